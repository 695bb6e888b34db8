""".npz header grouping: the compiled pass (formats/npz_scan.py) against its numpy twin
(numpy_fmt._headers under ``policy.forced("never")``): the same headers for every member, the
same refusals, the same specs from a whole open."""

from __future__ import annotations

import numpy as np
import pytest

from tdz_numba.formats import npz_scan, numpy_fmt
from tdz_numba.jit import policy
from tdz_numba.zipfmt.index import ArchiveIndex


def _npz(tmp_path, arrays):
    p = tmp_path / "a.npz"
    np.savez(p, **arrays)
    index = ArchiveIndex(p)
    index.check_all()
    f = numpy_fmt.MappedFile.of_index(p, index)
    return p, index, f


def _per_member(index, f, n):
    """Each member's parsed header, by kernel and by twin (None: refused)."""
    out = []
    for mode in ("always", "never"):
        t = index.table
        with policy.forced(mode):
            got = numpy_fmt._headers(f.buffer, t["payload_offset"], t["size"], n)
        out.append(None if got is None else [got[0][i] for i in got[1].tolist()])
    return out


ARRAYS = {
    "one": {f"w{i}": np.full(7, i, np.float16) for i in range(50)},
    "mixed": {
        "s": np.ones(()),
        "e": np.zeros((0, 3), np.int8),
        "f": np.asfortranarray(np.ones((3, 4), np.float32)),
        **{f"v{i}": np.ones(i % 17 + 1, np.int16) for i in range(300)},  # 17 shapes, interleaved
        **{f"d{i}": np.ones((i + 1, 2), np.float64) for i in range(200)},  # 200 distinct headers
    },
    "single": {"x": np.arange(3)},
}


@pytest.mark.parametrize("name", sorted(ARRAYS))
def test_kernel_matches_twin(tmp_path, monkeypatch, name):
    monkeypatch.setattr(numpy_fmt, "SMALL", 0)  # the bulk path at every count (see test_small_views)
    p, index, f = _npz(tmp_path, ARRAYS[name])
    try:
        fast, slow = _per_member(index, f, len(ARRAYS[name]))
        assert fast is not None and fast == slow
        assert [h.shape for h in fast] == [np.shape(v) for v in ARRAYS[name].values()]
        with policy.forced("always"):
            a = numpy_fmt._bulk_npz(index, f, str(p))
        with policy.forced("never"):
            b = numpy_fmt._bulk_npz(index, f, str(p))
        assert a is not None and a == b
    finally:
        f.close()
        index.close()


def _buf(*members: bytes) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    data = b"".join(members)
    po = np.cumsum([0] + [len(m) for m in members[:-1]]).astype(np.int64)
    return np.frombuffer(data, np.uint8), po, np.array([len(m) for m in members], np.int64)


def _hdr(text: bytes, version: int = 1, magic: bytes = numpy_fmt.MAGIC) -> bytes:
    return magic + bytes([version, 0]) + len(text).to_bytes(2, "little") + text


@pytest.mark.parametrize(
    "members",
    [
        [_hdr(b"{}")] * 3,
        [_hdr(b"{a}"), _hdr(b"{b}"), _hdr(b"{a}"), _hdr(b"{c}"), _hdr(b"{b}")],
        [_hdr(b"x" * 1024)],  # the longest header the bulk path reads
        [_hdr(b"{}"), b"\x93NUMPY\x01"],  # shorter than the fixed part
        [_hdr(b"{}"), _hdr(b"{}", version=2)],
        [_hdr(b"{}", magic=b"\x93NUMPZ")],
        [_hdr(b"x" * 1025)],  # over the limit
    ],
)
def test_group_edges_read_only(members):
    buf, po, size = _buf(*members)
    assert not buf.flags.writeable
    got = npz_scan.group(buf, po, size, 1024)
    ok = all(len(m) >= 10 and m[:6] == numpy_fmt.MAGIC and m[6] == 1 for m in members)
    ok = ok and all(int.from_bytes(m[8:10], "little") <= 1024 for m in members)
    if not ok:
        assert got is None
        return
    assert got is not None
    which, reps, hlen = got
    firsts: dict[bytes, int] = {}
    expect = [firsts.setdefault(m, len(firsts)) for m in members]
    assert which.tolist() == expect and len(reps) == len(firsts)
    assert hlen.tolist() == [len(m) - 10 for m in members]


def test_group_refuses_what_runs_past_the_buffer_or_member():
    buf, po, size = _buf(_hdr(b"{ab}"), _hdr(b"{ab}"))
    assert npz_scan.group(buf, po, size, 1024) is not None
    assert npz_scan.group(buf, po, size + np.array([0, 1]), 1024) is None  # past the end
    assert npz_scan.group(buf, po, size - np.array([0, 1]), 1024) is None  # header past its member
    assert npz_scan.group(buf, po - np.array([1, 0]), size, 1024) is None  # before the start
    assert npz_scan.group(buf, po[:0], size[:0], 1024)[1].size == 0  # no member


def test_kernel_declines_like_the_twin_on_a_bad_header(tmp_path):
    p, index, f = _npz(tmp_path, {"a": np.ones(3), "b": np.ones(4)})
    f.close()
    index.close()
    raw = bytearray(p.read_bytes())
    at = raw.find(b"'descr': '<f8'", raw.find(b"b.npy"))
    raw[at + 11 : at + 13] = b"zz"  # a dtype numpy does not know: only b's header
    p.write_bytes(bytes(raw))
    index = ArchiveIndex(p)
    index.check_all()
    f = numpy_fmt.MappedFile.of_index(p, index)
    try:
        assert _per_member(index, f, 2) == [None, None]
    finally:
        f.close()
        index.close()
    with pytest.raises(numpy_fmt.BadArchiveError, match="b.npy"):
        numpy_fmt.open_npz(p)
