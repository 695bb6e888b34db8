"""What ``tdz info`` / ``tree`` / ``show`` report, as JSON-able dicts (the CLI prints them).

Every function opens the file with :func:`tdz_numba.open`, so every readable
format works: a ``.tdz`` archive reports its zip entries, codecs and 64-byte
alignment; other formats report their leaves, bytes and how many are zero-copy.

Examples
--------
>>> import tempfile, pathlib, torch, tdz_numba
>>> from tdz_numba.cli.report import info_dict, show_dict, tree_dict
>>> with tempfile.TemporaryDirectory() as d:
...     p = tdz_numba.save({"a": {"b": torch.arange(4.0)}, "tag": "x"}, pathlib.Path(d) / "x.tdz")
...     print(info_dict(p)["leaves"], [c["key"] for c in tree_dict(p)["children"]],
...           show_dict(p, "a/b")["stats"]["mean"])
1 ['a', 'tag'] 1.5
"""

from __future__ import annotations

import json
import math
import os
from typing import Any

from ..errors import InvalidArgumentError, MissingKeyError

__all__ = [
    "info_dict",
    "tree_dict",
    "node_dict",
    "level_dict",
    "show_dict",
    "float_stats",
    "int_stats",
    "SHOW_VALUES",
    "json_float",
    "jsonable",
]

SHOW_VALUES = 8  # leading values printed by `tdz show`
_STATS_CHUNK = 1 << 20  # float elements converted to float64 at a time
_MAX_NESTED_SHAPES = 20


def jsonable(value: Any) -> Any:
    """``value`` if JSON can hold it, else its ``repr``."""
    try:
        json.dumps(value)
    except (TypeError, ValueError):
        return repr(value)
    return value


def json_float(x: float) -> float | str:
    """``x``, or ``"nan"`` / ``"inf"`` / ``"-inf"`` (JSON has no non-finite numbers)."""
    return x if math.isfinite(x) else repr(float(x))


def _dtype_name(dtype: Any) -> str:
    return str(dtype).replace("torch.", "")


#: The files' own names of plain uint8 (any other name on a uint8 leaf: quantized blocks).
_UINT8_NAMES = frozenset({"U8", "UINT8", "|U1", "<U1", "UINT8_T", "TORCH.UINT8", "B"})


def is_quantized(dtype: Any, type_name: str) -> bool:
    """Whether a leaf exposed as uint8 holds blocks of another type (GGUF ``Q4_K``, ...).

    Examples
    --------
    >>> import torch
    >>> is_quantized(torch.uint8, "Q4_K"), is_quantized(torch.uint8, "U8"), is_quantized(torch.float32, "F32")
    (True, False, False)
    """
    return _dtype_name(dtype) == "uint8" and bool(type_name) and type_name.upper() not in _UINT8_NAMES


def dtype_label(dtype: Any, type_name: str = "") -> str:
    """torch's name of a dtype; quantized blocks add the file's type: ``uint8 (Q4_K)``."""
    name = _dtype_name(dtype)
    return f"{name} ({type_name})" if is_quantized(dtype, type_name) else name


# -- info ------------------------------------------------------------------------------------


