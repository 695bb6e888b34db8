"""files/confine: the one rule for other files a reader opens (inside the folder, regular, no symlink out)."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time

import pytest

from tdz_numba.errors import BadArchiveError, TdzError, UnsafeContentError
from tdz_numba.files import confine
from tdz_numba.files.confine import (
    MemberMissingError,
    NotRegularError,
    OutsideError,
    map_inside,
    open_dir_inside,
    open_inside,
    read_inside,
    relative_inside,
)


@pytest.fixture
def root(tmp_path):
    r = tmp_path / "model"
    (r / "sub" / "deep").mkdir(parents=True)
    (r / "a.bin").write_bytes(b"AAAA")
    (r / "sub" / "b.bin").write_bytes(b"BBBBBB")
    (r / "sub" / "deep" / "c.bin").write_bytes(b"C")
    out = tmp_path / "outside"
    out.mkdir()
    (out / "secret.bin").write_bytes(b"SECRET")
    return r


def _read(root, rel):
    return read_inside(root, rel, where="in.file", entry="e", max_bytes=1 << 20)


@pytest.mark.parametrize(
    "rel, data",
    [
        ("a.bin", b"AAAA"),
        ("./a.bin", b"AAAA"),
        ("sub/b.bin", b"BBBBBB"),
        ("sub//deep/./c.bin", b"C"),
        ("sub/../a.bin", b"AAAA"),  # .. inside the folder
        ("sub\\b.bin", b"BBBBBB"),  # Windows separators, as ONNX writers may use
    ],
)
def test_inside_names_read(root, rel, data):
    assert _read(root, rel) == data


def test_absolute_name_under_the_folder(root):
    assert _read(root, str(root / "sub" / "b.bin")) == b"BBBBBB"
    assert relative_inside(root, str(root / "a.bin")) == "a.bin"


@pytest.mark.parametrize(
    "rel", ["../outside/secret.bin", "sub/../../outside/secret.bin", "/etc/passwd", ".."]
)
def test_outside_names_refused(root, rel):
    with pytest.raises(OutsideError) as e:
        _read(root, rel)
    assert isinstance(e.value, UnsafeContentError) and isinstance(e.value, TdzError)
    assert "in.file" in str(e.value) and e.value.path == "in.file" and e.value.entry == "e"


def test_symlinks_leading_out_refused(root):
    secret = root.parent / "outside" / "secret.bin"
    (root / "abs.bin").symlink_to(secret)
    (root / "rel.bin").symlink_to("../outside/secret.bin")
    (root / "sub" / "up.bin").symlink_to("../../outside/secret.bin")
    (root / "dirlink").symlink_to(root.parent / "outside")
    (root / "dev.bin").symlink_to("/dev/zero")
    for rel in ("abs.bin", "rel.bin", "sub/up.bin", "dirlink/secret.bin", "dev.bin"):
        with pytest.raises(OutsideError, match="symlink|above"):
            _read(root, rel)
    with pytest.raises(OutsideError):
        open_dir_inside(root, "dirlink", where="in.file")


def test_symlinks_inside_followed(root):
    (root / "l1.bin").symlink_to("sub/b.bin")
    (root / "sub" / "l2.bin").symlink_to("../a.bin")
    (root / "l3.bin").symlink_to(root / "sub" / "deep" / "c.bin")  # absolute, inside
    (root / "dl").symlink_to("sub/deep")
    (root / "sub" / "chain.bin").symlink_to("../l1.bin")
    assert _read(root, "l1.bin") == b"BBBBBB"
    assert _read(root, "sub/l2.bin") == b"AAAA"
    assert _read(root, "l3.bin") == b"C"
    assert _read(root, "dl/c.bin") == b"C"
    assert _read(root, "sub/chain.bin") == b"BBBBBB"
    fd = open_dir_inside(root, "dl", where="in.file")
    try:
        assert sorted(os.listdir(fd)) == ["c.bin"]
    finally:
        os.close(fd)


def test_symlink_loop_bounded(root):
    (root / "x").symlink_to("y")
    (root / "y").symlink_to("x")
    with pytest.raises(BadArchiveError, match="more than 40 symlinks"):
        _read(root, "x")


def test_fifo_socket_folder_refused_without_blocking(root):
    os.mkfifo(root / "fifo")
    t0 = time.monotonic()
    with pytest.raises(NotRegularError, match="FIFO"):
        _read(root, "fifo")
    assert time.monotonic() - t0 < 10  # a blocking open would never return
    (root / "fl").symlink_to("fifo")
    with pytest.raises(NotRegularError, match="FIFO"):
        map_inside(root, "fl", where="in.file")
    sock = socket.socket(socket.AF_UNIX)
    try:
        sock.bind(str(root / "sock"))
        with pytest.raises(NotRegularError, match="socket"):
            _read(root, "sock")
    finally:
        sock.close()
    with pytest.raises(NotRegularError, match="folder"):
        _read(root, "sub")
    with pytest.raises(NotRegularError, match="not a folder"):
        _read(root, "a.bin/x")
    with pytest.raises(NotRegularError):
        open_dir_inside(root, "a.bin", where="in.file")


def test_missing_and_bad_names(root):
    with pytest.raises(MemberMissingError, match="does not exist"):
        _read(root, "sub/nope.bin")
    assert issubclass(MemberMissingError, BadArchiveError)
    for bad in ("", "a\0b"):
        with pytest.raises(OutsideError, match="not a file name"):
            _read(root, bad)


def test_size_checked_before_reading(root):
    with pytest.raises(BadArchiveError, match="holds 6 bytes \\(at most 5 read\\)"):
        read_inside(root, "sub/b.bin", where="in.file", max_bytes=5)


def test_map_inside(root):
    mm, size = map_inside(root, "sub/b.bin", where="in.file")
    assert size == 6 and bytes(mm[:]) == b"BBBBBB"
    (root / "empty").write_bytes(b"")
    assert map_inside(root, "empty", where="in.file") == (None, 0)


def test_swap_after_check_is_caught(root, monkeypatch):
    """A name that is a regular file when looked at and a symlink out when opened (a race a
    realpath check would miss) is refused: the open itself uses O_NOFOLLOW."""
    (root / "swap.bin").symlink_to(root.parent / "outside" / "secret.bin")
    real_stat = os.stat

    def lying_stat(name, *, dir_fd=None, follow_symlinks=True):
        if name == "swap.bin":
            return real_stat(root / "a.bin")  # what it was before the swap
        return real_stat(name, dir_fd=dir_fd, follow_symlinks=follow_symlinks)

    monkeypatch.setattr(confine.os, "stat", lying_stat)
    with pytest.raises(NotRegularError, match="cannot open 'swap.bin'"):
        open_inside(root, "swap.bin", where="in.file")


def test_no_descriptor_leaks(root):
    before = len(os.listdir("/proc/self/fd")) if os.path.isdir("/proc/self/fd") else None
    if before is None:
        pytest.skip("no /proc/self/fd")
    for rel in ("a.bin", "sub/deep/c.bin", "../x", "sub/nope", "sub"):
        try:
            _read(root, rel)
        except TdzError:
            pass
    assert len(os.listdir("/proc/self/fd")) == before


# -- the readers that open other files go through the rule ---------------------------------------------
class _Alarm:
    """Fails a test that blocks (a FIFO opened blocking) instead of hanging the run."""

    def __enter__(self):
        import signal

        def fire(signum, frame):
            raise AssertionError("blocked on open")

        self.old = signal.signal(signal.SIGALRM, fire)
        signal.alarm(20)

    def __exit__(self, *exc):
        import signal

        signal.alarm(0)
        signal.signal(signal.SIGALRM, self.old)


def _sharded(tmp_path):
    import json

    import torch
    from safetensors.torch import save_file

    d = tmp_path / "ckpt"
    d.mkdir()
    save_file({"w1": torch.arange(4.0)}, str(d / "m-1.safetensors"))
    save_file({"w2": torch.ones(2)}, str(d / "m-2.safetensors"))
    idx = d / "m.safetensors.index.json"
    idx.write_text(json.dumps({"weight_map": {"w1": "m-1.safetensors", "w2": "m-2.safetensors"}}))
    return d, idx


def test_sharded_safetensors_shard_symlink_out_refused(tmp_path):
    import torch
    from safetensors.torch import save_file

    from tdz_numba import formats

    d, idx = _sharded(tmp_path)
    out = tmp_path / "outside"
    out.mkdir()
    save_file({"w2": torch.full((2,), 7.0)}, str(out / "secret.safetensors"))
    (d / "m-2.safetensors").unlink()
    (d / "m-2.safetensors").symlink_to(out / "secret.safetensors")
    with pytest.raises(OutsideError, match="shard 'm-2.safetensors'.*outside"):
        formats.open_source(idx)
    (d / "m-2.safetensors").unlink()
    (d / "store").mkdir()
    save_file({"w2": torch.ones(2)}, str(d / "store" / "m-2.safetensors"))
    (d / "m-2.safetensors").symlink_to("store/m-2.safetensors")  # inside: followed
    src = formats.open_source(idx)
    assert formats.to_tree(src)["w2"].tolist() == [1.0, 1.0]
    src.close()
    (d / "m-2.safetensors").unlink()
    os.mkfifo(d / "m-2.safetensors")
    with _Alarm(), pytest.raises(NotRegularError, match="FIFO"):
        formats.open_source(idx)


def _onnx_external(d, location):
    onnx = pytest.importorskip("onnx")
    import numpy as np
    from onnx import TensorProto, helper, numpy_helper

    t = numpy_helper.from_array(np.zeros(4, np.float32), "w")
    t.ClearField("raw_data")
    t.data_location = TensorProto.EXTERNAL
    for k, v in (("location", location), ("offset", "0"), ("length", "16")):
        e = t.external_data.add()
        e.key, e.value = k, v
    graph = helper.make_graph([], "g", [], [helper.make_tensor_value_info("w", t.data_type, [4])], [t])
    onnx.save(helper.make_model(graph), d / "m.onnx")
    return d / "m.onnx"


def test_onnx_external_data_fifo_and_symlink(tmp_path):
    from tdz_numba.formats.onnx import open_onnx

    d = tmp_path / "model"
    d.mkdir()
    p = _onnx_external(d, "w.bin")
    os.mkfifo(d / "w.bin")
    with _Alarm(), pytest.raises(NotRegularError, match="initializer 'w'.*FIFO"):
        open_onnx(p)
    (d / "w.bin").unlink()
    (d / "w.bin").symlink_to("/dev/zero")
    with pytest.raises(UnsafeContentError):
        open_onnx(p)
    (d / "w.bin").unlink()
    (d / "w.bin").write_bytes(bytes(range(16)))
    src = open_onnx(p)
    assert bytes(src.files[1].buffer) == bytes(range(16))
    src.close()


@pytest.mark.parametrize("op", ["open", "load", "is_archive", "verify"])
def test_input_fifo_is_refused_without_blocking(tmp_path, op):
    """The file given to open/load is a FIFO: refused at once (it used to block forever)."""
    fifo = tmp_path / "model.safetensors"
    os.mkfifo(fifo)
    code = (
        "import sys, tdz_numba\n"
        f"fn = getattr(tdz_numba, {op!r})\n"
        "try:\n"
        "    r = fn(sys.argv[1])\n"
        "    print('RESULT', r)\n"
        "except tdz_numba.TdzError as e:\n"
        "    print('REFUSED', type(e).__name__, e)\n"
    )
    proc = subprocess.run([sys.executable, "-c", code, str(fifo)], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    if op == "is_archive":
        assert "RESULT False" in proc.stdout
    else:
        assert "REFUSED" in proc.stdout and "not a regular file" in proc.stdout, proc.stdout
