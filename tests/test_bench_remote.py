"""``tdz bench --remote`` (structure of its figures, never their speed) and the loopback servers'
fault injection (tdz_numba.bench.servers)."""

from __future__ import annotations

import http.client
import json
import subprocess
import sys
import time
import urllib.error
import urllib.request

import pytest

from tdz_numba.bench import remote as bench_remote
from tdz_numba.bench.servers import FAULTS, RangeServer


def _get(url: str, **headers: str) -> tuple[int, dict, bytes]:
    req = urllib.request.Request(url, headers=headers)
    try:
        with urllib.request.urlopen(req, timeout=10) as r:
            return r.status, dict(r.headers), r.read()
    except urllib.error.HTTPError as e:
        return e.code, dict(e.headers), e.read()


@pytest.fixture
def server():
    s = RangeServer()
    yield s
    s.stop()


def test_faults(server):
    data = bytes(range(256)) * 64
    url = server.put("x.bin", data)
    status, head, body = _get(url, Range="bytes=100-1099")
    assert (status, body, head["Content-Range"]) == (206, data[100:1100], f"bytes 100-1099/{len(data)}")
    etag, modified = head["ETag"], head["Last-Modified"]

    server.inject("truncate")  # a well-formed reply with half the bytes
    status, head, body = _get(url, Range="bytes=100-1099")
    assert (status, body, head["Content-Length"]) == (206, data[100:600], "500")
    server.inject("status", 2, status=502)
    assert [_get(url)[0] for _ in range(3)] == [502, 502, 200]
    server.inject("drop")
    with pytest.raises(http.client.IncompleteRead):
        _get(url)
    server.drop = 1  # the older spelling of the same fault
    with pytest.raises(http.client.IncompleteRead):
        _get(url)
    server.inject("stall", seconds=0.3)
    t0 = time.monotonic()
    assert _get(url)[2] == data and time.monotonic() - t0 >= 0.3
    server.put("y.bin", b"other")
    server.inject("status", name="y.bin")  # only GETs of y.bin
    assert _get(url)[0] == 200 and _get(server.url("y.bin"))[0] == 503

    new = data[::-1]
    server.inject("replace", name="x.bin", data=new)
    assert _get(url, **{"If-Match": etag})[0] == 412  # replaced before this reply: the old ETag fails
    status, head, body = _get(url)
    assert body == new and head["ETag"] != etag and head["Last-Modified"] != modified
    assert _get(url, **{"If-Match": head["ETag"]})[0] == 200
    assert [m for m, *_ in server.log] == [
        "GET",
        "GET-TRUNCATED",
        "GET-502",
        "GET-502",
        "GET",
        "GET-DROPPED",
        "GET-DROPPED",
        "GET-STALLED",
        "GET",
        "GET-503",
        "GET-412",
        "GET",
        "GET",
    ]
    server.inject("status", 5)
    server.clear_faults()
    assert _get(url)[0] == 200
    with pytest.raises(ValueError, match="choose from"):
        server.inject("explode")
    assert set(FAULTS) == {"drop", "truncate", "status", "stall", "replace"}


def test_rounds_alternate_and_report_failures():
    order: list[str] = []

    def op(name):
        def run():
            order.append(name)
            if name == "c":
                raise ValueError("unsupported here " + "x" * 300)

        return run

    med, errors = bench_remote._rounds({k: op(k) for k in "abc"}, repeat=2)
    assert order == ["a", "b", "c", "b", "a", "a", "b"]  # warm-up, then reversed, then forward
    assert set(med) == {"a", "b"} and errors["c"].startswith("ValueError: unsupported here")
    assert len(errors["c"]) <= 160


