"""Mutators of the fuzz harness: field-aware edits of zip records and of meta.json.

:func:`mutate` turns a seed into one hostile input, deterministically from a
``random.Random``: one to three edits drawn from

- ``field``: a numeric field of any record (EOCD, zip64 end record and
  locator, central and local headers, extra blocks, the zip64 extra, the
  ``0x6474`` padding and ``0x7A74`` segment-table blocks, data descriptors) set
  to an interesting value: 0, all ones, signed and unsigned limits, values
  near 2**63 and 2**64, the file size, its neighbours, another field's value;
- ``z64``: a 64-bit size, offset or count set near 2**63 or 2**64;
- ``name``: a name field overwritten with a hostile name (same length);
- ``flip`` / ``bytes``: bit flips and random bytes, in headers or anywhere;
- ``truncate`` / ``append`` / ``dup``: a cut file, trailing junk, a
  duplicated central record (counts updated);
- ``meta``: a meta.json rewritten with a JSON-level change (huge, negative,
  overflowing or mistyped dims, bad dtypes, bad ``_class``/``_type``/version
  values, missing keys, deep nesting, unicode and many-component keys, ...),
  the archive rebuilt around it (CRC and sizes right, alignment kept);
- ``entry``: an entry renamed (any length) or a new entry added (name
  collisions, empty, aliased, over-long and deep names).

Examples
--------
>>> import io, random, zipfile
>>> buf = io.BytesIO()
>>> with zipfile.ZipFile(buf, "w") as z:
...     z.writestr("meta.json", "{}")
>>> data, how = mutate(buf.getvalue(), random.Random(1))
>>> isinstance(data, bytes) and isinstance(how, str)
True
"""

from __future__ import annotations

import json
import random
import re
import struct

from .zipmodel import Field, entries, field_map, rebuild

__all__ = ["mutate", "KINDS"]

_DTYPES = [
    "torch.float32",
    "torch.float64",
    "torch.uint8",
    "torch.int64",
    "torch.bool",
    "torch.bfloat16",
    "torch.complex128",
    "torch.float8_e4m3fn",
    "torch.uint64",
    "torch.quint8",
    "torch.foo",
    "float32",
    "",
    3,
    None,
    ["torch.float32"],
    "torch.float32 ",
]
_HUGE_SHAPES = [
    [2**63],
    [2**64],
    [2**63 - 1],
    [2**63 + 5],
    [-1],
    [0, 2**62],
    [2**62, 0],
    [2**32, 2**32],
    [2**31, 2**31, 2**31],
    [2**62, 2],
    [2**61, 8],
    [1] * 70,
    [1] * 5000,
    [10**30],
    [-(2**63)],
    [0, 2**63],
    [2**40],
    [10**12],
    [3.0],
    ["3"],
    [True],
    [None],
    [[2]],
    "3",
    3,
    {},
    [],
    [2**21, 2**21, 2**21],
    [0] * 64 + [2**63],
]
_CLASSES = [
    "tensordict:TensorDict",
    "tensordict:LazyStackedTensorDict",
    "tensordict:NonTensorStack",
    "tensordict:NonTensorData",
    "x:y",
    "",
    5,
    None,
    ":",
    "tensordict:",
    "os:system",
]
_TYPES = [
    "<class 'tensordict._td.TensorDict'>",
    "<class 'tensordict.tensorclass.NonTensorData'>",
    "<class 'tensordict.tensorclass.NonTensorStack'>",
    "<class 'tensordict._lazy.LazyStackedTensorDict'>",
    "<class 'x.Y'>",
    "<class ''>",
    5,
    None,
    "",
]
_NAMES = [
    b"",
    b"/",
    b"meta.json/",
    b"../x",
    b"/abs",
    b"a//b",
    b"./meta.json",
    b"\xff\xfe",
    b"a\x00b",
    b"x" * 300,
    b"q/" * 1500 + b"f",
    b"C:\\x",
    b"meta.json",
    b"%",
    b"..",
    b"a\\b",
]
_CRITICAL = re.compile(r"size|offset|count|hoff|zip64_|seg_|len|z64_end|n_disk|extra_id")
KINDS = (
    "field",
    "field",
    "field",
    "field",
    "z64",
    "name",
    "flip",
    "bytes",
    "truncate",
    "append",
    "dup",
    "meta",
    "meta",
    "meta",
    "meta",
    "entry",
)


