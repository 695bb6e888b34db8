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
