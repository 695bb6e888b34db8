"""What users see (issue 13): non-tensor values shown everywhere, tensorclass fields reachable,
nested shapes right, helpful missing-key / closed / checksum errors, save refusing what load
cannot read back. Each test fails on the code before this change."""

from __future__ import annotations

import json
import warnings

import numpy as np
import pytest
import torch

import tdz_numba
from tdz_numba import InvalidArgumentError, InvalidTreeError, MissingKeyError, cli


@pytest.fixture(scope="module")
def td_archive(tmp_path_factory):
    tensordict = pytest.importorskip("tensordict")
    from tensordict import NonTensorData, NonTensorStack, TensorDict, tensorclass

    @tensorclass
    class Obs:
        pixels: torch.Tensor

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        ragged = torch.nested.nested_tensor([torch.zeros(2), torch.arange(5.0)])
        td = TensorDict(
            {
                "names": NonTensorStack("x", "y", "z"),
                "cfg": NonTensorData({"lr": 0.1}),
                "obs": Obs(pixels=torch.ones(2, 3), batch_size=[2]),
                "ragged": ragged,
                "a": {"b": torch.ones(1)},
            },
            batch_size=[],
        )
    path = tmp_path_factory.mktemp("ux") / "ux.tdz"
    tdz_numba.save(td, path)
    assert tensordict is not None
    return path


