"""The public API documents itself in numpydoc form: Parameters, Returns, Raises and Examples."""

import inspect
import re

import pytest

import tdz_numba

FUNCTIONS = [
    "save",
    "open",
    "load",
    "pack",
    "unpack",
    "verify",
    "allocate",
    "is_archive",
    "refresh_checksums",
    "convert",
]


def _sections(obj) -> set[str]:
    doc = inspect.getdoc(obj) or ""
    return set(re.findall(r"^(\w+)\n-{3,}$", doc, re.MULTILINE))


@pytest.mark.parametrize("name", FUNCTIONS)
def test_function_has_numpydoc_sections(name):
    fn = getattr(tdz_numba, name)
    assert {"Parameters", "Returns", "Raises", "Examples"} <= _sections(fn), name
    params = [p for p in inspect.signature(fn).parameters]
    doc = inspect.getdoc(fn)
    for p in params:  # every argument is described ("a, b : ..." lines count for both)
        assert re.search(rf"^(\w+, )*{p}(, \w+)* :", doc, re.MULTILINE), f"{name}: {p} not documented"


def test_raises_name_tdz_errors():
    for name in FUNCTIONS:
        raises = inspect.getdoc(getattr(tdz_numba, name)).split("Raises\n------\n")[1].split("\n\n")[0]
        named = set(re.findall(r"^(\w+)", raises, re.MULTILINE))
        assert named and all(issubclass(getattr(tdz_numba, n), tdz_numba.TdzError) for n in named), (
            name,
            named,
        )


def test_archive_class_has_numpydoc_sections():
    assert {"Parameters", "Raises", "Examples"} <= _sections(tdz_numba.Archive)
