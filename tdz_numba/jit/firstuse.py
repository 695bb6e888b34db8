"""A short notice the first time a kernel is compiled instead of loaded from the cache.

Numba triggers its ``numba:compile`` event only when a signature is really
compiled (a load from the on-disk cache does not trigger it), so a listener on
that event sees exactly the first-use compilations. The notice is printed once
per process, for tdz_numba's own kernels only, and not while
:func:`tdz_numba.warmup` runs (it reports what it compiles itself).

Examples
--------
>>> from tdz_numba.jit import firstuse as _firstuse
>>> _firstuse.NOTICE.startswith("tdz_numba: compiling Numba kernels"), "tdz warmup" in _firstuse.NOTICE
(True, True)
"""

from __future__ import annotations

import sys
import threading
from typing import Any

from numba.core import event

__all__ = ["NOTICE", "compiled", "quiet"]

#: Two lines of at most 100 columns.
NOTICE = (
    "tdz_numba: compiling Numba kernels for first use (seconds, once per environment);\n"
    "  `tdz warmup` (or `python -m tdz_numba warmup`) compiles them all ahead of time"
)

_LOCK = threading.Lock()
_state: dict[str, Any] = {"shown": False, "quiet": 0}
#: Names (module.function) of the tdz_numba kernels compiled in this process, in order.
compiled: list[str] = []


def _kernel_name(data: Any) -> str | None:
    dispatcher = data.get("dispatcher") if isinstance(data, dict) else None
    func = getattr(dispatcher, "py_func", None)
    module = getattr(func, "__module__", "") or ""
    if func is None or not module.startswith("tdz_numba."):
        return None
    return f"{module}.{func.__qualname__}"


class _Listener(event.Listener):
    def on_start(self, ev: event.Event) -> None:
        name = _kernel_name(ev.data)
        if name is None:
            return
        with _LOCK:
            compiled.append(name)
            if _state["shown"] or _state["quiet"]:
                return
            _state["shown"] = True
        try:
            print(NOTICE, file=sys.stderr, flush=True)
        except (OSError, ValueError):  # pragma: no cover - stderr closed
            pass

    def on_end(self, ev: event.Event) -> None:
        pass


class quiet:
    """Context manager: no notice while it is active (used by :func:`tdz_numba.warmup`)."""

    def __enter__(self) -> quiet:
        with _LOCK:
            _state["quiet"] += 1
        return self

    def __exit__(self, *exc: object) -> None:
        with _LOCK:
            _state["quiet"] -= 1


event.register("numba:compile", _Listener())
