"""The protobuf wire format as the ONNX reader walks it: varints, a message's fields, strings
and the fields of a ``TensorProto``, read in place from the mapped bytes.

Every length and varint is bounded by its parent message (``end``); malformed input raises
:class:`WireError` (a :class:`~tdz_numba.BadArchiveError`), which the reader re-raises naming
the file. :func:`scan_varint` is the non-raising form that the fast path of
:mod:`~tdz_numba.formats.onnx_bulk` uses.

Examples
--------
>>> buf = memoryview(bytes([0x08, 0x96, 0x01, 0x42, 0x02]) + b"hi")  # field 1 = 150, field 8 = "hi"
>>> [(f, w, text(buf, v) if w == 2 else v) for f, w, v in fields(buf, 0, len(buf))]
[(1, 0, 150), (8, 2, 'hi')]
"""

from __future__ import annotations

from typing import Any

from ..errors import BadArchiveError
from ._shape import MAX_NDIM

__all__ = ["WireError", "scan_varint", "varint", "fields", "text", "signed", "pairs", "tensor_proto"]


class WireError(BadArchiveError):
    """Malformed protobuf: a truncated or over-long varint, field number 0, a length past its
    message, an unknown wire type (the caller names the file)."""


def scan_varint(buf: memoryview, pos: int, end: int) -> tuple[int, int]:
    """``(value, next position)`` of the varint at ``pos`` (before ``end``), as an unsigned 64-bit
    int; ``(-1, pos)`` when it is truncated, ``(-2, pos)`` when it runs over 10 bytes (no raise:
    the fast paths of :mod:`~tdz_numba.formats.onnx_bulk` fall back instead)."""
    if pos + 1 < end:  # one or two bytes: tags, names, dims and raw_data lengths below 16 KiB
        b = buf[pos]
        if b < 0x80:
            return b, pos + 1
        c = buf[pos + 1]
        if c < 0x80:
            return (b & 0x7F) | (c << 7), pos + 2
    value = shift = 0
    for _ in range(10):
        if pos >= end:
            return -1, pos
        b = buf[pos]
        pos += 1
        value |= (b & 0x7F) << shift
        if b < 0x80:
            return value & 0xFFFFFFFFFFFFFFFF, pos
        shift += 7
    return -2, pos


def varint(buf: memoryview, pos: int, end: int) -> tuple[int, int]:
    """:func:`scan_varint` that raises :class:`WireError` where it fails."""
    if pos < end and buf[pos] < 0x80:  # one byte: tags, small lengths and dims
        return buf[pos], pos + 1
    value, pos = scan_varint(buf, pos, end)
    if value < 0:
        raise WireError(
            f"truncated varint at offset {pos}"
            if value == -1
            else f"varint longer than 10 bytes at offset {pos}"
        )
    return value, pos


def fields(buf: memoryview, start: int, end: int):
    """``(field, wire type, value)`` of one message: varints as ints, LEN as ``(offset, length)``,
    fixed-size values as their offset."""
    pos = start
    while pos < end:
        tag, pos = varint(buf, pos, end)
        field, wire = tag >> 3, tag & 7
        if field == 0:
            raise WireError(f"field number 0 at offset {pos}")
        if wire == 0:
            value, pos = varint(buf, pos, end)
            yield field, wire, value
        elif wire == 2:
            n, pos = varint(buf, pos, end)
            if n > end - pos:
                raise WireError(f"field {field} at offset {pos}: length {n} runs past its message")
            yield field, wire, (pos, n)
            pos += n
        elif wire in (1, 5):
            size = 8 if wire == 1 else 4
            if size > end - pos:
                raise WireError(f"field {field} at offset {pos}: truncated fixed-size value")
            yield field, wire, pos
            pos += size
        else:
            raise WireError(f"field {field}: unsupported wire type {wire} at offset {pos}")


def text(buf: memoryview, v: Any) -> str:
    """The UTF-8 string of a LEN value ``(offset, length)`` (invalid bytes replaced)."""
    off, n = v
    return bytes(buf[off : off + n]).decode("utf-8", errors="replace")


def signed(v: int) -> int:
    """An ``int64`` field's value from its varint (two's complement in 64 bits)."""
    return v - (1 << 64) if v >= 1 << 63 else v


def pairs(buf: memoryview, v: tuple[int, int]) -> tuple[str, str]:
    """``(key, value)`` of a ``StringStringEntryProto`` (fields 1 and 2; a missing one is ``""``)."""
    key = value = ""
    for f, w, x in fields(buf, v[0], v[0] + v[1]):
        if w == 2 and f == 1:
            key = text(buf, x)
        elif w == 2 and f == 2:
            value = text(buf, x)
    return key, value


def tensor_proto(buf: memoryview, start: int, end: int) -> dict[str, Any]:
    """The fields of the ``TensorProto`` in ``buf[start:end]`` that the reader uses, as a dict:
    ``dims`` (at most :data:`~tdz_numba.formats._shape.MAX_NDIM` + 1 kept; ``ndim`` counts all),
    ``data_type``, ``name``, ``raw`` (the span of ``raw_data``), ``location``, ``external``
    (key/value pairs), ``typed`` (field number -> ``(wire type, value)`` list), ``strings``
    (spans) and ``segment`` (whether field 3 was present)."""
    t: dict[str, Any] = {
        "dims": [],
        "data_type": 0,
        "name": "",
        "raw": None,
        "location": 0,
        "external": [],
        "typed": {},
        "strings": [],
        "segment": False,
        "ndim": 0,
    }
    dims = t["dims"]
    for f, w, v in fields(buf, start, end):
        if f == 1:  # dims: packed or one varint each; past MAX_NDIM only counted
            if w == 2:
                pos, stop = v[0], v[0] + v[1]
                while pos < stop:
                    d, pos = varint(buf, pos, stop)
                    t["ndim"] += 1
                    if len(dims) <= MAX_NDIM:
                        dims.append(signed(d))
            elif w == 0:
                t["ndim"] += 1
                if len(dims) <= MAX_NDIM:
                    dims.append(signed(v))
        elif f == 2 and w == 0:
            t["data_type"] = v
        elif f == 3:
            t["segment"] = True
        elif f == 6 and w == 2:
            t["strings"].append(v)
        elif f == 8 and w == 2:
            t["name"] = text(buf, v)
        elif f == 9 and w == 2:
            t["raw"] = v  # the last occurrence wins, as in protobuf
        elif f == 13 and w == 2:
            t["external"].append(pairs(buf, v))
        elif f == 14 and w == 0:
            t["location"] = v
        elif f in (4, 5, 7, 10, 11):
            t["typed"].setdefault(f, []).append((w, v))
    return t
