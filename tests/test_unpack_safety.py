"""unpack on hostile zips: refused before anything is written, never follows a symbolic
link, leaves nothing behind on failure (issue 10 item 6)."""

from __future__ import annotations

import os
import stat
import zipfile
from pathlib import Path

import pytest
import torch

import tdz_numba
from tdz_numba.errors import ArchiveExistsError, BadArchiveError, TdzError
from tdz_numba.files import tempfiles as _tempfiles
from tdz_numba.zipfmt.extract import MAX_DEPTH, check_names

META = b'{"shape": [], "device": "cpu", "_type": "<class \'tensordict._td.TensorDict\'>"}'


def _zip(path: Path, entries: list) -> Path:
    """A zip of ``(name, data)`` or ``(name, data, unix_mode)`` entries, written by zipfile."""
    with zipfile.ZipFile(path, "w") as z:
        for e in entries:
            name, data = e[0], e[1]
            info = zipfile.ZipInfo(name)
            if len(e) > 2:
                info.external_attr = e[2] << 16
                info.create_system = 3
            z.writestr(info, data)
    return path


def _tree(directory: Path) -> list[str]:
    out = []
    for root, dirs, files in os.walk(directory):
        for n in dirs + files:
            out.append(os.path.relpath(os.path.join(root, n), directory))
    return sorted(out)


def _temps(directory: Path) -> list[str]:
    return [n for n in os.listdir(directory) if ".tdz-tmp." in n]


HOSTILE = {
    "file_and_dir": [("meta.json", META), ("x", b"1"), ("x/y", b"2")],
    "dir_then_file": [("meta.json", META), ("x/y", b"2"), ("x", b"1")],
    "meta_file_and_dir": [("meta.json", META), ("meta.json/", b"")],
    "meta_file_and_child": [("meta.json", META), ("meta.json/a", b"x")],
    "double_slash_alias": [("meta.json", META), ("a/b", b"1"), ("a//b", b"2")],
    "double_slash_alone": [("meta.json", META), ("a//b", b"2")],
    "dot_component": [("meta.json", META), ("a/./b", b"2")],
    "dotdot": [("meta.json", META), ("../evil", b"2")],
    "dotdot_inner": [("meta.json", META), ("a/../../evil", b"2")],
    "absolute": [("meta.json", META), ("/tmp/evil", b"2")],
    "backslash": [("meta.json", META), ("a\\..\\evil", b"2")],
    "drive": [("meta.json", META), ("C:/evil", b"2")],
    "long_component": [("meta.json", META), ("a/" + "x" * 300, b"2")],
    "long_multibyte_component": [("meta.json", META), ("é" * 128, b"2")],  # 256 bytes
    "symlink_then_child": [("meta.json", META), ("link", b"/", 0o120777), ("link/x", b"2")],
    "symlink_alone": [("meta.json", META), ("link", b"/etc/passwd", 0o120777)],
}


@pytest.mark.parametrize("case", list(HOSTILE))
def test_hostile_names_refused_before_writing(case, tmp_path):
    archive = _zip(tmp_path / "bad.tdz", HOSTILE[case])
    out = tmp_path / "out" / "target"
    with pytest.raises(BadArchiveError):
        tdz_numba.unpack(archive, out)
    assert not out.exists()
    assert not (tmp_path / "out").exists() or _tree(tmp_path / "out") == []
    assert not (tmp_path / "evil").exists()


def test_hostile_names_leave_existing_target_untouched(tmp_path):
    out = tmp_path / "target"
    out.mkdir()
    (out / "keep").write_bytes(b"k")
    for case, entries in HOSTILE.items():
        with pytest.raises(BadArchiveError):
            tdz_numba.unpack(_zip(tmp_path / f"{case}.tdz", entries), out)
    assert _tree(out) == ["keep"]
    assert _temps(tmp_path) == []


def test_empty_name_refused(tmp_path):
    archive = _zip(tmp_path / "bad.tdz", [("meta.json", META), ("", b"x")])
    with pytest.raises(TdzError):
        tdz_numba.unpack(archive, tmp_path / "out")
    assert not (tmp_path / "out").exists()
    with pytest.raises(BadArchiveError, match="empty name"):
        check_names(["meta.json", ""], "x")


