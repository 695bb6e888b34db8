"""tensordict collections built from an opened ``.tdz`` archive (the reading side of
:mod:`tdz_numba.tensordict`).

:func:`load_open` builds what ``TensorDict.load_memmap`` returns from an
:class:`~tdz_numba.Archive`: leaves are zero-copy views of the one mapping, made
in bulk (a common TensorDict level in one pass by the source's ``quick_level``,
any other archive's leaves in one bulk call first); each TensorDict level is made
with one ``TensorDict._new_unsafe`` call over its pre-built leaf dict (tensordict
sets loaded leaves unvalidated too); sub-levels are set as tensordict sets them.
No class named in an archive is ever imported.

Examples
--------
>>> import tempfile, pathlib, torch
>>> from tensordict import TensorDict
>>> import tdz_numba, tdz_numba.tensordict
>>> from tdz_numba.tensordict.load import LoadContext, load_open
>>> with tempfile.TemporaryDirectory() as d:
...     p = tdz_numba.tensordict.save(TensorDict(a=torch.arange(3), batch_size=[3]), pathlib.Path(d) / "x.tdz")
...     td = load_open(tdz_numba.open(p), LoadContext(None, None, (), p), None)
...     print(type(td).__name__, td.batch_size, td["a"].tolist())
TensorDict torch.Size([3]) [0, 1, 2]
"""

from __future__ import annotations

import hashlib
import json
import pickle
import sys
import warnings
from pathlib import Path
from typing import Any

from ..errors import BadArchiveError, InvalidArgumentError, TdzError, UnsafeContentError, UnsupportedError

__all__ = ["LoadContext", "load_open", "open_tdz_archive"]


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


class LoadContext:
    """Options of one load and its caches (classes resolved, tensors of the bulk pass).

    Parameters
    ----------
    device : torch.device, str or None
        Where leaves go (None: where the archive says; ``"meta"``: no payload read).
    allow_pickle : bool or None
        Pickled non-tensor data: True loads it, False refuses it, None follows
        ``pickle_default`` (``"refuse"``, or ``"warn"``: load with tensordict 0.15's FutureWarning).
    allowed_classes : tuple of type
        Classes a level may name besides the imported ones.
    path : str or os.PathLike
        The archive, for messages.
    """

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
        # the source's one-pass reader of a common TensorDict level (TdzSource.quick_level), or None
        self.quick: Any = None
        self.quick_done: dict[str, Any] = {}  # prefix -> its quick_level result, read ahead
        from tensordict import TensorDict

        self.td_cls = TensorDict
        self.devices: dict[str, Any] = {}  # meta.json "device" -> torch.device

    def saved_device(self, saved: Any) -> Any:
        """The torch.device of a level's meta.json ``"device"`` (None for ``"None"``/null)."""
        if saved is None or saved == "None":
            return None
        device = self.devices.get(saved) if type(saved) is str else None
        if device is None:
            import torch

            try:
                device = torch.device(saved)
            except (RuntimeError, TypeError, ValueError) as exc:
                raise BadArchiveError(f"{self.path}: meta.json device {saved!r:.100}: {exc}") from None
            if type(saved) is str:
                self.devices[saved] = device
        return device

    def batch_size(self, meta: dict) -> Any:
        """The torch.Size of a level's meta.json ``"shape"`` (a list of ints >= 0; absent: ``[]``)."""
        import torch

        shape = meta.get("shape", ())
        if type(shape) not in (list, tuple) or not all(type(s) is int and s >= 0 for s in shape):
            raise BadArchiveError(
                f"{self.path}: meta.json batch size {shape!r:.100} is not a list of ints >= 0"
            )
        return torch.Size(shape)

    def resolve(self, meta: dict) -> type:
        class_id = meta.get("_class")
        type_name = meta.get("_type")
        if not (class_id is None or type(class_id) is str) or not (
            type_name is None or type(type_name) is str
        ):
            raise BadArchiveError(
                f"{self.path}: meta.json _class {class_id!r:.100} / _type {type_name!r:.100}: expected strings"
            )
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
    where, entry = node._where(_JSON_TYPES_FILE), spec.path
    try:
        saved = json.loads(node.file_bytes(spec))
    except ValueError as exc:  # JSONDecodeError, UnicodeDecodeError
        raise BadArchiveError(f"{where}: not a JSON document: {exc}", entry=entry) from None
    except RecursionError:  # (else load's handler calls it a tree of levels too deep)
        raise BadArchiveError(f"{where}: not a JSON document: nested too deeply", entry=entry) from None
    if type(saved) is not dict:
        raise BadArchiveError(f"{where}: expected a JSON object, found {type(saved).__name__}", entry=entry)
    if hashlib.sha256(node.file_bytes(children["other.pickle"])).hexdigest() != saved.get("pickle_sha256"):
        return None
    if type(saved.get("types")) is not dict:
        raise BadArchiveError(
            f"{where}: 'types' must be an object, found {saved.get('types')!r:.100}", entry=entry
        )
    types = {}
    for key, name in saved["types"].items():
        if type(name) is not str or name not in _JSON_TYPES:
            raise InvalidArgumentError(f"Unknown type name {name!r} for the field {key!r} in {spec.path}.")
        types[key] = _JSON_TYPES[name]
    return types


