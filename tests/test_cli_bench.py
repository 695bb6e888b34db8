"""The ``tdz`` command line (info, tree, verify, bench) and the benchmark harness."""

import importlib.util
import json
import re
import subprocess
import sys

import numpy as np
import pytest
import torch

import tdz_numba
import tdz_numba.bench.reporting
from tdz_numba import bench, cli


def _run(*args, timeout=120):
    return subprocess.run(
        [sys.executable, "-m", "tdz_numba", *map(str, args)], capture_output=True, text=True, timeout=timeout
    )


@pytest.fixture
def archive(tmp_path):
    tree = {
        "obs": {
            "pixels": torch.zeros(4, 3, 8, 8, dtype=torch.uint8),
            "depth": np.ones((4, 8, 8), np.float32),
        },
        "reward": torch.arange(5, dtype=torch.float64),
        "env": "cartpole",
    }
    return tdz_numba.save(tree, tmp_path / "a.tdz")


def _corrupt(path, key):
    with tdz_numba.open(path) as ar:
        off = ar.info(key).offset
    data = bytearray(path.read_bytes())
    data[off + 3] ^= 0xFF
    path.write_bytes(bytes(data))


# -- bench --------------------------------------------------------------------------------


def test_bench_quick_json(tmp_path):
    png = tmp_path / "bench.png"
    proc = _run(
        "bench",
        "--quick",
        "--format",
        "tdz_numba,safetensors,floor",
        "--workload",
        "small",
        "--op",
        "save,open,read",
        "--json",
        "--dir",
        tmp_path,
        "--plot",
        png,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    results = json.loads(proc.stdout)
    fmts = ["tdz_numba", "floor"] + (["safetensors"] if importlib.util.find_spec("safetensors") else [])
    expected = {
        ("small", op, f)
        for op in ("save", "open", "read")
        for f in fmts
        if not (op == "open" and f == "floor")
    }
    got = {(r["workload"], r["op"], r["format"]) for r in results}
    assert got == expected
    for r in results:
        assert set(r) == {"workload", "op", "format", "median_ms", "runs_ms"}
        assert r["median_ms"] > 0 and len(r["runs_ms"]) == 3 and all(x > 0 for x in r["runs_ms"])
        assert r["median_ms"] == sorted(r["runs_ms"])[1]
    # the report goes to stderr: header, table with ratios, reproduce line
    err = proc.stderr
    assert "machine:" in err and "torch" in err and "numba" in err
    assert "size: 16 MiB" in err and "repeat: 3" in err and "warm page cache" in err
    assert "reproduce (from the repository root, in its .venv): python -m tdz_numba bench" in err
    assert "--workload small" in err
    # no absolute paths of the build machine: no interpreter path, no artifacts directory
    assert sys.executable not in err and ".tdz-bench-" not in err
    assert "(1.0x)" in err
    assert "WARNING" not in err
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert not list(tmp_path.glob(".tdz-bench-*"))  # artifacts removed


def test_bench_compressed_quick_json(tmp_path):
    proc = _run(
        "bench",
        "--quick",
        "--compression",
        "deflate",
        "--workload",
        "images_flat,images_small",
        "--json",
        "--dir",
        tmp_path,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    results = json.loads(proc.stdout)
    expected = {
        (w, op, f)
        for w in ("images_flat", "images_small")
        for op in ("save", "load")
        for f in ("tdz_numba", "tdz_numba_1t", "td_tdz", "zlib_ng")
    }
    assert {(r["workload"], r["op"], r["format"]) for r in results} == expected
    for r in results:
        assert r["median_ms"] > 0 and len(r["runs_ms"]) == 3 and all(x > 0 for x in r["runs_ms"])
        assert r["compression"] == "deflate" and r["compresslevel"] is None
        assert r["file_bytes"] > 0 and r["nbytes"] >= 16 * 2**20
        assert r["size_ratio"] == pytest.approx(r["nbytes"] / r["file_bytes"])
        assert r["size_ratio"] > 1.5, r  # image-like data compresses (about 3.5x)
    assert max(len(line) for line in proc.stderr.splitlines()) <= 100  # the report wraps at 100 columns
    err = proc.stderr.replace("\n  ", " ")  # its prose lines rejoined (continuations are indented by two)
    assert "compressed section (deflate)" in err and "size: 16 MiB" in err and "repeat: 3" in err
    for w in ("images_flat", "images_small"):
        assert f"size ratio {w}" in err and f"scaling {w}: " in err
        assert f"goal {w}: single thread within 1.2x of zlib-ng" in err
        assert f"goal {w}: save >= 2x faster than tensordict compressed" in err
    # each scaling verdict agrees with the ratio printed before it and the target after "goal >= 0.8 x N cores"
    scaling = [line for line in err.splitlines() if line.startswith("scaling ")]
    assert len(scaling) == 2, err
    for line in scaling:
        head, _, tail = line.partition("; goal >= 0.8 x ")
        target = float(re.search(r"= ([0-9.]+)x:", tail).group(1))
        ratios = dict(re.findall(r"(save|load) ([0-9.]+)x \(", head))
        verdicts = dict(re.findall(r"(save|load) (PASS|FAIL)", tail))
        assert set(ratios) == set(verdicts) == {"save", "load"}, line
        for op, ratio in ratios.items():
            if abs(float(ratio) - target) < 0.01:  # both are printed rounded to 2 decimals
                continue
            assert verdicts[op] == ("PASS" if float(ratio) >= target else "FAIL"), line
    assert "WARNING" not in err  # every load summed to the in-memory total
    assert not list(tmp_path.glob(".tdz-bench-*"))


def test_bench_compressed_options(capsys):
    # compressed-only names need --compression, and the other way round
    assert cli.main(["bench", "--workload", "images_flat"]) == 2
    assert "--compression" in capsys.readouterr().err
    assert cli.main(["bench", "--compression", "deflate", "--op", "verify"]) == 2
    assert "verify" in capsys.readouterr().err
    assert cli.main(["bench", "--compresslevel", "3"]) == 2
    assert cli.main(["bench", "--compression", "deflate", "--compresslevel", "12"]) == 2
    assert cli.main(["bench", "--compression", "zstd"]) == 2
    capsys.readouterr()


def test_bench_images_workload():
    a = bench.make_images(8, (3, 16, 24), seed=1)
    assert a.shape == (8, 3, 16, 24) and a.dtype == np.uint8
    assert (a == bench.make_images(8, (3, 16, 24), seed=1)).all()  # deterministic
    assert 0 < (a == 0).mean() < 0.9 and a.std() > 10  # masks, but not all zeros
    w = bench.make_workload("images_small", 16)
    assert len(w.flat) == 2000 and w.nbytes >= 16 * 2**20
    assert all(t.dtype == torch.uint8 and t.shape[1:] == (3, 44, 64) for t in w.leaves())
    f = bench.make_workload("images_flat", 16)
    (leaf,) = f.leaves()
    assert leaf.shape == (2000, 3, 44, 64) and torch.equal(leaf[:1], next(iter(w.leaves())))
    big = bench.make_workload("images_small", 40)  # from 1.5 images per leaf: full 64 x 64 images
    assert big.nbytes == 2000 * 2 * 3 * 64 * 64 and next(iter(big.leaves())).shape == (2, 3, 64, 64)


def test_bench_goals():
    res = bench.BenchResult(
        workloads={"images_flat": "x"},
        ops=["save", "load"],
        compression="deflate",
        nbytes={"images_flat": 100 << 20},
    )
    cells = {
        ("save", "tdz_numba"): 100.0,
        ("save", "tdz_numba_1t"): 190.0,
        ("save", "td_tdz"): 300.0,
        ("save", "zlib_ng"): 180.0,
        ("load", "tdz_numba"): 50.0,
        ("load", "tdz_numba_1t"): 60.0,
        ("load", "zlib_ng"): 40.0,
    }
    res.results = [
        {"workload": "images_flat", "op": op, "format": f, "median_ms": ms, "runs_ms": [ms]}
        for (op, f), ms in cells.items()
    ]
    res.sizes = {("images_flat", "tdz_numba"): 25 << 20}
    got = {(g["op"], g["goal"]): g for g in bench.reporting.goals(res)}
    cores = bench.reporting._cores()
    assert got[("save", "scaling")]["value"] == pytest.approx(1.9)
    assert got[("save", "scaling")]["passed"] == (1.9 >= 0.8 * cores)
    assert got[("load", "scaling")]["value"] == pytest.approx(1.2)
    assert got[("save", "single_thread")]["passed"] and not got[("load", "single_thread")]["passed"]
    vs_td = got[("save", "vs_tensordict")]
    assert vs_td["value"] == pytest.approx(3.0) and vs_td["passed"]
    assert ("load", "vs_tensordict") not in got
    text = "\n".join(bench.goal_lines(res))
    assert "size ratio images_flat (uncompressed / file, 100.0 MiB): tdz_numba 4.00x" in text
    assert "scaling images_flat: tdz_numba all threads vs num_threads=1: save 1.90x" in text
    assert "load 1.50x (tdz_numba_1t 60.0 ms vs zlib_ng 40.0 ms) FAIL" in text
    assert "save >= 2x faster than tensordict compressed: 3.00x" in text and "PASS" in text
    table = bench.format_table(res).splitlines()
    assert table[0].split() == ["workload", "op", "tdz_numba", "tdz_numba_1t", "td_tdz", "zlib_ng"]


def test_measure_rounds_alternates_and_isolates_failures():
    from tdz_numba.bench.harness import Cell, measure, measure_rounds

    log = []

    def cell(name, fail_at=None):
        def run(i):
            log.append((name, i))
            if i == fail_at:
                raise OSError(f"{name} broke")
            return i

        return Cell(
            run, before=lambda i: log.append((name, "before", i)), cleanup=lambda: log.append((name, "done"))
        )

    out = measure_rounds({"a": cell("a"), "b": cell("b", fail_at=1), "c": cell("c")}, 2)
    runs = [entry for entry in log if len(entry) == 2 and entry[1] != "done"]
    # round 0 (warm-up) of every cell, then the timed rounds, one run of each cell in turn
    assert runs == [("a", 0), ("b", 0), ("c", 0), ("a", 1), ("b", 1), ("c", 1), ("a", 2), ("c", 2)]
    assert len(out["a"]) == 2 and len(out["c"]) == 2 and all(ms >= 0 for ms in out["a"])
    assert isinstance(out["b"], OSError) and "b broke" in str(out["b"])
    assert [e for e in log if e[-1] == "done"] == [("a", "done"), ("b", "done"), ("c", "done")]
    with pytest.raises(OSError, match="b broke"):
        measure(cell("b", fail_at=0).run, 3)
    assert len(measure(lambda i: i, 3)) == 3


def test_bench_rejects_unknown_names(capsys):
    assert cli.main(["bench", "--format", "tdz_numba,nope"]) == 2
    assert "nope" in capsys.readouterr().err
    with pytest.raises(SystemExit) as exc:
        bench.main(["--op", "fly"])
    assert exc.value.code == 2


def test_bench_table_ratios():
    res = bench.BenchResult(workloads={"flat": "x"}, ops=["save", "verify"])
    res.results = [
        {"workload": "flat", "op": "save", "format": "tdz_numba", "median_ms": 10.0, "runs_ms": [10.0]},
        {"workload": "flat", "op": "save", "format": "torch", "median_ms": 25.0, "runs_ms": [25.0]},
        {"workload": "flat", "op": "verify", "format": "tdz_numba", "median_ms": 4.0, "runs_ms": [4.0]},
        {"workload": "flat", "op": "verify", "format": bench.CRC_FORMAT, "median_ms": 8.0, "runs_ms": [8.0]},
    ]
    table = bench.format_table(res)
    lines = table.splitlines()
    assert lines[0].split() == ["workload", "op", "tdz_numba", "torch", bench.CRC_FORMAT]
    assert "10.0 ms (1.0x)" in lines[2] and "25.0 ms (2.5x)" in lines[2]
    assert "4.00 ms (1.0x)" in lines[3] and "8.00 ms (2.0x)" in lines[3] and " - " in lines[3]


# -- info / tree / verify ----------------------------------------------------------------------


def test_cli_import_is_light():
    code = "import sys, tdz_numba.cli; print('torch' in sys.modules, 'numba' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.split() == ["False", "False"]


def test_info(archive, capsys):
    assert cli.main(["info", str(archive)]) == 0
    out = capsys.readouterr().out
    assert "TensorDict" in out and "stored x" in out
    assert "all 3 .memmap payloads 64-byte aligned" in out
    assert cli.main(["info", str(archive), "--json"]) == 0
    d = json.loads(capsys.readouterr().out)
    assert d["leaves"] == 3 and d["root_type"] == "TensorDict" and d["all_aligned"] is True
    assert d["file_bytes"] == archive.stat().st_size
    assert d["payload_bytes"] >= 4 * 3 * 8 * 8 + 4 * 8 * 8 * 4 + 5 * 8
    assert set(d["compression"]) == {"stored"} and sum(d["compression"].values()) == d["entries"]


def test_info_compressed_is_not_aligned(tmp_path, capsys):
    p = tdz_numba.save({"a": torch.zeros(1000)}, tmp_path / "c.tdz", compression="deflate")
    assert cli.main(["info", str(p), "--json"]) == 0
    d = json.loads(capsys.readouterr().out)
    assert d["compression"] == {"stored": 1, "deflate": 1}
    assert d["stored_bytes"] < d["payload_bytes"]


def test_tree(archive, capsys):
    assert cli.main(["tree", str(archive)]) == 0
    out = capsys.readouterr().out
    lines = out.splitlines()
    assert "TensorDict" in lines[0]
    pixels = next(line for line in lines if "pixels" in line)
    assert pixels.startswith("  ") and "uint8" in pixels and "[4, 3, 8, 8]" in pixels
    assert "768 B" in pixels and "stored" in pixels
    assert any("reward" in line and "float64" in line and "40 B" in line for line in lines)
    assert any("env" in line and "'cartpole'" in line for line in lines)

    assert cli.main(["tree", str(archive), "--depth", "1"]) == 0
    out = capsys.readouterr().out
    assert "pixels" not in out and "obs/" in out and "2 keys" in out and "reward" in out

    assert cli.main(["tree", str(archive), "obs", "--json"]) == 0
    d = json.loads(capsys.readouterr().out)
    assert d["kind"] == "level" and [c["key"] for c in d["children"]] == ["pixels", "depth"]
    depth = d["children"][1]
    assert depth["dtype"] == "float32" and depth["shape"] == [4, 8, 8] and depth["nbytes"] == 1024
    assert depth["codec"] == "stored" and depth["path"] == "obs/depth"

    assert cli.main(["tree", str(archive), "obs/pixels"]) == 0
    assert "obs/pixels" in capsys.readouterr().out

    assert cli.main(["tree", str(archive), "obs/nope"]) == 2
    err = capsys.readouterr().err
    assert "nope" in err and len(err.strip().splitlines()) == 1


def test_verify_ok(archive, capsys):
    assert cli.main(["verify", str(archive)]) == 0
    assert "OK" in capsys.readouterr().out
    assert cli.main(["verify", str(archive), "--json"]) == 0
    d = json.loads(capsys.readouterr().out)
    assert d["ok"] is True and d["leaves"] == 3


def test_verify_corrupted_exits_1(archive, capsys):
    _corrupt(archive, "obs/depth")
    assert cli.main(["verify", str(archive)]) == 1
    captured = capsys.readouterr()
    assert "obs/depth.memmap" in captured.err and "CRC" in captured.err
    assert "Traceback" not in captured.err and len(captured.err.strip().splitlines()) == 1
    # the real process: exit status, JSON on stdout, one line on stderr
    proc = _run("verify", archive, "--json")
    assert proc.returncode == 1, proc.stderr
    d = json.loads(proc.stdout)
    assert d["ok"] is False and d["error_type"] == "ChecksumError" and "obs/depth.memmap" in d["error"]
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("tdz verify: ") and "obs/depth.memmap" in lines[0]


@pytest.mark.parametrize("command", ["info", "tree", "verify"])
def test_not_an_archive_exits_2(tmp_path, command, capsys):
    junk = tmp_path / "junk.tdz"
    junk.write_bytes(b"this is not a zip file at all" * 4)
    assert cli.main([command, str(junk)]) == 2
    captured = capsys.readouterr()
    err = captured.err.strip().splitlines()
    assert len(err) == 1 and "junk.tdz" in err[0] and "Traceback" not in captured.err
    assert cli.main([command, str(tmp_path / "missing.tdz")]) == 2
    assert "no such file" in capsys.readouterr().err.lower()


def test_not_an_archive_subprocess(tmp_path, capsys):
    junk = tmp_path / "junk.bin"
    junk.write_bytes(b"\0" * 100)
    proc = _run("info", junk)
    assert proc.returncode == 2
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("tdz info: ") and "junk.bin" in lines[0]
    assert cli.main(["--debug", "info", str(junk)]) == 2
    assert "Traceback" in capsys.readouterr().err


def test_usage_errors_exit_2(capsys):
    assert cli.main([]) == 2
    assert cli.main(["info"]) == 2
    assert cli.main(["frobnicate"]) == 2
    assert cli.main(["tree", "x.tdz", "--depth", "-1"]) == 2
    capsys.readouterr()
    assert cli.main(["--help"]) == 0
    assert "bench" in capsys.readouterr().out
