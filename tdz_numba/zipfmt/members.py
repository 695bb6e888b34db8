"""Deflated members in segments: the parallel deflate and inflate (Numba kernels over zlib-ng),
the segment table that lists each member's segments (:class:`~tdz_numba.zipfmt.records.SegmentTable`),
and :func:`decode_member`, which decodes one member of any codec into memory.

Examples
--------
>>> import zlib, numpy as np
>>> from tdz_numba.zipfmt import members
>>> table = members.segment_table(1 << 20, [10, 20])
>>> members.parse_segment_table(table, "x")
(1048576, [10, 20])
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from ..errors import BadArchiveError, UnsupportedError
from . import records
from .compression import (
    CODEC_METHODS,
    allocate_output,
    bad_member,
    check_crc,
    check_declared,
    crc_error,
    decompress,
    memory_budget,
)

#: Uncompressed bytes per deflate segment (at least; larger for huge entries).
SEGMENT_SIZE = 4 << 20
_MAX_SEGMENTS = 16_000  # the table must fit in one extra field (< 64 KiB)


@dataclass
class Deflated:
    """One entry deflated in segments: the stored bytes (views) and its CRC."""

    parts: list[np.ndarray]
    csize: int
    crc: int
    table: bytes  # the segment-table extra block, b"" for a single segment


def segment_size_for(n: int, segment_size: int | None = None) -> int:
    """Segment size of an ``n``-byte entry: ``segment_size`` (default
    :data:`SEGMENT_SIZE`), or more so that the table stays below
    ``_MAX_SEGMENTS`` rows; never more than ``codec_kernels.MAX_SEGMENT``.

    Examples
    --------
    >>> from tdz_numba.zipfmt import members
    >>> members.segment_size_for(10 << 20), members.segment_size_for(10 << 20, 1 << 20)
    (4194304, 1048576)
    """
    from .kernels.deflate import MAX_SEGMENT

    seg = SEGMENT_SIZE if segment_size is None else int(segment_size)
    if seg <= 0:
        from ..errors import InvalidArgumentError

        raise InvalidArgumentError(f"segment_size must be > 0, got {seg}")
    while (n + seg - 1) // seg > _MAX_SEGMENTS:
        seg *= 2
    if seg > MAX_SEGMENT and n > MAX_SEGMENT:
        raise UnsupportedError(f"an entry of {n} bytes needs deflate segments above {MAX_SEGMENT} bytes")
    return min(seg, max(MAX_SEGMENT, 1))


def segment_table(segment: int, clens: list[int]) -> bytes:
    """Our segment-table extra block (:class:`~tdz_numba.zipfmt.records.SegmentTable`): id, length,
    version, segment size, count, then the compressed length of each segment."""
    body_len = records.SegmentTable.SIZEOF - records.SegmentTable.VERSION + 4 * len(clens)
    head = records.SEGMENT_TABLE_STRUCT.pack(
        records.SEGMENT_EXTRA_ID, body_len, records.SEGMENT_VERSION, segment, len(clens)
    )
    return head + np.asarray(clens, "<u4").tobytes()


def parse_segment_table(extra: bytes, where: str) -> tuple[int, list[int]] | None:
    """``(segment size, compressed lengths)`` from a local extra field, or None."""
    table = records.SegmentTable
    fixed = table.SIZEOF - table.VERSION  # the body's fixed fields: version, segment size, count
    pos = 0
    while pos + records.Extra.SIZEOF <= len(extra):
        tag, size = records.EXTRA_STRUCT.unpack_from(extra, pos)
        if tag == records.SEGMENT_EXTRA_ID:
            body_len = min(size, len(extra) - pos - records.Extra.SIZEOF)
            if body_len < fixed:
                raise BadArchiveError(f"{where}: segment table of {body_len} bytes, expected >= {fixed}")
            _, _, version, segment, count = records.SEGMENT_TABLE_STRUCT.unpack_from(extra, pos)
            if version != records.SEGMENT_VERSION or segment <= 0 or body_len != fixed + 4 * count:
                raise BadArchiveError(
                    f"{where}: bad segment table (version {version}, segment {segment}, "
                    f"{count} rows in {body_len} bytes; expected version {records.SEGMENT_VERSION} "
                    f"and {fixed + 4 * count} bytes)"
                )
            start = pos + table.SIZEOF
            return segment, np.frombuffer(extra, "<u4", count, start).tolist()
        pos += records.Extra.SIZEOF + size
    return None


def deflate_many(
    arrays: list[np.ndarray], level: int | None, num_threads: int | None, segment_size: int | None = None
) -> list[Deflated]:
    """Deflates every array as one raw-deflate stream made of independent
    segments of ``segment_size`` bytes (default :data:`SEGMENT_SIZE`), all
    segments of all arrays in one parallel kernel call."""
    from ..jit.presets import dynamic_schedule, run_parallel
    from .kernels.crc import crc32_combine
    from .kernels.deflate import Z_OK, Z_STREAM_END, deflate_bound, deflate_segments

    src, length, last, owner, seg_of = [], [], [], [], []
    for k, arr in enumerate(arrays):
        seg = segment_size_for(arr.size, segment_size)
        seg_of.append(seg)
        base = arr.ctypes.data
        starts = range(0, max(arr.size, 1), seg)  # an empty array: one empty segment
        for j, s in enumerate(starts):
            src.append(base + s)
            length.append(min(seg, arr.size - s))
            last.append(j == len(starts) - 1)
            owner.append(k)
    length_a = np.asarray(length, np.int64)
    caps = np.fromiter((deflate_bound(int(x)) for x in length), np.int64, len(length))
    scratch = np.empty(int(caps.sum()), np.uint8)
    starts_out = np.zeros(len(caps), np.int64)
    np.cumsum(caps[:-1], out=starts_out[1:])
    with dynamic_schedule():
        out_len, crcs, status = run_parallel(
            deflate_segments,
            np.asarray(src, np.int64),
            length_a,
            scratch.ctypes.data + starts_out,
            caps,
            np.asarray(last, np.bool_),
            np.int64(-1 if level is None else level),
            num_threads=num_threads,
        )
    ok = np.where(np.asarray(last), status == Z_STREAM_END, status == Z_OK)
    if not ok.all():
        raise UnsupportedError(f"zlib-ng deflate failed with status {int(status[~ok][0])}")
    results = [Deflated([], 0, 0, b"") for _ in arrays]
    clens: list[list[int]] = [[] for _ in arrays]
    for j, k in enumerate(owner):
        r = results[k]
        part = scratch[starts_out[j] : starts_out[j] + out_len[j]]
        r.parts.append(part)
        r.csize += int(out_len[j])
        r.crc = int(crc32_combine(r.crc, crcs[j], length[j]))
        clens[k].append(int(out_len[j]))
    for k, r in enumerate(results):
        if len(clens[k]) > 1:
            r.table = segment_table(seg_of[k], clens[k])
    return results


Job = tuple[str, np.ndarray, int, "int | None", "tuple[int, list[int]] | None"]


def inflate_many(
    jobs: list[Job],
    num_threads: int | None,
    *,
    expected: list[int | None] | None = None,
    into: np.ndarray | None = None,
) -> list[np.ndarray]:
    """Inflates raw-deflate entries into new arrays, in parallel across entries
    and across the segments of each.

    ``jobs`` rows: ``(where, stored bytes, size, crc or None, segment table or None)``;
    ``expected``: per job, the size the caller knows (dtype x shape) or None.
    Every size is checked (:func:`check_declared`, the batch's total against the
    memory budget) before anything is allocated; the kernel never writes past
    the declared size. Raises :class:`BadArchiveError` for a corrupt stream or
    table, :class:`ChecksumError` for a CRC mismatch.

    ``into``: a uint8 buffer that receives the outputs one after the other
    (the result is views of it) instead of new arrays: ``verify`` reuses one
    for every batch, which spares the page faults of fresh memory.
    """
    from ..jit.presets import dynamic_schedule, run_parallel
    from .kernels.crc import crc32_combine
    from .kernels.deflate import inflate_segments

    budget = memory_budget() if into is None else int(into.size)
    total = 0
    for k, (where, raw, size, _crc, _table) in enumerate(jobs):
        check_declared(
            size,
            int(raw.size),
            records.DEFLATED,
            where,
            budget=budget,
            expected=None if expected is None else expected[k],
        )
        total += size
    if total > budget:
        raise bad_member(
            jobs[0][0],
            f"the {len(jobs)} entries inflated together declare {total} bytes, more "
            f"than the memory budget of {budget} bytes",
            expected=budget,
            found=total,
        )
    dummy = np.empty(1, np.uint8)  # zlib refuses a NULL output pointer, even for 0 bytes
    src: list[int] = []
    slen: list[int] = []
    dst: list[int] = []
    dlen: list[int] = []
    last: list[bool] = []
    owner: list[int] = []
    first: list[int] = []
    plans: list[tuple[int, list[int]]] = []
    for where, raw, size, _crc, table in jobs:
        if table is None:
            segment, clens = max(size, 1), [raw.size]
        else:
            segment, clens = table
            want = max(1, (size + segment - 1) // segment)
            if len(clens) != want or sum(clens) != raw.size:
                raise bad_member(
                    where,
                    f"segment table lists {len(clens)} segments of {sum(clens)} bytes, "
                    f"expected {want} segments of {raw.size} bytes",
                )
        plans.append((segment, clens))
    if into is None:
        outs = [allocate_output(size, where) for where, _, size, _, _ in jobs]
    else:
        ends = np.cumsum([0] + [size for _, _, size, _, _ in jobs]).tolist()
        outs = [into[a:b] for a, b in zip(ends[:-1], ends[1:])]
    for k, ((_where, raw, size, _crc, _table), (segment, clens)) in enumerate(zip(jobs, plans)):
        pos = 0
        first.append(len(src))
        for j, c in enumerate(clens):
            src.append(raw.ctypes.data + pos if raw.size else dummy.ctypes.data)
            slen.append(c)
            dst.append(outs[k].ctypes.data + j * segment if size else dummy.ctypes.data)
            dlen.append(min(segment, size - j * segment) if size else 0)
            last.append(j == len(clens) - 1)
            owner.append(k)
            pos += c
    with dynamic_schedule():
        crcs, status = run_parallel(
            inflate_segments,
            np.asarray(src, np.int64),
            np.asarray(slen, np.int64),
            np.asarray(dst, np.int64),
            np.asarray(dlen, np.int64),
            np.asarray(last, np.bool_),
            num_threads=num_threads,
        )
    bad = np.flatnonzero(status)
    if bad.size:
        j = int(bad[0])
        k = owner[j]
        raise bad_member(
            jobs[k][0], f"corrupt deflate stream (segment {j - first[k]}, status {int(status[j])})"
        )
    found = [0] * len(jobs)
    for j, k in enumerate(owner):
        found[k] = int(crc32_combine(found[k], crcs[j], dlen[j])) if len(plans[k][1]) > 1 else int(crcs[j])
    for k, (where, _raw, _size, crc, _t) in enumerate(jobs):
        if crc is not None and found[k] != crc:
            raise crc_error(where, crc, found[k])
    return outs


def decode_member(
    raw: np.ndarray,
    codec: str,
    size: int,
    crc: int | None,
    where: str,
    num_threads: int | None = None,
    *,
    expected: int | None = None,
) -> np.ndarray:
    """Decodes one compressed member (of a zip entry, an npz member, ...) into a
    new uint8 array of exactly ``size`` bytes.

    Parameters
    ----------
    raw : np.ndarray
        The stored bytes (uint8, e.g. a view of a read-only mapping).
    codec : str
        ``"deflate"`` (raw deflate, no segment table), ``"bzip2"`` or ``"lzma"``
        (zip's LZMA header + raw LZMA1).
    size : int
        The declared uncompressed size, checked before any allocation against
        ``expected``, the memory budget and (deflate) the largest ratio.
    crc : int or None
        The CRC-32 to check, None to skip it.
    where : str
        Names the member in error messages.
    num_threads : int or None
        Threads of the deflate kernel (None: all cores).
    expected : int or None
        The size the caller knows from dtype x shape.

    Examples
    --------
    >>> import zlib, numpy as np
    >>> from tdz_numba.zipfmt import members
    >>> c = zlib.compressobj(6, zlib.DEFLATED, -15)
    >>> raw = np.frombuffer(c.compress(b"ab" * 50) + c.flush(), np.uint8)
    >>> members.decode_member(raw, "deflate", 100, zlib.crc32(b"ab" * 50), "m.npy").tobytes()[:4]
    b'abab'
    """
    method = CODEC_METHODS.get(codec)
    if method is None:
        raise UnsupportedError(
            f"{where}: unsupported codec {codec!r} (expected one of {sorted(CODEC_METHODS)})"
        )
    raw = np.frombuffer(raw, np.uint8) if not isinstance(raw, np.ndarray) else raw.reshape(-1).view(np.uint8)
    if method == records.DEFLATED:
        return inflate_many([(where, raw, size, crc, None)], num_threads, expected=[expected])[0]
    out = decompress(raw, method, size, where, expected=expected)
    if crc is not None:
        check_crc(out, crc, where)
    return out
