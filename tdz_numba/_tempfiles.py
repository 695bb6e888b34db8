"""Temporary files and directories beside a target, durable renames, stale-temp cleanup.

Every save (and unpack) writes to a temporary name in the target's directory
and renames it into place. The name says who made it::

    .{target name}.tdz-tmp.{host tag}.{pid}.{8 hex digits}

so that a later save in the same directory -- or ``tdz clean DIR`` /
:func:`clean` -- can remove the leftovers of processes that were killed
mid-write (kill -9, OOM killer, power loss): an entry is removed only when it
matches this exact pattern, was made on this host (the tag is a hash of the
host name), its process is no longer alive, and it has not been modified for
:data:`STALE_AGE` seconds. A live writer's temp file is never touched. On a
network file system shared by hosts, each host cleans only its own leftovers.

``durable`` writes ``fsync`` the file before ``os.replace`` and the directory
after it, so that a power loss leaves the old archive or the new one, never a
renamed but empty file.

Examples
--------
>>> import tempfile, pathlib
>>> from tdz_numba import _tempfiles
>>> with tempfile.TemporaryDirectory() as d:
...     fd, tmp = _tempfiles.create_temp_file(pathlib.Path(d), "x.tdz")
...     import os; os.close(fd)
...     print(_tempfiles.parse_temp_name(tmp.name)["name"], _tempfiles.clean(d))
x.tdz []
"""

from __future__ import annotations

import errno
import hashlib
import os
import re
import secrets
import shutil
import socket
import stat
import time
from pathlib import Path

__all__ = ["STALE_AGE", "temp_name", "parse_temp_name", "create_temp_file", "create_temp_dir", "clean",
           "fsync_directory", "reserve"]  # fmt: skip

#: Seconds without modification before a dead process's temp entry is removed.
STALE_AGE = 2.0

_MARK = ".tdz-tmp."
_PATTERN = re.compile(r"^\.(?P<name>.+)\.tdz-tmp\.(?P<host>[0-9a-f]{6})\.(?P<pid>[1-9][0-9]{0,9})\.[0-9a-f]{8}$",
                      re.DOTALL)  # fmt: skip


def _host_tag() -> str:
    return hashlib.sha1(socket.gethostname().encode("utf-8", "surrogateescape")).hexdigest()[:6]


def temp_name(name: str) -> str:
    """A fresh temporary name for the target file name ``name``."""
    return f".{name}{_MARK}{_host_tag()}.{os.getpid()}.{secrets.token_hex(4)}"


def parse_temp_name(name: str) -> dict[str, str] | None:
    """``{"name", "host", "pid"}`` of one of our temp names, else None."""
    m = _PATTERN.match(name)
    return m.groupdict() if m else None


def create_temp_file(directory: Path, name: str) -> tuple[int, Path]:
    """Creates (``O_EXCL | O_NOFOLLOW``, mode 0600) and opens a temp file beside ``directory/name``."""
    flags = os.O_RDWR | os.O_CREAT | os.O_EXCL | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_CLOEXEC", 0)
    for _ in range(100):
        path = Path(directory) / temp_name(name)
        try:
            return os.open(path, flags, 0o600), path
        except FileExistsError:
            continue
    raise FileExistsError(errno.EEXIST, "no free temporary name", str(directory))  # pragma: no cover


def create_temp_dir(directory: Path, name: str) -> Path:
    """Creates (mode 0700) a temp directory beside ``directory/name``."""
    for _ in range(100):
        path = Path(directory) / temp_name(name)
        try:
            os.mkdir(path, 0o700)
            return path
        except FileExistsError:
            continue
    raise FileExistsError(errno.EEXIST, "no free temporary name", str(directory))  # pragma: no cover


def _alive(pid: int) -> bool:
    if pid == os.getpid():
        return True
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except (PermissionError, OverflowError, OSError):
        return True  # exists (another user's) or cannot tell: keep
    return True


def clean(directory: str | os.PathLike, *, min_age: float = STALE_AGE, dry_run: bool = False) -> list[Path]:
    """Removes the temp files and directories that dead processes left in ``directory``.

    Only entries matching our temp-name pattern, made on this host, whose
    process is not alive and that were not modified for ``min_age`` seconds.
    Never follows symlinks. Returns the paths removed (or, with ``dry_run``,
    that would be).

    Examples
    --------
    >>> import tempfile
    >>> from tdz_numba._tempfiles import clean
    >>> with tempfile.TemporaryDirectory() as d:
    ...     print(clean(d))
    []
    """
    directory = Path(directory)
    host = _host_tag()
    now = time.time()
    removed: list[Path] = []
    try:
        entries = list(os.scandir(directory))
    except (FileNotFoundError, NotADirectoryError, PermissionError):
        return removed
    for entry in entries:
        if _MARK not in entry.name:
            continue
        info = parse_temp_name(entry.name)
        if info is None or info["host"] != host or _alive(int(info["pid"])):
            continue
        try:
            st = entry.stat(follow_symlinks=False)
        except FileNotFoundError:
            continue
        if now - st.st_mtime < min_age:
            continue
        if not (stat.S_ISREG(st.st_mode) or stat.S_ISDIR(st.st_mode)):
            continue
        if not dry_run:
            try:
                if stat.S_ISDIR(st.st_mode):
                    shutil.rmtree(entry.path)  # fd-based on Linux: never follows symlinks
                else:
                    os.unlink(entry.path)
            except FileNotFoundError:  # another process cleaned it first
                continue
            except OSError:
                continue  # not ours to remove (permissions): leave it
        removed.append(Path(entry.path))
    return removed


def fsync_directory(directory: Path) -> None:
    """``fsync`` a directory, making a rename in it durable (no-op where unsupported)."""
    try:
        fd = os.open(directory, os.O_RDONLY | getattr(os, "O_DIRECTORY", 0))
    except OSError:  # pragma: no cover - e.g. Windows
        return
    try:
        os.fsync(fd)
    except OSError as exc:  # some file systems refuse fsync on directories
        if exc.errno not in (errno.EINVAL, errno.ENOTSUP, errno.EBADF):
            raise
    finally:
        os.close(fd)


def reserve(fd: int, size: int) -> None:
    """Allocates ``size`` bytes for ``fd`` (``posix_fallocate``), so that writes through a
    mapping cannot hit a full disk later (SIGBUS). Raises ``OSError(ENOSPC)`` when the file
    system has no room; falls back to a sparse ``ftruncate`` where allocation is unsupported."""
    if size <= 0:
        os.ftruncate(fd, 0)
        return
    try:
        os.posix_fallocate(fd, 0, size)
    except OSError as exc:
        if exc.errno not in (errno.EOPNOTSUPP, errno.ENOTSUP, errno.EINVAL, errno.ENOSYS):
            raise
        os.ftruncate(fd, size)
    except AttributeError:  # pragma: no cover - no posix_fallocate (macOS)
        os.ftruncate(fd, size)
