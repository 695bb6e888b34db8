"""Writing an archive's local headers and payloads: units of work, a writer and a hasher.

:func:`write_payloads` is step 4 of :func:`tdz_numba.zipfmt.writer.write_entries`: the
entries, in file order, are cut into units of work (:func:`plan_units`): groups of
small entries (~1 MiB, at most 500) and 8 MiB spans of large ones, written straight
from the source buffers (a group with one ``pwritev`` of its headers and payloads, a
span in 2 MiB pieces cut at file offsets), with the CRC-32 of every payload by zlib-ng
(SIMD, GIL released). By default (:data:`HASH_AHEAD`) the calling thread writes while
one more thread hashes the same units in file order, a few MiB ahead
(:func:`_write_behind_hasher`): a group is written once its CRCs are in its local
headers. With ``num_threads=1`` the calling thread does both, each piece hashed right
after its write; with 2 to 4 that many threads share the units (:func:`write_threads`).
The local headers are all built at once beforehand (one
:func:`tdz_numba.zipfmt.packers.local_headers` call) and each CRC is patched in; the headers
of split entries are written last, with the CRC combined from their spans. The bytes
on disk are those of one sequential pass, whichever threads wrote them.

Examples
--------
>>> from tdz_numba.zipfmt.payload import SPAN, plan_units
>>> plan_units([False, True, False], [10, SPAN + 1, 5])
[(0, 1, -1), (1, 0, 8388608), (1, 8388608, 1), (2, 3, -1)]
"""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import Any

import numpy as np

from ..errors import InternalError
from ..files import tempfiles as _tempfiles
from . import packers, records
from .entry import Prepared

__all__ = [
    "UNIT",
    "PIECE",
    "SPAN",
    "UNIT_ROWS",
    "WRITEBACK",
    "plan_units",
    "write_payloads",
    "write_threads",
    "write_segments",
    "IOV_MAX",
]

#: Payload bytes per group of small entries (a unit of work of the writing threads),
#: hashed and then written in one ``pwritev`` by the same thread.
UNIT = 1 << 20
#: Entries larger than this are written in pieces cut at file offsets that are
#: multiples of it (hashed by the hashing thread a few pieces ahead, or, with
#: ``num_threads=1``, right after the piece's write). 2 MiB: the page cache then holds the payloads in 2 MiB
#: folios, which a read maps with one PMD each; 256 KiB pieces gave 256 KiB folios, and a
#: read of 256 MiB took ~1,090 page faults instead of ~290 (touching every page of a flat
#: archive just saved: 19.8 ms -> 10.2 ms, safetensors' file 8.6 ms; issue 27) for the same
#: save CPU time (227 vs 234 ms, medians of 9, alternating).
PIECE = 1 << 21
#: A large entry is shared out in spans of this many bytes (units of work), each
#: written piece by piece in one loop with a running CRC (per-piece Python cost
#: ~9 us with one unit per piece: ~9 ms per 256 MiB).
SPAN = 8 << 20
#: Entries per group: a group's (header, payload) pairs go in one ``pwritev``.
UNIT_ROWS = 500
#: Bytes written between two starts of the device writes of a durable save (2 and
#: 32 MiB measured within noise of 8 MiB, and a helper thread starting them gained
#: nothing: the device, ~1.4 GB/s here, sets the pace).
WRITEBACK = 8 << 20
#: ``write_threads(None)``: the calling thread writes every unit while one more thread computes
#: the CRC-32s (and digests) of the units in file order (:func:`write_payloads`).
HASH_AHEAD = 0
#: Bytes the hashing thread may run ahead of the writer: its read of the source leaves the
#: next pieces in the shared cache for the writer's copy.
HASH_AHEAD_BYTES = 4 << 20
#: Payload bytes still to hash below which a save hashes on the writing thread (a thread's
#: start and hand-over cost ~0.1 ms, the CRC of 4 MiB ~0.5 ms).
HASHER_MIN_BYTES = 4 << 20


