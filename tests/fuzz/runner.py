"""The fuzz runner: deterministic cases, a pool of isolated workers, a report.

Case ``i`` of a run is fully determined by ``(tag, i)``: a seed, one to three
mutations (:mod:`fuzz.mutators`) and one op (cycling through the five ops).
Cases run in ``jobs`` worker processes (:mod:`fuzz.worker`), one case at a
time each, with a ``timeout`` per case and ``RLIMIT_AS`` of 4 GiB; a worker
that dies (signal) or hangs is killed and restarted, and the case is counted
as ``signal`` or ``timeout`` (a case that times out is retried once in a
fresh worker with three times the timeout: a busy machine is not a hang). Pass = ``accepted`` or ``tdzerror`` (a
:class:`~tdz_numba.TdzError`; ``is_archive`` must return False instead);
``other``, ``memory``, ``signal`` and ``timeout`` are failures, and their
inputs are written to ``OUT/failures``.

Usage (from the repository root)::

    python tests/fuzz/runner.py --cases 10000 --jobs 2 --out /tmp/tdz-fuzz

Examples
--------
>>> from fuzz.runner import case_plan
>>> case_plan("t", 7, ["a", "b"]) == case_plan("t", 7, ["a", "b"])
True
"""

from __future__ import annotations

import argparse
import json
import os
import queue
import random
import select
import shutil
import subprocess
import sys
import threading
import time
from collections import Counter, defaultdict
from dataclasses import dataclass
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[1]
if str(HERE.parent) not in sys.path:
    sys.path.insert(0, str(HERE.parent))

from fuzz.worker import OPS, rmtree  # noqa: E402

__all__ = ["Case", "case_plan", "make_cases", "run_cases", "summarize", "main"]

CATEGORIES = ("accepted", "tdzerror", "other", "memory", "signal", "timeout")
FAILURES = ("other", "memory", "signal", "timeout")
#: Seeds drawn less often (large: slow to mutate and to read).
_LIGHT = {"deep_levels": 0.15, "long_name": 0.5}


@dataclass
class Case:
    """One input and one op."""

    id: int
    seed: str
    op: str
    subpath: str | None
    how: str
    data: bytes


def case_plan(tag: str, i: int, seed_names: list[str]) -> tuple[random.Random, str, str]:
    """The rng, seed name and op of case ``i`` (deterministic)."""
    rng = random.Random(f"{tag}:{i}")
    weights = [_LIGHT.get(n, 1.0) for n in seed_names]
    seed = rng.choices(seed_names, weights)[0]
    return rng, seed, OPS[i % len(OPS)]


def make_cases(seeds, tag: str, start: int, count: int):
    """Yields the cases ``start .. start + count - 1`` of run ``tag``."""
    from fuzz.mutators import mutate

    by_name = {s.name: s for s in seeds}
    names = [s.name for s in seeds]
    for i in range(start, start + count):
        rng, name, op = case_plan(tag, i, names)
        sd = by_name[name]
        data, how = mutate(sd.data, rng)
        sub = rng.choice(sd.subpaths) if sd.subpaths else "missing"
        yield Case(i, name, op, sub, how, data)


