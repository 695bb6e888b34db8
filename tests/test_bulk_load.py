"""Whole-level loads (``TdzSource.quick_level``) against the general path.

``build_tree`` builds a TensorDict level of plain stored leaves in one pass;
every other level, and anything unusual, goes through the general path
(``level`` + ``tensors``). These tests load the same archives both ways (the
quick path switched off by patching it to decline) and compare what a user
sees: keys and their order, level metadata, values, dtypes, shapes, that
leaves are views of the file, and the errors bad archives raise.
"""

from __future__ import annotations

import gzip
import json
import zipfile
from pathlib import Path

import numpy as np
import pytest
import torch
from ziputil import rewrite

import tdz_numba
from tdz_numba.errors import BadArchiveError, TdzError
from tdz_numba.tdz import bounds
from tdz_numba.tdz.source import TdzSource
from tdz_numba.tdz.tree import Level

HOSTILE = Path(__file__).parent / "fixtures" / "hostile"


def _general(monkeypatch):
    monkeypatch.setattr(TdzSource, "quick_level", lambda self, prefix: None)


def _same(a, b, where="<root>"):
    """Same keys in the same order, same level metadata, same values and types."""
    assert type(a) is type(b), where
    if isinstance(a, dict):
        assert list(a) == list(b), where
        if isinstance(a, Level):
            assert a.meta == b.meta and a.keyed == b.keyed, where
        for k in a:
            _same(a[k], b[k], f"{where}/{k}")
    elif isinstance(a, torch.Tensor):
        assert a.dtype == b.dtype and a.shape == b.shape and a.stride() == b.stride(), where
        assert torch.equal(a, b) if not a.is_floating_point() else torch.equal(a.nan_to_num(), b.nan_to_num())
    else:
        assert a == b, where


def _tree():
    rng = np.random.default_rng(1)
    return {
        "w": torch.from_numpy(rng.standard_normal((3, 5)).astype(np.float32)),
        "layers": {
            f"{i}": {
                "bias": torch.arange(i + 1, dtype=torch.float64),
                "mask": torch.tensor([True, False] * (i + 1)),
                "half": torch.ones(2, 2, dtype=torch.bfloat16),
            }
            for i in range(4)
        },
        "odd keys": {"a/b": torch.zeros(1), "%": torch.ones(1), ".": torch.full((2,), 7, dtype=torch.int16)},
        "scalar": torch.tensor(3.5),
        "empty": torch.zeros(0, 4),
        "big": torch.arange(10_000, dtype=torch.int32).reshape(100, 100),
        "c": torch.ones(3, dtype=torch.complex64),
        "tag": "run-1",
        "n": 7,
    }


@pytest.fixture
def archive(tmp_path):
    return tdz_numba.save(_tree(), tmp_path / "x.tdz")


def test_quick_load_is_the_general_load(archive, monkeypatch):
    quick = tdz_numba.load(archive)
    _same(quick, _tree_as_level(archive, monkeypatch))
    assert quick["layers"]["2"]["mask"].tolist() == [True, False] * 3
    assert quick["tag"] == "run-1" and quick["n"] == 7  # non-tensor data: the general path, inside


def _tree_as_level(path, monkeypatch):
    with monkeypatch.context() as m:
        _general(m)
        return tdz_numba.load(path)


def test_quick_levels_are_used_and_leaves_are_views_of_the_file(archive, monkeypatch):
    calls = []
    real = TdzSource.quick_level

    def spy(self, prefix):
        got = real(self, prefix)
        calls.append((prefix, got is not None))
        return got

    monkeypatch.setattr(TdzSource, "quick_level", spy)
    with tdz_numba.open(archive) as ar:
        d = ar.to_dict()
        assert ("", True) in calls and ("layers/0/", True) in calls
        assert ("tag/", False) in calls  # a NonTensorData level takes the general path
        base = ar._state.source.index.buffer.ctypes.data
        for t in (d["w"], d["layers"]["3"]["bias"], d["big"]):
            assert base <= t.data_ptr() < base + ar._state.source.index.size  # a view, no copy
        assert d["w"] is ar["w"]  # one cached view per leaf, whichever path made it
        assert d["layers"]["1"]["half"] is ar["layers", "1", "half"]


