"""``tdz warmup`` compiles every kernel signature the package uses, and nothing outlives a script.

After ``tdz warmup`` into an EMPTY ``NUMBA_CACHE_DIR``, a fresh process runs the
demo, a load (lazy open, small index path and the kernel path), a touching
prefetch of an archive, a verify, a convert, a GGUF dequantize and the CLI's
show/info/tree/verify: no compile
notice may appear (each would be seconds of LLVM on a user's first call). The
listener of :mod:`tdz_numba.jit.firstuse` names what was compiled, so a failure
says which kernel and signature the warm-up missed.

The background warm-up is off by default: a plain save/load script starts no
process (``TDZ_NUMBA_BACKGROUND_WARMUP=1`` opts in).
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
NOTICE = "tdz_numba: compiling Numba kernels for first use"

USE = r"""
import io, sys, contextlib
import numpy as np, torch, tdz_numba
from tdz_numba.jit import firstuse
from tdz_numba.cli import demo

d = sys.argv[1]
with contextlib.redirect_stdout(io.StringIO()):
    demo.main(["--quick"])
tree = {"a": torch.arange(10.0), "b": {"c": torch.ones(3, 4)}, "s": "text"}
p = tdz_numba.save(tree, d + "/x.tdz")
assert float(tdz_numba.load(p)["a"].sum()) == 45.0
big = tdz_numba.save({f"k{i}": torch.full((3,), float(i)) for i in range(3000)}, d + "/big.tdz")
assert float(tdz_numba.load(big)["k2999"][0]) == 2999.0
with tdz_numba.open(big) as ar:
    assert float(ar["k17"][1]) == 17.0
    ar.prefetch(touch=True)
with tdz_numba.open(p) as ar:
    ar.prefetch("b", touch=True)
    assert ar["b"]["c"].sum() == 12
tdz_numba.verify(p)
tdz_numba.verify(big)
z = tdz_numba.save({"x": torch.arange(50_000, dtype=torch.float32)}, d + "/z.tdz", compression="deflate")
assert torch.equal(tdz_numba.load(z)["x"], torch.arange(50_000, dtype=torch.float32))
tdz_numba.verify(z)
with tdz_numba.open(z) as ar:  # one compressed leaf, lazily
    assert float(ar["x"][5]) == 5.0
torch.save({"w": torch.arange(6.0).reshape(2, 3), "b": torch.ones(2)}, d + "/m.pt")
assert float(tdz_numba.load(d + "/m.pt")["w"][1, 2]) == 5.0
c = tdz_numba.save({"w": torch.ones(1 << 20), "s": torch.arange(3.0)}, d + "/c.tdz")  # 4 MiB: the copy kernel
assert float(tdz_numba.load(c, copy=True)["w"].sum()) == 1 << 20
assert float(tdz_numba.load(d + "/m.pt", copy=True)["w"][1, 2]) == 5.0  # a read-only mapping
from safetensors.torch import save_file
save_file({"w": torch.arange(6.0).reshape(2, 3)}, d + "/m.safetensors")
tdz_numba.convert(d + "/m.safetensors", d + "/m.tdz")
tdz_numba.verify(d + "/m.tdz")
import gguf
w = gguf.GGUFWriter(d + "/m.gguf", "llama")
T = gguf.GGMLQuantizationType
rng = np.random.default_rng(0)
rows = rng.standard_normal((2, 256)).astype(np.float32)
w.add_tensor("q8", gguf.quants.quantize(rows, T.Q8_0), raw_dtype=T.Q8_0)
w.add_tensor("bf16", gguf.quants.quantize(rows, T.BF16), raw_dtype=T.BF16)
w.add_tensor("q4k", rng.integers(0, 256, (2, 144), dtype=np.uint8), raw_dtype=T.Q4_K)  # random blocks
w.add_tensor("f32", rows)
w.write_header_to_file(); w.write_kv_data_to_file(); w.write_tensors_to_file(); w.close()
with tdz_numba.open(d + "/m.safetensors") as ar:
    ar.prefetch(touch=True)
with tdz_numba.open(d + "/m.gguf") as ar:
    for k in ("q8", "bf16", "q4k", "f32"):
        assert ar.dequantize(k).shape == (2, 256)
tdz_numba.verify(d + "/m.gguf")
import h5py
with h5py.File(d + "/m.h5", "w") as f:  # contiguous datasets: located by the header kernels
    f.create_dataset("w", data=np.arange(6.0).reshape(2, 3))
    f.create_group("g").create_dataset("i", data=np.arange(4, dtype=np.int32))
    f["s"] = np.array(["a", "bc"], dtype=h5py.string_dtype())  # global heap: walked by its kernel
with h5py.File(d + "/m2.h5", "w", libver="latest") as f:  # object header v2, link messages
    f.create_dataset("w", data=np.arange(3.0))
for h in ("/m.h5", "/m2.h5"):
    assert float(tdz_numba.load(d + h)["w"].sum()) in (15.0, 3.0)
