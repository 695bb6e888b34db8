"""The default save writes on the calling thread while one more thread computes the CRC-32s
a few MiB ahead of it (issue 27: the CRC was ~30% of a flat save's time on the writing
thread). CRCs equal zlib's at edge sizes and across piece, span and group boundaries; the
threads, the bound on how far the hasher runs ahead, and errors on either thread."""

from __future__ import annotations

import os
import threading
import time
import zipfile
import zlib

import numpy as np
import pytest
import torch

import tdz_numba
from tdz_numba.zipfmt import packers
from tdz_numba.zipfmt import payload as payload_writer

PIECE, SPAN = payload_writer.PIECE, payload_writer.SPAN


@pytest.fixture
def fixed_time(monkeypatch):
    monkeypatch.setattr(packers, "dos_datetime", lambda timestamp=None: (0, 33))


def _tree() -> dict:
    """Edge sizes (0, 1, 63, 64, 65 bytes), entries of one byte either side of a piece and of a
    span, a span-crossing one at an odd offset, and groups of many small entries."""
    rng = np.random.default_rng(27)
    sizes = [0, 1, 63, 64, 65, PIECE - 1, PIECE, PIECE + 1, 3, SPAN - 1, SPAN + 1, 2 * SPAN + PIECE + 7]
    tree: dict = {f"e{i:02d}": rng.integers(0, 256, n, dtype=np.uint8) for i, n in enumerate(sizes)}
    tree["many"] = {f"l{i:04d}": rng.integers(0, 256, 1 + i % 700, dtype=np.uint8) for i in range(3000)}
    tree["text"] = "hello"
    return tree


def _leaves(tree: dict, prefix: str = "") -> dict[str, np.ndarray]:
    out: dict[str, np.ndarray] = {}
    for k, v in tree.items():
        if isinstance(v, dict):
            out.update(_leaves(v, prefix + k + "/"))
        elif isinstance(v, np.ndarray) and v.size:  # (an empty leaf has no payload entry)
            out[prefix + k + ".memmap"] = v
    return out


def _spy(monkeypatch, delay: float = 0.0) -> dict[str, list]:
    """Records the thread and bytes of every CRC-32 call and the thread of every payload write
    (each ``delay`` seconds slower), and how many payload bytes the CRCs had read beyond those
    written when each CRC call started."""
    seen: dict[str, list] = {"crc": [], "bytes": [], "write": [], "ahead": []}
    real_functions = payload_writer._crc_functions
    hashed, written = [0], [0]

    def functions():
        crc32, combine = real_functions()

        def crc(data, value=0):
            seen["crc"].append(threading.current_thread())
            seen["bytes"].append(memoryview(data).nbytes)
            seen["ahead"].append(hashed[0] - written[0])
            hashed[0] += memoryview(data).nbytes
            return crc32(data, value)

        return crc, combine

    real_pwrite, real_pwritev = os.pwrite, os.pwritev

    def pwrite(fd, data, offset):
        seen["write"].append(threading.current_thread())
        time.sleep(delay)
        n = real_pwrite(fd, data, offset)
        written[0] += n
        return n

    def pwritev(fd, bufs, offset):
        seen["write"].append(threading.current_thread())
        time.sleep(delay)
        n = real_pwritev(fd, bufs, offset)
        written[0] += n
        return n

    monkeypatch.setattr(payload_writer, "_crc_functions", functions)
    monkeypatch.setattr(os, "pwrite", pwrite)
    monkeypatch.setattr(os, "pwritev", pwritev)
    return seen


@pytest.fixture
def two_cores(monkeypatch):
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {0, 1})


@pytest.mark.parametrize("kw", [{}, {"align": "auto", "align_threshold": 1000}, {"align": 4096}])
def test_crcs_equal_zlib_at_edge_sizes_and_boundaries(fixed_time, two_cores, tmp_path, kw):
    tree = _tree()
    serial = tdz_numba.save(tree, tmp_path / "one.tdz", num_threads=1, durable=False, **kw)
    p = tdz_numba.save(tree, tmp_path / "default.tdz", durable=False, **kw)  # writer + hasher
    assert p.read_bytes() == serial.read_bytes()
    leaves = _leaves(tree)
    with zipfile.ZipFile(p) as z:
        assert z.testzip() is None  # every CRC-32 checked by the standard library
        for name, arr in leaves.items():
            info = z.getinfo(name)
            assert info.CRC == zlib.crc32(arr), name
            assert info.file_size == arr.size
        assert z.read("e11.memmap") == leaves["e11.memmap"].tobytes()
        names = z.namelist()
    assert tdz_numba.verify(p).entries == len(names)


