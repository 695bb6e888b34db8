"""Per-payload XXH3-128 digests (issue 24): save/append/Writer/convert(digest=True), their bytes in
the central record, info(k).digest, verify(deep=True), refresh_checksums, diff and only_changed by
digest, other tools reading digest archives; the central parser's EXTRA_OVERRUN status."""

from __future__ import annotations

import struct
import subprocess
import sys
import zipfile
import zlib
from pathlib import Path
from unittest import mock

import numpy as np
import pytest
import torch
from ziputil import parse_zip

import tdz_numba
from tdz_numba.jit import policy
from tdz_numba.zipfmt import eocd, payload, records
from tdz_numba.zipfmt.index import ArchiveIndex
from tdz_numba.zipfmt.kernels import central_twin
from tdz_numba.zipfmt.kernels import dispatch as kernel_dispatch

xxhash = pytest.importorskip("xxhash")

BIG = payload.PIECE * 2 + 12_345  # a leaf written in several pieces (one unit with digests)
TREE = {
    "a": torch.arange(10.0),
    "s": {"b": torch.ones(3, dtype=torch.int16), "empty": torch.zeros(0)},
    "name": "run1",
    "big": torch.arange(BIG // 4, dtype=torch.int32),
}
LEAVES = {"a": TREE["a"], "s/b": TREE["s"]["b"], "big": TREE["big"]}


def _hex(t: torch.Tensor) -> str:
    return xxhash.xxh3_128_hexdigest(t.contiguous().numpy().tobytes())


def _digests(path: Path) -> dict[str, str | None]:
    with tdz_numba.open(path) as ar:
        return {k: ar.info(k).digest for k in LEAVES}


def _blocks(data: bytes) -> dict[str, tuple[int, int, int, bytes]]:
    """The digest blocks of every central record, parsed by hand: name -> (id, len, algo, value)."""
    out = {}
    for r in parse_zip(data).records:
        nlen, elen = struct.unpack_from("<HH", data, r.cpos + 28)
        q, end = r.cpos + 46 + nlen, r.cpos + 46 + nlen + elen
        while q + 4 <= end:
            hid, hlen = struct.unpack_from("<HH", data, q)
            if hid == 0x6874:
                out[r.name] = (hid, hlen, data[q + 4], bytes(data[q + 5 : q + 4 + hlen]))
            q += 4 + hlen
        # never in the local header
        lq, lend = r.local_extra, r.local_extra + r.local_extra_len
        while lq + 4 <= lend:
            hid, hlen = struct.unpack_from("<HH", data, lq)
            assert hid != 0x6874, r.name
            lq += 4 + hlen
    return out


@pytest.mark.parametrize(
    "kw",
    [{}, {"compression": "deflate"}, {"compression": "lzma"}, {"num_threads": 3}, {"align": "auto"}],
    ids=["stored", "deflate", "lzma", "threads", "auto"],
)
def test_save_digests_equal_xxhash(tmp_path, kw):
    p = tdz_numba.save(TREE, tmp_path / "x.tdz", digest=True, **kw)
    assert _digests(p) == {k: _hex(t) for k, t in LEAVES.items()}
    data = p.read_bytes()
    blocks = _blocks(data)
    assert sorted(blocks) == ["a.memmap", "big.memmap", "s/b.memmap"]  # payloads only (no meta.json)
    for name, (hid, hlen, algo, value) in blocks.items():
        key = name[: -len(".memmap")]
        assert (hid, hlen, algo, len(value)) == (0x6874, 17, 1, 16)
        assert value == xxhash.xxh3_128_digest(LEAVES[key].numpy().tobytes())
    with zipfile.ZipFile(p) as z:  # zipfile reads it: CRCs and every entry
        assert z.testzip() is None
        assert z.read("s/b.memmap") == LEAVES["s/b"].numpy().tobytes()
    assert tdz_numba.load(p)["big"].equal(TREE["big"])


def test_without_digest_nothing_changes(tmp_path):
    a = tdz_numba.save(TREE, tmp_path / "a.tdz")
    assert _digests(a) == dict.fromkeys(LEAVES)
    assert _blocks(a.read_bytes()) == {}
    b = tdz_numba.save(TREE, tmp_path / "b.tdz", digest=True)
    # the digest blocks are the only difference: 21 bytes per payload in the central directory
    assert b.stat().st_size - a.stat().st_size == 3 * records.DigestExtra.SIZEOF


def test_other_tools_read_digest_archives(tmp_path):
    p = tdz_numba.save(TREE, tmp_path / "x.tdz", digest=True)
    tdz_numba.append(p, {"c": torch.ones(4)})
    assert _digests(p)["a"] == _hex(TREE["a"])
    unzip = subprocess.run(["unzip", "-tq", str(p)], capture_output=True, text=True)
    if unzip.returncode != 127:  # (unzip installed)
        assert unzip.returncode == 0, unzip.stdout + unzip.stderr
    td = pytest.importorskip("tensordict")
    back = td.TensorDict.load_memmap(p)
    assert back["big"].equal(TREE["big"]) and back["c"].tolist() == [1.0] * 4


def test_writer_digests_streamed_and_added(tmp_path):
    p = tmp_path / "w.tdz"
    with tdz_numba.Writer(p, digest=True) as w:
        w.add("a", TREE["a"])
        w.add("s/b", TREE["s"]["b"])
        with w.stream("big", (BIG // 4,), torch.int32) as sink:
            for i in range(0, BIG // 4, 300_001):
                sink.write(TREE["big"][i : i + 300_001])
    assert _digests(p) == {k: _hex(t) for k, t in LEAVES.items()}
    assert tdz_numba.verify(p, deep=True).digests == 3


def test_append_and_compact_keep_digests(tmp_path):
    p = tdz_numba.save(TREE, tmp_path / "x.tdz", digest=True)
    before = p.read_bytes()
    old = _blocks(before)
    old_records = {r.name: before[r.cpos : r.cpos + r.clen] for r in parse_zip(before).records}
    tdz_numba.append(p, {"c": torch.full((5,), 2.0)})  # digest=None: as the archive
    after = p.read_bytes()
    assert after[: parse_zip(before).cd_off] == before[: parse_zip(before).cd_off]
    new_records = {r.name: after[r.cpos : r.cpos + r.clen] for r in parse_zip(after).records}
    for name in ("a.memmap", "big.memmap", "s/b.memmap"):  # kept byte for byte, digest included
        assert new_records[name] == old_records[name]
    blocks = _blocks(after)
    assert {k: blocks[k] for k in old} == old
    assert blocks["c.memmap"][3] == xxhash.xxh3_128_digest(torch.full((5,), 2.0).numpy().tobytes())
    tdz_numba.compact(p)
    assert _blocks(p.read_bytes()) == blocks
    assert tdz_numba.verify(p, deep=True).digests == 4
    # an append without digests to an archive without them adds none
    q = tdz_numba.save({"a": torch.ones(2)}, tmp_path / "q.tdz")
    tdz_numba.append(q, {"b": torch.ones(2)})
    assert _blocks(q.read_bytes()) == {}
    tdz_numba.append(q, {"c": torch.ones(2)}, digest=True)
    assert list(_blocks(q.read_bytes())) == ["c.memmap"]


def test_only_changed_compares_digests_without_reading(tmp_path):
    p = tdz_numba.save({"a": torch.arange(1000), "b": torch.ones(100)}, tmp_path / "x.tdz", digest=True)
    with mock.patch.object(ArchiveIndex, "read", side_effect=AssertionError("payload read")):
        written = tdz_numba.append(
            p, {"a": torch.arange(1000), "b": torch.zeros(100)}, replace=True, only_changed=True
        )
    assert written == ["b"]
    with tdz_numba.open(p) as ar:
        assert ar["b"].tolist() == [0.0] * 100 and ar.info("b").digest == _hex(torch.zeros(100))


def test_diff_by_digest_reads_no_payload(tmp_path):
    import tdz_numba.diffing as diffing

    a = tdz_numba.save({"w": torch.ones(1000), "x": torch.arange(10)}, tmp_path / "a.tdz", digest=True)
    b = tdz_numba.save({"w": torch.ones(1000), "x": torch.arange(10) + 1}, tmp_path / "b.tdz", digest=True)
    with (
        mock.patch.object(ArchiveIndex, "read", side_effect=AssertionError("payload read")),
        mock.patch.object(diffing, "_bytes_equal", side_effect=AssertionError("bytes compared")),
    ):
        report = tdz_numba.diff(a, b)
    assert (report.same, report.changed) == (["w"], ["x"])
    # one side without digests: the bytes are compared (CRC first), the same answer
    c = tdz_numba.save({"w": torch.ones(1000), "x": torch.arange(10)}, tmp_path / "c.tdz")
    with mock.patch.object(diffing, "_bytes_equal", wraps=diffing._bytes_equal) as compared:
        report = tdz_numba.diff(a, c)
    assert (report.same, report.changed) == (["w", "x"], []) and compared.call_count == 2


def _restamp_crc(data: bytearray, name: str) -> None:
    """Writes the CRC of entry ``name``'s current bytes into its local header and central record."""
    r = next(r for r in parse_zip(data).records if r.name == name)
    crc = struct.pack("<I", zlib.crc32(bytes(data[r.payload : r.payload + r.csize])))
    data[r.hoff + 14 : r.hoff + 18] = crc
    data[r.cpos + 16 : r.cpos + 20] = crc


def test_deep_verify_finds_a_flipped_byte(tmp_path):
    p = tdz_numba.save(TREE, tmp_path / "x.tdz", digest=True)
    report = tdz_numba.verify(p, deep=True)
    assert report.digests == 3 and "XXH3-128 digest of 3 leaves" in str(report)
    assert tdz_numba.verify(p).digests == 0
    data = bytearray(p.read_bytes())
    r = next(r for r in parse_zip(data).records if r.name == "s/b.memmap")
    data[r.payload + 1] ^= 0x10
    _restamp_crc(data, "s/b.memmap")  # the CRC agrees: only the digest sees the change
    p.write_bytes(bytes(data))
    assert tdz_numba.verify(p).leaves == 4  # (the empty leaf too)
    with pytest.raises(tdz_numba.ChecksumError, match=r"leaf 's/b' \(entry 's/b.memmap'\): XXH3-128") as exc:
        tdz_numba.verify(p, deep=True)
    assert exc.value.entry == "s/b.memmap"
    cli = subprocess.run(
        [sys.executable, "-m", "tdz_numba", "verify", "--deep", str(p)], capture_output=True, text=True
    )
    assert cli.returncode == 1 and "s/b.memmap" in cli.stderr
    assert subprocess.run([sys.executable, "-m", "tdz_numba", "verify", str(p)]).returncode == 0


def test_deep_verify_of_a_url_and_a_file_object(tmp_path):
    """``verify(url, deep=True)``: the digests recomputed from the bytes the CRC check fetched;
    a change with its CRC restamped is found there as in a local file."""
    import io

    fsspec = pytest.importorskip("fsspec")
    p = tdz_numba.save(TREE, tmp_path / "x.tdz", digest=True)
    fs = fsspec.filesystem("memory")
    fs.pipe("/deep/x.tdz", p.read_bytes())
    try:
        assert tdz_numba.verify("memory://deep/x.tdz", deep=True).digests == 3
        assert tdz_numba.verify("memory://deep/x.tdz").digests == 0
        assert tdz_numba.verify(io.BytesIO(p.read_bytes()), deep=True).digests == 3
        data = bytearray(p.read_bytes())
        r = next(r for r in parse_zip(data).records if r.name == "s/b.memmap")
        data[r.payload + 1] ^= 0x10
        _restamp_crc(data, "s/b.memmap")
        fs.pipe("/deep/x.tdz", bytes(data))
        assert tdz_numba.verify("memory://deep/x.tdz").leaves == 4  # the CRCs agree
        with pytest.raises(tdz_numba.ChecksumError, match=r"leaf 's/b' \(entry 's/b.memmap'\): XXH3-128"):
            tdz_numba.verify("memory://deep/x.tdz", deep=True)
        with pytest.raises(tdz_numba.ChecksumError, match=r"leaf 's/b'"):
            tdz_numba.verify(io.BytesIO(bytes(data)), deep=True)
    finally:
        fs.rm("/deep", recursive=True)


def test_deep_verify_a_damaged_digest(tmp_path):
    p = tdz_numba.save(TREE, tmp_path / "x.tdz", digest=True)
    data = bytearray(p.read_bytes())
    ix = ArchiveIndex(p)
    at = ix.digest_offset(ix.row("big.memmap"))
    ix.close()
    assert bytes(data[at : at + 16]) == xxhash.xxh3_128_digest(TREE["big"].numpy().tobytes())
    data[at + 15] ^= 1
    p.write_bytes(bytes(data))
    with pytest.raises(tdz_numba.ChecksumError, match="leaf 'big'"):
        tdz_numba.verify(p, deep=True)


def test_refresh_checksums_restamps_digests(tmp_path):
    p = tdz_numba.save(TREE, tmp_path / "x.tdz", digest=True)
    with tdz_numba.open(p, mode="r+") as ar:  # r+ close restamps what it handed out
        ar["a"][3] = 100.0
    want = TREE["a"].clone()
    want[3] = 100.0
    assert _digests(p)["a"] == _hex(want) and tdz_numba.verify(p, deep=True).digests == 3
    data = bytearray(p.read_bytes())  # written behind our back: refresh_checksums restamps both
    r = next(r for r in parse_zip(data).records if r.name == "s/b.memmap")
    data[r.payload] ^= 1
    p.write_bytes(bytes(data))
    with pytest.raises(tdz_numba.ChecksumError):
        tdz_numba.verify(p, deep=True)
    tdz_numba.refresh_checksums(p)
    assert tdz_numba.verify(p, deep=True).digests == 3
    with tdz_numba.open(p) as ar:
        assert ar.info("s/b").digest == _hex(ar["s/b"])


def test_convert_digest(tmp_path):
    from safetensors.torch import save_file

    save_file({"w": torch.randn(100), "b": torch.arange(7)}, tmp_path / "m.safetensors")
    out = tdz_numba.convert(tmp_path / "m.safetensors", tmp_path / "m.tdz", digest=True)
    with tdz_numba.open(out) as ar:
        assert {k: ar.info(k).digest for k in ("w", "b")} == {k: _hex(ar[k]) for k in ("w", "b")}


def test_digest_needs_the_extra(tmp_path):
    with mock.patch.dict(sys.modules, {"xxhash": None}):
        with pytest.raises(tdz_numba.UnsupportedError, match="'digest' extra"):
            tdz_numba.save(TREE, tmp_path / "x.tdz", digest=True)
        with pytest.raises(tdz_numba.UnsupportedError, match="'digest' extra"):
            tdz_numba.Writer(tmp_path / "w.tdz", digest=True)
    assert not (tmp_path / "x.tdz").exists()


def test_kernel_and_twin_find_the_same_digests(tmp_path):
    p = tdz_numba.save(TREE, tmp_path / "x.tdz", digest=True)
    tdz_numba.append(p, {"c": torch.ones(3)}, digest=False)  # records with and without a digest
    data = p.read_bytes()
    end = eocd.find_end_record(data)
    cd = data[end.cd_offset : end.cd_offset + end.cd_size]
    twin = central_twin.parse_central(cd, end.cd_offset, end.count)
    with policy.forced("always"):
        fast = kernel_dispatch.parse_central(cd, end.cd_offset, end.count)
    names = twin.names
    assert fast.names == names
    got = [fast.rows.digest(i) for i in range(len(names))]
    assert got == [twin.rows.digest(i) for i in range(len(names))]
    ix = ArchiveIndex(p)
    for name, value in zip(names, got):
        assert value == ix.digest(name)
        assert (value is not None) == (name in ("a.memmap", "big.memmap", "s/b.memmap"))
    ix.close()


# --------------------------------------------------------------------------------------------
# A central extra block that runs past the record's extra field (records.Status.EXTRA_OVERRUN)
# --------------------------------------------------------------------------------------------
def _zip_by_hand(central_extra: bytes, name: bytes = b"a.memmap", data: bytes = b"abcd") -> bytes:
    """One STORED entry: a local header without extra, a central record with ``central_extra``."""
    crc = zlib.crc32(data)
    local = struct.pack("<IHHHHHIIIHH", 0x04034B50, 20, 0, 0, 0, 33, crc, len(data), len(data), len(name), 0)
    body = local + name + data
    central = struct.pack(
        "<IHHHHHHIIIHHHHHII",
        0x02014B50,
        20,
        20,
        0,
        0,
        0,
        33,
        crc,
        len(data),
        len(data),
        len(name),
        len(central_extra),
        0,
        0,
        0,
        0,
        0,
    )
    cd = central + name + central_extra
    end = struct.pack("<4sHHHHIIH", b"PK\x05\x06", 0, 0, 1, 1, len(cd), len(body), 0)
    return body + cd + end


@pytest.mark.parametrize("impl", ["twin", "kernel"])
def test_extra_block_overrun_refused(tmp_path, impl):
    good = _zip_by_hand(struct.pack("<HH", 0x6474, 4) + bytes(4))
    bad = _zip_by_hand(struct.pack("<HH", 0x6474, 9) + bytes(4))  # claims 9 bytes, 4 follow
    for data, ok in ((good, True), (bad, False)):
        end = eocd.find_end_record(data)
        cd = data[end.cd_offset : end.cd_offset + end.cd_size]
        with policy.forced("never" if impl == "twin" else "always"):
            found = kernel_dispatch.parse_central(cd, end.cd_offset, end.count)
        if ok:
            assert found.status == (0, 0, 0, 0)
            continue
        extra_end = end.cd_offset + 46 + 8 + 8
        assert found.status == (records.Status.EXTRA_OVERRUN, 0, extra_end, extra_end - 8 + 4 + 9)
        with pytest.raises(zipfile.BadZipFile, match="Corrupt extra field 6474"):
            zipfile.ZipFile(__import__("io").BytesIO(data))
        p = tmp_path / "bad.zip"
        p.write_bytes(data)
        with policy.forced("never" if impl == "twin" else "always"):
            with pytest.raises(
                tdz_numba.BadArchiveError, match="entry 'a.memmap': a central extra block runs"
            ):
                ArchiveIndex(p)
    # 1-3 bytes after the last block are ignored, as zipfile ignores them
    tail = _zip_by_hand(struct.pack("<HH", 0x6474, 0) + b"\x00\x00")
    end = eocd.find_end_record(tail)
    with policy.forced("never" if impl == "twin" else "always"):
        found = kernel_dispatch.parse_central(
            tail[end.cd_offset : end.cd_offset + end.cd_size], end.cd_offset, 1
        )
    assert found.status == (0, 0, 0, 0)
    with zipfile.ZipFile(__import__("io").BytesIO(tail)) as z:
        assert z.read("a.memmap") == b"abcd"


def test_a_digest_block_of_another_length_or_algorithm_is_ignored():
    value = bytes(range(16))
    for block, seen in (
        (struct.pack("<HHB16s", 0x6874, 17, 1, value), value),
        (struct.pack("<HHB16s", 0x6874, 17, 2, value), None),  # another algorithm
        (struct.pack("<HHB15s", 0x6874, 16, 1, value[:15]), None),  # another length
    ):
        data = _zip_by_hand(struct.pack("<HH", 0x6474, 2) + bytes(2) + block)
        end = eocd.find_end_record(data)
        cd = data[end.cd_offset : end.cd_offset + end.cd_size]
        for mode in ("never", "always"):
            with policy.forced(mode):
                found = kernel_dispatch.parse_central(cd, end.cd_offset, 1)
            assert found.status == (0, 0, 0, 0) and found.rows.digest(0) == seen, mode
        assert np.frombuffer(data, np.uint8).size == len(data)
