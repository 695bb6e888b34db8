"""A lazy open of a file whose headers lie far apart reads only the pages those headers are in
(``files/scanadvice.py``: ``MADV_RANDOM`` while the opener scans, the default after); a file whose
headers lie close together keeps the kernel's read-around."""

from __future__ import annotations

import mmap
import os
from pathlib import Path

import numpy as np
import pytest
import torch
from smaps import vm_flags

import tdz_numba
from tdz_numba.bench.harness import drop_cache
from tdz_numba.files import loadadvice, pagecache, scanadvice
from tdz_numba.tdz.sources import MappedFile

PAGE = mmap.PAGESIZE

needs_smaps = pytest.mark.skipif(
    not os.path.exists("/proc/self/smaps") or not hasattr(mmap, "MADV_RANDOM"),
    reason="Linux /proc/self/smaps and MADV_RANDOM",
)


def test_mean_spacing_against_sorted_gaps():
    rng = np.random.default_rng(5)
    for n in (2, 3, 17, 500):
        offsets = rng.integers(0, 1 << 40, n)  # (offsets past 4 GiB: plain int64 arithmetic)
        gaps = np.diff(np.sort(offsets))
        assert scanadvice.mean_spacing(offsets, 1 << 41) == pytest.approx(float(gaps.mean()))
    assert scanadvice.mean_spacing(np.array([123], np.int64), 999) == 999.0
    assert scanadvice.mean_spacing(np.zeros(0, np.int64), 64) == 64.0


def _mapped(tmp_path: Path, nbytes: int) -> MappedFile:
    p = tmp_path / f"f{nbytes}.bin"
    with open(p, "wb") as f:
        f.truncate(nbytes)
    return MappedFile.open(p)


@needs_smaps
def test_header_scan_advises_large_files_until_it_learns_they_are_dense(tmp_path):
    big = _mapped(tmp_path, scanadvice.SMALL_FILE)
    small = _mapped(tmp_path, scanadvice.SMALL_FILE - PAGE)
    try:
        at = big.buffer.ctypes.data
        assert "rr" not in vm_flags(at)
        with scanadvice.header_scan(big) as scan:
            assert scan.active and "rr" in vm_flags(at)
            scan.decide(scanadvice.SPARSE_SPACING - 1.0)  # dense: the default read-around
            assert not scan.active and "rr" not in vm_flags(at)
            scan.decide(float(scanadvice.SPARSE_SPACING))
            assert scan.active and "rr" in vm_flags(at)
        assert "rr" not in vm_flags(at)  # the leaves' own reads: the default again
        with scanadvice.header_scan(small) as scan:  # read whole by the default in a few requests
            assert not scan.active and "rr" not in vm_flags(small.buffer.ctypes.data)
        with loadadvice.whole_file_mappings():
            with scanadvice.header_scan(big, in_load=False) as scan:
                assert not scan.active and "rr" not in vm_flags(at)
            with scanadvice.header_scan(big) as scan:
                assert scan.active
        big.remote = True  # (a remote file's mapping is its own anonymous memory: nothing to read)
        with scanadvice.header_scan(big) as scan:
            assert not scan.active
        with scanadvice.header_scan(None) as scan:
            assert not scan.active
    finally:
        big.close()
        small.close()


def test_header_scan_of_a_closed_mapping_raises_nothing():
    class Closed:  # a file whose mapping was closed under the scan: advice only, nothing raised
        size = scanadvice.SMALL_FILE
        _mmap = mmap.mmap(-1, PAGE)

    Closed._mmap.close()
    with scanadvice.header_scan(Closed()) as scan:
        scan.decide(0.0)
    assert not scan.active


# -- the openers: far-apart headers read page by page, close ones read around -----------------

LEAVES = 12  # of 2 MiB each: 24 MiB files, headers ~2 MiB apart


def _tensors(n: int, numel: int) -> dict[str, np.ndarray]:
    return {f"layer{i:02d}.weight": np.full(numel, i + 0.5, np.float32) for i in range(n)}


def _write(fmt: str, tensors: dict[str, np.ndarray], path: Path) -> None:
    if fmt == "npz":
        np.savez(path, **tensors)
    elif fmt == "onnx":
        onnx = pytest.importorskip("onnx")
        from onnx import helper, numpy_helper

        inits = [numpy_helper.from_array(v, k) for k, v in tensors.items()]
        onnx.save(helper.make_model(helper.make_graph([], "g", [], [], initializer=inits)), str(path))
    else:
        h5py = pytest.importorskip("h5py")
        with h5py.File(path, "w") as f:
            for k, v in tensors.items():
                f[k] = v


SUFFIX = {"npz": ".npz", "onnx": ".onnx", "hdf5": ".h5"}


