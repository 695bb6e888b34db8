"""``torch.distributed.checkpoint`` storage on ``.tdz`` archives: one archive per rank.

:class:`TdzStorageWriter` and :class:`TdzStorageReader` implement DCP's
``StorageWriter``/``StorageReader`` the way ``FileSystemWriter``/``Reader``
do (same planner interplay, same ``.metadata`` file, resharding by the
planners), but each rank writes its items as one normal ``.tdz`` archive,
``__<rank>_0.tdz``: tensors (and ``BytesIO`` items, as uint8 leaves) under
keys ``<fqn>`` (``<fqn>@<chunk offsets>`` for chunks that do not start at
zero), plus a ``__dcp__`` value listing every leaf's fqn, chunk offsets and
sizes. ``tdz verify``, ``unzip -t`` and :func:`tdz_numba.open` work on each
rank file alone. Loading maps each local archive once and copies every
requested chunk straight from the mapping into its destination tensor (one
copy; ``FileSystemReader`` unpickles each tensor first, then copies); remote
archives (fsspec URLs) fetch all the requested leaves of a file in one
coalesced batch of ranged reads.

Examples
--------
>>> import tempfile, torch, torch.distributed.checkpoint as dcp
>>> from tdz_numba.dcp import TdzStorageReader, TdzStorageWriter
>>> with tempfile.TemporaryDirectory() as d:
...     _ = dcp.save({"w": torch.arange(4.0)}, storage_writer=TdzStorageWriter(d), no_dist=True)
...     sd = {"w": torch.zeros(4)}
...     dcp.load(sd, storage_reader=TdzStorageReader(d), no_dist=True)
...     print(sd["w"].tolist())
[0.0, 1.0, 2.0, 3.0]
"""

from __future__ import annotations

import dataclasses
import io
import os
import pickle
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch.distributed.checkpoint.metadata import Metadata, StorageMeta
from torch.distributed.checkpoint.planner import (
    LoadItemType,
    LoadPlan,
    LoadPlanner,
    SavePlan,
    SavePlanner,
    WriteItemType,
)
from torch.distributed.checkpoint.storage import StorageReader, StorageWriter, WriteResult
from torch.futures import Future

from .errors import BadArchiveError, InvalidArgumentError

__all__ = ["TdzStorageWriter", "TdzStorageReader", "TdzChunk", "METADATA_NAME"]

#: DCP's global metadata file, as ``FileSystemWriter`` names it.
METADATA_NAME = ".metadata"
#: Key of the chunk table in each rank archive.
CHUNKS_KEY = "__dcp__"


@dataclass(frozen=True)
class TdzChunk:
    """Where one DCP item lives: the rank archive (relative to the checkpoint) and its key."""

    relative_path: str
    key: str
    length: int


@dataclass(frozen=True)
class _Prefix:
    prefix: str


class _Location:
    """A checkpoint directory: a local path or an fsspec URL prefix."""

    def __init__(self, path: str | os.PathLike, storage_options: dict[str, Any] | None) -> None:
        from .remote.read import is_remote

        self.storage_options = storage_options
        self.url = isinstance(path, str) and is_remote(path)
        if not self.url and storage_options is not None and isinstance(path, str):
            self.url = True
        if not self.url and not isinstance(path, (str, os.PathLike)):
            raise InvalidArgumentError(f"checkpoint path must be a path or a URL, got {path!r}")
        self.root: str | Path = path.rstrip("/") if self.url else Path(path)  # type: ignore[union-attr]
        self._fs = None

    def __str__(self) -> str:
        return str(self.root)

    @property
    def fs(self):
        if self._fs is None:
            import fsspec

            self._fs, _ = fsspec.core.url_to_fs(str(self.root), **(self.storage_options or {}))
        return self._fs

    def join(self, name: str) -> str | Path:
        return f"{self.root}/{name}" if self.url else self.root / name  # type: ignore[operator]

    def mkdir(self) -> None:
        if self.url:
            self.fs.makedirs(str(self.root), exist_ok=True)
        else:
            Path(self.root).mkdir(parents=True, exist_ok=True)

    def write_bytes(self, name: str, data: bytes) -> None:
        target = self.join(name)
        if self.url:
            self.fs.pipe_file(str(target), data)
            return
        tmp = Path(self.root) / f".{name}.{uuid.uuid4().hex[:8]}.tmp"
        with open(tmp, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, target)

    def read_bytes(self, name: str) -> bytes:
        target = self.join(name)
        if self.url:
            return self.fs.cat_file(str(target))
        return Path(target).read_bytes()


def _storage_key(item_index) -> str:
    offset = item_index.offset
    if offset is None or not any(offset):
        return item_index.fqn
    return f"{item_index.fqn}@{','.join(str(int(o)) for o in offset)}"


