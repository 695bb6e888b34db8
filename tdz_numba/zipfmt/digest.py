"""Per-payload XXH3-128 digests: the hash functions (the optional ``digest`` extra, the
``xxhash`` package) and the central extra block that stores them
(:class:`tdz_numba.zipfmt.records.DigestExtra`).

A digest is that of the entry's *uncompressed* bytes (like its CRC-32), computed while the
writers write them (:mod:`tdz_numba.zipfmt.payload`, the streaming writer's sinks), and
stored in the central record only: zip tools and tensordict skip the block.

Examples
--------
>>> from tdz_numba.zipfmt import digest
>>> value = digest.hash_bytes(b"abc")
>>> digest.hexdigest(value) == __import__("xxhash").xxh3_128_hexdigest(b"abc")
True
>>> len(digest.block(value)), digest.block(value)[:5].hex()
(21, '7468110001')
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

from ..errors import UnsupportedError
from . import records

__all__ = ["require", "hasher", "hash_bytes", "block", "blocks", "hexdigest", "BLOCK_SIZE", "PENDING"]

#: Bytes of one digest block in a central record.
BLOCK_SIZE = int(records.DigestExtra.SIZEOF)
#: A digest the writer still has to compute (``Prepared.digests``): its block is planned.
PENDING = b""


def require(what: str = "digest=True") -> Any:
    """The ``xxhash`` module; :class:`~tdz_numba.UnsupportedError` naming the extra without it."""
    try:
        import xxhash
    except ImportError:  # pragma: no cover - installed in the dev environment
        raise UnsupportedError(
            f"{what} needs the 'digest' extra (the xxhash package): pip install 'tdz_numba[digest]'"
        ) from None
    return xxhash


def hasher() -> Any:
    """A fresh streaming XXH3-128 state (``update(piece)``, ``digest()``)."""
    return require().xxh3_128()


def hash_bytes(data: Any) -> bytes:
    """The 16-byte XXH3-128 digest of a buffer (bytes, memoryview, uint8 array)."""
    return require().xxh3_128_digest(data)


def hash_function() -> Callable[[Any], bytes]:
    """The one-shot digest function (looked up once by a writer)."""
    return require().xxh3_128_digest


def block(value: bytes) -> bytes:
    """The central extra block that stores ``value`` (:class:`~tdz_numba.zipfmt.records.DigestExtra`)."""
    return records.DIGEST_STRUCT.pack(
        records.DIGEST_EXTRA_ID, BLOCK_SIZE - int(records.Extra.SIZEOF), records.DIGEST_XXH3_128, value
    )


def blocks(digests: Sequence[bytes | None] | None, n: int) -> list[bytes] | None:
    """The digest blocks of ``n`` entries (``b""`` for entries without one); None when none has one.
    A digest still :data:`PENDING` is a writer's bug."""
    if digests is None:
        return None
    out = []
    for d in digests:
        if d is None:
            out.append(b"")
        elif len(d) != BLOCK_SIZE - int(records.DigestExtra.VALUE):
            from ..errors import InternalError

            raise InternalError(f"a digest of {len(d)} bytes (not computed?) in a central record")
        else:
            out.append(block(d))
    return out


def planned_len(digests: Sequence[bytes | None] | None) -> int:
    """Bytes the digest blocks add to a central directory (pending ones included)."""
    return 0 if digests is None else BLOCK_SIZE * sum(d is not None for d in digests)


def hexdigest(value: bytes | None) -> str | None:
    """The hex string of a digest (``xxhash``'s ``hexdigest``), None for None."""
    return None if value is None else value.hex()
