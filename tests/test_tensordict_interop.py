"""Interoperability with tensordict 0.15.3's ``.tdz`` archives and memmap directories.

For every layout tensordict writes (plain / nested TensorDicts, robust keys,
empty leaves, lazy stacks, tensorclasses, non-tensor data and stacks, nested
tensors, a dtype zoo):

* their archive -> ``tdz_numba.load`` / ``tdz_numba.open``;
* ``tdz_numba.save`` -> ``TensorDict.load_memmap``;
* byte identity of ``tdz_numba.save`` and ``td.save`` (modulo DOS timestamps);
* ``unzip`` / ``zip -0 -r`` / stdlib ``zipfile`` (deflate, bzip2, lzma) interop;
* plain dicts -> tensordict;
* ``pack`` / ``unpack`` against memmap directories.
"""

from __future__ import annotations

import io
import math
import os
import shutil
import struct
import subprocess
import warnings
import zipfile
from pathlib import Path

import numpy as np
import pytest
import torch

tensordict = pytest.importorskip("tensordict")

from tensordict import (  # noqa: E402
    LazyStackedTensorDict,
    NonTensorData,
    NonTensorStack,
    TensorDict,
    TensorDictBase,
    pack_memmap,
    tensorclass,
)
from tensordict.tensorclass import is_tensorclass  # noqa: E402
from ziputil import parse_zip, zero_timestamps  # noqa: E402

import tdz_numba  # noqa: E402
from tdz_numba import Level, PickledData  # noqa: E402

pytestmark = [
    pytest.mark.filterwarnings("ignore::FutureWarning"),
    pytest.mark.filterwarnings("ignore::UserWarning"),
]

HAVE_ZIP = shutil.which("zip") is not None
HAVE_UNZIP = shutil.which("unzip") is not None
needs_zip = pytest.mark.skipif(not HAVE_ZIP, reason="Info-ZIP zip not installed")
needs_unzip = pytest.mark.skipif(not HAVE_UNZIP, reason="Info-ZIP unzip not installed")


# ---------------------------------------------------------------------------
# module-level classes (tensordict re-imports them by name on load)
# ---------------------------------------------------------------------------
@tensorclass
class MyTC:
    x: torch.Tensor
    s: str


@tensorclass
class TCMixed:
    x: torch.Tensor
    n: int
    tag: str
    opt: object = None


UNPICKLED: list = []


def _record_unpickle(x):
    UNPICKLED.append(x)
    return ("unpickled", x)


class Tripwire:
    """Records every unpickling of itself in UNPICKLED."""

    def __init__(self, x):
        self.x = x

    def __reduce__(self):
        return (_record_unpickle, (self.x,))


# ---------------------------------------------------------------------------
# layouts
# ---------------------------------------------------------------------------
ZOO_DTYPES = [
    torch.bool,
    torch.uint8,
    torch.int8,
    torch.int16,
    torch.int32,
    torch.int64,
    torch.uint16,
    torch.uint32,
    torch.uint64,
    torch.float16,
    torch.bfloat16,
    torch.float32,
    torch.float64,
    torch.complex64,
    torch.complex128,
]


