"""Whether asv runs with ``--quick``: the suites then take small sizes (a smoke run of every
benchmark in about a minute, not a measurement).

asv does not tell a benchmark that it runs with ``--quick``; the benchmark runs in a
process below the ``asv run --quick`` command, so the command lines of this process's
ancestors say it (Linux ``/proc``). ``TDZ_ASV_QUICK=1`` (or ``0``) decides instead.
"""

import os


def _ancestor_command_lines(limit=8):
    pid = os.getppid()
    for _ in range(limit):
        if pid <= 1:
            return
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                args = [a.decode("utf-8", "replace") for a in f.read().split(b"\0") if a]
            with open(f"/proc/{pid}/stat") as f:
                ppid = int(f.read().rsplit(")", 1)[1].split()[1])
        except (OSError, ValueError, IndexError):
            return
        yield args
        pid = ppid


def is_quick():
    """``TDZ_ASV_QUICK`` when set, else whether an ancestor is ``asv run ... --quick`` (or ``-q``)."""
    setting = os.environ.get("TDZ_ASV_QUICK")
    if setting is not None:
        return setting.strip().lower() not in ("", "0", "false", "no")
    for args in _ancestor_command_lines():
        runs_asv = any(os.path.basename(a) in ("asv", "asv.exe") or a.endswith("/asv") for a in args[:3])
        if runs_asv and "run" in args and ("--quick" in args or "-q" in args):
            return True
    return False


QUICK = is_quick()
