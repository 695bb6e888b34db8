"""Safe extraction of an archive into a memmap directory (:func:`tdz_numba.unpack`).

Every name is checked before anything is written; the archive is refused
with :class:`~tdz_numba.BadArchiveError` when a name

* is empty, absolute, has a drive or a backslash or a NUL byte;
* has an empty component (``a//b``, an alias of ``a/b``), a ``.`` or ``..``
  component, or a component over 255 bytes (UTF-8), or more than
  :data:`MAX_DEPTH` components;
* is both a file and a directory (``x`` and ``x/y``, ``meta.json`` and
  ``meta.json/``);
* is a symbolic link (its zip external attributes say so): tdz_numba never
  creates links, and so never writes below one.

The entries are written into a new temporary directory beside the target
(``.{name}.tdz-tmp.{host}.{pid}.{random}``, see :mod:`tdz_numba.files.tempfiles`),
every directory created and every file opened relative to a directory file
descriptor with ``O_NOFOLLOW`` (``mkdirat``/``openat``), so that no symbolic
link is ever followed; CRCs are checked as entries are written. Then:

* a missing or empty target directory is replaced by the temporary one with
  one ``rename``: the target appears complete or not at all;
* an existing non-empty target is merged into, as tensordict's
  ``unpack_memmap`` (``zipfile.extractall``) does: files of the archive
  replace files of the same name (a symbolic link in the target is replaced,
  never followed); other files stay. Before anything is moved, a directory of
  the target where the archive has a file, or a file or symbolic link where it
  has a directory, refuses the unpack (:class:`~tdz_numba.ArchiveExistsError`).

A failed unpack (bad name, CRC mismatch, full disk, ...) removes its
temporary directory and leaves the target as it was. The target path itself
is resolved (symbolic links in the path given are followed, as ``cd`` does);
nothing inside it is.

Examples
--------
>>> import tempfile, pathlib, torch, tdz_numba
>>> with tempfile.TemporaryDirectory() as d:
...     p = tdz_numba.save({"a": {"b": torch.ones(2)}}, pathlib.Path(d) / "x.tdz")
...     out = tdz_numba.unpack(p, pathlib.Path(d) / "dir")
...     print(sorted(str(q.relative_to(out)) for q in out.rglob("*")))
['a', 'a/b.memmap', 'a/meta.json', 'meta.json']
"""

from __future__ import annotations

import contextlib
import os
import stat
from pathlib import Path

from ..errors import ArchiveExistsError, BadArchiveError, InvalidArgumentError
from ..files import tempfiles as _tempfiles
from ..files.paths import user_errors
from ..files.progress import progress as _progress
from . import members, records
from .index import ArchiveIndex
from .stream import stream_member

__all__ = ["unpack", "check_names", "MAX_DEPTH", "MAX_COMPONENT"]

#: Most path components in one entry name (the reader's limit).
MAX_DEPTH = records.MAX_NAME_DEPTH
#: Longest path component, in bytes of UTF-8 (NAME_MAX of common file systems).
MAX_COMPONENT = 255

_DIR_FLAGS = (
    os.O_RDONLY | getattr(os, "O_DIRECTORY", 0) | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_CLOEXEC", 0)
)
_FILE_FLAGS = (
    os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_CLOEXEC", 0)
)
_S_IFLNK = 0o120000
_S_IFMT = 0o170000
_BUF = 8 << 20  # bytes per write call


def _is_symlink_entry(index: ArchiveIndex, row: int) -> bool:
    """Whether the central record's external attributes mark a Unix symbolic link."""
    cd = int(index.table["central_offset"][row])
    if cd < 0 or cd + records.Central.HEADER_OFFSET > index.size:
        return False
    at = cd + records.Central.EXTERNAL
    attr = int.from_bytes(index.buffer[at : at + 4].tobytes(), "little")
    return (attr >> 16) & _S_IFMT == _S_IFLNK


