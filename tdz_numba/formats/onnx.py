"""ONNX models: initializers as flat leaves, read from the protobuf wire format of the mapped file.

The ``ModelProto`` is walked field by field in the mapped bytes (every varint,
length and nested message bounded by its parent), so nothing is copied at
open: each initializer's ``raw_data`` is a zero-copy view of the model file
when its offset is aligned for the dtype (a copy otherwise). Data in external
files (``external_data``: location, offset, length) are mapped zero-copy, each
file once; a location that leaves the model's directory (absolute, ``..``, a
symlink out) raises :class:`~tdz_numba.UnsafeContentError`. Initializers in
typed fields (``float_data``, ``int32_data``, ``int64_data``, ``double_data``,
``uint64_data``, packed or not) are decoded on read (copies), with
``onnx.numpy_helper``'s conventions (float16/bfloat16/float8 bit patterns in
``int32_data``); STRING initializers become nested lists of ``str`` of their
shape (a 0-dim one: the ``str``). 4-, 2- and 6-bit types and segmented
tensors are refused when read (:class:`~tdz_numba.UnsupportedError`); sparse
initializers and the initializers of subgraphs (If/Loop bodies) are not
listed. The onnx package is not needed to read.

A bare serialized ``TensorProto`` (the ``.pb`` files of ONNX's test data)
opens as one leaf keyed by its name (``"tensor"`` when unnamed); a
``SequenceProto``, ``MapProto`` or ``OptionalProto`` file is refused. Limits
(refused at open): more than :data:`~tdz_numba.formats._shape.MAX_NDIM` (64)
dimensions, more than :data:`MAX_INITIALIZERS` initializers, more than
:data:`MAX_ENTRIES` fields in the model and its graph.

``metadata``: ``ir_version``, ``producer_name``, ``producer_version``,
``domain``, ``model_version``, ``doc_string``, ``opset_import`` (domain ->
version, ``""`` for the default domain), ``graph_name``, ``graph_doc_string``,
``metadata_props`` (key -> value).

Examples
--------
>>> import tempfile, pathlib, numpy as np, onnx
>>> from onnx import helper, numpy_helper
>>> from tdz_numba.formats.onnx import open_onnx
>>> from tdz_numba.tdz.sources import tensor_from_spec
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

from ..errors import BadArchiveError, UnsafeContentError, UnsupportedError
from ..files.confine import MemberMissingError, map_inside
from ..files.scanadvice import header_scan
from ..tdz.sources import MappedFile, TensorSpec, TreeSource, check_extent, stand_in_external
from ._common import as_tensor, no_gc, quote
from ._flat import flat_source
from ._shape import MAX_NDIM, check_shape
from .onnx_bulk import Columns, bulk_specs, column_specs, compact_graph, compact_tensor, torch_dtypes
from .onnx_wire import WireError, fields, pairs, signed, tensor_proto, text, varint

__all__ = ["ONNX_DTYPES", "detect_onnx", "open_onnx", "parse_model", "parse_tensor", "MAX_INITIALIZERS"]

#: ONNX TensorProto.DataType -> (torch dtype name, ONNX name)
ONNX_DTYPES: dict[int, tuple[str, str]] = {
    1: ("float32", "FLOAT"),
    2: ("uint8", "UINT8"),
    3: ("int8", "INT8"),
    4: ("uint16", "UINT16"),
    5: ("int16", "INT16"),
    6: ("int32", "INT32"),
    7: ("int64", "INT64"),
    9: ("bool", "BOOL"),
    10: ("float16", "FLOAT16"),
    11: ("float64", "DOUBLE"),
    12: ("uint32", "UINT32"),
    13: ("uint64", "UINT64"),
    14: ("complex64", "COMPLEX64"),
    15: ("complex128", "COMPLEX128"),
    16: ("bfloat16", "BFLOAT16"),
    17: ("float8_e4m3fn", "FLOAT8E4M3FN"),
    18: ("float8_e4m3fnuz", "FLOAT8E4M3FNUZ"),
    19: ("float8_e5m2", "FLOAT8E5M2"),
    20: ("float8_e5m2fnuz", "FLOAT8E5M2FNUZ"),
    24: ("float8_e8m0fnu", "FLOAT8E8M0"),
}
_PACKED_BITS = {
    21: "UINT4",
    22: "INT4",
    23: "FLOAT4E2M1",
    25: "UINT2",
    26: "INT2",
    27: "FLOAT6E2M3",
    28: "FLOAT6E3M2",
}
_STRING = 8
# typed field number -> (wire element: "f4"/"f8" fixed, "v" varint), by data type
_TYPED_FIELD = {
    1: 4,
    14: 4,
    6: 5,
    5: 5,
    3: 5,
    4: 5,
    2: 5,
    9: 5,
    10: 5,
    16: 5,
    17: 5,
    18: 5,
    19: 5,
    20: 5,
    24: 5,
    7: 7,
    11: 10,
    15: 10,
    12: 11,
    13: 11,
}
# ModelProto fields that may come first (tag bytes): ir_version, producer_name/version, domain,
# model_version, doc_string, graph, opset_import, metadata_props, training_info, functions
_MODEL_TAGS = {0x08, 0x12, 0x1A, 0x22, 0x28, 0x32, 0x3A, 0x42, 0x72, 0x7A, 0x82}
#: Most fields (nodes, inputs, opset entries, metadata props, ...) read in a model and its graph.
MAX_ENTRIES = 2_000_000
#: Most initializers listed (a model of more is refused as soon as the count passes it).
MAX_INITIALIZERS = 250_000


def parse_model(
    buf: memoryview, where: str = "<onnx>", *, compact: bool = False
) -> tuple[dict[str, Any], list[Any]]:
    """``(metadata, initializers)`` of a serialized ModelProto (see the module docstring).

    With ``compact``, an initializer as ``numpy_helper.from_array`` writes it is a tuple of
    :func:`~tdz_numba.formats.onnx_bulk.compact_tensor` instead of a dict."""
    info, inits, cols = _parse_model(buf, where, compact)
    return info, inits if cols is None else cols.tuples() + inits


def _parse_model(
    buf: memoryview, where: str, compact: bool, scan: header_scan | None = None
) -> tuple[dict[str, Any], list[Any], Columns | None]:
    """:func:`parse_model`, a graph whose initializers are all compact handed as its
    :class:`~tdz_numba.formats.onnx_bulk.Columns` (the third item; then no initializer in the list).
    ``scan``: the open's :class:`~tdz_numba.files.scanadvice.header_scan` of ``buf``'s file."""
    info: dict[str, Any] = {
        "ir_version": 0,
        "producer_name": "",
        "producer_version": "",
        "domain": "",
        "model_version": 0,
        "doc_string": "",
        "opset_import": {},
        "graph_name": "",
        "graph_doc_string": "",
        "metadata_props": {},
    }
    inits: list[Any] = []  # dicts (compact: also compact_tensor tuples)
    cols: Columns | None = None  # a compact graph's initializers
    graphs = entries = 0
    try:
        for f, w, v in fields(buf, 0, len(buf)):
            entries += 1
            if entries > MAX_ENTRIES:
                raise UnsupportedError(f"{where}: more than {MAX_ENTRIES:,} fields in the model")
            if w == 0 and f in (1, 5):
                info["ir_version" if f == 1 else "model_version"] = signed(v)
            elif w == 2 and f in (2, 3, 4, 6):
                info[{2: "producer_name", 3: "producer_version", 4: "domain", 6: "doc_string"}[f]] = text(
                    buf, v
                )
            elif w == 2 and f == 8:
                domain, version = "", 0
                for f2, w2, v2 in fields(buf, v[0], v[0] + v[1]):
                    if f2 == 1 and w2 == 2:
                        domain = text(buf, v2)
                    elif f2 == 2 and w2 == 0:
                        version = signed(v2)
                info["opset_import"][domain] = version
            elif w == 2 and f == 14:
                key, value = pairs(buf, v)
                info["metadata_props"][key] = value
            elif w == 2 and f == 7:
                graphs += 1
                g = compact_graph(buf, v[0], v[0] + v[1], True, scan) if compact else None
                if (
                    g is not None
                    and entries + g[3] <= MAX_ENTRIES
                    and len(inits) + len(g[2].names) <= MAX_INITIALIZERS
                    and cols is None
                    and not inits
                ):
                    entries += g[3]
                    for span, field in ((g[0], "graph_name"), (g[1], "graph_doc_string")):
                        if span is not None:
                            info[field] = text(buf, span)
                    cols = g[2]  # (a second graph is refused below)
                    continue
                if scan is not None and g is None:
                    scan.decide(0.0)  # (the initializers' spacing unknown: the kernel's default)
                for f2, w2, v2 in fields(buf, v[0], v[0] + v[1]):
                    entries += 1
                    if entries > MAX_ENTRIES:
                        raise UnsupportedError(f"{where}: more than {MAX_ENTRIES:,} fields in the graph")
                    if w2 != 2:
                        continue
                    if f2 == 2:
                        info["graph_name"] = text(buf, v2)
                    elif f2 == 10:
                        info["graph_doc_string"] = text(buf, v2)
                    elif f2 == 5:
                        if len(inits) >= MAX_INITIALIZERS:
                            raise UnsupportedError(
                                f"{where}: more than {MAX_INITIALIZERS:,} initializers (the reader's limit)"
                            )
                        t = compact_tensor(buf, v2[0], v2[0] + v2[1]) if compact else None
                        inits.append(t if t is not None else tensor_proto(buf, v2[0], v2[0] + v2[1]))
    except WireError as e:
        raise BadArchiveError(f"{where}: not a valid ONNX model: {e}") from None
    if graphs > 1:
        raise UnsupportedError(f"{where}: {graphs} graph fields (a merged ModelProto) are not supported")
    if not graphs and not info["ir_version"]:
        raise BadArchiveError(f"{where}: not an ONNX model (no graph, no ir_version)")
    return info, inits, cols


def _is_bare_tensor(buf: memoryview) -> bool:
    """Whether the file is a serialized ``TensorProto`` (field 2 a varint: ``data_type``;
    in a ``ModelProto`` field 2 is ``producer_name``, a string), as ONNX's test data are."""
    try:
        return any(f == 2 and w == 0 for f, w, _ in fields(buf, 0, len(buf)))
    except WireError:
        return False


