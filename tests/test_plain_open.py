"""The lean open of a plain TensorDict level (tdz_numba.tdz.plainlevel.is_plain_td / plain_children,
TdzSource.check_level): the same children, keys, shapes, dtypes and errors as the general path
(tree.describe_level) on plain and non-plain levels, and nothing built before it is asked for;
plain_td_level (check_level's one walk) as is_plain_td and plain_level on every level here, and
children_of_plain (a scanned level's children) as plain_children."""

from __future__ import annotations

import gc
import json
import zipfile
from pathlib import Path

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import tdz_numba
from tdz_numba.errors import BadArchiveError
from tdz_numba.tdz.plainlevel import (
    children_of_plain,
    is_plain_td,
    plain_children,
    plain_level,
    plain_td_level,
)
from tdz_numba.tdz.tree import TD_CLASS, TD_TYPE, describe_level

NTD = "<class 'tensordict.tensorclass.NonTensorData'>"
STACK = "<class 'tensordict._lazy.LazyStackedTensorDict'>"
LEAF = {"device": "cpu", "shape": [3], "dtype": "torch.float32", "is_nested": False}
FIELDS = {"shape": [], "device": "cpu", "_type": TD_TYPE, "_format_version": 1, "_class": TD_CLASS}


def _general(meta, prefix, names):
    """describe_level's ``(keyed, children)`` (or the exception it raises) over entry ``names``."""
    files = {n[len(prefix) :] for n in names if n.startswith(prefix) and "/" not in n[len(prefix) :]}
    dirs = {n[len(prefix) :].split("/")[0] for n in names if n.startswith(prefix) and "/" in n[len(prefix) :]}

    def has_level(sub):
        return sub + "meta.json" in names or any(n.startswith(sub) for n in names)

    try:
        keyed, children = describe_level(meta, prefix, lambda: (files, dirs), has_level, "w")
    except BadArchiveError as exc:
        return exc
    return keyed, {c.key: c for c in children}


def _contents(lvl):
    """A PlainLevel's contents (None for None)."""
    return lvl and (lvl.fields, lvl.items, lvl.names, lvl.nbytes, lvl.itemsize, lvl.subs)


def _check(meta, prefix="", names=()):
    """The fast path agrees with the general one; returns whether it took the level."""
    names = set(names)
    plain = is_plain_td(meta, prefix, names.__contains__)
    ok, lvl = plain_td_level(meta, prefix, names.__contains__)  # the same, in one walk
    assert ok is plain
    assert _contents(lvl) == _contents(plain_level(meta) if plain else None)
    if plain:
        want = _general(meta, prefix, names)
        assert not isinstance(want, Exception), want
        got = plain_children(meta, prefix)
        assert want == (True, got)
        assert list(got) == list(want[1])  # the order of meta.json
        for a, b in zip(got.values(), want[1].values()):
            assert type(a) is type(b) and type(a.leaf) is type(b.leaf)
            if a.leaf is not None:
                assert type(a.leaf.shape) is tuple and type(a.leaf.nested) is bool
        if lvl is not None:  # (a lazy open's children of a scanned level: from its columns)
            cols = children_of_plain(lvl, prefix)
            assert cols == got and list(cols) == list(got)
            assert [tuple(map(type, c.leaf or ())) for c in cols.values()] == [
                tuple(map(type, c.leaf or ())) for c in got.values()
            ]
    return plain


