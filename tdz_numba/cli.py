"""The ``tdz`` command line: ``info``, ``tree``, ``verify`` and ``bench``.

Exit codes: 0 success, 1 a check failed (a CRC-32 mismatch), 2 a usage error
or a file that is not a readable archive. Errors are printed on stderr as one
line; ``--debug`` adds the traceback. Importing this module imports neither
torch nor numba: they load when a command runs.

Examples
--------
::

    tdz info buffer.tdz               # entries, leaves, bytes, codecs, alignment, root class
    tdz tree buffer.tdz obs --depth 1  # the nested tree below "obs"
    tdz verify buffer.tdz --json      # CRC-32 of every entry + structure
    tdz bench --quick                  # the benchmark harness (see tdz_numba.bench)
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from collections.abc import Callable, Sequence
from typing import Any

from .errors import ChecksumError, TdzError

__all__ = ["main", "build_parser"]

PROG = "tdz"
EXIT_OK, EXIT_FAILED, EXIT_USAGE = 0, 1, 2


# -- helpers --------------------------------------------------------------------------------


def _one_line(exc: BaseException) -> str:
    text = " ".join(str(exc).split())
    if isinstance(exc, (TdzError, _UsageError)):
        return text or type(exc).__name__
    return f"{type(exc).__name__}: {text}" if text else type(exc).__name__


def _human(n: int) -> str:
    value = float(n)
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if value < 1024 or unit == "TiB":
            return f"{n} B" if unit == "B" else f"{value:.1f} {unit}"
        value /= 1024
    return f"{n} B"  # pragma: no cover


def _dtype_name(dtype: Any) -> str:
    return str(dtype).replace("torch.", "")


def _jsonable(value: Any) -> Any:
    try:
        json.dumps(value)
    except (TypeError, ValueError):
        return repr(value)
    return value


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


def info_dict(path: str | os.PathLike) -> dict[str, Any]:
    """What ``tdz info`` reports, as a dict."""
    import tdz_numba
    from tdz_numba import records

    ar = tdz_numba.open(path)
    try:
        index = ar._index
        index.check_all()  # payload offsets of every entry
        names = index.names
        fields = index.fields
        methods: dict[str, int] = {}
        for m in fields[:, 1].tolist():
            name = records.METHOD_NAMES.get(int(m), f"method {m}")
            methods[name] = methods.get(name, 0) + 1
        memmaps = [i for i, n in enumerate(names) if n.endswith(".memmap")]
        misaligned = [names[i] for i in memmaps if int(fields[i, 8]) % records.ALIGNMENT]
        compressed = sum(1 for i in memmaps if int(fields[i, 1]) != records.STORED)
        misaligned_stored = sum(
            1 for i in memmaps if int(fields[i, 1]) == records.STORED and int(fields[i, 8]) % records.ALIGNMENT
        )
        leaves = sum(1 for _ in ar.leaves())
        return {
            "path": str(path),
            "root_type": ar.type_name,
            "batch_size": ar.batch_size,
            "entries": len(names),
            "levels": sum(1 for n in names if n == "meta.json" or n.endswith("/meta.json")),
            "leaves": leaves,
            "file_bytes": int(index.size),
            "payload_bytes": int(fields[:, 4].sum()) if len(names) else 0,
            "stored_bytes": int(fields[:, 3].sum()) if len(names) else 0,
            "compression": methods,
            "alignment": records.ALIGNMENT,
            "memmap_entries": len(memmaps),
            "memmap_aligned": len(memmaps) - len(misaligned),
            "all_aligned": not misaligned,
            "misaligned": misaligned[:20],
            "misaligned_stored": misaligned_stored,
            "memmap_compressed": compressed,
        }
    finally:
        ar.close()


def cmd_info(args: argparse.Namespace) -> int:
    d = info_dict(args.file)
    if args.json:
        _print_json(d)
        return EXIT_OK
    codecs = ", ".join(f"{k} x{v}" for k, v in sorted(d["compression"].items(), key=lambda kv: -kv[1]))
    if d["memmap_entries"] == 0:
        align = "no .memmap payloads"
    elif d["all_aligned"]:
        align = f"all {d['memmap_entries']} .memmap payloads {d['alignment']}-byte aligned"
    else:
        n_bad = d["memmap_entries"] - d["memmap_aligned"]
        align = (f"{n_bad} of {d['memmap_entries']} .memmap payloads NOT {d['alignment']}-byte aligned "
                 f"(first: {d['misaligned'][0]}; {d['misaligned_stored']} of them stored, "
                 f"{n_bad - d['misaligned_stored']} compressed)")  # fmt: skip
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


# -- tree ------------------------------------------------------------------------------------


def _node_dict(node: Any, key: str, path: str, depth: int, max_depth: int | None) -> dict[str, Any]:
    """The JSON-able description of one child ``key`` of the level ``node``."""
    from tdz_numba import Archive, MissingKeyError
    from tdz_numba.tree import PickledData, RawFile

    try:
        info = node.info(key)
    except MissingKeyError:
        pass
    else:
        return {"key": key, "path": path, "kind": "leaf", "dtype": _dtype_name(info.dtype),
                "shape": list(info.shape), "nbytes": info.nbytes, "stored_nbytes": info.stored_nbytes,
                "codec": info.compression, "offset": info.offset,
                "crc": None if info.crc is None else f"{info.crc:#010x}", "nested": info.nested,
                "entry": info.entry}  # fmt: skip
    value = node[key]
    if isinstance(value, Archive):
        return _level_dict(value, key, path, depth, max_depth)
    if isinstance(value, RawFile):
        kind = "pickle" if isinstance(value, PickledData) else "file"
        return {"key": key, "path": path, "kind": kind, "nbytes": len(value.data)}
    return {"key": key, "path": path, "kind": "value", "value": _jsonable(value)}


def _level_dict(level: Any, key: str, path: str, depth: int, max_depth: int | None) -> dict[str, Any]:
    d: dict[str, Any] = {"key": key, "path": path, "kind": "level", "type": level.type_name,
                         "batch_size": level.batch_size, "keys": len(level)}  # fmt: skip
    if max_depth is not None and depth >= max_depth:
        d["children"] = None  # not expanded (--depth)
        return d
    d["children"] = [
        _node_dict(level, k, f"{path}/{k}" if path else k, depth + 1, max_depth) for k in level
    ]
    return d


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
        dtype = d["dtype"] + (" nested" if d["nested"] else "")
        rows.append([f"{pad}{name}", dtype, str(d["shape"]), f"{d['nbytes']} B", codec])
    elif kind in ("file", "pickle"):
        rows.append([f"{pad}{name}", kind, "", f"{d['nbytes']} B", ""])
    else:
        rows.append([f"{pad}{name}", "value", repr(d["value"])[:60], "", ""])


def cmd_tree(args: argparse.Namespace) -> int:
    import tdz_numba
    from tdz_numba import Archive, MissingKeyError

    if args.depth is not None and args.depth < 0:
        raise _UsageError("--depth must be >= 0")
    ar = tdz_numba.open(args.file)
    try:
        if args.subpath:
            sub = args.subpath.strip("/")
            if not sub:
                d = _level_dict(ar, "", "", 0, args.depth)
            else:
                parent, _, last = sub.rpartition("/")
                node = ar[parent] if parent else ar
                if not isinstance(node, Archive):
                    raise MissingKeyError(f"{args.file}: {parent!r} is not a level")
                if last not in node:
                    raise MissingKeyError(f"{args.file}: no key {sub!r}")
                d = _node_dict(node, last, sub, 0, args.depth)
                d["key"] = sub
        else:
            d = _level_dict(ar, "", "", 0, args.depth)
    finally:
        ar.close()
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


# -- verify ----------------------------------------------------------------------------------


def cmd_verify(args: argparse.Namespace) -> int:
    import tdz_numba

    try:
        report = tdz_numba.verify(args.file)
    except (TdzError, OSError) as exc:
        code = EXIT_FAILED if isinstance(exc, ChecksumError) else EXIT_USAGE
        if args.json:
            _print_json({"path": str(args.file), "ok": False, "error": _one_line(exc),
                         "error_type": type(exc).__name__})  # fmt: skip
        print(f"{PROG} verify: {_one_line(exc)}", file=sys.stderr)
        if getattr(args, "debug", False):
            import traceback

            traceback.print_exception(exc)
        return code
    if args.json:
        _print_json({"path": str(args.file), "ok": True, "entries": report.entries, "levels": report.levels,
                     "leaves": report.leaves, "payload_bytes": report.payload_bytes})  # fmt: skip
    else:
        print(report)
    return EXIT_OK


# -- bench -----------------------------------------------------------------------------------


def cmd_bench(argv: list[str]) -> int:
    from . import bench

    return bench.main(argv, prog=f"{PROG} bench")


# -- parser and dispatch -----------------------------------------------------------------------


class _UsageError(Exception):
    """A bad argument found after parsing (exit 2)."""


def build_parser() -> argparse.ArgumentParser:
    from . import __version__

    common = argparse.ArgumentParser(add_help=False)
    common.add_argument("--debug", action="store_true", default=argparse.SUPPRESS,
                        help="print the traceback of an error")  # fmt: skip

    p = argparse.ArgumentParser(
        prog=PROG,
        description="Inspect, check and benchmark .tdz tensor archives (tdz_numba).",
        epilog="exit codes: 0 ok, 1 check failed, 2 usage error or bad file",
    )
    p.add_argument("--debug", action="store_true", default=False, help="print the traceback of an error")
    p.add_argument("--version", action="version", version=f"%(prog)s (tdz_numba) {__version__}")
    sub = p.add_subparsers(dest="command", metavar="COMMAND")
    sub.required = True

    s = sub.add_parser("info", parents=[common], help="entries, leaves, bytes, codecs, alignment, root class",
                       description="Summary of an archive: entries, leaves, bytes, compression methods, "
                                   "64-byte alignment of every .memmap payload, root class.")  # fmt: skip
    s.add_argument("file", help="the .tdz archive")
    s.add_argument("--json", action="store_true", help="print JSON")
    s.set_defaults(func=cmd_info)

    s = sub.add_parser("tree", parents=[common], help="the nested tree: key, dtype, shape, bytes, codec",
                       description="Print the nested tree of an archive (or of SUBPATH): key, dtype, "
                                   "shape, size in bytes and codec of every leaf.")  # fmt: skip
    s.add_argument("file", help="the .tdz archive")
    s.add_argument("subpath", nargs="?", default=None, help='a level or leaf, as "a/b"')
    s.add_argument("--depth", type=int, default=None, help="expand at most N levels (default: all)")
    s.add_argument("--json", action="store_true", help="print JSON")
    s.set_defaults(func=cmd_tree)

    s = sub.add_parser("verify", parents=[common], help="check every entry's CRC-32 and the structure",
                       description="Check every entry's CRC-32 and the archive's structure. "
                                   "Exit 0 ok, 1 CRC mismatch, 2 bad or unreadable file.")  # fmt: skip
    s.add_argument("file", help="the .tdz archive")
    s.add_argument("--json", action="store_true", help="print JSON")
    s.set_defaults(func=cmd_verify)

    sub.add_parser("bench", add_help=False, help="benchmark against tensordict, torch, safetensors "
                                                 "(tdz bench --help for options)")  # fmt: skip
    return p


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
