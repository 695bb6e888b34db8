"""``tdz_numba.convert`` (this module: :mod:`tdz_numba.conversion`): any readable tensor file to ``.tdz``, and ``.tdz`` to ``.safetensors``.

Keys stay as the source names them (flat stays flat; ``nest=`` splits them)
and the source's metadata (safetensors ``__metadata__``, GGUF key/values, ...)
becomes the archive's metadata, so ``load(convert(x, "y.tdz")) == load(x)``.
To ``.tdz``, the source is opened (zero-copy) and a foreign file's leaves go
through the streaming :class:`~tdz_numba.Writer` batch by batch (~64 MiB; big leaves
in pieces), as views of the source's mapping whose pages are dropped once written
(:func:`tdz_numba.conversion_stream.write_streamed`): peak RSS stays bounded whatever the file's size. To ``.safetensors``, nested keys are joined with ``nest``,
non-tensor values go into ``__metadata__`` as JSON, and the payloads are
written with ``pwritev`` straight from the source's mapping; source pages are
dropped from memory after each batch (``MADV_DONTNEED``), so peak RSS stays
bounded on a large source.

Examples
--------
>>> import tempfile, pathlib, torch, tdz_numba
>>> with tempfile.TemporaryDirectory() as d:
...     p = tdz_numba.save({"a": {"w": torch.arange(3.0)}}, pathlib.Path(d) / "x.tdz")
...     out = tdz_numba.convert(p, pathlib.Path(d) / "y.tdz", compression="deflate")
...     with tdz_numba.open(out) as ar:
...         print(ar.format, ar.info("a/w").compression, ar["a/w"].tolist())
tdz deflate [0.0, 1.0, 2.0]
"""

from __future__ import annotations

import json
import os
import sys
import warnings
from pathlib import Path
from typing import Any

import torch

from .errors import InvalidArgumentError, InvalidTreeError, UnsupportedError
from .files.memory import evict_span
from .tdz.gcpause import paused_gc

__all__ = ["convert", "write_safetensors", "jsonable", "tensordict_levels", "TENSORDICT_DTYPES", "WRITES"]

_BATCH = 64 << 20
#: dtypes tensordict 0.15.3 can load from a memmap directory (``tensordict.utils._TORCH_DTYPES``);
#: it raises ``KeyError: 'torch.float8_e4m3fn'`` for the others (float8, float4, ...).
TENSORDICT_DTYPES = frozenset(
    "torch." + n
    for n in (
        "bfloat16 bool complex128 complex32 complex64 float16 float32 float64 int16 int32 int64 int8 "
        "qint32 qint8 quint4x2 quint8 uint8 uint16 uint32 uint64"
    ).split()
)


#: What convert writes, by the destination's suffix (any other suffix is refused).
WRITES = {".tdz": "tdz", "": "tdz", ".safetensors": "safetensors"}


