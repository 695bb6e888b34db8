"""safetensors files, single and sharded, as zero-copy sources.

The header (a little-endian u64 length, then a JSON object) is validated as
strictly as safetensors' own reader: header size at most 100 MB and inside the
file, every entry with a known ``dtype``, a ``shape`` of non-negative ints and
``data_offsets`` ``[begin, end]`` that tile the data area exactly (sorted by
offset, each tensor starts where the previous ends, the last ends at the end
of the file), ``end - begin == numel * itemsize``, and ``__metadata__`` a
str -> str object. Any violation raises :class:`~tdz_numba.BadArchiveError`
naming the tensor and the field.

A sharded checkpoint (``model.safetensors.index.json`` with a ``weight_map``)
opens as one name space over all its shards; each shard is mapped once.

Examples
--------
>>> import tempfile, pathlib, torch
>>> from safetensors.torch import save_file
>>> from tdz_numba.formats.safetensors import open_safetensors
>>> with tempfile.TemporaryDirectory() as d:
...     p = pathlib.Path(d) / "m.safetensors"
...     save_file({"a": torch.zeros(3), "b": torch.ones(2, 2)}, str(p), metadata={"format": "pt"})
...     src = open_safetensors(p)
...     print(list(src.level("").children), src.metadata)
['a', 'b'] {'format': 'pt'}
"""

from __future__ import annotations

import json
import math
import os
import re
import struct
from pathlib import Path
from typing import Any

import numpy as np
import torch

from ..errors import BadArchiveError, UnsupportedError
from ..files.confine import MemberMissingError, map_inside
from ..jit.policy import use_kernels
from ..tdz.sources import MappedFile, TensorSpec, TreeSource
from ._common import no_gc, quote
from ._flat import flat_source, make_specs
from ._shape import MAX_NDIM, check_shape
from .detect import read_json_file

__all__ = [
    "open_safetensors",
    "open_sharded",
    "parse_header",
    "index_claims",
    "join_shards",
    "DTYPES",
    "MAX_HEADER_SIZE",
]

#: safetensors' own limit on the JSON header.
MAX_HEADER_SIZE = 100_000_000

_NAMES = {
    "BOOL": "bool",
    "U8": "uint8",
    "I8": "int8",
    "F8_E5M2": "float8_e5m2",
    "F8_E4M3": "float8_e4m3fn",
    "F8_E4M3FNUZ": "float8_e4m3fnuz",
    "F8_E5M2FNUZ": "float8_e5m2fnuz",
    "F8_E8M0": "float8_e8m0fnu",
    "I16": "int16",
    "U16": "uint16",
    "F16": "float16",
    "BF16": "bfloat16",
    "I32": "int32",
    "U32": "uint32",
    "F32": "float32",
    "F64": "float64",
    "I64": "int64",
    "U64": "uint64",
    "C64": "complex64",
    "C128": "complex128",
}
#: safetensors dtype names -> torch dtypes (those this torch has).
DTYPES: dict[str, torch.dtype] = {k: getattr(torch, v) for k, v in _NAMES.items() if hasattr(torch, v)}
#: dtypes safetensors defines that have no torch equivalent here (sub-byte floats, ...).
_UNSUPPORTED = {"F4", "F6_E2M3", "F6_E3M2"} | (set(_NAMES) - set(DTYPES))


def _fail(where: str, msg: str) -> BadArchiveError:
    return BadArchiveError(f"{where}: {msg}")


