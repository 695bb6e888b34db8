"""Shape and stride limits every reader applies before describing a tensor.

torch and numpy compute strides and sizes in signed 64-bit integers: a
file-supplied shape whose padded element count (zero dimensions counted as 1)
times the item size reaches 2**63 would overflow them even when the tensor is
empty, so it is refused here.

Examples
--------
>>> from tdz_numba.formats._shape import check_shape
>>> check_shape((0, 2**40, 2**40), None, 4, "x")
Traceback (most recent call last):
...
tdz_numba.errors.BadArchiveError: x: shape [0, 1099511627776, 1099511627776] spans 2**63 bytes or more
"""

from __future__ import annotations

from ..errors import BadArchiveError

__all__ = ["check_shape", "MAX_NDIM"]

#: Most dimensions a tensor may have (numpy's limit).
MAX_NDIM = 64
_LIMIT = 1 << 63


def check_shape(shape: tuple[int, ...], strides: tuple[int, ...] | None, itemsize: int, where: str) -> None:
    """Raises :class:`~tdz_numba.BadArchiveError` for more than ``MAX_NDIM`` dimensions,
    a padded byte size or any stride's byte reach of 2**63 or more."""
    if len(shape) > MAX_NDIM:
        raise BadArchiveError(f"{where}: {len(shape)} dimensions (at most {MAX_NDIM})")
    total = itemsize
    for d in shape:
        total *= max(d, 1)
    if total >= _LIMIT:
        raise BadArchiveError(f"{where}: shape {list(shape)} spans 2**63 bytes or more")
    if strides is not None:
        reach = sum(max(d - 1, 0) * s for d, s in zip(shape, strides)) + 1
        if any(s >= _LIMIT // max(itemsize, 1) for s in strides) or reach * itemsize >= _LIMIT:
            raise BadArchiveError(f"{where}: strides {list(strides)} reach 2**63 bytes or more")
