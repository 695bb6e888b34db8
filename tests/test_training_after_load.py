"""Training after a zero-copy load (issue 25): every loaded leaf has its own version counter.

``model.load_state_dict(tdz_numba.load(path), assign=True)`` then one SGD step on a small
CNN with BatchNorm: BatchNorm's ``running_mean.add_()`` must not mark the convolution's
weight as modified (it did while every leaf was an autograd view of one base tensor).
Checked for ``.tdz`` and every foreign format, with the leaves still views of the mapping.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

import tdz_numba


def _model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(
        torch.nn.Conv2d(3, 8, 3),
        torch.nn.BatchNorm2d(8),
        torch.nn.ReLU(),
        torch.nn.Flatten(),
        torch.nn.Linear(8 * 6 * 6, 4),
    )


def _state() -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in _model().state_dict().items()}


def _write(fmt: str, d: Path, sd: dict[str, torch.Tensor]) -> Path:
    arrays = {k: v.numpy() for k, v in sd.items()}
    if fmt == "tdz":
        return tdz_numba.save(sd, d / "m.tdz")
    if fmt == "safetensors":
        from safetensors.torch import save_file

        save_file(sd, str(d / "m.safetensors"))
        return d / "m.safetensors"
    if fmt == "pt":
        torch.save(sd, d / "m.pt")
        return d / "m.pt"
    if fmt == "npz":
        np.savez(d / "m.npz", **arrays)
        return d / "m.npz"
    if fmt == "gguf":
        gguf = pytest.importorskip("gguf")
        w = gguf.GGUFWriter(str(d / "m.gguf"), "llama")
        for k, a in arrays.items():
            w.add_tensor(k, a)
        w.write_header_to_file()
        w.write_kv_data_to_file()
        w.write_tensors_to_file()
        w.close()
        return d / "m.gguf"
    if fmt == "hdf5":
        h5py = pytest.importorskip("h5py")
        with h5py.File(d / "m.h5", "w") as f:
            for k, a in arrays.items():
                f.create_dataset(k, data=a)
        return d / "m.h5"
    if fmt == "onnx":
        pytest.importorskip("onnx")
        from onnx import helper, numpy_helper, save

        inits = [numpy_helper.from_array(a, k) for k, a in arrays.items()]
        graph = helper.make_graph([], "g", [], [], inits)
        save(helper.make_model(graph), str(d / "m.onnx"))
        return d / "m.onnx"
    if fmt == "memmap_dir":
        td = pytest.importorskip("tensordict")
        td.TensorDict(dict(sd), batch_size=[]).memmap(d / "mm")
        return d / "mm"
    raise AssertionError(fmt)


FORMATS = ["tdz", "safetensors", "pt", "npz", "gguf", "hdf5", "onnx", "memmap_dir"]


@pytest.mark.parametrize("fmt", FORMATS)
def test_sgd_step_after_assign_load(tmp_path, fmt):
    sd = _state()
    path = _write(fmt, tmp_path, sd)
    loaded = tdz_numba.load(path)
    flat = dict(loaded.items())
    if fmt == "hdf5":  # a 0-d dataset reads as a plain value (the reader's rule for scalars)
        flat["1.num_batches_tracked"] = torch.tensor(flat["1.num_batches_tracked"])
    assert sorted(flat) == sorted(sd)
    for k, v in sd.items():
        assert torch.equal(flat[k], v), k
    model = _model()
    model.load_state_dict(flat, assign=True)
    # the weights are the loaded tensors (zero-copy where the format allows a view)
    assert model[0].weight.data_ptr() == flat["0.weight"].data_ptr()
    model.train()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    x = torch.randn(2, 3, 8, 8, generator=torch.Generator().manual_seed(1))
    before = model[0].weight.detach().clone()
    loss = model(x).square().mean()  # BatchNorm bumps running_mean/var in place here
    loss.backward()  # failed: "... is at version 1; expected version 0"
    opt.step()
    assert not torch.equal(model[0].weight.detach(), before)
    assert int(model[1].num_batches_tracked) == int(sd["1.num_batches_tracked"]) + 1


@pytest.mark.parametrize("fmt", FORMATS)
def test_inplace_write_bumps_only_its_leaf(tmp_path, fmt):
    path = _write(fmt, tmp_path, _state())
    tree = tdz_numba.load(path)
    t1, t2 = tree["1.running_mean"], tree["0.weight"]
    v2 = t2._version
    t1.add_(1)
    assert t1._version >= 1
    assert t2._version == v2
    assert not t2._is_view() or t2._base is not t1._base


def test_leaves_share_the_mapping(tmp_path):
    """Still zero-copy: two .tdz leaves live on the one storage of the file's mapping."""
    path = tdz_numba.save({"a": torch.arange(16.0), "b": torch.ones(4, 4)}, tmp_path / "x.tdz")
    tree = tdz_numba.load(path)
    a, b = tree["a"], tree["b"]
    assert a.untyped_storage().data_ptr() == b.untyped_storage().data_ptr()
    assert not a._is_view() and not b._is_view()
    with tdz_numba.open(path) as ar:
        one, other = ar["b"], ar["a"]
        assert one.untyped_storage().data_ptr() == other.untyped_storage().data_ptr()
        before = other._version
        one.mul_(2)
        assert other._version == before
        assert torch.equal(ar["b"], torch.full((4, 4), 2.0))  # the same leaf, written in place
