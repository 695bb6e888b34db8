"""The command line of issue 24's leftovers: ``tdz append ARCHIVE FILE`` and ``tdz verify --deep``."""

from __future__ import annotations

import subprocess
import sys
import zipfile

import pytest
import torch

import tdz_numba

safetensors_torch = pytest.importorskip("safetensors.torch")


def _tdz(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "tdz_numba", *args], capture_output=True, text=True)


def test_append_any_file(tmp_path):
    x = tdz_numba.save({"a": torch.ones(2)}, tmp_path / "x.tdz")
    src = tmp_path / "m.safetensors"
    safetensors_torch.save_file({"w": torch.arange(3.0), "a": torch.zeros(1)}, src)
    before = x.read_bytes()
    done = _tdz("append", str(x), str(src))
    assert done.returncode == 2 and "'a' already exists" in done.stderr  # refused, file untouched
    assert x.read_bytes() == before
    done = _tdz("append", str(x), str(src), "--subpath", "ep/7", "--digest")
    assert done.returncode == 0, done.stderr
    assert "2 leaves of" in done.stdout and "under 'ep/7'" in done.stdout
    assert x.read_bytes()[: len(before) - 100] == before[: len(before) - 100]  # grown, not rewritten
    assert _tdz("append", str(x), str(src), "--replace").returncode == 0
    back = tdz_numba.load(x)
    assert back["a"].tolist() == [0.0] and back["w"].tolist() == [0.0, 1.0, 2.0]
    assert back["ep"]["7"]["w"].tolist() == [0.0, 1.0, 2.0]
    with zipfile.ZipFile(x) as z:
        assert z.testzip() is None
    with tdz_numba.open(x) as ar:  # --digest, then digest=None follows the archive
        assert all(ar.info(k).digest is not None for k in ("ep/7/w", "ep/7/a", "w", "a"))
    deep = _tdz("verify", "--deep", "--json", str(x))
    assert deep.returncode == 0 and '"digests": 4' in deep.stdout


def test_append_a_tdz_with_levels(tmp_path):
    x = tdz_numba.save({"a": torch.ones(2)}, tmp_path / "x.tdz")
    y = tdz_numba.save({"obs": {"p": torch.zeros(3, 2)}, "s": "text"}, tmp_path / "y.tdz")
    assert _tdz("append", str(x), str(y)).returncode == 0
    back = tdz_numba.load(x)
    assert back["obs"]["p"].shape == (3, 2) and back["s"] == "text" and back["a"].tolist() == [1.0, 1.0]
