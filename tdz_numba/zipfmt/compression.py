"""Compression methods of zip entries: deflate (parallel segments, zlib-ng), bzip2 and lzma (stdlib).

Decoding is bounded: a declared size is checked before anything is allocated
(:func:`check_declared`: the caller's dtype x shape, :data:`MAX_DECODED` /
:func:`memory_budget`, deflate's largest ratio), no kernel writes past it, bzip2
and lzma decode in pieces, and lzma dictionaries are clamped to the entry size.
:func:`decode_member` decodes one member into memory, :func:`~tdz_numba.zipfmt.stream.stream_member`
(in :mod:`tdz_numba.zipfmt.stream`) streams any entry through a fixed buffer.

Examples
--------
>>> import numpy as np
>>> from tdz_numba.zipfmt import compression as codecs
>>> raw = bytes(1000)
>>> packed = codecs.compress(memoryview(raw), codecs.method_of("bzip2"), None)
>>> bytes(codecs.decompress(packed, 12, 1000, "x.memmap")) == raw
True
"""

from __future__ import annotations

import bz2
import lzma
import os
import struct
from collections.abc import Iterator
from dataclasses import dataclass

import numpy as np

from ..errors import BadArchiveError, ChecksumError, UnknownCompressionError, UnsupportedError
from . import records

__all__ = [
    "bad_member",
    "crc_error",
    "crc_of",
    "check_crc",
    "decode_chunks",
    "method_of",
    "check_level",
    "compress",
    "decompress",
    "decode_member",
    "check_declared",
    "memory_budget",
    "deflate_many",
    "inflate_many",
    "segment_size_for",
    "segment_table",
    "parse_segment_table",
    "Deflated",
    "COMPRESSION_NAMES",
    "CODEC_METHODS",
    "MAX_DECODED",
    "STREAM_CHUNK",
    "SEGMENT_SIZE",
    "DEFLATE_MAX_RATIO",
]

COMPRESSION_NAMES = {
    None: records.STORED,
    "stored": records.STORED,
    "deflate": records.DEFLATED,
    "deflated": records.DEFLATED,
    "bzip2": records.BZIP2,
    "lzma": records.LZMA,
}


#: Codec names of :func:`decode_member` and their zip method numbers.
CODEC_METHODS = {"deflate": records.DEFLATED, "bzip2": records.BZIP2, "lzma": records.LZMA}

#: Largest decoded size of the entries held in memory at once (one entry, or one
#: parallel batch). None: the machine's physical memory, or what the process's
#: address-space limit (``RLIMIT_AS``) leaves, whichever is lower.
MAX_DECODED: int | None = None
#: Raw deflate cannot expand more than this: 258 bytes per 2 bits of codes.
DEFLATE_MAX_RATIO = 1032
#: Size of the reusable buffer that :func:`tdz_numba.zipfmt.stream.stream_member` decodes into.
STREAM_CHUNK = 32 << 20
_IN_CHUNK = 8 << 20  # compressed bytes handed to bz2 / lzma per call
_LZMA_DICT_MIN = 4096


def bad_member(where: str, message: str, *, expected: object = None, found: object = None) -> BadArchiveError:
    return BadArchiveError(f"{where}: {message}", entry=where, expected=expected, found=found)


def crc_error(where: str, crc: int, found: int) -> ChecksumError:
    return ChecksumError(
        f"{where}: CRC-32 mismatch: recorded {crc:#010x}, computed {found:#010x}",
        entry=where,
        expected=crc,
        found=found,
    )


def memory_budget() -> int:
    """Bytes that decoding may allocate: :data:`MAX_DECODED` when set, else the
    physical memory, capped by what ``RLIMIT_AS`` leaves to this process."""
    if MAX_DECODED is not None:
        return int(MAX_DECODED)
    try:
        budget = os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError):  # pragma: no cover - not POSIX
        budget = 1 << 40
    try:
        import resource

        soft = resource.getrlimit(resource.RLIMIT_AS)[0]
        unlimited = soft == resource.RLIM_INFINITY
    except (ImportError, OSError, ValueError):  # pragma: no cover - not POSIX
        unlimited = True
    if not unlimited:
        try:
            with open("/proc/self/statm") as f:
                used = int(f.read().split()[0]) * os.sysconf("SC_PAGE_SIZE")
        except (OSError, ValueError, IndexError):  # pragma: no cover - no procfs
            used = 0
        budget = min(budget, soft - used)
    return max(int(budget), 0)


