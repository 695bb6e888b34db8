"""One Archive over every source: a TreeSource built here (as a format reader would), the
format dispatch of open/load (a format registered by the test), copy/device/dtype/nest,
metadata, convert round trips."""

from __future__ import annotations

import json
import shutil
import subprocess

import numpy as np
import pytest
import torch

import tdz_numba
from tdz_numba import Archive, InvalidArgumentError, MissingKeyError
from tdz_numba.formats.detect import FORMATS, Format
from tdz_numba.tdz.sources import Location, MappedFile, TensorSpec, TreeSource

ST_DTYPES = {"F32": torch.float32, "I64": torch.int64, "F16": torch.float16, "U8": torch.uint8}


def _write_raw(path, tensors):
    """A flat file of concatenated tensors (64-byte aligned) and the specs a reader would make."""
    blob = bytearray()
    specs = {}
    for key, t in tensors.items():
        blob += b"\0" * (-len(blob) % 64)
        raw = t.contiguous().view(-1).view(torch.uint8).numpy().tobytes()
        specs[key] = TensorSpec(
            key, t.dtype, tuple(t.shape), None, 0, len(blob), len(raw), type_name=str(t.dtype)
        )
        blob += raw
    path.write_bytes(bytes(blob))
    return specs


def _source(path, specs, metadata=None, fmt="raw"):
    f = MappedFile.open(path)
    return TreeSource(fmt, path, specs, files=[f], metadata=metadata)


def _register_raw(monkeypatch, opener):
    """A "raw" format (``*.bin`` files) registered for this test, as a user registers one."""
    monkeypatch.setitem(FORMATS, "raw", Format("raw", lambda p, head, size: p.suffix == ".bin", opener, 0))


@pytest.fixture
def flat(tmp_path):
    tensors = {
        "model.layers.0.weight": torch.arange(12, dtype=torch.float32).reshape(3, 4),
        "model.layers.0.bias": torch.arange(3, dtype=torch.float32),
        "model.embed": torch.arange(6, dtype=torch.int64),
        "head": torch.ones(2, 2, dtype=torch.float16),
    }
    path = tmp_path / "flat.bin"
    specs = _write_raw(path, tensors)
    return path, specs, tensors


def test_tree_source_archive_mapping_info_and_nest(flat):
    path, specs, tensors = flat
    ar = Archive(_source(path, specs, {"author": "me"}))
    assert ar.format == "raw" and ar.metadata == {"author": "me"}
    assert list(ar) == list(tensors)
    for k, t in tensors.items():
        assert torch.equal(ar[k], t)
    info = ar.info("model.embed")
    assert info.zero_copy and info.location == Location(str(path), specs["model.embed"].offset, 48)
    assert info.type_name == "torch.int64"
    flat_d = ar.to_dict()
    assert list(flat_d) == list(tensors)
    nested = ar.to_dict(nest=".")
    assert torch.equal(nested["model"]["layers"]["0"]["weight"], tensors["model.layers.0.weight"])
    assert [k for k, _ in ar.iter_leaves()] == list(tensors)
    # zero-copy: the leaf is a view of the one mapping
    assert ar["head"].untyped_storage().data_ptr() == ar["model.embed"].untyped_storage().data_ptr()
    ar.close()


def test_copy_device_dtype_options(flat, monkeypatch):
    path, specs, tensors = flat
    monkeypatch.setattr(tdz_numba.archive.bulk, "_SMALL_COPY", 0)  # exercise the parallel preadv path
    ar = Archive(_source(path, specs))
    ar._state.copy = True
    d = ar.to_dict()
    for k, t in tensors.items():
        assert torch.equal(d[k], t)
        assert d[k].untyped_storage().data_ptr() != ar.source.files[0].buffer.ctypes.data
    ar.close()

    p = tdz_numba.save(
        {"a": {"w": torch.arange(6.0).reshape(2, 3)}, "i": torch.arange(3)}, path.with_suffix(".tdz")
    )
    meta = tdz_numba.load(p, device="meta")
    assert meta["a"]["w"].device.type == "meta" and meta["a"]["w"].shape == (2, 3)
    half = tdz_numba.load(p, dtype=torch.float16)
    assert half["a"]["w"].dtype == torch.float16 and half["i"].dtype == torch.int64
    owned = tdz_numba.load(p, copy=True)
    owned["a"]["w"].add_(1)
    assert tdz_numba.load(p)["a"]["w"][0, 0].item() == 0.0
    with tdz_numba.open(p, dtype=torch.float64) as ar2:
        assert ar2["a/w"].dtype == torch.float64
    with tdz_numba.open(p, dtype="float64") as ar2:
        assert ar2["a/w"].dtype == torch.float64
    with pytest.raises(InvalidArgumentError):
        tdz_numba.open(p, dtype="float33")  # (dtypes by name are accepted: torch's names only)
    with pytest.raises(InvalidArgumentError):
        tdz_numba.open(p, device="nowhere")


