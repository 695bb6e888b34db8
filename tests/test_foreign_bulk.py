"""Leaves of the foreign formats made in bulk (tdz_numba.tdz.specbulk, archive/foreign.py,
archive/leafiter.py): the same tensors as one by one, views at any alignment, aligned=True,
copy=True by scatter reads, errors unchanged, reads in file order."""

from __future__ import annotations

import json
import os
import struct

import numpy as np
import pytest
import torch

import tdz_numba
from tdz_numba.archive import foreign
from tdz_numba.archive.mapping import Archive
from tdz_numba.errors import BadArchiveError
from tdz_numba.tdz.sources import MappedFile, TensorSpec, TreeSource, tensor_from_spec
from tdz_numba.tdz.specbulk import spec_views

# -- files of every format ---------------------------------------------------------------------


def _tensors():
    g = torch.Generator().manual_seed(0)
    return {
        "f16": torch.randn(5, 7, generator=g).half(),
        "f32": torch.randn(3, 4, generator=g),
        "f64": torch.randn(6, generator=g).double(),
        "i64": torch.arange(9, dtype=torch.int64).reshape(3, 3),
        "u8": torch.arange(5, dtype=torch.uint8),
        "i16": torch.arange(-4, 4, dtype=torch.int16),
        "bf16": torch.randn(4, generator=g).bfloat16(),
        "i32": torch.arange(7, dtype=torch.int32),
    }


def _odd_safetensors(path, tensors):
    """A safetensors file whose data starts at an odd offset and whose tensors follow each
    other without padding (every wider dtype misaligned somewhere)."""
    names = {torch.float16: "F16", torch.float32: "F32", torch.float64: "F64", torch.int64: "I64"}
    names.update({torch.uint8: "U8", torch.int16: "I16", torch.bfloat16: "BF16", torch.int32: "I32"})
    header, blobs, pos = {}, [], 0
    for k, t in tensors.items():
        raw = t.contiguous().view(torch.uint8).numpy().tobytes()
        header[k] = {"dtype": names[t.dtype], "shape": list(t.shape), "data_offsets": [pos, pos + len(raw)]}
        blobs.append(raw)
        pos += len(raw)
    text = json.dumps(header).encode()
    if (8 + len(text)) % 2 == 0:
        text += b" "  # data at an odd offset
    path.write_bytes(struct.pack("<Q", len(text)) + text + b"".join(blobs))
    return path


def _files(tmp_path):
    """``{format: (path, reference tensors)}`` for every format with a reader here."""
    from safetensors.torch import save_file

    ts = _tensors()
    out = {}
    p = tmp_path / "x.safetensors"
    save_file(ts, str(p))
    out["safetensors"] = (p, ts)
    out["odd-safetensors"] = (_odd_safetensors(tmp_path / "odd.safetensors", ts), ts)
    p = tmp_path / "x.pt"
    base = torch.arange(24, dtype=torch.float32)
    pt = dict(ts, view=base[3:15].view(3, 4), tr=base.view(4, 6).t(), base=base)  # views of one storage
    torch.save(pt, p)
    out["pt"] = (p, pt)
    npz = {k: v for k, v in ts.items() if k != "bf16"}
    p = tmp_path / "x.npz"
    np.savez(p, **{k: v.numpy() for k, v in npz.items()})
    out["npz"] = (p, npz)
    try:
        import gguf
    except ImportError:  # pragma: no cover - a dev dependency
        gguf = None
    if gguf is not None:
        p = tmp_path / "x.gguf"
        w = gguf.GGUFWriter(str(p), "llama")
        plain = {k: v for k, v in ts.items() if k in ("f16", "f32", "i32", "i16", "f64")}
        for k, v in plain.items():
            w.add_tensor(k, v.numpy())
        w.write_header_to_file()
        w.write_kv_data_to_file()
        w.write_tensors_to_file()
        w.close()
        out["gguf"] = (p, plain)
    try:
        import onnx
        from onnx import helper, numpy_helper
    except ImportError:  # pragma: no cover - a dev dependency
        onnx = None
    if onnx is not None:
        arrays = {k: v.numpy() for k, v in ts.items() if k != "bf16"}
        inits = [numpy_helper.from_array(v, k) for k, v in arrays.items()]
        p = tmp_path / "x.onnx"
        onnx.save(helper.make_model(helper.make_graph([], "g", [], [], initializer=inits)), str(p))
        out["onnx"] = (p, {k: torch.from_numpy(v) for k, v in arrays.items()})
    try:
        import h5py
    except ImportError:  # pragma: no cover - a dev dependency
        h5py = None
    if h5py is not None:
        p = tmp_path / "x.h5"
        with h5py.File(p, "w") as f:
            for k, v in ts.items():
                if k != "bf16":
                    f.create_dataset(k, data=v.numpy())
        out["hdf5"] = (p, {k: v for k, v in ts.items() if k != "bf16"})
    return out


