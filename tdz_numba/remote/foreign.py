"""Every other format over fsspec URLs and file objects: the readers of :mod:`tdz_numba.formats`
run unchanged on a :class:`RemoteFile` (a :class:`~tdz_numba.tdz.sources.MappedFile` over a
:class:`~tdz_numba.remote.object.RemoteObject`'s sparse mapping), with the bytes each needs
fetched first.

What an open fetches (requests counted by the loopback server; a file smaller than the
first read costs that one request):

- the first request reads the head (:data:`PROBE_BYTES`) of a name ending in
  ``.safetensors``, ``.gguf``, ``.npy``, ``.onnx``, ``.h5``/``.hdf5``, ``.json``, else the
  tail (:data:`~tdz_numba.remote.read.TAIL_BYTES`: a zip's central directory); the bytes,
  not the name, decide the format (a wrong guess costs one more request);
- safetensors: the 8-byte length and the JSON header (in the first read when the
  header is shorter than it); GGUF: the header (the prefix grows until the parse ends
  inside it); ``.npy``: its header;
- torch ``.pt`` (a zip): the tail, then ``data.pkl`` and the small records in one
  range; the payload offsets follow from ``torch.save``'s layout (checked against each
  member's local header when its bytes come), else every local header in one
  concurrent batch (members next to each other share a range);
- ``.npz`` (a zip): the tail only; a member's headers and data when it is first asked
  for (:mod:`~tdz_numba.remote.npz`);
- ONNX, HDF5, legacy (non-zip) torch files: the whole object (their structure is
  spread through the file);
- sharded safetensors (``*.index.json``): the index, then each shard's header; shard
  names are file names next to the index (no ``/``, never another folder).

Leaves are fetched when made: ``ar[key]`` one range, ``to_dict``/``load`` every leaf of
the level in one coalesced, concurrent batch (:func:`~tdz_numba.tdz.sources.make_present`).

Examples
--------
>>> import io, torch, tdz_numba
>>> from safetensors.torch import save
>>> buf = io.BytesIO(save({"w": torch.arange(4.0), "b": torch.ones(2)}))
>>> with tdz_numba.open(buf) as ar:
...     print(ar.format, ar["w"].tolist())
safetensors [0.0, 1.0, 2.0, 3.0]
"""

from __future__ import annotations

import json
import struct
from functools import partial
from pathlib import Path
from typing import Any

import numpy as np

from ..errors import BadArchiveError, TdzError, UnsupportedError
from ..formats.detect import FORMATS, HEAD_BYTES, _no_duplicates, opener
from ..tdz.sources import MappedFile, Source, TensorSpec, mapped_as
from ..zipfmt import eocd
from .object import RemoteObject
from .transports import _S3, _Generic, _Http

__all__ = ["RemoteFile", "PROBE_BYTES", "start", "is_zip", "sniff_remote", "open_foreign", "open_foreign_zip"]

#: Bytes of the first (head) request of a head-first format.
PROBE_BYTES = 64 << 10
#: Name endings of zips of other formats: their first request reads this many tail bytes.
ZIP_NAMES, ZIP_TAIL = (".pt", ".pth", ".bin", ".ckpt", ".npz"), 64 << 10
#: Name endings whose first request reads the head, not the tail.
HEAD_FIRST = (".safetensors", ".gguf", ".npy", ".onnx", ".h5", ".hdf5", ".he5", ".json")
#: Readers that get the whole object at open.
_WHOLE = ("onnx", "hdf5", "torch_legacy")


class RemoteFile(MappedFile):
    """A :class:`~tdz_numba.tdz.sources.MappedFile` over a remote object's sparse mapping:
    :meth:`need` fetches the bytes that are not here yet."""

    remote = True

    def __init__(self, obj: RemoteObject) -> None:
        super().__init__(Path(obj.label), obj._mmap, obj.size, False)
        self.path = obj.label  # type: ignore[assignment]  # a URL names the file
        self.obj = obj

    def need(self, start: int, stop: int) -> None:
        self.obj.need(start, stop)

    def need_spans(self, spans: list[tuple[int, int]]) -> None:
        self.obj.need_spans(spans)


