"""Hostile inputs for the numpy, ONNX, GGUF and safetensors readers (issue 23).

Each case is written here, then every op (open and read every leaf, dequantize
GGUF leaves, ``load``, ``convert`` to ``.tdz``) runs on it in a child process
under an address-space limit (``RLIMIT_AS``) and a timeout: the child must end
with success or a :class:`~tdz_numba.TdzError` whose message stays short, never a
crash, a hang, a ``MemoryError`` or another exception. Large-count cases (200k
empty safetensors entries, 2M empty GGUF metadata arrays, 3M ONNX initializers)
must end too: bounded work per claim, or an early refusal.
"""

from __future__ import annotations

import importlib
import json
import os
import struct
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest

from tdz_numba.errors import TdzError

ROOT = Path(__file__).resolve().parents[1]
#: Longest error message a hostile input may produce.
MAX_MESSAGE = 1000

_CHILD = textwrap.dedent(
    r"""
    import json, resource, sys, traceback
    limit = int(sys.argv[3]) << 20
    resource.setrlimit(resource.RLIMIT_AS, (limit, limit))
    paths, ops = json.loads(sys.argv[1]), sys.argv[2].split(",")
    import tdz_numba
    from tdz_numba.errors import TdzError
    for path, op in [(p, o) for p in paths for o in ops]:
        try:
            if op == "read":
                with tdz_numba.open(path) as ar:
                    n = 0
                    for k, t in ar.iter_leaves():
                        n += 1
                        if ar.format == "gguf":
                            ar.dequantize(k)
                out = {"op": op, "ok": n}
            elif op == "load":
                tdz_numba.load(path)
                out = {"op": op, "ok": 1}
            elif op == "convert":
                import warnings
                with warnings.catch_warnings():
                    warnings.simplefilter("ignore")
                    tdz_numba.convert(path, path + ".tdz")
                out = {"op": op, "ok": 1}
        except TdzError as e:
            out = {"op": op, "error": type(e).__name__, "length": len(str(e)), "message": str(e)[:3000]}
        except BaseException:
            traceback.print_exc()
            print(f"STRAY EXCEPTION in {op}", flush=True)
            sys.exit(3)
        print(json.dumps(out), flush=True)
    """
)


def run_ops(
    path: Path | list[Path], ops: str = "read,load,convert", *, timeout: float = 300.0, mem_mib: int = 6144
) -> list[dict]:
    """Runs ``ops`` on ``path`` (or on each of a list: one child for all) in a child;
    returns one dict per path and op (``ok`` or ``error``)."""
    paths = path if isinstance(path, list) else [path]
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    cmd = [sys.executable, "-c", _CHILD, json.dumps([str(p) for p in paths]), ops, str(mem_mib)]
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=env, cwd=ROOT)
    except subprocess.TimeoutExpired:
        raise AssertionError(f"{paths[0].name}: {ops} ran past {timeout} s (a hang)") from None
    assert proc.returncode == 0, (
        f"{paths[0].name}: exit {proc.returncode}\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
    )
    results = [json.loads(line) for line in proc.stdout.splitlines() if line.startswith("{")]
    assert [r["op"] for r in results] == ops.split(",") * len(paths), proc.stdout
    for r in results:
        assert r.get("length", 0) <= MAX_MESSAGE, f"{r['op']}: message of {r['length']} characters"
    return results


def _refused(results: list[dict], error: str = "", match: str = "") -> None:
    for r in results:
        assert "error" in r, f"{r['op']} accepted a hostile input"
        if error:
            assert r["error"] == error, r
        assert match in r["message"], r


# ----------------------------------------------------------------------------- ONNX

try:  # the GGUF, safetensors and numpy cases run without onnx
    import onnx
    from onnx import TensorProto, helper, numpy_helper
except ImportError:  # pragma: no cover - onnx is a dev dependency
    onnx = None
needs_onnx = pytest.mark.skipif(onnx is None, reason="needs onnx")


def _vi(x: int) -> bytes:
    out = bytearray()
    while True:
        b, x = x & 0x7F, x >> 7
        if x:
            out.append(b | 0x80)
        else:
            out.append(b)
            return bytes(out)


