"""Saving to object stores: the writer's one sequential pass, streamed to the object.

The writer plans every offset before writing a byte, so an archive can be
written front to back into a stream: headers and payloads in order (CRC-32s
computed in batches ahead of the writes, as the local writer does), then the
central directory. No local temporary file; payloads are written in slices of
at most :data:`SLICE_BYTES`, so memory stays bounded by the stream's buffer.

On S3 (s3fs) the stream is a :class:`~tdz_numba.remote.upload.MultipartStream`:
parts of 16 MiB are uploaded concurrently (at most 8 at once) while the writer
fills the next, and the multipart upload is completed at close (an archive
under one part goes in one PUT) or aborted on any error. Other fsspec files
honouring ``autocommit=False`` (gcs, azure, local) commit at the end or
discard; other filesystems get a temporary name moved into place. An
interrupted upload leaves no object and an existing one intact.

Examples
--------
>>> import io, torch, tdz_numba
>>> from tdz_numba.remote.write import stream_entries
>>> from tdz_numba.tdz.tree import flatten
>>> buf = io.BytesIO()
>>> n = stream_entries(flatten({"a": torch.arange(3)}), buf)
>>> print(n == len(buf.getvalue()), tdz_numba.load(buf)["a"].tolist())
True [0, 1, 2]
"""

from __future__ import annotations

import uuid
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import numpy as np

from ..errors import ArchiveExistsError, InternalError, InvalidArgumentError, TdzError
from ..zipfmt import packers
from ..zipfmt.entry import Entry
from ..zipfmt.writer import crc_batches, prepare  # the local writer's preparation and CRC batches
from .upload import PART_BYTES, PARTS_IN_FLIGHT, MultipartStream, supports_multipart

__all__ = ["stream_entries", "save_remote", "SLICE_BYTES"]

#: Largest single ``write`` to the stream (bounds the stream's buffering of big payloads).
SLICE_BYTES = 8 << 20
#: fsspec protocols whose objects appear only when the file is closed (one-shot PUT below the
#: block size, multipart upload completed at close above it); an error before close discards it.
_COMMIT_ON_CLOSE = {"s3", "s3a"}
#: Other fsspec protocols whose files honour ``autocommit=False`` (commit / discard).
_TRANSACTIONAL = {"gs", "gcs", "abfs", "az", "adl", "abfss", "file", "local"}


def _write(stream: Any, data: Any) -> int:
    view = memoryview(data).cast("B")
    for k in range(0, view.nbytes, SLICE_BYTES):
        stream.write(view[k : k + SLICE_BYTES])
    return view.nbytes


def stream_entries(
    entries: Sequence[Entry],
    stream: Any,
    *,
    compression: str | None = None,
    compresslevel: int | None = None,
    num_threads: int | None = None,
    digest: bool = False,
) -> int:
    """Writes ``entries`` as one archive to a writable binary ``stream``, front to back.
    ``digest``: an XXH3-128 digest of every payload in its central record (computed with
    the CRC-32s, ahead of the writes), as a local ``save(..., digest=True)`` stores it.

    Returns the number of bytes written. The stream is neither flushed nor closed.
    """
    from ..jit.policy import CRC_CHUNK
    from ..zipfmt import digest as digests_
    from ..zipfmt.kernels.dispatch import crc32_spans, crc32_zeros  # kernels or their twins

    prep = prepare(  # (the caller checked the arguments: saving.save / saving.pack)
        entries, compression=compression, compresslevel=compresslevel, num_threads=num_threads, digest=digest
    )
    digests = prep.digests
    hash_now = digests_.hash_function() if digests is not None else None

    def crcs_of(rows_: list[int], addrs: np.ndarray) -> np.ndarray:
        """The CRC-32s of ``rows_`` (and their pending digests, filled in)."""
        out = crc32_spans(addrs, stored_size[rows_].copy(), CRC_CHUNK, num_threads=num_threads)
        if hash_now is not None and digests is not None:
            for i in rows_:
                if digests[i] == digests_.PENDING:
                    digests[i] = hash_now(sources[i])
        return out

    n, methods, stored_size, size, crc, hashed, sources, more, p = (
        prep.n,
        prep.methods,
        prep.stored_size,
        prep.size,
        prep.crc,
        prep.hashed,
        prep.sources,
        prep.more,
        prep.plan,
    )
    for i in range(n):
        if sources[i] is None and size[i]:
            crc[i] = crc32_zeros(int(size[i]))
    fields: dict[str, Any] = dict(
        crc=crc,
        size=size,
        csize=stored_size,
        method=methods,
        dos=packers.dos_datetime(),
        pad=p.pad,
        flags=p.flags,
    )
    pending = [i for i in range(n) if not hashed[i] and sources[i] is not None and sources[i].size]
    pos = 0
    zeros = np.zeros(min(SLICE_BYTES, int(size.max(initial=0))), np.uint8)
    with ThreadPoolExecutor(1) as pool:  # CRC batches run ahead of the writes, on all cores
        jobs: list[tuple[list[int] | None, Any]] = []
        for rows_ in crc_batches(pending, stored_size):
            addrs = np.fromiter((sources[i].ctypes.data for i in rows_), np.int64, len(rows_))
            jobs.append(
                (
                    rows_,
                    pool.submit(crcs_of, rows_, addrs),
                )
            )
        start = 0
        for batch, job in [*jobs, (None, None)]:  # the last round: the entries after the last batch
            stop = n if batch is None else batch[-1] + 1
            if job is not None:
                crc[batch] = job.result()
            rows = {k: (v if k == "dos" else v[start:stop]) for k, v in fields.items()}
            heads = packers.local_headers(p.names[start:stop], more=more[start:stop], **rows)
            for i, head in zip(range(start, stop), heads):
                if pos != int(p.header_offset[i]) or pos + len(head) != int(p.payload_offset[i]):
                    raise InternalError(f"{p.names[i]!r}: stream position differs from the layout plan")
                pos += _write(stream, head)
                src = sources[i]
                if src is None:
                    left = int(size[i])
                    while left:
                        pos += _write(stream, zeros[: min(left, zeros.size)])
                        left -= min(left, zeros.size)
                    continue
                for part in src if isinstance(src, list) else [src]:
                    if part is not None and part.size:
                        pos += _write(stream, part)
            start = stop
    more_cd = digests_.blocks(digests, n)
    tail = packers.central_directory(
        p.names, header_offset=p.header_offset, zip64=p.central_zip64, more=more_cd, **fields
    )
    cd_size = p.cd_size + digests_.planned_len(digests)  # (the plan counts no digest block)
    if pos != p.cd_offset or len(tail) != cd_size:
        raise InternalError("central directory offset or size differs from the layout plan")
    zip64_end = packers.needs_zip64_end(n, p.cd_offset, cd_size) if more_cd else p.zip64_end
    pos += _write(stream, tail + packers.end_records(n, p.cd_offset, cd_size, zip64_end))
    return pos


