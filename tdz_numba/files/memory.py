"""Memory control of mapped payloads: evict, prefetch, residency, and O_DIRECT reads.

A leaf whose payload covers whole pages can be dropped from memory without
touching its neighbours (``madvise(MADV_DONTNEED)`` on exactly the pages that lie
inside it), brought in ahead of use (``MADV_WILLNEED``, optionally a parallel
touch that returns once the pages are resident), and its residency measured
(``/proc/self/pagemap``). These functions work on one ``mmap.mmap`` of a whole file and a
byte range of it; :class:`~tdz_numba.Archive` calls them per leaf.

Examples
--------
>>> import mmap, tempfile, os
>>> from tdz_numba.files import memory
>>> n = 4 * memory.PAGE_SIZE
>>> with tempfile.TemporaryFile() as f:
...     _ = f.write(os.urandom(n)); f.flush(); os.fsync(f.fileno())
...     mm = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_COPY)
...     memory.prefetch(mm, 0, n, touch=True)
...     before = memory.resident(mm, 0, n)
...     dropped = memory.evict(mm, 0, n, file=f.fileno())
...     print(before, dropped == n, memory.resident(mm, 0, n))
1.0 True 0.0
"""

from __future__ import annotations

import ctypes
import mmap
import os
import sys
import threading
from collections.abc import Sequence

import numpy as np

from ..errors import InvalidArgumentError, UnsupportedError
from . import libc
from .pagecache import read_full

__all__ = [
    "advise_huge_mapping",
    "evict_span",
    "PAGE_SIZE",
    "inner_pages",
    "evict",
    "prefetch",
    "readahead",
    "read_spans",
    "wait_readahead",
    "ReadAhead",
    "READAHEAD_PIECE",
    "readahead_on",
    "resident",
    "is_evictable",
    "read_direct",
    "aligned_empty",
]

#: This machine's page size (4096 on x86-64; 16 KiB or 64 KiB on some ARM machines).
PAGE_SIZE = mmap.PAGESIZE


def advise_huge_mapping(mm: mmap.mmap) -> bool:
    """``MADV_HUGEPAGE`` on the whole mapping ``mm`` of a file: its faults read (and map) 2 MiB
    folios; whether the advice was taken (False where the platform has no such advice or the
    kernel refuses it, e.g. without THP: advice only, never an error).

    >>> with mmap.mmap(-1, PAGE_SIZE) as mm:
    ...     isinstance(advise_huge_mapping(mm), bool)
    True
    """
    advice = getattr(mmap, "MADV_HUGEPAGE", None)
    if advice is None:
        return False
    try:
        mm.madvise(advice)
    except (OSError, ValueError):  # (a kernel without THP: EINVAL)
        return False
    return True


