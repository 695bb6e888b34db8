"""ONNX models through the onnx package (optional): initializers as flat leaves.

The model is parsed by ``onnx.load(path, load_external_data=False)``; a small
walk of the protobuf wire format of the same mapped bytes finds where each
initializer's ``raw_data`` lies in the file (verified byte for byte), so those
leaves are zero-copy views when their offset is aligned for the dtype (copies
otherwise). Data in external files (``external_data``: location, offset,
length) are mapped zero-copy, each file once; a location that leaves the
model's directory (absolute, ``..``, a symlink out) raises
:class:`~tdz_numba.UnsafeContentError`. Initializers stored in typed fields
(``float_data``, ``int32_data``, ...) are decoded by ``onnx.numpy_helper`` on
read (copies); STRING initializers become lists of ``str``. 4-bit and 2/6-bit
types are refused when read (:class:`~tdz_numba.UnsupportedError`).

``metadata``: ``ir_version``, ``producer_name``, ``producer_version``,
``domain``, ``model_version``, ``doc_string``, ``opset_import`` (domain ->
version, ``""`` for the default domain), ``graph_name``, ``graph_doc_string``,
``metadata_props`` (key -> value).

Examples
--------
>>> import tempfile, pathlib, numpy as np, onnx
>>> from onnx import helper, numpy_helper
>>> from tdz_numba.formats.onnx import open_onnx
>>> from tdz_numba.sources import tensor_from_spec
>>> w = numpy_helper.from_array(np.arange(6, dtype=np.float32).reshape(2, 3), "w")
>>> g = helper.make_graph([], "g", [], [helper.make_tensor_value_info("w", onnx.TensorProto.FLOAT, [2, 3])], [w])
>>> with tempfile.TemporaryDirectory() as d:
...     p = pathlib.Path(d) / "m.onnx"
...     onnx.save(helper.make_model(g), p)
...     src = open_onnx(p)
...     print(tensor_from_spec(src.level("").children["w"].leaf, src.files).tolist(), src.metadata["graph_name"])
[[0.0, 1.0, 2.0], [3.0, 4.0, 5.0]] g
"""

from __future__ import annotations

import math
import os
from pathlib import Path
from typing import Any

import numpy as np

from ..errors import BadArchiveError, TdzError, UnsafeContentError, UnsupportedError
from ..sources import MappedFile, TensorSpec, TreeSource, check_extent

__all__ = ["ONNX_DTYPES", "detect_onnx", "open_onnx", "raw_data_offsets"]

#: ONNX TensorProto.DataType -> torch dtype name
ONNX_DTYPES: dict[int, str] = {
    1: "float32", 2: "uint8", 3: "int8", 4: "uint16", 5: "int16", 6: "int32", 7: "int64", 9: "bool",
    10: "float16", 11: "float64", 12: "uint32", 13: "uint64", 14: "complex64", 15: "complex128",
    16: "bfloat16", 17: "float8_e4m3fn", 18: "float8_e4m3fnuz", 19: "float8_e5m2", 20: "float8_e5m2fnuz",
    24: "float8_e8m0fnu",
}  # fmt: skip
_PACKED = {21: "UINT4", 22: "INT4", 23: "FLOAT4E2M1", 25: "UINT2", 26: "INT2", 27: "FLOAT6E2M3", 28: "FLOAT6E3M2"}
_STRING = 8
# ModelProto fields that may come first (tag bytes): ir_version, producer_name/version, domain,
# model_version, doc_string, graph, opset_import, metadata_props, training_info, functions, configuration
_MODEL_TAGS = {0x08, 0x12, 0x1A, 0x22, 0x28, 0x32, 0x3A, 0x42, 0x72, 0x7A, 0x82}


def _varint(buf: memoryview, pos: int, end: int) -> tuple[int, int]:
    value = shift = 0
    for _ in range(10):
        if pos >= end:
            raise BadArchiveError(f"truncated varint at offset {pos}")
        b = buf[pos]
        pos += 1
        value |= (b & 0x7F) << shift
        if b < 0x80:
            return value, pos
        shift += 7
    raise BadArchiveError(f"varint longer than 10 bytes at offset {pos}")


def _fields(buf: memoryview, start: int, end: int):
    """(field number, wire type, value or (offset, length)) of one message's fields."""
    pos = start
    while pos < end:
        tag, pos = _varint(buf, pos, end)
        field, wire = tag >> 3, tag & 7
        if wire == 0:
            value, pos = _varint(buf, pos, end)
            yield field, wire, value
        elif wire == 2:
            n, pos = _varint(buf, pos, end)
            if pos + n > end:
                raise BadArchiveError(f"field {field} at offset {pos}: length {n} runs past its message")
            yield field, wire, (pos, n)
            pos += n
        elif wire in (1, 5):
            pos += 8 if wire == 1 else 4
            if pos > end:
                raise BadArchiveError(f"field {field}: truncated fixed-size value")
            yield field, wire, None
        else:
            raise BadArchiveError(f"field {field}: unsupported wire type {wire} at offset {pos}")


