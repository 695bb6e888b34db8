"""The benchmark harness: tdz_numba against tensordict, torch, safetensors and a raw-write floor.

Run ``tdz bench`` or ``python -m tdz_numba.bench`` (``--quick`` for a 16 MiB
run, ``--help`` for the filters). Two workloads of random float32 data
(default 256 MiB each):

* ``flat``: 8 leaves of shape ``(2048, 4096)`` (rows scale with ``--size-mib``);
* ``small``: 100 groups x 20 leaves of 33,554 values (values scale with the size),
  nested as ``{"group_000": {"leaf_00": t, ...}, ...}``.

Ops: ``save``, ``open`` (lazy open), ``read`` (open + ``float(t.sum())`` over
every leaf), ``copy`` (``shutil.copyfile`` / ``copytree`` of the artifact) and
``verify`` (``tdz_numba.verify``, with zlib-ng's single-thread ``crc32`` over
the same payload bytes for comparison).

Method: for every (workload, op, format) one warm-up run, then ``--repeat``
timed runs; the median is reported. Every save (and copy) writes a fresh path;
the previous artifact is deleted, and the new one fsynced, outside the timed
region. Results (returned handles, mappings, buffers) are also released
outside it, with the garbage collector run before and disabled during each
timed run. Numba kernels are compiled (or loaded from cache) before timing.
With ``--cold`` every file of the artifact is fsynced and its pages dropped
(``posix_fadvise(DONTNEED)``) before each timed open, read, copy and verify.
"""

from __future__ import annotations

import argparse
import gc
import math
import os
import platform
import shlex
import shutil
import statistics
import sys
import tempfile
import time
import warnings
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

__all__ = ["WORKLOADS", "OPS", "FORMATS", "CRC_FORMAT", "BenchResult", "run", "main",
           "format_table", "plot"]  # fmt: skip

WORKLOADS = ("flat", "small")
OPS = ("save", "open", "read", "copy", "verify")
FORMATS = ("tdz_numba", "td_tdz", "td_dir", "td_consolidated", "torch", "safetensors", "floor")
#: Pseudo-format of the verify row: zlib-ng's single-thread crc32 over the same payload bytes.
CRC_FORMAT = "zlib_ng_crc32"

DEFAULT_SIZE_MIB = 256.0
DEFAULT_REPEAT = 5
QUICK_SIZE_MIB = 16.0
QUICK_REPEAT = 3

_COLORS = {
    "tdz_numba": "#d62728",
    "td_tdz": "#1f77b4",
    "td_dir": "#aec7e8",
    "td_consolidated": "#17becf",
    "torch": "#ff7f0e",
    "safetensors": "#2ca02c",
    "floor": "#7f7f7f",
    CRC_FORMAT: "#9467bd",
}


# -- workloads -------------------------------------------------------------------------


@dataclass
class Workload:
    """One workload's data, made once: the nested tree and views of it for every format."""

    name: str
    description: str
    tree: dict  # nested dicts of tensors
    flat: dict  # "group_000.leaf_00" -> tensor (the same tensors)
    arrays: list  # numpy views of every leaf, in order
    nbytes: int
    _td: Any = None

    @property
    def td(self):
        """The tree as a TensorDict (built once, outside timing; shares the tensors)."""
        if self._td is None:
            from tensordict import TensorDict

            self._td = TensorDict(self.tree, batch_size=[])
        return self._td

    def leaves(self) -> Iterable:
        return self.flat.values()


def make_workload(name: str, size_mib: float, seed: int = 0) -> Workload:
    """The ``flat`` or ``small`` workload at ``size_mib`` MiB of float32 random data."""
    import torch

    scale = size_mib / DEFAULT_SIZE_MIB
    g = torch.Generator().manual_seed(seed)
    if name == "flat":
        rows = max(1, round(2048 * scale))
        tree = {f"leaf_{i:02d}": torch.randn(rows, 4096, generator=g) for i in range(8)}
        description = f"8 x float32[{rows}, 4096]"
    elif name == "small":
        values = max(1, round(33_554 * scale))
        tree = {
            f"group_{i:03d}": {f"leaf_{j:02d}": torch.randn(values, generator=g) for j in range(20)}
            for i in range(100)
        }
        description = f"100 groups x 20 x float32[{values}]"
    else:  # pragma: no cover - argparse restricts the names
        raise ValueError(f"unknown workload {name!r}")
    flat: dict = {}

    def walk(d: dict, prefix: str) -> None:
        for k, v in d.items():
            if isinstance(v, dict):
                walk(v, f"{prefix}{k}.")
            else:
                flat[prefix + k] = v

    walk(tree, "")
    arrays = [t.numpy() for t in flat.values()]
    nbytes = sum(a.nbytes for a in arrays)
    return Workload(name, description, tree, flat, arrays, nbytes)


