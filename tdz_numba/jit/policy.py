"""Kernel or twin: which path runs the CRC, layout and index work of a save or a load.

Numba compiles a kernel on its first call (seconds of LLVM) and then keeps it in
its on-disk cache. A fresh environment would pay that on its first save and
load, so the call sites ask :mod:`tdz_numba.zipfmt.kernels.dispatch` instead of calling
the kernels directly; it asks :func:`use_kernels` here and runs either the kernel
or its pure-Python twin in :mod:`tdz_numba.zipfmt.kernels.twins`, which return the same
values (byte-identical archives, the same index, the same errors):

* the kernels, when :func:`kernels_warm` (``tdz warmup`` or a finished
  background warm-up wrote its marker next to Numba's cache) and either Numba
  is already imported or the process has given the twins :data:`WARM_ENTRIES`
  entries in all (importing Numba alone costs ~0.4 s, more than the twins take
  below that); with a cold cache from :data:`COLD_ENTRIES` entries, where
  compiling (~3-5 s) pays;
* the twins otherwise, without importing Numba. ``tdz warmup`` fills the cache
  ahead of time; with ``TDZ_NUMBA_BACKGROUND_WARMUP=1`` the first cold fallback of
  a process also starts a background warm-up (``python -m tdz_numba.cli.warmup
  --background``: quiet, ``nice``, one at a time, outliving the script that
  started it), so later processes find the cache warm.

Environment
-----------
``TDZ_NUMBA_KERNELS``
    ``auto`` (default), ``always`` (kernels, compiling them if needed) or
    ``never`` (the twins only). The test suite sets ``always`` (tests/conftest.py)
    and runs both paths end to end in ``tests/test_firstuse.py``.
``TDZ_NUMBA_BACKGROUND_WARMUP``
    ``1`` switches the background warm-up on (default off: no process outlives
    the user's script unless asked). It stays off in mode ``never`` and when the
    cache directory is not writable.

Examples
--------
>>> from tdz_numba.jit import policy
>>> policy.mode() in ("auto", "always", "never")
True
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from typing import Any

__all__ = [
    "LOCK_NAME",
    "CRC_CHUNK",
    "WARM_ENTRIES",
    "COLD_ENTRIES",
    "mode",
    "forced",
    "use_kernels",
    "kernels_warm",
    "cache_key",
    "kernel_cache_dirs",
    "warmup_cache_dir",
    "write_marker",
    "background_enabled",
    "default_threads",
    "start_background_warmup",
]

#: Bytes hashed per parallel work item (the kernels' chunk; see :mod:`tdz_numba.zipfmt.kernels.crc`).
CRC_CHUNK = 1 << 20
#: With a warm cache but Numba not imported yet, the kernels run once a process has given
#: the twins this many entries in all (~0.1-0.25 s of twin work, less than importing Numba).
WARM_ENTRIES = 20_000
#: With a cold cache, the kernels are compiled once the twins have had this many entries.
COLD_ENTRIES = 500_000

_MODES = ("auto", "always", "never")
_MARKER_PREFIX = "tdz_numba-warm-"
LOCK_NAME = "tdz_numba-warmup.lock"
#: Files whose content the compiled kernels depend on (part of the marker's key).
_SOURCES = tuple(
    os.path.join(*name.split("/"))
    for name in (
        "zipfmt/kernels/crc.py",
        "zipfmt/kernels/central.py",
        "jit/presets.py",
        "zipfmt/records.py",
        "zipfmt/kernels/deflate.py",
        "files/page_kernels.py",
        "zipfmt/kernels/verify.py",
        "formats/gguf_kernels.py",
    )
)
#: The package directory (``tdz_numba/``): the kernel sources are named relative to it.
_HERE = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
_state: dict[str, Any] = {
    "forced": None,
    "warm": False,
    "checked": -1e9,
    "spawned": False,
    "key": None,
    "twin": 0,
}
#: ``os.environ``'s own dict (on POSIX: bytes -> bytes) and its key of ``TDZ_NUMBA_KERNELS``:
#: :func:`mode` runs on every kernel-or-twin choice, and ``os.environ.get`` of an unset variable
#: costs 4 Python-level calls and a caught ``KeyError`` (~1 us hot, several times that with cold
#: caches). ``os.environ[...] = ...`` and ``del os.environ[...]`` update that dict; anything else
#: (``os.putenv``) is invisible to ``os.environ`` as well.
_ENV_DATA: dict[Any, Any] | None = getattr(os.environ, "_data", None)
_ENV_KEY: Any = None
try:
    _ENV_KEY = os.environ.encodekey("TDZ_NUMBA_KERNELS")  # type: ignore[attr-defined]
except (AttributeError, TypeError):  # pragma: no cover - another os.environ: the plain lookup
    _ENV_DATA = None
if type(_ENV_DATA) is not dict:  # pragma: no cover - another os.environ: the plain lookup
    _ENV_DATA = None
#: The exact values of ``TDZ_NUMBA_KERNELS`` taken as they are (others are stripped and lowered).
_ENV_MODES: dict[Any, str] = {
    **{m: m for m in _MODES},
    **{m.encode(): m for m in _MODES},
}
_LOCK = threading.Lock()
_FORCED: list[tuple[object, str]] = []  # the open forced() blocks, innermost last


def mode() -> str:
    """``auto``, ``always`` or ``never``: :func:`forced`, else ``TDZ_NUMBA_KERNELS`` (default ``auto``).

    Raises
    ------
    InvalidArgumentError
        For another value of ``TDZ_NUMBA_KERNELS``.

    Examples
    --------
    >>> with forced("never"):
    ...     mode()
    'never'
    """
    forced_mode = _state["forced"]
    if forced_mode is not None:
        return str(forced_mode)
    raw = _ENV_DATA.get(_ENV_KEY) if _ENV_DATA is not None else os.environ.get("TDZ_NUMBA_KERNELS")
    if raw is None:  # (unset: no call to os.environ.get, which raises and catches a KeyError)
        return "auto"
    value = _ENV_MODES.get(raw)
    if value is not None:
        return value
    if isinstance(raw, bytes):
        raw = os.fsdecode(raw)
    value = raw.strip().lower() or "auto"
    if value not in _MODES:
        from ..errors import InvalidArgumentError

        raise InvalidArgumentError(
            f"TDZ_NUMBA_KERNELS={value!r}: expected one of {', '.join(_MODES)}",
            expected=list(_MODES),
            found=value,
        )
    return value


@contextlib.contextmanager
def forced(value: str) -> Iterator[None]:
    """Context manager: :func:`mode` returns ``value`` inside the block (process-wide; used by warmup).

    Examples
    --------
    >>> with forced("always"):
    ...     use_kernels()
    True
    """
    if value not in _MODES:
        raise ValueError(f"mode must be one of {_MODES}, got {value!r}")
    token = object()  # blocks of several threads may end in any order: each removes its own
    with _LOCK:
        _FORCED.append((token, value))
        _state["forced"] = value
    try:
        yield
    finally:
        with _LOCK:
            _FORCED[:] = [f for f in _FORCED if f[0] is not token]
            _state["forced"] = _FORCED[-1][1] if _FORCED else None


def cache_key() -> str:
    """Hex key of everything the compiled kernels depend on: their sources, Python, the installed Numba.

    Examples
    --------
    >>> len(cache_key())
    16
    """
    if _state["key"] is None:
        import importlib.util

        h = hashlib.sha1()
        h.update(sys.version.encode())
        spec = importlib.util.find_spec("numba")  # its location and stamp, without importing it
        origin = getattr(spec, "origin", None) or ""
        if origin:  # one key however the interpreter reached it (a symlinked venv, a relative path)
            origin = os.path.realpath(origin)
        with contextlib.suppress(OSError):
            st = os.stat(origin)
            h.update(f"{origin}:{st.st_mtime_ns}:{st.st_size}".encode())
        for name in _SOURCES:
            with contextlib.suppress(OSError), open(os.path.join(_HERE, name), "rb") as f:
                h.update(name.encode() + f.read())
        _state["key"] = h.hexdigest()[:16]
    return str(_state["key"])


def _cache_subpath(py_file: str) -> str:
    """Numba's ``_CacheLocator.get_suitable_cache_subpath``."""
    subpath = os.path.dirname(os.path.abspath(py_file))
    return "_".join([os.path.split(subpath)[-1], hashlib.sha1(subpath.encode()).hexdigest()])


