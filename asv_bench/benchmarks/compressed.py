"""asv suite: deflate-compressed save and load, tdz_numba against its peers side by side.

Parameters: layout (``images_flat``: ONE uint8 leaf of image-like data, which
exercises the parallelism within an entry (4 MiB segments); ``images_small``:
the same images as 100 groups x 20 leaves, parallelism across entries) x size
(MiB; ``asv run --quick``: 1 MiB, ``images_small`` only) x implementation:

* ``tdz_numba`` (all threads) and ``tdz_numba_1t`` (``num_threads=1``);
* ``td_tdz``: tensordict 0.15.3's own compressed archive
  (``td.save(p, compression="deflate")``, ``TensorDict.load_memmap(p, num_threads=cores)``);
* ``zlib_ng``: one raw-deflate stream per leaf on one thread, no container: the
  single-thread codec throughput.

These are the formats of ``tdz bench --compression deflate`` (``tdz_numba.bench``'s
public ``COMPRESSED_CLASSES``), on the same data (about 3.5x with deflate). ``load``
= open + inflate + ``float(t.sum())`` of every leaf. Numba kernels are compiled (or
loaded from cache) in ``setup``, never timed.

Run from the repository root: ``cd asv_bench && ../.venv/bin/asv machine --yes &&
../.venv/bin/asv run --python=same --quick --bench compressed``.
"""

import os
import shutil
import tempfile
import warnings
from pathlib import Path

try:
    from .quick import QUICK
except ImportError:  # asv imports benchmark files as top-level modules
    from quick import QUICK

warnings.filterwarnings("ignore")

#: MiB per workload (``asv run --quick``: 1 MiB, a smoke run; see quick.py).
SIZES = [1] if QUICK else [16, 64]
#: ``--quick``: ``images_small`` only (each benchmark is a process importing torch: a quick
#: run's time is mostly the number of parameter combinations).
LAYOUTS = ["images_small"] if QUICK else ["images_flat", "images_small"]
IMPLS = ["tdz_numba", "tdz_numba_1t", "td_tdz", "zlib_ng"]


class _Setup:
    params = (LAYOUTS, SIZES, IMPLS)
    param_names = ["layout", "size_mib", "impl"]
    timeout = 300

    def setup(self, layout, size_mib, impl):
        try:
            import torch

            import tdz_numba
            from tdz_numba.bench import COMPRESSED_CLASSES, make_workload, sum_tree
        except ImportError as exc:
            raise NotImplementedError(f"missing: {exc}") from None
        if impl == "td_tdz":
            try:
                import tensordict  # noqa: F401
            except ImportError:
                raise NotImplementedError("tensordict not installed") from None
        self.fmt = COMPRESSED_CLASSES[impl]("deflate", None)
        self.dir = Path(tempfile.mkdtemp(prefix="tdz-asv-deflate-", dir=os.getcwd()))
        # JIT: the deflate and inflate kernels, with an entry cut into several 4 MiB segments
        warm = self.dir / "warm.tdz"
        n = (1 << 18) if QUICK else (9 << 18)  # 9 << 18 int32: an entry of several 4 MiB segments
        tiny = {"a": {"b": torch.arange(n, dtype=torch.int32) % 251}, "c": torch.ones(100)}
        threads = [(1 if impl == "tdz_numba_1t" else None)] if QUICK else [None, 1]
        for nt in threads:
            tdz_numba.save(tiny, warm, compression="deflate", num_threads=nt)
            sum_tree(tdz_numba.load(warm, num_threads=nt))
        warm.unlink()
        self.w = make_workload(layout, size_mib)
        self.path = self.dir / f"a{self.fmt.suffix}"
        self.out = self.dir / f"b{self.fmt.suffix}"
        self.fmt.save(self.w, self.path)

    def teardown(self, *args):
        shutil.rmtree(self.dir, ignore_errors=True)


class Deflate(_Setup):
    def time_save_deflate(self, layout, size_mib, impl):
        self.fmt.save(self.w, self.out)

    def time_load_deflate(self, layout, size_mib, impl):
        self.fmt.read(self.w, self.path)


class DeflateRatio(_Setup):
    """The size ratio (a class of its own: ``--quick`` checks it for tdz_numba only)."""

    params = (LAYOUTS, SIZES, ["tdz_numba"]) if QUICK else _Setup.params

    def track_size_ratio(self, layout, size_mib, impl):
        """Uncompressed bytes / file size."""
        return self.w.nbytes / os.path.getsize(self.path)

    track_size_ratio.unit = "x"
