"""Remote archives through fsspec, against real servers on 127.0.0.1: a Range-honouring
HTTP server (tests/servers.py, which logs requests and bytes) and moto's S3 server via s3fs."""

from __future__ import annotations

import io
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import numpy as np
import pytest
import torch

import tdz_numba
from tdz_numba.errors import BadArchiveError, MissingKeyError, TdzError
from tdz_numba.remote import archive as remote_archive
from tdz_numba.remote import read as remote
from tdz_numba.remote import write as remote_write
from tdz_numba.tdz.tree import flatten

pytest.importorskip("fsspec")
pytest.importorskip("aiohttp")

from servers import MotoS3, RangeServer  # noqa: E402

GROUPS, PER_GROUP, LEAF = 100, 20, 1024  # 2,000 float32 leaves of 4 KiB


def _wide_tree(seed: int = 0) -> dict:
    g = torch.Generator().manual_seed(seed)
    return {
        f"g{i:03d}": {f"x{j:02d}": torch.randn(LEAF, generator=g) for j in range(PER_GROUP)}
        for i in range(GROUPS)
    }


def _assert_tree_equal(a, b) -> None:
    assert list(a) == list(b)
    for k in a:
        if isinstance(a[k], dict):
            _assert_tree_equal(a[k], b[k])
        elif isinstance(a[k], torch.Tensor):
            assert a[k].dtype == b[k].dtype and torch.equal(a[k], b[k]), k
        else:
            assert a[k] == b[k], k


@pytest.fixture(scope="module")
def http():
    server = RangeServer()
    yield server
    server.stop()


@pytest.fixture(scope="module")
def s3():
    pytest.importorskip("s3fs")
    pytest.importorskip("moto.server")
    server = MotoS3()
    fs = server.fs()
    fs.call_s3("create_bucket", Bucket="bucket")
    yield server
    server.stop()


@pytest.fixture(scope="module")
def wide(tmp_path_factory):
    tree = _wide_tree()
    path = tdz_numba.save(tree, tmp_path_factory.mktemp("wide") / "wide.tdz")
    return tree, path, path.read_bytes()


# -- HTTP: request counts and bytes ---------------------------------------------------------
def test_open_and_list_two_requests(http, wide):
    tree, _, data = wide
    url = http.put("wide.tdz", data)
    http.reset_log()
    with tdz_numba.open(url) as ar:
        assert http.requests == 1  # the tail only: the root meta.json is read when needed
        keys = list(ar)
        assert keys == list(tree)
        assert ar._index.requests == http.requests
    assert http.requests <= 2, http.log
    assert all(m == "GET" for m, *_ in http.log)


def test_subpath_bytes_close_to_needed(http, wide):
    tree, path, data = wide
    url = http.put("wide.tdz", data)
    local = tdz_numba.open(path)
    idx = local._index
    prefix = "g003/"
    needed = sum(int(idx.table["csize"][i]) for i, n in enumerate(idx.names) if n.startswith(prefix))
    http.reset_log()
    with tdz_numba.open(url) as ar:
        tail = http.bytes_served
        assert ar._index.tail_start > idx.entry("g003/meta.json").header_offset  # g003 is not in the tail
        list(ar)  # the root level
        http.reset_log()
        sub = ar["g003"].to_dict()
    _assert_tree_equal(sub, tree["g003"])
    ratio = http.bytes_served / needed
    assert ratio <= 1.05, (http.bytes_served, needed, http.log)
    assert http.requests <= 3
    # load(url, subpath=...) : the tail, the level's meta.json, one coalesced range
    http.reset_log()
    sub2 = tdz_numba.load(url, subpath="g050")
    _assert_tree_equal(sub2, tree["g050"])
    assert http.requests <= 3 and http.bytes_served - tail <= 1.05 * needed
    local.close()


def test_load_all_and_verify(http, wide):
    tree, _, data = wide
    url = http.put("wide.tdz", data)
    http.reset_log()
    back = tdz_numba.load(url)
    _assert_tree_equal(back, tree)
    assert http.bytes_served <= len(data) + remote.TAIL_BYTES
    report = tdz_numba.verify(url)
    assert report.leaves == GROUPS * PER_GROUP and report.path == url
    assert tdz_numba.is_archive(url)
    assert not tdz_numba.is_archive(http.put("not.tdz", b"hello" * 100))
    assert not tdz_numba.is_archive(http.url("missing.tdz"))


