"""``load(copy=True)`` of a ``.tdz`` reads its plain STORED leaves straight from the index's columns
(``TdzSource.extents``), without making a view of each first (issue 27: 20,000 x 10 KiB copied in
266 ms against 395 ms through the views); the other leaves still go through their views."""

from __future__ import annotations

import torch

import tdz_numba
from tdz_numba.tdz.source import TdzSource


def _counting(monkeypatch) -> list[int]:
    seen: list[int] = []
    real = TdzSource.tensors

    def tensors(self, leaves):
        seen.append(len(leaves))
        return real(self, leaves)

    monkeypatch.setattr(TdzSource, "tensors", tensors)
    return seen


def test_plain_leaves_copied_without_views(tmp_path, monkeypatch):
    g = torch.Generator().manual_seed(3)
    tree = {f"p{i:04d}": torch.randn(2560, generator=g).to(torch.float16) for i in range(600)}  # 5 KiB each
    tree["big"] = torch.randn(300_000, generator=g)  # 1.2 MiB: its own allocation
    tree["empty"] = torch.zeros(0, 3)
    tree["i64"] = torch.arange(7, dtype=torch.int64).reshape(7, 1)
    path = tdz_numba.save(tree, tmp_path / "m.tdz", durable=False)
    seen = _counting(monkeypatch)
    back = tdz_numba.load(path, copy=True)
    assert sum(seen) == 1  # one view made: the empty leaf's (no payload entry); 603 before
    assert list(back) == list(tree)
    for k, v in tree.items():
        assert back[k].dtype == v.dtype and back[k].shape == v.shape and torch.equal(back[k], v)
    # owned memory, not the file's mapping: writing one leaf changes no other, nor the file
    back["p0001"].fill_(1.0)
    assert torch.equal(back["p0002"], tree["p0002"])
    assert torch.equal(tdz_numba.load(path)["p0001"], tree["p0001"])


def test_other_leaves_still_through_views(tmp_path, monkeypatch):
    nt = torch.nested.nested_tensor([torch.ones(2, 3), torch.full((4, 3), 2.0)])
    tree = {"a": torch.randn(1 << 20), "n": nt, "b": torch.arange(10)}  # 4 MiB + a nested leaf
    path = tdz_numba.save(tree, tmp_path / "n.tdz", durable=False)
    seen = _counting(monkeypatch)
    back = tdz_numba.load(path, copy=True)
    assert sum(seen) == 1  # only the nested leaf made through its view
    assert torch.equal(back["a"], tree["a"]) and torch.equal(back["b"], tree["b"])
    assert [t.tolist() for t in back["n"].unbind()] == [t.tolist() for t in nt.unbind()]
