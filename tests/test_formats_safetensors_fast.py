"""The safetensors header's fast path (one regex pass, numpy checks) against the json path:
the same specs and metadata for every header it takes, the json path's verdict for the rest."""

import json
import struct

import pytest
import torch
from safetensors.torch import save_file

from tdz_numba.errors import BadArchiveError
from tdz_numba.formats import safetensors as st
from tdz_numba.formats.safetensors import open_safetensors, parse_header


def _compact(header: dict, data: bytes, pad_to: int = 8) -> bytes:
    """A file laid out as safetensors' own writer does (no whitespace), padded with spaces."""
    h = json.dumps(header, separators=(",", ":"), ensure_ascii=False).encode()
    h += b" " * (-len(h) % pad_to)
    return struct.pack("<Q", len(h)) + h + data


def _both(raw: bytes):
    """(fast result or None, slow result or the exception it raised)."""
    n = struct.unpack("<Q", raw[:8])[0]
    head = raw[8 : 8 + n]
    fast = st._fast_header(head, 8 + n, len(raw), 0)
    try:
        slow = st._slow_header(head, len(raw), "f", 0)
    except BadArchiveError as exc:
        slow = exc
    return fast, slow


def _tensors():
    g = torch.Generator().manual_seed(1)
    return {
        "scalar": torch.tensor(3.5, dtype=torch.float64),
        "empty": torch.zeros(0, 7, dtype=torch.float16),
        "b": torch.randn(3, 4, generator=g).to(torch.bfloat16),
        "naïve/ünïcode name": torch.arange(6, dtype=torch.int32).reshape(1, 2, 3),
        "bits": torch.tensor([True, False, True]),
        "i8": torch.arange(-5, 5, dtype=torch.int8),
        "z": torch.ones(2, 2, dtype=torch.complex64),
    }


@pytest.mark.parametrize("metadata", [None, {"format": "pt", "x": '{"a": 1}'}])
def test_fast_path_equals_json_path_on_safetensors_files(tmp_path, metadata):
    p = tmp_path / "m.safetensors"
    save_file(_tensors(), str(p), metadata=metadata)
    raw = p.read_bytes()
    fast, slow = _both(raw)
    assert fast is not None, "the writer's own layout must take the fast path"
    assert fast == slow
    assert list(fast[0]) == list(slow[0])  # header order kept
    got = open_safetensors(p)
    assert list(got.level("").children) == list(slow[0])  # the header's order (the writer sorts)
    spec = got.level("").children["scalar"].leaf
    assert spec.shape == () and spec.dtype == torch.float64 and spec.nbytes == 8


def _hdr(entries):
    return {k: {"dtype": d, "shape": s, "data_offsets": o} for k, (d, s, o) in entries.items()}


_OK = {"a": ("F32", [2], [0, 8]), "b": ("I16", [2], [8, 12]), "c": ("U8", [0], [12, 12])}