def parse_tensor(buf: memoryview, where: str = "<onnx>") -> dict[str, Any]:
    """The initializer dict of a bare serialized ``TensorProto`` (a ``.pb`` file)."""
    try:
        t = tensor_proto(buf, 0, len(buf))
    except WireError as e:
        raise BadArchiveError(f"{where}: not a valid ONNX TensorProto: {e}") from None
    if t["segment"]:  # field 3: a segment, or the values of a Sequence/Map/OptionalProto
        raise UnsupportedError(
            f"{where}: a segmented TensorProto (or a SequenceProto, MapProto or OptionalProto) is not read"
        )
    t["name"] = t["name"] or "tensor"
    return t


def detect_onnx(head: bytes, path: str | os.PathLike | None = None) -> bool:
    """A cheap check that a file starts like a serialized ``onnx.ModelProto``.

    ONNX writers emit ``ir_version`` (field 1) first: the tag byte ``0x08``,
    a small version, then another ModelProto field.

    >>> detect_onnx(bytes([0x08, 0x09, 0x12, 0x04]) + b"test")
    True
    """
    head = bytes(head)
    if str(path or "").endswith(".pb") and len(head) >= 2:  # a bare TensorProto: dims or data_type first
        if head[0] in (0x08, 0x0A) or (head[0] == 0x10 and 1 <= head[1] <= 28):
            return True
    if len(head) < 3 or head[0] != 0x08 or not 1 <= head[1] <= 64:
        return False
    return head[2] in _MODEL_TAGS


