"""The compiled scan of a plain TensorDict meta.json (tdz_numba.tdz.metascan) against its oracle,
``plain_td_level(parse_meta(text), prefix, has_meta)``: texts written by tdz_numba.save and by
tensordict, random mutations and every truncation of a text (the scan agrees or gives None, the
caller's cue to parse), edge sizes, small buffers, and a load of 20,000 leaves that takes the scan."""

from __future__ import annotations

import io
import random
import zipfile

import numpy as np
import pytest
import torch

import tdz_numba
from tdz_numba.errors import BadArchiveError
from tdz_numba.jit import policy
from tdz_numba.tdz import metascan, plainlevel
from tdz_numba.tdz import source as tdzsource
from tdz_numba.tdz.bounds import parse_meta
from tdz_numba.tdz.metascan import scan_level, scan_meta
from tdz_numba.tdz.plainlevel import plain_td_level

FIELDS = ("fields", "items", "names", "nbytes", "itemsize", "subs")
TAIL = '"shape": [], "device": "cpu", "_type": "<class \'tensordict._td.TensorDict\'>", "_format_version": 1, "_class": "tensordict:TensorDict"'


def leaf(shape, dtype="torch.float32", device='"cpu"'):
    return f'{{"device": {device}, "shape": {shape}, "dtype": "{dtype}", "is_nested": false}}'


def text(*children, tail=TAIL):
    return (
        "{" + ", ".join([*(f'"{k}": {v}' for k, v in children), *([tail] if tail else [])]) + "}"
    ).encode()


def oracle(data, prefix="", has=lambda name: True):
    """What the parsing path makes of ``data``: "error", None (not plain) or the PlainLevel."""
    try:
        meta = parse_meta(data, "meta.json")
    except BadArchiveError:
        return "error"
    ok, lvl = plain_td_level(meta, prefix, has)
    return lvl if ok else None


def check(data, prefix="", has=lambda name: True):
    """The scan's level (None where it gives way), asserted equal to the oracle's (types and order too)."""
    got = scan_level(data, prefix, has)
    if got is not None:
        want = oracle(data, prefix, has)
        assert want is not None and want != "error", data
        for f in FIELDS:
            assert repr(getattr(got, f)) == repr(getattr(want, f)), (f, data)
    return got


def metas_of(path):
    """``{name: bytes}`` of every meta.json of a .tdz, and a has_meta over its entries."""
    with zipfile.ZipFile(path) as z:
        names = set(z.namelist())
        return {n: z.read(n) for n in names if n.endswith("meta.json")}, names.__contains__


DTYPES = [
    torch.bool,
    torch.uint8,
    torch.int8,
    torch.int16,
    torch.int32,
    torch.int64,
    torch.float16,
    torch.bfloat16,
    torch.float32,
    torch.float64,
    torch.complex64,
    torch.complex128,
]


def test_save_outputs(tmp_path):
    tree = {f"d{i}": torch.zeros((2, 3), dtype=dt) for i, dt in enumerate(DTYPES)}
    tree.update(
        {
            "scalar": torch.tensor(2.5),
            "empty": torch.zeros(0, dtype=torch.int16),
            "empty2": torch.zeros(3, 0, 2),
            "deep": torch.zeros(1, 2, 1, 3, 1),
            "été ünï": torch.ones(4),
            "ключ": torch.ones(1),
            "odd/key name%": torch.ones(2),
            'q"uo\\te': torch.ones(2),
            "": torch.ones(1),
            "..": torch.ones(1),
            "tab\there": torch.ones(1),
            "sub": {"x": torch.ones(2, dtype=torch.complex64), "deeper": {"y": torch.arange(3)}},
        }
    )
    p = tdz_numba.save(tree, tmp_path / "x.tdz")
    metas, has = metas_of(p)
    for name, data in metas.items():
        assert check(data, name[: -len("meta.json")], has) is not None, name
    root = check(metas["meta.json"], "", has)
    keys = list(tree)
    assert [i[0] for i in root.items] == keys and root.subs == ["sub/"]
    assert root.items[keys.index("deep")][4:] == ((1, 2, 1, 3, 1), (6, 3, 3, 1, 1))
    flat = {f"k{i}": torch.zeros(i % 4, dtype=DTYPES[i % len(DTYPES)]) for i in range(50)}
    metas, has = metas_of(tdz_numba.save(flat, tmp_path / "f.tdz"))
    assert check(metas["meta.json"], "", has) is not None


