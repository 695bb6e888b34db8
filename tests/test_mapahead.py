"""A whole-file load of a cached file maps its pages ahead on another core (``files.mapahead``,
issue 27): after the load, with nothing touched, every page of its views is mapped in this
process; not for a cold file, a small one, one CPU, ``TDZ_NUMBA_MAPAHEAD=0``, a lazy open or a
copy; the queue is bounded and a forked child starts its own thread."""

from __future__ import annotations

import mmap
import os
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.torch import save_file

import tdz_numba
from tdz_numba.bench.harness import drop_cache
from tdz_numba.files import loadadvice, mapahead, pagecache
from tdz_numba.files.memory import PAGE_SIZE

MIB = 1 << 20


def _mapped(t: torch.Tensor | mmap.mmap) -> float:
    """The share of the pages of ``t``'s bytes (a tensor's, a mapping's) mapped in this process
    (``/proc/self/pagemap``)."""
    if isinstance(t, mmap.mmap):
        address, nbytes = np.frombuffer(t, np.uint8).ctypes.data, len(t)
    else:
        address, nbytes = t.data_ptr(), t.nbytes
    first = address // PAGE_SIZE
    last = (address + nbytes - 1) // PAGE_SIZE
    try:
        with open("/proc/self/pagemap", "rb") as f:
            f.seek(8 * first)
            e = np.frombuffer(f.read(8 * (last - first + 1)), np.uint64)
    except OSError:  # pragma: no cover - no pagemap
        pytest.skip("/proc/self/pagemap is not readable here")
    return float((e >> np.uint64(63)).astype(bool).mean())


