"""GGUF (llama.cpp's weight format, versions 2 and 3): a mapped reader and dequantization.

The header, every metadata key/value and every tensor info are parsed in
Python from the mapped file, each count and length checked against the bytes
that remain before anything is allocated or looped over. Tensors become
:class:`~tdz_numba.tdz.sources.TensorSpec` leaves of one flat level keyed by the
file's tensor names; ``metadata`` is the key/value dict.

Shapes: GGUF lists dimensions fastest first (``ne[0]`` is the row length), so
they are reversed into numpy/torch order. Plain types (F32, F16, BF16, F64,
I8, I16, I32, I64) are typed zero-copy views of that shape. Quantized tensors
are zero-copy ``uint8`` views of their blocks with shape ``(*rows,
bytes_per_row)`` where ``rows`` are the reversed ``ne[1:]`` and
``bytes_per_row = ne[0] // block_size * type_size`` (the ``gguf`` package's
``GGUFReader`` gives the same shape); ``TensorSpec.type_name`` names the ggml
type (``"Q4_K"``) and :meth:`GGUFSource.dequantize` / :func:`dequantize`
decode them to float32 with the Numba kernels of
:mod:`~tdz_numba.formats.gguf_kernels` (the other block types, MXFP4 and
NVFP4 included, through the ``gguf`` package; Q8_1, Q8_K and Q1_0, which it
cannot decode either, raise :class:`~tdz_numba.UnsupportedError`).

Limits (refused at open): big-endian files and version 1; more than
:data:`MAX_DIMS` dimensions; metadata arrays nested deeper than
:data:`MAX_ARRAY_DEPTH`; more than :data:`MAX_METADATA` metadata keys or
arrays. Quoted keys and names in error messages are cut to 80 characters.

Examples
--------
>>> import tempfile, pathlib, numpy as np, gguf
>>> from tdz_numba.formats.gguf import open_gguf
>>> with tempfile.TemporaryDirectory() as d:
...     p = str(pathlib.Path(d) / "m.gguf")
...     w = gguf.GGUFWriter(p, "llama"); w.add_tensor("w", np.arange(6, dtype=np.float32).reshape(2, 3))
...     w.write_header_to_file(); w.write_kv_data_to_file(); w.write_tensors_to_file(); w.close()
...     src = open_gguf(p)
...     spec = src.level("").children["w"].leaf
...     print(spec.shape, spec.type_name, src.metadata["general.architecture"])
(2, 3) F32 llama
"""

from __future__ import annotations

import math
import operator
import os
import struct
from typing import Any, cast

import numpy as np

from ..errors import BadArchiveError, InvalidArgumentError, MissingKeyError, UnsupportedError
from ..tdz.sources import MappedFile, TreeSource, tensor_from_spec
from ._common import no_gc, quote
from ._flat import flat_source, make_specs
from .gguf_bulk import bulk_columns, bulk_infos, infos_of
from .gguf_types import GGML_TYPES, MAX_DIMS, GGUFTensorInfo

__all__ = [
    "GGML_TYPES",
    "GGUFTensorInfo",
    "GGUFSource",
    "detect_gguf",
    "open_gguf",
    "dequantize",
    "is_quantized",
    "MAX_DIMS",
    "MAX_ARRAY_DEPTH",
    "MAX_METADATA",
]

MAGIC = b"GGUF"
#: Deepest nesting of metadata arrays accepted.
MAX_ARRAY_DEPTH = 8
#: Most metadata keys, and most metadata arrays (nested ones included), read from one file.
MAX_METADATA = 250_000

_BY_NAME = {v[0]: k for k, v in GGML_TYPES.items()}
_PLAIN = {
    "F32": "float32",
    "F16": "float16",
    "BF16": "bfloat16",
    "F64": "float64",
    "I8": "int8",
    "I16": "int16",
    "I32": "int32",
    "I64": "int64",
}

# metadata value types: id -> (struct format, size); 7 bool, 8 string, 9 array
_SCALARS = {
    0: ("<B", 1),
    1: ("<b", 1),
    2: ("<H", 2),
    3: ("<h", 2),
    4: ("<I", 4),
    5: ("<i", 4),
    6: ("<f", 4),
    7: ("<?", 1),
    10: ("<Q", 8),
    11: ("<q", 8),
    12: ("<d", 8),
}
_NP = {
    0: "<u1",
    1: "<i1",
    2: "<u2",
    3: "<i2",
    4: "<u4",
    5: "<i4",
    6: "<f4",
    7: "<u1",
    10: "<u8",
    11: "<i8",
    12: "<f8",
}
_U64 = struct.Struct("<Q")
_MIN_SIZE = {**{k: v[1] for k, v in _SCALARS.items()}, 8: 8, 9: 12}