def _sample(dtype: torch.dtype, shape: tuple[int, ...], seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    n = math.prod(shape)
    if dtype == torch.bool:
        return (torch.rand(n, generator=g) > 0.5).reshape(shape)
    if dtype.is_complex:
        real = torch.randn(n, generator=g, dtype=torch.float64)
        imag = torch.randn(n, generator=g, dtype=torch.float64)
        return torch.complex(real, imag).to(dtype).reshape(shape)
    if dtype.is_floating_point:
        t = torch.randn(n, generator=g, dtype=torch.float64).to(dtype)
        if n >= 4:  # special values, compared bitwise
            t[0], t[1], t[2], t[3] = float("nan"), float("inf"), float("-inf"), -0.0
        return t.reshape(shape)
    info = torch.iinfo(dtype)
    hi = min(info.max, 2**31 - 1)
    lo = max(info.min, -(2**31))
    return torch.randint(lo, hi, (n,), generator=g, dtype=torch.int64).to(dtype).reshape(shape)


def make_plain():
    return TensorDict(
        a=torch.arange(24, dtype=torch.float32).reshape(4, 3, 2),
        b=torch.arange(12, dtype=torch.int32).reshape(4, 3) - 5,
        mask=torch.arange(12).reshape(4, 3) % 3 == 0,
        batch_size=[4, 3],
        names=["time", "env"],
    )


def make_partial_names():
    return TensorDict(a=torch.ones(2, 3), batch_size=[2, 3], names=["t", None])


def make_nested():
    return TensorDict(
        obs=TensorDict(
            pixels=torch.arange(2 * 3 * 4 * 4, dtype=torch.uint8).reshape(2, 3, 4, 4),
            deeper=TensorDict(depth=torch.randn(2, 3, 5, dtype=torch.float64), batch_size=[2, 3]),
            batch_size=[2, 3],
        ),
        reward=torch.randn(2),
        empty_sub=TensorDict(batch_size=[2]),
        batch_size=[2],
        names=["t"],
    )


def make_robust_keys():
    return TensorDict(
        {
            "odd/key name%": torch.arange(3.0),
            "": torch.tensor([7], dtype=torch.int16),
            ".": torch.ones(2, dtype=torch.float64),
            "..": torch.zeros(1),
            "é": torch.tensor([1, 2], dtype=torch.int8),
            "%41": torch.ones(1),
            'q?*<>|"\\:': torch.ones(1),
            "tab\there": torch.zeros(2),
            "sub dir/x": TensorDict({"a b": torch.ones(2), "ü/ß": NonTensorData("v")}),
        },
        batch_size=[],
    )


def make_empty_leaves():
    return TensorDict(
        a=torch.zeros(0, 3),
        b=torch.zeros(2, 0, dtype=torch.int64),
        c=torch.zeros(0, dtype=torch.bfloat16),
        full=torch.ones(2, 2),
        sub=TensorDict(e=torch.zeros(0, dtype=torch.complex64), batch_size=[]),
        batch_size=[],
    )


def make_lazy0():
    return LazyStackedTensorDict.lazy_stack(
        [TensorDict(a=torch.zeros(3), b=torch.ones(3, 2)), TensorDict(a=torch.ones(3), b=torch.zeros(3, 2))],
        0,
    )


def make_lazy1():
    # heterogeneous shapes: only a lazy stack can hold them
    return LazyStackedTensorDict.lazy_stack(
        [
            TensorDict(a=torch.zeros(2, 3), batch_size=[2]),
            TensorDict(a=torch.ones(2, 4), batch_size=[2]),
            TensorDict(a=torch.full((2, 5), 2.0), batch_size=[2]),
        ],
        1,
    )


def make_lazy_named():
    return LazyStackedTensorDict.lazy_stack(
        [
            TensorDict(a=torch.zeros(3, 2), batch_size=[3], names=["x"]),
            TensorDict(a=torch.ones(3, 2), batch_size=[3], names=["x"]),
        ],
        1,
        stack_dim_name="s",
    )


def make_lazy_in_td():
    lazy = LazyStackedTensorDict.lazy_stack(
        [
            TensorDict(a=torch.zeros(3), s=NonTensorData("p")),
            TensorDict(a=torch.ones(3), s=NonTensorData("q")),
        ],
        0,
    )
    return TensorDict(z=lazy, w=torch.arange(2), batch_size=[2])


def make_device_and_batched_ntd():
    return TensorDict(
        a=torch.ones(3, 2),
        s=NonTensorData("x", batch_size=[3]),
        device="cpu",
        batch_size=[3],
    )


def make_tensorclass():
    return MyTC(x=torch.arange(6.0).reshape(2, 3), s="hello", batch_size=[2])


def make_tensorclass_mixed():
    return TCMixed(x=torch.ones(3, dtype=torch.int16), n=7, tag="t", opt=None, batch_size=[3])


def make_tensorclass_in_td():
    return TensorDict(
        tc=MyTC(x=torch.ones(2, 2), s="inner", batch_size=[2]), y=torch.zeros(2), batch_size=[2]
    )


def make_non_tensor_data():
    return TensorDict(
        a=torch.ones(2),
        s=NonTensorData("hi"),
        i=NonTensorData(10**20),
        f=NonTensorData(1.5),
        n=NonTensorData(None),
        b=NonTensorData(True),
        l=NonTensorData([1, "a", None, 2.5]),
        nan=NonTensorData(float("nan")),
        batch_size=[],
    )


def make_non_tensor_stack():
    return TensorDict(
        a=torch.ones(3),
        s=NonTensorStack("a", "b", "c"),
        j=NonTensorStack(1, [2, 3], None),
        batch_size=[3],
    )


def make_non_tensor_stack_2d():
    return TensorDict(s=NonTensorStack(NonTensorStack("a", "b"), NonTensorStack("c", "d")), batch_size=[2, 2])


def make_nested_tensors():
    return TensorDict(
        n=torch.nested.nested_tensor(
            [torch.ones(2, 3), torch.arange(12.0).reshape(4, 3)], layout=torch.strided
        ),
        i=torch.nested.nested_tensor([torch.arange(3), torch.arange(5)], layout=torch.strided),
        e=torch.nested.nested_tensor([torch.ones(0, 2), torch.zeros(3, 2)], layout=torch.strided),
        d3=torch.nested.nested_tensor([torch.ones(2, 3, 4), torch.zeros(1, 2, 3)], layout=torch.strided),
        dense=torch.ones(2),
        batch_size=[2],
    )


def make_dtype_zoo():
    leaves = {}
    for i, dt in enumerate(ZOO_DTYPES):
        name = str(dt).replace("torch.", "")
        leaves[name] = _sample(dt, (3, 5), seed=i)  # odd byte sizes: padding matters
        leaves[name + "_scalar"] = _sample(dt, (), seed=100 + i)
    return TensorDict(leaves, batch_size=[])


def make_views():
    base = torch.arange(24, dtype=torch.float32).reshape(4, 6)
    z = torch.complex(torch.ones(3), torch.arange(3.0))
    return TensorDict(
        t=base.T,  # non-contiguous
        sl=base[1:3, 2:],  # storage offset
        ex=torch.ones(1, 3).expand(4, 3),  # stride 0
        conj=z.conj(),  # lazy conjugate
        neg=torch._neg_view(torch.arange(3.0)),  # lazy negation
        grad=torch.ones(2, requires_grad=True) * 2,
        batch_size=[],
    )


def make_large():
    # crosses the writer's 1 MiB CRC chunk: the chunk CRCs must fold correctly
    return TensorDict(
        big=torch.arange(3 * (1 << 20) // 8 + 13, dtype=torch.float64), small=torch.ones(3), batch_size=[]
    )


def make_many_keys():
    return TensorDict(
        {f"k{i:03d}": torch.full((i % 7 + 1,), i, dtype=torch.int32) for i in range(150)}, batch_size=[]
    )


def make_empty_td():
    return TensorDict()


LAYOUTS = {
    "plain": make_plain,
    "partial_names": make_partial_names,
    "nested": make_nested,
    "robust_keys": make_robust_keys,
    "empty_leaves": make_empty_leaves,
    "lazy_stack_dim0": make_lazy0,
    "lazy_stack_dim1": make_lazy1,
    "lazy_named": make_lazy_named,
    "lazy_in_td": make_lazy_in_td,
    "device_batched_ntd": make_device_and_batched_ntd,
    "tensorclass": make_tensorclass,
    "tensorclass_mixed": make_tensorclass_mixed,
    "tensorclass_in_td": make_tensorclass_in_td,
    "non_tensor_data": make_non_tensor_data,
    "non_tensor_stack": make_non_tensor_stack,
    "non_tensor_stack_2d": make_non_tensor_stack_2d,
    "nested_tensors": make_nested_tensors,
    "dtype_zoo": make_dtype_zoo,
    "views": make_views,
    "large": make_large,
    "many_keys": make_many_keys,
    "empty_td": make_empty_td,
}
# layouts without non-ASCII keys (Info-ZIP stores names without the UTF-8 flag)
ASCII_LAYOUTS = [k for k in LAYOUTS if k != "robust_keys"]
# small, diverse subset for the slower matrix tests
CORE_LAYOUTS = [
    "plain",
    "nested",
    "robust_keys",
    "empty_leaves",
    "lazy_stack_dim1",
    "tensorclass",
    "non_tensor_data",
    "non_tensor_stack",
    "nested_tensors",
    "dtype_zoo",
]


# layouts whose tensordicts support ``(a == b).all()`` (no NaN, nested or non-tensor leaves)
EQ_LAYOUTS = [
    "plain",
    "partial_names",
    "nested",
    "empty_leaves",
    "lazy_stack_dim0",
    "views",
    "large",
    "many_keys",
    "empty_td",
]


def make_pickled():
    """tensordict writes pickle.pkl / other.pickle for these."""
    return TensorDict(
        st=NonTensorStack(Tripwire(1), Tripwire(2)),
        d=NonTensorData({1, 2}),
        a=torch.arange(2),
        batch_size=[2],
    )


# ---------------------------------------------------------------------------
# comparison helpers
# ---------------------------------------------------------------------------
def _bytes_of(t: torch.Tensor) -> torch.Tensor:
    t = t.detach().resolve_conj().resolve_neg().contiguous().reshape(-1)
    return t.view(torch.uint8) if t.dtype != torch.uint8 else t


def assert_tensor_same(got, exp, where=""):
    assert isinstance(got, torch.Tensor), f"{where}: expected a tensor, got {type(got).__name__}"
    exp = exp.detach()
    if exp.is_nested:
        assert got.is_nested, f"{where}: expected a nested tensor"
        assert got.dtype == exp.dtype, where
        g, e = got.unbind(0), exp.unbind(0)
        assert len(g) == len(e), where
        for i, (x, y) in enumerate(zip(g, e)):
            assert x.shape == y.shape, f"{where}[{i}]: {x.shape} != {y.shape}"
            assert torch.equal(_bytes_of(x), _bytes_of(y)), f"{where}[{i}] differs"
        return
    assert not got.is_nested, where
    assert got.dtype == exp.dtype, f"{where}: {got.dtype} != {exp.dtype}"
    assert got.shape == exp.shape, f"{where}: {got.shape} != {exp.shape}"
    # bitwise: NaN payloads, -0.0 and bfloat16 all compared exactly
    assert torch.equal(_bytes_of(got), _bytes_of(exp)), f"{where}: values differ"


def _values_equal(a, b) -> bool:
    if isinstance(a, float) and isinstance(b, float) and math.isnan(a) and math.isnan(b):
        return True
    if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)):
        return len(a) == len(b) and all(_values_equal(x, y) for x, y in zip(a, b))
    return type(a) is type(b) and a == b


