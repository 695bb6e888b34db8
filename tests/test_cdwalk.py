"""The central-directory parser (:mod:`tdz_numba.zipfmt.kernels.central`) against its twin and its oracles.

:func:`tdz_numba.zipfmt.kernels.central.parse_central` (compiled, and its pure-Python body
``py_func``) and its twin :func:`tdz_numba.zipfmt.kernels.central_twin.parse_central` must
give the same status, columns, names and refusals on every input; the names must be those
stdlib ``zipfile`` reads; so an open gives the same index and the same errors with kernels
forced on and off.
"""

from __future__ import annotations

import io
import os
import struct
import subprocess
import sys
import zipfile
from pathlib import Path

import numpy as np
import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

from ziputil import zip_bytes  # noqa: E402

import tdz_numba  # noqa: E402
from tdz_numba.errors import TdzError  # noqa: E402
from tdz_numba.jit import policy  # noqa: E402
from tdz_numba.zipfmt import central as cdir  # noqa: E402
from tdz_numba.zipfmt import eocd, records  # noqa: E402
from tdz_numba.zipfmt.index import ArchiveIndex  # noqa: E402
from tdz_numba.zipfmt.kernels import central as kernel  # noqa: E402
from tdz_numba.zipfmt.kernels import central_twin  # noqa: E402
from tdz_numba.zipfmt.kernels import dispatch as kernel_dispatch  # noqa: E402
from tdz_numba.zipfmt.records import Col, Status  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
NCOLS = len(Col)

_zip = zip_bytes


def _cd(data: bytes) -> tuple[bytes, int, int]:
    end = eocd.find_end_record(data)
    return data[end.cd_offset : end.cd_offset + end.cd_size], end.cd_offset, end.count


def _raw(cd, cd_offset: int, count: int, fn=kernel.parse_central):
    """The kernel's raw answer: (return value, out, columns, joined names)."""
    rows = count if 0 <= count <= len(cd) // records.Central.SIZEOF else 0
    cols = np.zeros((rows, NCOLS), np.int64)
    joined = np.zeros(len(cd), np.uint8)
    out = np.zeros(kernel.OUT_LEN, np.int64)
    code = fn(cd, cd_offset, count, cols, joined, out, np.zeros(rows, np.int64))
    n = int(out[kernel.OUT_NAMES])
    return int(code), out.tolist(), cols.tolist(), joined[: max(n, 0)].tobytes()


def _seen(found: central_twin.Central) -> tuple:
    """A :class:`Central` as plain values (its rows materialized)."""
    rows = found.rows
    digests = [rows.digest(i) for i in range(len(rows))] if found.status[0] == Status.OK else None
    return rows.array().tolist(), found.names, found.status, found.encrypted, found.unknown_method, digests


def check(
    data: bytes, cd: bytes | None = None, cd_offset: int | None = None, count: int | None = None
) -> bool:
    """Asserts the kernel agrees with its twin and its oracles on ``data``; returns whether the
    central directory parsed without error (status OK)."""
    if cd is None:
        cd, cd_offset, count = _cd(data)
    twin = central_twin.parse_central(cd, cd_offset, count)
    with policy.forced("always"):
        fast = kernel_dispatch.parse_central(cd, cd_offset, count)
    assert _seen(fast) == _seen(twin)
    code, out, cols, joined = _raw(cd, cd_offset, count)
    ro = np.frombuffer(cd, np.uint8)  # read-only input, and the pure-Python body of the kernel
    assert (code, out, cols, joined) == _raw(ro, cd_offset, count)
    assert (code, out, cols, joined) == _raw(ro, cd_offset, count, kernel.parse_central.py_func)
    assert tuple(out[:4]) == twin.status and code == out[0] and cols == twin.rows.array().tolist()
    if code == Status.OK:
        names = joined.decode("ascii").split("\0") if count else []
        if twin.names is not None:
            assert names == twin.names
        else:  # a name with a NUL or a byte >= 0x80
            assert out[kernel.OUT_NAMES] == -1
        with zipfile.ZipFile(io.BytesIO(data)) as z:
            zipped = [i.orig_filename for i in z.infolist()]
        if twin.names is not None and len(zipped) == count:
            assert zipped == names
    return code == Status.OK


