"""The numpy, ONNX, GGUF and safetensors readers on files other people's tools write,
compared bit for bit with each format's own reader (issue 23's real-file causes).

numpy.load for ``.npy``/``.npz`` (0-dim members of ``savez_compressed``, Python 2
era headers), ``onnx.numpy_helper.to_array`` for ONNX (0-dim initializers in typed
fields, bare ``TensorProto`` files, and every ``.pb``/``.onnx`` the installed onnx
package ships), ``gguf.GGUFReader`` + ``gguf.quants.dequantize`` for GGUF (every
quant type gguf knows, unusual writer configurations), and the convert warning for
dtypes tensordict 0.15.3 cannot load.
"""

from __future__ import annotations

import struct
import warnings
from pathlib import Path

import numpy as np
import pytest
import torch

import tdz_numba
from tdz_numba.errors import BadArchiveError, TdzError, UnsupportedError


def _bits(t) -> tuple:
    """dtype name, shape and raw bytes of a tensor or array (NaN payloads included)."""
    if isinstance(t, torch.Tensor):
        t = t.contiguous()
        raw = t.view(-1).view(torch.uint8).numpy().tobytes() if t.numel() else b""
        return str(t.dtype).removeprefix("torch."), tuple(t.shape), raw
    a = np.ascontiguousarray(t)
    return str(a.dtype), a.shape, a.tobytes()


def _same(got: torch.Tensor, ref: np.ndarray) -> None:
    ref = np.asarray(ref)
    if not ref.dtype.isnative:
        ref = ref.astype(ref.dtype.newbyteorder("="))
    assert tuple(got.shape) == ref.shape
    assert got.numpy().dtype == ref.dtype
    assert got.contiguous().numpy().tobytes() == np.ascontiguousarray(ref).tobytes()


# ----------------------------------------------------------------------------- numpy

_SCALARS = {
    "f4": np.float32(3.5),
    "be_i4": np.array(-7, ">i4"),
    "f8nan": np.frombuffer(struct.pack("<Q", 0x7FF8_0000_DEAD_BEEF), "<f8").reshape(()),
    "u1": np.uint8(200),
    "b": np.bool_(True),
    "c8": np.complex64(1 - 2j),
    "be_f2": np.array(1.5, ">f2"),
}


@pytest.mark.parametrize("writer", [np.savez, np.savez_compressed])
def test_npz_zero_dim_members_match_numpy(tmp_path, writer):
    p = tmp_path / "s.npz"
    writer(p, **_SCALARS, v=np.arange(3, dtype=">i8"))
    ref = np.load(p)
    with tdz_numba.open(p) as ar:
        assert sorted(ar.keys()) == sorted(ref.files)
        for k in ref.files:
            _same(ar[k], ref[k])
    out = tdz_numba.convert(p, tmp_path / "s.tdz")
    td = pytest.importorskip("tensordict").TensorDict.load_memmap(out)
    assert td["f4"].shape == () and td["be_i4"].item() == -7 and td["c8"].item() == 1 - 2j


@pytest.mark.parametrize("writer", [np.savez, np.savez_compressed])
def test_npz_with_other_members_reads_the_arrays(tmp_path, writer):
    """A README (or any member not named ``*.npy``) added to an ``.npz``: numpy's NpzFile reads
    the arrays (and hands out the other member's bytes); we read the same arrays, the other
    member is not a leaf, locally and from a URL."""
    import zipfile

    p = tmp_path / "r.npz"
    writer(p, a=np.arange(6.0).reshape(2, 3), b=np.array([1, 2], ">i4"))
    with zipfile.ZipFile(p, "a") as z:
        z.writestr("README.txt", "what these arrays are")
        z.writestr("sub/notes.json", "{}")
    ref = np.load(p)
    assert "README.txt" in ref.files  # numpy lists it (its bytes, not an array)
    arrays = [k for k in ref.files if not k.endswith((".txt", ".json"))]
    with tdz_numba.open(p) as ar:
        assert sorted(ar.keys()) == sorted(arrays) == ["a", "b"]
        for k in arrays:
            _same(ar[k], ref[k])
    assert tdz_numba.verify(p).entries == 4  # every member's CRC still checked
    fsspec = pytest.importorskip("fsspec")
    fs = fsspec.filesystem("memory")
    fs.pipe("/npzr/r.npz", p.read_bytes())
    try:
        back = tdz_numba.load("memory://npzr/r.npz")
        assert sorted(back) == ["a", "b"]
        _same(back["a"], ref["a"])
        _same(back["b"], ref["b"])
    finally:
        fs.rm("/npzr", recursive=True)


