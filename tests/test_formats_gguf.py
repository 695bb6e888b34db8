"""GGUF reader and dequantize kernels, against files and decoders of the ``gguf`` package."""

from __future__ import annotations

import struct
import warnings

import numpy as np
import pytest
import torch
from fuzz_readers import LONG_ITERATIONS, fuzz_iterations, require_fuzz_selected, run_fuzz
from naive_gguf import NAIVE_TYPES, naive_dequantize

from tdz_numba.errors import BadArchiveError, InvalidArgumentError, TdzError, UnsupportedError
from tdz_numba.formats.gguf import GGML_TYPES, dequantize, detect_gguf, open_gguf
from tdz_numba.tdz.sources import tensor_from_spec

gguf = pytest.importorskip("gguf")
from gguf import GGMLQuantizationType as T  # noqa: E402
from gguf.quants import dequantize as gguf_dequantize  # noqa: E402
from gguf.quants import quantize as gguf_quantize  # noqa: E402

KERNEL_TYPES = ["Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K"]


def _ref(raw: np.ndarray, name: str) -> np.ndarray:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)
        return gguf_dequantize(raw, T[name])


def _same_bits(a: np.ndarray, b: np.ndarray) -> bool:
    """Bit-for-bit equal, NaNs compared as NaN (their payloads depend on operand order)."""
    a, b = np.asarray(a, np.float32).reshape(-1), np.asarray(b, np.float32).reshape(-1)
    nan = np.isnan(a)
    return (
        a.shape == b.shape
        and np.array_equal(nan, np.isnan(b))
        and np.array_equal(a.view(np.uint32)[~nan], b.view(np.uint32)[~nan])
    )


def _random_blocks(rng, name: str, n_blocks: int, sane: bool) -> np.ndarray:
    _, block, tsize = GGML_TYPES[T[name].value]
    raw = rng.integers(0, 256, size=(n_blocks, tsize), dtype=np.uint8)
    if sane:  # finite fp16 scales; the random ones also cover inf/nan
        half = rng.uniform(-2, 2, size=(n_blocks, 2)).astype(np.float16).view(np.uint8)
        if name in ("Q2_K",):
            raw[:, 80:84] = half
        elif name == "Q3_K":
            raw[:, 108:110] = half[:, :2]
        elif name == "Q6_K":
            raw[:, 208:210] = half[:, :2]
        else:
            raw[:, 0 : 4 if name in ("Q4_1", "Q5_1", "Q4_K", "Q5_K") else 2] = half[
                :, : 4 if name in ("Q4_1", "Q5_1", "Q4_K", "Q5_K") else 2
            ]
    return raw


@pytest.mark.parametrize("name", KERNEL_TYPES)
@pytest.mark.parametrize("n_blocks", [1, 3, 517])
@pytest.mark.parametrize("sane", [True, False])
def test_dequantize_matches_gguf_bit_for_bit(name, n_blocks, sane):
    rng = np.random.default_rng(n_blocks * 7 + len(name))
    _, block, _ = GGML_TYPES[T[name].value]
    raw = _random_blocks(rng, name, n_blocks, sane)
    got = dequantize(raw, name, (n_blocks * block,))
    assert got.dtype == np.float32 and got.shape == (n_blocks * block,)
    assert _same_bits(_ref(raw, name), got)


@pytest.mark.parametrize("name", ["Q8_0", "Q4_K", "Q6_K", "Q5_1"])
def test_dequantize_rows_threads_and_torch(name):
    rng = np.random.default_rng(1)
    _, block, tsize = GGML_TYPES[T[name].value]
    rows, per_row = 5, 3  # 5 rows of 3 blocks each, shape (5, 3 * block)
    raw = _random_blocks(rng, name, rows * per_row, True).reshape(rows, per_row * tsize)
    ref = _ref(raw, name)
    assert ref.shape == (rows, per_row * block)
    for threads in (None, 1):
        assert _same_bits(ref, dequantize(raw, name, (rows, per_row * block), num_threads=threads))
    t = dequantize(torch.from_numpy(raw), T[name], [rows, per_row * block])
    assert isinstance(t, torch.Tensor) and t.shape == (rows, per_row * block)
    assert _same_bits(ref, t.numpy())
    assert _same_bits(ref, dequantize(raw.tobytes(), name, (rows, per_row * block)))


