"""The central-directory walk kernel (:mod:`tdz_numba.zipfmt.kernels.names`) against its slow oracles.

:func:`tdz_numba.zipfmt.kernels.names.walk_central` either accepts a small archive's central
directory (then its starts and joined names must give exactly what the Python path
``smallindex._parse_central`` gives, and stdlib ``zipfile``'s names) or defers to that
path; so an open gives the same index and the same errors with kernels forced on and off.
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
from tdz_numba.jit import policy
from tdz_numba.zipfmt import eocd, records, smallindex  # noqa: E402
from tdz_numba.zipfmt.index import ArchiveIndex  # noqa: E402
from tdz_numba.zipfmt.kernels import dispatch as kernel_dispatch
from tdz_numba.zipfmt.kernels import names as cd_kernels

ROOT = Path(__file__).resolve().parents[1]


_zip = zip_bytes


def _cd(data: bytes) -> tuple[bytes, int, int]:
    end = eocd.find_end_record(data)
    return data[end.cd_offset : end.cd_offset + end.cd_size], end.cd_offset, end.count


def _walk(cd, cd_offset: int, count: int, fn=cd_kernels.walk_central):
    """The kernel's raw answer: (status, starts, joined names)."""
    starts = np.zeros(max(count, 0), np.int64)
    joined = np.zeros(len(cd), np.uint8)
    n = fn(cd, cd_offset, count, starts, joined)
    return n, starts.tolist(), joined[: max(n, 0)].tobytes()


def _rows(found):
    if found is None:
        return None
    rows, names, by_name = found
    return [list(r) for r in rows.all()], list(rows._starts), names, by_name


def check(
    data: bytes, cd: bytes | None = None, cd_offset: int | None = None, count: int | None = None
) -> bool:
    """Asserts the kernel agrees with its oracles on ``data``; returns whether it accepted."""
    if cd is None:
        cd, cd_offset, count = _cd(data)
    oracle = smallindex._parse_central(cd, cd_offset, count)
    with policy.forced("always"):
        fast = smallindex._parse_any(cd, cd_offset, count)
    assert _rows(fast) == _rows(oracle)
    n, starts, joined = _walk(cd, cd_offset, count)
    ro = np.frombuffer(cd, np.uint8)  # read-only input, and the pure-Python body of the kernel
    assert (n, starts, joined) == _walk(ro, cd_offset, count)
    assert (n, starts, joined) == _walk(ro, cd_offset, count, cd_kernels.walk_central.py_func)
    if n >= 0:
        names = joined.decode("ascii").split("\0") if count else []
        if oracle is None:  # the walk accepts a name twice: the names dict refuses it
            assert len(set(names)) < count and fast is None
            return True
        assert names == oracle[1] and starts == list(oracle[0]._starts)
        with zipfile.ZipFile(io.BytesIO(data)) as z:
            assert [i.orig_filename for i in z.infolist()] == names
    return n >= 0


@pytest.mark.parametrize("n", [0, 1, 63, 64, 65, 255, 256])
def test_plain_zips_accepted(n):
    data = _zip({f"d{i % 7}/k{i}.memmap": bytes(i % 5) for i in range(n)})
    assert check(data)


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
        {"meta.json": b"{}", "ä/b.memmap": b"x"},  # UTF-8 names: the Python path decodes
        {"meta.json": b"{}", "a\0b": b"1"},  # a NUL in a name would split wrongly
        {"a": b"1", "\0": b""},
    ],
)
def test_unusual_names_deferred(entries):
    # (zipfile cuts names at a NUL: written with "~" in its place, then patched)
    data = _zip({k.replace("\0", "~"): v for k, v in entries.items()}).replace(b"~", b"\0")
    assert not check(data)
    with policy.forced("always"):
        assert smallindex._parse_any(*_cd(data))[1] == list(entries)


def test_zip64_and_out_of_order_deferred(tmp_path):
    from fuzz.zipmodel import to_zip64
    from test_smallindex import _reordered

    seed = tdz_numba.save({"a": torch.arange(5), "b": {"c": torch.ones(3)}}, tmp_path / "s.tdz").read_bytes()
    assert check(seed)
    assert not check(to_zip64(seed))  # zip64 extras: read by the Python path
    data = _zip({"meta.json": b"{}", "a": b"1" * 10, "b": b"22", "c": b""})
    assert check(data)
    assert not check(_reordered(data, [2, 0, 3, 1]))  # accepted by the Python path, out of order


def test_duplicate_names_refused():
    data = bytearray(_zip({"meta.json": b"{}", "ab": b"1", "ac": b"2"}))
    cd_offset = eocd.find_end_record(bytes(data)).cd_offset
    third = data.index(b"PK\x01\x02", data.index(b"PK\x01\x02", cd_offset + 1) + 1)
    data[third + 46 : third + 48] = b"ab"
    assert check(bytes(data))  # the walk accepts; the names dict then refuses
    with policy.forced("always"):
        assert smallindex._parse_any(*_cd(bytes(data))) is None
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
    for name, data in _corrupt(seed).items():
        check(data)
        p = tmp_path / f"{name}.tdz"
        p.write_bytes(data)
        with policy.forced("always"):
            fast = _outcome(p)
        with policy.forced("never"):
            slow = _outcome(p)
        assert fast == slow, name
        raised += fast[0] == "open"
    assert raised >= 8


