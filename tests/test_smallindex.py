"""The lazy index of a small archive (:mod:`tdz_numba.zipfmt.central`) against the mapped one.

An archive of up to ``SMALL_ENTRIES`` entries is indexed at open from the file's tail
(one ``pread``), its rows kept as lists built on first use; a larger one (here: every
one, ``SMALL_ENTRIES = -1``) is mapped and indexed into the kernel's columns. Both
must give the same columns, names, payload offsets and the same errors (type and
message), on valid archives and on thousands of mutated ones (the fuzz harness's
mutators).
"""

from __future__ import annotations

import struct
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

from ziputil import zip_bytes  # noqa: E402

import tdz_numba  # noqa: E402
from tdz_numba.errors import TdzError  # noqa: E402
from tdz_numba.zipfmt import central, eocd, records  # noqa: E402
from tdz_numba.zipfmt import index as reader  # noqa: E402
from tdz_numba.zipfmt.index import ArchiveIndex  # noqa: E402

CASES = 1500


def _err(exc: BaseException) -> tuple[str, str]:
    return type(exc).__name__, str(exc)


def observe(path: Path, small: bool, check_local: bool = False) -> list:
    """Everything an open and the lazy reads of an index show, errors included."""
    old = reader.SMALL_ENTRIES
    reader.SMALL_ENTRIES = old if small else -1
    try:
        try:
            ix = ArchiveIndex(path, check_local=check_local)
        except TdzError as exc:
            return ["open", _err(exc)]
        took_small = ix._small is not None
        out: list = [ix.names, ix.end]
        for i in range(len(ix.names)):
            try:
                out.append(ix.payload_offset(i))
                out.append(tuple(ix.row_at(i)))
            except TdzError as exc:
                out.append(_err(exc))
        for name in ix.names[:3]:
            try:
                out.append(ix.read_bytes(name))
            except TdzError as exc:
                out.append(_err(exc))
        out.append(ix._cols.tolist())
        out.append([tuple(r) for r in ix.rows])
        try:
            ix.check_all()
            out.append(ix._cols.tolist())
        except TdzError as exc:
            out.append(_err(exc))
        out.append(ix.table.tolist())
        ix.close()
        return out + [("small", took_small and small)]
    finally:
        reader.SMALL_ENTRIES = old


def _same(path: Path) -> bool:
    """Asserts both paths agree on ``path``; returns whether the small path accepted it."""
    got, want = observe(path, True), observe(path, False)
    took = got.pop()[1] if got[0] != "open" else False
    if want[0] != "open":
        want.pop()
    assert got == want, path
    assert observe(path, True, True) == observe(path, False, True)
    return took


@pytest.fixture(scope="module")
def seeds(tmp_path_factory):
    from fuzz.seeds import make_seeds

    return make_seeds(tmp_path_factory.mktemp("smallseeds"))


def test_valid_archives_take_the_small_path(seeds, tmp_path):
    taken = []
    for sd in seeds:
        p = tmp_path / f"{sd.name}.tdz"
        p.write_bytes(sd.data)
        taken.append((sd.name, _same(p)))
    # every seed but those with a bad or unusual name or a huge entry count takes it
    assert sum(t for _, t in taken) >= len(seeds) - 2, taken


def test_fixtures_agree():
    fixtures = Path(__file__).resolve().parent / "fixtures"
    for p in sorted(fixtures.glob("*.tdz")):
        assert _same(p), p


def test_hostile_fixtures_agree(tmp_path):
    import gzip

    for i, gz in enumerate(
        sorted((Path(__file__).resolve().parent / "fixtures" / "hostile").glob("*.bin.gz"))
    ):
        p = tmp_path / f"h{i}.tdz"
        p.write_bytes(gzip.decompress(gz.read_bytes()))
        _same(p)


def test_mutated_archives_agree(seeds, tmp_path):
    from fuzz.runner import make_cases

    small_ok = 0
    for case in make_cases(seeds, "smallindex-1", 0, CASES):
        p = tmp_path / "case.tdz"
        p.write_bytes(case.data)
        small_ok += _same(p)
    assert small_ok > CASES // 10  # many mutations leave the central directory readable


_zip = zip_bytes


