"""Peak memory of one remote operation, measured in a fresh child process (``tdz bench --remote``).

The parent's memory (its servers, its copies of the objects, whatever it
measured before) is never counted: each operation runs in a new interpreter
(``python -m tdz_numba.bench.rss SPEC``) that first does what the operation
needs besides it (imports, the tree to save, a small warm-up of the same
kind: kernels loaded, the connection pool made), then records its resident
size, runs the operation once and reports how far above that the resident
size went: ``peak_mib``. The peak is the kernel's own high-water mark
(``ru_maxrss``) when the operation raised it, else the highest of the
samples taken every millisecond (``/proc/self/statm``).

Operations (``op`` of the spec): ``load`` (``tdz_numba.load(url)``), ``cat``
(``fs.cat_file``), ``save`` (``tdz_numba.save`` of the benchmark's tree) and
``put`` (``fs.put`` of a local file).

Examples
--------
::

    from tdz_numba.bench.rss import measure
    measure({"op": "cat", "url": "http://127.0.0.1:8000/x.tdz"})  # {'peak_mib': 256.4, 'seconds': 0.61}
"""

from __future__ import annotations

import json
import os
import resource
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

__all__ = ["measure", "rss_bytes", "PeakSampler"]

_PAGE = os.sysconf("SC_PAGE_SIZE") if hasattr(os, "sysconf") else 4096


def rss_bytes() -> int:
    """This process's resident size now (``/proc/self/statm``; 0 where there is none).

    Examples
    --------
    >>> from tdz_numba.bench.rss import rss_bytes
    >>> rss_bytes() > 1 << 20
    True
    """
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * _PAGE
    except OSError:
        return 0


def _maxrss() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # KiB on Linux


class PeakSampler:
    """Samples :func:`rss_bytes` every ``interval`` seconds in a thread; ``peak`` is the highest.

    Examples
    --------
    >>> import mmap
    >>> from tdz_numba.bench.rss import PeakSampler
    >>> with PeakSampler() as s:  # 32 MiB of fresh pages (malloc might reuse resident ones)
    ...     block = mmap.mmap(-1, 32 << 20)
    ...     for k in range(0, 32 << 20, 4096):
    ...         block[k] = 1
    >>> s.peak - s.start >= 16 << 20
    True
    >>> block.close()
    """

    def __init__(self, interval: float = 0.001) -> None:
        """Nothing sampled before ``__enter__``."""
        self.interval = interval
        self.start = self.peak = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while not self._stop.is_set():
            self.peak = max(self.peak, rss_bytes())
            time.sleep(self.interval)

    def __enter__(self) -> PeakSampler:
        """Records the resident size and starts sampling."""
        self.start = self.peak = rss_bytes()
        self._max_before = _maxrss()
        self._thread.start()
        return self

    def __exit__(self, *exc: Any) -> None:
        """Stops sampling; the high-water mark counts if the block raised it."""
        self._stop.set()
        self._thread.join()
        self.peak = max(self.peak, rss_bytes())
        after = _maxrss()
        if after > self._max_before:
            self.peak = max(self.peak, after)


def measure(spec: dict[str, Any], timeout: float = 900) -> dict[str, float]:
    """Runs ``spec`` in a child process; returns ``{"peak_mib": ..., "seconds": ...}``.

    Raises ``RuntimeError`` with the child's last lines if it fails.
    """
    root = str(Path(__file__).resolve().parents[2])  # this copy of tdz_numba, not an installed one
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([root, os.environ.get("PYTHONPATH", "")]))
    proc = subprocess.run(
        [sys.executable, "-m", "tdz_numba.bench.rss", json.dumps(spec)],
        capture_output=True,
        text=True,
        timeout=timeout,
        env=env,
    )
    lines = proc.stdout.strip().splitlines()
    if proc.returncode or not lines:
        tail = (proc.stderr.strip().splitlines() or ["(no output)"])[-1][:200]
        raise RuntimeError(f"{spec.get('op')}: the measuring child failed: {tail}")
    out: dict[str, float] = json.loads(lines[-1])
    return out


def _child(spec: dict[str, Any]) -> dict[str, float]:
    import tempfile

    import fsspec

    op, url = spec["op"], spec["url"]
    opts = spec.get("storage_options") or {}
    fs, path = fsspec.core.url_to_fs(url, **opts)
    run: Any
    with tempfile.TemporaryDirectory() as d:
        if op in ("load", "save"):
            import torch

            import tdz_numba

            small = tdz_numba.save({"w": torch.ones(1 << 16)}, Path(d) / "warm.tdz")
            tdz_numba.load(small)  # the kernels loaded before the measure
        if op == "load":
            fs.cat_file(path, 0, 1)  # the session and its imports
            run = lambda: tdz_numba.load(url, storage_options=opts or None)  # noqa: E731
        elif op == "cat":
            fs.cat_file(path, 0, 1)
            run = lambda: fs.cat_file(path)  # noqa: E731
        elif op == "save":
            from .remote import model

            tree = model(spec["size_mib"])
            warm = url + ".warm.tdz"
            tdz_numba.save({"w": torch.ones(1 << 16)}, warm, storage_options=opts or None)
            fs.rm(fs._strip_protocol(warm))
            run = lambda: tdz_numba.save(tree, url, storage_options=opts or None)  # noqa: E731
        elif op == "put":
            Path(d, "warm").write_bytes(b"x")
            fs.put(str(Path(d, "warm")), path + ".warm")
            fs.rm(path + ".warm")
            run = lambda: fs.put(spec["local"], path)  # noqa: E731
        else:
            raise ValueError(f"unknown op {op!r}")
        with PeakSampler() as sampler:
            t0 = time.perf_counter()
            result = run()
            seconds = time.perf_counter() - t0
        del result
    return {"peak_mib": (sampler.peak - sampler.start) / 2**20, "seconds": seconds}


if __name__ == "__main__":  # pragma: no cover - the child of measure()
    print(json.dumps(_child(json.loads(sys.argv[1]))), flush=True)
