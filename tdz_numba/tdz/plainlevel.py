"""What a plain TensorDict ``meta.json`` says about its level, whatever the level's path.

Most levels of a real archive are plain TensorDict levels (known dtypes, list shapes,
nothing nested), and many share one ``meta.json`` text: the groups of a replay
buffer, the layers of a checkpoint. :func:`plain_level` reads such a text once into
a :class:`PlainLevel` (entry names below the level, byte sizes, shapes, strides), and
a reader keeps it per distinct text: every other level with the same bytes is then
resolved without parsing or walking its JSON again. Used by
:meth:`TdzSource.quick_level <tdz_numba.tdz.source.TdzSource.quick_level>` (load) and
:mod:`tdz_numba.archive.verify_pass` (verify).

Examples
--------
>>> from tdz_numba.tdz.plainlevel import plain_level
>>> lvl = plain_level({"x": {"dtype": "torch.float32", "shape": [2, 3]}, "sub": {"type": "TensorDict"},
...                    "shape": [], "device": None, "_type": "<class 'tensordict._td.TensorDict'>"})
>>> lvl.names, lvl.nbytes, lvl.subs, lvl.items[0][4:]
(['x.memmap'], [24], ['sub/'], ((2, 3), (3, 1)))
>>> plain_level({"x": {"dtype": "torch.float32", "shape": [2], "is_nested": True}}) is None
True
"""

from __future__ import annotations

from collections.abc import Callable
from itertools import islice, repeat
from typing import Any

import numpy as np

from ..files.loadadvice import advise_whole_file
from ..jit.policy import use_kernels
from ..zipfmt.records import Col
from . import sources as _sources
from .bounds import MAX_NBYTES, parse_meta, shape_nbytes
from .dtypes import dtype_table
from .keys import _ENCODED, encode_key
from .sources import Child, leaf_view, own_views
from .tree import (
    FORMAT_VERSION,
    NON_TENSOR_DATA_TYPE,
    RESERVED_FIELDS,
    TD_CLASS,
    TD_TYPE,
    LeafSpec,
    Level,
    is_keyed,
)
from .viewruns import _RUNS_FROM, _made_in_runs

__all__ = [
    "PlainLevel",
    "plain_level",
    "plain_level_of",
    "MAX_TEXTS",
    "is_plain_td",
    "td_fields_ok",
    "plain_td_level",
    "scan_td_level",
    "quick_views",
    "quick_leaves",
    "advise_views",
    "plain_children",
    "children_of_plain",
]

#: Bytes of a ``meta.json`` text from which :func:`scan_td_level` scans it (below: parsed, ~20 us at most).
SCAN_MIN = 2048
#: Distinct ``meta.json`` texts a reader keeps a :class:`PlainLevel` of (beyond: parsed per level).
MAX_TEXTS = 4096

_ITEMSIZE = {name: dtype.itemsize for name, dtype in dtype_table().items()}
_UNIT_STRIDE: tuple[int, ...] = (1,)
_STRIDES: dict[tuple[int, ...], tuple[int, ...]] = {}  # contiguous strides of the shapes seen
_UNSEEN: Any = object()


def contiguous_strides(shape: tuple[int, ...]) -> tuple[int, ...]:
    """Element strides of a C-contiguous tensor of ``shape`` (cached: leaves repeat shapes).

    >>> contiguous_strides((2, 3, 4))
    (12, 4, 1)
    """
    found = _STRIDES.get(shape)
    if found is not None:
        return found
    strides = [1] * len(shape)
    for i in range(len(shape) - 2, -1, -1):
        strides[i] = strides[i + 1] * max(shape[i + 1], 1)
    found = tuple(strides)
    if len(_STRIDES) < 4096:
        _STRIDES[shape] = found
    return found


