"""safetensors reader: every dtype, metadata, sharded checkpoints, strict header validation."""

import json
import struct

import pytest
import torch
from safetensors.torch import save_file

from tdz_numba import formats
from tdz_numba.errors import BadArchiveError, TdzError, UnsupportedError
from tdz_numba.formats.safetensors import DTYPES, open_safetensors, open_sharded


def _all_dtypes():
    out = {}
    for i, (name, dt) in enumerate(sorted(DTYPES.items())):
        if dt.is_floating_point or dt.is_complex:
            t = torch.randn(3, 2, dtype=torch.float32 if not dt.is_complex else torch.complex64).to(dt)
        elif dt == torch.bool:
            t = torch.tensor([[True, False], [False, True], [True, True]])
        else:
            t = (
                torch.arange(6, dtype=torch.int64).reshape(3, 2).to(dt)
                if dt.itemsize > 1 or dt != torch.uint8
                else torch.arange(6, dtype=torch.uint8).reshape(3, 2)
            )
        out[f"t{i}_{name}"] = t
    return out


def _same(a, b):
    assert a.dtype == b.dtype and a.shape == b.shape
    assert torch.equal(a.view(torch.uint8), b.view(torch.uint8)) if a.numel() else True


def test_every_dtype_zero_copy(tmp_path):
    tensors = _all_dtypes()
    tensors = {
        k: v for k, v in tensors.items() if not k.endswith(("C128",))
    }  # not a safetensors-python dtype
    p = tmp_path / "all.safetensors"
    try:
        save_file(tensors, str(p), metadata={"format": "pt", "x": "y"})
    except (KeyError, ValueError, TypeError):  # an older safetensors lacks some dtype
        tensors = {k: v for k, v in tensors.items() if "E8M0" not in k and "FNUZ" not in k}
        save_file(tensors, str(p), metadata={"format": "pt", "x": "y"})
    src = formats.open_source(p)
    assert src.format == "safetensors" and formats.detect(p) == "safetensors"
    assert src.metadata == {"format": "pt", "x": "y"}
    tree = formats.to_tree(src)
    assert set(tree) == set(tensors)
    for k, v in tensors.items():
        _same(tree[k], v)
        spec = src.level("").children[k].leaf
        assert spec.type_name == k.split("_", 1)[1]


def test_views_share_the_mapping(tmp_path):
    p = tmp_path / "x.safetensors"
    save_file({"a": torch.arange(16, dtype=torch.float32), "b": torch.ones(4, dtype=torch.float64)}, str(p))
    src = open_safetensors(p)
    a = formats.to_tree(src)["a"]
    base = src.files[0].torch_u8
    assert a.untyped_storage().data_ptr() == base.untyped_storage().data_ptr()
    copied = formats.to_tree(src, copy=True)["a"]
    assert copied.untyped_storage().data_ptr() != base.untyped_storage().data_ptr()
    assert torch.equal(a, copied)


def test_empty_and_zero_size(tmp_path):
    p = tmp_path / "e.safetensors"
    save_file({"z": torch.zeros(0, 3), "s": torch.tensor(2.5)}, str(p))
    tree = formats.to_tree(formats.open_source(p))
    assert tree["z"].shape == (0, 3) and tree["s"].item() == 2.5


def _sharded(tmp_path):
    a = {"w1": torch.randn(3, 4), "b1": torch.arange(3)}
    b = {"w2": torch.randn(2, 2, dtype=torch.float16)}
    save_file(a, str(tmp_path / "model-00001-of-00002.safetensors"), metadata={"format": "pt"})
    save_file(b, str(tmp_path / "model-00002-of-00002.safetensors"), metadata={"format": "pt"})
    wmap = {k: "model-00001-of-00002.safetensors" for k in a} | {
        k: "model-00002-of-00002.safetensors" for k in b
    }
    idx = tmp_path / "model.safetensors.index.json"
    idx.write_text(json.dumps({"metadata": {"total_size": 60}, "weight_map": wmap}))
    return idx, {**a, **b}


def test_sharded_index_and_directory(tmp_path):
    idx, ref = _sharded(tmp_path)
    for target in (idx, tmp_path):
        assert formats.detect(target) == "safetensors"
        src = formats.open_source(target)
        assert src.format == "safetensors" and len(src.files) == 2
        assert src.metadata["total_size"] == 60 and src.metadata["format"] == "pt"
        tree = formats.to_tree(src)
        assert set(tree) == set(ref)
        for k in ref:
            assert torch.equal(tree[k], ref[k])


@pytest.mark.parametrize(
    "edit, exc",
    [
        (lambda ix: ix["weight_map"].update(missing="model-00001-of-00002.safetensors"), BadArchiveError),
        (lambda ix: ix["weight_map"].pop("b1"), BadArchiveError),  # shard 1 holds a name the map lacks
        (lambda ix: ix["weight_map"].update(w1="../etc/passwd"), BadArchiveError),
        (lambda ix: ix["weight_map"].update(w1="nope.safetensors"), BadArchiveError),
        (lambda ix: ix.pop("weight_map"), BadArchiveError),
    ],
)
def test_sharded_index_validated(tmp_path, edit, exc):
    idx, _ = _sharded(tmp_path)
    ix = json.loads(idx.read_text())
    edit(ix)
    idx.write_text(json.dumps(ix))
    with pytest.raises(exc):
        open_sharded(idx)


