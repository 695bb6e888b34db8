"""The global heap kernel (formats.hdf5_headers.global_heap behind formats.hdf5_heap.heap_collection)
against its plain-Python reference (formats.hdf5_heap.walk_collection): the same objects or the
same error, word for word, on edge sizes, every size width, read-only buffers and damaged heaps."""

from __future__ import annotations

import numpy as np
import pytest

from tdz_numba.errors import BadArchiveError
from tdz_numba.formats.hdf5_headers import G_FULL, global_heap
from tdz_numba.formats.hdf5_heap import Collection, heap_collection, walk_collection
from tdz_numba.formats.hdf5_objects import Layout


def _collection(
    objs, lsz: int = 8, free: int | None = None, csize: int | None = None, lead: int = 0
) -> bytes:
    """A collection at offset ``lead``: ``objs`` = (index, data) then a free-space object of the
    rest (``free`` overrides its size), ``csize`` overrides the collection's size."""
    hdr = 8 + lsz
    body = b""
    for idx, data in objs:
        body += idx.to_bytes(2, "little") + bytes(6) + len(data).to_bytes(lsz, "little")
        body += data + bytes(-len(data) % 8)
    total = hdr + len(body)
    total = max(total + hdr, 4096) if free is None or free > 0 else total + hdr
    rest = total - hdr - len(body)
    body += bytes(8) + (rest if free is None else free).to_bytes(lsz, "little")
    body += bytes(total - hdr - len(body))
    size = total if csize is None else csize
    head = b"GCOL" + bytes([1, 0, 0, 0]) + (size % (1 << (8 * lsz))).to_bytes(lsz, "little")
    return bytes(lead) + head + body


def _both(buf: bytes, addr: int, lsz: int = 8, writable: bool = False):
    """(kernel's result or error text, reference's result or error text)."""
    arr = np.frombuffer(buf, np.uint8)  # read-only, as a file mapped for reading
    if writable:
        arr = arr.copy()
    lay = Layout(arr, "f.h5", base=0, osz=8, lsz=lsz, root=0)
    got = []
    for fn in (lambda: heap_collection(lay, addr, {}), lambda: walk_collection(lay, addr)):
        try:
            got.append(fn())
        except BadArchiveError as e:
            got.append(str(e))
    return got


@pytest.mark.parametrize("lsz", [2, 4, 8])
@pytest.mark.parametrize("writable", [False, True])
@pytest.mark.parametrize(
    "objs",
    [
        [],
        [(1, b"")],
        [(1, b"a")],
        [(1, b"12345678")],
        [(1, b"123456789"), (2, b"x" * 17)],
        [(5, b"abc"), (2, b"de"), (65535, b"f")],  # stored out of index order
    ],
)
def test_kernel_matches_reference(objs, lsz, writable):
    for lead in (0, 3, 8):
        buf = _collection(objs, lsz, lead=lead)
        k, r = _both(buf, lead, lsz, writable)
        assert isinstance(k, Collection) and k == r
        assert k.index.tolist() == sorted(i for i, _ in objs)
        for i, data in objs:
            pos, size = k.get(i)
            assert buf[pos : pos + size] == data
        assert k.get(4) is None and k.end == len(buf)


@pytest.mark.parametrize("lsz", [2, 4, 8])
def test_damaged_collections_same_error(lsz):
    ones = (1 << (8 * lsz)) - 1
    hdr = 8 + lsz
    ok = _collection([(1, b"abc"), (2, b"defgh")], lsz)
    cases = {
        "no collection there": [(b"XCOL" + ok[4:], 0), (ok, -1), (ok, len(ok) - 7), (ok, 1 << 70)],
        "version 2": [(ok[:4] + b"\x02" + ok[5:], 0)],
        "version -1": [(ok[:4] + b"\xff" + ok[5:], 0)],
        "runs past the end of the file": [(ok[: 8 + lsz - 1], 0)],
        "a size of": [
            (_collection([(1, b"a")], lsz, csize=hdr - 1), 0),
            (_collection([(1, b"a")], lsz, csize=ones), 0),
            (_collection([(1, b"a")], lsz, csize=8192), 0),
        ],
        "undefined size": [(_collection([(1, b"a")], lsz, free=ones), 0)],
        "twice": [(_collection([(3, b"a"), (3, b"b")], lsz), 0)],
        "free-space object of 0 bytes": [(_collection([(1, b"a")], lsz, free=0), 0)],
        "runs past the collection": [
            (_collection([(1, b"a" * 40)], lsz, csize=hdr + hdr + 16), 0),
        ],
    }
    for words, bufs in cases.items():
        for buf, addr in bufs:
            k, r = _both(buf, addr, lsz)
            assert isinstance(r, str) and words in r, (words, r)
            assert k == r


def test_huge_object_size_same_error():
    """An object size near 2**64 (an int64 overflow in a careless kernel) is past the collection."""
    buf = bytearray(_collection([(1, b"a")]))
    buf[16 + 8 : 16 + 16] = (2**64 - 9).to_bytes(8, "little")
    k, r = _both(bytes(buf), 0)
    assert k == r and f"object 1 of {2**64 - 9} bytes runs past the collection" in r


def test_many_objects_past_first_table():
    """More objects than the kernel's first table holds (G_FULL): walked again with room for all."""
    objs = [(i, b"") for i in range(1, 5001)]
    buf = _collection(objs)
    k, r = _both(buf, 0)
    assert k == r and k.index.size == 5000
    arr = np.frombuffer(buf, np.uint8)
    assert global_heap(arr, 0, 8, np.empty((10, 3), np.int64), np.zeros(3, np.int64)) == G_FULL


def test_collection_cached_by_address():
    lay = Layout(np.frombuffer(_collection([(1, b"a")]), np.uint8), "f.h5", 0, 8, 8, 0)
    heaps: dict = {}
    first = heap_collection(lay, 0, heaps)
    assert heaps[0] is first and heap_collection(lay, 0, heaps) is first


def test_mutants_same_result():
    """Random byte flips of real-looking collections (several per buffer, in the headers and the
    data alike): the kernel gives the reference's objects or its error, every time."""
    rng = np.random.default_rng(7)
    seeds = [
        _collection([(1, b"abc"), (2, b"x" * 20), (3, b"")], 8),
        _collection([(i, bytes([i]) * (i % 11)) for i in range(1, 40)], 4),
        _collection([(7, b"q" * 9)], 2, lead=5),
    ]
    accepted = 0
    for seed in seeds:
        lead = seed.find(b"GCOL")
        lsz = 8 if seed is seeds[0] else 4 if seed is seeds[1] else 2
        for _ in range(400):
            buf = bytearray(seed)
            for _ in range(int(rng.integers(1, 4))):
                at = int(rng.integers(0, min(len(buf), 160)))
                buf[at] = int(rng.integers(0, 256))
            k, r = _both(bytes(buf), lead, lsz)
            assert k == r
            accepted += isinstance(r, Collection)
    assert 0 < accepted < 1200
