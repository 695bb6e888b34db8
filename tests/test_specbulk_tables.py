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