class PlainLevel:
    """A plain TensorDict level's ``meta.json``, below any prefix.

    Attributes
    ----------
    fields : dict
        The level's own fields (batch ``shape``, ``device``, ``_type``, ...), in file order.
    items : list of tuple
        Every child in ``meta.json`` order: ``(key, name, nbytes, dtype, shape, strides)``
        of a leaf (``name``: its entry below the level, ``"<key>.memmap"``), or
        ``(key, "<key>/", -1, None, (), ())`` of a sub-level.
    names, nbytes, itemsize : list
        Per leaf, in order: the entry name below the level, bytes, bytes per element.
    subs : list of str
        Each sub-level's directory below the level (``"<key>/"``).
    """

    __slots__ = ("fields", "items", "names", "nbytes", "itemsize", "subs", "_arrays")

    def __init__(self) -> None:
        self.fields: dict[str, Any] = {}
        self.items: list[tuple[str, str, int, str | None, tuple[int, ...], tuple[int, ...]]] = []
        self.names: list[str] = []
        self.nbytes: list[int] = []
        self.itemsize: list[int] = []
        self.subs: list[str] = []
        self._arrays: tuple[np.ndarray, np.ndarray] | None = None

    @property
    def arrays(self) -> tuple[np.ndarray, np.ndarray]:
        """``(nbytes, itemsize)`` of the leaves as int64 arrays."""
        if self._arrays is None:
            self._arrays = (np.array(self.nbytes, np.int64), np.array(self.itemsize, np.int64))
        return self._arrays


def plain_level(meta: Any) -> PlainLevel | None:
    """The :class:`PlainLevel` of a parsed ``meta.json``, or None unless it is a plain
    TensorDict level: a keyed level of a known format version whose leaves have known
    dtypes, list shapes of a valid size and are not nested, and whose sub-levels
    name a ``type``. Anything else is for the general path, which also names what is
    wrong."""
    if type(meta) is not dict or meta.get("_type") == NON_TENSOR_DATA_TYPE or not is_keyed(meta):
        return None
    version = meta.get("_format_version", 0)
    if type(version) is not int or version > FORMAT_VERSION:
        return None
    encoded, itemsizes = _ENCODED, _ITEMSIZE
    out = PlainLevel()
    for key, value in meta.items():
        if type(value) is not dict:
            if key in RESERVED_FIELDS:
                out.fields[key] = value
                continue
            return None
        fname = encoded.get(key) or encode_key(key)
        if "dtype" not in value:
            if "type" not in value:
                return None
            out.subs.append(fname + "/")
            out.items.append((key, fname + "/", -1, None, (), ()))
            continue
        shape, dname = value.get("shape"), value["dtype"]
        itemsize = itemsizes.get(dname) if type(dname) is str else None
        if itemsize is None or type(shape) is not list or value.get("is_nested"):
            return None
        if len(shape) == 1 and type(shape[0]) is int and 0 <= shape[0] <= MAX_NBYTES // itemsize:
            nbytes = shape[0] * itemsize  # shape_nbytes of one dimension, without the call
            dims: tuple[int, ...] = (shape[0],)
            strides = _UNIT_STRIDE
        else:
            nbytes = shape_nbytes(shape, itemsize)
            if nbytes < 0:
                return None
            dims = tuple(shape)
            strides = contiguous_strides(dims)
        out.names.append(fname + ".memmap")
        out.nbytes.append(nbytes)
        out.itemsize.append(itemsize)
        out.items.append((key, fname + ".memmap", nbytes, dname, dims, strides))
    return out


def plain_level_of(texts: dict[bytes, PlainLevel | None], data: bytes, where: str) -> PlainLevel | None:
    """:func:`plain_level` of the ``meta.json`` bytes ``data``, each distinct text parsed
    once: kept in ``texts`` (a reader's own dict, at most :data:`MAX_TEXTS` texts).
    Raises :class:`~tdz_numba.errors.BadArchiveError` naming ``where`` for bytes that
    are not a JSON document.

    >>> texts = {}
    >>> a = plain_level_of(texts, b'{"x": {"dtype": "torch.int8", "shape": [3]}}', "g0/meta.json")
    >>> a is plain_level_of(texts, b'{"x": {"dtype": "torch.int8", "shape": [3]}}', "g1/meta.json"), a.nbytes
    (True, [3])
    """
    found = texts.get(data, _UNSEEN)
    if found is _UNSEEN:
        found = scan_td_level(data, "", _ANY) or plain_level(parse_meta(data, where))
        if len(texts) < MAX_TEXTS:
            texts[data] = found
    return found


def _any(name: str) -> bool:
    return True


_ANY = _any