def _expected_names(td) -> list | None:
    return list(td.names) if td._has_names() else None


def assert_level_matches(got, exp, where="<root>"):
    """A value loaded by tdz_numba matches the tensordict object it was saved from."""
    if isinstance(exp, torch.Tensor):
        assert_tensor_same(got, exp, where)
        return
    if isinstance(exp, NonTensorStack):
        assert isinstance(got, Level), f"{where}: {type(got).__name__}"
        assert got.type_name == "NonTensorStack", where
        assert got.data == exp.tolist(), where
        assert got.meta["stack_dim"] == exp.stack_dim, where
        return
    if isinstance(exp, NonTensorData):
        assert _values_equal(got, exp.data), f"{where}: {got!r} != {exp.data!r}"
        return
    if isinstance(exp, LazyStackedTensorDict):
        assert isinstance(got, Level), f"{where}: {type(got).__name__}"
        assert got.type_name == "LazyStackedTensorDict", where
        assert got.meta["stack_dim"] == exp.stack_dim, where
        assert list(got) == [str(i) for i in range(len(exp.tensordicts))], where
        for i, member in enumerate(exp.tensordicts):
            assert_level_matches(got[str(i)], member, f"{where}/{i}")
        return
    if is_tensorclass(exp) and not isinstance(exp, TensorDictBase):
        assert isinstance(got, Level), f"{where}: {type(got).__name__}"
        assert got.type_name == type(exp).__name__, where
        assert "_tensordict" in got, where
        assert_level_matches(got["_tensordict"], exp._tensordict, f"{where}/_tensordict")
        return
    assert isinstance(exp, TensorDictBase), type(exp)
    assert isinstance(got, Level), f"{where}: {type(got).__name__}"
    assert got.type_name == "TensorDict", where
    assert got.batch_size == list(exp.batch_size), f"{where}: {got.batch_size} != {list(exp.batch_size)}"
    assert got.names == _expected_names(exp), f"{where}: {got.names} != {_expected_names(exp)}"
    assert list(got) == list(exp.keys()), f"{where}: keys {list(got)} != {list(exp.keys())}"
    for key, value in exp.items():
        assert_level_matches(got[key], value, f"{where}/{key}")


def assert_td_same(got, exp, where="<root>"):
    """Two tensordict objects hold the same class, batch size, names and values."""
    if isinstance(exp, torch.Tensor):
        assert_tensor_same(got, exp, where)
        return
    assert type(got) is type(exp), f"{where}: {type(got).__name__} != {type(exp).__name__}"
    if isinstance(exp, NonTensorStack):
        assert got.batch_size == exp.batch_size, where
        assert got.stack_dim == exp.stack_dim, where
        assert got.tolist() == exp.tolist(), where
        return
    if isinstance(exp, NonTensorData):
        assert _values_equal(got.data, exp.data), f"{where}: {got.data!r} != {exp.data!r}"
        return
    assert got.batch_size == exp.batch_size, f"{where}: {got.batch_size} != {exp.batch_size}"
    if isinstance(exp, LazyStackedTensorDict):
        assert got.stack_dim == exp.stack_dim, where
        assert len(got.tensordicts) == len(exp.tensordicts), where
        for i, (g, e) in enumerate(zip(got.tensordicts, exp.tensordicts)):
            assert_td_same(g, e, f"{where}/{i}")
        return
    if is_tensorclass(exp) and not isinstance(exp, TensorDictBase):
        assert_td_same(got._tensordict, exp._tensordict, f"{where}/_tensordict")
        for key, value in exp._non_tensordict.items():
            assert _values_equal(got._non_tensordict.get(key), value), f"{where}.{key}"
        return
    if exp._has_names():
        assert list(got.names) == list(exp.names), f"{where}: {got.names} != {exp.names}"
    else:
        assert not got._has_names(), where
    assert set(got.keys()) == set(exp.keys()), f"{where}: {sorted(got.keys())} != {sorted(exp.keys())}"
    for key, value in exp.items():
        assert_td_same(got.get(key), value, f"{where}/{key}")


# ---------------------------------------------------------------------------
# zip helpers
# ---------------------------------------------------------------------------
def assert_same_bytes(p1: Path, p2: Path):
    a, b = Path(p1).read_bytes(), Path(p2).read_bytes()
    za, zb = zero_timestamps(a), zero_timestamps(b)
    if za != zb:
        with zipfile.ZipFile(p1) as z1, zipfile.ZipFile(p2) as z2:
            n1, n2 = z1.namelist(), z2.namelist()
            detail = [f"entries: {n1} vs {n2}"] if n1 != n2 else []
            for n in n1:
                if n in n2 and n.endswith(".json") and z1.read(n) != z2.read(n):
                    detail.append(f"{n}: {z1.read(n)!r} vs {z2.read(n)!r}")
        first = next((i for i, (x, y) in enumerate(zip(za, zb)) if x != y), min(len(za), len(zb)))
        raise AssertionError(
            f"{p1.name} ({len(a)} bytes) and {p2.name} ({len(b)} bytes) differ beyond timestamps, "
            f"first at byte {first}; " + "; ".join(detail)
        )


def dir_snapshot(d: Path) -> dict[str, bytes]:
    return {p.relative_to(d).as_posix(): p.read_bytes() for p in sorted(Path(d).rglob("*")) if p.is_file()}


def zip_directory_stdlib(
    src: Path, dst: Path, compression: int, *, stream: bool = False, with_dirs: bool = False
) -> Path:
    """Zips a memmap directory with the stdlib (optionally to a non-seekable
    stream, which makes zipfile write data descriptors)."""

    class NoSeek(io.RawIOBase):
        def __init__(self, f):
            self.f = f

        def writable(self):
            return True

        def seekable(self):
            return False

        def write(self, data):
            return self.f.write(data)

    with open(dst, "wb") as f:
        target = NoSeek(f) if stream else f
        with zipfile.ZipFile(target, "w", compression=compression) as z:
            for root, dirs, files in os.walk(src):
                dirs.sort()
                rel_root = Path(root).relative_to(src)
                if with_dirs and str(rel_root) != ".":
                    z.write(root, rel_root.as_posix() + "/")
                for name in sorted(files):
                    full = Path(root) / name
                    z.write(full, full.relative_to(src).as_posix())
    return dst