def _refused(key: str, why: str):
    def load() -> None:
        raise UnsupportedError(f"initializer {quote(key)}: {why}")

    return load


def _typed_loader(buf: memoryview, t: dict[str, Any], dtype: Any, where: str):
    """Decodes the typed field of a tensor (copies), as onnx.numpy_helper.to_array does."""
    dt, shape, field = t["data_type"], tuple(t["dims"]), _TYPED_FIELD.get(t["data_type"])
    parts = t["typed"].get(field, []) if field is not None else []

    def load() -> Any:
        numel = math.prod(shape)
        values: list[Any] = []
        chunks: list[np.ndarray] = []
        fixed = "<f4" if field == 4 else "<f8" if field == 10 else None
        for w, v in parts:
            if fixed is not None:
                if w == 2:
                    if v[1] % np.dtype(fixed).itemsize:
                        raise BadArchiveError(
                            f"{where}: initializer {quote(t['name'])}: packed field of {v[1]} bytes"
                        )
                    chunks.append(np.frombuffer(buf[v[0] : v[0] + v[1]], fixed))
                elif w == (5 if field == 4 else 1):
                    chunks.append(np.frombuffer(buf[v : v + np.dtype(fixed).itemsize], fixed))
            elif w == 2:
                pos, stop = v
                stop += pos
                while pos < stop:
                    x, pos = varint(buf, pos, stop)
                    values.append(x)
                    if len(values) > numel * 2 + 16:
                        raise BadArchiveError(f"{where}: initializer {quote(t['name'])}: too many values")
            elif w == 0:
                values.append(v)
        if fixed is not None:
            flat = np.concatenate(chunks) if chunks else np.zeros(0, fixed)
        else:
            flat = np.array(values, dtype=np.uint64) if values else np.zeros(0, np.uint64)
        want = numel * (2 if dt in (14, 15) else 1)
        if flat.size != want:
            raise BadArchiveError(
                f"{where}: initializer {quote(t['name'])}: {flat.size} values for shape {list(shape)}"
            )
        np_name = {
            1: "<f4",
            14: "<f4",
            11: "<f8",
            15: "<f8",
            7: "<i8",
            13: "<u8",
            12: "<u4",
            6: "<i4",
            5: "<i2",
            3: "i1",
            4: "<u2",
            2: "u1",
            9: "u1",
            10: "<u2",
            16: "<u2",
        }.get(dt, "u1")
        if fixed is None:  # varints: int32/int64 are two's complement in 64 bits, then narrowed
            flat = flat.astype(np.int64 if dt in (3, 5, 6, 7) else np.uint64).astype(np_name)
        out = flat.astype(fixed, copy=False) if fixed else flat
        if dt in (14, 15):
            out = np.ascontiguousarray(out).view(np.complex64 if dt == 14 else np.complex128)
        else:
            out = (
                np.ascontiguousarray(out).view(f"u{dtype.itemsize}")
                if dtype.itemsize > 1
                else out.view(np.uint8)
            )
        return as_tensor(out.reshape(shape))

    return load


