"""HDF5 attributes read by the reader itself (tdz_numba/formats/hdf5_attrs.py) against h5py, bit for bit,
and damaged attribute messages and global heaps refused with BadArchiveError, never a loop."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from hdf5_oracle import compare

from tdz_numba.errors import BadArchiveError, TdzError
from tdz_numba.formats import hdf5_walk
from tdz_numba.formats.hdf5 import open_hdf5
from tdz_numba.formats.hdf5_attrs import read_attributes
from tdz_numba.formats.hdf5_objects import ATTR, Layout

h5py = pytest.importorskip("h5py")

FIXTURES = Path(__file__).parent / "fixtures"
_NUMERIC = ["i1", "i2", "i4", "i8", "u1", "u2", "u4", "u8", "f2", "f4", "f8"]


def _fixed(obj, name: str, raw, size: int, pad: int, cset: int = 0, shape=()) -> None:
    """A fixed-length string attribute with the given padding (0 null-terminated, 1 null-padded,
    2 space-padded), written byte for byte (no conversion)."""
    tid = h5py.h5t.C_S1.copy()
    tid.set_size(size)
    tid.set_strpad(pad)
    tid.set_cset(cset)
    space = h5py.h5s.create(h5py.h5s.SCALAR) if shape == () else h5py.h5s.create_simple(shape)
    aid = h5py.h5a.create(obj.id, name.encode(), tid, space)
    aid.write(np.array(raw, dtype=f"S{size}"), mtype=tid)


def _ours(f) -> dict:
    """Attributes of every kind the reader decodes itself, by name."""
    rng = np.random.default_rng(3)
    out = {}
    for code in _NUMERIC:
        for order in "<>":
            dt = np.dtype(order + code)
            out[f"s_{order}{code}"] = np.array(rng.integers(0, 100), dt)[()]
            out[f"a_{order}{code}"] = (rng.standard_normal((2, 3)) * 40).astype(dt)
    nan = np.array([np.nan, -0.0, np.inf, -np.inf, 1e-310], "<f8")
    nan.view("<u8")[0] |= 0xBEEF  # a NaN payload
    out["nan"] = nan
    out["zero_len"] = np.zeros(0, "<i4")
    out["vstr"] = "text é"
    out["vstr_empty"] = ""
    out["vstrs"] = np.array(["a", "bcd", "", "ü" * 40], dtype=h5py.string_dtype())
    out["vstrs2d"] = np.array([["a", "b"], ["c", "d"]], dtype=h5py.string_dtype())
    out["vascii"] = np.array("ascii", dtype=h5py.string_dtype("ascii"))
    out["fixed"] = np.bytes_(b"bytes")
    out["fixeds"] = np.array([b"ab", b"c", b""], "S2")
    out["bool"] = True
    out["bools"] = np.array([[True, False], [False, True]])
    seq = np.empty(3, object)
    seq[0], seq[1], seq[2] = np.arange(3, dtype="<i4"), np.arange(0, dtype="<i4"), np.arange(5, dtype="<i4")
    out["vseq"] = (seq, h5py.vlen_dtype(np.dtype("<i4")))
    return out


def _h5py_kinds(f) -> dict:
    """Attributes read by h5py after the reader's checks."""
    return {
        "empty": h5py.Empty("f4"),
        "compound": np.array((1, 2.5), [("a", "<i4"), ("b", "<f8")])[()],
        "complex": np.complex64(1 - 2j),
        "enum": (np.int8(1), h5py.enum_dtype({"RED": 0, "GREEN": 1}, basetype="i1")),
        "bitfield": (np.uint16(5), None),  # written below as a 16-bit bitfield
    }


def _write(f, where, attrs: dict) -> None:
    for name, value in attrs.items():
        if isinstance(value, tuple):
            value, dtype = value
            if dtype is None:
                tid = h5py.h5t.STD_B16LE
                aid = h5py.h5a.create(where.id, name.encode(), tid, h5py.h5s.create(h5py.h5s.SCALAR))
                aid.write(np.array(value, "<u2"), mtype=tid)
                continue
            where.attrs.create(name, value, dtype=dtype)
        else:
            where.attrs[name] = value


