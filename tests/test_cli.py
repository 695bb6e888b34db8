"""The ``tdz`` verbs end to end: info, tree, show, verify, pack, unpack, refresh.

Every verb runs once as a real process (``python -m tdz_numba ...``). Each process
imports torch (a few seconds), so the processes of one stage run concurrently, in
a module fixture, and the tests below check their outputs; variations run
in-process through :func:`tdz_numba.cli.main`.
"""

import json
import math
import os
import shutil
import subprocess
import sys
import warnings

import numpy as np
import pytest
import torch

import tdz_numba
import tdz_numba.cli.report
from tdz_numba import cli
from tdz_numba.cli import commands
from tdz_numba.files import progress

LEAF_KEYS = {"obs/pixels", "obs/depth", "obs/nested/flag", "reward", "index", "ragged"}


def _tree():
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # nested tensors are a prototype
        ragged = torch.nested.nested_tensor(
            [torch.arange(6.0).reshape(2, 3), torch.arange(3.0).reshape(1, 3)]
        )
    return {
        "obs": {
            "pixels": torch.arange(4 * 3 * 8 * 8).to(torch.uint8).reshape(4, 3, 8, 8),
            "depth": np.linspace(0, 1, 4 * 8 * 8, dtype=np.float32).reshape(4, 8, 8),
            "nested": {"flag": torch.tensor([True, False, True, True])},
        },
        "reward": torch.tensor([1.0, float("nan"), 3.0, 4.0, 5.0], dtype=torch.float64),
        "index": torch.tensor([-5, 7, 2**40], dtype=torch.int64),
        "ragged": ragged,
        "env": "cartpole",
    }


def _corrupt(path, key):
    with tdz_numba.open(path) as ar:
        off = ar.info(key).offset
    data = bytearray(path.read_bytes())
    data[off + 3] ^= 0xFF
    path.write_bytes(bytes(data))


def _cmd(*args):
    return [sys.executable, "-m", "tdz_numba", *map(str, args)]


def _run_all(commands, timeout=240):
    """Runs {name: argv} concurrently; returns {name: CompletedProcess}."""
    procs = {
        name: subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        for name, argv in commands.items()
    }
    out = {}
    for name, p in procs.items():
        stdout, stderr = p.communicate(timeout=timeout)
        out[name] = subprocess.CompletedProcess(p.args, p.returncode, stdout, stderr)
    return out


def _run_on_pty_async(argv, timeout=240):
    """Starts argv with stderr on an 80-column pseudo-terminal; returns a function that
    waits and gives a CompletedProcess whose ``stderr`` is the terminal's text."""
    import fcntl
    import pty
    import struct
    import termios
    import threading

    master, slave = pty.openpty()
    fcntl.ioctl(slave, termios.TIOCSWINSZ, struct.pack("HHHH", 24, 80, 0, 0))
    try:
        p = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=slave, text=True)
    finally:
        os.close(slave)
    chunks = []

    def drain():
        while True:
            try:
                data = os.read(master, 65536)
            except OSError:  # EIO: the child closed the terminal
                return
            if not data:
                return
            chunks.append(data)

    reader = threading.Thread(target=drain, daemon=True)
    reader.start()

    def wait():
        stdout, _ = p.communicate(timeout=timeout)
        reader.join(timeout)
        os.close(master)
        return subprocess.CompletedProcess(
            argv, p.returncode, stdout, b"".join(chunks).decode("utf-8", "replace")
        )

    return wait


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    d = tmp_path_factory.mktemp("cli")
    f = {"dir": d}
    f["plain"] = tdz_numba.save(_tree(), d / "plain.tdz")
    f["deflate"] = tdz_numba.save(_tree(), d / "deflate.tdz", compression="deflate")
    f["corrupt"] = tdz_numba.save(_tree(), d / "corrupt.tdz")
    _corrupt(f["corrupt"], "obs/depth")
    f["junk"] = d / "junk.tdz"
    f["junk"].write_bytes(b"this is not a zip file at all" * 4)
    f["rw"] = tdz_numba.save(_tree(), d / "rw.tdz")
    with tdz_numba.open(f["rw"], mode="r+") as ar:
        depth, index = ar["obs/depth"], ar["index"]
    depth.add_(1)  # written after close (close re-stamps what was written before it)
    index[0] = 42
    f["unpacked"] = d / "unpacked"
    f["packed"] = d / "packed.tdz"
    return f


