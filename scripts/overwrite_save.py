"""Saving over the previous file (a checkpoint loop): tdz_numba ``durable=False`` and the default
(fsync) against safetensors' ``save_file``, 256 MiB ``flat``, the three alternating per round
(rotated order), medians. The old file's freeing (``files.tempfiles.replace``) is waited for
outside the timed region, as the page cache is synced.

Usage: ``python scripts/overwrite_save.py DIR ROUNDS`` (e.g. ``/tmp 9``).
"""

from __future__ import annotations

import os
import statistics
import sys
import time

import torch
from safetensors.torch import save_file

import tdz_numba
from tdz_numba.files import tempfiles


def main(directory: str, rounds: int) -> None:
    tree = {f"w{i}": torch.randn(2048, 4096) for i in range(8)}
    paths = [os.path.join(directory, n) for n in ("ow.tdz", "ow2.tdz", "ow.safetensors")]
    cells = {
        "tdz durable=False": lambda: tdz_numba.save(tree, paths[0], durable=False),
        "tdz durable=True": lambda: tdz_numba.save(tree, paths[1]),
        "safetensors": lambda: save_file(tree, paths[2]),
    }
    for fn in cells.values():  # the files to save over
        fn()
    res: dict[str, list[float]] = {k: [] for k in cells}
    names = list(cells)
    for r in range(rounds):
        for k in names[r % 3 :] + names[: r % 3]:
            os.sync()
            tempfiles.wait_released(30)
            t = time.perf_counter()
            cells[k]()
            res[k].append(time.perf_counter() - t)
    os.sync()
    for k, v in res.items():
        print(f"{k:20s} {statistics.median(v) * 1e3:7.1f} ms  runs {min(v) * 1e3:.0f}..{max(v) * 1e3:.0f}")
    for p in paths:
        os.unlink(p)


if __name__ == "__main__":
    main(sys.argv[1], int(sys.argv[2]))