def _keyed_children(node: Any, meta: dict) -> tuple[bool, dict]:
    """The children of a level read as a TensorDict level (keys listed in meta.json)."""
    from ..tdz.tree import TD_CLASS, describe_level

    index, prefix = node._index, node._prefix
    _, children = describe_level(
        {**meta, "_class": TD_CLASS},
        prefix,
        lambda: index.listing(prefix),
        lambda sub: sub + "meta.json" in index or index.is_dir(sub),
        node._where("meta.json"),
    )
    return True, {c.key: c for c in children}


def _build_at(owner: Any, prefix: str, ctx: LoadContext) -> Any:
    """The collection of the level at ``prefix`` of ``owner``'s archive: a common
    TensorDict level from the source's one-pass reader (no per-leaf specs, no
    :class:`~tdz_numba.Archive` view), any other through :func:`_build`."""
    if ctx.quick is not None:
        got = ctx.quick_done.pop(prefix, None) or ctx.quick(prefix)
        if got is not None and ctx.resolve(got[0].meta) is ctx.td_cls:
            return _quick_tensordict(owner, got, ctx)
    return _build(owner._sub(prefix) if prefix != owner._prefix else owner, ctx)


def _set_names(result: Any, names: Any, ctx: LoadContext) -> None:
    """Sets a level's meta.json ``"_names"`` (a list) on ``result``: BadArchiveError when they do not fit."""
    if isinstance(names, list):
        try:
            result._set_names(names)
        except (ValueError, TypeError) as exc:
            raise BadArchiveError(f"{ctx.path}: meta.json _names {names!r:.100}: {exc}") from None


def _build(node: Any, ctx: LoadContext) -> Any:
    """The collection of the level ``node`` (an :class:`~tdz_numba.Archive` view), general path."""
    import torch
    from tensordict import LazyStackedTensorDict, NonTensorStack, TensorDict
    from tensordict.tensorclass import NonTensorDataBase, is_tensorclass  # type: ignore[attr-defined]  # not re-exported

    from ..tdz.dtypes import torch_dtype

    keyed, children, meta = node.level_info()
    if keyed:  # the level's own fields: a reserved name holding an object is a key (as in Archive.meta)
        meta = {k: v for k, v in meta.items() if k not in children}
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
            members.append(_build_at(node, spec.path, ctx))
        stack_dim = meta.get("stack_dim")
        where, entry = node._where("meta.json"), node._prefix + "meta.json"
        if type(stack_dim) is not int:
            raise BadArchiveError(
                f"{where}: stack_dim must be an integer, found {stack_dim!r:.100}", entry=entry
            )
        try:
            result = cls(*members, stack_dim=stack_dim)
        except (ValueError, TypeError, IndexError, RuntimeError) as exc:
            raise BadArchiveError(
                f"{where}: {len(members)} stacked levels do not stack on dim {stack_dim}: {exc}", entry=entry
            ) from None
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
            td = _build_at(node, spec.path, ctx)
        else:
            if not issubclass(cls, NonTensorDataBase):
                raise InvalidArgumentError("The _tensordict directory seems to be missing.")
            td = TensorDict(device="cpu")
        return cls._from_tensordict(td, non_td, rebuild=False)  # type: ignore[attr-defined]  # a tensorclass type
    # a TensorDict level (other TensorDictBase classes load as TensorDict, as in tensordict)
    if not keyed:
        raise InvalidArgumentError(f"{node.where()}: a {cls.__name__} level must list its keys in meta.json")
    saved_device = ctx.saved_device(meta.get("device", "None"))
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
    batch_size = ctx.batch_size(meta)
    device = saved_device if target is None else target
    if cls is TensorDict or not issubclass(cls, TensorDict):
        # tensordict sets loaded leaves with validated=True: no per-leaf check either
        result = TensorDict._new_unsafe(leaves, batch_size=batch_size, device=device, nested=False)  # type: ignore[arg-type]
    else:
        result = cls(leaves, batch_size=batch_size, device=device)
    _set_names(result, meta.get("_names"), ctx)
    for key, spec in subs:
        # validated as tensordict sets them (non-tensor data is expanded to the batch size)
        result._set_str(key, _build_at(node, spec.path, ctx), inplace=False, validated=False)
    return result


