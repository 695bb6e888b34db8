"""Compression of ``.tdz`` payloads: parallel segmented deflate (Numba + zlib-ng),
bzip2 and lzma.

Covers:

1. kernel oracles: ``codec_kernels.deflate_segments`` / ``inflate_segments``
   against the stdlib :mod:`zlib` (edge sizes, random and zero data, several
   segments, read-only mmap input, CRCs);
2. round trips for every codec (dtypes, nested levels, empty leaves, sizes
   around the segment size) checked by ``zipfile``, ``unzip -t`` and a
   by-hand parse of the 0x7A74 segment-table extra block;
3. interop with tensordict 0.15.3 and stdlib ``zipfile`` archives;
4. ``num_threads`` determinism and validation;
5. lazy inflation (``open`` inflates nothing, ``to_dict`` batches);
6. corrupt payloads, segment tables and CRCs; ``mode="r+"``; unknown codecs;
7. ``verify`` on compressed archives.

Data stay small (a few hundred KiB per test): the writer's deflate is given
4 KiB segments (``deflate_many(..., segment_size=...)``) to reach segment
boundaries cheaply.
"""

from __future__ import annotations

import math
import mmap
import os
import re
import shutil
import struct
import subprocess
import warnings
import zipfile
import zlib
from pathlib import Path

import numpy as np
import pytest
import torch
from ziputil import parse_zip, payload_offset, zero_timestamps

import tdz_numba
from tdz_numba.errors import BadArchiveError, ChecksumError, InvalidArgumentError, TdzError, UnsupportedError
from tdz_numba.zipfmt import members, records
from tdz_numba.zipfmt.kernels import deflate as codec_kernels

pytestmark = [
    pytest.mark.filterwarnings("ignore::FutureWarning"),
    pytest.mark.filterwarnings("ignore::UserWarning"),
]

HAVE_UNZIP = shutil.which("unzip") is not None
SEG = 4096
CODECS = ["deflate", "bzip2", "lzma", "stored"]
METHOD = {"stored": 0, "deflate": 8, "bzip2": 12, "lzma": 14}
EDGE_SIZES = [0, 1, 63, 64, 65, 4096, 4097]


@pytest.fixture
def small_segments(monkeypatch):
    """4 KiB deflate segments for every save in the test (the writer calls
    ``members.deflate_many``; its ``segment_size`` argument is bound here)."""
    real = members.deflate_many

    def small(arrays, level, num_threads, segment_size=SEG):
        return real(arrays, level, num_threads, segment_size)

    monkeypatch.setattr(members, "deflate_many", small)
    return SEG


# ---------------------------------------------------------------------------
# helpers
# ---------------------------------------------------------------------------
def make_bytes(kind: str, n: int, seed: int = 0) -> np.ndarray:
    rng = np.random.default_rng(seed + n)
    if kind == "zeros":
        return np.zeros(n, np.uint8)
    if kind == "random":
        return rng.integers(0, 256, n, dtype=np.uint8)
    if kind == "text":  # compressible but not trivial: Huffman-coded blocks
        return (rng.integers(0, 8, n) + (np.arange(n) % 13) + 65).astype(np.uint8)
    raise AssertionError(kind)


def _i64(values) -> np.ndarray:
    return np.asarray(values, np.int64)


def kernel_deflate(data: np.ndarray, seg: int | None, level: int = 6):
    """Deflates ``data`` with the kernel in segments of ``seg`` bytes (None: one).

    Returns ``(list of segment bytes, crcs, statuses, input segments)``.
    """
    data = np.ascontiguousarray(data)
    n = data.size
    step = max(n, 1) if seg is None else seg
    starts = list(range(0, n, step)) or [0]
    lens = [min(step, n - s) for s in starts]
    caps = [int(codec_kernels.deflate_bound(x)) for x in lens]
    scratch = np.empty(sum(caps), np.uint8)
    offs = np.zeros(len(caps), np.int64)
    np.cumsum(caps[:-1], out=offs[1:])
    base = data.ctypes.data
    last = np.zeros(len(starts), np.bool_)
    last[-1] = True
    out_len, crcs, status = codec_kernels.deflate_segments(
        _i64([base + s for s in starts]),
        _i64(lens),
        scratch.ctypes.data + offs,
        _i64(caps),
        last,
        np.int64(level),
    )
    parts = [scratch[o : o + int(k)].tobytes() for o, k in zip(offs.tolist(), out_len.tolist())]
    inputs = [data[s : s + x].tobytes() for s, x in zip(starts, lens)]
    return parts, crcs, status, inputs


def zlib_segments(data: bytes, seg: int | None, level: int = 6) -> list[bytes]:
    """The stdlib's equivalent of the writer: fresh stream per segment, full
    flush, the last one finished."""
    n = len(data)
    step = max(n, 1) if seg is None else seg
    starts = list(range(0, n, step)) or [0]
    out = []
    for j, s in enumerate(starts):
        c = zlib.compressobj(level, zlib.DEFLATED, -15)
        body = c.compress(data[s : s + step])
        out.append(body + (c.flush() if j == len(starts) - 1 else c.flush(zlib.Z_FULL_FLUSH)))
    return out


def kernel_inflate(parts: list[bytes], sizes: list[int], src_buf: np.ndarray | None = None):
    """Inflates concatenated segments with the kernel into one preallocated array."""
    src = np.frombuffer(b"".join(parts), np.uint8) if src_buf is None else src_buf
    total = sum(sizes)
    out = np.empty(total, np.uint8)
    clens = [len(p) for p in parts]
    soffs = np.concatenate([[0], np.cumsum(clens)[:-1]]).astype(np.int64)
    doffs = np.concatenate([[0], np.cumsum(sizes)[:-1]]).astype(np.int64)
    last = np.zeros(len(parts), np.bool_)
    last[-1] = True
    crcs, status = codec_kernels.inflate_segments(
        src.ctypes.data + soffs, _i64(clens), out.ctypes.data + doffs, _i64(sizes), last
    )
    return out, crcs, status


