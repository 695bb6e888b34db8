"""Trees and meta.json: what a level of an archive holds, in both directions.

Writing, :func:`flatten` turns a nested mapping (of torch tensors, numpy
arrays, plain Python values and sub-mappings) into the archive's entry list in
tensordict's order, with every ``meta.json`` serialized as tensordict 0.15.3
writes it. Reading, :func:`describe_level` turns one ``meta.json`` plus the
names under its directory into a list of children, without touching payloads.

Levels read from an archive come back as :class:`Level` objects: dicts that
also keep the level's metadata (batch size, dim names, class name, stack
dimension, ...), so that writing a loaded tree again loses nothing. No class
named in a file is ever imported.

Examples
--------
>>> from tdz_numba.tdz.tree import encode_key, decode_key
>>> encode_key("odd/key name%")
'odd%2Fkey%20name%25'
>>> decode_key("odd%2Fkey%20name%25")
'odd/key name%'
"""

from __future__ import annotations

import json
import pickle
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any, NamedTuple

import numpy as np
import torch

from ..errors import BadArchiveError, InvalidTreeError, UnsafeContentError
from ..zipfmt.entry import Entry
from .bounds import check_shape, shape_nbytes
from .dtypes import dtype_table, from_numpy_dtype
from .keys import decode_key, encode_key
from .sources import Child

__all__ = [
    "Level",
    "RawFile",
    "PickledData",
    "LeafSpec",
    "encode_key",
    "decode_key",
    "flatten",
    "describe_level",
    "as_tensor",
    "TD_TYPE",
]

TD_TYPE = "<class 'tensordict._td.TensorDict'>"
TD_CLASS = "tensordict:TensorDict"
NON_TENSOR_DATA_TYPE = "<class 'tensordict.tensorclass.NonTensorData'>"
NON_TENSOR_STACK_TYPE = "<class 'tensordict.tensorclass.NonTensorStack'>"
LAZY_STACK_TYPE = "<class 'tensordict._lazy.LazyStackedTensorDict'>"
FORMAT_VERSION = 1
#: meta.json fields of a TensorDict level that are not keys.
RESERVED_FIELDS = ("shape", "device", "_type", "_format_version", "_class", "_names")
#: Files that hold non-tensor data next to a meta.json.
AUX_FILES = ("other.pickle", "pickle.pkl", "json_types.json")


# ---------------------------------------------------------------------------
# Tree node types
# ---------------------------------------------------------------------------
class Level(dict):
    """A level of an archive: a dict of its children plus its ``meta.json`` fields.

    ``meta`` holds the level's own fields (batch ``shape``, ``device``,
    ``_type``, ``_class``, ``_names``, ``stack_dim``, ``data``, ...), in file
    order. ``keyed`` levels (TensorDicts) list their children in meta.json;
    other levels (lazy stacks, tensorclasses, non-tensor data) hold
    sub-directories and files (``0``, ``1``, ``_tensordict``, ``other.pickle``).

    Examples
    --------
    >>> import torch
    >>> from tdz_numba.tdz.tree import Level
    >>> lvl = Level({"x": torch.zeros(2)}, meta={"shape": [2], "_names": ["t"]})
    >>> lvl.type_name, lvl.batch_size, lvl.names
    ('TensorDict', [2], ['t'])
    """

    def __init__(
        self, *args: Any, meta: Mapping[str, Any] | None = None, keyed: bool = True, **kwargs: Any
    ) -> None:
        super().__init__(*args, **kwargs)
        self.meta: dict[str, Any] = dict(meta or {})
        self.keyed = keyed

    @property
    def type_name(self) -> str:
        """The class name recorded for this level (``"TensorDict"``, ``"MyTC"``, ...)."""
        return class_name(self.meta)

    @property
    def batch_size(self) -> list[int] | None:
        """The batch size (meta.json ``"shape"``), or None."""
        shape = self.meta.get("shape")
        return list(shape) if isinstance(shape, list) else None

    @property
    def names(self) -> list[str | None] | None:
        """The dim names (meta.json ``"_names"``), or None."""
        names = self.meta.get("_names")
        return list(names) if isinstance(names, list) else None

    @property
    def data(self) -> Any:
        """The JSON data of a NonTensorData/NonTensorStack level (None otherwise)."""
        return self.meta.get("data")

    def __getitem__(self, key: Any) -> Any:
        """``level[key]``; an int, a slice or an integer/bool tensor selects rows of a level
        with a batch size (a Level of the rows of every leaf; views for an int or a slice)."""
        if key.__class__ is str:
            return dict.__getitem__(self, key)
        from .levelview import is_row_index, select_rows

        if is_row_index(key) and not (isinstance(key, int) and dict.__contains__(self, key)):
            return select_rows(self, key, "Level")
        return dict.__getitem__(self, key)

    def __repr__(self) -> str:
        """A summary like the Archive tree: keys, dtypes and shapes, at most 40 lines."""
        from .levelview import level_repr

        return level_repr(self)

    def __reduce__(self):
        return (_rebuild_level, (dict(self), self.meta, self.keyed))


