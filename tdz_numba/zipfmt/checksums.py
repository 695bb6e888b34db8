"""Checksums of STORED entries: their CRC-32s computed over the mapping (the kernel or its twin) and
re-stamped in place after ``r+`` writes, with their XXH3-128 digests where the archive has them.

Examples
--------
>>> import tempfile, pathlib, torch, tdz_numba
>>> from tdz_numba.zipfmt.checksums import refresh_checksums
>>> with tempfile.TemporaryDirectory() as d:
...     p = tdz_numba.save({"a": torch.zeros(4)}, pathlib.Path(d) / "x.tdz")
...     with tdz_numba.open(p, mode="r+") as ar:
...         ar["a"][0] = 1.0
...     print(refresh_checksums(p).name, tdz_numba.verify(p).leaves)
x.tdz 1
"""

from __future__ import annotations

import os
import struct
from pathlib import Path

import numpy as np

from ..errors import BadArchiveError
from . import records
from .index import ArchiveIndex

__all__ = ["stored_crcs", "refresh_checksums", "refresh_entries", "stamp_digests"]


def stored_crcs(index: ArchiveIndex, rows: np.ndarray) -> np.ndarray:
    """CRC-32 of the STORED entries ``rows`` of ``index``, computed in parallel."""
    from ..jit.policy import CRC_CHUNK
    from ..zipfmt.kernels.dispatch import crc32_spans  # the kernel or its twin

    base = index.buffer.ctypes.data
    addrs = base + index.table["payload_offset"][rows]
    # kernel: pieces of <= CRC_CHUNK, handed out 8 at a time
    return crc32_spans(addrs.astype(np.int64), index.table["csize"][rows].copy(), CRC_CHUNK, schedule=8)


def refresh_checksums(path: str | os.PathLike) -> Path:
    """Re-stamps the CRC-32 of STORED entries after in-place writes; see
    :func:`tdz_numba.refresh_checksums`."""
    index = ArchiveIndex(path, writable=True, check_local=True)
    try:
        if "meta.json" not in index:
            raise BadArchiveError(f"{path}: not a tensor archive: no top-level meta.json entry")
        stored = np.nonzero(index.table["method"] == records.STORED)[0]
        _stamp(index, stored, stored_crcs(index, stored))
        if index.has_digests:
            stamp_digests(index, stored.tolist())
        index._mmap.flush()
    finally:
        index.close()
    return Path(path)


def refresh_entries(index: ArchiveIndex, names: list[str]) -> int:
    """Re-stamps, in a writable ``index``, the CRC-32 of those STORED entries ``names`` whose
    bytes changed (their CRC computed now differs from the recorded one); other names are
    skipped. Returns how many were re-stamped (0: nothing written, the file untouched).

    Used when a ``mode="r+"`` archive closes: only the leaves it handed out can have been
    written through its mapping, so only those are hashed.
    """
    found = [index.row(n) for n in names]
    picked = [r for r in found if r is not None and index.row_at(r).method == records.STORED]
    if not picked:
        return 0
    for r in picked:
        index.payload_offset(r)  # (read from its local header when not yet)
    rows = np.array(picked, np.int64)
    table = index.table
    crcs = _crcs_by_read(index, rows)
    changed = crcs != table["crc"][rows]
    if not changed.any():
        return 0
    _stamp(index, rows[changed], crcs[changed])
    if index.has_digests:
        stamp_digests(index, rows[changed].tolist())
    index._mmap.flush()
    return int(changed.sum())


def stamp_digests(index: ArchiveIndex, rows: list[int]) -> int:
    """Re-stamps the digest of each STORED entry of ``rows`` that has one (its central
    :class:`~tdz_numba.zipfmt.records.DigestExtra`) from its bytes now; returns how many changed."""
    from .digest import hash_function

    hash_now = hash_function()
    buf = index.buffer
    changed = 0
    for row in rows:
        at = index.digest_offset(row)
        if at < 0:
            continue
        r = index.row_at(row)
        value = np.frombuffer(hash_now(buf[r.payload_offset : r.payload_offset + r.csize]), np.uint8)
        if not np.array_equal(buf[at : at + value.size], value):
            buf[at : at + value.size] = value
            changed += 1
    return changed


_READ_PIECE = 8 << 20


def _crcs_by_read(index: ArchiveIndex, rows: np.ndarray) -> np.ndarray:
    """CRC-32 of the STORED entries ``rows`` read with ``pread`` from the file, not through the
    mapping: the shared mapping's written pages are in the page cache that ``pread`` reads, and a
    hole of a sparse file (``allocate(..., reserve=False)``) reads as zeros without allocating a
    page, where touching it through a shared mapping on a full file system raises SIGBUS."""
    from zlib_ng import zlib_ng

    table = index.table
    out = np.zeros(rows.size, np.uint32)
    fd = os.open(index.path, os.O_RDONLY)
    try:
        for k, row in enumerate(rows.tolist()):
            pos, left, crc = int(table["payload_offset"][row]), int(table["csize"][row]), 0
            while left:
                piece = os.pread(fd, min(left, _READ_PIECE), pos)
                if not piece:
                    raise BadArchiveError(f"{index.path}: entry {index.names[row]!r} ends past the file")
                crc = zlib_ng.crc32(piece, crc)
                pos += len(piece)
                left -= len(piece)
            out[k] = crc
    finally:
        os.close(fd)
    return out


def _stamp(index: ArchiveIndex, rows: np.ndarray, crcs: np.ndarray) -> None:
    """Writes ``crcs`` into the local header (or data descriptor) and central record of ``rows``."""
    path = index.path
    buf = index.buffer
    sig = len(records.DESCRIPTOR_SIG)
    for row, crc in zip(rows.tolist(), crcs.tolist()):
        r = index.row_at(row)
        packed = np.frombuffer(struct.pack("<I", crc), np.uint8)
        if r.flags & records.FLAG_DESCRIPTOR:
            pos = r.payload_offset + r.csize
            if buf[pos : pos + sig].tobytes() == records.DESCRIPTOR_SIG:
                pos += sig
            pos += records.Descriptor.CRC
            if pos + 4 > r.next_offset:
                raise BadArchiveError(
                    f"{path}: entry {index.names[row]!r}: data descriptor past the data area",
                    path=str(path),
                    entry=index.names[row],
                    offset=pos,
                )
            buf[pos : pos + 4] = packed
        else:
            pos = r.header_offset + records.Local.CRC
            buf[pos : pos + 4] = packed
        pos = r.central_offset + records.Central.CRC
        buf[pos : pos + 4] = packed