def check_declared(
    size: int,
    csize: int,
    method: int,
    where: str,
    *,
    expected: int | None = None,
    in_memory: bool = True,
    budget: int | None = None,
) -> None:
    """Checks an entry's declared uncompressed ``size`` before anything is allocated.

    Refuses (:class:`BadArchiveError`): a negative size; a size other than
    ``expected`` (the leaf's dtype x shape, when the caller knows it); a
    deflate size above ``DEFLATE_MAX_RATIO`` x the compressed size (+ 4 KiB);
    and, when the output is to be held ``in_memory``, a size above
    :func:`memory_budget` (or ``budget``).

    Examples
    --------
    >>> from tdz_numba.zipfmt import compression as codecs
    >>> codecs.check_declared(4 << 40, 1024, 8, "x.memmap")
    Traceback (most recent call last):
    ...
    tdz_numba.errors.BadArchiveError: x.memmap: declares 4398046511104 uncompressed bytes for 1024 deflated bytes (raw deflate expands at most 1032:1)
    """
    if size < 0:
        raise bad_member(where, f"declares a negative uncompressed size ({size})", found=size)
    if expected is not None and size != expected:
        raise bad_member(
            where,
            f"declares {size} uncompressed bytes, expected {expected} (the leaf's dtype x shape)",
            expected=expected,
            found=size,
        )
    if method == records.DEFLATED and size > DEFLATE_MAX_RATIO * csize + 4096:
        raise bad_member(
            where,
            f"declares {size} uncompressed bytes for {csize} deflated bytes (raw deflate "
            f"expands at most {DEFLATE_MAX_RATIO}:1)",
            found=size,
        )
    if in_memory:
        limit = memory_budget() if budget is None else budget
        if size > limit:
            raise bad_member(
                where,
                f"declares {size} uncompressed bytes, more than the memory budget of "
                f"{limit} bytes (codecs.MAX_DECODED)",
                expected=limit,
                found=size,
            )


def _alloc(size: int, where: str) -> np.ndarray:
    try:
        return np.empty(size, np.uint8)
    except (MemoryError, ValueError):
        raise bad_member(where, f"cannot allocate {size} bytes for the decoded entry", found=size) from None


_LEVELS = {records.DEFLATED: range(-1, 10), records.BZIP2: range(1, 10), records.LZMA: range(0, 10)}


def check_level(method: int, level: int | None) -> None:
    """Raises :class:`~tdz_numba.InvalidArgumentError` for a level the codec does not take
    (deflate -1..9, bzip2 1..9; lzma ignores it, as zipfile does, but it must be 0..9)."""
    if level is None or method == records.STORED:
        return
    ok = _LEVELS[method]
    if not isinstance(level, int) or isinstance(level, bool) or level not in ok:
        from ..errors import InvalidArgumentError

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


