"""One remote object read by ranges into a sparse local mapping: :class:`RemoteObject`.

Every remote reader (the ``.tdz`` index of :mod:`.read`, the foreign formats of
:mod:`.foreign`) keeps the object's bytes in one anonymous mapping the size of
the object (``MAP_NORESERVE``: pages exist only where bytes were placed) and
asks :meth:`RemoteObject.need` / :meth:`RemoteObject.need_spans` for the byte
ranges it is about to read. Only what is missing is fetched: the ranges are
merged (small gaps bridged), cut into parts of at most :data:`PART_BYTES` and
fetched concurrently (at most :data:`CONCURRENCY` requests in flight), each
part written straight into its place.

How bytes come (the *transport*):

- ``http(s)://`` (fsspec's ``HTTPFileSystem``): aiohttp requests on fsspec's
  session, each body streamed into the mapping (one copy), a socket timeout
  on every request;
- ``s3://`` (s3fs): ``GetObject`` with ``Range`` and ``IfMatch``;
- any other fsspec filesystem (``memory://``, ``gs://``, caching layers such as
  ``simplecache::``): ``fs.cat_ranges``;
- a seekable binary file object: ``seek`` + ``read`` under a lock.

The object is *pinned* at the first response: its ETag (and S3 version id),
else Last-Modified, and its size. HTTP and S3 requests carry ``If-Match`` and
every response's ETag and ``Content-Range`` total are compared with the pin;
other filesystems are asked for ``info()`` again after every batch (not the
caching layers: they read their local copy). A replaced object raises
:class:`~tdz_numba.RemoteError` naming the URL and the byte range, never a mix
of old and new bytes. Connection faults, truncated bodies and 5xx answers are
retried (:data:`ATTEMPTS` tries per part), then raise the same error.

Examples
--------
>>> import fsspec
>>> from tdz_numba.remote.object import RemoteObject
>>> with fsspec.open("memory://doc-obj/x.bin", "wb") as f:
...     _ = f.write(bytes(range(200)))
>>> obj = RemoteObject("memory://doc-obj/x.bin")
>>> obj.start(tail=16)                    # the first request: the last 16 bytes, size and pin
>>> obj.size, obj.buffer[-1], obj.missing(0, obj.size)
(200, 199, [(0, 184)])
>>> obj.need(10, 20); obj.buffer[10:13].tolist(), obj.bytes_fetched
([10, 11, 12], 26)
>>> fsspec.filesystem("memory").rm("/doc-obj", recursive=True)
"""

from __future__ import annotations

import asyncio
import bisect
import mmap
import re
import sys
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from ..errors import FileMissingError, InvalidArgumentError, RemoteError

__all__ = [
    "RemoteObject",
    "coalesce",
    "MAX_GAP",
    "MAX_WASTE",
    "PART_BYTES",
    "CONCURRENCY",
    "ATTEMPTS",
    "TIMEOUT_S",
]

#: Ranges farther apart than this are fetched separately (not bridged).
MAX_GAP = 4096
#: Bridged gaps may add at most this fraction of the bytes needed.
MAX_WASTE = 0.02
#: Largest single ranged request (larger ranges are split, for concurrency).
PART_BYTES = 8 << 20
#: Requests in flight at once.
CONCURRENCY = 8
#: Attempts per ranged request before :class:`~tdz_numba.RemoteError`.
ATTEMPTS = 3
#: Seconds a request may wait for a connection or for the next bytes of its body.
TIMEOUT_S = 30.0

_NORESERVE = getattr(mmap, "MAP_NORESERVE", 0x4000 if sys.platform.startswith("linux") else 0)
_POPULATE_WRITE = getattr(mmap, "MADV_POPULATE_WRITE", 23 if sys.platform.startswith("linux") else None)
_CONTENT_RANGE = re.compile(r"^bytes (\d+)-(\d+)/(\d+|\*)$")


class _Replaced(Exception):
    """The object changed since it was pinned (not retried)."""


