"""Which format a file is, from its bytes: magic numbers, zip member names, directory contents.

The extension is never trusted on its own. Zip files are told apart by the
names of their members (a top-level ``meta.json``: ``.tdz``; ``<dir>/data.pkl``:
``torch.save``; only ``*.npy`` members: ``.npz``). Other formats are found by a
registry of *sniffers* (small functions of the file's first bytes), so a
reader module adds itself with one call to :func:`register`.

Examples
--------
>>> import tempfile, pathlib, numpy as np
>>> from tdz_numba.formats import detect
>>> with tempfile.TemporaryDirectory() as d:
...     p = pathlib.Path(d) / "x.bin"        # the extension says nothing
...     np.save(open(p, "wb"), np.zeros(3))
...     print(detect(p))
npy
"""

from __future__ import annotations

import importlib
import json
import os
import stat
import struct
import sys
from collections.abc import Callable
from itertools import compress, repeat
from pathlib import Path
from typing import Any, NamedTuple

from ..errors import BadArchiveError, UnsupportedError
from ..zipfmt.index import ArchiveIndex

__all__ = [
    "FORMATS",
    "Format",
    "register",
    "detect",
    "sniff",
    "opener",
    "HEAD_BYTES",
    "TORCH_LEGACY_MAGIC",
    "zip_kind",
    "torch_pickles",
    "all_end_with",
]

#: How many leading bytes a sniffer sees.
HEAD_BYTES = 4096
#: What a legacy (non-zip) ``torch.save`` file starts with: PROTO 2, LONG1 of the magic number.
TORCH_LEGACY_MAGIC = b"\x80\x02\x8a\x0al\xfc\x9cF\xf9 j\xa8P\x19"
_ZIP_MAGICS = (b"PK\x03\x04", b"PK\x05\x06")
_NPY_MAGIC = b"\x93NUMPY"
_NONBLOCK = getattr(os, "O_NONBLOCK", 0)


class Format(NamedTuple):
    """A registered format: ``sniff(path, head, size) -> bool`` on a regular file's first
    :data:`HEAD_BYTES` bytes; ``opener`` is ``"module:function"`` (imported on use) or the function,
    called as ``function(path, **options) -> sources.Source``; lower ``order`` is tried first."""

    name: str
    sniff: Callable[[Path, bytes, int], bool]
    opener: str | Callable[..., Any]
    order: int = 50


#: Registered non-zip formats, by name (zips are told apart by :func:`zip_kind`).
FORMATS: dict[str, Format] = {}
#: Openers of the zip and directory formats.
_BUILTIN_OPENERS = {
    "torch": "tdz_numba.formats.torch_pt:open_torch",
    "npz": "tdz_numba.formats.numpy_fmt:open_npz",
    "memmap_dir": "tdz_numba.formats.memmap_dir:open_memmap_dir",
    "safetensors_index": "tdz_numba.formats.safetensors:open_sharded",
}


def register(
    name: str, sniff: Callable[[Path, bytes, int], bool], opener: str | Callable[..., Any], *, order: int = 50
) -> None:
    """Adds (or replaces) a format: ``register("gguf", lambda p, head, size: head[:4] == b"GGUF",
    "tdz_numba.formats.gguf:open_gguf")``."""
    FORMATS[name] = Format(name, sniff, opener, order)


def opener(name: str) -> Callable[..., Any]:
    """The function that opens format ``name`` (its module imported now)."""
    target = FORMATS[name].opener if name in FORMATS else _BUILTIN_OPENERS[name]
    if callable(target):
        return target
    module, _, func = target.partition(":")
    found = sys.modules.get(module)  # (imported already: no importlib frames, ~5 us of a cold open)
    return getattr(found if found is not None else importlib.import_module(module), func)


# -- sniffers ------------------------------------------------------------------------------------
def _is_safetensors(path: Path, head: bytes, size: int) -> bool:
    if len(head) < 10:
        return False
    (n,) = struct.unpack_from("<Q", head)
    # a header too long for the file is still claimed: the reader names the problem
    return 2 <= n <= 100_000_000 and head[8:9] == b"{"


def _is_npy(path: Path, head: bytes, size: int) -> bool:
    return head.startswith(_NPY_MAGIC)


def _is_torch_legacy(path: Path, head: bytes, size: int) -> bool:
    return head.startswith(TORCH_LEGACY_MAGIC)


def _is_safetensors_index(path: Path, head: bytes, size: int) -> bool:
    if not head.lstrip()[:1] == b"{" or size > 64 << 20:
        return False
    return b'"weight_map"' in (head if size <= len(head) else path.read_bytes())