def test_dequantize_plain_types():
    rng = np.random.default_rng(2)
    h = rng.standard_normal(40).astype(np.float16)
    assert _same_bits(dequantize(h.view(np.uint8), "F16", (5, 8)), h.astype(np.float32))
    bf = rng.integers(0, 2**16, 64, dtype=np.uint16)
    assert _same_bits(dequantize(bf, "BF16", (64,)), _ref(bf.view(np.uint8).reshape(1, -1), "BF16"))
    i = np.arange(6, dtype=np.int32)
    assert dequantize(i, "I32", (2, 3)).tolist() == [[0, 1, 2], [3, 4, 5]]
    assert dequantize(np.zeros(0, np.uint8), "Q4_K", (0, 256)).shape == (0, 256)


def test_dequantize_rejects_bad_sizes():
    raw = np.zeros(34 * 2, np.uint8)
    with pytest.raises(InvalidArgumentError):
        dequantize(raw, "Q8_0", (96,))  # 3 blocks' worth of elements, 2 blocks of bytes
    with pytest.raises(InvalidArgumentError):
        dequantize(raw[:-1], "Q8_0", (64,))
    with pytest.raises(InvalidArgumentError):
        dequantize(raw, "Q8_0", (2, 32 + 16, 1))  # row not whole blocks
    with pytest.raises(InvalidArgumentError):
        dequantize(raw, "NOPE", (64,))
    with pytest.raises(InvalidArgumentError):
        dequantize(raw, 5, (64,))  # an unassigned ggml id


def test_dequantize_other_types_through_gguf():
    rng = np.random.default_rng(3)
    raw = rng.integers(0, 256, size=(2, GGML_TYPES[20][2]), dtype=np.uint8)  # IQ4_NL
    assert _same_bits(dequantize(raw, "IQ4_NL", (64,)), _ref(raw, "IQ4_NL"))
    with pytest.raises(UnsupportedError):
        dequantize(np.zeros(40, np.uint8), "Q8_1", (32,))


def _write(path, tensors, *, alignment=None, extra_kv=True):
    w = gguf.GGUFWriter(str(path), "llama")
    if alignment is not None:
        w.add_custom_alignment(alignment)
    if extra_kv:
        w.add_uint8("t.u8", 200)
        w.add_int8("t.i8", -100)
        w.add_uint16("t.u16", 60000)
        w.add_int16("t.i16", -30000)
        w.add_uint32("t.u32", 4_000_000_000)
        w.add_int32("t.i32", -2_000_000_000)
        w.add_float32("t.f32", 0.5)
        w.add_uint64("t.u64", 2**64 - 1)
        w.add_int64("t.i64", -(2**63))
        w.add_float64("t.f64", 1e300)
        w.add_bool("t.bool", True)
        w.add_string("t.str", "héllo")
        w.add_array("t.arr_int", [1, 2, 3])
        w.add_array("t.arr_float", [0.5, 1.5])
        w.add_array("t.arr_str", ["a", "bc", ""])
        w.add_array("t.arr_bool", [True, False])
        w.add_array("t.nested", [[1, 2], [3]])
    for name, (arr, raw_dtype) in tensors.items():
        if raw_dtype is None:
            w.add_tensor(name, arr)
        else:
            w.add_tensor(name, arr, raw_dtype=raw_dtype)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def _model(rng):
    f32 = rng.standard_normal((4, 3, 64)).astype(np.float32)
    rows = rng.standard_normal((6, 256)).astype(np.float32)
    tensors = {
        "f32": (f32, None),
        "f16": (rng.standard_normal((7, 5)).astype(np.float16), None),
        "f64": (rng.standard_normal(9), None),
        "i8": (rng.integers(-128, 127, (3, 4), dtype=np.int8), None),
        "i16": (rng.integers(-1000, 1000, 11, dtype=np.int16), None),
        "i32": (rng.integers(-(2**31), 2**31 - 1, (2, 2, 2), dtype=np.int32), None),
        "i64": (rng.integers(-(2**62), 2**62, 5, dtype=np.int64), None),
        "bf16": (gguf_quantize(rng.standard_normal((2, 8)).astype(np.float32), T.BF16), T.BF16),
    }
    for name in ("Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1"):
        tensors[name.lower()] = (gguf_quantize(rows, T[name]), T[name])
    for name in ("Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K"):  # no Python quantizer: random blocks
        raw = _random_blocks(rng, name, 6 * 2, True).reshape(3, 2, -1).reshape(3, -1)
        tensors[name.lower()] = (raw, T[name])
    return tensors


