"""Measuring: warm-ups, timed runs outside the collector, cold caches, the run loop."""

from __future__ import annotations

import functools
import gc
import importlib
import math
import os
import shutil
import statistics
import tempfile
import time
import warnings
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
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
    WORKLOADS,
)
from .peers import COMPRESSED_CLASSES, FORMAT_CLASSES, Format, sum_tree
from .workloads import Workload, make_workload

__all__ = [
    "BenchResult",
    "Cell",
    "run",
    "measure",
    "measure_rounds",
    "drop_cache",
    "filesystem_of",
    "available_formats",
]

# -- file helpers ------------------------------------------------------------------------------


def _files_of(path: Path) -> list[Path]:
    if path.is_dir():
        return [Path(root) / name for root, _, names in os.walk(path) for name in names]
    return [path] if path.exists() else []


def _remove(path: Path) -> None:
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path)
    elif path.exists() or path.is_symlink():
        path.unlink()


def _fsync(path: Path) -> None:
    for f in _files_of(path):
        fd = os.open(f, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


def drop_cache(path: Path) -> None:
    """fsyncs every file of ``path`` (a file or a directory) and drops its cached pages."""
    for f in _files_of(path):
        fd = os.open(f, os.O_RDONLY)
        try:
            os.fsync(fd)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def _du(path: Path) -> int:
    return sum(f.stat().st_size for f in _files_of(path))


def filesystem_of(path: Path) -> str:
    """``"<fstype> <source> mounted at <mount point>"`` of the filesystem holding ``path``."""
    real = os.path.realpath(path)
    best = ("", "?", "?")
    try:
        with open("/proc/self/mounts") as f:
            for line in f:
                parts = line.split()
                if len(parts) < 3:
                    continue
                mnt = parts[1].replace("\\040", " ")
                if (real == mnt or real.startswith(mnt.rstrip("/") + "/")) and len(mnt) >= len(best[0]):
                    best = (mnt, parts[2], parts[0])
    except OSError:
        return "unknown filesystem"
    return f"{best[1]} ({best[2]}) mounted at {best[0] or '?'}"


# -- measuring --------------------------------------------------------------------------------


def _timed(fn: Callable[[], Any]) -> tuple[float, Any]:
    gc.collect()
    gc.disable()
    try:
        t0 = time.perf_counter()
        out = fn()
        dt = time.perf_counter() - t0
    finally:
        gc.enable()
    return dt * 1e3, out


@dataclass
class Cell:
    """One cell's timed call ``run(i)`` (``i`` = 0 for the warm-up), its untimed
    ``before(i)`` and ``after(i, result)``, and a ``cleanup()`` once its runs are done."""

    run: Callable[[int], Any]
    before: Callable[[int], None] | None = None
    after: Callable[[int, Any], None] | None = None
    cleanup: Callable[[], None] | None = None


def measure_rounds(cells: dict[str, Cell], repeat: int) -> dict[str, list[float] | BaseException]:
    """Runs the cells in rounds: round 0 warms every cell up, then ``repeat`` timed rounds
    run each cell once, in turn, so that a machine that slows down or speeds up during
    the measurement (a shared machine, a disk's own caches) moves all cells alike.

    Returns each cell's timed runs in ms, or the exception that stopped it (its later
    rounds are skipped; the other cells go on).
    """
    out: dict[str, list[float] | BaseException] = {name: [] for name in cells}
    try:
        for i in range(repeat + 1):
            for name, cell in cells.items():
                runs = out[name]
                if not isinstance(runs, list):
                    continue
                try:
                    if cell.before is not None:
                        cell.before(i)
                    ms, result = _timed(functools.partial(cell.run, i))
                    if cell.after is not None:
                        cell.after(i, result)
                    del result
                    gc.collect()
                except Exception as exc:
                    out[name] = exc
                    continue
                if i:
                    runs.append(ms)
    finally:
        for cell in cells.values():
            if cell.cleanup is not None:
                cell.cleanup()
    return out


def measure(
    fn: Callable[[int], Any],
    repeat: int,
    *,
    before: Callable[[int], None] | None = None,
    after: Callable[[int, Any], None] | None = None,
) -> list[float]:
    """One warm-up run (index 0) then ``repeat`` timed runs; returns the timed runs in ms.

    ``before(i)`` and ``after(i, result)`` run outside the timed region; the
    result is released after ``after``. An exception is raised as it happens.
    """
    runs = measure_rounds({"": Cell(fn, before, after)}, repeat)[""]
    if isinstance(runs, BaseException):
        raise runs
    return runs


@dataclass
class BenchResult:
    """Results of :func:`run`: one record per measured cell, plus the context."""

    results: list[dict] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    workloads: dict[str, str] = field(default_factory=dict)  # name -> description
    sizes: dict[tuple[str, str], int] = field(default_factory=dict)  # (workload, format) -> bytes
    directory: str = ""
    filesystem: str = ""
    size_mib: float = DEFAULT_SIZE_MIB
    repeat: int = DEFAULT_REPEAT
    cold: bool = False
    formats: list[str] = field(default_factory=list)
    ops: list[str] = field(default_factory=list)
    wall_s: float = 0.0
    compression: str | None = None  # the compressed section's codec, None for the default section
    compresslevel: int | None = None
    nbytes: dict[str, int] = field(default_factory=dict)  # workload -> uncompressed bytes

    def cell(self, workload: str, op: str, fmt: str) -> dict | None:
        for r in self.results:
            if (r["workload"], r["op"], r["format"]) == (workload, op, fmt):
                return r
        return None


def available_formats(formats: Iterable[str]) -> tuple[list[str], list[str]]:
    """``(usable formats, notes)``: tensordict and safetensors formats are skipped when
    their package does not import."""
    usable, notes = [], []
    need = {
        "td_tdz": "tensordict",
        "td_tdz_enabled": "tensordict",
        "td_dir": "tensordict",
        "td_consolidated": "tensordict",
        "safetensors": "safetensors",
        "zlib_ng": "zlib_ng",
    }
    modules = {"tensordict": "tensordict", "safetensors": "safetensors.torch", "zlib_ng": "zlib_ng.zlib_ng"}
    failed: dict[str, str] = {}
    for fmt in formats:
        pkg = need.get(fmt)
        if pkg is not None and pkg not in failed:
            try:
                with warnings.catch_warnings():
                    warnings.simplefilter("ignore")
                    importlib.import_module(modules[pkg])
            except Exception as exc:  # ImportError, or a broken install
                failed[pkg] = f"{type(exc).__name__}: {exc}".splitlines()[0]
                notes.append(f"{pkg} does not import ({failed[pkg]}): skipping its formats")
        if pkg is not None and pkg in failed:
            continue
        usable.append(fmt)
    return usable, notes


def _warm_up_jit(directory: Path) -> None:
    """Compiles (or loads from Numba's cache) every kernel the timed calls use."""
    import torch

    import tdz_numba

    p = directory / "_jit_warmup.tdz"
    tdz_numba.save({"a": {"b": torch.arange(1000, dtype=torch.float32)}, "c": torch.zeros(3)}, p)
    with tdz_numba.open(p) as ar:
        float(ar["a/b"].sum())
        list(ar.leaves())
    tdz_numba.verify(p)
    tdz_numba.load(p)
    p.unlink()


def _warm_up_compressed(directory: Path, compression: str, compresslevel: int | None) -> None:
    """Compiles (or loads from cache) the kernels of compressed saves and loads, on all
    threads and on one, with entries large enough to be cut into segments."""
    import torch

    import tdz_numba

    p = directory / "_jit_warmup_c.tdz"
    big = torch.arange(9 << 18, dtype=torch.int32) % 251  # 9 MiB: three 4 MiB segments
    tree = {"a": {"b": big, "c": torch.zeros(1000)}, "d": torch.arange(5000, dtype=torch.uint8)}
    for nt in (None, 1):
        tdz_numba.save(tree, p, compression=compression, compresslevel=compresslevel, num_threads=nt)
        for _ in range(2):
            back = tdz_numba.load(p, num_threads=nt)
            sum_tree(back)
            del back
        with tdz_numba.open(p, num_threads=nt) as ar:
            float(ar["a/b"].sum())
    p.unlink()


def _payload_spans(path: Path) -> list[tuple[int, int]]:
    """``(offset, size)`` of every stored payload of a tdz archive (what verify checksums)."""
    from tdz_numba.zipfmt.index import ArchiveIndex

    index = ArchiveIndex(path, check_local=True)  # payload offsets of every entry
    try:
        stored = index.table[index.table["method"] == 0]
        return list(zip(stored["payload_offset"].tolist(), stored["csize"].tolist()))
    finally:
        index.close()


def _crc_file(path: Path, spans: list[tuple[int, int]]) -> int:
    """Maps ``path`` and runs zlib-ng's crc32 (one thread) over each span."""
    import mmap

    import numpy as np
    from zlib_ng import zlib_ng

    with open(path, "rb") as f:
        m = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
    try:
        buf = np.frombuffer(m, dtype=np.uint8)
        acc = 0
        for off, n in spans:
            acc ^= zlib_ng.crc32(buf[off : off + n])
        del buf
    finally:
        m.close()
    return acc


def run(
    *,
    workloads: Iterable[str] = WORKLOADS,
    ops: Iterable[str] = OPS,
    formats: Iterable[str] = FORMATS,
    size_mib: float = DEFAULT_SIZE_MIB,
    repeat: int = DEFAULT_REPEAT,
    cold: bool = False,
    directory: str | os.PathLike | None = None,
    progress: Callable[[str], None] | None = None,
    seed: int = 0,
    compression: str | None = None,
    compresslevel: int | None = None,
) -> BenchResult:
    """Runs the benchmark and returns a :class:`BenchResult`.

    ``directory`` is where artifacts go (a temporary sub-directory is made in
    it and removed at the end); by default a temporary directory in the
    current directory, so on the filesystem the user works on (not tmpfs).

    With ``compression`` (``"deflate"``) the compressed section runs instead:
    ``workloads``, ``ops`` and ``formats`` are then names from
    :data:`COMPRESSED_WORKLOADS`, :data:`COMPRESSED_OPS` and :data:`COMPRESSED_FORMATS`
    (the defaults of these arguments mean all of them).
    """
    import torch  # noqa: F401  (import cost outside every measurement)

    with warnings.catch_warnings():  # the caller's filters are left as they were
        warnings.filterwarnings("ignore", category=FutureWarning)
        warnings.filterwarnings("ignore", category=UserWarning, module="tensordict")
        warnings.filterwarnings("ignore", message="The given buffer is not writable")  # zlib_ng load
        return _run(
            workloads,
            ops,
            formats,
            size_mib,
            repeat,
            cold,
            directory,
            progress,
            seed,
            compression,
            compresslevel,
        )


def _run(
    workloads, ops, formats, size_mib, repeat, cold, directory, progress, seed, compression, compresslevel
) -> BenchResult:
    t_start = time.perf_counter()
    if compression is not None:
        if compression not in COMPRESSIONS:
            raise ValueError(f"unknown compression {compression!r}; choose from {', '.join(COMPRESSIONS)}")
        all_workloads: tuple[str, ...] = COMPRESSED_WORKLOADS
        all_ops: tuple[str, ...] = COMPRESSED_OPS
        all_formats: tuple[str, ...] = COMPRESSED_FORMATS
        if workloads is WORKLOADS:
            workloads = COMPRESSED_WORKLOADS
        if ops is OPS:
            ops = COMPRESSED_OPS
        if formats is FORMATS:
            formats = COMPRESSED_FORMATS
    else:
        all_workloads, all_ops, all_formats = WORKLOADS, OPS, FORMATS
    for kind, names, allowed in (
        ("workload", workloads, all_workloads),
        ("op", ops, all_ops),
        ("format", formats, all_formats),
    ):
        bad = [n for n in names if n not in allowed]
        if bad:
            raise ValueError(
                f"unknown {kind} {', '.join(map(repr, bad))}"
                + (f" with compression={compression!r}" if compression else "")
                + f"; choose from {', '.join(allowed)}"
            )
    ops = [o for o in all_ops if o in set(ops)]
    wanted = [f for f in all_formats if f in set(formats)]
    fmt_names, notes = available_formats(wanted)
    res = BenchResult(
        notes=notes,
        size_mib=size_mib,
        repeat=repeat,
        cold=cold,
        formats=fmt_names,
        ops=ops,
        compression=compression,
        compresslevel=compresslevel,
    )
    if compression is not None and compresslevel is not None and "td_tdz" in fmt_names:
        res.notes.append(
            f"td_tdz: tensordict's save takes no compression level: it uses zlib's "
            f"default, not {compresslevel}"
        )
    say = progress or (lambda s: None)

    parent = Path(directory) if directory is not None else Path.cwd()
    parent.mkdir(parents=True, exist_ok=True)
    root = Path(tempfile.mkdtemp(prefix=".tdz-bench-", dir=parent))
    res.directory = str(root)
    res.filesystem = filesystem_of(root)
    if "tmpfs" in res.filesystem.split(" ", 1)[0]:
        res.notes.append(f"artifacts are on tmpfs ({res.filesystem}): disk effects are not measured")
    try:
        _warm_up_jit(root)
        if compression is not None:
            _warm_up_compressed(root, compression, compresslevel)
        for wname in [w for w in all_workloads if w in set(workloads)]:
            say(f"[{wname}] generating {size_mib:g} MiB of data")
            w = make_workload(wname, size_mib, seed)
            res.workloads[wname] = f"{w.description} = {w.nbytes / 2**20:.1f} MiB"
            res.nbytes[wname] = w.nbytes
            fmts: dict[str, Format]
            if compression is None:
                fmts = {n: FORMAT_CLASSES[n]() for n in fmt_names}
            else:
                fmts = {n: COMPRESSED_CLASSES[n](compression, compresslevel) for n in fmt_names}
            _run_workload(w, root, ops, fmts, repeat, cold, res, say)
            del fmts
            del w
            gc.collect()
    finally:
        shutil.rmtree(root, ignore_errors=True)
    res.wall_s = time.perf_counter() - t_start
    return res


def _run_workload(
    w: Workload,
    root: Path,
    ops: list[str],
    fmts: dict[str, Format],
    repeat: int,
    cold: bool,
    res: BenchResult,
    say: Callable[[str], None],
) -> None:
    wdir = root / w.name
    wdir.mkdir()
    # reference total of the read op (sum of per-leaf float32 sums) and its tolerance
    ref_total = sum(float(t.sum()) for t in w.leaves())
    tol = 1e-6 * sum(float(t.abs().sum()) for t in w.leaves()) + 1e-3

    # the artifacts the reading ops use, written once outside timing
    artifacts: dict[str, Path] = {}
    broken: set[str] = set()
    reading_ops = [o for o in ops if o != "save"]
    for name, fmt in fmts.items():
        if not any(o in fmt.ops for o in reading_ops) and "save" not in ops:
            continue
        path = wdir / f"{name}{fmt.suffix}"
        try:
            fmt.save(w, path)
            gc.collect()
            _fsync(path)
        except Exception as exc:
            res.notes.append(f"{w.name}/{name}: save failed, format skipped: {_one_line(exc)}")
            broken.add(name)
            _remove(path)
            continue
        artifacts[name] = path
        res.sizes[(w.name, name)] = _du(path)

    def record(op: str, fmt_name: str, runs: list[float]) -> None:
        med = statistics.median(runs)
        row = {"workload": w.name, "op": op, "format": fmt_name, "median_ms": med, "runs_ms": runs}
        if res.compression is not None:
            file_bytes = res.sizes.get((w.name, fmt_name))
            row.update(
                compression=res.compression,
                compresslevel=res.compresslevel,
                nbytes=w.nbytes,
                file_bytes=file_bytes,
                size_ratio=w.nbytes / file_bytes if file_bytes else None,
            )
        res.results.append(row)
        say(
            f"[{w.name}] {op:<6} {fmt_name:<16} {med:10.2f} ms  (runs: "
            + ", ".join(f"{r:.1f}" for r in runs)
            + ")"
        )

    for op in ops:  # the formats of one op measured in alternating rounds (measure_rounds)
        cells: dict[str, Cell] = {}
        for name, fmt in fmts.items():
            if name in broken or op not in fmt.ops:
                continue
            cells[name] = _cell(op, w, fmt, artifacts[name], wdir, cold, ref_total, tol, res)
            if op == "verify" and name == "tdz_numba":
                cells[CRC_FORMAT] = _crc_cell(artifacts[name], cold)
        for name, runs in measure_rounds(cells, repeat).items():
            if isinstance(runs, BaseException):
                res.notes.append(f"{w.name}/{op}/{name}: failed: {_one_line(runs)}")
            else:
                record(op, name, runs)
    for path in artifacts.values():
        _remove(path)
    shutil.rmtree(wdir, ignore_errors=True)


def _cell(
    op: str,
    w: Workload,
    fmt: Format,
    artifact: Path,
    wdir: Path,
    cold: bool,
    ref_total: float,
    tol: float,
    res: BenchResult,
) -> Cell:
    if op in ("save", "copy"):
        written: list[Path] = []
        stem = f"{fmt.name}.{op}"

        def target(i: int) -> Path:
            return wdir / f"{stem}{i}{fmt.suffix}"

        def clear() -> None:
            while written:
                _remove(written.pop())

        def before(i: int) -> None:
            clear()  # the previous artifact goes outside the timed region
            _remove(target(i))
            if op == "copy" and cold:
                drop_cache(artifact)

        def wrote(i: int, out: Any) -> None:
            written.append(target(i))
            _fsync(target(i))  # writeback does not spill into the next run

        if op == "save":
            fn = lambda i: fmt.save(w, target(i))  # noqa: E731
        elif fmt.is_dir:
            fn = lambda i: shutil.copytree(artifact, target(i))  # noqa: E731
        else:
            fn = lambda i: shutil.copyfile(artifact, target(i))  # noqa: E731
        return Cell(fn, before, wrote, clear)

    dropping: Callable[[int], None] | None = (lambda i: drop_cache(artifact)) if cold else None
    if op == "open":
        return Cell(lambda i: fmt.open(artifact), dropping)
    if op in ("read", "load"):  # load: the compressed section's open + sum of every leaf

        def checked(i: int, out: Any) -> None:
            if i == 0:
                total = out[0]
                if not math.isfinite(total) or abs(total - ref_total) > tol:
                    res.notes.append(
                        f"{w.name}/{op}/{fmt.name}: WARNING: sum of leaves {total!r} "
                        f"differs from the in-memory sum {ref_total!r}"
                    )

        return Cell(lambda i: fmt.read(w, artifact), dropping, checked)
    if op == "verify":
        import tdz_numba

        return Cell(lambda i: tdz_numba.verify(artifact), dropping)
    raise ValueError(f"unknown op {op!r}")  # pragma: no cover


def _crc_cell(artifact: Path, cold: bool) -> Cell:
    spans = _payload_spans(artifact)
    before = (lambda i: drop_cache(artifact)) if cold else None
    return Cell(lambda i: _crc_file(artifact, spans), before)


def _one_line(exc: BaseException) -> str:
    text = " ".join(str(exc).split())
    return f"{type(exc).__name__}: {text}" if text else type(exc).__name__
