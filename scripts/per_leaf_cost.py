"""Per-leaf cost of a load above the bytes: 64 MiB of float32 as 1 leaf and as 100,000 leaves.

``python scripts/per_leaf_cost.py`` (from the repository root, in its .venv) saves both with
tdz_numba and safetensors into ``/tmp/tdz_per_leaf`` and prints, per operation, the median of 5
timed runs (garbage collector run before and off during each) and ``(T(100,000) - T(1)) / 100,000``:
the cost one more leaf adds to the same bytes. ``sum only`` is torch's cost of summing leaves that
are already mapped, the same for every format.
"""

import gc
import os
import time

from safetensors.torch import load_file, save_file

import tdz_numba
from tdz_numba.bench.leafsweep import _sum, make_leaves

OUT = "/tmp/tdz_per_leaf"
N = 100_000


def median(fn, k=5):
    fn()
    times = []
    for _ in range(k):
        gc.collect()
        gc.disable()
        t = time.perf_counter()
        out = fn()
        times.append(time.perf_counter() - t)
        del out
        gc.enable()
    return sorted(times)[k // 2]


def measure(n):
    """Median seconds of each operation on 64 MiB in ``n`` leaves."""
    nested, flat = make_leaves(n, 64)
    p, q = f"{OUT}/l{n}.tdz", f"{OUT}/l{n}.safetensors"
    tdz_numba.save(nested, p)
    save_file(flat, q)
    del nested, flat
    out = {
        "tdz_numba load": median(lambda: tdz_numba.load(p)),
        "tdz_numba load+sum": median(lambda: (_sum(tdz_numba.load(p)),)),
        "safetensors load_file": median(lambda: load_file(q)),
        "safetensors load_file+sum": median(lambda: (_sum(load_file(q)),)),
    }
    tree = tdz_numba.load(p)
    out["sum only (mapped)"] = median(lambda: _sum(tree))
    return out


def main():
    os.makedirs(OUT, exist_ok=True)
    os.environ.setdefault("TDZ_NUMBA_KERNELS", "always")  # the kernels' steady state, as tdz bench
    one, many = measure(1), measure(N)
    for key in one:
        a, b = one[key], many[key]
        print(
            f"{key:26s} N=1 {a * 1e3:8.1f} ms  N={N:,} {b * 1e3:8.1f} ms  "
            f"per leaf above N=1: {(b - a) / N * 1e6:6.2f} us"
        )


if __name__ == "__main__":
    main()
