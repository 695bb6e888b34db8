"""Fuzzing the format readers: mutated safetensors, torch .pt, .npy, .npz and memmap directories.

Each format's seeds are mutated (byte flips, truncations, inserted/deleted
spans, integer fields set to edge values, and format-aware edits: safetensors
JSON dtypes/shapes/offsets, .npy header fields, pickle opcodes and operands
re-zipped with valid CRCs so that the VM sees them, meta.json fields). One
worker process runs every case with a time budget, a timeout and a bounded
address space (RLIMIT_AS); each case must open and read every leaf, or raise a
:class:`~tdz_numba.TdzError`. A crash or hang names the case, which is
replayed with ``python tests/test_formats_fuzz.py --replay FORMAT CASE``.

``pytest -m fuzz`` runs the long version (``TDZ_FORMATS_FUZZ_SECONDS`` per format, default 60).
"""

from __future__ import annotations

import io
import json
import os
import random
import shutil
import struct
import subprocess
import sys
import time
import traceback
import zipfile
from pathlib import Path

import pytest

FORMATS = ("safetensors", "sharded", "torch", "npy", "npz", "memmap_dir")
#: Seconds per format in the CI run (about a minute in all with the worker's start-up).
CI_SECONDS = {"safetensors": 7, "sharded": 4, "torch": 11, "npy": 5, "npz": 7, "memmap_dir": 5}
ADDRESS_SPACE = 8 << 30
EDGES = [
    0,
    1,
    2,
    7,
    8,
    63,
    64,
    255,
    256,
    4095,
    65535,
    2**31 - 1,
    2**31,
    2**32 - 1,
    2**32,
    2**63 - 1,
    2**64 - 1,
]


# -- seeds ------------------------------------------------------------------------------------------
def make_seeds(d: Path) -> dict[str, list]:
    import numpy as np
    import torch
    from safetensors.torch import save_file

    import tdz_numba

    torch.manual_seed(0)
    out: dict[str, list] = {f: [] for f in FORMATS}
    save_file(
        {
            "a": torch.randn(3, 4),
            "b": torch.arange(5, dtype=torch.int16),
            "c": torch.ones(2, dtype=torch.bfloat16),
            "e": torch.zeros(0, 2),
        },
        str(d / "s.safetensors"),
        metadata={"k": "v"},
    )
    out["safetensors"].append((d / "s.safetensors").read_bytes())
    save_file({"w2": torch.ones(2, 2)}, str(d / "s2.safetensors"))
    wmap = {
        "a": "s.safetensors",
        "b": "s.safetensors",
        "c": "s.safetensors",
        "e": "s.safetensors",
        "w2": "s2.safetensors",
    }
    out["sharded"].append(
        {
            "m.safetensors.index.json": json.dumps(
                {"metadata": {"total_size": 1}, "weight_map": wmap}
            ).encode(),
            "s.safetensors": out["safetensors"][0],
            "s2.safetensors": (d / "s2.safetensors").read_bytes(),
        }
    )
    x = torch.arange(24, dtype=torch.float32).reshape(4, 6)
    torch.save(
        {
            "x": x,
            "t": x.t(),
            "s": x[1:, 2:],
            "p": torch.nn.Parameter(torch.ones(2)),
            "l": [x[0], (torch.arange(3, dtype=torch.uint8), 5)],
            "size": torch.Size([1]),
            "i": 3,
        },
        d / "p.pt",
    )
    out["torch"].append(_unzip((d / "p.pt").read_bytes()))
    torch.save(torch.nn.Linear(3, 2).state_dict(), d / "m.pt", pickle_protocol=4)
    out["torch"].append(_unzip((d / "m.pt").read_bytes()))
    for arr in (
        np.arange(12, dtype="<f4").reshape(3, 4),
        np.asfortranarray(np.ones((2, 3), ">i2")),
        np.array(3.5),
    ):
        buf = io.BytesIO()
        np.save(buf, arr)
        out["npy"].append(buf.getvalue())
    for save in (np.savez, np.savez_compressed):
        buf = io.BytesIO()
        save(buf, a=np.arange(6, dtype="<i4").reshape(2, 3), b=np.asfortranarray(np.eye(3)))
        out["npz"].append(_unzip(buf.getvalue()))
    arch = tdz_numba.save(
        {"a": x, "n": {"b": torch.ones(3, dtype=torch.int64)}, "tag": "t", "z": torch.zeros(0)}, d / "m.tdz"
    )
    md = tdz_numba.unpack(arch, d / "md")
    out["memmap_dir"].append(
        {str(p.relative_to(md)): p.read_bytes() for p in sorted(md.rglob("*")) if p.is_file()}
    )
    return out


