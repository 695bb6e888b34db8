"""The small-count paths of a load (few leaves, a short header) against the bulk paths they stand in
for: the same tensors, specs and errors.

* ``tdz/specbulk.small_views`` (up to ``specbulk.SMALL`` leaves) against the bulk
  ``views_and_extents``: every leaf the same tensor (storage, offset, shape, strides), or made by
  ``tensor_from_spec`` on both sides, which raises the first bad leaf's error;
* ``formats/safetensors`` headers up to ``SMALL_HEADER`` bytes: the json path, the specs the fast
  path gives (and a file's bad header named the same);
* ``formats/gguf`` files of up to ``gguf.SMALL`` tensors: the infos read one by one, as the bulk
  pass reads them.
"""

from __future__ import annotations

import json
import struct

import numpy as np
import pytest
import torch

import tdz_numba
from tdz_numba.errors import BadArchiveError
from tdz_numba.formats import gguf as gguf_mod
from tdz_numba.formats import safetensors as st
from tdz_numba.tdz import specbulk
from tdz_numba.tdz.sources import MappedFile, TensorSpec, tensor_from_spec


def _file(tmp_path, name="raw.bin", n=64):
    p = tmp_path / name
    p.write_bytes(np.arange(n, dtype=np.float32).tobytes())
    return MappedFile.open(p)


def _edge_specs() -> list[TensorSpec]:
    """Leaves the bulk path takes and leaves it leaves to ``tensor_from_spec`` (all valid there)."""
    f32, c64 = torch.float32, torch.complex64
    return [
        TensorSpec("plain", f32, (2, 3), None, 0, 0, 24),
        TensorSpec("scalar", f32, (), None, 0, 4, 4),
        TensorSpec("unaligned", f32, (2,), None, 0, 2, 8),
        TensorSpec("complex unaligned", c64, (1,), None, 0, 4, 8),
        TensorSpec("complex", c64, (2,), None, 0, 8, 16),
        TensorSpec("strided", f32, (2, 2), (1, 2), 0, 8, 16),
        TensorSpec("strided as dense", f32, (2, 2), (2, 1), 0, 8, 16),
        TensorSpec("zero stride", f32, (3,), (0,), 0, 12, 4),
        TensorSpec("list strides", f32, (2, 2), [1, 2], 0, 8, 16),
        TensorSpec("list shape", f32, [2, 2], None, 0, 8, 16),
        TensorSpec("empty", f32, (0, 3), None, 0, 0, 0),
        TensorSpec("numpy offset", f32, (2,), None, 0, np.int64(16), 8),
        TensorSpec("other file", f32, (3,), None, 1, 4, 12),
        TensorSpec("more bytes than needed", f32, (2,), None, 0, 32, 40),
        TensorSpec("u8 at the end", torch.uint8, (4,), None, 0, 252, 4),
    ]


def _bad_specs() -> list[TensorSpec]:
    f32 = torch.float32
    return [
        TensorSpec("past the end", f32, (4,), None, 0, 248, 16),
        TensorSpec("short", f32, (4,), None, 0, 0, 12),
        TensorSpec("negative dim", f32, (-1, 2), None, 0, 0, 8),
        TensorSpec("negative offset", f32, (1,), None, 0, -4, 4),
        TensorSpec("no such file", f32, (1,), None, 5, 0, 4),
        TensorSpec("stride rank", f32, (2, 2), (1,), 0, 0, 16),
        TensorSpec("negative stride", f32, (2,), (-1,), 0, 8, 8),
        TensorSpec("span past nbytes", f32, (2, 2), (4, 1), 0, 0, 16),
        TensorSpec("huge", f32, (1 << 40, 1 << 40), None, 0, 0, 16),
        TensorSpec("float dim", f32, (2.0,), None, 0, 0, 8),
        TensorSpec("numpy dim", f32, (np.int64(2),), None, 0, 16, 8),
        TensorSpec("bool stride", f32, (2,), (True,), 0, 16, 8),
        TensorSpec("bool dim", f32, (True,), None, 0, 16, 4),
    ]