def test_non_tensor_values_visible(td_archive, capsys):
    with tdz_numba.open(td_archive) as ar:
        text = repr(ar)
        html = ar._repr_html_()
    assert "['x', 'y', 'z']" in text and "{'lr': 0.1}" in text
    assert "[&#x27;x&#x27;, &#x27;y&#x27;, &#x27;z&#x27;]" in html and "&#x27;lr&#x27;: 0.1" in html
    assert "data=['x', 'y', 'z']" in repr(tdz_numba.load(td_archive)["names"])
    assert cli.main(["tree", str(td_archive)]) == 0
    out = capsys.readouterr().out
    assert "['x', 'y', 'z']" in out and "{'lr': 0.1}" in out
    assert cli.main(["tree", str(td_archive), "--json"]) == 0
    tree = json.loads(capsys.readouterr().out)
    names = next(c for c in tree["children"] if c["key"] == "names")
    assert (
        names["kind"] == "value" and names["value"] == ["x", "y", "z"] and names["type"] == "NonTensorStack"
    )
    assert cli.main(["show", str(td_archive), "names"]) == 0
    assert "['x', 'y', 'z']" in capsys.readouterr().out
    assert cli.main(["show", str(td_archive), "cfg", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["value"] == {"lr": 0.1}


def test_long_values_truncated(tmp_path):
    p = tdz_numba.save({"long": "x" * 500}, tmp_path / "l.tdz")
    with tdz_numba.open(p) as ar:
        line = repr(ar).splitlines()[1]
    assert line.endswith("...") and len(line) < 120


def test_tensorclass_fields_reachable_and_shown(td_archive, capsys):
    with tdz_numba.open(td_archive) as ar:
        assert torch.equal(ar["obs/pixels"], torch.ones(2, 3))
        assert ar.info("obs/pixels").entry == "obs/_tensordict/pixels.memmap"  # bytes unchanged
        assert "obs/pixels" in ar
        text = repr(ar)
    assert "_tensordict" not in text and "pixels: float32[2, 3]" in text
    assert cli.main(["tree", str(td_archive)]) == 0
    assert "_tensordict" not in capsys.readouterr().out


def test_nested_shapes_right_everywhere(td_archive, capsys):
    with tdz_numba.open(td_archive) as ar:
        text = repr(ar)
        html = ar._repr_html_()
    assert "ragged: float32[2, 2..5] nested" in text and "[2, 1]" not in text
    assert "[2, 2..5]" in html
    assert cli.main(["tree", str(td_archive), "--json"]) == 0
    ragged = next(c for c in json.loads(capsys.readouterr().out)["children"] if c["key"] == "ragged")
    assert ragged["nested_shapes"] == [[2], [5]] and ragged["shape_text"] == "[2, 2..5]"
    meta = tdz_numba.load(td_archive, device="meta")["ragged"]
    assert meta.is_nested and [t.shape[0] for t in meta.unbind()] == [2, 5]


def test_missing_key_names_level_lists_keys_and_suggests(tmp_path):
    p = tdz_numba.save(
        {"b": {f"k{i}": torch.ones(1) for i in range(12)} | {"zebra": torch.ones(1)}}, tmp_path / "x.tdz"
    )
    with tdz_numba.open(p) as ar:
        with pytest.raises(MissingKeyError) as e:
            ar["b/zebar"]
    msg = str(e.value)
    assert "level 'b'" in msg and "'k0'" in msg and "13 keys" in msg and "did you mean 'zebra'" in msg


def test_closed_archive_refuses_everything_naming_the_file(tmp_path):
    p = tdz_numba.save({"a": torch.ones(1)}, tmp_path / "x.tdz")
    ar = tdz_numba.open(p)
    ar.close()
    for fn in (
        ar.keys,
        lambda: list(ar),
        lambda: len(ar),
        lambda: ar["a"],
        lambda: ar.info("a"),
        ar.to_dict,
        lambda: "a" in ar,
        lambda: ar.metadata,
    ):
        with pytest.raises(InvalidArgumentError, match="x.tdz: the archive is closed"):
            fn()
    assert "closed" in repr(ar)


def test_checksum_error_after_r_plus_suggests_refresh(tmp_path):
    p = tdz_numba.save({"a": torch.zeros(4)}, tmp_path / "x.tdz")
    with tdz_numba.open(p, mode="r+") as ar:
        a = ar["a"]
    a.add_(1)  # after close (close re-stamps what was written before it)
    with pytest.raises(tdz_numba.ChecksumError, match="tdz refresh"):
        tdz_numba.verify(p)
    with tdz_numba.open(p, mode="r+") as ar:
        ar["a"].add_(1)
        ar.close(refresh=True)
    assert tdz_numba.verify(p).leaves == 1 and tdz_numba.load(p)["a"].tolist() == [2.0] * 4
    with tdz_numba.open(p) as ar, pytest.raises(InvalidArgumentError, match="r\\+"):
        ar.close(refresh=True)


@pytest.mark.parametrize("kind", ["quantized", "sparse", "meta"])
def test_save_refuses_what_load_cannot_read_back(tmp_path, kind):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        value = {
            "quantized": lambda: torch.quantize_per_tensor(torch.ones(2), 0.1, 0, torch.qint8),
            "sparse": lambda: torch.ones(2, 2).to_sparse(),
            "meta": lambda: torch.empty(2, device="meta"),
        }[kind]()
    with pytest.raises(InvalidTreeError, match="deep/leaf"):
        tdz_numba.save({"deep": {"leaf": value}}, tmp_path / "x.tdz")
    assert not (tmp_path / "x.tdz").exists()


def test_numpy_scalars_are_values_and_zero_d_stays_zero_d(tmp_path):
    p = tdz_numba.save(
        {"f": np.float32(1.5), "i": np.int64(3), "b": np.bool_(True), "s": np.str_("hi"), "z": np.array(2.0)},
        tmp_path / "x.tdz",
    )
    back = tdz_numba.load(p)
    assert back["f"].shape == () and back["f"].dtype == torch.float32 and back["f"].item() == 1.5
    assert back["i"].item() == 3 and back["b"].item() is True and back["s"] == "hi" and back["z"].shape == ()


def test_allocate_accepts_meta_templates(tmp_path):
    with tdz_numba.allocate({"x": torch.empty(3, 4, device="meta")}, tmp_path / "a.tdz") as ar:
        assert ar["x"].shape == (3, 4) and ar["x"].sum().item() == 0


def test_list_of_tensors_says_what_to_do(tmp_path):
    with pytest.raises(InvalidTreeError, match="use a dict .* torch.stack"):
        tdz_numba.save({"xs": [torch.ones(1), torch.ones(2)]}, tmp_path / "x.tdz")
