"""Archives that grow: new entries and a new central directory after the old end records, a
commit that is one small write, and the repair of a file an append left uncommitted.

The layout after an append of entries ``N`` to a file of ``S0`` bytes::

    [old entries][old central directory][old end records]   <- bytes 0 .. S0, never rewritten
    [gap < alignment][N's local headers and payloads]
    [central directory: the old records kept, byte for byte, then N's][end records]   <- S1

No byte before ``S0`` is written, so a mapping of the old file (an ``Archive`` opened
before the append, in this process or another) keeps reading the old state. The old
central directory and end records become dead space that zip readers never visit:
they locate the central directory from the last end record.

Crash safety (``kill -9`` at any instant). The commit is the last write of the final
``K`` bytes of the file (``K`` <= 98, the end records, inside one page: a write that does
not cross a page is done entirely or not at all when the process is killed):

1. the *temporary tail*: a copy of the old end-of-central-directory record (and of its
   zip64 locator, which points to the old zip64 end record where it is) is written at
   ``S1 - len`` in one small write. The file now ends with an end record that names the
   old central directory: our reader opens the old state (it accepts a gap between a
   central directory and its end record); zipfile and ``unzip`` see a central directory
   that does not end at the end record and refuse the file until
   :func:`repair_file` truncates it to ``S0`` (the old file, byte for byte);
2. the new entries and the new central directory (all but its last ``K`` bytes) are
   written into the hole below the temporary tail (``fsync`` when durable);
3. the commit: the last ``K`` bytes (the new end records) replace the temporary tail
   in one write, then ``fsync``.

A kill before step 1 leaves the old file; between 1 and 3, the old state behind a
temporary tail (readable by tdz_numba, repaired by truncation); after 3, the new state.
An exception before the commit truncates the file back to ``S0``. Appends to one file
are serialized by an exclusive ``flock``.

Examples
--------
>>> import io, zipfile
>>> from tdz_numba.zipfmt.grow import round_up
>>> round_up(100, 64), round_up(128, 64)
(128, 128)
"""

from __future__ import annotations

import contextlib
import fcntl
import mmap
import os
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, replace
from typing import Any

import numpy as np

from ..errors import BadArchiveError, InternalError
from . import digest as _digests
from . import packers
from .entry import Entry
from .eocd import EndRecord, end_record_position, find_end_record
from .payload import write_payloads, write_segments, write_threads
from .records import END_SIG, END_STRUCT, ZIP64_END_SIG, ZIP64_LOCATOR_SIG, ZIP64_LOCATOR_STRUCT

__all__ = [
    "State",
    "Appended",
    "Repaired",
    "central_records",
    "locked",
    "read_state",
    "append_entries",
    "Batch",
    "plan_batch",
    "repair_file",
    "round_up",
    "COMMIT_MAX",
]

#: Page size the commit write must not cross (the smallest page of the platforms served).
PAGE = mmap.PAGESIZE
#: Largest commit write: zip64 end record (56) + locator (20) + end record (22).
COMMIT_MAX = 98


def round_up(x: int, a: int) -> int:
    """``x`` rounded up to a multiple of ``a`` (``a`` >= 1)."""
    return -(-x // a) * a


@contextlib.contextmanager
def locked(path: str | os.PathLike, *, write: bool = True) -> Iterator[int]:
    """A descriptor on ``path`` holding an exclusive ``flock`` (shared when not ``write``):
    appends, compactions and repairs of one file wait for each other."""
    fd = os.open(path, os.O_RDWR if write else os.O_RDONLY)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX if write else fcntl.LOCK_SH)
        yield fd
    finally:
        os.close(fd)  # (releases the lock)


@dataclass(frozen=True)
class State:
    """The committed state of an archive as its last end record describes it."""

    size: int  # file size
    end: EndRecord
    eocd_offset: int  # offset of the end-of-central-directory record
    locator: bytes  # the zip64 end locator before it (b"": none)
    eocd: bytes  # the end record, comment excluded

    @property
    def temp_tail(self) -> bytes:
        """The end records of this state with no comment: what an append puts at the end of the
        file while it writes (the locator points to the zip64 end record where it is)."""
        return self.locator + self.eocd[:-2] + b"\0\0"

    @property
    def cd_end(self) -> int:
        return self.end.cd_offset + self.end.cd_size


