"""Leaves of every other format (:class:`~tdz_numba.tdz.sources.TensorSpec` leaves) in bulk:
zero-copy views, owned copies at memory speed, and read-ahead in file order.

:func:`spec_tensors` gives many leaves' views in one pass
(:func:`~tdz_numba.tdz.specbulk.spec_views`; what it leaves out is made one by one by
:func:`~tdz_numba.tdz.sources.tensor_from_spec`, which raises the reader's errors).
:func:`copy_specs` gives owned tensors: one ``torch.empty`` per leaf (2 MiB pages asked
for from 4 MiB on: :func:`~tdz_numba.files.copying.advise_huge`), filled from the file's
mapping by the streaming copy kernel on a few threads
(:func:`~tdz_numba.files.copying.copy_spans`) where the kernels run
(:func:`~tdz_numba.jit.policy.use_kernels`), else by ``os.preadv`` calls on a thread pool
(they release the GIL) that go forward through the file: leaves that follow each other in
the file are read by one call into many buffers (a scatter read, padding between them
into a scratch buffer), large leaves in 8 MiB pieces. :func:`hint` asks the kernel to read the leaves' byte ranges ahead, in
file order (``MADV_WILLNEED`` on the merged ranges), whatever order the keys come in.

Examples
--------
>>> import tempfile, pathlib, torch
>>> from safetensors.torch import save_file
>>> from tdz_numba import formats
>>> from tdz_numba.archive.foreign import copy_specs, spec_tensors
>>> with tempfile.TemporaryDirectory() as d:
...     p = pathlib.Path(d) / "x.safetensors"
...     save_file({"a": torch.arange(4.0), "b": torch.ones(2, 2)}, str(p))
...     src = formats.open_source(p)
...     specs = [c.leaf for c in src.level("").children.values()]
...     views, owned = spec_tensors(src, specs), copy_specs(src, specs)
...     print([t.tolist() for t in owned], views[0].data_ptr() == owned[0].data_ptr())
[[0.0, 1.0, 2.0, 3.0], [[1.0, 1.0], [1.0, 1.0]]] False
"""

from __future__ import annotations

import ctypes
import gc
import os
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from itertools import repeat
from operator import is_, is_not, methodcaller
from typing import Any

import numpy as np
import torch

from ..errors import BadArchiveError
from ..files.copying import advise_huge_runs, copy_spans
from ..files.loadadvice import advise_whole_file, whole_file_load
from ..files.memory import readahead, readahead_on
from ..jit.policy import use_kernels
from ..tdz.sources import Source, TensorSpec, make_present, own_views, tensor_from_spec
from ..tdz.specbulk import plain_extents, views_and_extents

__all__ = [
    "spec_tensors",
    "copy_specs",
    "slab_tensors",
    "owned_tensors",
    "hint",
    "all_specs",
    "PIECE",
    "MAX_GAP",
    "SLAB",
    "SLAB_LEAF",
]

#: Bytes one ``preadv`` call reads at most (larger leaves are split; runs of small ones end there).
PIECE = 8 << 20
#: Padding between two leaves that a scatter read skips into a scratch buffer (larger: a new call).
MAX_GAP = 64 << 10
#: Buffers in one ``preadv`` call (Linux's ``IOV_MAX`` is 1024; gaps take one each).
_IOVECS = 500
_ADDRESS = methodcaller("data_ptr")
#: Leaves of at most this many bytes are copied into shared slabs (see :func:`slab_tensors`).
SLAB_LEAF = 64 << 10
#: Bytes of one slab at most: what one small leaf can keep alive.
SLAB = 1 << 20


def all_specs(leaves: list[Any]) -> bool:
    """Whether every leaf is a :class:`~tdz_numba.tdz.sources.TensorSpec` (what this module takes)."""
    return bool(leaves) and set(map(type, leaves)) == {TensorSpec}


def spec_tensors(
    source: Source, leaves: list[TensorSpec], *, aligned: bool = False, hint_ahead: bool = False
) -> list[torch.Tensor]:
    """The zero-copy tensors of many leaves of ``source``, as ``tensor_from_spec`` makes them
    (``aligned=True``: misaligned leaves copied); its errors, for the first bad leaf in order.
    ``hint_ahead``: then :func:`hint` of the leaves (from the columns the views were checked with
    when the bulk path took every leaf)."""
    files, where = source.files, str(source.path)
    make_present(leaves, files)  # a remote file's leaves fetched in one batch (nothing locally)
    columns = getattr(source, "spec_columns", None)  # a flat reader's checked columns (formats._flat)
    out, ext = views_and_extents(leaves, files, aligned=aligned, columns=columns)
    if any(map(is_, out, repeat(None))):
        for i in [i for i, t in enumerate(out) if t is None]:
            out[i] = tensor_from_spec(leaves[i], files, where=where, aligned=aligned)
    if out and whole_file_load():  # (a load's views: each file's mapping advised by its order)
        if ext is not None and ext.ok.all():  # every leaf STORED, loader-less and in bounds
            cols: tuple[np.ndarray, np.ndarray, np.ndarray] | None = ext.files, ext.offsets, ext.nbytes
        else:
            cols = _leaf_columns(leaves)
        if cols is not None:
            _advise_columns(files, *cols)
            if hint_ahead:
                _hint_columns(files, *cols)
    elif hint_ahead and readahead_on():  # (off by default: nothing to gather)
        hint(source, leaves)
    return out