class _Missing(Exception):
    """The object is gone (404)."""


def coalesce(starts: np.ndarray, stops: np.ndarray, max_gap: int, max_waste: float) -> list[tuple[int, int]]:
    """Merged ``[start, stop)`` extents: overlapping and touching ones joined, then gaps of at
    most ``max_gap`` bridged, smallest first, while the bridged bytes stay within
    ``max_waste`` x the bytes needed.

    Examples
    --------
    >>> import numpy as np
    >>> from tdz_numba.remote.object import coalesce
    >>> coalesce(np.array([0, 100, 10, 5000]), np.array([10, 200, 20, 6000]), 4096, 0.5)
    [(0, 20), (100, 200), (5000, 6000)]
    >>> coalesce(np.array([0, 100]), np.array([10, 200]), 4096, 1.0)
    [(0, 200)]
    """
    starts = np.asarray(starts, np.int64)
    stops = np.maximum(np.asarray(stops, np.int64), starts)
    if not starts.size:
        return []
    order = np.argsort(starts, kind="stable")
    starts, stops = starts[order], np.maximum.accumulate(stops[order])
    gaps = starts[1:] - stops[:-1]  # > 0: bytes between an extent and the next
    small = np.nonzero((gaps > 0) & (gaps <= max_gap))[0]
    budget = max_waste * float((stops - starts).sum())
    n_bridge = int((np.cumsum(np.sort(gaps[small])) <= budget).sum())  # smallest gaps first
    keep = small[np.argsort(gaps[small], kind="stable")][:n_bridge]
    cut = gaps > 0
    cut[keep] = False
    first = np.concatenate(([0], np.nonzero(cut)[0] + 1))
    last = np.concatenate((np.nonzero(cut)[0], [starts.size - 1]))
    return list(zip(starts[first].tolist(), stops[last].tolist()))


# -- transports: how bytes come --------------------------------------------------------------
class _Transport:
    """Ranged reads of one object. ``first`` makes the opening request and returns
    ``(bytes, start, size, pin)``; ``fetch`` writes parts into a destination."""

    label: str
    cheap_check = False  # whether check() must run after every batch

    def first(self, start: int | None, n: int) -> tuple[bytes, int, int, dict[str, Any]]:
        raise NotImplementedError

    def fetch(self, parts: list[tuple[int, int]], dest: np.ndarray, pin: dict[str, Any]) -> list[Any]:
        raise NotImplementedError

    def check(self, pin: dict[str, Any]) -> None:
        """Raises :class:`_Replaced` when the object no longer matches ``pin``."""


def _pin_of(info: dict[str, Any]) -> dict[str, Any]:
    """The identity fields of an fsspec ``info()`` (ETag, version, generation, mtime, size)."""
    keys = ("ETag", "etag", "VersionId", "version_id", "generation", "LastModified", "mtime", "created")
    pin = {k: str(info[k]) for k in keys if info.get(k) is not None}
    pin["size"] = int(info.get("size") or 0)
    return pin


class _FileObject(_Transport):
    """A seekable binary file object (no pin: the caller owns the file)."""

    def __init__(self, file: Any) -> None:
        self.file = file
        self.lock = threading.Lock()
        path = getattr(file, "path", None) or getattr(file, "name", None) or repr(file)
        self.label = str(getattr(file, "full_name", None) or path)

    def first(self, start: int | None, n: int) -> tuple[bytes, int, int, dict[str, Any]]:
        with self.lock:
            size = int(self.file.seek(0, 2))
            a = max(0, size - n) if start is None else min(start, size)
            self.file.seek(a)
            return bytes(self.file.read(min(n, size - a))), a, size, {"size": size}

    def fetch(self, parts: list[tuple[int, int]], dest: np.ndarray, pin: dict[str, Any]) -> list[Any]:
        out: list[Any] = []
        for a, b in parts:
            try:
                with self.lock:
                    self.file.seek(a)
                    data = self.file.read(b - a)
                out.append(_place(dest, a, b, data))
            except Exception as exc:  # noqa: BLE001 - reported per part
                out.append(exc)
        return out