def _unzip(raw: bytes) -> list[tuple[str, bytes, int]]:
    with zipfile.ZipFile(io.BytesIO(raw)) as z:
        return [(i.filename, z.read(i.filename), i.compress_type) for i in z.infolist()]


def _zip(members: list[tuple[str, bytes, int]], rng: random.Random) -> bytes:
    buf = io.BytesIO()
    with zipfile.ZipFile(buf, "w") as z:
        for name, data, method in members:
            z.writestr(name, data, compress_type=method)
    raw = buf.getvalue()
    return _bytes_mutation(raw, rng) if rng.random() < 0.1 else raw


# -- mutators ---------------------------------------------------------------------------------------
def _bytes_mutation(b: bytes, rng: random.Random, head: int = 512) -> bytes:
    b = bytearray(b)
    kind = rng.random()
    if not b:
        return bytes(rng.randrange(256) for _ in range(rng.randrange(16)))
    if kind < 0.45:  # flips, biased to the header region
        for _ in range(rng.randint(1, 8)):
            lim = min(len(b), head) if rng.random() < 0.7 else len(b)
            b[rng.randrange(lim)] ^= 1 << rng.randrange(8) if rng.random() < 0.6 else rng.randrange(1, 256)
    elif kind < 0.6:
        del b[rng.randrange(len(b) + 1) :]
    elif kind < 0.75:
        i = rng.randrange(len(b) + 1)
        b[i:i] = bytes(rng.randrange(256) for _ in range(rng.randint(1, 16)))
    elif kind < 0.85:
        i = rng.randrange(len(b))
        del b[i : i + rng.randint(1, 16)]
    else:  # an integer field set to an edge value
        width = rng.choice([1, 2, 4, 8])
        i = rng.randrange(max(1, min(len(b), head) - width + 1))
        v = rng.choice(EDGES + [len(b), len(b) - 1, len(b) + 1]) & ((1 << (8 * width)) - 1)
        b[i : i + width] = v.to_bytes(width, "little")[: len(b) - i]
    return bytes(b)


def _rand_value(rng: random.Random):
    return rng.choice([-1, 0, 1, 3, 2**31, 2**64, 1.5, "x", None, [], [1, 2], {}, True, [-1], [2**40, 2**40]])


def _edit_entry(header: dict, names: list, data_len: int, rng: random.Random) -> None:
    name = rng.choice(names + ["__metadata__"])
    entry = header.get(name)
    r = rng.random()
    if name == "__metadata__" or not isinstance(entry, dict):
        header[name] = _rand_value(rng) if r < 0.5 else {"k": _rand_value(rng)}
    elif r < 0.25:
        entry["dtype"] = rng.choice(
            ["F32", "F64", "I8", "BOOL", "F8_E4M3", "C64", "F4", "Q4", 7, None, "BF16"]
        )
    elif r < 0.5:
        shape = list(entry["shape"])
        op = rng.random()
        if op < 0.3 and shape:
            shape[rng.randrange(len(shape))] = rng.choice(EDGES + [-1, -(2**63)])
        elif op < 0.6:
            shape.append(rng.choice([0, 1, 2, 2**62]))
        else:
            shape = _rand_value(rng)
        entry["shape"] = shape
    elif r < 0.8:
        offs = list(entry["data_offsets"])
        offs[rng.randrange(2)] = rng.choice(EDGES + [-1, data_len, data_len + 1, offs[0] + 1])
        entry["data_offsets"] = offs if rng.random() < 0.9 else offs + [0]
    else:
        entry.pop(rng.choice(["dtype", "shape", "data_offsets"]))
        if rng.random() < 0.5:
            entry["extra"] = 1


def mutate_safetensors(seed: bytes, rng: random.Random) -> bytes:
    if rng.random() < 0.4:
        return _bytes_mutation(seed, rng)
    (n,) = struct.unpack_from("<Q", seed)
    header = json.loads(seed[8 : 8 + n])
    data = seed[8 + n :]
    names = [k for k in header if k != "__metadata__"]
    for _ in range(rng.randint(1, 3)):
        try:
            _edit_entry(header, names, len(data), rng)
        except (TypeError, KeyError, ValueError, IndexError, AttributeError):
            pass  # an earlier edit changed the entry's shape: skip
    h = json.dumps(header).encode()
    hl = len(h) if rng.random() < 0.9 else rng.choice(EDGES)
    if rng.random() < 0.1:
        data = data[: rng.randrange(len(data) + 1)]
    return struct.pack("<Q", hl & (2**64 - 1)) + h + data