def test_the_caller_writes_and_one_more_thread_hashes(two_cores, monkeypatch, tmp_path):
    tree = _tree()
    seen = _spy(monkeypatch, delay=0.003)  # (writes slower than the hasher, even on a busy machine)
    tdz_numba.save(tree, tmp_path / "x.tdz", durable=False)
    main = threading.main_thread()
    assert {t.name for t in seen["crc"]} <= {"MainThread", "tdz-save-crc"}
    on_hasher = sum(n for t, n in zip(seen["crc"], seen["bytes"]) if t is not main)
    assert on_hasher >= 0.9 * sum(
        seen["bytes"]
    )  # the CRCs on the hasher (the writer may take the first group)
    assert set(seen["write"]) == {main}  # every write on the caller
    # the hasher runs at most HASH_AHEAD_BYTES in front of the writer (plus the step it starts)
    assert max(seen["ahead"]) <= payload_writer.HASH_AHEAD_BYTES + PIECE
    assert max(seen["ahead"]) > payload_writer.HASH_AHEAD_BYTES // 2  # it did run ahead, near the bound
    assert not [t for t in threading.enumerate() if t.name == "tdz-save-crc"]  # joined


@pytest.mark.parametrize(
    "case",
    ["num_threads=1", "small", "one core"],
)
def test_no_hashing_thread_where_it_does_not_pay(case, two_cores, monkeypatch, tmp_path):
    kw: dict = {}
    tree = {"w": np.ones(payload_writer.HASHER_MIN_BYTES, np.uint8)}
    if case == "num_threads=1":
        kw["num_threads"] = 1
    elif case == "small":
        tree = {"w": np.ones(payload_writer.HASHER_MIN_BYTES - 4096, np.uint8)}  # (meta.json too)
    else:
        monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {0})
    seen = _spy(monkeypatch)
    p = tdz_numba.save(tree, tmp_path / "x.tdz", durable=False, **kw)
    assert set(seen["crc"]) == set(seen["write"]) == {threading.main_thread()}
    with zipfile.ZipFile(p) as z:
        assert z.getinfo("w.memmap").CRC == zlib.crc32(tree["w"])


def test_write_threads_default_is_hash_ahead():
    assert payload_writer.write_threads(None) == payload_writer.HASH_AHEAD
    assert [payload_writer.write_threads(k) for k in (1, 2, 4, 9)] == [1, 2, 4, 4]


def test_an_error_in_the_hashing_thread_reaches_the_caller(two_cores, tmp_path, monkeypatch):
    target = tmp_path / "x.tdz"
    tdz_numba.save({"old": torch.ones(3)}, target)
    before = target.read_bytes()
    real_functions = payload_writer._crc_functions
    where = []

    def functions():
        crc32, combine = real_functions()

        def crc(data, value=0):
            if memoryview(data).nbytes == PIECE:  # a piece of the large leaf
                where.append(threading.current_thread().name)
                raise MemoryError("hasher failed")
            return crc32(data, value)

        return crc, combine

    real_pwrite = os.pwrite

    def slow_pwrite(fd, data, offset):  # the hasher stays ahead of the writer
        time.sleep(0.01)
        return real_pwrite(fd, data, offset)

    monkeypatch.setattr(payload_writer, "_crc_functions", functions)
    monkeypatch.setattr(os, "pwrite", slow_pwrite)
    with pytest.raises(MemoryError, match="hasher failed"):
        tdz_numba.save({"w": torch.randn(16 << 20 >> 2)}, target, durable=False)
    assert where == ["tdz-save-crc"]
    assert target.read_bytes() == before
    assert not [n for n in os.listdir(tmp_path) if ".tdz-tmp." in n]
    assert not [t for t in threading.enumerate() if t.name == "tdz-save-crc"]


