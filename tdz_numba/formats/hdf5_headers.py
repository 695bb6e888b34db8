"""HDF5 object headers read without libhdf5: the message table of an object and the bulk dataset scan.

An HDF5 object (group, dataset, committed datatype) is an *object header*: a
list of messages (type, flags, payload) spread over a first chunk and the
continuation blocks it names. Version 1 headers (``libver="earliest"``) start
with a version byte of 1 and 8-byte aligned messages; version 2 headers
(``"OHDR"``, ``libver="latest"``) have compact message headers and ``"OCHK"``
continuation blocks. :func:`header_messages` walks either kind into a table of
``(type, flags, payload offset, payload size)`` rows, every claim checked
against the file (offsets, sizes, the number of continuation blocks, the
table's capacity), so a damaged header ends in a status code, never a loop.

:func:`scan_datasets` does this for many objects at once and decodes, for the
common case (a simple dataspace, a little-endian IEEE float or a full-precision
integer, contiguous layout version 3/4 with an allocated address and no
filter, external storage or shared message), the dtype, shape, address and
size: the hot path of :func:`~tdz_numba.formats.hdf5.open_hdf5`. Everything
else gets status :data:`SLOW` and is decoded in Python
(:mod:`~tdz_numba.formats.hdf5_objects`, :mod:`~tdz_numba.formats.hdf5_walk`).
:func:`global_heap` walks a global heap collection (the bytes of variable-length
strings and sequences) into a table of objects, or a ``G_*`` status
(:mod:`~tdz_numba.formats.hdf5_heap` words them).

Statuses (negative: the header itself is damaged):

============  ===========================================================
``FAST``      a plain contiguous numeric dataset, decoded in full
``FAST_ATTRS`` the same, with attribute messages (read by
              :mod:`~tdz_numba.formats.hdf5_attrs`)
``SLOW``      an object to look at in Python (group, chunked, strings...)
``E_BOUNDS``  an offset or size runs past the end of the file
``E_SIG``     no object header at the address (bad signature or version)
``E_FULL``    more messages than the table holds
``E_BLOCKS``  more continuation blocks than :data:`MAX_BLOCKS`
============  ===========================================================

Examples
--------
>>> import numpy as np
>>> buf = np.zeros(64, np.uint8); buf[0] = 1; buf[8:12] = [32, 0, 0, 0]   # v1 header, 32 bytes
>>> buf[16:18] = [1, 0]; buf[18:20] = [8, 0]                              # a message of type 1, 8 bytes
>>> table = np.zeros((8, 4), np.int64)
>>> int(header_messages(buf, 0, 0, 8, 8, table)), table[0].tolist()
(1, [1, 0, 24, 8])
"""

from __future__ import annotations

import numpy as np
from numba import njit

from ..jit.presets import KERNEL

__all__ = [
    "header_messages",
    "scan_datasets",
    "symbol_table",
    "global_heap",
    "FAST",
    "FAST_ATTRS",
    "SLOW",
    "E_BOUNDS",
    "E_SIG",
    "E_FULL",
    "E_BLOCKS",
    "MAX_BLOCKS",
    "MAX_RANK",
    "COLS",
    "DTYPES",
    "STATUS_TEXT",
    "UNDEF",
    "G_NONE",
    "G_VERSION",
    "G_CUT",
    "G_SIZE",
    "G_UNDEF",
    "G_TWICE",
    "G_ZERO",
    "G_PAST",
    "G_FULL",
]

