"""The benchmark harness: tdz_numba against tensordict, torch, safetensors and a raw-write floor.

Run ``tdz bench`` or ``python -m tdz_numba.bench`` (``--quick`` for a 16 MiB
run, ``--help`` for the filters). Two workloads of random float32 data
(default 256 MiB each):

* ``flat``: 8 leaves of shape ``(2048, 4096)`` (rows scale with ``--size-mib``);
* ``small``: 100 groups x 20 leaves of 33,554 values (values scale with the size),
  nested as ``{"group_000": {"leaf_00": t, ...}, ...}``.

Ops: ``save``, ``open`` (lazy open), ``read`` (open + ``float(t.sum())`` over
every leaf), ``copy`` (``shutil.copyfile`` / ``copytree`` of the artifact) and
``verify`` (``tdz_numba.verify``, with zlib-ng's single-thread ``crc32`` over
the same payload bytes for comparison).

Method: for every (workload, op, format) one warm-up run, then ``--repeat``
timed runs; the median is reported. Every save (and copy) writes a fresh path;
the previous artifact is deleted, and the new one fsynced, outside the timed
region. Results (returned handles, mappings, buffers) are also released
outside it, with the garbage collector run before and disabled during each
timed run. Numba kernels are compiled (or loaded from cache) before timing.
With ``--cold`` every file of the artifact is fsynced and its pages dropped
(``posix_fadvise(DONTNEED)``) before each timed open, read, copy and verify.

Compressed section (``--compression deflate``, optionally ``--compresslevel N``;
default None = zlib-ng's default level): it replaces the sections above. Workloads:

* ``images_flat``: ONE uint8 leaf ``[N, 3, 64, 64]`` of image-like data (smooth
  gradients and shading, sparse +-2 sensor noise, a masked background, a flat
  object; deterministic; about 3.5x with deflate), N = 2000 x B images, B =
  size / 2000 / 12 KiB rounded (below 1.5, B = 1 and the images are shorter:
  ``[2000, 3, H, 64]``, e.g. H = 44 for 16 MiB);
* ``images_small``: the same images as 100 groups x 20 leaves ``[B, 3, 64, 64]``;
* ``flat`` and ``small``: the float32 workloads above (random floats barely compress).

Ops ``save`` and ``load`` (open + ``float(t.sum())`` of every leaf), formats
``tdz_numba`` (all threads), ``tdz_numba_1t`` (``num_threads=1``), ``td_tdz``
(``TensorDict.save(p, compression="deflate")``; ``load_memmap(p,
num_threads=os.cpu_count())``) and ``zlib_ng`` (one raw-deflate stream per leaf,
``zlib_ng.compressobj(level, DEFLATED, -15)`` on one thread, written to one file;
load = ``zlib_ng.decompress(..., wbits=-15)`` of every stream + the same sums: the
single-thread throughput reference). The report adds each format's size ratio
(uncompressed bytes / file size), the throughputs, and per workload the scaling
of tdz_numba (all threads vs one) and three goal checks (PASS/FAIL): scaling
>= 0.8 x cores; single thread within 1.2x of zlib-ng; save >= 2x faster than
tensordict compressed.
"""

from __future__ import annotations

import argparse
import gc
import importlib
import math
import os
import platform
import shlex
import shutil
import statistics
import sys
import tempfile
import time
import warnings
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

__all__ = ["WORKLOADS", "OPS", "FORMATS", "CRC_FORMAT", "COMPRESSIONS", "COMPRESSED_WORKLOADS",
           "COMPRESSED_OPS", "COMPRESSED_FORMATS", "BenchResult", "run", "main", "format_table",
           "goal_lines", "plot", "make_images"]  # fmt: skip

WORKLOADS = ("flat", "small")
OPS = ("save", "open", "read", "copy", "verify")
FORMATS = ("tdz_numba", "td_tdz", "td_tdz_enabled", "td_dir", "td_consolidated", "torch", "safetensors",
           "floor")  # fmt: skip
#: Pseudo-format of the verify row: zlib-ng's single-thread crc32 over the same payload bytes.
CRC_FORMAT = "zlib_ng_crc32"

#: The compressed section (``--compression``): its workloads, ops and formats.
COMPRESSIONS = ("deflate",)
COMPRESSED_WORKLOADS = ("images_flat", "images_small", "flat", "small")
COMPRESSED_OPS = ("save", "load")
COMPRESSED_FORMATS = ("tdz_numba", "tdz_numba_1t", "td_tdz", "zlib_ng")
#: Image shape ``(C, H, W)`` of the images workloads and their number of leaves.
IMAGE_SHAPE = (3, 64, 64)
IMAGE_LEAVES = (100, 20)
#: Goals of the compressed section.
GOAL_SCALING = 0.8  # tdz_numba all threads vs 1 thread >= GOAL_SCALING x cores
GOAL_SINGLE = 1.2  # tdz_numba_1t / zlib_ng <= GOAL_SINGLE
GOAL_VS_TD = 2.0  # td_tdz save / tdz_numba save >= GOAL_VS_TD

DEFAULT_SIZE_MIB = 256.0
DEFAULT_REPEAT = 5
QUICK_SIZE_MIB = 16.0
QUICK_REPEAT = 3

_COLORS = {
    "tdz_numba": "#d62728",
    "td_tdz": "#1f77b4",
    "td_tdz_enabled": "#e377c2",
    "td_dir": "#aec7e8",
    "td_consolidated": "#17becf",
    "torch": "#ff7f0e",
    "safetensors": "#2ca02c",
    "floor": "#7f7f7f",
    CRC_FORMAT: "#9467bd",
    "tdz_numba_1t": "#ff9896",
    "zlib_ng": "#9467bd",
}


# -- workloads -------------------------------------------------------------------------


@dataclass
class Workload:
    """One workload's data, made once: the nested tree and views of it for every format."""

    name: str
    description: str
    tree: dict  # nested dicts of tensors
    flat: dict  # "group_000.leaf_00" -> tensor (the same tensors)
    arrays: list  # numpy views of every leaf, in order
    nbytes: int
    _td: Any = None

    @property
    def td(self):
        """The tree as a TensorDict (built once, outside timing; shares the tensors)."""
        if self._td is None:
            from tensordict import TensorDict

            self._td = TensorDict(self.tree, batch_size=[])
        return self._td

    def leaves(self) -> Iterable:
        return self.flat.values()


def _fill_images_py(out, params, sx, cx, sy, cy, seed):  # pragma: no cover - compiled by Numba
    """Fills ``out`` (uint8 ``[n, c, h, w]``) with image-like pixels; ``params[i]`` holds
    image i's parameters (see :func:`make_images`), ``sx``/``cx`` (``w``) and ``sy``/``cy``
    (``h``) are scratch. The noise comes from a 31-bit LCG seeded with ``seed`` (the same
    integers in Python and in Numba), so the result is deterministic."""
    n, c, h, w = out.shape
    state = seed % 2147483648
    for i in range(n):
        p = params[i]
        fx, fy, ph = p[0], p[1], p[2]  # shading: 10 sin(fx x + fy y + ph), separable
        ey, ex, ry, rx = p[3], p[4], p[5], p[6]  # background: outside this ellipse = 0
        has_bg = p[7] < 0.7
        y0, x0 = p[8], p[9]  # a flat square object of side 0.25
        for x in range(w):
            sx[x] = math.sin(fx * x / (w - 1) + ph)
            cx[x] = math.cos(fx * x / (w - 1) + ph)
        for y in range(h):
            sy[y] = math.sin(fy * y / (h - 1))
            cy[y] = math.cos(fy * y / (h - 1))
        for ch in range(c):
            color = p[10 + 3 * ch] * 255.0
            base = p[11 + 3 * ch] * 160.0 + 40.0
            slope = (p[12 + 3 * ch] - 0.5) * 100.0
            for y in range(h):
                yy = y / (h - 1)
                dy = (yy - ey) / ry
                in_y = y0 <= yy < y0 + 0.25
                for x in range(w):
                    xx = x / (w - 1)
                    dx = (xx - ex) / rx
                    if in_y and x0 <= xx < x0 + 0.25:
                        v = color
                    elif has_bg and dy * dy + dx * dx > 1.0:
                        v = 0.0
                    else:
                        v = base + slope * (xx - yy) + 10.0 * (sx[x] * cy[y] + cx[x] * sy[y])
                        state = (state * 1103515245 + 12345) % 2147483648
                        r = state >> 23  # 0..255
                        if r < 40:  # ~16% of the values: sensor noise -2..2
                            v += r % 5 - 2
                    out[i, ch, y, x] = int(min(max(v, 0.0), 255.0))
    return out


