"""Archives that grow (issue 24): append, replace, compact, repair, and the crash states of an
append (kills at fixed steps and at random instants)."""

from __future__ import annotations

import os
import random
import re
import shutil
import signal
import subprocess
import time
import zipfile
from pathlib import Path

import numpy as np
import pytest
import torch

import tdz_numba
from tdz_numba.zipfmt import grow

try:
    from tensordict import TensorDict
except ImportError:  # pragma: no cover - tensordict is optional
    TensorDict = None

needs_td = pytest.mark.skipif(TensorDict is None, reason="tensordict is not installed")


def _flat(tree, prefix=""):
    """{key path: tensor or value} of a loaded tree."""
    out = {}
    for k, v in tree.items():
        if isinstance(v, dict):
            out.update(_flat(v, prefix + k + "/"))
        else:
            out[prefix + k] = v
    return out


def _same(a, b) -> bool:
    fa, fb = _flat(a), _flat(b)
    if fa.keys() != fb.keys():
        return False
    for k, v in fa.items():
        w = fb[k]
        if isinstance(v, torch.Tensor):
            if not (isinstance(w, torch.Tensor) and v.dtype == w.dtype and v.shape == w.shape):
                return False
            if not np.array_equal(_bytes(v), _bytes(w)):  # (bits; torch.equal: ~15 ms a call here)
                return False
        elif v != w:
            return False
    return True


def _bytes(t: torch.Tensor) -> np.ndarray:
    return t.contiguous().reshape(-1).view(torch.uint8).numpy()


def _check_zip_tools(p: Path) -> None:
    with zipfile.ZipFile(p) as z:
        assert z.testzip() is None
        names = z.namelist()
    assert len(names) == len(set(names))
    if shutil.which("unzip"):
        r = subprocess.run(["unzip", "-t", str(p)], capture_output=True, text=True)
        assert r.returncode == 0, r.stdout + r.stderr
        assert "No errors detected" in r.stdout


def _td_equal(p: Path, expected: dict) -> None:
    if TensorDict is None:
        return
    td = TensorDict.load_memmap(p)
    for k, v in _flat(expected).items():
        got = td[tuple(k.split("/"))]
        if isinstance(v, torch.Tensor):
            assert got.dtype == v.dtype and torch.equal(got, v), k
        else:
            assert got == v, k


BASE = {"a": torch.arange(10.0), "s": {"b": torch.ones(3, dtype=torch.int16)}, "name": "run1"}


@pytest.mark.parametrize("compression", [None, "deflate"])
@pytest.mark.parametrize("align", [None, "auto"])
def test_append_root_and_nested(tmp_path, compression, align):
    p = tdz_numba.save(BASE, tmp_path / "x.tdz")
    old = p.read_bytes()
    add = {
        "c": torch.arange(300_000, dtype=torch.int32),  # > 1 MiB: page-aligned with "auto"
        "s": {"d": torch.full((2, 2), 7.0), "deep": {"e": torch.tensor([1, 2], dtype=torch.uint8)}},
        "step": 3,
        "tags": ["x", "y"],
    }
    assert tdz_numba.append(p, add, compression=compression, align=align) == p.resolve()
    data = p.read_bytes()
    assert data[: len(old)] == old  # no byte of the old file rewritten
    expected = {**BASE, **add, "s": {**BASE["s"], **add["s"]}}
    assert _same(tdz_numba.load(p), expected)
    _check_zip_tools(p)
    _td_equal(p, expected)
    tdz_numba.verify(p)
    with zipfile.ZipFile(p) as z:
        info = z.getinfo("c.memmap")
        assert info.compress_type == (zipfile.ZIP_DEFLATED if compression else zipfile.ZIP_STORED)
        if compression is None:
            off = info.header_offset + 30 + len(info.filename) + len(_local_extra(data, info))
            assert off % (65536 if align == "auto" else 64) == 0
        # the merged meta.json files list the old keys first, then the new ones
        import json

        assert list(json.loads(z.read("meta.json")))[:5] == ["a", "s", "name", "c", "step"]
        assert list(json.loads(z.read("s/meta.json")))[:3] == ["b", "d", "deep"]