class TdzStorageWriter(StorageWriter):
    """Writes a DCP checkpoint as one ``.tdz`` archive per rank plus ``.metadata``.

    Parameters
    ----------
    path : str or os.PathLike
        The checkpoint directory, or an fsspec URL prefix (``s3://bucket/ckpt``):
        each rank streams its archive there (no local file).
    compression : str, optional
        As for :func:`tdz_numba.save`.
    num_threads : int, optional
        Threads for CRC-32 (and deflate).
    storage_options : dict, optional
        fsspec options for URLs.
    overwrite : bool
        When False, an existing checkpoint (its ``.metadata``) raises.

    Examples
    --------
    >>> import tempfile, pathlib, torch, torch.distributed.checkpoint as dcp, tdz_numba
    >>> from tdz_numba.dcp import TdzStorageWriter
    >>> with tempfile.TemporaryDirectory() as d:
    ...     _ = dcp.save({"w": torch.ones(2), "step": 3}, storage_writer=TdzStorageWriter(d), no_dist=True)
    ...     print(sorted(p.name for p in pathlib.Path(d).iterdir()), tdz_numba.load(f"{d}/__0_0.tdz")["w"].tolist())
    ['.metadata', '__0_0.tdz'] [1.0, 1.0]
    """

    def __init__(
        self,
        path: str | os.PathLike,
        *,
        compression: str | None = None,
        num_threads: int | None = None,
        storage_options: dict[str, Any] | None = None,
        overwrite: bool = True,
    ) -> None:
        super().__init__()
        self.location = _Location(path, storage_options)
        self.compression = compression
        self.num_threads = num_threads
        self.overwrite = overwrite
        self.save_id = uuid.uuid4().hex
        self.rank: int | None = None
        self.is_coordinator = False

    def reset(self, checkpoint_id: str | os.PathLike | None = None) -> None:
        if checkpoint_id:
            self.location = _Location(checkpoint_id, self.location.storage_options)
        self.save_id = uuid.uuid4().hex

    def set_up_storage_writer(self, is_coordinator: bool, *args: Any, **kwargs: Any) -> None:
        self.is_coordinator = is_coordinator
        self.rank = kwargs.get("rank")

    def prepare_local_plan(self, plan: SavePlan) -> SavePlan:
        self.location.mkdir()
        if not self.overwrite:
            try:
                self.location.read_bytes(METADATA_NAME)
            except (FileNotFoundError, OSError):
                pass
            else:
                from .errors import ArchiveExistsError

                raise ArchiveExistsError(f"{self.location}: a checkpoint exists and overwrite=False")
        return plan

    def prepare_global_plan(self, plans: list[SavePlan]) -> list[SavePlan]:
        return [
            dataclasses.replace(p, storage_data=_Prefix(f"__{i}_")) if p.storage_data is None else p
            for i, p in enumerate(plans)
        ]

    def write_data(self, plan: SavePlan, planner: SavePlanner) -> Future[list[WriteResult]]:
        from . import saving
        from .tdz.tree import Level

        name = f"{plan.storage_data.prefix}0.tdz"
        tree: dict[str, Any] = {}
        table: list[list[Any]] = []
        results: list[WriteResult] = []
        for item in plan.items:
            key = _storage_key(item.index)
            if key in tree or key == CHUNKS_KEY:
                raise BadArchiveError(f"{self.location}/{name}: two items map to the key {key!r}")
            data: Any = planner.resolve_data(item)
            offsets: list[int] = []
            if item.type == WriteItemType.BYTE_IO:
                raw = data.getbuffer() if isinstance(data, io.BytesIO) else memoryview(data)
                t = (
                    torch.frombuffer(bytearray(raw), dtype=torch.uint8)
                    if len(raw)
                    else torch.empty(0, dtype=torch.uint8)
                )
            else:
                t = data.detach()
                if t.device.type != "cpu":
                    t = t.cpu()
                t = t.contiguous()
                if item.tensor_data is not None:
                    offsets = [int(o) for o in item.tensor_data.chunk.offsets]
            tree[key] = t
            nbytes = t.numel() * t.element_size()
            table.append([key, item.index.fqn, offsets, list(t.shape), item.type.name])
            results.append(
                WriteResult(index=item.index, size_in_bytes=nbytes, storage_data=TdzChunk(name, key, nbytes))
            )
        tree[CHUNKS_KEY] = table
        level = Level(tree)
        saving.save(
            level,
            self.location.join(name),
            compression=self.compression,
            num_threads=self.num_threads,
            storage_options=self.location.storage_options if self.location.url else None,
        )
        fut: Future[list[WriteResult]] = Future()
        fut.set_result(results)
        return fut

    def finish(self, metadata: Metadata, results: list[list[WriteResult]]) -> None:
        metadata.version = "1.0.0"
        storage: dict[Any, Any] = {}
        for rs in results:
            storage.update({r.index: r.storage_data for r in rs})
        metadata.storage_data = storage
        metadata.storage_meta = self.storage_meta()
        self.location.write_bytes(METADATA_NAME, pickle.dumps(metadata))

    def storage_meta(self) -> StorageMeta | None:
        return StorageMeta(checkpoint_id=str(self.location), save_id=self.save_id)

    @property
    def checkpoint_id(self) -> str | os.PathLike:
        return self.location.root

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id: str | os.PathLike) -> bool:
        return isinstance(checkpoint_id, (str, os.PathLike))