def _rebuild_level(items, meta, keyed):
    return Level(items, meta=meta, keyed=keyed)


@dataclass(frozen=True)
class RawFile:
    """A non-payload file of an archive level (``json_types.json``, ...), kept as bytes."""

    data: bytes

    def __repr__(self) -> str:
        return f"{type(self).__name__}({len(self.data)} bytes)"


class PickledData(RawFile):
    """Pickled bytes from an archive: not unpickled unless asked.

    Examples
    --------
    >>> import pickle
    >>> from tdz_numba.tdz.tree import PickledData
    >>> PickledData(pickle.dumps({1, 2})).load(allow_pickle=True)
    {1, 2}
    """

    def load(self, *, allow_pickle: bool = False) -> Any:
        """Unpickles the data; raises :class:`UnsafeContentError` unless ``allow_pickle``."""
        if not allow_pickle:
            raise UnsafeContentError(
                "refusing to unpickle data from an archive: pickle can run "
                "arbitrary code. Pass allow_pickle=True only for trusted files."
            )
        return pickle.loads(self.data)


def class_name(meta: Mapping[str, Any]) -> str:
    """Short class name of a level from its ``_class`` or ``_type`` field."""
    cls = meta.get("_class")
    if isinstance(cls, str) and ":" in cls:
        return cls.rsplit(":", 1)[1].rsplit(".", 1)[-1]
    typ = meta.get("_type")
    if isinstance(typ, str) and typ.startswith("<class '") and typ.endswith("'>"):
        return typ[8:-2].rsplit(".", 1)[-1]
    return "TensorDict"


def is_keyed(meta: Mapping[str, Any]) -> bool:
    """Whether a level lists its children in meta.json (a TensorDict level, or a
    user subclass of TensorDict: tensordict writes its keys the same way)."""
    cls = meta.get("_class")
    if cls is not None:
        return cls == TD_CLASS or _lists_keys(meta)
    typ = meta.get("_type")
    if typ is not None:
        return typ == TD_TYPE or _lists_keys(meta)
    return True


def _lists_keys(meta: Mapping[str, Any]) -> bool:
    """A TensorDict-style meta.json of another class: batch ``shape`` and ``device``, no
    lazy-stack or non-tensor fields, and every other field a leaf or a sub-level record."""
    if not (isinstance(meta.get("shape"), list) and "device" in meta) or "stack_dim" in meta:
        return False
    if "_is_non_tensor" in meta:
        return False
    return all(
        isinstance(v, dict) and ("dtype" in v or "type" in v)
        for k, v in meta.items()
        if not k.startswith("_") and k not in ("shape", "device")
    )


# ---------------------------------------------------------------------------
# Writing: tree -> entries
# ---------------------------------------------------------------------------
def _json(meta: Mapping[str, Any], compact: bool = False) -> bytes:
    seps = (",", ":") if compact else None
    return json.dumps(meta, separators=seps).encode("utf-8")


def as_tensor(value: Any, where: str, *, shape_only: bool = False) -> torch.Tensor:
    """The CPU tensor whose bytes are stored for a leaf (no copy when possible).

    Raises :class:`InvalidTreeError` naming ``where`` for what :func:`load`
    could not read back: quantized and sparse tensors, tensors without data
    (meta device; accepted with ``shape_only``, for ``allocate``), numpy dtypes
    torch lacks.
    """
    if isinstance(value, np.ndarray):
        if not value.dtype.isnative:
            value = value.astype(value.dtype.newbyteorder("="))
        if from_numpy_dtype(value.dtype) is None:
            raise InvalidTreeError(
                f"{where}: numpy dtype {value.dtype} has no torch equivalent and cannot be stored"
            )
        return torch.from_numpy(np.ascontiguousarray(value).reshape(value.shape))  # 0-d stays 0-d
    t = value.detach() if value.requires_grad else value
    if t.is_quantized:
        raise InvalidTreeError(
            f"{where}: a quantized tensor ({t.dtype}) cannot be stored: load could not "
            f"read it back; store t.dequantize() or t.int_repr() and its scale/zero point"
        )
    if t.layout != torch.strided and not t.is_nested:
        raise InvalidTreeError(
            f"{where}: a {str(t.layout).replace('torch.', '')} tensor cannot be stored: "
            f"load reads dense tensors; store t.to_dense() (or its indices and values)"
        )
    if t.is_cpu:  # (is_cpu is ~6x cheaper than device.type: save's per-leaf cost, issue 11)
        pass
    elif t.device.type == "meta":
        if shape_only:
            return t
        raise InvalidTreeError(
            f"{where}: a meta-device tensor has no data to store (allocate() takes meta "
            f"templates; save needs real tensors)"
        )
    else:
        t = t.cpu()
    if t.is_nested:
        return t
    if t.is_conj():
        t = t.resolve_conj()
    if t.is_neg():
        t = t.resolve_neg()
    return t


