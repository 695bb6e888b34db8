"""``tdz bench --remote``: remote reads and saves against fsspec's own, on loopback servers.

One run gives every goal figure of issue 26 (medians of ``--repeat`` rounds
after a warm-up round; in each round the operations run in turn, their order
reversed every other round, so formats and peers alternate):

* **read-all** of a ``--size-mib`` ``.tdz`` archive and of a safetensors file
  of the same tensors: ``tdz_numba.load(url)`` (every tensor in memory, CRCs
  checked) against ``fs.cat_file(url)`` of the same object, over the
  loopback HTTP Range server and moto's S3 server (goal >= 0.9x);
* **S3 save**: ``tdz_numba.save(tree, "s3://...")`` against ``fs.put`` of the
  same archive from a local file (goal >= 0.9x);
* **peak RSS** of each of those, each measured once in a fresh child process
  (:mod:`tdz_numba.bench.rss`): how far the resident size rose above what the
  process held before (for reads: beyond the object's own size, the result);
  goal <= 64 MiB + one part per worker;
* **lazy open** of a 100-tensor file per format (.tdz, safetensors, GGUF,
  .pt, npz) over HTTP: requests of open + listing (goal <= 2), then requests
  and bytes of loading one tensor, and its bytes beyond the tensor's own
  (goal <= 64 KiB). A format this version cannot read over a URL reports
  ``n/a`` with the error, and the run goes on;
* **DCP** on 2 gloo ranks (``--section dcp``): ``TdzStorageWriter``/``Reader``
  against ``FileSystemWriter``/``Reader``.

Both read-all servers run in their own process (moto's, and the HTTP Range server's:
:class:`~tdz_numba.bench.servers.RangeServerProcess`), so the client under test shares no
interpreter lock with them; the lazy-open rows use the HTTP server in a thread (they read
its request log).

Examples
--------
::

    tdz bench --remote --size-mib 32 --repeat 3 --json
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from ..errors import InternalError

__all__ = ["main", "run_remote", "report", "model", "load_part_bytes", "SECTIONS", "LAZY_FORMATS"]

#: The sections of a run (``--section``); all but ``dcp`` by default.
SECTIONS = ("http", "s3", "save", "lazy", "dcp")
#: Formats of the read-all rows.
READ_FORMATS = ("tdz", "safetensors")
#: Formats of the lazy-open rows.
LAZY_FORMATS = ("tdz", "safetensors", "gguf", "torch", "npz")
#: Goals of issue 26.
GOAL_RATIO, GOAL_OPEN_REQUESTS, GOAL_BEYOND = 0.9, 2, 64 << 10
#: Tensors of a lazy-open file.
LAZY_TENSORS = 100


def model(size_mib: float, leaves: int = 64) -> dict[str, Any]:
    """``leaves`` float32 tensors of ``size_mib`` MiB in all (seeded: the same in every process).

    Examples
    --------
    >>> from tdz_numba.bench.remote import model
    >>> m = model(1, leaves=4)
    >>> print(len(m), sum(t.numel() * 4 for t in m.values()))
    4 1048576
    """
    import torch

    g = torch.Generator().manual_seed(0)
    n = max(1, int(size_mib * (1 << 20)) // 4 // leaves)
    return {f"w{k:03d}": torch.rand(n, generator=g) for k in range(leaves)}


def _short(exc: BaseException) -> str:
    text = f"{type(exc).__name__}: {exc}".replace("\n", " ")
    return text if len(text) <= 160 else text[:157] + "..."


def _rounds(ops: dict[str, Callable[[], Any]], repeat: int) -> tuple[dict[str, float], dict[str, str]]:
    """Median seconds per op over ``repeat`` rounds after a warm-up; the order reversed every other
    round. An op that raises is dropped (its error returned) and the others go on."""
    times: dict[str, list[float]] = {k: [] for k in ops}
    errors: dict[str, str] = {}
    for r in range(repeat + 1):
        for k in list(ops) if r % 2 == 0 else list(reversed(ops)):
            if k in errors:
                continue
            t0 = time.perf_counter()
            try:
                ops[k]()
            except Exception as exc:  # an unsupported format, a failed request: reported, not fatal
                errors[k] = _short(exc)
                continue
            if r:
                times[k].append(time.perf_counter() - t0)
    return {k: statistics.median(v) for k, v in times.items() if v}, errors


def _cached(opts: dict[str, Any]) -> dict[str, Any]:
    """The server's storage options without ``skip_instance_cache``: every URL call then reuses one
    s3fs instance (its client and connection pool), as ``fs.put`` and ``fs.cat`` do."""
    return {k: v for k, v in opts.items() if k != "skip_instance_cache"}


def _s3fs(opts: dict[str, Any]) -> Any:
    import fsspec

    return fsspec.filesystem("s3", **opts)


def _rss(spec: dict[str, Any], over: int = 0) -> float | str:
    """Peak RSS (MiB) of ``spec`` in a child, less ``over`` bytes; the error text if it failed."""
    from .rss import measure

    try:
        return round(measure(spec)["peak_mib"] - over / 2**20, 1)
    except Exception as exc:  # (a load this version cannot do: the row says why)
        return _short(exc)


def load_part_bytes(url: str, storage_options: dict[str, Any] | None, nbytes: int) -> int:
    """The part size of a bulk read of ``nbytes`` bytes of ``url``, as a load cuts it: from the
    transport's own ``max_part`` (:func:`~tdz_numba.remote.object.part_size`). No request.

    Examples
    --------
    >>> from tdz_numba.bench.remote import load_part_bytes
    >>> load_part_bytes("memory://bench-doc/x.tdz", None, 256 << 20) >> 20
    8
    """
    from ..remote.object import PART_BYTES, part_size
    from ..remote.transports import transport

    cap = int(getattr(transport(url, storage_options or None), "max_part", PART_BYTES))
    return part_size(nbytes, PART_BYTES, cap)


def _read_rows(
    server: str, urls: dict[str, str], opts: dict[str, Any], repeat: int, rss: bool
) -> list[dict[str, Any]]:
    import fsspec

    import tdz_numba

    fs, _ = fsspec.core.url_to_fs(next(iter(urls.values())), **opts)
    so = opts or None
    ops: dict[str, Callable[[], Any]] = {}
    sizes, parts = {}, {}
    for fmt, url in urls.items():
        path = fs._strip_protocol(url)
        sizes[fmt] = fs.size(path)
        ops[f"{fmt}/load"] = functools.partial(tdz_numba.load, url, storage_options=so)
        ops[f"{fmt}/cat"] = functools.partial(fs.cat_file, path)
        part = parts[fmt] = load_part_bytes(url, opts, sizes[fmt])  # the parts of a load's bulk read
        starts = list(range(0, sizes[fmt], part))
        ends = [min(sizes[fmt], a + part) for a in starts]
        ops[f"{fmt}/ranges"] = functools.partial(fs.cat_ranges, [path] * len(starts), starts, ends)
    med, errors = _rounds(ops, repeat)
    rows = []
    for fmt, url in urls.items():
        mib = sizes[fmt] / 2**20
        load, cat, ranges = med.get(f"{fmt}/load"), med.get(f"{fmt}/cat"), med.get(f"{fmt}/ranges")
        row: dict[str, Any] = {
            "server": server,
            "format": fmt,
            "bytes": sizes[fmt],
            "load_s": load,
            "cat_s": cat,
            "ranges_s": ranges,
            "load_mib_s": None if load is None else mib / load,
            "cat_mib_s": None if cat is None else mib / cat,
            "ratio": None if load is None or cat is None else cat / load,
            # fs.cat_ranges over the parts a load requests (part_bytes each): the same requests
            "part_bytes": parts[fmt],
            "ranges_mib_s": None if ranges is None else mib / ranges,
            "ratio_ranges": None if load is None or ranges is None else ranges / load,
            "goal": GOAL_RATIO,
            "error": errors.get(f"{fmt}/load") or errors.get(f"{fmt}/cat"),
        }
        if rss:
            spec = {"url": url, "storage_options": opts}
            row["rss_load_mib"] = (
                _rss({"op": "load", **spec}, sizes[fmt]) if load is not None else row["error"]
            )
            row["rss_cat_mib"] = _rss({"op": "cat", **spec}, sizes[fmt])
        rows.append(row)
    return rows


def _save_row(s3: Any, tree: dict[str, Any], local: Path, repeat: int, rss: bool) -> dict[str, Any]:
    import tdz_numba

    from ..remote.upload import PART_BYTES, PARTS_IN_FLIGHT

    opts = _cached(s3.storage_options)
    fs = _s3fs(opts)
    ops = {
        "save": lambda: tdz_numba.save(tree, "s3://bench/save.tdz", storage_options=opts),
        "put": lambda: fs.put(str(local), "bench/put.tdz"),
    }
    med, errors = _rounds(ops, repeat)
    mib = local.stat().st_size / 2**20
    save, put = med.get("save"), med.get("put")
    row: dict[str, Any] = {
        "bytes": local.stat().st_size,
        "save_s": save,
        "put_s": put,
        "save_mib_s": None if save is None else mib / save,
        "put_mib_s": None if put is None else mib / put,
        "ratio": None if save is None or put is None else put / save,
        "goal": GOAL_RATIO,
        "part_mib": PART_BYTES >> 20,
        "parts_in_flight": PARTS_IN_FLIGHT,
        "rss_goal_mib": 64 + (PART_BYTES >> 20) * PARTS_IN_FLIGHT,
        "error": errors.get("save") or errors.get("put"),
    }
    if rss:
        size = sum(t.numel() * t.element_size() for t in tree.values()) / 2**20
        row["rss_save_mib"] = _rss(
            {"op": "save", "url": "s3://bench/rss.tdz", "storage_options": opts, "size_mib": size}
        )
        row["rss_put_mib"] = _rss(
            {"op": "put", "url": "s3://bench/rss-put.tdz", "storage_options": opts, "local": str(local)}
        )
    return row


def _lazy_rows(http: Any, size_mib: float, directory: Path) -> list[dict[str, Any]]:
    import torch

    import tdz_numba

    from .readers import SUFFIX, write

    per = max(1024, min(256 << 10, int(size_mib * (1 << 20)) // LAZY_TENSORS // 4))  # float32s
    g = torch.Generator().manual_seed(2)
    tensors = {f"t{k:03d}": torch.rand(per, generator=g) for k in range(LAZY_TENSORS)}
    name = f"t{LAZY_TENSORS // 2:03d}"
    rows = []
    for fmt in LAZY_FORMATS:
        path = directory / f"lazy{SUFFIX[fmt]}"
        write(fmt, tensors, path)
        url = http.put(path.name, path.read_bytes())
        row: dict[str, Any] = {"format": fmt, "bytes": path.stat().st_size, "tensor_bytes": per * 4}
        http.reset_log()
        try:
            with tdz_numba.open(url) as ar:
                keys = list(ar)
                row["open_requests"], row["open_bytes"] = http.requests, http.bytes_served
                http.reset_log()
                t = ar[name]
                if not torch.equal(torch.as_tensor(t), tensors[name]):
                    raise InternalError(f"bench: {fmt} over HTTP read other values for {name}")
                row["load_requests"], row["load_bytes"] = http.requests, http.bytes_served
            row["beyond_bytes"] = row["load_bytes"] - row["tensor_bytes"]
            if len(keys) != LAZY_TENSORS:
                raise InternalError(f"bench: {fmt} over HTTP lists {len(keys)} keys, not {LAZY_TENSORS}")
            row["error"] = None
        except Exception as exc:
            row.update(open_requests=None, open_bytes=None, load_requests=None, load_bytes=None)
            row.update(beyond_bytes=None, error=_short(exc))
        rows.append(row)
        http.objects.pop("/" + path.name, None)
    return rows


def _dcp_worker(rank: int, world: int, port: int, root: str, size_mib: float, repeat: int, out: str) -> None:
    import shutil

    import torch
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp

    from tdz_numba.dcp import TdzStorageReader, TdzStorageWriter

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), GLOO_SOCKET_IFNAME="lo")
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        n = int(size_mib * (1 << 20) / 4 / world / 8)
        g = torch.Generator().manual_seed(rank)
        sd = {f"r{rank}.w{k}": torch.rand(n, generator=g) for k in range(8)}
        res: dict[str, float] = {}
        for name, writer, reader in (
            ("tdz", TdzStorageWriter, TdzStorageReader),
            ("fs", dcp.FileSystemWriter, dcp.FileSystemReader),
        ):
            ckpt = f"{root}/{name}"
            times: dict[str, list[float]] = {"save": [], "load": []}
            dst = {k: torch.empty_like(v) for k, v in sd.items()}
            for r in range(repeat + 1):  # one warm-up
                dist.barrier()
                if rank == 0:
                    shutil.rmtree(ckpt, ignore_errors=True)
                dist.barrier()
                t0 = time.perf_counter()
                dcp.save(sd, storage_writer=writer(ckpt))
                dist.barrier()
                t1 = time.perf_counter()
                dcp.load(dst, storage_reader=reader(ckpt))
                dist.barrier()
                if r:
                    times["save"].append(t1 - t0)
                    times["load"].append(time.perf_counter() - t1)
            res[f"save_{name}_s"] = statistics.median(times["save"])
            res[f"load_{name}_s"] = statistics.median(times["load"])
            wrong = [k for k in sd if not torch.equal(dst[k], sd[k])]
            if wrong:  # a benchmark of a wrong load measures nothing
                raise InternalError(f"bench: the {name} DCP load read other values for {wrong[:3]}")
        if rank == 0:
            Path(out).write_text(json.dumps(res))
    finally:
        dist.destroy_process_group()


def run_remote(
    size_mib: float = 256,
    repeat: int = 3,
    *,
    sections: tuple[str, ...] = SECTIONS[:-1],
    rss: bool = True,
    dcp_size_mib: float | None = None,
) -> dict[str, Any]:
    """Measures the figures of the module docstring; returns them as a JSON-able dict.

    Keys: ``size_mib``, ``repeat``, ``sections``, and per section ``read_all``
    (rows of ``http`` and ``s3``), ``save``, ``lazy`` (rows) and ``dcp``.
    """
    import tdz_numba

    from .readers import write
    from .servers import MotoS3, RangeServer, RangeServerProcess, free_port

    res: dict[str, Any] = {"size_mib": size_mib, "repeat": repeat, "sections": list(sections)}
    tree = model(size_mib)
    with tempfile.TemporaryDirectory() as tmp:
        d = Path(tmp)
        local = {"tdz": tdz_numba.save(tree, d / "m.tdz"), "safetensors": d / "m.safetensors"}
        write("safetensors", tree, local["safetensors"])
        res["read_all"] = []
        if "http" in sections:  # served by a child process: no interpreter lock shared with the client
            child = RangeServerProcess({p.name: p for p in local.values()})
            try:
                urls = {f: child.url(p.name) for f, p in local.items()}
                res["read_all"] += _read_rows("http", urls, {}, repeat, rss)
            finally:
                child.stop()
        if "lazy" in sections:  # in a thread: the rows count its requests and bytes
            http = RangeServer()
            try:
                res["lazy"] = _lazy_rows(http, size_mib, d)
            finally:
                http.stop()
        if "s3" in sections or "save" in sections:
            s3 = MotoS3(process=True)
            try:
                fs = s3.fs()
                fs.call_s3("create_bucket", Bucket="bench")
                if "s3" in sections:
                    for p in local.values():
                        fs.put(str(p), f"bench/{p.name}")
                    urls = {f: f"s3://bench/{p.name}" for f, p in local.items()}
                    res["read_all"] += _read_rows("s3", urls, _cached(s3.storage_options), repeat, rss)
                if "save" in sections:
                    res["save"] = _save_row(s3, tree, local["tdz"], repeat, rss)
            finally:
                s3.stop()
        if "dcp" in sections:
            import torch.multiprocessing as mp

            out = d / "dcp.json"
            args = (2, free_port(), str(d / "dcp"), dcp_size_mib or size_mib, repeat, str(out))
            mp.spawn(_dcp_worker, args=args, nprocs=2, join=True)
            r = json.loads(out.read_text())
            r["save_ratio"] = r["save_tdz_s"] / r["save_fs_s"]
            r["load_ratio"] = r["load_tdz_s"] / r["load_fs_s"]
            res["dcp"] = r
    return res


def _x(v: float | None) -> str:
    return "n/a" if v is None else f"{v:.2f}x"


def _mbs(v: float | None) -> str:
    return "n/a" if v is None else f"{v:,.0f} MiB/s"


def _mib(v: Any) -> str:
    return f"{v:+.0f}" if isinstance(v, (int, float)) else "n/a"


def report(res: dict[str, Any]) -> str:
    """The text report of :func:`run_remote`'s result (lines of at most 100 columns)."""
    lines = [
        f"tdz bench --remote: {res['size_mib']:g} MiB, median of {res['repeat']} rounds after a warm-up "
        "(loopback servers)",
    ]
    if res.get("read_all"):
        lines += [
            "",
            f"read-all: tdz_numba.load(url) vs fs.cat_file(url)  (goal >= {GOAL_RATIO}x; peak RSS in MiB "
            "beyond the object)",
            "(ranges: fs.cat_ranges of the parts a load requests (remote.object.part_size), the ratio to it)",
            f"{'server':7s} {'format':12s} {'tdz_numba':>11s} {'fs.cat':>11s} {'ratio':>6s} "
            f"{'ranges':>11s} {'ratio':>6s} {'RSS ours':>9s} {'RSS cat':>8s}",
        ]
        for r in res["read_all"]:
            lines.append(
                f"{r['server']:7s} {r['format']:12s} {_mbs(r['load_mib_s']):>11s} {_mbs(r['cat_mib_s']):>11s} "
                f"{_x(r['ratio']):>6s} {_mbs(r.get('ranges_mib_s')):>11s} {_x(r.get('ratio_ranges')):>6s} "
                f"{_mib(r.get('rss_load_mib')):>9s} {_mib(r.get('rss_cat_mib')):>8s}"
            )
            if r["error"]:
                lines.append(f"  n/a: {r['error'][:92]}")
    if res.get("save"):
        s = res["save"]
        lines += [
            "",
            f"S3 save: tdz_numba.save(tree, url) vs fs.put of the archive  (goal >= {GOAL_RATIO}x; "
            f"{s['part_mib']} MiB parts,",
            f"{s['parts_in_flight']} in flight: peak RSS goal <= {s['rss_goal_mib']} MiB)",
            f"{'tdz_numba':>14s} {'fs.put':>14s} {'ratio':>7s} {'RSS ours':>9s} {'RSS put':>8s}",
            f"{_mbs(s['save_mib_s']):>14s} {_mbs(s['put_mib_s']):>14s} {_x(s['ratio']):>7s} "
            f"{_mib(s.get('rss_save_mib')):>9s} {_mib(s.get('rss_put_mib')):>8s}",
        ]
        if s["error"]:
            lines.append(f"  n/a: {s['error'][:92]}")
    if res.get("lazy"):
        lines += [
            "",
            f"lazy open over HTTP of {LAZY_TENSORS} tensors, then one tensor  (goals: open <= "
            f"{GOAL_OPEN_REQUESTS} requests,",
            f"bytes beyond the tensor's <= {GOAL_BEYOND >> 10} KiB)",
            f"{'format':12s} {'open req':>8s} {'open bytes':>11s} {'load req':>8s} {'load bytes':>11s} "
            f"{'tensor':>9s} {'beyond':>8s}",
        ]
        for r in res["lazy"]:
            if r["error"]:
                lines.append(f"{r['format']:12s} n/a: {r['error'][:80]}")
                continue
            lines.append(
                f"{r['format']:12s} {r['open_requests']:>8d} {r['open_bytes']:>11,d} {r['load_requests']:>8d} "
                f"{r['load_bytes']:>11,d} {r['tensor_bytes']:>9,d} {r['beyond_bytes']:>8,d}"
            )
    if res.get("dcp"):
        r = res["dcp"]
        lines += [
            "",
            "DCP, 2 gloo ranks: TdzStorageWriter/Reader time / FileSystemWriter/Reader time (goal <= 1.0)",
            f"save {r['save_tdz_s']:.3f} s / {r['save_fs_s']:.3f} s = {r['save_ratio']:.2f}   "
            f"load {r['load_tdz_s']:.3f} s / {r['load_fs_s']:.3f} s = {r['load_ratio']:.2f}",
        ]
    return "\n".join(lines)