def info_dict(path: str | os.PathLike) -> dict[str, Any]:
    """What ``tdz info`` reports, as a dict (``format`` names the file's format)."""
    import tdz_numba

    ar = tdz_numba.open(path)
    try:
        if ar.format != "tdz":
            return _info_other(ar, path)
        from ..zipfmt import records

        index = ar.source.index  # type: ignore[attr-defined]  # format "tdz": a TdzSource
        remote = getattr(index, "fetch", None) is not None  # a URL: its local headers are not read
        if not remote:
            index.check_all()  # payload offsets of every entry
        names = index.names
        table = index.table
        methods: dict[str, int] = {}
        for m in table["method"].tolist():
            name = records.METHOD_NAMES.get(int(m), f"method {m}")
            methods[name] = methods.get(name, 0) + 1
        memmaps = [i for i, n in enumerate(names) if n.endswith(".memmap")]
        method, payload = table["method"], table["payload_offset"]
        # only a STORED payload is mapped in place: a compressed one is decoded into new memory,
        # so alignment means nothing for it
        stored_memmaps = [i for i in memmaps if int(method[i]) == records.STORED]
        unread = sum(int(payload[i]) < 0 for i in stored_memmaps)  # (remote: offsets not read)
        misaligned = [
            names[i] for i in stored_memmaps if int(payload[i]) % records.ALIGNMENT and payload[i] >= 0
        ]
        compressed = len(memmaps) - len(stored_memmaps)
        misaligned_stored = len(misaligned)
        dtypes: dict[str, int] = {}
        for _, spec in ar.leaves():
            name = dtype_label(getattr(spec, "dtype", "?"))
            dtypes[name] = dtypes.get(name, 0) + 1
        leaves = sum(dtypes.values())
        return {
            "path": str(path),
            "format": "tdz",
            "root_type": ar.type_name,
            "batch_size": ar.batch_size,
            "entries": len(names),
            "levels": sum(1 for n in names if n == "meta.json" or n.endswith("/meta.json")),
            "leaves": leaves,
            "file_bytes": int(index.size),
            "payload_bytes": int(table["size"].sum()),
            "stored_bytes": int(table["csize"].sum()),
            "compression": methods,
            "alignment": records.ALIGNMENT,
            "memmap_entries": len(memmaps),
            "memmap_stored": len(stored_memmaps),
            "memmap_aligned": len(stored_memmaps) - len(misaligned) - unread,
            "all_aligned": not misaligned if not unread else None,  # None: not read (a URL)
            "alignment_unread": unread,
            "dtypes": dtypes,
            "misaligned": misaligned[:20],
            "misaligned_stored": misaligned_stored,
            "memmap_compressed": compressed,
            "metadata": jsonable(ar.metadata),
        }
    finally:
        ar.close()


def _info_other(ar: Any, path: str | os.PathLike) -> dict[str, Any]:
    codecs: dict[str, int] = {}
    dtypes: dict[str, int] = {}
    leaves = zero = payload = stored = 0
    levels = 0
    stack = [ar]
    while stack:
        node = stack.pop()
        levels += 1
        for spec in node.level_info().children.values():
            if spec.kind == "leaf":
                info = node._leaf_info(spec.leaf)
                leaves += 1
                zero += bool(info.zero_copy)
                payload += info.nbytes
                stored += info.stored_nbytes
                codecs[info.compression] = codecs.get(info.compression, 0) + 1
                name = dtype_label(info.dtype, info.type_name)  # torch's name, then the file's own
                if info.type_name and not is_quantized(info.dtype, info.type_name):
                    name += f" ({info.type_name})"
                dtypes[name] = dtypes.get(name, 0) + 1
            elif spec.kind == "level":
                stack.append(node.sublevel(spec))
    file_bytes = sum(int(f.size) for f in ar.source.files) or os.path.getsize(path)
    return {
        "path": str(path),
        "format": ar.format,
        "root_type": ar.type_name,
        "batch_size": ar.batch_size,
        "entries": leaves,
        "levels": levels,
        "leaves": leaves,
        "file_bytes": file_bytes,
        "files": len(ar.source.files),
        "payload_bytes": payload,
        "stored_bytes": stored,
        "compression": codecs,
        "dtypes": dtypes,
        "zero_copy_leaves": zero,
        "metadata": jsonable(ar.metadata),
    }


# -- tree ------------------------------------------------------------------------------------


def node_dict(
    owner: Any,
    key: str,
    spec: Any,
    path: str,
    depth: int,
    max_depth: int | None,
    budget: list[int] | None = None,
) -> dict[str, Any]:
    """The JSON-able description of one child ``spec`` (named ``key``) of the level ``owner``."""
    from ..archive.display import level_value, nested_shape_text
    from ..tdz.tree import PickledData, RawFile

    if spec.kind == "leaf":
        info = owner._leaf_info(spec.leaf)
        d = {
            "key": key,
            "path": path,
            "kind": "leaf",
            "dtype": _dtype_name(info.dtype),
            "shape": list(info.shape),
            "nbytes": info.nbytes,
            "stored_nbytes": info.stored_nbytes,
            "codec": info.compression,
            "offset": info.offset,
            "crc": None if info.crc is None else f"{info.crc:#010x}",
            "nested": info.nested,
            "entry": info.entry,
            "zero_copy": info.zero_copy,
        }
        if info.type_name and not info.type_name.startswith("torch."):
            d["type_name"] = info.type_name
            d["quantized"] = is_quantized(info.dtype, info.type_name)
        if info.nested:
            shapes = owner._state.source.nested_shapes(spec.leaf)
            if shapes is not None:
                d["shape_text"] = nested_shape_text(shapes)
                d["nested_shapes"] = shapes[:_MAX_NESTED_SHAPES]
        return d
    if spec.kind == "value":
        return {"key": key, "path": path, "kind": "value", "value": jsonable(spec.leaf)}
    if spec.kind == "file":
        value = owner._value(spec)
        kind = "pickle" if isinstance(value, PickledData) or not isinstance(value, RawFile) else "file"
        nbytes = len(value.data) if isinstance(value, RawFile) else len(owner.file_bytes(spec))
        return {"key": key, "path": path, "kind": kind, "nbytes": nbytes}
    sub = owner._sub(spec.path)
    shown, value = level_value(sub)
    if shown:
        d = {"key": key, "path": path, "kind": "value", "value": jsonable(value)}
        if not sub._plain_value()[0]:
            d["type"] = sub.type_name
        return d
    return level_dict(sub, key, path, depth, max_depth, budget)


