"""The ``tdz`` command line: its parser and dispatch (the verbs are :mod:`tdz_numba.cli.commands`).

Verbs: ``info``, ``tree``, ``show``, ``verify``, ``convert``, ``pack``, ``unpack``,
``refresh``, ``diff``, ``append``, ``repair``, ``compact`` and ``bench`` (``tdz VERB --help`` for each).

Exit codes: 0 success, 1 a check failed (a CRC-32 mismatch), 2 a usage error
or a file that is not a readable archive. Errors are printed on stderr as one
line; ``--debug`` adds the traceback. Importing this module imports neither
torch nor numba: they load when a command runs.

Examples
--------
::

    tdz info buffer.tdz                # entries, leaves, bytes, codecs, alignment, root class
    tdz tree buffer.tdz obs --depth 1  # the nested tree below "obs"
    tdz show buffer.tdz obs/depth      # one leaf: storage, first values, min/max/mean/std, NaNs
    tdz verify buffer.tdz --json       # CRC-32 of every entry + structure
    tdz unpack buffer.tdz buffer_dir   # a tensordict memmap directory
    tdz pack buffer_dir again.tdz --compression deflate
    tdz refresh buffer.tdz             # re-stamp CRCs after mode="r+" writes
    tdz diff a.tdz b.safetensors       # leaves added, removed, changed
    tdz append buffer.tdz ep7.safetensors --subpath ep/7   # leaves of any file, no rewrite
    tdz repair buffer.tdz              # undo an append killed before its commit
    tdz compact buffer.tdz             # drop the bytes appends superseded
    tdz bench --quick                  # the benchmark harness (see tdz_numba.bench)
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Callable, Sequence

from ..errors import ChecksumError, TdzError
from .commands import (
    EXIT_FAILED,
    EXIT_OK,
    EXIT_USAGE,
    PROG,
    UsageError,
    cmd_bench,
    cmd_info,
    cmd_show,
    cmd_tree,
    cmd_verify,
    cmd_warmup,
    one_line,
)
from .file_cmds import (
    cmd_clean,
    cmd_compact,
    cmd_convert,
    cmd_diff,
    cmd_pack,
    cmd_refresh,
    cmd_repair,
    cmd_unpack,
)
from .report import SHOW_VALUES

#: Leaves (and values) ``tdz tree`` lists by default.
MAX_LEAVES = 200

__all__ = ["main", "build_parser"]


def build_parser() -> argparse.ArgumentParser:
    from .. import __version__

    common = argparse.ArgumentParser(add_help=False)
    common.add_argument(
        "--debug", action="store_true", default=argparse.SUPPRESS, help="print the traceback of an error"
    )

    p = argparse.ArgumentParser(
        prog=PROG,
        description="Inspect, check, pack and benchmark .tdz tensor archives (tdz_numba).",
        epilog="exit codes: 0 ok, 1 check failed, 2 usage error or bad file",
    )
    p.add_argument("--debug", action="store_true", default=False, help="print the traceback of an error")
    p.add_argument("--version", action="version", version=f"%(prog)s (tdz_numba) {__version__}")
    sub = p.add_subparsers(dest="command", metavar="COMMAND")
    sub.required = True

    s = sub.add_parser(
        "info",
        parents=[common],
        help="entries, leaves, bytes, codecs, alignment, root class",
        description="Summary of an archive: entries, leaves, bytes, compression methods, "
        "64-byte alignment of every .memmap payload, root class.",
    )
    s.add_argument("file", help="the file: .tdz, safetensors, .pt, .npz, GGUF, HDF5, ONNX, memmap dir, ...")
    s.add_argument("--json", action="store_true", help="print JSON")
    _bytes_flag(s)
    s.set_defaults(func=cmd_info)

    s = sub.add_parser(
        "tree",
        parents=[common],
        help="the nested tree: key, dtype, shape, size, codec",
        description="Print the nested tree of an archive (or of SUBPATH): key, dtype, "
        "shape, size and codec of every leaf (the first --max-leaves of them).",
    )
    s.add_argument("file", help="the file: .tdz, safetensors, .pt, .npz, GGUF, HDF5, ONNX, memmap dir, ...")
    s.add_argument("subpath", nargs="?", default=None, help='a level or leaf, as "a/b"')
    s.add_argument("--depth", type=int, default=None, help="expand at most N levels (default: all)")
    s.add_argument(
        "--max-leaves",
        type=int,
        default=MAX_LEAVES,
        metavar="N",
        help=f"list at most N leaves and values, then '... K more' (default {MAX_LEAVES}; 0: all)",
    )
    s.add_argument("--json", action="store_true", help="print JSON")
    _bytes_flag(s)
    s.set_defaults(func=cmd_tree)

    s = sub.add_parser(
        "show",
        parents=[common],
        help="one leaf: storage, first values, statistics",
        description="Show one leaf of an archive: entry name, dtype, shape, bytes, offset, "
        "compression, CRC-32, the first values (flattened) and summary "
        "statistics: min/max/mean/std (float64, population std, NaNs "
        "excluded) and the NaN count for floating dtypes; min/max/mean for "
        "integer and bool dtypes. Compressed leaves are inflated.",
    )
    s.add_argument("file", help="the file: .tdz, safetensors, .pt, .npz, GGUF, HDF5, ONNX, memmap dir, ...")
    s.add_argument("key", help='the leaf, as "a/b/c"')
    s.add_argument(
        "--values",
        type=int,
        default=SHOW_VALUES,
        metavar="N",
        help=f"print the first N values (default {SHOW_VALUES})",
    )
    s.add_argument("--json", action="store_true", help="print JSON")
    _bytes_flag(s)
    s.set_defaults(func=cmd_show)

    s = sub.add_parser(
        "verify",
        parents=[common],
        help="check every entry's CRC-32 and the structure",
        description="Check every entry's CRC-32 and the archive's structure. "
        "Exit 0 ok, 1 CRC mismatch, 2 bad or unreadable file.",
    )
    s.add_argument("file", help="the file: .tdz, safetensors, .pt, .npz, GGUF, HDF5, ONNX, memmap dir, ...")
    s.add_argument("--json", action="store_true", help="print JSON")
    s.add_argument(
        "--deep",
        action="store_true",
        help="also recompute every leaf's stored XXH3-128 digest (archives saved with digest=True)",
    )
    _bytes_flag(s)
    _progress_flag(s)
    s.set_defaults(func=cmd_verify)

    s = sub.add_parser(
        "pack",
        parents=[common],
        help="pack a tensordict memmap directory into an archive",
        description="Pack a tensordict memmap directory (as written by tensordict's "
        "memmap() or by `tdz unpack`) into a .tdz archive, like `zip -0 -r` "
        "with 64-byte-aligned payloads. An existing FILE is replaced.",
    )
    s.add_argument("directory", metavar="DIR", help="the memmap directory (with a meta.json)")
    s.add_argument("file", metavar="FILE", help="the .tdz archive to write")
    s.add_argument(
        "--compression",
        choices=("stored", "deflate", "bzip2", "lzma"),
        default="stored",
        help="codec of the .memmap payloads (default: stored, zero-copy)",
    )
    s.add_argument("--level", type=int, default=None, help="compression level passed to the codec")
    s.add_argument("--threads", type=int, default=None, help="threads for CRC-32 and deflate (default: all)")
    _bytes_flag(s)
    _progress_flag(s)
    s.set_defaults(func=cmd_pack)

    s = sub.add_parser(
        "unpack",
        parents=[common],
        help="extract an archive into a memmap directory",
        description="Extract an archive into a memmap directory that tensordict's "
        "load_memmap reads (like `unzip`). CRC-32s are checked.",
    )
    s.add_argument("file", metavar="FILE", help="the .tdz archive")
    s.add_argument("directory", metavar="DIR", help="the directory to create (or fill)")
    _bytes_flag(s)
    _progress_flag(s)
    s.set_defaults(func=cmd_unpack)

    s = sub.add_parser(
        "convert",
        parents=[common],
        help="convert any tensor file to .tdz or .safetensors (keys and metadata kept)",
        description="Convert a readable tensor file (safetensors, torch .pt, .npz, GGUF, "
        "HDF5, ONNX, memmap directory, .tdz) to a .tdz archive through the "
        "parallel writer (DST ending in .tdz or without a suffix) or to a safetensors "
        "file (DST ending in .safetensors: nested keys joined with '.' or SEP, non-tensor "
        "values in __metadata__ as JSON); any other suffix is refused. Keys stay as the "
        "source names them and its metadata is carried over.",
    )
    s.add_argument("src", metavar="SRC", help="the file to read")
    s.add_argument("dst", metavar="DST", help="the file to write (.tdz, or .safetensors)")
    g = s.add_mutually_exclusive_group()
    g.add_argument(
        "--nest",
        default=None,
        metavar="SEP",
        help="split flat names on SEP into levels (to .safetensors: join with it; default: keys kept)",
    )
    g.add_argument("--flat", action="store_true", help="keep flat names as they are (the default)")
    s.add_argument(
        "--compression",
        choices=("stored", "deflate", "bzip2", "lzma"),
        default="stored",
        help="codec of the .tdz payloads (default: stored, zero-copy)",
    )
    _bytes_flag(s)
    _progress_flag(s)
    s.set_defaults(func=cmd_convert)

    s = sub.add_parser(
        "diff",
        parents=[common],
        help="compare the tensor leaves of two files (any formats)",
        description="List the leaves added, removed and changed from A to B (dtype, shape or bytes; "
        "digests or CRC-32s first where both files have them). Exit code 0 when every leaf is "
        "the same, 1 when the files differ.",
    )
    s.add_argument("a", metavar="A", help="the first file")
    s.add_argument("b", metavar="B", help="the second file")
    s.add_argument("--json", action="store_true", help="print the report as JSON")
    s.add_argument("--allow-pickle", action="store_true", help="unpickle .pickle entries of both files")
    s.set_defaults(func=cmd_diff)

    s = sub.add_parser(
        "refresh",
        parents=[common],
        help="re-stamp CRC-32s after mode='r+' writes",
        description="Recompute and re-stamp the CRC-32 of every stored entry in place, "
        "after leaves were written through tdz_numba.open(FILE, mode='r+'), "
        "so that `tdz verify` and `unzip -t` pass again.",
    )
    s.add_argument("file", metavar="FILE", help="the .tdz archive (modified in place)")
    _progress_flag(s)
    s.set_defaults(func=cmd_refresh)

    s = sub.add_parser(
        "clean",
        parents=[common],
        help="remove temp files left by killed saves and unpacks",
        description="Remove the temporary files and directories (.NAME.tdz-tmp.HOST.PID.RANDOM) "
        "that saves and unpacks killed mid-write left in DIR: only those made on "
        "this host by processes that are no longer running.",
    )
    s.add_argument("directory", metavar="DIR", help="the directory to clean")
    s.add_argument("--dry-run", action="store_true", help="list what would be removed")
    s.set_defaults(func=cmd_clean)

    s = sub.add_parser(
        "repair",
        parents=[common],
        help="truncate a file an append was killed in to its last committed state",
        description="After a crash during tdz_numba.append, the file ends with a copy of the old "
        "end record (tdz_numba reads it, zip tools do not): truncate it back to the old bytes.",
    )
    s.add_argument("file", metavar="FILE", help="the .tdz archive (modified in place)")
    _bytes_flag(s)
    s.set_defaults(func=cmd_repair)

    s = sub.add_parser(
        "compact",
        parents=[common],
        help="rewrite an archive without the bytes appends superseded",
        description="Rewrite FILE (atomically, as save does) with only its live entries.",
    )
    s.add_argument("file", metavar="FILE", help="the .tdz archive (replaced atomically)")
    _bytes_flag(s)
    s.set_defaults(func=cmd_compact)

    from .append_cmd import add_parser as _add_append

    _bytes_flag(_add_append(sub, common))

    s = sub.add_parser(
        "warmup",
        parents=[common],
        help="compile every Numba kernel into the cache ahead of time",
        description="Compile every kernel family (CRC, layout, index, deflate/inflate, "
        "dequantize, memory pages) into Numba's on-disk cache, e.g. in a Docker "
        "build or a conda post-link step, and print what was compiled and where "
        "the cache is.",
    )
    s.set_defaults(func=cmd_warmup)

    sub.add_parser(
        "bench",
        add_help=False,
        help="benchmark against tensordict, torch, safetensors (tdz bench --help for options)",
    )
    return p


def _bytes_flag(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--bytes", action="store_true", help="print sizes as raw byte counts (default: human, 1.5 MiB)"
    )


def _progress_flag(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--progress",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="show a progress bar on stderr (default: only when stderr is a terminal; needs tqdm)",
    )


def _guard(fn: Callable[[], int], debug: bool, label: str) -> int:
    try:
        return int(fn() or 0)
    except KeyboardInterrupt:
        print(f"{label}: interrupted", file=sys.stderr)
        return 130
    except BrokenPipeError:
        # the reader went away (tdz tree x.tdz | head): stop quietly
        try:
            devnull = os.open(os.devnull, os.O_WRONLY)
            os.dup2(devnull, sys.stdout.fileno())
        except OSError:
            pass
        return EXIT_OK
    except SystemExit as exc:  # argparse inside bench
        return exc.code if isinstance(exc.code, int) else (0 if exc.code is None else EXIT_USAGE)
    except Exception as exc:
        if debug:
            import traceback

            traceback.print_exc()
        if isinstance(exc, ChecksumError):
            code = EXIT_FAILED
        elif isinstance(exc, (TdzError, OSError, UsageError)):
            code = EXIT_USAGE
        else:
            code = EXIT_USAGE
            if not debug:
                print(f"{label}: internal error (run with --debug for the traceback)", file=sys.stderr)
        print(f"{label}: {one_line(exc)}", file=sys.stderr)
        return code


def main(argv: Sequence[str] | None = None) -> int:
    """Runs ``tdz`` with ``argv`` (default ``sys.argv[1:]``) and returns the exit code."""
    argv = list(sys.argv[1:] if argv is None else argv)
    # `tdz [--debug] bench ...`: everything after "bench" belongs to the bench parser
    i = 0
    while i < len(argv) and argv[i] == "--debug":
        i += 1
    if i < len(argv) and argv[i] == "bench":
        rest = argv[i + 1 :]
        debug = i > 0 or "--debug" in rest
        rest = [a for a in rest if a != "--debug"]
        return _guard(lambda: cmd_bench(rest), debug, f"{PROG} bench")

    parser = build_parser()
    try:
        args = parser.parse_args(argv)
    except SystemExit as exc:  # --help, --version, usage errors (already printed)
        return exc.code if isinstance(exc.code, int) else (0 if exc.code is None else EXIT_USAGE)
    debug = bool(getattr(args, "debug", False))
    label = f"{PROG} {args.command}"
    return _guard(lambda: args.func(args), debug, label)


if __name__ == "__main__":
    raise SystemExit(main())
