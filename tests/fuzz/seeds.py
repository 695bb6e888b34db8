"""Seed archives of the fuzz harness, written by tdz_numba, by tensordict 0.15.3 and by zipfile.

Every seed is small (a few KiB: failing cases are kept as fixtures) and
deterministic (fixed tensors, DOS timestamps normalized), so that a case
number names the same bytes on every run. ``subpaths`` of a seed are the
levels ``load(subpath=...)`` is tried on.

Examples
--------
>>> sorted(SEED_NAMES)[:3]
['bzip2', 'deep_levels', 'deflate_segments']
"""

from __future__ import annotations

import io
import json
import zipfile
from dataclasses import dataclass
from pathlib import Path

from tensordict import tensorclass

from .zipmodel import normalize_times, to_zip64

__all__ = ["Seed", "SEED_NAMES", "make_seeds", "load_seeds"]


@dataclass(frozen=True)
class Seed:
    """One seed: its ``name``, its bytes and the subpaths to load."""

    name: str
    data: bytes
    subpaths: tuple[str, ...]


@tensorclass
class FuzzTC:
    x: object
    s: str


def _tree():
    import numpy as np
    import torch

    g = torch.Generator().manual_seed(0)
    return {
        "a": torch.randn(4, 8, generator=g),
        "obs": {
            "pix": torch.arange(96, dtype=torch.uint8).reshape(2, 3, 16),
            "depth": np.linspace(0, 1, 12, dtype=np.float32).reshape(3, 4),
            "bf": torch.ones(5, dtype=torch.bfloat16),
        },
        "flag": torch.tensor([True, False, True]),
        "c": torch.zeros(3, dtype=torch.complex64),
        "i": torch.arange(10, dtype=torch.int64),
    }


def _compressible():
    import torch

    # several KiB, compressible: deflate cuts it into many segments (small SEGMENT_SIZE)
    return {
        "z": torch.arange(4096, dtype=torch.int32) % 7,
        "w": torch.zeros(300, 5),
        "sub": {"v": torch.arange(1000, dtype=torch.int16)},
    }


def _tdz(tree, path: Path, **kw) -> bytes:
    import tdz_numba

    tdz_numba.save(tree, path, **kw)
    return normalize_times(path.read_bytes())


def _td_seeds(work: Path) -> dict[str, tuple[bytes, tuple[str, ...]]]:
    """Seeds written by tensordict 0.15.3 itself (``td.save(path.tdz)``)."""
    import torch
    from tensordict import LazyStackedTensorDict, NonTensorData, TensorDict

    out = {}
    td = TensorDict(
        a=torch.arange(12.0).reshape(3, 4),
        b=TensorDict(c=torch.ones(3, 2, dtype=torch.int16), s=NonTensorData("hi"), batch_size=[3]),
        e=torch.zeros(3, 0),
        batch_size=[3],
    )
    for comp in (None, "deflate", "bzip2"):
        p = work / f"td_{comp}.tdz"
        td.save(p, compression=comp) if comp else td.save(p)
        out[f"td_{comp or 'stored'}"] = (normalize_times(p.read_bytes()), ("b",))
    lazy = LazyStackedTensorDict.lazy_stack(
        [TensorDict(a=torch.zeros(2, 3), batch_size=[2]), TensorDict(a=torch.ones(2, 4), batch_size=[2])], 1
    )
    p = work / "td_lazy.tdz"
    TensorDict(z=lazy, w=torch.arange(2), batch_size=[2]).save(p)
    out["td_lazy"] = (normalize_times(p.read_bytes()), ("z", "z/0"))
    return out


