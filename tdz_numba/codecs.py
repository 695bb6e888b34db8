"""Compression methods of zip entries: deflate (parallel segments, zlib-ng), bzip2 and lzma (stdlib).

Examples
--------
>>> import numpy as np
>>> from tdz_numba import codecs
>>> raw = bytes(1000)
>>> packed = codecs.compress(memoryview(raw), codecs.method_of("bzip2"), None)
>>> bytes(codecs.decompress(packed, 12, 1000, "x.memmap")) == raw
True
"""

from __future__ import annotations

import bz2
import lzma
import struct
from dataclasses import dataclass

import numpy as np

from . import records
from .errors import BadArchiveError, ChecksumError, UnsupportedError

__all__ = ["method_of", "check_level", "compress", "decompress", "COMPRESSION_NAMES"]

COMPRESSION_NAMES = {
    None: records.STORED,
    "stored": records.STORED,
    "deflate": records.DEFLATED,
    "deflated": records.DEFLATED,
    "bzip2": records.BZIP2,
    "lzma": records.LZMA,
}


class UnknownCompressionError(UnsupportedError, ValueError):
    """An unknown compression name was passed to ``save``/``pack``."""


_LEVELS = {records.DEFLATED: range(-1, 10), records.BZIP2: range(1, 10), records.LZMA: range(0, 10)}


def check_level(method: int, level: int | None) -> None:
    """Raises :class:`~tdz_numba.InvalidArgumentError` for a level the codec does not take
    (deflate -1..9, bzip2 1..9; lzma ignores it, as zipfile does, but it must be 0..9)."""
    if level is None or method == records.STORED:
        return
    ok = _LEVELS[method]
    if not isinstance(level, int) or isinstance(level, bool) or level not in ok:
        from .errors import InvalidArgumentError

        raise InvalidArgumentError(
            f"compresslevel {level!r} is not valid for {records.METHOD_NAMES[method]} "
            f"(expected {ok.start}..{ok.stop - 1} or None)"
        )


def method_of(compression: str | None) -> int:
    """The zip method number of a compression name."""
    key = compression.lower() if isinstance(compression, str) else compression
    try:
        return COMPRESSION_NAMES[key]
    except (KeyError, TypeError):
        names = sorted(k for k in COMPRESSION_NAMES if k)
        raise UnknownCompressionError(
            f"unknown compression {compression!r} (expected None or one of {names})"
        ) from None


def _lzma_filters(props: bytes):
    return [lzma._decode_filter_properties(lzma.FILTER_LZMA1, props)]  # type: ignore[attr-defined]


def compress(data, method: int, level: int | None) -> bytes:
    """Compresses ``data`` (a buffer) into the bytes a bzip2 or lzma zip entry stores
    (deflate goes through :func:`deflate_many`, in parallel segments)."""
    if method == records.BZIP2:
        return bz2.compress(data, 9 if level is None else level)
    if method == records.LZMA:
        props = lzma._encode_filter_properties({"id": lzma.FILTER_LZMA1})  # type: ignore[attr-defined]
        comp = lzma.LZMACompressor(lzma.FORMAT_RAW, filters=_lzma_filters(props))
        return struct.pack("<BBH", 9, 4, len(props)) + props + comp.compress(data) + comp.flush()
    raise UnsupportedError(f"cannot compress with zip method {method}")


def decompress(raw, method: int, size: int, name: str) -> np.ndarray:
    """Decompresses a bzip2 or lzma entry into a new uint8 array of exactly ``size``
    bytes (deflate goes through :func:`inflate_many`, in parallel segments).

    Raises :class:`BadArchiveError` when the stream is corrupt or decodes to
    another size.
    """
    try:
        if method == records.BZIP2:
            d = bz2.BZ2Decompressor()
            out = d.decompress(raw, size + 1)
            ok = d.eof
        elif method == records.LZMA:
            raw = bytes(raw)
            if len(raw) < 4:
                raise BadArchiveError(f"{name}: truncated lzma header")
            (plen,) = struct.unpack_from("<H", raw, 2)
            d = lzma.LZMADecompressor(lzma.FORMAT_RAW, filters=_lzma_filters(raw[4 : 4 + plen]))
            out = d.decompress(raw[4 + plen :], size + 1)
            ok = True
        else:
            raise UnsupportedError(f"{name}: unsupported compression method {method}")
    except (OSError, EOFError, lzma.LZMAError, ValueError) as exc:
        if isinstance(exc, BadArchiveError):
            raise
        raise BadArchiveError(f"{name}: corrupt {records.METHOD_NAMES.get(method)} stream: {exc}") from None
    if len(out) != size or not ok:
        raise BadArchiveError(
            f"{name}: the compressed stream decodes to {len(out)}{'+' if len(out) > size else ''} "
            f"bytes, expected {size}"
        )
    return np.frombuffer(bytearray(out), dtype=np.uint8)


# ---------------------------------------------------------------------------
# Parallel deflate / inflate (segments, Numba + zlib-ng)
# ---------------------------------------------------------------------------
#: Id of the private local extra block that lists an entry's deflate segments (``b"tz"``).
SEGMENT_EXTRA_ID = 0x7A74
SEGMENT_VERSION = 1
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


