"""First use without compiling: the kernels' pure-Python twins (tdz_numba.zipfmt.kernels.twins) against the
kernels, both paths end to end, and the choice between them (tdz_numba.zipfmt.kernels.dispatch).

tests/conftest.py sets ``TDZ_NUMBA_KERNELS=always`` for the suite; the tests here pick the path
themselves with ``policy.forced``.
"""

from __future__ import annotations

import gzip
import json
import os
import subprocess
import sys
import zlib
from pathlib import Path

import naive
import numpy as np
import pytest
import torch

import tdz_numba
from tdz_numba.errors import InvalidArgumentError, TdzError
from tdz_numba.jit import policy
from tdz_numba.zipfmt import eocd, packers, records
from tdz_numba.zipfmt.kernels import central, central_twin
from tdz_numba.zipfmt.kernels import crc as kernels
from tdz_numba.zipfmt.kernels import dispatch as kernel_dispatch
from tdz_numba.zipfmt.kernels import twins as pykernels
from tdz_numba.zipfmt.records import Col, Status

ROOT = Path(__file__).resolve().parents[1]
HOSTILE = ROOT / "tests" / "fixtures" / "hostile"
EDGE = [0, 1, 7, 8, 63, 64, 65, 4095, 4096, 4097, (1 << 20) - 1, 1 << 20, (1 << 20) + 1, 3 << 20]


# ---------------------------------------------------------------------------
# CRC twins
# ---------------------------------------------------------------------------
def _spans(sizes, seed=0):
    rng = np.random.default_rng(seed)
    arrays = [rng.integers(0, 256, n, dtype=np.uint8) for n in sizes]
    addrs = np.array([a.ctypes.data for a in arrays], np.int64)
    return arrays, addrs, np.array(sizes, np.int64)


@pytest.mark.parametrize("chunk", [1 << 20, 4096])
def test_crc32_spans_twin_equals_kernel_and_zlib(chunk, monkeypatch):
    arrays, addrs, lengths = _spans(EDGE)
    want = kernels.crc32_spans(addrs, lengths, chunk)
    got = pykernels.crc32_spans(addrs, lengths, chunk)
    assert got.dtype == np.uint32 and np.array_equal(got, want)
    assert got.tolist() == [zlib.crc32(a.tobytes()) for a in arrays]
    monkeypatch.setattr(pykernels, "POOL_BYTES", 1)  # the thread pool and its combines
    for threads in (2, 3, None):
        assert np.array_equal(pykernels.crc32_spans(addrs, lengths, chunk, threads), want)
    assert pykernels.crc32_spans(np.zeros(0, np.int64), np.zeros(0, np.int64), chunk).size == 0


def test_crc32_zeros_and_combine_twins():
    for n in [0, 1, 2, 3, 100, 4096, 1 << 20, (1 << 33) + 5, (1 << 62) + 1]:
        assert pykernels.crc32_zeros(n) == int(kernels.crc32_zeros(n)), n
        if n < 1 << 21:
            assert pykernels.crc32_zeros(n) == naive.crc32_zeros(n) == zlib.crc32(bytes(n))
    rng = np.random.default_rng(1)
    for _ in range(50):
        a, b = rng.integers(0, 2**32, 2).tolist()
        n = int(rng.integers(0, 1 << 40))
        assert pykernels.crc32_combine(a, b, n) == int(kernels.crc32_combine(a, b, n))
    assert pykernels.crc32_combine(5, 7, 0) == int(kernels.crc32_combine(5, 7, 0)) == 5


