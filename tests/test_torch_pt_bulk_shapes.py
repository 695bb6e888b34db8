"""The .pt bulk path (``torch_pt._bulk_tree``) with one shape for every tensor, some of them not
C-contiguous (the one-shape shortcut must still tell them apart), and with many shapes."""

from __future__ import annotations

import torch

import tdz_numba
from tdz_numba.formats import torch_pt
from tdz_numba.jit.policy import forced


def _roundtrip(tmp_path, tensors):
    p = tmp_path / "m.pt"
    torch.save(tensors, p)
    built = []
    real = torch_pt._bulk_tree

    def spy(*a):
        built.append(real(*a))
        return built[-1]

    torch_pt._bulk_tree = spy
    try:
        with forced("always"):  # the pickle scan and the bulk path, not the VM
            got = tdz_numba.load(p)
    finally:
        torch_pt._bulk_tree = real
    assert built and built[0] is not None
    assert list(got) == list(tensors)
    for k, v in tensors.items():
        assert got[k].shape == v.shape and got[k].stride() == v.stride(), k
        assert torch.equal(got[k], v), k
    return got


def test_one_shape_with_transposed_tensors(tmp_path):
    g = torch.Generator().manual_seed(0)
    ts = {f"w{i}": torch.randn(4, 4, generator=g) for i in range(40)}
    ts["w3"] = ts["w3"].t()  # same shape, strides (1, 4)
    ts["w17"] = torch.randn(4, 4, generator=g).t()
    _roundtrip(tmp_path, ts)


def test_one_shape_all_contiguous_and_many_shapes(tmp_path):
    g = torch.Generator().manual_seed(1)
    _roundtrip(tmp_path, {f"p{i}": torch.randn(8, generator=g) for i in range(30)})
    mixed = {f"m{i}": torch.randn(i % 5 + 1, 3, generator=g) for i in range(30)}
    mixed["m7"] = torch.randn(3, 2, generator=g).t()
    _roundtrip(tmp_path, mixed)


def test_columns_handed_over_only_when_every_spec_is_dense(tmp_path):
    """The bulk level carries its specs' columns (the view path checks their extents from them)
    when every tensor is C-contiguous, none when one is strided; the views are the same either way."""
    from tdz_numba import formats
    from tdz_numba.archive import foreign
    from tdz_numba.tdz import specbulk

    g = torch.Generator().manual_seed(2)
    # (more leaves than specbulk.SMALL: fewer are made one by one, without columns)
    dense = {f"w{i}": torch.randn(i % 3 + 1, 5, generator=g) for i in range(30)}
    dense["h"] = torch.randn(7, generator=g).half()
    strided = dict(dense, t=torch.randn(5, 3, generator=g).t(), s=torch.arange(10.0)[2:7])
    used = []
    real = specbulk.column_extents

    def spy(cols, files):
        used.append(real(cols, files))
        return used[-1]

    for tree, given in ((dense, True), (strided, False)):
        p = tmp_path / f"{given}.pt"
        torch.save(tree, p)
        with forced("always"):
            src = formats.open_source(p)
            try:
                leaves = [c.leaf for c in src.level("").children.values()]
                cols = src.spec_columns
                assert (cols is not None) is given
                if given:
                    assert all(a is b for a, b in zip(cols.specs, leaves)) and len(cols.specs) == len(leaves)
                    plain = specbulk.plain_extents(leaves, src.files)
                    mine = specbulk.column_extents(cols, src.files)
                    for name, x, y in zip(plain._fields, plain, mine):
                        assert (x == y).all() if hasattr(x, "all") else x == y, name
                used.clear()
                specbulk.column_extents = spy  # (what views_and_extents calls)
                try:
                    views = foreign.spec_tensors(src, leaves)
                finally:
                    specbulk.column_extents = real
                assert bool(used) is given and all(e is not None for e in used)
            finally:
                src.close()
        for (k, v), t in zip(tree.items(), views):
            assert t.shape == v.shape and t.stride() == v.stride() and torch.equal(t, v), k


def test_tiny_pickles_go_to_the_vm_unless_kernels_are_forced(tmp_path, monkeypatch):
    """One or two tensors (a pickle under torch_pt._SCAN_FROM bytes) are read by the VM where the
    kernels would run by choice; forced, the scan reads them; the tensors are the same."""
    from tdz_numba.formats import pickle_scan

    calls = []
    real = pickle_scan.scan
    monkeypatch.setattr(pickle_scan, "scan", lambda *a, **k: calls.append(1) or real(*a, **k))
    monkeypatch.setattr(torch_pt, "use_kernels", lambda n=0: True)  # (a warm process)
    g = torch.Generator().manual_seed(3)
    for k, scanned in ((1, False), (2, False), (4, True)):
        tree = {f"layer.{i}.weight": torch.randn(3, 2, generator=g) for i in range(k)}
        p = tmp_path / f"t{k}.pt"
        torch.save(tree, p)
        for force, want in (("auto", scanned), ("always", True)):  # (the tests' default: always)
            calls.clear()
            with forced(force):
                got = tdz_numba.load(p)
            assert bool(calls) is want, (k, force)
            assert list(got) == list(tree) and all(torch.equal(got[n], v) for n, v in tree.items())