_FILL_IMAGES: list = []  # the compiled kernel, made on first use (Numba is imported lazily)


def make_images(n: int, shape: tuple[int, int, int] = IMAGE_SHAPE, seed: int = 0):
    """``n`` deterministic image-like images as a uint8 numpy array ``[n, *shape]``: per
    image a smooth colour gradient with low-frequency shading and sparse +-2 noise, in
    70% of them the background (outside an ellipse) masked to 0, and a flat square
    object. Deflate (zlib-ng's default level) shrinks it about 3.5x."""
    import numpy as np

    if not _FILL_IMAGES:
        import numba

        _FILL_IMAGES.append(numba.njit(cache=True, nogil=True)(_fill_images_py))
    c, h, w = shape
    rng = np.random.default_rng(seed)
    params = rng.random((n, 10 + 3 * c))
    params[:, 0:2] = params[:, 0:2] * 12 + 2  # shading frequencies
    params[:, 2] *= 2 * math.pi
    params[:, 5:7] = params[:, 5:7] * 0.3 + 0.2  # ellipse radii
    params[:, 8:10] *= 0.75
    out = np.empty((n, c, h, w), np.uint8)
    return _FILL_IMAGES[0](out, params, np.empty(w), np.empty(w), np.empty(h), np.empty(h), seed)


def make_workload(name: str, size_mib: float, seed: int = 0) -> Workload:
    """The ``flat`` or ``small`` workload at ``size_mib`` MiB of float32 random data, or
    ``images_flat`` / ``images_small``: the same 2000 x B images ``[3, 64, 64]`` (B =
    ``size_mib`` MiB / 2000 / 12 KiB rounded; below 1.5, B = 1 and the images are
    ``[3, H, 64]`` with H fitting the size) as one leaf or as 100 groups x 20 leaves
    of B images."""
    import torch

    scale = size_mib / DEFAULT_SIZE_MIB
    g = torch.Generator().manual_seed(seed)
    if name in ("images_flat", "images_small"):
        groups, per_group = IMAGE_LEAVES
        leaves = groups * per_group
        leaf_bytes = size_mib * 2**20 / leaves
        c, h, w = IMAGE_SHAPE
        if leaf_bytes >= 1.5 * c * h * w:
            per_leaf, image = round(leaf_bytes / (c * h * w)), IMAGE_SHAPE
        else:  # below 1.5 images per leaf (about 35 MiB): one shorter image per leaf
            per_leaf, image = 1, (c, max(1, min(h, round(leaf_bytes / (c * w)))), w)
        images = torch.from_numpy(make_images(leaves * per_leaf, image, seed))
        shape = ", ".join(map(str, image))
        if name == "images_flat":
            tree = {"images": images}
            description = f"1 x uint8[{leaves * per_leaf}, {shape}] (image-like)"
        else:
            chunks = images.split(per_leaf)  # leaf k = images k*B .. (k+1)*B - 1, own storage
            tree = {
                f"group_{i:03d}": {
                    f"leaf_{j:02d}": chunks[i * per_group + j].clone() for j in range(per_group)
                }
                for i in range(groups)
            }
            del chunks
            description = f"{groups} groups x {per_group} x uint8[{per_leaf}, {shape}] (image-like)"
            del images
    elif name == "flat":
        rows = max(1, round(2048 * scale))
        tree = {f"leaf_{i:02d}": torch.randn(rows, 4096, generator=g) for i in range(8)}
        description = f"8 x float32[{rows}, 4096]"
    elif name == "small":
        values = max(1, round(33_554 * scale))
        tree = {
            f"group_{i:03d}": {f"leaf_{j:02d}": torch.randn(values, generator=g) for j in range(20)}
            for i in range(100)
        }
        description = f"100 groups x 20 x float32[{values}]"
    else:  # pragma: no cover - argparse restricts the names
        raise ValueError(f"unknown workload {name!r}")
    flat: dict = {}

    def walk(d: dict, prefix: str) -> None:
        for k, v in d.items():
            if isinstance(v, dict):
                walk(v, f"{prefix}{k}.")
            else:
                flat[prefix + k] = v

    walk(tree, "")
    arrays = [t.numpy() for t in flat.values()]
    nbytes = sum(a.nbytes for a in arrays)
    return Workload(name, description, tree, flat, arrays, nbytes)


# -- formats -----------------------------------------------------------------------------


def _sum_leaves(tensors: Iterable) -> float:
    return sum(float(t.sum()) for t in tensors)


class Format:
    """How one format saves, opens and reads a workload. Every timed function returns
    what it created so that releasing it happens outside the timed region."""

    name = ""
    suffix = ""
    is_dir = False
    ops: tuple[str, ...] = ("save", "open", "read", "copy")

    def save(self, w: Workload, path: Path) -> Any:
        raise NotImplementedError

    def open(self, path: Path) -> Any:
        raise NotImplementedError

    def read(self, w: Workload, path: Path) -> tuple[float, Any]:
        raise NotImplementedError


class TdzNumba(Format):
    name, suffix = "tdz_numba", ".tdz"
    ops = ("save", "open", "read", "copy", "verify")

    def save(self, w, path):
        import tdz_numba

        return tdz_numba.save(w.tree, path)

    def open(self, path):
        import tdz_numba

        ar = tdz_numba.open(path)
        ar.close()
        return ar

    def read(self, w, path):
        import tdz_numba

        ar = tdz_numba.open(path)
        total = sum(float(ar[key].sum()) for key, _ in ar.leaves())
        ar.close()
        return total, ar  # ar keeps the leaves (and the mapping) until released


class TdTdz(Format):
    name, suffix = "td_tdz", ".tdz"

    def save(self, w, path):
        return w.td.save(path)

    def open(self, path):
        from tensordict import TensorDict

        return TensorDict.load_memmap(path)

    def read(self, w, path):
        td = self.open(path)
        return _sum_leaves(td.values(include_nested=True, leaves_only=True)), td


class TdTdzEnabled(TdTdz):
    """tensordict's own API (``td.save`` / ``TensorDict.load_memmap``) with
    ``tdz_numba.tensordict.enabled()``: the one-line acceleration."""

    name = "td_tdz_enabled"

    def save(self, w, path):
        from .tensordict import enabled

        with enabled():
            return super().save(w, path)

    def open(self, path):
        from .tensordict import enabled

        with enabled():
            return super().open(path)


class TdDir(TdTdz):
    name, suffix, is_dir = "td_dir", "", True

    def save(self, w, path):
        return w.td.memmap(path)


class TdConsolidated(Format):
    name, suffix = "td_consolidated", ".td"

    def save(self, w, path):
        return w.td.consolidate(filename=path)

    def open(self, path):
        from tensordict import TensorDict

        return TensorDict.from_consolidated(path)

    def read(self, w, path):
        td = self.open(path)
        return _sum_leaves(td.values(include_nested=True, leaves_only=True)), td


