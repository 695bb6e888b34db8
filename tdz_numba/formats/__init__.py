"""Readers of foreign tensor files: one :class:`~tdz_numba.tdz.sources.Source` per format.

:func:`detect` names a file's format from its bytes; :func:`open_source` opens
it as a :class:`~tdz_numba.tdz.sources.TreeSource` of zero-copy
:class:`~tdz_numba.tdz.sources.TensorSpec` leaves (``None`` for a ``.tdz`` archive,
which has its own reader). Formats: safetensors (also sharded, through the
``*.safetensors.index.json``), ``torch.save`` zips (read by a restricted pickle
VM that runs nothing from the file), ``.npy``/``.npz``, tensordict memmap
directories, plus those other modules register in :mod:`.detect`.

Examples
--------
>>> import tempfile, pathlib, torch
>>> from safetensors.torch import save_file
>>> from tdz_numba import formats
>>> with tempfile.TemporaryDirectory() as d:
...     p = pathlib.Path(d) / "w.safetensors"
...     save_file({"w": torch.ones(2, 3)}, str(p))
...     src = formats.open_source(p)
...     print(src.format, formats.to_tree(src)["w"].shape)
safetensors torch.Size([2, 3])
"""

from __future__ import annotations

import os
from typing import Any

from ..tdz.sources import Source, TreeSource, tensor_from_spec
from .detect import FORMATS, detect, register, sniff
from .detect import opener as _opener

__all__ = ["open_source", "detect", "register", "FORMATS", "to_tree"]


def open_source(
    path: str | os.PathLike, *, copy: bool = False, sniffed: tuple[str, Any] | None = None, **options: Any
) -> Source | None:
    """Opens a tensor file of any supported format other than ``.tdz``.

    Parameters
    ----------
    path : str or os.PathLike
        A file or a directory (tensordict memmap directory, sharded safetensors).
    copy : bool
        Recorded on the source (``source.copy``); leaves are made by
        :func:`~tdz_numba.tdz.sources.tensor_from_spec`, which copies on request.
    sniffed : (str, context), optional
        What :func:`~tdz_numba.formats.detect.sniff` returned for ``path``, when the
        caller sniffed it already: the zip index it parsed is reused (and owned
        by the source from here on), so the file is not parsed twice.
    **options
        Passed to the format's opener (unknown ones are ignored).

    Returns
    -------
    Source or None
        None for a ``.tdz`` archive (the caller opens it with its own reader).

    Raises
    ------
    UnsupportedError
        Unknown formats, TorchScript archives, what a reader does not support.
    BadArchiveError
        Malformed files.
    UnsafeContentError
        A torch file whose pickle names anything but tensor reconstruction,
        numpy object arrays.
    """
    name, ctx = sniff(path) if sniffed is None else sniffed
    if name == "tdz":
        if ctx is not None:
            ctx.close()
        return None
    try:
        fn = _opener(name)
        src = fn(path, index=ctx, **options) if ctx is not None else fn(path, **options)
    except BaseException:
        if ctx is not None:
            ctx.close()
        raise
    src.copy = copy
    return src


def to_tree(source: Source, *, copy: bool = False) -> dict[str, Any]:
    """Every level of a :class:`~tdz_numba.tdz.sources.TreeSource` as nested dicts of tensors
    and plain values (for tests and simple use; :func:`tdz_numba.open` is the lazy way)."""
    if not isinstance(source, TreeSource):
        raise TypeError(f"to_tree needs a TreeSource, got {type(source).__name__}")
    root: dict[str, Any] = {}
    stack = [("", root)]
    while stack:
        prefix, out = stack.pop()
        for key, child in source.level(prefix).children.items():
            if child.kind == "leaf":
                out[key] = tensor_from_spec(child.leaf, source.files, copy=copy, where=str(source.path))
            elif child.kind == "level":
                sub: dict[str, Any] = {}
                out[key] = sub
                stack.append((child.path, sub))
            else:
                out[key] = child.leaf
    return root
