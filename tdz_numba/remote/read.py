"""Archives on object stores: ranged reads through fsspec (s3://, gs://, https://, memory://, ...).

A ``.tdz`` suits object stores: its central directory is at the end and
small, and every leaf sits at a known offset. :class:`RemoteIndex` fetches
the tail of the object once (one suffix-range request: the end records and,
for typical archives, the whole central directory), parses it with the same
:func:`~tdz_numba.zipfmt.kernels.central.parse_central` kernel as a local open,
and keeps the object's bytes in one sparse anonymous mapping the size of the
object: a range is fetched into its place there before any leaf views it, so
the whole :class:`~tdz_numba.Archive` machinery (levels, zero-copy leaves
over one buffer, parallel inflate) works unchanged. Nothing is fetched at
open but the tail; each level's ``meta.json`` when first reached (listing the
root: a second request); a leaf on
access (its local header and payload in one request). ``to_dict``/``load``
fetch every entry below the level at once: extents sorted, adjacent ones
merged, small gaps bridged, cut into parts fetched concurrently
(``fs.cat_ranges``). Every fetched STORED entry's CRC-32 is checked (remote
bytes are not trusted; ``verify=False`` skips it); compressed entries are
checked when inflated.

Saving (:mod:`tdz_numba.remote.write`) streams the writer's one sequential
pass to ``fs.open(url, "wb")`` without a local file.

Examples
--------
>>> import fsspec, torch, tdz_numba
>>> _ = tdz_numba.save({"a": {"b": torch.arange(4)}}, "memory://doc/x.tdz")
>>> with tdz_numba.open("memory://doc/x.tdz") as ar:
...     print(list(ar), ar["a/b"].tolist())
['a'] [0, 1, 2, 3]
>>> fsspec.filesystem("memory").rm("memory://doc/x.tdz")
"""

from __future__ import annotations

import os
import re
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from ..errors import (
    BadArchiveError,
    ChecksumError,
    TdzError,
)
from ..zipfmt import eocd, records
from ..zipfmt.index import ArchiveIndex
from .arrival import ArrivalCheck
from .object import RemoteObject, coalesce, fewer, part_size

__all__ = [
    "RemoteIndex",
    "is_remote",
    "TAIL_BYTES",
]

#: Bytes read from the end of an object at open (end records + central directory in one request).
TAIL_BYTES = 1 << 20
#: Ranges farther apart than this are fetched separately (not bridged).
MAX_GAP = 4096
#: Bridged gaps may add at most this fraction of the bytes needed.
MAX_WASTE = 0.02
#: Largest single ranged request of a bulk fetch (larger extents are split for concurrency).
PART_BYTES = 8 << 20
#: A batch of local headers is cut into at most this many requests, by bridging gaps of at
#: most :data:`HEAD_GAP` bytes (members of small leaves are read through; big ones are not).
HEAD_RANGES, HEAD_GAP = 64, 1 << 20
#: At most this many local headers are fetched ahead by :meth:`RemoteIndex.payload_offset`.
HEAD_AHEAD = 64
#: Levels reached one by one before every level's ``meta.json`` is fetched in one batch.
WALK_LEVELS = 4
_L = records.Local
_LH = int(_L.SIZEOF)  # a local header's fixed part
#: Bytes of local extra fields a foreign zip's header fetch allows for (torch pads to 64).
_LOCAL_EXTRA = 256

_URL = re.compile(r"^[A-Za-z][A-Za-z0-9+.\-]*::?//|^[A-Za-z][A-Za-z0-9+.\-]*::")


def is_remote(target: Any) -> bool:
    """Whether ``target`` is an fsspec URL (``proto://...``, not ``file://``) or a binary file object.

    Examples
    --------
    >>> from tdz_numba.remote.read import is_remote
    >>> is_remote("s3://bucket/x.tdz"), is_remote("/tmp/x.tdz"), is_remote("file:///tmp/x.tdz")
    (True, False, False)
    """
    if isinstance(target, str):
        return bool(_URL.match(target)) and not target.startswith("file://")
    return (
        hasattr(target, "read") and hasattr(target, "seek") and not isinstance(target, (bytes, os.PathLike))
    )


