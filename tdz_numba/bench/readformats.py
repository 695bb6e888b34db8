"""``tdz bench --read-formats``: reading every tensor file format, tdz_numba against each format's own
library and ztensor, warm and cold (the zTensor benchmark page's reading table, reproduced here).

Workloads (``--size-mib``, default 512):

* ``mixed``: the tensors of a Llama-3.2-1B-shaped model (embedding, 16 layers of q/k/v/o and MLP
  projections, norms), float16, every matrix's first dimension scaled so that the total is the size;
* ``small``: many float16 tensors of ~10 KB (512 MiB: about 51,000 tensors).

Each file is written by its format's own library (safetensors, ``torch.save``, ``np.savez``, the
``gguf`` package's ``GGUFWriter``, h5py, onnx, and tdz_numba for ``.tdz``), then read in full, every
tensor summed (``t.sum(dtype=float32)``), by:

* ``tdz_numba``: ``tdz_numba.open(p)`` and its leaves, zero-copy where the file allows;
* ``tdz_numba_copy``: ``tdz_numba.open(p, copy=True)``: owned tensors;
* ``own``: the format's own reader (``safetensors.torch.load_file``,
  ``torch.load(mmap=True, weights_only=True)``, ``np.load``, ``gguf.GGUFReader``, h5py, ``onnx.load`` +
  ``numpy_helper``; for ``.tdz`` tensordict's ``TensorDict.load_memmap``);
* ``ztensor``: ``ztensor.open(p)`` and ``torch.from_dlpack`` of each tensor (formats it reads).

Warm (page cache kept) and cold (``fsync`` + ``posix_fadvise(DONTNEED)`` before every run), median of
``--repeat`` runs after one warm-up, in GB/s of tensor bytes.
"""

from __future__ import annotations

import os
import shutil
import statistics
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from .harness import drop_cache

__all__ = ["READ_FORMATS", "READERS", "llama_shapes", "make_tensors", "run_read_formats", "read_table"]

READ_FORMATS = ("tdz", "safetensors", "torch", "npz", "gguf", "hdf5", "onnx")
READERS = ("tdz_numba", "tdz_numba_copy", "own", "ztensor")
SUFFIX = {
    "tdz": ".tdz",
    "safetensors": ".safetensors",
    "torch": ".pt",
    "npz": ".npz",
    "gguf": ".gguf",
    "hdf5": ".h5",
    "onnx": ".onnx",
}
#: Formats ztensor 2.1 reads.
ZTENSOR_READS = ("safetensors", "torch", "npz", "gguf", "hdf5", "onnx")


def llama_shapes() -> dict[str, tuple[int, ...]]:
    """Tensor names and shapes of Llama-3.2-1B (hidden 2048, 16 layers, 8 KV heads, MLP 8192)."""
    h, inter, kv, vocab = 2048, 8192, 512, 128256
    out: dict[str, tuple[int, ...]] = {"model.embed_tokens.weight": (vocab, h)}
    for i in range(16):
        p = f"model.layers.{i}."
        out |= {
            p + "input_layernorm.weight": (h,),
            p + "self_attn.q_proj.weight": (h, h),
            p + "self_attn.k_proj.weight": (kv, h),
            p + "self_attn.v_proj.weight": (kv, h),
            p + "self_attn.o_proj.weight": (h, h),
            p + "post_attention_layernorm.weight": (h,),
            p + "mlp.gate_proj.weight": (inter, h),
            p + "mlp.up_proj.weight": (inter, h),
            p + "mlp.down_proj.weight": (h, inter),
        }
    out["model.norm.weight"] = (h,)
    return out


