"""The options of an open or a load, checked once (:func:`open_options`) and handed down as one
:class:`OpenOptions` value to the local opener, the remote one and every archive view.

Examples
--------
>>> import torch
>>> from tdz_numba.archive.options import open_options
>>> opts = open_options(dtype=torch.float16, device="cpu")
>>> opts.mode, opts.dtype, opts.device
('r', torch.float16, device(type='cpu'))
>>> open_options(dtype="bfloat16", map_location="cpu")[5:7]
(device(type='cpu'), torch.bfloat16)
"""

from __future__ import annotations

from typing import Any, NamedTuple

import torch

from ..errors import InvalidArgumentError

__all__ = ["OpenOptions", "open_options", "load_keys", "DEFAULT"]


class OpenOptions(NamedTuple):
    """The checked keywords of :func:`tdz_numba.open` / :func:`tdz_numba.load`."""

    mode: str = "r"
    subpath: str | tuple[str, ...] | None = None
    allow_pickle: bool = False
    num_threads: int | None = None
    copy: bool = False
    device: torch.device | None = None
    dtype: torch.dtype | None = None
    direct: bool = False
    allow_external: bool = False
    aligned: bool = False
    dequantize: bool = False


#: The options of a plain ``open(path)``.
DEFAULT = OpenOptions()


def open_options(
    *,
    mode: str = "r",
    subpath: str | tuple[str, ...] | None = None,
    allow_pickle: bool = False,
    num_threads: int | None = None,
    copy: bool = False,
    device: Any = None,
    dtype: Any = None,
    direct: bool = False,
    allow_external: bool = False,
    map_location: Any = None,
    aligned: bool = False,
    dequantize: bool = False,
) -> OpenOptions:
    """Checks the open/load keywords (see :func:`tdz_numba.open`) and returns them normalized.

    Raises
    ------
    InvalidArgumentError
        An unknown mode, a bad thread count, a dtype that is neither a ``torch.dtype`` nor the
        name of one (``"float16"``, ``"torch.bfloat16"``), a device torch does not know, both
        ``device`` and its alias ``map_location``.
    """
    if mode not in ("r", "r+"):
        raise InvalidArgumentError(f"mode must be 'r' or 'r+', got {mode!r}")
    if num_threads is not None:
        from ..jit.presets import check_num_threads

        num_threads = check_num_threads(num_threads)
    if map_location is not None:
        if device is not None:
            raise InvalidArgumentError(
                f"give device= or its alias map_location=, not both (device={device!r}, "
                f"map_location={map_location!r})"
            )
        if not isinstance(map_location, (str, torch.device)):
            raise InvalidArgumentError(
                f"map_location must be a device (str or torch.device), got {type(map_location).__name__}; "
                "a function or a dict of devices (torch.load's other forms) is not supported"
            )
        device = map_location
    if dtype is not None and not isinstance(dtype, torch.dtype):
        dtype = _dtype_by_name(dtype)
    if device is not None and not isinstance(device, torch.device):
        try:
            device = torch.device(device)
        except (RuntimeError, TypeError) as exc:
            raise InvalidArgumentError(f"device: {exc}") from None
    if (
        mode == "r"
        and subpath is None
        and not (allow_pickle or copy or direct or allow_external or aligned or dequantize)
        and num_threads is None
    ):
        if device is None and dtype is None:
            return DEFAULT
    return OpenOptions(
        mode,
        subpath,
        bool(allow_pickle),
        num_threads,
        bool(copy),
        device,
        dtype,
        bool(direct),
        bool(allow_external),
        bool(aligned),
        bool(dequantize),
    )


def _dtype_by_name(dtype: Any) -> torch.dtype:
    """A ``torch.dtype`` from its name (``"float16"``, ``"torch.float16"``, ``"half"``)."""
    if isinstance(dtype, str):
        name = dtype[6:] if dtype.startswith("torch.") else dtype
        found = getattr(torch, name, None) if name.isidentifier() else None
        if isinstance(found, torch.dtype):
            return found
        shown = dtype if len(dtype) <= 40 else dtype[:40] + "..."
        raise InvalidArgumentError(
            f"dtype {shown!r} names no torch dtype (e.g. 'float16', 'bfloat16', 'float32')"
        )
    raise InvalidArgumentError(
        f"dtype must be a torch.dtype, its name or None, got {type(dtype).__name__} {dtype!r:.60}"
    )


def load_keys(keys: Any) -> tuple[str, ...] | None:
    """The ``keys`` of a :func:`tdz_numba.load`, checked: a tuple of keys or paths (``"0.weight"``,
    ``"a/b"``), or None; raises :class:`~tdz_numba.InvalidArgumentError` for anything else."""
    if keys is None:
        return None
    if isinstance(keys, str):
        keys = (keys,)
    try:
        out = tuple(keys)
    except TypeError:
        raise InvalidArgumentError(f"keys must be a list of str, got {type(keys).__name__}") from None
    bad = [k for k in out if not isinstance(k, str) or not k]
    if bad:
        raise InvalidArgumentError(f"keys must be non-empty str, got {bad[0]!r:.60}")
    return out