def _made(specs, files, small: bool, monkeypatch, aligned=False):
    """spec_tensors' result (tensors, or the error's type and text) with one path forced."""
    monkeypatch.setattr(specbulk, "SMALL", 10**6 if small else 0)
    out = specbulk.views_and_extents(specs, files, aligned=aligned)[0]
    try:
        return [
            t if t is not None else tensor_from_spec(s, files, where="w", aligned=aligned)
            for s, t in zip(specs, out)
        ]
    except Exception as exc:  # noqa: BLE001 - compared below
        return (type(exc), str(exc))


def _mapped(t, files) -> bool:
    return any(f.buffer.ctypes.data <= t.data_ptr() < f.buffer.ctypes.data + f.size for f in files)


def _same(a, b, files) -> None:
    """The same tensors (views of the same bytes, or copies of equal values), or the same error."""
    assert type(a) is type(b)
    if isinstance(a, tuple):
        assert a == b
        return
    for x, y in zip(a, b, strict=True):
        assert x.dtype == y.dtype and x.shape == y.shape and x.stride() == y.stride()
        assert _mapped(x, files) == _mapped(y, files)
        if _mapped(x, files):
            assert x.data_ptr() == y.data_ptr()
        assert x.tolist() == y.tolist()


@pytest.mark.parametrize("aligned", [False, True])
def test_small_views_equal_the_bulk_path(tmp_path, monkeypatch, aligned):
    files = [_file(tmp_path), _file(tmp_path, "b.bin", 8)]
    specs = _edge_specs()
    small = _made(specs, files, True, monkeypatch, aligned)
    bulk = _made(specs, files, False, monkeypatch, aligned)
    assert isinstance(small, list)
    _same(small, bulk, files)
    for s, t in zip(specs, small):  # and what tensor_from_spec makes, leaf by leaf
        _same([t], [tensor_from_spec(s, files, aligned=aligned)], files)
    views = specbulk.small_views(specs, files, aligned=aligned)
    for t in views:  # a view where the bulk path makes one (own version counter)
        if t is not None:
            assert t._version == 0 and not t._is_view()


@pytest.mark.parametrize("bad", range(len(_bad_specs())))
def test_small_views_refuse_what_the_bulk_path_refuses(tmp_path, monkeypatch, bad):
    files = [_file(tmp_path)]
    specs = [*_edge_specs()[:3], _bad_specs()[bad], _edge_specs()[0]]
    assert specbulk.small_views(specs, files)[3] is None
    small = _made(specs, files, True, monkeypatch)
    bulk = _made(specs, files, False, monkeypatch)
    assert isinstance(small, tuple) and small[0] in (BadArchiveError, IndexError)  # (file 5 of 1)
    _same(small, bulk, files)


def test_views_and_extents_switch_at_small(tmp_path, monkeypatch):
    f = _file(tmp_path)
    specs = [TensorSpec(f"k{i}", torch.float32, (1,), None, 0, 4 * i, 4) for i in range(specbulk.SMALL + 1)]
    out, ext = specbulk.views_and_extents(specs[:-1], [f])
    assert ext is None and [t.item() for t in out] == list(range(specbulk.SMALL))
    out, ext = specbulk.views_and_extents(specs, [f])
    assert ext is not None and ext.ok.all() and [t.item() for t in out] == list(range(specbulk.SMALL + 1))


def _st_file(path, n: int, *, bad: bool = False) -> None:
    header, data, off = {}, b"", 0
    for i in range(n):
        arr = np.arange(3 * i, 3 * i + 6, dtype=np.float32).reshape(2, 3)
        header[f"layer.{i}.w"] = {"dtype": "F32", "shape": [2, 3], "data_offsets": [off, off + 24]}
        data += arr.tobytes()
        off += 24
    if bad:
        header["layer.0.w"]["data_offsets"] = [0, 20]
    h = json.dumps(header, separators=(",", ":")).encode()
    h += b" " * (-len(h) % 8)
    path.write_bytes(struct.pack("<Q", len(h)) + h + data)