def scan_td_level(data: bytes, prefix: str, has_meta: Callable[[str], bool]) -> PlainLevel | None:
    """``plain_td_level(parse_meta(data, ...), prefix, has_meta)[1]`` read by one compiled scan
    (:func:`~tdz_numba.tdz.metascan.scan_level`) of a text in tensordict's writer layout of at least
    :data:`SCAN_MIN` bytes, when the kernels run (:func:`~tdz_numba.jit.policy.use_kernels`); None
    otherwise, and for any text the scan does not take: the caller then parses ``data``.

    >>> scan_td_level(b'{"x": {"dtype": "torch.int8", "shape": [3]}}', "", None) is None  # (small)
    True
    """
    if len(data) < SCAN_MIN or not use_kernels(len(data) >> 7):
        return None
    from .metascan import scan_level  # imports Numba

    return scan_level(data, prefix, has_meta)


#: Most leaves of a level the per-leaf path of ``quick_level`` makes rather than :func:`quick_views`:
#: its ~10 numpy calls cost ~25 us whatever the count, the per-leaf path ~1.5 us a leaf (measured:
#: a level of one leaf 40 us of a 190 us load against 3).
QUICK_SMALL = 12


def quick_views(src: Any, plain: PlainLevel, prefix: str) -> Any:
    """The leaves of a level of leaves only as :meth:`TdzSource.quick_level
    <tdz_numba.tdz.source.TdzSource.quick_level>` makes them, in passes over all of them: its
    ``(level, [])`` when every leaf is a STORED entry of its size at an aligned, resolved offset
    and none has a view yet, else None (the per-leaf path checks each leaf and makes the rest).
    """
    index, items, cache = src.index, plain.items, src._tensors
    if plain.subs or len(items) <= QUICK_SMALL:  # (few leaves: the per-leaf path is cheaper)
        return None
    entries = plain.names if not prefix else [prefix + name for name in plain.names]
    if cache and not cache.keys().isdisjoint(entries):
        return None  # (views made already: the per-leaf path gives those)
    rows = np.fromiter(map(index._by_name.get, entries, repeat(-1)), np.int64, len(entries))
    if (rows < 0).any():
        return None
    cols = index.columns[rows]
    nbytes, itemsize = plain.arrays
    offsets = cols[:, Col.PAYLOAD_OFFSET]
    if cols[:, Col.METHOD].any() or (cols[:, Col.SIZE] != nbytes).any() or (offsets < 0).any():
        return None
    if (offsets % itemsize).any():
        return None
    keys, _, _, dnames, shapes, strides = zip(*items)
    elem_arr = offsets // itemsize
    elems = elem_arr.tolist()
    kinds = src._kinds
    with _sources.own_views():
        if not _sources._GUARD:
            return None
        kind = set(dnames)
        if len(kind) == 1:
            view = (kinds.get(dnames[0]) or src._kind(dnames[0]))[1]
            made = None
            if len(elems) >= _RUNS_FROM:  # leaves evenly spaced in the file: made a run at a time
                made = _made_in_runs([view], np.zeros(len(elems), np.int64), shapes, strides, elem_arr)
            if made is None:
                made = list(map(view.as_strided, shapes, strides, elems))
        else:
            views = {d: (kinds.get(d) or src._kind(d))[1] for d in kind}
            made = [views[d].as_strided(s, t, e) for d, s, t, e in zip(dnames, shapes, strides, elems)]
    cache.update(zip(entries, made))
    out = Level(meta=plain.fields)
    out.update(zip(keys, made))
    return out, []


#: Views whose payloads :func:`advise_views` looks at, at most (evenly spaced: a sample of an
#: order in the file is in order; of an order jumping back and forth, jumps too).
ADVISE_SAMPLE = 4096


