"""The code base stays ruff-clean: lint rules and the formatter (no '# fmt: skip' exceptions)."""

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
TARGETS = ["tdz_numba", "tests", "asv_bench", "conftest.py"]


def _ruff() -> str | None:
    exe = Path(sys.executable).parent / "ruff"
    return str(exe) if exe.is_file() else shutil.which("ruff")


@pytest.mark.parametrize("args", [["check"], ["format", "--check"]], ids=["lint", "format"])
def test_ruff(args):
    ruff = _ruff()
    if ruff is None:
        pytest.skip("ruff is not installed")
    proc = subprocess.run([ruff, *args, *TARGETS], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-2000:]


def test_no_format_exceptions():
    hits = [
        str(p.relative_to(ROOT))
        for t in TARGETS
        for p in (ROOT / t).rglob("*.py")
        if "fmt: skip" in p.read_text()
    ]
    hits = [h for h in hits if h != "tests/test_style.py"]
    assert not hits, hits