def _local_extra(data: bytes, info: zipfile.ZipInfo) -> bytes:
    h = info.header_offset
    n, m = int.from_bytes(data[h + 26 : h + 28], "little"), int.from_bytes(data[h + 28 : h + 30], "little")
    return data[h + 30 + n : h + 30 + n + m]


def test_append_under_subpath_creates_levels(tmp_path):
    p = tdz_numba.save(BASE, tmp_path / "x.tdz")
    tdz_numba.append(p, {"w": torch.ones(4)}, subpath="ep/0")
    tdz_numba.append(p, {"w": torch.zeros(4)}, subpath=("ep", "1"))
    tdz_numba.append(p, {"v": torch.ones(1)}, subpath="s")
    got = tdz_numba.load(p)
    assert torch.equal(got["ep"]["0"]["w"], torch.ones(4)) and torch.equal(
        got["ep"]["1"]["w"], torch.zeros(4)
    )
    assert sorted(got["s"].keys()) == ["b", "v"]
    _check_zip_tools(p)
    _td_equal(p, {"ep": {"0": {"w": torch.ones(4)}, "1": {"w": torch.zeros(4)}}, "s": {"v": torch.ones(1)}})


def test_existing_key_refused_unless_replace(tmp_path):
    p = tdz_numba.save(BASE, tmp_path / "x.tdz")
    before = p.read_bytes()
    with pytest.raises(tdz_numba.ArchiveExistsError, match="key 's/b' already exists") as info:
        tdz_numba.append(p, {"s": {"b": torch.zeros(3)}, "new": torch.ones(1)})
    assert isinstance(info.value, FileExistsError) and info.value.entry == "s/b"
    with pytest.raises(tdz_numba.ArchiveExistsError, match="'name'"):
        tdz_numba.append(p, {"name": "other"})
    assert p.read_bytes() == before  # a refused append writes nothing


def test_replace_changes_shape_dtype_and_kind(tmp_path):
    p = tdz_numba.save(BASE, tmp_path / "x.tdz")
    ar = tdz_numba.open(p)  # opened before: keeps the old state
    old_a = ar["a"].clone()
    new = {
        "a": torch.arange(6, dtype=torch.int64).reshape(2, 3),  # shape and dtype
        "s": {"b": {"inner": torch.ones(2)}},  # a leaf becomes a level
        "name": torch.tensor([5]),  # a non-tensor becomes a leaf
    }
    tdz_numba.append(p, new, replace=True)
    got = tdz_numba.load(p)
    assert _same(got, new)
    with zipfile.ZipFile(p) as z:
        names = z.namelist()
    assert "s/b.memmap" not in names and "name/meta.json" not in names and names.count("meta.json") == 1
    _check_zip_tools(p)
    _td_equal(p, new)
    assert torch.equal(ar["a"], old_a) and ar["s"]["b"].dtype == torch.int16  # the old mapping
    ar.close()
    # and back: a level becomes a leaf
    tdz_numba.append(p, {"s": torch.zeros(2)}, replace=True)
    assert torch.equal(tdz_numba.load(p)["s"], torch.zeros(2))
    _check_zip_tools(p)


def test_batch_size_checked(tmp_path):
    if TensorDict is None:
        pytest.skip("tensordict is not installed")
    p = tmp_path / "b.tdz"
    TensorDict({"x": torch.zeros(4, 2)}, batch_size=[4]).save(p)
    with pytest.raises(tdz_numba.InvalidTreeError, match=r"does not start with the batch size \[4\]"):
        tdz_numba.append(p, {"y": torch.zeros(3)})
    tdz_numba.append(p, {"y": torch.ones(4, 5)})
    tdz_numba.append(p, TensorDict({"z": torch.ones(4)}, batch_size=[4]), subpath="sub")
    td = TensorDict.load_memmap(p)
    assert td.batch_size == torch.Size([4]) and td["y"].shape == (4, 5) and td["sub", "z"].shape == (4,)
    _check_zip_tools(p)


