"""The lean lazy open: rows of the small index built on first use, the local-path fast path
of :func:`tdz_numba.open` (errors as before), and the end-record fast path."""

from __future__ import annotations

import gc
import os
import struct
import zipfile
from pathlib import Path

import pytest
import torch

import tdz_numba
from tdz_numba.api import _plain_local_path
from tdz_numba.jit import policy
from tdz_numba.zipfmt import central, eocd, records
from tdz_numba.zipfmt.index import ArchiveIndex


def _archive(tmp_path: Path, n: int = 5) -> Path:
    return tdz_numba.save({f"k{i}": torch.arange(i + 1) for i in range(n)}, tmp_path / "x.tdz")


def _parsed(data: bytes):
    """``(end, (rows, names, by_name))``; None for ``(rows, ...)`` when the parse or the names refuse it."""
    end = eocd.find_end_record(data)
    found = central.read_central(data, end)
    try:
        names, by_name = central.check_central(found, "x", end, len(data))
    except tdz_numba.TdzError:
        return end, None
    return end, (found.rows, names, by_name)


@pytest.mark.parametrize("mode", ["always", "never"])
def test_rows_are_built_on_first_use(tmp_path, mode):
    data = _archive(tmp_path).read_bytes()
    with policy.forced(mode):
        end, (rows, names, by_name) = _parsed(data)
    assert isinstance(rows, central.CentralRows) and len(rows) == len(names) == 6
    assert rows.kernel_columns == (mode == "always")
    assert rows._rows is None  # nothing built by the parse
    row = rows[2]
    assert rows[2] is row and rows._rows.count(None) == 5  # type: ignore[union-attr]  # the same list on every access
    assert rows[-1] is rows[5] and rows[-1][records.Col.NEXT_OFFSET] == end.cd_offset
    with pytest.raises(IndexError):
        rows[6]
    every = list(rows)
    assert every[2] is row and None not in rows._rows  # type: ignore[operator]
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
    with policy.forced("never"):  # (the kernel's columns are all built at once)
        lazy = central.read_central(data, eocd.find_end_record(data)).rows
    assert not lazy.kernel_columns
    data[end.cd_offset : end.cd_offset + end.cd_size] = bytes(end.cd_size)  # wiped after the parse
    assert list(lazy) == list(rows)


def test_index_values_match_the_kernel_path(tmp_path, monkeypatch):
    from tdz_numba.zipfmt import index as reader

    p = _archive(tmp_path, 30)
    small = ArchiveIndex(p)
    assert small._small is not None
    got = [tuple(small.row_at(i)) for i in range(len(small.names))]
    assert [small.payload_offset(i) for i in range(len(small.names))]
    monkeypatch.setattr(reader, "SMALL_ENTRIES", -1)  # mapped, the kernel's columns at once
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
    for mode in ("always", "never"):
        with policy.forced(mode):
            end, (rows, names, _) = _parsed(data)
            _, (plain, _, _) = _parsed(seed.read_bytes())
        assert end.zip64 and (mode == "always" or rows._zip64)
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
    end = eocd.find_end_record(bytes(data))
    second = data.index(b"PK\x01\x02", end.cd_offset + 1)
    if where == "records":  # the second record's size runs over the next header
        data[second + 20 : second + 28] = struct.pack("<II", 200, 200)
        assert _parsed(bytes(data))[1] is None
        end = eocd.find_end_record(bytes(data))
        assert central.read_central(bytes(data), end).status[:2] == (records.Status.OVERLAP, 1)
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
        tdz_numba.files.paths.as_local_path("s3://bucket/x.tdz")
    with pytest.raises(tdz_numba.UnsupportedError, match="a directory that is neither"):
        tdz_numba.open(tmp_path)
    if os.geteuid() != 0:  # root reads anything
        p.chmod(0)
        with pytest.raises(tdz_numba.AccessDeniedError):
            tdz_numba.open(p)


def test_end_record_fast_path_values(tmp_path):
    p = _archive(tmp_path)
    data = p.read_bytes()
    end = eocd.find_end_record(data)
    with zipfile.ZipFile(p) as z:
        assert end.count == len(z.infolist())
    assert end.end_offset == len(data) - 22 and not end.zip64
    with pytest.raises(tdz_numba.BadArchiveError, match="shorter than the 22-byte"):
        eocd.find_end_record(data[-21:])
    bad = bytearray(data)
    bad[-10:-6] = struct.pack("<I", end.cd_size + 10**6)  # a central directory size past the file
    with pytest.raises(tdz_numba.BadArchiveError, match="runs past its end record"):
        eocd.find_end_record(bytes(bad))


