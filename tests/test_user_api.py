"""Torch / TensorDict habits (issue 25): rows by index, in-place writes, to_tensordict, load(keys=,
map_location=, dtype by name), a subpath that is a leaf, a short Level repr, a clean dir(tdz_numba),
save_model / load_model with tied weights, save refusing another format's suffix."""

from __future__ import annotations

import subprocess
import sys

import numpy as np
import pytest
import torch

import tdz_numba
from tdz_numba import InvalidArgumentError, MissingKeyError


@pytest.fixture
def batched(tmp_path):
    td = pytest.importorskip("tensordict")
    data = td.TensorDict(
        x=torch.arange(10),
        y=torch.arange(20.0).reshape(10, 2),
        sub=td.TensorDict(z=torch.arange(30).reshape(10, 3), batch_size=[10]),
        batch_size=[10],
    )
    import tdz_numba.tensordict as tdt

    return tdt.save(data, tmp_path / "b.tdz"), data


def test_rows_by_index_on_archive_and_level(batched):
    path, data = batched
    with tdz_numba.open(path) as ar:
        rows = ar[2:5]
        assert rows.batch_size == [3]
        assert rows["x"].tolist() == [2, 3, 4]
        assert torch.equal(rows["sub"]["z"], data["sub", "z"][2:5])
        assert rows["y"].untyped_storage().data_ptr() == ar["y"].untyped_storage().data_ptr()  # a view
        one = ar[7]
        assert one["x"].item() == 7 and one.batch_size == []
        mask = torch.arange(10) % 3 == 0
        assert ar[mask]["x"].tolist() == [0, 3, 6, 9]
        assert ar[torch.tensor([9, 0])]["y"].tolist() == [[18.0, 19.0], [0.0, 1.0]]
        assert ar["sub"][1:3]["z"].tolist() == [[3, 4, 5], [6, 7, 8]]  # a sub-level with a batch size
        with pytest.raises(InvalidArgumentError, match="does not fit the batch size"):
            ar[10]
    tree = tdz_numba.load(path)
    assert tree[0:2]["x"].tolist() == [0, 1]
    assert tree[-1]["sub"]["z"].tolist() == [27, 28, 29]


def test_rows_need_a_batch_size(tmp_path):
    p = tdz_numba.save({"a": torch.ones(3)}, tmp_path / "x.tdz")
    with tdz_numba.open(p) as ar, pytest.raises(MissingKeyError, match="no batch size"):
        ar[0:2]


def test_setitem_writes_in_place(tmp_path):
    p = tdz_numba.save({"w": torch.zeros(2, 3), "n": {"b": torch.arange(4)}}, tmp_path / "x.tdz")
    with tdz_numba.open(p, mode="r+") as ar:
        ar["w"] = torch.ones(2, 3)
        ar["n/b"] = np.array([4, 5, 6, 7])
        with pytest.raises(InvalidArgumentError, match="same dtype and shape"):
            ar["w"] = torch.ones(3, 2)
        with pytest.raises(InvalidArgumentError, match="same dtype and shape"):
            ar["w"] = torch.ones(2, 3, dtype=torch.float64)
        with pytest.raises(InvalidArgumentError, match="not a tensor leaf"):
            ar["n"] = torch.ones(1)
        with pytest.raises(MissingKeyError):
            ar["nope"] = torch.ones(1)
    tdz_numba.refresh_checksums(p)
    back = tdz_numba.load(p)
    assert back["w"].tolist() == [[1.0] * 3] * 2 and back["n"]["b"].tolist() == [4, 5, 6, 7]
    with tdz_numba.open(p) as ar, pytest.raises(InvalidArgumentError, match="read-only"):
        ar["w"] = torch.zeros(2, 3)
    assert tdz_numba.load(p)["w"].sum().item() == 6.0


def test_to_tensordict(batched, monkeypatch):
    path, data = batched
    with tdz_numba.open(path) as ar:
        td = ar.to_tensordict()
        assert td.batch_size == torch.Size([10])
        assert td["sub"].batch_size == torch.Size([10])
        assert (td == data).all()
        monkeypatch.setitem(sys.modules, "tensordict", None)
        with pytest.raises(tdz_numba.UnsupportedError, match="needs the tensordict package"):
            ar.to_tensordict()


def test_load_keys_map_location_dtype_names(tmp_path):
    p = tdz_numba.save(
        {"0.weight": torch.ones(2), "1.bias": torch.zeros(3), "g": {"h": torch.ones(1)}}, tmp_path / "m.tdz"
    )
    got = tdz_numba.load(p, keys=["1.bias", "g/h"])
    assert sorted(got) == ["1.bias", "g"] and got["g"]["h"].tolist() == [1.0]
    with pytest.raises(MissingKeyError):
        tdz_numba.load(p, keys=["nope"])
    with pytest.raises(InvalidArgumentError, match="keys"):
        tdz_numba.load(p, keys=[3])
    assert tdz_numba.load(p, map_location="meta")["0.weight"].device.type == "meta"
    with pytest.raises(InvalidArgumentError, match="not both"):
        tdz_numba.load(p, map_location="cpu", device="cpu")
    assert tdz_numba.load(p, dtype="float16")["0.weight"].dtype == torch.float16
    assert tdz_numba.load(p, dtype="torch.bfloat16")["0.weight"].dtype == torch.bfloat16
    with tdz_numba.open(p, dtype="float64") as ar:
        assert ar["0.weight"].dtype == torch.float64
    with pytest.raises(InvalidArgumentError, match="names no torch dtype"):
        tdz_numba.load(p, dtype="float17")