def their_archive(td, tmp_path: Path, name: str = "theirs.tdz") -> Path:
    p = tmp_path / name
    td.save(p)
    assert p.is_file()
    return p


def test_byte_comparison_helper_is_not_vacuous(tmp_path):
    a = tdz_numba.save({"x": torch.zeros(3)}, tmp_path / "a.tdz")
    b = tdz_numba.save({"x": torch.ones(3)}, tmp_path / "b.tdz")
    with pytest.raises(AssertionError):
        assert_same_bytes(a, b)
    # rewrite every timestamp of a copy: the helper must see no difference
    raw = bytearray(a.read_bytes())
    for r in parse_zip(raw).records:
        raw[r.hoff + 10 : r.hoff + 14] = b"\x12\x34\x56\x78"
        raw[r.cpos + 12 : r.cpos + 16] = b"\x9a\xbc\xde\xf0"
    c = tmp_path / "c.tdz"
    c.write_bytes(bytes(raw))
    assert raw != a.read_bytes()
    assert_same_bytes(a, c)


# ---------------------------------------------------------------------------
# 1. their archive -> ours
# ---------------------------------------------------------------------------
@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_their_archive_loads_in_ours(layout, tmp_path):
    td = LAYOUTS[layout]()
    p = their_archive(td, tmp_path)
    assert tdz_numba.is_archive(p)
    assert_level_matches(tdz_numba.load(p), td)
    report = tdz_numba.verify(p)
    assert report.entries == len(zipfile.ZipFile(p).namelist())


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_their_archive_open_lazily(layout, tmp_path):
    td = LAYOUTS[layout]()
    p = their_archive(td, tmp_path)
    with tdz_numba.open(p) as ar:
        tree = ar.to_dict()
        assert_level_matches(tree, td)
        # every dense leaf: reachable by tuple path (and "a/b" when unambiguous),
        # 64-byte aligned and a zero-copy view of the mapping
        stack = [((), tree)]
        n_leaves = 0
        while stack:
            path, node = stack.pop()
            for key, value in node.items():
                sub = (*path, key)
                if isinstance(value, Level):
                    stack.append((sub, value))
                elif isinstance(value, torch.Tensor):
                    n_leaves += 1
                    assert_tensor_same(ar[sub], value, "/".join(sub))
                    if all("/" not in k for k in sub) and all(sub):
                        assert_tensor_same(ar["/".join(sub)], value, "/".join(sub))
                    info = ar.info(sub)
                    assert info.dtype == value.dtype
                    if value.is_nested or value.numel() == 0:
                        continue
                    assert info.compression == "stored"
                    assert info.offset % 64 == 0, (sub, info.offset)
                    assert info.zero_copy
                    assert info.nbytes == value.numel() * value.element_size()
                    if value.dtype not in (torch.bfloat16,):
                        arr = ar.numpy(sub)
                        assert arr.shape == tuple(value.shape)
                        assert arr.tobytes() == _bytes_of(value).numpy().tobytes()
        if layout not in ("empty_td", "non_tensor_stack_2d"):
            assert n_leaves > 0


def test_their_archive_metadata_visible(tmp_path):
    # plain: batch size and names
    lvl = tdz_numba.load(their_archive(make_plain(), tmp_path, "a.tdz"))
    assert lvl.type_name == "TensorDict"
    assert lvl.batch_size == [4, 3]
    assert lvl.names == ["time", "env"]
    assert lvl.meta["device"] == "cpu"
    # partial names
    lvl = tdz_numba.load(their_archive(make_partial_names(), tmp_path, "b.tdz"))
    assert lvl.names == ["t", None]
    # lazy stacks
    for i, (make, dim) in enumerate([(make_lazy0, 0), (make_lazy1, 1)]):
        lvl = tdz_numba.load(their_archive(make(), tmp_path, f"l{i}.tdz"))
        assert lvl.type_name == "LazyStackedTensorDict"
        assert lvl.meta["stack_dim"] == dim
        assert sorted(lvl) == [str(j) for j in range(len(lvl))]
        assert lvl["0"].type_name == "TensorDict"
    lvl = tdz_numba.load(their_archive(make_lazy_named(), tmp_path, "ln.tdz"))
    assert lvl.meta["stack_dim"] == 1 and lvl.meta["stack_dim_name"] == "s"
    assert lvl["0"].names == ["x"] and lvl["0"].batch_size == [3]
    with tdz_numba.open(tmp_path / "ln.tdz") as ar:
        assert ar.type_name == "LazyStackedTensorDict"
        assert ar.meta["stack_dim"] == 1 and ar.batch_size is None
        assert ar["1"].batch_size == [3]
        assert torch.equal(ar["1", "a"], torch.ones(3, 2))
    lvl = tdz_numba.load(their_archive(make_lazy1(), tmp_path, "l1b.tdz"))
    assert [lvl[k]["a"].shape for k in ("0", "1", "2")] == [(2, 3), (2, 4), (2, 5)]
    assert lvl["0"].batch_size == [2]
    # tensorclass
    lvl = tdz_numba.load(their_archive(make_tensorclass(), tmp_path, "tc.tdz"))
    assert lvl.type_name == "MyTC"
    assert lvl["_tensordict"]["s"] == "hello"
    assert lvl["_tensordict"].batch_size == [2]
    assert torch.equal(lvl["_tensordict"]["x"], torch.arange(6.0).reshape(2, 3))
    # non-tensor data and stacks
    lvl = tdz_numba.load(their_archive(make_non_tensor_stack(), tmp_path, "nts.tdz"))
    assert lvl["s"].type_name == "NonTensorStack"
    assert lvl["s"].data == ["a", "b", "c"]
    assert lvl["s"].meta["stack_dim"] == 0
    assert lvl["j"].data == [1, [2, 3], None]
    lvl = tdz_numba.load(their_archive(make_non_tensor_data(), tmp_path, "ntd.tdz"))
    assert lvl["s"] == "hi" and lvl["i"] == 10**20 and lvl["n"] is None and lvl["b"] is True
    assert lvl["l"] == [1, "a", None, 2.5] and math.isnan(lvl["nan"])
    # nested tensors come back as torch nested tensors
    lvl = tdz_numba.load(their_archive(make_nested_tensors(), tmp_path, "nt.tdz"))
    assert lvl["n"].is_nested and lvl["n"].layout == torch.strided
    assert [x.shape for x in lvl["n"].unbind()] == [(2, 3), (4, 3)]


