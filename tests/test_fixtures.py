"""Golden archives in tests/fixtures, checked byte for byte and value for value.

Ours (``ours_*.tdz``) are written with the DOS timestamp fixed, so today's
writer must reproduce them exactly: any format drift fails here. tensordict's
(``td_*.tdz``, written by tensordict 0.15.3 with their timestamps zeroed) must
load with the expected values, and our writer must produce the same bytes as
``td_stored.tdz`` apart from the timestamps, without a live tensordict.

Regenerate (only after a deliberate format change) from the repository root::

    python tests/test_fixtures.py          # ours
    python tests/test_fixtures.py --td     # tensordict's (needs tensordict==0.15.3)
"""

from __future__ import annotations

import io
import sys
import zipfile
from pathlib import Path

import numpy as np
import pytest
import torch
from ziputil import zero_timestamps

import tdz_numba
from tdz_numba.tdz import tree
from tdz_numba.zipfmt import eocd, members, packers, records, writer

HERE = Path(__file__).resolve().parent
FIXTURES = HERE / "fixtures"

DOS = (0, 33)  # 1980-01-01 00:00:00
SEGMENT = 4096  # small deflate segments: a segment table in a few KiB


def expected_tree() -> dict:
    """The tree every fixture holds (values chosen so that every byte is known)."""
    return {
        "a": torch.arange(12, dtype=torch.float32).reshape(3, 4),
        "b": {
            "c": torch.tensor([1, -2, 3], dtype=torch.int16),
            "é": torch.full((5,), 1.5, dtype=torch.bfloat16),
        },
        "flag": torch.tensor([True, False, True]),
        "tag": "hello",
        "z": torch.zeros(3000, dtype=torch.float32),  # 12,000 bytes: three deflate segments
    }


def _write_ours(path: Path, compression: str | None) -> bytes:
    real = packers.dos_datetime
    packers.dos_datetime = lambda timestamp=None: DOS  # type: ignore[assignment]
    try:
        writer.write_entries(
            tree.flatten(expected_tree()),
            path,
            compression=compression,
            segment_size=SEGMENT if compression else None,
        )
    finally:
        packers.dos_datetime = real  # type: ignore[assignment]
    return path.read_bytes()


def _with_zip64_end(buf: bytes) -> bytes:
    """``buf`` with zip64 end records (a reader must accept them on a small archive)."""
    end = eocd.find_end_record(buf)
    stop = end.cd_offset + end.cd_size
    return buf[:stop] + packers.end_records(end.count, end.cd_offset, end.cd_size, True)


def make_ours(directory: Path, tmp: Path) -> dict[str, bytes]:
    stored = _write_ours(tmp / "s.tdz", None)
    return {
        "ours_stored.tdz": stored,
        "ours_deflate.tdz": _write_ours(tmp / "d.tdz", "deflate"),
        "ours_zip64_end.tdz": _with_zip64_end(stored),
    }


def make_td(directory: Path, tmp: Path) -> dict[str, bytes]:  # pragma: no cover - needs tensordict
    from tensordict import TensorDict

    out = {}
    for name, kw in (("td_stored.tdz", {}), ("td_deflate.tdz", {"compression": "deflate"})):
        td = TensorDict(expected_tree(), batch_size=[])
        td.save(tmp / name, **kw)
        out[name] = zero_timestamps((tmp / name).read_bytes())
    return out


def _assert_values(loaded) -> None:
    exp = expected_tree()
    assert loaded["tag"] == exp["tag"]
    for key in ("a", "flag", "z"):
        assert loaded[key].dtype == exp[key].dtype and torch.equal(loaded[key], exp[key]), key
    for key in ("c", "é"):
        assert loaded["b"][key].dtype == exp["b"][key].dtype and torch.equal(loaded["b"][key], exp["b"][key])


OURS = ["ours_stored.tdz", "ours_deflate.tdz", "ours_zip64_end.tdz"]
THEIRS = ["td_stored.tdz", "td_deflate.tdz"]


@pytest.fixture(scope="module")
def regenerated(tmp_path_factory):
    return make_ours(FIXTURES, tmp_path_factory.mktemp("fixtures"))


@pytest.mark.parametrize("name", OURS)
def test_our_writer_reproduces_the_golden_bytes(regenerated, name):
    golden = (FIXTURES / name).read_bytes()
    got = regenerated[name]
    first = next((i for i, (x, y) in enumerate(zip(golden, got)) if x != y), min(len(golden), len(got)))
    assert got == golden, (
        f"{name}: {len(got)} bytes written, {len(golden)} golden; first difference at {first}"
    )


@pytest.mark.parametrize("name", OURS + THEIRS)
def test_golden_archives_load_verify_and_parse_with_zipfile(name):
    path = FIXTURES / name
    _assert_values(tdz_numba.load(path))
    assert tdz_numba.is_archive(path)
    assert tdz_numba.verify(path).leaves == 5  # tensors; the string is a NonTensorData level
    buf = path.read_bytes()
    with zipfile.ZipFile(io.BytesIO(buf)) as zf:
        assert zf.testzip() is None
        assert zf.namelist()[0] == "meta.json"
        info = zf.getinfo("a.memmap")
        if info.compress_type == zipfile.ZIP_STORED:
            n, e = np.frombuffer(buf[info.header_offset + 26 : info.header_offset + 30], "<u2")
            assert (info.header_offset + 30 + int(n) + int(e)) % records.ALIGNMENT == 0


def test_deflate_fixture_has_a_segment_table():
    from tdz_numba.zipfmt.index import ArchiveIndex

    index = ArchiveIndex(FIXTURES / "ours_deflate.tdz")
    e = index.entry("z.memmap")
    table = members.parse_segment_table(index.local_extra(e), "z.memmap")
    assert e.method == records.DEFLATED and table is not None
    segment, lengths = table
    assert segment == SEGMENT and len(lengths) == 3


def test_zip64_end_fixture_has_zip64_end_records():
    end = eocd.find_end_record((FIXTURES / "ours_zip64_end.tdz").read_bytes())
    assert end.zip64 and end.count == 8


def test_our_stored_bytes_equal_tensordicts_apart_from_timestamps():
    """tensordict 0.15.3's ``td.save`` of the same tree, checked without tensordict."""
    ours = zero_timestamps((FIXTURES / "ours_stored.tdz").read_bytes())
    assert ours == (FIXTURES / "td_stored.tdz").read_bytes()


def test_fixtures_stay_small():
    assert sum(p.stat().st_size for p in FIXTURES.glob("*.tdz")) < 200_000


if __name__ == "__main__":  # pragma: no cover - regenerates the fixtures
    import tempfile

    FIXTURES.mkdir(exist_ok=True)
    with tempfile.TemporaryDirectory() as d:
        made = make_td(FIXTURES, Path(d)) if "--td" in sys.argv else make_ours(FIXTURES, Path(d))
        for fname, data in made.items():
            (FIXTURES / fname).write_bytes(data)
            print(fname, len(data))