# -- the index -------------------------------------------------------------------------------
class RemoteIndex(ArchiveIndex):
    """An :class:`~tdz_numba.zipfmt.index.ArchiveIndex` over a remote object, fetched on demand.

    ``buffer`` is a sparse anonymous mapping of the object's size; entries are
    fetched into place (:meth:`fetch`) before anything reads them.
    ``requests`` and ``bytes_fetched`` count the traffic.
    """

    def __init__(
        self,
        target: Any,
        *,
        storage_options: dict[str, Any] | None = None,
        verify: bool = True,
        tail_bytes: int = TAIL_BYTES,
    ) -> None:
        obj = target if isinstance(target, RemoteObject) else RemoteObject(target, storage_options)
        if obj.size < 0:
            obj.start(tail=tail_bytes)
        elif not obj.present(obj.size - 22, obj.size):  # opened by a head read: the tail now
            obj.need(obj.size - tail_bytes, obj.size)
        self.obj = obj
        label = obj.label
        self.path = label  # type: ignore[assignment]  # a URL, not a local path
        self.writable = False
        self.verify = verify
        size = self.size = obj.size
        if not size:
            raise BadArchiveError(f"{label}: empty object, not a zip archive", path=label)
        self._mmap = obj._mmap  # type: ignore[assignment]  # the object's sparse mapping
        self.buffer = obj.buffer
        last = obj.ranges[-1] if obj.ranges else (size, size)
        self.tail_start = last[0] if last[1] == size else size  # the bytes of the tail read
        self._torch = None
        self._untyped = None
        self._rows = None
        self.end = end = eocd.find_end_record(self.buffer, label)
        if end.cd_offset < self.tail_start:  # a central directory larger than the tail read
            self._get([(end.cd_offset, self.tail_start)], lambda a, b: "the central directory")
            self.tail_start = end.cd_offset
        self._finish_open(end)
        self._ready = np.zeros(len(self.names), np.bool_)  # fetched, header parsed, CRC checked

    def _finish_open(self, end: eocd.EndRecord) -> None:
        """The part of :class:`ArchiveIndex`'s open that follows the mapping."""
        self._index_entries(end, False)
        self._limit = self.table["next_offset"]

    @property
    def requests(self) -> int:
        """Requests made so far (tail, ranges; retries included)."""
        return self.obj.requests

    @property
    def bytes_fetched(self) -> int:
        """Bytes fetched so far."""
        return self.obj.bytes_fetched

    # -- fetching ----------------------------------------------------------------------------
    def _names_in(self, a: int, b: int) -> str:
        hoff = self.table["header_offset"]
        rows = np.nonzero((hoff < b) & (self._limit > a))[0][:3].tolist()
        text = ", ".join(repr(self.names[i]) for i in rows)
        more = int(((hoff < b) & (self._limit > a)).sum()) - len(rows)
        return f"entries {text}" + (f" (+{more} more)" if more > 0 else "") if rows else "no entry"

    def _first_in(self, a: int, b: int) -> str | None:
        hoff = self.table["header_offset"]
        rows = np.nonzero((hoff < b) & (self._limit > a))[0]
        return self.names[int(rows[0])] if rows.size else None

    def _get(
        self,
        spans: list[tuple[int, int]],
        what: Callable[[int, int], str] | None = None,
        part_bytes: int | None = None,
        landed: Callable[[int, int], Any] | None = None,
    ) -> None:
        """Fetches ``[start, stop)`` spans (already coalesced) into :attr:`buffer`, in parts
        (:func:`~tdz_numba.remote.object.part_size`: :data:`PART_BYTES` or more on large reads)
        fetched concurrently (:meth:`RemoteObject.need_spans`); ``landed`` is told of each part."""
        self.obj.need_spans(
            spans,
            max_gap=0,
            max_waste=0.0,
            what=what or self._names_in,
            entry=self._first_in,
            part_bytes=part_bytes or part_size(sum(b - a for a, b in spans), PART_BYTES, self.obj.max_part),
            landed=landed,
        )

    def _spans(self, rows: np.ndarray) -> list[tuple[int, int]]:
        """Coalesced extents of ``rows``: adjacent merged, gaps up to :data:`MAX_GAP` bridged
        while the bridged bytes stay under :data:`MAX_WASTE` of the bytes needed."""
        starts = self.table["header_offset"][rows]
        stops = np.maximum(self._limit[rows], starts)
        inside = starts >= self.tail_start  # already here with the tail read
        starts, stops = starts[~inside], np.minimum(stops[~inside], self.tail_start)
        if not starts.size:
            return []
        return coalesce(starts, stops, MAX_GAP, MAX_WASTE)

    def fetch(self, rows: Sequence[int] | np.ndarray) -> None:
        """Makes entries ``rows`` readable: fetches what is not here, checks each local
        header and (unless ``verify=False``) the CRC-32 of STORED entries. A fetch of more
        than one part checks each entry as soon as the parts it lies in have landed
        (:class:`~tdz_numba.remote.arrival.ArrivalCheck`), while the others travel."""
        rows = np.asarray(rows, np.int64).reshape(-1)
        rows = np.unique(rows[~self._ready[rows]])
        if not rows.size:
            return
        spans = self._spans(rows)
        part = part_size(sum(b - a for a, b in spans), PART_BYTES, self.obj.max_part)
        if not self.verify or sum(b - a for a, b in spans) <= part:  # one request: check after
            self._get(spans, part_bytes=part)
            self._settle(rows)
            return
        rows = rows[np.argsort(self.table["header_offset"][rows], kind="stable")]
        starts = self.table["header_offset"][rows]
        check = ArrivalCheck(
            starts,
            np.maximum(self._limit[rows], starts),
            self.obj.ranges,
            lambda k: self._check(rows[k], True),
        )
        try:
            self._get(spans, part_bytes=part, landed=check.landed)
        except BaseException:
            check.stop()
            raise
        done = rows[check.finish()]
        self._ready[done] = True
        self._settle(np.setdiff1d(rows, done))  # (none, unless bytes came another way)

    def _settle(self, rows: np.ndarray) -> None:
        """Entries ``rows`` are here: their local headers checked, then their CRC-32s; marked ready.
        Once every entry is ready, every local header is checked in one kernel pass."""
        if rows.size:
            if int(self._ready.sum()) + rows.size == len(self.names) and not self.local_checked:
                ArchiveIndex.check_all(self)  # everything is here now: every local header at once
            self._check(rows)
            self._ready[rows] = True
        elif self._ready.all() and not self.local_checked:
            ArchiveIndex.check_all(self)

    def _check(self, rows: np.ndarray, serial: bool = False) -> None:
        """Checks entries ``rows`` (here): local headers, then (``verify``) STORED CRC-32s: on
        every core, or ``serial`` in this thread only (while parts travel: the parallel kernel's
        idle threads would spin on the cores the transfer needs, after each of many launches)."""
        for i in rows.tolist():
            ArchiveIndex.payload_offset(self, i)  # signature, name, bounds (once)
        if self.verify:
            from ..zipfmt.checksums import stored_crcs

            t = self.table
            stored = rows[(t["method"][rows] == records.STORED) & (t["csize"][rows] > 0)]
            if stored.size:
                crcs = self._serial_crcs(stored) if serial else stored_crcs(self, stored)
                bad = np.nonzero(crcs != t["crc"][stored])[0]
                if bad.size:
                    i = int(stored[bad[0]])
                    raise ChecksumError(
                        f"{self.path}: entry {self.names[i]!r}: CRC-32 mismatch: recorded "
                        f"{int(t['crc'][i]):#010x}, computed {int(stored_crcs(self, stored[bad[:1]])[0]):#010x} "
                        f"(the object changed since it was opened, or its bytes are corrupt)",
                        path=self.path,
                        entry=self.names[i],
                        offset=int(t["payload_offset"][i]),
                        expected=int(t["crc"][i]),
                    )

    def _serial_crcs(self, rows: np.ndarray) -> np.ndarray:
        """CRC-32s of the STORED entries ``rows`` in this thread (zlib-ng, the GIL released)."""
        from zlib_ng import zlib_ng

        t, buf = self.table, self.buffer
        spans = zip(t["payload_offset"][rows].tolist(), t["csize"][rows].tolist())
        return np.fromiter((zlib_ng.crc32(buf[a : a + n]) for a, n in spans), np.uint32, rows.size)

    def fetch_prefix(self, prefix: str) -> None:
        """Fetches every entry under directory ``prefix`` ("" for all) in one coalesced batch."""
        rows = (
            [i for i, n in enumerate(self.names) if n.startswith(prefix)]
            if prefix
            else range(len(self.names))
        )
        self.fetch(np.fromiter(rows, np.int64))

    def predict_payloads(self, alignment: int = 64) -> bool:
        """Fills every payload offset without reading the local headers, as ``torch.save``'s
        writer places them (the payload at the first multiple of ``alignment`` after the
        header, its name and a 4-byte padding field), when every local header read so far
        agrees; False (nothing changed) otherwise, or for zip64 members. The predicted
        members are :attr:`predicted`; :meth:`check_predicted` checks one once its bytes are here."""
        cols = self._cols.copy()
        hoff, nlen = cols[:, records.Col.HEADER_OFFSET], cols[:, records.Col.NAME_LEN]
        if (
            not len(hoff)
            or int(hoff.max()) >= 0xFFFFFFFF
            or int(cols[:, records.Col.CSIZE].max()) >= 0xFFFFFFFF
        ):
            return False
        pred = (hoff + _LH + nlen + 4 + alignment - 1) // alignment * alignment
        known = np.nonzero(self._ready)[0]
        if not known.size or not np.array_equal(cols[known, records.Col.PAYLOAD_OFFSET], pred[known]):
            return False
        self.predicted = ~self._ready.copy()
        cols[:, records.Col.PAYLOAD_OFFSET] = pred
        cols[:, records.Col.LOCAL_EXTRA_LEN] = pred - (hoff + _LH + nlen)
        self._cols = cols
        self._rows = None
        self.local_checked = True
        return True

    def check_predicted(self, i: int) -> None:
        """Checks member ``i``'s local header (fetched) against its predicted payload offset."""
        t = self.table
        h, n = int(t["header_offset"][i]), int(t["name_len"][i])
        head = bytes(self.obj.buffer[h : h + _LH])  # (the reader may have closed the index)
        name_len = int.from_bytes(head[_L.NAME_LEN : _L.NAME_LEN + 2], "little")
        extra = int.from_bytes(head[_L.EXTRA_LEN : _L.EXTRA_LEN + 2], "little")
        sig = int.from_bytes(head[:4], "little")
        if sig != records.LOCAL_SIG or name_len != n or h + _LH + n + extra != int(t["payload_offset"][i]):
            raise BadArchiveError(
                f"{self.path}: entry {self.names[i]!r}: its local header (at {h}) does not place the "
                f"payload at {int(t['payload_offset'][i])} as torch.save's writer does; the file is "
                f"damaged or was written by another tool: load a local copy",
                path=self.path,
                entry=self.names[i],
                offset=h,
            )
        if self.predicted is not None:
            self.predicted[i] = False

    def fetch_levels(self) -> None:
        """Fetches every level's ``meta.json`` in one concurrent batch (once): walking the tree
        (``tdz tree``, ``keys()`` of every level) then costs no request per level."""
        if getattr(self, "_levels_fetched", False):
            return
        self._levels_fetched = True
        rows = np.array([i for i, n in enumerate(self.names) if n.endswith("meta.json")], np.int64)
        rows = rows[~self._ready[rows]] if rows.size else rows
        if rows.size:
            self._get(fewer(self._spans(rows), HEAD_RANGES, HEAD_GAP))
            self.fetch(rows)

    def payload_offset(self, i: int) -> int:
        """Payload offset of entry ``i``: its local header fetched (not its payload: the bytes
        come with :meth:`fetch`, :meth:`raw` or :meth:`read_bytes`) and checked. Headers that
        are asked for one after another (``tdz tree``, ``info`` of many leaves) come in
        growing concurrent batches: the next unread headers in entry order, 2, 4, ... 64 of
        them while the entries asked for follow each other."""
        offset = int(self.table["payload_offset"][i])
        if offset >= 0:
            return offset
        self._ahead = min(2 * self._ahead, HEAD_AHEAD) if i == self._last + 1 else 1
        self._last = i
        a, b = self.header_span(i)
        if not self.obj.present(a, b):  # (fetched ahead already: no request)
            unread = np.nonzero(self.table["payload_offset"][i:] < 0)[0][: self._ahead] + i
            spans = [self.header_span(int(k)) for k in unread.tolist()]
            self.obj.need_spans(spans, max_gap=0, max_waste=0.0, what=self._names_in, entry=self._first_in)
        self.fetch_header(i)  # (a local extra field longer than guessed: the whole entry)
        return ArchiveIndex.payload_offset(self, i)

    def raw(self, e: Any) -> np.ndarray:
        """An entry's stored bytes (fetched first, CRC-32 checked when STORED, unless
        :attr:`raw_fetches` is False)."""
        if self.raw_fetches:
            self.fetch([e.index])
        return super().raw(e)

    def read_bytes(self, name: str) -> bytes:
        """An entry's bytes (``meta.json``): the entry fetched in one range first."""
        i = self.row(name)
        if i is not None:
            self.fetch([i])
        return super().read_bytes(name)

    def header_span(self, i: int, after: int = 0) -> tuple[int, int]:
        """``[start, stop)`` of entry ``i``'s local header (its name and up to 256 bytes of
        extra field) and ``after`` more bytes, within the entry."""
        t = self.table
        h = int(t["header_offset"][i])
        return h, min(h + _LH + int(t["name_len"][i]) + _LOCAL_EXTRA + after, max(h, int(self._limit[i])))

    def fetch_header(self, i: int) -> None:
        """Fetches entry ``i``'s local header (:meth:`header_span`), or the whole entry when its
        extra field is longer than guessed."""
        a, b = self.header_span(i)
        self.obj.need(a, b)
        extra = int.from_bytes(bytes(self.obj.buffer[a + _L.EXTRA_LEN : a + _L.EXTRA_LEN + 2]), "little")
        if a + _LH + int(self.table["name_len"][i]) + extra > b:
            self.obj.need(a, int(self._limit[i]))

    #: Local headers fetched by the next :meth:`payload_offset` that needs one (it doubles),
    #: and the entry that one read last.
    _ahead, _last = 1, -2
    #: True: :meth:`raw` fetches the entry first; False: the reader fetches the bytes it reads
    #: (a remote ``.npz``: a member's headers, its data when the tensor is made).
    raw_fetches = True

    #: None: :meth:`check_all` fetches every entry; an int: only each local header and that
    #: many payload bytes after it (payload offsets: ``tdz info``, a foreign zip's open).
    heads: int | None = 0
    #: Members whose payload offset was predicted, their local header not checked yet.
    predicted: np.ndarray | None = None

    def check_all(self) -> None:
        if self.heads is None:
            self.fetch(np.arange(len(self.names)))
            super().check_all()
            return
        if self.local_checked:
            return
        t = self.table
        hoff = t["header_offset"]
        name_len = np.fromiter((len(n.encode()) for n in self.names), np.int64, len(self.names))
        stops = np.minimum(hoff + _LH + name_len + _LOCAL_EXTRA + self.heads, np.maximum(self._limit, hoff))
        metas = np.fromiter((n.endswith("meta.json") for n in self.names), bool, len(self.names))
        stops[metas] = np.maximum(self._limit[metas], hoff[metas])  # every level's meta.json whole
        self._get(fewer(coalesce(hoff, stops, MAX_GAP, MAX_WASTE), HEAD_RANGES, HEAD_GAP))
        try:
            super().check_all()
            if metas.any():
                self.fetch(np.nonzero(metas)[0])  # here already: CRCs checked, marked ready
        except TdzError:  # a local extra field longer than guessed: the whole entries, then again
            self.heads = None
            self.check_all()