# -- the open reads the tail with pread; the file is mapped on first use --------------------------
def _fd_open(fd: int) -> bool:
    try:
        os.fstat(fd)
    except OSError:
        return False
    return True


def test_keys_without_mapping_then_mapped_on_first_leaf(tmp_path):
    p = _archive(tmp_path)
    with tdz_numba.open(p) as ar:
        ix = ar.source.index
        assert list(ar) == [f"k{i}" for i in range(5)]
        assert ix._map is None and ix._fd is not None  # keys: nothing mapped
        fd = ix._fd
        assert ar["k3"].tolist() == [0, 1, 2, 3]
        assert ix._map is not None and ix._fd is None and not _fd_open(fd)
    with tdz_numba.open(p) as ar:  # closed before anything was mapped: the descriptor too
        fd = ar.source.index._fd
    assert not _fd_open(fd)
    ix = ArchiveIndex(p)
    fd = ix._fd
    del ix  # dropped unclosed
    assert not _fd_open(fd)


def test_held_descriptors_are_capped(tmp_path, monkeypatch):
    from tdz_numba.zipfmt import lazymap

    monkeypatch.setattr(lazymap, "MAX_HELD_DESCRIPTORS", lazymap.held_descriptors() + 3)
    p = _archive(tmp_path)
    before = lazymap.held_descriptors()
    opened = [tdz_numba.open(p) for _ in range(10)]  # opened, nothing read yet
    try:
        held = [ar for ar in opened if ar.source.index._fd is not None]
        assert len(held) == 3 and lazymap.held_descriptors() == before + 3
        for ar in opened[3:]:  # beyond the cap: mapped at open, no descriptor kept
            assert ar.source.index._map is not None and ar.source.index._fd is None
        assert [ar["k3"].tolist() for ar in opened] == [[0, 1, 2, 3]] * 10
        assert lazymap.held_descriptors() == before  # mapped on first use: the descriptors are released
    finally:
        for ar in opened:
            ar.close()
    unread = [tdz_numba.open(p) for _ in range(3)]
    assert lazymap.held_descriptors() == before + 3
    for ar in unread:
        ar.close()
    ix = ArchiveIndex(p)
    assert lazymap.held_descriptors() == before + 1
    del ix  # dropped unclosed
    assert lazymap.held_descriptors() == before


def test_deferred_index_reads_as_the_mapped_one(tmp_path):
    p = tdz_numba.save({"a": torch.arange(3), "b": {"c": torch.ones(2)}, "s": "text"}, tmp_path / "x.tdz")
    lazy = ArchiveIndex(p)
    assert lazy._fd is not None
    meta = lazy.read_bytes("meta.json")  # by pread, the local header checked
    assert lazy._map is None and lazy._small[0][records.Col.PAYLOAD_OFFSET] >= 0
    with open(p, "rb") as f:
        mapped = ArchiveIndex(p, fd=f.fileno(), st=os.fstat(f.fileno()), mapping=None)
    mapped.buffer  # noqa: B018 - maps it
    assert meta == mapped.read_bytes("meta.json") and lazy.names == mapped.names
    assert [lazy.payload_offset(i) for i in range(len(lazy.names))] == [
        mapped.payload_offset(i) for i in range(len(mapped.names))
    ]
    assert lazy._cols.tolist() == mapped._cols.tolist()


def test_size_change_before_mapping(tmp_path):
    """A file that grew since the open (an append writes nothing before the old end) is mapped
    at its opened size; one that shrank is refused."""
    p = _archive(tmp_path)
    with tdz_numba.open(p) as ar:
        list(ar)
        with open(p, "ab") as f:
            f.write(b"x")
        assert ar["k1"].numel() > 0
    p = _archive(tmp_path)
    size = p.stat().st_size
    with tdz_numba.open(p) as ar:
        list(ar)
        os.truncate(p, size - 2)
        with pytest.raises(tdz_numba.BadArchiveError, match="shrank since it was opened"):
            ar["k1"]


@pytest.mark.parametrize("damage", ["crc", "header", "name"])
def test_bad_meta_json_entry_errors_unchanged(tmp_path, damage):
    """A meta.json read by pread that is not as recorded: the mapped path names the problem."""
    p = _archive(tmp_path)
    data = bytearray(p.read_bytes())
    assert data[30:39] == b"meta.json"
    if damage == "crc":
        # the payload's first byte (after the 30-byte header, the name and the extra field): a bare
        # index of "{" could land on the header's DOS time or CRC bytes, which vary with the clock
        name_len, extra_len = struct.unpack_from("<HH", data, 26)
        start = 30 + name_len + extra_len
        assert data[start : start + 1] == b"{"
        data[start + 1] ^= 1
        want = (tdz_numba.ChecksumError, "CRC-32 mismatch")
    elif damage == "header":
        data[0:4] = b"PK\x00\x00"
        want = (tdz_numba.BadArchiveError, "local header signature")
    else:
        data[30:34] = b"xeta"
        want = (tdz_numba.BadArchiveError, "local header name differs")
    p.write_bytes(bytes(data))
    with pytest.raises(want[0], match=want[1]):
        tdz_numba.open(p)


