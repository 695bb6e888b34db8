"""A zip's member names sorted into kinds (formats/detect.py: torch_pickles, all_end_with,
zip_kind) by C-level searches of the joined names, against the obvious per-name reference, names
with newlines included (those take the per-name path)."""

from __future__ import annotations

import random

import pytest

from tdz_numba.errors import UnsupportedError
from tdz_numba.formats.detect import all_end_with, torch_pickles, zip_kind


def _pickles(names):
    return [n for n in names if n.endswith("/data.pkl") and n.count("/") == 1]


def _kind(names):
    if "meta.json" in names:
        return "tdz"
    pkl = _pickles(names)
    if pkl:
        prefix = pkl[0][: -len("data.pkl")]
        if prefix + "constants.pkl" in names or any(n.startswith(prefix + "code/") for n in names):
            return "script"
        return "torch"
    if all(n.endswith(".npy") for n in names) or any(n.endswith(".npy") for n in names):
        return "npz"  # (other members of an npz are not arrays: not leaves)
    return "none"


PARTS = [
    "m/",
    "data.pkl",
    "/data.pkl",
    "data/0",
    ".npy",
    "\n",
    "code/",
    "constants.pkl",
    "x",
    "/",
    "meta.json",
]


@pytest.mark.parametrize("seed", range(300))
def test_against_per_name_reference(seed):
    rng = random.Random(seed)
    names = ["".join(rng.choice(PARTS) for _ in range(rng.randint(0, 4))) for _ in range(rng.randint(0, 8))]
    if seed % 3 == 0:
        names = [n for n in names if "\n" not in n]
    assert torch_pickles(names) == _pickles(names)
    assert all_end_with(names, ".npy") == all(n.endswith(".npy") for n in names)
    want = _kind(names)
    if want in ("script", "none"):
        with pytest.raises(UnsupportedError):
            zip_kind(names, "f")
    else:
        assert zip_kind(names, "f") == want


def test_edges():
    assert torch_pickles([]) == [] and all_end_with([], ".npy")
    assert torch_pickles(["a/data.pkl"]) == ["a/data.pkl"]
    assert torch_pickles(["x", "a/b/data.pkl", "/data.pkl"]) == ["/data.pkl"]
    assert torch_pickles(["a\nb/data.pkl", "c/data.pkl"]) == ["a\nb/data.pkl", "c/data.pkl"]
    assert not all_end_with(["a.npy\n.npy", "b.npy"], ".npy\n")  # suffix with a newline: per name
    assert all_end_with(["a.npy\n.npy", "b.npy"], ".npy")
    assert not all_end_with(["a.npy.npy", "b.np"], ".npy")
    with pytest.raises(UnsupportedError, match="TorchScript"):
        zip_kind(["m/data.pkl", "m/code/__torch__.py"], "f")
    with pytest.raises(UnsupportedError, match="TorchScript"):
        zip_kind(["m/code/x", "m/data.pkl"], "f")
    assert zip_kind(["m/data.pkl", "n/code/x", "xm/code/y"], "f") == "torch"
