"""What a loaded :class:`~tdz_numba.tdz.tree.Level` shows and selects: its ``repr``, a summary
like the :class:`~tdz_numba.Archive` tree (keys, dtype and shape of each leaf, values cut short,
at most :data:`MAX_LINES` lines, never the tensors' values), and its rows by index
(:func:`select_rows`: ``level[0:10]``, also what ``archive[0:10]`` returns).

Examples
--------
>>> import torch
>>> from tdz_numba.tdz.tree import Level
>>> print(repr(Level({"x": torch.zeros(2, 3), "sub": Level({"y": torch.ones(4)}), "tag": "run"})))
Level[TensorDict](2 leaves, 40 B)
  x: float32[2, 3]
  sub/ (TensorDict)
    y: float32[4]
  tag: 'run'
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from ..errors import InvalidArgumentError, MissingKeyError

__all__ = ["level_repr", "is_row_index", "select_rows", "MAX_LINES"]

#: Most tree lines a repr shows (a last line says how many more there are).
MAX_LINES = 40
_VALUE_CHARS = 80


def _human(n: int) -> str:
    for unit in ("B", "KB", "MB", "GB", "TB"):
        if n < 1000 or unit == "TB":
            return f"{n} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1000  # type: ignore[assignment]
    return f"{n} B"  # pragma: no cover


def _value(value: Any) -> str:
    try:
        text = repr(value)
    except Exception:  # a repr never raises
        text = f"<{type(value).__name__}>"
    text = " ".join(text.split())
    return text if len(text) <= _VALUE_CHARS else text[: _VALUE_CHARS - 3] + "..."


def _leaf(t: Any) -> str:
    dtype = str(t.dtype).replace("torch.", "")
    if getattr(t, "is_nested", False):
        return f"{dtype}[{t.size(0)}, ...] nested"
    device = "" if t.device.type == "cpu" else f" ({t.device})"
    return f"{dtype}{list(t.shape)}{device}"


def _count(level: Mapping[str, Any]) -> tuple[int, int]:
    """``(leaves, bytes)`` below a level (iterative: no recursion on depth)."""
    import torch

    leaves = nbytes = 0
    stack = [level]
    while stack:
        node = stack.pop()
        for v in node.values():
            if isinstance(v, torch.Tensor):
                leaves += 1
                if not v.is_nested and v.device.type != "meta":
                    nbytes += v.numel() * v.element_size()
            elif isinstance(v, Mapping):
                stack.append(v)
    return leaves, nbytes


def _name(level: Any) -> str:
    type_name = getattr(level, "type_name", None) or type(level).__name__
    batch = getattr(level, "batch_size", None)
    return f"{type_name}, batch_size={batch}" if batch else type_name


def level_repr(level: Any, max_lines: int = MAX_LINES) -> str:
    """``Level[Class, batch_size=..](N leaves, size)`` and indented ``key: dtype[shape]`` lines."""
    import torch

    if not level and "data" in getattr(level, "meta", {}):  # NonTensorData / NonTensorStack
        return f"Level[{_name(level)}](data={_value(level.meta['data'])})"
    leaves, nbytes = _count(level)
    head = f"Level[{_name(level)}]({leaves} lea{'f' if leaves == 1 else 'ves'}, {_human(nbytes)})"
    lines: list[str] = []
    shown = 0
    stack: list[tuple[int, Any]] = [(1, iter(level.items()))]
    total = 0
    while stack:
        depth, it = stack[-1]
        item = next(it, None)
        if item is None:
            stack.pop()
            continue
        key, v = item
        total += 1
        if shown >= max_lines:
            continue
        pad = "  " * depth
        if isinstance(v, torch.Tensor):
            lines.append(f"{pad}{key}: {_leaf(v)}")
        elif isinstance(v, Mapping):
            lines.append(f"{pad}{key}/ ({_name(v)})")
            stack.append((depth + 1, iter(v.items())))
        else:
            lines.append(f"{pad}{key}: {_value(v)}")
        shown += 1
    if total > shown:
        lines.append(f"  ... {total - shown} more entries")
    return "\n".join([head, *lines])


def is_row_index(key: Any) -> bool:
    """Whether ``key`` selects rows (an int, a slice, an integer or bool tensor / array / list)."""
    if isinstance(key, (int, slice)) and not isinstance(key, bool):
        return True
    import torch

    if isinstance(key, torch.Tensor):
        return key.dtype == torch.bool or not (key.is_floating_point() or key.is_complex())
    if type(key).__module__ == "numpy" and hasattr(key, "dtype"):
        return key.dtype.kind in "biu"
    if isinstance(key, list) and key:
        return all(isinstance(k, int) for k in key)
    return False


def _as_index(key: Any) -> Any:
    import torch

    if isinstance(key, (int, slice, torch.Tensor)):
        return key
    return torch.as_tensor(key)


def select_rows(tree: Mapping[str, Any], key: Any, where: str) -> Any:
    """The rows ``key`` of every leaf of a level with a batch size (views where indexing allows:
    an int or a slice; a tensor index copies, as in torch).

    Raises :class:`~tdz_numba.InvalidArgumentError` when the level has no batch size or the
    index does not fit it.
    """
    import torch

    meta = dict(getattr(tree, "meta", {}) or {})
    batch = meta.get("shape")
    if not isinstance(batch, list) or not batch:
        raise MissingKeyError(  # (a KeyError: an int is no key of a level without rows)
            f"{where}: [{_short(key)}] selects rows, but this level has no batch size "
            f"(keys are str: {_keys(tree)})"
        )
    index = _as_index(key)
    try:
        new_batch = list(torch.empty((), dtype=torch.uint8).expand(batch)[index].shape)
    except (IndexError, RuntimeError, ValueError, TypeError) as exc:
        raise InvalidArgumentError(
            f"{where}: index {_short(key)} does not fit the batch size {batch}: {_first_line(exc)}"
        ) from None
    meta["shape"] = new_batch
    return _rows(tree, index, meta, where, type(tree))


def _rows(tree: Mapping[str, Any], index: Any, meta: dict, where: str, level_type: type) -> Any:
    """The rows ``index`` of every leaf below ``tree``, as ``level_type`` (a Level) levels."""
    import torch

    out = level_type(meta=meta, keyed=getattr(tree, "keyed", True))
    for k, v in tree.items():
        if isinstance(v, torch.Tensor):
            try:
                out[k] = v[index]
            except (IndexError, RuntimeError, ValueError) as exc:
                raise InvalidArgumentError(
                    f"{where}/{k}: leaf of shape {list(v.shape)} has no rows {_short(index)}: "
                    f"{_first_line(exc)}"
                ) from None
        elif isinstance(v, Mapping):
            sub_meta = dict(getattr(v, "meta", {}) or {})
            shape = sub_meta.get("shape")
            if isinstance(shape, list) and shape:
                try:
                    sub_meta["shape"] = list(torch.empty((), dtype=torch.uint8).expand(shape)[index].shape)
                except (IndexError, RuntimeError, ValueError, TypeError):
                    pass  # its leaves say what does not fit
            out[k] = _rows(v, index, sub_meta, f"{where}/{k}", level_type)
        else:
            out[k] = v  # non-tensor data: the same for every row
    return out


def _short(key: Any) -> str:
    text = " ".join(repr(key).split())
    return text if len(text) <= 60 else text[:57] + "..."


def _keys(tree: Mapping[str, Any]) -> str:
    keys = list(tree)
    shown = ", ".join(repr(k) for k in keys[:8])
    return shown + (f", ... ({len(keys)} keys)" if len(keys) > 8 else "")


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    line = text[0] if text else type(exc).__name__
    return line if len(line) <= 160 else line[:157] + "..."
