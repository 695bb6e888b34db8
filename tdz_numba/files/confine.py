"""The one rule for files a reader may open besides the one it was given.

A multi-file format (sharded safetensors, ONNX external data, tensordict
memmap directories, HDF5 external storage, virtual sources and external links)
names other files. A reader may open such a file only when it is

- **inside the input's own folder** (the *root*): the relative name is walked
  one component at a time from an open descriptor of the root, each component
  opened with ``O_NOFOLLOW`` relative to its parent's descriptor (``openat``),
  so no rename or symlink swap between a check and the open can lead outside;
  ``..`` never climbs above the root;
- reached **without a symlink that leaves the root**: a symlink component is
  resolved here (``readlink`` at its parent's descriptor) and followed only when
  its target stays inside the root (a relative target is walked like the rest of
  the name; an absolute one must lie under the root's real path); one that
  leaves is refused with :class:`OutsideError`, at most :data:`MAX_SYMLINKS` are
  followed per name;
- a **regular file** (directories where a folder is asked for): every file is
  opened ``O_NONBLOCK`` and checked with ``fstat``, so a FIFO, device or socket
  is refused (:class:`NotRegularError`) and never blocks the open.

``realpath`` checks alone are not enough (a component can be swapped between
the check and the open): every function here returns or uses the descriptor it
walked to. Errors name the input file (``where``), the entry and the reason;
they are :class:`~tdz_numba.TdzError` subclasses.

Examples
--------
>>> import tempfile, os, pathlib
>>> from tdz_numba.files.confine import read_inside, OutsideError
>>> with tempfile.TemporaryDirectory() as d:
...     _ = (pathlib.Path(d) / "a.bin").write_bytes(b"inside")
...     os.symlink("/etc/hostname", pathlib.Path(d) / "out.bin")
...     print(read_inside(d, "a.bin", where="m.onnx", max_bytes=100))
...     try:
...         read_inside(d, "out.bin", where="m.onnx", max_bytes=100)
...     except OutsideError as e:
...         print(type(e).__name__, "outside" in str(e))
b'inside'
OutsideError True
"""

from __future__ import annotations

import mmap
import os
import stat
from collections.abc import Iterator
from contextlib import contextmanager

from ..errors import BadArchiveError, UnsafeContentError

__all__ = [
    "OutsideError",
    "NotRegularError",
    "MemberMissingError",
    "MAX_SYMLINKS",
    "open_inside",
    "open_dir_inside",
    "read_inside",
    "map_inside",
    "map_fd",
    "relative_inside",
    "check_regular",
]

#: Most symlinks followed while resolving one name (the kernel's ELOOP limit).
MAX_SYMLINKS = 40
_O_CLOEXEC = getattr(os, "O_CLOEXEC", 0)
_O_DIRECTORY = getattr(os, "O_DIRECTORY", 0)
_FILE_FLAGS = os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | _O_CLOEXEC
_DIR_FLAGS = os.O_RDONLY | os.O_NOFOLLOW | _O_DIRECTORY | _O_CLOEXEC


class OutsideError(UnsafeContentError):
    """A file named by the input lies outside the input's folder (an absolute name,
    ``..`` above the folder, a symlink that leaves it)."""


class NotRegularError(BadArchiveError):
    """A file named by the input is a FIFO, device, socket or directory, not a regular file."""


class MemberMissingError(BadArchiveError):
    """A file named by the input does not exist."""


def _short(name: object) -> str:
    text = repr(name)
    return text if len(text) <= 200 else text[:197] + "..."


def _components(rel: str) -> list[str]:
    return [c for c in rel.replace("\\", "/").split("/") if c not in ("", ".")]


def relative_inside(root: str | os.PathLike, name: str) -> str | None:
    """``name`` as a path relative to ``root`` when it can name a file inside it, else None.

    Relative names are returned as they are; an absolute name counts when it
    lies under ``root``'s real path (string-wise: its symlinks are then resolved
    by the walk of :func:`open_inside`).

    >>> relative_inside("/data/m", "/data/m/w.bin"), relative_inside("/data/m", "/etc/passwd")
    ('w.bin', None)
    """
    if not os.path.isabs(name) and not name.startswith(("/", "\\")):
        return name
    base = os.path.realpath(os.fspath(root))
    full = os.path.normpath(name)
    for b in {base, os.path.normpath(os.path.abspath(os.fspath(root)))}:
        if full == b:
            return "."
        if full.startswith(b.rstrip(os.sep) + os.sep):
            return full[len(b.rstrip(os.sep)) + 1 :]
    return None


