"""numpy ``.npy`` and ``.npz`` files as zero-copy sources; headers parsed without ``eval``.

A ``.npy`` header (magic, version 1/2/3, length, a Python dict literal with
``descr``, ``fortran_order`` and ``shape``) in numpy's own layout is read by one
regular expression (:func:`canonical_header`), any other with
:func:`ast.literal_eval` on a length-bounded string; then every field's type
is checked; as in numpy, a version 1 or 2 header written by Python 2
(``'shape': (2L,)``) is tokenized and read again without the ``L``
suffixes. ``.npy`` files and STORED ``.npz`` members are mapped zero-copy
(Fortran order as strided views); ``savez_compressed`` members are inflated
on access (CRC checked). Byte-swapped data is copied and swapped on access;
object arrays raise :class:`~tdz_numba.UnsafeContentError`, structured and
string dtypes :class:`~tdz_numba.UnsupportedError`.

Examples
--------
>>> import tempfile, pathlib, numpy as np
>>> from tdz_numba.formats import numpy_fmt, to_tree
>>> with tempfile.TemporaryDirectory() as d:
...     p = pathlib.Path(d) / "x.npz"
...     np.savez(p, a=np.arange(4), b=np.eye(2, order="F"))
...     tree = to_tree(numpy_fmt.open_npz(p))
...     print(tree["a"].tolist(), tree["b"].stride())
[0, 1, 2, 3] (1, 2)
"""

from __future__ import annotations

import ast
import io
import math
import os
import re
import struct
import tokenize
import zlib
from itertools import repeat
from typing import Any, NamedTuple

import numpy as np

from ..errors import BadArchiveError, UnsafeContentError, UnsupportedError
from ..files.scanadvice import header_scan
from ..jit.policy import use_kernels
from ..tdz.dtypes import from_numpy_dtype
from ..tdz.sources import MappedFile, TensorSpec, TreeSource, check_extent
from ..zipfmt.index import ArchiveIndex
from ..zipfmt.records import DEFLATED, STORED
from ._common import as_tensor, no_gc, quote
from ._flat import flat_source, make_specs
from ._shape import check_shape
from .detect import all_end_with

__all__ = [
    "open_npy",
    "open_npz",
    "member_spec",
    "parse_npy_header",
    "canonical_header",
    "NpyHeader",
    "MAX_HEADER",
]

MAGIC = b"\x93NUMPY"
#: Longest header read (numpy itself refuses headers over 10,000 bytes without allow_pickle).
MAX_HEADER = 1 << 16
_MAX_DEFLATE_RATIO = 1032  # deflate's largest expansion


class NpyHeader(NamedTuple):
    """A parsed ``.npy`` header: ``data_offset`` is where the array's bytes start."""

    dtype: np.dtype
    fortran: bool
    shape: tuple[int, ...]
    data_offset: int


