"""tensordict memmap directories opened in place, and format detection from bytes."""

import json
import zipfile

import numpy as np
import pytest
import torch

import tdz_numba
from tdz_numba import formats
from tdz_numba.errors import BadArchiveError, UnsupportedError
from tdz_numba.formats.memmap_dir import open_memmap_dir


def _tree():
    return {
        "a": torch.arange(6, dtype=torch.float32).reshape(2, 3),
        "nested": {"b": torch.ones(2, 4, dtype=torch.bfloat16), "deep": {"c": torch.tensor([1, 2, 3])}},
        "empty": torch.zeros(0, 2),
        "tag": "hello",
        "n": 3,
        "lst": [1, 2],
    }


def test_unpacked_archive(tmp_path):
    arch = tdz_numba.save(_tree(), tmp_path / "x.tdz")
    d = tdz_numba.unpack(arch, tmp_path / "d")
    assert formats.detect(d) == "memmap_dir"
    src = formats.open_source(d)
    assert src.format == "memmap_dir"
    tree = formats.to_tree(src)
    ref = tdz_numba.load(arch)
    assert list(tree) == list(ref)
    assert torch.equal(tree["a"], ref["a"]) and torch.equal(
        tree["nested"]["deep"]["c"], ref["nested"]["deep"]["c"]
    )
    assert tree["nested"]["b"].dtype == torch.bfloat16 and tree["empty"].shape == (0, 2)
    assert tree["tag"] == "hello" and tree["n"] == 3 and tree["lst"] == [1, 2]
    assert src.level("").meta["_type"].endswith("TensorDict'>") and "a" not in src.level("").meta
    # a leaf is a view of its mapped file
    spec = src.level("").children["a"].leaf
    t = formats.to_tree(src)["a"]
    assert t.untyped_storage().data_ptr() == src.files[spec.file].torch_u8.untyped_storage().data_ptr()


def test_tensordict_memmap(tmp_path):
    td_mod = pytest.importorskip("tensordict")
    td = td_mod.TensorDict({"x": torch.randn(4, 3), "sub": {"y": torch.arange(4)}}, batch_size=[4])
    td.memmap(tmp_path / "td")
    src = formats.open_source(tmp_path / "td")
    tree = formats.to_tree(src)
    assert torch.equal(tree["x"], td["x"]) and torch.equal(tree["sub"]["y"], td["sub", "y"])
    assert src.level("").meta["shape"] == [4]


def test_bad_directories(tmp_path):
    arch = tdz_numba.save({"a": torch.ones(4), "s": {"b": torch.zeros(2)}}, tmp_path / "x.tdz")
    d = tdz_numba.unpack(arch, tmp_path / "d")
    (d / "a.memmap").write_bytes(b"\0" * 3)
    with pytest.raises(BadArchiveError, match="a.memmap"):
        open_memmap_dir(d)
    (d / "a.memmap").unlink()
    with pytest.raises(BadArchiveError, match="no file"):
        open_memmap_dir(d)
    (d / "a.memmap").write_bytes(b"\0" * 16)
    (d / "s" / "meta.json").write_text("{not json")
    with pytest.raises(BadArchiveError, match="JSON"):
        open_memmap_dir(d)
    (d / "s" / "meta.json").unlink()
    with pytest.raises(BadArchiveError):
        open_memmap_dir(d)
    meta = json.loads((d / "meta.json").read_text())
    meta["a"]["dtype"] = "torch.evil"
    (d / "meta.json").write_text(json.dumps(meta))
    with pytest.raises(BadArchiveError, match="dtype"):
        open_memmap_dir(d)


def test_symlink_loop(tmp_path):
    arch = tdz_numba.save({"s": {"b": torch.zeros(2)}}, tmp_path / "x.tdz")
    d = tdz_numba.unpack(arch, tmp_path / "d")
    meta = json.loads((d / "s" / "meta.json").read_text())
    meta = {"loop": {"type": "TensorDict"}, **meta}
    (d / "s" / "meta.json").write_text(json.dumps(meta))
    (d / "s" / "loop").symlink_to(d / "s")
    with pytest.raises(BadArchiveError, match="twice"):
        open_memmap_dir(d)


# -- detection ---------------------------------------------------------------------------------------
def test_detect_ignores_extensions(tmp_path):
    from safetensors.torch import save_file

    save_file({"a": torch.ones(1)}, str(tmp_path / "weights.pt"))
    np.save(tmp_path / "arr.safetensors.npy", np.ones(1))
    torch.save({"a": torch.ones(1)}, tmp_path / "model.safetensors")
    with open(tmp_path / "z.pt", "wb") as fh:
        np.savez(fh, a=np.ones(1))
    tdz_numba.save({"a": torch.ones(1)}, tmp_path / "t.tdz").rename(tmp_path / "t.npz")  # save refuses .npz
    assert formats.detect(tmp_path / "weights.pt") == "safetensors"
    assert formats.detect(tmp_path / "arr.safetensors.npy") == "npy"
    assert formats.detect(tmp_path / "model.safetensors") == "torch"
    assert formats.detect(tmp_path / "z.pt") == "npz"
    assert formats.detect(tmp_path / "t.npz") == "tdz"
    assert formats.open_source(tmp_path / "t.npz") is None


@pytest.mark.parametrize(
    "raw, exc",
    [
        (b"", BadArchiveError),
        (b"hello world", UnsupportedError),
        (b"PK\x03\x04garbage", BadArchiveError),
    ],
)
def test_detect_unknown_and_malformed(tmp_path, raw, exc):
    p = tmp_path / "f"
    p.write_bytes(raw)
    with pytest.raises(exc):
        formats.detect(p)
    with pytest.raises(exc):
        formats.open_source(p)


def test_detect_other_zip_and_dirs(tmp_path):
    p = tmp_path / "o.zip"
    with zipfile.ZipFile(p, "w") as z:
        z.writestr("readme.txt", b"x")
    with pytest.raises(UnsupportedError, match="not a tensor file"):
        formats.detect(p)
    with pytest.raises(UnsupportedError):
        formats.detect(tmp_path)  # a directory of neither kind
    with pytest.raises(FileNotFoundError):
        formats.detect(tmp_path / "missing")


def test_registry_two_line_extension(tmp_path):
    formats.register(
        "fake", lambda p, head, size: head.startswith(b"FAKE"), "tdz_numba.formats.numpy_fmt:open_npy"
    )
    try:
        p = tmp_path / "f"
        p.write_bytes(b"FAKE....")
        assert formats.detect(p) == "fake"
    finally:
        del formats.FORMATS["fake"]


def test_open_source_reuses_a_sniff(tmp_path):
    from tdz_numba.formats.detect import sniff

    p = tmp_path / "x.pt"
    torch.save({"a": torch.arange(3)}, p)
    name, ctx = sniff(p)
    assert name == "torch" and ctx is not None
    src = formats.open_source(p, sniffed=(name, ctx))
    assert formats.to_tree(src)["a"].tolist() == [0, 1, 2]
