"""A Numba scan of the pickle ``torch.save`` writes for a flat dict of tensors: every tensor's
fields as columns, in one pass, without running the pickle VM.

``torch.save({"name": tensor, ...})`` (protocols 2 and 3, the default) writes one block of
about 30 opcodes per tensor: the key, then ``_rebuild_tensor_v2(storage, offset, size,
stride, requires_grad, OrderedDict())`` where ``storage`` is a persistent id ``('storage',
<Storage class>, key, location, numel)``. :func:`scan_state_dict` recognizes exactly that
shape (root a dict or an ``OrderedDict()`` with no state, batches of ``SETITEMS``, memo
puts and gets where the pickler writes them) and fills columns: the storage class and
location (byte positions of their text), element count, storage offset, shape and stride
(into one ``dims`` array), ``requires_grad``, and the tensor names and storage keys copied
into two NUL-separated buffers (one ``decode`` and one ``split`` each in Python).

Anything else (another opcode, another global, a tensor with metadata, nested
containers, a NUL in a name, limits of :mod:`.pickle_vm` reached) returns a status that
is not :data:`OK`, and the caller runs the restricted VM (:mod:`.pickle_vm`), which reads
the general case and raises its errors: the scan never decides that a file is bad, it
only recognizes files it can read faster. The scan reads only ``data`` (every read is
bounded by its length), runs nothing and allocates nothing.

Examples
--------
>>> import io, pickle, torch
>>> from tdz_numba.formats.pickle_scan import OK, scan
>>> buf = io.BytesIO(); torch.save({"w": torch.zeros(2, 3), "b": torch.ones(3)}, buf)
>>> import zipfile
>>> pkl = zipfile.ZipFile(buf).read("archive/data.pkl")
>>> s = scan(pkl)
>>> s.names, s.storage_keys, s.shapes, s.strides, s.root
(['w', 'b'], ['0', '1'], [(2, 3), (3,)], [(3, 1), (1,)], 'dict')
"""

from __future__ import annotations

from typing import NamedTuple

import numpy as np
from numba import njit

from ..jit.presets import BORROWED, KERNEL  # BORROWED: the helpers and the scan loop
from .pickle_shapes import scan_shapes

__all__ = ["OK", "NCOL", "scan_state_dict", "scan", "Scanned"]

#: Status of a recognized pickle (anything else: run the VM).
OK = 0
_NO = 1  # not the shape this scan reads
_LIMIT = 2  # a resource limit of the VM reached: the VM reports it
_ROOM = 3  # the output arrays are full: scan again with room for the most a pickle can hold

# columns of ``cols``
(
    _STYPE_POS,
    _STYPE_LEN,
    _LOC_POS,
    _LOC_LEN,
    _NUMEL,
    _OFFSET,
    _NDIM,
    _SHAPE_AT,
    _STRIDE_AT,
    _GRAD,
    _KEYNUM,
) = range(11)
#: Columns per tensor.
NCOL = 11
# ``out``: status, tensors, root kind (0 dict, 1 OrderedDict), bytes of names, bytes of keys
_OUT_LEN = 5

_REBUILD = np.frombuffer(b"torch._utils\n_rebuild_tensor_v2\n", np.uint8)
_ODICT = np.frombuffer(b"collections\nOrderedDict\n", np.uint8)
_STORAGE = np.frombuffer(b"storage", np.uint8)
_MAX_DIMS = 64

#: The scan's small helpers, inlined where they are called (Numba IR): LLVM left most of them as
#: calls, each passing every array as 7 words and its result tuple through memory (a scan of a
#: 20,000-tensor state dict: 8.4 ms so, 2.5 ms inlined; ``_tuple`` too: 2.0 ms, but twice the
#: compile time of ``tdz warmup``).
_INLINE = {**BORROWED, "inline": "always"}

# memo kinds
_STR, _GLOBAL, _TUPLE, _OTHER = 1, 2, 3, 4


@njit(**_INLINE)
def _same(data, pos, length, needle):  # pragma: no cover - compiled
    if length != needle.size:
        return False
    x = data[pos : pos + length]
    d = 0
    for i in range(length):  # branch-free: LLVM vectorizes it
        d |= x[i] ^ needle[i]
    return d == 0