def _file(p: Path, libver: str, track_order: bool) -> list[str]:
    """Attributes of every kind, at most 6 per object (compact storage); returns the group paths
    whose attributes are all decoded by the reader."""
    ours_only = []
    with h5py.File(p, "w", libver=libver, track_order=track_order) as f:
        items = list(_ours(f).items())
        for i in range(0, len(items), 6):
            g = f.create_group(f"g{i // 6:02d}", track_order=track_order)
            _write(f, g, dict(items[i : i + 6]))
            ours_only.append(g.name)
        _fixed(f["g00"], "nullterm", b"ab\0cd", 5, 0)
        _fixed(f["g00"], "nullpad", b"ab\0cd", 5, 1)
        _fixed(f["g01"], "spacepad", b"ab  ", 4, 2)
        _fixed(f["g01"], "utf8", ["é".encode()] * 2, 4, 1, cset=1, shape=(2,))
        f["strtype"] = np.dtype(h5py.string_dtype())  # a committed datatype
        f["g02"].attrs.create("committed", "shared", dtype=f["strtype"])
        h = f.create_group("h5py_kinds")
        _write(f, h, _h5py_kinds(f))
        h.attrs["plain"] = 7
        d = f.create_dataset("data", data=np.arange(4.0))
        d.attrs["unit"] = "m"
        d.attrs["scale"] = np.float32(0.5)
        f.attrs["title"] = "root"
        f["data"].attrs["ref"] = f["g00"].ref  # compact storage: left out with its reason
    return ours_only


@pytest.mark.parametrize("libver", ["earliest", "latest"])
@pytest.mark.parametrize("track_order", [False, True])
def test_attrs_agree_with_h5py(tmp_path, libver, track_order):
    p = tmp_path / "attrs.h5"
    ours_only = _file(p, libver, track_order)
    rep = compare(p)
    assert rep.mismatches == [] and rep.missing == []
    assert rep.skipped_attrs == ["/data@ref"]
    assert rep.attrs >= 60
    src = open_hdf5(p)
    assert "object or region reference" in src.skipped_attributes("data")["ref"]
    assert src.attributes("g00")["nullterm"] == "ab" and src.attributes("g00")["nullpad"] == "ab\x00cd"
    assert src.attributes("g01")["spacepad"] == "ab" and src.attributes("g01")["utf8"] == ["é", "é"]
    assert src.attributes("g02")["committed"] == "shared"
    assert src.attributes("h5py_kinds")["bitfield"] == 5
    src.close()
    # the groups of decoded kinds need no h5py call at all
    calls = []
    real = hdf5_walk.attrs_of
    try:
        hdf5_walk.attrs_of = lambda obj, where, names=None: calls.append(obj.name) or real(obj, where, names)
        src = open_hdf5(p)
        src.close()
    finally:
        hdf5_walk.attrs_of = real
    assert calls == ["/h5py_kinds"]
    assert not set(calls) & set(ours_only)


def test_read_attributes_values(tmp_path):
    p = tmp_path / "a.h5"
    with h5py.File(p, "w") as f:
        f.attrs["be"] = np.array([1, 256], ">u2")
        f.attrs["f2"] = np.float16(1.5)
        f.attrs["vs"] = ["x", "yz"]
        f.attrs["b"] = np.array([True, False])
    lay = Layout.read(np.fromfile(p, np.uint8), str(p))
    got = read_attributes(lay, lay.header(lay.root), "/", {})
    assert got.values == {"b": [True, False], "be": [1, 256], "f2": 1.5, "vs": ["x", "yz"]}
    assert not got.dense and got.h5py == [] and got.skipped == {}


def test_dense_attributes_through_h5py(tmp_path):
    p = tmp_path / "dense.h5"
    with h5py.File(p, "w", libver="latest") as f:
        g = f.create_group("g")
        for i in range(20):  # more than 8: dense storage
            g.attrs[f"a{i:02d}"] = i
    rep = compare(p)
    assert rep.mismatches == [] and rep.attrs == 20
    src = open_hdf5(p)
    assert src.attributes("g") == {f"a{i:02d}": i for i in range(20)}
    src.close()