@pytest.mark.parametrize(
    "text, data, why",
    [
        # not the writer's layout: the fast path declines, the json path accepts
        ('{"a": {"dtype":"F32","shape":[2],"data_offsets":[0,8]}}', 8, "space"),
        ('{"a":{"shape":[2],"dtype":"F32","data_offsets":[0,8]}}', 8, "field order"),
        ('{"a":{"dtype":"F32","shape":[2],"data_offsets":[0,8]},"__metadata__":{}}', 8, "metadata last"),
        ('{"\\u0061":{"dtype":"F32","shape":[2],"data_offsets":[0,8]}}', 8, "escape"),
        # wrong: the fast path declines, the json path names the error
        (
            '{"a":{"dtype":"F32","shape":[2],"data_offsets":[0,8]},"a":{"dtype":"F32","shape":[2],"data_offsets":[0,8]}}',
            8,
            "twice",
        ),
        ('{"a":{"dtype":"F32","shape":[02],"data_offsets":[0,8]}}', 8, "leading zero"),
        (
            '{"a":{"dtype":"F32","shape":[2],"data_offsets":[0,8]}x,"b":{"dtype":"F32","shape":[0],"data_offsets":[8,8]}}',
            8,
            "junk",
        ),
        (
            '{"a":{"dtype":"F32","shape":[2],"data_offsets":[0,8]}"b":{"dtype":"F32","shape":[0],"data_offsets":[8,8]}}',
            8,
            "no comma",
        ),
        ('{"a":{"dtype":"F32","shape":[2],"data_offsets":[0,8]},}', 8, "trailing comma"),
        ('{"a":{"dtype":"F32","shape":[3],"data_offsets":[0,8]}}', 8, "size"),
        ('{"a":{"dtype":"F32","shape":[2],"data_offsets":[0,8]}}', 9, "gap at end"),
        ('{"a":{"dtype":"F32","shape":[1],"data_offsets":[4,8]}}', 8, "gap at start"),
        ('{"a":{"dtype":"X9","shape":[2],"data_offsets":[0,8]}}', 8, "dtype"),
        ('{"a":{"dtype":"F32","shape":[99999999999999999],"data_offsets":[0,8]}}', 8, "huge"),
        (
            '{"a":{"dtype":"F32","shape":[0,999999999999999999,999999999999999999],"data_offsets":[0,0]}}',
            0,
            "2**63",
        ),
        ('{"__metadata__":{"a":1},"a":{"dtype":"F32","shape":[2],"data_offsets":[0,8]}}', 8, "meta value"),
        (
            '{"__metadata__":{"a":"1"},"__metadata__":{"dtype":"F32","shape":[2],"data_offsets":[0,8]}}',
            8,
            "meta name",
        ),
        ('{"__metadata__":{"a":"1"}}', 0, "no tensors"),
        ('{"a]},":{"dtype":"F32","shape":[2],"data_offsets":[0,8]}}', 8, "brackets in a name"),
    ],
)
def test_fast_path_declines_what_it_does_not_know(text, data, why):
    h = text.encode()
    raw = struct.pack("<Q", len(h)) + h + bytes(data)
    fast, slow = _both(raw)
    if isinstance(slow, BadArchiveError) or why in (
        "space",
        "field order",
        "metadata last",
        "escape",
        "no tensors",
    ):
        assert fast is None, why
    else:  # both accept: the same answer
        assert fast == slow, why


def test_fast_header_tiles():
    """Entries that do not follow one another (junk between them) are not taken apart by the
    regex alone: the matched length must be the body's."""
    good = '"a":{"dtype":"F32","shape":[2],"data_offsets":[0,8]}'
    text = "{" + good + ',"zz",' + good.replace('"a"', '"b"').replace("0,8", "8,16") + "}"
    h = text.encode()
    raw = struct.pack("<Q", len(h)) + h + bytes(16)
    fast, slow = _both(raw)
    assert fast is None and isinstance(slow, BadArchiveError)


def test_shuffled_offsets_and_zero_sized_tensors(tmp_path):
    header = _hdr(
        {
            "z0": ("F32", [0], [12, 12]),
            "b": ("I16", [2], [8, 12]),
            "z1": ("U8", [0, 3], [0, 0]),
            **{"a": _OK["a"]},
        }
    )
    raw = _compact(header, bytes(12))
    fast, slow = _both(raw)
    assert fast is not None and fast == slow
    assert [s.offset for s in fast[0].values()] == [len(raw) - 12 + o for o in (12, 8, 0, 0)]
    p = tmp_path / "z.safetensors"
    p.write_bytes(raw)
    specs, _ = parse_header(raw, len(raw), str(p))
    assert specs == fast[0]


def test_overlap_is_named_by_the_json_path(tmp_path):
    header = _hdr({"a": ("F32", [2], [0, 8]), "b": ("F32", [1], [4, 8]), "c": ("F32", [1], [8, 12])})
    p = tmp_path / "o.safetensors"
    p.write_bytes(_compact(header, bytes(12)))
    with pytest.raises(BadArchiveError, match="'b'.*overlaps|data_offsets"):
        open_safetensors(p)
