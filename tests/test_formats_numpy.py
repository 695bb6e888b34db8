"""numpy .npy/.npz readers: zero-copy, Fortran order, byte order, compressed members, refusals."""

import struct
import zipfile

import numpy as np
import pytest
import torch

from tdz_numba import formats
from tdz_numba.errors import BadArchiveError, UnsafeContentError, UnsupportedError
from tdz_numba.formats.numpy_fmt import open_npy, open_npz, parse_npy_header

_DTYPES = ["?", "u1", "i1", "u2", "i2", "u4", "i4", "u8", "i8", "f2", "f4", "f8", "c8", "c16"]


def _arr(dt, shape=(3, 4), order="C"):
    a = (np.arange(np.prod(shape)) % 7).astype(dt).reshape(shape)
    return np.asarray(a, order=order)


@pytest.mark.parametrize("dt", _DTYPES)
@pytest.mark.parametrize("order", ["C", "F"])
def test_npy_every_dtype(tmp_path, dt, order):
    a = _arr(dt, order=order)
    p = tmp_path / "a.bin"
    np.save(p.open("wb"), a)
    assert formats.detect(p) == "npy"
    src = formats.open_source(p)
    t = formats.to_tree(src)["0"]
    assert np.array_equal(t.numpy(), a) and t.numpy().dtype == a.dtype
    if order == "F":
        assert t.stride() == (1, 3)
    base = src.files[0].torch_u8  # numpy pads headers to 64 bytes: every dtype is aligned
    assert t.untyped_storage().data_ptr() == base.untyped_storage().data_ptr()  # zero-copy


def test_npy_byteswapped_copied(tmp_path):
    a = np.arange(6, dtype=">f4").reshape(2, 3)
    p = tmp_path / "be.npy"
    np.save(p, a)
    t = formats.to_tree(open_npy(p))["0"]
    assert t.dtype == torch.float32 and t.tolist() == a.tolist()


def test_npy_versions_and_scalars(tmp_path):
    for version in [(1, 0), (2, 0), (3, 0)]:
        p = tmp_path / f"v{version[0]}.npy"
        with open(p, "wb") as fh:
            np.lib.format.write_array(fh, np.arange(3.0), version=version)
        assert formats.to_tree(open_npy(p))["0"].tolist() == [0.0, 1.0, 2.0]
    p = tmp_path / "s.npy"
    np.save(p, np.float64(2.5))
    assert formats.to_tree(open_npy(p))["0"].item() == 2.5
    np.save(p, np.zeros((0, 3)))
    assert formats.to_tree(open_npy(p))["0"].shape == (0, 3)


def test_npz_stored_and_compressed(tmp_path):
    arrays = {"a": _arr("f4"), "b": _arr("i2", order="F"), "dir/c": _arr("u1", (5,)), "e": np.zeros((0,))}
    for save, codec in [(np.savez, "stored"), (np.savez_compressed, "deflate")]:
        p = tmp_path / f"{codec}.npz"
        save(p, **arrays)
        assert formats.detect(p) == "npz"
        src = formats.open_source(p)
        assert src.format == "npz"
        tree = formats.to_tree(src)
        assert list(tree) == list(arrays)
        for k, a in arrays.items():
            assert np.array_equal(tree[k].numpy(), a), k
            spec = src.level("").children[k].leaf
            assert spec.codec == codec
            if codec == "deflate":
                assert spec.size == a.nbytes and spec.crc is not None


def test_npz_compressed_crc_checked(tmp_path):
    p = tmp_path / "c.npz"
    np.savez_compressed(p, a=np.arange(1000))
    raw = bytearray(p.read_bytes())
    with zipfile.ZipFile(p) as z:
        info = z.getinfo("a.npy")
    # flip the recorded CRC in the central directory
    cd = raw.rfind(b"PK\x01\x02")
    raw[cd + 16] ^= 0xFF
    p.write_bytes(bytes(raw))
    assert info.CRC
    src = formats.open_source(p)
    with pytest.raises(BadArchiveError):
        formats.to_tree(src)


