"""tensordict collections as :class:`~tdz_numba.tdz.tree.Level` trees (for ``save``).

Imported only when a tensordict object is passed to :func:`tdz_numba.save`;
tensordict stays an optional dependency. The levels built here carry the same
meta.json fields, in the same order, as tensordict 0.15.3's memmap writer.

Examples
--------
>>> import torch
>>> from tensordict import TensorDict
>>> from tdz_numba.tdz.tdcompat import level_from_tensordict
>>> lvl = level_from_tensordict(TensorDict(a=torch.zeros(2, 3), batch_size=[2]))
>>> lvl.batch_size, lvl.meta["_class"]
([2], 'tensordict:TensorDict')
"""

from __future__ import annotations

import hashlib
import json
import pickle
from typing import Any

import torch

from ..errors import InvalidTreeError
from .tree import FORMAT_VERSION, Level, RawFile

__all__ = ["level_from_tensordict", "converter"]


def converter(allow_pickle: bool = False):
    """The converter :func:`tdz_numba.tdz.tree.flatten` takes for tensordict collections, or None
    when tensordict is not imported (then no tensordict object can exist).

    ``allow_pickle`` is kept for nested collections too.

    >>> from tdz_numba.tdz.tdcompat import converter
    >>> callable(converter())
    True
    """
    import functools
    import sys

    if "tensordict" not in sys.modules:
        return None
    return functools.partial(level_from_tensordict, allow_pickle=allow_pickle)


def _class_id(cls: type) -> str:
    import tensordict

    module = cls.__module__
    if getattr(tensordict, cls.__qualname__, None) is cls:
        module = "tensordict"
    return f"{module}:{cls.__qualname__}"


def _format(cls: type) -> dict[str, Any]:
    return {"_format_version": FORMAT_VERSION, "_class": _class_id(cls)}


def _jsonable(value: Any) -> bool:
    try:
        json.dumps(value)
    except (TypeError, ValueError):
        return False
    return True


def _td_jsonable(value: Any) -> bool:
    """tensordict's own JSON test (it decides what goes to meta.json vs a pickle)."""
    try:
        from tensordict.utils import _is_json_serializable
    except ImportError:  # pragma: no cover
        return _jsonable(value)
    return _is_json_serializable(value)


def _refuse(what: str) -> InvalidTreeError:
    return InvalidTreeError(
        f"{what} is not JSON-serializable: tensordict would pickle it; pass "
        f"allow_pickle=True to write the pickle (tdz_numba.tensordict.save)"
    )


def _tensorclass_level(obj: Any, allow_pickle: bool, *, with_td: bool) -> Level:
    """A tensorclass (or NonTensorData) level, as tensordict's tensorclass ``_memmap_``."""
    try:
        from tensordict.tensorclass import (  # type: ignore[attr-defined]  # private in tensordict 0.15.3
            _JSON_TYPE_NAMES,
            _JSON_TYPES_FILE,
            _from_shared_nontensor,
        )
    except ImportError:  # pragma: no cover
        _JSON_TYPE_NAMES, _JSON_TYPES_FILE = {}, "json_types.json"

        def _from_shared_nontensor(v):
            return v

    meta: dict[str, Any] = {"_type": str(type(obj))}
    to_pickle: dict[str, Any] = {}
    for key, value in obj._non_tensordict.items():
        value = _from_shared_nontensor(value)
        if _td_jsonable(value):
            meta[key] = value
        else:
            to_pickle[key] = value
    lvl = Level(meta=meta, keyed=False)
    if to_pickle:
        if not allow_pickle:
            raise _refuse(f"{type(obj).__name__} field(s) {sorted(to_pickle)}")
        pickled = pickle.dumps(to_pickle)
        lvl["other.pickle"] = RawFile(pickled)
        if all(isinstance(v, type) and v in _JSON_TYPE_NAMES for v in to_pickle.values()):
            saved = {
                "types": {k: _JSON_TYPE_NAMES[v] for k, v in to_pickle.items()},
                "pickle_sha256": hashlib.sha256(pickled).hexdigest(),
            }
            lvl[_JSON_TYPES_FILE] = RawFile(json.dumps(saved).encode("utf-8"))
    if with_td:
        lvl["_tensordict"] = level_from_tensordict(obj._tensordict, allow_pickle=allow_pickle)
    return lvl


