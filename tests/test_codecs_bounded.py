"""Bounded decoding: declared sizes checked before allocation, output never
written past the declared size, bzip2/lzma decoded in pieces, lzma
dictionaries clamped, 64-bit lengths (> 4 GiB single streams), and
:func:`members.decode_member` against the stdlib oracles.

Oracles: :func:`zlib.decompress` (``wbits=-15``), :mod:`bz2`, :mod:`lzma`,
:func:`zlib.crc32`.
"""

from __future__ import annotations

import bz2
import mmap
import struct
import zlib

import numpy as np
import pytest

from tdz_numba.errors import BadArchiveError, ChecksumError, TdzError, UnsupportedError
from tdz_numba.zipfmt import compression as codecs
from tdz_numba.zipfmt import members, stream
from tdz_numba.zipfmt.kernels import deflate as codec_kernels

EDGE = [0, 1, 63, 64, 65, 4095, 4096, 4097, 3 * 4096, 100_000]
GUARD = 4096


def data_of(n: int, seed: int = 0) -> bytes:
    rng = np.random.default_rng(seed + n)
    return (rng.integers(0, 6, n) + (np.arange(n) % 7) + 65).astype(np.uint8).tobytes()


def deflate(b: bytes, level: int = 6) -> bytes:
    c = zlib.compressobj(level, zlib.DEFLATED, -15)
    return c.compress(b) + c.flush()


def lzma_entry(b: bytes) -> bytes:
    return codecs.compress(b, codecs.method_of("lzma"), None)


def u8(b: bytes) -> np.ndarray:
    return np.frombuffer(b, np.uint8)


def encode(codec: str, b: bytes) -> bytes:
    return {"deflate": deflate, "bzip2": bz2.compress, "lzma": lzma_entry}[codec](b)


# ---------------------------------------------------------------------------
# decode_member: oracles at edge sizes
# ---------------------------------------------------------------------------
@pytest.mark.parametrize("codec", ["deflate", "bzip2", "lzma"])
@pytest.mark.parametrize("n", EDGE)
def test_decode_member_matches_stdlib(codec, n):
    b = data_of(n)
    out = members.decode_member(u8(encode(codec, b)), codec, n, zlib.crc32(b), "m", 1)
    assert out.dtype == np.uint8 and out.size == n and out.tobytes() == b
    assert members.decode_member(u8(encode(codec, b)), codec, n, None, "m", None, expected=n).tobytes() == b


@pytest.mark.parametrize("codec", ["deflate", "bzip2", "lzma"])
def test_decode_member_crc_and_sizes(codec):
    b = data_of(5000)
    raw = u8(encode(codec, b))
    with pytest.raises(ChecksumError, match="CRC-32 mismatch"):
        members.decode_member(raw, codec, 5000, zlib.crc32(b) ^ 1, "m.npy")
    for size in (4999, 5001, 0):
        with pytest.raises(BadArchiveError, match="m.npy"):
            members.decode_member(raw, codec, size, None, "m.npy")
    with pytest.raises(BadArchiveError, match="expected 4000") as info:
        members.decode_member(raw, codec, 5000, None, "m.npy", expected=4000)
    assert info.value.expected == 4000 and info.value.found == 5000


