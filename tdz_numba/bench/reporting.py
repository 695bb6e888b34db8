"""The text report of a benchmark run: tables, ratios, goal checks."""

from __future__ import annotations

import os
import platform
import shlex

from .constants import COMPRESSED_FORMATS, CRC_FORMAT, FORMATS, GOAL_SCALING, GOAL_SINGLE, GOAL_VS_TD
from .harness import BenchResult

__all__ = ["format_table", "goal_lines", "goals", "report", "machine_info", "human"]

# -- reporting ----------------------------------------------------------------------------------


def _fmt_ms(ms: float) -> str:
    if ms >= 1000:
        return f"{ms:.0f} ms"
    if ms >= 100:
        return f"{ms:.1f} ms"
    if ms >= 10:
        return f"{ms:.1f} ms"
    if ms >= 1:
        return f"{ms:.2f} ms"
    return f"{ms:.3f} ms"


def _fmt_ratio(r: float) -> str:
    if r >= 10:
        return f"{r:.0f}x"
    if r >= 0.1:
        return f"{r:.2g}x" if r < 1 else f"{r:.1f}x"
    return f"{r:.2g}x"


def machine_info() -> str:
    """One line: CPUs, platform, python and library versions."""
    import importlib.metadata as md

    def version(dist: str) -> str:
        try:
            return md.version(dist)
        except md.PackageNotFoundError:
            return "missing"

    try:
        affinity = len(os.sched_getaffinity(0))
    except AttributeError:  # pragma: no cover - not Linux
        affinity = os.cpu_count() or 1
    threads = ""
    try:
        import torch

        threads = f" (torch threads {torch.get_num_threads()}"
        import numba

        threads += f", numba threads {numba.config.NUMBA_NUM_THREADS})"  # type: ignore[attr-defined]
    except Exception:  # pragma: no cover
        threads += ")" if threads else ""
    return (
        f"machine: {os.cpu_count()} cpus, {affinity} usable{threads}, {platform.platform()}, "
        f"python {platform.python_version()}, torch {version('torch')}, numba {version('numba')}, "
        f"numpy {version('numpy')}, tensordict {version('tensordict')}, "
        f"safetensors {version('safetensors')}, zlib-ng {version('zlib-ng')}, "
        f"tdz_numba {version('tdz_numba')}"
    )


def _columns(res: BenchResult) -> list[str]:
    """The formats present in the results, in the run's order (then the known orders)."""
    first = COMPRESSED_FORMATS if res.compression else FORMATS
    order = dict.fromkeys([*res.formats, *first, *FORMATS, CRC_FORMAT, *COMPRESSED_FORMATS])
    order.update(dict.fromkeys(r["format"] for r in res.results))
    return [f for f in order if any(r["format"] == f for r in res.results)]


#: Widest line of the report: wider tables are split by columns, prose is wrapped.
WIDTH = 100


def format_table(res: BenchResult, width: int = WIDTH) -> str:
    """Rows = (workload, op), columns = formats; cells ``"12.3 ms (2.1x)"`` where the
    ratio is the cell over tdz_numba's cell of the same row. A table wider than ``width``
    is printed as several, each with the workload and op columns and the formats that fit."""
    cols = _columns(res)
    rows = []
    for wname in res.workloads:
        for op in res.ops:
            if not any(r["workload"] == wname and r["op"] == op for r in res.results):
                continue
            base = res.cell(wname, op, "tdz_numba")
            cells = []
            for f in cols:
                c = res.cell(wname, op, f)
                if c is None:
                    cells.append("-")
                    continue
                text = _fmt_ms(c["median_ms"])
                if base is not None and base["median_ms"] > 0:
                    text += f" ({_fmt_ratio(c['median_ms'] / base['median_ms'])})"
                cells.append(text)
            rows.append([wname, op, *cells])
    header = ["workload", "op", *cols]
    widths = [max(len(str(x)) for x in col) for col in zip(header, *rows)]
    groups: list[list[int]] = [[]]  # the format columns of each table
    used = widths[0] + 2 + widths[1]
    for i in range(2, len(header)):
        if groups[-1] and used + 2 + widths[i] > width:
            groups.append([])
            used = widths[0] + 2 + widths[1]
        groups[-1].append(i)
        used += 2 + widths[i]
    tables = []
    for group in groups:
        keep = [0, 1, *group]
        lines = [
            "  ".join(header[i].ljust(widths[i]) for i in keep).rstrip(),
            "  ".join("-" * widths[i] for i in keep),
        ]
        for row in rows:
            lines.append(
                "  ".join(
                    (row[i].ljust(widths[i]) if i < 2 else row[i].rjust(widths[i])) for i in keep
                ).rstrip()
            )
        tables.append("\n".join(lines))
    return "\n\n".join(tables)


