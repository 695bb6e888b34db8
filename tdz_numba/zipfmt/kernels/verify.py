"""Numba kernels of :func:`tdz_numba.verify`: one shared pass over every entry that checks
its local header and hashes its stored bytes, run by several threads at once.

:func:`crc_worker` is called by every thread of the pass (a helper thread from the
start, the calling thread once its own work is done); each call takes work items
from one shared counter (an atomic fetch-add) until none is left, so the threads
share the work whatever each did before, and a call holds no lock and no GIL.

Work: ``rows`` (entries, in any order), each cut by :func:`plan_pieces` into
pieces of at most ``chunk`` bytes of its ``crc_len`` (0: header only); pieces are
grouped into work items of about ``target`` bytes. Each piece checks its entry's
local header first (:func:`~tdz_numba.zipfmt.kernels.central.check_entry_header`: the bytes hashed lie inside the
entry's extent, which lies inside the file) and hashes nothing when it fails.

Examples
--------
>>> import numpy as np, zlib
>>> from tdz_numba.zipfmt.kernels import verify as vk
>>> lens = np.array([0, 5, 3 << 20], np.int64)
>>> first, owner, items = vk.plan_pieces(lens, 1 << 20, 2 << 20)
>>> first.tolist(), owner.tolist(), items.tolist()
([0, 1, 2, 5], [0, 1, 2, 2, 2], [0, 4, 5])
"""

from __future__ import annotations

import numpy as np
from numba import njit, types
from numba.extending import intrinsic

from ...jit.presets import KERNEL
from .. import records
from .central import check_entry_header
from .crc import _crc_table, _multmodp, _span_crc, _x2nmodp, crc32_combine

_CSIZE = int(records.Col.CSIZE)
_PAYLOAD = int(records.Col.PAYLOAD_OFFSET)
_HOFF = int(records.Col.HEADER_OFFSET)

__all__ = ["fetch_add", "plan_pieces", "crc_worker", "fold_pieces"]


@intrinsic
def fetch_add(typingctx, counter, value):
    """``counter[0] += value`` as one atomic operation (sequentially consistent);
    returns the value before. ``counter``: a non-empty C-contiguous int64 array."""
    if not (
        isinstance(counter, types.Array)
        and counter.dtype == types.int64
        and counter.layout == "C"
        and isinstance(value, types.Integer)
    ):
        return None
    sig = types.int64(counter, value)

    def codegen(context, builder, signature, args):
        ary = context.make_array(signature.args[0])(context, builder, args[0])
        delta = context.cast(builder, args[1], signature.args[1], types.int64)
        return builder.atomic_rmw("add", ary.data, delta, "seq_cst")

    return sig, codegen


@njit(**KERNEL)
def plan_pieces(crc_len, chunk, target):
    """``(first, owner, items)``: entry ``k`` owns pieces ``first[k]:first[k + 1]``
    (at least one, so that its header is checked; ``ceil(crc_len[k] / chunk)``
    otherwise), ``owner[j]`` is the entry of piece ``j``, and work item ``w`` is the
    pieces ``items[w]:items[w + 1]``: consecutive pieces of about ``target`` bytes
    (a piece also counts 4 KiB: its header check faults a page in)."""
    n = crc_len.size
    first = np.zeros(n + 1, np.int64)
    for k in range(n):
        first[k + 1] = first[k] + max(1, (crc_len[k] + chunk - 1) // chunk)
    total = first[n]
    owner = np.empty(total, np.int64)
    bounds = np.empty(total + 1, np.int64)
    bounds[0] = 0
    count = 1
    held = 0
    for k in range(n):
        left = crc_len[k]
        for j in range(first[k], first[k + 1]):
            owner[j] = k
            size = min(chunk, left)
            left -= size
            held += size + 4096
            if held >= target:
                bounds[count] = j + 1
                count += 1
                held = 0
    if bounds[count - 1] != total:
        bounds[count] = total
        count += 1
    return first, owner, bounds[:count].copy()


@njit(**KERNEL)
def crc_worker(
    buf, cols, cd_offset, rows, crc_len, first, owner, items, chunk, counter, entered, crcs, failed
):
    """One thread's share of the pass: takes work items from ``counter`` until none is
    left; for each piece ``j`` of entry ``k = owner[j]`` (row ``rows[k]`` of ``cols``)
    checks the local header (filling its payload offset in ``cols``) and, when it
    holds, stores the CRC-32 of the piece's bytes in ``crcs[j]``; a failed check
    stores its status code in ``failed[k]``. Returns the number of items it did.
    ``entered[0]`` counts the calls that have started (the caller waits for its helpers:
    a thread that has not yet reached the kernel needs the GIL, which the caller holds).

    Bounds: ``rows`` index ``cols``; ``crc_len[k] <= cols[rows[k], CSIZE]`` (the
    caller's plan); the header check proves ``payload + csize`` within the file.
    """
    table = _crc_table()  # only used without zlib-ng
    base = buf.ctypes.data
    status = np.zeros(4, np.int64)
    n_items = items.size - 1
    done = 0
    fetch_add(entered, 1)
    while True:
        w = fetch_add(counter, 1)
        if w >= n_items:
            break
        done += 1
        for j in range(items[w], items[w + 1]):
            k = owner[j]
            i = rows[k]
            if not check_entry_header(buf, cols[i, _HOFF], buf, cols, i, cd_offset, status):
                failed[k] = status[0]
                continue
            start = (j - first[k]) * chunk
            size = min(chunk, crc_len[k] - start)
            if size > 0 and crc_len[k] <= cols[i, _CSIZE]:
                crcs[j] = _span_crc(base + cols[i, _PAYLOAD] + start, size, table)
    return done


@njit(**KERNEL)
def fold_pieces(crcs, first, crc_len, chunk):
    """The CRC-32 of each entry's ``crc_len`` bytes from its pieces' CRCs, combined in
    order: an entry of one piece is its piece's CRC (no combine); whole pieces are
    appended with one precomputed ``x ** (8 * chunk)``, the last one by its length."""
    n = crc_len.size
    out = np.zeros(n, np.uint32)
    whole = _x2nmodp(chunk, 3)
    for i in range(n):
        a = first[i]
        b = first[i + 1]
        c = np.uint32(crcs[a])
        if b - a > 1:
            for j in range(a + 1, b - 1):
                c = _multmodp(whole, c) ^ crcs[j]
            c = crc32_combine(c, crcs[b - 1], crc_len[i] - (b - a - 1) * chunk)
        out[i] = c
    return out