# ---------------------------------------------------------------------------
# Layout twin
# ---------------------------------------------------------------------------
@pytest.mark.parametrize("seed", range(6))
def test_plan_layout_twin_equals_kernel(seed):
    rng = np.random.default_rng(seed)
    n = int(rng.integers(0, 300))
    header_len = rng.integers(30, 400, n).astype(np.int64)
    data_size = rng.choice(np.array(EDGE + [10**10], np.int64), n)
    choices = [0, 1] if seed == 0 else [0, 1, 64, 4096, 65536, 1 << 20]
    align = rng.choice(np.array(choices, np.int64), n)
    room = rng.choice(np.array([0, 10, 4000, 65535 - 100], np.int64), n)
    want = kernels.plan_layout(header_len, data_size, align, room)
    got = pykernels.plan_layout(header_len, data_size, align, room)
    for w, g in zip(want[:3], got[:3]):
        assert g.dtype == np.int64 and np.array_equal(w, g)
    assert int(want[3]) == got[3]


def test_plan_twin_matches_naive_oracle():
    from tdz_numba.zipfmt import layout

    names = [f"k{i}.memmap" for i in range(40)]
    sizes = [EDGE[i % len(EDGE)] for i in range(40)]
    align = [64 if i % 3 else 4096 for i in range(40)]
    with policy.forced("never"):
        plan = layout.plan(names, sizes, align, [records.STORED] * 40)
    with policy.forced("always"):
        ref = layout.plan(names, sizes, align, [records.STORED] * 40)
    assert np.array_equal(plan.payload_offset, ref.payload_offset)
    assert np.array_equal(plan.pad, ref.pad) and plan.file_size == ref.file_size
    rows, end = naive.naive_plan([len(n) for n in names], sizes, align)
    assert rows == list(zip(plan.header_offset.tolist(), plan.pad.tolist(), plan.payload_offset.tolist()))
    assert end == plan.cd_offset


# ---------------------------------------------------------------------------
# Index twins: byte for byte the same decision on every input
# ---------------------------------------------------------------------------
def _both_parse(buf, cd_offset, cd_size, count):
    from test_index import eager_index

    for check_local in (False, True):
        kc, ks = eager_index(buf, cd_offset, cd_size, count, check_local)
        pc, ps = eager_index(buf, cd_offset, cd_size, count, check_local, twin=True)
        assert ps.tolist() == ks.tolist(), (check_local, cd_offset, cd_size, count)
        assert pc.shape == kc.shape and np.array_equal(pc, kc), (check_local, ks.tolist())
    if eocd.central_directory_fits(buf.size, cd_offset, cd_size, count):  # the whole answer, names included
        cd = buf[cd_offset : cd_offset + cd_size]
        with policy.forced("always"):
            fast = kernel_dispatch.parse_central(cd, cd_offset, count)
        slow = central_twin.parse_central(cd, cd_offset, count)
        assert fast.rows.array().tolist() == slow.rows.array().tolist()
        assert (fast.names, fast.status, fast.encrypted, fast.unknown_method) == (
            slow.names,
            slow.status,
            slow.encrypted,
            slow.unknown_method,
        )
    kc, ks = eager_index(buf, cd_offset, cd_size, count, False)
    if ks[0] == 0 or (ks[0] == Status.COUNT and ks[1] == len(kc)):
        _gathered_equals_eager(buf, kc, ks, cd_offset, cd_size, count)
    if ks[0] == 0:
        pc = kc.copy()
        for i in range(len(kc)):
            want = central.resolve_local(buf, kc, i, cd_offset)
            got = central_twin.resolve_local(buf, pc, i, cd_offset)
            assert got.tolist() == want.tolist() and np.array_equal(pc, kc), i
    return ks


def _gathered_equals_eager(buf, cols, lazy_status, cd_offset, cd_size, count):
    """The local headers checked from copies (as the reader's pread path reads them) decide
    exactly as the eager parse does: same status, same columns; kernel and twin alike."""
    from test_index import eager_index

    eager_cols, eager_status = eager_index(buf, cd_offset, cd_size, count, True)
    lengths = cols[:, Col.NAME_LEN] + 30
    hpos = np.zeros(len(cols), np.int64)
    hpos[1:] = np.cumsum(lengths)[:-1]
    hdr = np.zeros(int(lengths.sum()), np.uint8)
    for h, p, n in zip(cols[:, Col.HEADER_OFFSET].tolist(), hpos.tolist(), lengths.tolist()):
        piece = buf[h : h + n]  # short past the end: the rest stays zero, as after a short pread
        hdr[p : p + len(piece)] = piece
    for impl in (central, central_twin):
        c = cols.copy()
        status = impl.check_local_headers(buf, c, cd_offset, hdr, hpos)
        if status[0] == 0:
            status = lazy_status
        assert status.tolist() == eager_status.tolist(), impl.__name__
        assert np.array_equal(c, eager_cols), impl.__name__


