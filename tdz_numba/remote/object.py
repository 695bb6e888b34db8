"""One remote object read by ranges into a sparse local mapping: :class:`RemoteObject`.

Every remote reader (the ``.tdz`` index of :mod:`.read`, the foreign formats of
:mod:`.foreign`) keeps the object's bytes in one anonymous mapping the size of
the object (``MAP_NORESERVE``: pages exist only where bytes were placed) and
asks :meth:`RemoteObject.need` / :meth:`RemoteObject.need_spans` for the byte
ranges it is about to read. Only what is missing is fetched: the ranges are
merged (small gaps bridged), cut into parts (:func:`part_size`: 8 MiB; on S3 up to 32 MiB
on large reads, about one part per request slot) and fetched concurrently (at most :data:`~tdz_numba.remote.transports.CONCURRENCY` requests in flight), each
part written straight into its place.

How bytes come (the *transport*):

- ``http(s)://`` (fsspec's ``HTTPFileSystem``): aiohttp requests on fsspec's
  session, each body streamed into the mapping (one copy), a socket timeout
  on every request;
- ``s3://`` (s3fs): ``GetObject`` with ``Range`` and ``IfMatch``, each body streamed
  into the mapping as its chunks come (one copy);
- any other fsspec filesystem (``memory://``, ``gs://``, caching layers such as
  ``simplecache::``): ``fs.cat_ranges``;
- a seekable binary file object: ``seek`` + ``read`` under a lock.

The object is *pinned* at the first response: its ETag (and S3 version id),
else Last-Modified, and its size. HTTP and S3 requests carry ``If-Match`` and
every response's ETag and ``Content-Range`` total are compared with the pin;
other filesystems are asked for ``info()`` again after every batch (not the
caching layers: they read their local copy). A replaced object raises
:class:`~tdz_numba.RemoteError` naming the URL and the byte range, never a mix
of old and new bytes. Connection faults, truncated bodies and 5xx answers are
retried (:data:`ATTEMPTS` tries per part), then raise the same error.

Examples
--------
>>> import fsspec
>>> from tdz_numba.remote.object import RemoteObject
>>> with fsspec.open("memory://doc-obj/x.bin", "wb") as f:
...     _ = f.write(bytes(range(200)))
>>> obj = RemoteObject("memory://doc-obj/x.bin")
>>> obj.start(tail=16)                    # the first request: the last 16 bytes, size and pin
>>> obj.size, int(obj.buffer[-1]), obj.missing(0, obj.size)
(200, 199, [(0, 184)])
>>> obj.need(10, 20); obj.buffer[10:13].tolist(), obj.bytes_fetched
([10, 11, 12], 26)
>>> fsspec.filesystem("memory").rm("/doc-obj", recursive=True)
"""

from __future__ import annotations

import bisect
import mmap
import sys
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from ..errors import FileMissingError, InvalidArgumentError, RemoteError
from .transports import CONCURRENCY, _Missing, _pin_of, _Replaced, transport

__all__ = [
    "RemoteObject",
    "coalesce",
    "fewer",
    "MAX_GAP",
    "MAX_WASTE",
    "PART_BYTES",
    "MAX_PART_BYTES",
    "part_size",
    "ATTEMPTS",
]

#: Ranges farther apart than this are fetched separately (not bridged).
MAX_GAP = 4096
#: Bridged gaps may add at most this fraction of the bytes needed.
MAX_WASTE = 0.02
#: Smallest part of a split range: larger ranges are split, for concurrency (:func:`part_size`).
PART_BYTES = 8 << 20
#: Largest part of a large read: a batch is cut into about ``CONCURRENCY`` parts of
#: :data:`PART_BYTES` to this many bytes (:func:`part_size`).
MAX_PART_BYTES = 32 << 20
#: Attempts per ranged request before :class:`~tdz_numba.RemoteError`.
ATTEMPTS = 3
#: A fetch of at least this many bytes has its pages prepared while it travels (``_populate``).
POPULATE_MIN = 1 << 20

