"""Archives that grow (re-exported by the package): :func:`append`, :func:`compact`,
:func:`repair`.

:func:`append` adds the leaves and levels of a tree to an existing archive (ours,
tensordict's, or a ``zip -0 -r`` of a memmap directory) without rewriting it: the new
payloads and the ``meta.json`` of each level that gains keys are written after the file's
last byte, then a central directory listing every live entry; the commit is one small
write of the end records (the protocol and its crash states:
:mod:`tdz_numba.zipfmt.grow`). :func:`compact` rewrites an archive without the bytes
that appends superseded; :func:`repair` truncates a file an append was killed in to its
last committed state.

Examples
--------
>>> import tempfile, pathlib, torch, tdz_numba
>>> with tempfile.TemporaryDirectory() as d:
...     p = tdz_numba.save({"w": torch.ones(2)}, pathlib.Path(d) / "ckpt.tdz")
...     _ = tdz_numba.append(p, {"step": 7, "opt": {"m": torch.zeros(2)}})
...     print(sorted(tdz_numba.load(p).keys()))
['opt', 'step', 'w']
"""

from __future__ import annotations

import contextlib
import json
import mmap
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from .errors import ArchiveExistsError, InvalidArgumentError, InvalidTreeError
from .files.paths import as_local_path, user_errors
from .tdz.gcpause import paused_gc
from .tdz.tdcompat import converter as tdcompat_converter
from .tdz.tree import RESERVED_FIELDS, _json, class_name, decode_key, encode_key, flatten, is_keyed
from .zipfmt import grow as _grow
from .zipfmt.entry import Entry
from .zipfmt.index import ArchiveIndex

__all__ = ["append", "compact", "repair", "td_order"]

PathLike = str | os.PathLike


@contextlib.contextmanager
def _locked(target: Path) -> Iterator[int]:
    """An exclusive lock on the file that ``target`` names now (a compaction that replaced the
    file while this process waited for the lock is followed to the new file)."""
    for _ in range(100):
        with _grow.locked(target) as fd:
            st, now = os.fstat(fd), os.stat(target)
            if (st.st_dev, st.st_ino) == (now.st_dev, now.st_ino):
                yield fd
                return
    raise InvalidArgumentError(f"{target}: the file keeps being replaced; cannot lock it")  # pragma: no cover


def _key_fields(meta: dict[str, Any]) -> list[str]:
    """The fields of a keyed level's meta.json that are its children."""
    return [
        k
        for k, v in meta.items()
        if k not in RESERVED_FIELDS and isinstance(v, dict) and ("dtype" in v or "type" in v)
    ]


def _shown(directory: str, key: str | None = None) -> str:
    """The key path of a level directory (``"a%2Fb/c/"``) as the user wrote it."""
    parts = [decode_key(p) for p in directory.rstrip("/").split("/") if p]
    if key is not None:
        parts.append(key)
    return "/".join(parts) or "<root>"


def _batch_prefix_ok(batch: Any, shape: Any) -> bool:
    return isinstance(shape, list) and shape[: len(batch)] == list(batch)


def _subpath_keys(subpath: Any) -> list[str]:
    if subpath is None:
        return []
    if isinstance(subpath, str):
        return [k for k in subpath.split("/") if k]
    if isinstance(subpath, (list, tuple)) and all(isinstance(k, str) for k in subpath):
        return list(subpath)
    raise InvalidArgumentError(f"subpath must be a str ('a/b') or a tuple of str keys, got {subpath!r}")