def _crc_functions() -> tuple[Any, Any]:
    """``(crc32, crc32_combine)``: zlib-ng's (SIMD; the GIL released on large buffers),
    the stdlib's CRC-32 with the Numba combine where zlib-ng lacks them."""
    try:
        from zlib_ng import zlib_ng

        crc32 = zlib_ng.crc32
        combine = getattr(zlib_ng, "crc32_combine", None)
    except ImportError:  # pragma: no cover - zlib-ng is a dependency
        import zlib

        crc32, combine = zlib.crc32, None
    if combine is None:  # pragma: no cover - zlib-ng < 0.5

        def combine(a: int, b: int, length: int) -> int:
            from .kernels.crc import crc32_combine

            return int(crc32_combine(a, b, length))

    return crc32, combine


def _cuts(start: int, length: int) -> list[tuple[int, int]]:
    """``(pos, cut)`` file offsets of the pieces of ``length`` bytes at file offset ``start``:
    cut at multiples of :data:`PIECE`.

    >>> _cuts(PIECE - 1, PIECE + 2)
    [(2097151, 2097152), (2097152, 4194304), (4194304, 4194305)]
    """
    stop = start + length
    out = []
    pos = start
    while pos < stop:
        cut = min(stop, (pos // PIECE + 1) * PIECE)
        out.append((pos, cut))
        pos = cut
    return out


def plan_units(
    split: list[bool], stored: list[int], offsets: list[int] | None = None, whole: bool = False
) -> list[tuple[int, int, int]]:
    """Work units in file order: ``(start, stop, -1)``, a group of whole entries
    (at most :data:`UNIT` bytes or :data:`UNIT_ROWS` entries), or ``(i, offset,
    length)``, a span (:data:`SPAN` bytes) of entry ``i``, that is ``split``.

    With the entries' payload ``offsets`` in the file, spans are cut at file offsets that
    are multiples of :data:`SPAN` (the first span of an entry ends at the next one), so
    that no :data:`PIECE` of the file is written in two parts (two parts of a 2 MiB piece
    leave the page cache with smaller folios: more page faults for every later read).
    ``whole``: a split entry is one unit (its pieces hashed in order by one thread: digests).

    >>> plan_units([True], [SPAN + 1], whole=True)
    [(0, 0, 8388609)]
    """
    units: list[tuple[int, int, int]] = []
    start = acc = 0
    for i, (big, nbytes) in enumerate(zip(split, stored)):
        if big:
            if start < i:
                units.append((start, i, -1))
            if whole:
                units.append((i, 0, nbytes))
                start, acc = i + 1, 0
                continue
            first = min(nbytes, SPAN - offsets[i] % SPAN) if offsets is not None else 0
            if first:
                units.append((i, 0, first))
            units.extend((i, off, min(SPAN, nbytes - off)) for off in range(first, nbytes, SPAN))
            start, acc = i + 1, 0
            continue
        acc += nbytes
        if acc >= UNIT or i + 1 - start >= UNIT_ROWS:
            units.append((start, i + 1, -1))
            start, acc = i + 1, 0
    if start < len(stored):
        units.append((start, len(stored), -1))
    return units


def write_payloads(
    fd: int,
    prep: Prepared,
    fields: dict[str, Any],
    has_data: np.ndarray,
    threads: int,
    bar: Any,
    writeback: bool = False,
) -> None:
    """Writes every local header and payload: units of work (:func:`plan_units`) in file
    order. ``threads`` (:func:`write_threads`): :data:`HASH_AHEAD`, this thread writes
    them while one more hashes them ahead of it (:func:`_write_behind_hasher`; this
    thread alone below :data:`HASHER_MIN_BYTES` or on one core); 1, this thread alone;
    2 to 4, that many take units in turn, each hashing and writing its own. The CRC-32s
    (zlib-ng, GIL released) are patched into the local headers (all built at once
    beforehand); a group of small entries is written with one ``pwritev`` once its CRCs
    are known, the pieces of large entries as they come, their headers last, once the
    pieces' CRCs are combined. The bytes on disk are those of one sequential pass. With
    ``writeback`` (durable saves) the device writes start every :data:`WRITEBACK` bytes,
    so that the final ``fsync`` waits for the last ones only. Digests (``prep.digests``,
    those still :data:`~tdz_numba.zipfmt.digest.PENDING`) are computed where the CRCs are
    (a large entry is then one unit, hashed in order: XXH3 has no combine)."""
    import threading

    crc32, combine = _crc_functions()
    p, n, sources, crc = prep.plan, prep.n, prep.sources, prep.crc
    stored = prep.stored_size
    pending = ~prep.hashed & has_data & (stored > 0)
    pend, split = pending.tolist(), (pending & (stored > PIECE)).tolist()
    hoff, poff = p.header_offset, p.payload_offset
    poff_at = poff.tolist()
    heads = packers.local_headers(p.names, more=prep.more, **fields)  # CRCs patched below
    head_len = np.fromiter(map(len, heads), np.int64, n)
    bad = np.flatnonzero(hoff + head_len != poff)
    if bad.size:
        i = int(bad[0])
        raise InternalError(
            f"{p.names[i]!r}: local header of {len(heads[i])} bytes differs from "
            f"the layout plan ({int(poff[i]) - int(hoff[i])})"
        )
    hpos = np.zeros(n + 1, np.int64)
    np.cumsum(head_len, out=hpos[1:])
    at = hpos.tolist()
    hbuf = bytearray().join(heads)
    del heads
    hview = memoryview(hbuf)
    crc_at = records.LOCAL_DT.fields["crc"][1]  # type: ignore[index]
    end = poff + np.where(has_data, stored, 0)
    contiguous = np.ones(n, np.bool_)  # entry i's bytes end where entry i + 1's header starts
    contiguous[:-1] = hoff[1:] == end[:-1]
    digests = prep.digests
    want = [False] * n if digests is None else [d is not None and not d for d in digests]
    if any(want):
        from .digest import hash_function, hasher

        hash_now, new_hasher = hash_function(), hasher
    units = plan_units(split, stored.tolist(), poff_at, whole=any(want))
    piece_crc: list[int] = [0] * len(units)
    lock = threading.Lock()
    order = iter(range(len(units)))
    errors: list[BaseException] = []
    unflushed = [0]

    def set_crc(i: int, value: int) -> None:
        crc[i] = value
        hbuf[at[i] + crc_at : at[i] + crc_at + 4] = value.to_bytes(4, "little")

    def hash_group(a: int, b: int) -> None:
        for i in range(a, b):
            if pend[i]:
                set_crc(i, crc32(sources[i]))
                if want[i]:
                    digests[i] = hash_now(sources[i])  # type: ignore[index]

    def write_group(a: int, b: int) -> int:
        if not contiguous[a : b - 1].all():  # gaps (unwritten zeros, room for an alignment)
            segments: list[tuple[int, object]] = []
            for i in range(a, b):
                segments.append((int(hoff[i]), hview[at[i] : at[i + 1]]))
                pos = int(poff[i])
                for part in sources[i] if isinstance(sources[i], list) else [sources[i]]:
                    if part is not None and part.size:
                        segments.append((pos, part))
                        pos += part.size
            write_segments(fd, segments)
            return int(stored[a:b].sum())
        bufs: list[Any] = []
        for i in range(a, b):
            bufs.append(hview[at[i] : at[i + 1]])
            src = sources[i]
            if isinstance(src, list):
                bufs.extend(part for part in src if part.size)
            elif src is not None and src.size:
                bufs.append(src)
        _pwritev_all(fd, bufs, int(hoff[a]), int(end[b - 1] - hoff[a]))
        return int(stored[a:b].sum())

    pwrite = os.pwrite

    def write_piece(pos: int, cut: int, view: Any) -> None:
        if pwrite(fd, view, pos) != cut - pos:
            write_segments(fd, [(pos, view)])  # a short write: finish it

    def piece(k: int, i: int, off: int, length: int) -> int:
        """Writes span ``k`` (``length`` bytes of entry ``i`` from ``off``) piece by piece,
        each hashed right after its write (its bytes still in cache)."""
        start = poff_at[i] + off  # the span's file offset
        span = memoryview(sources[i])[off : off + length]  # (slices of a memoryview: ~3x cheaper)
        c = 0
        h = new_hasher() if want[i] else None  # (then the unit is the whole entry)
        for pos, cut in _cuts(start, length):  # (whole large page-cache folios)
            view = span[pos - start : cut - start]
            write_piece(pos, cut, view)
            c = crc32(view, c)
            if h is not None:
                h.update(view)
        piece_crc[k] = c
        if h is not None:
            digests[i] = h.digest()  # type: ignore[index]
        return length

    def account(done: int) -> None:
        with lock:
            bar.update(done)
            unflushed[0] += done
            flush = writeback and unflushed[0] >= WRITEBACK
            if flush:
                unflushed[0] = 0
        if flush:
            _tempfiles.start_writeback(fd)

    def run(k: int) -> None:  # hash and write unit k (one thread does both)
        a, b, length = units[k]
        if length < 0:
            hash_group(a, b)
            done = write_group(a, b)
        else:
            done = piece(k, a, b, length)
        account(done)

    def work() -> None:
        try:
            while not errors:
                with lock:
                    k = next(order, None)
                if k is None:
                    return
                run(k)
        except BaseException as exc:  # re-raised by the calling thread
            errors.append(exc)

    if threads == HASH_AHEAD and len(units) >= 2 and _hasher_pays(stored, pending):
        # steps: (unit, -1, -1) a group; (unit, pos, cut) a piece of a span at file offsets
        steps: list[tuple[int, int, int]] = []
        for k, (a, b, length) in enumerate(units):
            if length < 0:
                steps.append((k, -1, -1))
            else:
                steps.extend((k, pos, cut) for pos, cut in _cuts(poff_at[a] + b, length))
        step_crc = [0] * len(steps)  # each piece's own CRC (either thread may hash it)
        state: list[Any] = [None]  # the digest state of the entry being hashed

        def hash_step(j: int) -> None:
            k, pos, cut = steps[j]
            a, b, length = units[k]
            if pos < 0:
                hash_group(a, b)
                return
            base = poff_at[a]
            view = memoryview(sources[a])[pos - base : cut - base]
            step_crc[j] = crc32(view)
            if want[a]:  # (the unit is the whole entry, its pieces hashed in order by the hasher)
                if pos == base:
                    state[0] = new_hasher()
                state[0].update(view)
                if cut == base + length:
                    digests[a] = state[0].digest()  # type: ignore[index]

        def write_step(j: int) -> int:
            k, pos, cut = steps[j]
            a, b, length = units[k]
            if pos < 0:
                return write_group(a, b)
            base = poff_at[a]
            write_piece(pos, cut, memoryview(sources[a])[pos - base : cut - base])
            return cut - pos

        sizes = [
            int(stored[units[k][0] : units[k][1]].sum()) if pos < 0 else cut - pos for k, pos, cut in steps
        ]
        grouped = [pos < 0 for _, pos, _ in steps]
        stealable = [pos < 0 or not want[units[k][0]] for k, pos, _ in steps]
        _write_behind_hasher(sizes, grouped, stealable, hash_step, write_step, account)
        for j, (k, pos, cut) in enumerate(steps):  # the spans' CRCs from their pieces'
            if pos >= 0:
                first = pos == poff_at[units[k][0]] + units[k][1]
                piece_crc[k] = step_crc[j] if first else combine(piece_crc[k], step_crc[j], cut - pos)
    elif threads <= 1 or len(units) < 2:  # the calling thread alone: no hand-over of units
        for k in range(len(units)):
            run(k)
    else:
        helpers: list[threading.Thread] = []
        try:
            for _ in range(min(threads, len(units)) - 1):
                helpers.append(threading.Thread(target=work, daemon=True))
                helpers[-1].start()
            work()
        finally:  # on an error the helpers stop after their current unit
            for t in helpers:
                t.join()
        if errors:
            raise errors[0]
    big = [i for i, s in enumerate(split) if s]
    if big:  # the headers of split entries, once their pieces' CRCs are combined
        c: dict[int, int] = {}
        for k, (i, off, length) in enumerate(units):
            if length >= 0:
                c[i] = piece_crc[k] if off == 0 else combine(c[i], piece_crc[k], length)
        for i in big:
            set_crc(i, c[i])
        write_segments(fd, [(int(hoff[i]), hview[at[i] : at[i + 1]]) for i in big])


def _hasher_pays(stored: np.ndarray, pending: np.ndarray) -> bool:
    """Whether a hashing thread beside the writer pays: enough bytes to hash and a second
    core this process may run on."""
    if int(stored[pending].sum()) < HASHER_MIN_BYTES:
        return False
    try:
        return len(os.sched_getaffinity(0)) >= 2
    except AttributeError:  # pragma: no cover - not Linux
        return (os.cpu_count() or 1) >= 2


def _write_behind_hasher(
    sizes: list[int],
    grouped: list[bool],
    stealable: list[bool],
    hash_step: Callable[[int], None],
    write_step: Callable[[int], int],
    account: Callable[[int], None],
    ahead: int | None = None,
) -> None:
    """Writes every step (a group of small entries or a piece of a large one, in file order,
    of ``sizes[j]`` payload bytes) on the calling thread while a second thread hashes them,
    at most ``ahead`` bytes (default :data:`HASH_AHEAD_BYTES`) in front of the writer.

    The hasher's read of the source brings it into the shared cache just before the writer's
    copy reads it, so the CRC (~30 ms per 256 MiB on its own core) costs the writer nothing.
    Measured on 2 cores shared with other jobs, 256 MiB in 8 leaves, ``durable=False``,
    interleaved rounds, those in which other processes used < 20% of a core (issue 27):
    52 ms median against safetensors' ``save_file`` 57 and a plain ``write`` of the same
    bytes 57 (the CRC inline, ``num_threads=1``: 79 at best); the hasher 2 MiB ahead 51,
    8 MiB 59, unbounded 59 (4 MiB: 49, in another run); 2,000 leaves of 131 KiB: 92 ms
    against 137 and 121 inline. The CPU time does not shrink (~58 ms writing + ~33
    hashing): with another process busy on the second core the save takes ~88 ms against
    safetensors' 58, which needs one core.

    Each step is hashed once, by whichever thread claims it first: the hasher, in order, or
    the writer, when the hasher has fallen behind it (a busy machine: another process on the
    second core), as with ``num_threads=1``: a piece right after its write, a group before
    it. A group (``grouped[j]``) is written once its CRCs are in its local headers: the
    writer waits only for a group the hasher is hashing. Steps not ``stealable`` (the pieces
    of an entry whose digest the hasher computes in order) are left to the hasher. Either
    thread's error stops the other and is raised here.
    """
    import threading

    ahead = HASH_AHEAD_BYTES if ahead is None else ahead
    n = len(sizes)
    cond = threading.Condition()
    owner = bytearray(n)  # who hashes step j: 0 nobody yet, 1 the hasher, 2 the writer
    finished = bytearray(n)  # the hasher has hashed step j
    progress = {"written": 0, "stop": False}  # payload bytes written; the writer gave up
    errors: list[BaseException] = []

    def hasher() -> None:
        done = 0  # payload bytes of the steps passed
        try:
            for j in range(n):
                if done - progress["written"] >= ahead:  # (read without the lock: it only grows)
                    with cond:
                        while done - progress["written"] >= ahead and not progress["stop"]:
                            cond.wait()
                done += sizes[j]
                with cond:
                    if progress["stop"]:
                        return
                    if owner[j]:  # the writer took it
                        continue
                    owner[j] = 1
                hash_step(j)
                with cond:
                    finished[j] = 1
                    cond.notify()
        except BaseException as exc:  # re-raised by the writer
            errors.append(exc)
            with cond:
                finished[:] = b"\x01" * n  # wakes the writer, which raises it
                cond.notify()

    helper = threading.Thread(target=hasher, name="tdz-save-crc", daemon=True)
    helper.start()
    try:
        for j in range(n):
            if grouped[j]:
                with cond:
                    mine = not owner[j]
                    if mine:
                        owner[j] = 2
                    else:
                        while not finished[j]:
                            cond.wait()
                if errors:
                    raise errors[0]
                if mine:
                    hash_step(j)
                account(write_step(j))
                with cond:
                    progress["written"] += sizes[j]
                    cond.notify()
                continue
            account(write_step(j))
            with cond:
                progress["written"] += sizes[j]
                mine = stealable[j] and not owner[j]
                if mine:
                    owner[j] = 2
                cond.notify()
            if errors:
                raise errors[0]
            if mine:
                hash_step(j)  # the bytes just written, still in this core's cache
    except BaseException:
        with cond:
            progress["stop"] = True  # (the hasher finishes its step and returns)
            cond.notify()
        raise
    finally:
        helper.join()
    if errors:
        raise errors[0]


def _pwritev_all(fd: int, bufs: list[Any], offset: int, total: int) -> None:
    """Writes the contiguous buffers ``bufs`` (``total`` bytes) at ``offset``:
    ``pwritev`` of up to :data:`IOV_MAX` buffers at a time; a short write is
    finished by :func:`write_segments`."""
    if len(bufs) <= IOV_MAX and os.pwritev(fd, bufs, offset) == total:
        return
    segments: list[tuple[int, Any]] = []
    pos = offset
    for b in bufs:
        view = memoryview(b).cast("B")
        segments.append((pos, view))
        pos += view.nbytes
    write_segments(fd, segments)


def write_threads(num_threads: int | None) -> int:
    """Threads that write a save's payloads: :data:`HASH_AHEAD` (0) by default, the calling
    thread writing while one more computes the CRC-32s (for a save of at least
    :data:`HASHER_MIN_BYTES` on a process that may use 2 cores, else the calling thread
    alone); 1: the calling thread alone, each piece hashed right after its write; 2 to 4
    (at most): that many share the units, each hashing and writing its own.

    Why one writer and one hasher: buffered writes to one file serialize on its inode
    lock, so a second *writing* thread gains little (256 MiB in 8 leaves, write only, 2
    shared cores: one thread median 84 ms, two 109 ms; 64 MiB in 2,000 / 20,000 leaves:
    within noise), while the CRC is ~30% of a lone thread's time: the CRC of a 2 MiB
    piece just written reads it back from L3, not L2 (~24 ms per 256 MiB beside a ~52 ms
    write, issue 27). On a second core it hides behind the write: see
    :func:`_write_behind_hasher` for the figures.

    Examples
    --------
    >>> write_threads(None), write_threads(1), write_threads(2), write_threads(16)
    (0, 1, 2, 4)
    """
    return HASH_AHEAD if num_threads is None else max(1, min(num_threads, 4))


#: Buffers per ``pwritev`` call (Linux's IOV_MAX).
IOV_MAX = 1024


def write_segments(fd: int, segments: list[tuple[int, Any]]) -> None:
    """Writes ``(offset, buffer)`` segments, batching contiguous runs into ``pwritev``."""
    i = 0
    while i < len(segments):
        offset = segments[i][0]
        bufs = [memoryview(segments[i][1]).cast("B")]
        end = offset + bufs[0].nbytes
        j = i + 1
        while j < len(segments) and segments[j][0] == end and len(bufs) < IOV_MAX:
            bufs.append(memoryview(segments[j][1]).cast("B"))
            end += bufs[-1].nbytes
            j += 1
        written = os.pwritev(fd, bufs, offset)
        if written < end - offset:  # short write: finish one buffer at a time
            pos = offset
            for b in bufs:
                if pos + b.nbytes <= offset + written:
                    pos += b.nbytes
                    continue
                skip = max(0, offset + written - pos)
                view = b[skip:]
                at = pos + skip
                while view.nbytes:
                    k = os.pwrite(fd, view, at)
                    view, at = view[k:], at + k
                pos += b.nbytes
        i = j


def _rows(fields: dict, start: int, stop: int) -> dict:
    return {k: (v if k == "dos" else v[start:stop]) for k, v in fields.items()}
