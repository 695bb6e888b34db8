"""Unevenly spaced 1-D leaves made by one ``split_with_sizes`` per typed view (tdz/viewruns.py
``_made_split``): the steps of an HDF5 file's data blocks, which find no runs; every leaf is what
``tensor_from_spec`` makes (storage, offset, shape, strides) and has its own version counter."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from tdz_numba.tdz import specbulk, viewruns
from tdz_numba.tdz.sources import MappedFile, TensorSpec, tensor_from_spec
from tdz_numba.tdz.specbulk import spec_views


def _layout(n, seed, *, shuffle=False, overlap=False, shifts=False):
    """Offsets of ``n`` leaves of 6 float32 (24 bytes), gaps of 0 or 8 bytes between them."""
    rng = np.random.default_rng(seed)
    gaps = np.where(rng.random(n) < 0.2, 8, 0)
    if overlap:
        gaps[n // 2] = -8  # leaf n//2 + 1 starts inside leaf n//2
    off = 16 + np.concatenate(([0], np.cumsum(24 + gaps[:-1])))
    if shifts:
        off[n // 3 :] += 1  # a second typed view (byte shift 1), its own span
    order = rng.permutation(n) if shuffle else np.arange(n)
    return off[order].tolist()


@pytest.mark.parametrize("shuffle", [False, True])
@pytest.mark.parametrize("overlap", [False, True])
@pytest.mark.parametrize("shifts", [False, True])
def test_split_equals_one_by_one(tmp_path, monkeypatch, shuffle, overlap, shifts):
    n = specbulk._RUNS_FROM + 100
    offsets = _layout(n, 7, shuffle=shuffle, overlap=overlap, shifts=shifts)
    p = tmp_path / "raw.bin"
    p.write_bytes(np.arange((max(offsets) + 64) // 4, dtype=np.float32).tobytes())
    calls = []
    real = viewruns._made_split
    monkeypatch.setattr(viewruns, "_made_split", lambda *a: calls.append(got := real(*a)) or got)
    f = MappedFile.open(p)
    try:
        specs = [TensorSpec(f"k{i}", torch.float32, (6,), None, 0, o, 24) for i, o in enumerate(offsets)]
        made = spec_views(specs, [f])
        for s, t in zip(specs, made):
            one = tensor_from_spec(s, [f])
            assert t.shape == one.shape and t.stride() == one.stride(), s.key
            assert t.data_ptr() == one.data_ptr() and torch.equal(t, one), s.key
            assert t.untyped_storage().data_ptr() == one.untyped_storage().data_ptr(), s.key
            assert t.storage_offset() == one.storage_offset(), s.key
            assert t._base is None and not t._is_view(), s.key
        before = [t._version for t in made]
        made[5].add_(1)
        assert [t._version for t in made] == [v + (i == 5) for i, v in enumerate(before)]
        # the split is what made them, except where two leaves overlap (one as_strided each)
        assert len(calls) == 1 and (calls[0] is None) == overlap
    finally:
        f.close()


def test_bad_extent_still_refused_among_uneven(tmp_path):
    """A leaf past the end of the file among unevenly spaced ones comes back as None (the
    one-by-one path names the error); the others are views."""
    n = specbulk._RUNS_FROM + 10
    offsets = _layout(n, 3)
    p = tmp_path / "raw.bin"
    p.write_bytes(np.zeros((max(offsets) + 24) // 4, np.float32).tobytes())
    f = MappedFile.open(p)
    try:
        specs = [TensorSpec(f"k{i}", torch.float32, (6,), None, 0, o, 24) for i, o in enumerate(offsets)]
        specs[7] = TensorSpec("bad", torch.float32, (6,), None, 0, f.size - 8, 24)
        made = spec_views(specs, [f])
        assert made[7] is None
        assert all(t is not None and t.shape == (6,) for i, t in enumerate(made) if i != 7)
    finally:
        f.close()
