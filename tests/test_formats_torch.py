"""torch.save files read by the restricted pickle VM: values, strides, aliasing, safety."""

import io
import os
import pickle
import zipfile
from collections import OrderedDict

import pytest
import torch

from tdz_numba import formats
from tdz_numba.errors import BadArchiveError, UnsafeContentError, UnsupportedError
from tdz_numba.formats import pickle_vm
from tdz_numba.formats.torch_pt import open_torch
from tdz_numba.tdz.dtypes import dtype_table


def _load(p):
    return formats.to_tree(formats.open_source(p))


def _check(ours, ref, path="<root>"):
    if isinstance(ref, torch.Tensor):
        assert isinstance(ours, torch.Tensor), path
        assert ours.dtype == ref.dtype and ours.shape == ref.shape, path
        assert ours.stride() == ref.stride(), path
        assert torch.equal(
            ours.contiguous().reshape(-1).view(torch.uint8), ref.contiguous().reshape(-1).view(torch.uint8)
        ), path
    elif isinstance(ref, dict):
        assert list(ours) == [str(k) for k in ref], path
        for k, v in ref.items():
            _check(ours[str(k)], v, f"{path}/{k}")
    elif isinstance(ref, (list, tuple)) and isinstance(ours, dict):
        assert list(ours) == [str(i) for i in range(len(ref))], path
        for i, v in enumerate(ref):
            _check(ours[str(i)], v, f"{path}/{i}")
    else:
        assert ours == ref and type(ours) is type(ref), (path, ours, ref)


def test_module_state_dict(tmp_path):
    torch.manual_seed(0)
    m = torch.nn.Sequential(
        torch.nn.Conv2d(3, 4, 3),
        torch.nn.BatchNorm2d(4),
        torch.nn.Flatten(),
        torch.nn.Linear(4, 5),
        torch.nn.LayerNorm(5),
    )
    p = tmp_path / "m.pt"
    torch.save(m.state_dict(), p)
    assert formats.detect(p) == "torch"
    src = formats.open_source(p)
    assert src.format == "torch" and src.metadata == {}
    ref = torch.load(p, weights_only=True)
    _check(_load(p), dict(ref))
    m2 = type(m)(*[type(x)(*a) for x, a in zip(m, [(3, 4, 3), (4,), (), (4, 5), (5,)])])
    m2.load_state_dict(_load(p))
    assert all(torch.equal(a, b) for a, b in zip(m.state_dict().values(), m2.state_dict().values()))


def test_nested_containers_strides_and_aliasing(tmp_path):
    x = torch.arange(24, dtype=torch.float32).reshape(4, 6)
    obj = {
        "x": x,
        "t": x.t(),
        "slice": x[1:3, 2:5],
        "row": x[2],
        "col": x[:, 3],
        "step": x[::2, ::3],
        "list": [x[0], (x.t()[1:], 7), {"deep": x[3, 1:]}],
        "tuple": (x[1], "s"),
        "plain": [1, 2.5, None, True, "x", (1, 2)],
        "size": torch.Size([2, 3]),
        "dev": torch.device("cpu"),
        "dt": torch.bfloat16,
        "od": OrderedDict(a=x[0, :2]),
        3: x[:1],
        "bytes": b"\x00\xff",
        "set": {1, 2},
        "param": torch.nn.Parameter(torch.ones(2, 2)),
    }
    p = tmp_path / "n.pt"
    torch.save(obj, p)
    ref = torch.load(p, weights_only=True)
    ours = _load(p)
    _check(
        {k: v for k, v in ours.items()}, {str(k) if not isinstance(k, str) else k: v for k, v in ref.items()}
    )
    assert ours["list"]["1"]["1"] == 7 and ours["tuple"]["1"] == "s"
    # tensors sharing a storage are views of the same bytes (mode r: private mapping, writes stay in memory)
    ours["x"][2, 0] = 555.0
    assert ours["row"][0] == 555.0 and ours["t"][0, 2] == 555.0
    ours["list"]["2"]["deep"][0] = -1.0
    assert ours["x"][3, 1] == -1.0
    assert os.path.getsize(p) and torch.load(p, weights_only=True)["x"][2, 0] == 12.0  # file unchanged


def test_level_meta_records_container_type(tmp_path):
    p = tmp_path / "l.pt"
    torch.save([torch.zeros(2), (torch.ones(1),)], p)
    src = formats.open_source(p)
    assert src.level("").meta == {"_torch_type": "list"}
    tree = formats.to_tree(src)
    assert list(tree) == ["0", "1"] and tree["1"]["0"].tolist() == [1.0]