def test_component_limits():
    check_names(["a/" + "x" * 255], "x")  # exactly 255 bytes is fine
    with pytest.raises(BadArchiveError, match="256 bytes"):
        check_names(["é" * 128], "x")
    with pytest.raises(BadArchiveError, match="components"):
        check_names(["a/" * MAX_DEPTH + "f"], "x")


def test_deep_names_do_not_recurse(tmp_path):
    # 1,500 components (3,000+ characters): validated and created iteratively,
    # each directory opened relative to its parent's fd
    import sys

    deep = "d/" * 1500 + "leaf.bin"
    archive = _zip(tmp_path / "deep.tdz", [("meta.json", META), (deep, b"abc")])
    limit = sys.getrecursionlimit()
    sys.setrecursionlimit(400)  # any recursion per component would fail
    try:
        out = tdz_numba.unpack(archive, tmp_path / "out")
    finally:
        sys.setrecursionlimit(limit)
    fd = os.open(out, os.O_RDONLY)
    try:
        for _ in range(1500):
            nxt = os.open("d", os.O_RDONLY | os.O_DIRECTORY, dir_fd=fd)
            os.close(fd)
            fd = nxt
        leaf = os.open("leaf.bin", os.O_RDONLY, dir_fd=fd)
        assert os.read(leaf, 10) == b"abc"
        os.close(leaf)
    finally:
        os.close(fd)
    _tempfiles.remove_tree(out)  # iterative removal (pytest's rmtree recurses)
    assert not out.exists()


def test_symlink_inside_target_pointing_outside_is_not_followed(tmp_path):
    outside = tmp_path / "outside"
    outside.mkdir()
    (outside / "victim").write_bytes(b"precious")
    archive = tdz_numba.save({"sub": {"a": torch.arange(4)}, "b": torch.ones(3)}, tmp_path / "x.tdz")
    # a directory link where the archive has a directory: refused, nothing written
    target = tmp_path / "target"
    target.mkdir()
    os.symlink(outside, target / "sub")
    with pytest.raises(ArchiveExistsError, match="symbolic link"):
        tdz_numba.unpack(archive, target)
    assert sorted(os.listdir(outside)) == ["victim"]
    assert (outside / "victim").read_bytes() == b"precious"
    assert _temps(tmp_path) == []
    # a file link where the archive has a file: the link is replaced, its target untouched
    target2 = tmp_path / "target2"
    target2.mkdir()
    os.symlink(outside / "victim", target2 / "b.memmap")
    os.symlink(outside / "new", target2 / "meta.json")  # dangling: must not create outside/new
    tdz_numba.unpack(archive, target2)
    assert (outside / "victim").read_bytes() == b"precious"
    assert sorted(os.listdir(outside)) == ["victim"]
    assert stat.S_ISREG(os.lstat(target2 / "b.memmap").st_mode)
    assert stat.S_ISREG(os.lstat(target2 / "meta.json").st_mode)
    assert tdz_numba.load(tdz_numba.pack(target2, tmp_path / "y.tdz"))["b"].tolist() == [1.0] * 3


def test_target_itself_a_symlink_to_a_directory(tmp_path):
    real = tmp_path / "real"
    real.mkdir()
    link = tmp_path / "link"
    os.symlink(real, link)
    archive = tdz_numba.save({"a": torch.arange(3)}, tmp_path / "x.tdz")
    out = tdz_numba.unpack(archive, link)
    assert out == link
    assert os.path.islink(link)  # the link stays; the files are in the directory it names
    assert sorted(os.listdir(real)) == ["a.memmap", "meta.json"]
    assert _temps(tmp_path) == []


def test_target_a_dangling_symlink_or_a_file(tmp_path):
    archive = tdz_numba.save({"a": torch.arange(3)}, tmp_path / "x.tdz")
    os.symlink(tmp_path / "nowhere", tmp_path / "dangling")
    with pytest.raises(TdzError):
        tdz_numba.unpack(archive, tmp_path / "dangling")
    assert not (tmp_path / "nowhere").exists()
    (tmp_path / "file").write_bytes(b"x")
    with pytest.raises(ArchiveExistsError):
        tdz_numba.unpack(archive, tmp_path / "file")


