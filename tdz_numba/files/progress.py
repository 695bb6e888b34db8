"""A small byte-progress helper for long operations (``tdz pack``, ``unpack``, ``verify``).

:func:`progress` is a context manager that gives an object with
``update(nbytes)``. It draws a `tqdm <https://tqdm.github.io>`_ bar on stderr
when tqdm is installed and the bar is enabled; otherwise every call is a no-op.
By default (``enabled=None``) the bar is shown only when ``sys.stderr`` is a
terminal, so pipes, logs and CI output stay clean. Importing this module
imports neither tqdm nor torch.

Examples
--------
>>> from tdz_numba.files.progress import progress
>>> with progress(3 * 2**20, "copy", enabled=False) as bar:
...     for _ in range(3):
...         bar.update(2**20)
>>> bar.n, bar.total
(3145728, 3145728)
"""

from __future__ import annotations

import os
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

__all__ = ["progress", "Progress", "stderr_is_tty", "human_bytes"]


def stderr_is_tty() -> bool:
    """Whether ``sys.stderr`` is an interactive terminal (False when it is missing or closed)."""
    stream = sys.stderr
    try:
        return bool(stream is not None and stream.isatty())
    except (AttributeError, ValueError, OSError):
        return False


class Progress:
    """Counts bytes done; forwards them to a tqdm bar when one is shown.

    ``n`` is the number of bytes reported so far and ``total`` the expected
    total. The object is also callable (``bar(nbytes)`` is ``bar.update(nbytes)``),
    so it can be passed wherever a byte callback is expected.
    """

    def __init__(self, total: int | None, bar: Any = None) -> None:
        self.total = total
        self.n = 0
        self._bar = bar

    @property
    def enabled(self) -> bool:
        """Whether a bar is drawn."""
        return self._bar is not None

    def update(self, nbytes: int) -> None:
        """Adds ``nbytes`` bytes done."""
        nbytes = int(nbytes)
        self.n += nbytes
        if self._bar is not None:
            self._bar.update(nbytes)

    __call__ = update

    def finish(self) -> None:
        """Reports whatever remains up to ``total`` as done (for one-shot operations)."""
        if self.total is not None and self.n < self.total:
            self.update(self.total - self.n)

    def close(self, leave: bool = True) -> None:
        """Closes the bar; ``leave=False`` erases it from the terminal."""
        bar, self._bar = self._bar, None
        if bar is not None:
            try:
                bar.leave = leave
                bar.close()
            except Exception:  # a progress bar never breaks the operation
                pass


def _make_bar(total: int | None, desc: str) -> Any:
    try:
        from tqdm import tqdm
    except ImportError:
        return None
    ncols = None  # tqdm sizes the bar to the terminal
    try:
        if os.get_terminal_size(sys.stderr.fileno()).columns == 0:
            ncols = 80  # a terminal that reports no size (a bare pty, a serial console)
    except (AttributeError, ValueError, OSError):
        pass
    try:
        return tqdm(
            total=total,
            desc=desc,
            unit="B",
            unit_scale=True,
            unit_divisor=1024,
            file=sys.stderr,
            ncols=ncols,
            dynamic_ncols=ncols is None,
            leave=True,
        )
    except Exception:
        return None


@contextmanager
def progress(total_bytes: int | None, desc: str = "", enabled: bool | None = None) -> Iterator[Progress]:
    """A byte progress bar for a block of work.

    Parameters
    ----------
    total_bytes : int or None
        Bytes the work covers (None: unknown, the bar only counts).
    desc : str
        Label shown before the bar.
    enabled : bool or None
        True: draw a bar (when tqdm is installed); False: never; None (default):
        only when ``sys.stderr`` is a terminal.

    Yields
    ------
    Progress
        Call ``update(nbytes)`` as bytes are done. On an exception the bar is
        erased, so that the error message stands alone.
    """
    if enabled is None:
        enabled = stderr_is_tty()
    total = None if total_bytes is None else max(int(total_bytes), 0)
    p = Progress(total, _make_bar(total, desc) if enabled else None)
    try:
        yield p
    except BaseException:
        p.close(leave=False)
        raise
    p.close(leave=True)


def human_bytes(n: int) -> str:
    """``n`` bytes for people: ``"512 B"``, ``"1.5 KiB"``, ``"257.9 MiB"``."""
    value = float(n)
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if value < 1024 or unit == "TiB":
            return f"{n} B" if unit == "B" else f"{value:.1f} {unit}"
        value /= 1024
    return f"{n} B"  # pragma: no cover