def test_leaf_access_fetches_one_range(http, wide):
    tree, _, data = wide
    url = http.put("wide.tdz", data)
    with tdz_numba.open(url) as ar:
        assert len(ar) == GROUPS  # the root meta.json
        http.reset_log()
        x = ar["g001/x05"]
        assert torch.equal(x, tree["g001"]["x05"])
        assert http.requests == 2  # g001/meta.json, then the leaf (header + payload)
        assert http.bytes_served < 2 * LEAF * 4


def test_compressed_and_mixed_values(http, tmp_path):
    tree = {
        "a": torch.arange(100_000),
        "b": {"c": torch.ones(7, 3, dtype=torch.bfloat16), "s": "text"},
        "n": 3,
        "e": torch.empty(0, 5),
    }
    for comp in (None, "deflate", "lzma"):
        p = tdz_numba.save(tree, tmp_path / f"m{comp}.tdz", compression=comp)
        url = http.put(f"m{comp}.tdz", p.read_bytes())
        back = tdz_numba.load(url, num_threads=1)
        _assert_tree_equal(back, tdz_numba.load(p))
        with tdz_numba.open(url) as ar:
            assert torch.equal(ar["a"], tree["a"]) and ar["b/s"] == "text"
        assert tdz_numba.verify(url).leaves == 3


def test_big_central_directory_third_request(http, wide):
    _, _, data = wide
    url = http.put("wide.tdz", data)
    http.reset_log()
    with remote_archive.open_remote(url, tail_bytes=4096) as ar:
        assert len(ar) == GROUPS
    assert http.requests == 3  # tail, rest of the central directory, root meta.json


# -- faults ------------------------------------------------------------------------------------
def test_dropped_connection_retries_then_fails(http, wide):
    tree, _, data = wide
    url = http.put("wide.tdz", data)
    with tdz_numba.open(url) as ar:
        http.drop = 1  # one cut: the retry succeeds
        assert torch.equal(ar["g010"].to_dict()["x03"], tree["g010"]["x03"])
        assert any(m == "GET-DROPPED" for m, *_ in http.log)
        http.drop = 100  # every attempt cut
        with pytest.raises(tdz_numba.RemoteError, match=r"wide\.tdz.*'g011/") as info:
            ar["g011"].to_dict()
        assert isinstance(info.value, TdzError) and isinstance(info.value, OSError)
        assert info.value.path == url and info.value.entry.startswith("g011/")
        http.drop = 0