def make_tensors(workload: str, size_mib: float, seed: int = 0) -> dict[str, Any]:
    """Flat ``name -> float16 tensor`` dict of ``mixed`` or ``small`` at ``size_mib`` MiB."""
    import torch

    g = torch.Generator().manual_seed(seed)
    target = int(size_mib * 2**20) // 2  # float16 elements
    if workload == "mixed":
        shapes = llama_shapes()
        full = sum(int(torch.Size(s).numel()) for s in shapes.values())
        scale = target / full
        out = {}
        for name, shape in shapes.items():
            if len(shape) == 2:  # scale the rows: the matrices keep their width
                shape = (max(1, round(shape[0] * scale)), shape[1])
            out[name] = torch.randn(shape, generator=g).to(torch.float16)
        return out
    if workload == "small":
        per = 5120  # 10 KiB of float16
        n = max(1, target // per)
        # every tensor distinct (a writer that stores identical tensors once, as ztensor's canonical
        # form does, must not gain from repeats), each with its own storage
        flat = torch.randn(n * per, generator=g).to(torch.float16)
        return {
            f"params.{i // 100:04d}.p{i % 100:02d}": flat[i * per : (i + 1) * per].clone() for i in range(n)
        }
    raise ValueError(f"unknown workload {workload!r}; choose mixed or small")


# -- writers: each format's own library ----------------------------------------------------------------


def _write(fmt: str, tensors: dict[str, Any], path: Path) -> None:
    import numpy as np

    if fmt == "tdz":
        import tdz_numba

        tdz_numba.save(tensors, path)
    elif fmt == "safetensors":
        from safetensors.torch import save_file

        save_file(tensors, str(path))
    elif fmt == "torch":
        import torch

        torch.save(tensors, path)
    elif fmt == "npz":
        np.savez(path, **{k: v.numpy() for k, v in tensors.items()})
    elif fmt == "gguf":
        import gguf

        w = gguf.GGUFWriter(str(path), "llama")
        for k, v in tensors.items():
            w.add_tensor(k, v.numpy())
        w.write_header_to_file()
        w.write_kv_data_to_file()
        w.write_tensors_to_file()
        w.close()
    elif fmt == "hdf5":
        import h5py

        with h5py.File(path, "w") as f:
            for k, v in tensors.items():
                f.create_dataset(k, data=v.numpy())
    elif fmt == "onnx":
        import onnx
        from onnx import helper, numpy_helper

        inits = [numpy_helper.from_array(v.numpy(), k) for k, v in tensors.items()]
        graph = helper.make_graph([], "weights", [], [], initializer=inits)
        onnx.save(helper.make_model(graph), str(path))
    else:  # pragma: no cover
        raise ValueError(fmt)


# -- readers ---------------------------------------------------------------------------------------------


def _sum(t: Any) -> float:
    import torch

    if isinstance(t, torch.Tensor):
        return float(t.sum(dtype=torch.float32))
    return float(t.sum(dtype="float32"))


def _read_tdz_numba(path: Path, copy: bool) -> float:
    import tdz_numba

    with tdz_numba.open(path, copy=copy) as ar:
        return sum(_sum(t) for _, t in ar.iter_leaves())


def _read_own(fmt: str, path: Path) -> float:
    import numpy as np

    if fmt == "tdz":
        from tensordict import TensorDict

        td = TensorDict.load_memmap(path)
        return sum(_sum(t) for t in td.values(include_nested=True, leaves_only=True))
    if fmt == "safetensors":
        from safetensors.torch import load_file

        return sum(_sum(t) for t in load_file(str(path)).values())
    if fmt == "torch":
        import torch

        return sum(_sum(t) for t in torch.load(path, mmap=True, weights_only=True).values())
    if fmt == "npz":
        with np.load(path, mmap_mode="r") as z:
            return sum(_sum(z[k]) for k in z.files)
    if fmt == "gguf":
        import gguf

        return sum(_sum(t.data) for t in gguf.GGUFReader(str(path)).tensors)
    if fmt == "hdf5":
        import h5py

        with h5py.File(path, "r") as f:
            return sum(_sum(f[k][...]) for k in f)
    if fmt == "onnx":
        import onnx
        from onnx import numpy_helper

        model = onnx.load(str(path))
        return sum(_sum(numpy_helper.to_array(t)) for t in model.graph.initializer)
    raise ValueError(fmt)  # pragma: no cover


def _read_ztensor(path: Path) -> float:
    import torch
    import ztensor

    src = ztensor.open(str(path))
    try:
        return sum(_sum(torch.from_dlpack(t)) for t in src.values())
    finally:
        src.close()


def reader_fn(fmt: str, reader: str, path: Path) -> Callable[[], float] | None:
    """The read-all function of one (format, reader) cell, or None when it does not apply."""
    if reader == "tdz_numba":
        return lambda: _read_tdz_numba(path, False)
    if reader == "tdz_numba_copy":
        return lambda: _read_tdz_numba(path, True)
    if reader == "own":
        return lambda: _read_own(fmt, path)
    if reader == "ztensor" and fmt in ZTENSOR_READS:
        return lambda: _read_ztensor(path)
    return None


# -- the run -------------------------------------------------------------------------------------------


@dataclass
class ReadResult:
    """Rows of ``{"workload", "format", "reader", "cache", "median_ms", "gbps", "runs_ms"}``."""

    rows: list[dict] = field(default_factory=list)
    nbytes: dict[str, int] = field(default_factory=dict)
    file_bytes: dict[tuple[str, str], int] = field(default_factory=dict)
    notes: list[str] = field(default_factory=list)
    size_mib: float = 512.0
    repeat: int = 5


def run_read_formats(
    *,
    workloads: tuple[str, ...] = ("mixed", "small"),
    formats: tuple[str, ...] = READ_FORMATS,
    readers: tuple[str, ...] = READERS,
    size_mib: float = 512.0,
    repeat: int = 5,
    caches: tuple[str, ...] = ("warm", "cold"),
    directory: str | os.PathLike | None = None,
    progress: Callable[[str], None] | None = None,
) -> ReadResult:
    """Writes every format with its own library, then times every reader on it (see the module doc)."""
    import torch

    say = progress or (lambda s: None)
    res = ReadResult(size_mib=size_mib, repeat=repeat)
    root = Path(tempfile.mkdtemp(prefix=".tdz-bench-read-", dir=directory or Path.cwd()))
    try:
        for wname in workloads:
            tensors = make_tensors(wname, size_mib)
            res.nbytes[wname] = nbytes = sum(t.numel() * t.element_size() for t in tensors.values())
            expected = sum(float(t.sum(dtype=torch.float32)) for t in tensors.values())
            for fmt in formats:
                path = root / f"{wname}{SUFFIX[fmt]}"
                try:
                    _write(fmt, tensors, path)
                except Exception as exc:  # a missing optional package, a writer's limit
                    res.notes.append(
                        f"{wname}/{fmt}: not written ({type(exc).__name__}: {exc})".splitlines()[0]
                    )
                    continue
                res.file_bytes[(wname, fmt)] = path.stat().st_size
                for reader in readers:
                    fn = reader_fn(fmt, reader, path)
                    if fn is None:
                        continue
                    for cache in caches:
                        try:
                            runs, total = _measure(fn, repeat, path if cache == "cold" else None)
                        except Exception as exc:
                            res.notes.append(
                                f"{wname}/{fmt}/{reader}: failed ({type(exc).__name__}: "
                                f"{str(exc).splitlines()[0] if str(exc) else ''})"
                            )
                            break
                        if abs(total - expected) > 1e-3 * (abs(expected) + nbytes / 2):
                            res.notes.append(f"{wname}/{fmt}/{reader}: WARNING: sum {total} != {expected}")
                        med = statistics.median(runs)
                        res.rows.append(
                            {
                                "workload": wname,
                                "format": fmt,
                                "reader": reader,
                                "cache": cache,
                                "median_ms": med,
                                "gbps": nbytes / med / 1e6,
                                "runs_ms": runs,
                            }
                        )
                        say(
                            f"[{wname}] {fmt:<12} {reader:<15} {cache:<5} {med:9.1f} ms {nbytes / med / 1e6:6.2f} GB/s"
                        )
                path.unlink(missing_ok=True)
            del tensors
    finally:
        shutil.rmtree(root, ignore_errors=True)
    return res


def _measure(fn: Callable[[], float], repeat: int, cold_path: Path | None) -> tuple[list[float], float]:
    import gc

    runs: list[float] = []
    total = 0.0
    for i in range(repeat + 1):
        if cold_path is not None:
            drop_cache(cold_path)
        gc.collect()
        t0 = time.perf_counter()
        total = fn()
        ms = (time.perf_counter() - t0) * 1e3
        if i:
            runs.append(ms)
    return runs, total


def read_table(res: ReadResult) -> str:
    """Rows = (workload, format, cache), columns = readers; cells ``GB/s (ratio to tdz_numba)``."""
    lines = []
    header = ["workload", "format", "cache", *READERS]
    rows = []
    keys = dict.fromkeys((r["workload"], r["format"], r["cache"]) for r in res.rows)
    for w, f, c in keys:
        cells = {r["reader"]: r for r in res.rows if (r["workload"], r["format"], r["cache"]) == (w, f, c)}
        base = cells.get("tdz_numba")
        row = [w, f, c]
        for reader in READERS:
            r = cells.get(reader)
            if r is None:
                row.append("-")
            else:
                ratio = f" ({r['median_ms'] / base['median_ms']:.2f}x)" if base else ""
                row.append(f"{r['gbps']:.2f} GB/s{ratio}")
        rows.append(row)
    widths = [max(len(str(x)) for x in col) for col in zip(header, *rows)]
    lines.append("  ".join(h.ljust(wd) for h, wd in zip(header, widths)).rstrip())
    lines.append("  ".join("-" * wd for wd in widths))
    lines += ["  ".join(c.ljust(wd) for c, wd in zip(row, widths)).rstrip() for row in rows]
    lines.append(
        "cells: GB/s of tensor bytes read and summed (median), (time relative to tdz_numba's in the "
        "same row: > 1x = slower than tdz_numba)"
    )
    for w, n in res.nbytes.items():
        sizes = ", ".join(f"{f} {res.file_bytes[(ww, f)] / n:.3f}x" for (ww, f) in res.file_bytes if ww == w)
        lines.append(f"workload {w}: {n / 2**20:.1f} MiB of tensors; file size / payload: {sizes}")
    lines += [f"note: {n}" for n in res.notes]
    return "\n".join(lines)


def plot_read(res: ReadResult, path: str | os.PathLike) -> Path:
    """Grouped bars: GB/s per (format, reader), one panel per (workload, cache)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    panels = list(dict.fromkeys((r["workload"], r["cache"]) for r in res.rows))
    fig, axes = plt.subplots(len(panels), 1, figsize=(10, 3.2 * len(panels) + 0.6), squeeze=False)
    colors = {"tdz_numba": "#d62728", "tdz_numba_copy": "#ff9896", "own": "#1f77b4", "ztensor": "#2ca02c"}
    for ax, (w, c) in zip(axes[:, 0], panels):
        fmts = list(dict.fromkeys(r["format"] for r in res.rows if (r["workload"], r["cache"]) == (w, c)))
        width = 0.8 / len(READERS)
        for j, reader in enumerate(READERS):
            xs, ys = [], []
            for i, f in enumerate(fmts):
                cell = [
                    r
                    for r in res.rows
                    if (r["workload"], r["cache"], r["format"], r["reader"]) == (w, c, f, reader)
                ]
                if cell:
                    xs.append(i + (j - (len(READERS) - 1) / 2) * width)
                    ys.append(cell[0]["gbps"])
            ax.bar(xs, ys, width, label=reader, color=colors[reader])
        ax.set_xticks(range(len(fmts)))
        ax.set_xticklabels(fmts)
        ax.set_ylabel("GB/s (higher is better)")
        ax.set_title(f"{w}, {c} cache: read + sum of every tensor", fontsize=9)
        ax.legend(fontsize=7, ncol=4)
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

    def names(allowed: tuple[str, ...]) -> Callable[[str], tuple[str, ...]]:
        def parse(text: str) -> tuple[str, ...]:
            got = tuple(s.strip() for s in text.split(",") if s.strip())
            bad = [g for g in got if g not in allowed]
            if bad or not got:
                raise argparse.ArgumentTypeError(f"choose from {', '.join(allowed)}")
            return got

        return parse

    p = argparse.ArgumentParser(prog=prog, description=__doc__.split("\n\n")[0])
    p.add_argument("--workload", type=names(("mixed", "small")), default=("mixed", "small"))
    p.add_argument("--format", type=names(READ_FORMATS), default=READ_FORMATS)
    p.add_argument("--reader", type=names(READERS), default=READERS)
    p.add_argument("--cache", type=names(("warm", "cold")), default=("warm", "cold"))
    p.add_argument("--size-mib", type=float, default=None, help="MiB of tensors per workload (default 512)")
    p.add_argument("--repeat", type=int, default=None, help="timed runs per cell after a warm-up (default 5)")
    p.add_argument("--quick", action="store_true", help="16 MiB, repeat 3")
    p.add_argument("--dir", type=Path, default=None, help="where files go (default: the current directory)")
    p.add_argument("--json", action="store_true", help="print the rows as JSON (the table goes to stderr)")
    p.add_argument("--plot", type=Path, default=None, metavar="OUT.png")
    p.add_argument("-v", "--verbose", action="store_true")
    args = p.parse_args(argv)
    size = args.size_mib if args.size_mib is not None else (16.0 if args.quick else 512.0)
    repeat = args.repeat if args.repeat is not None else (3 if args.quick else 5)
    if size <= 0 or repeat < 1:
        p.error("--size-mib must be > 0 and --repeat >= 1")
    res = run_read_formats(
        workloads=args.workload,
        formats=args.format,
        readers=args.reader,
        size_mib=size,
        repeat=repeat,
        caches=args.cache,
        directory=args.dir,
        progress=(lambda s: print(s, file=sys.stderr, flush=True)) if args.verbose else None,
    )
    text = (
        f"tdz_numba read benchmark: {size:g} MiB per workload, median of {repeat} after a warm-up\n"
        + read_table(res)
    )
    if args.plot is not None:
        text += f"\nplot: {plot_read(res, args.plot)}"
    if args.json:
        print(text, file=sys.stderr, flush=True)
        print(json.dumps(res.rows, indent=1))
    else:
        print(text, flush=True)
    return 0
