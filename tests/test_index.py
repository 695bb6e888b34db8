"""The reader's index under hostile input: overflow-safe bounds, STORED sizes, deep names,
error attributes, and the argument checks every entry point shares."""

import io
import zipfile
import zlib

import numpy as np
import pytest
import torch
from naive import naive_archive, naive_central_record, naive_end_records, naive_index, naive_local_header

import tdz_numba
from tdz_numba.errors import BadArchiveError, InvalidArgumentError, TdzError
from tdz_numba.zipfmt import central, eocd, records
from tdz_numba.zipfmt.index import ArchiveIndex
from tdz_numba.zipfmt.kernels import central as kernels
from tdz_numba.zipfmt.kernels import central_twin
from tdz_numba.zipfmt.records import Col, Status

DOS = (0, 33)
META = (
    b'{"a": {"device": "cpu", "shape": [2], "dtype": "torch.float32", "is_nested": false}, "shape": [], '
    b'"device": null, "_type": "<class \'tensordict._td.TensorDict\'>", "_format_version": 1, '
    b'"_class": "tensordict:TensorDict"}'
)
DATA = np.arange(2, dtype=np.float32).tobytes()


def _crafted(*, hoff=None, csize=None, size=None) -> bytes:
    """meta.json + a.memmap, with the central record of a.memmap lying about
    its header offset or sizes (values up to 2**64 - 1, in the zip64 extra)."""
    out, central = b"", b""
    for name, data, pad in ((b"meta.json", META, None), (b"a.memmap", DATA, 0)):
        if pad is not None:
            pad = -(len(out) + 30 + len(name) + 4 + 20) % 64
        kw = dict(crc=zlib.crc32(data), size=len(data), csize=len(data), method=0, dos=DOS, pad=pad, flags=0)
        h = len(out)
        out += naive_local_header(name, **kw) + data
        if name == b"a.memmap":
            kw.update(size=len(data) if size is None else size, csize=len(data) if csize is None else csize)
            h = h if hoff is None else hoff
        central += naive_central_record(name, header_offset=h, **kw)
    return out + central + naive_end_records(2, len(out), len(central))


def eager_index(buf, cd_offset: int, cd_size: int, count: int, check_local: bool, twin: bool = False):
    """``(cols, status)``: the index the central-directory kernels (or, ``twin``, their twins)
    build over a whole archive ``buf`` (a uint8 array), as an eager open does: the central
    directory parsed, then (``check_local``) every local header checked in the mapping,
    before the trailing count is reported."""
    buf = np.asarray(buf)
    if not eocd.central_directory_fits(buf.size, cd_offset, cd_size, count):
        return np.zeros((0, len(Col)), np.int64), np.array([Status.CENTRAL_OVERRUN, -1, buf.size, cd_offset])
    cd = buf[cd_offset : cd_offset + cd_size]
    if twin:
        found = central_twin.parse_central(cd, cd_offset, count)
        cols, status = found.rows.array(), np.array(found.status, np.int64)
    else:
        cols = np.zeros((count, len(Col)), np.int64)
        out = np.zeros(kernels.OUT_LEN, np.int64)
        kernels.parse_central(
            cd, cd_offset, count, cols, np.zeros(cd.size, np.uint8), out, np.zeros(count, np.int64)
        )
        status = out[:4].copy()
    if check_local and (status[0] == Status.OK or (status[0] == Status.COUNT and status[1] == count)):
        impl = central_twin if twin else kernels
        local = impl.check_local_headers(buf, cols, cd_offset, buf, cols[:, Col.HEADER_OFFSET].copy())
        if local[0] != Status.OK:
            status = local
    return cols, status


def _write(tmp_path, buf, name="x.tdz"):
    p = tmp_path / name
    p.write_bytes(buf)
    return p


def test_crafted_archive_is_valid(tmp_path):
    p = _write(tmp_path, _crafted())
    assert tdz_numba.load(p)["a"].tolist() == [0.0, 1.0]
    assert tdz_numba.is_archive(p)


