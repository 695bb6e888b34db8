"""Hostile memmap directories and HDF5 files: nothing outside the input's folder is read.

Each case runs every op (open + read every leaf, load, convert to .tdz, ``tdz
info``) in one child process with a memory limit and a per-op timeout
(:mod:`hostile_child`): no crash, no hang, no stray exception, and no byte of a
file outside the input (a secret file in another folder, ``/etc/passwd``)
in any leaf, value, converted archive or printed text. Faster in-process
checks pin the exact refusal for the cases that cannot hang.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch
from hostile_child import OPS, run_ops

import tdz_numba
from tdz_numba import formats
from tdz_numba.errors import BadArchiveError, UnsafeContentError, UnsupportedError
from tdz_numba.files.confine import NotRegularError, OutsideError
from tdz_numba.formats.memmap_dir import open_memmap_dir

h5py = pytest.importorskip("h5py")

SECRET = b"OUTSIDE-SECRET-9d2c!"
PASSWD = Path("/etc/passwd")


def _passwd_marker() -> bytes:
    data = PASSWD.read_bytes() if PASSWD.is_file() else b""
    return data[:8]


def _secret_file(outside: Path) -> Path:
    outside.mkdir(exist_ok=True)
    p = outside / "secret.bin"
    p.write_bytes(SECRET * 64)
    return p


def _memmap_dir(tmp: Path, name: str) -> Path:
    arch = tdz_numba.save({"a": torch.arange(4.0), "s": {"b": torch.ones(2)}}, tmp / f"{name}.tdz")
    return tdz_numba.unpack(arch, tmp / name)


def _pickle_dir(tmp: Path, name: str) -> Path:
    """A memmap directory with an ``obj/other.pickle`` (what tensordict writes for a NonTensorData
    it cannot store as JSON), written by hand in tensordict 0.15.3's layout."""
    d = tmp / name
    (d / "obj").mkdir(parents=True)
    (d / "x.memmap").write_bytes(np.zeros(2, np.float32).tobytes())
    (d / "meta.json").write_text(
        json.dumps(
            {
                "x": {"device": "cpu", "shape": [2], "dtype": "torch.float32", "is_nested": False},
                "obj": {"type": "NonTensorData"},
                "shape": [],
                "device": "cpu",
                "_type": "<class 'tensordict._td.TensorDict'>",
            }
        )
    )
    (d / "obj" / "meta.json").write_text(
        json.dumps({"_type": "<class 'tensordict.tensorclass.NonTensorData'>", "_metadata": None})
    )
    (d / "obj" / "other.pickle").write_bytes(b"\x80\x04K\x01.")
    return d


def _memmap_cases(tmp: Path) -> list[dict]:
    outside = tmp / "outside"
    secret = _secret_file(outside)
    cases = []
    d = _memmap_dir(tmp, "leaf_out")
    (d / "a.memmap").unlink()
    (d / "a.memmap").symlink_to(secret)
    cases.append(("leaf_out", d))
    d = _memmap_dir(tmp, "leaf_out_rel")
    (d / "a.memmap").unlink()
    (d / "a.memmap").symlink_to(Path("..") / "outside" / "secret.bin")
    cases.append(("leaf_out_rel", d))
    d = _memmap_dir(tmp, "level_out")
    lvl = outside / "level"
    shutil.copytree(d / "s", lvl)
    (lvl / "b.memmap").write_bytes(SECRET[:8])
    shutil.rmtree(d / "s")
    (d / "s").symlink_to(lvl)
    cases.append(("level_out", d))
    d = _pickle_dir(tmp, "pickle_out")
    (d / "obj" / "other.pickle").unlink()
    (d / "obj" / "other.pickle").symlink_to(secret)
    cases.append(("pickle_out", d))
    d = _pickle_dir(tmp, "pickle_devzero")
    (d / "obj" / "other.pickle").unlink()
    (d / "obj" / "other.pickle").symlink_to("/dev/zero")
    cases.append(("pickle_devzero", d))
    d = _pickle_dir(tmp, "pickle_fifo")
    (d / "obj" / "other.pickle").unlink()
    os.mkfifo(d / "obj" / "other.pickle")
    cases.append(("pickle_fifo", d))
    d = _memmap_dir(tmp, "leaf_fifo")
    (d / "a.memmap").unlink()
    os.mkfifo(d / "a.memmap")
    cases.append(("leaf_fifo", d))
    return [{"name": n, "path": str(p), "ops": list(OPS)} for n, p in cases]


