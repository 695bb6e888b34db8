"""``tdz_numba.diff``: two tensor files of any formats compared leaf by leaf (``tdz diff A B``).

A leaf present in both files is *changed* when its dtype or shape differs, or when its
bytes do: by digest when both files store one for it (no payload read), else by CRC-32
where both give one over exactly the tensor's bytes (a differing CRC decides without a
byte compare; an equal one is confirmed on the bytes), else by comparing the bytes. Bytes
are compared as bytes, so NaNs with the same payload are equal and ``-0.0`` differs from
``0.0``. Only tensor leaves are compared (plain values, such as NonTensorData, are not).

Examples
--------
>>> import tempfile, pathlib, torch, tdz_numba
>>> with tempfile.TemporaryDirectory() as d:
...     a = tdz_numba.save({"w": torch.ones(3), "b": torch.zeros(2)}, pathlib.Path(d) / "a.tdz")
...     b = tdz_numba.save({"w": torch.ones(3), "b": torch.ones(2), "c": torch.ones(1)}, pathlib.Path(d) / "b.tdz")
...     report = tdz_numba.diff(a, b)
...     print(report.added, report.removed, report.changed, report.same)
['c'] [] ['b'] ['w']
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass, field
from typing import Any

__all__ = ["diff", "DiffReport"]

PathLike = str | os.PathLike


@dataclass
class DiffReport:
    """What :func:`diff` found: leaf paths (``"a/b"``) in each class, sorted.

    ``details`` maps each changed leaf to a short reason (``"float32 [3] -> float16 [3]"``,
    ``"bytes differ"``); ``a`` and ``b`` are the files compared. ``bool(report)`` is True
    when the files differ.
    """

    a: str
    b: str
    added: list[str] = field(default_factory=list)
    removed: list[str] = field(default_factory=list)
    changed: list[str] = field(default_factory=list)
    same: list[str] = field(default_factory=list)
    details: dict[str, str] = field(default_factory=dict)
    sizes: dict[str, int] = field(default_factory=dict)

    def __bool__(self) -> bool:
        return bool(self.added or self.removed or self.changed)

    def summary(self) -> str:
        """One line: ``"1 added, 0 removed, 2 changed, 10 same"``."""
        return (
            f"{len(self.added)} added, {len(self.removed)} removed, "
            f"{len(self.changed)} changed, {len(self.same)} same"
        )

    def __str__(self) -> str:
        rows = [("A", k, self.details.get(k, "")) for k in self.added]
        rows += [("D", k, self.details.get(k, "")) for k in self.removed]
        rows += [("M", k, self.details.get(k, "")) for k in self.changed]
        rows.sort(key=lambda r: r[1])
        width = min(max((len(r[1]) for r in rows), default=0), 60)
        lines = []
        for mark, key, why in rows:
            shown = key if len(key) <= width else "..." + key[-(width - 3) :]
            lines.append(f" {mark} {shown:<{width}}  {why}".rstrip())
        na, nb = os.path.basename(self.a.rstrip("/")), os.path.basename(self.b.rstrip("/"))
        if na == nb:
            na, nb = "A", "B"
        lines.append(f"{_cut(na)} -> {_cut(nb)}: {self.summary()}")
        return "\n".join(lines)


def _cut(name: str, limit: int = 24) -> str:
    return name if len(name) <= limit else "..." + name[-(limit - 3) :]


def _describe(info: Any) -> str:
    name = str(info.dtype).removeprefix("torch.")
    return f"{name} {list(info.shape)}"


def _crc(info: Any) -> int | None:
    """The leaf's stored CRC-32 when it covers exactly the tensor's bytes."""
    crc = getattr(info, "crc", None)
    if crc is None:
        return None
    exact = math.prod(info.shape) * info.dtype.itemsize
    return crc if info.nbytes == exact else None


def _digest(info: Any) -> str | None:
    """The leaf's stored XXH3-128 digest when it covers exactly the tensor's bytes."""
    digest = getattr(info, "digest", None)
    if digest is None:
        return None
    return digest if info.nbytes == math.prod(info.shape) * info.dtype.itemsize else None


def _bytes_equal(x: Any, y: Any) -> bool:
    import torch

    if x.numel() == 0:
        return True
    bx = x.contiguous().reshape(-1).view(torch.uint8)
    by = y.contiguous().reshape(-1).view(torch.uint8)
    return bool(torch.equal(bx, by))


def diff(a: PathLike, b: PathLike, *, allow_pickle: bool = False) -> DiffReport:
    """Compares the tensor leaves of two files (any formats :func:`tdz_numba.open` reads).

    Parameters
    ----------
    a, b : str or os.PathLike
        The files (``.tdz``, safetensors, ``.pt``, npz, GGUF, HDF5, ONNX, memmap directories).
    allow_pickle : bool
        Passed to :func:`tdz_numba.open` for both files.

    Returns
    -------
    DiffReport
        ``added`` (in ``b`` only), ``removed`` (in ``a`` only), ``changed``, ``same``.

    Raises
    ------
    TdzError
        Either file cannot be read (the reader's error, naming it).

    Examples
    --------
    >>> import tempfile, pathlib, torch, tdz_numba
    >>> with tempfile.TemporaryDirectory() as d:
    ...     a = tdz_numba.save({"w": torch.ones(3)}, pathlib.Path(d) / "a.tdz")
    ...     b = tdz_numba.save({"w": torch.ones(3, dtype=torch.float16)}, pathlib.Path(d) / "b.tdz")
    ...     print(tdz_numba.diff(a, b).details)
    {'w': 'float32 [3] -> float16 [3]'}
    """
    from .api import open as open_archive

    report = DiffReport(str(a), str(b))
    with open_archive(a, allow_pickle=allow_pickle) as ra, open_archive(b, allow_pickle=allow_pickle) as rb:
        keys_a = [k for k, _ in ra.leaves()]
        keys_b = [k for k, _ in rb.leaves()]
        set_a, set_b = set(keys_a), set(keys_b)
        for k in keys_b:
            if k not in set_a:
                report.added.append(k)
                report.details[k] = _describe(rb.info(k))
        for k in keys_a:
            if k not in set_b:
                report.removed.append(k)
                report.details[k] = _describe(ra.info(k))
        for k in keys_a:
            if k not in set_b:
                continue
            ia, ib = ra.info(k), rb.info(k)
            if ia.dtype != ib.dtype or tuple(ia.shape) != tuple(ib.shape):
                report.changed.append(k)
                report.details[k] = f"{_describe(ia)} -> {_describe(ib)}"
                continue
            da, db = _digest(ia), _digest(ib)
            if da is not None and db is not None:
                equal = da == db
            else:
                ca, cb = _crc(ia), _crc(ib)
                crc_differs = ca is not None and cb is not None and ca != cb
                equal = False if crc_differs else _bytes_equal(ra[k], rb[k])
            if equal:
                report.same.append(k)
            else:
                report.changed.append(k)
                report.details[k] = "bytes differ"
    for keys in (report.added, report.removed, report.changed, report.same):
        keys.sort()
    return report