_NORESERVE = getattr(mmap, "MAP_NORESERVE", 0x4000 if sys.platform.startswith("linux") else 0)
_POPULATE_WRITE = getattr(mmap, "MADV_POPULATE_WRITE", 23 if sys.platform.startswith("linux") else None)


def coalesce(starts: np.ndarray, stops: np.ndarray, max_gap: int, max_waste: float) -> list[tuple[int, int]]:
    """Merged ``[start, stop)`` extents: overlapping and touching ones joined, then gaps of at
    most ``max_gap`` bridged, smallest first, while the bridged bytes stay within
    ``max_waste`` x the bytes needed.

    Examples
    --------
    >>> import numpy as np
    >>> from tdz_numba.remote.object import coalesce
    >>> coalesce(np.array([0, 100, 10, 5000]), np.array([10, 200, 20, 6000]), 4096, 0.01)
    [(0, 20), (100, 200), (5000, 6000)]
    >>> coalesce(np.array([0, 100]), np.array([10, 200]), 4096, 1.0)
    [(0, 200)]
    """
    starts = np.asarray(starts, np.int64)
    stops = np.maximum(np.asarray(stops, np.int64), starts)
    if not starts.size:
        return []
    order = np.argsort(starts, kind="stable")
    starts, stops = starts[order], np.maximum.accumulate(stops[order])
    gaps = starts[1:] - stops[:-1]  # > 0: bytes between an extent and the next
    small = np.nonzero((gaps > 0) & (gaps <= max_gap))[0]
    budget = max_waste * float((stops - starts).sum())
    n_bridge = int((np.cumsum(np.sort(gaps[small])) <= budget).sum())  # smallest gaps first
    keep = small[np.argsort(gaps[small], kind="stable")][:n_bridge]
    cut = gaps > 0
    cut[keep] = False
    first = np.concatenate(([0], np.nonzero(cut)[0] + 1))
    last = np.concatenate((np.nonzero(cut)[0], [starts.size - 1]))
    return list(zip(starts[first].tolist(), stops[last].tolist()))


def fewer(spans: list[tuple[int, int]], limit: int, max_gap: int) -> list[tuple[int, int]]:
    """``spans`` (sorted, disjoint) with their smallest gaps of at most ``max_gap`` bridged
    until at most ``limit`` remain: many tiny reads (local headers) cost fewer requests.

    Examples
    --------
    >>> from tdz_numba.remote.object import fewer
    >>> fewer([(0, 10), (20, 30), (100, 110), (5000, 5010)], 2, 1000)
    [(0, 110), (5000, 5010)]
    """
    if len(spans) <= limit:
        return spans
    gaps = np.array([spans[i + 1][0] - spans[i][1] for i in range(len(spans) - 1)], np.int64)
    order = np.argsort(gaps, kind="stable")
    order = order[gaps[order] <= max_gap][: len(spans) - limit]
    join = np.zeros(len(spans), bool)
    join[order + 1] = True
    out: list[tuple[int, int]] = []
    for (a, b), j in zip(spans, join.tolist()):
        if j:
            out[-1] = (out[-1][0], b)
        else:
            out.append((a, b))
    return out


