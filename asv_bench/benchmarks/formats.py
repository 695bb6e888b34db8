"""asv suite: tdz_numba against torch.save, safetensors and tensordict, side by side.

Parameters: layout (``flat``: few large leaves, ``small``: 100 groups x 20 leaves)
x size (MiB: 16 and 64) x format; under ``asv run --quick`` (see quick.py) a smoke run:
1 MiB, the ``small`` layout only with 10 groups, peak memory of tdz_numba only. ``time_*`` for save, lazy open and open + read of every
leaf; ``track_peak_rss_*`` for the memory ONE save or read needs (peak RSS growth
in a child process, see ``peak.py``: asv's own ``peakmem_*`` is the whole process's
peak, the same for every format). Numba kernels are compiled (or loaded from
cache) in ``setup``, never timed.

Run from the repository root (no prompt: ``asv machine --yes`` records this machine first):
``cd asv_bench && ../.venv/bin/asv machine --yes && ../.venv/bin/asv run --python=same --quick``
(a smoke run at quick sizes: see docs/performance.md; without ``--quick`` for measurements).
"""

import os
import shutil
import tempfile
import warnings

import torch

try:
    from .peak import peak_rss_growth
    from .quick import QUICK
except ImportError:  # asv imports benchmark files as top-level modules
    from peak import peak_rss_growth
    from quick import QUICK

warnings.filterwarnings("ignore")

FORMATS = ["tdz_numba", "safetensors", "torch", "td_tdz"]
#: MiB per workload (``asv run --quick``: 1 MiB, a smoke run; see quick.py).
SIZES = [1] if QUICK else [16, 64]
#: Layouts (``--quick``: only ``small``, with 10 groups: every benchmark is one process that
#: imports torch, so a quick run's time is mostly the number of parameter combinations).
LAYOUTS = ["small"] if QUICK else ["flat", "small"]
GROUPS = 10 if QUICK else 100


def make_tree(layout, size_mib):
    g = torch.Generator().manual_seed(0)
    total = size_mib * (1 << 20) // 4
    if layout == "flat":
        rows = max(1, total // 8 // 4096)
        return {f"w{i}": torch.randn(rows, 4096, generator=g) for i in range(8)}
    per = max(1, total // (GROUPS * 20))
    return {
        f"group_{i:03d}": {f"leaf_{j:02d}": torch.randn(per, generator=g) for j in range(20)}
        for i in range(GROUPS)
    }


def flat_keys(tree):
    out = {}
    for k, v in tree.items():
        if isinstance(v, dict):
            out.update({f"{k}.{kk}": vv for kk, vv in v.items()})
        else:
            out[k] = v
    return out


class _Base:
    params = (LAYOUTS, SIZES, FORMATS)
    param_names = ["layout", "size_mib", "format"]
    timeout = 300

    def setup(self, layout, size_mib, fmt):
        import tdz_numba

        self.dir = tempfile.mkdtemp(prefix="tdz-asv-", dir=os.getcwd())
        self.tree = make_tree(layout, size_mib)
        self.flat = flat_keys(self.tree)
        self.path = os.path.join(self.dir, "a")
        tdz_numba.load(tdz_numba.save({"x": {"y": torch.ones(3)}}, os.path.join(self.dir, "w.tdz")))
        if fmt == "td_tdz":
            try:
                from tensordict import TensorDict
            except ImportError:
                raise NotImplementedError("tensordict not installed") from None
            self.td = TensorDict(self.tree)
        if fmt == "safetensors":
            try:
                import safetensors  # noqa: F401
            except ImportError:
                raise NotImplementedError("safetensors not installed") from None
        self.save(fmt)

    def teardown(self, *args):
        shutil.rmtree(self.dir, ignore_errors=True)

    def save(self, fmt):
        if os.path.exists(self.path):
            os.unlink(self.path)
        if fmt == "tdz_numba":
            import tdz_numba

            tdz_numba.save(self.tree, self.path)
        elif fmt == "safetensors":
            from safetensors.torch import save_file

            save_file(self.flat, self.path)
        elif fmt == "torch":
            torch.save(self.flat, self.path)
        else:
            self.td.save(self.path + ".tdz")

    def open(self, fmt):
        if fmt == "tdz_numba":
            import tdz_numba

            return tdz_numba.open(self.path)
        if fmt == "safetensors":
            from safetensors import safe_open

            return safe_open(self.path, "pt")
        if fmt == "torch":
            return torch.load(self.path, mmap=True, weights_only=True)
        from tensordict import TensorDict

        return TensorDict.load_memmap(self.path + ".tdz")

    def read_all(self, fmt):
        h = self.open(fmt)
        total = 0.0
        if fmt == "tdz_numba":
            for key, _ in h.leaves():
                total += float(h[key].sum())
        elif fmt == "safetensors":
            for key in h.keys():
                total += float(h.get_tensor(key).sum())
        elif fmt == "torch":
            for t in h.values():
                total += float(t.sum())
        else:
            for t in h.values(True, True):
                total += float(t.sum())
        return total


class Save(_Base):
    def time_save(self, layout, size_mib, fmt):
        self.save(fmt)


class Open(_Base):
    def time_open(self, layout, size_mib, fmt):
        self.open(fmt)


class Read(_Base):
    def time_read_all(self, layout, size_mib, fmt):
        self.read_all(fmt)


class Peak(_Base):
    """Peak RSS growth of one save and one read (a child process each: seconds of imports,
    so ``--quick`` measures only tdz_numba)."""

    params = (["small"], SIZES, ["tdz_numba"]) if QUICK else _Base.params

    def track_peak_rss_save(self, layout, size_mib, fmt):
        return peak_rss_growth("formats", "Save", (layout, size_mib, fmt), "save", (fmt,))

    track_peak_rss_save.unit = "bytes"

    def track_peak_rss_read_all(self, layout, size_mib, fmt):
        return peak_rss_growth("formats", "Read", (layout, size_mib, fmt), "read_all", (fmt,))

    track_peak_rss_read_all.unit = "bytes"
