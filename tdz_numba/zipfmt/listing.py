"""The directory listing of an archive's entry names: which files and sub-directories each
directory holds (:attr:`tdz_numba.zipfmt.index.ArchiveIndex.files` and ``.dirs``).

Examples
--------
>>> files, dirs = build_listing(["meta.json", "obs/meta.json", "obs/pixels.memmap", "empty/"], "x.tdz")
>>> sorted(files[""]), sorted(files["obs"]), sorted(dirs[""]), files["empty"]
(['meta.json'], ['meta.json', 'pixels.memmap'], ['empty', 'obs'], set())
"""

from __future__ import annotations

from collections.abc import Iterable

from ..errors import BadArchiveError
from . import records

__all__ = ["build_listing"]


def build_listing(names: Iterable[str], label: str) -> tuple[dict[str, set[str]], dict[str, set[str]]]:
    """``(files, dirs)``: the files and the sub-directories directly under each directory of the
    entry ``names`` ("" is the root; a name ending in "/" is a directory). Raises
    :class:`~tdz_numba.BadArchiveError` (naming the archive ``label``) for a name of
    :data:`~tdz_numba.zipfmt.records.MAX_NAME_DEPTH` components or more."""
    files: dict[str, set[str]] = {"": set()}
    dirs: dict[str, set[str]] = {"": set()}
    for name in names:
        if name.count("/") >= records.MAX_NAME_DEPTH:
            raise BadArchiveError(
                f"{label}: entry {name[:60]!r}... has {name.count('/') + 1} path components, "
                f"more than the {records.MAX_NAME_DEPTH} tdz_numba reads",
                path=label,
                entry=name,
                expected=records.MAX_NAME_DEPTH,
                found=name.count("/") + 1,
            )
        if name.endswith("/"):
            _add_dir(files, dirs, name.rstrip("/"))
            continue
        parent, _, base = name.rpartition("/")
        if parent not in dirs:
            _add_dir(files, dirs, parent)
        files[parent].add(base)
    return files, dirs


def _add_dir(files: dict[str, set[str]], dirs: dict[str, set[str]], d: str) -> None:
    """Adds directory ``d`` and its missing ancestors (a loop: names may be deep)."""
    missing = []
    while d not in dirs:  # "" (the root) is always there
        missing.append(d)
        d = d.rpartition("/")[0]
    for d in reversed(missing):
        parent, _, base = d.rpartition("/")
        dirs[d] = set()
        files[d] = set()
        dirs[parent].add(base)
