"""``tdz bench --alignment``: what payload alignment costs and buys (the zTensor page's alignment table).

Workloads (``--size-mib``, default 512, float16):

* ``large``: 8 big matrices;
* ``mixed``: Llama-3.2-1B shapes (as ``--read-formats``);
* ``small``: tensors of ~10 KB (512 MiB: about 51,000).

Writers: tdz_numba ``save(align=64)`` (tensordict's bytes), ``align=4096``, ``align=65536`` and
``align="auto"`` (leaves >= 1 MiB on 64 KiB boundaries, the rest at 64 B), next to ztensor's canonical
writer (every tensor on 64 KiB, with digests) and its ``align=4096`` writer, on the same tensors.
Columns: file size / payload, save GB/s (median), the share of leaves >= 1 MiB whose payload starts on a
page (evictable one by one), cold read of every leaf (open + sum) and cold read of ONE leaf (the largest),
in ms (median, page cache dropped before each run).
"""

from __future__ import annotations

import gc
import os
import shutil
import statistics
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from .harness import drop_cache
from .readformats import make_tensors

__all__ = ["WRITERS", "run_alignment", "alignment_table", "main"]

WRITERS = ("tdz_64", "tdz_4096", "tdz_65536", "tdz_auto", "zt_canonical", "zt_4096")
WORKLOADS = ("large", "mixed", "small")