FAST, SLOW, FAST_ATTRS = 0, 1, 2
E_BOUNDS, E_SIG, E_FULL, E_BLOCKS = -1, -2, -3, -4
STATUS_TEXT = {
    E_BOUNDS: "an offset or size runs past the end of the file",
    E_SIG: "no object header at this address",
    E_FULL: "more header messages than allowed",
    E_BLOCKS: "more header continuation blocks than allowed",
}
#: Most chunks (the first + continuations) one object header may span.
MAX_BLOCKS = 4096
#: Statuses of :func:`global_heap` (a damaged collection; :mod:`~tdz_numba.formats.hdf5_heap` words them).
G_NONE, G_VERSION, G_CUT, G_SIZE, G_UNDEF, G_TWICE, G_ZERO, G_PAST, G_FULL = range(-1, -10, -1)
#: HDF5's own limit on the rank of a dataspace.
MAX_RANK = 32
#: Address fields holding all ones: "undefined" (returned as -1).
UNDEF = -1
#: Columns of :func:`scan_datasets`'s output: status, dtype code, rank, address, size, then the dims.
COLS = 5 + MAX_RANK
#: dtype codes of :func:`scan_datasets` (index) -> numpy dtype string.
DTYPES = ("", "<i1", "<i2", "<i4", "<i8", "<u1", "<u2", "<u4", "<u8", "<f2", "<f4", "<f8")

# message types
_NIL, _DATASPACE, _LINFO, _DTYPE, _FILL_OLD, _FILL, _LINK, _EXTERNAL, _LAYOUT = 0, 1, 2, 3, 4, 5, 6, 7, 8
_PIPELINE, _ATTR, _CONT, _SYMTAB, _AINFO = 0x0B, 0x0C, 0x10, 0x11, 0x15


@njit(**KERNEL)
def _uint(buf, pos, width):
    """Little-endian unsigned of ``width`` bytes at ``pos`` (all ones: -1, "undefined")."""
    v = 0
    ones = True
    for i in range(width):
        b = np.int64(buf[pos + i])
        if b != 255:
            ones = False
        v |= b << (8 * i)
    if ones:
        return -1
    if v < 0:  # the top bit of an 8-byte field: no such offset in a real file
        return -2
    return v


@njit(**KERNEL)
def _is(buf, pos, a, b, c, d):
    return buf[pos] == a and buf[pos + 1] == b and buf[pos + 2] == c and buf[pos + 3] == d


@njit(**KERNEL)
def header_messages(buf, addr, base, osz, lsz, table):
    """Walks the object header at ``addr`` (relative to ``base``) into ``table`` (int64, ``[cap, 4]``).

    Returns the number of rows written (type, flags, absolute payload offset,
    payload size; NIL messages left out) or a negative status.
    """
    n = buf.size
    cap = table.shape[0]
    start = base + addr
    if addr < 0 or addr > n or start < 0 or start + 16 > n:
        return E_BOUNDS
    blocks = np.empty((MAX_BLOCKS, 2), np.int64)
    nb = 1
    count = 0
    if _is(buf, start, 79, 72, 68, 82):  # "OHDR"
        if buf[start + 4] != 2:
            return E_SIG
        flags = np.int64(buf[start + 5])
        pos = start + 6
        if flags & 0x20:
            pos += 16
        if flags & 0x10:
            pos += 4
        width = 1 << (flags & 3)
        if pos + width > n:
            return E_BOUNDS
        size0 = _uint(buf, pos, width)
        pos += width
        if size0 < 0 or size0 > n or pos + size0 + 4 > n:
            return E_BOUNDS
        blocks[0, 0] = pos
        blocks[0, 1] = size0
        v2 = True
    else:
        if buf[start] != 1:
            return E_SIG
        size0 = _uint(buf, start + 8, 4)
        if size0 < 0 or start + 16 + size0 > n:
            return E_BOUNDS
        blocks[0, 0] = start + 16
        blocks[0, 1] = size0
        flags = 0
        v2 = False
    b = 0
    while b < nb:
        pos = blocks[b, 0]
        end = pos + blocks[b, 1]
        b += 1
        hsize = (6 if flags & 0x04 else 4) if v2 else 8
        while pos + hsize <= end:
            if v2:
                mtype = np.int64(buf[pos])
                msize = np.int64(buf[pos + 1]) | (np.int64(buf[pos + 2]) << 8)
                mflags = np.int64(buf[pos + 3])
            else:
                mtype = np.int64(buf[pos]) | (np.int64(buf[pos + 1]) << 8)
                msize = np.int64(buf[pos + 2]) | (np.int64(buf[pos + 3]) << 8)
                mflags = np.int64(buf[pos + 4])
            data = pos + hsize
            if data + msize > end:
                return E_BOUNDS
            pos = data + msize
            if mtype == _NIL:
                continue
            if mtype == _CONT:
                if msize < osz + lsz:
                    return E_BOUNDS
                caddr = _uint(buf, data, osz)
                clen = _uint(buf, data + osz, lsz)
                if caddr < 0 or clen < 0 or caddr > n or clen > n or base + caddr + clen > n:
                    return E_BOUNDS
                if nb >= MAX_BLOCKS:
                    return E_BLOCKS
                cpos = base + caddr
                if v2:
                    if clen < 8 or not _is(buf, cpos, 79, 67, 72, 75):  # "OCHK"
                        return E_SIG
                    blocks[nb, 0] = cpos + 4
                    blocks[nb, 1] = clen - 8
                else:
                    blocks[nb, 0] = cpos
                    blocks[nb, 1] = clen
                nb += 1
                continue
            if count >= cap:
                return E_FULL
            table[count, 0] = mtype
            table[count, 1] = mflags
            table[count, 2] = data
            table[count, 3] = msize
            count += 1
    return count


