"""Reads that leave the page cache as they found it (files.pagecache), and loads whose mappings are
advised for reading the whole file (files.loadadvice.whole_file_mappings): behaviour, not timing."""

from __future__ import annotations

import errno
import gc
import mmap
import os
from pathlib import Path

import numpy as np
import pytest
import torch
from smaps import vm_flags

import tdz_numba
from tdz_numba.bench.harness import drop_cache
from tdz_numba.files import loadadvice, mapahead, memory, pagecache
from tdz_numba.zipfmt.index import ArchiveIndex

PAGE = mmap.PAGESIZE
NOWAIT = getattr(os, "RWF_NOWAIT", 0)


def _oracle(path, offsets, sizes) -> bytes:
    """The slow obvious reference: one plain pread per piece, zeros past the end."""
    fd = os.open(path, os.O_RDONLY)
    try:
        return b"".join(os.pread(fd, n, o).ljust(n, b"\0") for o, n in zip(offsets, sizes))
    finally:
        os.close(fd)


def _drop(path) -> None:
    drop_cache(Path(path))  # the benchmarks' own: fsync, then POSIX_FADV_DONTNEED


def _dropped_or_skip(path) -> None:
    """Drops ``path`` from the page cache; skips where the file system keeps it (tmpfs) or the
    kernel does not say (mincore)."""
    _drop(path)
    try:
        left = pagecache.cached(path, 0, os.path.getsize(path))
    except tdz_numba.TdzError as exc:  # pragma: no cover - a platform without mincore
        pytest.skip(f"no page-cache residency here: {exc}")
    if left.any():
        pytest.skip("this file system keeps the file's pages cached after POSIX_FADV_DONTNEED")


def _drops_or_skip(tmp_path) -> None:
    """Skips where this kernel keeps a page that a plain read just brought in after
    ``POSIX_FADV_DONTNEED`` of it (read-ahead off, nothing mapped): :func:`pagecache.read_pieces`
    asks for that drop, and the residency checks below test what the kernel then did. (CI's
    machine kept such pages on every try; where the kernel drops them, code that asks nothing
    fails these tests.)"""
    probe = tmp_path / "probe.bin"
    probe.write_bytes(os.urandom(4 * PAGE))
    _dropped_or_skip(probe)
    fd = os.open(probe, os.O_RDONLY)
    try:
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_RANDOM)
        if NOWAIT:  # (as read_pieces: a miss asked without waiting first, then read)
            try:
                os.preadv(fd, [bytearray(10)], PAGE + 5, NOWAIT)
            except OSError:
                pass
        os.pread(fd, 10, PAGE + 5)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_NORMAL)
        os.posix_fadvise(fd, PAGE, PAGE, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)
    if pagecache.cached(probe, 0, 4 * PAGE).any():
        pytest.skip("this kernel keeps a page just read after POSIX_FADV_DONTNEED of it")


def _read(path, offsets, sizes) -> bytearray:
    fd = os.open(path, os.O_RDONLY)
    try:
        return pagecache.read_pieces(fd, offsets, sizes)
    finally:
        os.close(fd)


@pytest.mark.parametrize("nowait", [True, False])
def test_read_pieces_matches_plain_pread(tmp_path, monkeypatch, nowait):
    if not nowait:  # a kernel without RWF_NOWAIT: plain reads, the same bytes
        monkeypatch.setattr(pagecache, "_NOWAIT", None)
    rng = np.random.default_rng(7)
    size = 5 * PAGE + 123
    path = tmp_path / "f.bin"
    path.write_bytes(rng.integers(0, 256, size, dtype=np.uint8).tobytes())
    offsets = [0, 1, PAGE - 2, 3 * PAGE, size - 5, size - 1, size, size + 10, 7, 2 * PAGE + 5]
    sizes = [1, 0, 30, PAGE + 7, 5, 40, 3, 8, 0, 2 * PAGE]
    assert bytes(_read(path, offsets, sizes)) == _oracle(path, offsets, sizes)
    _drop(path)  # the same from a cold file
    assert bytes(_read(path, offsets, sizes)) == _oracle(path, offsets, sizes)
    assert _read(path, [], []) == bytearray()