def _descriptor_zip(seed: bytes) -> bytes:
    """The entries of ``seed`` re-zipped by zipfile into an unseekable stream: data
    descriptors (flag bit 3), deflate without a segment table, no alignment."""

    class Unseekable(io.RawIOBase):
        def __init__(self):
            self.buf = bytearray()

        def writable(self):
            return True

        def write(self, b):
            self.buf += b
            return len(b)

    src = zipfile.ZipFile(io.BytesIO(seed))
    sink = Unseekable()
    with zipfile.ZipFile(sink, "w") as z:
        for info in src.infolist():
            zi = zipfile.ZipInfo(info.filename, date_time=(1980, 1, 1, 0, 0, 0))
            zi.compress_type = (
                zipfile.ZIP_DEFLATED if info.filename.endswith(".memmap") else zipfile.ZIP_STORED
            )
            z.writestr(zi, src.read(info.filename))
    return bytes(sink.buf)


def _deep_levels(n: int = 1100) -> bytes:
    """``n`` nested levels ``d/d/d/...``, each a TensorDict with one sub-level."""
    buf = io.BytesIO()
    level = {
        "shape": [],
        "device": "cpu",
        "_type": "<class 'tensordict._td.TensorDict'>",
        "_format_version": 1,
        "_class": "tensordict:TensorDict",
    }
    with zipfile.ZipFile(buf, "w") as z:
        for i in range(n + 1):
            meta = (
                {"d": {"type": "TensorDict"}}
                if i < n
                else {"x": {"device": "cpu", "shape": [2], "dtype": "torch.float32", "is_nested": False}}
            ) | level
            prefix = "d/" * i
            z.writestr(zipfile.ZipInfo(prefix + "meta.json"), json.dumps(meta))
            if i == n:
                z.writestr(zipfile.ZipInfo(prefix + "x.memmap"), bytes(8))
    return buf.getvalue()


def _long_name(seed: bytes, n: int = 1500) -> bytes:
    """``seed`` plus one entry whose name has ``n`` path components."""
    src = zipfile.ZipFile(io.BytesIO(seed))
    buf = io.BytesIO()
    with zipfile.ZipFile(buf, "w") as z:
        for info in src.infolist():
            z.writestr(zipfile.ZipInfo(info.filename), src.read(info.filename))
        z.writestr(zipfile.ZipInfo("q/" * n + "f.memmap"), b"12345678")
    return buf.getvalue()


def _grown_seeds(work: Path) -> dict[str, tuple[bytes, tuple[str, ...]]]:
    """Archives that appends grew (dead space: the old central directory and end records, then
    new entries and a central directory that keeps old records byte for byte), and archives with
    digest blocks (``0x6874``, central records only) before and after an append."""
    import torch

    import tdz_numba

    out: dict[str, tuple[bytes, tuple[str, ...]]] = {}
    p = work / "appended.tdz"
    tdz_numba.save(_tree(), p)
    tdz_numba.append(p, {"obs": {"new": torch.arange(6, dtype=torch.int16)}, "x": "text"})
    tdz_numba.append(p, {"a": torch.ones(2, 3)}, replace=True)  # a superseded entry: dead bytes
    out["appended"] = (normalize_times(p.read_bytes()), ("obs", "x"))
    q = work / "digest.tdz"
    tdz_numba.save(_tree(), q, digest=True, align="auto")
    out["digest"] = (normalize_times(q.read_bytes()), ("obs",))
    tdz_numba.append(q, {"obs": {"depth": torch.zeros(3, 4)}, "y": torch.arange(3)}, replace=True)
    out["digest_appended"] = (normalize_times(q.read_bytes()), ("obs",))
    return out