def test_unusual_tails_take_the_mapped_path(tmp_path):
    import sys

    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from fuzz.zipmodel import to_zip64

    seed = _archive(tmp_path, 3)
    comment = seed.read_bytes()[:-2] + struct.pack("<H", 4) + b"note"
    for name, blob in {"comment": comment, "zip64": to_zip64(seed.read_bytes())}.items():
        q = tmp_path / f"{name}.tdz"
        q.write_bytes(blob)
        assert central.parse_tail(blob[-65536:], len(blob)) is None
        ix = ArchiveIndex(q)
        assert ix._fd is None and ix._map is not None and ix._small is not None
        with tdz_numba.open(q) as ar:
            assert ar["k2"].tolist() == [0, 1, 2]


def test_big_central_directory_takes_the_mapped_path(tmp_path, monkeypatch):
    from tdz_numba.zipfmt import index as reader

    p = _archive(tmp_path, 8)
    calls = []
    real = os.pread
    monkeypatch.setattr(os, "pread", lambda fd, n, off: calls.append((off, n)) or real(fd, n, off))
    monkeypatch.setattr(reader, "_TAIL_BYTES", 64)  # the central directory is not in the tail read:
    ix = ArchiveIndex(p)  # a second pread from where it starts
    end = eocd.find_end_record(p.read_bytes())
    assert ix._fd is not None and calls == [(p.stat().st_size - 64, 64), (end.cd_offset, end.cd_size + 22)]
    assert ix.read_bytes("k3.memmap") == torch.arange(4).numpy().tobytes()
    monkeypatch.setattr(reader, "_TAIL_MAX", 64)  # too far back: mapped
    ix = ArchiveIndex(p)
    assert ix._fd is None and ix._small is not None
    monkeypatch.setattr(reader, "_TAIL_BYTES", 1 << 16)
    monkeypatch.setattr(reader, "SMALL_ENTRIES", 3)  # more entries than the small index takes
    assert ArchiveIndex(p)._fd is None


def test_parse_tail_matches_find_end_record(tmp_path):
    data = _archive(tmp_path, 12).read_bytes()
    end, (rows, names, by_name) = _parsed(data)
    for n in (len(data), 4096, end.cd_size + 22, 23):
        found = central.parse_tail(data[-n:], len(data))
        if n < end.cd_size + 22:
            assert found is None
            continue
        assert found[0] == end and central.check_central(found[1], "x", end, len(data)) == (names, by_name)
        assert list(found[1].rows) == list(rows)
    assert central.parse_tail(data, len(data), max_count=len(names) - 1) is None
    assert central.parse_tail(b"", 0) is None and central.parse_tail(data[:-1], len(data) - 1) is None


def test_mutated_archives_read_first_as_the_kernel_path(tmp_path):
    """The fuzz harness's mutated archives: read meta.json first (by pread on the small path)
    gives what the kernel path gives, errors included."""
    import sys

    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from fuzz.runner import make_cases
    from fuzz.seeds import make_seeds

    from tdz_numba.zipfmt import index as reader

    def first_reads(path: Path, small: bool) -> list:
        old = reader.SMALL_ENTRIES
        reader.SMALL_ENTRIES = old if small else -1
        try:
            try:
                ix = ArchiveIndex(path)
            except tdz_numba.TdzError as exc:
                return ["open", type(exc).__name__, str(exc)]
            out: list = [ix.names]
            for name in ix.names[:4]:
                try:
                    out.append(ix.read_bytes(name))
                except tdz_numba.TdzError as exc:
                    out.append((type(exc).__name__, str(exc)))
            out.append([tuple(r) for r in ix.rows])
            ix.close()
            return out
        finally:
            reader.SMALL_ENTRIES = old

    seeds = make_seeds(tmp_path / "seeds")
    p = tmp_path / "case.tdz"
    for case in make_cases(seeds, "open-fast-1", 0, 400):
        p.write_bytes(case.data)
        assert first_reads(p, True) == first_reads(p, False)