class LocalEntry:
    def __init__(self, info, buf, central_offset):
        self.info = info
        self.name = info.filename
        h = info.header_offset
        self.header_offset = h
        self.central_offset = central_offset
        self.payload_offset = payload_offset(buf, h)
        name_len, extra_len = struct.unpack_from("<HH", buf, h + 26)
        self.extra_offset = h + 30 + name_len
        self.extra = bytes(buf[self.extra_offset : self.payload_offset])
        self.blocks = []  # (id, offset of the body in the file, body)
        pos = 0
        while pos + 4 <= len(self.extra):
            tag, size = struct.unpack_from("<HH", self.extra, pos)
            self.blocks.append((tag, self.extra_offset + pos + 4, self.extra[pos + 4 : pos + 4 + size]))
            pos += 4 + size
        assert pos == len(self.extra), f"{self.name}: extra field does not parse"

    @property
    def ids(self):
        return [b[0] for b in self.blocks]

    def table(self):
        """``(body offset, version, segment, count, lengths)`` or None."""
        for tag, off, body in self.blocks:
            if tag == records.SEGMENT_EXTRA_ID:
                version, segment, count = struct.unpack_from("<IQI", body)
                assert len(body) == 16 + 4 * count
                return off, version, segment, count, list(struct.unpack_from(f"<{count}I", body, 16))
        return None


def zip_entries(path) -> dict[str, LocalEntry]:
    """Every entry's local header, parsed by hand (and its central record offset)."""
    buf = Path(path).read_bytes()
    with zipfile.ZipFile(path) as z:
        infos = z.infolist()
    records = parse_zip(buf).records  # tests/ziputil.py: the one hand parser
    assert [r.name for r in records] == [info.filename for info in infos]
    return {info.filename: LocalEntry(info, buf, r.cpos) for info, r in zip(infos, records)}


def patch_file(path, offset: int, data: bytes) -> None:
    with open(path, "r+b") as f:
        f.seek(offset)
        f.write(data)


def unzip_test(path) -> subprocess.CompletedProcess:
    return subprocess.run(["unzip", "-t", str(path)], capture_output=True, text=True, timeout=60)


def as_torch(v):
    return torch.from_numpy(v) if isinstance(v, np.ndarray) else v


def assert_tree_equal(got, want, where=""):
    """``got`` (a Level or dict from load/to_dict) holds ``want``'s values."""
    assert set(got) == set(want), f"{where}: keys {sorted(got)} != {sorted(want)}"
    for k, w in want.items():
        g = got[k]
        if isinstance(w, dict):
            assert_tree_equal(g, w, f"{where}/{k}")
        elif isinstance(w, (torch.Tensor, np.ndarray)):
            w = as_torch(w)
            assert isinstance(g, torch.Tensor), f"{where}/{k}: {type(g)}"
            assert g.dtype == w.dtype and g.shape == w.shape, (
                f"{where}/{k}: {g.dtype}{g.shape} vs {w.dtype}{w.shape}"
            )
            assert torch.equal(g, w), f"{where}/{k}: values differ"
        else:
            assert g == w, f"{where}/{k}"


def tensor_leaves(tree, prefix=""):
    for k, v in tree.items():
        if isinstance(v, dict):
            yield from tensor_leaves(v, f"{prefix}{k}/")
        elif isinstance(v, (torch.Tensor, np.ndarray)):
            yield prefix + k, as_torch(v)