def _quick_tensordict(owner: Any, got: tuple[Any, list[tuple[str, str]]], ctx: LoadContext) -> Any:
    """A TensorDict level from the source's one-pass reader: ``got`` is ``(level, subs)``,
    the level's leaves in meta.json order (sub-levels hold None) and ``(key, prefix)`` of
    each sub-level. The same object :func:`_build`'s general path makes, in one
    ``TensorDict._new_unsafe`` call."""
    level, subs = got
    meta = level.meta
    target = ctx.device
    if target is None:
        leaves = {k: t for k, t in level.items() if t is not None}
        device = ctx.saved_device(meta.get("device", "None"))
    else:
        leaves = {k: t.to(target, non_blocking=True) for k, t in level.items() if t is not None}
        device = target
    result = ctx.td_cls._new_unsafe(
        leaves,
        batch_size=ctx.batch_size(meta),
        device=device,
        nested=False,
    )
    _set_names(result, meta.get("_names"), ctx)
    for key, prefix in subs:
        # validated as tensordict sets them (non-tensor data is expanded to the batch size)
        result._set_str(key, _build_at(owner, prefix, ctx), inplace=False, validated=False)
    return result


def _bulk_tensors(node: Any) -> dict[str, Any]:
    """``{entry: tensor}`` of every leaf below ``node``, resolved in one bulk call."""
    from ..archive.bulk import materialize

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
    from ..tdz.tree import encode_key

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


def load_open(ar: Any, ctx: LoadContext, subpath: Any) -> Any:
    """What ``TensorDict.load_memmap`` returns, read from the opened archive ``ar``
    (closed on return; the leaves keep the mapping alive).

    ``subpath``: a ``"a/b"`` string or a (nested) tuple of keys, or None. A source
    with a one-pass reader of common TensorDict levels (``quick_level``: stored,
    aligned leaves of plain dtypes) gives each such level in one pass; otherwise
    every leaf below the level is resolved in one general bulk call first (none
    with ``device="meta"``); then each level is built (see the module docstring).
    """
    try:
        node = _subpath_node(ar, subpath)
        if not ctx.no_data:
            state = ar._state
            if not (state.copy or state.dtype is not None or state.device is not None):
                ctx.quick = getattr(state.source, "quick_level", None)
            got = ctx.quick(node._prefix) if ctx.quick is not None else None
            if got is None:  # not the common case: every leaf resolved in one general bulk call
                ctx.tensors = _bulk_tensors(node)
            else:  # a level at a time, each in one pass
                ctx.quick_done[node._prefix] = got
        try:
            return _build_at(node, node._prefix, ctx)
        except RecursionError:
            # the reader allows 4,096 levels; tensordict builds (and uses) its levels recursively
            raise UnsupportedError(
                f"{ar.path}: levels nested too deep to build as tensordict objects "
                f"(Python's recursion limit is {sys.getrecursionlimit()}); tdz_numba.open/load read it"
            ) from None
    finally:
        ar.close()


def open_tdz_archive(path: Path, mode: str, num_threads: int, *, check_local: bool = False) -> Any:
    """``path`` opened as a ``.tdz`` :class:`~tdz_numba.Archive`, or None when it is not one
    (then tensordict's own ``load_memmap`` reads it).

    The zip reader directly, without format detection: one parse of the central
    directory; ``check_local=True`` checks every local header in the same kernel
    pass (for a load of the whole archive), else they are checked as entries are
    read. None exactly when
    ``is_archive(path, thorough=False)`` is False; an archive that cannot be opened
    in ``mode`` raises.

    >>> import tempfile, pathlib, torch, tdz_numba
    >>> from tdz_numba.tensordict.load import open_tdz_archive
    >>> with tempfile.TemporaryDirectory() as d:
    ...     p = tdz_numba.save({"a": torch.ones(2)}, pathlib.Path(d) / "x.tdz")
    ...     print(open_tdz_archive(p, "r", 1)["a"].tolist(), open_tdz_archive(pathlib.Path(d), "r", 1))
    [1.0, 1.0] None
    """
    from ..archive.mapping import Archive
    from ..archive.verify import is_archive
    from ..tdz.source import TdzSource
    from ..zipfmt.index import ArchiveIndex

    if mode not in ("r", "r+"):
        raise InvalidArgumentError(f"mode must be 'r' or 'r+', got {mode!r}")
    if not path.is_file():
        return None
    try:
        index = ArchiveIndex(path, writable=mode == "r+", check_local=check_local)
        return Archive(TdzSource(path, mode=mode, allow_pickle=False, num_threads=num_threads, index=index))
    except (TdzError, OSError, ValueError, RecursionError):
        if is_archive(path, thorough=False):
            raise  # an archive that this mode cannot open (read-only file with mode="r+", ...)
        return None