def check_names(names: list[str], where: str, symlinks: set[int] | None = None) -> dict:
    """Validates entry names and returns their tree: nested dicts for directories,
    the row number for files. Iterative (no recursion, whatever the depth).

    Raises
    ------
    BadArchiveError
        For every unsafe or ambiguous name (see the module docstring).

    Examples
    --------
    >>> from tdz_numba.zipfmt.extract import check_names
    >>> check_names(["meta.json", "a/", "a/b.memmap"], "x.tdz")
    {'meta.json': 0, 'a': {'b.memmap': 2}}
    >>> try:
    ...     check_names(["x", "x/y"], "x.tdz")
    ... except ValueError as e:
    ...     print(e)
    x.tdz: entry 'x/y': 'x' is both a file and a directory
    """
    root: dict = {}
    symlinks = symlinks or set()
    for row, name in enumerate(names):
        if not name or name == "/":
            raise BadArchiveError(f"{where}: entry {row} has an empty name")
        if name.startswith("/") or "\\" in name or "\x00" in name or ":" in name.split("/", 1)[0]:
            raise BadArchiveError(f"{where}: entry {name!r} has an absolute or unsafe path")
        if row in symlinks:
            raise BadArchiveError(
                f"{where}: entry {name!r} is a symbolic link: tdz_numba does not extract links"
            )
        is_dir = name.endswith("/")
        parts = (name[:-1] if is_dir else name).split("/")
        if len(parts) > MAX_DEPTH:
            raise BadArchiveError(f"{where}: entry name has {len(parts)} components (at most {MAX_DEPTH})")
        for part in parts:
            if part in ("", ".", ".."):
                what = (
                    "an empty path component (an alias like 'a//b')" if not part else f"a {part!r} component"
                )
                raise BadArchiveError(f"{where}: entry {name[:200]!r} has {what}")
            if len(part) > MAX_COMPONENT // 4 and len(os.fsencode(part)) > MAX_COMPONENT:
                raise BadArchiveError(
                    f"{where}: entry {name[:200]!r}: a path component of {len(os.fsencode(part))} bytes "
                    f"(at most {MAX_COMPONENT})"
                )
        node = root
        last = len(parts) - 1
        for j, part in enumerate(parts):
            child = node.get(part)
            if j == last and not is_dir:
                if child is not None:
                    raise BadArchiveError(f"{where}: entry {name[:200]!r} is both a file and a directory")
                node[part] = row
            else:
                if child is None:
                    child = node[part] = {}
                elif not isinstance(child, dict):
                    raise BadArchiveError(
                        f"{where}: entry {name[:200]!r}: {'/'.join(parts[: j + 1])[:200]!r} is both a file "
                        f"and a directory"
                    )
                node = child
    return root


class _Cursor:
    """Opens directories below a root directory fd, component by component with
    ``O_NOFOLLOW``, keeping only the last one open (its children open in O(1))."""

    def __init__(self, root_fd: int) -> None:
        self.root = root_fd
        self.path: tuple[str, ...] = ()
        self.fd = root_fd

    def open(self, path: tuple[str, ...]) -> int:
        if path == self.path:
            return self.fd
        if path[:-1] == self.path and path:
            fd = os.open(path[-1], _DIR_FLAGS, dir_fd=self.fd)
        else:
            fd = self.root
            for part in path:
                nxt = os.open(part, _DIR_FLAGS, dir_fd=fd)
                if fd != self.root:
                    os.close(fd)
                fd = nxt
        self.close()
        self.path, self.fd = path, fd
        return fd

    def close(self) -> None:
        if self.fd != self.root:
            os.close(self.fd)
        self.path, self.fd = (), self.root


def _walk(tree: dict):
    """``(path, dir node)`` of every directory, depth first (parents before children)."""
    stack: list[tuple[tuple[str, ...], dict]] = [((), tree)]
    while stack:
        path, node = stack.pop()
        yield path, node
        subs = [(path + (k,), v) for k, v in node.items() if isinstance(v, dict)]
        stack.extend(reversed(subs))


def _write_all(fd: int, data) -> None:
    view = memoryview(data).cast("B")
    while view.nbytes:
        n = os.write(fd, view[:_BUF])
        view = view[n:]


def _write_entry(index: ArchiveIndex, name: str, out: int) -> None:
    """Writes one entry's bytes to ``out``: STORED ones from the mapping, compressed ones
    decoded through a fixed buffer (``stream.stream_member``: memory independent of the
    entry's size); the CRC-32 is checked either way."""
    e = index.entry(name)
    if e.method == records.STORED:
        _write_all(out, index.read(name))  # a view of the mapping; checks size and CRC
        return
    where = f"{index.path}: entry {name!r}"
    table = members.parse_segment_table(index.local_extra(e), where) if e.method == records.DEFLATED else None
    stream_member(index.raw(e), e.method, e.size, e.crc, table, lambda piece: _write_all(out, piece), where)


def _extract(index: ArchiveIndex, tree: dict, root_fd: int, bar) -> None:
    cursor = _Cursor(root_fd)
    try:
        for path, node in _walk(tree):
            fd = cursor.open(path)
            for name, child in node.items():
                if isinstance(child, dict):
                    os.mkdir(name, 0o777, dir_fd=fd)
                    continue
                out = os.open(name, _FILE_FLAGS, 0o666, dir_fd=fd)
                try:
                    _write_entry(index, index.names[child], out)
                finally:
                    os.close(out)
                bar.update(int(index.table["size"][child]))
    finally:
        cursor.close()


