"""The columns a flat reader made its specs from (formats/_flat.py ``make_specs``,
``SpecColumns``) checked in place of the specs (tdz/specbulk.py ``column_extents``): the same
extents, and a bad extent is still refused with the one-by-one path's error."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from tdz_numba.archive.foreign import spec_tensors
from tdz_numba.errors import BadArchiveError
from tdz_numba.formats._flat import flat_source, make_specs
from tdz_numba.tdz import specbulk
from tdz_numba.tdz.sources import MappedFile, tensor_from_spec


def _source(tmp_path, n, *, bad=None, nbytes=24):
    p = tmp_path / "raw.bin"
    p.write_bytes(np.arange(n * 6 + 4, dtype=np.float32).tobytes())
    f = MappedFile.open(p)
    offsets = [16 + 24 * i for i in range(n)]
    sizes = [nbytes] * n
    if bad is not None:
        offsets[bad] = f.size - 8  # 24 bytes claimed, 8 left in the file
    specs = make_specs(
        [f"k{i}" for i in range(n)], [torch.float32] * n, [(2, 3)] * n, 0, offsets, sizes, ["F32"] * n
    )
    return flat_source("raw", p, specs, files=[f]), f


@pytest.fixture
def spy(monkeypatch):
    got = []
    monkeypatch.setattr(specbulk, "SMALL", 0)  # the bulk path at every count (see test_small_views)
    real = specbulk.column_extents
    monkeypatch.setattr(specbulk, "column_extents", lambda *a: got.append(r := real(*a)) or r)
    return got


@pytest.mark.parametrize("n", [1, 300])
def test_columns_give_the_same_views(tmp_path, spy, n):
    src, f = _source(tmp_path, n)
    try:
        leaves = [c.leaf for c in src.level("").children.values()]
        made = spec_tensors(src, leaves)
        assert len(spy) == 1 and spy[0] is not None and spy[0].ok.all()
        plain = specbulk.plain_extents(leaves, src.files)
        for x, y in zip(spy[0], plain):
            assert np.array_equal(x, y) if isinstance(x, np.ndarray) else list(x) == list(y)
        for s, t in zip(leaves, made):
            one = tensor_from_spec(s, src.files)
            assert t.shape == one.shape and t.stride() == one.stride() and t.data_ptr() == one.data_ptr()
            assert torch.equal(t, one)
    finally:
        f.close()


@pytest.mark.parametrize("n", [1, 300])
@pytest.mark.parametrize("short", [False, True])
def test_bad_extent_from_columns_still_refused(tmp_path, spy, n, short):
    """A reader's column claiming bytes past the end of the file (or fewer than the shape needs)
    is refused: the column check marks it, the one-by-one path raises."""
    src, f = _source(tmp_path, n, bad=None if short else n - 1, nbytes=20 if short else 24)
    try:
        leaves = [c.leaf for c in src.level("").children.values()]
        with pytest.raises(BadArchiveError):
            spec_tensors(src, leaves)
        assert len(spy) == 1 and spy[0] is not None and not spy[0].ok[n - 1]
    finally:
        f.close()


def test_columns_unused_when_leaves_differ(tmp_path, spy):
    """Leaves that are not the very specs the columns were made into: the specs are checked."""
    src, f = _source(tmp_path, 20)
    try:
        leaves = [c.leaf for c in src.level("").children.values()]
        leaves[3] = leaves[3]._replace(offset=f.size)  # past the end, not in the columns
        with pytest.raises(BadArchiveError):
            spec_tensors(src, leaves)
        assert spy == []
        assert all(t is not None for t in spec_tensors(src, leaves[:3]))  # fewer leaves: specs checked
        assert spy == []
    finally:
        f.close()


def test_columns_of_iterators_fall_back(tmp_path, spy):
    """Columns handed to ``make_specs`` as iterators (used up making the specs): not taken,
    the specs are checked."""
    p = tmp_path / "raw.bin"
    p.write_bytes(np.arange(64, dtype=np.float32).tobytes())
    f = MappedFile.open(p)
    try:
        n = 10
        specs = make_specs(
            [f"k{i}" for i in range(n)],
            iter([torch.float32] * n),
            iter([(2,)] * n),
            0,
            iter(range(0, 8 * n, 8)),
            iter([8] * n),
            ["F32"] * n,
        )
        src = flat_source("raw", p, specs, files=[f])
        made = spec_tensors(src, list(specs.values()))
        assert [t.tolist() for t in made] == [[2.0 * i, 2.0 * i + 1] for i in range(n)]
        assert spy == [None]
    finally:
        f.close()