@pytest.mark.parametrize("n", [1, 3, 12, 40])
def test_safetensors_small_header_gives_the_fast_paths_specs(tmp_path, monkeypatch, n):
    p = tmp_path / "x.safetensors"
    _st_file(p, n)
    raw = p.read_bytes()
    (hl,) = struct.unpack("<Q", raw[:8])
    fast = st._fast_header(raw[8 : 8 + hl], 8 + hl, len(raw), 0)
    assert fast is not None
    got = st.parse_header(np.frombuffer(raw, np.uint8), len(raw), "x")
    assert got == fast and list(got[0]) == list(fast[0])
    assert (hl <= st.SMALL_HEADER) == (n <= 12)
    monkeypatch.setattr(st, "SMALL_HEADER", 0)
    assert st.parse_header(np.frombuffer(raw, np.uint8), len(raw), "x") == got
    back = tdz_numba.load(p)
    assert [t.tolist() for t in back.values()] == [
        np.arange(3 * i, 3 * i + 6).reshape(2, 3).tolist() for i in range(n)
    ]


@pytest.mark.parametrize("small", [True, False])
def test_safetensors_small_header_names_the_same_error(tmp_path, monkeypatch, small):
    p = tmp_path / "x.safetensors"
    _st_file(p, 2, bad=True)
    monkeypatch.setattr(st, "SMALL_HEADER", 1 << 20 if small else 0)
    with pytest.raises(
        BadArchiveError,
        match=r"tensor 'layer.0.w': data_offsets: 20 bytes, but F32 of shape \[2, 3\] needs 24",
    ):
        tdz_numba.load(p)


def _gguf(path, n: int) -> None:
    import gguf

    w = gguf.GGUFWriter(str(path), "x")
    for i in range(n):
        w.add_tensor(f"t{i}", np.arange(i, i + 4 * (i + 1), dtype=np.float32).reshape(i + 1, 4))
    w.add_tensor("q", np.zeros((2, 34), np.uint8), raw_dtype=gguf.GGMLQuantizationType.Q8_0)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


@pytest.mark.parametrize("n", [0, 2, 5, 12])
def test_gguf_small_reads_the_infos_as_the_bulk_pass(tmp_path, monkeypatch, n):
    p = tmp_path / "m.gguf"
    _gguf(p, n)
    f = MappedFile.open(p)
    try:
        mv = memoryview(f.buffer.data)
        monkeypatch.setattr(gguf_mod, "SMALL", 10**6)
        one = gguf_mod._parse(mv, "m", columns=True)
        monkeypatch.setattr(gguf_mod, "SMALL", 0)
        bulk = gguf_mod._parse(mv, "m", columns=True)
    finally:
        f.close()
    assert one[0] == bulk[0] and one[1] == bulk[1] and one[2:] == bulk[2:]
    monkeypatch.undo()
    back = tdz_numba.load(p)
    assert [back[f"t{i}"].tolist() for i in range(n)] == [
        np.arange(i, i + 4 * (i + 1), dtype=np.float32).reshape(i + 1, 4).tolist() for i in range(n)
    ]


def _h5(path) -> dict:
    import h5py

    want = {}
    with h5py.File(path, "w") as f:
        for i, (dt, shape) in enumerate(
            [("<f4", (3,)), (">i2", (2, 3)), ("<f8", ()), ("u1", (4, 1, 2)), ("<i8", (0, 2)), ("<f2", (5,))]
        ):
            arr = np.arange(int(np.prod(shape)), dtype=dt).reshape(shape)
            f.create_dataset(f"d{i}", data=arr)
            want[f"d{i}"] = arr
        f["d0"].attrs["unit"] = "m"
        g = f.create_group("g")
        g["x"] = np.ones(3, np.float32)
        g["s"] = h5py.SoftLink("/d1")
        f["chunked"] = np.arange(6.0).reshape(2, 3)
        f.create_dataset("cz", data=np.arange(8, dtype=np.int32), chunks=(4,), compression="gzip")
    return want