def read_state(buf: Any, label: str) -> State:
    """The end records of ``buf`` (the whole file, bytes-like), checked."""
    end = find_end_record(buf, label)
    size = len(buf)
    lo = max(0, size - (END_STRUCT.size + 0xFFFF))
    pos = end_record_position(bytes(buf[lo:size]))
    if pos < 0:  # pragma: no cover - find_end_record found one
        raise BadArchiveError(f"{label}: no end-of-central-directory record", path=label)
    at = lo + pos
    loc = at - ZIP64_LOCATOR_STRUCT.size
    locator = b""
    if end.zip64 and loc >= 0 and bytes(buf[loc : loc + 4]) == ZIP64_LOCATOR_SIG:
        locator = bytes(buf[loc:at])
    return State(size, end, at, locator, bytes(buf[at : at + END_STRUCT.size]))


def central_records(buf: Any, state: State, central_offsets: Sequence[int]) -> list[bytes]:
    """The raw central records of an archive, in central-directory order, from the offsets of
    their starts (the index's ``central_offset`` column)."""
    offs = sorted(int(o) for o in central_offsets)
    stops = offs[1:] + [state.cd_end]
    return [bytes(buf[a:b]) for a, b in zip(offs, stops)]


@dataclass(frozen=True)
class Appended:
    """What an append wrote: where the new entries start, the new central directory and size."""

    old_size: int
    data_offset: int
    cd_offset: int
    cd_size: int
    size: int
    count: int


def _tail_layout(data_end: int, cd_size: int, count: int, keep: int) -> tuple[int, bytes, int]:
    """``(cd_offset, end_records, K)``: the central directory placed at ``data_end`` or a few
    bytes after, so that the last ``K`` bytes of the file (the end records, at least ``keep``
    bytes) lie within one page."""
    cd_offset = data_end
    for _ in range(4):
        z64 = packers.needs_zip64_end(count, cd_offset, cd_size)
        end = packers.end_records(count, cd_offset, cd_size, z64)
        k = max(len(end), keep)
        size = cd_offset + cd_size + len(end)
        r = size % PAGE
        if r == 0 or r >= k:
            return cd_offset, end, k
        cd_offset += k - r
    raise InternalError("no central directory position keeps the end records within one page")


@dataclass
class Batch:
    """Entries planned at a file offset: local headers and payloads to write, then their
    central records (:meth:`write`)."""

    prep: Any  # writer.Prepared, its plan shifted to the batch's offset
    fields: dict[str, Any]
    has_data: np.ndarray
    start: int  # offset of the first local header
    data_end: int  # where the batch's last payload ends
    cd_len: int  # bytes of its central records without digest blocks (central_len: with them)

    @property
    def central_len(self) -> int:
        """Bytes of its central records, the digest blocks planned included."""
        return self.cd_len + _digests.planned_len(self.prep.digests)

    def write(self, fd: int, num_threads: int | None = None, writeback: bool = False) -> bytes:
        """Writes the local headers and payloads (CRCs computed as they are written); returns
        the central records."""
        if self.prep.n:
            write_payloads(
                fd, self.prep, self.fields, self.has_data, write_threads(num_threads), _NoBar(), writeback
            )
        return self.central()

    def central(self) -> bytes:
        """The central records of the batch (CRCs as :attr:`fields` holds them)."""
        p = self.prep.plan
        cd = packers.central_directory(
            p.names,
            header_offset=p.header_offset,
            zip64=p.central_zip64,
            more=_digests.blocks(self.prep.digests, self.prep.n),
            **{**self.fields, "pad": p.central_pad},
        )
        if len(cd) != self.central_len:
            raise InternalError(f"central records of {len(cd)} bytes, planned {self.central_len}")
        return cd


