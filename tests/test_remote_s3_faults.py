"""The S3 transport's faults (remote/transports.py ``_S3``: bodies streamed into place): a proxy
in front of moto's server cuts, shortens or refuses the next ranged GETs of the data; every
fault is retried within bounds or raises a RemoteError naming the URL and the range, and a
verified load never returns other bytes."""

from __future__ import annotations

import http.client
import socket
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest
import torch

import tdz_numba
from tdz_numba.errors import RemoteError

pytest.importorskip("s3fs")
pytest.importorskip("moto.server")

from servers import MotoS3  # noqa: E402

#: Headers the proxy sets itself.
_HOP = ("content-length", "transfer-encoding", "connection", "date", "server")


class FaultProxy:
    """An HTTP proxy to ``endpoint``; ``faults`` (modes the next ranged GETs of object data take,
    one each): ``"drop"`` (half the body, then the connection shut), ``"short"`` (a complete-looking
    reply with half the body) or ``"503"``. ``gets`` counts the ranged data GETs."""

    def __init__(self, endpoint: str) -> None:
        host, port = endpoint.split("//")[1].split(":")
        self.faults: list[str] = []
        self.gets = 0
        self.lock = threading.Lock()
        outer = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *args):  # quiet
                pass

            def _forward(self) -> None:
                n = int(self.headers.get("Content-Length") or 0)
                body = self.rfile.read(n) if n else None
                conn = http.client.HTTPConnection(host, int(port), timeout=30)
                conn.request(self.command, self.path, body=body, headers=dict(self.headers))
                r = conn.getresponse()
                data = r.read()
                conn.close()
                rng = self.headers.get("Range") or ""
                mode = None
                if self.command == "GET" and rng.startswith("bytes=") and not rng.startswith("bytes=-"):
                    with outer.lock:
                        outer.gets += 1
                        mode = outer.faults.pop(0) if outer.faults else None
                if mode == "503":
                    self.send_response(503)
                    self.send_header("Content-Length", "0")
                    self.end_headers()
                    return
                self.send_response(r.status)
                for k, v in r.getheaders():
                    if k.lower() not in _HOP:
                        self.send_header(k, v)
                cut = len(data) // 2 if mode in ("drop", "short") else len(data)
                self.send_header("Content-Length", str(cut if mode == "short" else len(data)))
                self.end_headers()
                self.wfile.write(data[:cut])
                self.wfile.flush()
                if mode == "drop":
                    self.close_connection = True
                    self.connection.shutdown(socket.SHUT_RDWR)

            do_GET = do_HEAD = do_PUT = do_POST = do_DELETE = _forward

        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.httpd.daemon_threads = True
        self.endpoint = f"http://127.0.0.1:{self.httpd.server_address[1]}"
        self.thread = threading.Thread(target=self.httpd.serve_forever, daemon=True)
        self.thread.start()

    def stop(self) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()


@pytest.fixture(scope="module")
def proxied():
    """``(storage_options through the proxy, proxy, tree)``: an 8 MiB archive on moto."""
    server = MotoS3()
    proxy = FaultProxy(server.endpoint)
    try:
        fs = server.fs()
        fs.call_s3("create_bucket", Bucket="faults")
        g = torch.Generator().manual_seed(5)
        tree = {f"w{k}": torch.rand(256 << 10, generator=g) for k in range(8)}  # 8 x 1 MiB
        tdz_numba.save(tree, "s3://faults/m.tdz", storage_options=server.storage_options)
        opts = dict(server.storage_options)
        opts["client_kwargs"] = {**opts["client_kwargs"], "endpoint_url": proxy.endpoint}
        opts["config_kwargs"] = {"retries": {"max_attempts": 1, "mode": "standard"}}  # ours only
        yield opts, proxy, tree
    finally:
        proxy.stop()
        server.stop()


@pytest.fixture
def small_parts(monkeypatch):
    from tdz_numba.remote import read

    monkeypatch.setattr(read, "part_size", lambda total, floor, cap: 1 << 20)  # 1 MiB parts


@pytest.mark.parametrize("fault", ["drop", "short", "503"])
def test_one_fault_is_retried(proxied, small_parts, fault):
    opts, proxy, tree = proxied
    proxy.faults, proxy.gets = [fault], 0
    back = tdz_numba.load("s3://faults/m.tdz", storage_options=opts)
    assert not proxy.faults and proxy.gets > 8  # the data in parts, one of them again
    assert all(torch.equal(back[k], v) for k, v in tree.items())


@pytest.mark.parametrize("fault", ["drop", "short", "503"])
def test_persistent_fault_names_url_and_range(proxied, small_parts, fault):
    opts, proxy, tree = proxied
    proxy.faults = [fault] * 100
    try:
        with pytest.raises(RemoteError, match=r"s3://faults/m\.tdz: reading bytes \[\d+, \d+\).*failed") as e:
            tdz_numba.load("s3://faults/m.tdz", storage_options=opts)
        assert e.value.path == "s3://faults/m.tdz" and e.value.entry  # the first entry of the range
    finally:
        proxy.faults = []
    back = tdz_numba.load("s3://faults/m.tdz", storage_options=opts)  # and then it reads again
    assert all(torch.equal(back[k], v) for k, v in tree.items())