def _onnx_model(path: Path, inits) -> Path:
    onnx.save(helper.make_model(helper.make_graph([], "g", [], [], inits)), path)
    return path


@needs_onnx
def test_onnx_external_location_naming_the_folder(tmp_path):
    paths = []
    for i, location in enumerate([".", "./", "", ".//"]):
        t = numpy_helper.from_array(np.zeros(4, np.float32), "w")
        t.ClearField("raw_data")
        t.data_location = TensorProto.EXTERNAL
        e = t.external_data.add()
        e.key, e.value = "location", location
        paths.append(_onnx_model(tmp_path / f"m{i}.onnx", [t]))
    _refused(run_ops(paths), "BadArchiveError", "'w'")


@needs_onnx
def test_onnx_more_than_64_dims_refused_at_open(tmp_path):
    t = helper.make_tensor("deep", TensorProto.FLOAT, [1] * 101, b"\0\0\0\0", raw=True)
    p = _onnx_model(tmp_path / "m.onnx", [t])
    _refused(run_ops(p), "BadArchiveError", "101 dimensions (at most 64)")
    ok = _onnx_model(tmp_path / "ok.onnx", [numpy_helper.from_array(np.ones([1] * 64, np.float32), "d64")])
    assert [r.get("ok") for r in run_ops(ok)] == [1, 1, 1]  # the limit is the one convert can write


@needs_onnx
def test_onnx_millions_of_initializers_refused_early(tmp_path):
    from tdz_numba.formats.onnx import MAX_INITIALIZERS

    n = 3_000_000
    one = [
        b"\x2a" + _vi(len(b)) + b
        for b in (b"\x08\x00\x10\x01\x42" + _vi(len(nm)) + nm for nm in [b"%d" % i for i in range(n)])
    ]
    graph = b"".join(one)
    p = tmp_path / "many.onnx"
    p.write_bytes(b"\x08\x08\x3a" + _vi(len(graph)) + graph)
    _refused(run_ops(p, timeout=240), "UnsupportedError", f"more than {MAX_INITIALIZERS:,} initializers")


@needs_onnx
def test_onnx_many_initializers_under_the_limit_read(tmp_path):
    n = 20_000
    inits = [numpy_helper.from_array(np.array([i], np.int32), f"t{i}") for i in range(n)]
    p = _onnx_model(tmp_path / "m.onnx", inits)
    assert [r.get("ok") for r in run_ops(p, "read")] == [n]


@needs_onnx
def test_onnx_long_names_quoted_short(tmp_path):
    name = "n" * 3_000_000
    a = numpy_helper.from_array(np.zeros(1, np.float32), name)
    b = numpy_helper.from_array(np.zeros(1, np.float32), name)
    _refused(run_ops(_onnx_model(tmp_path / "dup.onnx", [a, b]), "read"), "BadArchiveError", "duplicate")


# ----------------------------------------------------------------------------- GGUF


def _gguf_header(n_tensors: int, n_kv: int) -> bytes:
    return b"GGUF" + struct.pack("<IQQ", 3, n_tensors, n_kv)


def test_gguf_millions_of_empty_metadata_arrays_refused(tmp_path):
    n = 2_000_000
    tail = struct.pack("<IIQ", 9, 0, 0)  # an empty array of u8
    p = tmp_path / "kv.gguf"
    p.write_bytes(
        _gguf_header(0, n)
        + b"".join(struct.pack("<Q", len(k)) + k + tail for k in (b"k%d" % i for i in range(n)))
    )
    _refused(run_ops(p), "UnsupportedError", "metadata keys")


def test_gguf_millions_of_nested_empty_arrays_refused(tmp_path):
    n = 2_000_000
    key = b"nested"
    body = struct.pack("<Q", len(key)) + key + struct.pack("<IIQ", 9, 9, n) + struct.pack("<IQ", 0, 0) * n
    p = tmp_path / "nested.gguf"
    p.write_bytes(_gguf_header(0, 1) + body)
    _refused(run_ops(p, "read"), "BadArchiveError", "metadata values and arrays")