def _lzma_decoder(raw: np.ndarray, size: int, where: str) -> tuple[lzma.LZMADecompressor, int]:
    """A raw LZMA1 decoder for a zip entry's stream, and the offset of its data.

    The header's dictionary size is clamped to the entry's size (a dictionary
    larger than the output is never read) and checked against the memory budget
    before the decoder allocates it.
    """
    if raw.size < 9:
        raise bad_member(
            where, f"truncated lzma header ({raw.size} bytes, expected >= 9)", found=int(raw.size)
        )
    head = raw[:9].tobytes()
    (plen,) = struct.unpack_from("<H", head, 2)
    if plen != 5:
        raise bad_member(where, f"lzma properties of {plen} bytes, expected 5", expected=5, found=plen)
    props, (dict_size,) = head[4], struct.unpack_from("<I", head, 5)
    if props >= 9 * 5 * 5:
        raise bad_member(where, f"bad lzma properties byte {props:#x}", found=props)
    need = max(min(dict_size, size), _LZMA_DICT_MIN)
    if need > memory_budget():
        raise bad_member(where, f"lzma dictionary of {need} bytes exceeds the memory budget", found=dict_size)
    filt = {
        "id": lzma.FILTER_LZMA1,
        "lc": props % 9,
        "lp": (props // 9) % 5,
        "pb": props // 45,
        "dict_size": need,
    }
    try:
        return lzma.LZMADecompressor(lzma.FORMAT_RAW, filters=[filt]), 9
    except (lzma.LZMAError, ValueError, MemoryError) as exc:
        raise bad_member(where, f"bad lzma header: {exc}") from None


def decode_chunks(raw: np.ndarray, method: int, size: int, where: str, chunk: int) -> Iterator[bytes]:
    """Decodes a bzip2 or lzma entry incrementally: pieces of <= ``chunk``
    bytes, never more than ``size`` in all (one byte more is asked for to
    detect a longer stream, and refused)."""
    name = records.METHOD_NAMES.get(method)
    d: bz2.BZ2Decompressor | lzma.LZMADecompressor
    if method == records.BZIP2:
        d, pos = bz2.BZ2Decompressor(), 0
    elif method == records.LZMA:
        d, pos = _lzma_decoder(raw, size, where)
    else:
        raise UnsupportedError(f"{where}: unsupported compression method {method}")
    view = memoryview(raw.data).cast("B") if raw.size else memoryview(b"")
    produced = idle = 0
    data: memoryview | bytes
    try:
        while not d.eof and idle < 2:
            if d.needs_input:
                if pos >= raw.size:
                    break
                data, pos = view[pos : pos + _IN_CHUNK], min(pos + _IN_CHUNK, raw.size)
            else:
                data = b""
            out = d.decompress(data, min(chunk, size - produced + 1))
            idle = 0 if (out or data) else idle + 1
            produced += len(out)
            if produced > size:
                raise bad_member(where, f"the {name} stream decodes to more than {size} bytes", expected=size)
            if out:
                yield out
    except (OSError, EOFError, lzma.LZMAError, ValueError, MemoryError) as exc:
        if isinstance(exc, BadArchiveError):
            raise
        raise bad_member(where, f"corrupt {name} stream: {exc}") from None
    if produced != size or (method == records.BZIP2 and not d.eof):
        raise bad_member(
            where,
            f"the {name} stream decodes to {produced} bytes{'' if d.eof else ' (truncated)'}, "
            f"expected {size}",
            expected=size,
            found=produced,
        )


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


def decompress(raw, method: int, size: int, name: str, *, expected: int | None = None) -> np.ndarray:
    """Decompresses a bzip2 or lzma entry into a new uint8 array of exactly ``size``
    bytes (deflate goes through :func:`inflate_many`, in parallel segments).

    ``size`` is checked (:func:`check_declared`) before anything is allocated and
    the stream is decoded in bounded pieces. Raises :class:`BadArchiveError`
    when the stream is corrupt or decodes to another size.
    """
    raw = np.frombuffer(raw, np.uint8) if not isinstance(raw, np.ndarray) else raw
    check_declared(size, int(raw.size), method, name, expected=expected)
    out = _alloc(size, name)
    pos = 0
    for piece in decode_chunks(raw, method, size, name, STREAM_CHUNK):
        out[pos : pos + len(piece)] = np.frombuffer(piece, np.uint8)
        pos += len(piece)
    return out


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


def segment_size_for(n: int, segment_size: int | None = None) -> int:
    """Segment size of an ``n``-byte entry: ``segment_size`` (default
    :data:`SEGMENT_SIZE`), or more so that the table stays below
    ``_MAX_SEGMENTS`` rows; never more than ``codec_kernels.MAX_SEGMENT``.

    Examples
    --------
    >>> from tdz_numba.zipfmt import compression as codecs
    >>> codecs.segment_size_for(10 << 20), codecs.segment_size_for(10 << 20, 1 << 20)
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
        outs = [_alloc(size, where) for where, _, size, _, _ in jobs]
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
    >>> from tdz_numba.zipfmt import compression as codecs
    >>> c = zlib.compressobj(6, zlib.DEFLATED, -15)
    >>> raw = np.frombuffer(c.compress(b"ab" * 50) + c.flush(), np.uint8)
    >>> codecs.decode_member(raw, "deflate", 100, zlib.crc32(b"ab" * 50), "m.npy").tobytes()[:4]
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


def crc_of(data, crc: int = 0) -> int:
    from zlib_ng import zlib_ng

    return zlib_ng.crc32(data, crc) if len(data) else crc


def check_crc(data: np.ndarray, crc: int, where: str) -> None:
    found = crc_of(data)
    if found != crc:
        raise crc_error(where, crc, found)
