"""``tdz bench --read-formats``: reading every tensor file format with tdz_numba, ztensor and the format's
own library (the zTensor benchmark page's reading table, and issue 27's).

Workloads:

* ``llama``: the tensors of a Llama-3.2-1B-shaped model (embedding, 16 layers of q/k/v/o and MLP
  projections, norms), float16, every matrix's first dimension scaled so that the total is
  ``--size-mib`` (default 512);
* ``small``: ``--small-count`` (default 20,000) distinct float16 tensors of 10 KiB.

Every format is written by its own library (safetensors, ``torch.save``, ``np.savez``, ``gguf``'s
``GGUFWriter``, h5py, onnx; ``.tdz`` by tdz_numba, with tensordict's ``load_memmap`` as its own reader,
safetensors as its flat peer and ztensor reading its own ``.zt``). Modes, each timed from nothing open
to every tensor touched:

* ``view``: open + a zero-copy view of every tensor (where the reader has one: see
  :mod:`.readers`) + one byte of every 4 KiB page of each tensor read (no sum);
* ``cold``: the same after ``posix_fadvise(DONTNEED)`` of the file (fsynced once, when written);
* ``copy``: every tensor into owned memory, then the same touch.

Readers alternate per round (round r: every reader once, the order rotated by r), after one warm-up
round; cells are medians of ``--repeat`` rounds, in ms; each view cell is also split at the touch
(``open + views``: the reader's call and its list of tensors, per tensor). A ``memcpy`` line gives this machine's copy
bandwidth (numpy ``copyto`` of a buffer of the workload's size) for the copy column. Every reader's
tensors are checked (count, bytes and the bytes touched) against what was written.
"""

from __future__ import annotations

import gc
import os
import shutil
import statistics
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from .harness import drop_cache, filesystem_of
from .readers import (
    FORMATS,
    SUFFIX,
    expected_touch,
    llama_shapes,
    make_tensors,
    reader,
    readers_of,
    touch,
    write,
)

__all__ = [
    "READ_FORMATS",
    "READERS",
    "MODES",
    "WORKLOADS",
    "llama_shapes",
    "make_tensors",
    "run_read_formats",
    "read_table",
    "ratio_table",
    "per_tensor_table",
    "cold_stalls",
    "ratios",
    "plot_read",
    "main",
]

READ_FORMATS = FORMATS
READERS = ("tdz_numba", "ztensor", "own", "safetensors")
MODES = ("view", "cold", "copy")
WORKLOADS = ("llama", "small")
DEFAULT_SIZE_MIB = 512.0
DEFAULT_SMALL_COUNT = 20_000
DEFAULT_REPEAT = 5
QUICK_SIZE_MIB = 8.0
QUICK_SMALL_COUNT = 200
QUICK_REPEAT = 1
SHORT = {"tdz_numba": "ours", "ztensor": "zt", "own": "own", "safetensors": "st"}


@dataclass
class ReadResult:
    """Rows of ``{"workload", "format", "reader", "file", "mode", "median_ms", "runs_ms", "gbps",
    "us_per_tensor"}`` and the context (sizes, memcpy bandwidth, notes)."""

    rows: list[dict] = field(default_factory=list)
    nbytes: dict[str, int] = field(default_factory=dict)
    count: dict[str, int] = field(default_factory=dict)
    file_bytes: dict[str, dict[str, int]] = field(default_factory=dict)
    memcpy: dict[str, dict[str, float]] = field(default_factory=dict)
    notes: list[str] = field(default_factory=list)
    repeat: int = DEFAULT_REPEAT
    filesystem: str = ""
    seconds: float = 0.0


def _release(keep: Any) -> None:
    close = getattr(keep, "close", None)
    if callable(close):
        close()