_OPEN = """
import sys
from tdz_numba.errors import BadArchiveError
from tdz_numba.formats.hdf5 import open_hdf5
try:
    open_hdf5(sys.argv[1]).close()
    print("OPENED")
except BadArchiveError as e:
    print("REFUSED", e)
"""


def test_attr_mutant_refused():
    """tests/fixtures/hdf5_attr_mutant_hang.h5 (a fuzz mutant, rseed 11, mutant 1362) sends h5py's
    read of group '/g''s attribute 's' into an endless loop: its variable-length string lives in a
    global heap collection whose free-space object claims 0 bytes, and libhdf5 steps 0 bytes ahead
    forever. The reader walks the collection itself and refuses it (in a child: the old reader
    hangs there and fails here)."""
    fixture = FIXTURES / "hdf5_attr_mutant_hang.h5"
    try:
        proc = subprocess.run(
            [sys.executable, "-c", _OPEN, str(fixture)], timeout=60, capture_output=True, text=True
        )
    except subprocess.TimeoutExpired:
        raise AssertionError("reading the damaged attribute still loops") from None
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert proc.stdout.startswith("REFUSED"), proc.stdout
    assert "global heap collection at 7920: a free-space object of 0 bytes" in proc.stdout


def _attr_file(tmp_path) -> tuple[Path, bytes]:
    p = tmp_path / "v.h5"
    with h5py.File(p, "w", libver="earliest") as f:
        f.attrs["s"] = "hello"
        f.attrs["n"] = np.arange(4, dtype="<i4")
    return p, p.read_bytes()


def _damaged(tmp_path, data: bytes, pos: int, raw: bytes) -> Path:
    bad = bytearray(data)
    bad[pos : pos + len(raw)] = raw
    q = tmp_path / "bad.h5"
    q.write_bytes(bytes(bad))
    return q


@pytest.mark.parametrize(
    "what, patch, message",
    [
        ("signature", lambda gcol, osz: (gcol, b"XCOL"), "no collection there"),
        ("version", lambda gcol, osz: (gcol + 4, b"\x07"), "version 7"),
        ("size", lambda gcol, osz: (gcol + 8, (1 << 40).to_bytes(8, "little")), "past the end of the file"),
        ("free space", lambda gcol, osz: (gcol + 16 + 16 + 8, bytes(16)), "free-space object of 0 bytes"),
        ("object size", lambda gcol, osz: (gcol + 16 + 8, (3).to_bytes(8, "little")), "holds 3 bytes"),
        ("object index", lambda gcol, osz: (gcol + 16, (9).to_bytes(2, "little")), "no object 1"),
    ],
)
def test_damaged_global_heap(tmp_path, what, patch, message):
    p, data = _attr_file(tmp_path)
    gcol = data.find(b"GCOL")
    assert gcol > 0
    pos, raw = patch(gcol, 8)
    with pytest.raises(BadArchiveError, match=message):
        open_hdf5(_damaged(tmp_path, data, pos, raw))


def test_damaged_attribute_messages(tmp_path):
    """Every claim of an attribute message (sizes of its name, type and space, the rank, the
    element count) is checked: a byte flipped anywhere in the messages opens or is refused."""
    p, data = _attr_file(tmp_path)
    lay = Layout.read(np.frombuffer(data, np.uint8), str(p))
    rows = [r for r in lay.header(lay.root).rows.tolist() if r[0] == ATTR]
    assert len(rows) == 2
    refused = 0
    for _t, _f, start, size in rows:
        for pos in range(start, start + size):
            for value in (0x00, 0xFF, data[pos] ^ 0x10):
                q = _damaged(tmp_path, data, pos, bytes([value]))
                try:
                    open_hdf5(q).close()
                except TdzError:
                    refused += 1
    assert refused > 0