def _numpy_scalar(value: Any) -> Any:
    """A numpy scalar as a 0-d array (numbers, bools) or a str; None for anything else."""
    if isinstance(value, np.str_):
        return str(value)
    if isinstance(value, np.generic) and from_numpy_dtype(value.dtype) is not None:
        return np.asarray(value)
    return None


def _json_value(value: Any) -> bool:
    """Whether a non-mapping value is stored as JSON NonTensorData."""
    if value is None or isinstance(value, (str, bool, int, float)):
        return True
    if isinstance(value, (list, tuple)):
        try:
            json.dumps(value)
        except (TypeError, ValueError):
            return False
        return True
    return False


def non_tensor_level(value: Any) -> Level:
    """The NonTensorData level tensordict writes for a plain Python value."""
    return Level(
        meta={"_type": NON_TENSOR_DATA_TYPE, "data": value, "_metadata": None, "_is_non_tensor": True},
        keyed=False,
    )


#: dtypes whose ``Tensor.numpy()`` works: their byte view goes through numpy (~2x faster).
_NUMPY_VIEWABLE = frozenset(
    [torch.bool, torch.uint8, torch.int8, torch.int16, torch.int32, torch.int64, torch.float16]
    + [torch.float32, torch.float64, torch.complex64, torch.complex128]
)


def byte_view(t: torch.Tensor) -> np.ndarray:
    """A flat uint8 numpy view of a contiguous CPU tensor's bytes (no copy)."""
    if t.dtype in _NUMPY_VIEWABLE:  # save's per-leaf cost (issue 11): numpy views are cheaper
        return t.numpy().reshape(-1).view(np.uint8)
    flat = t.view(-1)
    if flat.dtype != torch.uint8:
        flat = flat.view(torch.uint8)
    return flat.numpy()


def _leaf_entries(t: torch.Tensor, name: str, zeros: bool) -> tuple[dict[str, Any], list[Entry]]:
    """meta.json record and payload entries of one tensor leaf."""
    if t.is_nested:
        if zeros:
            raise InvalidTreeError(f"{name}: nested tensors cannot be allocated in an archive")
        sizes = t._nested_tensor_size().to(torch.int64).contiguous()
        meta = {"device": "cpu", "shape": list(sizes.shape), "dtype": str(t.dtype), "is_nested": True}
        out = [
            Entry(name[: -len(".memmap")] + ".shape.memmap", data=byte_view(sizes), nbytes=sizes.numel() * 8)
        ]
        if t.numel():
            buf = torch.cat([x.reshape(-1) for x in t.unbind()])
            out.insert(0, Entry(name, data=byte_view(buf), nbytes=buf.numel() * buf.element_size()))
        return meta, out
    meta = {"device": "cpu", "shape": list(t.shape), "dtype": str(t.dtype), "is_nested": False}
    nbytes = t.numel() * t.element_size()
    if nbytes == 0:
        return meta, []
    if zeros:
        return meta, [Entry(name, zeros=True, nbytes=nbytes)]
    if not t.is_contiguous():
        t = t.contiguous()
    return meta, [Entry(name, data=byte_view(t), nbytes=nbytes)]


#: Turns a value into a :class:`Level` (a tensordict collection, ...), or returns None.
Converter = Callable[[Any], "Level | None"]


def _as_level(value: Any, convert: Converter | None) -> Mapping | None:
    """``value`` as a level to write: a Level, what ``convert`` makes of it (a
    tensordict collection), another Mapping; else None."""
    if isinstance(value, Level):
        return value
    if convert is not None:
        converted = convert(value)
        if converted is not None:
            return converted
    return value if isinstance(value, Mapping) else None


