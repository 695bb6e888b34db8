"""How a :class:`~tdz_numba.remote.object.RemoteObject`'s bytes come: one transport per kind
of target (see :mod:`tdz_numba.remote.object`). ``first`` makes the opening request (bytes,
size, pin); ``fetch`` places many ranges, each checked against the pin.

Examples
--------
>>> import io
>>> from tdz_numba.remote.transports import transport
>>> t = transport(io.BytesIO(b"0123456789"), None)
>>> t.first(None, 3)[:3]
(b'789', 7, 10)
"""

from __future__ import annotations

import asyncio
import re
import threading
from collections.abc import Callable
from typing import Any

import numpy as np

from ..errors import InvalidArgumentError

__all__ = ["transport", "CONCURRENCY", "TIMEOUT_S", "READ_BUFSIZE"]

#: Requests in flight at once.
CONCURRENCY = 8
#: Seconds a request may wait for a connection or for the next bytes of its body.
TIMEOUT_S = 30.0
#: Body bytes aiohttp may buffer per HTTP request before it stops reading the socket (its
#: default, 64 KiB, pauses and resumes the socket every few chunks on a fast link).
READ_BUFSIZE = 1 << 20

#: A callback told of each part ``(a, b)`` as soon as its bytes are in place (or None).
Landed = Callable[[int, int], Any] | None

_CONTENT_RANGE = re.compile(r"^bytes (\d+)-(\d+)/(\d+|\*)$")


class _Replaced(Exception):
    """The object changed since it was pinned (not retried)."""


class _Missing(Exception):
    """The object is gone (404)."""


# -- transports: how bytes come --------------------------------------------------------------
class _Transport:
    """Ranged reads of one object. ``first`` makes the opening request and returns
    ``(bytes, start, size, pin)``; ``fetch`` writes parts into a destination."""

    label: str
    cheap_check = False  # whether check() must run after every batch
    #: Largest part of a large read (object.part_size): 8 MiB parts measured best over HTTP
    max_part = 8 << 20

    def first(self, start: int | None, n: int) -> tuple[bytes, int, int, dict[str, Any]]:
        raise NotImplementedError

    def fetch(
        self, parts: list[tuple[int, int]], dest: np.ndarray, pin: dict[str, Any], landed: Landed = None
    ) -> list[Any]:
        """Places every ``(a, b)`` of ``parts`` in ``dest[a:b]``; per part None or the error.
        ``landed(a, b)``, when given, is called as soon as a part's bytes are all in place and
        checked (from the transport's thread: it must be quick), before the others finish."""
        raise NotImplementedError

    def check(self, pin: dict[str, Any]) -> None:
        """Raises :class:`_Replaced` when the object no longer matches ``pin``."""


def _pin_of(info: dict[str, Any]) -> dict[str, Any]:
    """The identity fields of an fsspec ``info()`` (ETag, version, generation, mtime, size)."""
    keys = ("ETag", "etag", "VersionId", "version_id", "generation", "LastModified", "mtime", "created")
    pin: dict[str, Any] = {k: str(info[k]) for k in keys if info.get(k) is not None}
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

    def fetch(
        self, parts: list[tuple[int, int]], dest: np.ndarray, pin: dict[str, Any], landed: Landed = None
    ) -> list[Any]:
        out: list[Any] = []
        for a, b in parts:
            try:
                with self.lock:
                    self.file.seek(a)
                    data = self.file.read(b - a)
                out.append(_placed(dest, a, b, data, landed))
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


def _placed(dest: np.ndarray, a: int, b: int, data: Any, landed: Landed) -> Any:
    """:func:`_place`, then ``landed(a, b)`` when the bytes are in place."""
    err = _place(dest, a, b, data)
    if err is None and landed is not None:
        landed(a, b)
    return err


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
        info = self._info()
        if info.get("type") == "directory":  # not an object (a memmap directory's prefix?)
            raise _Missing()
        pin = _pin_of(info)
        size = pin["size"]
        a = max(0, size - n) if start is None else min(start, size)
        b = min(size, a + n)
        data = bytes(self.fs.cat_file(self.path, start=a, end=b)) if b > a else b""
        return data, a, size, pin

    def fetch(
        self, parts: list[tuple[int, int]], dest: np.ndarray, pin: dict[str, Any], landed: Landed = None
    ) -> list[Any]:
        try:
            got = self.fs.cat_ranges(
                [self.path] * len(parts), [a for a, _ in parts], [b for _, b in parts], on_error="return"
            )
        except Exception as exc:  # noqa: BLE001 - reported per part
            return [exc] * len(parts)
        return [_placed(dest, a, b, d, landed) for (a, b), d in zip(parts, got)]

    def check(self, pin: dict[str, Any]) -> None:
        full = _pin_of(self._info())
        now = {k: full.get(k) for k in pin}
        if now != pin:
            raise _Replaced(f"was {pin}, now {now}")