def test_subpath_that_is_a_leaf(tmp_path):
    from safetensors.torch import save_file

    p = tdz_numba.save({"0.weight": torch.ones(2), "a": {"b": torch.ones(1)}}, tmp_path / "m.tdz")
    with pytest.raises(MissingKeyError, match="'0.weight' names a tensor leaf, not a level"):
        tdz_numba.load(p, subpath="0.weight")
    with pytest.raises(MissingKeyError, match="'a/b' names a tensor leaf"):
        tdz_numba.open(p, subpath="a/b")
    assert tdz_numba.load(p, subpath="a")["b"].tolist() == [1.0]
    with pytest.raises(MissingKeyError):
        tdz_numba.load(p, subpath="zz")
    save_file({"w": torch.ones(1)}, str(tmp_path / "s.safetensors"))
    with pytest.raises(MissingKeyError, match="'w' names a tensor leaf"):
        tdz_numba.load(tmp_path / "s.safetensors", subpath="w")


def test_level_repr_is_a_summary(tmp_path):
    model = torch.nn.Sequential(*[torch.nn.Linear(64, 64) for _ in range(30)])
    p = tdz_numba.save(model.state_dict(), tmp_path / "m.tdz")
    text = repr(tdz_numba.load(p))
    lines = text.splitlines()
    assert lines[0] == "Level[TensorDict](60 leaves, 499.2 KB)"
    assert lines[1] == "  0.weight: float32[64, 64]"
    assert lines[-1] == "  ... 20 more entries"
    assert len(lines) == 42 and len(text) < 2000
    assert "tensor(" not in text


def test_dir_is_clean_and_import_is_cheap():
    names = dir(tdz_numba)
    for bad in ("Any", "TYPE_CHECKING", "annotations", "importlib", "errors"):
        assert bad not in names
    assert set(tdz_numba.__all__) <= set(names) and "__version__" in names
    code = "import sys, tdz_numba; dir(tdz_numba); print(sorted(m for m in ('torch', 'numba') if m in sys.modules))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"


