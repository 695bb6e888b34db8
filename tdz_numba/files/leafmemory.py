"""Per-leaf memory control of an opened file: evict, prefetch, residency, streaming, capabilities.

:class:`LeafMemory` is mixed into :class:`~tdz_numba.Archive`: it finds the
byte range of a leaf (or of every leaf below a level) in its file's single
mapping and applies :mod:`tdz_numba.files.memory` to exactly that range, so a leaf's
pages can be dropped without touching its neighbours, brought in ahead of use,
or measured; :meth:`LeafMemory.stream` walks a file larger than memory with a
bounded resident set.

Examples
--------
>>> import tempfile, pathlib, torch, tdz_numba
>>> with tempfile.TemporaryDirectory() as d:
...     p = tdz_numba.save({"a": torch.ones(1 << 20), "b": torch.zeros(1 << 20)},
...                        pathlib.Path(d) / "x.tdz", align="auto")
...     with tdz_numba.open(p) as ar:
...         total = sum(float(t.sum()) for _, t in ar.stream())   # prefetch next, evict done
...         _ = ar.prefetch("a", touch=True)
...         print(total, ar.resident("a"), ar.info("a").evictable, ar.caps.evict)
...         _ = ar.evict("a")
...         print(ar.resident("a"))
1048576.0 1.0 True True
0.0
"""

from __future__ import annotations

import mmap
from collections.abc import Iterator
from typing import Any, NamedTuple

from ..errors import MissingKeyError, UnsupportedError
from . import memory

__all__ = ["Caps", "LeafMemory", "leaf_caps"]


class Caps(NamedTuple):
    """What a file or a leaf supports, in the spirit of ztensor's ``Caps``.

    ``map``: leaves are views of a memory map (zero-copy); ``evict``: their pages
    can be dropped one leaf at a time without touching a neighbour (payloads start
    on a page and cover whole pages); ``verify``: the file records checksums
    (zip CRC-32) that :func:`tdz_numba.verify` checks; ``alignment``: the largest
    power of two (up to 64 KiB) that every payload offset is a multiple of.
    """

    map: bool
    evict: bool
    verify: bool
    alignment: int


def _alignment_of(offsets: list[int]) -> int:
    align = 1 << 16
    for off in offsets:
        while align > 1 and off % align:
            align >>= 1
    return align if offsets else 0


def leaf_caps(info: Any, verifiable: bool) -> Caps:
    """The :class:`Caps` of one leaf from its :class:`~tdz_numba.LeafInfo`."""
    offset = info.offset if info.offset is not None else -1
    mapped = bool(info.zero_copy)
    evict = mapped and memory.is_evictable(offset, info.stored_nbytes)
    return Caps(
        mapped, evict, verifiable and info.crc is not None, _alignment_of([offset]) if offset >= 0 else 0
    )


class _Range(NamedTuple):
    key: str
    mm: mmap.mmap
    offset: int
    nbytes: int
    file: str
    shared: bool


