"""Loopback servers for the remote tests and ``tdz bench --remote``: an HTTP server honouring
Range requests (it logs every request and the bytes it served, and injects faults on demand),
and moto's standalone S3 server reached through s3fs (no in-process mocking; in a thread, or
in its own process for benchmarks). Both bind 127.0.0.1 on a free port; the HTTP server runs
in a thread of this process, or in a child for benchmarks (:class:`RangeServerProcess`).

Faults of :class:`RangeServer` (:meth:`RangeServer.inject`), each for the next ``count``
matching GETs: ``"drop"`` (half the body, then the connection is shut), ``"truncate"`` (a
complete-looking reply, ``Content-Length`` included, with half the requested bytes),
``"status"`` (an error status, 503 unless told), ``"stall"`` (the reply waits ``seconds``
before its headers), ``"replace"`` (the object's bytes are replaced by ``data`` before the
reply: a new ``ETag`` and ``Last-Modified``). A GET with ``If-Match`` that does not match the
object's ``ETag`` gets 412.

Examples
--------
>>> import urllib.request
>>> from tdz_numba.bench.servers import RangeServer
>>> server = RangeServer()
>>> url = server.put("x.bin", b"0123456789")
>>> req = urllib.request.Request(url, headers={"Range": "bytes=-3"})
>>> print(urllib.request.urlopen(req).read(), server.requests, server.bytes_served)
b'789' 1 3
>>> server.inject("status", status=503)
>>> try:
...     urllib.request.urlopen(url)
... except urllib.error.HTTPError as e:
...     print(e.code, server.log[-1][0])
503 GET-503
>>> server.stop()
"""

from __future__ import annotations

import os
import re
import socket
import subprocess
import sys
import threading
import time
from dataclasses import dataclass
from email.utils import formatdate
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

__all__ = ["RangeServer", "RangeServerProcess", "MotoS3", "Fault", "FAULTS", "free_port", "main"]

#: The fault kinds of :meth:`RangeServer.inject`.
FAULTS = ("drop", "truncate", "status", "stall", "replace")
_LOGGED = {"truncate": "GET-TRUNCATED", "stall": "GET-STALLED", "replace": "GET-REPLACED"}

_RANGE = re.compile(r"^bytes=(\d*)-(\d*)$")


