"""tdz_numba.tensordict: tensordict's own API with and without tdz_numba behind it.

Every layout runs the same battery of tensordict calls (save to .tdz,
load_memmap, subpath, r+ write-through + refresh_archive_checksums,
memmap_like to .tdz, pack_memmap/unpack_memmap, is_memmap_archive) once with
``enabled()`` and once without; results, classes and error classes must match.
"""

from __future__ import annotations

import sys
import warnings
import zipfile
from pathlib import Path

import pytest
import torch

tensordict = pytest.importorskip("tensordict")

from tensordict import (  # noqa: E402
    LazyStackedTensorDict,
    NonTensorData,
    NonTensorStack,
    TensorDict,
    TensorDictBase,
    is_memmap_archive,
    pack_memmap,
    refresh_archive_checksums,
    tensorclass,
    unpack_memmap,
)
from tensordict.tensorclass import is_tensorclass  # noqa: E402
from ziputil import rewrite, zero_timestamps  # noqa: E402

import tdz_numba  # noqa: E402
import tdz_numba.tensordict as tdt  # noqa: E402

pytestmark = [
    pytest.mark.filterwarnings("ignore::FutureWarning"),
    pytest.mark.filterwarnings("ignore::UserWarning"),
]


@tensorclass
class ApiTC:
    x: torch.Tensor
    s: str


class Trip:
    def __init__(self, v):
        self.v = v

    def __eq__(self, other):
        return isinstance(other, Trip) and other.v == self.v

    def __repr__(self):
        return f"Trip({self.v})"


def make_plain():
    return TensorDict(
        a=torch.arange(24.0).reshape(4, 3, 2),
        m=torch.arange(12).reshape(4, 3) % 2 == 0,
        batch_size=[4, 3],
        names=["t", "env"],
    )


def make_nested():
    return TensorDict(
        obs=TensorDict(
            p=torch.arange(24, dtype=torch.uint8).reshape(2, 3, 4),
            deep=TensorDict(d=torch.randn(2, 5, dtype=torch.float64), batch_size=[2]),
            batch_size=[2],
        ),
        r=torch.randn(2),
        batch_size=[2],
        names=["t"],
    )


def make_lazy0():
    return LazyStackedTensorDict.lazy_stack([TensorDict(a=torch.zeros(3)), TensorDict(a=torch.ones(3))], 0)


def make_lazy1():
    return LazyStackedTensorDict.lazy_stack(
        [TensorDict(a=torch.zeros(2, 3), batch_size=[2]), TensorDict(a=torch.ones(2, 4), batch_size=[2])],
        1,
        stack_dim_name="s",
    )


def make_tc():
    return ApiTC(x=torch.arange(6.0).reshape(2, 3), s="hello", batch_size=[2])


def make_tc_in_td():
    return TensorDict(tc=make_tc(), y=torch.zeros(2), batch_size=[2])


def make_ntd():
    return TensorDict(a=torch.ones(2), s=NonTensorData("hi"), l=NonTensorData([1, "a", None]), batch_size=[])


def make_nts():
    return TensorDict(a=torch.ones(3), s=NonTensorStack("a", "b", "c"), batch_size=[3])


def make_pickled():
    return TensorDict(
        st=NonTensorStack(Trip(1), Trip(2)), d=NonTensorData({1, 2}), a=torch.arange(2.0), batch_size=[2]
    )


def make_nested_tensors():
    return TensorDict(
        n=torch.nested.nested_tensor(
            [torch.ones(2, 3), torch.arange(12.0).reshape(4, 3)], layout=torch.strided
        ),
        dense=torch.ones(2),
        batch_size=[2],
    )


def make_empty():
    return TensorDict(
        a=torch.zeros(0, 3), full=torch.ones(2, 2), sub=TensorDict(e=torch.zeros(0)), batch_size=[]
    )


def make_odd_keys():
    return TensorDict(
        {
            "odd/key name%": torch.arange(3.0),
            "": torch.ones(1),
            "é": torch.tensor([1, 2]),
            "sub dir": TensorDict({"a b": torch.ones(2)}),
        },
        batch_size=[],
    )


