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
import threading

import llvmlite.binding as llvm
from numba import types
from numba.core import cgutils
from numba.extending import intrinsic

__all__ = ["KERNEL", "PARALLEL", "HAVE_ZNG_CRC", "zng_crc32_z", "u8_pointer", "memcpy", "run_parallel"]

#: Serial kernels: no Python objects, GIL released, cached on disk.
KERNEL = {"nogil": True, "cache": True}
#: Kernels whose loops are ``prange``: only where it pays.
PARALLEL = {**KERNEL, "parallel": True}


def _register(lib: ctypes.CDLL, name: str) -> bool:
    try:
        fn = getattr(lib, name)
    except AttributeError:
        return False
    llvm.add_symbol(name, ctypes.cast(fn, ctypes.c_void_p).value)
    return True


try:
    from zlib_ng import zlib_ng as _zlib_ng_ext

    _ZNG = ctypes.CDLL(_zlib_ng_ext.__file__)
    HAVE_ZNG_CRC = _register(_ZNG, "zng_crc32_z")
except (ImportError, OSError):  # pragma: no cover - zlib-ng is a dependency
    HAVE_ZNG_CRC = False

#: ``uint32_t zng_crc32_z(uint32_t crc, const uint8_t *buf, size_t len)``
zng_crc32_z = types.ExternalFunction(
    "zng_crc32_z", types.uint32(types.uint32, types.voidptr, types.uintp)
)


@intrinsic
def u8_pointer(typingctx, address):
    """``CPointer(uint8)`` from an integer address, for ``numba.carray``."""
    if not isinstance(address, types.Integer):
        return None
    sig = types.CPointer(types.uint8)(address)

    def codegen(context, builder, signature, args):
        return builder.inttoptr(args[0], cgutils.voidptr_t)

    return sig, codegen


@intrinsic
def memcpy(typingctx, dst, src, count):
    """``memcpy(dst, src, count)`` between integer addresses (LLVM intrinsic)."""
    if not all(isinstance(t, types.Integer) for t in (dst, src, count)):
        return None
    sig = types.void(dst, src, count)

    def codegen(context, builder, signature, args):
        d, s, n = args
        cgutils.raw_memcpy(
            builder,
            builder.inttoptr(d, cgutils.voidptr_t),
            builder.inttoptr(s, cgutils.voidptr_t),
            n,
            1,
        )
        return context.get_dummy_value()

    return sig, codegen


_PARALLEL_LOCK = threading.Lock()


def run_parallel(kernel, *args):
    """Calls a ``parallel=True`` kernel, one at a time per process.

    Numba's default threading layers do not support concurrent parallel
    launches from several Python threads; saves and verifies may run in
    threads, so launches are serialized here (each launch uses all cores).
    """
    with _PARALLEL_LOCK:
        return kernel(*args)
