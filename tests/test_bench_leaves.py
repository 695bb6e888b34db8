"""``tdz bench --leaves``: the leaf-count sweep (tiny sizes)."""

from __future__ import annotations

import json

import pytest
import torch

from tdz_numba.bench import leafsweep
from tdz_numba.cli import main


def test_make_leaves_groups_of_20():
    nested, flat = leafsweep.make_leaves(45, 0.01)
    assert len(flat) == 45 and len(nested) == 3 and len(nested["g00002"]) == 5
    assert all(t.dtype == torch.float32 for t in flat.values())
    assert nested["g00001"]["l03"] is flat["g00001/l03"]


def test_leaves_json_table_and_plot(tmp_path, capsys):
    pytest.importorskip("safetensors")
    png = tmp_path / "leaves.png"
    rc = main(
        [
            "bench",
            "--leaves",
            "20,60",
            "--size-mib",
            "0.05",
            "--repeat",
            "1",
            "--no-durable",
            "--dir",
            str(tmp_path),
            "--json",
            "--plot",
            str(png),
        ]
    )
    assert rc == 0
    out = capsys.readouterr()
    rows = json.loads(out.out)
    assert {(r["leaves"], r["format"], r["op"]) for r in rows} == {
        (n, f, op) for n in (20, 60) for f in leafsweep.FORMATS for op in leafsweep.OPS
    }
    assert all(
        r["seconds"] > 0 and r["us_per_leaf"] == pytest.approx(r["seconds"] * 1e6 / r["leaves"]) for r in rows
    )
    assert "tdz/st" in out.err and "load+sum" in out.err and "cost from 20 to 60 leaves" in out.err
    if png.exists():  # matplotlib installed
        assert png.stat().st_size > 1000
    assert list(tmp_path.glob("tdz-leaves-*")) == []  # artifacts removed


def test_leaves_bad_arguments(capsys):
    assert main(["bench", "--leaves", "0"]) == 2
    assert main(["bench", "--leaves", "10", "--format", "nope"]) == 2
    assert "unknown format" in capsys.readouterr().err


def test_durable_sweep_adds_the_save_without_fsync(tmp_path, capsys):
    pytest.importorskip("safetensors")
    argv = ["bench", "--leaves", "20", "--size-mib", "0.05", "--repeat", "1", "--dir", str(tmp_path)]
    assert main([*argv, "--format", "tdz_numba,safetensors", "--json"]) == 0
    out = capsys.readouterr()
    rows = json.loads(out.out)
    assert {(r["format"], r["op"]) for r in rows} == {
        ("tdz_numba", leafsweep.NOFSYNC),
        *((f, op) for f in ("tdz_numba", "safetensors") for op in leafsweep.OPS),
    }
    assert "durable=True (fsync)" in out.err and f"{leafsweep.NOFSYNC:<9}" in out.err
    assert [line for line in out.err.splitlines() if line.split()[1:2] == [leafsweep.NOFSYNC]][0].endswith(
        "x"
    )