def raw_data_offsets(buf: memoryview) -> list[tuple[int, int] | None] | None:
    """``(offset, length)`` of each main-graph initializer's ``raw_data`` in wire order (None: none),
    or None when the layout is not the plain one (the caller then copies)."""
    size = len(buf)
    graphs = [v for f, w, v in _fields(buf, 0, size) if f == 7 and w == 2]
    if len(graphs) != 1:
        return None
    g_off, g_len = graphs[0]
    out: list[tuple[int, int] | None] = []
    for f, w, v in _fields(buf, g_off, g_off + g_len):
        if f == 5 and w == 2:
            t_off, t_len = v
            raw = None
            for tf, tw, tv in _fields(buf, t_off, t_off + t_len):
                if tf == 9 and tw == 2:
                    raw = tv  # the last occurrence wins, as in protobuf
            out.append(raw)
    return out


def detect_onnx(head: bytes, path: str | os.PathLike | None = None) -> bool:
    """A cheap check that a file starts like a serialized ``onnx.ModelProto``.

    ONNX writers emit ``ir_version`` (field 1) first: the tag byte ``0x08``,
    a small version, then another ModelProto field.

    >>> detect_onnx(bytes([0x08, 0x09, 0x12, 0x04]) + b"test")
    True
    """
    head = bytes(head)
    if len(head) < 3 or head[0] != 0x08 or not 1 <= head[1] <= 64:
        return False
    return head[2] in _MODEL_TAGS


def _model_info(model: Any) -> dict[str, Any]:
    g = model.graph
    return {
        "ir_version": int(model.ir_version),
        "producer_name": model.producer_name,
        "producer_version": model.producer_version,
        "domain": model.domain,
        "model_version": int(model.model_version),
        "doc_string": model.doc_string,
        "opset_import": {o.domain: int(o.version) for o in model.opset_import},
        "graph_name": g.name,
        "graph_doc_string": g.doc_string,
        "metadata_props": {p.key: p.value for p in model.metadata_props},
    }


def _refused(key: str, why: str):
    def load() -> None:
        raise UnsupportedError(f"initializer {key!r}: {why}")

    return load


def _typed_loader(tensor: Any, dtype: Any, where: str):
    def load() -> np.ndarray:
        from onnx import numpy_helper

        try:
            arr = numpy_helper.to_array(tensor)
        except TdzError:
            raise
        except Exception as e:  # noqa: BLE001 - onnx raises ValueError/TypeError/... on bad fields
            raise BadArchiveError(f"{where}: initializer {tensor.name!r}: {e}") from None
        arr = np.ascontiguousarray(arr)
        if arr.dtype.kind not in "biufc" or arr.dtype.itemsize != dtype.itemsize or arr.dtype.name in (
            "bfloat16",) or arr.dtype.name.startswith("float8"):  # fmt: skip
            arr = arr.view(f"u{dtype.itemsize}") if dtype.itemsize > 1 else arr.view(np.uint8)
        return arr

    return load


def _external(tensor: Any, model_dir: Path, where: str) -> tuple[str, int, int | None]:
    info = {e.key: e.value for e in tensor.external_data}
    location = info.get("location", "")
    if not location:
        raise BadArchiveError(f"{where}: initializer {tensor.name!r}: external data without a location")
    rel = Path(location)
    if rel.is_absolute() or ".." in rel.parts or location.startswith(("/", "\\")) or ":" in rel.parts[0]:
        raise UnsafeContentError(f"{where}: initializer {tensor.name!r}: external data location {location!r} "
                                 f"is outside the model's directory")  # fmt: skip
    full = (model_dir / rel).resolve()
    if not full.is_relative_to(model_dir.resolve()):
        raise UnsafeContentError(f"{where}: initializer {tensor.name!r}: external data location {location!r} "
                                 f"resolves outside the model's directory")  # fmt: skip
    try:
        offset = int(info.get("offset", "0"))
        length = int(info["length"]) if "length" in info else None
    except ValueError:
        raise BadArchiveError(f"{where}: initializer {tensor.name!r}: bad external offset/length {info}") from None
    if offset < 0 or (length is not None and length < 0):
        raise BadArchiveError(f"{where}: initializer {tensor.name!r}: negative external offset/length")
    return str(full), offset, length