_DESCRS = [
    "<f4",
    ">f8",
    "|u1",
    "<i8",
    "|b1",
    "<c8",
    "|O",
    "<U3",
    "|V8",
    "<M8[s]",
    "[('a', '<i4')]",
    "'<f4'",
    "<f4 ",
    "zz",
    "(2,)<f4",
    "<f2",
    ">c16",
]


def mutate_npy(seed: bytes, rng: random.Random) -> bytes:
    if rng.random() < 0.5:
        return _bytes_mutation(seed, rng, head=128)
    shape = rng.choice(
        [
            "()",
            "(3,)",
            "(3, 4)",
            "(-1,)",
            "(2**70,)",
            "(0, 5)",
            "(1.5,)",
            "[3]",
            "(3, 4, 5, 6)",
            "(" + "1," * 40 + ")",
            "('a',)",
        ]
    )
    descr = rng.choice(_DESCRS)
    fortran = rng.choice(["False", "True", "0", "None"])
    text = rng.choice(
        [
            f"{{'descr': {descr!r}, 'fortran_order': {fortran}, 'shape': {shape}, }}",
            f"{{'descr': {descr}, 'fortran_order': {fortran}, 'shape': {shape}}}",
            f"{{'fortran_order': {fortran}, 'shape': {shape}}}",
            "{" * 200,
            "[" * 2000,
            "1 + 1",
        ]
    )
    h = text.encode("latin-1") + b"\n"
    version = rng.choice([1, 1, 2, 3, 4])
    body = seed[seed.index(b"\n") + 1 :] if b"\n" in seed else b""
    body = body[: rng.randrange(len(body) + 1)] if rng.random() < 0.3 else body
    hl = len(h) if rng.random() < 0.9 else rng.choice(EDGES)
    if version == 1:
        return b"\x93NUMPY\x01\x00" + struct.pack("<H", hl & 0xFFFF) + h + body
    return b"\x93NUMPY" + bytes([version, 0]) + struct.pack("<I", hl & 0xFFFFFFFF) + h + body


_OPCODES = b"q\x94rhj(KJMN\x88\x89)}]\x8ftlde\x85\x86\x87RQbcs\x81\x93\x8a\x8bGX\x8cBC.01\x80\x95"


def mutate_pickle(data: bytes, rng: random.Random) -> bytes:
    b = bytearray(data)
    for _ in range(rng.randint(1, 4)):
        r = rng.random()
        if not b:
            break
        i = rng.randrange(len(b))
        if r < 0.3:
            b[i] = rng.choice(_OPCODES)
        elif r < 0.5:
            b.insert(i, rng.choice(_OPCODES))
        elif r < 0.65:
            del b[i : i + rng.randint(1, 6)]
        elif r < 0.85:
            b[i] = rng.randrange(256)
        else:
            b[i:i] = rng.choice(
                [
                    b"h\x00",
                    b"(",
                    b"t",
                    b"R",
                    b"cos\nsystem\n",
                    b"ctorch\nFloatStorage\n",
                    b"0",
                    b"X\xff\xff\xff\x7f",
                    b"r\xff\xff\xff\xff",
                    b"\x8b\xff\xff\xff\x7f",
                ]
            )
    return bytes(b)


def mutate_zip_members(members, rng: random.Random, kind: str) -> bytes:
    members = [list(m) for m in members]
    r = rng.random()
    if r < 0.15:
        return _bytes_mutation(_zip([tuple(m) for m in members], random.Random(0)), rng)
    for _ in range(rng.randint(1, 2)):
        m = rng.choice(members)
        name = m[0]
        if kind == "torch" and name.endswith("data.pkl") and rng.random() < 0.7:
            m[1] = mutate_pickle(m[1], rng)
        elif kind == "torch" and name.endswith("byteorder") and rng.random() < 0.3:
            m[1] = rng.choice([b"big", b"", b"little\n", b"x" * 100])
        elif kind == "npz" and rng.random() < 0.7:
            m[1] = mutate_npy(m[1], rng) if rng.random() < 0.5 else _bytes_mutation(m[1], rng, head=128)
        elif rng.random() < 0.3:
            m[1] = m[1][: rng.randrange(len(m[1]) + 1)]
        elif rng.random() < 0.3:
            m[0] = rng.choice(
                ["archive/code/x.py", "archive/constants.pkl", "x.npy", "meta.json", name + "/"]
            )
        else:
            m[1] = _bytes_mutation(m[1], rng)
    return _zip([tuple(m) for m in members], rng)