def test_unicode_and_encoded_keys(tmp_path):
    tree = {
        "été ünï": torch.ones(4),
        "odd/key name%": torch.ones(2),
        'q"\\': torch.ones(1),
        "": torch.ones(1),
        ".": torch.ones(1),
    }
    metas, has = metas_of(tdz_numba.save(tree, tmp_path / "u.tdz"))
    lvl = check(metas["meta.json"], "", has)
    assert lvl is not None
    assert [i[0] for i in lvl.items] == list(tree)
    assert lvl.names == [
        "été%20ünï.memmap",
        "odd%2Fkey%20name%25.memmap",
        "q%22%5C.memmap",
        "%.memmap",
        "%2E.memmap",
    ]
    raw = text(("été", leaf([1])), ("x\ud7ff", leaf([1])))  # raw UTF-8 keys, as orjson writes them
    assert check(raw) is not None


def test_tensordict_outputs(tmp_path):
    tensordict = pytest.importorskip("tensordict")
    td = tensordict.TensorDict(
        {
            "a": torch.zeros(3, 4),
            "b": torch.zeros(3, dtype=torch.bfloat16),
            "c": torch.zeros(3, 2, dtype=torch.bool),
            "n": {"x": torch.zeros(3, 5, dtype=torch.int64), "y": torch.zeros(3, dtype=torch.complex64)},
            "é k/ey": torch.zeros(3),
        },
        batch_size=[3],
    )
    td.memmap(tmp_path / "td")
    files = {p: p.read_bytes() for p in (tmp_path / "td").rglob("meta.json")}
    assert len(files) == 2
    for p, data in files.items():
        prefix = p.parent.relative_to(tmp_path / "td").as_posix()
        prefix = "" if prefix == "." else prefix + "/"
        assert check(data, prefix, lambda name: (tmp_path / "td" / name).exists()) is not None, data


def test_edge_sizes():
    for data in (
        b"{}",
        b" {} \n",
        text(tail=""),
        text(tail=TAIL),
        text(("a", leaf([]))),
        text(("a", leaf([7])), tail=""),
    ):
        lvl = check(data)
        assert lvl is not None, data
    assert check(b"{}").items == [] and check(text(("a", leaf([]))), "").nbytes == [4]
    assert check(text(("s", '{"type": "TensorDict"}')), "p/", lambda n: n == "p/s/meta.json").subs == ["s/"]
    assert (
        scan_level(text(("s", '{"type": "TensorDict"}')), "p/", lambda n: False) is None
    )  # no sub meta.json
    for data in (b"", b"{", b"}", b"[]", b"null", b"{} x", b"{}}", b"\xef\xbb\xbf{}"):
        assert scan_level(data, "", lambda n: True) is None


@pytest.mark.parametrize(
    "data",
    [
        text(("a", leaf([1])), ("a", leaf([2]))),  # duplicate keys: JSON keeps the last
        text(("shape", leaf([1]))),  # a child and a field of one name
        text(("_class", leaf([1])), tail='"_class": "tensordict:TensorDict"'),
        text(("a", leaf([1], "torch.nonsense"))),
        text(("a", leaf([1], device="1"))),
        text(("a", leaf([1], device='"c\\u0070u"'))),  # escapes in a device
        text(("a", leaf([1]).replace("false", "true"))),  # nested
        text(("a", leaf([-1]))),
        text(("a", leaf([1.0]))),
        text(("a", leaf([10**18]))),  # 19 digits
        text(("a", leaf([2**62, 2]))),
        text(("a", leaf([2**59, 16], "torch.int8"))),  # 2**63 bytes
        text(("a", leaf([0, 2**59, 0, 4]))),  # 2**63 bytes of strides (zero dims count as 1)
        text(("a", leaf([1] * 17))),  # more dims than the scan reads
        text(("a", leaf([1])), tail='"odd": 1'),
        text(("a", leaf([1])), tail='"_type": "<class \'tensordict.tensorclass.NonTensorData\'>"'),
        text(("a", leaf([1])), tail='"_format_version": 99'),
        text(("a", leaf([1])), tail='"shape": [], "b": {"type": "TensorDict"}'),  # a child after the fields
        text(("a", '{"device": "cpu", "dtype": "torch.float32", "shape": [1], "is_nested": false}')),
        text(("a", '{"shape": [1], "dtype": "torch.float32"}')),
    ],
)
def test_gives_way(data):
    assert check(data) is None


def test_accepted_variants():
    compact = (
        text(("a", leaf([2, 3])), ("b", leaf([])), tail='"shape":[4]')
        .replace(b": ", b":")
        .replace(b", ", b",")
    )
    spaced = b'\n{ "a" :\t{ "device" : null , "shape" : [ 2 , 3 ] , "dtype" : "torch.int8" , "is_nested" : false } }\r\n'
    big = text(
        ("a", leaf([2**59], "torch.int8")),
        ("b", leaf([0, 2**59, 15], "torch.int8")),
        ("c", leaf([999999999999999999, 0])),
    )
    esc = text(("a\\n\\u00e9\\\\\\/", leaf([1])), ("\\ud83d\\ude00", leaf([2])))
    lone = text(("a\\ud800", leaf([1])))  # a lone surrogate: orjson refuses it, parse_meta's json takes it
    for data in (compact, spaced, big, esc, lone):
        assert check(data) is not None, data
    assert [i[0] for i in check(esc).items] == ["a\né\\/", "\U0001f600"]