class _Worker:
    def __init__(self, k: int, work: Path, warm: Path, timeout: float) -> None:
        self.k = k
        self.dir = work / f"w{k}"
        self.warm = warm
        self.timeout = timeout
        self.proc: subprocess.Popen | None = None
        self.starts = 0

    def start(self) -> None:
        rmtree(str(self.dir))
        self.dir.mkdir(parents=True)
        env = dict(os.environ)
        env["PYTHONPATH"] = os.pathsep.join([str(ROOT), env.get("PYTHONPATH", "")])
        env.setdefault("NUMBA_CACHE_DIR", str(ROOT / ".numba_cache"))
        env["OMP_NUM_THREADS"] = "1"
        self.stderr = open(self.dir.parent / f"w{self.k}.stderr.{self.starts}", "w")
        self.proc = subprocess.Popen(
            [sys.executable, str(HERE / "worker.py"), str(self.warm), str(self.dir)],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=self.stderr,
            env=env,
            text=True,
            bufsize=1,
        )
        self.starts += 1
        line = self._readline(300)
        if line != "ready":
            raise RuntimeError(f"fuzz worker {self.k} did not start: {line!r} (see {self.stderr.name})")

    def _readline(self, timeout: float) -> str | None:
        r, _, _ = select.select([self.proc.stdout], [], [], timeout)
        if not r:
            return None
        line = self.proc.stdout.readline()
        return line.strip() if line else ""

    def _stderr_tail(self) -> str:
        self.stderr.flush()
        try:
            return Path(self.stderr.name).read_text(errors="replace")[-3000:]
        except OSError:
            return ""

    def stop(self) -> None:
        if self.proc is not None:
            self.proc.kill()
            self.proc.wait()
            self.proc = None
            self.stderr.close()

    def run(self, case: Case) -> dict:
        rec = self._run(case, self.timeout)
        if rec["cat"] == "timeout":  # a busy machine, or a hang: a hang hangs again, with 3x the time
            rec = self._run(case, 3 * self.timeout)
            rec["retried"] = True
        return rec

    def _run(self, case: Case, timeout: float) -> dict:
        if self.proc is None:
            self.start()
        path = self.dir / "case.bin"
        path.write_bytes(case.data)
        req = {"id": case.id, "op": case.op, "path": str(path), "subpath": case.subpath, "tmp": str(self.dir)}
        t0 = time.perf_counter()
        try:
            self.proc.stdin.write(json.dumps(req) + "\n")
            self.proc.stdin.flush()
        except BrokenPipeError:
            pass
        line = self._readline(timeout)
        secs = time.perf_counter() - t0
        if line:
            rec = json.loads(line)
        else:
            timed_out = line is None
            self.proc.kill() if timed_out else None
            rc = self.proc.wait()
            tail = self._stderr_tail()
            frame = ""
            for ln in tail.splitlines():  # faulthandler: the innermost frame is listed first
                if ln.strip().startswith("File "):
                    frame = ln.strip()
                    break
            rec = {
                "cat": "timeout" if timed_out else "signal",
                "exc": "timeout" if timed_out else f"rc={rc}",
                "frame": frame,
                "ours": frame,
                "msg": tail[-600:],
            }
            self.proc = None
            self.stderr.close()
        rec.update(
            id=case.id, seed=case.seed, op=case.op, subpath=case.subpath, how=case.how, secs=round(secs, 4)
        )
        return rec


def run_cases(
    cases,
    *,
    jobs: int,
    work: Path,
    warm: Path,
    timeout: float = 10.0,
    failures: Path | None = None,
    progress: bool = False,
    log: Path | None = None,
) -> list[dict]:
    """Runs ``cases`` (an iterable of :class:`Case`) in ``jobs`` workers; returns one record per
    case (also appended to ``log``, one JSON line each, as they come)."""
    work.mkdir(parents=True, exist_ok=True)
    todo: queue.Queue = queue.Queue(maxsize=4 * jobs)
    results: list[dict] = []
    lock = threading.Lock()
    errors: list[BaseException] = []

    def loop(w: _Worker) -> None:
        try:
            while True:
                case = todo.get()
                if case is None:
                    break
                rec = w.run(case)
                if failures is not None and rec["cat"] in FAILURES:
                    failures.mkdir(parents=True, exist_ok=True)
                    (failures / f"case{case.id}.bin").write_bytes(case.data)
                with lock:
                    results.append(rec)
                    if sink is not None:
                        sink.write(json.dumps(rec) + "\n")
                    if progress and len(results) % 500 == 0:
                        bad = sum(r["cat"] in FAILURES for r in results)
                        rate = len(results) / (time.perf_counter() - t0)
                        print(
                            f"  {len(results)} cases, {bad} failures, {rate:.1f} cases/s",
                            file=sys.stderr,
                            flush=True,
                        )
        except BaseException as exc:  # surfaced by the caller
            errors.append(exc)
            while todo.get() is not None:  # drain so the producer never blocks
                pass
        finally:
            w.stop()

    sink = open(log, "w", buffering=1) if log is not None else None
    t0 = time.perf_counter()
    workers = [_Worker(k, work, warm, timeout) for k in range(jobs)]
    threads = [threading.Thread(target=loop, args=(w,), daemon=True) for w in workers]
    for t in threads:
        t.start()
    try:
        for case in cases:
            if errors:
                break
            todo.put(case)
    finally:
        for _ in threads:
            todo.put(None)
        for t in threads:
            t.join()
    if sink is not None:
        sink.close()
    if errors:
        raise errors[0]
    results.sort(key=lambda r: r["id"])
    return results


