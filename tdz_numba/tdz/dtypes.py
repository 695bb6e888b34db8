"""The dtype names meta.json uses (``str(torch.dtype)``) and their numpy twins.

Only names in this table are accepted from a file: a dtype string is never
looked up as an attribute of ``torch``.

Examples
--------
>>> from tdz_numba.tdz.dtypes import torch_dtype
>>> torch_dtype("torch.bfloat16", entry="a.memmap")
torch.bfloat16
"""

from __future__ import annotations

import numpy as np
import torch

from ..errors import BadArchiveError

__all__ = ["torch_dtype", "dtype_table", "numpy_dtype", "from_numpy_dtype"]

_NAMES = [
    "bool",
    "uint8",
    "uint16",
    "uint32",
    "uint64",
    "int8",
    "int16",
    "int32",
    "int64",
    "float16",
    "bfloat16",
    "float32",
    "float64",
    "complex32",
    "complex64",
    "complex128",
    "float8_e4m3fn",
    "float8_e4m3fnuz",
    "float8_e5m2",
    "float8_e5m2fnuz",
    "float8_e8m0fnu",
]
_BY_NAME: dict[str, torch.dtype] = {f"torch.{n}": getattr(torch, n) for n in _NAMES if hasattr(torch, n)}
_NUMPY = {
    torch.bool: np.bool_,
    torch.uint8: np.uint8,
    torch.uint16: np.uint16,
    torch.uint32: np.uint32,
    torch.uint64: np.uint64,
    torch.int8: np.int8,
    torch.int16: np.int16,
    torch.int32: np.int32,
    torch.int64: np.int64,
    torch.float16: np.float16,
    torch.float32: np.float32,
    torch.float64: np.float64,
    torch.complex64: np.complex64,
    torch.complex128: np.complex128,
}
_FROM_NUMPY = {np.dtype(v): k for k, v in _NUMPY.items()}


def torch_dtype(name: object, *, entry: str) -> torch.dtype:
    """The torch dtype of a meta.json ``"dtype"`` string; ``BadArchiveError`` if unknown."""
    try:
        return _BY_NAME[name]  # type: ignore[index]
    except (KeyError, TypeError):
        raise BadArchiveError(
            f"{entry}: unknown dtype {name!r} (expected one of {sorted(_BY_NAME)})"
        ) from None


def dtype_table() -> dict[str, torch.dtype]:
    """A copy of the name -> dtype table (for hot loops; unknown names must
    still go through :func:`torch_dtype` for the error)."""
    return dict(_BY_NAME)


def numpy_dtype(dtype: torch.dtype) -> np.dtype:
    """The numpy dtype with the same bytes: unsigned ints of the same size for
    dtypes numpy lacks (bfloat16 -> uint16, float8 -> uint8, complex32 -> uint32)."""
    if dtype in _NUMPY:
        return np.dtype(_NUMPY[dtype])
    return np.dtype(f"u{dtype.itemsize}")


def from_numpy_dtype(dtype: np.dtype) -> torch.dtype | None:
    """The torch dtype of a numpy dtype, or None when torch has none."""
    return _FROM_NUMPY.get(np.dtype(dtype).newbyteorder("=")) if np.dtype(dtype).isnative else None