def kernel_cache_dirs() -> list[str]:
    """Where Numba would keep the cache of :mod:`tdz_numba.zipfmt.kernels.crc`, most likely first (Numba's
    locators: ``NUMBA_CACHE_DIR``, else the package's ``__pycache__``, else the user-wide cache)."""
    kernels_py = os.path.join(_HERE, "zipfmt", "kernels", "crc.py")
    if os.environ.get("NUMBA_CACHE_DIR"):
        return [os.path.join(os.environ["NUMBA_CACHE_DIR"], _cache_subpath(kernels_py))]
    dirs = [os.path.join(os.path.dirname(kernels_py), "__pycache__")]
    if sys.platform.startswith("linux"):
        base = os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache")
        dirs.append(os.path.join(base, "numba", _cache_subpath(kernels_py)))
    elif sys.platform == "darwin":
        dirs.append(os.path.join(os.path.expanduser("~/Library/Caches/numba"), _cache_subpath(kernels_py)))
    return dirs


def _marker_ok(path: str) -> bool:
    try:
        with open(path, encoding="utf-8") as f:
            marker = json.load(f)
        return all(os.path.exists(p) for p in marker.get("index_files", []))
    except (OSError, ValueError, AttributeError, TypeError):
        return False


def kernels_warm() -> bool:
    """Whether a finished warm-up's marker for this :func:`cache_key` lies next to Numba's cache
    (and the cache index files it lists still exist). Does not import Numba."""
    if _state["warm"]:
        return True
    now = time.monotonic()
    if now - _state["checked"] < 2.0:  # a cold answer is looked up again at most every 2 s
        return False
    name = _MARKER_PREFIX + cache_key() + ".json"
    _state["warm"] = any(_marker_ok(os.path.join(d, name)) for d in kernel_cache_dirs())
    _state["checked"] = now
    return bool(_state["warm"])


