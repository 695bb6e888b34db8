"""Round trips, bytes on disk, zero-copy mapping semantics, allocate, subpath, API surface."""

import json
import os
import shutil
import struct
import subprocess
import sys
import zipfile

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from ziputil import zero_timestamps

import tdz_numba
from tdz_numba import Level

DTYPES = [
    torch.bool,
    torch.uint8,
    torch.uint16,
    torch.uint32,
    torch.uint64,
    torch.int8,
    torch.int16,
    torch.int32,
    torch.int64,
    torch.float16,
    torch.bfloat16,
    torch.float32,
    torch.float64,
    torch.complex64,
    torch.complex128,
    torch.float8_e4m3fn,
    torch.float8_e5m2,
]


def _sample(dtype, shape):
    n = int(np.prod(shape)) if shape else 1
    raw = torch.arange(n, dtype=torch.float64).reshape(shape) % 7
    if dtype == torch.bool:
        return raw > 3
    if dtype.is_complex:
        return torch.complex(raw, -raw).to(dtype)
    return raw.to(dtype)


def _local_headers(path):
    """(name, payload offset, extra bytes) of every local header, parsed by hand."""
    data = path.read_bytes()
    out = []
    with zipfile.ZipFile(path) as zf:
        for info in zf.infolist():
            h = info.header_offset
            assert data[h : h + 4] == b"PK\x03\x04"
            n, e = struct.unpack_from("<HH", data, h + 26)
            out.append((info.filename, h + 30 + n + e, data[h + 30 + n : h + 30 + n + e]))
    return out


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("shape", [(), (0,), (1,), (63,), (64,), (65,), (3, 5, 7)], ids=str)
def test_roundtrip_dtype_shape_matrix(tmp_path, dtype, shape):
    t = _sample(dtype, shape)
    p = tdz_numba.save({"x": t}, tmp_path / "x.tdz")
    back = tdz_numba.load(p)["x"]
    assert back.dtype == dtype and back.shape == t.shape
    assert torch.equal(
        back.view(torch.uint8) if dtype.itemsize == 1 and dtype.is_floating_point else back,
        t.view(torch.uint8) if dtype.itemsize == 1 and dtype.is_floating_point else t,
    )


def test_numpy_leaves_noncontiguous_conj_neg_requires_grad(tmp_path):
    base = torch.arange(24, dtype=torch.float32).reshape(4, 6)
    c = torch.complex(torch.ones(3), torch.arange(3.0))
    tree = {
        "np_f64": np.linspace(0, 1, 11),
        "np_be": np.arange(4, dtype=">i4"),  # big-endian: stored as native values
        "np_slice": np.arange(20, dtype=np.int32)[::3],
        "transposed": base.t(),
        "strided": base[:, ::2],
        "expanded": torch.ones(3).expand(4, 3),
        "conj": c.conj(),
        "neg": torch._neg_view(torch.arange(3.0)),
        "grad": torch.ones(2, requires_grad=True),
    }
    back = tdz_numba.load(tdz_numba.save(tree, tmp_path / "x.tdz"))
    assert np.array_equal(back["np_f64"].numpy(), tree["np_f64"])
    assert back["np_be"].tolist() == [0, 1, 2, 3]
    assert back["np_slice"].tolist() == list(range(0, 20, 3))
    assert torch.equal(back["transposed"], base.t())
    assert torch.equal(back["strided"], base[:, ::2])
    assert torch.equal(back["expanded"], torch.ones(4, 3))
    assert torch.equal(back["conj"], c.conj().resolve_conj())
    assert back["neg"].tolist() == [-0.0, -1.0, -2.0]
    assert not back["grad"].requires_grad and back["grad"].tolist() == [1.0, 1.0]


def test_plain_values_nesting_and_odd_keys(tmp_path):
    tree = {
        "s": "héllo",
        "i": 3,
        "f": 2.5,
        "b": True,
        "none": None,
        "lst": [1, "a", None, [2.0]],
        "nan": float("nan"),
        "": torch.ones(1),
        ".": torch.ones(2),
        "..": {"x": torch.zeros(1)},
        "odd/key name%": torch.arange(3),
        "a": {"b": {"c": torch.tensor([7])}},
    }
    back = tdz_numba.load(tdz_numba.save(tree, tmp_path / "x.tdz"))
    assert list(back) == list(tree)
    for k in ("s", "i", "f", "b", "none", "lst"):
        assert back[k] == tree[k] and type(back[k]) is type(tree[k])
    assert np.isnan(back["nan"])
    assert back["odd/key name%"].tolist() == [0, 1, 2]
    assert back[""].tolist() == [1.0] and back["."].tolist() == [1.0, 1.0]
    assert back[".."]["x"].tolist() == [0.0]
    names = [n for n, _, _ in _local_headers(tmp_path / "x.tdz")]
    assert "odd%2Fkey%20name%25.memmap" in names and "%.memmap" in names
    assert "%2E.memmap" in names and "%2E%2E/x.memmap" in names
    with tdz_numba.open(tmp_path / "x.tdz") as ar:
        assert ar["a/b/c"].tolist() == [7] and ar["a", "b", "c"].tolist() == [7]
        assert ar["odd/key name%"].tolist() == [0, 1, 2]  # exact key wins over splitting


