"""HDF5 groups whose links are all plainly mapped datasets (formats/hdf5_walk.py's one-pass specs):
a flat root becomes a ``flat_source`` with the specs' columns, the same leaves as h5py says; groups
mixing such datasets with others keep h5py's order and take the level-by-level path."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

from tdz_numba import formats
from tdz_numba.formats.hdf5 import open_hdf5

h5py = pytest.importorskip("h5py")


def _h5py_leaves(p: Path, group: str = "/") -> dict[str, tuple[int, tuple[int, ...], np.ndarray]]:
    with h5py.File(p, "r") as f:
        g = f[group]
        return {k: (g[k].id.get_offset(), g[k].shape, g[k][()]) for k in g.keys()}


def _check_leaves(src, prefix: str, want: dict, tree: dict) -> None:
    children = src.level(prefix).children
    assert list(children) == list(want)
    for k, (offset, shape, value) in want.items():
        leaf = children[k].leaf
        assert leaf.offset == offset and leaf.shape == shape and leaf.loader is None, k
        assert torch.equal(tree[k], torch.from_numpy(value)), k


@pytest.mark.parametrize("uniform", [True, False])
def test_flat_root_is_a_flat_source_with_columns(tmp_path: Path, uniform: bool) -> None:
    p = tmp_path / "flat.h5"
    with h5py.File(p, "w") as f:
        f.attrs["note"] = "root"
        for i in range(40):
            shape = (3, 2) if uniform else (i % 4 + 1, 2)
            f.create_dataset(f"w{i:02d}", data=np.full(shape, i, np.float32 if i % 3 else np.int64))
    want = _h5py_leaves(p)
    src = open_hdf5(p)
    try:
        cols = src.spec_columns
        assert cols is not None
        leaves = [c.leaf for c in src.level("").children.values()]
        assert len(cols.specs) == len(leaves) and all(a is b for a, b in zip(cols.specs, leaves))
        assert src.metadata == {"note": "root"} and src.level("").meta == {"note": "root"}
        _check_leaves(src, "", want, formats.to_tree(src))
        if uniform:  # one shape object for every leaf
            assert len({id(s) for s in cols.shapes}) == 1
    finally:
        src.close()


def test_a_chunked_dataset_and_a_group_keep_their_places(tmp_path: Path) -> None:
    p = tmp_path / "mixed.h5"
    with h5py.File(p, "w") as f:
        for i in range(40):
            f.create_dataset(f"a{i:02d}", data=np.arange(4, dtype=np.float64) + i)
        f.create_dataset("a20x", data=np.arange(6, dtype=np.int32), chunks=(3,), compression="gzip")
        g = f.create_group("a30g")
        g.attrs["k"] = 1
        for i in range(20):
            g.create_dataset(f"b{i:02d}", data=np.full(2, i, np.int16))
    with h5py.File(p, "r") as f:
        order = list(f.keys())
    src = open_hdf5(p)
    try:
        assert getattr(src, "spec_columns", None) is None  # a sub-level: the tree's own path
        root = src.level("").children
        assert list(root) == order and root["a30g"].kind == "level"
        tree = formats.to_tree(src)
        assert tree["a20x"].tolist() == list(range(6))
        assert src.level(root["a30g"].path).meta == {"k": 1}
        _check_leaves(src, root["a30g"].path, _h5py_leaves(p, "a30g"), tree["a30g"])
        assert tree["a39"].tolist() == [39.0, 40.0, 41.0, 42.0]
    finally:
        src.close()


def test_chunked_datasets_only_among_many(tmp_path: Path) -> None:
    p = tmp_path / "chunked.h5"
    with h5py.File(p, "w") as f:
        for i in range(20):
            kw = {"chunks": (2,)} if i % 2 else {}
            f.create_dataset(f"c{i:02d}", data=np.arange(4, dtype=np.float32) * i, **kw)
    src = open_hdf5(p)
    try:
        assert getattr(src, "spec_columns", None) is None
        tree = formats.to_tree(src)
        assert list(tree) == [f"c{i:02d}" for i in range(20)]
        for i in range(20):
            assert tree[f"c{i:02d}"].tolist() == [0.0, i, 2.0 * i, 3.0 * i]
    finally:
        src.close()


def _naive_names(heap: bytes, offs: list[int]) -> list[str] | None:
    out = []
    for off in offs:
        end = heap.find(b"\0", off) if 0 <= off < len(heap) else -1
        if end < 0:
            return None
        out.append(heap[off:end].decode("utf-8", "surrogateescape"))
    return out


def test_heap_names_equal_one_by_one() -> None:
    import random

    from tdz_numba.formats.hdf5_objects import heap_names

    rng = random.Random(5)
    alphabet = [b"a", b"\0", b"\xc3\xa9", b"\xe2\x82", b"\xff", b"\x80", b"\xf0\x9f\x98\x80", b"z"]
    kinds = set()
    for _ in range(2000):
        heap = b"".join(rng.choice(alphabet) for _ in range(rng.randint(1, 30)))
        starts = [0] + [i + 1 for i, b in enumerate(heap) if b == 0]
        pick = [rng.choice(starts) for _ in range(rng.randint(1, 6))]
        if rng.random() < 0.3:  # inside a name, past the end, negative
            pick.append(rng.choice([rng.randrange(len(heap)), len(heap), -1]))
        want = _naive_names(heap, pick)
        assert heap_names(heap, np.array(pick, np.int64)) == want, (heap, pick)
        kinds.add(want is None)
    assert kinds == {True, False}


@pytest.mark.parametrize("soft", [False, True])
def test_the_scan_reads_the_symbol_tables_addresses(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, soft: bool
) -> None:
    """A plain old-style group hands the symbol table kernel's address column to the header scan
    (no list made back into an array); one with a soft link hands the hard links' addresses and
    the link's target: either way each dataset's header address is h5py's."""
    from tdz_numba.formats import hdf5_walk

    p = tmp_path / "links.h5"
    with h5py.File(p, "w", libver="earliest") as f:
        for i in range(40):
            f.create_dataset(f"w{i:02d}", data=np.full(3, i, np.float32))
        if soft:
            f["zz"] = h5py.SoftLink("/w07")
    with h5py.File(p, "r") as f:
        headers = {k: h5py.h5o.get_info(f[k].id).addr for k in f.keys()}
    want = _h5py_leaves(p)
    seen: list[np.ndarray] = []
    real = hdf5_walk.scan_datasets
    monkeypatch.setattr(
        hdf5_walk, "scan_datasets", lambda buf, arr, *a: seen.append(arr.copy()) or real(buf, arr, *a)
    )
    src = open_hdf5(p)
    try:
        _check_leaves(src, "", want, formats.to_tree(src))
    finally:
        src.close()
    (arr,) = seen
    order = [k for k in want if k != "zz"] + (["zz"] if soft else [])
    assert arr.tolist() == [headers[k] for k in order]  # (the superblock's base address is 0 here)
