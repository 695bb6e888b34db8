"""Lazy iteration over many leaves that makes them in batches: ``Archive.iter_leaves``,
``items()`` and ``values()`` (every format; a ``.tdz`` where :func:`batched` says so).

A level's children are taken in runs of consecutive leaves; each run is made by
:func:`~tdz_numba.archive.bulk.materialize` in batches of at most :data:`BATCH`
leaves (views: checked and built in one pass each, their bytes hinted ahead in file
order) or, when leaves are copied, cast or moved, of at most :data:`BATCH_BYTES`
bytes, so that iterating stays lazy in memory. A batch that raises is made again one
leaf at a time: the leaves before the bad one are yielded, then the bad one raises
the reader's error, where iterating one by one raised it.

Examples
--------
>>> import tempfile, pathlib, torch
>>> from safetensors.torch import save_file
>>> import tdz_numba
>>> with tempfile.TemporaryDirectory() as d:
...     p = pathlib.Path(d) / "x.safetensors"
...     save_file({"a": torch.zeros(2), "b": torch.ones(3)}, str(p))
...     with tdz_numba.open(p) as ar:
...         print([(k, t.tolist()) for k, t in ar.iter_leaves()], [len(v) for v in ar.values()])
[('a', [0.0, 0.0]), ('b', [1.0, 1.0, 1.0])] [2, 3]
"""

from __future__ import annotations

from collections.abc import ItemsView, Iterator, ValuesView
from typing import Any

from ..errors import TdzError
from ..tdz.sources import paused_gc

__all__ = ["batched", "level_pairs", "leaf_pairs", "LevelItems", "LevelValues", "BATCH", "BATCH_BYTES"]

#: Leaves made in one batch (views).
BATCH = 4096
#: Bytes made in one batch when leaves are copied, cast or moved to a device.
BATCH_BYTES = 64 << 20


def batched(node: Any) -> bool:
    """Whether ``node``'s leaves are iterated in batches: those of every format but ``.tdz``, and
    those of a ``.tdz`` of STORED entries read as views (a batch then holds no memory of its
    own: an open + ``items()`` of 20,000 leaves ~100 ms, not ~400 one by one). A ``.tdz`` with
    compressed entries, or read as copies, cast or moved, makes each leaf on access (a batch
    would inflate or copy up to :data:`BATCH` leaves at once, whatever their sizes)."""
    state = node._state
    source = state.source
    if not hasattr(source, "tensors"):
        return True
    return not _heavy(state) and not source.has_compressed()


def _heavy(state: Any) -> bool:
    """Whether leaves are copied, cast or moved (each then owns memory)."""
    return bool(state.copy or state.device is not None or state.dtype is not None)


def _made(node: Any, names: list[str], leaves: list[Any]) -> Iterator[tuple[str, Any]]:
    """``(name, tensor)`` of a run of leaves of ``node``'s level, made in batches."""
    from .bulk import materialize

    state = node._state
    heavy = _heavy(state)
    n = len(leaves)
    resolve = getattr(state.source, "resolve", None)  # (a .tdz: its local headers in one pass)
    if resolve is not None and n > BATCH:
        resolve(leaves)
    start = 0
    while start < n:
        stop = min(n, start + BATCH)
        if heavy:
            size, stop = 0, start
            while stop < n and (stop == start or size < BATCH_BYTES) and stop - start < BATCH:
                size += int(getattr(leaves[stop], "nbytes", 0) or 0)
                stop += 1
        batch = leaves[start:stop]
        try:
            made: list[Any] | None = materialize(node, batch)
        except TdzError:
            made = None
        if made is None:  # one by one: the leaves before the bad one, then its error
            for name, leaf in zip(names[start:stop], batch):
                yield name, node._deliver(node._tensor(leaf))
        else:
            yield from zip(names[start:stop], made)
        start = stop


def _segments(items: list[tuple[str, Any]]) -> tuple[list[str], list[int]]:
    """The children's kinds, and the positions of those that are not leaves (then ``len``)."""
    with paused_gc():  # a level of many leaves: many small objects
        kinds = [c.kind for _, c in items]
        stops = [i for i, k in enumerate(kinds) if k != "leaf"]
    stops.append(len(items))
    return kinds, stops


def level_pairs(node: Any) -> Iterator[tuple[str, Any]]:
    """``(key, value)`` of every child of ``node``'s level, in order (``items()``)."""
    items = list(node._level()[1].items())
    _, stops = _segments(items)
    pos = 0
    for stop in stops:
        if stop > pos:
            run = items[pos:stop]
            yield from _made(node, [k for k, _ in run], [c.leaf for _, c in run])
        if stop < len(items):
            key, child = items[stop]
            yield key, node._value(child)
        pos = stop + 1


def leaf_pairs(root: Any) -> Iterator[tuple[str, Any]]:
    """``(path, tensor)`` of every leaf below ``root``, depth first (``iter_leaves``)."""
    items = list(root._level()[1].items())
    kinds, stops = _segments(items)
    stack: list[tuple[str, Any, list[tuple[str, Any]], list[str], list[int], int, int]] = [
        ("", root, items, kinds, stops, 0, 0)
    ]
    while stack:
        prefix, node, items, kinds, stops, pos, s = stack.pop()
        while s < len(stops):
            stop = stops[s]
            if stop > pos:
                run = items[pos:stop]
                with paused_gc():
                    names = [prefix + k for k, _ in run]
                    leaves = [c.leaf for _, c in run]
                yield from _made(node, names, leaves)
            pos, s = stop + 1, s + 1
            if stop < len(items) and kinds[stop] == "level":
                key, child = items[stop]
                stack.append((prefix, node, items, kinds, stops, pos, s))
                sub = node._sub(child.path)
                sub_items = list(sub._level()[1].items())
                sub_kinds, sub_stops = _segments(sub_items)
                stack.append((prefix + key + "/", sub, sub_items, sub_kinds, sub_stops, 0, 0))
                break


class LevelItems(ItemsView):
    """``Archive.items()``: a lazy view whose iteration makes the leaves in batches."""

    def __iter__(self) -> Iterator[tuple[str, Any]]:
        return self._mapping._pairs()  # type: ignore[attr-defined]  # the mapping is an Archive


class LevelValues(ValuesView):
    """``Archive.values()``: a lazy view whose iteration makes the leaves in batches."""

    def __iter__(self) -> Iterator[Any]:
        return (v for _, v in self._mapping._pairs())  # type: ignore[attr-defined]  # an Archive
