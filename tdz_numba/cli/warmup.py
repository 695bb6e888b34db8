"""``tdz_numba.warmup()`` / ``tdz warmup``: compiles every kernel signature into Numba's cache.

Kernels are compiled on their first call and cached on disk (``cache=True``),
so a fresh environment pays 10-30 s of compilation spread over its first
save, load, verify, compressed save/load, GGUF dequantize and prefetch. Every
signature the package calls a kernel with is listed in one place,
:data:`tdz_numba.cli.signatures.SIGNATURES`; this module compiles each of them
(``Dispatcher.compile``: nothing runs), family by family, then runs each
family's paths once on a few bytes in a temporary directory as a check: a
signature those paths compile beyond the table is reported as missing from it
(and compiled all the same). Run it in a Docker build, a conda post-link
script or a CI setup step; a second run only loads from the cache.
When every family ran, it writes a marker next to the cache
(:func:`tdz_numba.zipfmt.kernels.dispatch.write_marker`): from then on saves and
loads use the kernels (before, small ones use their pure-Python twins, see
:mod:`tdz_numba.zipfmt.kernels.dispatch`). ``python -m tdz_numba.cli.warmup
--background`` is the quiet, low-priority run that a first cold save or load
starts when the user opted in (``TDZ_NUMBA_BACKGROUND_WARMUP=1``).

Examples
--------
>>> import tdz_numba
>>> report = tdz_numba.warmup(verbose=False)  # doctest: +SKIP
>>> sorted(report.families)  # doctest: +SKIP
['CRC', 'deflate/inflate', 'dequantize', 'index', 'layout', 'memory pages']
"""

from __future__ import annotations

import contextlib
import mmap
import os
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TextIO

import numpy as np

from ..errors import InternalError

__all__ = [
    "WarmupReport",
    "warmup",
    "kernel_dispatchers",
    "kernel_signatures",
    "signature_table",
    "cache_dirs",
    "background_main",
]

_KERNEL_MODULES = (
    "tdz_numba.zipfmt.kernels.crc",
    "tdz_numba.zipfmt.kernels.central",
    "tdz_numba.zipfmt.kernels.deflate",
    "tdz_numba.files.page_kernels",
    "tdz_numba.zipfmt.kernels.verify",
    "tdz_numba.formats.gguf_kernels",
    "tdz_numba.formats.hdf5_headers",
    "tdz_numba.formats.pickle_scan",
    "tdz_numba.formats.pickle_shapes",
    "tdz_numba.formats.pt_records",
    "tdz_numba.formats.npz_scan",
    "tdz_numba.formats.onnx_scan",
    "tdz_numba.formats.safetensors_scan",
    "tdz_numba.formats.gguf_scan",
    "tdz_numba.tdz.metascan",
)


@dataclass
class WarmupReport:
    """What :func:`warmup` did: per family, seconds and the kernels compiled (not loaded from the cache).

    Attributes
    ----------
    families : dict
        Family name -> (seconds, list of kernels compiled during that family).
    cache_dirs : list of str
        The directories Numba's cache files of tdz_numba's kernels live in.
    """

    families: dict[str, tuple[float, list[str]]] = field(default_factory=dict)
    cache_dirs: list[str] = field(default_factory=list)
    #: Signatures compiled by the families' paths that the table does not list ("module.name(types)").
    missing: list[str] = field(default_factory=list)

    @property
    def compiled(self) -> list[str]:
        """Every kernel compiled (rather than loaded from the cache), in order."""
        return [name for _, names in self.families.values() for name in names]


def kernel_dispatchers() -> dict[str, Any]:
    """Every Numba dispatcher of tdz_numba's kernel modules, by ``module.name``."""
    import importlib

    from numba.core.registry import CPUDispatcher

    out: dict[str, Any] = {}
    for modname in _KERNEL_MODULES:
        module = importlib.import_module(modname)
        for name, obj in vars(module).items():
            if isinstance(obj, CPUDispatcher):
                out[f"{modname}.{name}"] = obj
    return out


def _family_of(kernel: str) -> str:
    """The family a kernel ("tdz_numba.module.name") is compiled in (any other module: the first)."""
    module = kernel.rsplit(".", 1)[0]
    if module.endswith(".deflate"):
        return "deflate/inflate"
    if module.endswith(".gguf_kernels"):
        return "dequantize"
    if module.endswith(".page_kernels"):
        return "memory pages"
    return "CRC, layout, index"


_PARSED: dict[str, Any] = {}