def test_npy_zero_dim_byteswapped(tmp_path):
    p = tmp_path / "s.npy"
    np.save(p, np.array(2.5, ">f8"))
    with tdz_numba.open(p) as ar:
        _same(ar["0"], np.load(p))


def _npy(header: str, data: bytes, major: int = 1) -> bytes:
    h = header.encode("latin-1")
    pre = 10 if major == 1 else 12
    h += b" " * (-(pre + len(h) + 1) % 64) + b"\n"
    size = struct.pack("<H", len(h)) if major == 1 else struct.pack("<I", len(h))
    return b"\x93NUMPY" + bytes([major, 0]) + size + h + data


_PY2_HEADERS = [
    ("{'descr': '<f4', 'fortran_order': False, 'shape': (2L, 3L), }", 1),
    ("{'descr': '<i8', 'fortran_order': True, 'shape': (3L, 2L), }", 2),
    ("{'descr': '<f4', 'fortran_order': False, 'shape': (6L,), }", 1),
    ("{u'descr': u'<f4', u'fortran_order': False, u'shape': (1L, 6L)}", 1),
    ("{'descr': '>f4', 'fortran_order': False, 'shape': (0L, 0L, 6L), }", 2),
]


@pytest.mark.parametrize(("header", "major"), _PY2_HEADERS)
def test_python2_npy_headers_match_numpy(tmp_path, header, major):
    dt = np.dtype(eval(header.replace("L", ""))["descr"])  # noqa: S307 - the test's own literal
    shape = eval(header.replace("L", ""))["shape"]  # noqa: S307
    data = np.arange(int(np.prod(shape)), dtype=dt).tobytes()
    p = tmp_path / "py2.npy"
    p.write_bytes(_npy(header, data, major))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # numpy: "created on Python 2"
        ref = np.load(p)
    with tdz_numba.open(p) as ar:
        _same(ar["0"].contiguous(), ref)
    q = tmp_path / "py2.npz"  # the same member in a stored npz
    import zipfile

    with zipfile.ZipFile(q, "w") as z:
        z.writestr("a.npy", p.read_bytes())
    with tdz_numba.open(q) as ar:
        _same(ar["a"].contiguous(), ref)


def test_python2_suffix_in_version_3_refused_like_numpy(tmp_path):
    p = tmp_path / "v3.npy"
    p.write_bytes(_npy("{'descr': '<f4', 'fortran_order': False, 'shape': (2L,), }", bytes(8), 3))
    with pytest.raises(ValueError):
        np.load(p)
    with pytest.raises(BadArchiveError, match="not a Python literal"):
        tdz_numba.open(p)


def test_npy_header_never_evaluated(tmp_path):
    p = tmp_path / "evil.npy"
    p.write_bytes(
        _npy("{'descr': '<f4', 'fortran_order': False, 'shape': (__import__('os').getpid(),)}", b"")
    )
    with pytest.raises(BadArchiveError):
        tdz_numba.open(p)


# ----------------------------------------------------------------------------- ONNX

onnx = pytest.importorskip("onnx")
from onnx import TensorProto as TP  # noqa: E402
from onnx import helper, numpy_helper  # noqa: E402


def _typed_scalars():
    return [
        helper.make_tensor("i64", TP.INT64, [], [-5]),
        helper.make_tensor("u64", TP.UINT64, [], [2**64 - 1]),
        helper.make_tensor("f", TP.FLOAT, [], [1.5]),
        helper.make_tensor("i32", TP.INT32, [], [-7]),
        helper.make_tensor("i8", TP.INT8, [], [-3]),
        helper.make_tensor("u8", TP.UINT8, [], [250]),
        helper.make_tensor("u16", TP.UINT16, [], [65535]),
        helper.make_tensor("bool", TP.BOOL, [], [True]),
        helper.make_tensor("d", TP.DOUBLE, [], [2.5]),
        helper.make_tensor("f16", TP.FLOAT16, [], [np.float16(1.5)]),
        helper.make_tensor("bf16", TP.BFLOAT16, [], [3.0]),
        helper.make_tensor("c64", TP.COMPLEX64, [], [1 + 2j]),
        helper.make_tensor("c128", TP.COMPLEX128, [], [3 - 4j]),
        helper.make_tensor("e4m3", TP.FLOAT8E4M3FN, [], [2.0]),
        helper.make_tensor("row", TP.INT64, [3], [1, 2, 3]),
    ]