def test_subpath_through_a_non_tensordict_level(tmp_path):
    p = tdz_numba.save(BASE, tmp_path / "x.tdz")
    with pytest.raises(tdz_numba.ArchiveExistsError, match="key 'name' already exists"):
        tdz_numba.append(p, {"x": torch.ones(1)}, subpath="name")
    tdz_numba.append(p, {"x": torch.ones(1)}, subpath="name", replace=True)  # the value becomes a level
    assert torch.equal(tdz_numba.load(p)["name"]["x"], torch.ones(1))
    _check_zip_tools(p)


@needs_td
def test_append_to_tensordict_archive(tmp_path):
    td = TensorDict(
        {"obs": torch.arange(12.0).reshape(3, 4), "nested": {"r": torch.ones(3)}, "label": "hi"},
        batch_size=[3],
    )
    p = tmp_path / "theirs.tdz"
    td.save(p)
    old = p.read_bytes()
    tdz_numba.append(p, {"nested": {"q": torch.zeros(3, 2)}, "act": torch.ones(3, dtype=torch.int8)})
    assert p.read_bytes()[: len(old)] == old
    back = TensorDict.load_memmap(p)
    assert back.batch_size == torch.Size([3])
    assert torch.equal(back["obs"], td["obs"]) and torch.equal(back["nested", "q"], torch.zeros(3, 2))
    assert torch.equal(back["act"], torch.ones(3, dtype=torch.int8)) and back["label"] == "hi"
    _check_zip_tools(p)
    got = tdz_numba.load(p)
    assert sorted(got.keys()) == ["act", "label", "nested", "obs"]


def test_append_to_zip_r_archive(tmp_path):
    if shutil.which("zip") is None:
        pytest.skip("no zip tool")
    src = tdz_numba.save(BASE, tmp_path / "x.tdz")
    d = tdz_numba.unpack(src, tmp_path / "dir")
    p = tmp_path / "zipped.tdz"
    subprocess.run(["zip", "-q", "-0", "-r", str(p), "."], cwd=d, check=True)
    old = p.read_bytes()
    tdz_numba.append(p, {"s": {"z": torch.arange(3)}, "k": torch.ones(2)})
    assert p.read_bytes()[: len(old)] == old
    expected = {**BASE, "k": torch.ones(2), "s": {**BASE["s"], "z": torch.arange(3)}}
    assert _same(tdz_numba.load(p), expected)
    _check_zip_tools(p)
    _td_equal(p, expected)
    with zipfile.ZipFile(p) as z:
        assert "s/" in z.namelist()  # zip's directory entries are kept
    tdz_numba.compact(p)
    with zipfile.ZipFile(p) as z:
        assert "s/" not in z.namelist()
    assert _same(tdz_numba.load(p), expected)


def test_compact_drops_superseded_bytes(tmp_path):
    p = tdz_numba.save({"w": torch.ones(100_000)}, tmp_path / "x.tdz")
    for i in range(3):
        tdz_numba.append(p, {"w": torch.full((100_000,), float(i))}, replace=True)
    grown = p.stat().st_size
    ar = tdz_numba.open(p)
    tdz_numba.compact(p)
    assert p.stat().st_size < grown / 3
    assert torch.equal(tdz_numba.load(p)["w"], torch.full((100_000,), 2.0))
    assert torch.equal(ar["w"], torch.full((100_000,), 2.0))  # the reader of the old file
    _check_zip_tools(p)
    # compact's result is save's archive of the same tree (apart from timestamps)
    q = tdz_numba.save(tdz_numba.load(p), tmp_path / "y.tdz")
    from ziputil import zero_timestamps

    assert zero_timestamps(p.read_bytes()) == zero_timestamps(q.read_bytes())


def test_compact_keeps_deflate(tmp_path):
    p = tdz_numba.save({"w": torch.zeros(10_000)}, tmp_path / "x.tdz", compression="deflate")
    tdz_numba.append(p, {"v": torch.zeros(10_000)}, compression="deflate")
    tdz_numba.compact(p)
    with zipfile.ZipFile(p) as z:
        assert {i.compress_type for i in z.infolist() if i.filename.endswith(".memmap")} == {
            zipfile.ZIP_DEFLATED
        }


