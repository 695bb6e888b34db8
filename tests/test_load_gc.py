"""Loading, opening (and listing), saving, appending to or converting a file of thousands of
leaves runs no pass of the cyclic garbage collector.

A 20,000-leaf ``.tdz`` load used to start ~136 collections (its ``meta.json`` alone is ~100,000
containers), one of them a full pass over a heap holding torch and Numba (125-150 ms here): the
load took 220-280 ms, 83 ms without them. The collector is paused for the whole load (or open,
or ``to_dict``, or the first listing of a level, or a save, append or convert) and given back as
the caller had it. (A save of 20,000 leaves of 10 KiB: 445 ms with the collector's passes, 277
without; a lazy open + keys of it: 150 ms, 33 ms.)
"""

from __future__ import annotations

import gc

import numpy as np
import pytest
import torch

import tdz_numba

N = 3000  # leaves: ~4 containers each in meta.json, far above the youngest generation's 700


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    from safetensors.torch import save_file

    d = tmp_path_factory.mktemp("gc")
    tensors = {f"p{i:05d}": torch.full((3,), float(i)) for i in range(N)}
    out = {"tdz": tdz_numba.save(tensors, d / "many.tdz")}
    save_file(tensors, str(d / "many.safetensors"))
    out["safetensors"] = d / "many.safetensors"
    return out


def _passes(call):
    """``call()``'s result and the collector passes that ran inside it (a first call imports
    and loads kernels: not measured)."""
    passes: list[int] = []
    call()

    def cb(phase, info):
        if phase == "start":
            passes.append(info["generation"])

    gc.collect()
    gc.callbacks.append(cb)
    try:
        got = call()
    finally:
        gc.callbacks.remove(cb)
    return got, passes


def _check(tree):
    assert len(tree) == N
    values = np.array([float(tree[f"p{i:05d}"][1]) for i in range(0, N, 97)])
    np.testing.assert_array_equal(values, np.arange(0, N, 97, dtype=np.float64))


@pytest.mark.parametrize("fmt", ["tdz", "safetensors"])
def test_load_runs_no_collection(files, fmt):
    tree, passes = _passes(lambda: tdz_numba.load(files[fmt]))
    assert passes == []
    assert gc.isenabled()
    _check(tree)


@pytest.mark.parametrize("fmt", ["tdz", "safetensors"])
def test_open_and_to_dict_run_no_collection(files, fmt):
    def both():
        with tdz_numba.open(files[fmt]) as ar:
            return ar.to_dict()

    tree, passes = _passes(both)
    assert passes == []
    assert gc.isenabled()
    _check(tree)


def test_collector_left_as_the_caller_had_it(files):
    gc.disable()
    try:
        _check(tdz_numba.load(files["tdz"]))
        assert not gc.isenabled()
    finally:
        gc.enable()
    gc.freeze()  # an application's own frozen objects stay frozen, nothing of ours joins them
    try:
        frozen = gc.get_freeze_count()
        _check(tdz_numba.load(files["tdz"]))
        assert 0 < gc.get_freeze_count() <= frozen  # (a few frozen objects may be freed meanwhile)
    finally:
        gc.unfreeze()
    assert gc.isenabled()


def test_collector_given_back_when_the_load_fails(tmp_path):
    bad = tmp_path / "bad.tdz"
    bad.write_bytes(b"PK\x03\x04" + bytes(60))
    with pytest.raises(tdz_numba.TdzError):
        tdz_numba.load(bad)
    assert gc.isenabled()


def test_open_and_listing_run_no_collection(files):
    def listed():
        with tdz_numba.open(files["tdz"]) as ar:  # (the root level's children made on first use)
            return list(ar), ar["p00042"].tolist()

    (keys, value), passes = _passes(listed)
    assert passes == []
    assert gc.isenabled()
    assert len(keys) == N and keys[7] == "p00007" and value == [42.0] * 3


@pytest.mark.parametrize("what", ["save", "append", "convert"])
def test_writes_run_no_collection(files, tmp_path, what):
    tensors = {f"p{i:05d}": torch.full((3,), float(i)) for i in range(N)}
    out = tmp_path / "w.tdz"
    if what == "save":
        call = lambda: tdz_numba.save(tensors, out, durable=False)  # noqa: E731
    elif what == "append":
        tdz_numba.save({"first": torch.ones(1)}, out)
        call = lambda: tdz_numba.append(out, tensors, replace=True)  # noqa: E731
    else:
        call = lambda: tdz_numba.convert(files["safetensors"], out)  # noqa: E731
    _, passes = _passes(call)
    assert passes == []
    assert gc.isenabled()
    tree = tdz_numba.load(out)
    assert tree.pop("first", torch.ones(1)).tolist() == [1.0]  # (append's first leaf)
    _check(tree)


def test_collector_given_back_when_a_save_fails(tmp_path):
    with pytest.raises(tdz_numba.TdzError):
        tdz_numba.save({"a": torch.ones(2), "b": object()}, tmp_path / "x.tdz")
    assert gc.isenabled() and not (tmp_path / "x.tdz").exists()
