"""The ``.tdz`` source: lazy ``meta.json`` levels and leaf tensors over one mapping.

:class:`TdzSource` is what :class:`~tdz_numba.Archive` navigates for a
``.tdz`` file (every other format gives a :class:`~tdz_numba.tdz.sources.TreeSource`).
Opening parses the end records and the central directory; a level's
``meta.json`` is parsed the first time the level is reached; a leaf tensor is
created the first time it is asked for, alone (:meth:`TdzSource.tensor`) or
together with many others (:meth:`TdzSource.tensors`: one vectorized pass over
their index rows, then one ``as_strided`` call per leaf on a typed view of the
whole mapping, below autograd's view tracking: each leaf its own tensor with its
own version counter, see :func:`~tdz_numba.tdz.sources.own_views`). :meth:`TdzSource.check_leaf` is the leaf check that
:func:`~tdz_numba.verify` runs.

Examples
--------
>>> import tempfile, pathlib, torch, tdz_numba
>>> from tdz_numba.tdz.source import TdzSource
>>> with tempfile.TemporaryDirectory() as d:
...     p = tdz_numba.save({"a": torch.arange(3)}, pathlib.Path(d) / "x.tdz")
...     src = TdzSource(p)
...     lvl = src.level("")
...     print(lvl.keyed, list(lvl.children), src.tensor(lvl.children["a"].leaf).tolist())
...     src.close()
True ['a'] [0, 1, 2]
"""

from __future__ import annotations

import math
import os
from pathlib import Path
from typing import Any

import numpy as np
import torch

from ..errors import BadArchiveError, InvalidArgumentError, UnsupportedError
from ..zipfmt import records
from ..zipfmt.index import ArchiveIndex
from ..zipfmt.records import Col
from . import sources as _sources
from .bounds import parse_meta
from .dtypes import dtype_table, torch_dtype
from .nested import nested_shapes, nested_tensor
from .plainlevel import (
    SCAN_MIN,
    PlainLevel,
    children_of_plain,
    contiguous_strides,
    is_plain_td,
    plain_children,
    plain_level,
    plain_level_of,
    plain_td_level,
    quick_leaves,
    quick_views,
    scan_td_level,
)
from .sources import Child, LeafInfo, LevelInfo, Location, Source, leaf_view, own_views, paused_gc
from .tree import LeafSpec, Level, PickledData, RawFile, describe_level

__all__ = ["PICKLE_SUFFIXES", "TdzSource", "METADATA_ENTRY"]

DTYPES = dtype_table()
#: The entry ``save(..., metadata=)`` writes: a top-level file that tensordict
#: (which reads only the keys its meta.json lists) ignores.
METADATA_ENTRY = "__metadata__.json"
#: Names of the files in which tensordict keeps pickled non-tensor data.
PICKLE_SUFFIXES = (".pickle", ".pkl")


def _from_bytes(data: np.ndarray, dtype: torch.dtype, shape: tuple[int, ...]) -> torch.Tensor:
    """A tensor over a new uint8 buffer (inflated data)."""
    if data.size == 0:
        return torch.empty(shape, dtype=dtype)
    return torch.from_numpy(data).view(dtype).view(shape)