@pytest.fixture(scope="module")
def runs(files):
    """Every verb as a real process, concurrently, in three stages (pack needs the
    unpacked directory, the last verify the refreshed file)."""
    f = files
    pty_run = _run_on_pty_async(_cmd("verify", f["plain"], "--json")) if sys.platform != "win32" else None
    res = _run_all(
        {
            "info": _cmd("info", f["plain"], "--json"),
            "tree": _cmd("tree", f["plain"], "--json"),
            "show": _cmd("show", f["deflate"], "reward"),
            "verify_corrupt": _cmd("verify", f["corrupt"]),
            "junk": _cmd("info", f["junk"]),
            "unpack": _cmd("unpack", f["plain"], f["unpacked"]),
            "refresh": _cmd("refresh", f["rw"]),
        }
    )
    if pty_run is not None:
        res["verify_tty"] = pty_run()
    res.update(
        _run_all(
            {
                "pack": _cmd("pack", f["unpacked"], f["packed"], "--compression", "deflate", "--progress"),
                "verify_refreshed": _cmd("verify", f["rw"], "--json"),
            }
        )
    )
    return res


def _ok(proc):
    assert proc.returncode == 0, f"{proc.args}: exit {proc.returncode}\n{proc.stderr[-3000:]}"
    return proc


# -- read-only verbs (real processes) ---------------------------------------------------------------


def test_info_json(runs, files):
    d = json.loads(_ok(runs["info"]).stdout)
    assert d["leaves"] == len(LEAF_KEYS) and d["root_type"] == "TensorDict"
    assert d["file_bytes"] == files["plain"].stat().st_size and d["all_aligned"] is True
    assert d["compression"] == {"stored": d["entries"]}


def _walk(node, out):
    if node["kind"] == "leaf":
        out[node["path"]] = node
    for child in node.get("children") or []:
        _walk(child, out)
    return out


def test_tree_json(runs):
    d = json.loads(_ok(runs["tree"]).stdout)
    assert d["kind"] == "level" and d["type"] == "TensorDict"
    leaves = _walk(d, {})
    assert set(leaves) == LEAF_KEYS
    assert leaves["obs/pixels"]["dtype"] == "uint8" and leaves["obs/pixels"]["shape"] == [4, 3, 8, 8]
    assert leaves["obs/depth"]["dtype"] == "float32" and leaves["obs/depth"]["nbytes"] == 4 * 8 * 8 * 4
    assert leaves["obs/nested/flag"]["dtype"] == "bool" and leaves["ragged"]["nested"] is True
    assert all(leaf["codec"] == "stored" for leaf in leaves.values())
    env = next(c for c in d["children"] if c["key"] == "env")
    assert env["kind"] == "value" and env["value"] == "cartpole"


def test_tree_text_deflate(files, capsys):
    assert cli.main(["tree", str(files["deflate"])]) == 0
    out = capsys.readouterr().out
    pixels = next(line for line in out.splitlines() if "pixels" in line)
    assert "uint8" in pixels and "[4, 3, 8, 8]" in pixels and "deflate" in pixels and "B stored" in pixels


def test_show_json(files, capsys):
    assert cli.main(["show", str(files["plain"]), "obs/depth", "--json"]) == 0
    d = json.loads(capsys.readouterr().out)
    depth = np.linspace(0, 1, 256, dtype=np.float32).astype(np.float64)
    assert d["key"] == "obs/depth" and d["entry"] == "obs/depth.memmap" and d["kind"] == "leaf"
    assert d["dtype"] == "float32" and d["shape"] == [4, 8, 8] and d["numel"] == 256
    assert d["nbytes"] == d["stored_nbytes"] == 1024 and d["compression"] == "stored"
    assert d["offset"] % 64 == 0 and d["aligned"] is True and d["zero_copy"] is True
    assert d["crc"].startswith("0x") and len(d["crc"]) == 10
    assert d["values"] == depth[:8].tolist()
    st = d["stats"]
    assert st["nan"] == 0 and st["count"] == 256
    assert st["min"] == 0.0 and st["max"] == 1.0
    assert math.isclose(st["mean"], depth.mean()) and math.isclose(st["std"], depth.std())


