"""tdz_numba.diff and `tdz diff`: leaves added, removed, changed and the same, across formats."""

import json
import zipfile

import numpy as np
import pytest
import torch

import tdz_numba
from tdz_numba import cli


@pytest.fixture
def pair(tmp_path):
    base = {"w": torch.arange(6.0).reshape(2, 3), "b": torch.zeros(4), "nested": {"x": torch.ones(2)}}
    other = {
        "w": torch.arange(6.0).reshape(2, 3),  # same
        "b": torch.tensor([0.0, 0.0, 1.0, 0.0]),  # bytes differ
        "nested": {"x": torch.ones(2, dtype=torch.float16)},  # dtype differs
        "new": torch.ones(1),
    }
    return (
        tdz_numba.save(base, tmp_path / "a.tdz"),
        tdz_numba.save(other, tmp_path / "b.tdz"),
    )


def test_diff_classes_and_reasons(pair):
    a, b = pair
    r = tdz_numba.diff(a, b)
    assert (r.added, r.removed, r.changed, r.same) == (["new"], [], ["b", "nested/x"], ["w"])
    assert r.details["nested/x"] == "float32 [2] -> float16 [2]" and r.details["b"] == "bytes differ"
    assert bool(r) and r.summary() == "1 added, 0 removed, 2 changed, 1 same"
    back = tdz_numba.diff(b, a)
    assert back.removed == ["new"] and back.added == []
    assert not tdz_numba.diff(a, a)


def test_diff_across_formats_compares_bytes(tmp_path):
    st = pytest.importorskip("safetensors.torch")
    sd = {"enc.weight": torch.randn(8, 4), "enc.bias": torch.randn(8)}
    st.save_file(sd, str(tmp_path / "m.safetensors"))
    torch.save({**sd, "enc.bias": sd["enc.bias"] + 1}, tmp_path / "m.pt")
    r = tdz_numba.diff(tmp_path / "m.safetensors", tmp_path / "m.pt")
    assert r.same == ["enc.weight"] and r.changed == ["enc.bias"]
    t = tdz_numba.convert(tmp_path / "m.safetensors", tmp_path / "m.tdz")
    assert not tdz_numba.diff(tmp_path / "m.safetensors", t)


def test_diff_bytes_not_values(tmp_path):
    nan_a = torch.tensor([float("nan"), 0.0])
    nan_b = torch.tensor([float("nan"), -0.0])
    a = tdz_numba.save({"x": nan_a, "y": nan_a}, tmp_path / "a.tdz")
    b = tdz_numba.save({"x": nan_a.clone(), "y": nan_b}, tmp_path / "b.tdz")
    r = tdz_numba.diff(a, b)
    assert r.same == ["x"] and r.changed == ["y"]  # NaN == NaN by bytes; 0.0 != -0.0


def test_diff_trusts_a_differing_crc_without_reading(pair, monkeypatch):
    from tdz_numba import diffing

    calls = []
    real = diffing._bytes_equal
    monkeypatch.setattr(diffing, "_bytes_equal", lambda x, y: calls.append(1) or real(x, y))
    a, b = pair
    r = tdz_numba.diff(a, b)
    assert r.changed == ["b", "nested/x"]
    assert len(calls) == 1  # "w" (equal CRCs) confirmed on bytes; "b" decided by its CRC


def test_diff_ignores_trailing_bytes_crc(tmp_path):
    """A payload longer than its tensor (tensordict's own test artifact) has a CRC over more
    bytes than the tensor: it is not used, the bytes decide."""
    d = tmp_path / "dir"
    tdz_numba.unpack(tdz_numba.save({"x": torch.arange(4, dtype=torch.int32)}, tmp_path / "a.tdz"), d)
    with open(d / "x.memmap", "ab") as f:
        f.write(b"\0")
    r = tdz_numba.diff(tmp_path / "a.tdz", d)
    assert r.same == ["x"]


def test_tdz_diff_cli(pair, capsys):
    a, b = pair
    assert cli.main(["diff", str(a), str(b)]) == 1
    out = capsys.readouterr().out
    assert " A new" in out and " M nested/x" in out and "float32 [2] -> float16 [2]" in out
    assert out.strip().endswith("1 added, 0 removed, 2 changed, 1 same")
    assert all(len(line) <= 100 for line in out.splitlines())
    assert cli.main(["diff", str(a), str(a), "--json"]) == 0
    got = json.loads(capsys.readouterr().out)
    assert got["same"] == ["b", "nested/x", "w"] and got["changed"] == []


def test_diff_of_a_bad_file_is_a_clear_error(pair, tmp_path, capsys):
    a, _ = pair
    bad = tmp_path / "bad.tdz"
    bad.write_bytes(b"PK\x03\x04 not really")
    with pytest.raises(tdz_numba.TdzError, match="bad.tdz"):
        tdz_numba.diff(a, bad)
    assert cli.main(["diff", str(a), str(bad)]) == 2
    assert "bad.tdz" in capsys.readouterr().err


def test_diff_npz_against_tdz(tmp_path):
    arrays = {"a": np.arange(5, dtype=np.int16), "b": np.eye(3)}
    np.savez(tmp_path / "x.npz", **arrays)
    t = tdz_numba.save({k: torch.from_numpy(v) for k, v in arrays.items()}, tmp_path / "x.tdz")
    assert tdz_numba.diff(tmp_path / "x.npz", t).same == ["a", "b"]
    with zipfile.ZipFile(t) as z:
        assert "a.memmap" in z.namelist()
