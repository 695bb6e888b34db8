"""torch .pt files other tools wrote, read bit for bit as ``torch.load(weights_only=True)`` reads them.

The corpus: files ``torch.save`` writes in unusual but legal configurations
(every dtype, views with offsets and strides, shared storages, expanded
views, conjugate and negative bits, parameters, state dicts with
``_metadata``, nested containers, pickle protocols 1 to 5, the legacy
non-zip format), and small files an older torch wrote, kept in
``tests/fixtures/pt_real/`` (see its ``SOURCE.md``). Each is read with
``tdz_numba.open`` and ``tdz_numba.load`` and compared with torch's reader:
dtype, shape, strides, the bytes of every element (NaN payloads included)
and aliasing (two leaves on one storage keep their distance in memory);
then converted to ``.tdz`` and read back, by us and by tensordict 0.15.3.
What torch reads and we refuse is a documented limit, listed in REFUSED.
"""

from __future__ import annotations

import math
import warnings
from collections import OrderedDict
from pathlib import Path

import pytest
import torch

import tdz_numba
from tdz_numba.errors import InvalidTreeError, TdzError, UnsupportedError

FIXTURES = Path(__file__).parent / "fixtures" / "pt_real"

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")


# -- the reference comparison --------------------------------------------------------------------
def _bytes(t: torch.Tensor) -> bytes:
    c = torch.empty(t.shape, dtype=t.dtype)  # C strides, even where t's one-element dims have others
    c.copy_(t.resolve_conj().resolve_neg())
    return c.reshape(-1).view(torch.uint8).numpy().tobytes() if c.numel() else b""


def _tensors(ref, ours, path="") -> list[tuple[str, torch.Tensor, torch.Tensor]]:
    """Walks torch's object and ours side by side: asserts the structure and plain values are
    equal, returns the (path, torch's tensor, our tensor) pairs."""
    out = []
    if not isinstance(ref, (dict, list, tuple)) or not (isinstance(ref, dict) or _holds_tensor(ref)):
        ours = ours["0"]  # a top-level tensor or value is the single key "0"
    stack = [(ref, ours, path)]
    while stack:
        r, o, p = stack.pop()
        if isinstance(r, torch.Tensor):
            assert isinstance(o, torch.Tensor), (p, type(o))
            out.append((p, r, o))
        elif isinstance(r, dict) or (isinstance(r, (list, tuple)) and _holds_tensor(r)):
            items = list(r.items()) if isinstance(r, dict) else list(enumerate(r))
            assert list(o.keys()) == [str(k) for k, _ in items], p
            stack.extend((v, o[str(k)], f"{p}/{k}") for k, v in items)
        else:
            assert _same_value(r, o), (p, r, o)
    return out


def _holds_tensor(v) -> bool:
    stack = [v]
    while stack:
        x = stack.pop()
        if isinstance(x, torch.Tensor):
            return True
        if isinstance(x, dict):
            stack.extend(x.values())
        elif isinstance(x, (list, tuple)):
            stack.extend(x)
    return False


def _same_value(r, o) -> bool:
    if isinstance(r, float) and math.isnan(r):
        return isinstance(o, float) and math.isnan(o)
    if isinstance(r, (list, tuple)):
        return type(o) is type(r) and len(o) == len(r) and all(_same_value(a, b) for a, b in zip(r, o))
    return r == o and type(r) is type(o)


def check_same(ref, ours, *, strides: bool = True, aliasing: bool = True) -> int:
    """Asserts ``ours`` holds what ``ref`` (torch.load's object) holds, bit for bit; returns
    the number of tensors compared."""
    pairs = _tensors(ref, ours)
    for p, r, o in pairs:
        assert o.dtype == r.dtype and tuple(o.shape) == tuple(r.shape), (
            p,
            o.dtype,
            r.dtype,
            o.shape,
            r.shape,
        )
        assert not o.is_conj() and not o.is_neg(), p  # bits resolved into the values
        if strides and not (r.is_conj() or r.is_neg()):
            assert o.stride() == r.stride(), (p, o.stride(), r.stride())
        assert _bytes(o) == _bytes(r), p
    if strides and aliasing:  # leaves on one storage keep their distance in memory
        by_storage: dict[int, list] = {}
        for p, r, o in pairs:
            if r.numel() and not (r.is_conj() or r.is_neg()):
                by_storage.setdefault(r.untyped_storage().data_ptr(), []).append((p, r, o))
        for group in by_storage.values():
            p0, r0, o0 = group[0]
            for p, r, o in group[1:]:
                assert o.data_ptr() - o0.data_ptr() == r.data_ptr() - r0.data_ptr(), (p0, p)
    return len(pairs)


