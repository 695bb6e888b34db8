"""What the views of one opened archive share (:class:`ArchiveState`), and the level paths and key
errors of the :class:`~tdz_numba.archive.mapping.Archive` mapping.

Examples
--------
>>> from tdz_numba.archive.state import nest_flat, subpath_prefix
>>> subpath_prefix("obs/pixels"), nest_flat({"a.b": 1, "a.c": 2})
('obs/pixels/', {'a': {'b': 1, 'c': 2}})
"""

from __future__ import annotations

import difflib
from collections.abc import Mapping
from typing import Any

import torch

from ..errors import InvalidArgumentError, MissingKeyError
from ..tdz.sources import Source
from ..tdz.tree import encode_key

__all__ = ["ArchiveState", "subpath_prefix", "nest_flat", "missing_key"]


class ArchiveState:
    """What all views of one opened archive share."""

    def __init__(self, source: Source, *, copy: bool = False, device: Any = None, dtype: Any = None) -> None:
        self.source = source
        self.closed = False
        self.copy = copy
        self.device = None if device is None else torch.device(device)
        self.dtype = dtype
        self.direct = False  # copy=True leaves read with O_DIRECT where page-aligned
        self.aligned = False  # leaves not aligned for their dtype are copies (not views)
        self.dequantize = False  # GGML quantized leaves decoded to float32 when made
        self.views: dict[str, Any] = {}  # prefix -> the Archive view of that level


def subpath_prefix(subpath: str | tuple[str, ...] | list[str] | None) -> str:
    """Directory prefix (``"a/b/"``) of a subpath given as ``"a/b"`` or ``("a", "b")``."""
    if subpath is None:
        return ""
    parts = subpath.split("/") if isinstance(subpath, str) else list(subpath)
    parts = [p for p in parts if p != ""] if isinstance(subpath, str) else parts
    if not all(isinstance(p, str) for p in parts):
        raise InvalidArgumentError(f"subpath must be a str or a tuple of str, got {subpath!r}")
    return "".join(encode_key(p) + "/" for p in parts)


def nest_flat(tree: Mapping[str, Any], sep: str = ".") -> dict[str, Any]:
    """Splits flat names (``"model.layers.0.weight"``) into nested dicts on ``sep``.

    Levels are merged; a name that is both a value and a prefix of other names
    raises :class:`~tdz_numba.InvalidArgumentError`.

    Examples
    --------
    >>> from tdz_numba.archive.state import nest_flat
    >>> nest_flat({"a.b": 1, "a.c": 2, "d": 3})
    {'a': {'b': 1, 'c': 2}, 'd': 3}
    """
    if not isinstance(sep, str) or not sep:
        raise InvalidArgumentError(f"nest must be a non-empty str, got {sep!r}")
    out: dict[str, Any] = {}
    for name, value in tree.items():
        if isinstance(value, Mapping):
            value = nest_flat(value, sep)
        parts = name.split(sep)
        node = out
        for i, part in enumerate(parts[:-1]):
            nxt = node.setdefault(part, {})
            if not isinstance(nxt, dict):
                raise InvalidArgumentError(
                    f"{sep.join(parts[: i + 1])!r} is both a value and a level of {name!r}"
                )
            node = nxt
        last = parts[-1]
        if last in node:
            if isinstance(node[last], dict) and isinstance(value, dict):
                node[last].update(value)
                continue
            raise InvalidArgumentError(f"{name!r} is both a value and a level (splitting on {sep!r})")
        node[last] = value
    return out


def missing_key(where: str, key: object, have: list[str], level: str) -> MissingKeyError:
    """A MissingKeyError that names the level, lists some keys and suggests a close match."""
    shown = ", ".join(repr(k) for k in have[:10]) + (f", ... ({len(have)} keys)" if len(have) > 10 else "")
    text = f"{where}: no key {key!r} in level {level or '<root>'!r}"
    text += f" (keys: {shown})" if have else " (the level is empty)"
    last = key.rsplit("/", 1)[-1] if isinstance(key, str) else None
    close = difflib.get_close_matches(last, have, n=1) if last is not None else []
    if close:
        text += f"; did you mean {close[0]!r}?"
    return MissingKeyError(text)
