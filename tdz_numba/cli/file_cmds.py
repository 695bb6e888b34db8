"""The ``tdz`` verbs that write files: ``pack``, ``unpack``, ``convert``, ``diff``, ``refresh``,
``clean``, ``repair`` and ``compact`` (the reading verbs are :mod:`tdz_numba.cli.commands`; each
takes the parsed arguments and returns the exit code).

Examples
--------
>>> import argparse
>>> from tdz_numba.cli.file_cmds import cmd_clean
>>> import tempfile
>>> with tempfile.TemporaryDirectory() as d:
...     cmd_clean(argparse.Namespace(directory=d, dry_run=True))  # doctest: +ELLIPSIS
/...: 0 stale temporary entries (dry run)
0
"""

from __future__ import annotations

import argparse
import os

from ..files.progress import progress
from .commands import (
    EXIT_FAILED,
    EXIT_OK,
    UsageError,
    archive_sizes,
    dir_sizes,
    plural,
    print_json,
    sizer,
    want_progress,
)

__all__ = [
    "cmd_pack",
    "cmd_unpack",
    "cmd_convert",
    "cmd_diff",
    "cmd_refresh",
    "cmd_clean",
    "cmd_repair",
    "cmd_compact",
]


def cmd_pack(args: argparse.Namespace) -> int:
    import tdz_numba

    if not os.path.isdir(args.directory):
        raise UsageError(f"{args.directory}: not a directory")
    files, nbytes = dir_sizes(args.directory)
    compression = None if args.compression == "stored" else args.compression
    out = tdz_numba.pack(
        args.directory,
        args.file,
        compression=compression,
        compresslevel=args.level,
        num_threads=args.threads,
        progress=want_progress(args),
    )
    size, nbytes_out = sizer(args), os.path.getsize(out)
    print(
        f"{out}: packed {plural(files, 'file')} ({size(nbytes)}) from {args.directory}, "
        f"{args.compression}, {size(nbytes_out)}"
    )
    return EXIT_OK


def cmd_unpack(args: argparse.Namespace) -> int:
    import tdz_numba

    sizes = archive_sizes(args.file)
    out = tdz_numba.unpack(args.file, args.directory, progress=want_progress(args))
    what = (
        f"{plural(sizes['entries'], 'entry', 'entries')} ({sizer(args)(sizes['payload_bytes'])})"
        if sizes
        else "entries"
    )
    print(f"{out}: unpacked {what} from {args.file}")
    return EXIT_OK


def cmd_convert(args: argparse.Namespace) -> int:
    import tdz_numba

    nest = None if args.flat else args.nest
    compression = None if args.compression == "stored" else args.compression
    out = tdz_numba.convert(
        args.src, args.dst, nest=nest, compression=compression, progress=want_progress(args)
    )
    if isinstance(out, str) and "://" in out:  # an fsspec URL (streamed there)
        import fsspec

        fs, where = fsspec.core.url_to_fs(out)
        size = int(fs.size(where))
    else:
        size = os.path.getsize(out)
    print(f"{out}: converted from {args.src}, {sizer(args)(size)}")
    return EXIT_OK


def cmd_diff(args: argparse.Namespace) -> int:
    import tdz_numba

    report = tdz_numba.diff(args.a, args.b, allow_pickle=args.allow_pickle)
    if args.json:
        print_json(
            {k: getattr(report, k) for k in ("a", "b", "added", "removed", "changed", "same", "details")}
        )
    else:
        print(report)
    return EXIT_FAILED if report else EXIT_OK


def cmd_refresh(args: argparse.Namespace) -> int:
    import tdz_numba

    sizes = archive_sizes(args.file)
    total = sizes["payload_bytes"] if sizes else None
    with progress(total, "refresh", enabled=want_progress(args)) as bar:
        out = tdz_numba.refresh_checksums(args.file)
        bar.finish()
    what = plural(sizes["stored_entries"], "stored entry", "stored entries") if sizes else "stored entries"
    print(f"{out}: CRC-32 of {what} re-stamped")
    return EXIT_OK


def cmd_clean(args: argparse.Namespace) -> int:
    from ..saving import clean

    removed = clean(args.directory, dry_run=args.dry_run)
    for path in removed:
        print(f"{'would remove' if args.dry_run else 'removed'} {path}")
    print(
        f"{args.directory}: {len(removed)} stale temporary {'entry' if len(removed) == 1 else 'entries'}"
        f"{' (dry run)' if args.dry_run else ''}"
    )
    return EXIT_OK


def cmd_repair(args: argparse.Namespace) -> int:
    from ..growing import repair

    r, size = repair(args.file), sizer(args)
    if r.action == "ok":
        print(f"{args.file}: committed, nothing to repair ({size(r.size)})")
    else:
        print(
            f"{args.file}: an uncommitted append removed: truncated from {size(r.old_size)} to {size(r.size)}"
        )
    return EXIT_OK


def cmd_compact(args: argparse.Namespace) -> int:
    from ..growing import compact

    before = os.path.getsize(args.file)
    out = compact(args.file)
    after, size = os.path.getsize(out), sizer(args)
    print(
        f"{out}: compacted from {size(before)} to {size(after)} ({size(before - after)} of superseded data removed)"
    )
    return EXIT_OK
