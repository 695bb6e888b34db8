"""ArchiveIndex.check_all of a small archive whose headers lie close together: each header
resolved by zipfmt.central.check_small (no columns, no kernel) against the kernel's (or twin's)
pass over the columns: the same payload offsets, columns and rows, the same error (type and
message) and the index left as it was after one, on valid archives, the fixtures and
thousands of mutated archives (the fuzz harness's mutators), and on .pt / .tdz / npz loads."""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

import tdz_numba  # noqa: E402
from tdz_numba.errors import TdzError  # noqa: E402
from tdz_numba.zipfmt import central  # noqa: E402
from tdz_numba.zipfmt import index as reader  # noqa: E402
from tdz_numba.zipfmt.index import ArchiveIndex  # noqa: E402

CASES = 1500


def _observe(path: Path, small: bool) -> tuple[list, bool]:
    """What check_all right after an open shows (errors included), and whether check_small ran."""
    ran = []
    real = central.check_small

    def spy(*a):
        ran.append(1)
        return real(*a) if small else False  # False: the kernel's (or twin's) pass

    reader.check_small = spy
    try:
        try:
            ix = ArchiveIndex(path)
        except TdzError as exc:
            return ["open", type(exc).__name__, str(exc)], False
        out: list = []
        try:
            ix.check_all()
            out.append("ok")
        except TdzError as exc:
            out += [type(exc).__name__, str(exc), ix.local_checked]
        out.append(ix._cols.tolist())
        out.append([tuple(r) for r in ix.rows])
        for i in range(len(ix.names)):
            try:
                out.append(ix.payload_offset(i))
            except TdzError as exc:
                out.append((type(exc).__name__, str(exc)))
        ix.close()
        return out, bool(ran)
    finally:
        reader.check_small = real


def _same(path: Path) -> bool:
    got, took = _observe(path, True)
    want, _ = _observe(path, False)
    assert got == want, path
    return took and got[0] == "ok"


@pytest.fixture(scope="module")
def seeds(tmp_path_factory):
    from fuzz.seeds import make_seeds

    return make_seeds(tmp_path_factory.mktemp("checksmallseeds"))


def test_valid_and_mutated_archives_agree(seeds, tmp_path):
    from fuzz.runner import make_cases

    taken = 0
    for sd in seeds:
        p = tmp_path / f"{sd.name}.tdz"
        p.write_bytes(sd.data)
        taken += _same(p)
    assert taken >= len(seeds) // 2  # most seeds are small archives of near headers
    bad = 0
    for case in make_cases(seeds, "checksmall-1", 0, CASES):
        p = tmp_path / "case.tdz"
        p.write_bytes(case.data)
        got, took = _observe(p, True)
        assert got == _observe(p, False)[0]
        bad += took and got[0] != "ok"
    assert bad > 0  # some mutations break a local header the small check then hands on


def test_fixtures_agree(tmp_path):
    import gzip

    here = Path(__file__).resolve().parent / "fixtures"
    for p in sorted(here.glob("*.tdz")):
        _same(p)
    for i, gz in enumerate(sorted((here / "hostile").glob("*.bin.gz"))):
        p = tmp_path / f"h{i}.tdz"
        p.write_bytes(gzip.decompress(gz.read_bytes()))
        _same(p)


def test_loads_take_it(tmp_path):
    """A one-tensor .pt, a small .tdz and npz: check_small runs and the tensors are right; a
    local header's name changed (the central directory's kept) is refused as before."""
    import zipfile

    t = {"a": torch.arange(6.0).reshape(2, 3), "b": torch.ones(4, dtype=torch.float16)}
    paths = [tmp_path / "m.pt", tmp_path / "m.tdz", tmp_path / "m.npz"]
    torch.save(t, paths[0])
    tdz_numba.save(t, paths[1], durable=False)
    many = {f"m{i}": np.full(3, i, np.float32) for i in range(6)}  # (an npz of <= 4 members is
    np.savez(paths[2], **{k: v.numpy() for k, v in t.items()}, **many)  # read member by member)
    for p in paths:
        ran = []
        real = central.check_small
        reader.check_small = lambda *a, ran=ran, real=real: ran.append(1) or real(*a)
        try:
            got = tdz_numba.load(p)
        finally:
            reader.check_small = real
        assert all(torch.equal(torch.as_tensor(got[k]), v) for k, v in t.items()), p
        if p.suffix != ".tdz":  # (a .tdz load reads its headers one by one, lazily)
            assert ran, p
    data = bytearray(paths[0].read_bytes())
    name = next(i.filename for i in zipfile.ZipFile(paths[0]).infolist() if i.filename.endswith("data/0"))
    at = data.find(name.encode())  # the first copy: the local header's
    data[at + len(name) - 1 : at + len(name)] = b"9"
    bad = tmp_path / "bad.pt"
    bad.write_bytes(bytes(data))
    errors = []
    for small in (True, False):
        real = central.check_small
        reader.check_small = real if small else (lambda *a: False)
        try:
            with pytest.raises(TdzError) as exc:
                tdz_numba.load(bad)
            errors.append((type(exc.value).__name__, str(exc.value)))
        finally:
            reader.check_small = real
    assert errors[0] == errors[1]
