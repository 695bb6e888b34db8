"""The options of an open or a load, checked once (:func:`open_options`) and handed down as one
:class:`OpenOptions` value to the local opener, the remote one and every archive view.

Examples
--------
>>> import torch
>>> from tdz_numba.archive.options import open_options
>>> opts = open_options(dtype=torch.float16, device="cpu")
>>> opts.mode, opts.dtype, opts.device
('r', torch.float16, device(type='cpu'))
"""

from __future__ import annotations

from typing import Any, NamedTuple

import torch

from ..errors import InvalidArgumentError

__all__ = ["OpenOptions", "open_options", "DEFAULT"]


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
) -> OpenOptions:
    """Checks the open/load keywords (see :func:`tdz_numba.open`) and returns them normalized.

    Raises
    ------
    InvalidArgumentError
        An unknown mode, a bad thread count, a dtype that is not a ``torch.dtype``, a device torch
        does not know.
    """
    if mode not in ("r", "r+"):
        raise InvalidArgumentError(f"mode must be 'r' or 'r+', got {mode!r}")
    if num_threads is not None:
        from ..jit.presets import check_num_threads

        num_threads = check_num_threads(num_threads)
    if dtype is not None and not isinstance(dtype, torch.dtype):
        raise InvalidArgumentError(f"dtype must be a torch.dtype or None, got {dtype!r}")
    if device is not None and not isinstance(device, torch.device):
        try:
            device = torch.device(device)
        except (RuntimeError, TypeError) as exc:
            raise InvalidArgumentError(f"device: {exc}") from None
    if (
        mode == "r"
        and subpath is None
        and not (allow_pickle or copy or direct or allow_external)
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
    )
