"""The hostile-file campaign (issue 23): every hostile input through every op, each case in its
own child process (address-space limit, a timeout per op), outcomes counted by category.

The cases: the hostile classes of issue 23 as the tests build them (``.pt`` pickles nested a
million levels deep or blowing the memo/stack/opcode budgets, stride-0 views of 10^9 elements,
odd keys; memmap directories whose leaves, levels or ``other.pickle`` lead outside the folder
or are FIFOs or ``/dev/zero``; HDF5 virtual datasets, external storage pointing at
``/etc/passwd`` and external/soft links through other files; the damaged HDF5 files that once
hung libhdf5, and variable-length string/sequence/compound datasets, fill values and chunks
whose global heap holds a 0-byte free-space object, ``tests/test_formats_hdf5_vlen.py``), plus every kept ``.tdz`` fuzz mutant (``tests/fixtures/hostile``). Ops:
``read`` (the reader's source, every leaf), ``open`` (``to_dict``), ``load``, ``convert`` (to
.tdz, its bytes scanned) and ``tdz info``. A secret planted outside each input's folder (and
``/etc/passwd``'s first bytes) must never appear in what an op returns.

Categories: ``ok``, ``refused`` (a :class:`~tdz_numba.TdzError`, or ``tdz info`` exiting
non-zero with a message), and the failures ``crash`` (the child died), ``hang`` (an op ran
past its timeout), ``memory`` (``MemoryError``), ``stray`` (another exception) and ``leak``
(an outside byte came back).

Usage: ``python scripts/campaign_hostile.py [--jobs 2] [--json OUT] [-v]`` (a few minutes);
exits 1 on any failure.
"""

from __future__ import annotations

import argparse
import gzip
import json
import sys
import tempfile
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))

from hostile_child import OPS, run_ops  # noqa: E402

FAILURES = ("crash", "hang", "memory", "stray", "leak")
#: Cases per child (a child that dies is rerun case by case).
BATCH = 12


def _cases(tmp: Path) -> list[dict]:
    """Every case: ``{"family", "name", "path", "ops", "options"}``."""
    import test_memmapdir_hdf5_hostile as mh
    import test_pt_hostile as ph
    from test_formats_hdf5_vlen import vlen_files

    cases = []
    pt = tmp / "pt"
    pt.mkdir()
    for name, path in ph.make_seeds(pt).items():
        ops = ["open"] if name.startswith("many") else ["open", "load", "convert", "info"]
        cases.append({"family": "torch .pt", "name": f"pt:{name}", "path": str(path), "ops": ops})
    md = tmp / "memmap"
    md.mkdir()
    for c in mh._memmap_cases(md):
        cases.append({**c, "family": "memmap dir", "name": f"memmap:{c['name']}"})
    hd = tmp / "hdf5"
    hd.mkdir()
    for c in mh._hdf5_cases(hd):
        cases.append({**c, "family": "hdf5", "name": f"hdf5:{c['name']}"})
        cases.append(
            {
                **c,
                "family": "hdf5",
                "name": f"hdf5:{c['name']}+allow",
                "ops": ["read"],
                "options": {"allow_external": True},
            }
        )
    for name, (_ok, bad) in vlen_files(hd / "vlen").items():  # damaged heaps behind vlen datasets
        cases.append({"family": "hdf5", "name": f"hdf5:vlen_{name}_bad", "path": str(bad), "ops": list(OPS)})
    for p in sorted((ROOT / "tests" / "fixtures").glob("hdf5_*_mutant_hang.h5")):
        cases.append({"family": "hdf5", "name": f"hdf5:{p.name}", "path": str(p), "ops": list(OPS)})
    td = tmp / "tdz"
    td.mkdir()
    for p in sorted((ROOT / "tests" / "fixtures" / "hostile").glob("*.bin.gz")):
        q = td / (p.name.removesuffix(".bin.gz") + ".tdz")
        q.write_bytes(gzip.decompress(p.read_bytes()))
        cases.append(
            {
                "family": ".tdz mutants",
                "name": f"tdz:{q.stem}",
                "path": str(q),
                "ops": ["open", "load", "info"],
            }
        )
    return cases


def _category(r: dict | None) -> str:
    if r is None:
        return "crash"
    if r["leaks"]:
        return "leak"
    out = r["outcome"]
    if out == "ok":
        return "ok"
    if out.startswith("STRAY: timed out"):
        return "hang"
    if out.startswith("STRAY: MemoryError"):
        return "memory"
    if out.startswith("STRAY"):
        return "stray"
    return "refused"


def _run(batch: list[dict], markers: list[bytes], work: Path, timeout: int) -> list[dict]:
    """The cases of ``batch`` in one child; when the child dies, each case again in its own
    child, so that a crash is pinned on its case and the others still run."""
    work.mkdir(parents=True, exist_ok=True)
    try:
        results = run_ops(batch, markers, work, timeout=timeout)
    except Exception:  # noqa: BLE001 - AssertionError (the child died) or TimeoutExpired
        if len(batch) > 1:
            return [row for i, c in enumerate(batch) for row in _run([c], markers, work / str(i), timeout)]
        results = {}
    rows = []
    for case in batch:
        for op in case["ops"]:
            r = results.get((case["name"], op))
            rows.append(
                {
                    "family": case["family"],
                    "case": case["name"],
                    "op": op,
                    "category": _category(r),
                    "outcome": (r or {}).get("outcome", "no result: the child died"),
                }
            )
    return rows


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--jobs", type=int, default=2, help="children at once (default 2)")
    ap.add_argument("--timeout", type=int, default=15, help="seconds per op (default 15)")
    ap.add_argument("--json", type=Path, help="write every (case, op) outcome here")
    ap.add_argument("-v", "--verbose", action="store_true", help="print every failure")
    args = ap.parse_args(argv)
    import test_memmapdir_hdf5_hostile as mh

    with tempfile.TemporaryDirectory() as d:
        tmp = Path(d)
        cases = _cases(tmp)
        markers = [mh.SECRET[:8]] + ([mh._passwd_marker()] if mh.PASSWD.is_file() else [])
        with ThreadPoolExecutor(args.jobs) as pool:
            batches = [cases[i : i + BATCH] for i in range(0, len(cases), BATCH)]
            futures = [
                pool.submit(_run, b, markers, tmp / "work" / str(i), args.timeout)
                for i, b in enumerate(batches)
            ]
            rows = [row for f in futures for row in f.result()]
    cats = ["ok", "refused", *FAILURES]
    by = Counter((r["family"], r["category"]) for r in rows)
    n_cases = Counter(r["family"] for r in {(r["family"], r["case"]): r for r in rows}.values())
    print(f"{'family':14}{'cases':>7}{'ops':>6}" + "".join(f"{c:>9}" for c in cats))
    for fam in sorted(n_cases):
        cells = [by[(fam, c)] for c in cats]
        print(f"{fam:14}{n_cases[fam]:>7}{sum(cells):>6}" + "".join(f"{x:>9}" for x in cells))
    total = Counter(r["category"] for r in rows)
    print(f"{'all':14}{sum(n_cases.values()):>7}{len(rows):>6}" + "".join(f"{total[c]:>9}" for c in cats))
    if args.verbose:
        for r in rows:
            if r["category"] in FAILURES:
                print(f"{r['category']:7} {r['case']} {r['op']}: {r['outcome'][:200]}")
    if args.json:
        args.json.write_text(json.dumps(rows, indent=1))
    return 1 if any(total[c] for c in FAILURES) else 0


if __name__ == "__main__":
    sys.exit(main())
