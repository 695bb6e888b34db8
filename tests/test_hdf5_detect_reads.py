"""detect_hdf5 past the first bytes: one 8-byte pread per power-of-two offset (a user block
of any size is found; a file of another format costs ~20 small reads, not 20 buffered 8 KiB ones)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from tdz_numba.formats import hdf5
from tdz_numba.formats.hdf5 import SIGNATURE, detect_hdf5


@pytest.mark.parametrize("at", [None, 8192, 1 << 20])
def test_signature_found_with_small_reads(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, at: int | None
) -> None:
    p = tmp_path / "f.bin"
    data = bytearray(2 << 20)
    if at is not None:
        data[at : at + 8] = SIGNATURE
    p.write_bytes(bytes(data))
    reads: list[tuple[int, int]] = []
    real = os.pread
    monkeypatch.setattr(hdf5.os, "pread", lambda fd, n, off: reads.append((n, off)) or real(fd, n, off))
    assert detect_hdf5(bytes(data[:4096]), p) is (at is not None)
    offsets = [off for _n, off in reads]
    assert all(n == 8 for n, _off in reads) and offsets[0] == 4096  # (512..2048: in the head)
    assert offsets == [4096 << k for k in range(len(offsets))]
    assert offsets[-1] == (at if at is not None else 1 << 20)  # 2 MiB: the last offset that fits
    assert detect_hdf5(bytes(data[:4096]), tmp_path / "missing") is False