register("npy", _is_npy, "tdz_numba.formats.numpy_fmt:open_npy", order=10)
register("safetensors", _is_safetensors, "tdz_numba.formats.safetensors:open_safetensors", order=20)
register("torch_legacy", _is_torch_legacy, "tdz_numba.formats.torch_pt:open_torch_legacy", order=30)
register("safetensors_index", _is_safetensors_index, "tdz_numba.formats.safetensors:open_sharded", order=90)


def _is_gguf(path: Path, head: bytes, size: int) -> bool:
    return head[:4] == b"GGUF"


def _is_hdf5(path: Path, head: bytes, size: int) -> bool:  # signature at 0, 512, 1024, ... (user block)
    from .hdf5 import detect_hdf5

    return detect_hdf5(head, path)


def _is_onnx(path: Path, head: bytes, size: int) -> bool:  # a cheap ModelProto check; the opener parses
    from .onnx import detect_onnx

    return detect_onnx(head, path)


register("gguf", _is_gguf, "tdz_numba.formats.gguf:open_gguf", order=15)
register("hdf5", _is_hdf5, "tdz_numba.formats.hdf5:open_hdf5", order=40)
register("onnx", _is_onnx, "tdz_numba.formats.onnx:open_onnx", order=80)


# -- zips ------------------------------------------------------------------------------------------
def _joined(names: list[str]) -> str | None:
    """The names joined by newlines, each followed by one, when no name holds a newline (None
    then): one string that C-level ``find``/``count`` search instead of a method call per name
    (a zip of 20,000 members: ~0.4 ms against ~5 ms for a ``str.endswith`` pass, measured)."""
    text = "\n".join(names)
    if text.count("\n") != max(0, len(names) - 1):
        return None
    return text + "\n" if names else ""


def torch_pickles(names: list[str]) -> list[str]:
    """The members named ``<dir>/data.pkl`` (exactly one ``/``), in order: a ``torch.save``
    archive has one.

    >>> torch_pickles(["m/data.pkl", "m/data/0", "x/y/data.pkl", "n\\n/data.pkl"])
    ['m/data.pkl', 'n\\n/data.pkl']
    """
    text = _joined(names)
    if text is None:  # a name holds a newline: name by name
        ends = map(str.endswith, names, repeat("/data.pkl"))
        return [n for n in compress(names, ends) if n.count("/") == 1]
    out = []
    key = "/data.pkl\n"
    pos = text.find(key)
    while pos >= 0:
        name = text[text.rfind("\n", 0, pos) + 1 : pos + len(key) - 1]
        if name.count("/") == 1:
            out.append(name)
        pos = text.find(key, pos + 1)
    return out


def all_end_with(names: list[str], suffix: str) -> bool:
    """Whether every name ends with ``suffix`` (no newline in it; True for no names).

    >>> all_end_with(["a.npy", "b.npy"], ".npy"), all_end_with(["a.npy", "b.npy.x"], ".npy")
    (True, False)
    """
    text = _joined(names)
    if text is None or "\n" in suffix:
        return all(map(str.endswith, names, repeat(suffix)))
    return text.count(suffix + "\n") == len(names)  # (at most one per name: at its end)


def zip_kind(names: list[str], where: str) -> str:
    """``"tdz"``, ``"torch"`` or ``"npz"`` from a zip's member names.

    Raises :class:`~tdz_numba.UnsupportedError` for a TorchScript archive and
    for a zip that is none of these.
    """
    if "meta.json" in names:
        return "tdz"
    pkl = torch_pickles(names)
    if pkl:
        prefix = pkl[0][: -len("data.pkl")]
        code = prefix + "code/"
        text = _joined(names)
        if text is None:
            has_code = any(map(str.startswith, names, repeat(code)))
        else:
            has_code = text.startswith(code) or "\n" + code in text
        if prefix + "constants.pkl" in names or has_code:
            raise UnsupportedError(
                f"{where}: a TorchScript archive (torch.jit.save): it holds code, not only tensors; "
                f"load it with torch.jit.load, or save its state_dict() with torch.save"
            )
        return "torch"
    if all_end_with(names, ".npy") or any(map(str.endswith, names, repeat(".npy"))):
        return "npz"  # (numpy's NpzFile too reads a zip with other members: they are not arrays)
    raise UnsupportedError(
        f"{where}: a zip archive that is not a tensor file (no meta.json, no <dir>/data.pkl, "
        f"members other than *.npy: {names[:3]})"
    )


