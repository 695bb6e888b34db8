"""``tdz bench --leaves N,N,...``: cost per leaf from a few hundred to a hundred thousand leaves.

Workload: ``--size-mib`` (default 64) of random float32 split into N equal leaves,
nested in groups of 20 (``{"g00000": {"l00": t, ...}, ...}``; safetensors and
torch get the same tensors under flat ``"g00000/l00"`` keys). For every N
(default 200, 2,000, 20,000, 100,000) and format:

* ``tdz_numba``: ``save`` (library defaults, ``durable`` as ``--durable``; with
  ``--durable``, the default, also ``save-nofsync``: ``durable=False``, the
  like-for-like peer of ``save_file`` and ``torch.save``, which do not ``fsync``),
  lazy ``open`` (``tdz_numba.open(p).keys()``), ``load+sum`` (``load`` and
  ``float(t.sum())`` of every leaf);
* ``safetensors``: ``save_file``, ``safe_open(p, "pt").keys()``, ``load_file`` + sums;
* ``torch``: ``torch.save``, ``torch.load(p, mmap=True)`` (its lazy open) and the same + sums.

Median of ``--repeat`` (default 3) timed runs after one warm-up, the formats of
an op measured in alternating rounds (one run of each in turn); every save
writes a fresh path (the previous one is removed outside the timed region);
the garbage collector runs before and is off during each timed run. The table
gives milliseconds, microseconds per leaf and tdz_numba / safetensors ratios;
``--plot OUT.png`` draws microseconds per leaf against N (log-log), one line
per format, one panel per operation.
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import sys
import tempfile
from collections.abc import Callable, Iterable
from functools import partial
from pathlib import Path
from typing import Any

__all__ = [
    "DEFAULT_LEAVES",
    "FORMATS",
    "OPS",
    "NOFSYNC",
    "make_leaves",
    "run_sweep",
    "sweep_table",
    "plot_sweep",
    "main",
]

DEFAULT_LEAVES = (200, 2_000, 20_000, 100_000)
FORMATS = ("tdz_numba", "safetensors", "torch")
OPS = ("save", "open", "load+sum")
#: The extra op of ``tdz_numba`` when ``durable``: its save without ``fsync``.
NOFSYNC = "save-nofsync"
GROUP = 20


def make_leaves(n: int, size_mib: float, seed: int = 0) -> tuple[dict[str, Any], dict[str, Any]]:
    """``(nested, flat)``: ``size_mib`` of random float32 as ``n`` leaves in groups of 20 (same tensors)."""
    import torch

    per = max(1, int(size_mib * 2**20) // 4 // n)
    data = torch.randn(n * per, generator=torch.Generator().manual_seed(seed))
    nested: dict[str, Any] = {}
    flat: dict[str, Any] = {}
    for i, t in enumerate(data.split(per)):
        t = t.clone()  # own storage per leaf, as a real checkpoint has
        group, leaf = f"g{i // GROUP:05d}", f"l{i % GROUP:02d}"
        nested.setdefault(group, {})[leaf] = t
        flat[f"{group}/{leaf}"] = t
    return nested, flat


def _sum(tree: Any) -> float:
    import torch

    total = 0.0
    stack = [tree]
    while stack:
        node = stack.pop()
        for v in node.values():
            if isinstance(v, torch.Tensor):
                total += float(v.sum())
            else:
                stack.append(v)
    return total


def _ops(fmt: str, nested: dict, flat: dict, durable: bool) -> dict[str, Callable[[Path], Any]]:
    if fmt == "tdz_numba":
        import tdz_numba

        def t_open(p: Path) -> Any:
            ar = tdz_numba.open(p)
            keys = list(ar.keys())
            ar.close()
            return keys

        return {
            "save": lambda p: tdz_numba.save(nested, p, durable=durable),
            "open": t_open,
            "load+sum": lambda p: _sum(tdz_numba.load(p)),
        }
    if fmt == "safetensors":
        from safetensors import safe_open
        from safetensors.torch import load_file, save_file

        def s_open(p: Path) -> Any:
            with safe_open(str(p), "pt") as f:
                return list(f.keys())

        return {
            "save": lambda p: save_file(flat, str(p)),
            "open": s_open,
            "load+sum": lambda p: _sum(load_file(str(p))),
        }
    import torch

    return {
        "save": lambda p: torch.save(flat, p),
        "open": lambda p: torch.load(p, mmap=True, weights_only=True),
        "load+sum": lambda p: _sum(torch.load(p, mmap=True, weights_only=True)),
    }


def run_sweep(
    *,
    leaves: Iterable[int] = DEFAULT_LEAVES,
    formats: Iterable[str] = FORMATS,
    size_mib: float = 64.0,
    repeat: int = 3,
    durable: bool = True,
    directory: str | os.PathLike | None = None,
    progress: Callable[[str], None] | None = None,
) -> list[dict[str, Any]]:
    """Runs the sweep; one row per (N, format, op): ``{"leaves", "format", "op", "seconds", "us_per_leaf"}``.

    Per N and op, the formats are measured in alternating rounds
    (:func:`~tdz_numba.bench.harness.measure_rounds`); the saves come first and leave
    each format's artifact for its open and load."""
    from .harness import Cell, measure_rounds

    formats = list(formats)
    rows: list[dict[str, Any]] = []
    root = Path(tempfile.mkdtemp(prefix="tdz-leaves-", dir=directory))
    try:
        for n in leaves:
            nested, flat = make_leaves(n, size_mib)
            seconds: dict[str, float] = {}
            for op in OPS:
                cells: dict[str, Cell] = {}
                for fmt in formats:
                    path = root / f"{fmt}-{n}.bin"
                    call = _ops(fmt, nested, flat, durable)[op]
                    cells[f"{fmt}|{op}"] = Cell(
                        partial(_call, call, path), partial(_fresh, path) if op == "save" else None
                    )
                    if op == "save" and fmt == "tdz_numba" and durable:  # and like-for-like with peers
                        spare = root / f"{fmt}-{n}-nofsync.bin"  # that do not fsync
                        call = _ops(fmt, nested, flat, False)["save"]
                        cells[f"{fmt}|{NOFSYNC}"] = Cell(
                            partial(_call, call, spare),
                            partial(_fresh, spare),
                            cleanup=partial(_fresh, spare, 0),
                        )
                for key, runs in measure_rounds(cells, repeat).items():
                    if isinstance(runs, BaseException):
                        raise runs
                    seconds[key] = statistics.median(runs) / 1e3
            for fmt in formats:
                (root / f"{fmt}-{n}.bin").unlink(missing_ok=True)
                for op in (*OPS, NOFSYNC):
                    s = seconds.get(f"{fmt}|{op}")
                    if s is None:
                        continue
                    rows.append(
                        {"leaves": n, "format": fmt, "op": op, "seconds": s, "us_per_leaf": s * 1e6 / n}
                    )
                    if progress is not None:
                        progress(
                            f"N={n:>7,} {fmt:<12} {op:<9} {s * 1e3:10.2f} ms  {s * 1e6 / n:8.2f} us/leaf"
                        )
            del nested, flat
    finally:
        shutil.rmtree(root, ignore_errors=True)
    return rows


