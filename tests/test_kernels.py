"""Every Numba kernel against a slow obvious oracle (zlib, a Python layout loop, zipfile)."""

import mmap
import zipfile
import zlib

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from naive import crc32_combine as naive_combine
from naive import naive_plan, naive_zip64_fields
from naive import table_crc32 as naive_table_crc32

from tdz_numba.zipfmt import eocd, layout, packers, records
from tdz_numba.zipfmt.kernels import crc as kernels
from tdz_numba.zipfmt.records import Col
from tdz_numba.zipfmt.records import Status as IndexStatus

EDGE_SIZES = [0, 1, 63, 64, 65, 4095, 4096, 4097, (1 << 20) - 1, 1 << 20, (1 << 20) + 1, 3 * (1 << 20) + 17]


def _spans(*arrays):
    addrs = np.array([a.ctypes.data if a.size else 0 for a in arrays], np.int64)
    lengths = np.array([a.size for a in arrays], np.int64)
    return addrs, lengths


@pytest.fixture(scope="module")
def data():
    return np.frombuffer(np.random.default_rng(0).bytes(4 * (1 << 20)), np.uint8)


@pytest.mark.parametrize("n", EDGE_SIZES)
@pytest.mark.parametrize("chunk", [64, 1 << 20])
def test_crc32_spans_matches_zlib(data, n, chunk):
    addrs, lengths = _spans(data[:n])
    assert int(kernels.crc32_spans(addrs, lengths, chunk)[0]) == zlib.crc32(data[:n])


def test_crc32_spans_many_spans_and_unaligned_starts(data):
    views = [data[o : o + s] for o, s in [(1, 63), (3, 1 << 20), (7, 0), (65, 65), (100, 2_000_001)]]
    addrs, lengths = _spans(*views)
    got = kernels.crc32_spans(addrs, lengths, 4096)
    assert [int(c) for c in got] == [zlib.crc32(v) for v in views]


