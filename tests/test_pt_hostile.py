"""Hostile torch .pt files: every op ends in a clear TdzError (or a read), never a crash or a hang.

Each hostile seed is written here, deterministically, and every op (open and
read every leaf, ``load``, ``convert``, ``tdz info``) runs on it in a child
process with an address-space limit (RLIMIT_AS) and a timeout, so that a
segfault, a MemoryError or a hang fails the test instead of killing pytest.
The seeds are the hostile classes issue 23 found: tuples a million levels
deep used as a dict key or put in a (frozen)set (Python's recursive hash),
lists and dicts as deep, pickles of 15 MB of one-byte opcodes (a hang), a
dict key with a lone surrogate, a (10**9,) view of one element with stride 0,
sets of tensors and tuple keys. Then the mutation fuzz of ``.pt`` files, which
must accept a share of its mutants (else it only tests the refusals).
"""

from __future__ import annotations

import io
import json
import os
import pickle
import subprocess
import sys
import textwrap
import zipfile
from collections import OrderedDict
from pathlib import Path

import pytest
import torch

import tdz_numba

ROOT = Path(__file__).resolve().parents[1]
DEEP = 1_000_000  # tuples: refused when built, 2,000 levels down
DEEP_MUTABLE = 100_000  # lists and dicts: refused by the walk of the finished object
BIG = 15_000_000


# -- writing .pt zips around a chosen pickle ---------------------------------------------------------
class _S:
    """A storage stand-in: pickled as the persistent id torch writes."""

    def __init__(self, key, cls, numel):
        self.pid = ("storage", cls, key, "cpu", numel)


class _T:
    """A tensor stand-in: reduces to torch's own rebuild function with chosen arguments."""

    def __init__(self, storage, offset, size, stride):
        self.args = (storage, offset, size, stride, False, OrderedDict())

    def __reduce__(self):
        return (torch._utils._rebuild_tensor_v2, self.args)


def _dumps(obj, protocol=2) -> bytes:
    buf = io.BytesIO()
    p = pickle.Pickler(buf, protocol=protocol)
    p.persistent_id = lambda o: o.pid if isinstance(o, _S) else None
    p.dump(obj)
    return buf.getvalue()


def write_pt(path: Path, pkl: bytes, storages: dict | None = None) -> Path:
    with zipfile.ZipFile(path, "w", zipfile.ZIP_STORED) as z:
        z.writestr("archive/data.pkl", pkl)
        z.writestr("archive/byteorder", b"little")
        for key, raw in (storages or {}).items():
            z.writestr(f"archive/data/{key}", raw)
        z.writestr("archive/version", b"3\n")
    return path


def _key(name: str) -> bytes:
    raw = name.encode()
    return b"X" + len(raw).to_bytes(4, "little") + raw


def _get(i: int) -> bytes:
    return b"j" + i.to_bytes(4, "little")


