"""tensordict collections as :class:`~tdz_numba.tree.Level` trees (for ``save``).

Imported only when a tensordict object is passed to :func:`tdz_numba.save`;
tensordict stays an optional dependency. The levels built here carry the same
meta.json fields, in the same order, as tensordict 0.15.3's memmap writer.

Examples
--------
>>> import torch
>>> from tensordict import TensorDict
>>> from tdz_numba.tdcompat import level_from_tensordict
>>> lvl = level_from_tensordict(TensorDict(a=torch.zeros(2, 3), batch_size=[2]))
>>> lvl.batch_size, lvl.meta["_class"]
([2], 'tensordict:TensorDict')
"""

from __future__ import annotations

import json
from typing import Any

import torch

from .errors import InvalidTreeError
from .tree import FORMAT_VERSION, Level

__all__ = ["level_from_tensordict"]


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


def level_from_tensordict(obj: Any) -> Level | None:
    """A Level tree for a tensordict collection, or None if ``obj`` is not one."""
    from tensordict import LazyStackedTensorDict, NonTensorData, NonTensorStack, TensorDictBase
    from tensordict.tensorclass import is_tensorclass

    if isinstance(obj, NonTensorStack):
        data = obj.tolist()
        if not _jsonable(data):
            raise InvalidTreeError(
                "NonTensorStack data is not JSON-serializable; tdz_numba does not write pickles"
            )
        meta = {"_type": str(type(obj)), **_format(type(obj)), "stack_dim": obj.stack_dim,
                "device": str(obj.device) if obj.device is not None else None, "data": data}  # fmt: skip
        return Level(meta=meta, keyed=False)
    if isinstance(obj, NonTensorData):
        if not _jsonable(obj.data):
            raise InvalidTreeError(
                f"NonTensorData of type {type(obj.data).__name__} is not JSON-serializable; "
                f"tdz_numba does not write pickles"
            )
        meta = {"_type": str(type(obj)), "data": obj.data, "_metadata": None, "_is_non_tensor": True}
        return Level(meta=meta, keyed=False)
    if isinstance(obj, LazyStackedTensorDict):
        meta = {"_type": str(type(obj)), **_format(type(obj)), "stack_dim": obj.stack_dim,
                "stack_dim_name": obj._td_dim_name}  # fmt: skip
        lvl = Level(meta=meta, keyed=False)
        for i, member in enumerate(obj.tensordicts):
            lvl[str(i)] = level_from_tensordict(member)
        return lvl
    if is_tensorclass(obj) and not isinstance(obj, TensorDictBase):
        meta: dict[str, Any] = {"_type": str(type(obj))}
        for key, value in obj._non_tensordict.items():
            if not _jsonable(value):
                raise InvalidTreeError(
                    f"tensorclass field {key!r} is not JSON-serializable; tdz_numba does not write pickles"
                )
            meta[key] = value
        lvl = Level(meta=meta, keyed=False)
        lvl["_tensordict"] = level_from_tensordict(obj._tensordict)
        return lvl
    if isinstance(obj, TensorDictBase):
        meta = {"shape": list(obj.batch_size), "device": "cpu", "_type": str(type(obj)),
                **_format(type(obj))}  # fmt: skip
        if obj._has_names():
            meta["_names"] = list(obj.names)
        lvl = Level(meta=meta, keyed=True)
        for key, value in obj.items():
            if isinstance(value, torch.Tensor):
                lvl[key] = value
            else:
                child = level_from_tensordict(value)
                if child is None:
                    raise InvalidTreeError(f"{key}: cannot store a {type(value).__name__}")
                lvl[key] = child
        return lvl
    return None
