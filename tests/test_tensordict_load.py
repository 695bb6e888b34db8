"""``enable()``'s ``TensorDict.load_memmap``: the bulk path (one open, every leaf in one
call, levels built with ``TensorDict._new_unsafe``) returns what tensordict 0.15.3
returns: classes, leaf types, batch sizes, devices, names, lock and memmap flags, key
order, values, non-tensor data; files that are not archives still reach tensordict.
"""

from __future__ import annotations

import warnings
import zipfile
from pathlib import Path

import pytest
import torch

pytest.importorskip("tensordict")

from tensordict import NonTensorData, TensorDict, TensorDictBase  # noqa: E402
from tensordict.tensorclass import is_tensorclass  # noqa: E402
from ziputil import rewrite  # noqa: E402

import tdz_numba.tensordict as tdt  # noqa: E402

pytestmark = [
    pytest.mark.filterwarnings("ignore::FutureWarning"),
    pytest.mark.filterwarnings("ignore::UserWarning"),
]


def _grouped(n_groups=5, per_group=20, values=7):
    """The benchmark's shape: groups of leaves (float32, int64 and bool mixed in)."""
    g = torch.Generator().manual_seed(0)
    groups = {}
    for i in range(n_groups):
        leaves = {f"l{j:02d}": torch.randn(values, generator=g) for j in range(per_group)}
        leaves["idx"] = torch.arange(values) * i
        leaves["mask"] = torch.arange(values) % (i + 2) == 0
        groups[f"g{i:03d}"] = leaves
    groups["top"] = torch.ones(3, 2)
    return TensorDict(groups, batch_size=[])


def _batched():
    return TensorDict(
        obs=TensorDict(x=torch.randn(4, 3), y=torch.zeros(4, 2, dtype=torch.float64), batch_size=[4]),
        r=torch.arange(4.0),
        note=NonTensorData("hello", batch_size=[4]),
        batch_size=[4],
        names=["t"],
    )


def _flags(td) -> list:
    """Per level: class, batch size, device, names, locked, memmap and shared flags, keys."""
    out = []
    stack = [("", td)]
    while stack:
        where, node = stack.pop()
        if is_tensorclass(node) and not isinstance(node, TensorDictBase):
            out.append((where, type(node), node._non_tensordict))
            node = node._tensordict
        if isinstance(node, NonTensorData):
            out.append((where, type(node), node.data, node.batch_size))
            continue
        out.append(
            (
                where,
                type(node),
                node.batch_size,
                node.device,
                node.names if node._has_names() else None,
                node.is_locked,
                node.is_memmap(),
                node._is_shared,
                list(node.keys()),
            )
        )
        for key in node.keys():
            value = node.get(key)
            if isinstance(value, torch.Tensor):
                out.append((f"{where}/{key}", type(value), value.dtype, value.shape, value.device))
            else:
                stack.append((f"{where}/{key}", value))
    return out


def _same_values(a, b) -> None:
    for (ka, va), (kb, vb) in zip(a.items(True, True), b.items(True, True)):
        assert ka == kb
        if isinstance(va, torch.Tensor):
            assert torch.equal(va, vb), ka


@pytest.mark.parametrize("make", [_grouped, _batched], ids=["grouped", "batched"])
@pytest.mark.parametrize("written_by", ["tensordict", "enabled"])
def test_enabled_load_memmap_matches_tensordict(make, written_by, tmp_path):
    td = make()
    p = tmp_path / "x.tdz"
    if written_by == "enabled":
        with tdt.enabled():
            td.save(p)
    else:
        td.save(p)
    theirs = TensorDict.load_memmap(p)
    with tdt.enabled():
        ours = TensorDict.load_memmap(p)
    assert _flags(ours) == _flags(theirs)
    _same_values(ours, theirs)


def test_enabled_leaves_are_views_of_one_mapping(tmp_path):
    p = tmp_path / "x.tdz"
    _grouped().save(p)
    with tdt.enabled():
        td = TensorDict.load_memmap(p)
    storages = {t.untyped_storage().data_ptr() for t in td.values(True, True)}
    assert len(storages) == 1  # zero-copy: one mapping of the file
    # mode="r" is copy-on-write: a write is private to the process
    before = p.read_bytes()
    td["g000", "l00"][0] = 123.0
    assert p.read_bytes() == before


