"""records.py: record descriptions, the one zip64 decision, packers and the end-record reader."""

import io
import re
import zipfile
from pathlib import Path

import numpy as np
import pytest
from naive import naive_archive, naive_central_record, naive_zip64_fields

from tdz_numba.errors import BadArchiveError, TdzError, UnsupportedError
from tdz_numba.zipfmt import eocd, layout, packers, records

GIB = 1 << 30
PACKAGE = Path(__file__).resolve().parent.parent / "tdz_numba"


def test_offsets_are_spelled_only_in_records():
    """Record offsets and sizes live in records.py; other modules use the names."""
    pattern = re.compile(
        r"(\+ ?(14|16|18|22|26|28|30|42|46)\b)|\b\d+ ?\* ?46\b|<I22xHH|<4sHHHHIIH|<I4xHH|<IHHHHHH"
    )
    offenders = []
    wings = ("zipfmt", "archive", "remote")  # every module that reads or writes zip records
    paths = sorted(p for w in wings for p in (PACKAGE / w).rglob("*.py") if p.name != "records.py")
    assert len(paths) > 20
    for path in paths:
        for n, line in enumerate(path.read_text().splitlines(), 1):
            if pattern.search(line.split("#")[0]):
                offenders.append(f"{path.name}:{n}: {line.strip()}")
    assert offenders == []


@pytest.mark.parametrize(
    "size, csize, hoff",
    [
        (0, 0, 0),
        (records.ZIP64_LIMIT, records.ZIP64_LIMIT, records.ZIP64_LIMIT),
        (records.ZIP64_LIMIT + 1, 10, 0),
        (10, records.ZIP64_LIMIT + 1, 0),
        (10, 10, records.ZIP64_LIMIT + 1),
        (2 * GIB + 64, 2 * 1024 * 1024, 0),
        (5 * GIB, 5 * GIB, 9 * GIB),
        (1 << 62, 1, 1 << 40),
    ],
)
def test_central_zip64_matches_zipfile_rule(size, csize, hoff):
    assert int(packers.central_zip64([size], [csize], [hoff])[0]) == naive_zip64_fields(size, csize, hoff)
    got = packers.central_directory(
        [b"x.memmap"],
        crc=[7],
        size=[size],
        csize=[csize],
        method=[8],
        dos=(0, 33),
        pad=[-1],
        flags=[0],
        header_offset=[hoff],
        zip64=packers.central_zip64([size], [csize], [hoff]),
    )
    assert got == naive_central_record(
        b"x.memmap",
        crc=7,
        size=size,
        csize=csize,
        method=8,
        dos=(0, 33),
        pad=None,
        flags=0,
        header_offset=hoff,
    )
    assert len(got) == int(
        packers.central_record_len([8], packers.central_zip64([size], [csize], [hoff]), [-1])[0]
    )


def test_deflated_leaf_over_2gib_plans_the_central_directory_it_writes():
    """Regression: a deflated leaf of 2 GiB + 64 zero bytes compresses to a few MiB; the
    plan must still give its central record the zip64 sizes (it used to look at the
    stored size only, and save failed with 'central directory size differs')."""
    names = ["meta.json", "big.memmap", "small.memmap"]
    size = [100, 2 * GIB + 64, 10]
    csize = [100, 2_100_000, 10]
    methods = [records.STORED, records.DEFLATED, records.STORED]
    p = layout.plan(names, csize, [0, 0, 64], methods, size=size, local_more=[0, 2000, 0])
    assert list(p.central_zip64) == [0, packers.ZIP64_SIZES, 0]
    cd = packers.central_directory(
        p.names,
        crc=[1, 2, 3],
        size=p.size,
        csize=p.data_size,
        method=p.methods,
        dos=(0, 33),
        pad=p.pad,
        flags=p.flags,
        header_offset=p.header_offset,
        zip64=p.central_zip64,
    )
    assert len(cd) == p.cd_size
    heads = packers.local_headers(
        p.names,
        crc=[1, 2, 3],
        size=p.size,
        csize=p.data_size,
        method=p.methods,
        dos=(0, 33),
        pad=p.pad,
        flags=p.flags,
        more=[b"", bytes(2000), b""],
    )
    assert [int(h) + len(x) for h, x in zip(p.header_offset, heads)] == [int(x) for x in p.payload_offset]


def test_plan_matches_naive_archive_and_zipfile(tmp_path):
    names = ["meta.json", "a.memmap", "sub/é.memmap", "b.memmap"]
    payloads = [b"{}", bytes(range(100)), b"x" * 65, b"y" * 64]
    align = [0, 64, 4096, 1]
    p = layout.plan(names, [len(x) for x in payloads], align, [0] * 4)
    expected = naive_archive(names, payloads, align, dos=(0, 33))
    crc = [zipfile.crc32(x) for x in payloads]
    kw = dict(
        crc=crc, size=p.size, csize=p.data_size, method=p.methods, dos=(0, 33), pad=p.pad, flags=p.flags
    )
    buf = bytearray(p.file_size)
    for i, head in enumerate(packers.local_headers(p.names, **kw)):
        h = int(p.header_offset[i])
        buf[h : h + len(head) + len(payloads[i])] = head + payloads[i]
    buf[p.cd_offset :] = packers.central_directory(
        p.names, header_offset=p.header_offset, zip64=p.central_zip64, **{**kw, "pad": p.central_pad}
    ) + packers.end_records(4, p.cd_offset, p.cd_size, False)
    assert bytes(buf) == expected
    with zipfile.ZipFile(io.BytesIO(expected)) as zf:
        assert [zf.read(n) for n in names] == payloads