def test_their_archive_subpath(tmp_path):
    td = make_nested()
    p = their_archive(td, tmp_path)
    sub = tdz_numba.load(p, subpath="obs/deeper")
    assert sub.batch_size == [2, 3]
    assert_tensor_same(sub["depth"], td["obs", "deeper", "depth"], "depth")
    with tdz_numba.open(p, subpath=("obs",)) as ar:
        assert sorted(ar) == ["deeper", "pixels"]
        assert ar.batch_size == [2, 3]
        assert_tensor_same(ar["pixels"], td["obs", "pixels"], "pixels")
    # robust-key encoded subpath
    p = their_archive(make_robust_keys(), tmp_path, "r.tdz")
    with tdz_numba.open(p, subpath=("sub dir/x",)) as ar:
        assert ar["ü/ß"] == "v"
        assert torch.equal(ar["a b"], torch.ones(2))
    # lazy-stack member
    p = their_archive(make_lazy1(), tmp_path, "l.tdz")
    assert torch.equal(tdz_numba.load(p, subpath="2")["a"], torch.full((2, 5), 2.0))


def test_their_pickled_data_not_unpickled_by_default(tmp_path):
    td = make_pickled()
    p = their_archive(td, tmp_path)
    names = zipfile.ZipFile(p).namelist()
    assert "st/pickle.pkl" in names and "d/other.pickle" in names
    UNPICKLED.clear()
    lvl = tdz_numba.load(p)
    assert UNPICKLED == []
    assert torch.equal(lvl["a"], torch.arange(2))
    assert lvl["st"].type_name == "NonTensorStack"
    assert isinstance(lvl["st"]["pickle.pkl"], PickledData)
    assert isinstance(lvl["d"], Level) and isinstance(lvl["d"]["other.pickle"], PickledData)
    with tdz_numba.open(p) as ar:
        pk = ar["st", "pickle.pkl"]
        assert isinstance(pk, PickledData)
        with pytest.raises(tdz_numba.UnsafeContentError):
            pk.load()
        assert isinstance(ar["d/other.pickle"], PickledData)
    assert UNPICKLED == []
    # verify checks CRCs without unpickling
    tdz_numba.verify(p)
    assert UNPICKLED == []


def test_their_pickled_stack_with_allow_pickle(tmp_path):
    p = their_archive(make_pickled(), tmp_path)
    UNPICKLED.clear()
    lvl = tdz_numba.load(p, allow_pickle=True)
    assert sorted(UNPICKLED) == [1, 2]
    assert list(lvl["st"]["pickle.pkl"]) == [("unpickled", 1), ("unpickled", 2)]


def test_their_pickled_non_tensor_data_with_allow_pickle(tmp_path):
    # A NonTensorData holding a JSON value loads as that value; one holding a
    # pickled value should load as that value too when allow_pickle=True
    # (tensordict's other.pickle holds the dict {"data": value}).
    p = their_archive(TensorDict(d=NonTensorData({1, 2}), batch_size=[]), tmp_path)
    lvl = tdz_numba.load(p, allow_pickle=True)
    assert lvl["d"] == {1, 2}
    with tdz_numba.open(p, allow_pickle=True) as ar:
        assert ar["d"] == {1, 2}


# ---------------------------------------------------------------------------
# 2. ours -> theirs
# ---------------------------------------------------------------------------
@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_our_archive_loads_in_tensordict(layout, tmp_path):
    td = LAYOUTS[layout]()
    p = tdz_numba.save(td, tmp_path / "ours.tdz")
    assert p == (tmp_path / "ours.tdz").resolve()
    back = TensorDict.load_memmap(p, allow_pickle=False)
    assert_td_same(back, td)
    if layout in EQ_LAYOUTS:
        assert (back == td).all()
    assert zipfile.ZipFile(p).testzip() is None


def test_our_archive_tensordict_classes_and_fields(tmp_path):
    back = TensorDict.load_memmap(tdz_numba.save(make_tensorclass(), tmp_path / "tc.tdz"))
    assert type(back) is MyTC
    assert back.s == "hello" and torch.equal(back.x, torch.arange(6.0).reshape(2, 3))
    assert back.batch_size == torch.Size([2])
    back = TensorDict.load_memmap(tdz_numba.save(make_tensorclass_mixed(), tmp_path / "tcm.tdz"))
    assert type(back) is TCMixed and back.n == 7 and back.tag == "t" and back.opt is None
    back = TensorDict.load_memmap(tdz_numba.save(make_lazy1(), tmp_path / "l.tdz"))
    assert isinstance(back, LazyStackedTensorDict) and back.stack_dim == 1
    assert back.batch_size == torch.Size([2, 3])
    back = TensorDict.load_memmap(tdz_numba.save(make_plain(), tmp_path / "p.tdz"))
    assert back.names == ["time", "env"] and back.batch_size == torch.Size([4, 3])
    back = TensorDict.load_memmap(tdz_numba.save(make_non_tensor_stack(), tmp_path / "s.tdz"))
    assert back["s"] == ["a", "b", "c"]
    assert isinstance(back.get("s"), NonTensorStack)
    back = TensorDict.load_memmap(tdz_numba.save(make_nested_tensors(), tmp_path / "n.tdz"))
    assert back["n"].is_nested


def test_our_archive_mode_r_plus_in_tensordict(tmp_path):
    td = make_plain()
    p = tdz_numba.save(td, tmp_path / "ours.tdz")
    back = TensorDict.load_memmap(p, mode="r+")
    back["a"][0] = 100.0
    del back
    again = tdz_numba.load(p)
    assert (again["a"][0] == 100.0).all()
    assert torch.equal(again["a"][1:], td["a"][1:])


@pytest.mark.parametrize("compression", ["deflate", "bzip2", "lzma"])
def test_compressed_archives_both_ways(compression, tmp_path):
    td = TensorDict(
        a=torch.arange(1000.0).reshape(10, 100),
        sub=TensorDict(c=torch.randint(0, 5, (10, 3), dtype=torch.uint8), batch_size=[10]),
        s=NonTensorData("x"),
        n=torch.nested.nested_tensor([torch.ones(2, 3), torch.zeros(4, 3)], layout=torch.strided),
        e=torch.zeros(10, 0),
        z=_sample(torch.bfloat16, (7, 3)),
        batch_size=[],
    )
    ours = tdz_numba.save(td, tmp_path / "ours.tdz", compression=compression)
    theirs = tmp_path / "theirs.tdz"
    td.save(theirs, compression=compression)
    assert_td_same(TensorDict.load_memmap(ours), td)
    assert_level_matches(tdz_numba.load(theirs), td)
    assert_level_matches(tdz_numba.load(ours), td)
    with tdz_numba.open(theirs) as ar:
        assert ar.info("a").compression == compression
        assert not ar.info("a").zero_copy
    assert zipfile.ZipFile(ours).testzip() is None
    tdz_numba.verify(theirs)
    if compression != "deflate":  # stdlib codecs on both sides: same streams
        assert_same_bytes(ours, theirs)