def test_memmap_dir_hostile_in_child(tmp_path):
    cases = _memmap_cases(tmp_path)
    results = run_ops(cases, [SECRET[:8]], tmp_path)
    for case in cases:
        for op in case["ops"]:
            r = results[(case["name"], op)]
            assert not r["leaks"], r
            assert not r["outcome"].startswith("STRAY"), r
            # every case holds a hostile member that every op meets: all refuse
            assert r["outcome"] != "ok", r
    assert results[("leaf_out", "read")]["outcome"] == "OutsideError"
    assert results[("level_out", "load")]["outcome"] == "OutsideError"
    assert results[("pickle_devzero", "read")]["outcome"] == "OutsideError"
    assert results[("pickle_fifo", "read")]["outcome"] == "NotRegularError"
    assert results[("leaf_fifo", "convert")]["outcome"] == "NotRegularError"


@pytest.mark.parametrize("case", ["leaf_out", "leaf_out_rel", "level_out", "pickle_out", "pickle_devzero"])
def test_memmap_dir_outside_refused(tmp_path, case):
    cases = {c["name"]: c for c in _memmap_cases(tmp_path)}
    with pytest.raises(OutsideError, match="outside") as e:
        open_memmap_dir(cases[case]["path"])
    assert isinstance(e.value, UnsafeContentError) and str(tmp_path / case) in str(e.value)


def test_memmap_dir_inside_symlinks_followed(tmp_path):
    """A leaf or level symlinked to another place inside the directory is read (documented)."""
    d = _memmap_dir(tmp_path, "inside")
    (d / "store").mkdir()
    (d / "a.memmap").rename(d / "store" / "a.bin")
    (d / "a.memmap").symlink_to(Path("store") / "a.bin")
    (d / "s").rename(d / "store" / "s")
    (d / "s").symlink_to(d / "store" / "s")  # absolute, inside
    src = open_memmap_dir(d)
    tree = formats.to_tree(src)
    assert tree["a"].tolist() == [0.0, 1.0, 2.0, 3.0] and tree["s"]["b"].tolist() == [1.0, 1.0]
    src.close()


def test_memmap_dir_other_file_limit(tmp_path, monkeypatch):
    from tdz_numba.formats import memmap_dir

    d = _pickle_dir(tmp_path, "big")
    monkeypatch.setattr(memmap_dir, "MAX_FILE_BYTES", 4)
    with pytest.raises(BadArchiveError, match="5 bytes"):
        open_memmap_dir(d)


# -- tensordict's own artifact: .memmap files longer than the tensor ------------------------------------
# Copied byte for byte from pytorch/tensordict test/artifacts/mmap_example (commit a1a061e3, MIT licence),
# loaded by tensordict's test_load_custom_artifact: int64.memmap holds 17 bytes for 16, bfloat16.memmap 6 for 4.
_ARTIFACT = {
    "meta.json": b'{"nested": {"type": "TensorDict"}, "shape": [2, 1], "device": "cpu", '
    b'"_type": "<class \'tensordict._td.TensorDict\'>"}',
    "nested/meta.json": b'{"int64": {"device": "cpu", "shape": [2, 1], "dtype": "torch.int64", '
    b'"is_nested": false}, "string": {"type": "NonTensorData"}, "bfloat16": {"device": "cpu", '
    b'"shape": [2, 1], "dtype": "torch.bfloat16", "is_nested": false}, "shape": [2, 1], '
    b'"device": "cpu", "_type": "<class \'tensordict._td.TensorDict\'>"}',
    "nested/string/meta.json": b'{"_type": "<class \'tensordict.tensorclass.NonTensorData\'>", '
    b'"data": ["a string!"], "_metadata": null}',
    "nested/int64.memmap": bytes.fromhex("0100000000000000020000000000000000"),
    "nested/bfloat16.memmap": bytes.fromhex("803f803f0a00"),
}


