"""The ``tdz`` command line: inspect, check, pack and benchmark ``.tdz`` archives.

Verbs: ``info``, ``tree``, ``show``, ``verify``, ``convert``, ``pack``, ``unpack``,
``refresh`` and ``bench`` (``tdz VERB --help`` for each).

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
    tdz bench --quick                  # the benchmark harness (see tdz_numba.bench)
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from collections.abc import Callable, Sequence
from typing import Any

from ..errors import ChecksumError, TdzError
from ..files.progress import human_bytes, progress, stderr_is_tty
from .report import SHOW_VALUES

__all__ = ["main", "build_parser"]

PROG = "tdz"
EXIT_OK, EXIT_FAILED, EXIT_USAGE = 0, 1, 2


# -- helpers --------------------------------------------------------------------------------


def _one_line(exc: BaseException) -> str:
    text = " ".join(str(exc).split())
    if isinstance(exc, (TdzError, _UsageError)):
        return text or type(exc).__name__
    return f"{type(exc).__name__}: {text}" if text else type(exc).__name__


_human = human_bytes


def _print_json(obj: Any) -> None:
    print(json.dumps(obj, indent=1))


def _table(rows: list[list[str]], right: Sequence[int] = ()) -> list[str]:
    if not rows:
        return []
    widths = [max(len(r[i]) for r in rows if i < len(r)) for i in range(max(map(len, rows)))]
    out = []
    for r in rows:
        cells = [(c.rjust(widths[i]) if i in right else c.ljust(widths[i])) for i, c in enumerate(r)]
        out.append("  ".join(cells).rstrip())
    return out


# -- info ------------------------------------------------------------------------------------


def cmd_info(args: argparse.Namespace) -> int:
    from .report import info_dict

    d = info_dict(args.file)
    if args.json:
        _print_json(d)
        return EXIT_OK
    if d["format"] != "tdz":
        return _print_info_other(d)
    codecs = ", ".join(f"{k} x{v}" for k, v in sorted(d["compression"].items(), key=lambda kv: -kv[1]))
    if d["memmap_entries"] == 0:
        align = "no .memmap payloads"
    elif d["all_aligned"]:
        align = f"all {d['memmap_entries']} .memmap payloads {d['alignment']}-byte aligned"
    else:
        n_bad = d["memmap_entries"] - d["memmap_aligned"]
        align = (
            f"{n_bad} of {d['memmap_entries']} .memmap payloads NOT {d['alignment']}-byte aligned "
            f"(first: {d['misaligned'][0]}; {d['misaligned_stored']} of them stored, "
            f"{n_bad - d['misaligned_stored']} compressed)"
        )
    root = d["root_type"] + (f", batch_size={d['batch_size']}" if d["batch_size"] is not None else "")
    ratio = f" ({d['stored_bytes'] / d['payload_bytes']:.1%} of it)" if d["payload_bytes"] else ""
    rows = [
        ["file:", d["path"]],
        ["root:", root],
        ["entries:", f"{d['entries']} ({d['levels']} levels)"],
        ["leaves:", str(d["leaves"])],
        ["file bytes:", f"{d['file_bytes']} ({_human(d['file_bytes'])})"],
        ["payload bytes:", f"{d['payload_bytes']} ({_human(d['payload_bytes'])}) uncompressed"],
        ["stored bytes:", f"{d['stored_bytes']} ({_human(d['stored_bytes'])}){ratio}"],
        ["compression:", codecs or "-"],
        ["alignment:", align],
    ]
    print("\n".join(_table(rows)))
    return EXIT_OK


def _print_info_other(d: dict[str, Any]) -> int:
    codecs = ", ".join(f"{k} x{v}" for k, v in sorted(d["compression"].items(), key=lambda kv: -kv[1]))
    root = d["root_type"] + (f", batch_size={d['batch_size']}" if d["batch_size"] is not None else "")
    rows = [
        ["file:", d["path"]],
        ["format:", d["format"]],
        ["root:", root],
        ["leaves:", f"{d['leaves']} ({d['levels']} levels)"],
        [
            "file bytes:",
            f"{d['file_bytes']} ({_human(d['file_bytes'])})"
            + (f" in {d['files']} files" if d["files"] > 1 else ""),
        ],
        ["payload bytes:", f"{d['payload_bytes']} ({_human(d['payload_bytes'])})"],
        ["stored bytes:", f"{d['stored_bytes']} ({_human(d['stored_bytes'])})"],
        ["compression:", codecs or "-"],
        ["zero-copy:", f"{d['zero_copy_leaves']} of {d['leaves']} leaves"],
    ]
    if d["metadata"]:
        rows.append(["metadata:", _one_line_text(repr(d["metadata"]), 100)])
    print("\n".join(_table(rows)))
    return EXIT_OK


def _one_line_text(text: str, limit: int) -> str:
    text = " ".join(text.split())
    return text if len(text) <= limit else text[: limit - 3] + "..."


# -- tree ------------------------------------------------------------------------------------


def _tree_rows(d: dict[str, Any], indent: int, rows: list[list[str]]) -> None:
    pad = "  " * indent
    name = d["key"] or "<root>"
    kind = d["kind"]
    if kind == "level":
        bs = f" batch_size={d['batch_size']}" if d.get("batch_size") else ""
        if d["children"] is None:
            rows.append([f"{pad}{name}/", d["type"], f"{d['keys']} keys{bs}", "", "..."])
            return
        rows.append([f"{pad}{name}/", d["type"], bs.strip(), "", ""])
        for child in d["children"]:
            _tree_rows(child, indent + 1, rows)
    elif kind == "leaf":
        codec = d["codec"]
        if d["stored_nbytes"] != d["nbytes"]:
            codec += f" ({d['stored_nbytes']} B stored)"
        dtype = d.get("type_name") or d["dtype"]
        dtype += " nested" if d["nested"] else ""
        rows.append(
            [f"{pad}{name}", dtype, d.get("shape_text") or str(d["shape"]), f"{d['nbytes']} B", codec]
        )
    elif kind in ("file", "pickle"):
        rows.append([f"{pad}{name}", kind, "", f"{d['nbytes']} B", ""])
    else:
        rows.append([f"{pad}{name}", d.get("type", "value"), _one_line_text(repr(d["value"]), 60), "", ""])


def cmd_tree(args: argparse.Namespace) -> int:
    from .report import tree_dict

    if args.depth is not None and args.depth < 0:
        raise _UsageError("--depth must be >= 0")
    d = tree_dict(args.file, args.subpath, args.depth)
    if args.json:
        _print_json(d)
        return EXIT_OK
    rows: list[list[str]] = []
    if d["kind"] == "level" and not args.subpath:
        bs = f", batch_size={d['batch_size']}" if d.get("batch_size") is not None else ""
        print(f"{args.file} ({d['type']}{bs})")
        for child in d["children"] or []:
            _tree_rows(child, 0, rows)
        if d["children"] is None:
            rows.append([f"... {d['keys']} keys", "", "", "", ""])
    else:
        _tree_rows(d, 0, rows)
    print("\n".join(_table(rows, right=(3,))))
    return EXIT_OK


# -- show ------------------------------------------------------------------------------------


def _fmt_num(x: Any) -> str:
    if x is None:
        return "-"
    if isinstance(x, bool) or isinstance(x, int):
        return str(x)
    if isinstance(x, float):
        text = f"{x:.6g}"
        return text if any(c in text for c in ".eni") else text + ".0"  # 1.0, 1e+20, nan, inf
    return str(x)


def cmd_show(args: argparse.Namespace) -> int:
    if args.values < 0:
        raise _UsageError("--values must be >= 0")
    from .report import json_float, show_dict

    d = show_dict(args.file, args.key, args.values)
    if args.json:
        if d["kind"] == "leaf":
            d["values"] = [json_float(v) if isinstance(v, float) else v for v in d["values"]]
            if d["stats"]:
                d["stats"] = {k: json_float(v) if isinstance(v, float) else v for k, v in d["stats"].items()}
        _print_json(d)
        return EXIT_OK
    if d["kind"] == "value":
        kind = f"non-tensor data ({d['type']})" if "type" in d else "plain value (NonTensorData)"
        print(
            "\n".join(
                _table(
                    [["key:", d["key"]], ["kind:", kind], ["value:", _one_line_text(repr(d["value"]), 2000)]]
                )
            )
        )
        return EXIT_OK
    if d["kind"] == "file":
        print(
            "\n".join(
                _table(
                    [
                        ["key:", d["key"]],
                        ["kind:", "file"],
                        ["entry:", d["entry"]],
                        ["nbytes:", f"{d['nbytes']} ({_human(d['nbytes'])})"],
                    ]
                )
            )
        )
        return EXIT_OK
    if d["nested"]:
        n, ndim = (d["shape"] + [0, 0])[:2]
        shapes = ", ".join(str(x) for x in d["nested_shapes"]) + (
            " ..." if n > len(d["nested_shapes"]) else ""
        )
        shape = f"nested: {n} tensors of {ndim} dims, {d['numel']} values ({shapes})"
    else:
        shape = f"{d['shape']} ({d['numel']} values)"
    if d["offset"] is None:
        offset = "- (no payload entry: empty leaf)"
    else:
        offset = f"{d['offset']} ({'' if d['aligned'] else 'NOT '}64-byte aligned)"
    stored = f"{d['stored_nbytes']} ({_human(d['stored_nbytes'])})"
    if d["nbytes"] and d["stored_nbytes"] != d["nbytes"]:
        stored += f", {d['stored_nbytes'] / d['nbytes']:.1%}"
    shown = ", ".join(_fmt_num(v) for v in d["values"])
    more = f" ... ({d['numel'] - len(d['values'])} more)" if d["numel"] > len(d["values"]) else ""
    rows = [
        ["key:", d["key"]],
        ["entry:", d["entry"] or "-"],
        ["dtype:", d["dtype"]],
        ["shape:", shape],
        ["nbytes:", f"{d['nbytes']} ({_human(d['nbytes'])})"],
        ["stored:", stored],
        ["offset:", offset],
        ["compression:", d["compression"]],
        ["crc:", d["crc"] or "-"],
        ["zero-copy:", "yes" if d["zero_copy"] else "no"],
        ["values:", f"[{shown}]{more}"],
    ]
    st = d["stats"]
    if st is not None and "std" in st:
        rows += [
            ["min:", _fmt_num(st["min"])],
            ["max:", _fmt_num(st["max"])],
            ["mean:", _fmt_num(st["mean"])],
            ["std:", _fmt_num(st["std"])],
            ["nan:", str(st["nan"])],
        ]
    elif st is not None:
        rows += [
            ["min:", _fmt_num(st["min"])],
            ["max:", _fmt_num(st["max"])],
            ["mean:", _fmt_num(st["mean"])],
        ]
    print("\n".join(_table(rows)))
    return EXIT_OK


# -- verify ----------------------------------------------------------------------------------


def _want_progress(args: argparse.Namespace) -> bool:
    flag = getattr(args, "progress", None)
    return stderr_is_tty() if flag is None else bool(flag)


def _archive_sizes(path: str | os.PathLike) -> dict[str, int] | None:
    """Entries, uncompressed payload bytes and STORED entries of an archive (None if unreadable:
    the command itself then reports the error)."""
    from tdz_numba.zipfmt import records
    from tdz_numba.zipfmt.index import ArchiveIndex

    try:
        index = ArchiveIndex(path)
    except (TdzError, OSError):
        return None
    try:
        table = index.table
        return {
            "entries": len(index.names),
            "payload_bytes": int(table["size"].sum()),
            "stored_entries": int((table["method"] == records.STORED).sum()),
        }
    finally:
        index.close()


def _dir_sizes(directory: str | os.PathLike) -> tuple[int, int]:
    files = nbytes = 0
    for root, _, names in os.walk(os.fspath(directory)):
        for name in names:
            try:
                nbytes += os.stat(os.path.join(root, name)).st_size
                files += 1
            except OSError:
                pass
    return files, nbytes


def cmd_verify(args: argparse.Namespace) -> int:
    import tdz_numba

    try:
        report = tdz_numba.verify(args.file, progress=_want_progress(args))
    except (TdzError, OSError) as exc:
        code = EXIT_FAILED if isinstance(exc, ChecksumError) else EXIT_USAGE
        if args.json:
            _print_json(
                {
                    "path": str(args.file),
                    "ok": False,
                    "error": _one_line(exc),
                    "error_type": type(exc).__name__,
                }
            )
        print(f"{PROG} verify: {_one_line(exc)}", file=sys.stderr)
        if getattr(args, "debug", False):
            import traceback

            traceback.print_exception(exc)
        return code
    if args.json:
        _print_json(
            {
                "path": str(args.file),
                "ok": True,
                "entries": report.entries,
                "levels": report.levels,
                "leaves": report.leaves,
                "payload_bytes": report.payload_bytes,
            }
        )
    else:
        print(report)
    return EXIT_OK


# -- pack / unpack / refresh -------------------------------------------------------------------


def cmd_pack(args: argparse.Namespace) -> int:
    import tdz_numba

    if not os.path.isdir(args.directory):
        raise _UsageError(f"{args.directory}: not a directory")
    files, nbytes = _dir_sizes(args.directory)
    compression = None if args.compression == "stored" else args.compression
    out = tdz_numba.pack(
        args.directory,
        args.file,
        compression=compression,
        compresslevel=args.level,
        num_threads=args.threads,
        progress=_want_progress(args),
    )
    size = os.path.getsize(out)
    print(
        f"{out}: packed {files} files ({_human(nbytes)}) from {args.directory}, "
        f"{args.compression}, {size} bytes ({_human(size)})"
    )
    return EXIT_OK


def cmd_unpack(args: argparse.Namespace) -> int:
    import tdz_numba

    sizes = _archive_sizes(args.file)
    out = tdz_numba.unpack(args.file, args.directory, progress=_want_progress(args))
    what = f"{sizes['entries']} entries ({_human(sizes['payload_bytes'])})" if sizes else "entries"
    print(f"{out}: unpacked {what} from {args.file}")
    return EXIT_OK


def cmd_convert(args: argparse.Namespace) -> int:
    import tdz_numba

    nest = None if args.flat else args.nest
    compression = None if args.compression == "stored" else args.compression
    out = tdz_numba.convert(
        args.src, args.dst, nest=nest, compression=compression, progress=_want_progress(args)
    )
    if isinstance(out, str) and "://" in out:  # an fsspec URL (streamed there)
        import fsspec

        fs, where = fsspec.core.url_to_fs(out)
        size = int(fs.size(where))
    else:
        size = os.path.getsize(out)
    print(f"{out}: converted from {args.src}, {size} bytes ({_human(size)})")
    return EXIT_OK


def cmd_refresh(args: argparse.Namespace) -> int:
    import tdz_numba

    sizes = _archive_sizes(args.file)
    total = sizes["payload_bytes"] if sizes else None
    with progress(total, "refresh", enabled=_want_progress(args)) as bar:
        out = tdz_numba.refresh_checksums(args.file)
        bar.finish()
    what = f"{sizes['stored_entries']} stored entries" if sizes else "stored entries"
    print(f"{out}: CRC-32 of {what} re-stamped")
    return EXIT_OK


def cmd_clean(args: argparse.Namespace) -> int:
    from ..api import clean

    removed = clean(args.directory, dry_run=args.dry_run)
    for path in removed:
        print(f"{'would remove' if args.dry_run else 'removed'} {path}")
    print(
        f"{args.directory}: {len(removed)} stale temporary {'entry' if len(removed) == 1 else 'entries'}"
        f"{' (dry run)' if args.dry_run else ''}"
    )
    return EXIT_OK


def cmd_warmup(args: argparse.Namespace) -> int:
    from .warmup import warmup

    warmup()
    return EXIT_OK


# -- bench -----------------------------------------------------------------------------------


def cmd_bench(argv: list[str]) -> int:
    from .. import bench

    return bench.main(argv, prog=f"{PROG} bench")


# -- parser and dispatch -----------------------------------------------------------------------


class _UsageError(Exception):
    """A bad argument found after parsing (exit 2)."""


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
    s.set_defaults(func=cmd_info)

    s = sub.add_parser(
        "tree",
        parents=[common],
        help="the nested tree: key, dtype, shape, bytes, codec",
        description="Print the nested tree of an archive (or of SUBPATH): key, dtype, "
        "shape, size in bytes and codec of every leaf.",
    )
    s.add_argument("file", help="the file: .tdz, safetensors, .pt, .npz, GGUF, HDF5, ONNX, memmap dir, ...")
    s.add_argument("subpath", nargs="?", default=None, help='a level or leaf, as "a/b"')
    s.add_argument("--depth", type=int, default=None, help="expand at most N levels (default: all)")
    s.add_argument("--json", action="store_true", help="print JSON")
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
    _progress_flag(s)
    s.set_defaults(func=cmd_unpack)

    s = sub.add_parser(
        "convert",
        parents=[common],
        help="convert any tensor file to .tdz (or .tdz to .safetensors)",
        description="Convert a readable tensor file (safetensors, torch .pt, .npz, GGUF, "
        "HDF5, ONNX, memmap directory, .tdz) to a .tdz archive through the "
        "parallel writer, or a .tdz archive to .safetensors (DST ending in "
        ".safetensors: nested keys joined with the separator, non-tensor "
        "values in __metadata__ as JSON).",
    )
    s.add_argument("src", metavar="SRC", help="the file to read")
    s.add_argument("dst", metavar="DST", help="the file to write (.tdz, or .safetensors)")
    g = s.add_mutually_exclusive_group()
    g.add_argument(
        "--nest",
        default=".",
        metavar="SEP",
        help="split flat names on SEP into levels (to .safetensors: join with it; default '.')",
    )
    g.add_argument("--flat", action="store_true", help="keep flat names as they are")
    s.add_argument(
        "--compression",
        choices=("stored", "deflate", "bzip2", "lzma"),
        default="stored",
        help="codec of the .tdz payloads (default: stored, zero-copy)",
    )
    _progress_flag(s)
    s.set_defaults(func=cmd_convert)

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
        elif isinstance(exc, (TdzError, OSError, _UsageError)):
            code = EXIT_USAGE
        else:
            code = EXIT_USAGE
            if not debug:
                print(f"{label}: internal error (run with --debug for the traceback)", file=sys.stderr)
        print(f"{label}: {_one_line(exc)}", file=sys.stderr)
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
