"""The Numba scan of flat ``torch.save`` dicts (formats/pickle_scan.py) against the restricted VM.

The oracle is the VM path (``TDZ_NUMBA_KERNELS=never``: no scan): a file opened with the scan
must give the same specs, in the same order, with the same level meta, or the same error.
"""

from __future__ import annotations

import io
import random
import zipfile
import zlib
from collections import OrderedDict
from pathlib import Path
from typing import Any

import pytest
import torch

from tdz_numba import errors, formats
from tdz_numba.formats import pickle_scan, torch_pt
from tdz_numba.jit import policy


def _pickle(obj: Any) -> bytes:
    buf = io.BytesIO()
    torch.save(obj, buf)
    z = zipfile.ZipFile(buf)
    return z.read(next(n for n in z.namelist() if n.endswith("data.pkl")))


def _opened(path: Path) -> Any:
    """(meta, [(key, spec)]) of the file's root level, or (error type, message)."""
    try:
        src = torch_pt.open_torch(path)
    except errors.TdzError as exc:
        return type(exc), str(exc)
    try:
        level = src.level("")
        leaves = [(k, c.leaf) for k, c in level.children.items()]
        # a loader is a closure (a copy with conj/neg applied): compared by its presence
        return level.meta, [
            (k, v._replace(loader=bool(v.loader)) if hasattr(v, "loader") else v) for k, v in leaves
        ]
    finally:
        src.close()


def _both(path: Path) -> tuple[Any, Any]:
    with policy.forced("always"):
        fast = _opened(path)
    with policy.forced("never"):
        slow = _opened(path)
    return fast, slow


CASES = {
    "flat": {"a": torch.arange(6.0).reshape(2, 3), "b": torch.ones(3, dtype=torch.int64)},
    "dtypes": {
        "h": torch.ones(4, dtype=torch.float16),
        "bf": torch.ones(2, 2, dtype=torch.bfloat16),
        "b": torch.tensor([True, False]),
        "c": torch.ones(3, dtype=torch.complex64),
        "u8": torch.arange(5, dtype=torch.uint8),
    },
    "shapes": {"s0": torch.tensor(3.5), "e": torch.zeros(0, 4), "r5": torch.ones(1, 2, 1, 3, 2)},
    "views": (lambda x: {"t": x.t(), "row": x[1], "col": x[:, 2], "x": x, "slice": x[1:, 1:]})(
        torch.arange(20.0).reshape(4, 5)
    ),
    "grad": {"g": torch.ones(2, requires_grad=True)},
    "unicode": {"päräm.ü": torch.ones(1), "": torch.zeros(2), "a b/c": torch.ones(2)},
    "big": {f"layer.{i}.weight": torch.full((i % 3 + 1, 2), float(i)) for i in range(700)},
}


@pytest.mark.parametrize("name", sorted(CASES))
def test_scan_matches_vm(name: str, tmp_path: Path) -> None:
    p = tmp_path / "x.pt"
    torch.save(CASES[name], p)
    assert pickle_scan.scan(_pickle(CASES[name])) is not None  # the fast path is taken
    fast, slow = _both(p)
    assert fast == slow
    assert [k for k, _ in fast[1]] == list(CASES[name])
    with policy.forced("always"):
        got = formats.to_tree(formats.open_source(p))
    for k, v in CASES[name].items():
        assert got[k].dtype == v.dtype and torch.equal(got[k], v.detach())


def test_scan_fields(tmp_path: Path) -> None:
    x = torch.arange(12, dtype=torch.int32).reshape(3, 4)
    s = pickle_scan.scan(_pickle(OrderedDict([("w", x.t()), ("v", x[2])])))
    assert s is not None
    assert s.names == ["w", "v"] and s.storage_keys == ["0", "0"] and s.root == "OrderedDict"
    assert s.shapes == [(4, 3), (4,)] and s.strides == [(1, 4), (1,)]
    assert s.offsets.tolist() == [0, 8] and s.numels.tolist() == [12, 12]
    assert s.storage_types == [("torch", "IntStorage")] * 2 and s.locations == ["cpu", "cpu"]


@pytest.mark.parametrize(
    "obj",
    [
        {"nested": {"a": torch.ones(2)}},  # a sub-level
        {"a": torch.ones(2), "step": 3},  # a plain value
        [torch.ones(2)],  # a list root
        torch.nn.Linear(2, 2).state_dict(),  # OrderedDict with _metadata (BUILD)
        {"p": torch.nn.Parameter(torch.ones(2))},  # _rebuild_parameter
        {"n": torch._neg_view(torch.ones(2))},  # metadata argument
        {},
    ],
    ids=["nested", "value", "list", "module", "parameter", "neg", "empty"],
)
def test_other_shapes_go_to_the_vm(obj: Any, tmp_path: Path) -> None:
    assert pickle_scan.scan(_pickle(obj)) is None
    p = tmp_path / "x.pt"
    torch.save(obj, p)
    fast, slow = _both(p)
    assert fast == slow