def parse_npy_header(head: bytes, where: str) -> NpyHeader:
    """The header at the start of ``head`` (which must hold the whole header)."""
    if len(head) < 10 or not head.startswith(MAGIC):
        raise BadArchiveError(f"{where}: not a .npy file (magic {head[:6]!r})")
    major = head[6]
    if major == 1:
        (hlen,) = struct.unpack_from("<H", head, 8)
        start = 10
    elif major in (2, 3):
        if len(head) < 12:
            raise BadArchiveError(f"{where}: truncated .npy header")
        (hlen,) = struct.unpack_from("<I", head, 8)
        start = 12
    else:
        raise UnsupportedError(f"{where}: .npy format version {major}.{head[7]} (expected 1, 2 or 3)")
    if hlen > MAX_HEADER:
        raise BadArchiveError(f"{where}: .npy header of {hlen} bytes (at most {MAX_HEADER} read)")
    if start + hlen > len(head):
        raise BadArchiveError(f"{where}: .npy header of {hlen} bytes runs past the end of the data")
    raw = head[start : start + hlen]
    try:
        d = _literal(raw.decode("utf-8" if major == 3 else "latin-1"), major)
    except (UnicodeDecodeError, ValueError, SyntaxError, MemoryError, RecursionError, TypeError) as exc:
        raise BadArchiveError(f"{where}: .npy header is not a Python literal: {type(exc).__name__}") from None
    if not isinstance(d, dict) or set(d) != {"descr", "fortran_order", "shape"}:
        raise BadArchiveError(f"{where}: .npy header must be a dict of descr, fortran_order, shape")
    shape, fortran, descr = d["shape"], d["fortran_order"], d["descr"]
    if not isinstance(shape, tuple) or not all(type(s) is int and s >= 0 for s in shape):
        raise BadArchiveError(
            f"{where}: .npy header shape {quote(shape)} is not a tuple of non-negative ints"
        )
    if type(fortran) is not bool:
        raise BadArchiveError(f"{where}: .npy header fortran_order {quote(fortran)} is not a bool")
    if not isinstance(descr, str):
        if isinstance(descr, list):
            raise UnsupportedError(f"{where}: structured dtype (record arrays) are not read")
        raise BadArchiveError(f"{where}: .npy header descr {quote(descr)} is not a dtype string")
    if len(descr) > 64:
        raise BadArchiveError(f"{where}: .npy header descr of {len(descr)} characters")
    try:
        dtype = np.dtype(descr)
    except (TypeError, ValueError, SyntaxError) as exc:
        raise BadArchiveError(f"{where}: .npy header descr {quote(descr)}: {quote(str(exc), 200)}") from None
    if dtype.hasobject:
        raise UnsafeContentError(f"{where}: object array (descr {descr!r}) holds pickles; not read")
    if dtype.fields is not None or dtype.subdtype is not None:
        raise UnsupportedError(f"{where}: structured or sub-array dtype {descr!r} is not read")
    if from_numpy_dtype(dtype.newbyteorder("=")) is None:
        raise UnsupportedError(f"{where}: dtype {descr!r} has no torch equivalent")
    check_shape(shape, None, dtype.itemsize, where)
    return NpyHeader(dtype, fortran, shape, start + hlen)


#: numpy's own header text (``numpy.lib.format``: ``{'descr': '<f4', 'fortran_order': False,
#: 'shape': (2, 3), }`` padded with spaces and a newline), each int at most 18 digits without a
#: leading zero: what :func:`canonical_header` reads without :mod:`ast`.
_CANONICAL = re.compile(
    r"\{'descr': '([^'\\\x00-\x1f\x7f-\x9f]{1,64})', 'fortran_order': (True|False), "
    r"'shape': \(((?:(?:0|[1-9][0-9]{0,17}), )*(?:0|[1-9][0-9]{0,17})|(?:0|[1-9][0-9]{0,17}),|)\), \}"
    r" *\n?"
)


def canonical_header(text: str) -> dict[str, Any] | None:
    """The header dict of a header text in numpy's own layout, read by one regular expression
    (~50 times cheaper than :func:`ast.literal_eval`, which gives the same dict); None for any
    other text (then :func:`_literal` reads it with :func:`ast.literal_eval`).

    >>> canonical_header("{'descr': '<f2', 'fortran_order': False, 'shape': (2048, 8), }   \\n")
    {'descr': '<f2', 'fortran_order': False, 'shape': (2048, 8)}
    >>> canonical_header("{'descr': '<f2', 'fortran_order': False, 'shape': (07,), }") is None
    True
    """
    m = _CANONICAL.fullmatch(text)
    if m is None:
        return None
    descr, fortran, dims = m.groups()
    shape = tuple(map(int, dims.rstrip(",").split(", "))) if dims else ()
    return {"descr": descr, "fortran_order": fortran == "True", "shape": shape}


def _literal(text: str, major: int) -> Any:
    """The header's dict, read with :func:`ast.literal_eval` (never ``eval``).

    As numpy does, a version 1 or 2 header that is not a Python 3 literal gets
    one more try with the Python 2 long suffix dropped from its numbers
    (``(2L, 3L)`` -> ``(2, 3)``): the text is only tokenized, then rejoined.
    """
    found = canonical_header(text)
    if found is not None:
        return found
    try:
        return ast.literal_eval(text)
    except SyntaxError:
        if major > 2:
            raise
    kept: list[tokenize.TokenInfo] = []
    after_number = False
    try:
        for tok in tokenize.generate_tokens(io.StringIO(text).readline):
            if not (after_number and tok.type == tokenize.NAME and tok.string == "L"):
                kept.append(tok)
            after_number = tok.type == tokenize.NUMBER
    except tokenize.TokenError as exc:
        raise SyntaxError(str(exc)) from None
    return ast.literal_eval(tokenize.untokenize(kept))


def _strides(shape: tuple[int, ...], fortran: bool) -> tuple[int, ...] | None:
    if not fortran or len(shape) < 2:
        return None
    out, acc = [], 1
    for d in shape:
        out.append(acc)
        acc *= max(d, 1)
    return tuple(out)