def _memcpy(nbytes: int, repeat: int) -> dict[str, float]:
    """numpy copy bandwidth, GB/s: ``copyto`` between two resident buffers, and ``.copy()`` (allocation
    + page faults + copy, what a loader that allocates pays)."""
    import numpy as np

    src = np.ones(nbytes, np.uint8)
    dst = np.zeros(nbytes, np.uint8)
    copyto, alloc = [], []
    for _ in range(max(3, repeat)):
        t0 = time.perf_counter()
        np.copyto(dst, src)
        copyto.append(time.perf_counter() - t0)
        t0 = time.perf_counter()
        out = src.copy()
        alloc.append(time.perf_counter() - t0)
        del out
    return {
        "copyto_gbps": nbytes / statistics.median(copyto) / 1e9,
        "alloc_copy_gbps": nbytes / statistics.median(alloc) / 1e9,
    }


def _drop(path: Path) -> None:
    """Drops the file's cached pages (``posix_fadvise(DONTNEED)``; it was fsynced once when written)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)


def _rounds(
    cells: dict[str, tuple[Callable[[Path], tuple[list[Any], Any]], Path]],
    repeat: int,
    cold: bool,
    expect: tuple[int, int, int],
    fail: Callable[[str, str], None],
    opened: dict[str, list[float]] | None = None,
) -> dict[str, list[float]]:
    """Round 0 warms every reader up (and checks its tensors), then ``repeat`` timed rounds; round r runs
    every reader once, the order rotated by r. A reader that fails is dropped (``fail(reader, why)``).
    ``opened`` (optional) gets each timed round's ms up to the tensors being made, before the touch."""
    names = list(cells)
    out: dict[str, list[float]] = {n: [] for n in names}
    for r in range(repeat + 1):
        live = [n for n in names if n in out]
        k = r % max(1, len(live))
        for name in live[k:] + live[:k]:
            fn, path = cells[name]
            if cold:
                _drop(path)
            gc.collect()
            gc.disable()
            try:
                t0 = time.perf_counter()
                tensors, keep = fn(path)
                t1 = time.perf_counter()
                total = touch(tensors)
                ms = (time.perf_counter() - t0) * 1e3
            except Exception as exc:
                gc.enable()
                msg = str(exc).splitlines()[0][:160] if str(exc) else ""
                fail(name, f"{type(exc).__name__}: {msg}")
                del out[name]
                continue
            gc.enable()
            if r == 0:
                got = (len(tensors), int(sum(t.nbytes for t in tensors)), total)
                if got != expect:
                    fail(name, f"wrong tensors: (count, bytes, touched sum) {got} != {expect}")
                    del out[name]
            else:
                out[name].append(ms)
                if opened is not None:
                    opened.setdefault(name, []).append((t1 - t0) * 1e3)
            del tensors
            _release(keep)
            del keep
    return out


