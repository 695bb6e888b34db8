"""The lean lazy open: rows of the small index built on first use, the local-path fast path
of :func:`tdz_numba.open` (errors as before), and the end-record fast path."""

from __future__ import annotations

import os
import struct
import zipfile
from pathlib import Path

import pytest
import torch

import tdz_numba
from tdz_numba import records, smallindex
from tdz_numba.api import _plain_local_path
from tdz_numba.reader import ArchiveIndex


def _archive(tmp_path: Path, n: int = 5) -> Path:
    return tdz_numba.save({f"k{i}": torch.arange(i + 1) for i in range(n)}, tmp_path / "x.tdz")


def _parsed(data: bytes):
    end = records.find_end_record(data)
    return end, smallindex.parse_small(data, end.cd_offset, end.cd_size, end.count)


def test_rows_are_built_on_first_use(tmp_path):
    data = _archive(tmp_path).read_bytes()
    end, (rows, names, by_name) = _parsed(data)
    assert isinstance(rows, smallindex.SmallRows) and len(rows) == len(names) == 6
    assert rows._rows == [None] * 6  # nothing built by the parse
    row = rows[2]
    assert rows[2] is row and rows._rows.count(None) == 5  # the same list on every access
    assert rows[-1] is rows[5] and rows[-1][records.Col.NEXT_OFFSET] == end.cd_offset
    with pytest.raises(IndexError):
        rows[6]
    every = list(rows)
    assert every[2] is row and None not in rows._rows
    with zipfile.ZipFile(tmp_path / "x.tdz") as z:
        infos = z.infolist()
    for i, info in enumerate(infos):  # the values zipfile reads
        r = every[i]
        assert names[i] == info.filename and by_name[info.filename] == i
        assert (r[records.Col.CRC], r[records.Col.SIZE], r[records.Col.HEADER_OFFSET]) == (
            info.CRC,
            info.file_size,
            info.header_offset,
        )
        nxt = infos[i + 1].header_offset if i + 1 < len(infos) else end.cd_offset
        assert r[records.Col.NEXT_OFFSET] == nxt and r[records.Col.PAYLOAD_OFFSET] == -1


def test_rows_come_from_the_checked_copy(tmp_path):
    """A row built after the parse reads the central directory as it was checked, not as
    the (shared, changeable) bytes are now."""
    data = bytearray(_archive(tmp_path).read_bytes())
    end, (rows, _, _) = _parsed(bytes(data))
    end2 = records.find_end_record(data)
    found = smallindex.parse_small(data, end2.cd_offset, end2.cd_size, end2.count)
    assert found is not None
    lazy = found[0]
    data[end.cd_offset : end.cd_offset + end.cd_size] = bytes(end.cd_size)  # wiped after the parse
    assert list(lazy) == list(rows)


def test_index_values_match_the_kernel_path(tmp_path, monkeypatch):
    from tdz_numba import reader

    p = _archive(tmp_path, 30)
    small = ArchiveIndex(p)
    assert small._small is not None
    got = [tuple(small.row_at(i)) for i in range(len(small.names))]
    assert [small.payload_offset(i) for i in range(len(small.names))]
    monkeypatch.setattr(reader, "SMALL_ENTRIES", -1)
    with monkeypatch.context() as m:
        m.setattr(reader, "_small_enough", lambda count: False)
        ref = ArchiveIndex(p)
        assert ref._small is None
        want = [tuple(ref.row_at(i)) for i in range(len(ref.names))]
        assert [ref.payload_offset(i) for i in range(len(ref.names))]
    assert got == want
    assert small._cols.tolist() == ref._cols.tolist()