def flatten(tree: Any, *, zeros: bool = False, convert: Converter | None = None) -> list[Entry]:
    """Entries of the archive for ``tree``, in tensordict's order.

    Depth first; at each level ``meta.json``, then the other files sorted by
    name, then the sub-directories sorted by name. With ``zeros=True`` payload
    entries carry no data (``allocate``). ``convert`` turns other collections
    into levels (the caller's choice: ``save`` passes
    :func:`tdz_numba.tdz.tdcompat.converter` for tensordict collections).
    """
    root = _as_level(tree, convert)
    if root is None:
        raise InvalidTreeError(
            f"save expects a mapping (dict, Level or TensorDict), got {type(tree).__name__}"
        )
    out: list[Entry] = []
    stack: list[tuple[Any, str]] = [(root, "")]  # a loop, not recursion: any nesting depth
    while stack:
        level, prefix = stack.pop()
        subs = _flatten_level(level, prefix, out, zeros, convert)
        stack.extend(reversed(subs))  # sub-directories by name, depth first
    return out


def td_level_fields() -> dict[str, Any]:
    """The fields of a plain TensorDict level's meta.json (no batch size, on cpu)."""
    return {
        "shape": [],
        "device": "cpu",
        "_type": TD_TYPE,
        "_format_version": FORMAT_VERSION,
        "_class": TD_CLASS,
    }


def _flatten_level(
    level: Mapping, prefix: str, out: list[Entry], zeros: bool, convert: Converter | None
) -> list[tuple[Any, str]]:
    """Appends the entries of one level to ``out``; returns its sub-levels ``(level, prefix)`` by name."""
    where = prefix.rstrip("/") or "<root>"
    files: dict[str, Entry] = {}
    dirs: dict[str, Any] = {}
    keyed = getattr(level, "keyed", True)
    own_meta = getattr(level, "meta", None)

    def add_file(fname: str, entry: Entry) -> None:
        if fname in files or fname in dirs or fname == "meta.json":
            raise InvalidTreeError(f"{where}: two children map to the file name {fname!r}")
        files[fname] = entry

    def add_dir(dname: str, child: Any) -> None:
        if dname in dirs or dname in files:
            raise InvalidTreeError(f"{where}: two children map to the directory {dname!r}")
        dirs[dname] = child

    if keyed and own_meta is not None and "_type" not in own_meta and "_class" not in own_meta:
        # a level read from another format (HDF5 attributes, a reader's own fields): only the
        # fields a tensordict meta.json holds are kept, the rest would break tensordict's loader
        kept = {k: v for k, v in own_meta.items() if k in ("shape", "device", "_names")}
        own_meta = {**td_level_fields(), **kept} if kept else None
    if keyed:
        meta: dict[str, Any] = {}
        reserved = set(RESERVED_FIELDS) if own_meta is None else set(own_meta)
        for key, value in level.items():
            if not isinstance(key, str):
                raise InvalidTreeError(f"{where}: keys must be str, got {key!r}")
            if key in reserved:
                raise InvalidTreeError(
                    f"{where}: key {key!r} collides with the meta.json field of the same name; rename it"
                )
            fname = encode_key(key)
            path = prefix + fname
            if isinstance(value, np.generic):
                scalar = _numpy_scalar(value)
                value = scalar if scalar is not None else value
            if isinstance(value, (torch.Tensor, np.ndarray)):
                leaf = as_tensor(value, path, shape_only=zeros)
                meta[key], payloads = _leaf_entries(leaf, path + ".memmap", zeros)
                for e in payloads:
                    add_file(e.name[len(prefix) :], e)
            elif _json_value(value):
                # NaN and infinities are written as json writes them, as tensordict does
                meta[key] = {"type": "NonTensorData"}
                add_dir(fname, non_tensor_level(value))
            else:
                child = _as_level(value, convert)
                if child is None:
                    if isinstance(value, (list, tuple)) and any(
                        isinstance(v, (torch.Tensor, np.ndarray)) for v in value
                    ):
                        raise InvalidTreeError(
                            f"{path}: a {type(value).__name__} of tensors cannot be stored as one value; "
                            f"use a dict ({{'0': t0, '1': t1, ...}}) or torch.stack(...) them into one tensor"
                        )
                    raise InvalidTreeError(
                        f"{path}: cannot store a value of type {type(value).__name__} "
                        f"(expected a tensor, an array, a mapping, or "
                        f"str/int/float/bool/None/lists of them)"
                    )
                meta[key] = {"type": getattr(child, "type_name", "TensorDict")}
                add_dir(fname, child)
        if own_meta is None:
            meta.update(td_level_fields())
        else:
            meta.update(own_meta)
        compact = False
    else:
        meta = dict(own_meta or {})
        for name, value in level.items():
            if isinstance(value, RawFile):
                add_file(name, Entry(prefix + name, data=value.data))
            elif _as_level(value, convert) is not None:
                add_dir(name, _as_level(value, convert))
            else:
                raise InvalidTreeError(
                    f"{prefix + name}: a {class_name(meta)} level holds only levels and "
                    f"files, got {type(value).__name__}"
                )
        compact = meta.get("_type") == NON_TENSOR_STACK_TYPE
    try:
        data = _json(meta, compact)
    except (TypeError, ValueError) as exc:
        raise InvalidTreeError(f"{where}: metadata is not JSON-serializable: {exc}") from None
    out.append(Entry(prefix + "meta.json", data=data))
    for fname in sorted(files):
        e = files[fname]
        if e.name != prefix + fname:
            e.name = prefix + fname
        out.append(e)
    return [(dirs[dname], prefix + dname + "/") for dname in sorted(dirs)]


