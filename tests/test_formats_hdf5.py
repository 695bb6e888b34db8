"""HDF5 reader (h5py optional): groups, attributes, zero-copy contiguous datasets, loaders for the rest."""

from __future__ import annotations

import builtins
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from fuzz_readers import LONG_ITERATIONS, fuzz_iterations, require_fuzz_selected, run_fuzz

from tdz_numba.errors import BadArchiveError, TdzError, UnsupportedError
from tdz_numba.formats.hdf5 import detect_hdf5, open_hdf5
from tdz_numba.tdz.sources import tensor_from_spec

h5py = pytest.importorskip("h5py")


def _leaf(src, *keys):
    prefix = ""
    for k in keys[:-1]:
        prefix = src.level(prefix).children[k].path
    return src.level(prefix).children[keys[-1]]


def _read(src, *keys):
    return tensor_from_spec(_leaf(src, *keys).leaf, src.files)


def _sample(path):
    rng = np.random.default_rng(0)
    data = {
        "f32": rng.standard_normal((4, 5)).astype(np.float32),
        "i64": np.arange(12, dtype=np.int64).reshape(3, 4),
        "u8": np.arange(7, dtype=np.uint8),
        "f16": rng.standard_normal(6).astype(np.float16),
        "bool": np.array([True, False, True]),
        "c64": (rng.standard_normal(3) + 1j).astype(np.complex64),
    }
    with h5py.File(path, "w") as f:
        f.attrs["title"] = "demo"
        f.attrs["version"] = np.int32(3)
        f.attrs["scales"] = np.array([0.5, 2.0])
        f.attrs["raw"] = np.bytes_(b"bytes")
        for k, v in data.items():
            f.create_dataset(k, data=v)
        g = f.create_group("model/layer0")
        g.attrs["kind"] = "linear"
        f["model"].attrs["depth"] = 1
        g.create_dataset("w_gzip", data=data["f32"], compression="gzip", chunks=(2, 5))
        g.create_dataset("w_chunked", data=data["i64"], chunks=(1, 4))
        g.create_dataset("w_be", data=data["i64"].astype(">i4"))
        g.create_dataset("scalar", data=3.5)
        g.create_dataset("name", data="hello")
        g.create_dataset("names", data=["a", "bc"], dtype=h5py.string_dtype())
        g.create_dataset("empty", shape=(0, 3), dtype="f4")
        g.create_dataset("unallocated", shape=(2, 2), dtype="f4", fillvalue=7.0)
        dcpl = h5py.h5p.create(h5py.h5p.DATASET_CREATE)
        dcpl.set_layout(h5py.h5d.COMPACT)
        h5py.h5d.create(g.id, b"compact", h5py.h5t.NATIVE_INT32, h5py.h5s.create_simple((4,)), dcpl=dcpl)
        g["compact"][...] = [1, 2, 3, 4]
        g["self"] = f["model"]  # a hard link back up: a cycle
        f["soft"] = h5py.SoftLink("/f32")
        f["dangling"] = h5py.SoftLink("/nowhere")
        f["ext"] = h5py.ExternalLink("/etc/passwd", "/x")
    return data


