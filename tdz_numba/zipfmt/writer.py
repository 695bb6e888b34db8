"""The archive writer: plan every offset, size the file once, copy payloads once.

:func:`write_entries` takes the entry list from :func:`tdz_numba.tdz.tree.flatten`
(or from a directory, for :func:`pack`):

1. compress payloads when asked (their stored size must be known to plan);
2. plan the layout of all entries at once (:mod:`tdz_numba.zipfmt.layout`);
3. remove the temp files of killed saves (:mod:`tdz_numba.files.tempfiles`), create
   a temporary file beside the target (``.{name}.tdz-tmp.{host}.{pid}.{random}``)
   and ``ftruncate`` it to its final size (``posix_fallocate`` when payloads
   are zeros, for ``allocate``: a full disk fails now, not with SIGBUS later);
4. write the local headers and payloads in units of work taken in file order
   (:func:`tdz_numba.zipfmt.payload.write_payloads`), straight from the source tensors:
   small entries in groups of ~1 MiB, each group with one ``pwritev`` of its headers
   and payloads; large entries in 2 MiB pieces at file offsets that are multiples of
   2 MiB, their headers (CRC of the combined pieces) written last. This thread
   writes while one more computes the CRC-32s (zlib-ng's SIMD CRC, GIL released) a
   few MiB ahead of it, so that the CRC costs the writer nothing on a second core
   (``num_threads=1``: this thread hashes each piece right after writing it; 2 to 4:
   that many threads share the units). All local headers are built at once
   beforehand; each CRC is patched into its header. Zero-filled payloads
   (``allocate``) are never written: the CRC of their zeros is computed arithmetically;
5. write the central directory and the end records;
6. ``fsync`` the file (``durable=True``, the default; the device writes were
   started every 8 MiB during step 4, so this waits for the tail only),
   ``os.replace`` the target, keeping its permissions, and ``fsync`` the directory.

Why not copy into a shared mapping with the CRC fused to the copy? Measured
on the 2,000-leaf / 256 MiB workload: page faults on a fresh mapping make
that ~1.5x slower than ``pwritev`` (the kernel copies into the page cache
without faulting). Buffered writes to one file serialize on its inode lock,
so a second thread hashes instead of writing: the CRC of a piece just written
cost the writing thread ~24 ms per 256 MiB (a 2 MiB piece is read back from L3)
beside a ~52 ms write; on the hashing thread, a few MiB ahead, it also brings the
source into the shared cache for the writer's copy (see
:func:`tdz_numba.zipfmt.payload.write_threads`).

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
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

from ..errors import (
    AccessDeniedError,
    ArchiveExistsError,
    BadArchiveError,
    InternalError,
    InvalidArgumentError,
)
from ..files import tempfiles as _tempfiles
from ..files.paths import as_local_path
from ..files.progress import progress as _progress
from . import compression as codecs
from . import digest as _digests
from . import members, packers, records
from .entry import Entry, Prepared
from .layout import plan
from .payload import write_payloads, write_segments, write_threads

__all__ = [
    "crc_batches",
    "write_entries",
    "check_target",
    "check_write_args",
    "directory_entries",
    "payload_alignments",
    "AUTO_THRESHOLD",
    "AUTO_PAGE",
]


def check_target(path: str | os.PathLike, existsok: bool) -> Path:
    """The resolved target file of a save; refuses URLs and file objects, directories,
    unwritable files or directories and, unless ``existsok``, existing files."""
    path = as_local_path(path)
    if path.is_dir():
        raise ArchiveExistsError(f"cannot write an archive at {path}: it is a directory")
    if path.exists() and not existsok:
        raise ArchiveExistsError(f"{path} already exists; pass existsok=True to overwrite it")
    target = path.resolve()
    if target.exists() and not os.access(target, os.W_OK):
        raise AccessDeniedError(f"cannot overwrite {path}: the file is not writable")
    parent = next((d for d in target.parents if d.exists()), None)
    if parent is not None and not parent.is_dir():
        raise InvalidArgumentError(f"cannot write {path}: {parent} is not a directory")
    if parent is not None and not os.access(parent, os.W_OK | os.X_OK):
        raise AccessDeniedError(f"cannot write {path}: the directory {parent} is not writable")
    return target


def check_write_args(compression: str | None, compresslevel: int | None, num_threads: object) -> None:
    """The checks of ``save``/``pack`` arguments shared by every write path: a known
    compression, a level that it takes (none without compression), a valid thread count.

    Examples
    --------
    >>> check_write_args("deflate", 6, 2)
    >>> check_write_args(None, 6, None)
    Traceback (most recent call last):
    ...
    tdz_numba.errors.InvalidArgumentError: compresslevel 6 given without compression: pass compression="deflate", "bzip2" or "lzma", or no compresslevel
    """
    from ..jit.presets import check_num_threads

    method = codecs.method_of(compression)
    if compresslevel is not None and method == records.STORED:
        raise InvalidArgumentError(
            f"compresslevel {compresslevel!r} given without compression: pass "
            f'compression="deflate", "bzip2" or "lzma", or no compresslevel',
            expected=None,
            found=compresslevel,
        )
    codecs.check_level(method, compresslevel)
    check_num_threads(num_threads)


def prepare(
    entries: Sequence[Entry],
    *,
    compression: str | None = None,
    compresslevel: int | None = None,
    num_threads: int | None = None,
    segment_size: int | None = None,
    align: int | str | None = None,
    align_threshold: int | None = None,
    digest: bool = False,
) -> Prepared:
    """Compresses the payloads (deflate in parallel segments) and plans every offset. With
    ``digest``, the XXH3-128 digests of the payloads (:mod:`tdz_numba.zipfmt.digest`): those of
    compressed and empty ones now, the others marked for the payload writer."""
    method = codecs.method_of(compression)
    n = len(entries)
    hash_now = _digests.hash_function() if digest else None
    if method == records.STORED:  # nothing to compress: whole columns at once
        arrays: list = [None if e.zeros else _byte_array(e.data) for e in entries]
        size = np.fromiter((e.nbytes if a is None else a.size for e, a in zip(entries, arrays)), np.int64, n)
        prep = _planned(
            entries, arrays, size, size.copy(), np.zeros(n, np.int64), [b""] * n, align, align_threshold
        )
        if hash_now is not None:
            prep.digests = [
                None if a is None or not e.is_payload else (hash_now(a) if not a.size else _digests.PENDING)
                for e, a in zip(entries, arrays)
            ]
        return prep
    methods = np.zeros(n, np.int64)
    stored_size = np.zeros(n, np.int64)
    size = np.zeros(n, np.int64)
    crc = np.zeros(n, np.int64)
    hashed = np.zeros(n, np.bool_)  # CRC already known (compressed entries)
    sources: list = [None] * n  # the bytes to write: an array, a list of parts, None for zeros
    more = [b""] * n  # extra blocks before the zip64 one (segment tables)
    to_deflate: list[int] = []
    digests: list | None = [None] * n if hash_now is not None else None
    for i, e in enumerate(entries):
        arr = None if e.zeros else np.frombuffer(e.data, dtype=np.uint8)  # type: ignore[arg-type]
        size[i] = arr.size if arr is not None else e.nbytes
        if digests is not None and arr is not None and e.is_payload:
            digests[i] = hash_now(arr)  # type: ignore[misc]
        if method != records.STORED and e.is_payload and size[i] > 0:
            if arr is None:
                arr = np.zeros(int(size[i]), np.uint8)
            methods[i] = method
            hashed[i] = True
            if method == records.DEFLATED:
                to_deflate.append(i)
            else:  # bzip2 / lzma: the stdlib, serial
                from zlib_ng import zlib_ng

                crc[i] = zlib_ng.crc32(arr)
                arr = np.frombuffer(codecs.compress(arr, method, compresslevel), dtype=np.uint8)
        sources[i] = arr
        stored_size[i] = arr.size if arr is not None else e.nbytes
    if to_deflate:  # every segment of every entry in one parallel kernel call
        seg = {} if segment_size is None else {"segment_size": segment_size}
        for i, d in zip(
            to_deflate,
            members.deflate_many([sources[i] for i in to_deflate], compresslevel, num_threads, **seg),
        ):
            sources[i], stored_size[i], crc[i], more[i] = d.parts, d.csize, d.crc, d.table
    prep = _planned(entries, sources, size, stored_size, methods, more, align, align_threshold)
    prep.crc[:], prep.hashed[:] = crc, hashed
    prep.digests = digests
    return prep


def _byte_array(data: Any) -> np.ndarray:
    """The bytes of an entry as a flat uint8 array (no copy)."""
    if isinstance(data, np.ndarray) and data.dtype == np.uint8 and data.ndim == 1 and data.flags.c_contiguous:
        return data
    return np.frombuffer(data, dtype=np.uint8)


def _planned(
    entries: Sequence[Entry],
    sources: list,
    size: np.ndarray,
    stored_size: np.ndarray,
    methods: np.ndarray,
    more: list,
    align: int | str | None,
    align_threshold: int | None,
) -> Prepared:
    """:class:`Prepared` with the layout planned (CRCs zero, none known yet)."""
    n = len(entries)
    stored_payload = np.fromiter((e.is_payload for e in entries), np.bool_, n) & (methods == records.STORED)
    alignment = payload_alignments(stored_payload, stored_size, align, align_threshold)
    p = plan(
        [e.name for e in entries],
        stored_size,
        alignment,
        methods,
        size=size,
        local_more=[len(m) for m in more],
    )
    return Prepared(
        n, methods, stored_size, size, np.zeros(n, np.int64), np.zeros(n, np.bool_), sources, more, p
    )


def write_entries(
    entries: Sequence[Entry],
    target: Path,
    *,
    compression: str | None = None,
    compresslevel: int | None = None,
    num_threads: int | None = None,
    progress: bool | None = None,
    durable: bool = True,
    reserve: bool = True,
    segment_size: int | None = None,
    align: int | str | None = None,
    align_threshold: int | None = None,
    digest: bool = False,
) -> Path:
    """Writes ``entries`` as an archive at ``target`` (atomically; with ``durable``,
    ``fsync`` of the file before the rename and of the directory after it). Zero
    payloads (``allocate``) are never written; with ``reserve`` their blocks are
    allocated (``fallocate``), so that a full disk fails here, not on a later write.
    ``segment_size``: uncompressed bytes per deflate segment (default
    :data:`tdz_numba.zipfmt.members.SEGMENT_SIZE`). ``align`` and ``align_threshold``: see
    :func:`payload_alignments`. ``digest``: an XXH3-128 digest of every payload in its central
    record, computed as it is written. The caller has checked the arguments (:func:`check_write_args`)."""
    from .kernels.dispatch import crc32_zeros  # the kernel or its twin

    prep = prepare(
        entries,
        compression=compression,
        compresslevel=compresslevel,
        num_threads=num_threads,
        segment_size=segment_size,
        align=align,
        align_threshold=align_threshold,
        digest=digest,
    )
    n, size, crc, sources, p = prep.n, prep.size, prep.crc, prep.sources, prep.plan
    has_data = np.fromiter((s is not None for s in sources), np.bool_, n)
    zero_rows = np.flatnonzero(~has_data & (size > 0)).tolist()

    with _tempfiles.atomic_file(target, durable=durable) as fd:  # atomic: the target or nothing
        if reserve and zero_rows:
            _tempfiles.reserve(fd, p.file_size)  # allocate: room for the zeros, or ENOSPC now
        else:
            os.ftruncate(fd, p.file_size)
        for i in zero_rows:  # zero payloads (allocate): never written, CRC by arithmetic
            crc[i] = crc32_zeros(int(size[i]))
        fields: dict[str, Any] = dict(
            crc=crc,
            size=size,
            csize=prep.stored_size,
            method=prep.methods,
            dos=packers.dos_datetime(),
            pad=p.pad,
            flags=p.flags,
        )
        with _progress(int(prep.stored_size.sum()), f"save {target.name}", enabled=progress) as bar:
            write_payloads(fd, prep, fields, has_data, write_threads(num_threads), bar, durable)
        more = _digests.blocks(prep.digests, n)
        tail = packers.central_directory(
            p.names,
            header_offset=p.header_offset,
            zip64=p.central_zip64,
            more=more,
            **{**fields, "pad": p.central_pad},
        )
        cd_size = p.cd_size + _digests.planned_len(prep.digests)  # (the plan counts no digest block)
        if len(tail) != cd_size:
            raise InternalError(
                f"central directory of {len(tail)} bytes differs from the layout plan ({cd_size})"
            )
        zip64_end = packers.needs_zip64_end(n, p.cd_offset, cd_size) if more else p.zip64_end
        end = packers.end_records(n, p.cd_offset, cd_size, zip64_end)
        write_segments(fd, [(p.cd_offset, tail + end)])
        if p.cd_offset + cd_size + len(end) != p.file_size:
            os.ftruncate(fd, p.cd_offset + cd_size + len(end))
    return target


#: Default ``align_threshold`` of ``align="auto"``: leaves of at least this many bytes
#: start on a :data:`AUTO_PAGE` boundary. At 1 MiB the expected padding (half a 64 KiB
#: page) costs <= 3% of such a leaf and nothing for smaller ones; see the README's
#: alignment table for the measured file sizes.
AUTO_THRESHOLD = 1 << 20
#: The boundary of ``align="auto"``: a multiple of the 4, 16 and 64 KiB page sizes.
AUTO_PAGE = 1 << 16


def payload_alignments(
    stored_payload: np.ndarray, nbytes: np.ndarray, align: int | str | None, threshold: int | None = None
) -> np.ndarray:
    """Payload alignment of every entry for a save's ``align=`` policy.

    * ``None`` or ``64``: every STORED ``*.memmap`` payload on a 64-byte boundary:
      tensordict's bytes (the default);
    * an int (a power of two >= 64, e.g. 4096, 16384, 65536): every such payload
      on that boundary (zTensor's blanket page alignment);
    * ``"auto"``: payloads of at least ``threshold`` bytes (default
      :data:`AUTO_THRESHOLD`) on a :data:`AUTO_PAGE` boundary, so that they are
      page-aligned for 4, 16 and 64 KiB pages and can be mapped and evicted on their
      own; every other payload stays at 64 bytes.

    Other entries (``meta.json``, compressed payloads) get 0: no padding block.

    >>> import numpy as np
    >>> payload_alignments(np.array([False, True, True]), np.array([90, 100, 2 << 20]), "auto").tolist()
    [0, 64, 65536]
    """
    from ..errors import InvalidArgumentError

    if threshold is not None and (
        not isinstance(threshold, int) or isinstance(threshold, bool) or threshold < 0
    ):
        raise InvalidArgumentError(f"align_threshold must be a non-negative int of bytes, got {threshold!r}")
    if align == "auto":
        big = nbytes >= (AUTO_THRESHOLD if threshold is None else threshold)
        return np.where(stored_payload, np.where(big, AUTO_PAGE, records.ALIGNMENT), 0).astype(np.int64)
    if threshold is not None:
        raise InvalidArgumentError("align_threshold applies only to align='auto'")
    if align is None:
        align = records.ALIGNMENT
    if (
        not isinstance(align, int)
        or isinstance(align, bool)
        or align < records.ALIGNMENT
        or align & (align - 1)
        or align > AUTO_PAGE
    ):
        raise InvalidArgumentError(
            f"align must be None, 'auto' or a power of two from {records.ALIGNMENT} to {AUTO_PAGE} "
            f"(e.g. 4096), got {align!r}"
        )
    return np.where(stored_payload, align, 0).astype(np.int64)


#: Bytes of payload hashed per CRC batch before the writer may use the CRCs.
_CRC_BATCH = 16 << 20


def crc_batches(rows: list[int], sizes: np.ndarray) -> list[list[int]]:
    """Consecutive groups of ``rows`` of about ``_CRC_BATCH`` bytes (at most 512 rows)."""
    out: list[list[int]] = []
    cur: list[int] = []
    acc = 0
    for i in rows:
        cur.append(i)
        acc += int(sizes[i])
        if acc >= _CRC_BATCH or len(cur) >= 512:
            out.append(cur)
            cur, acc = [], 0
    if cur:
        out.append(cur)
    return out


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
                out.append(Entry(name, data=arr, nbytes=nbytes))
            else:
                out.append(Entry(name, data=path.read_bytes(), nbytes=nbytes))
        for e in dirs:
            walk(Path(e.path), prefix + e.name + "/")

    walk(directory, "")
    return out
