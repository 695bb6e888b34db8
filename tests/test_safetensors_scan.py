"""Oracle tests of :func:`tdz_numba.formats.safetensors_scan.entries` (the compiled pass over a
header's entries) against the regex pass it replaces (``_entries`` with the kernels off): the same
columns, or None, on writer-layout bodies, edge sizes and every one-byte corruption of one."""

from __future__ import annotations

import random

import numpy as np
import pytest

from tdz_numba.formats import safetensors as st
from tdz_numba.formats.safetensors_scan import entries
from tdz_numba.jit.policy import forced


def _oracle(body: str):
    with forced("never"):
        return st._entries(body)


def _same(body: str) -> None:
    got, want = entries(body), _oracle(body)
    if want is None:
        assert got is None, body
        return
    assert got is not None, body
    assert list(got[0]) == list(want[0])
    assert list(got[1]) == list(want[1])
    assert list(got[2]) == list(want[2])
    assert got[3].tolist() == want[3].tolist() and got[4].tolist() == want[4].tolist()
    assert got[3].dtype == np.int64 and got[4].dtype == np.int64


def _entry(name: str, dtype: str, shape: str, b: str, e: str) -> str:
    return f'"{name}":{{"dtype":"{dtype}","shape":[{shape}],"data_offsets":[{b},{e}]}}'


GOOD = [
    _entry("a", "F16", "2,3", "0", "12"),
    _entry("a", "F16", "2,3", "0", "12") + "," + _entry("b", "BF16", "", "12", "14"),
    _entry("", "U8", "0", "0", "0"),  # empty name, zero dim
    _entry("ü名", "F32", "1,1,1,1,1,1,1,1", "0", "4"),  # non-ASCII names
    _entry("x", "A" * 16, "9" * 18, "9" * 18, "9" * 18),  # the longest fields the regex takes
    ",".join(_entry(f"p.{i}", "F16", "5120", str(i * 10240), str(i * 10240 + 10240)) for i in range(300)),
]
BAD = [
    "",
    _entry("a", "F16", "2,3", "0", "12") + ",",  # a trailing comma
    _entry("a", "F16", "2,3", "0", "12") + "," + _entry("b", "F16", "", "12", "14")[:-1],  # truncated
    _entry("a", "A" * 17, "2", "0", "4"),  # a dtype of 17 characters
    _entry("a", "f16", "2", "0", "4"),  # lower case
    _entry("a", "F16", "9" * 19, "0", "4"),  # 19 digits
    _entry("a", "F16", "02", "0", "4"),  # a leading zero
    _entry("a", "F16", "2,", "0", "4"),
    _entry("a", "F16", ",2", "0", "4"),
    _entry("a", "F16", "2", "00", "4"),
    _entry("a", "F16", "2", "0", "-4"),
    _entry("a\x01", "F16", "2", "0", "4"),  # a control character
    _entry("a", "F16", "2", "0", "4") + " ",
    " " + _entry("a", "F16", "2", "0", "4"),
    _entry("a", "F16", "2", "0", "4") + ',"zz",' + _entry("b", "F16", "2", "4", "8"),
    _entry("a", "", "2", "0", "4"),
]


@pytest.mark.parametrize("body", GOOD + BAD)
def test_entries_match_the_regex_pass(body):
    _same(body)


def test_entries_of_bad_bodies_are_none():
    assert all(entries(b) is None for b in BAD)
    assert all(entries(b) is not None for b in GOOD)


def test_every_one_byte_change_matches_the_regex_pass():
    body = GOOD[1]
    rng = random.Random(0)
    alphabet = '"{}[],:0123456789AZ_az \\\x00\x1fé'
    for i in range(len(body)):
        for c in rng.sample(alphabet, 6):
            _same(body[:i] + c + body[i + 1 :])
        _same(body[:i] + body[i + 1 :])  # one character dropped
        _same(body[:i])  # cut short


def test_entries_reads_a_read_only_buffer_of_any_size():
    for n in (1, 2, 7, 64):
        body = ",".join(_entry(f"k{i}", "I64", str(i), str(8 * i), str(8 * i + 8 * i)) for i in range(n))
        _same(body)