# ---------------------------------------------------------------------------
# 3. byte identity
# ---------------------------------------------------------------------------
@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_byte_identical_to_tensordict(layout, tmp_path):
    td = LAYOUTS[layout]()
    ours = tdz_numba.save(td, tmp_path / "ours.tdz")
    theirs = their_archive(td, tmp_path)
    assert_same_bytes(ours, theirs)


@pytest.mark.parametrize("layout", CORE_LAYOUTS)
def test_byte_identical_when_saving_a_memmapped_tensordict(layout, tmp_path):
    # a tensordict loaded from an archive (leaves are views of the mapping);
    # load_memmap may reorder keys or set devices, so compare with what
    # tensordict itself writes for the loaded object
    td = LAYOUTS[layout]()
    loaded = TensorDict.load_memmap(their_archive(td, tmp_path))
    loaded.save(tmp_path / "theirs2.tdz")
    ours = tdz_numba.save(loaded, tmp_path / "ours.tdz")
    assert_same_bytes(ours, tmp_path / "theirs2.tdz")
    assert_td_same(TensorDict.load_memmap(ours), td)


@pytest.mark.parametrize("layout", list(LAYOUTS) + ["pickled"])
def test_load_then_save_is_lossless(layout, tmp_path):
    td = make_pickled() if layout == "pickled" else LAYOUTS[layout]()
    theirs = their_archive(td, tmp_path)
    tree = tdz_numba.load(theirs)
    ours = tdz_numba.save(tree, tmp_path / "ours.tdz")
    assert_same_bytes(ours, theirs)


@pytest.mark.parametrize(
    "value",
    [{"k": [1, 2]}, [{"a": 1}, {"b": 2}], {"nested": {"x": None}}],
    ids=["dict", "list_of_dicts", "nested_dict"],
)
def test_load_then_save_keeps_json_non_tensor_data(value, tmp_path):
    # NonTensorData holding any JSON value (dicts included) must survive
    # load -> save unchanged: it must not turn into a TensorDict level, nor be
    # refused
    td = TensorDict(v=NonTensorData(value), a=torch.ones(1), batch_size=[])
    theirs = their_archive(td, tmp_path)
    tree = tdz_numba.load(theirs)
    # a dict value comes back as a NonTensorData level (a plain dict would be a
    # sub-level); other JSON values come back as they are
    got = tree["v"].data if isinstance(value, dict) else tree["v"]
    assert got == value
    if isinstance(value, dict):
        assert tree["v"].type_name == "NonTensorData" and len(tree["v"]) == 0
    ours = tdz_numba.save(tree, tmp_path / "ours.tdz")
    assert_same_bytes(ours, theirs)
    assert TensorDict.load_memmap(ours)["v"] == value


def test_save_over_its_own_source(tmp_path):
    td = make_nested()
    p = their_archive(td, tmp_path)
    loaded = TensorDict.load_memmap(p)  # views into the file being replaced
    ref = tmp_path / "ref.tdz"
    loaded.save(ref)
    tdz_numba.save(loaded, p)
    assert zero_timestamps(p.read_bytes()) == zero_timestamps(ref.read_bytes())
    assert_td_same(loaded, td)  # the old mapping is still readable
    tree = tdz_numba.load(p)
    tdz_numba.save(tree, p)
    assert zero_timestamps(p.read_bytes()) == zero_timestamps(ref.read_bytes())
    assert_level_matches(tree["obs"], td["obs"])
    assert_td_same(TensorDict.load_memmap(p), td)


def test_allocate_matches_memmap_like(tmp_path):
    tmpl = TensorDict(
        a=torch.zeros(4, 3),
        sub=TensorDict(c=torch.zeros(4, dtype=torch.int16), batch_size=[4]),
        ex=torch.zeros(1, 5).expand(4, 5),
        batch_size=[4],
        names=["t"],
    )
    with tdz_numba.allocate(tmpl, tmp_path / "ours.tdz") as buf:
        buf["a"][1] = 3.0
        buf["sub", "c"][2] = 9
    theirs = tmp_path / "theirs.tdz"
    tmpl.memmap_like(theirs)
    # tensordict's archive is all zeros; ours was written through: rewrite it
    with tdz_numba.open(tmp_path / "ours.tdz", mode="r+") as buf:
        buf["a"].zero_()
        buf["sub", "c"].zero_()
    tdz_numba.refresh_checksums(tmp_path / "ours.tdz")
    assert_same_bytes(tmp_path / "ours.tdz", theirs)
    back = TensorDict.load_memmap(tmp_path / "ours.tdz")
    assert back.names == ["t"] and back["ex"].shape == (4, 5)


def test_pickles_refused_when_writing(tmp_path):
    target = tmp_path / "x.tdz"
    with pytest.raises(tdz_numba.InvalidTreeError):
        tdz_numba.save(TensorDict(s=NonTensorStack({1}, {2}), batch_size=[2]), target)
    assert not target.exists()
    with pytest.raises(tdz_numba.InvalidTreeError):
        tdz_numba.save(make_pickled(), target)
    with pytest.raises(tdz_numba.InvalidTreeError):
        tdz_numba.save(TensorDict(d=NonTensorData(Tripwire(3))), target)
    with pytest.raises(tdz_numba.InvalidTreeError):
        tdz_numba.save(TCMixed(x=torch.ones(2), n=1, tag="t", opt={1, 2}, batch_size=[2]), target)
    assert not target.exists()
    assert not list(tmp_path.iterdir()), "no temporary file may be left behind"
    # an existing archive is left intact on refusal
    good = tdz_numba.save(make_plain(), target)
    before = good.read_bytes()
    with pytest.raises(tdz_numba.InvalidTreeError):
        tdz_numba.save(make_pickled(), target)
    assert target.read_bytes() == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["x.tdz"]


# ---------------------------------------------------------------------------
# 4. unzip / zip / zipfile
# ---------------------------------------------------------------------------
@needs_unzip
@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_unzip_of_our_archive_loads_in_tensordict(layout, tmp_path):
    td = LAYOUTS[layout]()
    p = tdz_numba.save(td, tmp_path / "ours.tdz")
    subprocess.run(["unzip", "-tq", str(p)], check=True, capture_output=True)
    out = tmp_path / "dir"
    subprocess.run(["unzip", "-q", str(p), "-d", str(out)], check=True, capture_output=True)
    assert_td_same(TensorDict.load_memmap(out), td)