def test_show_text_deflate(runs):
    out = _ok(runs["show"]).stdout
    rows = dict(line.split(":", 1) for line in out.splitlines())
    rows = {k.strip(): v.strip() for k, v in rows.items()}
    assert rows["key"] == "reward" and rows["entry"] == "reward.memmap" and rows["dtype"] == "float64"
    assert rows["compression"] == "deflate" and rows["zero-copy"] == "no"
    assert rows["values"] == "[1.0, nan, 3.0, 4.0, 5.0]"
    assert rows["nan"] == "1" and rows["min"] == "1.0" and rows["max"] == "5.0" and rows["mean"] == "3.25"


@pytest.mark.skipif(sys.platform == "win32", reason="needs a pseudo-terminal")
def test_verify_ok_with_a_bar_on_the_terminal(runs):
    p = _ok(runs["verify_tty"])
    d = json.loads(p.stdout)
    assert d["ok"] is True and d["leaves"] == len(LEAF_KEYS) and d["levels"] == 4
    assert "verify" in p.stderr and "100%" in p.stderr  # the bar, drawn because stderr is a terminal


def test_verify_deflate_no_bar_on_a_pipe(files, capsys):
    assert cli.main(["verify", str(files["deflate"])]) == 0
    captured = capsys.readouterr()
    assert "OK" in captured.out and captured.err == ""  # stderr is not a terminal: no bar


def test_verify_corrupt_names_the_entry(runs):
    p = runs["verify_corrupt"]
    assert p.returncode == 1
    lines = p.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("tdz verify: ") and "obs/depth.memmap" in lines[0]
    assert "CRC" in lines[0] and "Traceback" not in p.stderr and p.stdout == ""


def test_not_an_archive(runs, files, capsys):
    p = runs["junk"]
    assert p.returncode == 2 and p.stdout == ""
    lines = p.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("tdz info: ") and "junk.tdz" in lines[0]
    assert "Traceback" not in p.stderr
    for verb in ("tree", "show", "verify", "unpack", "refresh"):
        args = {"show": ["key"], "unpack": [str(files["dir"] / "never")]}.get(verb, [])
        assert cli.main([verb, str(files["junk"]), *args]) == 2, verb
        err = capsys.readouterr().err
        assert len(err.strip().splitlines()) == 1 and "junk.tdz" in err and "Traceback" not in err
    assert not (files["dir"] / "never").exists()
    assert cli.main(["--debug", "tree", str(files["junk"])]) == 2
    err = capsys.readouterr().err
    assert "Traceback" in err and "junk.tdz" in err.strip().splitlines()[-1]


# -- writing verbs (real processes) -----------------------------------------------------------------


def _assert_same(a, b):
    assert set(a) == set(b)
    for k, v in a.items():
        if isinstance(v, dict):
            _assert_same(v, b[k])
        elif isinstance(v, torch.Tensor) and v.is_nested:
            assert all(torch.equal(x, y) for x, y in zip(v.unbind(), b[k].unbind(), strict=True))
        elif isinstance(v, torch.Tensor):
            assert v.dtype == b[k].dtype and torch.equal(v.nan_to_num(), b[k].nan_to_num())
        else:
            assert v == b[k]


def test_unpack_pack_round_trip(runs, files):
    out = _ok(runs["unpack"]).stdout
    assert str(files["unpacked"]) in out and "unpacked" in out
    assert (files["unpacked"] / "meta.json").is_file()
    assert (files["unpacked"] / "obs" / "depth.memmap").stat().st_size == 1024
    p = _ok(runs["pack"])
    assert str(files["packed"]) in p.stdout and "deflate" in p.stdout
    assert "pack" in p.stderr and "100%" in p.stderr  # --progress forces the bar
    _assert_same(tdz_numba.load(files["plain"]), tdz_numba.load(files["packed"]))
    with tdz_numba.open(files["packed"]) as ar:
        assert ar.info("obs/depth").compression == "deflate"
    tdz_numba.verify(files["packed"])


def test_refresh_after_rw_write(runs, files, tmp_path, capsys):
    assert "re-stamped" in _ok(runs["refresh"]).stdout
    d = json.loads(_ok(runs["verify_refreshed"]).stdout)
    assert d["ok"] is True
    back = tdz_numba.load(files["rw"])
    assert int(back["index"][0]) == 42 and float(back["obs"]["depth"].min()) == 1.0
    # the same in-process: a write through mode="r+" fails verify until refresh
    p = tdz_numba.save({"a": torch.zeros(8), "b": {"c": torch.ones(3)}}, tmp_path / "w.tdz")
    with tdz_numba.open(p, mode="r+") as ar:
        c = ar["b/c"]
    c.mul_(3)  # after close: stale until refreshed
    assert cli.main(["verify", str(p)]) == 1
    assert "b/c.memmap" in capsys.readouterr().err
    assert cli.main(["refresh", str(p)]) == 0 and "4 stored entries" in capsys.readouterr().out
    assert cli.main(["verify", str(p)]) == 0 and "OK" in capsys.readouterr().out
    assert tdz_numba.load(p)["b"]["c"].tolist() == [3.0, 3.0, 3.0]