def _scanner_spy(monkeypatch, fmt: str, seen: list[bool]) -> None:
    """Records, each time ``fmt``'s opener scans headers through the mapping, whether the
    mapping then reads page by page (``rr`` in its VmFlags)."""
    if fmt == "npz":
        from tdz_numba.formats import numpy_fmt as mod

        name, arg = "_headers", 0
    elif fmt == "onnx":
        from tdz_numba.formats import onnx_scan as mod

        name, arg = "scan_graph", 0
    else:
        from tdz_numba.formats import hdf5_walk as mod

        name, arg = "scan_datasets", 0
    real = getattr(mod, name)

    def spy(*args, **kw):
        buf = args[arg]
        seen.append("rr" in vm_flags(np.frombuffer(buf, np.uint8).ctypes.data))
        return real(*args, **kw)

    monkeypatch.setattr(mod, name, spy)


@needs_smaps
@pytest.mark.parametrize("fmt", ["npz", "onnx", "hdf5"])
def test_lazy_open_of_far_apart_headers_reads_only_their_pages(tmp_path, monkeypatch, fmt):
    tensors = _tensors(LEAVES, 1 << 19)
    path = tmp_path / f"m{SUFFIX[fmt]}"
    _write(fmt, tensors, path)
    size = path.stat().st_size
    assert size >= scanadvice.SMALL_FILE
    drop_cache(path)
    if pagecache.cached(path, 0, size).any():
        pytest.skip("this file system keeps the file's pages cached after POSIX_FADV_DONTNEED")
    seen: list[bool] = []
    _scanner_spy(monkeypatch, fmt, seen)
    with tdz_numba.open(path) as ar:
        assert sorted(ar.keys()) == sorted(tensors)
        read = int(pagecache.cached(path, 0, size).sum())
        leaf = ar["layer07.weight"]
        assert "rr" not in vm_flags(leaf.data_ptr())  # the leaves' reads: the default read-around
        assert torch.equal(leaf, torch.from_numpy(tensors["layer07.weight"]))
    # the headers' pages and the file's ends, not read-around of each (the default here reads
    # read_ahead_kb, 128 KiB-8 MiB, around every header: 1.5-24 MiB of these 24)
    assert read * PAGE <= (512 << 10), f"{fmt}: the lazy open read {read * PAGE >> 10} KiB"
    assert seen and all(seen)  # every scan through the mapping read page by page


@needs_smaps
@pytest.mark.parametrize("fmt", ["npz", "onnx", "hdf5"])
def test_close_headers_keep_the_default_read_around(tmp_path, monkeypatch, fmt):
    n = 1700 if fmt != "hdf5" else 1100  # 10-16 KiB apart, 17 MiB
    tensors = _tensors(n, 2560 if fmt != "hdf5" else 4096)
    path = tmp_path / f"d{SUFFIX[fmt]}"
    _write(fmt, tensors, path)
    assert path.stat().st_size >= scanadvice.SMALL_FILE
    seen: list[bool] = []
    _scanner_spy(monkeypatch, fmt, seen)
    back = tdz_numba.load(path)
    if fmt == "onnx":  # (its first initializers, read page by page, told how far apart they lie)
        assert seen[0] and len(seen) == 2
        del seen[0]
    assert seen and not any(seen)  # dense: one synchronous read per header would cost more
    assert len(back) == n and torch.equal(back["layer33.weight"], torch.from_numpy(tensors["layer33.weight"]))
    seen.clear()
    with tdz_numba.open(path) as ar:
        assert len(ar.keys()) == n
    assert seen and not any(seen[1:] if fmt == "onnx" else seen)


@needs_smaps
def test_whole_file_load_of_hdf5_keeps_default_advice_while_scanning(tmp_path, monkeypatch):
    tensors = _tensors(LEAVES, 1 << 19)
    path = tmp_path / "m.h5"
    _write("hdf5", tensors, path)
    seen: list[bool] = []
    _scanner_spy(monkeypatch, "hdf5", seen)
    back = tdz_numba.load(path)  # (its load reads the whole file forward: see header_scan)
    assert seen and not any(seen)
    assert torch.equal(back["layer03.weight"], torch.from_numpy(tensors["layer03.weight"]))
    seen.clear()
    npz = tmp_path / "m.npz"
    _write("npz", tensors, npz)
    _scanner_spy(monkeypatch, "npz", seen)
    assert torch.equal(tdz_numba.load(npz)["layer03.weight"], back["layer03.weight"])
    assert seen and all(seen)  # (.npz, ONNX: their loads too)


