"""The streaming writer (re-exported by the package): :class:`Writer`, an archive written leaf by
leaf in bounded memory.

Each :meth:`Writer.add` writes its leaf's local header and payload at once (the CRC computed as
the bytes are written, as :func:`tdz_numba.save` does), and :meth:`Writer.stream` hands out a
:class:`Sink` that takes a payload in pieces; only the central records and each level's keys are
kept. The ``meta.json`` of every level, which lists keys not known until the end, is written when
the ``with`` block ends, after the payloads, then the central directory. The archive holds the
same entries with the same bytes as ``save()`` of the same tree (only the ``meta.json`` entries
come last instead of first in their levels; :func:`tdz_numba.compact` puts them in tensordict's
order, byte for byte ``save``'s archive). It is written to a temp file renamed into place at the
end: leaving the block by an exception leaves no file and no temp file.

Examples
--------
>>> import tempfile, pathlib, torch, tdz_numba
>>> with tempfile.TemporaryDirectory() as d:
...     with tdz_numba.Writer(pathlib.Path(d) / "x.tdz") as w:
...         w.add("a", torch.ones(2))
...         with w.stream("big", (4,), torch.int32) as sink:
...             _ = sink.write(torch.arange(2, dtype=torch.int32))
...             _ = sink.write(b"\\x02\\x00\\x00\\x00\\x03\\x00\\x00\\x00")
...     print(tdz_numba.load(pathlib.Path(d) / "x.tdz")["big"].tolist())
[0, 1, 2, 3]
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any, Literal

import numpy as np
import torch

from .errors import ArchiveExistsError, InvalidArgumentError, InvalidTreeError, TdzError
from .files import tempfiles as _tempfiles
from .files.paths import user_errors
from .tdz.tdcompat import converter as tdcompat_converter
from .tdz.tree import _json, encode_key, flatten, td_level_fields
from .zipfmt import grow as _grow
from .zipfmt import packers, records
from .zipfmt.entry import Entry

__all__ = ["Writer", "Sink", "NewLevel"]

PathLike = str | os.PathLike


class _Level:
    __slots__ = ("keys", "meta", "whole")

    def __init__(self, meta: dict[str, Any] | None = None, whole: bool = False) -> None:
        self.keys: dict[str, Any] = {}
        self.meta = meta
        self.whole = whole  # written whole by one add() (its meta.json included): takes no more keys


def _shown(key: str | tuple[str, ...]) -> str:
    """A key as messages show it (a tuple joined with "/")."""
    return key if isinstance(key, str) else "/".join(key)


#: Bytes of the pinned host buffer through which a :class:`Writer`'s sinks take CUDA chunks
#: (one buffer per Writer, made on the first device chunk, reused for every later one).
STAGE_BYTES = 8 << 20


def _staged(t: torch.Tensor, staging: torch.Tensor) -> Iterator[memoryview]:
    """The bytes of a device tensor, copied to the host through ``staging`` (a uint8 host tensor,
    pinned where CUDA is available) one piece of ``staging.numel()`` bytes at a time."""
    flat = t.detach().contiguous().reshape(-1).view(torch.uint8)
    n, step = flat.numel(), staging.numel()
    for a in range(0, n, step):
        k = min(step, n - a)
        staging[:k].copy_(flat[a : a + k])  # blocking: the bytes are written before the next piece
        yield memoryview(staging[:k].numpy())  # type: ignore[arg-type]


def _as_bytes(chunk: Any, key: str) -> memoryview:
    """A chunk's bytes, without a copy where it can be avoided (CUDA tensors are copied to the host)."""
    if isinstance(chunk, torch.Tensor):
        t = chunk.detach()
        if not t.is_cpu:
            t = t.cpu()
        return memoryview(t.contiguous().reshape(-1).view(torch.uint8).numpy())  # type: ignore[arg-type]
    if isinstance(chunk, np.ndarray):
        return memoryview(np.ascontiguousarray(chunk).reshape(-1).view(np.uint8))  # type: ignore[arg-type]
    if isinstance(chunk, (bytes, bytearray, memoryview)):
        return memoryview(chunk).cast("B")
    raise InvalidArgumentError(
        f"stream {key!r}: write takes a tensor, an array, bytes or a memoryview, got {type(chunk).__name__}"
    )