def test_open_and_keys_read_the_file_twice(tmp_path, monkeypatch):
    """Format detection reads the first 4 KiB, the index the last 16 KiB; the root meta.json,
    inside the first bytes, is not read again; nothing is mapped."""
    p = _archive(tmp_path)
    calls = []
    real = os.pread
    monkeypatch.setattr(os, "pread", lambda fd, n, off: calls.append(off) or real(fd, n, off))
    with tdz_numba.open(p) as ar:
        assert list(ar) == [f"k{i}" for i in range(5)] and ar.source.index._map is None
        assert calls == [0, 0]  # (the file is smaller than 16 KiB: its tail is the whole file)
        big = tdz_numba.save({"m": torch.zeros(5000), "s": "x" * 5000}, tmp_path / "big.tdz")
    calls.clear()
    with tdz_numba.open(big) as ar:  # a meta.json past the first 4 KiB: read with pread
        ix = ar.source.index
        assert ar["s"] == "x" * 5000 and ix._map is None
        assert calls[2:] == [ix.row_at(ix.row("s/meta.json")).header_offset]  # type: ignore[arg-type]


def test_tail_start():
    data = _zip_bytes()
    end = eocd.find_end_record(data)
    assert central.tail_start(data[-30:], len(data)) == end.cd_offset
    assert central.tail_start(data, len(data)) is None  # the whole file: nothing before it
    assert central.tail_start(data[-30:], len(data), max_count=0) is None
    assert central.tail_start(b"x" * 30, len(data)) is None and central.tail_start(b"", 10) is None


def _zip_bytes() -> bytes:
    import io

    buf = io.BytesIO()
    with zipfile.ZipFile(buf, "w") as z:
        z.writestr("meta.json", "{}")
        z.writestr("a", "12345")
    return buf.getvalue()


def _open_fds() -> int:
    return len(os.listdir("/proc/self/fd"))


@pytest.mark.skipif(not os.path.isdir("/proc/self/fd"), reason="needs /proc/self/fd")
def test_sniff_hands_its_descriptor_to_the_index(tmp_path):
    """The detection's descriptor is the one the index keeps (no dup): closed exactly once, on
    success, on close and on every refusal."""
    from tdz_numba.formats.detect import sniff

    p = _archive(tmp_path)
    gc.collect()  # (mappings of earlier tests' garbage hold descriptors: closed before counting)
    before = _open_fds()
    name, index = sniff(p)
    assert name == "tdz" and index._fd is not None and _open_fds() == before + 1
    index.close()
    assert index._fd is None and _open_fds() == before
    ar = tdz_numba.open(p)
    assert ar["k2"].tolist() == [0, 1, 2]  # mapped (the mapping holds a descriptor of its own)
    ar.close()
    del ar
    gc.collect()
    assert _open_fds() == before
    bad = tmp_path / "bad.tdz"  # a central directory the index refuses (its signature)
    data = bytearray(p.read_bytes())
    end = eocd.find_end_record(bytes(data))
    data[end.cd_offset] ^= 0xFF
    bad.write_bytes(bytes(data))
    with pytest.raises(tdz_numba.BadArchiveError, match="central"):
        tdz_numba.open(bad)
    other = tmp_path / "other.zip"  # a zip that is no tensor file: the index closes it
    with zipfile.ZipFile(other, "w") as z:
        z.writestr("readme.txt", "x")
    with pytest.raises(tdz_numba.UnsupportedError):
        sniff(other)
    assert _open_fds() == before


def test_mode_reads_the_environment_as_set(monkeypatch):
    monkeypatch.delenv("TDZ_NUMBA_KERNELS", raising=False)
    assert policy.mode() == "auto"
    monkeypatch.setenv("TDZ_NUMBA_KERNELS", " Never ")
    assert policy.mode() == "never" and not policy.use_kernels(10**9)
    monkeypatch.setenv("TDZ_NUMBA_KERNELS", "always")
    assert policy.mode() == "always" and policy.use_kernels(0)
    monkeypatch.setenv("TDZ_NUMBA_KERNELS", "")
    assert policy.mode() == "auto"
    monkeypatch.setenv("TDZ_NUMBA_KERNELS", "sometimes")
    with pytest.raises(tdz_numba.InvalidArgumentError, match="'sometimes'"):
        policy.mode()
    with policy.forced("never"):
        assert policy.mode() == "never"


def test_parse_meta_names_the_place_on_error_only():
    from tdz_numba.tdz.bounds import parse_meta

    calls = []

    def where(name):
        calls.append(name)
        return f"f.tdz: {name}"

    assert parse_meta(b'{"a": 1}', where, "a/meta.json") == {"a": 1} and calls == []
    with pytest.raises(tdz_numba.BadArchiveError, match=r"^f.tdz: a/meta.json: not valid JSON"):
        parse_meta(b'{"a": ', where, "a/meta.json")
    assert calls == ["a/meta.json"]
    with pytest.raises(tdz_numba.BadArchiveError, match=r"^x: not valid JSON"):
        parse_meta(b"[", "x")