@needs_smaps
@pytest.mark.parametrize("kernels", ["always", "never"])
@pytest.mark.parametrize("apart", [1 << 20, 10 << 10])
def test_onnx_scan_decides_from_its_first_initializers(tmp_path, monkeypatch, kernels, apart):
    """More initializers than the probe: the first :data:`PROBE` read page by page, the rest as
    their spacing says, with the kernel (probe, then the whole graph) and without (its twin)."""
    pytest.importorskip("onnx")
    from tdz_numba.formats import onnx_bulk, onnx_scan
    from tdz_numba.jit import policy

    n = -(-scanadvice.SMALL_FILE // apart) + 1
    tensors = _tensors(n, apart // 4)
    path = tmp_path / "m.onnx"
    _write("onnx", tensors, path)
    seen: list[bool] = []
    mod, name = (onnx_scan, "scan_graph") if kernels == "always" else (onnx_bulk, "compact_tensor")
    real = getattr(mod, name)

    def spy(*args, **kw):
        buf = args[0]
        seen.append("rr" in vm_flags(np.frombuffer(buf, np.uint8).ctypes.data))
        return real(*args, **kw)

    monkeypatch.setattr(mod, name, spy)
    with policy.forced(kernels), tdz_numba.open(path) as ar:
        assert len(ar.keys()) == n
        assert torch.equal(ar["layer05.weight"], torch.from_numpy(tensors["layer05.weight"]))
    probe = onnx_bulk.PROBE
    if kernels == "always":
        assert seen[0] and len(seen) == 2  # the probe's 16 rows, then the whole graph
        assert seen[1] is (apart >= scanadvice.SPARSE_SPACING)
    else:
        assert len(seen) == n and all(seen[:probe])
        assert all(seen[probe:]) if apart >= scanadvice.SPARSE_SPACING else not any(seen[probe:])


def test_heap_string_count_in_chunks_against_one_pass(monkeypatch):
    """HDF5's estimate of a group's links (NUL-ended runs in its name heap), counted 1 MiB at a
    time (the heap's size is the file's claim), against the obvious one-pass count."""
    from tdz_numba.formats import hdf5_objects

    def one_pass(heap: bytes) -> int:
        a = np.frombuffer(heap, np.uint8)
        return 0 if not a.size else int(np.count_nonzero((a[:-1] != 0) & (a[1:] == 0))) + int(a[-1] != 0)

    rng = np.random.default_rng(7)
    monkeypatch.setattr(hdf5_objects, "_CHUNK", 7)  # runs across many chunk edges
    for n in [*range(0, 40), 63, 64, 65, 4097]:
        for share in (0.1, 0.5, 0.9):
            heap = ((rng.random(n) < share) * rng.integers(1, 256, n)).astype(np.uint8).tobytes()
            assert hdf5_objects._strings(heap) == one_pass(heap), (n, share)
    assert hdf5_objects._strings(b"name\0\0\0\0other\0\0\0") == 2


@needs_smaps
def test_pages_only_advises_the_range_and_gives_the_default_back():
    mm = mmap.mmap(-1, 64 * PAGE)
    base = np.frombuffer(mm, np.uint8).ctypes.data
    with scanadvice.pages_only(mm, 10 * PAGE + 5, 12 * PAGE + 1):  # pages 10-12
        assert "rr" in vm_flags(base + 10 * PAGE) and "rr" in vm_flags(base + 12 * PAGE)
        assert "rr" not in vm_flags(base + 9 * PAGE) and "rr" not in vm_flags(base + 13 * PAGE)
    assert "rr" not in vm_flags(base + 11 * PAGE)
    with scanadvice.pages_only(mm, 63 * PAGE, 80 * PAGE):  # (clipped to the mapping)
        assert "rr" in vm_flags(base + 63 * PAGE)
    with scanadvice.pages_only(None, 0, PAGE):
        pass
    del base
    mm.close()
    with scanadvice.pages_only(mm, 0, PAGE):  # (closed: nothing raises)
        pass


@needs_smaps
def test_lazy_info_of_far_apart_tdz_entries_reads_only_their_headers(tmp_path):
    # a .tdz opened lazily reads a leaf's local header when asked for its info: through a page
    # fault that, by default, reads read_ahead_kb around it (tdz tree of a cold 512 MiB model:
    # 373 MiB); entries >= SPARSE_SPACING apart: the header's pages only
    tensors = {f"layer{i:02d}.weight": np.full(1 << 19, i, np.float32) for i in range(LEAVES)}  # 2 MiB apart
    path = tdz_numba.save(tensors, tmp_path / "m.tdz")
    size = path.stat().st_size
    assert size // (LEAVES + 1) >= scanadvice.SPARSE_SPACING
    drop_cache(path)
    if pagecache.cached(path, 0, size).any():
        pytest.skip("this file system keeps the file's pages cached after POSIX_FADV_DONTNEED")
    with tdz_numba.open(path) as ar:
        infos = [ar.info(k) for k in ar.keys()]
        read = int(pagecache.cached(path, 0, size).sum())
        assert [i.offset % 64 for i in infos] == [0] * LEAVES and all(i.zero_copy for i in infos)
        leaf = ar["layer07.weight"]
        assert "rr" not in vm_flags(leaf.data_ptr())  # the leaves' reads: the default read-around
        assert torch.equal(leaf, torch.from_numpy(tensors["layer07.weight"]))
    assert read * PAGE <= (512 << 10), f"the listing read {read * PAGE >> 10} KiB"