def test_failed_append_leaves_the_file(tmp_path, monkeypatch):
    p = tdz_numba.save(BASE, tmp_path / "x.tdz")
    before = p.read_bytes()
    calls = []
    real = grow.write_segments

    def failing(fd, segments):
        calls.append(1)
        if len(calls) == 2:  # after the temporary tail: the central directory's write
            raise OSError(28, "No space left on device")
        return real(fd, segments)

    monkeypatch.setattr(grow, "write_segments", failing)
    with pytest.raises(tdz_numba.DiskFullError):
        tdz_numba.append(p, {"c": torch.ones(5)})
    assert p.read_bytes() == before


def _uncommitted(p: Path) -> bytes:
    """The file as an append killed between its first write and its commit leaves it: the old
    bytes, a hole, and a copy of the old end record at the new end."""
    old = p.read_bytes()
    state = grow.read_state(old, str(p))
    with open(p, "r+b") as f:
        f.seek(len(old) + 100_000)
        f.write(state.temp_tail)
    return old


def test_uncommitted_append_reads_old_state_and_repairs(tmp_path):
    p = tdz_numba.save(BASE, tmp_path / "x.tdz")
    old = _uncommitted(p)
    assert _same(tdz_numba.load(p), BASE)  # our reader: the old content
    with pytest.raises(zipfile.BadZipFile):
        zipfile.ZipFile(p).testzip()
    r = tdz_numba.repair(p)
    assert (r.action, r.size) == ("truncated", len(old)) and p.read_bytes() == old
    assert tdz_numba.repair(p).action == "ok"
    _check_zip_tools(p)


def test_uncommitted_append_then_append(tmp_path):
    p = tdz_numba.save(BASE, tmp_path / "x.tdz")
    _uncommitted(p)
    tdz_numba.append(p, {"c": torch.ones(2)})
    _check_zip_tools(p)
    assert _same(tdz_numba.load(p), {**BASE, "c": torch.ones(2)})


def test_repair_refuses_other_damage(tmp_path):
    p = tdz_numba.save(BASE, tmp_path / "x.tdz")
    data = bytearray(p.read_bytes())
    data[-22:-22] = b"\0" * 50  # an end record whose central directory is followed by zeros
    p.write_bytes(bytes(data))
    with pytest.raises(tdz_numba.BadArchiveError, match="not a file an append left uncommitted"):
        tdz_numba.repair(p)


# ---------------------------------------------------------------------------
# kills
# ---------------------------------------------------------------------------
def _big_tree(seed: int) -> dict:
    g = torch.Generator().manual_seed(seed)
    return {
        f"ep{seed}": {
            f"t{i}": torch.randint(0, 255, (64 << 10,), generator=g, dtype=torch.uint8) for i in range(48)
        }
    }


def _forked_append(p: Path, tree: dict, kill_after: float | None, step_exit: int | None = None) -> float:
    """Appends ``tree`` in a forked child (durable), killed (SIGKILL) ``kill_after`` seconds after
    it starts the append, or exiting (``os._exit``) at its ``step_exit``-th write; returns the
    seconds from the start of the append to the child's end."""
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:  # pragma: no cover - the child
        try:
            os.close(r)
            if step_exit is not None:
                real = grow.write_segments
                count = [0]

                def dying(fd, segments):
                    count[0] += 1
                    if count[0] == step_exit:
                        os._exit(3)
                    return real(fd, segments)

                grow.write_segments = dying
            os.write(w, b"go")
            tdz_numba.append(p, tree)
        finally:
            os._exit(0)
    os.close(w)
    os.read(r, 2)
    t0 = time.perf_counter()
    os.close(r)
    if kill_after is not None:
        time.sleep(kill_after)
        os.kill(pid, signal.SIGKILL)
    os.waitpid(pid, 0)
    return time.perf_counter() - t0


def _state_after_kill(p: Path, old: dict, new: dict) -> str:
    got = tdz_numba.load(p)  # never an error
    which = "old" if _same(got, old) else "new" if _same(got, new) else None
    assert which is not None, sorted(_flat(got))
    r = tdz_numba.repair(p)
    _check_zip_tools(p)
    assert _same(tdz_numba.load(p), old if which == "old" else new)
    return which + ("+repaired" if r.action == "truncated" else "")