def open_onnx(path: str | os.PathLike, **kw: Any) -> TreeSource:
    """Opens an ONNX model (needs the onnx package): its initializers as flat leaves.

    Raises :class:`~tdz_numba.UnsupportedError` when onnx is missing,
    :class:`~tdz_numba.BadArchiveError` for files onnx cannot parse or
    inconsistent initializers, :class:`~tdz_numba.UnsafeContentError` for
    external data outside the model's directory.
    """
    try:
        import onnx
    except ImportError:
        raise UnsupportedError(f"{path}: reading ONNX models needs onnx (pip install 'tdz_numba[onnx]')") from None
    import torch

    where = str(path)
    model_dir = Path(path).parent
    files = [MappedFile.open(path)]
    try:
        try:
            model = onnx.load(str(path), load_external_data=False)
        except Exception as e:  # noqa: BLE001 - DecodeError, RuntimeError, ...
            raise BadArchiveError(f"{where}: not a readable ONNX model: {e}") from None
        if not model.HasField("graph") and not model.ir_version:
            raise BadArchiveError(f"{where}: not an ONNX model (no graph, no ir_version)")
        buf = memoryview(files[0].buffer)
        inits = list(model.graph.initializer)
        try:
            offsets = raw_data_offsets(buf)
        except BadArchiveError:
            offsets = None
        if offsets is not None and len(offsets) != len(inits):
            offsets = None
        by_location: dict[str, int] = {}
        tree: dict[str, Any] = {}
        for i, t in enumerate(inits):
            key = t.name
            if key in tree:
                raise BadArchiveError(f"{where}: duplicate initializer name {key!r}")
            if any(d < 0 for d in t.dims):
                raise BadArchiveError(f"{where}: initializer {key!r}: negative dimension in {list(t.dims)}")
            shape = tuple(int(d) for d in t.dims)
            numel = math.prod(shape)
            if t.data_type == _STRING:
                if len(t.string_data) != numel:
                    raise BadArchiveError(f"{where}: initializer {key!r}: {len(t.string_data)} strings for "
                                          f"shape {list(shape)}")  # fmt: skip
                tree[key] = [s.decode("utf-8", errors="replace") for s in t.string_data]
                continue
            if t.data_type in _PACKED or t.data_type not in ONNX_DTYPES:
                name = _PACKED.get(t.data_type, f"data type {t.data_type}")
                tree[key] = TensorSpec(key, torch.uint8, shape, None, 0, 0, 0, name,
                                       loader=_refused(key, f"{name} elements are not supported"))  # fmt: skip
                continue
            dtype = getattr(torch, ONNX_DTYPES[t.data_type])
            type_name = onnx.TensorProto.DataType.Name(t.data_type)
            nbytes = numel * dtype.itemsize
            if t.data_location == onnx.TensorProto.EXTERNAL:
                full, offset, length = _external(t, model_dir, where)
                if length is not None and length != nbytes:
                    raise BadArchiveError(f"{where}: initializer {key!r}: external length {length}, "
                                          f"shape {list(shape)} needs {nbytes}")  # fmt: skip
                if full not in by_location:
                    try:
                        by_location[full] = len(files)
                        files.append(MappedFile.open(full))
                    except FileNotFoundError:
                        raise BadArchiveError(f"{where}: initializer {key!r}: external file {full} is missing") from None
                spec = TensorSpec(key, dtype, shape, None, by_location[full], offset, nbytes, type_name)
                check_extent(spec, files[by_location[full]].size, full)
            elif t.HasField("raw_data"):
                if len(t.raw_data) != nbytes:
                    raise BadArchiveError(f"{where}: initializer {key!r}: raw_data holds {len(t.raw_data)} bytes, "
                                          f"shape {list(shape)} of {type_name} needs {nbytes}")  # fmt: skip
                loc = offsets[i] if offsets is not None else None
                if loc is not None and loc[1] == nbytes and buf[loc[0] : loc[0] + loc[1]] == t.raw_data:
                    spec = TensorSpec(key, dtype, shape, None, 0, loc[0], nbytes, type_name)
                    check_extent(spec, files[0].size, where)
                else:  # not found where expected: a copy of the parsed bytes
                    raw = bytes(t.raw_data)
                    spec = TensorSpec(key, dtype, shape, None, 0, 0, 0, type_name,
                                      loader=lambda raw=raw, dt=dtype, s=shape: np.frombuffer(
                                          raw, f"u{dt.itemsize}").reshape(s).copy())  # fmt: skip
            else:
                spec = TensorSpec(key, dtype, shape, None, 0, 0, 0, type_name, loader=_typed_loader(t, dtype, where))
            tree[key] = spec
        metadata = _model_info(model)
        src = TreeSource("onnx", path, tree, files=files, metadata=metadata)
    except BaseException:
        for f in files:
            f.close()
        raise
    return src
