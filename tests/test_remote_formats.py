"""Every format over fsspec URLs and file objects, against a real loopback HTTP Range server:
values bit for bit as a local open gives them, request and byte counts, and faults (dropped
connections, truncated bodies, 5xx answers, stalls, objects replaced between requests)."""

from __future__ import annotations

import io
import json
import time

import numpy as np
import pytest
import torch

import tdz_numba
from tdz_numba.errors import RemoteError
from tdz_numba.remote import object as remote_object
from tdz_numba.remote import transports

pytest.importorskip("fsspec")
pytest.importorskip("aiohttp")

from servers import RangeServer  # noqa: E402

N, ELEMS = 100, 4096  # 100 float32 tensors of 16 KiB


class FaultServer(RangeServer):
    """The loopback Range server, plus: ``If-Match`` answered with 412 when the object's ETag
    differs, and ``faults``, modes the next GETs take one each: ``"500"`` (an error answer),
    ``"short"`` (a 206 whose Content-Range and body stop halfway), ``"stall"`` (no answer for
    :attr:`stall_s` seconds). ``drop`` (the base server's) cuts a body halfway."""

    def __init__(self) -> None:
        super().__init__()
        self.faults: list[str] = []
        self.stall_s = 3.0
        outer = self
        base = self.httpd.RequestHandlerClass

        class Handler(base):  # type: ignore[misc,valid-type]
            def _plain(self, code: int, tag: str) -> None:
                outer._record(tag, self.path, self.headers.get("Range"), 0)
                self.send_response(code)
                self.send_header("Content-Length", "0")
                self.end_headers()

            def do_GET(self):
                key = self.path.split("?")[0]
                data = outer.objects.get(key)
                want = self.headers.get("If-Match")
                if data is not None and want and want != outer.etag(key):
                    return self._plain(412, "GET-412")
                with outer.lock:
                    mode = outer.faults.pop(0) if outer.faults else None
                if mode == "500":
                    return self._plain(500, "GET-500")
                if mode == "stall":
                    outer._record("GET-STALL", self.path, self.headers.get("Range"), 0)
                    time.sleep(outer.stall_s)
                    self.close_connection = True
                    return None
                if mode == "short" and data is not None:
                    a, b = (int(x) for x in self.headers["Range"].split("=")[1].split("-"))
                    b = a + (b + 1 - a) // 2
                    outer._record("GET-SHORT", self.path, self.headers.get("Range"), b - a)
                    self.send_response(206)
                    self.send_header("Content-Length", str(b - a))
                    self.send_header("ETag", outer.etag(key))
                    self.send_header("Content-Range", f"bytes {a}-{b - 1}/{len(data)}")
                    self.end_headers()
                    self.wfile.write(data[a:b])
                    return None
                return super().do_GET()

        self.httpd.RequestHandlerClass = Handler


@pytest.fixture(scope="module")
def http():
    server = FaultServer()
    yield server
    server.stop()


def _tensors() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return {f"t{i:03d}": torch.randn(ELEMS, generator=g) for i in range(N)}


def _gguf(path, tensors) -> None:
    gguf = pytest.importorskip("gguf")
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_string("general.name", "remote-test")
    for k, v in tensors.items():
        w.add_tensor(k, v.numpy())
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def _onnx(path, tensors) -> None:
    onnx = pytest.importorskip("onnx")
    from onnx import helper, numpy_helper

    inits = [numpy_helper.from_array(v.numpy(), k) for k, v in tensors.items()]
    outs = [helper.make_tensor_value_info(t.name, t.data_type, list(t.dims)) for t in inits]
    onnx.save(helper.make_model(helper.make_graph([], "g", [], outs, inits)), path)


def _hdf5(path, tensors) -> None:
    h5py = pytest.importorskip("h5py")
    with h5py.File(path, "w") as f:
        for k, v in tensors.items():
            f.create_dataset(k, data=v.numpy())


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    """``{format: (local path, served name)}`` of the same 100 tensors in every format."""
    from safetensors.torch import save_file

    d = tmp_path_factory.mktemp("formats")
    t = _tensors()
    out = {}
    save_file(t, d / "m.safetensors")
    out["safetensors"] = d / "m.safetensors"
    torch.save(t, d / "m.pt")
    out["torch"] = d / "m.pt"
    np.savez(d / "m.npz", **{k: v.numpy() for k, v in t.items()})
    out["npz"] = d / "m.npz"
    np.save(d / "m.npy", torch.stack(list(t.values())).numpy())
    out["npy"] = d / "m.npy"
    _gguf(d / "m.gguf", t)
    out["gguf"] = d / "m.gguf"
    _onnx(d / "m.onnx", dict(list(t.items())[:20]))
    out["onnx"] = d / "m.onnx"
    _hdf5(d / "m.h5", dict(list(t.items())[:20]))
    out["hdf5"] = d / "m.h5"
    return t, out