def wrap_lines(lines: list[str], width: int = WIDTH) -> list[str]:
    """Each prose line longer than ``width`` wrapped at spaces, the continuation indented by two."""
    import textwrap

    out: list[str] = []
    for line in lines:
        if len(line) <= width or "\n" in line:
            out.append(line)
            continue
        out.extend(
            textwrap.wrap(line, width, subsequent_indent="  ", break_long_words=False, break_on_hyphens=False)
            or [line]
        )
    return out


def fastest_lines(res: BenchResult) -> list[str]:
    """Per row, the fastest format (the crc32 comparison, the floor, and the compressed
    section's references zlib_ng and tdz_numba_1t aside)."""
    out = []
    for wname in res.workloads:
        for op in res.ops:
            cells = [
                r
                for r in res.results
                if r["workload"] == wname
                and r["op"] == op
                and r["format"] not in (CRC_FORMAT, "floor", "zlib_ng", "tdz_numba_1t")
            ]
            if len(cells) < 2:
                continue
            cells.sort(key=lambda r: r["median_ms"])
            best, second = cells[0], cells[1]
            out.append(
                f"fastest {wname}/{op}: {best['format']} ({_fmt_ms(best['median_ms'])}, "
                f"{second['median_ms'] / best['median_ms']:.2f}x ahead of {second['format']})"
            )
    return out


def enabled_lines(res: BenchResult) -> list[str]:
    """Speedup of tensordict's own API with ``tdz_numba.tensordict.enable()`` over without."""
    out = []
    cell = {(r["workload"], r["op"], r["format"]): r["median_ms"] for r in res.results}
    for wname in res.workloads:
        parts = [
            f"{op} {cell[(wname, op, 'td_tdz')] / cell[(wname, op, 'td_tdz_enabled')]:.1f}x"
            for op in res.ops
            if (wname, op, "td_tdz") in cell and (wname, op, "td_tdz_enabled") in cell
        ]
        if parts:
            out.append(
                f"tensordict API with tdz_numba.tensordict.enable() vs without, {wname}: " + ", ".join(parts)
            )
    return out


def _spread_lines(res: BenchResult) -> list[str]:
    """Cells whose runs spread by more than 50% around the median (noisy machine)."""
    out = []
    for r in res.results:
        runs, med = r["runs_ms"], r["median_ms"]
        if len(runs) >= 3 and med > 0 and (max(runs) - min(runs)) / med > 0.5:
            out.append(f"{r['workload']}/{r['op']}/{r['format']}: runs {min(runs):.1f}..{max(runs):.1f} ms")
    if out:
        return ["noisy cells (max - min > 50% of the median): " + "; ".join(out)]
    return []


def _cores() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # pragma: no cover - not Linux
        return os.cpu_count() or 1


def _level_text(level: int | None) -> str:
    return "None = zlib-ng default (6)" if level is None else str(level)


