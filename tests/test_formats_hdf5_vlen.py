"""HDF5 datasets of variable-length types (tdz_numba/formats/hdf5_vlen.py): the global heap
collections their references name are walked by the reader before libhdf5 reads one.

A collection with a free-space object of 0 bytes sends libhdf5 into an endless loop (the bug of
tests/fixtures/hdf5_attr_mutant_hang.h5, there behind an attribute). Behind a string, sequence
or compound dataset, its fill value or its chunks, the old reader handed such a dataset to h5py
and hung at open; each damaged file is opened here in a child with a timeout. The undamaged
files agree with h5py bit for bit (tests/hdf5_oracle.py).
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from fuzz_readers import fuzz_iterations, run_fuzz
from hdf5_oracle import compare

from tdz_numba.errors import UnsupportedError
from tdz_numba.formats.hdf5 import open_hdf5
from tdz_numba.tdz.sources import tensor_from_spec

h5py = pytest.importorskip("h5py")

__all__ = ["vlen_files", "zero_free_space"]


def _gcols(data: bytes) -> list[int]:
    out, i = [], data.find(b"GCOL")
    while i >= 0:
        out.append(i)
        i = data.find(b"GCOL", i + 1)
    return out


def zero_free_space(data: bytes, gcol: int, lsz: int = 8) -> bytes:
    """``data`` with a free-space object of 0 bytes written right after the last object of the
    global heap collection at ``gcol`` (libhdf5 steps 0 bytes ahead there, forever)."""
    hdr = 8 + lsz
    p = gcol + hdr
    while int.from_bytes(data[p : p + 2], "little"):
        p += hdr + ((int.from_bytes(data[p + 8 : p + 8 + lsz], "little") + 7) & ~7)
    return data[:p] + bytes(hdr) + data[p + hdr :]


def _strings(n: int = 2) -> np.ndarray:
    return np.array(["hello", "wörld", "", "x" * 40][:n], dtype=h5py.string_dtype())


def _seqs() -> np.ndarray:
    a = np.empty(3, object)
    a[0], a[1], a[2] = np.arange(3, dtype="<i4"), np.arange(0, dtype="<i4"), np.arange(5, dtype="<i4")
    return a


def _nested() -> np.ndarray:
    """Sequences of sequences of int32: the outer heap objects hold references themselves."""
    a = np.empty(2, object)
    a[0] = np.empty(2, object)
    a[0][0], a[0][1] = np.arange(3, dtype="<i4"), np.arange(1, dtype="<i4")
    a[1] = np.empty(1, object)
    a[1][0] = np.arange(2, dtype="<i4")
    return a


_NESTED = h5py.vlen_dtype(h5py.vlen_dtype(np.dtype("<i4")))
_COMP = np.dtype([("a", "<i4"), ("s", h5py.string_dtype()), ("b", "<f8")])
_ARR = np.dtype([("n", "<i2"), ("pair", h5py.string_dtype(), (2,))])

#: name -> (libver or h5py.File keywords, writer of dataset "s" into an open file)
_KINDS = {
    "vstr": ("earliest", lambda f: f.create_dataset("s", data=_strings(4))),
    "vstr_latest": ("latest", lambda f: f.create_dataset("s", data=_strings(4))),
    "vstr_2d": ("earliest", lambda f: f.create_dataset("s", data=_strings(4).reshape(2, 2))),
    "vstr_scalar": ("earliest", lambda f: f.create_dataset("s", data="hello", dtype=h5py.string_dtype())),
    "vstr_compact": (
        "earliest",
        lambda f: f.create_dataset("s", data=_strings(4), dcpl=_compact()),
    ),
    "vseq": ("earliest", lambda f: f.create_dataset("s", data=_seqs(), dtype=h5py.vlen_dtype("<i4"))),
    "compound": (
        "earliest",
        lambda f: f.create_dataset("s", data=np.array([(1, "x", 0.5), (2, "yz", -1.0)], _COMP)),
    ),
    "compound_array": (
        "latest",
        lambda f: f.create_dataset("s", data=np.array([(1, ["a", "b"]), (2, ["cd", ""])], _ARR)),
    ),
    "fill": (
        "earliest",
        lambda f: f.create_dataset("s", (4,), dtype=h5py.string_dtype(), fillvalue="abc"),
    ),
    "chunked": ("earliest", lambda f: f.create_dataset("s", data=_strings(4), chunks=(2,))),
    "chunked_latest": (
        "latest",
        lambda f: f.create_dataset("s", data=_strings(4), chunks=(2,), maxshape=(None,)),
    ),
    "chunked_userblock": (
        {"userblock_size": 512},
        lambda f: f.create_dataset("s", data=_strings(4), chunks=(2,), compression="gzip"),
    ),
    "nested": ("earliest", lambda f: f.create_dataset("s", data=_nested(), dtype=_NESTED)),
    "chunked_gzip": (
        "earliest",
        lambda f: f.create_dataset("s", data=_strings(4), chunks=(3,), compression="gzip", shuffle=True),
    ),
}


def _compact():
    dcpl = h5py.h5p.create(h5py.h5p.DATASET_CREATE)
    dcpl.set_layout(h5py.h5d.COMPACT)
    return dcpl


def vlen_files(folder: Path) -> dict[str, tuple[Path, Path]]:
    """Every kind of variable-length dataset: name -> (the file, the file with its heap damaged)."""
    folder.mkdir(parents=True, exist_ok=True)
    out = {}
    for name, (libver, write) in _KINDS.items():
        p = folder / f"{name}.h5"
        kw = libver if isinstance(libver, dict) else {"libver": libver}
        with h5py.File(p, "w", **kw) as f:
            f["ok"] = np.arange(3.0)
            write(f)
        data = p.read_bytes()
        gcols = _gcols(data)
        assert len(gcols) == 1, (name, gcols)
        q = folder / f"{name}_bad.h5"
        q.write_bytes(zero_free_space(data, gcols[0]))
        out[name] = (p, q)
    return out


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    return vlen_files(tmp_path_factory.mktemp("vlen"))


@pytest.mark.parametrize("name", sorted(_KINDS))
def test_undamaged_agree_with_h5py(files, name):
    rep = compare(files[name][0])
    assert rep.mismatches == [] and rep.missing == [] and rep.refused == []
    assert rep.leaves + rep.values >= 2


_OPEN = """
import json, sys
from tdz_numba.errors import BadArchiveError
from tdz_numba.formats.hdf5 import open_hdf5
out = {}
for path in sys.argv[1:]:
    try:
        open_hdf5(path).close()
        out[path] = "OPENED"
    except BadArchiveError as e:
        out[path] = "REFUSED " + str(e)