def _url(http, path) -> str:
    return http.put(path.name, path.read_bytes())


def _same(a, b) -> None:
    assert list(a) == list(b)
    for k in a:
        if isinstance(a[k], dict):
            _same(a[k], b[k])
        else:
            assert a[k].dtype == b[k].dtype and a[k].shape == b[k].shape, k
            assert torch.equal(a[k].contiguous().view(torch.uint8), b[k].contiguous().view(torch.uint8)), k


FORMATS = ["safetensors", "torch", "npz", "npy", "gguf", "onnx", "hdf5"]


@pytest.mark.parametrize("fmt", FORMATS)
def test_bit_exact_with_local(http, files, fmt):
    _, paths = files
    url = _url(http, paths[fmt])
    local = tdz_numba.load(paths[fmt])
    _same(tdz_numba.load(url), local)
    with tdz_numba.open(url) as ar:
        assert ar.format == tdz_numba.open(paths[fmt]).format
        key = list(local)[len(local) // 2]
        _same({key: ar[key]}, {key: local[key]})
    _same(tdz_numba.load(url, copy=True), local)
    with open(paths[fmt], "rb") as fh:  # a file object
        _same(tdz_numba.load(io.BytesIO(fh.read())), local)


@pytest.mark.parametrize("fmt", ["safetensors", "gguf", "npy", "torch", "npz"])
def test_lazy_open_one_or_two_requests(http, files, fmt):
    _, paths = files
    url = _url(http, paths[fmt])
    http.reset_log()
    with tdz_numba.open(url) as ar:
        keys = list(ar)
        assert http.requests <= 2, http.log
        assert ar.source.remote.requests == http.requests
    assert keys == list(tdz_numba.open(paths[fmt]))


@pytest.mark.parametrize("fmt", ["torch", "npz"])
def test_zip_open_round_trips(http, files, fmt, monkeypatch):
    """A foreign zip: the tail (its central directory), the small records in one range, then one
    concurrent batch of the members' local headers (bridged into at most HEAD_RANGES requests
    over gaps of at most HEAD_GAP; with no bridging: never a leaf's bytes)."""
    from tdz_numba.remote import read

    t, paths = files
    url = _url(http, paths[fmt])
    http.reset_log()
    with tdz_numba.open(url) as ar:
        assert len(ar) == N
        assert http.requests <= read.HEAD_RANGES + 2, http.log
        assert http.log[0][2] == "bytes=-65536"
    monkeypatch.setattr(read, "HEAD_GAP", 0)
    http.reset_log()
    with tdz_numba.open(url) as ar:
        assert len(ar) == N
        assert http.requests <= N + 2, http.log
        assert http.bytes_served <= (64 << 10) + N * 1500 + 16384, http.bytes_served
        opened = http.bytes_served
        assert torch.equal(ar["t042"], t["t042"])
        assert http.bytes_served - opened <= ELEMS * 4 + 4096


@pytest.mark.parametrize("fmt", ["safetensors", "gguf", "torch", "npz"])
def test_partial_load_fetches_its_bytes(http, files, fmt, monkeypatch):
    from tdz_numba.remote import read

    monkeypatch.setattr(read, "HEAD_GAP", 0)  # zips: local headers only, no leaf read through
    t, paths = files
    url = _url(http, paths[fmt])
    with tdz_numba.open(url) as ar:
        opened = http.bytes_served
        http.reset_log()
        x = ar["t042"]
        assert torch.equal(x, t["t042"])
        assert http.requests == 1, http.log
        assert http.bytes_served <= ELEMS * 4 + (64 << 10), http.log
        del opened
    http.reset_log()
    back = tdz_numba.load(url, keys=["t007", "t093"])
    assert torch.equal(back["t007"], t["t007"]) and torch.equal(back["t093"], t["t093"])
    if fmt in ("safetensors", "gguf"):  # the header + the two leaves' bytes
        assert http.bytes_served <= 2 * ELEMS * 4 + (64 << 10) + (64 << 10), http.log


# -- faults --------------------------------------------------------------------------------------
@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("fault", ["drop", "short", "500"])
def test_one_fault_is_retried(http, files, fmt, fault, monkeypatch):
    t, paths = files
    url = _url(http, paths[fmt])
    local = tdz_numba.load(paths[fmt])
    with tdz_numba.open(url) as ar:
        http.reset_log()
        if fault == "drop":
            http.drop = 1
        else:
            http.faults = [fault]
        back = ar.to_dict()
    http.drop, http.faults = 0, []
    _same(back, local)
    if fmt not in ("onnx", "hdf5"):  # those read everything at open
        assert any(m != "GET" for m, *_ in http.log), http.log


@pytest.mark.parametrize("fmt", FORMATS)
def test_persistent_fault_names_url_and_range(http, files, fmt, monkeypatch):
    _, paths = files
    url = _url(http, paths[fmt])
    monkeypatch.setattr(remote_object, "ATTEMPTS", 2)
    http.faults = ["500"] * 50
    try:
        with pytest.raises(
            RemoteError, match=r"127\.0\.0\.1.*" + paths[fmt].name.replace(".", r"\.")
        ) as info:
            tdz_numba.load(url)
    finally:
        http.faults = []
    assert info.value.path == url
    assert "HTTP 500" in str(info.value) or "first request" in str(info.value)


@pytest.mark.parametrize("fmt", ["safetensors", "torch", "npz", "gguf", "npy"])
def test_replaced_object_is_refused(http, files, fmt, tmp_path):
    """Same name, same size, other bytes, after the open: RemoteError, never a mix."""
    t, paths = files
    data = paths[fmt].read_bytes()
    url = http.put("swap-" + paths[fmt].name, data)
    with tdz_numba.open(url) as ar:
        keys = list(ar)
        flipped = bytearray(data)
        flipped[-1] ^= 0xFF
        http.put("swap-" + paths[fmt].name, bytes(flipped))
        with pytest.raises(
            RemoteError, match=r"swap-.*reading bytes \[\d+, \d+\).*changed since it was opened"
        ):
            ar[keys[len(keys) // 2]]  # (not in the first read)
    assert any(m == "GET-412" for m, *_ in http.log)


def test_replaced_without_if_match_is_caught_by_etag(files):
    """A server that ignores If-Match: the ETag of every response is compared with the pin."""
    plain = RangeServer()
    base = plain.httpd.RequestHandlerClass

    class IgnoresIfMatch(base):  # type: ignore[misc,valid-type]
        def do_GET(self):
            del self.headers["If-Match"]
            return super().do_GET()

    plain.httpd.RequestHandlerClass = IgnoresIfMatch
    try:
        t, paths = files
        data = paths["safetensors"].read_bytes()
        url = plain.put("m.safetensors", data)
        with tdz_numba.open(url) as ar:
            plain.put("m.safetensors", data[:-4] + b"\0\0\0\0")
            with pytest.raises(RemoteError, match=r"m\.safetensors.*ETag"):
                ar["t099"]
    finally:
        plain.stop()


def test_stalled_server_times_out(http, files, monkeypatch):
    t, paths = files
    url = _url(http, paths["safetensors"])
    monkeypatch.setattr(transports, "TIMEOUT_S", 0.3)
    monkeypatch.setattr(remote_object, "ATTEMPTS", 2)
    http.stall_s = 2.0
    with tdz_numba.open(url) as ar:
        http.faults = ["stall", "stall"]
        t0 = time.monotonic()
        with pytest.raises(RemoteError, match=r"m\.safetensors: reading bytes \[\d+, \d+\).*Timeout"):
            ar["t050"]
        assert time.monotonic() - t0 < 2.0
    http.faults = []


def test_stall_once_then_retried(http, files, monkeypatch):
    t, paths = files
    url = _url(http, paths["gguf"])
    monkeypatch.setattr(transports, "TIMEOUT_S", 0.3)
    http.stall_s = 1.0
    with tdz_numba.open(url) as ar:
        http.faults = ["stall"]
        assert torch.equal(ar["t053"], t["t053"])
        assert any(m == "GET-STALL" for m, *_ in http.log)
    http.faults = []


# -- sharded safetensors, caching layers, memory:// ----------------------------------------------
def test_sharded_index_relative_urls(http, files, tmp_path):
    from safetensors.torch import save

    t, _ = files
    keys = list(t)
    a, b = dict((k, t[k]) for k in keys[:50]), dict((k, t[k]) for k in keys[50:])
    http.put("shard/m-1.safetensors", save(a))
    http.put("shard/m-2.safetensors", save(b))
    wmap = {**{k: "m-1.safetensors" for k in a}, **{k: "m-2.safetensors" for k in b}}
    url = http.put("shard/m.safetensors.index.json", json.dumps({"weight_map": wmap}).encode())
    http.reset_log()
    with tdz_numba.open(url) as ar:
        assert ar.format == "safetensors" and len(ar) == N
        assert http.requests == 3, http.log  # the index, each shard's header
        assert torch.equal(ar["t077"], t["t077"])
    _same(tdz_numba.load(url), t)
    bad = http.put("shard/bad.index.json", json.dumps({"weight_map": {"x": "../m.safetensors"}}).encode())
    with pytest.raises(tdz_numba.BadArchiveError, match="not a file name next to the index"):
        tdz_numba.open(bad)
    # values that are not names (lists, objects): refused as locally, not a TypeError (unhashable)
    for value in (["m-1.safetensors"], {"a": 1}):
        odd = http.put("shard/odd.index.json", json.dumps({"weight_map": {"x": value}}).encode())
        with pytest.raises(tdz_numba.BadArchiveError, match="must be a shard file name"):
            tdz_numba.open(odd)


@pytest.mark.parametrize("layer", ["simplecache", "blockcache", "filecache"])
def test_caching_layers(http, files, layer, tmp_path):
    t, paths = files
    url = _url(http, paths["safetensors"])
    chained = f"{layer}::{url}"
    opts = {layer: {"cache_storage": str(tmp_path / "cache")}}
    back = tdz_numba.load(chained, storage_options=opts)
    _same(back, t)
    with tdz_numba.open(chained, storage_options=opts) as ar:
        assert torch.equal(ar["t010"], t["t010"])


def test_memory_filesystem_all_formats(files):
    import fsspec

    t, paths = files
    fs = fsspec.filesystem("memory")
    for fmt in ("safetensors", "gguf", "torch", "npz"):
        url = f"memory://tdz-rf/{paths[fmt].name}"
        fs.pipe(url, paths[fmt].read_bytes())
        _same(tdz_numba.load(url), tdz_numba.load(paths[fmt]))
    fs.rm("/tdz-rf", recursive=True)


def test_torch_open_two_requests_and_damaged_header(http, files):
    """A torch.save zip: its payload offsets follow from its layout, so an open is the tail and
    data.pkl; each leaf's fetch also reads its local header and checks the offset used."""
    t, paths = files
    data = paths["torch"].read_bytes()
    url = http.put("two.pt", data)
    http.reset_log()
    with tdz_numba.open(url) as ar:
        assert len(ar) == N
        assert http.requests == 2, http.log
        http.reset_log()
        assert torch.equal(ar["t042"], t["t042"])
        assert http.requests == 1 and http.bytes_served <= ELEMS * 4 + 128, http.log
    import zipfile

    with zipfile.ZipFile(paths["torch"]) as z:
        info = next(i for i in z.infolist() if i.filename.endswith("/data/42"))
    bad = bytearray(data)
    bad[info.header_offset + 28] += 8  # its local extra field is 8 bytes longer: the payload moves
    url = http.put("bad.pt", bytes(bad))
    with tdz_numba.open(url) as ar:
        key = next(k for k in ar if torch.equal(tdz_numba.open(paths["torch"])[k], t["t042"]))
        with pytest.raises(tdz_numba.BadArchiveError, match=r"bad\.pt: entry '.*/data/42'.*local header"):
            ar[key]
        assert torch.equal(ar["t041"], t["t041"])


def test_tdz_crc_checked_as_parts_land(http, files, tmp_path, monkeypatch):
    """A verified bulk fetch in many parts (each entry checked once the parts it lies in have
    landed): the same values; a flipped byte in a middle part is a ChecksumError naming its entry."""
    from tdz_numba.remote import read
    from tdz_numba.remote.archive import open_remote

    t, _ = files
    p = tdz_numba.save(t, tmp_path / "g.tdz")
    monkeypatch.setattr(read, "PART_BYTES", 64 << 10)
    monkeypatch.setattr(read, "part_size", lambda total, floor, cap: floor)  # 64 KiB parts
    url = http.put("g.tdz", p.read_bytes())
    with open_remote(url, tail_bytes=8192) as ar:  # (a tail read holding no tensor)
        http.reset_log()
        _same(ar.to_dict(), t)
        assert http.requests > 20
    with tdz_numba.open(p) as local:
        off = local._index.entry("t050.memmap").payload_offset
    bad = bytearray(p.read_bytes())
    bad[off + 100] ^= 1
    url = http.put("gbad.tdz", bytes(bad))
    with pytest.raises(tdz_numba.ChecksumError, match=r"gbad\.tdz: entry 't050\.memmap'"):
        tdz_numba.load(url)


def test_cli_info_tree_read_the_header_only(http, files, capsys):
    from tdz_numba.cli import main

    t, paths = files
    for fmt in ("safetensors", "gguf", "torch"):
        url = _url(http, paths[fmt])
        for cmd in ("info", "tree"):
            http.reset_log()
            assert main([cmd, url]) == 0
            assert http.requests <= 2 and http.bytes_served <= (80 << 10), (fmt, cmd, http.log)
        http.reset_log()
        assert main(["verify", url, "--json"]) == 0
        assert '"ok": true' in capsys.readouterr().out
        assert http.bytes_served >= paths[fmt].stat().st_size


def test_s3_formats_pinned(files):
    pytest.importorskip("s3fs")
    pytest.importorskip("moto.server")
    from servers import MotoS3

    t, paths = files
    server = MotoS3()
    try:
        fs = server.fs()
        fs.call_s3("create_bucket", Bucket="bucket")
        opts = server.storage_options
        for fmt in ("safetensors", "torch", "gguf"):
            url = f"s3://bucket/{paths[fmt].name}"
            fs.pipe(url, paths[fmt].read_bytes())
            _same(tdz_numba.load(url, storage_options=opts), tdz_numba.load(paths[fmt]))
        url = "s3://bucket/m.safetensors"
        with tdz_numba.open(url, storage_options=opts) as ar:
            assert ar.source.remote.pin.get("ETag")
            data = bytearray(paths["safetensors"].read_bytes())
            data[-1] ^= 1
            fs.pipe(url, bytes(data))
            with pytest.raises(RemoteError, match=r"s3://bucket/m\.safetensors: reading bytes.*changed"):
                ar["t050"]
    finally:
        server.stop()


def test_memmap_dir_under_url_prefix(http, files, tmp_path):
    """A tensordict memmap directory under a URL prefix: each level's meta.json and the
    listing at open, each leaf's file fetched when used (memory:// and HTTP, which lists no
    folders: sizes from HEAD requests)."""
    import fsspec

    t, _ = files
    tree = {"a": {k: t[k] for k in list(t)[:5]}, "b": t["t099"], "tag": "x"}
    d = tdz_numba.unpack(tdz_numba.save(tree, tmp_path / "d.tdz"), tmp_path / "d")
    local = tdz_numba.load(d)
    fs = fsspec.filesystem("memory")
    fs.put(str(d), "/tdz-md/d", recursive=True)
    try:
        with tdz_numba.open("memory://tdz-md/d") as ar:
            assert ar.format == "memmap_dir" and sorted(ar) == sorted(local)
            assert all(not f.obj.ranges for f in ar.source.files)  # nothing fetched at open
            assert torch.equal(ar["a/t003"], t["t003"])
        back = tdz_numba.load("memory://tdz-md/d")
        assert back["tag"] == "x" and torch.equal(back["b"], t["t099"])
        _same(back["a"], local["a"])
    finally:
        fs.rm("/tdz-md", recursive=True)
    for p in d.rglob("*"):
        if p.is_file():
            http.put("md/" + str(p.relative_to(d)), p.read_bytes())
    back = tdz_numba.load(http.url("md"))
    assert torch.equal(back["a"]["t001"], t["t001"]) and back["tag"] == "x"


def test_onnx_external_data_next_to_the_model(http, files, tmp_path):
    """ONNX external data: files named relative to the model's URL, fetched when used; a
    location leaving the folder is refused as for a local file."""
    onnx = pytest.importorskip("onnx")
    from onnx import helper, numpy_helper
    from onnx.external_data_helper import convert_model_to_external_data

    t, _ = files
    inits = [numpy_helper.from_array(t[k].numpy(), k) for k in list(t)[:10]]
    outs = [helper.make_tensor_value_info(i.name, i.data_type, list(i.dims)) for i in inits]
    model = helper.make_model(helper.make_graph([], "g", [], outs, inits))
    convert_model_to_external_data(model, all_tensors_to_one_file=True, location="w.bin", size_threshold=0)
    onnx.save(model, tmp_path / "m.onnx")
    http.put("ext/w.bin", (tmp_path / "w.bin").read_bytes())
    url = http.put("ext/m.onnx", (tmp_path / "m.onnx").read_bytes())
    http.reset_log()
    with tdz_numba.open(url) as ar:
        assert sum(m == "GET" for m, *_ in http.log) == 1  # the model; w.bin: one HEAD, no bytes
        http.reset_log()
        assert torch.equal(ar["t004"], t["t004"])
        assert http.bytes_served == ELEMS * 4, http.log
    _same(tdz_numba.load(url), tdz_numba.load(tmp_path / "m.onnx"))
    with tdz_numba.open(url) as ar:
        http.put("ext/w.bin", b"\0" * len((tmp_path / "w.bin").read_bytes()))
        with pytest.raises(RemoteError, match=r"ext/w\.bin: reading bytes.*changed"):
            ar["t007"]


def test_hdf5_needing_h5py_read_from_a_url(http, tmp_path):
    """Datasets only h5py reads (chunked, compressed, strings, compact) come from a URL as from
    the local file: libhdf5 reads the fetched object through a file object, never a local path."""
    h5py = pytest.importorskip("h5py")
    rng = np.random.default_rng(3)
    with h5py.File(tmp_path / "c.h5", "w") as f:
        f.create_dataset("c", data=np.arange(1000.0), chunks=(100,), compression="gzip")
        f.create_dataset(
            "g/s", data=rng.standard_normal((7, 9)).astype(np.float32), chunks=(2, 4), shuffle=True
        )
        f.create_dataset("plain", data=np.arange(12, dtype=np.int16).reshape(3, 4))
        f.create_dataset("compact", data=np.arange(5, dtype=np.int32), compression=None)
        f.attrs["note"] = "chunked"
    url = http.put("h5/c.h5", (tmp_path / "c.h5").read_bytes())
    back = tdz_numba.load(url)
    with h5py.File(tmp_path / "c.h5", "r") as f:
        np.testing.assert_array_equal(back["c"].numpy(), f["c"][()])
        np.testing.assert_array_equal(back["g"]["s"].numpy(), f["g/s"][()])
        np.testing.assert_array_equal(back["plain"].numpy(), f["plain"][()])
        np.testing.assert_array_equal(back["compact"].numpy(), f["compact"][()])
    _same(back, tdz_numba.load(tmp_path / "c.h5"))
    http.reset_log()
    with tdz_numba.open(url) as ar:
        assert torch.equal(ar["c"], torch.arange(1000.0, dtype=torch.float64))
    assert sum(m == "GET" for m, *_ in http.log) == 1, http.log  # the object, fetched whole once


def test_hdf5_url_with_allow_external_refused(http, tmp_path):
    """``allow_external=True`` would make libhdf5 open other files by local path: refused for a URL."""
    h5py = pytest.importorskip("h5py")
    with h5py.File(tmp_path / "e.h5", "w") as f:
        f.create_dataset("x", data=np.arange(4.0), chunks=(2,))
    url = http.put("h5/e.h5", (tmp_path / "e.h5").read_bytes())
    with pytest.raises(tdz_numba.UnsupportedError, match=r"e\.h5: allow_external=True .* local files only"):
        tdz_numba.open(url, allow_external=True)


def test_sharded_and_memmap_dir_faults(http, files, tmp_path, monkeypatch):
    """The readers of several objects: a dropped body is retried, a persistent 5xx names the
    shard's (or leaf file's) URL and range."""
    from safetensors.torch import save

    t, _ = files
    keys = list(t)
    http.put("sh2/a.safetensors", save({k: t[k] for k in keys[:50]}))
    http.put("sh2/b.safetensors", save({k: t[k] for k in keys[50:]}))
    wmap = {k: "a.safetensors" if i < 50 else "b.safetensors" for i, k in enumerate(keys)}
    url = http.put("sh2/m.safetensors.index.json", json.dumps({"weight_map": wmap}).encode())
    with tdz_numba.open(url) as ar:
        http.drop = 1
        _same(ar.to_dict(), t)
    monkeypatch.setattr(remote_object, "ATTEMPTS", 2)
    with tdz_numba.open(url) as ar:
        http.faults = ["500"] * 10
        with pytest.raises(RemoteError, match=r"sh2/b\.safetensors: reading bytes \[\d+, \d+\)"):
            ar["t080"]
    http.faults, http.drop = [], 0
    d = tdz_numba.unpack(tdz_numba.save({"a": t["t001"], "b": t["t002"]}, tmp_path / "d.tdz"), tmp_path / "d")
    for p in d.rglob("*"):
        if p.is_file():
            http.put("md2/" + str(p.relative_to(d)), p.read_bytes())
    with tdz_numba.open(http.url("md2")) as ar:
        http.faults = ["500"] * 10
        with pytest.raises(RemoteError, match=r"md2/b\.memmap: reading bytes \[0, 16384\)"):
            ar["b"]
        http.faults = []
        http.drop = 1
        assert torch.equal(ar["a"], t["t001"])
    http.drop = 0


def test_is_archive_reads_one_range(http, files):
    t, paths = files
    for fmt in ("safetensors", "onnx", "torch"):
        url = _url(http, paths[fmt])
        http.reset_log()
        assert not tdz_numba.is_archive(url)
        assert http.requests <= 2 and http.bytes_served <= (68 << 10), (fmt, http.log)


def test_gguf_header_longer_than_the_first_read(http, files, tmp_path):
    """A GGUF header of ~300 KiB (a tokenizer's vocabulary): the prefix grows until the parse
    ends inside it; the values are the local open's."""
    gguf = pytest.importorskip("gguf")
    t, _ = files
    w = gguf.GGUFWriter(str(tmp_path / "big.gguf"), "llama")
    w.add_array("tokenizer.ggml.tokens", [f"token-{i:06d}" for i in range(20000)])
    for k in list(t)[:20]:
        w.add_tensor(k, t[k].numpy())
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    url = http.put("big.gguf", (tmp_path / "big.gguf").read_bytes())
    http.reset_log()
    with tdz_numba.open(url) as ar:
        assert http.requests <= 3, http.log
        assert ar.metadata["tokenizer.ggml.tokens"][-1] == "token-019999"
    _same(tdz_numba.load(url), tdz_numba.load(tmp_path / "big.gguf"))


def test_tdz_walk_fetches_levels_in_one_batch(http, tmp_path):
    """Walking many levels of a remote .tdz: after a few levels reached one by one, every
    level's meta.json comes in one concurrent batch (at most HEAD_RANGES requests)."""
    from tdz_numba.remote import archive as remote_archive
    from tdz_numba.remote import read

    tree = {f"g{i:03d}": {"x": torch.full((8,), float(i))} for i in range(100)}
    url = http.put("walk.tdz", tdz_numba.save(tree, tmp_path / "walk.tdz").read_bytes())
    http.reset_log()
    with remote_archive.open_remote(url, tail_bytes=4096) as ar:  # the levels are not in the tail read
        assert [list(ar[k]) for k in ar] == [["x"]] * 100
        assert http.requests <= 1 + read.WALK_LEVELS + read.HEAD_RANGES + 1, len(http.log)
        assert ar["g077/x"][0] == 77.0


def test_convert_from_urls_of_other_formats(http, files, tmp_path):
    t, paths = files
    for fmt in ("safetensors", "gguf", "torch"):
        url = _url(http, paths[fmt])
        out = tdz_numba.convert(url, tmp_path / f"{fmt}.tdz")
        _same(tdz_numba.load(out), tdz_numba.load(paths[fmt]))