def _swapped_loader(f: MappedFile, offset: int, h: NpyHeader) -> Any:
    def load() -> Any:
        n = math.prod(h.shape) * h.dtype.itemsize
        arr = f.buffer[offset : offset + n].view(h.dtype).astype(h.dtype.newbyteorder("="))
        return as_tensor(arr.reshape(h.shape, order="F" if h.fortran else "C"))

    return load


def _spec(
    key: str, h: NpyHeader, f: MappedFile, file: int, offset: int, avail: int, where: str
) -> TensorSpec:
    dtype = from_numpy_dtype(h.dtype.newbyteorder("="))
    need = math.prod(h.shape) * h.dtype.itemsize
    if avail < need:
        raise BadArchiveError(
            f"{where}: array {quote(key)} ({h.dtype.str}, shape {list(h.shape)}) needs {need} bytes, "
            f"{avail} follow its header"
        )
    loader = None
    if not h.dtype.isnative and h.dtype.itemsize > 1:
        loader = _swapped_loader(f, offset, h)
    spec = TensorSpec(
        key, dtype, h.shape, _strides(h.shape, h.fortran), file, offset, need, h.dtype.str, loader=loader
    )
    if loader is not None:
        check_extent(spec._replace(loader=None), f.size, where)
    check_extent(spec, f.size, where)
    return spec


def open_npy(path: str | os.PathLike, **options: Any) -> TreeSource:
    """A ``.npy`` file as a source with one leaf, key ``"0"`` (zero-copy unless byte-swapped)."""
    f = MappedFile.open(path)
    try:
        where = str(f.path)
        h = parse_npy_header(f.buffer[: MAX_HEADER + 12].tobytes(), where)
        spec = _spec("0", h, f, 0, h.data_offset, f.size - h.data_offset, where)
    except BaseException:
        f.close()
        raise
    return TreeSource("npy", path, {"0": spec}, files=[f], metadata={})


def _inflate_head(raw: np.ndarray, where: str) -> bytes:
    """The first bytes of a deflated member: enough for its .npy header."""
    d = zlib.decompressobj(-15)
    try:
        out = d.decompress(raw[: MAX_HEADER + 64].tobytes(), MAX_HEADER + 12)
    except zlib.error as exc:
        raise BadArchiveError(f"{where}: deflate stream: {exc}") from None
    return out


def _deflated_loader(index: ArchiveIndex, name: str, h: NpyHeader, where: str) -> Any:
    def load() -> Any:
        data = index.read(name)  # inflated in parallel, CRC checked
        n = math.prod(h.shape) * h.dtype.itemsize
        if data.size != h.data_offset + n:
            raise BadArchiveError(
                f"{where}: member {quote(name)} inflates to {data.size} bytes, expected {h.data_offset + n}"
            )
        arr = data[h.data_offset :].view(h.dtype)
        if not h.dtype.isnative:
            arr = arr.astype(h.dtype.newbyteorder("="))
        return as_tensor(arr.reshape(h.shape, order="F" if h.fortran else "C"))

    return load


#: Longest version-1 header the bulk path gathers for every member at once (numpy pads
#: headers to 64 bytes: 118 for a small shape); longer ones take the per-member path.
_BULK_HEADER = 1024


def _headers(
    buf: np.ndarray, po: np.ndarray, size: np.ndarray, n: int
) -> tuple[list[NpyHeader], np.ndarray] | None:
    """The distinct ``.npy`` headers of the members (payload at ``po``, ``size`` bytes) and each
    member's among them, each distinct header parsed once; None where a member is not a
    native-endian version-1 array with a header of at most :data:`_BULK_HEADER` bytes inside the
    file, or a header does not parse. The compiled pass (:func:`.npz_scan.group`) from
    :func:`~tdz_numba.jit.policy.use_kernels`, else gathers in numpy (its twin)."""
    if use_kernels(n):
        from . import npz_scan  # imports Numba

        got = npz_scan.group(buf, po, size, _BULK_HEADER)
        if got is None:
            return None
        which, reps, hlen = got
        starts, ends = po[reps].tolist(), (po[reps] + 10 + hlen[reps]).tolist()
        return _parsed([buf[a:b].tobytes() for a, b in zip(starts, ends)], which)
    if np.any(size < 10) or np.any(po + size > buf.size):
        return None
    heads = buf[po[:, None] + np.arange(10)]
    if not (np.all(heads[:, :6] == np.frombuffer(MAGIC, np.uint8)) and np.all(heads[:, 6] == 1)):
        return None
    hlen = heads[:, 8].astype(np.int64) | (heads[:, 9].astype(np.int64) << 8)
    if np.any(hlen > _BULK_HEADER) or np.any(10 + hlen > size):
        return None
    texts: list[bytes] = []
    which = np.empty(n, np.int64)  # member -> its header in `texts`
    for length in np.unique(hlen).tolist():
        rows = np.flatnonzero(hlen == length)
        step = 10 + length
        block = buf[po[rows, None] + np.arange(step)].tobytes()
        ids: dict[bytes, int] = {}  # each distinct header once (hashing bytes: cheaper than np.unique)
        inverse = [ids.setdefault(block[i : i + step], len(ids)) for i in range(0, len(block), step)]
        which[rows] = np.array(inverse, np.int64) + len(texts)
        texts.extend(ids)
    return _parsed(texts, which)