@pytest.mark.parametrize("n", [0, 1, 63, 64, 65, 255, 256])
def test_plain_zips_accepted(n):
    data = _zip({f"d{i % 7}/k{i}.memmap": bytes(i % 5) for i in range(n)})
    assert check(data)
    assert central_twin.parse_central(*_cd(data)).names == [f"d{i % 7}/k{i}.memmap" for i in range(n)]


def test_tdz_archives_accepted(tmp_path):
    tree = {f"g{g}": {f"t{i}": torch.randn(3) for i in range(20)} for g in range(10)}
    p = tdz_numba.save(tree, tmp_path / "x.tdz")
    assert check(p.read_bytes())
    with policy.forced("always"):
        ix = ArchiveIndex(p)
        assert ix._small is not None and len(ix.names) == 211
        assert (
            ix.read_bytes("g3/meta.json")
            == p.read_bytes()[ix.payload_offset(ix.row("g3/meta.json")) :][
                : ix.row_at(ix.row("g3/meta.json")).csize
            ]
        )


@pytest.mark.parametrize(
    "entries",
    [
        {"meta.json": b"{}", "ä/b.memmap": b"x"},  # UTF-8 names: decoded by Python
        {"meta.json": b"{}", "a\0b": b"1"},  # a NUL in a name would split wrongly
        {"a": b"1", "\0": b""},
    ],
)
def test_unusual_names_decoded_by_python(entries):
    # (zipfile cuts names at a NUL: written with "~" in its place, then patched)
    data = _zip({k.replace("\0", "~"): v for k, v in entries.items()}).replace(b"~", b"\0")
    assert check(data)
    for mode in ("always", "never"):
        with policy.forced(mode):
            found = kernel_dispatch.parse_central(*_cd(data))
            assert found.names is None
            end = eocd.find_end_record(data)
            assert cdir.check_central(found, "x", end, len(data))[0] == list(entries)


def test_zip64_and_out_of_order_accepted(tmp_path):
    from fuzz.zipmodel import to_zip64
    from test_smallindex import _reordered

    seed = tdz_numba.save({"a": torch.arange(5), "b": {"c": torch.ones(3)}}, tmp_path / "s.tdz").read_bytes()
    assert check(seed)
    z64 = to_zip64(seed)
    assert check(z64)  # zip64 extras: read by both
    plain, wide = central_twin.parse_central(*_cd(seed)), central_twin.parse_central(*_cd(z64))
    for a, b in zip(plain.rows, wide.rows):
        assert (a[Col.SIZE], a[Col.CSIZE], a[Col.HEADER_OFFSET]) == (
            b[Col.SIZE],
            b[Col.CSIZE],
            b[Col.HEADER_OFFSET],
        )
    data = _zip({"meta.json": b"{}", "a": b"1" * 10, "b": b"22", "c": b""})
    assert check(data)
    shuffled = _reordered(data, [2, 0, 3, 1])
    assert check(shuffled)  # out of file order: sorted for the overlap check
    found = central_twin.parse_central(*_cd(shuffled))
    assert found.names == ["b", "meta.json", "c", "a"]
    nxt = {n: r[Col.NEXT_OFFSET] for n, r in zip(found.names, found.rows)}
    hoff = {n: r[Col.HEADER_OFFSET] for n, r in zip(found.names, found.rows)}
    assert nxt["meta.json"] == hoff["a"] and nxt["a"] == hoff["b"] and nxt["b"] == hoff["c"]


def test_duplicate_names_refused():
    data = bytearray(_zip({"meta.json": b"{}", "ab": b"1", "ac": b"2"}))
    cd_offset = eocd.find_end_record(bytes(data)).cd_offset
    third = data.index(b"PK\x01\x02", data.index(b"PK\x01\x02", cd_offset + 1) + 1)
    data[third + 46 : third + 48] = b"ab"
    assert check(bytes(data))  # the parse accepts; the names dict then refuses
    for mode in ("always", "never"):
        with (
            policy.forced(mode),
            pytest.raises(tdz_numba.BadArchiveError, match="'ab' appears twice"),
        ):
            ArchiveIndex(_write(bytes(data)))


_TMP: list[Path] = []


def _write(data: bytes) -> Path:
    p = _TMP[0] / "case.zip"
    p.write_bytes(data)
    return p


@pytest.fixture(autouse=True)
def _tmp(tmp_path):
    _TMP[:] = [tmp_path]