def test_object_and_structured(tmp_path):
    p = tmp_path / "o.npy"
    np.save(p, np.array([{"a": 1}, None], dtype=object), allow_pickle=True)
    with pytest.raises(UnsafeContentError):
        formats.open_source(p)
    np.save(p, np.zeros(2, dtype=[("x", "f4"), ("y", "i4")]))
    with pytest.raises(UnsupportedError):
        formats.open_source(p)
    np.save(p, np.array(["ab", "c"]))
    with pytest.raises(UnsupportedError):
        formats.open_source(p)
    z = tmp_path / "o.npz"
    np.savez(z, a=np.arange(2), o=np.array([1, None], dtype=object))
    with pytest.raises(UnsafeContentError):
        formats.open_source(z)


def _npy(header: bytes, data: bytes = b"", version=1) -> bytes:
    if version == 1:
        return b"\x93NUMPY\x01\x00" + struct.pack("<H", len(header)) + header + data
    return b"\x93NUMPY" + bytes([version, 0]) + struct.pack("<I", len(header)) + header + data


@pytest.mark.parametrize(
    "raw, exc",
    [
        (
            _npy(b"{'descr': '<f4', 'fortran_order': False, 'shape': (4,), }", bytes(8)),
            BadArchiveError,
        ),  # short data
        (_npy(b"{'descr': '<f4', 'fortran_order': False, 'shape': (-1,), }"), BadArchiveError),
        (_npy(b"{'descr': '<f4', 'fortran_order': 0, 'shape': (1,), }", bytes(4)), BadArchiveError),
        (_npy(b"{'descr': '<f4', 'fortran_order': False}"), BadArchiveError),
        (_npy(b"{'descr': '<f4', 'fortran_order': False, 'shape': (1,), 'x': 1}"), BadArchiveError),
        (_npy(b"{'descr': 'zz', 'fortran_order': False, 'shape': (1,), }"), BadArchiveError),
        (_npy(b"{'descr': 3, 'fortran_order': False, 'shape': (1,), }"), BadArchiveError),
        (_npy(b"__import__('os').system('touch /tmp/x')"), BadArchiveError),
        (_npy(b"{'descr': '<f4', 'fortran_order': False, 'shape': (1.5,), }"), BadArchiveError),
        (_npy(b"{'descr': '<M8[s]', 'fortran_order': False, 'shape': (1,), }", bytes(8)), UnsupportedError),
        (_npy(b"{'descr': '<f4'", version=9), UnsupportedError),
        (b"\x93NUMPY\x01\x00\xff\xff{", BadArchiveError),
        (b"\x93NUMPY\x02\x00\xff\xff\xff\x7f{", BadArchiveError),
        (b"\x93NUMPY", BadArchiveError),
    ],
)
def test_bad_npy(tmp_path, raw, exc):
    p = tmp_path / "bad.npy"
    p.write_bytes(raw)
    with pytest.raises(exc):
        formats.open_source(p)


def test_header_parser_has_no_eval(tmp_path):
    marker = tmp_path / "marker"
    head = _npy(f"open({str(marker)!r}, 'w')".encode())
    with pytest.raises(BadArchiveError):
        parse_npy_header(head, "x")
    assert not marker.exists()


def test_npz_foreign_member_and_bad_member(tmp_path):
    p = tmp_path / "f.npz"
    with zipfile.ZipFile(p, "w") as z:
        z.writestr("a.npy", _npy(b"{'descr': '<f4', 'fortran_order': False, 'shape': (9,), }", bytes(4)))
    with pytest.raises(BadArchiveError):
        open_npz(p)
    with zipfile.ZipFile(p, "w") as z:  # an npz with another member: the arrays are read (numpy too)
        z.writestr("a.npy", b"")
        z.writestr("notes.txt", b"hi")
    with pytest.raises(BadArchiveError, match="a.npy"):  # the bad array is still refused
        formats.open_source(p)
    with zipfile.ZipFile(p, "w") as z:
        z.writestr("notes.txt", b"hi")
        z.writestr("b.txt", b"")
    with pytest.raises(UnsupportedError, match="not a tensor file"):  # no array at all: not an npz
        formats.open_source(p)