def test_zip64_values_in_lazy_rows(tmp_path):
    import sys

    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from fuzz.zipmodel import to_zip64

    seed = _archive(tmp_path, 3)
    data = to_zip64(seed.read_bytes())
    end, (rows, names, _) = _parsed(data)
    _, (plain, _, _) = _parsed(seed.read_bytes())
    assert end.zip64 and rows._zip64
    for i in range(len(names)):  # sizes and offsets as the plain archive's, read from zip64 extras
        a, b = rows[i], plain[i]
        assert a[records.Col.SIZE] == b[records.Col.SIZE] and a[records.Col.CSIZE] == b[records.Col.CSIZE]
    p = tmp_path / "z64.tdz"
    p.write_bytes(data)
    with tdz_numba.open(p) as ar:
        assert ar["k2"].tolist() == [0, 1, 2]


@pytest.mark.parametrize("where", ["records", "local"])
def test_malformed_records_still_refused(tmp_path, where):
    p = _archive(tmp_path)
    data = bytearray(p.read_bytes())
    end = records.find_end_record(bytes(data))
    second = data.index(b"PK\x01\x02", end.cd_offset + 1)
    if where == "records":  # the second record's size runs over the next header
        data[second + 20 : second + 28] = struct.pack("<II", 200, 200)
        assert _parsed(bytes(data))[1] is None
        p.write_bytes(bytes(data))
        with pytest.raises(tdz_numba.BadArchiveError, match="overlapping the next record"):
            tdz_numba.open(p)
    else:  # a bad local header is found when the entry is first read (lazily), as before
        hoff = struct.unpack_from("<I", data, second + 42)[0]
        data[hoff : hoff + 4] = b"PK\x00\x00"
        p.write_bytes(bytes(data))
        with tdz_numba.open(p) as ar:
            with pytest.raises(tdz_numba.BadArchiveError, match="local header signature"):
                ar["k0"]


def test_plain_local_path():
    assert _plain_local_path(Path("/a/b.tdz")) == Path("/a/b.tdz")
    assert _plain_local_path("/a/b.tdz") == Path("/a/b.tdz")
    for other in ("s3://bucket/x.tdz", "file:///a/b.tdz", "simplecache::s3://b/x", "a:b", b"/a", 3):
        assert _plain_local_path(other) is None


def test_open_paths_and_errors_unchanged(tmp_path):
    p = _archive(tmp_path)
    for given in (p, str(p), os.fsencode(p), f"file://{p}"):
        with tdz_numba.open(given) as ar:
            assert ar["k1"].tolist() == [0, 1]
    colon = tmp_path / "a:b.tdz"  # a local name with a colon takes the general path
    colon.write_bytes(p.read_bytes())
    with tdz_numba.open(str(colon)) as ar:
        assert list(ar) == [f"k{i}" for i in range(5)]
    missing = tmp_path / "missing.tdz"
    for given in (missing, str(missing)):
        with pytest.raises(tdz_numba.FileMissingError, match=f"cannot open {missing}: no such file") as ei:
            tdz_numba.open(given)
        assert isinstance(ei.value, FileNotFoundError) and ei.value.filename == str(missing)
    with pytest.raises(tdz_numba.UnsupportedError, match="URLs are not supported"):
        tdz_numba._paths.as_local_path("s3://bucket/x.tdz")
    with pytest.raises(tdz_numba.UnsupportedError, match="a directory that is neither"):
        tdz_numba.open(tmp_path)
    if os.geteuid() != 0:  # root reads anything
        p.chmod(0)
        with pytest.raises(tdz_numba.AccessDeniedError):
            tdz_numba.open(p)


def test_end_record_fast_path_values(tmp_path):
    p = _archive(tmp_path)
    data = p.read_bytes()
    end = records.find_end_record(data)
    with zipfile.ZipFile(p) as z:
        assert end.count == len(z.infolist())
    assert end.end_offset == len(data) - 22 and not end.zip64
    with pytest.raises(tdz_numba.BadArchiveError, match="shorter than the 22-byte"):
        records.find_end_record(data[-21:])
    bad = bytearray(data)
    bad[-10:-6] = struct.pack("<I", end.cd_size + 10**6)  # a central directory size past the file
    with pytest.raises(tdz_numba.BadArchiveError, match="runs past its end record"):
        records.find_end_record(bytes(bad))
