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

import numpy as np

from ..errors import BadArchiveError, ChecksumError, UnknownCompressionError, UnsupportedError
from . import records

__all__ = [
    "allocate_output",
    "bad_member",
    "crc_error",
    "crc_of",
    "check_crc",
    "decode_chunks",
    "method_of",
    "check_level",
    "compress",
    "decompress",
    "check_declared",
    "memory_budget",
    "COMPRESSION_NAMES",
    "CODEC_METHODS",
    "MAX_DECODED",
    "STREAM_CHUNK",
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


def allocate_output(size: int, where: str) -> np.ndarray:
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
    out = allocate_output(size, name)
    pos = 0
    for piece in decode_chunks(raw, method, size, name, STREAM_CHUNK):
        out[pos : pos + len(piece)] = np.frombuffer(piece, np.uint8)
        pos += len(piece)
    return out


def crc_of(data, crc: int = 0) -> int:
    from zlib_ng import zlib_ng

    return zlib_ng.crc32(data, crc) if len(data) else crc


def check_crc(data: np.ndarray, crc: int, where: str) -> None:
    found = crc_of(data)
    if found != crc:
        raise crc_error(where, crc, found)
