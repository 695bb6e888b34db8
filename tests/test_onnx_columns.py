"""Compact ONNX graphs as columns (formats/onnx_bulk.py Columns, formats/onnx_scan.py graph_columns):
the same initializers as the tuple readers, the same specs as bulk_specs, the same refusals."""

from __future__ import annotations

import numpy as np
import pytest
import torch

onnx = pytest.importorskip("onnx")
from onnx import helper, numpy_helper  # noqa: E402

from tdz_numba import formats  # noqa: E402
from tdz_numba.formats import onnx as ox  # noqa: E402
from tdz_numba.formats import onnx_bulk, onnx_scan  # noqa: E402
from tdz_numba.jit import policy  # noqa: E402


def _graph(arrays: dict[str, np.ndarray]) -> bytes:
    inits = [numpy_helper.from_array(v, k) for k, v in arrays.items()]
    return helper.make_graph([], "g", [], [], initializer=inits).SerializeToString()


CASES = {
    "uniform": {f"u{i}": np.full((2, 3), i, np.float16) for i in range(20)},
    "scalars": {f"s{i}": np.array(i, np.int64) for i in range(20)},
    "ranks": {f"r{i}": np.ones((1,) * (i % 3 + 1), np.float32) for i in range(20)},
    "shapes": {f"h{i}": np.ones((i % 4 + 1, 2), np.int8 if i % 2 else np.float64) for i in range(20)},
    "empty": {},
}


@pytest.mark.parametrize("case", list(CASES))
def test_columns_equal_the_tuples(case: str) -> None:
    g = _graph(CASES[case])
    with policy.forced("never"):
        want = onnx_bulk.compact_graph(memoryview(g), 0, len(g))
        twin = onnx_bulk.compact_graph(memoryview(g), 0, len(g), True)
    got = onnx_scan.graph_columns(memoryview(g), 0, len(g))
    assert want is not None and got is not None and twin is not None
    assert [t[0] for t in want[2]] == list(CASES[case])
    for cols in (got[2], twin[2]):
        assert cols.tuples() == want[2]
        assert cols.types.dtype == cols.offsets.dtype == cols.lengths.dtype == np.int64
        assert cols.distinct is None or cols.distinct == set(cols.shapes)
    assert got[:2] == want[:2] and got[3] == want[3]
    if case in ("uniform", "scalars"):  # one shape object for every initializer
        assert len({id(s) for s in got[2].shapes}) == 1 and got[2].distinct == {got[2].shapes[0]}
    dtypes = onnx_bulk.torch_dtypes(ox.ONNX_DTYPES)
    size = len(g)
    assert onnx_bulk.column_specs(got[2], dtypes, size) == onnx_bulk.bulk_specs(want[2], dtypes, size)


def test_column_checks_refuse() -> None:
    dtypes = onnx_bulk.torch_dtypes(ox.ONNX_DTYPES)
    good = [("a", 1, (2,), 10, 8), ("b", 10, (3,), 18, 6)]
    cols = onnx_bulk.Columns.of(good)
    assert list(onnx_bulk.column_specs(cols, dtypes, 24)) == ["a", "b"]
    assert onnx_bulk.column_specs(cols, dtypes, 23) is None  # past the end of the file
    for bad in (
        [good[0], ("a", 10, (3,), 18, 6)],  # a name twice
        [good[0], ("b", 8, (3,), 18, 6)],  # STRING: not a raw type
        [good[0], ("b", 10, (3,), 18, 5)],  # raw_data one byte short
        [good[0], ("b", 10, (2**62, 2), 18, 6)],  # a shape of 2**63 bytes or more
    ):
        assert onnx_bulk.column_specs(onnx_bulk.Columns.of(bad), dtypes, 100) is None
    assert onnx_bulk.column_specs(onnx_bulk.Columns.of([]), dtypes, 100) is None


def test_open_kernel_and_twin_agree(tmp_path) -> None:
    arrays = CASES["shapes"]
    p = tmp_path / "m.onnx"
    inits = [numpy_helper.from_array(v, k) for k, v in arrays.items()]
    onnx.save(helper.make_model(helper.make_graph([], "g", [], [], initializer=inits)), str(p))
    with policy.forced("always"):
        fast = ox.open_onnx(p)
    with policy.forced("never"):
        twin = ox.open_onnx(p)
    try:
        a, b = fast.level("").children, twin.level("").children
        assert list(a) == list(b) == list(arrays)
        assert [c.leaf for c in a.values()] == [c.leaf for c in b.values()]
        assert fast.spec_columns is not None and fast.metadata == twin.metadata
        info, inits = ox.parse_model(memoryview(p.read_bytes()), str(p), compact=True)
        assert [t[0] for t in inits] == list(arrays) and all(type(t) is tuple for t in inits)
        tree = formats.to_tree(fast)
        for k, v in arrays.items():
            assert torch.equal(tree[k], torch.from_numpy(v)), k
    finally:
        fast.close()
        twin.close()