# -- in-process variations --------------------------------------------------------------------------


def _main(capsys, *args):
    code = cli.main([str(a) for a in args])
    captured = capsys.readouterr()
    return code, captured.out, captured.err


def test_show_dtypes(files, capsys):
    path = files["plain"]
    code, out, _ = _main(capsys, "show", path, "obs/nested/flag", "--json")
    d = json.loads(out)
    assert code == 0 and d["dtype"] == "bool" and d["values"] == [True, False, True, True]
    assert d["stats"] == {"count": 4, "min": False, "max": True, "mean": 0.75}
    code, out, _ = _main(capsys, "show", path, "index", "--json")
    d = json.loads(out)
    assert d["stats"]["min"] == -5 and d["stats"]["max"] == 2**40 and d["values"] == [-5, 7, 2**40]
    code, out, _ = _main(capsys, "show", path, "reward", "--json")
    d = json.loads(out)  # strict JSON: NaN as a string
    assert d["values"][1] == "nan" and d["stats"]["nan"] == 1 and d["stats"]["count"] == 4
    assert math.isclose(d["stats"]["mean"], 3.25) and math.isclose(d["stats"]["std"], np.std([1, 3, 4, 5]))
    code, out, _ = _main(capsys, "show", path, "ragged", "--json")
    d = json.loads(out)
    assert d["nested"] is True and d["nested_shapes"] == [[2, 3], [1, 3]] and d["numel"] == 9
    assert d["values"] == [0.0, 1.0, 2.0, 3.0, 4.0, 5.0, 0.0, 1.0] and d["stats"]["max"] == 5.0
    code, out, _ = _main(capsys, "show", path, "obs/pixels", "--values", "3")
    assert code == 0 and "[0, 1, 2] ... (765 more)" in out and "mean:" in out and "nan:" not in out
    code, out, _ = _main(capsys, "show", path, "env")
    assert code == 0 and "'cartpole'" in out


def test_show_float_stats_chunked(tmp_path, capsys, monkeypatch):
    monkeypatch.setattr(tdz_numba.cli.report, "_STATS_CHUNK", 7)  # exercise the chunk merge
    x = torch.randn(1000, dtype=torch.float32)
    x[::97] = float("nan")
    p = tdz_numba.save({"x": x, "h": x.to(torch.bfloat16), "e": torch.zeros(0)}, tmp_path / "f.tdz")
    _, out, _ = _main(capsys, "show", p, "x", "--json")
    st = json.loads(out)["stats"]
    ref = x[~x.isnan()].double()
    assert st["nan"] == int(x.isnan().sum()) and st["count"] == ref.numel()
    assert st["min"] == ref.min().item() and st["max"] == ref.max().item()
    assert math.isclose(st["mean"], ref.mean().item(), rel_tol=1e-9, abs_tol=1e-12)
    assert math.isclose(st["std"], ref.std(correction=0).item(), rel_tol=1e-9)
    _, out, _ = _main(capsys, "show", p, "h", "--json")
    assert json.loads(out)["dtype"] == "bfloat16"
    _, out, _ = _main(capsys, "show", p, "e", "--json")
    d = json.loads(out)
    assert d["values"] == [] and d["stats"]["min"] is None and d["offset"] is None


def test_show_errors(files, capsys):
    code, _, err = _main(capsys, "show", files["plain"], "obs")
    assert code == 2 and "is a level" in err and len(err.strip().splitlines()) == 1
    code, _, err = _main(capsys, "show", files["plain"], "obs/nope")
    assert code == 2 and "nope" in err and len(err.strip().splitlines()) == 1
    code, _, err = _main(capsys, "show", files["plain"], "reward", "--values", "-1")
    assert code == 2 and "--values" in err
    code, _, err = _main(capsys, "show", files["corrupt"], "obs/depth")
    assert code == 0  # show reads the mapping; only verify (and inflation) check CRCs