def _external(t: dict[str, Any], model_dir: Path, where: str) -> tuple[str, int, int | None]:
    info = dict(t["external"])
    key, location = t["name"], info.get("location", "")
    if not location:
        raise BadArchiveError(f"{where}: initializer {quote(key)}: external data without a location")
    rel = Path(location)
    if not rel.parts:
        raise BadArchiveError(
            f"{where}: initializer {quote(key)}: external data location {quote(location)} names no file"
        )
    if rel.is_absolute() or ".." in rel.parts or location.startswith(("/", "\\")) or ":" in rel.parts[0]:
        raise UnsafeContentError(
            f"{where}: initializer {quote(key)}: external data location {quote(location)} "
            f"is outside the model's directory"
        )
    full = (model_dir / rel).resolve()
    if not full.is_relative_to(model_dir.resolve()):
        raise UnsafeContentError(
            f"{where}: initializer {quote(key)}: external data location {quote(location)} "
            f"resolves outside the model's directory"
        )
    try:
        offset = int(info.get("offset", "0"))
        length = int(info["length"]) if "length" in info else None
    except ValueError:
        raise BadArchiveError(
            f"{where}: initializer {quote(key)}: bad external offset/length {quote(info)}"
        ) from None
    if offset < 0 or (length is not None and length < 0):
        raise BadArchiveError(f"{where}: initializer {quote(key)}: negative external offset/length")
    return str(full), offset, length


def open_onnx(path: str | os.PathLike, **kw: Any) -> TreeSource:
    """Opens an ONNX model: its main graph's initializers as flat leaves, keyed by name.

    Raises :class:`~tdz_numba.BadArchiveError` for malformed protobuf or
    inconsistent initializers, :class:`~tdz_numba.UnsafeContentError` for
    external data outside the model's directory.
    """

    where = str(path)
    model_dir = Path(path).parent
    files = [MappedFile.open(path)]
    try:
        with no_gc():  # a model of millions of initializers: several times faster
            src = _open(path, where, model_dir, files)
    except BaseException:
        for f in files:
            f.close()
        raise
    return src


