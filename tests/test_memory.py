"""A save copies nothing: peak RSS grows by far less than the data written."""

import subprocess
import sys

SCRIPT = r"""
import os, resource, sys, torch, tdz_numba
d = sys.argv[1]
tdz_numba.load(tdz_numba.save({"w": {"x": torch.ones(10)}}, os.path.join(d, "warm.tdz")))
tree = {f"g{i}": {f"l{j}": torch.randn(8192) for j in range(20)} for i in range(100)}  # 62.5 MiB
tree["big"] = torch.randn(64, 2048, 128)  # 64 MiB, one leaf
tree["strided"] = torch.randn(512, 2048)[:, ::2]  # non-contiguous: one 4 MiB copy is allowed
base = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
tdz_numba.save(tree, os.path.join(d, "x.tdz"))
print((resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - base) / 1024)
"""


def test_peak_rss_of_a_save_stays_within_64_mib_of_the_source(tmp_path):
    out = subprocess.run([sys.executable, "-c", SCRIPT, str(tmp_path)], capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    grown_mib = float(out.stdout.strip())
    assert grown_mib <= 64, f"save grew peak RSS by {grown_mib:.1f} MiB for ~130 MiB of data"