@pytest.mark.parametrize("hoff", [2**63 - 31, 2**63 - 1, 2**63, 2**64 - 30, 2**64 - 1, (1 << 40)])
@pytest.mark.parametrize("check_local", [False, True])
def test_header_offset_near_2_63_is_out_of_range(tmp_path, hoff, check_local):
    """Used to overflow ``hoff + 30`` in the kernel and read out of bounds (SIGSEGV)."""
    p = _write(tmp_path, _crafted(hoff=hoff))
    with pytest.raises(BadArchiveError) as info:
        ArchiveIndex(p, check_local=check_local)
    e = info.value
    assert (e.entry, e.path) == ("a.memmap", str(p))
    assert e.found == (hoff if hoff < 2**63 else hoff - 2**64)  # the kernel's int64 view of the field
    assert not tdz_numba.is_archive(p)
    with pytest.raises(BadArchiveError):
        tdz_numba.load(p)
    with pytest.raises(BadArchiveError):
        tdz_numba.verify(p)


@pytest.mark.parametrize("csize", [2**62, 2**63 - 1, 2**63, 2**64 - 1])
@pytest.mark.parametrize("check_local", [False, True])
def test_compressed_size_near_2_63_is_rejected(tmp_path, csize, check_local):
    p = _write(tmp_path, _crafted(csize=csize, size=csize))
    with pytest.raises(BadArchiveError) as info:
        ArchiveIndex(p, check_local=check_local)
    assert info.value.entry == "a.memmap"
    assert not tdz_numba.is_archive(p)


@pytest.mark.parametrize("size", [0, 4, 12, 2**40, 2**64 - 1])
def test_stored_size_must_equal_compressed_size(tmp_path, size):
    """A STORED entry recording another size than it stores used to load the next
    header's bytes as its values."""
    p = _write(tmp_path, _crafted(size=size))
    with pytest.raises(BadArchiveError) as info:
        tdz_numba.load(p)
    e = info.value
    assert e.entry == "a.memmap"
    if size < 2**63:
        assert (e.expected, e.found) == (len(DATA), size)
    assert not tdz_numba.is_archive(p)
    with pytest.raises(BadArchiveError):
        tdz_numba.verify(p)


def test_status_codes_are_one_enum():
    assert kernels.parse_central.__module__ == "tdz_numba.zipfmt.kernels.central"
    assert not hasattr(kernels, "IndexStatus")
    assert Status(int(Status.STORED_SIZE)) is Status.STORED_SIZE


def test_lazy_local_check_equals_eager_parse(tmp_path, small_tree):
    """reader's lazy path (resolve_local) and the eager kernel fill the same columns."""
    for compression in (None, "deflate"):
        p = tdz_numba.save(small_tree, tmp_path / f"{compression}.tdz", compression=compression)
        lazy, eager = ArchiveIndex(p), ArchiveIndex(p, check_local=True)
        assert (lazy.table["payload_offset"] == -1).all()
        for i in range(len(lazy.names)):
            lazy.payload_offset(i)
        assert np.array_equal(lazy.table, eager.table)
        assert [tuple(r) for r in lazy.rows] == [tuple(r) for r in eager.table.tolist()]


def test_index_matches_naive_parse_of_zipfile_archives(tmp_path):
    for method in (zipfile.ZIP_STORED, zipfile.ZIP_DEFLATED):
        b = io.BytesIO()
        with zipfile.ZipFile(b, "w", compression=method) as zf:
            for i in range(9):
                zf.writestr(f"d{i % 3}/f{i}.bin", bytes([i]) * (i * 41))
        buf = b.getvalue()
        for check_local in (False, True):
            end = eocd.find_end_record(buf)
            cols, status = eager_index(
                np.frombuffer(buf, np.uint8), end.cd_offset, end.cd_size, end.count, check_local
            )
            assert status[0] == Status.OK
            t = cols.view(records.INDEX_DTYPE)[:, 0]
            got = [
                (
                    buf[r["name_offset"] : r["name_offset"] + r["name_len"]],
                    *(
                        int(r[k])
                        for k in (
                            "flags",
                            "method",
                            "crc",
                            "csize",
                            "size",
                            "header_offset",
                            "payload_offset",
                            "local_extra_len",
                        )
                    ),
                )
                for r in t
            ]
            assert got == naive_index(buf, check_local)