LAYOUTS = {
    "plain": (make_plain, None),
    "nested": (make_nested, "obs/deep"),
    "lazy0": (make_lazy0, "1"),
    "lazy1": (make_lazy1, "0"),
    "tensorclass": (make_tc, None),
    "tensorclass_in_td": (make_tc_in_td, "tc"),
    "non_tensor_data": (make_ntd, None),
    "non_tensor_stack": (make_nts, "s"),
    "pickled": (make_pickled, None),
    "nested_tensors": (make_nested_tensors, None),
    "empty_leaves": (make_empty, "sub"),
    "odd_keys": (make_odd_keys, "sub dir"),
}


# ---------------------------------------------------------------------------
# comparison helpers
# ---------------------------------------------------------------------------
def _bytes(t):
    if t.is_nested:
        return torch.cat([x.reshape(-1) for x in t.unbind(0)]) if t.numel() else torch.zeros(0)
    t = t.detach().contiguous().reshape(-1)
    return t.view(torch.uint8) if t.dtype not in (torch.uint8, torch.bool) else t


def assert_same(got, exp, where="<root>"):
    assert type(got) is type(exp), f"{where}: {type(got)} vs {type(exp)}"
    if isinstance(exp, torch.Tensor):
        assert got.dtype == exp.dtype and got.device == exp.device, where
        if exp.is_nested:
            assert got.is_nested and all(torch.equal(a, b) for a, b in zip(got.unbind(0), exp.unbind(0))), (
                where
            )
        else:
            assert got.shape == exp.shape, where
            if exp.device.type != "meta":
                assert torch.equal(_bytes(got), _bytes(exp)), where
        return
    if isinstance(exp, NonTensorData):
        assert got.data == exp.data, where
        assert got.batch_size == exp.batch_size, where
        return
    if isinstance(exp, NonTensorStack):
        assert got.tolist() == exp.tolist(), where
        assert got.batch_size == exp.batch_size, where
        return
    if is_tensorclass(exp) and not isinstance(exp, TensorDictBase):
        assert got._non_tensordict == exp._non_tensordict, where
        assert_same(got._tensordict, exp._tensordict, where + "/_tensordict")
        return
    if isinstance(exp, LazyStackedTensorDict):
        assert got.stack_dim == exp.stack_dim and got._td_dim_name == exp._td_dim_name, where
        assert len(got.tensordicts) == len(exp.tensordicts), where
        for i, (a, b) in enumerate(zip(got.tensordicts, exp.tensordicts)):
            assert_same(a, b, f"{where}/{i}")
        return
    assert isinstance(exp, TensorDictBase), where
    assert got.batch_size == exp.batch_size, where
    assert got.device == exp.device, where
    assert got.is_locked == exp.is_locked and got.is_memmap() == exp.is_memmap(), where
    assert got._has_names() == exp._has_names() and (not exp._has_names() or got.names == exp.names), where
    assert list(got.keys()) == list(exp.keys()), where
    for key in exp.keys():
        assert_same(got.get(key), exp.get(key), f"{where}/{key}")


def _first_leaf(obj):
    """A non-empty dense tensor leaf, for write-through checks."""
    if isinstance(obj, torch.Tensor):
        return obj if (not obj.is_nested and obj.numel()) else None
    if is_tensorclass(obj) and not isinstance(obj, TensorDictBase):
        return _first_leaf(obj._tensordict)
    if isinstance(obj, LazyStackedTensorDict):
        return next((x for x in map(_first_leaf, obj.tensordicts) if x is not None), None)
    if isinstance(obj, TensorDictBase):
        return next((x for x in (_first_leaf(obj.get(k)) for k in obj.keys()) if x is not None), None)
    return None


def _call(fn):
    try:
        return fn()
    except Exception as exc:  # noqa: BLE001
        return exc