def check_file(path: Path, tmp_path: Path, convert: str = "both", *, trusted: bool = False) -> int:
    """Every way of reading ``path`` agrees with torch.load; so does its .tdz conversion, read
    back by us and (``convert="both"``) by tensordict; ``convert="refused"``: convert refuses
    a value .tdz cannot hold, with a TdzError and no output. ``trusted``: the reference is
    torch.load(weights_only=False), for files we wrote that torch's weights-only reader refuses.

    A legacy file's storages lie wherever the pickles end: a storage that does not start at a
    multiple of its element size is read as a copy (its views do not share memory).
    """
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        ref = torch.load(path, weights_only=not trusted)
    aliasing = path.read_bytes()[:2] == b"PK"  # zip records are 64-byte aligned: always views
    n = check_same(ref, tdz_numba.load(path), aliasing=aliasing)
    with tdz_numba.open(path) as ar:
        pairs = _tensors(ref, ar)
        check_same(ref, ar, aliasing=aliasing)
    dst = tmp_path / (path.stem + ".tdz")
    if convert == "refused":
        with pytest.raises(InvalidTreeError, match="cannot store a value"):
            tdz_numba.convert(path, dst)
        assert not dst.exists() and list(tmp_path.iterdir()) == [path]
        return n
    out = tdz_numba.convert(path, dst)  # keys kept as the file names them (nested levels stay levels)
    want = {".".join(p.strip("/").split("/")) or "0": r for p, r, _ in pairs}
    _check_flat(want, _flat(tdz_numba.load(out)), out)
    if convert != "both":
        return n
    from tensordict import TensorDict

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        td = TensorDict.load_memmap(out).flatten_keys(".")
    _check_flat(want, {k: td[k] for k in td.keys() if isinstance(td[k], torch.Tensor)}, out)
    return n


def _flat(tree, prefix: str = "") -> dict:
    out = {}
    for k, v in tree.items():
        if isinstance(v, torch.Tensor):
            out[prefix + k] = v
        elif hasattr(v, "items"):
            out.update(_flat(v, prefix + k + "."))
    return out


def _check_flat(want: dict, got: dict, where) -> None:
    assert sorted(got) == sorted(want), (where, sorted(got), sorted(want))
    for k, r in want.items():
        t = got[k]
        assert t.dtype == r.dtype and tuple(t.shape) == tuple(r.shape), (where, k)
        assert _bytes(t) == _bytes(r), (where, k)


# -- the generated corpus --------------------------------------------------------------------------
def _nan_payloads(dtype: torch.dtype) -> torch.Tensor:
    """NaNs with payloads and signs, infinities, signed zeros and denormals of a float dtype."""
    bits = {
        torch.float32: [0x7FC00001, 0xFFC00002, 0x7F800001, 0x7F800000, 0x80000000, 0x00000001],
        torch.float64: [0x7FF8000000000001, 0xFFF0000000000002, 0x8000000000000000, 1],
        torch.float16: [0x7E01, 0xFC01, 0x8000, 0x0001],
        torch.bfloat16: [0x7FC1, 0xFF81, 0x8000, 0x0001],
    }[dtype]
    ints = {2: torch.int16, 4: torch.int32, 8: torch.int64}[dtype.itemsize]
    width = 8 * dtype.itemsize
    signed = [b - (1 << width) if b >> (width - 1) else b for b in bits]
    return torch.tensor(signed, dtype=ints).view(dtype)


def _every_dtype() -> dict:
    g = torch.Generator().manual_seed(0)
    out = {}
    for dt in (torch.float64, torch.float32, torch.float16, torch.bfloat16):
        out[str(dt)] = torch.randn(3, 4, generator=g).to(dt)
        out[str(dt) + "_nan"] = _nan_payloads(dt)
    for dt in (torch.int8, torch.int16, torch.int32, torch.int64, torch.uint8):
        out[str(dt)] = torch.randint(-100 if dt.is_signed else 0, 100, (5,), generator=g, dtype=dt)
    out["uint16"] = torch.tensor([0, 1, 2**16 - 1], dtype=torch.int32).to(torch.uint16)
    out["uint32"] = torch.tensor([0, 1, 2**32 - 1], dtype=torch.int64).to(torch.uint32)
    out["uint64"] = torch.tensor([0, 1, -1], dtype=torch.int64).view(torch.uint64)
    out["bool"] = torch.tensor([True, False, True])
    out["complex64"] = torch.randn(2, 3, dtype=torch.complex64, generator=g)
    out["complex128"] = torch.randn(4, dtype=torch.complex128, generator=g)
    out["complex32"] = torch.randn(3, dtype=torch.complex64, generator=g).to(torch.complex32)
    out["zero_dim"] = torch.tensor(3.5)
    out["empty"] = torch.zeros(0, 3)
    out["empty_int"] = torch.zeros(2, 0, dtype=torch.int64)
    return out


