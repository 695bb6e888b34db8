"""Benchmark workloads: the data every format saves and reads, made once per run."""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

from .constants import DEFAULT_SIZE_MIB, IMAGE_LEAVES, IMAGE_SHAPE

__all__ = ["Workload", "make_images", "make_workload"]

# -- workloads -------------------------------------------------------------------------


@dataclass
class Workload:
    """One workload's data, made once: the nested tree and views of it for every format."""

    name: str
    description: str
    tree: dict  # nested dicts of tensors
    flat: dict  # "group_000.leaf_00" -> tensor (the same tensors)
    arrays: list  # numpy views of every leaf, in order
    nbytes: int
    _td: Any = None

    @property
    def td(self):
        """The tree as a TensorDict (built once, outside timing; shares the tensors)."""
        if self._td is None:
            from tensordict import TensorDict

            self._td = TensorDict(self.tree, batch_size=[])
        return self._td

    def leaves(self) -> Iterable:
        return self.flat.values()


def _fill_images_py(out, params, sx, cx, sy, cy, seed):  # pragma: no cover - compiled by Numba
    """Fills ``out`` (uint8 ``[n, c, h, w]``) with image-like pixels; ``params[i]`` holds
    image i's parameters (see :func:`make_images`), ``sx``/``cx`` (``w``) and ``sy``/``cy``
    (``h``) are scratch. The noise comes from a 31-bit LCG seeded with ``seed`` (the same
    integers in Python and in Numba), so the result is deterministic."""
    n, c, h, w = out.shape
    state = seed % 2147483648
    for i in range(n):
        p = params[i]
        fx, fy, ph = p[0], p[1], p[2]  # shading: 10 sin(fx x + fy y + ph), separable
        ey, ex, ry, rx = p[3], p[4], p[5], p[6]  # background: outside this ellipse = 0
        has_bg = p[7] < 0.7
        y0, x0 = p[8], p[9]  # a flat square object of side 0.25
        for x in range(w):
            sx[x] = math.sin(fx * x / (w - 1) + ph)
            cx[x] = math.cos(fx * x / (w - 1) + ph)
        for y in range(h):
            sy[y] = math.sin(fy * y / (h - 1))
            cy[y] = math.cos(fy * y / (h - 1))
        for ch in range(c):
            color = p[10 + 3 * ch] * 255.0
            base = p[11 + 3 * ch] * 160.0 + 40.0
            slope = (p[12 + 3 * ch] - 0.5) * 100.0
            for y in range(h):
                yy = y / (h - 1)
                dy = (yy - ey) / ry
                in_y = y0 <= yy < y0 + 0.25
                for x in range(w):
                    xx = x / (w - 1)
                    dx = (xx - ex) / rx
                    if in_y and x0 <= xx < x0 + 0.25:
                        v = color
                    elif has_bg and dy * dy + dx * dx > 1.0:
                        v = 0.0
                    else:
                        v = base + slope * (xx - yy) + 10.0 * (sx[x] * cy[y] + cx[x] * sy[y])
                        state = (state * 1103515245 + 12345) % 2147483648
                        r = state >> 23  # 0..255
                        if r < 40:  # ~16% of the values: sensor noise -2..2
                            v += r % 5 - 2
                    out[i, ch, y, x] = int(min(max(v, 0.0), 255.0))
    return out


_FILL_IMAGES: list = []  # the compiled kernel, made on first use (Numba is imported lazily)


def make_images(n: int, shape: tuple[int, int, int] = IMAGE_SHAPE, seed: int = 0):
    """``n`` deterministic image-like images as a uint8 numpy array ``[n, *shape]``: per
    image a smooth colour gradient with low-frequency shading and sparse +-2 noise, in
    70% of them the background (outside an ellipse) masked to 0, and a flat square
    object. Deflate (zlib-ng's default level) shrinks it about 3.5x."""
    import numpy as np

    if not _FILL_IMAGES:
        import numba

        _FILL_IMAGES.append(numba.njit(cache=True, nogil=True)(_fill_images_py))
    c, h, w = shape
    rng = np.random.default_rng(seed)
    params = rng.random((n, 10 + 3 * c))
    params[:, 0:2] = params[:, 0:2] * 12 + 2  # shading frequencies
    params[:, 2] *= 2 * math.pi
    params[:, 5:7] = params[:, 5:7] * 0.3 + 0.2  # ellipse radii
    params[:, 8:10] *= 0.75
    out = np.empty((n, c, h, w), np.uint8)
    return _FILL_IMAGES[0](out, params, np.empty(w), np.empty(w), np.empty(h), np.empty(h), seed)


def make_workload(name: str, size_mib: float, seed: int = 0) -> Workload:
    """The ``flat`` or ``small`` workload at ``size_mib`` MiB of float32 random data, or
    ``images_flat`` / ``images_small``: the same 2000 x B images ``[3, 64, 64]`` (B =
    ``size_mib`` MiB / 2000 / 12 KiB rounded; below 1.5, B = 1 and the images are
    ``[3, H, 64]`` with H fitting the size) as one leaf or as 100 groups x 20 leaves
    of B images."""
    import torch

    scale = size_mib / DEFAULT_SIZE_MIB
    g = torch.Generator().manual_seed(seed)
    if name in ("images_flat", "images_small"):
        groups, per_group = IMAGE_LEAVES
        leaves = groups * per_group
        leaf_bytes = size_mib * 2**20 / leaves
        c, h, w = IMAGE_SHAPE
        if leaf_bytes >= 1.5 * c * h * w:
            per_leaf, image = round(leaf_bytes / (c * h * w)), IMAGE_SHAPE
        else:  # below 1.5 images per leaf (about 35 MiB): one shorter image per leaf
            per_leaf, image = 1, (c, max(1, min(h, round(leaf_bytes / (c * w)))), w)
        images = torch.from_numpy(make_images(leaves * per_leaf, image, seed))
        shape = ", ".join(map(str, image))
        if name == "images_flat":
            tree: dict[str, Any] = {"images": images}
            description = f"1 x uint8[{leaves * per_leaf}, {shape}] (image-like)"
        else:
            chunks = images.split(per_leaf)  # leaf k = images k*B .. (k+1)*B - 1, own storage
            tree = {
                f"group_{i:03d}": {
                    f"leaf_{j:02d}": chunks[i * per_group + j].clone() for j in range(per_group)
                }
                for i in range(groups)
            }
            del chunks
            description = f"{groups} groups x {per_group} x uint8[{per_leaf}, {shape}] (image-like)"
            del images
    elif name == "flat":
        rows = max(1, round(2048 * scale))
        tree = {f"leaf_{i:02d}": torch.randn(rows, 4096, generator=g) for i in range(8)}
        description = f"8 x float32[{rows}, 4096]"
    elif name == "small":
        values = max(1, round(33_554 * scale))
        tree = {
            f"group_{i:03d}": {f"leaf_{j:02d}": torch.randn(values, generator=g) for j in range(20)}
            for i in range(100)
        }
        description = f"100 groups x 20 x float32[{values}]"
    else:  # pragma: no cover - argparse restricts the names
        raise ValueError(f"unknown workload {name!r}")
    flat: dict = {}

    def walk(d: dict, prefix: str) -> None:
        for k, v in d.items():
            if isinstance(v, dict):
                walk(v, f"{prefix}{k}.")
            else:
                flat[prefix + k] = v

    walk(tree, "")
    arrays = [t.numpy() for t in flat.values()]
    nbytes = sum(a.nbytes for a in arrays)
    return Workload(name, description, tree, flat, arrays, nbytes)