class _Merge:
    """The entries an append writes and the old entries it supersedes."""

    def __init__(self, index: ArchiveIndex, label: str, replace: bool) -> None:
        self.index = index
        self.label = label
        self.replace = replace
        self.live = set(index.names)
        self.drop: set[str] = set()
        self.fresh: list[str] = []  # level directories written whole (new, or replaced)
        self.replaced: list[str] = []

    def old_meta(self, directory: str) -> dict[str, Any] | None:
        name = directory + "meta.json"
        if name not in self.live:
            return None
        try:
            meta = json.loads(self.index.read_bytes(name))
        except (ValueError, UnicodeDecodeError) as exc:
            raise InvalidTreeError(f"{self.label}: {name} is not valid JSON ({exc})") from None
        if not isinstance(meta, dict):
            raise InvalidTreeError(f"{self.label}: {name} does not hold a JSON object")
        return meta

    def drop_key(self, directory: str, key: str) -> None:
        base = directory + encode_key(key)
        for name in self.live:
            if name in (base + ".memmap", base + ".shape.memmap") or name.startswith(base + "/"):
                self.drop.add(name)
        self.fresh.append(base + "/")

    def level(self, directory: str, new: dict[str, Any]) -> bytes | None:
        """Merges the new meta.json of ``directory`` into the archive's: the merged bytes, or
        None when the level is new (or written whole) and the new bytes stand."""
        if any(directory.startswith(f) for f in self.fresh):
            return None
        old = self.old_meta(directory)
        if old is None:
            self.fresh.append(directory)
            return None
        if not is_keyed(old) or "_is_non_tensor" in old:
            raise InvalidTreeError(
                f"{self.label}: cannot add keys to {_shown(directory)}: it is a {class_name(old)} level "
                f"(only TensorDict levels take new keys; pass replace=True on its parent to supersede it)"
            )
        batch = old.get("shape") if isinstance(old.get("shape"), list) else []
        old_keys = _key_fields(old)
        changed: dict[str, Any] = {}
        added: dict[str, Any] = {}
        for key in _key_fields(new):
            nv = new[key]
            where = _shown(directory, key)
            if "dtype" in nv and not nv.get("is_nested") and not _batch_prefix_ok(batch, nv.get("shape")):
                raise InvalidTreeError(
                    f"{self.label}: leaf {where} of shape {nv.get('shape')} does not start with the "
                    f"batch size {batch} of {_shown(directory)}"
                )
            if key not in old_keys:
                added[key] = nv
                continue
            ov = old[key]
            if ov.get("type") == "TensorDict" and nv.get("type") == "TensorDict":
                continue  # both levels: merged key by key when the sub-level comes
            if not self.replace:
                raise ArchiveExistsError(
                    f"{self.label}: key {where!r} already exists; pass replace=True to supersede it",
                    path=self.label,
                    entry=where,
                )
            self.drop_key(directory, key)
            self.replaced.append(where)
            changed[key] = nv
        if not added and not changed:
            return b""  # nothing new at this level: its meta.json stays
        merged = {k: changed.get(k, old[k]) for k in old_keys}
        merged.update(added)
        merged.update((k, v) for k, v in old.items() if k not in old_keys)
        self.drop.add(directory + "meta.json")
        return _json(merged)

    def child_batch_ok(self, directory: str, new: dict[str, Any]) -> None:
        """A new sub-level's batch size must start with its parent's (tensordict checks it)."""
        parent = directory.rstrip("/").rpartition("/")[0]
        parent = parent + "/" if parent else ""
        old = self.old_meta(parent) if parent != directory else None
        if old is None or any(parent.startswith(f) for f in self.fresh):
            return
        batch = old.get("shape") if isinstance(old.get("shape"), list) else []
        shape = new.get("shape", [])
        if not _batch_prefix_ok(batch, shape if isinstance(shape, list) else []):
            raise InvalidTreeError(
                f"{self.label}: level {_shown(directory)} of batch size {shape} does not start with the "
                f"batch size {batch} of {_shown(parent)}"
            )


def _same_payload(index: ArchiveIndex, name: str, data: Any) -> bool:
    """Whether the archive's entry ``name`` holds ``data``'s bytes: by its XXH3-128 digest when
    the archive stores one (no payload read), else CRC-32 first (from the central directory),
    then the bytes."""
    import numpy as np

    from .zipfmt.payload import _crc_functions

    e = index.entry(name)
    new = (
        np.frombuffer(data, np.uint8) if not isinstance(data, np.ndarray) else data.reshape(-1).view(np.uint8)
    )
    if e.size != new.size:
        return False
    stored = index.digest(name)
    if stored is not None and _digest_available():  # XXH3-128 of both sides: no payload read
        from .zipfmt.digest import hash_bytes

        return hash_bytes(new) == stored
    if _crc_functions()[0](new) != e.crc:
        return False
    return bool(np.array_equal(index.read(name, check_crc=False), new))


def _digest_available() -> bool:
    """Whether the ``digest`` extra is installed (without it, stored digests are not compared)."""
    try:
        import xxhash  # noqa: F401
    except ImportError:
        return False
    return True


