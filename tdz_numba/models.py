"""A model's state dict with tied weights: :func:`save_model` and :func:`load_model` (re-exported by
the package), with the semantics of ``safetensors.torch.save_model`` / ``load_model``: tensors that
share memory are saved once, the dropped names recorded in the metadata and restored on load,
missing and unexpected names reported.

Examples
--------
>>> import tempfile, pathlib, torch, tdz_numba
>>> with tempfile.TemporaryDirectory() as d:
...     p = tdz_numba.save_model(torch.nn.Linear(2, 2), pathlib.Path(d) / "m.tdz")
...     print(sorted(tdz_numba.load(p)))
['bias', 'weight']
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from .errors import InvalidArgumentError, MissingKeyError
from .saving import save

__all__ = ["save_model", "load_model"]

PathLike = str | os.PathLike


def save_model(model: Any, path: PathLike, *, metadata: dict[str, Any] | None = None, **kwargs: Any) -> Path:
    """Saves ``model.state_dict()`` as a ``.tdz`` archive, each shared tensor once (as
    ``safetensors.torch.save_model`` does).

    Tied weights (names whose tensors share memory, e.g. an embedding and an output head)
    are written once, under the first name (sorted) that covers the whole storage; each
    dropped name is recorded in the archive's metadata as ``{dropped: kept}`` (a name the
    caller already put in ``metadata`` is left alone). :func:`load_model` restores them.

    Parameters
    ----------
    model : torch.nn.Module
    path : str or os.PathLike
        The ``.tdz`` archive to write.
    metadata : dict, optional
        JSON metadata stored with the archive.
    **kwargs
        Passed to :func:`save` (``compression``, ``align``, ...).

    Returns
    -------
    pathlib.Path

    Raises
    ------
    InvalidArgumentError
        Tensors sharing memory none of which covers the whole of it (saving one would
        drop the others' bytes), or a suffix that names another format.

    Examples
    --------
    >>> import tempfile, pathlib, torch, tdz_numba
    >>> m = torch.nn.Sequential(torch.nn.Embedding(4, 2), torch.nn.Linear(2, 4, bias=False))
    >>> m[1].weight = m[0].weight  # tied
    >>> with tempfile.TemporaryDirectory() as d:
    ...     p = tdz_numba.save_model(m, pathlib.Path(d) / "m.tdz")
    ...     print(sorted(tdz_numba.load(p)), tdz_numba.open(p).metadata)
    ['0.weight'] {'1.weight': '0.weight'}
    """
    state = model.state_dict()
    meta = dict(metadata or {})
    for kept, dropped in _duplicate_names(state).items():
        for name in dropped:
            meta.setdefault(name, kept)
            del state[name]
    flat = {k: v.detach().contiguous() for k, v in state.items()}
    return save(flat, path, metadata=meta or None, **kwargs)


def load_model(
    model: Any, path: PathLike, *, strict: bool = True, device: Any = "cpu", **kwargs: Any
) -> tuple[list[str], list[str]]:
    """Loads an archive (or any file :func:`load` reads) into ``model``, restoring tied weights
    as ``safetensors.torch.load_model`` does.

    Names of the model that share memory with a name in the file (dropped by
    :func:`save_model`) are neither missing nor unexpected: loading the kept name fills them.

    Parameters
    ----------
    model : torch.nn.Module
    path : str or os.PathLike
    strict : bool
        Raise when names are missing or unexpected; otherwise return them.
    device : str or torch.device
        Where the loaded tensors go before being copied into the model.
    **kwargs
        Passed to :func:`load` (``dtype``, ``keys``, ...).

    Returns
    -------
    (missing, unexpected) : tuple of list of str
        Names of the model not loaded, names of the file not used.

    Raises
    ------
    MissingKeyError
        ``strict=True`` and names are missing or unexpected (both lists in the message).

    Examples
    --------
    >>> import tempfile, pathlib, torch, tdz_numba
    >>> m = torch.nn.Linear(2, 2)
    >>> with tempfile.TemporaryDirectory() as d:
    ...     p = tdz_numba.save_model(m, pathlib.Path(d) / "m.tdz")
    ...     print(tdz_numba.load_model(torch.nn.Linear(2, 2), p))
    ([], [])
    """
    from .api import load

    state = dict(load(path, device=device, **kwargs).items())
    tied = _duplicate_names(model.state_dict(), preferred=set(state))
    missing_l, unexpected = model.load_state_dict(state, strict=False)
    missing = set(missing_l)
    unexpected = list(unexpected)
    for dropped in tied.values():
        for name in dropped:
            if name in missing:
                missing.remove(name)
            elif name not in state:
                unexpected.append(name)
    missing_out = sorted(missing)
    if strict and (missing_out or unexpected):
        parts = []
        if missing_out:
            parts.append(f"missing from the file: {_names(missing_out)}")
        if unexpected:
            parts.append(f"unexpected in the file: {_names(unexpected)}")
        raise MissingKeyError(f"{path}: loading into {type(model).__name__}: " + "; ".join(parts))
    return missing_out, unexpected


def _names(names: list[str]) -> str:
    shown = ", ".join(repr(n) for n in names[:10])
    return shown + (f", ... ({len(names)} names)" if len(names) > 10 else "")


def _duplicate_names(state: dict[str, Any], preferred: set[str] | None = None) -> dict[str, list[str]]:
    """``{kept: [dropped, ...]}`` for names whose tensors overlap in memory: the kept name is
    the first (sorted; a ``preferred`` one first) whose tensor covers its whole storage."""
    import torch

    groups: dict[tuple, list[str]] = {}
    for name, t in state.items():
        if not isinstance(t, torch.Tensor) or t.device.type == "meta":
            continue
        st = t.untyped_storage()
        if st.data_ptr() == 0 or st.nbytes() == 0:
            continue
        groups.setdefault((t.device, st.data_ptr(), st.nbytes()), []).append(name)
    out: dict[str, list[str]] = {}
    for names in groups.values():
        if len(names) < 2:
            continue
        for shared in _overlapping(state, names):
            if len(shared) < 2:
                continue
            complete = sorted(n for n in shared if _covers_storage(state[n]))
            if not complete:
                raise InvalidArgumentError(
                    f"tensors {sorted(shared)} share memory but none covers all of it: "
                    "saving one would lose the others' bytes (clone them first)"
                )
            pick = [n for n in complete if preferred and n in preferred] or complete
            keep = pick[0]
            out[keep] = [n for n in sorted(shared) if n != keep]
    return out


def _overlapping(state: dict[str, Any], names: list[str]) -> list[set[str]]:
    """Groups of ``names`` (one storage) whose byte ranges overlap."""
    areas = sorted((state[n].data_ptr(), state[n].data_ptr() + _span(state[n]), n) for n in names)
    groups: list[set[str]] = []
    last_stop = -1
    for start, stop, name in areas:
        if groups and start < last_stop:
            groups[-1].add(name)
            last_stop = max(last_stop, stop)
        else:
            groups.append({name})
            last_stop = stop
    return groups


def _span(t: Any) -> int:
    if t.numel() == 0:
        return 0
    return (sum((d - 1) * s for d, s in zip(t.shape, t.stride())) + 1) * t.element_size()


def _covers_storage(t: Any) -> bool:
    st = t.untyped_storage()
    return t.data_ptr() == st.data_ptr() and t.numel() * t.element_size() == st.nbytes()