class TdzSource(Source):
    """A ``.tdz`` archive as a :class:`~tdz_numba.tdz.sources.Source`: levels are
    parsed from ``meta.json`` lazily, leaves are views of the one mapping.

    Parameters
    ----------
    path : str or os.PathLike
        The archive.
    mode : {"r", "r+"}
        Private (copy-on-write) or shared mapping.
    allow_pickle : bool
        Unpickle ``*.pickle`` / ``*.pkl`` files when read.
    num_threads : int, optional
        Threads that inflate compressed leaves.

    Raises
    ------
    BadArchiveError
        Not a zip archive, or no top-level ``meta.json``.
    """

    format = "tdz"
    #: Whether :meth:`check_level` also makes the :class:`~tdz_numba.tdz.plainlevel.PlainLevel` of
    #: a plain level (one walk of its ``meta.json``: what a load then reads), or only checks it (an
    #: open, whose levels may never be loaded whole: :meth:`quick_level` makes it when asked).
    keep_plain = False

    def __init__(
        self,
        path: str | os.PathLike,
        *,
        mode: str = "r",
        allow_pickle: bool = False,
        num_threads: int | None = None,
        index: ArchiveIndex | None = None,
    ) -> None:
        self.index = index if index is not None else ArchiveIndex(path, writable=mode == "r+")
        self.path = self.index.path
        self.mode = mode
        self.allow_pickle = allow_pickle
        self.num_threads = num_threads
        self.files = []
        self._levels: dict[str, LevelInfo] = {}
        self._checked: dict[str, dict[str, Any] | None] = {}  # prefix -> a plain meta.json (None: scanned)
        # prefix -> its plain_level (check_level), or ``(meta,)``: checked, its PlainLevel made on use
        self._checked_plain: dict[str, PlainLevel | tuple[Any] | None] = {}
        self._tensors: dict[str, torch.Tensor] = {}
        self._typed: dict[torch.dtype, torch.Tensor] = {}
        self._kinds: dict[str, tuple[int, torch.Tensor]] = {}
        self._plain: dict[bytes, PlainLevel | None] = {}  # meta.json text -> what it says
        self._columns: tuple[np.ndarray, list[int], list[int], list[int]] | None = None
        self._metadata: dict[str, Any] | None = None
        #: A remote index's ``fetch`` (None for a local file): a leaf's bytes are fetched before use.
        self._fetch = getattr(self.index, "fetch", None)
        if "meta.json" not in self.index:
            self.index.close()
            raise BadArchiveError(f"{path}: not a tensor archive: no top-level meta.json entry")

    # -- metadata and levels ------------------------------------------------------------
    @property
    def metadata(self) -> dict[str, Any]:  # type: ignore[override]
        """What ``save(..., metadata=)`` stored (``{}`` when nothing was)."""
        if self._metadata is None:
            meta: dict[str, Any] = {}
            if METADATA_ENTRY in self.index:
                meta = parse_meta(self.index.read_bytes(METADATA_ENTRY), self.where(METADATA_ENTRY))
                if not isinstance(meta, dict):
                    raise BadArchiveError(f"{self.path}: {METADATA_ENTRY}: expected a JSON object")
            self._metadata = meta
        return self._metadata

    def where(self, name: str = "") -> str:
        """``"<file>: <name>"`` for messages."""
        return f"{self.path}: {name or '<root>'}"

    def has_level(self, prefix: str) -> bool:
        return prefix + "meta.json" in self.index

    def level(self, prefix: str) -> LevelInfo:
        """The level at ``prefix`` (``""``, ``"a/"``, ``"a/b/"``): its meta.json checked once
        (:meth:`check_level`: a large one scanned), its children made from what that kept."""
        cached = self._levels.get(prefix)
        if cached is not None:
            return cached
        with paused_gc():  # a level of 20,000 leaves: 60,000 new containers (a collector's pass: ~150 ms)
            if prefix not in self._checked:
                self.check_level(prefix)
                if (cached := self._levels.get(prefix)) is not None:
                    return cached  # (not a plain level: described there)
            meta = self._checked.pop(prefix)
            if meta is None:  # (scanned: parsed for the level's own meta only)
                meta = parse_meta(self._meta_bytes(prefix), self.where(prefix + "meta.json"))
            plain = self._checked_plain.get(prefix)  # (its columns: no walk of meta)
            kids = (
                children_of_plain(plain, prefix)
                if type(plain) is PlainLevel
                else plain_children(meta, prefix)
            )
            result = self._levels[prefix] = tuple.__new__(LevelInfo, (True, kids, meta))
        return result

    def check_level(self, prefix: str) -> None:
        """Raises what :meth:`level` would raise for the level at ``prefix``, building only
        what a level that is not plain needs: a plain TensorDict level
        (:func:`~tdz_numba.tdz.plainlevel.is_plain_td`) is kept parsed, its children made
        on first use (open reads the root ``meta.json`` this way)."""
        if prefix in self._levels or prefix in self._checked:
            return
        has = self.index.__contains__
        data = self._meta_bytes(prefix)  # in tensordict's layout: scanned (level() parses it if asked)
        # (a text below SCAN_MIN is parsed: scan_td_level's own first test, without the call)
        plain: PlainLevel | tuple[Any] | None = (
            scan_td_level(data, prefix, has) if len(data) >= SCAN_MIN else None
        )
        meta, ok = None, True
        if plain is None:  # (not scanned; a text "null" parses to None too: checked as parsed)
            meta = parse_meta(data, self.where, prefix + "meta.json")  # (the place made on error only)
            if self.keep_plain:  # a load: the PlainLevel that quick_level reads, in the same walk
                ok, plain = plain_td_level(meta, prefix, has)
            else:  # checked only: quick_level makes the PlainLevel if it is asked for
                ok, plain = is_plain_td(meta, prefix, has), (meta,)
        if ok:
            self._checked[prefix], self._checked_plain[prefix] = meta, plain
        else:
            self._describe(meta, prefix)

    def _meta_bytes(self, prefix: str) -> bytes:  # (the bytes of the meta.json at prefix)
        if (meta_name := prefix + "meta.json") not in self.index:
            raise BadArchiveError(f"{self.where(prefix)}: no meta.json entry {meta_name!r}")
        return self.index.read_bytes(meta_name)

    def _describe(self, meta: Any, prefix: str) -> LevelInfo:
        """The level at ``prefix`` by :func:`~tdz_numba.tdz.tree.describe_level` (any level; its errors)."""
        index = self.index
        keyed, children = describe_level(
            meta,
            prefix,
            lambda: index.listing(prefix),
            lambda sub: sub + "meta.json" in index or index.is_dir(sub),
            self.where(prefix + "meta.json"),
        )
        result = self._levels[prefix] = LevelInfo(keyed, {c.key: c for c in children}, meta)
        return result

    def quick_level(self, prefix: str, tensors: bool = True) -> tuple[Level, list[tuple[str, str]]] | None:
        """The level at ``prefix`` in one pass, for :func:`~tdz_numba.archive.bulk.build_tree`, when
        it is the common case: ``(level, subs)``, the :class:`~tdz_numba.tdz.tree.Level` of its
        leaves (sub-levels hold None) and ``(key, "a/b/")`` of each sub-level.

        The common case is a plain TensorDict level
        (:func:`~tdz_numba.tdz.plainlevel.plain_level`) whose leaves are STORED, aligned
        and of the size their shape says. Anything else gives None, and the caller
        takes the general path (:meth:`level`, :meth:`tensors`), which also names what
        is wrong. Each distinct ``meta.json`` text is parsed once per source; leaf views
        are cached as :meth:`tensors` caches them; the level is not.
        ``tensors=False`` only checks (:func:`~tdz_numba.verify`): the leaves are None.
        """
        index = self.index
        if self.mode != "r" or getattr(index, "fetch", None) is not None:
            return None  # a remote index fetches bytes per batch: the general path does that
        parsed = self._levels.get(prefix)
        meta_name = prefix + "meta.json"
        if prefix in self._checked_plain:  # (check_level's: the meta.json it kept, walked once)
            kept = self._checked_plain[prefix]
            if isinstance(kept, tuple):  # (checked by an open: made now, from the meta.json it parsed)
                plain = self._checked_plain[prefix] = plain_level(kept[0])
            else:
                plain = kept
        elif parsed is not None:
            plain = plain_level(parsed.meta)
        elif meta_name in index:
            plain = plain_level_of(self._plain, index.read_bytes(meta_name), self.where(meta_name))
        else:
            return None
        if plain is None:
            return None
        if not prefix and not index.local_checked:
            try:
                index.check_all()  # the whole archive: every local header in one kernel pass
            except BadArchiveError:  # somewhere: the general path reads the headers of the
                return None  # leaves it needs, and names what is wrong with them
        if tensors and (fast := quick_views(self, plain, prefix)) is not None:
            return fast  # a level of leaves only: in passes over all of them
        return quick_leaves(self, plain, prefix, tensors)  # (else: leaf by leaf)

    def _kind(self, name: str) -> tuple[int, torch.Tensor]:
        """``(itemsize, typed view)`` of a plain dtype name (one of :data:`DTYPES`)."""
        dtype = DTYPES[name]
        kind = self._kinds[name] = (dtype.itemsize, self._typed_view(dtype))
        return kind

    def parsed_levels(self) -> set[str]:
        """Prefixes of the levels parsed so far (open is lazy: only what was reached)."""
        return set(self._levels) | set(self._checked)

    def read_bytes(self, name: str) -> bytes:
        """The uncompressed bytes of entry ``name`` (CRC checked)."""
        return self.index.read_bytes(name)

    def file_value(self, child: Child) -> Any:
        """A non-payload file of a level: :class:`RawFile`, or :class:`PickledData`
        (unpickled when the source allows pickle)."""
        data = self.index.read_bytes(child.path)
        if child.path.endswith(PICKLE_SUFFIXES):
            pickled = PickledData(data)
            return pickled.load(allow_pickle=True) if self.allow_pickle else pickled
        return RawFile(data)

    # -- leaves ------------------------------------------------------------------------------
    def _refuse_rw(self, leaf: LeafSpec, why: str) -> None:
        if self.mode == "r+":
            raise UnsupportedError(
                f"{self.path}: leaf {leaf.key!r} ({leaf.entry}) {why}, so it cannot be "
                f"written through with mode='r+'; open with mode='r' or re-save the archive"
            )

    def _typed_view(self, dtype: torch.dtype) -> torch.Tensor:
        """The whole mapping as one tensor of ``dtype`` (leaves are ``as_strided`` on it)."""
        typed = self._typed.get(dtype)
        if typed is None:
            base = self.index.torch_storage
            size = self.index.size - self.index.size % dtype.itemsize
            typed = (base[:size] if size < len(base) else base).view(dtype) if dtype != torch.uint8 else base
            self._typed[dtype] = typed
        return typed

    def tensor(self, leaf: LeafSpec, copy: bool = False, cache: bool = True) -> torch.Tensor:
        """The tensor of one leaf (cached; ``copy=True``: an owned copy, not cached;
        ``cache=False``: not kept (a streamed, inflated leaf is freed with its last reference))."""
        cached = self._tensors.get(leaf.entry)
        if cached is None:
            cached = self._make_leaf(leaf)
            if cache:
                self._tensors[leaf.entry] = cached
        return cached.clone() if copy else cached

    def _make_leaf(self, leaf: LeafSpec) -> torch.Tensor:
        index = self.index
        dtype = DTYPES.get(leaf.dtype) if type(leaf.dtype) is str else None
        i = index.row(leaf.entry)
        if self._fetch is not None and i is not None:  # a remote archive: the entry's bytes, CRC checked
            self._fetch([i])
        if dtype is not None and i is not None and not leaf.nested:
            # the common case, kept lean: one view into the file's single mapping
            r = index.row_at(i)
            method, size, offset = r.method, r.size, r.payload_offset
            if offset < 0:
                offset = index.payload_offset(i)
            itemsize = dtype.itemsize
            if method == 0 and offset % itemsize == 0 and size == math.prod(leaf.shape) * itemsize:
                with own_views():
                    return leaf_view(
                        self._typed_view(dtype),
                        leaf.shape,
                        contiguous_strides(leaf.shape),
                        offset // itemsize,
                    )
        dtype = torch_dtype(leaf.dtype, entry=self.where(leaf.entry))
        if leaf.nested:
            self._refuse_rw(leaf, "is a nested tensor (materialized in memory)")
            return self.nested_leaf(leaf, dtype)
        nbytes = math.prod(leaf.shape) * dtype.itemsize
        if leaf.entry not in index:
            if nbytes == 0:
                return torch.empty(leaf.shape, dtype=dtype)
            raise BadArchiveError(
                f"{self.where(leaf.entry)}: leaf {leaf.key!r} of shape {list(leaf.shape)} "
                f"needs {nbytes} bytes but the archive has no entry {leaf.entry!r}"
            )
        e = index.entry(leaf.entry)
        if e.size != nbytes:
            raise BadArchiveError(
                f"{self.where(leaf.entry)}: leaf {leaf.key!r} ({leaf.dtype}, shape "
                f"{list(leaf.shape)}): expected {nbytes} bytes, the entry holds {e.size}"
            )
        if nbytes == 0:
            return torch.empty(leaf.shape, dtype=dtype)
        if e.method != records.STORED:
            self._refuse_rw(leaf, f"is compressed ({records.METHOD_NAMES[e.method]})")
            if e.method == records.DEFLATED:
                data = index.inflate([e], self.num_threads)[0]
            else:
                data = index.read(leaf.entry)
            return _from_bytes(data, dtype, leaf.shape)
        # STORED but not aligned for its dtype (a foreign zip): copy
        self._refuse_rw(leaf, f"is not aligned (payload at offset {e.payload_offset})")
        flat = index.torch_storage[e.payload_offset : e.payload_offset + nbytes].clone()
        return flat.view(dtype).view(leaf.shape)

    def nested_leaf(self, leaf: LeafSpec, dtype: torch.dtype) -> torch.Tensor:
        """A nested tensor from its values and ``.shape.memmap`` entries (a copy): :func:`.nested.nested_tensor`."""
        return nested_tensor(self.index, leaf, dtype, self.where)

    def nested_shapes(self, leaf: LeafSpec) -> list[list[int]] | None:
        """The component shapes of a nested leaf (from its small ``.shape.memmap``), or None."""
        return nested_shapes(self.index, leaf)

    def check_leaf(self, leaf: LeafSpec) -> None:
        """Raises :class:`BadArchiveError` unless the leaf's entry holds the bytes its
        dtype and shape need (nested leaves are decoded). Used by :func:`~tdz_numba.verify`."""
        dtype = DTYPES.get(leaf.dtype) if type(leaf.dtype) is str else None
        if dtype is None:
            dtype = torch_dtype(leaf.dtype, entry=self.where(leaf.entry))
        if leaf.nested:
            self.nested_leaf(leaf, dtype)
            return
        nbytes = math.prod(leaf.shape) * dtype.itemsize
        index = self.index
        row = index.row(leaf.entry)
        found = int(index.columns[row, Col.SIZE]) if row is not None else 0
        if found != nbytes:
            raise BadArchiveError(
                f"{self.where(leaf.entry)}: leaf {leaf.key!r} ({leaf.dtype}, shape "
                f"{list(leaf.shape)}): expected {nbytes} bytes, the archive holds {found}"
            )

    def leaf_info(self, leaf: LeafSpec) -> LeafInfo:
        """Storage details of one leaf (no payload read)."""
        dtype = torch_dtype(leaf.dtype, entry=self.where(leaf.entry))
        index = self.index
        if leaf.entry in index:
            e = index.entry(leaf.entry)
            method = records.METHOD_NAMES[e.method]
            zero = method == "stored" and not leaf.nested and e.payload_offset % dtype.itemsize == 0
            loc = Location(str(self.path), e.payload_offset, e.compressed_size)
            return LeafInfo(
                leaf.key,
                leaf.entry,
                dtype,
                leaf.shape,
                e.payload_offset,
                e.size,
                e.compressed_size,
                method,
                e.crc,
                leaf.nested,
                zero,
                loc,
                leaf.dtype,
                _hex(index.digest(leaf.entry)),
            )
        return LeafInfo(
            leaf.key,
            None,
            dtype,
            leaf.shape,
            None,
            0,
            0,
            "stored",
            None,
            leaf.nested,
            False,
            None,
            leaf.dtype,
        )

    # -- many leaves at once ---------------------------------------------------------------
    def has_compressed(self) -> bool:
        return bool((self.index.table["method"] != records.STORED).any())

    def resolve(self, leaves: list[LeafSpec]) -> None:
        """Reads the local headers of the leaves' entries that are still unread, in one kernel
        pass when they are most of the archive (an iteration over them, made in batches)."""
        self._payloads(leaves)

    def prefetch(self, leaves: list[LeafSpec]) -> None:
        """Inflates every DEFLATE leaf of ``leaves`` in one parallel batch."""
        index = self.index
        if not (index.table["method"] == records.DEFLATED).any():
            return  # nothing to inflate: do not walk the leaves
        todo, specs = [], []
        for leaf in leaves:
            if leaf.nested or leaf.entry in self._tensors:
                continue
            row = index.row(leaf.entry)
            if row is not None and index.row_at(row).method == records.DEFLATED:
                e = index.entry(leaf.entry)
                dtype = torch_dtype(leaf.dtype, entry=self.where(leaf.entry))
                if e.size != math.prod(leaf.shape) * dtype.itemsize:
                    continue  # _make_leaf reports the size mismatch on access, before inflating
                todo.append(e)
                specs.append(leaf)
        if not todo:
            return
        self._refuse_rw(specs[0], "is compressed (deflate)")
        for leaf, data in zip(specs, index.inflate(todo, self.num_threads)):
            dtype = torch_dtype(leaf.dtype, entry=self.where(leaf.entry))
            self._tensors[leaf.entry] = _from_bytes(data, dtype, leaf.shape)

    def tensors(self, leaves: list[LeafSpec]) -> list[torch.Tensor]:
        """The tensors of many leaves at once (cached, as :meth:`tensor`).

        One vectorized pass over the leaves' index rows checks methods, sizes
        and alignment (reading every local header still unread in one kernel
        pass when most of the archive is asked for); each plain stored leaf is
        then one ``as_strided`` view of a typed view of the whole mapping.
        Compressed leaves are inflated together. Anything else (nested,
        unaligned, mismatched sizes: their errors) goes through :meth:`tensor`.
        """
        if not leaves:
            return []
        self.prefetch(leaves)
        out: list[torch.Tensor | None] = [None] * len(leaves)
        offs, szs, mets = (c.tolist() for c in self._payloads(leaves))
        with own_views():
            self._views(leaves, out, offs, szs, mets, DTYPES, self._typed, self._tensors)
        return out  # type: ignore[return-value]

    def _payloads(self, leaves: list[LeafSpec]) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """``(payload offsets, stored sizes, methods)`` of the leaves' entries (-1 for an entry the
        archive lacks), with every local header still unread read first (in one kernel pass when
        most of the archive is asked for; a remote index fetches the bytes here first)."""
        n = len(leaves)
        index = self.index
        by_name = index._by_name
        rows = np.fromiter((by_name.get(leaf.entry, -1) for leaf in leaves), np.int64, n)
        found = rows >= 0
        offsets, sizes, methods = (np.full(n, -1, np.int64) for _ in range(3))
        if not found.any():
            return offsets, sizes, methods
        sel = rows[found]
        fetch = getattr(index, "fetch", None)
        if fetch is not None:
            fetch(sel)
        unresolved = index.table["payload_offset"][sel] < 0
        if not index.local_checked and unresolved.any():
            if 2 * len(sel) >= len(index.names):
                index.check_all()
            else:
                for i in sel[unresolved].tolist():
                    index.payload_offset(int(i))
        table = index.table
        offsets[found] = table["payload_offset"][sel]
        sizes[found] = table["size"][sel]
        methods[found] = table["method"][sel]
        return offsets, sizes, methods

    def extents(self, leaves: list[LeafSpec]) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """``(ok, offsets, sizes)`` of the leaves' payloads in the file; ``ok``: a plain STORED leaf of
        a known dtype in exactly its dense bytes, which a copy reads without a view first
        (``load(copy=True)``). The others go through :meth:`tensor`, which raises their errors."""
        offsets, sizes, methods = self._payloads(leaves)
        fits = (
            not f.nested
            and type(d := f.dtype) is str
            and d in DTYPES
            and n == DTYPES[d].itemsize * math.prod(f.shape)
            for f, n in zip(leaves, sizes.tolist())
        )
        ok = np.fromiter(fits, bool, len(leaves)) & (methods == records.STORED) & (offsets >= 0)
        return ok, offsets, sizes

    def _views(self, leaves, out, offs, szs, mets, dtypes, typed_cache, cache) -> None:
        """The loop of :meth:`tensors` (inside :func:`own_views`: each leaf its own tensor)."""
        guarded = bool(_sources._GUARD)
        for j, leaf in enumerate(leaves):
            t = cache.get(leaf.entry)
            if t is not None:
                out[j] = t
                continue
            dtype = dtypes.get(leaf.dtype) if type(leaf.dtype) is str else None
            if dtype is not None and mets[j] == 0 and not leaf.nested:
                itemsize = dtype.itemsize
                off = offs[j]
                shape = leaf.shape
                if off % itemsize == 0 and szs[j] == math.prod(shape) * itemsize:
                    typed = typed_cache.get(dtype)
                    if typed is None:
                        typed = self._typed_view(dtype)
                    strides = contiguous_strides(shape)
                    t = cache[leaf.entry] = (
                        typed.as_strided(shape, strides, off // itemsize)
                        if guarded
                        else leaf_view(typed, shape, strides, off // itemsize)
                    )
                    out[j] = t
                    continue
            out[j] = self.tensor(leaf)

    def close(self) -> None:
        if self.mode == "r+" and self._tensors and self.index.buffer is not None:
            # the leaves handed out are all that can have been written through the mapping:
            # their CRC-32s are re-stamped where the bytes changed (see refresh_entries)
            from ..zipfmt.checksums import refresh_entries

            refresh_entries(self.index, list(self._tensors))
        self.index.close()
        if self._tensors or self._typed:  # (nothing to drop after a bare open)
            self._typed = {}
            self._kinds = {}
            self._tensors = {}
        self._columns = None


def open_tdz(
    path: str | os.PathLike, *, mode: str = "r", allow_pickle: bool = False, num_threads: int | None = None
) -> TdzSource:
    """Opens a ``.tdz`` archive as a :class:`TdzSource` (arguments checked)."""
    if mode not in ("r", "r+"):
        raise InvalidArgumentError(f"mode must be 'r' or 'r+', got {mode!r}")
    return TdzSource(Path(path), mode=mode, allow_pickle=allow_pickle, num_threads=num_threads)


def _hex(digest: bytes | None) -> str | None:
    return None if digest is None else digest.hex()