class TdzStorageReader(StorageReader):
    """Reads a checkpoint written by :class:`TdzStorageWriter`, on any world size.

    Parameters
    ----------
    path : str or os.PathLike
        The checkpoint directory or fsspec URL prefix.
    storage_options : dict, optional
        fsspec options for URLs.
    verify : bool
        Check the CRC-32 of every fetched entry of remote archives (local
        archives are mapped; ``tdz verify`` checks them).

    Examples
    --------
    >>> import tempfile, torch, torch.distributed.checkpoint as dcp
    >>> from tdz_numba.dcp import TdzStorageReader, TdzStorageWriter
    >>> with tempfile.TemporaryDirectory() as d:
    ...     _ = dcp.save({"w": torch.arange(6.0)}, storage_writer=TdzStorageWriter(d), no_dist=True)
    ...     sd = {"w": torch.zeros(6)}
    ...     dcp.load(sd, storage_reader=TdzStorageReader(d), no_dist=True)
    ...     print(sd["w"][-1].item())
    5.0
    """

    def __init__(
        self, path: str | os.PathLike, *, storage_options: dict[str, Any] | None = None, verify: bool = True
    ) -> None:
        super().__init__()
        self.location = _Location(path, storage_options)
        self.verify = verify
        self.storage_data: dict[Any, Any] = {}
        self.load_id = uuid.uuid4().hex

    def reset(self, checkpoint_id: str | os.PathLike | None = None) -> None:
        self.storage_data = {}
        if checkpoint_id:
            self.location = _Location(checkpoint_id, self.location.storage_options)
        self.load_id = uuid.uuid4().hex

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        try:
            raw = self.location.read_bytes(METADATA_NAME)
        except FileNotFoundError:
            raise BadArchiveError(f"{self.location}: no DCP checkpoint here (no {METADATA_NAME})") from None
        metadata = pickle.loads(raw)  # DCP's own format: a pickled Metadata
        if getattr(metadata, "storage_meta", None) is None:
            metadata.storage_meta = StorageMeta()
        metadata.storage_meta.load_id = self.load_id
        return metadata

    def set_up_storage_reader(
        self, metadata: Metadata, is_coordinator: bool, *args: Any, **kwargs: Any
    ) -> None:
        self.storage_data = metadata.storage_data
        if self.storage_data is None:
            raise BadArchiveError(f"{self.location}: the checkpoint metadata has no storage data")

    def prepare_local_plan(self, plan: LoadPlan) -> LoadPlan:
        return plan

    def prepare_global_plan(self, plans: list[LoadPlan]) -> list[LoadPlan]:
        return plans

    def _open(self, rel: str):
        from . import api
        from .remote.archive import open_remote

        target = self.location.join(rel)
        if self.location.url:
            return open_remote(str(target), storage_options=self.location.storage_options, verify=self.verify)
        return api.open(target)

    def read_data(self, plan: LoadPlan, planner: LoadPlanner) -> Future[None]:
        from torch.distributed._shard._utils import narrow_tensor_by_index

        from .tdz.tree import encode_key

        per_file: dict[str, list[Any]] = {}
        for req in plan.items:
            info = self.storage_data[req.storage_index]
            if not isinstance(info, TdzChunk):
                raise BadArchiveError(
                    f"{self.location}: not a tdz checkpoint (storage data {type(info).__name__})"
                )
            per_file.setdefault(info.relative_path, []).append(req)
        for rel, reqs in per_file.items():
            ar = self._open(rel)
            try:
                index = ar._index
                if hasattr(index, "fetch"):  # remote: every needed leaf in one coalesced batch
                    names = ["meta.json"] + [
                        encode_key(self.storage_data[r.storage_index].key) + ".memmap" for r in reqs
                    ]
                    rows = [index.row(n) for n in names]
                    index.fetch([r for r in rows if r is not None])
                for req in reqs:
                    key = self.storage_data[req.storage_index].key
                    stored = ar[key]
                    if req.type == LoadItemType.BYTE_IO:
                        planner.load_bytes(req, io.BytesIO(stored.numpy().tobytes()))
                        continue
                    src = narrow_tensor_by_index(stored, req.storage_offsets, req.lengths)
                    target = planner.resolve_tensor(req).detach()
                    if target.size() != src.size():
                        raise BadArchiveError(
                            f"{self.location}/{rel}: {key!r}: stored chunk {list(src.size())}, "
                            f"destination {list(target.size())}"
                        )
                    target.copy_(src)
                    planner.commit_tensor(req, target)
            finally:
                ar.close()
        fut: Future[None] = Future()
        fut.set_result(None)
        return fut

    @property
    def checkpoint_id(self) -> str | os.PathLike:
        return self.location.root

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id: str | os.PathLike) -> bool:
        return isinstance(checkpoint_id, (str, os.PathLike))
