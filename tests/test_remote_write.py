"""S3 saves through concurrent multipart uploads (tdz_numba.remote.upload), against moto's real
S3 server on 127.0.0.1: parts in flight bounded, the object committed at close only, aborted on
any error with an existing object intact and no pending upload, the same bytes as a local save."""

from __future__ import annotations

import asyncio
import io
import threading
import tracemalloc

import numpy as np
import pytest
import torch

import tdz_numba
from tdz_numba.errors import InvalidArgumentError, RemoteError
from tdz_numba.remote import upload
from tdz_numba.remote import write as remote_write
from tdz_numba.tdz.tree import flatten
from tdz_numba.zipfmt import packers

s3fs = pytest.importorskip("s3fs")
pytest.importorskip("moto.server")

from servers import MotoS3  # noqa: E402

MiB = 1 << 20
BUCKET = "wbucket"


@pytest.fixture(scope="module")
def s3():
    server = MotoS3(process=True)  # its memory is not this process's (tracemalloc below)
    server.fs().call_s3("create_bucket", Bucket=BUCKET)
    yield server
    server.stop()


@pytest.fixture
def calls(monkeypatch):
    """Every S3 call (s3fs's ``_error_wrapper``, which all of them go through) as ``(method, body
    bytes)``; ``state["max"]``: most upload_parts at once (each held ~20 ms so that concurrent ones
    overlap); ``state["fail"]``: the part number or the method to fail; ``state["consume"]``: the part
    whose first attempt reads its whole body, then times out (s3fs retries it)."""
    state = {"now": 0, "max": 0, "log": [], "fail": None, "delay": 0.02, "consume": None, "attempts": 0}
    lock = threading.Lock()
    real = s3fs.core._error_wrapper

    async def traced(func, *, args=(), kwargs=None, retries):
        method, kw = func.__name__, kwargs or {}
        body = kw.get("Body")
        n = 0 if body is None else (len(body.getbuffer()) if isinstance(body, io.BytesIO) else len(body))
        with lock:
            state["log"].append((method, n))
        if method == state["fail"]:
            raise OSError(f"injected failure of {method}")
        if method == state["consume"]:
            func = _flaky(func, state)
        if method != "upload_part":
            return await real(func, args=args, kwargs=kwargs, retries=retries)
        with lock:
            state["now"] += 1
            state["max"] = max(state["max"], state["now"])
        try:
            await asyncio.sleep(state["delay"])
            if kw.get("PartNumber") == state["fail"]:
                raise OSError(f"injected failure of part {state['fail']}")
            if kw.get("PartNumber") == state["consume"]:
                func = _flaky(func, state)
            return await real(func, args=args, kwargs=kwargs, retries=retries)
        finally:
            with lock:
                state["now"] -= 1

    monkeypatch.setattr(s3fs.core, "_error_wrapper", traced)
    return state


def _flaky(func, state):
    """``func`` whose first attempt reads the whole body, then times out (retryable for s3fs)."""

    async def flaky(**kw):
        state["attempts"] += 1
        if state["attempts"] == 1:  # the request went out, all of the body read, no reply
            if hasattr(kw["Body"], "read"):
                kw["Body"].read()
            raise TimeoutError("injected: no reply")
        return await func(**kw)

    return flaky


def _pending(s3) -> list:
    return s3.fs().call_s3("list_multipart_uploads", Bucket=BUCKET).get("Uploads", [])


def _object(s3, key: str) -> bytes:
    fs = s3.fs()
    return fs.cat_file(f"{BUCKET}/{key}")


