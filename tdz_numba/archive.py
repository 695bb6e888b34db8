"""Opening archives: :class:`Archive`, a lazy read-only mapping over one memory map.

Opening parses the end records, the central directory (one kernel pass) and
the root ``meta.json``. Deeper ``meta.json`` files are parsed when their level
is first reached, and a leaf tensor is created when it is first accessed: as a
view into the single mapping of the file (zero-copy), or, for compressed or
unaligned entries, as a new buffer.

Examples
--------
>>> import tempfile, pathlib, torch, tdz_numba
>>> with tempfile.TemporaryDirectory() as d:
...     p = tdz_numba.save({"obs": {"pixels": torch.ones(2, 3)}, "step": 7},
...                        pathlib.Path(d) / "x.tdz")
...     with tdz_numba.open(p) as ar:
...         print(ar["obs/pixels"].shape, ar["step"], sorted(ar))
torch.Size([2, 3]) 7 ['obs', 'step']
"""

from __future__ import annotations

import math
import os
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from . import records
from .bounds import build_levels, check_nested_sizes, parse_meta, walk_leaves
from .dtypes import dtype_table, numpy_dtype, torch_dtype
from .errors import BadArchiveError, InvalidArgumentError, MissingKeyError, UnsupportedError
from .reader import ArchiveIndex
from .tree import (
    NON_TENSOR_DATA_TYPE,
    ChildSpec,
    LeafSpec,
    Level,
    PickledData,
    RawFile,
    class_name,
    describe_level,
    encode_key,
)

__all__ = ["Archive", "LeafInfo", "open_archive", "load", "subpath_prefix"]

DTYPES = dtype_table()


def _from_bytes(data: np.ndarray, dtype: torch.dtype, shape: tuple[int, ...]) -> torch.Tensor:
    """A tensor over a new uint8 buffer (inflated data)."""
    if data.size == 0:
        return torch.empty(shape, dtype=dtype)
    return torch.from_numpy(data).view(dtype).view(shape)


def _contiguous_strides(shape: tuple[int, ...]) -> tuple[int, ...]:
    strides = [1] * len(shape)
    for i in range(len(shape) - 2, -1, -1):
        strides[i] = strides[i + 1] * max(shape[i + 1], 1)
    return tuple(strides)

_PICKLE_SUFFIXES = (".pickle", ".pkl")


@dataclass(frozen=True)
class LeafInfo:
    """Where a leaf lives in the archive and how it is stored."""

    key: str
    entry: str | None
    dtype: torch.dtype
    shape: tuple[int, ...]
    offset: int | None
    nbytes: int
    stored_nbytes: int
    compression: str
    crc: int | None
    nested: bool

    @property
    def zero_copy(self) -> bool:
        """Whether the leaf is a view of the file's mapping."""
        return (self.compression == "stored" and not self.nested and self.offset is not None
                and self.offset % self.dtype.itemsize == 0)  # fmt: skip


class _State:
    """What all views of one opened archive share."""

    def __init__(self, index: ArchiveIndex, mode: str, allow_pickle: bool,
                 num_threads: int | None = None) -> None:  # fmt: skip
        self.index = index
        self.mode = mode
        self.allow_pickle = allow_pickle
        self.num_threads = num_threads
        self.levels: dict[str, tuple[bool, dict[str, ChildSpec], dict[str, Any]]] = {}
        self.tensors: dict[str, torch.Tensor] = {}
        self.views: dict[str, Archive] = {}


def subpath_prefix(subpath: str | tuple[str, ...] | list[str] | None) -> str:
    """Directory prefix (``"a/b/"``) of a subpath given as ``"a/b"`` or ``("a", "b")``."""
    if subpath is None:
        return ""
    parts = subpath.split("/") if isinstance(subpath, str) else list(subpath)
    parts = [p for p in parts if p != ""] if isinstance(subpath, str) else parts
    if not all(isinstance(p, str) for p in parts):
        raise InvalidArgumentError(f"subpath must be a str or a tuple of str, got {subpath!r}")
    return "".join(encode_key(p) + "/" for p in parts)