def _dir_kind(path: Path) -> str:
    if (path / "meta.json").is_file():
        return "memmap_dir"
    indexes = sorted(path.glob("*.safetensors.index.json"))
    if len(indexes) == 1:
        return "safetensors_index"
    if len(indexes) > 1:
        raise UnsupportedError(f"{path}: several *.safetensors.index.json files; open one of them")
    raise UnsupportedError(
        f"{path}: a directory that is neither a tensordict memmap directory (no meta.json) nor a "
        f"sharded safetensors checkpoint (no *.safetensors.index.json)"
    )


def sniff(path: str | os.PathLike) -> tuple[str, Any]:
    """``(format name, context)``: context is the opened ``ArchiveIndex`` of a zip (to reuse),
    else None. Registered formats report their registered name (``"torch_legacy"``,
    ``"safetensors_index"`` included)."""
    p = path if isinstance(path, Path) else Path(path)
    where = str(p)
    try:  # one descriptor for the kind, the size, the first bytes and a zip's mapping
        fd = os.open(where, os.O_RDONLY | _NONBLOCK)  # a FIFO never blocks the open
    except IsADirectoryError:  # pragma: no cover - platforms that refuse to open directories
        return _dir_kind(p), None
    try:
        st = os.fstat(fd)
        if stat.S_ISDIR(st.st_mode):
            return _dir_kind(p), None
        if not stat.S_ISREG(st.st_mode):
            raise UnsupportedError(
                f"{p}: not a regular file (a FIFO, socket or device); tensor files are read from files"
            )
        size = st.st_size
        head = os.pread(fd, HEAD_BYTES, 0)  # (a zip's index maps the file when it needs to)
        if not head:
            raise BadArchiveError(f"{p}: empty file, not a tensor file")
        if head[:4] in _ZIP_MAGICS:
            taken, fd = fd, -1  # the index owns the descriptor now (keeps it, or closes it)
            index = ArchiveIndex(p, fd=taken, st=st, head=head, take_fd=True)
            try:
                names = index.names  # (a .tdz: its meta.json named without the zip_kind call)
                return ("tdz" if "meta.json" in names else zip_kind(names, where)), index
            except BaseException:
                index.close()
                raise
    finally:
        if fd >= 0:
            os.close(fd)
    for fmt in _in_order():
        try:
            hit = fmt.sniff(p, head, size)
        except (OSError, ValueError, struct.error):
            hit = False
        if hit:
            return fmt.name, None
    raise UnsupportedError(
        f"{p}: unknown file format (first bytes {head[:16]!r}); tdz_numba reads .tdz, safetensors, "
        f"torch.save (.pt), .npy/.npz, GGUF, HDF5, ONNX files and tensordict memmap directories"
    )


#: ``(FORMATS' values, them sorted by order)`` as last sorted (a sort per sniff: ~2 us).
_ORDERED: tuple[list[Format], list[Format]] = ([], [])


def _in_order() -> list[Format]:
    """The registered formats, lowest ``order`` first (sorted again when :data:`FORMATS` changed)."""
    global _ORDERED
    now = list(FORMATS.values())
    if now != _ORDERED[0]:
        _ORDERED = (now, sorted(now, key=lambda f: f.order))
    return _ORDERED[1]


_PUBLIC = {"torch_legacy": "torch", "safetensors_index": "safetensors"}


def detect(path: str | os.PathLike) -> str:
    """The format of ``path`` from its bytes.

    Returns one of ``"tdz"``, ``"safetensors"``, ``"torch"``, ``"npz"``, ``"npy"``,
    ``"gguf"``, ``"hdf5"``, ``"onnx"``, ``"memmap_dir"``.

    Raises
    ------
    UnsupportedError
        Unknown formats, TorchScript archives, zips of other content.
    BadArchiveError
        A malformed zip.
    """
    name, ctx = sniff(path)
    if ctx is not None:
        ctx.close()
    return _PUBLIC.get(name, name)


def read_json_file(path: Path, limit: int = 64 << 20) -> Any:
    """A small JSON file parsed, duplicate keys refused (BadArchiveError on any problem)."""
    size = path.stat().st_size
    if size > limit:
        raise BadArchiveError(f"{path}: {size} bytes, more than the {limit} a JSON index may have")
    try:
        return json.loads(path.read_bytes().decode("utf-8"), object_pairs_hook=_no_duplicates)
    except (UnicodeDecodeError, ValueError, RecursionError) as exc:
        raise BadArchiveError(f"{path}: not valid JSON: {exc}") from None


def _no_duplicates(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    out = dict(pairs)
    if len(out) != len(pairs):
        seen: set[str] = set()
        dup = next(k for k, _ in pairs if k in seen or seen.add(k))  # type: ignore[func-returns-value]
        raise BadArchiveError(f"key {dup!r} appears twice in a JSON object")
    return out