def test_plan_refuses_bad_alignments_and_long_names():
    from tdz_numba.errors import InvalidArgumentError, InvalidTreeError

    with pytest.raises(InvalidArgumentError):
        layout.plan(["a"], [1], [3], [0])
    # a padding larger than a 16-bit extra length holds starts the header later (a gap) instead
    p = layout.plan(["x", "a"], [5, 1], [0, 1 << 17], [0, 0])
    assert int(p.payload_offset[1]) % (1 << 17) == 0 and 0 <= int(p.pad[1]) <= 0xFFFF - 24
    assert int(p.header_offset[1]) > 30 + 1 + 20 + 5  # the gap after the first entry
    with pytest.raises(InvalidArgumentError):  # other extra blocks leave no room for a padding block
        layout.plan(["a"], [1], [64], [0], local_more=[0xFFFF])
    with pytest.raises(InvalidTreeError):
        layout.plan(["x" * 70_000], [1], [0], [0])


# ----------------------------------------------------------------- end records ----
def _zip(zip64=False, comment=b""):
    p = layout.plan(["a"], [3], [0], [0])
    kw = dict(crc=[zipfile.crc32(b"abc")], size=[3], csize=[3], method=[0], dos=(0, 33), pad=[-1], flags=[0])
    head = packers.local_headers(p.names, **kw)[0]
    cd = packers.central_directory(p.names, header_offset=[0], zip64=[0], **kw)
    end = packers.end_records(1, p.cd_offset, p.cd_size, zip64)
    if comment:
        end = end[:-2] + len(comment).to_bytes(2, "little") + comment
    return head + b"abc" + cd + end


@pytest.mark.parametrize("zip64", [False, True])
def test_end_records_round_trip_and_zipfile(zip64):
    buf = _zip(zip64, b"hello")
    end = eocd.find_end_record(buf)
    assert (end.count, end.cd_offset, end.zip64) == (1, 30 + 1 + 20 + 3, zip64)
    with zipfile.ZipFile(io.BytesIO(buf)) as zf:
        assert zf.read("a") == b"abc"


@pytest.mark.parametrize("zip64", [False, True])
def test_find_end_record_never_raises_anything_but_tdz_errors(zip64):
    """Every byte of the end records set to 0x00, 0xFF and random values."""
    buf = _zip(zip64)
    tail = records.End.SIZEOF + (records.Zip64End.SIZEOF + records.Zip64Locator.SIZEOF if zip64 else 0)
    rng = np.random.default_rng(1)
    for pos in range(len(buf) - tail, len(buf)):
        for value in (0, 0xFF, int(rng.integers(256))):
            bad = bytearray(buf)
            bad[pos] = value
            try:
                end = eocd.find_end_record(bytes(bad))
            except TdzError:
                continue
            assert 0 <= end.cd_offset <= end.cd_offset + end.cd_size <= end.end_offset <= len(bad)


def test_find_end_record_huge_values_are_out_of_range():
    buf = bytearray(_zip(True))
    z = len(buf) - 22 - 20 - 56
    buf[z + records.Zip64End.CD_OFFSET : z + records.Zip64End.CD_OFFSET + 8] = (2**64 - 5).to_bytes(
        8, "little"
    )
    with pytest.raises(BadArchiveError) as info:
        eocd.find_end_record(bytes(buf), "x.zip")
    assert info.value.found > len(buf) and info.value.path == "x.zip"
    buf = bytearray(_zip(True))
    loc = len(buf) - 22 - 20
    buf[loc + records.Zip64Locator.END_OFFSET : loc + 16] = (2**63 + 7).to_bytes(8, "little")
    with pytest.raises(BadArchiveError) as info:
        eocd.find_end_record(bytes(buf))
    assert (info.value.offset, info.value.found) == (loc, 2**63 + 7)


def test_find_end_record_attributes():
    with pytest.raises(BadArchiveError) as info:
        eocd.find_end_record(b"PK\x05\x06", "t.zip")
    assert (info.value.path, info.value.expected, info.value.found) == ("t.zip", 22, 4)
    buf = bytearray(_zip())
    buf[-22 + records.End.DISK] = 1
    with pytest.raises(UnsupportedError):
        eocd.find_end_record(bytes(buf))
    buf = bytearray(_zip())
    buf[-22 + records.End.COUNT] = buf[-22 + records.End.DISK_COUNT] = 200  # 200 records in 47 bytes
    with pytest.raises(BadArchiveError) as info:
        eocd.find_end_record(bytes(buf))
    assert info.value.expected == 200 * 46 and info.value.found == 46 + 1
