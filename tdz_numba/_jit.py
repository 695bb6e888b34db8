"""Numba decorator presets and the zlib-ng symbols the kernels call.

Kernels are compiled on first call (never at import) and cached on disk
(``cache=True``). zlib-ng's C functions are reached by *name*: the address of
each symbol is registered with LLVM when this module is imported, and kernels
declare them as :class:`numba.types.ExternalFunction`. A name, unlike a ctypes
function pointer, survives in Numba's on-disk cache, so a second process loads
the compiled kernels instead of compiling them again.
"""

from __future__ import annotations

import ctypes
import numbers
import threading
from typing import Any

import llvmlite.binding as llvm  # type: ignore[import-untyped]
from numba import types
from numba.core import cgutils
from numba.extending import intrinsic

from . import _firstuse  # noqa: F401  (the first-compile notice)

__all__ = [
    "KERNEL",
    "PARALLEL",
    "HAVE_ZNG_CRC",
    "HAVE_ZNG_CODEC",
    "zng_crc32_z",
    "zng_deflateInit2",
    "zng_deflate",
    "zng_deflateEnd",
    "zng_inflateInit2",
    "zng_inflate",
    "zng_inflateEnd",
    "u8_pointer",
    "run_parallel",
    "check_num_threads",
]

#: Serial kernels: no Python objects, GIL released, cached on disk.
KERNEL: dict[str, Any] = {"nogil": True, "cache": True}
#: Kernels whose loops are ``prange``: only where it pays.
PARALLEL: dict[str, Any] = {**KERNEL, "parallel": True}


def _register(lib: ctypes.CDLL, name: str) -> bool:
    try:
        fn = getattr(lib, name)
    except AttributeError:
        return False
    llvm.add_symbol(name, ctypes.cast(fn, ctypes.c_void_p).value)
    return True


_CODEC_SYMBOLS = (
    "zng_deflateInit2",
    "zng_deflate",
    "zng_deflateEnd",
    "zng_inflateInit2",
    "zng_inflate",
    "zng_inflateEnd",
)
try:
    from zlib_ng import zlib_ng as _zlib_ng_ext

    _ZNG = ctypes.CDLL(_zlib_ng_ext.__file__)
    HAVE_ZNG_CRC = _register(_ZNG, "zng_crc32_z")
    #: Whether zlib-ng's native deflate/inflate API is reachable from kernels.
    HAVE_ZNG_CODEC = all([_register(_ZNG, name) for name in _CODEC_SYMBOLS])
except (ImportError, OSError):  # pragma: no cover - zlib-ng is a dependency
    HAVE_ZNG_CRC = HAVE_ZNG_CODEC = False

_I32 = types.int32
_STREAM = types.voidptr  # zng_stream *: 104 bytes, see codec_kernels
#: ``int32_t zng_deflateInit2(zng_stream *, level, method, windowBits, memLevel, strategy)``
zng_deflateInit2 = types.ExternalFunction("zng_deflateInit2", _I32(_STREAM, _I32, _I32, _I32, _I32, _I32))
#: ``int32_t zng_deflate(zng_stream *, int32_t flush)``
zng_deflate = types.ExternalFunction("zng_deflate", _I32(_STREAM, _I32))
zng_deflateEnd = types.ExternalFunction("zng_deflateEnd", _I32(_STREAM))
#: ``int32_t zng_inflateInit2(zng_stream *, int32_t windowBits)``
zng_inflateInit2 = types.ExternalFunction("zng_inflateInit2", _I32(_STREAM, _I32))
zng_inflate = types.ExternalFunction("zng_inflate", _I32(_STREAM, _I32))
zng_inflateEnd = types.ExternalFunction("zng_inflateEnd", _I32(_STREAM))

#: ``uint32_t zng_crc32_z(uint32_t crc, const uint8_t *buf, size_t len)``
zng_crc32_z = types.ExternalFunction("zng_crc32_z", types.uint32(types.uint32, types.voidptr, types.uintp))


@intrinsic
def u8_pointer(typingctx, address):
    """``CPointer(uint8)`` from an integer address, for ``numba.carray``."""
    if not isinstance(address, types.Integer):
        return None
    sig = types.CPointer(types.uint8)(address)

    def codegen(context, builder, signature, args):
        return builder.inttoptr(args[0], cgutils.voidptr_t)

    return sig, codegen


_PARALLEL_LOCK = threading.Lock()


def check_num_threads(num_threads: object) -> int | None:
    """The one check of every ``num_threads`` argument: None (all cores) or an int >= 1.

    Raises
    ------
    InvalidArgumentError
        For 0, negative numbers, floats, bools and anything else.

    Examples
    --------
    >>> check_num_threads(2), check_num_threads(None)
    (2, None)
    """
    if num_threads is None:
        return None
    if isinstance(num_threads, bool) or not isinstance(num_threads, numbers.Integral) or num_threads < 1:
        from .errors import InvalidArgumentError

        raise InvalidArgumentError(
            f"num_threads must be an int >= 1 or None, got {num_threads!r}",
            expected="an int >= 1 or None",
            found=num_threads,
        )
    return int(num_threads)


def run_parallel(kernel, *args, num_threads: int | None = None):
    """Calls a ``parallel=True`` kernel on ``num_threads`` threads (None: all cores).

    Numba's default threading layers do not support concurrent parallel
    launches from several Python threads; saves and verifies may run in
    threads, so launches are serialized here.
    """
    import numba

    with _PARALLEL_LOCK:
        num_threads = check_num_threads(num_threads)
        if num_threads is None:
            return kernel(*args)
        previous = numba.get_num_threads()
        numba.set_num_threads(min(num_threads, numba.config.NUMBA_NUM_THREADS))  # type: ignore[attr-defined]
        try:
            return kernel(*args)
        finally:
            numba.set_num_threads(previous)
