"""A fuzz worker process: runs one op on one input per request, reports the outcome.

Started by :mod:`fuzz.runner` as ``python worker.py WARMUP_ARCHIVE``. It
imports tdz_numba, runs every op once on a valid archive (so that kernels
are compiled or loaded from the cache before the first timed case), sets
``RLIMIT_AS`` and prints ``ready``. Then for each JSON line on stdin
(``{"path", "op", "subpath", "tmp"}``) it prints one JSON line: the category
(``accepted``, ``tdzerror``, ``other``, ``memory``) and, for exceptions, the
exception type, the innermost traceback frame and the innermost tdz_numba
frame. A crash or a hang is seen by the runner (it restarts the worker).

Ops: ``is_archive`` (must return a bool and never raise), ``open`` (open +
``to_dict`` + a sum over the bytes of every leaf + ``numpy()`` of every dense leaf), ``verify``, ``load_subpath``
and ``unpack`` (into a fresh directory).
"""

from __future__ import annotations

import faulthandler
import json
import os
import resource
import sys
import traceback
import warnings

OPS = ("is_archive", "open", "verify", "load_subpath", "unpack")
AS_LIMIT = 4 << 30


def _sum_leaves(tree) -> int:
    import torch

    total = 0
    stack = [tree]
    while stack:
        node = stack.pop()
        if isinstance(node, dict):
            stack.extend(node.values())
        elif isinstance(node, torch.Tensor):
            parts = node.unbind() if node.is_nested else [node]
            for t in parts:
                if t.numel():
                    total += int(t.reshape(-1).view(torch.uint8).sum())
    return total


def rmtree(path: str) -> None:
    """Removes ``path`` whatever its depth (shutil.rmtree recurses: 1,500-deep trees break it)."""
    import subprocess

    subprocess.run(["rm", "-rf", "--", path], check=False)


def run_op(op: str, path: str, subpath: str | None, tmp: str) -> object:
    """Runs ``op`` on the archive at ``path``; returns a small summary."""
    import tdz_numba

    if op == "is_archive":
        r = tdz_numba.is_archive(path)
        if not isinstance(r, bool):
            raise AssertionError(f"is_archive returned {r!r}")
        return r
    if op == "open":
        with tdz_numba.open(path) as ar:
            total = _sum_leaves(ar.to_dict())
            for key, leaf in list(ar.leaves()):
                if not leaf.nested:
                    total += ar.numpy(key).nbytes  # numpy views of every dense leaf too
            return total
    if op == "verify":
        return tdz_numba.verify(path).entries
    if op == "load_subpath":
        return _sum_leaves(tdz_numba.load(path, subpath=subpath))
    if op == "unpack":
        out = os.path.join(tmp, "unpacked")
        try:
            tdz_numba.unpack(path, out)
        finally:
            rmtree(out)
        return True
    if op == "_segv":  # the harness's own tests: a crash, a hang, an allocation over RLIMIT_AS
        import ctypes

        ctypes.string_at(0)
    if op == "_hang":
        import time

        time.sleep(3600)
    if op == "_oom":
        return len(bytearray(5 << 30))
    raise ValueError(f"unknown op {op!r}")


def _frame(tb_list, ours: bool) -> str:
    for fr in reversed(tb_list):
        if not ours or "tdz_numba" in fr.filename:
            return f"{os.path.basename(fr.filename)}:{fr.lineno} {fr.name}"
    return ""


def classify(op: str, exc: BaseException | None) -> dict:
    """The outcome record of one op (``exc`` is None on success)."""
    from tdz_numba import TdzError

    if exc is None:
        return {"cat": "accepted"}
    tb = traceback.extract_tb(exc.__traceback__)
    rec = {
        "exc": type(exc).__name__,
        "frame": _frame(tb, False),
        "ours": _frame(tb, True),
        "msg": str(exc)[:300],
    }
    if isinstance(exc, MemoryError):
        rec["cat"] = "memory"
    elif isinstance(exc, TdzError) and op != "is_archive":
        rec["cat"] = "tdzerror"
    else:
        rec["cat"] = "other"
    return rec


def main() -> None:
    warnings.filterwarnings("ignore")
    out = os.fdopen(os.dup(1), "w", buffering=1)
    os.dup2(2, 1)  # stray prints (progress bars, warnings) go to stderr
    faulthandler.enable(sys.stderr)
    import torch

    import tdz_numba  # noqa: F401

    torch.set_num_threads(1)
    warm = sys.argv[1]
    tmp = sys.argv[2]
    for op in OPS:
        try:
            run_op(op, warm, None, tmp)
        except Exception as exc:  # a warm-up failure is reported, not fatal
            print(f"warm-up {op}: {exc!r}", file=sys.stderr)
    resource.setrlimit(resource.RLIMIT_AS, (AS_LIMIT, AS_LIMIT))
    out.write("ready\n")
    for line in sys.stdin:
        req = json.loads(line)
        try:
            run_op(req["op"], req["path"], req.get("subpath"), req["tmp"])
            rec = classify(req["op"], None)
        except BaseException as exc:  # noqa: BLE001 - every outcome is recorded
            rec = classify(req["op"], exc)
            del exc
        rec["id"] = req["id"]
        out.write(json.dumps(rec) + "\n")


if __name__ == "__main__":
    main()
