"""HTTP bodies streamed into place (remote/transports.py ``_Http``) whatever pieces they come in,
and the benchmark's HTTP server in a child process (bench/servers.py ``RangeServerProcess``)."""

from __future__ import annotations

import io
import re
import threading
import time
import urllib.request
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import numpy as np
import pytest
import torch

from tdz_numba.bench.servers import RangeServerProcess
from tdz_numba.errors import RemoteError
from tdz_numba.remote.object import RemoteObject

DATA = np.random.default_rng(7).integers(0, 256, 3 << 20, dtype=np.uint8).tobytes()


class _Pieces(BaseHTTPRequestHandler):
    """Range replies sent with ``Transfer-Encoding: chunked`` in small uneven HTTP chunks, with
    pauses: aiohttp hands them over in many pieces, some at HTTP chunk ends. ``extra`` bytes
    past the range end the body when set (a server sending more than asked)."""

    protocol_version = "HTTP/1.1"
    extra = 0

    def log_message(self, *args):  # quiet
        pass

    def do_GET(self):
        m = re.match(r"bytes=(\d*)-(\d*)", self.headers.get("Range", ""))
        size = len(DATA)
        if m.group(1):
            a, b = int(m.group(1)), min(size, int(m.group(2)) + 1)
        else:
            a, b = size - int(m.group(2)), size
        self.send_response(206)
        self.send_header("Content-Range", f"bytes {a}-{b - 1}/{size}")
        self.send_header("ETag", '"fixed"')
        self.send_header("Transfer-Encoding", "chunked")
        self.end_headers()
        body = DATA[a:b] + b"x" * type(self).extra
        pos, k = 0, 0
        while pos < len(body):
            n = (1, 7, 4093, 65536, 300_001)[k % 5]
            piece = body[pos : pos + n]
            self.wfile.write(f"{len(piece):x}\r\n".encode() + piece + b"\r\n")
            pos, k = pos + n, k + 1
            if k % 7 == 0:
                self.wfile.flush()
                time.sleep(0.001)
        self.wfile.write(b"0\r\n\r\n")


@pytest.fixture
def pieces():
    handler = type("Handler", (_Pieces,), {})
    httpd = ThreadingHTTPServer(("127.0.0.1", 0), handler)
    httpd.daemon_threads = True
    threading.Thread(target=httpd.serve_forever, daemon=True).start()
    yield handler, f"http://127.0.0.1:{httpd.server_address[1]}/x.bin"
    httpd.shutdown()
    httpd.server_close()


def test_body_in_many_pieces_lands_in_place(pieces):
    _, url = pieces
    obj = RemoteObject(url)
    obj.start(tail=1000)
    assert obj.size == len(DATA) and obj.buffer[-1000:].tobytes() == DATA[-1000:]
    obj.need_spans([(0, 1_500_001), (2_000_000, len(DATA) - 1000)], part_bytes=700_000)
    assert obj.requests == 1 + 3 + 2 and obj.missing(0, obj.size) == [(1_500_001, 2_000_000)]
    assert obj.buffer[:1_500_001].tobytes() == DATA[:1_500_001]
    assert obj.buffer[2_000_000:].tobytes() == DATA[2_000_000:]
    obj.read_all()
    assert obj.buffer.tobytes() == DATA


def test_body_past_the_range_is_an_error(pieces):
    handler, url = pieces
    obj = RemoteObject(url)
    obj.start(tail=10)
    handler.extra = 3  # every reply now runs 3 bytes past what was asked
    with pytest.raises(RemoteError, match=r"\[0, 100000\).*runs past the 100000 bytes"):
        obj.need(0, 100_000)


def test_range_server_process(tmp_path):
    (tmp_path / "a.bin").write_bytes(DATA[:100_000])
    (tmp_path / "b.bin").write_bytes(b"")
    server = RangeServerProcess({"a.bin": tmp_path / "a.bin", "dir/b.bin": tmp_path / "b.bin"})
    try:
        req = urllib.request.Request(server.url("a.bin"), headers={"Range": "bytes=99990-"})
        with urllib.request.urlopen(req, timeout=10) as r:
            assert (r.status, r.read()) == (206, DATA[99_990:100_000])
        with urllib.request.urlopen(server.url("dir/b.bin"), timeout=10) as r:
            assert (r.status, r.read()) == (200, b"")
        obj = RemoteObject(server.url("a.bin"))
        obj.start(tail=10)
        obj.read_all()
        assert obj.buffer.tobytes() == DATA[:100_000]
    finally:
        server.stop()
    assert server.process.returncode == 0  # closing its stdin ended it


def test_range_server_process_reports_a_failed_start(tmp_path):
    with pytest.raises(RuntimeError, match="did not start"):
        RangeServerProcess({"gone.bin": tmp_path / "gone.bin"})


class _Gated(io.BytesIO):
    """A file object whose reads after the first wait (up to ``wait_s``) until ``gate`` is set:
    a read whose CRCs are computed only after its last part would wait the whole time."""

    def __init__(self, data: bytes, gate: threading.Event, wait_s: float) -> None:
        super().__init__(data)
        self.gate, self.wait_s, self.reads, self.opened = gate, wait_s, 0, False
        self.waited: list[bool] = []

    def read(self, n: int = -1) -> bytes:
        if self.opened and n > (64 << 10):  # a data part (not the open's tail read)
            self.reads += 1
            if self.reads > 1:
                self.waited.append(self.gate.wait(self.wait_s))
        return super().read(n)


def test_crcs_are_computed_as_parts_land(tmp_path, monkeypatch):
    """A verified bulk read checks each entry's CRC-32 as soon as the part it lies in has
    landed, while later parts are still to come (not after the last part); values right."""
    import tdz_numba
    from tdz_numba.remote import read
    from tdz_numba.remote.archive import open_remote
    from tdz_numba.zipfmt import checksums

    g = torch.Generator().manual_seed(3)
    tree = {f"w{k}": torch.rand(128 << 10, generator=g) for k in range(8)}  # 8 x 512 KiB
    data = tdz_numba.save(tree, tmp_path / "g.tdz").read_bytes()
    gate = threading.Event()
    real = checksums.stored_crcs

    def crcs(index, rows):
        out = real(index, rows)
        if int(index.table["csize"][rows].max()) > (64 << 10):
            gate.set()  # a tensor's CRC was computed (not only a meta.json's)
        return out

    serial = getattr(read.RemoteIndex, "_serial_crcs", None)

    def serial_crcs(index, rows):
        out = serial(index, rows)  # type: ignore[misc]
        if int(index.table["csize"][rows].max()) > (64 << 10):
            gate.set()
        return out

    monkeypatch.setattr(checksums, "stored_crcs", crcs)  # either way of computing them
    monkeypatch.setattr(read.RemoteIndex, "_serial_crcs", serial_crcs, raising=False)
    monkeypatch.setattr(read, "PART_BYTES", 1 << 20)  # 1 MiB parts: 5 of them
    f = _Gated(data, gate, wait_s=3.0)
    with open_remote(f, tail_bytes=4096) as ar:  # (a tail read holding no tensor)
        f.opened = True
        back = ar.to_dict()
    assert f.reads >= 4
    assert f.waited and all(f.waited)  # the second part waited for a CRC, and got it
    assert all(torch.equal(back[k], v) for k, v in tree.items())
