"""torch .pt bulk open: storage records found by key number in one compiled pass
(formats/pt_records.py) against the lookup by name (its twin), the scan's key numbers, shared
shape tuples; whole opens with the scan against the VM."""

from __future__ import annotations

import zipfile
from pathlib import Path

import numpy as np
import pytest
import torch

from tdz_numba.formats import pickle_scan, pickle_shapes, pt_records, torch_pt
from tdz_numba.jit import policy
from tdz_numba.zipfmt.index import ArchiveIndex


def _scanned(path: Path) -> tuple[ArchiveIndex, str, pickle_scan.Scanned]:
    index = ArchiveIndex(path)
    prefix = torch_pt._prefix(index, str(path))
    s = pickle_scan.scan(index.read_bytes(prefix + "data.pkl"))
    assert s is not None
    return index, prefix, s


def _by_name(index: ArchiveIndex, prefix: str, s: pickle_scan.Scanned) -> list[int]:
    return [index.row(prefix + "data/" + k) for k in s.storage_keys]


@pytest.mark.parametrize("count", [1, 2, 11, 120])
def test_rows_by_number_match_rows_by_name(tmp_path: Path, count: int) -> None:
    base = torch.arange(8.0)
    obj = {f"t{i}": torch.full((i % 3 + 1,), float(i)) for i in range(count)}
    obj["tied"] = obj["t0"][:]  # a shared storage: one key twice
    obj["view"] = base[2:5]
    obj["base"] = base
    p = tmp_path / "x.pt"
    torch.save(obj, p)
    index, prefix, s = _scanned(p)
    try:
        assert s.key_numbers is not None
        assert s.key_numbers.tolist() == [int(k) for k in s.storage_keys]
        rows = pt_records.rows_by_number(index, prefix, s.key_numbers)
        assert rows is not None and rows.tolist() == _by_name(index, prefix, s)
        assert torch_pt._record_rows(s, index, prefix).tolist() == rows.tolist()
        named = torch_pt._record_rows(s._replace(key_numbers=None), index, prefix)
        assert named.tolist() == rows.tolist()  # the twin: names looked up one by one
        ro = np.frombuffer(index.buffer.tobytes(), np.uint8)  # a read-only copy of the file
        t = index.table
        out = np.empty(len(s.names), np.int64)
        args = (np.ascontiguousarray(t["name_offset"]), np.ascontiguousarray(t["name_len"]))
        pre = np.frombuffer((prefix + "data/").encode(), np.uint8)
        assert pt_records.record_rows(ro, *args, pre, s.key_numbers, out) == 0
        assert out.tolist() == rows.tolist()
    finally:
        index.close()


def _zip_with(names: dict[str, bytes], path: Path) -> None:
    with zipfile.ZipFile(path, "w") as z:
        for n, b in names.items():
            z.writestr(n, b)


@pytest.mark.parametrize(
    ("entries", "keys", "expect"),
    [
        (["a/data/0", "a/data/1"], [1, 0, 1], [1, 0, 1]),
        (["a/data/0", "a/data/01"], [1], None),  # "01" is not the name of key 1
        (["a/data/0"], [1], None),  # no record
        (["a/data/0"], [-1], None),  # a key that is not a number
        (["a/data/0", "a/data/7"], [0], [0]),
        (["b/data/0"], [0], None),  # another prefix
        (["a/data/0", "a/data/x"], [0], [0]),
        (["a/data/" + "9" * 19], [0], None),  # longer than any number the scan writes
        ([f"a/data/{k}" for k in range(30)], [29, 3], [29, 3]),
    ],
)
def test_record_rows_edges(tmp_path: Path, entries: list[str], keys: list[int], expect: list[int] | None):
    p = tmp_path / "z.zip"
    _zip_with({e: b"xx" for e in entries}, p)
    index = ArchiveIndex(p)
    try:
        got = pt_records.rows_by_number(index, "a/", np.array(keys, np.int64))
        assert (None if got is None else got.tolist()) == expect
    finally:
        index.close()


def test_keys_far_apart_decline(tmp_path: Path) -> None:
    p = tmp_path / "z.zip"
    _zip_with({"a/data/0": b"", "a/data/100000": b""}, p)
    index = ArchiveIndex(p)
    try:
        assert pt_records.rows_by_number(index, "a/", np.array([0, 100000])) is None  # the table's reach
        assert pt_records.rows_by_number(index, "a/", np.array([0])).tolist() == [0]
    finally:
        index.close()


def test_shared_shape_tuples_equal_per_row_tuples() -> None:
    block = np.array([[2, 3], [2, 3], [2, 3]])
    got = pickle_shapes._rows(block)
    assert got == [(2, 3)] * 3 and got[0] is got[2]
    mixed = pickle_shapes._rows(np.array([[2, 3], [3, 2]]))
    assert mixed == [(2, 3), (3, 2)]


def _opened(path: Path) -> list:
    src = torch_pt.open_torch(path)
    try:
        return [(k, c.leaf) for k, c in src.level("").children.items()]
    finally:
        src.close()


@pytest.mark.parametrize("layout", ["uniform", "mixed", "views"])
def test_open_matches_the_vm(tmp_path: Path, layout: str) -> None:
    x = torch.arange(24.0).reshape(4, 6)
    obj = {
        "uniform": {f"w{i}": torch.ones(5, dtype=torch.float16) for i in range(300)},
        "mixed": {
            f"w{i}": torch.ones(i % 4 + 1, dtype=(torch.float32, torch.int8)[i % 2]) for i in range(50)
        },
        "views": {"x": x, "t": x.t(), "row": x[1], "tail": x[2:], "e": torch.ones(3).expand(2, 3)},
    }[layout]
    p = tmp_path / "x.pt"
    torch.save(obj, p)
    with policy.forced("always"):
        fast = _opened(p)
    with policy.forced("never"):
        slow = _opened(p)
    assert fast == slow and [k for k, _ in fast] == list(obj)


def test_a_name_set_twice_reads_as_the_vm_reads_it(tmp_path: Path) -> None:
    """A flat dict whose pickle sets one name twice (the scan leaves repeated names to the
    reader's dict of specs): the VM's tree, the last value kept."""
    from test_pickle_scan import _mutated, _pickle_of_file

    p = tmp_path / "x.pt"
    torch.save({"aa": torch.ones(2), "ab": torch.zeros(3), "c": torch.ones(1)}, p)
    q = tmp_path / "dup.pt"
    _mutated(p, q, lambda b: b.replace(b"X\x02\x00\x00\x00ab", b"X\x02\x00\x00\x00aa"))
    assert pickle_scan.scan(_pickle_of_file(q)) is None
    assert pickle_scan.scan(_pickle_of_file(q), unique=False) is not None
    with policy.forced("always"):
        fast = _opened(q)
    with policy.forced("never"):
        slow = _opened(q)
    assert fast == slow and [k for k, _ in fast] == ["aa", "c"] and fast[0][1].shape == (3,)