def _corrupt(data: bytes) -> dict[str, bytes]:
    """The central-record corruptions tests/test_smallindex.py and test_open_fast.py use, and more."""
    end = eocd.find_end_record(data)
    second = data.index(b"PK\x01\x02", end.cd_offset + 1)
    out = {}

    def put(name: str, at: int, value: bytes) -> None:
        b = bytearray(data)
        b[at : at + len(value)] = value
        out[name] = bytes(b)

    put("signature", second, b"PK\x09\x09")
    put("encrypted", second + 8, struct.pack("<H", records.FLAG_ENCRYPTED))
    put("method", second + 10, struct.pack("<H", 99))
    put("stored_size", second + 24, struct.pack("<I", 12345))
    put("csize_overlap", second + 20, struct.pack("<II", 10**6, 10**6))
    put("header_past_end", second + 42, struct.pack("<I", end.cd_offset))
    put("header_back", second + 42, struct.pack("<I", 0))
    put("name_len_overrun", second + 28, struct.pack("<H", 0xFFFF))
    put("extra_len_overrun", second + 30, struct.pack("<H", 0xFFFF))
    put("comment_len", second + 32, struct.pack("<H", 3))
    put("zip64_missing", second + 20, struct.pack("<I", 0xFFFFFFFF))
    put("cp437", second + 46, b"\x81")
    b = bytearray(data)  # more records than counted / fewer
    b[-12:-10] = struct.pack("<H", end.count - 1)
    b[-14:-12] = struct.pack("<H", end.count - 1)
    out["count_low"] = bytes(b)
    return out


def _outcome(path: Path) -> list:
    try:
        ix = ArchiveIndex(path)
    except TdzError as exc:
        return ["open", type(exc).__name__, str(exc)]
    out: list = [ix.names, [tuple(r) for r in ix.rows]]
    for name in ix.names[:3]:
        try:
            out.append(ix.read_bytes(name))
        except TdzError as exc:
            out.append((type(exc).__name__, str(exc)))
    ix.close()
    try:
        with tdz_numba.open(path) as ar:
            out.append(sorted(ar.keys()))
    except TdzError as exc:
        out.append((type(exc).__name__, str(exc)))
    return out


def test_corruptions_same_errors(tmp_path):
    seed = tdz_numba.save({"a": torch.arange(5), "b": {"c": torch.ones(3)}}, tmp_path / "s.tdz").read_bytes()
    raised = 0
    codes = set()
    for name, data in _corrupt(seed).items():
        check(data)
        codes.add(central_twin.parse_central(*_cd(data)).status[0])
        p = tmp_path / f"{name}.tdz"
        p.write_bytes(data)
        with policy.forced("always"):
            fast = _outcome(p)
        with policy.forced("never"):
            slow = _outcome(p)
        assert fast == slow, name
        raised += fast[0] == "open"
    assert raised >= 8
    assert len(codes) >= 6, codes  # the corruptions reach several refusal sites


def test_mutated_archives_agree(tmp_path):
    """The fuzz harness's mutated archives: the kernel and the twin agree, errors included."""
    from fuzz.runner import make_cases
    from fuzz.seeds import make_seeds

    seeds = make_seeds(tmp_path / "seeds")
    p = tmp_path / "case.tdz"
    accepted = 0
    for case in make_cases(seeds, "cdwalk-1", 0, 300):
        p.write_bytes(case.data)
        try:
            cd, cd_offset, count = _cd(case.data)
        except TdzError:
            cd = None
        if cd is not None and eocd.central_directory_fits(len(case.data), cd_offset, len(cd), count):
            if count <= cdir.SMALL_ENTRIES:
                accepted += check(case.data, cd, cd_offset, count)
        with policy.forced("always"):
            fast = _outcome(p)
        with policy.forced("never"):
            slow = _outcome(p)
        assert fast == slow, case.id
    assert accepted > 30


