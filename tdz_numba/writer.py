"""The archive writer: plan every offset, size the file once, copy payloads once.

:func:`write_entries` takes the entry list from :func:`tdz_numba.tree.flatten`
(or from a directory, for :func:`pack`):

1. compress payloads when asked (their stored size must be known to plan);
2. plan the layout of all entries at once (:mod:`tdz_numba.layout`);
3. remove the temp files of killed saves (:mod:`tdz_numba._tempfiles`), create
   a temporary file beside the target (``.{name}.tdz-tmp.{host}.{pid}.{random}``)
   and ``ftruncate`` it to its final size (``posix_fallocate`` when payloads
   are zeros, for ``allocate``: a full disk fails now, not with SIGBUS later);
4. hash the payloads on all cores but one (zlib-ng's SIMD CRC-32 called from
   a ``prange`` kernel, in chunks within and across entries) in a background
   thread, in batches of ~16 MiB, while this thread writes the file in one
   sequential pass of ``pwritev`` calls straight from the source tensors:
   header, payload, header, ...; each batch's local headers are built at
   once (numpy record arrays) as soon as its CRCs are known. Zero-filled
   payloads (``allocate``) are never written: the CRC of their zeros is
   computed arithmetically;
5. write the central directory and the end records;
6. ``fsync`` the file (``durable=True``, the default), ``os.replace`` the
   target, keeping its permissions, and ``fsync`` the directory.

Why not copy into a shared mapping with the CRC fused to the copy? Measured
on the 2,000-leaf / 256 MiB workload: page faults on a fresh mapping make
that ~1.5x slower than ``pwritev`` (the kernel copies into the page cache
without faulting), and parallel writers to one file serialize on the inode
lock. The CRC pass reads the sources once more at ~11 GB/s on two cores.

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
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from . import _tempfiles, codecs, records
from ._paths import as_local_path
from .errors import (
    AccessDeniedError,
    ArchiveExistsError,
    BadArchiveError,
    InternalError,
    InvalidArgumentError,
)
from .layout import plan
from .progress import progress as _progress
from .tree import Entry

__all__ = [
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
    from ._jit import check_num_threads

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


@dataclass
class Prepared:
    """Entries ready to write: payloads compressed, sizes and CRCs known where they can be, the
    layout planned. Shared by the local writer and the streamed (remote) one."""

    n: int
    methods: np.ndarray
    stored_size: np.ndarray
    size: np.ndarray
    crc: np.ndarray
    hashed: np.ndarray  # CRC already known (compressed entries)
    sources: list  # the bytes to write: an array, a list of parts, None for zeros
    more: list  # extra blocks before the zip64 one (segment tables)
    plan: Any


def prepare(
    entries: Sequence[Entry],
    *,
    compression: str | None = None,
    compresslevel: int | None = None,
    num_threads: int | None = None,
    segment_size: int | None = None,
    align: int | str | None = None,
    align_threshold: int | None = None,
) -> Prepared:
    """Compresses the payloads (deflate in parallel segments) and plans every offset."""
    method = codecs.method_of(compression)
    n = len(entries)
    if method == records.STORED:  # nothing to compress: whole columns at once
        arrays: list = [None if e.zeros else _byte_array(e.data) for e in entries]
        size = np.fromiter((e.nbytes if a is None else a.size for e, a in zip(entries, arrays)), np.int64, n)
        return _planned(
            entries, arrays, size, size.copy(), np.zeros(n, np.int64), [b""] * n, align, align_threshold
        )
    methods = np.zeros(n, np.int64)
    stored_size = np.zeros(n, np.int64)
    size = np.zeros(n, np.int64)
    crc = np.zeros(n, np.int64)
    hashed = np.zeros(n, np.bool_)  # CRC already known (compressed entries)
    sources: list = [None] * n  # the bytes to write: an array, a list of parts, None for zeros
    more = [b""] * n  # extra blocks before the zip64 one (segment tables)
    to_deflate: list[int] = []
    for i, e in enumerate(entries):
        arr = None if e.zeros else np.frombuffer(e.data, dtype=np.uint8)  # type: ignore[arg-type]
        size[i] = arr.size if arr is not None else e.nbytes
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
            codecs.deflate_many([sources[i] for i in to_deflate], compresslevel, num_threads, **seg),
        ):
            sources[i], stored_size[i], crc[i], more[i] = d.parts, d.csize, d.crc, d.table
    prep = _planned(entries, sources, size, stored_size, methods, more, align, align_threshold)
    prep.crc[:], prep.hashed[:] = crc, hashed
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
) -> Path:
    """Writes ``entries`` as an archive at ``target`` (atomically; with ``durable``,
    ``fsync`` of the file before the rename and of the directory after it). Zero
    payloads (``allocate``) are never written; with ``reserve`` their blocks are
    allocated (``fallocate``), so that a full disk fails here, not on a later write.
    ``segment_size``: uncompressed bytes per deflate segment (default
    :data:`tdz_numba.codecs.SEGMENT_SIZE`). ``align`` and ``align_threshold``: see
    :func:`payload_alignments`."""
    from .kernel_dispatch import crc32_zeros  # the kernel or its twin

    check_write_args(compression, compresslevel, num_threads)
    prep = prepare(
        entries,
        compression=compression,
        compresslevel=compresslevel,
        num_threads=num_threads,
        segment_size=segment_size,
        align=align,
        align_threshold=align_threshold,
    )
    n, size, crc, sources, p = prep.n, prep.size, prep.crc, prep.sources, prep.plan
    has_data = np.fromiter((s is not None for s in sources), np.bool_, n)
    zero_rows = np.flatnonzero(~has_data & (size > 0)).tolist()

    target.parent.mkdir(parents=True, exist_ok=True)
    _tempfiles.clean(target.parent)  # leftovers of killed saves (dead processes only)
    fd, tmp = _tempfiles.create_temp_file(target.parent, target.name)
    try:
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
            dos=records.dos_datetime(),
            pad=p.pad,
            flags=p.flags,
        )
        with _progress(int(prep.stored_size.sum()), f"save {target.name}", enabled=progress) as bar:
            _write_payloads(fd, prep, fields, has_data, _write_threads(num_threads), bar, durable)
        tail = records.central_directory(
            p.names, header_offset=p.header_offset, zip64=p.central_zip64, **{**fields, "pad": p.central_pad}
        )
        if len(tail) != p.cd_size:
            raise InternalError(
                f"central directory of {len(tail)} bytes differs from the layout plan ({p.cd_size})"
            )
        write_segments(
            fd, [(p.cd_offset, tail + records.end_records(n, p.cd_offset, p.cd_size, p.zip64_end))]
        )
        mode = stat.S_IMODE(os.stat(target).st_mode) if target.exists() else _default_mode()
        os.fchmod(fd, mode)
        if durable:
            os.fsync(fd)
        os.close(fd)
        fd = -1
        os.replace(tmp, target)
        if durable:
            _tempfiles.fsync_directory(target.parent)
    except BaseException:
        if fd >= 0:
            os.close(fd)
        tmp.unlink(missing_ok=True)
        raise
    return target


#: Payload bytes per group of small entries (a unit of work of the writing threads),
#: hashed and then written in one ``pwritev`` by the same thread.
_UNIT = 1 << 20
#: Entries larger than this are cut into pieces of this size, each written and then
#: hashed by one thread while its bytes are still in that core's cache (measured on a
#: 256 MiB save: write -> CRC of 256 KiB pieces costs ~5 ms CPU above the bare writes,
#: CRC -> write of 1 MiB ~20 ms, the CRC's own read of the source).
_PIECE = 1 << 18
#: Entries per group: a group's (header, payload) pairs go in one ``pwritev``.
_UNIT_ROWS = 500
#: Bytes written between two starts of the device writes of a durable save.
_WRITEBACK = 8 << 20


def _crc_functions() -> tuple[Any, Any]:
    """``(crc32, crc32_combine)``: zlib-ng's (SIMD; the GIL released on large buffers),
    the stdlib's CRC-32 with the Numba combine where zlib-ng lacks them."""
    try:
        from zlib_ng import zlib_ng

        crc32 = zlib_ng.crc32
        combine = getattr(zlib_ng, "crc32_combine", None)
    except ImportError:  # pragma: no cover - zlib-ng is a dependency
        import zlib

        crc32, combine = zlib.crc32, None
    if combine is None:  # pragma: no cover - zlib-ng < 0.5

        def combine(a: int, b: int, length: int) -> int:
            from .kernels import crc32_combine

            return int(crc32_combine(a, b, length))

    return crc32, combine


