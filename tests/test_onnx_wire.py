"""The protobuf wire primitives of the ONNX reader against protobuf's own varint coder."""

from __future__ import annotations

import pytest

pytest.importorskip("google.protobuf")
from google.protobuf.internal import decoder, encoder  # noqa: E402

from tdz_numba import BadArchiveError  # noqa: E402
from tdz_numba.formats.onnx_wire import WireError, fields, pairs, scan_varint, signed, text, varint  # noqa: E402

VALUES = [0, 1, 127, 128, 255, 300, 16383, 16384, 2**21 - 1, 2**21, 2**32, 2**63 - 1, 2**63, 2**64 - 1]


def _encode(v: int) -> bytes:
    out: list[bytes] = []
    encoder._VarintEncoder()(out.append, v, True)
    return b"".join(out)


@pytest.mark.parametrize("value", VALUES)
@pytest.mark.parametrize("pad", [0, 3])
def test_varints_match_protobuf(value, pad):
    data = b"\xaa" * pad + _encode(value) + b"\x01\x02"
    want, stop = decoder._DecodeVarint(data, pad)
    assert (want, stop) == (value, pad + len(_encode(value)))
    buf = memoryview(data)
    assert scan_varint(buf, pad, len(data)) == (want, stop) == varint(buf, pad, len(data))
    assert scan_varint(buf, pad, stop) == (want, stop)  # ending exactly at its bound


def test_bad_varints():
    trunc = memoryview(b"\x80\x80")
    assert scan_varint(trunc, 0, 2) == (-1, 2)
    assert scan_varint(memoryview(b"\x96\x01"), 0, 1)[0] == -1  # the bound cuts it
    with pytest.raises(WireError, match="truncated varint at offset 2"):
        varint(trunc, 0, 2)
    long = memoryview(b"\xff" * 10 + b"\x01")
    assert scan_varint(long, 0, 11) == (-2, 10)
    assert scan_varint(long, 0, 10) == (-2, 10)  # ten continuation bytes up to the bound: too long
    with pytest.raises(WireError, match="longer than 10 bytes") as info:
        varint(long, 0, 11)
    assert isinstance(info.value, BadArchiveError)


def test_fields_text_pairs_signed():
    entry = b"\x0a\x01k\x12\x02vv"  # StringStringEntryProto: key "k", value "vv"
    msg = b"\x08\x96\x01" + b"\x72" + bytes([len(entry)]) + entry + b"\x15" + b"\x00\x00\x80\x3f"
    buf = memoryview(msg)
    got = list(fields(buf, 0, len(msg)))
    assert [(f, w) for f, w, _ in got] == [(1, 0), (14, 2), (2, 5)]
    assert got[0][2] == 150 and pairs(buf, got[1][2]) == ("k", "vv") and got[2][2] == len(msg) - 4
    assert text(memoryview(b"\xffa"), (0, 2)) == "\ufffda"  # invalid UTF-8 replaced
    assert signed(2**64 - 1) == -1 and signed(5) == 5
    with pytest.raises(WireError, match="runs past its message"):
        list(fields(memoryview(b"\x0a\x05ab"), 0, 4))
    with pytest.raises(WireError, match="field number 0"):
        list(fields(memoryview(b"\x00\x01"), 0, 2))
    with pytest.raises(WireError, match="wire type 3"):
        list(fields(memoryview(b"\x0b"), 0, 1))