# -- formats -----------------------------------------------------------------------------


def _sum_leaves(tensors: Iterable) -> float:
    return sum(float(t.sum()) for t in tensors)


class Format:
    """How one format saves, opens and reads a workload. Every timed function returns
    what it created so that releasing it happens outside the timed region."""

    name = ""
    suffix = ""
    is_dir = False
    ops: tuple[str, ...] = ("save", "open", "read", "copy")

    def save(self, w: Workload, path: Path) -> Any:
        raise NotImplementedError

    def open(self, path: Path) -> Any:
        raise NotImplementedError

    def read(self, w: Workload, path: Path) -> tuple[float, Any]:
        raise NotImplementedError


class TdzNumba(Format):
    name, suffix = "tdz_numba", ".tdz"
    ops = ("save", "open", "read", "copy", "verify")

    def save(self, w, path):
        import tdz_numba

        return tdz_numba.save(w.tree, path)

    def open(self, path):
        import tdz_numba

        ar = tdz_numba.open(path)
        ar.close()
        return ar

    def read(self, w, path):
        import tdz_numba

        ar = tdz_numba.open(path)
        total = sum(float(ar[key].sum()) for key, _ in ar.leaves())
        ar.close()
        return total, ar  # ar keeps the leaves (and the mapping) until released


class TdTdz(Format):
    name, suffix = "td_tdz", ".tdz"

    def save(self, w, path):
        return w.td.save(path)

    def open(self, path):
        from tensordict import TensorDict

        return TensorDict.load_memmap(path)

    def read(self, w, path):
        td = self.open(path)
        return _sum_leaves(td.values(include_nested=True, leaves_only=True)), td


class TdDir(TdTdz):
    name, suffix, is_dir = "td_dir", "", True

    def save(self, w, path):
        return w.td.memmap(path)


class TdConsolidated(Format):
    name, suffix = "td_consolidated", ".td"

    def save(self, w, path):
        return w.td.consolidate(filename=path)

    def open(self, path):
        from tensordict import TensorDict

        return TensorDict.from_consolidated(path)

    def read(self, w, path):
        td = self.open(path)
        return _sum_leaves(td.values(include_nested=True, leaves_only=True)), td


class TorchFormat(Format):
    name, suffix = "torch", ".pt"

    def save(self, w, path):
        import torch

        torch.save(w.flat, path)

    def open(self, path):
        import torch

        return torch.load(path, mmap=True, weights_only=True)

    def read(self, w, path):
        d = self.open(path)
        return _sum_leaves(d.values()), d


class SafetensorsFormat(Format):
    name, suffix = "safetensors", ".safetensors"

    def save(self, w, path):
        from safetensors.torch import save_file

        save_file(w.flat, path)

    def open(self, path):
        from safetensors import safe_open

        with safe_open(path, "pt") as f:
            keys = list(f.keys())
        return keys

    def read(self, w, path):
        from safetensors.torch import load_file

        d = load_file(path)
        return _sum_leaves(d.values()), d


class Floor(Format):
    """Raw ``write`` of every leaf's bytes into one file; reading sums the in-memory arrays."""

    name, suffix = "floor", ".bin"
    ops = ("save", "read", "copy")

    def save(self, w, path):
        with open(path, "wb") as f:
            for a in w.arrays:
                f.write(a)

    def read(self, w, path):
        return sum(float(a.sum()) for a in w.arrays), None


_FORMAT_CLASSES = {c.name: c for c in (TdzNumba, TdTdz, TdDir, TdConsolidated, TorchFormat,
                                       SafetensorsFormat, Floor)}  # fmt: skip


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


def measure(fn: Callable[[], Any], repeat: int, *, before: Callable[[int], None] | None = None,
            after: Callable[[int, Any], None] | None = None) -> list[float]:  # fmt: skip
    """One warm-up run (index 0) then ``repeat`` timed runs; returns the timed runs in ms.

    ``before(i)`` and ``after(i, result)`` run outside the timed region; the
    result is released after ``after``.
    """
    runs: list[float] = []
    for i in range(repeat + 1):
        if before is not None:
            before(i)
        ms, out = _timed(lambda i=i: fn(i))
        if after is not None:
            after(i, out)
        del out
        gc.collect()
        if i:
            runs.append(ms)
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

    def cell(self, workload: str, op: str, fmt: str) -> dict | None:
        for r in self.results:
            if (r["workload"], r["op"], r["format"]) == (workload, op, fmt):
                return r
        return None


