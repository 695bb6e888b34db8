"""The read advice of a file's mapping while an opener scans the headers between its leaves.

An opener that finds its leaves by walking headers spread through the file (an ``.npz``'s
``.npy`` headers, HDF5 object headers, ONNX ``TensorProto`` fields) touches one page per
leaf. Under the kernel's default advice each of those faults reads ``read_ahead_kb`` around
the page (8 MiB on this machine), so the lazy open of a 512 MiB model read 180-408 MiB to list
146 tensors. Inside :class:`header_scan` a large file's mapping reads only the pages the scan
touches (``MADV_RANDOM``) where its headers lie at least :data:`SPARSE_SPACING` apart, and the
kernel's default read-around where they are closer (there reading the whole file in large
requests costs less than a synchronous page read per header); the default comes back when the
scan ends, for the leaves' own reads.

>>> header_scan(None).active
False
"""

from __future__ import annotations

import mmap
from typing import Any

import numpy as np

from .loadadvice import whole_file_load

__all__ = ["SPARSE_SPACING", "SMALL_FILE", "header_scan", "mean_spacing", "pages_only"]

#: Mean bytes from one header to the next from which a scan reads only the pages it touches.
#: Measured here, cold lazy opens of ``.npz`` files of 200 MiB (``read_ahead_kb`` 8192, ~100 us
#: a synchronous page read, ~2 GB/s sequential): headers 10 KiB apart 1,669 ms page by page
#: against 204 ms read around; 64 KiB 345 against 388; 256 KiB 77 against 223; 1 MiB 21 against
#: 188. The crossover is a disk's latency times its bandwidth (~64 KiB here, ~0.5 MiB on cloud
#: block storage, ~1 MiB on a spinning disk): 1 MiB never loses much anywhere.
SPARSE_SPACING = 1 << 20

#: Files smaller than this are scanned with the default advice (read whole in a few requests).
SMALL_FILE = 16 << 20


def mean_spacing(offsets: np.ndarray, size: int) -> float:
    """Mean bytes between consecutive headers at ``offsets`` (any order) of a file of ``size``
    bytes: the span they cover over their count less one (one header: the file's size).

    >>> mean_spacing(np.array([0, 4096, 2048]), 1 << 20), mean_spacing(np.array([7]), 100)
    (2048.0, 100.0)
    """
    n = int(offsets.size)
    if n < 2:
        return float(size)
    return float(int(offsets.max()) - int(offsets.min())) / (n - 1)


class header_scan:  # noqa: N801 - a context manager used as a function
    """Inside it, the mapping of a file of at least :data:`SMALL_FILE` bytes reads only the
    pages a fault touches (``MADV_RANDOM``) until the scan learns that its headers lie closer
    than :data:`SPARSE_SPACING` (:meth:`decide`), then the kernel's default; the default
    again on exit. ``f``: a :class:`~tdz_numba.tdz.sources.MappedFile` (or anything with
    ``_mmap`` and ``size``), a remote file's or a missing one (None) advised nothing; with
    ``in_load=False``, nothing either inside a whole-file load
    (:func:`~tdz_numba.files.loadadvice.whole_file_mappings`: HDF5, whose load then reads the
    whole file forward, measured 455 ms cold with its headers' pages read first, one by one,
    against 349 without, medians of 9). Advice only: a kernel that refuses it changes nothing,
    and nothing raises.

    >>> class F:  # a mapped file of 32 MiB
    ...     size = 32 << 20
    ...     _mmap = mmap.mmap(-1, size)
    >>> with header_scan(F()) as scan:
    ...     sparse = scan.active
    ...     scan.decide(4096.0)  # headers 4 KiB apart: read around from here on
    ...     dense = scan.active
    >>> sparse, dense
    (True, False)
    """

    __slots__ = ("_mm", "active")

    def __init__(self, f: Any, in_load: bool = True) -> None:
        mm = None
        if f is not None and not getattr(f, "remote", False) and getattr(f, "size", 0) >= SMALL_FILE:
            mm = getattr(f, "_mmap", None)
        if not in_load and whole_file_load():
            mm = None
        self._mm: mmap.mmap | None = mm
        self.active = False

    def __enter__(self) -> header_scan:
        self._advise(True)
        return self

    def __exit__(self, *exc: object) -> None:
        self._advise(False)

    def decide(self, spacing: float) -> None:
        """The headers lie ``spacing`` bytes apart on average (:func:`mean_spacing`): page
        by page from here on where that is at least :data:`SPARSE_SPACING`, else read around."""
        self._advise(spacing >= SPARSE_SPACING)

    def _advise(self, random: bool) -> None:
        mm = self._mm
        if mm is None or random == self.active:
            return
        try:
            mm.madvise(mmap.MADV_RANDOM if random else mmap.MADV_NORMAL)
        except (OSError, ValueError, AttributeError):  # (closed, or a platform without the advice)
            self._mm = None
            return
        self.active = random


class pages_only:  # noqa: N801 - a context manager used as a function
    """Inside it, a fault on the pages of bytes ``[start, stop)`` of the mapping ``mm`` reads only
    the page it touches (``MADV_RANDOM`` on those pages; ``MADV_NORMAL`` again on exit): one
    header read far from the others (a zip local header when an archive's entries lie at least
    :data:`SPARSE_SPACING` apart), without ``read_ahead_kb`` around it. ``tdz tree`` of a cold
    512 MiB model read 373 MiB of it through its 146 headers' faults; 0.4 MiB so. A page in the
    cache costs nothing more; advice only: ``mm`` None, closed or refusing it changes nothing.

    >>> mm = mmap.mmap(-1, 1 << 20)
    >>> with pages_only(mm, 5000, 5100):
    ...     mm[5000]
    0
    """

    __slots__ = ("_mm", "_start", "_length")

    def __init__(self, mm: mmap.mmap | None, start: int, stop: int) -> None:
        page = mmap.PAGESIZE
        self._start = max(0, start) // page * page
        self._mm = mm
        try:
            self._length = min(stop, len(mm)) - self._start if mm is not None else 0
        except ValueError:  # (closed)
            self._length = 0

    def __enter__(self) -> None:
        self._advise(mmap.MADV_RANDOM)

    def __exit__(self, *exc: object) -> None:
        self._advise(mmap.MADV_NORMAL)

    def _advise(self, advice: int) -> None:
        if self._mm is None or self._length <= 0:
            return
        try:
            self._mm.madvise(advice, self._start, self._length)
        except (OSError, ValueError, AttributeError):  # (closed, or a platform without the advice)
            self._mm = None