def test_bytes_on_disk_alignment_order_and_zip_tools(tmp_path):
    tree = {
        "z": torch.ones(3),
        "a": {"y": torch.ones(65, dtype=torch.uint8), "x": torch.ones(1)},
        "m": torch.arange(10, dtype=torch.int64),
        "t": "text",
        "e": torch.zeros(0),
    }
    p = tdz_numba.save(tree, tmp_path / "x.tdz")
    headers = _local_headers(p)
    names = [n for n, _, _ in headers]
    # meta.json first at every level, then files sorted, then directories sorted; no empty payloads
    assert names == [
        "meta.json",
        "m.memmap",
        "z.memmap",
        "a/meta.json",
        "a/x.memmap",
        "a/y.memmap",
        "t/meta.json",
    ]
    for name, payload, extra in headers:
        if name.endswith(".memmap"):
            assert payload % 64 == 0, name
            tag, size = struct.unpack_from("<HH", extra)
            assert tag == 0x6474 and extra[4 : 4 + size] == bytes(size)
            assert struct.unpack_from("<HH", extra, 4 + size) == (1, 16)  # zip64 extra after the padding
        else:
            assert struct.unpack_from("<HH", extra) == (1, 16)
    with zipfile.ZipFile(p) as zf:
        assert zf.testzip() is None
        assert all(i.compress_type == zipfile.ZIP_STORED for i in zf.infolist())
    if shutil.which("unzip"):
        r = subprocess.run(["unzip", "-t", str(p)], capture_output=True, text=True)
        assert r.returncode == 0, r.stdout + r.stderr


def test_zero_copy_single_storage_and_private_mapping(tmp_path, small_tree):
    p = tdz_numba.save(small_tree, tmp_path / "x.tdz")
    before = p.read_bytes()
    with tdz_numba.open(p) as ar:
        a, b, c = ar["a"], ar["nested/b"], ar["nested/deep/c"]
        ptrs = {t.untyped_storage().data_ptr() for t in (a, b, c, ar["np"])}
        assert len(ptrs) == 1  # one mapping of the file
        info = ar.info("a")
        assert a.data_ptr() - a.untyped_storage().data_ptr() == info.offset
        assert info.offset % 64 == 0 and info.nbytes == 24 and info.compression == "stored"
        n = ar.numpy("a")
        assert n.ctypes.data == a.data_ptr()  # same bytes
        a.add_(100)  # private mapping: in memory only
        assert n[0, 0] == 100
        assert ar["a"] is a
    assert p.read_bytes() == before
    assert tdz_numba.load(p)["a"][0, 0] == 0


def test_mode_r_plus_writes_through_and_refresh_checksums(tmp_path, small_tree):
    p = tdz_numba.save(small_tree, tmp_path / "x.tdz")
    with tdz_numba.open(p, mode="r+") as ar:
        a, c = ar["a"], ar["nested/deep/c"]
    a.fill_(5)  # written after close (the tensors keep the mapping): nothing re-stamps them
    c[1] = 42
    assert tdz_numba.load(p)["a"].eq(5).all()
    with zipfile.ZipFile(p) as zf:
        assert zf.testzip() == "a.memmap"  # stale CRC until refreshed
    with pytest.raises(tdz_numba.ChecksumError, match="a.memmap"):
        tdz_numba.verify(p)
    tdz_numba.refresh_checksums(p)
    with zipfile.ZipFile(p) as zf:
        assert zf.testzip() is None
    assert tdz_numba.verify(p).leaves == 4
    if shutil.which("unzip"):
        assert subprocess.run(["unzip", "-tq", str(p)], capture_output=True).returncode == 0
    assert tdz_numba.load(p)["nested"]["deep"]["c"].tolist() == [1, 42, 3]


