"""tensordict fidelity: every TensorDictBase subclass and view is written with the
``_class`` / ``_type`` tensordict 0.15.3 records, and read back (issue 10 item 10).

Each fixture type of tensordict's ``TestTensorDicts`` (sub-tensordicts, permuted,
(un)squeezed, TensorDictParams, typed, nested typed, lazy stacks, MetaData, a user
subclass of TensorDict) goes through ``tdz_numba.tensordict.save/load`` directly and
through tensordict's own ``td.save`` / ``load_memmap`` / ``unpack_memmap`` with
``enable()`` active; the meta.json of every level must equal tensordict's own.
"""

from __future__ import annotations

import json
import warnings
import zipfile

import pytest
import torch

pytest.importorskip("tensordict")
warnings.filterwarnings("ignore", category=DeprecationWarning)

from tensordict import (  # noqa: E402
    LazyStackedTensorDict,
    MetaData,
    NonTensorData,
    TensorDict,
    TypedTensorDict,
    is_memmap_archive,
    unpack_memmap,
)
from tensordict.base import _register_tensor_class  # noqa: E402
from tensordict.nn import TensorDictParams  # noqa: E402

import tdz_numba  # noqa: E402
import tdz_numba.tensordict as tdt  # noqa: E402


class _Typed(TypedTensorDict):
    a: torch.Tensor
    b: torch.Tensor


class _NestedTyped(TypedTensorDict):
    a: torch.Tensor
    inner: TensorDict


class _UserTD(TensorDict):
    pass


_register_tensor_class(_UserTD)  # so that tensordict's own load_memmap finds it, as ours does


def _base(*shape):
    g = torch.Generator().manual_seed(len(shape))
    return TensorDict(
        a=torch.randn(*shape, 5, generator=g),
        b=torch.randint(10, (*shape, 3), generator=g),
        batch_size=list(shape),
    )


def _fixtures():
    return {
        "td": lambda: _base(4, 3, 2, 1),
        "sub_td": lambda: _base(2, 4, 3, 2, 1)._get_sub_tensordict(1),
        "sub_td2": lambda: _base(4, 2, 3, 2, 1)._get_sub_tensordict((slice(None), 1)),
        "permute_td": lambda: _base(3, 1, 4, 2).permute(2, 0, 3, 1),
        "unsqueezed_td": lambda: _base(4, 3, 2).unsqueeze(-1),
        "squeezed_td": lambda: _base(4, 3, 1, 2, 1).squeeze(2),
        "td_params": lambda: TensorDictParams(_base(4, 3, 2, 1)),
        "typed_td": lambda: _Typed(a=torch.randn(4, 3, 5), b=torch.zeros(4, 3, 2), batch_size=[4, 3]),
        "nested_typed_td": lambda: _NestedTyped(a=torch.randn(4, 3), inner=_base(4, 3), batch_size=[4, 3]),
        "typed_inside_td": lambda: TensorDict(
            x=_Typed(a=torch.randn(2, 5), b=torch.zeros(2, 1), batch_size=[2]), batch_size=[2]
        ),
        "params_inside_td": lambda: TensorDict(p=TensorDictParams(_base(3)), batch_size=[3]),
        "sub_td_nested": lambda: TensorDict(x=_base(3, 2), batch_size=[3])._get_sub_tensordict(1),
        "stacked_td": lambda: LazyStackedTensorDict(_base(4, 3), _base(4, 3), stack_dim=1),
        "nested_stacked_td": lambda: TensorDict(
            s=LazyStackedTensorDict(_base(2), _base(2), stack_dim=0), batch_size=[2]
        ),
        "metadata": lambda: TensorDict(m=MetaData[str]("a metadata!"), n=NonTensorData("text"), x=_base(2)),
        "user_subclass": lambda: TensorDict(u=_UserTD(a=torch.ones(2), batch_size=[2]), batch_size=[2]),
    }


FIXTURES = _fixtures()


def _metas(path) -> dict[str, dict]:
    with zipfile.ZipFile(path) as z:
        return {i.filename: json.loads(z.read(i)) for i in z.infolist() if i.filename.endswith("meta.json")}


def _theirs(td, tmp_path):
    assert not tdt.is_enabled()
    p = tmp_path / "theirs.tdz"
    td.save(p, copy_existing=True)
    return p


def _equal(a, b) -> bool:
    return bool((a.cpu() == b.cpu()).all())


@pytest.mark.parametrize("name", list(FIXTURES))
def test_meta_json_equals_tensordicts(name, tmp_path):
    td = FIXTURES[name]()
    theirs = _metas(_theirs(td, tmp_path))
    ours = _metas(tdt.save(td, tmp_path / "ours.tdz"))
    assert list(ours) == list(theirs)
    for entry in theirs:
        assert ours[entry] == theirs[entry], entry
        assert list(ours[entry]) == list(theirs[entry]), entry  # same field order


@pytest.mark.parametrize("name", list(FIXTURES))
def test_direct_save_load_roundtrip(name, tmp_path):
    td = FIXTURES[name]()
    p = tdt.save(td, tmp_path / "x.tdz")
    back = tdt.load(p)
    expected = TensorDict.load_memmap(_theirs(td, tmp_path))
    assert type(back) is type(expected)
    assert back.batch_size == td.batch_size
    assert _equal(back, td)
    # the plain loader reads what we write, too
    tree = tdz_numba.load(p)
    assert tree.meta["_class"] == _metas(p)["meta.json"]["_class"]


@pytest.mark.parametrize("name", list(FIXTURES))
def test_through_enable(name, tmp_path):
    # tensordict's own test_memmap_archive, with tdz_numba behind tensordict's API
    td = FIXTURES[name]()
    archive = tmp_path / "saved.tdz"
    with tdt.enabled():
        td.save(archive, copy_existing=True)
        assert is_memmap_archive(archive)
        loaded = TensorDict.load_memmap(archive)
        assert _equal(td, loaded)
        unpack_memmap(archive, tmp_path / "unpacked")
        loaded_dir = TensorDict.load_memmap(tmp_path / "unpacked")
        assert _equal(td, loaded_dir)
    tdz_numba.verify(archive)
    # tensordict without us reads the archive written through enable()
    assert _equal(td, TensorDict.load_memmap(archive))


def test_written_class_rule():
    from tdz_numba.tdz.tdcompat import _written_class

    assert _written_class(_base(2)) is TensorDict
    assert _written_class(_UserTD(a=torch.ones(1), batch_size=[1])) is _UserTD
    assert _written_class(FIXTURES["sub_td"]()) is TensorDict
    assert _written_class(FIXTURES["td_params"]()) is TensorDict
    assert _written_class(FIXTURES["typed_td"]()) is TensorDict


def test_plain_load_of_a_user_subclass_lists_its_keys(tmp_path):
    # tdz_numba.load (no tensordict class resolution) reads a TensorDict subclass's
    # level by its key listing, as for TensorDict itself
    td = TensorDict(
        u=_UserTD(a=torch.ones(2), b=TensorDict(c=torch.zeros(2, 1), batch_size=[2]), batch_size=[2]),
        batch_size=[2],
    )
    tree = tdz_numba.load(tdt.save(td, tmp_path / "x.tdz"))
    assert tree["u"].type_name == "_UserTD"
    assert sorted(tree["u"]) == ["a", "b"] and tree["u"]["a"].tolist() == [1.0, 1.0]
    assert tree["u"]["b"]["c"].shape == (2, 1)
