"""``tdz bench --read-formats``: workloads, the touch, alternating rounds, tables and the CLI (tiny sizes)."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from tdz_numba.bench import readers, readformats
from tdz_numba.cli import main


def test_our_reader_hands_every_tensor_in_depth_first_order():
    a, b, c = torch.zeros(1), torch.ones(2), torch.full((3,), 2.0)
    flat = {"a": a, "b": b}
    got = readers._leaves(flat, [])
    assert len(got) == 2 and got[0] is a and got[1] is b and readers._leaves({}, []) == []
    nested = {"a": a, "sub": {"c": c, "tag": "x", "deeper": {"b": b}}, "n": 3}
    got = readers._leaves(nested, [])
    assert len(got) == 3 and all(x is y for x, y in zip(got, [a, c, b]))  # plain values left out


def test_workloads():
    small = readers.make_tensors("small", count=250)
    assert len(small) == 250 and all(
        t.nbytes == 10 * 1024 and t.dtype == torch.float16 for t in small.values()
    )
    ts = list(small.values())
    assert not torch.equal(ts[0], ts[1])  # distinct tensors
    assert len({t.untyped_storage().data_ptr() for t in ts}) == 250  # each its own storage
    llama = readers.make_tensors("llama", 8)
    assert list(llama) == list(readers.llama_shapes())
    assert sum(t.nbytes for t in llama.values()) == pytest.approx(8 * 2**20, rel=0.05)
    assert llama["model.layers.3.mlp.down_proj.weight"].shape[1] == 8192  # widths kept
    assert readers.make_tensors("mixed", 8).keys() == llama.keys()  # alignment.py's name
    with pytest.raises(ValueError, match="unknown workload"):
        readers.make_tensors("nope")


def test_touch_reads_one_byte_per_page():
    a = np.zeros(3 * 4096 + 1, np.uint8)
    a[0], a[4096], a[8192], a[12288] = 1, 2, 3, 4
    a[1] = a[4095] = 100  # not on a page start: not read
    t = torch.zeros(5000, dtype=torch.uint8)
    t[0], t[4096] = 7, 9
    assert readers.touch([a]) == 10
    assert readers.touch([a, t]) == 26
    assert readers.touch([a[1:]]) == 100  # pages counted from the tensor's own start (a[1] and a[4097])
    assert readers.touch([np.zeros(0, np.uint8)]) == 0
    with pytest.raises(ValueError, match="non-contiguous"):
        readers.touch([np.zeros((4, 4))[:, 0]])


def test_readers_agree_on_every_format(tmp_path):
    """Every reader of every row (view and copy) gives the written tensors' count, bytes and touched bytes."""
    tensors = readers.make_tensors("small", count=30)
    tensors["big"] = torch.randn(3, 5000).to(torch.float16)  # several pages
    expect = readers.expected_touch(tensors)
    for fmt in readers.FORMATS:
        for name, f in readers.readers_of(fmt).items():
            path = tmp_path / f"x{readers.SUFFIX[f]}"
            if not path.exists():
                try:
                    readers.write(f, tensors, path)
                except ImportError:
                    continue
            for copy in (False, True):
                got, keep = readers.reader(fmt, name, copy)(path)
                assert (len(got), sum(t.nbytes for t in got), readers.touch(got)) == expect, (fmt, name, copy)
                del got
                if keep is not None and hasattr(keep, "close"):
                    keep.close()
    assert readers.readers_of("tdz") == {
        "tdz_numba": "tdz",
        "ztensor": "zt",
        "own": "tdz",
        "safetensors": "safetensors",
    }
    with pytest.raises(ValueError, match="unknown reader"):
        readers.reader("npz", "nope", False)


def test_rounds_alternate_rotate_and_drop_failures(tmp_path):
    order = []
    tensors = [torch.ones(10)]
    expect = (1, 40, 0)

    def ok(name):
        def fn(path):
            order.append(name)
            return list(tensors), None

        return fn

    def boom(path):
        order.append("boom")
        raise OSError("disk on fire\nsecond line")

    def wrong(path):
        order.append("wrong")
        return [torch.ones(3)], None

    notes = []
    cells = {
        n: (fn, tmp_path) for n, fn in (("a", ok("a")), ("b", ok("b")), ("boom", boom), ("wrong", wrong))
    }
    # expected touch of ones(10) float32: first byte 0 (1.0 = 00 00 80 3f), touched sum 0
    opened: dict[str, list[float]] = {}
    out = readformats._rounds(cells, 3, False, expect, lambda rd, why: notes.append((rd, why)), opened)
    assert set(out) == {"a", "b"} and all(len(v) == 3 and min(v) > 0 for v in out.values())
    # the part before the touch: one per timed round, never more than the whole
    assert set(opened) == {"a", "b"}
    assert all(len(opened[n]) == 3 and all(0 < o <= t for o, t in zip(opened[n], out[n])) for n in out)
    # round 0: a b boom wrong; then the two survivors, order rotated by the round
    assert order == ["a", "b", "boom", "wrong", "b", "a", "a", "b", "b", "a"]
    assert notes[0] == ("boom", "OSError: disk on fire")
    assert notes[1][0] == "wrong" and "(1, 12, 0) != (1, 40, 0)" in notes[1][1]


