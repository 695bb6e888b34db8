"""The Numba graph scan (formats/onnx_scan.py) against its oracle, the Python compact_graph of
formats/onnx_bulk.py: the same result (or None) on real graphs, every prefix and random mutations."""

from __future__ import annotations

import random

import numpy as np
import pytest

from tdz_numba.formats import onnx_bulk, onnx_scan
from tdz_numba.jit import policy

onnx = pytest.importorskip("onnx")


def _graph_bytes(arrays: dict[str, np.ndarray], name: str = "weights") -> bytes:
    from onnx import helper, numpy_helper

    inits = [numpy_helper.from_array(v, k) for k, v in arrays.items()]
    return helper.make_graph([], name, [], [], initializer=inits, doc_string="doc").SerializeToString()


def _python(buf: bytes, start: int, end: int) -> object:
    with policy.forced("never"):
        return onnx_bulk.compact_graph(memoryview(buf), start, end)


ARRAYS = {
    "w": np.arange(6, dtype=np.float32).reshape(2, 3),
    "ünï": np.ones((1, 2, 1, 2), np.float16),
    "": np.zeros(3, np.int64),
    "s": np.array(2.5, np.float64),
    "e": np.zeros((0, 4), np.int8),
}


def test_same_as_python_on_a_real_graph() -> None:
    g = _graph_bytes(ARRAYS)
    want = _python(g, 0, len(g))
    assert want is not None and [t[0] for t in want[2]] == list(ARRAYS)
    assert onnx_scan.compact_graph(memoryview(g), 0, len(g)) == want
    with policy.forced("always"):
        assert onnx_bulk.compact_graph(memoryview(g), 0, len(g)) == want


def test_many_initializers_in_one_rank_and_mixed() -> None:
    arrays = {f"p.{i}": np.full((i % 3 + 1,), i, np.float32) for i in range(500)}
    g = _graph_bytes(arrays)
    assert onnx_scan.compact_graph(memoryview(g), 0, len(g)) == _python(g, 0, len(g))
    same = {f"q{i}": np.full((2, 2), i, np.int32) for i in range(300)}
    g = _graph_bytes(same)
    got = onnx_scan.compact_graph(memoryview(g), 0, len(g))
    assert got == _python(g, 0, len(g)) and got is not None and got[2][7][2] == (2, 2)


def test_names_with_nul_or_bad_utf8_decode_as_python_does() -> None:
    g = bytearray(_graph_bytes({"ab": np.ones(2, np.float32), "cd": np.ones(1, np.float32)}))
    i = g.find(b"ab")
    g[i : i + 2] = b"a\x00"
    j = g.find(b"cd")
    g[j : j + 2] = b"\xff\xfe"
    got = onnx_scan.compact_graph(memoryview(bytes(g)), 0, len(g))
    assert got == _python(bytes(g), 0, len(g))
    assert got is not None and [t[0] for t in got[2]] == ["a\x00", "\ufffd\ufffd"]


def test_prefixes_and_mutations_agree() -> None:
    g = _graph_bytes(ARRAYS)
    for k in range(len(g)):
        assert onnx_scan.compact_graph(memoryview(g), 0, k) == _python(g, 0, k), k
    rng = random.Random(3)
    seen = set()
    for _ in range(3000):
        b = bytearray(g)
        for _ in range(rng.randint(1, 3)):
            b[rng.randrange(len(b))] = rng.choice([rng.randrange(256), 0x08, 0x10, 0x42, 0x4A, 0xFF, 0x80])
        data = bytes(b)
        want = _python(data, 0, len(data))
        assert onnx_scan.compact_graph(memoryview(data), 0, len(data)) == want
        seen.add(want is None)
    assert seen == {True, False}
