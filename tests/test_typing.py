"""The package type-checks: ``python -m mypy`` (configured in pyproject's ``[tool.mypy]``) finds no errors."""

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def test_mypy_clean():
    pytest.importorskip("mypy", reason="mypy is not installed (pip install -e .[dev])")
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    proc = subprocess.run(
        [sys.executable, "-m", "mypy", "--no-error-summary"],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 0, f"mypy found errors:\n{proc.stdout}{proc.stderr}"
    assert proc.stdout.strip() == ""
