"""Streaming decode through a fixed buffer: :func:`stream.stream_member`
against the stdlib oracles (every codec, chunk sizes around the entry and
segment sizes, segment tables), its errors, ``verify``'s streaming path, and
the peak RSS of streaming and verifying a 512 MiB deflated entry measured in
a child process (``VmHWM``).
"""

from __future__ import annotations

import bz2
import json
import os
import subprocess
import sys
import textwrap
import zlib
from pathlib import Path

import numpy as np
import pytest
import torch

import tdz_numba
from tdz_numba.errors import BadArchiveError, ChecksumError, TdzError
from tdz_numba.zipfmt import compression as codecs
from tdz_numba.zipfmt import members, stream

SEG = 4096
ROOT = Path(__file__).resolve().parents[1]


def data_of(n: int, seed: int = 0) -> bytes:
    rng = np.random.default_rng(seed + n)
    return (rng.integers(0, 6, n) + (np.arange(n) % 7) + 65).astype(np.uint8).tobytes()


def deflate(b: bytes) -> bytes:
    c = zlib.compressobj(6, zlib.DEFLATED, -15)
    return c.compress(b) + c.flush()


def u8(b: bytes) -> np.ndarray:
    return np.frombuffer(b, np.uint8)


ENCODE = {0: lambda b: b, 8: deflate, 12: bz2.compress, 14: lambda b: codecs.compress(b, 14, None)}


def collect(raw, method, size, crc, table, chunk, threads=None) -> tuple[bytes, list[int], int]:
    pieces: list[bytes] = []
    found = stream.stream_member(
        raw,
        method,
        size,
        crc,
        table,
        lambda p: pieces.append(p.tobytes()),
        "e",
        chunk=chunk,
        num_threads=threads,
    )
    return b"".join(pieces), [len(p) for p in pieces], found


@pytest.mark.parametrize("method", [0, 8, 12, 14])
@pytest.mark.parametrize("n", [0, 1, 63, 64, 65, 4096, 4097, 10_000])
@pytest.mark.parametrize("chunk", [1, 63, 4096, 10_000])
def test_stream_member_matches_stdlib(method, n, chunk):
    b = data_of(n)
    out, sizes, found = collect(u8(ENCODE[method](b)), method, n, zlib.crc32(b), None, chunk)
    assert out == b and found == zlib.crc32(b)
    assert all(0 < s <= chunk for s in sizes)


@pytest.mark.parametrize("n", [SEG - 1, SEG, SEG + 1, 3 * SEG, 3 * SEG + 1, 7 * SEG - 1, 10 * SEG])
@pytest.mark.parametrize("chunk", [SEG, 2 * SEG, 2 * SEG + 5, 3 * SEG, 64 * SEG])
@pytest.mark.parametrize("threads", [1, None])
def test_stream_member_segment_groups(n, chunk, threads):
    b = data_of(n)
    (d,) = members.deflate_many([u8(b)], None, 1, segment_size=SEG)
    raw = u8(b"".join(p.tobytes() for p in d.parts))
    table = members.parse_segment_table(d.table, "t") if d.table else None
    out, sizes, found = collect(raw, 8, n, d.crc, table, chunk, threads)
    assert out == b and found == zlib.crc32(b) == d.crc
    assert max(sizes) <= max(chunk, 1)
    out2, _, _ = collect(raw, 8, n, d.crc, None, chunk)  # the same bytes as one stream
    assert out2 == b


