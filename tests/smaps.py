"""This process's mappings as ``/proc/self/smaps`` describes them (Linux), for the tests of advice."""

from __future__ import annotations

import re


def vm_flags(address: int) -> list[str]:
    """The VmFlags of this process's mapping that holds ``address`` (``hg``: MADV_HUGEPAGE,
    ``rr``: MADV_RANDOM)."""
    with open("/proc/self/smaps") as f:
        text = f.read()
    for m in re.finditer(r"^([0-9a-f]+)-([0-9a-f]+) [^\n]*\n((?:[A-Za-z_]+:[^\n]*\n)+)", text, re.M):
        if int(m.group(1), 16) <= address < int(m.group(2), 16):
            line = [ln for ln in m.group(3).splitlines() if ln.startswith("VmFlags:")]
            return line[0].split()[1:] if line else []
    raise AssertionError(f"no mapping holds {address:#x}")