@njit(**KERNEL)
def _dtype_code(buf, p, size):
    """dtype code (:data:`DTYPES`) of a plain little-endian datatype message at ``p``; 0 otherwise."""
    if size < 12:
        return 0
    cls = buf[p] & 0x0F
    bits = np.int64(buf[p + 1]) | (np.int64(buf[p + 2]) << 8) | (np.int64(buf[p + 3]) << 16)
    width = _uint(buf, p + 4, 4)
    offset = np.int64(buf[p + 8]) | (np.int64(buf[p + 9]) << 8)
    prec = np.int64(buf[p + 10]) | (np.int64(buf[p + 11]) << 8)
    if offset != 0 or prec != 8 * width:
        return 0
    if cls == 0:
        if bits & 1 or bits & 0x06:  # big-endian, or padding bits set to one
            return 0
        signed = (bits >> 3) & 1
        for i in range(4):
            if width == (1 << i):
                return 1 + i if signed else 5 + i
        return 0
    if cls != 1 or size < 20:
        return 0
    if bits & 0x41 or bits & 0x0E or ((bits >> 4) & 3) != 2:  # not LE, padding set, not implied msb
        return 0
    sign = (bits >> 8) & 0xFF
    eloc, esize, mloc, msz = buf[p + 12], buf[p + 13], buf[p + 14], buf[p + 15]
    bias = _uint(buf, p + 16, 4)
    if width == 2 and sign == 15 and eloc == 10 and esize == 5 and mloc == 0 and msz == 10 and bias == 15:
        return 9
    if width == 4 and sign == 31 and eloc == 23 and esize == 8 and mloc == 0 and msz == 23 and bias == 127:
        return 10
    if width == 8 and sign == 63 and eloc == 52 and esize == 11 and mloc == 0 and msz == 52 and bias == 1023:
        return 11
    return 0


_ITEMSIZE = np.array([0, 1, 2, 4, 8, 1, 2, 4, 8, 2, 4, 8], np.int64)


