"""The demo: build sample data, save it, open it lazily, verify it, compare with peers.

Run ``python -m tdz_numba.cli.demo`` (``--quick`` for a small sample, ``--keep DIR``
to keep the files).
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

import tdz_numba

__all__ = ["sample_tree", "main"]


def sample_tree(groups: int = 100, leaves: int = 20, values: int = 33_554, seed: int = 0) -> dict:
    """A replay-buffer-like tree: ``groups`` x ``leaves`` float32 leaves plus a few
    uint8 frames, index tensors and plain metadata (the seed's "small" workload
    at its default size: 100 x 20 x 33,554 float32 values, 256 MiB)."""
    g = torch.Generator().manual_seed(seed)
    tree: dict = {
        "frames": torch.randint(0, 255, (64, 3, 84, 84), dtype=torch.uint8, generator=g),
        "index": torch.arange(64, dtype=torch.int64),
        "info": {"env": "CartPole-v1", "seed": seed, "tags": ["demo", "sample"]},
    }
    for i in range(groups):
        tree[f"group_{i:03d}"] = {f"leaf_{j:02d}": torch.randn(values, generator=g) for j in range(leaves)}
    return tree


def _best(fn, repeat: int = 3) -> float:
    times = []
    for _ in range(repeat):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m tdz_numba.cli.demo", description=__doc__)
    parser.add_argument("--quick", action="store_true", help="a small sample (10 x 20 leaves)")
    parser.add_argument("--keep", type=Path, help="directory to keep the archive in")
    args = parser.parse_args(argv)
    groups, values = (10, 4096) if args.quick else (100, 33_554)
    tree = sample_tree(groups=groups, values=values)
    nbytes = sum(
        t.numel() * t.element_size()
        for g in tree.values()
        if isinstance(g, dict)
        for t in g.values()
        if isinstance(t, torch.Tensor)
    )
    print(f"sample: {groups} groups x 20 float32 leaves + frames ({nbytes / 2**20:.1f} MiB of leaves)")
    with tempfile.TemporaryDirectory() as tmp:
        out = args.keep or Path(tmp)
        out.mkdir(parents=True, exist_ok=True)
        path = out / "demo.tdz"
        tdz_numba.save({"warmup": torch.zeros(4)}, out / "warmup.tdz")  # JIT / cache load
        tdz_numba.load(out / "warmup.tdz")
        t_save = _best(lambda: tdz_numba.save(tree, path))
        t_open = _best(lambda: tdz_numba.open(path).close())
        with tdz_numba.open(path) as ar:
            t_read = _best(lambda: sum(float(ar[k].sum()) for k in ("group_000/leaf_00", "frames")))
            print(repr(ar).splitlines()[0])
            print("\n".join(repr(ar).splitlines()[1:8]) + "\n  ...")
            info = ar.info("group_000/leaf_00")
            print(
                f"leaf group_000/leaf_00: offset {info.offset} (64-aligned: {info.offset is not None and info.offset % 64 == 0}), "
                f"{info.nbytes} bytes, crc {info.crc:#010x}, zero-copy: {info.zero_copy}"
            )
            same = (
                ar["group_000/leaf_00"].untyped_storage().data_ptr()
                == ar["frames"].untyped_storage().data_ptr()
            )
            print(f"all leaves share one mapping: {same}; info: {ar['info']['env']!r}")
            assert torch.equal(ar["group_007/leaf_03"], tree["group_007"]["leaf_03"])
        report = tdz_numba.verify(path)
        print(report)
        size = path.stat().st_size
        print(
            f"save {t_save * 1e3:.1f} ms ({size / t_save / 2**30:.2f} GiB/s), "
            f"open (lazy) {t_open * 1e3:.2f} ms, read 2 leaves {t_read * 1e3:.2f} ms"
        )
        try:
            from tensordict import TensorDict
        except ImportError:
            print("(install tensordict==0.15.3 to compare with its .tdz writer)")
        else:
            import warnings

            warnings.filterwarnings("ignore", category=FutureWarning)
            td = TensorDict.from_dict({k: v for k, v in tree.items() if k != "info"})
            t_td = _best(lambda: td.save(out / "td.tdz"), repeat=1)
            t_td_open = _best(lambda: TensorDict.load_memmap(path), repeat=1)
            back = TensorDict.load_memmap(path)
            assert torch.equal(back["group_001", "leaf_02"], tree["group_001"]["leaf_02"])
            print(
                f"tensordict 0.15.3: save {t_td * 1e3:.1f} ms ({t_td / t_save:.1f}x ours), "
                f"load_memmap of our archive {t_td_open * 1e3:.1f} ms: values equal"
            )
        np.testing.assert_equal(tdz_numba.load(path)["index"].numpy(), np.arange(64))
    print("demo OK")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