def inner_pages(offset: int, nbytes: int, page: int = PAGE_SIZE) -> tuple[int, int]:
    """``(start, length)`` of the whole pages that lie inside ``[offset, offset + nbytes)``.

    A leaf's neighbours share its first and last partial pages, so only the pages
    entirely inside it may be evicted. ``length`` is 0 when no whole page fits.

    >>> inner_pages(64, 3 * 4096, 4096)
    (4096, 8192)
    """
    if offset < 0 or nbytes < 0:
        raise InvalidArgumentError(f"bad byte range: offset {offset}, nbytes {nbytes}")
    start = -(-offset // page) * page
    stop = (offset + nbytes) // page * page
    return start, max(0, stop - start)


def is_evictable(offset: int, nbytes: int, page: int = PAGE_SIZE) -> bool:
    """Whether ``[offset, offset + nbytes)`` starts on a page boundary and covers whole pages
    (the tail page may be partial only at the end of the file)."""
    return nbytes > 0 and offset % page == 0 and inner_pages(offset, nbytes, page)[1] > 0


def _address(mm: mmap.mmap) -> int:
    buf = np.frombuffer(mm, dtype=np.uint8)
    return buf.ctypes.data


def _check(mm: mmap.mmap, offset: int, nbytes: int) -> None:
    if offset < 0 or nbytes < 0 or offset + nbytes > len(mm):
        raise InvalidArgumentError(
            f"byte range [{offset}, {offset + nbytes}) outside the mapping ({len(mm)} bytes)"
        )


def evict(
    mm: mmap.mmap,
    offset: int,
    nbytes: int,
    *,
    file: str | os.PathLike | int | None = None,
    shared: bool = False,
) -> int:
    """Drops the pages that lie entirely inside ``[offset, offset + nbytes)`` from memory.

    The pages are unmapped from this process (``madvise(MADV_DONTNEED)``) and, when
    ``file`` (the mapped file's path or an open descriptor) is given, dropped from the
    page cache too (``posix_fadvise(POSIX_FADV_DONTNEED)``; measured here:
    ``MADV_PAGEOUT`` left them cached), so that :func:`resident` reads 0.0 after.
    A ``shared`` (``mode="r+"``) mapping is flushed to the file first, so no written
    data is lost. For a private mapping (``mode="r"``) in-place changes to those
    pages are discarded: the file's bytes come back on the next access. Pages a
    neighbour shares (the partial first and last page) are never dropped. Where the
    kernel has mapped the file with a 2 MiB huge page, unmapping part of it unmaps all
    of it: neighbours' unmodified pages in it come back from the page cache on their
    next access (mappings are not made with ``MADV_NOHUGEPAGE``, which slowed a cold
    read-all of 1 GiB here from 729 to 787 ms, median of 9).
    Returns the number of bytes dropped.
    """
    _check(mm, offset, nbytes)
    start, length = inner_pages(offset, nbytes)
    if not length:
        return 0
    if shared:
        mm.flush(start, length)
    mm.madvise(mmap.MADV_DONTNEED, start, length)
    if file is not None:
        fd = file if isinstance(file, int) else os.open(file, os.O_RDONLY)
        try:
            os.posix_fadvise(fd, start, length, os.POSIX_FADV_DONTNEED)
        finally:
            if not isinstance(file, int):
                os.close(fd)
    return length


def evict_span(address: int, nbytes: int, mappings: Sequence[tuple[int, int]]) -> int:
    """Drops from this process the whole pages of ``[address, address + nbytes)`` (``MADV_DONTNEED``)
    when they lie inside one of the read-only file ``mappings`` (``(start, stop)`` addresses): clean
    pages of a file mapping come back from the file if touched again. Returns the bytes dropped.

    Examples
    --------
    >>> import mmap, numpy as np
    >>> mm = mmap.mmap(-1, 4 * PAGE_SIZE)
    >>> base = np.frombuffer(mm, np.uint8).ctypes.data
    >>> evict_span(base + 1, 3 * PAGE_SIZE, [(base, base + 4 * PAGE_SIZE)]) == 2 * PAGE_SIZE
    True
    >>> evict_span(base, PAGE_SIZE, [])  # not inside a mapping we were given: kept
    0
    """
    start, length = inner_pages(address, nbytes)
    if not length or not any(a <= start and start + length <= b for a, b in mappings):
        return 0
    return length if libc.madvise(start, length, mmap.MADV_DONTNEED) else 0


def prefetch(mm: mmap.mmap, offset: int, nbytes: int, *, touch: bool = False) -> None:
    """Asks the kernel to read ``[offset, offset + nbytes)`` ahead (``MADV_WILLNEED``).

    With ``touch=True`` every page is also read (in parallel, one byte per page,
    by a Numba kernel), and the call returns once the range is resident.
    """
    _check(mm, offset, nbytes)
    if not nbytes:
        return
    start = offset // PAGE_SIZE * PAGE_SIZE
    mm.madvise(mmap.MADV_WILLNEED, start, offset + nbytes - start)
    if touch:
        from ..jit.presets import run_parallel
        from .page_kernels import touch_pages

        buf = np.frombuffer(mm, dtype=np.uint8)
        run_parallel(touch_pages, buf[offset : offset + nbytes], PAGE_SIZE)


#: ``readahead`` skips hints below this many bytes in all (page faults are as good there).
READAHEAD_MIN = 1 << 20
#: Bytes one ``MADV_POPULATE_READ`` call of the background read-ahead covers (it checks for a
#: stop between two such calls, and skips a piece already in the page cache).
READAHEAD_PIECE = 8 << 20
#: ``MADV_POPULATE_READ`` (Linux >= 5.14): faults pages in as a read would, without touching them.
_POPULATE_READ = getattr(mmap, "MADV_POPULATE_READ", 22 if sys.platform.startswith("linux") else None)
_RUNNING: set[ReadAhead] = set()
_RUNNING_LOCK = threading.Lock()


class ReadAhead:
    """A background read of byte ranges of a mapping, in file order (see :func:`readahead`).

    ``nbytes`` is what it reads (the merged ranges, within the memory budget); :meth:`join`
    waits for it, :meth:`stop` ends it after the piece it is reading.

    >>> import mmap
    >>> mm = mmap.mmap(-1, 4 * PAGE_SIZE)
    >>> ra = ReadAhead(mm, [(0, 4 * PAGE_SIZE)])
    >>> ra.join(10), ra.nbytes == 4 * PAGE_SIZE
    (True, True)
    """

    def __init__(self, mm: mmap.mmap | np.ndarray, spans: Sequence[tuple[int, int]]) -> None:
        self.nbytes = int(sum(b - a for a, b in spans))
        self._stop = threading.Event()
        # the thread holds a view of the mapping: it stays mapped until the read ends
        buf = np.frombuffer(mm, dtype=np.uint8)
        self._thread = threading.Thread(
            target=self._run, args=(buf, list(spans)), name="tdz_numba-readahead", daemon=True
        )
        with _RUNNING_LOCK:
            _RUNNING.add(self)
        self._thread.start()

    def _run(self, buf: np.ndarray, spans: list[tuple[int, int]]) -> None:
        try:
            base = buf.ctypes.data
            for a, b in spans:
                for start in range(a, b, READAHEAD_PIECE):
                    if self._stop.is_set():
                        return
                    length = min(READAHEAD_PIECE, b - start)
                    if _cached(base + start, length):
                        continue  # warm: the caller's faults map it as cheaply
                    if not libc.madvise(base + start, length, _POPULATE_READ):  # type: ignore[arg-type]
                        return  # (unmapped, an I/O error: the caller's access reports it)
        finally:
            with _RUNNING_LOCK:
                _RUNNING.discard(self)

    def join(self, timeout: float | None = None) -> bool:
        """Waits for the read to end (at most ``timeout`` seconds); whether it ended."""
        self._thread.join(timeout)
        return not self._thread.is_alive()

    def stop(self) -> None:
        """Ends the read after the piece being read."""
        self._stop.set()


#: :func:`_cached` looks at one page in this many bytes (a 2 MiB folio is cached whole or not at all).
_SAMPLE = 2 << 20


def _cached(address: int, length: int) -> bool:
    """Whether a page-aligned range of a file mapping looks cached: one page in every
    :data:`_SAMPLE` bytes is in the page cache (``mincore``; a whole-range ``mincore`` walks
    every page and cost a warm load of 512 MiB several ms). False when it cannot tell."""
    mincore = libc.function("mincore")
    if mincore is None:
        return False
    vec = (ctypes.c_ubyte * 1)()
    for a in range(address, address + length, _SAMPLE):
        if mincore(ctypes.c_void_p(a), ctypes.c_size_t(PAGE_SIZE), vec) != 0 or not vec[0] & 1:
            return False
    return True


_SUPPORTED: list[bool] = []


def _populate_supported() -> bool:
    """Whether this kernel takes ``MADV_POPULATE_READ`` (tried once on an anonymous page)."""
    if not _SUPPORTED:
        ok = False
        if _POPULATE_READ is not None:
            with mmap.mmap(-1, PAGE_SIZE) as probe:
                ok = libc.madvise(_address(probe), PAGE_SIZE, _POPULATE_READ)
        _SUPPORTED.append(ok)
    return _SUPPORTED[0]


def wait_readahead(timeout: float | None = None) -> bool:
    """Waits for every background read-ahead of this process (:func:`readahead`) to end;
    whether all ended within ``timeout`` seconds.

    >>> wait_readahead(10)
    True
    """
    with _RUNNING_LOCK:
        running = list(_RUNNING)
    return all(r.join(timeout) for r in running)


def readahead_on() -> bool:
    """Whether :func:`readahead` reads anything: ``TDZ_NUMBA_READAHEAD=1`` (off by default), so a
    caller skips gathering the ranges when it is off.

    >>> os.environ.get("TDZ_NUMBA_READAHEAD") is None and not readahead_on()
    True
    """
    return os.environ.get("TDZ_NUMBA_READAHEAD", "0") == "1"


def readahead(
    mm: mmap.mmap | np.ndarray,
    offsets: np.ndarray | Sequence[int],
    sizes: np.ndarray | Sequence[int],
    *,
    gap: int = 1 << 20,
    min_bytes: int = READAHEAD_MIN,
) -> int:
    """Reads the byte ranges about to be handed out ahead, in file order, in the background,
    when ``TDZ_NUMBA_READAHEAD=1`` (off by default: see ``docs/memory.md``).

    Ranges (negative offsets or sizes are skipped) are sorted and merged when less than
    ``gap`` bytes apart (:func:`read_spans`); a thread (:class:`ReadAhead`) then faults them
    in piece by piece (``MADV_POPULATE_READ`` of :data:`READAHEAD_PIECE` bytes, skipping
    pieces already cached), whatever order the caller touches them in: the reads go
    forward through the file, and in a mapping advised by
    :func:`~tdz_numba.files.loadadvice.advise_whole_file` the
    page cache fills with 2 MiB folios. It returns at once. Nothing is read when the ranges
    hold fewer than ``min_bytes`` bytes, and no more than half the memory available now.
    Returns the bytes the background read covers (:func:`wait_readahead` waits for it): 0
    when none was started. Off, nothing is hinted either: ``MADV_WILLNEED``, which this
    function gave before, reads at most ``max(read_ahead_kb, max_sectors_kb)`` per call
    (8 MiB here, whatever the length asked) and in 4 KiB folios, which later mapped reads
    of the file pay for. On a kernel before 5.14 (no ``MADV_POPULATE_READ``) it is still
    the fallback when turned on, and is not counted.

    Examples
    --------
    >>> import mmap, tempfile
    >>> from tdz_numba.files.memory import readahead, wait_readahead
    >>> os.environ["TDZ_NUMBA_READAHEAD"] = "1"
    >>> with tempfile.TemporaryFile() as f:
    ...     _ = f.write(bytes(4 << 20)); f.flush()
    ...     with mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as mm:
    ...         n = readahead(mm, [0, 2 << 20], [1 << 20, 1 << 20], gap=0)
    ...         _ = wait_readahead()
    >>> del os.environ["TDZ_NUMBA_READAHEAD"]
    >>> n
    2097152
    """
    if not readahead_on():  # off: no sort or merge to pay for
        _same_lengths(offsets, sizes)
        return 0
    spans = read_spans(len(mm), offsets, sizes, gap=gap, min_bytes=min_bytes)
    if not spans:
        return 0
    if _populate_supported():
        return ReadAhead(mm, spans).nbytes
    for start, stop in spans:  # a hint only: never an error
        try:
            mm.madvise(mmap.MADV_WILLNEED, start, stop - start)  # type: ignore[union-attr]
        except (AttributeError, OSError, ValueError):
            break
    return 0


def read_spans(
    size: int,
    offsets: np.ndarray | Sequence[int],
    sizes: np.ndarray | Sequence[int],
    *,
    gap: int = 1 << 20,
    min_bytes: int = READAHEAD_MIN,
) -> list[tuple[int, int]]:
    """The ``(start, stop)`` spans :func:`readahead` reads of a mapping of ``size`` bytes: the
    ranges in bounds, sorted, merged when less than ``gap`` bytes apart, starts on pages,
    within half the memory available now; none below ``min_bytes`` bytes in all.

    >>> read_spans(10 << 20, [5 << 20, 0, -1], [1 << 20, 1 << 20, 8], gap=0, min_bytes=0)
    [(0, 1048576), (5242880, 6291456)]
    """
    _same_lengths(offsets, sizes)
    off = np.asarray(offsets, np.int64).reshape(-1)
    nb = np.asarray(sizes, np.int64).reshape(-1)
    keep = (off >= 0) & (nb > 0) & (off <= size) & (nb <= size - np.minimum(off, size))
    off, nb = off[keep], nb[keep]
    if int(nb.sum()) < min_bytes or not off.size:
        return []
    order = np.argsort(off, kind="stable")
    off, end = off[order], (off + nb)[order]
    end = np.maximum.accumulate(end)
    starts = np.flatnonzero(np.r_[True, off[1:] > end[:-1] + gap])
    try:
        budget = os.sysconf("SC_AVPHYS_PAGES") * PAGE_SIZE // 2
    except (ValueError, OSError):  # pragma: no cover - no sysconf
        budget = 1 << 30
    spans: list[tuple[int, int]] = []
    for a, b in zip(starts.tolist(), [*starts[1:].tolist(), off.size]):
        start = int(off[a]) // PAGE_SIZE * PAGE_SIZE
        length = min(int(end[b - 1]) - start, budget)
        if length <= 0:
            break
        spans.append((start, start + length))
        budget -= length
    return spans


def _same_lengths(offsets: np.ndarray | Sequence[int], sizes: np.ndarray | Sequence[int]) -> None:
    """Refuses ``offsets`` and ``sizes`` of different lengths (:func:`read_spans`' ranges)."""
    n, m = np.size(offsets), np.size(sizes)
    if n != m:
        raise InvalidArgumentError(f"readahead: {n} offsets but {m} sizes")


def resident(mm: mmap.mmap, offset: int, nbytes: int) -> float:
    """Fraction (0.0 to 1.0) of the pages of ``[offset, offset + nbytes)`` that are in this
    process's memory (a page counts when any of its bytes belongs to the range).

    Read from ``/proc/self/pagemap`` (the page's "present" bit): exactly what
    :func:`evict` drops and :func:`prefetch` brings in, page by page. ``mincore``,
    the fallback where pagemap is unreadable, reports the page cache instead, whose
    granularity is the file system's folio (measured here: ext4 keeps 64 KiB folios,
    so a leaf's neighbour can keep a shared folio cached).
    """
    _check(mm, offset, nbytes)
    if not nbytes:
        return 1.0
    base = _address(mm)
    start = offset // PAGE_SIZE * PAGE_SIZE
    length = offset + nbytes - start
    pages = -(-length // PAGE_SIZE)
    first = (base + start) // PAGE_SIZE
    try:
        fd = os.open("/proc/self/pagemap", os.O_RDONLY)
    except OSError:
        fd = -1
    if fd >= 0:
        try:
            raw = os.pread(fd, 8 * pages, 8 * first)
        finally:
            os.close(fd)
        if len(raw) == 8 * pages:
            entries = np.frombuffer(raw, dtype=np.uint64)
            return float(np.count_nonzero(entries >> np.uint64(63))) / pages
    vec = (ctypes.c_ubyte * pages)()
    mincore = libc.function("mincore")
    if mincore is None or mincore(ctypes.c_void_p(base + start), ctypes.c_size_t(length), vec) != 0:
        err = ctypes.get_errno()
        raise UnsupportedError(f"mincore failed: {os.strerror(err)}")
    arr = np.frombuffer(vec, dtype=np.uint8)  # type: ignore[call-overload]  # ctypes arrays are buffers; numpy stubs miss them
    return float(np.count_nonzero(arr & 1)) / pages


def aligned_empty(nbytes: int, align: int = PAGE_SIZE) -> np.ndarray:
    """A uint8 buffer whose start is a multiple of ``align`` (for O_DIRECT)."""
    raw = np.empty(nbytes + align, np.uint8)
    shift = (-raw.ctypes.data) % align
    return raw[shift : shift + nbytes]


def read_direct(
    path: str | os.PathLike, ranges: Sequence[tuple[int, int]], *, direct: bool = True
) -> tuple[list[np.ndarray], bool]:
    """Reads byte ranges ``(offset, nbytes)`` of a file into new owned buffers.

    With ``direct=True`` the file is opened with ``O_DIRECT`` (bypassing the page
    cache) and each range is read in whole aligned blocks into a page-aligned
    buffer; ranges are returned as views of those buffers. Where the file system
    refuses ``O_DIRECT`` (tmpfs, some FUSE mounts) it falls back to buffered
    ``preadv``. Returns ``(buffers, used_direct)``.
    """
    flags = os.O_RDONLY
    use_direct = direct and hasattr(os, "O_DIRECT")
    fd = -1
    if use_direct:
        try:
            fd = os.open(path, flags | os.O_DIRECT)
        except OSError:
            use_direct = False
    if fd < 0:
        fd = os.open(path, flags)
    out: list[np.ndarray] = []
    try:
        size = os.fstat(fd).st_size
        for offset, nbytes in ranges:
            if offset < 0 or nbytes < 0 or offset + nbytes > size:
                raise InvalidArgumentError(
                    f"{path}: range [{offset}, {offset + nbytes}) outside the file ({size} bytes)"
                )
            if use_direct:
                lo = offset // PAGE_SIZE * PAGE_SIZE
                hi = min(-(-(offset + nbytes) // PAGE_SIZE) * PAGE_SIZE, -(-size // PAGE_SIZE) * PAGE_SIZE)
                buf = aligned_empty(max(hi - lo, PAGE_SIZE))
                try:
                    got = read_full(fd, buf[: hi - lo], lo)
                except OSError:  # EINVAL: this file system takes no O_DIRECT after all
                    os.close(fd)
                    fd = os.open(path, flags)
                    use_direct = False
                else:
                    if got < offset + nbytes - lo:
                        raise InvalidArgumentError(f"{path}: short read at offset {offset}")
                    out.append(buf[offset - lo : offset - lo + nbytes])
                    continue
            buf = np.empty(nbytes, np.uint8)
            if read_full(fd, buf, offset) < nbytes:
                raise InvalidArgumentError(f"{path}: short read at offset {offset}")
            out.append(buf)
    finally:
        os.close(fd)
    return out, use_direct