def run_read_formats(
    *,
    workloads: tuple[str, ...] = WORKLOADS,
    formats: tuple[str, ...] = READ_FORMATS,
    readers: tuple[str, ...] = READERS,
    modes: tuple[str, ...] = MODES,
    size_mib: float = DEFAULT_SIZE_MIB,
    small_count: int = DEFAULT_SMALL_COUNT,
    repeat: int = DEFAULT_REPEAT,
    directory: str | os.PathLike | None = None,
    progress: Callable[[str], None] | None = None,
) -> ReadResult:
    """Writes every format with its own library, then times every reader on it (see the module doc)."""
    say = progress or (lambda s: None)
    started = time.perf_counter()
    res = ReadResult(repeat=repeat)
    root = Path(tempfile.mkdtemp(prefix=".tdz-bench-read-", dir=directory or Path.cwd()))
    res.filesystem = filesystem_of(root)
    try:
        for wname in workloads:
            tensors = make_tensors(wname, size_mib, count=small_count)
            expect = expected_touch(tensors)
            res.count[wname], res.nbytes[wname] = expect[0], expect[1]
            res.memcpy[wname] = _memcpy(expect[1], repeat)
            files: dict[str, Path] = {}
            needed = dict.fromkeys(f for fmt in formats for rd, f in readers_of(fmt).items() if rd in readers)
            for f in needed:
                path = root / f"{wname}{SUFFIX[f]}"
                try:
                    write(f, tensors, path)
                except Exception as exc:  # a missing optional package, a writer's limit
                    res.notes.append(
                        f"{wname}/{f}: not written ({type(exc).__name__}: {exc})".splitlines()[0]
                    )
                    continue
                drop_cache(path)  # fsync once (and drop): a cold run then only drops the pages
                files[f] = path
                res.file_bytes.setdefault(wname, {})[f] = path.stat().st_size
                say(f"[{wname}] wrote {path.name}: {path.stat().st_size / 2**20:.1f} MiB")
            del tensors
            gc.collect()
            for fmt in formats:
                for mode in modes:
                    cells = {
                        rd: (reader(fmt, rd, mode == "copy"), files[f])
                        for rd, f in readers_of(fmt).items()
                        if rd in readers and f in files
                    }
                    if not cells:
                        continue

                    def fail(rd: str, why: str, w: str = wname, fmt: str = fmt, mode: str = mode) -> None:
                        res.notes.append(f"{w}/{fmt}/{rd}/{mode}: failed ({why})")

                    opened: dict[str, list[float]] = {}
                    runs = _rounds(cells, repeat, mode == "cold", expect, fail, opened)
                    for rd, ms in runs.items():
                        if not ms:
                            continue
                        med = statistics.median(ms)
                        open_med = statistics.median(opened[rd])
                        res.rows.append(
                            {
                                "workload": wname,
                                "format": fmt,
                                "reader": rd,
                                "file": readers_of(fmt)[rd],
                                "mode": mode,
                                "median_ms": med,
                                "runs_ms": ms,
                                "gbps": expect[1] / med / 1e6,
                                "us_per_tensor": med * 1e3 / expect[0],
                                "open_ms": open_med,
                                "open_us_per_tensor": open_med * 1e3 / expect[0],
                            }
                        )
                        say(
                            f"[{wname}] {fmt:<12} {mode:<4} {rd:<12} {med:9.2f} ms  {expect[1] / med / 1e6:6.2f} GB/s"
                        )
            for path in files.values():
                path.unlink(missing_ok=True)
    finally:
        shutil.rmtree(root, ignore_errors=True)
    res.seconds = time.perf_counter() - started
    return res


# -- tables --------------------------------------------------------------------------------------------


def _ms(x: float | None) -> str:
    if x is None:
        return "-"
    return f"{x:.2f}" if x < 10 else f"{x:.1f}" if x < 100 else f"{x:.0f}"


def _cell(res: ReadResult, w: str, f: str, rd: str, mode: str) -> dict | None:
    for r in res.rows:
        if (r["workload"], r["format"], r["reader"], r["mode"]) == (w, f, rd, mode):
            return r
    return None


def _grid(header: list[str], rows: list[list[str]]) -> list[str]:
    widths = [max(len(x) for x in col) for col in zip(header, *rows)]
    out = ["  ".join(h.ljust(wd) for h, wd in zip(header, widths)).rstrip()]
    out += ["  ".join(c.ljust(wd) for c, wd in zip(row, widths)).rstrip() for row in rows]
    return out


def read_table(res: ReadResult) -> str:
    """Per workload: rows = formats, columns = modes, cells ``ours / ztensor / own [/ safetensors]`` in ms."""
    lines: list[str] = []
    for w in res.nbytes:
        fmts = list(dict.fromkeys(r["format"] for r in res.rows if r["workload"] == w))
        modes = [m for m in MODES if any(r["mode"] == m and r["workload"] == w for r in res.rows)]
        lines.append(
            f"{w}: {res.nbytes[w] / 2**20:.1f} MiB in {res.count[w]:,} float16 tensors; ms, median of {res.repeat}"
        )
        lines.append("cells: tdz_numba / ztensor / own library (.tdz: own = tensordict, then safetensors)")
        rows = []
        for f in fmts:
            row = [f]
            for m in modes:
                cells = [_cell(res, w, f, rd, m) for rd in readers_of(f)]
                row.append(" / ".join(_ms(c["median_ms"] if c else None) for c in cells))
            rows.append(row)
        lines += _grid(["format", *modes], rows)
        mc = res.memcpy.get(w)
        if mc and "copy" in modes:
            ours = [
                r for r in res.rows if (r["workload"], r["reader"], r["mode"]) == (w, "tdz_numba", "copy")
            ]
            best = max((r["gbps"] for r in ours), default=0.0)
            lines.append(
                f"memcpy {mc['copyto_gbps']:.2f} GB/s (numpy copyto; alloc + copy {mc['alloc_copy_gbps']:.2f}); "
                f"tdz_numba copy best {best:.2f} GB/s = {best / mc['copyto_gbps']:.2f}x"
            )
        lines.append("")
    return "\n".join(lines).rstrip()


