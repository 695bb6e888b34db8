"""tdz_numba: single-file, memory-mapped tensor archives (tensordict's ``.tdz``), fast.

``import tdz_numba`` is cheap: submodules (torch, numba kernels) load on first
use of a name below, and kernels compile on first call (then come from
Numba's on-disk cache).

Examples
--------
>>> import tempfile, pathlib, torch, tdz_numba
>>> with tempfile.TemporaryDirectory() as d:
...     p = tdz_numba.save({"a": torch.arange(4)}, pathlib.Path(d) / "x.tdz")
...     with tdz_numba.open(p) as ar:
...         print(ar["a"].tolist())
[0, 1, 2, 3]
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from .errors import (
    AccessDeniedError,
    ArchiveExistsError,
    BadArchiveError,
    ChecksumError,
    DiskFullError,
    FileMissingError,
    InternalError,
    InvalidArgumentError,
    InvalidTreeError,
    MissingKeyError,
    RemoteError,
    TdzError,
    UnknownCompressionError,
    UnsafeContentError,
    UnsupportedError,
)

__version__ = "0.1.0"

__all__ = [
    "__version__",
    # functions
    "save",
    "open",
    "load",
    "pack",
    "unpack",
    "is_archive",
    "verify",
    "refresh_checksums",
    "allocate",
    "convert",
    "clean",
    "append",
    "compact",
    "repair",
    "save_model",
    "load_model",
    "diff",
    # types
    "Archive",
    "LeafInfo",
    "LevelInfo",
    "Location",
    "Level",
    "RawFile",
    "PickledData",
    "VerifyReport",
    "DiffReport",
    "Writer",
    # errors
    "TdzError",
    "BadArchiveError",
    "ChecksumError",
    "UnsupportedError",
    "ArchiveExistsError",
    "UnsafeContentError",
    "InvalidTreeError",
    "InvalidArgumentError",
    "MissingKeyError",
    "UnknownCompressionError",
    "FileMissingError",
    "AccessDeniedError",
    "DiskFullError",
    "RemoteError",
    "InternalError",
]

_LAZY = {
    "save": "saving",
    "open": "api",
    "load": "api",
    "pack": "saving",
    "unpack": "saving",
    "is_archive": "api",
    "verify": "api",
    "refresh_checksums": "api",
    "allocate": "saving",
    "convert": "conversion",
    "clean": "saving",
    "append": "growing",
    "compact": "growing",
    "repair": "growing",
    "save_model": "models",
    "load_model": "models",
    "diff": "diffing",
    "DiffReport": "diffing",
    "Archive": "archive.mapping",
    "LeafInfo": "tdz.sources",
    "LevelInfo": "tdz.sources",
    "Location": "tdz.sources",
    "Level": "tdz.tree",
    "RawFile": "tdz.tree",
    "PickledData": "tdz.tree",
    "VerifyReport": "archive.verify",
    "Writer": "streaming",
    "warmup": "cli.warmup",  # not in __all__: tdz_numba.warmup()
}

if TYPE_CHECKING:  # pragma: no cover
    from .api import is_archive, load, open, refresh_checksums, verify
    from .archive.mapping import Archive
    from .archive.verify import VerifyReport
    from .conversion import convert
    from .diffing import DiffReport, diff
    from .growing import append, compact, repair
    from .models import load_model, save_model
    from .saving import allocate, clean, pack, save, unpack
    from .streaming import Writer
    from .tdz.sources import LeafInfo, LevelInfo, Location
    from .tdz.tree import Level, PickledData, RawFile


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'tdz_numba' has no attribute {name!r}")
    value = getattr(importlib.import_module(f".{module}", __name__), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    """The package face (``__all__``) and the dunders: no helper or submodule names."""
    return sorted(set(__all__) | {n for n in globals() if n.startswith("__") and n.endswith("__")})