def _walk(root: str | os.PathLike, rel: str, where: str, entry: str, want_dir: bool) -> int:
    """An open descriptor of ``root/rel`` walked as the module docstring says (caller closes it)."""
    if not isinstance(rel, str) or not rel or "\0" in rel:
        raise OutsideError(f"{where}: {entry}: {_short(rel)} is not a file name", path=where, entry=entry)
    first = relative_inside(root, rel)
    if first is None:
        raise OutsideError(
            f"{where}: {entry}: {_short(rel)} is outside the input's folder {os.fspath(root)!r}",
            path=where,
            entry=entry,
        )
    base_real = os.path.realpath(os.fspath(root))
    try:
        root_fd = os.open(os.fspath(root), os.O_RDONLY | _O_DIRECTORY | _O_CLOEXEC)
    except OSError as e:
        raise MemberMissingError(
            f"{where}: {entry}: cannot open the input's folder: {e.strerror}", path=where, entry=entry
        ) from None
    stack = [root_fd]  # descriptors from the root down to the current folder
    todo = _components(first)
    todo.reverse()
    links = 0
    try:
        while todo:
            name = todo.pop()
            if name == "..":
                if len(stack) == 1:
                    raise OutsideError(
                        f"{where}: {entry}: {_short(rel)} climbs above the input's folder",
                        path=where,
                        entry=entry,
                    )
                os.close(stack.pop())
                continue
            last = not todo
            cur = stack[-1]
            try:
                st = os.stat(name, dir_fd=cur, follow_symlinks=False)
            except FileNotFoundError:
                raise MemberMissingError(
                    f"{where}: {entry}: {_short(rel)} does not exist (no {name!r})", path=where, entry=entry
                ) from None
            except OSError as e:
                raise MemberMissingError(
                    f"{where}: {entry}: {_short(rel)}: {e.strerror}", path=where, entry=entry
                ) from None
            if stat.S_ISLNK(st.st_mode):
                links += 1
                if links > MAX_SYMLINKS:
                    raise BadArchiveError(
                        f"{where}: {entry}: {_short(rel)}: more than {MAX_SYMLINKS} symlinks",
                        path=where,
                        entry=entry,
                    )
                try:
                    target = os.readlink(name, dir_fd=cur)
                except OSError as e:
                    raise MemberMissingError(
                        f"{where}: {entry}: {_short(rel)}: {e.strerror}", path=where, entry=entry
                    ) from None
                if os.path.isabs(target):
                    inner = relative_inside(base_real, target)
                    if inner is None:
                        raise OutsideError(
                            f"{where}: {entry}: {_short(rel)} is a symlink to {_short(target)}, "
                            f"outside the input's folder",
                            path=where,
                            entry=entry,
                        )
                    while len(stack) > 1:  # restart from the root
                        os.close(stack.pop())
                    parts = _components(inner)
                else:
                    parts = _components(target)
                todo.extend(reversed(parts))
                continue
            if not last or want_dir:
                try:
                    fd = os.open(name, _DIR_FLAGS, dir_fd=cur)
                except NotADirectoryError:
                    raise NotRegularError(
                        f"{where}: {entry}: {_short(rel)}: {name!r} is not a folder", path=where, entry=entry
                    ) from None
                except OSError as e:  # ELOOP: swapped for a symlink since the stat
                    raise OutsideError(
                        f"{where}: {entry}: {_short(rel)}: {name!r} changed while opened ({e.strerror})",
                        path=where,
                        entry=entry,
                    ) from None
                stack.append(fd)
                continue
            if not stat.S_ISREG(st.st_mode):  # refused before any open (a device open can act)
                raise NotRegularError(
                    f"{where}: {entry}: {_short(rel)} is {_kind(st.st_mode)}, not a regular file",
                    path=where,
                    entry=entry,
                )
            try:
                fd = os.open(name, _FILE_FLAGS, dir_fd=cur)
            except OSError as e:
                raise NotRegularError(
                    f"{where}: {entry}: {_short(rel)}: cannot open {name!r} ({e.strerror})",
                    path=where,
                    entry=entry,
                ) from None
            try:
                check_regular(fd, where, entry, rel)
            except BaseException:
                os.close(fd)
                raise
            return fd
        if not want_dir:
            raise NotRegularError(
                f"{where}: {entry}: {_short(rel)} is a folder, not a file", path=where, entry=entry
            )
        return os.dup(stack[-1])
    finally:
        for fd in stack:
            os.close(fd)