def test_refresh_checksums_foreign_zip_with_data_descriptors(tmp_path):
    if not shutil.which("zip"):
        pytest.skip("zip not installed")
    d = tmp_path / "dir"
    tdz_numba.unpack(tdz_numba.save({"a": torch.zeros(16)}, tmp_path / "x.tdz"), d)
    p = tmp_path / "f.zip"
    # zip writing to a pipe cannot seek back: it sets flag bit 3 and writes data descriptors
    subprocess.run("zip -0 -q -r - . | cat > ../f.zip", shell=True, cwd=d, check=True)
    with zipfile.ZipFile(p) as zf:
        assert any(i.flag_bits & 0x8 for i in zf.infolist())
    with tdz_numba.open(p, mode="r") as ar:
        assert ar["a"].tolist() == [0.0] * 16
    # write through (payload of a zip -0 entry is not 64-aligned but float32 needs 4)
    arr = np.memmap(p, np.uint8, mode="r+")
    with zipfile.ZipFile(p) as zf:
        info = zf.getinfo("a.memmap")
    h = info.header_offset
    n, e = struct.unpack_from("<HH", bytes(arr[h + 26 : h + 30]))
    arr[h + 30 + n + e] = 1
    arr.flush()
    del arr
    with zipfile.ZipFile(p) as zf:
        assert zf.testzip() == "a.memmap"
    tdz_numba.refresh_checksums(p)
    with zipfile.ZipFile(p) as zf:
        assert zf.testzip() is None
    assert subprocess.run(["unzip", "-tq", str(p)], capture_output=True).returncode == 0


def test_allocate_zero_filled_writable_and_not_materialized(tmp_path):
    frame = torch.zeros(64, 64, dtype=torch.uint8)
    template = {
        "obs": frame.expand(50_000, 64, 64),
        "reward": torch.zeros(()).expand(50_000),
        "meta": {"idx": torch.arange(3)},
    }
    p = tmp_path / "buf.tdz"
    with tdz_numba.allocate(template, p) as buf:
        assert buf.mode == "r+"
        assert buf["obs"].shape == (50_000, 64, 64) and buf["obs"].dtype == torch.uint8
        assert buf["meta/idx"].tolist() == [0, 0, 0]
        buf["obs"][10] = 3
    st = os.stat(p)
    assert st.st_size > 50_000 * 64 * 64
    assert st.st_blocks * 512 >= 50_000 * 64 * 64  # reserved (fallocate), the zeros never written
    back = tdz_numba.open(p)
    assert int(back["obs"][10].sum()) == 3 * 64 * 64 and int(back["obs"][11].sum()) == 0
    with zipfile.ZipFile(p) as zf:  # close re-stamped obs (written); the others' are the CRCs of zeros
        assert zf.testzip() is None
    tdz_numba.refresh_checksums(p)
    assert tdz_numba.verify(p).leaves == 3


def test_subpath_parses_nothing_outside(tmp_path, small_tree):
    p = tdz_numba.save(small_tree, tmp_path / "x.tdz")
    sub = tdz_numba.load(p, subpath="nested/deep")
    assert list(sub) == ["c"] and sub["c"].tolist() == [1, 2, 3]
    assert tdz_numba.load(p, subpath=("nested",))["b"].dtype == torch.bfloat16
    with tdz_numba.open(p, subpath="nested") as ar:
        list(ar)
        assert ar.source.parsed_levels() == {"nested/"}  # the root meta.json was never parsed
    with pytest.raises(tdz_numba.MissingKeyError):
        tdz_numba.open(p, subpath="nope")


def test_archive_mapping_repr_info_and_to_dict(tmp_path, small_tree):
    p = tdz_numba.save(small_tree, tmp_path / "x.tdz")
    with tdz_numba.open(p) as ar:
        assert len(ar) == 4 and set(ar) == {"a", "nested", "np", "tag"}
        assert "nested/b" in ar and "zzz" not in ar
        assert isinstance(ar["nested"], tdz_numba.Archive)
        text = repr(ar)
        assert "nested/ (TensorDict)" in text and "bfloat16[2, 4]" in text and "'hello'" in text
        info = ar.info(("nested", "b"))
        assert (info.dtype, info.shape, info.compression) == (torch.bfloat16, (2, 4), "stored")
        assert info.zero_copy and isinstance(info.crc, int)
        assert ar.numpy("nested/b").dtype == np.uint16  # numpy has no bfloat16: same bytes
        d = ar.to_dict()
        assert isinstance(d, dict) and isinstance(d, Level) and d.meta["_class"] == "tensordict:TensorDict"
        assert d["tag"] == "hello" and torch.equal(d["a"], small_tree["a"])