@pytest.mark.parametrize("step", [1, 2, 3, 4])
def test_exit_at_each_write_of_an_append(tmp_path, step):
    """The child dies at its n-th write of grow's own: before the temporary tail (1), after the
    payloads (2), before the commit write (3); 4: no such write, the append completes."""
    p = tdz_numba.save(BASE, tmp_path / "x.tdz")
    tree = _big_tree(1)
    _forked_append(p, tree, None, step_exit=step)
    new = {**BASE, **tree}
    assert _state_after_kill(p, BASE, new) in {"old", "old+repaired", "new"}


def test_kill_campaign(tmp_path):
    """SIGKILL at random instants of appends, repeated: our open reads the old or the new content,
    and after repair every zip tool reads the file (counts in the assertion message)."""
    warm = tdz_numba.save(BASE, tmp_path / "warm.tdz")
    tdz_numba.append(warm, _big_tree(0))  # kernels compiled (or loaded) before the forks
    p = tdz_numba.save(BASE, tmp_path / "x.tdz")
    current: dict = dict(BASE)
    span = _forked_append(p, _big_tree(0), None)
    current.update(_big_tree(0))
    rng = random.Random(int(os.environ.get("TDZ_KILL_SEED", "24")))
    counts: dict[str, int] = {}
    runs = int(os.environ.get("TDZ_KILL_RUNS", "20"))
    for k in range(1, runs + 1):
        tree = _big_tree(k)
        _forked_append(p, tree, rng.uniform(0, span))
        new = {**current, **tree}
        which = _state_after_kill(p, current, new)
        counts[which] = counts.get(which, 0) + 1
        if which.startswith("new"):
            current = new
    assert sum(counts.values()) == runs, counts
    print(f"kill campaign: {runs} kills over a {span * 1e3:.0f} ms append: {counts}")


def test_open_archive_survives_append(tmp_path):
    p = tdz_numba.save({"a": torch.arange(5)}, tmp_path / "x.tdz")
    ar = tdz_numba.open(p)
    assert ar["a"].tolist() == [0, 1, 2, 3, 4]
    tdz_numba.append(p, {"b": torch.ones(2)})
    assert ar["a"].tolist() == [0, 1, 2, 3, 4] and "b" not in ar
    ar.close()
    with tdz_numba.open(p, mode="r+") as rw:  # an r+ archive: new leaves, old offsets
        rw["a"][0] = 9
        tdz_numba.append(p, {"c": torch.zeros(1)})
        rw["a"][1] = 8
    got = tdz_numba.load(p)
    assert got["a"].tolist()[:2] == [9, 8] and sorted(got.keys()) == ["a", "b", "c"]
    np.testing.assert_array_equal(got["c"].numpy(), np.zeros(1, np.float32))
    # the new central directory copied the CRC of 'a' as it was at the append: stale until a refresh
    with pytest.raises(tdz_numba.ChecksumError, match="'a.memmap'"):
        tdz_numba.verify(p)
    tdz_numba.refresh_checksums(p)
    tdz_numba.verify(p)
    _check_zip_tools(p)


def test_append_to_an_allocated_buffer(tmp_path):
    buf = tdz_numba.allocate({"x": torch.zeros(4, 3)}, tmp_path / "b.tdz")
    offset = buf.info("x").offset
    buf["x"][:] = 3
    tdz_numba.append(tmp_path / "b.tdz", {"y": torch.ones(2)})
    buf["x"][0, 0] = 5  # the old mapping still writes the file
    buf.close()
    with tdz_numba.open(tmp_path / "b.tdz") as ar:
        assert ar.info("x").offset == offset and ar["x"][0].tolist() == [5.0, 3.0, 3.0]
        assert ar["y"].tolist() == [1.0, 1.0]
    tdz_numba.refresh_checksums(tmp_path / "b.tdz")
    _check_zip_tools(tmp_path / "b.tdz")