def segment_size_for(n: int) -> int:
    """Segment size of an ``n``-byte entry: ``SEGMENT_SIZE``, or more so that
    the table stays below ``_MAX_SEGMENTS`` rows."""
    seg = SEGMENT_SIZE
    while (n + seg - 1) // seg > _MAX_SEGMENTS:
        seg *= 2
    return seg


def segment_table(segment: int, clens: list[int]) -> bytes:
    """The ``0x7A74`` extra block: version, segment size, count, compressed lengths."""
    body = struct.pack("<IQI", SEGMENT_VERSION, segment, len(clens)) + struct.pack(f"<{len(clens)}I", *clens)
    return struct.pack("<HH", SEGMENT_EXTRA_ID, len(body)) + body


def parse_segment_table(extra: bytes, where: str) -> tuple[int, list[int]] | None:
    """``(segment size, compressed lengths)`` from a local extra field, or None."""
    pos = 0
    while pos + 4 <= len(extra):
        tag, size = struct.unpack_from("<HH", extra, pos)
        body = extra[pos + 4 : pos + 4 + size]
        if tag == SEGMENT_EXTRA_ID:
            if len(body) < 16:
                raise BadArchiveError(f"{where}: segment table of {len(body)} bytes, expected >= 16")
            version, segment, count = struct.unpack_from("<IQI", body)
            if version != SEGMENT_VERSION or segment <= 0 or len(body) != 16 + 4 * count:
                raise BadArchiveError(
                    f"{where}: bad segment table (version {version}, segment {segment}, "
                    f"{count} rows in {len(body)} bytes; expected version {SEGMENT_VERSION} "
                    f"and {16 + 4 * count} bytes)"
                )
            return segment, list(struct.unpack_from(f"<{count}I", body, 16))
        pos += 4 + size
    return None


def deflate_many(arrays: list[np.ndarray], level: int | None, num_threads: int | None) -> list[Deflated]:
    """Deflates every array as one raw-deflate stream made of independent
    segments, all segments of all arrays in one parallel kernel call."""
    from ._jit import run_parallel
    from .codec_kernels import Z_OK, Z_STREAM_END, deflate_bound, deflate_segments
    from .kernels import crc32_combine

    src, length, last, owner, seg_of = [], [], [], [], []
    for k, arr in enumerate(arrays):
        seg = segment_size_for(arr.size)
        seg_of.append(seg)
        base = arr.ctypes.data
        starts = range(0, arr.size, seg)
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
    out_len, crcs, status = run_parallel(
        deflate_segments, np.asarray(src, np.int64), length_a, scratch.ctypes.data + starts_out, caps,
        np.asarray(last, np.bool_), np.int64(-1 if level is None else level), num_threads=num_threads,
    )  # fmt: skip
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


def inflate_many(jobs: list[tuple[str, np.ndarray, int, int, tuple[int, list[int]] | None]],
                 num_threads: int | None) -> list[np.ndarray]:  # fmt: skip
    """Inflates raw-deflate entries into new arrays, in parallel across entries
    and across the segments of each.

    ``jobs`` rows: ``(where, stored bytes, size, crc, segment table or None)``.
    Raises :class:`BadArchiveError` for a corrupt stream or table,
    :class:`ChecksumError` for a CRC mismatch.
    """
    from ._jit import run_parallel
    from .codec_kernels import inflate_segments
    from .kernels import crc32_combine

    outs = [np.empty(size, np.uint8) for _, _, size, _, _ in jobs]
    dummy = np.empty(1, np.uint8)  # zlib refuses a NULL output pointer, even for 0 bytes
    src, slen, dst, dlen, last, owner = [], [], [], [], [], []
    for k, (where, raw, size, _crc, table) in enumerate(jobs):
        if table is None:
            segment, clens = max(size, 1), [raw.size]
        else:
            segment, clens = table
            want = max(1, (size + segment - 1) // segment)
            if len(clens) != want or sum(clens) != raw.size:
                raise BadArchiveError(
                    f"{where}: segment table lists {len(clens)} segments of {sum(clens)} bytes, "
                    f"expected {want} segments of {raw.size} bytes"
                )
        pos = 0
        for j, c in enumerate(clens):
            src.append(raw.ctypes.data + pos if raw.size else dummy.ctypes.data)
            slen.append(c)
            dst.append(outs[k].ctypes.data + j * segment if size else dummy.ctypes.data)
            dlen.append(min(segment, size - j * segment) if size else 0)
            last.append(j == len(clens) - 1)
            owner.append(k)
            pos += c
    crcs, status = run_parallel(
        inflate_segments, np.asarray(src, np.int64), np.asarray(slen, np.int64),
        np.asarray(dst, np.int64), np.asarray(dlen, np.int64), np.asarray(last, np.bool_),
        num_threads=num_threads,
    )  # fmt: skip
    found = [0] * len(jobs)
    for j, k in enumerate(owner):
        if status[j]:
            raise BadArchiveError(f"{jobs[k][0]}: corrupt deflate stream (segment {j - owner.index(k)}, "
                                  f"status {int(status[j])})")  # fmt: skip
        found[k] = int(crc32_combine(found[k], crcs[j], dlen[j]))
    for k, (where, _raw, _size, crc, _t) in enumerate(jobs):
        if found[k] != crc:
            raise ChecksumError(f"{where}: CRC-32 mismatch: recorded {crc:#010x}, computed {found[k]:#010x}")
    return outs