class Archive(Mapping):
    """A lazy, read-only mapping over one level of an opened archive.

    Keys are the level's keys. Values are ``torch.Tensor`` leaves (views into
    the file's single mapping), nested :class:`Archive` levels, plain Python
    values (non-tensor data) and :class:`~tdz_numba.tree.RawFile` objects.
    ``archive["a/b/c"]`` and ``archive["a", "b", "c"]`` reach nested values.

    Use :func:`tdz_numba.open` to create one.

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

    def __init__(self, state: _State, prefix: str = "") -> None:
        self._state = state
        self._prefix = prefix
        self._level()  # parse this level's meta.json now: errors surface at open

    # -- context manager -------------------------------------------------------
    def __enter__(self) -> Archive:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        """Releases the archive. Tensors already obtained stay valid (they keep
        the mapping alive); new accesses fail."""
        index = self._state.index
        if index is not None:
            index.close()
        self._state.index = None  # type: ignore[assignment]

    # -- properties --------------------------------------------------------------
    @property
    def path(self) -> Path:
        """Path of the archive file."""
        return self._index.path

    @property
    def mode(self) -> str:
        """``"r"`` (private mapping) or ``"r+"`` (writes reach the file)."""
        return self._state.mode

    @property
    def meta(self) -> dict[str, Any]:
        """This level's meta.json fields that are not keys (batch size, class, ...)."""
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
        shape = self._level()[2].get("shape")
        return list(shape) if isinstance(shape, list) else None

    # -- level parsing -----------------------------------------------------------
    @property
    def _index(self) -> ArchiveIndex:
        index = self._state.index
        if index is None:
            raise InvalidArgumentError("the archive is closed")
        return index

    def _sub(self, prefix: str) -> Archive:
        """The (cached) view of the level at ``prefix``."""
        view = self._state.views.get(prefix)
        if view is None:
            view = self._state.views[prefix] = Archive(self._state, prefix)
        return view

    def _where(self, name: str = "") -> str:
        return f"{self._index.path}: {(self._prefix + name) or '<root>'}"

    def _level(self) -> tuple[bool, dict[str, ChildSpec], dict[str, Any]]:
        cached = self._state.levels.get(self._prefix)
        if cached is not None:
            return cached
        index = self._index
        meta_name = self._prefix + "meta.json"
        if meta_name not in index:
            raise BadArchiveError(f"{self._where()}: no meta.json entry {meta_name!r}")
        meta = parse_meta(index.read_bytes(meta_name), self._where("meta.json"))
        keyed, children = describe_level(
            meta, self._prefix, lambda: index.listing(self._prefix),
            lambda sub: sub + "meta.json" in index or index.is_dir(sub), self._where("meta.json"),
        )  # fmt: skip
        result = (keyed, {c.key: c for c in children}, meta)
        self._state.levels[self._prefix] = result
        return result

    # -- Mapping -----------------------------------------------------------------
    def __iter__(self) -> Iterator[str]:
        return iter(self._level()[1])

    def __len__(self) -> int:
        return len(self._level()[1])

    def __contains__(self, key: object) -> bool:
        try:
            self._resolve(key)
        except KeyError:
            return False
        return True

    def _resolve(self, key: object) -> tuple[Archive, ChildSpec]:
        children = self._level()[1]
        if isinstance(key, str) and key in children:
            return self, children[key]
        if isinstance(key, tuple) and key and all(isinstance(k, str) for k in key):
            parts = list(key)
        elif isinstance(key, str):
            parts = key.split("/")
        else:
            raise MissingKeyError(f"{self._where()}: no key {key!r}")
        node: Archive = self
        for i, part in enumerate(parts):
            spec = node._level()[1].get(part)
            if spec is None:
                raise MissingKeyError(f"{self._where()}: no key {'/'.join(parts[: i + 1])!r}")
            if i == len(parts) - 1:
                return node, spec
            if spec.kind != "level":
                raise MissingKeyError(f"{self._where()}: {'/'.join(parts[: i + 1])!r} is not a level")
            node = self._sub(spec.path)
        raise MissingKeyError(f"{self._where()}: empty key")

    def __getitem__(self, key: str | tuple[str, ...]) -> Any:
        node, spec = self._resolve(key)
        return node._value(spec)

    def _value(self, spec: ChildSpec) -> Any:
        if spec.kind == "leaf":
            return self._leaf(spec.leaf)
        if spec.kind == "file":
            data = self._index.read_bytes(spec.path)
            if spec.path.endswith(_PICKLE_SUFFIXES):
                pickled = PickledData(data)
                return pickled.load(allow_pickle=True) if self._state.allow_pickle else pickled
            return RawFile(data)
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
        if self._state.allow_pickle and "other.pickle" in children:
            fields = self._value(children["other.pickle"])  # tensordict pickles a dict of fields
            if isinstance(fields, dict) and "data" in fields:
                return True, fields["data"]
        return False, None

    # -- leaves ------------------------------------------------------------------
    def _leaf(self, spec: LeafSpec) -> torch.Tensor:
        cached = self._state.tensors.get(spec.entry)
        if cached is not None:
            return cached
        t = self._make_leaf(spec)
        self._state.tensors[spec.entry] = t
        return t

    def _refuse_rw(self, spec: LeafSpec, why: str) -> None:
        if self._state.mode == "r+":
            raise UnsupportedError(
                f"{self._index.path}: leaf {spec.key!r} ({spec.entry}) {why}, so it cannot be "
                f"written through with mode='r+'; open with mode='r' or re-save the archive"
            )

    def _make_leaf(self, spec: LeafSpec) -> torch.Tensor:
        index = self._index
        dtype = DTYPES.get(spec.dtype) if type(spec.dtype) is str else None
        i = index._by_name.get(spec.entry)
        if dtype is not None and i is not None and not spec.nested:
            # the common case, kept lean: one view into the file's single mapping
            r = index.rows[i]
            method, size, offset = r.method, r.size, r.payload_offset
            if offset < 0:
                offset = index.payload_offset(i)
            itemsize = dtype.itemsize
            if method == 0 and offset % itemsize == 0 and size == math.prod(spec.shape) * itemsize:
                return torch.empty(0, dtype=dtype).set_(index.torch_untyped, offset // itemsize,
                                                        spec.shape, _contiguous_strides(spec.shape))  # fmt: skip
        dtype = torch_dtype(spec.dtype, entry=self._where(spec.entry))
        if spec.nested:
            self._refuse_rw(spec, "is a nested tensor (materialized in memory)")
            return self._nested_leaf(spec, dtype)
        numel = math.prod(spec.shape)
        nbytes = numel * dtype.itemsize
        if spec.entry not in index:
            if nbytes == 0:
                return torch.empty(spec.shape, dtype=dtype)
            raise BadArchiveError(
                f"{self._where(spec.entry)}: leaf {spec.key!r} of shape {list(spec.shape)} "
                f"needs {nbytes} bytes but the archive has no entry {spec.entry!r}"
            )
        e = index.entry(spec.entry)
        if e.size != nbytes:
            raise BadArchiveError(
                f"{self._where(spec.entry)}: leaf {spec.key!r} ({spec.dtype}, shape "
                f"{list(spec.shape)}): expected {nbytes} bytes, the entry holds {e.size}"
            )
        if nbytes == 0:
            return torch.empty(spec.shape, dtype=dtype)
        if e.method != records.STORED:
            self._refuse_rw(spec, f"is compressed ({records.METHOD_NAMES[e.method]})")
            if e.method == records.DEFLATED:
                data = index.inflate([e], self._state.num_threads)[0]
            else:
                data = index.read(spec.entry)
            return _from_bytes(data, dtype, spec.shape)
        # STORED but not aligned for its dtype (a foreign zip): copy
        self._refuse_rw(spec, f"is not aligned (payload at offset {e.payload_offset})")
        flat = index.torch_storage[e.payload_offset : e.payload_offset + nbytes].clone()
        return flat.view(dtype).view(spec.shape)

    def _nested_leaf(self, spec: LeafSpec, dtype: torch.dtype) -> torch.Tensor:
        index = self._index
        where = self._where(spec.entry)
        if len(spec.shape) != 2:
            raise BadArchiveError(f"{where}: nested leaf shape {list(spec.shape)} must be [n, ndim]")
        n, ndim = spec.shape
        if spec.shape_entry not in index:
            raise BadArchiveError(f"{where}: nested leaf {spec.key!r} has no {spec.shape_entry!r}")
        raw = index.read(spec.shape_entry, check_crc=False)
        if raw.size != n * ndim * 8:
            raise BadArchiveError(
                f"{self._where(spec.shape_entry)}: expected {n * ndim * 8} bytes of sizes, found {raw.size}"
            )
        sizes = torch.from_numpy(raw.copy().view(np.int64).reshape(n, ndim))
        numel = check_nested_sizes(sizes.numpy(), dtype.itemsize, self._where(spec.shape_entry))
        if numel == 0:
            buf = torch.empty(0, dtype=dtype)
        else:
            if spec.entry not in index:
                raise BadArchiveError(f"{where}: nested leaf {spec.key!r} has no payload entry")
            e = index.entry(spec.entry)
            if e.size != numel * dtype.itemsize:
                raise BadArchiveError(
                    f"{where}: expected {numel * dtype.itemsize} bytes for the nested values, found {e.size}"
                )
            buf = torch.from_numpy(index.read(spec.entry, check_crc=False).copy()).view(dtype)
        strides, offsets = torch._nested_compute_contiguous_strides_offsets(sizes)
        return torch._nested_view_from_buffer(buf, sizes, strides, offsets)

    # -- public helpers -----------------------------------------------------------
    def numpy(self, key: str | tuple[str, ...]) -> np.ndarray:
        """The leaf ``key`` as a numpy array sharing the tensor's bytes.

        dtypes numpy lacks come back as unsigned ints of the same size
        (bfloat16 as uint16, float8 as uint8).
        """
        t = self[key]
        if not isinstance(t, torch.Tensor) or t.is_nested:
            raise MissingKeyError(f"{self._where()}: {key!r} is not a dense tensor leaf")
        flat = t.reshape(-1)
        if flat.dtype != torch.uint8:
            flat = flat.view(torch.uint8)
        return flat.numpy().view(numpy_dtype(t.dtype)).reshape(tuple(t.shape))

    def info(self, key: str | tuple[str, ...]) -> LeafInfo:
        """Storage details of leaf ``key``: dtype, shape, offset, sizes, codec, CRC."""
        node, spec = self._resolve(key)
        if spec.kind != "leaf":
            raise MissingKeyError(f"{self._where()}: {key!r} is not a tensor leaf")
        leaf = spec.leaf
        dtype = torch_dtype(leaf.dtype, entry=node._where(leaf.entry))
        index = self._index
        if leaf.entry in index:
            e = index.entry(leaf.entry)
            return LeafInfo(leaf.key, leaf.entry, dtype, leaf.shape, e.payload_offset, e.size,
                            e.compressed_size, records.METHOD_NAMES[e.method], e.crc, leaf.nested)  # fmt: skip
        return LeafInfo(leaf.key, None, dtype, leaf.shape, None, 0, 0, "stored", None, leaf.nested)

    def _prefetch_compressed(self) -> None:
        """Inflates every DEFLATE leaf below this level in one parallel batch."""
        index = self._index
        if not (index.table["method"] == records.DEFLATED).any():
            return  # nothing to inflate: do not walk the leaves
        todo, specs = [], []
        for _, leaf in self.leaves():
            if leaf.nested or leaf.entry in self._state.tensors:
                continue
            row = index.row(leaf.entry)
            if row is not None and index.rows[row].method == records.DEFLATED:
                e = index.entry(leaf.entry)
                dtype = torch_dtype(leaf.dtype, entry=self._where(leaf.entry))
                if e.size != math.prod(leaf.shape) * dtype.itemsize:
                    continue  # _make_leaf reports the size mismatch on access, before inflating
                todo.append(e)
                specs.append(leaf)
        if not todo:
            return
        if self._state.mode == "r+":
            self._refuse_rw(specs[0], "is compressed (deflate)")
        for leaf, data in zip(specs, index.inflate(todo, self._state.num_threads)):
            dtype = torch_dtype(leaf.dtype, entry=self._where(leaf.entry))
            self._state.tensors[leaf.entry] = _from_bytes(data, dtype, leaf.shape)

    def to_dict(self) -> Level:
        """The whole level as nested :class:`~tdz_numba.tree.Level` dicts of tensors
        (views, no copy) and plain values. Compressed leaves below this level are
        inflated together, in parallel."""
        self._prefetch_compressed()
        return self._to_dict()

    def _to_dict(self) -> Level:
        def expand(node: Archive) -> tuple[Level, list]:  # iterative: any depth (tdz_numba.bounds)
            keyed, children, _ = node._level()
            return Level(meta=node.meta, keyed=keyed), [(k, node._value(c)) for k, c in children.items()]

        return build_levels(self, expand, lambda v: isinstance(v, Archive))  # type: ignore[return-value]

    def leaves(self) -> Iterator[tuple[str, LeafSpec]]:
        """``(path, spec)`` of every tensor leaf below this level, depth first."""
        return walk_leaves(self, lambda node: [
            (k, c.kind, c.leaf if c.kind == "leaf" else node._sub(c.path) if c.kind == "level" else None)
            for k, c in node._level()[1].items()])  # fmt: skip

    def __repr__(self) -> str:
        try:
            lines = self._tree_lines(0, 40)
        except Exception as exc:  # a repr never raises
            return f"<tdz_numba.Archive {self._prefix or '/'} (unreadable: {exc})>"
        head = f"Archive({self._state.index.path if self._state.index else '<closed>'}"
        head += f", {self.type_name}, mode={self.mode!r}"
        bs = self.batch_size
        head += f", batch_size={bs})" if bs else ")"
        return "\n".join([head, *lines])

    def _repr_html_(self, max_rows: int = 500) -> str:
        """A collapsible HTML tree for Jupyter: one ``<details>`` per level (class
        name, batch size), one row per leaf (key, dtype, shape, size, codec).

        At most ``max_rows`` rows are drawn; the rest is summarized as
        "... N more keys" per level. Only meta.json files and the central
        directory are read: no leaf tensor is created, nothing is inflated.
        Never raises: on any error the plain :func:`repr` is shown in a ``<pre>``.
        """
        import html

        esc = html.escape

        from .progress import human_bytes as human

        def level_label(node: Archive) -> str:
            bs = node.batch_size
            text = f'<span style="color:#276">{esc(node.type_name)}</span>'
            if bs is not None:
                text += f' <span style="color:#777">batch_size={esc(str(bs))}</span>'
            return text + f' <span style="color:#777">&middot; {len(node)} keys</span>'

        style = ("<style>.tdz-archive table{border-collapse:collapse;margin:0;font-family:monospace}"
                 ".tdz-archive td{text-align:left;padding:0 0.9em 0 0;white-space:nowrap;"
                 "vertical-align:top}.tdz-archive summary{cursor:pointer}</style>")  # fmt: skip
        budget = [max_rows]

        def render(node: Archive) -> str:
            rows: list[str] = []
            subs: list[str] = []
            items = list(node._level()[1].items())
            for i, (key, spec) in enumerate(items):
                if budget[0] <= 0:
                    rest = len(items) - i
                    subs.append(f'<div style="color:#777;font-family:monospace">... {rest} more '
                                f'key{"s" if rest != 1 else ""}</div>')  # fmt: skip
                    break
                budget[0] -= 1
                name = f"<b>{esc(key)}</b>"
                if spec.kind == "leaf":
                    try:
                        info = node.info(key)
                        dtype = str(info.dtype).replace("torch.", "") + (" nested" if info.nested else "")
                        codec = info.compression
                        if info.stored_nbytes != info.nbytes:
                            codec += f" ({human(info.stored_nbytes)} stored)"
                        cols = [dtype, str(list(info.shape)), human(info.nbytes), codec]
                    except Exception as exc:  # one bad leaf does not hide the others
                        dtype = str(spec.leaf.dtype).replace("torch.", "")
                        cols = [dtype, str(list(spec.leaf.shape)), "?", f"error: {exc}"]
                    rows.append(f"<tr><td>{name}</td><td>{esc(cols[0])}</td><td>{esc(cols[1])}</td>"
                                f'<td style="text-align:right">{esc(cols[2])}</td>'
                                f"<td>{esc(cols[3])}</td></tr>")  # fmt: skip
                elif spec.kind == "file":
                    rows.append(f'<tr><td>{name}</td><td colspan="4" style="color:#777">'
                                f"file {esc(spec.path)}</td></tr>")  # fmt: skip
                else:
                    sub = node._sub(spec.path)
                    plain, value = sub._plain_value()
                    if plain:
                        text = repr(value)
                        text = text if len(text) <= 80 else text[:77] + "..."
                        rows.append(f'<tr><td>{name}</td><td colspan="4">{esc(text)}</td></tr>')
                    else:
                        inner = render(sub)
                        subs.append(f"<details><summary><b>{esc(key)}/</b> {level_label(sub)}</summary>"
                                    f'<div style="margin-left:1.2em">{inner}</div></details>')  # fmt: skip
            table = f"<table>{''.join(rows)}</table>" if rows else ""
            return table + "".join(subs)

        try:
            index = self._state.index
            if index is None:
                raise InvalidArgumentError("the archive is closed")
            body = render(self)
            where = esc(str(index.path))
            if self._prefix:
                where += f" : {esc(self._prefix.rstrip('/'))}"
            extra = ""
            if not self._prefix and len(index.names):
                extra = (f' <span style="color:#777">&middot; {len(index.names)} entries, '
                         f"{human(int(index.table['size'].sum()))} payload</span>")  # fmt: skip
            return (f'<div class="tdz-archive">{style}<details open><summary><b>Archive</b> {where} '
                    f"{level_label(self)}{extra}</summary>"
                    f'<div style="margin-left:1.2em">{body}</div></details></div>')  # fmt: skip
        except Exception:
            try:
                text = repr(self)
            except Exception:
                text = "<tdz_numba.Archive>"
            return f"<pre>{esc(text)}</pre>"

    def _tree_lines(self, depth: int, budget: int) -> list[str]:
        lines: list[str] = []
        pad = "  " * (depth + 1)
        for key, spec in self._level()[1].items():
            if len(lines) >= budget:
                lines.append(pad + "...")
                break
            if spec.kind == "leaf":
                leaf = spec.leaf
                dt = str(leaf.dtype).replace("torch.", "")
                kind = " nested" if leaf.nested else ""
                lines.append(f"{pad}{key}: {dt}{list(leaf.shape)}{kind}")
            elif spec.kind == "file":
                lines.append(f"{pad}{key}: file")
            else:
                sub = self._sub(spec.path)
                plain, value = sub._plain_value()
                if plain:
                    lines.append(f"{pad}{key}: {value!r}"[: 120])
                else:
                    lines.append(f"{pad}{key}/ ({sub.type_name})")
                    lines.extend(sub._tree_lines(depth + 1, budget - len(lines)))
        return lines


