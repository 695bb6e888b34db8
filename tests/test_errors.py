"""Malformed archives and bad calls: the right exception class, a message that names
what is wrong, nothing written where it should not be.

Malformed files are made by patching the bytes of a valid archive (headers parsed
by hand with ``struct``), or by writing a foreign zip with :mod:`zipfile` when a
``meta.json`` has to change length.
"""

from __future__ import annotations

import json
import os
import pathlib
import pickle
import random
import stat
import struct
import subprocess
import sys
import textwrap
import zipfile
import zlib
from dataclasses import dataclass

import numpy as np
import pytest
import torch
from ziputil import parse_zip

import tdz_numba
from tdz_numba import (
    ArchiveExistsError,
    BadArchiveError,
    ChecksumError,
    InvalidArgumentError,
    InvalidTreeError,
    MissingKeyError,
    TdzError,
    UnsafeContentError,
    UnsupportedError,
)

# ---------------------------------------------------------------------------
# zip parsing / patching helpers (independent of tdz_numba)
# ---------------------------------------------------------------------------
EOCD = struct.Struct("<4sHHHHIIH")  # 22 bytes
ZIP64_END = struct.Struct("<4sQHHIIQQQQ")
ZIP64_LOCATOR = struct.Struct("<4sIQI")

# central record field offsets
C_FLAGS, C_METHOD, C_CRC, C_CSIZE, C_USIZE, C_NLEN, C_HOFF = 8, 10, 16, 20, 24, 28, 42
# local header field offsets
L_FLAGS, L_METHOD, L_CRC, L_NLEN, L_ELEN = 6, 8, 14, 26, 28
# end record field offsets
E_DISK, E_NDISK, E_COUNT, E_CDSIZE, E_CDOFF = 4, 8, 10, 12, 16

FORBIDDEN = (struct.error, IndexError, zipfile.BadZipFile, OverflowError, MemoryError)


@dataclass
class Rec:
    name: str
    cpos: int  # offset of the central record
    hoff: int  # offset of the local header
    csize: int
    usize: int
    crc: int
    reclen: int  # length of the central record with name, extra, comment
    payload: int  # payload offset (from the local header's name and extra lengths)


class Zip:
    """A mutable copy of an archive's bytes, with its records parsed by hand."""

    def __init__(self, data: bytes) -> None:
        self.data = bytearray(data)
        parsed = parse_zip(self.data)  # tests/ziputil.py: the one hand parser
        self.eocd, self.count, self.cd_size, self.cd_off = (
            parsed.eocd,
            parsed.count,
            parsed.cd_size,
            parsed.cd_off,
        )
        self.recs: list[Rec] = [
            Rec(r.name, r.cpos, r.hoff, r.csize, r.usize, r.crc, r.clen, r.payload) for r in parsed.records
        ]

    @classmethod
    def of(cls, path) -> Zip:
        return cls(pathlib.Path(path).read_bytes())

    def rec(self, name: str) -> Rec:
        return next(r for r in self.recs if r.name == name)

    def put(self, off: int, fmt: str, *values) -> None:
        struct.pack_into("<" + fmt, self.data, off, *values)

    def get(self, off: int, fmt: str):
        return struct.unpack_from("<" + fmt, self.data, off)[0]

    def central(self, name: str, field: int, fmt: str, value: int) -> None:
        self.put(self.rec(name).cpos + field, fmt, value)

    def local(self, name: str, field: int, fmt: str, value: int) -> None:
        self.put(self.rec(name).hoff + field, fmt, value)

    def end(self, field: int, fmt: str, value: int) -> None:
        self.put(self.eocd + field, fmt, value)

    def write(self, path) -> pathlib.Path:
        path = pathlib.Path(path)
        path.write_bytes(bytes(self.data))
        return path


def fix_crc(z: Zip, name: str) -> None:
    """Re-stamps the CRC-32 of a STORED entry in its local header and central record."""
    r = z.rec(name)
    crc = zlib.crc32(bytes(z.data[r.payload : r.payload + r.csize]))
    z.local(name, L_CRC, "I", crc)
    z.central(name, C_CRC, "I", crc)


def rezip(src, dst, replace: dict | None = None, add: list | None = None) -> pathlib.Path:
    """A foreign (zipfile-written, STORED) copy of ``src`` with entries replaced
    (``None`` drops the entry) and others appended."""
    replace = replace or {}
    with zipfile.ZipFile(src) as zin, zipfile.ZipFile(dst, "w", zipfile.ZIP_STORED) as zout:
        for info in zin.infolist():
            if info.filename in replace:
                data = replace[info.filename]
                if data is None:
                    continue
            else:
                data = zin.read(info.filename)
            zout.writestr(info.filename, data)
        for name, data in add or []:
            zout.writestr(name, data)
    return pathlib.Path(dst)


def meta_of(path, name="meta.json") -> dict:
    with zipfile.ZipFile(path) as zf:
        return json.loads(zf.read(name))


def base_tree():
    return {
        "a": torch.arange(10, dtype=torch.float32),
        "b": {"c": torch.arange(12, dtype=torch.int64).reshape(3, 4)},
        "tag": "hello",
    }


# entry order of base_tree(): meta.json, a.memmap, b/meta.json, b/c.memmap, tag/meta.json
BASE_NAMES = ["meta.json", "a.memmap", "b/meta.json", "b/c.memmap", "tag/meta.json"]


@pytest.fixture
def base(tmp_path) -> pathlib.Path:
    p = tdz_numba.save(base_tree(), tmp_path / "base.tdz")
    return p


def _message_has(exc: BaseException, needles) -> None:
    msg = str(exc)
    for n in needles:
        if isinstance(n, tuple):
            assert any(x in msg for x in n), f"none of {n!r} in message: {msg}"
        else:
            assert n in msg, f"{n!r} not in message: {msg}"


def _raises(exc_type, fn, *needles):
    """Calls ``fn``; asserts it raises ``exc_type`` (never a bare low-level error)
    whose message holds every needle."""
    with pytest.raises(exc_type) as ei:
        fn()
    assert not isinstance(ei.value, FORBIDDEN)
    _message_has(ei.value, needles)
    return ei.value


def _tree_listing(root: pathlib.Path) -> list[str]:
    return sorted(str(p.relative_to(root)) for p in root.rglob("*"))


# ---------------------------------------------------------------------------
# sanity: the hand parser agrees with zipfile
# ---------------------------------------------------------------------------
def test_hand_parser_matches_zipfile(base):
    z = Zip.of(base)
    assert [r.name for r in z.recs] == BASE_NAMES
    with zipfile.ZipFile(base) as zf:
        infos = zf.infolist()
        assert [i.header_offset for i in infos] == [r.hoff for r in z.recs]
        assert [i.compress_size for i in infos] == [r.csize for r in z.recs]
        assert zf.testzip() is None
    assert z.rec("a.memmap").payload % 64 == 0
    assert tdz_numba.is_archive(base)
    tdz_numba.verify(base)


# ---------------------------------------------------------------------------
# structural faults: every entry point refuses the file the same way
# ---------------------------------------------------------------------------
def _case_empty(z: Zip):
    z.data = bytearray()
    return BadArchiveError, ["empty"]


