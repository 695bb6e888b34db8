"""What the restricted pickle VM may build: the allowlist of globals and our handlers for them.

:mod:`.pickle_vm` interprets the opcodes; this module holds what a global may
stand for (:data:`GLOBALS`: the tensor and parameter rebuild functions, the
typed and untyped storage classes, ``collections.OrderedDict``,
``torch.Size``, ``torch.device``, the dtypes, ``set``/``frozenset``,
``complex`` and the ``_codecs.encode`` that protocol 2 uses for bytes) and
:func:`call`, our own code that stands in for calling one of them. Nothing
here imports or calls anything the file names.

A tensor comes back as a :class:`TensorRef` (storage, offset, shape,
strides, and the conjugate / negative bits ``torch.save`` keeps in the
rebuild's metadata argument), never as a tensor.

Examples
--------
>>> from tdz_numba.formats.pickle_ops import GLOBALS, call
>>> size = GLOBALS[("torch", "Size")]
>>> call(size, ((2, 3),), "<pickle>")
torch.Size([2, 3])
"""

from __future__ import annotations

from collections import OrderedDict
from typing import Any, NamedTuple

import torch

from ..errors import BadArchiveError, UnsafeContentError, UnsupportedError
from ..tdz.dtypes import dtype_table

__all__ = ["TensorRef", "StorageType", "GLOBALS", "lookup", "call", "short"]


class StorageType(NamedTuple):
    """A storage class named by the pickle: its element dtype (uint8 for untyped storage)."""

    name: str
    dtype: torch.dtype
    untyped: bool


class TensorRef:
    """A tensor the pickle rebuilds: ``storage`` is what ``persistent_load`` returned.

    ``conj`` and ``neg`` are torch's conjugate and negative bits: the values are
    the conjugate / negation of the stored ones (``x.conj()``, ``torch._neg_view``).
    """

    __slots__ = ("storage", "offset", "shape", "stride", "dtype", "requires_grad", "parameter", "conj", "neg")

    def __init__(
        self,
        storage: Any,
        offset: int,
        shape: tuple[int, ...],
        stride: tuple[int, ...],
        dtype: torch.dtype,
        requires_grad: bool,
        parameter: bool = False,
        conj: bool = False,
        neg: bool = False,
    ) -> None:
        self.storage = storage
        self.offset = offset
        self.shape = shape
        self.stride = stride
        self.dtype = dtype
        self.requires_grad = requires_grad
        self.parameter = parameter
        self.conj = conj
        self.neg = neg

    def __repr__(self) -> str:
        kind = "Parameter" if self.parameter else "Tensor"
        bits = "".join(f", {b}=True" for b in ("conj", "neg") if getattr(self, b))
        return (
            f"{kind}Ref({self.dtype}, shape={list(self.shape)}, stride={list(self.stride)}, "
            f"offset={self.offset}{bits})"
        )


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


def lookup(module: str, name: str, where: str) -> Any:
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
    if module == "torch" and isinstance(vars(torch).get(name), torch.dtype):  # no lazy import
        raise UnsupportedError(
            f"{where}: the pickle holds tensors of dtype torch.{name}, which tdz_numba does not read"
        )
    raise UnsafeContentError(
        f"{where}: the pickle names {module}.{name}, which is not tensor data; refusing to run it "
        f"(only torch tensor/storage reconstruction, containers and scalars are read)"
    )


# -- handlers of the allowed callables (our code, never the file's) --------------------------------
def _ints(v: Any, what: str, where: str) -> tuple[int, ...]:
    if type(v) is tuple and len(v) == 1 and type(v[0]) is int:  # the common case, without a generator
        return v
    if not isinstance(v, tuple) or not all(type(x) is int for x in v):
        raise BadArchiveError(f"{where}: {what} must be a tuple of ints, found {short(v)}")
    return tuple(v)


def _bits(metadata: Any, dtype: torch.dtype, where: str) -> tuple[bool, bool]:
    """The (conj, neg) bits of a rebuild's metadata argument (``torch._utils.set_tensor_metadata``)."""
    if not metadata:  # torch: ``if metadata:`` (None, {} and other false values set nothing)
        return False, False
    if type(metadata) is not dict:
        raise BadArchiveError(f"{where}: a tensor's metadata is {short(metadata)}, not a dict")
    bits = []
    for name in ("conj", "neg"):
        v = metadata.get(name, False)
        if type(v) not in (bool, int):
            raise BadArchiveError(f"{where}: tensor metadata {name!r} is {short(v)}, not a bool")
        bits.append(bool(v))
    conj, neg = bits
    if conj and not dtype.is_complex:
        raise BadArchiveError(f"{where}: the conjugate bit is set on a {dtype} tensor (not complex)")
    if neg and dtype == torch.bool:
        raise BadArchiveError(f"{where}: the negative bit is set on a bool tensor")
    return conj, neg


def _tensor(args: tuple, where: str, dtype: torch.dtype | None = None, meta_at: int = 6) -> TensorRef:
    if len(args) < 4:
        raise BadArchiveError(
            f"{where}: a tensor rebuild needs (storage, offset, size, stride), found {len(args)} args"
        )
    storage, offset, size, stride = args[:4]
    if type(storage) is not _Storage:
        raise BadArchiveError(
            f"{where}: a tensor rebuild's storage is {short(storage)}, not a persistent storage"
        )
    if type(offset) is not int or offset < 0:
        raise BadArchiveError(f"{where}: storage offset {short(offset)} is not a non-negative int")
    shape = _ints(size, "a tensor's size", where)
    strides = _ints(stride, "a tensor's stride", where)
    if len(strides) != len(shape):
        raise BadArchiveError(f"{where}: stride {list(strides)} does not match size {list(shape)}")
    requires_grad = bool(args[4]) if len(args) > 4 and type(args[4]) is bool else False
    dtype = dtype or storage.type.dtype
    conj, neg = _bits(args[meta_at] if len(args) > meta_at else None, dtype, where)
    return TensorRef(storage.ref, offset, shape, strides, dtype, requires_grad, False, conj, neg)


def call(fn: _Fn, args: Any, where: str) -> Any:
    if not isinstance(args, tuple):
        raise BadArchiveError(f"{where}: REDUCE arguments of {fn.name} are not a tuple")
    kind = fn.kind
    if kind == "_rebuild_tensor_v2" or kind == "_rebuild_tensor":
        return _tensor(args, where)
    if kind == "_rebuild_tensor_v3":
        if len(args) < 7 or not isinstance(args[6], torch.dtype):
            raise BadArchiveError(f"{where}: _rebuild_tensor_v3 needs a dtype as 7th argument")
        return _tensor(args, where, args[6], 7)
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
            t.conj,
            t.neg,
        )
    if kind == "from_type":  # (func, new_type, args, state): plain Tensor/Parameter only
        if len(args) != 4 or not isinstance(args[0], _Fn) or not isinstance(args[1], _Fn):
            raise BadArchiveError(f"{where}: malformed _rebuild_from_type_v2 arguments")
        if args[1].kind not in ("tensor_type", "parameter_type"):
            raise UnsupportedError(f"{where}: tensor subclass {args[1].name} is not read")
        t = call(args[0], args[2], where)
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
                raise BadArchiveError(f"{where}: bad torch.device({short(args[0])}): {exc}") from None
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


def short(v: Any) -> str:
    """A bounded description of a value from the file (never a repr of a container)."""
    if isinstance(v, int) and v.bit_length() > 64:
        return f"an int of {v.bit_length()} bits"
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