def _place(dest: np.ndarray, a: int, b: int, data: Any) -> Any:
    """Copies ``data`` into ``dest[a:b]``; an error when it has another length."""
    if not isinstance(data, (bytes, bytearray, memoryview)):
        return data
    if len(data) != b - a:
        return ValueError(f"got {len(data)} bytes, expected {b - a} (a truncated body?)")
    dest[a:b] = np.frombuffer(data, np.uint8)
    return None


class _Generic(_Transport):
    """Any fsspec filesystem: ``info()`` pins, ``cat_ranges`` reads."""

    def __init__(self, fs: Any, path: str, label: str) -> None:
        self.fs, self.path, self.label = fs, path, label
        from fsspec.implementations.cached import CachingFileSystem

        self.cheap_check = not isinstance(fs, CachingFileSystem)  # a cache reads its local copy

    def _info(self) -> dict[str, Any]:
        try:
            self.fs.invalidate_cache(self.path)
        except Exception:  # noqa: BLE001 - not every filesystem caches listings
            pass
        try:
            return dict(self.fs.info(self.path))
        except FileNotFoundError:
            inner = getattr(self.fs, "fs", None)  # blockcache's info() misreads http URLs: ask the target
            if inner is None:
                raise _Missing() from None
        try:
            return dict(inner.info(self.path))
        except FileNotFoundError:
            raise _Missing() from None

    def first(self, start: int | None, n: int) -> tuple[bytes, int, int, dict[str, Any]]:
        pin = _pin_of(self._info())
        size = pin["size"]
        a = max(0, size - n) if start is None else min(start, size)
        b = min(size, a + n)
        data = bytes(self.fs.cat_file(self.path, start=a, end=b)) if b > a else b""
        return data, a, size, pin

    def fetch(self, parts: list[tuple[int, int]], dest: np.ndarray, pin: dict[str, Any]) -> list[Any]:
        try:
            got = self.fs.cat_ranges(
                [self.path] * len(parts), [a for a, _ in parts], [b for _, b in parts], on_error="return"
            )
        except Exception as exc:  # noqa: BLE001 - reported per part
            return [exc] * len(parts)
        return [_place(dest, a, b, d) for (a, b), d in zip(parts, got)]

    def check(self, pin: dict[str, Any]) -> None:
        now = _pin_of(self._info())
        if now != pin:
            raise _Replaced(f"was {pin}, now {now}")


def _parse_range(headers: Any, status: int, body_len: int | None) -> tuple[int, int | None, int | None]:
    """``(start, stop, total)`` from a response's ``Content-Range`` (200: the whole object)."""
    cr = headers.get("Content-Range") or headers.get("content-range")
    if status == 200 or not cr:
        return 0, body_len, body_len
    m = _CONTENT_RANGE.match(cr.strip())
    if not m:
        raise ValueError(f"unreadable Content-Range {cr[:60]!r}")
    total = None if m.group(3) == "*" else int(m.group(3))
    return int(m.group(1)), int(m.group(2)) + 1, total