def goals(res: BenchResult) -> list[dict]:
    """The compressed section's goal checks, per workload and op: ``{"workload", "op",
    "goal", "value", "target", "passed", "text"}`` where ``goal`` is ``"scaling"``
    (tdz_numba 1 thread / all threads >= 0.8 x cores), ``"single_thread"``
    (tdz_numba_1t / zlib_ng <= 1.2) or ``"vs_tensordict"`` (save: td_tdz / tdz_numba >= 2)."""
    cores = _cores()
    out: list[dict] = []

    def ms(w: str, op: str, f: str) -> float | None:
        c = res.cell(w, op, f)
        return c["median_ms"] if c is not None and c["median_ms"] > 0 else None

    for w in res.workloads:
        for op in ("save", "load"):
            full, one, ref = ms(w, op, "tdz_numba"), ms(w, op, "tdz_numba_1t"), ms(w, op, "zlib_ng")
            if full and one:
                target = GOAL_SCALING * cores
                out.append(
                    dict(
                        workload=w,
                        op=op,
                        goal="scaling",
                        value=one / full,
                        target=target,
                        passed=one / full >= target,
                        text=f"{one / full:.2f}x ({_fmt_ms(one)} -> {_fmt_ms(full)})",
                    )
                )
            if one and ref:
                out.append(
                    dict(
                        workload=w,
                        op=op,
                        goal="single_thread",
                        value=one / ref,
                        target=GOAL_SINGLE,
                        passed=one / ref <= GOAL_SINGLE,
                        text=f"{one / ref:.2f}x (tdz_numba_1t {_fmt_ms(one)} vs zlib_ng {_fmt_ms(ref)})",
                    )
                )
        full, td = ms(w, "save", "tdz_numba"), ms(w, "save", "td_tdz")
        if full and td:
            out.append(
                dict(
                    workload=w,
                    op="save",
                    goal="vs_tensordict",
                    value=td / full,
                    target=GOAL_VS_TD,
                    passed=td / full >= GOAL_VS_TD,
                    text=f"{td / full:.2f}x (td_tdz {_fmt_ms(td)} vs tdz_numba {_fmt_ms(full)})",
                )
            )
    return out


def goal_lines(res: BenchResult) -> list[str]:
    """Per workload: size ratios, throughputs, the scaling line and the goal checks."""
    cores = _cores()
    lines: list[str] = []
    gs = goals(res)

    def verdict(g: dict) -> str:
        return f"{g['text']} {'PASS' if g['passed'] else 'FAIL'}"

    for w in res.workloads:
        n = res.nbytes.get(w, 0)
        ratios = [(f, n / b) for (ww, f), b in res.sizes.items() if ww == w and b]
        if ratios:
            lines.append(
                f"size ratio {w} (uncompressed / file, {human(n)}): "
                + ", ".join(f"{f} {r:.2f}x" for f, r in ratios)
            )
        for op in res.ops:
            found = [(f, res.cell(w, op, f)) for f in _columns(res)]
            cells = [(f, c) for f, c in found if c is not None and c["median_ms"] > 0]
            if cells and n:
                lines.append(
                    f"throughput {w}/{op} (uncompressed MB/s): "
                    + ", ".join(f"{f} {n / c['median_ms'] / 1e3:.0f}" for f, c in cells)
                )
        by = {(g["op"], g["goal"]): g for g in gs if g["workload"] == w}
        sc = [(op, by[(op, "scaling")]) for op in ("save", "load") if (op, "scaling") in by]
        if sc:
            lines.append(
                f"scaling {w}: tdz_numba all threads vs num_threads=1: "
                + ", ".join(f"{op} {g['text']}" for op, g in sc)
                + f"; goal >= {GOAL_SCALING:g} x {cores} cores = {GOAL_SCALING * cores:.2f}x: "
                + ", ".join(f"{op} {'PASS' if g['passed'] else 'FAIL'}" for op, g in sc)
            )
        st = [(op, by[(op, "single_thread")]) for op in ("save", "load") if (op, "single_thread") in by]
        if st:
            lines.append(
                f"goal {w}: single thread within {GOAL_SINGLE:g}x of zlib-ng: "
                + ", ".join(f"{op} {verdict(g)}" for op, g in st)
            )
        if ("save", "vs_tensordict") in by:
            lines.append(
                f"goal {w}: save >= {GOAL_VS_TD:g}x faster than tensordict compressed: "
                + verdict(by[("save", "vs_tensordict")])
            )
    if gs:
        failed = [f"{g['workload']}/{g['op']}/{g['goal']}" for g in gs if not g["passed"]]
        lines.append(
            f"goals: {len(gs) - len(failed)} PASS, {len(failed)} FAIL"
            + (f" ({', '.join(failed)})" if failed else "")
        )
    return lines


