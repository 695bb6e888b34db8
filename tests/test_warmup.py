"""First use: the one-line compile notice and ``tdz warmup`` / ``tdz_numba.warmup()``.

Each test runs fresh processes with an empty ``NUMBA_CACHE_DIR``, so they
really compile (tens of seconds on a busy machine).
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from tdz_numba.cli import warmup as warmup_module

ROOT = Path(__file__).resolve().parents[1]
NOTICE = "tdz_numba: compiling Numba kernels for first use"

USE = r"""
import sys, numpy as np, torch, tdz_numba
from tdz_numba.formats.gguf import dequantize
p = sys.argv[1]
tdz_numba.save({"a": torch.arange(10.0), "b": {"c": torch.ones(3, 4)}}, p + "/x.tdz")
assert float(tdz_numba.load(p + "/x.tdz")["a"].sum()) == 45.0
tdz_numba.verify(p + "/x.tdz")
x = torch.arange(50_000, dtype=torch.float32)
tdz_numba.save({"x": x}, p + "/z.tdz", compression="deflate")
assert torch.equal(tdz_numba.load(p + "/z.tdz")["x"], x)
if len(sys.argv) > 2:
    dequantize(np.zeros(34, np.uint8), "Q8_0", (32,))
print("ok")
"""


def _run(args: list[str], cache: Path) -> subprocess.CompletedProcess:
    env = dict(os.environ, NUMBA_CACHE_DIR=str(cache), PYTHONPATH=str(ROOT))
    return subprocess.run([sys.executable, *args], env=env, capture_output=True, text=True, timeout=900)


def test_notice_printed_exactly_once_then_never(tmp_path: Path) -> None:
    cache = tmp_path / "cache"
    first = _run(["-c", USE, str(tmp_path)], cache)
    assert first.returncode == 0, first.stderr
    assert first.stderr.count(NOTICE) == 1, first.stderr
    assert "tdz warmup" in first.stderr
    second = _run(["-c", USE, str(tmp_path)], cache)  # same cache: loaded, not compiled
    assert second.returncode == 0, second.stderr
    assert NOTICE not in second.stderr, second.stderr


def test_warmup_compiles_everything_ahead(tmp_path: Path) -> None:
    cache = tmp_path / "cache"
    warm = _run(["-m", "tdz_numba", "warmup"], cache)
    assert warm.returncode == 0, warm.stderr
    assert NOTICE not in warm.stderr
    out = warm.stdout
    for family in ("CRC, layout, index", "deflate/inflate", "dequantize", "memory pages"):
        assert family in out
    for kernel in (
        "crc32_spans",
        "plan_layout",
        "parse_central",
        "resolve_local",
        "check_local_headers",
        "deflate_segments",
        "inflate_segments",
        "inflate_step",
        "_q4_k",
        "_bf16",
        "touch_pages",
    ):
        assert kernel in out, out
    assert f"cache: {cache}" in out
    used = _run(["-c", USE, str(tmp_path), "gguf"], cache)
    assert used.returncode == 0, used.stderr
    assert NOTICE not in used.stderr, used.stderr
    again = _run(
        [
            "-c",
            "import tdz_numba; r = tdz_numba.warmup(verbose=False); "
            "print(len(r.compiled), len(r.cache_dirs))",
        ],
        cache,
    )
    assert again.returncode == 0, again.stderr
    # one cache directory per package directory holding kernel modules (zipfmt/kernels, files, formats)
    dirs = {m.rpartition(".")[0] for m in warmup_module._KERNEL_MODULES}
    assert len(dirs) == 4 and again.stdout.split() == ["0", str(len(dirs))]
