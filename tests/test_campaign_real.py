"""The real-file campaign (``scripts/campaign_real.py``) runs clean: every file of the corpus
agrees with its owner's reader or is refused for a documented limit, and its .tdz conversion
reads back the same in tdz_numba and tensordict 0.15.3."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def test_campaign_real_files(tmp_path):
    pytest.importorskip("tensordict")
    out = tmp_path / "rows.json"
    proc = subprocess.run(
        [
            sys.executable,
            "-W",
            "ignore",
            str(ROOT / "scripts" / "campaign_real.py"),
            "-v",
            "--json",
            str(out),
        ],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    rows = json.loads(out.read_text())
    outcomes = {r["outcome"] for r in rows}
    assert outcomes <= {"agree", "both refuse", "limit"}, outcomes
    agreed = [r for r in rows if r["outcome"] == "agree"]
    assert len(agreed) >= 0.8 * len(rows)  # a reader that refuses everything fails here
    assert {r["format"] for r in agreed} >= {"numpy", "torch", "safetensors", "tdz", "memmap_dir"}
