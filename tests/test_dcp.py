"""torch.distributed.checkpoint on .tdz: gloo process groups on CPU (torch.multiprocessing spawn,
127.0.0.1), saving on 2 and 3 ranks, loading on 2 and 1, locally and on S3 (moto server)."""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
import torch.multiprocessing as mp

import tdz_numba
from tdz_numba.cli import main as tdz_main
from tdz_numba.dcp import TdzStorageReader, TdzStorageWriter

ROWS, COLS = 12, 4
pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled:UserWarning")


def _full() -> torch.Tensor:
    return torch.arange(ROWS * COLS, dtype=torch.float32).reshape(ROWS, COLS)


def _per_rank(r: int) -> torch.Tensor:
    return torch.arange(6, dtype=torch.float64).reshape(2, 3) + 100 * r


def _shared() -> torch.Tensor:
    return torch.linspace(0, 1, 10)


def _save_state(rank: int, world: int, mesh) -> dict:
    from torch.distributed.tensor import Shard, distribute_tensor

    return {
        f"rank{rank}.w": _per_rank(rank),
        "shared": _shared(),
        "step": 7,
        "dt": distribute_tensor(_full(), mesh, [Shard(0)]),
    }


def _check_loaded(rank: int, world: int, mesh, reader, group=None) -> None:
    from torch.distributed.tensor import Shard, distribute_tensor

    sd = {
        f"rank{rank}.w": torch.zeros(2, 3, dtype=torch.float64),
        "shared": torch.zeros(10),
        "step": 0,
        "dt": distribute_tensor(torch.zeros(ROWS, COLS), mesh, [Shard(0)]),
    }
    dcp.load(sd, storage_reader=reader, process_group=group)
    assert torch.equal(sd[f"rank{rank}.w"], _per_rank(rank))
    assert torch.equal(sd["shared"], _shared()) and sd["step"] == 7
    assert torch.equal(sd["dt"].to_local(), _full().chunk(world)[rank]), (rank, world)


def _worker(rank: int, world: int, port: int, jobs: list, opts: dict | None) -> None:
    from torch.distributed.device_mesh import init_device_mesh

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), GLOO_SOCKET_IFNAME="lo")
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        mesh = init_device_mesh("cpu", (world,))
        for job, where in jobs:
            storage_options = opts if where.startswith("s3://") else None
            if job == "save":
                dcp.save(
                    _save_state(rank, world, mesh),
                    storage_writer=TdzStorageWriter(where, storage_options=storage_options),
                )
            elif job == "load":
                _check_loaded(rank, world, mesh, TdzStorageReader(where, storage_options=storage_options))
            else:  # "load2": ranks 0 and 1 load as a world of 2 (the others wait)
                from torch.distributed.device_mesh import DeviceMesh

                group = dist.new_group([0, 1])  # collective: every rank creates it
                if rank < 2:
                    sub = DeviceMesh.from_group(group, "cpu")
                    _check_loaded(rank, 2, sub, TdzStorageReader(where), group)
            dist.barrier()
    finally:
        dist.destroy_process_group()


def _spawn(world: int, jobs: list, opts: dict | None = None) -> None:
    from servers import free_port

    mp.spawn(_worker, args=(world, free_port(), jobs, opts), nprocs=world, join=True)


def _load_single(where: str, saved_world: int, opts: dict | None = None) -> None:
    sd = {f"rank{r}.w": torch.zeros(2, 3, dtype=torch.float64) for r in range(saved_world)}
    sd.update(shared=torch.zeros(10), step=0, dt=torch.zeros(ROWS, COLS))
    dcp.load(sd, storage_reader=TdzStorageReader(where, storage_options=opts), no_dist=True)
    for r in range(saved_world):
        assert torch.equal(sd[f"rank{r}.w"], _per_rank(r))
    assert torch.equal(sd["shared"], _shared()) and sd["step"] == 7 and torch.equal(sd["dt"], _full())


