"""ONNX initializers as ``numpy_helper.from_array`` writes them, read with minimal Python per tensor.

Such a ``TensorProto`` holds only ``dims`` (field 1, one varint each), ``data_type`` (2), ``name``
(8) and ``raw_data`` (9). :func:`compact_tensor` reads one in a tight loop (no generator, no dict)
into ``(name, data_type, dims, raw_offset, raw_length)``, or returns None for anything else (a
typed field, external data, a string tensor, a negative or 65th dimension, a truncated varint):
the general field walker (:func:`~tdz_numba.formats.onnx_wire.tensor_proto`) then reads that
tensor. When every initializer of a model is compact, :func:`bulk_specs` checks them as columns
(names unique, each distinct shape once, ``raw_data`` sizes against ``numel * itemsize``) and
builds the specs in one pass; it returns None when a check fails, and the per-initializer path
names the error. :func:`compact_graph` with ``columns=True`` hands the initializers as
:class:`Columns` (what the compiled scan fills: no tuple per initializer), which
:func:`column_specs` checks the same way.

Examples
--------
>>> from tdz_numba.formats.onnx_bulk import compact_tensor
>>> pb = bytes([0x08, 2, 0x08, 3, 0x10, 1, 0x42, 1]) + b"w" + bytes([0x4A, 24]) + bytes(24)
>>> compact_tensor(memoryview(pb), 0, len(pb))
('w', 1, (2, 3), 11, 24)
"""

from __future__ import annotations

import math
from typing import Any, NamedTuple

import numpy as np

from ..jit.policy import use_kernels
from ..tdz.sources import TensorSpec
from ._flat import make_specs
from ._shape import MAX_NDIM, check_shape
from .onnx_wire import scan_varint

__all__ = [
    "Columns",
    "PROBE",
    "compact_tensor",
    "compact_graph",
    "bulk_specs",
    "column_specs",
    "torch_dtypes",
]

#: Initializers a graph's scan reads first (page by page) to learn how far apart they lie
#: (:class:`~tdz_numba.files.scanadvice.header_scan`).
PROBE = 16

_LIMIT = 1 << 63


class Columns(NamedTuple):
    """Compact initializers as columns: the fields of :func:`compact_tensor`'s tuples, in order.

    >>> c = Columns.of([("w", 1, (2, 3), 11, 24), ("b", 1, (3,), 40, 12)])
    >>> c.tuples()
    [('w', 1, (2, 3), 11, 24), ('b', 1, (3,), 40, 12)]
    """

    names: list[str]
    types: np.ndarray  # int64 ONNX data types (each < 2**63)
    shapes: list[tuple[int, ...]]
    offsets: np.ndarray  # int64 raw_data offsets
    lengths: np.ndarray  # int64 raw_data lengths
    distinct: set[tuple[int, ...]] | None  # the distinct shapes when known (else: set(shapes))

    @classmethod
    def of(cls, inits: list[tuple[str, int, tuple[int, ...], int, int]]) -> Columns:
        """The columns of :func:`compact_tensor` tuples."""
        if not inits:
            empty = np.zeros(0, np.int64)
            return cls([], empty, [], empty, empty, set())
        names, types, shapes, offsets, lengths = zip(*inits)
        as_array = lambda c: np.array(c, dtype=np.int64)  # noqa: E731 - every value < 2**63
        return cls(list(names), as_array(types), list(shapes), as_array(offsets), as_array(lengths), None)

    def tuples(self) -> list[tuple[str, int, tuple[int, ...], int, int]]:
        """The initializers as :func:`compact_tensor` tuples."""
        return list(
            zip(self.names, self.types.tolist(), self.shapes, self.offsets.tolist(), self.lengths.tolist())
        )


def compact_tensor(
    buf: memoryview, start: int, end: int
) -> tuple[str, int, tuple[int, ...], int, int] | None:
    """``(name, data_type, dims, raw_offset, raw_length)`` of the ``TensorProto`` in
    ``buf[start:end]``, or None when it has any other field (see the module docstring).
    Repeated ``data_type``/``name``/``raw_data`` fields: the last wins, as in protobuf."""
    pos = start
    dims: list[int] = []
    dtype = 0
    name = ""
    raw_at = raw_len = -1
    while pos < end:
        tag = buf[pos]
        pos += 1
        if tag == 0x08 or tag == 0x10:
            value, pos = scan_varint(buf, pos, end)
            if value < 0 or value >= _LIMIT:
                return None
            if tag == 0x10:
                dtype = value
            elif len(dims) < MAX_NDIM:
                dims.append(value)
            else:
                return None
        elif tag == 0x42 or tag == 0x4A:
            n, pos = scan_varint(buf, pos, end)
            if n < 0 or n > end - pos:
                return None
            if tag == 0x42:
                name = bytes(buf[pos : pos + n]).decode("utf-8", errors="replace")
            else:
                raw_at, raw_len = pos, n
            pos += n
        else:
            return None
    if raw_at < 0:
        return None
    return name, dtype, tuple(dims), raw_at, raw_len


