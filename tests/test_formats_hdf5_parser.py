"""The HDF5 reader's own parser (superblock, object headers, group links) against h5py, bit for bit.

Files written by h5py with many options and real files other tools wrote
(tests/fixtures/hdf5_real) are read by the reader and by h5py and compared leaf by
leaf (tests/hdf5_oracle.py); the plain contiguous datasets must be mapped by the
reader itself (no h5py call) at h5py's own offset. Damaged headers end in status
codes or BadArchiveError, never a loop.
"""

from __future__ import annotations

import builtins
from pathlib import Path

import numpy as np
import pytest
from hdf5_oracle import compare

from tdz_numba.errors import BadArchiveError, UnsupportedError
from tdz_numba.formats.hdf5 import open_hdf5
from tdz_numba.formats.hdf5_headers import (
    COLS,
    E_BLOCKS,
    E_BOUNDS,
    E_SIG,
    FAST,
    header_messages,
    scan_datasets,
    symbol_table,
)
from tdz_numba.tdz.sources import tensor_from_spec

h5py = pytest.importorskip("h5py")

REAL = Path(__file__).parent / "fixtures" / "hdf5_real"
_PLAIN = {
    "i1": "<i1",
    "i2": "<i2",
    "i4": "<i4",
    "i8": "<i8",
    "u1": "<u1",
    "u2": "<u2",
    "u4": "<u4",
    "u8": "<u8",
    "f2": "<f2",
    "f4": "<f4",
    "f8": "<f8",
}


def _write(p: Path, libver: str, track_order: bool, userblock: int = 0) -> set[str]:
    """A file with most dataset and group kinds; returns the paths the reader must map itself."""
    rng = np.random.default_rng(5)
    mapped = set()
    kw = {"userblock_size": userblock} if userblock else {}
    with h5py.File(p, "w", libver=libver, track_order=track_order, **kw) as f:
        f.attrs["title"] = "matrix"
        for name, dt in _PLAIN.items():
            f.create_dataset(name, data=(rng.standard_normal((3, 5)) * 50).astype(dt))
            mapped.add(f"/{name}")
            f.create_dataset(f"be_{name}", data=np.arange(6, dtype=dt.replace("<", ">")))
        nan = np.array([np.nan, -np.inf, 1.5], "<f8")
        nan.view("<u8")[0] |= 0x1234  # a NaN payload: kept bit for bit
        f.create_dataset("nan", data=nan)
        mapped.add("/nan")
        f.create_dataset("bool", data=np.array([True, False, True]))
        f.create_dataset("c8", data=np.array([1 + 2j, 3 - 4j], np.complex64))
        f.create_dataset("scalar", data=np.float32(2.5))
        f.create_dataset("empty", shape=(0, 4), dtype="f4")
        f.create_dataset("unallocated", shape=(2, 3), dtype="i4", fillvalue=-7)
        f.create_dataset("filled", data=np.ones((2, 2), "f4"), fillvalue=9.0)
        mapped.add("/filled")
        f.create_dataset("chunked", data=np.arange(40, dtype="f4").reshape(4, 10), chunks=(2, 5))
        f.create_dataset("gzip", data=np.arange(40, dtype="i2"), compression="gzip", shuffle=True)
        dcpl = h5py.h5p.create(h5py.h5p.DATASET_CREATE)
        dcpl.set_layout(h5py.h5d.COMPACT)
        h5py.h5d.create(f.id, b"compact", h5py.h5t.STD_I16LE, h5py.h5s.create_simple((5,)), dcpl=dcpl)
        f["compact"][...] = np.arange(5)
        f.create_dataset("string", data="text")
        f.create_dataset("strings", data=["a", "bcd"], dtype=h5py.string_dtype())
        f.create_dataset("fixed", data=np.array([b"ab", b"cd"], "S2"))
        f.create_dataset("compound", data=np.array([(1, 2.0)], [("a", "<i4"), ("b", "<f8")]))
        f.create_dataset("big", data=np.arange(100_000, dtype="<f4"))
        mapped.add("/big")
        f["soft"] = h5py.SoftLink("/f4")
        mapped.add("/soft")
        f["hard"] = f["f2"]
        mapped.add("/hard")
        g = f.create_group("a/b/c")
        g.attrs["depth"] = 3
        for i in range(12):  # more than 8 links: dense storage with libver="latest"
            g.create_dataset(f"w{i:02d}", data=np.full((i + 1,), i, "<i4"))
            mapped.add(f"/a/b/c/w{i:02d}")
        ds = f.create_dataset("a/with_attr", data=np.arange(3.0))
        ds.attrs["unit"] = "m"
        mapped.add("/a/with_attr")
        f["a/back"] = f["a"]  # a cycle
        f["a/dangling"] = h5py.SoftLink("/nowhere")
        f.create_dataset("one_d", data=np.zeros(1, "u1"))
        mapped.add("/one_d")
        f.create_dataset("rank5", data=np.arange(32, dtype="<i2").reshape(2, 2, 2, 2, 2))
        mapped.add("/rank5")
    return mapped