FORMATS = ["safetensors", "odd-safetensors", "pt", "npz", "gguf", "onnx", "hdf5"]


def _leaf_specs(ar):
    return [(k, leaf) for k, leaf in ar.leaves()]


def _bytes(t):
    return t.reshape(-1).contiguous().view(torch.uint8)


def _inside(t, files):
    return any(f.buffer.ctypes.data <= t.data_ptr() < f.buffer.ctypes.data + f.size for f in files)


@pytest.mark.parametrize("fmt", FORMATS)
def test_bulk_gives_the_tensors_one_by_one_gives(tmp_path, fmt):
    files = _files(tmp_path)
    if fmt not in files:
        pytest.skip(f"no writer for {fmt}")
    path, ref = files[fmt]
    with tdz_numba.open(path) as ar:
        src = ar.source
        pairs = _leaf_specs(ar)
        specs = [s for _, s in pairs]
        bulk = foreign.spec_tensors(src, specs)
        loaded = tdz_numba.load(path)
        iterated = dict(ar.iter_leaves())
        for (k, spec), b in zip(pairs, bulk):
            one = tensor_from_spec(spec, src.files, where=str(src.path))
            for t in (b, iterated[k]):
                assert t.dtype == one.dtype and t.shape == one.shape and t.stride() == one.stride(), k
                assert t.data_ptr() == one.data_ptr(), k  # the same bytes of the mapping
                assert torch.equal(_bytes(t), _bytes(one)), k
            if spec.loader is None and spec.codec == "stored" and spec.numel:
                assert _inside(b, src.files), k  # zero-copy at any alignment
                assert b.data_ptr() - src.files[spec.file].buffer.ctypes.data == spec.offset, k
        for k, v in ref.items():
            assert loaded[k].dtype == v.dtype and torch.equal(loaded[k], v), k


def test_misaligned_leaves_are_views_and_ops_read_them_right(tmp_path):
    path, ref = _files(tmp_path)["odd-safetensors"]
    with tdz_numba.open(path) as ar:
        infos = {k: ar.info(k) for k in ref}
        assert any(not i.aligned for i in infos.values())  # the file does put leaves off alignment
        for k, v in ref.items():
            t = ar[k]
            assert infos[k].zero_copy and _inside(t, ar.source.files)
            assert infos[k].aligned == (t.data_ptr() % v.element_size() == 0)
            assert torch.equal(t, v) and torch.equal(t.clone(), v) and torch.equal(t.contiguous(), v)
            if v.is_floating_point():
                assert torch.allclose(t.float().sum(), v.float().sum())
                if t.dim() == 2:
                    assert torch.allclose(t.float() @ t.float().T, v.float() @ v.float().T)
            else:
                assert torch.equal(t.sum(), v.sum())
            if v.dtype != torch.bfloat16:
                assert np.array_equal(ar.numpy(k), v.numpy())


def _ops(x):
    """A battery of CPU kernels (reductions, casts, matmul, sort, where, ...) on ``x``."""
    fl = x.is_floating_point() or x.is_complex()
    cplx = x.is_complex()
    out = [x.clone(), x.T.contiguous(), x + x, x * 2, x.sum(), x.sum(0), x.sum(1), x.abs(), -x, x.cumsum(1)]
    out += [
        x == x,
        torch.where(x.real > 0 if cplx else x > 0, x, x * 2),
        x.index_select(1, torch.arange(0, 9, 2)),
    ]
    out += [torch.empty_like(x).copy_(x), torch.cat([x, x]), x.flip(1), x[:2, :3].prod()]
    if not cplx:
        out += [x.max(), torch.sort(x, 1).values, x.float(), x.double(), x.argmax(), x.topk(2).values]
        out += [x.float() @ x.float().T, x.float().softmax(1)]
    if fl:
        out += [x @ x.T, x.exp(), torch.nn.functional.linear(x, x)]
    return out