def _end(buf):
    try:
        end = eocd.find_end_record(buf, "x")
    except TdzError:
        return None
    return end.cd_offset, end.cd_size, end.count


def _saved(tmp_path, tree, **kw) -> np.ndarray:
    path = tdz_numba.save(tree, tmp_path / "x.tdz", durable=False, **kw)
    return np.frombuffer(path.read_bytes(), np.uint8)


def test_index_twin_on_valid_archives(tmp_path):
    tree = {
        "a": torch.arange(10.0),
        "b": {"c": torch.ones(3, 4, dtype=torch.float64), "é": torch.zeros(0)},
        "tag": "txt",
    }
    for kw in ({}, {"compression": "deflate"}, {"align": 4096}):
        buf = _saved(tmp_path, tree, **kw)
        assert _both_parse(buf, *_end(buf))[0] == 0
    buf = np.frombuffer(naive.naive_archive(["x", "y"], [b"12345", b""], [64, 0]), np.uint8)
    assert _both_parse(buf, *_end(buf))[0] == 0


def test_index_twin_on_wrong_end_values(tmp_path):
    buf = _saved(tmp_path, {"a": torch.arange(4), "b": torch.ones(2)})
    cd, size, count = _end(buf)
    for args in [
        (cd, size, count + 1),
        (cd, size, max(count - 1, 0)),
        (cd, size, 0),
        (cd + 1, size - 1, count),
        (cd - 1, size, count),
        (-1, size, count),
        (cd, -5, count),
        (cd, size, -1),
        (cd, 1 << 62, count),
        (buf.size, 0, 0),
        (0, cd + size, count),
    ]:
        _both_parse(buf, *args)


def test_index_twin_on_mutated_archives(tmp_path):
    tree = {f"k{i}": torch.arange(i + 1, dtype=torch.int32) for i in range(6)}
    base = _saved(tmp_path, tree, align=64)
    cd, size, count = _end(base)
    rng = np.random.default_rng(7)
    codes = set()
    for trial in range(600):
        buf = base.copy()
        for _ in range(int(rng.integers(1, 4))):
            pos = int(rng.integers(0, buf.size)) if trial % 2 else int(rng.integers(cd, cd + size))
            buf[pos] = rng.integers(0, 256) if trial % 3 else rng.choice([0, 0xFF])
        if trial % 5 == 0:  # 0xFFFFFFFF size / offset fields: the zip64 extra search
            buf[cd + int(rng.choice([20, 24, 42])) :][:4] = 0xFF
        codes.add(int(_both_parse(buf, cd, size, count)[0]))
    assert len(codes) >= 4, codes  # the mutations reach several refusal sites