@pytest.mark.parametrize("libver", ["earliest", "latest"])
@pytest.mark.parametrize("track_order", [False, True])
def test_options_matrix(tmp_path, libver, track_order):
    p = tmp_path / "m.h5"
    want_mapped = _write(p, libver, track_order)
    rep = compare(p)
    assert rep.mismatches == [] and rep.missing == [] and rep.refused == []
    # zero-copy: the reader's own (want_mapped) and, through h5py's get_offset, the native ones it
    # leaves to h5py (one-byte "big-endian" ints, h5py's bool and complex, a dataset with attributes)
    assert set(rep.mapped_paths) == want_mapped | {"/be_i1", "/be_u1", "/bool", "/c8"}
    src = open_hdf5(p)
    with h5py.File(p, "r") as h5:
        root = src.level("")
        for name in ("f4", "u8", "big", "nan"):
            assert root.children[name].leaf.offset == h5[name].id.get_offset()
        # h5py's order: by name, or by creation order when tracked
        assert list(root.children) == [k for k in h5.keys() if k in root.children]
        a = src.level(root.children["a"].path)
        assert list(a.children) == [k for k in h5["a"].keys() if k in a.children]
        assert src.attributes("a/b/c") == {"depth": 3} and src.attributes("a/with_attr") == {"unit": "m"}
    assert src.metadata == {"title": "matrix"}
    assert "back" not in a.children and "dangling" not in a.children
    src.close()


def test_userblock_and_offsets(tmp_path):
    for libver in ("earliest", "latest"):
        p = tmp_path / f"ub_{libver}.h5"
        want = _write(p, libver, False, userblock=4096)
        rep = compare(p)
        assert rep.mismatches == [] and want <= set(rep.mapped_paths)


def test_hot_path_needs_no_h5py(tmp_path, monkeypatch):
    """Plain contiguous datasets in plain groups: h5py is imported but never opens the file."""
    p = tmp_path / "plain.h5"
    with h5py.File(p, "w") as f:
        for i in range(50):
            f.create_dataset(f"g{i % 3}/x{i}", data=np.arange(i + 1, dtype="<f4"))
    opened = []
    real = h5py.File

    def spy(*a, **kw):
        opened.append(a)
        return real(*a, **kw)

    monkeypatch.setattr(h5py, "File", spy)
    src = open_hdf5(p)
    assert opened == [] and src._h5 is None
    for i in range(50):
        level = src.level(src.level("").children[f"g{i % 3}"].path)
        assert tensor_from_spec(level.children[f"x{i}"].leaf, src.files).tolist() == list(range(i + 1))
    src.close()


def test_real_files():
    """Files written by other tools (tests/fixtures/hdf5_real/SOURCE.md): same as h5py."""
    files = sorted(REAL.glob("*.h*5"))
    assert len(files) >= 15
    mapped = 0
    for p in files:
        rep = compare(p)
        assert rep.mismatches == [] and rep.missing == [] and rep.refused == [], (p.name, rep)
        mapped += rep.mapped
    assert mapped >= 60  # the plain datasets of those files are mapped by the reader itself


def test_real_file_big_endian_machine():
    rep = compare(REAL / "vlen_string_s390x.h5")
    assert rep.leaves == 4 and rep.mapped == 2 and rep.mismatches == []


# -- damaged structures: status codes and clear errors ------------------------------------------


def _v1_header(cont_to: int, size: int = 64) -> np.ndarray:
    """A version 1 object header at 0 whose one message is a continuation to ``cont_to``."""
    buf = np.zeros(size, np.uint8)
    buf[0] = 1
    buf[8:12] = np.frombuffer(np.uint32(24).tobytes(), np.uint8)  # 24 bytes of messages
    buf[16:18] = [0x10, 0]  # continuation
    buf[18:20] = [16, 0]
    buf[24:32] = np.frombuffer(np.uint64(cont_to).tobytes(), np.uint8)
    buf[32:40] = np.frombuffer(np.uint64(24).tobytes(), np.uint8)
    return buf


def test_header_continuation_loop_is_bounded():
    buf = _v1_header(cont_to=16)  # the continuation block is the first block again: a loop
    table = np.zeros((16, 4), np.int64)
    assert header_messages(buf, 0, 0, 8, 8, table) == E_BLOCKS