@njit(**KERNEL)
def scan_datasets(buf, addrs, base, osz, lsz, out):
    """Reads the object header of every address in ``addrs`` into a row of ``out`` (``[len, COLS]``).

    Row: status (:data:`FAST`, :data:`FAST_ATTRS`, :data:`SLOW` or a negative
    status), dtype code (:data:`DTYPES`), rank, absolute data offset, data size,
    dims. Only :data:`FAST` and :data:`FAST_ATTRS` rows carry the decoded fields.
    """
    n = buf.size
    table = np.empty((512, 4), np.int64)
    itemsize = _ITEMSIZE
    for i in range(addrs.size):
        row = out[i]
        row[:] = 0
        got = header_messages(buf, addrs[i], base, osz, lsz, table)
        if got < 0:
            row[0] = got if got != E_FULL else SLOW
            continue
        row[0] = SLOW
        space = -1
        dtype = -1
        layout = -1
        other = False
        attrs = False
        for m in range(got):
            t = table[m, 0]
            if t == _DATASPACE and space < 0:
                space = m
            elif t == _DTYPE and dtype < 0:
                dtype = m
            elif t == _LAYOUT:
                if layout >= 0:  # two layout messages: for Python (and libhdf5) to judge
                    other = True
                layout = m
            elif t == _AINFO:  # attribute info: attributes only when its fractal heap is defined
                p, size = table[m, 2], table[m, 3]
                at = p + 2 + (2 if size >= 2 and buf[p + 1] & 1 else 0)
                if at + osz > p + size or _uint(buf, at, osz) != -1:
                    other = True
            elif t == _ATTR:  # compact attributes: read in Python, the data still mapped here
                attrs = True
            elif t == _EXTERNAL or t == _PIPELINE or t == _SYMTAB:
                other = True
            elif t == _LINK or t == _LINFO:
                other = True
            if table[m, 1] & 0x02:  # a shared message
                other = True
        if other or space < 0 or dtype < 0 or layout < 0:
            continue
        # dataspace: version 1 or 2, simple, rank >= 1
        p, size = table[space, 2], table[space, 3]
        if size < 4:
            continue
        ver, rank = buf[p], np.int64(buf[p + 1])
        if ver == 1:
            d0 = p + 8
        elif ver == 2 and buf[p + 3] == 1:
            d0 = p + 4
        else:
            continue
        if rank < 1 or rank > MAX_RANK or d0 + rank * lsz > p + size:
            continue
        count = np.int64(1)
        ok = True
        for r in range(rank):
            d = _uint(buf, d0 + r * lsz, lsz)
            if d < 0 or d > n:  # a dim larger than the file: h5py's problem
                ok = False
                break
            row[5 + r] = d
            if d > 0 and count > n // d:
                ok = False
                break
            count *= d
        if not ok:
            continue
        code = _dtype_code(buf, table[dtype, 2], table[dtype, 3])
        if code == 0:
            continue
        p, size = table[layout, 2], table[layout, 3]
        if size < 2 + osz + lsz or (buf[p] != 3 and buf[p] != 4) or buf[p + 1] != 1:
            continue
        addr = _uint(buf, p + 2, osz)
        nbytes = _uint(buf, p + 2 + osz, lsz)
        want = count * itemsize[code]
        if addr < 0 or addr > n or nbytes != want or want == 0 or base + addr + want > n:
            continue
        row[0] = FAST_ATTRS if attrs else FAST
        row[1] = code
        row[2] = rank
        row[3] = base + addr
        row[4] = want


@njit(**KERNEL)
def symbol_table(buf, btree, base, osz, lsz, out):
    """Lists an "old-style" group: walks its version 1 B-tree (group nodes) from ``btree``
    (absolute) and its symbol table nodes, in name order, into ``out`` (int64, ``[cap, 4]``):
    heap offset of the name, absolute object header address (-1: undefined), cache type, the
    first 4 scratch-pad bytes (a soft link's value offset). Returns the count or a negative
    status: a child's level must be its parent's minus one (no cycles), the nodes visited are
    bounded by the file size, the entries by ``out``'s capacity."""
    n = buf.size
    cap = out.shape[0]
    stack = np.empty((1 << 17, 2), np.int64)  # (node, expected level)
    sp = 0
    stack[0, 0] = btree
    stack[0, 1] = -1
    sp = 1
    visits = 0
    count = 0
    entry = 2 * osz + 24
    step = lsz + osz
    while sp > 0:
        sp -= 1
        node = stack[sp, 0]
        want = stack[sp, 1]
        visits += 1
        if visits > n // 24 + 1:
            return E_BLOCKS
        if node < 0 or node > n or node + 8 + 2 * osz > n:
            return E_BOUNDS
        if not _is(buf, node, 84, 82, 69, 69) or buf[node + 4] != 0:  # "TREE", group node
            return E_SIG
        level = np.int64(buf[node + 5])
        used = np.int64(buf[node + 6]) | (np.int64(buf[node + 7]) << 8)
        if (want >= 0 and level != want) or level > 63:
            return E_SIG
        kids = node + 8 + 2 * osz
        if kids + used * step + lsz > n:
            return E_BOUNDS
        if level > 0:
            if sp + used > stack.shape[0]:
                return E_BLOCKS
            for i in range(used - 1, -1, -1):
                c = _uint(buf, kids + lsz + i * step, osz)
                if c < 0 or c > n:
                    return E_BOUNDS
                stack[sp, 0] = base + c
                stack[sp, 1] = level - 1
                sp += 1
            continue
        for i in range(used):
            s = _uint(buf, kids + lsz + i * step, osz)
            if s < 0 or s > n:
                return E_BOUNDS
            s += base
            if s + 8 > n or not _is(buf, s, 83, 78, 79, 68):  # "SNOD"
                return E_SIG
            k = np.int64(buf[s + 6]) | (np.int64(buf[s + 7]) << 8)
            if s + 8 + k * entry > n:
                return E_BOUNDS
            if count + k > cap:
                return E_FULL
            for j in range(k):
                e = s + 8 + j * entry
                out[count, 0] = _uint(buf, e, osz)
                a = _uint(buf, e + osz, osz)
                out[count, 1] = a + base if 0 <= a <= n else -1
                out[count, 2] = _uint(buf, e + 2 * osz, 4)
                out[count, 3] = _uint(buf, e + 2 * osz + 8, 4)
                count += 1
    return count


