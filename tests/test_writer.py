"""The streaming Writer (issue 24): the same entries as save, compact -> save's bytes, streamed
leaves, wrong sizes, exceptions, bounded memory."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import zipfile
from pathlib import Path
from unittest import mock

import numpy as np
import pytest
import torch
from ziputil import zero_timestamps

import tdz_numba

TREE = {
    "a": torch.arange(10.0),
    "s": {"b": torch.ones(3, dtype=torch.int16), "empty": torch.zeros(0)},
    "name": "run1",
    "big": torch.arange(100_000, dtype=torch.int32),
}


def _write(path: Path, **kw) -> Path:
    with tdz_numba.Writer(path, **kw) as w:
        w.add("a", TREE["a"])
        w.add("s/b", TREE["s"]["b"])
        w.add("s/empty", TREE["s"]["empty"])
        w.add("name", "run1")
        with w.stream("big", (100_000,), torch.int32) as sink:
            for i in range(0, 100_000, 30_000):
                sink.write(TREE["big"][i : i + 30_000])
    return path


@pytest.mark.parametrize("align", [None, "auto", 4096])
def test_same_entries_as_save_and_compact_is_save(tmp_path, align):
    s = tdz_numba.save(TREE, tmp_path / "s.tdz", align=align)
    w = _write(tmp_path / "w.tdz", align=align)
    with zipfile.ZipFile(s) as zs, zipfile.ZipFile(w) as zw:
        assert zw.testzip() is None
        assert sorted(zs.namelist()) == sorted(zw.namelist())
        for n in zs.namelist():
            assert zs.read(n) == zw.read(n), n
            assert zs.getinfo(n).CRC == zw.getinfo(n).CRC
    # the meta.json entries come last; compact puts them in tensordict's order: save's bytes
    tdz_numba.compact(w, align=align)
    assert zero_timestamps(w.read_bytes()) == zero_timestamps(s.read_bytes())


def test_writer_read_by_tensordict(tmp_path):
    td = pytest.importorskip("tensordict")
    p = tmp_path / "w.tdz"
    with tdz_numba.Writer(p) as w:
        w.add_level("obs", meta={"shape": [4]})
        w.add("obs/pixels", torch.zeros(4, 2, dtype=torch.uint8))
        sink = w.stream("obs/depth", (4,), np.float32)
        sink.write(np.arange(4, dtype=np.float32))
        sink.close()
        w.add("nested", {"x": torch.ones(2), "y": {"z": 3}})
    back = td.TensorDict.load_memmap(p)
    assert back["obs"].batch_size == torch.Size([4])
    assert back["obs", "depth"].tolist() == [0.0, 1.0, 2.0, 3.0] and back["nested", "y", "z"] == 3
    assert tdz_numba.load(p)["obs"].batch_size == [4]


def test_stream_chunk_kinds_and_dtypes(tmp_path):
    p = tmp_path / "w.tdz"
    data = np.arange(64, dtype=np.int64)
    with tdz_numba.Writer(p) as w:
        with w.stream("x", (8, 8), "int64") as sink:
            sink.write(torch.from_numpy(data[:8]))
            sink.write(data[8:16])
            sink.write(data[16:32].tobytes())
            sink.write(memoryview(data[32:]))
        with w.stream("bf", [2], torch.bfloat16) as sink:
            sink.write(torch.tensor([1.5, -2.0], dtype=torch.bfloat16))
    got = tdz_numba.load(p)
    assert got["x"].tolist() == data.reshape(8, 8).tolist()
    assert got["bf"].dtype == torch.bfloat16 and got["bf"].tolist() == [1.5, -2.0]
    tdz_numba.verify(p)


@pytest.mark.parametrize("how", ["short", "long"])
def test_wrong_byte_count_names_the_key_and_leaves_nothing(tmp_path, how):
    p = tmp_path / "w.tdz"
    with pytest.raises(tdz_numba.TdzError, match="stream 'obs/x': (4|20) bytes written") as info:
        with tdz_numba.Writer(p) as w:
            w.add("a", torch.ones(2))
            with w.stream("obs/x", (4,), torch.float32) as sink:
                sink.write(b"\0" * (4 if how == "short" else 20))
    assert info.value.entry == "obs/x" and info.value.expected == 16
    assert os.listdir(tmp_path) == []


def test_exception_leaves_no_file_and_keeps_the_old_one(tmp_path):
    p = tdz_numba.save({"old": torch.ones(1)}, tmp_path / "w.tdz")
    before = p.read_bytes()
    with pytest.raises(RuntimeError, match="boom"):
        with tdz_numba.Writer(p) as w:
            w.add("a", torch.ones(1000))
            raise RuntimeError("boom")
    assert os.listdir(tmp_path) == ["w.tdz"] and p.read_bytes() == before
    with pytest.raises(tdz_numba.TdzError, match=r"streams not closed at the end of the Writer: \['s'\]"):
        with tdz_numba.Writer(tmp_path / "n.tdz") as w:
            w.stream("s", (2,), torch.int8)
    assert os.listdir(tmp_path) == ["w.tdz"]


def test_keys_checked(tmp_path):
    with tdz_numba.Writer(tmp_path / "w.tdz") as w:
        w.add("a", torch.ones(1))
        with pytest.raises(tdz_numba.ArchiveExistsError, match="key 'a' was added already"):
            w.add("a", torch.ones(1))
        w.add("d", {"x": torch.ones(1)})
        with pytest.raises(tdz_numba.InvalidTreeError, match="written whole by one add"):
            w.add("d/y", torch.ones(1))
        with pytest.raises(tdz_numba.InvalidArgumentError, match="key must be a non-empty str"):
            w.add("a//b", torch.ones(1))
    assert sorted(tdz_numba.load(tmp_path / "w.tdz").keys()) == ["a", "d"]


def test_compressed_adds(tmp_path):
    p = tmp_path / "w.tdz"
    with tdz_numba.Writer(p, compression="deflate") as w:
        w.add("z", torch.zeros(100_000))
        with w.stream("s", (3,), torch.int8) as sink:
            sink.write(b"\1\2\3")
    with zipfile.ZipFile(p) as z:
        assert z.getinfo("z.memmap").compress_type == zipfile.ZIP_DEFLATED
        assert z.getinfo("s.memmap").compress_type == zipfile.ZIP_STORED and z.testzip() is None
    assert torch.equal(tdz_numba.load(p)["z"], torch.zeros(100_000))


def test_writer_needs_with(tmp_path):
    w = tdz_numba.Writer(tmp_path / "w.tdz")
    with pytest.raises(tdz_numba.TdzError, match="not open"):
        w.add("a", torch.ones(1))
    with mock.patch.dict(sys.modules, {"xxhash": None}):  # digest=True needs the "digest" extra
        with pytest.raises(tdz_numba.UnsupportedError, match="'digest' extra"):
            tdz_numba.Writer(tmp_path / "w.tdz", digest=True)


CHILD = textwrap.dedent(
    """
    import resource, sys, torch, tdz_numba
    path, leaves, leaf_mib, stream_mib = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4])
    with tdz_numba.Writer(path + ".warm") as w:  # kernels loaded, buffers of the first use made
        w.add("a", torch.ones(1 << 18))
    base = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    with tdz_numba.Writer(path) as w:
        for i in range(leaves):
            w.add(f"layer{i}/w", torch.full((leaf_mib << 18,), float(i)))  # made, written, dropped
        with w.stream("stream", (stream_mib << 20,), torch.uint8) as sink:
            for k in range(stream_mib):
                sink.write(torch.full((1 << 20,), k % 251, dtype=torch.uint8))
    print((resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - base) >> 10)
    """
)


def test_peak_memory_is_bounded(tmp_path):
    """16 leaves of 4 MiB and a streamed 64 MiB leaf (128 MiB in all): the peak RSS grows by
    much less than the tree (measured in a child process)."""
    p = tmp_path / "w.tdz"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(Path(tdz_numba.__file__).parents[1])])}
    out = subprocess.run(
        [sys.executable, "-c", CHILD, str(p), "16", "4", "64"], capture_output=True, text=True, env=env
    )
    assert out.returncode == 0, out.stderr
    growth_mib = int(out.stdout.split()[-1])
    assert growth_mib < 40, growth_mib
    got = tdz_numba.load(p)
    assert got["layer15"]["w"][0].item() == 15.0 and got["stream"][(3 << 20) + 5].item() == 3
    tdz_numba.verify(p)


def test_device_chunks_staged_through_one_host_buffer():
    """A device chunk is copied to the host piece by piece through one reused buffer: every byte
    arrives, in order, whatever the buffer's size against the chunk's (CPU tensors stand in)."""
    from tdz_numba.streaming import _staged

    t = torch.arange(1000, dtype=torch.float32).reshape(10, 100).t()  # non-contiguous
    want = t.contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()
    for size in (1, 3, 64, 4000, 1 << 16):
        staging = torch.empty(size, dtype=torch.uint8)
        got, ptrs = b"", set()
        for view in _staged(t, staging):
            assert view.nbytes <= size
            got += bytes(view)
            ptrs.add(np.frombuffer(view, np.uint8).ctypes.data)
        assert got == want
        assert ptrs == {staging.data_ptr()}  # one buffer, reused


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cuda_stream_through_pinned_buffer(tmp_path, monkeypatch):
    import tdz_numba.streaming as st

    monkeypatch.setattr(st, "STAGE_BYTES", 4096)
    x = torch.randn(3000, device="cuda")
    with tdz_numba.Writer(tmp_path / "c.tdz") as w:
        with w.stream("x", x.shape, x.dtype) as sink:
            sink.write(x[:1000])
            sink.write(x[1000:])
        assert w._staging is not None and w._staging.is_pinned() and w._staging.numel() == 4096
    assert torch.equal(tdz_numba.load(tmp_path / "c.tdz")["x"], x.cpu())