def summarize(results: list[dict]) -> dict:
    """Counts by category, by op and category, and failures grouped by root cause."""
    cats = Counter(r["cat"] for r in results)
    by_op: dict[str, Counter] = defaultdict(Counter)
    for r in results:
        by_op[r["op"]][r["cat"]] += 1
    groups: dict[str, list[dict]] = defaultdict(list)
    for r in results:
        if r["cat"] in FAILURES:
            groups[f"{r['cat']} {r.get('exc')} @ {r.get('frame')} (ours: {r.get('ours')})"].append(r)
    return {
        "cases": len(results),
        "counts": {c: cats.get(c, 0) for c in CATEGORIES},
        "by_op": {op: {c: by_op[op].get(c, 0) for c in CATEGORIES} for op in OPS},
        "root_causes": [
            {
                "cause": k,
                "count": len(v),
                "ops": sorted({r["op"] for r in v}),
                "examples": [
                    {
                        "id": r["id"],
                        "seed": r["seed"],
                        "op": r["op"],
                        "how": r["how"],
                        "msg": r.get("msg", "")[:200],
                    }
                    for r in v[:3]
                ],
            }
            for k, v in sorted(groups.items(), key=lambda kv: -len(kv[1]))
        ],
        "median_case_s": sorted(r["secs"] for r in results)[len(results) // 2] if results else None,
    }


def prepare_seeds(out: Path):
    """Writes the seeds (and the warm-up archive) under ``out``; returns the seeds."""
    from fuzz.seeds import make_seeds, save_seeds

    seeds = make_seeds(out / "seed-work")
    save_seeds(seeds, out / "seeds")
    shutil.rmtree(out / "seed-work", ignore_errors=True)
    warm = out / "warm.tdz"
    warm.write_bytes(next(s.data for s in seeds if s.name == "deflate_segments"))
    return seeds, warm


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--cases", type=int, default=2000)
    p.add_argument("--start", type=int, default=0)
    p.add_argument("--jobs", type=int, default=2)
    p.add_argument("--timeout", type=float, default=10.0)
    p.add_argument("--tag", default="tdz-fuzz-1")
    p.add_argument("--out", type=Path, default=Path("/tmp/tdz-fuzz"))
    args = p.parse_args(argv)
    t0 = time.perf_counter()
    seeds, warm = prepare_seeds(args.out)
    t1 = time.perf_counter()
    cases = make_cases(seeds, args.tag, args.start, args.cases)
    results = run_cases(
        cases,
        jobs=args.jobs,
        work=args.out / "work",
        warm=warm,
        timeout=args.timeout,
        failures=args.out / "failures",
        progress=True,
        log=args.out / "results.jsonl",
    )
    t2 = time.perf_counter()
    summary = summarize(results)
    summary.update(seeds_s=round(t1 - t0, 1), run_s=round(t2 - t1, 1), tag=args.tag, start=args.start)
    (args.out / "summary.json").write_text(json.dumps(summary, indent=1))
    print(json.dumps({k: summary[k] for k in ("cases", "counts", "seeds_s", "run_s")}))
    for g in summary["root_causes"]:
        print(f"{g['count']:6d}  {g['cause']}  ops={g['ops']}  e.g. case {g['examples'][0]['id']}")
    return 0 if not summary["root_causes"] else 1


if __name__ == "__main__":
    sys.exit(main())
