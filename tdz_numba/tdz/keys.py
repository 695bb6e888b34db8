"""tensordict's ``robust_key``: the percent-encoding of keys into file names (``meta.json``
siblings and ``.memmap`` payloads), and its inverse, bug for bug.

Examples
--------
>>> from tdz_numba.tdz.keys import encode_key, decode_key
>>> encode_key("odd/key name%")
'odd%2Fkey%20name%25'
>>> decode_key("odd%2Fkey%20name%25")
'odd/key name%'
>>> encode_key(""), encode_key("..")
('%', '%2E%2E')
"""

from __future__ import annotations

import re

__all__ = ["encode_key", "decode_key"]

_UNSAFE = set('/<>:"|?*\\ \0%') | {chr(i) for i in range(32)} | {chr(127)}
_ENCODE = str.maketrans({c: f"%{ord(c):02X}" for c in _UNSAFE})
_NEEDS_ENCODING = re.compile("[" + re.escape("".join(sorted(_UNSAFE))) + "]")


_ENCODED: dict[str, str] = {}  # keys repeat across levels (x0..x19 in every group): encode each once
_ENCODED_MAX = 1 << 16


def encode_key(key: str) -> str:
    """File-name form of a key (tensordict's ``robust_key`` encoding)."""
    out = _ENCODED.get(key)
    if out is not None:
        return out
    if not key:
        out = "%"
    elif key in (".", ".."):
        out = "%2E" * len(key)
    else:  # str.translate with multi-character replacements is slow: most keys need none
        out = key.translate(_ENCODE) if _NEEDS_ENCODING.search(key) else key
    if len(_ENCODED) < _ENCODED_MAX:
        _ENCODED[key] = out
    return out


def decode_key(name: str) -> str:
    """Inverse of :func:`encode_key` (tensordict's decoder, bug for bug)."""
    if name == "%":
        return ""
    out = []
    i = 0
    while i < len(name):
        if name[i] == "%" and i + 2 < len(name):
            try:
                out.append(chr(int(name[i + 1 : i + 3], 16)))
                i += 3
                continue
            except ValueError:
                pass
        out.append(name[i])
        i += 1
    return "".join(out)