@pytest.mark.parametrize(
    "dtype",
    [torch.float16, torch.bfloat16, torch.float32, torch.float64, torch.int16, torch.int32, torch.int64]
    + [torch.complex64, torch.complex128],
)
def test_views_at_every_shift_compute_like_copies(tmp_path, dtype):
    g = torch.Generator().manual_seed(1)
    if dtype.is_floating_point or dtype.is_complex:
        v = torch.randn(8, 9, generator=g).to(dtype)
    else:
        v = torch.randint(-50, 50, (8, 9), generator=g).to(dtype)
    raw = v.contiguous().view(torch.uint8).numpy().tobytes()
    isz = v.element_size()
    want = _ops(v)
    for shift in range(isz):
        p = tmp_path / f"raw{shift}.bin"
        p.write_bytes(bytes(shift) + raw + bytes(isz))
        f = MappedFile.open(p)
        spec = TensorSpec("x", dtype, (8, 9), None, 0, shift, len(raw))
        (t,) = spec_views([spec], [f])
        one = tensor_from_spec(spec, [f])
        if shift and dtype.is_complex:  # torch's complex kernels need aligned memory: copies
            assert t is None and not _inside(one, [f]) and one.data_ptr() % isz == 0
            t = one
        else:
            assert t.data_ptr() == f.buffer.ctypes.data + shift == one.data_ptr()
        for got, ref in zip(_ops(t), want):
            assert torch.equal(got, ref) or torch.allclose(got, ref, equal_nan=True), (shift, got, ref)


def _sub(tmp_path, name):
    d = tmp_path / name
    d.mkdir()
    return d


def test_each_leaf_has_its_own_version_counter(tmp_path):
    for fmt in ("odd-safetensors", "npz", "pt"):
        path, ref = _files(_sub(tmp_path, fmt))[fmt]
        tree = tdz_numba.load(path)
        keys = [k for k, v in tree.items() if isinstance(v, torch.Tensor) and v.is_floating_point()]
        before = {k: tree[k]._version for k in keys}
        tree[keys[0]].add_(1)
        assert tree[keys[0]]._version == before[keys[0]] + 1
        assert all(tree[k]._version == before[k] for k in keys[1:]), fmt
        assert not any(tree[k]._is_view() for k in keys)


def test_aligned_copies_exactly_the_misaligned_leaves(tmp_path):
    for fmt in ("odd-safetensors", "npz", "onnx"):
        files = _files(_sub(tmp_path, fmt))
        if fmt not in files:
            continue
        path, ref = files[fmt]
        with tdz_numba.open(path, aligned=True) as ar:
            mapped = ar.source.files
            for k in ref:
                info = ar.info(k)
                t = ar[k]
                assert t.data_ptr() % t.element_size() == 0, (fmt, k)
                assert _inside(t, mapped) == info.aligned == info.zero_copy, (fmt, k)
                assert torch.equal(t, ref[k])
            loaded = ar.to_dict()  # the bulk path copies the same leaves
            for k in ref:
                assert _inside(loaded[k], mapped) == ar.info(k).aligned, (fmt, k)
                assert torch.equal(loaded[k], ref[k])
        assert torch.equal(tdz_numba.load(path, aligned=True)[k], ref[k])
        misaligned = 0
        with tdz_numba.open(path) as ar:
            loaded = ar.to_dict()
            for k in ref:
                misaligned += not ar.info(k).aligned
                assert ar.info(k).zero_copy  # without aligned=True every stored leaf is a view
                assert _inside(loaded[k], ar.source.files) and _inside(ar[k], ar.source.files)
        if fmt != "onnx":
            assert misaligned, fmt  # np.savez / the odd file do misalign some leaves


@pytest.mark.parametrize("fmt", FORMATS)
def test_copy_gives_owned_tensors_equal_to_the_reader(tmp_path, fmt, monkeypatch):
    files = _files(tmp_path)
    if fmt not in files:
        pytest.skip(f"no writer for {fmt}")
    path, ref = files[fmt]
    monkeypatch.setattr(foreign, "PIECE", 64)  # large leaves split, runs of small ones cut
    storages = set()
    with tdz_numba.open(path, copy=True) as ar:
        mapped = ar.source.files
        got = dict(ar.iter_leaves())
        assert not any(ar.info(k).zero_copy for k in ref)
        loaded = tdz_numba.load(path, copy=True)
        for k, v in ref.items():  # (while ar's mapping lives: a later allocation may reuse its addresses)
            for t in (got[k], loaded[k]):
                assert t.dtype == v.dtype and torch.equal(t, v), k
                assert not _inside(t, mapped), k
                assert t.data_ptr() % t.element_size() == 0
            storages.add(loaded[k].untyped_storage().data_ptr())
    if fmt != "pt":  # (the .pt file saves views of one storage; copies are per leaf)
        assert len(storages) == len(ref)