def _corrupt_last_payload(path: Path) -> None:
    with zipfile.ZipFile(path) as z:
        info = z.infolist()[-1]
    data = bytearray(path.read_bytes())
    start = info.header_offset + 30 + len(info.filename.encode()) + len(info.extra)
    data[start + info.compress_size // 2] ^= 0xFF
    path.write_bytes(bytes(data))


@pytest.mark.parametrize("compression", [None, "deflate"])
def test_failure_midway_leaves_nothing(compression, tmp_path):
    tree = {f"k{i}": torch.arange(1000) + i for i in range(8)}
    archive = tdz_numba.save(tree, tmp_path / "x.tdz", compression=compression)
    _corrupt_last_payload(archive)
    out = tmp_path / "out"
    with pytest.raises(BadArchiveError):  # ChecksumError, or a corrupt deflate stream
        tdz_numba.unpack(archive, out)
    assert not out.exists()
    assert _temps(tmp_path) == []
    # an existing target is left as it was
    out.mkdir()
    (out / "keep").write_bytes(b"k")
    with pytest.raises(BadArchiveError):
        tdz_numba.unpack(archive, out)
    assert _tree(out) == ["keep"]
    assert _temps(tmp_path) == []


def test_new_and_empty_targets_appear_whole(tmp_path):
    archive = tdz_numba.save({"a": {"b": torch.ones(2)}, "c": "text"}, tmp_path / "x.tdz")
    for target in (tmp_path / "new" / "deeper", tmp_path / "empty"):
        if target.name == "empty":
            target.mkdir()
            os.chmod(target, 0o750)
        tdz_numba.unpack(archive, target)
        assert "meta.json" in os.listdir(target)
        assert tdz_numba.load(tdz_numba.pack(target, tmp_path / "re.tdz"))["a"]["b"].tolist() == [1.0, 1.0]
    assert stat.S_IMODE(os.stat(tmp_path / "empty").st_mode) == 0o750  # the directory's mode is kept
    assert _temps(tmp_path) == [] and _temps(tmp_path / "new") == []


def test_non_empty_target_is_merged_like_tensordict(tmp_path):
    # tensordict's unpack_memmap (zipfile.extractall) overwrites files and keeps others
    archive = tdz_numba.save({"a": torch.ones(2), "s": {"b": torch.zeros(3)}}, tmp_path / "x.tdz")
    out = tmp_path / "out"
    (out / "s").mkdir(parents=True)
    (out / "a.memmap").write_bytes(b"old")
    (out / "other").write_bytes(b"kept")
    (out / "s" / "other2").write_bytes(b"kept2")
    tdz_numba.unpack(archive, out)
    assert (out / "other").read_bytes() == b"kept"
    assert (out / "s" / "other2").read_bytes() == b"kept2"
    assert (out / "a.memmap").read_bytes() == torch.ones(2).numpy().tobytes()
    assert _temps(tmp_path) == []
    # a directory where the archive has a file: refused before anything moves
    out2 = tmp_path / "out2"
    (out2 / "a.memmap").mkdir(parents=True)
    (out2 / "other").write_bytes(b"kept")
    with pytest.raises(ArchiveExistsError, match="is a directory"):
        tdz_numba.unpack(archive, out2)
    assert _tree(out2) == ["a.memmap", "other"]


def test_tensordict_unpack_memmap_under_enable(tmp_path):
    pytest.importorskip("tensordict")
    from tensordict import TensorDict, unpack_memmap

    import tdz_numba.tensordict as tdt

    td = TensorDict(a=torch.arange(4), b=TensorDict(c=torch.ones(4, 2), batch_size=[4]), batch_size=[4])
    archive = tdt.save(td, tmp_path / "x.tdz")
    with tdt.enabled():
        out = unpack_memmap(archive, tmp_path / "dir")
    assert (TensorDict.load_memmap(out) == td).all()


@pytest.mark.parametrize("compression", ["deflate", "bzip2", "lzma"])
def test_compressed_entries_stream_into_files(compression, tmp_path):
    tree = {"a": torch.arange(300_000, dtype=torch.int32), "s": {"b": torch.zeros(5000)}}
    archive = tdz_numba.save(tree, tmp_path / "x.tdz", compression=compression)
    out = tdz_numba.unpack(archive, tmp_path / "dir")
    assert (out / "a.memmap").read_bytes() == tree["a"].numpy().tobytes()
    assert (out / "s" / "b.memmap").read_bytes() == bytes(20000)