def _tree(got) -> list:
    out = []
    for k, v in got.items():
        if isinstance(v, dict):
            out.append((k, _tree(v)))
        elif isinstance(v, torch.Tensor):
            out.append((k, v.dtype, tuple(v.shape), v.tolist()))
        else:
            out.append((k, type(v), repr(v)))
    return out


def test_hdf5_few_links_and_rows_as_the_bulk_paths(tmp_path, monkeypatch):
    from tdz_numba.formats import hdf5_objects, hdf5_walk

    p = tmp_path / "x.h5"
    want = _h5(p)
    few = tdz_numba.load(p)
    with tdz_numba.open(p) as ar:
        few_info = [(k, ar.info(k)) for k, c in ar.level_info().children.items() if c.kind == "leaf"]
    monkeypatch.setattr(hdf5_objects, "FEW_LINKS", -1)
    monkeypatch.setattr(hdf5_walk, "SMALL", -1)
    bulk = tdz_numba.load(p)
    with tdz_numba.open(p) as ar:
        bulk_info = [(k, ar.info(k)) for k, c in ar.level_info().children.items() if c.kind == "leaf"]
    assert list(few) == list(bulk) and _tree(few) == _tree(bulk)
    assert few_info == bulk_info
    for k, arr in want.items():
        assert np.asarray(few[k]).tolist() == arr.tolist()
    assert len(few_info) >= 5
    assert few["g"]["x"].tolist() == [1.0] * 3


def _npz_cases(tmp_path):
    arrs = {
        "a": np.arange(6, dtype=np.float32).reshape(2, 3),
        "f": np.asfortranarray(np.arange(6, dtype=np.int16).reshape(2, 3)),
        "s": np.array(2.5),
        "e": np.zeros((0, 4), np.uint8),
    }
    p = tmp_path / "x.npz"
    np.savez(p, **arrs)
    return p, arrs


def _npz_specs(p, small: bool, monkeypatch):
    from tdz_numba.formats import numpy_fmt
    from tdz_numba.zipfmt.index import ArchiveIndex

    monkeypatch.setattr(numpy_fmt, "SMALL", 10**6 if small else 0)
    try:
        src = numpy_fmt.open_npz(p, index=ArchiveIndex(p))
    except Exception as exc:  # noqa: BLE001 - compared
        return (type(exc), str(exc))
    try:
        return [(k, c.leaf) for k, c in src.level("").children.items()]
    finally:
        src.close()


def test_npz_few_members_as_the_bulk_path(tmp_path, monkeypatch):
    p, arrs = _npz_cases(tmp_path)
    small, bulk = _npz_specs(p, True, monkeypatch), _npz_specs(p, False, monkeypatch)
    assert isinstance(small, list) and small == bulk
    monkeypatch.undo()
    back = tdz_numba.load(p)
    assert {k: np.asarray(v).tolist() for k, v in back.items()} == {k: v.tolist() for k, v in arrs.items()}


@pytest.mark.parametrize("damage", ["local signature", "npy magic", "both"])
def test_npz_few_members_name_the_bulk_paths_error(tmp_path, monkeypatch, damage):
    """A damaged local header is named before any member's ``.npy`` header (check_all's order),
    whichever path reads the members."""
    p, _ = _npz_cases(tmp_path)
    raw = bytearray(p.read_bytes())
    second = raw.find(b"PK\x03\x04", 4)
    if damage in ("local signature", "both"):
        raw[second : second + 2] = b"XX"
    if damage in ("npy magic", "both"):
        first_npy = raw.find(b"\x93NUMPY")
        raw[first_npy + 1 : first_npy + 6] = b"NOPE!"
    p.write_bytes(bytes(raw))
    small, bulk = _npz_specs(p, True, monkeypatch), _npz_specs(p, False, monkeypatch)
    assert isinstance(small, tuple) and small == bulk
    assert ("local header signature" in small[1]) == (damage != "npy magic")
