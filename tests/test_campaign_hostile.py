"""The hostile campaign (``scripts/campaign_hostile.py``) runs clean: every hostile class and kept
mutant through every op, in children, with no crash, hang, MemoryError, stray exception or byte of
an outside file; some inputs are read (the mutants that stay valid), the rest refused."""

from __future__ import annotations

import json
import subprocess
import sys
from collections import Counter
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def test_campaign_hostile(tmp_path):
    pytest.importorskip("h5py")
    out = tmp_path / "rows.json"
    proc = subprocess.run(
        [
            sys.executable,
            "-W",
            "ignore",
            str(ROOT / "scripts" / "campaign_hostile.py"),
            "-v",
            "--json",
            str(out),
        ],
        capture_output=True,
        text=True,
        timeout=1200,
    )
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    counts = Counter(r["category"] for r in json.loads(out.read_text()))
    assert set(counts) <= {"ok", "refused"}, counts
    assert counts["ok"] > 50 and counts["refused"] > 200, counts