def _compare_onnx(value, ref: np.ndarray) -> None:
    if ref.dtype == object:  # STRING: nested lists of str of the tensor's shape
        assert (
            value
            == np.vectorize(lambda s: s.decode() if isinstance(s, bytes) else s, otypes=[object])(
                ref
            ).tolist()
        )
        return
    assert tuple(value.shape) == ref.shape
    raw = value.contiguous().view(-1).view(torch.uint8).numpy().tobytes() if value.numel() else b""
    assert raw == np.ascontiguousarray(ref).tobytes()


def test_onnx_zero_dim_typed_initializers_match_numpy_helper(tmp_path):
    inits = _typed_scalars() + [
        helper.make_tensor("s0", TP.STRING, [], [b"hi"]),
        helper.make_tensor("s2", TP.STRING, [2, 2], [b"a", b"b", b"c", "d\u00e9".encode()]),
    ]
    p = tmp_path / "m.onnx"
    onnx.save(helper.make_model(helper.make_graph([], "g", [], [], inits)), p)
    with tdz_numba.open(p) as ar:
        for t in inits:
            _compare_onnx(ar[t.name], numpy_helper.to_array(t))
        assert ar["s0"] == "hi" and ar["s2"] == [["a", "b"], ["c", "d\u00e9"]]
    with pytest.warns(UserWarning, match="'e4m3' are float8_e4m3fn"):
        out = tdz_numba.convert(p, tmp_path / "m.tdz")
    with tdz_numba.open(out) as back:
        assert back["i64"].shape == () and back["i64"].item() == -5 and back["c64"].item() == 1 + 2j


@pytest.mark.parametrize("name", ["x", ""])
def test_bare_tensorproto_opens_as_one_leaf(tmp_path, name):
    for i, t in enumerate(
        _typed_scalars() + [numpy_helper.from_array(np.arange(6, dtype=np.float32).reshape(2, 3))]
    ):
        t.name = name
        p = tmp_path / f"input_{i}.pb"
        p.write_bytes(t.SerializeToString())
        with tdz_numba.open(p) as ar:
            assert ar.format == "onnx" and list(ar.keys()) == [name or "tensor"]
            _compare_onnx(ar[name or "tensor"], numpy_helper.to_array(t))


def test_sequence_map_optional_protos_refused(tmp_path):
    t = numpy_helper.from_array(np.arange(3, dtype=np.float32), "t")
    protos = {
        "seq": numpy_helper.from_list([np.arange(3, dtype=np.float32), np.ones(2, np.float32)], "s"),
        "opt": numpy_helper.from_optional(np.arange(3, dtype=np.float32), "o"),
        "map": numpy_helper.from_dict({1: np.arange(2, dtype=np.float32)}, "m"),
        "seg": t,
    }
    protos["seg"].segment.begin = 0
    protos["seg"].segment.end = 3
    for kind, proto in protos.items():
        p = tmp_path / f"{kind}.pb"
        p.write_bytes(proto.SerializeToString())
        try:
            ar = tdz_numba.open(p)
        except UnsupportedError as e:
            assert "SequenceProto" in str(e)
            continue
        with ar, pytest.raises(TdzError):  # only a refusal is right: never values
            [ar[k] for k in ar.keys()]


def _onnx_corpus() -> list[Path]:
    root = Path(onnx.__file__).parent
    return sorted(p for p in root.rglob("*") if p.suffix in (".pb", ".onnx") and p.is_file())


