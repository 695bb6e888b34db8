"""Bounds on what an archive may claim, checked before anything is allocated or walked.

A leaf's shape (:func:`check_shape`), a nested leaf's sizes
(:func:`check_nested_sizes`) and a ``meta.json`` document (:func:`parse_meta`:
JSON nested too deeply is a :class:`~tdz_numba.errors.BadArchiveError`, not a
``RecursionError``) are checked with overflow-safe arithmetic. Trees of levels
are walked without recursion (:func:`build_levels`, :func:`walk_leaves`), so
their depth is bounded only by the zip format: an entry name has at most
65,535 bytes, hence at most 32,767 nested levels.

Examples
--------
>>> from tdz_numba.tdz.bounds import check_shape
>>> check_shape([3, 0, 5], 8, "leaf")
(3, 0, 5)
"""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any

import numpy as np

from ..errors import BadArchiveError

# 19 digits in a row (an integer orjson may read as a float) found with a C-speed translate + find
# (a regex is ~10x slower): digits become b"1", everything else b" "
_DIGITS_AS_ONES = bytes(0x31 if 0x30 <= i <= 0x39 else 0x20 for i in range(256))
_LONG_DIGITS = b"1" * 19

_orjson_loads: Callable[[bytes], Any] | None
try:  # an optional, faster JSON decoder (the ``fast`` extra)
    from orjson import loads as _orjson_loads
except ImportError:  # pragma: no cover - depends on the environment
    _orjson_loads = None

__all__ = [
    "MAX_NDIM",
    "MAX_NBYTES",
    "shape_ok",
    "shape_nbytes",
    "check_shape",
    "check_nested_sizes",
    "parse_meta",
    "build_levels",
    "walk_leaves",
]

#: Most dimensions a leaf may have (numpy's limit: a leaf must also be a numpy array).
MAX_NDIM = 64
#: Bound on ``itemsize * prod(max(dim, 1))`` of a leaf's shape: its byte size, and
#: every stride, fit in a signed 64-bit int (torch and numpy refuse more).
MAX_NBYTES = 2**63 - 1


def shape_nbytes(shape: list, itemsize: int = 1) -> int:
    """The byte size ``itemsize * prod(shape)`` of a leaf, or -1 unless ``shape`` is a
    list of ints ``>= 0`` whose byte size (and strides, zero dims counted as 1) fit in
    :data:`MAX_NBYTES`, with at most :data:`MAX_NDIM` dims.

    Examples
    --------
    >>> shape_nbytes([2, 0, 3], 4), shape_nbytes([2, -1], 4), shape_nbytes([2**62, 2], 4)
    (0, -1, -1)
    """
    if len(shape) > MAX_NDIM:
        return -1
    bound = nbytes = itemsize
    for s in shape:  # a loop: a generator in all() costs more than the check here
        if type(s) is not int or s < 0:
            return -1
        nbytes *= s
        if s > 1:
            bound *= s
            if bound > MAX_NBYTES:
                return -1
    return nbytes


def shape_ok(shape: list, itemsize: int = 1) -> bool:
    """Whether ``shape`` is a list of ints ``>= 0`` whose byte size (and strides,
    zero dims counted as 1) fit in :data:`MAX_NBYTES`, with at most :data:`MAX_NDIM` dims."""
    return shape_nbytes(shape, itemsize) >= 0


def check_shape(shape: Any, itemsize: int, where: str) -> tuple[int, ...]:
    """``shape`` as a tuple, or :class:`~tdz_numba.errors.BadArchiveError` unless it is a
    list of at most :data:`MAX_NDIM` non-negative ints whose byte size and strides
    (``itemsize * prod(max(dim, 1))``) fit in :data:`MAX_NBYTES`.

    Examples
    --------
    >>> check_shape([2, 3], 4, "x")
    (2, 3)
    >>> check_shape([0, 2**62], 4, "x")
    Traceback (most recent call last):
    ...
    tdz_numba.errors.BadArchiveError: x: bad shape [0, 4611686018427387904] ...
    """
    if type(shape) is not list or not shape_ok(shape, itemsize):
        raise BadArchiveError(
            f"{where}: bad shape {shape!r:.200} (expected a list of at most {MAX_NDIM} "
            f"non-negative ints whose size in bytes, zero dims counted as 1, is below 2**63)"
        )
    return tuple(shape)