def _truncate_at(where: str):
    def build(z: Zip):
        a, c = z.rec("a.memmap"), z.rec("b/c.memmap")
        cut = {
            "1": 1,
            "21": 21,
            "local_header": 20,
            "after_first_header": z.recs[0].payload,
            "mid_payload_a": a.payload + a.csize // 2,
            "mid_payload_c": c.payload + c.csize // 2,
            "cd_start": z.cd_off,
            "mid_cd": z.cd_off + z.cd_size // 2,
            "mid_cd_record": z.recs[2].cpos + 20,
            "before_eocd": z.eocd,
            "mid_eocd": z.eocd + 11,
            "last_byte": len(z.data) - 1,
        }[where]
        z.data = z.data[:cut]
        return BadArchiveError, []

    return build


def _garbage(n: int, seed: int):
    def build(z: Zip):
        z.data = bytearray(random.Random(seed).randbytes(n))
        return BadArchiveError, []

    return build


def _garbage_with_eocd(z: Zip):
    """Random bytes ending in an end record that claims one central record at 0."""
    body = random.Random(7).randbytes(300).replace(b"PK", b"pk")
    z.data = bytearray(body + EOCD.pack(b"PK\x05\x06", 0, 0, 1, 1, 46, 0, 0))
    return BadArchiveError, ["entry #0", "0x2014b50"]


def _front_cut(z: Zip):
    cd_off = z.cd_off
    z.data = z.data[100:]
    return BadArchiveError, [str(cd_off)]


def _cd_offset_plus1(z: Zip):
    z.end(E_CDOFF, "I", z.cd_off + 1)
    return BadArchiveError, [str(z.cd_off + 1)]


def _cd_offset_minus1(z: Zip):
    z.end(E_CDOFF, "I", z.cd_off - 1)
    return BadArchiveError, ["entry #0", "0x2014b50"]


def _cd_offset_past_end(z: Zip):
    z.end(E_CDOFF, "I", 0xFFFFFF00)
    return BadArchiveError, [str(0xFFFFFF00)]


def _cd_size_plus1(z: Zip):
    z.end(E_CDSIZE, "I", z.cd_size + 1)
    return BadArchiveError, [str(z.cd_size + 1)]


def _cd_size_minus1(z: Zip):
    z.end(E_CDSIZE, "I", z.cd_size - 1)
    return BadArchiveError, ["entry #4"]


def _cd_size_zero(z: Zip):
    z.end(E_CDSIZE, "I", 0)
    return BadArchiveError, ["5 entries"]


def _count_plus1(z: Zip):
    z.end(E_COUNT, "H", z.count + 1)
    z.end(E_NDISK, "H", z.count + 1)
    return BadArchiveError, ["6 entries"]


def _count_huge(z: Zip):
    z.end(E_COUNT, "H", 0xFFFF)
    z.end(E_NDISK, "H", 0xFFFF)
    return BadArchiveError, ["65535"]


def _zip64_locator_past_end(z: Zip):
    bad = len(z.data) + 1000
    loc = ZIP64_LOCATOR.pack(b"PK\x06\x07", 0, bad, 1)
    z.data = z.data[: z.eocd] + loc + z.data[z.eocd :]
    return BadArchiveError, [str(bad)]


def _zip64_end_bad_signature(z: Zip):
    z64 = ZIP64_END.pack(b"PK\x06\x05", 44, 45, 45, 0, 0, z.count, z.count, z.cd_size, z.cd_off)
    where = z.eocd
    loc = ZIP64_LOCATOR.pack(b"PK\x06\x07", 0, where, 1)
    z.data = z.data[: z.eocd] + z64 + loc + z.data[z.eocd :]
    return BadArchiveError, [str(where)]


def _hoff_past_end(z: Zip):
    bad = len(z.data) + 100
    z.central("a.memmap", C_HOFF, "I", bad)
    return BadArchiveError, ["a.memmap", str(bad)]


def _hoff_in_cd(z: Zip):
    z.central("a.memmap", C_HOFF, "I", z.cd_off)
    return BadArchiveError, ["a.memmap", str(z.cd_off)]


def _hoff_ffffffff_without_zip64(z: Zip):
    z.central("a.memmap", C_HOFF, "I", 0xFFFFFFFF)
    return BadArchiveError, ["a.memmap", "zip64"]


def _local_signature(z: Zip):
    z.local("a.memmap", 0, "I", 0x05034B50)
    return BadArchiveError, ["a.memmap", "0x4034b50", "0x5034b50"]


def _local_name_differs(z: Zip):
    z.data[z.rec("a.memmap").hoff + 30] = ord("x")
    return BadArchiveError, ["a.memmap"]


def _local_name_length_differs(z: Zip):
    z.local("a.memmap", L_NLEN, "H", 7)
    return BadArchiveError, ["a.memmap"]


def _size_past_cd(z: Zip):
    z.central("a.memmap", C_CSIZE, "I", z.cd_off)
    z.central("a.memmap", C_USIZE, "I", z.cd_off)
    return BadArchiveError, ["a.memmap", str(z.cd_off)]


def _last_size_into_cd(z: Zip):
    r = z.rec("tag/meta.json")
    z.central("tag/meta.json", C_CSIZE, "I", r.csize + 1)
    z.central("tag/meta.json", C_USIZE, "I", r.usize + 1)
    return BadArchiveError, ["tag/meta.json", str(z.cd_off)]


def _same_local_header(z: Zip):
    """Two central records (different names) pointing at one local header."""
    z.central("b/meta.json", C_HOFF, "I", z.rec("a.memmap").hoff)
    return BadArchiveError, [("a.memmap", "b/meta.json")]


def _duplicate_central_record(z: Zip):
    """The central record of a.memmap twice: same name, same local header."""
    r = z.rec("a.memmap")
    rec = bytes(z.data[r.cpos : r.cpos + r.reclen])
    end = z.cd_off + z.cd_size
    z.data = z.data[:end] + rec + z.data[end:]
    z.eocd += len(rec)
    z.end(E_COUNT, "H", z.count + 1)
    z.end(E_NDISK, "H", z.count + 1)
    z.end(E_CDSIZE, "I", z.cd_size + len(rec))
    return BadArchiveError, ["a.memmap"]


def _size_overlaps_next_header(z: Zip):
    """a.memmap's recorded size runs over b/meta.json's local header (not into the CD)."""
    a, nxt = z.rec("a.memmap"), z.rec("b/meta.json")
    size = nxt.hoff - a.payload + 16
    z.central("a.memmap", C_CSIZE, "I", size)
    z.central("a.memmap", C_USIZE, "I", size)
    # the entry whose size is wrong must be named, with the offsets involved
    return BadArchiveError, ["a.memmap", str(nxt.hoff), str(a.payload + size)]


def _name_not_utf8(z: Zip):
    r = z.rec("a.memmap")
    z.central("a.memmap", C_FLAGS, "H", 0x800)
    z.data[r.cpos + 46] = 0xFF
    z.data[r.hoff + 30] = 0xFF
    return BadArchiveError, ["entry #1", "UTF-8"]


def _multi_disk(z: Zip):
    z.end(E_DISK, "H", 1)
    return UnsupportedError, ["multi-disk"]


