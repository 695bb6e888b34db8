"""Durable saves, stale temp files, full disks, and errors naming the user's path
(issue 10 item 9, issue 13 "Errors outside the documented tree")."""

from __future__ import annotations

import contextlib
import errno
import io
import os
import random
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import numpy as np
import pytest
import torch

import tdz_numba
from tdz_numba.errors import (
    AccessDeniedError,
    DiskFullError,
    FileMissingError,
    InvalidArgumentError,
    TdzError,
    UnsupportedError,
)
from tdz_numba.files import tempfiles as _tempfiles
from tdz_numba.files.paths import as_local_path, user_errors
from tdz_numba.saving import clean

ROOT = Path(__file__).resolve().parents[1]


def _temps(directory: Path) -> list[str]:
    return sorted(n for n in os.listdir(directory) if ".tdz-tmp." in n)


def _dead_pid() -> int:
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait()
    return proc.pid


def _age(path: Path, seconds: float = 60.0) -> None:
    t = time.time() - seconds
    os.utime(path, (t, t), follow_symlinks=False)


# ---------------------------------------------------------------------------
# temp names and cleaning
# ---------------------------------------------------------------------------
def test_temp_name_pattern():
    name = _tempfiles.temp_name("x.tdz")
    info = _tempfiles.parse_temp_name(name)
    assert info is not None and info["name"] == "x.tdz" and int(info["pid"]) == os.getpid()
    assert name.startswith(".x.tdz.tdz-tmp.")
    for other in (
        ".x.tdz.abcdefgh.tmp",
        "x.tdz.tdz-tmp.abcdef.1.0123abcd",
        ".x.tdz.tdz-tmp.abcdef.0.0123abcd",
        ".x.tdz.tdz-tmp.abcdef.12.0123abc",
        ".x.tdz.tdz-tmp.ABCDEF.12.0123abcd",
    ):
        assert _tempfiles.parse_temp_name(other) is None, other


def test_clean_removes_only_dead_old_matching_entries(tmp_path):
    host = _tempfiles.parse_temp_name(_tempfiles.temp_name("x"))["host"]
    dead, alive = _dead_pid(), os.getppid()
    make = {
        f".a.tdz.tdz-tmp.{host}.{dead}.0123abcd": True,  # dead, old: removed
        f".b.tdz.tdz-tmp.{host}.{alive}.0123abcd": False,  # alive
        f".c.tdz.tdz-tmp.{host}.{os.getpid()}.0123abcd": False,  # this process
        f".d.tdz.tdz-tmp.{'0' if host[0] != '0' else '1'}{host[1:]}.{dead}.0123abcd": False,  # another host
        f".e.tdz.tdz-tmp.{host}.{dead}.0123abcd.bak": False,  # not our pattern
        ".f.tdz.0123abcd.tmp": False,  # the old mkstemp names: unknown owner
        "g.tdz": False,
    }
    for name in make:
        (tmp_path / name).write_bytes(b"x")
        _age(tmp_path / name)
    recent = tmp_path / f".h.tdz.tdz-tmp.{host}.{dead}.0123abcd"
    recent.write_bytes(b"x")  # dead but modified just now: kept
    stale_dir = tmp_path / f".i.tdz-tmp.{host}.{dead}.0123abcd"  # a killed unpack's directory
    (stale_dir / "sub").mkdir(parents=True)
    (stale_dir / "sub" / "f").write_bytes(b"x")
    outside = tmp_path / "outside"
    outside.mkdir()
    (outside / "keep").write_bytes(b"k")
    os.symlink(outside, stale_dir / "link")  # never followed
    _age(stale_dir)
    link = tmp_path / f".j.tdz.tdz-tmp.{host}.{dead}.0123abcd"
    os.symlink(outside / "keep", link)  # a link with our name: not a file we made
    _age(link)

    assert sorted(p.name for p in clean(tmp_path, dry_run=True)) == sorted(
        [f".a.tdz.tdz-tmp.{host}.{dead}.0123abcd", stale_dir.name]
    )
    removed = sorted(p.name for p in clean(tmp_path))
    assert removed == sorted([f".a.tdz.tdz-tmp.{host}.{dead}.0123abcd", stale_dir.name])
    for name, gone in make.items():
        assert (tmp_path / name).exists() != gone, name
    assert recent.exists() and os.path.islink(link)
    assert (outside / "keep").read_bytes() == b"k"