def make_seeds(work: Path) -> list[Seed]:
    """Writes every seed (deterministically) and returns them, in a fixed order."""
    import numpy as np
    import torch
    from tensordict import TensorDict

    from tdz_numba.zipfmt import members

    work.mkdir(parents=True, exist_ok=True)
    s: dict[str, tuple[bytes, tuple[str, ...]]] = {}
    s["stored"] = (_tdz(_tree(), work / "stored.tdz"), ("obs",))
    old = members.SEGMENT_SIZE
    members.SEGMENT_SIZE = 2048  # several segments per entry: a segment table with many rows
    try:
        s["deflate_segments"] = (_tdz(_compressible(), work / "defl.tdz", compression="deflate"), ("sub",))
    finally:
        members.SEGMENT_SIZE = old
    s["bzip2"] = (_tdz(_compressible(), work / "bz.tdz", compression="bzip2"), ("sub",))
    s["lzma"] = (_tdz(_compressible(), work / "lz.tdz", compression="lzma"), ("sub",))
    deep = {"l1": {"l2": {"l3": {"x": torch.ones(3), "l4": {"y": torch.arange(4)}}}}, "top": torch.zeros(2)}
    s["nested"] = (_tdz(deep, work / "nested.tdz"), ("l1", "l1/l2/l3", "l1/l2/l3/l4"))
    nt = torch.nested.nested_tensor([torch.arange(6.0).reshape(2, 3), torch.ones(4, 3)])
    s["nested_tensor"] = (_tdz({"nt": nt, "d": torch.ones(2)}, work / "nt.tdz"), ())
    from tensordict import LazyStackedTensorDict

    lazy = LazyStackedTensorDict.lazy_stack(
        [TensorDict(a=torch.zeros(2, 3), batch_size=[2]), TensorDict(a=torch.ones(2, 5), batch_size=[2])], 1
    )
    s["lazy_stack"] = (
        _tdz(TensorDict(z=lazy, w=torch.arange(2), batch_size=[2]), work / "lazy.tdz"),
        ("z", "z/1"),
    )
    s["tensorclass"] = (
        _tdz(
            TensorDict(
                tc=FuzzTC(x=torch.ones(2, 2), s="inner", batch_size=[2]), y=torch.zeros(2), batch_size=[2]
            ),
            work / "tc.tdz",
        ),
        ("tc",),
    )
    s["non_tensor"] = (
        _tdz(
            {
                "s": "hello",
                "n": None,
                "l": [1, 2.5, "x"],
                "big": 10**20,
                "t": torch.ones(1),
                "sub": {"f": 1.5},
            },
            work / "ntd.tdz",
        ),
        ("sub", "s"),
    )
    s["empty_leaves"] = (
        _tdz(
            {
                "e": torch.zeros(0, 3),
                "f": torch.zeros(2, 0, dtype=torch.int64),
                "g": np.zeros(0, np.float64),
                "sub": {"h": torch.zeros(0)},
                "full": torch.ones(2),
            },
            work / "empty.tdz",
        ),
        ("sub",),
    )
    s["zip64"] = (to_zip64(s["stored"][0]), ("obs",))
    s["zip64_deflate"] = (to_zip64(s["deflate_segments"][0]), ("sub",))
    s["descriptors"] = (_descriptor_zip(s["deflate_segments"][0]), ("sub",))
    s.update(_td_seeds(work))
    s.update(_grown_seeds(work))
    s["deep_levels"] = (_deep_levels(), ("d", "d/d/d"))
    s["long_name"] = (_long_name(s["stored"][0]), ("obs",))
    return [Seed(name, data, subs) for name, (data, subs) in s.items()]


SEED_NAMES = (
    "stored",
    "deflate_segments",
    "bzip2",
    "lzma",
    "nested",
    "nested_tensor",
    "lazy_stack",
    "tensorclass",
    "non_tensor",
    "empty_leaves",
    "zip64",
    "zip64_deflate",
    "descriptors",
    "td_stored",
    "td_deflate",
    "td_bzip2",
    "td_lazy",
    "appended",
    "digest",
    "digest_appended",
    "deep_levels",
    "long_name",
)


def load_seeds(directory: Path) -> list[Seed]:
    """Seeds from ``directory`` (written by :func:`save_seeds`)."""
    index = json.loads((directory / "seeds.json").read_text())
    return [Seed(n, (directory / f"{n}.bin").read_bytes(), tuple(subs)) for n, subs in index]


def save_seeds(seeds: list[Seed], directory: Path) -> None:
    directory.mkdir(parents=True, exist_ok=True)
    for sd in seeds:
        (directory / f"{sd.name}.bin").write_bytes(sd.data)
    (directory / "seeds.json").write_text(json.dumps([[sd.name, list(sd.subpaths)] for sd in seeds]))