def _leaf_columns(leaves: list[TensorSpec]) -> tuple[np.ndarray, np.ndarray, np.ndarray] | None:
    """The leaves' file index, offset and STORED bytes (0 for a leaf with a loader), as columns;
    None where a claim is beyond int64 (the leaves then say what is wrong)."""
    try:
        n = len(leaves)
        _, _, _, _, files_col, offsets, nbytes, _, _, _, _, loaders = zip(*leaves)  # the columns, in C
        fidx = np.fromiter(files_col, np.int64, n)
        off = np.fromiter(offsets, np.int64, n)
        nb = np.fromiter(nbytes, np.int64, n)
        if loaders.count(None) != n:
            nb[np.fromiter(map(is_not, loaders, repeat(None)), bool, n)] = 0
    except (OverflowError, TypeError, ValueError):
        return None
    return fidx, off, nb


def _advise_columns(files: list[Any], fidx: np.ndarray, off: np.ndarray, nb: np.ndarray) -> None:
    """:func:`~tdz_numba.files.loadadvice.advise_whole_file` of each mapped file with the leaves
    in it, in their order (a directory of files: grouped by a stable sort, not a pass a file)."""
    if len(files) == 1:
        advise_whole_file(getattr(files[0], "_mmap", None), off, nb)
        return
    order = np.argsort(fidx, kind="stable")
    ends = np.flatnonzero(np.diff(fidx[order])) + 1
    for rows in np.split(order, ends):
        if rows.size and 0 <= (i := int(fidx[rows[0]])) < len(files):
            advise_whole_file(getattr(files[i], "_mmap", None), off[rows], nb[rows])


def hint(source: Source, leaves: list[TensorSpec]) -> int:
    """Asks the kernel to read the STORED leaves' bytes ahead, in file order, merged into few
    ranges (:func:`~tdz_numba.files.memory.readahead`: nothing below 1 MiB, never more than
    half the free memory). Returns the bytes hinted."""
    files = source.files
    if not leaves or not files or not readahead_on():  # (off by default: nothing to gather)
        return 0
    columns = _leaf_columns(leaves)
    return 0 if columns is None else _hint_columns(files, *columns)


def _hint_columns(files: list[Any], fidx: np.ndarray, off: np.ndarray, nb: np.ndarray) -> int:
    """:func:`hint` of leaves given as columns (file index, offset, bytes). Nothing to do (not even
    the ranges' sort and merge, ~0.1-0.2 ms a file) while read-ahead is off, as it is by default
    (``TDZ_NUMBA_READAHEAD``: :func:`~tdz_numba.files.memory.readahead` then reads nothing)."""
    if not readahead_on():
        return 0
    done = 0
    for i, f in enumerate(files):
        mm = getattr(f, "_mmap", None)
        if mm is None:
            continue
        if len(files) == 1:
            done += readahead(mm, off, nb)
            continue
        mine = fidx == i
        if mine.any():
            done += readahead(mm, off[mine], nb[mine])
    return done


def _dest(t: torch.Tensor, nbytes: int) -> memoryview:
    """A writable memoryview of an owned, contiguous tensor's bytes."""
    return memoryview((ctypes.c_ubyte * nbytes).from_address(t.data_ptr())).cast("B")


def _read_full(fd: int, views: list[memoryview], offset: int, path: Any) -> None:
    """``preadv`` of ``views`` at ``offset`` until all are full (a short read continues where it
    stopped); :class:`~tdz_numba.BadArchiveError` when the file ends first."""
    first = 0
    while first < len(views):
        n = os.preadv(fd, views[first:] if first else views, offset)
        if n <= 0:
            raise BadArchiveError(f"{path}: short read at offset {offset} (file truncated?)")
        offset += n
        while first < len(views) and n >= len(views[first]):
            n -= len(views[first])
            first += 1
        if n:  # a read that stopped inside a buffer: the rest of it next
            views = views[:first] + [views[first][n:]] + views[first + 1 :]