def plan_batch(
    entries: Sequence[Entry],
    offset: int,
    *,
    compression: str | None = None,
    compresslevel: int | None = None,
    num_threads: int | None = None,
    align: int | str | None = None,
    align_threshold: int | None = None,
    dos: tuple[int, int] | None = None,
    digest: bool = False,
) -> Batch:
    """Compresses and plans ``entries`` to be written from ``offset`` on (rounded up to their
    largest payload alignment, so that the plan of :func:`tdz_numba.zipfmt.layout.plan`,
    made from 0, shifts by a multiple of every alignment). ``digest``: their payloads'
    digests in their central records (zero-filled entries get one only when the caller
    marks it :data:`~tdz_numba.zipfmt.digest.PENDING` and fills it: a streamed leaf)."""
    from .kernels.dispatch import crc32_zeros
    from .writer import prepare

    prep = prepare(
        entries,
        compression=compression,
        compresslevel=compresslevel,
        num_threads=num_threads,
        align=align,
        align_threshold=align_threshold,
        digest=digest,
    )
    p = prep.plan
    step = max(int(p.align.max()) if prep.n else 1, 1)
    base = round_up(offset, step)
    hoff = p.header_offset + base
    p = replace(
        p,
        header_offset=hoff,
        payload_offset=p.payload_offset + base,
        central_zip64=packers.central_zip64(p.size, p.data_size, hoff),
        cd_offset=p.cd_offset + base,
    )
    prep = replace(prep, plan=p)
    n = prep.n
    has_data = np.fromiter((s is not None for s in prep.sources), np.bool_, n)
    for i in np.flatnonzero(~has_data & (prep.size > 0)).tolist():  # zeros: CRC by arithmetic
        prep.crc[i] = crc32_zeros(int(prep.size[i]))
    fields: dict[str, Any] = dict(
        crc=prep.crc,
        size=prep.size,
        csize=prep.stored_size,
        method=prep.methods,
        dos=packers.dos_datetime() if dos is None else dos,
        pad=p.pad,
        flags=p.flags,
    )
    cd_len = int(packers.central_record_len([len(b) for b in p.names], p.central_zip64, p.central_pad).sum())
    if digest and prep.digests is None:
        prep.digests = [None] * n
    return Batch(prep, fields, has_data, base, p.cd_offset if n else offset, cd_len)


def append_entries(
    fd: int,
    state: State,
    kept: list[bytes],
    entries: Sequence[Entry],
    *,
    compression: str | None = None,
    compresslevel: int | None = None,
    num_threads: int | None = None,
    align: int | str | None = None,
    align_threshold: int | None = None,
    durable: bool = True,
    dos: tuple[int, int] | None = None,
    digest: bool = False,
) -> Appended:
    """Writes ``entries`` after the end of the file (``state.size``) and a central directory
    of ``kept`` (raw central records of the old entries that stay, in order) followed by the
    new entries' records; commits with one small write (see the module docstring). On an
    exception before the commit the file is truncated back to its old size."""
    s0 = state.size
    if os.fstat(fd).st_size != s0:
        raise InternalError("the archive changed size while it was being appended to")
    batch = plan_batch(
        entries,
        s0,
        compression=compression,
        compresslevel=compresslevel,
        num_threads=num_threads,
        align=align,
        align_threshold=align_threshold,
        dos=dos,
        digest=digest,
    )
    old_cd = b"".join(kept)
    cd_size = len(old_cd) + batch.central_len
    count = len(kept) + batch.prep.n
    temp = state.temp_tail
    cd_offset, end, k = _tail_layout(batch.data_end, cd_size, count, len(temp))
    size = cd_offset + cd_size + len(end)
    committed = False
    try:
        write_segments(fd, [(size - len(temp), temp)])  # 1. the old state at the new end
        if durable:
            os.fsync(fd)
        new_cd = batch.write(fd, num_threads, durable)  # 2. (every write below the copy)
        tail = old_cd + new_cd + end
        write_segments(fd, [(cd_offset, memoryview(tail)[: len(tail) - k])])
        if durable:
            os.fsync(fd)
        committed = True
        write_segments(fd, [(size - k, tail[len(tail) - k :])])  # 3. the commit: one small write
        if durable:
            os.fsync(fd)
    except BaseException:
        if not committed:
            with contextlib.suppress(OSError):
                os.ftruncate(fd, s0)  # the old file, byte for byte
        raise
    return Appended(s0, batch.start, cd_offset, cd_size, size, count)