print(json.dumps(out))
"""


def _open_in_child(paths: list[Path], timeout: int = 60) -> dict[str, str]:
    try:
        proc = subprocess.run(
            [sys.executable, "-c", _OPEN, *map(str, paths)],
            timeout=timeout,
            capture_output=True,
            text=True,
        )
    except subprocess.TimeoutExpired:
        raise AssertionError("opening a damaged variable-length dataset still loops") from None
    assert proc.returncode == 0, proc.stderr[-2000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


def test_damaged_heap_refused_not_a_hang(files):
    """The old reader hands each of these datasets to h5py, whose read of the damaged collection
    never ends (the child times out: this test fails on main); now each is refused naming the
    file, the dataset and the collection."""
    got = _open_in_child([files[name][1] for name in sorted(_KINDS)])
    for name in sorted(_KINDS):
        q = str(files[name][1])
        assert got[q].startswith(f"REFUSED {q}: dataset '/s': global heap collection at "), (name, got[q])
        assert got[q].endswith("a free-space object of 0 bytes (libhdf5 loops on it)"), (name, got[q])


def _patched(src: Path, dst: Path, patch) -> Path:
    data = bytearray(src.read_bytes())
    gcol = data.find(b"GCOL")
    pos, raw = patch(gcol)
    data[pos : pos + len(raw)] = raw
    dst.write_bytes(bytes(data))
    return dst


@pytest.mark.parametrize(
    "what, patch, message",
    [
        ("signature", lambda g: (g, b"XCOL"), "no collection there"),
        ("version", lambda g: (g + 4, b"\x07"), "version 7"),
        ("size", lambda g: (g + 8, (1 << 40).to_bytes(8, "little")), "past the end of the file"),
        ("object size", lambda g: (g + 16 + 8, (3).to_bytes(8, "little")), "holds 3 bytes"),
        ("object index", lambda g: (g + 16, (9).to_bytes(2, "little")), "no object 1 "),
    ],
)
def test_damaged_collection_claims(files, tmp_path, what, patch, message):
    """Each claim of a collection behind a string dataset is checked (in a child: libhdf5 is never
    trusted with a damaged heap in this process)."""
    q = _patched(files["vstr_scalar"][0], tmp_path / f"{what.replace(' ', '_')}.h5", patch)
    got = _open_in_child([q])[str(q)]
    assert got.startswith(f"REFUSED {q}: dataset '/s': ") and message in got, got


def test_reference_past_the_file(files, tmp_path):
    p = files["vseq"][0]
    data = bytearray(p.read_bytes())
    gcol = data.find(b"GCOL")
    at = data.find(gcol.to_bytes(8, "little"))  # the first reference's collection address
    assert at > 0
    data[at : at + 8] = (len(data) + 4096).to_bytes(8, "little")
    q = tmp_path / "past.h5"
    q.write_bytes(bytes(data))
    got = _open_in_child([q])[str(q)]
    assert "a heap reference to address" in got and "past the end of the file" in got, got


def test_nested_reference_checked(files, tmp_path):
    """The references inside a sequence of sequences' outer heap objects are checked too: an
    inner reference to an object the collection lacks is refused."""
    from tdz_numba.formats.hdf5_attrs import heap_collection
    from tdz_numba.formats.hdf5_objects import Layout

    p = files["nested"][0]
    data = bytearray(p.read_bytes())
    lay = Layout.read(np.frombuffer(bytes(data), np.uint8), str(p))
    col = heap_collection(lay, data.find(b"GCOL"), {})
    outer = [
        pos for pos, size in zip(col.pos.tolist(), col.size.tolist()) if size == 32
    ]  # [[0, 1, 2], [0]]: two references
    assert len(outer) == 1
    data[outer[0] + 12 : outer[0] + 16] = (99).to_bytes(4, "little")  # the first one's index
    q = tmp_path / "nested_inner.h5"
    q.write_bytes(bytes(data))
    got = _open_in_child([q])[str(q)]
    assert got.startswith(f"REFUSED {q}: dataset '/s': no object 99 in the global heap collection"), got


def test_chunk_filter_not_checked_is_a_refused_leaf(tmp_path):
    """A chunked variable-length dataset whose filter this reader does not undo (lzf) is a leaf
    that refuses when read: its chunks' references cannot be checked, so h5py never reads it."""
    p = tmp_path / "lzf.h5"
    with h5py.File(p, "w") as f:
        f.create_dataset("s", data=_strings(4), chunks=(2,), compression="lzf")
        f["n"] = np.arange(3.0)
    src = open_hdf5(p)
    try:
        spec = src.level("").children["s"].leaf
        with pytest.raises(UnsupportedError, match="filter 32000: only deflate, shuffle and fletcher32"):
            tensor_from_spec(spec, src.files)
        n = src.level("").children["n"].leaf
        assert tensor_from_spec(n, src.files).tolist() == [0.0, 1.0, 2.0]
    finally:
        src.close()


