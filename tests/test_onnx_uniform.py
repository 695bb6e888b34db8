"""ONNX files whose initializers all have one type and one shape (formats/onnx_bulk.py's repeated
columns): the same specs as the walker, and a short ``raw_data`` among them still refused."""

import numpy as np
import pytest

onnx = pytest.importorskip("onnx")
from onnx import helper, numpy_helper  # noqa: E402

from tdz_numba.errors import BadArchiveError  # noqa: E402
from tdz_numba.formats import onnx as ox  # noqa: E402


def _save(path, inits):
    onnx.save(helper.make_model(helper.make_graph([], "g", [], [], initializer=inits)), str(path))
    return path


def test_uniform_initializers_equal_the_walker(tmp_path, monkeypatch):
    arrays = {f"p{i:02d}": np.full((2, 3), i, np.float16) for i in range(30)}
    p = _save(tmp_path / "u.onnx", [numpy_helper.from_array(v, k) for k, v in arrays.items()])
    fast = ox.open_onnx(p)
    with monkeypatch.context() as m:
        m.setattr(ox, "compact_graph", lambda *a: None)
        m.setattr(ox, "compact_tensor", lambda *a: None)
        slow = ox.open_onnx(p)
    a, b = fast.level("").children, slow.level("").children
    assert list(a) == list(b) == list(arrays)
    assert [c.leaf for c in a.values()] == [c.leaf for c in b.values()]


@pytest.mark.parametrize("where", [0, 17, 29])
def test_one_short_raw_data_among_equal_shapes_is_refused(tmp_path, where):
    inits = [numpy_helper.from_array(np.arange(4, dtype=np.float32), f"p{i:02d}") for i in range(30)]
    inits[where].raw_data = inits[where].raw_data[:12]
    p = _save(tmp_path / "bad.onnx", inits)
    with pytest.raises(BadArchiveError, match="raw_data holds 12 bytes"):
        ox.open_onnx(p)