def _parse_type(text: str) -> Any:
    """A Numba type from its text in the table (the package's own source, written by
    :func:`signature_table`: evaluated with nothing but :mod:`numba.core.types` in scope)."""
    if text not in _PARSED:
        from numba.core import types

        names = {k: v for k, v in vars(types).items() if not k.startswith("_")}
        _PARSED[text] = eval(text, {"__builtins__": {}}, names)  # noqa: S307
    return _PARSED[text]


def _type_text(t: Any) -> str:
    """The text of a Numba type that :func:`_parse_type` reads back as the same type."""
    from numba.core import types

    candidates = [repr(t)]
    if isinstance(t, types.Buffer):  # bytes, bytearray, array.array: their repr is not Python
        candidates.append(
            f"{type(t).__name__}({t.dtype!r}, {t.ndim}, {t.layout!r}, readonly={not t.mutable})"
        )
    for text in candidates:
        try:
            if _parse_type(text) == t:
                return text
        except Exception:  # noqa: BLE001 - not a Python expression: the next candidate
            continue
    raise InternalError(f"warm-up: the Numba type {t!r} cannot be written in the signature table")


def kernel_signatures() -> dict[str, tuple[tuple[Any, ...], ...]]:
    """:data:`~tdz_numba.cli.signatures.SIGNATURES` as Numba types: kernel -> argument type tuples."""
    from .signatures import SIGNATURES

    return {
        kernel: tuple(tuple(map(_parse_type, sig)) for sig in sigs) for kernel, sigs in SIGNATURES.items()
    }


def _sig_text(sig: tuple[Any, ...]) -> tuple[str, ...]:
    return tuple(_type_text(t) for t in sig)


def _held_signatures() -> list[tuple[str, tuple[Any, ...]]]:
    """``(kernel, argument types)`` of every signature the dispatchers hold, less those with
    literal types (a helper compiled for the constants another kernel calls it with: never
    a call from Python)."""
    from numba.core import types

    return [
        (name, tuple(sig))
        for name, disp in kernel_dispatchers().items()
        for sig in disp.signatures
        if not any(isinstance(t, types.Literal) for t in sig)
    ]


def signature_table(extra: dict[str, list[tuple[str, ...]]] | None = None) -> str:
    """The source of :data:`~tdz_numba.cli.signatures.SIGNATURES` for every signature the kernel
    dispatchers of this process hold (compiled or loaded from the cache), merged with the
    current table and ``extra``: run the package's workloads first (see that module)."""
    from .signatures import SIGNATURES

    table: dict[str, set[tuple[str, ...]]] = {k: set(v) for k, v in SIGNATURES.items()}
    for name, sig in _held_signatures():
        table.setdefault(name, set()).add(_sig_text(sig))
    for name, sigs in (extra or {}).items():
        table.setdefault(name, set()).update(map(tuple, sigs))
    lines = ["SIGNATURES: dict[str, tuple[tuple[str, ...], ...]] = {"]
    for name in sorted(k for k, v in table.items() if v and k in kernel_dispatchers()):
        lines.append(f"    {name!r}: (")
        lines += [f"        {sig!r}," for sig in sorted(table[name])]
        lines.append("    ),")
    lines.append("}")
    return "\n".join(lines)


def _compile_table(family: str) -> None:
    """Compiles (or loads from the cache) every signature of the table in ``family``."""
    dispatchers = kernel_dispatchers()
    for kernel, sigs in kernel_signatures().items():
        disp = dispatchers.get(kernel)
        if disp is None or _family_of(kernel) != family:
            continue  # (a kernel gone from the package: the table is regenerated, see signatures.py)
        for sig in sigs:
            disp.compile(sig)


def _not_in_table() -> list[str]:
    """Signatures the dispatchers hold that the table does not list."""
    listed = {k: set(v) for k, v in kernel_signatures().items()}
    return [
        f"{name}({', '.join(map(repr, sig))})"
        for name, sig in _held_signatures()
        if sig not in listed.get(name, set())
    ]


def _missing_lines(missing: list[str], width: int = 100) -> str:
    """The warm-up's note on signatures the table does not list, in lines of at most ``width``:
    kernels by name; inner helpers (``_name``, compiled with the kernels that call them) counted.

    Examples
    --------
    >>> print(_missing_lines(["m.k(int64)", "m._h(int64)", "m._g(int64)"]))
    not in tdz_numba.cli.signatures (compiled all the same): m.k(int64); and 2 signatures of inner
    helpers compiled with their callers
    """
    import textwrap

    helpers = [m for m in missing if m.split("(", 1)[0].rsplit(".", 1)[-1].startswith("_")]
    kernels = [m for m in missing if m not in helpers]
    text = "not in tdz_numba.cli.signatures (compiled all the same): " + "; ".join(kernels)
    if helpers:
        text += f"{'; and ' if kernels else ''}{len(helpers)} signatures of inner helpers compiled with their callers"
    return "\n".join(textwrap.wrap(text, width, break_long_words=True, break_on_hyphens=False))