def _tree(mib: int, seed: int = 0) -> dict:
    g = torch.Generator().manual_seed(seed)
    return {"w": torch.rand(mib * MiB // 4 - 1000, generator=g), "b": {"x": torch.arange(1000)}}


def test_parts_concurrent_bounded_and_bytes_of_a_local_save(s3, calls, monkeypatch, tmp_path):
    monkeypatch.setattr(packers, "dos_datetime", lambda *a: (0, 33))  # the one field that differs
    tree = _tree(23)
    url = f"s3://{BUCKET}/many.tdz"
    remote_write.save_remote(
        flatten(tree), url, storage_options=s3.storage_options, block_size=5 * MiB, parts_in_flight=3
    )
    methods = [m for m, _ in calls["log"]]
    assert methods[0] == "create_multipart_upload" and methods[-1] == "complete_multipart_upload"
    local = tdz_numba.save(tree, tmp_path / "many.tdz").read_bytes()
    assert _object(s3, "many.tdz") == local
    parts = [n for m, n in calls["log"] if m == "upload_part"]
    assert parts == [5 * MiB] * 4 + [len(local) - 20 * MiB]  # in order of sending, the last one short
    assert calls["max"] == 3  # concurrent, and never more than parts_in_flight
    assert _pending(s3) == []


def test_object_appears_at_close_only(s3, calls):
    fs = s3.fs()
    data = np.random.default_rng(1).integers(0, 256, 13 * MiB, dtype=np.uint8).tobytes()
    f = upload.MultipartStream(fs, f"{BUCKET}/late.bin", part_size=5 * MiB, parts_in_flight=2)
    for k in range(0, len(data), 3 * MiB + 7):  # writes that straddle part boundaries
        assert f.write(memoryview(data)[k : k + 3 * MiB + 7]) == len(data[k : k + 3 * MiB + 7])
    assert f.tell() == len(data)
    [up] = [u for u in _pending(s3) if u["Key"] == "late.bin"]  # parts sent, nothing committed
    assert not fs.exists(f"{BUCKET}/late.bin")
    f.close()
    f.close()  # (twice: nothing more)
    assert _object(s3, "late.bin") == data
    assert f.parts == 3 and 1 <= f.peak_in_flight <= 2
    assert _pending(s3) == []
    with pytest.raises(ValueError):
        f.write(b"x")
    assert up["UploadId"]


def test_retried_part_is_sent_whole(s3, calls):
    """s3fs retries a part with the same arguments: the body is rewound for every attempt (it was
    left at its end, and the retry sent an empty part that S3 completed the upload with)."""
    fs = s3.fs()
    data = np.random.default_rng(3).integers(0, 256, 13 * MiB, dtype=np.uint8).tobytes()
    calls["consume"] = 3  # the last part: the one an empty retry would silently cut
    with upload.MultipartStream(fs, f"{BUCKET}/retried.bin", part_size=5 * MiB) as f:
        f.write(data)
    assert calls["attempts"] == 2
    assert _object(s3, "retried.bin") == data
    calls["consume"], calls["attempts"] = "put_object", 0  # a small object: one PUT, retried
    with upload.MultipartStream(fs, f"{BUCKET}/retried-small.bin", part_size=5 * MiB) as f:
        f.write(data[: 3 * MiB])
    assert calls["attempts"] == 2
    assert _object(s3, "retried-small.bin") == data[: 3 * MiB]


def test_small_object_one_put_no_upload(s3, calls):
    url = f"s3://{BUCKET}/small.tdz"
    tree = {"a": torch.arange(10)}
    tdz_numba.save(tree, url, storage_options=s3.storage_options)
    methods = [m for m, _ in calls["log"]]
    assert "put_object" in methods and "create_multipart_upload" not in methods, methods
    assert tdz_numba.load(url, storage_options=s3.storage_options)["a"].tolist() == list(range(10))


@pytest.mark.parametrize("where", ["part", "writer"])
def test_error_aborts_and_keeps_the_old_object(s3, calls, monkeypatch, where):
    url = f"s3://{BUCKET}/keep.tdz"
    old = {"v": torch.arange(100)}
    tdz_numba.save(old, url, storage_options=s3.storage_options)
    if where == "part":
        calls["fail"] = 3  # part 3 fails on the server side (after s3fs's retries)
    else:
        real = remote_write._write

        def failing(stream, data):  # a Python-level error in the writer, after parts went out
            if memoryview(data).nbytes > 17 * MiB:  # the big payload: 17 MiB of it, then the error
                real(stream, memoryview(data).cast("B")[: 17 * MiB])
                raise ValueError("writer failed")
            return real(stream, data)

        monkeypatch.setattr(remote_write, "_write", failing)
    with pytest.raises(RemoteError) as info:
        remote_write.save_remote(
            flatten(_tree(24, seed=3)),
            url,
            storage_options=s3.storage_options,
            block_size=5 * MiB,
            parts_in_flight=2,
        )
    assert url in str(info.value)
    assert ("injected failure of part 3" if where == "part" else "writer failed") in str(info.value)
    assert [m for m, _ in calls["log"]].count("abort_multipart_upload") == 1
    assert sum(m == "upload_part" for m, _ in calls["log"]) >= 2  # parts had gone out
    assert _pending(s3) == []  # no incomplete upload left behind
    assert tdz_numba.load(url, storage_options=s3.storage_options)["v"].tolist() == list(range(100))


def test_commit_failure_aborts(s3, calls, monkeypatch):
    fs = s3.fs()
    f = upload.MultipartStream(fs, f"{BUCKET}/nocommit.bin", part_size=5 * MiB, parts_in_flight=2)
    f.write(bytes(11 * MiB))
    calls["fail"] = "complete_multipart_upload"
    with pytest.raises(RemoteError, match="nocommit.bin: commit failed: OSError: injected failure"):
        f.close()
    assert [m for m, _ in calls["log"]][-2:] == ["complete_multipart_upload", "abort_multipart_upload"]
    assert not fs.exists(f"{BUCKET}/nocommit.bin") and _pending(s3) == []


def test_part_size_grows(s3, calls, monkeypatch):
    monkeypatch.setattr(upload, "GROW_EVERY", 2)
    fs = s3.fs()
    data = np.random.default_rng(2).integers(0, 256, 36 * MiB, dtype=np.uint8).tobytes()
    calls["delay"] = 0
    with upload.MultipartStream(fs, f"{BUCKET}/grow.bin", part_size=5 * MiB) as f:
        f.write(data)
    parts = [n for m, n in calls["log"] if m == "upload_part"]
    assert parts == [5 * MiB, 5 * MiB, 10 * MiB, 10 * MiB, 6 * MiB]
    assert _object(s3, "grow.bin") == data


def test_memory_bounded_by_parts_in_flight(s3, calls):
    """Python memory of a 60 MiB upload with 3 parts of 5 MiB in flight stays near 4 parts' worth
    (a bytes body costs one more copy per part in flight, a bytearray two)."""
    fs = s3.fs()
    chunk = bytes(MiB)
    with upload.MultipartStream(fs, f"{BUCKET}/warm.bin", part_size=5 * MiB) as f:
        f.write(chunk)  # the client made outside the trace
    tracemalloc.start()
    try:
        f = upload.MultipartStream(fs, f"{BUCKET}/mem.bin", part_size=5 * MiB, parts_in_flight=3)
        for _ in range(60):
            f.write(chunk)
        f.close()
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert f.peak_in_flight == 3
    assert peak < 4 * 5 * MiB * 1.15 + 3 * MiB, peak / MiB
    assert fs.size(f"{BUCKET}/mem.bin") == 60 * MiB


def test_bad_arguments(s3):
    fs = s3.fs()
    with pytest.raises(InvalidArgumentError, match="5 MiB"):
        upload.MultipartStream(fs, f"{BUCKET}/x", part_size=MiB)
    with pytest.raises(InvalidArgumentError, match="parts_in_flight"):
        upload.MultipartStream(fs, f"{BUCKET}/x", parts_in_flight=0)
    assert upload.supports_multipart(fs)
    with pytest.raises(RemoteError):  # a missing bucket: named, no object
        tdz_numba.save(
            {"a": torch.ones(3)}, "s3://no-such-bucket-tdz/x.tdz", storage_options=s3.storage_options
        )


def test_save_digest_to_url_and_file_object(tmp_path):
    """``save(tree, url, digest=True)`` (refused before) streams the digests into the central
    records: the same digests and object size as a local save with digests; a deep verify
    checks them; a file object gets them too."""
    pytest.importorskip("xxhash")
    import fsspec

    g = torch.Generator().manual_seed(9)
    tree = {"a": {"w": torch.rand(1000, generator=g)}, "b": torch.arange(7), "e": torch.zeros(0)}
    url = "memory://tdz-digest/d.tdz"
    tdz_numba.save(tree, url, digest=True)
    local = tdz_numba.save(tree, tmp_path / "d.tdz", digest=True)
    buf = io.BytesIO()
    tdz_numba.save(tree, buf, digest=True)
    with (
        tdz_numba.open(url) as ar,
        tdz_numba.open(local) as lo,
        tdz_numba.open(io.BytesIO(buf.getvalue())) as fo,
    ):
        for k in ("a/w", "b", "e"):
            assert lo.info(k).digest is not None or k == "e"  # (an empty leaf has no entry)
            assert ar.info(k).digest == lo.info(k).digest == fo.info(k).digest, k
    assert fsspec.filesystem("memory").size("/tdz-digest/d.tdz") == local.stat().st_size
    copy = tmp_path / "copy.tdz"  # (a deep verify reads local files)
    copy.write_bytes(fsspec.filesystem("memory").cat_file("/tdz-digest/d.tdz"))
    assert tdz_numba.verify(copy, deep=True).digests == tdz_numba.verify(local, deep=True).digests >= 2
    fsspec.filesystem("memory").rm("/tdz-digest", recursive=True)