@njit(**_INLINE)
def _put(data, pos, n, kind, a, b, mkind, ma, mb, counts):  # pragma: no cover - compiled
    """Consumes an optional BINPUT / LONG_BINPUT after an object: the new position, or -1."""
    if pos >= n:
        return -1
    op = data[pos]
    if op == 0x71:  # BINPUT
        if pos + 2 > n:
            return -1
        idx = np.int64(data[pos + 1])
        pos += 2
    elif op == 0x72:  # LONG_BINPUT
        if pos + 5 > n:
            return -1
        idx = (
            np.int64(data[pos + 1])
            | (np.int64(data[pos + 2]) << 8)
            | (np.int64(data[pos + 3]) << 16)
            | (np.int64(data[pos + 4]) << 24)
        )
        pos += 5
    else:
        return pos
    if idx >= mkind.size:
        return -1
    if mkind[idx] == 0:
        counts[1] += 1
    mkind[idx] = kind
    ma[idx] = a
    mb[idx] = b
    counts[0] += 1
    return pos


@njit(**_INLINE)
def _get(data, pos, n, mkind):  # pragma: no cover - compiled
    """The memo index a BINGET / LONG_BINGET at ``pos`` reads (-1: not a get), and its length."""
    op = data[pos]
    if op == 0x68 and pos + 2 <= n:
        return np.int64(data[pos + 1]), 2
    if op == 0x6A and pos + 5 <= n:
        idx = (
            np.int64(data[pos + 1])
            | (np.int64(data[pos + 2]) << 8)
            | (np.int64(data[pos + 3]) << 16)
            | (np.int64(data[pos + 4]) << 24)
        )
        return (idx if idx < mkind.size else -2), 5
    return -1, 0


@njit(**_INLINE)
def _string(data, pos, n, mkind, ma, mb, counts):  # pragma: no cover - compiled
    """A str pushed by BINUNICODE / SHORT_BINUNICODE (+ put) or a get of one:
    ``(new pos, start, length)``; new pos -1 when it is not one."""
    if pos >= n:
        return -1, 0, 0
    op = data[pos]
    if op == 0x58 and pos + 5 <= n:  # BINUNICODE
        length = (
            np.int64(data[pos + 1])
            | (np.int64(data[pos + 2]) << 8)
            | (np.int64(data[pos + 3]) << 16)
            | (np.int64(data[pos + 4]) << 24)
        )
        start = pos + 5
    elif op == 0x8C and pos + 2 <= n:  # SHORT_BINUNICODE
        length = np.int64(data[pos + 1])
        start = pos + 2
    else:
        idx, skip = _get(data, pos, n, mkind)
        if idx < 0 or mkind[idx] != _STR:
            return -1, 0, 0
        counts[0] += 1
        return pos + skip, ma[idx], mb[idx]
    if start + length > n:
        return -1, 0, 0
    counts[0] += 1
    return _put(data, start + length, n, _STR, start, length, mkind, ma, mb, counts), start, length


@njit(**_INLINE)
def _global(data, pos, n, mkind, ma, mb, counts):  # pragma: no cover - compiled
    """A GLOBAL (+ put) or a get of one: ``(new pos, text start, text length)`` of its
    ``module\\nname\\n`` text (ASCII, each line under 4096 bytes, as the VM reads it)."""
    if pos >= n:
        return -1, 0, 0
    if data[pos] != 0x63:
        idx, skip = _get(data, pos, n, mkind)
        if idx < 0 or mkind[idx] != _GLOBAL:
            return -1, 0, 0
        counts[0] += 1
        return pos + skip, ma[idx], mb[idx]
    start = pos + 1
    end = start
    for _line in range(2):
        limit = min(n, end + 4096)
        while end < limit and data[end] != 0x0A:
            if data[end] >= 0x80:
                return -1, 0, 0
            end += 1
        if end >= limit:
            return -1, 0, 0
        end += 1
    counts[0] += 1
    return _put(data, end, n, _GLOBAL, start, end - start, mkind, ma, mb, counts), start, end - start