def test_virtual_vlen_refused_with_allow_external(tmp_path):
    """A virtual dataset of strings reads its sources' heaps, which this reader does not check:
    refused even with allow_external=True (before libhdf5 opens it)."""
    src_file = tmp_path / "src.h5"
    with h5py.File(src_file, "w") as f:
        f["vs"] = _strings(4)
    p = tmp_path / "vds.h5"
    with h5py.File(p, "w") as f:
        layout = h5py.VirtualLayout(shape=(4,), dtype=h5py.string_dtype())
        layout[:] = h5py.VirtualSource("src.h5", "vs", shape=(4,))
        f.create_virtual_dataset("v", layout)
    src = open_hdf5(p, allow_external=True)
    try:
        spec = src.level("").children["v"].leaf
        with pytest.raises(UnsupportedError, match="its global heap is in other files"):
            tensor_from_spec(spec, src.files)
    finally:
        src.close()


@pytest.mark.parametrize(
    "name, datasets",
    [
        (
            "test_compact_datasets_earliest.hdf5",
            ["string/variable_length_ascii", "string/variable_length_utf8"],
        ),
        ("test_scalar_empty_datasets_earliest.hdf5", ["scalar_string"]),
        ("vlen_string_s390x.h5", ["DSvariable"]),
    ],
)
def test_real_files_references_checked(name, datasets):
    """Variable-length datasets of files other tools wrote (tests/fixtures/hdf5_real: jhdf's
    compact and scalar strings, a big-endian machine's strings) have their references read and
    every one found in its collection (the data agree with h5py: tests/test_campaign_real.py)."""
    from tdz_numba.formats.hdf5_objects import Layout
    from tdz_numba.formats.hdf5_vlen import VlenCheck

    p = Path(__file__).parent / "fixtures" / "hdf5_real" / name
    lay = Layout.read(np.fromfile(p, np.uint8), str(p))
    with h5py.File(p, "r") as f:
        for key in datasets:
            check = VlenCheck(lay, lay.header(h5py.h5o.get_info(f[key].id).addr + lay.base), key, {})
            assert check.has_vlen and not check.limit
            assert check.contiguous() == max(f[key].size, 1)