def test_sharded_duplicate_name(tmp_path):
    idx, _ = _sharded(tmp_path)
    save_file({"w1": torch.zeros(1)}, str(tmp_path / "model-00002-of-00002.safetensors"))
    ix = json.loads(idx.read_text())
    ix["weight_map"] = {"w1": "model-00001-of-00002.safetensors", "b1": "model-00001-of-00002.safetensors"}
    ix["weight_map"]["w1"] = "model-00002-of-00002.safetensors"
    idx.write_text(json.dumps(ix))
    with pytest.raises(BadArchiveError, match="w1"):
        open_sharded(idx)


def _raw(header: dict, data: bytes, pad_to=8) -> bytes:
    h = json.dumps(header).encode()
    h += b" " * (-len(h) % pad_to)
    return struct.pack("<Q", len(h)) + h + data


_GOOD = {
    "a": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]},
    "b": {"dtype": "I16", "shape": [2], "data_offsets": [8, 12]},
}


def test_handwritten_good(tmp_path):
    p = tmp_path / "h.safetensors"
    p.write_bytes(_raw({**_GOOD, "__metadata__": {"k": "v"}}, struct.pack("<ffhh", 1.5, 2.5, 7, -8)))
    tree = formats.to_tree(open_safetensors(p))
    assert tree["a"].tolist() == [1.5, 2.5] and tree["b"].tolist() == [7, -8]


def _bad(**changes):
    h = json.loads(json.dumps(_GOOD))
    for path, value in changes.items():
        name, field = path.split("__")
        if value is ...:
            del h[name][field]
        else:
            h[name][field] = value
    return h


@pytest.mark.parametrize(
    "header, data, match",
    [
        (_bad(a__dtype="F33"), 12, "'a'.*dtype"),
        (_bad(a__dtype=5), 12, "'a'.*dtype"),
        (_bad(a__shape=[-1]), 12, "'a'.*shape"),
        (_bad(a__shape=[3]), 12, "'a'.*data_offsets"),
        (_bad(a__shape="2"), 12, "'a'.*shape"),
        (_bad(a__data_offsets=[0, 8, 9]), 12, "'a'.*data_offsets"),
        (_bad(a__data_offsets=[8, 0]), 12, "'a'.*data_offsets"),
        (_bad(b__data_offsets=[4, 8]), 12, "'b'.*data_offsets"),  # overlap
        (_bad(b__data_offsets=[10, 14]), 14, "'b'"),  # gap
        (_bad(b__data_offsets=[8, 112]), 12, "'b'.*data_offsets"),  # out of bounds
        (_bad(a__data_offsets=...), 12, "'a'.*data_offsets"),
        (_bad(a__extra=1), 12, "'a'.*unknown"),
        (_GOOD, 20, "data area"),  # trailing bytes
        ({**_GOOD, "__metadata__": {"k": 1}}, 12, "__metadata__"),
        ({**_GOOD, "__metadata__": []}, 12, "__metadata__"),
        ({"a": [1]}, 0, "'a'"),
    ],
)
def test_bad_headers(tmp_path, header, data, match):
    p = tmp_path / "bad.safetensors"
    p.write_bytes(_raw(header, bytes(data)))
    with pytest.raises(BadArchiveError, match=match):
        open_safetensors(p)


@pytest.mark.parametrize(
    "raw, match",
    [
        (b"\x01\x00", "too short"),
        (struct.pack("<Q", 200_000_000) + b"{}", "limit"),
        (struct.pack("<Q", 100) + b"{}", "past the end"),
        (struct.pack("<Q", 4) + b"[1] ", "start"),
        (struct.pack("<Q", 4) + b"{1: ", "JSON"),
        (struct.pack("<Q", 2) + b"\xff\xfe", "start"),
        (struct.pack("<Q", 13) + b'{"a":1,"a":2}', "twice"),
    ],
)
def test_bad_framing(tmp_path, raw, match):
    p = tmp_path / "bad.safetensors"
    p.write_bytes(raw)
    with pytest.raises(BadArchiveError, match=match):
        open_safetensors(p)


def test_truncated_file_through_open_source(tmp_path):
    p = tmp_path / "t.safetensors"
    save_file({"a": torch.ones(100)}, str(p))
    p.write_bytes(p.read_bytes()[:-10])
    with pytest.raises(BadArchiveError):
        formats.open_source(p)


def test_subbyte_dtype_unsupported(tmp_path):
    p = tmp_path / "f4.safetensors"
    p.write_bytes(_raw({"a": {"dtype": "F4", "shape": [2], "data_offsets": [0, 1]}}, b"\0"))
    with pytest.raises(UnsupportedError, match="F4"):
        open_safetensors(p)
    assert issubclass(UnsupportedError, TdzError)