@njit(**KERNEL)
def global_heap(buf, addr, lsz, out, info):
    """Walks the global heap collection at absolute ``addr`` the way libhdf5 walks it, into
    ``out`` (int64, ``[cap, 3]``: object index, absolute data offset, size; in the order they
    are stored). Returns the count or a negative ``G_*`` status; ``info`` (int64, 3) holds the
    collection's size and, for a damaged object, its index and size (sizes as unsigned bits).

    Every claim is checked: the ``"GCOL"`` signature and version 1, the collection within the
    file, no object of an undefined size, an index twice, a free-space object of 0 bytes (libhdf5
    loops on it) or an object past the collection; what follows the last object header that fits
    is free space. ``G_FULL``: more objects than ``out`` holds (at most ``info[0] // (8 + lsz)``).
    """
    n = buf.size
    hdr = 8 + lsz
    if addr < 0 or addr > n - 8 or not _is(buf, addr, 71, 67, 79, 76):  # "GCOL"
        return G_NONE
    info[1] = np.int64(buf[addr + 4])
    if buf[addr + 4] != 1:
        return G_VERSION
    if addr + hdr > n:
        return G_CUT
    csize = np.uint64(0)
    for i in range(lsz):
        csize |= np.uint64(buf[addr + 8 + i]) << np.uint64(8 * i)
    info[0] = np.int64(csize)
    undefined = np.uint64(0xFFFFFFFFFFFFFFFF) >> np.uint64(64 - 8 * lsz)
    if csize == undefined or csize < np.uint64(hdr) or csize > np.uint64(n - addr):
        return G_SIZE
    size = np.int64(csize)
    seen = np.zeros(65536, np.bool_)
    cap = out.shape[0]
    count = 0
    p = hdr
    while p + hdr <= size:
        q = addr + p
        idx = np.int64(buf[q]) | (np.int64(buf[q + 1]) << 8)
        osize = np.uint64(0)
        for i in range(lsz):
            osize |= np.uint64(buf[q + 8 + i]) << np.uint64(8 * i)
        info[1] = idx
        info[2] = np.int64(osize)
        if osize == undefined:
            return G_UNDEF
        rest = size - p
        if idx > 0:
            if seen[idx]:
                return G_TWICE
            seen[idx] = True
            if osize > np.uint64(rest):
                return G_PAST
            need = hdr + ((np.int64(osize) + 7) & ~7)
            if need > rest:
                return G_PAST
            if count >= cap:
                return G_FULL
            out[count, 0] = idx
            out[count, 1] = q + hdr
            out[count, 2] = np.int64(osize)
            count += 1
        elif osize == 0:
            return G_ZERO
        else:
            if osize > np.uint64(rest):
                break
            need = np.int64(osize)
        p += need
    return count