def compact_graph(
    buf: memoryview, start: int, end: int, columns: bool = False, scan: Any = None
) -> tuple[Any, Any, Any, int] | None:
    """``(name span, doc_string span, compact initializers, field count)`` of the ``GraphProto`` in
    ``buf[start:end]`` (spans: ``(offset, length)`` or None), read in one tight loop; None when
    an initializer is not compact or a field is malformed (the general walker then reads it).
    The initializers: a list of :func:`compact_tensor` tuples, or with ``columns`` their
    :class:`Columns`. With the Numba kernels on, :func:`~tdz_numba.formats.onnx_scan.graph_columns`
    reads it (the same result, in one compiled pass). ``scan``: a
    :class:`~tdz_numba.files.scanadvice.header_scan` of ``buf``'s file, decided by the spacing of
    the first :data:`PROBE` initializers' data (fewer: left page by page)."""
    if use_kernels((end - start) >> 12):
        from .onnx_scan import graph_columns  # imports Numba

        got = graph_columns(buf, start, end, scan)
        if got is None or columns:
            return got
        return got[0], got[1], got[2].tuples(), got[3]
    probe = PROBE if scan is not None and scan.active else 0
    first = -1
    pos = start
    name = doc = None
    inits: list[Any] = []
    count = 0
    while pos < end:
        tag, pos = scan_varint(buf, pos, end)
        wire = tag & 7
        if tag < 8:  # truncated, or field number 0
            return None
        count += 1
        if wire == 2:
            n, pos = scan_varint(buf, pos, end)
            if n < 0 or n > end - pos:
                return None
            field = tag >> 3
            if field == 5:
                t = compact_tensor(buf, pos, pos + n)
                if t is None:
                    return None
                inits.append(t)
                if probe and t[3] >= 0:  # (t[3]: the raw_data offset)
                    if first < 0:
                        first = t[3]
                    elif len(inits) == probe:
                        scan.decide((t[3] - first) / (probe - 1))
                        probe = 0
            elif field == 2:
                name = (pos, n)
            elif field == 10:
                doc = (pos, n)
            pos += n
        elif wire == 0:
            value, pos = scan_varint(buf, pos, end)
            if value < 0:
                return None
        elif wire == 1 or wire == 5:
            pos += 8 if wire == 1 else 4
            if pos > end:
                return None
        else:
            return None
    return name, doc, Columns.of(inits) if columns else inits, count


def torch_dtypes(table: dict[int, tuple[str, str]]) -> dict[int, tuple[Any, str]]:
    """ONNX data type -> (torch dtype, ONNX name) from ``table`` (-> (torch name, ONNX name)),
    for the types this torch has."""
    import torch

    return {k: (getattr(torch, t), name) for k, (t, name) in table.items() if hasattr(torch, t)}


def bulk_specs(
    inits: list[tuple[str, int, tuple[int, ...], int, int]], dtypes: dict[int, tuple[Any, str]], size: int
) -> dict[str, TensorSpec] | None:
    """``{name: spec}`` of compact initializers (``dtypes``: ONNX data type -> (torch dtype, ONNX
    name)), every extent inside a file of ``size`` bytes; None when any check fails."""
    return column_specs(Columns.of(inits), dtypes, size)


def column_specs(
    cols: Columns, dtypes: dict[int, tuple[Any, str]], size: int
) -> dict[str, TensorSpec] | None:
    """:func:`bulk_specs` of initializers given as :class:`Columns`: names unique, data types
    known, each distinct shape checked once, ``raw_data`` lengths equal to ``numel * itemsize``
    and inside the file; None when any check fails (the per-initializer path names the error)."""
    names, types, shapes = cols.names, cols.types, cols.shapes
    n = len(names)
    if not n:
        return None
    first = int(types[0])
    listed = None if (types == first).all() else types.tolist()
    kinds = {first} if listed is None else set(listed)
    if not kinds <= dtypes.keys():
        return None
    numel_of: dict[tuple[int, ...], int] = {}
    for shape in set(shapes) if cols.distinct is None else cols.distinct:
        try:
            check_shape(shape, None, 16, "")
        except Exception:  # noqa: BLE001 - the per-initializer path raises it with the name
            return None
        numel_of[shape] = math.prod(shape)
    itemsize = {t: dtypes[t][0].itemsize for t in kinds}
    if len(kinds) == 1 and len(numel_of) == 1:  # one type, one shape: the columns repeat one value
        need = np.full(n, numel_of[shapes[0]] * itemsize[first], np.int64)
        torch_types, type_names = [dtypes[first][0]] * n, [dtypes[first][1]] * n
    else:
        listed = types.tolist() if listed is None else listed
        need = np.array([numel_of[s] * itemsize[t] for s, t in zip(shapes, listed)], dtype=np.int64)
        torch_types, type_names = [dtypes[t][0] for t in listed], [dtypes[t][1] for t in listed]
    off = cols.offsets
    if not np.array_equal(need, cols.lengths) or np.any(off > size - need) or np.any(off < 0):
        return None
    specs = make_specs(names, torch_types, shapes, 0, off.tolist(), need.tolist(), type_names)
    return specs if len(specs) == n else None  # (a name twice: one key)