def test_attributes_through_the_archive(tmp_path):
    """Issue 25: ``ar['g'].metadata`` is group g's attributes (not the root's), ``ar.info(k).attrs``
    a dataset's; a gzip-chunked dataset says how it is stored in info, ``tdz info`` and ``tdz tree``."""
    import tdz_numba

    p = tmp_path / "a.h5"
    with h5py.File(p, "w") as f:
        f.attrs["title"] = "root"
        g = f.create_group("g")
        g.attrs["kind"] = "encoder"
        g.attrs["sizes"] = np.array([3, 4], ">i8")
        w = g.create_dataset(
            "w", data=np.arange(4000.0).reshape(40, 100), compression="gzip", chunks=(10, 100)
        )
        w.attrs["unit"] = "m"
        w.attrs["scale"] = np.float32(0.25)
        g.create_dataset("b", data=np.arange(3.0))
    with tdz_numba.open(p) as ar:
        assert ar.metadata == {"title": "root"}
        assert ar["g"].metadata == {"kind": "encoder", "sizes": [3, 4]}
        info = ar.info("g/w")
        assert info.attrs == {"scale": 0.25, "unit": "m"} and ar["g"].info("w").attrs == info.attrs
        assert ar.info("g/b").attrs == {}
        with h5py.File(p, "r") as f:
            stored = f["g/w"].id.get_storage_size()
        assert info.compression == "chunked+gzip" and info.stored_nbytes == stored < info.nbytes == 32000
    for cmd in ("info", "tree"):
        out = subprocess.run(
            [sys.executable, "-m", "tdz_numba.cli.command", cmd, str(p)],
            capture_output=True,
            text=True,
            timeout=120,
        ).stdout
        assert "chunked+gzip" in out and "0 B stored" not in out, out


def test_leaf_info_attrs_empty_for_other_formats(tmp_path):
    import torch

    import tdz_numba

    p = tdz_numba.save({"a": torch.ones(2)}, tmp_path / "x.tdz")
    with tdz_numba.open(p) as ar:
        assert ar.info("a").attrs == {}


@pytest.mark.parametrize("libver", ["earliest", "latest"])
def test_plain_datasets_with_attributes_need_no_h5py(tmp_path, monkeypatch, libver):
    """scan_datasets gives FAST_ATTRS to a plain contiguous dataset with compact attributes: it is
    mapped without h5py and its attributes read by the reader (h5py never opens the file); one
    with dense attributes stays SLOW (h5py lists them)."""
    from tdz_numba.formats.hdf5_headers import COLS, FAST, FAST_ATTRS, SLOW, scan_datasets
    from tdz_numba.tdz.sources import tensor_from_spec

    p = tmp_path / "a.h5"
    with h5py.File(p, "w", libver=libver) as f:
        for i in range(5):
            d = f.create_dataset(f"w{i}", data=np.arange(i + 2, dtype="<f4"))
            d.attrs["unit"] = f"m{i}"
            d.attrs["scale"] = np.array([i, 2 * i], ">i2")
        f.create_dataset("bare", data=np.arange(3, dtype="<i8"))
        addrs = [h5py.h5o.get_info(f[k].id).addr for k in ("w0", "bare")]
        if libver == "latest":
            dense = f.create_dataset("dense", data=np.arange(2.0))
            for i in range(12):
                dense.attrs[f"a{i:02d}"] = i
            addrs.append(h5py.h5o.get_info(dense.id).addr)
    buf = np.fromfile(p, np.uint8)
    out = np.zeros((len(addrs), COLS), np.int64)
    scan_datasets(buf, np.array(addrs, np.int64), 0, 8, 8, out)
    assert out[:, 0].tolist() == [FAST_ATTRS, FAST] + ([SLOW] if libver == "latest" else [])
    if libver == "latest":
        (tmp_path / "b.h5").write_bytes(p.read_bytes())
        with h5py.File(tmp_path / "b.h5", "a") as f:
            del f["dense"]
        p = tmp_path / "b.h5"
    opened = []
    real = h5py.File
    monkeypatch.setattr(h5py, "File", lambda *a, **kw: opened.append(a) or real(*a, **kw))
    src = open_hdf5(p)
    assert opened == [] and src._h5 is None
    root = src.level("")
    for i in range(5):
        spec = root.children[f"w{i}"].leaf
        assert spec.loader is None
        assert tensor_from_spec(spec, src.files).tolist() == list(range(i + 2))
        assert src.attributes(f"w{i}") == {"scale": [i, 2 * i], "unit": f"m{i}"}
    assert src.attributes("bare") == {}
    src.close()
    monkeypatch.undo()
    assert compare(p).mismatches == []