PLAIN = [
    {"x": LEAF},
    {"x": LEAF, **FIELDS},
    {**FIELDS, "x": LEAF, "y": {**LEAF, "shape": [2, 0, 5], "dtype": "torch.bfloat16"}},
    {"x": {**LEAF, "shape": []}, "y": {"dtype": "torch.int64", "shape": [4]}},  # no device, no is_nested
    {"odd key/é%": LEAF, "": {**LEAF, "shape": [1]}, "..": LEAF},  # robust-key encoding
    {"n": {**LEAF, "shape": [2, 3], "is_nested": True}},  # a nested leaf: its sizes' shape
    {"shape": LEAF, "_type": TD_TYPE},  # a reserved name holding a leaf is a child
    {"s": {"type": "TensorDict"}, "x": LEAF},
    {"s": {"type": "NonTensorData"}, "_class": TD_CLASS, "_type": "anything: _class decides"},
    {"x": {**LEAF, "shape": [(2**63 - 1) // 4]}},  # the largest 1-d float32 leaf
    {"x": {**LEAF, "shape": [(2**63 - 1) // 8, 2]}},  # the largest 2-d float32 leaf
    {"x": {**LEAF, "shape": [2**61 - 1, 0]}, "y": {**LEAF, "shape": [1, 1]}},
    {"x": {**LEAF, "shape": [0, 3]}, "y": {**LEAF, "shape": [3, 0]}, "z": {**LEAF, "shape": [4, 5]}},
    {"_format_version": 0, "x": LEAF},
    {},
]

NOT_PLAIN = [
    [],
    "text",
    {"a": 1},  # a field that is not reserved
    {"a": {"shape": [1]}},  # neither a leaf nor a sub-level
    {"a": {"dtype": "torch.nonsense", "shape": [1]}},  # unknown dtype: the general path (fails on access)
    {"a": {"dtype": 7, "shape": [1]}},
    {"a": {"dtype": "torch.float32"}},  # no shape
    {"a": {**LEAF, "shape": 3}},
    {"a": {**LEAF, "shape": [-1]}},
    {"a": {**LEAF, "shape": [True]}},
    {"a": {**LEAF, "shape": [1.0]}},
    {"a": {**LEAF, "shape": [2, -1]}},
    {"a": {**LEAF, "shape": [2**63 // 4]}},
    {"a": {**LEAF, "shape": [2**40, 2**40]}},
    {"a": {**LEAF, "shape": [2**62, 2]}},  # two dims: 2**63 elements
    {"a": {**LEAF, "shape": [0, 2**70]}},  # no bytes, but a stride past 2**63
    {"a": {**LEAF, "shape": [2, True]}},
    {"a": {**LEAF, "shape": [3, -1]}},
    {"a": {**LEAF, "shape": ["2", 3]}},
    {"a": {**LEAF, "shape": [1] * 65}},
    {"a": {**LEAF, "is_nested": 1}},
    {"a": {**LEAF, "is_nested": None}},
    {"_format_version": 99, "a": LEAF},
    {"_format_version": "1", "a": LEAF},
    {"_format_version": True, "a": LEAF},
    {"_type": NTD, "data": 1},
    {"_type": STACK, "stack_dim": 0},
    {"_class": "mymodule:MyTD", "a": LEAF},  # a subclass: the general path decides
    {"_type": "<class 'x.MyTD'>", "a": LEAF},
    {"missing": {"type": "TensorDict"}},  # no sub-level in the archive
    {"s": {"type": "TensorDict"}},  # (names below have only s/x.memmap: no s/meta.json)
]


@pytest.mark.parametrize("meta", PLAIN)
def test_plain_levels_as_the_general_path(meta):
    names = {"s/meta.json", "a/s/meta.json"}
    assert _check(meta, "", names)
    assert _check(meta, "a/", names)


@pytest.mark.parametrize("meta", NOT_PLAIN)
def test_other_levels_take_the_general_path(meta):
    assert not _check(meta, "", {"s/x.memmap"})


_values = st.recursive(
    st.none()
    | st.booleans()
    | st.integers(-(2**65), 2**65)
    | st.floats(allow_nan=False)
    | st.text(max_size=5),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=4), inner, max_size=3),
    max_leaves=6,
)
_shapes = st.lists(st.integers(-2, 2**62) | st.sampled_from([True, 1.0, "2", None]), max_size=4) | _values
_leaves = st.fixed_dictionaries(
    {
        "dtype": st.sampled_from(["torch.float32", "torch.uint8", "torch.float8_e4m3fn", "torch.bad", 3]),
        "shape": _shapes,
    },
    optional={
        "is_nested": st.sampled_from([False, True, 0, None]),
        "device": st.sampled_from(["cpu", None]),
        "type": st.just("T"),
    },
)
_subs = st.fixed_dictionaries({"type": st.sampled_from(["TensorDict", "NonTensorData"])})
_fields = st.fixed_dictionaries(
    {},
    optional={
        "shape": st.just([]) | _values,
        "_type": st.sampled_from([TD_TYPE, NTD, STACK]),
        "_class": st.sampled_from([TD_CLASS, "m:X"]),
        "_format_version": st.sampled_from([0, 1, 2, True, "1"]),
        "device": st.just("cpu"),
    },
)


@settings(max_examples=300, deadline=None)
@given(
    st.dictionaries(
        st.sampled_from(["a", "b", "s", "t", "x y", "shape"]), _leaves | _subs | _values, max_size=5
    ),
    _fields,
)
def test_random_levels(children, fields):
    """Whatever a meta.json holds, the fast path takes only levels the general path describes
    without error, and then gives its children."""
    _check({**children, **fields}, "p/", {"p/s/meta.json", "p/t/x.memmap"})


# -- through tdz_numba.open --------------------------------------------------------------------
def _zip(path: Path, entries: dict[str, bytes]) -> Path:
    with zipfile.ZipFile(path, "w") as z:
        for name, data in entries.items():
            z.writestr(name, data)
    return path


def _meta(obj) -> bytes:
    return json.dumps(obj).encode()


def _sub_meta() -> bytes:
    return _meta({"y": {**LEAF, "shape": [1]}, **FIELDS})


def test_open_builds_children_on_first_use(tmp_path):
    p = tdz_numba.save(
        {f"x{i}": torch.arange(3.0) + i for i in range(4)} | {"g": {"y": torch.ones(2)}}, tmp_path / "a.tdz"
    )
    with tdz_numba.open(p) as ar:
        src = ar.source
        assert src._levels == {} and set(src._checked) == {""}  # checked, nothing built
        assert src.parsed_levels() == {""}
        assert list(ar) == ["x0", "x1", "x2", "x3", "g"]
        assert set(src._levels) == {""} and src._checked == {}
        assert ar["x2"].tolist() == [2.0, 3.0, 4.0] and ar["g/y"].tolist() == [1.0, 1.0]
        assert set(src.parsed_levels()) == {"", "g/"}
    with tdz_numba.open(p) as ar:  # load after a bare open: the checked meta.json is reused
        tree = ar.to_dict()
        assert tree["x3"].tolist() == [3.0, 4.0, 5.0] and tree.meta["_type"] == TD_TYPE
    assert tdz_numba.open(p).close() is None


def _tree():
    return {
        "a": torch.arange(6).reshape(2, 3),
        "empty": torch.zeros(0, 4),
        "scalar": torch.tensor(1.5),
        "bf": torch.ones(3, dtype=torch.bfloat16),
        "nested": torch.nested.nested_tensor([torch.ones(2, 3), torch.ones(1, 3)]),
        "sub": {"b": torch.ones(1), "deep": {"c": torch.zeros(2)}, "text": "hello"},
        "odd key/x": torch.ones(1),
        "value": 3,
    }


def test_levels_of_saved_trees_as_the_general_path(tmp_path):
    p = tdz_numba.save(_tree(), tmp_path / "t.tdz")
    with zipfile.ZipFile(p) as z:
        names = set(z.namelist())
        metas = {n[: -len("meta.json")]: json.loads(z.read(n)) for n in names if n.endswith("meta.json")}
    with tdz_numba.open(p) as ar:
        src = ar.source
        for prefix, meta in metas.items():
            want = _general(meta, prefix, names)
            got = src.level(prefix)
            assert (got.keyed, got.children, got.meta) == (*want, meta)
        plain = {prefix for prefix, meta in metas.items() if is_plain_td(meta, prefix, names.__contains__)}
        assert {"", "sub/", "sub/deep/"} <= plain and "sub/text/" not in plain
        assert ar["sub/text"] == "hello" and ar["value"] == 3 and ar["nested"].is_nested
        assert ar.info("a").shape == (2, 3) and ar["odd key/x"].tolist() == [1.0]


@pytest.mark.parametrize("kernels", ["always", "never"])
def test_scanned_levels_listed_from_their_columns(tmp_path, monkeypatch, kernels):
    # levels of >= SCAN_MIN bytes: with the kernels, check_level scans them (root at open, a
    # sub-level when reached) and level() makes the children from the scan's columns, the same
    # as the general path; without them, parsed and walked (plain_children) as before
    from tdz_numba.jit import policy
    from tdz_numba.tdz import source as source_mod
    from tdz_numba.tdz.plainlevel import SCAN_MIN

    tree = {f"w{i}": torch.full((i % 3 + 1,), float(i)) for i in range(80)}
    tree["sub"] = {f"k{i}": torch.arange(i % 4, dtype=torch.int16) for i in range(60)} | {
        "deep": {"z": torch.ones(2)}
    }
    p = tdz_numba.save(tree, tmp_path / "big.tdz")
    with zipfile.ZipFile(p) as z:
        names = set(z.namelist())
        metas = {n[: -len("meta.json")]: json.loads(z.read(n)) for n in names if n.endswith("meta.json")}
        assert len(z.read("meta.json")) >= SCAN_MIN and len(z.read("sub/meta.json")) >= SCAN_MIN
    walked, collecting = [], []
    real, columns = source_mod.plain_children, source_mod.children_of_plain

    def spy(made, log):
        return lambda *a: (log.append(a[1]), collecting.append(gc.isenabled()))[0] or made(*a)

    monkeypatch.setattr(source_mod, "plain_children", spy(real, walked))
    monkeypatch.setattr(source_mod, "children_of_plain", spy(columns, []))
    with policy.forced(kernels), tdz_numba.open(p) as ar:
        src = ar.source
        for prefix in ("", "sub/", "sub/deep/"):
            got = src.level(prefix)
            assert (got.keyed, got.children, got.meta) == (
                *_general(metas[prefix], prefix, names),
                metas[prefix],
            )
            assert list(got.children) == [k for k, v in metas[prefix].items() if isinstance(v, dict)]
        assert ar["w79"].tolist() == [79.0, 79.0] and ar["sub/k7"].tolist() == [0, 1, 2]
        assert ar["sub/deep/z"].tolist() == [1.0, 1.0]
    # (the small "sub/deep/" level is parsed and walked either way)
    assert walked == (["sub/deep/"] if kernels == "always" else ["", "sub/", "sub/deep/"])
    assert collecting == [False] * 3  # (the collector paused while a level's children are made)


@pytest.mark.parametrize(
    "meta",
    [
        {"a": {**LEAF, "shape": [-1]}},
        {"a": {**LEAF, "shape": "3"}},
        {"a": {**LEAF, "shape": [2**62, 4]}},
        {"a": 5},
        {"a": {"shape": [1]}},
        {"missing": {"type": "TensorDict"}},
        {"_format_version": 7},
        [1, 2],
    ],
)
def test_bad_root_meta_raises_at_open_as_before(tmp_path, meta):
    p = _zip(tmp_path / "bad.tdz", {"meta.json": _meta(meta), "s/x.memmap": b""})
    want = _general(meta, "", {"meta.json", "s/x.memmap"})
    assert isinstance(want, BadArchiveError)
    with pytest.raises(BadArchiveError) as info:
        tdz_numba.open(p)
    assert str(info.value) == str(want).replace("w:", f"{p}: meta.json:", 1)


def test_bad_sub_level_raises_when_reached(tmp_path):
    p = _zip(
        tmp_path / "sub.tdz",
        {
            "meta.json": _meta({"s": {"type": "TensorDict"}, "t": {"type": "TensorDict"}, **FIELDS}),
            "s/meta.json": _meta({"y": {**LEAF, "shape": [-2]}}),
            "t/meta.json": _sub_meta(),
        },
    )
    with tdz_numba.open(p) as ar:
        assert list(ar) == ["s", "t"] and list(ar["t"]) == ["y"]
        with pytest.raises(BadArchiveError, match=r"s/meta.json: leaf 'y': bad shape \[-2\]"):
            ar["s"]
    with pytest.raises(BadArchiveError, match="bad shape"):
        tdz_numba.open(p, subpath="s")


def test_unknown_dtype_fails_on_access(tmp_path):
    meta = {"a": {**LEAF, "dtype": "torch.nonsense"}, "b": {**LEAF, "shape": [1]}, **FIELDS}
    p = _zip(tmp_path / "dt.tdz", {"meta.json": _meta(meta), "a.memmap": bytes(12), "b.memmap": bytes(4)})
    with tdz_numba.open(p) as ar:  # the general path: open succeeds, as before
        assert list(ar) == ["a", "b"] and ar["b"].tolist() == [0.0]
        with pytest.raises(BadArchiveError, match="nonsense"):
            ar["a"]


def test_non_tensor_and_stacked_levels(tmp_path):
    meta = {"_type": STACK, "stack_dim": 0}
    p = _zip(
        tmp_path / "st.tdz",
        {
            "meta.json": _meta(meta),
            "0/meta.json": _sub_meta(),
            "1/meta.json": _sub_meta(),
            "1/other.pickle": b"x",
        },
    )
    with tdz_numba.open(p) as ar:
        assert ar.source._levels[""].keyed is False and list(ar) == ["0", "1"]
        assert list(ar["1"]) == ["y"] and ar.level_info("0").children["y"].leaf.shape == (1,)


def test_open_checks_and_load_keeps_the_plain_level(tmp_path):
    """An open checks the root level (is_plain_td) and makes its PlainLevel only when a whole read
    asks (quick_level); a load makes it in the check's walk: the same PlainLevel either way."""
    import tdz_numba.archive.opening as opening
    from tdz_numba.archive.options import DEFAULT

    tree = {
        "w": torch.arange(6.0).reshape(2, 3),
        "b": torch.ones(4, dtype=torch.int8),
        "g": {"y": torch.ones(2)},
    }
    p = tdz_numba.save(tree, tmp_path / "a.tdz")
    with tdz_numba.open(p) as ar:
        src = ar.source
        assert not src.keep_plain and src._checked_plain[""] == (src._checked[""],)
        tree = ar.to_dict()
        lazy = src._checked_plain[""]
    ar = opening.open_archive(p, DEFAULT, whole=True)
    try:
        kept = ar.source._checked_plain[""]
        assert ar.source.keep_plain and type(kept).__name__ == "PlainLevel"
    finally:
        ar.close()
    for attr in ("fields", "items", "names", "nbytes", "itemsize", "subs"):
        assert getattr(lazy, attr) == getattr(kept, attr), attr
    assert tree["w"].tolist() == [[0.0, 1.0, 2.0], [3.0, 4.0, 5.0]] and tree["g"]["y"].tolist() == [1.0, 1.0]
    loaded = tdz_numba.load(p)
    assert loaded["b"].tolist() == [1, 1, 1, 1] and loaded["w"].equal(tree["w"])
    nested = tdz_numba.save(
        {"n": torch.nested.nested_tensor([torch.ones(2), torch.ones(3)])}, tmp_path / "n.tdz"
    )
    with tdz_numba.open(nested) as ar:  # a plain level that plain_level refuses: the general path
        assert ar.source.quick_level("") is None and ar.source._checked_plain[""] is None
        assert [t.tolist() for t in ar["n"].unbind()] == [[1.0, 1.0], [1.0, 1.0, 1.0]]


_SHAPES = [[2, 3], [0, 5], [5, 0], [0, 2**62], [2**62, 0], [2**31, 2**31], [2**30, 2**30]]
_SHAPES += [[-1, 2], [2, -1], [2, 1.0], [True, 2], [2, None], [2**61, 2], [2**60, 1]]


@pytest.mark.parametrize("shape", _SHAPES)
@pytest.mark.parametrize("dtype", ["torch.int8", "torch.float32", "torch.float64"])
def test_two_dim_shapes_as_shape_nbytes(shape, dtype):
    """is_plain_td's and plain_td_level's inlined two-dimension check: shape_nbytes' answer."""
    from tdz_numba.tdz.bounds import shape_nbytes

    itemsize = {"torch.int8": 1, "torch.float32": 4, "torch.float64": 8}[dtype]
    meta = {"x": {"dtype": dtype, "shape": shape}}
    want = shape_nbytes(shape, itemsize) >= 0
    assert is_plain_td(meta, "", None) is want
    ok, lvl = plain_td_level(meta, "", None)
    assert ok is want and (lvl is None or lvl.nbytes == [shape_nbytes(shape, itemsize)])