def test_deep_names_are_walked_without_recursion(tmp_path):
    deep = "/".join(["d"] * 1500) + "/x.bin"
    p = tmp_path / "deep.zip"
    with zipfile.ZipFile(p, "w") as zf:
        zf.writestr("meta.json", "{}")
        zf.writestr(deep, b"1")
    index = ArchiveIndex(p)
    assert index.is_dir("/".join(["d"] * 1500))
    assert index.listing("/".join(["d"] * 1499)) == (set(), {"d"})
    assert tdz_numba.is_archive(p)
    too_deep = "/".join(["d"] * (records.MAX_NAME_DEPTH + 1))
    with zipfile.ZipFile(p, "w") as zf:
        zf.writestr("meta.json", "{}")
        zf.writestr(too_deep, b"1")
    with pytest.raises(BadArchiveError) as info:
        ArchiveIndex(p).listing("")
    assert info.value.expected == records.MAX_NAME_DEPTH


def test_crc_error_attributes(tmp_path):
    buf = bytearray(naive_archive(["meta.json", "a.memmap"], [META, DATA], [0, 64]))
    buf[buf.index(DATA)] ^= 1
    p = _write(tmp_path, bytes(buf))
    with pytest.raises(tdz_numba.ChecksumError) as info:
        tdz_numba.verify(p)
    e = info.value
    assert (e.entry, e.path, e.expected) == ("a.memmap", str(p), zlib.crc32(DATA))
    assert e.found == zlib.crc32(bytes(buf[e.offset : e.offset + len(DATA)]))


def test_error_attributes_default_to_none():
    e = tdz_numba.BadArchiveError("plain message")
    assert (str(e), e.path, e.entry, e.offset, e.expected, e.found) == (
        "plain message",
        None,
        None,
        None,
        None,
        None,
    )
    assert issubclass(tdz_numba.UnknownCompressionError, (TdzError, ValueError, NotImplementedError))
    from tdz_numba.errors import InternalError

    assert issubclass(InternalError, (TdzError, RuntimeError))


# ------------------------------------------------------------- arguments ----
@pytest.mark.parametrize("bad", [0, -3, 1.5, True, "2"])
def test_num_threads_is_checked_the_same_everywhere(tmp_path, bad):
    p = tdz_numba.save({"a": torch.ones(3)}, tmp_path / "x.tdz")
    calls = [
        lambda: tdz_numba.save({"a": torch.ones(3)}, tmp_path / "y.tdz", num_threads=bad),
        lambda: tdz_numba.save(
            {"a": torch.ones(3)}, tmp_path / "y.tdz", compression="deflate", num_threads=bad
        ),
        lambda: tdz_numba.open(p, num_threads=bad),
        lambda: tdz_numba.load(p, num_threads=bad),
        lambda: tdz_numba.pack(tdz_numba.unpack(p, tmp_path / "d"), tmp_path / "z.tdz", num_threads=bad),
    ]
    for call in calls:
        with pytest.raises(InvalidArgumentError) as info:
            call()
        assert info.value.found == bad
    assert not (tmp_path / "y.tdz").exists()


def test_compresslevel_needs_compression(tmp_path):
    with pytest.raises(InvalidArgumentError) as info:
        tdz_numba.save({"a": torch.ones(3)}, tmp_path / "x.tdz", compresslevel=6)
    assert info.value.found == 6
    with pytest.raises(InvalidArgumentError):
        tdz_numba.save({"a": torch.ones(3)}, tmp_path / "x.tdz", compression="stored", compresslevel=1)
    assert not (tmp_path / "x.tdz").exists()


@pytest.mark.parametrize("meta", [b"[1, 2]", b'"x"', b"nan", b'{"a": 1}', b"\xff", b"[" * 100_000, b"{}"])
def test_is_archive_agrees_with_open(tmp_path, meta):
    p = tmp_path / "m.tdz"
    with zipfile.ZipFile(p, "w") as zf:
        zf.writestr("meta.json", meta)
    try:
        tdz_numba.open(p).close()
        opened = True
    except TdzError:
        opened = False
    assert tdz_numba.is_archive(p) is opened
    assert opened == (meta == b"{}")