def convert(
    src: str | os.PathLike,
    dst: str | os.PathLike,
    *,
    nest: str | None = None,
    compression: str | None = None,
    progress: bool | None = None,
    digest: bool = False,
) -> Path:
    """Converts any readable tensor file to ``.tdz`` or ``.safetensors``, keys and metadata kept.

    Parameters
    ----------
    src : str or os.PathLike
        A file :func:`open` reads (safetensors, ``.pt``, npz, GGUF, ``.tdz``, ...).
    dst : str or os.PathLike
        The file to write, its format chosen by its suffix: ``.tdz`` (or no suffix) a ``.tdz``
        archive (through the parallel writer; leaves go in as views of the source's mapping),
        ``.safetensors`` a safetensors file. Any other suffix is refused.
    nest : str or None
        To ``.tdz``: None (default) keeps the source's keys as they are (``"0.weight"`` stays
        one key); a separator splits flat names into levels on it. To ``.safetensors``: nested
        keys are joined with it (default ".").
    compression : str, optional
        Codec of the ``.tdz`` payloads (as for :func:`save`).
    progress : bool, optional
        A progress bar on stderr.
    digest : bool
        To ``.tdz``: an XXH3-128 digest of every payload (as :func:`save` stores it).

    Returns
    -------
    pathlib.Path

    Raises
    ------
    InvalidArgumentError
        A destination suffix convert does not write (the message lists what it writes).
    InvalidTreeError
        A leaf the target format cannot hold (e.g. complex32 in safetensors).

    Examples
    --------
    >>> import tempfile, pathlib, torch, tdz_numba
    >>> import json
    >>> with tempfile.TemporaryDirectory() as d:
    ...     p = tdz_numba.save({"a": {"b": torch.ones(2)}, "tag": "x"}, pathlib.Path(d) / "x.tdz")
    ...     st = tdz_numba.convert(p, pathlib.Path(d) / "x.safetensors")
    ...     raw = st.read_bytes()
    ...     header = json.loads(raw[8 : 8 + int.from_bytes(raw[:8], "little")])
    ...     print(header["a.b"]["shape"], header["__metadata__"])
    [2] {'tag': '"x"'}
    """
    from . import api, saving
    from .archive.state import nest_flat

    if nest is not None and (not isinstance(nest, str) or not nest):
        raise InvalidArgumentError(f"nest must be a non-empty str or None, got {nest!r}")
    from .remote.read import is_remote

    remote_dst = is_remote(dst)  # an fsspec URL: saving.save streams the .tdz there
    dst = dst if remote_dst else Path(dst)  # type: ignore[assignment]
    target = _target_format(dst)
    if remote_dst and target == "safetensors":
        raise UnsupportedError(
            f"{dst}: safetensors output goes to a local file; convert to a .tdz URL instead"
        )
    with paused_gc():  # every leaf of the source, then as many entries: no cycles (see save)
        ar = api.open(src)
        try:
            if target == "safetensors":
                return write_safetensors(ar, dst, sep=nest or ".", progress=progress)  # type: ignore[arg-type]
            tree: Any = ar.to_dict()
            if ar.format != "tdz":
                tree = nest_flat(tree, nest) if nest is not None else tensordict_levels(tree)
            _warn_tensordict_dtypes(tree, dst)
            metadata = {str(k): jsonable(v) for k, v in (ar.metadata or {}).items()} or None
            if ar.format != "tdz" and not remote_dst:
                from .conversion_stream import write_streamed

                return write_streamed(
                    ar,
                    tree,
                    Path(dst),
                    compression=compression,
                    progress=progress,
                    metadata=metadata,
                    digest=digest,
                )
            return saving.save(
                tree, dst, compression=compression, progress=progress, metadata=metadata, digest=digest
            )
        finally:
            ar.close()


def tensordict_levels(tree: Any) -> Any:
    """A foreign file's tree with each level's meta cut to what a tensordict meta.json holds
    (a reader's own fields, such as the ``.pt`` reader's ``_torch_type``, are not meta.json
    fields); a level left without a batch ``shape`` becomes a plain dict (saved as a TensorDict).

    Examples
    --------
    >>> from tdz_numba.tdz.tree import Level
    >>> tree = Level({"x": 1}, meta={"shape": [2], "_torch_type": "x"}, keyed=True)
    >>> out = tensordict_levels(tree)
    >>> out.meta, out["x"]
    ({'shape': [2]}, 1)
    """
    from .tdz.tree import RESERVED_FIELDS, Level

    def level(node: Any) -> Any:
        meta = {k: v for k, v in (getattr(node, "meta", None) or {}).items() if k in RESERVED_FIELDS}
        if isinstance(meta.get("shape"), list):
            return Level(meta=meta, keyed=True)
        return {}

    root = level(tree)
    stack = [(tree, root)]
    while stack:  # iterative: no recursion on the file's depth
        src, out = stack.pop()
        for key, value in src.items():
            if isinstance(value, dict):
                sub = out[key] = level(value)
                stack.append((value, sub))
            else:
                out[key] = value
    return root


