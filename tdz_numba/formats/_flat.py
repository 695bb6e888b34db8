"""Building many :class:`~tdz_numba.tdz.sources.TensorSpec` leaves at once, and the flat
:class:`~tdz_numba.tdz.sources.TreeSource` of a file with one level of them.

A reader that has its tensors as columns (names, dtypes, shapes, offsets, sizes)
makes the specs with :func:`make_specs` (one C-level ``tuple.__new__`` per spec,
no Python frame: about 4x cheaper than calling the named tuple) and hands a
``{name: spec}`` dict to :func:`flat_source`, which builds the level's
:class:`~tdz_numba.tdz.sources.Child` entries the same way. Both pause the
cyclic garbage collector (:func:`~tdz_numba.formats._common.no_gc`): 20,000+
new tuples would otherwise trigger several collections.

Examples
--------
>>> import torch
>>> from tdz_numba.formats._flat import make_specs
>>> specs = make_specs(["a", "b"], [torch.float32] * 2, [(2,), (3,)], 0, [0, 8], [8, 12], ["F32"] * 2)
>>> specs["b"]
TensorSpec(key='b', dtype=torch.float32, shape=(3,), strides=None, file=0, offset=8, nbytes=12, type_name='F32', codec='stored', size=0, crc=None, loader=None)
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from itertools import repeat
from typing import Any

from ..errors import InvalidArgumentError
from ..tdz.sources import Child, LevelInfo, MappedFile, TensorSpec, TreeSource
from ..tdz.specbulk import SpecColumns
from ._common import no_gc

__all__ = ["make_specs", "flat_source", "SpecDict"]

#: ``tuple.__new__`` mapped with ``repeat(cls, n)`` builds named tuples without a Python frame (half
#: the time of a ``partial(tuple.__new__, cls)`` call per row: 0.2 against 0.4 us at 20,000 rows).
_new = tuple.__new__


def make_specs(
    names: Sequence[str],
    dtypes: Sequence[Any],
    shapes: Sequence[tuple[int, ...]],
    file: int | Sequence[int],
    offsets: Sequence[int],
    nbytes: Sequence[int],
    type_names: Sequence[str],
) -> dict[str, TensorSpec]:
    """``{name: TensorSpec}`` of stored, C-contiguous leaves from equal-length columns, in order.

    ``file`` is one file index for every leaf or a column of them. The values
    must be checked already (names unique, extents inside the file): this only
    builds the tuples. Every column must hold plain Python objects (``int``, not
    numpy scalars: use ``ndarray.tolist()``).
    """
    n = len(names)
    files = repeat(file, n) if isinstance(file, int) else file
    with no_gc():
        rows = zip(
            names,
            dtypes,
            shapes,
            repeat(None, n),
            files,
            offsets,
            nbytes,
            type_names,
            repeat("stored", n),
            repeat(0, n),
            repeat(None, n),
            repeat(None, n),
        )
        made = list(map(_new, repeat(TensorSpec, n), rows))
        out = SpecDict(zip(names, made))
    out.columns = SpecColumns(made, dtypes, shapes, file, offsets, nbytes)
    return out


class SpecDict(dict):
    """The ``{name: spec}`` dict of :func:`make_specs`, with the columns it made them from
    (:class:`~tdz_numba.tdz.specbulk.SpecColumns`), which :func:`flat_source` hands to its source
    (``spec_columns``): the bulk view path then checks the extents from them."""

    columns: SpecColumns | None = None


def flat_source(
    format: str,
    path: str | os.PathLike,
    specs: dict[str, TensorSpec],
    *,
    files: list[MappedFile],
    metadata: dict[str, Any] | None = None,
    cls: type[TreeSource] = TreeSource,
    meta: dict[str, Any] | None = None,
) -> TreeSource:
    """The :class:`~tdz_numba.tdz.sources.TreeSource` (or subclass ``cls``) whose root level holds
    ``specs`` (keys: the dict's keys, in order) and ``meta``: the same source
    ``cls(format, path, specs, ...)`` builds, its children made in one pass. A tree whose
    values are not all specs (sub-levels, plain values) is handed to ``cls`` as it is."""
    with no_gc():
        values = list(specs.values())
        if not all(map(isinstance, values, repeat(TensorSpec))):
            return cls(format, path, specs, files=files, metadata=metadata)
        src = cls(format, path, {}, files=files, metadata=metadata)
        names = list(specs)
        if not all(map(isinstance, names, repeat(str))):
            raise InvalidArgumentError(f"{src.path}: level keys must be str")
        n = len(names)
        children = dict(zip(names, map(_new, repeat(Child, n), zip(names, repeat("leaf", n), names, values))))
    src._levels[""] = LevelInfo(True, children, dict(meta or {}))
    src.spec_columns = getattr(specs, "columns", None)  # type: ignore[attr-defined]  # see SpecDict
    return src