def test_stream_member_errors():
    b = data_of(5 * SEG)
    (d,) = members.deflate_many([u8(b)], None, 1, segment_size=SEG)
    raw = u8(b"".join(p.tobytes() for p in d.parts))
    seg, clens = members.parse_segment_table(d.table, "t")
    with pytest.raises(BadArchiveError, match="segment table lists 4 segments"):
        stream.stream_member(raw, 8, len(b), d.crc, (seg, clens[:4]), None, "e", chunk=2 * SEG)
    bad = raw.copy()
    bad[clens[0] + 3] ^= 0xFF
    with pytest.raises(TdzError):
        stream.stream_member(bad, 8, len(b), d.crc, (seg, clens), None, "e", chunk=2 * SEG)
    with pytest.raises(ChecksumError, match="CRC-32 mismatch"):
        stream.stream_member(raw, 8, len(b), d.crc ^ 1, (seg, clens), None, "e", chunk=2 * SEG)
    with pytest.raises(BadArchiveError, match="stored with 10 bytes"):
        stream.stream_member(u8(bytes(10)), 0, 11, None, None, None, "e")
    for size in (len(b) - 1, len(b) + 1):
        with pytest.raises(BadArchiveError, match="decodes to"):
            stream.stream_member(raw, 8, size, None, None, None, "e", chunk=SEG)
    with pytest.raises(BadArchiveError, match="ends after"):  # trailing bytes after the stream end
        stream.stream_member(u8(raw.tobytes() + b"xx"), 8, len(b), None, None, None, "e", chunk=SEG)
    with pytest.raises(BadArchiveError, match="decodes to 0 bytes"):
        stream.stream_member(u8(b""), 8, 10, None, None, None, "e")
    with pytest.raises(ValueError):
        stream.stream_member(raw, 8, len(b), None, None, None, "e", chunk=0)
    with pytest.raises(NotImplementedError):
        stream.stream_member(raw, 99, len(b), None, None, None, "e")

    def failing(piece):
        raise OSError("disk full")

    with pytest.raises(OSError, match="disk full"):  # the sink's errors propagate, the stream is freed
        stream.stream_member(raw, 8, len(b), None, None, failing, "e", chunk=SEG)


@pytest.mark.parametrize("compression", ["deflate", "bzip2", "lzma"])
def test_verify_streams_large_entries(compression, monkeypatch, tmp_path):
    tree = {"a": torch.arange(20_000, dtype=torch.int32), "b": torch.zeros(3000), "c": torch.ones(10)}
    p = tdz_numba.save(tree, tmp_path / "x.tdz", compression=compression)
    monkeypatch.setattr(codecs, "STREAM_CHUNK", 4096)
    calls: list[str] = []
    real = stream.stream_member

    def spy(raw, method, size, crc, table, sink, where, **kw):
        calls.append(where)
        return real(raw, method, size, crc, table, sink, where, **kw)

    monkeypatch.setattr(stream, "stream_member", spy)
    assert tdz_numba.verify(p).leaves == 3
    assert any("a.memmap" in w for w in calls) and any("b.memmap" in w for w in calls)
    # flip one payload byte of the large entry: verify fails on it
    from tdz_numba.zipfmt.index import ArchiveIndex

    idx = ArchiveIndex(p)
    e = idx.entry("a.memmap")
    idx.close()
    data = bytearray(p.read_bytes())
    data[e.payload_offset + e.compressed_size // 2] ^= 0x55
    p.write_bytes(bytes(data))
    with pytest.raises(BadArchiveError, match="a.memmap"):
        tdz_numba.verify(p)


def test_verify_batches_share_one_buffer(monkeypatch, tmp_path):
    tree = {f"k{i}": torch.arange(750, dtype=torch.float32) + i for i in range(7)}  # 3000 bytes each
    p = tdz_numba.save(tree, tmp_path / "x.tdz", compression="deflate")
    monkeypatch.setattr(codecs, "STREAM_CHUNK", 4096)  # batches of <= 8192 bytes: two entries each
    seen: list[tuple[int, int]] = []
    real = members.inflate_many

    def spy(jobs, num_threads, **kw):
        seen.append((len(jobs), kw["into"].ctypes.data))
        return real(jobs, num_threads, **kw)

    monkeypatch.setattr(members, "inflate_many", spy)
    assert tdz_numba.verify(p).leaves == 7
    assert [n for n, _ in seen] == [2, 2, 2, 1] and len({a for _, a in seen}) == 1
    from tdz_numba.zipfmt.index import ArchiveIndex

    idx = ArchiveIndex(p)
    e = idx.entry("k6.memmap")
    idx.close()
    data = bytearray(p.read_bytes())
    data[e.payload_offset + 5] ^= 0x10
    p.write_bytes(bytes(data))
    with pytest.raises(BadArchiveError, match="k6.memmap"):
        tdz_numba.verify(p)


# ---------------------------------------------------------------------------
# peak RSS (child processes)
# ---------------------------------------------------------------------------
_HWM = """
def hwm():
    with open("/proc/self/status") as f:
        return next(int(l.split()[1]) for l in f if l.startswith("VmHWM:")) << 10
"""

_STREAM_CHILD = (
    _HWM
    + """
import json, sys, zlib, numpy as np
from tdz_numba.zipfmt import members, stream
from tdz_numba.zipfmt.kernels.crc import crc32_zeros
seg, n = 4 << 20, 128  # 512 MiB of zeros in 4 MiB segments
(d,) = members.deflate_many([np.zeros(2 * seg, np.uint8)], None, 1, segment_size=seg)
mid, end = (p.tobytes() for p in d.parts)
raw = np.frombuffer(mid * (n - 1) + end, np.uint8)
table = (seg, [len(mid)] * (n - 1) + [len(end)])
size, crc = seg * n, int(crc32_zeros(seg * n))
stream.stream_member(np.frombuffer(d.parts[0].tobytes() + end, np.uint8), 8, 2 * seg, None,
                     (seg, [len(mid), len(end)]), None, "warm")  # compile + first touch
before = hwm()
got = []
assert stream.stream_member(raw, 8, size, crc, table, lambda p: got.append(p.size), "t") == crc
with_table = hwm() - before
assert stream.stream_member(raw, 8, size, crc, None, None, "t") == crc
print(json.dumps({"size": size, "with_table": with_table, "single": hwm() - before, "pieces": len(got)}))
"""
)

_SAVE_CHILD = """
import sys, torch, tdz_numba
tdz_numba.save({"z": torch.zeros(128 << 20), "s": torch.ones(4)}, sys.argv[1], compression="deflate")
"""

_VERIFY_CHILD = (
    _HWM
    + """
import json, sys, tdz_numba
tdz_numba.verify(sys.argv[2])  # compile, page in the code
before = hwm()
r = tdz_numba.verify(sys.argv[1])
print(json.dumps({"growth": hwm() - before, "payload": r.payload_bytes}))
"""
)


def _child(code: str, *args: str) -> dict:
    env = {**os.environ, "PYTHONPATH": str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", "")}
    out = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code), *args],
        capture_output=True,
        text=True,
        env=env,
        timeout=300,
        check=False,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