def _kind(mode: int) -> str:
    if stat.S_ISFIFO(mode):
        return "a FIFO"
    if stat.S_ISSOCK(mode):
        return "a socket"
    if stat.S_ISCHR(mode) or stat.S_ISBLK(mode):
        return "a device"
    if stat.S_ISDIR(mode):
        return "a folder"
    return "not a regular file"


def check_regular(fd: int, where: str, entry: str, name: object = None) -> os.stat_result:
    """``fstat(fd)``; raises :class:`NotRegularError` unless it is a regular file."""
    st = os.fstat(fd)
    if not stat.S_ISREG(st.st_mode):
        kind = _kind(st.st_mode)
        shown = _short(name) if name is not None else "the file"
        raise NotRegularError(
            f"{where}: {entry}: {shown} is {kind}, not a regular file", path=where, entry=entry
        )
    return st


def open_inside(root: str | os.PathLike, rel: str, *, where: str, entry: str = "file") -> int:
    """A read-only, non-blocking descriptor of the regular file ``rel`` inside ``root``.

    Parameters
    ----------
    root : str or os.PathLike
        The input's folder.
    rel : str
        The name the input gives (relative, or absolute under ``root``).
    where : str
        The input file, for messages.
    entry : str
        What names the file (a shard, an initializer, a leaf), for messages.

    Returns
    -------
    int
        An open descriptor; the caller closes it.

    Raises
    ------
    OutsideError
        An absolute name outside ``root``, ``..`` above it, a symlink leaving it.
    NotRegularError
        A FIFO, device, socket or folder.
    MemberMissingError
        No such file.
    """
    return _walk(root, rel, where, entry, want_dir=False)


def open_dir_inside(root: str | os.PathLike, rel: str, *, where: str, entry: str = "folder") -> int:
    """A descriptor of the folder ``rel`` inside ``root`` (``"."``: the root itself), walked
    like :func:`open_inside`; raises the same errors (:class:`NotRegularError` for a non-folder)."""
    if rel in (".", "./"):
        return os.open(os.fspath(root), os.O_RDONLY | _O_DIRECTORY | _O_CLOEXEC)
    return _walk(root, rel, where, entry, want_dir=True)


@contextmanager
def _closing(fd: int) -> Iterator[int]:
    try:
        yield fd
    finally:
        os.close(fd)


def read_inside(
    root: str | os.PathLike, rel: str, *, where: str, max_bytes: int, entry: str = "file"
) -> bytes:
    """The bytes of the regular file ``rel`` inside ``root`` (see :func:`open_inside`);
    a file larger than ``max_bytes`` is refused before anything is read."""
    with _closing(open_inside(root, rel, where=where, entry=entry)) as fd:
        size = os.fstat(fd).st_size
        if size > max_bytes:
            raise BadArchiveError(
                f"{where}: {entry}: {_short(rel)} holds {size} bytes (at most {max_bytes} read)",
                path=where,
                entry=entry,
            )
        chunks = []
        left = size
        while left > 0:
            b = os.read(fd, min(left, 1 << 24))
            if not b:
                break
            chunks.append(b)
            left -= len(b)
        return b"".join(chunks)


def map_fd(fd: int) -> tuple[mmap.mmap | None, int]:
    """A private (copy-on-write) mapping of the whole regular file ``fd`` and its size
    (``None`` for an empty file); the descriptor may be closed afterwards."""
    size = os.fstat(fd).st_size
    if size == 0:
        return None, 0
    return mmap.mmap(fd, size, access=mmap.ACCESS_COPY), size


def map_inside(
    root: str | os.PathLike, rel: str, *, where: str, entry: str = "file"
) -> tuple[mmap.mmap | None, int]:
    """The file ``rel`` inside ``root`` (see :func:`open_inside`) mapped privately: ``(mapping, size)``."""
    with _closing(open_inside(root, rel, where=where, entry=entry)) as fd:
        return map_fd(fd)