def _jobs(
    offsets: np.ndarray, sizes: np.ndarray, dests: list[memoryview]
) -> list[tuple[int, list[memoryview]]]:
    """``(file offset, buffers)`` scatter reads of leaves sorted by offset: consecutive leaves
    (padding up to :data:`MAX_GAP` between them, at most :data:`PIECE` bytes and
    :data:`_IOVECS` leaves per read) share one read; larger leaves are split in pieces."""
    jobs: list[tuple[int, list[memoryview]]] = []
    n = len(dests)
    if n == 0:
        return jobs
    ends = offsets + sizes
    gaps = np.empty(n, np.int64)
    gaps[0] = -1
    gaps[1:] = offsets[1:] - ends[:-1]
    big = sizes > PIECE
    start = (gaps < 0) | (gaps > MAX_GAP) | big | np.r_[False, big[:-1]]
    cum = np.cumsum(sizes)
    start[1:] |= (cum[1:] - 1) // PIECE != (cum[:-1] - 1) // PIECE
    start[1:] |= np.arange(1, n) % _IOVECS == 0
    start[0] = True
    bounds = np.flatnonzero(start).tolist() + [n]
    max_gap = int(gaps[1:][~start[1:]].max()) if n > 1 and (~start[1:]).any() else 0
    scratch = memoryview(bytearray(max(max_gap, 1))) if max_gap > 0 else None
    offs, gap_list = offsets.tolist(), gaps.tolist()
    for a, b in zip(bounds[:-1], bounds[1:]):
        if b - a == 1 and big[a]:
            view, off = dests[a], offs[a]
            for s in range(0, len(view), PIECE):
                jobs.append((off + s, [view[s : s + PIECE]]))
            continue
        views: list[memoryview] = []
        for k in range(a, b):
            gap = gap_list[k]
            if k > a and gap > 0:
                views.append(scratch[:gap])  # type: ignore[index]  # scratch exists when a gap does
            views.append(dests[k])
        jobs.append((offs[a], views))
    return jobs