class _PredictedZip(RemoteFile):
    """A torch zip whose payload offsets were predicted (:meth:`RemoteIndex.predict_payloads`):
    each leaf's fetch also fetches its member's local header (a few bytes before it: the
    same request) and checks the prediction before the bytes are used."""

    def __init__(self, obj: RemoteObject, index: Any) -> None:
        super().__init__(obj)
        t = index.table
        order = np.argsort(t["payload_offset"], kind="stable")
        self._index, self._order = index, order
        self._starts = t["payload_offset"][order]
        self._stops = self._starts + t["csize"][order]
        self._hoff = t["header_offset"][order]

    def need(self, start: int, stop: int) -> None:
        self.need_spans([(start, stop)])

    def need_spans(self, spans: list[tuple[int, int]]) -> None:
        predicted = self._index.predicted
        rows: list[int] = []
        extra: list[tuple[int, int]] = []
        for a, _ in spans:
            k = int(np.searchsorted(self._starts, a, side="right")) - 1
            if k >= 0 and a < self._stops[k] and predicted[self._order[k]]:
                rows.append(int(self._order[k]))
                extra.append((int(self._hoff[k]), int(self._starts[k])))
        self.obj.need_spans(list(spans) + extra)
        for i in rows:
            if predicted[i]:
                self._index.check_predicted(i)


def start(obj: RemoteObject, tail_bytes: int) -> None:
    """The first request: the head of a head-first name, else the tail."""
    name = obj.label.split("?")[0].lower()
    if name.endswith(HEAD_FIRST):
        obj.start(head=PROBE_BYTES)
    elif name.endswith(ZIP_NAMES):
        obj.start(tail=min(tail_bytes, ZIP_TAIL))
    else:
        obj.start(tail=tail_bytes)


def is_zip(obj: RemoteObject, tail_bytes: int) -> bool:
    """Whether the object is a zip: ``PK`` magic at its start (from a head read), or an end
    record in its tail (from a tail read)."""
    if obj.size < 22:
        return False
    if not obj.present(0, 4):
        if eocd.end_record_position(bytes(obj.buffer[max(0, obj.size - tail_bytes) :])) >= 0:
            return True
        obj.need(0, min(obj.size, HEAD_BYTES))  # (the sniffers read these bytes next)
    return bytes(obj.buffer[:4]) in (b"PK\x03\x04", b"PK\x05\x06")  # (a truncated zip too: its error)


def sniff_remote(obj: RemoteObject) -> str:
    """The registered format of a non-zip object from its first bytes (fetched if needed)."""
    n = min(obj.size, HEAD_BYTES)
    obj.need(0, n)
    head = bytes(obj.buffer[:n])
    if not head:
        raise BadArchiveError(f"{obj.label}: empty object, not a tensor file", path=obj.label)
    if head.lstrip()[:1] == b"{" and obj.size <= 64 << 20:  # a sharded index: JSON naming shards
        obj.need(0, obj.size)
        if b'"weight_map"' in bytes(obj.buffer):
            return "safetensors_index"
    where = Path(obj.label)
    for fmt in sorted(FORMATS.values(), key=lambda f: f.order):
        if fmt.name == "safetensors_index":
            continue
        try:
            hit = fmt.sniff(where, head, obj.size)
        except (OSError, ValueError, struct.error):
            hit = False
        if hit:
            return fmt.name
    raise UnsupportedError(
        f"{obj.label}: unknown file format (first bytes {head[:16]!r}); tdz_numba reads .tdz, safetensors, "
        f"torch.save (.pt), .npy/.npz, GGUF, HDF5, ONNX files and tensordict memmap directories",
        path=obj.label,
    )


def _opened(
    name: str, obj: RemoteObject, options: dict[str, Any], file: RemoteFile | None = None, **kw: Any
) -> Source:
    """The format's own opener on the object (its ``MappedFile.open`` gives :class:`RemoteFile`)."""
    rf = file if file is not None else RemoteFile(obj)
    key = obj.label
    with mapped_as({key: rf, str(Path(key)): rf}, partial(_neighbour, obj)):
        src = opener(name)(key, **kw, **options)
    src.path = obj.label  # type: ignore[assignment]  # a URL names the source
    src.remote = obj  # type: ignore[attr-defined]  # traffic counters, read_all for verify
    return src