@njit(**_INLINE)
def _int(data, pos, n, counts):  # pragma: no cover - compiled
    """An int pushed by BININT1 / BININT2 / BININT / LONG1 (<= 8 bytes): ``(new pos, value)``."""
    if pos >= n:
        return -1, 0
    op = data[pos]
    if op == 0x4B and pos + 2 <= n:
        counts[0] += 1
        return pos + 2, np.int64(data[pos + 1])
    if op == 0x4D and pos + 3 <= n:
        counts[0] += 1
        return pos + 3, np.int64(data[pos + 1]) | (np.int64(data[pos + 2]) << 8)
    if op == 0x4A and pos + 5 <= n:
        v = (
            np.int64(data[pos + 1])
            | (np.int64(data[pos + 2]) << 8)
            | (np.int64(data[pos + 3]) << 16)
            | (np.int64(data[pos + 4]) << 24)
        )
        counts[0] += 1
        return pos + 5, v - (np.int64(1) << 32) if v >= (np.int64(1) << 31) else v
    if op == 0x8A and pos + 2 <= n:
        length = np.int64(data[pos + 1])
        if length > 8 or pos + 2 + length > n:
            return -1, 0
        v = np.int64(0)
        for i in range(length):
            v |= np.int64(data[pos + 2 + i]) << (8 * i)
        if 0 < length < 8 and data[pos + 1 + length] >= 0x80:  # sign-extend
            v -= np.int64(1) << (8 * length)
        counts[0] += 1
        return pos + 2 + length, v
    return -1, 0


@njit(**BORROWED)
def _tuple(data, pos, n, dims, nd, mkind, ma, mb, counts):  # pragma: no cover - compiled
    """A tuple of ints (EMPTY_TUPLE, TUPLE1-3 or MARK ... TUPLE, + put) or a get of one,
    appended to ``dims`` at ``nd[0]``: ``(new pos, start in dims, length)``."""
    if pos >= n:
        return -1, 0, 0
    start = nd[0]
    op = data[pos]
    idx, skip = _get(data, pos, n, mkind)
    if idx != -1:
        if idx < 0 or mkind[idx] != _TUPLE:
            return -1, 0, 0
        k = mb[idx]
        if start + k > dims.size:
            return -1, 0, 0
        for i in range(k):
            dims[start + i] = dims[ma[idx] + i]
        nd[0] = start + k
        counts[0] += 1
        return pos + skip, start, k
    if op == 0x29:  # EMPTY_TUPLE
        counts[0] += 1
        return _put(data, pos + 1, n, _TUPLE, start, 0, mkind, ma, mb, counts), start, 0
    marked = op == 0x28
    if marked:
        counts[0] += 1
        pos += 1
    k = 0
    while pos < n and (data[pos] == 0x4B or data[pos] == 0x4D or data[pos] == 0x4A or data[pos] == 0x8A):
        if k >= _MAX_DIMS or start + k >= dims.size:
            return -1, 0, 0
        pos, v = _int(data, pos, n, counts)
        if pos < 0:
            return -1, 0, 0
        dims[start + k] = v
        k += 1
    if pos >= n:
        return -1, 0, 0
    op = data[pos]
    if marked:
        if op != 0x74:  # TUPLE
            return -1, 0, 0
    elif not ((op == 0x85 and k == 1) or (op == 0x86 and k == 2) or (op == 0x87 and k == 3)):
        return -1, 0, 0
    counts[0] += 1
    nd[0] = start + k
    return _put(data, pos + 1, n, _TUPLE, start, k, mkind, ma, mb, counts), start, k


@njit(**_INLINE)
def _copy(data, start, length, buf, at):  # pragma: no cover - compiled
    """Copies ``data[start:start+length]`` and a NUL to ``buf`` at ``at``: the new end, or -1
    (a NUL in the text, or no room)."""
    if at + length + 1 > buf.size:
        return -2
    x = data[start : start + length]
    y = buf[at : at + length]
    nul = False
    for i in range(length):  # branch-free: LLVM vectorizes it
        c = x[i]
        nul |= c == 0
        y[i] = c
    if nul:
        return -1
    buf[at + length] = 0
    return at + length + 1