def test_read_everything(tmp_path):
    p = tmp_path / "a.h5"
    data = _sample(p)
    assert detect_hdf5(p.read_bytes()[:4096], p)
    src = open_hdf5(p)
    assert src.format == "hdf5"
    assert src.metadata == {"title": "demo", "version": 3, "scales": [0.5, 2.0], "raw": "bytes"}
    base = src.files[0].torch_u8.data_ptr()
    for k, v in data.items():
        spec = _leaf(src, k).leaf
        t = _read(src, k)
        assert spec.loader is None and spec.nbytes == v.nbytes
        if spec.offset % v.itemsize == 0:  # h5py packs datasets unaligned; aligned ones are views
            assert t.data_ptr() == base + spec.offset
        assert np.array_equal(t.numpy(), v), k
    assert np.array_equal(_read(src, "soft").numpy(), data["f32"])
    assert "dangling" not in src.level("").children and "ext" not in src.level("").children
    model = src.level(_leaf(src, "model").path)
    assert model.meta == {"depth": 1}
    layer = src.level(model.children["layer0"].path)
    assert layer.meta == {"kind": "linear"}
    assert "self" not in layer.children  # the cycle is walked once
    for k, want in [
        ("w_gzip", data["f32"]),
        ("w_chunked", data["i64"]),
        ("w_be", data["i64"].astype(np.int32)),
        ("compact", np.array([1, 2, 3, 4], np.int32)),
        ("unallocated", np.full((2, 2), 7, np.float32)),
        ("empty", np.zeros((0, 3), np.float32)),
    ]:
        spec = layer.children[k].leaf
        t = tensor_from_spec(spec, src.files)
        assert t.dtype == torch.from_numpy(want).dtype and np.array_equal(t.numpy(), want), k
        if k not in ("empty",):
            assert spec.loader is not None, k
    assert layer.children["scalar"].kind == "value" and layer.children["scalar"].leaf == 3.5
    assert layer.children["name"].leaf == "hello"
    assert layer.children["names"].leaf == ["a", "bc"]
    src.close()
    assert src._h5 is None


def test_storage_described(tmp_path):
    """Leaves read through h5py say how they are stored (not "stored (0 B stored)")."""
    p = tmp_path / "a.h5"
    _sample(p)
    src = open_hdf5(p)
    got = {}
    for k in ("w_gzip", "w_chunked", "w_be", "unallocated", "compact", "empty"):
        spec = _leaf(src, "model", "layer0", k).leaf
        got[k] = (spec.codec, spec.nbytes, spec.size)
    h5 = h5py.File(p, "r")
    gz = h5["model/layer0/w_gzip"].id.get_storage_size()
    h5.close()
    assert got == {
        "w_gzip": ("chunked+gzip", gz, 80),
        "w_chunked": ("chunked", 96, 96),
        "w_be": ("stored", 48, 48),
        "unallocated": ("unallocated", 0, 16),
        "compact": ("compact", 16, 16),
        "empty": ("stored", 0, 0),
    }
    assert _read(src, "model", "layer0", "w_gzip").shape == (4, 5)
    src.close()


def test_userblock_detection(tmp_path):
    p = tmp_path / "ub.h5"
    with h5py.File(p, "w", userblock_size=8192) as f:
        f.create_dataset("x", data=np.arange(5.0))
    head = p.read_bytes()[:4096]
    assert not detect_hdf5(head) and detect_hdf5(head, p)
    src = open_hdf5(p)
    assert _read(src, "x").tolist() == [0, 1, 2, 3, 4]
    assert _leaf(src, "x").leaf.offset > 8192
    src.close()
    assert not detect_hdf5(b"\x00" * 4096, None)


def test_virtual_and_external_storage_refused(tmp_path):
    ext = tmp_path / "raw.bin"
    ext.write_bytes(np.arange(4, dtype=np.float32).tobytes())
    p = tmp_path / "v.h5"
    with h5py.File(p, "w") as f:
        f.create_dataset("ext", shape=(4,), dtype="f4", external=[(str(ext), 0, 16)])
        layout = h5py.VirtualLayout(shape=(4,), dtype="f4")
        layout[:] = h5py.VirtualSource(str(tmp_path / "other.h5"), "x", shape=(4,))
        f.create_virtual_dataset("vds", layout)
    src = open_hdf5(p)
    for k in ("ext", "vds"):
        with pytest.raises(UnsupportedError):
            _read(src, k)
    src.close()


@pytest.mark.parametrize("cut", [0, 8, 100, 600, 1500])
def test_malformed(tmp_path, cut):
    p = tmp_path / "a.h5"
    _sample(p)
    data = p.read_bytes()
    bad = tmp_path / "bad.h5"
    bad.write_bytes(data[:cut])
    with pytest.raises(TdzError):
        src = open_hdf5(bad)
        # some truncations open: reading what is missing must fail cleanly
        for k in ("f32", "i64"):
            _read(src, k)
        raise BadArchiveError("opened a truncated file without noticing")  # pragma: no cover