def test_cli_clean(tmp_path):
    from tdz_numba.cli import main

    host = _tempfiles.parse_temp_name(_tempfiles.temp_name("x"))["host"]
    stale = tmp_path / f".x.tdz.tdz-tmp.{host}.{_dead_pid()}.0123abcd"
    stale.write_bytes(b"x" * 100)
    _age(stale)
    assert main(["clean", str(tmp_path), "--dry-run"]) == 0 and stale.exists()
    assert main(["clean", str(tmp_path)]) == 0 and not stale.exists()


def test_save_removes_stale_temps_and_uses_the_pattern(tmp_path, monkeypatch):
    host = _tempfiles.parse_temp_name(_tempfiles.temp_name("x"))["host"]
    stale = tmp_path / f".x.tdz.tdz-tmp.{host}.{_dead_pid()}.0123abcd"
    stale.write_bytes(b"x")
    _age(stale)
    seen = []
    real_replace = os.replace

    def spy(src, dst, *a, **k):
        seen.append(Path(src).name)
        return real_replace(src, dst, *a, **k)

    monkeypatch.setattr(os, "replace", spy)
    tdz_numba.save({"a": torch.ones(3)}, tmp_path / "x.tdz")
    assert not stale.exists()
    assert _temps(tmp_path) == []
    assert _tempfiles.parse_temp_name(seen[0])["name"] == "x.tdz"


_CHILD = textwrap.dedent("""
    import sys, torch, tdz_numba
    path, n = sys.argv[1], int(sys.argv[2])
    tree = {f"k{i}": torch.full((n // 4 // 8,), 2.0) for i in range(8)}
    print("ready", flush=True)
    while True:
        tdz_numba.save(tree, path)
""")


