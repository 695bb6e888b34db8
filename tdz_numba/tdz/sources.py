"""Where leaves come from: the contract between file-format readers and :class:`~tdz_numba.Archive`.

Every reader (safetensors, torch ``.pt``, npz, GGUF, HDF5, ONNX, memmap
directories) maps its file(s) once with :class:`MappedFile` and describes each
tensor by a :class:`TensorSpec`: which mapped file, the byte offset of element
``[0, ..., 0]``, dtype, shape and element strides. It then hands a nested tree
of specs, plain values and sub-dicts to :class:`TreeSource`, which serves the
levels the :class:`~tdz_numba.Archive` navigates. :func:`tensor_from_spec`
turns a spec into a tensor: a zero-copy view of the mapping when the offset is
aligned for the dtype, a copy otherwise (or always, with ``copy=True``).

No reader creates tensors itself, and every spec is checked against the size
of its file before a view is made (:func:`check_extent`).

Examples
--------
>>> import tempfile, pathlib, numpy as np, torch
>>> from tdz_numba.tdz.sources import MappedFile, TensorSpec, tensor_from_spec
>>> with tempfile.TemporaryDirectory() as d:
...     p = pathlib.Path(d) / "raw.bin"
...     _ = p.write_bytes(np.arange(6, dtype=np.float32).tobytes())
...     f = MappedFile.open(p)
...     spec = TensorSpec("x", torch.float32, (2, 3), (1, 2), 0, 0, 24)   # a transposed view
...     print(tensor_from_spec(spec, [f]).tolist())
[[0.0, 2.0, 4.0], [1.0, 3.0, 5.0]]
"""

from __future__ import annotations

import contextlib
import math
import mmap
import os
import stat
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, NamedTuple

import numpy as np

from ..errors import BadArchiveError, InvalidArgumentError
from ..files.loadadvice import map_cached_ahead
from .gcpause import paused_gc
from .standins import _STAND_INS, make_present, mapped_as, stand_in_external

if TYPE_CHECKING:  # pragma: no cover
    import torch

__all__ = [
    "MappedFile",
    "TensorSpec",
    "Child",
    "LevelInfo",
    "LeafInfo",
    "Location",
    "Source",
    "TreeSource",
    "check_extent",
    "tensor_from_spec",
    "copied_leaf",
    "needs_alignment",
    "own_views",
    "leaf_view",
    "paused_gc",
    "make_present",
    "mapped_as",
    "stand_in_external",
    "MAX_DEPTH",
]

#: Deepest nesting of levels any reader builds or walks (a claim in a file beyond it is refused).
MAX_DEPTH = 256


class Location(NamedTuple):
    """Where a leaf's bytes are (like ztensor's ``Location``)."""

    file: str
    offset: int
    nbytes: int


