"""save(..., align=...): 64-byte (tensordict), page, and selective ("auto") payload alignment.

Every payload offset is read back from the local headers themselves (as zipfile
and unzip find them), and every variant is read by zipfile, ``unzip -t`` and
tensordict 0.15.3.
"""

import shutil
import subprocess
import zipfile

import numpy as np
import pytest
import torch
from ziputil import parse_zip

import tdz_numba
from tdz_numba.errors import InvalidArgumentError
from tdz_numba.zipfmt.layout import plan
from tdz_numba.zipfmt.writer import AUTO_PAGE, AUTO_THRESHOLD

KIB = 1024


def payload_offsets(path):
    """name -> payload offset, from each local header (fixed part + name + extra)."""
    return {r.name: r.payload for r in parse_zip(path.read_bytes()).records}  # tests/ziputil.py


def tree_of(sizes):
    return {f"leaf_{i:02d}": torch.arange(n, dtype=torch.uint8) for i, n in enumerate(sizes)}


SIZES = [10, 100, 4095, 4096, 4097, 70_000, AUTO_THRESHOLD - 1, AUTO_THRESHOLD, AUTO_THRESHOLD + 1, 3 << 20]


@pytest.mark.parametrize("align", [None, 64, 4096, 16384, 65536])
def test_blanket_alignment(tmp_path, align):
    tree = tree_of(SIZES)
    p = tdz_numba.save(tree, tmp_path / "x.tdz", align=align)
    offsets = payload_offsets(p)
    for i in range(len(SIZES)):
        assert offsets[f"leaf_{i:02d}.memmap"] % (align or 64) == 0
    assert offsets["meta.json"] == 30 + len("meta.json") + 20  # never padded
    back = tdz_numba.load(p)
    for k, v in tree.items():
        assert torch.equal(back[k], v)
    with zipfile.ZipFile(p) as zf:
        assert zf.testzip() is None


def test_auto_aligns_only_big_leaves_threshold_edges(tmp_path):
    tree = tree_of(SIZES)
    p = tdz_numba.save(tree, tmp_path / "auto.tdz", align="auto")
    offsets = payload_offsets(p)
    for i, n in enumerate(SIZES):
        off = offsets[f"leaf_{i:02d}.memmap"]
        assert off % 64 == 0
        if n >= AUTO_THRESHOLD:
            assert off % AUTO_PAGE == 0, (n, off)
    # below the threshold: exactly the 64-byte layout of those leaves (same padding as align=64)
    small = {k: v for k, v in tree.items() if v.numel() < AUTO_THRESHOLD}
    a = tdz_numba.save(small, tmp_path / "a.tdz", align="auto")
    b = tdz_numba.save(small, tmp_path / "b.tdz")
    assert payload_offsets(a) == payload_offsets(b)
    with tdz_numba.open(p) as ar:
        for i in range(len(SIZES)):
            assert torch.equal(ar[f"leaf_{i:02d}"], tree[f"leaf_{i:02d}"])


@pytest.mark.parametrize("threshold", [4096, 4097])
def test_auto_threshold_argument(tmp_path, threshold):
    p = tdz_numba.save(tree_of([4096, 10]), tmp_path / "t.tdz", align="auto", align_threshold=threshold)
    off = payload_offsets(p)["leaf_00.memmap"]
    assert (off % AUTO_PAGE == 0) == (threshold <= 4096)


def test_auto_file_size_on_small_leaves_equals_64(tmp_path):
    tree = {f"g{i}": {f"l{j}": torch.randn(2500) for j in range(20)} for i in range(10)}  # 10 KB leaves
    a = tdz_numba.save(tree, tmp_path / "a.tdz", align="auto")
    b = tdz_numba.save(tree, tmp_path / "b.tdz")
    assert a.stat().st_size == b.stat().st_size


def test_page_padding_not_copied_to_the_central_directory(tmp_path):
    tree = tree_of([5000, 6000, 7000])
    big = tdz_numba.save(tree, tmp_path / "p.tdz", align=65536)
    with zipfile.ZipFile(big) as zf:
        assert all(len(i.extra) < 64 for i in zf.infolist())  # no 64 KiB copies in the central records
    small = tdz_numba.save(tree, tmp_path / "s.tdz")
    with zipfile.ZipFile(small) as zf:  # tensordict's layout: the 64-byte block is copied
        assert all(i.extra[:2] == b"td" for i in zf.infolist() if i.filename.endswith(".memmap"))


