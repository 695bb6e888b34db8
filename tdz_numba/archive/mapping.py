"""Navigating any readable file: :class:`Archive`, a lazy read-only mapping over a source.

An :class:`Archive` walks the levels a :class:`~tdz_numba.tdz.sources.Source`
serves: a ``.tdz`` file (:class:`~tdz_numba.tdz.source.TdzSource`: meta.json
parsed per level on first use, leaves as views of one mapping), or any other
format a reader describes with a :class:`~tdz_numba.tdz.sources.TreeSource`
(safetensors, torch ``.pt``, npz, GGUF, ...). Nothing per leaf happens until a
leaf or a level is asked for; :meth:`Archive.to_dict` resolves every leaf
below a level in one bulk pass.

Examples
--------
>>> import tempfile, pathlib, torch, tdz_numba
>>> with tempfile.TemporaryDirectory() as d:
...     p = tdz_numba.save({"obs": {"pixels": torch.ones(2, 3)}, "step": 7},
...                        pathlib.Path(d) / "x.tdz")
...     with tdz_numba.open(p) as ar:
...         print(ar["obs/pixels"].shape, ar["step"], sorted(ar), ar.format)
torch.Size([2, 3]) 7 ['obs', 'step'] tdz
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

import numpy as np
import torch

from ..errors import InvalidArgumentError, MissingKeyError, UnsupportedError
from ..files.leafmemory import LeafMemory
from ..tdz.dtypes import numpy_dtype
from ..tdz.sources import LeafInfo, LevelInfo, Location, Source, paused_gc, tensor_from_spec
from ..tdz.tree import NON_TENSOR_DATA_TYPE, Level, class_name
from .bulk import dequantized, meta_tensor, spec_info
from .state import ArchiveState, missing_key, nest_flat

__all__ = ["Archive"]

_TENSORCLASS_INNER = "_tensordict"


class Archive(LeafMemory, Mapping):
    """A lazy, read-only mapping over one level of an opened file (any format).

    Keys are the level's keys. Values are ``torch.Tensor`` leaves (views into
    the file's mapping unless opened with ``copy=True``), nested
    :class:`Archive` levels, plain Python values (non-tensor data) and
    :class:`~tdz_numba.tdz.tree.RawFile` objects. ``archive["a/b/c"]`` and
    ``archive["a", "b", "c"]`` reach nested values; a tensorclass's fields are
    reached directly (``ar["obs/pixels"]``: its ``_tensordict`` level is seen
    through).

    Use :func:`tdz_numba.open` to create one; a format reader wraps its
    :class:`~tdz_numba.tdz.sources.Source` with ``Archive(source)``.

    Parameters
    ----------
    source : Source
        What to navigate (or, internally, the state shared by the views of one file).
    prefix : str
        The source's prefix of this level (``""``: the root).

    Raises
    ------
    BadArchiveError
        The level's description in the file is malformed (also raised on
        access, for a leaf whose entry is malformed; :class:`ChecksumError`
        for a CRC mismatch of an inflated or fetched entry).
    MissingKeyError
        ``ar[key]`` for a key the level does not have; the message names the
        level and lists its keys (also a ``KeyError``).
    UnsupportedError
        A leaf that cannot be produced as asked (e.g. a compressed leaf of an
        archive opened with ``mode="r+"``).
    InvalidArgumentError
        A leaf accessed after :meth:`close`.

    Examples
    --------
    >>> import tempfile, pathlib, torch, tdz_numba
    >>> with tempfile.TemporaryDirectory() as d:
    ...     p = tdz_numba.save({"a": {"b": torch.arange(4)}}, pathlib.Path(d) / "x.tdz")
    ...     ar = tdz_numba.open(p)
    ...     print(ar["a", "b"].tolist(), ar.info("a/b").offset % 64, ar.numpy("a/b").dtype)
    ...     ar.close()
    [0, 1, 2, 3] 0 int64
    """

    def __init__(self, source: Source | ArchiveState, prefix: str = "") -> None:
        state = self._state = source if isinstance(source, ArchiveState) else ArchiveState(source)
        self._prefix = prefix
        if state.closed:
            raise InvalidArgumentError(f"{state.source.path}: the archive is closed")
        state.source.check_level(prefix)  # parse this level now: errors surface at open

    # -- context manager -------------------------------------------------------
    def __enter__(self) -> Archive:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self, *, refresh: bool = False) -> None:
        """Releases the file. Tensors already obtained stay valid (they keep the
        mapping alive); every later use of the archive raises.

        ``refresh=True`` (``mode="r+"`` only) re-stamps the CRC-32 of every
        stored entry first, as :func:`tdz_numba.refresh_checksums` does.
        """
        state = self._state
        if state.closed:
            return
        if refresh and self.mode != "r+":
            raise InvalidArgumentError(
                f"{self.path}: close(refresh=True) needs an archive opened with mode='r+'"
            )
        source = state.source
        source.close()
        state.closed = True
        if state.views:
            state.views.clear()
        if refresh:
            from ..zipfmt.checksums import refresh_checksums

            refresh_checksums(source.path)

    @property
    def closed(self) -> bool:
        """Whether :meth:`close` was called."""
        return self._state.closed

    # -- properties --------------------------------------------------------------
    @property
    def source(self) -> Source:
        """The :class:`~tdz_numba.tdz.sources.Source` this archive navigates."""
        self._check_open()
        return self._state.source

    @property
    def path(self) -> Path:
        """Path of the file."""
        return self._state.source.path

    @property
    def format(self) -> str:
        """The file's format: ``"tdz"``, ``"safetensors"``, ``"torch"``, ``"npz"``, ..."""
        return self._state.source.format

    @property
    def metadata(self) -> dict[str, Any]:
        """The file's own metadata at the root (safetensors ``__metadata__``, GGUF key/values,
        what ``save(..., metadata=)`` stored, HDF5 root attributes, ...); at a sub-level, that
        level's own (HDF5 group attributes), ``{}`` when its format keeps none per level."""
        self._check_open()
        source = self._state.source
        if self._prefix:
            per_level = getattr(source, "level_metadata", None)
            return dict(per_level(self._prefix) or {}) if per_level is not None else {}
        return dict(source.metadata or {})

    @property
    def mode(self) -> str:
        """``"r"`` (private mapping) or ``"r+"`` (writes reach the file)."""
        return getattr(self._state.source, "mode", "r")

    @property
    def meta(self) -> dict[str, Any]:
        """This level's metadata fields that are not keys (batch size, class, ...)."""
        keyed, children, meta = self._level()
        if not keyed:
            return dict(meta)
        return {k: v for k, v in meta.items() if k not in children}

    @property
    def type_name(self) -> str:
        """Class name recorded for this level (``"TensorDict"``, ``"LazyStackedTensorDict"``, ...)."""
        return class_name(self._level()[2])

    @property
    def batch_size(self) -> list[int] | None:
        """The batch size recorded for this level (meta ``"shape"``), or None."""
        shape = self._level()[2].get("shape")
        return list(shape) if isinstance(shape, list) else None

    # -- levels --------------------------------------------------------------------
    def _check_open(self) -> None:
        if self._state.closed:
            raise InvalidArgumentError(f"{self._state.source.path}: the archive is closed")

    @property
    def _index(self) -> Any:
        """The ``.tdz`` index (:class:`~tdz_numba.zipfmt.index.ArchiveIndex`) of a tdz archive."""
        self._check_open()
        index = getattr(self._state.source, "index", None)
        if index is None:
            raise UnsupportedError(f"{self.path}: a {self.format} file has no zip index")
        return index

    def _sub(self, prefix: str) -> Archive:
        """The (cached) view of the level at ``prefix``."""
        view = self._state.views.get(prefix)
        if view is None:
            view = self._state.views[prefix] = Archive(self._state, prefix)
        return view

    def where(self, key: str = "") -> str:
        """``"<file>: <path of key below this level>"``, as messages name places."""
        return f"{self._state.source.path}: {(self._prefix + key) or '<root>'}"

    _where = where

    def _level(self) -> LevelInfo:
        self._check_open()
        return self._state.source.level(self._prefix)

    def level_info(self, key: str | tuple[str, ...] | None = None) -> LevelInfo:
        """``LevelInfo(keyed, children, meta)`` of this level, or of the level at ``key``.

        ``children`` maps each key to a :class:`~tdz_numba.tdz.sources.Child`
        (``kind``: ``"leaf"``, ``"level"``, ``"value"`` or, in ``.tdz``, ``"file"``).

        Examples
        --------
        >>> import tempfile, pathlib, torch, tdz_numba
        >>> with tempfile.TemporaryDirectory() as d:
        ...     p = tdz_numba.save({"a": {"b": torch.zeros(1)}}, pathlib.Path(d) / "x.tdz")
        ...     with tdz_numba.open(p) as ar:
        ...         info = ar.level_info("a")
        ...         print(info.keyed, {k: c.kind for k, c in info.children.items()})
        True {'b': 'leaf'}
        """
        if key is None or key == "" or key == ():
            return self._level()
        return self.sublevel(key)._level()

    def sublevel(self, key: Any) -> Archive:
        """The level at ``key`` (a key, a path, or a ``"level"`` child from :meth:`level_info`)."""
        if hasattr(key, "kind") and hasattr(key, "path"):
            if key.kind != "level":
                raise MissingKeyError(f"{self.where(key.key)}: not a level ({key.kind})")
            return self._sub(key.path)
        node, spec = self._resolve(key)
        if spec.kind != "level":
            raise MissingKeyError(f"{node.where(spec.key)}: {key!r} is not a level ({spec.kind})")
        return node._sub(spec.path)

    # -- Mapping -----------------------------------------------------------------
    def __iter__(self) -> Iterator[str]:
        return iter(self._level()[1])

    def __len__(self) -> int:
        return len(self._level()[1])

    def keys(self):  # noqa: D102 - Mapping.keys, refused once closed
        self._check_open()
        return super().keys()

    def values(self):  # noqa: D102 - Mapping.values, refused once closed (leaves made in batches)
        self._check_open()
        from .leafiter import LevelValues

        return LevelValues(self)

    def items(self):  # noqa: D102 - Mapping.items (lazy (key, value) pairs, leaves made in batches), refused once closed
        self._check_open()
        from .leafiter import LevelItems

        return LevelItems(self)

    def _pairs(self) -> Iterator[tuple[str, Any]]:
        """``(key, value)`` of this level in order; the leaves made in batches where
        :func:`~tdz_numba.archive.leafiter.batched` says so."""
        from .leafiter import batched, level_pairs

        if batched(self):
            return level_pairs(self)
        return ((key, self._value(child)) for key, child in self._level()[1].items())

    def __contains__(self, key: object) -> bool:
        try:
            self._resolve(key)
        except KeyError:
            return False
        return True

    def _inner(self) -> Archive | None:
        """The ``_tensordict`` level of a tensorclass (its fields), or None."""
        keyed, children, _ = self._level()
        spec = children.get(_TENSORCLASS_INNER)
        if keyed or spec is None or spec.kind != "level":
            return None
        return self._sub(spec.path)

    def _resolve(self, key: object) -> tuple[Archive, Any]:
        children = self._level()[1]
        if isinstance(key, str) and key in children:
            return self, children[key]
        if isinstance(key, tuple) and key and all(isinstance(k, str) for k in key):
            parts = list(key)
        elif isinstance(key, str) and key:
            parts = key.split("/")
        else:
            raise MissingKeyError(f"{self.where()}: no key {key!r} (keys are str or tuples of str)")
        node: Archive = self
        for i, part in enumerate(parts):
            level_children = node._level()[1]
            spec = level_children.get(part)
            if spec is None:
                inner = node._inner()
                if inner is not None and part in inner._level()[1]:
                    node, spec = inner, inner._level()[1][part]
            if spec is None:
                have = list(level_children)
                inner = node._inner()
                if inner is not None:
                    have = [k for k in have if k != _TENSORCLASS_INNER] + list(inner._level()[1])
                raise missing_key(
                    str(self._state.source.path),
                    "/".join(parts[: i + 1]),
                    have,
                    "/".join(parts[:i]) or self._prefix.rstrip("/"),
                )
            if i == len(parts) - 1:
                return node, spec
            if spec.kind != "level":
                raise MissingKeyError(
                    f"{self.where()}: {'/'.join(parts[: i + 1])!r} is a {spec.kind}, not a level"
                )
            node = node._sub(spec.path)
        raise MissingKeyError(f"{self.where()}: empty key")

    def __getitem__(self, key: Any) -> Any:
        """The value at ``key`` (a key, a path ``"a/b"``, a tuple of keys); an int, a slice or an
        integer/bool tensor selects rows of a level with a batch size (a :class:`Level` of the
        rows of every leaf: views for an int or a slice)."""
        if not isinstance(key, (str, tuple)):
            from ..tdz.levelview import is_row_index, select_rows

            if is_row_index(key):
                return select_rows(self.to_dict(), key, self.where())
        node, spec = self._resolve(key)
        return node._value(spec)

    def __setitem__(self, key: str | tuple[str, ...], value: Any) -> None:
        """Writes ``value`` into leaf ``key`` in place (``mode="r+"``; the same shape and dtype;
        then :func:`~tdz_numba.refresh_checksums`). Raises
        :class:`~tdz_numba.InvalidArgumentError` otherwise."""
        from .rows import write_leaf

        write_leaf(self, key, value)

    def to_tensordict(self) -> Any:
        """The level as a ``tensordict.TensorDict`` of the same zero-copy leaves (needs tensordict:
        :class:`~tdz_numba.UnsupportedError` without it)."""
        from .rows import to_tensordict

        return to_tensordict(self)

    def _value(self, spec: Any) -> Any:
        kind = spec.kind
        if kind == "leaf":
            return self._deliver(self._tensor(spec.leaf))
        if kind == "value":
            return spec.leaf
        if kind == "file":
            return self._state.source.file_value(spec)  # type: ignore[attr-defined]  # "file" children: TdzSource only
        sub = self._sub(spec.path)
        plain, value = sub._plain_value()
        return value if plain else sub

    def _plain_value(self) -> tuple[bool, Any]:
        """``(True, value)`` when this level is a NonTensorData holding a plain value.

        A dict value stays a level (its ``.data``): as a plain dict it would
        read, and be written back, as a sub-level.
        """
        _, children, meta = self._level()
        if meta.get("_type") != NON_TENSOR_DATA_TYPE or meta.get("_metadata") is not None:
            return False, None
        if "data" in meta:
            return (False, None) if isinstance(meta["data"], dict) else (True, meta["data"])
        if getattr(self._state.source, "allow_pickle", False) and "other.pickle" in children:
            fields = self._value(children["other.pickle"])  # tensordict pickles a dict of fields
            if isinstance(fields, dict) and "data" in fields:
                return True, fields["data"]
        return False, None

    # -- leaves ------------------------------------------------------------------
    def _tensor(self, leaf: Any) -> torch.Tensor:
        """The raw tensor of a leaf spec (zero-copy where the source allows)."""
        source = self._state.source
        if self._state.device is not None and self._state.device.type == "meta":
            return meta_tensor(source, leaf)
        make = getattr(source, "tensor", None)
        if make is not None:
            return make(leaf)
        state = self._state
        t = tensor_from_spec(
            leaf, source.files, copy=state.copy, where=str(source.path), aligned=state.aligned
        )
        return dequantized(leaf, t) if state.dequantize else t

    def _deliver(self, t: torch.Tensor, copied: bool = False) -> torch.Tensor:
        """Applies the archive's ``copy`` / ``dtype`` / ``device`` options to a leaf."""
        state = self._state
        if state.copy and not copied and state.source.format == "tdz" and t.device.type != "meta":
            t = t.clone()
        if state.dtype is not None and (t.is_floating_point() or t.is_complex()) and t.dtype != state.dtype:
            t = t.to(state.dtype)
        dev = state.device
        if dev is not None and dev.type not in ("cpu", "meta"):
            if dev.type == "cuda" and torch.cuda.is_available() and not t.is_pinned():
                t = t.pin_memory()
            t = t.to(dev, non_blocking=True)
        return t

    def leaf(self, key: Any) -> torch.Tensor:
        """The tensor of leaf ``key`` (a key, a path, or a ``"leaf"`` child from :meth:`level_info`).

        Raises :class:`~tdz_numba.MissingKeyError` when ``key`` is absent or not a tensor leaf.
        """
        if hasattr(key, "kind") and hasattr(key, "leaf"):
            spec = key
        else:
            node, spec = self._resolve(key)
            if spec.kind != "leaf":
                raise MissingKeyError(f"{node.where(spec.key)}: {key!r} is a {spec.kind}, not a tensor leaf")
            return node._value(spec)
        if spec.kind != "leaf":
            raise MissingKeyError(f"{self.where(spec.key)}: not a tensor leaf ({spec.kind})")
        return self._value(spec)

    def leaf_tensors(self, children: list[Any]) -> list[torch.Tensor]:
        """The tensors of many ``"leaf"`` children of this level (from :meth:`level_info`), in one call."""
        from .bulk import materialize

        return materialize(self, [c.leaf for c in children])

    def materialize(self) -> None:
        """Resolves every leaf below this level now, in one bulk pass (they are cached:
        later accesses are dictionary lookups). Compressed leaves are inflated together.
        (:meth:`prefetch` reads pages ahead instead.)"""
        from .bulk import materialize

        if self._state.copy or self._state.device is not None:
            return  # delivered tensors are not cached
        materialize(self, [leaf for _, leaf in self.leaves()])

    def file_bytes(self, child: Any) -> bytes:
        """The raw bytes of a ``"file"`` child (a ``.tdz`` level's ``other.pickle``, ...),
        given as the child or its entry name; nothing is unpickled."""
        path = child.path if hasattr(child, "path") else child
        reader = getattr(self.source, "read_bytes", None)
        if reader is None:
            raise UnsupportedError(f"{self.path}: a {self.format} file has no files besides its tensors")
        return reader(path)

    def numpy(self, key: str | tuple[str, ...]) -> np.ndarray:
        """The leaf ``key`` as a numpy array sharing the tensor's bytes.

        dtypes numpy lacks come back as unsigned ints of the same size
        (bfloat16 as uint16, float8 as uint8).
        """
        t = self[key]
        if not isinstance(t, torch.Tensor) or t.is_nested:
            raise MissingKeyError(f"{self.where()}: {key!r} is not a dense tensor leaf")
        if t.device.type != "cpu":
            t = t.cpu()
        flat = t.reshape(-1)
        if flat.dtype != torch.uint8:
            flat = flat.view(torch.uint8)
        return flat.numpy().view(numpy_dtype(t.dtype)).reshape(tuple(t.shape))

    def info(self, key: str | tuple[str, ...]) -> LeafInfo:
        """Storage details of leaf ``key``: dtype, shape, offset, sizes, codec, CRC,
        ``zero_copy``, ``location`` and ``attrs`` (HDF5 dataset attributes). No payload is read."""
        node, spec = self._resolve(key)
        if spec.kind != "leaf":
            raise MissingKeyError(f"{self.where()}: {key!r} is not a tensor leaf")
        own = getattr(self._state.source, "leaf_attributes", None)
        info = node._leaf_info(spec.leaf)
        return dataclasses.replace(info, attrs=own(node._prefix, spec.key)) if own else info

    def _leaf_info(self, leaf: Any) -> LeafInfo:
        state = self._state
        source = state.source
        make = getattr(source, "leaf_info", None)
        if make is None:
            return spec_info(leaf, source, aligned=state.aligned, copy=state.copy)
        info = make(leaf)
        if state.copy and info.zero_copy:  # the archive hands out owned copies
            info = dataclasses.replace(info, zero_copy=False)
        return info

    def where_is(self, key: str | tuple[str, ...]) -> Location | None:
        """``Location(file, offset, nbytes)`` of leaf ``key``'s bytes (None: no payload)."""
        return self.info(key).location

    def dequantize(self, key: str | tuple[str, ...]) -> torch.Tensor:
        """The leaf ``key`` decoded to float32 when it holds GGML quantized blocks
        (GGUF ``Q4_0``, ``Q8_0``, ``Q4_K``, ...); other leaves come back as they are.

        Raises :class:`~tdz_numba.UnsupportedError` for a quant type the decoder lacks.
        """
        node, spec = self._resolve(key)
        if spec.kind != "leaf":
            raise MissingKeyError(f"{self.where()}: {key!r} is not a tensor leaf")
        # (a leaf of a file opened with dequantize=True comes decoded already: returned as it is)
        return dequantized(spec.leaf, node._value(spec))

    def leaves(self) -> Iterator[tuple[str, Any]]:
        """``(path, spec)`` of every tensor leaf below this level, depth first (any depth)."""
        from ..tdz.bounds import walk_leaves

        return walk_leaves(
            self,
            lambda node: [
                (k, c.kind, c.leaf if c.kind == "leaf" else node._sub(c.path) if c.kind == "level" else None)
                for k, c in node._level()[1].items()
            ],
        )

    def iter_leaves(self) -> Iterator[tuple[str, torch.Tensor]]:
        """``(path, tensor)`` of every tensor leaf below this level, lazily, depth first.

        Examples
        --------
        >>> import tempfile, pathlib, torch, tdz_numba
        >>> with tempfile.TemporaryDirectory() as d:
        ...     p = tdz_numba.save({"a": {"b": torch.ones(1)}, "c": torch.zeros(2)}, pathlib.Path(d) / "x.tdz")
        ...     with tdz_numba.open(p) as ar:
        ...         print([(k, t.shape[0]) for k, t in ar.iter_leaves()])
        [('a/b', 1), ('c', 2)]
        """
        from .leafiter import batched, leaf_pairs

        if batched(self):  # leaves made in batches
            yield from leaf_pairs(self)
            return
        from ..tdz.bounds import walk_leaves  # (a compressed .tdz, or copies: made (and cached) on access)

        pairs = walk_leaves(
            self,
            lambda node: [
                (
                    k,
                    c.kind,
                    (node, c) if c.kind == "leaf" else node._sub(c.path) if c.kind == "level" else None,
                )
                for k, c in node._level()[1].items()
            ],
        )
        for path, (node, child) in pairs:
            yield path, node._value(child)

    def to_dict(self, *, nest: str | None = None, keys: tuple[str, ...] | list[str] | None = None) -> Level:
        """The whole level as nested :class:`~tdz_numba.tdz.tree.Level` dicts of tensors
        (views, no copy, unless opened with ``copy=True``) and plain values.

        Every leaf below the level is resolved in one bulk pass; compressed
        leaves are inflated together, in parallel. ``nest=".."``: flat names
        are split on that separator into nested dicts (plain dicts). ``keys``:
        only these keys or paths (``"a/b"``).
        """
        from .bulk import build_tree

        with paused_gc():  # thousands of levels and tensors, no cycles among them
            if keys is not None:
                from .rows import select_keys

                tree = select_keys(self, tuple(keys))
            else:
                tree = build_tree(self)
        return nest_flat(tree, nest) if nest is not None else tree  # type: ignore[return-value]

    def _prefetch_compressed(self) -> None:
        """Inflates every DEFLATE leaf below this level in one parallel batch."""
        prefetch = getattr(self._state.source, "prefetch", None)
        if prefetch is not None:
            prefetch([leaf for _, leaf in self.leaves()])

    def __repr__(self) -> str:
        from .display import archive_repr

        return archive_repr(self)

    def _repr_html_(self, max_rows: int = 500) -> str:
        """A collapsible HTML tree for Jupyter (see :func:`tdz_numba.archive.display.archive_html`)."""
        from .display import archive_html

        return archive_html(self, max_rows)