@pytest.mark.parametrize(
    "entries",
    [
        {"meta.json": b"{}", "ä/b.memmap": b"x"},  # UTF-8 names
        {"meta.json": b"{}", "a": b"1", "b": b""},
        {"meta.json": b"{}", "d/": b""},
        {},
    ],
)
def test_plain_zips_agree(tmp_path, entries):
    p = tmp_path / "z.zip"
    p.write_bytes(_zip(entries))
    assert _same(p)


def test_unusual_archives_agree(tmp_path):
    """Duplicate names, cp437 names, encrypted flags, unknown methods: both paths decide alike."""
    base = _zip({"meta.json": b"{}", "ab": b"1", "ac": b"2"})
    data = bytearray(base)
    cd = eocd.find_end_record(bytes(data)).cd_offset
    second = data.index(b"PK\x01\x02", cd + 1)
    third = data.index(b"PK\x01\x02", second + 1)
    cases = {}
    dup = bytearray(base)
    dup[third + 46 : third + 48] = b"ab"  # the central directory names "ab" twice
    cases["dup"] = dup
    cp437 = bytearray(base)
    cp437[second + 46 : second + 48] = b"\x81\x82"  # not UTF-8, no UTF-8 flag: cp437
    cases["cp437"] = cp437
    flagged = bytearray(cp437)
    flagged[second + 8 : second + 10] = struct.pack("<H", records.FLAG_UTF8)
    cases["utf8_flag"] = flagged
    enc = bytearray(base)
    enc[second + 8 : second + 10] = struct.pack("<H", records.FLAG_ENCRYPTED)
    cases["encrypted"] = enc
    method = bytearray(base)
    method[second + 10 : second + 12] = struct.pack("<H", 99)
    cases["method"] = method
    opens = {"cp437": True}  # (no UTF-8 flag: a legacy cp437 name)
    for name, blob in cases.items():
        p = tmp_path / f"{name}.zip"
        p.write_bytes(bytes(blob))
        assert _same(p) == opens.get(name, False), name
        found = central.read_central(bytes(blob), eocd.find_end_record(bytes(blob)))
        assert found.status == (0, 0, 0, 0), name  # the records are sound: the names and flags are not
        assert (found.names is None) == (name in ("cp437", "utf8_flag")), name
        assert (found.encrypted, found.unknown_method) == (
            1 if name == "encrypted" else -1,
            1 if name == "method" else -1,
        ), name
    assert ArchiveIndex(tmp_path / "cp437.zip").names[1] == b"\x81\x82".decode("cp437")
    with pytest.raises(tdz_numba.BadArchiveError, match="has the UTF-8 flag but its name is not UTF-8"):
        ArchiveIndex(tmp_path / "utf8_flag.zip")
    with pytest.raises(tdz_numba.UnsupportedError, match="'ab' is encrypted"):
        ArchiveIndex(tmp_path / "encrypted.zip")
    with pytest.raises(tdz_numba.UnsupportedError, match="compression method 99"):
        ArchiveIndex(tmp_path / "method.zip")
    with pytest.raises(tdz_numba.BadArchiveError, match="'ab' appears twice"):
        ArchiveIndex(tmp_path / "dup.zip")


def test_zip64_central_records(tmp_path):
    """Central records whose sizes and offsets live in a zip64 extra (as zipfile writes past 2 GiB)."""
    from fuzz.zipmodel import to_zip64

    seed = tdz_numba.save({"a": torch.arange(5), "b": {"c": torch.ones(3)}}, tmp_path / "s.tdz")
    p = tmp_path / "z64.tdz"
    p.write_bytes(to_zip64(seed.read_bytes()))
    assert _same(p)
    ix = ArchiveIndex(p)
    assert ix._small is not None and ix.end.zip64


def test_open_and_load_unchanged(tmp_path, small_tree):
    p = tdz_numba.save(small_tree, tmp_path / "x.tdz")
    with tdz_numba.open(p) as ar:
        ix = ar.source.index
        assert ix._small is not None  # lazy: no numpy columns yet
        assert ar["a"].tolist() == small_tree["a"].tolist()
        assert ix._small is not None and ix._buffer is not None
    tree = tdz_numba.load(p)
    assert torch.equal(tree["nested"]["deep"]["c"], small_tree["nested"]["deep"]["c"])


def test_buffer_and_table_are_lazy(tmp_path):
    p = tdz_numba.save({"a": torch.arange(4)}, tmp_path / "x.tdz")
    ix = ArchiveIndex(p)
    assert ix._buffer is None and ix._cols_np is None
    assert ix.entry("a.memmap").payload_offset == ix.payload_offset(1)
    assert ix._cols_np is None
    table = ix.table
    assert ix._small is None and table["payload_offset"][1] == ix.payload_offset(1)
    assert isinstance(ix.buffer, np.ndarray) and ix.buffer.size == ix.size
    ix.close()
    assert ix.buffer is None