def base_text():
    kids = [
        (f"k{i}", leaf([i, 2][: i % 3], ["torch.float16", "torch.int64", "torch.bool"][i % 3]))
        for i in range(6)
    ]
    kids += [("sub", '{"type": "TensorDict"}'), ("é/x", leaf([3]))]
    kids += [(f"r{i}", leaf([4, 4])) for i in range(3)]  # leaves written alike: read once, compared after
    return text(*kids)


ALPHABET = b'{}[]",: 0123456789-.eE\\u\ttfalsenul\x00\xff\xc3\xa9'


def mutate(rng, data):
    b = bytearray(data)
    for _ in range(rng.randint(1, 3)):
        op, i = rng.randrange(4), rng.randrange(len(b) + 1)
        if op == 0 and i < len(b):
            b[i] = rng.choice(ALPHABET)
        elif op == 1 and i < len(b):
            del b[i : i + rng.randint(1, 4)]
        elif op == 2:
            b[i:i] = bytes([rng.choice(ALPHABET)])
        else:
            j = rng.randrange(len(b) + 1)
            b[i:i] = b[j : j + rng.randint(1, 12)]
    return bytes(b)


def test_mutations():
    rng = random.Random(27)
    data = base_text()
    accepted = 0
    for _ in range(3000):
        if check(mutate(rng, data)) is not None:
            accepted += 1
    assert 90 < accepted < 2900, accepted  # (~5% of the mutants keep the layout)


def test_leaves_written_alike():
    alike = leaf([2, 5], "torch.int16")
    for other in (
        leaf([2, 6], "torch.int16"),
        leaf([2, 5], "torch.int32"),
        leaf([2, 5], "torch.int16", "null"),
    ):  # (checked against the oracle)
        lvl = check(
            text(("a", alike), ("b", alike), ("c", other), ("d", alike), ("e", '{"type": "T"}'), ("f", alike))
        )
        assert lvl is not None and len(lvl.names) == 5
        assert lvl.items[1][2:5] == lvl.items[3][2:5] == lvl.items[5][2:5] == (20, "torch.int16", (2, 5))


def test_truncations():
    data = base_text()
    assert check(data) is not None
    for n in range(len(data)):
        assert check(data[:n]) is None
        check(data[n:])