def _model(tmp_path: Path, mib: int = 24) -> tuple[dict[str, torch.Tensor], Path]:
    n = 6
    tree = {f"w{i}": torch.randn(mib * MIB // 4 // n + 17 * i) for i in range(n)}
    p = tmp_path / "m.safetensors"
    save_file(tree, str(p))
    return tree, p


def _warm(path: Path) -> None:
    with open(path, "rb") as f:
        while f.read(8 * MIB):
            pass


@pytest.fixture(autouse=True)
def _two_cpus_or_skip(monkeypatch):
    monkeypatch.delenv(mapahead.ENV, raising=False)
    if not mapahead.map_ahead_on(mapahead.MIN_BYTES):
        pytest.skip("one CPU for this process: nothing is mapped ahead")
    yield
    assert mapahead.wait_map_ahead(30)


def test_warm_load_maps_every_page_ahead(tmp_path):
    tree, p = _model(tmp_path)
    _warm(p)
    got = tdz_numba.load(p)
    assert mapahead.wait_map_ahead(30)
    shares = [_mapped(t) for t in got.values()]
    assert min(shares) == 1.0, shares  # every page, the first leaf's too, with nothing touched
    assert all(torch.equal(got[k], v) for k, v in tree.items())


def test_tdz_load_maps_ahead_too(tmp_path):
    tree = {f"w{i}": torch.randn(5 * MIB // 4) for i in range(5)}
    p = tdz_numba.save(tree, tmp_path / "m.tdz", durable=False)
    _warm(p)
    got = tdz_numba.load(p)
    assert mapahead.wait_map_ahead(30)
    assert min(_mapped(t) for t in got.values()) == 1.0


@pytest.mark.parametrize("case", ["off", "one_cpu", "small", "open", "copy", "cold"], ids=lambda c: c)
def test_nothing_mapped_ahead(tmp_path, monkeypatch, case):
    _, p = _model(tmp_path, mib=4 if case == "small" else 24)
    _warm(p)
    if case == "off":
        monkeypatch.setenv(mapahead.ENV, "0")
    elif case == "one_cpu":
        monkeypatch.setattr(mapahead, "_CPUS", {os.getpid(): 1})
    elif case == "cold":
        drop_cache(p)
        with open(p, "rb") as f:
            if pagecache.looks_cached(f.fileno(), p.stat().st_size):
                pytest.skip("the page cache kept the file (POSIX_FADV_DONTNEED not honoured here)")
    queued = []
    monkeypatch.setattr(loadadvice, "map_ahead", lambda mm: queued.append(len(mm)) or True)
    if case == "open":
        with tdz_numba.open(p) as ar:
            got = {k: ar[k] for k in ar.keys()}
            assert mapahead.wait_map_ahead(30)
            shares = [_mapped(t) for t in got.values()]
    else:
        got = tdz_numba.load(p, copy=case == "copy")
        assert mapahead.wait_map_ahead(30)
        shares = [_mapped(t) for t in got.values()]
    assert queued == []
    if case != "copy":  # views nothing touched (the first leaf may share the header's folio)
        assert max(shares[1:]) < 0.05, shares


def test_warm_load_queues_the_mapping(tmp_path, monkeypatch):
    _, p = _model(tmp_path)
    _warm(p)
    queued = []
    monkeypatch.setattr(loadadvice, "map_ahead", lambda mm: queued.append(len(mm)) or True)
    tdz_numba.load(p)
    assert queued == [p.stat().st_size]


def _mapping(p: Path) -> mmap.mmap:
    with open(p, "rb") as f:
        return mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)


def test_map_ahead_faults_a_file_mapping_in(tmp_path):
    p = tmp_path / "f.bin"
    p.write_bytes(os.urandom(3 * MIB + 5))
    mm = _mapping(p)
    assert not mapahead.map_ahead(mm)  # below MIN_BYTES
    assert mapahead.map_ahead(mm, min_bytes=1)
    assert mapahead.wait_map_ahead(30)
    assert _mapped(mm) == 1.0
    assert mm[-5:] == p.read_bytes()[-5:]


def test_cpus_and_cache_samples(tmp_path, monkeypatch):
    monkeypatch.setattr(mapahead, "_CPUS", {})
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {0})
    assert not mapahead.map_ahead_on(1 << 30)  # one CPU: the faults stay with the caller
    p = tmp_path / "f.bin"
    p.write_bytes(os.urandom(MIB))
    with open(p, "rb") as f:
        assert pagecache.looks_cached(f.fileno(), MIB)  # just written
        assert not pagecache.looks_cached(f.fileno(), 0) and not pagecache.looks_cached(-1, MIB)
        drop_cache(p)
        if not loadadvice._mostly_cached(_mapping(p)):  # (mincore: where the drop is honoured)
            assert not pagecache.looks_cached(f.fileno(), MIB)
            _warm(p)
            assert pagecache.looks_cached(f.fileno(), MIB)


def test_the_cache_question_reads_nothing(tmp_path, monkeypatch):
    """``looks_cached`` of a dropped file says no and leaves it dropped: cachestat reads nothing.
    (Its ``RWF_NOWAIT`` fallback starts the read of the first page it misses, and where the disk
    answered fast enough it took that page for a cached one: 1 cold load in 10 was mapped
    ahead, from the end backwards, instead of read forward.)"""
    p = tmp_path / "f.bin"
    p.write_bytes(os.urandom(4 * MIB))
    drop_cache(p)
    if pagecache.cached(p, 0, 4 * MIB).any():
        pytest.skip("this file system keeps the file's pages cached after POSIX_FADV_DONTNEED")
    with open(p, "rb") as f:
        if pagecache._cachestat_all(f.fileno(), range(0, 1)) is None:
            pytest.skip("no cachestat on this kernel (Linux 6.5+) or not for this caller")
        for _ in range(20):
            assert not pagecache.looks_cached(f.fileno(), 4 * MIB)
        assert not pagecache.cached(p, 0, 4 * MIB).any()  # nothing was read
        _warm(p)
        assert pagecache.looks_cached(f.fileno(), 4 * MIB)
        monkeypatch.setattr(pagecache, "_CACHESTAT_REFUSED", [True])  # without it: RWF_NOWAIT reads
        assert pagecache.looks_cached(f.fileno(), 4 * MIB)


def test_queue_is_bounded(tmp_path):
    p = tmp_path / "f.bin"
    p.write_bytes(bytes(MIB))
    w = mapahead._worker()
    with w.lock:
        w.pending += mapahead.MAX_PENDING  # as if that many were waiting
    try:
        assert not mapahead.map_ahead(_mapping(p), min_bytes=1)
    finally:
        with w.lock:
            w.pending -= mapahead.MAX_PENDING
            if not w.pending:
                w.idle.set()


def test_forked_child_starts_its_own_thread(tmp_path):
    p = tmp_path / "f.bin"
    p.write_bytes(os.urandom(2 * MIB))
    assert mapahead.map_ahead(_mapping(p), min_bytes=1) and mapahead.wait_map_ahead(30)
    pid = os.fork()
    if pid == 0:  # pragma: no cover - the child
        ok = False
        try:
            mm = _mapping(p)
            ok = mapahead.map_ahead(mm, min_bytes=1) and mapahead.wait_map_ahead(10)
            ok = ok and _mapped(mm) == 1.0
        finally:
            os._exit(0 if ok else 1)
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0
