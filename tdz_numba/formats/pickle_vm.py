"""A restricted pickle VM for ``torch.save`` files: it interprets opcodes and runs nothing.

Python's unpickler imports every global a pickle names and calls it. This VM
does neither: it interprets the opcodes of protocols 2-5 itself, and a global
is looked up in a fixed table of what ``torch.save`` writes for tensors and
containers (the tensor and parameter rebuild functions, the typed and untyped
storage classes, ``collections.OrderedDict``, ``torch.Size``,
``torch.device``, the dtypes, ``set``/``frozenset`` and the ``_codecs.encode``
that protocol 2 uses for bytes). Any other global raises
:class:`~tdz_numba.UnsafeContentError` naming it, before anything else
happens. Tensors come back as :class:`TensorRef` descriptions (storage,
offset, shape, strides), never as tensors: the caller maps them.

Resources are bounded: the pickle's size, the memo, the stack and every
container's length are checked, and nothing recurses on file-controlled depth.
Malformed input raises :class:`~tdz_numba.BadArchiveError`.

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

import gc
import struct
from collections import OrderedDict
from collections.abc import Callable
from typing import Any, NamedTuple

import torch

from ..errors import BadArchiveError, TdzError, UnsafeContentError, UnsupportedError
from ..tdz.dtypes import dtype_table

__all__ = [
    "load",
    "TensorRef",
    "StorageType",
    "MAX_PICKLE_BYTES",
    "MAX_MEMO",
    "MAX_STACK",
    "MAX_ITEMS",
    "GLOBALS",
]

#: Largest pickle this VM reads (tensor data lives outside the pickle). Every opcode pushes at
#: most one item, so this also bounds the stack between MARKs.
MAX_PICKLE_BYTES = 64 << 20
#: Most memo entries.
MAX_MEMO = 1 << 22
#: Most items on the stack (all frames) and nested MARKs.
MAX_STACK = 1 << 22
#: Most items in one container.
MAX_ITEMS = 1 << 24
#: Longest LONG4 integer, in bytes.
MAX_LONG_BYTES = 1 << 16


class StorageType(NamedTuple):
    """A storage class named by the pickle: its element dtype (uint8 for untyped storage)."""

    name: str
    dtype: torch.dtype
    untyped: bool


class TensorRef:
    """A tensor the pickle rebuilds: ``storage`` is what ``persistent_load`` returned."""

    __slots__ = ("storage", "offset", "shape", "stride", "dtype", "requires_grad", "parameter")

    def __init__(
        self,
        storage: Any,
        offset: int,
        shape: tuple[int, ...],
        stride: tuple[int, ...],
        dtype: torch.dtype,
        requires_grad: bool,
        parameter: bool = False,
    ) -> None:
        self.storage = storage
        self.offset = offset
        self.shape = shape
        self.stride = stride
        self.dtype = dtype
        self.requires_grad = requires_grad
        self.parameter = parameter

    def __repr__(self) -> str:
        kind = "Parameter" if self.parameter else "Tensor"
        return f"{kind}Ref({self.dtype}, shape={list(self.shape)}, stride={list(self.stride)}, offset={self.offset})"


class _Fn(NamedTuple):
    """An allowed callable global: ``kind`` selects our own handler."""

    name: str
    kind: str


# -- the allowlist ---------------------------------------------------------------------------------
_DTYPES = {str(v)[len("torch.") :]: v for v in dtype_table().values()}
_STORAGES = {
    "DoubleStorage": torch.float64,
    "FloatStorage": torch.float32,
    "HalfStorage": torch.float16,
    "LongStorage": torch.int64,
    "IntStorage": torch.int32,
    "ShortStorage": torch.int16,
    "CharStorage": torch.int8,
    "ByteStorage": torch.uint8,
    "BoolStorage": torch.bool,
    "BFloat16Storage": torch.bfloat16,
    "ComplexDoubleStorage": torch.complex128,
    "ComplexFloatStorage": torch.complex64,
}
#: (module, name) -> what it stands for: a dtype, a StorageType or an _Fn.
GLOBALS: dict[tuple[str, str], Any] = {}
for _n, _dt in _STORAGES.items():
    GLOBALS[("torch", _n)] = StorageType(_n, _dt, False)
for _mod in ("torch", "torch.storage"):
    GLOBALS[(_mod, "UntypedStorage")] = StorageType("UntypedStorage", torch.uint8, True)
    GLOBALS[(_mod, "TypedStorage")] = StorageType("TypedStorage", torch.uint8, True)
for _n, _dt in _DTYPES.items():
    GLOBALS[("torch", _n)] = _dt
for _n in (
    "_rebuild_tensor",
    "_rebuild_tensor_v2",
    "_rebuild_tensor_v3",
    "_rebuild_parameter",
    "_rebuild_parameter_with_state",
):
    GLOBALS[("torch._utils", _n)] = _Fn(f"torch._utils.{_n}", _n)
GLOBALS[("torch._tensor", "_rebuild_from_type_v2")] = _Fn("torch._tensor._rebuild_from_type_v2", "from_type")
GLOBALS[("torch._tensor", "Tensor")] = GLOBALS[("torch", "Tensor")] = _Fn("torch.Tensor", "tensor_type")
GLOBALS[("torch.nn.parameter", "Parameter")] = _Fn("torch.nn.parameter.Parameter", "parameter_type")
GLOBALS[("collections", "OrderedDict")] = _Fn("collections.OrderedDict", "ordered_dict")
GLOBALS[("torch", "Size")] = _Fn("torch.Size", "size")
GLOBALS[("torch", "device")] = _Fn("torch.device", "device")
for _mod in ("builtins", "__builtin__"):
    GLOBALS[(_mod, "set")] = _Fn("builtins.set", "set")
    GLOBALS[(_mod, "frozenset")] = _Fn("builtins.frozenset", "frozenset")
    GLOBALS[(_mod, "complex")] = _Fn("builtins.complex", "complex")
GLOBALS[("_codecs", "encode")] = _Fn("_codecs.encode", "encode")
#: torch reconstructions that are safe but not read here (sparse, quantized, nested, ...).
_KNOWN_UNSUPPORTED = {
    "_rebuild_qtensor": "quantized tensors",
    "_rebuild_sparse_tensor": "sparse tensors",
    "_rebuild_nested_tensor": "nested tensors",
    "_rebuild_meta_tensor_no_storage": "meta tensors",
    "_rebuild_wrapper_subclass": "tensor subclasses",
    "_rebuild_device_tensor_from_numpy": "numpy-backed tensors",
    "_rebuild_device_tensor_from_cpu_tensor": "device tensors",
    "_rebuild_xla_tensor": "XLA tensors",
    "_rebuild_mps_tensor": "MPS tensors",
    "_rebuild_sparse_csr_tensor": "sparse tensors",
}
_QUANTIZED_STORAGES = {"QUInt8Storage", "QInt8Storage", "QInt32Storage", "QUInt4x2Storage", "QUInt2x4Storage"}
_LATIN1 = ("latin1", "latin-1", "iso-8859-1", "iso8859-1", "l1")


def _lookup(module: str, name: str, where: str) -> Any:
    value = GLOBALS.get((module, name))
    if value is not None:
        return value
    if module == "torch" and name in _QUANTIZED_STORAGES:
        raise UnsupportedError(
            f"{where}: the pickle holds quantized storage (torch.{name}), which tdz_numba "
            f"does not read; dequantize the tensors first"
        )
    if module == "torch._utils" and name in _KNOWN_UNSUPPORTED:
        raise UnsupportedError(
            f"{where}: the pickle holds {_KNOWN_UNSUPPORTED[name]} (torch._utils.{name}), "
            f"which tdz_numba does not read; convert them to dense tensors first"
        )
    raise UnsafeContentError(
        f"{where}: the pickle names {module}.{name}, which is not tensor data; refusing to run it "
        f"(only torch tensor/storage reconstruction, containers and scalars are read)"
    )


# -- handlers of the allowed callables (our code, never the file's) --------------------------------
def _ints(v: Any, what: str, where: str) -> tuple[int, ...]:
    if not isinstance(v, tuple) or not all(type(x) is int for x in v):
        raise BadArchiveError(f"{where}: {what} must be a tuple of ints, found {_short(v)}")
    return tuple(v)


def _tensor(args: tuple, where: str, dtype: torch.dtype | None = None) -> TensorRef:
    if len(args) < 4:
        raise BadArchiveError(
            f"{where}: a tensor rebuild needs (storage, offset, size, stride), found {len(args)} args"
        )
    storage, offset, size, stride = args[:4]
    if type(storage) is not _Storage:
        raise BadArchiveError(
            f"{where}: a tensor rebuild's storage is {_short(storage)}, not a persistent storage"
        )
    if type(offset) is not int or offset < 0:
        raise BadArchiveError(f"{where}: storage offset {_short(offset)} is not a non-negative int")
    shape = _ints(size, "a tensor's size", where)
    strides = _ints(stride, "a tensor's stride", where)
    if len(strides) != len(shape):
        raise BadArchiveError(f"{where}: stride {list(strides)} does not match size {list(shape)}")
    requires_grad = bool(args[4]) if len(args) > 4 and type(args[4]) is bool else False
    return TensorRef(storage.ref, offset, shape, strides, dtype or storage.type.dtype, requires_grad)


def _call(fn: _Fn, args: Any, where: str) -> Any:
    if not isinstance(args, tuple):
        raise BadArchiveError(f"{where}: REDUCE arguments of {fn.name} are not a tuple")
    kind = fn.kind
    if kind == "_rebuild_tensor_v2" or kind == "_rebuild_tensor":
        return _tensor(args, where)
    if kind == "_rebuild_tensor_v3":
        if len(args) < 7 or not isinstance(args[6], torch.dtype):
            raise BadArchiveError(f"{where}: _rebuild_tensor_v3 needs a dtype as 7th argument")
        return _tensor(args, where, args[6])
    if kind in ("_rebuild_parameter", "_rebuild_parameter_with_state"):
        if len(args) < 2 or not isinstance(args[0], TensorRef):
            raise BadArchiveError(f"{where}: {fn.name} needs a tensor as first argument")
        t = args[0]
        return TensorRef(
            t.storage,
            t.offset,
            t.shape,
            t.stride,
            t.dtype,
            bool(args[1]) if type(args[1]) is bool else False,
            True,
        )
    if kind == "from_type":  # (func, new_type, args, state): plain Tensor/Parameter only
        if len(args) != 4 or not isinstance(args[0], _Fn) or not isinstance(args[1], _Fn):
            raise BadArchiveError(f"{where}: malformed _rebuild_from_type_v2 arguments")
        if args[1].kind not in ("tensor_type", "parameter_type"):
            raise UnsupportedError(f"{where}: tensor subclass {args[1].name} is not read")
        t = _call(args[0], args[2], where)
        if not isinstance(t, TensorRef):
            raise BadArchiveError(f"{where}: _rebuild_from_type_v2 did not rebuild a tensor")
        if args[1].kind == "parameter_type":
            t.parameter = True
        return t
    if kind == "ordered_dict":
        if args == ():
            return OrderedDict()
        if (
            len(args) == 1
            and isinstance(args[0], list)
            and all(isinstance(p, tuple) and len(p) == 2 for p in args[0])
        ):
            try:
                return OrderedDict(args[0])
            except TypeError as exc:
                raise BadArchiveError(f"{where}: OrderedDict: {exc}") from None
        raise BadArchiveError(f"{where}: unexpected OrderedDict arguments")
    if kind == "size":
        if len(args) == 1 and isinstance(args[0], (tuple, list)) and all(type(x) is int for x in args[0]):
            return torch.Size(args[0])
        raise BadArchiveError(f"{where}: torch.Size arguments must be one tuple of ints")
    if kind == "device":
        ok = 1 <= len(args) <= 2 and isinstance(args[0], str) and (len(args) == 1 or type(args[1]) is int)
        if ok and len(args[0]) < 64:
            try:
                return torch.device(*args)
            except (RuntimeError, ValueError) as exc:
                raise BadArchiveError(f"{where}: bad torch.device({_short(args[0])}): {exc}") from None
        raise BadArchiveError(f"{where}: torch.device arguments must be (str[, int])")
    if kind in ("set", "frozenset"):
        items = args[0] if args else ()
        if len(args) > 1 or not isinstance(items, (list, tuple)):
            raise BadArchiveError(f"{where}: {fn.name} needs one list")
        try:
            return set(items) if kind == "set" else frozenset(items)
        except TypeError as exc:
            raise BadArchiveError(f"{where}: {fn.name}: {exc}") from None
    if kind == "complex":
        if 1 <= len(args) <= 2 and all(type(x) in (int, float) for x in args):
            return complex(*args)
        raise BadArchiveError(f"{where}: complex() needs numbers")
    if kind == "encode":  # protocol 2 bytes: _codecs.encode(str, "latin1")
        if (
            len(args) == 2
            and isinstance(args[0], str)
            and isinstance(args[1], str)
            and args[1].lower() in _LATIN1
        ):
            try:
                return args[0].encode("latin-1")
            except UnicodeEncodeError:
                raise BadArchiveError(f"{where}: _codecs.encode of a non-latin-1 string") from None
        raise BadArchiveError(f"{where}: _codecs.encode is only read as (str, 'latin1')")
    raise UnsupportedError(f"{where}: {fn.name} cannot be called with REDUCE here")


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


def _short(v: Any) -> str:
    """A bounded description of a value from the file (never a repr of a container)."""
    if v is None or isinstance(v, (bool, int, float, torch.dtype)):
        return repr(v)[:60]
    if isinstance(v, (str, bytes)):
        return repr(v[:40])
    if isinstance(v, (tuple, list)):
        return f"a {type(v).__name__} of {len(v)} items"
    return f"a {type(v).__name__}"


class _Storage(NamedTuple):
    """What BINPERSID pushes: ``persistent_load``'s result and the storage class named."""

    ref: Any
    type: StorageType


