"""Keeps the failing inputs of a fuzz run as regression fixtures.

Usage::

    python tests/fuzz/keep.py /tmp/tdz-fuzz [--per-cause 25]

reads ``OUT/results.jsonl`` and ``OUT/failures/caseN.bin`` and adds each
failing input (gzip-compressed, deduplicated by content) to
``tests/fixtures/hostile/`` with its op, subpath, cause and the helper that
owns the failing code (``xfail`` until fixed); ``test_fuzz.py`` replays them.
At most ``--per-cause`` inputs are kept per root cause, and the directory
stays below 2 MB.
"""

from __future__ import annotations

import argparse
import gzip
import hashlib
import json
import sys
from collections import defaultdict
from pathlib import Path

HOSTILE = Path(__file__).resolve().parents[1] / "fixtures" / "hostile"
LIMIT = 1_900_000

#: Which helper owns the code in a frame's file (the innermost tdz_numba frame).
OWNERS = {
    "reader.py": "core",
    "kernels.py": "core",
    "records.py": "core",
    "layout.py": "core",
    "codecs.py": "codec",
    "codec_kernels.py": "codec",
    "integrity.py": "safety",
    "writer.py": "safety",
    "archive.py": "archive",
    "tdzsource.py": "archive",
    "bulk.py": "archive",
}


def owner_of(rec: dict) -> str | None:
    """The owner of the innermost tdz_numba frame of a failure (None: fixed here)."""
    ours = rec.get("ours") or ""
    fname = ours.split(":", 1)[0].replace('File "', "").rsplit("/", 1)[-1]
    if rec.get("op") == "unpack" and fname in ("", "pathlib.py"):
        return "safety"
    return OWNERS.get(fname, "core" if rec["cat"] in ("signal", "timeout") else None)


def keep(out: Path, per_cause: int = 25) -> int:
    index_path = HOSTILE / "index.json"
    HOSTILE.mkdir(parents=True, exist_ok=True)
    index = json.loads(index_path.read_text()) if index_path.exists() else []
    known = {f["file"] for f in index}
    used = sum(p.stat().st_size for p in HOSTILE.iterdir())
    per: dict[str, int] = defaultdict(int)
    for f in index:
        per[f.get("cause", "")] += 1
    added = 0
    for line in (out / "results.jsonl").read_text().splitlines():
        rec = json.loads(line)
        if rec["cat"] not in ("other", "memory", "signal", "timeout"):
            continue
        cause = f"{rec['cat']} {rec.get('exc')} @ {rec.get('ours') or rec.get('frame')}"
        if per[cause] >= per_cause:
            continue
        data = (out / "failures" / f"case{rec['id']}.bin").read_bytes()
        packed = gzip.compress(data, 9, mtime=0)
        name = hashlib.sha256(data).hexdigest()[:16] + f"-{rec['op']}.bin.gz"
        if name in known or used + len(packed) > LIMIT:
            continue
        (HOSTILE / name).write_bytes(packed)
        used += len(packed)
        known.add(name)
        per[cause] += 1
        index.append(
            {
                "file": name,
                "op": rec["op"],
                "subpath": rec.get("subpath"),
                "seed": rec["seed"],
                "how": rec["how"][:300],
                "cause": cause[:200],
                "owner": owner_of(rec),
                "msg": rec.get("msg", "")[:200],
            }
        )
        added += 1
    index_path.write_text(json.dumps(index, indent=1) + "\n")
    return added


def add(
    data: bytes,
    op: str,
    *,
    subpath: str | None,
    how: str,
    cause: str,
    owner: str | None,
    seed: str = "manual",
) -> str:
    """Adds one input by hand (a reproducer found outside a run); returns its file name."""
    index_path = HOSTILE / "index.json"
    index = json.loads(index_path.read_text()) if index_path.exists() else []
    name = hashlib.sha256(data).hexdigest()[:16] + f"-{op}.bin.gz"
    if name not in {f["file"] for f in index}:
        (HOSTILE / name).write_bytes(gzip.compress(data, 9, mtime=0))
        index.append(
            {
                "file": name,
                "op": op,
                "subpath": subpath,
                "seed": seed,
                "how": how,
                "cause": cause,
                "owner": owner,
                "msg": "",
            }
        )
        index_path.write_text(json.dumps(index, indent=1) + "\n")
    return name


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("out", type=Path)
    p.add_argument("--per-cause", type=int, default=25)
    args = p.parse_args(argv)
    print(f"kept {keep(args.out, args.per_cause)} new inputs in {HOSTILE}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