def write_marker(cache_dir: str, index_files: list[str]) -> str | None:
    """Records that every kernel is in Numba's cache at ``cache_dir`` (called by :func:`tdz_numba.warmup`).

    Markers of other keys are removed. Returns the marker's path, or None when
    ``cache_dir`` is not writable.
    """
    path = os.path.join(cache_dir, _MARKER_PREFIX + cache_key() + ".json")
    tmp = f"{path}.{os.getpid()}.tmp"
    try:
        with open(tmp, "w", encoding="utf-8") as f:
            json.dump({"key": cache_key(), "index_files": sorted(index_files)}, f)
        os.replace(tmp, path)
        for old in os.listdir(cache_dir):
            if old.startswith(_MARKER_PREFIX) and os.path.join(cache_dir, old) != path:
                with contextlib.suppress(OSError):
                    os.unlink(os.path.join(cache_dir, old))
    except OSError:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        return None
    _state["warm"] = True
    return path


def background_enabled() -> bool:
    """Whether a cold fallback may start the background warm-up: only when the user opts in
    with ``TDZ_NUMBA_BACKGROUND_WARMUP=1`` (off by default: no process outlives the user's
    script unasked), and not in mode ``never``.

    Examples
    --------
    >>> import os
    >>> background_enabled() == (os.environ.get("TDZ_NUMBA_BACKGROUND_WARMUP", "") in ("1", "true", "yes", "on"))
    True
    """
    setting = os.environ.get("TDZ_NUMBA_BACKGROUND_WARMUP", "").strip().lower()
    if setting not in ("1", "true", "yes", "on"):
        return False
    return mode() != "never"