def test_subpath_and_level_to_dict(archive, monkeypatch):
    sub = tdz_numba.load(archive, subpath="layers/2")
    _same(sub, Level({k: v for k, v in _tree()["layers"]["2"].items()}, meta=sub.meta))
    with tdz_numba.open(archive) as ar:
        lvl = ar["layers"].to_dict()
        assert list(lvl) == ["0", "1", "2", "3"]
        assert torch.equal(lvl["3"]["bias"], torch.arange(4, dtype=torch.float64))


@pytest.mark.filterwarnings("ignore:Casting complex values")
def test_options_take_the_general_path(archive):
    d = tdz_numba.load(archive, copy=True, dtype=torch.float16)
    assert d["w"].dtype == torch.float16 and d["big"].dtype == torch.int32
    m = tdz_numba.load(archive, device="meta")
    assert m["big"].device.type == "meta" and m["big"].shape == (100, 100)


def test_compressed_and_r_plus_archives(tmp_path, monkeypatch):
    tree = {"a": torch.arange(1000.0), "b": {"c": torch.ones(64, dtype=torch.int8)}}
    p = tdz_numba.save(tree, tmp_path / "z.tdz", compression="deflate")
    _same(tdz_numba.load(p), _tree_as_level(p, monkeypatch))
    q = tdz_numba.save(tree, tmp_path / "s.tdz")
    d = tdz_numba.load(q, mode="r+")
    d["a"][0] = 42.0
    del d
    assert tdz_numba.load(q)["a"][0].item() == 42.0


@pytest.mark.parametrize(
    "change",
    [
        {"shape": [4, 5]},  # the payload has 3x5 elements
        {"shape": [3, -5]},
        {"shape": [3.0, 5]},
        {"shape": "3,5"},
        {"dtype": "torch.float128"},
        {"dtype": ["torch.float32"]},
        {"shape": [2**62, 4]},
    ],
)
def test_bad_leaf_records_raise_the_general_paths_error(archive, tmp_path, monkeypatch, change):
    def edit(name, data):
        if name != "meta.json":
            return data
        meta = json.loads(data)
        meta["w"].update(change)
        return json.dumps(meta).encode()

    bad = rewrite(archive, tmp_path / "bad.tdz", edit)
    with pytest.raises(TdzError) as quick:
        tdz_numba.load(bad)
    with monkeypatch.context() as m:
        _general(m)
        with pytest.raises(TdzError) as general:
            tdz_numba.load(bad)
    assert type(quick.value) is type(general.value) and str(quick.value) == str(general.value)
    assert "w" in str(quick.value)


def test_missing_payload_and_missing_level(archive, tmp_path):
    dropped = ("big.memmap", "layers/1/meta.json")
    bad = rewrite(archive, tmp_path / "bad.tdz", lambda n, d: None if n in dropped else d)
    with pytest.raises(BadArchiveError, match="layers"):
        tdz_numba.load(bad)
    with tdz_numba.open(bad) as ar, pytest.raises(TdzError, match="big"):
        ar["big"]


@pytest.mark.parametrize("case", sorted(p.name for p in HOSTILE.glob("*load*.bin.gz"))[:40])
def test_hostile_archives_same_outcome_both_ways(case, tmp_path, monkeypatch):
    p = tmp_path / "h.tdz"
    p.write_bytes(gzip.decompress((HOSTILE / case).read_bytes()))

    def outcome():
        try:
            d = tdz_numba.load(p)
        except TdzError as exc:
            return type(exc).__name__, str(exc)
        return "ok", repr(sorted(d)) if isinstance(d, dict) else repr(d)

    quick = outcome()
    with monkeypatch.context() as m:
        _general(m)
        general = outcome()
    assert quick == general


# -- meta.json decoding: orjson when present, json otherwise, same values ------------------------
DOCS = [
    b'{"a": {"shape": [3], "dtype": "torch.float32", "device": "cpu", "is_nested": false}}',
    b'{"n": 100000000000000000000, "m": -9223372036854775809}',  # beyond 64 bits: json's ints
    b'{"x": NaN, "y": Infinity}',
    b'{"x": 1e400}',
    b'{"s": "\\ud800"}',
    b'{"a": 1, "a": 2}',
    b"[" * 100 + b"]" * 100,
]


