"""Stand-ins for the files a format's reader maps: how :mod:`tdz_numba.remote` runs the readers
unchanged on a remote object (:func:`mapped_as`, :func:`stand_in_external`), and the hook that
fetches leaves' bytes before tensors are made of them (:func:`make_present`, a no-op for
local files).

Examples
--------
>>> from tdz_numba.tdz.standins import mapped_as, stand_in_external
>>> stand_in_external("w.bin") is None           # outside mapped_as: the reader maps the file itself
True
>>> with mapped_as({}, lambda location: "the remote file " + location):
...     print(stand_in_external("w.bin"))
the remote file w.bin
"""

from __future__ import annotations

import contextlib
import contextvars
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # pragma: no cover
    from .sources import MappedFile

__all__ = ["mapped_as", "stand_in_external", "make_present"]

_STAND_INS: contextvars.ContextVar[dict[str, MappedFile] | None] = contextvars.ContextVar(
    "tdz_mapped_as", default=None
)


_NEIGHBOURS: contextvars.ContextVar[Callable[[str], MappedFile] | None] = contextvars.ContextVar(
    "tdz_neighbours", default=None
)


@contextlib.contextmanager
def mapped_as(files: dict[str, MappedFile], neighbours: Callable[[str], MappedFile] | None = None):
    """Within the block, :meth:`MappedFile.open` of a name in ``files`` returns that file (a
    remote object's :class:`MappedFile`), so that a format's reader opens it unchanged;
    ``neighbours(location)`` gives the file a reader names relative to it (ONNX external data),
    the location already checked by the reader (relative, no ``..``)."""
    token = _STAND_INS.set(files)
    other = _NEIGHBOURS.set(neighbours)
    try:
        yield
    finally:
        _NEIGHBOURS.reset(other)
        _STAND_INS.reset(token)


def stand_in_external(location: str) -> MappedFile | None:
    """The file at ``location`` next to a remote file being opened (inside :func:`mapped_as`);
    None otherwise (a local reader maps the file itself)."""
    found = _NEIGHBOURS.get()
    return None if found is None else found(location)


def make_present(specs: Any, files: Any) -> None:
    """Fetches the bytes of many leaves of remote files in one batch per file (nothing
    for local files): what a reader calls before it makes tensors of ``specs``."""
    remote = [i for i, f in enumerate(files) if getattr(f, "remote", False)]
    if not remote:
        return
    spans: dict[int, list[tuple[int, int]]] = {i: [] for i in remote}
    from .sources import TensorSpec

    for s in specs:
        if type(s) is TensorSpec and s.nbytes > 0 and s.file in spans:
            spans[s.file].append((s.offset, s.offset + s.nbytes))
    for i, todo in spans.items():
        if todo:
            files[i].need_spans(todo)