def test_copy_reads_forward_through_the_file_whatever_the_key_order(tmp_path, monkeypatch):
    from safetensors.torch import save_file

    ts = {f"k{i}": torch.full((100 + i,), float(i)) for i in range(40)}
    p = tmp_path / "x.safetensors"
    save_file(ts, str(p))
    with tdz_numba.open(p) as ar:
        src = ar.source
        specs = [s for _, s in ar.leaves()]
    rng = np.random.default_rng(0)
    order = rng.permutation(len(specs)).tolist()
    shuffled = [specs[i] for i in order]
    seen: list[int] = []
    real = os.preadv

    def record(fd, views, offset):
        seen.append(offset)
        return real(fd, views, offset)

    monkeypatch.setattr(foreign, "PIECE", 1000)  # several scatter reads
    monkeypatch.setattr(foreign.os, "preadv", record)
    out = foreign.copy_specs(src, shuffled, num_threads=1)
    assert seen == sorted(seen) and len(seen) > 1
    for spec, t in zip(shuffled, out):
        assert torch.equal(t, ts[spec.key])


def test_scatter_reads_skip_padding_and_restart_after_gaps(tmp_path, monkeypatch):
    p = tmp_path / "raw.bin"
    data = np.arange(4096, dtype=np.uint8).tobytes() * 64
    p.write_bytes(data)
    f = MappedFile.open(p)
    src = TreeSource("raw", p, {}, files=[f])
    # padding of 3 bytes, a gap larger than MAX_GAP, an overlapping leaf, one big leaf
    specs = [
        TensorSpec("a", torch.int16, (10,), None, 0, 1, 20),
        TensorSpec("b", torch.int32, (4,), None, 0, 24, 16),
        TensorSpec("c", torch.uint8, (8,), None, 0, 200_000, 8),
        TensorSpec("d", torch.uint8, (30,), None, 0, 190_000, 30),
        TensorSpec("e", torch.float32, (50_000,), None, 0, 2, 200_000),
    ]
    monkeypatch.setattr(foreign, "MAX_GAP", 1000)
    monkeypatch.setattr(foreign, "PIECE", 4096)
    for threads in (1, 2):
        out = foreign.copy_specs(src, specs, num_threads=threads)
        for spec, t in zip(specs, out):
            want = torch.frombuffer(
                bytearray(data[spec.offset : spec.offset + spec.nbytes]), dtype=spec.dtype
            )
            assert torch.equal(t.view(-1), want), spec.key


def test_a_file_truncated_after_open_is_a_short_read(tmp_path):
    from safetensors.torch import save_file

    p = tmp_path / "x.safetensors"
    save_file({"a": torch.ones(1000), "b": torch.ones(1000)}, str(p))
    with tdz_numba.open(p) as ar:
        src = ar.source
        specs = [s for _, s in ar.leaves()]
        os.truncate(p, os.path.getsize(p) - 100)
        with pytest.raises(BadArchiveError, match="short read"):
            foreign.copy_specs(src, specs)


# -- errors: the same, in the same place ---------------------------------------------------------


def _hand_made(tmp_path, specs_of):
    p = tmp_path / "raw.bin"
    p.write_bytes(np.arange(64, dtype=np.float32).tobytes())
    f = MappedFile.open(p)
    tree = {s.key: s for s in specs_of}
    return Archive(TreeSource("raw", p, tree, files=[f])), f


BAD = [
    (TensorSpec("bad", torch.float32, (100,), None, 0, 0, 400), "lie outside the file"),
    (TensorSpec("bad", torch.float32, (4,), None, 0, 0, 8), "needs 16 bytes, the file gives it 8"),
    (TensorSpec("bad", torch.float32, (2, -1), None, 0, 0, 8), "bad shape"),
    (TensorSpec("bad", torch.float32, (2, 2), (2, -1), 0, 0, 16), "bad strides"),
    (TensorSpec("bad", torch.float32, (2, 2), (1,), 0, 0, 16), "bad strides"),
    (TensorSpec("bad", torch.float32, (1 << 62, 1 << 62), None, 0, 0, 16), "needs"),
    (TensorSpec("bad", torch.float32, (4,), None, 0, 1 << 70, 16), "lie outside the file"),
    (TensorSpec("bad", torch.float32, (4,), None, 0, -8, 16), "lie outside the file"),
]