def _parsed(texts: list[bytes], which: np.ndarray) -> tuple[list[NpyHeader], np.ndarray] | None:
    """Each distinct header text parsed (None: one does not parse, or is byte-swapped)."""
    headers = []
    for text in texts:
        try:
            h = parse_npy_header(text, "")
        except (BadArchiveError, UnsupportedError, UnsafeContentError):
            return None  # the per-member path names the member and the error
        if not h.dtype.isnative and h.dtype.itemsize > 1:
            return None
        headers.append(h)
    return headers, which


#: Most members of an ``.npz`` read one by one (:func:`member_spec`) rather than in bulk: the
#: bulk passes cost ~150 us whatever the count, a member ~20-40 us (1 member: 56 us against 190).
SMALL = 4


def _bulk_npz(index: ArchiveIndex, f: MappedFile, where: str) -> dict[str, TensorSpec] | None:
    """Every member's spec when all are STORED, native-endian version-1 ``.npy`` arrays with
    unique names (``np.savez``'s files): local headers checked in one pass, every member's
    ``.npy`` header gathered into one array, each distinct header parsed once. None when
    anything differs; the per-member path then reads the file (and names any error)."""
    names = index.names
    n = len(names)
    if not n or not all_end_with(names, ".npy"):
        return None
    index.check_all()  # every local header, in one kernel (or twin) pass: payload offsets filled
    if n <= SMALL:  # a few members: read one by one (member_spec), cheaper than the passes below
        return None
    table = index.table
    if not (np.all(table["method"] == STORED) and np.array_equal(table["size"], table["csize"])):
        return None
    size = table["size"]
    po = table["payload_offset"]
    found = _headers(f.buffer, po, size, n)
    if found is None:
        return None
    headers, which = found
    need = np.array([math.prod(h.shape) * h.dtype.itemsize for h in headers], dtype=np.int64)
    data_offset = np.array([h.data_offset for h in headers], dtype=np.int64)
    if np.any(size - data_offset[which] < need[which]):
        return None
    keys = list(map(str.removesuffix, names, repeat(".npy")))  # (every name ends so: checked)
    with no_gc():
        dtypes = [from_numpy_dtype(h.dtype.newbyteorder("=")) for h in headers]
        strides = [_strides(h.shape, h.fortran) for h in headers]
        shapes = [h.shape for h in headers]
        codes = [h.dtype.str for h in headers]
        if len(headers) == 1:  # one dtype and shape (a model's many equal arrays): shared objects
            w = None
            dtype_col, shape_col, code_col = dtypes * n, shapes * n, codes * n
            nbytes = need[:1].tolist() * n
        else:  # per member: C-level lookups in the distinct headers' columns
            w = which.tolist()
            dtype_col, shape_col, code_col = (list(map(c.__getitem__, w)) for c in (dtypes, shapes, codes))
            nbytes = need[which].tolist()
        specs = make_specs(
            keys, dtype_col, shape_col, 0, (po + data_offset[which]).tolist(), nbytes, code_col
        )
        if len(specs) != n:  # two names read as one key (the index refuses repeated names)
            return None
        if any(st is not None for st in strides):  # Fortran order: strided views
            w = which.tolist() if w is None else w
            specs = {k: s._replace(strides=strides[i]) for (k, s), i in zip(specs.items(), w)}
    return specs


