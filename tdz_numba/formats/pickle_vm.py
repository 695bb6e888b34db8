"""A restricted pickle VM for ``torch.save`` files: it interprets opcodes and runs nothing.

Python's unpickler imports every global a pickle names and calls it. This VM
does neither: it interprets the binary opcodes of protocols 1-5 itself (the
text opcodes of protocol 0 are refused, as ``torch.load(weights_only=True)``
refuses them), and a global is looked up in the fixed table of
:mod:`.pickle_ops` (tensor and storage reconstruction, containers, scalars).
Any other global raises :class:`~tdz_numba.UnsafeContentError` naming it,
before anything else happens. Tensors come back as :class:`TensorRef`
descriptions (storage, offset, shape, strides, conjugate / negative bits),
never as tensors: the caller maps them.

Resources are bounded before they are spent: the pickle's size, the number of
opcodes run (:data:`MAX_OPS`, so a pickle of any size is read or refused in
seconds), the memo, the stack and every container's length are checked, and
containers nest at most :data:`MAX_NESTING` deep: a tuple or frozenset is
refused when it is built too deep (so hashing a dict key or a set element
never recurses past the bound), and the finished object is walked once,
without recursion, for lists and dicts that grew deep after they were built.
Nothing recurses on file-controlled depth. Malformed input raises
:class:`~tdz_numba.BadArchiveError`.

Examples
--------
>>> import pickle
>>> from tdz_numba.formats.pickle_vm import load
>>> load(pickle.dumps({"a": [1, 2.5, None], "b": (True, "x")}, protocol=2), lambda pid: None)
{'a': [1, 2.5, None], 'b': (True, 'x')}
>>> import os
>>> load(pickle.dumps(os.system, protocol=2), lambda pid: None)
Traceback (most recent call last):
...
tdz_numba.errors.UnsafeContentError: <pickle>: the pickle names posix.system, which is not tensor data; refusing to run it (only torch tensor/storage reconstruction, containers and scalars are read)
"""

from __future__ import annotations

import struct
from collections import OrderedDict
from collections.abc import Callable
from itertools import chain
from typing import Any

from ..errors import BadArchiveError, TdzError, UnsafeContentError, UnsupportedError
from ._common import no_gc
from .pickle_ops import GLOBALS, StorageType, TensorRef, _Fn, _Storage, _tensor, call, lookup, short

__all__ = [
    "load",
    "load_at",
    "TensorRef",
    "StorageType",
    "MAX_PICKLE_BYTES",
    "MAX_OPS",
    "MAX_MEMO",
    "MAX_STACK",
    "MAX_ITEMS",
    "MAX_NESTING",
    "GLOBALS",
]

#: Largest pickle this VM reads (tensor data lives outside the pickle).
MAX_PICKLE_BYTES = 64 << 20
#: Most opcodes run. ``torch.save`` of a state dict writes about 30 per tensor (so this is over
#: 130,000 tensors); at well under a microsecond each, any pickle is read or refused in seconds.
MAX_OPS = 4 << 20
#: Most memo entries (``torch.save`` stores about 8 per tensor).
MAX_MEMO = 1 << 20
#: Most items on the stack (all frames) and nested MARKs (an empty set, the largest thing one
#: opcode makes, is 216 bytes: so the stack holds less than a quarter of a GiB). Checked at each
#: MARK and every ``_CHUNK`` opcodes, so one frame may pass it by up to ``_CHUNK`` items.
MAX_STACK = 1 << 20
#: Most items in one container.
MAX_ITEMS = 1 << 24
#: Deepest nesting of containers (tuples, lists, dicts, sets) in the object built.
MAX_NESTING = 2000
#: Opcodes run between two checks of the stack's size.
_CHUNK = 1 << 15
#: Longest LONG4 integer, in bytes.
MAX_LONG_BYTES = 1 << 16


# -- the VM ------------------------------------------------------------------------------------------
_MARK = object()
_U = struct.Struct("<I").unpack_from
_I = struct.Struct("<i").unpack_from
_H = struct.Struct("<H").unpack_from
_Q = struct.Struct("<Q").unpack_from
_D = struct.Struct(">d").unpack_from


def _name(op: int) -> str:
    import pickletools

    for o in pickletools.opcodes:
        if ord(o.code) == op:
            return o.name
    return f"0x{op:02x}"