def test_enabled_subpath_and_device(tmp_path):
    p = tmp_path / "x.tdz"
    _batched().save(p)
    for kwargs in ({"subpath": "obs"}, {"device": "cpu"}, {"device": "meta"}):
        theirs = TensorDict.load_memmap(p, **kwargs)
        with tdt.enabled():
            ours = TensorDict.load_memmap(p, **kwargs)
        assert _flags(ours) == _flags(theirs), kwargs
        if kwargs.get("device") != "meta":
            _same_values(ours, theirs)


def test_not_an_archive_reaches_tensordict(tmp_path):
    # a zip without a top-level meta.json, a memmap directory, a missing path: the
    # same result or the same error class as tensordict's own load_memmap
    z = tmp_path / "other.tdz"
    with zipfile.ZipFile(z, "w") as f:
        f.writestr("x.txt", "not a tensordict")
    d = tmp_path / "dir"
    _batched().memmap(d)
    for target in (z, d, tmp_path / "missing.tdz"):
        try:
            theirs = TensorDict.load_memmap(target)
        except Exception as exc:  # noqa: BLE001
            theirs = exc
        with tdt.enabled():
            try:
                ours = TensorDict.load_memmap(target)
            except Exception as exc:  # noqa: BLE001
                ours = exc
        if isinstance(theirs, Exception):
            assert isinstance(ours, type(theirs)), (target, ours, theirs)
        else:
            assert _flags(ours) == _flags(theirs)


def test_truncated_archive_is_an_error_not_a_fallback(tmp_path):
    # an archive whose central directory is fine but whose leaf payload is cut: our
    # reader reports it (the open succeeded, so tensordict's path is not tried)
    p = tmp_path / "x.tdz"
    _grouped(1, 2, 1000).save(p)
    data = bytearray(p.read_bytes())
    info = zipfile.ZipFile(p).getinfo("g000/l00.memmap")
    # break the local header of one leaf: the central directory still reads
    data[info.header_offset : info.header_offset + 4] = b"XXXX"
    p.write_bytes(bytes(data))
    with tdt.enabled(), warnings.catch_warnings(), pytest.raises(Exception) as err:  # noqa: PT011
        TensorDict.load_memmap(p)
    from tdz_numba import TdzError

    assert isinstance(err.value, TdzError)


def test_bench_cell_td_tdz_enabled(tmp_path):
    # tdz bench's td_tdz_enabled cell: save, open (load_memmap) and read through enable()
    from tdz_numba.bench.peers import FORMAT_CLASSES
    from tdz_numba.bench.workloads import make_workload

    w = make_workload("small", 0.05)
    fmt, plain = FORMAT_CLASSES["td_tdz_enabled"](), FORMAT_CLASSES["td_tdz"]()
    p = tmp_path / "x.tdz"
    fmt.save(w, p)
    assert not tdt.is_enabled()
    total, td = fmt.read(w, p)
    expected, _ = plain.read(w, p)
    assert total == pytest.approx(expected)
    assert _flags(fmt.open(p)) == _flags(plain.open(p))


def test_too_deep_for_tensordict_is_a_tdz_error(tmp_path):
    # the reader allows 4,096 levels; building tensordict objects recurses: a TdzError,
    # not a bare RecursionError (tensordict's own load_memmap raises RecursionError)
    import json
    import sys

    from tdz_numba import UnsupportedError

    depth = sys.getrecursionlimit() + 200
    p = tmp_path / "deep.tdz"
    meta = {"shape": [], "device": "cpu", "_type": "<class 'tensordict._td.TensorDict'>"}
    with zipfile.ZipFile(p, "w") as z:
        for i in range(depth + 1):
            z.writestr(
                "a/" * i + "meta.json",
                json.dumps({**meta, "a": {"type": "TensorDict"}} if i < depth else meta),
            )
    with pytest.raises(UnsupportedError, match="nested too deep"):
        tdt.load(p)
    with tdt.enabled(), pytest.raises(UnsupportedError, match="nested too deep"):
        TensorDict.load_memmap(p)