def test_top_level_tensor_and_scalar(tmp_path):
    p = tmp_path / "t.pt"
    torch.save(torch.arange(5)[1:], p)
    tree = _load(p)
    assert tree["0"].tolist() == [1, 2, 3, 4]
    torch.save(42, p)
    assert _load(p) == {"0": 42}


def _creatable(dt):
    try:
        return torch.zeros(3, dtype=dt)
    except (RuntimeError, TypeError):
        return None


@pytest.mark.parametrize("protocol", [2, 4, 5])
def test_every_dtype(tmp_path, protocol):
    tensors = {}
    for name, dt in dtype_table().items():
        t = _creatable(dt)
        if t is not None:
            tensors[name] = (
                torch.randint(0, 100, (3,), dtype=torch.uint8).view(torch.uint8).repeat(dt.itemsize).view(dt)
                if dt.itemsize
                else t
            )
    p = tmp_path / "d.pt"
    torch.save(tensors, p, pickle_protocol=protocol)
    _check(_load(p), torch.load(p, weights_only=False))  # our own file; weights_only lacks FRAME
    assert len(tensors) >= 15


def test_copy_mode(tmp_path):
    p = tmp_path / "c.pt"
    x = torch.arange(6.0).reshape(2, 3)
    torch.save({"x": x, "t": x.t()}, p)
    src = formats.open_source(p, copy=True)
    assert src.copy is True
    tree = formats.to_tree(src, copy=True)
    assert torch.equal(tree["t"], x.t())
    tree["x"][0, 0] = 9.0
    assert tree["t"][0, 0] == 0.0  # copies are independent


def test_allow_pickle_is_not_a_way_around(tmp_path):
    p = tmp_path / "e.pt"
    _write_pt(p, _EvilSystem(str(tmp_path / "marker")))
    with pytest.raises(UnsafeContentError):
        formats.open_source(p, allow_pickle=True)


# -- hand-made torch zips ------------------------------------------------------------------------
def _write_pt(path, payload_or_pickle, storages=None, byteorder=b"little", protocol=2):
    data = payload_or_pickle if isinstance(payload_or_pickle, bytes) else _dumps(payload_or_pickle, protocol)
    with zipfile.ZipFile(path, "w", zipfile.ZIP_STORED) as z:
        z.writestr("archive/data.pkl", data)
        if byteorder is not None:
            z.writestr("archive/byteorder", byteorder)
        for key, raw in (storages or {}).items():
            z.writestr(f"archive/data/{key}", raw)
        z.writestr("archive/version", b"3\n")


class _S:
    """A storage stand-in: pickled as the persistent id torch writes."""

    def __init__(self, key, cls, numel):
        self.pid = ("storage", cls, key, "cpu", numel)


class _T:
    """A tensor stand-in: reduces to torch's own rebuild function with chosen arguments."""

    def __init__(self, storage, offset, size, stride):
        self.args = (storage, offset, size, stride, False, OrderedDict())

    def __reduce__(self):
        return (torch._utils._rebuild_tensor_v2, self.args)


def _dumps(obj, protocol=2):
    buf = io.BytesIO()
    p = pickle.Pickler(buf, protocol=protocol)
    p.persistent_id = lambda o: o.pid if isinstance(o, _S) else None
    p.dump(obj)
    return buf.getvalue()


def test_handmade_views(tmp_path):
    raw = torch.arange(12, dtype=torch.float32).numpy().tobytes()
    s = _S("0", torch.FloatStorage, 12)
    p = tmp_path / "h.pt"
    _write_pt(
        p,
        {"a": _T(s, 0, (3, 4), (4, 1)), "b": _T(s, 5, (2, 2), (1, 3)), "z": _T(s, 12, (0,), (1,))},
        {"0": raw},
    )
    tree = _load(p)
    full = torch.arange(12, dtype=torch.float32)
    assert torch.equal(tree["a"], full.view(3, 4))
    assert torch.equal(tree["b"], full.as_strided((2, 2), (1, 3), 5))
    assert tree["z"].shape == (0,)


@pytest.mark.parametrize(
    "offset, size, stride",
    [
        (13, (1,), (1,)),  # offset past the storage
        (0, (13,), (1,)),  # longer than the storage
        (0, (3, 4), (5, 1)),  # strides reach past the end
        (10, (2, 2), (1, 1)),  # offset + extent past the end
        (0, (3,), (1, 1)),  # rank mismatch
        (-1, (1,), (1,)),
        (0, (-1,), (1,)),
        (0, (2,), (-1,)),
        (0, "x", (1,)),
    ],
)
def test_views_outside_storage(tmp_path, offset, size, stride):
    s = _S("0", torch.FloatStorage, 12)
    p = tmp_path / "v.pt"
    _write_pt(p, {"a": _T(s, offset, size, stride)}, {"0": bytes(48)})
    with pytest.raises(BadArchiveError):
        open_torch(p)