class _Cursor:
    """Bounds-checked little-endian reads from the mapped header.

    ``subject`` names what is being read (``"metadata 'general.name'"``); it and
    the ``what`` of each read are joined into a message only when a read fails.
    """

    def __init__(self, buf: memoryview, where: str) -> None:
        self.buf = buf
        self.size = len(buf)
        self.pos = 0
        self.where = where
        self.subject = ""
        self.arrays = 0  # metadata arrays built so far (nested ones included)

    def fail(self, what: str) -> BadArchiveError:
        return BadArchiveError(f"{self.where}: {self.subject}{what}")

    def need(self, n: int, what: str) -> None:
        if n < 0 or self.pos + n > self.size:
            raise self.fail(
                f"{what} at offset {self.pos} needs {n} bytes, the file has {self.size - self.pos} left"
            )

    def unpack(self, fmt: str, n: int, what: str) -> Any:
        if self.pos + n > self.size:
            self.need(n, what)
        (v,) = struct.unpack_from(fmt, self.buf, self.pos)
        self.pos += n
        return v

    def u32(self, what: str) -> int:
        return self.unpack("<I", 4, what)

    def u64(self, what: str) -> int:
        return self.unpack("<Q", 8, what)

    def string(self, what: str) -> str:
        n = self.u64(f"{what} length")
        if n > self.size - self.pos:
            self.need(n, what)
        raw = self.buf[self.pos : self.pos + n]
        self.pos += n
        return str(raw, "utf-8", "replace")

    def count(self, what: str, min_item: int) -> int:
        n = self.u64(what)
        if n * min_item > self.size - self.pos:
            raise self.fail(
                f"{what} {n} at offset {self.pos - 8} exceeds the {self.size - self.pos} bytes left"
            )
        return n

    def _strings(self, n: int, what: str) -> list[str]:
        buf, pos, size = self.buf, self.pos, self.size
        unpack = _U64.unpack_from
        out: list[str] = []
        append = out.append
        for i in range(n):
            if pos + 8 > size:
                self.pos = pos
                self.need(8, f"{what}item {i} length")
            (ln,) = unpack(buf, pos)
            pos += 8
            if ln > size - pos:
                self.pos = pos
                self.need(ln, f"{what}item {i}")
            append(str(buf[pos : pos + ln], "utf-8", "replace"))
            pos += ln
        self.pos = pos
        return out

    def value(self, vtype: int, depth: int = 0) -> Any:
        if vtype in _SCALARS:
            fmt, n = _SCALARS[vtype]
            return self.unpack(fmt, n, "value")
        if vtype == 8:
            return self.string("value")
        if vtype != 9:
            raise self.fail(f": unknown value type {vtype} at offset {self.pos - 4}")
        if depth >= MAX_ARRAY_DEPTH:
            raise self.fail(f": arrays nested deeper than {MAX_ARRAY_DEPTH}")
        self.arrays += 1
        if self.arrays > MAX_METADATA:
            raise self.fail(f": more than {MAX_METADATA:,} metadata values and arrays (the reader's limit)")
        itype = self.u32("array item type")
        if itype not in _MIN_SIZE:
            raise self.fail(f": unknown array item type {itype} at offset {self.pos - 4}")
        n = self.count("array item count", _MIN_SIZE[itype])
        if not n:
            return []
        if itype == 8:  # string arrays (vocabularies: 100k+ items): one tight loop
            return self._strings(n, "array ")
        if itype in _NP:
            arr = np.frombuffer(self.buf, dtype=_NP[itype], count=n, offset=self.pos)
            self.pos += n * _SCALARS[itype][1]
            return arr.astype(bool).tolist() if itype == 7 else arr.tolist()
        return [self.value(itype, depth + 1) for _ in range(n)]


def detect_gguf(head: bytes, path: str | os.PathLike | None = None) -> bool:
    """Whether the first bytes of a file are a GGUF header (magic ``b"GGUF"``).

    >>> detect_gguf(b"GGUF\\x03\\x00\\x00\\x00")
    True
    """
    return bytes(head[:4]) == MAGIC


#: Most tensor infos read one by one: the bulk pass's ~55 us of numpy calls cost more than the
#: records' ~7 us each below it (measured: 1 tensor 9 us against 61; 146 tensors 1.0 ms against 0.12).
SMALL = 6