@pytest.mark.parametrize("mib", [128])
def test_killed_saves_leave_old_or_new_and_next_save_cleans(mib, tmp_path):
    n = mib << 20
    path = tmp_path / "x.tdz"
    tdz_numba.save({f"k{i}": torch.full((n // 4 // 8,), 1.0) for i in range(8)}, path)
    env = dict(os.environ, PYTHONPATH=str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    rng = random.Random(0)
    kills = 0
    for _ in range(10):
        proc = subprocess.Popen(
            [sys.executable, "-c", _CHILD, str(path), str(n)], env=env, stdout=subprocess.PIPE, text=True
        )
        try:
            assert proc.stdout.readline().strip() == "ready"
            deadline = time.monotonic() + 60
            while not _temps(tmp_path) and time.monotonic() < deadline:
                time.sleep(0.002)
            time.sleep(rng.uniform(0, 0.05))  # somewhere in the middle of a save
        finally:
            proc.send_signal(signal.SIGKILL)
            proc.wait()
            proc.stdout.close()
        kills += 1
        # after each kill: the archive is the old one or a new one, never corrupt
        value = tdz_numba.load(path)["k0"][:1].item()
        assert value in (1.0, 2.0)
    left = _temps(tmp_path)
    assert left, "no save was killed mid-write (no temp file left): the test did not test anything"
    time.sleep(_tempfiles.STALE_AGE + 0.2)
    tdz_numba.save({"k0": torch.full((4,), 3.0)}, path)
    assert _temps(tmp_path) == []
    assert tdz_numba.load(path)["k0"].tolist() == [3.0] * 4
    assert kills == 10


# ---------------------------------------------------------------------------
# fsync
# ---------------------------------------------------------------------------
@pytest.mark.parametrize("durable", [True, False])
def test_durable_fsyncs_file_and_directory(durable, tmp_path, monkeypatch):
    calls = []
    real = os.fsync

    def spy(fd):
        calls.append(os.path.isdir(f"/proc/self/fd/{fd}") if os.path.exists("/proc/self/fd") else None)
        return real(fd)

    monkeypatch.setattr(os, "fsync", spy)
    tdz_numba.save({"a": torch.ones(3)}, tmp_path / "x.tdz", durable=durable)
    tdz_numba.pack(tdz_numba.unpack(tmp_path / "x.tdz", tmp_path / "d"), tmp_path / "y.tdz", durable=durable)
    with tdz_numba.allocate({"a": torch.zeros(3)}, tmp_path / "z.tdz", durable=durable):
        pass
    if durable:
        assert calls == [False, True] * 3  # the file before the rename, the directory after
    else:
        assert calls == []


# ---------------------------------------------------------------------------
# full disks
# ---------------------------------------------------------------------------
@contextlib.contextmanager
def _tmpfs(directory: Path, size: str, ro: bool = False):
    directory.mkdir(parents=True, exist_ok=True)
    opts = f"size={size}" + (",ro" if ro else "")
    r = subprocess.run(["mount", "-t", "tmpfs", "-o", opts, "tmpfs", str(directory)], capture_output=True)
    if r.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {r.stderr.decode(errors='replace').strip()}")
    try:
        yield directory
    finally:
        subprocess.run(["umount", "-l", str(directory)], capture_output=True)


def test_disk_full_on_tmpfs(tmp_path):
    with _tmpfs(tmp_path / "small", "1m") as d:
        old = tdz_numba.save({"a": torch.ones(16)}, d / "x.tdz")
        with pytest.raises(DiskFullError) as info:
            tdz_numba.save({"a": torch.ones(1 << 20)}, d / "x.tdz")  # 4 MiB
        assert isinstance(info.value, OSError) and isinstance(info.value, TdzError)
        assert info.value.errno == errno.ENOSPC
        assert str(d / "x.tdz") in str(info.value) and ".tdz-tmp." not in str(info.value)
        assert _temps(d) == []
        assert tdz_numba.load(old)["a"].tolist() == [1.0] * 16  # the old file is intact
        with pytest.raises(DiskFullError):
            tdz_numba.allocate(
                {"a": torch.zeros(1 << 20)}, d / "buf.tdz"
            )  # reserved up front, no SIGBUS later
        assert sorted(os.listdir(d)) == ["x.tdz"]
        # sparse on request: succeeds, the space is not taken
        with tdz_numba.allocate({"a": torch.zeros(1 << 20)}, d / "sparse.tdz", reserve=False) as buf:
            assert buf["a"].shape == (1 << 20,)


_FSIZE_CHILD = textwrap.dedent("""
    import resource, signal, sys, os, torch, tdz_numba
    signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
    resource.setrlimit(resource.RLIMIT_FSIZE, (1 << 20, 1 << 20))
    d = sys.argv[1]
    out = []
    for what in ("save", "allocate"):
        try:
            if what == "save":
                tdz_numba.save({"a": torch.ones(1 << 20)}, os.path.join(d, "x.tdz"))
            else:
                tdz_numba.allocate({"a": torch.zeros(1 << 20)}, os.path.join(d, "y.tdz"))
            out.append(what + ":ok")
        except tdz_numba.DiskFullError as e:
            out.append(what + ":DiskFullError:" + str(isinstance(e, OSError)))
        except BaseException as e:
            out.append(what + ":" + type(e).__name__ + ":" + str(e))
    print(" ".join(out), sorted(os.listdir(d)))
""")


def test_disk_full_by_file_size_limit(tmp_path):
    env = dict(os.environ, PYTHONPATH=str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    r = subprocess.run(
        [sys.executable, "-c", _FSIZE_CHILD, str(tmp_path)],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert r.returncode == 0, r.stderr[-2000:]
    assert r.stdout.strip() == "save:DiskFullError:True allocate:DiskFullError:True []", r.stdout


# ---------------------------------------------------------------------------
# errors that name the user's path
# ---------------------------------------------------------------------------
def test_missing_file_errors(tmp_path):
    missing = tmp_path / "nope" / "x.tdz"
    for call in (
        tdz_numba.open,
        tdz_numba.load,
        tdz_numba.verify,
        tdz_numba.refresh_checksums,
        lambda p: tdz_numba.unpack(p, tmp_path / "out"),
    ):
        with pytest.raises(FileMissingError) as info:
            call(missing)
        assert isinstance(info.value, FileNotFoundError) and isinstance(info.value, TdzError)
        assert str(missing) in str(info.value)
        assert info.value.errno == errno.ENOENT and info.value.filename == str(missing)
    assert not (tmp_path / "out").exists()
    assert tdz_numba.is_archive(missing) is False
    with pytest.raises(FileMissingError):
        tdz_numba.pack(tmp_path / "nodir", tmp_path / "y.tdz")


def test_read_only_directory_names_the_users_path(tmp_path):
    if os.geteuid() == 0:  # root ignores permission bits: use a read-only mount
        ctx = _tmpfs(tmp_path / "ro", "1m", ro=True)
    else:
        (tmp_path / "ro").mkdir()
        os.chmod(tmp_path / "ro", 0o555)
        ctx = contextlib.nullcontext(tmp_path / "ro")
    with ctx as d:
        target = d / "x.tdz"
        for call in (
            lambda: tdz_numba.save({"a": torch.ones(2)}, target),
            lambda: tdz_numba.allocate({"a": torch.zeros(2)}, target),
        ):
            with pytest.raises(AccessDeniedError) as info:
                call()
            assert isinstance(info.value, PermissionError) and isinstance(info.value, TdzError)
            assert str(target) in str(info.value)
            assert ".tdz-tmp." not in str(info.value) and ".tmp" not in str(info.value)
        with pytest.raises(AccessDeniedError):
            tdz_numba.unpack(tdz_numba.save({"a": torch.ones(2)}, tmp_path / "ok.tdz"), d / "out")


def test_write_permission_error_from_the_os_names_the_users_path(tmp_path):
    # an EACCES raised on the temp name (as mkstemp did) is reported on the user's path
    with pytest.raises(AccessDeniedError) as info, user_errors(tmp_path / "x.tdz", action="write"):
        raise PermissionError(
            errno.EACCES, "Permission denied", str(tmp_path / ".x.tdz.tdz-tmp.abcdef.1.0123abcd")
        )
    assert (
        str(info.value) == f"cannot write {tmp_path / 'x.tdz'}: permission denied (the directory {tmp_path} "
        f"is not writable)"
    )


def test_file_objects_and_urls_are_not_supported_yet(tmp_path):
    url = "s3://bucket/x.tdz"
    archive = tdz_numba.save({"a": torch.ones(2)}, tmp_path / "x.tdz")
    for arg in (url, io.BytesIO(), "https://host/x.tdz"):
        for call in (
            lambda a: tdz_numba.unpack(a, tmp_path / "out"),
            tdz_numba.refresh_checksums,
            lambda a: tdz_numba.allocate({"a": torch.zeros(2)}, a),
        ):
            with pytest.raises(UnsupportedError) as info:
                call(arg)
            assert isinstance(info.value, NotImplementedError)
            assert "not supported yet" in str(info.value)
            if isinstance(arg, str):
                assert repr(arg) in str(info.value)  # quoted exactly: never 's3:/bucket/x.tdz'
    with pytest.raises(UnsupportedError, match="not supported yet"):
        tdz_numba.unpack(archive, url)
    assert as_local_path("file:///tmp/a%20b.tdz") == Path("/tmp/a b.tdz")
    assert as_local_path(b"/tmp/x.tdz") == Path("/tmp/x.tdz")
    assert as_local_path("C:/x.tdz") == Path("C:/x.tdz")  # a drive letter is not a URL scheme
    with pytest.raises(InvalidArgumentError):
        as_local_path(42)
    assert not (tmp_path / "out").exists()


def test_reserve_false_stays_sparse(tmp_path):
    with tdz_numba.allocate(
        {"a": torch.zeros(64 << 20, dtype=torch.uint8)}, tmp_path / "s.tdz", reserve=False
    ):
        pass
    st = os.stat(tmp_path / "s.tdz")
    assert st.st_size > 64 << 20 and st.st_blocks * 512 < 8 << 20
    with tdz_numba.allocate({"a": torch.zeros(64 << 20, dtype=torch.uint8)}, tmp_path / "r.tdz") as buf:
        assert int(buf["a"][-1]) == 0
    assert os.stat(tmp_path / "r.tdz").st_blocks * 512 >= 64 << 20
    assert np.all(np.fromfile(tmp_path / "r.tdz", np.uint8, count=16, offset=4096) == 0)