def _with_level_meta(tmp_path, level: str, edit) -> Path:
    """A TensorDict with a sub-level ``s`` saved by tensordict's API, with ``edit(meta) -> meta``
    applied to the meta.json at ``level`` (``"meta.json"`` or ``"s/meta.json"``)."""
    import json

    td = TensorDict(a=torch.arange(3.0), s=TensorDict(b=torch.ones(3, 2), batch_size=[3]), batch_size=[3])
    src = tdt.save(td, tmp_path / "x.tdz")
    return rewrite(
        src,
        tmp_path / "bad.tdz",
        lambda name, data: json.dumps(edit(json.loads(data))).encode() if name == level else data,
    )


@pytest.mark.parametrize("field", ["_class", "_type", "device", "shape"])
def test_a_field_name_holding_a_leaf_record_loads_alike_both_ways(field, tmp_path, monkeypatch):
    # an edited or foreign meta.json where a reserved name holds a leaf record: a key (as
    # tdz_numba.load and Archive.meta read it), not the level's field; the one-pass level
    # (TdzSource.quick_level) and the general path build the same TensorDict, without a bare
    # TypeError (unhashable class id, torch.device of a dict) on the general one
    from tdz_numba.tdz.source import TdzSource

    leaf = {"device": "cpu", "shape": [3, 0], "dtype": "torch.float32", "is_nested": False}
    bad = _with_level_meta(tmp_path, "s/meta.json", lambda meta: {**meta, field: leaf})
    loaded = [tdt.load(bad)]
    with tdt.enabled():
        loaded.append(TensorDict.load_memmap(bad))
    monkeypatch.setattr(TdzSource, "quick_level", lambda self, prefix: None)
    loaded.append(tdt.load(bad))
    with tdt.enabled():
        loaded.append(TensorDict.load_memmap(bad))
    for out in loaded:
        s = out["s"]
        assert type(s) is TensorDict and list(s.keys()) == ["b", field]
        assert s[field].shape == (3, 0) and torch.equal(s["b"], torch.ones(3, 2))
        assert s.batch_size == (3,)  # (without its shape field, set as the root's sub-level: the root's)
        assert (s.batch_size, s.device, out.device) == (
            loaded[0]["s"].batch_size,
            loaded[0]["s"].device,
            loaded[0].device,
        )


@pytest.mark.parametrize(
    "level, change",
    [
        ("s/meta.json", {"shape": None}),
        ("s/meta.json", {"shape": "3"}),
        ("s/meta.json", {"shape": [3.0]}),
        ("meta.json", {"shape": [-3]}),
        ("s/meta.json", {"device": "nodevice"}),
        ("s/meta.json", {"device": [1]}),
        ("s/meta.json", {"_type": {"type": 5}, "_class": None}),  # not keyed: a class lookup
        ("s/meta.json", {"_class": ["x"], "shape": None}),
        ("s/meta.json", {"_names": ["t", "u"]}),  # two names, one batch dim
    ],
)
def test_malformed_level_fields_raise_tdz_errors_both_ways(level, change, tmp_path, monkeypatch):
    # batch size, device and class fields of a level come from the file: a TdzError (here
    # BadArchiveError) on the one-pass and the general path, never a bare TypeError/RuntimeError
    from tdz_numba import TdzError
    from tdz_numba.tdz.source import TdzSource

    def edit(meta: dict) -> dict:
        return {k: v for k, v in {**meta, **change}.items() if v is not None or k == "shape"}

    bad = _with_level_meta(tmp_path, level, edit)
    for general in (False, True):
        if general:
            monkeypatch.setattr(TdzSource, "quick_level", lambda self, prefix: None)
        with pytest.raises(TdzError):
            tdt.load(bad)
        with tdt.enabled(), pytest.raises(TdzError):
            TensorDict.load_memmap(bad)
