"""GGUF tensor infos read in bulk (formats/gguf_bulk.py) against the per-record parser: the same
infos for files the gguf package writes, None (the per-record parser decides) for bad ones."""

from __future__ import annotations

import struct

import numpy as np
import pytest
import torch

from tdz_numba.errors import BadArchiveError
from tdz_numba.formats import gguf as gg
from tdz_numba.formats.gguf_bulk import bulk_infos

gguf = pytest.importorskip("gguf")
from test_formats_gguf import _header, _model, _pad, _tensor_info, _write  # noqa: E402


def _parse_both(path, monkeypatch):
    buf = memoryview(np.fromfile(path, np.uint8).data)
    fast = gg._parse(buf, str(path))
    with monkeypatch.context() as m:
        m.setattr(gg, "bulk_infos", lambda *a: None)
        slow = gg._parse(buf, str(path))
    return fast, slow


@pytest.mark.parametrize("alignment", [None, 64])
def test_bulk_equals_per_record(tmp_path, monkeypatch, alignment):
    rng = np.random.default_rng(3)
    tensors = _model(rng)
    tensors |= {f"many.{i}": (np.full(i % 5 + 1, i, np.float32), None) for i in range(50)}
    tensors["scalar-ish.é"] = (np.ones((1, 1, 1), np.float16), None)
    p = _write(tmp_path / "m.gguf", tensors, alignment=alignment)
    fast, slow = _parse_both(p, monkeypatch)
    assert fast == slow
    assert [i.name for i in fast[1]] == list(tensors)
    src = gg.open_gguf(p)
    for name, (arr, _) in tensors.items():
        spec = src.level("").children[name].leaf
        assert spec.offset == src.tensor_info[name].offset
        got = gg.tensor_from_spec(spec, src.files).reshape(-1).view(torch.uint8).numpy()
        assert got.tobytes() == np.ascontiguousarray(arr).tobytes()


@pytest.mark.parametrize(
    "info, tail",
    [
        (_tensor_info(dims=(1,) * 9), 64),  # too many dims
        (_tensor_info(ggml_type=5), 64),  # unknown type
        (_tensor_info(offset=8), 64),  # misaligned
        (_tensor_info(dims=(64,)), 64),  # past the end
        (_tensor_info(dims=(2**40, 2**40)), 64),
        (_tensor_info(offset=2**64 - 32), 64),
        (_tensor_info(dims=(0, 2**40, 2**40)), 64),
        (_tensor_info(dims=(48,), ggml_type=8), 64),  # row not whole blocks
        (_tensor_info(dims=(), ggml_type=12), 512),
        (_tensor_info() * 2, 64),  # duplicate name (count 2 below)
        (_tensor_info(name=b"x" * 100), 0),  # name runs past the end
    ],
)
def test_bulk_declines_bad_infos(tmp_path, info, tail):
    n = 2 if info.count(b"\x01\x00\x00\x00\x00\x00\x00\x00w") == 2 else 1
    data = _pad(_header(n, 0) + info) + b"\0" * tail
    if tail == 0:
        data = _header(n, 0) + info[:40]
    buf = np.frombuffer(data, np.uint8)
    assert bulk_infos(buf, len(_header(n, 0)), n, 32) is None
    p = tmp_path / "bad.gguf"
    p.write_bytes(data)
    with pytest.raises(BadArchiveError):
        gg.open_gguf(p)


def test_bulk_edges():
    """Zero-dimension tensors, the last record ending at the file's end, offsets at the end."""
    recs = _tensor_info(b"a", (), 0, 0) + _tensor_info(b"b", (0, 3), 1, 32) + _tensor_info(b"c", (2,), 26, 32)
    head = _header(3, 0)
    data = _pad(head + recs) + b"\1" * 40
    buf = np.frombuffer(data, np.uint8)
    infos, start = bulk_infos(buf, len(head), 3, 32)
    assert start == len(_pad(head + recs))
    assert [(i.name, i.type_name, i.shape, i.offset - start, i.nbytes) for i in infos] == [
        ("a", "F32", (), 0, 4),
        ("b", "F16", (3, 0), 32, 0),
        ("c", "I32", (2,), 32, 8),
    ]
    assert bulk_infos(buf[: start + 39], len(head), 3, 32) is None  # c's 8 bytes end past the file
    assert bulk_infos(np.frombuffer(head + recs[:-1], np.uint8), len(head), 3, 32) is None
    assert struct.unpack("<Q", recs[:8]) == (1,)


@pytest.mark.parametrize("n,kinds", [(1, 1), (2, 2), (146, 9), (5000, 40)])
def test_distinct_rows_against_unique(n, kinds):
    from tdz_numba.formats.gguf_bulk import MAX_DIMS, distinct_rows

    rng = np.random.default_rng(n)
    base = rng.integers(0, 1 << 63, (kinds, 2 + MAX_DIMS), dtype=np.uint64, endpoint=False)
    base[:, 2:] %= np.uint64(5)  # small dimensions: rows that differ in one place only
    rows = base[rng.integers(0, kinds, n)]
    rows.setflags(write=False)
    distinct, inverse = distinct_rows(rows)
    assert (distinct[inverse] == rows).all()
    want = np.unique(rows, axis=0)
    assert sorted(map(tuple, distinct.tolist())) == sorted(map(tuple, want.tolist()))


def test_distinct_rows_colliding_keys():
    """Two different rows with the same wrapping key (m1 * m0 == m0 * m1): still told apart."""
    from tdz_numba.formats import gguf_bulk

    mix = gguf_bulk._MIX
    rows = np.zeros((3, mix.size), np.uint64)
    rows[0, 0], rows[1, 1], rows[2, 2] = mix[1], mix[0], 7
    keys = (rows * mix).sum(axis=1, dtype=np.uint64)
    assert keys[0] == keys[1]  # the collision is real
    distinct, inverse = gguf_bulk.distinct_rows(rows)
    assert len(distinct) == 3 and (distinct[inverse] == rows).all()