@needs_zip
@pytest.mark.parametrize("variant", ["stored", "deflated", "streamed", "zip64"])
@pytest.mark.parametrize("layout", ASCII_LAYOUTS)
def test_zip_cli_of_memmap_dir_loads_in_ours(layout, variant, tmp_path):
    td = LAYOUTS[layout]()
    d = tmp_path / "mm"
    td.memmap(d)
    z = tmp_path / "x.zip"
    cmd = {
        "stored": f"zip -0 -r -q {z} .",
        "deflated": f"zip -r -q {z} .",
        "streamed": f"zip -0 -r -q - . | cat > {z}",  # non-seekable: data descriptors
        "zip64": f"zip -0 -r -q -fz {z} .",  # zip64 extras on every entry
    }[variant]
    subprocess.run(cmd, shell=True, cwd=d, check=True, capture_output=True)
    assert tdz_numba.is_archive(z)
    if variant == "streamed" and layout != "empty_td":
        assert any(i.flag_bits & 0x8 for i in zipfile.ZipFile(z).infolist())
    tree = tdz_numba.load(z)
    assert_level_matches(tree, td)
    tdz_numba.verify(z)


@needs_zip
def test_zip_cli_unaligned_entries_are_copied(tmp_path):
    # one-byte meta/pad differences: at least some payloads are misaligned
    leaves = {f"k{i}": _sample(torch.float64, (3 + i,), seed=i) for i in range(8)}
    td = TensorDict(leaves, batch_size=[])
    d = tmp_path / "mm"
    td.memmap(d)
    z = tmp_path / "x.zip"
    subprocess.run(f"zip -0 -r -q {z} .", shell=True, cwd=d, check=True, capture_output=True)
    with tdz_numba.open(z) as ar:
        infos = [ar.info(k) for k in leaves]
        assert any(i.offset % 8 for i in infos), "expected an unaligned payload"
        for k, v in leaves.items():
            assert_tensor_same(ar[k], v, k)
    with pytest.raises(tdz_numba.UnsupportedError):
        with tdz_numba.open(z, mode="r+") as ar:
            for k in leaves:
                ar[k]


@needs_zip
def test_zip_cli_non_ascii_key(tmp_path):
    # Info-ZIP's zip stores the UTF-8 names tensordict writes ("é.memmap")
    # without the UTF-8 flag; the reader must still find the leaf that
    # meta.json names (unzip and libarchive read such names as UTF-8).
    td = TensorDict({"é": torch.arange(5, dtype=torch.int16), "a": torch.ones(2)}, batch_size=[])
    d = tmp_path / "mm"
    td.memmap(d)
    z = tmp_path / "x.zip"
    subprocess.run(f"zip -0 -r -q {z} .", shell=True, cwd=d, check=True, capture_output=True)
    tree = tdz_numba.load(z)
    assert_tensor_same(tree["é"], td["é"], "é")


_ZIP_METHODS = {
    "stored": zipfile.ZIP_STORED,
    "deflated": zipfile.ZIP_DEFLATED,
    "bzip2": zipfile.ZIP_BZIP2,
    "lzma": zipfile.ZIP_LZMA,
}
_STDLIB_CASES = [
    pytest.param(layout, method, stream, id=f"{layout}-{method}-{'descriptors' if stream else 'seekable'}")
    for layout in CORE_LAYOUTS + ["lazy_stack_dim0", "tensorclass_in_td", "large"]
    for method in _ZIP_METHODS
    for stream in (False, True)
    # the slow codecs are exercised on the small layouts only
    if layout != "large" or (method in ("stored", "deflated") and not stream)
]


@pytest.mark.parametrize("layout, method, stream", _STDLIB_CASES)
def test_stdlib_zipfile_of_memmap_dir_loads_in_ours(layout, method, stream, tmp_path):
    compression = _ZIP_METHODS[method]
    td = LAYOUTS[layout]()
    d = tmp_path / "mm"
    td.memmap(d)
    z = zip_directory_stdlib(d, tmp_path / "x.zip", compression, stream=stream, with_dirs=stream)
    if stream:
        assert all(i.flag_bits & 0x8 for i in zipfile.ZipFile(z).infolist() if not i.is_dir())
    tree = tdz_numba.load(z)
    assert_level_matches(tree, td)
    tdz_numba.verify(z)
    # tensordict agrees on the same file
    assert_td_same(TensorDict.load_memmap(z), td)


def test_stdlib_zipfile_roundtrip_of_our_archive(tmp_path):
    # extractall of our archive -> a directory tensordict reads
    td = make_nested()
    p = tdz_numba.save(td, tmp_path / "ours.tdz")
    with zipfile.ZipFile(p) as z:
        assert z.testzip() is None
        z.extractall(tmp_path / "out")
        for info in z.infolist():
            if info.filename.endswith(".memmap"):
                # payload is 64-byte aligned per the format
                local = info.header_offset
                raw = p.read_bytes()
                n, m = struct.unpack_from("<HH", raw, local + 26)
                assert (local + 30 + n + m) % 64 == 0, info.filename
                extra = raw[local + 30 + n : local + 30 + n + m]
                assert struct.unpack_from("<H", extra, 0)[0] == 0x6474
    assert_td_same(TensorDict.load_memmap(tmp_path / "out"), td)


# ---------------------------------------------------------------------------
# 5. plain dicts -> tensordict
# ---------------------------------------------------------------------------
def test_plain_dict_loads_in_tensordict(tmp_path):
    tree = {
        "t": torch.arange(6).reshape(2, 3),
        "np": np.arange(5, dtype=np.float32),
        "big_endian": np.arange(4, dtype=">i4"),
        "strided": np.arange(10)[::-2],
        "npbool": np.array([True, False]),
        "npc": np.array([1 + 2j, -3j], np.complex128),
        "u16": np.arange(3, dtype=np.uint16),
        "bf": torch.tensor([1.5, -2.0], dtype=torch.bfloat16),
        "scalar": torch.tensor(3.25),
        "empty": torch.zeros(0, 4),
        "s": "hello",
        "unicode": "héllo ✓",
        "i": 7,
        "bigint": 2**70,
        "f": 2.5,
        "b": True,
        "n": None,
        "l": [1, "a", None, 2.5, [True]],
        "tup": (1, 2),
        "emptylist": [],
        "nested": {"x": torch.ones(2), "deeper": {"y": np.zeros((2, 2)), "z": "deep"}},
        "emptyd": {},
        "odd/key": torch.ones(1),
    }
    p = tdz_numba.save(tree, tmp_path / "plain.tdz")
    td = TensorDict.load_memmap(p)
    assert type(td) is TensorDict and td.batch_size == torch.Size([])
    assert set(td.keys()) == set(tree)
    assert torch.equal(td["t"], tree["t"])
    assert torch.equal(td["np"], torch.from_numpy(tree["np"]))
    assert td["big_endian"].dtype == torch.int32 and td["big_endian"].tolist() == [0, 1, 2, 3]
    assert td["strided"].tolist() == [9, 7, 5, 3, 1]
    assert td["npbool"].tolist() == [True, False]
    assert torch.equal(td["npc"], torch.from_numpy(tree["npc"]))
    assert td["u16"].dtype == torch.uint16 and td["u16"].tolist() == [0, 1, 2]
    assert_tensor_same(td["bf"], tree["bf"], "bf")
    assert_tensor_same(td["scalar"], tree["scalar"], "scalar")
    assert td["empty"].shape == (0, 4)
    assert td["s"] == "hello"
    assert td["unicode"] == "héllo ✓"
    assert td["i"] == 7 and td["bigint"] == 2**70
    assert td["f"] == 2.5 and td["b"] is True and td["n"] is None
    assert td["l"] == [1, "a", None, 2.5, [True]]
    assert td["tup"] == [1, 2]
    assert td["emptylist"] == []
    assert torch.equal(td["nested", "x"], torch.ones(2))
    assert torch.equal(td["nested", "deeper", "y"], torch.zeros(2, 2, dtype=torch.float64))
    assert td["nested", "deeper", "z"] == "deep"
    assert isinstance(td["emptyd"], TensorDict) and len(td["emptyd"].keys()) == 0
    assert torch.equal(td["odd/key"], torch.ones(1))
    # and our own reader gives the same tree back
    back = tdz_numba.load(p)
    assert back["tup"] == [1, 2] and back["l"] == tree["l"] and back["bigint"] == 2**70
    assert back["nested"]["deeper"]["z"] == "deep"