def _check_rank_files(ckpt: Path, world: int) -> None:
    files = sorted(ckpt.glob("__*_0.tdz"))
    assert [f.name for f in files] == [f"__{r}_0.tdz" for r in range(world)]
    for r, f in enumerate(files):
        assert tdz_main(["verify", str(f)]) == 0
        if shutil.which("unzip"):
            out = subprocess.run(["unzip", "-t", str(f)], capture_output=True, text=True)
            assert out.returncode == 0 and "No errors detected" in out.stdout, out.stdout
        with tdz_numba.open(f) as ar:  # a normal archive on its own
            assert torch.equal(ar[f"rank{r}.w"], _per_rank(r))
            table = {row[0]: row for row in ar["__dcp__"]}
            assert table["dt" if r == 0 else f"dt@{r * ROWS // world},0"][1:4] == [
                "dt",
                [r * ROWS // world, 0],
                [ROWS // world, COLS],
            ]


@pytest.fixture(scope="module", autouse=True)
def _warm_kernels(tmp_path_factory):
    """Compile (or load) the Numba kernels once here, so that the spawned ranks load them
    from the cache instead of each compiling them on a cold cache."""
    p = tdz_numba.save(
        {"x": torch.ones(64), "y": {"z": torch.arange(3)}},
        tmp_path_factory.mktemp("warm") / "w.tdz",
        compression="deflate",
    )
    tdz_numba.save(tdz_numba.load(p), p.with_name("s.tdz"))
    tdz_numba.verify(p)


@pytest.fixture(scope="module")
def s3():
    pytest.importorskip("s3fs")
    pytest.importorskip("moto.server")
    from servers import MotoS3

    server = MotoS3()
    server.fs().call_s3("create_bucket", Bucket="ckpt")
    yield server
    server.stop()


def test_two_ranks_local_and_s3_then_one(tmp_path, s3):
    ckpt = tmp_path / "two"
    url = "s3://ckpt/run/two"
    _spawn(2, [("save", str(ckpt)), ("save", url), ("load", str(ckpt)), ("load", url)], s3.storage_options)
    _check_rank_files(ckpt, 2)
    _load_single(str(ckpt), 2)
    _load_single(url, 2, s3.storage_options)
    assert tdz_numba.verify(f"{url}/__1_0.tdz", storage_options=s3.storage_options).leaves >= 3


def test_three_ranks_reshard_to_two_and_one(tmp_path):
    ckpt = tmp_path / "three"
    _spawn(3, [("save", str(ckpt)), ("load2", str(ckpt))])  # 3 row shards read into 2
    _check_rank_files(ckpt, 3)
    _load_single(str(ckpt), 3)


def test_single_process_compressed_bytes_and_overwrite(tmp_path):
    state = {
        "w": torch.arange(4096, dtype=torch.float32).reshape(64, 64),
        "cfg": {"lr": 0.1, "name": "x"},
        "n": torch.tensor(3),
    }
    ckpt = tmp_path / "c"
    dcp.save(state, storage_writer=TdzStorageWriter(ckpt, compression="deflate"), no_dist=True)
    with tdz_numba.open(ckpt / "__0_0.tdz") as ar:
        assert ar.info("w").compression == "deflate"
    back = {"w": torch.zeros(64, 64), "cfg": {"lr": 0.0, "name": ""}, "n": torch.tensor(0)}
    dcp.load(back, storage_reader=TdzStorageReader(ckpt), no_dist=True)
    assert torch.equal(back["w"], state["w"]) and back["cfg"] == state["cfg"] and int(back["n"]) == 3
    from torch.distributed.checkpoint.api import CheckpointException

    with pytest.raises(CheckpointException, match="ArchiveExistsError.*overwrite=False"):  # DCP wraps it
        dcp.save(state, storage_writer=TdzStorageWriter(ckpt, overwrite=False), no_dist=True)
    with pytest.raises((CheckpointException, tdz_numba.BadArchiveError), match="no DCP checkpoint"):
        dcp.load(back, storage_reader=TdzStorageReader(tmp_path / "nothing"), no_dist=True)