def test_pack_unpack_errors(files, tmp_path, capsys):
    code, _, err = _main(capsys, "pack", tmp_path / "missing", tmp_path / "x.tdz")
    assert code == 2 and "not a directory" in err and len(err.strip().splitlines()) == 1
    empty = tmp_path / "empty"
    empty.mkdir()
    code, _, err = _main(capsys, "pack", empty, tmp_path / "x.tdz")
    assert code == 2 and "meta.json" in err and "Traceback" not in err
    code, _, err = _main(capsys, "pack", empty, tmp_path / "x.tdz", "--compression", "zstd")
    assert code == 2 and "invalid choice" in err
    code, _, err = _main(capsys, "unpack", files["junk"], tmp_path / "out")
    assert code == 2 and "junk.tdz" in err and len(err.strip().splitlines()) == 1
    code, _, err = _main(capsys, "refresh", files["junk"])
    assert code == 2 and "junk.tdz" in err
    code, _, err = _main(capsys, "unpack", files["corrupt"], tmp_path / "out2")
    assert code == 1 and "obs/depth.memmap" in err  # a CRC mismatch is a failed check


def test_pack_unpack_in_process(files, tmp_path, capsys):
    for codec in ("stored", "bzip2", "lzma"):
        out = tmp_path / f"{codec}.tdz"
        code, _, err = _main(capsys, "pack", files["unpacked"], out, "--compression", codec, "--no-progress")
        assert code == 0 and err == ""
        with tdz_numba.open(out) as ar:
            assert ar.info("obs/pixels").compression == codec
        _assert_same(tdz_numba.load(files["plain"]), tdz_numba.load(out))
    d = tmp_path / "again"
    code, out, _ = _main(capsys, "unpack", tmp_path / "lzma.tdz", d)
    assert code == 0 and (d / "obs" / "pixels.memmap").read_bytes() == bytes(range(256)) * 3
    shutil.rmtree(d)


def test_verify_progress_flag(files, capsys, monkeypatch):
    code, out, err = _main(capsys, "verify", files["plain"], "--progress")
    assert code == 0 and "OK" in out and "100%" in err and "verify" in err
    monkeypatch.setattr(commands, "stderr_is_tty", lambda: True)
    code, out, err = _main(capsys, "verify", files["plain"])
    assert code == 0 and "100%" in err
    code, out, err = _main(capsys, "verify", files["plain"], "--no-progress")
    assert code == 0 and err == ""
    code, out, err = _main(capsys, "verify", files["corrupt"], "--json")
    assert code == 1 and json.loads(out)["ok"] is False and "obs/depth.memmap" in err


def test_help_of_every_verb(capsys):
    for verb in ("info", "tree", "show", "verify", "pack", "unpack", "refresh"):
        assert cli.main([verb, "--help"]) == 0
        out = capsys.readouterr().out
        assert out.startswith(f"usage: tdz {verb} ")
        if verb in ("pack", "unpack", "verify", "refresh"):
            assert "--progress" in out and "--no-progress" in out
        if verb in ("info", "tree", "show", "verify"):
            assert "--json" in out
    assert cli.main(["pack", "--help"]) == 0
    assert "stored,deflate,bzip2,lzma" in capsys.readouterr().out.replace(" ", "").replace("\n", "")


# -- the progress helper ----------------------------------------------------------------------------


def test_progress_disabled_counts():
    with progress.progress(100, "x", enabled=False) as bar:
        bar.update(30)
        bar(20)
        assert not bar.enabled
        bar.finish()
    assert bar.n == 100 and bar.total == 100


def test_progress_enabled_draws_a_bar(capsys):
    pytest.importorskip("tqdm")
    with progress.progress(2048, "copy", enabled=True) as bar:
        assert bar.enabled
        bar.update(2048)
    err = capsys.readouterr().err
    assert "copy" in err and "100%" in err and "2.00k" in err


def test_progress_follows_the_terminal(monkeypatch, capsys):
    pytest.importorskip("tqdm")

    class FakeTTY:
        def __init__(self):
            self.text = ""

        def isatty(self):
            return True

        def write(self, s):
            self.text += s

        def flush(self):
            pass

    with progress.progress(10, "auto") as bar:  # stderr is captured: not a terminal
        assert not bar.enabled
    fake = FakeTTY()
    monkeypatch.setattr(sys, "stderr", fake)
    assert progress.stderr_is_tty()
    with progress.progress(10, "auto") as bar:
        assert bar.enabled
        bar.update(10)
    assert "auto" in fake.text and "100%" in fake.text
    monkeypatch.setattr(sys, "stderr", None)
    assert not progress.stderr_is_tty()