def available_formats(formats: Iterable[str]) -> tuple[list[str], list[str]]:
    """``(usable formats, notes)``: tensordict and safetensors formats are skipped when
    their package does not import."""
    usable, notes = [], []
    need = {"td_tdz": "tensordict", "td_dir": "tensordict", "td_consolidated": "tensordict",
            "safetensors": "safetensors"}  # fmt: skip
    failed: dict[str, str] = {}
    for fmt in formats:
        pkg = need.get(fmt)
        if pkg is not None and pkg not in failed:
            try:
                with warnings.catch_warnings():
                    warnings.simplefilter("ignore")
                    if pkg == "tensordict":
                        import tensordict  # noqa: F401
                    else:
                        import safetensors.torch  # noqa: F401
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


def _payload_spans(path: Path) -> list[tuple[int, int]]:
    """``(offset, size)`` of every stored payload of a tdz archive (what verify checksums)."""
    from tdz_numba.reader import ArchiveIndex

    index = ArchiveIndex(path, check_local=True)  # payload offsets of every entry
    try:
        f = index.fields
        return [(int(f[i, 8]), int(f[i, 3])) for i in range(len(index.names)) if int(f[i, 1]) == 0]
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


def run(*, workloads: Iterable[str] = WORKLOADS, ops: Iterable[str] = OPS,
        formats: Iterable[str] = FORMATS, size_mib: float = DEFAULT_SIZE_MIB,
        repeat: int = DEFAULT_REPEAT, cold: bool = False, directory: str | os.PathLike | None = None,
        progress: Callable[[str], None] | None = None, seed: int = 0) -> BenchResult:  # fmt: skip
    """Runs the benchmark and returns a :class:`BenchResult`.

    ``directory`` is where artifacts go (a temporary sub-directory is made in
    it and removed at the end); by default a temporary directory in the
    current directory, so on the filesystem the user works on (not tmpfs).
    """
    import torch  # noqa: F401  (import cost outside every measurement)

    warnings.filterwarnings("ignore", category=FutureWarning)
    warnings.filterwarnings("ignore", category=UserWarning, module="tensordict")
    t_start = time.perf_counter()
    ops = [o for o in OPS if o in set(ops)]
    wanted = [f for f in FORMATS if f in set(formats)]
    fmt_names, notes = available_formats(wanted)
    res = BenchResult(notes=notes, size_mib=size_mib, repeat=repeat, cold=cold,
                      formats=fmt_names, ops=ops)  # fmt: skip
    say = progress or (lambda s: None)

    parent = Path(directory) if directory is not None else Path.cwd()
    parent.mkdir(parents=True, exist_ok=True)
    root = Path(tempfile.mkdtemp(prefix=".tdz-bench-", dir=parent))
    res.directory = str(root)
    res.filesystem = filesystem_of(root)
    if "tmpfs" in res.filesystem.split(" ", 1)[0]:
        res.notes.append(f"artifacts are on tmpfs ({res.filesystem}): disk effects are not measured")
    frozen = False
    try:
        _warm_up_jit(root)
        # long-lived objects (torch, tensordict, ...) out of the collector's way: the
        # collections run around every timed run then only scan what the runs made
        gc.collect()
        gc.freeze()
        frozen = True
        for wname in [w for w in WORKLOADS if w in set(workloads)]:
            say(f"[{wname}] generating {size_mib:g} MiB of data")
            w = make_workload(wname, size_mib, seed)
            res.workloads[wname] = f"{w.description} = {w.nbytes / 2**20:.1f} MiB"
            _run_workload(w, root, ops, fmt_names, repeat, cold, res, say)
            del w
            gc.collect()
    finally:
        if frozen:
            gc.unfreeze()
        shutil.rmtree(root, ignore_errors=True)
    res.wall_s = time.perf_counter() - t_start
    return res


