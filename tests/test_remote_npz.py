"""A remote ``.npz`` opened lazily (:mod:`tdz_numba.remote.npz`), against the loopback HTTP Range
server: the open reads the tail only, one tensor costs its member's bytes in one request,
``load`` and ``tdz info`` every header in one batch; deflated members, long ``.npy``
headers and bad members."""

from __future__ import annotations

import io
import zipfile

import numpy as np
import pytest
import torch

import tdz_numba

pytest.importorskip("fsspec")
pytest.importorskip("aiohttp")

from servers import RangeServer  # noqa: E402

N, ELEMS = 100, 4096  # 100 float32 arrays of 16 KiB


@pytest.fixture(scope="module")
def http():
    server = RangeServer()
    yield server
    server.stop()


def _arrays(n: int = N, elems: int = ELEMS) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(0)
    return {f"t{i:03d}": rng.standard_normal(elems).astype(np.float32) for i in range(n)}


def _npz(arrays, compressed: bool = False) -> bytes:
    buf = io.BytesIO()
    (np.savez_compressed if compressed else np.savez)(buf, **arrays)
    return buf.getvalue()


def test_open_one_request_one_tensor_its_bytes(http):
    """The goal of issue 26: a lazy open <= 2 requests; one tensor of 100 fetches <= its
    bytes + the header (the tail read) + 64 KiB, in all, the open included."""
    a = _arrays()
    url = http.put("lazy.npz", _npz(a))
    http.reset_log()
    with tdz_numba.open(url) as ar:
        assert list(ar) == list(a) and len(ar) == N and "nope" not in ar
        assert http.requests == 1, http.log  # the tail: the central directory
        tail = http.bytes_served
        x = ar["t042"]
        assert np.array_equal(x.numpy(), a["t042"])
        assert http.requests == 2, http.log  # the member: headers and data in one range
        assert http.bytes_served - tail <= ELEMS * 4 + 256, http.log
        assert http.bytes_served <= ELEMS * 4 + tail + (64 << 10)
        http.reset_log()
        assert "t042" in ar and "t043" in ar  # (`in` makes the child: t043's member is fetched)
        info = ar.info("t042")  # made already: no request
        assert info.shape == (ELEMS,) and info.dtype == torch.float32 and http.requests == 1


def test_load_and_info_fetch_every_header_in_one_batch(http):
    from tdz_numba.remote import read

    a = _arrays()
    url = http.put("all.npz", _npz(a))
    http.reset_log()
    back = tdz_numba.load(url)
    assert list(back) == list(a) and all(np.array_equal(back[k].numpy(), a[k]) for k in a)
    assert http.requests <= 1 + read.HEAD_RANGES + 1, http.log
    from tdz_numba.cli import main

    http.reset_log()
    assert main(["info", url]) == 0
    assert http.requests <= 1 + read.HEAD_RANGES, http.log


def test_a_large_member_headers_first_then_its_data(http):
    """A member larger than WHOLE_MEMBER: ``info`` fetches its headers only; the tensor its data."""
    from tdz_numba.remote import npz

    a = _arrays(4, 1 << 19)  # 2 MiB each
    url = http.put("large.npz", _npz(a))
    http.reset_log()
    with tdz_numba.open(url) as ar:
        tail = http.bytes_served
        info = ar.info("t001")
        assert info.shape == (1 << 19,) and info.nbytes == 2 << 20
        assert http.bytes_served - tail <= 2 * npz.NPY_HEAD, http.log
        assert np.array_equal(ar["t001"].numpy(), a["t001"])
        assert http.bytes_served - tail <= (2 << 20) + 4096, http.log


@pytest.mark.parametrize("elems", [ELEMS, 1 << 19])
def test_deflated_members(http, elems):
    a = _arrays(5, elems)
    a["zeros"] = np.zeros(elems, np.float32)  # compresses far: its header inflates from a few bytes
    url = http.put(f"c{elems}.npz", _npz(a, compressed=True))
    with tdz_numba.open(url) as ar:
        assert ar.info("t003").compression == "deflate"
        assert np.array_equal(ar["t003"].numpy(), a["t003"]) and np.array_equal(
            ar["zeros"].numpy(), a["zeros"]
        )
    back = tdz_numba.load(url)
    assert all(np.array_equal(back[k].numpy(), a[k]) for k in a)


def _long_header_npz(arr: np.ndarray, pad: int) -> bytes:
    """An ``.npz`` whose member's ``.npy`` header is padded with ``pad`` spaces (valid: numpy
    reads it), longer than the bytes a lazy open reads after the local header."""
    d = "{'descr': '<f4', 'fortran_order': False, 'shape': (" + str(arr.size) + ",), }"
    text = d + " " * pad
    text += " " * ((-(10 + len(text) + 1)) % 64) + "\n"
    npy = b"\x93NUMPY\x01\x00" + len(text).to_bytes(2, "little") + text.encode() + arr.tobytes()
    buf = io.BytesIO()
    with zipfile.ZipFile(buf, "w", zipfile.ZIP_STORED) as z:
        z.writestr("long.npy", npy)
        z.writestr("short.npy", _member(arr[:3]))
    assert np.array_equal(np.load(io.BytesIO(buf.getvalue()))["long"], arr)
    return buf.getvalue()


def _member(arr: np.ndarray) -> bytes:
    b = io.BytesIO()
    np.save(b, arr)
    return b.getvalue()


def test_long_npy_header_is_read_whole(http):
    from tdz_numba.remote import npz

    arr = np.arange(1 << 19, dtype=np.float32)  # 2 MiB: its headers are read first
    url = http.put("longhead.npz", _long_header_npz(arr, 3 * npz.NPY_HEAD))
    with tdz_numba.open(url) as ar:
        assert ar.info("long").shape == arr.shape
        assert np.array_equal(ar["long"].numpy(), arr) and ar["short"].tolist() == [0.0, 1.0, 2.0]


def test_bad_members(http):
    buf = io.BytesIO()
    with zipfile.ZipFile(buf, "w") as z:
        z.writestr("a.npy", _member(np.ones(2)))
        z.writestr("notes.txt", b"hi")
    url = http.put("bad.npz", buf.getvalue())
    with tdz_numba.open(url) as ar:  # another member is not an array: not a leaf (as numpy reads it)
        assert list(ar) == ["a"] and torch.equal(ar["a"], torch.ones(2, dtype=torch.float64))
    buf = io.BytesIO()
    with zipfile.ZipFile(buf, "w") as z:
        z.writestr("notes.txt", b"hi")
    url = http.put("noarray.npz", buf.getvalue())
    with pytest.raises(tdz_numba.TdzError, match=r"noarray\.npz"):
        tdz_numba.open(url)
    buf = io.BytesIO()
    with zipfile.ZipFile(buf, "w") as z:
        z.writestr("a.npy", b"\x93NUMPY\x01\x00" + b"\x10\x00" + b"not a dict      " + b"\0" * 8)
    url = http.put("badhead.npz", buf.getvalue())
    with tdz_numba.open(url) as ar:  # the header is read when the member is asked for
        assert list(ar) == ["a"]
        with pytest.raises(tdz_numba.BadArchiveError, match=r"badhead\.npz: member 'a\.npy'"):
            ar["a"]
