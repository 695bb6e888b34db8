"""The ``tdz`` verbs: one ``cmd_*`` function per verb, each taking the parsed arguments and
returning the exit code (:mod:`tdz_numba.cli.command` parses and dispatches).

Examples
--------
>>> from tdz_numba.cli.commands import EXIT_OK, EXIT_FAILED, EXIT_USAGE
>>> EXIT_OK, EXIT_FAILED, EXIT_USAGE
(0, 1, 2)
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from collections.abc import Sequence
from typing import Any

from ..errors import ChecksumError, TdzError
from ..files.progress import human_bytes, progress, stderr_is_tty

__all__ = [
    "cmd_info",
    "cmd_tree",
    "cmd_show",
    "cmd_verify",
    "cmd_pack",
    "cmd_unpack",
    "cmd_convert",
    "cmd_refresh",
    "cmd_clean",
    "cmd_warmup",
    "cmd_bench",
    "one_line",
    "want_progress",
    "UsageError",
    "PROG",
    "EXIT_OK",
    "EXIT_FAILED",
    "EXIT_USAGE",
]

PROG = "tdz"
EXIT_OK, EXIT_FAILED, EXIT_USAGE = 0, 1, 2


# -- helpers --------------------------------------------------------------------------------


def one_line(exc: BaseException) -> str:
    text = " ".join(str(exc).split())
    if isinstance(exc, (TdzError, UsageError)):
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
        raise UsageError("--depth must be >= 0")
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
        raise UsageError("--values must be >= 0")
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


def want_progress(args: argparse.Namespace) -> bool:
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
        report = tdz_numba.verify(args.file, progress=want_progress(args))
    except (TdzError, OSError) as exc:
        code = EXIT_FAILED if isinstance(exc, ChecksumError) else EXIT_USAGE
        if args.json:
            _print_json(
                {
                    "path": str(args.file),
                    "ok": False,
                    "error": one_line(exc),
                    "error_type": type(exc).__name__,
                }
            )
        print(f"{PROG} verify: {one_line(exc)}", file=sys.stderr)
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
        raise UsageError(f"{args.directory}: not a directory")
    files, nbytes = _dir_sizes(args.directory)
    compression = None if args.compression == "stored" else args.compression
    out = tdz_numba.pack(
        args.directory,
        args.file,
        compression=compression,
        compresslevel=args.level,
        num_threads=args.threads,
        progress=want_progress(args),
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
    out = tdz_numba.unpack(args.file, args.directory, progress=want_progress(args))
    what = f"{sizes['entries']} entries ({_human(sizes['payload_bytes'])})" if sizes else "entries"
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
    print(f"{out}: converted from {args.src}, {size} bytes ({_human(size)})")
    return EXIT_OK


def cmd_refresh(args: argparse.Namespace) -> int:
    import tdz_numba

    sizes = _archive_sizes(args.file)
    total = sizes["payload_bytes"] if sizes else None
    with progress(total, "refresh", enabled=want_progress(args)) as bar:
        out = tdz_numba.refresh_checksums(args.file)
        bar.finish()
    what = f"{sizes['stored_entries']} stored entries" if sizes else "stored entries"
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


def cmd_warmup(args: argparse.Namespace) -> int:
    from .warmup import warmup

    warmup()
    return EXIT_OK


# -- bench -----------------------------------------------------------------------------------


def cmd_bench(argv: list[str]) -> int:
    from .. import bench

    return bench.main(argv, prog=f"{PROG} bench")


# -- parser and dispatch -----------------------------------------------------------------------


class UsageError(Exception):
    """A bad argument found after parsing (exit 2)."""