def test_small_buffers_and_read_only():
    data = base_text()
    dt = metascan._dtypes()
    buf = np.frombuffer(data, np.uint8)
    out = np.zeros(6, np.int64)
    for size in (0, 1, 5, 40):
        keys, names = np.zeros(size, np.uint8), np.zeros(size, np.uint8)
        rows = np.zeros((size // 8, 6), np.int64)
        dims = np.zeros((size // 8, metascan.MAX_DIMS + 1), np.int64)
        scan_meta(buf, *dt[:3], keys, names, rows, dims, np.zeros(16, np.int64), out)
        assert out[0] == 0
    for shape in ((0, 0), (4, 6)):  # malformed columns: refused, not written past
        scan_meta(
            buf,
            *dt[:3],
            keys,
            names,
            np.zeros(shape, np.int64),
            np.zeros(shape, np.int64),
            np.zeros(0, np.int64),
            out,
        )
        assert out[0] == 0
    writable = bytearray(data)  # a writable buffer: read through a read-only view
    assert scan_level(bytes(writable), "", lambda n: True) is not None


def test_hook_policy(tmp_path):
    data = text(*[(f"k{i}", leaf([3])) for i in range(40)])
    assert len(data) >= plainlevel.SCAN_MIN
    with policy.forced("never"):
        assert plainlevel.scan_td_level(data, "", lambda n: True) is None
    with policy.forced("always"):
        assert plainlevel.scan_td_level(data, "", lambda n: True) is not None
        assert plainlevel.scan_td_level(data[:100], "", lambda n: True) is None  # (small: parsed)
        texts = {}
        lvl = plainlevel.plain_level_of(texts, data, "g/meta.json")
        want = plainlevel.plain_level(parse_meta(data, ""))
        assert all(repr(getattr(lvl, f)) == repr(getattr(want, f)) for f in FIELDS)


def test_load_takes_the_scan(tmp_path, monkeypatch):
    n = 20_000
    tree = {f"p.{i:05d}": torch.full((2,), float(i % 2048), dtype=torch.float16) for i in range(n)}
    tree["g"] = {f"x{i}": torch.arange(i % 5, dtype=torch.int32) for i in range(300)}
    p = tdz_numba.save(tree, tmp_path / "big.tdz")
    refuse = AssertionError("the meta.json was parsed")

    def no(*args, **kwargs):
        raise refuse

    with monkeypatch.context() as m:
        m.setattr(tdzsource, "plain_td_level", no)
        m.setattr(tdzsource, "parse_meta", no)
        m.setattr(plainlevel, "parse_meta", no)
        m.setattr(plainlevel, "plain_level", no)
        got = tdz_numba.load(p)
    assert list(got) == list(tree)
    assert got["p.12345"].tolist() == [12345.0 % 2048] * 2 and got["p.12345"].dtype == torch.float16
    assert got["g"]["x4"].tolist() == [0, 1, 2, 3]
    with tdz_numba.open(p) as ar:  # a level scanned at open is parsed when navigated
        assert ar["p.00007"].tolist() == [7.0, 7.0] and len(ar.keys()) == n + 1


def test_refused_text_still_loads(tmp_path):
    p = tdz_numba.save({f"k{i}": torch.full((3,), float(i)) for i in range(100)}, tmp_path / "x.tdz")
    with zipfile.ZipFile(p) as z:
        meta = z.read("meta.json")
    odd = meta.replace(b'"device": "cpu", "shape"', b'"device": "cpu", "extra": 1, "shape"', 1)
    assert scan_level(odd, "", lambda n: True) is None and oracle(odd) is not None
    buf = io.BytesIO()
    with zipfile.ZipFile(p) as z, zipfile.ZipFile(buf, "w") as w:
        for info in z.infolist():
            w.writestr(info, odd if info.filename == "meta.json" else z.read(info))
    q = tmp_path / "odd.tdz"
    q.write_bytes(buf.getvalue())
    assert tdz_numba.load(q)["k42"].tolist() == [42.0] * 3


FAST: list = []  # what quick_views gave


def _quick(path, prefix, fast, monkeypatch):
    """``quick_level(prefix)`` of a fresh source, with (``fast``) or without plainlevel.quick_views."""
    with monkeypatch.context() as m:
        real = plainlevel.quick_views
        m.setattr(
            tdzsource,
            "quick_views",
            (lambda *a: FAST.append(real(*a)) or FAST[-1]) if fast else (lambda *a: None),
        )
        src = tdzsource.TdzSource(path)
        src.check_level("")
        if prefix:
            src.quick_level("")
        return src, src.quick_level(prefix)


@pytest.mark.parametrize("compression", [None, "deflate"])
def test_quick_views_as_the_per_leaf_path(tmp_path, monkeypatch, compression):
    leaves = {f"d{i}": torch.arange(6).to(dt).reshape(2, 3) for i, dt in enumerate(DTYPES)}
    leaves.update(
        {"s": torch.tensor(1.5), "e": torch.zeros(0, 3), "big": torch.arange(40.0).reshape(2, 4, 5)}
    )
    # 300 leaves of one shape, evenly spaced (names of one length): made in runs (_made_in_runs)
    same = {f"h{i:03d}": torch.full((5,), float(i), dtype=torch.float16) for i in range(300)}
    runs: list[object] = []
    real_runs = plainlevel._made_in_runs
    monkeypatch.setattr(plainlevel, "_made_in_runs", lambda *a: runs.append(got := real_runs(*a)) or got)
    tree = {**leaves, "g": dict(leaves), "h": same}
    p = tdz_numba.save(tree, tmp_path / "q.tdz", compression=compression)
    for prefix, want in (("", tree), ("g/", leaves), ("h/", same)):
        a_src, a = _quick(p, prefix, True, monkeypatch)
        b_src, b = _quick(p, prefix, False, monkeypatch)
        try:
            if a is None or b is None:
                assert a is None and b is None and (compression or prefix == "")
                continue
            assert list(a[0]) == list(b[0]) == list(want) and a[1] == b[1]
            assert a[0].meta == b[0].meta
            for key, t in a[0].items():
                u = b[0][key]
                if t is None or isinstance(t, dict):
                    assert u is None or isinstance(u, dict)
                    continue
                assert (t.dtype, t.shape, t.stride(), t.storage_offset()) == (
                    u.dtype,
                    u.shape,
                    u.stride(),
                    u.storage_offset(),
                )
                assert torch.equal(t, want[key])
            assert sorted(a_src._tensors) == sorted(b_src._tensors)
        finally:
            a_src.close()
            b_src.close()
    if not compression:
        assert FAST and FAST[-1] is not None  # (the level "h/": made by quick_views)
        assert runs and runs[-1] is not None  # (and made in runs)
    got = tdz_numba.load(p)
    before = got["h"]["h001"]._version
    got["h"]["h000"].add_(1)  # own version counters: a write to one leaf marks no other
    assert got["h"]["h001"]._version == before and got["h"]["h000"][0] == 1.0
    assert got["h"]["h299"][4] == 299.0