def mutate_sharded(seed: dict, rng: random.Random) -> dict:
    files = dict(seed)
    r = rng.random()
    name = "m.safetensors.index.json"
    if r < 0.3:
        shard = rng.choice(["s.safetensors", "s2.safetensors"])
        files[shard] = mutate_safetensors(files[shard], rng)
    elif r < 0.4:
        files[name] = _bytes_mutation(files[name], rng)
    elif r < 0.45:
        del files[rng.choice(sorted(files))]
    else:
        index = json.loads(files[name])
        wmap = index["weight_map"]
        for _ in range(rng.randint(1, 2)):
            k = rng.choice(sorted(wmap))
            op = rng.random()
            if op < 0.3:
                wmap[k] = rng.choice(
                    [
                        "s2.safetensors",
                        "s.safetensors",
                        "../s.safetensors",
                        "",
                        "/etc/passwd",
                        "missing.safetensors",
                        "m.safetensors.index.json",
                        5,
                        None,
                    ]
                )
            elif op < 0.5:
                del wmap[k]
            elif op < 0.7:
                wmap[rng.choice(["zz", k + "x", ""])] = rng.choice(["s.safetensors", "s2.safetensors"])
            elif op < 0.85:
                index["metadata"] = _rand_value(rng)
            else:
                index[rng.choice(["weight_map", "metadata"])] = _rand_value(rng)
                break
        files[name] = json.dumps(index).encode()
    return files


def mutate_memmap_dir(seed: dict, rng: random.Random) -> dict:
    files = dict(seed)
    for _ in range(rng.randint(1, 2)):
        name = rng.choice(sorted(files))
        data = files[name]
        if name.endswith("meta.json") and rng.random() < 0.7:
            try:
                meta = json.loads(data)
            except ValueError:
                meta = None
            if not isinstance(meta, dict) or not meta:
                files[name] = _bytes_mutation(data, rng)
                continue
            keys = [k for k, v in meta.items() if isinstance(v, dict)] or list(meta)
            k = rng.choice(keys)
            if isinstance(meta.get(k), dict) and rng.random() < 0.7:
                field = rng.choice(["dtype", "shape", "type", "is_nested"])
                meta[k][field] = rng.choice(
                    [
                        _rand_value(rng),
                        "torch.float64",
                        "torch.evil",
                        [2**40],
                        [3, 3],
                        "TensorDict",
                        "NonTensorData",
                    ]
                )
            else:
                meta[k] = _rand_value(rng)
            files[name] = json.dumps(meta).encode()
        elif rng.random() < 0.5:
            files[name] = data[: rng.randrange(len(data) + 1)]
        elif rng.random() < 0.5:
            del files[name]
        else:
            files[name] = _bytes_mutation(data, rng)
    return files


# -- the worker --------------------------------------------------------------------------------------
def make_case(fmt: str, seeds: dict, case: int, master: int):
    rng = random.Random(f"{master}:{fmt}:{case}")
    seed = rng.choice(seeds[fmt])
    if fmt == "safetensors":
        return mutate_safetensors(seed, rng)
    if fmt == "npy":
        return mutate_npy(seed, rng)
    if fmt in ("torch", "npz"):
        return mutate_zip_members(seed, rng, fmt)
    if fmt == "sharded":
        return mutate_sharded(seed, rng)
    return mutate_memmap_dir(seed, rng)


def write_case(target: Path, payload) -> Path:
    if target.is_dir():
        shutil.rmtree(target)
    elif target.exists():
        target.unlink()
    if isinstance(payload, dict):
        target.mkdir()
        for name, data in payload.items():
            p = target / name
            p.parent.mkdir(parents=True, exist_ok=True)
            p.write_bytes(data)
    else:
        target.write_bytes(payload)
    return target


def read_everything(path: Path) -> None:
    """Opens a case and touches every leaf (first and last element; a sum when small)."""
    import torch

    from tdz_numba import formats

    src = formats.open_source(path)
    if src is None:
        return
    try:
        for t in _leaves(formats.to_tree(src)):
            if not isinstance(t, torch.Tensor) or t.numel() == 0:
                continue
            t[(0,) * t.dim()].item()
            t[tuple(d - 1 for d in t.shape)].item()
            if t.numel() <= 1 << 20:
                t.reshape(-1).view(torch.uint8).sum() if t.is_contiguous() and t.dim() else t.clone()
    finally:
        src.close()


def _leaves(tree):
    stack = [tree]
    while stack:
        node = stack.pop()
        for v in node.values():
            if isinstance(v, dict):
                stack.append(v)
            else:
                yield v


