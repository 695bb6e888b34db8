"""tensordict 0.15.3 plain vs ``tdz_numba.tensordict.enable()``: save, load_memmap, load+read.

Usage: ``python scripts/td_enable_bench.py [--leaves 2000] [--size-mib 64] [--repeat 5]``

Workload: ``--size-mib`` of random float32 as N leaves nested in groups of 20
(``tdz_numba.bench.leafsweep.make_leaves``) in a ``TensorDict(batch_size=[])``.
Per variant (plain tensordict, enable()) and op, the median of ``--repeat``
timed runs after one warm-up, garbage collector off during each run:

* ``save``: ``td.save(path.tdz)`` (fresh path each run);
* ``memmap``: ``td.memmap(dir)`` (directory, plain only: enable() does not change it);
* ``load``: ``TensorDict.load_memmap(path.tdz)``;
* ``load+read``: the same and ``float(t.sum())`` of every leaf.
"""

from __future__ import annotations

import argparse
import gc
import shutil
import statistics
import tempfile
import time
from pathlib import Path


def _time(fn, repeat, setup=None):
    fn()  # warm-up
    out = []
    for _ in range(repeat):
        if setup is not None:
            setup()
        gc.collect()
        gc.disable()
        t0 = time.perf_counter()
        fn()
        out.append(time.perf_counter() - t0)
        gc.enable()
    return statistics.median(out) * 1e3


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--leaves", type=int, default=2000)
    ap.add_argument("--size-mib", type=float, default=64)
    ap.add_argument("--repeat", type=int, default=5)
    args = ap.parse_args(argv)
    import torch
    from tensordict import TensorDict

    import tdz_numba.tensordict as tdt
    from tdz_numba.bench.leafsweep import make_leaves

    nested, _ = make_leaves(args.leaves, args.size_mib)
    td = TensorDict(nested, batch_size=[])
    tmp = Path(tempfile.mkdtemp(prefix="tdbench"))
    res: dict[tuple[str, str], float] = {}
    try:
        for variant in ("plain", "enabled"):
            if variant == "enabled":
                tdt.enable()
            else:
                tdt.disable()
            p = tmp / f"{variant}.tdz"

            def save(p=p):
                td.save(p)

            def rm(p=p):
                p.unlink(missing_ok=True)

            res[variant, "save"] = _time(save, args.repeat, rm)
            td.save(p)

            def load(p=p):
                return TensorDict.load_memmap(p)

            def load_read(p=p):
                t = TensorDict.load_memmap(p)
                return sum(float(v.sum()) for v in t.values(True, True))

            res[variant, "load"] = _time(load, args.repeat)
            res[variant, "load+read"] = _time(load_read, args.repeat)
            if variant == "plain":
                d = tmp / "dir"

                def memmap(d=d):
                    td.memmap(d, existsok=True)

                def rmd(d=d):
                    shutil.rmtree(d, ignore_errors=True)

                res["plain", "memmap(dir)"] = _time(memmap, args.repeat, rmd)
        tdt.disable()
        # check: same values both ways
        a = TensorDict.load_memmap(tmp / "plain.tdz")
        with tdt.enabled():
            b = TensorDict.load_memmap(tmp / "plain.tdz")
        assert (a == b).all()
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    print(
        f"{args.leaves} float32 leaves in groups of 20, {args.size_mib} MiB, median of {args.repeat} (ms); "
        f"torch {torch.__version__}"
    )
    print(f"{'op':<12}{'plain':>10}{'enabled':>10}{'ratio':>8}")
    for op in ("save", "load", "load+read"):
        pl, en = res["plain", op], res["enabled", op]
        print(f"{op:<12}{pl:>10.1f}{en:>10.1f}{pl / en:>7.2f}x")
    print(f"{'memmap(dir)':<12}{res['plain', 'memmap(dir)']:>10.1f}")


if __name__ == "__main__":
    main()