def battery(td, subpath, tmp: Path) -> dict:
    """tensordict's archive API on ``td``; values or raised exceptions."""
    tmp.mkdir()
    arc, out = tmp / "x.tdz", {}
    out["memmap"] = _call(lambda: td.memmap(tmp / "m.tdz"))
    out["save"] = _call(lambda: td.save(arc))
    out["bytes"] = zero_timestamps(arc.read_bytes())
    out["load"] = _call(lambda: TensorDict.load_memmap(arc, allow_pickle=True))
    out["load_fn"] = _call(lambda: tensordict.load(arc, allow_pickle=True))
    out["meta"] = _call(lambda: TensorDict.load_memmap(arc, device="meta", allow_pickle=True))
    if subpath is not None:
        out["subpath"] = _call(lambda: TensorDict.load_memmap(arc, subpath=subpath, allow_pickle=True))
    out["bad_subpath"] = _call(lambda: TensorDict.load_memmap(arc, subpath="nope/x"))
    out["exists"] = _call(lambda: td.save(arc, existsok=False))
    rw = _call(lambda: TensorDict.load_memmap(arc, mode="r+", allow_pickle=True))
    if isinstance(rw, Exception):
        out["rw"] = rw
    else:
        leaf = _first_leaf(rw)
        if leaf is not None:
            leaf.view(-1)[0] = 1 if leaf.dtype != torch.bool else True
            out["rw_leaf"] = leaf.clone()
        del rw, leaf
        out["testzip_before"] = zipfile.ZipFile(arc).testzip()
        out["refresh"] = refresh_archive_checksums(arc)
        out["testzip_after"] = zipfile.ZipFile(arc).testzip()
        out["reloaded"] = _call(lambda: TensorDict.load_memmap(arc, allow_pickle=True))
    out["cow"] = _call(lambda: _cow(arc))
    like = tmp / "like.tdz"
    out["like"] = _call(lambda: td.memmap_like(like))
    out["like_bytes"] = zero_timestamps(like.read_bytes()) if like.exists() else None
    out["deflate"] = _call(lambda: td.save(tmp / "z.tdz", compression="deflate"))
    out["bad_compression"] = _call(lambda: td.save(tmp / "bad.tdz", compression="nope"))
    d = tmp / "dir"
    out["dir"] = _call(lambda: td.memmap(d))
    packed = tmp / "packed.tdz"
    out["pack"] = _call(lambda: pack_memmap(d, packed))
    out["pack_bytes"] = zero_timestamps(packed.read_bytes()) if packed.exists() else None
    out["pack_inside"] = _call(lambda: pack_memmap(d, d / "in.tdz"))
    out["pack_nometa"] = _call(lambda: pack_memmap(tmp / "nothing", tmp / "n.tdz"))
    out["unpack"] = _call(lambda: unpack_memmap(arc, tmp / "un"))
    un = tmp / "un"
    out["unpack_files"] = sorted(p.relative_to(un).as_posix() for p in un.rglob("*")) if un.exists() else None
    out["unpack_bad"] = _call(lambda: unpack_memmap(tmp / "dir" / "meta.json", tmp / "un2"))
    out["is_archive"] = [is_memmap_archive(p) for p in (arc, d, tmp / "missing.tdz", d / "meta.json")]
    return out


def _cow(arc):
    t = TensorDict.load_memmap(arc, allow_pickle=True)
    leaf = _first_leaf(t)
    if leaf is not None:
        leaf.view(-1)[0] = 7 if leaf.dtype != torch.bool else False
    return zero_timestamps(Path(arc).read_bytes())


def compare_results(ours: dict, theirs: dict, name: str):
    assert ours.keys() == theirs.keys()
    for key, exp in theirs.items():
        got = ours[key]
        where = f"{name}:{key}"
        if isinstance(exp, Exception):
            assert isinstance(got, type(exp)), f"{where}: {got!r} is not a {type(exp).__name__} ({exp})"
        elif isinstance(got, Exception):
            raise AssertionError(
                f"{where}: raised {got!r}, tensordict returned {type(exp).__name__}"
            ) from got
        elif isinstance(exp, (bytes, str, list, bool, type(None))):
            assert got == exp, where
        elif isinstance(exp, Path):
            assert isinstance(got, Path) and got.name == exp.name, where
        else:
            assert_same(got, exp, where)


@pytest.mark.parametrize("name", list(LAYOUTS))
def test_api_battery_enabled_vs_tensordict(name, tmp_path):
    make, subpath = LAYOUTS[name]
    td = make()
    assert not tdt.is_enabled()
    theirs = battery(td, subpath, tmp_path / "theirs")
    with tdt.enabled():
        assert tdt.is_enabled()
        ours = battery(td, subpath, tmp_path / "ours")
    assert not tdt.is_enabled()
    compare_results(ours, theirs, name)