def test_tensordict_artifact_with_trailing_bytes(tmp_path):
    d = tmp_path / "mmap_example"
    for name, data in _ARTIFACT.items():
        (d / name).parent.mkdir(parents=True, exist_ok=True)
        (d / name).write_bytes(data)
    assert (d / "nested" / "int64.memmap").stat().st_size == 17
    src = open_memmap_dir(d)
    tree = formats.to_tree(src)
    assert tree["nested"]["int64"].dtype == torch.int64
    assert tree["nested"]["int64"].tolist() == [[1], [2]]
    assert tree["nested"]["bfloat16"].dtype == torch.bfloat16
    assert torch.equal(tree["nested"]["bfloat16"], torch.ones(2, 1, dtype=torch.bfloat16))
    assert tree["nested"]["string"] == ["a string!"]
    src.close()
    with tdz_numba.open(d) as ar:
        assert ar["nested"]["int64"].tolist() == [[1], [2]]
    td_mod = pytest.importorskip("tensordict")
    td = td_mod.TensorDict.load(d)
    assert torch.equal(td["nested", "int64"], tree["nested"]["int64"])
    assert torch.equal(td["nested", "bfloat16"], tree["nested"]["bfloat16"])
    # one byte short is still refused
    (d / "nested" / "int64.memmap").write_bytes(bytes(15))
    with pytest.raises(BadArchiveError, match="needs 16 bytes, the file holds 15"):
        open_memmap_dir(d)


# -- HDF5 --------------------------------------------------------------------------------------------
_COMPOUND = np.dtype([("a", "<i4"), ("b", "<f4")])


def _sources(outside: Path) -> Path:
    """An HDF5 file outside the input's folder whose datasets hold the secret's bytes."""
    src = outside / "src.h5"
    raw = (SECRET * 4)[:64]
    with h5py.File(src, "w") as f:
        f["f"] = np.frombuffer(raw, np.float32)
        f["c"] = np.frombuffer(raw, _COMPOUND)
        f["s"] = np.frombuffer(raw, "S16")
        f["vs"] = np.array([SECRET.decode()] * 4, dtype=h5py.string_dtype())
        f["g/x"] = np.frombuffer(raw, np.int32)
    return src


def _vds(f, name, src: Path, dset: str, dtype, n: int) -> None:
    layout = h5py.VirtualLayout(shape=(n,), dtype=dtype)
    layout[:] = h5py.VirtualSource(str(src), dset, shape=(n,), dtype=dtype)
    f.create_virtual_dataset(name, layout)


