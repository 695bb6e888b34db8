"""tensordict integration: tdz_numba as the ``.tdz`` archive backend of tensordict.

* :func:`save` writes any tensordict collection (same bytes as ``td.save(path)``
  apart from zip timestamps);
* :func:`load` reads an archive back as the class ``TensorDict.load_memmap``
  returns, with leaves as zero-copy views into one mapping of the file;
* :func:`enable` / :func:`disable` / :func:`enabled` make tensordict's own API
  (``save``/``dumps``/``memmap``/``memmap_like`` to a ``.tdz``,
  ``load_memmap``/``load`` of an archive, ``pack_memmap``, ``unpack_memmap``,
  ``is_memmap_archive``, ``refresh_archive_checksums``) use tdz_numba.

tensordict is imported lazily, inside the functions. No class named in an
archive is ever imported by :func:`load`.

Examples
--------
>>> import tempfile, pathlib, torch
>>> from tensordict import TensorDict
>>> import tdz_numba.tensordict as tdt
>>> td = TensorDict(a=torch.arange(3), batch_size=[3])
>>> with tempfile.TemporaryDirectory() as d:
...     p = tdt.save(td, pathlib.Path(d) / "x.tdz")
...     print(type(tdt.load(p)).__name__, tdt.load(p)["a"].tolist())
TensorDict [0, 1, 2]
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import pickle
import sys
import threading
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from .errors import InvalidArgumentError, InvalidTreeError, TdzError, UnsafeContentError, UnsupportedError

__all__ = ["save", "load", "enable", "disable", "enabled", "is_enabled", "TensordictNotInstalledError"]

SUPPORTED_PREFIX = "0.15."


class TensordictNotInstalledError(TdzError, ImportError):  # type: ignore[misc]  # both define .path (str | None)
    """tensordict is needed for :mod:`tdz_numba.tensordict` but is not installed."""


def _tensordict():
    try:
        import tensordict
    except ImportError as exc:
        raise TensordictNotInstalledError(
            "tdz_numba.tensordict needs the tensordict package: pip install 'tensordict==0.15.*'"
        ) from exc
    return tensordict


# ---------------------------------------------------------------------------
# save
# ---------------------------------------------------------------------------
def save(
    td: Any,
    path: str | os.PathLike,
    *,
    compression: str | None = None,
    compresslevel: int | None = None,
    existsok: bool = True,
    num_threads: int | None = None,
    allow_pickle: bool = False,
    durable: bool = True,
) -> Path:
    """Writes a tensordict collection to a ``.tdz`` archive, as ``td.save(path)`` does.

    Non-JSON non-tensor data is pickled as tensordict pickles it only with
    ``allow_pickle=True``; otherwise :class:`~tdz_numba.InvalidTreeError`.
    ``durable``: ``fsync`` before and after the rename, as :func:`tdz_numba.save`.
    """
    _tensordict()
    from . import api
    from .tdcompat import level_from_tensordict

    level = level_from_tensordict(td, allow_pickle=allow_pickle)
    if level is None:
        raise InvalidTreeError(f"expected a tensordict collection, got {type(td).__name__}")
    return api.save(
        level,
        path,
        compression=compression,
        compresslevel=compresslevel,
        existsok=existsok,
        num_threads=num_threads,
        durable=durable,
    )


# ---------------------------------------------------------------------------
# load
# ---------------------------------------------------------------------------
def _lookup(module: str, qualname: str) -> Any:
    """``module:qualname`` among already-imported modules (never imports)."""
    if not module or not qualname or "<locals>" in qualname:
        return None
    obj = sys.modules.get(module)
    if obj is None:
        return None
    for part in qualname.split("."):
        obj = getattr(obj, part, None)
        if obj is None:
            return None
    return obj


class _Ctx:
    def __init__(
        self,
        device: Any,
        allow_pickle: bool | None,
        allowed_classes: tuple,
        path: Any,
        pickle_default: str = "refuse",
    ) -> None:
        import torch

        self.device = torch.device(device) if device is not None else None
        fake = torch._guards.active_fake_mode()
        self.no_data = bool(fake) or (self.device is not None and self.device.type == "meta")
        self.allow_pickle = allow_pickle
        # allow_pickle=None: "refuse" for direct calls; "warn" (load with a FutureWarning, as
        # tensordict 0.15 does) only for tensordict's own load_memmap while enable() is on
        self.pickle_default = pickle_default
        self.allowed = tuple(allowed_classes)
        self.path = path
        self.cache: dict[tuple[Any, Any], type] = {}
        self.tensors: dict[str, Any] = {}  # entry -> tensor, from one bulk pass

    def resolve(self, meta: dict) -> type:
        class_id = meta.get("_class")
        type_name = meta.get("_type")
        key = (class_id, type_name)
        cls = self.cache.get(key)
        if cls is None:
            cls = self.cache[key] = self._resolve(class_id, type_name)
        return cls

    def _resolve(self, class_id: Any, type_name: Any) -> type:
        from tensordict import TensorDict, TensorDictBase
        from tensordict._td_memmap import _class_id
        from tensordict.tensorclass import is_tensorclass  # type: ignore[attr-defined]  # not re-exported

        if class_id is None and type_name is None:
            return TensorDict
        for c in self.allowed:
            if (class_id is not None and _class_id(c) == class_id) or str(c) == type_name:
                return c
        # classes tensordict registered itself (e.g. ``MetaData[str]``, made on first use)
        import tensordict.base as td_base

        for c in getattr(td_base, "_ACCEPTED_CLASSES", ()):
            if (class_id is not None and _class_id(c) == class_id) or str(c) == type_name:
                return c
        found = None
        if isinstance(class_id, str) and ":" in class_id:
            found = _lookup(*class_id.split(":", 1))
        name = None
        if found is None and isinstance(type_name, str) and type_name.startswith("<class '"):
            name = type_name[len("<class '") :].removesuffix("'>")
            parts = name.split(".")
            for i in range(len(parts) - 1, 0, -1):
                found = _lookup(".".join(parts[:i]), ".".join(parts[i:]))
                if found is not None:
                    break
        if found is None and name is not None:
            # qualname fallback, as tensordict falls back on the class load_memmap is called on
            found = next((c for c in self.allowed if name.endswith("." + c.__qualname__)), None)
        if found is None:
            shown = class_id if class_id is not None else name or type_name
            raise UnsupportedError(
                f"{self.path}: the archive names the class {shown!r}, which is not imported "
                f"(tdz_numba never imports a module named in a file): import it first or pass "
                f"it in allowed_classes"
            )
        if not (isinstance(found, type) and (issubclass(found, TensorDictBase) or is_tensorclass(found))):
            raise UnsupportedError(f"{self.path}: {class_id or type_name!r} is not a tensor collection class")
        return found

    def unpickle(self, node: Any, entry: str) -> Any:
        if self.allow_pickle is False or (self.allow_pickle is None and self.pickle_default != "warn"):
            raise UnsafeContentError(
                f"{self.path}: refusing to load pickled non-tensor data ({entry}). Pickle can "
                f"execute arbitrary code. Pass allow_pickle=True only when the saved data is trusted."
            )
        if self.allow_pickle is None:
            warnings.warn(
                "TensorDict.load_memmap is loading a pickled non-tensor field. This is only safe "
                "for trusted data. Starting with TensorDict 0.16, the default will change to "
                "allow_pickle=False. Pass allow_pickle=True to acknowledge trusted data or "
                "allow_pickle=False to reject pickle now.",
                FutureWarning,
                stacklevel=4,
            )
        return pickle.loads(node.file_bytes(entry))


def _json_types(node: Any, children: dict) -> dict | None:
    from tensordict.tensorclass import _JSON_TYPES, _JSON_TYPES_FILE  # type: ignore[attr-defined]  # private (0.15.3)

    spec = children.get(_JSON_TYPES_FILE)
    if spec is None or "other.pickle" not in children:
        return None
    saved = json.loads(node.file_bytes(spec))
    if hashlib.sha256(node.file_bytes(children["other.pickle"])).hexdigest() != saved.get("pickle_sha256"):
        return None
    types = {}
    for key, name in saved["types"].items():
        if name not in _JSON_TYPES:
            raise InvalidArgumentError(f"Unknown type name {name!r} for the field {key!r} in {spec.path}.")
        types[key] = _JSON_TYPES[name]
    return types


def _keyed_children(node: Any, meta: dict) -> tuple[bool, dict]:
    """The children of a level read as a TensorDict level (keys listed in meta.json)."""
    from .tree import TD_CLASS, describe_level

    index, prefix = node._index, node._prefix
    _, children = describe_level(
        {**meta, "_class": TD_CLASS},
        prefix,
        lambda: index.listing(prefix),
        lambda sub: sub + "meta.json" in index or index.is_dir(sub),
        node._where("meta.json"),
    )
    return True, {c.key: c for c in children}


def _build(node: Any, ctx: _Ctx) -> Any:
    import torch
    from tensordict import LazyStackedTensorDict, NonTensorStack, TensorDict
    from tensordict.tensorclass import NonTensorDataBase, is_tensorclass  # type: ignore[attr-defined]  # not re-exported

    from .dtypes import torch_dtype

    keyed, children, meta = node.level_info()
    cls = ctx.resolve(meta)
    if not keyed and issubclass(cls, TensorDict):
        keyed, children = _keyed_children(node, meta)  # a user subclass of TensorDict lists its keys
    if issubclass(cls, NonTensorStack) and meta.get("data") is not None:
        data = meta["data"]
        if isinstance(data, str):
            if data != "pickle.pkl" or "pickle.pkl" not in children:
                raise InvalidArgumentError(
                    f"Invalid pickled NonTensorStack filename in memmap metadata: {data!r}."
                )
            data = ctx.unpickle(node, children["pickle.pkl"].path)
        device = meta.get("device")
        return cls._from_list(data, device=torch.device(device) if device is not None else None)
    if issubclass(cls, LazyStackedTensorDict):
        members: list[Any] = []
        while (spec := children.get(str(len(members)))) is not None and spec.kind == "level":
            members.append(_build(node.sublevel(spec), ctx))
        result = cls(*members, stack_dim=meta["stack_dim"])
        if meta.get("stack_dim_name") is not None:
            result._td_dim_name = meta["stack_dim_name"]
        return result
    if is_tensorclass(cls):
        non_td = {k: v for k, v in meta.items() if k != "_type"}
        types = _json_types(node, children)
        if types is not None:
            non_td.update(types)
        elif "other.pickle" in children:
            non_td.update(ctx.unpickle(node, children["other.pickle"].path))
        spec = children.get("_tensordict")
        if spec is not None and spec.kind == "level":
            td = _build(node.sublevel(spec), ctx)
        else:
            if not issubclass(cls, NonTensorDataBase):
                raise InvalidArgumentError("The _tensordict directory seems to be missing.")
            td = TensorDict(device="cpu")
        return cls._from_tensordict(td, non_td, rebuild=False)  # type: ignore[attr-defined]  # a tensorclass type
    # a TensorDict level (other TensorDictBase classes load as TensorDict, as in tensordict)
    if not keyed:
        raise InvalidArgumentError(f"{node.where()}: a {cls.__name__} level must list its keys in meta.json")
    saved_device = meta.get("device", "None")
    saved_device = None if saved_device in ("None", None) else torch.device(saved_device)
    target = ctx.device
    leaves: dict[str, Any] = {}
    subs: list[tuple[str, Any]] = []
    missing = []
    tensors = ctx.tensors
    for key, spec in children.items():
        kind = spec.kind
        if kind == "leaf":
            if ctx.no_data:
                leaf = spec.leaf
                leaves[key] = torch.zeros(
                    leaf.shape, device=target, dtype=torch_dtype(leaf.dtype, entry=leaf.entry)
                )
                continue
            t = tensors.get(spec.path)
            if t is None:
                missing.append(spec)  # not reached by the bulk pass (a subclass listing its keys)
            elif target is not None:
                t = t.to(target, non_blocking=True)
            leaves[key] = t  # None keeps the key order
        elif kind == "level":
            subs.append((key, spec))
    if missing:  # all of them in one call
        for spec, t in zip(missing, node.leaf_tensors(missing)):
            leaves[spec.key] = t if target is None else t.to(target, non_blocking=True)
    batch_size = torch.Size(meta.get("shape", ()))
    device = saved_device if target is None else target
    if cls is TensorDict or not issubclass(cls, TensorDict):
        # tensordict sets loaded leaves with validated=True: no per-leaf check either
        result = TensorDict._new_unsafe(leaves, batch_size=batch_size, device=device, nested=False)  # type: ignore[arg-type]
    else:
        result = cls(leaves, batch_size=batch_size, device=device)
    names = meta.get("_names")
    if isinstance(names, list):
        result._set_names(names)
    for key, spec in subs:
        # validated as tensordict sets them (non-tensor data is expanded to the batch size)
        result._set_str(key, _build(node.sublevel(spec), ctx), inplace=False, validated=False)
    return result


def _bulk_tensors(node: Any) -> dict[str, Any]:
    """``{entry: tensor}`` of every leaf below ``node``, resolved in one bulk call."""
    from .bulk import materialize

    specs = []
    stack = [node]
    while stack:
        level = stack.pop()
        for spec in level.level_info().children.values():
            kind = spec.kind
            if kind == "leaf":
                specs.append(spec.leaf)
            elif kind == "level":
                stack.append(level.sublevel(spec))
    return {leaf.entry: t for leaf, t in zip(specs, materialize(node, specs))}


def _subpath_node(ar: Any, subpath: Any) -> Any:
    from .tree import encode_key

    if subpath is None:
        return ar
    if isinstance(subpath, str):
        parts = tuple(p for p in subpath.split("/") if p)
    else:
        from tensordict.utils import _unravel_key_to_tuple

        parts = _unravel_key_to_tuple(subpath)
        if not parts:
            raise InvalidArgumentError("subpath must be a string path or a (nested) tuple of strings.")
    node = ar
    for part in parts:
        keyed, children, _ = node.level_info()
        spec = children.get(part if keyed else encode_key(part))
        if spec is None and not keyed and part != "_tensordict" and "_tensordict" in children:
            # a tensorclass keeps its fields under _tensordict
            node = node.sublevel(children["_tensordict"])
            keyed, children, _ = node.level_info()
            spec = children.get(part)
        if spec is None or spec.kind != "level":
            raise InvalidArgumentError(f"No tensordict found under subpath {'/'.join(parts)!r} in {ar.path}.")
        node = node.sublevel(spec)
    return node


def load(
    path: str | os.PathLike,
    *,
    subpath: Any = None,
    mode: str | None = "r",
    device: Any = None,
    num_threads: int | None = None,
    allow_pickle: bool | None = None,
    allowed_classes: tuple = (),
    _pickle_default: str = "refuse",
) -> Any:
    """Loads an archive as ``TensorDict.load_memmap`` would, without importing anything.

    Returns a TensorDict, LazyStackedTensorDict, tensorclass instance,
    NonTensorData or NonTensorStack. Leaves are views into one mapping of the
    file (``mode="r"``: copy-on-write; ``"r+"``: writes reach the file).
    ``device="meta"`` reads no payload. Classes are looked up among imported
    modules and ``allowed_classes`` only (else :class:`~tdz_numba.UnsupportedError`).
    ``allow_pickle``: pickled non-tensor data is loaded only with True; None
    and False raise :class:`~tdz_numba.UnsafeContentError` (nothing read from
    a file runs code unless the caller allows it). Under :func:`enable`,
    tensordict's own ``load_memmap(allow_pickle=None)`` keeps tensordict 0.15's
    documented default: it loads pickles with a FutureWarning.
    """
    _tensordict()
    from . import api

    if mode is None:
        mode = "r"
    if allow_pickle is not None and not isinstance(allow_pickle, bool):
        raise InvalidArgumentError("allow_pickle must be a bool or None.")
    ctx = _Ctx(device, allow_pickle, allowed_classes, path, _pickle_default)
    return _load_open(api.open(path, mode=mode, allow_pickle=False, num_threads=num_threads), ctx, subpath)


def _load_open(ar: Any, ctx: _Ctx, subpath: Any) -> Any:
    """:func:`load` of an opened archive (closed on return; its leaves keep the mapping)."""
    try:
        node = _subpath_node(ar, subpath)
        if not ctx.no_data:
            ctx.tensors = _bulk_tensors(node)
        return _build(node, ctx)
    finally:
        ar.close()


def _open_tdz(path: Path, mode: str, num_threads: int) -> Any:
    """``path`` opened as a ``.tdz`` archive, or None when it is not one (then
    tensordict's own ``load_memmap`` reads it): the zip reader directly, no
    format detection. None exactly when ``is_archive(path, thorough=False)`` is False."""
    from .archive import Archive
    from .integrity import is_archive
    from .tdzsource import open_tdz

    if not path.is_file():
        return None
    try:
        return Archive(open_tdz(path, mode=mode, allow_pickle=False, num_threads=num_threads))
    except (TdzError, OSError, ValueError, RecursionError):
        if is_archive(path, thorough=False):
            raise  # an archive that this mode cannot open (read-only file with mode="r+", ...)
        return None


# ---------------------------------------------------------------------------
# enable / disable
# ---------------------------------------------------------------------------
_LOCK = threading.RLock()
_SAVED: list[tuple[Any, str, Any]] = []  # (owner, name, original value)

_COMPRESSION_NAMES = {0: None, 8: "deflate", 12: "bzip2", 14: "lzma"}


def _compression_name(compression: Any) -> str | None:
    from tensordict._archive import _resolve_compression

    method = _resolve_compression(compression)  # tensordict's ValueError for unknown names
    if method not in _COMPRESSION_NAMES:
        raise UnsupportedError(f"unsupported zip compression method {method}")
    return _COMPRESSION_NAMES[method]


class _Fallback(Exception):
    pass


def _patched_functions(originals: dict[str, Any]) -> dict[str, Any]:
    """The replacements, closing over tensordict's originals (used as fallbacks)."""
    from tensordict import _archive as tda

    def is_memmap_archive(path):
        from . import api

        return api.is_archive(path)

    def pack_memmap(prefix, archive_path, *, compression=None, compresslevel=None):
        from . import api

        prefix, archive_path = Path(prefix), Path(archive_path)
        if not (prefix / "meta.json").exists():
            raise ValueError(
                f"{prefix} does not look like a memory-mapped tensordict directory (no meta.json found)."
            )
        files = list(tda._iter_memmap_dir(prefix))
        if archive_path.resolve().is_relative_to(prefix.resolve()) or (
            archive_path.exists() and any(p.samefile(archive_path) for p in files)
        ):
            raise ValueError(
                f"The archive path {archive_path} must be outside the source directory "
                f"{prefix} and must not alias a source file."
            )
        target = archive_path.resolve()
        if target.exists() and not os.access(target, os.W_OK):
            raise PermissionError(f"Cannot overwrite {archive_path}: the file is not writable.")
        api.pack(
            prefix, archive_path, compression=_compression_name(compression), compresslevel=compresslevel
        )
        return archive_path

    def unpack_memmap(archive_path, prefix):
        from . import api

        archive_path, prefix = Path(archive_path), Path(prefix)
        if not api.is_archive(archive_path):
            raise ValueError(f"{archive_path} is not a memory-mapped tensordict archive.")
        api.unpack(archive_path, prefix)
        return prefix

    def refresh_archive_checksums(archive_path):
        from . import api

        archive_path = Path(archive_path)
        if not api.is_archive(archive_path):
            raise ValueError(f"{archive_path} is not a memory-mapped tensordict archive.")
        api.refresh_checksums(archive_path)
        return archive_path

    def _level_or_fallback(td, like: bool):
        from tensordict.base import _NESTED_TENSORS_AS_LISTS
        from tensordict.utils import _is_unbatched

        from .tdcompat import level_from_tensordict

        leaves = td.values(True, True, is_leaf=_NESTED_TENSORS_AS_LISTS)
        for value in leaves:
            if _is_unbatched(value) or (like and getattr(value, "is_nested", False)):
                raise _Fallback  # warnings / errors as tensordict raises them
        try:
            return level_from_tensordict(td, allow_pickle=True)
        except (InvalidTreeError, AttributeError, TypeError):
            raise _Fallback from None

    def _save_as_archive(
        td,
        archive_path,
        *,
        num_threads=0,
        compression=None,
        copy_existing=False,
        share_non_tensor=False,
        existsok=True,
        robust_key=True,
    ):
        from . import api

        if robust_key is not True:
            return originals["_save_as_archive"](
                td,
                archive_path,
                num_threads=num_threads,
                compression=compression,
                copy_existing=copy_existing,
                share_non_tensor=share_non_tensor,
                existsok=existsok,
                robust_key=robust_key,
            )
        archive_path = Path(archive_path)
        tda._check_archive_target(archive_path, existsok)
        name = _compression_name(compression)
        saved_prefix = getattr(td, "_memmap_prefix", None)
        if td.is_memmap() and isinstance(saved_prefix, Path) and (saved_prefix / "meta.json").exists():
            return pack_memmap(saved_prefix, archive_path, compression=compression)
        try:
            level = _level_or_fallback(td, like=False)
        except _Fallback:
            return originals["_save_as_archive"](
                td,
                archive_path,
                num_threads=num_threads,
                compression=compression,
                copy_existing=copy_existing,
                share_non_tensor=share_non_tensor,
                existsok=True,
                robust_key=robust_key,
            )
        api.save(level, archive_path, compression=name)
        return archive_path

    def _make_archive_like(
        td,
        archive_path,
        *,
        num_threads=0,
        copy_existing=False,
        share_non_tensor=False,
        existsok=True,
        robust_key=True,
    ):
        from . import writer
        from ._paths import user_errors
        from .tree import flatten

        fallback_kw = dict(
            num_threads=num_threads,
            copy_existing=copy_existing,
            share_non_tensor=share_non_tensor,
            robust_key=robust_key,
        )
        if robust_key is not True:
            return originals["_make_archive_like"](td, archive_path, existsok=existsok, **fallback_kw)
        archive_path = Path(archive_path)
        tda._check_archive_target(archive_path, existsok)
        try:
            level = _level_or_fallback(td, like=True)
        except _Fallback:
            return originals["_make_archive_like"](td, archive_path, existsok=True, **fallback_kw)
        with user_errors(archive_path, action="write"):
            writer.write_entries(flatten(level, zeros=True), writer.check_target(archive_path, True))
        return archive_path

    orig_load_memmap = originals["TensorDictBase.load_memmap"].__func__

    def load_memmap(
        cls,
        prefix,
        device=None,
        non_blocking=False,
        *,
        out=None,
        robust_key=True,
        subpath=None,
        mode=None,
        num_threads=0,
        allow_pickle=None,
    ):
        import torch
        from tensordict._archive import _ArchivePath

        if (
            out is None
            and robust_key is True
            and mode in (None, "r", "r+")
            and (allow_pickle is None or isinstance(allow_pickle, bool))
            and isinstance(prefix, (str, os.PathLike))
            and not isinstance(prefix, _ArchivePath)
            and not torch._guards.active_fake_mode()
        ):
            path = Path(prefix)
            # the central directory only: load checks each local header it reads
            ar = _open_tdz(path, mode or "r", num_threads if num_threads and num_threads > 1 else 1)
            if ar is not None:
                ctx = _Ctx(device, allow_pickle, (cls,), path, "warn")
                try:
                    result = _load_open(ar, ctx, subpath)
                except UnsupportedError as exc:
                    if "tdz_numba never imports" not in str(exc):
                        raise
                    # a class tensordict may still find (registered classes): its own path
                else:
                    if (
                        not non_blocking
                        and device is not None
                        and torch.device(device).type not in ("meta", "cuda")
                    ):
                        result._sync_all()
                    return result
        return orig_load_memmap(
            cls,
            prefix,
            device,
            non_blocking,
            out=out,
            robust_key=robust_key,
            subpath=subpath,
            mode=mode,
            num_threads=num_threads,
            allow_pickle=allow_pickle,
        )

    load_memmap.__doc__ = orig_load_memmap.__doc__
    load_memmap.__name__ = orig_load_memmap.__name__
    load_memmap.__qualname__ = orig_load_memmap.__qualname__
    load_memmap.__wrapped__ = orig_load_memmap  # type: ignore[attr-defined]  # functools.wraps-style marker
    return {
        "is_memmap_archive": is_memmap_archive,
        "pack_memmap": pack_memmap,
        "unpack_memmap": unpack_memmap,
        "refresh_archive_checksums": refresh_archive_checksums,
        "_save_as_archive": _save_as_archive,
        "_make_archive_like": _make_archive_like,
        "TensorDictBase.load_memmap": classmethod(load_memmap),
    }


def _patch_points() -> list[tuple[Any, str, str]]:
    """(owner, attribute, replacement key): every binding tensordict calls."""
    import tensordict
    from tensordict import _archive
    from tensordict._base import serialization

    points: list[tuple[Any, str, str]] = []
    for name in (
        "is_memmap_archive",
        "pack_memmap",
        "unpack_memmap",
        "refresh_archive_checksums",
        "_save_as_archive",
        "_make_archive_like",
    ):
        for module in (_archive, serialization, tensordict):
            if name in vars(module):
                points.append((module, name, name))
    owner = next(c for c in tensordict.TensorDictBase.__mro__ if "load_memmap" in vars(c))
    points.append((owner, "load_memmap", "TensorDictBase.load_memmap"))
    return points


def enable() -> None:
    """Makes tensordict's archive API use tdz_numba (idempotent; see :func:`disable`)."""
    td = _tensordict()
    if not str(getattr(td, "__version__", "")).startswith(SUPPORTED_PREFIX):
        raise UnsupportedError(
            f"tdz_numba.tensordict.enable() supports tensordict {SUPPORTED_PREFIX}x only, "
            f"found {getattr(td, '__version__', 'unknown')}"
        )
    with _LOCK:
        if _SAVED:
            return
        from tensordict import _archive

        points = _patch_points()
        originals = {name: getattr(_archive, name) for _, _, name in points if hasattr(_archive, name)}
        owner = points[-1][0]
        originals["TensorDictBase.load_memmap"] = vars(owner)["load_memmap"]
        replacements = _patched_functions(originals)
        for owner, attr, key in points:
            _SAVED.append((owner, attr, vars(owner)[attr]))
            setattr(owner, attr, replacements[key])


def disable() -> None:
    """Restores tensordict's own functions exactly (no-op when not enabled)."""
    with _LOCK:
        while _SAVED:
            owner, attr, original = _SAVED.pop()
            setattr(owner, attr, original)


def is_enabled() -> bool:
    """Whether :func:`enable` is in effect."""
    return bool(_SAVED)


@contextlib.contextmanager
def enabled() -> Iterator[None]:
    """Context manager: tdz_numba backs tensordict archives inside the block.

    Re-entrant: the state on entry is restored on exit.
    """
    was = is_enabled()
    enable()
    try:
        yield
    finally:
        if not was:
            disable()