def load(data: bytes, persistent_load: Callable[[Any], Any], where: str = "<pickle>") -> Any:
    """The object a pickle describes, built only from allowed parts (see :func:`load_at`)."""
    return load_at(data, persistent_load, where)[0]


def load_at(
    data: bytes, persistent_load: Callable[[Any], Any], where: str = "<pickle>", start: int = 0
) -> tuple[Any, int]:
    """The object of the pickle that starts at byte ``start`` of ``data``, and where it ends.

    Parameters
    ----------
    data : bytes
        The pickle (or several in a row, as in a legacy ``torch.save`` file).
    persistent_load : callable
        Called with each persistent id (a tuple of plain values); its result
        stands for the storage (``_rebuild_*`` receive ``(result, StorageType)``).
    where : str
        Prefix of error messages.
    start : int
        Where the pickle starts.

    Returns
    -------
    tuple
        The object and the offset just past the pickle's STOP.

    Raises
    ------
    UnsafeContentError
        A global outside the allowlist.
    UnsupportedError
        The text opcodes of protocol 0, out-of-band buffers,
        extension codes, tensor kinds that are not read.
    BadArchiveError
        Truncated or malformed pickles, limits exceeded (:data:`MAX_OPS`,
        :data:`MAX_MEMO`, :data:`MAX_NESTING`, ...), a container that holds itself.
    """
    data = data if type(data) is bytes else bytes(data)
    n = len(data)
    if n > MAX_PICKLE_BYTES:
        raise BadArchiveError(f"{where}: pickle of {n} bytes exceeds the limit of {MAX_PICKLE_BYTES}")
    with no_gc():  # the VM makes many small containers and no garbage: skip the collector's passes
        try:
            root, end = _run(data, n, persistent_load, where, start)
            _check_nesting(root, where)
            return root, end
        except IndexError:
            raise BadArchiveError(
                f"{where}: truncated or malformed pickle (stack underflow or a read past the end)"
            ) from None
        except struct.error:
            raise BadArchiveError(f"{where}: truncated pickle") from None
        except (TypeError, KeyError, AttributeError, ValueError, RecursionError, OverflowError) as exc:
            if isinstance(exc, TdzError):
                raise
            if type(exc) is KeyError:
                raise BadArchiveError(
                    f"{where}: memo key {exc} was never stored (or an unhashable dict key)"
                ) from None
            raise BadArchiveError(f"{where}: malformed pickle: {type(exc).__name__}: {exc}") from None