def level_dict(
    level: Any, key: str, path: str, depth: int, max_depth: int | None, budget: list[int] | None = None
) -> dict[str, Any]:
    """The JSON-able description of a level and (up to ``max_depth``) what is below it.

    ``budget`` (a one-item list) is how many more children may be described in all: once
    spent, a level lists the children it got to and ``"more"`` counts the others."""
    from ..archive.display import children_of

    children = children_of(level)
    d: dict[str, Any] = {
        "key": key,
        "path": path,
        "kind": "level",
        "type": level.type_name,
        "batch_size": level.batch_size,
        "keys": len(children),
    }
    if max_depth is not None and depth >= max_depth:
        d["children"] = None  # not expanded (--depth)
        return d
    out: list[dict[str, Any]] = []
    for i, (k, spec, owner) in enumerate(children):
        if budget is not None:
            if budget[0] <= 0:
                d["more"] = len(children) - i
                break
            budget[0] -= spec.kind != "level"  # levels are free: the leaves below them count
        out.append(node_dict(owner, k, spec, f"{path}/{k}" if path else k, depth + 1, max_depth, budget))
    d["children"] = out
    return d


def tree_dict(
    path: str | os.PathLike,
    subpath: str | None = None,
    depth: int | None = None,
    max_leaves: int | None = None,
) -> dict[str, Any]:
    """What ``tdz tree`` reports: the nested description of the file (or of ``subpath``), with at
    most ``max_leaves`` leaves and values (None: all; each level cut short says how many it has
    ``"more"``, and the top ``"truncated": True``)."""
    import tdz_numba

    if depth is not None and depth < 0:
        raise InvalidArgumentError("--depth must be >= 0")
    ar = tdz_numba.open(path)
    try:
        sub = (subpath or "").strip("/")
        budget = None if max_leaves is None else [max_leaves]
        if not sub:
            d = level_dict(ar, "", "", 0, depth, budget)
            d["format"] = ar.format
        else:
            node, spec = ar._resolve(sub)
            d = node_dict(node, sub, spec, sub, 0, depth, budget)
            d["key"] = sub
        if budget is not None and budget[0] <= 0 and _cut_short(d):
            d["truncated"] = True
        return d
    finally:
        ar.close()


def _cut_short(d: dict[str, Any]) -> bool:
    """Whether a level of the description says it has ``"more"`` children than it lists."""
    stack = [d]
    while stack:
        node = stack.pop()
        if node.get("more"):
            return True
        stack.extend(node.get("children") or [])
    return False


# -- show ------------------------------------------------------------------------------------


def _flat_values(t: Any) -> Any:
    """All values of a (possibly nested) tensor as one 1-D tensor (a view when possible)."""
    import torch

    if t.is_nested:
        parts = [x.reshape(-1) for x in t.unbind()]
        return torch.cat(parts) if parts else torch.empty(0, dtype=t.dtype)
    return t.reshape(-1)


def float_stats(flat: Any) -> dict[str, Any]:
    """min/max/mean/std (population, ddof=0) in float64 over the non-NaN values, and the NaN count.

    Chunked (Chan et al.'s pairwise update), so that a large leaf is never
    copied to float64 whole.
    """
    import torch

    count, mean, m2, nan = 0, 0.0, 0.0, 0
    lo, hi = math.inf, -math.inf
    for start in range(0, flat.numel(), _STATS_CHUNK):
        c = flat[start : start + _STATS_CHUNK].to(torch.float64)
        isnan = torch.isnan(c)
        k = int(isnan.sum())
        if k:
            nan += k
            c = c[~isnan]
        m = c.numel()
        if m == 0:
            continue
        lo, hi = min(lo, c.min().item()), max(hi, c.max().item())
        cmean = c.mean().item()
        cm2 = (c - cmean).square_().sum().item() if math.isfinite(cmean) else math.nan
        delta, total = cmean - mean, count + m
        mean = mean + delta * m / total if count else cmean
        m2 = m2 + cm2 + (delta * delta * count * m / total if count else 0.0)
        count = total
    if count == 0:
        return {"count": 0, "nan": nan, "min": None, "max": None, "mean": None, "std": None}
    std = math.sqrt(m2 / count) if m2 >= 0 else math.nan  # nan stays nan (infinite values)
    return {"count": count, "nan": nan, "min": lo, "max": hi, "mean": mean, "std": std}