@njit(**BORROWED)
def _decimal(data, start, length):  # pragma: no cover - compiled
    """The number ``data[start:start+length]`` writes in canonical decimal (``str(int)`` of it:
    1 to 18 digits, no leading zero), or -1."""
    if length < 1 or length > 18 or (length > 1 and data[start] == 0x30):
        return -1
    v = np.int64(0)
    for i in range(length):
        c = data[start + i]
        if c < 0x30 or c > 0x39:
            return -1
        v = v * 10 + np.int64(c - 0x30)
    return v


@njit(**BORROWED)
def _entry(data, pos, n, row, cols, dims, nd, names, skeys, lens, mkind, ma, mb, counts):  # noqa: C901  # pragma: no cover - compiled
    """One ``key, _rebuild_tensor_v2(...)`` pair at ``pos`` into row ``row``: the new position, or -1."""
    pos, a, b = _string(data, pos, n, mkind, ma, mb, counts)  # the key
    if pos < 0:
        return -1
    lens[0] = _copy(data, a, b, names, lens[0])
    if lens[0] < 0:
        return lens[0]
    pos, a, b = _global(data, pos, n, mkind, ma, mb, counts)
    if pos < 0 or not _same(data, a, b, _REBUILD):
        return -1
    if pos + 2 > n or data[pos] != 0x28 or data[pos + 1] != 0x28:  # MARK MARK
        return -1
    counts[0] += 2
    pos, a, b = _string(data, pos + 2, n, mkind, ma, mb, counts)
    if pos < 0 or not _same(data, a, b, _STORAGE):
        return -1
    pos, a, b = _global(data, pos, n, mkind, ma, mb, counts)  # the storage class
    if pos < 0:
        return -1
    cols[row, _STYPE_POS] = a
    cols[row, _STYPE_LEN] = b
    pos, a, b = _string(data, pos, n, mkind, ma, mb, counts)  # the storage key
    if pos < 0:
        return -1
    lens[1] = _copy(data, a, b, skeys, lens[1])
    if lens[1] < 0:
        return lens[1]
    cols[row, _KEYNUM] = _decimal(data, a, b)  # torch.save's keys: "0", "1", ...
    pos, a, b = _string(data, pos, n, mkind, ma, mb, counts)  # the location
    if pos < 0:
        return -1
    cols[row, _LOC_POS] = a
    cols[row, _LOC_LEN] = b
    pos, v = _int(data, pos, n, counts)  # numel
    if pos < 0 or pos + 2 > n or data[pos] != 0x74:  # TUPLE
        return -1
    cols[row, _NUMEL] = v
    counts[0] += 1
    pos = _put(data, pos + 1, n, _OTHER, 0, 0, mkind, ma, mb, counts)
    if pos < 0 or pos >= n or data[pos] != 0x51:  # BINPERSID
        return -1
    counts[0] += 1
    pos, v = _int(data, pos + 1, n, counts)  # storage offset
    if pos < 0:
        return -1
    cols[row, _OFFSET] = v
    pos, a, b = _tuple(data, pos, n, dims, nd, mkind, ma, mb, counts)  # size
    if pos < 0:
        return -1
    cols[row, _SHAPE_AT] = a
    cols[row, _NDIM] = b
    pos, a, b2 = _tuple(data, pos, n, dims, nd, mkind, ma, mb, counts)  # stride
    if pos < 0 or b2 != b or pos >= n:
        return -1
    cols[row, _STRIDE_AT] = a
    if data[pos] == 0x88:  # NEWTRUE
        cols[row, _GRAD] = 1
    elif data[pos] == 0x89:  # NEWFALSE
        cols[row, _GRAD] = 0
    else:
        return -1
    counts[0] += 1
    pos, a, b = _global(data, pos + 1, n, mkind, ma, mb, counts)  # backward hooks: OrderedDict()
    if pos < 0 or not _same(data, a, b, _ODICT) or pos + 2 > n:
        return -1
    if data[pos] != 0x29 or data[pos + 1] != 0x52:  # EMPTY_TUPLE REDUCE
        return -1
    counts[0] += 2
    pos = _put(data, pos + 2, n, _OTHER, 0, 0, mkind, ma, mb, counts)
    if pos < 0 or pos >= n or data[pos] != 0x74:  # TUPLE: the arguments
        return -1
    counts[0] += 1
    pos = _put(data, pos + 1, n, _OTHER, 0, 0, mkind, ma, mb, counts)
    if pos < 0 or pos >= n or data[pos] != 0x52:  # REDUCE: the tensor
        return -1
    counts[0] += 1
    return _put(data, pos + 1, n, _OTHER, 0, 0, mkind, ma, mb, counts)