def _run_workload(w: Workload, root: Path, ops: list[str], fmt_names: list[str], repeat: int,
                  cold: bool, res: BenchResult, say: Callable[[str], None]) -> None:  # fmt: skip
    wdir = root / w.name
    wdir.mkdir()
    fmts = {n: _FORMAT_CLASSES[n]() for n in fmt_names}
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
        res.results.append({"workload": w.name, "op": op, "format": fmt_name,
                            "median_ms": med, "runs_ms": runs})  # fmt: skip
        say(f"[{w.name}] {op:<6} {fmt_name:<16} {med:10.2f} ms  (runs: "
            + ", ".join(f"{r:.1f}" for r in runs) + ")")

    for op in ops:
        for name, fmt in fmts.items():
            if name in broken or op not in fmt.ops:
                continue
            try:
                runs = _measure_cell(op, w, fmt, artifacts[name], wdir, repeat, cold, ref_total, tol, res)
            except Exception as exc:
                res.notes.append(f"{w.name}/{op}/{name}: failed: {_one_line(exc)}")
                continue
            record(op, name, runs)
            if op == "verify" and name == "tdz_numba":
                try:
                    runs = _measure_crc(artifacts[name], repeat, cold)
                except Exception as exc:
                    res.notes.append(f"{w.name}/verify/{CRC_FORMAT}: failed: {_one_line(exc)}")
                else:
                    record(op, CRC_FORMAT, runs)
    for path in artifacts.values():
        _remove(path)
    shutil.rmtree(wdir, ignore_errors=True)


def _measure_cell(op: str, w: Workload, fmt: Format, artifact: Path, wdir: Path, repeat: int,
                  cold: bool, ref_total: float, tol: float, res: BenchResult) -> list[float]:  # fmt: skip
    if op in ("save", "copy"):
        written: list[Path] = []
        stem = f"{fmt.name}.{op}"

        def target(i: int) -> Path:
            return wdir / f"{stem}{i}{fmt.suffix}"

        def before(i: int) -> None:
            while written:  # the previous artifact goes outside the timed region
                _remove(written.pop())
            _remove(target(i))
            if op == "copy" and cold:
                drop_cache(artifact)

        def after(i: int, out: Any) -> None:
            written.append(target(i))
            _fsync(target(i))  # writeback does not spill into the next run

        if op == "save":
            fn = lambda i: fmt.save(w, target(i))  # noqa: E731
        elif fmt.is_dir:
            fn = lambda i: shutil.copytree(artifact, target(i))  # noqa: E731
        else:
            fn = lambda i: shutil.copyfile(artifact, target(i))  # noqa: E731
        try:
            return measure(fn, repeat, before=before, after=after)
        finally:
            for p in written:
                _remove(p)

    before = (lambda i: drop_cache(artifact)) if cold else None
    if op == "open":
        return measure(lambda i: fmt.open(artifact), repeat, before=before)
    if op == "read":
        def after(i: int, out: Any) -> None:
            if i == 0:
                total = out[0]
                if not math.isfinite(total) or abs(total - ref_total) > tol:
                    res.notes.append(f"{w.name}/read/{fmt.name}: WARNING: sum of leaves {total!r} "
                                     f"differs from the in-memory sum {ref_total!r}")  # fmt: skip

        return measure(lambda i: fmt.read(w, artifact), repeat, before=before, after=after)
    if op == "verify":
        import tdz_numba

        return measure(lambda i: tdz_numba.verify(artifact), repeat, before=before)
    raise ValueError(f"unknown op {op!r}")  # pragma: no cover


def _measure_crc(artifact: Path, repeat: int, cold: bool) -> list[float]:
    spans = _payload_spans(artifact)
    before = (lambda i: drop_cache(artifact)) if cold else None
    return measure(lambda i: _crc_file(artifact, spans), repeat, before=before)


def _one_line(exc: BaseException) -> str:
    text = " ".join(str(exc).split())
    return f"{type(exc).__name__}: {text}" if text else type(exc).__name__


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
        affinity = os.cpu_count()
    threads = ""
    try:
        import torch

        threads = f" (torch threads {torch.get_num_threads()}"
        import numba

        threads += f", numba threads {numba.config.NUMBA_NUM_THREADS})"
    except Exception:  # pragma: no cover
        threads += ")" if threads else ""
    return (f"machine: {os.cpu_count()} cpus, {affinity} usable{threads}, {platform.platform()}, "
            f"python {platform.python_version()}, torch {version('torch')}, numba {version('numba')}, "
            f"numpy {version('numpy')}, tensordict {version('tensordict')}, "
            f"safetensors {version('safetensors')}, zlib-ng {version('zlib-ng')}, "
            f"tdz_numba {version('tdz_numba')}")  # fmt: skip