def _conflicts(tree: dict, src_fd: int, dst_fd: int, directory: Path) -> None:
    """Refuses (before anything moves) a merge that would need a directory of the target
    removed, or a file or link of the target where the archive has a directory."""
    cursor = _Cursor(dst_fd)
    try:
        for path, node in _walk(tree):
            try:
                fd = cursor.open(path)
            except FileNotFoundError:
                continue  # a new directory: moved in whole
            for name, child in node.items():
                try:
                    st = os.stat(name, dir_fd=fd, follow_symlinks=False)
                except FileNotFoundError:
                    continue
                shown = directory.joinpath(*path, name)
                if isinstance(child, dict) and not stat.S_ISDIR(st.st_mode):
                    kind = "a symbolic link" if stat.S_ISLNK(st.st_mode) else "a file"
                    raise ArchiveExistsError(
                        f"cannot unpack into {directory}: {shown} is {kind} where the archive has a "
                        f"directory (unpack never follows links in the target): remove it or unpack elsewhere"
                    )
                if not isinstance(child, dict) and stat.S_ISDIR(st.st_mode):
                    raise ArchiveExistsError(
                        f"cannot unpack into {directory}: {shown} is a directory where the archive has a file"
                    )
    finally:
        cursor.close()


def _merge(tree: dict, src_fd: int, dst_fd: int) -> None:
    """Moves the extracted tree into an existing directory (files replace files)."""
    src, dst = _Cursor(src_fd), _Cursor(dst_fd)
    moved: set[tuple[str, ...]] = set()
    try:
        for path, node in _walk(tree):
            if any(path[:k] in moved for k in range(1, len(path) + 1)):
                continue  # inside a directory moved whole
            sfd, dfd = src.open(path), dst.open(path)
            for name, child in node.items():
                if isinstance(child, dict):
                    try:
                        os.stat(name, dir_fd=dfd, follow_symlinks=False)
                        continue  # exists (a directory: checked): merged below
                    except FileNotFoundError:
                        moved.add(path + (name,))
                os.replace(name, name, src_dir_fd=sfd, dst_dir_fd=dfd)
    finally:
        src.close()
        dst.close()


def _target(directory: Path) -> tuple[Path, os.stat_result | None]:
    """The resolved target directory and its stat (None when it does not exist)."""
    resolved = Path(os.path.realpath(directory))
    try:
        st = os.stat(resolved)
    except FileNotFoundError:
        if os.path.lexists(directory) and os.path.islink(directory):
            raise InvalidArgumentError(
                f"cannot unpack into {directory}: a symbolic link to a missing path"
            ) from None
        return resolved, None
    if not stat.S_ISDIR(st.st_mode):
        raise ArchiveExistsError(f"cannot unpack into {directory}: it exists and is not a directory")
    return resolved, st


def unpack(path: str | os.PathLike, directory: str | os.PathLike, *, progress: bool | None = None) -> Path:
    """Extracts an archive into a memmap directory; see :func:`tdz_numba.unpack` and the
    module docstring for the checks and the guarantees."""
    directory = Path(directory)
    with user_errors(path, action="unpack"):
        index = ArchiveIndex(path, check_local=True)
    try:
        if "meta.json" not in index:
            raise BadArchiveError(f"{path}: not a tensor archive: no top-level meta.json entry")
        where = str(index.path)
        links = {i for i in range(len(index.names)) if _is_symlink_entry(index, i)}
        tree = check_names(index.names, where, links)
        with user_errors(directory, action="unpack into"):
            target, st = _target(directory)
            target.parent.mkdir(parents=True, exist_ok=True)
            _tempfiles.clean(target.parent)
            tmp = _tempfiles.create_temp_dir(target.parent, target.name)
            try:
                root_fd = os.open(tmp, _DIR_FLAGS)
                try:
                    total = int(index.table["size"].sum())
                    with _progress(total, "unpack", enabled=progress) as bar:
                        _extract(index, tree, root_fd, bar)
                    os.fchmod(root_fd, stat.S_IMODE(st.st_mode) if st is not None else _dir_mode())
                    if st is None or not os.listdir(target):
                        try:
                            os.rename(tmp, target)  # replaces a missing or empty directory atomically
                            return directory
                        except OSError:
                            if not target.is_dir():
                                raise  # e.g. the parent vanished
                    dst_fd = os.open(target, _DIR_FLAGS)
                    try:
                        _conflicts(tree, root_fd, dst_fd, directory)
                        _merge(tree, root_fd, dst_fd)
                    finally:
                        os.close(dst_fd)
                finally:
                    os.close(root_fd)
            finally:
                if os.path.lexists(tmp):
                    with contextlib.suppress(OSError):
                        _tempfiles.remove_tree(tmp)  # iterative: any depth
    finally:
        index.close()
    return directory


def _dir_mode() -> int:
    """0o777 less the umask (what ``mkdir`` gives)."""
    return 0o777 & ~_tempfiles.umask()