def main(argv: list[str] | None = None, prog: str = "tdz bench --remote") -> int:
    """Entry point of ``tdz bench --remote``."""
    p = argparse.ArgumentParser(
        prog=prog, description="remote reads and saves against fsspec's own, on loopback servers"
    )
    p.add_argument("--size-mib", type=float, default=256, help="object size (default 256, the goals')")
    p.add_argument("--dcp-size-mib", type=float, default=None, help="DCP state_dict size over 2 ranks")
    p.add_argument("--repeat", type=int, default=3, help="timed rounds after the warm-up (default 3)")
    p.add_argument(
        "--section",
        action="append",
        choices=SECTIONS,
        default=None,
        help="what to measure (repeatable; default: all but dcp)",
    )
    p.add_argument("--no-rss", action="store_true", help="skip the peak-RSS children")
    p.add_argument("--json", action="store_true", help="print the results as JSON (the report to stderr)")
    args = p.parse_args(argv)
    if args.size_mib <= 0 or args.repeat < 1:
        p.error("--size-mib must be > 0 and --repeat >= 1")
    res = run_remote(
        args.size_mib,
        args.repeat,
        sections=tuple(args.section or SECTIONS[:-1]),
        rss=not args.no_rss,
        dcp_size_mib=args.dcp_size_mib,
    )
    text = report(res)
    if args.json:
        print(text, file=sys.stderr, flush=True)
        print(json.dumps(res, indent=1))
    else:
        print(text, flush=True)
    return 0


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