def member_spec(index: ArchiveIndex, f: MappedFile, name: str, where: str) -> tuple[str, TensorSpec]:
    """``(key, spec)`` of the ``.npz`` member ``name`` (``<key>.npy``): its local header and
    ``.npy`` header read and checked (a deflated member's header inflated from its first
    bytes). The per-member path of :func:`open_npz`, and what a remote ``.npz`` runs for one
    member when it is first asked for (:mod:`tdz_numba.remote.npz`).

    Examples
    --------
    >>> import tempfile, pathlib, numpy as np
    >>> from tdz_numba.formats.numpy_fmt import member_spec
    >>> from tdz_numba.tdz.sources import MappedFile
    >>> from tdz_numba.zipfmt.index import ArchiveIndex
    >>> with tempfile.TemporaryDirectory() as d:
    ...     p = pathlib.Path(d) / "x.npz"
    ...     np.savez(p, a=np.zeros((2, 3), np.float32))
    ...     key, spec = member_spec(ArchiveIndex(p), MappedFile.open(p), "a.npy", str(p))
    ...     print(key, spec.shape, spec.type_name, spec.nbytes)
    a (2, 3) <f4 24
    """
    if not name.endswith(".npy"):
        raise UnsupportedError(f"{where}: member {quote(name)} is not a .npy array")
    key = name[: -len(".npy")]
    e = index.entry(name)
    what = f"{where}: member {quote(name)}"
    if e.method == STORED:
        if e.size != e.compressed_size:
            raise BadArchiveError(f"{what}: stored with sizes {e.compressed_size} and {e.size}")
        head = index.raw(e)[: MAX_HEADER + 12].tobytes()
        h = parse_npy_header(head, what)
        return key, _spec(key, h, f, 0, e.payload_offset + h.data_offset, e.size - h.data_offset, what)
    if e.method != DEFLATED:
        raise UnsupportedError(f"{what}: compression method {e.method} (numpy writes stored or deflate)")
    h = parse_npy_header(_inflate_head(index.raw(e), what), what)
    need = math.prod(h.shape) * h.dtype.itemsize
    if e.size != h.data_offset + need:
        raise BadArchiveError(f"{what}: holds {e.size} bytes, header and shape say {h.data_offset + need}")
    if e.size > e.compressed_size * _MAX_DEFLATE_RATIO + 4096:
        raise BadArchiveError(f"{what}: {e.compressed_size} deflated bytes cannot inflate to {e.size}")
    dtype = from_numpy_dtype(h.dtype.newbyteorder("="))
    # size: the leaf's own bytes (the member also holds the .npy header); crc: the member's
    return key, TensorSpec(
        key,
        dtype,
        h.shape,
        None,
        0,
        e.payload_offset,
        e.compressed_size,
        h.dtype.str,
        codec="deflate",
        size=need,
        crc=e.crc,
        loader=_deflated_loader(index, name, h, what),
    )


def open_npz(path: str | os.PathLike, *, index: ArchiveIndex | None = None, **options: Any) -> TreeSource:
    """An ``.npz`` file: one leaf per ``<name>.npy`` member, keyed ``<name>``.

    STORED members are zero-copy views; deflated ones (``savez_compressed``)
    are inflated when first read. Members not named ``*.npy`` (a README added to the zip:
    numpy's ``NpzFile`` returns their bytes) are not arrays and not leaves.
    """
    index = ArchiveIndex(path) if index is None else index
    where = str(path)
    try:
        f = MappedFile.of_index(path, index)  # (the mapping the header check reads: faults shared)
    except BaseException:
        index.close()
        raise
    try:
        if f.size != index.size:
            raise BadArchiveError(f"{where}: the file changed while it was opened")
        with header_scan(f) as scan:  # (members far apart: only their .npy headers' pages read)
            scan.decide(f.size / max(1, len(index.names)))  # (no columns built: check_all's own proxy)
            bulk = _bulk_npz(index, f, where)
            tree: dict[str, TensorSpec] = bulk if bulk is not None else {}
            for name in index.names if bulk is None else ():
                if not name.endswith(".npy"):
                    continue  # a member that is not an array (numpy hands out its bytes): not a leaf
                key, spec = member_spec(index, f, name, where)
                if key in tree:
                    raise BadArchiveError(f"{where}: two members named {quote(name)}")
                tree[key] = spec
    except BaseException:
        f.close()
        index.close()
        raise
    src = flat_source("npz", path, tree, files=[f], metadata={})
    src._index = index  # type: ignore[attr-defined]  # deflated members are read through it
    return src
