"""Every code block of the README runs as pasted.

The ``python`` blocks run in order, in one fresh temporary directory, each in a
new interpreter (so a block cannot lean on a name another block defined unless
it defines it itself). Then every ``tdz ...`` line of the ``bash`` blocks runs
there too (as ``python -m tdz_numba ...``), against the files the Python blocks
made. Set-up commands (``scripts/setup.sh``, ``pip``, ``conda``, ``cd``, ``asv``)
are not run here: CI runs them (``.ci/run``).
"""

import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
README = ROOT / "README.md"
FENCE = re.compile(r"^```(\w+)[^\n]*\n(.*?)^```", re.M | re.S)


def blocks(lang: str) -> list[str]:
    return [body for kind, body in FENCE.findall(README.read_text()) if kind == lang]


def _env() -> dict[str, str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")]))
    env.setdefault("NUMBA_CACHE_DIR", str(ROOT / ".numba_cache"))
    return env


@pytest.fixture(scope="module")
def workdir(tmp_path_factory):
    return tmp_path_factory.mktemp("readme")


def test_readme_has_python_and_cli_blocks():
    assert len(blocks("python")) >= 3
    assert any(line.strip().startswith("tdz ") for b in blocks("bash") for line in b.splitlines())


@pytest.mark.parametrize("i", range(len(blocks("python"))))
def test_python_block_runs(i, workdir):
    code = blocks("python")[i]
    proc = subprocess.run(
        [sys.executable, "-c", code], cwd=workdir, env=_env(), capture_output=True, text=True, timeout=600
    )
    assert proc.returncode == 0, f"README python block {i}:\n{code}\n--- stderr:\n{proc.stderr[-3000:]}"


def _cli_lines() -> list[str]:
    out = []
    for body in blocks("bash"):
        for line in body.splitlines():
            line = line.split("  #", 1)[0].strip()
            if line.startswith("tdz ") and not line.startswith("tdz bench"):
                out.append(line)
    return out


@pytest.mark.parametrize("line", _cli_lines())
def test_cli_line_runs(line, workdir):
    # after the python blocks (pytest runs this module's tests in file order)
    argv = shlex.split(line)[1:]
    proc = subprocess.run(
        [sys.executable, "-m", "tdz_numba", *argv],
        cwd=workdir,
        env=_env(),
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 0, f"{line}\n{proc.stdout[-2000:]}\n{proc.stderr[-2000:]}"