def test_big_archives_take_the_kernel(tmp_path, monkeypatch):
    p = tdz_numba.save({f"k{i}": torch.zeros(1) for i in range(20)}, tmp_path / "x.tdz")
    monkeypatch.setattr(reader, "SMALL_ENTRIES", 10)
    assert ArchiveIndex(p)._small is None
    monkeypatch.setattr(reader, "SMALL_ENTRIES", 21)
    assert ArchiveIndex(p)._small is not None


def test_end_record_with_comment_and_sniff(tmp_path):
    data = _zip({"meta.json": b"{}"})
    with_comment = data[:-2] + struct.pack("<H", 5) + b"hello"
    end = eocd.find_end_record(with_comment)
    assert end == eocd.find_end_record(data)
    p = tmp_path / "c.tdz"
    p.write_bytes(with_comment)
    from tdz_numba.formats.detect import sniff

    kind, ix = sniff(p)
    assert kind == "tdz" and ix.names == ["meta.json"]
    ix.close()


def test_zip64_end_signature_message_as_before(tmp_path):
    """A zip64 end record with a bad signature is named as the structured dtype read it (trailing NULs dropped)."""
    src = tdz_numba.save({"a": torch.zeros(2)}, tmp_path / "x.tdz")
    data = bytearray(src.read_bytes())
    from fuzz.zipmodel import to_zip64

    data = bytearray(to_zip64(bytes(data)))
    z = data.rfind(records.ZIP64_END_SIG)
    data[z : z + 4] = b"PK\x00\x00"
    with pytest.raises(tdz_numba.BadArchiveError, match=r"found b'PK'\)"):
        eocd.find_end_record(bytes(data))


def _reordered(data: bytes, order: list[int]) -> bytes:
    """``data`` with its central records listed in ``order`` (local headers stay where they are)."""
    end = eocd.find_end_record(data)
    cd = data[end.cd_offset : end.cd_offset + end.cd_size]
    recs, p = [], 0
    while p < len(cd):
        nlen, elen, clen = struct.unpack_from("<HHH", cd, p + 28)
        recs.append(cd[p : p + 46 + nlen + elen + clen])
        p += 46 + nlen + elen + clen
    return data[: end.cd_offset] + b"".join(recs[i] for i in order) + data[end.cd_offset + end.cd_size :]


def test_central_records_out_of_file_order(tmp_path):
    """The overlap check sorts by header offset when the central directory is not in file order."""
    data = _zip({"meta.json": b"{}", "a": b"1" * 10, "b": b"22", "c": b""})
    p = tmp_path / "r.zip"
    p.write_bytes(_reordered(data, [2, 0, 3, 1]))
    assert _same(p)
    ix = ArchiveIndex(p)
    assert ix.names == ["b", "meta.json", "c", "a"] and ix.read_bytes("a") == b"1" * 10
    # an entry whose stored bytes run into the next record: refused the same way on both paths
    bad = bytearray(_reordered(data, [2, 0, 3, 1]))
    end = eocd.find_end_record(bytes(bad))
    pos = bad.index(b"PK\x01\x02", end.cd_offset + 1)  # the second central record: meta.json
    bad[pos + 20 : pos + 28] = struct.pack("<II", 30, 30)
    p.write_bytes(bytes(bad))
    assert not _same(p)
    with pytest.raises(tdz_numba.BadArchiveError, match="overlapping the next record"):
        ArchiveIndex(p)


def test_twin_mode_keeps_lazy_rows_at_any_size(tmp_path, monkeypatch):
    """When the dispatcher runs the pure-Python twin, the rows stay lazy lists at any size."""
    from tdz_numba.jit import policy

    p = tdz_numba.save({f"k{i}": torch.zeros(1) for i in range(20)}, tmp_path / "x.tdz")
    monkeypatch.setattr(reader, "SMALL_ENTRIES", 5)
    with policy.forced("never"):
        ix = ArchiveIndex(p)
        assert ix._small is not None
        assert ix.read_bytes("k3.memmap") == bytes(4)
    with policy.forced("always"):
        assert ArchiveIndex(p)._small is None
