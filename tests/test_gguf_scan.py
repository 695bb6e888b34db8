"""The Numba record walk of GGUF tensor infos (formats/gguf_scan.py) against its oracle, the
Python walk of formats/gguf_bulk.bulk_infos: the same infos (or None), on files the gguf
package wrote, every truncation and random mutations of the tensor-info table."""

from __future__ import annotations

import random
import struct
from pathlib import Path

import numpy as np
import pytest

from tdz_numba.formats.gguf_bulk import bulk_infos
from tdz_numba.jit import policy

gguf = pytest.importorskip("gguf")


def _file(tmp_path: Path, tensors: dict[str, np.ndarray]) -> tuple[np.ndarray, int, int]:
    p = tmp_path / "m.gguf"
    w = gguf.GGUFWriter(str(p), "llama")
    for k, v in tensors.items():
        w.add_tensor(k, v)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    buf = np.frombuffer(p.read_bytes(), np.uint8)
    # the tensor-info table starts after the metadata: find it by the first name's length field
    name = next(iter(tensors)).encode()
    pos = bytes(buf).find(struct.pack("<Q", len(name)) + name)
    assert pos > 0
    return buf, pos, len(tensors)


def _both(buf: np.ndarray, pos: int, n: int) -> tuple[object, object]:
    with policy.forced("always"):
        fast = bulk_infos(buf, pos, n, 32)
    with policy.forced("never"):
        slow = bulk_infos(buf, pos, n, 32)
    return fast, slow


def test_same_infos_as_python(tmp_path: Path) -> None:
    tensors = {f"blk.{i}.w": np.full((i % 3 + 1, 4), i, np.float32) for i in range(300)}
    tensors["ünï"] = np.ones(3, np.float16)
    buf, pos, n = _file(tmp_path, tensors)
    fast, slow = _both(buf, pos, n)
    assert fast is not None and fast == slow
    assert [i.name for i in fast[0]] == list(tensors)


def test_truncations_and_mutations_agree(tmp_path: Path) -> None:
    buf, pos, n = _file(tmp_path, {"a": np.ones((2, 3), np.float32), "bb": np.ones(5, np.float16)})
    raw = bytes(buf)
    for k in range(pos, pos + 120):
        cut = np.frombuffer(raw[:k], np.uint8)
        assert _both(cut, pos, n)[0] == _both(cut, pos, n)[1]
    rng = random.Random(11)
    outcomes = set()
    for _ in range(1500):
        b = bytearray(raw)
        for _ in range(rng.randint(1, 2)):
            b[pos + rng.randrange(100)] = rng.choice([rng.randrange(256), 0, 1, 0xFF, 0x80])
        arr = np.frombuffer(bytes(b), np.uint8)
        fast, slow = _both(arr, pos, n)
        assert fast == slow
        outcomes.add(fast is None)
    assert outcomes == {True, False}


def test_names_with_nul_or_bad_bytes(tmp_path: Path) -> None:
    buf, pos, n = _file(tmp_path, {"ab": np.ones(2, np.float32), "cd": np.ones(2, np.float32)})
    b = bytearray(bytes(buf))
    i = b.find(b"ab", pos)
    b[i : i + 2] = b"a\x00"
    j = b.find(b"cd", pos)
    b[j : j + 2] = b"\xff\xfe"
    fast, slow = _both(np.frombuffer(bytes(b), np.uint8), pos, n)
    assert fast == slow and fast is not None
    assert [i.name for i in fast[0]] == ["a\x00", "\ufffd\ufffd"]


@pytest.mark.parametrize("kinds", [1, 2, 64, 65, 200])
def test_rows_grouped_in_the_kernel_or_by_the_caller(tmp_path: Path, kinds: int) -> None:
    """``gather_rows`` groups up to MAX_KINDS distinct (type, dims) rows itself; beyond, the
    caller's sort-based grouping takes over: the same infos as the Python path either way."""
    from tdz_numba.formats.gguf_scan import MAX_KINDS, rows

    tensors = {f"t{i}": np.full((i % kinds + 1, 2), i, np.float32) for i in range(300)}
    buf, pos, n = _file(tmp_path, tensors)
    fast, slow = _both(buf, pos, n)
    assert fast is not None and fast == slow
    assert [i.shape for i in fast[0][:3]] == [t.shape for t in list(tensors.values())[:3]]
    from tdz_numba.formats.gguf_scan import walk

    _, ends, ndims, _, _ = walk(buf, pos, n, 4)
    table, offsets, distinct, inverse = rows(buf, ends, ndims, 32, 4)
    if kinds > MAX_KINDS:
        assert distinct is None and inverse is None
    else:
        assert len(distinct) == kinds
        assert (distinct[inverse] == table).all()
    assert (offsets % 32 == 0).all() and offsets.tolist() == sorted(offsets.tolist())


def test_rows_refuse_offsets_out_of_the_file_or_misaligned(tmp_path: Path) -> None:
    from tdz_numba.formats.gguf_scan import rows, walk

    buf, pos, n = _file(tmp_path, {"a": np.ones((2, 3), np.float32), "b": np.ones(8, np.float32)})
    _, ends, ndims, _, _ = walk(buf, pos, n, 4)
    assert rows(buf, ends, ndims, 32, 4) is not None
    last = int(ends[-1]) + 4 + 8 * int(ndims[-1]) + 4  # the last record's offset field
    for value in (buf.size, buf.size + 1, 2**64 - 32, 33):  # past the end (wrapping too), misaligned
        b = bytearray(bytes(buf))
        b[last : last + 8] = struct.pack("<Q", value)
        arr = np.frombuffer(bytes(b), np.uint8)
        assert rows(arr, ends, ndims, 32, 4) is None
        assert _both(arr, pos, n) == (None, None)