def _parse(buf: memoryview, where: str, *, columns: bool = False) -> tuple[dict[str, Any], Any, int, int]:
    """``(metadata, infos, version, data_start)`` of a GGUF file; ``columns=True``: the infos as the
    tuple of their six fields' lists (:func:`~tdz_numba.formats.gguf_bulk.bulk_columns`)."""
    c = _Cursor(buf, where)
    c.need(4, "magic")
    if bytes(buf[:4]) != MAGIC:
        raise BadArchiveError(f"{where}: not a GGUF file (magic {bytes(buf[:4])!r})")
    c.pos = 4
    version = c.u32("version")
    if version not in (2, 3):
        if version & 0xFFFF == 0 and int.from_bytes(version.to_bytes(4, "little"), "big") in (1, 2, 3):
            raise UnsupportedError(f"{where}: big-endian GGUF files are not supported")
        if version == 1:
            raise UnsupportedError(f"{where}: GGUF version 1 is not supported (only 2 and 3)")
        raise BadArchiveError(f"{where}: unknown GGUF version {version}")
    n_tensors = c.count("tensor count", 24)
    n_kv = c.count("metadata count", 13)
    if n_kv > MAX_METADATA:
        raise UnsupportedError(f"{where}: {n_kv:,} metadata keys (the reader reads at most {MAX_METADATA:,})")
    meta: dict[str, Any] = {}
    for i in range(n_kv):
        c.subject = f"metadata key #{i} "
        key = c.string("key")
        if key in meta:
            raise BadArchiveError(f"{where}: duplicate metadata key {quote(key)}")
        c.subject = f"metadata {quote(key)} "
        meta[key] = c.value(c.u32("type"))
    c.subject = ""
    alignment = meta.get("general.alignment", 32)
    if type(alignment) is not int or alignment <= 0 or alignment & (alignment - 1):
        raise BadArchiveError(f"{where}: general.alignment {quote(alignment)} is not a power of two")
    bulk = None
    if n_tensors > SMALL:  # (a few tensors: read one by one, the path that decides anyway)
        bulk = (bulk_columns if columns else bulk_infos)(
            np.frombuffer(buf, np.uint8), c.pos, n_tensors, alignment
        )
    if bulk is not None:
        return meta, bulk[0], version, bulk[1]
    infos: list[tuple[str, int, tuple[int, ...], int]] = []
    for i in range(n_tensors):
        c.subject = f"tensor #{i} "
        name = c.string("name")
        c.subject = f"tensor {quote(name)} "
        n_dims = c.u32("dimension count")
        if n_dims > MAX_DIMS:
            raise c.fail(f"has {n_dims} dimensions (at most {MAX_DIMS})")
        c.need(8 * n_dims, "dimensions")
        dims = struct.unpack_from(f"<{n_dims}Q", buf, c.pos)
        c.pos += 8 * n_dims
        ggml_type = c.u32("type")
        offset = c.u64("offset")
        infos.append((name, ggml_type, dims, offset))
    data_start = -(-c.pos // alignment) * alignment
    out: list[GGUFTensorInfo] = []
    seen: set[str] = set()
    for name, ggml_type, dims, offset in infos:
        if name in seen:
            raise BadArchiveError(f"{where}: duplicate tensor name {quote(name)}")
        seen.add(name)
        if ggml_type not in GGML_TYPES:
            raise BadArchiveError(f"{where}: tensor {quote(name)}: unknown ggml type {ggml_type}")
        tname, block, tsize = GGML_TYPES[ggml_type]
        if block > 1 and (not dims or dims[0] % block):
            raise BadArchiveError(
                f"{where}: tensor {quote(name)}: row length {dims[0] if dims else None} is not a "
                f"multiple of the {tname} block size {block}"
            )
        if offset % alignment:
            raise BadArchiveError(
                f"{where}: tensor {quote(name)}: offset {offset} is not a multiple of {alignment}"
            )
        if (
            math.prod(max(d, 1) for d in dims) * 8 >= 2**63
        ):  # even an empty tensor needs a shape numpy can hold
            raise BadArchiveError(f"{where}: tensor {quote(name)}: dimensions {list(dims)} are too large")
        nbytes = math.prod(dims) // block * tsize
        start = data_start + offset
        if start + nbytes > len(buf):
            raise BadArchiveError(
                f"{where}: tensor {quote(name)} ({tname}, {nbytes} bytes at {start}) lies "
                f"outside the file ({len(buf)} bytes)"
            )
        out.append(GGUFTensorInfo(name, ggml_type, tname, tuple(reversed(dims)), start, nbytes))
    if columns:
        return meta, tuple(map(list, zip(*out))) if out else ([],) * 6, version, data_start
    return meta, out, version, data_start


class GGUFSource(TreeSource):
    """A GGUF file as a flat tree of tensors; ``metadata`` holds the key/value pairs.

    ``tensor_info[name]`` gives each tensor's ggml type and logical shape;
    :meth:`dequantize` decodes any tensor to float32.
    """

    version: int
    data_start: int
    _info_columns: tuple[Any, ...] = ([],) * 6  # the infos' six fields, one list each
    _info_table: dict[str, GGUFTensorInfo] | None = None

    @property
    def tensor_info(self) -> dict[str, GGUFTensorInfo]:
        """``{name: GGUFTensorInfo}`` of every tensor, in file order (built on first use)."""
        if self._info_table is None:
            self._info_table = dict(zip(self._info_columns[0], infos_of(self._info_columns)))
        return self._info_table

    def dequantize(self, key: str, *, num_threads: int | None = None) -> Any:
        """Tensor ``key`` decoded to a float32 torch tensor of its logical shape.

        Plain tensors (F32, F64, I8-I64) come back as they are (a zero-copy view).
        """
        try:
            info = self.tensor_info[key]
        except KeyError:
            raise MissingKeyError(f"{self.path}: no tensor {quote(key)}") from None
        spec = self.level("").children[key].leaf
        raw = tensor_from_spec(spec, self.files, where=str(self.path))
        return dequantize(raw, info.type_name, info.shape, num_threads=num_threads)


def _kind(torch: Any, tname: str, shape: tuple[int, ...]) -> tuple[Any, tuple[int, ...]]:
    """The torch dtype and leaf shape of a tensor of ggml type ``tname`` and logical ``shape``
    (quantized: ``uint8`` blocks, ``(*rows, bytes_per_row)``)."""
    plain = _PLAIN.get(tname)
    if plain is not None:
        return getattr(torch, plain), shape
    _, block, tsize = GGML_TYPES[_BY_NAME[tname]]
    return torch.uint8, (*shape[:-1], shape[-1] // block * tsize)


def open_gguf(path: str | os.PathLike, **kw: Any) -> GGUFSource:
    """Maps a GGUF file and describes its tensors (see the module docstring for shapes).

    Raises :class:`~tdz_numba.BadArchiveError` for any malformed header and
    :class:`~tdz_numba.UnsupportedError` for version 1 and big-endian files.
    """
    import torch

    f = MappedFile.open(path)
    where = str(path)
    try:
        with no_gc():  # millions of small metadata values: several times faster
            meta, cols, version, data_start = _parse(memoryview(f.buffer.data), where, columns=True)
        names, _, tnames, shapes, offsets, nbytes = cols
        n = len(names)
        if n and tnames.count(tnames[0]) == n and shapes.count(shapes[0]) == n:  # one kind (C-level ==)
            dtype, shape = _kind(torch, tnames[0], shapes[0])
            dtypes, leaf_shapes = [dtype] * n, [shape] * n
        else:
            kinds = {key: _kind(torch, *key) for key in set(zip(tnames, shapes))}
            per = list(map(kinds.__getitem__, zip(tnames, shapes)))
            dtypes, leaf_shapes = [p[0] for p in per], [p[1] for p in per]
        # every extent was checked against the file by _parse (or bulk_infos)
        tree = make_specs(names, dtypes, leaf_shapes, 0, offsets, nbytes, tnames)
        src = cast(GGUFSource, flat_source("gguf", path, tree, files=[f], metadata=meta, cls=GGUFSource))
    except BaseException:
        f.close()
        raise
    src._info_columns = cols
    src.version = version
    src.data_start = data_start
    return src


def is_quantized(type_name: str) -> bool:
    """Whether ``type_name`` names a GGML block type (``"Q4_K"``, ``"IQ2_XS"``, ``"MXFP4"``,
    ``"NVFP4"``): leaves :func:`dequantize` decodes to float32 (not F32, F16, BF16, I8-I64, F64).

    >>> is_quantized("MXFP4"), is_quantized("q8_0"), is_quantized("F16"), is_quantized("float32")
    (True, True, False, False)
    """
    tid = _BY_NAME.get(type_name.upper()) if isinstance(type_name, str) else None
    return tid is not None and GGML_TYPES[tid][1] > 1


def _type(ggml_type: int | str) -> tuple[str, int, int]:
    if isinstance(ggml_type, str):
        if ggml_type not in _BY_NAME:
            raise InvalidArgumentError(f"unknown ggml type {quote(ggml_type)}")
        return GGML_TYPES[_BY_NAME[ggml_type]]
    try:
        tid = operator.index(ggml_type)  # ints, numpy ints, gguf's GGMLQuantizationType
    except TypeError:
        raise InvalidArgumentError(f"ggml_type must be a name or an id, got {quote(ggml_type)}") from None
    if tid not in GGML_TYPES:
        raise InvalidArgumentError(f"unknown ggml type {quote(ggml_type)}")
    return GGML_TYPES[tid]


def dequantize(
    data: Any, ggml_type: int | str, shape: tuple[int, ...] | list[int], *, num_threads: int | None = None
) -> Any:
    """Decodes GGML blocks to float32 of the logical ``shape`` (numpy order, last dim = row).

    ``shape`` may also be the shape of the block view a GGUF leaf has,
    ``(*rows, bytes_per_row)`` (told apart by the byte count: the two never
    match the same buffer for a quantized type).

    ``data`` holds the raw bytes (a numpy array, a torch tensor or any buffer,
    e.g. the uint8 block view of a GGUF leaf); a torch tensor in gives a torch
    tensor out, anything else a numpy array. Q4_0, Q4_1, Q5_0, Q5_1, Q8_0,
    Q2_K, Q3_K, Q4_K, Q5_K, Q6_K, F16 and BF16 are decoded by parallel Numba
    kernels; F32/F64/I8-I64 are returned as they are (reshaped); other types
    go through the ``gguf`` package when it is installed
    (:class:`~tdz_numba.UnsupportedError` otherwise).

    Examples
    --------
    >>> import numpy as np
    >>> from tdz_numba.formats.gguf import dequantize
    >>> block = np.zeros(34, np.uint8); block[:2] = np.frombuffer(np.float16(2).tobytes(), np.uint8)
    >>> block[2:] = np.arange(32, dtype=np.int8).view(np.uint8)
    >>> dequantize(block, "Q8_0", (32,))[:4].tolist()
    [0.0, 2.0, 4.0, 6.0]
    """
    from ..jit.presets import run_parallel
    from .gguf_kernels import KERNELS, half_table

    name, block, tsize = _type(ggml_type)
    try:
        shape = tuple(operator.index(d) for d in shape)
    except TypeError:
        raise InvalidArgumentError(f"bad shape {quote(shape)}") from None
    if any(d < 0 for d in shape) or math.prod(max(d, 1) for d in shape) * 8 >= 2**63:
        raise InvalidArgumentError(f"bad shape {list(shape)}")
    is_torch = type(data).__module__.startswith("torch")
    if is_torch:
        import torch

        raw = data.detach().cpu().contiguous().view(-1).view(torch.uint8).numpy()
    elif isinstance(data, np.ndarray):
        raw = np.ascontiguousarray(data).reshape(-1).view(np.uint8)
    else:
        raw = np.frombuffer(data, np.uint8)
    numel = math.prod(shape)
    logical_ok = block == 1 or (bool(shape) and shape[-1] % block == 0 and numel // block * tsize == raw.size)
    if block > 1 and not logical_ok and shape and shape[-1] % tsize == 0 and numel == raw.size:
        # the block view's shape (rows..., bytes_per_row), as GGUF leaves are exposed
        shape = (*shape[:-1], shape[-1] // tsize * block)
        numel = math.prod(shape)
    if block > 1 and (not shape or shape[-1] % block):
        raise InvalidArgumentError(
            f"{name}: row length of shape {list(shape)} is not a multiple of the block size {block}"
        )
    need = numel // block * tsize
    if raw.size != need:
        raise InvalidArgumentError(
            f"{name}: shape {list(shape)} needs {need} bytes of blocks, got {raw.size}"
        )
    if name in _PLAIN and name not in ("F16", "BF16"):
        out = raw.view(np.dtype(_PLAIN[name]).newbyteorder("<")).reshape(shape)
    elif name in KERNELS:
        out = np.empty(numel, np.float32)
        target = out.view(np.uint32) if name == "BF16" else out
        if numel and not run_parallel(KERNELS[name][0], raw, half_table(), target, num_threads=num_threads):
            raise BadArchiveError(f"{name}: block buffer of {raw.size} bytes does not match {numel} elements")
        out = out.reshape(shape)
    else:
        try:
            from gguf import GGMLQuantizationType
            from gguf.quants import dequantize as gguf_dequantize
        except ImportError:
            raise UnsupportedError(f"dequantizing {name} needs the gguf package") from None
        try:
            out = gguf_dequantize(raw.reshape(-1, tsize), GGMLQuantizationType(_BY_NAME[name]))
        except NotImplementedError:
            raise UnsupportedError(
                f"dequantizing {name} is not supported (the gguf package has no decoder for it)"
            ) from None
        out = np.ascontiguousarray(out, dtype=np.float32).reshape(shape)
    if is_torch:
        import torch

        return torch.from_numpy(out)
    return out