class MappedFile:
    """One file mapped once: privately (``mode="r"``) or shared (``writable=True``).

    ``buffer`` is a uint8 numpy view of the whole mapping; :attr:`torch_u8`
    the same bytes as a torch tensor (created on first use). Views stay valid
    after :meth:`close` (they keep the mapping alive). A reader calls :meth:`need`
    before it reads bytes of ``buffer``: a no-op for a local file; a remote file
    (:mod:`tdz_numba.remote`, ``remote = True``) fetches them into place.
    """

    #: Whether :meth:`need` fetches (a remote object's sparse mapping).
    remote = False

    def __init__(self, path: Path, mm: mmap.mmap | None, size: int, writable: bool) -> None:
        self.path = path
        self.size = size
        self.writable = writable
        self._mmap = mm
        self.buffer = np.frombuffer(mm, dtype=np.uint8) if mm is not None else np.empty(0, np.uint8)
        self._torch = None
        self._typed: dict[tuple[Any, int], Any] = {}

    def need(self, start: int, stop: int) -> None:
        """Makes bytes ``[start, stop)`` of :attr:`buffer` readable (a no-op for a local file)."""

    def need_spans(self, spans: list[tuple[int, int]]) -> None:
        """:meth:`need` of many ``(start, stop)`` spans at once (a no-op for a local file)."""

    @classmethod
    def open(cls, path: str | os.PathLike, *, writable: bool = False) -> MappedFile:
        """Maps ``path``; raises :class:`~tdz_numba.BadArchiveError` for a directory or a device.

        Inside :func:`mapped_as`, a path it names gives the file it maps it to."""
        stand_in = _STAND_INS.get()
        if stand_in is not None:
            found = stand_in.get(str(path))
            if found is not None:
                return found
        p = path if isinstance(path, Path) else Path(path)
        try:
            fd = os.open(p, (os.O_RDWR if writable else os.O_RDONLY) | getattr(os, "O_NONBLOCK", 0))
        except IsADirectoryError:
            raise BadArchiveError(f"{p}: is a directory, not a file") from None
        try:
            st = os.fstat(fd)
            if not stat.S_ISREG(st.st_mode):
                raise BadArchiveError(f"{p}: not a regular file")
            size = st.st_size
            mm = None
            if size:
                mm = mmap.mmap(fd, size, access=mmap.ACCESS_WRITE if writable else mmap.ACCESS_COPY)
                if not writable:  # (a load's file, cached: its pages mapped ahead from now)
                    map_cached_ahead(mm, fd)
        finally:
            os.close(fd)
        return cls(p, mm, size, writable)

    @classmethod
    def of_index(cls, path: str | os.PathLike, index: Any) -> MappedFile:
        """The file ``path`` as the zip index ``index`` (a local
        :class:`~tdz_numba.zipfmt.index.ArchiveIndex` of it) maps it: the same mapping (one
        mapping per file, one page fault per page; the index's header check and the views read the
        same pages), or :meth:`open` where the index has none (remote) or :func:`mapped_as` names
        the path.

        >>> import tempfile, pathlib, numpy as np
        >>> from tdz_numba.zipfmt.index import ArchiveIndex
        >>> with tempfile.TemporaryDirectory() as d:
        ...     p = pathlib.Path(d) / "a.npz"
        ...     np.savez(p, a=np.arange(3))
        ...     index = ArchiveIndex(p)
        ...     f = MappedFile.of_index(p, index)
        ...     print(f.size == index.size, f.buffer.ctypes.data == index.buffer.ctypes.data)
        True True
        """
        stand_in = _STAND_INS.get()
        mm = index.mapping if getattr(index, "ident", None) is not None else None
        if mm is None or (stand_in is not None and str(path) in stand_in):
            return cls.open(path)
        return cls(Path(path), mm, len(mm), False)

    @property
    def torch_u8(self):
        """The whole mapping as one uint8 torch tensor (leaves are views of it)."""
        if self._torch is None:
            import torch

            self._torch = torch.from_numpy(self.buffer) if self.size else torch.empty(0, dtype=torch.uint8)
        return self._torch

    def typed(self, dtype: Any, shift: int = 0):
        """The mapping from byte ``shift`` on as one tensor of ``dtype`` (cached per dtype and shift).

        A leaf at byte ``offset`` is element ``(offset - shift) // itemsize`` of the view
        whose ``shift`` is ``offset % itemsize``: a leaf at any byte address is a view of
        the mapping (``shift == 0``: on :attr:`torch_u8`'s storage; otherwise on a storage
        that starts ``shift`` bytes in, made by ``torch.from_numpy`` of the shifted buffer,
        which keeps the mapping alive). CPU kernels read such unaligned tensors correctly
        (x86-64 and ARM64 load unaligned vectors), checked for every dtype in the tests.
        """
        key = (dtype, shift)
        found = self._typed.get(key)
        if found is not None:
            return found
        import torch

        if shift == 0:
            base = self.torch_u8
        else:
            base = (
                torch.from_numpy(self.buffer[shift:])
                if shift < self.size
                else torch.empty(0, dtype=torch.uint8)
            )
        itemsize = dtype.itemsize
        if dtype != torch.uint8:  # (the slice only where bytes are left over: one op less)
            n = base.numel()
            base = (base[: n - n % itemsize] if n % itemsize else base).view(dtype)
        self._typed[key] = base
        return base

    def close(self) -> None:
        """Drops this object's references; tensors already made keep the mapping alive."""
        self.buffer = np.empty(0, np.uint8)
        self._torch = None
        self._typed = {}
        self._mmap = None


