"""Leaves in bulk: a whole level (or file) resolved at once, and copies read in parallel.

:func:`build_tree` walks the levels below an :class:`~tdz_numba.Archive`
once, collects every leaf, and asks the source for all their tensors in one
call (for ``.tdz``: one vectorized pass over the index rows, then one
``as_strided`` per leaf on a typed view of the whole mapping, made below
autograd's view tracking (:func:`~tdz_numba.tdz.sources.own_views`): each leaf
shares the mapping's storage but has its own version counter, so an in-place
write to one leaf (BatchNorm's running stats) leaves the others' autograd state
alone. Measured the cheapest of tracked ``as_strided``, ``set_`` on the
storage, ``.data``, numpy views + ``from_numpy``, ``torch.frombuffer`` and
``unsafe_split_with_sizes``). With ``copy=True`` the payloads are
copied from the mapping by the streaming copy kernel on a few threads
(:func:`~tdz_numba.files.copying.copy_spans`; without the kernels: scatter
``os.preadv`` calls in file order on a thread pool, which release the GIL),
into preallocated tensors: a leaf above :data:`~tdz_numba.archive.foreign.SLAB_LEAF` bytes gets its own
allocation (2 MiB pages asked for: :func:`~tdz_numba.files.copying.advise_huge_runs`); smaller ones share slabs of at most
:data:`~tdz_numba.archive.foreign.SLAB` bytes (one allocation per slab, not per leaf: 20,000 leaves of
10 KiB copy in about half the CPU time), each still its own tensor with its
own version counter and its own bytes. The trade-off: a small leaf keeps its
slab alive (at most :data:`~tdz_numba.archive.foreign.SLAB` bytes), and ``torch.save`` of that one leaf
alone writes its slab's storage.

Examples
--------
>>> import tempfile, pathlib, torch, tdz_numba
>>> with tempfile.TemporaryDirectory() as d:
...     p = tdz_numba.save({"a": {"b": torch.arange(3)}, "c": "txt"}, pathlib.Path(d) / "x.tdz")
...     tree = tdz_numba.load(p, copy=True)
...     print(tree["a"]["b"].tolist(), tree["c"])
[0, 1, 2] txt
"""

from __future__ import annotations

import math
import os
from concurrent.futures import ThreadPoolExecutor
from operator import attrgetter
from typing import Any

import numpy as np
import torch

from ..errors import BadArchiveError
from ..files.copying import advise_huge_runs, copy_spans
from ..jit.policy import use_kernels
from ..tdz.dtypes import dtype_table
from ..tdz.sources import (
    LeafInfo,
    Location,
    Source,
    TensorSpec,
    needs_alignment,
    paused_gc,
    tensor_from_spec,
)
from ..tdz.tree import Level
from .foreign import SLAB, SLAB_LEAF, _dest, all_specs, copy_specs, owned_tensors, slab_tensors, spec_tensors

__all__ = ["build_tree", "materialize", "read_into", "spec_info", "meta_tensor", "COPY_PIECE"]

#: Bytes read by one ``preadv`` call of a parallel copy (larger leaves are split).
COPY_PIECE = 8 << 20
#: Below this total, copies come from the mapping (one memcpy each): threads cost more.
_SMALL_COPY = 4 << 20
_NESTED = attrgetter("is_nested")
_DTYPES = dtype_table()


