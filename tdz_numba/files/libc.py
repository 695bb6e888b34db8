"""The C library's functions that Python's ``os`` and ``mmap`` lack (``mincore``, ``madvise`` on an
address, ``sync_file_range``, ``fallocate``, ``renameat2``, ``syscall`` for ``cachestat``), looked
up once per process in the symbols the process already has loaded (``CDLL(None)``: no
``ldconfig`` subprocess, unlike ``ctypes.util.find_library``).

Examples
--------
>>> from tdz_numba.files import libc
>>> libc.function("mincore") is not None
True
>>> libc.function("no_such_function_here") is None
True
"""

from __future__ import annotations

import ctypes
import threading
from typing import Any

__all__ = ["function", "madvise"]

_LOCK = threading.Lock()
_LIB: list[Any] = []
_FUNCS: dict[str, Any] = {}
_SIGNATURES: dict[str, tuple[tuple[Any, ...], Any]] = {
    "mincore": ((ctypes.c_void_p, ctypes.c_size_t, ctypes.POINTER(ctypes.c_ubyte)), ctypes.c_int),
    "madvise": ((ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int), ctypes.c_int),
    "sync_file_range": ((ctypes.c_int, ctypes.c_int64, ctypes.c_int64, ctypes.c_uint), ctypes.c_int),
    "fallocate64": ((ctypes.c_int, ctypes.c_int, ctypes.c_int64, ctypes.c_int64), ctypes.c_int),
    "fallocate": ((ctypes.c_int, ctypes.c_int, ctypes.c_int64, ctypes.c_int64), ctypes.c_int),
    # (variadic in C; Linux passes its arguments in registers, so one fixed prototype serves cachestat)
    "syscall": (
        (ctypes.c_long, ctypes.c_int, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_uint),
        ctypes.c_long,
    ),
    "renameat2": (
        (ctypes.c_int, ctypes.c_char_p, ctypes.c_int, ctypes.c_char_p, ctypes.c_uint),
        ctypes.c_int,
    ),
}


def function(name: str) -> Any:
    """The C function ``name`` with its argument and result types set (those listed here), or None
    where this platform's C library lacks it."""
    fn = _FUNCS.get(name, False)
    if fn is not False:
        return fn
    with _LOCK:
        if not _LIB:
            try:
                _LIB.append(ctypes.CDLL(None, use_errno=True))
            except OSError:  # pragma: no cover - no dynamic symbol table
                _LIB.append(None)
        lib = _LIB[0]
        fn = getattr(lib, name, None) if lib is not None else None
        if fn is not None and name in _SIGNATURES:
            fn.argtypes, fn.restype = _SIGNATURES[name]
        _FUNCS[name] = fn
    return fn


def madvise(address: int, length: int, advice: int) -> bool:
    """``madvise(address, length, advice)`` on page-aligned memory; whether it succeeded."""
    fn = function("madvise")
    return fn is not None and fn(ctypes.c_void_p(address), ctypes.c_size_t(length), int(advice)) == 0