def test_gguf_many_metadata_keys_under_the_limit_read(tmp_path):
    n = 100_000
    tail = struct.pack("<IIQ", 9, 0, 0)
    p = tmp_path / "kv.gguf"
    p.write_bytes(
        _gguf_header(0, n)
        + b"".join(struct.pack("<Q", len(k)) + k + tail for k in (b"k%d" % i for i in range(n)))
    )
    from tdz_numba.formats.gguf import open_gguf

    src = open_gguf(p)
    assert len(src.metadata) == n and src.metadata["k99999"] == []
    src.close()


def test_gguf_garbage_key_message_short(tmp_path):
    key = b"\xff" * 5_000_000
    p = tmp_path / "bad.gguf"
    p.write_bytes(_gguf_header(0, 2) + (struct.pack("<Q", len(key)) + key + struct.pack("<I", 77)) * 2)
    with pytest.raises(TdzError) as e:
        importlib.import_module("tdz_numba.formats.gguf").open_gguf(p)
    assert len(str(e.value)) < 300 and "unknown value type 77" in str(e.value)
    p.write_bytes(_gguf_header(1, 0) + struct.pack("<Q", len(key)) + key + struct.pack("<I", 99))
    with pytest.raises(TdzError) as e:
        importlib.import_module("tdz_numba.formats.gguf").open_gguf(p)
    assert len(str(e.value)) < 300 and "99 dimensions" in str(e.value)


# ----------------------------------------------------------------------------- safetensors


def _safetensors(path: Path, header: dict) -> Path:
    raw = json.dumps(header).encode()
    path.write_bytes(struct.pack("<Q", len(raw)) + raw)
    return path


def test_safetensors_200k_empty_entries(tmp_path):
    n = 200_000
    p = _safetensors(
        tmp_path / "many.safetensors",
        {f"t{i}": {"dtype": "F32", "shape": [0], "data_offsets": [0, 0]} for i in range(n)},
    )
    results = run_ops(p, "read,convert", timeout=400)
    assert results[0] == {"op": "read", "ok": n} and results[1].get("ok") == 1


def test_sharded_index_values_not_names(tmp_path):
    from safetensors.numpy import save_file

    paths = []
    for i, value in enumerate([["a.safetensors"], {"x": 1}, 3, None]):
        d = tmp_path / str(i)
        d.mkdir()
        save_file({"w": np.zeros(2, np.float32)}, str(d / "a.safetensors"))
        idx = d / "model.safetensors.index.json"
        idx.write_text(json.dumps({"weight_map": {"w": "a.safetensors", "v": value}}))
        paths.append(idx)
    _refused(run_ops(paths, "read,load"), "BadArchiveError", "weight_map value for 'v'")


def test_safetensors_long_names_quoted_short(tmp_path):
    name = "x" * 2_000_000
    p = _safetensors(
        tmp_path / "bad.safetensors", {name: {"dtype": "F99", "shape": [1], "data_offsets": [0, 4]}}
    )
    _refused(run_ops(p, "read"), "BadArchiveError", "dtype: unknown")


# ----------------------------------------------------------------------------- numpy


def test_npz_long_member_name_quoted_short(tmp_path):
    import zipfile

    p = tmp_path / "bad.npz"
    with zipfile.ZipFile(p, "w") as z:
        z.writestr("b" * 60000 + ".npy", b"\x93NUMPY\x01\x00\x10\x00{'descr': 1}   ")
    _refused(run_ops(p, "read"), "BadArchiveError", "'bbbbbbbb")


def test_npy_huge_header_literal_bounded(tmp_path):
    body = "{'descr': '<f4', 'fortran_order': False, 'shape': (" + "(" * 20000 + ")" * 20000 + ",)}"
    h = body.encode()
    p = tmp_path / "deep.npy"
    p.write_bytes(b"\x93NUMPY\x02\x00" + struct.pack("<I", len(h)) + h)
    _refused(run_ops(p, "read"), "BadArchiveError")