def quick_leaves(src: Any, plain: PlainLevel, prefix: str, tensors: bool) -> Any:
    """The level as :meth:`TdzSource.quick_level <tdz_numba.tdz.source.TdzSource.quick_level>`
    makes it leaf by leaf (a level with sub-levels, few leaves, or leaves :func:`quick_views`
    does not take): its ``(level, subs)``, or None at the first leaf that is not a STORED entry
    of its size at an aligned offset (the general path then names what is wrong)."""
    index = src.index
    by_name, cache = index._by_name, src._tensors
    columns = src._columns
    if columns is None or columns[0] is not index.columns:  # index rows as lists, once per parse
        cols = index.columns
        m, s, o = (cols[:, c].tolist() for c in (Col.METHOD, Col.SIZE, Col.PAYLOAD_OFFSET))
        columns = src._columns = (cols, m, s, o)
    _, methods, sizes, offsets = columns
    kinds = src._kinds  # dtype name -> (itemsize, typed view of the mapping)
    out = Level(meta=plain.fields)
    subs: list[tuple[str, str]] = []
    # each leaf its own tensor on the mapping's storage (own version counter): own_views
    with own_views():
        guarded = bool(_sources._GUARD)
        for key, name, nbytes, dname, shape, strides in plain.items:
            entry = prefix + name
            if dname is None:  # a sub-level
                if entry + "meta.json" not in by_name:
                    return None
                out[key] = None
                subs.append((key, entry))
                continue
            t = cache.get(entry) if cache else None
            if t is None:
                itemsize, view = kinds.get(dname) or src._kind(dname)
                row = by_name.get(entry)
                if row is None:
                    if nbytes:
                        return None
                    if tensors:  # tensordict writes no file for an empty leaf
                        cache[entry] = view.new_empty(shape)
                    out[key] = cache.get(entry)
                    continue
                if methods[row] or sizes[row] != nbytes:
                    return None
                offset = offsets[row]
                if offset < 0:  # a part of the archive: its local header read now
                    offset = index.payload_offset(row)
                if offset % itemsize:
                    return None
                if not tensors:
                    out[key] = None
                    continue
                t = (
                    view.as_strided(shape, strides, offset // itemsize)
                    if guarded
                    else leaf_view(view, shape, strides, offset // itemsize)
                )
                cache[entry] = t
            out[key] = t
    return out, subs


def advise_views(src: Any) -> bool:
    """:func:`~tdz_numba.files.loadadvice.advise_whole_file` of a ``.tdz`` source's mapping with the
    payloads of the views made so far, in the order they were made (a load's: its keys' order;
    at most :data:`ADVISE_SAMPLE` of them); whether advice was given.

    >>> import tempfile, pathlib, torch, tdz_numba
    >>> from tdz_numba.tdz.source import open_tdz
    >>> with tempfile.TemporaryDirectory() as d:
    ...     src = open_tdz(tdz_numba.save({"a": torch.ones(4)}, pathlib.Path(d) / "x.tdz"))
    ...     given = advise_views(src); src.close()
    >>> given  # (no view made yet)
    False
    """
    index, made = src.index, src._tensors
    if not made:
        return False
    step = -(-len(made) // ADVISE_SAMPLE)
    rows = np.fromiter(map(index._by_name.get, islice(made, 0, None, step), repeat(-1)), np.int64)
    cols = index.columns[rows[rows >= 0]]
    offsets = cols[:, Col.PAYLOAD_OFFSET]
    known = offsets >= 0
    return advise_whole_file(index.mapping, offsets[known], cols[known, Col.SIZE])


def td_fields_ok(meta: dict[str, Any]) -> bool:
    """Whether a level's fields name a TensorDict level of a format version this package reads
    (``_class`` TensorDict, or no ``_class`` and a ``_type`` of TensorDict or none).

    >>> td_fields_ok({"_format_version": 1}), td_fields_ok({"_class": "other"})
    (True, False)
    """
    cls = meta.get("_class")
    if cls is None:
        typ = meta.get("_type")
        if typ is not None and typ != TD_TYPE:
            return False
    elif cls != TD_CLASS:
        return False
    version = meta.get("_format_version", 0)
    return type(version) is int and version <= FORMAT_VERSION


def is_plain_td(meta: Any, prefix: str, has_meta: Callable[[str], bool]) -> bool:
    """Whether a parsed ``meta.json`` is a plain TensorDict level that
    :func:`~tdz_numba.tdz.tree.describe_level` describes without error, checked without
    building anything: a ``TensorDict`` of a known format version whose leaves have a
    known dtype, a valid list shape and a bool ``is_nested`` (or none), and whose
    sub-levels name a ``type`` and have a ``meta.json`` (``has_meta("a/b/meta.json")``).
    Its children are then :func:`plain_children`; anything else (and every error) is
    for the general path.

    >>> meta = {"x": {"dtype": "torch.float32", "shape": [2, 3]}, "sub": {"type": "TensorDict"},
    ...         "shape": [], "_type": "<class 'tensordict._td.TensorDict'>"}
    >>> is_plain_td(meta, "", lambda name: name == "sub/meta.json")
    True
    >>> is_plain_td(meta, "", lambda name: False), is_plain_td({"x": {"dtype": "odd", "shape": []}}, "", None)
    (False, False)
    """
    if type(meta) is not dict or not td_fields_ok(meta):
        return False
    itemsizes, encoded = _ITEMSIZE, _ENCODED
    for key, value in meta.items():
        if type(value) is not dict:
            if key in RESERVED_FIELDS:
                continue
            return False
        if "dtype" in value:
            dname, shape = value["dtype"], value.get("shape")
            itemsize = itemsizes.get(dname) if type(dname) is str else None
            if itemsize is None or type(shape) is not list:
                return False
            nested = value.get("is_nested", False)
            if nested is not False:
                if nested is not True:
                    return False
                itemsize = 8  # a nested leaf's shape is that of its int64 sizes
            ndim = len(shape)
            if ndim == 1:
                n = shape[0]
                if type(n) is not int or n < 0 or n > MAX_NBYTES // itemsize:
                    return False
            elif ndim == 2:  # shape_nbytes of two dimensions, without the call (as plain_td_level)
                a, b = shape
                if type(a) is not int or type(b) is not int or a < 0 or b < 0:
                    return False
                if (a or 1) * (b or 1) > MAX_NBYTES // itemsize:  # (zero dims count as 1)
                    return False
            elif shape_nbytes(shape, itemsize) < 0:
                return False
        elif "type" not in value or not has_meta(
            prefix + (encoded.get(key) or encode_key(key)) + "/meta.json"
        ):
            return False
    return True


def plain_td_level(meta: Any, prefix: str, has_meta: Callable[[str], bool]) -> tuple[bool, PlainLevel | None]:
    """:func:`is_plain_td` and, where it holds, :func:`plain_level` of the same ``meta``, in
    one walk of its leaves: ``(is_plain_td(meta, prefix, has_meta), plain_level(meta))``,
    the second None when the first is False. An open checks its root level this way
    (:meth:`TdzSource.check_level <tdz_numba.tdz.source.TdzSource.check_level>`) and a load
    reads the level it kept (:meth:`~tdz_numba.tdz.source.TdzSource.quick_level`) without
    walking the ``meta.json`` again.

    >>> meta = {"x": {"dtype": "torch.float32", "shape": [2, 3]}, "sub": {"type": "TensorDict"},
    ...         "shape": [], "_type": "<class 'tensordict._td.TensorDict'>"}
    >>> ok, lvl = plain_td_level(meta, "", lambda name: name == "sub/meta.json")
    >>> ok, lvl.names, lvl.subs, lvl.items[0][4:]
    (True, ['x.memmap'], ['sub/'], ((2, 3), (3, 1)))
    >>> plain_td_level({"x": {"dtype": "torch.int8", "shape": [2], "is_nested": True}}, "", None)
    (True, None)
    >>> plain_td_level({"x": {"dtype": "odd", "shape": []}}, "", None)
    (False, None)
    """
    if type(meta) is not dict:
        return False, None
    if not td_fields_ok(meta):
        return False, None
    # a TensorDict level (TD_TYPE, TD_CLASS or neither): is_keyed holds, as plain_level asks;
    # plain_level also refuses a NonTensorData _type (next to a TensorDict _class) and nested leaves
    itemsizes, encoded = _ITEMSIZE, _ENCODED
    out = PlainLevel()
    keep = meta.get("_type") != NON_TENSOR_DATA_TYPE
    fields, items, names, sizes, itemsize_of, subs = (
        out.fields,
        out.items,
        out.names,
        out.nbytes,
        out.itemsize,
        out.subs,
    )
    for key, value in meta.items():
        if type(value) is not dict:
            if key in RESERVED_FIELDS:
                fields[key] = value
                continue
            return False, None
        fname = encoded.get(key) or encode_key(key)
        if "dtype" not in value:
            if "type" not in value or not has_meta(prefix + fname + "/meta.json"):
                return False, None
            subs.append(fname + "/")
            items.append((key, fname + "/", -1, None, (), ()))
            continue
        dname, shape = value["dtype"], value.get("shape")
        itemsize = itemsizes.get(dname) if type(dname) is str else None
        if itemsize is None or type(shape) is not list:
            return False, None
        nested = value.get("is_nested", False)
        if nested is not False:
            if nested is not True:
                return False, None
            itemsize, keep = 8, False  # a nested leaf's shape is that of its int64 sizes: not plain_level's
        ndim = len(shape)
        dims: tuple[int, ...]
        if ndim == 1:
            n = shape[0]
            if type(n) is not int or n < 0 or n > MAX_NBYTES // itemsize:
                return False, None
            nbytes, dims, strides = n * itemsize, (n,), _UNIT_STRIDE
        elif ndim == 2:  # shape_nbytes and contiguous_strides of two dimensions, without the calls
            a, b = shape
            if type(a) is not int or type(b) is not int or a < 0 or b < 0:
                return False, None
            if (a or 1) * (b or 1) > MAX_NBYTES // itemsize:  # (zero dims count as 1)
                return False, None
            nbytes, dims, strides = a * b * itemsize, (a, b), (b or 1, 1)
        else:
            nbytes = shape_nbytes(shape, itemsize)
            if nbytes < 0:
                return False, None
            dims = tuple(shape)
            strides = contiguous_strides(dims)
        if keep:
            fname += ".memmap"
            names.append(fname)
            sizes.append(nbytes)
            itemsize_of.append(itemsize)
            items.append((key, fname, nbytes, dname, dims, strides))
    return True, out if keep else None


def plain_children(meta: dict[str, Any], prefix: str) -> dict[str, Child]:
    """The children of a level that :func:`is_plain_td` accepted, as
    :func:`~tdz_numba.tdz.tree.describe_level` gives them (the same
    :class:`~tdz_numba.tdz.sources.Child` and :class:`~tdz_numba.tdz.tree.LeafSpec` values).

    >>> kids = plain_children({"x": {"dtype": "torch.int8", "shape": [3]}, "s": {"type": "TensorDict"}}, "a/")
    >>> kids["x"].leaf.entry, kids["x"].leaf.shape, kids["s"].path
    ('a/x.memmap', (3,), 'a/s/')
    """
    new, encoded = tuple.__new__, _ENCODED
    children: dict[str, Child] = {}
    for key, value in meta.items():
        if type(value) is not dict:
            continue  # a reserved field
        base = prefix + (encoded.get(key) or encode_key(key))
        if "dtype" not in value:
            children[key] = new(Child, (key, "level", base + "/", None))
            continue
        nested = value.get("is_nested", False)
        entry = base + ".memmap"
        spec = new(
            LeafSpec,
            (
                key,
                entry,
                value["dtype"],
                tuple(value["shape"]),
                nested,
                base + ".shape.memmap" if nested else None,
            ),
        )
        children[key] = new(Child, (key, "leaf", entry, spec))
    return children


def children_of_plain(plain: PlainLevel, prefix: str) -> dict[str, Child]:
    """:func:`plain_children` of the ``meta.json`` that ``plain`` was read from (the same
    children, in the same order), made from its columns in one C-level pass per field: a lazy
    open lists a 20,000-leaf level scanned by :func:`scan_td_level` without walking its JSON.

    >>> lvl = plain_level({"x": {"dtype": "torch.int8", "shape": [3]}, "s": {"type": "TensorDict"}})
    >>> kids = children_of_plain(lvl, "a/")
    >>> kids["x"].leaf.entry, kids["x"].leaf.shape, kids["s"].path
    ('a/x.memmap', (3,), 'a/s/')
    """
    new = tuple.__new__
    if not plain.items:
        return {}
    keys, names, sizes, dnames, shapes, _strides = zip(*plain.items)
    entries = [prefix + name for name in names] if prefix else names
    n = len(keys)
    if plain.subs:  # (levels and leaves mixed: one step each)
        return {
            key: new(Child, (key, "level", entry, None))
            if size < 0
            else new(Child, (key, "leaf", entry, new(LeafSpec, (key, entry, dname, shape, False, None))))
            for key, entry, size, dname, shape in zip(keys, entries, sizes, dnames, shapes)
        }
    specs = map(
        new, repeat(LeafSpec, n), zip(keys, entries, dnames, shapes, repeat(False, n), repeat(None, n))
    )
    return dict(zip(keys, map(new, repeat(Child, n), zip(keys, repeat("leaf", n), entries, specs))))