def _int_values(f: Field, old: int, size: int, rng: random.Random, others: list[int]) -> int:
    bits = 8 * f.width
    top = (1 << bits) - 1
    cands = [
        0,
        1,
        top,
        top - 1,
        top >> 1,
        (top >> 1) + 1,
        old + 1,
        old - 1,
        old + 64,
        old - 64,
        old * 2,
        size,
        size - 1,
        size + 1,
        size - old,
        old ^ (1 << rng.randrange(bits)),
        rng.randrange(top + 1),
        rng.choice(others) if others else 0,
    ]
    if bits == 64:
        cands += [
            2**63 - 1,
            2**63,
            2**63 + 1,
            2**63 - 30,
            2**63 - 46,
            2**64 - 30,
            2**63 - old,
            2**32,
            2**31,
            2**62,
            2**40,
            4 * 10**12,
            2**64 - old,
        ]
    if bits == 32:
        cands += [2**31 - 1, 2**31, 0xFFFFFFFF - 30, 0xFFFFFFFF]
    return rng.choice(cands) & top


def _field_edit(data: bytearray, fields: list[Field], rng: random.Random) -> str:
    ints = [f for f in fields if f.kind == "int" and f.width in (2, 4, 8)]
    if not ints:
        return _flip(data, rng)
    # half the time a size, offset or count (the fields the reader must bound), the other half any
    # field; either way the record kind is drawn first, so that rare records (zip64) get hit
    pool = [f for f in ints if _CRITICAL.search(f.name)] if rng.random() < 0.5 else ints
    by_record: dict[str, list[Field]] = {}
    for f in pool or ints:
        by_record.setdefault(f.record, []).append(f)
    rec = rng.choice(sorted(by_record))
    f = rng.choice(by_record[rec])
    fmt = {2: "<H", 4: "<I", 8: "<Q"}[f.width]
    old = struct.unpack_from(fmt, data, f.offset)[0]
    others = [
        struct.unpack_from({2: "<H", 4: "<I", 8: "<Q"}[g.width], data, g.offset)[0]
        for g in rng.sample(ints, min(4, len(ints)))
    ]
    new = _int_values(f, old, len(data), rng, others)
    struct.pack_into(fmt, data, f.offset, new)
    return f"field {f.record}[{f.index}].{f.name}@{f.offset}: {old}->{new}"


def _z64_edit(data: bytearray, fields: list[Field], rng: random.Random) -> str:
    """A 64-bit size, offset or count (zip64 extra, zip64 end record, locator) near 2**63 or 2**64:
    where ``offset + header size`` overflows a signed or unsigned 64-bit sum."""
    wide = [f for f in fields if f.width == 8 and f.kind == "int"]
    if not wide:
        return _field_edit(data, fields, rng)
    f = rng.choice(wide)
    old = struct.unpack_from("<Q", data, f.offset)[0]
    k = rng.choice([1, 2, 10, 22, 30, 46, 56, 64, 4096, old % 4096])
    new = rng.choice([2**63 - k, 2**63 + k, 2**64 - k, 2**63 - old, 2**64 - old, 2**62 + old]) & (2**64 - 1)
    struct.pack_into("<Q", data, f.offset, new)
    return f"z64 {f.record}[{f.index}].{f.name}@{f.offset}: {old}->{new}"