def read_into(
    path: str | os.PathLike,
    jobs: list[tuple[int, np.ndarray]],
    num_threads: int | None = None,
    direct: bool = False,
) -> bool:
    """Reads ``(file offset, destination uint8 array)`` jobs from ``path`` with
    parallel ``os.preadv``; raises :class:`~tdz_numba.BadArchiveError` on a short read.

    With ``direct=True`` the file is opened with ``O_DIRECT`` (no page cache): every job's
    offset and destination address must then be page-aligned and its length a whole
    number of pages (the caller over-allocates); where the file system refuses
    ``O_DIRECT`` the reads are buffered. Returns whether ``O_DIRECT`` was used.

    Examples
    --------
    >>> import tempfile, os, numpy as np
    >>> from tdz_numba.archive.bulk import read_into
    >>> with tempfile.NamedTemporaryFile() as f:
    ...     _ = f.write(bytes(range(10))); f.flush()
    ...     out = np.empty(4, np.uint8)
    ...     _ = read_into(f.name, [(3, out)])
    ...     print(out.tolist())
    [3, 4, 5, 6]
    """
    pieces: list[tuple[int, memoryview]] = []
    for offset, dest in jobs:
        view = memoryview(dest).cast("B")  # type: ignore[arg-type]  # ndarray is a buffer (numpy stubs, py<3.12)
        for start in range(0, len(view), COPY_PIECE):
            pieces.append((offset + start, view[start : start + COPY_PIECE]))
    if not pieces:
        return False
    fd = -1
    if direct and hasattr(os, "O_DIRECT"):
        try:
            fd = os.open(path, os.O_RDONLY | os.O_DIRECT)
        except OSError:  # a file system without O_DIRECT (EINVAL): buffered reads
            fd = -1
    used_direct = fd >= 0
    if fd < 0:
        fd = os.open(path, os.O_RDONLY)
    try:

        def one(piece: tuple[int, memoryview]) -> None:
            off, mv = piece
            done = 0
            while done < len(mv):
                n = os.preadv(fd, [mv[done:]], off + done)
                if n <= 0:
                    if (
                        used_direct and done
                    ):  # O_DIRECT past the end of the file: the padding of the last page
                        return
                    raise BadArchiveError(f"{path}: short read at offset {off + done} (file truncated?)")
                done += n

        workers = min(num_threads or os.cpu_count() or 1, len(pieces))
        if workers <= 1:
            for piece in pieces:
                one(piece)
        else:
            with ThreadPoolExecutor(workers) as pool:
                list(pool.map(one, pieces))
    finally:
        os.close(fd)
    return used_direct


def _u8(t: torch.Tensor) -> np.ndarray:
    flat = t.view(-1)
    return (flat.view(torch.uint8) if flat.dtype != torch.uint8 else flat).numpy()


def _copy_tdz(
    source: Any, leaves: list[Any], num_threads: int | None, direct: bool = False
) -> list[torch.Tensor]:
    """Owned tensors of ``.tdz`` leaves: stored ones read with parallel preadv (``direct``:
    page-aligned ones with O_DIRECT into page-aligned buffers)."""
    from ..tdz.sources import paused_gc

    with paused_gc():  # thousands of new tensors and buffers, no cycles among them
        return _copy_tdz_leaves(source, leaves, num_threads, direct)


def _copy_tdz_leaves(
    source: Any, leaves: list[Any], num_threads: int | None, direct: bool
) -> list[torch.Tensor]:
    """Owned tensors of ``leaves``: the plain STORED ones straight from the index's columns
    (:meth:`~tdz_numba.tdz.source.TdzSource.extents`: no view made first), the others (and every
    leaf of a small or ``direct`` copy) through their views (:func:`_copy_tdz_views`)."""
    extents = getattr(source, "extents", None)
    buffer = source.index.buffer
    if direct or extents is None or buffer is None or not buffer.size:
        return _copy_tdz_views(source, leaves, num_threads, direct)
    ok, offsets, sizes = extents(leaves)
    if int(sizes[ok].sum()) < _SMALL_COPY:
        return _copy_tdz_views(source, leaves, num_threads, direct)
    out: list[Any] = [None] * len(leaves)
    rest = np.flatnonzero(~ok).tolist()
    if rest:  # (their errors first, as the views would raise them)
        for i, t in zip(rest, _copy_tdz_views(source, [leaves[i] for i in rest], num_threads, direct)):
            out[i] = t
    rows = np.flatnonzero(ok)
    dtypes: list[Any] = [None] * len(leaves)
    shapes: list[Any] = [None] * len(leaves)
    for i in rows.tolist():
        dtypes[i], shapes[i] = _DTYPES[leaves[i].dtype], leaves[i].shape
    made, addrs = owned_tensors(dtypes, shapes, sizes, offsets, rows, out, slab=SLAB)
    nbytes, offs = sizes[rows], offsets[rows]
    live = nbytes > 0
    if use_kernels(int(nbytes.sum()) >> 18):  # from the mapping, streaming stores, in parallel
        copy_spans(buffer, offs[live], addrs[live], nbytes[live], num_threads, where=source.path)
    else:
        dests = [_dest(t, n) for t, n in zip(made, nbytes.tolist())]
        _scatter_read(
            source.path, [(o, d) for o, d, x in zip(offs.tolist(), dests, live.tolist()) if x], num_threads
        )
    return out