@pytest.mark.parametrize(
    "pid, storages",
    [
        (("storage", torch.FloatStorage, "0", "cpu", 13), {"0": bytes(48)}),  # numel beyond record
        (("storage", torch.FloatStorage, "9", "cpu", 1), {"0": bytes(48)}),  # no record
        (("storage", torch.FloatStorage, "../0", "cpu", 1), {"0": bytes(48)}),
        (("storage", torch.FloatStorage, 0, "cpu", 1), {"0": bytes(48)}),
        (("blob", torch.FloatStorage, "0", "cpu", 1), {"0": bytes(48)}),
        (("storage", torch.FloatStorage, "0"), {"0": bytes(48)}),
    ],
)
def test_bad_persistent_ids(tmp_path, pid, storages):
    s = _S("0", torch.FloatStorage, 1)
    s.pid = pid
    p = tmp_path / "p.pt"
    _write_pt(p, {"a": _T(s, 0, (1,), (1,))}, storages)
    with pytest.raises(BadArchiveError):
        open_torch(p)


def test_big_endian_and_bad_byteorder(tmp_path):
    p = tmp_path / "be.pt"
    _write_pt(p, {"a": 1}, byteorder=b"big")
    with pytest.raises(UnsupportedError, match="big-endian"):
        open_torch(p)
    _write_pt(p, {"a": 1}, byteorder=b"middle")
    with pytest.raises(BadArchiveError, match="byteorder"):
        open_torch(p)
    _write_pt(p, {"a": 1}, byteorder=None)  # old files have none: little
    assert _load(p) == {"a": 1}


def test_legacy_and_torchscript(tmp_path):
    p = tmp_path / "legacy.pt"
    torch.save({"a": torch.ones(2)}, p, _use_new_zipfile_serialization=False)
    assert formats.detect(p) == "torch"
    assert _load(p)["a"].tolist() == [1.0, 1.0]  # legacy (non-zip) files are read, as torch.load reads them
    s = tmp_path / "script.pt"
    torch.jit.save(torch.jit.script(torch.nn.Linear(2, 2)), s)
    with pytest.raises(UnsupportedError, match="TorchScript"):
        formats.detect(s)
    with pytest.raises(UnsupportedError, match="TorchScript"):
        formats.open_source(s)


# -- malicious pickles ------------------------------------------------------------------------------
class _EvilSystem:
    def __init__(self, marker):
        self.marker = marker

    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",))


class _EvilExec:
    def __init__(self, marker):
        self.marker = marker

    def __reduce__(self):
        return (exec, (f"open({self.marker!r}, 'w').write('x')",))


class _EvilImport:
    def __reduce__(self):
        return (__import__, ("os",))


class _EvilEval:
    def __init__(self, marker):
        self.marker = marker

    def __reduce__(self):
        return (eval, (f"open({self.marker!r}, 'w')",))


@pytest.mark.parametrize("protocol", [2, 4, 5])
@pytest.mark.parametrize(
    "make, name",
    [
        (_EvilSystem, "system"),
        (_EvilExec, "exec"),
        (lambda m: _EvilImport(), "__import__"),
        (_EvilEval, "eval"),
    ],
)
def test_malicious_pickles_run_nothing(tmp_path, make, name, protocol):
    marker = tmp_path / "marker"
    p = tmp_path / "evil.pt"
    # the evil object hides inside an otherwise normal state dict
    s = _S("0", torch.FloatStorage, 2)
    _write_pt(
        p, {"w": _T(s, 0, (2,), (1,)), "x": [1, {"y": make(str(marker))}]}, {"0": bytes(8)}, protocol=protocol
    )
    assert formats.detect(p) == "torch"
    with pytest.raises(UnsafeContentError, match=rf"(posix|builtins|__builtin__)\.{name}\b"):
        formats.open_source(p)
    assert not marker.exists()