@pytest.mark.parametrize(
    "name", ["ours_stored.tdz", "ours_deflate.tdz", "ours_zip64_end.tdz", "td_stored.tdz", "td_deflate.tdz"]
)
@pytest.mark.parametrize("check_local", [False, True])
def test_index_of_golden_archives_matches_naive_parse(name, check_local):
    from pathlib import Path

    path = Path(__file__).resolve().parent / "fixtures" / name
    buf = path.read_bytes()
    index = ArchiveIndex(path, check_local=check_local)
    got = [
        (
            n.encode(),
            *(
                int(r[k])
                for k in (
                    "flags",
                    "method",
                    "crc",
                    "csize",
                    "size",
                    "header_offset",
                    "payload_offset",
                    "local_extra_len",
                )
            ),
        )
        for n, r in zip(index.names, index.table)
    ]
    assert got == naive_index(buf, check_local)
    assert int(index.table["next_offset"].max()) == index.end.cd_offset


# -- local headers read with pread when entries are far apart -----------------------------
def _spaced(tmp_path, name="s.tdz"):
    """An archive whose entries are >= 64 KiB apart: a whole-archive header check preads them."""
    tree = {f"g{i}": {f"l{j}": torch.full((40_000,), float(i * 10 + j)) for j in range(4)} for i in range(3)}
    return tdz_numba.save(tree, tmp_path / name, durable=False)


def test_spaced_headers_are_read_with_pread_and_fill_the_same_columns(tmp_path, monkeypatch):
    import os

    p = _spaced(tmp_path)
    calls = []
    real, realv = os.pread, os.preadv
    monkeypatch.setattr(os, "pread", lambda fd, n, off: calls.append(off) or real(fd, n, off))
    monkeypatch.setattr(os, "preadv", lambda fd, b, off, *f: calls.append(off) or realv(fd, b, off, *f))
    eager = ArchiveIndex(p, check_local=True)
    assert len(calls) == len(
        eager.names
    )  # one read per entry (cached: files.pagecache), no page fault per header
    monkeypatch.setattr(central, "PREAD_SPACING", 1 << 62)  # the mapped path
    mapped = ArchiveIndex(p, check_local=True)
    assert len(calls) == len(eager.names)
    lazy = ArchiveIndex(p)  # (its open reads the file's tail with one pread)
    before = len(calls)
    for i in range(len(lazy.names)):
        lazy.payload_offset(i)
    assert len(calls) == before
    assert np.array_equal(eager.table, mapped.table) and np.array_equal(eager.table, lazy.table)
    leaves = [i for i, n in enumerate(eager.names) if n.endswith(".memmap")]
    assert len(leaves) == 12 and (eager.table["payload_offset"][leaves] % 64 == 0).all()


@pytest.mark.parametrize(
    "where, value",
    [(0, b"PK\x05\x06"), (26, b"\x07\x00"), (30, b"X"), (28, b"\xff\xff")],
    ids=["signature", "name length", "name byte", "extra length past the next record"],
)
def test_spaced_bad_local_header_gives_the_mapped_paths_error(tmp_path, monkeypatch, where, value):

    p = _spaced(tmp_path)
    idx = ArchiveIndex(p)
    victim = int(np.argmax(idx.table["csize"]))  # a payload entry in the middle of the file
    hoff = int(idx.table["header_offset"][victim])
    idx.close()
    raw = bytearray(p.read_bytes())
    raw[hoff + where : hoff + where + len(value)] = value
    p.write_bytes(bytes(raw))
    with pytest.raises(BadArchiveError) as by_pread:
        ArchiveIndex(p, check_local=True)
    monkeypatch.setattr(central, "PREAD_SPACING", 1 << 62)
    with pytest.raises(BadArchiveError) as by_map:
        ArchiveIndex(p, check_local=True)
    assert str(by_pread.value) == str(by_map.value)
    assert by_pread.value.entry == by_map.value.entry is not None


def test_spaced_check_reads_the_mapped_file_even_after_a_replace(tmp_path):
    p = _spaced(tmp_path)
    idx = ArchiveIndex(p)
    want = ArchiveIndex(p, check_local=True).table.copy()
    other = _spaced(tmp_path, "other.tdz")
    raw = bytearray(other.read_bytes())
    raw[int(idx.table["header_offset"][3])] ^= 0xFF  # the new file at the path is corrupt
    other.write_bytes(bytes(raw))
    other.replace(p)
    idx.check_all()  # the path names another file now: the mapping is checked, not the path
    assert np.array_equal(idx.table, want)