def _open(path: str | os.PathLike, where: str, model_dir: Path, files: list[MappedFile]) -> TreeSource:
    import torch

    buf = memoryview(files[0].buffer.data)
    with header_scan(files[0]) as scan:  # (initializers far apart: only their headers' pages read)
        bare = _is_bare_tensor(buf)
        if not bare:
            metadata, inits, cols = _parse_model(buf, where, True, scan)
    if bare:
        metadata = {}
        inits = [parse_tensor(buf, where)]
    else:
        kinds = set(map(type, inits)) | ({tuple} if cols is not None and cols.names else set())
        if kinds == {tuple}:
            dtypes = torch_dtypes(ONNX_DTYPES)
            specs = (
                bulk_specs(inits, dtypes, files[0].size)
                if cols is None
                else column_specs(cols, dtypes, files[0].size)
            )
            if specs is not None:
                return flat_source("onnx", path, specs, files=files, metadata=metadata)
        if tuple in kinds:  # the per-initializer path reads every one
            metadata, inits = parse_model(buf, where)
    by_location: dict[str, int] = {}
    tree: dict[str, Any] = {}
    for t in inits:
        key = t["name"]
        if key in tree:
            raise BadArchiveError(f"{where}: duplicate initializer name {quote(key)}")
        shape = tuple(t["dims"])
        what = f"{where}: initializer {quote(key)}"
        if t["ndim"] > MAX_NDIM:
            raise BadArchiveError(f"{what}: {t['ndim']} dimensions (at most {MAX_NDIM})")
        if any(d < 0 for d in shape):
            raise BadArchiveError(f"{what}: negative dimension in {list(shape)}")
        check_shape(shape, None, 16, what)
        numel = math.prod(shape)
        dt = t["data_type"]
        if dt == _STRING:
            if len(t["strings"]) != numel:
                raise BadArchiveError(f"{what}: {len(t['strings'])} strings for shape {list(shape)}")
            # nested lists of the tensor's shape (numpy_helper's array .tolist()); 0-dim: the str
            strings = np.empty(numel, object)
            strings[:] = [text(buf, s) for s in t["strings"]]
            tree[key] = strings.reshape(shape).tolist()
            continue
        if dt not in ONNX_DTYPES:
            name = _PACKED_BITS.get(dt, f"data type {dt}")
            tree[key] = TensorSpec(
                key,
                torch.uint8,
                shape,
                None,
                0,
                0,
                0,
                name,
                loader=_refused(key, f"{name} elements are not supported"),
            )
            continue
        dtype = getattr(torch, ONNX_DTYPES[dt][0])
        type_name = ONNX_DTYPES[dt][1]
        nbytes = numel * dtype.itemsize
        if t["segment"]:
            spec = TensorSpec(
                key,
                dtype,
                shape,
                None,
                0,
                0,
                0,
                type_name,
                loader=_refused(key, "segmented tensors are not supported"),
            )
        elif t["location"] == 1:  # EXTERNAL
            full, offset, length = _external(t, model_dir, where)
            if length is not None and length != nbytes:
                raise BadArchiveError(
                    f"{where}: initializer {quote(key)}: external length {length}, "
                    f"shape {list(shape)} needs {nbytes}"
                )
            if full not in by_location:
                mf = stand_in_external(dict(t["external"])["location"])  # a remote model's neighbour
                if mf is None:
                    try:  # inside the model's folder, a regular file, no symlink leading out
                        mm, size = map_inside(
                            model_dir,
                            dict(t["external"])["location"],
                            where=where,
                            entry=f"initializer {quote(key)}",
                        )
                    except MemberMissingError:
                        raise BadArchiveError(
                            f"{where}: initializer {quote(key)}: external file {quote(full, 200)} is missing"
                        ) from None
                    mf = MappedFile(Path(full), mm, size, False)
                by_location[full] = len(files)
                files.append(mf)
            spec = TensorSpec(key, dtype, shape, None, by_location[full], offset, nbytes, type_name)
            check_extent(spec, files[by_location[full]].size, full)
        elif t["raw"] is not None:
            off, n = t["raw"]
            if n != nbytes:
                raise BadArchiveError(
                    f"{where}: initializer {quote(key)}: raw_data holds {n} bytes, "
                    f"shape {list(shape)} of {type_name} needs {nbytes}"
                )
            spec = TensorSpec(key, dtype, shape, None, 0, off, nbytes, type_name)
            check_extent(spec, files[0].size, where)
        else:
            spec = TensorSpec(
                key, dtype, shape, None, 0, 0, 0, type_name, loader=_typed_loader(buf, t, dtype, where)
            )
        tree[key] = spec
    return TreeSource("onnx", path, tree, files=files, metadata=metadata)
