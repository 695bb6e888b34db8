"""``column_extents`` (tdz/specbulk.py) decides the common case, every row inside its file, with a
few whole-column checks (``_all_inside``) and the rows one by one otherwise: the same
:class:`~tdz_numba.tdz.specbulk.Extents` as ``plain_extents`` of the specs either way, every
bound exact (a leaf ending on the file's last byte passes, one byte more fails)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from tdz_numba.formats._flat import make_specs
from tdz_numba.tdz import specbulk
from tdz_numba.tdz.sources import MappedFile

SIZE = 4096


def _file(tmp_path, name="raw.bin", size=SIZE):
    p = tmp_path / name
    p.write_bytes(bytes(range(256)) * (size // 256))
    return MappedFile.open(p)


def _same(cols, files):
    """``column_extents`` of ``cols`` equals ``plain_extents`` of its specs, field by field."""
    mine = specbulk.column_extents(cols, files)
    assert mine is not None
    plain = specbulk.plain_extents(cols.specs, files)
    for field, x, y in zip(specbulk.Extents._fields, mine, plain):
        if isinstance(y, np.ndarray):
            assert isinstance(x, np.ndarray) and x.dtype == y.dtype and np.array_equal(x, y), field
        else:
            assert list(x) == list(y), field
    return mine


def _columns(dtypes, shapes, offsets, nbytes, file=0):
    n = len(shapes)
    return make_specs([f"k{i}" for i in range(n)], dtypes, shapes, file, offsets, nbytes, ["x"] * n).columns


@pytest.mark.parametrize(
    "dtypes",
    [[torch.float32] * 4, [torch.float32, torch.float16, torch.int64, torch.uint8]],
)
@pytest.mark.parametrize("shapes", [[(2, 3)] * 4, [(2, 3), (6,), (1, 2, 3), (3, 2)]])
def test_every_row_inside(tmp_path, dtypes, shapes):
    f = _file(tmp_path)
    try:
        need = [6 * d.itemsize for d in dtypes]
        offsets = [0, 100, 1000, SIZE - need[3]]  # the last one ends on the file's last byte
        ext = _same(_columns(dtypes, shapes, offsets, need), [f])
        assert ext.ok.all() and ext.nbytes.tolist() == need
    finally:
        f.close()


@pytest.mark.parametrize(
    "bad",
    [
        {"offsets": SIZE - 23},  # one byte past the end
        {"nbytes": 23},  # fewer bytes than the shape needs
        {"nbytes": SIZE},  # more bytes than the file has after the offset
        {"offsets": -1},
        {"offsets": 1 << 56},
        {"nbytes": 1 << 57},
        {"offsets": (1 << 63) - 8},  # offset + bytes wraps past 2**63 in int64
        {"shape": (0, 3)},  # no elements: the one-by-one path makes it
    ],
)
def test_a_bad_row_is_found(tmp_path, bad):
    f = _file(tmp_path)
    try:
        shapes = [(2, 3)] * 4
        offsets, nbytes = [0, 24, 48, 72], [24] * 4
        if "offsets" in bad:
            offsets[2] = bad["offsets"]
        if "nbytes" in bad:
            nbytes[2] = bad["nbytes"]
        if "shape" in bad:
            shapes[2] = bad["shape"]
        ext = _same(_columns([torch.float32] * 4, shapes, offsets, nbytes), [f])
        assert ext.ok.tolist() == [True, True, False, True]
        assert ext.nbytes.tolist() == [24, 24, 0, 24]
    finally:
        f.close()


def test_several_files(tmp_path):
    """A file column over two files (each row checked against its own file's size)."""
    a, b = _file(tmp_path, "a.bin"), _file(tmp_path, "b.bin", 1024)
    try:
        ext = _same(_columns([torch.float32] * 3, [(4,)] * 3, [0, 1008, 2000], [16] * 3, [0, 1, 0]), [a, b])
        assert ext.ok.all()
        ext = _same(_columns([torch.float32] * 3, [(4,)] * 3, [0, 1009, 2000], [16] * 3, [0, 1, 0]), [a, b])
        assert ext.ok.tolist() == [True, False, True]
    finally:
        a.close()
        b.close()


def test_numpy_int_columns(tmp_path):
    """Columns of numpy ints (not what readers hand on, still taken): the same extents."""
    f = _file(tmp_path)
    try:
        offsets = list(np.array([0, 24, 48], np.int64))
        ext = _same(_columns([torch.float32] * 3, [(2, 3)] * 3, offsets, [np.int64(24)] * 3), [f])
        assert ext.ok.all()
    finally:
        f.close()


def test_bool_dimension_refused(tmp_path):
    """A dimension that is a bool (equal to 1, not an int) is not taken from the columns, even
    where an equal int dimension of another shape would merge with it in a set of values."""
    f = _file(tmp_path)
    try:
        cols = _columns([torch.float32] * 2, [(2, 1), (3, True)], [0, 64], [8, 12])
        assert specbulk.column_extents(cols, [f]) is None
    finally:
        f.close()