def test_gap_when_the_padding_does_not_fit_the_extra_field(tmp_path):
    """A 64 KiB alignment may need up to 65,535 padding bytes, more than a zip extra field
    holds next to its other blocks: the local header then starts a little later (a gap of
    zeros after the previous payload). Find a size that forces it, then check readers."""
    names = ["meta.json", "leaf_00.memmap", "leaf_01.memmap"]
    for n in range(0, AUTO_PAGE, 7):  # noqa: B007 - n is used after the loop
        p = plan(names, [200, n, 10], [0, 64, AUTO_PAGE], [0, 0, 0])  # one kernel call per size
        gap = int(p.header_offset[2]) - int(p.payload_offset[1] + n)
        if gap:
            break
    else:  # pragma: no cover
        pytest.fail("no size produced a gap")
    assert int(p.payload_offset[2]) % AUTO_PAGE == 0 and 0 < gap < 64
    assert int(p.pad[2]) <= 65535 - 24
    # the same through a real save: the plan of the real entries tells which size of leaf_00 gives a gap
    from tdz_numba.tdz.tree import flatten

    def tree_with(n):
        return {"leaf_00": torch.zeros(n, dtype=torch.uint8), "leaf_01": torch.arange(256, dtype=torch.uint8)}

    # leaf_00's payload starts at 64 KiB; leaf_01's header (68 bytes) then ends just past the
    # next 64 KiB boundary when n is a little below 64 KiB - 68: the padding would not fit
    for n in range(AUTO_PAGE - 200, AUTO_PAGE):
        entries = flatten(tree_with(n))
        sizes = [len(e.data) if e.name == "meta.json" else e.nbytes for e in entries]
        q = plan([e.name for e in entries], sizes, [0, AUTO_PAGE, AUTO_PAGE], [0, 0, 0])
        if int(q.header_offset[2]) > int(q.payload_offset[1]) + n:
            break
    else:  # pragma: no cover
        pytest.fail("no leaf size gave a gap")
    tree = tree_with(n)
    path = tdz_numba.save(tree, tmp_path / "gap.tdz", align=AUTO_PAGE)
    with zipfile.ZipFile(path) as zf:
        infos = {i.filename: i for i in zf.infolist()}
    offs = payload_offsets(path)
    assert infos["leaf_01.memmap"].header_offset > offs["leaf_00.memmap"] + n  # the gap is on disk
    assert offs["leaf_01.memmap"] % AUTO_PAGE == 0
    with zipfile.ZipFile(path) as zf:
        assert zf.testzip() is None and zf.read("leaf_01.memmap") == bytes(range(256))
    assert torch.equal(tdz_numba.load(path)["leaf_01"], tree["leaf_01"])
    tdz_numba.verify(path)
    if shutil.which("unzip"):
        proc = subprocess.run(["unzip", "-t", str(path)], capture_output=True, text=True)
        assert proc.returncode == 0, proc.stdout + proc.stderr


@pytest.mark.parametrize("align", [4096, 65536, "auto"])
def test_every_variant_reads_in_unzip_and_tensordict(tmp_path, align):
    tree = {
        "big": torch.randn(300_000),
        "small": {"a": torch.arange(7), "b": torch.ones(3, 5)},
        "name": "run-1",
    }
    p = tdz_numba.save(
        tree, tmp_path / "v.tdz", align=align, align_threshold=1 << 20 if align == "auto" else None
    )
    if shutil.which("unzip"):
        proc = subprocess.run(["unzip", "-t", str(p)], capture_output=True, text=True)
        assert proc.returncode == 0, proc.stdout + proc.stderr
        out = tmp_path / "unzipped"
        subprocess.run(["unzip", "-q", str(p), "-d", str(out)], check=True)
        assert np.array_equal(np.fromfile(out / "big.memmap", np.float32), tree["big"].numpy())
    tensordict = pytest.importorskip("tensordict")
    td = tensordict.TensorDict.load_memmap(p)
    assert torch.equal(td["big"], tree["big"]) and torch.equal(td["small", "b"], tree["small"]["b"])
    assert td["name"] == "run-1"


def test_pack_and_allocate_take_align(tmp_path):
    p = tdz_numba.save(tree_of([5000, 3 << 20]), tmp_path / "x.tdz")
    d = tdz_numba.unpack(p, tmp_path / "dir")
    q = tdz_numba.pack(d, tmp_path / "y.tdz", align="auto")
    offs = payload_offsets(q)
    assert offs["leaf_01.memmap"] % AUTO_PAGE == 0 and offs["leaf_00.memmap"] % 64 == 0
    with tdz_numba.allocate(
        {"obs": torch.zeros(84, 84).expand(100, 84, 84)}, tmp_path / "a.tdz", align=4096
    ) as buf:
        assert buf.info("obs").offset % 4096 == 0


@pytest.mark.parametrize("bad", [32, 100, 3000, 1 << 17, True, 4096.0, "pages"])
def test_bad_align_values(tmp_path, bad):
    with pytest.raises(InvalidArgumentError):
        tdz_numba.save({"a": torch.ones(3)}, tmp_path / "x.tdz", align=bad)
    assert not (tmp_path / "x.tdz").exists()


def test_threshold_only_with_auto(tmp_path):
    with pytest.raises(InvalidArgumentError):
        tdz_numba.save({"a": torch.ones(3)}, tmp_path / "x.tdz", align=4096, align_threshold=10)
    with pytest.raises(InvalidArgumentError):
        tdz_numba.save({"a": torch.ones(3)}, tmp_path / "x.tdz", align="auto", align_threshold=-1)