def cache_dirs() -> list[str]:
    """Where Numba keeps the cache files of tdz_numba's kernels (``NUMBA_CACHE_DIR`` or ``__pycache__``)."""
    dirs = []
    for disp in kernel_dispatchers().values():
        cache = getattr(disp, "_cache", None)
        path = getattr(cache, "cache_path", None)
        if path and str(path) not in dirs:
            dirs.append(str(path))
    return dirs


def _crc_layout_index(tmp: Path) -> None:
    import torch

    from .. import api, saving
    from ..zipfmt.kernels.crc import crc32_spans, crc32_zeros

    tree = {"a": torch.arange(10.0), "b": {"c": torch.ones(3, 4, dtype=torch.float64)}, "e": torch.empty(0)}
    path = saving.save(tree, tmp / "w.tdz", durable=False)
    crc32_zeros(int(np.int64(4096)))
    data = np.zeros(8, np.uint8)  # verify hashes in its own pass: refresh and other formats use this one
    crc32_spans(np.array([data.ctypes.data], np.int64), np.array([data.size], np.int64), 1 << 20)
    loaded = api.load(path)
    float(loaded["a"].sum())
    with api.open(path) as ar:  # (the central directory parsed by kernels.central.parse_central)
        ar["b/c"]
    api.verify(path)
    from ..zipfmt.central import check_local_by_pread
    from ..zipfmt.index import ArchiveIndex

    index = ArchiveIndex(path, check_local=True)  # every local header, in the mapping
    cols, ident = index.columns.copy(), index.ident
    assert ident is not None  # a local file
    check_local_by_pread(index.buffer, cols, index.end.cd_offset, path, ident)  # far-apart headers
    from ..zipfmt.kernels.dispatch import resolve_local

    resolve_local(index.buffer, cols, 0, index.end.cd_offset)  # a header read on first use (large archives)
    index.close()
    lazy = ArchiveIndex(path)  # a lazy open: one entry's local header read on first use
    for i in range(len(lazy.names)):
        lazy.payload_offset(i)
    lazy.close()


def _codecs(tmp: Path) -> None:
    import torch
    import zlib_ng.zlib_ng as zng

    from .. import api, saving
    from ..zipfmt.kernels.deflate import deflate_bound
    from ..zipfmt.stream import inflate_serial

    x = torch.arange(100_000, dtype=torch.float32)
    path = saving.save({"x": x}, tmp / "z.tdz", compression="deflate", durable=False)
    if not torch.equal(api.load(path)["x"], x):
        raise InternalError(f"{path}: warm-up: the deflate round trip read back other values")
    deflate_bound(1 << 20)
    data = np.arange(4096, dtype=np.uint8)
    comp = zng.compressobj(6, zng.DEFLATED, -15)
    raw = np.frombuffer(comp.compress(data.tobytes()) + comp.flush(), np.uint8).copy()
    out: list[np.ndarray] = []
    inflate_serial(raw, data.size, lambda piece: out.append(piece.copy()), "warmup", 1 << 20)


def _dequantize(tmp: Path) -> None:
    from ..formats.gguf import dequantize
    from ..formats.gguf_kernels import KERNELS

    for name, (_, block, size) in KERNELS.items():
        dequantize(np.zeros(size, np.uint8), name, (block,))


def _pages(tmp: Path) -> None:
    from ..files.memory import PAGE_SIZE, prefetch

    path = tmp / "pages.bin"
    path.write_bytes(bytes(2 * PAGE_SIZE))
    for access in (mmap.ACCESS_COPY, mmap.ACCESS_READ):  # an archive's mapping; a caller's read-only one
        with open(path, "rb") as f, mmap.mmap(f.fileno(), 0, access=access) as mm:
            prefetch(mm, 0, len(mm), touch=True)


_FAMILIES: dict[str, Callable[[Path], None]] = {
    "CRC, layout, index": _crc_layout_index,
    "deflate/inflate": _codecs,
    "dequantize": _dequantize,
    "memory pages": _pages,
}