def _object(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    out = dict(pairs)
    if len(out) != len(pairs):
        seen: set[str] = set()
        dup = next(k for k, _ in pairs if k in seen or seen.add(k))  # type: ignore[func-returns-value]
        raise ValueError(f"key {quote(dup)} appears twice")
    return out


_FIELDS = {"dtype": 0, "shape": 0, "data_offsets": 0}.keys()


def _explain(name: str, info: Any, where: str, data_len: int | None = None) -> None:
    """Raises the error that names what is wrong with header entry ``name``."""
    what = f"{where}: tensor {quote(name)}"
    if not isinstance(info, dict):
        raise BadArchiveError(f"{what}: entry must be an object, found {type(info).__name__}")
    extra = set(info) - set(_FIELDS)
    missing = set(_FIELDS) - set(info)
    if missing or extra:
        raise BadArchiveError(
            f"{what}: fields must be dtype, shape, data_offsets "
            f"(missing {sorted(missing)}, unknown {sorted(extra)[:5]})"
        )
    tname = info["dtype"]
    if isinstance(tname, str) and tname in _UNSUPPORTED:
        raise UnsupportedError(f"{what}: dtype {tname} has no torch {torch.__version__} equivalent")
    if not isinstance(tname, str) or tname not in DTYPES:
        raise BadArchiveError(f"{what}: dtype: unknown {quote(tname, 40)} (expected one of {sorted(DTYPES)})")
    shape = info["shape"]
    if type(shape) is not list or not all(type(d) is int and d >= 0 for d in shape):
        raise BadArchiveError(f"{what}: shape: {quote(shape, 100)} is not a list of non-negative ints")
    offs = info["data_offsets"]
    if type(offs) is not list or len(offs) != 2 or not all(type(o) is int and o >= 0 for o in offs):
        raise BadArchiveError(f"{what}: data_offsets: {quote(offs, 100)} is not [begin, end]")
    begin, end = offs
    if end < begin:
        raise BadArchiveError(f"{what}: data_offsets: end {end} < begin {begin}")
    raise BadArchiveError(f"{what}: data_offsets: end {end} is past the data area ({data_len} bytes)")


def parse_header(
    buf: Any, size: int, where: str, file: int = 0
) -> tuple[dict[str, TensorSpec], dict[str, str]]:
    """Validated ``({name: spec}, metadata)`` of the safetensors bytes ``buf`` (``size`` long).

    ``buf`` supports slicing to bytes-like objects (a numpy uint8 array or ``bytes``).
    Specs keep the header's order; their offsets are absolute in the file.
    """
    with no_gc():  # a header of 100k+ entries: the collector's passes would triple the time
        return _parse_header(buf, size, where, file)


def _parse_header(buf: Any, size: int, where: str, file: int) -> tuple[dict[str, TensorSpec], dict[str, str]]:
    raw = _header_bytes(buf, size, where)
    if len(raw) > SMALL_HEADER:  # (a small one: the json path, which decides for the fast one anyway)
        fast = _fast_header(raw, 8 + len(raw), size, file)
        if fast is not None:
            return fast
    return _slow_header(raw, size, where, file)


#: Headers of at most this many bytes (~10-15 tensors) are parsed by :func:`_slow_header`: its
#: ~2 us a tensor beat the fast path's ~20 us of numpy calls (one tensor: 6 us against 20).
SMALL_HEADER = 1024


def _header_bytes(buf: Any, size: int, where: str) -> bytes:
    """The JSON header's bytes, its length and framing checked."""
    if size < 8:
        raise _fail(where, f"{size} bytes: too short for the 8-byte header length")
    (n,) = struct.unpack("<Q", bytes(buf[:8]))
    if n > MAX_HEADER_SIZE:
        raise _fail(where, f"header length {n} exceeds safetensors' limit of {MAX_HEADER_SIZE} bytes")
    if 8 + n > size:
        raise _fail(where, f"header length {n} runs past the end of the file ({size} bytes)")
    raw = bytes(buf[8 : 8 + n])
    if not raw.startswith(b"{"):
        raise _fail(where, f"header does not start with '{{': {raw[:16]!r}")
    return raw


def _slow_header(
    raw: bytes, size: int, where: str, file: int
) -> tuple[dict[str, TensorSpec], dict[str, str]]:
    """The header parsed with :mod:`json` and checked entry by entry: any header, and the
    error that names what is wrong."""
    n = len(raw)
    try:
        header = json.loads(raw.decode("utf-8"), object_pairs_hook=_object)
    except (UnicodeDecodeError, ValueError, RecursionError) as exc:
        raise _fail(where, f"header is not valid JSON: {exc}") from None
    if not isinstance(header, dict):
        raise _fail(where, "header is not a JSON object")
    metadata = header.pop("__metadata__", {})
    if metadata is None:
        metadata = {}
    if not isinstance(metadata, dict) or not all(isinstance(v, str) for v in metadata.values()):
        raise _fail(
            where, f"__metadata__ must be an object of strings to strings, found {quote(metadata, 200)}"
        )
    data_start = 8 + n
    data_len = size - data_start
    specs: dict[str, TensorSpec] = {}
    extents: list[tuple[int, int, str]] = []
    fields = _FIELDS
    dtypes = DTYPES
    for name, info in header.items():  # the common case first; _explain() names what is wrong
        if type(info) is not dict or len(info) != 3 or info.keys() != fields:
            _explain(name, info, where)
        dtype = dtypes.get(info["dtype"]) if type(info["dtype"]) is str else None
        shape = info["shape"]
        offs = info["data_offsets"]
        if dtype is None or type(shape) is not list or type(offs) is not list or len(offs) != 2:
            _explain(name, info, where)
            raise AssertionError  # _explain raised
        begin, end = offs
        if type(begin) is not int or type(end) is not int or not 0 <= begin <= end <= data_len:
            _explain(name, info, where, data_len)
        numel = 1
        for d in shape:
            if type(d) is not int or d < 0:
                _explain(name, info, where)
            numel *= d
        if end - begin != numel * dtype.itemsize:
            raise BadArchiveError(
                f"{where}: tensor {quote(name)}: data_offsets: {end - begin} bytes, but "
                f"{info['dtype']} of shape {shape} needs {numel * dtype.itemsize}"
            )
        shape = tuple(shape)
        if not numel or len(shape) > MAX_NDIM:  # else the bytes, inside the file, bound the shape
            check_shape(shape, None, dtype.itemsize, f"{where}: tensor {quote(name)}")
        specs[name] = TensorSpec(
            name, dtype, shape, None, file, data_start + begin, end - begin, info["dtype"]
        )
        extents.append((begin, end, name))
    extents.sort()
    pos = 0
    for begin, end, name in extents:
        if begin != pos:
            why = "overlaps the previous tensor" if begin < pos else f"leaves a gap after offset {pos}"
            raise BadArchiveError(f"{where}: tensor {quote(name)}: data_offsets: begins at {begin}, {why}")
        pos = end
    if pos != data_len:
        raise BadArchiveError(
            f"{where}: tensors end at data offset {pos}, the data area has {data_len} bytes"
        )
    return specs, metadata


# -- the fast path: a header as safetensors' own writer lays it out ---------------------------------
#
# ``{"__metadata__":{...},"name":{"dtype":"F16","shape":[2,3],"data_offsets":[0,12]},...}`` with no
# whitespace (but after the closing brace), no escapes in names, the fields in this order and ints
# of at most 18 digits. One compiled pass (formats/safetensors_scan.py; with the kernels off, one
# regex pass and a tiling check) pulls every entry's fields out, the checks run on
# numpy columns and on the few distinct dtype/shape texts. Anything else, and any header that
# fails a check, goes to _slow_header(), which accepts or names the error exactly as before.

_INT = r"(?:0|[1-9][0-9]{0,17})"
_ENTRY = re.compile(
    r'"([^"\\\x00-\x1f]*)":\{"dtype":"([A-Z0-9_]{1,16})","shape":\[((?:'
    + _INT
    + r"(?:,"
    + _INT
    + r')*)?)\],"data_offsets":\[('
    + _INT
    + r"),("
    + _INT
    + r")\]\}(?:,|\Z)"
)
#: Characters of an entry that are not in its five captured fields.
_FIXED = len('"":{"dtype":"","shape":[],"data_offsets":[,]}')
_META = '{"__metadata__":'
_DECODER = json.JSONDecoder(object_pairs_hook=_object)


def _fast_header(
    raw: bytes, data_start: int, size: int, file: int
) -> tuple[dict[str, TensorSpec], dict[str, str]] | None:
    """The header's specs and metadata, or None when the header is not in the writer's own
    layout or fails a check (then :func:`_slow_header` decides)."""
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError:
        return None
    end = len(text.rstrip(" \t\n\r")) - 1
    if end < 1 or text[end] != "}":
        return None
    metadata: dict[str, str] = {}
    start = 1
    if text.startswith(_META):
        try:
            meta, start = _DECODER.raw_decode(text, len(_META))
        except (ValueError, RecursionError):
            return None
        if type(meta) is not dict or not all(type(v) is str for v in meta.values()):
            return None
        metadata = meta
        if start >= end or text[start] != ",":  # (no tensors: the slow path is as fast)
            return None
        start += 1
    body = text[start:end]
    if "\\" in body:  # an escape in a name: json decodes it
        return None
    got = _entries(body)
    if got is None:
        return None
    names, tnames, shape_texts, begins, ends = got
    n = len(names)
    if "__metadata__" in metadata or len(set(names)) != n or "__metadata__" in names:
        return None
    dtypes_of = {t: DTYPES.get(t) for t in set(tnames)}
    if None in dtypes_of.values():
        return None
    shapes_of: dict[str, tuple[int, ...]] = {}
    numel_of: dict[str, int] = {}
    for text_ in set(shape_texts):
        shape = tuple(map(int, text_.split(","))) if text_ else ()
        numel = math.prod(shape)
        if len(shape) > MAX_NDIM or numel >= 1 << 62 or (not numel and not _shape_ok(shape)):
            return None
        shapes_of[text_] = shape
        numel_of[text_] = numel
    sizes = {t: d.itemsize for t, d in dtypes_of.items() if d is not None}
    itemsize = np.array(list(map(sizes.__getitem__, tnames)), dtype=np.int64)
    numels = np.array(list(map(numel_of.__getitem__, shape_texts)), dtype=np.int64)
    nbytes = ends - begins
    if not np.array_equal(nbytes, numels * itemsize):  # numel < 2**62, itemsize <= 16: no overflow
        return None
    order = np.lexsort((ends, begins))
    b_sorted, e_sorted = begins[order], ends[order]
    if (
        b_sorted[0] != 0
        or e_sorted[-1] != size - data_start
        or not np.array_equal(b_sorted[1:], e_sorted[:-1])
    ):
        return None
    specs = make_specs(
        names,
        list(map(dtypes_of.__getitem__, tnames)),
        list(map(shapes_of.__getitem__, shape_texts)),
        file,
        (begins + data_start).tolist(),
        nbytes.tolist(),
        tnames,
    )
    return specs, metadata


def _entries(body: str) -> tuple[Any, Any, Any, np.ndarray, np.ndarray] | None:
    """``(names, dtype texts, shape texts, begins, ends)`` of the entries that tile ``body``, or
    None: one compiled pass (:func:`~tdz_numba.formats.safetensors_scan.entries`) with the
    kernels on, else one regex pass and a check that the matches tile the body (the same result)."""
    if use_kernels(len(body) >> 6):
        from .safetensors_scan import entries  # imports Numba

        return entries(body)
    found = _ENTRY.findall(body)
    n = len(found)
    if not n:
        return None
    names, tnames, shape_texts, begin_texts, end_texts = zip(*found)
    matched = n * _FIXED + (n - 1) + sum(map(len, names)) + sum(map(len, tnames))
    matched += sum(map(len, shape_texts)) + sum(map(len, begin_texts)) + sum(map(len, end_texts))
    if matched != len(body):  # the entries must tile the body (see test_fast_header_tiles)
        return None
    begins = np.fromiter(map(int, begin_texts), np.int64, n)
    ends = np.fromiter(map(int, end_texts), np.int64, n)
    return names, tnames, shape_texts, begins, ends


def _shape_ok(shape: tuple[int, ...]) -> bool:
    try:
        check_shape(shape, None, 16, "")
    except BadArchiveError:
        return False
    return True


def open_safetensors(path: str | os.PathLike, **options: Any) -> TreeSource:
    """One ``.safetensors`` file as a flat :class:`~tdz_numba.tdz.sources.TreeSource`
    (keys: the file's tensor names; ``metadata``: its ``__metadata__``)."""
    f = MappedFile.open(path)
    try:
        specs, metadata = parse_header(f.buffer, f.size, str(f.path))
    except BaseException:
        f.close()
        raise
    return flat_source("safetensors", path, specs, files=[f], metadata=dict(metadata))


def _shard_path(root: Path, name: Any, where: str) -> Path:
    if not isinstance(name, str) or not name or "/" in name or "\\" in name or name in (".", ".."):
        raise BadArchiveError(
            f"{where}: weight_map names shard {quote(name)}: not a file name in the same directory"
        )
    return root / name


def index_claims(index: Any, where: str) -> tuple[dict[str, str], dict[str, Any]]:
    """The ``weight_map`` and ``metadata`` of a parsed ``*.safetensors.index.json``, checked:
    an object whose ``weight_map`` values are shard names (str) and whose metadata is an object
    (the local and the remote sharded readers)."""
    if not isinstance(index, dict) or not isinstance(index.get("weight_map"), dict):
        raise BadArchiveError(f"{where}: an index must be a JSON object with a 'weight_map' object")
    wmap: dict[str, Any] = index["weight_map"]
    for key, shard in wmap.items():
        if not isinstance(shard, str):
            raise BadArchiveError(
                f"{where}: weight_map value for {quote(key)} must be a shard file name, "
                f"found {type(shard).__name__} {quote(shard)}"
            )
    meta = index.get("metadata") or {}
    if not isinstance(meta, dict):
        raise BadArchiveError(f"{where}: 'metadata' must be an object, found {quote(meta, 100)}")
    return wmap, meta


def join_shards(
    per_shard: dict[str, dict[str, TensorSpec]], wmap: dict[str, str], where: str
) -> dict[str, TensorSpec]:
    """One flat name space over the shards' tensors: every ``weight_map`` name in its shard,
    every shard tensor in the map, no name in two shards."""
    owner: dict[str, str] = {}
    for name, specs in per_shard.items():
        for key in specs:
            if key in owner:
                raise BadArchiveError(
                    f"{where}: tensor {quote(key)} is in shards {quote(owner[key])} and {quote(name)}"
                )
            owner[key] = name
    tree: dict[str, TensorSpec] = {}
    for key, shard in wmap.items():
        spec = per_shard[shard].get(key)
        if spec is None:
            raise BadArchiveError(
                f"{where}: weight_map puts {quote(key)} in {quote(shard)}, which does not hold it"
            )
        tree[key] = spec
    extra = [k for k in owner if k not in wmap]
    if extra:
        raise BadArchiveError(
            f"{where}: shard {quote(owner[extra[0]])} holds {quote(extra[0])}, which weight_map does not list"
        )
    return tree


def open_sharded(path: str | os.PathLike, **options: Any) -> TreeSource:
    """A sharded checkpoint: ``path`` is its ``*.safetensors.index.json`` or a directory
    holding exactly one. One flat name space over every shard, each shard mapped once;
    every name of the ``weight_map`` must be in its shard, and every shard tensor in the map."""
    p = Path(path)
    if p.is_dir():
        found = sorted(p.glob("*.safetensors.index.json"))
        if len(found) != 1:
            raise UnsupportedError(f"{p}: expected one *.safetensors.index.json, found {len(found)}")
        p = found[0]
    where = str(p)
    wmap, meta = index_claims(read_json_file(p), where)
    shard_names = list(dict.fromkeys(wmap.values()))
    files: list[MappedFile] = []
    metadata: dict[str, Any] = {}
    try:
        per_shard: dict[str, dict[str, TensorSpec]] = {}
        for i, name in enumerate(shard_names):
            sp = _shard_path(p.parent, name, where)
            try:  # inside the index's folder, a regular file, no symlink leading out
                f = MappedFile(
                    sp, *map_inside(p.parent, name, where=where, entry=f"shard {quote(name)}"), False
                )
            except MemberMissingError:
                raise BadArchiveError(f"{where}: shard {quote(name)} does not exist") from None
            files.append(f)
            specs, smeta = parse_header(f.buffer, f.size, str(sp), file=i)
            metadata.update(smeta)
            per_shard[name] = specs
        tree = join_shards(per_shard, wmap, where)
    except BaseException:
        for f in files:
            f.close()
        raise
    metadata.update(meta)
    return flat_source("safetensors", p, tree, files=files, metadata=metadata)
