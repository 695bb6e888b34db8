"""Numba kernels that read a central directory into what Python needs most: names.

Once a kernel has walked the central directory, what an open still pays for is
building one ``str`` per entry. These kernels copy every name into *one*
buffer, the names separated by NUL bytes, so that Python builds all of them
with one ``decode`` and one ``split`` (~0.05 us a name, against ~0.3 us for a
slice per name). They accept only names that this makes safe: ASCII without
a NUL byte; for anything else they answer "take the Python path", which
decodes, checks and names the problem as before.

* :func:`walk_central`: the whole check of
  :func:`tdz_numba.zipfmt.smallindex._parse_central` (a small archive's central
  directory) plus the names; it accepts plain archives only (no zip64 extra,
  records in file order) and defers everything else.
* :func:`gather_names`: the names of an index already parsed by
  :func:`tdz_numba.zipfmt.kernels.crc.parse_central_directory` (its ``NAME_OFFSET`` and
  ``NAME_LEN`` columns).

Both are called through :mod:`tdz_numba.zipfmt.kernels.dispatch`, and only when the
dispatcher runs kernels at all: without them, the Python paths run unchanged.

Examples
--------
>>> import numpy as np, tempfile, pathlib, torch, tdz_numba
>>> from tdz_numba.zipfmt import records; from tdz_numba.zipfmt.kernels import names as cd_kernels
>>> with tempfile.TemporaryDirectory() as d:
...     data = tdz_numba.save({"a": torch.zeros(4)}, pathlib.Path(d) / "x.tdz").read_bytes()
>>> end = eocd.find_end_record(data)
>>> cd = np.frombuffer(data, np.uint8)[end.cd_offset : end.cd_offset + end.cd_size]
>>> starts, joined = np.empty(end.count, np.int64), np.empty(cd.size, np.uint8)
>>> n = cd_kernels.walk_central(cd, end.cd_offset, end.count, starts, joined)
>>> starts.tolist(), joined[:n].tobytes()
([0, 55], b'meta.json\\x00a.memmap')
"""

from __future__ import annotations

from numba import njit

from ...errors import InternalError
from ...jit.presets import KERNEL
from .. import records
from .crc import _u16, _u32  # the little-endian field readers of the index kernels

__all__ = ["DEFER", "BAD_ARGUMENTS", "walk_central", "gather_names"]

#: Status: the kernel does not accept this central directory; the Python path decides.
DEFER = -1
#: Status: the output arrays are too small (a caller's bug, never the file's).
BAD_ARGUMENTS = -2

_CD_SIZEOF = records.Central.SIZEOF
_CD_FLAGS = int(records.Central.FLAGS)
_CD_METHOD = int(records.Central.METHOD)
_CD_CSIZE = int(records.Central.CSIZE)
_CD_SIZE = int(records.Central.SIZE)
_CD_NAME_LEN = int(records.Central.NAME_LEN)
_CD_EXTRA_LEN = int(records.Central.EXTRA_LEN)
_CD_COMMENT_LEN = int(records.Central.COMMENT_LEN)
_CD_HEADER_OFFSET = int(records.Central.HEADER_OFFSET)
_LH_SIZEOF = records.Local.SIZEOF
_CENTRAL_SIG = records.CENTRAL_SIG
_U32_MAX = 0xFFFFFFFF
_ENCRYPTED = records.FLAG_ENCRYPTED
_STORED = records.STORED
_KNOWN = tuple(sorted(records.METHOD_NAMES))
if len(_KNOWN) != 4:  # the kernel tests the method against four constants
    raise InternalError(f"names: {len(_KNOWN)} compression methods, the kernel knows 4")
_M0, _M1, _M2, _M3 = _KNOWN
_NCOLS = len(records.Col)
_NOFF = int(records.Col.NAME_OFFSET)
_NLEN = int(records.Col.NAME_LEN)


