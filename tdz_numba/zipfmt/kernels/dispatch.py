"""The kernels' call sites: each function runs the Numba kernel or its pure-Python twin
(:mod:`tdz_numba.zipfmt.kernels.twins`: the same values, byte-identical archives, the same errors),
as :func:`tdz_numba.jit.policy.use_kernels` decides, without importing Numba for the twins.

Examples
--------
>>> import numpy as np
>>> from tdz_numba.zipfmt.kernels import dispatch
>>> data = np.frombuffer(b"abc", np.uint8)
>>> hex(int(dispatch.crc32_spans(np.array([data.ctypes.data]), np.array([3]))[0]))
'0x352441c2'
"""

from __future__ import annotations

import contextlib
from array import array
from typing import Any

import numpy as np

from ...jit.policy import CRC_CHUNK, use_kernels
from . import twins as pykernels

__all__ = [
    "crc32_spans",
    "crc32_zeros",
    "plan_layout",
    "parse_central_directory",
    "resolve_local",
    "check_local_headers",
    "walk_central",
    "gather_names",
]


# --------------------------------------------------------------------------
# The dispatched functions (the kernels' signatures)
# --------------------------------------------------------------------------
def crc32_spans(
    addrs, lengths, chunk: int = CRC_CHUNK, *, num_threads: int | None = None, schedule: int | None = None
) -> np.ndarray:
    """CRC-32 (uint32) of each memory span ``[addrs[i], addrs[i] + lengths[i])`` on ``num_threads``
    threads; ``schedule``: the kernel's dynamic schedule (:func:`tdz_numba.jit.presets.dynamic_schedule`)."""
    addrs = np.asarray(addrs, np.int64)
    lengths = np.asarray(lengths, np.int64)
    if not use_kernels(int(addrs.size)):
        return pykernels.crc32_spans(addrs, lengths, chunk, num_threads)
    from ...jit.presets import run_parallel
    from .crc import crc32_spans as kernel

    ctx: Any = contextlib.nullcontext()
    if schedule is not None:
        from ...jit.presets import dynamic_schedule

        ctx = dynamic_schedule(schedule)
    with ctx:
        return run_parallel(kernel, addrs, lengths, chunk, num_threads=num_threads)


def crc32_zeros(n: int) -> int:
    """CRC-32 of ``n`` zero bytes, computed (O(log n)), not hashed."""
    if not use_kernels():
        return pykernels.crc32_zeros(n)
    from .crc import crc32_zeros as kernel

    return int(kernel(int(n)))


def plan_layout(header_len, data_size, align, room):
    """See :func:`tdz_numba.zipfmt.kernels.crc.plan_layout`."""
    if not use_kernels(len(header_len)):
        return pykernels.plan_layout(header_len, data_size, align, room)
    from .crc import plan_layout as kernel

    return kernel(header_len, data_size, align, room)


def parse_central_directory(buf, cd_offset: int, cd_size: int, count: int, check_local: bool):
    """See :func:`tdz_numba.zipfmt.kernels.crc.parse_central_directory`."""
    if not use_kernels(int(count)):
        return pykernels.parse_central_directory(buf, cd_offset, cd_size, count, check_local)
    from .crc import parse_central_directory as kernel

    return kernel(buf, cd_offset, cd_size, count, check_local)


def resolve_local(buf, cols: np.ndarray, i: int, cd_offset: int) -> np.ndarray:
    """See :func:`tdz_numba.zipfmt.kernels.crc.resolve_local`."""
    if not use_kernels():
        return pykernels.resolve_local(buf, cols, i, cd_offset)
    from .crc import resolve_local as kernel

    return kernel(buf, cols, i, cd_offset)


def check_local_headers(
    buf, cols: np.ndarray, cd_offset: int, hdr: np.ndarray, hpos: np.ndarray
) -> np.ndarray:
    """See :func:`tdz_numba.zipfmt.kernels.crc.check_local_headers`."""
    if not use_kernels(len(cols)):
        return pykernels.check_local_headers(buf, cols, cd_offset, hdr, hpos)
    from .crc import check_local_headers as kernel

    return kernel(buf, cols, cd_offset, hdr, hpos)


def walk_central(cd: bytes, cd_offset: int, count: int) -> tuple[array, str] | None:
    """A small archive's central directory ``cd`` (at ``cd_offset``, ``count`` records) checked
    by :func:`tdz_numba.zipfmt.kernels.names.walk_central`: ``(record starts, names joined by NUL)``.

    None when the kernels do not run or the kernel defers (zip64 values, records out of
    file order, names that are not plain ASCII, anything wrong): the caller then takes
    the Python path (:func:`tdz_numba.zipfmt.smallindex._parse_central`), which is this
    function's twin.

    Examples
    --------
    >>> with forced("never"):
    ...     walk_central(b"", 0, 0) is None
    True
    """
    if not use_kernels(count):
        return None
    from .names import walk_central as kernel

    starts = array("q", bytes(8 * count))
    joined = bytearray(len(cd))
    n = kernel(cd, cd_offset, count, starts, joined)
    if n < 0:
        return None
    del joined[n:]
    return starts, joined.decode("ascii")


def gather_names(buf: np.ndarray, cols: np.ndarray, room: int) -> str | None:
    """Every entry's name (``cols`` from :func:`parse_central_directory` over ``buf``), joined by
    NUL, copied by :func:`tdz_numba.zipfmt.kernels.names.gather_names` into a buffer of ``room`` bytes
    (the central directory's size holds them all).

    None when the kernels do not run, or a name holds a NUL or a byte >= 0x80 (the caller
    then decodes each name: :meth:`tdz_numba.zipfmt.index.ArchiveIndex._decode_names`).

    Examples
    --------
    >>> with forced("never"):
    ...     gather_names(np.zeros(1, np.uint8), np.zeros((0, 14), np.int64), 0) is None
    True
    """
    if not use_kernels():
        return None
    from .names import gather_names as kernel

    joined = bytearray(room)
    n = kernel(buf, cols, joined)
    if n < 0:
        return None
    del joined[n:]
    return joined.decode("ascii")