class TensorSpec(NamedTuple):
    """One tensor leaf of a non-``.tdz`` file, described without touching its bytes.

    ``offset`` is the byte offset (in ``files[file]``) of element ``[0, ..., 0]``,
    storage offsets included; ``strides`` are in elements (None: C-contiguous);
    ``nbytes`` is how many bytes the leaf spans in the file (the stored,
    compressed size when ``codec`` is not ``"stored"``, then ``size`` is the
    decoded size). ``loader`` reads copy-only leaves (an HDF5 chunked dataset):
    it returns a numpy array or tensor of ``dtype``/``shape``.
    ``type_name`` is the file's own name for the element type (``"F32"``,
    ``"Q4_K"``, ``"<f4"``); quantized blocks are exposed as ``uint8``.
    """

    key: str
    dtype: Any  # torch.dtype
    shape: tuple[int, ...]
    strides: tuple[int, ...] | None
    file: int
    offset: int
    nbytes: int
    type_name: str = ""
    codec: str = "stored"
    size: int = 0
    crc: int | None = None
    loader: Callable[[], Any] | None = None

    @property
    def numel(self) -> int:
        return math.prod(self.shape)


class Child(NamedTuple):
    """A child of a level: ``kind`` is ``"leaf"`` (``leaf`` a spec), ``"level"`` (``path`` its
    prefix, ending in ``/``), ``"file"`` (``path`` the entry of a file that is not a leaf) or
    ``"value"`` (``leaf`` holds the plain Python value)."""

    key: str
    kind: str
    path: str
    leaf: Any = None


@dataclass(frozen=True)
class LeafInfo:
    """Where a leaf lives in its file and how it is stored.

    ``zero_copy``: whether the leaf is a view of the file's mapping;
    ``location``: ``(file, offset, nbytes)`` of its bytes (None when the leaf
    has no payload); ``type_name``: the file's own name for the element type
    (``"torch.float32"``, ``"F32"``, ``"Q4_K"``); ``attrs``: the leaf's own
    attributes in its file (HDF5 dataset attributes; ``{}`` for formats without).
    """

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
    zero_copy: bool = False
    location: Location | None = None
    type_name: str = ""
    #: The XXH3-128 digest of the leaf's bytes stored with it (hex; None: none stored).
    digest: str | None = None
    attrs: dict[str, Any] = field(default_factory=dict, hash=False)

    @property
    def aligned(self) -> bool:
        """Whether the leaf's tensor starts on a multiple of its element size in memory: a
        STORED leaf whose file offset is element-aligned, or a leaf decoded into its own
        buffer (compressed, or read by a loader). An unaligned STORED leaf is still a view
        of the mapping; ``open/load(..., aligned=True)`` copies those leaves."""
        if self.offset is None or self.compression != "stored":
            return True
        return self.offset % max(self.dtype.itemsize, 1) == 0

    @property
    def evictable(self) -> bool:
        """Whether the leaf's payload starts on a page of this machine and covers whole
        pages: :meth:`Archive.evict` can then drop it without touching a neighbour
        (``save(..., align="auto")`` gives big leaves this)."""
        from ..files.memory import is_evictable

        return self.zero_copy and self.offset is not None and is_evictable(self.offset, self.stored_nbytes)

    @property
    def caps(self):
        """The leaf's :class:`~tdz_numba.files.leafmemory.Caps` (map, evict, verify, alignment)."""
        from ..files.leafmemory import leaf_caps

        return leaf_caps(self, self.crc is not None)