def test_not_hdf5(tmp_path):
    p = tmp_path / "x.h5"
    p.write_bytes(b"not hdf5 at all" * 10)
    with pytest.raises(BadArchiveError):
        open_hdf5(p)


def test_without_h5py(tmp_path, monkeypatch):
    p = tmp_path / "a.h5"
    _sample(p)
    real_import = builtins.__import__

    def fake_import(name, *a, **kw):
        if name == "h5py" or name.startswith("h5py."):
            raise ImportError("no h5py")
        return real_import(name, *a, **kw)

    monkeypatch.setattr(builtins, "__import__", fake_import)
    for mod in [m for m in sys.modules if m == "h5py" or m.startswith("h5py.")]:
        monkeypatch.delitem(sys.modules, mod)
    with pytest.raises(UnsupportedError, match="h5py"):
        open_hdf5(p)


def test_fuzz_hdf5(tmp_path):
    p = tmp_path / "seed.h5"
    with h5py.File(p, "w") as f:
        f.attrs["a"] = 1
        f.create_dataset("x", data=np.arange(16.0))
        f.create_dataset("g/y", data=np.arange(8, dtype=np.int32), chunks=(4,), compression="gzip")
        f["g"].attrs["s"] = "t"
        # attributes the reader decodes itself: variable-length strings (a global heap), big-endian
        # numbers, fixed strings, booleans; and one h5py reads (a compound)
        f["g"].attrs["vs"] = ["ab", "c"]
        f["x"].attrs["be"] = np.arange(3, dtype=">i4")
        f["x"].attrs["fixed"] = np.bytes_(b"xyz")
        f["x"].attrs["flag"] = True
        f["g/y"].attrs["pair"] = np.array((1, 2.0), [("a", "<i2"), ("b", "<f4")])[()]
    n = fuzz_iterations(400)
    accepted = run_fuzz(p, "tdz_numba.formats.hdf5.open_hdf5", n, tmp_path, head=2048, suffix=".h5")
    # the mutants reach past the superblock check: a share opens and reads every leaf
    assert accepted >= n // 10, f"only {accepted} of {n} mutants accepted"
    assert accepted < n  # and the damage is seen


def test_fuzz_hdf5_hostile_seed(tmp_path):
    """Mutants of a file whose datasets and links name other files (virtual sources, external
    storage at /etc/passwd, external links): refused cleanly, never a stray error."""
    src = tmp_path / "src.h5"
    with h5py.File(src, "w") as f:
        f["x"] = np.arange(4.0)
    p = tmp_path / "seed.h5"
    with h5py.File(p, "w") as f:
        f.create_dataset("ok", data=np.arange(8.0))
        f.create_dataset("ext", shape=(2,), dtype=[("a", "<i4")], external=[("/etc/passwd", 0, 8)])
        f["el"] = h5py.ExternalLink(str(src), "/x")
        f["soft"] = h5py.SoftLink("/el")
        f["g/deep"] = h5py.SoftLink("/soft")
        layout = h5py.VirtualLayout(shape=(4,), dtype="f8")
        layout[:] = h5py.VirtualSource(str(src), "x", shape=(4,))
        f.create_virtual_dataset("vds", layout)  # refused from its header: libhdf5 never opens it
    n = fuzz_iterations(300)
    # an intact mutant refuses its external dataset when read (a TdzError): few are "accepted"
    run_fuzz(p, "tdz_numba.formats.hdf5.open_hdf5", n, tmp_path, rseed=2, head=4096, suffix=".h5")


_FIXTURE = Path(__file__).parent / "fixtures" / "hdf5_vds_mutant_hang.h5"
_READ_ALL = """
import sys
from tdz_numba.errors import UnsupportedError
from tdz_numba.formats.hdf5 import open_hdf5
from tdz_numba.tdz.sources import tensor_from_spec
src = open_hdf5(sys.argv[1])
for key, child in sorted(src.level("").children.items()):
    try:
        print(key, tensor_from_spec(child.leaf, src.files).tolist())
    except UnsupportedError as e:
        print(key, "refused:", e)
src.close()
"""


