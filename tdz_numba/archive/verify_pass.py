"""The parallel part of :func:`tdz_numba.verify` on a local ``.tdz``: every local header
checked and every STORED entry hashed by a :class:`CrcPass` that helper threads start
at once, while the calling thread walks the levels (:func:`walk_levels`) and then
joins the pass.

The pass and the walk are the checks of the sequential path, done in another order:
a local header that fails, a leaf whose entry does not match its ``meta.json``, or a
level that is not a plain TensorDict level sends :func:`tdz_numba.archive.verify.verify`
back to the sequential checks of that part, so every error is the one they raise.

Examples
--------
>>> import tempfile, pathlib, torch, tdz_numba
>>> from tdz_numba.archive.opening import open_archive
>>> from tdz_numba.archive.verify_pass import CrcPass, walk_levels
>>> with tempfile.TemporaryDirectory() as d:
...     p = tdz_numba.save({"a": torch.zeros(8), "b": {"c": torch.ones(2)}}, pathlib.Path(d) / "x.tdz")
...     with open_archive(p) as ar:
...         crc = CrcPass(ar.source.index, helpers=1)
...         walk = walk_levels(ar.source)
...         crc.join()
...         print(crc.failed_rows(), walk.levels, walk.leaves, walk.failed_levels(ar.source.index))
[] 2 2 []
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field
from typing import Any

import numpy as np
from zlib_ng import zlib_ng

from ..errors import TdzError
from ..tdz.plainlevel import PlainLevel, plain_level, plain_level_of
from ..zipfmt import records
from ..zipfmt.records import Col

__all__ = [
    "CrcPass",
    "Walk",
    "walk_levels",
    "check_level",
    "helper_threads",
    "ITEM_BYTES",
    "MIN_HELPER_BYTES",
    "SMALL_FIRST",
    "START_WAIT",
]

#: Bytes hashed per work item of the pass (about 0.2 ms of one core): small enough that
#: the threads finish together, large enough that taking items costs nothing.
ITEM_BYTES = 2 << 20
#: Seconds :class:`CrcPass` waits at most for its helper threads to enter the kernel.
START_WAIT = 0.002
#: Entries below this size are checked first (``meta.json`` documents among them).
SMALL_FIRST = 64 << 10
#: Below this many stored bytes the calling thread hashes alone (a thread start costs more).
MIN_HELPER_BYTES = 8 << 20


def helper_threads(stored_bytes: int) -> int:
    """Threads to start beside the calling one: Numba's thread count less one (so the
    pass uses the cores a parallel kernel would), none for a small archive."""
    if stored_bytes < MIN_HELPER_BYTES:
        return 0
    import numba

    return max(0, int(numba.get_num_threads()) - 1)


class CrcPass:
    """Local headers of every entry checked and every STORED entry hashed, by ``helpers``
    threads from the start and by the calling thread in :meth:`join`.

    After :meth:`join`: :meth:`failed_rows` lists the entries whose local header failed
    (their payload offsets are unknown: :meth:`ArchiveIndex.check_all
    <tdz_numba.zipfmt.index.ArchiveIndex.check_all>` names the first); otherwise the index's
    payload offsets are all filled in and :meth:`crcs` gives the CRC-32 of STORED rows.
    """

    def __init__(self, index: Any, helpers: int | None = None) -> None:
        from ..jit.policy import CRC_CHUNK
        from ..zipfmt.kernels.verify import crc_worker, plan_pieces

        table = index.table
        n = len(table)
        self.index = index
        self.chunk = CRC_CHUNK
        stored = table["method"] == records.STORED
        crc_len = np.where(stored, table["csize"], 0).astype(np.int64)
        # small entries first (in file order), then the others: the meta.json headers the
        # walk reads are then checked (their payload offsets filled in) within the first item
        self.order = np.argsort(crc_len >= SMALL_FIRST, kind="stable")
        self.crc_len = crc_len[self.order]
        self.first, owner, items = plan_pieces(self.crc_len, CRC_CHUNK, ITEM_BYTES)
        self.crcs_raw = np.zeros(owner.size, np.uint32)
        self.failed = np.zeros(n, np.int64)
        self._counter = np.zeros(1, np.int64)
        self._entered = np.zeros(1, np.int64)
        self._items = items
        self._args: tuple[Any, ...] = (
            index.buffer,
            index._cols,  # the kernel fills in the payload offsets, as check_all would
            int(index.end.cd_offset),
            self.order,
            self.crc_len,
            self.first,
            owner,
            items,
            CRC_CHUNK,
            self._counter,
            self._entered,
            self.crcs_raw,
            self.failed,
        )
        self._kernel = crc_worker
        if helpers is None:
            helpers = helper_threads(int(self.crc_len.sum()))
        self._threads = [
            threading.Thread(target=crc_worker, args=self._args, name="tdz-verify-crc", daemon=True)
            for _ in range(min(helpers, max(0, items.size - 2)))
        ]
        #: Threads started beside the calling one.
        self.helpers = len(self._threads)
        for t in self._threads:
            t.start()
        self._joined = False
        # a started thread may still need the GIL to reach the kernel (which releases it): wait
        # until the helpers are inside, else they would wait for this thread's Python work
        # (up to the 5 ms switch interval). Bounded: the pass is correct either way.
        deadline = time.perf_counter() + START_WAIT
        try:
            while self._entered[0] < len(self._threads) and time.perf_counter() < deadline:
                time.sleep(2e-5)
        except BaseException:  # an interrupt: stop the helpers before leaving
            self.cancel()
            raise

    def join(self) -> None:
        """The calling thread takes the items left, then waits for the helpers."""
        if self._joined:
            return
        try:
            self._kernel(*self._args)
        finally:
            for t in self._threads:
                t.join()
            self._joined = True
            self._args = ()
            self.index.columns_filled()

    def cancel(self) -> None:
        """Stops the pass early (no item is taken any more) and waits for the helpers."""
        self._counter[0] = self._items.size  # the kernels' fetch-adds now get values past the end
        for t in self._threads:
            t.join()
        self._joined = True
        self._args = ()
        self.index.columns_filled()

    def failed_rows(self) -> list[int]:
        """Entries whose local header failed its check (after :meth:`join`)."""
        return sorted(self.order[np.nonzero(self.failed)[0]].tolist())

    def crcs(self, rows: np.ndarray) -> np.ndarray:
        """CRC-32 of the STORED entries ``rows`` (after :meth:`join`, with no failed row)."""
        from ..zipfmt.kernels.verify import fold_pieces

        out = np.empty(self.order.size, np.uint32)
        out[self.order] = fold_pieces(self.crcs_raw, self.first, self.crc_len, self.chunk)
        return out[rows]


@dataclass
class Walk:
    """What :func:`walk_levels` found: counts, the leaf rows whose entries are checked
    after the pass (:meth:`failed_levels`), and the first error of a level it checked
    the sequential way (raised after the levels before it are cleared)."""

    levels: int = 0
    leaves: int = 0
    prefixes: list[str] = field(default_factory=list)  # every level reached, in order
    rows: list[int] = field(default_factory=list)  # leaf entries checked in bulk
    #: per level with rows: (bytes each row's shape and dtype need, item sizes, position in
    #: prefixes), arrays shared by the levels of one meta.json document
    parts: list[tuple[np.ndarray, np.ndarray, int]] = field(default_factory=list)
    error: BaseException | None = None

    def failed_levels(self, index: Any) -> list[str]:
        """Levels (in walk order) with a leaf whose entry is compressed, of another size
        than its shape says, or not aligned for its dtype: the sequential check of the
        level decides (it accepts compressed and unaligned entries, and names a bad size).
        Needs every payload offset (after a :class:`CrcPass` without failed rows)."""
        if not self.rows:
            return []
        cols = index._cols
        rows = np.array(self.rows, np.int64)
        need = np.concatenate([p[0] for p in self.parts])
        itemsize = np.concatenate([p[1] for p in self.parts])
        ok = (cols[rows, Col.METHOD] == records.STORED) & (cols[rows, Col.SIZE] == need)
        ok &= cols[rows, Col.PAYLOAD_OFFSET] % itemsize == 0
        if ok.all():
            return []
        level_of = np.repeat([p[2] for p in self.parts], [p[0].size for p in self.parts])
        bad = np.unique(level_of[~ok])
        return [self.prefixes[i] for i in bad.tolist()]


def walk_levels(source: Any) -> Walk:
    """Every level reached from the root, depth first as the sequential walk goes: a plain
    TensorDict level is read here (its ``meta.json`` CRC-checked, each distinct document
    parsed once (:func:`~tdz_numba.tdz.plainlevel.plain_level`), each leaf's entry looked up, sizes and alignment
    checked later in bulk); any other level, and any level whose fast read raises, is
    checked the sequential way (:func:`check_level`). Stops at the first error (kept in
    :attr:`Walk.error`)."""
    walk = Walk()
    index = source.index
    parsed = source.parsed_levels()
    templates: dict[bytes, PlainLevel | None] = {}  # levels often repeat one meta.json (layers, groups)
    stack = [""]
    while stack:
        prefix = stack.pop()
        walk.levels += 1
        walk.prefixes.append(prefix)
        try:
            subs = _fast_level(source, index, prefix, parsed, templates, walk)
        except Exception:  # noqa: BLE001 - the sequential check below names what is wrong
            subs = None
        if subs is None:
            try:
                subs = check_level(source, prefix, walk)
            except Exception as exc:  # noqa: BLE001 - raised by verify after the CRCs
                walk.error = exc
                break
        stack.extend(subs)  # popped last first, as the sequential walk does
    return walk


def check_level(source: Any, prefix: str, walk: Walk | None = None) -> list[str]:
    """The sequential check of one level (its ``meta.json`` described, every leaf's entry
    checked by :meth:`TdzSource.check_leaf <tdz_numba.tdz.source.TdzSource.check_leaf>`):
    the prefixes of its sub-levels."""
    subs = []
    for spec in source.level(prefix).children.values():
        if spec.kind == "leaf":
            if walk is not None:
                walk.leaves += 1
            source.check_leaf(spec.leaf)
        elif spec.kind == "level":
            subs.append(spec.path)
    return subs


def _fast_level(
    source: Any,
    index: Any,
    prefix: str,
    parsed: set[str],
    templates: dict[bytes, PlainLevel | None],
    walk: Walk,
) -> list[str] | None:
    """The level at ``prefix`` when it is a plain TensorDict level: its sub-level
    prefixes (its leaves' rows added to ``walk``), or None."""
    by_name = index._by_name
    if prefix in parsed:
        tpl = plain_level(source.level(prefix).meta)
    else:
        row = by_name.get(prefix + "meta.json")
        if row is None:
            return None
        cols = index._cols
        if cols[row, Col.METHOD] != records.STORED:
            return None
        offset = int(cols[row, Col.PAYLOAD_OFFSET])
        if offset < 0:
            try:
                offset = index.payload_offset(row)
            except TdzError:
                return None
        raw = index.buffer[offset : offset + int(cols[row, Col.SIZE])]
        if (zlib_ng.crc32(raw) if raw.size else 0) != cols[row, Col.CRC]:
            return None  # the sequential read names the CRC error
        try:
            tpl = plain_level_of(templates, raw.tobytes(), "")
        except TdzError:  # the sequential read names it
            tpl = None
    if tpl is None:
        return None
    subs = [prefix + sub for sub in tpl.subs]
    for sub in subs:
        if sub + "meta.json" not in by_name:
            return None
    rows = [by_name.get(prefix + name) for name in tpl.names]
    need, itemsize = tpl.arrays
    if None in rows:  # tensordict writes no file for an empty leaf
        if any(r is None and n for r, n in zip(rows, tpl.nbytes)):
            return None
        keep = [k for k, r in enumerate(rows) if r is not None]
        rows = [rows[k] for k in keep]
        need, itemsize = need[keep], itemsize[keep]
    walk.leaves += len(tpl.names)
    if rows:
        walk.rows += rows
        walk.parts.append((need, itemsize, len(walk.prefixes) - 1))
    return subs