def test_index_twin_on_zip64_extras():
    # a central record whose sizes and offset sit in a zip64 extra (what large archives have)
    name = b"big"
    local = records.LOCAL_SIG.to_bytes(4, "little") + bytes(22) + len(name).to_bytes(2, "little") + bytes(2)
    local += name + b"data"
    for fields, extra in [
        ((4, 4, 0), b""),
        (
            (0xFFFFFFFF, 0xFFFFFFFF, 0xFFFFFFFF),
            (1).to_bytes(2, "little")
            + (24).to_bytes(2, "little")
            + (4).to_bytes(8, "little") * 2
            + (0).to_bytes(8, "little"),
        ),
        (
            (0xFFFFFFFF, 4, 0),
            (1).to_bytes(2, "little") + (8).to_bytes(2, "little") + (1 << 63).to_bytes(8, "little"),
        ),
        ((0xFFFFFFFF, 4, 0), (9).to_bytes(2, "little") + (0).to_bytes(2, "little")),
        ((0xFFFFFFFF, 4, 0), (1).to_bytes(2, "little") + (4).to_bytes(2, "little") + bytes(4)),
        (
            (4, 0xFFFFFFFF, 0),
            (7).to_bytes(2, "little")
            + (2).to_bytes(2, "little")
            + bytes(2)
            + (1).to_bytes(2, "little")
            + (8).to_bytes(2, "little")
            + (4).to_bytes(8, "little"),
        ),
    ]:
        usize, csize, hoff = fields
        central = bytearray(46)
        central[0:4] = records.CENTRAL_SIG.to_bytes(4, "little")
        central[20:24] = csize.to_bytes(4, "little")
        central[24:28] = usize.to_bytes(4, "little")
        central[28:30] = len(name).to_bytes(2, "little")
        central[30:32] = len(extra).to_bytes(2, "little")
        central[42:46] = hoff.to_bytes(4, "little")
        cdir = bytes(central) + name + extra
        buf = np.frombuffer(local + cdir, np.uint8)
        _both_parse(buf, len(local), len(cdir), 1)


def _hostile():
    if not (HOSTILE / "index.json").exists():
        return []
    return sorted(f["file"] for f in json.loads((HOSTILE / "index.json").read_text()))


def test_index_twin_on_hostile_fixtures():
    files = _hostile()
    assert files
    seen = 0
    for name in files:
        buf = np.frombuffer(gzip.decompress((HOSTILE / name).read_bytes()), np.uint8)
        end = _end(buf)
        if end is not None:
            _both_parse(buf, *end)
            seen += 1
    assert seen > 20


def _outcome(fn):
    try:
        out = fn()
    except TdzError as exc:
        return type(exc).__name__, str(exc)
    except Exception as exc:  # noqa: BLE001 - compared between the paths, whatever it is
        return "other " + type(exc).__name__, str(exc)
    return "ok", repr(out)


def test_hostile_fixtures_same_decision_on_both_paths(tmp_path):
    for name in _hostile()[:80]:
        path = tmp_path / name.replace(".bin.gz", ".tdz")
        path.write_bytes(gzip.decompress((HOSTILE / name).read_bytes()))
        results = []
        for m in ("always", "never"):
            with policy.forced(m):
                results.append(
                    (
                        _outcome(lambda p=path: tdz_numba.verify(p)),
                        _outcome(lambda p=path: sorted(tdz_numba.load(p))),
                    )
                )
        assert results[0] == results[1], name


# ---------------------------------------------------------------------------
# End to end on each path
# ---------------------------------------------------------------------------
@pytest.mark.parametrize("kw", [{}, {"align": 4096}, {"compression": "deflate"}])
def test_save_load_verify_identical_on_both_paths(tmp_path, monkeypatch, small_tree, kw):
    monkeypatch.setattr(packers, "dos_datetime", lambda *a: (0, 33))
    tree = {**small_tree, "zeros": torch.zeros(1000), "big": torch.arange(300_000, dtype=torch.float32)}
    files = {}
    for m in ("always", "never"):
        with policy.forced(m):
            p = tdz_numba.save(tree, tmp_path / f"{m}.tdz", durable=False, **kw)
            files[m] = p.read_bytes()
            back = tdz_numba.load(p)
            assert torch.equal(back["big"], tree["big"]) and back["tag"] == "hello"
            with tdz_numba.open(p) as ar:
                assert torch.equal(ar["nested/deep/c"], tree["nested"]["deep"]["c"])
            assert tdz_numba.verify(p).leaves == 6
    assert files["always"] == files["never"]


def test_allocate_zero_crcs_on_both_paths(tmp_path):
    for m in ("always", "never"):
        with policy.forced(m):
            p = tmp_path / f"{m}.tdz"
            with tdz_numba.allocate({"z": torch.zeros(5000, 3)}, p):
                pass
            assert tdz_numba.verify(p).entries >= 2