def test_vds_mutant_refused_before_libhdf5():
    """tests/fixtures/hdf5_vds_mutant_hang.h5 (a fuzz mutant of a file with a virtual dataset)
    sends libhdf5's open of '/vds' into a CPU loop (> 5 min measured). The reader reads the
    object's header itself, sees the virtual layout and refuses it before h5py opens it; the
    rest of the file reads. Run in a child: on the old reader this hangs, and fails here."""
    import subprocess

    try:
        proc = subprocess.run(
            [sys.executable, "-c", _READ_ALL, str(_FIXTURE)], timeout=60, capture_output=True, text=True
        )
    except subprocess.TimeoutExpired:
        raise AssertionError("the reader still hangs on the damaged virtual dataset") from None
    assert proc.returncode == 0, proc.stderr[-2000:]
    lines = dict(line.split(" ", 1) for line in proc.stdout.splitlines())
    assert lines["ok"] == str([float(i) for i in range(8)])
    assert lines["vds"].startswith("refused: dataset '/vds': a virtual dataset")
    assert lines["ext"].startswith("refused: dataset '/ext': external raw storage")


def test_vds_mutant_allowed_is_probed_in_a_child(tmp_path, monkeypatch):
    """With allow_external=True libhdf5 must open the virtual dataset: it does so in a child
    process first, and a loop there is refused after PROBE_TIMEOUT (not a hang here)."""
    import shutil

    from tdz_numba.formats import hdf5_walk

    p = tmp_path / "m.h5"
    shutil.copy(_FIXTURE, p)
    monkeypatch.setattr(hdf5_walk, "PROBE_TIMEOUT", 3.0)
    with pytest.raises(BadArchiveError, match="did not finish opening it in 3 s"):
        hdf5_walk.probe_in_child(str(p), (("vds", 0),), str(p))
    hdf5_walk.probe_in_child(str(p), (("ok", 0),), str(p))  # an intact dataset opens


def test_detect_and_open_source(tmp_path):
    from tdz_numba import formats

    p = tmp_path / "data.bin"
    with h5py.File(p, "w", userblock_size=4096) as f:
        f.create_dataset("g/x", data=np.arange(3.0))
    assert formats.detect(p) == "hdf5"
    src = formats.open_source(p)
    assert src.format == "hdf5" and formats.to_tree(src)["g"]["x"].tolist() == [0, 1, 2]
    src.close()


@pytest.mark.fuzz
def test_fuzz_hdf5_long(tmp_path, request):
    require_fuzz_selected(request)
    p = tmp_path / "seed.h5"
    with h5py.File(p, "w") as f:
        f.attrs["a"] = np.arange(3)
        f.create_dataset("x", data=np.arange(16.0))
        f.create_dataset("g/y", data=np.arange(8, dtype=np.int32), chunks=(4,), compression="gzip")
        f.create_dataset("g/s", data="text")
        f["g"].attrs["s"] = "t"
        f["g"].attrs["vs"] = ["ab", "c"]
        f["x"].attrs["be"] = np.arange(3, dtype=">f8")
        f["x"].attrs["flag"] = np.array([True, False])
    n = fuzz_iterations(LONG_ITERATIONS)
    run_fuzz(
        p,
        "tdz_numba.formats.hdf5.open_hdf5",
        n,
        tmp_path,
        rseed=1,
        head=4096,
        suffix=".h5",
        timeout=max(120.0, n / 10),
    )


def test_through_tdz_numba_open(tmp_path):
    """The public API over an HDF5 file (runs once Archive reads foreign formats)."""
    import tdz_numba

    if not hasattr(tdz_numba.Archive, "format"):
        pytest.skip("tdz_numba.open does not read foreign formats in this build yet")
    p = tmp_path / "a.h5"
    data = _sample(p)
    with tdz_numba.open(p) as ar:
        assert ar.format == "hdf5" and ar.metadata["title"] == "demo"
        assert np.array_equal(ar["f32"].numpy(), data["f32"])
        assert np.array_equal(ar["model"]["layer0"]["w_gzip"].numpy(), data["f32"])
        assert ar.info("model/layer0/w_gzip").zero_copy is False


# the damaged attribute fixture (hdf5_attr_mutant_hang.h5): tests/test_formats_hdf5_attrs.py