def _tensors(workload: str, size_mib: float) -> dict[str, Any]:
    import torch

    if workload == "large":
        g = torch.Generator().manual_seed(0)
        rows = max(1, int(size_mib * 2**20) // 2 // 8 // 4096)
        return {f"w{i}": torch.randn(rows, 4096, generator=g).to(torch.float16) for i in range(8)}
    return make_tensors(workload, size_mib)


def _save(writer: str, tensors: dict[str, Any], path: Path) -> None:
    if writer.startswith("tdz_"):
        import tdz_numba

        policy = writer[4:]
        tdz_numba.save(tensors, path, align="auto" if policy == "auto" else int(policy))
        return
    import ztensor.numpy as ztnp

    arrays = {k: v.numpy() for k, v in tensors.items()}
    ztnp.save_file(arrays, str(path), align=None if writer == "zt_canonical" else 4096)


def _read_all(writer: str, path: Path) -> float:
    import torch

    if writer.startswith("tdz_"):
        import tdz_numba

        with tdz_numba.open(path) as ar:
            return sum(float(t.sum(dtype=torch.float32)) for _, t in ar.iter_leaves())
    import ztensor

    src = ztensor.open(str(path))
    try:
        return sum(float(torch.from_dlpack(t).sum(dtype=torch.float32)) for t in src.values())
    finally:
        src.close()


def _read_one(writer: str, path: Path, key: str) -> float:
    import torch

    if writer.startswith("tdz_"):
        import tdz_numba

        with tdz_numba.open(path) as ar:
            return float(ar[key].sum(dtype=torch.float32))
    import ztensor

    src = ztensor.open(str(path))
    try:
        return float(torch.from_dlpack(src[key]).sum(dtype=torch.float32))
    finally:
        src.close()


def _evictable_share(writer: str, path: Path, tensors: dict[str, Any], threshold: int) -> float | None:
    """Share of the leaves >= ``threshold`` bytes whose payload offset is a multiple of the page size."""
    from ..files.memory import PAGE_SIZE

    big = [k for k, v in tensors.items() if v.numel() * v.element_size() >= threshold]
    if not big:
        return None
    if writer.startswith("tdz_"):
        import tdz_numba

        with tdz_numba.open(path) as ar:
            offsets = [ar.info(k).offset for k in big]
    else:
        import ztensor

        src = ztensor.open(str(path))
        try:
            offsets = [src[k].location.offset for k in big]
        finally:
            src.close()
    return sum(1 for o in offsets if o is not None and o % PAGE_SIZE == 0) / len(big)


def _median_ms(fn: Callable[[], Any], repeat: int, before: Callable[[], None] | None = None) -> float:
    runs = []
    for i in range(repeat + 1):
        if before is not None:
            before()
        gc.collect()
        t0 = time.perf_counter()
        fn()
        if i:
            runs.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(runs)


def run_alignment(
    *,
    workloads: tuple[str, ...] = WORKLOADS,
    writers: tuple[str, ...] = WRITERS,
    size_mib: float = 512.0,
    repeat: int = 5,
    directory: str | os.PathLike | None = None,
    progress: Callable[[str], None] | None = None,
) -> tuple[list[dict], list[str]]:
    """Rows ``{"workload", "writer", "size_ratio", "save_gbps", "evictable", "cold_all_ms", "cold_one_ms"}``
    and notes."""
    say = progress or (lambda s: None)
    rows: list[dict] = []
    notes: list[str] = []
    root = Path(tempfile.mkdtemp(prefix=".tdz-bench-align-", dir=directory or Path.cwd()))
    try:
        for w in workloads:
            tensors = _tensors(w, size_mib)
            for writer in writers:
                row = _cell(w, writer, tensors, root / f"{w}.{writer}", repeat, notes)
                if row is not None:
                    rows.append(row)
                    say(
                        f"[{w}] {writer:<13} {row['size_ratio']:.4f}x {row['save_gbps']:.2f} GB/s "
                        f"cold all {row['cold_all_ms']:.1f} ms one {row['cold_one_ms']:.2f} ms"
                    )
            tensors.clear()
    finally:
        shutil.rmtree(root, ignore_errors=True)
    return rows, notes


def _cell(
    w: str, writer: str, tensors: dict[str, Any], path: Path, repeat: int, notes: list[str]
) -> dict | None:
    from ..zipfmt.writer import AUTO_THRESHOLD

    payload = sum(t.numel() * t.element_size() for t in tensors.values())
    largest = max(tensors, key=lambda k: tensors[k].numel())

    def save() -> None:
        path.unlink(missing_ok=True)
        _save(writer, tensors, path)
        os.sync()

    try:
        save_ms = _median_ms(save, repeat)
        size = path.stat().st_size
        evictable = _evictable_share(writer, path, tensors, AUTO_THRESHOLD)
        cold_all = _median_ms(lambda: _read_all(writer, path), repeat, lambda: drop_cache(path))
        cold_one = _median_ms(lambda: _read_one(writer, path, largest), repeat, lambda: drop_cache(path))
    except Exception as exc:  # ztensor missing, ...
        notes.append(f"{w}/{writer}: {type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}")
        return None
    finally:
        path.unlink(missing_ok=True)
    return {
        "workload": w,
        "writer": writer,
        "size_ratio": size / payload,
        "save_gbps": payload / save_ms / 1e6,
        "evictable": evictable,
        "cold_all_ms": cold_all,
        "cold_one_ms": cold_one,
        "payload": payload,
    }


def alignment_table(rows: list[dict], notes: list[str]) -> str:
    header = [
        "workload",
        "writer",
        "file/payload",
        "save GB/s",
        "big leaves on a page",
        "cold read-all",
        "cold read one",
    ]
    body = []
    for r in rows:
        ev = "-" if r["evictable"] is None else f"{100 * r['evictable']:.0f}%"
        body.append(
            [
                r["workload"],
                r["writer"],
                f"{r['size_ratio']:.4f}x",
                f"{r['save_gbps']:.2f}",
                ev,
                f"{r['cold_all_ms']:.1f} ms",
                f"{r['cold_one_ms']:.2f} ms",
            ]
        )
    widths = [max(len(str(x)) for x in col) for col in zip(header, *body)]
    lines = [
        "  ".join(h.ljust(wd) for h, wd in zip(header, widths)).rstrip(),
        "  ".join("-" * wd for wd in widths),
    ]
    lines += ["  ".join(c.ljust(wd) for c, wd in zip(b, widths)).rstrip() for b in body]
    lines.append(
        "tdz_N: tdz_numba save(align=N); tdz_auto: align='auto' (>= 1 MiB on 64 KiB, the rest 64 B); "
        "zt_canonical: ztensor canonical (64 KiB + digests); zt_4096: ztensor align=4096. Medians; "
        "cold = page cache dropped before each run; one = the largest leaf."
    )
    lines += [f"note: {n}" for n in notes]
    return "\n".join(lines)


def plot_alignment(rows: list[dict], path: str | os.PathLike) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    workloads = list(dict.fromkeys(r["workload"] for r in rows))
    fig, axes = plt.subplots(1, 3, figsize=(15, 4))
    metrics = (
        ("size_ratio", "file size / payload (log)"),
        ("save_gbps", "save GB/s"),
        ("cold_all_ms", "cold read-all ms"),
    )
    for ax, (key, label) in zip(axes, metrics):
        width = 0.8 / len(WRITERS)
        for j, writer in enumerate(WRITERS):
            xs, ys = [], []
            for i, w in enumerate(workloads):
                cell = [r for r in rows if r["workload"] == w and r["writer"] == writer]
                if cell:
                    xs.append(i + (j - (len(WRITERS) - 1) / 2) * width)
                    ys.append(cell[0][key])
            ax.bar(xs, ys, width, label=writer)
        ax.set_xticks(range(len(workloads)))
        ax.set_xticklabels(workloads)
        ax.set_title(label, fontsize=9)
        if key == "size_ratio":
            ax.set_yscale("log")
    axes[0].legend(fontsize=7)
    fig.tight_layout()
    out = Path(path)
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=110)
    plt.close(fig)
    return out


