"""How each format (tdz_numba and its peers) saves, opens and reads a workload."""

from __future__ import annotations

import os
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from .workloads import Workload

__all__ = ["Format", "FORMAT_CLASSES", "COMPRESSED_CLASSES", "leaf_sum", "sum_tree"]

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
    ops: tuple[str, ...] = ("save", "open", "read", "copy", "verify")

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

        tree = tdz_numba.load(path)  # every leaf in one bulk pass, as load_file / torch.load read
        return sum_tree(tree), tree  # the tree keeps the mapping until released


class TdzNumbaNoFsync(TdzNumba):
    """``save(..., durable=False)``: no fsync, as safetensors and torch.save write (the like-for-like save)."""

    name = "tdz_numba_nofsync"
    ops = ("save",)

    def save(self, w, path):
        import tdz_numba

        return tdz_numba.save(w.tree, path, durable=False)


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
        from ..tensordict import enabled

        with enabled():
            return super().save(w, path)

    def open(self, path):
        from ..tensordict import enabled

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


FORMAT_CLASSES = {
    c.name: c
    for c in (
        TdzNumba,
        TdzNumbaNoFsync,
        TdTdz,
        TdTdzEnabled,
        TdDir,
        TdConsolidated,
        TorchFormat,
        SafetensorsFormat,
        Floor,
    )
}


# -- compressed formats (ops "save" and "load"; "load" calls ``read``) --------------------------


def leaf_sum(t: Any) -> float:
    """``float(t.sum())``, touching every byte of the leaf; one-byte integer leaves are
    summed by numpy (exact, and about 10x faster than torch's uint8 -> int64 sum, which
    would otherwise dominate the load of the image workloads)."""
    import torch

    if t.dtype in (torch.uint8, torch.int8, torch.bool):
        return float(t.numpy().sum(dtype="int64"))
    return float(t.sum())


def sum_tree(tree: Any) -> float:
    """Sum of :func:`leaf_sum` over the tensors of nested mappings."""
    total = 0.0
    for v in tree.values():
        if isinstance(v, dict):
            total += sum_tree(v)
        elif hasattr(v, "sum"):
            total += leaf_sum(v)
    return total


class Compressed(Format):
    """A format of the compressed section: ``compression`` and ``compresslevel`` as given
    to ``tdz bench``; ``load`` = open + ``float(t.sum())`` of every leaf (:func:`leaf_sum`)."""

    ops = ("save", "load")

    def __init__(self, compression: str = "deflate", compresslevel: int | None = None) -> None:
        self.compression = compression
        self.compresslevel = compresslevel


class CTdzNumba(Compressed):
    name, suffix = "tdz_numba", ".tdz"
    num_threads: int | None = None

    def save(self, w, path):
        import tdz_numba

        return tdz_numba.save(
            w.tree,
            path,
            compression=self.compression,
            compresslevel=self.compresslevel,
            num_threads=self.num_threads,
        )

    def read(self, w, path):
        import tdz_numba

        tree = tdz_numba.load(path, num_threads=self.num_threads)  # inflates every leaf (one batch)
        return sum_tree(tree), tree


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
        return sum(leaf_sum(t) for t in td.values(include_nested=True, leaves_only=True)), td


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
                total += leaf_sum(leaf)
                leaves.append(leaf)
        finally:
            view.release()
            if m is not None:
                m.close()
        return total, leaves


COMPRESSED_CLASSES = {c.name: c for c in (CTdzNumba, CTdzNumba1t, CTdTdz, ZlibNg)}