@pytest.mark.parametrize("doc", DOCS)
def test_parse_meta_is_json_with_or_without_orjson(doc, monkeypatch):
    expected = json.loads(doc.decode())
    got = bounds.parse_meta(doc, "m")
    with monkeypatch.context() as m:
        m.setattr(bounds, "_orjson_loads", None)
        plain = bounds.parse_meta(doc, "m")
    assert repr(got) == repr(plain) == repr(expected)


@pytest.mark.parametrize("doc", [b"{", b'{"a": 1} x', b"\xff\xfe", b"[" * 200_000 + b"]" * 200_000])
def test_parse_meta_refuses_what_json_refuses(doc, monkeypatch):
    with pytest.raises(BadArchiveError, match="not valid JSON"):
        bounds.parse_meta(doc, "m")
    monkeypatch.setattr(bounds, "_orjson_loads", None)
    with pytest.raises(BadArchiveError, match="not valid JSON"):
        bounds.parse_meta(doc, "m")


@pytest.mark.parametrize(
    ("shape", "itemsize", "expected"),
    [
        ([], 4, 4),
        ([0], 8, 0),
        ([3, 0, 2**40], 1, 0),
        ([3, 0, 2**62], 1, -1),
        ([2**61, 4], 1, 2**63),
        ([2**61, 2], 4, -1),
        ([1] * 65, 1, -1),
    ],
)
def test_shape_nbytes_bounds(shape, itemsize, expected):
    want = -1 if expected >= 2**63 else expected
    assert bounds.shape_nbytes(shape, itemsize) == want
    assert bounds.shape_ok(shape, itemsize) == (want >= 0)


def test_nesting_deeper_than_python_recursion_saves_and_loads(tmp_path):
    tree: dict = {"x": torch.arange(3)}
    for _ in range(1500):
        tree = {"a": tree}
    p = tdz_numba.save(tree, tmp_path / "deep.tdz")
    node = tdz_numba.load(p)
    depth = 0
    while "a" in node:
        node, depth = node["a"], depth + 1
    assert depth == 1500 and node["x"].tolist() == [0, 1, 2]
    with zipfile.ZipFile(p) as z:  # depth first, meta.json before the level's files
        names = z.namelist()
    assert names[0] == "meta.json" and names[1] == "a/meta.json" and names[-1].endswith("a/x.memmap")


def test_a_bad_local_header_outside_the_leaves_loads_as_the_general_path_does(tmp_path, monkeypatch):
    p = tdz_numba.save({"w": torch.arange(6.0), "g": {"x": torch.ones(2)}}, tmp_path / "x.tdz")
    with zipfile.ZipFile(p, "a") as z:
        z.writestr("junk.bin", b"not a leaf")
    data = bytearray(p.read_bytes())
    with zipfile.ZipFile(p) as z:
        data[z.getinfo("junk.bin").header_offset] ^= 0xFF  # its local header signature
    p.write_bytes(bytes(data))
    quick = tdz_numba.load(p)
    _same(quick, _tree_as_level(p, monkeypatch))
    assert quick["w"].tolist() == [0.0, 1.0, 2.0, 3.0, 4.0, 5.0] and quick["g"]["x"].tolist() == [1.0, 1.0]
    with pytest.raises(BadArchiveError, match="junk.bin"):
        tdz_numba.verify(p)


@pytest.mark.parametrize("n, size", [(3000, 700), (40, 300_000)])
def test_copy_of_many_tdz_leaves_reads_every_byte(tmp_path, n, size):
    """load(copy=True) of a .tdz reads the leaves by scatter preadv in file order (consecutive
    leaves and their 64-byte padding in one read): every leaf owned and equal to its view."""
    g = torch.Generator().manual_seed(n)
    tree = {
        f"k{i:05d}": torch.randint(0, 255, (size + i % 7,), dtype=torch.uint8, generator=g) for i in range(n)
    }
    tree["f"] = torch.randn(33, generator=g)
    p = tdz_numba.save(tree, tmp_path / "many.tdz")
    got = tdz_numba.load(p, copy=True)
    with tdz_numba.open(p) as ar:
        base = ar["k00000"].untyped_storage().data_ptr()
        for k, v in tree.items():
            assert torch.equal(got[k], v), k
            assert got[k].untyped_storage().data_ptr() != base