def _drop_unchanged(
    index: ArchiveIndex, merge: _Merge, entries: list[Entry]
) -> tuple[list[Entry], list[str]]:
    """``entries`` without the leaves and plain values whose bytes and records the archive holds
    already (``only_changed``), and the key paths that remain to be written."""
    by_name = {e.name: e for e in entries}
    gone: set[str] = set()
    prefixes: list[str] = []
    metas: dict[str, dict[str, Any]] = {}
    written: list[str] = []
    for e in entries:
        directory, _, fname = e.name.rpartition("/")
        directory = directory + "/" if directory else ""
        if fname != "meta.json" or any(directory.startswith(p) for p in prefixes):
            continue
        new = json.loads(bytes(e.data))  # type: ignore[arg-type]
        old = merge.old_meta(directory) if isinstance(new, dict) and is_keyed(new) else None
        if old is None:
            continue
        keep = dict(new)
        for key in _key_fields(new):
            nv, base = new[key], directory + encode_key(key)
            if nv.get("type") == "TensorDict":
                continue
            same = old.get(key) == nv
            if same and "dtype" in nv:
                files = [n for n in (base + ".memmap", base + ".shape.memmap") if n in by_name]
                same = all(n in merge.live and _same_payload(index, n, by_name[n].data) for n in files)
                if same:
                    gone.update(files)
            elif same:  # a plain value: its level's meta.json, byte for byte
                sub = base + "/meta.json"
                same = (
                    sub in by_name
                    and sub in merge.live
                    and merge.index.read_bytes(sub) == bytes(by_name[sub].data)  # type: ignore[arg-type]
                )
                if same:
                    prefixes.append(base + "/")
            if same:
                del keep[key]
            else:
                written.append(_shown(directory, key))
        if len(keep) != len(new):
            metas[e.name] = keep
    out = []
    for e in entries:
        if e.name in gone or any(e.name.startswith(p) for p in prefixes):
            continue
        out.append(Entry(e.name, data=_json(metas[e.name])) if e.name in metas else e)
    return out, written


def _plan(index: ArchiveIndex, label: str, entries: list[Entry], replace: bool) -> tuple[list[Entry], _Merge]:
    """The entries to write (merged meta.json files in place) and the merge (what is dropped)."""
    merge = _Merge(index, label, replace)
    out: list[Entry] = []
    for e in entries:
        directory, _, fname = e.name.rpartition("/")
        directory = directory + "/" if directory else ""
        if fname != "meta.json":
            out.append(e)
            continue
        new = json.loads(bytes(e.data))  # type: ignore[arg-type]
        was_fresh = any(directory.startswith(f) for f in merge.fresh)
        merged = merge.level(directory, new) if isinstance(new, dict) else None
        if merged is None:
            if not was_fresh and directory:
                merge.child_batch_ok(directory, new)
            out.append(e)
        elif merged != b"":  # (b"": the level gains nothing, its meta.json stays)
            out.append(Entry(e.name, data=merged))
    for e in out:  # a file of the new tree that an old entry holds already: superseded
        if e.name in merge.live:
            merge.drop.add(e.name)
    return out, merge