def _encrypted(name: str):
    def build(z: Zip):
        z.local(name, L_FLAGS, "H", z.get(z.rec(name).hoff + L_FLAGS, "H") | 1)
        z.central(name, C_FLAGS, "H", z.get(z.rec(name).cpos + C_FLAGS, "H") | 1)
        return UnsupportedError, [name, "encrypted"]

    return build


def _method_99(name: str):
    def build(z: Zip):
        z.local(name, L_METHOD, "H", 99)
        z.central(name, C_METHOD, "H", 99)
        return UnsupportedError, [name, "99"]

    return build


STRUCTURAL = {
    "empty": _case_empty,
    **{
        f"truncated_{w}": _truncate_at(w)
        for w in [
            "1",
            "21",
            "local_header",
            "after_first_header",
            "mid_payload_a",
            "mid_payload_c",
            "cd_start",
            "mid_cd",
            "mid_cd_record",
            "before_eocd",
            "mid_eocd",
            "last_byte",
        ]
    },
    "front_cut": _front_cut,
    **{f"garbage_{n}": _garbage(n, n) for n in (1, 21, 22, 64, 4096, 70000)},
    "garbage_with_eocd": _garbage_with_eocd,
    "cd_offset_plus1": _cd_offset_plus1,
    "cd_offset_minus1": _cd_offset_minus1,
    "cd_offset_past_end": _cd_offset_past_end,
    "cd_size_plus1": _cd_size_plus1,
    "cd_size_minus1": _cd_size_minus1,
    "cd_size_zero": _cd_size_zero,
    "count_plus1": _count_plus1,
    "count_huge": _count_huge,
    "zip64_locator_past_end": _zip64_locator_past_end,
    "zip64_end_bad_signature": _zip64_end_bad_signature,
    "hoff_past_end": _hoff_past_end,
    "hoff_in_cd": _hoff_in_cd,
    "hoff_ffffffff_without_zip64": _hoff_ffffffff_without_zip64,
    "local_signature": _local_signature,
    "local_name_differs": _local_name_differs,
    "local_name_length_differs": _local_name_length_differs,
    "size_past_cd": _size_past_cd,
    "last_size_into_cd": _last_size_into_cd,
    "same_local_header": _same_local_header,
    "duplicate_central_record": _duplicate_central_record,
    "size_overlaps_next_header": _size_overlaps_next_header,
    "name_not_utf8": _name_not_utf8,
    "multi_disk": _multi_disk,
    "encrypted_payload": _encrypted("a.memmap"),
    "encrypted_meta": _encrypted("meta.json"),
    "method_99_payload": _method_99("a.memmap"),
    "method_99_meta": _method_99("meta.json"),
}


def _build(case: str, base: pathlib.Path, tmp_path: pathlib.Path):
    z = Zip.of(base)
    exc, needles = STRUCTURAL[case](z)
    path = z.write(tmp_path / f"{case}.tdz")
    return path, exc, needles


def _open_and_read_all(path, mode="r"):
    with tdz_numba.open(path, mode=mode) as ar:
        ar.to_dict()
        for name in ar._index.names:  # entries meta.json does not reach, too
            ar._index.entry(name)


@pytest.mark.parametrize("case", list(STRUCTURAL))
def test_structural_fault(case, base, tmp_path):
    path, exc, needles = _build(case, base, tmp_path)
    before = path.read_bytes()
    needles = [*needles, str(path)]  # every message names the file
    out = tmp_path / "out"

    # open() reads local headers lazily (a lazy open touches no payload page):
    # a fault in one surfaces at the latest when its entry is first read
    _raises(exc, lambda: _open_and_read_all(path), *needles)
    _raises(exc, lambda: _open_and_read_all(path, mode="r+"), *needles)
    _raises(exc, lambda: tdz_numba.load(path), *needles)
    _raises(exc, lambda: tdz_numba.verify(path), *needles)
    _raises(exc, lambda: tdz_numba.unpack(path, out), *needles)
    assert not out.exists(), "unpack wrote something for a malformed archive"
    _raises(exc, lambda: tdz_numba.refresh_checksums(path), *needles)
    assert tdz_numba.is_archive(path) is False
    assert path.read_bytes() == before, "a failed call modified the file"


def test_encrypted_is_also_not_implemented(base, tmp_path):
    path, _, _ = _build("encrypted_payload", base, tmp_path)
    with pytest.raises(NotImplementedError):
        tdz_numba.open(path)
    path, _, _ = _build("method_99_payload", base, tmp_path)
    with pytest.raises(NotImplementedError):
        tdz_numba.load(path)


def test_bad_archive_is_value_error(tmp_path):
    p = tmp_path / "x.tdz"
    p.write_bytes(b"not a zip at all, just some text" * 3)
    with pytest.raises(ValueError):
        tdz_numba.open(p)
    with pytest.raises(TdzError):
        tdz_numba.open(p)


def test_count_too_small_does_not_drop_entries_silently(base, tmp_path):
    """The end record lists one entry fewer than the central directory holds
    (the last record would be silently ignored): a structural fault."""
    src = rezip(base, tmp_path / "extra.tdz", add=[("zz_notes.txt", b"not referenced by meta.json")])
    z = Zip.of(src)
    assert z.recs[-1].name == "zz_notes.txt"
    z.end(E_COUNT, "H", z.count - 1)
    z.end(E_NDISK, "H", z.count - 1)
    path = z.write(tmp_path / "count_minus1.tdz")
    _raises(BadArchiveError, lambda: tdz_numba.verify(path), str(path))
    out = tmp_path / "out"
    _raises(BadArchiveError, lambda: tdz_numba.unpack(path, out), str(path))


def test_is_archive_false_for_directory_and_missing(tmp_path):
    assert tdz_numba.is_archive(tmp_path) is False
    assert tdz_numba.is_archive(tmp_path / "missing.tdz") is False


def test_open_directory_and_missing(tmp_path):
    d = tmp_path / "adir.tdz"
    d.mkdir()
    for fn in (
        lambda: tdz_numba.open(d),
        lambda: tdz_numba.open(d, mode="r+"),
        lambda: tdz_numba.load(d),
        lambda: tdz_numba.verify(d),
        lambda: tdz_numba.unpack(d, tmp_path / "out"),
        lambda: tdz_numba.refresh_checksums(d),
    ):
        _raises(BadArchiveError, fn, str(d), "directory")
    assert not (tmp_path / "out").exists()
    with pytest.raises(FileNotFoundError):
        tdz_numba.open(tmp_path / "missing.tdz")


def test_no_top_level_meta_json(base, tmp_path):
    path = rezip(base, tmp_path / "nometa.tdz", replace={"meta.json": None})
    _raises(BadArchiveError, lambda: tdz_numba.open(path), "meta.json", str(path))
    _raises(BadArchiveError, lambda: tdz_numba.unpack(path, tmp_path / "out"), "meta.json")
    assert not (tmp_path / "out").exists()
    assert tdz_numba.is_archive(path) is False