def _hdf5_cases(tmp: Path) -> list[dict]:
    outside = tmp / "outside"
    _secret_file(outside)
    src = _sources(outside)
    folder = tmp / "in"
    folder.mkdir()
    cases = []
    p = folder / "vds.h5"
    with h5py.File(p, "w") as f:
        f["ok"] = np.arange(3.0)
        _vds(f, "v_f4", src, "f", "<f4", 16)
        _vds(f, "v_compound", src, "c", _COMPOUND, 8)
        _vds(f, "v_str", src, "s", "S16", 4)
        _vds(f, "v_vlen", src, "vs", h5py.string_dtype(), 4)
    cases.append(("vds", p))
    if PASSWD.is_file():
        for name, dtype, shape in [
            ("f4", "<f4", (4,)),
            ("compound", _COMPOUND, (2,)),
            ("opaque", np.dtype("V8"), (2,)),
            ("string", "S8", (2,)),
            ("scalar", "<f8", ()),
        ]:
            p = folder / f"ext_{name}.h5"
            with h5py.File(p, "w") as f:
                f["ok"] = np.arange(3.0)
                n = int(np.prod(shape, dtype=np.int64)) * np.dtype(dtype).itemsize
                if shape == ():  # h5py drops external= for scalars: the low-level API keeps it
                    dcpl = h5py.h5p.create(h5py.h5p.DATASET_CREATE)
                    dcpl.set_external(os.fsencode(PASSWD), 0, n)
                    space = h5py.h5s.create(h5py.h5s.SCALAR)
                    h5py.h5d.create(f.id, b"e", h5py.h5t.IEEE_F64LE, space, dcpl=dcpl)
                else:
                    f.create_dataset("e", shape=shape, dtype=dtype, external=[(str(PASSWD), 0, n)])
            cases.append((f"ext_{name}", p))
    p = folder / "links.h5"
    with h5py.File(p, "w") as f:
        f["ok"] = np.arange(3.0)
        f["el"] = h5py.ExternalLink(str(src), "/f")
        f["el_group"] = h5py.ExternalLink(str(src), "/g")
        f["el_root"] = h5py.ExternalLink(str(src), "/")
        f["soft_through"] = h5py.SoftLink("/el_root/c")
        f["soft_chain"] = h5py.SoftLink("/soft_to_root/vs")
        f["soft_to_root"] = h5py.SoftLink("/el_root")
    cases.append(("links", p))
    return [{"name": n, "path": str(p), "ops": list(OPS)} for n, p in cases]


def test_hdf5_hostile_in_child(tmp_path):
    cases = _hdf5_cases(tmp_path)
    # the same files opened with allow_external=True: refused (every other file is outside)
    cases += [
        {
            "name": c["name"] + "+allow",
            "path": c["path"],
            "ops": ["read"],
            "options": {"allow_external": True},
        }
        for c in list(cases)
    ]
    markers = [SECRET[:8]] + ([_passwd_marker()] if PASSWD.is_file() else [])
    results = run_ops(cases, markers, tmp_path)
    for case in cases:
        for op in case["ops"]:
            r = results[(case["name"], op)]
            assert not r["leaks"], r
            assert not r["outcome"].startswith("STRAY"), r
    for c in cases:
        name = c["name"]
        if name.endswith("+allow"):
            assert results[(name, "read")]["outcome"] == "OutsideError", name
        elif name == "links":  # links to other files are left out: the rest reads
            assert all(results[(name, op)]["outcome"] == "ok" for op in OPS), results
        else:  # each refused dataset refuses when read
            assert results[(name, "read")]["outcome"] == "UnsupportedError", (name, results[(name, "read")])
            assert results[(name, "convert")]["outcome"] == "UnsupportedError"


def _leaf(src, key):
    return src.level("").children[key]


def test_hdf5_refusals_in_process(tmp_path):
    cases = {c["name"]: Path(c["path"]) for c in _hdf5_cases(tmp_path)}
    src = formats.open_source(cases["vds"])
    for key in ("v_f4", "v_compound", "v_str", "v_vlen"):
        child = _leaf(src, key)
        assert child.kind == "leaf", key  # not read at open: a refusing leaf
        with pytest.raises(UnsupportedError, match="virtual dataset.*allow_external=True"):
            child.leaf.loader()
    assert tdz_numba.open(cases["vds"])["ok"].tolist() == [0.0, 1.0, 2.0]
    src.close()
    for name in [n for n in cases if n.startswith("ext_")]:
        src = formats.open_source(cases[name])
        with pytest.raises(UnsupportedError, match="external raw storage"):
            _leaf(src, "e").leaf.loader()
        src.close()
    src = formats.open_source(cases["links"])
    assert sorted(src.level("").children) == ["ok"]
    src.close()
    # with allow_external: the outside files are named in the error
    with pytest.raises(OutsideError, match="outside the input's folder"):
        formats.open_source(cases["links"], allow_external=True)


