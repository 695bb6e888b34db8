"""A zero-copy load of a foreign file hints every leaf's bytes ahead (archive/foreign.py): from the
columns the views were checked with when the bulk path takes every leaf, by taking the specs apart
again otherwise; the same ranges either way."""

from __future__ import annotations

import numpy as np
import pytest
import torch

import tdz_numba
from tdz_numba.archive import foreign
from tdz_numba.tdz import specbulk


def _spy(monkeypatch):
    monkeypatch.setenv("TDZ_NUMBA_READAHEAD", "1")  # (off: nothing is hinted, see test_no_hint_when_off)
    calls: list[tuple[list[int], list[int]]] = []

    def readahead(mm, off, nb, **kw):
        calls.append((np.asarray(off).tolist(), np.asarray(nb).tolist()))
        return int(np.asarray(nb).sum())

    monkeypatch.setattr(foreign, "readahead", readahead)
    return calls


@pytest.mark.parametrize("bulk", [True, False, None])
def test_every_leaf_hinted(tmp_path, monkeypatch, bulk):
    from safetensors.torch import save_file

    ts = {f"k{i:02d}": torch.full((50 + i,), float(i)) for i in range(30)}
    p = tmp_path / "x.safetensors"
    save_file(dict(reversed(list(ts.items()))), str(p))
    if bulk is not None:  # None: 30 leaves made one by one (small_views: no extents, foreign.hint)
        monkeypatch.setattr(specbulk, "SMALL", 0)
    else:
        monkeypatch.setattr(specbulk, "SMALL", 64)
    if bulk is False:  # one leaf the bulk path refuses: the specs are taken apart again (foreign.hint)
        real = foreign.views_and_extents

        def partial(leaves, files, aligned=False, **kw):
            out, ext = real(leaves, files, aligned=aligned, **kw)
            ext.ok[0] = False
            return out, ext

        monkeypatch.setattr(foreign, "views_and_extents", partial)
    calls = _spy(monkeypatch)
    got = tdz_numba.load(p)
    assert all(torch.equal(got[k], v) for k, v in ts.items())
    with tdz_numba.open(p) as ar:
        want = sorted((ar.info(k).offset, v.nbytes) for k, v in ts.items())
    assert len(calls) == 1
    assert sorted(zip(*calls[0])) == want


def test_no_hint_when_off(tmp_path, monkeypatch):
    """Read-ahead off (the default): a view load does not even sort and merge the leaves' ranges."""
    from safetensors.torch import save_file

    ts = {f"k{i:02d}": torch.full((50 + i,), float(i)) for i in range(30)}
    p = tmp_path / "x.safetensors"
    save_file(ts, str(p))
    calls = _spy(monkeypatch)
    monkeypatch.delenv("TDZ_NUMBA_READAHEAD")
    got = tdz_numba.load(p)
    assert all(torch.equal(got[k], v) for k, v in ts.items())
    assert calls == []
