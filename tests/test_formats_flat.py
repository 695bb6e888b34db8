"""formats/_flat.py: specs and flat levels built in bulk are the ones TensorSpec/TreeSource build."""

import pytest
import torch

from tdz_numba.errors import InvalidArgumentError
from tdz_numba.formats._flat import flat_source, make_specs
from tdz_numba.formats.torch_pt import open_torch
from tdz_numba.tdz.sources import TensorSpec, TreeSource
from tdz_numba.tdz.tree import Level


def test_make_specs_equals_the_named_tuple():
    specs = make_specs(
        ["a", "b"], [torch.float16, torch.int8], [(2, 3), ()], [0, 1], [8, 100], [12, 1], ["F16", "I8"]
    )
    assert specs == {
        "a": TensorSpec("a", torch.float16, (2, 3), None, 0, 8, 12, "F16"),
        "b": TensorSpec("b", torch.int8, (), None, 1, 100, 1, "I8"),
    }
    assert type(specs["a"]) is TensorSpec and specs["a"].numel == 6 and specs["b"].codec == "stored"


def _levels(src):
    return {p: (lv.keyed, lv.children, lv.meta) for p, lv in src._levels.items()}


def test_flat_source_equals_tree_source(tmp_path):
    specs = make_specs(["x", "y/z"], [torch.float32] * 2, [(1,), (2,)], 0, [0, 4], [4, 8], ["F32"] * 2)
    tree = Level(specs, meta={"_torch_type": "dict"})
    fast = flat_source("t", tmp_path / "f", tree, files=[], metadata={"m": "1"}, meta=tree.meta)
    slow = TreeSource("t", tmp_path / "f", tree, files=[], metadata={"m": "1"})
    assert _levels(fast) == _levels(slow) and fast.metadata == slow.metadata
    assert fast.level("").children["y/z"].path == "y/z"  # a "/" in a flat name does not split it
    mixed = {"x": specs["x"], "v": 3, "sub": {"w": specs["y/z"]}}  # not all specs: TreeSource decides
    assert _levels(flat_source("t", tmp_path / "f", mixed, files=[])) == _levels(
        TreeSource("t", tmp_path / "f", mixed, files=[])
    )
    with pytest.raises(InvalidArgumentError):
        flat_source("t", tmp_path / "f", {1: specs["x"]}, files=[])


def test_torch_state_dict_root_meta(tmp_path):
    p = tmp_path / "m.pt"
    torch.save({"a": torch.ones(3), "b": torch.zeros(2, 2).t()}, p)
    src = open_torch(p)
    assert src.level("").meta == {"_torch_type": "dict"}
    assert src.level("").children["b"].leaf.strides == (1, 2)


def test_no_gc_restores_the_collector_and_keeps_frozen_objects():
    import gc

    from tdz_numba.formats._common import no_gc

    assert gc.isenabled()
    with no_gc():
        assert not gc.isenabled()
        made = [(i, str(i)) for i in range(1000)]
    assert gc.isenabled() and gc.get_freeze_count() == 0
    assert gc.get_count()[0] < 100  # the new objects went to the oldest generation, no pass pending
    gc.freeze()  # an application that froze its own objects (a pre-fork server)
    try:
        frozen = gc.get_freeze_count()
        with no_gc():
            made += [(i,) for i in range(10)]
        assert gc.get_freeze_count() == frozen and gc.isenabled()
    finally:
        gc.unfreeze()
    gc.disable()  # a caller that paused the collector itself: left paused
    try:
        with no_gc():
            pass
        assert not gc.isenabled()
    finally:
        gc.enable()
    assert len(made) == 1010