def format_table(res: BenchResult) -> str:
    """Rows = (workload, op), columns = formats; cells ``"12.3 ms (2.1x)"`` where the
    ratio is the cell over tdz_numba's cell of the same row."""
    cols = [f for f in [*FORMATS, CRC_FORMAT] if any(r["format"] == f for r in res.results)]
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
    lines = ["  ".join(h.ljust(wd) for h, wd in zip(header, widths)).rstrip(),
             "  ".join("-" * wd for wd in widths)]  # fmt: skip
    for row in rows:
        lines.append("  ".join((c.ljust(wd) if i < 2 else c.rjust(wd)) for i, (c, wd)
                               in enumerate(zip(row, widths))).rstrip())  # fmt: skip
    return "\n".join(lines)


def fastest_lines(res: BenchResult) -> list[str]:
    """Per row, the fastest format (the crc32 comparison and the floor aside)."""
    out = []
    for wname in res.workloads:
        for op in res.ops:
            cells = [r for r in res.results if r["workload"] == wname and r["op"] == op
                     and r["format"] not in (CRC_FORMAT, "floor")]  # fmt: skip
            if len(cells) < 2:
                continue
            cells.sort(key=lambda r: r["median_ms"])
            best, second = cells[0], cells[1]
            out.append(f"fastest {wname}/{op}: {best['format']} ({_fmt_ms(best['median_ms'])}, "
                       f"{second['median_ms'] / best['median_ms']:.2f}x ahead of {second['format']})")  # fmt: skip
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


def report(res: BenchResult, argv: list[str]) -> str:
    """The header, the table and the notes, as printed by ``tdz bench``."""
    mode = ("cold (fsync + posix_fadvise DONTNEED of every artifact file before each timed "
            "open/read/copy/verify)" if res.cold else "warm page cache")  # fmt: skip
    lines = [
        "tdz_numba benchmark",
        machine_info(),
        f"size: {res.size_mib:g} MiB per workload, repeat: {res.repeat} (+1 warm-up, median reported), "
        f"cache: {mode}",
        f"artifacts: {res.directory} on {res.filesystem} (removed after the run)",
        "reproduce: " + shlex.join([sys.executable, "-m", "tdz_numba", "bench", *argv]),
    ]
    for wname, desc in res.workloads.items():
        sizes = ", ".join(f"{f} {_human(n)}" for (w, f), n in res.sizes.items() if w == wname)
        lines.append(f"workload {wname}: {desc}" + (f"; artifacts: {sizes}" if sizes else ""))
    lines += ["", format_table(res), ""]
    lines.append("cells: median (ratio to tdz_numba in the same row); '-' = not applicable. "
                 "open = lazy open (no payload read); read = open + float(t.sum()) of every leaf "
                 "(floor: numpy sum of the in-memory arrays); copy = shutil.copyfile/copytree; "
                 f"{CRC_FORMAT} = zlib-ng crc32 on one thread over the payloads that verify checks.")  # fmt: skip
    for wname in res.workloads:
        v = res.cell(wname, "verify", "tdz_numba")
        c = res.cell(wname, "verify", CRC_FORMAT)
        if v is not None:
            n = sum(a for (w, f), a in res.sizes.items() if w == wname and f == "tdz_numba")
            text = f"verify {wname}: tdz_numba.verify {n / v['median_ms'] / 1e6:.2f} GB/s"
            if c is not None:
                text += f", zlib-ng crc32 single thread {n / c['median_ms'] / 1e6:.2f} GB/s"
            lines.append(text + f" (over {_human(n)})")
    lines += fastest_lines(res)
    lines += _spread_lines(res)
    lines += [f"note: {n}" for n in res.notes]
    lines.append(f"total wall time: {res.wall_s:.1f} s")
    return "\n".join(lines)


def _human(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} GiB"  # pragma: no cover