def ratios(res: ReadResult) -> list[dict]:
    """Per (workload, format, mode): tdz_numba's median over the best peer's (every other reader)."""
    out = []
    for key in dict.fromkeys((r["workload"], r["format"], r["mode"]) for r in res.rows):
        cells = {r["reader"]: r for r in res.rows if (r["workload"], r["format"], r["mode"]) == key}
        ours = cells.get("tdz_numba")
        peers = [r for rd, r in cells.items() if rd != "tdz_numba"]
        if ours is None or not peers:
            continue
        best = min(peers, key=lambda r: r["median_ms"])
        out.append(
            {
                "workload": key[0],
                "format": key[1],
                "mode": key[2],
                "ratio": ours["median_ms"] / best["median_ms"],
                "best_peer": best["reader"],
                "ours_ms": ours["median_ms"],
                "best_ms": best["median_ms"],
            }
        )
    return out


def ratio_table(res: ReadResult) -> str:
    """Rows = (workload, format), columns = modes, cells ``ours / best peer`` (``*``: > 1.0, a goal missed),
    plus us per tensor of the view mode (every reader) at the workload's count."""
    rs = ratios(res)
    keys = list(dict.fromkeys((r["workload"], r["format"]) for r in rs))
    modes = [m for m in MODES if any(r["mode"] == m for r in rs)]
    rows = []
    for w, f in keys:
        row = [w, f]
        for m in modes:
            c = [r for r in rs if (r["workload"], r["format"], r["mode"]) == (w, f, m)]
            row.append(
                f"{c[0]['ratio']:.2f} {SHORT[c[0]['best_peer']]}{'*' if c[0]['ratio'] > 1 else ''}"
                if c
                else "-"
            )
        per = [_cell(res, w, f, rd, "view") for rd in readers_of(f)]
        row.append(" / ".join(f"{c['us_per_tensor']:.1f}" if c else "-" for c in per))
        rows.append(row)
    lines = ["ratio: tdz_numba time / best peer's (the peer named; * = slower than it)"]
    lines += _grid(["workload", "format", *modes, "view us/tensor (ours/zt/own)"], rows)
    missed = sum(r["ratio"] > 1 for r in rs)
    lines.append(f"{missed} of {len(rs)} cells slower than the best peer")
    return "\n".join(lines)


def per_tensor_table(res: ReadResult) -> str:
    """Per (workload, format): us per tensor of the view mode, every reader, split at the touch:
    ``open + views`` (the reader's call and the list of tensors, nothing touched) and the whole cell."""
    rows = []
    for w in res.nbytes:
        for f in dict.fromkeys(r["format"] for r in res.rows if r["workload"] == w):
            per = [_cell(res, w, f, rd, "view") for rd in readers_of(f)]
            if not any(per):
                continue
            opens = " / ".join(f"{c['open_us_per_tensor']:.1f}" if c and "open_ms" in c else "-" for c in per)
            whole = " / ".join(f"{c['us_per_tensor']:.1f}" if c else "-" for c in per)
            rows.append([w, f, opens, whole])
    if not rows:
        return ""
    lines = ["view mode, us per tensor (ours / zt / own): open + views (no touch), whole cell"]
    lines += _grid(["workload", "format", "open + views", "with the touch"], rows)
    return "\n".join(lines)