def open_archive(path: str | os.PathLike, *, mode: str = "r",
                 subpath: str | tuple[str, ...] | None = None,
                 allow_pickle: bool = False, num_threads: int | None = None) -> Archive:  # fmt: skip
    """Opens an archive lazily; see :func:`tdz_numba.open`."""
    if mode not in ("r", "r+"):
        raise InvalidArgumentError(f"mode must be 'r' or 'r+', got {mode!r}")
    from ._jit import check_num_threads

    num_threads = check_num_threads(num_threads)
    index = ArchiveIndex(path, writable=mode == "r+")
    state = _State(index, mode, allow_pickle, num_threads)
    prefix = subpath_prefix(subpath)
    if prefix and prefix + "meta.json" not in index:
        raise MissingKeyError(f"{path}: no level at subpath {subpath!r} (no entry {prefix + 'meta.json'!r})")
    if "meta.json" not in index:
        raise BadArchiveError(f"{path}: not a tensor archive: no top-level meta.json entry")
    return Archive(state, prefix)


def load(path: str | os.PathLike, *, subpath: str | tuple[str, ...] | None = None,
         mode: str = "r", allow_pickle: bool = False, num_threads: int | None = None) -> Level:  # fmt: skip
    """Loads an archive as nested dicts; see :func:`tdz_numba.load`."""
    ar = open_archive(path, mode=mode, subpath=subpath, allow_pickle=allow_pickle,
                      num_threads=num_threads)  # fmt: skip
    try:
        return ar.to_dict()
    finally:
        ar.close()