class NewLevel:
    """A level declared among the values of :meth:`Writer.add_many` (its ``meta`` as for
    :meth:`Writer.add_level`)."""

    __slots__ = ("meta",)

    def __init__(self, meta: dict[str, Any] | None = None) -> None:
        self.meta = meta


class Sink:
    """Takes the payload of one leaf in pieces (:meth:`write`), checked against its size at
    :meth:`close` (also when its ``with`` block ends)."""

    def __init__(self, writer: Writer, key: str, batch: _grow.Batch, nbytes: int) -> None:
        from .zipfmt.payload import _crc_functions

        self._writer = writer
        self.key = key
        self._batch = batch
        self.nbytes = nbytes
        self.written = 0
        self._crc = 0
        self._crc32 = _crc_functions()[0]
        digests = batch.prep.digests
        self._hasher = None
        if digests is not None and batch.prep.n:
            from .zipfmt.digest import PENDING, hasher

            digests[0] = PENDING
            self._hasher = hasher()
        self._pos = int(batch.prep.plan.payload_offset[0]) if batch.prep.n else 0
        self.closed = False

    def write(self, chunk: Any) -> int:
        """Writes the next bytes of the payload; returns how many."""
        if self.closed:
            raise TdzError(f"stream {self.key!r}: write after close")
        if isinstance(chunk, torch.Tensor) and not chunk.is_cpu:  # through the pinned buffer
            n = chunk.numel() * chunk.element_size()
            self._check_room(n)
            for view in _staged(chunk, self._writer._stage()):
                self._put(view)
            return n
        view = _as_bytes(chunk, self.key)
        n = view.nbytes
        self._check_room(n)
        if n:
            self._put(view)
        return n

    def _check_room(self, n: int) -> None:
        if self.written + n > self.nbytes:
            raise TdzError(
                f"stream {self.key!r}: {self.written + n} bytes written, more than the "
                f"{self.nbytes} its shape and dtype hold",
                entry=self.key,
                expected=self.nbytes,
                found=self.written + n,
            )

    def _put(self, view: memoryview) -> None:
        """Writes ``view`` at the sink's position, CRC and digest updated."""
        from .zipfmt.payload import write_segments

        n = view.nbytes
        write_segments(self._writer._fd, [(self._pos, view)])
        self._crc = self._crc32(view, self._crc)
        if self._hasher is not None:
            self._hasher.update(view)
        self._pos += n
        self.written += n

    def close(self) -> None:
        """Checks the byte count and records the leaf (its CRC patched into its local header)."""
        if self.closed:
            return
        if self.written != self.nbytes:
            raise TdzError(
                f"stream {self.key!r}: {self.written} bytes written, its shape and dtype hold {self.nbytes}",
                entry=self.key,
                expected=self.nbytes,
                found=self.written,
            )
        self.closed = True
        b = self._batch
        if b.prep.n:
            b.fields["crc"][0] = self._crc
            if self._hasher is not None:
                b.prep.digests[0] = self._hasher.digest()
            at = int(b.prep.plan.header_offset[0]) + records.LOCAL_DT.fields["crc"][1]  # type: ignore[index]
            os.pwrite(self._writer._fd, self._crc.to_bytes(4, "little"), at)
            self._writer._central.append(b.central())
        self._writer._open_sinks.discard(self)

    def __enter__(self) -> Sink:
        return self

    def __exit__(self, exc_type: Any, exc: Any, tb: Any) -> None:
        if exc_type is None:
            self.close()