def worker(out_dir: Path, budgets: dict[str, float], master: int, progress: Path) -> None:
    import resource

    resource.setrlimit(resource.RLIMIT_AS, (ADDRESS_SPACE, ADDRESS_SPACE))
    from tdz_numba.errors import TdzError

    seeds = make_seeds(out_dir)
    report = {"counts": {}, "failures": []}
    for fmt, seconds in budgets.items():
        counts: dict[str, int] = {}
        t_end = time.monotonic() + seconds
        case = 0
        target = out_dir / f"case_{fmt}"
        while time.monotonic() < t_end:
            payload = make_case(fmt, seeds, case, master)
            progress.write_text(f"{fmt} {case}")
            write_case(target, payload)
            try:
                read_everything(target)
                outcome = "ok"
            except TdzError as exc:
                outcome = type(exc).__name__
            except Exception as exc:  # noqa: BLE001 - what the fuzz looks for
                outcome = "FAIL"
                report["failures"].append(
                    {
                        "format": fmt,
                        "case": case,
                        "error": repr(exc)[:300],
                        "tb": traceback.format_exc()[-1500:],
                    }
                )
            counts[outcome] = counts.get(outcome, 0) + 1
            case += 1
        report["counts"][fmt] = counts
    print("FUZZ-REPORT " + json.dumps(report), flush=True)


def run_fuzz(tmp_path: Path, budgets: dict[str, float], master: int = 1) -> dict:
    progress = tmp_path / "progress"
    env = dict(os.environ)
    root = str(Path(__file__).resolve().parent.parent)
    env["PYTHONPATH"] = root + os.pathsep + env.get("PYTHONPATH", "")
    cmd = [
        sys.executable,
        __file__,
        "--worker",
        str(tmp_path),
        json.dumps(budgets),
        str(master),
        str(progress),
    ]
    timeout = sum(budgets.values()) + 180
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=env)
    except subprocess.TimeoutExpired:
        pytest.fail(f"fuzz worker hung; last case: {progress.read_text() if progress.exists() else '?'}")
    line = next((x for x in proc.stdout.splitlines() if x.startswith("FUZZ-REPORT ")), None)
    if proc.returncode != 0 or line is None:
        pytest.fail(
            f"fuzz worker died (rc {proc.returncode}) at case "
            f"{progress.read_text() if progress.exists() else '?'}:\n{proc.stderr[-3000:]}"
        )
    return json.loads(line[len("FUZZ-REPORT ") :])


def _check(report: dict, min_cases: int) -> None:
    print(json.dumps(report["counts"]))
    fails = report["failures"]
    assert not fails, "\n".join(f"{f['format']} case {f['case']}: {f['error']}\n{f['tb']}" for f in fails[:5])
    for fmt, counts in report["counts"].items():
        assert sum(counts.values()) >= min_cases, (fmt, counts)
        assert len(counts) > 1, f"{fmt}: every case had the same outcome {counts}: the mutators are too weak"


def test_fuzz_formats_ci(tmp_path):
    _check(run_fuzz(tmp_path, CI_SECONDS), min_cases=50)


@pytest.mark.fuzz
def test_fuzz_formats_long(tmp_path, request):
    if "fuzz" not in (request.config.getoption("markexpr") or ""):
        pytest.skip("the long fuzz run: pytest -m fuzz")
    seconds = float(os.environ.get("TDZ_FORMATS_FUZZ_SECONDS", "60"))
    # thousands of cases per format at the default 60 s (directories are the slowest: ~20 cases/s)
    _check(
        run_fuzz(tmp_path, {f: seconds for f in FORMATS}, master=int(time.time())),
        min_cases=int(15 * seconds),
    )


def test_mutators_are_deterministic(tmp_path):
    seeds = make_seeds(tmp_path)
    for fmt in FORMATS:
        assert make_case(fmt, seeds, 7, 1) == make_case(fmt, seeds, 7, 1)


if __name__ == "__main__":
    if sys.argv[1] == "--worker":
        worker(Path(sys.argv[2]), json.loads(sys.argv[3]), int(sys.argv[4]), Path(sys.argv[5]))
    elif sys.argv[1] == "--replay":  # --replay FORMAT CASE [MASTER]
        import tempfile

        with tempfile.TemporaryDirectory() as d:
            seeds = make_seeds(Path(d))
            payload = make_case(
                sys.argv[2], seeds, int(sys.argv[3]), int(sys.argv[4]) if len(sys.argv) > 4 else 1
            )
            read_everything(write_case(Path(d) / "case", payload))
            print("no error")
