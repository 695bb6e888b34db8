"""``load(copy=True)`` of a ``.tdz`` with many small leaves (archive/bulk.py ``_slabs``): the small
leaves are packed into shared slabs of at most ``SLAB`` bytes, one allocation per slab instead of one
per leaf, and each is still its own tensor: its own version counter, no autograd base, its bytes its
own (a write to one leaf changes no other), nothing shared with the file's mapping."""

from __future__ import annotations

import pytest
import torch

import tdz_numba
from tdz_numba.archive import bulk


def _tree(g: torch.Generator) -> dict[str, torch.Tensor]:
    tree: dict[str, torch.Tensor] = {}
    for i in range(60):
        kind = i % 6
        if kind == 0:
            t = torch.randn(3 + i, generator=g)
        elif kind == 1:
            t = torch.randn(2, 5, i % 4 + 1, generator=g).to(torch.float16)
        elif kind == 2:
            t = torch.randint(0, 2, (i + 1,), generator=g).bool()
        elif kind == 3:
            t = torch.randn(4, i % 3 + 1, generator=g).to(torch.bfloat16)
        elif kind == 4:
            t = torch.randn(i % 5 + 1, generator=g, dtype=torch.complex64)
        else:
            t = torch.tensor(float(i))  # 0-d
        tree[f"s{i:02d}"] = t
    tree["big"] = torch.randn(bulk.SLAB_LEAF // 4 + 3, generator=g)  # above SLAB_LEAF: its own storage
    return tree


@pytest.mark.parametrize("slab", [None, 256])
def test_small_leaves_share_slabs_but_stay_their_own_tensors(tmp_path, monkeypatch, slab):
    monkeypatch.setattr(bulk, "_SMALL_COPY", 0)  # the read path, not the clone of tiny archives
    if slab is not None:
        monkeypatch.setattr(bulk, "SLAB", slab)  # many slabs; leaves larger than one get one each
    g = torch.Generator().manual_seed(7)
    tree = _tree(g)
    p = tdz_numba.save(tree, tmp_path / "small.tdz")
    got = tdz_numba.load(p, copy=True)
    with tdz_numba.open(p) as ar:
        base = ar["s00"].untyped_storage().data_ptr()
        for k, v in tree.items():
            assert got[k].dtype == v.dtype and got[k].shape == v.shape and torch.equal(got[k], v), k
            assert got[k].untyped_storage().data_ptr() != base, k  # owned, not the mapping
    small = [k for k in tree if k != "big"]
    storages = {got[k].untyped_storage().data_ptr() for k in small}
    assert len(storages) < len(small)  # slabs: fewer allocations than leaves
    for k in small:
        st = got[k].untyped_storage()
        assert st.nbytes() <= max(bulk.SLAB, got[k].nbytes), k
        assert got[k]._base is None and not got[k]._is_view(), k
    assert got["big"].untyped_storage().nbytes() == got["big"].nbytes
    assert len({got[k].data_ptr() for k in tree}) == len(tree)  # no two leaves at one address
    before = {k: got[k]._version for k in tree}
    snapshot = {k: got[k].clone() for k in tree}
    got["s06"].add_(1)  # float32, between other leaves of its slab
    assert got["s06"]._version == before["s06"] + 1
    for k in tree:
        if k != "s06":
            assert got[k]._version == before[k], k
            assert torch.equal(got[k], snapshot[k]), k


def test_sgd_step_on_slab_leaves(tmp_path, monkeypatch):
    """A model loaded with copy=True and assign=True trains: each parameter is updated alone."""
    monkeypatch.setattr(bulk, "_SMALL_COPY", 0)
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.BatchNorm1d(3), torch.nn.Linear(3, 2))
    p = tdz_numba.save({k: v.detach().clone() for k, v in model.state_dict().items()}, tmp_path / "m.tdz")
    state = tdz_numba.load(p, copy=True)
    fresh = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.BatchNorm1d(3), torch.nn.Linear(3, 2))
    fresh.load_state_dict(dict(state), assign=True)
    opt = torch.optim.SGD(fresh.parameters(), lr=0.1)
    ref = {k: v.detach().clone() for k, v in model.state_dict().items()}
    x = torch.randn(8, 4)
    (fresh(x) ** 2).sum().backward()  # BatchNorm's running stats are written in place
    opt.step()
    (model(x) ** 2).sum().backward()
    with torch.no_grad():
        for q in model.parameters():
            q -= 0.1 * q.grad
    for k, v in model.state_dict().items():
        assert torch.allclose(fresh.state_dict()[k], v), k
    assert not torch.equal(fresh.state_dict()["0.weight"], ref["0.weight"])
