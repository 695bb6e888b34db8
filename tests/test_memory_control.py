"""Page-level memory control (tdz_numba.files.memory): evict, prefetch, residency, O_DIRECT reads."""

import mmap
import os

import numpy as np
import pytest

from tdz_numba.errors import InvalidArgumentError
from tdz_numba.files import memory

PAGE = memory.PAGE_SIZE


def _file(tmp_path, pages=16, name="data.bin"):
    p = tmp_path / name
    data = np.random.default_rng(0).integers(0, 256, pages * PAGE, dtype=np.uint8)
    with open(p, "wb") as f:
        f.write(data.tobytes())
        f.flush()
        os.fsync(f.fileno())  # clean pages: the page cache can drop them
    return p, data


def _map(path, shared=False):
    fd = os.open(path, os.O_RDWR if shared else os.O_RDONLY)
    try:
        return mmap.mmap(fd, 0, access=mmap.ACCESS_WRITE if shared else mmap.ACCESS_COPY)
    finally:
        os.close(fd)


@pytest.mark.parametrize(
    ("offset", "nbytes", "expected"),
    [
        (0, 0, (0, 0)),
        (0, PAGE, (0, PAGE)),
        (0, PAGE - 1, (0, 0)),
        (1, PAGE, (PAGE, 0)),
        (64, 3 * PAGE, (PAGE, 2 * PAGE)),
        (PAGE - 1, PAGE + 2, (PAGE, PAGE)),
        (5 * PAGE, 2 * PAGE + 1, (5 * PAGE, 2 * PAGE)),
        (2**40 + 3, 2**33, (2**40 + PAGE, 2**33 - PAGE)),  # > 4 GiB offsets, by arithmetic
    ],
)
def test_inner_pages(offset, nbytes, expected):
    assert memory.inner_pages(offset, nbytes, PAGE) == expected
    # the slow oracle: every page whose bytes all lie inside the range
    if nbytes < 64 * PAGE:
        inside = [
            p
            for p in range(offset // PAGE, (offset + nbytes) // PAGE + 1)
            if p * PAGE >= offset and (p + 1) * PAGE <= offset + nbytes
        ]
        got = memory.inner_pages(offset, nbytes, PAGE)
        assert got == ((inside[0] * PAGE, len(inside) * PAGE) if inside else (got[0], 0))


def test_inner_pages_rejects_negative():
    with pytest.raises(InvalidArgumentError):
        memory.inner_pages(-1, 10)


def test_evictable():
    assert memory.is_evictable(0, PAGE)
    assert memory.is_evictable(PAGE, 3 * PAGE + 5)
    assert not memory.is_evictable(64, 10 * PAGE)
    assert not memory.is_evictable(0, PAGE - 1)
    assert not memory.is_evictable(0, 0)


def test_prefetch_touch_then_evict_exactly_one_range(tmp_path):
    path, _ = _file(tmp_path)
    mm = _map(path)
    memory.prefetch(mm, 0, len(mm), touch=True)
    assert memory.resident(mm, 0, len(mm)) == 1.0
    dropped = memory.evict(mm, 4 * PAGE, 8 * PAGE, file=path)
    assert dropped == 8 * PAGE
    assert memory.resident(mm, 4 * PAGE, 8 * PAGE) == 0.0
    # the neighbours are untouched
    assert memory.resident(mm, 0, 4 * PAGE) == 1.0
    assert memory.resident(mm, 12 * PAGE, 4 * PAGE) == 1.0
    # a range that does not cover whole pages drops only its inner pages
    memory.prefetch(mm, 0, len(mm), touch=True)
    assert memory.evict(mm, 64, 2 * PAGE, file=path) == PAGE
    assert memory.resident(mm, PAGE, PAGE) == 0.0
    assert memory.resident(mm, 0, PAGE) == 1.0 and memory.resident(mm, 2 * PAGE, PAGE) == 1.0
    mm.close()


def test_evict_private_mapping_discards_private_changes(tmp_path):
    path, data = _file(tmp_path)
    mm = _map(path)
    buf = np.frombuffer(mm, np.uint8)
    buf[5 * PAGE] ^= 0xFF  # a private (copy-on-write) change
    assert buf[5 * PAGE] != data[5 * PAGE]
    memory.evict(mm, 4 * PAGE, 4 * PAGE, file=path)
    assert buf[5 * PAGE] == data[5 * PAGE]  # the file's byte is back
    assert path.read_bytes() == data.tobytes()
    del buf
    mm.close()


def test_evict_shared_mapping_keeps_written_data(tmp_path):
    path, data = _file(tmp_path)
    mm = _map(path, shared=True)
    buf = np.frombuffer(mm, np.uint8)
    buf[5 * PAGE : 6 * PAGE] = 7
    memory.evict(mm, 4 * PAGE, 4 * PAGE, file=path, shared=True)
    assert (buf[5 * PAGE : 6 * PAGE] == 7).all()  # read back from the file
    on_disk = np.frombuffer(path.read_bytes(), np.uint8)
    assert (on_disk[5 * PAGE : 6 * PAGE] == 7).all()
    assert (on_disk[: 5 * PAGE] == data[: 5 * PAGE]).all()
    del buf
    mm.close()


def test_range_checks(tmp_path):
    path, _ = _file(tmp_path, pages=2)
    mm = _map(path)
    for fn in (memory.evict, memory.prefetch, memory.resident):
        with pytest.raises(InvalidArgumentError):
            fn(mm, PAGE, 2 * PAGE)
    assert memory.resident(mm, 0, 0) == 1.0
    mm.close()


def test_touch_pages_kernel_against_oracle():
    from tdz_numba.files.page_kernels import touch_pages

    for n in (1, 63, 64, 65, PAGE - 1, PAGE, PAGE + 1, 3 * PAGE + 7):
        buf = np.random.default_rng(n).integers(0, 256, n, dtype=np.uint8)
        expected = int(sum(int(buf[i]) for i in range(0, n, PAGE)))
        assert int(touch_pages(buf, PAGE)) == expected
    ro = np.frombuffer(bytes(range(256)) * 40, np.uint8)  # read-only memory
    assert int(touch_pages(ro, PAGE)) == int(ro[::PAGE].astype(np.int64).sum())


@pytest.mark.parametrize("direct", [True, False])
def test_read_direct_equals_file_bytes(tmp_path, direct):
    path, data = _file(tmp_path, pages=8)
    ranges = [(0, 10), (64, 3 * PAGE), (PAGE, PAGE), (7 * PAGE + 5, PAGE - 5), (3, 0)]
    bufs, used = memory.read_direct(path, ranges, direct=direct)
    if not direct:
        assert used is False
    for (off, n), b in zip(ranges, bufs):
        assert b.tobytes() == data[off : off + n].tobytes()
        assert b.flags.writeable  # owned buffers
    with pytest.raises(InvalidArgumentError):
        memory.read_direct(path, [(8 * PAGE - 1, 2)], direct=direct)


def test_read_direct_falls_back_where_refused(tmp_path, monkeypatch):
    """A file system that refuses O_DIRECT (EINVAL at open, as tmpfs did before Linux 6.6):
    buffered reads, same bytes."""
    import errno

    path, data = _file(tmp_path, pages=3)
    real_open = os.open

    def refusing_open(p, flags, *args, **kwargs):
        if flags & getattr(os, "O_DIRECT", 0):
            raise OSError(errno.EINVAL, "Invalid argument")
        return real_open(p, flags, *args, **kwargs)

    monkeypatch.setattr(os, "open", refusing_open)
    bufs, used = memory.read_direct(path, [(100, 2 * PAGE)], direct=True)
    assert bufs[0].tobytes() == data[100 : 100 + 2 * PAGE].tobytes()
    assert used is False