def plot(res: BenchResult, path: str | os.PathLike) -> Path:
    """A grouped bar chart (one panel per workload x op, log y axis) saved to ``path``."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    wnames = list(res.workloads)
    ops = [o for o in res.ops if any(r["op"] == o for r in res.results)]
    cols = [f for f in [*FORMATS, CRC_FORMAT] if any(r["format"] == f for r in res.results)]
    fig, axes = plt.subplots(len(wnames), len(ops), figsize=(3.2 * len(ops) + 1, 3.4 * len(wnames) + 0.8),
                             squeeze=False)  # fmt: skip
    for i, wname in enumerate(wnames):
        for j, op in enumerate(ops):
            ax = axes[i][j]
            cells = [(f, res.cell(wname, op, f)) for f in cols]
            cells = [(f, c) for f, c in cells if c is not None]
            xs = range(len(cells))
            vals = [c["median_ms"] for _, c in cells]
            bars = ax.bar(xs, vals, color=[_COLORS.get(f, "#333333") for f, _ in cells])
            for b, v in zip(bars, vals):
                ax.annotate(_fmt_ms(v).replace(" ms", ""), (b.get_x() + b.get_width() / 2, v),
                            ha="center", va="bottom", fontsize=6, rotation=90,
                            xytext=(0, 2), textcoords="offset points")  # fmt: skip
            ax.set_yscale("log")
            ax.set_xticks(list(xs))
            ax.set_xticklabels([f for f, _ in cells], rotation=60, ha="right", fontsize=7)
            ax.set_title(f"{wname} / {op}", fontsize=9)
            if j == 0:
                ax.set_ylabel("median ms (log)")
            if vals:
                ax.set_ylim(min(vals) / 2, max(vals) * 4)
    handles = [plt.Rectangle((0, 0), 1, 1, color=_COLORS.get(f, "#333333")) for f in cols]
    top = 1 - 0.6 / fig.get_figheight()  # room for the title and the legend, in figure fraction
    fig.suptitle(f"tdz_numba bench: {res.size_mib:g} MiB per workload, median of {res.repeat}, "
                 f"{'cold' if res.cold else 'warm'} cache (lower is better)", y=0.995, fontsize=10)  # fmt: skip
    fig.legend(handles, cols, loc="upper center", bbox_to_anchor=(0.5, 1 - 0.35 / fig.get_figheight()),
               ncol=len(cols), fontsize=8, frameon=False)  # fmt: skip
    fig.tight_layout(rect=(0, 0, 1, top))
    out = Path(path)
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=120)
    plt.close(fig)
    return out


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
    p.add_argument("--workload", type=_choices(WORKLOADS, "workload"), default=list(WORKLOADS),
                   help=f"comma list of {', '.join(WORKLOADS)} (default all)")
    p.add_argument("--op", type=_choices(OPS, "op"), default=list(OPS),
                   help=f"comma list of {', '.join(OPS)} (default all)")
    p.add_argument("--format", type=_choices(FORMATS, "format"), default=list(FORMATS),
                   help=f"comma list of {', '.join(FORMATS)} (default all)")
    p.add_argument("--size-mib", type=_positive(float), default=None,
                   help=f"MiB of data per workload (default {DEFAULT_SIZE_MIB:g}; {QUICK_SIZE_MIB:g} with --quick)")
    p.add_argument("--repeat", type=_positive(int), default=None,
                   help=f"timed runs per cell after one warm-up (default {DEFAULT_REPEAT}; "
                        f"{QUICK_REPEAT} with --quick)")  # fmt: skip
    p.add_argument("--cold", action="store_true",
                   help="drop the artifact's cached pages before each timed open/read/copy/verify")
    p.add_argument("--dir", type=Path, default=None,
                   help="where artifacts go (a temporary sub-directory is made there; default: the "
                        "current directory, not /dev/shm)")  # fmt: skip
    p.add_argument("--json", action="store_true",
                   help="print the results as JSON on stdout (the report goes to stderr)")
    p.add_argument("--plot", type=Path, default=None, metavar="OUT.png", help="save a bar chart (matplotlib)")
    p.add_argument("--quick", action="store_true", help=f"size {QUICK_SIZE_MIB:g} MiB, repeat {QUICK_REPEAT}")
    p.add_argument("-v", "--verbose", action="store_true", help="print each cell to stderr as it is measured")
    return p


def main(argv: list[str] | None = None, prog: str = "tdz bench") -> int:
    """Entry point of ``tdz bench`` and ``python -m tdz_numba.bench``."""
    import json

    argv = list(sys.argv[1:] if argv is None else argv)
    args = build_parser(prog).parse_args(argv)
    size = args.size_mib if args.size_mib is not None else (QUICK_SIZE_MIB if args.quick else DEFAULT_SIZE_MIB)
    repeat = args.repeat if args.repeat is not None else (QUICK_REPEAT if args.quick else DEFAULT_REPEAT)

    def progress(line: str) -> None:
        print(line, file=sys.stderr, flush=True)

    res = run(workloads=args.workload, ops=args.op, formats=args.format, size_mib=size, repeat=repeat,
              cold=args.cold, directory=args.dir, progress=progress if args.verbose else None)  # fmt: skip
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


if __name__ == "__main__":
    raise SystemExit(main(prog="python -m tdz_numba.bench"))
