"""What the zip writers take: an :class:`Entry` per file of the archive, and the
:class:`Prepared` batch (sizes, CRCs and layout) that the local and the streamed writer share.

Examples
--------
>>> from tdz_numba.zipfmt.entry import Entry
>>> Entry("a.memmap", data=b"abcd", nbytes=4).is_payload
True
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

__all__ = ["Entry", "Prepared"]


@dataclass
class Entry:
    """One archive entry to write.

    ``data`` holds the bytes to store: ``bytes`` for metadata files, a flat
    uint8 numpy view of the source tensor for payloads (no copy; it keeps the
    tensor alive). ``zeros`` entries (``allocate``) have no data, only
    ``nbytes``.
    """

    name: str
    data: bytes | np.ndarray | None = None
    zeros: bool = False
    nbytes: int = 0

    @property
    def is_payload(self) -> bool:
        return self.name.endswith(".memmap")


@dataclass
class Prepared:
    """Entries ready to write: payloads compressed, sizes and CRCs known where they can be, the
    layout planned. Shared by the local writer and the streamed (remote) one."""

    n: int
    methods: np.ndarray
    stored_size: np.ndarray
    size: np.ndarray
    crc: np.ndarray
    hashed: np.ndarray  # CRC already known (compressed entries)
    sources: list  # the bytes to write: an array, a list of parts, None for zeros
    more: list  # extra blocks before the zip64 one (segment tables)
    plan: Any
    #: Per-entry XXH3-128 digests for the central records (None: no digests): a digest, None for
    #: an entry without one, ``b""`` for one the payload writer computes as it writes.
    digests: list | None = None