def test_report_fits_100_columns():
    res = {
        "size_mib": 256,
        "repeat": 3,
        "read_all": [
            dict(
                server="http",
                format="tdz",
                load_mib_s=812.5,
                cat_mib_s=900.1,
                ratio=0.9,
                ranges_mib_s=700.0,
                ratio_ranges=0.86,
                error=None,
            ),
            dict(
                server="s3",
                format="safetensors",
                load_mib_s=None,
                cat_mib_s=1e4,
                ratio=None,
                error="BadArchiveError: " + "y" * 200,
                rss_load_mib="n/a",
                rss_cat_mib=12.0,
            ),
        ],
        "save": dict(
            save_mib_s=30.0,
            put_mib_s=31.0,
            ratio=0.97,
            part_mib=16,
            parts_in_flight=8,
            rss_goal_mib=192,
            rss_save_mib=140.2,
            rss_put_mib=500.0,
            error=None,
        ),
        "lazy": [
            dict(
                format="tdz",
                open_requests=2,
                open_bytes=1 << 20,
                load_requests=1,
                load_bytes=42048,
                tensor_bytes=41940,
                beyond_bytes=108,
                error=None,
            ),
            dict(format="gguf", error="BadArchiveError: " + "z" * 300),
        ],
        "dcp": dict(
            save_tdz_s=1.0, save_fs_s=1.1, load_tdz_s=0.5, load_fs_s=0.6, save_ratio=0.91, load_ratio=0.83
        ),
    }
    text = bench_remote.report(res)
    assert max(map(len, text.splitlines())) <= 100, text
    assert (
        "0.90x" in text and "0.86x" in text and "n/a: BadArchiveError" in text and "gguf         n/a" in text
    )
    assert "+140" in text and "1,048,576" in text


def test_cli_remote_small_run():
    """One small run of every section but DCP: every figure present, with the right type."""
    from tdz_numba.remote import transports
    from tdz_numba.remote.object import part_size

    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "tdz_numba",
            "bench",
            "--remote",
            "--size-mib",
            "4",
            "--repeat",
            "1",
            "--json",
        ],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    res = json.loads(proc.stdout)
    assert max(map(len, proc.stderr.splitlines())) <= 100
    assert res["size_mib"] == 4 and res["sections"] == ["http", "s3", "save", "lazy"]
    rows = {(r["server"], r["format"]): r for r in res["read_all"]}
    assert set(rows) == {(s, f) for s in ("http", "s3") for f in ("tdz", "safetensors")}
    for (_server, fmt), r in rows.items():
        assert r["cat_s"] > 0 and isinstance(r["rss_cat_mib"], float), r
        if r["error"] is None:
            assert r["load_s"] > 0 and r["ratio"] == pytest.approx(r["cat_s"] / r["load_s"])
            assert r["ratio_ranges"] == pytest.approx(r["ranges_s"] / r["load_s"])  # the same requests
            assert r["part_bytes"] == part_size(
                r["bytes"], cap=getattr(transports, f"_{_server.title()}").max_part
            )
            assert isinstance(r["rss_load_mib"], float)
        else:  # a format this version cannot read over a URL: reported, not fatal
            assert r["load_s"] is None and r["ratio"] is None and fmt != "tdz"
            assert f"n/a: {r['error'][:40]}" in proc.stderr
    assert rows["http", "tdz"]["bytes"] > 4 << 20
    s = res["save"]
    assert s["error"] is None and s["ratio"] == pytest.approx(s["put_s"] / s["save_s"])
    assert isinstance(s["rss_save_mib"], float) and isinstance(s["rss_put_mib"], float)
    assert s["rss_goal_mib"] == 64 + s["part_mib"] * s["parts_in_flight"]
    lazy = {r["format"]: r for r in res["lazy"]}
    assert list(lazy) == list(bench_remote.LAZY_FORMATS)
    tdz = lazy["tdz"]
    assert tdz["error"] is None and tdz["open_requests"] == 2 and tdz["load_requests"] == 1
    assert tdz["beyond_bytes"] == tdz["load_bytes"] - tdz["tensor_bytes"] >= 0
    for r in lazy.values():
        assert (r["error"] is None) == isinstance(r["open_requests"], int)