@pytest.mark.parametrize("name", list(LAYOUTS))
def test_interop_both_ways(name, tmp_path):
    td = LAYOUTS[name][0]()
    td.save(tmp_path / "theirs.tdz")
    with tdt.enabled():
        td.save(tmp_path / "ours.tdz")
        from_theirs = TensorDict.load_memmap(tmp_path / "theirs.tdz", allow_pickle=True)
    from_ours = TensorDict.load_memmap(tmp_path / "ours.tdz", allow_pickle=True)
    ref = TensorDict.load_memmap(tmp_path / "theirs.tdz", allow_pickle=True)
    assert_same(from_theirs, ref)
    assert_same(from_ours, ref)
    # tdz_numba.tensordict.load == TensorDict.load_memmap, also without enable()
    assert_same(tdt.load(tmp_path / "theirs.tdz", allow_pickle=True), ref)
    meta = tdt.load(tmp_path / "theirs.tdz", device="meta", allow_pickle=True)
    assert_same(meta, TensorDict.load_memmap(tmp_path / "theirs.tdz", device="meta", allow_pickle=True))


def test_tdt_save_bytes_and_pickle_policy(tmp_path):
    td = make_pickled()
    td.save(tmp_path / "theirs.tdz")
    with pytest.raises(tdz_numba.InvalidTreeError):
        tdt.save(td, tmp_path / "ours.tdz")
    assert not (tmp_path / "ours.tdz").exists()
    tdt.save(td, tmp_path / "ours.tdz", allow_pickle=True)
    assert zero_timestamps((tmp_path / "ours.tdz").read_bytes()) == zero_timestamps(
        (tmp_path / "theirs.tdz").read_bytes()
    )
    with pytest.raises(tdz_numba.UnsafeContentError):
        tdt.load(tmp_path / "ours.tdz", allow_pickle=False)
    with pytest.raises(RuntimeError):  # the same class tensordict raises
        tdt.load(tmp_path / "ours.tdz", allow_pickle=False)
    with pytest.raises(tdz_numba.UnsafeContentError):  # direct calls: no pickle unless allowed
        tdt.load(tmp_path / "ours.tdz")
    with tdt.enabled(), pytest.warns(FutureWarning):  # tensordict's own default under enable()
        got = TensorDict.load_memmap(tmp_path / "ours.tdz")
    assert got["st"] == [Trip(1), Trip(2)]
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert tdt.load(tmp_path / "ours.tdz", allow_pickle=True).get("d").data == {1, 2}
    with tdt.enabled(), pytest.raises(RuntimeError):
        TensorDict.load_memmap(tmp_path / "theirs.tdz", allow_pickle=False)


def test_zero_copy_and_meta_device(tmp_path):
    td = make_nested()
    p = tdt.save(td, tmp_path / "x.tdz")
    got = tdt.load(p)
    with tdz_numba.open(p) as ar:
        base = ar["r"].untyped_storage().data_ptr()
    assert got["r"].untyped_storage().data_ptr() != 0 and not isinstance(
        got["r"], tensordict.MemoryMappedTensor
    )
    assert base != 0
    meta = tdt.load(p, device="meta")
    assert meta["obs", "p"].device.type == "meta" and meta.device == torch.device("meta")
    assert meta["obs", "p"].shape == td["obs", "p"].shape
    with tdt.enabled():
        m2 = TensorDict.load_memmap(p, device="meta")
    assert_same(m2, meta)


def test_unknown_tensorclass_not_imported(tmp_path):
    tc = make_tc()
    p = tmp_path / "tc.tdz"
    tc.save(p)
    unpacked = unpack_memmap(p, tmp_path / "dir")
    meta_path = unpacked / "meta.json"
    fake_module = "tdz_fake_module_never_imported"
    meta_path.write_text(meta_path.read_text().replace(ApiTC.__module__, fake_module))
    assert fake_module in meta_path.read_text()
    bad = pack_memmap(unpacked, tmp_path / "bad.tdz")
    assert fake_module not in sys.modules
    with pytest.raises(tdz_numba.UnsupportedError, match=f"{fake_module}.ApiTC"):
        tdt.load(bad)
    assert fake_module not in sys.modules
    # allowed_classes lets the caller name the class (qualname fallback)
    assert_same(tdt.load(bad, allowed_classes=(ApiTC,)), tdt.load(p))
    # resolved among imported modules
    assert type(tdt.load(p)) is ApiTC