@pytest.mark.parametrize("impl", ["kernels", "pykernels"])
def test_check_local_headers_never_reads_outside_its_copies(tmp_path, impl):
    mod = {"kernels": kernels, "pykernels": central_twin}[impl]
    p = _spaced(tmp_path)
    buf = np.frombuffer(p.read_bytes(), np.uint8)
    end = eocd.find_end_record(buf)
    cols, status = eager_index(buf, end.cd_offset, end.cd_size, end.count, False)
    assert status[0] == Status.OK
    lengths = cols[:, records.Col.NAME_LEN] + 30
    hpos = np.zeros(len(cols), np.int64)
    hpos[1:] = np.cumsum(lengths)[:-1]
    hdr = np.concatenate([buf[h : h + n] for h, n in zip(cols[:, records.Col.HEADER_OFFSET], lengths)])
    good = cols.copy()
    assert mod.check_local_headers(buf, good, end.cd_offset, hdr, hpos)[0] == Status.OK
    for short in (hdr[:10], hdr[: int(hpos[-1]) + 31], np.zeros(0, np.uint8)):  # copies cut short
        st = mod.check_local_headers(buf, cols.copy(), end.cd_offset, short, hpos)
        assert st[0] == Status.HEADER_PAST_END
    bad = hpos.copy()
    bad[2] = -1
    assert mod.check_local_headers(buf, cols.copy(), end.cd_offset, hdr, bad)[:2].tolist() == [
        Status.HEADER_PAST_END,
        2,
    ]
    assert mod.check_local_headers(buf, cols.copy(), end.cd_offset, hdr, hpos[:-1])[0] == Status.COUNT
    ro = hdr.copy()
    ro.setflags(write=False)
    assert mod.check_local_headers(buf, cols.copy(), end.cd_offset, ro, hpos)[0] == Status.OK


def test_spaced_short_read_keeps_the_other_headers_in_place(tmp_path, monkeypatch):
    import os

    p = _spaced(tmp_path)
    idx = ArchiveIndex(p)
    last = int(np.argmax(idx.table["header_offset"]))
    cut = int(idx.table["header_offset"][last])
    idx.close()
    real, realv = os.pread, os.preadv
    # the file seen shorter from inside the last local header (as if cut while being read)
    monkeypatch.setattr(os, "pread", lambda fd, n, off: real(fd, n, off)[: max(0, cut + 10 - off)])

    def short_preadv(fd, bufs, off, *flags):  # (the headers are read with preadv: files.pagecache)
        keep = max(0, cut + 10 - off)
        return realv(fd, [memoryview(b)[:keep] for b in bufs], off, *flags) if keep else 0

    monkeypatch.setattr(os, "preadv", short_preadv)
    with pytest.raises(BadArchiveError, match="local header name differs") as info:
        ArchiveIndex(p, check_local=True)
    assert info.value.entry == idx.names[last]  # every earlier header was read in its place


def test_zip64_locator_naming_another_disk_is_refused_as_zipfile_does(tmp_path):
    """A zip64 end locator whose disk field is not 0 describes a spanned archive: zipfile refuses
    it ("span multiple disks"), so do we (it was accepted: a parser/zipfile disagreement)."""
    import shutil
    from pathlib import Path

    src = Path(__file__).parent / "fixtures" / "ours_zip64_end.tdz"
    data = bytearray(src.read_bytes())
    loc = data.rfind(b"PK\x06\x07")
    assert loc > 0
    p = tmp_path / "spanned.tdz"
    shutil.copy(src, p)
    data[loc + 4 : loc + 8] = (0x7FFFFFFF).to_bytes(4, "little")
    p.write_bytes(bytes(data))
    with pytest.raises(zipfile.BadZipFile, match="multiple disks"):
        zipfile.ZipFile(p)
    with pytest.raises(tdz_numba.UnsupportedError, match="multi-disk"):
        tdz_numba.open(p)
    assert tdz_numba.load(src) is not None  # the untouched fixture still reads