def test_progress_without_tqdm_is_a_no_op(monkeypatch):
    monkeypatch.setitem(sys.modules, "tqdm", None)  # import tqdm -> ImportError
    with progress.progress(10, "x", enabled=True) as bar:
        bar.update(5)
    assert not bar.enabled and bar.n == 5


def test_progress_erases_the_bar_on_error(capsys):
    pytest.importorskip("tqdm")
    with pytest.raises(RuntimeError), progress.progress(10, "boom", enabled=True) as bar:
        bar.update(3)
        raise RuntimeError("x")
    assert not bar.enabled  # closed


# -- the notebook repr ------------------------------------------------------------------------------


def test_archive_repr_html(files, tmp_path):
    with tdz_numba.open(files["deflate"]) as ar:
        html = ar._repr_html_()
        assert html.startswith('<div class="tdz-archive">') and html.count("<details") == 3
        for text in (
            "TensorDict",
            "pixels",
            "uint8",
            "[4, 3, 8, 8]",
            "768 B",
            "deflate",
            "&#x27;cartpole&#x27;",
            "nested",
            "flag",
        ):
            assert text in html, text
        sub = ar["obs"]._repr_html_()
        assert "obs" in sub and "depth" in sub and "reward" not in sub
    assert ar._repr_html_().startswith("<pre>")  # closed: the plain repr
    tree = {"<script>": torch.zeros(1)}
    tree |= {f"g{i}": {f"k{j}": torch.zeros(1) for j in range(30)} for i in range(30)}
    p = tdz_numba.save(tree, tmp_path / "big.tdz")
    with tdz_numba.open(p) as ar:
        html = ar._repr_html_()
        assert html.count("<tr>") < 500 and "more keys" in html
        assert "<script>" not in html and "&lt;script&gt;" in html
        assert ar._repr_html_(max_rows=5).count("<tr>") <= 5


# -- every format, convert -------------------------------------------------------------------


def test_cli_reads_every_format_and_converts(tmp_path, capsys):
    st = pytest.importorskip("safetensors.torch")
    src = tmp_path / "m.safetensors"
    st.save_file(
        {"model.w": torch.arange(6.0).reshape(2, 3), "model.b": torch.ones(2)},
        str(src),
        metadata={"author": "me"},
    )
    code, out, _ = _main(capsys, "info", src)
    assert code == 0 and "safetensors" in out and "2 of 2 leaves" in out and "author" in out
    code, out, _ = _main(capsys, "tree", src, "--json")
    assert code == 0 and [c["key"] for c in json.loads(out)["children"]] == ["model.b", "model.w"]
    code, out, _ = _main(capsys, "show", src, "model.w", "--json")
    assert code == 0 and json.loads(out)["values"][:3] == [0.0, 1.0, 2.0] and json.loads(out)["zero_copy"]
    code, out, _ = _main(capsys, "verify", src)
    assert code == 0 and "2 leaves" in out
    dst = tmp_path / "m.tdz"
    code, out, _ = _main(capsys, "convert", src, dst, "--nest", ".")  # keys are kept unless --nest
    assert code == 0 and "converted" in out
    with tdz_numba.open(dst) as ar:
        assert list(ar) == ["model"] and torch.equal(ar["model/w"], torch.arange(6.0).reshape(2, 3))
        assert ar.metadata == {"author": "me"}
    if shutil.which("unzip"):
        assert subprocess.run(["unzip", "-tq", str(dst)], capture_output=True).returncode == 0
    code, _, _ = _main(capsys, "convert", src, tmp_path / "flat.tdz", "--flat", "--compression", "deflate")
    assert code == 0 and "model.w" in tdz_numba.load(tmp_path / "flat.tdz")
    code, _, _ = _main(capsys, "convert", dst, tmp_path / "back.safetensors")
    assert code == 0 and torch.equal(
        st.load_file(str(tmp_path / "back.safetensors"))["model.w"], torch.arange(6.0).reshape(2, 3)
    )
    code, _, err = _main(capsys, "convert", tmp_path / "missing.pt", dst)
    assert code == 2 and "missing.pt" in err