def test_fuzz_vlen_seed(tmp_path):
    """Mutants of a file of variable-length datasets (strings, sequences, a compound, a fill
    value, gzip chunks) and their heaps: each opens or is refused, never a hang or a stray error
    (in a child with a timeout); a share still opens and reads every leaf."""
    p = tmp_path / "seed.h5"
    with h5py.File(p, "w", libver="earliest") as f:
        f["n"] = np.arange(4.0)
        f["s"] = _strings(4)
        f.create_dataset("q", data=_seqs(), dtype=h5py.vlen_dtype("<i4"))
        f["c"] = np.array([(1, "x", 0.5), (2, "yz", -1.0)], _COMP)
        f.create_dataset("fill", (3,), dtype=h5py.string_dtype(), fillvalue="abc")
        f.create_dataset("z", data=_strings(4), chunks=(2,), compression="gzip", shuffle=True)
    n = fuzz_iterations(300)
    accepted = run_fuzz(p, "tdz_numba.formats.hdf5.open_hdf5", n, tmp_path, rseed=5, suffix=".h5")
    assert n // 20 <= accepted < n, f"{accepted} of {n} mutants accepted"


_READ_ALL = """
import resource, sys, traceback
resource.setrlimit(resource.RLIMIT_AS, (6 << 30, 6 << 30))
from tdz_numba.errors import TdzError
from tdz_numba.formats.hdf5 import open_hdf5
from tdz_numba.tdz.sources import tensor_from_spec
accepted = 0
for path in sys.argv[1:]:
    try:
        src = open_hdf5(path)
        try:
            stack = [""]
            while stack:
                for child in src.level(stack.pop()).children.values():
                    if child.kind == "level":
                        stack.append(child.path)
                    elif child.kind == "leaf":
                        tensor_from_spec(child.leaf, src.files)
        finally:
            src.close()
        accepted += 1
    except TdzError:
        pass
    except BaseException:
        traceback.print_exc()
        print("FAILED", path, flush=True)
        sys.exit(3)
print("accepted", accepted)
"""