def load(data: bytes, persistent_load: Callable[[Any], Any], where: str = "<pickle>") -> Any:
    """The object a pickle describes, built only from allowed parts.

    Parameters
    ----------
    data : bytes
        The pickle.
    persistent_load : callable
        Called with each persistent id (a tuple of plain values); its result
        stands for the storage (``_rebuild_*`` receive ``(result, StorageType)``).
    where : str
        Prefix of error messages.

    Raises
    ------
    UnsafeContentError
        A global outside the allowlist.
    UnsupportedError
        Opcodes of protocols 0/1 that torch does not write, out-of-band buffers,
        extension codes, tensor kinds that are not read.
    BadArchiveError
        Truncated or malformed pickles, limits exceeded.
    """
    data = bytes(data)
    n = len(data)
    if n > MAX_PICKLE_BYTES:
        raise BadArchiveError(f"{where}: pickle of {n} bytes exceeds the limit of {MAX_PICKLE_BYTES}")
    paused = gc.isenabled()  # the VM makes many small containers and no garbage: skip the collector's passes
    if paused:
        gc.disable()
    try:
        return _run(data, n, persistent_load, where)
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
    finally:
        if paused:
            gc.enable()


def _run(data: bytes, n: int, persistent_load: Callable[[Any], Any], where: str) -> Any:  # noqa: C901
    stack: list[Any] = []
    metastack: list[list[Any]] = []
    memo: dict[int, Any] = {}
    pos = 0
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

    memo_put = memo.__setitem__  # BINPUT keys are one byte; the wider puts check the size
    push = stack.append
    while True:
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
            push(tuple(items))
        elif op == 0x86:  # TUPLE2
            b = stack.pop()
            stack[-1] = (stack[-1], b)
        elif op == 0x58:  # X BINUNICODE
            (length,) = _U(data, pos)
            pos += 4
            raw = data[pos : pos + length]
            if len(raw) != length:
                raise BadArchiveError(f"{where}: string of {length} bytes runs past the end of the pickle")
            push(raw.decode("utf-8", "surrogatepass"))  # a UnicodeDecodeError is a ValueError: reported
            pos += length
        elif op == 0x52:  # R REDUCE
            args = stack.pop()
            fn = stack[-1]
            if type(fn) is not _Fn:
                raise BadArchiveError(f"{where}: REDUCE of a {type(fn).__name__}, not an allowed callable")
            stack[-1] = _call(fn, args, where)
        elif op == 0x51:  # Q BINPERSID
            pid = stack[-1]
            if type(pid) is not tuple or len(pid) < 2 or type(pid[1]) is not StorageType:
                raise BadArchiveError(f"{where}: persistent id {_short(pid)} is not a storage id")
            stack[-1] = _Storage(persistent_load(pid), pid[1])
        elif op == 0x89:  # NEWFALSE
            push(False)
        elif op == 0x29:  # ) EMPTY_TUPLE
            push(())
        elif op == 0x85:  # TUPLE1
            stack[-1] = (stack[-1],)
        elif op == 0x8C:  # SHORT_BINUNICODE
            length = data[pos]
            push(text(pos + 1, length))
            pos += 1 + length
        elif op == 0x6C or op == 0x64 or op == 0x65 or op == 0x75 or op == 0x91 or op == 0x90:
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
                push(frozenset(items))
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
            stack[-1] = (stack[-1], b, c)
        elif op == 0x88:  # NEWTRUE
            push(True)
        elif op == 0x4E:  # N NONE
            push(None)
        elif op == 0x7D:  # } EMPTY_DICT
            push({})
        elif op == 0x5D:  # ] EMPTY_LIST
            push([])
        elif op == 0x8F:  # EMPTY_SET
            push(set())
        elif op == 0x4A:  # J BININT
            push(_I(data, pos)[0])
            pos += 4
        elif op == 0x4D:  # M BININT2
            push(_H(data, pos)[0])
            pos += 2
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
        elif op == 0x47:  # G BINFLOAT
            push(_D(data, pos)[0])
            pos += 8
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
            push(_lookup(module, name, where))
        elif op == 0x93:  # STACK_GLOBAL
            name = stack.pop()
            module = stack.pop()
            if not isinstance(module, str) or not isinstance(name, str):
                raise BadArchiveError(f"{where}: STACK_GLOBAL of non-strings")
            push(_lookup(module, name, where))
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
            if not isinstance(cls, _Fn) or cls.kind not in ("ordered_dict", "set", "frozenset", "size"):
                raise BadArchiveError(f"{where}: NEWOBJ of {_short(cls)}, not an allowed class")
            stack[-1] = _call(cls, args, where)
        elif op == 0x2E:  # . STOP
            if len(stack) != 1 or metastack:
                raise BadArchiveError(f"{where}: STOP with {len(stack)} items on the stack")
            return stack[0]
        elif op == 0x80:  # PROTO
            if data[pos] > 5:
                raise UnsupportedError(f"{where}: pickle protocol {data[pos]} (expected 2 to 5)")
            pos += 1
        elif op == 0x95:  # FRAME
            (length,) = _Q(data, pos)
            pos += 8
            if pos + length > n:
                raise BadArchiveError(f"{where}: FRAME of {length} bytes runs past the end of the pickle")
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
            push(blob(pos + skip, length).decode("latin-1"))
            pos += skip + length
        elif op == 0x8D:  # BINUNICODE8
            (length,) = _Q(data, pos)
            push(text(pos + 8, length))
            pos += 8 + length
        elif op == 0x69 or op == 0x6F:  # INST, OBJ: instantiate a class: never for tensor data
            if op == 0x69:
                module, pos = line(pos)
                name, pos = line(pos)
                _lookup(module, name, where)
            raise UnsupportedError(f"{where}: INST/OBJ opcodes are not read")
        elif op in (0x82, 0x83, 0x84):  # EXT1/2/4: the copyreg extension registry
            raise UnsafeContentError(
                f"{where}: the pickle uses a copyreg extension code, which names a "
                f"global tdz_numba does not resolve"
            )
        elif op in (0x97, 0x98):
            raise UnsupportedError(f"{where}: out-of-band buffers (pickle protocol 5) are not read")
        elif op in (0x49, 0x4C, 0x53, 0x56, 0x46, 0x70, 0x67, 0x50):
            raise UnsupportedError(f"{where}: text opcode {_name(op)} (pickle protocol 0) is not read")
        else:
            raise BadArchiveError(f"{where}: unknown pickle opcode 0x{op:02x} at byte {pos - 1}")