def test_loaded_levels_resave_byte_identically(tmp_path, small_tree):
    p1 = tdz_numba.save(small_tree, tmp_path / "a.tdz")
    p2 = tdz_numba.save(tdz_numba.load(p1), tmp_path / "b.tdz")
    assert zero_timestamps(p1.read_bytes()) == zero_timestamps(p2.read_bytes())


@pytest.mark.parametrize("compression", ["deflate", "bzip2", "lzma"])
def test_compressed_roundtrip(tmp_path, compression):
    """(r+ refusal and unknown names: tests/test_compression.py)"""
    tree = {"img": torch.arange(5000, dtype=torch.int64) % 3, "x": {"y": torch.zeros(100)}}
    p = tdz_numba.save(tree, tmp_path / "c.tdz", compression=compression)
    with zipfile.ZipFile(p) as zf:
        assert zf.testzip() is None
        methods = {i.filename: i.compress_type for i in zf.infolist()}
    assert methods["meta.json"] == zipfile.ZIP_STORED
    assert methods["img.memmap"] == {"deflate": 8, "bzip2": 12, "lzma": 14}[compression]
    back = tdz_numba.load(p)
    assert torch.equal(back["img"], tree["img"]) and torch.equal(back["x"]["y"], tree["x"]["y"])
    with tdz_numba.open(p) as ar:
        assert ar.info("img").compression == compression


def test_save_overwrites_atomically_and_from_its_own_mapping(tmp_path, small_tree):
    p = tdz_numba.save(small_tree, tmp_path / "x.tdz")
    os.chmod(p, 0o640)
    loaded = tdz_numba.load(p)  # views into the old file
    loaded["extra"] = torch.ones(3)
    tdz_numba.save(loaded, p)
    assert os.stat(p).st_mode & 0o777 == 0o640
    back = tdz_numba.load(p)
    assert torch.equal(back["a"], small_tree["a"]) and back["extra"].tolist() == [1.0] * 3
    assert sorted(x.name for x in tmp_path.iterdir()) == ["x.tdz"]


def test_pack_unpack_roundtrip(tmp_path, small_tree):
    p = tdz_numba.save(small_tree, tmp_path / "x.tdz")
    d = tdz_numba.unpack(p, tmp_path / "dir")
    assert (d / "meta.json").is_file() and (d / "nested" / "deep" / "c.memmap").is_file()
    p2 = tdz_numba.pack(d, tmp_path / "y.tdz")
    assert zero_timestamps(p.read_bytes()) == zero_timestamps(p2.read_bytes())
    with pytest.raises(tdz_numba.BadArchiveError):
        tdz_numba.pack(d, d / "inside.tdz")


def test_is_archive(tmp_path, small_tree):
    p = tdz_numba.save(small_tree, tmp_path / "x.tdz")
    assert tdz_numba.is_archive(p)
    assert not tdz_numba.is_archive(tmp_path)
    assert not tdz_numba.is_archive(tmp_path / "missing")
    other = tmp_path / "o.zip"
    with zipfile.ZipFile(other, "w") as zf:
        zf.writestr("x.txt", "hi")
    assert not tdz_numba.is_archive(other)


def test_public_api_is_pinned():
    assert tdz_numba.__all__ == [
        "__version__",
        "save",
        "open",
        "load",
        "pack",
        "unpack",
        "is_archive",
        "verify",
        "refresh_checksums",
        "allocate",
        "convert",
        "clean",
        "append",
        "compact",
        "repair",
        "save_model",
        "load_model",
        "diff",
        "Archive",
        "LeafInfo",
        "LevelInfo",
        "Location",
        "Level",
        "RawFile",
        "PickledData",
        "VerifyReport",
        "DiffReport",
        "Writer",
        "TdzError",
        "BadArchiveError",
        "ChecksumError",
        "UnsupportedError",
        "ArchiveExistsError",
        "UnsafeContentError",
        "InvalidTreeError",
        "InvalidArgumentError",
        "MissingKeyError",
        "UnknownCompressionError",
        "FileMissingError",
        "AccessDeniedError",
        "DiskFullError",
        "RemoteError",
        "InternalError",
    ]
    for name in tdz_numba.__all__:
        assert getattr(tdz_numba, name) is not None
    for name in tdz_numba.__all__:
        obj = getattr(tdz_numba, name)
        if name.endswith("Error"):
            assert issubclass(obj, tdz_numba.TdzError)
    assert issubclass(tdz_numba.BadArchiveError, ValueError)
    assert issubclass(tdz_numba.UnsupportedError, NotImplementedError)
    assert issubclass(tdz_numba.RemoteError, OSError) and issubclass(tdz_numba.InternalError, RuntimeError)


