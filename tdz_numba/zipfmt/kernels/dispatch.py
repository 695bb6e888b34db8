"""The kernels' call sites: each function runs the Numba kernel or its pure-Python twin
(:mod:`tdz_numba.zipfmt.kernels.twins` for the CRC and layout kernels of
:mod:`~tdz_numba.zipfmt.kernels.crc`, :mod:`tdz_numba.zipfmt.kernels.central_twin` for the
central-directory kernels of :mod:`~tdz_numba.zipfmt.kernels.central`: the same values,
byte-identical archives, the same errors),
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
from typing import Any

import numpy as np

from ...errors import InternalError
from ...jit.policy import CRC_CHUNK, use_kernels
from .. import records
from . import central_twin
from . import twins as pykernels
from .central_twin import Central, CentralRows

__all__ = [
    "crc32_spans",
    "crc32_zeros",
    "plan_layout",
    "parse_central",
    "resolve_local",
    "check_local_headers",
]

_CD_SIZEOF = int(records.Central.SIZEOF)
_NCOLS = len(records.Col)
_CENTRAL: list = []  # the kernel module, once imported


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


def parse_central(cd, cd_offset: int, count: int) -> Central:
    """A central directory ``cd`` (bytes or a uint8 array; ``count`` records, at ``cd_offset``
    in the file) parsed by :func:`tdz_numba.zipfmt.kernels.central.parse_central` or by its twin
    :func:`tdz_numba.zipfmt.kernels.central_twin.parse_central`: the same :class:`Central`.

    Examples
    --------
    >>> from tdz_numba.jit.policy import forced
    >>> with forced("never"):
    ...     parse_central(b"", 0, 0).status
    (0, 0, 0, 0)
    """
    if not use_kernels(count):
        return central_twin.parse_central(cd, cd_offset, count)
    kernels = _CENTRAL
    if not kernels:  # (imported once: an import statement per open costs ~5 us)
        from . import central

        kernels.append(central)
    k = kernels[0]
    n = len(cd)
    cols = np.zeros((count if 0 <= count <= n // _CD_SIZEOF else 0, _NCOLS), np.int64)
    joined = bytearray(n)
    out = np.zeros(k.OUT_LEN, np.int64)
    digests = np.empty(len(cols), np.int64)
    if k.parse_central(cd, cd_offset, count, cols, joined, out, digests) == k.BAD_ARGUMENTS:
        raise InternalError(f"kernels.central.parse_central: arguments that do not fit ({count} records)")
    code, i, expected, found, length, encrypted, unknown, n_digests = out.tolist()
    names = None
    if length >= 0:
        del joined[length:]
        names = joined.decode("ascii").split("\x00") if count else []
    rows = CentralRows(cd, cd_offset, len(cols), cols=cols, digests=digests if n_digests else None)
    return Central(rows, names, (code, i, expected, found), encrypted, unknown)


def resolve_local(buf, cols: np.ndarray, i: int, cd_offset: int) -> np.ndarray:
    """See :func:`tdz_numba.zipfmt.kernels.central.resolve_local`."""
    if not use_kernels():
        return central_twin.resolve_local(buf, cols, i, cd_offset)
    from .central import resolve_local as kernel

    return kernel(buf, cols, i, cd_offset)


def check_local_headers(
    buf, cols: np.ndarray, cd_offset: int, hdr: np.ndarray, hpos: np.ndarray
) -> np.ndarray:
    """See :func:`tdz_numba.zipfmt.kernels.central.check_local_headers`."""
    if not use_kernels(len(cols)):
        return central_twin.check_local_headers(buf, cols, cd_offset, hdr, hpos)
    from .central import check_local_headers as kernel

    return kernel(buf, cols, cd_offset, hdr, hpos)
