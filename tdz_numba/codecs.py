"""Compression methods of zip entries: deflate (zlib-ng), bzip2 and lzma (stdlib).

Examples
--------
>>> import numpy as np
>>> from tdz_numba import codecs
>>> raw = bytes(1000)
>>> packed = codecs.compress(memoryview(raw), codecs.method_of("deflate"), None)
>>> bytes(codecs.decompress(packed, 8, 1000, "x.memmap")) == raw
True
"""

from __future__ import annotations

import bz2
import lzma
import struct

import numpy as np
from zlib_ng import zlib_ng

from . import records
from .errors import BadArchiveError, UnsupportedError

__all__ = ["method_of", "compress", "decompress", "COMPRESSION_NAMES"]

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
    """Compresses ``data`` (a buffer) into the bytes a zip entry of ``method`` stores."""
    if method == records.DEFLATED:
        c = zlib_ng.compressobj(-1 if level is None else level, zlib_ng.DEFLATED, -15)
        return c.compress(data) + c.flush()
    if method == records.BZIP2:
        return bz2.compress(data, 9 if level is None else level)
    if method == records.LZMA:
        props = lzma._encode_filter_properties({"id": lzma.FILTER_LZMA1})  # type: ignore[attr-defined]
        comp = lzma.LZMACompressor(lzma.FORMAT_RAW, filters=_lzma_filters(props))
        return struct.pack("<BBH", 9, 4, len(props)) + props + comp.compress(data) + comp.flush()
    raise UnsupportedError(f"cannot compress with zip method {method}")


def decompress(raw, method: int, size: int, name: str) -> np.ndarray:
    """Decompresses an entry into a new uint8 array of exactly ``size`` bytes.

    Raises :class:`BadArchiveError` when the stream is corrupt or decodes to
    another size.
    """
    try:
        if method == records.DEFLATED:
            d = zlib_ng.decompressobj(-15)
            # one extra byte detects oversized streams
            out = d.decompress(raw, size + 1)
            ok = d.eof and not d.unconsumed_tail
        elif method == records.BZIP2:
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
    except zlib_ng.error as exc:
        raise BadArchiveError(f"{name}: corrupt deflate stream: {exc}") from None
    if len(out) != size or not ok:
        raise BadArchiveError(
            f"{name}: the compressed stream decodes to {len(out)}{'+' if len(out) > size else ''} "
            f"bytes, expected {size}"
        )
    return np.frombuffer(bytearray(out), dtype=np.uint8)