def _plan_units(split: list[bool], stored: list[int]) -> list[tuple[int, int, int]]:
    """Work units in file order: ``(start, stop, -1)``, a group of whole entries
    (at most :data:`_UNIT` bytes or :data:`_UNIT_ROWS` entries), or ``(i, offset,
    length)``, a piece (:data:`_PIECE` bytes) of entry ``i``, that is ``split``."""
    units: list[tuple[int, int, int]] = []
    start = acc = 0
    for i, (big, nbytes) in enumerate(zip(split, stored)):
        if big:
            if start < i:
                units.append((start, i, -1))
            units.extend((i, off, min(_PIECE, nbytes - off)) for off in range(0, nbytes, _PIECE))
            start, acc = i + 1, 0
            continue
        acc += nbytes
        if acc >= _UNIT or i + 1 - start >= _UNIT_ROWS:
            units.append((start, i + 1, -1))
            start, acc = i + 1, 0
    if start < len(stored):
        units.append((start, len(stored), -1))
    return units


def _write_payloads(
    fd: int,
    prep: Prepared,
    fields: dict[str, Any],
    has_data: np.ndarray,
    threads: int,
    bar: Any,
    writeback: bool = False,
) -> None:
    """Writes every local header and payload: units of work (:func:`_plan_units`) taken
    in file order by ``threads`` threads (this one included); each thread computes
    the CRC-32 of its unit's payloads (zlib-ng, GIL released), puts them in their
    local headers (all built at once beforehand, CRC fields patched) and writes the
    unit with one ``pwritev``. The pieces of large entries are written and then hashed
    (still in cache); their headers are written last, once the pieces' CRCs are combined.
    The bytes on disk are those of one sequential pass. With ``writeback`` (durable
    saves) the device writes start every :data:`_WRITEBACK` bytes, so that the final
    ``fsync`` waits for the last ones only."""
    import threading

    crc32, combine = _crc_functions()
    p, n, sources, crc = prep.plan, prep.n, prep.sources, prep.crc
    stored = prep.stored_size
    pending = ~prep.hashed & has_data & (stored > 0)
    pend, split = pending.tolist(), (pending & (stored > _PIECE)).tolist()
    hoff, poff = p.header_offset, p.payload_offset
    heads = records.local_headers(p.names, more=prep.more, **fields)  # CRCs patched below
    head_len = np.fromiter(map(len, heads), np.int64, n)
    bad = np.flatnonzero(hoff + head_len != poff)
    if bad.size:
        i = int(bad[0])
        raise InternalError(
            f"{p.names[i]!r}: local header of {len(heads[i])} bytes differs from "
            f"the layout plan ({int(poff[i]) - int(hoff[i])})"
        )
    hpos = np.zeros(n + 1, np.int64)
    np.cumsum(head_len, out=hpos[1:])
    at = hpos.tolist()
    hbuf = bytearray().join(heads)
    del heads
    hview = memoryview(hbuf)
    crc_at = records.LOCAL_DT.fields["crc"][1]  # type: ignore[index]
    end = poff + np.where(has_data, stored, 0)
    contiguous = np.ones(n, np.bool_)  # entry i's bytes end where entry i + 1's header starts
    contiguous[:-1] = hoff[1:] == end[:-1]
    units = _plan_units(split, stored.tolist())
    piece_crc: list[int] = [0] * len(units)
    lock = threading.Lock()
    order = iter(range(len(units)))
    errors: list[BaseException] = []
    unflushed = [0]

    def set_crc(i: int, value: int) -> None:
        crc[i] = value
        hbuf[at[i] + crc_at : at[i] + crc_at + 4] = value.to_bytes(4, "little")

    def group(a: int, b: int) -> int:
        for i in range(a, b):
            if pend[i]:
                set_crc(i, crc32(sources[i]))
        if not contiguous[a : b - 1].all():  # gaps (unwritten zeros, room for an alignment)
            segments: list[tuple[int, object]] = []
            for i in range(a, b):
                segments.append((int(hoff[i]), hview[at[i] : at[i + 1]]))
                pos = int(poff[i])
                for part in sources[i] if isinstance(sources[i], list) else [sources[i]]:
                    if part is not None and part.size:
                        segments.append((pos, part))
                        pos += part.size
            write_segments(fd, segments)
            return int(stored[a:b].sum())
        bufs: list[Any] = []
        for i in range(a, b):
            bufs.append(hview[at[i] : at[i + 1]])
            src = sources[i]
            if isinstance(src, list):
                bufs.extend(part for part in src if part.size)
            elif src is not None and src.size:
                bufs.append(src)
        _pwritev_all(fd, bufs, int(hoff[a]), int(end[b - 1] - hoff[a]))
        return int(stored[a:b].sum())

    def piece(k: int, i: int, off: int, length: int) -> int:
        view = sources[i][off : off + length]
        _pwritev_all(fd, [view], int(poff[i]) + off, length)
        piece_crc[k] = crc32(view)  # the bytes just copied are still in this core's cache
        return length

    def work() -> None:
        try:
            while not errors:
                with lock:
                    k = next(order, None)
                if k is None:
                    return
                a, b, length = units[k]
                done = group(a, b) if length < 0 else piece(k, a, b, length)
                with lock:
                    bar.update(done)
                    unflushed[0] += done
                    flush = writeback and unflushed[0] >= _WRITEBACK
                    if flush:
                        unflushed[0] = 0
                if flush:
                    _tempfiles.start_writeback(fd)
        except BaseException as exc:  # re-raised by the calling thread
            errors.append(exc)

    helpers: list[threading.Thread] = []
    try:
        for _ in range(min(threads, len(units)) - 1):
            helpers.append(threading.Thread(target=work, daemon=True))
            helpers[-1].start()
        work()
    finally:  # on an error the helpers stop after their current unit
        for t in helpers:
            t.join()
    if errors:
        raise errors[0]
    big = [i for i, s in enumerate(split) if s]
    if big:  # the headers of split entries, once their pieces' CRCs are combined
        c: dict[int, int] = {}
        for k, (i, off, length) in enumerate(units):
            if length >= 0:
                c[i] = piece_crc[k] if off == 0 else combine(c[i], piece_crc[k], length)
        for i in big:
            set_crc(i, c[i])
        write_segments(fd, [(int(hoff[i]), hview[at[i] : at[i + 1]]) for i in big])