class Writer:
    """Writes an archive leaf by leaf: ``with tdz_numba.Writer(path) as w: w.add(key, value)``.

    Parameters
    ----------
    path : str or os.PathLike
        The archive to write (replaced atomically at the end of the ``with`` block).
    align : {None, 64, 4096, 16384, 65536, "auto"}
        Payload alignment, as for :func:`tdz_numba.save`.
    compression : {None, "deflate", "bzip2", "lzma"}
        Codec of the payloads of :meth:`add` (streamed leaves are stored).
    compresslevel : int, optional
        Its level.
    durable : bool
        ``fsync`` the file before the rename and the directory after.
    digest : bool
        An XXH3-128 digest of every payload, computed from the pieces as they are written
        (streamed leaves too), stored as :func:`tdz_numba.save` stores it (``digest`` extra).
    existsok : bool
        False: an existing ``path`` raises :class:`~tdz_numba.ArchiveExistsError`.
    metadata : dict, optional
        The file's own metadata, as for :func:`tdz_numba.save` (written at the end).

    Examples
    --------
    >>> import tempfile, pathlib, torch, tdz_numba
    >>> with tempfile.TemporaryDirectory() as d:
    ...     with tdz_numba.Writer(pathlib.Path(d) / "x.tdz") as w:
    ...         w.add_level("obs", meta={"shape": [3]})
    ...         w.add("obs/pixels", torch.zeros(3, 2))
    ...         w.add("env", "CartPole")
    ...     print(tdz_numba.load(pathlib.Path(d) / "x.tdz")["obs"].batch_size)
    [3]
    """

    def __init__(
        self,
        path: PathLike,
        *,
        align: int | str | None = None,
        compression: str | None = None,
        compresslevel: int | None = None,
        durable: bool = True,
        digest: bool = False,
        existsok: bool = True,
        metadata: dict[str, Any] | None = None,
    ) -> None:
        from .zipfmt.writer import check_write_args, payload_alignments

        check_write_args(compression, compresslevel, None)
        payload_alignments(np.zeros(0, np.bool_), np.zeros(0, np.int64), align)  # (checks align)
        if digest:
            from .zipfmt.digest import require

            require("Writer(digest=True)")
        self._metadata = None
        if metadata is not None:
            from .saving import _metadata_entry

            self._metadata = _metadata_entry(metadata)  # (checked now)
        self.path = path
        self._opts = dict(compression=compression, compresslevel=compresslevel, align=align, digest=digest)
        self._durable = durable
        self._existsok = existsok
        self._fd = -1
        self._cm: Any = None
        self._staging: torch.Tensor | None = None

    def _stage(self) -> torch.Tensor:
        """The reusable host buffer of device chunks (:data:`STAGE_BYTES`, pinned with CUDA)."""
        if self._staging is None:
            pin = torch.cuda.is_available()
            self._staging = torch.empty(STAGE_BYTES, dtype=torch.uint8, pin_memory=pin)
        return self._staging

    # -- the file ----------------------------------------------------------------------------
    def __enter__(self) -> Writer:
        from .zipfmt.writer import check_target

        with user_errors(self.path, action="write"):
            self._target: Path = check_target(self.path, self._existsok)
            self._cm = _tempfiles.atomic_file(self._target, durable=self._durable)
            self._fd = self._cm.__enter__()
        self._offset = self._entries = 0
        self._central: list[bytes] = []
        self._levels: dict[str, _Level] = {"": _Level()}
        self._open_sinks: set[Sink] = set()
        self._dos = packers.dos_datetime()
        return self

    def __exit__(self, exc_type: Any, exc: Any, tb: Any) -> Literal[False]:
        cm, self._cm = self._cm, None
        if cm is None:
            return False
        if exc_type is None:
            try:
                with user_errors(self.path, action="write"):
                    self._finish()
            except BaseException as err:
                cm.__exit__(type(err), err, err.__traceback__)
                raise
        with user_errors(self.path, action="write"):
            cm.__exit__(exc_type, exc, tb)
        self._fd = -1
        return False

    def _need_open(self) -> None:
        if self._cm is None:
            raise TdzError("the Writer is not open: use it as `with tdz_numba.Writer(path) as w:`")

    def _write(self, entries: list[Entry], **opts: Any) -> _grow.Batch:
        batch = _grow.plan_batch(entries, self._offset, dos=self._dos, **{**self._opts, **opts})
        self._offset = batch.data_end
        self._entries += batch.prep.n
        return batch

    # -- levels and keys ---------------------------------------------------------------------
    def _split(self, key: Any) -> tuple[str, str]:
        """``(directory, leaf)`` of a key: ``"a/b"``, or a tuple of keys (which may hold ``/``)."""
        parts = tuple(key) if isinstance(key, tuple) else key.split("/") if isinstance(key, str) else ()
        if not parts or any(not isinstance(p, str) or not p for p in parts):
            raise InvalidArgumentError(
                f"key must be a non-empty str of '/'-separated keys or a tuple of keys, got {key!r}"
            )
        *parents, leaf = parts
        directory = ""
        for p in parents:
            self._child(directory, p, _Level(), key)
            directory += encode_key(p) + "/"
        return directory, leaf

    def _child(self, directory: str, key: str, level: _Level | None, full: str, record: Any = None) -> None:
        """Registers ``key`` in the level of ``directory``: a sub-level (``level``) reused when it
        exists, or a leaf/value ``record``."""
        parent = self._levels[directory]
        if parent.whole:
            raise InvalidTreeError(
                f"{full}: its level was written whole by one add(); add its keys one by one instead"
            )
        sub = directory + encode_key(key) + "/"
        if level is not None and sub in self._levels and key in parent.keys:
            return
        if key in parent.keys:
            raise ArchiveExistsError(f"{self.path}: key {full!r} was added already", entry=full)
        if level is not None:
            self._levels[sub] = level
            parent.keys[key] = {"type": "TensorDict"}
        else:
            parent.keys[key] = record

    def add_level(self, key: str | tuple[str, ...], meta: dict[str, Any] | None = None) -> None:
        """Creates the TensorDict level ``key`` (``"a/b"``; ``""``: the root), with ``meta``: its
        ``meta.json`` fields other than keys (``{"shape": [batch], "_names": [...], ...}``) over
        the defaults."""
        self._need_open()
        if meta is not None and not isinstance(meta, dict):
            raise InvalidArgumentError(f"add_level {key!r}: meta must be a dict, got {type(meta).__name__}")
        if key == "" or key == ():  # the root level's own fields
            self._levels[""].meta = {**td_level_fields(), **(meta or {})}
            return
        directory, leaf = self._split(key)
        sub = directory + encode_key(leaf) + "/"
        own = {**td_level_fields(), **(meta or {})}
        if sub in self._levels:
            self._levels[sub].meta = own
            return
        self._child(directory, leaf, _Level(own), _shown(key))

    def add(self, key: str | tuple[str, ...], value: Any) -> None:
        """Writes one value now: a tensor or array (its payload), a plain value (a NonTensorData
        level), or a whole mapping / TensorDict (every entry of it)."""
        self.add_many([(key, value)])

    def add_many(self, items: Any) -> None:
        """Writes several ``(key, value)`` pairs now, as :meth:`add` writes each, in one batch
        (one layout plan, one pass of writes: cheaper than an :meth:`add` per small leaf); a
        value :class:`NewLevel` declares a level there, as :meth:`add_level` does."""
        self._need_open()
        entries: list[Entry] = []
        for key, value in items:
            if isinstance(value, NewLevel):
                self.add_level(key, meta=value.meta)
                continue
            entries.extend(self._entries_of(key, value))
        if entries:
            batch = self._write(entries)
            self._central.append(batch.write(self._fd, None, self._durable))

    def _entries_of(self, key: str | tuple[str, ...], value: Any) -> list[Entry]:
        """Registers ``key`` and returns the entries of ``value`` (payloads, sub-level files)."""
        directory, leaf = self._split(key)
        entries = flatten({leaf: value}, convert=tdcompat_converter())
        record = json.loads(bytes(entries[0].data))[leaf]  # type: ignore[arg-type]
        rest = entries[1:]
        for e in rest:
            e.name = directory + e.name
        is_level = "type" in record
        self._child(directory, leaf, None, _shown(key), record)
        if is_level:  # written whole, its meta.json included: no more keys below it
            self._levels[directory + encode_key(leaf) + "/"] = _Level(whole=True)
        return rest

    def stream(self, key: str | tuple[str, ...], shape: Any, dtype: Any) -> Sink:
        """A :class:`Sink` for the payload of leaf ``key`` of ``shape`` and ``dtype`` (a torch
        dtype, a numpy dtype or its name): ``sink.write(chunk)`` with tensors (CUDA ones copied to
        the host through one reused pinned buffer of :data:`STAGE_BYTES`), arrays, bytes or memoryviews, ``sink.close()`` (or its ``with`` block) at the
        end; a byte count other than the shape's raises :class:`~tdz_numba.TdzError` naming
        ``key``. The leaf is stored (not compressed)."""
        self._need_open()
        shown = _shown(key)
        tdtype = _torch_dtype(dtype, shown)
        try:
            template = torch.empty(tuple(int(s) for s in shape), dtype=tdtype, device="meta")
        except (TypeError, ValueError, RuntimeError) as exc:
            raise InvalidArgumentError(f"stream {shown!r}: bad shape {shape!r} ({exc})") from None
        directory, leaf = self._split(key)
        entries = flatten({leaf: template}, zeros=True)
        record = json.loads(bytes(entries[0].data))[leaf]  # type: ignore[arg-type]
        self._child(directory, leaf, None, shown, record)
        payload = [Entry(directory + e.name, zeros=True, nbytes=e.nbytes) for e in entries[1:]]
        nbytes = sum(e.nbytes for e in payload)
        batch = self._write(payload, compression=None, compresslevel=None)
        if batch.prep.n:
            p = batch.prep.plan
            head = packers.local_headers(p.names, more=batch.prep.more, **batch.fields)[0]
            os.pwrite(self._fd, head, int(p.header_offset[0]))
            batch.fields["crc"][0] = 0
        sink = Sink(self, shown, batch, nbytes)
        self._open_sinks.add(sink)
        return sink

    # -- the end -----------------------------------------------------------------------------
    def _finish(self) -> None:
        from .growing import td_order

        if self._open_sinks:
            keys = sorted(s.key for s in self._open_sinks)
            raise TdzError(f"{self.path}: streams not closed at the end of the Writer: {keys}")
        metas: list[Entry] = []
        for directory, level in self._levels.items():
            if level.whole:
                continue
            meta = {**level.keys, **(level.meta or td_level_fields())}
            metas.append(Entry(directory + "meta.json", data=_json(meta)))
        metas.sort(key=lambda e: td_order(e.name))
        if self._metadata is not None:
            metas.append(self._metadata)
        batch = self._write(metas, compression=None, compresslevel=None, digest=False)
        self._central.append(batch.write(self._fd))
        cd = b"".join(self._central)
        count = self._entries
        cd_offset = self._offset
        end = packers.end_records(
            count, cd_offset, len(cd), packers.needs_zip64_end(count, cd_offset, len(cd))
        )
        from .zipfmt.payload import write_segments

        write_segments(self._fd, [(cd_offset, cd + end)])
        os.ftruncate(self._fd, cd_offset + len(cd) + len(end))

    def __repr__(self) -> str:
        return f"Writer({str(self.path)!r})"


def _torch_dtype(dtype: Any, key: str) -> torch.dtype:
    if isinstance(dtype, torch.dtype):
        return dtype
    try:
        return torch.from_numpy(np.zeros(0, np.dtype(dtype))).dtype
    except (TypeError, ValueError):
        pass
    name = str(dtype).replace("torch.", "")
    value = getattr(torch, name, None)
    if isinstance(value, torch.dtype):
        return value
    raise InvalidArgumentError(f"stream {key!r}: unknown dtype {dtype!r}")