def test_enable_disable_restores_exactly():
    from tensordict import _archive
    from tensordict._base import serialization

    names = [
        "is_memmap_archive",
        "pack_memmap",
        "unpack_memmap",
        "refresh_archive_checksums",
        "_save_as_archive",
        "_make_archive_like",
    ]
    before = {(m.__name__, n): vars(m).get(n) for m in (_archive, serialization, tensordict) for n in names}
    owner = next(c for c in TensorDictBase.__mro__ if "load_memmap" in vars(c))
    lm = vars(owner)["load_memmap"]
    tdt.enable()
    tdt.enable()  # idempotent
    with tdt.enabled():  # re-entrant
        assert tensordict.pack_memmap is not before[("tensordict", "pack_memmap")]
    assert tdt.is_enabled()
    assert vars(owner)["load_memmap"] is not lm
    tdt.disable()
    tdt.disable()
    after = {(m.__name__, n): vars(m).get(n) for m in (_archive, serialization, tensordict) for n in names}
    assert after == before and vars(owner)["load_memmap"] is lm


def test_enable_checks_version(monkeypatch):
    monkeypatch.setattr(tensordict, "__version__", "0.16.0")
    with pytest.raises(tdz_numba.UnsupportedError, match="0.15"):
        tdt.enable()
    assert not tdt.is_enabled()


def test_direct_load_refuses_pickles_unless_allowed(tmp_path):
    """tdz_numba.tensordict.load runs no pickle unless the caller passes allow_pickle=True;
    tensordict's own load_memmap under enable() keeps tensordict's default (warn and load)."""
    td = TensorDict(d=NonTensorData({1, 2}), a=torch.ones(2), batch_size=[])
    td.save(tmp_path / "p.tdz")
    with pytest.raises(tdz_numba.UnsafeContentError):
        tdt.load(tmp_path / "p.tdz")
    assert tdt.load(tmp_path / "p.tdz", allow_pickle=True)["d"] == {1, 2}
    with tdt.enabled(), pytest.warns(FutureWarning):
        assert TensorDict.load_memmap(tmp_path / "p.tdz")["d"] == {1, 2}


def _with_entries(src: Path, dst: Path, entries: dict[str, bytes]) -> Path:
    """``src`` with ``entries`` added or replaced (the rest copied as they are)."""
    return rewrite(src, dst, lambda name, data: None if name in entries else data, entries.items())


@pytest.mark.parametrize(
    "types",
    [
        b"{not json",
        b"\xff\xfe",
        b"[1, 2]",
        b'{"pickle_sha256": "SHA", "types": [1]}',
        b'{"pickle_sha256": "SHA", "types": {"s": ["dict"]}}',
        b"[" * 100_000 + b"]" * 100_000,
    ],
    ids=["not json", "not utf-8", "a list", "types a list", "type name a list", "nested too deeply"],
)
def test_malformed_json_types_is_a_bad_archive_error(tmp_path, types):
    import hashlib
    import pickle

    p = tmp_path / "tc.tdz"
    make_tc().save(p)
    other = pickle.dumps({})
    data = types.replace(b"SHA", hashlib.sha256(other).hexdigest().encode())
    bad = _with_entries(p, tmp_path / "bad.tdz", {"json_types.json": data, "other.pickle": other})
    # an unknown type name is tensordict's ValueError (here InvalidArgumentError); the rest is a bad file
    want = (
        tdz_numba.InvalidArgumentError
        if b"types" in types and b"[1]" not in types
        else tdz_numba.BadArchiveError
    )
    with pytest.raises(want, match="json_types.json") as info:
        tdt.load(bad)
    assert want is tdz_numba.InvalidArgumentError or info.value.entry == "json_types.json"
    with tdt.enabled(), pytest.raises(want, match="json_types.json"):
        TensorDict.load_memmap(bad)


@pytest.mark.parametrize(
    "stack_dim", [None, "0", 1.0, [0], 7], ids=["missing", "a string", "a float", "a list", "out of range"]
)
def test_malformed_stack_dim_is_a_bad_archive_error(tmp_path, stack_dim):
    import json

    td = LazyStackedTensorDict(TensorDict(a=torch.ones(2)), TensorDict(a=torch.zeros(2)), stack_dim=0)
    p = tdt.save(td, tmp_path / "ls.tdz")
    with zipfile.ZipFile(p) as z:
        meta = json.loads(z.read("meta.json"))
    if stack_dim is None:
        del meta["stack_dim"]
    else:
        meta["stack_dim"] = stack_dim
    bad = _with_entries(p, tmp_path / "bad.tdz", {"meta.json": json.dumps(meta).encode()})
    with pytest.raises(tdz_numba.BadArchiveError, match="stack") as info:
        tdt.load(bad)
    assert info.value.entry == "meta.json"
    with tdt.enabled(), pytest.raises(tdz_numba.BadArchiveError, match="stack"):
        TensorDict.load_memmap(bad)