def warmup(*, verbose: bool = True, file: TextIO | None = None) -> WarmupReport:
    """Compiles every kernel signature of tdz_numba into Numba's on-disk cache.

    Per family, compiles the signatures :data:`~tdz_numba.cli.signatures.SIGNATURES`
    lists, then runs the family's paths as a check: a save, load, lazy open and
    verify (CRC, layout and index kernels), a deflate save/load and a serial
    inflate (codec kernels), a dequantize of every GGML block type and a
    touching prefetch (page kernels) on a few bytes in a temporary directory.
    Kernels already in the cache are only loaded. The first-use notice is not
    printed while it runs.

    Parameters
    ----------
    verbose : bool, default True
        Print one line per family (seconds, kernels compiled) and the cache directory.
    file : file object, optional
        Where to print (default ``sys.stdout``).

    Returns
    -------
    WarmupReport
        Seconds and compiled kernels per family, and the cache directories.

    Raises
    ------
    OSError
        When the temporary directory cannot be written.

    Examples
    --------
    >>> import tdz_numba
    >>> report = tdz_numba.warmup(verbose=False)  # doctest: +SKIP
    >>> report.cache_dirs  # doctest: +SKIP
    ['/home/me/.cache/numba/...']
    """
    from ..jit import firstuse as _firstuse
    from ..jit import policy

    out = file if file is not None else sys.stdout
    report = WarmupReport()
    with (
        policy.forced("always"),  # the save/load paths below run the kernels, not their twins
        _firstuse.quiet(),
        tempfile.TemporaryDirectory(prefix="tdz-warmup-") as tmpdir,
    ):
        for family, run in _FAMILIES.items():
            before = len(_firstuse.compiled)
            t0 = time.perf_counter()
            _compile_table(family)
            run(Path(tmpdir))
            seconds = time.perf_counter() - t0
            names = _firstuse.compiled[before:]
            report.families[family] = (seconds, names)
            if verbose:
                _print_family(family, seconds, names, out)
    report.missing = _not_in_table()
    report.cache_dirs = cache_dirs()
    if verbose and report.missing:
        print(_missing_lines(report.missing), file=out)
    _mark_warm()
    if verbose:
        for d in report.cache_dirs:
            print(f"cache: {d}", file=out)
    return report


def _print_family(family: str, seconds: float, names: list[str], out: TextIO) -> None:
    """``CRC, layout, index   3.20 s  compiled 24 kernels (50 signatures): a, b, ...`` in 100 columns."""
    import textwrap

    kernels = list(dict.fromkeys(n.rsplit(".", 1)[-1] for n in names))
    if not names:
        print(f"{family:<20} {seconds:6.2f} s  loaded from the cache", file=out)
        return
    k, s = len(kernels), len(names)
    what = f"compiled {k} kernel{'s' if k != 1 else ''}"
    if s != k:
        what += f" ({s} signature{'s' if s != 1 else ''})"
    text = f"{family:<20} {seconds:6.2f} s  {what}: {', '.join(kernels)}"
    print("\n".join(textwrap.wrap(text, 100, subsequent_indent=" " * 32, break_on_hyphens=False)), file=out)


def _mark_warm() -> str | None:
    """Writes the warm marker into the cache directory of :mod:`tdz_numba.zipfmt.kernels.crc`."""
    from ..jit import policy

    index_files: list[str] = []
    where = None
    for name, disp in kernel_dispatchers().items():
        cache = getattr(disp, "_cache", None)
        index = getattr(getattr(cache, "_cache_file", None), "_index_path", None)
        if index and name.startswith("tdz_numba.zipfmt.kernels.crc.") and os.path.exists(index):
            index_files.append(str(index))
            where = where or str(getattr(cache, "cache_path", "") or "") or None
    if where is None:
        return None
    return policy.write_marker(where, index_files)


def background_main() -> int:
    """``python -m tdz_numba.cli.warmup --background``: a quiet :func:`warmup` at low priority.

    Started by the first save or load that finds the cache cold
    (:func:`tdz_numba.zipfmt.kernels.dispatch.start_background_warmup`). One runs at a time
    (a lock file in the cache directory, removed at the end); nothing is printed;
    an unwritable cache directory ends it quietly. Returns the exit status (0).
    """
    from ..jit import policy

    try:
        import fcntl
    except ImportError:  # pragma: no cover - not POSIX: no background warm-up
        return 0

    with contextlib.suppress(OSError):
        os.nice(10)
    # where Numba caches (the user-wide one for a read-only package)
    cache = policy.warmup_cache_dir()
    if cache is None:
        return 0
    lock_path = os.path.join(cache, policy.LOCK_NAME)
    try:
        os.makedirs(cache, exist_ok=True)
        fd = os.open(lock_path, os.O_CREAT | os.O_WRONLY, 0o644)
    except OSError:
        return 0
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            return 0  # another warm-up holds the lock
        if not policy.kernels_warm():
            with contextlib.suppress(Exception):
                warmup(verbose=False)
        with contextlib.suppress(OSError):
            os.unlink(lock_path)
        return 0
    finally:
        os.close(fd)


if __name__ == "__main__":  # pragma: no cover - run as a subprocess
    if sys.argv[1:] == ["--background"]:
        sys.exit(background_main())
    warmup()