def test_onnx_package_corpus_matches_onnx():
    """Every ``.pb`` (test inputs/outputs: bare TensorProtos) and ``model.onnx`` the onnx
    package ships, read by our reader and by onnx, bit for bit."""
    files = _onnx_corpus()
    if not files:
        pytest.skip("this onnx package ships no test data")
    counts = {"pb": 0, "onnx": 0, "initializers": 0}
    for p in files:
        if p.suffix == ".pb":
            t = TP()
            t.ParseFromString(p.read_bytes())
            with tdz_numba.open(p) as ar:
                tree = ar.to_dict()
            assert list(tree) == [t.name or "tensor"], p
            _compare_onnx(tree[t.name or "tensor"], numpy_helper.to_array(t))
            counts["pb"] += 1
        else:
            m = onnx.load(p, load_external_data=False)
            with tdz_numba.open(p) as ar:
                tree = ar.to_dict()
            assert sorted(tree) == sorted(i.name for i in m.graph.initializer), p
            for init in m.graph.initializer:
                _compare_onnx(tree[init.name], numpy_helper.to_array(init))
                counts["initializers"] += 1
            counts["onnx"] += 1
    assert counts["pb"] > 100 and counts["onnx"] > 50, counts


# ----------------------------------------------------------------------------- GGUF

gguf = pytest.importorskip("gguf")
from gguf import GGMLQuantizationType as Q  # noqa: E402
from gguf.constants import GGML_QUANT_SIZES  # noqa: E402


def _write_every_type(path: Path) -> None:
    rng = np.random.default_rng(23)
    w = gguf.GGUFWriter(str(path), "test")
    for q in Q:
        block, size = GGML_QUANT_SIZES[q]
        raw = rng.integers(0, 256, (2, (2 if block > 1 else 32) * size), dtype=np.uint8)
        if q == Q.F16:  # finite values: gguf's float32 and ours must agree, NaN payloads too
            raw = rng.standard_normal((2, 32)).astype(np.float16).view(np.uint8)
        w.add_tensor(q.name, raw, raw_dtype=q)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def test_every_gguf_quant_type_dequantizes_bit_exactly_or_is_refused(tmp_path):
    from gguf.quants import dequantize as gguf_dequantize

    p = tmp_path / "all.gguf"
    _write_every_type(p)
    reader = gguf.GGUFReader(str(p))
    seen = set()
    with tdz_numba.open(p) as ar:
        for t in reader.tensors:
            q = Q(t.tensor_type)
            seen.add(q)
            raw = ar[t.name]
            assert raw.contiguous().view(-1).view(torch.uint8).numpy().tobytes() == t.data.tobytes()
            try:
                ref = gguf_dequantize(t.data, q)
            except NotImplementedError:
                ref = None
            if ref is None and q.name in ("I8", "I16", "I32", "I64", "F64"):
                got = ar.dequantize(t.name)  # plain types come back as they are
                assert got.dtype == getattr(torch, {"I": "int", "F": "float"}[q.name[0]] + q.name[1:])
                continue
            if ref is None:
                with pytest.raises(UnsupportedError, match=q.name):
                    ar.dequantize(t.name)
                continue
            got = ar.dequantize(t.name)
            if got.dtype in (torch.float16, torch.bfloat16):  # plain leaves: as they are
                got = got.float()
            assert got.dtype == torch.float32, q
            assert _bits(got) == _bits(ref), q
    assert seen == set(Q)


def test_gguf_source_dequantize_mxfp4_nvfp4(tmp_path):
    from gguf.quants import dequantize as gguf_dequantize

    p = tmp_path / "all.gguf"
    _write_every_type(p)
    reader = {t.name: t for t in gguf.GGUFReader(str(p)).tensors}
    with tdz_numba.open(p) as ar:
        for name in ("MXFP4", "NVFP4"):
            got = ar.dequantize(name)
            assert got.dtype == torch.float32  # not the raw uint8 blocks
            assert _bits(got) == _bits(gguf_dequantize(reader[name].data, Q[name]))