def _call(fn: Callable[[Path], Any], path: Path, i: int) -> Any:
    return fn(path)


def _fresh(path: Path, i: int) -> None:
    path.unlink(missing_ok=True)


def sweep_table(rows: list[dict[str, Any]]) -> str:
    """The sweep as text: per N and op, ms and us/leaf of each format, and tdz_numba / safetensors
    (a ``save-nofsync`` row, when measured, is tdz_numba's save without ``fsync`` / safetensors' save)."""
    cell = {(r["leaves"], r["format"], r["op"]): r["seconds"] for r in rows}
    leaves = sorted({r["leaves"] for r in rows})
    formats = list(dict.fromkeys(r["format"] for r in rows))
    head = f"{'N leaves':>9} {'op':<12}" + "".join(f" {f + ' ms':>16} {'us/leaf':>8}" for f in formats)
    ratio = "tdz_numba" in formats and "safetensors" in formats
    lines = [head + (f" {'tdz/st':>7}" if ratio else "")]
    for n in leaves:
        for op in OPS:
            if (n, formats[0], op) not in cell:
                continue
            line = f"{n:>9,} {op:<12}"
            for f in formats:
                s = cell.get((n, f, op))
                line += f" {s * 1e3:16.2f} {s * 1e6 / n:8.2f}" if s is not None else f" {'-':>16} {'-':>8}"
            if ratio:
                line += f" {cell[(n, 'tdz_numba', op)] / cell[(n, 'safetensors', op)]:6.2f}x"
            lines.append(line)
            if op == "save" and (n, "tdz_numba", NOFSYNC) in cell:
                s = cell[(n, "tdz_numba", NOFSYNC)]
                line = f"{n:>9,} {NOFSYNC:<12}"
                for f in formats:
                    line += (
                        f" {s * 1e3:16.2f} {s * 1e6 / n:8.2f}" if f == "tdz_numba" else f" {'-':>16} {'-':>8}"
                    )
                if ratio:
                    line += f" {s / cell[(n, 'safetensors', 'save')]:6.2f}x"
                lines.append(line)
    if len(leaves) > 1:
        lo, hi = leaves[0], leaves[-1]
        for f in formats:
            growth = [
                f"{op} {cell[(hi, f, op)] / cell[(lo, f, op)]:.1f}x" for op in OPS if (lo, f, op) in cell
            ]
            lines.append(
                f"{f}: cost from {lo:,} to {hi:,} leaves ({hi / lo:g}x the leaves): {', '.join(growth)}"
            )
    return "\n".join(lines)