def test_open_writer_file_matches_gguf_reader(tmp_path):
    rng = np.random.default_rng(4)
    path = _write(tmp_path / "m.gguf", _model(rng))
    assert detect_gguf(path.read_bytes()[:16], path)
    src = open_gguf(path)
    reader = gguf.GGUFReader(str(path))
    assert src.version == 3 and src.format == "gguf"
    meta = src.metadata
    assert meta["general.architecture"] == "llama"
    assert meta["t.u8"] == 200 and meta["t.i8"] == -100 and meta["t.u16"] == 60000 and meta["t.i16"] == -30000
    assert meta["t.u32"] == 4_000_000_000 and meta["t.i32"] == -2_000_000_000 and meta["t.f32"] == 0.5
    assert meta["t.u64"] == 2**64 - 1 and meta["t.i64"] == -(2**63) and meta["t.f64"] == 1e300
    assert meta["t.bool"] is True and meta["t.str"] == "héllo"
    assert meta["t.arr_int"] == [1, 2, 3] and meta["t.arr_float"] == [0.5, 1.5]
    assert meta["t.arr_str"] == ["a", "bc", ""] and meta["t.arr_bool"] == [True, False]
    assert meta["t.nested"] == [[1, 2], [3]]
    for key, field in reader.fields.items():
        if key.startswith("GGUF.") or key == "t.nested":
            continue
        assert meta[key] == field.contents(), key
    children = src.level("").children
    assert list(children) == [t.name for t in reader.tensors]
    for rt in reader.tensors:
        spec = children[rt.name].leaf
        assert spec.type_name == rt.tensor_type.name
        got = tensor_from_spec(spec, src.files)
        want = np.asarray(rt.data)
        if spec.type_name == "BF16":  # GGUFReader gives bf16 as bytes
            want = want.view(np.int16)
        assert tuple(got.shape) == want.shape, rt.name
        if spec.type_name == "BF16":
            assert got.dtype == torch.bfloat16
            assert np.array_equal(got.view(torch.int16).numpy(), want)
        else:
            assert np.array_equal(got.numpy(), want), rt.name
        assert got.data_ptr() == src.files[0].torch_u8.data_ptr() + spec.offset  # zero-copy
        deq = src.dequantize(rt.name)
        ref = (
            gguf_dequantize(np.asarray(rt.data), rt.tensor_type)
            if spec.type_name not in ("F64", "I8", "I16", "I32", "I64")
            else want
        )
        assert (
            _same_bits(ref, deq.numpy().astype(np.float32))
            if ref.dtype == np.float32
            else np.array_equal(ref, deq.numpy())
        )
        assert tuple(deq.shape) == tuple(int(d) for d in reversed(rt.shape))
    # the original float values survive a Q8_0 round trip approximately
    assert np.allclose(
        src.dequantize("q8_0").numpy(), gguf_dequantize(_model(np.random.default_rng(4))["q8_0"][0], T.Q8_0)
    )
    src.close()


def test_alignment_key_and_version_2(tmp_path):
    rng = np.random.default_rng(5)
    tensors = {
        "a": (rng.standard_normal(3).astype(np.float32), None),
        "b": (rng.standard_normal((2, 5)).astype(np.float32), None),
    }
    path = _write(tmp_path / "a.gguf", tensors, alignment=64, extra_kv=False)
    src = open_gguf(path)
    assert src.metadata["general.alignment"] == 64 and src.data_start % 64 == 0
    for name, (arr, _) in tensors.items():
        spec = src.level("").children[name].leaf
        assert (spec.offset - src.data_start) % 64 == 0
        assert np.array_equal(tensor_from_spec(spec, src.files).numpy(), arr)
    data = bytearray(path.read_bytes())
    data[4:8] = struct.pack("<I", 2)
    v2 = tmp_path / "v2.gguf"
    v2.write_bytes(data)
    s2 = open_gguf(v2)
    assert s2.version == 2
    assert np.array_equal(
        tensor_from_spec(s2.level("").children["b"].leaf, s2.files).numpy(), tensors["b"][0]
    )


