"""asv suite: deflate-compressed save and load of tdz_numba, serial and parallel.

Parameters: layout (``images_flat``: ONE uint8 leaf of image-like data, which
exercises the parallelism within an entry (4 MiB segments); ``images_small``:
the same images as 100 groups x 20 leaves, parallelism across entries) x size
(MiB) x ``num_threads`` (1 = serial, 2 = parallel). The data is the image-like
workload of ``tdz bench --compression deflate`` (about 3.5x with deflate).
``time_load_deflate`` = ``tdz_numba.load`` (inflates every leaf in one batch) +
``float(t.sum())`` of every leaf. Numba kernels are compiled (or loaded from
cache) in ``setup``, never timed.

Run from the repository root: ``cd asv_bench && ../.venv/bin/asv run --python=same --quick --bench compressed``.
"""

import os
import shutil
import tempfile
import warnings

warnings.filterwarnings("ignore")


class Deflate:
    params = (["images_flat", "images_small"], [16, 64], [1, 2])
    param_names = ["layout", "size_mib", "num_threads"]
    timeout = 300

    def setup(self, layout, size_mib, num_threads):
        try:
            import torch
            from zlib_ng import zlib_ng  # noqa: F401  (the deflate codec)

            import tdz_numba
            from tdz_numba.bench import make_workload, sum_tree  # the data and the sums of tdz bench
        except ImportError as exc:
            raise NotImplementedError(f"missing: {exc}") from None
        self.sum_tree = sum_tree  # float(t.sum()) of every leaf (numpy's for uint8 leaves)
        self.dir = tempfile.mkdtemp(prefix="tdz-asv-deflate-", dir=os.getcwd())
        try:
            # JIT: the deflate and inflate kernels on this thread count, with an entry cut
            # into several 4 MiB segments
            warm = os.path.join(self.dir, "warm.tdz")
            tiny = {"a": {"b": torch.arange(9 << 18, dtype=torch.int32) % 251}, "c": torch.ones(100)}
            tdz_numba.save(tiny, warm, compression="deflate", num_threads=num_threads)
            sum_tree(tdz_numba.load(warm, num_threads=num_threads))
            os.unlink(warm)
        except (NotImplementedError, TypeError, ValueError) as exc:  # no deflate / num_threads support
            shutil.rmtree(self.dir, ignore_errors=True)
            raise NotImplementedError(f"compressed save/load unavailable: {exc}") from None
        self.tree = make_workload(layout, size_mib).tree
        self.path = os.path.join(self.dir, "a.tdz")
        self.out = os.path.join(self.dir, "b.tdz")
        tdz_numba.save(self.tree, self.path, compression="deflate", num_threads=num_threads)

    def teardown(self, *args):
        shutil.rmtree(self.dir, ignore_errors=True)

    def time_save_deflate(self, layout, size_mib, num_threads):
        import tdz_numba

        tdz_numba.save(self.tree, self.out, compression="deflate", num_threads=num_threads)

    def time_load_deflate(self, layout, size_mib, num_threads):
        import tdz_numba

        self.sum_tree(tdz_numba.load(self.path, num_threads=num_threads))

    def track_size_ratio(self, layout, size_mib, num_threads):
        """Uncompressed bytes / archive size."""
        nbytes = 0
        stack = [self.tree]
        while stack:
            for v in stack.pop().values():
                if isinstance(v, dict):
                    stack.append(v)
                else:
                    nbytes += v.nbytes
        return nbytes / os.path.getsize(self.path)

    track_size_ratio.unit = "x"