def _writable_dir(path: str) -> bool:
    """``path`` exists and is writable, or could be created."""
    path = os.path.abspath(path)
    while not os.path.lexists(path):
        parent = os.path.dirname(path)
        if parent == path:
            return False
        path = parent
    return os.path.isdir(path) and os.access(path, os.W_OK | os.X_OK)


def warmup_cache_dir() -> str | None:
    """The first writable directory of :func:`kernel_cache_dirs` (where Numba's locators put the
    cache: a read-only package directory falls back to the user-wide one), or None."""
    return next((d for d in kernel_cache_dirs() if _writable_dir(d)), None)


def start_background_warmup() -> bool:
    """Starts ``python -m tdz_numba.cli.warmup --background`` once per process, detached
    (when :func:`background_enabled`, :func:`warmup_cache_dir` finds a writable cache and no warm-up holds
    its lock). Returns whether one was started."""
    with _LOCK:
        if _state["spawned"]:
            return False
        _state["spawned"] = True
    if not background_enabled() or not sys.executable or getattr(sys, "frozen", False):
        return False
    cache = warmup_cache_dir()
    if cache is None:
        return False
    with contextlib.suppress(OSError):  # a warm-up runs (a killed one's lock goes stale after 10 min)
        if time.time() - os.stat(os.path.join(cache, LOCK_NAME)).st_mtime < 600:
            return False
    env = dict(os.environ)
    root = os.path.dirname(_HERE)  # this tdz_numba, whatever the child's sys.path
    env["PYTHONPATH"] = os.pathsep.join([root, *filter(None, [env.get("PYTHONPATH")])])
    try:
        proc = subprocess.Popen(
            [sys.executable, "-m", "tdz_numba.cli.warmup", "--background"],
            stdin=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
            env=env,
            close_fds=True,
            start_new_session=True,
        )
    except OSError:
        return False
    threading.Thread(target=proc.wait, name="tdz-warmup-reaper", daemon=True).start()
    return True


def default_threads() -> int:
    """Numba's thread count (``NUMBA_NUM_THREADS``, default: the usable cores), without importing Numba.

    Examples
    --------
    >>> default_threads() >= 1
    True
    """
    numba = sys.modules.get("numba")
    if numba is not None:
        return int(numba.config.NUMBA_NUM_THREADS)
    with contextlib.suppress(ValueError):
        if os.environ.get("NUMBA_NUM_THREADS"):
            return max(1, int(os.environ["NUMBA_NUM_THREADS"]))
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except AttributeError:  # pragma: no cover - not Linux
        return max(1, os.cpu_count() or 1)


def use_kernels(entries: int = 0) -> bool:
    """Whether work on ``entries`` entries runs the Numba kernels (see the module docstring).

    Examples
    --------
    >>> with forced("never"):
    ...     use_kernels(10**9)
    False
    """
    m = _state["forced"]  # mode(), without the call when nothing is forced or set
    if m is None:
        unset = _ENV_DATA is not None and _ENV_KEY not in _ENV_DATA
        m = "auto" if unset else mode()
    if m != "auto":
        return m == "always"
    if "numba" in sys.modules and _state["warm"]:
        return True
    # the twins cost ~1-12 us per entry: once this process has spent about what importing
    # Numba (warm) or compiling (cold) costs, the kernels pay
    done = _state["twin"] + entries
    if _state["warm"] or kernels_warm():  # (the flag first: no call once a marker was found)
        if "numba" in sys.modules or done >= WARM_ENTRIES:
            return True
    elif done >= COLD_ENTRIES:
        return True
    else:
        start_background_warmup()
    _state["twin"] = done
    return False