class LevelInfo(NamedTuple):
    """One level: whether it lists its keys itself (``keyed``), its children by key, its metadata."""

    keyed: bool
    children: dict[str, Child]
    meta: dict[str, Any]


def span_bytes(shape: tuple[int, ...], strides: tuple[int, ...] | None, itemsize: int) -> int:
    """Bytes from element ``[0, ..]`` to the end of the last element (0 when empty).

    Raises :class:`ValueError` for negative strides.
    """
    if any(s == 0 for s in shape):
        return 0
    if strides is None:
        return math.prod(shape) * itemsize
    if any(st < 0 for st in strides):
        raise ValueError("negative strides")
    last = sum((d - 1) * st for d, st in zip(shape, strides))
    return (last + 1) * itemsize


def check_extent(spec: TensorSpec, file_size: int, where: str) -> None:
    """Raises :class:`~tdz_numba.BadArchiveError` unless the leaf lies inside its file.

    Checks dimensions (non-negative ints), strides (matching rank, non-negative),
    the offset and the bytes spanned against ``file_size``, with Python's
    unbounded ints (no overflow).
    """
    shape = spec.shape
    if not all(type(d) is int and d >= 0 for d in shape):
        raise BadArchiveError(f"{where}: tensor {spec.key!r}: bad shape {list(shape)}")
    if spec.strides is not None and (
        len(spec.strides) != len(shape) or not all(type(s) is int and s >= 0 for s in spec.strides)
    ):
        raise BadArchiveError(
            f"{where}: tensor {spec.key!r}: bad strides {spec.strides} for shape {list(shape)}"
        )
    if spec.loader is not None:
        return
    itemsize = spec.dtype.itemsize
    if spec.codec == "stored":
        need = span_bytes(shape, spec.strides, itemsize)
        if need and spec.nbytes < need:
            raise BadArchiveError(
                f"{where}: tensor {spec.key!r} ({spec.type_name or spec.dtype}, shape {list(shape)}) "
                f"needs {need} bytes, the file gives it {spec.nbytes}"
            )
    elif spec.size != math.prod(shape) * itemsize:
        raise BadArchiveError(
            f"{where}: tensor {spec.key!r}: decodes to {spec.size} bytes, shape {list(shape)} "
            f"needs {math.prod(shape) * itemsize}"
        )
    if spec.nbytes and (spec.offset < 0 or spec.offset + spec.nbytes > file_size):
        raise BadArchiveError(
            f"{where}: tensor {spec.key!r}: bytes [{spec.offset}, {spec.offset + spec.nbytes}) "
            f"lie outside the file ({file_size} bytes)"
        )


def own_views() -> contextlib.AbstractContextManager:
    """The context in which leaves are made: ``as_strided`` below autograd's view tracking.

    A leaf made by ``typed.as_strided(...)`` in it shares the mapping's storage (zero-copy)
    but is not an autograd view of ``typed``: it has its own version counter, so an
    in-place write to one leaf (BatchNorm's ``running_mean.add_()`` after
    ``load_state_dict(..., assign=True)``) does not mark every other leaf as modified.
    Measured at 100,000 leaves: cheaper than a tracked ``as_strided`` (no view record)
    and about half the cost of ``torch.empty(0).set_(storage, ...)``. Where torch lacks
    the guard, :func:`leaf_view` falls back to ``set_``.
    """
    global _GUARD
    if _GUARD is None:
        import torch

        _GUARD = getattr(torch._C, "_AutoDispatchBelowADInplaceOrView", False)
    return _GUARD() if _GUARD else contextlib.nullcontext()


def leaf_view(typed, shape: tuple[int, ...], strides: tuple[int, ...], offset: int):
    """A tensor of ``shape``/``strides`` at element ``offset`` of ``typed``'s storage, with
    its own version counter; call it inside :func:`own_views`."""
    if _GUARD:
        return typed.as_strided(shape, strides, offset)
    import torch

    return torch.empty(0, dtype=typed.dtype).set_(typed.untyped_storage(), offset, shape, strides)