def _header(n_tensors, n_kv, version=3):
    return b"GGUF" + struct.pack("<IQQ", version, n_tensors, n_kv)


def _s(text: bytes) -> bytes:
    return struct.pack("<Q", len(text)) + text


def _tensor_info(name=b"w", dims=(4,), ggml_type=0, offset=0):
    return (
        _s(name)
        + struct.pack("<I", len(dims))
        + struct.pack(f"<{len(dims)}Q", *dims)
        + struct.pack("<IQ", ggml_type, offset)
    )


def _pad(b: bytes, n=32) -> bytes:
    return b + b"\0" * (-len(b) % n)


@pytest.mark.parametrize(
    "data, error",
    [
        (b"GGU", BadArchiveError),
        (b"GGML" + b"\0" * 40, BadArchiveError),
        (_header(0, 0, version=1), UnsupportedError),
        (b"GGUF" + struct.pack(">IQQ", 3, 0, 0), UnsupportedError),  # big-endian
        (_header(0, 0, version=7), BadArchiveError),
        (_header(2**60, 0), BadArchiveError),  # tensor count vs file size
        (_header(0, 2**63), BadArchiveError),
        (_header(0, 1) + struct.pack("<Q", 2**62) + b"k", BadArchiveError),  # key length
        (_header(0, 1) + _s(b"k") + struct.pack("<I", 99) + b"\0" * 8, BadArchiveError),  # value type
        (_header(0, 1) + _s(b"k") + struct.pack("<IIQ", 9, 4, 2**61), BadArchiveError),  # array count
        (_header(0, 1) + _s(b"k") + struct.pack("<IIQ", 9, 77, 1) + b"\0" * 8, BadArchiveError),  # item type
        (_header(0, 1) + _s(b"k") + struct.pack("<I", 8) + struct.pack("<Q", 10**12), BadArchiveError),
        (
            _header(0, 1)
            + _s(b"k")
            + struct.pack("<IIQ", 9, 8, 2)
            + _s(b"a")
            + struct.pack("<Q", 2**40)
            + b"\0" * 16,
            BadArchiveError,
        ),  # string array item length
        (
            _header(0, 1) + _s(b"k") + struct.pack("<IIQ", 9, 8, 3) + _s(b"a") + _s(b"b") + b"\0" * 4,
            BadArchiveError,
        ),  # string array truncated
        (_header(0, 2) + (_s(b"k") + struct.pack("<IB", 0, 1)) * 2, BadArchiveError),  # duplicate key
        (_header(0, 1) + _s(b"general.alignment") + struct.pack("<II", 4, 48), BadArchiveError),
        (_header(0, 1) + _s(b"general.alignment") + struct.pack("<Q", 8) + b"abcdefgh", BadArchiveError),
        (_pad(_header(1, 0) + _tensor_info(dims=(1,) * 9)) + b"\0" * 64, BadArchiveError),  # too many dims
        (_pad(_header(1, 0) + _tensor_info(ggml_type=5)) + b"\0" * 64, BadArchiveError),  # unknown type
        (_pad(_header(1, 0) + _tensor_info(offset=8)) + b"\0" * 64, BadArchiveError),  # misaligned
        (_pad(_header(1, 0) + _tensor_info(dims=(64,))) + b"\0" * 64, BadArchiveError),  # past the end
        (_pad(_header(1, 0) + _tensor_info(dims=(2**40, 2**40))) + b"\0" * 64, BadArchiveError),
        (_pad(_header(1, 0) + _tensor_info(offset=2**64 - 32)) + b"\0" * 64, BadArchiveError),
        (
            _pad(_header(1, 0) + _tensor_info(dims=(0, 2**40, 2**40))) + b"\0" * 64,
            BadArchiveError,
        ),  # empty, huge
        (_pad(_header(1, 0) + _tensor_info(dims=(48,), ggml_type=8)) + b"\0" * 64, BadArchiveError),  # row
        (_pad(_header(1, 0) + _tensor_info(dims=(), ggml_type=12)) + b"\0" * 512, BadArchiveError),
        (_pad(_header(2, 0) + _tensor_info() * 2) + b"\0" * 64, BadArchiveError),  # duplicate name
    ],
)
def test_malformed_headers(tmp_path, data, error):
    p = tmp_path / "bad.gguf"
    p.write_bytes(data)
    with pytest.raises(error):
        open_gguf(p)


