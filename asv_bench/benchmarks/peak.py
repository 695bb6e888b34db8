"""Peak memory of ONE operation, measured in a child process.

asv's ``peakmem_*`` reports the whole benchmark process's peak RSS: the
interpreter, torch and the workload's own tensors (~450-670 MB here), so every
format looks the same. :func:`peak_rss_growth` runs a fresh Python process that
prepares the benchmark (its ``setup``), resets its high-water mark
(``/proc/self/clear_refs``), runs the operation once and reports by how much the
peak RSS grew above the RSS at the start: the memory the operation itself needed,
file-backed pages included. A child process, not ``fork``: Numba's OpenMP
threads do not survive a fork (measured: the forked child hangs).
"""

import os
import subprocess
import sys

HERE = os.path.dirname(os.path.abspath(__file__))

_CHILD = """
import sys
sys.path.insert(0, {here!r})
import peak
from {module} import {cls}
bench = {cls}()
bench.setup(*{params!r})
try:
    print("PEAK", peak.measure_here(lambda: getattr(bench, {method!r})(*{args!r})))
finally:
    bench.teardown(*{params!r})
"""


def _kib(field):
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    raise RuntimeError(f"no {field} in /proc/self/status")


def measure_here(fn):
    """Bytes by which ``fn()`` raises this process's peak RSS above its current RSS."""
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # reset VmHWM to the current RSS
    start = _kib("VmRSS")
    fn()
    return (_kib("VmHWM") - start) * 1024


def peak_rss_growth(module, cls, params, method, args=()):
    """Runs ``cls().setup(*params)`` then ``getattr(obj, method)(*args)`` in a child Python
    and returns the operation's peak RSS growth in bytes."""
    if not os.path.exists("/proc/self/clear_refs"):
        raise NotImplementedError("needs Linux (/proc/self/clear_refs)")
    code = _CHILD.format(
        here=HERE, module=module, cls=cls, params=tuple(params), method=method, args=tuple(args)
    )
    proc = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=600, cwd=os.getcwd()
    )
    for line in proc.stdout.splitlines():
        if line.startswith("PEAK "):
            return int(line.split()[1])
    raise RuntimeError(f"child failed ({proc.returncode}): {proc.stderr[-2000:]}")
