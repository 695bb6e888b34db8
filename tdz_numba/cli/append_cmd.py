"""``tdz append ARCHIVE FILE``: the leaves of any readable file added to an archive in place.

Examples
--------
::

    tdz append buffer.tdz episode_7.safetensors --subpath episodes/7
    tdz append ckpt.tdz new_head.pt --replace      # existing keys superseded
"""

from __future__ import annotations

import argparse
import os

__all__ = ["add_parser", "cmd_append"]


def add_parser(sub: argparse._SubParsersAction, common: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """Registers ``tdz append``; returns its parser."""
    s = sub.add_parser(
        "append",
        parents=[common],
        help="add the leaves of any readable file to an archive, without a rewrite",
        description="Add the leaves (and plain values) of FILE (any format tdz reads: .tdz, "
        "safetensors, .pt, npz, GGUF, ...) to ARCHIVE, after its last byte (see tdz_numba.append). "
        "An existing key is refused unless --replace.",
    )
    s.add_argument("archive", metavar="ARCHIVE", help="the .tdz archive (grown in place)")
    s.add_argument("file", metavar="FILE", help="the file whose leaves are added")
    s.add_argument("--subpath", metavar="P", help="the level to add under ('a/b'; created when missing)")
    s.add_argument("--replace", action="store_true", help="supersede existing keys")
    s.add_argument("--digest", action="store_true", help="store XXH3-128 digests of the new payloads")
    s.set_defaults(func=cmd_append)
    return s


def cmd_append(args: argparse.Namespace) -> int:
    import tdz_numba

    from ..conversion import tensordict_levels
    from .commands import EXIT_OK, plural, sizer

    before = os.path.getsize(args.archive)
    with tdz_numba.open(args.file) as ar:
        tree = ar.to_dict()  # (views of FILE's mapping: written from there)
        if ar.format != "tdz":
            tree = tensordict_levels(tree)
        leaves = sum(1 for _ in ar.leaves())
        tdz_numba.append(
            args.archive,
            tree,
            subpath=args.subpath,
            replace=args.replace,
            digest=True if args.digest else None,
        )
    after = os.path.getsize(args.archive)
    where = f" under {args.subpath!r}" if args.subpath else ""
    grown = sizer(args)(after - before)
    print(f"{args.archive}: {plural(leaves, 'leaf', 'leaves')} of {args.file} appended{where} (+{grown})")
    return EXIT_OK