def test_nested_arrays_depth_limit(tmp_path):
    body = _s(b"k") + struct.pack("<I", 9) + struct.pack("<IQ", 9, 1) * 12 + struct.pack("<IQ", 4, 0)
    p = tmp_path / "deep.gguf"
    p.write_bytes(_header(0, 1) + body)
    with pytest.raises(BadArchiveError, match="nested"):
        open_gguf(p)


def test_every_truncation_is_an_error(tmp_path):
    path = _write(
        tmp_path / "t.gguf",
        {
            "w": (np.ones((2, 32), np.float32), None),
            "q": (gguf_quantize(np.ones((2, 32), np.float32), T.Q8_0), T.Q8_0),
        },
    )
    data = path.read_bytes()
    src = open_gguf(path)
    end = max(i.offset + i.nbytes for i in src.tensor_info.values())  # the padding after it is optional
    src.close()
    cut = tmp_path / "cut.gguf"
    for n in list(range(0, 600)) + list(range(600, end, 37)) + [end - 1]:
        cut.write_bytes(data[:n])
        with pytest.raises(TdzError):
            open_gguf(cut)


def test_fuzz_gguf(tmp_path):
    rng = np.random.default_rng(6)
    seed = _write(
        tmp_path / "seed.gguf",
        {
            "f": (rng.standard_normal((3, 32)).astype(np.float32), None),
            "q8": (gguf_quantize(rng.standard_normal((2, 64)).astype(np.float32), T.Q8_0), T.Q8_0),
            "q4k": (_random_blocks(rng, "Q4_K", 2, True).reshape(1, -1), T.Q4_K),
        },
    )
    head = open_gguf(seed).data_start
    n = fuzz_iterations(1000)
    accepted = run_fuzz(seed, "tdz_numba.formats.gguf.open_gguf", n, tmp_path, head=head, suffix=".gguf")
    print("accepted", accepted, "of", n)
    assert accepted >= n // 20, (
        f"only {accepted} of {n} mutants read in full: a reader refusing all would pass"
    )


def test_detect_and_open_source(tmp_path):
    from tdz_numba import formats

    path = _write(tmp_path / "model.bin", {"w": (np.ones((2, 32), np.float32), None)}, extra_kv=False)
    assert formats.detect(path) == "gguf"
    src = formats.open_source(path)
    assert src.format == "gguf" and formats.to_tree(src)["w"].shape == (2, 32)
    src.close()


@pytest.mark.parametrize("name", ["Q4_K", "Q8_0", "Q6_K"])
def test_dequantize_accepts_block_view_shape(name):
    """Archive.dequantize passes the leaf's own (block view) shape."""
    rng = np.random.default_rng(8)
    _, block, tsize = GGML_TYPES[T[name].value]
    raw = _random_blocks(rng, name, 6, True).reshape(3, 2 * tsize)
    got = dequantize(torch.from_numpy(raw), name, raw.shape)
    assert tuple(got.shape) == (3, 2 * block)
    assert _same_bits(_ref(raw, name), got.numpy())


@pytest.mark.fuzz
def test_fuzz_gguf_long(tmp_path, request):
    require_fuzz_selected(request)
    rng = np.random.default_rng(9)
    seed = _write(
        tmp_path / "seed.gguf",
        {
            "f": (rng.standard_normal((3, 32)).astype(np.float32), None),
            "q5": (gguf_quantize(rng.standard_normal((2, 64)).astype(np.float32), T.Q5_1), T.Q5_1),
            "q6k": (_random_blocks(rng, "Q6_K", 2, True).reshape(1, -1), T.Q6_K),
        },
    )
    n = fuzz_iterations(LONG_ITERATIONS)
    run_fuzz(
        seed,
        "tdz_numba.formats.gguf.open_gguf",
        n,
        tmp_path,
        rseed=1,
        head=open_gguf(seed).data_start,
        suffix=".gguf",
        timeout=max(120.0, n / 20),
    )