def test_copy_true_tdz_parallel_preadv(tmp_path, monkeypatch):
    monkeypatch.setattr(tdz_numba.archive.bulk, "_SMALL_COPY", 0)
    monkeypatch.setattr(tdz_numba.archive.bulk, "COPY_PIECE", 4096)  # several pieces per leaf
    tree = {f"k{i}": torch.randn(3000 + i) for i in range(5)}
    p = tdz_numba.save(tree, tmp_path / "x.tdz")
    back = tdz_numba.load(p, copy=True)
    with tdz_numba.open(p) as ar:
        base = ar.source.index.buffer.ctypes.data
        size = ar.source.index.size
    for k, t in tree.items():
        assert torch.equal(back[k], t)
        ptr = back[k].data_ptr()
        assert not (base <= ptr < base + size)  # owned, not a view of the mapping


def test_stub_formats_dispatch_and_convert(flat, tmp_path, monkeypatch):
    """open/load/verify/info dispatch on tdz_numba.formats.detect/open_source; convert to .tdz nests names on nest=."""
    path, specs, tensors = flat
    _register_raw(monkeypatch, lambda p, **options: _source(p, specs, {"k": "v"}))
    with tdz_numba.open(path) as ar:
        assert ar.format == "raw" and ar.metadata == {"k": "v"}
        assert "format='raw'" in repr(ar)
    tree = tdz_numba.load(path, nest=".")
    assert set(tree) == {"model", "head"}
    report = tdz_numba.verify(path)
    assert report.leaves == 4
    out = tdz_numba.convert(path, tmp_path / "conv.tdz", nest=".")  # keys are kept unless nest=
    with tdz_numba.open(out) as ar:
        assert ar.format == "tdz" and ar.metadata == {"k": "v"}
        assert torch.equal(ar["model/layers/0/weight"], tensors["model.layers.0.weight"])
    flat_out = tdz_numba.convert(path, tmp_path / "flat.tdz")
    assert "model.layers.0.bias" in tdz_numba.load(flat_out)
    from tdz_numba.cli.report import info_dict, tree_dict

    d = info_dict(path)
    assert d["format"] == "raw" and d["leaves"] == 4 and d["zero_copy_leaves"] == 4
    assert [c["key"] for c in tree_dict(path)["children"]] == list(tensors)


def test_tree_source_verify_refuses_out_of_bounds(flat, monkeypatch):
    path, specs, _ = flat
    bad = dict(specs)
    s = bad["head"]
    bad["head"] = s._replace(offset=path.stat().st_size - 2)
    _register_raw(monkeypatch, lambda p, **options: _source(p, bad))
    with pytest.raises(tdz_numba.BadArchiveError, match="outside the file"):
        tdz_numba.verify(path)


def test_save_metadata_roundtrip_and_tensordict_still_loads(tmp_path):
    td_mod = pytest.importorskip("tensordict")
    p = tdz_numba.save(
        {"a": torch.arange(3.0), "b": {"c": torch.ones(2)}},
        tmp_path / "m.tdz",
        metadata={"step": 3, "tags": ["x", "y"], "lr": 0.5},
    )
    with tdz_numba.open(p) as ar:
        assert ar.metadata == {"step": 3, "tags": ["x", "y"], "lr": 0.5}
        assert sorted(ar) == ["a", "b"]
    assert tdz_numba.verify(p).leaves == 2
    td = td_mod.TensorDict.load_memmap(p)
    assert sorted(td.keys()) == ["a", "b"] and td["b", "c"].sum().item() == 2.0
    with tdz_numba.open(tdz_numba.save({"a": torch.ones(1)}, tmp_path / "n.tdz")) as ar:
        assert ar.metadata == {}
    with pytest.raises(InvalidArgumentError):
        tdz_numba.save({"a": torch.ones(1)}, tmp_path / "bad.tdz", metadata={1: "x"})
    with pytest.raises(InvalidArgumentError):
        tdz_numba.save({"a": torch.ones(1)}, tmp_path / "bad.tdz", metadata={"x": object()})


