"""Numba decorator presets and the zlib-ng symbols the kernels call.

Kernels are compiled on first call (never at import) and cached on disk
(``cache=True``). zlib-ng's C functions are reached by *name*: the address of
each symbol is registered with LLVM when a kernel module first asks for one
of the names below (importing this module alone does not import Numba), and kernels
declare them as :class:`numba.types.ExternalFunction`. A name, unlike a ctypes
function pointer, survives in Numba's on-disk cache, so a second process loads
the compiled kernels instead of compiling them again.
"""

from __future__ import annotations

import numbers
import threading
from typing import Any

__all__ = [
    "KERNEL",
    "PARALLEL",
    "BORROWED",
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
    "dynamic_schedule",
]

#: Serial kernels: no Python objects, GIL released, cached on disk.
KERNEL: dict[str, Any] = {"nogil": True, "cache": True}
#: Kernels whose loops are ``prange``: only where it pays.
PARALLEL: dict[str, Any] = {**KERNEL, "parallel": True}
#: Serial kernels and helpers that only read and write the arrays they are given and make none:
#: compiled without reference counting (each call would otherwise count every array argument up
#: and down, atomically: ~35% of the pickle scan's time at 20,000 tensors, 8.9 -> 5.8 ms).
BORROWED: dict[str, Any] = {**KERNEL, "_nrt": False}

# The Numba-typed names below are made on first access (PEP 562 ``__getattr__``),
# when a kernel module imports them: importing this module (``check_num_threads``,
# ``run_parallel``, the presets) does not import Numba, so a save or load that
# takes the kernel-free path (:mod:`tdz_numba.zipfmt.kernels.dispatch`) never loads it.
HAVE_ZNG_CRC: bool  # declared here, made by __getattr__ (an annotation binds no value)
#: Whether zlib-ng's native deflate/inflate API is reachable from kernels.
HAVE_ZNG_CODEC: bool
zng_crc32_z: Any
zng_deflateInit2: Any
zng_deflate: Any
zng_deflateEnd: Any
zng_inflateInit2: Any
zng_inflate: Any
zng_inflateEnd: Any
u8_pointer: Any
_NUMBA_NAMES = frozenset(__all__) - {
    "KERNEL",
    "PARALLEL",
    "run_parallel",
    "check_num_threads",
    "dynamic_schedule",
}
_INIT_LOCK = threading.Lock()


def _register(lib: Any, name: str) -> bool:
    import ctypes

    import llvmlite.binding as llvm  # type: ignore[import-untyped]

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


def _numba_names() -> dict[str, Any]:
    """Registers zlib-ng's symbols with LLVM and builds the Numba-typed names (once)."""
    import ctypes

    from numba import types
    from numba.core import cgutils
    from numba.extending import intrinsic

    from . import firstuse as _firstuse  # noqa: F401  (the first-compile notice)

    out: dict[str, Any] = {}
    try:
        from zlib_ng import zlib_ng as _zlib_ng_ext

        lib = ctypes.CDLL(_zlib_ng_ext.__file__)
        out["HAVE_ZNG_CRC"] = _register(lib, "zng_crc32_z")
        out["HAVE_ZNG_CODEC"] = all([_register(lib, name) for name in _CODEC_SYMBOLS])
    except (ImportError, OSError):  # pragma: no cover - zlib-ng is a dependency
        out["HAVE_ZNG_CRC"] = out["HAVE_ZNG_CODEC"] = False

    i32 = types.int32
    stream = types.voidptr  # zng_stream *: 104 bytes, see codec_kernels
    ext = types.ExternalFunction
    # int32_t zng_deflateInit2(zng_stream *, level, method, windowBits, memLevel, strategy)
    out["zng_deflateInit2"] = ext("zng_deflateInit2", i32(stream, i32, i32, i32, i32, i32))
    out["zng_deflate"] = ext("zng_deflate", i32(stream, i32))  # (zng_stream *, int32_t flush)
    out["zng_deflateEnd"] = ext("zng_deflateEnd", i32(stream))
    out["zng_inflateInit2"] = ext("zng_inflateInit2", i32(stream, i32))  # (zng_stream *, windowBits)
    out["zng_inflate"] = ext("zng_inflate", i32(stream, i32))
    out["zng_inflateEnd"] = ext("zng_inflateEnd", i32(stream))
    # uint32_t zng_crc32_z(uint32_t crc, const uint8_t *buf, size_t len)
    out["zng_crc32_z"] = ext("zng_crc32_z", types.uint32(types.uint32, types.voidptr, types.uintp))

    @intrinsic
    def u8_pointer(typingctx, address):
        """``CPointer(uint8)`` from an integer address, for ``numba.carray``."""
        if not isinstance(address, types.Integer):
            return None
        sig = types.CPointer(types.uint8)(address)

        def codegen(context, builder, signature, args):
            return builder.inttoptr(args[0], cgutils.voidptr_t)

        return sig, codegen

    out["u8_pointer"] = u8_pointer
    return out


def __getattr__(name: str) -> Any:
    if name not in _NUMBA_NAMES:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    with _INIT_LOCK:
        if name not in globals():
            globals().update(_numba_names())
    return globals()[name]


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
        from ..errors import InvalidArgumentError

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


def dynamic_schedule(chunk: int = 1):
    """Hands ``prange`` iterations to threads ``chunk`` at a time (Numba's
    default splits the range into one static block per thread): segments take
    unequal times, and on a busy machine one late thread would hold up the other."""
    import contextlib

    import numba

    chunks = getattr(numba, "parallel_chunksize", None)
    return chunks(chunk) if chunks is not None else contextlib.nullcontext()
