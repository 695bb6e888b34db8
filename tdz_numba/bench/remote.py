"""``tdz bench --remote``: remote archives and DCP against their peers, on loopback servers.

Figures (median of ``--repeat`` runs, each peer measured in the same run):

* open + list of a 2,000-leaf archive over HTTP: requests (goal <= 2);
* load of one subpath: bytes served beyond the open's tail / bytes of the
  subpath's entries (goal <= 1.05);
* read-all: ``tdz_numba.load(url)`` (every leaf in memory, CRCs checked)
  against ``fs.cat_file(url)`` (fsspec's HTTP filesystem) of the same object,
  for the 2,000-leaf and an 8-leaf archive (goal >= 0.8x its throughput);
* save to S3 (moto's server): ``tdz_numba.save(tree, "s3://...")`` against
  ``fs.put`` of the same archive from a local file (goal >= 0.8x);
* DCP on 2 gloo ranks: ``dcp.save``/``dcp.load`` with
  :class:`~tdz_numba.dcp.TdzStorageWriter`/``Reader`` against
  ``FileSystemWriter``/``Reader`` (goal <= 1.0x their time).

Examples
--------
::

    tdz bench --remote --size-mib 32 --repeat 3
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from ..errors import InternalError

__all__ = ["main", "run_remote"]


def _median(fn, repeat: int, before=None) -> float:
    times = []
    for _ in range(repeat + 1):  # one warm-up
        if before is not None:
            before()
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times[1:])


def _tree(size_mib: float):
    import torch

    per = max(1, int(size_mib * (1 << 20) / 4 / 2000))
    g = torch.Generator().manual_seed(0)
    return {
        f"group_{i:03d}": {f"leaf_{j:02d}": torch.rand(per, generator=g) for j in range(20)}
        for i in range(100)
    }


def _flat(size_mib: float):
    import torch

    g = torch.Generator().manual_seed(1)
    return {f"w{k}": torch.rand(max(1, int(size_mib * (1 << 20) / 4 / 8)), generator=g) for k in range(8)}


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

            def clean(ckpt=ckpt):
                dist.barrier()
                if rank == 0:
                    shutil.rmtree(ckpt, ignore_errors=True)
                dist.barrier()

            def save(ckpt=ckpt, writer=writer):
                dcp.save(sd, storage_writer=writer(ckpt))
                dist.barrier()

            res[f"dcp_save_{name}"] = _median(save, repeat, clean)
            dst = {k: torch.empty_like(v) for k, v in sd.items()}

            def load(ckpt=ckpt, reader=reader, dst=dst):
                dcp.load(dst, storage_reader=reader(ckpt))
                dist.barrier()

            res[f"dcp_load_{name}"] = _median(load, repeat)
            wrong = [k for k in sd if not torch.equal(dst[k], sd[k])]
            if wrong:  # a benchmark of a wrong load measures nothing
                raise InternalError(f"bench: the {name} DCP load read other values for {wrong[:3]}")
        if rank == 0:
            Path(out).write_text(json.dumps(res))
    finally:
        dist.destroy_process_group()


def run_remote(
    size_mib: float = 64,
    repeat: int = 3,
    *,
    dcp_size_mib: float | None = None,
    sections: tuple[str, ...] = ("http", "s3", "dcp"),
) -> dict[str, Any]:
    """Measures the figures listed in the module docstring; returns them as a dict."""
    import fsspec

    import tdz_numba

    from .servers import MotoS3, RangeServer, free_port

    res: dict[str, Any] = {"size_mib": size_mib, "repeat": repeat}
    tree = _tree(size_mib)
    with tempfile.TemporaryDirectory() as d:
        local = tdz_numba.save(tree, Path(d) / "small.tdz")
        data = local.read_bytes()
        if "http" in sections:
            http = RangeServer()
            try:
                url = http.put("small.tdz", data)
                http.reset_log()
                with tdz_numba.open(url) as ar:
                    list(ar)
                res["open_list_requests"] = http.requests
                idx = tdz_numba.open(local)._index
                needed = sum(
                    int(idx.table["csize"][i]) for i, n in enumerate(idx.names) if n.startswith("group_050/")
                )
                http.reset_log()
                tdz_numba.load(url, subpath="group_050")
                res["subpath_requests"] = http.requests
                res["subpath_bytes_ratio"] = (http.bytes_served - http.log[0][3]) / needed  # beyond the tail
                fs = fsspec.filesystem("http")

                flat_url = http.put(
                    "flat.tdz", tdz_numba.save(_flat(size_mib), Path(d) / "flat.tdz").read_bytes()
                )
                for name, u in (("small", url), ("flat", flat_url)):  # every leaf in memory vs the bytes
                    res[f"read_all_{name}_tdz_s"] = _median(lambda u=u: tdz_numba.load(u), repeat)
                    res[f"read_all_{name}_cat_s"] = _median(lambda u=u: fs.cat_file(u), repeat)
                    res[f"read_all_{name}_ratio"] = (
                        res[f"read_all_{name}_cat_s"] / res[f"read_all_{name}_tdz_s"]
                    )
            finally:
                http.stop()
        if "s3" in sections:
            s3 = MotoS3()
            try:
                fs = s3.fs()
                fs.call_s3("create_bucket", Bucket="bench")
                opts = s3.storage_options
                res["s3_save_tdz_s"] = _median(
                    lambda: tdz_numba.save(tree, "s3://bench/a.tdz", storage_options=opts), repeat
                )
                res["s3_put_s"] = _median(lambda: fs.put(str(local), "bench/b.tdz"), repeat)
                res["s3_save_ratio"] = res["s3_put_s"] / res["s3_save_tdz_s"]
            finally:
                s3.stop()
        if "dcp" in sections:
            import torch.multiprocessing as mp

            out = Path(d) / "dcp.json"
            mp.spawn(
                _dcp_worker,
                args=(2, free_port(), str(Path(d) / "dcp"), dcp_size_mib or size_mib, repeat, str(out)),
                nprocs=2,
                join=True,
            )
            r = json.loads(out.read_text())
            res.update(r)
            res["dcp_save_ratio"] = r["dcp_save_tdz"] / r["dcp_save_fs"]
            res["dcp_load_ratio"] = r["dcp_load_tdz"] / r["dcp_load_fs"]
    return res


def main(argv: list[str] | None = None, prog: str = "tdz bench --remote") -> int:
    """Entry point of ``tdz bench --remote``."""
    p = argparse.ArgumentParser(prog=prog, description=__doc__.split("\n")[0])
    p.add_argument("--size-mib", type=float, default=64, help="archive size (default 64)")
    p.add_argument("--dcp-size-mib", type=float, default=None, help="DCP state_dict size over 2 ranks")
    p.add_argument("--repeat", type=int, default=3)
    p.add_argument("--section", action="append", choices=["http", "s3", "dcp"], default=None)
    p.add_argument("--json", action="store_true")
    args = p.parse_args(argv)
    res = run_remote(
        args.size_mib,
        args.repeat,
        dcp_size_mib=args.dcp_size_mib,
        sections=tuple(args.section or ("http", "s3", "dcp")),
    )
    if args.json:
        print(json.dumps(res, indent=1))
    else:
        for k, v in res.items():
            print(f"{k:24s} {v:.4g}" if isinstance(v, float) else f"{k:24s} {v}")
    return 0


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