def plot_sweep(rows: list[dict[str, Any]], path: str | os.PathLike) -> Path:
    """Microseconds per leaf against N, log-log, one panel per op, one line per format (matplotlib)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(OPS), figsize=(4.2 * len(OPS), 3.6), sharex=True)
    for ax, op in zip(axes, OPS):
        for fmt in dict.fromkeys(r["format"] for r in rows):
            pts = sorted(
                (r["leaves"], r["us_per_leaf"]) for r in rows if r["format"] == fmt and r["op"] == op
            )
            if pts:
                ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", label=fmt)
        ax.set_xscale("log")
        ax.set_yscale("log")
        ax.set_title(op)
        ax.set_xlabel("leaves (N)")
        ax.grid(True, which="both", alpha=0.3)
    axes[0].set_ylabel("us per leaf (median)")
    axes[-1].legend()
    fig.tight_layout()
    out = Path(path)
    fig.savefig(out, dpi=110)
    plt.close(fig)
    return out


def _leaf_counts(text: str) -> list[int]:
    try:
        counts = [int(s.replace("_", "")) for s in text.split(",") if s.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated leaf counts, got {text!r}") from None
    if not counts or min(counts) < 1:
        raise argparse.ArgumentTypeError(f"leaf counts must be >= 1, got {text!r}")
    return counts


def main(argv: list[str], prog: str = "tdz bench --leaves") -> int:
    """``tdz bench --leaves N,N,...``: see the module docstring."""
    import json

    p = argparse.ArgumentParser(prog=prog, description=__doc__.split("\n\n")[0])
    p.add_argument(
        "--leaves",
        type=_leaf_counts,
        default=list(DEFAULT_LEAVES),
        metavar="N,N,...",
        help="leaf counts (default 200,2000,20000,100000)",
    )
    p.add_argument("--format", default=",".join(FORMATS), help="comma list of " + ", ".join(FORMATS))
    p.add_argument(
        "--size-mib", type=float, default=64.0, help="MiB of float32 split into the leaves (default 64)"
    )
    p.add_argument("--repeat", type=int, default=3, help="timed runs per cell after a warm-up (default 3)")
    p.add_argument(
        "--durable",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="tdz_numba.save(durable=...) (default: True, the library default)",
    )
    p.add_argument("--dir", type=Path, default=None, help="where artifacts go (a temporary sub-directory)")
    p.add_argument(
        "--json", action="store_true", help="print the rows as JSON on stdout (the table on stderr)"
    )
    p.add_argument(
        "--plot", type=Path, default=None, metavar="OUT.png", help="us per leaf against N, log-log"
    )
    p.add_argument("-v", "--verbose", action="store_true", help="print each cell to stderr as it is measured")
    args = p.parse_args(argv)
    formats = [s for s in args.format.split(",") if s]
    bad = [f for f in formats if f not in FORMATS]
    if bad or args.repeat < 1 or args.size_mib <= 0:
        p.error(f"unknown format {', '.join(bad)}" if bad else "--repeat and --size-mib must be > 0")
    rows = run_sweep(
        leaves=args.leaves,
        formats=formats,
        size_mib=args.size_mib,
        repeat=args.repeat,
        durable=args.durable,
        directory=args.dir,
        progress=(lambda s: print(s, file=sys.stderr, flush=True)) if args.verbose else None,
    )
    fsync = (
        f"tdz_numba save durable=True (fsync); {NOFSYNC}: durable=False, like safetensors' save_file "
        "(no fsync): the like-for-like ratio"
        if args.durable
        else "tdz_numba save durable=False (no fsync, as safetensors' save_file)"
    )
    text = (
        f"tdz_numba leaf-count sweep: {args.size_mib:g} MiB float32 in N leaves (groups of {GROUP}), "
        f"median of {args.repeat}; {fsync}\n{sweep_table(rows)}"
    )
    if args.plot is not None:
        text += f"\nplot: {plot_sweep(rows, args.plot)}"
    if args.json:
        print(text, file=sys.stderr)
        print(json.dumps(rows, indent=1))
    else:
        print(text)
    return 0