def test_truncated_object(http, wide):
    _, _, data = wide
    url = http.put("trunc.tdz", data[: len(data) - 300])
    with pytest.raises(BadArchiveError, match="trunc.tdz"):
        tdz_numba.open(url)
    url = http.put("trunc2.tdz", data)
    with tdz_numba.open(url) as ar:
        http.put("trunc2.tdz", data[: len(data) // 2])  # shrinks after open: the pinned ETag differs
        with pytest.raises(tdz_numba.RemoteError, match=r"trunc2\.tdz.*changed since it was opened"):
            ar["g060"].to_dict()


def test_object_replaced_between_open_and_read(http, tmp_path):
    old = tdz_numba.save({"w": torch.zeros(1000)}, tmp_path / "a.tdz").read_bytes()
    new = tdz_numba.save({"w": torch.ones(1000)}, tmp_path / "b.tdz").read_bytes()
    assert len(old) == len(new)
    url = http.put("swap.tdz", old)
    with remote_archive.open_remote(url, tail_bytes=64) as ar:  # the leaf is not in the tail read
        assert list(ar) == ["w"]  # the root meta.json fetched before the swap
        http.put("swap.tdz", new)  # same size, another ETag: refused before any byte is used
        with pytest.raises(tdz_numba.RemoteError, match=r"swap\.tdz: .*'w\.memmap'.*changed") as info:
            ar["w"]
        assert info.value.entry == "w.memmap" and info.value.path == url
    with remote_archive.open_remote(url, tail_bytes=64, verify=False) as ar:
        assert ar["w"].sum() == 1000


def test_missing_object_and_subpath(http, wide):
    with pytest.raises(FileNotFoundError, match="nothing.tdz") as info:
        tdz_numba.open(http.url("nothing.tdz"))
    assert isinstance(info.value, TdzError) and info.value.path == http.url("nothing.tdz")
    url = http.put("wide.tdz", wide[2])
    with pytest.raises(MissingKeyError, match="wide.tdz"):
        tdz_numba.open(url, subpath="nope")
    with pytest.raises(tdz_numba.InvalidArgumentError):
        tdz_numba.open(url, mode="r+")


# -- fsspec file objects, memory:// -----------------------------------------------------------
def test_memory_and_file_objects(tmp_path):
    import fsspec

    tree = {"a": {"b": torch.arange(10)}, "t": "x"}
    url = "memory://tdz-tests/one.tdz"
    tdz_numba.save(tree, url)
    _assert_tree_equal(tdz_numba.load(url), tree)
    fs = fsspec.filesystem("memory")
    assert not [p for p in fs.ls("/tdz-tests") if p["name"].endswith(".tmp")]
    with fs.open("/tdz-tests/one.tdz", "rb") as f:
        assert tdz_numba.open(f)["a/b"].tolist() == list(range(10))
    buf = io.BytesIO()
    tdz_numba.save(tree, buf)
    _assert_tree_equal(tdz_numba.load(io.BytesIO(buf.getvalue())), tree)
    # a streamed save is byte-identical to a local save, but for the timestamps
    local = tdz_numba.save(tree, tmp_path / "one.tdz").read_bytes()
    assert len(local) == len(buf.getvalue())
    tdz_numba.save(tree, url, metadata={"step": 7})  # the file's own metadata travels too
    with tdz_numba.open(url) as ar:
        assert ar.metadata == {"step": 7}
    fs.rm("/tdz-tests", recursive=True)


# -- S3 (moto server) ----------------------------------------------------------------------------
def test_s3_roundtrip_multipart(s3, wide):
    tree, path, data = wide
    url = "s3://bucket/ckpt/wide.tdz"
    big = {"w": torch.randn(3 << 20), "small": tree["g000"]}  # 12 MiB: multipart with 5 MiB blocks
    remote_write.save_remote(flatten(big), url, storage_options=s3.storage_options, block_size=5 << 20)
    back = tdz_numba.load(url, storage_options=s3.storage_options)
    _assert_tree_equal(back, big)
    assert tdz_numba.verify(url, storage_options=s3.storage_options).leaves == 1 + PER_GROUP
    tdz_numba.save(tree, "s3://bucket/ckpt/wide2.tdz", storage_options=s3.storage_options)
    with tdz_numba.open("s3://bucket/ckpt/wide2.tdz", storage_options=s3.storage_options) as ar:
        assert len(ar) == GROUPS
        assert ar._index.requests <= 2
        _assert_tree_equal(ar["g042"].to_dict(), tree["g042"])
    with pytest.raises(tdz_numba.ArchiveExistsError):
        tdz_numba.save(tree, url, storage_options=s3.storage_options, existsok=False)


def _pending_uploads(fs) -> list:
    return fs.call_s3("list_multipart_uploads", Bucket="bucket").get("Uploads", [])


def test_s3_upload_interrupted_leaves_old_object(s3, monkeypatch):
    fs = s3.fs()
    url = "s3://bucket/keep.tdz"
    old = {"v": torch.arange(1000)}
    tdz_numba.save(old, url, storage_options=s3.storage_options)
    calls = []

    def failing(stream, data):
        calls.append(1)
        if len(calls) > 4:
            raise KeyboardInterrupt  # interrupted mid-stream, after parts went out
        return real(stream, data)

    real = remote_write._write
    monkeypatch.setattr(remote_write, "_write", failing)
    with pytest.raises(KeyboardInterrupt):
        remote_write.save_remote(
            flatten({"v": torch.randn(4 << 20)}),
            url,
            storage_options=s3.storage_options,
            block_size=5 << 20,
        )
    monkeypatch.undo()
    assert _pending_uploads(fs) == []  # the multipart upload was aborted
    _assert_tree_equal(tdz_numba.load(url, storage_options=s3.storage_options), old)
    with pytest.raises(tdz_numba.TdzError):  # a new object never appeared either
        tdz_numba.open("s3://bucket/never.tdz", storage_options=s3.storage_options)


def test_s3_upload_killed_process(s3, tmp_path):
    fs = s3.fs()
    url = "s3://bucket/killed.tdz"
    tdz_numba.save({"v": torch.arange(10)}, url, storage_options=s3.storage_options)
    script = tmp_path / "child.py"
    script.write_text(
        textwrap.dedent(f"""
        import time, torch
        from tdz_numba.remote import upload as remote_upload, write as remote_write
        from tdz_numba.tdz.tree import flatten
        real = remote_write._write
        def slow(stream, data):
            time.sleep(0.05)
            return real(stream, data)
        remote_write._write = slow
        real_close = remote_upload.MultipartStream.close
        def held(self):  # the upload is never completed before the parent's kill (on a loaded
            time.sleep(120)  # machine the parts could all land between its check and its kill)
            return real_close(self)
        remote_upload.MultipartStream.close = held
        remote_write.SLICE_BYTES = 1 << 20
        opts = {s3.storage_options!r}
        remote_write.save_remote(flatten({{"v": torch.randn(16 << 20)}}), {url!r},
                                 storage_options=opts, block_size=5 << 20)
    """)
    )
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(sys.path))
    child = subprocess.Popen([sys.executable, str(script)], env=env)
    try:
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline and child.poll() is None:
            ups = _pending_uploads(fs)
            if ups and fs.call_s3(
                "list_parts", Bucket="bucket", Key=ups[0]["Key"], UploadId=ups[0]["UploadId"]
            ).get("Parts"):
                break
            time.sleep(0.05)
        assert child.poll() is None, "the upload finished before it could be killed"
        child.send_signal(signal.SIGKILL)
        child.wait()
    finally:
        if child.poll() is None:
            child.kill()
    fs.invalidate_cache()
    assert tdz_numba.load(url, storage_options=s3.storage_options)["v"].tolist() == list(range(10))
    for up in _pending_uploads(fs):  # the killed upload stays pending, never an object
        fs.call_s3("abort_multipart_upload", Bucket="bucket", Key=up["Key"], UploadId=up["UploadId"])


def test_is_remote_detection(tmp_path):
    assert remote.is_remote("s3://b/k") and remote.is_remote("https://h/x.tdz")
    assert remote.is_remote("simplecache::s3://b/k") and remote.is_remote(io.BytesIO())
    assert not remote.is_remote(str(tmp_path / "x.tdz")) and not remote.is_remote(Path("x.tdz"))
    assert not remote.is_remote("file:///tmp/x.tdz") and not remote.is_remote("C:/x.tdz")
    assert np.frombuffer(b"", np.uint8).size == 0


def test_cli_accepts_urls(http, tmp_path, capsys):
    from tdz_numba.cli import main

    p = tdz_numba.save(
        {"obs": {"x": torch.arange(12.0).reshape(3, 4)}, "r": torch.ones(3)}, tmp_path / "c.tdz"
    )
    url = http.put("cli.tdz", p.read_bytes())
    for argv in (["info", url], ["tree", url], ["show", url, "obs/x"], ["verify", url, "--json"]):
        assert main(argv) == 0, argv
    out = capsys.readouterr().out
    assert '"ok": true' in out and "obs" in out
    assert main(["convert", url, "memory://tdz-cli/c.tdz"]) == 0  # remote in, remote out
    assert tdz_numba.load("memory://tdz-cli/c.tdz")["r"].tolist() == [1.0, 1.0, 1.0]
    bad = http.put("cli-bad.tdz", p.read_bytes()[:-10])
    assert main(["verify", bad]) == 2
    assert "cli-bad.tdz" in capsys.readouterr().err


def _naive_spans(extents, max_gap, waste):
    """Oracle of RemoteIndex._spans: merge touching extents, then bridge the smallest
    gaps (<= max_gap) while their total stays within waste x the bytes needed."""
    ext = sorted(extents)
    runs = []
    for a, b in ext:
        if runs and a <= runs[-1][1]:
            runs[-1][1] = max(runs[-1][1], b)
        else:
            runs.append([a, b])
    budget = waste * sum(b - a for a, b in ext)
    gaps = sorted((runs[i + 1][0] - runs[i][1], i) for i in range(len(runs) - 1))
    bridge, used = set(), 0
    for g, i in gaps:
        if g > max_gap or used + g > budget:
            break
        used += g
        bridge.add(i)
    out = [list(runs[0])] if runs else []
    for i in range(1, len(runs)):
        if i - 1 in bridge:
            out[-1][1] = runs[i][1]
        else:
            out.append(list(runs[i]))
    return [tuple(x) for x in out]


def test_spans_match_oracle(wide, http):
    rng = np.random.default_rng(0)
    url = http.put("wide.tdz", wide[2])
    with remote_archive.open_remote(url, tail_bytes=64) as ar:
        idx = ar._index
        for _ in range(50):
            rows = rng.choice(len(idx.names), size=int(rng.integers(1, 300)), replace=False)
            got = idx._spans(rows)
            ext = [
                (int(idx.table["header_offset"][i]), int(min(idx._limit[i], idx.tail_start)))
                for i in rows
                if idx.table["header_offset"][i] < idx.tail_start
            ]
            assert got == _naive_spans(ext, remote.MAX_GAP, remote.MAX_WASTE)


def test_streamed_save_memory_is_bounded():
    """A streamed save holds no copy of the archive: peak traced memory stays far below its size."""
    import tracemalloc

    class Sink:  # a write-only stream that keeps nothing (like an upload)
        n = 0

        def write(self, b):
            self.n += memoryview(b).nbytes
            return memoryview(b).nbytes

    tree = {f"w{i}": torch.ones(4 << 20) for i in range(8)}  # 128 MiB
    entries = flatten(tree)
    sink = Sink()
    remote_write.stream_entries(entries[:2], Sink())  # warm-up: kernels loaded outside the trace
    tracemalloc.start()
    try:
        n = remote_write.stream_entries(entries, sink)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert n == sink.n > 128 << 20
    assert peak < 16 << 20, peak


def test_pack_to_url_and_refusals(tmp_path):
    tree = {"a": {"b": torch.arange(5)}}
    p = tdz_numba.save(tree, tmp_path / "x.tdz")
    d = tdz_numba.unpack(p, tmp_path / "dir")
    url = "memory://tdz-pack/x.tdz"
    tdz_numba.pack(d, url)
    _assert_tree_equal(tdz_numba.load(url), tree)
    for call in (
        lambda: tdz_numba.refresh_checksums(url),
        lambda: tdz_numba.allocate(tree, url),
        lambda: tdz_numba.unpack(url, tmp_path / "out"),
    ):
        with pytest.raises(tdz_numba.UnsupportedError, match="memory://tdz-pack/x.tdz"):
            call()
    with pytest.raises(FileNotFoundError):
        tdz_numba.pack(tmp_path / "nodir", url)
    import fsspec

    fsspec.filesystem("memory").rm("/tdz-pack", recursive=True)


def test_parts_checked_as_they_land_with_drops(http, wide, monkeypatch):
    """Small parts: each entry is checked as the parts it lies in land; cut connections in
    the middle are retried and the values are right."""
    tree, _, data = wide
    url = http.put("wide.tdz", data)
    monkeypatch.setattr(remote, "PART_BYTES", 256 << 10)
    with remote_archive.open_remote(url) as ar:
        http.reset_log()
        http.drop = 2
        back = ar.to_dict()
        assert ar._index._ready.all() and ar._index.local_checked
    http.drop = 0
    _assert_tree_equal(back, tree)
    assert sum(m == "GET-DROPPED" for m, *_ in http.log) == 2
    assert sum(m == "GET" for m, *_ in http.log) > 3  # several parts
    assert http.bytes_served - sum(n for m, _, _, n in http.log if m == "GET-DROPPED") <= len(data)


def test_convert_to_and_from_urls(tmp_path):
    from safetensors.torch import save_file

    save_file({"w": torch.arange(6.0)}, tmp_path / "m.safetensors")
    url = "memory://tdz-conv/m.tdz"
    tdz_numba.convert(tmp_path / "m.safetensors", url)
    assert tdz_numba.load(url)["w"].tolist() == [0.0, 1.0, 2.0, 3.0, 4.0, 5.0]
    tdz_numba.convert(url, tmp_path / "back.safetensors")  # a remote .tdz as the source
    assert tdz_numba.load(tmp_path / "back.safetensors")["w"].tolist() == [0.0, 1.0, 2.0, 3.0, 4.0, 5.0]
    with pytest.raises(tdz_numba.UnsupportedError, match="memory://tdz-conv/m.safetensors"):
        tdz_numba.convert(tmp_path / "m.safetensors", "memory://tdz-conv/m.safetensors")
    assert not Path("memory:").exists()
    import fsspec

    fsspec.filesystem("memory").rm("/tdz-conv", recursive=True)
