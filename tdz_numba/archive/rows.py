"""Torch and TensorDict habits on an :class:`~tdz_numba.Archive`: in-place writes
(``ar[key] = value`` with ``mode="r+"``), chosen keys (``load(keys=...)``) and
``to_tensordict()``; rows by index (``ar[0:10]``) are
:func:`tdz_numba.tdz.levelview.select_rows`.

Examples
--------
>>> import tempfile, pathlib, torch, tdz_numba, tdz_numba.tensordict
>>> from tensordict import TensorDict
>>> with tempfile.TemporaryDirectory() as d:
...     td = TensorDict(x=torch.arange(10), y=torch.ones(10, 2), batch_size=[10])
...     p = tdz_numba.tensordict.save(td, pathlib.Path(d) / "x.tdz")
...     with tdz_numba.open(p) as ar:
...         rows = ar[2:4]
...     print(rows["x"].tolist(), rows.batch_size)
[2, 3] [2]
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

from ..errors import InvalidArgumentError, UnsupportedError
from ..tdz.tree import Level

__all__ = ["write_leaf", "select_keys", "to_tensordict"]


def write_leaf(ar: Any, key: Any, value: Any) -> None:
    """``ar[key] = value``: writes ``value`` into the leaf's bytes (``mode="r+"`` only; the same
    shape and dtype). Then :func:`tdz_numba.refresh_checksums` (or ``close(refresh=True)``)."""
    state = ar._state
    ar._check_open()
    if ar.mode != "r+":
        raise InvalidArgumentError(
            f"{ar.where()}: the archive is read-only (mode={ar.mode!r}): open it with mode='r+' "
            f"to write into leaves in place"
        )
    if state.copy or state.dtype is not None or state.device is not None:
        raise InvalidArgumentError(
            f"{ar.where()}: opened with copy/dtype/device: its leaves are not the file's bytes, "
            "so a write would not reach the file"
        )
    node, spec = ar._resolve(key)
    if spec.kind != "leaf":
        raise InvalidArgumentError(
            f"{node.where(spec.key)}: is a {spec.kind}, not a tensor leaf; only leaves are written "
            "in place (the archive's layout never changes)"
        )
    target = node._value(spec)
    try:
        src = value if isinstance(value, torch.Tensor) else torch.as_tensor(value)
    except (TypeError, ValueError, RuntimeError) as exc:
        raise InvalidArgumentError(
            f"{node.where(spec.key)}: cannot write a {type(value).__name__}: {_first_line(exc)}"
        ) from None
    if src.dtype != target.dtype or tuple(src.shape) != tuple(target.shape):
        raise InvalidArgumentError(
            f"{node.where(spec.key)}: the leaf is {str(target.dtype).replace('torch.', '')}"
            f"{list(target.shape)}, the value {str(src.dtype).replace('torch.', '')}{list(src.shape)}: "
            "an in-place write needs the same dtype and shape"
        )
    target.copy_(src)


def select_keys(ar: Any, keys: tuple[str, ...]) -> Level:
    """Only the leaves, levels and values ``keys`` of a level (each a key of the level or a path
    ``"a/b"``, nested in the result as in the file); leaves resolved in one bulk pass."""
    from .bulk import materialize

    out = Level(meta=ar.meta, keyed=True)
    slots: list[tuple[Level, str]] = []
    leaves: list[Any] = []
    for key in keys:
        node, spec = ar._resolve(key)
        children = ar._level()[1]
        parts = [key] if key in children else key.split("/")
        dest = out
        for part in parts[:-1]:
            nxt = dest.get(part)
            if not isinstance(nxt, Level):
                nxt = dest[part] = Level()
            dest = nxt
        last = parts[-1]
        if spec.kind == "leaf":
            dest[last] = None
            slots.append((dest, last))
            leaves.append(spec.leaf)
        elif spec.kind == "level":
            dest[last] = node._sub(spec.path).to_dict()
        else:
            dest[last] = node._value(spec)
    for (lvl, last), t in zip(slots, materialize(ar, leaves)):
        lvl[last] = t
    return out


def to_tensordict(ar: Any) -> Any:
    """The level as a ``tensordict.TensorDict`` (nested levels as nested TensorDicts with their
    batch sizes; leaves the same zero-copy tensors :meth:`~tdz_numba.Archive.to_dict` gives)."""
    try:
        from tensordict import TensorDict
    except ImportError:
        raise UnsupportedError(
            "to_tensordict() needs the tensordict package (pip install tensordict); "
            "to_dict() gives the same leaves as nested dicts"
        ) from None
    return _td(ar.to_dict(), TensorDict)


def _td(tree: Mapping[str, Any], cls: Any) -> Any:
    batch = getattr(tree, "batch_size", None) or []
    items = {k: _td(v, cls) if isinstance(v, Mapping) else v for k, v in tree.items()}
    return cls(items, batch_size=batch)


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    line = text[0] if text else type(exc).__name__
    return line if len(line) <= 160 else line[:157] + "..."