def _fake(rows):
    res = readformats.ReadResult(repeat=3)
    res.nbytes, res.count = {"small": 1000 * 10240}, {"small": 1000}
    res.memcpy = {"small": {"copyto_gbps": 10.0, "alloc_copy_gbps": 4.0}}
    for fmt, mode, rd, ms in rows:
        res.rows.append(
            {
                "workload": "small",
                "format": fmt,
                "reader": rd,
                "file": fmt,
                "mode": mode,
                "median_ms": ms,
                "runs_ms": [ms],
                "gbps": 1000 * 10240 / ms / 1e6,
                "us_per_tensor": ms,
                "open_ms": ms / 2,
                "open_us_per_tensor": ms / 2,
            }
        )
    return res


def test_ratios_and_tables_fit_100_columns():
    res = _fake(
        [
            ("safetensors", "view", "tdz_numba", 4.0),
            ("safetensors", "view", "ztensor", 2.0),
            ("safetensors", "view", "own", 8.0),
            ("safetensors", "copy", "tdz_numba", 1.0),
            ("safetensors", "copy", "ztensor", 2.0),
            ("safetensors", "copy", "own", 4.0),
            ("tdz", "view", "tdz_numba", 3.0),
            ("tdz", "view", "ztensor", 6.0),
            ("tdz", "view", "own", 9.0),
            ("tdz", "view", "safetensors", 1.5),
        ]
    )
    rs = {(r["format"], r["mode"]): r for r in readformats.ratios(res)}
    assert (
        rs[("safetensors", "view")]["ratio"] == 2.0 and rs[("safetensors", "view")]["best_peer"] == "ztensor"
    )
    assert rs[("safetensors", "copy")]["ratio"] == 0.5
    assert rs[("tdz", "view")]["ratio"] == 2.0 and rs[("tdz", "view")]["best_peer"] == "safetensors"
    text = readformats.ratio_table(res)
    assert "2.00 zt*" in text and "0.50 zt" in text and "0.50 zt*" not in text and "2.00 st*" in text
    assert "2 of 3 cells slower" in text
    table = readformats.read_table(res)
    assert "4.00 / 2.00 / 8.00" in table and "3.00 / 6.00 / 9.00 / 1.50" in table
    assert (
        "memcpy 10.00 GB/s (numpy copyto; alloc + copy 4.00); tdz_numba copy best 10.24 GB/s = 1.02x" in table
    )
    per = readformats.per_tensor_table(res)
    assert "small     safetensors  2.0 / 1.0 / 4.0        4.0 / 2.0 / 8.0" in per
    assert "small     tdz          1.5 / 3.0 / 4.5 / 0.8  3.0 / 6.0 / 9.0 / 1.5" in per
    assert per in readformats.report(res)
    for line in (table + "\n" + text + "\n" + readformats.report(res)).splitlines():
        assert len(line) <= 100, line


def test_cold_stalls_counts_rounds_over_the_cells_fastest():
    res = _fake(
        [
            ("tdz", "cold", "tdz_numba", 300.0),
            ("tdz", "cold", "ztensor", 290.0),
            ("tdz", "cold", "own", 500.0),
            ("safetensors", "cold", "tdz_numba", 300.0),
            ("safetensors", "cold", "ztensor", 310.0),
        ]
    )
    rows = {(r["format"], r["reader"]): r for r in res.rows}
    rows[("tdz", "tdz_numba")]["runs_ms"] = [250.0, 800.0, 300.0, 376.0]  # 800 and 376 > 1.5 x 250
    rows[("tdz", "ztensor")]["runs_ms"] = [290.0, 280.0, 1000.0]
    rows[("tdz", "own")]["runs_ms"] = [500.0, 700.0]  # 700 < 750: not a stall
    text = readformats.cold_stalls(res)
    assert "small     tdz     2/4 / 1/3 / 0/2" in text
    assert "safetensors" not in text  # one round each, none stalled: no row
    assert text in readformats.report(res)
    assert readformats.cold_stalls(_fake([("npz", "cold", "tdz_numba", 9.0)])) == ""


def test_cli_quick_json_and_plot(tmp_path, capsys):
    pytest.importorskip("safetensors")
    png = tmp_path / "read.png"
    argv = ["bench", "--read-formats", "--workload", "small", "--small-count", "40", "--format"]
    argv += ["safetensors,npz,tdz", "--repeat", "1", "--dir", str(tmp_path), "--json", "--plot", str(png)]
    assert main(argv) == 0
    out = capsys.readouterr()
    doc = json.loads(out.out)
    cells = {(r["format"], r["mode"], r["reader"]) for r in doc["rows"]}
    want = {
        (f, m, rd)
        for f in ("safetensors", "npz", "tdz")
        for m in readformats.MODES
        for rd in readers.readers_of(f)
    }
    failed = [n for n in doc["notes"] if "failed" in n]
    assert failed == [] and cells == want
    assert all(len(r["runs_ms"]) == 1 and r["median_ms"] > 0 for r in doc["rows"])
    assert doc["count"] == {"small": 40} and doc["memcpy"]["small"]["copyto_gbps"] > 0
    assert len(doc["ratios"]) == 9 and "ratio: tdz_numba time / best peer" in out.err
    assert max(len(line) for line in out.err.splitlines()) <= 100
    if png.exists():
        assert png.stat().st_size > 1000
    assert [p for p in tmp_path.iterdir() if p.name.startswith(".tdz-bench-read-")] == []


def test_cli_bad_arguments(capsys):
    assert main(["bench", "--read-formats", "--format", "nope"]) == 2
    assert main(["bench", "--read-formats", "--mode", "warm"]) == 2
    assert main(["bench", "--read-formats", "--small-count", "0"]) == 2
    assert "choose from" in capsys.readouterr().err
