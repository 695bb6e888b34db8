"""A zip-based file (.pt, .npz, .tdz) is mapped once: the views share the index's mapping. Far-apart
local headers are read with ``pread`` in a load too (not through the mapping advised for 2 MiB
folios, where each header's fault would read 2 MiB around it: a lazy load of a cold file would
read most of it, tests/test_cold_readahead.py); a bad header is refused either way."""

from __future__ import annotations

import numpy as np
import pytest
import torch

import tdz_numba
from tdz_numba.errors import BadArchiveError
from tdz_numba.zipfmt import central


def _write(fmt, path):
    ts = {f"w{i}": torch.full((40_000,), float(i)) for i in range(4)}  # 160 KB apart: far apart
    if fmt == "pt":
        torch.save(ts, path)
    elif fmt == "npz":
        np.savez(path, **{k: v.numpy() for k, v in ts.items()})
    else:
        tdz_numba.save(ts, path)
    return ts


@pytest.fixture
def preads(monkeypatch):
    calls = []
    real = central.check_local_by_pread

    def spy(*a, **k):
        calls.append(1)
        return real(*a, **k)

    monkeypatch.setattr(central, "check_local_by_pread", spy)
    return calls


@pytest.mark.parametrize("fmt", ["pt", "npz"])
def test_load_reads_far_headers_with_pread(tmp_path, preads, fmt):
    p = tmp_path / f"m.{fmt}"
    ts = _write(fmt, p)
    got = tdz_numba.load(p)
    assert all(torch.equal(got[k], v) for k, v in ts.items())
    assert preads  # not through the whole-file mapping (its faults read 2 MiB each)


@pytest.mark.parametrize("fmt", ["pt", "npz"])
def test_views_share_the_index_mapping(tmp_path, monkeypatch, fmt):
    """One mapping per file: the views are made over the mapping the index checked (the file
    is not mapped a second time by ``MappedFile.open``)."""
    from tdz_numba import formats
    from tdz_numba.tdz.sources import MappedFile

    p = tmp_path / f"m.{fmt}"
    ts = _write(fmt, p)

    def refuse(*a, **k):
        raise AssertionError("mapped a second time")

    monkeypatch.setattr(MappedFile, "open", refuse)
    src = formats.open_source(p)
    try:
        f = src.files[0]
        assert f.size == p.stat().st_size and f.buffer[:4].tobytes() == b"PK\x03\x04"
        got = tdz_numba.load(p)
        assert all(torch.equal(got[k], v) for k, v in ts.items())
    finally:
        src.close()


@pytest.mark.parametrize("fmt", ["pt", "npz", "tdz"])
def test_bad_far_header_refused_by_load(tmp_path, fmt):
    p = tmp_path / f"m.{fmt}"
    _write(fmt, p)
    raw = bytearray(p.read_bytes())
    last = raw.rfind(b"PK\x03\x04", 0, raw.find(b"PK\x01\x02"))  # the last local header
    raw[last + 26] ^= 0x01  # its name length no longer the central directory's
    p.write_bytes(bytes(raw))
    with pytest.raises(BadArchiveError):
        _ = tdz_numba.load(p)


def test_rows_of(tmp_path):
    from tdz_numba.zipfmt.index import ArchiveIndex

    p = tmp_path / "m.npz"
    np.savez(p, a=np.arange(3), b=np.ones(2))
    index = ArchiveIndex(p)
    assert index.rows_of(["b.npy", "x", "a.npy"]) == [index.row("b.npy"), None, index.row("a.npy")]
    assert sorted(index.rows_of(iter(["a.npy", "b.npy"]))) == [0, 1]
