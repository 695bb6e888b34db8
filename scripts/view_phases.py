"""Phases of the read benchmark's ``view`` cell, ours against ztensor: open + views, then the touch.

``python scripts/view_phases.py [llama|small] [reps] [fmt ...]`` (from the repository root, in its
.venv) writes each format's file with the format's own library into ``/tmp/tdz_view_phases`` (once),
then, for each format, alternates tdz_numba.load and ztensor.open + from_dlpack ``reps`` times and
prints the medians (ms) of: open + views, the touch of one byte per 4 KiB page, and both; plus the
minor page faults of the touch and the share of the views' start addresses on a 2 MiB boundary of
the mapping. Indicative only on a loaded machine.
"""

import gc
import os
import resource
import sys
import time
from pathlib import Path

from tdz_numba.bench import readers as R

OUT = Path("/tmp/tdz_view_phases")
FMTS = ("safetensors", "torch", "npz", "gguf", "hdf5", "onnx", "tdz")


def _path(fmt: str, workload: str) -> Path:
    ext = {"torch": "pt", "safetensors": "safetensors", "tdz": "tdz"}.get(fmt, fmt)
    return OUT / f"{workload}.{ext}"


def main() -> None:
    workload = sys.argv[1] if len(sys.argv) > 1 else "llama"
    reps = int(sys.argv[2]) if len(sys.argv) > 2 else 20
    fmts = sys.argv[3:] or FMTS
    os.environ.setdefault("TDZ_NUMBA_KERNELS", "always")
    OUT.mkdir(exist_ok=True)
    tensors = None
    for fmt in fmts:
        p = _path(fmt, workload)
        if not p.exists():
            if tensors is None:
                tensors = R.make_tensors(workload, count=20000 if workload == "small" else None)
            R.write(fmt, tensors, p)
    for fmt in fmts:
        p = _path(fmt, workload)
        cells = {"ours": R.reader(fmt, "tdz_numba", False), "zt": R.reader(fmt, "ztensor", False)}
        res = {k: [] for k in cells}
        for r in range(reps + 1):
            for name, fn in cells.items():
                gc.collect()
                gc.disable()
                t0 = time.perf_counter_ns()
                ts, keep = fn(p)
                t1 = time.perf_counter_ns()
                f0 = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
                t2 = time.perf_counter_ns()
                R.touch(ts)
                t3 = time.perf_counter_ns()
                f1 = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
                gc.enable()
                al = sum(1 for t in ts if t.data_ptr() % (2 << 20) == 0) / max(1, len(ts))
                if r:
                    res[name].append(
                        ((t1 - t0) / 1e6, (t3 - t2) / 1e6, (t3 - t0 - (t2 - t1)) / 1e6, f1 - f0, al)
                    )
                del ts, keep
        for name, rows in res.items():
            med = [sorted(c)[len(c) // 2] for c in zip(*rows)]
            print(
                f"{workload:6s} {fmt:12s} {name:5s} open+views {med[0]:7.2f}  touch {med[1]:7.2f}  "
                f"total {med[2]:7.2f} ms  faults {med[3]:6.0f}  2MiB-aligned starts {med[4]:.2f}"
            )


if __name__ == "__main__":
    main()