assert tdz_numba.load(d + "/m.h5")["g"]["i"].tolist() == [0, 1, 2, 3]
assert tdz_numba.load(d + "/m.h5")["s"] == ["a", "bc"]
from tdz_numba.cli import command
with contextlib.redirect_stdout(io.StringIO()):
    for argv in (["show", z, "x"], ["info", z], ["tree", z], ["verify", z], ["show", d + "/m.gguf", "q4k"]):
        assert command.main([str(a) for a in argv]) == 0, argv
print("compiled:", sorted(set(firstuse.compiled)))
"""


def _run(args: list[str], cache: Path, **env: str) -> subprocess.CompletedProcess:
    full = dict(os.environ, NUMBA_CACHE_DIR=str(cache), PYTHONPATH=str(ROOT), **env)
    full.pop("TDZ_NUMBA_KERNELS", None)  # the user's default: auto
    return subprocess.run([sys.executable, *args], env=full, capture_output=True, text=True, timeout=1200)


def test_after_warmup_nothing_compiles(tmp_path: Path) -> None:
    pytest.importorskip("gguf")
    pytest.importorskip("safetensors")
    cache = tmp_path / "cache"
    assert not cache.exists()  # empty: the warm-up compiles everything itself
    warm = _run(["-m", "tdz_numba", "warmup"], cache)
    assert warm.returncode == 0, warm.stderr
    assert NOTICE not in warm.stderr
    for mode in ("auto", "always"):  # the default choice of path, and the kernels everywhere
        work = tmp_path / mode
        work.mkdir()
        used = _run(["-c", USE, str(work)], cache, TDZ_NUMBA_KERNELS=mode)
        assert used.returncode == 0, used.stderr[-3000:]
        assert NOTICE not in used.stderr, (mode, used.stdout, used.stderr[-3000:])
        assert "compiled: []" in used.stdout, (mode, used.stdout)


def test_warmup_signatures_listed_in_one_place() -> None:
    from tdz_numba.cli import warmup

    listed = warmup.kernel_signatures()
    assert listed, "no signatures enumerated"
    dispatchers = warmup.kernel_dispatchers()
    for name in listed:
        assert name in dispatchers, name  # every entry names a real kernel
    # touch_pages runs on both mappings an archive has: read-only (r) and private copy-on-write
    assert len(listed["tdz_numba.files.page_kernels.touch_pages"]) >= 2


def test_first_use_notice_says_how_to_warm() -> None:
    from tdz_numba.jit.firstuse import NOTICE as TEXT

    assert "tdz warmup" in TEXT and "python -m tdz_numba warmup" in TEXT


def test_no_background_process_by_default(tmp_path: Path) -> None:
    from tdz_numba.jit import policy

    env = {k: v for k, v in os.environ.items() if k not in ("PYTEST_CURRENT_TEST", "CI")}
    env.pop("TDZ_NUMBA_BACKGROUND_WARMUP", None)
    code = (
        "import sys, subprocess; sys.modules.pop('pytest', None)\n"
        "started = []\n"
        "real = subprocess.Popen\n"
        "class Spy(real):\n"
        "    def __init__(self, args, *a, **k):\n"
        "        started.append(list(args) if not isinstance(args, str) else [args])\n"
        "        super().__init__(args, *a, **k)\n"
        "subprocess.Popen = Spy\n"
        "import torch, tdz_numba\n"
        "from tdz_numba.jit import policy\n"
        "print('enabled', policy.background_enabled())\n"
        "p = tdz_numba.save({'a': torch.zeros(3)}, sys.argv[1] + '/a.tdz')\n"
        "tdz_numba.load(p)\n"
        "print('warm', policy.kernels_warm())\n"
        "print('spawned', [a for a in started if 'tdz_numba.cli.warmup' in ' '.join(map(str, a))])\n"
    )
    env.update(NUMBA_CACHE_DIR=str(tmp_path / "cache"), PYTHONPATH=str(ROOT), TDZ_NUMBA_KERNELS="auto")
    out = subprocess.run(
        [sys.executable, "-c", code, str(tmp_path)], env=env, capture_output=True, text=True, timeout=600
    )
    assert out.returncode == 0, out.stderr
    assert "enabled False" in out.stdout and "warm False" in out.stdout, out.stdout
    assert "spawned []" in out.stdout, out.stdout
    assert policy.background_enabled() is False  # (here too, whatever the environment)


def _record() -> None:
    """``python tests/test_warmup_complete.py --record``: runs the warm-up's paths and the
    workloads above in this process (kernels forced) and prints the signature table."""
    import tempfile

    os.environ["TDZ_NUMBA_KERNELS"] = "always"
    sys.path.insert(0, str(ROOT))  # this checkout's tdz_numba, not an installed one
    from tdz_numba.cli import warmup

    warmup.warmup(verbose=False)
    with tempfile.TemporaryDirectory() as d:
        sys.argv = [sys.argv[0], d]
        exec(compile(USE, "<workloads>", "exec"), {"__name__": "__workloads__"})
    print(warmup.signature_table())


if __name__ == "__main__":  # pragma: no cover - a maintainer's tool
    if sys.argv[1:] == ["--record"]:
        _record()
