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

``durable`` writes ``fsync`` the file before the rename and the directory
after it, so that a power loss leaves the old archive or the new one, never a
renamed but empty file. A replaced file is freed off the caller's thread
(:func:`replace`).

Examples
--------
>>> import tempfile, pathlib
>>> from tdz_numba.files import tempfiles as _tempfiles
>>> with tempfile.TemporaryDirectory() as d:
...     fd, tmp = _tempfiles.create_temp_file(pathlib.Path(d), "x.tdz")
...     import os; os.close(fd)
...     print(_tempfiles.parse_temp_name(tmp.name)["name"], _tempfiles.clean(d))
x.tdz []
"""

from __future__ import annotations

import contextlib
import errno
import hashlib
import os
import re
import secrets
import socket
import stat
import threading
import time
from collections.abc import Iterator
from pathlib import Path

from . import libc

__all__ = [
    "STALE_AGE",
    "temp_name",
    "parse_temp_name",
    "create_temp_file",
    "create_temp_dir",
    "clean",
    "fsync_directory",
    "reserve",
    "start_writeback",
    "umask",
    "remove_tree",
    "atomic_file",
    "replace",
    "wait_released",
]

#: Seconds without modification before a dead process's temp entry is removed.
STALE_AGE = 2.0

_MARK = ".tdz-tmp."
_PATTERN = re.compile(
    r"^\.(?P<name>.+)\.tdz-tmp\.(?P<host>[0-9a-f]{6})\.(?P<pid>[1-9][0-9]{0,9})\.[0-9a-f]{8}$", re.DOTALL
)


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
    >>> from tdz_numba.files.tempfiles import clean
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
                    remove_tree(entry.path)  # iterative; never follows symlinks
                else:
                    os.unlink(entry.path)
            except FileNotFoundError:  # another process cleaned it first
                continue
            except OSError:
                continue  # not ours to remove (permissions): leave it
        removed.append(Path(entry.path))
    return removed


def umask() -> int:
    """The process umask, read without changing it where possible (``os.umask`` is
    process-wide: setting it to read it races with other threads creating files)."""
    try:
        with open("/proc/self/status", "rb") as f:
            for line in f:
                if line.startswith(b"Umask:"):
                    return int(line.split()[1], 8)
    except (OSError, ValueError, IndexError):
        pass
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


@contextlib.contextmanager
def atomic_file(target: Path, *, durable: bool = True) -> Iterator[int]:
    """A descriptor on a new temp file beside ``target`` that becomes ``target`` when the block
    ends without an exception: its mode set (``target``'s if it exists, else ``0o666 & ~umask``),
    ``fsync`` of the file (``durable``), then the rename, then ``fsync`` of the directory
    (``durable``). On an exception the temp file is removed and ``target`` is left as it was.
    Leftovers of killed writers (dead processes only) are removed first (:func:`clean`).

    Examples
    --------
    >>> import os, tempfile, pathlib
    >>> with tempfile.TemporaryDirectory() as d:
    ...     with atomic_file(pathlib.Path(d) / "x.bin", durable=False) as fd:
    ...         _ = os.write(fd, b"abc")
    ...     print(sorted(os.listdir(d)), (pathlib.Path(d) / "x.bin").read_bytes())
    ['x.bin'] b'abc'
    """
    target.parent.mkdir(parents=True, exist_ok=True)
    clean(target.parent)
    fd, tmp = create_temp_file(target.parent, target.name)
    try:
        yield fd
        mode = stat.S_IMODE(os.stat(target).st_mode) if target.exists() else 0o666 & ~umask()
        os.fchmod(fd, mode)
        if durable:
            os.fsync(fd)
        os.close(fd)
        fd = -1
        replace(tmp, target, exchange=not durable)
        if durable:
            fsync_directory(target.parent)
    except BaseException:
        if fd >= 0:
            os.close(fd)
        tmp.unlink(missing_ok=True)
        raise


#: ``renameat2`` flag: swap the two names atomically (Linux >= 3.15; ext4, xfs, btrfs, tmpfs).
_RENAME_EXCHANGE = 2
_AT_FDCWD = -100
_RELEASING: set[threading.Thread] = set()
_RELEASING_LOCK = threading.Lock()


def replace(tmp: Path, target: Path, *, exchange: bool = False) -> None:
    """``os.replace(tmp, target)``, the old ``target``'s blocks and cached pages freed off the
    calling thread.

    Unlinking the last name of a large file frees its page cache and extents in the
    ``unlink``/``rename`` call (~60 ms per 256 MiB cached here). When ``target`` is a regular file,
    a descriptor held on it (``O_PATH``) defers that to the last ``close``, which a thread does
    after the rename (:func:`wait_released` waits for it): the rename returns at once and the old
    file is gone from the directory when this returns. Readers that have it open or mapped keep
    reading it, as with a plain rename.

    ``exchange=True`` (saves with ``durable=False``) swaps the names with ``renameat2(...,
    RENAME_EXCHANGE)`` and unlinks the old file under the temp name, where the file system has it:
    ext4 flushes the new file's delayed blocks when a rename replaces an existing name
    (``auto_da_alloc``: ~90 ms per 256 MiB written here), a swap does not. Nothing is promised
    after a power loss then (as ``durable=False`` documents). A crash between the swap and the
    unlink leaves the old file under a temp name, which the next save's :func:`clean` removes.

    Examples
    --------
    >>> import tempfile, pathlib
    >>> with tempfile.TemporaryDirectory() as d:
    ...     old, new = pathlib.Path(d) / "x.bin", pathlib.Path(d) / "y.bin"
    ...     _ = old.write_bytes(b"old"); _ = new.write_bytes(b"new")
    ...     replace(new, old, exchange=True)
    ...     print(sorted(p.name for p in pathlib.Path(d).iterdir()), old.read_bytes(), wait_released(5))
    ['x.bin'] b'new' True
    """
    held = _hold(target)
    try:
        if not (exchange and held is not None and _swapped(tmp, target, held)):
            os.replace(tmp, target)
    except BaseException:
        if held is not None:
            os.close(held[0])
        raise
    if held is not None:
        _release(held[0])


def _hold(target: Path) -> tuple[int, int, int] | None:
    """``(descriptor, st_dev, st_ino)`` on ``target`` when it is a regular file (``O_PATH``: no
    read permission needed, a symbolic link is not followed), else None."""
    flags = getattr(os, "O_PATH", 0) | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_CLOEXEC", 0)
    if not flags & getattr(os, "O_PATH", 0):
        return None  # (no O_PATH: nothing to defer, the plain rename frees it)
    try:
        fd = os.open(target, flags)
    except OSError:
        return None
    try:
        st = os.fstat(fd)
    except OSError:
        os.close(fd)
        return None
    if not stat.S_ISREG(st.st_mode) or st.st_nlink != 1:
        os.close(fd)  # (a link, a directory, a file with other names: the rename frees nothing)
        return None
    return fd, st.st_dev, st.st_ino


def _swapped(tmp: Path, target: Path, held: tuple[int, int, int]) -> bool:
    """Swaps ``tmp`` and ``target`` and unlinks the old file now at ``tmp``; False (nothing
    changed) where the swap is not available or ``target`` is no longer the held file."""
    fn = libc.function("renameat2")
    if fn is None:
        return False
    a, b = os.fsencode(tmp), os.fsencode(target)
    if fn(_AT_FDCWD, a, _AT_FDCWD, b, _RENAME_EXCHANGE) != 0:
        return False  # (EINVAL: the file system cannot swap; ENOENT: target removed meanwhile)
    try:
        st = os.stat(tmp, follow_symlinks=False)
        ours = (st.st_dev, st.st_ino) == held[1:]
    except OSError:
        ours = False
    if not ours:  # another process put something else at target: swap back, rename as usual
        if fn(_AT_FDCWD, a, _AT_FDCWD, b, _RENAME_EXCHANGE) != 0:  # pragma: no cover - raced twice
            raise OSError(f"{target}: replaced by another process during the save; the new file is at {tmp}")
        return False
    os.unlink(tmp)
    return True


def _release(fd: int) -> None:
    """Closes ``fd`` on a thread (the last reference to a file without names: the kernel frees it
    there). Not a daemon: the interpreter's exit waits for it."""

    def run() -> None:
        try:
            os.close(fd)
        finally:
            with _RELEASING_LOCK:
                _RELEASING.discard(thread)

    thread = threading.Thread(target=run, name="tdz-free-replaced")
    with _RELEASING_LOCK:
        _RELEASING.add(thread)
    try:
        thread.start()
    except RuntimeError:  # (no new threads: interpreter shutdown) the close frees it here
        with _RELEASING_LOCK:
            _RELEASING.discard(thread)
        os.close(fd)


def wait_released(timeout: float | None = None) -> bool:
    """Waits until the files that :func:`replace` replaced are freed (at most ``timeout``
    seconds); whether all were.

    >>> wait_released(1)
    True
    """
    with _RELEASING_LOCK:
        pending = list(_RELEASING)
    for t in pending:
        t.join(timeout)
    return not any(t.is_alive() for t in pending)


def remove_tree(path: str | os.PathLike) -> None:
    """Removes a directory tree without recursion and without following symbolic links.

    Sub-directories are first renamed up into ``path`` (so that at most two
    directories are open at a time, whatever the depth), then emptied and
    removed. ``shutil.rmtree`` recurses once per level and fails on trees
    deeper than the recursion limit.
    """
    path = os.fspath(path)
    if not stat.S_ISDIR(os.lstat(path).st_mode):
        os.unlink(path)
        return
    flags = (
        os.O_RDONLY
        | getattr(os, "O_DIRECTORY", 0)
        | getattr(os, "O_NOFOLLOW", 0)
        | getattr(os, "O_CLOEXEC", 0)
    )
    root = os.open(path, flags)
    counter = 0
    try:
        while True:
            names = os.listdir(root)
            if not names:
                break
            for name in names:
                st = os.stat(name, dir_fd=root, follow_symlinks=False)
                if not stat.S_ISDIR(st.st_mode):
                    os.unlink(name, dir_fd=root)
                    continue
                sub = os.open(name, flags, dir_fd=root)
                try:
                    for child in os.listdir(sub):
                        if stat.S_ISDIR(os.stat(child, dir_fd=sub, follow_symlinks=False).st_mode):
                            while True:  # hoist it into the root under a fresh name
                                counter += 1
                                try:
                                    os.rename(child, f".rm{counter}", src_dir_fd=sub, dst_dir_fd=root)
                                    break
                                except OSError:
                                    if counter > 1 << 40:  # pragma: no cover
                                        raise
                        else:
                            os.unlink(child, dir_fd=sub)
                finally:
                    os.close(sub)
                os.rmdir(name, dir_fd=root)
    finally:
        os.close(root)
    os.rmdir(path)


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
    """Allocates ``size`` bytes for ``fd`` without writing them (Linux ``fallocate``:
    unwritten extents, instant), so that writes through a mapping cannot hit a full disk
    later (SIGBUS). Raises ``OSError(ENOSPC)`` when the file system has no room. Where
    the file system cannot allocate (``EOPNOTSUPP``), the file is left sparse: glibc's
    ``posix_fallocate`` emulation, which writes every block, is not used."""
    os.ftruncate(fd, size)
    if size <= 0:
        return
    fallocate = _libc_fallocate()
    if fallocate is None:  # pragma: no cover - not Linux
        try:
            os.posix_fallocate(fd, 0, size)
        except (OSError, AttributeError):
            pass
        return
    import ctypes

    if fallocate(fd, 0, ctypes.c_int64(0), ctypes.c_int64(size)) != 0:
        err = ctypes.get_errno()
        if err in (errno.EOPNOTSUPP, errno.ENOTSUP, errno.ENOSYS, errno.EINVAL):
            return
        raise OSError(err, os.strerror(err))


def start_writeback(fd: int) -> None:
    """Starts writing the file's dirty pages to the device without waiting (Linux
    ``sync_file_range(SYNC_FILE_RANGE_WRITE)``; a no-op elsewhere or on error).

    A durable save calls it every few MiB while it writes, so that its final
    ``fsync`` waits for the last pages only: measured on a 256 MiB save, write
    + ``fsync`` 264-293 ms without, 164-192 ms with (64 MiB: 62-66 -> 44-48 ms).
    It makes nothing durable by itself: the ``fsync`` still follows."""
    fn = _libc_sync_file_range()
    if fn is not None:
        import ctypes

        fn(fd, ctypes.c_int64(0), ctypes.c_int64(0), _SYNC_FILE_RANGE_WRITE)


_SYNC_FILE_RANGE_WRITE = 2
_SYNC_FILE_RANGE: list = []


def _libc_sync_file_range():
    if not _SYNC_FILE_RANGE:
        from . import libc

        _SYNC_FILE_RANGE.append(libc.function("sync_file_range"))
    return _SYNC_FILE_RANGE[0]


_FALLOCATE: list = []


def _libc_fallocate():
    if not _FALLOCATE:
        from . import libc

        _FALLOCATE.append(libc.function("fallocate64") or libc.function("fallocate"))
    return _FALLOCATE[0]