@pytest.mark.skipif(not Path("/proc/self/status").exists(), reason="needs /proc")
def test_stream_member_peak_rss_is_bounded():
    r = _child(_STREAM_CHILD)
    assert r["size"] == 512 << 20 and r["pieces"] == r["size"] // codecs.STREAM_CHUNK
    assert r["with_table"] < 80 << 20, r
    assert r["single"] < 80 << 20, r


@pytest.mark.skipif(not Path("/proc/self/status").exists(), reason="needs /proc")
def test_verify_peak_rss_is_bounded(tmp_path):
    big, small = tmp_path / "big.tdz", tmp_path / "small.tdz"
    subprocess.run(
        [sys.executable, "-c", _SAVE_CHILD, str(big)],
        check=True,
        timeout=300,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
    )
    tdz_numba.save({"z": torch.zeros(1 << 20), "s": torch.ones(4)}, small, compression="deflate")
    r = _child(_VERIFY_CHILD, str(big), str(small))
    assert r["payload"] >= 512 << 20
    assert r["growth"] < 96 << 20, r


from hypothesis import given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402


@settings(max_examples=60, deadline=None)
@given(
    n=st.integers(0, 40_000),
    seg=st.integers(1, 9000),
    chunk=st.integers(1, 30_000),
    kind=st.sampled_from(["text", "zeros", "random"]),
    threads=st.sampled_from([1, 2]),
)
def test_stream_and_inflate_match_zlib_property(n, seg, chunk, kind, threads):
    rng = np.random.default_rng(n)
    b = {"text": data_of(n), "zeros": bytes(n), "random": rng.integers(0, 256, n, dtype=np.uint8).tobytes()}[
        kind
    ]
    (d,) = members.deflate_many([u8(b)], None, threads, segment_size=seg)
    stream = b"".join(p.tobytes() for p in d.parts)
    assert zlib.decompress(stream, wbits=-15) == b and d.crc == zlib.crc32(b)
    table = members.parse_segment_table(d.table, "t") if d.table else None
    out, sizes, found = collect(u8(stream), 8, n, d.crc, table, chunk, threads)
    assert out == b and found == d.crc and all(s <= chunk for s in sizes)
    (inflated,) = members.inflate_many([("t", u8(stream), n, d.crc, table)], threads)
    assert inflated.tobytes() == b
