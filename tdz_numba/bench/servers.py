"""Loopback servers for the remote tests and ``tdz bench --remote``: an HTTP server honouring
Range requests (it logs every request and the bytes it served, and can drop connections),
and moto's standalone S3 server reached through s3fs (no in-process mocking). Both bind
127.0.0.1 on a free port.

Examples
--------
>>> import urllib.request
>>> from tdz_numba.bench.servers import RangeServer
>>> server = RangeServer()
>>> url = server.put("x.bin", b"0123456789")
>>> req = urllib.request.Request(url, headers={"Range": "bytes=-3"})
>>> print(urllib.request.urlopen(req).read(), server.requests, server.bytes_served)
b'789' 1 3
>>> server.stop()
"""

from __future__ import annotations

import os
import re
import socket
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

__all__ = ["RangeServer", "MotoS3", "free_port"]

_RANGE = re.compile(r"^bytes=(\d*)-(\d*)$")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class RangeServer:
    """Serves in-memory objects ``{"/name": bytes}`` over HTTP/1.1 with Range support.

    ``log`` holds ``(method, path, range header, bytes served)`` per request;
    ``drop`` is how many of the next GETs are cut after half their body.
    """

    def __init__(self) -> None:
        """Starts serving at once, in a daemon thread."""
        self.objects: dict[str, bytes] = {}
        self.log: list[tuple[str, str, str | None, int]] = []
        self.drop = 0
        self.lock = threading.Lock()
        outer = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *args):  # quiet
                pass

            def _serve(self, body: bool) -> None:
                data = outer.objects.get(self.path.split("?")[0])
                if data is None:
                    outer._record(self.command, self.path, None, 0)
                    self.send_response(404)
                    self.send_header("Content-Length", "0")
                    self.end_headers()
                    return
                size = len(data)
                header = self.headers.get("Range")
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
                chunk = data[start:stop]
                with outer.lock:
                    cut = body and outer.drop > 0
                    if cut:
                        outer.drop -= 1
                # logged before anything is sent: a client that has its reply finds it in the log
                if not body:
                    outer._record(self.command, self.path, header, 0)
                elif cut:
                    outer._record("GET-DROPPED", self.path, header, len(chunk) // 2)
                else:
                    outer._record(self.command, self.path, header, len(chunk))
                self.send_response(status)
                self.send_header("Content-Length", str(len(chunk)))
                self.send_header("Accept-Ranges", "bytes")
                self.send_header("ETag", f'"{hash(data) & 0xFFFFFFFF:08x}"')
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

    def url(self, name: str) -> str:
        return f"http://127.0.0.1:{self.port}/{name.lstrip('/')}"

    def put(self, name: str, data: bytes) -> str:
        self.objects["/" + name.lstrip("/")] = bytes(data)
        return self.url(name)

    def reset_log(self) -> None:
        with self.lock:
            self.log.clear()

    @property
    def requests(self) -> int:
        return len(self.log)

    @property
    def bytes_served(self) -> int:
        return sum(n for *_, n in self.log)

    def stop(self) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()


class MotoS3:
    """moto's standalone S3 server on 127.0.0.1 (a real HTTP server in a thread);
    :meth:`fs` gives an s3fs filesystem on it, :attr:`storage_options` the options for URLs."""

    def __init__(self) -> None:
        import logging

        from moto.server import ThreadedMotoServer

        logging.getLogger("werkzeug").setLevel(logging.ERROR)  # one line per request otherwise

        for k, v in {
            "AWS_ACCESS_KEY_ID": "testing",
            "AWS_SECRET_ACCESS_KEY": "testing",
            "AWS_DEFAULT_REGION": "us-east-1",
        }.items():
            os.environ.setdefault(k, v)
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
        import s3fs

        return s3fs.S3FileSystem(**self.storage_options)

    def stop(self) -> None:
        self.server.stop()