class _Http(_Transport):
    """fsspec's ``HTTPFileSystem``: aiohttp requests on its session, bodies streamed into place."""

    def __init__(self, fs: Any, path: str, label: str) -> None:
        self.fs, self.path, self.label = fs, path, label

    def _run(self, coro: Any) -> Any:
        from fsspec.asyn import sync

        return sync(self.fs.loop, lambda: coro)

    async def _get(self, rng: str, pin: dict[str, Any] | None, sink: Callable[[int, int, int], Any]) -> Any:
        import aiohttp

        kw = dict(self.fs.kwargs)
        headers = dict(kw.pop("headers", None) or {})
        headers["Range"] = rng
        if pin and pin.get("ETag"):
            headers["If-Match"] = pin["ETag"]
        session = await self.fs.set_session()
        timeout = aiohttp.ClientTimeout(total=None, sock_connect=TIMEOUT_S, sock_read=TIMEOUT_S)
        async with session.get(self.fs.encode_url(self.path), headers=headers, timeout=timeout, **kw) as r:
            if r.status == 404:
                raise _Missing()
            if r.status == 412:
                raise _Replaced("the server refused If-Match (412)")
            if r.status not in (200, 206):
                raise ConnectionError(f"HTTP {r.status} {r.reason}")
            etag = r.headers.get("ETag")
            if pin is not None:
                if pin.get("ETag") and etag != pin["ETag"]:
                    raise _Replaced(f"ETag {pin['ETag']} became {etag}")
                lm = r.headers.get("Last-Modified")
                if not pin.get("ETag") and pin.get("Last-Modified") and lm != pin["Last-Modified"]:
                    raise _Replaced(f"Last-Modified {pin['Last-Modified']} became {lm}")
            length = r.headers.get("Content-Length")
            a, b, total = _parse_range(r.headers, r.status, None if length is None else int(length))
            if pin is not None and total is not None and total != pin["size"]:
                raise _Replaced(f"size {pin['size']} became {total}")
            target = sink(a, -1 if b is None else b, -1 if total is None else total)
            got = 0
            async for chunk in r.content.iter_chunked(1 << 20):
                got += target(got, chunk)
            meta = {"ETag": etag, "Last-Modified": r.headers.get("Last-Modified"), "size": total}
            return got, meta

    def first(self, start: int | None, n: int) -> tuple[bytes, int, int, dict[str, Any]]:
        rng = f"bytes=-{n}" if start is None else f"bytes={start}-{start + n - 1}"
        buf = bytearray()
        where: list[int] = []

        def sink(a: int, b: int, total: int) -> Callable[[int, bytes], int]:
            where.append(a)

            def put(pos: int, chunk: bytes) -> int:
                buf.extend(chunk)
                return len(chunk)

            return put

        try:
            _, meta = self._run(self._get(rng, None, sink))
        except _Missing:
            raise
        except Exception as exc:
            if "416" in str(exc):  # an empty object answers a suffix range with 416
                return b"", 0, 0, {"size": 0}
            raise
        size = meta["size"] if meta["size"] is not None else len(buf)
        pin = {k: v for k, v in meta.items() if v is not None}
        pin["size"] = int(size)
        return bytes(buf), where[0], int(size), pin

    def fetch(self, parts: list[tuple[int, int]], dest: np.ndarray, pin: dict[str, Any]) -> list[Any]:
        async def one(a: int, b: int, sem: asyncio.Semaphore) -> Any:
            def sink(ra: int, rb: int, total: int) -> Callable[[int, bytes], int]:
                if ra != a or (rb >= 0 and rb != b):
                    raise ValueError(f"the server sent bytes [{ra}, {rb}), asked [{a}, {b})")

                def put(pos: int, chunk: bytes) -> int:
                    n = len(chunk)
                    if pos + n > b - a:
                        raise ValueError(f"the body runs past the {b - a} bytes asked")
                    dest[a + pos : a + pos + n] = np.frombuffer(chunk, np.uint8)
                    return n

                return put

            async with sem:
                try:
                    got, _ = await self._get(f"bytes={a}-{b - 1}", pin, sink)
                except Exception as exc:  # noqa: BLE001 - reported per part
                    return exc
            return None if got == b - a else ValueError(f"got {got} bytes, expected {b - a} (truncated body)")

        async def all_parts() -> list[Any]:
            sem = asyncio.Semaphore(CONCURRENCY)
            return list(await asyncio.gather(*(one(a, b, sem) for a, b in parts)))

        return self._run(all_parts())