class TorchFormat(Format):
    name, suffix = "torch", ".pt"

    def save(self, w, path):
        import torch

        torch.save(w.flat, path)

    def open(self, path):
        import torch

        return torch.load(path, mmap=True, weights_only=True)

    def read(self, w, path):
        d = self.open(path)
        return _sum_leaves(d.values()), d


class SafetensorsFormat(Format):
    name, suffix = "safetensors", ".safetensors"

    def save(self, w, path):
        from safetensors.torch import save_file

        save_file(w.flat, path)

    def open(self, path):
        from safetensors import safe_open

        with safe_open(path, "pt") as f:
            keys = list(f.keys())
        return keys

    def read(self, w, path):
        from safetensors.torch import load_file

        d = load_file(path)
        return _sum_leaves(d.values()), d


class Floor(Format):
    """Raw ``write`` of every leaf's bytes into one file; reading sums the in-memory arrays."""

    name, suffix = "floor", ".bin"
    ops = ("save", "read", "copy")

    def save(self, w, path):
        with open(path, "wb") as f:
            for a in w.arrays:
                f.write(a)

    def read(self, w, path):
        return sum(float(a.sum()) for a in w.arrays), None


_FORMAT_CLASSES = {c.name: c for c in (TdzNumba, TdTdz, TdTdzEnabled, TdDir, TdConsolidated, TorchFormat,
                                       SafetensorsFormat, Floor)}  # fmt: skip


# -- compressed formats (ops "save" and "load"; "load" calls ``read``) --------------------------


def _leaf_sum(t: Any) -> float:
    """``float(t.sum())``, touching every byte of the leaf; one-byte integer leaves are
    summed by numpy (exact, and about 10x faster than torch's uint8 -> int64 sum, which
    would otherwise dominate the load of the image workloads)."""
    import torch

    if t.dtype in (torch.uint8, torch.int8, torch.bool):
        return float(t.numpy().sum(dtype="int64"))
    return float(t.sum())


def _sum_tree(tree: Any) -> float:
    """Sum of :func:`_leaf_sum` over the tensors of nested mappings."""
    total = 0.0
    for v in tree.values():
        if isinstance(v, dict):
            total += _sum_tree(v)
        elif hasattr(v, "sum"):
            total += _leaf_sum(v)
    return total


class Compressed(Format):
    """A format of the compressed section: ``compression`` and ``compresslevel`` as given
    to ``tdz bench``; ``load`` = open + ``float(t.sum())`` of every leaf (:func:`_leaf_sum`)."""

    ops = ("save", "load")

    def __init__(self, compression: str = "deflate", compresslevel: int | None = None) -> None:
        self.compression = compression
        self.compresslevel = compresslevel


class CTdzNumba(Compressed):
    name, suffix = "tdz_numba", ".tdz"
    num_threads: int | None = None

    def save(self, w, path):
        import tdz_numba

        return tdz_numba.save(w.tree, path, compression=self.compression, compresslevel=self.compresslevel,
                              num_threads=self.num_threads)  # fmt: skip

    def read(self, w, path):
        import tdz_numba

        tree = tdz_numba.load(path, num_threads=self.num_threads)  # inflates every leaf (one batch)
        return _sum_tree(tree), tree


class CTdzNumba1t(CTdzNumba):
    name, num_threads = "tdz_numba_1t", 1


class CTdTdz(Compressed):
    """tensordict's archive with deflated entries (zipfile, one thread; no level argument:
    zlib's default) and ``load_memmap(num_threads=os.cpu_count())`` (parallel across entries)."""

    name, suffix = "td_tdz", ".tdz"

    def save(self, w, path):
        return w.td.save(path, compression=self.compression)

    def read(self, w, path):
        from tensordict import TensorDict

        td = TensorDict.load_memmap(path, num_threads=os.cpu_count() or 1)
        return sum(_leaf_sum(t) for t in td.values(include_nested=True, leaves_only=True)), td


class ZlibNg(Compressed):
    """The single-thread reference: one raw-deflate stream per leaf
    (``zlib_ng.compressobj(level, DEFLATED, -15)``) written one after the other to one
    file, no container; load maps the file and ``zlib_ng.decompress``-es every stream
    (``wbits=-15``), then sums the leaves like the others."""

    name, suffix = "zlib_ng", ".deflate"

    def __init__(self, compression: str = "deflate", compresslevel: int | None = None) -> None:
        super().__init__(compression, compresslevel)
        self.spans: dict[str, list[tuple[int, int]]] = {}  # path -> (offset, size) per leaf

    def save(self, w, path):
        from zlib_ng import zlib_ng

        level = -1 if self.compresslevel is None else self.compresslevel
        spans, offset = [], 0
        with open(path, "wb") as f:
            for a in w.arrays:
                c = zlib_ng.compressobj(level, zlib_ng.DEFLATED, -15)
                head = c.compress(a)
                tail = c.flush()
                f.write(head)
                f.write(tail)
                spans.append((offset, len(head) + len(tail)))
                offset += len(head) + len(tail)
        self.spans[str(path)] = spans

    def read(self, w, path):
        import mmap

        import torch
        from zlib_ng import zlib_ng

        spans = self.spans[str(path)]
        with open(path, "rb") as f:
            m = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) if os.fstat(f.fileno()).st_size else None
        view = memoryview(m) if m is not None else memoryview(b"")
        total, leaves = 0.0, []
        try:
            for (off, n), t in zip(spans, w.leaves()):
                data = zlib_ng.decompress(view[off : off + n], wbits=-15, bufsize=max(1, t.nbytes))
                leaf = torch.frombuffer(data, dtype=t.dtype)  # read-only bytes: warning filtered in run
                total += _leaf_sum(leaf)
                leaves.append(leaf)
        finally:
            view.release()
            if m is not None:
                m.close()
        return total, leaves


_COMPRESSED_CLASSES = {c.name: c for c in (CTdzNumba, CTdzNumba1t, CTdTdz, ZlibNg)}


# -- file helpers ------------------------------------------------------------------------------


def _files_of(path: Path) -> list[Path]:
    if path.is_dir():
        return [Path(root) / name for root, _, names in os.walk(path) for name in names]
    return [path] if path.exists() else []


def _remove(path: Path) -> None:
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path)
    elif path.exists() or path.is_symlink():
        path.unlink()


