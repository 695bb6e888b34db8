"""canonical_header: numpy's own header layout read by a regular expression gives the dict that
ast.literal_eval gives (the oracle), and leaves every other text to literal_eval."""

from __future__ import annotations

import ast
import io

import numpy as np
import pytest
from numpy.lib import format as npformat

from tdz_numba.errors import BadArchiveError
from tdz_numba.formats import numpy_fmt
from tdz_numba.formats.numpy_fmt import canonical_header, parse_npy_header

SHAPES = [(), (0,), (1,), (5,), (2, 3), (2048, 8192), (1, 2, 3, 4, 5, 6, 7), (10**17,), (0, 0)]
DESCRS = ["<f2", ">f4", "<i8", "|b1", "|u1", "<c16", "<M8[ns]", "|V4", "<U3"]


def _text(descr: str, fortran: bool, shape: tuple[int, ...], version: int = 1) -> str:
    buf = io.BytesIO()
    d = {"descr": descr, "fortran_order": fortran, "shape": shape}
    if version == 1:
        npformat.write_array_header_1_0(buf, d)
    else:
        npformat.write_array_header_2_0(buf, d)
    start = 10 if version == 1 else 12
    return buf.getvalue()[start:].decode("latin-1")


@pytest.mark.parametrize("version", [1, 2])
def test_numpy_written_headers_match_literal_eval(version: int) -> None:
    for shape in SHAPES:
        for descr in DESCRS:
            for fortran in (False, True):
                text = _text(descr, fortran, shape, version)
                got = canonical_header(text)
                assert got is not None, text  # numpy's own layout: the fast path takes it
                assert got == ast.literal_eval(text) and type(got["shape"]) is tuple
                assert all(type(d) is int for d in got["shape"])


@pytest.mark.parametrize(
    "text",
    [
        "{'descr': '<f2', 'fortran_order': False, 'shape': (07,), }",  # leading zero: a SyntaxError
        "{'descr': '<f2', 'fortran_order': False, 'shape': (1, 2,), }",  # not numpy's layout
        "{'descr': '<f2', 'fortran_order': False, 'shape': (1,2), }",
        "{'descr': '<f2', 'fortran_order': 0, 'shape': (1,), }",
        "{'descr': 'a\\'b', 'fortran_order': False, 'shape': (1,), }",  # an escape
        "{'descr': '<f2\x00', 'fortran_order': False, 'shape': (1,), }",  # a NUL: literal_eval refuses
        "{'descr': '<f2', 'fortran_order': False, 'shape': (1,), 'x': 1, }",
        "{'fortran_order': False, 'descr': '<f2', 'shape': (1,), }",  # other key order
        "{'descr': '<f2', 'fortran_order': False, 'shape': (1,), }\n\n",
        "{'descr': '<f2', 'fortran_order': False, 'shape': (" + "9" * 19 + ",), }",  # 19 digits
        " {'descr': '<f2', 'fortran_order': False, 'shape': (1,), }",
    ],
)
def test_other_texts_are_left_to_literal_eval(text: str) -> None:
    assert canonical_header(text) is None


def test_parse_takes_the_fast_path_and_keeps_every_check(monkeypatch: pytest.MonkeyPatch) -> None:
    calls: list[str] = []
    real = ast.literal_eval
    monkeypatch.setattr(numpy_fmt.ast, "literal_eval", lambda t: calls.append(t) or real(t))
    head = b"\x93NUMPY\x01\x00" + len(t := _text("<f2", False, (4, 8))).to_bytes(2, "little")
    h = parse_npy_header(head + t.encode("latin-1"), "x.npy")
    assert h.dtype == np.dtype("<f2") and h.shape == (4, 8) and not h.fortran and calls == []
    bad = _text("|O", False, (2,))  # an object array: refused after the fast parse as before
    with pytest.raises(Exception, match="object array"):
        parse_npy_header(b"\x93NUMPY\x01\x00" + len(bad).to_bytes(2, "little") + bad.encode(), "x.npy")
    odd = "{'descr': '<f2', 'fortran_order': False, 'shape': (07,), }"  # literal_eval still says no
    with pytest.raises(BadArchiveError, match="not a Python literal"):
        parse_npy_header(b"\x93NUMPY\x01\x00" + len(odd).to_bytes(2, "little") + odd.encode(), "x.npy")
    assert calls and calls[0] == odd  # (a version-1 header gets a second try without "L"s)
