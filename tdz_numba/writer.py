"""The archive writer: plan every offset, size the file once, copy payloads once.

:func:`write_entries` takes the entry list from :func:`tdz_numba.tree.flatten`
(or from a directory, for :func:`pack`):

1. compress payloads when asked (their stored size must be known to plan);
2. plan the layout of all entries at once (:mod:`tdz_numba.layout`);
3. create a temporary file beside the target, ``ftruncate`` it to its final
   size and map it;
4. copy every payload straight from its source tensor into the mapping, in
   parallel across and within entries, hashing each chunk right after it is
   copied (:func:`~tdz_numba.kernels.copy_crc32_spans`); zero-filled
   payloads (``allocate``) are not written at all, their CRC is computed;
5. write local headers, the central directory and the end records;
6. ``os.replace`` the target, keeping its permissions.

On any error the temporary file is removed and an existing target is intact.

Examples
--------
>>> import tempfile, pathlib, torch, tdz_numba
>>> with tempfile.TemporaryDirectory() as d:
...     p = tdz_numba.save({"a": torch.arange(3)}, pathlib.Path(d) / "x.tdz")
...     print(p.name, tdz_numba.load(p)["a"].tolist())
x.tdz [0, 1, 2]
"""

from __future__ import annotations

import os
import stat
import struct
import tempfile
from concurrent.futures import ThreadPoolExecutor
from collections.abc import Sequence
from pathlib import Path

import numpy as np

from . import codecs, records
from .errors import ArchiveExistsError, BadArchiveError, InvalidTreeError
from .layout import plan
from .tree import Entry
from ._jit import run_parallel

__all__ = ["write_entries", "check_target", "directory_entries"]


def check_target(path: str | os.PathLike, existsok: bool) -> Path:
    """The resolved target file of a save; refuses directories and, unless
    ``existsok``, existing files."""
    path = Path(path)
    if path.is_dir():
        raise ArchiveExistsError(f"cannot write an archive at {path}: it is a directory")
    if path.exists() and not existsok:
        raise ArchiveExistsError(f"{path} already exists; pass existsok=True to overwrite it")
    target = path.resolve()
    if target.exists() and not os.access(target, os.W_OK):
        raise PermissionError(f"cannot overwrite {path}: the file is not writable")
    return target


def _buffer_address(data: bytes | np.ndarray) -> tuple[np.ndarray, int]:
    arr = np.frombuffer(data, dtype=np.uint8) if isinstance(data, (bytes, bytearray)) else data
    return arr, arr.ctypes.data if arr.size else 0


def write_entries(entries: Sequence[Entry], target: Path, *, compression: str | None = None,
                  compresslevel: int | None = None) -> Path:  # fmt: skip
    """Writes ``entries`` as an archive at ``target`` (atomically)."""
    from .kernels import CRC_CHUNK, crc32_spans, crc32_zeros

    method = codecs.method_of(compression)
    n = len(entries)
    methods = np.zeros(n, np.int64)
    stored_size = np.zeros(n, np.int64)
    size = np.zeros(n, np.int64)
    crc = np.zeros(n, np.int64)
    hashed = np.zeros(n, np.bool_)  # CRC already known (compressed entries)
    sources: list[np.ndarray | None] = [None] * n  # what is copied, keeps owners alive
    keep: list[object] = []
    for i, e in enumerate(entries):
        if e.data is not None:
            arr = np.frombuffer(e.data, dtype=np.uint8)
        elif e.zeros:
            arr = None
        else:
            t = e.tensor
            if t is None:
                raise InvalidTreeError(f"{e.name}: entry has no data")  # internal
            keep.append(t)
            arr = _tensor_bytes(t, e.name)
        size[i] = arr.size if arr is not None else e.nbytes
        if method != records.STORED and e.is_payload and size[i] > 0:
            if arr is None:
                arr = np.zeros(int(size[i]), np.uint8)
            from zlib_ng import zlib_ng

            crc[i] = zlib_ng.crc32(arr)
            hashed[i] = True
            methods[i] = method
            arr = np.frombuffer(codecs.compress(arr, method, compresslevel), dtype=np.uint8)
        sources[i] = arr
        stored_size[i] = arr.size if arr is not None else e.nbytes
    aligned = [e.is_payload and methods[i] == records.STORED for i, e in enumerate(entries)]
    p = plan([e.name for e in entries], stored_size, aligned, methods)

    target.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp_name = tempfile.mkstemp(dir=target.parent, prefix=f".{target.name}.", suffix=".tmp")
    tmp = Path(tmp_name)
    try:
        os.ftruncate(fd, p.file_size)
        # CRCs of the payloads run on all cores (nogil kernel, background
        # thread) while this thread writes the file sequentially.
        pending = [i for i in range(n) if sources[i] is not None and sources[i].size and not hashed[i]]
        crc_job = None
        if pending:
            addrs = np.fromiter((sources[i].ctypes.data for i in pending), np.int64, len(pending))
            pool = ThreadPoolExecutor(1)
            crc_job = pool.submit(run_parallel, crc32_spans, addrs, stored_size[pending].copy(), CRC_CHUNK)
            pool.shutdown(wait=False)
        dos = records.dos_datetime()
        segments: list[tuple[int, object]] = []
        for i in range(n):
            head = records.local_header(p.names[i], crc=int(crc[i]), size=int(size[i]),
                                        csize=int(stored_size[i]), method=int(methods[i]), dos=dos,
                                        pad=p.pad_of(i), flags=int(p.flags[i]))  # fmt: skip
            h = int(p.header_offset[i])
            if h + len(head) != int(p.payload_offset[i]):
                raise AssertionError(f"{p.names[i]!r}: local header differs from the layout plan")
            segments.append((h, head))
            if sources[i] is not None and sources[i].size:
                segments.append((h + len(head), sources[i]))
        write_segments(fd, segments)
        if crc_job is not None:
            crc[pending] = crc_job.result()
            for i in pending:  # stamp the CRC into the local header written above
                os.pwrite(fd, struct.pack("<I", int(crc[i])), int(p.header_offset[i]) + 14)
        for i in range(n):
            if sources[i] is None and size[i]:
                crc[i] = crc32_zeros(int(size[i]))
                os.pwrite(fd, struct.pack("<I", int(crc[i])), int(p.header_offset[i]) + 14)
        central = [
            records.central_header(p.names[i], crc=int(crc[i]), size=int(size[i]),
                                   csize=int(stored_size[i]), method=int(methods[i]), dos=dos,
                                   pad=p.pad_of(i), flags=int(p.flags[i]),
                                   header_offset=int(p.header_offset[i]))  # fmt: skip
            for i in range(n)
        ]
        tail = b"".join(central)
        if len(tail) != p.cd_size:
            raise AssertionError("central directory size differs from the layout plan")
        tail += records.end_records(n, p.cd_offset, p.cd_size, p.zip64_end)
        write_segments(fd, [(p.cd_offset, tail)])
        mode = stat.S_IMODE(os.stat(target).st_mode) if target.exists() else _default_mode()
        os.fchmod(fd, mode)
        os.close(fd)
        fd = -1
        os.replace(tmp, target)
    except BaseException:
        if fd >= 0:
            os.close(fd)
        tmp.unlink(missing_ok=True)
        raise
    finally:
        del keep
    return target