def _fsync(path: Path) -> None:
    for f in _files_of(path):
        fd = os.open(f, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


def drop_cache(path: Path) -> None:
    """fsyncs every file of ``path`` (a file or a directory) and drops its cached pages."""
    for f in _files_of(path):
        fd = os.open(f, os.O_RDONLY)
        try:
            os.fsync(fd)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def _du(path: Path) -> int:
    return sum(f.stat().st_size for f in _files_of(path))


def filesystem_of(path: Path) -> str:
    """``"<fstype> <source> mounted at <mount point>"`` of the filesystem holding ``path``."""
    real = os.path.realpath(path)
    best = ("", "?", "?")
    try:
        with open("/proc/self/mounts") as f:
            for line in f:
                parts = line.split()
                if len(parts) < 3:
                    continue
                mnt = parts[1].replace("\\040", " ")
                if (real == mnt or real.startswith(mnt.rstrip("/") + "/")) and len(mnt) >= len(best[0]):
                    best = (mnt, parts[2], parts[0])
    except OSError:
        return "unknown filesystem"
    return f"{best[1]} ({best[2]}) mounted at {best[0] or '?'}"


# -- measuring --------------------------------------------------------------------------------


def _timed(fn: Callable[[], Any]) -> tuple[float, Any]:
    gc.collect()
    gc.disable()
    try:
        t0 = time.perf_counter()
        out = fn()
        dt = time.perf_counter() - t0
    finally:
        gc.enable()
    return dt * 1e3, out


def measure(fn: Callable[[], Any], repeat: int, *, before: Callable[[int], None] | None = None,
            after: Callable[[int, Any], None] | None = None) -> list[float]:  # fmt: skip
    """One warm-up run (index 0) then ``repeat`` timed runs; returns the timed runs in ms.

    ``before(i)`` and ``after(i, result)`` run outside the timed region; the
    result is released after ``after``.
    """
    runs: list[float] = []
    for i in range(repeat + 1):
        if before is not None:
            before(i)
        ms, out = _timed(lambda i=i: fn(i))
        if after is not None:
            after(i, out)
        del out
        gc.collect()
        if i:
            runs.append(ms)
    return runs


@dataclass
class BenchResult:
    """Results of :func:`run`: one record per measured cell, plus the context."""

    results: list[dict] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    workloads: dict[str, str] = field(default_factory=dict)  # name -> description
    sizes: dict[tuple[str, str], int] = field(default_factory=dict)  # (workload, format) -> bytes
    directory: str = ""
    filesystem: str = ""
    size_mib: float = DEFAULT_SIZE_MIB
    repeat: int = DEFAULT_REPEAT
    cold: bool = False
    formats: list[str] = field(default_factory=list)
    ops: list[str] = field(default_factory=list)
    wall_s: float = 0.0
    compression: str | None = None  # the compressed section's codec, None for the default section
    compresslevel: int | None = None
    nbytes: dict[str, int] = field(default_factory=dict)  # workload -> uncompressed bytes

    def cell(self, workload: str, op: str, fmt: str) -> dict | None:
        for r in self.results:
            if (r["workload"], r["op"], r["format"]) == (workload, op, fmt):
                return r
        return None


def available_formats(formats: Iterable[str]) -> tuple[list[str], list[str]]:
    """``(usable formats, notes)``: tensordict and safetensors formats are skipped when
    their package does not import."""
    usable, notes = [], []
    need = {"td_tdz": "tensordict", "td_tdz_enabled": "tensordict", "td_dir": "tensordict",
            "td_consolidated": "tensordict",
            "safetensors": "safetensors", "zlib_ng": "zlib_ng"}  # fmt: skip
    modules = {"tensordict": "tensordict", "safetensors": "safetensors.torch", "zlib_ng": "zlib_ng.zlib_ng"}
    failed: dict[str, str] = {}
    for fmt in formats:
        pkg = need.get(fmt)
        if pkg is not None and pkg not in failed:
            try:
                with warnings.catch_warnings():
                    warnings.simplefilter("ignore")
                    importlib.import_module(modules[pkg])
            except Exception as exc:  # ImportError, or a broken install
                failed[pkg] = f"{type(exc).__name__}: {exc}".splitlines()[0]
                notes.append(f"{pkg} does not import ({failed[pkg]}): skipping its formats")
        if pkg is not None and pkg in failed:
            continue
        usable.append(fmt)
    return usable, notes


def _warm_up_jit(directory: Path) -> None:
    """Compiles (or loads from Numba's cache) every kernel the timed calls use."""
    import torch

    import tdz_numba

    p = directory / "_jit_warmup.tdz"
    tdz_numba.save({"a": {"b": torch.arange(1000, dtype=torch.float32)}, "c": torch.zeros(3)}, p)
    with tdz_numba.open(p) as ar:
        float(ar["a/b"].sum())
        list(ar.leaves())
    tdz_numba.verify(p)
    tdz_numba.load(p)
    p.unlink()


def _warm_up_compressed(directory: Path, compression: str, compresslevel: int | None) -> None:
    """Compiles (or loads from cache) the kernels of compressed saves and loads, on all
    threads and on one, with entries large enough to be cut into segments."""
    import torch

    import tdz_numba

    p = directory / "_jit_warmup_c.tdz"
    big = torch.arange(9 << 18, dtype=torch.int32) % 251  # 9 MiB: three 4 MiB segments
    tree = {"a": {"b": big, "c": torch.zeros(1000)}, "d": torch.arange(5000, dtype=torch.uint8)}
    for nt in (None, 1):
        tdz_numba.save(tree, p, compression=compression, compresslevel=compresslevel, num_threads=nt)
        for _ in range(2):
            back = tdz_numba.load(p, num_threads=nt)
            _sum_tree(back)
            del back
        with tdz_numba.open(p, num_threads=nt) as ar:
            float(ar["a/b"].sum())
    p.unlink()


def _payload_spans(path: Path) -> list[tuple[int, int]]:
    """``(offset, size)`` of every stored payload of a tdz archive (what verify checksums)."""
    from tdz_numba.reader import ArchiveIndex

    index = ArchiveIndex(path, check_local=True)  # payload offsets of every entry
    try:
        f = index.fields
        return [(int(f[i, 8]), int(f[i, 3])) for i in range(len(index.names)) if int(f[i, 1]) == 0]
    finally:
        index.close()


def _crc_file(path: Path, spans: list[tuple[int, int]]) -> int:
    """Maps ``path`` and runs zlib-ng's crc32 (one thread) over each span."""
    import mmap

    import numpy as np
    from zlib_ng import zlib_ng

    with open(path, "rb") as f:
        m = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
    try:
        buf = np.frombuffer(m, dtype=np.uint8)
        acc = 0
        for off, n in spans:
            acc ^= zlib_ng.crc32(buf[off : off + n])
        del buf
    finally:
        m.close()
    return acc


def run(*, workloads: Iterable[str] = WORKLOADS, ops: Iterable[str] = OPS,
        formats: Iterable[str] = FORMATS, size_mib: float = DEFAULT_SIZE_MIB,
        repeat: int = DEFAULT_REPEAT, cold: bool = False, directory: str | os.PathLike | None = None,
        progress: Callable[[str], None] | None = None, seed: int = 0, compression: str | None = None,
        compresslevel: int | None = None) -> BenchResult:  # fmt: skip
    """Runs the benchmark and returns a :class:`BenchResult`.

    ``directory`` is where artifacts go (a temporary sub-directory is made in
    it and removed at the end); by default a temporary directory in the
    current directory, so on the filesystem the user works on (not tmpfs).

    With ``compression`` (``"deflate"``) the compressed section runs instead:
    ``workloads``, ``ops`` and ``formats`` are then names from
    :data:`COMPRESSED_WORKLOADS`, :data:`COMPRESSED_OPS` and :data:`COMPRESSED_FORMATS`
    (the defaults of these arguments mean all of them).
    """
    import torch  # noqa: F401  (import cost outside every measurement)

    warnings.filterwarnings("ignore", category=FutureWarning)
    warnings.filterwarnings("ignore", category=UserWarning, module="tensordict")
    warnings.filterwarnings("ignore", message="The given buffer is not writable")  # zlib_ng load
    t_start = time.perf_counter()
    if compression is not None:
        if compression not in COMPRESSIONS:
            raise ValueError(f"unknown compression {compression!r}; choose from {', '.join(COMPRESSIONS)}")
        all_workloads, all_ops, all_formats = COMPRESSED_WORKLOADS, COMPRESSED_OPS, COMPRESSED_FORMATS
        if workloads is WORKLOADS:
            workloads = COMPRESSED_WORKLOADS
        if ops is OPS:
            ops = COMPRESSED_OPS
        if formats is FORMATS:
            formats = COMPRESSED_FORMATS
    else:
        all_workloads, all_ops, all_formats = WORKLOADS, OPS, FORMATS
    for kind, names, allowed in (("workload", workloads, all_workloads), ("op", ops, all_ops),
                                 ("format", formats, all_formats)):  # fmt: skip
        bad = [n for n in names if n not in allowed]
        if bad:
            raise ValueError(f"unknown {kind} {', '.join(map(repr, bad))}"
                             + (f" with compression={compression!r}" if compression else "")
                             + f"; choose from {', '.join(allowed)}")  # fmt: skip
    ops = [o for o in all_ops if o in set(ops)]
    wanted = [f for f in all_formats if f in set(formats)]
    fmt_names, notes = available_formats(wanted)
    res = BenchResult(notes=notes, size_mib=size_mib, repeat=repeat, cold=cold,
                      formats=fmt_names, ops=ops, compression=compression,
                      compresslevel=compresslevel)  # fmt: skip
    if compression is not None and compresslevel is not None and "td_tdz" in fmt_names:
        res.notes.append(f"td_tdz: tensordict's save takes no compression level: it uses zlib's "
                         f"default, not {compresslevel}")  # fmt: skip
    say = progress or (lambda s: None)

    parent = Path(directory) if directory is not None else Path.cwd()
    parent.mkdir(parents=True, exist_ok=True)
    root = Path(tempfile.mkdtemp(prefix=".tdz-bench-", dir=parent))
    res.directory = str(root)
    res.filesystem = filesystem_of(root)
    if "tmpfs" in res.filesystem.split(" ", 1)[0]:
        res.notes.append(f"artifacts are on tmpfs ({res.filesystem}): disk effects are not measured")
    frozen = False
    try:
        _warm_up_jit(root)
        if compression is not None:
            _warm_up_compressed(root, compression, compresslevel)
        # long-lived objects (torch, tensordict, ...) out of the collector's way: the
        # collections run around every timed run then only scan what the runs made
        gc.collect()
        gc.freeze()
        frozen = True
        for wname in [w for w in all_workloads if w in set(workloads)]:
            say(f"[{wname}] generating {size_mib:g} MiB of data")
            w = make_workload(wname, size_mib, seed)
            res.workloads[wname] = f"{w.description} = {w.nbytes / 2**20:.1f} MiB"
            res.nbytes[wname] = w.nbytes
            if compression is None:
                fmts = {n: _FORMAT_CLASSES[n]() for n in fmt_names}
            else:
                fmts = {n: _COMPRESSED_CLASSES[n](compression, compresslevel) for n in fmt_names}
            _run_workload(w, root, ops, fmts, repeat, cold, res, say)
            del fmts
            del w
            gc.collect()
    finally:
        if frozen:
            gc.unfreeze()
        shutil.rmtree(root, ignore_errors=True)
    res.wall_s = time.perf_counter() - t_start
    return res


def _run_workload(w: Workload, root: Path, ops: list[str], fmts: dict[str, Format], repeat: int,
                  cold: bool, res: BenchResult, say: Callable[[str], None]) -> None:  # fmt: skip
    wdir = root / w.name
    wdir.mkdir()
    # reference total of the read op (sum of per-leaf float32 sums) and its tolerance
    ref_total = sum(float(t.sum()) for t in w.leaves())
    tol = 1e-6 * sum(float(t.abs().sum()) for t in w.leaves()) + 1e-3

    # the artifacts the reading ops use, written once outside timing
    artifacts: dict[str, Path] = {}
    broken: set[str] = set()
    reading_ops = [o for o in ops if o != "save"]
    for name, fmt in fmts.items():
        if not any(o in fmt.ops for o in reading_ops) and "save" not in ops:
            continue
        path = wdir / f"{name}{fmt.suffix}"
        try:
            fmt.save(w, path)
            gc.collect()
            _fsync(path)
        except Exception as exc:
            res.notes.append(f"{w.name}/{name}: save failed, format skipped: {_one_line(exc)}")
            broken.add(name)
            _remove(path)
            continue
        artifacts[name] = path
        res.sizes[(w.name, name)] = _du(path)

    def record(op: str, fmt_name: str, runs: list[float]) -> None:
        med = statistics.median(runs)
        row = {"workload": w.name, "op": op, "format": fmt_name, "median_ms": med, "runs_ms": runs}
        if res.compression is not None:
            file_bytes = res.sizes.get((w.name, fmt_name))
            row.update(compression=res.compression, compresslevel=res.compresslevel, nbytes=w.nbytes,
                       file_bytes=file_bytes, size_ratio=w.nbytes / file_bytes if file_bytes else None)  # fmt: skip
        res.results.append(row)
        say(f"[{w.name}] {op:<6} {fmt_name:<16} {med:10.2f} ms  (runs: "
            + ", ".join(f"{r:.1f}" for r in runs) + ")")

    for op in ops:
        for name, fmt in fmts.items():
            if name in broken or op not in fmt.ops:
                continue
            try:
                runs = _measure_cell(op, w, fmt, artifacts[name], wdir, repeat, cold, ref_total, tol, res)
            except Exception as exc:
                res.notes.append(f"{w.name}/{op}/{name}: failed: {_one_line(exc)}")
                continue
            record(op, name, runs)
            if op == "verify" and name == "tdz_numba":
                try:
                    runs = _measure_crc(artifacts[name], repeat, cold)
                except Exception as exc:
                    res.notes.append(f"{w.name}/verify/{CRC_FORMAT}: failed: {_one_line(exc)}")
                else:
                    record(op, CRC_FORMAT, runs)
    for path in artifacts.values():
        _remove(path)
    shutil.rmtree(wdir, ignore_errors=True)


def _measure_cell(op: str, w: Workload, fmt: Format, artifact: Path, wdir: Path, repeat: int,
                  cold: bool, ref_total: float, tol: float, res: BenchResult) -> list[float]:  # fmt: skip
    if op in ("save", "copy"):
        written: list[Path] = []
        stem = f"{fmt.name}.{op}"

        def target(i: int) -> Path:
            return wdir / f"{stem}{i}{fmt.suffix}"

        def before(i: int) -> None:
            while written:  # the previous artifact goes outside the timed region
                _remove(written.pop())
            _remove(target(i))
            if op == "copy" and cold:
                drop_cache(artifact)

        def after(i: int, out: Any) -> None:
            written.append(target(i))
            _fsync(target(i))  # writeback does not spill into the next run

        if op == "save":
            fn = lambda i: fmt.save(w, target(i))  # noqa: E731
        elif fmt.is_dir:
            fn = lambda i: shutil.copytree(artifact, target(i))  # noqa: E731
        else:
            fn = lambda i: shutil.copyfile(artifact, target(i))  # noqa: E731
        try:
            return measure(fn, repeat, before=before, after=after)
        finally:
            for p in written:
                _remove(p)

    before = (lambda i: drop_cache(artifact)) if cold else None
    if op == "open":
        return measure(lambda i: fmt.open(artifact), repeat, before=before)
    if op in ("read", "load"):  # load: the compressed section's open + sum of every leaf
        def after(i: int, out: Any) -> None:
            if i == 0:
                total = out[0]
                if not math.isfinite(total) or abs(total - ref_total) > tol:
                    res.notes.append(f"{w.name}/{op}/{fmt.name}: WARNING: sum of leaves {total!r} "
                                     f"differs from the in-memory sum {ref_total!r}")  # fmt: skip

        return measure(lambda i: fmt.read(w, artifact), repeat, before=before, after=after)
    if op == "verify":
        import tdz_numba

        return measure(lambda i: tdz_numba.verify(artifact), repeat, before=before)
    raise ValueError(f"unknown op {op!r}")  # pragma: no cover


def _measure_crc(artifact: Path, repeat: int, cold: bool) -> list[float]:
    spans = _payload_spans(artifact)
    before = (lambda i: drop_cache(artifact)) if cold else None
    return measure(lambda i: _crc_file(artifact, spans), repeat, before=before)


def _one_line(exc: BaseException) -> str:
    text = " ".join(str(exc).split())
    return f"{type(exc).__name__}: {text}" if text else type(exc).__name__


# -- reporting ----------------------------------------------------------------------------------


def _fmt_ms(ms: float) -> str:
    if ms >= 1000:
        return f"{ms:.0f} ms"
    if ms >= 100:
        return f"{ms:.1f} ms"
    if ms >= 10:
        return f"{ms:.1f} ms"
    if ms >= 1:
        return f"{ms:.2f} ms"
    return f"{ms:.3f} ms"


def _fmt_ratio(r: float) -> str:
    if r >= 10:
        return f"{r:.0f}x"
    if r >= 0.1:
        return f"{r:.2g}x" if r < 1 else f"{r:.1f}x"
    return f"{r:.2g}x"


def machine_info() -> str:
    """One line: CPUs, platform, python and library versions."""
    import importlib.metadata as md

    def version(dist: str) -> str:
        try:
            return md.version(dist)
        except md.PackageNotFoundError:
            return "missing"

    try:
        affinity = len(os.sched_getaffinity(0))
    except AttributeError:  # pragma: no cover - not Linux
        affinity = os.cpu_count()
    threads = ""
    try:
        import torch

        threads = f" (torch threads {torch.get_num_threads()}"
        import numba

        threads += f", numba threads {numba.config.NUMBA_NUM_THREADS})"
    except Exception:  # pragma: no cover
        threads += ")" if threads else ""
    return (f"machine: {os.cpu_count()} cpus, {affinity} usable{threads}, {platform.platform()}, "
            f"python {platform.python_version()}, torch {version('torch')}, numba {version('numba')}, "
            f"numpy {version('numpy')}, tensordict {version('tensordict')}, "
            f"safetensors {version('safetensors')}, zlib-ng {version('zlib-ng')}, "
            f"tdz_numba {version('tdz_numba')}")  # fmt: skip


def _columns(res: BenchResult) -> list[str]:
    """The formats present in the results, in the run's order (then the known orders)."""
    first = COMPRESSED_FORMATS if res.compression else FORMATS
    order = dict.fromkeys([*res.formats, *first, *FORMATS, CRC_FORMAT, *COMPRESSED_FORMATS])
    order.update(dict.fromkeys(r["format"] for r in res.results))
    return [f for f in order if any(r["format"] == f for r in res.results)]


def format_table(res: BenchResult) -> str:
    """Rows = (workload, op), columns = formats; cells ``"12.3 ms (2.1x)"`` where the
    ratio is the cell over tdz_numba's cell of the same row."""
    cols = _columns(res)
    rows = []
    for wname in res.workloads:
        for op in res.ops:
            if not any(r["workload"] == wname and r["op"] == op for r in res.results):
                continue
            base = res.cell(wname, op, "tdz_numba")
            cells = []
            for f in cols:
                c = res.cell(wname, op, f)
                if c is None:
                    cells.append("-")
                    continue
                text = _fmt_ms(c["median_ms"])
                if base is not None and base["median_ms"] > 0:
                    text += f" ({_fmt_ratio(c['median_ms'] / base['median_ms'])})"
                cells.append(text)
            rows.append([wname, op, *cells])
    header = ["workload", "op", *cols]
    widths = [max(len(str(x)) for x in col) for col in zip(header, *rows)]
    lines = ["  ".join(h.ljust(wd) for h, wd in zip(header, widths)).rstrip(),
             "  ".join("-" * wd for wd in widths)]  # fmt: skip
    for row in rows:
        lines.append("  ".join((c.ljust(wd) if i < 2 else c.rjust(wd)) for i, (c, wd)
                               in enumerate(zip(row, widths))).rstrip())  # fmt: skip
    return "\n".join(lines)


def fastest_lines(res: BenchResult) -> list[str]:
    """Per row, the fastest format (the crc32 comparison, the floor, and the compressed
    section's references zlib_ng and tdz_numba_1t aside)."""
    out = []
    for wname in res.workloads:
        for op in res.ops:
            cells = [r for r in res.results if r["workload"] == wname and r["op"] == op
                     and r["format"] not in (CRC_FORMAT, "floor", "zlib_ng", "tdz_numba_1t")]  # fmt: skip
            if len(cells) < 2:
                continue
            cells.sort(key=lambda r: r["median_ms"])
            best, second = cells[0], cells[1]
            out.append(f"fastest {wname}/{op}: {best['format']} ({_fmt_ms(best['median_ms'])}, "
                       f"{second['median_ms'] / best['median_ms']:.2f}x ahead of {second['format']})")  # fmt: skip
    return out


def enabled_lines(res: BenchResult) -> list[str]:
    """Speedup of tensordict's own API with ``tdz_numba.tensordict.enable()`` over without."""
    out = []
    cell = {(r["workload"], r["op"], r["format"]): r["median_ms"] for r in res.results}
    for wname in res.workloads:
        parts = [f"{op} {cell[(wname, op, 'td_tdz')] / cell[(wname, op, 'td_tdz_enabled')]:.1f}x"
                 for op in res.ops
                 if (wname, op, "td_tdz") in cell and (wname, op, "td_tdz_enabled") in cell]  # fmt: skip
        if parts:
            out.append(f"tensordict API with tdz_numba.tensordict.enable() vs without, {wname}: " + ", ".join(parts))
    return out


def _spread_lines(res: BenchResult) -> list[str]:
    """Cells whose runs spread by more than 50% around the median (noisy machine)."""
    out = []
    for r in res.results:
        runs, med = r["runs_ms"], r["median_ms"]
        if len(runs) >= 3 and med > 0 and (max(runs) - min(runs)) / med > 0.5:
            out.append(f"{r['workload']}/{r['op']}/{r['format']}: runs {min(runs):.1f}..{max(runs):.1f} ms")
    if out:
        return ["noisy cells (max - min > 50% of the median): " + "; ".join(out)]
    return []


def _cores() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # pragma: no cover - not Linux
        return os.cpu_count() or 1


def _level_text(level: int | None) -> str:
    return "None = zlib-ng default (6)" if level is None else str(level)


def goals(res: BenchResult) -> list[dict]:
    """The compressed section's goal checks, per workload and op: ``{"workload", "op",
    "goal", "value", "target", "passed", "text"}`` where ``goal`` is ``"scaling"``
    (tdz_numba 1 thread / all threads >= 0.8 x cores), ``"single_thread"``
    (tdz_numba_1t / zlib_ng <= 1.2) or ``"vs_tensordict"`` (save: td_tdz / tdz_numba >= 2)."""
    cores = _cores()
    out: list[dict] = []

    def ms(w: str, op: str, f: str) -> float | None:
        c = res.cell(w, op, f)
        return c["median_ms"] if c is not None and c["median_ms"] > 0 else None

    for w in res.workloads:
        for op in ("save", "load"):
            full, one, ref = ms(w, op, "tdz_numba"), ms(w, op, "tdz_numba_1t"), ms(w, op, "zlib_ng")
            if full and one:
                target = GOAL_SCALING * cores
                out.append(dict(workload=w, op=op, goal="scaling", value=one / full, target=target,
                                passed=one / full >= target,
                                text=f"{one / full:.2f}x ({_fmt_ms(one)} -> {_fmt_ms(full)})"))  # fmt: skip
            if one and ref:
                out.append(dict(workload=w, op=op, goal="single_thread", value=one / ref, target=GOAL_SINGLE,
                                passed=one / ref <= GOAL_SINGLE,
                                text=f"{one / ref:.2f}x (tdz_numba_1t {_fmt_ms(one)} vs zlib_ng {_fmt_ms(ref)})"))  # fmt: skip
        full, td = ms(w, "save", "tdz_numba"), ms(w, "save", "td_tdz")
        if full and td:
            out.append(dict(workload=w, op="save", goal="vs_tensordict", value=td / full, target=GOAL_VS_TD,
                            passed=td / full >= GOAL_VS_TD,
                            text=f"{td / full:.2f}x (td_tdz {_fmt_ms(td)} vs tdz_numba {_fmt_ms(full)})"))  # fmt: skip
    return out


def goal_lines(res: BenchResult) -> list[str]:
    """Per workload: size ratios, throughputs, the scaling line and the goal checks."""
    cores = _cores()
    lines: list[str] = []
    gs = goals(res)

    def verdict(g: dict) -> str:
        return f"{g['text']} {'PASS' if g['passed'] else 'FAIL'}"

    for w in res.workloads:
        n = res.nbytes.get(w, 0)
        ratios = [(f, n / b) for (ww, f), b in res.sizes.items() if ww == w and b]
        if ratios:
            lines.append(f"size ratio {w} (uncompressed / file, {_human(n)}): "
                         + ", ".join(f"{f} {r:.2f}x" for f, r in ratios))  # fmt: skip
        for op in res.ops:
            cells = [(f, res.cell(w, op, f)) for f in _columns(res)]
            cells = [(f, c) for f, c in cells if c is not None and c["median_ms"] > 0]
            if cells and n:
                lines.append(f"throughput {w}/{op} (uncompressed MB/s): "
                             + ", ".join(f"{f} {n / c['median_ms'] / 1e3:.0f}" for f, c in cells))  # fmt: skip
        by = {(g["op"], g["goal"]): g for g in gs if g["workload"] == w}
        sc = [(op, by[(op, "scaling")]) for op in ("save", "load") if (op, "scaling") in by]
        if sc:
            lines.append(f"scaling {w}: tdz_numba all threads vs num_threads=1: "
                         + ", ".join(f"{op} {g['text']}" for op, g in sc)
                         + f"; goal >= {GOAL_SCALING:g} x {cores} cores = {GOAL_SCALING * cores:.2f}x: "
                         + ", ".join(f"{op} {'PASS' if g['passed'] else 'FAIL'}" for op, g in sc))  # fmt: skip
        st = [(op, by[(op, "single_thread")]) for op in ("save", "load") if (op, "single_thread") in by]
        if st:
            lines.append(f"goal {w}: single thread within {GOAL_SINGLE:g}x of zlib-ng: "
                         + ", ".join(f"{op} {verdict(g)}" for op, g in st))  # fmt: skip
        if ("save", "vs_tensordict") in by:
            lines.append(f"goal {w}: save >= {GOAL_VS_TD:g}x faster than tensordict compressed: "
                         + verdict(by[("save", "vs_tensordict")]))  # fmt: skip
    if gs:
        failed = [f"{g['workload']}/{g['op']}/{g['goal']}" for g in gs if not g["passed"]]
        lines.append(f"goals: {len(gs) - len(failed)} PASS, {len(failed)} FAIL"
                     + (f" ({', '.join(failed)})" if failed else ""))  # fmt: skip
    return lines


def report(res: BenchResult, argv: list[str]) -> str:
    """The header, the table and the notes, as printed by ``tdz bench``."""
    mode = ("cold (fsync + posix_fadvise DONTNEED of every artifact file before each timed "
            "open/read/copy/verify)" if res.cold else "warm page cache")  # fmt: skip
    if res.compression is not None:
        mode = mode.replace("open/read/copy/verify", "load")
    lines = [
        "tdz_numba benchmark" + (f": compressed section ({res.compression})" if res.compression else ""),
        machine_info(),
        f"size: {res.size_mib:g} MiB per workload, repeat: {res.repeat} (+1 warm-up, median reported), "
        f"cache: {mode}",
    ]
    if res.compression is not None:
        lines.append(f"compression: {res.compression}, compresslevel {_level_text(res.compresslevel)}; "
                     f"tdz_numba threads: all ({_cores()} usable cores) and 1")  # fmt: skip
    lines += [
        f"artifacts: {res.directory} on {res.filesystem} (removed after the run)",
        "reproduce: " + shlex.join([sys.executable, "-m", "tdz_numba", "bench", *argv]),
    ]
    for wname, desc in res.workloads.items():
        sizes = ", ".join(f"{f} {_human(n)}" for (w, f), n in res.sizes.items() if w == wname)
        lines.append(f"workload {wname}: {desc}" + (f"; artifacts: {sizes}" if sizes else ""))
    lines += ["", format_table(res), ""]
    if res.compression is not None:
        lines.append("cells: median (ratio to tdz_numba in the same row); '-' = not applicable. "
                     f"save = write a fresh {res.compression} archive; load = open + inflate + "
                     "float(t.sum()) of every leaf (tdz_numba: tdz_numba.load(p, num_threads); td_tdz: "
                     f"TensorDict.load_memmap(p, num_threads={os.cpu_count()})). tdz_numba_1t = tdz_numba "
                     "with num_threads=1; zlib_ng = one raw-deflate stream per leaf on one thread into "
                     "one file (no container, no CRC-32), load = zlib_ng.decompress of each + the sums. "
                     "Sums: torch's, numpy's for uint8 leaves (torch's uint8 sum is ~10x slower).")  # fmt: skip
        lines += goal_lines(res)
    else:
        lines.append("cells: median (ratio to tdz_numba in the same row); '-' = not applicable. "
                     "open = lazy open (no payload read); read = open + float(t.sum()) of every leaf "
                     "(floor: numpy sum of the in-memory arrays); copy = shutil.copyfile/copytree; "
                     f"{CRC_FORMAT} = zlib-ng crc32 on one thread over the payloads that verify checks.")  # fmt: skip
    for wname in res.workloads:
        v = res.cell(wname, "verify", "tdz_numba")
        c = res.cell(wname, "verify", CRC_FORMAT)
        if v is not None:
            n = sum(a for (w, f), a in res.sizes.items() if w == wname and f == "tdz_numba")
            text = f"verify {wname}: tdz_numba.verify {n / v['median_ms'] / 1e6:.2f} GB/s"
            if c is not None:
                text += f", zlib-ng crc32 single thread {n / c['median_ms'] / 1e6:.2f} GB/s"
            lines.append(text + f" (over {_human(n)})")
    lines += fastest_lines(res)
    lines += enabled_lines(res)
    lines += _spread_lines(res)
    lines += [f"note: {n}" for n in res.notes]
    lines.append(f"total wall time: {res.wall_s:.1f} s")
    return "\n".join(lines)


def _human(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} GiB"  # pragma: no cover


def plot(res: BenchResult, path: str | os.PathLike) -> Path:
    """A grouped bar chart (one panel per workload x op, log y axis) saved to ``path``."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    wnames = list(res.workloads)
    ops = [o for o in res.ops if any(r["op"] == o for r in res.results)]
    cols = _columns(res)
    fig, axes = plt.subplots(len(wnames), len(ops), figsize=(3.2 * len(ops) + 1, 3.4 * len(wnames) + 0.8),
                             squeeze=False)  # fmt: skip
    for i, wname in enumerate(wnames):
        for j, op in enumerate(ops):
            ax = axes[i][j]
            cells = [(f, res.cell(wname, op, f)) for f in cols]
            cells = [(f, c) for f, c in cells if c is not None]
            xs = range(len(cells))
            vals = [c["median_ms"] for _, c in cells]
            bars = ax.bar(xs, vals, color=[_COLORS.get(f, "#333333") for f, _ in cells])
            for b, v in zip(bars, vals):
                ax.annotate(_fmt_ms(v).replace(" ms", ""), (b.get_x() + b.get_width() / 2, v),
                            ha="center", va="bottom", fontsize=6, rotation=90,
                            xytext=(0, 2), textcoords="offset points")  # fmt: skip
            ax.set_yscale("log")
            ax.set_xticks(list(xs))
            ax.set_xticklabels([f for f, _ in cells], rotation=60, ha="right", fontsize=7)
            ax.set_title(f"{wname} / {op}", fontsize=9)
            if j == 0:
                ax.set_ylabel("median ms (log)")
            if vals:
                ax.set_ylim(min(vals) / 2, max(vals) * 4)
    handles = [plt.Rectangle((0, 0), 1, 1, color=_COLORS.get(f, "#333333")) for f in cols]
    top = 1 - (0.8 if res.compression else 0.6) / fig.get_figheight()  # title and legend, figure fraction
    codec = ""
    if res.compression:  # a narrow figure (2 ops): the title on two lines
        level = "default" if res.compresslevel is None else res.compresslevel
        codec = f"{res.compression} level {level},\n"
    fig.suptitle(f"tdz_numba bench: {codec}{res.size_mib:g} MiB per workload, median of {res.repeat}, "
                 f"{'cold' if res.cold else 'warm'} cache (lower is better)", y=0.995, fontsize=10)  # fmt: skip
    legend_y = 1 - (0.5 if res.compression else 0.35) / fig.get_figheight()
    fig.legend(handles, cols, loc="upper center", bbox_to_anchor=(0.5, legend_y),
               ncol=len(cols), fontsize=8, frameon=False)  # fmt: skip
    fig.tight_layout(rect=(0, 0, 1, top))
    out = Path(path)
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=120)
    plt.close(fig)
    return out


# -- command line -------------------------------------------------------------------------------


def _choices(allowed: tuple[str, ...], what: str) -> Callable[[str], list[str]]:
    def parse(text: str) -> list[str]:
        names = [s.strip() for s in text.split(",") if s.strip()]
        if not names or "all" in names:
            return list(allowed)
        bad = [n for n in names if n not in allowed]
        if bad:
            raise argparse.ArgumentTypeError(
                f"unknown {what} {', '.join(map(repr, bad))}; choose from {', '.join(allowed)}"
            )
        return names

    parse.__name__ = what
    return parse


def _positive(kind: type) -> Callable[[str], Any]:
    def parse(text: str):
        try:
            value = kind(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"not a number: {text!r}") from None
        if not value > 0:
            raise argparse.ArgumentTypeError(f"must be > 0, got {text!r}")
        return value

    parse.__name__ = kind.__name__
    return parse


def build_parser(prog: str = "tdz bench") -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog=prog,
        description="Benchmark tdz_numba against tensordict, torch.save, safetensors and a raw-write floor.",
        epilog="Cells are medians; ratios are relative to tdz_numba in the same row.",
    )
    all_workloads = tuple(dict.fromkeys([*WORKLOADS, *COMPRESSED_WORKLOADS]))
    all_ops = tuple(dict.fromkeys([*OPS, *COMPRESSED_OPS]))
    all_formats = tuple(dict.fromkeys([*FORMATS, *COMPRESSED_FORMATS]))
    p.add_argument("--workload", type=_choices(all_workloads, "workload"), default=None,
                   help=f"comma list of {', '.join(WORKLOADS)}; with --compression of "
                        f"{', '.join(COMPRESSED_WORKLOADS)} (default all)")  # fmt: skip
    p.add_argument("--op", type=_choices(all_ops, "op"), default=None,
                   help=f"comma list of {', '.join(OPS)}; with --compression of "
                        f"{', '.join(COMPRESSED_OPS)} (default all)")  # fmt: skip
    p.add_argument("--format", type=_choices(all_formats, "format"), default=None,
                   help=f"comma list of {', '.join(FORMATS)}; with --compression of "
                        f"{', '.join(COMPRESSED_FORMATS)} (default all)")  # fmt: skip
    p.add_argument("--compression", choices=COMPRESSIONS, default=None,
                   help="run the compressed section instead: image-like and float workloads saved "
                        "and loaded compressed, tdz_numba on all threads and on one against "
                        "tensordict and single-thread zlib-ng, with scaling and goal checks")  # fmt: skip
    p.add_argument("--compresslevel", type=int, default=None, metavar="N",
                   help="deflate level -1..9 of the compressed section (default: zlib-ng's default)")  # fmt: skip
    p.add_argument("--size-mib", type=_positive(float), default=None,
                   help=f"MiB of data per workload (default {DEFAULT_SIZE_MIB:g}; {QUICK_SIZE_MIB:g} with --quick)")
    p.add_argument("--repeat", type=_positive(int), default=None,
                   help=f"timed runs per cell after one warm-up (default {DEFAULT_REPEAT}; "
                        f"{QUICK_REPEAT} with --quick)")  # fmt: skip
    p.add_argument("--cold", action="store_true",
                   help="drop the artifact's cached pages before each timed open/read/copy/verify")
    p.add_argument("--dir", type=Path, default=None,
                   help="where artifacts go (a temporary sub-directory is made there; default: the "
                        "current directory, not /dev/shm)")  # fmt: skip
    p.add_argument("--json", action="store_true",
                   help="print the results as JSON on stdout (the report goes to stderr)")
    p.add_argument("--plot", type=Path, default=None, metavar="OUT.png", help="save a bar chart (matplotlib)")
    p.add_argument("--quick", action="store_true", help=f"size {QUICK_SIZE_MIB:g} MiB, repeat {QUICK_REPEAT}")
    p.add_argument("-v", "--verbose", action="store_true", help="print each cell to stderr as it is measured")
    return p


def main(argv: list[str] | None = None, prog: str = "tdz bench") -> int:
    """Entry point of ``tdz bench`` and ``python -m tdz_numba.bench``."""
    import json

    argv = list(sys.argv[1:] if argv is None else argv)
    parser = build_parser(prog)
    args = parser.parse_args(argv)
    if args.compression is None:
        if args.compresslevel is not None:
            parser.error("--compresslevel needs --compression")
        allowed = {"workload": WORKLOADS, "op": OPS, "format": FORMATS}
    else:
        if args.compresslevel is not None and not -1 <= args.compresslevel <= 9:
            parser.error(f"--compresslevel must be -1..9, got {args.compresslevel}")
        allowed = {"workload": COMPRESSED_WORKLOADS, "op": COMPRESSED_OPS, "format": COMPRESSED_FORMATS}
    for kind, names in allowed.items():
        given = getattr(args, kind)
        if given is None:
            setattr(args, kind, list(names))
            continue
        bad = [n for n in given if n not in names]
        if bad:
            where = "with --compression" if args.compression else "without --compression"
            parser.error(f"argument --{kind}: {', '.join(map(repr, bad))} not available {where}; "
                         f"choose from {', '.join(names)}")  # fmt: skip
    size = args.size_mib if args.size_mib is not None else (QUICK_SIZE_MIB if args.quick else DEFAULT_SIZE_MIB)
    repeat = args.repeat if args.repeat is not None else (QUICK_REPEAT if args.quick else DEFAULT_REPEAT)

    def progress(line: str) -> None:
        print(line, file=sys.stderr, flush=True)

    res = run(workloads=args.workload, ops=args.op, formats=args.format, size_mib=size, repeat=repeat,
              cold=args.cold, directory=args.dir, progress=progress if args.verbose else None,
              compression=args.compression, compresslevel=args.compresslevel)  # fmt: skip
    text = report(res, argv)
    if args.plot is not None:
        out = plot(res, args.plot)
        text += f"\nplot: {out}"
    if args.json:
        print(text, file=sys.stderr, flush=True)
        print(json.dumps(res.results, indent=1))
    else:
        print(text, flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main(prog="python -m tdz_numba.bench"))