# ---------------------------------------------------------------------------
# Reading: meta.json + listing -> children
# ---------------------------------------------------------------------------
_ITEMSIZE = {name: dt.itemsize for name, dt in dtype_table().items()}


class LeafSpec(NamedTuple):
    """A tensor leaf described by meta.json."""

    key: str
    entry: str  # archive name of the payload
    dtype: str
    shape: tuple[int, ...]
    nested: bool
    shape_entry: str | None = None


def describe_level(
    meta: Any,
    prefix: str,
    listing: Callable[[], tuple[set[str], set[str]]],
    has_level: Callable[[str], bool],
    where: str,
) -> tuple[bool, list[Child]]:
    """Children of the level at ``prefix`` from its parsed meta.json.

    ``listing()`` gives the ``(files, dirs)`` directly under ``prefix`` (only
    levels that do not list their children in meta.json need it);
    ``has_level(dir_prefix)`` tells whether a sub-level (its meta.json)
    exists. Raises :class:`~tdz_numba.errors.BadArchiveError` for a malformed
    meta.json.
    """
    if not isinstance(meta, dict):
        raise BadArchiveError(f"{where}: meta.json must hold a JSON object, found {type(meta).__name__}")
    version = meta.get("_format_version", 0)
    if not isinstance(version, int) or version > FORMAT_VERSION:
        raise BadArchiveError(
            f"{where}: meta.json _format_version {version!r} is newer than this "
            f"reader supports (expected <= {FORMAT_VERSION})"
        )
    children: list[Child] = []
    if is_keyed(meta):
        for key, value in meta.items():
            if key in RESERVED_FIELDS and not isinstance(value, dict):
                continue
            if not isinstance(value, dict):
                raise BadArchiveError(
                    f"{where}: meta.json entry {key!r} must be an object, found {value!r:.200}"
                )
            fname = encode_key(key)
            if "type" in value and "dtype" not in value:
                if not has_level(prefix + fname + "/"):
                    raise BadArchiveError(
                        f"{where}: meta.json lists {key!r} ({value['type']}) but the "
                        f"archive has no directory {prefix + fname + '/'!r}"
                    )
                children.append(Child(key, "level", prefix + fname + "/"))
                continue
            if "dtype" not in value or "shape" not in value:
                raise BadArchiveError(
                    f"{where}: meta.json entry {key!r} has neither 'dtype'/'shape' nor 'type': {value!r:.200}"
                )
            shape, dtype = value["shape"], value["dtype"]
            nested = bool(value.get("is_nested", False))
            # nested leaves: the shape is that of their int64 sizes; a bad dtype fails on access
            itemsize = 8 if nested else _ITEMSIZE.get(dtype, 1) if type(dtype) is str else 1
            if type(shape) is not list or shape_nbytes(shape, itemsize) < 0:
                check_shape(shape, itemsize, f"{where}: leaf {key!r}")
            base = prefix + fname
            entry = base + ".memmap"
            spec = LeafSpec(
                key, entry, dtype, tuple(shape), nested, base + ".shape.memmap" if nested else None
            )
            children.append(Child(key, "leaf", entry, spec))
        return True, children
    files, dirs = listing()
    for d in sorted(dirs):
        children.append(Child(d, "level", prefix + d + "/"))
    for f in sorted(files):
        if f != "meta.json":
            children.append(Child(f, "file", prefix + f))
    return False, children
