"""Copies at memory speed (files/copying.py, the ``copy_spans`` kernel of files/page_kernels.py):
the kernel against a byte-by-byte oracle, the wrapper's pieces and errors, huge-page advice on
the destinations, and ``load(copy=True)`` taking the kernel path (not ``preadv``) for ``.tdz``
and foreign files with the same bytes as the ``preadv`` path."""

from __future__ import annotations

import mmap
import os
import sys

import numpy as np
import pytest
import torch

import tdz_numba
from tdz_numba.errors import BadArchiveError
from tdz_numba.files import copying
from tdz_numba.jit import policy

MiB = 1 << 20


def _oracle(src: np.ndarray, offsets, sizes, dests: list[np.ndarray]) -> None:
    """The slow obvious copy: byte by byte."""
    for off, n, d in zip(offsets, sizes, dests):
        for k in range(n):
            d[k] = src[off + k]


def _cols(*v):
    return np.array(v, np.int64)


@pytest.mark.parametrize("stream", [True, False])
def test_copy_spans_kernel_against_oracle(stream):
    from tdz_numba.files.page_kernels import copy_spans

    rng = np.random.default_rng(0)
    src = rng.integers(0, 256, 3000, dtype=np.uint8)
    sizes = [0, 1, 63, 64, 65, 127, 128, 129, 191, 200, 1000]
    for shift in (0, 1, 7, 31, 63):  # destinations at every alignment to the 64-byte blocks
        for src_shift in (0, 3):
            offs = [(i * 97 + src_shift) % (3000 - 1000) for i in range(len(sizes))]
            pool = np.zeros(sum(sizes) + 64 * len(sizes) + 64, np.uint8)
            base = (-pool.ctypes.data) % 64 + shift
            starts, at = [], base
            for n in sizes:
                starts.append(at)
                at += n + 64
            got = [pool[s : s + n] for s, n in zip(starts, sizes)]
            want = [np.zeros(n, np.uint8) for n in sizes]
            _oracle(src, offs, sizes, want)
            addrs = _cols(*(pool.ctypes.data + s for s in starts))
            done = copy_spans(src, _cols(*offs), addrs, _cols(*sizes), stream)
            assert done == sum(sizes)
            for g, w in zip(got, want):
                assert np.array_equal(g, w)
            gaps = np.ones(pool.size, bool)  # nothing written outside the spans
            for s, n in zip(starts, sizes):
                gaps[s : s + n] = False
            assert not pool[gaps].any()


def test_copy_spans_kernel_read_only_source_and_bad_spans():
    from tdz_numba.files.page_kernels import copy_spans

    ro = np.frombuffer(bytes(range(256)) * 4, np.uint8)  # read-only memory
    dst = np.zeros(300, np.uint8)
    assert copy_spans(ro, _cols(10), _cols(dst.ctypes.data), _cols(300), True) == 300
    assert np.array_equal(dst, ro[10:310])
    dst[:] = 0
    a = dst.ctypes.data
    # the first span outside the source: -(i + 1), and nothing copied (not even span 0)
    for bad in ((0, 2000), (-1, 1), (1024, 1), (5, -1)):
        status = copy_spans(ro, _cols(0, bad[0]), _cols(a, a + 100), _cols(50, bad[1]), True)
        assert status == -2
    assert not dst.any()
    assert copy_spans(ro, _cols(1024), _cols(a), _cols(0), True) == 0  # empty at the very end


def test_pieces_split_large_spans_and_group_small_ones():
    offs = _cols(0, 20 * MiB, 20 * MiB + 10, 40 * MiB)
    sizes = _cols(20 * MiB, 10, 3 * MiB, 5)
    addrs = _cols(1000, 50_000_000, 60_000_000, 70_000_000)
    pieces = copying._pieces(offs, addrs, sizes)
    flat = [(int(o), int(a), int(n)) for p in pieces for o, a, n in zip(*p)]
    assert sum(n for _, _, n in flat) == int(sizes.sum())
    assert all(n <= copying.PIECE for _, _, n in flat)
    assert flat[:3] == [
        (0, 1000, 8 * MiB),
        (8 * MiB, 1000 + 8 * MiB, 8 * MiB),
        (16 * MiB, 1000 + 16 * MiB, 4 * MiB),
    ]
    assert len(pieces) == 3  # 8 + 8 + (4 + tiny + 3 + tiny): the small spans share a piece
    small = copying._pieces(_cols(*range(0, 1000, 10)), _cols(*range(100)), _cols(*[10] * 100))
    assert len(small) == 1