def _name_edit(data: bytearray, fields: list[Field], rng: random.Random) -> str:
    names = [f for f in fields if f.name == "name" and f.width > 0]
    if not names:
        return _flip(data, rng)
    f = rng.choice(names)
    src = rng.choice(_NAMES + [bytes(data[g.offset : g.offset + g.width]) for g in rng.sample(names, 1)])
    new = (
        (src + b"x" * f.width)[: f.width]
        if rng.random() < 0.5
        else (src * (f.width // max(len(src), 1) + 1))[: f.width]
    )
    if rng.random() < 0.3:  # only the tail: keeps the directory, changes the file
        cut = rng.randrange(f.width)
        new = bytes(data[f.offset : f.offset + cut]) + new[cut:]
    data[f.offset : f.offset + f.width] = new
    return f"name {f.record}[{f.index}]@{f.offset} -> {new[:40]!r}"


def _flip(data: bytearray, rng: random.Random, fields: list[Field] | None = None) -> str:
    if fields and rng.random() < 0.7:
        f = rng.choice(fields)
        pos = f.offset + rng.randrange(max(f.width, 1)) if f.width else f.offset
        pos = min(pos, len(data) - 1)
    else:
        pos = rng.randrange(len(data))
    old = data[pos]
    data[pos] ^= 1 << rng.randrange(8)
    return f"flip @{pos}: {old}->{data[pos]}"


def _random_bytes(data: bytearray, rng: random.Random, fields: list[Field]) -> str:
    f = rng.choice(fields) if fields and rng.random() < 0.7 else None
    start = f.offset if f else rng.randrange(len(data))
    n = rng.choice([1, 2, 4, 8, 16, 64])
    chunk = bytes(rng.choice([0, 0xFF, rng.randrange(256)]) for _ in range(n))
    data[start : start + n] = chunk[: max(0, len(data) - start)]
    return f"bytes @{start}+{n}"


def _truncate(data: bytearray, rng: random.Random, fields: list[Field]) -> str:
    if fields and rng.random() < 0.6:
        f = rng.choice(fields)
        cut = f.offset + rng.choice([0, max(f.width // 2, 1), f.width])
    else:
        cut = rng.randrange(len(data))
    del data[cut:]
    return f"truncate at {cut}"


def _append(data: bytearray, rng: random.Random) -> str:
    junk = rng.choice(
        [
            b"\0" * rng.randrange(1, 70000),
            b"PK\x05\x06" + bytes(18),
            b"PK\x06\x07" + bytes(16),
            bytes(rng.randrange(256) for _ in range(rng.randrange(1, 200))),
        ]
    )
    if rng.random() < 0.5:
        data[0:0] = junk
        return f"prepend {len(junk)} bytes"
    data += junk
    return f"append {len(junk)} bytes"


def _dup_central(data: bytearray, fields: list[Field], rng: random.Random) -> str:
    """A central record duplicated at the end of the directory; counts and sizes updated."""
    eocd = [f for f in fields if f.record == "eocd"]
    if any(f.record == "zip64_end" for f in fields) or not eocd:
        return _flip(data, rng, fields)
    starts = sorted({f.offset for f in fields if f.record == "central" and f.name == "sig"})
    if not starts:
        return _flip(data, rng, fields)
    e = eocd[0].offset
    bounds = starts + [e]
    k = rng.randrange(len(starts))
    rec = bytes(data[bounds[k] : bounds[k + 1]])
    count, cd_size = struct.unpack_from("<H4xI", data, e + 8)[0], struct.unpack_from("<I", data, e + 12)[0]
    data[e:e] = rec
    e += len(rec)
    struct.pack_into(
        "<HHI", data, e + 8, (count + 1) & 0xFFFF, (count + 1) & 0xFFFF, (cd_size + len(rec)) & 0xFFFFFFFF
    )
    return f"dup central[{k}]"


# ---------------------------------------------------------------------------
# meta.json
# ---------------------------------------------------------------------------
def _deep(n: int, kind: str) -> str:
    return ("[" * n + "]" * n) if kind == "list" else ('{"a":' * n + "1" + "}" * n)


def _leaf_keys(meta: dict) -> list[str]:
    return [k for k, v in meta.items() if isinstance(v, dict) and "dtype" in v]


def _meta_edit(meta, rng: random.Random) -> tuple[object | bytes, str]:
    """A changed meta.json (an object, or raw bytes) and what changed."""
    if not isinstance(meta, dict):
        return b"{}", "meta: replaced by {}"
    leaves = _leaf_keys(meta)
    choice = rng.randrange(14)
    if choice <= 3 and leaves:
        k = rng.choice(leaves)
        shape = meta[k].get("shape")
        if rng.random() < 0.7 or not isinstance(shape, list) or not shape:
            meta[k]["shape"] = rng.choice(_HUGE_SHAPES)
        else:
            i = rng.randrange(len(shape))
            shape[i] = rng.choice([shape[i] * 2, shape[i] + 1, 0, 2**63 // max(shape[i], 1), -shape[i]])
        return meta, f"meta: {k}.shape={str(meta[k]['shape'])[:60]}"
    if choice == 4 and leaves:
        k = rng.choice(leaves)
        meta[k]["dtype"] = rng.choice(_DTYPES)
        return meta, f"meta: {k}.dtype={meta[k]['dtype']!r}"
    if choice == 5 and leaves:
        k = rng.choice(leaves)
        meta[k]["is_nested"] = rng.choice([True, False, "yes", 1, None, [1]])
        return meta, f"meta: {k}.is_nested={meta[k]['is_nested']!r}"
    if choice == 6:
        k = rng.choice(sorted(meta)) if meta else "x"
        meta[k] = rng.choice(
            [
                5,
                [],
                "x",
                {},
                {"type": 5},
                {"type": "TensorDict"},
                {"dtype": "torch.float32"},
                {"shape": [1]},
                None,
                {"type": "NonTensorData", "dtype": 1},
            ]
        )
        return meta, f"meta: {k!r} -> {meta[k]!r}"
    if choice == 7 and meta:
        k = rng.choice(sorted(meta))
        del meta[k]
        return meta, f"meta: del {k!r}"
    if choice == 8:
        field_, vals = rng.choice(
            [
                ("_class", _CLASSES),
                ("_type", _TYPES),
                ("_format_version", [2, "1", -1, 1.5, True, 10**30, None, 0]),
                ("shape", [[2**63], [-1], "x", None, [1.5], [10**30]]),
                ("stack_dim", [10**30, -5, "0", None, 2**63, 1]),
                ("_names", [5, ["a"] * 50, [None], "x", [1]]),
                ("data", [_deep_obj(400), "x" * 100000, [1] * 1000, None, {"a": 1}]),
            ]
        )
        meta[field_] = rng.choice(vals)
        return meta, f"meta: {field_}={str(meta[field_])[:50]}"
    if choice == 9:
        raw = rng.choice(
            [
                _deep(100_000, "list"),
                _deep(50_000, "dict"),
                _deep(1_100, "list"),
                "[]",
                "5",
                '"s"',
                "null",
                "\xef\xbb\xbf{}",
                '{"a": NaN}',
                "1e999999",
                '{"a":1,"a":2}',
                "{",
                '{"x": ' + "9" * 5000 + "}",
            ]
        )
        return raw.encode("utf-8", "surrogatepass"), f"meta: raw {raw[:30]!r} ({len(raw)} chars)"
    if choice == 10:
        key = rng.choice(
            [
                "ключ",
                "a/b",
                "..",
                "",
                "%",
                "meta.json",
                "/".join(["a"] * 1500),
                "x" * 300,
                "\udcff",
                "nul\x00",
                "日本語/キー",
                "a\\b",
            ]
        )
        meta[key] = rng.choice(
            [
                {"device": "cpu", "shape": [2], "dtype": "torch.float32", "is_nested": False},
                {"type": "TensorDict"},
                {"device": "cpu", "shape": [0], "dtype": "torch.int8", "is_nested": False},
            ]
        )
        try:
            return json.dumps(meta, ensure_ascii=False).encode("utf-8"), f"meta: add key {key[:30]!r}"
        except UnicodeEncodeError:
            return json.dumps(meta, ensure_ascii=True).encode(), f"meta: add key {key[:30]!r} (escaped)"
    if choice == 11:
        raw = json.dumps(meta).encode()
        cut = rng.randrange(len(raw) + 1)
        return raw[:cut] + rng.choice([b"", b"\xff", b"\x00", b"}"]), f"meta: cut at {cut}"
    if choice == 12:
        meta[rng.choice(leaves) if leaves else "x"] = {
            "device": "cpu",
            "shape": [2, 3],
            "dtype": "torch.float32",
            "is_nested": True,
        }
        return meta, "meta: nested flag on a dense leaf"
    n = rng.choice([1, 2, 3, 4, 5])
    for _ in range(n):
        if not leaves:
            break
        k = rng.choice(leaves)
        meta[k]["shape"] = [
            rng.choice([0, 1, 2, 3, 2**31, 2**32 + 1, 2**62]) for _ in range(rng.randrange(1, 4))
        ]
    return meta, f"meta: {n} random shapes"


def _deep_obj(n: int):
    out: list = []
    for _ in range(n):
        out = [out]
    return out


def _meta_mutation(data: bytes, rng: random.Random) -> bytes | None:
    try:
        members = entries(data)
    except Exception:
        return None
    metas = [
        m
        for m in members
        if m.name.endswith(b"meta.json") and struct.unpack_from("<H", m.local_fixed, 8)[0] == 0
    ]
    if not metas:
        return None
    m = rng.choice(metas)
    try:
        meta = json.loads(m.data)
    except (ValueError, RecursionError):
        meta = {}
    new, how = _meta_edit(meta, rng)
    raw = new if isinstance(new, bytes) else json.dumps(new).encode("utf-8", "surrogatepass")
    return rebuild(members, replace={m.name: raw}), f"{how} in {m.name[:60]!r}"


def _entry_mutation(data: bytes, rng: random.Random) -> tuple[bytes, str] | None:
    try:
        members = entries(data)
    except Exception:
        return None
    names = [m.name for m in members]
    if not names:
        return None
    base = rng.choice(names)
    stem = base.rsplit(b"/", 1)[0] + b"/" if b"/" in base else b""
    new_name = rng.choice(
        [
            b"",
            b"meta.json/",
            stem + b"meta.json/x",
            base + b"/y",
            base.rstrip(b"/") + b"//",
            stem + b"/" + base[len(stem) :],
            b"q/" * 1500 + b"f",
            b"x" * 300 + b".memmap",
            stem + b"a" * 300,
            b"\xff.memmap",
            b"link",
            b"link/x",
            b"../../etc",
            b"./meta.json",
            base,
            stem + b"\xe2\x80\x8b.memmap",
        ]
    )
    if rng.random() < 0.5:  # rename an existing entry
        m = rng.choice(members)
        old = m.name
        m.name = new_name
        for fixed, at in (("local_fixed", 26), ("central_fixed", 28)):
            b = bytearray(getattr(m, fixed))
            struct.pack_into("<H", b, at, len(new_name))
            setattr(m, fixed, bytes(b))
        return rebuild(members), f"entry: rename {old[:40]!r} -> {new_name[:40]!r}"
    payload = rng.choice([b"", b"{}", bytes(8), bytes(64)])
    return rebuild(members, extra_members=[(new_name, payload)]), f"entry: add {new_name[:40]!r}"


def _apply(kind: str, data: bytearray, fields: list[Field], rng: random.Random) -> str:
    if kind == "field":
        return _field_edit(data, fields, rng)
    if kind == "name":
        return _name_edit(data, fields, rng)
    if kind == "z64":
        return _z64_edit(data, fields, rng)
    if kind == "flip":
        return _flip(data, rng, fields)
    if kind == "bytes":
        return _random_bytes(data, rng, fields)
    if kind == "truncate":
        return _truncate(data, rng, fields)
    if kind == "append":
        return _append(data, rng)
    return _dup_central(data, fields, rng)


def mutate(seed: bytes, rng: random.Random) -> tuple[bytes, str]:
    """One hostile input from ``seed``, and a description of the edits."""
    data = bytearray(seed)
    done = []
    for _ in range(rng.choice([1, 1, 1, 2, 2, 3])):
        if not data:
            break
        kind = rng.choice(KINDS)
        if kind in ("meta", "entry"):
            try:
                res = (_meta_mutation if kind == "meta" else _entry_mutation)(bytes(data), rng)
            except (AssertionError, struct.error, IndexError, ValueError, RecursionError, TypeError):
                res = None  # the input was damaged by an earlier edit
            if res is not None:
                data = bytearray(res[0])
                done.append(res[1])
                continue
            kind = "field"
        fields = field_map(bytes(data))
        try:
            done.append(_apply(kind, data, fields, rng))
        except (struct.error, IndexError, ValueError):  # a field cut short by an earlier edit
            done.append(_flip(data, rng))
    return bytes(data), "; ".join(done)