@pytest.mark.parametrize("bad,text", BAD)
def test_bad_leaves_raise_the_one_by_one_error(tmp_path, bad, text):
    good = [TensorSpec(f"g{i}", torch.float32, (4,), None, 0, 16 * i, 16) for i in range(3)]
    ar, f = _hand_made(tmp_path, [*good, bad, TensorSpec("after", torch.float32, (2,), None, 0, 0, 8)])
    with pytest.raises(BadArchiveError) as one:
        tensor_from_spec(bad, [f], where=str(f.path))
    assert text in str(one.value)
    out = spec_views([*good, bad], [f])
    assert out[3] is None and all(t is not None for t in out[:3])
    for call in (ar.to_dict, lambda: list(ar.values())):
        with pytest.raises(BadArchiveError) as many:
            call()
        assert str(many.value) == str(one.value)
    got = []
    with pytest.raises(BadArchiveError) as lazy:
        for k, _ in ar.iter_leaves():
            got.append(k)
    assert str(lazy.value) == str(one.value) and got == ["g0", "g1", "g2"]  # the good ones first
    with pytest.raises(BadArchiveError) as copied:
        foreign.copy_specs(ar.source, [*good, bad])
    assert str(copied.value) == str(one.value)


def test_iteration_makes_leaves_in_batches_and_keeps_order(tmp_path, monkeypatch):
    from tdz_numba.archive import leafiter

    calls = []
    real = foreign.spec_tensors

    def counting(source, leaves, **kw):
        calls.append(len(leaves))
        return real(source, leaves, **kw)

    monkeypatch.setattr(leafiter, "BATCH", 7)
    import tdz_numba.archive.bulk as bulk

    monkeypatch.setattr(bulk, "spec_tensors", counting)
    p = tmp_path / "raw.bin"
    p.write_bytes(np.arange(64, dtype=np.float32).tobytes())
    f = MappedFile.open(p)
    tree = {"a": TensorSpec("a", torch.float32, (2,), None, 0, 0, 8), "v": 5}
    tree["sub"] = {f"s{i}": TensorSpec(f"s{i}", torch.float32, (1,), None, 0, 4 * i, 4) for i in range(20)}
    tree["z"] = TensorSpec("z", torch.float32, (3,), None, 0, 8, 12)
    ar = Archive(TreeSource("raw", p, tree, files=[f]))
    got = list(ar.iter_leaves())
    assert [k for k, _ in got] == ["a", *[f"sub/s{i}" for i in range(20)], "z"]
    assert [t.tolist() for _, t in got[1:4]] == [[0.0], [1.0], [2.0]]
    assert calls == [1, 7, 7, 6, 1]
    calls.clear()
    assert [k for k, _ in ar.items()] == ["a", "v", "sub", "z"] and list(ar.values())[1] == 5
    assert calls == [1, 1, 1, 1]


@pytest.mark.parametrize("how", ["stored", "deflate", "copy"])
def test_tdz_iteration_in_batches_where_it_holds_no_memory(tmp_path, monkeypatch, how):
    # a .tdz of STORED entries read as views is iterated in batches (its local headers read in
    # one pass first); compressed, or copied, each leaf is made on access (a batch would inflate
    # or copy BATCH leaves at once); the same keys, values and order either way
    from tdz_numba.archive import leafiter
    from tdz_numba.tdz.source import TdzSource

    monkeypatch.setattr(leafiter, "BATCH", 16)
    batches, resolved = [], []
    real_tensors, real_resolve = TdzSource.tensors, TdzSource.resolve
    monkeypatch.setattr(
        TdzSource, "tensors", lambda self, leaves: batches.append(len(leaves)) or real_tensors(self, leaves)
    )
    monkeypatch.setattr(
        TdzSource, "resolve", lambda self, leaves: resolved.append(len(leaves)) or real_resolve(self, leaves)
    )
    tree = {f"w{i:02d}": torch.arange(i % 5 + 1, dtype=torch.float32) + i for i in range(40)}
    tree["sub"] = {"x": torch.ones(3, dtype=torch.int16), "t": "text"}
    kw = {"compression": "deflate"} if how == "deflate" else {}
    p = tdz_numba.save(tree, tmp_path / "b.tdz", **kw)
    with tdz_numba.open(p, copy=how == "copy") as ar:
        items = list(ar.items())
        leaves = list(ar.iter_leaves())
        assert ar.source.index.local_checked is (how == "stored")
        assert items[-1][1]["t"] == "text"
    assert [k for k, _ in items] == [*tree] and [k for k, _ in leaves] == [*list(tree)[:40], "sub/x"]
    for k, t in items[:40]:
        assert torch.equal(t, tree[k])
    assert torch.equal(leaves[-1][1], tree["sub"]["x"])
    if how == "stored":
        assert resolved == [40, 40] and batches[:3] == [16, 16, 8]
    else:
        assert resolved == [] and set(batches) <= {1}
