"""A load with the garbage collector on, as in a user's script: 20,000 leaves of 10 KiB.

``python scripts/load_with_gc.py [REV_DIR]`` (from the repository root, in its .venv) saves the
seed's small workload as ``.tdz`` and safetensors into ``/tmp/tdz_gc_load``, then times
``tdz_numba.load`` of each in fresh processes, the collector on, and counts the collections that
ran inside the load. With ``REV_DIR`` (another checkout, e.g. ``git worktree add /tmp/old REV``)
the processes alternate between the two trees and both columns are printed: the figure of
``load``'s collector pause (``tdz/sources.paused_gc``) is this script against the commit before it.
"""

import json
import os
import statistics
import subprocess
import sys
from pathlib import Path

OUT = Path("/tmp/tdz_gc_load")
CHILD = r"""
import gc, json, sys, time
sys.path.insert(0, ".")
import tdz_numba
out = {}
for p in sys.argv[1:]:
    tdz_numba.load(p)  # imports and kernels: not timed
    times, passes = [], []
    cb = lambda phase, info: passes.append(1) if phase == "start" else None
    for _ in range(5):
        gc.callbacks.append(cb)
        t = time.perf_counter()
        tree = tdz_numba.load(p)
        times.append(time.perf_counter() - t)
        gc.callbacks.remove(cb)
        del tree
    out[p] = (sorted(times)[2], len(passes) / 5)
print(json.dumps(out))
"""


def main() -> None:
    from safetensors.torch import save_file

    import tdz_numba
    from tdz_numba.bench.readers import make_tensors

    OUT.mkdir(exist_ok=True)
    files = [OUT / "small.tdz", OUT / "small.safetensors"]
    if not all(f.exists() for f in files):
        tensors = make_tensors("small", 195.3125)
        tdz_numba.save(tensors, files[0])
        save_file(tensors, str(files[1]))
    trees = {"this tree": Path.cwd()}
    if len(sys.argv) > 1:
        trees["other tree"] = Path(sys.argv[1])
    got: dict[str, dict[str, list[tuple[float, float]]]] = {t: {} for t in trees}
    for r in range(4):
        for name in list(trees)[:: 1 if r % 2 == 0 else -1]:
            res = subprocess.run(
                [sys.executable, "-c", CHILD, *map(str, files)],
                cwd=trees[name],
                capture_output=True,
                text=True,
                check=True,
                env=dict(os.environ, NUMBA_CACHE_DIR=str(trees[name] / ".numba_cache")),
            )
            for p, v in json.loads(res.stdout.splitlines()[-1]).items():
                got[name].setdefault(Path(p).suffix, []).append(tuple(v))
    for name, per in got.items():
        for fmt, rows in per.items():
            ms = statistics.median(v[0] for v in rows) * 1e3
            passes = statistics.median(v[1] for v in rows)
            print(f"{name:10s} {fmt:13s} load {ms:7.1f} ms  collections inside the load {passes:5.1f}")


if __name__ == "__main__":
    main()
