"""``verify(path, deep=True)``: every stored XXH3-128 digest recomputed from the leaf's bytes.

A ``.tdz`` written with ``digest=True`` stores the digest of each payload in its central
record (:class:`tdz_numba.zipfmt.records.DigestExtra`); the deep check hashes every such
payload again (decompressed when compressed) and raises
:class:`~tdz_numba.ChecksumError` naming the first leaf whose bytes differ. It runs after
the CRC-32 checks of :func:`tdz_numba.verify`, so a digest mismatch with a good CRC means a
change the CRC cannot see (a collision, or bytes rewritten with their CRC restamped).

Examples
--------
>>> import tempfile, pathlib, torch, tdz_numba
>>> with tempfile.TemporaryDirectory() as d:
...     p = tdz_numba.save({"a": torch.ones(4)}, pathlib.Path(d) / "x.tdz", digest=True)
...     print(tdz_numba.verify(p, deep=True).digests)
1
"""

from __future__ import annotations

from typing import Any

from ..errors import ChecksumError

__all__ = ["check_digests", "leaf_key"]

_SUFFIX = ".memmap"


def leaf_key(name: str) -> str:
    """The leaf an entry name stands for (``"a/b.memmap"`` -> ``"a/b"``)."""
    return name[: -len(_SUFFIX)] if name.endswith(_SUFFIX) else name


def check_digests(index: Any, bar: Any = None) -> int:
    """Recomputes the digest of every entry of ``index`` that stores one, in file order;
    returns how many were checked. ``bar``: a progress bar (``update(nbytes)``)."""
    if not index.has_digests:
        return 0
    from ..zipfmt.digest import hash_function

    hash_now = hash_function()
    rows = sorted(range(len(index.names)), key=lambda i: index.row_at(i).header_offset)
    checked = 0
    for i in rows:
        at = index.digest_offset(i)
        if at < 0:
            continue
        name = index.names[i]
        expected = index.digest(name)
        found = hash_now(index.read(name, check_crc=False))
        if found != expected:
            key = leaf_key(name)
            raise ChecksumError(
                f"{index.path}: leaf {key!r} (entry {name!r}): XXH3-128 digest mismatch: "
                f"recorded {expected.hex()}, computed {found.hex()}",
                path=str(index.path),
                entry=name,
                offset=at,
                expected=expected.hex(),
                found=found.hex(),
            )
        checked += 1
        if bar is not None:
            bar.update(int(index.row_at(i).size))
    return checked