def test_crc32_spans_on_read_only_mmap(tmp_path, data):
    p = tmp_path / "blob"
    p.write_bytes(data[:100_003].tobytes())
    with open(p, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as mm:
        arr = np.frombuffer(mm, np.uint8)
        assert not arr.flags.writeable
        addrs, lengths = _spans(arr[5:])
        assert int(kernels.crc32_spans(addrs, lengths, 4096)[0]) == zlib.crc32(bytes(mm[5:]))
        del arr


@given(st.binary(max_size=2000), st.binary(max_size=2000))
@settings(max_examples=200, deadline=None)
def test_crc32_combine_matches_concatenation(a, b):
    assert int(kernels.crc32_combine(zlib.crc32(a), zlib.crc32(b), len(b))) == zlib.crc32(a + b)


@pytest.mark.parametrize("n", [0, 1, 63, 64, 65, 1000, 1 << 20, 12_345_677])
def test_crc32_zeros(n):
    assert int(kernels.crc32_zeros(n)) == zlib.crc32(bytes(n))


def test_crc32_zeros_beyond_4gib_by_arithmetic():
    # crc(zeros(a + b)) == combine(crc(zeros(a)), crc(zeros(b)), b) for b > 4 GiB
    a, b = 1000, (5 << 30) + 3
    assert kernels.crc32_zeros(a + b) == kernels.crc32_combine(
        kernels.crc32_zeros(a), kernels.crc32_zeros(b), b
    )


@pytest.mark.parametrize("n", [0, 1, 63, 64, 65, 1000])
def test_table_crc32_fallback(data, n):
    table = kernels._crc_table()
    assert int(kernels.table_crc32(data[:n], 0, table)) == zlib.crc32(data[:n])
    assert int(kernels.table_crc32(data[:n], 12345, table)) == zlib.crc32(data[:n], 12345)


@given(st.integers(0, 2**32 - 1), st.integers(0, 2**32 - 1), st.integers(0, 5000))
@settings(max_examples=100, deadline=None)
def test_crc32_combine_matches_naive(c1, c2, n):
    c2 = c2 if n else 0  # the CRC of an empty B is 0
    assert int(kernels.crc32_combine(c1, c2, n)) == naive_combine(c1, c2, n)


@pytest.mark.parametrize("n", [0, 1, 63, 64, 65, 300])
def test_table_crc32_matches_bitwise_oracle(data, n):
    table = kernels._crc_table()
    assert int(kernels.table_crc32(data[:n], 99, table)) == naive_table_crc32(data[:n].tobytes(), 99)


# ---------------------------------------------------------------- layout ----
_ALIGNS = st.sampled_from([0, 1, 64, 4096, 65536])


@given(
    st.lists(
        st.tuples(st.integers(1, 300), st.integers(0, 10**6), _ALIGNS, st.integers(0, 3000)), max_size=40
    )
)
@settings(max_examples=200, deadline=None)
def test_plan_layout_matches_naive(entries):
    name_len = [e[0] for e in entries]
    sizes = [e[1] for e in entries]
    align = [e[2] for e in entries]
    more = [e[3] for e in entries]
    header_len = packers.local_header_len(name_len, more, np.array(align) > 1)
    room = 0xFFFF - (header_len - 30 - np.array(name_len, np.int64))
    hoff, pad, payload, end = kernels.plan_layout(
        header_len, np.array(sizes, np.int64), np.array(align, np.int64), room
    )
    oracle, oracle_end = naive_plan(name_len, sizes, align, more)
    assert [tuple(map(int, x)) for x in zip(hoff, pad, payload)] == oracle
    assert int(end) == oracle_end
    assert all(int(p) % a == 0 for p, a in zip(payload, align) if a > 1)


@given(st.lists(st.tuples(st.integers(0, 2**34), st.integers(0, 2**34), _ALIGNS), min_size=1, max_size=20))
@settings(max_examples=100, deadline=None)
def test_plan_beyond_4gib_by_arithmetic_matches_naive(entries):
    """Sizes up to 16 GiB: offsets, zip64 decisions and the central directory length,
    without writing a byte."""
    names = [f"e{i}.memmap" for i in range(len(entries))]
    size = [e[0] for e in entries]
    csize = [min(e[0], e[1]) for e in entries]
    align = [e[2] for e in entries]
    p = layout.plan(names, csize, align, [8] * len(names), size=size)
    oracle, end = naive_plan([len(n) for n in names], csize, align)
    assert [(int(h), int(q), int(x)) for h, q, x in zip(p.header_offset, p.pad, p.payload_offset)] == oracle
    assert p.cd_offset == end
    z = [naive_zip64_fields(s, c, h) for s, c, (h, _, _) in zip(size, csize, oracle)]
    assert p.central_zip64.tolist() == z
    cd = 0
    for n, bits, (_, pad, _), a in zip(names, z, oracle, align):
        cd += (
            46
            + len(n)
            + (4 + 8 * (2 * (bits & 1) + (bits >> 1)) if bits else 0)
            + (4 + pad if pad >= 0 and a == 64 else 0)  # only tensordict's 64-byte padding is copied
        )
    assert p.cd_size == cd


def test_plan_layout_beyond_4gib_offsets_by_arithmetic():
    # three 3 GiB payloads: offsets past 4 GiB need zip64 central fields and end records
    sizes = [3 << 30] * 3
    p = layout.plan(["a.memmap", "b.memmap", "c.memmap"], sizes, [64] * 3, [0] * 3)
    assert all(int(x) % 64 == 0 for x in p.payload_offset)
    assert int(p.header_offset[2]) > 1 << 32
    # sizes > 2 GiB everywhere, header offsets past 2 GiB after the first
    assert list(p.central_zip64) == [packers.ZIP64_SIZES, 3, 3]
    assert p.zip64_end
    assert p.file_size == p.cd_offset + p.cd_size + 56 + 20 + 22


def test_plan_wrapper_and_records_agree_with_zipfile(tmp_path):
    """Headers planned by the kernel and packed by records parse with the stdlib."""
    names = ["meta.json", "a.memmap", "sub/é.memmap"]
    payloads = [b"{}", bytes(range(100)), b"x" * 65]
    n = len(names)
    p = layout.plan(names, [len(x) for x in payloads], [0, 64, 4096], [0] * n)
    kw = dict(
        crc=[zlib.crc32(x) for x in payloads],
        size=p.size,
        csize=p.data_size,
        method=p.methods,
        dos=(0, 33),
        pad=p.pad,
        flags=p.flags,
    )
    buf = bytearray(p.file_size)
    for i, head in enumerate(packers.local_headers(p.names, **kw)):
        h = int(p.header_offset[i])
        assert h + len(head) == int(p.payload_offset[i])
        buf[h : h + len(head)] = head
        buf[int(p.payload_offset[i]) : int(p.payload_offset[i]) + len(payloads[i])] = payloads[i]
    central = packers.central_directory(
        p.names, header_offset=p.header_offset, zip64=p.central_zip64, **{**kw, "pad": p.central_pad}
    )
    assert len(central) == p.cd_size
    buf[p.cd_offset :] = central + packers.end_records(n, p.cd_offset, p.cd_size, p.zip64_end)
    assert int(p.payload_offset[2]) % 4096 == 0
    path = tmp_path / "x.zip"
    path.write_bytes(bytes(buf))
    with zipfile.ZipFile(path) as zf:
        assert zf.testzip() is None
        assert zf.namelist() == names
        assert [zf.read(n) for n in names] == payloads


# ----------------------------------------------------------------- index ----
def _zip_bytes(tmp_path, n_entries=5, method=zipfile.ZIP_STORED):
    path = tmp_path / "s.zip"
    with zipfile.ZipFile(path, "w", compression=method) as zf:
        for i in range(n_entries):
            zf.writestr(f"d{i % 2}/f{i}.bin", bytes([i]) * (i * 37))
    return path, path.read_bytes()


def _index(buf):
    from test_index import eager_index

    end = eocd.find_end_record(buf)
    return eager_index(np.frombuffer(buf, np.uint8), end.cd_offset, end.cd_size, end.count, True)


@pytest.mark.parametrize("method", [zipfile.ZIP_STORED, zipfile.ZIP_DEFLATED])
def test_parse_central_matches_zipfile(tmp_path, method):
    path, buf = _zip_bytes(tmp_path, 7, method)
    fields, status = _index(buf)
    assert status[0] == IndexStatus.OK
    with zipfile.ZipFile(path) as zf:
        for row, info in zip(fields.view(records.INDEX_DTYPE)[:, 0], zf.infolist()):
            start, length = int(row["name_offset"]), int(row["name_len"])
            assert buf[start : start + length].decode() == info.filename
            assert tuple(int(row[k]) for k in ("method", "crc", "csize", "size", "header_offset")) == (
                info.compress_type,
                info.CRC,
                info.compress_size,
                info.file_size,
                info.header_offset,
            )
            # payload offset from the local header's own name/extra lengths
            n, e = np.frombuffer(buf[info.header_offset + 26 : info.header_offset + 30], "<u2")
            assert int(row["payload_offset"]) == info.header_offset + 30 + int(n) + int(e)


def test_parse_central_on_read_only_map(tmp_path):
    path, buf = _zip_bytes(tmp_path)
    with open(path, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as mm:
        arr = np.frombuffer(mm, np.uint8)
        end = eocd.find_end_record(arr)
        from test_index import eager_index

        assert not arr.flags.writeable
        fields, status = eager_index(arr, end.cd_offset, end.cd_size, end.count, True)  # kernels, read-only
        assert status[0] == 0 and fields.shape == (5, len(Col))
        assert fields[:, Col.PAYLOAD_OFFSET].min() > 0
        del arr


def test_parse_central_status_codes(tmp_path):
    _, buf = _zip_bytes(tmp_path)
    end = eocd.find_end_record(buf)
    # bad central signature
    bad = bytearray(buf)
    bad[end.cd_offset] = 0
    assert _index(bytes(bad))[1][0] == IndexStatus.CENTRAL_SIGNATURE
    # local header offset of entry 1 pointing past the data area
    bad = bytearray(buf)
    fields, _ = _index(buf)
    cd1 = int(fields[1, Col.CENTRAL_OFFSET])
    bad[cd1 + 42 : cd1 + 46] = (end.cd_offset + 10).to_bytes(4, "little")
    status = _index(bytes(bad))[1]
    assert (status[0], status[1]) == (IndexStatus.HEADER_PAST_END, 1)
    # local signature broken
    bad = bytearray(buf)
    bad[int(fields[2, Col.HEADER_OFFSET])] = 0
    assert tuple(_index(bytes(bad))[1][:2]) == (IndexStatus.LOCAL_SIGNATURE, 2)
    # two central records pointing at the same local header: overlap
    bad = bytearray(buf)
    bad[cd1 + 42 : cd1 + 46] = int(fields[0, Col.HEADER_OFFSET]).to_bytes(4, "little")
    assert _index(bytes(bad))[1][0] in (IndexStatus.OVERLAP, IndexStatus.NAME_MISMATCH)
    # compressed size running into the central directory
    bad = bytearray(buf)
    cd4 = int(fields[4, Col.CENTRAL_OFFSET])
    bad[cd4 + 20 : cd4 + 28] = (10**6).to_bytes(4, "little") * 2
    assert tuple(_index(bytes(bad))[1][:2]) == (IndexStatus.PAYLOAD_PAST_END, 4)
    # a STORED entry whose uncompressed size differs from its stored size
    bad = bytearray(buf)
    bad[cd4 + 24 : cd4 + 28] = (10**6).to_bytes(4, "little")
    assert tuple(_index(bytes(bad))[1][:2]) == (IndexStatus.STORED_SIZE, 4)