@pytest.mark.parametrize("alignment", [None, 1, 8, 64, 256])
def test_gguf_writer_configurations_match_reader(tmp_path, alignment):
    from gguf import GGUFValueType as V

    p = tmp_path / "m.gguf"
    w = gguf.GGUFWriter(str(p), "llama")
    if alignment is not None:
        w.add_custom_alignment(alignment)
    w.add_uint8("v.u8", 255)
    w.add_int8("v.i8", -128)
    w.add_uint16("v.u16", 65535)
    w.add_int16("v.i16", -32768)
    w.add_uint32("v.u32", 2**32 - 1)
    w.add_int32("v.i32", -(2**31))
    w.add_float32("v.f32", 0.1)
    w.add_uint64("v.u64", 2**64 - 1)
    w.add_int64("v.i64", -(2**63))
    w.add_float64("v.f64", 1e300)
    w.add_bool("v.bool", True)
    w.add_string("v.str", "h\u00e9llo")
    w.add_string("v.empty", "")
    w.add_array("v.arr_f32", [0.5, -1.0])
    w.add_array("v.arr_str", ["a", "", "\u00df"])
    w.add_array("v.arr_bool", [True, False])
    w.add_array("v.arr_empty", [])
    w.add_key_value("v.nested", [[1, 2], [3]], V.ARRAY, sub_type=V.ARRAY)
    w.add_key_value("v.nested_str", [["x"], ["y", "z"]], V.ARRAY, sub_type=V.ARRAY)
    rng = np.random.default_rng(1)
    w.add_tensor("a", rng.standard_normal((3, 5)).astype(np.float32))
    w.add_tensor("b", rng.standard_normal((7,)).astype(np.float16))
    w.add_tensor("c", np.arange(4, dtype=np.int32).reshape(1, 2, 2))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    r = gguf.GGUFReader(str(p))
    with tdz_numba.open(p) as ar:
        meta = ar.metadata
        for name, field in r.fields.items():
            if name.startswith("GGUF."):
                continue
            ref = field.contents()
            got = meta[name]
            if isinstance(ref, float) and field.types[0] == V.FLOAT32:
                assert np.float32(got) == np.float32(ref), name
            elif name.startswith("v.nested"):  # GGUFReader.contents() flattens arrays of arrays
                assert [x for sub in got for x in sub] == ref, name
            elif name == "v.arr_f32":
                assert np.array(got, np.float32).tobytes() == np.array(ref, np.float32).tobytes()
            else:
                assert got == ref, name
        assert meta["v.nested"] == [[1, 2], [3]] and meta["v.nested_str"] == [["x"], ["y", "z"]]
        for t in r.tensors:
            ref = np.asarray(t.data)
            _same(ar[t.name].contiguous(), ref.reshape(tuple(int(d) for d in reversed(t.shape))))


def test_big_endian_gguf_refused_clearly(tmp_path):
    p = tmp_path / "be.gguf"
    w = gguf.GGUFWriter(str(p), "llama", endianess=gguf.GGUFEndian.BIG)
    w.add_tensor("a", np.arange(4, dtype=np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    assert gguf.GGUFReader(str(p)).tensors[0].data.tolist() == [0, 1, 2, 3]  # gguf reads it
    with pytest.raises(UnsupportedError, match="big-endian"):
        tdz_numba.open(p)


# ----------------------------------------------------------------------------- convert


def test_convert_warns_for_dtypes_tensordict_cannot_load(tmp_path):
    from safetensors.torch import save_file

    from tdz_numba.conversion import TENSORDICT_DTYPES

    tensordict = pytest.importorskip("tensordict")
    from tensordict.utils import _TORCH_DTYPES

    assert {str(d) for d in _TORCH_DTYPES} == TENSORDICT_DTYPES  # the table follows 0.15.3's
    p = tmp_path / "f8.safetensors"
    save_file(
        {
            "w.e8": torch.ones(3).to(torch.float8_e8m0fnu),
            "w.e4": torch.ones(2).to(torch.float8_e4m3fn),
            "b": torch.ones(2),
        },
        str(p),
    )
    with pytest.warns(UserWarning, match="tensordict 0.15.3 cannot load") as rec:
        out = tdz_numba.convert(p, tmp_path / "f8.tdz", nest=".")
    msg = str(rec[0].message)
    assert "'w/e8'" in msg and "'w/e4'" in msg and "float8_e8m0fnu" in msg and "'b'" not in msg
    assert rec[0].filename == __file__
    with pytest.raises(KeyError):  # what the warning announces
        tensordict.TensorDict.load_memmap(out)
    with tdz_numba.open(out) as ar:
        assert ar["w"]["e8"].float().tolist() == [1.0, 1.0, 1.0]
    q = tmp_path / "plain.safetensors"
    save_file({"b": torch.ones(2)}, str(q))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        tdz_numba.convert(q, tmp_path / "plain.tdz")  # no warning when every dtype loads


def test_quote_caps_messages():
    from tdz_numba.formats._common import quote

    assert quote("x" * 10**6).endswith("...") and len(quote("x" * 10**6)) == 83
    assert len(quote(list(range(10**6)))) < 100 and quote("ab") == "'ab'"