def _float8() -> dict:
    """Every bit pattern of each float8 dtype (tensordict 0.15.3 loads none of them)."""
    names = ("float8_e4m3fn", "float8_e5m2", "float8_e4m3fnuz", "float8_e5m2fnuz", "float8_e8m0fnu")
    return {n: torch.arange(256, dtype=torch.uint8).view(getattr(torch, n)) for n in names}


def _views() -> dict:
    x = torch.arange(60, dtype=torch.float32).reshape(3, 4, 5)
    return {
        "x": x,
        "t": x.transpose(0, 2),
        "perm": x.permute(1, 2, 0),
        "offset_slice": x[1:, 2:, 1:4],
        "step": x[:, ::2, ::3],
        "row": x[2, 1],
        "scalar_view": x[1, 2, 3],
        "flat_tail": x.reshape(-1)[37:],
        "expanded": torch.arange(3.0)[:, None].expand(3, 1000),
        "stride0": torch.tensor([7.0]).expand(10),
        "diag": torch.arange(16.0).reshape(4, 4).diagonal(),
        "unfold": torch.arange(10.0).unfold(0, 4, 2),
        "tied": [x[0], x[0]],
        "other_dtype_view": torch.arange(8, dtype=torch.int32).view(torch.float32)[2:],
    }


def _bits() -> dict:
    c = torch.tensor([1 + 2j, -3.5 - 0.25j, float("nan") + 1j], dtype=torch.complex64)
    m = torch.arange(12, dtype=torch.float64).to(torch.complex128).reshape(3, 4) * (1 - 1j)
    f = torch.tensor([1.0, -2.0, float("inf"), 0.0])
    return {
        "conj": c.conj(),
        "neg": torch._neg_view(f),
        "conj_neg": torch._neg_view(c.conj()),
        "conj_t": m.t().conj(),
        "conj_slice": m[1:, ::2].conj(),
        "neg_int": torch._neg_view(torch.arange(5, dtype=torch.int32)),
        "neg_bf16": torch._neg_view(_nan_payloads(torch.bfloat16)),
        "neg_nan": torch._neg_view(_nan_payloads(torch.float32)),
        "conj_param": torch.nn.Parameter(c.conj(), requires_grad=False),
        "plain_next_to_conj": c,
    }


def _containers() -> dict:
    torch.manual_seed(0)
    m = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.BatchNorm1d(4), torch.nn.Linear(4, 2))
    sd = m.state_dict()
    t = torch.ones(2)
    w = torch.nn.Parameter(torch.randn(2, 2))
    w.extra_attr = "kept by torch, not data"  # saved through _rebuild_from_type_v2 with a state
    return {
        "state_dict": sd,
        "od": OrderedDict([("b", t), ("a", t * 2)]),
        "list": [t, 1, "s", None, 2.5, True],
        "tuple": (t, (t[:1], -3)),
        "plain": [1, -2, 2**40, -(2**70), 0.1, float("inf"), None, True, "ünï", [1, [2, "x"]]],
        "nan": float("nan"),
        "size": torch.Size([3, 4]),
        "empty_dict": {},
        "nested": {"a": {"b": {"c": t.clone()}}},
        "int_key": {1: t, 2: "x"},
        "param": torch.nn.Parameter(torch.arange(3.0)),
        "param_state": w,
        "grad": torch.ones(2, requires_grad=True),
    }


def _values_tdz_cannot_hold() -> dict:
    return {
        "t": torch.ones(2),
        "bytes": b"\x00\xff",
        "dtype": torch.float16,
        "device": torch.device("cpu"),
        "complex": 1 - 2j,
        "set": {1, 2, 3},
    }


def _optimizer() -> dict:
    torch.manual_seed(0)
    m = torch.nn.Linear(3, 2)
    opt = torch.optim.Adam(m.parameters())
    m(torch.randn(4, 3)).sum().backward()
    opt.step()
    return {"model": m.state_dict(), "optim": opt.state_dict(), "epoch": 3}


def _legacy_dtypes() -> dict:
    """The dtypes a legacy file holds in typed storages (torch.load cannot read the untyped
    storages it writes for uint16/32/64 and complex32)."""
    return {k: v for k, v in _every_dtype().items() if k not in ("uint16", "uint32", "uint64", "complex32")}