def test_an_error_of_the_writer_stops_the_hasher(two_cores, tmp_path, monkeypatch):
    target = tmp_path / "x.tdz"
    tdz_numba.save({"old": torch.ones(3)}, target)
    before = target.read_bytes()
    real = os.pwrite
    calls = []

    def failing(fd, data, offset):
        calls.append(offset)
        if len(calls) == 3:
            time.sleep(0.05)  # the hasher reaches its bound and waits for the writer
            raise OSError(28, "No space left on device")
        return real(fd, data, offset)

    monkeypatch.setattr(os, "pwrite", failing)
    with pytest.raises(tdz_numba.DiskFullError):
        tdz_numba.save({"w": torch.randn(64 << 20 >> 2)}, target, durable=False)
    monkeypatch.undo()
    assert len(calls) == 3 and target.read_bytes() == before
    assert not [n for n in os.listdir(tmp_path) if ".tdz-tmp." in n]
    assert not [t for t in threading.enumerate() if t.name == "tdz-save-crc"]


def test_digests_with_the_hashing_thread(fixed_time, two_cores, tmp_path):
    xxhash = pytest.importorskip("xxhash")
    tree = _tree()
    p = tdz_numba.save(tree, tmp_path / "x.tdz", durable=False, digest=True)
    one = tdz_numba.save(tree, tmp_path / "one.tdz", durable=False, digest=True, num_threads=1)
    assert p.read_bytes() == one.read_bytes()
    with tdz_numba.open(p) as ar:
        for key in ("e01", "e02", "e07", "e10", "e11", "many/l2999"):
            arr = tree[key] if "/" not in key else tree["many"][key.split("/")[1]]
            assert ar.info(key).digest == xxhash.xxh3_128_hexdigest(arr.tobytes()), key


def test_the_writer_hashes_what_a_slow_hasher_has_not_reached(fixed_time, two_cores, monkeypatch, tmp_path):
    """A hasher that falls behind (another process on the second core): the archive is the same
    and every entry is hashed once, the writer hashing what it reaches first."""
    tree = _tree()
    expected = tdz_numba.save(tree, tmp_path / "one.tdz", num_threads=1, durable=False).read_bytes()
    real_functions = payload_writer._crc_functions
    calls: list[tuple[str, int]] = []

    def functions():
        crc32, combine = real_functions()

        def crc(data, value=0):
            name = threading.current_thread().name
            if name == "tdz-save-crc":
                time.sleep(0.02)  # descheduled
            calls.append((name, memoryview(data).nbytes))
            return crc32(data, value)

        return crc, combine

    monkeypatch.setattr(payload_writer, "_crc_functions", functions)
    p = tdz_numba.save(tree, tmp_path / "slow.tdz", durable=False)
    assert p.read_bytes() == expected
    by = {name for name, _ in calls}
    assert "MainThread" in by and by <= {"MainThread", "tdz-save-crc"}  # (the split: below)
    with zipfile.ZipFile(p) as z:
        assert z.testzip() is None
        every = sum(info.file_size for info in z.infolist())  # payloads and meta.json files
    assert sum(n for _, n in calls) == every  # each entry's bytes hashed once


def test_a_stalled_hasher_leaves_every_other_step_to_the_writer():
    """Deterministic (the CI's slow disk once let a hasher slowed by sleeps keep up): the hasher
    stalls inside its first piece until the writer has written every step; the writer then hashes
    every other piece and every group the hasher had not claimed, each step exactly once, and
    writes them all in order."""
    grouped = [True, True, False, False, False, True, False, False, True, False, False, False]
    n = len(grouped)
    sizes = [100 if g else PIECE for g in grouped]
    written_all = threading.Event()
    hashed: list[tuple[str, int]] = []
    writes: list[int] = []
    stalled = []

    def hash_step(j: int) -> None:
        name = threading.current_thread().name
        if name == "tdz-save-crc" and not grouped[j] and not stalled:
            stalled.append(j)
            assert written_all.wait(10)  # (a writer that never steals would leave this to time out)
        hashed.append((name, j))

    def write_step(j: int) -> int:
        writes.append(j)
        if j == n - 1:
            written_all.set()
        return sizes[j]

    accounted: list[int] = []
    payload_writer._write_behind_hasher(sizes, grouped, [True] * n, hash_step, write_step, accounted.append)
    assert writes == list(range(n)) and accounted == sizes
    assert sorted(j for _, j in hashed) == list(range(n))  # each step once
    pieces_by_hasher = [j for name, j in hashed if name == "tdz-save-crc" and not grouped[j]]
    assert pieces_by_hasher == stalled  # the one it stalled in, or none (it started late)
    by_writer = {j for name, j in hashed if name == "MainThread"}
    assert by_writer >= {j for j in range(n) if not grouped[j]} - set(stalled)
    assert by_writer >= {j for j in range(n) if grouped[j] and (not stalled or j > stalled[0])}