def test_header_claims_checked():
    table = np.zeros((16, 4), np.int64)
    assert header_messages(_v1_header(cont_to=2**62), 0, 0, 8, 8, table) == E_BOUNDS
    assert header_messages(_v1_header(cont_to=2**64 - 2), 0, 0, 8, 8, table) == E_BOUNDS
    bad = _v1_header(16)
    bad[0] = 7
    assert header_messages(bad, 0, 0, 8, 8, table) == E_SIG
    assert header_messages(bad, 10**12, 0, 8, 8, table) == E_BOUNDS
    out = np.zeros((2, COLS), np.int64)
    scan_datasets(_v1_header(16), np.array([0, 5000], np.int64), 0, 8, 8, out)
    assert out[:, 0].tolist() == [E_BLOCKS, E_BOUNDS]


def test_btree_cycle_refused():
    """A group B-tree node whose child is itself (same level): refused, not walked forever."""
    buf = np.zeros(256, np.uint8)
    buf[0:4] = np.frombuffer(b"TREE", np.uint8)
    buf[4], buf[5], buf[6] = 0, 1, 1  # group node, level 1, one child
    buf[8:24] = 0xFF  # siblings undefined
    buf[32:40] = 0  # child 0 -> this node again
    out = np.zeros((8, 4), np.int64)
    assert symbol_table(buf, 0, 0, 8, 8, out) == E_SIG


def test_layout_address_past_the_end(tmp_path):
    """A contiguous dataset whose layout address points past the file: not mapped, and reading
    it fails cleanly (h5py's error as BadArchiveError)."""
    p = tmp_path / "a.h5"
    with h5py.File(p, "w") as f:
        f.create_dataset("x", data=np.arange(4, dtype="<f8"))
        off = f["x"].id.get_offset()
    data = bytearray(p.read_bytes())
    at = data.find(off.to_bytes(8, "little"))
    assert at > 0
    data[at : at + 8] = (len(data) + 4096).to_bytes(8, "little")
    p.write_bytes(bytes(data))
    with pytest.raises((BadArchiveError, UnsupportedError)):
        src = open_hdf5(p)
        tensor_from_spec(src.level("").children["x"].leaf, src.files)


def test_virtual_refused_without_opening_it(tmp_path, monkeypatch):
    """The virtual and external datasets are refused from their headers: h5py never opens them
    (h5o.open is never called with their names)."""
    p = tmp_path / "v.h5"
    with h5py.File(p, "w") as f:
        f.create_dataset("plain", data=np.arange(3.0))
        f.create_dataset("ext", shape=(2,), dtype="<f4", external=[("/etc/passwd", 0, 8)])
        layout = h5py.VirtualLayout(shape=(4,), dtype="f8")
        layout[:] = h5py.VirtualSource("other.h5", "x", shape=(4,))
        f.create_virtual_dataset("vds", layout)
        f.create_dataset("chunked", data=np.arange(4.0), chunks=(2,))
    opened = []
    real = h5py.h5o.open

    def spy(loc, name, *a, **kw):
        opened.append(name)
        return real(loc, name, *a, **kw)

    monkeypatch.setattr(h5py.h5o, "open", spy)
    src = open_hdf5(p)
    assert opened == [b"chunked"]
    root = src.level("").children
    for k, why in (("vds", "a virtual dataset"), ("ext", "external raw storage")):
        assert root[k].leaf.shape == ((4,) if k == "vds" else (2,))
        with pytest.raises(UnsupportedError, match=why):
            tensor_from_spec(root[k].leaf, src.files)
    src.close()


def test_without_h5py_message_unchanged(tmp_path, monkeypatch):
    p = tmp_path / "a.h5"
    with h5py.File(p, "w") as f:
        f["x"] = np.arange(3.0)
    real_import = builtins.__import__

    def fake_import(name, *a, **kw):
        if name == "h5py" or name.startswith("h5py."):
            raise ImportError("no h5py")
        return real_import(name, *a, **kw)

    monkeypatch.setattr(builtins, "__import__", fake_import)
    with pytest.raises(UnsupportedError, match="h5py"):
        open_hdf5(p)


def test_fast_status_for_plain_dataset(tmp_path):
    p = tmp_path / "a.h5"
    with h5py.File(p, "w") as f:
        f["x"] = np.arange(6, dtype="<i2").reshape(2, 3)
        addr = h5py.h5o.get_info(f["x"].id).addr
        off = f["x"].id.get_offset()
    buf = np.fromfile(p, np.uint8)
    out = np.zeros((1, COLS), np.int64)
    scan_datasets(buf, np.array([addr], np.int64), 0, 8, 8, out)
    assert out[0, :7].tolist() == [FAST, 2, 2, off, 12, 2, 3]


@pytest.mark.parametrize("keep", [9, 12, 14, 15, 16, 30])
def test_superblock_cut_short(tmp_path, keep):
    """A file cut inside its superblock: BadArchiveError (an IndexError before the fix at 12-15)."""
    p = tmp_path / "a.h5"
    with h5py.File(p, "w") as f:
        f["x"] = np.arange(3.0)
    p.write_bytes(p.read_bytes()[:keep])
    with pytest.raises(BadArchiveError):
        open_hdf5(p)
