"""Small helpers the file readers share: quoting file-supplied text in error messages,
and turning a decoded numpy array (0-dim included) into a tensor of its own shape.

Examples
--------
>>> from tdz_numba.formats._common import quote
>>> quote("a" * 200)[:12], len(quote("a" * 200))
("'aaaaaaaaaaa", 83)
>>> quote("short")
"'short'"
"""

from __future__ import annotations

import reprlib
from typing import Any

import numpy as np

from ..tdz.sources import paused_gc as no_gc  # (one helper; the readers' name for it)

__all__ = ["quote", "as_tensor", "no_gc", "QUOTE_LIMIT"]

#: Longest quoted value (a name, key, descr, location read from a file) an error message holds.
QUOTE_LIMIT = 80
_REPR = reprlib.Repr()
_REPR.maxlevel, _REPR.maxlist, _REPR.maxtuple, _REPR.maxdict = 3, 6, 6, 4
_REPR.maxstring = _REPR.maxother = QUOTE_LIMIT


def quote(value: Any, limit: int = QUOTE_LIMIT) -> str:
    """``repr(value)`` cut to ``limit`` characters plus ``"..."`` (file-supplied garbage
    can be megabytes long; an error message must stay readable)."""
    if isinstance(value, (str, bytes)):
        text = repr(value[: limit + 1])  # a slice: never builds a huge repr
    else:
        text = _REPR.repr(value)  # containers: a few items, a few levels
    return text if len(text) <= limit else text[:limit] + "..."


def as_tensor(arr: np.ndarray) -> Any:
    """A C-contiguous torch tensor of ``arr``'s own shape (``np.ascontiguousarray``
    makes 0-dim arrays 1-dim; this keeps them 0-dim)."""
    import torch

    return torch.from_numpy(np.ascontiguousarray(arr).reshape(arr.shape))
