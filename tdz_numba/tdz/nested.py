"""Nested (jagged) tensor leaves of a ``.tdz``: the values entry and its ``.shape.memmap`` of
per-component sizes, decoded into a ``torch`` nested tensor (a copy), every size checked first.

Examples
--------
>>> import tempfile, pathlib, torch, tdz_numba
>>> nt = torch.nested.nested_tensor([torch.ones(2, 3), torch.zeros(4, 3)])
>>> with tempfile.TemporaryDirectory() as d:
...     p = tdz_numba.save({"x": nt}, pathlib.Path(d) / "n.tdz")
...     with tdz_numba.open(p) as ar:
...         print([list(t.shape) for t in ar["x"].unbind()])
[[2, 3], [4, 3]]
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np
import torch

from ..errors import BadArchiveError
from .bounds import check_nested_sizes
from .tree import LeafSpec

__all__ = ["nested_tensor", "nested_shapes"]


def nested_tensor(
    index: Any, leaf: LeafSpec, dtype: torch.dtype, where: Callable[[str], str]
) -> torch.Tensor:
    """The nested tensor of ``leaf`` (``shape`` ``[n, ndim]``) from the archive ``index``: sizes from
    its ``shape_entry``, values from its entry, both copied; ``where(entry)`` names an entry in errors
    (:class:`~tdz_numba.BadArchiveError` for a missing entry or a size that does not add up)."""
    at = where(leaf.entry)
    if len(leaf.shape) != 2:
        raise BadArchiveError(f"{at}: nested leaf shape {list(leaf.shape)} must be [n, ndim]")
    n, ndim = leaf.shape
    shape_entry = leaf.shape_entry
    if shape_entry is None or shape_entry not in index:
        raise BadArchiveError(f"{at}: nested leaf {leaf.key!r} has no {shape_entry!r}")
    raw = index.read(shape_entry, check_crc=False)
    if raw.size != n * ndim * 8:
        raise BadArchiveError(
            f"{where(shape_entry)}: expected {n * ndim * 8} bytes of sizes, found {raw.size}"
        )
    sizes = torch.from_numpy(raw.copy().view(np.int64).reshape(n, ndim))
    numel = check_nested_sizes(sizes.numpy(), dtype.itemsize, where(shape_entry))
    if numel == 0:
        buf = torch.empty(0, dtype=dtype)
    else:
        if leaf.entry not in index:
            raise BadArchiveError(f"{at}: nested leaf {leaf.key!r} has no payload entry")
        e = index.entry(leaf.entry)
        if e.size != numel * dtype.itemsize:
            raise BadArchiveError(
                f"{at}: expected {numel * dtype.itemsize} bytes for the nested values, found {e.size}"
            )
        buf = torch.from_numpy(index.read(leaf.entry, check_crc=False).copy()).view(dtype)
    strides, offsets = torch._nested_compute_contiguous_strides_offsets(sizes)
    return torch._nested_view_from_buffer(buf, sizes, strides, offsets)


def nested_shapes(index: Any, leaf: LeafSpec) -> list[list[int]] | None:
    """The component shapes of a nested ``leaf`` (from its small ``.shape.memmap``), or None where
    it is not nested or its sizes entry is missing or of the wrong size."""
    shape_entry = leaf.shape_entry
    if not leaf.nested or shape_entry is None or shape_entry not in index or len(leaf.shape) != 2:
        return None
    n, ndim = leaf.shape
    raw = index.read(shape_entry, check_crc=False)
    if raw.size != n * ndim * 8:
        return None
    return raw.copy().view(np.int64).reshape(n, ndim).tolist()
