"""Numba kernels over pages of a mapping: a parallel touch that faults pages in.

Examples
--------
>>> import numpy as np
>>> from tdz_numba.files.page_kernels import touch_pages
>>> int(touch_pages(np.ones(10_000, np.uint8), 4096))
3
"""

from __future__ import annotations

import numpy as np
from numba import njit, prange

from ..jit.presets import PARALLEL

__all__ = ["touch_pages"]


@njit(**PARALLEL)
def touch_pages(buf, page):
    """Reads one byte of every ``page``-sized block of ``buf`` (in parallel), so that a
    mapped range is resident when it returns; returns the sum of the bytes read (so
    the reads cannot be optimized away)."""
    n = buf.size
    count = (n + page - 1) // page
    acc = np.zeros(count, np.int64)
    for i in prange(count):
        acc[i] = buf[i * page]
    return acc.sum()