_IOV_MAX = 1024


def write_segments(fd: int, segments: list[tuple[int, object]]) -> None:
    """Writes ``(offset, buffer)`` segments, batching contiguous runs into ``pwritev``."""
    i = 0
    while i < len(segments):
        offset = segments[i][0]
        bufs = [memoryview(segments[i][1]).cast("B")]
        end = offset + bufs[0].nbytes
        j = i + 1
        while j < len(segments) and segments[j][0] == end and len(bufs) < _IOV_MAX:
            bufs.append(memoryview(segments[j][1]).cast("B"))
            end += bufs[-1].nbytes
            j += 1
        written = os.pwritev(fd, bufs, offset)
        if written < end - offset:  # short write: finish one buffer at a time
            pos = offset
            for b in bufs:
                if pos + b.nbytes <= offset + written:
                    pos += b.nbytes
                    continue
                skip = max(0, offset + written - pos)
                view = b[skip:]
                at = pos + skip
                while view.nbytes:
                    k = os.pwrite(fd, view, at)
                    view, at = view[k:], at + k
                pos += b.nbytes
        i = j


def _default_mode() -> int:
    umask = os.umask(0)
    os.umask(umask)
    return 0o666 & ~umask


def _tensor_bytes(t, name: str) -> np.ndarray:
    """A flat uint8 numpy view of a contiguous CPU tensor's bytes."""
    import torch

    if isinstance(t, np.ndarray):
        return t.reshape(-1).view(np.uint8)
    if not t.is_contiguous():
        raise InvalidTreeError(f"{name}: internal error: non-contiguous source")
    flat = t.reshape(-1)
    if flat.dtype != torch.uint8:
        flat = flat.view(torch.uint8)
    return flat.numpy()


# ---------------------------------------------------------------------------
# memmap directory -> entries (pack)
# ---------------------------------------------------------------------------
def directory_entries(directory: Path, target: Path) -> list[Entry]:
    """Entries for every file of a memmap directory, in tensordict's order.

    Payload files are memory-mapped, not read: the writer copies from the
    mapping.
    """
    if not (directory / "meta.json").is_file():
        raise BadArchiveError(f"{directory} is not a memmap directory: it has no meta.json")
    root = directory.resolve()
    if target == root or root in target.parents:
        raise BadArchiveError(f"the archive {target} must be outside the directory {directory}")
    out: list[Entry] = []

    def walk(d: Path, prefix: str) -> None:
        items = sorted(os.scandir(d), key=lambda e: e.name)
        files = [e for e in items if e.is_file()]
        dirs = [e for e in items if e.is_dir()]
        for e in sorted(files, key=lambda e: e.name != "meta.json"):
            path = Path(e.path)
            if path.resolve() == target:
                raise BadArchiveError(f"the archive {target} must not be a file of {directory}")
            name = prefix + e.name
            nbytes = e.stat().st_size
            if name.endswith(".memmap") and nbytes:
                arr = np.memmap(path, dtype=np.uint8, mode="r")
                out.append(Entry(name, tensor=arr, nbytes=nbytes))
            else:
                out.append(Entry(name, data=path.read_bytes(), nbytes=nbytes))
        for e in dirs:
            walk(Path(e.path), prefix + e.name + "/")

    walk(directory, "")
    return out
