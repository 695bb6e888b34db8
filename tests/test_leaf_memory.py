"""Archive.evict / prefetch / resident / stream / caps: memory control per leaf."""

import os
import subprocess
import sys
import textwrap

import numpy as np
import pytest
import torch

import tdz_numba
from tdz_numba.errors import InvalidArgumentError, MissingKeyError
from tdz_numba.files.memory import PAGE_SIZE

MIB = 1 << 20


def _save(tmp_path, align="auto", n=4, size=MIB, name="x.tdz"):
    tree = {f"w{i}": torch.full((size // 4,), float(i + 1)) for i in range(n)}
    tree["small"] = torch.arange(10)
    p = tdz_numba.save(tree, tmp_path / name, align=align)
    os.sync()  # clean page cache pages: evicted pages can leave the cache too
    return p, tree


def test_evict_drops_exactly_one_leaf(tmp_path):
    p, _ = _save(tmp_path)
    with tdz_numba.open(p) as ar:
        ar.prefetch(touch=True)
        assert all(ar.resident(f"w{i}") == 1.0 for i in range(4))
        dropped = ar.evict("w1")
        assert dropped == MIB  # page-aligned (align="auto"), whole pages
        assert ar.resident("w1") == 0.0
        assert ar.resident("w0") == 1.0 and ar.resident("w2") == 1.0 and ar.resident("w3") == 1.0
        assert float(ar["w1"].sum()) == 2.0 * (MIB // 4)  # read again from the file
        assert ar.info("w1").evictable and not ar.info("small").evictable


def test_evict_a_level_and_caps(tmp_path):
    tree = {"layers": {f"l{i}": torch.ones(MIB // 4) for i in range(3)}, "other": torch.ones(MIB // 4)}
    p = tdz_numba.save(tree, tmp_path / "x.tdz", align=4096)
    with tdz_numba.open(p) as ar:
        ar.prefetch("layers", touch=True)
        ar.prefetch("other", touch=True)
        assert ar.evict("layers") == 3 * MIB
        assert ar.resident("layers") == 0.0 and ar.resident("other") == 1.0
        caps = ar.caps
        assert caps.map and caps.evict and caps.verify and caps.alignment >= 4096
        assert ar.info("other").caps.evict
    # tensordict's 64-byte layout: mapped, not evictable leaf by leaf
    q = tdz_numba.save(tree, tmp_path / "y.tdz")
    with tdz_numba.open(q) as ar:
        assert ar.caps.map and not ar.caps.evict and ar.caps.alignment >= 64


def test_evict_keeps_rplus_writes(tmp_path):
    p, _ = _save(tmp_path)
    with tdz_numba.open(p, mode="r+") as ar:
        ar["w2"][:1000] = 42.0
        ar.evict("w2")
        assert float(ar["w2"][:1000].sum()) == 42.0 * 1000
    with tdz_numba.open(p) as ar:  # on disk
        assert float(ar["w2"][:1000].sum()) == 42.0 * 1000


def test_evict_discards_private_writes_in_mode_r(tmp_path):
    p, tree = _save(tmp_path)
    with tdz_numba.open(p) as ar:
        t = ar["w2"]
        t[:1000] = 42.0  # private copy-on-write pages
        ar.evict("w2")
        assert torch.equal(t, tree["w2"])  # documented: the file's bytes come back


def test_stream_order_values_and_arguments(tmp_path):
    p, tree = _save(tmp_path, n=5)
    with tdz_numba.open(p) as ar:
        got = [(k, float(t.sum())) for k, t in ar.stream()]
        offsets = [ar.info(k).offset for k, _ in got]
        assert offsets == sorted(offsets)  # file order
        assert dict(got) == {k: float(v.sum()) for k, v in tree.items()}
        sub = [k for k, _ in ar.stream(["w3", "w0"], prefetch=0, evict=False)]
        assert sub == ["w0", "w3"]
        with pytest.raises(InvalidArgumentError):
            list(ar.stream(prefetch=-1))
        with pytest.raises(MissingKeyError):
            ar.evict("nope")


_CHILD = textwrap.dedent("""
    import sys, torch, tdz_numba
    path, how = sys.argv[1], sys.argv[2]
    with tdz_numba.open(path) as ar:  # kernels loaded (or compiled) before the measurement
        list(ar)
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")
    def kib(field):
        for line in open("/proc/self/status"):
            if line.startswith(field + ":"):
                return int(line.split()[1])
    start = kib("VmRSS")
    total = 0.0
    with tdz_numba.open(path) as ar:
        if how == "stream":
            for _, t in ar.stream():
                total += float(t.sum())
        else:
            for t in ar.to_dict().values():
                total += float(t.sum())
    print(total, (kib("VmHWM") - start) * 1024)
""")


@pytest.mark.skipif(not os.path.exists("/proc/self/clear_refs"), reason="needs Linux")
def test_stream_peak_rss_is_bounded(tmp_path):
    """16 leaves of 16 MiB (256 MiB): streaming stays <= 2 x the largest leaf + 128 MiB
    (measured in a child process, file-backed pages included); to_dict touches it all."""
    n, leaf = 16, 16 * MIB
    tree = {f"w{i:02d}": torch.full((leaf // 4,), 1.0) for i in range(n)}
    p = tdz_numba.save(tree, tmp_path / "big.tdz", align="auto")
    del tree
    os.sync()
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join(filter(None, [os.getcwd(), os.environ.get("PYTHONPATH")])),
    }
    peaks = {}
    for how in ("stream", "to_dict"):
        proc = subprocess.run(
            [sys.executable, "-c", _CHILD, str(p), how], capture_output=True, text=True, timeout=300, env=env
        )
        assert proc.returncode == 0, proc.stderr[-2000:]
        total, peak = proc.stdout.split()
        assert float(total) == n * leaf / 4
        peaks[how] = int(peak)
    assert peaks["stream"] <= 2 * leaf + 128 * MIB, peaks
    print("peak RSS growth (MiB):", {k: round(v / MIB, 1) for k, v in peaks.items()})
    assert peaks["to_dict"] > peaks["stream"] + 64 * MIB, peaks


def test_numpy_view_of_mapping_is_page_aligned(tmp_path):
    p, _ = _save(tmp_path, align=4096)
    with tdz_numba.open(p) as ar:
        arr = ar.numpy("w0")
        assert arr.ctypes.data % PAGE_SIZE == 0
        assert np.all(arr == 1.0)


@pytest.mark.parametrize("align", ["auto", None])
def test_copy_direct_equals_buffered(tmp_path, align):
    tree = {f"w{i}": torch.randn(MIB // 4 + i * 1000) for i in range(3)}
    tree["small"] = torch.arange(5)
    p = tdz_numba.save(tree, tmp_path / "d.tdz", align=align)
    a = tdz_numba.load(p, copy=True, direct=True)
    b = tdz_numba.load(p, copy=True)
    for k, v in tree.items():
        assert torch.equal(a[k], v) and torch.equal(b[k], v)
        assert a[k].untyped_storage().data_ptr() != b[k].untyped_storage().data_ptr()
    if align == "auto":  # page-aligned leaves land in page-aligned owned buffers
        assert a["w0"].data_ptr() % PAGE_SIZE == 0


def test_copy_direct_falls_back_where_refused(tmp_path, monkeypatch):
    import errno

    tree = {"w": torch.randn(MIB // 2)}
    p = tdz_numba.save(tree, tmp_path / "d.tdz", align="auto")
    real_open = os.open

    def refusing_open(path, flags, *args, **kwargs):
        if flags & getattr(os, "O_DIRECT", 0):
            raise OSError(errno.EINVAL, "Invalid argument")
        return real_open(path, flags, *args, **kwargs)

    monkeypatch.setattr(os, "open", refusing_open)
    assert torch.equal(tdz_numba.load(p, copy=True, direct=True)["w"], tree["w"])