def append(
    path: PathLike,
    tree: Any,
    *,
    subpath: str | tuple[str, ...] | None = None,
    replace: bool = False,
    durable: bool = True,
    num_threads: int | None = None,
    compression: str | None = None,
    compresslevel: int | None = None,
    align: int | str | None = None,
    align_threshold: int | None = None,
    only_changed: bool = False,
    digest: bool | None = None,
) -> Any:
    """Adds the leaves and levels of ``tree`` to an existing archive, without rewriting it.

    The new payloads and the ``meta.json`` of every level that gains keys are written
    after the file's last byte, then a central directory that lists every live entry
    (the superseded ones dropped) and the end records. No byte of the old file is
    rewritten: readers that opened it before (an :class:`~tdz_numba.Archive` of this
    process, an ``r+`` archive, another process) keep reading the old state from their
    mapping. The result is a standard zip (zipfile, ``unzip``, tensordict's
    ``load_memmap``); the old central directory stays in the file as dead space until
    :func:`compact`.

    Crash safety: after a ``kill -9`` (or a crash) at any point, :func:`tdz_numba.open`
    reads the old content or the new one. Until the commit (the last small write) the
    file ends with a copy of the old end record: zipfile refuses such a file until
    :func:`repair` (``tdz repair PATH``) truncates it back to the old bytes. Appends,
    compactions and repairs of one file take an exclusive ``flock``.

    Parameters
    ----------
    path : str or os.PathLike
        An existing archive (ours, tensordict's, a ``zip -0 -r`` of a memmap directory).
    tree : Mapping or tensordict.TensorDict
        What to add, as for :func:`tdz_numba.save`. Sub-mappings merge into existing
        TensorDict levels key by key.
    subpath : str or tuple of str, optional
        The level to add under (``"a/b"``, created when missing); the root when None.
    replace : bool
        Supersede existing keys (their shape, dtype and kind may change); False: an
        existing key raises :class:`~tdz_numba.ArchiveExistsError`.
    durable : bool
        ``fsync`` before and after the commit (a power loss leaves the old or new state).
    num_threads, compression, compresslevel, align, align_threshold
        As for :func:`tdz_numba.save`, for the new payloads.
    only_changed : bool
        Incremental checkpoints: leaves and plain values that the archive holds already with
        the same dtype, shape and bytes (CRC-32 first, from the central directory, then the
        bytes) are not written. Then the key paths written are returned. The comparison
        uses the archive's digest of a leaf first when it has one (no payload read).
    digest : bool, optional
        An XXH3-128 digest of every new payload in its central record (as
        :func:`tdz_numba.save` stores it); None: when the archive has digests already.
        The old entries' records, digests included, are kept byte for byte.

    Returns
    -------
    pathlib.Path or list of str
        The archive (symlinks resolved); with ``only_changed``, the key paths written.

    Raises
    ------
    ArchiveExistsError
        A key of ``tree`` exists already and ``replace`` is False (the message names it).
    InvalidTreeError
        A value that cannot be written, a leaf whose shape does not start with its level's
        batch size, or keys added to a level that is not a TensorDict.
    BadArchiveError
        ``path`` is not a readable archive.
    FileMissingError, AccessDeniedError, DiskFullError
        File-system errors (the file is left as it was).

    Examples
    --------
    >>> import tempfile, pathlib, torch, tdz_numba
    >>> with tempfile.TemporaryDirectory() as d:
    ...     p = tdz_numba.save({"w": torch.ones(2)}, pathlib.Path(d) / "x.tdz")
    ...     _ = tdz_numba.append(p, {"w": torch.zeros(3, dtype=torch.int8)}, replace=True)
    ...     print(tdz_numba.load(p)["w"])
    tensor([0, 0, 0], dtype=torch.int8)
    """
    from .zipfmt.writer import check_write_args

    check_write_args(compression, compresslevel, num_threads)
    keys = _subpath_keys(subpath)
    for k in reversed(keys):
        tree = {k: tree}
    with user_errors(path, action="append to"), paused_gc():  # (many entries, no cycles: see save)
        target = as_local_path(path).resolve()
        label = str(path)
        entries = flatten(tree, convert=tdcompat_converter())
        with _locked(target) as fd:
            st = os.fstat(fd)
            index = ArchiveIndex(target, fd=fd, st=st)
            try:
                written: list[str] = []
                if digest is None:
                    digest = index.has_digests
                if only_changed:
                    entries, written = _drop_unchanged(index, _Merge(index, label, replace), entries)
                out, merge = _plan(index, label, entries, replace)
                located = sorted(zip((r.central_offset for r in index.rows), index.names))
            finally:
                index.close()
            if not out and not merge.drop:
                return written if only_changed else target
            with mmap.mmap(fd, st.st_size, access=mmap.ACCESS_READ) as buf:
                state = _grow.read_state(buf, label)
                records = _grow.central_records(buf, state, [o for o, _ in located])
            kept = [rec for rec, (_, name) in zip(records, located) if name not in merge.drop]
            _grow.append_entries(
                fd,
                state,
                kept,
                out,
                compression=compression,
                compresslevel=compresslevel,
                num_threads=num_threads,
                align=align,
                align_threshold=align_threshold,
                durable=durable,
                digest=bool(digest),
            )
        return written if only_changed else target


