"""Concurrent multipart uploads to S3: a write-only stream whose parts go out while the next fills.

s3fs's file (``fs.open(url, "wb")``) uploads each full block synchronously
inside ``write``: the writer waits for every part's round trip, so a streamed
save ran at less than half of ``fs.put``. :class:`MultipartStream` copies the
writer's bytes into part buffers of ``part_size`` bytes and hands each full
part to s3fs's event loop (``fs._call_s3("upload_part", ...)``), keeping at
most ``parts_in_flight`` parts uploading at once: ``write`` blocks while the
pool is full, so memory is bounded by ``(parts_in_flight + 1) * part_size``
(the part buffers are reused) whatever the object's size. The buffers are
``io.BytesIO`` objects: aiohttp sends those in 64 KiB pieces, where a
``bytes`` or ``bytearray`` body is copied whole into the socket transport's
buffer (a ``bytearray`` body twice): 2-3x the part's size per part in flight.

The object appears only at :meth:`MultipartStream.close`: the multipart upload
is completed there (an object smaller than one part is sent in one
``put_object`` and no upload is created). :meth:`MultipartStream.discard`
(called on any error, ``KeyboardInterrupt`` included) waits for the parts in
flight and aborts the upload, so no incomplete upload stays behind and an
existing object under the same key is intact. A killed process leaves a
pending upload (S3 lifecycle rules clean those), never an object.

Examples
--------
::

    import s3fs
    from tdz_numba.remote.upload import MultipartStream

    f = MultipartStream(s3fs.S3FileSystem(), "bucket/ckpt.bin", part_size=16 << 20)
    try:
        for chunk in chunks:
            f.write(chunk)  # a full part goes out at once; waits while 8 are uploading
        f.close()  # the last part, then the upload completed: the object appears
    except BaseException:
        f.discard()  # the upload aborted: nothing appears
        raise

``tdz_numba.save(tree, "s3://bucket/ckpt.tdz")`` does this (:mod:`tdz_numba.remote.write`);
``tests/test_remote_write.py`` runs it against moto's S3 server.
"""

from __future__ import annotations

import asyncio
import functools
import io
import threading
from concurrent.futures import Future
from concurrent.futures import wait as wait_futures
from typing import Any

from ..errors import InvalidArgumentError, RemoteError

__all__ = ["MultipartStream", "PART_BYTES", "PARTS_IN_FLIGHT", "MIN_PART_BYTES", "supports_multipart"]

#: Default part size.
PART_BYTES = 16 << 20
#: The part size doubles after every this many parts (S3 allows 10,000: 16 MiB parts, then 32, 64,
#: 128 and 256 MiB ones reach ~970 GiB; the last part number a save can use is 10,000).
GROW_EVERY = 2_000
#: Default number of parts uploading at once.
PARTS_IN_FLIGHT = 8
#: S3's smallest part (all but the last).
MIN_PART_BYTES = 5 << 20
#: S3's largest part number.
MAX_PARTS = 10_000
#: How long :meth:`MultipartStream.discard` waits for the parts in flight before aborting anyway.
ABORT_WAIT_S = 60.0


def supports_multipart(fs: Any) -> bool:
    """Whether ``fs`` is an s3fs filesystem on a running event loop (the concurrent upload path).

    Examples
    --------
    >>> import fsspec
    >>> from tdz_numba.remote.upload import supports_multipart
    >>> supports_multipart(fsspec.filesystem("memory"))
    False
    """
    try:
        import s3fs
    except ImportError:  # pragma: no cover - s3fs is what makes s3:// URLs work at all
        return False
    return isinstance(fs, s3fs.S3FileSystem) and not getattr(fs, "asynchronous", False)


