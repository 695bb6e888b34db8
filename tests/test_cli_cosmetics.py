"""What the ``tdz`` verbs print: human sizes (``--bytes`` for raw), torch's dtype names, plurals,
a format line for every file, ``tree --max-leaves`` with a "... N more" line, 100 columns."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

import tdz_numba
from tdz_numba import cli
from tdz_numba.bench import reporting
from tdz_numba.bench.harness import BenchResult
from tdz_numba.files.progress import human_bytes


def _main(capsys, *args):
    code = cli.main([str(a) for a in args])
    out = capsys.readouterr()
    return code, out.out, out.err


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    d = tmp_path_factory.mktemp("cosmetics")
    st = pytest.importorskip("safetensors.torch")
    f = {}
    f["tdz"] = tdz_numba.save({"w": torch.zeros(1000, 21), "b": {"c": torch.ones(3)}}, d / "x.tdz")
    f["one"] = tdz_numba.save({"a": {"b": torch.zeros(4)}}, d / "one.tdz")
    f["st"] = d / "m.safetensors"
    st.save_file({"w": torch.zeros(1000, 21), "h": torch.zeros(4, dtype=torch.float16)}, str(f["st"]))
    f["npz"] = d / "x.npz"
    np.savez(f["npz"], a=np.arange(10.0), i=np.arange(3, dtype=np.int32))
    f["big"] = tdz_numba.save(
        {"g": {f"k{i:04d}": torch.zeros(2) for i in range(450)}, "z": torch.ones(1)}, d / "big.tdz"
    )
    return f


def test_sizes_are_human_unless_bytes(files, capsys):
    code, out, _ = _main(capsys, "tree", files["tdz"])
    w = next(line for line in out.splitlines() if line.startswith("w "))
    assert code == 0 and "82.0 KiB" in w and "84000" not in w
    code, out, _ = _main(capsys, "tree", files["tdz"], "--bytes")
    w = next(line for line in out.splitlines() if line.startswith("w "))
    assert code == 0 and "84000 B" in w
    code, out, _ = _main(capsys, "info", files["tdz"], "--json")
    payload = json.loads(out)["payload_bytes"]
    code, out, _ = _main(capsys, "info", files["tdz"])
    assert f"payload:      {human_bytes(payload)} uncompressed" in out and str(payload) not in out
    code, out, _ = _main(capsys, "info", files["tdz"], "--bytes")
    assert f"{payload} B uncompressed" in out
    code, out, _ = _main(capsys, "show", files["tdz"], "w")
    assert "size:         82.0 KiB" in out
    code, out, _ = _main(capsys, "verify", files["tdz"])
    assert f"({human_bytes(payload)} of payload)" in out
    code, out, _ = _main(capsys, "verify", files["tdz"], "--bytes")
    assert f"({payload} B of payload)" in out


def test_one_dtype_vocabulary(files, capsys):
    code, out, _ = _main(capsys, "tree", files["st"])
    rows = {line.split()[0]: line for line in out.splitlines()[1:]}
    assert code == 0 and " float32 " in rows["w"] and " float16 " in rows["h"]
    assert "F32" not in out and "F16" not in out
    code, out, _ = _main(capsys, "tree", files["npz"])
    assert "<f8" not in out and "float64" in out and "int32" in out
    code, out, _ = _main(capsys, "show", files["st"], "h")
    assert "dtype:        float16" in out and "F16" not in out
    # the format's own names only in info
    code, out, _ = _main(capsys, "info", files["st"])
    assert "dtypes:       float16 (F16) x1, float32 (F32) x1" in out


def test_plurals_and_format_line(files, capsys):
    code, out, _ = _main(capsys, "info", files["one"])
    assert "(2 levels)" in out and "format:       tdz" in out and "root:         TensorDict" in out
    code, out, _ = _main(capsys, "tree", files["one"], "--depth", "0")
    assert "1 key" in out and "1 keys" not in out
    code, out, _ = _main(capsys, "verify", files["one"])
    assert "2 levels, 1 leaf" in out and "1 leaves" not in out
    code, out, _ = _main(capsys, "info", files["npz"])
    assert "format:       npz" in out and "root:" not in out and "TensorDict" not in out
    assert "(1 level)" in out
    code, out, _ = _main(capsys, "tree", files["st"])
    assert out.splitlines()[0].endswith("(safetensors; 2 keys)") and "TensorDict" not in out


def test_tree_max_leaves(files, capsys):
    code, out, _ = _main(capsys, "tree", files["big"])
    lines = out.splitlines()
    assert code == 0 and len(lines) < 210  # 200 leaves by default
    assert sum(1 for line in lines if line.strip().startswith("k")) == 200
    assert "  ... 250 more" in lines and "... 1 more" in lines  # g's other keys, then the root's z
    assert "--max-leaves" in lines[-1]
    code, out, _ = _main(capsys, "tree", files["big"], "--max-leaves", "5")
    assert sum(1 for line in out.splitlines() if line.strip().startswith("k")) == 5 and "... 445 more" in out
    code, out, _ = _main(capsys, "tree", files["big"], "--max-leaves", "0")
    assert sum(1 for line in out.splitlines() if line.strip().startswith("k")) == 450 and "more" not in out
    code, out, _ = _main(capsys, "tree", files["big"], "--max-leaves", "3", "--json")
    d = json.loads(out)
    assert d["truncated"] is True and d["more"] == 1 and d["children"][0]["more"] == 447
    code, _, err = _main(capsys, "tree", files["big"], "--max-leaves", "-1")
    assert code == 2 and "--max-leaves" in err


def test_output_fits_100_columns(tmp_path, capsys):
    long = "a_rather_long_key_name_" * 6
    p = tdz_numba.save({long: {long: torch.zeros(3, 4, 5, 6, 7, 8)}, "s": "x" * 300}, tmp_path / "l.tdz")
    for args in (["tree", p], ["info", p], ["tree", p, "--bytes"]):
        code, out, _ = _main(capsys, *args)
        assert code == 0
        assert max(len(line) for line in out.splitlines()[1:]) <= 100, out


def test_bench_report_fits_100_columns():
    fmts = ["tdz_numba", "tdz_numba_lazy", "td_memmap", "td_tdz", "torch", "torch_mmap", "safetensors", "npz"]
    res = BenchResult(workloads={"small_many_leaves": "x " * 80, "large_images": "y"}, ops=["save", "read"])
    res.results = [
        {"workload": w, "op": op, "format": f, "median_ms": 12.345 * (i + 1), "runs_ms": [12.0, 13.0]}
        for w in res.workloads
        for op in res.ops
        for i, f in enumerate(fmts)
    ]
    text = reporting.report(res, ["--quick"])
    assert max(len(line) for line in text.splitlines()) <= 100
    table = reporting.format_table(res)
    headers = [line.split() for line in table.splitlines() if line.startswith("workload")]
    assert len(headers) >= 2 and all(h[:2] == ["workload", "op"] for h in headers)
    assert sorted(sum((h[2:] for h in headers), [])) == sorted(fmts)  # every format, once


def test_html_repr_headers_preview_metadata_sizes(tmp_path):
    tree = {
        "obs": {
            "pixels": torch.arange(768).to(torch.uint8).reshape(4, 3, 8, 8),
            "v": torch.tensor([0.5, 2.0]),
        },
        "reward": torch.arange(100.0),
        "env": "cartpole",
    }
    p = tdz_numba.save(tree, tmp_path / "r.tdz", metadata={"author": "me"})
    with tdz_numba.open(p) as ar:
        html = ar._repr_html_()
    heads = "<th>key</th><th>dtype</th><th>shape</th>"
    assert html.count(heads) == 2 and "<th>storage</th>" in html and "<th>values</th>" in html
    assert '<td class="tdz-v">0. 1. 2. ... 97. 98. 99.</td>' in html  # first and last values
    assert '<td class="tdz-v">0.5 2.</td>' in html and '<td class="tdz-v">0 1 2 ... 253 254 255</td>' in html
    assert "metadata: author = &#x27;me&#x27;" in html
    assert "2 keys &middot; 776 B" in html  # obs/: 768 + 8 bytes of leaves
    assert "3 keys &middot; 1.1 KiB" in html  # the root: 776 + 400 = 1176 bytes
    q = tdz_numba.save({"z": torch.arange(1000.0)}, tmp_path / "z.tdz", compression="deflate")
    with tdz_numba.open(q) as ar:
        html = ar._repr_html_()
    assert '<td class="tdz-v"></td>' in html  # compressed: not inflated for a preview