def test_decode_member_unknown_codec_and_readonly_mmap(tmp_path):
    with pytest.raises(UnsupportedError, match="zstd"):
        members.decode_member(u8(b"xx"), "zstd", 1, None, "m")
    b = data_of(70_000)
    p = tmp_path / "d.bin"
    p.write_bytes(b"pad" + deflate(b))
    with open(p, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as m:
        view = np.frombuffer(m, np.uint8)[3:]
        assert members.decode_member(view, "deflate", len(b), zlib.crc32(b), "m").tobytes() == b
        del view


# ---------------------------------------------------------------------------
# declared sizes checked before allocation
# ---------------------------------------------------------------------------
@pytest.mark.parametrize("size", [int(4e12), 2**63 - 1, 2**63, 2**64 + 5])
def test_deflate_bomb_claims_are_refused_before_allocation(size):
    raw = u8(deflate(bytes(1000)))
    with pytest.raises(BadArchiveError, match="1032:1"):
        members.decode_member(raw, "deflate", size, 0, "bomb")
    with pytest.raises(BadArchiveError, match="1032:1"):
        members.inflate_many([("bomb", raw, size, 0, None)], 1)


def test_negative_size_refused():
    with pytest.raises(BadArchiveError, match="negative"):
        members.decode_member(u8(deflate(b"")), "deflate", -1, 0, "neg")


@pytest.mark.parametrize("codec", ["bzip2", "lzma"])
@pytest.mark.parametrize("size", [2**63 - 1, 2**63, 10**13])
def test_bz2_lzma_huge_claims_refused(codec, size):
    with pytest.raises(BadArchiveError, match="memory budget"):
        members.decode_member(u8(encode(codec, b"y" * 1000)), codec, size, None, "claim")


def test_memory_budget_is_overridable(monkeypatch):
    assert codecs.memory_budget() > 0
    monkeypatch.setattr(codecs, "MAX_DECODED", 10_000)
    assert codecs.memory_budget() == 10_000
    b = bytes(20_000)
    with pytest.raises(BadArchiveError, match="memory budget of 10000"):
        members.decode_member(u8(deflate(b)), "deflate", len(b), None, "big")
    with pytest.raises(BadArchiveError, match="memory budget"):
        members.decode_member(u8(bz2.compress(b)), "bzip2", len(b), None, "big")
    # a batch: each entry fits, their sum does not
    jobs = [(f"e{i}", u8(deflate(bytes(6000))), 6000, None, None) for i in range(2)]
    with pytest.raises(BadArchiveError, match="together declare 12000"):
        members.inflate_many(jobs, 1)
    # into a caller's buffer: its size is the limit; outputs are consecutive views of it
    buf = np.empty(12_000, np.uint8)
    outs = members.inflate_many(jobs, 1, into=buf)
    assert [o.ctypes.data - buf.ctypes.data for o in outs] == [0, 6000] and not buf.any()
    with pytest.raises(BadArchiveError, match="12000"):
        members.inflate_many(jobs, 1, into=buf[:11_999])
    # streaming holds nothing of the entry's size: allowed
    assert stream.stream_member(
        u8(deflate(b)), 8, len(b), zlib.crc32(b), None, None, "s", chunk=4096
    ) == zlib.crc32(b)


def test_lzma_huge_dictionary_is_clamped():
    b = data_of(50_000)
    raw = bytearray(lzma_entry(b))
    assert struct.unpack_from("<HB", raw, 2) == (5, raw[4])
    raw[5:9] = struct.pack("<I", 0xFFFFFFFF)  # asks for a 4 GiB dictionary
    out = members.decode_member(u8(bytes(raw)), "lzma", len(b), zlib.crc32(b), "dict")
    assert out.tobytes() == b


def test_lzma_dictionary_over_budget_refused(monkeypatch):
    b = bytes(200_000)
    raw = bytearray(lzma_entry(b))
    raw[5:9] = struct.pack("<I", 0xFFFFFFFF)
    monkeypatch.setattr(codecs, "MAX_DECODED", 100_000)
    with pytest.raises(BadArchiveError, match="lzma dictionary"):
        stream.stream_member(u8(bytes(raw)), 14, len(b), None, None, None, "dict")


@pytest.mark.parametrize(
    "mutate, match",
    [
        (lambda r: r[:5], "truncated lzma header"),
        (lambda r: r[:2] + struct.pack("<H", 6) + r[4:], "properties of 6 bytes"),
        (lambda r: r[:4] + bytes([230]) + r[5:], "properties byte"),
        (lambda r: r[:20], "lzma"),
        (lambda r: r[:9] + bytes(len(r) - 9), "lzma"),
    ],
)
def test_lzma_bad_headers_and_streams(mutate, match):
    b = data_of(3000)
    with pytest.raises(BadArchiveError, match=match):
        members.decode_member(u8(mutate(lzma_entry(b))), "lzma", len(b), zlib.crc32(b), "l")


@pytest.mark.parametrize("codec", ["deflate", "bzip2", "lzma"])
def test_corrupt_streams_raise_tdz_errors(codec):
    b = data_of(30_000)
    good = encode(codec, b)
    rng = np.random.default_rng(1)
    refused = 0
    for trial in range(40):
        raw = bytearray(good)
        for pos in rng.integers(0, len(raw), 1 + trial % 4):
            raw[int(pos)] ^= int(rng.integers(1, 256))
        if trial % 5 == 0:
            raw = raw[: int(rng.integers(0, len(raw)))]
        data = u8(bytes(raw))
        # a flip may still decode (e.g. inside a stored block): then the CRC check refuses it, so whatever
        # is returned without an error is the original data
        try:
            out = members.decode_member(data, codec, len(b), zlib.crc32(b), "c")
        except TdzError:
            refused += 1
        else:
            assert out.tobytes() == b, trial
        pieces: list[bytes] = []
        try:
            n = stream.stream_member(
                data,
                codecs.CODEC_METHODS[codec],
                len(b),
                zlib.crc32(b),
                None,
                lambda piece, out=pieces: out.append(piece.tobytes()),
                "c",
                chunk=4096,
            )
        except TdzError:
            refused += 1
        else:
            assert n == len(b) and b"".join(pieces) == b, trial
    assert refused >= 40  # most mutations are refused (both paths agree on each)


# ---------------------------------------------------------------------------
# the kernels never write past the output (guard region)
# ---------------------------------------------------------------------------
def _guarded(n: int) -> np.ndarray:
    buf = np.full(n + GUARD, 0xAB, np.uint8)
    return buf


@pytest.mark.parametrize("n_true, n_told", [(10_000, 5_000), (10_000, 9_999), (10_000, 1), (10_000, 0)])
def test_inflate_segments_stays_inside_output(n_true, n_told):
    b = data_of(n_true)
    raw = u8(deflate(b))
    buf = _guarded(max(n_told, 1))
    crc, status = codec_kernels.inflate_segments(
        np.array([raw.ctypes.data], np.int64),
        np.array([raw.size], np.int64),
        np.array([buf.ctypes.data], np.int64),
        np.array([n_told], np.int64),
        np.array([True]),
    )
    assert status[0] != 0
    assert (buf[n_told:] == 0xAB).all() if n_told else (buf[1:] == 0xAB).all()
    assert buf[:n_told].tobytes() == b[:n_told]


def test_inflate_segments_lying_streams_stay_inside_output():
    rng = np.random.default_rng(7)
    b = data_of(20_000)
    good = deflate(b)
    for trial in range(60):
        raw = bytearray(good)
        for pos in rng.integers(0, len(raw), 3):
            raw[int(pos)] ^= int(rng.integers(1, 256))
        raw = u8(bytes(raw))
        told = int(rng.integers(0, 20_001))
        buf = _guarded(told)
        _, status = codec_kernels.inflate_segments(
            np.array([raw.ctypes.data], np.int64),
            np.array([raw.size], np.int64),
            np.array([buf.ctypes.data], np.int64),
            np.array([told], np.int64),
            np.array([True]),
        )
        assert (buf[told:] == 0xAB).all(), trial


def test_inflate_step_stays_inside_output():
    b = data_of(50_000)
    raw = u8(deflate(b))
    strm = np.zeros(13, np.uint64)
    assert codec_kernels.inflate_open(strm) == 0
    try:
        buf = _guarded(1000)
        used, got, rc, crc = codec_kernels.inflate_step(
            strm, raw.ctypes.data, raw.size, buf.ctypes.data, 1000, 0
        )
        assert got == 1000 and rc == 0 and 0 < used <= raw.size
        assert buf[:1000].tobytes() == b[:1000] and (buf[1000:] == 0xAB).all()
        assert int(crc) == zlib.crc32(b[:1000])
    finally:
        codec_kernels.inflate_close(strm)


def test_deflate_segments_enforce_max_segment():
    a = np.zeros(16, np.uint8)
    out = np.zeros(64, np.uint8)
    for n, cap in [(codec_kernels.MAX_SEGMENT + 1, 64), (16, 1 << 32), (-1, 64)]:
        _, _, status = codec_kernels.deflate_segments(
            np.array([a.ctypes.data], np.int64),
            np.array([n], np.int64),
            np.array([out.ctypes.data], np.int64),
            np.array([cap], np.int64),
            np.array([True]),
            np.int64(6),
        )
        assert status[0] == -2
    assert members.segment_size_for(1 << 20, 1 << 40) == codec_kernels.MAX_SEGMENT


def test_segment_size_parameter():
    a = u8(data_of(10_000))
    (r,) = members.deflate_many([a], None, 1, segment_size=3000)
    seg, clens = members.parse_segment_table(r.table, "t")
    assert seg == 3000 and len(clens) == 4
    (r2,) = members.deflate_many([a], None, 1)
    assert r2.table == b""  # default 4 MiB: one segment
    assert zlib.decompress(b"".join(p.tobytes() for p in r.parts), wbits=-15) == a.tobytes()
    with pytest.raises(ValueError):
        members.segment_size_for(10, 0)


# ---------------------------------------------------------------------------
# > 4 GiB single stream (no segment table), built by repeating a full-flushed piece
# ---------------------------------------------------------------------------
def big_zero_stream(piece: int, reps: int) -> tuple[np.ndarray, int, int]:
    from tdz_numba.zipfmt.kernels.crc import crc32_zeros

    c = zlib.compressobj(9, zlib.DEFLATED, -15)
    p = c.compress(bytes(piece)) + c.flush(zlib.Z_FULL_FLUSH)
    return u8(p * reps + c.flush(zlib.Z_FINISH)), piece * reps, int(crc32_zeros(piece * reps))


def _mem_available() -> int:
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0


def test_stream_member_single_stream_past_4_gib():
    raw, size, crc = big_zero_stream(64 << 20, 65)  # 4.06 GiB
    assert size > 1 << 32
    sizes = []
    assert stream.stream_member(raw, 8, size, crc, None, lambda p: sizes.append(p.size), "big") == crc
    assert sum(sizes) == size and max(sizes) == codecs.STREAM_CHUNK
    with pytest.raises(BadArchiveError, match="decodes to more than"):
        stream.stream_member(raw, 8, size - 1, None, None, None, "big")


@pytest.mark.skipif(_mem_available() < 12 << 30, reason="needs ~5 GiB of free memory")
def test_decode_member_single_stream_past_4_gib():
    raw, size, crc = big_zero_stream(64 << 20, 65)
    out = members.decode_member(raw, "deflate", size, crc, "big", 2)
    assert out.size == size
    assert not out[(1 << 32) - 8 : (1 << 32) + 8].any() and not out[-16:].any()


@pytest.mark.skipif(_mem_available() < 12 << 30, reason="needs ~5 GiB of free memory")
def test_zipfile_written_entry_past_4_gib_loads_and_verifies(tmp_path, monkeypatch):
    """A >= 4 GiB deflate entry as zipfile writes it (zip64, one stream, no
    segment table): ``zipfile`` writes the headers and CRC, the stream is the
    repeated full-flushed piece (so the test needs no 4 GiB deflate)."""
    import json
    import zipfile

    import tdz_numba

    piece, reps = 64 << 20, 65
    c = zlib.compressobj(9, zlib.DEFLATED, -15)
    body = c.compress(bytes(piece)) + c.flush(zlib.Z_FULL_FLUSH)
    end = c.flush(zlib.Z_FINISH)

    class Repeat:  # stands in for zlib's compressor: one piece per 64 MiB written
        def compress(self, data):
            assert len(data) == piece
            return body

        def flush(self):
            return end

    real = zipfile._get_compressor
    p = tmp_path / "big.tdz"
    with zipfile.ZipFile(p, "w") as z:
        meta = {
            "x": {"device": "cpu", "shape": [piece * reps], "dtype": "torch.uint8", "is_nested": False},
            "shape": [],
            "device": "cpu",
            "_type": "<class 'tensordict._td.TensorDict'>",
            "_format_version": 1,
            "_class": "tensordict:TensorDict",
        }
        z.writestr("meta.json", json.dumps(meta))
        monkeypatch.setattr(zipfile, "_get_compressor", lambda *a, **k: Repeat())
        info = zipfile.ZipInfo("x.memmap")
        info.compress_type = zipfile.ZIP_DEFLATED
        zeros = bytes(piece)
        with z.open(info, "w", force_zip64=True) as f:
            for _ in range(reps):
                f.write(zeros)
        monkeypatch.setattr(zipfile, "_get_compressor", real)
    with zipfile.ZipFile(p) as z:
        assert z.getinfo("x.memmap").file_size == piece * reps > 1 << 32
    assert tdz_numba.verify(p).payload_bytes > 1 << 32  # streamed
    with tdz_numba.open(p) as ar:
        x = ar["x"]
        assert x.numel() == piece * reps
        assert not x[(1 << 32) - 8 : (1 << 32) + 8].any() and not x[-16:].any()


def test_leaf_size_claims_checked_before_inflating(tmp_path, monkeypatch):
    """meta.json claims 1e12 floats for a small deflated entry: load, to_dict
    and verify refuse it without inflating anything."""
    import json
    import zipfile

    import tdz_numba

    p = tmp_path / "claim.tdz"
    meta = {
        "x": {"device": "cpu", "shape": [10**12], "dtype": "torch.float32", "is_nested": False},
        "shape": [],
        "device": "cpu",
        "_type": "<class 'tensordict._td.TensorDict'>",
        "_format_version": 1,
        "_class": "tensordict:TensorDict",
    }
    with zipfile.ZipFile(p, "w") as z:
        z.writestr("meta.json", json.dumps(meta))
        z.writestr("x.memmap", bytes(4000), compress_type=zipfile.ZIP_DEFLATED)
    calls = []
    real = members.inflate_many
    monkeypatch.setattr(
        members, "inflate_many", lambda jobs, *a, **k: calls.append(jobs) or real(jobs, *a, **k)
    )
    with pytest.raises(BadArchiveError, match="4000"):
        tdz_numba.load(p)
    with pytest.raises(BadArchiveError, match="4000"):
        tdz_numba.verify(p)
    assert calls == []