@pytest.mark.parametrize("name", NAIVE_TYPES)
@pytest.mark.parametrize("sane", [True, False])
def test_dequantize_matches_ggml_c_reference(name, sane):
    """Against a slow transcription of ggml's C ``dequantize_row_*`` (tests/naive_gguf.py)."""
    rng = np.random.default_rng(10 + len(name) + sane)
    raw = _random_blocks(rng, name, 3, sane)
    _, block, _ = GGML_TYPES[T[name].value]
    want = naive_dequantize(raw, name)
    assert _same_bits(want, dequantize(raw, name, (3 * block,)))


def test_through_tdz_numba_open(tmp_path):
    """The public API over a GGUF file (runs once Archive reads foreign formats)."""
    import tdz_numba

    if not hasattr(tdz_numba.Archive, "format"):
        pytest.skip("tdz_numba.open does not read foreign formats in this build yet")
    q = gguf_quantize(np.linspace(-1, 1, 128, dtype=np.float32).reshape(2, 64), T.Q8_0)
    path = _write(
        tmp_path / "m.gguf",
        {"w": (np.arange(64, dtype=np.float32).reshape(2, 32), None), "q": (q, T.Q8_0)},
        extra_kv=False,
    )
    with tdz_numba.open(path) as ar:
        assert ar.format == "gguf" and ar.metadata["general.architecture"] == "llama"
        assert ar["w"].tolist() == np.arange(64, dtype=np.float32).reshape(2, 32).tolist()
        assert ar.info("q").type_name == "Q8_0" and tuple(ar["q"].shape) == (2, 68)
        if hasattr(ar, "dequantize"):
            assert _same_bits(gguf_dequantize(q, T.Q8_0), ar.dequantize("q").numpy())


def test_load_and_open_with_dequantize(tmp_path):
    """``load/open(..., dequantize=True)``: quantized leaves come decoded to float32 (bit for bit
    what gguf's dequantize gives), plain leaves stay zero-copy views; dtype= applies after."""
    import tdz_numba

    p = tmp_path / "q.gguf"
    rng = np.random.default_rng(1)
    rows = rng.standard_normal((4, 256)).astype(np.float32)
    w = gguf.GGUFWriter(str(p), "llama")
    w.add_tensor("q8", gguf_quantize(rows, T.Q8_0), raw_dtype=T.Q8_0)
    q4k = rng.integers(0, 256, (4, 144), dtype=np.uint8)  # random blocks (gguf cannot quantize Q4_K)
    w.add_tensor("q4k", q4k, raw_dtype=T.Q4_K)
    w.add_tensor("f32", rows)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    raw = tdz_numba.load(p)
    assert raw["q8"].dtype == torch.uint8  # the default: block views
    out = tdz_numba.load(p, dequantize=True)
    for k, blocks, t in (("q8", gguf_quantize(rows, T.Q8_0), T.Q8_0), ("q4k", q4k, T.Q4_K)):
        want = gguf_dequantize(blocks, t)
        assert out[k].dtype == torch.float32 and out[k].shape == (4, 256)
        assert np.array_equal(out[k].numpy().view(np.uint32), want.view(np.uint32))
    assert torch.equal(out["f32"], torch.from_numpy(rows))
    with tdz_numba.open(p, dequantize=True) as ar:
        assert torch.equal(ar["q8"], out["q8"]) and torch.equal(ar.dequantize("q8"), out["q8"])
        assert dict(ar.iter_leaves()).keys() == {"q8", "q4k", "f32"}
        assert all(t.dtype == torch.float32 for _, t in ar.iter_leaves())
        assert ar.info("f32").zero_copy
    half = tdz_numba.load(p, dequantize=True, dtype="float16")
    assert half["q4k"].dtype == torch.float16
    assert torch.equal(half["q4k"].isnan(), out["q4k"].half().isnan())
