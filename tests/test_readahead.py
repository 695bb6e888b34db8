"""memory.readahead: the ranges a bulk load hands out read ahead in file order (merged, capped, never an error)."""

from __future__ import annotations

import mmap

import numpy as np
import pytest
import torch

import tdz_numba
from tdz_numba.errors import InvalidArgumentError
from tdz_numba.files import memory


def test_merges_sorts_and_skips_bad_ranges():
    got = memory.read_spans(
        64 << 20, [8 << 20, 0, -1, 1 << 20, 60 << 20], [1 << 20, 1 << 20, 5, 1 << 20, 8 << 20], gap=0
    )
    # [0, 2 MiB) merged (adjacent), [8, 9 MiB) alone, the negative and the out-of-bounds ranges skipped
    assert got == [(0, 2 << 20), (8 << 20, 9 << 20)]
    assert memory.read_spans(64 << 20, [0, 8 << 20], [1 << 20, 1 << 20], gap=16 << 20) == [(0, 9 << 20)]


def test_unaligned_start_is_rounded_down_to_a_page():
    got = memory.read_spans(8 << 20, [memory.PAGE_SIZE + 10], [2 << 20])
    assert got == [(memory.PAGE_SIZE, memory.PAGE_SIZE + 10 + (2 << 20))]


def test_small_totals_are_not_read():
    mm = mmap.mmap(-1, 8 << 20)
    assert memory.readahead(mm, np.arange(10) * 4096, np.full(10, 100)) == 0
    assert memory.read_spans(8 << 20, np.arange(10) * 4096, np.full(10, 100)) == []


def test_mismatched_lengths_refused():
    with pytest.raises(InvalidArgumentError):
        memory.readahead(mmap.mmap(-1, 4096), [0, 1], [1])


def test_real_mapping(tmp_path, monkeypatch):
    monkeypatch.setenv("TDZ_NUMBA_READAHEAD", "1")  # (off by default)
    tree = {"a": torch.randn(300_000), "b": {"c": torch.arange(400_000, dtype=torch.float64)}}
    path = tdz_numba.save(tree, tmp_path / "x.tdz", durable=False)
    with tdz_numba.open(path) as ar:
        locs = [ar.info(k).location for k, _ in ar.leaves()]
        mm = ar._state.source.index._mmap
        assert memory.readahead(mm, [loc.offset for loc in locs], [loc.nbytes for loc in locs]) >= 4_400_000
        assert memory.wait_readahead(60)
        assert torch.equal(ar["a"], tree["a"]) and torch.equal(ar["b/c"], tree["b"]["c"])


def test_off_sorts_nothing(monkeypatch):
    """Off (the default), readahead returns before read_spans sorts and merges the ranges."""
    calls = []
    real = memory.read_spans
    monkeypatch.setattr(memory, "read_spans", lambda *a, **k: calls.append(1) or real(*a, **k))
    mm = mmap.mmap(-1, 8 << 20)
    offs, sizes = np.arange(4) * (2 << 20), np.full(4, 2 << 20)
    monkeypatch.delenv("TDZ_NUMBA_READAHEAD", raising=False)
    assert memory.readahead(mm, offs, sizes) == 0
    assert calls == []
    with pytest.raises(InvalidArgumentError):  # still refused when off
        memory.readahead(mm, offs, sizes[:3])
    monkeypatch.setenv("TDZ_NUMBA_READAHEAD", "1")
    memory.readahead(mm, offs, sizes)
    assert calls == [1]
    assert memory.wait_readahead(60)


def test_tdz_load_gathers_no_ranges_when_off(tmp_path, monkeypatch):
    """read_ahead_tdz (every .tdz load) hands nothing to readahead when it is off; on, the payloads."""
    from tdz_numba.archive import opening

    calls = []
    monkeypatch.setattr(opening, "readahead", lambda mm, off, nb: calls.append(int(nb.sum())) or 0)
    path = tdz_numba.save({"a": torch.zeros(1 << 19)}, tmp_path / "x.tdz", durable=False)
    monkeypatch.delenv("TDZ_NUMBA_READAHEAD", raising=False)
    assert torch.equal(tdz_numba.load(path)["a"], torch.zeros(1 << 19))
    assert calls == []
    monkeypatch.setenv("TDZ_NUMBA_READAHEAD", "1")
    tdz_numba.load(path)
    assert len(calls) == 1 and calls[0] >= 4 << 19  # (and meta.json)