class _S3(_Transport):
    """s3fs: ``GetObject`` with ``Range``, ``IfMatch`` and the pinned version."""

    def __init__(self, fs: Any, path: str, label: str) -> None:
        self.fs, self.path, self.label = fs, path, label
        self.bucket, self.key, self.version = fs.split_path(path)

    async def _get(self, rng: str, pin: dict[str, Any] | None) -> tuple[bytes, dict[str, Any]]:
        kw: dict[str, Any] = {"Bucket": self.bucket, "Key": self.key, "Range": rng}
        version = (pin or {}).get("VersionId") or self.version
        if version:
            kw["VersionId"] = version
        if pin and pin.get("ETag"):
            kw["IfMatch"] = pin["ETag"]
        try:
            resp = await self.fs._call_s3("get_object", **kw)
        except FileNotFoundError:
            raise _Missing() from None
        except Exception as exc:
            if "PreconditionFailed" in str(exc) or "412" in str(exc):
                raise _Replaced("the server refused IfMatch (412)") from None
            if "InvalidRange" in str(exc) or "416" in str(exc):
                return b"", {"size": 0}
            raise
        try:
            body = await resp["Body"].read()
        finally:
            resp["Body"].close()
        meta = {"ETag": resp.get("ETag"), "VersionId": resp.get("VersionId")}
        headers = {"Content-Range": resp.get("ContentRange")}
        a, b, total = _parse_range(headers, 206 if resp.get("ContentRange") else 200, len(body))
        if pin is not None:
            if pin.get("ETag") and meta["ETag"] != pin["ETag"]:
                raise _Replaced(f"ETag {pin['ETag']} became {meta['ETag']}")
            if total is not None and total != pin["size"]:
                raise _Replaced(f"size {pin['size']} became {total}")
        meta.update(start=a, size=total)
        return body, meta

    def first(self, start: int | None, n: int) -> tuple[bytes, int, int, dict[str, Any]]:
        from fsspec.asyn import sync

        rng = f"bytes=-{n}" if start is None else f"bytes={start}-{start + n - 1}"
        body, meta = sync(self.fs.loop, self._get, rng, None)
        size = int(meta["size"] if meta.get("size") is not None else len(body))
        pin = {k: v for k, v in meta.items() if v is not None and k in ("ETag", "VersionId")}
        pin["size"] = size
        return body, int(meta.get("start") or 0), size, pin

    def fetch(self, parts: list[tuple[int, int]], dest: np.ndarray, pin: dict[str, Any]) -> list[Any]:
        from fsspec.asyn import sync

        async def one(a: int, b: int, sem: asyncio.Semaphore) -> Any:
            async with sem:
                try:
                    body, _ = await self._get(f"bytes={a}-{b - 1}", pin)
                except Exception as exc:  # noqa: BLE001 - reported per part
                    return exc
            return _place(dest, a, b, body)

        async def all_parts() -> list[Any]:
            sem = asyncio.Semaphore(CONCURRENCY)
            return list(await asyncio.gather(*(one(a, b, sem) for a, b in parts)))

        return sync(self.fs.loop, all_parts)


def transport(target: Any, storage_options: dict[str, Any] | None) -> _Transport:
    """The transport of an fsspec URL or a file object."""
    if not isinstance(target, str):
        if storage_options:
            raise InvalidArgumentError("storage_options apply to URLs, not to file objects")
        return _FileObject(target)
    import fsspec

    try:
        fs, path = fsspec.core.url_to_fs(target, **(storage_options or {}))
    except (ImportError, ValueError) as exc:
        raise InvalidArgumentError(f"{target}: cannot open this URL with fsspec: {exc}", path=target) from None
    kind = type(fs).__name__
    if kind == "HTTPFileSystem" and hasattr(fs, "set_session"):
        return _Http(fs, path, target)
    if kind == "S3FileSystem" and hasattr(fs, "_call_s3"):
        return _S3(fs, path, target)
    return _Generic(fs, path, target)


