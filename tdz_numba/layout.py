"""The layout plan: every offset of an archive, computed before a byte is written.

:func:`plan` encodes entry names, then calls the
:func:`~tdz_numba.kernels.plan_layout` kernel once for all entries: local
header offsets, padding of aligned payloads, payload offsets, central
directory offset and size, and whether zip64 end records are needed.

Examples
--------
>>> from tdz_numba.layout import plan
>>> p = plan(["meta.json", "a.memmap"], [100, 24], [False, True], [0, 0])
>>> int(p.payload_offset[1]) % 64
0
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from . import records

__all__ = ["Plan", "plan"]


@dataclass(frozen=True)
class Plan:
    """Offsets of every record of an archive (arrays indexed like the entries)."""

    names: list[bytes]
    flags: np.ndarray
    methods: np.ndarray
    data_size: np.ndarray
    header_offset: np.ndarray
    local_extra_len: np.ndarray
    pad: np.ndarray
    payload_offset: np.ndarray
    aligned: np.ndarray
    cd_offset: int
    cd_size: int
    zip64_end: bool
    file_size: int

    def pad_of(self, i: int) -> int | None:
        """Padding block length of entry ``i`` (None when it has no block)."""
        return int(self.pad[i]) if self.aligned[i] else None


def plan(names: Sequence[str], data_size: Sequence[int], aligned: Sequence[bool],
         methods: Sequence[int], alignment: int = records.ALIGNMENT,
         local_more: Sequence[int] | None = None) -> Plan:  # fmt: skip
    """Plans the layout of an archive from entry names and stored sizes.

    ``aligned`` entries (STORED ``*.memmap`` payloads) get a ``0x6474`` padding
    block so that their payload starts at a multiple of ``alignment``.
    ``local_more`` counts other local extra bytes per entry (segment tables).
    """
    from .kernels import plan_layout

    encoded = [records.name_flags(n, m) for n, m in zip(names, methods)]
    name_bytes = [e[0] for e in encoded]
    name_len = np.fromiter((len(b) for b in name_bytes), np.int64, len(name_bytes))
    sizes = np.asarray(data_size, dtype=np.int64).reshape(-1)
    align = np.asarray(aligned, dtype=np.bool_).reshape(-1)
    more = np.zeros(len(name_bytes), np.int64) if local_more is None else np.asarray(local_more, np.int64)
    hoff, lextra, pad, payload, _cextra, _c64, tail = plan_layout(
        name_len, sizes, align, alignment, 0, more
    )
    return Plan(
        names=name_bytes,
        flags=np.fromiter((e[1] for e in encoded), np.int64, len(encoded)),
        methods=np.asarray(methods, dtype=np.int64).reshape(-1),
        data_size=sizes,
        header_offset=hoff,
        local_extra_len=lextra,
        pad=pad,
        payload_offset=payload,
        aligned=align,
        cd_offset=int(tail[0]),
        cd_size=int(tail[1]),
        zip64_end=bool(tail[2]),
        file_size=int(tail[3]),
    )