def td_order(name: str) -> tuple:
    """Sort key of tensordict's entry order: depth first; at each level ``meta.json``, then
    the other files by name, then the sub-directories by name.

    >>> sorted(["b/meta.json", "z.memmap", "a/x.memmap", "meta.json", "a/meta.json"], key=td_order)
    ['meta.json', 'z.memmap', 'a/meta.json', 'a/x.memmap', 'b/meta.json']
    """
    *dirs, fname = name.split("/")
    return (*((1, d) for d in dirs), (0, fname != "meta.json", fname))


def compact(
    path: PathLike,
    *,
    compression: str | None = "keep",
    compresslevel: int | None = None,
    align: int | str | None = None,
    align_threshold: int | None = None,
    num_threads: int | None = None,
    durable: bool = True,
) -> Path:
    """Rewrites an archive without the bytes that appends superseded (atomically, as
    :func:`tdz_numba.save` writes: a temp file renamed over it).

    The live entries are written in tensordict's order (directory entries of foreign zips
    dropped), their CRCs checked as they are read; an archive with digests keeps them. Readers that opened the old file keep
    reading it (the rename gives the path a new file).

    Parameters
    ----------
    path : str or os.PathLike
        The archive.
    compression : {"keep", None, "deflate", "bzip2", "lzma"}
        ``"keep"``: the codec of the compressed payloads when they share one, else stored.
    compresslevel, align, align_threshold, num_threads, durable
        As for :func:`tdz_numba.save`.

    Returns
    -------
    pathlib.Path
        The archive.

    Examples
    --------
    >>> import tempfile, pathlib, torch, tdz_numba
    >>> with tempfile.TemporaryDirectory() as d:
    ...     p = tdz_numba.save({"w": torch.ones(1000)}, pathlib.Path(d) / "x.tdz")
    ...     _ = tdz_numba.append(p, {"w": torch.ones(10)}, replace=True)
    ...     big = p.stat().st_size
    ...     print(tdz_numba.compact(p).stat().st_size < big, tdz_numba.load(p)["w"].shape)
    True torch.Size([10])
    """
    from .zipfmt import compression as codecs
    from .zipfmt import records
    from .zipfmt.writer import check_write_args, write_entries

    with user_errors(path, action="compact"):
        target = as_local_path(path).resolve()
        with _locked(target) as fd:
            index = ArchiveIndex(target, fd=fd, st=os.fstat(fd))
            try:
                names = sorted((n for n in index.names if not n.endswith("/")), key=td_order)
                if compression == "keep":
                    used = {index.entry(n).method for n in names if n.endswith(".memmap")} - {records.STORED}
                    by_method = {m: name for name, m in codecs.CODEC_METHODS.items()}
                    compression = by_method.get(used.pop()) if len(used) == 1 else None
                check_write_args(compression, compresslevel, num_threads)
                entries = [Entry(n, data=index.read(n), nbytes=index.entry(n).size) for n in names]
                return write_entries(
                    entries,
                    target,
                    digest=index.has_digests,  # (recomputed as they are written: the same values)
                    compression=compression,
                    compresslevel=compresslevel,
                    num_threads=num_threads,
                    durable=durable,
                    align=align,
                    align_threshold=align_threshold,
                )
            finally:
                index.close()


def repair(path: PathLike, *, durable: bool = True) -> _grow.Repaired:
    """Makes a file that an append was killed in readable by every zip tool: truncated back to
    its last committed state (the old file, byte for byte). A file that needs nothing is left
    alone (``action == "ok"``).

    Returns
    -------
    tdz_numba.zipfmt.grow.Repaired
        ``action`` (``"ok"`` or ``"truncated"``), ``old_size`` and ``size``.

    Raises
    ------
    BadArchiveError
        Not a zip, or damaged in a way an append cannot leave.

    Examples
    --------
    >>> import tempfile, pathlib, torch, tdz_numba
    >>> with tempfile.TemporaryDirectory() as d:
    ...     p = tdz_numba.save({"w": torch.ones(2)}, pathlib.Path(d) / "x.tdz")
    ...     print(tdz_numba.repair(p).action)
    ok
    """
    with user_errors(path, action="repair"):
        target = as_local_path(path).resolve()
        with _locked(target) as fd:
            return _grow.repair_file(fd, str(path), durable=durable)