def test_scan_of_every_prefix_and_of_mutations_is_safe() -> None:
    data = _pickle({"w": torch.ones(2, 3), "v": torch.arange(4), "z": torch.ones(1)[0]})
    assert pickle_scan.scan(data) is not None
    for k in range(len(data)):
        assert pickle_scan.scan(data[:k]) is None  # STOP is the last byte: no prefix is whole
    rng = random.Random(5)
    for _ in range(2000):
        b = bytearray(data)
        for _ in range(rng.randint(1, 3)):
            b[rng.randrange(len(b))] = rng.randrange(256)
        s = pickle_scan.scan(bytes(b))  # never an exception or a crash
        assert s is None or len(s.names) == len(s.shapes) == len(s.strides) == len(s.storage_keys)


def _mutated(src: Path, dst: Path, fn: Any) -> None:
    """A copy of the torch zip ``src`` whose data.pkl is ``fn(data.pkl)`` (same length)."""
    raw = bytearray(src.read_bytes())
    data = _pickle_of_file(src)
    at = raw.find(data)
    new = fn(bytearray(data))
    assert len(new) == len(data) and at > 0
    raw[at : at + len(data)] = new
    old_crc, new_crc = (zlib.crc32(x).to_bytes(4, "little") for x in (data, bytes(new)))
    assert raw.count(old_crc) == 2  # the local header's and the central directory's
    dst.write_bytes(bytes(raw).replace(old_crc, new_crc))


def _pickle_of_file(p: Path) -> bytes:
    z = zipfile.ZipFile(p)
    return z.read(next(n for n in z.namelist() if n.endswith("data.pkl")))


def test_mutated_files_agree_with_the_vm(tmp_path: Path) -> None:
    """Random byte changes of the pickle (the zip's CRC is not checked on open): the scan's path
    gives the VM's tree or the VM's error, every time."""
    p = tmp_path / "x.pt"
    x = torch.arange(24.0).reshape(4, 6)
    torch.save({"w": x, "t": x.t(), "r": x[2], "b": torch.ones(3, dtype=torch.bool)}, p)
    rng = random.Random(7)
    data = _pickle_of_file(p)
    outcomes: set[Any] = set()
    for trial in range(150):
        q = tmp_path / f"m{trial}.pt"

        def flip(b: bytearray) -> bytearray:
            for _ in range(rng.randint(1, 2)):
                b[rng.randrange(2, len(b))] = rng.choice([rng.randrange(256), 0x4B, 0x28, 0x85, 0x74, 0xFF])
            return b

        _mutated(p, q, flip)
        fast, slow = _both(q)
        assert fast == slow, (trial, fast, slow)
        outcomes.add(fast[0] if isinstance(fast[0], type) else "tree")
    assert data  # the pickle was found in the file
    assert "tree" in outcomes and errors.BadArchiveError in outcomes and errors.ChecksumError not in outcomes


def test_bad_claims_raise_the_vm_errors(tmp_path: Path) -> None:
    """A storage that holds fewer elements than claimed, an offset past the storage: the
    same error with the scan as without."""
    p = tmp_path / "x.pt"
    torch.save({"a": torch.ones(4), "b": torch.ones(2)}, p)
    data = _pickle_of_file(p)
    # numel of the second storage 2 -> 200 (BININT1 2 follows the 'cpu' get in its persistent id)
    i = data.rfind(b"K\x02t")
    assert i > 0
    q = tmp_path / "numel.pt"
    _mutated(p, q, lambda b: b[:i] + b"K\xc8t" + b[i + 3 :])
    fast, slow = _both(q)
    assert fast == slow and fast[0] is errors.BadArchiveError and "claims 200" in fast[1]
    # storage offset of "b": BINPERSID then BININT1 0 -> 9 (past its 2 elements)
    j = data.rfind(b"QK\x00")
    q = tmp_path / "offset.pt"
    _mutated(p, q, lambda b: b[: j + 2] + b"\x09" + b[j + 3 :])
    fast, slow = _both(q)
    assert fast == slow and fast[0] is errors.BadArchiveError and "storage offset 9" in fast[1]
