"""remote/arrival.py: each item is checked once, as soon as every byte of its extent has landed,
whatever order and size the parts land in; a failed check is raised by finish()."""

from __future__ import annotations

import threading

import numpy as np
import pytest

from tdz_numba.remote.arrival import ArrivalCheck


@pytest.mark.parametrize("seed", range(8))
def test_items_checked_once_and_only_when_covered(seed):
    """Random extents and parts landing in random order (some bytes here before): every item
    is checked exactly once, and never before all its bytes were told to have landed."""
    rng = np.random.default_rng(seed)
    n = int(rng.integers(1, 40))
    sizes = rng.integers(1, 5000, n)
    stops = np.cumsum(sizes)
    starts = stops - sizes
    total = int(stops[-1])
    cuts = np.unique(np.concatenate(([0, total], rng.integers(0, total, int(rng.integers(0, 30))))))
    parts = [(int(a), int(b)) for a, b in zip(cuts[:-1], cuts[1:])]
    present = [parts.pop(int(rng.integers(len(parts))))] if len(parts) > 1 and seed % 2 else []
    parts = [parts[k] for k in rng.permutation(len(parts)).tolist()]
    here = np.zeros(total, bool)  # what was told so far (set before each landed() call)
    for a, b in present:
        here[a:b] = True
    calls: list[list[int]] = []
    early: list[int] = []

    def check(items):
        calls.append(list(items))
        early.extend(k for k in items if not here[starts[k] : stops[k]].all())

    chk = ArrivalCheck(starts, stops, present, check)
    for a, b in parts:
        here[a:b] = True
        chk.landed(a, b)
    checked = chk.finish()
    flat = [k for c in calls for k in c]
    assert sorted(flat) == list(range(n)) == checked.tolist() and len(flat) == n  # each once
    assert not early


def test_an_item_waits_for_all_its_parts():
    seen: list[list[int]] = []
    gate = threading.Event()

    def check(items):
        seen.append(list(items))
        gate.set()

    chk = ArrivalCheck(np.array([0, 100]), np.array([100, 300]), [], check)
    chk.landed(150, 300)  # item 1 half here
    chk.landed(0, 100)  # item 0 whole
    assert gate.wait(5)
    chk.landed(100, 150)  # item 1 whole now
    assert chk.finish().tolist() == [0, 1]
    assert seen == [[0], [1]]


def test_a_failed_check_is_raised_by_finish_and_stops_the_checks():
    calls = []

    def check(items):
        calls.append(list(items))
        raise ValueError("bad bytes")

    chk = ArrivalCheck(np.array([0, 10]), np.array([10, 20]), [], check)
    chk.landed(0, 10)
    chk.landed(10, 20)
    with pytest.raises(ValueError, match="bad bytes"):
        chk.finish()
    assert calls == [[0]]


def test_stop_ends_the_worker():
    chk = ArrivalCheck(np.array([0]), np.array([10]), [], lambda items: None)
    chk.landed(0, 5)
    chk.stop()
    assert not chk._thread.is_alive()