def test_plain_dict_matches_equivalent_tensordict_bytes(tmp_path):
    t = torch.arange(6, dtype=torch.float32).reshape(2, 3)
    tree = {"a": t, "s": "hello", "sub": {"b": torch.ones(2, dtype=torch.int64), "n": 3}}
    td = TensorDict(
        a=t, s=NonTensorData("hello"), sub=TensorDict(b=torch.ones(2, dtype=torch.int64), n=NonTensorData(3))
    )
    ours = tdz_numba.save(tree, tmp_path / "ours.tdz")
    assert_same_bytes(ours, their_archive(td, tmp_path))


def test_level_from_load_keeps_metadata_when_resaved(tmp_path):
    # Level objects carry batch size / names / class: tensordict sees them again
    src = tdz_numba.save(make_plain(), tmp_path / "a.tdz")
    lvl = tdz_numba.load(src)
    lvl["extra"] = torch.zeros(4, 3)
    out = tdz_numba.save(lvl, tmp_path / "b.tdz")
    td = TensorDict.load_memmap(out)
    assert td.batch_size == torch.Size([4, 3]) and td.names == ["time", "env"]
    assert torch.equal(td["extra"], torch.zeros(4, 3))


# ---------------------------------------------------------------------------
# 6. pack / unpack
# ---------------------------------------------------------------------------
@pytest.mark.parametrize("layout", list(LAYOUTS) + ["pickled"])
def test_pack_of_memmap_dir_matches_tensordict(layout, tmp_path):
    td = make_pickled() if layout == "pickled" else LAYOUTS[layout]()
    d = tmp_path / "mm"
    td.memmap(d)
    ours = tdz_numba.pack(d, tmp_path / "ours.tdz")
    theirs_pack = pack_memmap(d, tmp_path / "theirs_pack.tdz")
    assert_same_bytes(ours, theirs_pack)
    if layout != "pickled":  # td.save pickles again: same bytes only by chance
        assert_same_bytes(ours, their_archive(td, tmp_path))
    if layout != "pickled":
        assert_td_same(TensorDict.load_memmap(ours), td)


@pytest.mark.parametrize("compression", ["bzip2", "lzma"])
def test_compressed_pack_matches_tensordict(compression, tmp_path):
    td = make_nested()
    d = tmp_path / "mm"
    td.memmap(d)
    ours = tdz_numba.pack(d, tmp_path / "ours.tdz", compression=compression)
    theirs = pack_memmap(d, tmp_path / "theirs.tdz", compression=compression)
    assert_same_bytes(ours, theirs)
    assert_td_same(TensorDict.load_memmap(ours), td)


@pytest.mark.parametrize("layout", list(LAYOUTS) + ["pickled"])
def test_unpack_of_their_archive(layout, tmp_path):
    td = make_pickled() if layout == "pickled" else LAYOUTS[layout]()
    p = their_archive(td, tmp_path)
    out = tdz_numba.unpack(p, tmp_path / "ours_dir")
    assert Path(out).is_dir()
    if layout == "pickled":
        back = TensorDict.load_memmap(out, allow_pickle=True)
        assert torch.equal(back["a"], td["a"])
        assert back["d"] == {1, 2}
    else:
        assert_td_same(TensorDict.load_memmap(out), td)
    # the same files, byte for byte, as unzip and as tensordict's own memmap
    if HAVE_UNZIP:
        subprocess.run(
            ["unzip", "-q", str(p), "-d", str(tmp_path / "unzip_dir")], check=True, capture_output=True
        )
        unzip_snap = dir_snapshot(tmp_path / "unzip_dir")
        assert dir_snapshot(out) == unzip_snap
    if layout != "pickled":
        td.memmap(tmp_path / "mm")
        assert dir_snapshot(out) == dir_snapshot(tmp_path / "mm")


def test_pack_unpack_roundtrip_is_identity(tmp_path):
    td = make_nested_tensors()
    theirs = their_archive(td, tmp_path)
    d = tdz_numba.unpack(theirs, tmp_path / "d")
    repacked = tdz_numba.pack(d, tmp_path / "re.tdz")
    assert_same_bytes(repacked, theirs)
    assert_level_matches(tdz_numba.load(repacked), td)


# ---------------------------------------------------------------------------
# in-place writes through shared mappings, both directions
# ---------------------------------------------------------------------------
def test_r_plus_on_their_archive_then_tensordict_reads(tmp_path):
    td = TensorDict(
        a=torch.zeros(4, 3), b=TensorDict(c=torch.zeros(4, dtype=torch.int8), batch_size=[4]), batch_size=[4]
    )
    p = their_archive(td, tmp_path)
    with tdz_numba.open(p, mode="r+") as ar:
        ar["a"][1] = 5.0
        ar["b", "c"][3] = -2
    tdz_numba.refresh_checksums(p)
    assert zipfile.ZipFile(p).testzip() is None
    tdz_numba.verify(p)
    back = TensorDict.load_memmap(p)
    assert back["a"][1].tolist() == [5.0, 5.0, 5.0] and back["a"].sum() == 15.0
    assert back["b", "c"].tolist() == [0, 0, 0, -2]


def test_tensordict_r_plus_then_ours_reads(tmp_path):
    p = tdz_numba.save(TensorDict(a=torch.zeros(3), batch_size=[3]), tmp_path / "ours.tdz")
    back = TensorDict.load_memmap(p, mode="r+")
    back["a"][2] = 4.0
    del back
    assert tdz_numba.load(p)["a"].tolist() == [0.0, 0.0, 4.0]
    with pytest.raises(tdz_numba.ChecksumError):
        tdz_numba.verify(p)
    tdz_numba.refresh_checksums(p)
    tdz_numba.verify(p)


if __name__ == "__main__":  # pragma: no cover
    warnings.simplefilter("ignore")
    raise SystemExit(pytest.main([__file__, "-q"]))