def test_crc_mismatch_reported_on_both_paths(tmp_path):
    p = tdz_numba.save({"a": torch.arange(100)}, tmp_path / "x.tdz", durable=False)
    raw = bytearray(p.read_bytes())
    raw[raw.index(torch.arange(100).numpy().tobytes()) + 9] ^= 1
    p.write_bytes(bytes(raw))
    msgs = []
    for m in ("always", "never"):
        with policy.forced(m), pytest.raises(tdz_numba.ChecksumError) as info:
            tdz_numba.verify(p)
        msgs.append(str(info.value))
    assert msgs[0] == msgs[1]


# ---------------------------------------------------------------------------
# The choice
# ---------------------------------------------------------------------------
def test_mode_from_environment(monkeypatch):
    monkeypatch.setenv("TDZ_NUMBA_KERNELS", "never")
    assert policy.mode() == "never" and not policy.use_kernels(10**9)
    monkeypatch.setenv("TDZ_NUMBA_KERNELS", "ALWAYS")
    assert policy.use_kernels(0)
    monkeypatch.setenv("TDZ_NUMBA_KERNELS", "sometimes")
    with pytest.raises(InvalidArgumentError, match="TDZ_NUMBA_KERNELS"):
        policy.mode()
    with pytest.raises(ValueError):
        policy.forced("x").__enter__()


