"""Issue 24's figures from one run: the streaming Writer's memory and speed against ``save``, the
incremental re-save of a checkpoint of which 2% changed, and the ``kill -9`` campaign on append.

* Writer: 1 GiB as 48 leaves of 16 MiB from a generator plus one 256 MiB leaf streamed in 16 MiB
  pieces, durable; peak RSS growth measured in a child process (``ru_maxrss`` after the write minus
  before it), time against ``save`` of the same tree (alternating, medians).
* Incremental: a 1 GiB checkpoint of 512 leaves of 2 MiB; 2% of them (10 leaves) change; the
  re-save is ``append(path, tree, replace=True, only_changed=True)`` against ``save`` of the whole
  tree (alternating, medians; durable), for an archive without digests (each leaf compared by CRC-32,
  then byte for byte) and one saved with ``digest=True`` (compared by digest, no payload read).
* Kill campaign: ``tests/test_append.py::test_kill_campaign`` (SIGKILL at random instants of
  appends, then open, repair and every zip tool), its counts.

Usage: ``python scripts/growth_figures.py [--rounds 3] [--dir DIR]`` (a few minutes, 3 GiB of disk).
"""

from __future__ import annotations

import argparse
import os
import re
import statistics
import subprocess
import sys
import tempfile
import textwrap
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

_CHILD = textwrap.dedent(
    r"""
    import resource, sys, torch, tdz_numba
    path, how = sys.argv[1], sys.argv[2]
    MIB = 1 << 20
    def leaves():
        for i in range(48):
            yield f"w/{i}", torch.full((16 * MIB,), i % 251, dtype=torch.uint8)
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    if how == "writer":
        with tdz_numba.Writer(path) as w:
            for k, v in leaves():
                w.add(k, v)
                del v
            with w.stream("big", (256 * MIB,), torch.uint8) as sink:
                piece = torch.empty(16 * MIB, dtype=torch.uint8)
                for j in range(16):
                    piece.fill_(j)
                    sink.write(piece)
    else:
        tree = {"w": {k.split("/")[1]: v for k, v in leaves()}, "big": torch.zeros(256 * MIB, dtype=torch.uint8)}
        tdz_numba.save(tree, path)
    print((resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before) / 1024)
    """
)


def _child(path: Path, how: str) -> tuple[float, float]:
    t0 = time.perf_counter()
    out = subprocess.run(
        [sys.executable, "-c", _CHILD, str(path), how], capture_output=True, text=True, check=True
    )
    return time.perf_counter() - t0, float(out.stdout.strip())


def writer_figures(d: Path, rounds: int) -> dict:
    times: dict[str, list[float]] = {"writer": [], "save": []}
    rss: dict[str, list[float]] = {"writer": [], "save": []}
    for r in range(rounds):
        for how in ("writer", "save") if r % 2 == 0 else ("save", "writer"):
            p = d / f"{how}.tdz"
            t, m = _child(p, how)
            times[how].append(t)
            rss[how].append(m)
            p.unlink()
    return {k: (statistics.median(times[k]), max(rss[k])) for k in times}


def incremental_figures(d: Path, rounds: int, digest: bool) -> tuple[float, float, int]:
    import torch

    import tdz_numba

    g = torch.Generator().manual_seed(0)
    tree = {
        f"l{i:03d}": torch.randint(0, 255, (2 << 20,), generator=g, dtype=torch.uint8) for i in range(512)
    }
    p = tdz_numba.save(tree, d / "ckpt.tdz", digest=digest)
    inc, full, written = [], [], 0
    for r in range(rounds):
        for k in range(10):  # 2% of the leaves change
            tree[f"l{(r * 37 + k * 51) % 512:03d}"] = torch.randint(
                0, 255, (2 << 20,), generator=g, dtype=torch.uint8
            )
        order = ("inc", "full") if r % 2 == 0 else ("full", "inc")
        for how in order:
            t0 = time.perf_counter()
            if how == "inc":
                res = tdz_numba.append(p, tree, replace=True, only_changed=True)
                inc.append(time.perf_counter() - t0)
                written = len(getattr(res, "changed", None) or []) or written
            else:
                tdz_numba.save(tree, d / "full.tdz", digest=digest)
                full.append(time.perf_counter() - t0)
        tdz_numba.compact(p)  # the next round starts from a compact file
    return statistics.median(inc), statistics.median(full), written


def kill_campaign() -> str:
    env = dict(os.environ, TDZ_KILL_RUNS=os.environ.get("TDZ_KILL_RUNS", "20"))
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "pytest",
            "-q",
            "-s",
            "-p",
            "no:cacheprovider",
            "tests/test_append.py::test_kill_campaign",
            "-o",
            "addopts=",
        ],
        cwd=ROOT,
        capture_output=True,
        text=True,
        env=env,
    )
    m = re.search(r"kill campaign: .*", proc.stdout)
    return (m.group(0) if m else "no result") + (
        "" if proc.returncode == 0 else f" (FAILED, rc {proc.returncode})"
    )


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--dir", type=Path, default=None, help="where the files go (default: a temp dir)")
    args = ap.parse_args(argv)
    with tempfile.TemporaryDirectory(dir=args.dir) as t:
        d = Path(t)
        w = writer_figures(d, args.rounds)
        print(
            f"Writer 1 GiB (48 x 16 MiB + 256 MiB streamed): {w['writer'][0]:.2f} s, peak RSS growth "
            f"{w['writer'][1]:.0f} MiB; save of the same tree {w['save'][0]:.2f} s, {w['save'][1]:.0f} MiB; "
            f"Writer / save = {w['writer'][0] / w['save'][0]:.2f}x (medians of {args.rounds}, in child processes)"
        )
        for digest in (False, True):
            inc, full, _ = incremental_figures(d, args.rounds, digest)
            how = "by stored XXH3 digests" if digest else "by CRC-32, then the bytes"
            print(
                f"incremental re-save, 1 GiB of 512 x 2 MiB, 2% changed, compared {how}: "
                f"append(only_changed=True) {inc * 1e3:.0f} ms, save {full * 1e3:.0f} ms: "
                f"{full / inc:.1f}x faster (medians of {args.rounds})"
            )
    print(kill_campaign())
    return 0


if __name__ == "__main__":
    sys.exit(main())