#: name -> the pickle (protocol 2 unless it says 4): each builds {"a": <hostile value>} or worse
PICKLES = {
    "deep_tuple_key": b"\x80\x02}N" + b"\x85" * DEEP + b"K\x01s.",
    "deep_tuple_frozenset": b"\x80\x04}" + _key("a") + b"(N" + b"\x85" * DEEP + b"\x91s.",
    "deep_tuple_set_reduce": b"\x80\x02}" + _key("a") + b"cbuiltins\nset\n]N" + b"\x85" * DEEP + b"a\x85Rs.",
    "deep_tuple_additems": b"\x80\x04}" + _key("a") + b"\x8f(N" + b"\x85" * DEEP + b"\x90s.",
    "deep_tuple_value": b"\x80\x02}" + _key("a") + b"N" + b"\x85" * DEEP + b"s.",
    "deep_mark_tuple": b"\x80\x02}" + _key("a") + b"(" * DEEP_MUTABLE + b")" + b"t" * DEEP_MUTABLE + b"s.",
    "deep_list": b"\x80\x02}" + _key("a") + b"]" * DEEP_MUTABLE + b"a" * (DEEP_MUTABLE - 1) + b"s.",
    "deep_dict": b"\x80\x02}" + _key("a") + b"}" + b"K\x01}" * DEEP_MUTABLE + b"s" * DEEP_MUTABLE + b"s.",
    "deep_list_grown_later": (  # each list shallow when built, one chain after APPENDs via the memo
        b"\x80\x02}"
        + _key("a")
        + b"".join(b"]r" + i.to_bytes(4, "little") + b"0" for i in range(DEEP_MUTABLE))
        + b"".join(_get(i) + _get(i + 1) + b"a0" for i in range(DEEP_MUTABLE - 1))
        + _get(0)
        + b"s."
    ),
    "many_dups": b"\x80\x02}" + _key("a") + b"N" + b"2" * BIG + b"(ls.",
    "many_empty_sets": b"\x80\x04}" + _key("a") + b"(" + b"\x8f" * BIG + b"ls.",
    "many_binput_same": b"\x80\x02}" + _key("a") + b"N" + b"q\x00" * (BIG // 2) + b"s.",
    "many_memoize": b"\x80\x04}" + _key("a") + b"N" + b"\x94" * BIG + b"s.",
    "many_marks": b"\x80\x02}" + _key("a") + b"(" * BIG + b"s.",
    "many_binputs": b"\x80\x02}"
    + _key("a")
    + b"N"
    + b"".join(b"r" + i.to_bytes(4, "little") for i in range(BIG // 5))
    + b"s.",
}


def _tensors_pt(path: Path, obj, storages) -> Path:
    return write_pt(path, _dumps(obj), storages)


def make_seeds(d: Path) -> dict[str, Path]:
    """Every hostile seed, written under ``d``."""
    out = {name: write_pt(d / f"{name}.pt", pkl) for name, pkl in PICKLES.items()}
    s = _S("0", torch.FloatStorage, 1)
    out["stride0_1e9"] = _tensors_pt(d / "stride0.pt", {"big": _T(s, 0, (10**9,), (0,))}, {"0": bytes(4)})
    out["stride0_many"] = _tensors_pt(  # each below the limit, together far above
        d / "stride0_many.pt", {f"t{i}": _T(s, 0, (10**8,), (0,)) for i in range(40)}, {"0": bytes(4)}
    )
    out["surrogate_key"] = d / "surrogate.pt"
    torch.save({"ok": torch.ones(2), "a\udc80b": torch.zeros(1)}, out["surrogate_key"])
    out["set_of_tensors"] = d / "tset.pt"
    torch.save({"s": {torch.ones(1)}}, out["set_of_tensors"])
    out["tuple_key"] = d / "tkey.pt"
    torch.save({(1, "x"): torch.ones(1)}, out["tuple_key"])
    out["self_list"] = write_pt(d / "self_list.pt", b"\x80\x02}" + _key("a") + b"]q\x00h\x00as.")
    return out


#: seed -> (error class every op must raise, words its message must hold)
EXPECTED = {name: ("BadArchiveError", "nested deeper") for name in PICKLES if name.startswith("deep")}
EXPECTED["many_dups"] = ("BadArchiveError", "on the stack")
EXPECTED["many_empty_sets"] = ("BadArchiveError", "on the stack")  # the largest item one opcode makes
EXPECTED["many_binput_same"] = ("BadArchiveError", "opcodes")  # nothing grows: the opcode budget
EXPECTED["many_memoize"] = ("BadArchiveError", "memo entries")
EXPECTED["many_marks"] = ("BadArchiveError", "on the stack")
EXPECTED["many_binputs"] = ("BadArchiveError", "memo entries")
EXPECTED["stride0_1e9"] = ("UnsupportedError", "'big'")
EXPECTED["stride0_many"] = ("UnsupportedError", "repeats the bytes")
EXPECTED["surrogate_key"] = ("UnsupportedError", "lone surrogate")
EXPECTED["set_of_tensors"] = ("UnsupportedError", "set of tensors")
EXPECTED["tuple_key"] = ("UnsupportedError", "dict key of type tuple")
EXPECTED["self_list"] = ("BadArchiveError", "contains itself")

_CHILD = textwrap.dedent(
    r"""
    import json, os, resource, sys, traceback
    limit = int(sys.argv[1]) << 20
    resource.setrlimit(resource.RLIMIT_AS, (limit, limit))
    jobs = json.loads(sys.argv[2])  # [[path, out_dir, [op, ...]], ...]
    import torch
    import tdz_numba
    from tdz_numba.errors import TdzError
    from tdz_numba import cli

    def read_all(path):
        with tdz_numba.open(path) as ar:
            stack = [ar]
            while stack:
                node = stack.pop()
                for k in node:
                    v = node[k]
                    if isinstance(v, torch.Tensor):
                        v.reshape(-1)[:1].sum() if v.numel() else None
                    elif hasattr(v, "keys"):
                        stack.append(v)

    OPS = {
        "open": lambda path, out: read_all(path),
        "load": lambda path, out: tdz_numba.load(path),
        "convert": lambda path, out: tdz_numba.convert(path, os.path.join(out, "out.tdz")),
        "info": lambda path, out: cli.main(["info", path]),
    }
    for path, out, names in jobs:
        result = {}
        for name in names:
            print(f"RUNNING {name} on {path}", flush=True)
            try:
                OPS[name](path, out)
                result[name] = ["ok", "", 0]
            except TdzError as exc:
                result[name] = [type(exc).__name__, str(exc)[:2000], len(str(exc))]
            except BaseException:
                traceback.print_exc()
                print(f"STRAY EXCEPTION in {name} on {path}", flush=True)
                sys.exit(3)
        print("RESULT " + json.dumps([path, result]), flush=True)
    """
)
ALL_OPS = ("open", "load", "convert", "info")


def run_ops(jobs: list, *, mem_mib: int = 3072, timeout: float = 900.0) -> dict:
    """Runs each job ``(path, out_dir, ops)`` in one child (RLIMIT_AS, timeout); returns
    path -> op -> [outcome, message, length]. A crash or a hang fails, naming the op and file."""
    env = dict(os.environ)
    env["PYTHONPATH"] = str(ROOT) + os.pathsep + env.get("PYTHONPATH", "")
    cmd = [
        sys.executable,
        "-c",
        _CHILD,
        str(mem_mib),
        json.dumps([[str(p), str(o), list(ops)] for p, o, ops in jobs]),
    ]
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=env)
    except subprocess.TimeoutExpired as e:
        out = e.stdout.decode() if isinstance(e.stdout, bytes) else (e.stdout or "")
        raise AssertionError(f"the ops hung (> {timeout} s): {out.splitlines()[-1:]}") from None
    assert proc.returncode == 0, (
        f"child exit {proc.returncode} (a negative code is a signal: -11 a segfault) "
        f"{[x for x in proc.stdout.splitlines() if x.startswith('RUNNING')][-1:]}\n"
        f"{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
    )
    rows = [json.loads(x[len("RESULT ") :]) for x in proc.stdout.splitlines() if x.startswith("RESULT ")]
    return {path: result for path, result in rows}


def _ops_for(name: str) -> tuple[str, ...]:
    # the seeds that spend a resource budget (a second or more each) run the open only
    return ("open",) if name.startswith("many") else ALL_OPS


@pytest.fixture(scope="module")
def results(tmp_path_factory) -> dict:
    """Every seed through its ops, in one child: seed name -> (path, op -> outcome)."""
    d = tmp_path_factory.mktemp("hostile_pt")
    seeds = make_seeds(d)
    jobs = []
    for name, path in seeds.items():
        (d / f"out_{name}").mkdir()
        jobs.append((path, d / f"out_{name}", _ops_for(name)))
    by_path = run_ops(jobs)
    return {name: (path, by_path[str(path)]) for name, path in seeds.items()}


@pytest.mark.parametrize("name", sorted(EXPECTED))
def test_hostile_seed_every_op(name, results):
    path, result = results[name]
    cls, words = EXPECTED[name]
    for op in _ops_for(name):
        if op == "info":  # prints the error and returns an exit status
            assert result["info"][0] in (cls, "ok"), result["info"]
            continue
        outcome, message, length = result[op]
        assert outcome == cls and words in message, (name, op, result[op])
        assert str(path) in message and length < 1000, (name, op, length)  # names the file, briefly
    assert not (path.parent / f"out_{name}" / "out.tdz").exists()  # convert left nothing behind


def test_legal_stride0_view_is_read(tmp_path):
    """A stride-0 view of a small storage is legal (torch reads it): open maps it, convert writes it."""
    p = tmp_path / "e.pt"
    torch.save({"e": torch.tensor([2.5]).expand(1000), "m": torch.arange(3.0)[:, None].expand(3, 500)}, p)
    ref = torch.load(p, weights_only=True)
    with tdz_numba.open(p) as ar:
        assert ar["e"].stride() == (0,) and torch.equal(ar["e"], ref["e"])
        assert ar["m"].stride() == ref["m"].stride() and torch.equal(ar["m"], ref["m"])
    back = tdz_numba.load(tdz_numba.convert(p, tmp_path / "e.tdz"))
    assert torch.equal(back["e"], ref["e"]) and torch.equal(back["m"], ref["m"])


def test_vm_bounds_are_checked_before_hashing():
    """In process: a deep tuple as a key is refused when built, before Python hashes it."""
    from tdz_numba.errors import BadArchiveError
    from tdz_numba.formats import pickle_vm

    depth = pickle_vm.MAX_NESTING + 5
    with pytest.raises(BadArchiveError, match="nested deeper"):
        pickle_vm.load(b"\x80\x02}N" + b"\x85" * depth + b"K\x01s.", lambda pid: None)
    ok = pickle_vm.load(b"\x80\x02}N" + b"\x85" * 100 + b"K\x01s.", lambda pid: None)
    (key,) = ok
    for _ in range(100):
        (key,) = key
    assert key is None
    with pytest.raises(BadArchiveError, match="opcodes"):
        pickle_vm.load(b"\x80\x02N" + b"q\x00" * (pickle_vm.MAX_OPS + 1) + b".", lambda pid: None)
    with pytest.raises(BadArchiveError, match="on the stack"):
        pickle_vm.load(b"\x80\x02(" + b"N" * (pickle_vm.MAX_STACK + 65536) + b"l.", lambda pid: None)


def test_fuzz_accepts_a_share_of_mutants(tmp_path):
    """The .pt mutation fuzz (tests/test_formats_fuzz.py's worker) finds no stray error, and
    reads a share of its mutants: mutators that only make garbage would test the refusals only."""
    from test_formats_fuzz import run_fuzz  # tests/ is on pytest's pythonpath

    report = run_fuzz(tmp_path, {"torch": 10.0}, master=23)
    assert not report["failures"], report["failures"][:3]
    counts = report["counts"]["torch"]
    print("pt fuzz outcomes:", counts)
    total = sum(counts.values())
    assert total >= 50, counts
    assert counts.get("ok", 0) >= 0.05 * total, counts
    assert counts.get("ok", 0) < total, counts


def test_fuzz_legacy_files(tmp_path):
    """Mutants of a legacy (non-zip) file: each opens and reads every leaf, or raises a TdzError."""
    from fuzz_readers import fuzz_iterations, run_fuzz

    seed = tmp_path / "seed.pt"
    x = torch.arange(12.0).reshape(3, 4)
    obj = {"x": x, "t": x.t(), "tail": x.reshape(-1)[5:], "b": torch.tensor([True, False]), "n": [1, "s"]}
    torch.save(obj, seed, _use_new_zipfile_serialization=False)
    run_fuzz(
        seed, "tdz_numba.formats.torch_pt.open_torch_legacy", fuzz_iterations(400), tmp_path, suffix=".pt"
    )