def sample_tree():
    """Several dtypes, nested levels, empty leaves, and payloads smaller than,
    exactly one / several times, and one byte over a 4 KiB segment."""
    g = torch.Generator().manual_seed(0)
    return {
        "f32_small": torch.randn(10, generator=g),  # 40 B < one segment
        "u8_exact": torch.from_numpy(make_bytes("text", SEG)),  # exactly one segment
        "i64_multiple": torch.arange(3 * SEG // 8, dtype=torch.int64).reshape(3, -1),  # exactly 3
        "u8_over": torch.from_numpy(make_bytes("random", SEG + 1)),  # 2 segments, 1 byte in the 2nd
        "f64_exact": torch.randn(8, 64, dtype=torch.float64, generator=g),  # 4096 B
        "zeros": torch.zeros(10_000, dtype=torch.int32),  # 40000 B: 10 segments, compressible
        "empty": torch.empty(0),
        "np_i16": np.arange(3000, dtype=np.int16),  # 6000 B: 2 segments
        "tag": "hello",
        "lvl1": {
            "bf16": torch.randn(3, 700, generator=g).to(torch.bfloat16),  # 4200 B
            "bool": torch.rand(5000, generator=g) > 0.5,  # 5000 B
            "lvl2": {
                "f16": torch.randn(2049, generator=g).to(torch.float16),  # 4098 B
                "c64": torch.randn(600, dtype=torch.complex64, generator=g),  # 4800 B
                "u8_one": torch.tensor([7], dtype=torch.uint8),  # 1 B
                "empty2": torch.zeros(0, 3, dtype=torch.int64),
                "text": torch.from_numpy(make_bytes("text", 3 * SEG + 100)),  # 4 segments
            },
        },
    }


def check_archive_structure(path, compression: str, segment: int = SEG) -> dict[str, LocalEntry]:
    """meta.json STORED, payloads compressed, segment tables exactly on
    multi-segment deflate entries, lengths summing to the compressed size."""
    entries = zip_entries(path)
    method = METHOD[compression]
    for name, e in entries.items():
        info = e.info
        if name.endswith("meta.json") or not name.endswith(".memmap") or info.file_size == 0:
            assert info.compress_type == zipfile.ZIP_STORED, name
        else:
            assert info.compress_type == method, name
        table = e.table()
        nseg = math.ceil(info.file_size / segment) if info.file_size else 0
        if compression == "deflate" and info.compress_type == zipfile.ZIP_DEFLATED and nseg > 1:
            assert table is not None, f"{name}: {info.file_size} bytes, no segment table"
            _, version, seg, count, lens = table
            assert (version, seg, count) == (1, segment, nseg), name
            assert sum(lens) == info.compress_size, name
            assert all(x > 0 for x in lens), name
            ids = e.ids
            assert 1 in ids, f"{name}: no zip64 extra"
            assert ids.index(records.SEGMENT_EXTRA_ID) < ids.index(1), f"{name}: table after zip64: {ids}"
        else:
            assert table is None, f"{name}: unexpected segment table ({info.file_size} bytes)"
    return entries


# ---------------------------------------------------------------------------
# 1. kernel oracles
# ---------------------------------------------------------------------------
@pytest.mark.parametrize("kind", ["random", "zeros", "text"])
@pytest.mark.parametrize("n", EDGE_SIZES)
def test_deflate_kernel_single_segment_decodes_with_zlib(n, kind):
    data = make_bytes(kind, n)
    parts, crcs, status, _ = kernel_deflate(data, None)
    assert status.tolist() == [codec_kernels.Z_STREAM_END]
    assert zlib.decompress(parts[0], wbits=-15) == data.tobytes()
    assert int(crcs[0]) == zlib.crc32(data.tobytes())


@pytest.mark.parametrize("kind", ["random", "zeros", "text"])
@pytest.mark.parametrize("n,seg", [(4097, 4096), (3 * 4096, 4096), (200, 64), (65, 64), (129, 64), (1000, 1)])
def test_deflate_kernel_segments_concatenate_into_one_stream(n, seg, kind):
    data = make_bytes(kind, n)
    parts, crcs, status, inputs = kernel_deflate(data, seg)
    nseg = math.ceil(n / seg)
    assert len(parts) == nseg
    assert status.tolist() == [codec_kernels.Z_OK] * (nseg - 1) + [codec_kernels.Z_STREAM_END]
    joined = b"".join(parts)
    assert zlib.decompress(joined, wbits=-15) == data.tobytes()
    d = zlib.decompressobj(-15)
    assert d.decompress(joined) == data.tobytes() and d.eof and not d.unused_data
    for j, (part, raw) in enumerate(zip(parts, inputs)):
        assert int(crcs[j]) == zlib.crc32(raw)
        # segments are independent: each decodes alone (no shared window)
        dj = zlib.decompressobj(-15)
        assert dj.decompress(part) == raw, f"segment {j}"
        assert dj.eof == (j == nseg - 1)


@pytest.mark.parametrize("level", [0, 1, 9])
def test_deflate_kernel_levels(level):
    data = make_bytes("text", 3 * 4096 + 5)
    parts, _, status, _ = kernel_deflate(data, 4096, level)
    assert (status >= 0).all()
    assert zlib.decompress(b"".join(parts), wbits=-15) == data.tobytes()


@pytest.mark.parametrize("kind", ["random", "zeros", "text"])
@pytest.mark.parametrize("n", EDGE_SIZES)
@pytest.mark.parametrize("level", [1, 6, 9])
def test_inflate_kernel_decodes_zlib_stream(n, kind, level):
    data = make_bytes(kind, n).tobytes()
    c = zlib.compressobj(level, zlib.DEFLATED, -15)
    stream = c.compress(data) + c.flush()
    out, crcs, status = kernel_inflate([stream], [n])
    assert status.tolist() == [0]
    assert out.tobytes() == data
    assert int(crcs[0]) == zlib.crc32(data)


@pytest.mark.parametrize("kind", ["random", "zeros", "text"])
@pytest.mark.parametrize("n,seg", [(4097, 4096), (3 * 4096, 4096), (130, 64), (65, 64)])
def test_inflate_kernel_decodes_zlib_full_flush_segments(n, seg, kind):
    data = make_bytes(kind, n).tobytes()
    parts = zlib_segments(data, seg)
    sizes = [min(seg, n - s) for s in range(0, n, seg)]
    out, crcs, status = kernel_inflate(parts, sizes)
    assert status.tolist() == [0] * len(parts)
    assert out.tobytes() == data
    for j, s in enumerate(range(0, n, seg)):
        assert int(crcs[j]) == zlib.crc32(data[s : s + seg])


def test_inflate_kernel_reports_bad_segments():
    data = make_bytes("text", 1000).tobytes()
    (stream,) = zlib_segments(data, None)
    # output one byte too short: input left over / too long
    _, _, status = kernel_inflate([stream], [999])
    assert status[0] != 0
    # output one byte too long: produced < dst_len
    _, _, status = kernel_inflate([stream], [1001])
    assert status[0] == 2
    # truncated stream
    _, _, status = kernel_inflate([stream[:-3]], [1000])
    assert status[0] != 0
    # a full-flushed (non-final) segment as the last one: no end of stream
    parts = zlib_segments(data, 500)
    _, _, status = kernel_inflate([parts[0]], [500])
    assert status[0] != 0
    # garbage
    _, _, status = kernel_inflate([b"\xff" * 64], [1000])
    assert status[0] != 0


def test_kernels_read_only_mmap_input(tmp_path):
    n = 3 * 4096 + 17
    data = make_bytes("text", n)
    f = tmp_path / "raw.bin"
    f.write_bytes(data.tobytes())
    with open(f, "rb") as fh:
        m = mmap.mmap(fh.fileno(), 0, access=mmap.ACCESS_READ)
    try:
        ro = np.frombuffer(m, np.uint8)
        assert not ro.flags.writeable
        parts, crcs, status, _ = kernel_deflate(ro, 4096)
        assert (status >= 0).all()
        assert zlib.decompress(b"".join(parts), wbits=-15) == data.tobytes()
        assert [int(c) for c in crcs] == [zlib.crc32(data[s : s + 4096].tobytes()) for s in range(0, n, 4096)]
        # through the Python wrapper as well
        (d,) = members.deflate_many([ro], None, None)
        assert d.crc == zlib.crc32(data.tobytes())
        assert zlib.decompress(b"".join(p.tobytes() for p in d.parts), wbits=-15) == data.tobytes()
        del ro
    finally:
        m.close()
    # compressed input in a read-only mapping
    g = tmp_path / "deflated.bin"
    parts = zlib_segments(data.tobytes(), 4096)
    g.write_bytes(b"".join(parts))
    with open(g, "rb") as fh:
        m = mmap.mmap(fh.fileno(), 0, access=mmap.ACCESS_READ)
    try:
        ro = np.frombuffer(m, np.uint8)
        sizes = [min(4096, n - s) for s in range(0, n, 4096)]
        out, _, status = kernel_inflate(parts, sizes, src_buf=ro)
        assert status.tolist() == [0] * len(parts)
        assert out.tobytes() == data.tobytes()
        del ro
    finally:
        m.close()


def test_deflate_many_and_inflate_many_roundtrip(small_segments):
    arrays = [make_bytes("text", n) for n in (1, 4096, 4097, 3 * 4096, 20_000)] + [make_bytes("random", 9000)]
    results = members.deflate_many(arrays, None, None)
    jobs = []
    for a, r in zip(arrays, results):
        assert r.crc == zlib.crc32(a.tobytes())
        stream = b"".join(p.tobytes() for p in r.parts)
        assert len(stream) == r.csize
        assert zlib.decompress(stream, wbits=-15) == a.tobytes()
        table = members.parse_segment_table(r.table, "x") if r.table else None
        assert (table is not None) == (a.size > SEG)
        if table:
            assert table[0] == SEG and sum(table[1]) == r.csize and len(table[1]) == math.ceil(a.size / SEG)
        jobs.append((f"entry {a.size}", np.frombuffer(stream, np.uint8), a.size, r.crc, table))
    for a, out in zip(arrays, members.inflate_many(jobs, None)):
        assert out.tobytes() == a.tobytes()
    # without the tables (one segment per entry, like foreign zips)
    no_tables = [(w, raw, size, crc, None) for w, raw, size, crc, _ in jobs]
    for a, out in zip(arrays, members.inflate_many(no_tables, 1)):
        assert out.tobytes() == a.tobytes()


def test_segment_size_grows_to_bound_the_table(small_segments, monkeypatch, tmp_path):
    monkeypatch.setattr(members, "_MAX_SEGMENTS", 3)
    assert members.segment_size_for(3 * SEG, SEG) == SEG
    assert members.segment_size_for(3 * SEG + 1, SEG) == 2 * SEG
    assert members.segment_size_for(5 * SEG, SEG) == 2 * SEG
    data = torch.from_numpy(make_bytes("text", 5 * SEG))
    p = tdz_numba.save({"x": data}, tmp_path / "x.tdz", compression="deflate")
    _, version, seg, count, lens = zip_entries(p)["x.memmap"].table()
    assert (version, seg, count) == (1, 2 * SEG, 3)
    assert torch.equal(tdz_numba.load(p)["x"], data)
    assert zipfile.ZipFile(p).testzip() is None


# ---------------------------------------------------------------------------
# 2. round trips
# ---------------------------------------------------------------------------
@pytest.mark.parametrize("compression", CODECS)
def test_roundtrip_each_codec(compression, small_segments, tmp_path):
    tree = sample_tree()
    p = tdz_numba.save(tree, tmp_path / "x.tdz", compression=compression)
    assert_tree_equal(tdz_numba.load(p), tree)
    with tdz_numba.open(p) as ar:  # lazily, one leaf at a time
        for key, want in tensor_leaves(tree):
            got = ar[key]
            assert got.dtype == want.dtype and torch.equal(got, want), key
            info = ar.info(key)
            if want.numel():
                assert info.compression == compression
                assert info.zero_copy == (compression == "stored")
        assert_tree_equal(ar.to_dict(), tree)
    with zipfile.ZipFile(p) as z:
        assert z.testzip() is None
        for key, want in tensor_leaves(tree):
            if want.numel():
                raw = z.read(key + ".memmap")
                assert raw == want.contiguous().view(-1).view(torch.uint8).numpy().tobytes(), key
    check_archive_structure(p, compression)
    if compression == "deflate":
        tables = {n for n, e in zip_entries(p).items() if e.table() is not None}
        assert tables == {
            "u8_over.memmap",
            "i64_multiple.memmap",
            "zeros.memmap",
            "np_i16.memmap",
            "lvl1/bf16.memmap",
            "lvl1/bool.memmap",
            "lvl1/lvl2/f16.memmap",
            "lvl1/lvl2/c64.memmap",
            "lvl1/lvl2/text.memmap",
        }
    report = tdz_numba.verify(p)
    assert report.leaves == sum(1 for _ in tensor_leaves(tree))


@pytest.mark.skipif(not HAVE_UNZIP, reason="Info-ZIP unzip not installed")
@pytest.mark.parametrize("compression", CODECS)
def test_unzip_t_passes(compression, small_segments, tmp_path):
    p = tdz_numba.save(sample_tree(), tmp_path / "x.tdz", compression=compression)
    r = unzip_test(p)
    if compression == "lzma" and "unsupported compression" in r.stdout:
        pytest.skip("this unzip has no LZMA support")
    assert r.returncode == 0, r.stdout + r.stderr
    assert "No errors detected" in r.stdout


@pytest.mark.skipif(not HAVE_UNZIP, reason="Info-ZIP unzip not installed")
def test_unzip_extracts_multisegment_entries(small_segments, tmp_path):
    tree = sample_tree()
    p = tdz_numba.save(tree, tmp_path / "x.tdz", compression="deflate")
    out = tmp_path / "out"
    r = subprocess.run(["unzip", "-q", str(p), "-d", str(out)], capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stdout + r.stderr
    for key, want in tensor_leaves(tree):
        if want.numel():
            got = (out / (key + ".memmap")).read_bytes()
            assert got == want.contiguous().view(-1).view(torch.uint8).numpy().tobytes(), key


@pytest.mark.parametrize(
    "compression", ["deflate", "DEFLATE", "deflated", "bzip2", "lzma", "stored", "Stored", None]
)
def test_compression_names(compression, tmp_path):
    x = torch.arange(100)
    p = tdz_numba.save({"x": x}, tmp_path / "x.tdz", compression=compression)
    name = "stored" if compression is None else compression.lower()
    name = {"deflated": "deflate"}.get(name, name)
    assert zipfile.ZipFile(p).getinfo("x.memmap").compress_type == METHOD[name]
    assert zipfile.ZipFile(p).getinfo("meta.json").compress_type == zipfile.ZIP_STORED
    assert torch.equal(tdz_numba.load(p)["x"], x)


@pytest.mark.parametrize("level", [0, 1, 9])
@pytest.mark.parametrize("compression", ["deflate", "bzip2", "lzma"])
def test_compresslevel(compression, level, small_segments, tmp_path):
    if compression == "bzip2" and level == 0:
        level = 1  # bzip2 levels are 1..9
    tree = {"a": torch.from_numpy(make_bytes("text", 3 * SEG + 1)), "b": torch.arange(5000)}
    p = tdz_numba.save(tree, tmp_path / "x.tdz", compression=compression, compresslevel=level)
    assert_tree_equal(tdz_numba.load(p), tree)
    assert zipfile.ZipFile(p).testzip() is None
    check_archive_structure(p, compression)


def test_deflate_default_segment_size(tmp_path):
    """One payload of 4 MiB + 1 byte with the real 4 MiB segments: 2 segments."""
    assert members.SEGMENT_SIZE == 4 << 20
    n = (4 << 20) + 1
    x = torch.from_numpy(np.arange(n, dtype=np.uint8) % 7)
    p = tdz_numba.save(
        {"x": x, "y": torch.ones(3)}, tmp_path / "x.tdz", compression="deflate", compresslevel=1
    )
    e = check_archive_structure(p, "deflate", segment=4 << 20)
    assert e["x.memmap"].table()[3] == 2
    assert e["y.memmap"].table() is None
    assert torch.equal(tdz_numba.load(p)["x"], x)
    with zipfile.ZipFile(p) as z:
        assert z.read("x.memmap") == x.numpy().tobytes()


def test_pack_compressed_from_memmap_directory(small_segments, tmp_path):
    """pack reads payloads through read-only np.memmap mappings."""
    tree = sample_tree()
    plain = tdz_numba.save(tree, tmp_path / "plain.tdz")
    d = tdz_numba.unpack(plain, tmp_path / "dir")
    p = tdz_numba.pack(d, tmp_path / "packed.tdz", compression="deflate")
    assert_tree_equal(tdz_numba.load(p), tree)
    assert zipfile.ZipFile(p).testzip() is None
    check_archive_structure(p, "deflate")


def test_numpy_readonly_memmap_leaf(small_segments, tmp_path):
    f = tmp_path / "raw.bin"
    data = make_bytes("text", 3 * SEG + 3)
    data.tofile(f)
    leaf = np.memmap(f, dtype=np.uint8, mode="r")
    assert not leaf.flags.writeable
    p = tdz_numba.save({"m": leaf}, tmp_path / "x.tdz", compression="deflate")
    assert torch.equal(tdz_numba.load(p)["m"], torch.from_numpy(data))
    check_archive_structure(p, "deflate")


# ---------------------------------------------------------------------------
# 3. interop
# ---------------------------------------------------------------------------
try:
    import tensordict
    from tensordict import TensorDict
except ImportError:  # pragma: no cover - tensordict is a dev dependency
    tensordict = TensorDict = None
needs_td = pytest.mark.skipif(tensordict is None, reason="tensordict not installed")


def make_td():
    g = torch.Generator().manual_seed(1)
    return TensorDict(
        a=torch.arange(3000.0).reshape(10, 300),  # 12000 B: 3 segments
        b=torch.randint(0, 255, (10, 411), dtype=torch.uint8, generator=g),  # 4110 B
        c=torch.ones(10, 1, dtype=torch.float64),
        e=torch.zeros(10, 0),
        sub=TensorDict(
            x=torch.randn(10, 2, 205, generator=g).to(torch.bfloat16),  # 8200 B
            y=(torch.arange(10 * 512) % 3 == 0).reshape(10, 512),  # 5120 B
            batch_size=[10],
        ),
        batch_size=[10],
    )


def td_tree(td) -> dict:
    out = {}
    for k, v in td.items():
        out[k] = td_tree(v) if isinstance(v, tensordict.TensorDictBase) else v
    return out


def assert_td_equal(got, want):
    keys = sorted(want.keys(include_nested=True, leaves_only=True), key=str)
    assert sorted(got.keys(include_nested=True, leaves_only=True), key=str) == keys
    for k in keys:
        assert got[k].dtype == want[k].dtype and torch.equal(got[k], want[k]), k


@needs_td
@pytest.mark.parametrize("compression", ["deflate", "bzip2", "lzma"])
def test_tensordict_loads_ours(compression, small_segments, tmp_path):
    td = make_td()
    p = tdz_numba.save(td, tmp_path / "ours.tdz", compression=compression)
    if compression == "deflate":
        assert zip_entries(p)["a.memmap"].table()[3] == 3
    assert_td_equal(TensorDict.load_memmap(p), td)


@needs_td
@pytest.mark.parametrize("compression", ["deflate", "bzip2", "lzma"])
def test_we_load_tensordicts(compression, tmp_path):
    td = make_td()
    p = tmp_path / "theirs.tdz"
    td.save(p, compression=compression)
    assert zipfile.ZipFile(p).getinfo("a.memmap").compress_type == METHOD[compression]
    assert all(e.table() is None for e in zip_entries(p).values())
    assert_tree_equal(tdz_numba.load(p), td_tree(td))
    with tdz_numba.open(p, num_threads=1) as ar:
        assert torch.equal(ar["sub/x"], td["sub", "x"])
        assert ar.info("sub/x").compression == compression
    tdz_numba.verify(p)


@needs_td
@pytest.mark.parametrize("stream", [False, True], ids=["seekable", "data-descriptors"])
@pytest.mark.parametrize("compression", [zipfile.ZIP_DEFLATED, zipfile.ZIP_BZIP2, zipfile.ZIP_LZMA])
def test_we_load_stdlib_zip_of_memmap_directory(compression, stream, tmp_path):
    td = make_td()
    d = tmp_path / "dir"
    td.memmap(d)
    p = tmp_path / "std.zip"

    class NoSeek:
        def __init__(self, f):
            self.f = f

        def write(self, b):
            return self.f.write(b)

        def flush(self):
            self.f.flush()

    with open(p, "wb") as f:
        with zipfile.ZipFile(NoSeek(f) if stream else f, "w", compression=compression) as z:
            for root, dirs, files in os.walk(d):
                dirs.sort()
                for name in sorted(files):
                    full = Path(root) / name
                    z.write(full, full.relative_to(d).as_posix())
    assert_tree_equal(tdz_numba.load(p), td_tree(td))
    tdz_numba.verify(p)


# ---------------------------------------------------------------------------
# 4. num_threads
# ---------------------------------------------------------------------------
def zero_timestamps_of(path) -> bytes:
    return zero_timestamps(Path(path).read_bytes())


@pytest.mark.parametrize("compression", ["deflate", "bzip2"])
def test_num_threads_gives_identical_archives(compression, small_segments, tmp_path):
    import numba

    tree = sample_tree()
    before = numba.get_num_threads()
    p1 = tdz_numba.save(tree, tmp_path / "t1.tdz", compression=compression, num_threads=1)
    p2 = tdz_numba.save(tree, tmp_path / "t2.tdz", compression=compression, num_threads=2)
    pn = tdz_numba.save(tree, tmp_path / "tn.tdz", compression=compression)
    assert numba.get_num_threads() == before
    assert zero_timestamps_of(p1) == zero_timestamps_of(p2) == zero_timestamps_of(pn)
    a, b = tdz_numba.load(p1, num_threads=1), tdz_numba.load(p1, num_threads=2)
    assert_tree_equal(a, tree)
    assert_tree_equal(b, tree)
    with tdz_numba.open(p2, num_threads=1) as ar:
        assert torch.equal(ar["lvl1/lvl2/text"], tree["lvl1"]["lvl2"]["text"])
    assert numba.get_num_threads() == before


@pytest.mark.parametrize("bad", [0, -1])
def test_num_threads_must_be_positive(bad, tmp_path):
    tree = {"x": torch.arange(5000)}
    target = tmp_path / "x.tdz"
    with pytest.raises(InvalidArgumentError):
        tdz_numba.save(tree, target, compression="deflate", num_threads=bad)
    assert not target.exists()
    assert list(tmp_path.iterdir()) == []  # no temporary file left behind
    p = tdz_numba.save(tree, target, compression="deflate")
    with pytest.raises(InvalidArgumentError):
        tdz_numba.open(p, num_threads=bad)
    with pytest.raises(InvalidArgumentError):
        tdz_numba.load(p, num_threads=bad)
    with pytest.raises(InvalidArgumentError):
        members.inflate_many([("x", np.zeros(1, np.uint8), 0, 0, None)], bad)


# ---------------------------------------------------------------------------
# 5. laziness
# ---------------------------------------------------------------------------
@pytest.fixture
def inflate_calls(monkeypatch):
    calls: list[list[str]] = []
    real = members.inflate_many

    def counting(jobs, num_threads, **kw):
        calls.append([re.search(r"entry '([^']*)'", j[0]).group(1) for j in jobs])
        return real(jobs, num_threads, **kw)

    monkeypatch.setattr(members, "inflate_many", counting)
    return calls


def deflated_names(path) -> set[str]:
    with zipfile.ZipFile(path) as z:
        return {i.filename for i in z.infolist() if i.compress_type == zipfile.ZIP_DEFLATED}


def test_open_is_lazy_and_to_dict_batches(small_segments, tmp_path, inflate_calls):
    tree = sample_tree()
    p = tdz_numba.save(tree, tmp_path / "x.tdz", compression="deflate")
    names = deflated_names(p)
    assert len(names) == 13
    ar = tdz_numba.open(p)
    assert inflate_calls == []
    sorted(ar)
    ar.info("u8_over")
    ar["lvl1"]
    ar["tag"]
    repr(ar)
    assert "u8_over" in ar
    assert inflate_calls == []
    assert torch.equal(ar["u8_over"], tree["u8_over"])
    assert inflate_calls == [["u8_over.memmap"]]
    ar["u8_over"]  # cached
    assert len(inflate_calls) == 1
    sub = ar["lvl1"]["lvl2"]
    assert_tree_equal(sub.to_dict(), tree["lvl1"]["lvl2"])
    lvl2 = {n for n in names if n.startswith("lvl1/lvl2/")}
    assert len(inflate_calls) == 2 and set(inflate_calls[1]) == lvl2
    assert_tree_equal(ar.to_dict(), tree)
    assert len(inflate_calls) == 3
    assert sorted(inflate_calls[2]) == sorted(names - lvl2 - {"u8_over.memmap"})
    ar.close()


def test_load_inflates_in_one_call(small_segments, tmp_path, inflate_calls):
    tree = sample_tree()
    p = tdz_numba.save(tree, tmp_path / "x.tdz", compression="deflate")
    assert_tree_equal(tdz_numba.load(p), tree)
    assert len(inflate_calls) == 1 and sorted(inflate_calls[0]) == sorted(deflated_names(p))


@needs_td
def test_foreign_zip_entries_inflate_in_one_batch(tmp_path, inflate_calls):
    td = make_td()
    p = tmp_path / "theirs.tdz"
    td.save(p, compression="deflate")
    assert_tree_equal(tdz_numba.load(p), td_tree(td))
    assert len(inflate_calls) == 1 and sorted(inflate_calls[0]) == sorted(deflated_names(p))


# ---------------------------------------------------------------------------
# 6. errors
# ---------------------------------------------------------------------------
def entry_pattern(name: str) -> str:
    return re.escape(repr(name))


@pytest.mark.parametrize("compression", ["deflate", "bzip2", "lzma"])
@pytest.mark.parametrize("key,kind", [("multi", "text"), ("single", "text"), ("multi_random", "random")])
def test_flipped_payload_byte(compression, key, kind, small_segments, tmp_path):
    tree = {
        "multi": torch.from_numpy(make_bytes("text", 3 * SEG + 10)),
        "single": torch.from_numpy(make_bytes("text", 1000)),
        "multi_random": torch.from_numpy(make_bytes("random", 2 * SEG + 10)),
        "ok": torch.arange(10),
    }
    p = tdz_numba.save(tree, tmp_path / "x.tdz", compression=compression)
    name = key + ".memmap"
    e = zip_entries(p)[name]
    at = e.payload_offset + e.info.compress_size // 3
    byte = Path(p).read_bytes()[at]
    patch_file(p, at, bytes([byte ^ 0xFF]))
    with tdz_numba.open(p) as ar:  # opening reads no payload
        assert torch.equal(ar["ok"], tree["ok"])
        with pytest.raises(BadArchiveError, match=entry_pattern(name)):
            ar[key]
    with pytest.raises(BadArchiveError, match=entry_pattern(name)):
        tdz_numba.load(p)
    with pytest.raises(BadArchiveError, match=entry_pattern(name)):
        tdz_numba.verify(p)


def _table_mutations():
    def count_plus(v, seg, count, lens):
        return v, seg, count + 1, lens

    def count_minus(v, seg, count, lens):
        return v, seg, count - 1, lens

    def seg_double(v, seg, count, lens):
        return v, seg * 2, count, lens

    def seg_half(v, seg, count, lens):
        return v, seg // 2, count, lens

    def seg_zero(v, seg, count, lens):
        return v, 0, count, lens

    def version(v, seg, count, lens):
        return 2, seg, count, lens

    def len_plus(v, seg, count, lens):
        return v, seg, count, [lens[0] + 1, *lens[1:]]

    def len_minus_last(v, seg, count, lens):
        return v, seg, count, [*lens[:-1], lens[-1] - 1]

    def boundary_shift(v, seg, count, lens):
        return v, seg, count, [lens[0] + 1, lens[1] - 1, *lens[2:]]

    def boundary_shift_back(v, seg, count, lens):
        return v, seg, count, [lens[0] - 1, lens[1] + 1, *lens[2:]]

    return [
        count_plus,
        count_minus,
        seg_double,
        seg_half,
        seg_zero,
        version,
        len_plus,
        len_minus_last,
        boundary_shift,
        boundary_shift_back,
    ]


@pytest.mark.parametrize("mutate", _table_mutations(), ids=lambda f: f.__name__)
def test_corrupt_segment_table(mutate, small_segments, tmp_path):
    data = torch.from_numpy(make_bytes("text", 3 * SEG + 10))
    p = tdz_numba.save({"x": data, "ok": torch.arange(4)}, tmp_path / "x.tdz", compression="deflate")
    e = zip_entries(p)["x.memmap"]
    off, v, seg, count, lens = e.table()
    assert count == 4
    v2, seg2, count2, lens2 = mutate(v, seg, count, lens)
    body = struct.pack("<IQI", v2, seg2, count2) + struct.pack(f"<{count}I", *lens2)
    patch_file(p, off, body)  # same length: every offset stays valid
    assert zipfile.ZipFile(p).testzip() is None  # unknown extras are ignored by others
    with tdz_numba.open(p) as ar:
        assert torch.equal(ar["ok"], torch.arange(4))
        with pytest.raises(BadArchiveError, match=entry_pattern("x.memmap")):
            ar["x"]
    with pytest.raises(BadArchiveError, match=entry_pattern("x.memmap")):
        tdz_numba.load(p)
    with pytest.raises(BadArchiveError, match=entry_pattern("x.memmap")):
        tdz_numba.verify(p)


def test_truncated_segment_table_block(small_segments, tmp_path):
    """A 0x7A74 block shorter than its 16-byte header."""
    data = torch.from_numpy(make_bytes("text", 2 * SEG + 10))
    p = tdz_numba.save({"x": data}, tmp_path / "x.tdz", compression="deflate")
    e = zip_entries(p)["x.memmap"]
    off, *_ = e.table()
    blen = len(e.blocks[e.ids.index(records.SEGMENT_EXTRA_ID)][2])
    # shrink the declared length to 8 and turn the rest into an unknown block
    patch_file(p, off - 2, struct.pack("<H", 8))
    patch_file(p, off + 8, struct.pack("<HH", 0x4242, blen - 8 - 4))
    assert zip_entries(p)["x.memmap"].ids[:2] == [records.SEGMENT_EXTRA_ID, 0x4242]
    with pytest.raises(BadArchiveError, match=entry_pattern("x.memmap")):
        tdz_numba.load(p)


@pytest.mark.parametrize("compression", ["deflate", "bzip2", "lzma"])
@pytest.mark.parametrize("size", [1000, 3 * SEG + 10])
def test_patched_crc_raises_checksum_error(compression, size, small_segments, tmp_path):
    data = torch.from_numpy(make_bytes("text", size))
    p = tdz_numba.save({"x": data, "ok": torch.arange(4)}, tmp_path / "x.tdz", compression=compression)
    e = zip_entries(p)["x.memmap"]
    bad = struct.pack("<I", e.info.CRC ^ 0x1)
    patch_file(p, e.header_offset + 14, bad)
    patch_file(p, e.central_offset + 16, bad)
    assert zipfile.ZipFile(p).getinfo("x.memmap").CRC == e.info.CRC ^ 1
    with tdz_numba.open(p) as ar:
        assert torch.equal(ar["ok"], torch.arange(4))
        with pytest.raises(ChecksumError, match=entry_pattern("x.memmap")):
            ar["x"]
    with pytest.raises(ChecksumError, match=entry_pattern("x.memmap")):
        tdz_numba.load(p)
    with pytest.raises(ChecksumError, match=entry_pattern("x.memmap")):
        tdz_numba.verify(p)


def test_checksum_error_is_bad_archive_error():
    assert issubclass(ChecksumError, BadArchiveError)
    assert issubclass(BadArchiveError, TdzError)


@pytest.mark.parametrize("compression", ["deflate", "bzip2", "lzma"])
def test_rplus_refuses_compressed_leaves(compression, tmp_path):
    tree = {"x": torch.arange(100), "sub": {"y": torch.ones(50)}}
    p = tdz_numba.save(tree, tmp_path / "x.tdz", compression=compression)
    with tdz_numba.open(p, mode="r+") as ar:
        with pytest.raises(UnsupportedError, match=f"leaf 'x' .*is compressed \\({compression}\\).*mode='r'"):
            ar["x"]
        with pytest.raises(UnsupportedError):
            ar["sub"]["y"]
        with pytest.raises(UnsupportedError):
            ar.to_dict()
    with pytest.raises(UnsupportedError):
        tdz_numba.load(p, mode="r+")
    assert_tree_equal(tdz_numba.load(p), tree)  # the file is untouched


@pytest.mark.parametrize("name", ["zstd", "zstd99", "gzip", "", "deflate64", 8])
def test_unknown_compression(name, tmp_path):
    target = tmp_path / "x.tdz"
    with pytest.raises(
        tdz_numba.UnknownCompressionError
    ) as info:  # also a ValueError and an UnsupportedError
        tdz_numba.save({"x": torch.arange(3)}, target, compression=name)
    assert isinstance(info.value, ValueError) and isinstance(info.value, UnsupportedError)
    assert f"unknown compression {name!r}" in str(info.value)
    assert not target.exists()
    assert list(tmp_path.iterdir()) == []


def test_unknown_compression_keeps_existing_file(tmp_path):
    target = tdz_numba.save({"x": torch.arange(3)}, tmp_path / "x.tdz")
    before = target.read_bytes()
    with pytest.raises(ValueError):
        tdz_numba.save({"x": torch.arange(4)}, target, compression="zstd")
    assert target.read_bytes() == before


# ---------------------------------------------------------------------------
# 7. verify
# ---------------------------------------------------------------------------
@pytest.mark.parametrize("compression", ["deflate", "bzip2", "lzma"])
def test_verify_compressed_archive(compression, small_segments, tmp_path):
    tree = sample_tree()
    p = tdz_numba.save(tree, tmp_path / "x.tdz", compression=compression)
    report = tdz_numba.verify(p)
    with zipfile.ZipFile(p) as z:
        infos = z.infolist()
    assert report.entries == len(infos)
    assert report.leaves == sum(1 for _ in tensor_leaves(tree))
    assert report.levels == sum(1 for i in infos if i.filename.endswith("meta.json"))
    assert report.payload_bytes == sum(i.file_size for i in infos)
    assert "OK" in str(report)


def test_verify_does_not_patch_or_keep_state(small_segments, tmp_path, inflate_calls):
    p = tdz_numba.save(sample_tree(), tmp_path / "x.tdz", compression="deflate")
    before = p.read_bytes()
    tdz_numba.verify(p)
    assert p.read_bytes() == before
    # verify inflates every deflate entry (in one batch) to check its CRC
    assert sorted(sum(inflate_calls, [])) == sorted(deflated_names(p))


# ---------------------------------------------------------------------------
# more: nested tensors, threads, zero-length deflate entries, bad levels
# ---------------------------------------------------------------------------
@pytest.mark.parametrize("compression", ["deflate", "bzip2", "lzma"])
def test_nested_tensor_leaf_compressed(compression, small_segments, tmp_path):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        nt = torch.nested.nested_tensor(
            [torch.arange(900.0).reshape(300, 3), torch.zeros(500, 3)], layout=torch.strided
        )
    p = tdz_numba.save({"n": nt, "x": torch.arange(10)}, tmp_path / "x.tdz", compression=compression)
    with zipfile.ZipFile(p) as z:
        assert z.getinfo("n.memmap").compress_type == METHOD[compression]
        assert z.testzip() is None
    check_archive_structure(p, compression)
    back = tdz_numba.load(p)["n"]
    assert back.is_nested
    for got, want in zip(back.unbind(), nt.unbind()):
        assert torch.equal(got, want)
    tdz_numba.verify(p)


def test_concurrent_saves_and_loads(small_segments, tmp_path):
    from concurrent.futures import ThreadPoolExecutor

    tree = {"a": torch.arange(20_000) % 7, "b": {"c": torch.from_numpy(make_bytes("text", 3 * SEG + 1))}}

    def job(i):
        p = tdz_numba.save(tree, tmp_path / f"c{i}.tdz", compression="deflate", num_threads=1 + i % 2)
        assert_tree_equal(tdz_numba.load(p, num_threads=2 - i % 2), tree)
        return zero_timestamps_of(p)

    with ThreadPoolExecutor(3) as pool:
        images = list(pool.map(job, range(6)))
    assert all(img == images[0] for img in images)


def test_inflate_many_zero_size_entry():
    """A zero-length entry stored as a 2-byte deflate stream (stdlib zipfile's
    empty-file output) inflates to an empty array."""
    c = zlib.compressobj(6, zlib.DEFLATED, -15)
    empty = np.frombuffer(c.compress(b"") + c.flush(), np.uint8)
    assert empty.size == 2
    (out,) = members.inflate_many([("entry 'e.memmap'", empty, 0, 0, None)], None)
    assert out.size == 0
    other = make_bytes("text", 100)
    c = zlib.compressobj(6, zlib.DEFLATED, -15)
    raw = np.frombuffer(c.compress(other.tobytes()) + c.flush(), np.uint8)
    outs = members.inflate_many(
        [
            ("entry 'e.memmap'", empty, 0, 0, None),
            ("entry 'x.memmap'", raw, 100, zlib.crc32(other.tobytes()), None),
        ],
        1,
    )
    assert outs[0].size == 0 and outs[1].tobytes() == other.tobytes()


def test_zero_length_deflated_entry_in_foreign_zip(tmp_path):
    """stdlib zipfile deflates empty files too (a 2-byte stream): such an
    empty leaf must load, like it does with zipfile and tensordict."""
    d = tdz_numba.unpack(
        tdz_numba.save({"e": torch.zeros(10, 0), "a": torch.ones(10)}, tmp_path / "x.tdz"), tmp_path / "dir"
    )
    p = tmp_path / "std.zip"
    with zipfile.ZipFile(p, "w", zipfile.ZIP_DEFLATED) as z:
        for f in sorted(d.iterdir()):
            z.write(f, f.name)
        if "e.memmap" not in z.namelist():
            z.writestr("e.memmap", b"")
    info = zipfile.ZipFile(p).getinfo("e.memmap")
    assert (info.compress_type, info.file_size, info.compress_size) == (zipfile.ZIP_DEFLATED, 0, 2)
    with tdz_numba.open(p) as ar:
        assert ar["e"].shape == (10, 0)
    assert_tree_equal(tdz_numba.load(p), {"e": torch.zeros(10, 0), "a": torch.ones(10)})
    tdz_numba.verify(p)


@pytest.mark.parametrize("compression,level", [("deflate", 10), ("deflate", -2), ("bzip2", 0), ("bzip2", 10)])
def test_invalid_compresslevel(compression, level, tmp_path):
    """A bad level is a bad argument: per tdz_numba.errors, an error that is a
    TdzError and the ValueError a caller expects; nothing is left behind."""
    target = tmp_path / "x.tdz"
    with pytest.raises(ValueError) as info:
        tdz_numba.save({"x": torch.arange(100)}, target, compression=compression, compresslevel=level)
    assert isinstance(info.value, TdzError), type(info.value).__mro__
    assert list(tmp_path.iterdir()) == []