#: name -> (the object, torch.save's arguments, what convert does: "both" = read back by us and
#: tensordict, "ours" = by us (tensordict 0.15.3 has no float8), "refused" = a value .tdz cannot hold)
GENERATED = {
    "every_dtype": (_every_dtype, {}, "both"),
    "float8": (_float8, {}, "ours"),
    "views": (_views, {}, "both"),
    "bits": (_bits, {}, "both"),
    "containers": (_containers, {}, "both"),
    "values_tdz_cannot_hold": (_values_tdz_cannot_hold, {}, "refused"),
    "optimizer": (_optimizer, {}, "both"),
    "top_tensor": (lambda: torch.arange(6.0).reshape(2, 3).t(), {}, "both"),
    "top_list": (lambda: [torch.ones(2), torch.zeros(3)], {}, "both"),
    "protocol_3": (_views, {"pickle_protocol": 3}, "both"),
    "protocol_4": (_containers, {"pickle_protocol": 4}, "both"),  # torch's weights_only: no FRAME
    "protocol_5": (_bits, {"pickle_protocol": 5}, "both"),
    # protocol 1 writes bools as text INT opcodes, which torch's weights_only reader refuses:
    # the files it reads hold no bools (so no tensors: requires_grad is a bool)
    "protocol_1": (
        lambda: {"a": 1, "s": "x", "l": [1, 2.5, None, (3, "y")], "n": -7},
        {"pickle_protocol": 1},
        "both",
    ),
    "legacy": (_views, {"_use_new_zipfile_serialization": False}, "both"),
    "legacy_bits": (_bits, {"_use_new_zipfile_serialization": False}, "both"),
    "legacy_dtypes": (_legacy_dtypes, {"_use_new_zipfile_serialization": False}, "both"),
    "legacy_containers": (_containers, {"_use_new_zipfile_serialization": False}, "both"),
}


@pytest.mark.parametrize("name", list(GENERATED))
def test_generated_agrees_with_torch(name, tmp_path):
    make, kwargs, convert = GENERATED[name]
    p = tmp_path / f"{name}.pt"
    torch.save(make(), p, **kwargs)
    check_file(p, tmp_path, convert, trusted=kwargs.get("pickle_protocol", 2) > 3)


def test_every_dtype_counted(tmp_path):
    p = tmp_path / "d.pt"
    torch.save(_every_dtype(), p)
    assert check_file(p, tmp_path) == len(_every_dtype())


def test_conj_and_neg_bits_issue_example(tmp_path):
    p = tmp_path / "cn.pt"
    torch.save({"c": torch.tensor([1 + 2j]).conj(), "n": torch._neg_view(torch.tensor([1.0, 2.0]))}, p)
    with tdz_numba.open(p) as ar:
        assert ar["c"].tolist() == [1 - 2j] and ar["n"].tolist() == [-1.0, -2.0]
        assert not ar.info("c").zero_copy and ar.info("n").dtype == torch.float32
    lvl = tdz_numba.load(p)
    assert lvl["c"].tolist() == [1 - 2j] and lvl["n"].tolist() == [-1.0, -2.0]
    out = tdz_numba.convert(p, tmp_path / "cn.tdz")
    lvl = tdz_numba.load(out)
    assert lvl["c"].tolist() == [1 - 2j] and lvl["n"].tolist() == [-1.0, -2.0]


@pytest.mark.parametrize("path", sorted(FIXTURES.glob("*.bin")), ids=lambda p: p.name)
def test_fixture_files_agree_with_torch(path, tmp_path):
    assert check_file(path, tmp_path) >= 2


# -- what torch reads and we refuse: the documented limits ------------------------------------------
def _quantized():
    return {"q": torch.quantize_per_tensor(torch.randn(4), 0.1, 0, torch.quint8)}


REFUSED = {
    "quantized": (_quantized, "quantized"),
    "sparse_coo": (lambda: {"s": torch.eye(3).to_sparse()}, "sparse"),
    "sparse_csr": (lambda: {"s": torch.eye(3).to_sparse_csr()}, "sparse"),
    "tensor_set": (lambda: {"s": {torch.ones(1)}}, "set of tensors"),
    "tuple_key": (lambda: {(1, 2): torch.ones(1)}, "dict key of type tuple"),
    "surrogate_key": (lambda: {"a\udc80": torch.ones(1)}, "surrogate"),
    "colliding_keys": (lambda: {1: torch.ones(1), "1": torch.zeros(1)}, "both read as"),
    "bits8": (lambda: {"b": torch.zeros(2, dtype=torch.uint8).view(torch.bits8)}, "bits8"),
}


@pytest.mark.parametrize("name", list(REFUSED))
def test_refused_with_a_reason(name, tmp_path):
    make, reason = REFUSED[name]
    p = tmp_path / f"{name}.pt"
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        torch.save(make(), p)
        torch.load(p, weights_only=True)  # torch reads it: ours is a limit, so it is documented
    with pytest.raises(UnsupportedError, match=reason):
        tdz_numba.open(p)
    with pytest.raises(TdzError):
        tdz_numba.convert(p, tmp_path / "x.tdz")
    assert not (tmp_path / "x.tdz").exists()
