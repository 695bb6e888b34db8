"""Streaming decode of one entry through a fixed-size buffer (bounded memory).

:func:`stream_member` (also reachable as ``tdz_numba.zipfmt.compression.stream_member``)
decodes a STORED, deflate, bzip2 or lzma entry of any size in pieces of at
most ``chunk`` bytes into one reusable buffer, hands each piece to a *sink*
(a CRC, a file write, ...) and checks the size and CRC-32 at the end, so that
``verify`` and ``unpack`` of a many-GiB entry need a few tens of MiB.

Deflate entries with a segment table (written by tdz_numba) are inflated a
group of segments at a time, in parallel, into the buffer; any other deflate
stream (zipfile, tensordict) is inflated serially by one zlib-ng stream.

Examples
--------
>>> import zlib, numpy as np
>>> from tdz_numba.zipfmt.stream import stream_member
>>> c = zlib.compressobj(6, zlib.DEFLATED, -15)
>>> raw = np.frombuffer(c.compress(bytes(1 << 20)) + c.flush(), np.uint8)
>>> pieces = []
>>> crc = stream_member(raw, 8, 1 << 20, zlib.crc32(bytes(1 << 20)), None,
...                     lambda b: pieces.append(len(b)), "zeros", chunk=256 << 10)
>>> pieces
[262144, 262144, 262144, 262144]
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np

from ..errors import UnsupportedError
from . import compression as c
from . import records

__all__ = ["stream_member", "inflate_serial"]

Sink = Callable[[np.ndarray], object]


def stream_member(
    raw: np.ndarray,
    method: int,
    size: int,
    crc: int | None,
    table: tuple[int, list[int]] | None,
    sink: Sink | None,
    where: str,
    *,
    expected: int | None = None,
    chunk: int | None = None,
    num_threads: int | None = None,
) -> int:
    """Decodes one entry in pieces through a reusable buffer and feeds ``sink``.

    Parameters
    ----------
    raw : np.ndarray
        The entry's stored bytes (uint8; a view of the mapping is fine).
    method : int
        Zip method: 0 (STORED), 8 (DEFLATED), 12 (BZIP2) or 14 (LZMA).
    size : int
        Declared uncompressed size: checked before decoding (``expected``,
        deflate's largest ratio; not the memory budget: nothing of that size is
        allocated) and the decoded total must equal it.
    crc : int or None
        Recorded CRC-32, checked at the end (None: not checked).
    table : (segment size, compressed lengths) or None
        The deflate segment table (``members.parse_segment_table``), if any.
    sink : callable or None
        Called with each decoded piece in order, a uint8 array of <= ``chunk``
        bytes that is only valid during the call (copy it to keep it). None:
        decode and check only.
    where : str
        Names the entry in error messages.
    expected : int or None
        The size the caller knows (dtype x shape).
    chunk : int or None
        Buffer size (default ``codecs.STREAM_CHUNK``, 32 MiB).
    num_threads : int or None
        Threads for segmented deflate entries (None: all cores).

    Returns
    -------
    int
        The CRC-32 of the decoded bytes.

    Raises
    ------
    BadArchiveError
        A corrupt stream or table, or a stream that decodes to another size.
        ``sink`` may have received pieces before the error.
    ChecksumError
        The CRC-32 differs from ``crc``.
    """
    chunk = c.STREAM_CHUNK if chunk is None else int(chunk)
    if chunk < 1:
        from ..errors import InvalidArgumentError

        raise InvalidArgumentError(f"chunk must be >= 1, got {chunk}")
    raw = np.frombuffer(raw, np.uint8) if not isinstance(raw, np.ndarray) else raw
    c.check_declared(size, int(raw.size), method, where, expected=expected, in_memory=False)
    sink = sink if sink is not None else _discard
    if method == records.STORED:
        found = _stored(raw, size, sink, where, chunk)
    elif method == records.DEFLATED:
        if table is not None and len(table[1]) > 1 and 0 < table[0] <= chunk // 2:
            found = _segments(raw, size, table, sink, where, chunk, num_threads)
        else:
            found = inflate_serial(raw, size, sink, where, chunk)
    elif method in (records.BZIP2, records.LZMA):
        found = 0
        for piece in c.decode_chunks(raw, method, size, where, chunk):
            found = c.crc_of(piece, found)
            sink(np.frombuffer(piece, np.uint8))
    else:
        raise UnsupportedError(f"{where}: unsupported compression method {method}")
    if crc is not None and found != crc:
        raise c.crc_error(where, crc, found)
    return found


def _discard(piece: np.ndarray) -> None:
    return None


def _stored(raw: np.ndarray, size: int, sink: Sink, where: str, chunk: int) -> int:
    if raw.size != size:
        raise c.bad_member(
            where,
            f"is stored with {raw.size} bytes but records an uncompressed size of {size}",
            expected=size,
            found=int(raw.size),
        )
    found = 0
    for pos in range(0, size, chunk):
        piece = raw[pos : pos + chunk]
        found = c.crc_of(piece, found)
        sink(piece)
    return found


def inflate_serial(raw: np.ndarray, size: int, sink: Sink, where: str, chunk: int) -> int:
    """One zlib-ng stream over the whole entry, ``chunk`` bytes of output at a time."""
    from .kernels.deflate import Z_STREAM_END, inflate_close, inflate_open, inflate_step

    buf = np.empty(max(1, min(chunk, size)), np.uint8)
    probe = np.empty(1, np.uint8)
    src = raw.ctypes.data if raw.size else probe.ctypes.data
    strm = np.zeros(13, np.uint64)
    rc = int(inflate_open(strm))
    if rc != 0:  # pragma: no cover - out of memory in zlib-ng
        raise c.bad_member(where, f"zlib-ng inflateInit2 failed ({rc})")
    pos = produced = found = 0
    try:
        while produced < size:
            cap = min(buf.size, size - produced)
            used, got, rc, found = inflate_step(strm, src + pos, raw.size - pos, buf.ctypes.data, cap, found)
            pos, produced, rc, found = pos + int(used), produced + int(got), int(rc), int(found)
            if got:
                sink(buf[:got])
            if (rc < 0 and rc != -5) or rc == Z_STREAM_END or (used == 0 and got == 0):
                break
        if rc < 0 and rc != -5:
            raise c.bad_member(
                where,
                f"corrupt deflate stream (status {rc}) after {produced} of {size} bytes",
                expected=size,
                found=produced,
            )
        if produced < size:
            raise c.bad_member(
                where,
                f"the deflate stream decodes to {produced} bytes, expected {size}",
                expected=size,
                found=produced,
            )
        if rc != Z_STREAM_END:  # output complete: the stream must end here, without more output
            used, got, rc, _ = inflate_step(strm, src + pos, raw.size - pos, probe.ctypes.data, 1, 0)
            pos, rc = pos + int(used), int(rc)
            if got:
                raise c.bad_member(
                    where, f"the deflate stream decodes to more than {size} bytes", expected=size
                )
            if rc != Z_STREAM_END:
                raise c.bad_member(
                    where, f"corrupt deflate stream: no end of stream after {size} bytes (status {rc})"
                )
        if pos != raw.size:
            raise c.bad_member(
                where,
                f"the deflate stream ends after {pos} of {raw.size} stored bytes",
                expected=int(raw.size),
                found=pos,
            )
    finally:
        inflate_close(strm)
        strm[0] = 0
    return found


def _segments(
    raw: np.ndarray,
    size: int,
    table: tuple[int, list[int]],
    sink: Sink,
    where: str,
    chunk: int,
    num_threads: int | None,
) -> int:
    """Groups of segments inflated in parallel into one buffer of <= ``chunk`` bytes."""
    from ..jit.presets import dynamic_schedule, run_parallel
    from .kernels.crc import crc32_combine
    from .kernels.deflate import inflate_segments

    segment, clens = table
    count = len(clens)
    want = max(1, (size + segment - 1) // segment)
    offsets = np.zeros(count + 1, np.int64)
    np.cumsum(np.asarray(clens, np.int64), out=offsets[1:])
    if count != want or int(offsets[-1]) != raw.size:
        raise c.bad_member(
            where,
            f"segment table lists {count} segments of {int(offsets[-1])} bytes, "
            f"expected {want} segments of {raw.size} bytes",
        )
    group = max(1, chunk // segment)
    buf = np.empty(min(group * segment, size), np.uint8)
    base, out = raw.ctypes.data, buf.ctypes.data
    found = 0
    for g in range(0, count, group):
        rows = np.arange(g, min(g + group, count))
        dlen = np.minimum(segment, size - rows * segment)
        with dynamic_schedule():
            crcs, status = run_parallel(
                inflate_segments,
                base + offsets[rows],
                offsets[rows + 1] - offsets[rows],
                out + (rows - g) * segment,
                dlen,
                rows == count - 1,
                num_threads=num_threads,
            )
        bad = np.flatnonzero(status)
        if bad.size:
            j = int(bad[0])
            raise c.bad_member(where, f"corrupt deflate stream (segment {g + j}, status {int(status[j])})")
        for j in range(rows.size):
            found = int(crc32_combine(found, crcs[j], dlen[j]))
        sink(buf[: int(dlen.sum())])
    return found
