"""Checks of a verified bulk fetch done as its parts land: :class:`ArrivalCheck`.

A bulk fetch of many entries (``load``, ``to_dict`` of a remote archive) is cut
into parts fetched concurrently. The transport tells of each part as soon as
its bytes are in place and checked against the pin (:meth:`ArrivalCheck.landed`:
a queue put, from the transport's thread). One worker thread takes them in the
order they land, marks their bytes here and, for every entry whose extent is
now all here, runs the check (its local header, its CRC-32) while the other
parts are still travelling: the CRC of a read costs about one part's, not the
whole object's, after the last byte. The worker holds no lock while checking:
it alone keeps its bookkeeping; the caller, blocked in the fetch, reads the
result only after :meth:`ArrivalCheck.finish` joined it.

Examples
--------
>>> import numpy as np
>>> from tdz_numba.remote.arrival import ArrivalCheck
>>> seen = []
>>> chk = ArrivalCheck(np.array([0, 10, 20]), np.array([10, 20, 30]), [(0, 5)], seen.extend)
>>> chk.landed(5, 15); chk.landed(15, 30)
>>> chk.finish().tolist(), sorted(seen)
([0, 1, 2], [0, 1, 2])
"""

from __future__ import annotations

import queue
import threading
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

__all__ = ["ArrivalCheck"]

_STOP = (-1, -1)


class ArrivalCheck:
    """Runs ``check(items)`` on the items whose extents ``[starts[k], stops[k])`` are all here,
    in a worker thread, as the parts they lie in land (see the module).

    Parameters
    ----------
    starts, stops : numpy.ndarray
        Item extents, sorted and disjoint (entries of an archive in file order).
    present : sequence of (int, int)
        Byte ranges here before the fetch (sorted, disjoint).
    check : callable
        Called with a list of item numbers (positions in ``starts``) once their bytes are all
        here; what it raises ends the checks and is raised again by :meth:`finish`.
    """

    def __init__(
        self,
        starts: np.ndarray,
        stops: np.ndarray,
        present: Sequence[tuple[int, int]],
        check: Callable[[list[int]], Any],
    ) -> None:
        self.starts = np.asarray(starts, np.int64)
        self.stops = np.maximum(np.asarray(stops, np.int64), self.starts)
        self.check = check
        self.done = np.zeros(self.starts.size, np.bool_)
        self._here_a: list[int] = [int(a) for a, _ in present]
        self._here_b: list[int] = [int(b) for _, b in present]
        self.error: BaseException | None = None
        self._queue: queue.SimpleQueue[tuple[int, int]] = queue.SimpleQueue()
        self._stopped = False
        self._thread = threading.Thread(target=self._run, name="tdz-check-on-arrival", daemon=True)
        self._thread.start()
        for a, b in present:  # what is here already is checked first
            self._queue.put((int(a), int(b)))

    def landed(self, a: int, b: int) -> None:
        """Bytes ``[a, b)`` are in place (called from the transport's thread: only a queue put)."""
        self._queue.put((int(a), int(b)))

    def _add(self, a: int, b: int) -> None:
        """Records ``[a, b)`` as here (merged with its neighbours)."""
        import bisect

        sa, sb = self._here_a, self._here_b
        i = bisect.bisect_left(sb, a)
        j = bisect.bisect_right(sa, b)
        if i < j:
            a, b = min(a, sa[i]), max(b, sb[j - 1])
        sa[i:j] = [a]
        sb[i:j] = [b]

    def _covered(self, a: int, b: int) -> bool:
        import bisect

        i = bisect.bisect_right(self._here_a, a) - 1
        return i >= 0 and self._here_b[i] >= b

    def _run(self) -> None:
        while True:
            a, b = self._queue.get()
            if (a, b) == _STOP:
                return
            if self.error is not None or self._stopped:
                continue
            self._add(a, b)
            lo = int(np.searchsorted(self.stops, a, "left"))  # the items touching [a, b)
            hi = int(np.searchsorted(self.starts, b, "right"))
            ready = [
                k
                for k in range(lo, hi)
                if not self.done[k] and self._covered(int(self.starts[k]), int(self.stops[k]))
            ]
            if not ready:
                continue
            try:
                self.check(ready)
            except BaseException as exc:  # raised again by finish(), in the caller's thread
                self.error = exc
                continue
            self.done[ready] = True

    def stop(self) -> None:
        """Ends the worker without waiting for the checks still queued (the fetch failed)."""
        self._stopped = True
        self._queue.put(_STOP)
        self._thread.join()

    def finish(self) -> np.ndarray:
        """Waits for the checks of every part told so far; returns the items checked (sorted).
        Raises what a check raised."""
        self._queue.put(_STOP)
        self._thread.join()
        if self.error is not None:
            raise self.error
        return np.nonzero(self.done)[0]
