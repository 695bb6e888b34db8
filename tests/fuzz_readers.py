"""Mutation fuzzing of format readers in a child process (timeout + RLIMIT_AS).

The child mutates a seed file many times, opens each mutant with a reader,
reads every leaf, and accepts only success or a :class:`tdz_numba.TdzError`;
anything else (another exception, a crash, a hang, running out of the address
space limit) fails the test with the offending mutant saved for replay.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

__all__ = ["run_fuzz", "fuzz_iterations", "require_fuzz_selected", "LONG_ITERATIONS"]

#: Mutants per reader in the ``-m fuzz`` runs (``$TDZ_FUZZ_ITERS`` overrides).
LONG_ITERATIONS = 20000

_CHILD = textwrap.dedent(
    r"""
    import os, random, resource, sys, traceback, importlib
    limit = int(sys.argv[5]) << 20
    resource.setrlimit(resource.RLIMIT_AS, (limit, limit))
    seed_path, reader, n, rseed, head, out_dir, suffix = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4]), int(sys.argv[6]), sys.argv[7], sys.argv[8]
    import numpy as np, torch
    import tdz_numba
    from tdz_numba.errors import TdzError
    from tdz_numba.tdz.sources import tensor_from_spec
    mod_name, fn_name = reader.rsplit(".", 1)
    opener = getattr(importlib.import_module(mod_name), fn_name)
    seed = open(seed_path, "rb").read()
    rng = random.Random(rseed)
    INTERESTING = [0, 1, 2, 3, 7, 8, 9, 0x7F, 0x80, 0xFF, 0x7FFF, 0xFFFF, 0x7FFFFFFF, 0xFFFFFFFF, 2**32, 2**63 - 1, 2**63, 2**64 - 1, len(seed), len(seed) - 1, len(seed) + 1, 32, 64, 4096]

    def mutate(data):
        b = bytearray(data)
        for _ in range(rng.randint(1, 4)):
            if not b:
                break
            kind = rng.randrange(7)
            hi = min(len(b), head) if head and rng.random() < 0.8 else len(b)
            pos = rng.randrange(hi)
            if kind == 0:
                b[pos] ^= 1 << rng.randrange(8)
            elif kind == 1:
                b[pos] = rng.randrange(256)
            elif kind == 2:
                width = rng.choice([1, 2, 4, 8])
                v = rng.choice(INTERESTING) & ((1 << (8 * width)) - 1)
                b[pos:pos + width] = v.to_bytes(width, "little")
            elif kind == 3:
                del b[rng.randrange(len(b)):]
            elif kind == 4:
                del b[pos:pos + rng.randint(1, 16)]
            elif kind == 5:
                b[pos:pos] = bytes(rng.randrange(256) for _ in range(rng.randint(1, 16)))
            else:
                src = rng.randrange(len(b)); ln = rng.randint(1, 32)
                b[pos:pos + ln] = b[src:src + ln]
        return bytes(b)

    path = os.path.join(out_dir, "mutant" + suffix)
    accepted = 0
    for i in range(n):
        data = mutate(seed)
        with open(path, "wb") as f:
            f.write(data)
        try:
            src = opener(path)
            try:
                stack = [""]
                while stack:
                    lvl = src.level(stack.pop())
                    for child in lvl.children.values():
                        if child.kind == "level":
                            stack.append(child.path)
                        elif child.kind == "leaf":
                            t = tensor_from_spec(child.leaf, src.files)
                            if t.dtype.is_floating_point or t.dtype == torch.uint8:
                                t.sum()
                if hasattr(src, "dequantize"):
                    for k in list(src.tensor_info):
                        src.dequantize(k)
            finally:
                src.close()
            accepted += 1
        except TdzError:
            pass
        except BaseException:
            keep = os.path.join(out_dir, f"failing{suffix}")
            os.replace(path, keep)
            traceback.print_exc()
            print(f"FUZZ FAILURE at iteration {i}, mutant kept in {keep}", flush=True)
            sys.exit(3)
    print("FUZZ OK", n, "accepted", accepted)
    """
)


def fuzz_iterations(default: int) -> int:
    """Iterations per fuzz test: ``default``, or ``$TDZ_FUZZ_ITERS`` when set (long runs)."""
    return int(os.environ.get("TDZ_FUZZ_ITERS", default))


def require_fuzz_selected(request) -> None:
    """Skips a long ``@pytest.mark.fuzz`` test unless the run selected it with ``-m fuzz``."""
    import pytest

    if "fuzz" not in (request.config.getoption("markexpr", "") or ""):
        pytest.skip("long fuzzing run: select it with -m fuzz")


def run_fuzz(
    seed: Path,
    reader: str,
    n: int,
    tmp_path: Path,
    *,
    rseed: int = 0,
    head: int = 0,
    timeout: float = 120.0,
    mem_mib: int = 6144,
    suffix: str = "",
) -> int:
    """Runs ``n`` mutants of ``seed`` through ``reader`` ("module.function") in a child process.

    ``head``: mutate mostly the first ``head`` bytes (the header). Fails with
    the child's output when it crashes, hangs past ``timeout`` seconds, or
    raises anything but a ``TdzError``. Returns how many mutants were accepted
    (opened and every leaf read), so that a caller can assert the fuzz reaches
    past the first check.
    """
    env = dict(os.environ)
    env.setdefault("PYTHONPATH", str(Path(__file__).resolve().parents[1]))
    cmd = [
        sys.executable,
        "-c",
        _CHILD,
        str(seed),
        reader,
        str(n),
        str(rseed),
        str(mem_mib),
        str(head),
        str(tmp_path),
        suffix,
    ]
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=env)
    except subprocess.TimeoutExpired as e:
        raise AssertionError(
            f"fuzzing {reader} hung (> {timeout} s); last mutant in {tmp_path}: {e.stdout}"
        ) from None
    if proc.returncode != 0 or "FUZZ OK" not in proc.stdout:
        raise AssertionError(
            f"fuzzing {reader}: exit {proc.returncode}\n{proc.stdout[-4000:]}\n{proc.stderr[-4000:]}"
        )
    return int(proc.stdout.rsplit("accepted", 1)[1].split()[0])