def test_convert_tdz_to_safetensors_and_back(tmp_path):
    st = pytest.importorskip("safetensors.torch")
    tree = {
        "obs": {"pixels": torch.randint(0, 255, (2, 3), dtype=torch.uint8), "depth": torch.randn(2)},
        "reward": torch.randn(4).to(torch.bfloat16),
        "env": "cartpole",
        "n": 3,
    }
    p = tdz_numba.save(tree, tmp_path / "x.tdz", metadata={"run": "a"})
    out = tdz_numba.convert(p, tmp_path / "x.safetensors")
    loaded = st.load_file(str(out))
    assert set(loaded) == {"obs.pixels", "obs.depth", "reward"}
    assert torch.equal(loaded["obs.pixels"], tree["obs"]["pixels"])
    assert torch.equal(loaded["reward"], tree["reward"])
    from safetensors import safe_open

    with safe_open(str(out), "pt") as f:
        meta = f.metadata()
    assert json.loads(meta["env"]) == "cartpole" and json.loads(meta["n"]) == 3 and meta["run"] == "a"
    slash = tdz_numba.convert(p, tmp_path / "y.safetensors", nest="/")
    assert "obs/depth" in st.load_file(str(slash))
    # every dtype the safetensors reader names is written (complex64: "C64"), others are refused
    c64 = torch.tensor([1 + 2j, 3 - 1j], dtype=torch.complex64)
    out = tdz_numba.convert(tdz_numba.save({"c": c64}, tmp_path / "c.tdz"), tmp_path / "c.safetensors")
    assert torch.equal(st.load_file(str(out))["c"], c64)
    with pytest.raises(tdz_numba.InvalidTreeError, match="safetensors"):
        tdz_numba.convert(
            tdz_numba.save({"c": torch.ones(2, dtype=torch.complex32)}, tmp_path / "c32.tdz"),
            tmp_path / "c32.safetensors",
        )


def test_convert_tdz_to_tdz_is_a_valid_zip_tensordict_reads(tmp_path):
    td_mod = pytest.importorskip("tensordict")
    p = tdz_numba.save({"a": {"b": torch.arange(10.0)}, "s": "txt"}, tmp_path / "x.tdz")
    out = tdz_numba.convert(p, tmp_path / "y.tdz", compression="deflate")
    if shutil.which("unzip"):
        r = subprocess.run(["unzip", "-t", str(out)], capture_output=True, text=True)
        assert r.returncode == 0, r.stdout + r.stderr
    td = td_mod.TensorDict.load_memmap(out)
    assert torch.equal(td["a", "b"], torch.arange(10.0))


def test_public_level_api(tmp_path):
    p = tdz_numba.save({"a": {"b": torch.arange(3), "c": "x"}, "d": torch.zeros(2)}, tmp_path / "x.tdz")
    with tdz_numba.open(p) as ar:
        info = ar.level_info()
        assert info.keyed and {k: c.kind for k, c in info.children.items()} == {"a": "level", "d": "leaf"}
        sub = ar.sublevel(info.children["a"])
        assert sub is ar.sublevel("a")
        kids = sub.level_info().children
        assert torch.equal(sub.leaf(kids["b"]), torch.arange(3)) and torch.equal(
            ar.leaf("a/b"), torch.arange(3)
        )
        assert [t.tolist() for t in sub.leaf_tensors([kids["b"]])] == [[0, 1, 2]]
        assert ar.where("a/b").endswith("x.tdz: a/b")
        with pytest.raises(MissingKeyError):
            ar.leaf("a")
        with pytest.raises(MissingKeyError):
            ar.sublevel("d")
        ar.materialize()
        assert ar.where_is("d").nbytes == 8


def test_bulk_to_dict_matches_per_leaf(tmp_path):
    rng = np.random.default_rng(0)
    tree = {
        f"g{i}": {f"x{j}": torch.from_numpy(rng.standard_normal(j + 1).astype(np.float32)) for j in range(7)}
        for i in range(30)
    }
    tree["odd"] = {
        "u8": torch.arange(5, dtype=torch.uint8),
        "empty": torch.zeros(0, 3),
        "c": torch.ones(2, dtype=torch.complex64),
    }
    p = tdz_numba.save(tree, tmp_path / "x.tdz")
    d = tdz_numba.load(p)
    with tdz_numba.open(p) as ar:
        for path, t in ar.iter_leaves():
            a, b = path.split("/")
            assert torch.equal(d[a][b], t) and torch.equal(t, tree[a][b])


def test_archive_dequantize_gguf(tmp_path):
    gguf = pytest.importorskip("gguf")
    from gguf.quants import dequantize as gguf_dequantize
    from gguf.quants import quantize as gguf_quantize

    w32 = np.linspace(-1, 1, 4 * 64, dtype=np.float32).reshape(4, 64)
    q = gguf_quantize(w32, gguf.GGMLQuantizationType.Q8_0)
    path = tmp_path / "m.gguf"
    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_tensor("blk.0.w", q, raw_dtype=gguf.GGMLQuantizationType.Q8_0)
    writer.add_tensor("blk.0.b", np.arange(4, dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    with tdz_numba.open(path) as ar:
        assert ar.format == "gguf" and ar.info("blk.0.w").type_name == "Q8_0"
        got = ar.dequantize("blk.0.w")
        ref = gguf_dequantize(q, gguf.GGMLQuantizationType.Q8_0)
        assert got.dtype == torch.float32 and np.array_equal(got.numpy().reshape(-1), ref.reshape(-1))
        assert torch.equal(ar.dequantize("blk.0.b"), torch.arange(4, dtype=torch.float32))  # plain: as is
        assert "Q8_0" in repr(ar) or "uint8" in repr(ar)
