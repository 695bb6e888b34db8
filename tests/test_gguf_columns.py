"""open_gguf reads the tensor infos as columns (formats/gguf_bulk.py ``columns=True``): the specs and
the lazily built ``tensor_info`` equal what the per-record parser gives, for mixed and uniform files."""

from __future__ import annotations

import numpy as np
import pytest

from tdz_numba.formats import gguf as gg

gguf = pytest.importorskip("gguf")
from test_formats_gguf import _model, _write  # noqa: E402


@pytest.mark.parametrize("uniform", [False, True])
def test_columns_equal_per_record(tmp_path, monkeypatch, uniform):
    if uniform:
        tensors = {f"p.{i}": (np.full((2, 3), i, np.float16), None) for i in range(40)}
    else:
        tensors = _model(np.random.default_rng(5))
    p = _write(tmp_path / "m.gguf", tensors)
    buf = memoryview(np.fromfile(p, np.uint8).data)
    infos = gg._parse(buf, str(p))[1]
    fast = gg.open_gguf(p)
    with monkeypatch.context() as m:
        m.setattr(gg, "bulk_infos", lambda *a: None)
        m.setattr(gg, "bulk_columns", lambda *a: None)
        slow = gg.open_gguf(p)
        assert gg._parse(buf, str(p))[1] == infos
    want = {i.name: i for i in infos}
    for src in (fast, slow):
        assert src.tensor_info == want
        assert all(type(v) is gg.GGUFTensorInfo for v in src.tensor_info.values())
        assert list(src.level("").children) == list(tensors)
    a, b = fast.level("").children, slow.level("").children
    assert [c.leaf for c in a.values()] == [c.leaf for c in b.values()]