class _Tied(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.emb = torch.nn.Embedding(5, 3)
        self.head = torch.nn.Linear(3, 5, bias=False)
        self.head.weight = self.emb.weight


def test_save_model_load_model_tied(tmp_path):
    torch.manual_seed(0)
    m = _Tied()
    p = tdz_numba.save_model(m, tmp_path / "m.tdz", metadata={"note": "x"})
    assert sorted(tdz_numba.load(p)) == ["emb.weight"]
    assert tdz_numba.open(p).metadata == {"note": "x", "head.weight": "emb.weight"}
    fresh = _Tied()
    assert tdz_numba.load_model(fresh, p) == ([], [])
    assert torch.equal(fresh.head.weight, m.emb.weight) and fresh.head.weight is fresh.emb.weight
    other = torch.nn.Linear(3, 5)
    with pytest.raises(
        MissingKeyError, match="missing from the file: 'bias', 'weight'; unexpected in the file: 'emb.weight'"
    ):
        tdz_numba.load_model(other, p)
    assert tdz_numba.load_model(other, p, strict=False) == (["bias", "weight"], ["emb.weight"])
    # a plain model round-trips; a view that does not cover its storage is refused
    lin = torch.nn.Linear(4, 2)
    q = tdz_numba.save_model(lin, tmp_path / "l.tdz")
    lin2 = torch.nn.Linear(4, 2)
    tdz_numba.load_model(lin2, q)
    assert torch.equal(lin2.weight, lin.weight)
    bad = torch.nn.Module()
    base = torch.zeros(10)
    bad.register_buffer("a", base[0:4])
    bad.register_buffer("b", base[2:6])
    with pytest.raises(InvalidArgumentError, match="share memory but none covers"):
        tdz_numba.save_model(bad, tmp_path / "bad.tdz")


@pytest.mark.parametrize(
    "suffix", [".safetensors", ".pt", ".pth", ".npz", ".npy", ".gguf", ".h5", ".hdf5", ".onnx", ".PT"]
)
def test_save_refuses_another_formats_suffix(tmp_path, suffix):
    with pytest.raises(InvalidArgumentError, match="save writes .tdz archives"):
        tdz_numba.save({"a": torch.ones(1)}, tmp_path / f"x{suffix}")
    assert not (tmp_path / f"x{suffix}").exists()
    assert tdz_numba.save({"a": torch.ones(1)}, tmp_path / "x.ckpt").exists()  # any other name: fine


# -- convert round-trips ---------------------------------------------------------------------------
def _same(a, b, where=""):
    assert list(a) == list(b), where
    for k in a:
        x, y = a[k], b[k]
        if isinstance(x, torch.Tensor):
            assert isinstance(y, torch.Tensor) and x.dtype == y.dtype and x.shape == y.shape, where + k
            assert torch.equal(
                x.view(torch.uint8) if x.dtype.is_floating_point else x,
                y.view(torch.uint8) if y.dtype.is_floating_point else y,
            ), where + k
        elif isinstance(x, dict):
            _same(x, y, f"{where}{k}/")
        else:
            assert x == y, where + k


@pytest.mark.parametrize("fmt", ["tdz", "safetensors", "pt", "npz", "gguf", "hdf5", "onnx", "memmap_dir"])
def test_convert_round_trips(tmp_path, fmt):
    from test_training_after_load import _state, _write

    from tdz_numba.conversion import jsonable

    if fmt == "safetensors":
        from safetensors.torch import save_file

        src = tmp_path / "m.safetensors"
        save_file(_state(), str(src), metadata={"format": "pt", "note": "héllo"})
    elif fmt == "gguf":
        gguf = pytest.importorskip("gguf")
        src = tmp_path / "m.gguf"
        w = gguf.GGUFWriter(str(src), "llama")
        w.add_uint32("t.u32", 7)
        w.add_float32("t.f32", 0.5)
        w.add_string("t.str", "x")
        w.add_array("t.arr", [1, 2, 3])
        for k, v in _state().items():
            w.add_tensor(k, v.numpy())
        w.write_header_to_file()
        w.write_kv_data_to_file()
        w.write_tensors_to_file()
        w.close()
    elif fmt == "tdz":
        src = tdz_numba.save(_state(), tmp_path / "m.tdz", metadata={"epoch": 3, "tags": ["a", "b"]})
    else:
        src = _write(fmt, tmp_path, _state())
    out = tdz_numba.convert(src, tmp_path / "out.tdz")
    _same(tdz_numba.load(src), tdz_numba.load(out))
    assert "0.weight" in tdz_numba.load(out)  # flat stays flat
    with tdz_numba.open(src) as a, tdz_numba.open(out) as b:
        want = jsonable(a.metadata)
        assert b.metadata == want
        if fmt in ("safetensors", "gguf", "tdz"):
            assert want  # the metadata that round-trips is not empty
        if fmt == "gguf":
            assert want["t.u32"] == 7 and want["t.arr"] == [1, 2, 3] and want["t.str"] == "x"
    bare = tdz_numba.convert(src, tmp_path / "noext")  # no suffix: .tdz
    assert tdz_numba.open(bare).format == "tdz"


def test_convert_to_safetensors_keeps_metadata(tmp_path):
    from safetensors import safe_open
    from safetensors.torch import save_file

    src = tmp_path / "a.safetensors"
    save_file({"0.weight": torch.ones(2)}, str(src), metadata={"format": "pt"})
    mid = tdz_numba.convert(src, tmp_path / "b.tdz")
    back = tdz_numba.convert(mid, tmp_path / "c.safetensors")
    with safe_open(str(back), "pt") as f:
        assert f.metadata() == {"format": "pt"} and list(f.keys()) == ["0.weight"]
    assert tdz_numba.convert(src, tmp_path / "d.safetensors").exists()
    nested = tdz_numba.convert(src, tmp_path / "n.tdz", nest=".")
    assert tdz_numba.load(nested)["0"]["weight"].tolist() == [1.0, 1.0]


@pytest.mark.parametrize("name", ["m2.pt", "x.npz", "x.gguf", "x.h5", "x.bin"])
def test_convert_refuses_other_suffixes(tmp_path, name):
    src = tdz_numba.save({"a": torch.ones(1)}, tmp_path / "a.tdz")
    with pytest.raises(InvalidArgumentError, match=r"convert writes \.tdz archives .* and \.safetensors"):
        tdz_numba.convert(src, tmp_path / name)
    assert not (tmp_path / name).exists()


def test_cli_convert_keys_and_nest(tmp_path):
    from safetensors.torch import save_file

    from tdz_numba.cli.command import main

    src = tmp_path / "a.safetensors"
    save_file({"0.weight": torch.ones(2)}, str(src))
    assert main(["convert", str(src), str(tmp_path / "flat.tdz")]) == 0
    assert list(tdz_numba.load(tmp_path / "flat.tdz")) == ["0.weight"]
    assert main(["convert", "--nest", ".", str(src), str(tmp_path / "n.tdz")]) == 0
    assert list(tdz_numba.load(tmp_path / "n.tdz")["0"]) == ["weight"]
    assert main(["convert", str(src), str(tmp_path / "m2.pt")]) != 0
    assert not (tmp_path / "m2.pt").exists()