@njit(**KERNEL)
def walk_central(cd, cd_offset, count, starts, joined):
    """Checks a small archive's central directory as ``smallindex._parse_central`` does and
    copies its names into ``joined``, NUL-separated.

    Parameters
    ----------
    cd : uint8 array
        The central directory's bytes (possibly read-only).
    cd_offset : int
        Where it starts in the file (header offsets must lie before it).
    count : int
        The entries the end record lists.
    starts : int64 array of at least ``count``
        Filled with where each record starts in ``cd``.
    joined : uint8 array of at least ``cd.size``
        Filled with the names, separated by one NUL byte each.

    Returns
    -------
    int
        The length of the names in ``joined`` (>= 0): every record is well
        formed, in file order, without zip64 values, with an ASCII name holding
        no NUL, the records do not overlap and end where the central directory
        ends. :data:`DEFER` for anything else (the Python path decides, and
        raises for what is wrong); :data:`BAD_ARGUMENTS` when ``starts`` or
        ``joined`` is too small.
    """
    n = len(cd)
    if count < 0 or len(starts) < count or len(joined) < n or cd_offset < 0:
        return BAD_ARGUMENTS
    header_limit = cd_offset - _LH_SIZEOF
    p = 0
    j = 0  # names written so far: j <= p - 46 * i (each record holds its name and 46 more bytes)
    least = 0
    prev_hoff = -1
    prev_csize = 0
    for i in range(count):
        if p > n - _CD_SIZEOF:
            return DEFER
        if _u32(cd, p) != _CENTRAL_SIG:
            return DEFER
        flags = _u16(cd, p + _CD_FLAGS)
        method = _u16(cd, p + _CD_METHOD)
        csize = _u32(cd, p + _CD_CSIZE)
        usize = _u32(cd, p + _CD_SIZE)
        nlen = _u16(cd, p + _CD_NAME_LEN)
        q = p + _CD_SIZEOF
        rec_end = q + nlen + _u16(cd, p + _CD_EXTRA_LEN) + _u16(cd, p + _CD_COMMENT_LEN)
        hoff = _u32(cd, p + _CD_HEADER_OFFSET)
        if rec_end > n or flags & _ENCRYPTED:
            return DEFER
        if method != _M0 and method != _M1 and method != _M2 and method != _M3:
            return DEFER
        if usize == _U32_MAX or csize == _U32_MAX or hoff == _U32_MAX:
            return DEFER  # zip64 values: the Python path reads them
        if hoff > header_limit or (usize != csize and method == _STORED):
            return DEFER
        if hoff < prev_hoff:
            return DEFER  # out of file order: the Python path sorts
        if least > hoff or prev_csize > hoff - least:
            return DEFER
        least = hoff + _LH_SIZEOF + nlen
        prev_hoff = hoff
        prev_csize = csize
        starts[i] = p
        if i:
            joined[j] = 0
            j += 1
        for k in range(q, q + nlen):  # q + nlen <= rec_end <= n
            b = cd[k]
            if b == 0 or b >= 0x80:
                return DEFER  # a NUL splits wrongly; bytes >= 0x80: UTF-8 (the Python path decodes)
            joined[j] = b
            j += 1
        p = rec_end
    if p != n:
        return DEFER
    if count and (least > cd_offset or prev_csize > cd_offset - least):
        return DEFER
    return j


@njit(**KERNEL)
def gather_names(buf, cols, joined):
    """Copies every entry's name, ``buf[cols[i, NAME_OFFSET] : ... + cols[i, NAME_LEN]]``, into
    ``joined``, NUL-separated.

    Parameters
    ----------
    buf : uint8 array
        The archive's bytes (the mapping).
    cols : int64 array (count, len(records.Col))
        The index of :func:`tdz_numba.zipfmt.kernels.crc.parse_central_directory`.
    joined : uint8 array or bytearray
        Room for every name and a separator each.

    Returns
    -------
    int
        The length written (>= 0); :data:`DEFER` when a name holds a NUL or a byte
        >= 0x80 (the caller then slices the names one by one) or lies outside ``buf``;
        :data:`BAD_ARGUMENTS` when ``cols`` or ``joined`` does not fit.
    """
    if cols.shape[1] != _NCOLS:
        return BAD_ARGUMENTS
    n = len(buf)
    room = len(joined)
    j = 0
    for i in range(cols.shape[0]):
        start = cols[i, _NOFF]
        length = cols[i, _NLEN]
        if start < 0 or length < 0 or start > n or length > n - start:
            return DEFER
        if i:
            if j >= room:
                return BAD_ARGUMENTS
            joined[j] = 0
            j += 1
        if length > room - j:
            return BAD_ARGUMENTS
        for k in range(start, start + length):
            b = buf[k]
            if b == 0 or b >= 0x80:
                return DEFER
            joined[j] = b
            j += 1
    return j