def test_forced_blocks_that_overlap_in_threads_restore_the_mode(monkeypatch):
    # two warm-ups in two threads: their forced() blocks overlap and end in either order;
    # once both ended the environment decides again (it was stuck on the first block's mode)
    import threading

    monkeypatch.setenv("TDZ_NUMBA_KERNELS", "never")
    a_in, b_in, a_out = threading.Event(), threading.Event(), threading.Event()

    def first():
        with policy.forced("always"):
            a_in.set()
            b_in.wait(5)
        a_out.set()

    def second():
        a_in.wait(5)
        with policy.forced("auto"):
            b_in.set()
            a_out.wait(5)
            assert policy.mode() == "auto"  # the innermost block still open

    threads = [threading.Thread(target=first), threading.Thread(target=second)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(10)
    assert policy.mode() == "never" and not policy.use_kernels(10**9)


def _cold(monkeypatch) -> None:
    for key, value in (("warm", False), ("checked", -1e9), ("twin", 0)):
        monkeypatch.setitem(policy._state, key, value)


def test_auto_follows_marker_and_sizes(tmp_path, monkeypatch):
    monkeypatch.setenv("NUMBA_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.setenv("TDZ_NUMBA_KERNELS", "auto")
    monkeypatch.setitem(policy._state, "spawned", True)  # no background run from a test
    _cold(monkeypatch)
    assert not policy.kernels_warm()
    assert not policy.use_kernels(10)
    assert policy.use_kernels(policy.COLD_ENTRIES)
    cache = policy.kernel_cache_dirs()[0]
    os.makedirs(cache)
    index = os.path.join(cache, "kernels.x.nbi")
    Path(index).write_bytes(b"")
    assert not policy.kernels_warm()  # a cold answer is kept for 2 s
    marker = policy.write_marker(cache, [index])
    assert marker and Path(marker).exists()
    _cold(monkeypatch)
    assert policy.kernels_warm()
    # warm, Numba not imported: the twins until the process gave them WARM_ENTRIES entries
    monkeypatch.delitem(sys.modules, "numba", raising=False)
    assert not policy.use_kernels(policy.WARM_ENTRIES // 2)
    assert not policy.use_kernels(policy.WARM_ENTRIES // 2 - 1)
    assert policy.use_kernels(1)
    monkeypatch.setitem(sys.modules, "numba", object())
    _cold(monkeypatch)
    assert policy.use_kernels(0)  # warm and Numba imported: the kernels
    os.unlink(index)  # a cache emptied behind the marker's back: not warm
    _cold(monkeypatch)
    assert not policy.kernels_warm()
    Path(cache, "tdz_numba-warm-old.json").write_text("{}")
    Path(index).write_bytes(b"")
    policy.write_marker(cache, [index])  # removes markers of other keys
    assert sorted(os.listdir(cache)) == sorted(["kernels.x.nbi", os.path.basename(marker)])
    assert policy.write_marker(str(tmp_path / "missing" / "dir"), []) is None


def test_background_warmup_switches(monkeypatch, tmp_path):
    assert not policy.background_enabled()  # under pytest
    monkeypatch.setenv("TDZ_NUMBA_BACKGROUND_WARMUP", "1")
    monkeypatch.setenv("TDZ_NUMBA_KERNELS", "auto")
    assert policy.background_enabled()
    monkeypatch.setenv("TDZ_NUMBA_KERNELS", "never")
    assert not policy.background_enabled()
    monkeypatch.setenv("TDZ_NUMBA_KERNELS", "auto")
    monkeypatch.setenv("TDZ_NUMBA_BACKGROUND_WARMUP", "0")
    assert not policy.background_enabled()
    # started once per process, with the lock of a running warm-up respected
    monkeypatch.setenv("TDZ_NUMBA_BACKGROUND_WARMUP", "1")
    monkeypatch.setenv("NUMBA_CACHE_DIR", str(tmp_path / "cache"))
    started = []

    class FakePopen:
        def __init__(self, args, **kw):
            started.append((args, kw))

        def wait(self):
            return 0

    monkeypatch.setattr(policy.subprocess, "Popen", FakePopen)
    monkeypatch.setitem(policy._state, "spawned", False)
    assert policy.start_background_warmup()
    assert not policy.start_background_warmup()
    assert started[0][0][1:] == ["-m", "tdz_numba.cli.warmup", "--background"]
    assert started[0][1]["start_new_session"] and started[0][1]["stdout"] == subprocess.DEVNULL
    lock = Path(policy.kernel_cache_dirs()[0], policy.LOCK_NAME)
    lock.parent.mkdir(parents=True)
    lock.write_bytes(b"")
    monkeypatch.setitem(policy._state, "spawned", False)
    assert not policy.start_background_warmup()
    blocker = tmp_path / "file"
    blocker.write_bytes(b"")
    monkeypatch.setenv("NUMBA_CACHE_DIR", str(blocker / "cache"))  # under a file: not writable
    monkeypatch.setitem(policy._state, "spawned", False)
    assert not policy.start_background_warmup()
    assert len(started) == 1


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="the user-wide cache path is Linux's")
def test_background_warmup_goes_where_numba_caches(monkeypatch, tmp_path):
    # a read-only package directory (a system-wide install): Numba caches in the user-wide
    # directory instead, so the background warm-up and its lock go there too
    import fcntl
    import types

    from tdz_numba.cli import warmup as precompile

    monkeypatch.delenv("NUMBA_CACHE_DIR", raising=False)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    monkeypatch.setenv("TDZ_NUMBA_BACKGROUND_WARMUP", "1")
    monkeypatch.setenv("TDZ_NUMBA_KERNELS", "auto")
    in_tree, user_wide = policy.kernel_cache_dirs()
    assert user_wide.startswith(str(tmp_path))
    real = policy._writable_dir
    monkeypatch.setattr(policy, "_writable_dir", lambda p: p != in_tree and real(p))
    started = []
    fake = types.SimpleNamespace(wait=lambda: 0)
    monkeypatch.setattr(policy.subprocess, "Popen", lambda args, **kw: started.append(args) or fake)
    monkeypatch.setitem(policy._state, "spawned", False)
    assert policy.start_background_warmup() and len(started) == 1
    lock = Path(user_wide, policy.LOCK_NAME)
    lock.parent.mkdir(parents=True)
    lock.write_bytes(b"")  # a warm-up runs there: no second one
    monkeypatch.setitem(policy._state, "spawned", False)
    assert not policy.start_background_warmup() and len(started) == 1
    # the background run itself takes the lock in that directory
    ran = []
    monkeypatch.setattr(policy, "kernels_warm", lambda: False)
    monkeypatch.setattr(precompile, "warmup", lambda **kw: ran.append(kw))
    monkeypatch.setattr(os, "nice", lambda n: 0)
    with open(lock, "wb") as held:
        fcntl.flock(held, fcntl.LOCK_EX)
        assert precompile.background_main() == 0 and ran == []  # held: nothing run
    assert precompile.background_main() == 0 and ran == [{"verbose": False}]
    assert not lock.exists() and not Path(in_tree, policy.LOCK_NAME).exists()


def _fresh(code: str, cache: Path, **env: str) -> subprocess.CompletedProcess:
    full = dict(os.environ, NUMBA_CACHE_DIR=str(cache), PYTHONPATH=str(ROOT), TDZ_NUMBA_KERNELS="auto")
    full.update(env)
    return subprocess.run([sys.executable, "-c", code], env=full, capture_output=True, text=True, timeout=300)


FIRST = r"""
import sys, torch, tdz_numba
from tdz_numba.jit import policy
assert "numba" not in sys.modules
p = tdz_numba.save({"a": torch.arange(10.0), "b": {"c": torch.ones(3)}}, sys.argv[1] if len(sys.argv) > 1 else "{path}")
assert float(tdz_numba.load(p)["a"].sum()) == 45.0
with tdz_numba.open(p) as ar:
    ar["b/c"]
tdz_numba.verify(p)
print("numba" in sys.modules, policy.kernels_warm())
"""


def test_first_save_and_load_import_no_numba(tmp_path):
    code = FIRST.replace("{path}", str(tmp_path / "x.tdz"))
    out = _fresh(code, tmp_path / "cache", TDZ_NUMBA_BACKGROUND_WARMUP="0")
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["False", "False"]
    assert "compiling Numba kernels" not in out.stderr
    assert not (tmp_path / "cache").exists()  # nothing compiled, nothing started
    bare = _fresh(
        "import sys, tdz_numba, tdz_numba.jit.presets; print('numba' in sys.modules)", tmp_path / "c"
    )
    assert bare.stdout.split() == ["False"], bare.stderr


def test_background_main_quiet_on_unwritable_cache(tmp_path):
    blocker = tmp_path / "file"
    blocker.write_bytes(b"")
    out = subprocess.run(
        [sys.executable, "-m", "tdz_numba.cli.warmup", "--background"],
        env=dict(os.environ, NUMBA_CACHE_DIR=str(blocker / "cache"), PYTHONPATH=str(ROOT)),
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert out.returncode == 0 and out.stdout == out.stderr == ""


def test_cache_key_is_the_same_through_a_symlinked_install(tmp_path, monkeypatch):
    """A venv reached through a symbolic link (a worktree's linked .venv, a conda env under a
    linked prefix) names Numba by another path: the warm marker that `tdz warmup` wrote must
    still be found, else every process runs the Python twins until WARM_ENTRIES."""
    import importlib.util
    import types

    from tdz_numba.jit import policy as _policy

    real_spec = importlib.util.find_spec("numba")
    real_dir = Path(real_spec.origin).parent
    link = tmp_path / "linked-site-packages"
    link.symlink_to(real_dir.parent)
    linked_origin = str(link / real_dir.name / Path(real_spec.origin).name)
    assert linked_origin != real_spec.origin and Path(linked_origin).exists()

    def key_with(origin: str) -> str:
        monkeypatch.setitem(_policy._state, "key", None)
        fake = types.SimpleNamespace(origin=origin)
        monkeypatch.setattr(
            importlib.util, "find_spec", lambda name, *a: fake if name == "numba" else real_find(name, *a)
        )
        try:
            return _policy.cache_key()
        finally:
            monkeypatch.setattr(importlib.util, "find_spec", real_find)

    real_find = importlib.util.find_spec
    assert key_with(linked_origin) == key_with(real_spec.origin)
    other = tmp_path / "other_numba.py"
    other.write_text("# another numba\n")
    assert key_with(str(other)) != key_with(real_spec.origin)  # the key still follows the install