#: A cold round slower than this many times its cell's fastest round counts as a stall (the
#: disk's: on this machine's shared virtual disk a cold 512 MiB read takes ~0.25 s or ~0.6-1 s).
STALL = 1.5


def cold_stalls(res: ReadResult) -> str:
    """Per (workload, format) of the cold mode: each reader's rounds slower than :data:`STALL`
    times the fastest round of its cell, out of its rounds (``3/11``): how much a cold median
    rests on the disk's stalls rather than on the reader ("" when no cell has one)."""
    rows = []
    for w, f in dict.fromkeys((r["workload"], r["format"]) for r in res.rows if r["mode"] == "cold"):
        runs = [(_cell(res, w, f, rd, "cold") or {}).get("runs_ms") for rd in readers_of(f)]
        stalled = [sum(x > STALL * min(v) for x in v) if v else None for v in runs]
        if not any(stalled):
            continue
        text = [f"{k}/{len(v)}" if v else "-" for k, v in zip(stalled, runs)]
        rows.append([w, f, " / ".join(text)])
    if not rows:
        return ""
    lines = [f"cold rounds over {STALL}x their cell's fastest (disk stalls; ours / zt / own)"]
    lines += _grid(["workload", "format", "stalled rounds"], rows)
    return "\n".join(lines)


def report(res: ReadResult) -> str:
    """The whole text: context, the ms table, the ratio table, file sizes and notes."""
    lines = [
        f"tdz bench --read-formats: readers alternating per round, median of {res.repeat} after a warm-up",
        f"files on {res.filesystem}",
        read_table(res),
        "",
        ratio_table(res),
        "",
        per_tensor_table(res),
    ]
    stalls = cold_stalls(res)
    if stalls:
        lines += ["", stalls]
    for w, sizes in res.file_bytes.items():
        text = ", ".join(f"{f} {n / res.nbytes[w]:.3f}x" for f, n in sizes.items())
        lines.append(f"{w} file size / payload: {text}")
    lines += [f"note: {n}" for n in res.notes]
    lines.append(f"run time: {res.seconds:.0f} s")
    return "\n".join(lines)


