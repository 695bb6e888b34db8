"""``tdz info URL`` / ``tdz tree URL`` of a remote ``.tdz`` read the tail, the central directory and
the ``meta.json`` entries, not the leaves; a leaf's payload offset reads its local header only, and
its bytes come (CRC checked) when the tensor is made. Counted by the loopback server's log."""

from __future__ import annotations

import io
import json
from contextlib import redirect_stdout

import pytest
import torch

import tdz_numba
from tdz_numba.cli import main

pytest.importorskip("fsspec")
pytest.importorskip("aiohttp")

from servers import RangeServer  # noqa: E402

N, ELEMS = 1000, 16384  # 1,000 float32 leaves of 64 KiB: a 62.6 MiB file


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    server = RangeServer()
    tree = {f"l{i:04d}": torch.full((ELEMS,), float(i)) for i in range(N)}
    p = tdz_numba.save(tree, tmp_path_factory.mktemp("info") / "many.tdz")
    url = server.put("many.tdz", p.read_bytes())
    yield server, url, p
    server.stop()


def _run(args) -> str:
    out = io.StringIO()
    with redirect_stdout(out):
        assert main(args) == 0
    return out.getvalue()


def test_info_reads_the_tail_and_meta_json_only(served):
    server, url, p = served
    size = p.stat().st_size
    server.reset_log()
    d = json.loads(_run(["info", "--json", url]))
    assert d["leaves"] == N and d["file_bytes"] == size
    assert server.requests <= 3 and server.bytes_served < size // 10, (server.requests, server.bytes_served)
    assert d["all_aligned"] is None and d["alignment_unread"] == N  # the local headers are not read
    assert "not read (remote" in _run(["info", url])
    local = json.loads(_run(["info", "--json", str(p)]))
    assert local["all_aligned"] is True and local["alignment_unread"] == 0


def test_tree_reads_local_headers_not_leaves(served):
    server, url, p = served
    server.reset_log()
    _run(["tree", url])
    assert server.bytes_served < p.stat().st_size // 10, (server.requests, server.bytes_served)


def test_leaf_info_reads_its_local_header_then_the_tensor_its_bytes(served):
    server, url, _ = served
    with tdz_numba.open(url) as ar:
        assert len(ar) == N  # the root meta.json
        server.reset_log()
        info = ar.info("l0100")
        assert info.offset % 64 == 0 and info.nbytes == ELEMS * 4
        assert server.requests == 1 and server.bytes_served <= 1024, server.log
        server.reset_log()
        assert torch.equal(ar["l0100"], torch.full((ELEMS,), 100.0))
        assert server.requests == 1 and server.bytes_served <= ELEMS * 4 + 1024, server.log


def test_a_leaf_after_every_local_header_was_read(served, tmp_path):
    """Regression: once the local headers were read (payload offsets known), a leaf was a view of
    bytes never fetched (zeros past the header batch); its bytes are fetched, CRC checked."""
    server = served[0]
    tree = {f"b{i}": torch.full((1 << 19,), float(i)) for i in range(4)}  # 2 MiB apart: not read through
    url = server.put("big.tdz", tdz_numba.save(tree, tmp_path / "big.tdz").read_bytes())
    with tdz_numba.open(url) as ar:
        ar._index.check_all()
        assert torch.equal(ar["b1"], tree["b1"])


def test_a_verified_bulk_fetch_keeps_every_request_slot_busy(served, tmp_path, monkeypatch):
    """Regression: a verified bulk fetch went in groups of 16 MiB (2 parts of 8 MiB: 2 requests in
    flight of 8); 40 MiB now go in one batch of 5 parts, requested together."""
    from tdz_numba.remote import read

    server = served[0]
    tree = {f"w{i}": torch.full((1 << 20,), float(i)) for i in range(10)}  # 40 MiB
    url = server.put("wide40.tdz", tdz_numba.save(tree, tmp_path / "w.tdz").read_bytes())
    batches = []
    get = read.RemoteIndex._get
    monkeypatch.setattr(
        read.RemoteIndex,
        "_get",
        lambda self, spans, *a, **k: batches.append(list(spans)) or get(self, spans, *a, **k),
    )
    with tdz_numba.open(url) as ar:
        back = ar.to_dict()
    assert all(torch.equal(back[k], tree[k]) for k in tree)
    big = [b for b in batches if sum(e - s for s, e in b) > 1 << 20]
    assert len(big) == 1, [sum(e - s for s, e in b) >> 20 for b in batches]