def _target_format(dst: Any) -> str:
    """``"tdz"`` or ``"safetensors"`` from the destination's suffix; anything else refused."""
    name = str(dst).rstrip("/")
    base = name.rsplit("/", 1)[-1]
    suffix = os.path.splitext(base)[1].lower()
    fmt = WRITES.get(suffix)
    if fmt is None:
        raise InvalidArgumentError(
            f"{name}: convert writes .tdz archives (a .tdz name, or one without a suffix) and "
            f".safetensors files; {suffix!r} names neither (a .tdz under another format's name "
            "would mislead that format's tools)"
        )
    return fmt


def jsonable(value: Any, depth: int = 0) -> Any:
    """A metadata value as JSON can hold it: numpy scalars and arrays as Python numbers and
    lists, tuples as lists, bytes as text (UTF-8, else ``repr``), non-finite floats as their
    names (``"nan"``, ``"inf"``), anything else as its ``repr``."""
    import math

    if depth > 64:
        return repr(value)[:200]
    if value is None or isinstance(value, (bool, int, str)):
        return value
    if isinstance(value, float):
        return value if math.isfinite(value) else repr(value)
    if hasattr(value, "tolist") and type(value).__module__ == "numpy":
        return jsonable(value.tolist(), depth + 1)
    if isinstance(value, (bytes, bytearray, memoryview)):
        try:
            return bytes(value).decode("utf-8")
        except UnicodeDecodeError:
            return repr(bytes(value))
    if isinstance(value, (list, tuple)):
        return [jsonable(v, depth + 1) for v in value]
    if isinstance(value, dict):
        return {str(k): jsonable(v, depth + 1) for k, v in value.items()}
    return repr(value)


def _warn_tensordict_dtypes(tree: Any, dst: Any) -> None:
    """A :class:`UserWarning` naming the leaves whose dtype tensordict 0.15.3 cannot load."""
    bad: dict[str, list[str]] = {}
    stack: list[tuple[str, Any]] = [("", tree)]
    while stack:
        prefix, node = stack.pop()
        for key, value in node.items():
            if isinstance(value, dict):
                stack.append((f"{prefix}{key}/", value))
            elif isinstance(value, torch.Tensor) and str(value.dtype) not in TENSORDICT_DTYPES:
                bad.setdefault(str(value.dtype).removeprefix("torch."), []).append(prefix + str(key))
    if bad:
        keys = sorted(k for ks in bad.values() for k in ks)
        shown = ", ".join(repr(k[:80]) for k in keys[:8]) + (
            f" and {len(keys) - 8} more" if len(keys) > 8 else ""
        )
        warnings.warn(
            f"{dst}: leaves {shown} are {', '.join(sorted(bad))}, which tensordict 0.15.3 cannot load "
            f"(TensorDict.load_memmap raises KeyError); tdz_numba reads them",
            UserWarning,
            stacklevel=_outside_level(),
        )


def _outside_level() -> int:
    """The ``stacklevel`` of the first frame outside this package, seen from the caller."""
    package = os.path.dirname(os.path.abspath(__file__))
    frame: Any = sys._getframe(1)
    level = 1
    while frame is not None and frame.f_code.co_filename.startswith(package):
        frame, level = frame.f_back, level + 1
    return level


def _walk(ar: Any, sep: str) -> tuple[list[tuple[str, Any]], dict[str, str]]:
    """``(joined key, leaf tensor)`` of every tensor leaf, and the non-tensor values as JSON."""
    from .archive.mapping import Archive
    from .tdz.tree import RawFile

    tensors: list[tuple[str, Any]] = []
    values: dict[str, str] = {}
    stack: list[tuple[str, Archive]] = [("", ar)]
    while stack:
        prefix, node = stack.pop()
        for key in node:
            name = prefix + key
            value = node[key]
            if isinstance(value, torch.Tensor):
                tensors.append((name, value))
            elif isinstance(value, Archive):
                stack.append((name + sep, value))
            elif isinstance(value, RawFile):
                continue  # tensordict's pickles and type files: nothing safetensors can hold
            else:
                try:
                    values[name] = json.dumps(value)
                except (TypeError, ValueError):
                    values[name] = json.dumps(repr(value))
    return tensors, values


