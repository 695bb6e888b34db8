"""plain_extents computes per distinct (shape, strides): values that compare equal across types
(True == 1, 1.0 == 1) must not share a verdict."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch

from tdz_numba.tdz.sources import MappedFile, TensorSpec
from tdz_numba.tdz.specbulk import plain_extents, spec_views


def _file(tmp_path: Path) -> MappedFile:
    p = tmp_path / "raw.bin"
    p.write_bytes(np.arange(64, dtype=np.float32).tobytes())
    return MappedFile.open(p)


def test_bool_and_float_strides_are_refused_next_to_equal_ints(tmp_path: Path) -> None:
    f = _file(tmp_path)
    try:
        specs = [
            TensorSpec("a", torch.float32, (2,), (1,), 0, 0, 8),
            TensorSpec("b", torch.float32, (2,), (True,), 0, 8, 8),
            TensorSpec("c", torch.float32, (2,), (1.0,), 0, 16, 8),
            TensorSpec("d", torch.float32, (2, 2), (1, 2), 0, 24, 16),
            TensorSpec("e", torch.float32, (2,), (1,), 0, 40, 8),
        ]
        ext = plain_extents(specs, [f])
        assert ext.ok.tolist() == [True, False, False, True, True]
        assert ext.dense.tolist()[0] and not ext.dense[3] and ext.strides[3] == (1, 2)
        views = spec_views(specs, [f])
        assert views[1] is None and views[2] is None
        assert views[3].tolist() == [[6.0, 8.0], [7.0, 9.0]] and views[4].tolist() == [10.0, 11.0]
    finally:
        f.close()


def test_shared_shape_and_strides_get_their_own_tensors(tmp_path: Path) -> None:
    f = _file(tmp_path)
    try:
        specs = [TensorSpec(f"k{i}", torch.float32, (2, 2), (2, 1), 0, 16 * i, 16) for i in range(4)]
        ext = plain_extents(specs, [f])
        assert ext.ok.all() and ext.dense.all() and ext.numels.tolist() == [4] * 4
        views = spec_views(specs, [f])
        views[0].add_(1)
        assert [v._version for v in views] == [1, 0, 0, 0]
        assert views[3].flatten().tolist() == [12.0, 13.0, 14.0, 15.0]
    finally:
        f.close()


def test_runs_made_by_unbind_match_one_by_one(tmp_path: Path) -> None:
    """Leaves in arithmetic progression (two interleaved byte shifts, a gap, another shape) are made
    in runs: each the tensor tensor_from_spec makes, each its own version counter."""
    from tdz_numba.tdz.sources import tensor_from_spec

    p = tmp_path / "raw.bin"
    p.write_bytes(bytes(range(256)) * 64)
    f = MappedFile.open(p)
    try:
        specs = []
        for i in range(40):  # 10-byte steps: float16 leaves alternate between byte shifts 0 and 1
            specs.append(TensorSpec(f"a{i}", torch.float16, (2,), None, 0, 3 + 10 * i, 4))
        for i in range(30):  # 2x3 int16 leaves every 16 bytes, then one out of step
            specs.append(TensorSpec(f"b{i}", torch.int16, (2, 3), None, 0, 1000 + 16 * i, 12))
        specs.append(TensorSpec("odd", torch.int16, (2, 3), None, 0, 2001, 12))
        specs.append(TensorSpec("t", torch.int16, (3, 2), (1, 3), 0, 3000, 12))
        got = spec_views(specs, [f])
        want = [tensor_from_spec(s, [f]) for s in specs]
        for g, w in zip(got, want):
            assert g.dtype == w.dtype and g.shape == w.shape and g.stride() == w.stride()
            assert g.data_ptr() == w.data_ptr() and g.numpy().tobytes() == w.numpy().tobytes()
        got[5].add_(1)
        got[45].add_(1)
        assert [t._version for t in got[:7]] == [0, 0, 0, 0, 0, 1, 0]
        assert [t._version for t in got[44:47]] == [0, 1, 0]
        assert not any(t._is_view() for t in got)
    finally:
        f.close()


def test_given_contiguous_strides_take_the_dense_path(tmp_path: Path) -> None:
    """Strides given and C-contiguous (a .pt state dict) give what strides=None gives, through the
    dense path (no per-(shape, strides) table); a bool, a list or other strides keep the general one."""
    from tdz_numba.tdz import specbulk

    f = _file(tmp_path)
    try:
        shapes = [(2, 3), (4,), (2, 1, 2), (2, 3)]
        offs = [0, 24, 40, 56]
        none = [
            TensorSpec(str(i), torch.float32, s, None, 0, o, 4 * int(np.prod(s)))
            for i, (s, o) in enumerate(zip(shapes, offs))
        ]
        given = [s._replace(strides=specbulk._contiguous_of([s.shape])[0]) for s in none]
        assert specbulk._given_contiguous(shapes, [s.strides for s in given], set(shapes))
        a, b = plain_extents(none, [f]), plain_extents(given, [f])
        for x, y in zip(a, b):
            assert (x == y).all() if isinstance(x, np.ndarray) else x == y
        for t, u in zip(spec_views(none, [f]), spec_views(given, [f])):
            assert t.tolist() == u.tolist() and t.stride() == u.stride()
            assert t.storage_offset() == u.storage_offset()
        for row, st in [(1, None), (1, (True,)), (1, [1]), (0, (1, 2))]:  # None, bool, list, transposed
            case = [s.strides for s in given]
            case[row] = st
            assert not specbulk._given_contiguous(shapes, case, set(shapes))
    finally:
        f.close()
