"""Checking and repairing archives: CRC-32 verification, checksum refresh, extraction.

Examples
--------
>>> import tempfile, pathlib, torch, tdz_numba
>>> with tempfile.TemporaryDirectory() as d:
...     p = tdz_numba.save({"a": torch.zeros(8)}, pathlib.Path(d) / "x.tdz")
...     print(tdz_numba.verify(p).entries)
2
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from ..errors import ChecksumError, TdzError
from ..files.progress import human_bytes
from ..files.progress import progress as _progress
from ..tdz.bounds import parse_meta
from ..zipfmt import records
from ..zipfmt.checksums import stored_crcs
from ..zipfmt.index import ArchiveIndex

__all__ = ["VerifyReport", "verify", "verify_compressed", "check_leaves", "is_archive"]


def _count(n: int, word: str, plural: str | None = None) -> str:
    """``"1 leaf"``, ``"2 leaves"``."""
    return f"{n} {word if n == 1 else (plural or word + 's')}"


@dataclass(frozen=True)
class VerifyReport:
    """What :func:`verify` checked.

    ``payload_bytes``: the leaves' bytes (uncompressed); ``checksummed_bytes``: those whose
    checksum was computed and compared (every payload of a ``.tdz``; the zip members of a
    ``.pt`` or ``.npz``; none of a safetensors or GGUF file, whose formats have no checksum);
    ``decoded``: compressed leaves decoded (their codec's own checks ran).
    """

    path: Path
    entries: int
    levels: int
    leaves: int
    payload_bytes: int
    format: str = "tdz"
    checksummed_bytes: int | None = None  # None: every payload byte (a .tdz)
    decoded: int = 0
    digests: int = 0  # leaves whose XXH3-128 digest was recomputed (``deep=True``)

    @property
    def unchecked_bytes(self) -> int:
        """Payload bytes no checksum covers (0 for a ``.tdz``): only their place and size were checked."""
        if self.checksummed_bytes is None:
            return 0
        return max(0, self.payload_bytes - self.checksummed_bytes)

    def describe(self, size: Any = None) -> str:
        """The report as text: a first line, then what was checked and what was not (one line each);
        ``size`` formats byte counts (default: human sizes, "12.5 MiB")."""
        size = size or human_bytes
        counts = f"{_count(self.levels, 'level')}, {_count(self.leaves, 'leaf', 'leaves')}"
        if self.checksummed_bytes is None:
            deep = (
                f", the XXH3-128 digest of {_count(self.digests, 'leaf', 'leaves')}" if self.digests else ""
            )
            return (
                f"{self.path}: OK (tdz): {_count(self.entries, 'entry', 'entries')}, {counts}\n"
                f"  checked: the CRC-32 of every entry ({size(self.payload_bytes)} of payload), "
                f"the structure{deep}"
            )
        done = ["the bounds and size of every leaf"]
        if self.checksummed_bytes:
            done.append(f"the CRC-32 of {size(self.checksummed_bytes)}")
        if self.decoded:
            done.append(f"{_count(self.decoded, 'compressed leaf', 'compressed leaves')} decoded")
        lines = [f"{self.path}: OK ({self.format}): {counts}", f"  checked: {', '.join(done)}"]
        if self.unchecked_bytes:
            lines.append(
                f"  not checked: the values of {size(self.unchecked_bytes)} of payload "
                f"({self.format} files have no checksums)"
            )
        return "\n".join(lines)

    def __str__(self) -> str:
        return self.describe()


def verify(path: str | os.PathLike, *, progress: bool | None = None, deep: bool = False) -> VerifyReport:
    """Checks every entry's CRC-32 and the archive's structure; see :func:`tdz_numba.verify`.
    ``deep``: then every stored XXH3-128 digest is recomputed
    (:func:`tdz_numba.archive.verify_deep.check_digests`).

    Files of other formats are checked as far as the format can prove: every
    leaf's bytes inside its file, compressed members decoded (their CRCs
    checked), and the CRC-32 of every member when the container is a zip
    (torch ``.pt``, ``.npz``).
    """
    from .opening import open_archive

    ar = open_archive(path)
    try:
        if ar.format != "tdz":
            return _verify_other(ar, path, progress)
        if _parallel_ok(ar.source):
            report = _verify_parallel(ar, path, progress)
        else:
            report = _verify_sequential(ar, path, progress)
        if deep:
            from dataclasses import replace

            from .verify_deep import check_digests

            with _progress(report.payload_bytes, "verify digests", enabled=progress) as bar:
                source: Any = ar.source  # (a TdzSource: format "tdz")
                report = replace(report, digests=check_digests(source.index, bar))
        return report
    finally:
        ar.close()


def _parallel_ok(source) -> bool:
    """Whether the checks run as one parallel pass beside the structure walk: a local,
    read-only archive, with the Numba kernels (their pure-Python twins take the
    sequential path)."""
    from ..jit.policy import use_kernels

    index = source.index
    return source.mode == "r" and getattr(index, "fetch", None) is None and use_kernels(len(index.names))


def _verify_parallel(ar, path: str | os.PathLike, progress: bool | None) -> VerifyReport:
    """verify of a local ``.tdz``: the local headers and STORED CRCs of every entry in one
    pass on helper threads (:class:`~tdz_numba.archive.verify_pass.CrcPass`) while this thread
    walks the levels, then this thread joins the pass. The errors, and their order, are
    those of :func:`_verify_sequential`: a bad local header first, then a CRC mismatch,
    then a structure error, then the compressed entries."""
    from .verify_pass import CrcPass, check_level, walk_levels

    source = ar.source
    index = source.index
    table = index.table
    methods = table["method"]
    stored = np.nonzero(methods == records.STORED)[0]
    with _progress(int(table["csize"].sum()), "verify", enabled=progress) as bar:
        crc = CrcPass(index)
        try:
            if not crc.helpers:  # alone, the pass first: the walk then finds every header read
                crc.join()
            walk = walk_levels(source)
        except BaseException:
            crc.cancel()
            raise
        crc.join()
        if crc.failed_rows():
            index.check_all()  # names the first bad local header, as the sequential path does
            return _verify_sequential(ar, path, progress)  # (not reached: the same check failed)
        walk_error = walk.error
        for prefix in walk.failed_levels(index):  # levels before the error, in walk order
            try:
                check_level(source, prefix)
            except Exception as exc:  # reported after the CRCs, which take precedence
                walk_error = exc
                break
        crc_error = _after_stored_crcs(index, stored, crc.crcs(stored), walk_error, bar)
    if crc_error is not None:
        raise crc_error from walk_error
    if walk_error is not None:
        raise walk_error
    return VerifyReport(Path(path), len(index.names), walk.levels, walk.leaves, int(table["size"].sum()))


def _verify_sequential(ar, path: str | os.PathLike, progress: bool | None) -> VerifyReport:
    """verify of a ``.tdz`` one check after the other: every local header, the structure
    walk, the STORED CRCs (a parallel kernel), the compressed entries."""
    index = ar.source.index  # format "tdz": a TdzSource
    index.check_all()  # every central record and local header
    table = index.table
    methods = table["method"]
    stored = np.nonzero(methods == records.STORED)[0]
    with _progress(int(table["csize"].sum()), "verify", enabled=progress) as bar:
        # the structure first (one pass per level), then the STORED CRCs on every core
        walk_error: Exception | None = None
        try:
            levels, leaves = _walk_structure(ar)
        except Exception as exc:  # reported after the CRCs, which take precedence
            walk_error = exc
        crc_error = _after_stored_crcs(index, stored, stored_crcs(index, stored), walk_error, bar)
    if crc_error is not None:
        raise crc_error from walk_error
    if walk_error is not None:
        raise walk_error
    return VerifyReport(Path(path), len(index.names), levels, leaves, int(table["size"].sum()))


def _after_stored_crcs(
    index: ArchiveIndex, stored: np.ndarray, crcs: np.ndarray, walk_error: BaseException | None, bar: Any
) -> ChecksumError | None:
    """What verify decides once the STORED CRCs are known: a structure error is raised now
    when every CRC holds (before inflating anything: a leaf may claim another size); the
    compressed entries before the first bad CRC are inflated and checked; returns the
    ChecksumError of the first bad STORED entry (raised by the caller), or None."""
    table = index.table
    bar.update(int(table["csize"][stored].sum()))
    bad = np.nonzero(crcs != table["crc"][stored])[0]
    first_bad = int(stored[bad[0]]) if bad.size else len(index.names)
    if walk_error is not None and not bad.size:
        raise walk_error
    methods = table["method"]
    compressed = [i for i in np.nonzero(methods != records.STORED)[0].tolist() if i < first_bad]
    verify_compressed(index, compressed, bar)
    return _crc_error(index, first_bad, int(crcs[bad[0]])) if bad.size else None


def _crc_error(index: ArchiveIndex, row: int, found: int) -> ChecksumError:
    """The ChecksumError of entry ``row``. The file alone cannot tell damage from in-place
    writes whose CRCs were not re-stamped, so a stored payload's message says both: damaged,
    unless it was written in place (then, and only then, ``tdz refresh``)."""
    table = index.table
    name = index.names[row]
    expected = int(table["crc"][row])
    hint = ": the file is damaged"
    if name.endswith(".memmap") and int(table["method"][row]) == records.STORED:
        hint = (
            ": the file is damaged, unless this leaf was written in place without re-stamping its CRC "
            "(through a mode='r+' tensor used after close(), or by another program); only in that "
            "case run `tdz refresh FILE` (re-stamping a damaged file would hide the damage)"
        )
    return ChecksumError(
        f"{index.path}: entry {name!r}: CRC-32 mismatch: recorded {expected:#010x}, "
        f"computed {found:#010x}{hint}",
        path=str(index.path),
        entry=name,
        offset=int(table["payload_offset"][row]),
        expected=expected,
        found=found,
    )


def _verify_other(ar, path: str | os.PathLike, progress: bool | None) -> VerifyReport:
    """verify of a non-``.tdz`` file: bounds of every leaf, codecs, zip CRCs."""
    files = ar.source.files
    entries = 0
    zipped: set[int] = set()  # files that are zip containers: every member CRC-checked
    with _progress(None, "verify", enabled=progress) as bar:
        for n, f in enumerate(files):
            with open(f.path, "rb") as fh:
                magic = fh.read(4)
            if magic == b"PK\x03\x04":  # a zip container (.pt, .npz): its members' CRC-32s
                index = ArchiveIndex(f.path, check_local=True)
                try:
                    table = index.table
                    stored = np.nonzero(table["method"] == records.STORED)[0]
                    crcs = stored_crcs(index, stored)
                    bar.update(int(table["csize"][stored].sum()))
                    bad = np.nonzero(crcs != table["crc"][stored])[0]
                    if bad.size:
                        raise _crc_error(index, int(stored[bad[0]]), int(crcs[bad[0]]))
                    verify_compressed(index, np.nonzero(table["method"] != records.STORED)[0].tolist(), bar)
                    entries += len(index.names)
                    zipped.add(n)
                finally:
                    index.close()
        levels, leaves, payload, decoded, crc_bytes = check_leaves(ar, zipped)
    return VerifyReport(
        Path(path), entries or leaves, levels, leaves, payload, ar.format, min(crc_bytes, payload), decoded
    )


def check_leaves(ar: Any, zipped: set[int]) -> tuple[int, int, int, int, int]:
    """Every leaf of a foreign file's levels checked: its bounds in its file, compressed leaves
    and loaders decoded. ``zipped``: the files whose members' CRC-32s were compared. Returns
    ``(levels, leaves, payload bytes, decoded leaves, bytes under a CRC-32)``; shared by the
    local and the remote verify."""
    from ..tdz.sources import TensorSpec, check_extent, tensor_from_spec

    source = ar.source
    files = source.files
    levels = leaves = payload = decoded = crc_bytes = 0
    stack = [ar]
    while stack:
        node = stack.pop()
        levels += 1
        for spec in node.level_info().children.values():
            if spec.kind == "level":
                stack.append(node.sublevel(spec))
                continue
            if spec.kind != "leaf":
                continue
            leaves += 1
            leaf = spec.leaf
            if not isinstance(leaf, TensorSpec):
                node.leaf(spec)
                continue
            if leaf.loader is None and 0 <= leaf.file < len(files):
                check_extent(leaf, files[leaf.file].size, str(files[leaf.file].path))
            if leaf.codec != "stored" or leaf.loader is not None:
                tensor_from_spec(leaf, files, where=str(source.path))
                decoded += leaf.codec != "stored"
            nbytes = leaf.size if leaf.codec != "stored" else leaf.numel * leaf.dtype.itemsize
            payload += nbytes
            crc_bytes += nbytes if leaf.file in zipped else 0
    return levels, leaves, payload, decoded, crc_bytes


def _walk_structure(ar) -> tuple[int, int]:
    """Every level's meta.json parses, every leaf matches its entry: ``(levels, leaves)``."""
    source = ar.source
    quick = getattr(source, "quick_level", None)  # a TensorDict level of plain stored leaves, checked
    levels = leaves = 0
    stack = [""]  # level prefixes: the source's levels, no Archive view per level
    while stack:
        prefix = stack.pop()
        levels += 1
        got = quick(prefix, tensors=False) if quick is not None else None
        if got is not None:  # every leaf found, stored, aligned and of its shape's size
            level, subs = got
            leaves += len(level) - len(subs)
            stack.extend(sub for _, sub in subs)
            continue
        for spec in source.level(prefix).children.values():
            if spec.kind == "leaf":
                leaves += 1
                source.check_leaf(spec.leaf)
            elif spec.kind == "level":
                stack.append(spec.path)
    return levels, leaves


