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
from ..files.progress import human_bytes, stderr_is_tty

__all__ = [
    "cmd_info",
    "cmd_tree",
    "cmd_show",
    "cmd_verify",
    "cmd_warmup",
    "cmd_bench",
    "one_line",
    "want_progress",
    "plural",
    "sizer",
    "archive_sizes",
    "dir_sizes",
    "print_json",
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
#: Widest line the text outputs aim for.
WIDTH = 100
#: Formats whose root is a tensordict class (the others' "TensorDict" root is only a container).
_TD_FORMATS = ("tdz", "memmap_dir")


def plural(n: int, word: str, many: str | None = None) -> str:
    """``"1 level"``, ``"2 levels"``, ``"1 entry"``, ``"3 entries"`` (``many``: the plural, default ``word + "s"``).

    Examples
    --------
    >>> plural(1, "key"), plural(2, "leaf", "leaves")
    ('1 key', '2 leaves')
    """
    return f"{n} {word if n == 1 else (many or word + 's')}"


def sizer(args: argparse.Namespace) -> Any:
    """How a command prints byte counts: human sizes ("1.5 MiB"), or raw bytes with ``--bytes``."""
    if getattr(args, "bytes", False):
        return lambda n: f"{int(n)} B"
    return _human


def print_json(obj: Any) -> None:
    print(json.dumps(obj, indent=1))


def _cut(text: str, limit: int) -> str:
    return text if len(text) <= limit else text[: max(1, limit - 3)] + "..."


def _table(rows: list[list[str]], right: Sequence[int] = (), width: int = WIDTH) -> list[str]:
    """Rows as aligned columns; wider than ``width``, the key column is cut first (down to 24
    characters), then the widest other columns (down to 12), each cut cell ending in "..."."""
    if not rows:
        return []
    ncol = max(map(len, rows))
    widths = [max((len(r[i]) for r in rows if i < len(r)), default=0) for i in range(ncol)]
    full = list(widths)
    over = sum(widths) + 2 * (ncol - 1) - width
    if over > 0 and ncol > 1:
        cut = min(over, max(0, widths[0] - 24))
        widths[0] -= cut
        over -= cut
        while over > 0:
            i = max((i for i in range(1, ncol) if i not in right), key=lambda i: widths[i], default=None)
            if i is None or widths[i] <= 12:
                break
            cut = min(over, widths[i] - 12)
            widths[i] -= cut
            over -= cut
        rows = [[_cut(c, widths[i]) if widths[i] < full[i] else c for i, c in enumerate(r)] for r in rows]
    out = []
    for r in rows:
        cells = [(c.rjust(widths[i]) if i in right else c.ljust(widths[i])) for i, c in enumerate(r)]
        out.append("  ".join(cells).rstrip())
    return out


# -- info ------------------------------------------------------------------------------------


def _codecs(d: dict[str, Any]) -> str:
    return ", ".join(f"{k} x{v}" for k, v in sorted(d["compression"].items(), key=lambda kv: -kv[1])) or "-"


def _root_row(d: dict[str, Any]) -> list[list[str]]:
    """The ``root:`` row, only for tensordict's own formats (another file's root is a plain container)."""
    bs = f", batch_size={d['batch_size']}" if d["batch_size"] is not None else ""
    if d["format"] in _TD_FORMATS:
        return [["root:", d["root_type"] + bs]]
    return [["batch size:", str(d["batch_size"])]] if d["batch_size"] is not None else []


def cmd_info(args: argparse.Namespace) -> int:
    from .report import info_dict

    d = info_dict(args.file)
    if args.json:
        print_json(d)
        return EXIT_OK
    size = sizer(args)
    if d["format"] != "tdz":
        return _print_info_other(d, size)
    n_mm, n_stored = d["memmap_entries"], d["memmap_stored"]
    compressed = f"; {n_mm - n_stored} compressed (decoded, not mapped)" if n_mm > n_stored else ""
    if n_stored == 0:
        align = "no stored .memmap payloads" + compressed
    elif d["all_aligned"] is None:  # a URL: the local headers are not read
        align = f"not read (remote: local headers not fetched; a local copy shows it){compressed}"
    elif d["all_aligned"]:
        what = plural(n_stored, "stored .memmap payload" if compressed else ".memmap payload")
        align = f"all {what} {d['alignment']}-byte aligned{compressed}"
    else:
        n_bad = n_stored - d["memmap_aligned"]
        align = (
            f"{n_bad} of {plural(n_stored, 'stored .memmap payload')} NOT {d['alignment']}-byte aligned "
            f"(first: {d['misaligned'][0]}){compressed}"
        )
    ratio = f" ({d['stored_bytes'] / d['payload_bytes']:.1%} of it)" if d["payload_bytes"] else ""
    rows = [
        ["file:", d["path"]],
        ["format:", "tdz (a zip of a tensordict memmap directory)"],
        *_root_row(d),
        ["entries:", f"{d['entries']} ({plural(d['levels'], 'level')})"],
        ["leaves:", str(d["leaves"])],
        ["file size:", size(d["file_bytes"])],
        ["payload:", f"{size(d['payload_bytes'])} uncompressed"],
        ["stored:", f"{size(d['stored_bytes'])}{ratio}"],
        ["compression:", _codecs(d)],
        ["dtypes:", _dtypes(d)],
        ["alignment:", align],
    ]
    if d["metadata"]:
        rows.append(["metadata:", _one_line_text(repr(d["metadata"]), WIDTH - 15)])
    print("\n".join(_table(rows)))
    return EXIT_OK


def _dtypes(d: dict[str, Any]) -> str:
    """``float32 x3, uint8 (Q4_K) x2``: torch's names, the format's own in parentheses."""
    items = sorted(d.get("dtypes", {}).items(), key=lambda kv: (-kv[1], kv[0]))
    return _one_line_text(", ".join(f"{name} x{n}" for name, n in items), WIDTH - 15) or "-"


def _print_info_other(d: dict[str, Any], size: Any) -> int:
    files = f" in {d['files']} files" if d["files"] > 1 else ""
    rows = [
        ["file:", d["path"]],
        ["format:", d["format"]],
        *_root_row(d),
        ["leaves:", f"{d['leaves']} ({plural(d['levels'], 'level')})"],
        ["file size:", size(d["file_bytes"]) + files],
        ["payload:", size(d["payload_bytes"])],
        ["stored:", size(d["stored_bytes"])],
        ["compression:", _codecs(d)],
        ["dtypes:", _dtypes(d)],
        ["zero-copy:", f"{d['zero_copy_leaves']} of {plural(d['leaves'], 'leaf', 'leaves')}"],
    ]
    if d["metadata"]:
        rows.append(["metadata:", _one_line_text(repr(d["metadata"]), WIDTH - 15)])
    print("\n".join(_table(rows)))
    return EXIT_OK


def _one_line_text(text: str, limit: int) -> str:
    text = " ".join(text.split())
    return text if len(text) <= limit else text[: limit - 3] + "..."


# -- tree ------------------------------------------------------------------------------------


def leaf_dtype(d: dict[str, Any]) -> str:
    """A leaf's dtype in torch's words; quantized blocks (uint8) add the file's type: ``uint8 (Q4_K)``."""
    text = d["dtype"]
    if d.get("quantized"):
        text += f" ({d['type_name']})"
    return text + (" nested" if d["nested"] else "")


def _tree_rows(d: dict[str, Any], indent: int, rows: list[list[str]], size: Any) -> None:
    pad = "  " * indent
    name = d["key"] or "<root>"
    kind = d["kind"]
    if kind == "level":
        bs = f" batch_size={d['batch_size']}" if d.get("batch_size") else ""
        if d["children"] is None:
            rows.append([f"{pad}{name}/", d["type"], f"{plural(d['keys'], 'key')}{bs}", "", "..."])
            return
        rows.append([f"{pad}{name}/", d["type"], bs.strip(), "", ""])
        for child in d["children"]:
            _tree_rows(child, indent + 1, rows, size)
        if d.get("more"):
            rows.append([f"{pad}  ... {d['more']} more", "", "", "", ""])
    elif kind == "leaf":
        codec = d["codec"]
        if d["stored_nbytes"] != d["nbytes"]:
            codec += f" ({size(d['stored_nbytes'])} stored)"
        shape = d.get("shape_text") or str(d["shape"])
        rows.append([f"{pad}{name}", leaf_dtype(d), shape, size(d["nbytes"]), codec])
    elif kind in ("file", "pickle"):
        rows.append([f"{pad}{name}", kind, "", size(d["nbytes"]), ""])
    else:
        rows.append([f"{pad}{name}", d.get("type", "value"), _one_line_text(repr(d["value"]), 60), "", ""])


def cmd_tree(args: argparse.Namespace) -> int:
    from .report import tree_dict

    if args.depth is not None and args.depth < 0:
        raise UsageError("--depth must be >= 0")
    if args.max_leaves < 0:
        raise UsageError("--max-leaves must be >= 0 (0: no limit)")
    d = tree_dict(args.file, args.subpath, args.depth, args.max_leaves or None)
    if args.json:
        print_json(d)
        return EXIT_OK
    size = sizer(args)
    rows: list[list[str]] = []
    if d["kind"] == "level" and not args.subpath:
        what = d["format"]
        if d["format"] in _TD_FORMATS:
            what += f": {d['type']}"
        if d.get("batch_size") is not None:
            what += f", batch_size={d['batch_size']}"
        print(f"{args.file} ({what}; {plural(d['keys'], 'key')})")
        for child in d["children"] or []:
            _tree_rows(child, 0, rows, size)
        if d["children"] is None:
            rows.append([f"... {plural(d['keys'], 'key')}", "", "", "", ""])
        elif d.get("more"):
            rows.append([f"... {d['more']} more", "", "", "", ""])
    else:
        _tree_rows(d, 0, rows, size)
    print("\n".join(_table(rows, right=(3,))))
    if d.get("truncated"):
        print(
            f"(the first {plural(args.max_leaves, 'leaf', 'leaves')} shown; --max-leaves N for more, 0 for all)"
        )
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
    size = sizer(args)
    if args.json:
        if d["kind"] == "leaf":
            d["values"] = [json_float(v) if isinstance(v, float) else v for v in d["values"]]
            if d["stats"]:
                d["stats"] = {k: json_float(v) if isinstance(v, float) else v for k, v in d["stats"].items()}
        print_json(d)
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
                        ["size:", size(d["nbytes"])],
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
        shape = f"{d['shape']} ({plural(d['numel'], 'value')})"
    if d["offset"] is None:
        offset = "- (no payload entry: empty leaf)"
    else:
        stored_payload = d["compression"] == "stored"  # (a compressed one is decoded: alignment n/a)
        offset = (
            f"{d['offset']} ({'' if d['aligned'] else 'NOT '}64-byte aligned)"
            if stored_payload
            else str(d["offset"])
        )
    stored = size(d["stored_nbytes"])
    if d["nbytes"] and d["stored_nbytes"] != d["nbytes"]:
        stored += f", {d['stored_nbytes'] / d['nbytes']:.1%}"
    texts = [_fmt_num(v) for v in d["values"]]
    while len(texts) > 1 and len(", ".join(texts)) + 30 > WIDTH - 14:  # the row fits 100 columns
        texts.pop()
    shown = ", ".join(texts)
    more = f" ... ({d['numel'] - len(texts)} more)" if d["numel"] > len(texts) else ""
    rows = [
        ["key:", d["key"]],
        ["entry:", d["entry"] or "-"],
        ["dtype:", leaf_dtype(d)],
        ["shape:", shape],
        ["size:", size(d["nbytes"])],
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


def archive_sizes(path: str | os.PathLike) -> dict[str, int] | None:
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


def dir_sizes(directory: str | os.PathLike) -> tuple[int, int]:
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
        report = tdz_numba.verify(args.file, progress=want_progress(args), deep=getattr(args, "deep", False))
    except (TdzError, OSError) as exc:
        code = EXIT_FAILED if isinstance(exc, ChecksumError) else EXIT_USAGE
        if args.json:
            print_json(
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
        print_json(
            {
                "path": str(args.file),
                "ok": True,
                "entries": report.entries,
                "levels": report.levels,
                "leaves": report.leaves,
                "payload_bytes": report.payload_bytes,
                "format": report.format,
                "checksummed_bytes": report.checksummed_bytes,
                "unchecked_bytes": report.unchecked_bytes,
                "digests": report.digests,
            }
        )
    else:
        print(report.describe(sizer(args)))
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
