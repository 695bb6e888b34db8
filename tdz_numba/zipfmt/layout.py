"""The layout plan: every offset of an archive, computed before a byte is written.

:func:`plan` encodes entry names, asks :mod:`tdz_numba.zipfmt.records` for every
record length and zip64 decision, then calls the
:func:`~tdz_numba.zipfmt.kernels.crc.plan_layout` kernel once for all entries: local
header offsets, padding of aligned payloads, payload offsets. The central
directory's length follows from the records' rules; the packers
(:func:`tdz_numba.zipfmt.packers.local_headers`,
:func:`tdz_numba.zipfmt.packers.central_directory`) receive the plan's decisions.

Examples
--------
>>> from tdz_numba.zipfmt.layout import plan
>>> p = plan(["meta.json", "a.memmap"], [100, 24], [0, 64], [0, 0])
>>> int(p.payload_offset[1]) % 64, p.pad_of(0)
(0, None)
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import numpy.typing as npt

from ..errors import InvalidArgumentError, InvalidTreeError
from . import packers, records

__all__ = ["Plan", "plan"]

_MAX_U16 = 0xFFFF


@dataclass(frozen=True)
class Plan:
    """Offsets of every record of an archive (arrays indexed like the entries)."""

    names: list[bytes]
    flags: np.ndarray
    methods: np.ndarray
    size: np.ndarray  # uncompressed sizes
    data_size: np.ndarray  # stored sizes
    align: np.ndarray  # payload alignment per entry (0 or 1: no padding block)
    header_offset: np.ndarray
    pad: np.ndarray  # padding bytes; -1: no padding block
    central_pad: np.ndarray  # the padding block copied into the central record (-1: none)
    payload_offset: np.ndarray
    central_zip64: np.ndarray  # packers.central_zip64 of every entry
    cd_offset: int
    cd_size: int
    zip64_end: bool
    file_size: int

    def pad_of(self, i: int) -> int | None:
        """Padding block length of entry ``i`` (None when it has no block)."""
        pad = int(self.pad[i])
        return None if pad < 0 else pad


def _alignments(align: npt.ArrayLike, n: int) -> np.ndarray:
    a = np.asarray(align).reshape(-1)
    if a.size != n:
        raise InvalidArgumentError(f"{a.size} alignments for {n} entries")
    if a.dtype == np.bool_:  # True: the default alignment
        return np.where(a, records.ALIGNMENT, 0).astype(np.int64)
    a = a.astype(np.int64)
    bad = (a < 0) | ((a > 1) & ((a & (a - 1)) != 0))
    if bad.any():
        raise InvalidArgumentError(f"alignment {int(a[bad][0])}: expected 0, 1 or a power of two")
    return a


def plan(
    names: list[str],
    data_size: npt.ArrayLike,
    align: npt.ArrayLike,
    methods: npt.ArrayLike,
    *,
    size: npt.ArrayLike | None = None,
    local_more: npt.ArrayLike | None = None,
) -> Plan:
    """Plans the layout of an archive from entry names and stored sizes.

    Parameters
    ----------
    names : sequence of str
        Entry names, in archive order.
    data_size : sequence of int
        Stored (compressed) size of each entry.
    align : sequence of int (or bool)
        Payload alignment per entry: entries with an alignment > 1 get a
        ``0x6474`` padding block so that their payload starts at a multiple of
        it (64 for ``*.memmap`` entries, as tensordict); 0 or 1: no block.
        ``True`` means :data:`tdz_numba.zipfmt.records.ALIGNMENT`.
    methods : sequence of int
        Compression method per entry.
    size : sequence of int, optional
        Uncompressed sizes (default: ``data_size``); with the stored sizes
        they decide the central zip64 fields.
    local_more : sequence of int, optional
        Bytes of other local extra blocks per entry (segment tables).
    """
    from .kernels.dispatch import plan_layout  # the kernel or its twin

    n = len(names)
    methods_arr = np.asarray(methods, dtype=np.int64).reshape(n)
    encoded = [packers.name_flags(name, int(m)) for name, m in zip(names, methods_arr.tolist())]
    name_bytes = [e[0] for e in encoded]
    name_len = np.fromiter((len(b) for b in name_bytes), np.int64, n)
    if n and int(name_len.max()) > _MAX_U16:
        i = int(name_len.argmax())
        raise InvalidTreeError(
            f"entry name {names[i][:60]!r}... is {int(name_len[i])} bytes long, "
            f"a zip entry name can hold {_MAX_U16}"
        )
    stored = np.asarray(data_size, dtype=np.int64).reshape(n)
    usize = stored if size is None else np.asarray(size, dtype=np.int64).reshape(n)
    alignment = _alignments(align, n)
    more = np.zeros(n, np.int64) if local_more is None else np.asarray(local_more, np.int64).reshape(n)
    has_pad = alignment > 1
    header_len = packers.local_header_len(name_len, more, has_pad)
    # padding bytes the local extra field can still take (it holds at most 65,535 bytes)
    room = _MAX_U16 - (header_len - records.Local.SIZEOF - name_len)
    if n and bool((has_pad & (room < 0)).any()):
        i = int(np.nonzero(has_pad & (room < 0))[0][0])
        raise InvalidArgumentError(
            f"entry {names[i]!r}: {int(more[i])} other extra bytes leave no room "
            f"for a padding block in the zip extra field"
        )
    hoff, pad, payload, data_end = plan_layout(header_len, stored, alignment, room)
    zip64 = packers.central_zip64(usize, stored, hoff)
    # tensordict copies the 64-byte padding block into the central record; larger (page)
    # paddings stay local only, so they do not grow the central directory
    central_pad = np.where(alignment == records.ALIGNMENT, pad, -1)
    cd_offset = int(data_end)
    cd_size = int(packers.central_record_len(name_len, zip64, central_pad).sum())
    zip64_end = packers.needs_zip64_end(n, cd_offset, cd_size)
    return Plan(
        names=name_bytes,
        flags=np.fromiter((e[1] for e in encoded), np.int64, n),
        methods=methods_arr,
        size=usize,
        data_size=stored,
        align=alignment,
        header_offset=hoff,
        pad=pad,
        central_pad=central_pad,
        payload_offset=payload,
        central_zip64=zip64,
        cd_offset=cd_offset,
        cd_size=cd_size,
        zip64_end=zip64_end,
        file_size=cd_offset + cd_size + packers.end_records_len(zip64_end),
    )
