"""remote/object.py: the pages of a large fetch are faulted in by a thread that leaves the
interpreter lock to the event loop placing the bytes; tdz bench --remote's ``ranges`` column
cuts the parts a load cuts, from the transport's own ``max_part``."""

from __future__ import annotations

import ctypes
import io
import mmap
import threading
import time

import numpy as np
import pytest

from tdz_numba.bench.remote import load_part_bytes
from tdz_numba.files import libc
from tdz_numba.remote import object as remote_object
from tdz_numba.remote import transports
from tdz_numba.remote.object import RemoteObject, part_size

MIB = 1 << 20


def _resident(buf: np.ndarray) -> int:
    """Pages of ``buf`` (page-aligned) resident now (``mincore``)."""
    pages = -(-buf.size // mmap.PAGESIZE)
    vec = (ctypes.c_ubyte * pages)()
    assert libc.function("mincore")(ctypes.c_void_p(buf.ctypes.data), ctypes.c_size_t(buf.size), vec) == 0
    return int(np.frombuffer(vec, np.uint8).__and__(1).sum())


@pytest.mark.skipif(remote_object._POPULATE_WRITE is None, reason="no MADV_POPULATE_WRITE here")
def test_prefault_leaves_the_interpreter_lock_to_other_threads():
    """A 128 MiB part's pages are all faulted in, while another Python thread keeps running:
    ``mmap.madvise`` held the lock for the whole call (~30 ms here), so the event loop that
    places an HTTP body could not run until the pages were in."""
    obj = RemoteObject(io.BytesIO(b""))
    obj.sized(128 * MIB, {})
    assert _resident(obj.buffer) == 0
    ticks: list[float] = []
    stop = threading.Event()

    def tick() -> None:
        while not stop.is_set():
            ticks.append(time.perf_counter())
            time.sleep(0.0005)

    ticker = threading.Thread(target=tick, daemon=True)
    ticker.start()
    time.sleep(0.01)
    t0 = time.perf_counter()
    thread = obj._populate([(0, obj.size)])
    assert thread is not None
    thread.join()
    t1 = time.perf_counter()
    stop.set()
    ticker.join()
    if _resident(obj.buffer) == 0:
        pytest.skip("this kernel refuses MADV_POPULATE_WRITE")
    assert _resident(obj.buffer) == obj.size // mmap.PAGESIZE
    if t1 - t0 < 0.01:
        pytest.skip(f"the pages came in {1e3 * (t1 - t0):.1f} ms: too fast to tell")
    during = [t0, *(t for t in ticks if t0 <= t <= t1), t1]
    longest = max(b - a for a, b in zip(during[:-1], during[1:]))
    assert longest < 0.5 * (t1 - t0), (longest, t1 - t0, len(during))


def test_small_fetch_is_not_prefaulted():
    obj = RemoteObject(io.BytesIO(b""))
    obj.sized(8 * MIB, {})
    assert obj._populate([(0, remote_object.POPULATE_MIN - 1)]) is None


def test_bench_ranges_use_the_transports_max_part(monkeypatch):
    """The ``ranges`` column's parts are those of a load over the same transport (they were
    fixed at 8 MiB for HTTP and 32 MiB for S3 in the bench)."""
    url = "http://127.0.0.1:9/x.tdz"  # (no request is made)
    assert load_part_bytes(url, None, 256 * MIB) == part_size(256 * MIB, cap=8 * MIB) == 8 * MIB
    monkeypatch.setattr(transports._Http, "max_part", 16 * MIB)
    assert load_part_bytes(url, None, 256 * MIB) == 16 * MIB
    assert load_part_bytes(url, None, 64 * MIB) == 8 * MIB  # about one part per request slot
    obj = RemoteObject(url)
    assert obj.max_part == 16 * MIB


def test_a_loaded_remote_tdz_frees_its_object_without_the_collector():
    """The remote object (and its mapping, once the tensors are gone) goes when the load
    returns, not at the next garbage collection: the object kept the index's bound methods
    after a fetch (a cycle index -> object -> index), so a 256 MiB load's mapping stayed
    resident until the collector ran, in some later operation."""
    import gc
    import weakref

    import torch

    import tdz_numba

    tree = {f"w{k}": torch.rand(1 << 16) for k in range(8)}
    buf = io.BytesIO()
    tdz_numba.save(tree, buf)
    made: list[weakref.ref] = []
    start = RemoteObject.start

    def recording_start(self, **kw):
        start(self, **kw)
        made.append(weakref.ref(self))

    gc.collect()
    gc.disable()
    try:
        with pytest.MonkeyPatch.context() as mp:
            mp.setattr(RemoteObject, "start", recording_start)
            out = tdz_numba.load(buf)
        assert len(made) == 1 and made[0]() is None
        assert all(torch.equal(out[k], tree[k]) for k in tree)  # (the views keep the bytes)
    finally:
        gc.enable()
