"""Repository-level pytest hooks for the doctests of the package.

``python -m pytest`` collects ``tests/`` and the docstring examples of ``tdz_numba/``
(``--doctest-modules``, see ``[tool.pytest.ini_options]`` in pyproject.toml). Two rules keep that
collection cheap and safe:

- helper modules under ``tests/`` that are not test files (oracles, servers, the fuzz package) are not
  imported as doctest modules; the test files that need them import them themselves;
- an example that imports an optional package (tensordict, h5py, onnx, gguf, fsspec, ...) or uses a
  ``memory://`` URL is skipped, with the package named, when that package is not installed.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

_TESTS = Path(__file__).resolve().parent / "tests"

# top-level import name -> what a doctest needs it for; only optional dependencies belong here
OPTIONAL = ("tensordict", "safetensors", "h5py", "onnx", "gguf", "fsspec", "s3fs", "matplotlib", "ztensor")
_IMPORT = re.compile(r"^\s*(import|from)\s+(.*)$")


def pytest_ignore_collect(collection_path: Path, config: pytest.Config) -> bool | None:
    """Do not import the non-test helpers of ``tests/`` as doctest modules."""
    path = Path(collection_path)
    if _TESTS not in path.parents:
        return None
    if path.is_dir():
        return True if (path / "__init__.py").exists() else None
    if path.suffix == ".py" and not (path.name.startswith("test_") or path.name == "conftest.py"):
        return True
    return None


def _needed(source: str) -> set[str]:
    """The optional packages one doctest example imports (or needs, for ``memory://`` URLs)."""
    needed: set[str] = set()
    for line in source.splitlines():
        match = _IMPORT.match(line)
        if match:
            names = match.group(2).split(",") if match.group(1) == "import" else [match.group(2)]
            for name in names:
                top = name.strip().split(" ")[0].split(".")[0]
                if top in OPTIONAL:
                    needed.add(top)
    if "memory://" in source:
        needed.add("fsspec")
    return needed


def pytest_runtest_setup(item: pytest.Item) -> None:
    """Skip a doctest whose examples need an optional package that is not installed."""
    dtest = getattr(item, "dtest", None)
    if dtest is None:
        return
    for name in sorted(set().union(*(_needed(ex.source) for ex in dtest.examples))):
        pytest.importorskip(name, reason=f"this example needs the optional package {name!r}")
