"""verify's parallel pass (tdz_numba.archive.verify_pass, tdz_numba.zipfmt.kernels.verify): kernel oracles
(zlib.crc32, a Python plan), and the same report or the same error as the sequential
checks on valid, corrupted and mutated archives."""

from __future__ import annotations

import os
import struct
import threading
import zlib
from pathlib import Path

import numpy as np
import pytest
import torch
from numba import njit

import tdz_numba
from tdz_numba.archive import verify as integrity
from tdz_numba.archive import verify_pass
from tdz_numba.errors import BadArchiveError, ChecksumError
from tdz_numba.zipfmt.index import ArchiveIndex
from tdz_numba.zipfmt.kernels import verify as vk


# -- kernels against oracles ---------------------------------------------------------------
def naive_plan(crc_len, chunk, target):
    first, owner, bounds, held = [0], [], [0], 0
    for k, n in enumerate(crc_len):
        pieces = max(1, -(-n // chunk))
        first.append(first[-1] + pieces)
        left = n
        for j in range(first[k], first[k + 1]):
            owner.append(k)
            size = min(chunk, left)
            left -= size
            held += size + 4096
            if held >= target:
                bounds.append(j + 1)
                held = 0
    if bounds[-1] != first[-1]:
        bounds.append(first[-1])
    return first, owner, bounds


@pytest.mark.parametrize(
    "lens, chunk, target",
    [
        ([0], 64, 1),
        ([5, 0, 3000, 64, 65], 64, 200),
        ([1 << 20, 3 << 20, 17], 1 << 20, 2 << 20),
        ([0] * 9, 8, 10_000),
    ],
)
def test_plan_pieces_matches_python(lens, chunk, target):
    first, owner, items = vk.plan_pieces(np.array(lens, np.int64), chunk, target)
    assert (first.tolist(), owner.tolist(), items.tolist()) == naive_plan(lens, chunk, target)


@pytest.mark.parametrize("chunk", [1, 7, 64, 4096])
def test_fold_pieces_matches_zlib(chunk):
    rng = np.random.default_rng(1)
    blobs = [
        rng.bytes(n)
        for n in (0, 1, chunk - 1 if chunk > 1 else 0, chunk, chunk + 1, 3 * chunk, 5 * chunk + 3)
    ]
    lens = np.array([len(b) for b in blobs], np.int64)
    first, _, _ = vk.plan_pieces(lens, chunk, 1 << 30)
    crcs = np.zeros(int(first[-1]), np.uint32)
    for k, b in enumerate(blobs):
        for p, j in enumerate(range(first[k], first[k + 1])):
            crcs[j] = zlib.crc32(b[p * chunk : (p + 1) * chunk])
    assert vk.fold_pieces(crcs, first, lens, chunk).tolist() == [zlib.crc32(b) for b in blobs]


@njit(nogil=True)
def _take_many(counter, n, out):
    for k in range(n):
        out[k] = vk.fetch_add(counter, 1)


def test_fetch_add_is_atomic_across_threads():
    counter = np.zeros(1, np.int64)
    n = 200_000
    outs = [np.empty(n, np.int64) for _ in range(3)]
    _take_many(counter, 1, np.empty(1, np.int64))  # compiled before the race
    counter[0] = 0
    threads = [threading.Thread(target=_take_many, args=(counter, n, o)) for o in outs]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert counter[0] == 3 * n
    assert np.array_equal(np.sort(np.concatenate(outs)), np.arange(3 * n))


@pytest.fixture(scope="module")
def big(tmp_path_factory):
    """Leaves of one and of several CRC chunks, a compressed-free tree of repeated levels."""
    g = torch.Generator().manual_seed(0)
    tree = {f"g{i}": {f"x{j}": torch.randn(1000 + 37 * j, generator=g) for j in range(5)} for i in range(6)}
    tree["large"] = torch.randn((3 << 20) // 4 + 5, generator=g)  # 3 MiB + 20 bytes: 4 pieces
    tree["empty"] = torch.empty(0)
    return tdz_numba.save(tree, tmp_path_factory.mktemp("big") / "big.tdz")


@pytest.mark.parametrize("helpers", [0, 1, 3])
def test_crc_pass_matches_zlib_on_every_entry(big, helpers, monkeypatch):
    monkeypatch.setattr(verify_pass, "ITEM_BYTES", 64 << 10)  # many items: the threads share them
    index = ArchiveIndex(big)
    try:
        crc = verify_pass.CrcPass(index, helpers=helpers)
        crc.join()
        assert int(crc._entered[0]) == 1 + len(crc._threads)  # every helper ran the kernel
        assert crc.failed_rows() == []
        table = index.table
        stored = np.nonzero(table["method"] == 0)[0]
        got = crc.crcs(stored)
        buf = index.buffer
        for row, c in zip(stored.tolist(), got.tolist()):
            off, n = int(table["payload_offset"][row]), int(table["csize"][row])
            assert c == zlib.crc32(buf[off : off + n]) == int(table["crc"][row])
        check = ArchiveIndex(big, check_local=True)  # the pass filled in what check_all reads
        assert np.array_equal(check.table["payload_offset"], table["payload_offset"])
        check.close()
    finally:
        index.close()


def test_crc_pass_rows_see_the_filled_offsets(big):
    index = ArchiveIndex(big)
    try:
        before = index.rows  # cached row tuples, built before the pass
        assert any(r.payload_offset < 0 for r in before)
        verify_pass.CrcPass(index, helpers=1).join()
        assert [r.payload_offset for r in index.rows] == index.table["payload_offset"].tolist()
        assert min(r.payload_offset for r in index.rows) >= 0
        assert index.row_at(len(before) - 1).payload_offset >= 0
    finally:
        index.close()


# -- the same outcome as the sequential checks -------------------------------------------------
def _outcome(path, parallel: bool, monkeypatch):
    monkeypatch.setattr(verify_pass, "MIN_HELPER_BYTES", 0)  # helper threads even on tiny files
    monkeypatch.setattr(verify_pass, "ITEM_BYTES", 4096)
    if not parallel:
        monkeypatch.setattr(integrity, "_parallel_ok", lambda source: False)
    try:
        r = tdz_numba.verify(path)
        return ("ok", r.entries, r.levels, r.leaves, r.payload_bytes)
    except Exception as exc:  # noqa: BLE001 - compared between the two paths
        return (type(exc).__name__, str(exc))
    finally:
        monkeypatch.undo()


def _same(path, monkeypatch):
    seq = _outcome(path, False, monkeypatch)
    par = _outcome(path, True, monkeypatch)
    assert par == seq
    return par


def test_valid_archive_same_report(big, monkeypatch):
    out = _same(big, monkeypatch)
    assert out[0] == "ok" and out[2] == 7 and out[3] == 32


def _patch(path: Path, out: Path, at: int, data: bytes) -> Path:
    raw = bytearray(path.read_bytes())
    raw[at : at + len(data)] = data
    out.write_bytes(bytes(raw))
    return out


def _entry(path, name):
    index = ArchiveIndex(path, check_local=True)
    try:
        row = index.row(name)
        return index.row_at(row)
    finally:
        index.close()


def test_bad_byte_in_a_large_leaf_named(big, tmp_path, monkeypatch):
    r = _entry(big, "large.memmap")
    bad = _patch(big, tmp_path / "b.tdz", r.payload_offset + (2 << 20) + 3, b"\x55")
    out = _same(bad, monkeypatch)
    assert out[0] == "ChecksumError" and "large.memmap" in out[1]


def test_bad_local_header_same_error(big, tmp_path, monkeypatch):
    r = _entry(big, "g3/x2.memmap")
    bad = _patch(big, tmp_path / "h.tdz", r.header_offset, b"PK\x09\x09")
    out = _same(bad, monkeypatch)
    assert out[0] == "BadArchiveError" and "g3/x2.memmap" in out[1]


def _rewrite_meta(path: Path, out: Path, level: str, old: bytes, new: bytes) -> Path:
    """Replaces bytes inside a level's meta.json (same length) and re-stamps its CRC."""
    r = _entry(path, level + "meta.json")
    raw = bytearray(path.read_bytes())
    doc = bytes(raw[r.payload_offset : r.payload_offset + r.size])
    assert old in doc and len(old) == len(new)
    doc = doc.replace(old, new, 1)
    raw[r.payload_offset : r.payload_offset + r.size] = doc
    crc = struct.pack("<I", zlib.crc32(doc))
    raw[r.header_offset + 14 : r.header_offset + 18] = crc
    raw[r.central_offset + 16 : r.central_offset + 20] = crc
    out.write_bytes(bytes(raw))
    return out


def test_leaf_size_mismatch_in_one_repeated_level(big, tmp_path, monkeypatch):
    bad = _rewrite_meta(big, tmp_path / "s.tdz", "g4/", b"1074", b"1075")  # x2 of g4 only
    out = _same(bad, monkeypatch)
    assert out[0] == "BadArchiveError" and "g4/x2.memmap" in out[1]


def test_size_mismatch_and_crc_error_crc_first(big, tmp_path, monkeypatch):
    bad = _rewrite_meta(big, tmp_path / "s.tdz", "g4/", b"1074", b"1075")
    r = _entry(bad, "g1/x0.memmap")
    both = _patch(bad, tmp_path / "sc.tdz", r.payload_offset, b"\x00\x01")
    out = _same(both, monkeypatch)
    assert out[0] == "ChecksumError" and "g1/x0.memmap" in out[1]


def test_two_bad_levels_first_in_walk_order(big, tmp_path, monkeypatch):
    one = _rewrite_meta(big, tmp_path / "1.tdz", "g1/", b"1037", b"1038")
    two = _rewrite_meta(one, tmp_path / "2.tdz", "g5/", b"torch.float32", b"torch.floatXX")
    out = _same(two, monkeypatch)  # the walk pops g5 first: its dtype is named
    assert out[0] != "ok" and "g5/" in out[1]


def test_compressed_and_unaligned_leaves_pass(tmp_path, monkeypatch):
    tree = {"a": {"b": torch.arange(5000.0), "c": torch.ones(3)}, "d": torch.zeros(7, dtype=torch.float64)}
    p = tdz_numba.save(tree, tmp_path / "z.tdz", compression="deflate")
    out = _same(p, monkeypatch)
    assert out[0] == "ok" and out[3] == 3
    import zipfile

    q = tmp_path / "plain.tdz"  # a foreign zip: payloads unaligned
    with zipfile.ZipFile(p) as src, zipfile.ZipFile(q, "w") as dst:
        for info in src.infolist():
            dst.writestr(info.filename, src.read(info.filename))
    assert _same(q, monkeypatch)[0] == "ok"


def test_missing_leaf_entry_and_missing_sub_level(big, tmp_path, monkeypatch):
    r = _entry(big, "g2/x1.memmap")  # a renamed entry: the level names an absent file
    for where in (r.header_offset + 30, r.central_offset + 46):
        name = big.read_bytes()[where : where + len("g2/x1")]
        assert name == b"g2/x1"
    renamed = _patch(big, tmp_path / "r1.tdz", r.header_offset + 30, b"g2/y1")
    renamed = _patch(renamed, tmp_path / "r2.tdz", r.central_offset + 46, b"g2/y1")
    assert _same(renamed, monkeypatch)[0] == "BadArchiveError"
    m = _entry(big, "g3/meta.json")
    gone = _patch(big, tmp_path / "m1.tdz", m.header_offset + 30, b"g3/zeta")
    gone = _patch(gone, tmp_path / "m2.tdz", m.central_offset + 46, b"g3/zeta")
    assert _same(gone, monkeypatch)[0] != "ok"


def test_mutated_archives_same_outcome(tmp_path, monkeypatch):
    """Mutated archives of the fuzz harness: the parallel and the sequential checks agree."""
    from fuzz.runner import make_cases, prepare_seeds

    seeds, _ = prepare_seeds(tmp_path / "seeds")
    seeds = [s for s in seeds if s.name not in ("deep_levels", "long_name")]
    differ = []
    for case in make_cases(seeds, "verify-parallel", 0, int(os.environ.get("TDZ_VERIFY_CASES", "300"))):
        p = tmp_path / "case.tdz"
        p.write_bytes(case.data)
        seq = _outcome(p, False, monkeypatch)
        par = _outcome(p, True, monkeypatch)
        if seq != par:
            differ.append((case.id, case.seed, case.how, seq, par))
    assert not differ, differ[:3]


def test_errors_keep_their_types(big, tmp_path):
    r = _entry(big, "g0/x0.memmap")
    bad = _patch(big, tmp_path / "c.tdz", r.payload_offset, b"\xff")
    with pytest.raises(ChecksumError):
        tdz_numba.verify(bad)
    with pytest.raises(BadArchiveError):
        tdz_numba.verify(_patch(big, tmp_path / "h.tdz", r.header_offset, b"XX"))


@pytest.mark.parametrize("name", ["large.memmap", "g2/meta.json", "g0/x4.memmap"])
def test_crc_pass_names_the_entries_whose_header_failed(big, tmp_path, name):
    r = _entry(big, name)
    bad = _patch(big, tmp_path / "f.tdz", r.header_offset, b"PK\x00\x00")
    index = ArchiveIndex(bad)
    try:
        crc = verify_pass.CrcPass(index, helpers=1)
        crc.join()
        assert crc.failed_rows() == [index.row(name)]
    finally:
        index.close()


def test_cancel_stops_the_helpers(big, monkeypatch):
    monkeypatch.setattr(verify_pass, "ITEM_BYTES", 4096)
    index = ArchiveIndex(big)
    try:
        crc = verify_pass.CrcPass(index, helpers=2)
        crc.cancel()
        assert not any(t.is_alive() for t in crc._threads)
        crc.join()  # a no-op after cancel
        alone = verify_pass.CrcPass(index, helpers=0)
        args = alone._args
        alone.cancel()  # no item is left to take: a worker called now does nothing
        assert vk.crc_worker(*args) == 0 and not alone.crcs_raw.any() and not alone.failed.any()
    finally:
        index.close()


def test_interrupted_walk_cancels_the_pass(big, monkeypatch):
    started = []
    real = verify_pass.CrcPass

    def spy(*args, **kwargs):
        kwargs["helpers"] = 2  # helpers whatever the thread count (with none, nothing is to cancel)
        started.append(real(*args, **kwargs))
        return started[-1]

    def interrupted(source):
        raise KeyboardInterrupt

    monkeypatch.setattr(verify_pass, "MIN_HELPER_BYTES", 0)
    monkeypatch.setattr(verify_pass, "ITEM_BYTES", 4096)  # items enough for two helpers
    monkeypatch.setattr(verify_pass, "CrcPass", spy)
    monkeypatch.setattr(verify_pass, "walk_levels", interrupted)
    with pytest.raises(KeyboardInterrupt):
        tdz_numba.verify(big)
    assert started and started[0].helpers == 2 and started[0]._joined  # cancelled, helpers joined
    assert not any(t.is_alive() for t in started[0]._threads)