def _neighbour(obj: RemoteObject, location: str) -> RemoteFile:
    """The object at ``location`` (checked by the reader: relative, no ``..``) in the folder of
    ``obj``'s URL, sized and pinned by one metadata request; its bytes come when used."""
    if not isinstance(obj.io, (_Http, _S3, _Generic)):
        raise UnsupportedError(
            f"{obj.label}: names another file ({location!r}); a file object has no folder: use a URL",
            path=obj.label,
        )
    parts = [p for p in location.replace("\\", "/").split("/") if p not in ("", ".")]
    if not parts or ".." in parts:
        raise BadArchiveError(f"{obj.label}: {location!r} is not a file inside its folder", path=obj.label)
    url = obj.label.split("?")[0].rsplit("/", 1)[0] + "/" + "/".join(parts)
    other = RemoteObject(url, obj.storage_options)
    other.stat()
    return RemoteFile(other)


def open_foreign(obj: RemoteObject, options: dict[str, Any]) -> Source:
    """A non-zip object opened by its format's reader, the header bytes fetched first."""
    name = sniff_remote(obj)
    size = obj.size
    if name == "safetensors":
        obj.need(0, 8)
        (n,) = struct.unpack("<Q", bytes(obj.buffer[:8]))
        obj.need(8, 8 + min(n, size))  # (a length past the end: the reader says so)
    elif name == "npy":
        from ..formats.numpy_fmt import MAX_HEADER

        obj.need(0, 12)  # magic, version, header length (2 bytes in version 1, else 4)
        head = bytes(obj.buffer[:12])
        n = (
            int.from_bytes(head[8:10], "little") + 10
            if head[6] == 1
            else int.from_bytes(head[8:12], "little") + 12
        )
        obj.need(0, min(n, MAX_HEADER + 12))
    elif name == "gguf":
        return _open_gguf(obj, options)
    elif name == "safetensors_index":
        return _open_sharded(obj, options)
    elif name in _WHOLE:
        obj.need(0, size)
    else:  # a format registered by someone else: it gets the whole object
        obj.need(0, size)
    return _opened(name, obj, options)


def _open_gguf(obj: RemoteObject, options: dict[str, Any]) -> Source:
    """GGUF: the reader runs on the prefix fetched so far; its header must end inside it
    (the data section starts after the header), else the prefix grows and it runs again."""
    have = obj.ranges[0][1] if obj.ranges and obj.ranges[0][0] == 0 else 0
    for _ in range(16):
        try:
            src = _opened("gguf", obj, options)
        except TdzError:
            if have >= obj.size:
                raise
            have = min(obj.size, max(have * 8, 1 << 20))
            obj.need(0, have)
            continue
        data_start = int(getattr(src, "data_start", obj.size))
        if data_start <= have:
            return src
        src.close()
        have = min(obj.size, data_start)
        obj.need(0, have)
    raise BadArchiveError(f"{obj.label}: the GGUF header never ended", path=obj.label)  # pragma: no cover


def open_foreign_zip(kind: str, index: Any, options: dict[str, Any]) -> Source:
    """A torch ``.pt`` or ``.npz`` zip over a :class:`~tdz_numba.remote.read.RemoteIndex`:
    its small records fetched in one range, its members' local headers (and ``.npy``
    headers) in one batch, then the reader runs unchanged."""
    obj: RemoteObject = index.obj
    names = index.names
    file: RemoteFile | None = None
    if kind == "torch":
        small = [i for i, n in enumerate(names) if "/data/" not in n]
        index.fetch(small)  # data.pkl, byteorder, version: next to each other, one range
        index.heads = 0
        if index.predict_payloads():  # torch.save's layout: no local header read at open
            file = _PredictedZip(obj, index)
    else:  # npz: the keys from the central directory; a member's headers when it is asked for
        from .npz import open_npz_remote

        src = open_npz_remote(index, RemoteFile(obj))
        src.remote = obj  # type: ignore[attr-defined]  # traffic counters, read_all for verify
        return src
    index.check_all()  # every local header in one concurrent batch (unless predicted)
    return _opened(kind, obj, options, file=file, index=index)