class MultipartStream:
    """A write-only binary stream uploading to ``s3://bucket/key`` in concurrent parts.

    Parameters
    ----------
    fs : s3fs.S3FileSystem
        The filesystem (its ``_call_s3`` runs on its event loop ``fs.loop``).
    path : str
        ``bucket/key`` (as ``fs.split_path`` takes it).
    part_size : int
        Bytes per part (all but the last), at least 5 MiB; doubled after every
        :data:`GROW_EVERY` parts, so that 10,000 parts reach ~60,000 times the first.
    parts_in_flight : int
        The most parts uploading at once (``write`` waits while that many are out).

    Attributes
    ----------
    peak_in_flight : int
        The most parts that were uploading at once (for tests and the benchmark).
    parts : int
        Parts sent so far.

    Examples
    --------
    As a context manager (see the module's example for ``close``/``discard``)::

        with MultipartStream(s3fs.S3FileSystem(), "bucket/ckpt.bin") as f:
            f.write(data)  # committed on a clean exit, aborted on an exception
    """

    def __init__(
        self, fs: Any, path: str, *, part_size: int = PART_BYTES, parts_in_flight: int = PARTS_IN_FLIGHT
    ) -> None:
        """Checks the sizes; nothing is sent before the first full part (or ``close``)."""
        if int(part_size) < MIN_PART_BYTES:
            raise InvalidArgumentError(
                f"part_size must be at least 5 MiB (S3's smallest part), got {part_size}"
            )
        if int(parts_in_flight) < 1:
            raise InvalidArgumentError(f"parts_in_flight must be >= 1, got {parts_in_flight}")
        self.fs = fs
        self.path = path
        self.bucket, self.key = fs.split_path(path)[:2]
        self.part_size = int(part_size)
        self.parts_in_flight = int(parts_in_flight)
        self.closed = False
        self.peak_in_flight = 0
        self.parts = 0
        self._upload_id: str | None = None
        self._etags: dict[int, str] = {}
        self._futures: set[Future[Any]] = set()
        self._free: list[io.BytesIO] = []  # part buffers back from finished uploads
        self._slots = threading.BoundedSemaphore(self.parts_in_flight)
        self._lock = threading.Lock()
        self._error: BaseException | None = None
        self._buf = io.BytesIO()
        self._fill = 0
        self._written = 0

    # -- writing ---------------------------------------------------------------------------------
    def writable(self) -> bool:
        """Always ``True`` (a write-only stream)."""
        return True

    def tell(self) -> int:
        """Bytes written so far."""
        return self._written

    def write(self, data: Any) -> int:
        """Copies ``data`` (any buffer) into the current part; full parts are sent at once.

        Raises the :class:`~tdz_numba.errors.RemoteError` of a part that failed.
        """
        if self.closed:
            raise ValueError("write to a closed MultipartStream")
        view = memoryview(data).cast("B")
        n, k = view.nbytes, 0
        while k < n:
            take = min(n - k, self.part_size - self._fill)
            self._buf.write(view[k : k + take])
            self._fill += take
            k += take
            if self._fill == self.part_size:
                self._send_part()
        self._written += n
        return n

    def _raise_pending(self) -> None:
        if self._error is not None:
            raise self._error

    def _call(self, method: str, **kw: Any) -> Any:
        """One S3 call on the filesystem's loop, waited for here."""
        return asyncio.run_coroutine_threadsafe(
            self.fs._call_s3(method, Bucket=self.bucket, Key=self.key, **kw), self.fs.loop
        ).result()

    def _send_part(self) -> None:
        """Hands the full buffer to the loop (waiting for a slot); takes a free buffer for the next."""
        self._raise_pending()
        if self._upload_id is None:
            self._upload_id = self._call("create_multipart_upload")["UploadId"]
        self._slots.acquire()  # at most parts_in_flight uploading: the writer waits here
        try:
            self._raise_pending()  # (a part that failed while we waited)
        except BaseException:
            self._slots.release()
            raise
        self.parts += 1
        if self.parts > MAX_PARTS:
            self._slots.release()
            raise RemoteError(f"{self._url}: more than {MAX_PARTS} parts", path=self._url)
        number, body = self.parts, self._buf
        body.truncate(self._fill)  # (the last part: shorter than the buffer)
        body.seek(0)
        fut = asyncio.run_coroutine_threadsafe(self._upload_part(number, body), self.fs.loop)
        with self._lock:
            self._futures.add(fut)
            self.peak_in_flight = max(self.peak_in_flight, len(self._futures))
        fut.add_done_callback(functools.partial(self._part_done, number=number, body=body))
        with self._lock:
            if number % GROW_EVERY == 0:  # larger parts from here on (the old buffers are dropped)
                self.part_size *= 2
                self._free.clear()
            self._buf = self._free.pop() if self._free else io.BytesIO()
        self._fill = 0

    async def _upload_part(self, number: int, body: io.BytesIO) -> Any:
        """``upload_part`` with s3fs's retries, the body rewound before every attempt.

        (``fs._call_s3`` retries with the same arguments: a body that an
        attempt had read, all or half, would send an empty or a short part,
        with matching checksums, and S3 would complete the upload with it.)
        """
        from s3fs.core import _error_wrapper

        fs = self.fs
        await fs.set_session()
        method = (await fs.get_s3(self.bucket)).upload_part
        kwargs = fs._get_s3_method_kwargs(
            method, Bucket=self.bucket, Key=self.key, UploadId=self._upload_id, PartNumber=number, Body=body
        )

        @functools.wraps(method)
        async def attempt(**kw: Any) -> Any:
            body.seek(0)
            return await method(**kw)

        return await _error_wrapper(attempt, kwargs=kwargs, retries=fs.retries)

    def _part_done(self, fut: Future[Any], *, number: int, body: io.BytesIO) -> None:
        """(On the loop thread.) Records the part's ETag or its error; frees the slot and the buffer."""
        with self._lock:
            self._futures.discard(fut)
            try:
                if fut.cancelled():
                    raise RemoteError(f"s3://{self.path}: part {number} cancelled", path=self._url)
                exc = fut.exception()
                if exc is not None:
                    raise exc
                self._etags[number] = fut.result()["ETag"]
                if not body.closed and body.seek(0, io.SEEK_END) == self.part_size:
                    body.seek(0)  # reused for a later part: written over from the start
                    self._free.append(body)
            except BaseException as exc:
                if self._error is None:
                    self._error = _remote_error(self._url, f"upload of part {number}", exc)
        self._slots.release()

    @property
    def _url(self) -> str:
        return f"s3://{self.path}"

    # -- committing or discarding ------------------------------------------------------------------
    def flush(self) -> None:
        """Nothing to do: parts go out when full, the last one at :meth:`close`."""

    def close(self) -> None:
        """Sends the last part, waits for every part and completes the upload: the object appears.

        A small object (under one part) is sent in one ``put_object``. On any
        error the upload is aborted (see :meth:`discard`) and the error raised.
        """
        if self.closed:
            return
        try:
            if self._upload_id is None:  # under one part: one PUT, no multipart upload
                self._buf.truncate(self._fill)
                # bytes, not the BytesIO: s3fs retries with the same arguments (see _upload_part)
                self._call("put_object", Body=self._buf.getvalue())
            else:
                if self._fill:
                    self._send_part()
                wait_futures(list(self._futures))
                self._raise_pending()
                parts = [{"PartNumber": k, "ETag": self._etags[k]} for k in range(1, self.parts + 1)]
                self._call(
                    "complete_multipart_upload", UploadId=self._upload_id, MultipartUpload={"Parts": parts}
                )
        except BaseException as exc:
            self.discard()
            if isinstance(exc, RemoteError) or not isinstance(exc, Exception):
                raise
            raise _remote_error(self._url, "commit", exc) from exc
        self.closed = True
        self._buf = io.BytesIO()
        self._free.clear()
        self._invalidate()

    def discard(self) -> None:
        """Abandons the upload: waits (bounded) for the parts in flight, then aborts it. Best effort:
        never raises (an abort that fails leaves a pending upload, never an object)."""
        if self.closed:
            return
        self.closed = True
        futures = list(self._futures)
        for f in futures:
            f.cancel()
        wait_futures(futures, timeout=ABORT_WAIT_S)
        if self._upload_id is not None:
            try:
                self._call("abort_multipart_upload", UploadId=self._upload_id)
            except Exception:  # noqa: S110 - the upload is abandoned either way
                pass
        self._buf = io.BytesIO()
        self._free.clear()

    def _invalidate(self) -> None:
        """Drops the filesystem's cached listings of the key and its parents (the object is new)."""
        path = self.path
        while path:
            self.fs.invalidate_cache(path)
            path = path.rpartition("/")[0]

    def __enter__(self) -> MultipartStream:
        """Returns the stream; ``close`` on a clean exit, ``discard`` on an exception."""
        return self

    def __exit__(self, kind: Any, exc: Any, tb: Any) -> None:
        """Commits or discards (see :meth:`__enter__`)."""
        if kind is None:
            self.close()
        else:
            self.discard()


def _remote_error(url: str, what: str, exc: BaseException) -> BaseException:
    """A :class:`RemoteError` naming the URL and the step (``KeyboardInterrupt`` and the like pass)."""
    if isinstance(exc, RemoteError) or not isinstance(exc, Exception):
        return exc
    text = str(exc)
    if len(text) > 300:
        text = text[:300] + "..."
    err = RemoteError(f"{url}: {what} failed: {type(exc).__name__}: {text}", path=url)
    err.__cause__ = exc
    return err