def slab_tensors(
    dtypes: Sequence[Any],
    shapes: Sequence[Any],
    nbytes: Sequence[int],
    offsets: Sequence[int],
    rows: list[int],
    out: list[Any],
    slab: int = SLAB,
    *,
    destinations: bool = True,
) -> list[tuple[int, memoryview, int]]:
    """Owned tensors of the small leaves ``rows`` of one file (``out[j]`` for each, of
    ``dtypes[j]``, ``shapes[j]`` and ``nbytes[j]`` bytes at file offset ``offsets[j]``), made
    from shared slabs: the leaves of one dtype, in file order, packed into allocations of at
    most ``slab`` bytes (one allocation per slab, not per leaf: 20,000 leaves of 10 KiB copy
    in about half the CPU time), each leaf its own tensor (its own version counter: made below
    autograd's view tracking) on a slice of its slab's storage. The trade-off: a small leaf
    keeps its slab alive, and ``torch.save`` of that one leaf alone writes its slab's storage.
    Returns ``(j, destination, its address)`` for each leaf (``destinations=False``: nothing)."""
    groups: dict[Any, list[int]] = {}
    for j in rows:
        groups.setdefault(dtypes[j], []).append(j)
    done: list[tuple[int, memoryview, int]] = []
    for dtype, members in groups.items():
        members.sort(key=offsets.__getitem__)
        itemsize = dtype.itemsize
        start = 0
        while start < len(members):
            stop, size = start, 0
            while stop < len(members) and (stop == start or size + nbytes[members[stop]] <= slab):
                size += nbytes[members[stop]]
                stop += 1
            part = members[start:stop]
            sizes = [nbytes[j] for j in part]
            block = torch.empty(size // itemsize, dtype=dtype)
            with own_views():
                pieces = block.split_with_sizes([s // itemsize for s in sizes])
                for j, piece in zip(part, pieces):
                    shape = shapes[j]
                    out[j] = piece if piece.shape == shape else piece.view(shape)
            start = stop
            if not destinations:
                continue
            flat = block.view(torch.uint8) if block.dtype != torch.uint8 else block
            mv = memoryview(flat.numpy())  # type: ignore[arg-type]  # ndarray is a buffer (numpy stubs)
            at, address = 0, block.data_ptr()
            for j, s in zip(part, sizes):
                done.append((j, mv[at : at + s], address + at))
                at += s
    return done


def owned_tensors(
    dtypes: Sequence[Any],
    shapes: Sequence[Any],
    nbytes: np.ndarray,
    offsets: np.ndarray,
    rows: np.ndarray,
    out: list[Any],
    files: np.ndarray | None = None,
    slab: int = SLAB,
) -> tuple[list[torch.Tensor], np.ndarray]:
    """Fresh owned tensors for the leaves ``rows`` (``out[j]`` of ``dtypes[j]`` and ``shapes[j]``,
    ``nbytes[j]`` bytes at file offset ``offsets[j]`` of file ``files[j]``; one file when None),
    to be filled by a copy: a leaf over :data:`SLAB_LEAF` bytes gets its own allocation, advised
    for 2 MiB pages (fresh memory: 512x fewer faults), the small ones share slabs of at most
    ``slab`` bytes, per file in file order (:func:`slab_tensors`). Returns the tensors of ``rows``
    in order and their addresses."""
    nb = nbytes[rows]
    big = nb > SLAB_LEAF
    for i in rows[big].tolist():
        out[i] = torch.empty(shapes[i], dtype=dtypes[i])
    if not big.all():
        small = rows[~big]
        nb_list, off_list = nbytes.tolist(), offsets.tolist()
        groups = (
            [small] if files is None else [small[files[small] == f] for f in np.unique(files[small]).tolist()]
        )
        for mine in groups:
            slab_tensors(dtypes, shapes, nb_list, off_list, mine.tolist(), out, slab, destinations=False)
    made = [out[i] for i in rows.tolist()]
    addrs = np.fromiter(map(_ADDRESS, made), np.int64, len(made))
    advise_huge_runs(addrs[big], nb[big])
    return made, addrs


def copy_specs(
    source: Source, leaves: list[TensorSpec], num_threads: int | None = None
) -> list[torch.Tensor]:
    """Owned tensors of many leaves of ``source`` (what ``tensor_from_spec(..., copy=True)``
    gives, read in bulk; see the module). Leaves the bulk path does not take (strided,
    compressed, loaders, bad bounds) are made one by one first, in order, so the first bad
    leaf raises its reader's error before anything is read."""
    files, where = source.files, str(source.path)
    n = len(leaves)
    if n == 0:
        return []
    if any(getattr(f, "remote", False) for f in files):  # fetched in one batch, then copied from the mapping
        make_present(leaves, files)
        return [tensor_from_spec(s, files, copy=True, where=where, num_threads=num_threads) for s in leaves]
    ext = plain_extents(leaves, files)
    take = ext.ok & ext.dense
    out: list[Any] = [None] * n
    for i in np.flatnonzero(~take).tolist():
        out[i] = tensor_from_spec(leaves[i], files, copy=True, where=where, num_threads=num_threads)
    rows = np.flatnonzero(take)
    if not rows.size:
        return out
    was = gc.isenabled()
    gc.disable()  # many new tensors, no cycles among them
    try:
        nb_all = ext.numels * ext.itemsizes
        made, addrs = owned_tensors(ext.dtypes, ext.shapes, nb_all, ext.offsets, rows, out, ext.files)
        nbytes = nb_all[rows]
        kernel = use_kernels(int(nbytes.sum()) >> 18)
        dests: list[memoryview] | None = None
        work: list[tuple[int, int, list[memoryview]]] = []
        fcol = ext.files[rows]
        for fi in np.unique(fcol).tolist():
            mine = np.flatnonzero(fcol == fi)
            order = mine[np.argsort(ext.offsets[rows][mine], kind="stable")]
            offs = ext.offsets[rows][order]
            sizes = nbytes[order]
            mm = getattr(files[fi], "_mmap", None)
            if mm is not None:
                readahead(mm, offs, sizes)  # cold: the kernel reads ahead in file order
            if kernel and files[fi].buffer.size:  # from the mapping, streaming stores, in parallel
                copy_spans(files[fi].buffer, offs, addrs[order], sizes, num_threads, where=where)
                continue
            if dests is None:
                dests = list(map(_dest, made, nbytes.tolist()))
            work.extend(
                (fi, off, views) for off, views in _jobs(offs, sizes, [dests[k] for k in order.tolist()])
            )
    finally:
        if was:
            gc.enable()
    _run(files, work, num_threads)
    return out


def _run(files: list[Any], work: list[tuple[int, int, list[memoryview]]], num_threads: int | None) -> None:
    """Runs the scatter reads on a thread pool (in file order: each worker takes the next)."""
    fds: dict[int, int] = {}
    try:
        for fi in {w[0] for w in work}:
            fds[fi] = os.open(files[fi].path, os.O_RDONLY)

        def one(job: tuple[int, int, list[memoryview]]) -> None:
            fi, off, views = job
            _read_full(fds[fi], views, off, files[fi].path)

        total = sum(len(v) for w in work for v in w[2])
        workers = min(num_threads or os.cpu_count() or 1, len(work))
        if workers <= 1 or total < (4 << 20):
            for job in work:
                one(job)
        else:
            with ThreadPoolExecutor(workers) as pool:
                list(pool.map(one, work))
    finally:
        for fd in fds.values():
            os.close(fd)