def _written_class(obj: Any) -> type:
    """The class tensordict 0.15.3 records for a ``TensorDictBase`` level of an archive.

    ``td.save(path.tdz)`` stages ``td.apply(...)._memmap_(like=True)``: a
    ``TensorDict`` (or a user subclass of it) keeps its class; every other
    collection -- views (``_SubTensorDict``, permuted, (un)squeezed, ...),
    ``TensorDictParams``, ``TypedTensorDict`` classes, ``PersistentTensorDict``,
    stores -- is written as a plain ``TensorDict``. Lazy stacks and
    tensorclasses are handled by the caller.
    """
    from tensordict import TensorDict

    cls = type(obj)
    return cls if issubclass(cls, TensorDict) else TensorDict


def _parent_type_name(obj: Any) -> str:
    """The ``{"type": ...}`` a parent's meta.json records for ``obj``: the class name of
    ``obj.apply(...)``, which keeps ``TypedTensorDict`` classes and yields ``TensorDict``
    for views and ``TensorDictParams``."""
    try:
        from tensordict import TypedTensorDict
    except ImportError:  # pragma: no cover
        return "TensorDict"
    return type(obj).__name__ if isinstance(obj, TypedTensorDict) else "TensorDict"


class _Level(Level):
    """A Level whose parent records another class name than its own ``_class``."""

    written_as = "TensorDict"

    @property
    def type_name(self) -> str:
        return self.written_as


def level_from_tensordict(obj: Any, *, allow_pickle: bool = False) -> Level | None:
    """A Level tree for a tensordict collection, or None if ``obj`` is not one.

    Non-JSON non-tensor data is written as tensordict pickles it (``pickle.pkl``
    for a NonTensorStack, ``other.pickle`` for NonTensorData and tensorclass
    fields) only with ``allow_pickle=True``; otherwise it raises
    :class:`~tdz_numba.InvalidTreeError`.
    """
    from tensordict import LazyStackedTensorDict, NonTensorData, NonTensorStack, TensorDictBase
    from tensordict.tensorclass import NonTensorDataBase, is_tensorclass  # type: ignore[attr-defined]  # not re-exported

    if isinstance(obj, NonTensorStack):
        data = obj.tolist()
        meta = {
            "_type": str(type(obj)),
            **_format(type(obj)),
            "stack_dim": obj.stack_dim,
            "device": str(obj.device) if obj.device is not None else None,
        }
        if _td_jsonable(data):
            meta["data"] = data
            return Level(meta=meta, keyed=False)
        if not allow_pickle:
            raise _refuse("NonTensorStack data")
        meta["data"] = "pickle.pkl"
        lvl = Level(meta=meta, keyed=False)
        lvl["pickle.pkl"] = RawFile(pickle.dumps(data))
        return lvl
    if isinstance(obj, (NonTensorData, NonTensorDataBase)):  # MetaData too: no _tensordict level
        return _tensorclass_level(obj, allow_pickle, with_td=False)
    if isinstance(obj, LazyStackedTensorDict):
        meta = {
            "_type": str(type(obj)),
            **_format(type(obj)),
            "stack_dim": obj.stack_dim,
            "stack_dim_name": obj._td_dim_name,
        }
        lvl = Level(meta=meta, keyed=False)
        for i, member in enumerate(obj.tensordicts):
            lvl[str(i)] = level_from_tensordict(member, allow_pickle=allow_pickle)
        return lvl
    if is_tensorclass(obj) and not isinstance(obj, TensorDictBase):
        return _tensorclass_level(obj, allow_pickle, with_td=True)
    if isinstance(obj, TensorDictBase):
        cls = _written_class(obj)
        meta = {"shape": list(obj.batch_size), "device": "cpu", "_type": str(cls), **_format(cls)}
        if obj._has_names():
            meta["_names"] = list(obj.names)
        if cls is type(obj):
            lvl = Level(meta=meta, keyed=True)
        else:
            written = _Level(meta=meta, keyed=True)
            written.written_as = _parent_type_name(obj)
            lvl = written
        for key, value in obj.items():
            if isinstance(value, torch.Tensor):
                lvl[key] = value
            else:
                child = level_from_tensordict(value, allow_pickle=allow_pickle)
                if child is None:
                    raise InvalidTreeError(f"{key}: cannot store a {type(value).__name__}")
                lvl[key] = child
        return lvl
    return None
