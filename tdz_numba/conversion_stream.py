"""``convert`` of a foreign file to ``.tdz`` through the streaming :class:`~tdz_numba.Writer`,
in bounded memory.

The source's tree (views of its mapping: nothing read yet) is walked in order; its leaves go
to the Writer in batches of about :data:`BATCH` bytes (one layout plan and one pass of writes
per batch, as :func:`tdz_numba.save` writes them), stored leaves of at least :data:`BIG`
bytes as streamed leaves in :data:`PIECE` pieces. After each batch or piece the source's
pages just copied are dropped from this process (``MADV_DONTNEED`` on its read-only file
mapping: :func:`tdz_numba.files.memory.evict_span`), so the resident set grows by about one
batch or piece, whatever the file's size, where a whole-tree save kept every page it copied
mapped in. The archive holds the entries :func:`tdz_numba.save` of the same tree writes,
byte for byte; only the ``meta.json`` entries come after the payloads
(:func:`tdz_numba.compact` gives ``save``'s order and bytes).

Examples
--------
>>> import tempfile, pathlib, torch, tdz_numba
>>> from safetensors.torch import save_file
>>> with tempfile.TemporaryDirectory() as d:
...     save_file({"w": torch.ones(3), "b": torch.zeros(2)}, f"{d}/m.safetensors")
...     out = tdz_numba.convert(f"{d}/m.safetensors", pathlib.Path(d) / "m.tdz")
...     print(sorted(tdz_numba.load(out).keys()))
['b', 'w']
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

import numpy as np
import torch

from .files.memory import evict_span

__all__ = ["write_streamed", "BATCH", "BIG", "PIECE"]

#: Bytes of leaves written per batch (one layout plan, one pass of writes).
BATCH = 32 << 20
#: Stored leaves of at least this many bytes are streamed in pieces.
BIG = 32 << 20
#: Bytes per piece of a streamed leaf: the writer's piece (:data:`tdz_numba.zipfmt.payload.PIECE`,
#: 2 MiB), so that its CRC is computed while the bytes just copied are in cache.
PIECE = 2 << 20


def _level_meta(level: Any) -> dict[str, Any] | None:
    """The ``meta.json`` fields :func:`tdz_numba.tdz.tree.flatten` writes for a level (None: the
    defaults), for :meth:`Writer.add_level`."""
    from .tdz.tree import td_level_fields

    own = getattr(level, "meta", None)
    if own is None or not getattr(level, "keyed", True):
        return None
    if "_type" not in own and "_class" not in own:
        kept = {k: v for k, v in own.items() if k in ("shape", "device", "_names")}
        return {**td_level_fields(), **kept} if kept else None
    return dict(own)


def _walk(tree: Mapping, parts: tuple[str, ...] = ()) -> Iterator[tuple[tuple[str, ...], Any, bool]]:
    """``(key path, value, is_level)`` depth first in the tree's order (a level before its children)."""
    stack: list[Iterator[tuple[Any, Any]]] = [iter(tree.items())]
    paths = [parts]
    while stack:
        item = next(stack[-1], None)
        if item is None:
            stack.pop()
            paths.pop()
            continue
        key, value = item
        path = (*paths[-1], key)
        if isinstance(value, Mapping):
            yield path, value, True
            stack.append(iter(value.items()))
            paths.append(path)
        else:
            yield path, value, False


def _nbytes(value: Any) -> int:
    if isinstance(value, torch.Tensor) and not value.is_nested:
        return value.numel() * value.element_size()
    if isinstance(value, np.ndarray):
        return value.nbytes
    return 0


def _address(value: Any) -> int:
    return value.data_ptr() if isinstance(value, torch.Tensor) else value.ctypes.data


def write_streamed(
    ar: Any,
    tree: Mapping,
    dst: Path,
    *,
    compression: str | None = None,
    progress: bool | None = None,
    metadata: dict[str, Any] | None = None,
    digest: bool = False,
) -> Path:
    """Writes ``tree`` (the opened source ``ar``'s leaves, shaped as ``convert`` shapes them) to
    ``dst`` through the Writer, dropping the source's pages as they are written."""
    from .conversion import _mapped_ranges
    from .files.progress import progress as _progress
    from .streaming import NewLevel, Writer

    maps = _mapped_ranges(ar.source)
    total = sum(_nbytes(v) for _, v, lvl in _walk(tree) if not lvl)
    pending: list[tuple[tuple[str, ...], Any]] = []  # leaves and NewLevel marks, in tree order
    acc = 0
    with (
        Writer(dst, compression=compression, digest=digest, metadata=metadata) as w,
        _progress(total, f"convert {dst.name}", enabled=progress) as bar,
    ):

        def flush() -> None:
            nonlocal acc
            if not pending:
                return
            w.add_many(pending)
            for _, v in pending:
                n = _nbytes(v) if not isinstance(v, NewLevel) else 0
                if n:
                    evict_span(_address(v), n, maps)  # the pages just copied: dropped
            bar.update(acc)
            pending.clear()
            acc = 0

        root = _level_meta(tree)
        if root is not None:
            w.add_level("", meta=root)
        for path, value, is_level in _walk(tree):
            if is_level:  # (declared in order, empty levels too, as save writes them)
                pending.append((path, NewLevel(_level_meta(value))))
                continue
            n = _nbytes(value)
            if n >= BIG and compression is None and isinstance(value, torch.Tensor) and value.is_contiguous():
                flush()
                _stream(w, path, value, maps)
                bar.update(n)
                continue
            pending.append((path, value))
            acc += n
            if acc >= BATCH:
                flush()
        flush()
    return dst


def _stream(w: Any, path: tuple[str, ...], t: torch.Tensor, maps: list[tuple[int, int]]) -> None:
    """One big stored leaf through a sink, :data:`PIECE` bytes at a time, each piece's source
    pages dropped once written."""
    flat = t.detach().reshape(-1)
    raw = (flat.view(torch.uint8) if flat.dtype != torch.uint8 else flat).numpy()
    with w.stream(path, tuple(t.shape), t.dtype) as sink:
        for at in range(0, raw.size, PIECE):
            piece = raw[at : at + PIECE]
            sink.write(piece)
            evict_span(piece.ctypes.data, piece.size, maps)