def test_read_pieces_where_the_file_refuses_nowait(tmp_path, monkeypatch):

    path = tmp_path / "f.bin"
    path.write_bytes(os.urandom(3 * PAGE))
    real = os.preadv
    calls = []

    def refusing(fd, bufs, off, *flags):
        calls.append(flags)
        if flags and flags[0]:
            raise OSError(errno.EOPNOTSUPP, "no RWF_NOWAIT here")
        return real(fd, bufs, off)

    monkeypatch.setattr(pagecache, "_NOWAIT_REFUSED", [])
    monkeypatch.setattr(os, "preadv", refusing)
    offsets, sizes = [10, PAGE - 3, 2 * PAGE], [5, 9, PAGE]
    assert bytes(_read(path, offsets, sizes)) == _oracle(path, offsets, sizes)
    assert bytes(_read(path, offsets, sizes)) == _oracle(path, offsets, sizes)
    assert sum(1 for f in calls if f and f[0]) == 1  # asked once, then plain reads


def test_read_pieces_where_the_file_takes_no_advice(tmp_path, monkeypatch):

    path = tmp_path / "f.bin"
    path.write_bytes(os.urandom(3 * PAGE))

    def refusing(fd, offset, length, advice):
        raise OSError(errno.EINVAL, "no advice here")

    monkeypatch.setattr(os, "posix_fadvise", refusing)
    offsets, sizes = [10, PAGE - 3, 2 * PAGE], [5, 9, PAGE]
    assert bytes(_read(path, offsets, sizes)) == _oracle(path, offsets, sizes)