@njit(**KERNEL)
def scan_state_dict(
    data, cols, dims, names, skeys, mkind, ma, mb, limits, out
):  # pragma: no cover - compiled
    """Scans a pickle (see the module); ``out`` = ``[status, tensors, root kind, bytes of
    names, bytes of storage keys]``. ``cols`` (rows x :data:`NCOL`), ``dims``, ``names``,
    ``skeys`` are filled; ``mkind`` (int8, zeros), ``ma`` and ``mb`` (int64) are the memo's
    scratch, one slot per memo index; ``limits`` = ``[most opcodes, most memo entries]``
    (the VM's: reaching one is left to the VM)."""
    counts = np.zeros(2, np.int64)  # opcodes run, memo entries
    nd = np.zeros(1, np.int64)
    lens = np.zeros(2, np.int64)
    _scan(data, cols, dims, names, skeys, mkind, ma, mb, limits, out, counts, nd, lens)


@njit(**BORROWED)
def _scan(data, cols, dims, names, skeys, mkind, ma, mb, limits, out, counts, nd, lens):  # noqa: C901  # pragma: no cover - compiled
    """The scan of :func:`scan_state_dict`, its scratch (``counts``, ``nd``, ``lens``: zeros) given."""
    n = data.size
    out[0] = _NO
    out[1] = 0
    if n < 4 or data[0] != 0x80 or (data[1] != 2 and data[1] != 3):
        return
    pos = 2
    counts[0] = 1
    if data[pos] == 0x7D:  # EMPTY_DICT
        counts[0] += 1
        pos = _put(data, pos + 1, n, _OTHER, 0, 0, mkind, ma, mb, counts)
        root = 0
    else:
        pos, a, b = _global(data, pos, n, mkind, ma, mb, counts)
        if pos < 0 or not _same(data, a, b, _ODICT) or pos + 2 > n:
            return
        if data[pos] != 0x29 or data[pos + 1] != 0x52:
            return
        counts[0] += 2
        pos = _put(data, pos + 2, n, _OTHER, 0, 0, mkind, ma, mb, counts)
        root = 1
    rows = 0
    while pos >= 0 and pos < n:
        op = data[pos]
        if op == 0x2E:  # STOP
            counts[0] += 1
            if counts[0] > limits[0] or counts[1] >= limits[1]:
                out[0] = _LIMIT
                return
            out[0] = OK
            out[1] = rows
            out[2] = root
            out[3] = lens[0]
            out[4] = lens[1]
            return
        single = op != 0x28  # key, value, SETITEM
        if not single:
            counts[0] += 1
            pos += 1
        while pos < n and (single or (data[pos] != 0x75)):  # SETITEMS ends a batch
            if rows >= cols.shape[0] or nd[0] + 2 * _MAX_DIMS > dims.size:
                out[0] = _ROOM
                return
            if counts[0] > limits[0]:
                return
            pos = _entry(data, pos, n, rows, cols, dims, nd, names, skeys, lens, mkind, ma, mb, counts)
            if pos < 0:
                if pos == -2:
                    out[0] = _ROOM
                return
            rows += 1
            if single:
                break
        if pos < 0 or pos >= n or data[pos] != (0x73 if single else 0x75):
            return
        counts[0] += 1
        pos += 1


