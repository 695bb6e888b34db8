"""Bar charts of a benchmark run (matplotlib, imported on use)."""

from __future__ import annotations

import os
from pathlib import Path

from .constants import COLORS
from .harness import BenchResult
from .reporting import _columns, _fmt_ms

__all__ = ["plot"]


def plot(res: BenchResult, path: str | os.PathLike) -> Path:
    """A grouped bar chart (one panel per workload x op, log y axis) saved to ``path``."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    wnames = list(res.workloads)
    ops = [o for o in res.ops if any(r["op"] == o for r in res.results)]
    cols = _columns(res)
    fig, axes = plt.subplots(
        len(wnames), len(ops), figsize=(3.2 * len(ops) + 1, 3.4 * len(wnames) + 0.8), squeeze=False
    )
    for i, wname in enumerate(wnames):
        for j, op in enumerate(ops):
            ax = axes[i][j]
            found = [(f, res.cell(wname, op, f)) for f in cols]
            cells = [(f, c) for f, c in found if c is not None]
            xs = range(len(cells))
            vals = [c["median_ms"] for _, c in cells]
            bars = ax.bar(xs, vals, color=[COLORS.get(f, "#333333") for f, _ in cells])
            for b, v in zip(bars, vals):
                ax.annotate(
                    _fmt_ms(v).replace(" ms", ""),
                    (b.get_x() + b.get_width() / 2, v),
                    ha="center",
                    va="bottom",
                    fontsize=6,
                    rotation=90,
                    xytext=(0, 2),
                    textcoords="offset points",
                )
            ax.set_yscale("log")
            ax.set_xticks(list(xs))
            ax.set_xticklabels([f for f, _ in cells], rotation=60, ha="right", fontsize=7)
            ax.set_title(f"{wname} / {op}", fontsize=9)
            if j == 0:
                ax.set_ylabel("median ms (log)")
            if vals:
                ax.set_ylim(min(vals) / 2, max(vals) * 4)
    handles = [plt.Rectangle((0, 0), 1, 1, color=COLORS.get(f, "#333333")) for f in cols]
    top = 1 - (0.8 if res.compression else 0.6) / fig.get_figheight()  # title and legend, figure fraction
    codec = ""
    if res.compression:  # a narrow figure (2 ops): the title on two lines
        level = "default" if res.compresslevel is None else res.compresslevel
        codec = f"{res.compression} level {level},\n"
    fig.suptitle(
        f"tdz_numba bench: {codec}{res.size_mib:g} MiB per workload, median of {res.repeat}, "
        f"{'cold' if res.cold else 'warm'} cache (lower is better)",
        y=0.995,
        fontsize=10,
    )
    legend_y = 1 - (0.5 if res.compression else 0.35) / fig.get_figheight()
    fig.legend(
        handles,
        cols,
        loc="upper center",
        bbox_to_anchor=(0.5, legend_y),
        ncol=len(cols),
        fontsize=8,
        frameon=False,
    )
    fig.tight_layout(rect=(0, 0, 1, top))
    out = Path(path)
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=120)
    plt.close(fig)
    return out