def main(argv: list[str], prog: str = "tdz bench --alignment") -> int:
    """``tdz bench --alignment``: see the module docstring."""
    import argparse
    import json
    import sys

    p = argparse.ArgumentParser(prog=prog, description=__doc__.split("\n\n")[0])
    p.add_argument("--workload", default=",".join(WORKLOADS), help="comma list of large, mixed, small")
    p.add_argument("--writer", default=",".join(WRITERS), help="comma list of " + ", ".join(WRITERS))
    p.add_argument("--size-mib", type=float, default=None, help="MiB of tensors per workload (default 512)")
    p.add_argument("--repeat", type=int, default=None, help="runs per cell after a warm-up (default 5)")
    p.add_argument("--quick", action="store_true", help="16 MiB, repeat 3")
    p.add_argument("--dir", type=Path, default=None)
    p.add_argument("--json", action="store_true")
    p.add_argument("--plot", type=Path, default=None, metavar="OUT.png")
    p.add_argument("-v", "--verbose", action="store_true")
    args = p.parse_args(argv)
    workloads = tuple(s for s in args.workload.split(",") if s)
    writers = tuple(s for s in args.writer.split(",") if s)
    bad = [x for x in workloads if x not in WORKLOADS] + [x for x in writers if x not in WRITERS]
    if bad:
        p.error(f"unknown {', '.join(bad)}")
    size = args.size_mib if args.size_mib is not None else (16.0 if args.quick else 512.0)
    repeat = args.repeat if args.repeat is not None else (3 if args.quick else 5)
    rows, notes = run_alignment(
        workloads=workloads,
        writers=writers,
        size_mib=size,
        repeat=repeat,
        directory=args.dir,
        progress=(lambda s: print(s, file=sys.stderr)) if args.verbose else None,
    )
    text = f"tdz_numba alignment benchmark: {size:g} MiB per workload, median of {repeat}\n"
    text += alignment_table(rows, notes)
    if args.plot is not None:
        text += f"\nplot: {plot_alignment(rows, args.plot)}"
    if args.json:
        print(text, file=sys.stderr)
        print(json.dumps(rows, indent=1))
    else:
        print(text)
    return 0