def _sink_into(dest: np.ndarray, a: int, b: int) -> Callable[[int, int, int], Callable[[int, bytes], int]]:
    """A response sink for the part ``[a, b)``: checks the range the server sent, then writes
    each body chunk straight into ``dest`` (an error when the body runs past ``b``)."""

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

    return sink


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
        kw.setdefault("read_bufsize", READ_BUFSIZE)
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
            # each chunk as the socket gave it (readchunk: no join into larger blocks, no copy)
            # goes straight into place: one copy per byte on our side
            async for chunk, _ in r.content.iter_chunks():
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

    def fetch(
        self, parts: list[tuple[int, int]], dest: np.ndarray, pin: dict[str, Any], landed: Landed = None
    ) -> list[Any]:
        async def one(a: int, b: int, sem: asyncio.Semaphore) -> Any:
            async with sem:
                try:
                    got, _ = await self._get(f"bytes={a}-{b - 1}", pin, _sink_into(dest, a, b))
                except Exception as exc:  # noqa: BLE001 - reported per part
                    return exc
            if got != b - a:
                return ValueError(f"got {got} bytes, expected {b - a} (truncated body)")
            if landed is not None:
                landed(a, b)
            return None

        async def all_parts() -> list[Any]:
            sem = asyncio.Semaphore(CONCURRENCY)
            return list(await asyncio.gather(*(one(a, b, sem) for a, b in parts)))

        return self._run(all_parts())


class _S3(_Transport):
    """s3fs: ``GetObject`` with ``Range``, ``IfMatch`` and the pinned version; each body streamed
    into place as its chunks come (no whole-part ``bytes`` per request, one copy per byte)."""

    #: An S3 request has a high fixed cost (first-byte latency, per-request price; moto copies
    #: the whole object per range): a large read goes in about one part per request slot.
    max_part = 32 << 20

    def __init__(self, fs: Any, path: str, label: str) -> None:
        self.fs, self.path, self.label = fs, path, label
        self.bucket, self.key, self.version = fs.split_path(path)

    async def _get(
        self, rng: str, pin: dict[str, Any] | None, sink: Callable[[int, int, int], Any] | None = None
    ) -> tuple[Any, dict[str, Any]]:
        """One ranged ``GetObject``: ``(body bytes, meta)``, or with ``sink(start, stop, total)``
        (which returns ``put(pos, chunk) -> len``) ``(bytes placed, meta)``."""
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
            text = str(exc)
            if "PreconditionFailed" in text or "412" in text or "pre-condition" in text:
                raise _Replaced("the server refused IfMatch (412)") from None
            if "InvalidRange" in text or "416" in text:
                return (b"" if sink is None else 0), {"size": 0}
            raise
        body = resp["Body"]
        try:
            meta = {"ETag": resp.get("ETag"), "VersionId": resp.get("VersionId")}
            if pin is not None and pin.get("ETag") and meta["ETag"] != pin["ETag"]:
                raise _Replaced(f"ETag {pin['ETag']} became {meta['ETag']}")
            length = resp.get("ContentLength")
            headers = {"Content-Range": resp.get("ContentRange")}
            status = 206 if resp.get("ContentRange") else 200
            if sink is None:
                data: Any = await body.read()
                a, b, total = _parse_range(headers, status, len(data))
            else:
                a, b, total = _parse_range(headers, status, None if length is None else int(length))
            if pin is not None and total is not None and total != pin["size"]:
                raise _Replaced(f"size {pin['size']} became {total}")
            if sink is not None:
                put = sink(a, -1 if b is None else b, -1 if total is None else total)
                data = 0
                content = getattr(getattr(body, "raw_stream", None), "content", None)
                if content is not None and hasattr(content, "iter_chunks"):  # aiohttp: as the socket gave it
                    if hasattr(content, "set_read_chunk_size"):  # (aiohttp >= 3.12) see READ_BUFSIZE
                        content.set_read_chunk_size(READ_BUFSIZE)
                    async for chunk, _ in content.iter_chunks():
                        data += put(data, chunk)
                else:  # another HTTP backend: its own reads
                    while chunk := await body.read(READ_BUFSIZE):
                        data += put(data, chunk)
        finally:
            body.close()
        meta.update(start=a, size=total)
        return data, meta

    def first(self, start: int | None, n: int) -> tuple[bytes, int, int, dict[str, Any]]:
        from fsspec.asyn import sync

        rng = f"bytes=-{n}" if start is None else f"bytes={start}-{start + n - 1}"
        body, meta = sync(self.fs.loop, self._get, rng, None)
        size = int(meta["size"] if meta.get("size") is not None else len(body))
        pin = {k: v for k, v in meta.items() if v is not None and k in ("ETag", "VersionId")}
        pin["size"] = size
        return body, int(meta.get("start") or 0), size, pin

    def fetch(
        self, parts: list[tuple[int, int]], dest: np.ndarray, pin: dict[str, Any], landed: Landed = None
    ) -> list[Any]:
        from fsspec.asyn import sync

        async def one(a: int, b: int, sem: asyncio.Semaphore) -> Any:
            async with sem:
                try:
                    got, _ = await self._get(f"bytes={a}-{b - 1}", pin, _sink_into(dest, a, b))
                except Exception as exc:  # noqa: BLE001 - reported per part
                    return exc
            if got != b - a:
                return ValueError(f"got {got} bytes, expected {b - a} (truncated body)")
            if landed is not None:
                landed(a, b)
            return None

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
        raise InvalidArgumentError(
            f"{target}: cannot open this URL with fsspec: {exc}", path=target
        ) from None
    kind = type(fs).__name__
    if kind == "HTTPFileSystem" and hasattr(fs, "set_session"):
        return _Http(fs, path, target)
    if kind == "S3FileSystem" and hasattr(fs, "_call_s3"):
        return _S3(fs, path, target)
    return _Generic(fs, path, target)