def plot_read(res: ReadResult, path: str | os.PathLike) -> Path:
    """Bars of tdz_numba's time over the best peer's per (format, mode), one panel per workload, log scale."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rs = ratios(res)
    panels = list(dict.fromkeys(r["workload"] for r in rs)) or ["-"]
    fig, axes = plt.subplots(len(panels), 1, figsize=(10, 3.4 * len(panels) + 0.4), squeeze=False)
    colors = {"view": "#d62728", "cold": "#1f77b4", "copy": "#2ca02c"}
    for ax, w in zip(axes[:, 0], panels):
        fmts = list(dict.fromkeys(r["format"] for r in rs if r["workload"] == w))
        width = 0.8 / len(MODES)
        for j, m in enumerate(MODES):
            xs, ys = [], []
            for i, f in enumerate(fmts):
                c = [r for r in rs if (r["workload"], r["format"], r["mode"]) == (w, f, m)]
                if c:
                    xs.append(i + (j - (len(MODES) - 1) / 2) * width)
                    ys.append(c[0]["ratio"])
            ax.bar(xs, ys, width, label=m, color=colors[m])
        ax.axhline(1.0, color="black", linewidth=0.8)
        ax.set_yscale("log")
        ax.set_xticks(range(len(fmts)))
        ax.set_xticklabels(fmts)
        ax.set_ylabel("tdz_numba / best peer\n(< 1: tdz_numba faster)")
        n = res.count.get(w, 0)
        ax.set_title(f"{w}: {res.nbytes.get(w, 0) / 2**20:.0f} MiB, {n:,} tensors", fontsize=9)
        ax.legend(fontsize=7, ncol=3)
    fig.tight_layout()
    out = Path(path)
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=110)
    plt.close(fig)
    return out


def main(argv: list[str], prog: str = "tdz bench --read-formats") -> int:
    """``tdz bench --read-formats``: see the module docstring."""
    import argparse
    import json
    import sys

    def names(
        allowed: tuple[str, ...], alias: dict[str, str] | None = None
    ) -> Callable[[str], tuple[str, ...]]:
        def parse(text: str) -> tuple[str, ...]:
            got = tuple((alias or {}).get(s.strip(), s.strip()) for s in text.split(",") if s.strip())
            bad = [g for g in got if g not in allowed]
            if bad or not got:
                raise argparse.ArgumentTypeError(f"choose from {', '.join(allowed)}")
            return tuple(dict.fromkeys(got))

        return parse

    p = argparse.ArgumentParser(prog=prog, description=__doc__.split("\n\n")[0])
    p.add_argument("--workload", type=names(WORKLOADS, {"mixed": "llama"}), default=WORKLOADS)
    p.add_argument("--format", type=names(READ_FORMATS), default=READ_FORMATS)
    p.add_argument("--reader", type=names(READERS), default=READERS)
    p.add_argument("--mode", type=names(MODES), default=MODES)
    p.add_argument(
        "--size-mib",
        type=float,
        default=None,
        help=f"MiB of the llama workload (default {DEFAULT_SIZE_MIB:g})",
    )
    p.add_argument(
        "--small-count",
        type=int,
        default=None,
        help=f"tensors of the small workload (default {DEFAULT_SMALL_COUNT:,})",
    )
    p.add_argument(
        "--repeat", type=int, default=None, help=f"timed rounds after a warm-up (default {DEFAULT_REPEAT})"
    )
    p.add_argument(
        "--quick",
        action="store_true",
        help=f"llama {QUICK_SIZE_MIB:g} MiB, small {QUICK_SMALL_COUNT:,} tensors, repeat {QUICK_REPEAT} (< 1 minute)",
    )
    p.add_argument(
        "--dir",
        type=Path,
        default=None,
        help="where files go (default: the current directory; not tmpfs for cold)",
    )
    p.add_argument(
        "--json", action="store_true", help="print the results as JSON (the report goes to stderr)"
    )
    p.add_argument(
        "--plot", type=Path, default=None, metavar="OUT.png", help="bar chart of the ratios (matplotlib)"
    )
    p.add_argument("-v", "--verbose", action="store_true", help="print each cell to stderr as it is measured")
    args = p.parse_args(argv)
    size = (
        args.size_mib if args.size_mib is not None else (QUICK_SIZE_MIB if args.quick else DEFAULT_SIZE_MIB)
    )
    count = (
        args.small_count
        if args.small_count is not None
        else (QUICK_SMALL_COUNT if args.quick else DEFAULT_SMALL_COUNT)
    )
    repeat = args.repeat if args.repeat is not None else (QUICK_REPEAT if args.quick else DEFAULT_REPEAT)
    if size <= 0 or count < 1 or repeat < 1:
        p.error("--size-mib must be > 0, --small-count >= 1 and --repeat >= 1")
    res = run_read_formats(
        workloads=args.workload,
        formats=args.format,
        readers=args.reader,
        modes=args.mode,
        size_mib=size,
        small_count=count,
        repeat=repeat,
        directory=args.dir,
        progress=(lambda s: print(s, file=sys.stderr, flush=True)) if args.verbose else None,
    )
    text = report(res)
    if args.plot is not None:
        text += f"\nplot: {plot_read(res, args.plot)}"
    if args.json:
        print(text, file=sys.stderr, flush=True)
        doc = {
            "rows": res.rows,
            "ratios": ratios(res),
            "memcpy": res.memcpy,
            "nbytes": res.nbytes,
            "count": res.count,
            "file_bytes": res.file_bytes,
            "notes": res.notes,
            "repeat": res.repeat,
            "seconds": res.seconds,
        }
        print(json.dumps(doc, indent=1))
    else:
        print(text, flush=True)
    return 0