def test_cli_repair_and_compact(tmp_path, capsys):
    from tdz_numba.cli import main

    p = tdz_numba.save(BASE, tmp_path / "x.tdz")
    old = _uncommitted(p)
    assert main(["repair", "--bytes", str(p)]) == 0
    assert f"truncated from {len(old) + 100_000 + 22} B to {len(old)} B" in capsys.readouterr().out
    assert main(["repair", str(p)]) == 0 and "nothing to repair" in capsys.readouterr().out
    tdz_numba.append(p, {"a": torch.zeros(10)}, replace=True)
    grown = p.stat().st_size
    assert main(["compact", "--bytes", str(p)]) == 0
    out = capsys.readouterr().out
    assert f"compacted from {grown} B to {p.stat().st_size} B" in out and p.stat().st_size < grown
    tdz_numba.append(p, {"a": torch.zeros(10)}, replace=True)
    assert main(["compact", str(p)]) == 0  # human sizes by default, as every verb
    assert re.search(
        r"compacted from [\d.]+ KiB to [\d.]+ KiB \([\d.]+ (B|KiB) of superseded", capsys.readouterr().out
    )
    assert torch.equal(tdz_numba.load(p)["a"], torch.zeros(10))


def test_append_only_changed(tmp_path):
    tree = {f"l{i}": torch.full((1000,), float(i)) for i in range(50)}
    tree["cfg"] = {"lr": 0.1, "name": "x"}
    tree["empty"] = torch.zeros(0)
    p = tdz_numba.save(tree, tmp_path / "ckpt.tdz")
    size = p.stat().st_size
    assert tdz_numba.append(p, tree, replace=True, only_changed=True) == []
    assert p.stat().st_size == size  # nothing written
    tree["l7"] = tree["l7"] + 1  # same CRC impossible: bytes differ
    tree["l9"] = tree["l9"].double()  # another dtype
    tree["cfg"] = {"lr": 0.2, "name": "x"}
    written = tdz_numba.append(p, tree, replace=True, only_changed=True)
    assert written == ["l7", "l9", "cfg/lr"]
    got = tdz_numba.load(p)
    assert torch.equal(got["l7"], tree["l7"]) and got["l9"].dtype == torch.float64 and got["cfg"]["lr"] == 0.2
    full = tdz_numba.load(tdz_numba.save(tree, tmp_path / "full.tdz"))
    assert _same(tdz_numba.load(p), full)
    # without replace, only a changed leaf is refused
    tree["l1"] = tree["l1"] * 2
    with pytest.raises(tdz_numba.ArchiveExistsError, match="'l1'"):
        tdz_numba.append(p, tree, only_changed=True)


def test_append_zip64_and_its_repair(tmp_path):
    """An archive past 4 GiB (a sparse allocate): the append writes zip64 end records, its
    temporary tail carries the zip64 locator, and repair restores the old bytes."""
    p = tmp_path / "big.tdz"
    tdz_numba.allocate(
        {"z": torch.empty(5 << 30, dtype=torch.uint8, device="meta")}, p, reserve=False
    ).close()
    with open(p, "rb") as f:
        f.seek(-98, 2)
        old_tail = f.read()
    old_size = p.stat().st_size
    state = grow.read_state(np.memmap(p, np.uint8, mode="r"), str(p))
    assert state.end.zip64 and state.locator  # a zip64 archive: the locator is copied too
    tdz_numba.append(p, {"a": torch.arange(4)})
    with zipfile.ZipFile(p) as z:
        assert sorted(z.namelist()) == ["a.memmap", "meta.json", "z.memmap"]
        assert z.read("a.memmap") == torch.arange(4).numpy().tobytes()
    with tdz_numba.open(p) as ar:
        assert ar["a"].tolist() == [0, 1, 2, 3] and ar["z"].shape == (5 << 30,)
    # an uncommitted append on top: the zip64 end records are found again by repair
    committed = p.stat().st_size
    state = grow.read_state(np.memmap(p, np.uint8, mode="r"), str(p))
    with open(p, "r+b") as f:
        f.seek(committed + 4096)
        f.write(state.temp_tail)
    with tdz_numba.open(p) as ar:
        assert ar["a"].tolist() == [0, 1, 2, 3]
    r = tdz_numba.repair(p)
    assert (r.action, r.size) == ("truncated", committed)
    with zipfile.ZipFile(p) as z:
        assert z.read("a.memmap") == torch.arange(4).numpy().tobytes()
    assert old_size < committed and len(old_tail) == 98