def _relative(directory: str) -> str:
    """The parent of the artifacts directory, relative to the current directory when inside it
    (a report shows no build machine's absolute paths)."""
    parent = os.path.dirname(directory.rstrip("/")) or "."
    try:
        rel = os.path.relpath(parent)
    except ValueError:  # pragma: no cover - another drive
        return parent
    return "the current directory" if rel == "." else (rel if not rel.startswith("..") else parent)


def report(res: BenchResult, argv: list[str]) -> str:
    """The header, the table and the notes, as printed by ``tdz bench``."""
    mode = (
        "cold (fsync + posix_fadvise DONTNEED of every artifact file before each timed open/read/copy/verify)"
        if res.cold
        else "warm page cache"
    )
    if res.compression is not None:
        mode = mode.replace("open/read/copy/verify", "load")
    lines = [
        "tdz_numba benchmark" + (f": compressed section ({res.compression})" if res.compression else ""),
        machine_info(),
        f"size: {res.size_mib:g} MiB per workload, repeat: {res.repeat} (+1 warm-up, median reported; "
        f"the formats of an op alternate, one run of each per round), cache: {mode}",
    ]
    if res.compression is not None:
        lines.append(
            f"compression: {res.compression}, compresslevel {_level_text(res.compresslevel)}; "
            f"tdz_numba threads: all ({_cores()} usable cores) and 1"
        )
    lines += [
        f"artifacts: a temporary directory in {_relative(res.directory)} on {res.filesystem} "
        "(removed after the run)",
        "reproduce (from the repository root, in its .venv): "
        + shlex.join(["python", "-m", "tdz_numba", "bench", *argv]),
    ]
    for wname, desc in res.workloads.items():
        sizes = ", ".join(f"{f} {human(n)}" for (w, f), n in res.sizes.items() if w == wname)
        lines.append(f"workload {wname}: {desc}" + (f"; artifacts: {sizes}" if sizes else ""))
    lines += ["", format_table(res), ""]
    if res.compression is not None:
        lines.append(
            "cells: median (ratio to tdz_numba in the same row); '-' = not applicable. "
            f"save = write a fresh {res.compression} archive; load = open + inflate + "
            "float(t.sum()) of every leaf (tdz_numba: tdz_numba.load(p, num_threads); td_tdz: "
            f"TensorDict.load_memmap(p, num_threads={os.cpu_count()})). tdz_numba_1t = tdz_numba "
            "with num_threads=1; zlib_ng = one raw-deflate stream per leaf on one thread into "
            "one file (no container, no CRC-32), load = zlib_ng.decompress of each + the sums. "
            "Sums: torch's, numpy's for uint8 leaves (torch's uint8 sum is ~10x slower)."
        )
        lines += goal_lines(res)
    else:
        lines.append(
            "cells: median (ratio to tdz_numba in the same row); '-' = not applicable. "
            "open = lazy open (no payload read); read = open + float(t.sum()) of every leaf "
            "(floor: numpy sum of the in-memory arrays); copy = shutil.copyfile/copytree; "
            f"{CRC_FORMAT} = zlib-ng crc32 on one thread over the payloads that verify checks."
        )
    for wname in res.workloads:
        v = res.cell(wname, "verify", "tdz_numba")
        c = res.cell(wname, "verify", CRC_FORMAT)
        if v is not None:
            n = sum(a for (w, f), a in res.sizes.items() if w == wname and f == "tdz_numba")
            text = f"verify {wname}: tdz_numba.verify {n / v['median_ms'] / 1e6:.2f} GB/s"
            if c is not None:
                text += f", zlib-ng crc32 single thread {n / c['median_ms'] / 1e6:.2f} GB/s"
            text += f" (over {human(n)})"
            if n < 64 << 20:  # --quick sizes: the archive checks and thread start-up are not amortized
                text += (
                    "; at this size verify's fixed costs (structure walk, meta.json of every level, "
                    "thread start-up) dominate: compare at the default 256 MiB"
                )
            lines.append(text)
    lines += fastest_lines(res)
    lines += enabled_lines(res)
    lines += _spread_lines(res)
    lines += [f"note: {n}" for n in res.notes]
    lines.append(f"total wall time: {res.wall_s:.1f} s")
    return "\n".join(wrap_lines(lines))


def human(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} GiB"  # pragma: no cover