@pytest.mark.parametrize(
    ("names", "unpack_error"),
    [
        (["b/", "b/x.txt"], None),
        (["q/r/s/"], None),
        (["é/ü.txt"], None),
        (["a//b.txt"], "empty path"),
        (["/"], "empty name"),
        (["//x"], "absolute"),
    ],
)
def test_odd_but_harmless_names(names, unpack_error, base, tmp_path):
    """Directory entries and doubled slashes: the tree still loads and verifies (the extra entries are not
    part of it); unpack writes the harmless ones inside the target and refuses the unsafe names."""
    path = rezip(base, tmp_path / "odd.tdz", add=[(n, b"" if n.endswith("/") else b"x") for n in names])
    assert torch.equal(tdz_numba.load(path)["b"]["c"], base_tree()["b"]["c"])
    tdz_numba.verify(path)
    assert tdz_numba.is_archive(path) is True
    if unpack_error is None:
        tdz_numba.unpack(path, tmp_path / "out")
        assert (tmp_path / "out" / "meta.json").exists()
    else:
        _raises(BadArchiveError, lambda: tdz_numba.unpack(path, tmp_path / "out"), unpack_error)
    if (tmp_path / "out").exists():
        out = (tmp_path / "out").resolve()
        for p in out.rglob("*"):
            assert out in p.resolve().parents


def test_plain_zip_is_not_an_archive(tmp_path):
    path = tmp_path / "plain.zip"
    with zipfile.ZipFile(path, "w") as zf:
        zf.writestr("hello.txt", "hi")
    assert tdz_numba.is_archive(path) is False
    _raises(BadArchiveError, lambda: tdz_numba.load(path), "meta.json")


def test_stored_sizes_disagree(base, tmp_path):
    """A STORED entry whose compressed and uncompressed sizes differ."""
    z = Zip.of(base)
    r = z.rec("meta.json")
    z.central("meta.json", C_USIZE, "I", r.usize + 1)
    path = z.write(tmp_path / "sizes.tdz")
    _raises(BadArchiveError, lambda: tdz_numba.open(path), "meta.json", str(r.usize + 1))
    assert tdz_numba.is_archive(path) is False


def test_payload_usize_disagrees_with_meta(base, tmp_path):
    z = Zip.of(base)
    r = z.rec("a.memmap")
    z.central("a.memmap", C_USIZE, "I", r.usize - 4)
    z.central("a.memmap", C_CSIZE, "I", r.csize - 4)
    path = z.write(tmp_path / "short.tdz")
    with tdz_numba.open(path) as ar:
        _raises(BadArchiveError, lambda: ar["a"], "a.memmap", "40", "36")
        assert ar["b"]["c"].sum().item() == 66  # other leaves still readable
    _raises(BadArchiveError, lambda: tdz_numba.load(path), "a.memmap")
    _raises(BadArchiveError, lambda: tdz_numba.verify(path), "a.memmap")


# ---------------------------------------------------------------------------
# unsafe entry names in unpack
# ---------------------------------------------------------------------------
@pytest.mark.parametrize("evil", ["../evil", "/etc/x", "b/../../evil", "./x", "..", "a/./../../x"])
def test_unpack_refuses_unsafe_names_foreign_zip(evil, base, tmp_path):
    work = tmp_path / "work"
    work.mkdir()
    path = rezip(base, work / "evil.tdz", add=[(evil, b"pwned")])
    with zipfile.ZipFile(path) as zf:
        assert evil in zf.namelist()
    target = work / "deep" / "target"
    before = _tree_listing(tmp_path)
    _raises(BadArchiveError, lambda: tdz_numba.unpack(path, target), repr(evil))
    assert not target.exists(), "unpack created the target before checking names"
    assert _tree_listing(tmp_path) == before
    assert not (work / "deep" / "evil").exists()
    assert not (work / "evil").exists()


@pytest.mark.parametrize("evil", ["../evil", "/etc/xy"])
def test_unpack_refuses_unsafe_names_patched(evil, tmp_path):
    """A valid tdz archive whose payload entry is renamed (same length) in both headers."""
    work = tmp_path / "work"
    work.mkdir()
    key = "k" * len(evil)
    src = tdz_numba.save({key: torch.ones(3)}, work / "src.tdz")
    z = Zip.of(src)
    r = z.rec(key + ".memmap")
    new = (evil + ".memmap").encode()
    z.data[r.cpos + 46 : r.cpos + 46 + len(new)] = new
    z.data[r.hoff + 30 : r.hoff + 30 + len(new)] = new
    path = z.write(work / "evil.tdz")
    target = work / "target"
    target.mkdir()  # an existing, empty target: stays empty
    before = _tree_listing(tmp_path)
    _raises(BadArchiveError, lambda: tdz_numba.unpack(path, target), evil)
    assert list(target.iterdir()) == []
    assert _tree_listing(tmp_path) == before
    assert not pathlib.Path("/etc/xy.memmap").exists()


# ---------------------------------------------------------------------------
# checksums and compressed streams
# ---------------------------------------------------------------------------
def test_corrupted_payload_byte_verify(base, tmp_path):
    z = Zip.of(base)
    r = z.rec("b/c.memmap")
    z.data[r.payload + 5] ^= 0xFF
    path = z.write(tmp_path / "bad.tdz")
    err = _raises(ChecksumError, lambda: tdz_numba.verify(path), "b/c.memmap", f"{r.crc:#010x}")
    assert isinstance(err, BadArchiveError)
    assert "a.memmap" not in str(err)
    _raises(ChecksumError, lambda: tdz_numba.unpack(path, tmp_path / "out"), "b/c.memmap")
    # a valid archive again after refreshing the checksums
    tdz_numba.refresh_checksums(path)
    tdz_numba.verify(path)


def test_verify_names_first_bad_entry(base, tmp_path):
    z = Zip.of(base)
    for name in ("b/c.memmap", "a.memmap"):
        r = z.rec(name)
        z.data[r.payload] ^= 0x01
    path = z.write(tmp_path / "bad2.tdz")
    err = _raises(ChecksumError, lambda: tdz_numba.verify(path), "a.memmap")
    assert "b/c.memmap" not in str(err)


def test_corrupted_meta_json_byte(base, tmp_path):
    z = Zip.of(base)
    r = z.rec("meta.json")
    i = bytes(z.data[r.payload : r.payload + r.csize]).index(b"float32") + r.payload
    z.data[i] = ord("F")  # still valid JSON, wrong CRC
    path = z.write(tmp_path / "badmeta.tdz")
    _raises(ChecksumError, lambda: tdz_numba.open(path), "meta.json", str(path))
    _raises(ChecksumError, lambda: tdz_numba.verify(path), "meta.json")
    assert tdz_numba.is_archive(path) is False


