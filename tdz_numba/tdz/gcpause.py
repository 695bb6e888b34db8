"""Pausing the cyclic garbage collector while a load makes many small objects (re-exported by
:mod:`tdz_numba.tdz.sources`, where the readers import it from).

Examples
--------
>>> import gc
>>> from tdz_numba.tdz.gcpause import paused_gc
>>> with paused_gc():
...     with paused_gc():  # nested: the outermost restores
...         inner = gc.isenabled()
...     middle = gc.isenabled()
>>> inner, middle, gc.isenabled()
(False, False, True)
"""

from __future__ import annotations

import gc

__all__ = ["paused_gc"]


class paused_gc:  # noqa: N801 - a context manager used as a function: ``with paused_gc():``
    """Pauses the cyclic garbage collector while many small objects (a header's containers,
    children, tensors) are made: nothing made there forms cycles, and each of the collector's
    passes over the heap (hundreds of thousands of objects once torch is imported; a full pass
    125-150 ms here) costs more than the work. Nested uses leave it to the outermost, which
    moves what was made to the oldest generation (``gc.freeze(); gc.unfreeze()``, not done when
    the application froze objects itself) instead of a young collection traversing it at once.
    (A class: ~0.3 us a use, not a generator's ~1.5; a load enters it ~10 times.)

    >>> with paused_gc():
    ...     inside = gc.isenabled()
    >>> inside, gc.isenabled()
    (False, True)
    """

    __slots__ = ("_was",)

    def __enter__(self) -> None:
        self._was = gc.isenabled()
        gc.disable()

    def __exit__(self, *exc: object) -> None:
        if self._was:
            if not gc.get_freeze_count():
                gc.freeze()
                gc.unfreeze()
            gc.enable()