def int_stats(flat: Any) -> dict[str, Any]:
    """min/max (exact, in the leaf's dtype) and mean (float64) of an integer or bool leaf."""
    import numpy as np

    a = flat.contiguous().numpy()
    if a.size == 0:
        return {"count": 0, "min": None, "max": None, "mean": None}
    lo, hi = a.min().item(), a.max().item()
    return {"count": int(a.size), "min": lo, "max": hi, "mean": float(a.mean(dtype=np.float64))}


def _leaf_values(flat: Any, n: int) -> list[Any]:
    import torch

    head = flat[:n]
    if head.is_floating_point():
        return head.to(torch.float64).tolist()
    if head.is_complex():
        return [f"{v.real:.6g}{v.imag:+.6g}j" for v in head.to(torch.complex128).tolist()]
    if head.dtype == torch.bool:
        return [bool(v) for v in head.tolist()]
    return [int(v) for v in head.contiguous().numpy().tolist()]


def show_dict(path: str | os.PathLike, key: str, values: int = SHOW_VALUES) -> dict[str, Any]:
    """What ``tdz show`` reports about one leaf (or plain value, or non-tensor data), as a dict.

    Raises :class:`~tdz_numba.InvalidArgumentError` when ``key`` is empty or a
    level (use :func:`tree_dict`), :class:`~tdz_numba.MissingKeyError` when absent.
    """
    import tdz_numba
    from tdz_numba import Archive

    from ..archive.display import level_value
    from ..tdz.tree import RawFile

    ar = tdz_numba.open(path)
    try:
        key = key.strip("/")
        if not key:
            raise InvalidArgumentError(f"{path}: KEY is empty; use `tdz tree {path}` for the whole archive")
        node, spec = ar._resolve(key)
        if spec.kind != "leaf":
            value = node._value(spec)
            if isinstance(value, Archive):
                shown, data = level_value(value)
                if shown:
                    return {
                        "path": str(path),
                        "key": key,
                        "kind": "value",
                        "type": value.type_name,
                        "value": jsonable(data),
                    }
                raise InvalidArgumentError(
                    f"{path}: {key!r} is a level ({value.type_name}, {len(value)} keys), "
                    f"not a leaf; use `tdz tree {path} {key}`"
                )
            if isinstance(value, RawFile):
                return {
                    "path": str(path),
                    "key": key,
                    "kind": "file",
                    "entry": spec.path,
                    "nbytes": len(value.data),
                }
            return {"path": str(path), "key": key, "kind": "value", "value": jsonable(value)}
        info = node._leaf_info(spec.leaf)
        t = node._value(spec)
        flat = _flat_values(t)
        numel = int(flat.numel())
        d: dict[str, Any] = {
            "path": str(path),
            "key": key,
            "kind": "leaf",
            "entry": info.entry,
            "dtype": _dtype_name(info.dtype),
            "shape": list(info.shape),
            "numel": numel,
            "nested": info.nested,
            "nbytes": info.nbytes,
            "stored_nbytes": info.stored_nbytes,
            "offset": info.offset,
            "aligned": None if info.offset is None else info.offset % 64 == 0,
            "compression": info.compression,
            "crc": None if info.crc is None else f"{info.crc:#010x}",
            "zero_copy": info.zero_copy,
            "values": _leaf_values(flat, values),
        }
        if info.type_name and not info.type_name.startswith("torch."):
            d["type_name"] = info.type_name
        if info.location is not None:
            d["file"] = info.location.file
        if info.nested:
            d["nested_shapes"] = [list(x.shape) for x in t.unbind()[:values]]
        if flat.is_floating_point():
            d["stats"] = float_stats(flat)
        elif flat.is_complex():
            d["stats"] = None
        else:
            d["stats"] = int_stats(flat)
        return d
    except MissingKeyError:
        raise
    finally:
        ar.close()