def save_remote(
    entries: Sequence[Entry],
    target: Any,
    *,
    storage_options: dict[str, Any] | None = None,
    existsok: bool = True,
    block_size: int | None = None,
    parts_in_flight: int | None = None,
    **kwargs: Any,
) -> str:
    """Streams ``entries`` to an fsspec URL (or a writable file object); see :func:`tdz_numba.save`.

    The object is committed only after the last byte: on any error (or
    interruption) a multipart upload is aborted or the temporary object
    removed, and an existing object is left intact. On S3, ``block_size``
    is the part size (default :data:`~tdz_numba.remote.upload.PART_BYTES`,
    at least 5 MiB) and ``parts_in_flight`` the most parts uploading at once
    (default :data:`~tdz_numba.remote.upload.PARTS_IN_FLIGHT`); elsewhere
    ``block_size`` goes to ``fs.open``.
    """
    from ..errors import RemoteError

    if not isinstance(target, str):
        if storage_options:
            raise InvalidArgumentError("storage_options apply to URLs, not to file objects")
        stream_entries(entries, target, **kwargs)
        return getattr(target, "path", None) or repr(target)
    import fsspec

    fs, path = fsspec.core.url_to_fs(target, **(storage_options or {}))
    if not existsok and fs.exists(path):
        raise ArchiveExistsError(f"{target} already exists; pass existsok=True to overwrite it")
    opts: dict[str, Any] = {} if block_size is None else {"block_size": block_size}
    tmp = None
    f: Any = None
    try:
        protocols = {fs.protocol} if isinstance(fs.protocol, str) else set(fs.protocol)
        commit = False
        if supports_multipart(fs):  # S3: parts uploaded concurrently, the upload completed at close()
            f = MultipartStream(
                fs,
                path,
                part_size=block_size or PART_BYTES,
                parts_in_flight=parts_in_flight or PARTS_IN_FLIGHT,
            )
        elif protocols & _COMMIT_ON_CLOSE:  # appears at close() (one PUT or the multipart completion)
            f = fs.open(path, "wb", **opts)
        elif protocols & _TRANSACTIONAL:  # the object appears at commit(); discard() aborts
            f = fs.open(path, "wb", autocommit=False, **opts)
            commit = True
        else:  # e.g. memory:// creates the object at open: write elsewhere, move into place
            tmp = f"{path}.{uuid.uuid4().hex[:12]}.tmp"
            f = fs.open(tmp, "wb", **opts)
    except TdzError:
        raise
    except Exception as exc:
        raise RemoteError(
            f"{target}: cannot open the object for writing: {type(exc).__name__}: {exc}", path=target
        ) from exc
    try:
        stream_entries(entries, f, **kwargs)
        f.close()
        if commit:
            f.commit()
        elif tmp is not None:
            fs.mv(tmp, path)
    except BaseException as exc:
        _discard(f)
        if tmp is not None:
            try:
                fs.rm(tmp)
            except Exception:  # noqa: S110 - already gone, or never created
                pass
        if isinstance(exc, (TdzError, KeyboardInterrupt, SystemExit, AssertionError)):
            raise
        raise RemoteError(
            f"{target}: upload failed, nothing written (an existing object is intact): "
            f"{type(exc).__name__}: {exc}",
            path=target,
        ) from exc
    return target


def _discard(f: Any) -> None:
    """Abandons a stream: aborts its multipart upload, and marks it closed so that its
    finalizer does not flush (which would start a new upload)."""
    try:
        if hasattr(f, "discard"):
            f.discard()
    except Exception:  # noqa: S110 - best effort: the upload is abandoned either way
        pass
    try:
        f.closed = True
    except Exception:  # noqa: S110 - a file whose closed flag is read-only has no such finalizer
        pass
