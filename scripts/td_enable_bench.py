"""tensordict 0.15.3 plain vs ``tdz_numba.tensordict.enable()``: save, load_memmap, load+read.

Usage: ``python scripts/td_enable_bench.py [--leaves 2000] [--size-mib 64] [--repeat 5]``

Workload: ``--size-mib`` of random float32 as N leaves nested in groups of 20
(``tdz_numba.bench.leafsweep.make_leaves``) in a ``TensorDict(batch_size=[])``.
Per op, plain tensordict and enable() run alternately (one run of each per
round, so that a busy machine slows both alike), ``--repeat`` rounds after one
warm-up; medians, garbage collector off during each run:

* ``save``: ``td.save(path.tdz)`` (fresh path each run; tensordict's save ends
  with a ``load_memmap`` of the archive, both variants);
* ``load``: ``TensorDict.load_memmap(path.tdz)`` (of the archive tensordict wrote);
* ``load+read``: the same and ``float(t.sum())`` of every leaf;
* ``read`` alone (the sums over an already loaded result) for reference: it
  bounds the load+read ratio.
"""

from __future__ import annotations

import argparse
import gc
import shutil
import statistics
import tempfile
import time
from pathlib import Path


def _once(fn, setup=None) -> float:
    if setup is not None:
        setup()
    gc.collect()
    gc.disable()
    try:
        t0 = time.perf_counter()
        fn()
        return time.perf_counter() - t0
    finally:
        gc.enable()


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
    src = tmp / "x.tdz"
    variants = {"plain": tdt.disable, "enabled": tdt.enable}
    times: dict[tuple[str, str], list[float]] = {}
    try:
        td.save(src)  # tensordict's own archive
        target = tmp / "out.tdz"

        def save():
            td.save(target)

        def rm():
            target.unlink(missing_ok=True)

        def load():
            return TensorDict.load_memmap(src)

        def load_read():
            t = TensorDict.load_memmap(src)
            return sum(float(v.sum()) for v in t.values(True, True))

        loaded = load()
        leaves = list(loaded.values(True, True))

        def read():
            return sum(float(v.sum()) for v in leaves)

        ops = {"save": (save, rm), "load": (load, None), "load+read": (load_read, None)}
        for op, (fn, setup) in ops.items():
            for switch in variants.values():
                switch()
                _once(fn, setup)  # warm-up
            for _ in range(args.repeat):
                for name, switch in variants.items():
                    switch()
                    times.setdefault((name, op), []).append(_once(fn, setup))
        tdt.disable()
        read_ms = statistics.median(_once(read) for _ in range(args.repeat)) * 1e3
        a = TensorDict.load_memmap(src)  # check: the same values both ways
        with tdt.enabled():
            b = TensorDict.load_memmap(src)
        assert (a == b).all()
    finally:
        tdt.disable()
        shutil.rmtree(tmp, ignore_errors=True)
    print(
        f"{args.leaves} float32 leaves in groups of 20, {args.size_mib} MiB; medians of {args.repeat} "
        f"alternating runs (ms); torch {torch.__version__}"
    )
    print(f"{'op':<12}{'plain':>10}{'enabled':>10}{'ratio':>8}")
    for op in ops:
        pl, en = (statistics.median(times[v, op]) * 1e3 for v in ("plain", "enabled"))
        print(f"{op:<12}{pl:>10.1f}{en:>10.1f}{pl / en:>7.2f}x")
    print(f"{'read alone':<12}{read_ms:>10.1f}  (sums of the loaded leaves, both variants)")


if __name__ == "__main__":
    main()
