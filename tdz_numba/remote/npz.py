"""A remote ``.npz`` opened lazily: the keys come from the central directory (the tail read),
each member's ``.npy`` header when the member is first asked for.

An ``.npz`` keeps each array's dtype and shape in the ``.npy`` header at the start of its
member, spread through the file: reading every header at open costs a request per member
(or reading most of the file). Here the root level's children are a :class:`LazyMembers`
mapping: listing keys, ``len`` and ``in`` need the central directory only; ``ar[key]`` and
``ar.info(key)`` fetch the member's local header, ``.npy`` header and data in one range
(a member up to :data:`WHOLE_MEMBER` bytes; a larger one gets its headers first, its data
when the tensor is made); ``values()``/``items()`` (``load``, ``tdz info``, ``tdz tree``)
fetch every remaining header in one concurrent batch. The local reader
(:func:`~tdz_numba.formats.numpy_fmt.open_npz`) is unchanged: each member's spec is made by
the same :func:`~tdz_numba.formats.numpy_fmt.member_spec`.

Requests (loopback server, 100 members of 16 KiB): open 1 (the 64 KiB tail), one tensor 1
more (its member: bytes = its data + its headers).

Examples
--------
>>> import io, numpy as np, tdz_numba
>>> buf = io.BytesIO()
>>> np.savez(buf, a=np.arange(3), b=np.ones(2))
>>> with tdz_numba.open(buf) as ar:
...     print(list(ar), ar["a"].tolist(), ar.source.remote.requests)  # a small file: one tail read
['a', 'b'] [0, 1, 2] 1
"""

from __future__ import annotations

from collections.abc import ItemsView, Iterator, Mapping, ValuesView
from typing import Any

import numpy as np

from ..errors import TdzError
from ..formats.numpy_fmt import MAX_HEADER, member_spec
from ..tdz.sources import Child, LevelInfo, MappedFile, TreeSource
from ..zipfmt import records
from .object import coalesce, fewer

__all__ = ["LazyMembers", "LazyNpzSource", "open_npz_remote", "WHOLE_MEMBER", "NPY_HEAD"]

#: A member up to this many bytes is fetched whole (headers and data, one range) when first
#: asked for; a larger one gets its headers first (:data:`NPY_HEAD` bytes after its local header).
WHOLE_MEMBER = 1 << 20
#: Bytes read after a STORED member's local header for its ``.npy`` header.
NPY_HEAD = 1024 + 10
#: Bytes read after a deflated member's local header: what its header is inflated from.
DEFLATE_HEAD = MAX_HEADER + 64


class LazyMembers(Mapping):
    """The children of a remote ``.npz``'s root level (``{key: Child}``): keys from the
    central directory, a member's spec made (its headers fetched) when first asked for."""

    def __init__(self, index: Any, file: MappedFile, where: str) -> None:
        self._index, self._file, self._where = index, file, where
        # names are unique (the central directory's check): so are the keys; members that are
        # not arrays are not leaves (as formats.numpy_fmt.open_npz)
        self._rows = {name[: -len(".npy")]: i for i, name in enumerate(index.names) if name.endswith(".npy")}
        self._made: dict[str, Child] = {}

    def __iter__(self) -> Iterator[str]:
        return iter(self._rows)

    def __len__(self) -> int:
        return len(self._rows)

    def __contains__(self, key: object) -> bool:
        return key in self._rows

    def __getitem__(self, key: str) -> Child:
        child = self._made.get(key)
        if child is None:
            i = self._rows[key]  # KeyError: no such member
            self._fetch([i], whole=True)
            child = self._make(key, i)
        return child

    def values(self) -> ValuesView:  # type: ignore[override]  # every child at once
        return self.all().values()

    def items(self) -> ItemsView:  # type: ignore[override]
        return self.all().items()

    def all(self) -> dict[str, Child]:
        """Every child, in member order: the headers not fetched yet in one concurrent batch."""
        todo = [(k, i) for k, i in self._rows.items() if k not in self._made]
        if todo:
            self._fetch([i for _, i in todo], whole=False)
            for k, i in todo:
                self._make(k, i)
        return {k: self._made[k] for k in self._rows}

    def _span(self, i: int, whole: bool) -> tuple[int, int]:
        index = self._index
        a, stop = int(index.table["header_offset"][i]), int(index._limit[i])
        if whole and stop - a <= WHOLE_MEMBER:
            return a, stop
        deflated = int(index.table["method"][i]) != records.STORED
        return index.header_span(i, DEFLATE_HEAD if deflated else NPY_HEAD)

    def _fetch(self, rows: list[int], whole: bool) -> None:
        """The bytes members ``rows`` need for their specs (one coalesced, concurrent batch;
        many small ranges bridged into at most :data:`~tdz_numba.remote.read.HEAD_RANGES`)."""
        from .read import HEAD_GAP, HEAD_RANGES, MAX_GAP, MAX_WASTE

        spans = [self._span(i, whole) for i in rows]
        merged = coalesce(
            np.array([a for a, _ in spans]), np.array([b for _, b in spans]), MAX_GAP, MAX_WASTE
        )
        self._index.obj.need_spans(fewer(merged, HEAD_RANGES, HEAD_GAP), max_gap=0, max_waste=0.0)

    def _make(self, key: str, i: int) -> Child:
        index = self._index
        name = index.names[i]
        try:
            _, spec = member_spec(index, self._file, name, self._where)
        except TdzError:
            a, stop = int(index.table["header_offset"][i]), int(index._limit[i])
            if index.obj.present(a, stop):
                raise
            index.obj.need(a, stop)  # a header longer than guessed: the whole member, then again
            _, spec = member_spec(index, self._file, name, self._where)
        child = self._made[key] = Child(key, "leaf", key, spec)
        return child


class LazyNpzSource(TreeSource):
    """The :class:`~tdz_numba.tdz.sources.TreeSource` of a remote ``.npz``: one level, its
    children a :class:`LazyMembers`."""

    def __init__(self, path: str, file: MappedFile, index: Any) -> None:
        super().__init__("npz", path, {}, files=[file], metadata={})
        self._index = index  # deflated members are read through it
        self._root = LevelInfo(True, LazyMembers(index, file, path), {})  # type: ignore[arg-type]  # a lazy Mapping

    def level(self, prefix: str) -> LevelInfo:
        return self._root if prefix == "" else super().level(prefix)

    def has_level(self, prefix: str) -> bool:
        return prefix == ""


def open_npz_remote(index: Any, file: MappedFile) -> LazyNpzSource:
    """The lazy source of the remote ``.npz`` whose central directory ``index`` holds (a
    :class:`~tdz_numba.remote.read.RemoteIndex`; ``file`` maps the same object)."""
    index.raw_fetches = False
    src = LazyNpzSource(str(index.path), file, index)
    src.path = index.path  # a URL names the source
    return src
