"""Tools that never mislead: verify tells damage from stale CRCs, closing a writable archive
re-stamps what was written, verify of a format without checksums says what it could not check,
info does not call compressed payloads misaligned, HDF5 attributes per level."""

from __future__ import annotations

import json
import zipfile

import numpy as np
import pytest
import torch

import tdz_numba
from tdz_numba import cli


def _overwrite(path, offset: int, data: bytes) -> None:
    with open(path, "r+b") as f:
        f.seek(offset)
        f.write(data)


def test_real_damage_is_not_blamed_on_r_plus(tmp_path, capsys):
    p = tdz_numba.save({"a": torch.arange(64.0), "b": torch.ones(8)}, tmp_path / "x.tdz")
    with tdz_numba.open(p) as ar:
        off = ar.info("a").offset
    _overwrite(p, off + 8, b"\xde\xad\xbe\xef")  # 4 bytes of a payload: damage, not a write of ours
    with pytest.raises(tdz_numba.ChecksumError) as info:
        tdz_numba.verify(p)
    msg = str(info.value)
    assert "'a.memmap'" in msg and "the file is damaged" in msg
    assert "re-stamp the CRCs with" not in msg  # the old advice, which would bless the damage
    assert "unless" in msg and "only in that case" in msg  # refresh only for writes in place
    assert cli.main(["verify", str(p)]) == 1
    err = capsys.readouterr().err
    assert "damaged" in err and len(err.strip().splitlines()) == 1


def test_close_of_r_plus_restamps_what_was_written(tmp_path):
    p = tdz_numba.save(
        {"a": torch.zeros(1000), "b": {"c": torch.ones(3)}, "d": torch.ones(5)}, tmp_path / "x.tdz"
    )
    before = p.read_bytes()
    with tdz_numba.open(p, mode="r+") as ar:
        float(ar["d"].sum())  # handed out, not written: nothing to re-stamp
    assert p.read_bytes() == before  # the file is not touched
    with tdz_numba.open(p, mode="r+") as ar:
        ar["a"][3] = 7.0
        ar["b", "c"].mul_(2)
    assert tdz_numba.verify(p).leaves == 3
    with zipfile.ZipFile(p) as zf:
        assert zf.testzip() is None
        assert zf.getinfo("a.memmap").CRC == zipfile.crc32(
            np.where(np.arange(1000) == 3, 7, 0).astype(np.float32).tobytes()
        )
    back = tdz_numba.load(p)
    assert float(back["a"][3]) == 7.0 and back["b"]["c"].tolist() == [2.0, 2.0, 2.0]


def test_allocate_write_close_verifies(tmp_path):
    with tdz_numba.allocate(
        {"x": torch.zeros(4096), "y": {"z": torch.zeros(2, 3, dtype=torch.int32)}}, tmp_path / "a.tdz"
    ) as ar:
        ar["x"].copy_(torch.arange(4096.0))
        ar["y", "z"].fill_(5)
    report = tdz_numba.verify(tmp_path / "a.tdz")
    assert report.leaves == 2
    back = tdz_numba.load(tmp_path / "a.tdz")
    assert torch.equal(back["x"], torch.arange(4096.0)) and back["y"]["z"].sum() == 30


def test_verify_of_a_format_without_checksums_says_so(tmp_path, capsys):
    st = pytest.importorskip("safetensors.torch")
    src = tmp_path / "m.safetensors"
    st.save_file({"w": torch.arange(6.0).reshape(2, 3), "b": torch.ones(4)}, str(src))
    report = tdz_numba.verify(src)
    text = str(report)
    assert "payload bytes checked" not in text
    assert report.format == "safetensors" and report.checksummed_bytes == 0
    assert report.payload_bytes == 40 and report.unchecked_bytes == 40
    assert "checked: the bounds and size of every leaf" in text
    assert "not checked: the values of 40 B of payload (safetensors files have no checksums)" in text
    assert cli.main(["verify", str(src), "--json"]) == 0
    d = json.loads(capsys.readouterr().out)
    assert d["checksummed_bytes"] == 0 and d["unchecked_bytes"] == 40 and d["format"] == "safetensors"
    npz = tmp_path / "x.npz"
    np.savez(npz, a=np.arange(10.0))  # a zip: its members carry CRC-32s, and they are checked
    report = tdz_numba.verify(npz)
    assert report.checksummed_bytes == report.payload_bytes == 80 and report.unchecked_bytes == 0
    assert "not checked" not in str(report) and "CRC-32 of 80 B" in str(report)
    ours = tdz_numba.save({"a": torch.zeros(4)}, tmp_path / "x.tdz")
    report = tdz_numba.verify(ours)
    assert report.checksummed_bytes is None and report.unchecked_bytes == 0
    assert "CRC-32 of every entry" in str(report)


def test_info_does_not_call_compressed_payloads_misaligned(tmp_path, capsys):
    p = tdz_numba.save(
        {"a": torch.zeros(1000), "b": torch.ones(1000)}, tmp_path / "z.tdz", compression="deflate"
    )
    assert cli.main(["info", str(p)]) == 0
    out = capsys.readouterr().out
    assert "NOT" not in out and "misaligned" not in out
    assert "2 compressed (decoded, not mapped)" in out
    assert cli.main(["info", str(p), "--json"]) == 0
    d = json.loads(capsys.readouterr().out)
    assert d["memmap_entries"] == 2 and d["memmap_stored"] == 0 and d["all_aligned"] is True
    assert d["misaligned"] == [] and d["misaligned_stored"] == 0


def test_hdf5_attributes_per_level_and_dataset(tmp_path):
    h5py = pytest.importorskip("h5py")
    p = tmp_path / "a.h5"
    with h5py.File(p, "w") as f:
        f.attrs["note"] = "root"
        g = f.create_group("g")
        g.attrs["units"] = "m"
        g.attrs["scale"] = np.float32(2.0)
        w = g.create_dataset("w", data=np.arange(4.0))
        w.attrs["desc"] = b"weights"
        inner = g.create_group("inner")
        inner.attrs["n"] = np.arange(3)
        inner.create_dataset("v", data=np.ones(2))
        f.create_dataset("plain", data=np.zeros(3))
    with tdz_numba.open(p) as ar:
        assert ar.metadata == {"note": "root"}
        assert ar["g"].metadata == {"units": "m", "scale": 2.0}
        assert ar["g"]["inner"].metadata == {"n": [0, 1, 2]}
        assert ar.source.attributes("g/w") == {"desc": "weights"}
        assert ar.source.attributes("plain") == {} and ar.source.attributes("") == {"note": "root"}
        assert ar["g"]["w"].tolist() == [0.0, 1.0, 2.0, 3.0]


def test_sub_level_metadata_is_not_the_roots(tmp_path):
    p = tdz_numba.save({"a": {"b": torch.zeros(2)}}, tmp_path / "x.tdz", metadata={"run": 1})
    with tdz_numba.open(p) as ar:
        assert ar.metadata == {"run": 1}
        assert ar["a"].metadata == {}  # a .tdz keeps its metadata at the root only