# -- the object ------------------------------------------------------------------------------
class RemoteObject:
    """A remote object's bytes in a sparse mapping, fetched by range on demand (see the module).

    ``size``, ``buffer`` (uint8 numpy view of the mapping) and ``pin`` exist after
    :meth:`start`; ``requests`` and ``bytes_fetched`` count the traffic;
    ``progress``, when set, is called with the bytes of every part placed.
    """

    def __init__(self, target: Any, storage_options: dict[str, Any] | None = None) -> None:
        self.io = transport(target, storage_options)
        self.storage_options = storage_options
        self.label: str = self.io.label
        self.requests = 0
        self.bytes_fetched = 0
        self.size = -1
        self.pin: dict[str, Any] = {}
        self.progress: Callable[[int], Any] | None = None
        self._mmap: mmap.mmap | None = None
        self.buffer = np.empty(0, np.uint8)
        self._starts: list[int] = []
        self._stops: list[int] = []
        self._lock = threading.RLock()
        self._what: Callable[[int, int], str] | None = None
        self._entry: Callable[[int, int], str | None] | None = None

    # -- the first request -----------------------------------------------------------------
    def start(self, *, tail: int | None = None, head: int | None = None) -> None:
        """The first request: the last ``tail`` (or first ``head``) bytes; sets size and pin."""
        n = tail if tail is not None else head
        if n is None or n <= 0:
            raise InvalidArgumentError(f"start() needs tail or head > 0, got {n!r}")
        self.requests += 1
        try:
            data, a, size, pin = self.io.first(None if tail is not None else 0, n)
        except _Missing:
            raise FileMissingError(f"{self.label}: no such object", path=self.label) from None
        except FileNotFoundError:
            raise FileMissingError(f"{self.label}: no such object", path=self.label) from None
        except Exception as exc:
            raise RemoteError(
                f"{self.label}: the first request ({'last' if tail else 'first'} {n} bytes) failed: "
                f"{type(exc).__name__}: {str(exc)[:200]}",
                path=self.label,
            ) from exc
        if a + len(data) > size:  # a server ignoring the Range header sent everything
            data, a = data[-size:] if size else b"", 0
        self.size, self.pin = size, pin
        if size:
            self._mmap = mmap.mmap(-1, size, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS | _NORESERVE)
            self.buffer = np.frombuffer(self._mmap, dtype=np.uint8)
        if data:
            self.buffer[a : a + len(data)] = np.frombuffer(data, np.uint8)
            self._add(a, a + len(data))
        self.bytes_fetched += len(data)

    # -- what is here ----------------------------------------------------------------------
    def _add(self, a: int, b: int) -> None:
        i = bisect.bisect_left(self._stops, a)
        j = bisect.bisect_right(self._starts, b)
        if i < j:
            a, b = min(a, self._starts[i]), max(b, self._stops[j - 1])
        self._starts[i:j] = [a]
        self._stops[i:j] = [b]

    def missing(self, a: int, b: int) -> list[tuple[int, int]]:
        """The parts of ``[a, b)`` not fetched yet."""
        out = []
        i = bisect.bisect_right(self._stops, a)
        pos = a
        while pos < b and i < len(self._starts):
            s, e = self._starts[i], self._stops[i]
            if s >= b:
                break
            if s > pos:
                out.append((pos, s))
            pos = max(pos, e)
            i += 1
        if pos < b:
            out.append((pos, b))
        return out

    def present(self, a: int, b: int) -> bool:
        """Whether every byte of ``[a, b)`` is here."""
        return not self.missing(a, b)

    @property
    def ranges(self) -> list[tuple[int, int]]:
        """The fetched ``[start, stop)`` ranges, merged and sorted."""
        return list(zip(self._starts, self._stops))

    # -- fetching ----------------------------------------------------------------------------
    def need(self, a: int, b: int) -> None:
        """Makes ``[a, b)`` (clipped to the object) present, fetching what is missing."""
        self.need_spans([(a, b)])

    def need_spans(
        self,
        spans: Sequence[tuple[int, int]],
        *,
        max_gap: int | None = None,
        max_waste: float | None = None,
        what: Callable[[int, int], str] | None = None,
        entry: Callable[[int, int], str | None] | None = None,
        part_bytes: int | None = None,
    ) -> None:
        """Makes every ``[a, b)`` of ``spans`` present: the missing bytes merged
        (:func:`coalesce`), cut into parts, fetched concurrently and placed; failed parts
        retried; :class:`~tdz_numba.RemoteError` naming the URL and range when they keep failing
        or the object was replaced."""
        with self._lock:
            todo = []
            for a, b in spans:
                a, b = max(0, int(a)), min(self.size, int(b))
                if b > a:
                    todo.extend(self.missing(a, b))
            if not todo:
                return
            merged = coalesce(
                np.array([a for a, _ in todo]),
                np.array([b for _, b in todo]),
                MAX_GAP if max_gap is None else max_gap,
                MAX_WASTE if max_waste is None else max_waste,
            )
            self._what, self._entry = what, entry
            self._fetch(merged, PART_BYTES if part_bytes is None else part_bytes)

    def _fetch(self, spans: list[tuple[int, int]], part_bytes: int) -> None:
        parts = [(a, min(a + part_bytes, b)) for a0, b in spans for a in range(a0, b, part_bytes)]
        for attempt in range(ATTEMPTS):
            self.requests += len(parts)
            faults = self._populate(parts)
            got = self.io.fetch(parts, self.buffer, self.pin)
            if faults is not None:
                faults.join()
            failed = []
            for (a, b), err in zip(parts, got):
                if err is None:
                    self._add(a, b)
                    self.bytes_fetched += b - a
                    if self.progress is not None:
                        self.progress(b - a)
                elif isinstance(err, (_Replaced, _Missing)):
                    self._raise(a, b, err, attempt + 1)
                else:
                    failed.append(((a, b), err))
            if not failed:
                break
            if attempt == ATTEMPTS - 1:
                (a, b), err = failed[0]
                self._raise(a, b, err, ATTEMPTS)
            parts = [p for p, _ in failed]
            time.sleep(0.05 * 4**attempt)
        if self.io.cheap_check:
            self.requests += 1
            try:
                self.io.check(self.pin)
            except (_Replaced, _Missing) as exc:
                self._raise(spans[0][0], spans[-1][1], exc, 1)

    def _raise(self, a: int, b: int, err: BaseException, tries: int) -> None:
        what, entry = self._what, self._entry
        which = f" ({what(a, b)})" if what is not None else ""
        if isinstance(err, _Replaced):
            why = f"the object changed since it was opened ({err}); reopen it"
        elif isinstance(err, _Missing):
            why = "the object is gone (404); it was deleted or replaced since it was opened"
        else:
            why = f"failed after {tries} attempts: {type(err).__name__}: {str(err)[:200]}"
        raise RemoteError(
            f"{self.label}: reading bytes [{a}, {b}){which}: {why}",
            path=self.label,
            entry=entry(a, b) if entry is not None else None,
            offset=a,
            expected=b - a,
        ) from err

    def _populate(self, parts: list[tuple[int, int]]) -> threading.Thread | None:
        """Pre-faults the pages of ``parts`` (``MADV_POPULATE_WRITE``, Linux >= 5.14) in a thread,
        so that placing the fetched bytes is a plain copy. None when not worth it or unsupported."""
        mm = self._mmap
        if mm is None or _POPULATE_WRITE is None or sum(b - a for a, b in parts) < (1 << 20):
            return None
        page = mmap.PAGESIZE
        spans = [(a - a % page, b) for a, b in parts]

        def run() -> None:
            for a, b in spans:
                try:
                    mm.madvise(_POPULATE_WRITE, a, b - a)
                except (OSError, ValueError):  # an older kernel: the copy faults the pages in
                    return

        t = threading.Thread(target=run, daemon=True)
        t.start()
        return t

    def read_all(self) -> None:
        """Fetches every missing byte of the object (concurrent parts)."""
        self.need(0, self.size)