@pytest.mark.skipif(NOWAIT is None, reason="no RWF_NOWAIT on this platform")
def test_read_pieces_asks_every_piece_before_waiting(tmp_path, monkeypatch):
    """Every piece of some bytes asked with RWF_NOWAIT first, in order (one ``map`` over them),
    then only the misses read plainly; a page cached before is not read again plainly."""
    path = tmp_path / "f.bin"
    path.write_bytes(os.urandom(32 * PAGE))
    offsets = [2 * PAGE + 100, 9 * PAGE + 40, 4 * PAGE - 10, 20 * PAGE, 9 * PAGE + 50, 31 * PAGE + 4000, 7]
    sizes = [50, 30, 20, 60, 10, 500, 0]  # (4 * PAGE - 10: two pages; then past the end; no bytes)
    real = os.preadv
    seen: list[tuple[bool, int]] = []

    def preadv(fd, bufs, offset, *flags):
        seen.append((bool(flags and flags[0] & NOWAIT), offset))
        return real(fd, bufs, offset, *flags)

    _dropped_or_skip(path)
    fd = os.open(path, os.O_RDONLY)
    try:
        os.pread(fd, 10, 9 * PAGE + 5)  # page 9 cached before (and what read-ahead brings)
        before = pagecache.cached(path, 0, 32 * PAGE)
        monkeypatch.setattr(os, "preadv", preadv)
        got = pagecache.read_pieces(fd, offsets, sizes)
        monkeypatch.undo()
    finally:
        os.close(fd)
    assert bytes(got) == _oracle(path, offsets, sizes)
    first = seen[: len(offsets) - 1]
    assert first == [(True, o) for o in offsets[:-1]]  # every piece of some bytes, in order
    waits = [o for nowait, o in seen[len(first) :]]
    assert all(not nowait for nowait, _ in seen[len(first) :])
    assert 9 * PAGE + 40 not in waits and 9 * PAGE + 50 not in waits  # (cached: read at once)
    # only a piece with a page not cached before is waited for; it may also come at once: its
    # RWF_NOWAIT read starts the kernel's read-ahead, which a fast device can finish within that
    # call (seen in CI). The wait after EAGAIN is pinned by the refused/EAGAIN tests below.
    uncached = [
        (o, n)
        for o, n in zip(offsets, sizes)
        if n and not all(before[p] for p in range(o // PAGE, min(32, -(-(o + n) // PAGE))))
    ]
    assert all(any(o <= w < o + n for o, n in uncached) for w in waits)


def test_read_pieces_refused_after_a_miss_drops_only_the_misses_before(tmp_path, monkeypatch):
    """A file that answers EAGAIN for the first piece and refuses the flag at the second: the first
    is read and its pages dropped, the rest read plainly."""
    path = tmp_path / "f.bin"
    path.write_bytes(os.urandom(8 * PAGE))
    real = os.preadv
    state = {"n": 0}

    def flaky(fd, bufs, off, *flags):
        if flags and flags[0]:
            state["n"] += 1
            raise (BlockingIOError() if state["n"] == 1 else OSError(errno.EINVAL, "no RWF_NOWAIT"))
        return real(fd, bufs, off)

    drops = []
    real_drop = pagecache.drop_pages
    monkeypatch.setattr(pagecache, "_NOWAIT_REFUSED", [])
    monkeypatch.setattr(os, "preadv", flaky)
    monkeypatch.setattr(
        pagecache, "drop_pages", lambda fd, pages: drops.append(list(pages)) or real_drop(fd, pages)
    )
    offsets, sizes = [PAGE + 10, 5 * PAGE, 6 * PAGE + 1], [20, 30, 40]
    assert bytes(_read(path, offsets, sizes)) == _oracle(path, offsets, sizes)
    assert drops == [[(1, 2)]]


def _asked_drops(monkeypatch) -> list[int]:
    """``os.posix_fadvise`` recording every page that a ``POSIX_FADV_DONTNEED`` names."""
    real = os.posix_fadvise
    pages: list[int] = []

    def fadvise(fd, offset, length, advice):
        if advice == os.POSIX_FADV_DONTNEED:
            pages.extend(range(offset // PAGE, -(-(offset + length) // PAGE)))
        return real(fd, offset, length, advice)

    monkeypatch.setattr(os, "posix_fadvise", fadvise)
    return pages


def _settled(attempt) -> None:
    """Runs ``attempt()`` up to three times, until it returns None: ``attempt`` asserts what our
    code asked of the kernel (hard: code that asks nothing fails every try) and returns a message
    where the page cache then differs from what the asks should give. That part is the kernel's:
    its read-ahead may bring pages in large folios that a drop of exact pages cannot split, and a
    page just read may be kept (CI's machine kept them on every try); after three tries it skips."""
    why = None
    for _ in range(3):
        why = attempt()
        if why is None:
            return
    pytest.skip(f"the kernel's page cache did not follow the asks: {why}")


def test_read_pieces_drops_only_what_it_brought_in(tmp_path, monkeypatch):
    path = tmp_path / "f.bin"
    path.write_bytes(os.urandom(16 * PAGE))
    offsets, sizes = [2 * PAGE + 100, 9 * PAGE + 40, 4 * PAGE - 10], [50, 30, 20]
    _drops_or_skip(tmp_path)

    def attempt() -> str | None:
        _dropped_or_skip(path)
        fd = os.open(path, os.O_RDONLY)
        try:
            os.pread(fd, 10, 9 * PAGE + 5)  # page 9 cached before (with whatever read-ahead brings)
            before = pagecache.cached(path, 0, 16 * PAGE)
            asked = _asked_drops(monkeypatch)
            real, missed = os.preadv, []

            def preadv(fd, bufs, offset, *flags):  # records the pieces RWF_NOWAIT missed
                try:
                    return real(fd, bufs, offset, *flags)
                except BlockingIOError:
                    missed.append(offset)
                    raise

            monkeypatch.setattr(os, "preadv", preadv)
            got = pagecache.read_pieces(fd, offsets, sizes)
            monkeypatch.undo()
        finally:
            os.close(fd)
        after = pagecache.cached(path, 0, 16 * PAGE)
        assert bytes(got) == _oracle(path, offsets, sizes)  # (after the look: the oracle caches)
        assert before[9] and 9 not in asked  # cached before: kept
        brought = {
            p for o, n in zip(offsets, sizes) if o in missed for p in range(o // PAGE, -(-(o + n) // PAGE))
        }
        if not brought:  # (the kernel's read-ahead of page 9 brought every piece in first)
            return "every piece was cached before it was read"
        assert set(asked) == brought  # the misses' pages dropped, no other page
        if not np.array_equal(after, before):
            return f"page cache before {np.flatnonzero(before)}, after {np.flatnonzero(after)}"
        return None

    _settled(attempt)


def _spaced_archive(tmp_path, n=8, leaf_bytes=64 * 1024):
    tree = {f"w{i}": torch.full((leaf_bytes // 4,), float(i)) for i in range(n)}
    return tdz_numba.save(tree, tmp_path / "spaced.tdz"), tree


def test_load_leaves_header_pages_uncached(tmp_path, monkeypatch):
    """A whole load reads every local header with pread (far apart: >= PREAD_SPACING per entry);
    the header pages that were not cached are not cached after it (the old reads left them)."""
    path, tree = _spaced_archive(tmp_path)
    _dropped_or_skip(path)
    _drops_or_skip(tmp_path)
    index = ArchiveIndex(path)
    headers = [index.row_at(index.row(f"w{i}.memmap")).header_offset for i in range(8)]
    index.close()
    _drop(path)  # (the open read the tail)
    back = tdz_numba.load(path)
    for k, v in tree.items():
        assert torch.equal(back[k], v)  # (values read through the mapping after the check)
    del back  # (pages a mapping holds stay cached)
    gc.collect()
    _drop(path)
    size = os.path.getsize(path)
    tail = (size - 64 * 1024) // PAGE  # the open reads the file's tail (central directory)
    # (and format detection its first bytes: page 0)
    pages = sorted({h // PAGE for h in headers if 0 < h // PAGE < tail})
    assert len(pages) >= 6

    tries = iter(range(3))

    def attempt() -> str | None:
        fresh = tmp_path / f"copy{next(tries)}.tdz"  # (a new file: no mapping of an earlier load)
        fresh.write_bytes(path.read_bytes())
        _drop(fresh)
        asked = _asked_drops(monkeypatch)
        back = tdz_numba.load(fresh)  # the check alone, nothing touched
        monkeypatch.undo()
        cached = pagecache.cached(fresh, 0, size)
        del back
        if not set(pages) <= set(asked):  # (a page the kernel's read-ahead brought first is kept)
            return f"header pages not asked to drop: {sorted(set(pages) - set(asked))}"
        if cached[pages].any():
            return f"header pages left cached: {np.array(pages)[cached[pages]]}"
        return None

    _settled(attempt)


def test_load_keeps_cached_header_pages(tmp_path):
    path, _ = _spaced_archive(tmp_path)
    _dropped_or_skip(path)
    index = ArchiveIndex(path)
    first = index.row_at(index.row("w0.memmap")).header_offset
    index.close()
    _drop(path)
    fd = os.open(path, os.O_RDONLY)
    try:
        os.pread(fd, 30, first)  # someone else read it: it stays
    finally:
        os.close(fd)
    tdz_numba.load(path)
    assert pagecache.cached(path, first, 30).all()


needs_smaps = pytest.mark.skipif(
    not os.path.exists("/proc/self/smaps") or not hasattr(mmap, "MADV_HUGEPAGE"),
    reason="Linux /proc/self/smaps and MADV_HUGEPAGE",
)


@needs_smaps
def test_load_views_map_for_the_whole_file(tmp_path):
    from safetensors.torch import save_file

    path, tree = _spaced_archive(tmp_path, n=3)
    back = tdz_numba.load(path)
    assert "hg" in vm_flags(back["w0"].data_ptr())  # a load: 2 MiB folios, any touch order
    st = tmp_path / "x.safetensors"
    save_file({"a": torch.ones(1000), "b": torch.zeros(64)}, str(st))
    other = tdz_numba.load(st)
    assert "hg" in vm_flags(other["a"].data_ptr())
    assert torch.equal(other["a"], torch.ones(1000))


@needs_smaps
def test_lazy_open_and_copy_keep_default_read_around(tmp_path):
    path, tree = _spaced_archive(tmp_path, n=3)
    with tdz_numba.open(path) as ar:  # a lazy open reads a small part: the kernel's read-around
        assert "hg" not in vm_flags(ar["w1"].data_ptr())
    owned = tdz_numba.load(path, copy=True)
    assert torch.equal(owned["w2"], tree["w2"])
    shared = tdz_numba.load(path, mode="r+")
    assert "hg" not in vm_flags(shared["w0"].data_ptr())
    part = tdz_numba.load(path, keys=["w1"])  # a part of the file: the kernel's read-around
    assert "hg" not in vm_flags(part["w1"].data_ptr())


def test_whole_file_mappings_scope(tmp_path):
    path = tmp_path / "f.bin"
    path.write_bytes(bytes(4 * PAGE))
    forward = np.array([0, PAGE, 2 * PAGE], np.int64)
    huge = hasattr(mmap, "MADV_HUGEPAGE")
    _dropped_or_skip(path)  # (cached, the read now would be skipped)
    with open(path, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as mm:
        assert loadadvice.advise_whole_file(mm, forward[::-1]) is False
        assert memory.resident(mm, 0, 4 * PAGE) == 0.0  # outside a load: nothing read
        with loadadvice.whole_file_mappings():
            assert loadadvice.whole_file_load()
            assert loadadvice.advise_whole_file(mm, forward) is huge
            assert memory.resident(mm, 0, 4 * PAGE) == 0.0  # read forward: the faults stream
            assert loadadvice.advise_whole_file(None, forward) is False
            if huge and memory._populate_supported():
                assert loadadvice.advise_whole_file(mm, forward[::-1]) is True  # backwards: read now
                assert memory.resident(mm, 0, 4 * PAGE) == 1.0
        assert not loadadvice.whole_file_load()


def test_in_file_order_counts_the_steps_back():
    ahead = np.arange(0, 65 * 64, 64, dtype=np.int64)  # 65 leaves: 64 steps, 2 may go back
    assert loadadvice.in_file_order(ahead)
    assert loadadvice.in_file_order(ahead[:0]) and loadadvice.in_file_order(ahead[:1])
    two_back = ahead.copy()
    two_back[[10, 40]] = 0  # two leaves sharing the first one's bytes (tied weights): 2 steps back
    assert loadadvice.in_file_order(two_back)
    three_back = two_back.copy()
    three_back[50] = 0
    assert not loadadvice.in_file_order(three_back)
    assert not loadadvice.in_file_order(np.array([64, 0], np.int64))  # one step, back
    sizes = np.full(65, 64, np.int64)
    sizes[[10, 40, 50]] = 0  # empty leaves: where they say they start is not read
    assert loadadvice.in_file_order(three_back, sizes)
    rng = np.random.default_rng(0)
    assert not loadadvice.in_file_order(rng.permutation(ahead))


def _present(address: int, nbytes: int) -> float:
    """The share of the pages of ``[address, address + nbytes)`` mapped in this process."""
    first, last = address // PAGE, (address + nbytes - 1) // PAGE
    with open("/proc/self/pagemap", "rb") as f:
        f.seek(8 * first)
        entries = np.frombuffer(f.read(8 * (last - first + 1)), np.uint64)
    return float(np.count_nonzero(entries >> np.uint64(63))) / entries.size


@needs_smaps
@pytest.mark.parametrize("order", ["by_name", "reversed"])
def test_load_reads_forward_files_it_lists_out_of_order(tmp_path, order):
    """A .tdz's payloads lie by name (tensordict's order): a tree saved in another key order
    is listed by a load in that order, which jumps back through the file: a load of it cold
    reads the file forward itself (its pages mapped when it returns); in order, the views
    fault in as they are touched; cached, another core maps them (``files.mapahead``)."""
    names = [f"w{i:02d}" for i in range(40)]
    if order == "reversed":
        names = names[::-1]
    tree = {k: torch.full((1 << 18,), float(i)) for i, k in enumerate(names)}  # 1 MiB each
    path = tdz_numba.save(tree, tmp_path / "x.tdz")
    h5py = pytest.importorskip("h5py")
    h5 = tmp_path / "x.h5"
    with h5py.File(h5, "w") as f:  # datasets in creation order, listed by name
        for k in names:  # the headers first, then the data (so that reading them reads no data
            f.create_dataset(k, shape=(1 << 18,), dtype="f4")  # around: read_ahead_kb may be MiBs)
        for k in names:
            f[k][...] = tree[k].numpy()
    read_now = order == "reversed" and memory._populate_supported()
    for file, first in ((path, names[0]), (h5, "w00")):
        warm = tdz_numba.load(file)  # (just written: cached: mapped ahead on another core)
        assert "hg" in vm_flags(warm[first].data_ptr())
        assert mapahead.wait_map_ahead(30)
        ahead = mapahead.map_ahead_on(file.stat().st_size)
        assert _present(warm["w05"].data_ptr(), 1 << 20) == (1.0 if ahead else 0.0)
        del warm
        gc.collect()
        _dropped_or_skip(file)
        back = tdz_numba.load(file)
        assert list(back) == (names if file == path else sorted(names))
        assert "hg" in vm_flags(back[first].data_ptr())
        assert _present(back["w05"].data_ptr(), 1 << 20) == (1.0 if read_now else 0.0)
        assert all(torch.equal(back[k], tree[k]) for k in names)