class LeafMemory:
    """Memory control methods of :class:`~tdz_numba.Archive` (see the module docstring)."""

    # -- where a leaf's bytes are -------------------------------------------------------
    def _mapping(self, file: str) -> tuple[mmap.mmap, bool]:
        source = self._state.source  # type: ignore[attr-defined]
        index = getattr(source, "index", None)
        if index is not None and getattr(index, "_mmap", None) is not None and str(index.path) == file:
            return index._mmap, getattr(source, "mode", "r") == "r+"
        for f in getattr(source, "files", []):
            if str(f.path) == file and getattr(f, "_mmap", None) is not None:
                return f._mmap, bool(getattr(f, "writable", False))
        raise UnsupportedError(f"{self.path}: {file} is not memory-mapped here (a remote or copied source)")  # type: ignore[attr-defined]

    def _ranges(self, key: str | tuple[str, ...] | None) -> list[_Range]:
        """The mapped byte ranges of leaf ``key``, or of every leaf below level ``key``
        (None: this level), in file order. Leaves that are not views of a mapping
        (compressed, copied) are skipped."""
        node: Any  # an Archive (this mixin's host class)
        if key is None:
            node, keys = self, [k for k, _ in self.leaves()]  # type: ignore[attr-defined]
        else:
            value_node, child = self._resolve(key)  # type: ignore[attr-defined]
            if child.kind == "leaf":
                node, keys = value_node, [child.key]
            elif child.kind == "level":
                node = value_node._sub(child.path)
                keys = [k for k, _ in node.leaves()]
            else:
                raise MissingKeyError(f"{self.where()}: {key!r} is neither a leaf nor a level")  # type: ignore[attr-defined]
        out = []
        for k in keys:
            info = node.info(k)
            if not info.zero_copy or info.location is None or not info.stored_nbytes:
                continue
            mm, shared = self._mapping(info.location.file)
            out.append(_Range(k, mm, info.location.offset, info.location.nbytes, info.location.file, shared))
        out.sort(key=lambda r: (r.file, r.offset))
        return out

    # -- the public methods ---------------------------------------------------------------
    def evict(self, key: str | tuple[str, ...] | None = None, *, drop_cache: bool = False) -> int:
        """Drops the pages of leaf ``key`` (or of every leaf below level ``key``; None:
        this level) from this process's memory (``madvise(MADV_DONTNEED)``); returns the
        bytes dropped.

        Only pages that lie entirely inside a leaf's payload are dropped, so a
        neighbour's bytes are never touched; leaves saved with ``align="auto"`` (big
        ones) or a page ``align`` cover whole pages (``info(k).evictable``). With
        ``mode="r+"`` the pages are flushed to the file first: nothing written is
        lost. With ``mode="r"`` (a private mapping) in-place changes to those pages
        are DISCARDED: the file's bytes come back on the next access. Tensors already
        obtained stay valid: their pages are read again when touched.

        The kernel may keep the file's pages in its page cache (reclaimed under
        pressure). ``drop_cache=True`` also asks it to drop them
        (``posix_fadvise(DONTNEED)``); the page cache works in folios that can span
        leaves (measured on ext4 here: dropping one 1 MiB leaf's range unmapped its
        neighbours too), so that option can make neighbours fault in again (their
        bytes are never changed).
        """
        return sum(
            memory.evict(r.mm, r.offset, r.nbytes, file=r.file if drop_cache else None, shared=r.shared)
            for r in self._ranges(key)
        )

    def prefetch(self, key: str | tuple[str, ...] | None = None, *, touch: bool = False) -> int:
        """Asks the kernel to read leaf ``key`` (or every leaf below level ``key``; None:
        this level) ahead (``MADV_WILLNEED``); with ``touch=True`` every page is also
        read in parallel and the call returns once they are resident. Returns the bytes
        covered."""
        ranges = self._ranges(key)
        for r in ranges:
            memory.prefetch(r.mm, r.offset, r.nbytes, touch=touch)
        return sum(r.nbytes for r in ranges)

    def resident(self, key: str | tuple[str, ...]) -> float:
        """Fraction (0.0 to 1.0) of the pages of leaf ``key`` (or of every leaf below level
        ``key``) that are in this process's memory; 1.0 for leaves that are not mapped
        (copied or inflated: they live in memory)."""
        ranges = self._ranges(key)
        total = sum(r.nbytes for r in ranges)
        if not total:
            return 1.0
        return sum(memory.resident(r.mm, r.offset, r.nbytes) * r.nbytes for r in ranges) / total

    def stream(
        self, keys: list[str] | None = None, *, prefetch: int = 1, evict: bool = True
    ) -> Iterator[tuple[str, Any]]:
        """``(key, tensor)`` for every leaf below this level (or ``keys``), in file order,
        in bounded memory.

        The next ``prefetch`` leaves are read ahead while the caller works on one;
        with ``evict=True`` each leaf's pages are dropped once the caller asks for the
        next one (so keep no reference you still need: a kept tensor is read again
        from the file when touched). Peak resident memory stays near the largest
        leaf (times ``prefetch + 1``) however large the file, where :meth:`to_dict`
        keeps every page it touched. See :meth:`evict` for ``mode="r"`` writes.
        """
        if prefetch < 0:
            from ..errors import InvalidArgumentError

            raise InvalidArgumentError(f"prefetch must be >= 0, got {prefetch!r}")
        wanted = [k for k, _ in self.leaves()] if keys is None else list(keys)  # type: ignore[attr-defined]
        order = []
        for k in wanted:
            info = self.info(k)  # type: ignore[attr-defined]
            where = (info.location.file, info.location.offset) if info.location is not None else ("", -1)
            order.append((where, k, info))
        order.sort(key=lambda t: t[0])
        ranges: list[_Range | None] = []
        for _, k, info in order:
            mapped = info.zero_copy and info.location is not None and info.stored_nbytes > 0
            if mapped:
                mm, shared = self._mapping(info.location.file)
                ranges.append(
                    _Range(k, mm, info.location.offset, info.location.nbytes, info.location.file, shared)
                )
            else:
                ranges.append(None)
        for i, (_, k, _info) in enumerate(order):
            for r in ranges[i + 1 : i + 1 + prefetch]:
                if r is not None:
                    memory.prefetch(r.mm, r.offset, r.nbytes)
            yield k, self._stream_value(k)  # type: ignore[attr-defined]
            r = ranges[i]
            if evict and r is not None:
                memory.evict(r.mm, r.offset, r.nbytes, shared=r.shared)

    def _stream_value(self, key: str) -> Any:
        """Leaf ``key`` as :meth:`stream` yields it: never kept in the archive's cache."""
        node, child = self._resolve(key)  # type: ignore[attr-defined]
        make = getattr(self._state.source, "tensor", None)  # type: ignore[attr-defined]
        state = self._state  # type: ignore[attr-defined]
        if child.kind != "leaf" or make is None or state.device is not None:
            return node._value(child)
        return node._deliver(make(child.leaf, cache=False))

    @property
    def caps(self) -> Caps:
        """The :class:`Caps` of the whole file: every leaf's capability must hold."""
        infos = [self.info(k) for k, _ in self.leaves()]  # type: ignore[attr-defined]
        source = self._state.source  # type: ignore[attr-defined]
        verifiable = getattr(source, "format", "") in ("tdz", "torch", "npz")
        caps = [leaf_caps(i, verifiable) for i in infos]
        offsets = [i.offset for i in infos if i.offset is not None and i.zero_copy]
        return Caps(
            bool(caps) and all(c.map for c in caps),
            bool(caps) and all(c.evict for c in caps),
            verifiable,
            _alignment_of(offsets),
        )