def _heap_mutant(data: bytes, gcols: list[int], rng: np.random.Generator) -> bytes:
    """``data`` with 1-3 changes inside its global heap collections: an object header's index or
    size set to an edge value, or any byte of a collection (its own header included) changed."""
    b = bytearray(data)
    edges = [0, 1, 2, 7, 8, 9, 16, 0xFF, 0xFFFF, 2**31, 2**32 - 1, 2**63, 2**64 - 1]
    for _ in range(int(rng.integers(1, 4))):
        g = gcols[int(rng.integers(len(gcols)))]
        csize = min(int.from_bytes(b[g + 8 : g + 16], "little"), len(b) - g)
        heads, p = [], 16
        while p + 16 <= csize and len(heads) < 64:  # the object headers, as written
            heads.append(g + p)
            if not int.from_bytes(b[g + p : g + p + 2], "little"):
                break
            p += 16 + ((int.from_bytes(b[g + p + 8 : g + p + 16], "little") + 7) & ~7)
        if heads and rng.random() < 0.6:
            at = heads[int(rng.integers(len(heads)))]
            if rng.random() < 0.3:
                b[at : at + 2] = int(rng.choice([0, 1, 2, 3, 0xFFFF])).to_bytes(2, "little")
            else:
                width = int(rng.choice([1, 2, 4, 8]))
                v = int(edges[int(rng.integers(len(edges)))]) & ((1 << (8 * width)) - 1)
                b[at + 8 : at + 8 + width] = v.to_bytes(width, "little")
        else:
            b[g + int(rng.integers(max(csize, 16)))] = int(rng.integers(256))
    return bytes(b)


def _walked(walk, *args):
    """A global heap walk's result, or its error's text."""
    from tdz_numba.errors import BadArchiveError

    try:
        return walk(*args)
    except BadArchiveError as e:
        return str(e)


def test_fuzz_vlen_heaps(tmp_path):
    """Mutants damaged inside their global heap collections only (object indexes and sizes set to
    edge values, collection headers, object bytes) of a file of strings, sequences, a compound, a
    fill value and gzip chunks: the heap kernel agrees with its Python reference on every
    collection of every mutant, and opening and reading every leaf (in a child with a timeout:
    libhdf5 loops on some damaged heaps) ends in the data or a TdzError; a share reads."""
    from tdz_numba.formats.hdf5_heap import heap_collection, walk_collection
    from tdz_numba.formats.hdf5_objects import Layout

    p = tmp_path / "seed.h5"
    with h5py.File(p, "w", libver="earliest") as f:
        f["s"] = _strings(4)
        f.create_dataset("q", data=_seqs(), dtype=h5py.vlen_dtype("<i4"))
        f["c"] = np.array([(1, "x", 0.5), (2, "yz", -1.0)], _COMP)
        f.create_dataset("fill", (3,), dtype=h5py.string_dtype(), fillvalue="abc")
        f.create_dataset("z", data=_strings(4), chunks=(2,), compression="gzip", shuffle=True)
        f.create_dataset("n", data=_nested(), dtype=_NESTED)
        f.attrs["a"] = "attribute text"
    seed = p.read_bytes()
    gcols = _gcols(seed)
    assert gcols
    rng = np.random.default_rng(11)
    n = fuzz_iterations(300)
    paths = []
    for i in range(n):
        data = _heap_mutant(seed, gcols, rng)
        lay = Layout(np.frombuffer(data, np.uint8), f"m{i}.h5", 0, 8, 8, 0)
        for g in gcols:
            got = [_walked(heap_collection, lay, g, {}), _walked(walk_collection, lay, g)]
            assert got[0] == got[1], (i, g, got)
        q = tmp_path / f"m{i}.h5"
        q.write_bytes(data)
        paths.append(q)
    try:
        proc = subprocess.run(
            [sys.executable, "-c", _READ_ALL, *map(str, paths)], timeout=600, capture_output=True, text=True
        )
    except subprocess.TimeoutExpired:
        raise AssertionError("a mutant of a global heap hangs the reader") from None
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    accepted = int(proc.stdout.rsplit("accepted", 1)[1])
    assert n // 20 <= accepted < n, f"{accepted} of {n} mutants read"