def test_import_is_cheap_and_second_process_uses_kernel_cache(tmp_path):
    code_import = "import sys, tdz_numba; print('numba' in sys.modules, 'torch' in sys.modules)"
    env = dict(os.environ, NUMBA_CACHE_DIR=str(tmp_path / "cache"))
    out = subprocess.run([sys.executable, "-c", code_import], capture_output=True, text=True, env=env)
    assert out.stdout.split() == ["False", "False"], out.stderr
    code = (
        "import torch, tdz_numba, sys\n"
        "from tdz_numba.zipfmt.kernels import central as c, crc as k\n"
        f"p = tdz_numba.save({{'a': torch.ones(100), 'b': {{'c': torch.zeros(3)}}}}, {str(tmp_path / 'x.tdz')!r})\n"
        "assert tdz_numba.load(p)['a'].sum() == 100\n"
        # save hashes with zlib-ng from its writing threads (no CRC kernel to compile)
        "fns = [k.plan_layout, c.parse_central]\n"
        "print(sum(sum(f.stats.cache_misses.values()) for f in fns), sum(sum(f.stats.cache_hits.values()) for f in fns))\n"
    )
    first = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env)
    second = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env)
    assert first.returncode == 0 and second.returncode == 0, first.stderr + second.stderr
    misses, hits = map(int, second.stdout.split())
    assert misses == 0 and hits == 2


@given(st.text())
@settings(max_examples=300, deadline=None)
def test_robust_key_encoding_matches_tensordict(key):
    td_utils = pytest.importorskip("tensordict._utils_key_json")
    from tdz_numba.tdz.tree import decode_key, encode_key

    assert encode_key(key) == td_utils._encode_key_for_filesystem(key)
    assert decode_key(encode_key(key)) == td_utils._decode_key_from_filesystem(encode_key(key))


def test_progress_bars_only_when_asked(tmp_path, small_tree, capsys):
    pytest.importorskip("tqdm")
    p = tdz_numba.save(small_tree, tmp_path / "x.tdz", progress=True)
    tdz_numba.verify(p, progress=True)
    tdz_numba.unpack(p, tmp_path / "d", progress=True)
    err = capsys.readouterr().err
    assert "save x.tdz" in err and "verify" in err and "unpack" in err
    tdz_numba.save(small_tree, tmp_path / "y.tdz")  # stderr is not a terminal under pytest: silent
    tdz_numba.verify(tmp_path / "y.tdz", progress=False)
    assert capsys.readouterr().err == ""


def test_save_of_a_foreign_level_writes_only_tensordict_fields(tmp_path):
    """A level read from another format carries that format's fields (HDF5 attributes) in
    ``meta``: save keeps them out of meta.json, where tensordict would take them for children."""
    tree = Level(
        {"g": Level({"w": torch.arange(3.0)}, meta={"lr": 0.1, "shape": []}, keyed=True)},
        meta={"note": "hi"},
        keyed=True,
    )
    p = tdz_numba.save(tree, tmp_path / "f.tdz")
    with zipfile.ZipFile(p) as z:
        root, sub = (json.loads(z.read(n)) for n in ("meta.json", "g/meta.json"))
    assert "note" not in root and "lr" not in sub
    assert root["_class"] == sub["_class"] == "tensordict:TensorDict" and sub["shape"] == []
    assert torch.equal(tdz_numba.load(p)["g"]["w"], torch.arange(3.0))
    td = pytest.importorskip("tensordict")
    out = tmp_path / "unzipped"
    with zipfile.ZipFile(p) as z:
        z.extractall(out)
    assert torch.equal(td.TensorDict.load_memmap(out)["g", "w"], torch.arange(3.0))


def test_save_of_a_loaded_hdf5_file_loads_in_tensordict(tmp_path):
    h5py = pytest.importorskip("h5py")
    td = pytest.importorskip("tensordict")
    with h5py.File(tmp_path / "a.h5", "w") as f:
        f.attrs["note"] = "hi"
        f.create_group("g").attrs["lr"] = 0.1
        f["g"].create_dataset("w", data=np.arange(3.0))
    p = tdz_numba.save(tdz_numba.load(tmp_path / "a.h5"), tmp_path / "a.tdz")
    out = tmp_path / "unzipped"
    with zipfile.ZipFile(p) as z:
        z.extractall(out)
    assert torch.equal(td.TensorDict.load_memmap(out)["g", "w"], torch.arange(3.0, dtype=torch.float64))