def test_copy_spans_wrapper_in_parallel_equals_the_source():
    rng = np.random.default_rng(1)
    src = rng.integers(0, 256, 40 * MiB, dtype=np.uint8)
    sizes = _cols(17 * MiB + 3, 5, 9 * MiB, 1, 6 * MiB + 100)
    offs = _cols(0, 17 * MiB + 3, 18 * MiB, 27 * MiB + 9, 30 * MiB)
    dests = [np.empty(int(n), np.uint8) for n in sizes]
    addrs = _cols(*(d.ctypes.data for d in dests))
    order = [3, 0, 4, 1, 2]  # any order in: sorted by file offset inside
    done = copying.copy_spans(src, offs[order], addrs[order], sizes[order], num_threads=3)
    assert done == int(sizes.sum())
    for o, n, d in zip(offs.tolist(), sizes.tolist(), dests):
        assert np.array_equal(d, src[o : o + n])


def test_copy_spans_wrapper_refuses_spans_outside_the_file(tmp_path):
    p = tmp_path / "f.bin"
    p.write_bytes(bytes(range(256)) * 64)
    dst = np.zeros(100, np.uint8)
    with open(p, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as mm:
        buf = np.frombuffer(mm, np.uint8)
        with pytest.raises(BadArchiveError, match="lie outside"):
            copying.copy_spans(buf, _cols(16_300), _cols(dst.ctypes.data), _cols(100), where=p)
        os.truncate(p, 4096)  # shorter since the mapping was made: the copy would raise SIGBUS
        with pytest.raises(BadArchiveError, match="short read"):
            copying.copy_spans(buf, _cols(8192), _cols(dst.ctypes.data), _cols(100), where=p)
        assert copying.copy_spans(buf, _cols(4000), _cols(dst.ctypes.data), _cols(96), where=p) == 96
        del buf
    assert not dst[96:].any() and dst[0] == 4000 % 256


def _vm_flags(address: int) -> set[str]:
    with open("/proc/self/smaps") as f:
        lines = f.read().splitlines()
    inside = False
    for line in lines:
        head = line.split()[0] if line else ""
        if "-" in head and all(c in "0123456789abcdef-" for c in head):
            lo, hi = (int(x, 16) for x in head.split("-"))
            inside = lo <= address < hi
        elif inside and line.startswith("VmFlags:"):
            return set(line.split()[1:])
    return set()


needs_thp = pytest.mark.skipif(
    not sys.platform.startswith("linux") or getattr(mmap, "MADV_HUGEPAGE", None) is None,
    reason="transparent huge pages are Linux's",
)


@needs_thp
def test_advise_huge_marks_the_whole_huge_pages_inside():
    t = torch.empty(9 * MiB, dtype=torch.uint8)
    a = t.data_ptr()
    done = copying.advise_huge(a, t.nbytes)
    first = -(-a // copying.HUGE_PAGE) * copying.HUGE_PAGE
    assert done == (a + t.nbytes) // copying.HUGE_PAGE * copying.HUGE_PAGE - first >= 6 * MiB
    assert "hg" in _vm_flags(first) and "hg" in _vm_flags(first + done - 1)
    assert copying.advise_huge(a, copying.HUGE_MIN - 1) == 0


def _big_files(tmp_path):
    g = torch.Generator().manual_seed(0)
    tree = {
        "emb": torch.randn(2600, 1024, generator=g).half(),  # 5 MiB: its own allocation, huge pages
        "w": torch.randn(300, 257, generator=g),
        **{f"s{i}": torch.randn(i + 1, generator=g) for i in range(40)},  # slabs (.tdz)
    }
    from safetensors.torch import save_file

    tdz = tdz_numba.save(tree, tmp_path / "m.tdz")
    st = tmp_path / "m.safetensors"
    save_file(tree, str(st))
    npz = tmp_path / "m.npz"
    np.savez(npz, **{k: v.float().numpy() for k, v in tree.items()})
    return tree, [tdz, st, npz]


def test_copy_load_takes_the_kernel_path_with_the_same_bytes(tmp_path, monkeypatch):
    """Regression (issue 27, copy at memory speed): with the kernels on, ``load(copy=True)``
    copies from the mapping (not by the ``preadv`` scatter reads), large leaves on memory advised for 2 MiB pages;
    the bytes equal the ``preadv`` path's and the source's."""
    tree, paths = _big_files(tmp_path)
    with policy.forced("never"):
        before = [tdz_numba.load(p, copy=True) for p in paths]

    def no_preadv(*args, **kwargs):
        raise AssertionError("the preadv copy ran: the copy did not take the kernel path")

    from tdz_numba.archive import bulk, foreign

    monkeypatch.setattr(bulk, "_scatter_read", no_preadv)
    monkeypatch.setattr(foreign, "_run", lambda files, work, n: no_preadv() if work else None)
    with policy.forced("always"):
        after = [tdz_numba.load(p, copy=True) for p in paths]
    for p, a, b in zip(paths, before, after):
        assert a.keys() == b.keys() == tree.keys(), p
        for k, v in tree.items():
            want = v.float() if str(p).endswith(".npz") else v
            assert torch.equal(a[k], want) and torch.equal(b[k], want), (p, k)
            assert b[k].untyped_storage().data_ptr() != a[k].untyped_storage().data_ptr()
        if sys.platform.startswith("linux") and getattr(mmap, "MADV_HUGEPAGE", None) is not None:
            emb = b["emb"]
            first = -(-emb.data_ptr() // copying.HUGE_PAGE) * copying.HUGE_PAGE
            assert "hg" in _vm_flags(first), p
    # each leaf its own tensor: a write to one changes no other, and no autograd base
    b = after[0]
    b["emb"].add_(1)
    assert torch.equal(b["w"], tree["w"]) and b["emb"]._base is None
    assert b["emb"].untyped_storage().nbytes() == b["emb"].nbytes


def test_copy_load_of_a_truncated_file_is_a_short_read_on_the_kernel_path(tmp_path):
    _, paths = _big_files(tmp_path)
    for p in paths[1:]:  # (a .tdz checks its local headers in the mapping first: not a copy's)
        with tdz_numba.open(p, copy=True) as ar, policy.forced("always"):
            assert ar["s0"].numel() == 1  # the file is mapped now
            os.truncate(p, os.path.getsize(p) // 2)  # a copy from the mapping would be a SIGBUS
            with pytest.raises(BadArchiveError, match="short read"):
                ar.to_dict()


@pytest.mark.parametrize("kernels", ["always", "never"])
def test_foreign_small_leaves_share_slabs_but_stay_their_own_tensors(tmp_path, kernels):
    """Regression (issue 27, the small workload's copy): a foreign file's small leaves are
    copied onto shared slabs (one allocation per slab, not per leaf), each still its own
    tensor with its own version counter and bytes; both copy paths."""
    from safetensors.torch import save_file

    from tdz_numba.archive import foreign

    g = torch.Generator().manual_seed(3)
    tree = {
        f"s{i:03d}": torch.randn(2, i % 7 + 1, generator=g).to(torch.float16 if i % 3 else torch.float32)
        for i in range(300)
    }
    tree["z"] = torch.tensor(5.0)  # 0-d
    tree["big"] = torch.randn(foreign.SLAB_LEAF // 4 + 3, generator=g)  # its own storage
    p = tmp_path / "small.safetensors"
    save_file(tree, str(p))
    with policy.forced(kernels):
        got = tdz_numba.load(p, copy=True)
    for k, v in tree.items():
        assert got[k].dtype == v.dtype and got[k].shape == v.shape and torch.equal(got[k], v), k
    small = [k for k in tree if k != "big"]
    assert len({got[k].untyped_storage().data_ptr() for k in small}) <= 4  # 2 dtypes, 1 MiB slabs
    for k in small:
        assert got[k].untyped_storage().nbytes() <= foreign.SLAB, k
        assert got[k]._base is None and not got[k]._is_view(), k
    assert got["big"].untyped_storage().nbytes() == got["big"].nbytes
    before = {k: got[k]._version for k in tree}
    snapshot = {k: got[k].clone() for k in tree}
    got["s010"].add_(1)
    for k in tree:
        if k != "s010":
            assert got[k]._version == before[k] and torch.equal(got[k], snapshot[k]), k


@needs_thp
def test_a_large_copy_advises_the_source_mapping_for_2mib_folios(tmp_path):
    """A cold copy from a mapping without ``MADV_HUGEPAGE`` reads 4-128 KiB per fault, one
    synchronous read each (a cold 512 MiB .tdz copied ~2x slower than by preadv)."""
    p = tmp_path / "f.bin"
    p.write_bytes(
        np.random.default_rng(2).integers(0, 256, copying.STREAM_MIN + 4096, dtype=np.uint8).tobytes()
    )
    dst = np.empty(copying.STREAM_MIN, np.uint8)
    with open(p, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_COPY) as mm:
        buf = np.frombuffer(mm, np.uint8)
        assert "hg" not in _vm_flags(buf.ctypes.data)
        assert copying.copy_spans(buf, _cols(4096), _cols(dst.ctypes.data), _cols(dst.size)) == dst.size
        assert "hg" in _vm_flags(buf.ctypes.data)
        assert np.array_equal(dst, buf[4096:])
        del buf
