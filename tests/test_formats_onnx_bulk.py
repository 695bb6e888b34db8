"""ONNX initializers read compactly (formats/onnx_bulk.py) against the general field walker:
the same specs for numpy_helper's files, the walker's reading and errors for everything else."""

import numpy as np
import pytest
import torch

onnx = pytest.importorskip("onnx")
from onnx import TensorProto, helper, numpy_helper  # noqa: E402

from tdz_numba import formats  # noqa: E402
from tdz_numba.errors import BadArchiveError  # noqa: E402
from tdz_numba.formats import onnx as ox  # noqa: E402
from tdz_numba.formats.onnx_bulk import compact_graph, compact_tensor  # noqa: E402


def _save(path, inits, name="g", doc=""):
    graph = helper.make_graph([], name, [], [], initializer=inits, doc_string=doc)
    onnx.save(helper.make_model(graph), str(path))
    return path


def _open_both(path, monkeypatch):
    fast = ox.open_onnx(path)
    with monkeypatch.context() as m:
        m.setattr(ox, "compact_graph", lambda *a: None)
        m.setattr(ox, "compact_tensor", lambda *a: None)
        slow = ox.open_onnx(path)
    return fast, slow


def _arrays():
    rng = np.random.default_rng(0)
    return {
        "w": rng.standard_normal((3, 200)).astype(np.float32),  # two-byte varint dims and lengths
        "h": rng.standard_normal(70000).astype(np.float16),  # three-byte raw_data length
        "s": np.array(7, dtype=np.int64),  # 0-dim
        "e": np.zeros((0, 4), np.float64),
        "b": np.array([True, False]),
        "ü": np.arange(6, dtype=np.uint8).reshape(1, 2, 3),
    }


def test_compact_equals_walker(tmp_path, monkeypatch):
    arrays = _arrays()
    p = _save(tmp_path / "m.onnx", [numpy_helper.from_array(v, k) for k, v in arrays.items()], doc="d")
    fast, slow = _open_both(p, monkeypatch)
    specs = {k: c.leaf for k, c in fast.level("").children.items()}
    assert specs == {k: c.leaf for k, c in slow.level("").children.items()}
    assert fast.metadata == slow.metadata and fast.metadata["graph_doc_string"] == "d"
    tree = formats.to_tree(fast)
    for k, v in arrays.items():
        assert torch.equal(tree[k], torch.from_numpy(v.copy())), k
    assert all(s.loader is None for s in specs.values())


def test_typed_and_external_fields_take_the_walker(tmp_path, monkeypatch):
    typed = helper.make_tensor("t", TensorProto.FLOAT, [2], [1.5, 2.5])  # float_data, not raw
    raw = numpy_helper.from_array(np.arange(4, dtype=np.int32), "r")
    p = _save(tmp_path / "t.onnx", [raw, typed])
    buf = memoryview(p.read_bytes())
    _, inits = ox.parse_model(buf, str(p), compact=True)
    assert [type(t).__name__ for t in inits] == ["tuple", "dict"]
    fast, slow = _open_both(p, monkeypatch)
    assert formats.to_tree(fast)["t"].tolist() == [1.5, 2.5]
    assert formats.to_tree(fast)["r"].tolist() == [0, 1, 2, 3]
    assert list(fast.level("").children) == list(slow.level("").children) == ["r", "t"]


def test_compact_tensor_edges():
    pb = bytes([0x08, 0x80, 0x01, 0x10, 2, 0x42, 0]) + bytes([0x4A, 0x80, 0x01]) + bytes(128)
    assert compact_tensor(memoryview(pb), 0, len(pb)) == ("", 2, (128,), 10, 128)
    assert compact_tensor(memoryview(pb), 0, len(pb) - 1) is None  # raw_data runs past the message
    assert compact_tensor(memoryview(pb), 0, 2) is None  # truncated varint
    neg = bytes([0x08]) + b"\xff" * 9 + b"\x01" + bytes([0x4A, 0])  # dims -1
    assert compact_tensor(memoryview(neg), 0, len(neg)) is None
    many = bytes([0x08, 1]) * 65 + bytes([0x4A, 0])
    assert compact_tensor(memoryview(many), 0, len(many)) is None
    assert compact_tensor(memoryview(bytes([0x0A, 1, 2, 0x4A, 0])), 0, 5) is None  # packed dims
    assert compact_tensor(memoryview(bytes([0x10, 1])), 0, 2) is None  # no raw_data
    assert compact_graph(memoryview(bytes([0x2A, 5]) + pb[:5]), 0, 7) is None


@pytest.mark.parametrize("bad", ["duplicate", "size"])
def test_bad_initializers_named_by_the_walker(tmp_path, bad):
    a = numpy_helper.from_array(np.arange(4, dtype=np.float32), "a")
    b = numpy_helper.from_array(np.arange(4, dtype=np.float32), "a" if bad == "duplicate" else "b")
    if bad == "size":
        b.dims[0] = 5
    p = _save(tmp_path / "bad.onnx", [a, b])
    with pytest.raises(BadArchiveError, match="duplicate initializer|raw_data holds 16 bytes"):
        ox.open_onnx(p)