def _pwritev_all(fd: int, bufs: list[Any], offset: int, total: int) -> None:
    """Writes the contiguous buffers ``bufs`` (``total`` bytes) at ``offset``:
    ``pwritev`` of up to :data:`_IOV_MAX` buffers at a time; a short write is
    finished by :func:`write_segments`."""
    if len(bufs) <= _IOV_MAX and os.pwritev(fd, bufs, offset) == total:
        return
    segments: list[tuple[int, Any]] = []
    pos = offset
    for b in bufs:
        view = memoryview(b).cast("B")
        segments.append((pos, view))
        pos += view.nbytes
    write_segments(fd, segments)


def _write_threads(num_threads: int | None) -> int:
    """Threads that hash and write a save's payloads: ``num_threads`` (default: the
    cores), at most 4 (buffered writes to one file serialize on its inode lock;
    the CRCs of the other threads overlap them)."""
    from .kernel_dispatch import default_threads

    total = default_threads() if num_threads is None else num_threads
    return max(1, min(total, 4))


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
    from .errors import InvalidArgumentError

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


_IOV_MAX = 1024
#: Bytes of payload hashed per CRC batch before the writer may use the CRCs.
_CRC_BATCH = 16 << 20


def _batches(rows: list[int], sizes: np.ndarray) -> list[list[int]]:
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


def _rows(fields: dict, start: int, stop: int) -> dict:
    return {k: (v if k == "dos" else v[start:stop]) for k, v in fields.items()}


def write_segments(fd: int, segments: list[tuple[int, Any]]) -> None:
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
    return 0o666 & ~_tempfiles.umask()


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