def check_nested_sizes(sizes: np.ndarray, itemsize: int, where: str) -> int:
    """Number of elements of a nested leaf from its ``(n, ndim)`` int64 sizes, or
    :class:`~tdz_numba.errors.BadArchiveError` for a negative size or a component
    (or the whole) whose byte size or strides would not fit in 64 bits.

    Examples
    --------
    >>> import numpy as np
    >>> check_nested_sizes(np.array([[2, 3], [4, 3]]), 4, "x")
    18
    """
    if sizes.size == 0:
        return 0
    if (sizes < 0).any():
        raise BadArchiveError(f"{where}: negative nested sizes")
    # float estimates first (never overflow), exact int64 products only when they fit
    per = np.prod(np.maximum(sizes, 1).astype(np.float64), axis=-1) * itemsize
    if per.max() > 2.0**62 or float(np.prod(sizes.astype(np.float64), axis=-1).sum()) * itemsize > 2.0**62:
        raise BadArchiveError(f"{where}: nested sizes too large (over 2**62 bytes)")
    return int(sizes.prod(-1).sum())


def parse_meta(raw: bytes, where: str | Callable[[str], str], name: str = "") -> Any:
    """A ``meta.json`` decoded: :class:`~tdz_numba.errors.BadArchiveError` for bytes
    that are not UTF-8 JSON, including JSON nested too deeply to parse.

    ``where`` names the document in a message: a string, or a function that makes it from
    ``name`` (called on an error only: an open of a valid file builds no message text).

    With `orjson <https://github.com/ijl/orjson>`_ installed (the ``fast``
    extra) documents are decoded by it, 2-3x faster than :mod:`json`; what it
    refuses (``NaN``, ``1e400``, lone surrogates, ...) and documents with a run
    of 19 or more digits (it reads integers beyond 64 bits as floats) are
    decoded by :mod:`json`, so the result is the same either way.
    """
    if _orjson_loads is not None and _LONG_DIGITS not in raw.translate(_DIGITS_AS_ONES):
        try:
            return _orjson_loads(raw)
        except (ValueError, TypeError):
            pass
    try:
        return json.loads(raw.decode("utf-8"))
    except (UnicodeDecodeError, ValueError) as exc:
        raise BadArchiveError(f"{_place(where, name)}: not valid JSON: {exc}") from None
    except RecursionError:
        raise BadArchiveError(f"{_place(where, name)}: not valid JSON: nested too deeply") from None


def _place(where: str | Callable[[str], str], name: str) -> str:
    return where if isinstance(where, str) else where(name)


def build_levels(
    root: Any, expand: Callable[[Any], tuple[dict, list[tuple[str, Any]]]], is_node: Callable[[Any], bool]
) -> dict:
    """A nested dict of ``root`` built without recursion (any depth).

    ``expand(node)`` gives a new container and the ``(key, value)`` items of
    ``node``; values for which ``is_node`` holds are expanded in turn, the
    others are stored as they are. Keys keep the order of the items.

    Examples
    --------
    >>> tree = {"a": {"b": 1}, "c": 2}
    >>> build_levels(tree, lambda n: ({}, list(n.items())), lambda v: isinstance(v, dict))
    {'a': {'b': 1}, 'c': 2}
    """
    top, items = expand(root)
    todo = [(top, items)]
    while todo:
        container, items = todo.pop()
        for key, value in items:
            if is_node(value):
                child, child_items = expand(value)
                container[key] = child
                todo.append((child, child_items))
            else:
                container[key] = value
    return top


def walk_leaves(root: Any, children: Callable[[Any], list[tuple[str, str, Any]]]) -> Any:
    """``(path, leaf)`` pairs below ``root``, depth first, without recursion.

    ``children(node)`` gives ``(key, kind, item)`` triples: ``kind == "leaf"``
    yields ``item``, ``kind == "level"`` descends into it, others are skipped.

    Examples
    --------
    >>> tree = {"a": {"b": 1}, "c": 2}
    >>> kids = lambda n: [(k, "level" if isinstance(v, dict) else "leaf", v) for k, v in n.items()]
    >>> list(walk_leaves(tree, kids))
    [('a/b', 1), ('c', 2)]
    """
    stack = [("", iter(children(root)))]
    while stack:
        prefix, it = stack[-1]
        for key, kind, item in it:
            if kind == "leaf":
                yield prefix + key, item
            elif kind == "level":
                stack.append((prefix + key + "/", iter(children(item))))
                break
        else:
            stack.pop()