def test_bad_arguments_and_bounds():
    cd, cd_offset, count = _cd(_zip({"a": b"1", "b": b"2"}))
    ro = np.frombuffer(cd, np.uint8)
    code, out, _, joined = _raw(ro, cd_offset, count)
    assert code == Status.OK and out[kernel.OUT_NAMES] == 3 and joined == b"a\0b"
    cols, out = np.zeros((2, NCOLS), np.int64), np.zeros(kernel.OUT_LEN, np.int64)
    dig = np.zeros(2, np.int64)
    parse = kernel.parse_central
    assert parse(ro, cd_offset, 2, cols[:1], np.zeros(len(cd), np.uint8), out, dig) == kernel.BAD_ARGUMENTS
    assert (
        parse(ro, cd_offset, 2, cols[:, :5].copy(), np.zeros(len(cd), np.uint8), out, dig)
        == kernel.BAD_ARGUMENTS
    )
    assert parse(ro, cd_offset, 2, cols, np.zeros(3, np.uint8), out, dig) == kernel.BAD_ARGUMENTS
    assert parse(ro, cd_offset, 2, cols, np.zeros(len(cd), np.uint8), out[:3], dig) == kernel.BAD_ARGUMENTS
    assert parse(ro, cd_offset, 2, cols, np.zeros(len(cd), np.uint8), out, dig[:1]) == kernel.BAD_ARGUMENTS
    assert _raw(ro, -1, 2)[1][:4] == [Status.CENTRAL_OVERRUN, -1, len(cd), -1]
    assert _raw(ro, cd_offset, -1)[1][0] == Status.CENTRAL_OVERRUN
    assert _raw(ro, cd_offset, 3)[1][0] == Status.CENTRAL_OVERRUN  # more counted than 46-byte records fit
    assert _raw(ro[:-1], cd_offset, 2)[1][:2] == [Status.CENTRAL_OVERRUN, 1]  # a record cut short
    assert _raw(ro, cd_offset, 1)[1][:4] == [Status.COUNT, 1, 1, -1]  # fewer counted than there are
    assert _raw(ro, 10, 2)[1][:2] == [Status.HEADER_PAST_END, 0]  # headers past the central directory
    assert _raw(ro[:0], cd_offset, 0)[:2] == (0, [0, 0, 0, 0, 0, -1, -1, 0])
    for args in ((ro, -1, 2), (ro, cd_offset, -1), (ro, cd_offset, 3), (ro[:-1], cd_offset, 2), (ro, 10, 2)):
        assert _raw(*args)[1][:4] == list(central_twin.parse_central(*args).status)


def test_dispatch_runs_the_kernel_or_the_twin():
    cd, cd_offset, count = _cd(_zip({"a": b"1"}))
    with policy.forced("never"):
        slow = kernel_dispatch.parse_central(cd, cd_offset, count)
    with policy.forced("always"):
        fast = kernel_dispatch.parse_central(cd, cd_offset, count)
    assert not slow.rows.kernel_columns and fast.rows.kernel_columns
    assert _seen(slow) == _seen(fast) and fast.names == ["a"] and fast.rows[0][Col.NEXT_OFFSET] == cd_offset


_FUZZ = r"""
import random, resource, sys
import numpy as np
resource.setrlimit(resource.RLIMIT_AS, (4 << 30, 4 << 30))
sys.path.insert(0, sys.argv[1])
from tdz_numba.zipfmt.kernels import central as kernel, central_twin
seeds = [open(p, "rb").read() for p in sys.argv[3:]]
rng = random.Random(int(sys.argv[2]))
ok = accepted = 0
for k in range(3000):
    cd = bytearray(rng.choice(seeds))
    for _ in range(rng.choice((1, 1, 2, 4, 16))):
        at = rng.randrange(len(cd))
        cd[at] = rng.choice((0, 0xFF, 0x80, rng.randrange(256)))
    if rng.random() < 0.2:
        cd = cd[: rng.randrange(len(cd) + 1)]
    cd = bytes(cd)
    off = rng.choice((4096, 10**6, 30, 0))
    count = max(0, cd.count(b"PK\x01\x02") + rng.choice((0, 0, 0, -1, 1)))
    twin = central_twin.parse_central(cd, off, count)
    rows = count if count <= len(cd) // 46 else 0
    cols, joined, out = np.zeros((rows, 14), np.int64), np.zeros(len(cd), np.uint8), np.zeros(8, np.int64)
    digests = np.zeros(rows, np.int64)
    code = kernel.parse_central(np.frombuffer(cd, np.uint8), off, count, cols, joined, out, digests)
    names = joined[: max(out[4], 0)].tobytes().decode("ascii").split("\0") if out[4] > 0 else []
    same = tuple(out[:4].tolist()) == twin.status and cols.tolist() == twin.rows.array().tolist()
    same = same and (out[4] < 0) == (twin.names is None) and (twin.names is None or names == twin.names or count == 0)
    same = same and (int(out[5]), int(out[6])) == (twin.encrypted, twin.unknown_method)
    if not same:
        print("MISMATCH", k, cd.hex(), off, count)
        sys.exit(1)
    accepted += code == 0
    ok += 1
print("ok", ok, accepted)
"""