def _run(  # noqa: C901
    data: bytes, n: int, persistent_load: Callable[[Any], Any], where: str, pos: int
) -> tuple[Any, int]:
    stack: list[Any] = []
    metastack: list[list[Any]] = []
    memo: dict[int, Any] = {}
    below = 0  # items in the frames below the current one

    def text(start: int, length: int) -> str:
        if start + length > n:
            raise BadArchiveError(f"{where}: string of {length} bytes runs past the end of the pickle")
        try:
            return data[start : start + length].decode("utf-8", "surrogatepass")
        except UnicodeDecodeError:
            raise BadArchiveError(f"{where}: string at byte {start} is not UTF-8") from None

    def blob(start: int, length: int) -> bytes:
        if start + length > n:
            raise BadArchiveError(f"{where}: {length} bytes at {start} run past the end of the pickle")
        return data[start : start + length]

    def memo_get(i: int) -> Any:
        try:
            return memo[i]
        except KeyError:
            raise BadArchiveError(f"{where}: memo key {i} was never stored") from None

    def no_mark() -> BadArchiveError:
        return BadArchiveError(f"{where}: an opcode needs a MARK that is not there")

    def line(start: int) -> tuple[str, int]:
        end = data.find(b"\n", start, min(n, start + 4096))
        if end < 0:
            raise BadArchiveError(f"{where}: unterminated GLOBAL name at byte {start}")
        try:
            return data[start:end].decode("ascii"), end + 1
        except UnicodeDecodeError:
            raise BadArchiveError(f"{where}: GLOBAL name at byte {start} is not ASCII") from None

    nest: dict[int, tuple[int, Any]] = {}  # id -> (depth, tuple or frozenset) of those that hold one

    def deep(obj: Any) -> Any:
        """``obj`` (a new tuple or frozenset), its depth checked: hashing it recurses that deep."""
        d = 0
        for x in obj:
            tx = type(x)
            if tx is tuple or tx is frozenset:
                held = nest.get(id(x))
                e = 1 if held is None else held[0]  # the ones not kept hold no tuple
                if e > d:
                    d = e
        if d:
            if d >= MAX_NESTING:
                raise BadArchiveError(f"{where}: tuples or frozensets nested deeper than {MAX_NESTING}")
            nest[id(obj)] = (d + 1, obj)  # kept alive: its id is not reused while the VM runs
        return obj

    rebuild = _tensor
    memo_put = memo.__setitem__  # BINPUT keys are one byte; the wider puts check the size
    push = stack.append
    for _ in range(MAX_OPS // _CHUNK):
        for _ in range(_CHUNK):
            op = data[pos]
            pos += 1
            # the opcodes of a torch state dict first, most frequent first (an if-chain is the dispatch)
            if op == 0x72:  # r LONG_BINPUT
                if len(memo) >= MAX_MEMO:
                    raise BadArchiveError(f"{where}: more than {MAX_MEMO} memo entries")
                memo_put(_U(data, pos)[0], stack[-1])
                pos += 4
            elif op == 0x4B:  # K BININT1
                push(data[pos])
                pos += 1
            elif op == 0x68:  # h BINGET (a miss is a KeyError: load() reports it)
                push(memo[data[pos]])
                pos += 1
            elif op == 0x71:  # q BINPUT
                memo_put(data[pos], stack[-1])
                pos += 1
            elif op == 0x28:  # ( MARK
                below += len(stack)
                metastack.append(stack)
                if below > MAX_STACK or len(metastack) > MAX_STACK:
                    raise BadArchiveError(f"{where}: more than {MAX_STACK} items or marks on the stack")
                stack = []
                push = stack.append
            elif op == 0x74:  # t TUPLE
                if not metastack:
                    raise no_mark()
                items = stack
                stack = metastack.pop()
                below -= len(stack)
                push = stack.append
                push(deep(tuple(items)))
            elif op == 0x86:  # TUPLE2
                b = stack.pop()
                a = stack[-1]
                ta, tb = type(a), type(b)
                flat = ta is not tuple and ta is not frozenset and tb is not tuple and tb is not frozenset
                stack[-1] = (a, b) if flat else deep((a, b))  # deep() of a flat tuple: no-op
            elif op == 0x58:  # X BINUNICODE
                (length,) = _U(data, pos)
                pos += 4
                raw = data[pos : pos + length]
                if len(raw) != length:
                    raise BadArchiveError(
                        f"{where}: string of {length} bytes runs past the end of the pickle"
                    )
                push(raw.decode("utf-8", "surrogatepass"))  # a UnicodeDecodeError is a ValueError: reported
                pos += length
            elif op == 0x52:  # R REDUCE
                args = stack.pop()
                fn = stack[-1]
                if type(fn) is not _Fn:
                    raise BadArchiveError(
                        f"{where}: REDUCE of a {type(fn).__name__}, not an allowed callable"
                    )
                kind = fn.kind
                if kind == "_rebuild_tensor_v2" and type(args) is tuple:  # the common calls, direct
                    stack[-1] = rebuild(args, where)
                elif kind == "ordered_dict" and args == ():
                    stack[-1] = OrderedDict()
                else:
                    value = call(fn, args, where)
                    stack[-1] = deep(value) if type(value) is frozenset else value
            elif op == 0x51:  # Q BINPERSID
                pid = stack[-1]
                if type(pid) is not tuple or len(pid) < 2 or type(pid[1]) is not StorageType:
                    raise BadArchiveError(f"{where}: persistent id {short(pid)} is not a storage id")
                stack[-1] = _Storage(persistent_load(pid), pid[1])
            elif op == 0x89:  # NEWFALSE
                push(False)
            elif op == 0x29:  # ) EMPTY_TUPLE
                push(())
            elif op == 0x85:  # TUPLE1
                a = stack[-1]
                ta = type(a)
                stack[-1] = (a,) if ta is not tuple and ta is not frozenset else deep((a,))
            elif op == 0x8C:  # SHORT_BINUNICODE
                length = data[pos]
                push(text(pos + 1, length))
                pos += 1 + length
            elif op < 0x5E:  # the rest, split in two: no opcode waits behind more than ~25 tests
                if op == 0x4E:  # N NONE
                    push(None)
                elif op == 0x5D:  # ] EMPTY_LIST
                    push([])
                elif op == 0x4A:  # J BININT
                    push(_I(data, pos)[0])
                    pos += 4
                elif op == 0x4D:  # M BININT2
                    push(_H(data, pos)[0])
                    pos += 2
                elif op == 0x47:  # G BINFLOAT
                    push(_D(data, pos)[0])
                    pos += 8
                elif op == 0x2E:  # . STOP
                    if len(stack) != 1 or metastack:
                        raise BadArchiveError(f"{where}: STOP with {len(stack)} items on the stack")
                    return stack[0], pos
                elif op == 0x30:  # 0 POP
                    if stack:
                        stack.pop()
                    elif metastack:
                        stack = metastack.pop()
                        below -= len(stack)
                        push = stack.append
                    else:
                        raise BadArchiveError(f"{where}: POP on an empty stack")
                elif op == 0x31:  # 1 POP_MARK
                    if not metastack:
                        raise no_mark()
                    stack = metastack.pop()
                    below -= len(stack)
                    push = stack.append
                elif op == 0x32:  # 2 DUP
                    push(stack[-1])
                elif (
                    op == 0x42 or op == 0x43 or op == 0x8E or op == 0x96
                ):  # BINBYTES, SHORT_BINBYTES, BINBYTES8, BYTEARRAY8
                    if op == 0x43:
                        length, skip = data[pos], 1
                    elif op == 0x42:
                        length, skip = _U(data, pos)[0], 4
                    else:
                        length, skip = _Q(data, pos)[0], 8
                    value = blob(pos + skip, length)
                    push(bytearray(value) if op == 0x96 else value)
                    pos += skip + length
                elif op == 0x54 or op == 0x55:  # BINSTRING, SHORT_BINSTRING (Python 2 str)
                    if op == 0x55:
                        length, skip = data[pos], 1
                    else:
                        length, skip = _I(data, pos)[0], 4
                        if length < 0:
                            raise BadArchiveError(f"{where}: negative BINSTRING length")
                    try:  # torch.load decodes them as UTF-8 (its default encoding)
                        push(blob(pos + skip, length).decode("utf-8"))
                    except UnicodeDecodeError:
                        raise BadArchiveError(
                            f"{where}: Python 2 string at byte {pos - 1} is not UTF-8"
                        ) from None
                    pos += skip + length
                elif op in (0x49, 0x4C, 0x53, 0x56, 0x46, 0x70, 0x67, 0x50):
                    raise UnsupportedError(
                        f"{where}: text opcode {_name(op)} (pickle protocol 0) is not read"
                    )
                else:
                    raise BadArchiveError(f"{where}: unknown pickle opcode 0x{op:02x} at byte {pos - 1}")
            else:
                if op == 0x6C or op == 0x64 or op == 0x65 or op == 0x75 or op == 0x91 or op == 0x90:
                    # l LIST, d DICT, e APPENDS, u SETITEMS, FROZENSET, ADDITEMS: all pop a MARK
                    if not metastack:
                        raise no_mark()
                    items = stack
                    stack = metastack.pop()
                    below -= len(stack)
                    push = stack.append
                    if op == 0x75 or op == 0x64:
                        if len(items) % 2:
                            raise BadArchiveError(f"{where}: odd number of items for a dict")
                        if op == 0x64:
                            target: Any = {}
                            push(target)
                        else:
                            target = stack[-1]
                        if not isinstance(target, dict):
                            raise BadArchiveError(f"{where}: SETITEMS on a {type(target).__name__}")
                        for i in range(0, len(items), 2):
                            target[items[i]] = items[i + 1]
                        if len(target) > MAX_ITEMS:
                            raise BadArchiveError(f"{where}: a dict of more than {MAX_ITEMS} items")
                    elif op == 0x65 or op == 0x6C:
                        if op == 0x6C:
                            target = []
                            push(target)
                        else:
                            target = stack[-1]
                        if type(target) is not list:
                            raise BadArchiveError(f"{where}: APPENDS on a {type(target).__name__}")
                        target.extend(items)
                        if len(target) > MAX_ITEMS:
                            raise BadArchiveError(f"{where}: a list of more than {MAX_ITEMS} items")
                    elif op == 0x91:
                        push(deep(frozenset(items)))
                    else:
                        target = stack[-1]
                        if type(target) is not set:
                            raise BadArchiveError(f"{where}: ADDITEMS on a {type(target).__name__}")
                        target.update(items)
                        if len(target) > MAX_ITEMS:
                            raise BadArchiveError(f"{where}: a set of more than {MAX_ITEMS} items")
                elif op == 0x87:  # TUPLE3
                    c = stack.pop()
                    b = stack.pop()
                    stack[-1] = deep((stack[-1], b, c))
                elif op == 0x88:  # NEWTRUE
                    push(True)
                elif op == 0x7D:  # } EMPTY_DICT
                    push({})
                elif op == 0x8F:  # EMPTY_SET
                    push(set())
                elif op == 0x8A or op == 0x8B:  # LONG1, LONG4
                    if op == 0x8A:
                        length = data[pos]
                        pos += 1
                    else:
                        (length,) = _I(data, pos)
                        pos += 4
                        if length < 0 or length > MAX_LONG_BYTES:
                            raise BadArchiveError(f"{where}: LONG4 of {length} bytes")
                    push(int.from_bytes(blob(pos, length), "little", signed=True))
                    pos += length
                elif op == 0x6A:  # j LONG_BINGET
                    push(memo_get(_U(data, pos)[0]))
                    pos += 4
                elif op == 0x94:  # MEMOIZE
                    if len(memo) >= MAX_MEMO:
                        raise BadArchiveError(f"{where}: more than {MAX_MEMO} memo entries")
                    memo_put(len(memo), stack[-1])
                elif op == 0x73:  # s SETITEM
                    v = stack.pop()
                    k = stack.pop()
                    target = stack[-1]
                    if not isinstance(target, dict):
                        raise BadArchiveError(f"{where}: SETITEM on a {type(target).__name__}")
                    target[k] = v
                    if len(target) > MAX_ITEMS:
                        raise BadArchiveError(f"{where}: a dict of more than {MAX_ITEMS} items")
                elif op == 0x61:  # a APPEND
                    v = stack.pop()
                    target = stack[-1]
                    if type(target) is not list:
                        raise BadArchiveError(f"{where}: APPEND on a {type(target).__name__}")
                    target.append(v)
                    if len(target) > MAX_ITEMS:
                        raise BadArchiveError(f"{where}: a list of more than {MAX_ITEMS} items")
                elif op == 0x63:  # c GLOBAL
                    module, pos = line(pos)
                    name, pos = line(pos)
                    push(lookup(module, name, where))
                elif op == 0x93:  # STACK_GLOBAL
                    name = stack.pop()
                    module = stack.pop()
                    if not isinstance(module, str) or not isinstance(name, str):
                        raise BadArchiveError(f"{where}: STACK_GLOBAL of non-strings")
                    push(lookup(module, name, where))
                elif op == 0x62:  # b BUILD
                    state = stack.pop()
                    inst = stack[-1]
                    if isinstance(inst, dict) and isinstance(state, dict):
                        pass  # an OrderedDict's __dict__ (a state_dict's _metadata): not data
                    elif isinstance(inst, TensorRef) and state is None:
                        pass
                    else:
                        raise UnsupportedError(f"{where}: BUILD of a {type(inst).__name__} is not read")
                elif op == 0x81 or op == 0x92:  # NEWOBJ, NEWOBJ_EX
                    if op == 0x92:
                        kwargs = stack.pop()
                        if kwargs:
                            raise UnsupportedError(f"{where}: NEWOBJ_EX with keyword arguments")
                    args = stack.pop()
                    cls = stack[-1]
                    if not isinstance(cls, _Fn) or cls.kind not in (
                        "ordered_dict",
                        "set",
                        "frozenset",
                        "size",
                    ):
                        raise BadArchiveError(f"{where}: NEWOBJ of {short(cls)}, not an allowed class")
                    value = call(cls, args, where)
                    stack[-1] = deep(value) if type(value) is frozenset else value
                elif op == 0x80:  # PROTO
                    if data[pos] > 5:
                        raise UnsupportedError(f"{where}: pickle protocol {data[pos]} (expected 2 to 5)")
                    pos += 1
                elif op == 0x95:  # FRAME
                    (length,) = _Q(data, pos)
                    pos += 8
                    if pos + length > n:
                        raise BadArchiveError(
                            f"{where}: FRAME of {length} bytes runs past the end of the pickle"
                        )
                elif (
                    op == 0x42 or op == 0x43 or op == 0x8E or op == 0x96
                ):  # BINBYTES, SHORT_BINBYTES, BINBYTES8, BYTEARRAY8
                    if op == 0x43:
                        length, skip = data[pos], 1
                    elif op == 0x42:
                        length, skip = _U(data, pos)[0], 4
                    else:
                        length, skip = _Q(data, pos)[0], 8
                    value = blob(pos + skip, length)
                    push(bytearray(value) if op == 0x96 else value)
                    pos += skip + length
                elif op == 0x8D:  # BINUNICODE8
                    (length,) = _Q(data, pos)
                    push(text(pos + 8, length))
                    pos += 8 + length
                elif op == 0x69 or op == 0x6F:  # INST, OBJ: instantiate a class: never for tensor data
                    if op == 0x69:
                        module, pos = line(pos)
                        name, pos = line(pos)
                        lookup(module, name, where)
                    raise UnsupportedError(f"{where}: INST/OBJ opcodes are not read")
                elif op in (0x82, 0x83, 0x84):  # EXT1/2/4: the copyreg extension registry
                    raise UnsafeContentError(
                        f"{where}: the pickle uses a copyreg extension code, which names a "
                        f"global tdz_numba does not resolve"
                    )
                elif op in (0x97, 0x98):
                    raise UnsupportedError(f"{where}: out-of-band buffers (pickle protocol 5) are not read")
                elif op in (0x49, 0x4C, 0x53, 0x56, 0x46, 0x70, 0x67, 0x50):
                    raise UnsupportedError(
                        f"{where}: text opcode {_name(op)} (pickle protocol 0) is not read"
                    )
                else:
                    raise BadArchiveError(f"{where}: unknown pickle opcode 0x{op:02x} at byte {pos - 1}")
        if below + len(stack) > MAX_STACK:  # pushes that grow one frame: checked once per chunk
            raise BadArchiveError(f"{where}: more than {MAX_STACK} items on the stack")
    raise BadArchiveError(
        f"{where}: more than {MAX_OPS} pickle opcodes (torch.save writes about 30 per tensor); "
        f"refused as a resource limit"
    )


_FLAT = (list, tuple, set, frozenset)


def _check_nesting(root: Any, where: str) -> None:
    """Raises BadArchiveError when containers in ``root`` nest deeper than MAX_NESTING or hold
    themselves. Iterative (post-order, each container visited once)."""
    if type(root) not in _FLAT and not isinstance(root, dict):
        return
    height: dict[int, int] = {}  # id -> height of a finished container
    on_path: set[int] = {id(root)}
    frames: list[list[Any]] = [[root, _children(root), 0]]
    while frames:
        frame = frames[-1]
        for child in frame[1]:
            tc = type(child)
            if tc in _FLAT or tc is dict or tc is OrderedDict:
                cid = id(child)
                h = height.get(cid)
                if h is None:
                    if cid in on_path:
                        raise BadArchiveError(f"{where}: the pickle holds a container that contains itself")
                    if len(frames) >= MAX_NESTING:
                        raise BadArchiveError(f"{where}: containers nested deeper than {MAX_NESTING}")
                    on_path.add(cid)
                    frames.append([child, _children(child), 0])
                    break
                if len(frames) + h > MAX_NESTING:
                    raise BadArchiveError(f"{where}: containers nested deeper than {MAX_NESTING}")
                if h > frame[2]:
                    frame[2] = h
        else:
            frames.pop()
            node = frame[0]
            on_path.discard(id(node))
            h = height[id(node)] = frame[2] + 1
            if frames and h > frames[-1][2]:
                frames[-1][2] = h


def _children(node: Any) -> Any:
    return chain(node.keys(), node.values()) if isinstance(node, dict) else iter(node)