@pytest.mark.parametrize(
    "raw, exc",
    [
        (b"\x80\x02cposix\nsystem\n.", UnsafeContentError),
        (b"\x80\x04\x8c\x05posix\x8c\x06system\x93.", UnsafeContentError),
        (b"\x80\x02ctorch._utils\n_rebuild_qtensor\n.", UnsupportedError),
        (b"\x80\x02ctorch\nQUInt8Storage\n.", UnsupportedError),
        (b"\x80\x02ctorch\nFloatStorage\n.", UnsupportedError),  # a bare class as the value
        (b"\x80\x02]q\x00h\x00a.", BadArchiveError),  # a list that holds itself
        (b"\x80\x02K\x01K\x02.", BadArchiveError),  # two items at STOP
        (b"\x80\x02K\x01", BadArchiveError),  # no STOP
        (b"\x80\x02h\x05.", BadArchiveError),  # memo miss
        (b"\x80\x02X\xff\x00\x00\x00ab.", BadArchiveError),  # string past the end
        (b"\x80\x02(K\x01u.", BadArchiveError),  # SETITEMS without a dict
        (b"\x80\x02t.", BadArchiveError),  # TUPLE without MARK
        (b"\x80\x02\xff.", BadArchiveError),  # unknown opcode
        (b"\x80\x09N.", UnsupportedError),  # protocol 9
        (b"(I1\n.", UnsupportedError),  # text opcode
        (b"\x80\x02N\x8a\xffab.", BadArchiveError),  # LONG1 past the end
        (b"\x80\x02}K\x01]s\x8f.", BadArchiveError),  # junk after SETITEM
        (b"\x80\x02\x82\x01.", UnsafeContentError),  # EXT1
        (
            b"\x80\x02ccollections\nOrderedDict\n]\x85R}b.",
            None,
        ),  # OrderedDict([]) + BUILD of its __dict__: fine
        (b"\x80\x02]}b.", UnsupportedError),  # BUILD on a list
    ],
)
def test_raw_pickles(tmp_path, raw, exc):
    p = tmp_path / "r.pt"
    _write_pt(p, raw)
    if exc is None:
        open_torch(p)
        return
    with pytest.raises(exc):
        open_torch(p)


def test_vm_limits():
    deep = b"\x80\x02" + b"(" * 1000 + b")" + b"t" * 1000 + b"."
    assert pickle_vm.load(deep, lambda pid: None) is not None  # marks are not recursion
    nested = b"\x80\x02" + b"]" * 300 + b"a" * 299 + b"."
    obj = pickle_vm.load(nested, lambda pid: None)
    with pytest.raises(BadArchiveError, match="deeper"):
        from tdz_numba.formats.torch_pt import _to_tree

        _to_tree({"a": obj}, "<test>", 0)
    with pytest.raises(BadArchiveError):
        pickle_vm.load(b"\x80\x02r\xff\xff\xff\xff", lambda pid: None)  # LONG_BINPUT on an empty stack


def test_vm_does_not_import():
    import builtins

    calls = []
    real = builtins.__import__

    def spy(name, *a, **k):
        calls.append(name)
        return real(name, *a, **k)

    data = pickle.dumps(
        {"a": OrderedDict(b=[1, 2.0, "x", None, True, (b"z",)]), "s": frozenset({1})}, protocol=4
    )
    builtins.__import__ = spy
    try:
        out = pickle_vm.load(data, lambda pid: None)
    finally:
        builtins.__import__ = real
    assert out == {"a": OrderedDict(b=[1, 2.0, "x", None, True, (b"z",)]), "s": frozenset({1})}
    assert calls == []


def test_quantized_and_sparse_refused(tmp_path):
    p = tmp_path / "q.pt"
    torch.save({"q": torch.quantize_per_tensor(torch.randn(4), 0.1, 0, torch.quint8)}, p)
    with pytest.raises(UnsupportedError, match="quantized"):
        formats.open_source(p)
    torch.save({"s": torch.eye(3).to_sparse()}, p)
    with pytest.raises(UnsupportedError, match="sparse"):
        formats.open_source(p)


def test_negative_dims_with_positive_product(tmp_path):
    s = _S("0", torch.FloatStorage, 12)
    p = tmp_path / "neg.pt"
    _write_pt(p, {"a": _T(s, 0, (-2, -3), (1, 1))}, {"0": bytes(48)})
    with pytest.raises(BadArchiveError):
        open_torch(p)


def test_vm_restores_the_collector():
    import gc

    assert gc.isenabled()
    with pytest.raises(BadArchiveError):
        pickle_vm.load(b"\x80\x02t.", lambda pid: None)
    assert gc.isenabled()
    gc.disable()
    try:
        pickle_vm.load(b"\x80\x02N.", lambda pid: None)
        assert not gc.isenabled()
    finally:
        gc.enable()