class _NoBar:
    def update(self, n: int) -> None:
        pass


@dataclass(frozen=True)
class Repaired:
    """What :func:`repair_file` did: ``action`` is ``"ok"`` (nothing to do) or ``"truncated"``."""

    action: str
    old_size: int
    size: int


def _adjacent(buf: Any, state: State) -> bool:
    """Whether the central directory and the end records follow each other without a gap up to
    the end record at the end of the file (zipfile's rule): the central directory, then the zip64
    end record and its locator when there are, then the end record."""
    end = state.end
    if not state.locator:
        return end.cd_offset + end.cd_size == state.eocd_offset
    from .records import ZIP64_END_STRUCT

    z_end = end.end_offset
    record_size = ZIP64_END_STRUCT.unpack_from(buf, z_end)[1]
    locator_at = state.eocd_offset - ZIP64_LOCATOR_STRUCT.size
    return end.cd_offset + end.cd_size == z_end and z_end + 12 + record_size == locator_at


def _end_of_records(buf: Any, at: int, end: EndRecord, label: str) -> int:
    """Where the end records that start at ``at`` (a zip64 end record or an end record) end,
    checked against ``end`` (the same central directory); -1 when they do not match."""
    size = len(buf)
    if bytes(buf[at : at + 4]) == ZIP64_END_SIG:
        from .records import ZIP64_END_STRUCT

        if at + ZIP64_END_STRUCT.size + ZIP64_LOCATOR_STRUCT.size + END_STRUCT.size > size:
            return -1
        z = ZIP64_END_STRUCT.unpack_from(buf, at)
        if (z[7], z[8], z[9]) != (end.count, end.cd_size, end.cd_offset):
            return -1
        at = at + 12 + z[1] + ZIP64_LOCATOR_STRUCT.size
        if (
            at + END_STRUCT.size > size
            or bytes(buf[at - ZIP64_LOCATOR_STRUCT.size : at - 16]) != ZIP64_LOCATOR_SIG
        ):
            return -1
    if bytes(buf[at : at + 4]) != END_SIG or at + END_STRUCT.size > size:
        return -1
    rec = END_STRUCT.unpack_from(buf, at)
    if not end.zip64 and (rec[4], rec[5], rec[6]) != (end.count, end.cd_size, end.cd_offset):
        return -1
    stop = at + END_STRUCT.size + rec[7]
    return stop if stop <= size else -1


def repair_file(fd: int, label: str, *, durable: bool = True) -> Repaired:
    """Brings a file an append left uncommitted back to its last committed state: the end
    record at the end of the file names the old central directory (the temporary tail of an
    append), whose own end records follow it; the file is truncated after them (the old file,
    byte for byte). A file whose central directory ends at its end record is left alone."""
    size = os.fstat(fd).st_size
    if size == 0:
        raise BadArchiveError(f"{label}: empty file, not a zip archive", path=label)
    with mmap.mmap(fd, size, access=mmap.ACCESS_READ) as buf:
        state = read_state(buf, label)
        end = state.end
        if _adjacent(buf, state):
            return Repaired("ok", size, size)
        stop = _end_of_records(buf, end.cd_offset + end.cd_size, end, label)
    if stop < 0:
        raise BadArchiveError(
            f"{label}: the central directory at offset {end.cd_offset} ({end.cd_size} bytes) is not "
            f"followed by its end records: not a file an append left uncommitted, cannot repair it",
            path=label,
            offset=end.cd_offset + end.cd_size,
        )
    os.ftruncate(fd, stop)
    if durable:
        os.fsync(fd)
    return Repaired("truncated", size, stop)
