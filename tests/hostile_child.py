"""Runs reader operations on hostile inputs in one child process (memory limit, a timeout per op).

Used by ``tests/test_memmapdir_hdf5_hostile.py``: :func:`run_ops` writes the
cases to a JSON file and starts ``python hostile_child.py CASES``. The child
sets ``RLIMIT_AS``, then for each case and op prints ``START case op`` and one
JSON line: the outcome (``"ok"``, the name of the :class:`~tdz_numba.TdzError`
raised, or ``"STRAY: ..."`` for anything else) and the markers found in what
the op returned (tensor bytes, values, the converted archive's bytes, the
``tdz info`` text). A hang is cut by ``SIGALRM``; a crash is seen by the parent
as a missing line after its ``START``.

Ops: ``read`` (:func:`tdz_numba.formats.open_source` with the case's options,
every leaf read), ``open`` (:func:`tdz_numba.open`, ``to_dict``), ``load``,
``convert`` (to ``.tdz``, then the archive's bytes scanned), ``info`` (``tdz info``).
"""

from __future__ import annotations

import io
import json
import os
import resource
import signal
import subprocess
import sys
import traceback
from contextlib import redirect_stderr, redirect_stdout
from pathlib import Path
from typing import Any

__all__ = ["run_ops", "OPS"]

OPS = ("read", "open", "load", "convert", "info")


class _Timeout(BaseException):
    pass


class _Refused(Exception):
    """``tdz info`` printed an error and returned a non-zero code (a clean refusal)."""


def _chunks(value: Any, out: list[bytes], depth: int = 0) -> None:
    """Every byte string a value holds (tensors as their raw bytes), recursively."""
    import numpy as np
    import torch

    if depth > 200:
        return
    if isinstance(value, torch.Tensor) and value.is_nested:  # its components, one by one
        for part in value.unbind():
            _chunks(part, out, depth + 1)
    elif isinstance(value, torch.Tensor):
        t = value.detach().cpu().contiguous()
        out.append(t.reshape(-1).view(torch.uint8).numpy().tobytes() if t.numel() else b"")
    elif isinstance(value, np.ndarray):
        out.append(np.ascontiguousarray(value).tobytes())
        if value.dtype.kind == "O":
            for v in value.reshape(-1).tolist():
                _chunks(v, out, depth + 1)
    elif isinstance(value, bytes | bytearray | memoryview):
        out.append(bytes(value))
    elif isinstance(value, str):
        out.append(value.encode("utf-8", "surrogateescape"))
    elif hasattr(value, "items") and callable(value.items):
        try:
            items = list(value.items(include_nested=True, leaves_only=True))  # a TensorDict
        except TypeError:
            items = list(value.items())
        for k, v in items:
            _chunks(k, out, depth + 1)
            _chunks(v, out, depth + 1)
    elif isinstance(value, list | tuple | set | frozenset):
        for v in value:
            _chunks(v, out, depth + 1)
    else:
        data = getattr(value, "data", None)  # RawFile / PickledData
        if isinstance(data, bytes):
            out.append(data)
        else:
            out.append(repr(value).encode("utf-8", "surrogateescape"))


def _op(op: str, path: str, options: dict[str, Any], work: Path) -> list[bytes]:
    import tdz_numba
    from tdz_numba import formats

    out: list[bytes] = []
    if op == "read":
        src = formats.open_source(path, **options)
        try:
            _chunks(formats.to_tree(src), out)
        finally:
            src.close()
    elif op == "open":
        with tdz_numba.open(path) as ar:
            _chunks(ar.to_dict(), out)
            _chunks(ar.metadata, out)
    elif op == "load":
        _chunks(tdz_numba.load(path), out)
    elif op == "convert":
        dst = work / "converted.tdz"
        if dst.exists():
            dst.unlink()
        tdz_numba.convert(path, dst)
        out.append(dst.read_bytes())
    elif op == "info":
        from tdz_numba.cli import main

        buf = io.StringIO()
        with redirect_stdout(buf), redirect_stderr(buf):
            rc = main(["info", path])
        out.append(buf.getvalue().encode("utf-8", "surrogateescape"))
        if "internal error" in buf.getvalue():
            raise RuntimeError(f"tdz info: {buf.getvalue()[-300:]}")
        if rc:
            raise _Refused(f"tdz info exit {rc}: {buf.getvalue()[-300:]}")
    return out


def _child(cases_file: str) -> None:
    spec = json.loads(Path(cases_file).read_text())
    limit = int(spec["mem_mib"]) << 20
    resource.setrlimit(resource.RLIMIT_AS, (limit, limit))
    markers = [bytes.fromhex(m) for m in spec["markers"]]
    work = Path(spec["work"])
    from tdz_numba.errors import TdzError

    def alarm(signum: int, frame: Any) -> None:
        raise _Timeout()

    signal.signal(signal.SIGALRM, alarm)
    for case in spec["cases"]:
        for op in case["ops"]:
            print("START", case["name"], op, flush=True)
            signal.alarm(int(spec["timeout"]))
            found: list[str] = []
            try:
                chunks = _op(op, case["path"], case.get("options", {}), work)
                outcome = "ok"
                for m in markers:
                    if any(m in c for c in chunks):
                        found.append(m.hex())
            except _Timeout:
                outcome = "STRAY: timed out"
            except TdzError as e:
                outcome = type(e).__name__
            except _Refused as e:
                outcome = "refused: " + str(e)[:300]
            except BaseException as e:  # noqa: BLE001 - reported to the parent
                outcome = f"STRAY: {type(e).__name__}: {str(e)[:300]}"
                traceback.print_exc(file=sys.stdout)
            finally:
                signal.alarm(0)
            print(
                json.dumps({"case": case["name"], "op": op, "outcome": outcome, "leaks": found}), flush=True
            )
    print("ALL DONE", flush=True)


def run_ops(
    cases: list[dict[str, Any]],
    markers: list[bytes],
    work: Path,
    *,
    timeout: int = 30,
    mem_mib: int = 6144,
) -> dict[tuple[str, str], dict[str, Any]]:
    """Runs every case's ops in one child; returns ``{(case, op): result}``.

    Each case is ``{"name", "path", "ops", "options"}``. Fails (AssertionError)
    when the child crashes or runs past the sum of the per-op timeouts.
    """
    spec = {
        "cases": cases,
        "markers": [m.hex() for m in markers],
        "work": str(work),
        "timeout": timeout,
        "mem_mib": mem_mib,
    }
    cases_file = work / "cases.json"
    cases_file.write_text(json.dumps(spec))
    env = dict(os.environ)
    root = str(Path(__file__).resolve().parents[1])
    env["PYTHONPATH"] = root + os.pathsep + env.get("PYTHONPATH", "")
    total = 120 + timeout * sum(len(c["ops"]) for c in cases)
    proc = subprocess.run(
        [sys.executable, __file__, str(cases_file)],
        capture_output=True,
        text=True,
        timeout=total,
        env=env,
        cwd=str(work),
    )
    results: dict[tuple[str, str], dict[str, Any]] = {}
    last = None
    for line in proc.stdout.splitlines():
        if line.startswith("START "):
            last = line
        elif line.startswith("{"):
            r = json.loads(line)
            results[(r["case"], r["op"])] = r
    assert "ALL DONE" in proc.stdout and proc.returncode == 0, (
        f"child exit {proc.returncode} after {last!r}\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
    )
    return results


if __name__ == "__main__":
    _child(sys.argv[1])