def write_safetensors(
    ar: Any, dst: str | os.PathLike, *, sep: str = ".", progress: bool | None = None, durable: bool = True
) -> Path:
    """Writes the leaves of an opened file as one ``.safetensors`` file, atomically (the project's
    temp files: :func:`tdz_numba.files.tempfiles.atomic_file`; ``durable``: ``fsync`` as
    :func:`tdz_numba.save`), dtypes named as the safetensors reader names them.

    Raises :class:`~tdz_numba.InvalidTreeError` for a leaf safetensors cannot
    hold (nested, complex, ...) or two leaves joined to the same name.
    """
    from .files import tempfiles as _tempfiles
    from .files.progress import progress as _progress
    from .formats.safetensors import DTYPES
    from .zipfmt.writer import write_segments

    st_names = {dtype: name for name, dtype in DTYPES.items()}  # the reader's table, inverted
    tensors, values = _walk(ar, sep)
    maps = _mapped_ranges(ar.source)
    metadata = {k: (v if isinstance(v, str) else json.dumps(v)) for k, v in (ar.metadata or {}).items()}
    metadata.update(values)
    header: dict[str, Any] = {}
    if metadata:
        header["__metadata__"] = metadata
    offset = 0
    parts = []
    for name, t in sorted(tensors, key=lambda kv: kv[0]):
        if name in header:
            raise InvalidTreeError(f"{ar.path}: two leaves become {name!r} (join separator {sep!r})")
        if t.is_nested or t.layout != torch.strided or t.dtype not in st_names:
            raise InvalidTreeError(
                f"{ar.path}: leaf {name!r} ({t.dtype}{', nested' if t.is_nested else ''}) "
                f"has no safetensors form"
            )
        t = t.contiguous()
        nbytes = t.numel() * t.element_size()
        header[name] = {
            "dtype": st_names[t.dtype],
            "shape": list(t.shape),
            "data_offsets": [offset, offset + nbytes],
        }
        parts.append((offset, t, nbytes))
        offset += nbytes
    head = json.dumps(header, separators=(",", ":")).encode("utf-8")
    head += b" " * (-len(head) % 8)
    base = 8 + len(head)
    dst = Path(dst)
    with _tempfiles.atomic_file(dst, durable=durable) as fd:  # the whole file or nothing
        os.ftruncate(fd, base + offset)
        write_segments(fd, [(0, len(head).to_bytes(8, "little") + head)])
        with _progress(offset, f"convert {dst.name}", enabled=progress) as bar:
            batch: list[tuple[int, Any]] = []
            acc = 0
            for off, t, nbytes in parts:
                if not nbytes:
                    continue
                flat = t.view(-1)
                batch.append(
                    (base + off, (flat.view(torch.uint8) if flat.dtype != torch.uint8 else flat).numpy())
                )
                acc += nbytes
                if acc >= _BATCH:
                    _flush(fd, batch, bar, maps)
                    batch, acc = [], 0
            _flush(fd, batch, bar, maps)
    return dst


def _mapped_ranges(source: Any) -> list[tuple[int, int]]:
    """``(start, stop)`` addresses of the source's file mappings (pages that can be dropped)."""
    bufs = [f.buffer for f in getattr(source, "files", [])]
    index = getattr(source, "index", None)
    if index is not None and index.buffer is not None:
        bufs.append(index.buffer)
    return [(b.ctypes.data, b.ctypes.data + b.size) for b in bufs if b is not None and b.size]


def _flush(fd: int, batch: list[tuple[int, Any]], bar: Any, maps: list[tuple[int, int]]) -> None:
    from .zipfmt.writer import write_segments

    if not batch:
        return
    write_segments(fd, batch)
    bar.update(sum(a.size for _, a in batch))
    for _, a in batch:  # the source's pages just copied: dropped, so memory stays bounded
        evict_span(a.ctypes.data, a.size, maps)