class Scanned(NamedTuple):
    """A recognized pickle's tensors, in order (see :func:`scan`)."""

    names: list[str]
    storage_keys: list[str]
    storage_types: list[tuple[str, str]]  # (module, name) of each tensor's storage class
    locations: list[str]
    numels: np.ndarray
    offsets: np.ndarray
    shapes: list[tuple[int, ...]]
    strides: list[tuple[int, ...]]
    root: str  # "dict" or "OrderedDict"
    #: Each storage key as the number it writes in canonical decimal (``"12"``: 12), else -1.
    key_numbers: np.ndarray | None = None


def _texts(data: bytes, pos: np.ndarray, length: np.ndarray) -> list[str] | None:
    """The UTF-8 text at each ``(pos, length)``, decoded once per distinct position (None: not UTF-8)."""
    first = int(pos[0])
    try:
        if (pos == first).all():  # one memoized string (the usual "cpu", one storage class)
            return [data[first : first + int(length[0])].decode("utf-8")] * pos.size
        uniq, at, inverse = np.unique(pos, return_index=True, return_inverse=True)
        table = [data[p : p + k].decode("utf-8") for p, k in zip(uniq.tolist(), length[at].tolist())]
    except UnicodeDecodeError:
        return None
    return list(map(table.__getitem__, inverse.tolist()))


def scan(
    data: bytes, max_ops: int | None = None, max_memo: int | None = None, *, unique: bool = True
) -> Scanned | None:
    """The tensors of a ``torch.save`` pickle of a flat dict (see the module), or None when the
    pickle is not of that shape (or a name or key is not strict UTF-8, or two names repeat):
    the VM reads it then. ``unique=False``: repeated names are left to the caller (a dict of
    the names, which it builds anyway, tells them in the same pass)."""
    from .pickle_vm import MAX_MEMO, MAX_OPS

    n = len(data)
    buf = np.frombuffer(data, np.uint8)
    buf.flags.writeable = False  # bytes or bytearray: one compiled signature
    limits = np.array(
        [MAX_OPS if max_ops is None else max_ops, MAX_MEMO if max_memo is None else max_memo], np.int64
    )
    out = np.zeros(_OUT_LEN, np.int64)
    slots = n // 2 + 1  # a put takes 2 bytes at least: a larger memo index is refused (the VM reads it)
    mkind = np.zeros(slots, np.int8)  # calloc: only the pages of the indices used are touched
    ma, mb = np.empty(slots, np.int64), np.empty(slots, np.int64)
    rows = n // 64 + 16  # torch.save writes ~100 bytes a tensor: room for that, else a second scan
    for _ in range(2):
        cols = np.empty((rows, NCOL), np.int64)
        dims = np.empty(4 * rows + 4 * _MAX_DIMS, np.int64)
        names = np.empty(min(n, 32 * rows) + 1, np.uint8)
        skeys = np.empty(min(n, 8 * rows) + 1, np.uint8)
        scan_state_dict(buf, cols, dims, names, skeys, mkind, ma, mb, limits, out)
        if out[0] != _ROOM:
            break
        rows = n // 20 + 16  # an entry takes more than 20 bytes: room for every one
        mkind[:] = 0
    count = int(out[1])
    if out[0] != OK or count == 0:
        return None
    cols = cols[:count]
    try:
        keys = names[: out[3] - 1].tobytes().decode("utf-8").split("\0")
        skey = skeys[: out[4] - 1].tobytes().decode("utf-8").split("\0")
        globs = _texts(data, cols[:, _STYPE_POS], cols[:, _STYPE_LEN])
        locs = _texts(data, cols[:, _LOC_POS], cols[:, _LOC_LEN])
    except UnicodeDecodeError:
        return None
    if globs is None or locs is None or (unique and len(set(keys)) != count):
        return None
    types: dict[str, tuple[str, str]] = {}
    for g in set(globs):
        module, name, _ = g.split("\n")
        types[g] = (module, name)
    shapes, strides = scan_shapes(dims, cols[:, _NDIM : _STRIDE_AT + 1])  # (ndim, shape_at, stride_at)
    return Scanned(
        keys,
        skey,
        list(map(types.__getitem__, globs)),
        locs,
        cols[:, _NUMEL],
        cols[:, _OFFSET],
        shapes,
        strides,
        "OrderedDict" if out[2] else "dict",
        cols[:, _KEYNUM],
    )
