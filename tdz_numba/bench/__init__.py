"""The benchmark (``tdz bench``): tdz_numba against tensordict, torch, safetensors and a raw-write floor.

Run ``tdz bench`` or ``python -m tdz_numba.bench`` (``--quick`` for a 16 MiB
run, ``--help`` for the filters). Two workloads of random float32 data
(default 256 MiB each):

* ``flat``: 8 leaves of shape ``(2048, 4096)`` (rows scale with ``--size-mib``);
* ``small``: 100 groups x 20 leaves of 33,554 values (values scale with the size),
  nested as ``{"group_000": {"leaf_00": t, ...}, ...}``.

Ops: ``save``, ``open`` (lazy open), ``read`` (the format's whole-file read:
``tdz_numba.load``, safetensors' ``load_file``, ``torch.load(mmap=True)``,
``TensorDict.load_memmap``; then ``float(t.sum())`` over every leaf), ``copy`` (``shutil.copyfile`` / ``copytree`` of the artifact) and
``verify`` (``tdz_numba.verify``, with zlib-ng's single-thread ``crc32`` over
the same payload bytes for comparison).

Method: for every (workload, op, format) one warm-up run, then ``--repeat``
timed runs; the median is reported. Every save (and copy) writes a fresh path;
the previous artifact is deleted, and the new one fsynced, outside the timed
region. Results (returned handles, mappings, buffers) are also released
outside it, with the garbage collector run before and disabled during each
timed run. Numba kernels are compiled (or loaded from cache) before timing, and
every section runs them (``TDZ_NUMBA_KERNELS=always`` unless the environment
sets it: the steady state of a long process, not the first-use twins of
:mod:`tdz_numba.zipfmt.kernels.dispatch`).
With ``--cold`` every file of the artifact is fsynced and its pages dropped
(``posix_fadvise(DONTNEED)``) before each timed open, read, copy and verify.

Compressed section (``--compression deflate``, optionally ``--compresslevel N``;
default None = zlib-ng's default level): it replaces the sections above. Workloads:

* ``images_flat``: ONE uint8 leaf ``[N, 3, 64, 64]`` of image-like data (smooth
  gradients and shading, sparse +-2 sensor noise, a masked background, a flat
  object; deterministic; about 3.5x with deflate), N = 2000 x B images, B =
  size / 2000 / 12 KiB rounded (below 1.5, B = 1 and the images are shorter:
  ``[2000, 3, H, 64]``, e.g. H = 44 for 16 MiB);
* ``images_small``: the same images as 100 groups x 20 leaves ``[B, 3, 64, 64]``;
* ``flat`` and ``small``: the float32 workloads above (random floats barely compress).

Ops ``save`` and ``load`` (open + ``float(t.sum())`` of every leaf), formats
``tdz_numba`` (all threads), ``tdz_numba_1t`` (``num_threads=1``), ``td_tdz``
(``TensorDict.save(p, compression="deflate")``; ``load_memmap(p,
num_threads=os.cpu_count())``) and ``zlib_ng`` (one raw-deflate stream per leaf,
``zlib_ng.compressobj(level, DEFLATED, -15)`` on one thread, written to one file;
load = ``zlib_ng.decompress(..., wbits=-15)`` of every stream + the same sums: the
single-thread throughput reference). The report adds each format's size ratio
(uncompressed bytes / file size), the throughputs, and per workload the scaling
of tdz_numba (all threads vs one) and three goal checks (PASS/FAIL): scaling
>= 0.8 x cores; single thread within 1.2x of zlib-ng; save >= 2x faster than
tensordict compressed.
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

from .constants import (
    COMPRESSED_FORMATS,
    COMPRESSED_OPS,
    COMPRESSED_WORKLOADS,
    COMPRESSIONS,
    CRC_FORMAT,
    DEFAULT_REPEAT,
    DEFAULT_SIZE_MIB,
    FORMATS,
    OPS,
    QUICK_REPEAT,
    QUICK_SIZE_MIB,
    WORKLOADS,
)
from .harness import BenchResult, run
from .peers import COMPRESSED_CLASSES, FORMAT_CLASSES, Format, leaf_sum, sum_tree
from .plot import plot
from .reporting import format_table, goal_lines, report
from .workloads import Workload, make_images, make_workload

__all__ = [
    "WORKLOADS",
    "OPS",
    "FORMATS",
    "CRC_FORMAT",
    "COMPRESSIONS",
    "COMPRESSED_WORKLOADS",
    "COMPRESSED_OPS",
    "COMPRESSED_FORMATS",
    "BenchResult",
    "Workload",
    "run",
    "main",
    "format_table",
    "goal_lines",
    "report",
    "plot",
    "make_images",
    "make_workload",
    "leaf_sum",
    "sum_tree",
    "build_parser",
    "Format",
    "FORMAT_CLASSES",
    "COMPRESSED_CLASSES",
]

# -- command line -------------------------------------------------------------------------------


def _choices(allowed: tuple[str, ...], what: str) -> Callable[[str], list[str]]:
    def parse(text: str) -> list[str]:
        names = [s.strip() for s in text.split(",") if s.strip()]
        if not names or "all" in names:
            return list(allowed)
        bad = [n for n in names if n not in allowed]
        if bad:
            raise argparse.ArgumentTypeError(
                f"unknown {what} {', '.join(map(repr, bad))}; choose from {', '.join(allowed)}"
            )
        return names

    parse.__name__ = what
    return parse


def _positive(kind: type) -> Callable[[str], Any]:
    def parse(text: str):
        try:
            value = kind(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"not a number: {text!r}") from None
        if not value > 0:
            raise argparse.ArgumentTypeError(f"must be > 0, got {text!r}")
        return value

    parse.__name__ = kind.__name__
    return parse


def build_parser(prog: str = "tdz bench") -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog=prog,
        description="Benchmark tdz_numba against tensordict, torch.save, safetensors and a raw-write floor.",
        epilog="Cells are medians; ratios are relative to tdz_numba in the same row.",
    )
    all_workloads = tuple(dict.fromkeys([*WORKLOADS, *COMPRESSED_WORKLOADS]))
    all_ops = tuple(dict.fromkeys([*OPS, *COMPRESSED_OPS]))
    all_formats = tuple(dict.fromkeys([*FORMATS, *COMPRESSED_FORMATS]))
    p.add_argument(
        "--workload",
        type=_choices(all_workloads, "workload"),
        default=None,
        help=f"comma list of {', '.join(WORKLOADS)}; with --compression of "
        f"{', '.join(COMPRESSED_WORKLOADS)} (default all)",
    )
    p.add_argument(
        "--op",
        type=_choices(all_ops, "op"),
        default=None,
        help=f"comma list of {', '.join(OPS)}; with --compression of "
        f"{', '.join(COMPRESSED_OPS)} (default all)",
    )
    p.add_argument(
        "--format",
        type=_choices(all_formats, "format"),
        default=None,
        help=f"comma list of {', '.join(FORMATS)}; with --compression of "
        f"{', '.join(COMPRESSED_FORMATS)} (default all)",
    )
    p.add_argument(
        "--compression",
        choices=COMPRESSIONS,
        default=None,
        help="run the compressed section instead: image-like and float workloads saved "
        "and loaded compressed, tdz_numba on all threads and on one against "
        "tensordict and single-thread zlib-ng, with scaling and goal checks",
    )
    p.add_argument(
        "--compresslevel",
        type=int,
        default=None,
        metavar="N",
        help="deflate level -1..9 of the compressed section (default: zlib-ng's default)",
    )
    p.add_argument(
        "--size-mib",
        type=_positive(float),
        default=None,
        help=f"MiB of data per workload (default {DEFAULT_SIZE_MIB:g}; {QUICK_SIZE_MIB:g} with --quick)",
    )
    p.add_argument(
        "--repeat",
        type=_positive(int),
        default=None,
        help=f"timed runs per cell after one warm-up (default {DEFAULT_REPEAT}; {QUICK_REPEAT} with --quick)",
    )
    p.add_argument(
        "--cold",
        action="store_true",
        help="drop the artifact's cached pages before each timed open/read/copy/verify",
    )
    p.add_argument(
        "--dir",
        type=Path,
        default=None,
        help="where artifacts go (a temporary sub-directory is made there; default: the "
        "current directory, not /dev/shm)",
    )
    p.add_argument(
        "--json", action="store_true", help="print the results as JSON on stdout (the report goes to stderr)"
    )
    p.add_argument("--plot", type=Path, default=None, metavar="OUT.png", help="save a bar chart (matplotlib)")
    p.add_argument("--quick", action="store_true", help=f"size {QUICK_SIZE_MIB:g} MiB, repeat {QUICK_REPEAT}")
    p.add_argument("-v", "--verbose", action="store_true", help="print each cell to stderr as it is measured")
    p.add_argument(
        "--remote",
        action="store_true",
        help="remote archives (HTTP, S3) and DCP on loopback servers (see --remote --help)",
    )
    p.add_argument(
        "--alignment",
        action="store_true",
        help="file size, save speed and cold reads of align=64/4096/65536/'auto' next to ztensor's "
        "writers (see --alignment --help)",
    )
    p.add_argument(
        "--leaves",
        metavar="N,N,...",
        default=None,
        help="leaf-count sweep: save, lazy open and load+sum of 64 MiB in N leaves against "
        "safetensors and torch, us per leaf (see --leaves 200 --help)",
    )
    p.add_argument(
        "--read-formats",
        action="store_true",
        help="read every tensor file format (safetensors, .pt, npz, GGUF, HDF5, ONNX, .tdz) with "
        "tdz_numba, the format's own library and ztensor (see --read-formats --help)",
    )
    return p


def main(argv: list[str] | None = None, prog: str = "tdz bench") -> int:
    """Entry point of ``tdz bench`` and ``python -m tdz_numba.bench``."""
    import json

    argv = list(sys.argv[1:] if argv is None else argv)
    # steady state: the Numba kernels, not their first-use twins (tdz_numba.zipfmt.kernels.dispatch), compiled
    # or loaded before any timed run by each section's warm-up; TDZ_NUMBA_KERNELS=auto measures the mix
    os.environ.setdefault("TDZ_NUMBA_KERNELS", "always")
    if "--alignment" in argv:  # what payload alignment costs and buys: tdz_numba.bench.alignment
        from .alignment import main as align_main

        return align_main([a for a in argv if a != "--alignment"], f"{prog} --alignment")
    if "--read-formats" in argv:  # every tensor file format, every reader: tdz_numba.bench.readformats
        from .readformats import main as read_main

        return read_main([a for a in argv if a != "--read-formats"], f"{prog} --read-formats")
    if any(a == "--leaves" or a.startswith("--leaves=") for a in argv):  # per-leaf cost: bench.leafsweep
        from .leafsweep import main as leaves_main

        return leaves_main(argv, f"{prog} --leaves")
    if "--remote" in argv:  # remote archives and DCP on loopback servers: tdz_numba.bench.remote
        from .remote import main as remote_main

        return remote_main([a for a in argv if a != "--remote"], f"{prog} --remote")
    parser = build_parser(prog)
    args = parser.parse_args(argv)
    if args.compression is None:
        if args.compresslevel is not None:
            parser.error("--compresslevel needs --compression")
        allowed = {"workload": WORKLOADS, "op": OPS, "format": FORMATS}
    else:
        if args.compresslevel is not None and not -1 <= args.compresslevel <= 9:
            parser.error(f"--compresslevel must be -1..9, got {args.compresslevel}")
        allowed = {"workload": COMPRESSED_WORKLOADS, "op": COMPRESSED_OPS, "format": COMPRESSED_FORMATS}
    for kind, names in allowed.items():
        given = getattr(args, kind)
        if given is None:
            setattr(args, kind, list(names))
            continue
        bad = [n for n in given if n not in names]
        if bad:
            where = "with --compression" if args.compression else "without --compression"
            parser.error(
                f"argument --{kind}: {', '.join(map(repr, bad))} not available {where}; "
                f"choose from {', '.join(names)}"
            )
    size = (
        args.size_mib if args.size_mib is not None else (QUICK_SIZE_MIB if args.quick else DEFAULT_SIZE_MIB)
    )
    repeat = args.repeat if args.repeat is not None else (QUICK_REPEAT if args.quick else DEFAULT_REPEAT)

    def progress(line: str) -> None:
        print(line, file=sys.stderr, flush=True)

    res = run(
        workloads=args.workload,
        ops=args.op,
        formats=args.format,
        size_mib=size,
        repeat=repeat,
        cold=args.cold,
        directory=args.dir,
        progress=progress if args.verbose else None,
        compression=args.compression,
        compresslevel=args.compresslevel,
    )
    text = report(res, argv)
    if args.plot is not None:
        out = plot(res, args.plot)
        text += f"\nplot: {out}"
    if args.json:
        print(text, file=sys.stderr, flush=True)
        print(json.dumps(res.results, indent=1))
    else:
        print(text, flush=True)
    return 0