def test_hdf5_allow_external_inside(tmp_path):
    folder = tmp_path / "in"
    (folder / "sub").mkdir(parents=True)
    raw = np.arange(6, dtype=">f4")
    (folder / "sub" / "raw.bin").write_bytes(b"HEAD" + raw.tobytes())
    other = folder / "other.h5"
    with h5py.File(other, "w") as f:
        f["x"] = np.arange(5, dtype=np.int16)
        f["c"] = np.array([(1, 2.0), (3, 4.0)], _COMPOUND)
        f["g/y"] = np.arange(3.0)
    p = folder / "main.h5"
    with h5py.File(p, "w") as f:
        f.create_dataset(
            "ext", shape=(2, 3), dtype=">f4", external=[("sub/raw.bin", 4, 12), ("sub/raw.bin", 16, 12)]
        )
        _vds(f, "vds", other, "x", "<i2", 5)
        layout = h5py.VirtualLayout(shape=(5,), dtype="<i2")
        layout[:] = h5py.VirtualSource("other.h5", "x", shape=(5,))
        f.create_virtual_dataset("vds_rel", layout)
        f["el"] = h5py.ExternalLink("other.h5", "/x")
        f["el_c"] = h5py.ExternalLink("other.h5", "/c")
        f["el_g"] = h5py.ExternalLink("other.h5", "/g")
        f["soft"] = h5py.SoftLink("/el_g/y")
    src = formats.open_source(p, allow_external=True)
    tree = formats.to_tree(src)
    assert tree["ext"].dtype == torch.float32 and tree["ext"].tolist() == [[0, 1, 2], [3, 4, 5]]
    assert tree["vds"].tolist() == [0, 1, 2, 3, 4] and tree["vds_rel"].tolist() == [0, 1, 2, 3, 4]
    assert tree["el"].tolist() == [0, 1, 2, 3, 4] and tree["el_g"]["y"].tolist() == [0.0, 1.0, 2.0]
    assert tree["soft"].tolist() == [0.0, 1.0, 2.0]
    assert tree["el_c"].tolist() == [(1, 2.0), (3, 4.0)]
    # another file: read through h5py, never the input mapping
    assert _leaf(src, "el").leaf.loader is not None
    src.close()
    pc = folder / "compound.h5"
    with h5py.File(pc, "w") as f:
        f.create_dataset("ext_c", shape=(2,), dtype=_COMPOUND, external=[("sub/raw.bin", 0, 16)])
    src = formats.open_source(pc, allow_external=True)
    with pytest.raises(UnsupportedError, match="only numeric external storage"):
        _leaf(src, "ext_c").leaf.loader()
    src.close()
    # by default none of them is read
    src = formats.open_source(p)
    assert sorted(src.level("").children) == ["ext", "vds", "vds_rel"]
    with pytest.raises(UnsupportedError, match="allow_external=True"):
        _leaf(src, "ext").leaf.loader()
    src.close()
    # a file inside the folder that is a symlink leading out is refused even when allowed
    (folder / "sub" / "raw.bin").unlink()
    (folder / "sub" / "raw.bin").symlink_to(_secret_file(tmp_path / "outside"))
    with pytest.raises(OutsideError, match="symlink"):
        formats.open_source(p, allow_external=True)
    # a FIFO in its place: refused, never opened blocking
    (folder / "sub" / "raw.bin").unlink()
    os.mkfifo(folder / "sub" / "raw.bin")
    with pytest.raises(NotRegularError, match="FIFO"):
        formats.open_source(p, allow_external=True)