def _open_sharded(obj: RemoteObject, options: dict[str, Any]) -> Source:
    """A sharded safetensors checkpoint: the index, then every shard's header; shards are
    file names next to the index (a name with ``/`` or ``\\`` is refused)."""
    from ..formats._common import quote
    from ..formats._flat import flat_source
    from ..formats.safetensors import index_claims, join_shards, parse_header

    where = obj.label
    try:
        index = json.loads(bytes(obj.buffer).decode("utf-8"), object_pairs_hook=_no_duplicates)
    except (UnicodeDecodeError, ValueError, RecursionError) as exc:
        raise BadArchiveError(f"{where}: not valid JSON: {exc}", path=where) from None
    wmap, meta = index_claims(index, where)
    base = where.split("?")[0].rsplit("/", 1)[0] + "/"
    shards = list(dict.fromkeys(wmap.values()))
    files: list[MappedFile] = []
    per: dict[str, dict[str, TensorSpec]] = {}
    metadata: dict[str, Any] = {}
    storage = getattr(obj, "storage_options", None)
    for i, name in enumerate(shards):
        if not isinstance(name, str) or not name or "/" in name or "\\" in name or name in (".", ".."):
            raise BadArchiveError(
                f"{where}: weight_map names shard {quote(name)}: not a file name next to the index"
            )
        shard = RemoteObject(base + name, storage)
        shard.start(head=PROBE_BYTES)
        shard.need(0, 8)
        (n,) = struct.unpack("<Q", bytes(shard.buffer[:8])) if shard.size >= 8 else (0,)
        shard.need(8, 8 + min(n, shard.size))
        f = RemoteFile(shard)
        files.append(f)
        specs, smeta = parse_header(f.buffer, f.size, str(f.path), file=i)
        metadata.update(smeta)
        per[name] = specs
    tree = join_shards(per, wmap, where)
    metadata.update(meta)
    src = flat_source("safetensors", Path(where), tree, files=files, metadata=metadata)
    src.path = where  # type: ignore[assignment]
    src.remote = obj  # type: ignore[attr-defined]
    return src


def verify_foreign(ar: Any, progress: bool | None) -> Any:
    """``verify`` of a remote file of another format: every object fetched (a progress bar
    with bytes per second), then the checks of a local verify: zip members' CRC-32s (a
    ``.pt`` or ``.npz``), every leaf's bounds, compressed leaves and loaders decoded."""
    from ..archive.verify import VerifyReport, check_leaves, verify_compressed
    from ..files.progress import progress as _progress
    from ..zipfmt import records
    from .read import RemoteIndex

    source = ar.source
    files = source.files
    objs = list({id(f.obj): f.obj for f in files if isinstance(f, RemoteFile)}.values())
    todo = sum(sum(b - a for a, b in o.missing(0, o.size)) for o in objs)
    entries = 0
    zipped: set[int] = set()
    with _progress(todo, "fetch", enabled=progress) as bar:
        for o in objs:
            o.progress = bar.update
            try:
                o.read_all()
            finally:
                o.progress = None
    for n, f in enumerate(files):
        if isinstance(f, RemoteFile) and bytes(f.buffer[:4]) == b"PK\x03\x04":
            index = RemoteIndex(f.obj, verify=True)  # every byte is here: no request
            index.check_all()  # local headers, the CRC-32 of every STORED member
            rows = np.nonzero(index.table["method"] != records.STORED)[0].tolist()
            with _progress(None, "verify", enabled=progress) as bar:
                verify_compressed(index, rows, bar)
            entries += len(index.names)
            zipped.add(n)
    levels, leaves, payload, decoded, crc_bytes = check_leaves(ar, zipped)
    return VerifyReport(
        source.path, entries or leaves, levels, leaves, payload, ar.format, min(crc_bytes, payload), decoded
    )


def fetched(src: Source) -> tuple[int, int]:
    """``(requests, bytes)`` of every remote object of a source."""
    objs = {id(f.obj): f.obj for f in src.files if isinstance(f, RemoteFile)}
    top = getattr(src, "remote", None)
    if top is not None:
        objs[id(top)] = top
    return sum(o.requests for o in objs.values()), sum(o.bytes_fetched for o in objs.values())


def read_all(src: Source) -> None:
    """Fetches every byte of every remote object of a source (``verify``)."""
    for f in src.files:
        if isinstance(f, RemoteFile):
            f.obj.read_all()
    top = getattr(src, "remote", None)
    if top is not None:
        top.read_all()