@pytest.mark.parametrize("compression", ["deflate", "bzip2", "lzma"])
@pytest.mark.parametrize("how", ["flip_middle", "garble_start", "shorter_csize", "bigger_usize"])
def test_corrupted_compressed_stream(compression, how, tmp_path):
    tree = {"a": torch.arange(2000, dtype=torch.float32) % 37, "tag": "x"}
    src = tdz_numba.save(tree, tmp_path / "c.tdz", compression=compression)
    z = Zip.of(src)
    r = z.rec("a.memmap")
    assert z.get(r.cpos + C_METHOD, "H") != 0
    if how == "flip_middle":
        z.data[r.payload + r.csize // 2] ^= 0x5A
    elif how == "garble_start":
        start = r.payload + (0 if compression == "deflate" else 4 if compression == "bzip2" else 9)
        z.data[start : start + 8] = b"\xff" * 8
    elif how == "shorter_csize":
        z.central("a.memmap", C_CSIZE, "I", r.csize // 2)
    else:
        # meta.json says 8000 bytes too, so the leaf check cannot catch this one
        z.central("a.memmap", C_USIZE, "I", r.usize + 8)
        m = z.rec("meta.json")
        raw = bytes(z.data[m.payload : m.payload + m.csize])
        new = raw.replace(b"[2000]", b"[2002]")
        assert len(new) == len(raw) and new != raw
        z.data[m.payload : m.payload + m.csize] = new
        fix_crc(z, "meta.json")
    path = z.write(tmp_path / f"bad_{compression}_{how}.tdz")

    with tdz_numba.open(path) as ar:
        _raises(BadArchiveError, lambda: ar["a"], "a.memmap")
        assert ar["tag"] == "x"
    _raises(BadArchiveError, lambda: tdz_numba.load(path), "a.memmap")
    _raises(BadArchiveError, lambda: tdz_numba.verify(path), "a.memmap")
    _raises(BadArchiveError, lambda: tdz_numba.unpack(path, tmp_path / "out"), "a.memmap")


# r+ on compressed leaves and unknown compression names: tests/test_compression.py


# ---------------------------------------------------------------------------
# meta.json faults
# ---------------------------------------------------------------------------
def _with_meta(base, tmp_path, meta, name="meta.json", tag="m") -> pathlib.Path:
    data = meta if isinstance(meta, bytes) else json.dumps(meta).encode()
    return rezip(base, tmp_path / f"{tag}.tdz", replace={name: data})


@pytest.mark.parametrize("raw", [b"{not json", b"\xff\xfe\x00{}", b"", b'{"a": '])
def test_root_meta_not_json(raw, base, tmp_path):
    path = _with_meta(base, tmp_path, raw)
    _raises(BadArchiveError, lambda: tdz_numba.open(path), "meta.json", "JSON", str(path))
    _raises(BadArchiveError, lambda: tdz_numba.verify(path), "meta.json")
    assert tdz_numba.is_archive(path) is False


@pytest.mark.parametrize("value", [[1, 2], 42, None, "str", True])
def test_root_meta_not_an_object(value, base, tmp_path):
    path = _with_meta(base, tmp_path, value)
    _raises(BadArchiveError, lambda: tdz_numba.open(path), "meta.json", "object")
    _raises(BadArchiveError, lambda: tdz_numba.load(path), "meta.json")
    assert tdz_numba.is_archive(path) is False  # is_archive and open agree


def test_nested_meta_not_json(base, tmp_path):
    path = _with_meta(base, tmp_path, b"{{{", name="b/meta.json")
    with tdz_numba.open(path) as ar:  # lazy: the root is fine
        assert ar["a"].shape == (10,)
        _raises(BadArchiveError, lambda: ar["b"], "b/meta.json")
        _raises(BadArchiveError, lambda: ar["b/c"], "b/meta.json")
    _raises(BadArchiveError, lambda: tdz_numba.load(path), "b/meta.json")
    _raises(BadArchiveError, lambda: tdz_numba.verify(path), "b/meta.json")
    _raises(BadArchiveError, lambda: tdz_numba.open(path, subpath="b"), "b/meta.json")


@pytest.mark.parametrize("shape", [[-1], [2.5], ["10"], [True], 10, None, [[10]], "10", [10, -3]])
def test_bad_leaf_shape(shape, base, tmp_path):
    meta = meta_of(base)
    meta["a"]["shape"] = shape
    path = _with_meta(base, tmp_path, meta)
    _raises(BadArchiveError, lambda: tdz_numba.load(path), "'a'", "shape")
    _raises(BadArchiveError, lambda: tdz_numba.open(path), "'a'", "shape")
    _raises(BadArchiveError, lambda: tdz_numba.verify(path), "'a'")


@pytest.mark.parametrize("shape", [[2**40, 2**40], [2**62, 2**62, 2**62], [0, 2**62], [2**63]])
def test_leaf_shape_too_large(shape, base, tmp_path):
    # refused when the level is read: the byte size and strides must fit in 64 bits
    meta = meta_of(base)
    meta["a"]["shape"] = shape
    path = _with_meta(base, tmp_path, meta)
    for op in (tdz_numba.open, tdz_numba.load, tdz_numba.verify):
        _raises(BadArchiveError, lambda: op(path), "'a'", "bad shape")  # noqa: B023


@pytest.mark.parametrize("shape", [[11], [5], [2, 5, 2], [0], [2**20, 2**20]])
def test_leaf_size_disagrees_with_shape(shape, base, tmp_path):
    meta = meta_of(base)
    meta["a"]["shape"] = shape
    path = _with_meta(base, tmp_path, meta)
    nbytes = int(np.prod(np.array(shape, dtype=object))) * 4
    with tdz_numba.open(path) as ar:
        _raises(BadArchiveError, lambda: ar["a"], "'a'", "a.memmap", str(nbytes), "40")
        _raises(BadArchiveError, lambda: ar.numpy("a"), "'a'")
    _raises(BadArchiveError, lambda: tdz_numba.load(path), "a.memmap")
    _raises(BadArchiveError, lambda: tdz_numba.verify(path), "a.memmap", str(nbytes))


def test_leaf_dtype_size_disagrees(base, tmp_path):
    meta = meta_of(base)
    meta["a"]["dtype"] = "torch.float64"  # 80 bytes expected, 40 stored
    path = _with_meta(base, tmp_path, meta)
    _raises(BadArchiveError, lambda: tdz_numba.load(path), "a.memmap", "80", "40")


BAD_DTYPES = [
    "torch.float128",
    "torch.Tensor",
    "os.system",
    "torch.load",
    "builtins.eval",
    "torch.nn",
    "float32",
    "torch.",
    "",
    "torch.float32 ",
    "__import__('os')",
    123,
    None,
    ["torch.float32"],
    {"x": 1},
]


@pytest.mark.parametrize("dtype", BAD_DTYPES, ids=[repr(d) for d in BAD_DTYPES])
def test_unknown_dtype(dtype, base, tmp_path, monkeypatch):
    calls = []
    monkeypatch.setattr(os, "system", lambda *a, **k: calls.append(a) or 0)
    meta = meta_of(base)
    meta["a"]["dtype"] = dtype
    path = _with_meta(base, tmp_path, meta)
    needles = ["a.memmap", "dtype"]
    if isinstance(dtype, str) and dtype:
        needles.append(repr(dtype))
    with tdz_numba.open(path) as ar:
        _raises(BadArchiveError, lambda: ar["a"], *needles)
        _raises(BadArchiveError, lambda: ar.info("a"), *needles)
        assert ar["b"]["c"].shape == (3, 4)
    _raises(BadArchiveError, lambda: tdz_numba.load(path), *needles)
    _raises(BadArchiveError, lambda: tdz_numba.verify(path), *needles)
    assert calls == []


def test_dtype_never_looked_up_as_attribute(base, tmp_path, monkeypatch):
    """A dtype string naming a real torch attribute that is a dtype-like object
    still has to come from the table, not getattr."""
    sentinel = torch.float16
    monkeypatch.setattr(torch, "evil_dtype", sentinel, raising=False)
    meta = meta_of(base)
    meta["a"]["dtype"] = "torch.evil_dtype"
    path = _with_meta(base, tmp_path, meta)
    _raises(BadArchiveError, lambda: tdz_numba.load(path), "torch.evil_dtype")


@pytest.mark.parametrize("version", [2, 99, "1", 1.0, [1]])
def test_format_version(version, base, tmp_path):
    meta = meta_of(base)
    meta["_format_version"] = version
    path = _with_meta(base, tmp_path, meta)
    _raises(BadArchiveError, lambda: tdz_numba.open(path), "meta.json", "_format_version", repr(version))
    _raises(BadArchiveError, lambda: tdz_numba.load(path), "_format_version")


def test_nested_format_version_2(base, tmp_path):
    meta = meta_of(base, "b/meta.json")
    meta["_format_version"] = 2
    path = _with_meta(base, tmp_path, meta, name="b/meta.json")
    with tdz_numba.open(path) as ar:
        _raises(BadArchiveError, lambda: ar["b"], "b/meta.json", "_format_version")
    _raises(BadArchiveError, lambda: tdz_numba.load(path), "b/meta.json")


def test_leaf_without_payload_entry(base, tmp_path):
    path = rezip(base, tmp_path / "nopayload.tdz", replace={"a.memmap": None})
    with tdz_numba.open(path) as ar:
        assert "a" in list(ar)
        _raises(BadArchiveError, lambda: ar["a"], "'a'", "a.memmap", "40")
        assert ar["b"]["c"].sum().item() == 66
    _raises(BadArchiveError, lambda: tdz_numba.load(path), "a.memmap")
    _raises(BadArchiveError, lambda: tdz_numba.verify(path), "a.memmap")


def test_level_without_directory(base, tmp_path):
    path = rezip(base, tmp_path / "nodir.tdz", replace={"b/meta.json": None, "b/c.memmap": None})
    _raises(BadArchiveError, lambda: tdz_numba.open(path), "'b'", "b/")


@pytest.mark.parametrize("value", [5, "x", [1], None])
def test_meta_entry_not_an_object(value, base, tmp_path):
    meta = meta_of(base)
    meta["a"] = value
    path = _with_meta(base, tmp_path, meta)
    _raises(BadArchiveError, lambda: tdz_numba.open(path), "'a'")


@pytest.mark.parametrize("value", [{"shape": [10]}, {"dtype": "torch.float32"}, {}])
def test_meta_entry_incomplete(value, base, tmp_path):
    meta = meta_of(base)
    meta["a"] = value
    path = _with_meta(base, tmp_path, meta)
    _raises(BadArchiveError, lambda: tdz_numba.open(path), "'a'")


# ---------------------------------------------------------------------------
# save / allocate / pack: bad targets and bad trees
# ---------------------------------------------------------------------------
def test_save_existsok_false(tmp_path):
    path = tdz_numba.save({"a": torch.ones(3)}, tmp_path / "x.tdz")
    before = path.read_bytes()
    err = _raises(
        ArchiveExistsError, lambda: tdz_numba.save({"b": torch.zeros(2)}, path, existsok=False), str(path)
    )
    assert isinstance(err, FileExistsError)
    assert path.read_bytes() == before
    _raises(ArchiveExistsError, lambda: tdz_numba.allocate({"b": torch.zeros(2)}, path, existsok=False))
    assert path.read_bytes() == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["x.tdz"]


def test_save_to_directory(tmp_path):
    d = tmp_path / "adir"
    d.mkdir()
    err = _raises(TdzError, lambda: tdz_numba.save({"a": torch.ones(3)}, d), str(d))
    assert isinstance(err, OSError)
    assert d.is_dir() and list(d.iterdir()) == []
    assert sorted(p.name for p in tmp_path.iterdir()) == ["adir"]
    _raises(TdzError, lambda: tdz_numba.allocate({"a": torch.ones(3)}, d), str(d))
    _raises(TdzError, lambda: tdz_numba.save({"a": torch.ones(3)}, d, existsok=False), str(d))
    assert d.is_dir() and list(d.iterdir()) == []


@pytest.mark.parametrize(
    "tree, key",
    [
        ({"ok": torch.ones(2), "weird": object()}, "weird"),
        ({"ok": torch.ones(2), "s": {1, 2}}, "s"),
        ({"outer": {"inner": object()}}, "outer/inner"),
        ({"outer": {"deep": {"fs": frozenset([1])}}}, "outer/deep/fs"),
        ({"lst": [1, object()]}, "lst"),
        ({"fn": len}, "fn"),
        ({"b": b"bytes"}, "b"),
    ],
    ids=["object", "set", "nested_object", "frozenset", "list_with_object", "function", "bytes"],
)
def test_save_unsupported_value(tree, key, tmp_path):
    path = tmp_path / "x.tdz"
    _raises(InvalidTreeError, lambda: tdz_numba.save(tree, path), key)
    assert list(tmp_path.iterdir()) == []


def test_save_not_a_mapping(tmp_path):
    for tree in (torch.ones(2), [1, 2], None, "str"):
        _raises(InvalidTreeError, lambda tree=tree: tdz_numba.save(tree, tmp_path / "x.tdz"))
    assert list(tmp_path.iterdir()) == []


def test_save_non_str_key(tmp_path):
    _raises(InvalidTreeError, lambda: tdz_numba.save({1: torch.ones(2)}, tmp_path / "x.tdz"), "1")
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("key", ["shape", "_type", "device", "_format_version", "_class", "_names"])
def test_save_reserved_key(key, tmp_path):
    path = tmp_path / "x.tdz"
    _raises(InvalidTreeError, lambda: tdz_numba.save({key: torch.ones(2)}, path), repr(key))
    _raises(InvalidTreeError, lambda: tdz_numba.save({"sub": {key: "v"}}, path), repr(key), "sub")
    assert list(tmp_path.iterdir()) == []


def test_failed_save_keeps_existing_target(tmp_path):
    path = tdz_numba.save({"a": torch.arange(5)}, tmp_path / "x.tdz")
    before = path.read_bytes()
    listing = sorted(os.listdir(tmp_path))
    bad = {"big": torch.zeros(1000), "z": object()}
    _raises(InvalidTreeError, lambda: tdz_numba.save(bad, path), "z")
    assert path.read_bytes() == before
    assert sorted(os.listdir(tmp_path)) == listing
    assert tdz_numba.load(path)["a"].tolist() == [0, 1, 2, 3, 4]


@pytest.mark.parametrize("exc", [RuntimeError, KeyboardInterrupt])
@pytest.mark.parametrize("existing", [True, False])
def test_save_failing_midway_is_atomic(exc, existing, tmp_path, monkeypatch):
    import tdz_numba.zipfmt.writer

    path = tmp_path / "x.tdz"
    if existing:
        tdz_numba.save({"a": torch.arange(5)}, path)
    before = path.read_bytes() if existing else None
    listing = sorted(os.listdir(tmp_path))

    def boom(*args, **kwargs):
        raise exc("injected failure")

    monkeypatch.setattr(tdz_numba.zipfmt.writer.packers, "end_records", boom)
    with pytest.raises(exc, match="injected failure"):
        tdz_numba.save({"b": torch.ones(10_000), "c": "text"}, path)
    with pytest.raises(exc, match="injected failure"):
        tdz_numba.allocate({"b": torch.ones(10_000)}, path)
    monkeypatch.undo()
    assert sorted(os.listdir(tmp_path)) == listing, "temporary files left behind"
    if existing:
        assert path.read_bytes() == before
        assert tdz_numba.load(path)["a"].tolist() == [0, 1, 2, 3, 4]
    else:
        assert not path.exists()


def test_failed_pack_is_atomic(tmp_path, monkeypatch):
    import tdz_numba.zipfmt.writer

    src = tdz_numba.save(base_tree(), tmp_path / "src.tdz")
    d = tdz_numba.unpack(src, tmp_path / "dir")
    target = tdz_numba.save({"keep": torch.ones(1)}, tmp_path / "out" / "t.tdz")
    before = target.read_bytes()
    monkeypatch.setattr(
        tdz_numba.zipfmt.writer.packers,
        "end_records",
        lambda *a, **k: (_ for _ in ()).throw(OSError("disk full")),
    )
    with pytest.raises(OSError, match="disk full"):
        tdz_numba.pack(d, target)
    monkeypatch.undo()
    assert target.read_bytes() == before
    assert sorted(os.listdir(target.parent)) == ["t.tdz"]


@pytest.mark.parametrize("mode", [0o640, 0o600, 0o604])
def test_overwrite_keeps_permissions(mode, tmp_path):
    path = tdz_numba.save({"a": torch.ones(2)}, tmp_path / "x.tdz")
    os.chmod(path, mode)
    tdz_numba.save({"b": torch.zeros(3)}, path)
    assert stat.S_IMODE(os.stat(path).st_mode) == mode
    assert list(tdz_numba.load(path)) == ["b"]
    tdz_numba.save({"c": torch.zeros(3)}, path, compression="deflate")
    assert stat.S_IMODE(os.stat(path).st_mode) == mode


def test_pack_bad_directory(tmp_path):
    d = tmp_path / "notamemmap"
    d.mkdir()
    (d / "x.memmap").write_bytes(b"1234")
    _raises(BadArchiveError, lambda: tdz_numba.pack(d, tmp_path / "x.tdz"), "meta.json")
    assert not (tmp_path / "x.tdz").exists()


# ---------------------------------------------------------------------------
# bad arguments and missing keys
# ---------------------------------------------------------------------------
@pytest.mark.parametrize("mode", ["w", "a", "rw", "", "R", "r+b", None])
def test_bad_mode(mode, base, tmp_path):
    before = base.read_bytes()
    err = _raises(InvalidArgumentError, lambda: tdz_numba.open(base, mode=mode), repr(mode))
    assert isinstance(err, ValueError)
    _raises(InvalidArgumentError, lambda: tdz_numba.load(base, mode=mode))
    assert base.read_bytes() == before
    # the mode is checked before the file is touched
    missing = tmp_path / "missing.tdz"
    _raises(InvalidArgumentError, lambda: tdz_numba.open(missing, mode=mode))
    assert not missing.exists()


@pytest.mark.parametrize("subpath", ["nope", "b/nope", ("b", "nope"), ("nope",), "a", "tag/x"])
def test_missing_subpath(subpath, base):
    err = _raises(MissingKeyError, lambda: tdz_numba.open(base, subpath=subpath))
    assert isinstance(err, KeyError)
    last = subpath if isinstance(subpath, str) else "/".join(subpath)
    assert last.split("/")[-1] in str(err)
    _raises(MissingKeyError, lambda: tdz_numba.load(base, subpath=subpath))


def test_bad_subpath_type(base):
    _raises(InvalidArgumentError, lambda: tdz_numba.open(base, subpath=("b", 3)))


@pytest.mark.parametrize("key", ["nope", "b/nope", ("b", "nope"), "a/x", "nope/deeper", "", 3, ()])
def test_missing_key(key, base):
    with tdz_numba.open(base) as ar:
        with pytest.raises(KeyError) as ei:
            ar[key]
        assert isinstance(ei.value, MissingKeyError)
        if key not in ("", ()):
            text = key if isinstance(key, str) else "/".join(key) if isinstance(key, tuple) else repr(key)
            assert text.split("/")[0] in str(ei.value) or text in str(ei.value)
        assert key not in ar
        with pytest.raises(KeyError):
            ar.info(key)
        assert ar.get(key, "default") == "default"


def test_info_and_numpy_on_non_leaf(base):
    with tdz_numba.open(base) as ar:
        _raises(MissingKeyError, lambda: ar.info("b"), "'b'")
        _raises(MissingKeyError, lambda: ar.numpy("tag"), "'tag'")


def test_closed_archive(base):
    ar = tdz_numba.open(base)
    ar.close()
    _raises(InvalidArgumentError, lambda: ar["a"], "closed")


# ---------------------------------------------------------------------------
# pickled data is never unpickled by default
# ---------------------------------------------------------------------------
class _Touch:
    """Unpickling this creates ``path``."""

    def __init__(self, path) -> None:
        self.path = str(path)

    def __reduce__(self):
        return (pathlib.Path.touch, (pathlib.Path(self.path),))


@pytest.fixture
def pickle_archives(tmp_path):
    """Archives (NonTensorStack pickle.pkl, NonTensorData other.pickle) whose pickles
    create a marker file when loaded."""
    tensordict = pytest.importorskip("tensordict")
    from tensordict import NonTensorData, NonTensorStack, TensorDict

    marker = tmp_path / "PWNED"
    evil = pickle.dumps(_Touch(marker), protocol=4)
    out = {}
    for kind, td, rel in [
        (
            "stack",
            lambda: TensorDict(a=NonTensorStack({1}, {2}), b=torch.zeros(2), batch_size=[2]),
            "a/pickle.pkl",
        ),
        ("data", lambda: TensorDict(a=NonTensorData({1}), b=torch.zeros(2), batch_size=[]), "a/other.pickle"),
    ]:
        d = tmp_path / f"dir_{kind}"
        td().memmap(d)
        assert (d / rel).is_file(), sorted(str(p) for p in d.rglob("*"))
        (d / rel).write_bytes(evil)
        out[kind] = (tdz_numba.pack(d, tmp_path / f"{kind}.tdz"), rel)
    assert not marker.exists()
    del tensordict
    return out, marker


@pytest.mark.parametrize("kind", ["stack", "data"])
def test_pickle_not_loaded_by_default(kind, pickle_archives, tmp_path):
    archives, marker = pickle_archives
    path, rel = archives[kind]
    fname = rel.split("/")[-1]

    tree = tdz_numba.load(path)
    assert not marker.exists()
    pickled = tree["a"][fname]
    assert isinstance(pickled, tdz_numba.PickledData)
    _raises(UnsafeContentError, pickled.load, "allow_pickle")
    _raises(UnsafeContentError, lambda: pickled.load(allow_pickle=False))
    assert not marker.exists()

    with tdz_numba.open(path) as ar:
        for value in (ar["a"][fname], ar["a/" + fname], ar[("a", fname)]):
            assert isinstance(value, tdz_numba.PickledData)
        repr(ar)
        list(ar["a"])
        ar.to_dict()
        assert ar["b"].shape == (2,) or ar["b"].shape == ()
    assert not marker.exists()

    tdz_numba.verify(path)
    assert tdz_numba.is_archive(path)
    tdz_numba.unpack(path, tmp_path / f"unpacked_{kind}")
    assert not marker.exists()

    # control: the payload really is malicious
    pickled.load(allow_pickle=True)
    assert marker.exists()


def test_pickle_allow_pickle_opt_in(pickle_archives):
    archives, marker = pickle_archives
    path, rel = archives["stack"]
    with tdz_numba.open(path, allow_pickle=True) as ar:
        ar[rel]
    assert marker.exists()


# ---------------------------------------------------------------------------
# random corruption: only TdzError, in a subprocess (a crash or hang fails the test)
# ---------------------------------------------------------------------------
_FUZZ = textwrap.dedent(
    """
    import json, os, random, shutil, struct, sys, tempfile, traceback, pathlib
    import torch, tdz_numba
    from tdz_numba import TdzError
    root = pathlib.Path(sys.argv[1])
    n_iter = int(sys.argv[2])
    tree = {"a": torch.arange(10, dtype=torch.float32), "b": {"c": torch.ones(3, 4, dtype=torch.int64)},
            "tag": "hello", "n": {"x": torch.arange(3).to(torch.bfloat16)}}
    good = tdz_numba.save(tree, root / "good.tdz").read_bytes()
    good_deflate = tdz_numba.save(tree, root / "gd.tdz", compression="deflate").read_bytes()
    # byte ranges of headers and the central directory (payload flips are boring)
    def header_ranges(data):
        eocd = data.rfind(b"PK\\x05\\x06")
        count, cd_size, cd_off = struct.unpack_from("<HII", data, eocd + 10)
        ranges = [(cd_off, len(data))]
        p = cd_off
        for _ in range(count):
            nlen, elen, clen = struct.unpack_from("<HHH", data, p + 28)
            hoff = struct.unpack_from("<I", data, p + 42)[0]
            ln, le = struct.unpack_from("<HH", data, hoff + 26)
            ranges.append((hoff, hoff + 30 + ln + le))
            p += 46 + nlen + elen + clen
        return ranges
    bad = []
    refused = 0
    rng = random.Random(1234)
    for it in range(n_iter):
        src = good if it % 3 else good_deflate
        data = bytearray(src)
        ranges = header_ranges(bytes(src))
        muts = []
        for _ in range(rng.choice([1, 1, 1, 2, 3])):
            if rng.random() < 0.85:
                lo, hi = rng.choice(ranges)
                pos = rng.randrange(lo, hi)
            else:
                pos = rng.randrange(len(data))
            val = rng.choice([0, 0xFF, rng.randrange(256), data[pos] ^ (1 << rng.randrange(8))])
            muts.append((pos, data[pos], val))
            data[pos] = val
        path = root / f"f{it}.tdz"
        path.write_bytes(bytes(data))
        out = root / f"out{it}"
        for op in ("is_archive", "load", "verify", "unpack", "access"):
            try:
                if op == "is_archive":
                    r = tdz_numba.is_archive(path)
                    assert r in (True, False), r
                elif op == "load":
                    tdz_numba.load(path)
                elif op == "verify":
                    tdz_numba.verify(path)
                elif op == "unpack":
                    tdz_numba.unpack(path, out)
                else:
                    with tdz_numba.open(path) as ar:
                        for k in ("a", "b/c", "tag", "n/x"):
                            try:
                                ar[k]
                            except TdzError:
                                pass
            except TdzError:
                refused += 1
            except BaseException as exc:
                bad.append({"it": it, "op": op, "muts": muts, "exc": type(exc).__name__,
                            "tb": traceback.format_exc()[-1500:]})
        shutil.rmtree(out, ignore_errors=True)
        path.unlink()
        # nothing may escape the work directory
    leftovers = sorted(p.name for p in root.iterdir() if p.name not in ("good.tdz", "gd.tdz"))
    print(json.dumps({"bad": bad, "leftovers": leftovers, "refused": refused}))
    """
)


def test_random_corruption_only_raises_tdz_errors(tmp_path):
    script = tmp_path / "fuzz.py"
    script.write_text(_FUZZ)
    work = tmp_path / "work"
    work.mkdir()
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(
        [str(pathlib.Path(__file__).resolve().parents[1]), env.get("PYTHONPATH", "")]
    )
    proc = subprocess.run(
        [sys.executable, str(script), str(work), "600"], capture_output=True, text=True, timeout=120, env=env
    )
    assert proc.returncode == 0, f"fuzz process died (rc={proc.returncode}):\n{proc.stderr[-3000:]}"
    report = json.loads(proc.stdout.strip().splitlines()[-1])
    assert report["leftovers"] == []
    assert report["bad"] == [], json.dumps(report["bad"][:5], indent=1)
    assert report["refused"] > 600, report  # the mutations did reach the parser


def _random_json(rng: random.Random, depth: int = 0):
    kind = rng.randrange(9 if depth < 3 else 6)
    if kind == 0:
        return rng.choice([-1, 0, 1, 10, 2**31, 2**63, -(2**70), 3])
    if kind == 1:
        return rng.choice([0.5, -0.0, 1e308, float("nan"), float("inf")])
    if kind == 2:
        return rng.choice(["", "torch.float32", "torch.float128", "os.system", "../x", "\x00", "%", "é"])
    if kind == 3:
        return rng.choice([True, False, None])
    if kind in (4, 5):
        return [rng.choice([0, 1, 10, -1, 2**40, "3", 1.5, None]) for _ in range(rng.randrange(4))]
    if kind in (6, 7):
        return [_random_json(rng, depth + 1) for _ in range(rng.randrange(3))]
    return {
        rng.choice(["shape", "dtype", "type", "is_nested", "device", "x"]): _random_json(rng, depth + 1)
        for _ in range(rng.randrange(4))
    }


def test_random_meta_values_only_raise_tdz_errors(base, tmp_path):
    """Random meta.json contents (valid JSON, correct CRC): only TdzError, never a
    TypeError/ValueError/OverflowError from deep inside."""
    rng = random.Random(99)
    original = meta_of(base)
    refused = 0
    for it in range(150):
        meta = json.loads(json.dumps(original))
        target = rng.choice(["a", "b", "tag", "shape", "_class", "_type", "new", "../evil", ""])
        roll = rng.random()
        if roll < 0.4 and target in ("a", "new", "../evil", ""):
            meta[target] = {
                "device": "cpu",
                "shape": _random_json(rng, 2),
                "dtype": _random_json(rng, 2),
                "is_nested": rng.choice([False, True, 0, "yes"]),
            }
        elif roll < 0.7 and target == "a":
            meta["a"][rng.choice(["shape", "dtype", "is_nested"])] = _random_json(rng)
        else:
            meta[target] = _random_json(rng)
        path = tmp_path / f"m{it}.tdz"
        rezip(base, path, replace={"meta.json": json.dumps(meta).encode()})
        for fn in (tdz_numba.load, tdz_numba.verify, tdz_numba.is_archive):
            try:
                fn(path)
            except TdzError:
                refused += 1
            except BaseException as exc:  # pragma: no cover - reported below
                raise AssertionError(f"iteration {it}: meta {meta!r} raised {exc!r}") from exc
        path.unlink()
    assert refused > 50
