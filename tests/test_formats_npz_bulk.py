""".npz bulk path (every member's .npy header gathered at once, each distinct header parsed
once) against the per-member path: the same specs, or it declines and the per-member path decides."""

import numpy as np
import pytest
import torch

from tdz_numba import formats
from tdz_numba.errors import BadArchiveError
from tdz_numba.formats import numpy_fmt
from tdz_numba.zipfmt.index import ArchiveIndex


def _specs(path, monkeypatch=None):
    src = numpy_fmt.open_npz(path)
    try:
        return {k: c.leaf for k, c in src.level("").children.items()}, formats.to_tree(src)
    finally:
        src.close()


def _per_member(path, monkeypatch):
    with monkeypatch.context() as m:
        m.setattr(numpy_fmt, "_bulk_npz", lambda *a: None)
        return _specs(path)


def _bulk(path):
    index = ArchiveIndex(path)
    f = numpy_fmt.MappedFile.open(path)
    try:
        return numpy_fmt._bulk_npz(index, f, str(path))
    finally:
        f.close()
        index.close()


def test_bulk_equals_per_member(tmp_path, monkeypatch):
    arrays = {
        "scalar": np.float64(2.5) * np.ones(()),
        "empty": np.zeros((0, 3), np.float16),
        "f": np.asfortranarray(np.arange(12, dtype=np.float32).reshape(3, 4)),
        "i8": np.arange(-3, 3, dtype=np.int8),
        "b": np.array([True, False]),
        **{f"w.{i}": np.arange(i + 1, dtype=np.int16) for i in range(40)},  # 40 shapes
        **{f"same.{i}": np.full(5, i, np.float16) for i in range(30)},  # one header, 30 members
    }
    p = tmp_path / "a.npz"
    np.savez(p, **arrays)
    bulk = _bulk(p)
    assert bulk is not None
    specs, tree = _specs(p)
    slow_specs, slow_tree = _per_member(p, monkeypatch)
    assert specs == slow_specs == bulk
    assert list(specs) == list(arrays)
    for k, v in arrays.items():
        assert torch.equal(tree[k], torch.from_numpy(np.ascontiguousarray(v)).reshape(v.shape)), k
        assert tree[k].stride() == slow_tree[k].stride()
    assert specs["f"].strides == (1, 3)


@pytest.mark.parametrize("kind", ["compressed", "swapped"])
def test_bulk_declines_what_the_per_member_path_reads(tmp_path, monkeypatch, kind):
    p = tmp_path / "d.npz"
    a = np.arange(6, dtype=np.float32).reshape(2, 3)
    if kind == "compressed":
        np.savez_compressed(p, a=a, b=a + 1)
    else:
        np.savez(p, a=a.astype(">f4"), b=a + 1)
    assert _bulk(p) is None
    _, tree = _specs(p)
    assert torch.equal(tree["a"], torch.from_numpy(a)) and torch.equal(tree["b"], torch.from_numpy(a + 1))


def _patch_member(p, name, old: bytes, new: bytes):
    raw = bytearray(p.read_bytes())
    at = raw.index(old, raw.index(name.encode()))  # in the member's local copy, after its local name
    raw[at : at + len(old)] = new
    p.write_bytes(bytes(raw))


@pytest.mark.parametrize(
    "old, new, match",
    [
        (b"'descr': '<f4'", b"'descr': '<X4'", "descr"),
        (b"(2, 3)", b"(2, 9)", "needs 72 bytes"),
        (b"\x93NUMPY", b"\x93NUMPX", "not a .npy"),
        (b"'fortran_order': False", b"'fortran_order': 0    ", "fortran_order"),
    ],
)
def test_bad_member_header_is_named(tmp_path, old, new, match):
    p = tmp_path / "bad.npz"
    a = np.arange(6, dtype=np.float32).reshape(2, 3)
    np.savez(p, ok=a, bad=a)
    _patch_member(p, "bad.npy", old, new)
    assert _bulk(p) is None
    with pytest.raises(BadArchiveError, match=match) as info:
        numpy_fmt.open_npz(p)
    assert "bad.npy" in str(info.value)