def verify_compressed(index: ArchiveIndex, rows: list[int], bar) -> None:
    """Checks the CRC-32 of compressed entries in bounded memory: small deflate
    entries inflated in parallel batches of <= 2 x ``codecs.STREAM_CHUNK``
    bytes into one reused buffer, the others streamed through one
    ``STREAM_CHUNK`` buffer (``stream.stream_member``)."""
    from ..zipfmt import compression as codecs
    from ..zipfmt import members
    from ..zipfmt.stream import stream_member

    limit = 2 * codecs.STREAM_CHUNK
    scratch: list[np.ndarray] = []
    batch: list = []
    held = 0

    def flush() -> None:
        if not scratch:  # one buffer for every batch: its pages are faulted in once
            small = sum(
                int(index.entry(index.names[i]).size)
                for i in rows
                if index.entry(index.names[i]).size <= codecs.STREAM_CHUNK
            )
            scratch.append(np.empty(max(1, min(limit, small)), np.uint8))
        jobs = [
            (
                f"{index.path}: entry {e.name!r}",
                index.raw(e),
                e.size,
                e.crc,
                members.parse_segment_table(index.local_extra(e), f"{index.path}: entry {e.name!r}"),
            )
            for e in batch
        ]
        members.inflate_many(jobs, None, into=scratch[0])  # in parallel; checks the CRCs
        bar.update(sum(b.compressed_size for b in batch))

    for i in rows:
        e = index.entry(index.names[i])
        if e.method == records.DEFLATED and e.size <= codecs.STREAM_CHUNK:
            if batch and held + e.size > limit:
                flush()
                batch, held = [], 0
            batch.append(e)
            held += e.size
            continue
        where = f"{index.path}: entry {e.name!r}"
        table = (
            members.parse_segment_table(index.local_extra(e), where) if e.method == records.DEFLATED else None
        )
        stream_member(index.raw(e), e.method, e.size, e.crc, table, None, where)
        bar.update(e.compressed_size)
    if batch:
        flush()


def is_archive(path: str | os.PathLike, *, thorough: bool = True) -> bool:
    """Whether ``path`` is a zip file with a top-level ``meta.json``; see
    :func:`tdz_numba.is_archive`. ``thorough=False`` checks the central
    directory only (local headers are then checked when entries are read)."""
    p = Path(path)
    if not p.is_file():
        return False
    try:
        index = ArchiveIndex(p, check_local=thorough)
    except (TdzError, OSError):
        return False
    try:
        if "meta.json" not in index:
            return False
        from ..tdz.tree import describe_level

        meta = parse_meta(
            index.read_bytes("meta.json"), str(p)
        )  # deep JSON: BadArchiveError, not RecursionError
        # the root level as open reads it: is_archive is True exactly when open succeeds
        describe_level(
            meta,
            "",
            lambda: index.listing(""),
            lambda sub: sub + "meta.json" in index or index.is_dir(sub),
            str(p),
        )
        return True
    except (TdzError, ValueError, RecursionError):
        return False
    finally:
        index.close()