#: ``torch._C._AutoDispatchBelowADInplaceOrView`` once :func:`own_views` looked (False: torch lacks it).
_GUARD: Any = None


def _contiguous(shape: tuple[int, ...]) -> tuple[int, ...]:
    out = [1] * len(shape)
    for i in range(len(shape) - 2, -1, -1):
        out[i] = out[i + 1] * max(shape[i + 1], 1)
    return tuple(out)


def tensor_from_spec(
    spec: TensorSpec,
    files: list[MappedFile],
    *,
    copy: bool = False,
    where: str = "",
    num_threads: int | None = None,
    aligned: bool = False,
):
    """The tensor a spec describes: a view of the mapping (zero-copy), or a new tensor.

    A STORED leaf is a view at any byte offset (:meth:`MappedFile.typed`), with its own
    version counter (:func:`own_views`). A copy is made when ``copy=True``, when
    ``aligned=True`` and the offset is not a multiple of the dtype's size, for
    compressed members (inflated) and for ``loader`` leaves. Many specs at once:
    :func:`~tdz_numba.tdz.specbulk.spec_views` (the same tensors, checked in bulk).
    """
    import torch

    where = where or (str(files[spec.file].path) if 0 <= spec.file < len(files) else "<file>")
    if spec.nbytes and 0 <= spec.file < len(files) and getattr(files[spec.file], "remote", False):
        files[spec.file].need(spec.offset, spec.offset + spec.nbytes)
    if spec.loader is not None:
        value = spec.loader()
        t = (
            torch.from_numpy(np.ascontiguousarray(value).reshape(value.shape))
            if isinstance(value, np.ndarray)
            else value
        )  # 0-d stays 0-d
        if t.dtype != spec.dtype and t.element_size() == spec.dtype.itemsize:
            t = t.view(spec.dtype)
        if tuple(t.shape) != tuple(spec.shape):
            raise BadArchiveError(
                f"{where}: tensor {spec.key!r}: read shape {list(t.shape)}, expected {list(spec.shape)}"
            )
        return t
    if spec.numel == 0:
        return torch.empty(spec.shape, dtype=spec.dtype)
    f = files[spec.file]
    check_extent(spec, f.size, where)
    itemsize = spec.dtype.itemsize
    if spec.codec != "stored":
        from ..zipfmt import members

        raw = f.buffer[spec.offset : spec.offset + spec.nbytes]
        data = members.decode_member(
            raw, spec.codec, spec.size, spec.crc, f"{where}: {spec.key!r}", num_threads
        )
        flat = torch.from_numpy(data).view(spec.dtype)
        return flat.view(spec.shape)
    strides = spec.strides if spec.strides is not None else _contiguous(spec.shape)
    shift = spec.offset % itemsize
    if not copy and not (shift and (aligned or needs_alignment(spec.dtype))):
        # a tensor on the mapping's storage (shifted when unaligned): no copy, its own version counter
        with own_views():
            return leaf_view(f.typed(spec.dtype, shift), spec.shape, strides, spec.offset // itemsize)
    t = copied_leaf(f, spec.dtype, spec.shape, strides, spec.offset)
    return t.clone() if copy else t  # copy: only the elements (a gapped view made dense)


def needs_alignment(dtype: Any) -> bool:
    """Whether torch's CPU kernels need a tensor of ``dtype`` aligned to its element size: the
    complex dtypes (``c10::complex<double>`` is declared ``alignas(16)``, and the compiler's
    aligned vector loads of it crash on an unaligned address: ``sum(0)`` and ``where`` of a
    complex128 tensor 8 bytes off did, measured on torch 2.13). Their misaligned leaves
    are copies; every other dtype is a view at any byte address (checked op by op in
    ``tests/test_foreign_bulk.py``)."""
    return bool(dtype.is_complex)


def copied_leaf(f: MappedFile, dtype: Any, shape: Any, strides: Any, offset: int):
    """An owned copy of the leaf of ``shape``/``strides`` (elements) at byte ``offset`` of ``f``:
    the bytes it spans copied into a new (aligned) buffer, the same strides on it."""
    span = span_bytes(tuple(shape), tuple(strides), dtype.itemsize)
    raw = f.torch_u8[offset : offset + span].clone()
    import torch

    typed = raw.view(dtype) if dtype != torch.uint8 else raw
    return typed.as_strided(shape, strides, 0)


class Source:
    """A readable file of any format: what :class:`~tdz_numba.Archive` navigates.

    Subclasses set ``format``, ``path``, ``metadata`` and ``files`` and serve
    :meth:`level`. ``.tdz`` archives have their own lazy source; every other
    format builds a :class:`TreeSource`.
    """

    format: str = ""
    path: Path
    metadata: dict[str, Any]
    files: list[MappedFile]

    def level(self, prefix: str) -> LevelInfo:  # pragma: no cover - abstract
        raise NotImplementedError

    def check_level(self, prefix: str) -> None:
        """Raises what :meth:`level` would raise for ``prefix`` (a source may defer
        building the level's children until :meth:`level` is called)."""
        self.level(prefix)

    def has_level(self, prefix: str) -> bool:  # pragma: no cover - abstract
        raise NotImplementedError

    def close(self) -> None:
        for f in self.files:
            f.close()


class TreeSource(Source):
    """A source whose whole tree is known at open: nested dicts of :class:`TensorSpec`,
    plain values and sub-dicts (dict keys are the level's keys, in order).

    Flat formats (safetensors, npz, GGUF) give one level of specs keyed by the
    file's own tensor names. Each sub-dict becomes a level with prefix
    ``"<key>/"`` (keys used as they are, so a ``"/"`` in a flat name never
    splits it).
    """

    def __init__(
        self,
        format: str,
        path: str | os.PathLike,
        tree: Mapping[str, Any],
        *,
        files: list[MappedFile],
        metadata: dict[str, Any] | None = None,
        level_meta: dict[str, dict[str, Any]] | None = None,
    ) -> None:
        self.format = format
        self.path = path if isinstance(path, Path) else Path(path)
        self.files = files
        self.metadata = metadata or {}
        self._levels: dict[str, LevelInfo] = {}
        with paused_gc():
            self._build(tree, level_meta or {})

    def _build(self, tree: Mapping[str, Any], level_meta: dict[str, dict[str, Any]]) -> None:
        """The levels of ``tree``, iteratively (no recursion on file-controlled depth)."""
        stack: list[tuple[str, Mapping[str, Any], int]] = [("", tree, 0)]
        counter = 0
        new = tuple.__new__
        while stack:
            prefix, node, depth = stack.pop()
            if depth > MAX_DEPTH:
                raise BadArchiveError(f"{self.path}: nesting deeper than {MAX_DEPTH} levels")
            children: dict[str, Child] = {}
            for key, value in node.items():
                if type(value) is TensorSpec and type(key) is str:  # the common case, kept lean
                    children[key] = new(Child, (key, "leaf", prefix + key, value))
                    continue
                if not isinstance(key, str):
                    raise InvalidArgumentError(f"{self.path}: level keys must be str, got {key!r}")
                if isinstance(value, TensorSpec):
                    children[key] = Child(key, "leaf", prefix + key, value)
                elif isinstance(value, Mapping):
                    counter += 1
                    sub = f"{prefix}{counter}:{key}/"  # unique even if keys contain "/"
                    children[key] = Child(key, "level", sub)
                    stack.append((sub, value, depth + 1))
                else:
                    children[key] = Child(key, "value", prefix + key, value)
            meta = level_meta.get(prefix, getattr(node, "meta", None))  # a tree.Level carries its own
            self._levels[prefix] = LevelInfo(True, children, dict(meta or {}))

    def level(self, prefix: str) -> LevelInfo:
        try:
            return self._levels[prefix]
        except KeyError:
            raise InvalidArgumentError(f"{self.path}: no level {prefix!r}") from None

    def has_level(self, prefix: str) -> bool:
        return prefix in self._levels