def test_fuzz_central_bytes_in_subprocess(tmp_path):
    """Random byte damage to central directories, parsed in a child process (a read out of
    bounds would crash it, not pytest) with a memory limit and a timeout."""
    seeds = []
    for i, entries in enumerate(
        [
            {"meta.json": b"{}", "a.memmap": b"x" * 64, "b/meta.json": b"{}", "b/c.memmap": b""},
            {f"k{j}": bytes(j) for j in range(40)},
        ]
    ):
        cd, _, _ = _cd(_zip(entries))
        seeds.append(tmp_path / f"seed{i}.bin")
        seeds[-1].write_bytes(cd)
    env = dict(os.environ, TDZ_NUMBA_KERNELS="always")
    done = subprocess.run(
        [sys.executable, "-c", _FUZZ, str(ROOT), "20261130", *map(str, seeds)],
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    assert done.stdout.split()[:2] == ["ok", "3000"], done.stdout
    assert int(done.stdout.split()[2]) > 100, done.stdout  # damage the parser accepts (names, lengths)


def _big_index(tmp_path: Path, entries: dict[str, bytes]) -> ArchiveIndex:
    p = tmp_path / "big.zip"
    p.write_bytes(_zip(entries))
    with policy.forced("always"):
        ix = ArchiveIndex(p)
    assert ix._small is None  # (more than SMALL_ENTRIES: the kernel's columns at once)
    return ix


@pytest.mark.parametrize("unusual", [None, "ä", "\0", "\x7f"])
def test_names_of_a_large_archive_against_the_twin_and_zipfile(tmp_path, unusual):
    names = [f"d{i % 7}/k{i}.memmap" for i in range(300)]
    if unusual is not None:
        names[150] = f"x{unusual}y"
    ix = _big_index(tmp_path, dict.fromkeys([n.replace("\0", "~") for n in names], b"1"))
    if unusual == "\0":  # zipfile cuts names at a NUL: patched in after
        p = tmp_path / "nul.zip"
        p.write_bytes(ix.path.read_bytes().replace(b"x~y", b"x\0y"))
        with policy.forced("always"):
            ix = ArchiveIndex(p)
    with policy.forced("never"):
        slow = ArchiveIndex(ix.path)
    assert ix.names == names == slow.names
    assert slow._small is not None and slow._cols.tolist() == ix._cols.tolist()
    cd, cd_offset, count = _cd(ix.path.read_bytes())
    code, out, _, joined = _raw(cd, cd_offset, count)
    assert code == Status.OK
    assert out[kernel.OUT_NAMES] == (-1 if unusual in ("ä", "\0") else len("\0".join(names).encode()))
    if unusual not in ("ä", "\0"):
        assert joined.decode("ascii").split("\0") == names
    if unusual != "\0":
        with zipfile.ZipFile(ix.path) as z:
            assert z.namelist() == names


def test_refusals_are_noted_once_parsed(tmp_path):
    """The first encrypted entry and the first of an unknown method, noted by the walk."""
    base = _zip({f"k{i}": b"1" for i in range(300)})
    end = eocd.find_end_record(base)
    starts = [m for m in range(end.cd_offset, len(base)) if base[m : m + 4] == b"PK\x01\x02"]
    data = bytearray(base)
    for i in (7, 200):
        data[starts[i] + 8 : starts[i] + 10] = struct.pack("<H", records.FLAG_ENCRYPTED)
    for i in (5, 250):
        data[starts[i] + 10 : starts[i] + 12] = struct.pack("<H", 99)
    assert check(bytes(data))
    found = central_twin.parse_central(*_cd(bytes(data)))
    assert (found.encrypted, found.unknown_method) == (7, 5)
    for mode in ("always", "never"):
        with policy.forced(mode), pytest.raises(tdz_numba.UnsupportedError, match="'k7' is encrypted"):
            ArchiveIndex(_write(bytes(data)))