def _copy_tdz_views(
    source: Any, leaves: list[Any], num_threads: int | None, direct: bool
) -> list[torch.Tensor]:
    """Owned tensors of ``leaves`` copied from their views (:meth:`~tdz_numba.tdz.source.TdzSource.tensors`):
    clones below :data:`_SMALL_COPY` bytes in all, else the spans of the views that share the
    mapping (``direct``: page-aligned ones read with O_DIRECT)."""
    from ..files.memory import PAGE_SIZE, aligned_empty

    views = source.tensors(leaves)
    n = len(views)
    nested = list(map(_NESTED, views))
    nbytes = [0 if nst else t.numel() * t.element_size() for t, nst in zip(views, nested)]
    total = sum(nbytes)
    out: list[Any] = [None] * n
    jobs: list[tuple[int, memoryview, int]] = []  # (file offset, destination, its address)
    direct_jobs: list[tuple[int, np.ndarray]] = []
    base = source.index.buffer.ctypes.data if (total >= _SMALL_COPY or direct) else 0
    slabbed: list[int] = []
    offsets = [0] * n
    for j, t in enumerate(views):
        shared = base and not nested[j] and nbytes[j] and t.untyped_storage().data_ptr() == base
        if not shared:
            out[j] = t.clone()
            continue
        offset = offsets[j] = t.data_ptr() - base
        if direct and offset % PAGE_SIZE == 0:
            size = nbytes[j]
            buf = aligned_empty(-(-size // PAGE_SIZE) * PAGE_SIZE)  # whole pages, page-aligned
            direct_jobs.append((offset, buf))
            out[j] = torch.from_numpy(buf[:size]).view(t.dtype).view(t.shape)
        elif nbytes[j] <= SLAB_LEAF:
            slabbed.append(j)
        else:
            owned = out[j] = torch.empty(t.shape, dtype=t.dtype)
            jobs.append((offset, memoryview(_u8(owned)), owned.data_ptr()))  # type: ignore[arg-type]  # ndarray is a buffer
    if slabbed:
        jobs.extend(_slabs(views, slabbed, nbytes, offsets, out))
    if jobs:  # fresh memory: 2 MiB pages (512x fewer faults), straddling leaves that lie side by side
        owned_at = np.array([(a, len(mv)) for _, mv, a in jobs if len(mv) > SLAB_LEAF], np.int64)
        if owned_at.size:
            advise_huge_runs(owned_at[:, 0], owned_at[:, 1])
    if jobs and use_kernels(sum(len(mv) for _, mv, _ in jobs) >> 18):  # from the mapping, streaming
        offs, addrs = np.array([o for o, _, _ in jobs], np.int64), np.array([a for _, _, a in jobs], np.int64)
        sizes = np.fromiter((len(mv) for _, mv, _ in jobs), np.int64, len(jobs))
        copy_spans(source.index.buffer, offs, addrs, sizes, num_threads, where=source.path)
    else:
        _scatter_read(source.path, [(o, mv) for o, mv, _ in jobs], num_threads)
    if direct_jobs:
        read_into(source.path, direct_jobs, num_threads, direct=True)
    return out


def _slabs(
    views: list[torch.Tensor], rows: list[int], nbytes: list[int], offsets: list[int], out: list[Any]
) -> list[tuple[int, memoryview, int]]:
    """Owned tensors of the small leaves ``rows`` (``out[j]`` for each) on shared slabs of at most
    :data:`~tdz_numba.archive.foreign.SLAB` bytes (:func:`~tdz_numba.archive.foreign.slab_tensors`). Returns the ``(file
    offset, destination, its address)`` reads that fill them."""
    dtypes = [t.dtype for t in views]
    shapes = [t.shape for t in views]
    made = slab_tensors(dtypes, shapes, nbytes, offsets, rows, out, SLAB)
    return [(offsets[j], mv, address) for j, mv, address in made]


def _scatter_read(path: Any, jobs: list[tuple[int, memoryview]], num_threads: int | None) -> None:
    """Reads ``(file offset, destination)`` jobs in file order, leaves that follow each other in
    one scatter ``preadv`` (the foreign readers' plan): 20,000 small leaves are a few hundred
    reads, not 20,000 thread-pool tasks."""
    from .foreign import _jobs, _read_full

    if not jobs:
        return
    offsets = np.fromiter((o for o, _ in jobs), np.int64, len(jobs))
    order = np.argsort(offsets, kind="stable")
    dests = [jobs[k][1] for k in order.tolist()]
    sizes = np.fromiter(map(len, dests), np.int64, len(dests))
    work = _jobs(offsets[order], sizes, dests)
    fd = os.open(path, os.O_RDONLY)
    try:
        workers = min(num_threads or os.cpu_count() or 1, len(work))
        if workers <= 1 or int(sizes.sum()) < _SMALL_COPY:
            for off, views in work:
                _read_full(fd, views, off, path)
        else:
            with ThreadPoolExecutor(workers) as pool:
                list(pool.map(lambda job: _read_full(fd, job[1], job[0], path), work))
    finally:
        os.close(fd)


def materialize(ar: Any, leaves: list[Any], *, hint_ahead: bool = True) -> list[torch.Tensor]:
    """The delivered tensors of many leaf specs of one archive (options applied).

    Leaves of every other format than ``.tdz`` are made in bulk
    (:mod:`~tdz_numba.archive.foreign`): views checked and built in one pass, or, with
    ``copy=True``, owned tensors read by scatter ``preadv`` in file order. With
    ``hint_ahead`` (views) the kernel is asked to read their bytes ahead, in file order."""
    state = ar._state
    source = state.source
    if not leaves:
        return []
    if state.device is not None and state.device.type == "meta":
        return [meta_tensor(source, leaf) for leaf in leaves]
    threads = getattr(source, "num_threads", None)
    copied = False
    if hasattr(source, "tensors"):
        if state.copy:
            tensors, copied = _copy_tdz(source, leaves, threads, getattr(state, "direct", False)), True
        else:
            tensors = source.tensors(leaves)
    elif getattr(source, "tensor", None) is not None:
        tensors = [source.tensor(leaf) for leaf in leaves]  # type: ignore[attr-defined]  # a source of its own leaves
    elif not all_specs(leaves):  # pragma: no cover - every reader's leaves are TensorSpec
        files, where = source.files, str(source.path)
        tensors = [tensor_from_spec(leaf, files, copy=state.copy, where=where) for leaf in leaves]
        copied = state.copy
    elif state.copy:
        tensors, copied = copy_specs(source, leaves, threads), True
    else:
        aligned = getattr(state, "aligned", False)
        tensors = spec_tensors(source, leaves, aligned=aligned, hint_ahead=hint_ahead)
    if getattr(state, "dequantize", False):
        tensors = [dequantized(leaf, t) for leaf, t in zip(leaves, tensors)]
    if state.dtype is None and state.device is None:
        return tensors
    return [ar._deliver(t, copied=copied) for t in tensors]


def dequantized(leaf: Any, t: torch.Tensor) -> torch.Tensor:
    """``t`` decoded to float32 when ``leaf`` holds GGML quantized blocks (GGUF ``Q4_0``, ``Q4_K``,
    ...; ``open/load(..., dequantize=True)``), else ``t`` itself."""
    type_name = getattr(leaf, "type_name", "")
    if not type_name or t.dtype != torch.uint8:
        return t
    from ..formats.gguf import dequantize, is_quantized

    return dequantize(t, type_name, leaf.shape) if is_quantized(type_name) else t


_KIND = attrgetter("kind")
_LEAF = attrgetter("leaf")


def build_tree(ar: Any) -> Level:
    """Every value below ``ar`` as nested :class:`~tdz_numba.tdz.tree.Level` dicts, leaves resolved in bulk.

    Levels in the common case (a ``.tdz`` TensorDict level of stored leaves,
    read without ``copy``/``dtype``/``device``) are built in one pass each by
    the source's ``quick_level``; the others go through the general path,
    whose leaves are materialized together at the end (compressed ones
    inflated in one parallel batch).
    """
    ar._check_open()
    state = ar._state
    quick = getattr(state.source, "quick_level", None)
    if state.copy or state.dtype is not None or state.device is not None:
        quick = None
    slots: list[tuple[Level, list[str]]] = []
    leaves: list[Any] = []
    root = Level()
    stack: list[tuple[str, Level | None, str]] = [(ar._prefix, None, "")]  # (level, parent, key in parent)
    while stack:
        prefix, parent, name = stack.pop()
        got = quick(prefix) if quick is not None else None
        if got is not None:
            out, subs = got
            for key, sub in subs:  # sub-levels: filled when popped
                stack.append((sub, out, key))
        else:
            node = ar._sub(prefix) if prefix != ar._prefix else ar
            if parent is not None:
                plain, value = node._plain_value()
                if plain:
                    parent[name] = value
                    continue
            keyed, children, _ = node._level()
            out = Level(meta=node.meta, keyed=keyed)
            with paused_gc():  # a level of many leaves: lists of them, not one step per leaf
                kinds = list(map(_KIND, children.values()))
                if kinds.count("leaf") == len(kinds):  # a level of leaves only: no per-key lookups
                    keys = list(children)  # filled below, in this order (nothing else goes in)
                    leaves.extend(map(_LEAF, children.values()))
                else:
                    out.update(dict.fromkeys(children))  # keeps the key order; filled below
                    keys = [k for k, kind in zip(children, kinds) if kind == "leaf"]
                    leaves.extend(children[k].leaf for k in keys)
            slots.append((out, keys))
            if len(keys) < len(kinds):
                for key, kind in zip(children, kinds):
                    if kind == "level":
                        stack.append((children[key].path, out, key))
                    elif kind != "leaf":
                        out[key] = node._value(children[key])
        if parent is None:
            root = out
        else:
            parent[name] = out
    made = materialize(ar, leaves)
    pos = 0
    for lvl, keys in slots:
        lvl.update(zip(keys, made[pos : pos + len(keys)]))
        pos += len(keys)
    return root


def meta_tensor(source: Source, leaf: Any) -> torch.Tensor:
    """A meta-device tensor of a leaf's dtype and shape (no payload read)."""
    from ..tdz.dtypes import torch_dtype

    if isinstance(leaf, TensorSpec):
        return torch.empty(leaf.shape, dtype=leaf.dtype, device="meta")
    dtype = torch_dtype(leaf.dtype, entry=f"{source.path}: {leaf.entry}")
    if leaf.nested:
        shapes = source.nested_shapes(leaf) if hasattr(source, "nested_shapes") else None
        if shapes:  # torch has no meta nested tensors: a CPU one over an uninitialized buffer (nothing read)
            sizes = torch.tensor(shapes, dtype=torch.int64)
            strides, offsets = torch._nested_compute_contiguous_strides_offsets(sizes)
            buf = torch.empty(int(sizes.prod(-1).sum()), dtype=dtype)
            return torch._nested_view_from_buffer(buf, sizes, strides, offsets)
    return torch.empty(leaf.shape, dtype=dtype, device="meta")


def spec_info(spec: TensorSpec, source: Source, *, aligned: bool = False, copy: bool = False) -> LeafInfo:
    """The :class:`LeafInfo` of a :class:`~tdz_numba.tdz.sources.TensorSpec` leaf: ``zero_copy``
    says whether the archive's tensor is a view of the mapping (a STORED leaf with elements at
    any offset; not with ``copy``, nor with ``aligned`` for a misaligned one)."""

    itemsize = spec.dtype.itemsize
    nbytes = spec.size if spec.codec != "stored" else math.prod(spec.shape) * itemsize
    files = source.files
    fname = str(files[spec.file].path) if 0 <= spec.file < len(files) else str(source.path)
    zero = spec.loader is None and spec.codec == "stored" and nbytes > 0 and not copy
    if zero and spec.offset % itemsize and (aligned or needs_alignment(spec.dtype)):
        zero = False
    loc = Location(fname, spec.offset, spec.nbytes) if spec.loader is None else None
    return LeafInfo(
        spec.key,
        None,
        spec.dtype,
        tuple(spec.shape),
        spec.offset if spec.loader is None else None,
        nbytes,
        spec.nbytes,
        spec.codec,
        spec.crc,
        False,
        zero,
        loc,
        spec.type_name or str(spec.dtype),
    )