def part_size(total: int, floor: int = PART_BYTES, cap: int = MAX_PART_BYTES) -> int:
    """The part size of a read of ``total`` bytes: about ``total / CONCURRENCY`` (whole MiB), at
    least ``floor`` and at most ``cap`` (a transport's ``max_part``: 32 MiB on S3, whose requests
    have a high fixed cost, 8 MiB elsewhere): every request slot busy with the fewest requests.

    Examples
    --------
    >>> from tdz_numba.remote.object import part_size
    >>> [part_size(n << 20) >> 20 for n in (1, 64, 128, 256, 4096)]
    [8, 8, 16, 32, 32]
    >>> part_size(256 << 20, cap=8 << 20) >> 20
    8
    """
    want = -(-int(total) // CONCURRENCY)
    want = -(-want // (1 << 20)) << 20
    return max(int(floor), min(int(cap), MAX_PART_BYTES, want))


# -- the object ------------------------------------------------------------------------------
class RemoteObject:
    """A remote object's bytes in a sparse mapping, fetched by range on demand (see the module).

    ``size``, ``buffer`` (uint8 numpy view of the mapping) and ``pin`` exist after
    :meth:`start`; ``requests`` and ``bytes_fetched`` count the traffic;
    ``progress``, when set, is called with the bytes of every part placed.
    """

    def __init__(self, target: Any, storage_options: dict[str, Any] | None = None) -> None:
        self.io = transport(target, storage_options)
        self.storage_options = storage_options
        self.label: str = self.io.label
        self.requests = 0
        self.bytes_fetched = 0
        self.size = -1
        self.pin: dict[str, Any] = {}
        self.progress: Callable[[int], Any] | None = None
        self._mmap: mmap.mmap | None = None
        self.buffer = np.empty(0, np.uint8)
        self._starts: list[int] = []
        self._stops: list[int] = []
        self._lock = threading.RLock()
        self._what: Callable[[int, int], str] | None = None
        self._entry: Callable[[int, int], str | None] | None = None

    @property
    def max_part(self) -> int:
        """The largest part of a large read over this object's transport (:func:`part_size`)."""
        return int(getattr(self.io, "max_part", PART_BYTES))

    # -- the first request -----------------------------------------------------------------
    def start(self, *, tail: int | None = None, head: int | None = None) -> None:
        """The first request: the last ``tail`` (or first ``head``) bytes; sets size and pin."""
        n = tail if tail is not None else head
        if n is None or n <= 0:
            raise InvalidArgumentError(f"start() needs tail or head > 0, got {n!r}")
        self.requests += 1
        try:
            data, a, size, pin = self.io.first(None if tail is not None else 0, n)
        except _Missing:
            raise FileMissingError(f"{self.label}: no such object", path=self.label) from None
        except FileNotFoundError:
            raise FileMissingError(f"{self.label}: no such object", path=self.label) from None
        except Exception as exc:
            raise RemoteError(
                f"{self.label}: the first request ({'last' if tail else 'first'} {n} bytes) failed: "
                f"{type(exc).__name__}: {str(exc)[:200]}",
                path=self.label,
            ) from exc
        if a + len(data) > size:  # a server ignoring the Range header sent everything
            data, a = data[-size:] if size else b"", 0
        self.size, self.pin = size, pin
        if size:
            self._mmap = mmap.mmap(-1, size, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS | _NORESERVE)
            self.buffer = np.frombuffer(self._mmap, dtype=np.uint8)
        if data:
            self.buffer[a : a + len(data)] = np.frombuffer(data, np.uint8)
            self._add(a, a + len(data))
        self.bytes_fetched += len(data)

    def stat(self) -> None:
        """Starts with one metadata request (``fs.info``: size and identity), no bytes."""
        self.requests += 1
        try:
            info = dict(self.io.fs.info(self.io.path))  # type: ignore[attr-defined]  # fsspec transports
        except FileNotFoundError:
            raise FileMissingError(f"{self.label}: no such object", path=self.label) from None
        except Exception as exc:
            raise RemoteError(f"{self.label}: cannot read its size: {exc}", path=self.label) from exc
        self.sized(int(info.get("size") or 0), _pin_of(info))

    def sized(self, size: int, pin: dict[str, Any]) -> None:
        """Starts without a request: the size and pin come from a listing (``fs.ls``)."""
        keep = (
            "ETag",
            "etag",
            "VersionId",
            "version_id",
            "generation",
        )  # (a listing's times differ from info()'s)
        self.size, self.pin = int(size), {k: v for k, v in pin.items() if k in keep}
        self.pin["size"] = self.size
        if self.size:
            self._mmap = mmap.mmap(-1, self.size, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS | _NORESERVE)
            self.buffer = np.frombuffer(self._mmap, dtype=np.uint8)

    # -- what is here ----------------------------------------------------------------------
    def _add(self, a: int, b: int) -> None:
        i = bisect.bisect_left(self._stops, a)
        j = bisect.bisect_right(self._starts, b)
        if i < j:
            a, b = min(a, self._starts[i]), max(b, self._stops[j - 1])
        self._starts[i:j] = [a]
        self._stops[i:j] = [b]

    def missing(self, a: int, b: int) -> list[tuple[int, int]]:
        """The parts of ``[a, b)`` not fetched yet."""
        out = []
        i = bisect.bisect_right(self._stops, a)
        pos = a
        while pos < b and i < len(self._starts):
            s, e = self._starts[i], self._stops[i]
            if s >= b:
                break
            if s > pos:
                out.append((pos, s))
            pos = max(pos, e)
            i += 1
        if pos < b:
            out.append((pos, b))
        return out

    def present(self, a: int, b: int) -> bool:
        """Whether every byte of ``[a, b)`` is here."""
        return not self.missing(a, b)

    @property
    def ranges(self) -> list[tuple[int, int]]:
        """The fetched ``[start, stop)`` ranges, merged and sorted."""
        return list(zip(self._starts, self._stops))

    # -- fetching ----------------------------------------------------------------------------
    def need(self, a: int, b: int) -> None:
        """Makes ``[a, b)`` (clipped to the object) present, fetching what is missing."""
        self.need_spans([(a, b)])

    def need_spans(
        self,
        spans: Sequence[tuple[int, int]],
        *,
        max_gap: int | None = None,
        max_waste: float | None = None,
        what: Callable[[int, int], str] | None = None,
        entry: Callable[[int, int], str | None] | None = None,
        part_bytes: int | None = None,
        landed: Callable[[int, int], Any] | None = None,
    ) -> None:
        """Makes every ``[a, b)`` of ``spans`` present: the missing bytes merged
        (:func:`coalesce`), cut into parts, fetched concurrently and placed; failed parts
        retried; :class:`~tdz_numba.RemoteError` naming the URL and range when they keep failing
        or the object was replaced. ``landed(a, b)`` is told of each part as soon as it is in
        place (from the transport's thread), while the others are still travelling."""
        with self._lock:
            todo = []
            for a, b in spans:
                a, b = max(0, int(a)), min(self.size, int(b))
                if b > a:
                    todo.extend(self.missing(a, b))
            if not todo:
                return
            gap = MAX_GAP if max_gap is None else max_gap
            todo = self._over_present(sorted(todo), gap)
            merged = coalesce(
                np.array([a for a, _ in todo]),
                np.array([b for _, b in todo]),
                gap,
                MAX_WASTE if max_waste is None else max_waste,
            )
            if part_bytes is None:
                part_bytes = part_size(sum(b - a for a, b in merged), cap=self.max_part)
            # (held for the fetch only: they are bound methods of the reader, and a reader that
            # holds this object would make a cycle that keeps the mapping until the collector runs)
            self._what, self._entry = what, entry
            try:
                self._fetch(merged, part_bytes, landed)
            finally:
                self._what = self._entry = None

    def _over_present(self, todo: list[tuple[int, int]], max_gap: int) -> list[tuple[int, int]]:
        """Missing parts (sorted) joined across gaps of at most ``max_gap`` bytes that are here
        already: fetching a few known bytes again costs less than a request (a member's
        headers fetched first, then the data of many members: one range, not one per member)."""
        if max_gap <= 0 or len(todo) < 2:
            return todo
        out = [todo[0]]
        for a, b in todo[1:]:
            pa, pb = out[-1]
            if 0 < a - pb <= max_gap and self.present(pb, a):
                out[-1] = (pa, max(pb, b))
            else:
                out.append((a, b))
        return out

    def _fetch(
        self, spans: list[tuple[int, int]], part_bytes: int, landed: Callable[[int, int], Any] | None = None
    ) -> None:
        parts = [(a, min(a + part_bytes, b)) for a0, b in spans for a in range(a0, b, part_bytes)]
        for attempt in range(ATTEMPTS):
            self.requests += len(parts)
            faults = self._populate(parts)
            try:
                got = self.io.fetch(parts, self.buffer, self.pin, landed)
            finally:
                if faults is not None:
                    faults.join()
            failed = []
            for (a, b), err in zip(parts, got):
                if err is None:
                    self._add(a, b)
                    self.bytes_fetched += b - a
                    if self.progress is not None:
                        self.progress(b - a)
                elif isinstance(err, (_Replaced, _Missing)):
                    self._raise(a, b, err, attempt + 1)
                else:
                    failed.append(((a, b), err))
            if not failed:
                break
            if attempt == ATTEMPTS - 1:
                (a, b), err = failed[0]
                self._raise(a, b, err, ATTEMPTS)
            parts = [p for p, _ in failed]
            time.sleep(0.05 * 4**attempt)
        if self.io.cheap_check:
            self.requests += 1
            try:
                self.io.check(self.pin)
            except (_Replaced, _Missing) as exc:
                self._raise(spans[0][0], spans[-1][1], exc, 1)

    def _raise(self, a: int, b: int, err: BaseException, tries: int) -> None:
        what, entry = self._what, self._entry
        which = f" ({what(a, b)})" if what is not None else ""
        if isinstance(err, _Replaced):
            why = f"the object changed since it was opened ({err}); reopen it"
        elif isinstance(err, _Missing):
            why = "the object is gone (404); it was deleted or replaced since it was opened"
        else:
            why = f"failed after {tries} attempts: {type(err).__name__}: {str(err)[:200]}"
        raise RemoteError(
            f"{self.label}: reading bytes [{a}, {b}){which}: {why}",
            path=self.label,
            entry=entry(a, b) if entry is not None else None,
            offset=a,
            expected=b - a,
        ) from err

    def _populate(self, parts: list[tuple[int, int]]) -> threading.Thread | None:
        """Faults in the pages of ``parts`` in a thread while the first bytes travel, part by part
        (``MADV_POPULATE_WRITE``, Linux >= 5.14), so that placing the bytes is a plain copy. The
        calls go through :func:`~tdz_numba.files.libc.madvise`, which releases the interpreter
        lock: ``mmap.madvise`` holds it (60 ms for 256 MiB), and the event loop placing the
        bytes could not run meanwhile (the first 64 MiB of an HTTP read landed after 120-150 ms,
        now 36-41 ms). No ``MADV_HUGEPAGE``: 2 MiB pages fault in 3x cheaper, but on a machine
        whose memory is page cache each costs a compaction stall (+10 per 256 MiB read measured,
        HTTP .tdz read-all 0.55-1.64x ``fs.cat`` with them, 1.14-1.65x without). None when not
        worth it or unsupported."""
        if not self.size or _POPULATE_WRITE is None or sum(b - a for a, b in parts) < POPULATE_MIN:
            return None
        from ..files import libc

        buffer = self.buffer  # the thread keeps the mapping alive until it is done
        page = mmap.PAGESIZE
        spans = [(a - a % page, b) for a, b in parts]

        def run() -> None:
            base = int(buffer.ctypes.data)
            for a, b in spans:
                if not libc.madvise(base + a, b - a, _POPULATE_WRITE):  # type: ignore[arg-type]
                    return  # (an older kernel: the copy faults the pages in)

        t = threading.Thread(target=run, name="tdz_numba-prefault", daemon=True)
        t.start()
        return t

    def read_all(self) -> None:
        """Fetches every missing byte of the object (concurrent parts)."""
        self.need(0, self.size)