def free_port() -> int:
    """A TCP port free on 127.0.0.1 now (bound and released)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class RangeServer:
    """Serves in-memory objects ``{"/name": bytes}`` over HTTP/1.1 with Range support.

    ``log`` holds ``(method, path, range header, bytes served)`` per request (a fault's
    method reads ``GET-DROPPED``, ``GET-TRUNCATED``, ``GET-503``, ``GET-STALLED``,
    ``GET-REPLACED``, ``GET-412``); ``drop`` is how many of the next GETs are cut after
    half their body (the same as ``inject("drop", count)``); :meth:`inject` queues the
    other faults. Every object has an ``ETag`` and a ``Last-Modified`` header.
    """

    def __init__(self) -> None:
        """Starts serving at once, in a daemon thread."""
        self.objects: dict[str, bytes] = {}
        self.modified: dict[str, float] = {}
        self.log: list[tuple[str, str, str | None, int]] = []
        self.drop = 0
        self.faults: list[Fault] = []
        self.lock = threading.Lock()
        outer = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *args):  # quiet
                pass

            def _empty(self, status: int, **headers: str) -> None:
                self.send_response(status)
                for k, v in headers.items():
                    self.send_header(k.replace("_", "-"), v)
                self.send_header("Content-Length", "0")
                self.end_headers()

            def _serve(self, body: bool) -> None:
                key = self.path.split("?")[0]
                fault = outer._take_fault(key) if body else None
                if fault is not None and fault.kind == "replace":
                    outer.put(key, fault.data)
                elif fault is not None and fault.kind == "stall":
                    time.sleep(fault.seconds)
                data = outer.objects.get(key)
                if fault is not None and fault.kind == "status":
                    outer._record(f"GET-{fault.status}", self.path, self.headers.get("Range"), 0)
                    self._empty(fault.status)
                    return
                if data is None:
                    outer._record(self.command, self.path, None, 0)
                    self.send_response(404)
                    self.send_header("Content-Length", "0")
                    self.end_headers()
                    return
                size = len(data)
                header = self.headers.get("Range")
                etag = outer.etag(key)
                match = self.headers.get("If-Match")
                if match is not None and match.strip() not in ("*", etag):
                    outer._record(f"{self.command}-412", self.path, header, 0)
                    self._empty(412, ETag=etag)
                    return
                start, stop, status = 0, size, 200
                if header:
                    m = _RANGE.match(header.strip())
                    if not m or (not m.group(1) and not m.group(2)):
                        self.send_response(416)
                        self.send_header("Content-Length", "0")
                        self.end_headers()
                        return
                    a, b = m.group(1), m.group(2)
                    if not a:  # suffix
                        start, stop = max(0, size - int(b)), size
                    else:
                        start, stop = int(a), size if not b else min(size, int(b) + 1)
                    if start >= size and size:
                        self.send_response(416)
                        self.send_header("Content-Range", f"bytes */{size}")
                        self.send_header("Content-Length", "0")
                        self.end_headers()
                        return
                    status = 206
                chunk = memoryview(data)[start:stop]  # no copy of the object's bytes
                with outer.lock:
                    cut = body and outer.drop > 0
                    if cut:
                        outer.drop -= 1
                cut = cut or (fault is not None and fault.kind == "drop")
                short = fault is not None and fault.kind == "truncate"
                if short:  # a well-formed reply with half the bytes asked for
                    chunk = chunk[: len(chunk) // 2]
                # logged before anything is sent: a client that has its reply finds it in the log
                if not body:
                    outer._record(self.command, self.path, header, 0)
                elif cut:
                    outer._record("GET-DROPPED", self.path, header, len(chunk) // 2)
                elif fault is not None:
                    outer._record(_LOGGED[fault.kind], self.path, header, len(chunk))
                else:
                    outer._record(self.command, self.path, header, len(chunk))
                self.send_response(status)
                self.send_header("Content-Length", str(len(chunk)))
                self.send_header("Accept-Ranges", "bytes")
                self.send_header("ETag", etag)
                self.send_header("Last-Modified", formatdate(outer.modified[key], usegmt=True))
                if status == 206:
                    self.send_header("Content-Range", f"bytes {start}-{stop - 1}/{size}")
                self.end_headers()
                if not body:
                    return
                if cut:  # half the body, then the connection drops
                    self.wfile.write(chunk[: len(chunk) // 2])
                    self.wfile.flush()
                    self.close_connection = True
                    self.connection.shutdown(socket.SHUT_RDWR)
                    return
                self.wfile.write(chunk)

            def do_GET(self):
                self._serve(True)

            def do_HEAD(self):
                self._serve(False)

        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.httpd.daemon_threads = True
        self.port = self.httpd.server_address[1]
        self.thread = threading.Thread(target=self.httpd.serve_forever, daemon=True)
        self.thread.start()

    def _record(self, method: str, path: str, rng: str | None, n: int) -> None:
        with self.lock:
            self.log.append((method, path, rng, n))

    def _take_fault(self, key: str) -> Fault | None:
        with self.lock:
            for k, f in enumerate(self.faults):
                if f.path is None or f.path == key:
                    f.count -= 1
                    if f.count <= 0:
                        del self.faults[k]
                    return f
        return None

    def url(self, name: str) -> str:
        """The URL of object ``name``."""
        return f"http://127.0.0.1:{self.port}/{name.lstrip('/')}"

    def put(self, name: str, data: bytes) -> str:
        """Stores (or replaces: a new ``ETag`` and ``Last-Modified``) object ``name``; returns its URL."""
        key = "/" + name.lstrip("/")
        with self.lock:
            self.objects[key] = bytes(data)
            # Last-Modified has a one-second resolution: a replacement moves it on by at least 1 s
            self.modified[key] = max(time.time(), self.modified.get(key, 0.0) + 1.0)
        return self.url(name)

    def etag(self, name: str) -> str:
        """The quoted ``ETag`` of object ``name`` (it changes with the bytes and at every replacement)."""
        key = "/" + name.lstrip("/")
        return (
            f'"{hash(self.objects[key]) & 0xFFFFFFFF:08x}-{int(self.modified[key] * 1000) & 0xFFFFFFFF:08x}"'
        )

    def inject(
        self,
        kind: str,
        count: int = 1,
        *,
        name: str | None = None,
        status: int = 503,
        seconds: float = 30.0,
        data: bytes = b"",
    ) -> None:
        """Queues a fault for the next ``count`` GETs (of object ``name`` only, if given).

        Parameters
        ----------
        kind : str
            One of :data:`FAULTS` (see the module docstring).
        count : int
            How many GETs get it.
        name : str, optional
            Only GETs of this object.
        status : int
            The status of ``"status"`` (default 503).
        seconds : float
            The delay of ``"stall"``.
        data : bytes
            The new bytes of ``"replace"`` (replaced at the first matching GET).
        """
        if kind not in FAULTS:
            raise ValueError(f"unknown fault {kind!r}; choose from {', '.join(FAULTS)}")
        path = None if name is None else "/" + name.lstrip("/")
        with self.lock:
            if kind == "replace":  # once: the object stays replaced
                self.faults.append(Fault(kind, 1, path, status, seconds, bytes(data)))
            else:
                self.faults.append(Fault(kind, int(count), path, status, seconds, b""))

    def clear_faults(self) -> None:
        """Drops every queued fault (``drop`` included)."""
        with self.lock:
            self.faults.clear()
            self.drop = 0

    def reset_log(self) -> None:
        """Empties :attr:`log`."""
        with self.lock:
            self.log.clear()

    @property
    def requests(self) -> int:
        """Requests logged since the last :meth:`reset_log`."""
        return len(self.log)

    @property
    def bytes_served(self) -> int:
        """Body bytes sent since the last :meth:`reset_log` (of cut replies: what was sent)."""
        return sum(n for *_, n in self.log)

    def stop(self) -> None:
        """Stops serving and closes the socket."""
        self.httpd.shutdown()
        self.httpd.server_close()


@dataclass
class Fault:
    """A queued fault of :class:`RangeServer` (see :meth:`RangeServer.inject`)."""

    kind: str
    count: int
    path: str | None
    status: int
    seconds: float
    data: bytes


class RangeServerProcess:
    """A :class:`RangeServer` in a child process (``python -m tdz_numba.bench.servers``) serving
    local files: a benchmark's client then shares no interpreter lock with the server (as
    :class:`MotoS3` with ``process=True``). No request log and no faults (they live in the
    child): tests that count requests or inject faults use :class:`RangeServer`.

    Parameters
    ----------
    files : dict of str to path
        Object name -> local file, read once by the child.

    Examples
    --------
    >>> import tempfile, urllib.request
    >>> from pathlib import Path
    >>> from tdz_numba.bench.servers import RangeServerProcess
    >>> with tempfile.TemporaryDirectory() as d:
    ...     _ = (Path(d) / "x.bin").write_bytes(b"0123456789")
    ...     server = RangeServerProcess({"x.bin": Path(d) / "x.bin"})
    >>> req = urllib.request.Request(server.url("x.bin"), headers={"Range": "bytes=2-4"})
    >>> urllib.request.urlopen(req).read()
    b'234'
    >>> server.stop()
    """

    def __init__(self, files: dict[str, str | os.PathLike[str]]) -> None:
        """Starts the child and waits until it serves every file."""
        args = [f"{name}={os.fspath(path)}" for name, path in files.items()]
        self.process = subprocess.Popen(
            [sys.executable, "-m", "tdz_numba.bench.servers", *args],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
        )
        assert self.process.stdout is not None
        line = self.process.stdout.readline().decode().strip()  # "port N" once every file is read
        if not line.startswith("port "):
            self.stop()
            raise RuntimeError(f"the HTTP server process did not start (it said {line[:100]!r})")
        self.port = int(line.split()[1])

    def url(self, name: str) -> str:
        """The URL of object ``name``."""
        return f"http://127.0.0.1:{self.port}/{name.lstrip('/')}"

    def stop(self) -> None:
        """Stops the child (closing its stdin ends it)."""
        if self.process.stdin is not None and not self.process.stdin.closed:
            self.process.stdin.close()
        try:
            self.process.wait(10)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait()
        if self.process.stdout is not None:
            self.process.stdout.close()


def main(argv: list[str] | None = None) -> int:
    """The child of :class:`RangeServerProcess`: serves ``NAME=PATH`` files, prints ``port N``,
    and stops when its stdin closes."""
    server = RangeServer()
    try:
        for arg in sys.argv[1:] if argv is None else argv:
            name, _, path = arg.partition("=")
            with open(path, "rb") as f:
                server.put(name, f.read())
        print(f"port {server.port}", flush=True)
        sys.stdin.read()  # until the parent closes it (or exits)
    finally:
        server.stop()
    return 0


class MotoS3:
    """moto's standalone S3 server on 127.0.0.1 (a real HTTP server);
    :meth:`fs` gives an s3fs filesystem on it, :attr:`storage_options` the options for URLs.

    Parameters
    ----------
    process : bool
        Serve from a child process (``python -m moto.server``) instead of a thread of this
        one: the benchmark's client then shares no interpreter lock with the server.
    """

    def __init__(self, process: bool = False) -> None:
        """Starts the server and waits until it answers."""
        import logging

        logging.getLogger("werkzeug").setLevel(logging.ERROR)  # one line per request otherwise

        for k, v in {
            "AWS_ACCESS_KEY_ID": "testing",
            "AWS_SECRET_ACCESS_KEY": "testing",
            "AWS_DEFAULT_REGION": "us-east-1",
        }.items():
            os.environ.setdefault(k, v)
        self.server = self.process = None
        if process:
            port = free_port()
            self.process = subprocess.Popen(
                [sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(port)],
                stdout=subprocess.DEVNULL,
                stderr=subprocess.DEVNULL,
            )
            deadline = time.monotonic() + 60
            while True:
                try:
                    socket.create_connection(("127.0.0.1", port), timeout=1).close()
                    break
                except OSError:
                    if self.process.poll() is not None or time.monotonic() > deadline:
                        self.stop()
                        raise RuntimeError("moto's server did not start") from None
                    time.sleep(0.1)
            self.endpoint = f"http://127.0.0.1:{port}"
        else:
            from moto.server import ThreadedMotoServer

            self.server = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
            self.server.start()
            host, port = self.server.get_host_and_port()
            self.endpoint = f"http://{host}:{port}"
        self.storage_options = {
            "key": "testing",
            "secret": "testing",
            "skip_instance_cache": True,
            "client_kwargs": {"endpoint_url": self.endpoint, "region_name": "us-east-1"},
        }

    def fs(self):
        """A new s3fs filesystem on the server."""
        import s3fs

        return s3fs.S3FileSystem(**self.storage_options)

    def stop(self) -> None:
        """Stops the server (and its process)."""
        if self.server is not None:
            self.server.stop()
        if self.process is not None and self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(10)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
