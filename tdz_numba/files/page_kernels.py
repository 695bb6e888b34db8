"""Numba kernels over pages of a mapping: a parallel touch that faults pages in, and the
copy of byte spans into owned memory with streaming (non-temporal) stores.

Examples
--------
>>> import numpy as np
>>> from tdz_numba.files.page_kernels import copy_spans, touch_pages
>>> int(touch_pages(np.ones(10_000, np.uint8), 4096))
3
>>> src, dst = np.arange(200, dtype=np.uint8), np.zeros(100, np.uint8)
>>> col = lambda *v: np.array(v, np.int64)
>>> int(copy_spans(src, col(10, 150), col(dst.ctypes.data, dst.ctypes.data + 60), col(60, 40), True))
100
>>> dst[:3].tolist(), dst[60:63].tolist()
([10, 11, 12], [150, 151, 152])
"""

from __future__ import annotations

import numpy as np
from llvmlite import ir
from numba import njit, prange, types
from numba.core import cgutils
from numba.extending import intrinsic

from ..jit.presets import KERNEL, PARALLEL

__all__ = ["touch_pages", "copy_spans", "STREAM_BLOCK"]

#: Bytes one streaming store writes (the destination is aligned to it first).
STREAM_BLOCK = 64


@njit(**PARALLEL)
def touch_pages(buf, page):
    """Reads one byte of every ``page``-sized block of ``buf`` (in parallel), so that a
    mapped range is resident when it returns; returns the sum of the bytes read (so
    the reads cannot be optimized away)."""
    n = buf.size
    count = (n + page - 1) // page
    acc = np.zeros(count, np.int64)
    for i in prange(count):
        acc[i] = buf[i * page]
    return acc.sum()


@intrinsic
def _stream64(typingctx, dst, src):
    """Copies 64 bytes from address ``src`` (any alignment) to address ``dst`` (64-byte aligned)
    with a non-temporal store (``!nontemporal``: ``movntdq`` on x86-64, ``stnp`` on arm64)."""
    if not isinstance(dst, types.Integer) or not isinstance(src, types.Integer):
        return None
    sig = types.void(dst, src)

    def codegen(context, builder, signature, args):
        vec = ir.VectorType(ir.IntType(64), 8)
        value = builder.load(builder.inttoptr(args[1], vec.as_pointer()), align=1)
        store = builder.store(value, builder.inttoptr(args[0], vec.as_pointer()), align=64)
        store.set_metadata("nontemporal", builder.module.add_metadata([ir.Constant(ir.IntType(32), 1)]))
        return context.get_dummy_value()

    return sig, codegen


@intrinsic
def _memcpy(typingctx, dst, src, nbytes):
    """``memcpy(dst, src, nbytes)`` between two addresses (``llvm.memcpy``: the C library's)."""
    if not all(isinstance(a, types.Integer) for a in (dst, src, nbytes)):
        return None
    sig = types.void(dst, src, nbytes)

    def codegen(context, builder, signature, args):
        ptr = ir.IntType(8).as_pointer()
        d, s = builder.inttoptr(args[0], ptr), builder.inttoptr(args[1], ptr)
        cgutils.raw_memcpy(builder, d, s, args[2], 1)
        return context.get_dummy_value()

    return sig, codegen


@intrinsic
def _store_fence(typingctx):
    """A full fence: the streaming stores before it are visible to every thread after it."""
    sig = types.void()

    def codegen(context, builder, signature, args):
        builder.fence("seq_cst")
        return context.get_dummy_value()

    return sig, codegen


@njit(**KERNEL)
def copy_spans(src, src_offsets, dst_addresses, nbytes, stream):
    """Copies ``nbytes[i]`` bytes of ``src`` from ``src_offsets[i]`` to the memory at address
    ``dst_addresses[i]``, for every ``i`` in order. With ``stream`` the 64-byte-aligned body of
    each destination is written with non-temporal stores (copies far larger than the caches
    then run at memory bandwidth whatever their size: the C library's ``memcpy`` streams only
    above a threshold of its own, ~0.75x the last-level cache). Returns the bytes copied, or
    ``-(i + 1)`` for the first span ``i`` outside ``src`` (then nothing is copied). The
    destinations are the caller's: owned, writable, at least ``nbytes[i]`` bytes each."""
    n = src_offsets.size
    size = src.size
    total = 0
    for i in range(n):
        off = src_offsets[i]
        cnt = nbytes[i]
        if off < 0 or cnt < 0 or off > size or cnt > size - off:
            return -(i + 1)
        total += cnt
    base = src.ctypes.data
    for i in range(n):
        cnt = nbytes[i]
        if cnt == 0:
            continue
        addr = dst_addresses[i]
        s = base + src_offsets[i]
        k = 0
        if stream and cnt >= 2 * STREAM_BLOCK:
            k = (STREAM_BLOCK - addr % STREAM_BLOCK) % STREAM_BLOCK  # up to the first aligned block
            _memcpy(addr, s, k)
            while k + STREAM_BLOCK <= cnt:
                _stream64(addr + k, s + k)
                k += STREAM_BLOCK
        _memcpy(addr + k, s + k, cnt - k)
    if stream:
        _store_fence()
    return total
