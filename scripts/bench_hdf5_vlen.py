"""Open and load times of an HDF5 file of variable-length strings (issue 23's vlen heap check).

Writes (once) a file of two datasets of ``--strings`` strings each, one contiguous and one in
gzip chunks, with h5py, then times ``tdz_numba.open(p)`` and ``tdz_numba.load(p)`` (best of
``--repeat``, after one untimed call of each) with whatever ``tdz_numba`` is on ``PYTHONPATH``::

    NUMBA_CACHE_DIR=$PWD/.numba_cache TDZ_NUMBA_KERNELS=always PYTHONPATH=$PWD \\
        .venv/bin/python scripts/bench_hdf5_vlen.py /tmp/vlen400k.h5
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable
from pathlib import Path

import h5py
import numpy as np

import tdz_numba


def write(p: Path, n: int) -> None:
    """Two datasets of ``n`` strings (15 to 45 characters): contiguous, and gzip chunks."""
    s = np.array([f"string number {i}" * (1 + i % 3) for i in range(n)], dtype=object)
    with h5py.File(p, "w") as f:
        f.create_dataset("contig", data=s, dtype=h5py.string_dtype())
        f.create_dataset("gz", data=s, dtype=h5py.string_dtype(), chunks=(10_000,), compression="gzip")


def best(fn: Callable[[], object], repeat: int) -> float:
    """The shortest of ``repeat`` timed calls of ``fn``."""
    times = []
    for _ in range(repeat):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return min(times)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("path", type=Path)
    ap.add_argument("--strings", type=int, default=200_000)
    ap.add_argument("--repeat", type=int, default=3)
    args = ap.parse_args()
    if not args.path.exists():
        write(args.path, args.strings)

    def opened() -> None:
        tdz_numba.open(args.path).close()

    def loaded() -> None:
        tdz_numba.load(args.path)

    opened()
    loaded()
    print(f"{tdz_numba.__file__}")
    print(
        f"open {best(opened, args.repeat):.3f} s  load {best(loaded, args.repeat):.3f} s  (best of {args.repeat})"
    )


if __name__ == "__main__":
    main()
