"""h5py as the oracle of the HDF5 reader: every leaf and value compared bit for bit.

:func:`compare` opens a file with :func:`tdz_numba.formats.hdf5.open_hdf5` and with
h5py, walks the reader's tree and, for each leaf, reads the same path through
h5py and compares dtype, shape and bytes (NaN payloads included); plain values
(scalars, strings) are compared as h5py's value made plain. It also lists the
names h5py shows in each group that the tree leaves out, and how many leaves were
mapped by the reader itself (no h5py call: ``loader is None``), so tests can
assert the fast path was taken.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import torch

from tdz_numba.errors import UnsupportedError
from tdz_numba.formats.hdf5 import open_hdf5
from tdz_numba.formats.hdf5_h5py import plain
from tdz_numba.tdz.sources import tensor_from_spec

__all__ = ["compare", "Report"]


@dataclass
class Report:
    leaves: int = 0
    mapped: int = 0
    values: int = 0
    refused: list[str] = field(default_factory=list)
    mismatches: list[str] = field(default_factory=list)
    missing: list[str] = field(default_factory=list)
    mapped_paths: list[str] = field(default_factory=list)
    attrs: int = 0
    skipped_attrs: list[str] = field(default_factory=list)


def _same(ours: np.ndarray, want: np.ndarray) -> bool:
    if want.dtype.kind in "biufc" and want.dtype.fields is None:
        want = want.astype(want.dtype.newbyteorder("="), copy=False)
    if ours.dtype != want.dtype or ours.shape != want.shape:
        return False
    return np.ascontiguousarray(ours).tobytes() == np.ascontiguousarray(want).tobytes()


def _as_numpy(value) -> np.ndarray:
    if isinstance(value, torch.Tensor):
        return value.numpy()
    return np.asarray(value)


def _plain_equal(a, raw) -> bool:
    """Whether the reader's plain value ``a`` is h5py's ``raw`` value (as is, or made plain)."""
    import h5py  # type: ignore[import-untyped]

    if isinstance(raw, h5py.Empty):  # a null dataspace
        return a is None
    if isinstance(a, np.ndarray) and isinstance(raw, np.ndarray):
        if a.dtype != raw.dtype or a.shape != raw.shape:
            return False
        if a.dtype.hasobject:
            return repr(a.tolist()) == repr(raw.tolist())
        return a.tobytes() == raw.tobytes()
    b = plain(raw)
    if isinstance(a, np.ndarray) or isinstance(b, np.ndarray):
        return _same(np.asarray(a), np.asarray(b))
    if isinstance(a, float) and isinstance(b, float) and a != a and b != b:
        return True
    return a == b


def _attr_same(a, b, fid=None) -> bool:
    """Bit for bit: same types, floats by their bytes (NaN payloads, -0.0), lists item by item,
    h5py references (dense storage, read by h5py) by the object they name."""
    import struct

    import h5py  # type: ignore[import-untyped]

    if type(a) is not type(b):
        return False
    if isinstance(a, h5py.h5r.Reference):
        return h5py.h5r.get_name(a, fid) == h5py.h5r.get_name(b, fid)
    if isinstance(a, list):
        return len(a) == len(b) and all(_attr_same(x, y, fid) for x, y in zip(a, b))
    if isinstance(a, float):
        return struct.pack("<d", a) == struct.pack("<d", b)
    if isinstance(a, np.ndarray):
        return a.dtype == b.dtype and a.shape == b.shape and a.tobytes() == b.tobytes()
    return a == b


def compare_attrs(rep: Report, src, obj, tree_path: str) -> None:
    """The reader's attributes of ``tree_path`` against h5py's ``obj.attrs`` made plain, in order."""
    skipped = src.skipped_attributes(tree_path)
    rep.skipped_attrs += [f"{obj.name}@{k}" for k in skipped]
    want = {}
    for name in obj.attrs.keys():
        if name not in skipped:
            want[name] = plain(obj.attrs[name])
    ours = src.attributes(tree_path)
    rep.attrs += len(ours)
    if list(ours) != list(want) or not all(_attr_same(ours[k], want[k], obj.file.id) for k in want):
        rep.mismatches.append(f"{obj.name} attrs: {ours!r} != {want!r}"[:400])


def compare(path, **kw) -> Report:
    """Reads ``path`` with the reader and with h5py; returns what agreed and what did not."""
    import h5py  # type: ignore[import-untyped]

    rep = Report()
    src = open_hdf5(path, **kw)
    try:
        with h5py.File(path, "r") as h5:
            stack = [("", "")]
            while stack:
                prefix, h5path = stack.pop()
                level = src.level(prefix)
                group = h5[h5path or "/"]
                compare_attrs(rep, src, group, h5path.strip("/"))
                for name in group.keys():
                    link = group.get(name, getlink=True)
                    if name not in level.children and not isinstance(link, h5py.ExternalLink):
                        try:
                            target = group.get(name)
                        except Exception:  # noqa: BLE001 - h5py cannot open it either
                            target = None
                        if target is not None and not isinstance(target, (h5py.Group, h5py.Datatype)):
                            rep.missing.append(f"{h5path}/{name}")
                for key, child in level.children.items():
                    full = f"{h5path}/{key}"
                    if child.kind == "level":
                        stack.append((child.path, full))
                        continue
                    want = h5[full][()]
                    compare_attrs(rep, src, h5[full], full.strip("/"))
                    if child.kind == "value":
                        rep.values += 1
                        if not _plain_equal(child.leaf, want):
                            rep.mismatches.append(f"{full}: value {child.leaf!r} != {want!r}"[:300])
                        continue
                    rep.leaves += 1
                    spec = child.leaf
                    try:
                        ours = _as_numpy(tensor_from_spec(spec, src.files))
                    except UnsupportedError:
                        rep.refused.append(full)
                        continue
                    if spec.loader is None:
                        rep.mapped += 1
                        rep.mapped_paths.append(full)
                    if not _same(ours, np.asarray(want)):
                        rep.mismatches.append(
                            f"{full}: {ours.dtype}{ours.shape} != {want.dtype}{np.shape(want)}"
                        )
    finally:
        src.close()
    return rep
