"""Plain TensorDict levels read once per distinct meta.json text (tdz_numba.tdz.plainlevel), as
load (TdzSource.quick_level), verify and ArchiveIndex.read_bytes use them: the template
against its oracles (shape_nbytes, torch's strides, the general path's values), levels
sharing a text and levels that do not, the cache bound, and CRC errors of meta.json."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from ziputil import parse_zip

import tdz_numba
from tdz_numba.errors import BadArchiveError, ChecksumError
from tdz_numba.tdz import plainlevel
from tdz_numba.tdz import source as tdzsource
from tdz_numba.tdz.plainlevel import plain_level

META = "<class 'tensordict._td.TensorDict'>"


@pytest.mark.parametrize(
    "shape",
    [[5], [0], [1], [], [2, 3], [True], [-1], [1.0], ["3"], [2**61], [2**63 // 4], [2**63 // 4 + 1], [2**70]],
)
def test_sizes_as_shape_nbytes(shape):
    from tdz_numba.tdz.bounds import shape_nbytes

    meta = {"a": {"device": "cpu", "shape": shape, "dtype": "torch.float32", "is_nested": False}, "shape": []}
    lvl = plain_level(meta)
    want = shape_nbytes(shape, 4)
    if want < 0:
        assert lvl is None
    else:
        assert lvl is not None and lvl.nbytes == [want] and lvl.names == ["a.memmap"]
        assert lvl.items[0][4] == tuple(shape) and lvl.items[0][5] == torch.empty(shape).stride()


@pytest.mark.parametrize(
    "meta",
    [
        [],  # not an object
        {"a": 1},  # a field that is not reserved
        {"a": {"shape": [1]}},  # neither a leaf nor a sub-level
        {"a": {"dtype": "torch.nonsense", "shape": [1]}},
        {"a": {"dtype": "torch.float32", "shape": 3}},
        {"a": {"dtype": "torch.float32", "shape": [1], "is_nested": True}},
        {"_format_version": 99, "a": {"dtype": "torch.float32", "shape": [1]}},
        {"_format_version": "1", "a": {"dtype": "torch.float32", "shape": [1]}},
        {"_type": "<class 'tensordict.tensorclass.NonTensorData'>", "data": 1},
    ],
)
def test_not_plain(meta):
    assert plain_level(meta) is None


def test_order_fields_and_subs():
    meta = {
        "z": {"dtype": "torch.int64", "shape": [2, 0, 3]},
        "shape": [2],
        "s/x": {"type": "TensorDict"},
        "a": {"dtype": "torch.bfloat16", "shape": []},
        "device": "cpu",
        "_type": META,
    }
    lvl = plain_level(meta)
    assert lvl is not None
    assert [item[0] for item in lvl.items] == ["z", "s/x", "a"]
    assert lvl.fields == {"shape": [2], "device": "cpu", "_type": META}
    assert list(lvl.fields) == ["shape", "device", "_type"]
    enc = tdz_numba.tdz.tree.encode_key("s/x")
    assert lvl.subs == [enc + "/"] and lvl.items[1] == ("s/x", enc + "/", -1, None, (), ())
    assert lvl.names == ["z.memmap", "a.memmap"] and lvl.nbytes == [0, 2] and lvl.itemsize == [8, 2]
    assert lvl.items[0][5] == torch.empty(2, 0, 3).stride() and lvl.items[2][4:] == ((), ())
    need, itemsize = lvl.arrays
    assert need.tolist() == [0, 2] and itemsize.tolist() == [8, 2]


def _groups(n_groups: int, per: int, same: bool) -> dict:
    """Groups of leaves: with ``same`` every group has the same keys, shapes and dtypes
    (one meta.json text), else each group differs."""
    tree = {}
    for g in range(n_groups):
        tree[f"g{g}"] = {
            f"k{j}": torch.arange(
                g * 100 + j * 7, g * 100 + j * 7 + (3 if same else 3 + g), dtype=torch.float32
            )
            .reshape(1, -1)
            .repeat(2, 1)
            for j in range(per)
        }
    return tree


@pytest.mark.parametrize("same", [True, False])
@pytest.mark.parametrize("groups", [3, 300])  # a small index and a kernel-parsed one
def test_shared_texts_load_each_level_values(tmp_path, same, groups, monkeypatch):
    tree = _groups(groups, 2, same)
    p = tdz_numba.save(tree, tmp_path / "x.tdz")
    calls = []
    real = plainlevel.plain_level
    for module in (plainlevel, tdzsource):  # (a level parsed already is read in tdzsource)
        monkeypatch.setattr(module, "plain_level", lambda meta: calls.append(1) or real(meta))
    both = plainlevel.plain_td_level  # the root: checked at open and read by the load in one walk
    monkeypatch.setattr(tdzsource, "plain_td_level", lambda *a: calls.append(1) or both(*a))
    scan = plainlevel.scan_td_level  # (a large root: scanned, not parsed; counted once all the same)
    monkeypatch.setattr(tdzsource, "scan_td_level", lambda *a: (got := scan(*a)) and calls.append(1) or got)
    got = tdz_numba.load(p)
    for g, sub in tree.items():
        for k, v in sub.items():
            assert torch.equal(got[g][k], v), (g, k)
    # one parse per distinct text: the root, then one (same) or one per group (not same)
    assert len(calls) == (2 if same else groups + 1)


def test_cache_bound(tmp_path, monkeypatch):
    tree = _groups(5, 2, False)
    p = tdz_numba.save(tree, tmp_path / "x.tdz")
    monkeypatch.setattr(plainlevel, "MAX_TEXTS", 2)
    got = tdz_numba.load(p)
    for g, sub in tree.items():
        for k, v in sub.items():
            assert torch.equal(got[g][k], v)
    src = tdzsource.TdzSource(p)
    try:
        for g in tree:
            assert src.quick_level(g + "/") is not None
        assert len(src._plain) == 2
    finally:
        src.close()


def test_tensordict_levels_sharing_a_text(tmp_path):
    td_mod = pytest.importorskip("tensordict")
    import tdz_numba.tensordict as tdt

    td = td_mod.TensorDict(_groups(40, 3, True), batch_size=[2])
    p = tmp_path / "t.tdz"
    td.save(p)
    plain = td_mod.TensorDict.load_memmap(p)
    with tdt.enabled():
        ours = td_mod.TensorDict.load_memmap(p)
    assert (plain == ours).all() and ours.batch_size == torch.Size([2])
    assert ours["g39", "k2"].data_ptr() != ours["g38", "k2"].data_ptr()


def _corrupt_meta(path: Path, name: str) -> None:
    data = bytearray(path.read_bytes())
    rec = next(r for r in parse_zip(data).records if r.name == name)
    text = bytes(data[rec.payload : rec.payload + rec.usize])
    i = text.index(b'"shape"')
    data[rec.payload + i + 1] = ord("S")  # still JSON, another text: the CRC no longer holds
    json.loads(bytes(data[rec.payload : rec.payload + rec.usize]))
    path.write_bytes(bytes(data))


@pytest.mark.parametrize("groups", [3, 300])
def test_meta_crc_error_names_the_entry(tmp_path, groups):
    p = tdz_numba.save(_groups(groups, 2, True), tmp_path / "x.tdz")
    _corrupt_meta(p, "g1/meta.json")
    with pytest.raises(ChecksumError, match=r"g1/meta\.json") as info:
        tdz_numba.load(p)
    assert info.value.entry == "g1/meta.json"
    with pytest.raises((ChecksumError, BadArchiveError), match=r"g1/meta\.json"):
        tdz_numba.verify(p)
