"""Runs of leaves made at once by ``spec_views`` (tdz/specbulk.py ``_made_in_runs``): packed
C-contiguous runs are one block split along its first dimension, other runs an ``unbind``; every
leaf is what ``tensor_from_spec`` makes (storage, offset, shape, strides) and has its own version
counter."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from tdz_numba.tdz import specbulk
from tdz_numba.tdz.sources import MappedFile, TensorSpec, tensor_from_spec
from tdz_numba.tdz.specbulk import spec_views


@pytest.mark.parametrize("shape", [(5,), (3, 4), (2, 1, 3), ()])
@pytest.mark.parametrize("gap", [0, 8])
def test_runs_equal_one_by_one(tmp_path, shape, gap):
    n = specbulk._RUNS_FROM + 40  # runs are looked for from _RUNS_FROM leaves on
    numel = int(np.prod(shape))
    step = numel * 4 + gap
    raw = np.arange((n * step + 16) // 4, dtype=np.float32).tobytes()
    p = tmp_path / "raw.bin"
    p.write_bytes(raw)
    f = MappedFile.open(p)
    try:
        specs = [
            TensorSpec(f"k{i}", torch.float32, shape, None, 0, 4 + i * step, numel * 4) for i in range(n)
        ]
        specs.append(TensorSpec("odd", torch.float32, (2, 2), None, 0, 2, 16))  # unaligned, alone
        made = spec_views(specs, [f])
        for s, t in zip(specs, made):
            one = tensor_from_spec(s, [f])
            assert t.shape == one.shape and t.stride() == one.stride(), s.key
            assert t.data_ptr() == one.data_ptr() and torch.equal(t, one), s.key
            assert t._base is None and not t._is_view(), s.key
        before = [t._version for t in made]
        made[3].add_(1)
        assert [t._version for t in made] == [v + (i == 3) for i, v in enumerate(before)]
    finally:
        f.close()


@pytest.mark.parametrize("odd", [(2, -1), (True, 2), (1.0, 2), (np.int64(1), 2), (2, [1])])
@pytest.mark.parametrize("mixed", [False, True])
def test_odd_dimensions_are_left_to_the_one_by_one_path(tmp_path, odd, mixed):
    """Shapes whose dimensions are not plain non-negative ints come back as None, whether every
    spec has the same one (the one-distinct-shape path) or they sit next to equal int shapes."""
    p = tmp_path / "raw.bin"
    p.write_bytes(np.arange(256, dtype=np.float32).tobytes())
    f = MappedFile.open(p)
    try:
        specs = [TensorSpec(f"k{i}", torch.float32, odd, None, 0, 8 * i, 8) for i in range(20)]
        if mixed:
            specs[::2] = [TensorSpec(f"g{i}", torch.float32, (1, 2), None, 0, 8 * i, 8) for i in range(10)]
        out = spec_views(specs, [f])
        for s, t in zip(specs, out):
            if s.shape is odd:
                assert t is None, s.key
            else:
                assert t is not None and torch.equal(t, tensor_from_spec(s, [f])), s.key
    finally:
        f.close()


@pytest.mark.parametrize("n", [146, 255, 256])
def test_runs_looked_for_from_runs_from(tmp_path, monkeypatch, n):
    """Below ``_RUNS_FROM`` leaves no runs are looked for (the search costs what they save); from
    it on they are; the leaves are the same either way."""
    p = tmp_path / "raw.bin"
    p.write_bytes(np.arange(4 * n, dtype=np.float32).tobytes())
    calls = []
    real = specbulk._made_in_runs

    def spy(*a):
        calls.append(len(a[-1]))
        return real(*a)

    monkeypatch.setattr(specbulk, "_made_in_runs", spy)
    f = MappedFile.open(p)
    try:
        specs = [TensorSpec(f"k{i}", torch.float32, (2, 2), None, 0, 16 * i, 16) for i in range(n)]
        made = spec_views(specs, [f])
        assert [t.tolist() for t in made] == [[[4 * i, 4 * i + 1], [4 * i + 2, 4 * i + 3]] for i in range(n)]
    finally:
        f.close()
    assert calls == ([n] if n >= specbulk._RUNS_FROM else [])