def test_mutated_archives_agree(tmp_path):
    """The fuzz harness's mutated archives: the kernel and the Python path agree, errors included."""
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
            if count <= smallindex.SMALL_ENTRIES:
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
    assert _walk(ro, cd_offset, count)[0] == 3
    small = np.zeros(1, np.int64)
    assert (
        cd_kernels.walk_central(ro, cd_offset, 2, small, np.zeros(len(cd), np.uint8))
        == cd_kernels.BAD_ARGUMENTS
    )
    assert cd_kernels.walk_central(ro, cd_offset, 2, np.zeros(2, np.int64), np.zeros(3, np.uint8)) < 0
    assert cd_kernels.walk_central(ro, -1, 2, np.zeros(2, np.int64), np.zeros(len(cd), np.uint8)) < 0
    assert _walk(ro, cd_offset, 3)[0] == cd_kernels.DEFER  # more counted than there are
    assert _walk(ro, cd_offset, 1)[0] == cd_kernels.DEFER  # fewer
    assert _walk(ro[:-1], cd_offset, 2)[0] == cd_kernels.DEFER  # a record cut short
    assert _walk(ro, 10, 2)[0] == cd_kernels.DEFER  # headers past the central directory
    assert _walk(ro[:0], cd_offset, 0)[0] == 0


def test_dispatch_falls_back_without_kernels():
    cd, cd_offset, count = _cd(_zip({"a": b"1"}))
    with policy.forced("never"):
        assert kernel_dispatch.walk_central(cd, cd_offset, count) is None
    with policy.forced("always"):
        starts, text = kernel_dispatch.walk_central(cd, cd_offset, count)
    assert list(starts) == [0] and text == "a"


_FUZZ = r"""
import random, resource, sys
import numpy as np
resource.setrlimit(resource.RLIMIT_AS, (4 << 30, 4 << 30))
sys.path.insert(0, sys.argv[1])
from tdz_numba.jit import policy
from tdz_numba.zipfmt import smallindex
from tdz_numba.zipfmt.kernels import dispatch as kernel_dispatch
from tdz_numba.zipfmt.kernels import names as cd_kernels
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
    oracle = smallindex._parse_central(cd, off, count) if count <= len(cd) // 46 else None
    with policy.forced("always"):
        fast = smallindex._parse_any(cd, off, count)
    if (oracle is None) != (fast is None) or (fast and (fast[1] != oracle[1] or list(fast[0]._starts) != oracle[0]._starts)):
        print("MISMATCH", k, cd.hex(), off, count)
        sys.exit(1)
    n = cd_kernels.walk_central(np.frombuffer(cd, np.uint8), off, count, np.zeros(count, np.int64), np.zeros(len(cd), np.uint8))
    accepted += n >= 0
    ok += 1
print("ok", ok, accepted)
"""


def test_fuzz_central_bytes_in_subprocess(tmp_path):
    """Random byte damage to central directories, walked in a child process (a read out of
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
    assert int(done.stdout.split()[2]) > 100, done.stdout  # damage the kernel accepts (names, lengths)


def _big_index(tmp_path: Path, entries: dict[str, bytes]) -> ArchiveIndex:
    p = tmp_path / "big.zip"
    p.write_bytes(_zip(entries))
    with policy.forced("always"):
        ix = ArchiveIndex(p)
    assert ix._small is None  # (more than SMALL_ENTRIES: the kernel path)
    return ix


def _slow_names(ix: ArchiveIndex) -> list[str]:
    with policy.forced("never"):
        return ix._decode_names()


@pytest.mark.parametrize("unusual", [None, "ä", "\0", "\x7f"])
def test_gather_names_against_slicing_and_zipfile(tmp_path, unusual):
    names = [f"d{i % 7}/k{i}.memmap" for i in range(300)]
    if unusual is not None:
        names[150] = f"x{unusual}y"
    ix = _big_index(tmp_path, dict.fromkeys([n.replace("\0", "~") for n in names], b"1"))
    if unusual == "\0":  # zipfile cuts names at a NUL: patched in after
        p = tmp_path / "nul.zip"
        p.write_bytes(ix.path.read_bytes().replace(b"x~y", b"x\0y"))
        with policy.forced("always"):
            ix = ArchiveIndex(p)
    assert ix.names == names == _slow_names(ix)
    joined = bytearray(ix.end.cd_size)
    n = cd_kernels.gather_names(ix.buffer, ix._cols, joined)
    assert n == (cd_kernels.DEFER if unusual in ("ä", "\0") else len("\0".join(names)))
    assert n == cd_kernels.gather_names.py_func(ix.buffer, ix._cols, bytearray(ix.end.cd_size))
    if unusual != "\0":
        with zipfile.ZipFile(ix.path) as z:
            assert z.namelist() == names


def test_gather_names_bounds(tmp_path):
    ix = _big_index(tmp_path, {f"k{i}": b"" for i in range(300)})
    cols, buf = ix._cols.copy(), ix.buffer
    total = len("\0".join(ix.names))
    assert cd_kernels.gather_names(buf, cols, bytearray(total)) == total
    assert cd_kernels.gather_names(buf, cols, bytearray(total - 1)) == cd_kernels.BAD_ARGUMENTS
    assert cd_kernels.gather_names(buf, cols[:, :5].copy(), bytearray(total)) == cd_kernels.BAD_ARGUMENTS
    for col, value in (
        (records.Col.NAME_OFFSET, -1),
        (records.Col.NAME_OFFSET, buf.size),
        (records.Col.NAME_LEN, -5),
    ):
        bad = cols.copy()
        bad[7, col] = value
        assert cd_kernels.gather_names(buf, bad, bytearray(buf.size)) == cd_kernels.DEFER
    bad = cols.copy()
    bad[7, records.Col.NAME_LEN] = buf.size
    assert cd_kernels.gather_names(buf, bad, bytearray(2 * buf.size)) == cd_kernels.DEFER
    assert cd_kernels.gather_names(buf, cols[:0], bytearray(0)) == 0
