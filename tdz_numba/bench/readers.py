"""The workloads, writers and readers of ``tdz bench --read-formats`` (see :mod:`.readformats`).

Every reader is a function ``path -> (tensors, keep)``: the list of tensors (torch tensors or numpy
arrays) it produced, and an object to release (or close) once the harness has touched them. What the
reader does inside the timed region is what its library offers for the mode:

* ``view``: the zero-copy (or fastest) path: ``tdz_numba.load``, ``ztensor.open`` + ``torch.from_dlpack``
  of every tensor, and the format's own library's mapped read where it has one (``safe_open``,
  ``torch.load(mmap=True)``, ``GGUFReader``, ``TensorDict.load_memmap``); npz, HDF5 and ONNX have none
  (``np.load``, ``h5py`` and ``onnx.load`` read into memory);
* ``copy``: every tensor in owned memory: ``tdz_numba.load(copy=True)``, ``ztensor.numpy.load_file(copy=True)``,
  and the library's in-memory load (``safetensors.torch.load`` of the file's bytes, ``torch.load`` without
  mmap, ``np.array`` of GGUF's views, ...).

The harness then touches one byte of every 4 KiB page of every tensor (:func:`touch`): the same work
for every reader, in one compiled pass over the tensors' addresses.
"""

from __future__ import annotations

from collections.abc import Callable
from itertools import repeat
from pathlib import Path
from typing import Any

import numpy as np
from numba import carray, njit

from ..jit.presets import u8_pointer

__all__ = [
    "FORMATS",
    "SUFFIX",
    "PAGE",
    "llama_shapes",
    "make_tensors",
    "write",
    "reader",
    "readers_of",
    "touch",
    "addresses",
]

FORMATS = ("safetensors", "torch", "npz", "gguf", "hdf5", "onnx", "tdz")
SUFFIX = {
    "tdz": ".tdz",
    "safetensors": ".safetensors",
    "torch": ".pt",
    "npz": ".npz",
    "gguf": ".gguf",
    "hdf5": ".h5",
    "onnx": ".onnx",
    "zt": ".zt",
}
PAGE = 4096
SMALL_ELEMS = 5120  # float16 elements of one "small" tensor: 10 KiB


def llama_shapes() -> dict[str, tuple[int, ...]]:
    """Tensor names and shapes of Llama-3.2-1B (hidden 2048, 16 layers, 8 KV heads, MLP 8192)."""
    h, inter, kv, vocab = 2048, 8192, 512, 128256
    out: dict[str, tuple[int, ...]] = {"model.embed_tokens.weight": (vocab, h)}
    for i in range(16):
        p = f"model.layers.{i}."
        out |= {
            p + "input_layernorm.weight": (h,),
            p + "self_attn.q_proj.weight": (h, h),
            p + "self_attn.k_proj.weight": (kv, h),
            p + "self_attn.v_proj.weight": (kv, h),
            p + "self_attn.o_proj.weight": (h, h),
            p + "post_attention_layernorm.weight": (h,),
            p + "mlp.gate_proj.weight": (inter, h),
            p + "mlp.up_proj.weight": (inter, h),
            p + "mlp.down_proj.weight": (h, inter),
        }
    out["model.norm.weight"] = (h,)
    return out


def make_tensors(
    workload: str, size_mib: float = 512.0, seed: int = 0, count: int | None = None
) -> dict[str, Any]:
    """Flat ``name -> float16 tensor`` dict of a workload.

    ``llama`` (alias ``mixed``): Llama-3.2-1B's tensors, every matrix's first dimension scaled so that the
    total is ``size_mib``. ``small``: ``count`` distinct tensors of 10 KiB (default: as many as fit in
    ``size_mib``), each with its own storage.
    """
    import torch

    g = torch.Generator().manual_seed(seed)
    if workload in ("llama", "mixed"):
        target = int(size_mib * 2**20) // 2  # float16 elements
        shapes = llama_shapes()
        full = sum(int(torch.Size(s).numel()) for s in shapes.values())
        scale = target / full
        out = {}
        for name, shape in shapes.items():
            if len(shape) == 2:  # scale the rows: the matrices keep their width
                shape = (max(1, round(shape[0] * scale)), shape[1])
            out[name] = torch.randn(shape, generator=g).to(torch.float16)
        return out
    if workload == "small":
        n = count if count is not None else max(1, int(size_mib * 2**20) // 2 // SMALL_ELEMS)
        # every tensor distinct (a writer that stores identical tensors once must not gain from repeats)
        flat = torch.randn(n * SMALL_ELEMS, generator=g).to(torch.float16)
        return {
            f"params.{i // 100:04d}.p{i % 100:02d}": flat[i * SMALL_ELEMS : (i + 1) * SMALL_ELEMS].clone()
            for i in range(n)
        }
    raise ValueError(f"unknown workload {workload!r}; choose llama or small")


# -- writers: each format's own library -------------------------------------------------------------


def write(fmt: str, tensors: dict[str, Any], path: Path) -> None:
    """Writes ``tensors`` as ``fmt`` with the format's own library (``zt``: ztensor's ``align=4096``)."""
    if fmt == "tdz":
        import tdz_numba

        tdz_numba.save(tensors, path)
    elif fmt == "safetensors":
        from safetensors.torch import save_file

        save_file(tensors, str(path))
    elif fmt == "torch":
        import torch

        torch.save(tensors, path)
    elif fmt == "npz":
        np.savez(path, **{k: v.numpy() for k, v in tensors.items()})
    elif fmt == "gguf":
        import gguf

        w = gguf.GGUFWriter(str(path), "llama")
        for k, v in tensors.items():
            w.add_tensor(k, v.numpy())
        w.write_header_to_file()
        w.write_kv_data_to_file()
        w.write_tensors_to_file()
        w.close()
    elif fmt == "hdf5":
        import h5py

        with h5py.File(path, "w") as f:
            for k, v in tensors.items():
                f.create_dataset(k, data=v.numpy())
    elif fmt == "onnx":
        import onnx
        from onnx import helper, numpy_helper

        inits = [numpy_helper.from_array(v.numpy(), k) for k, v in tensors.items()]
        graph = helper.make_graph([], "weights", [], [], initializer=inits)
        onnx.save(helper.make_model(graph), str(path))
    elif fmt == "zt":
        import ztensor.numpy as ztnp

        ztnp.save_file({k: v.numpy() for k, v in tensors.items()}, str(path), align=4096)
    else:
        raise ValueError(f"unknown format {fmt!r}")


# -- readers ----------------------------------------------------------------------------------------

Reader = Callable[[Path], tuple[list[Any], Any]]


def _leaves(tree: Any, out: list[Any]) -> list[Any]:
    """The tensors of the nested dicts ``tree``, depth first, appended to ``out``."""
    values = list(tree.values())
    if all(map(isinstance, values, repeat(_tensor_type()))):  # a flat level: no Python step per leaf
        out.extend(values)
        return out
    for v in values:
        if isinstance(v, dict):
            _leaves(v, out)
        elif hasattr(v, "data_ptr"):
            out.append(v)
    return out


def _tensor_type() -> type:
    import torch

    return torch.Tensor


def _tdz_numba(copy: bool) -> Reader:
    def read(path: Path) -> tuple[list[Any], Any]:
        import tdz_numba

        tree = tdz_numba.load(path, copy=copy)
        return _leaves(tree, []), None

    return read


def _ztensor(copy: bool) -> Reader:
    def read(path: Path) -> tuple[list[Any], Any]:
        if copy:
            import ztensor.numpy as ztnp

            return list(ztnp.load_file(str(path), copy=True).values()), None
        import torch
        import ztensor

        src = ztensor.open(str(path))
        return [torch.from_dlpack(t) for t in src.values()], src

    return read


def _safetensors(copy: bool) -> Reader:
    def read(path: Path) -> tuple[list[Any], Any]:
        if copy:
            from safetensors.torch import load

            with open(path, "rb") as f:
                return list(load(f.read()).values()), None
        from safetensors import safe_open

        with safe_open(str(path), framework="pt") as f:
            return [f.get_tensor(k) for k in f.keys()], None

    return read


def _torch(copy: bool) -> Reader:
    def read(path: Path) -> tuple[list[Any], Any]:
        import torch

        return list(torch.load(path, mmap=not copy, weights_only=True).values()), None

    return read


def _npz(copy: bool) -> Reader:  # np.load reads every member into memory: one path for both modes
    def read(path: Path) -> tuple[list[Any], Any]:
        with np.load(path) as z:
            return [z[k] for k in z.files], None

    return read


def _gguf(copy: bool) -> Reader:
    def read(path: Path) -> tuple[list[Any], Any]:
        import gguf

        r = gguf.GGUFReader(str(path))
        if copy:
            return [np.array(t.data) for t in r.tensors], None
        return [t.data for t in r.tensors], r

    return read


def _hdf5(copy: bool) -> Reader:  # h5py reads datasets into memory: one path for both modes
    def read(path: Path) -> tuple[list[Any], Any]:
        import h5py

        with h5py.File(path, "r") as f:
            return [f[k][()] for k in f], None

    return read


def _onnx(copy: bool) -> Reader:  # onnx.load parses the whole file into memory: one path for both modes
    def read(path: Path) -> tuple[list[Any], Any]:
        import onnx
        from onnx import numpy_helper

        model = onnx.load(str(path))
        return [numpy_helper.to_array(t) for t in model.graph.initializer], None

    return read


def _tensordict(copy: bool) -> Reader:
    def read(path: Path) -> tuple[list[Any], Any]:
        from tensordict import TensorDict

        td = TensorDict.load_memmap(path)
        if copy:
            td = td.clone()  # memmap-backed leaves into owned tensors
        return list(td.values(include_nested=True, leaves_only=True)), None

    return read


_OWN = {
    "safetensors": _safetensors,
    "torch": _torch,
    "npz": _npz,
    "gguf": _gguf,
    "hdf5": _hdf5,
    "onnx": _onnx,
    "tdz": _tensordict,
}


def readers_of(fmt: str) -> dict[str, str]:
    """``reader name -> the format of the file it reads`` for the row of ``fmt``.

    Every row has ``tdz_numba``, ``ztensor`` and ``own`` (the format's library; tensordict for ``.tdz``);
    the ``.tdz`` row adds ``safetensors`` (the flat peer, on a .safetensors file of the same tensors) and
    its ``ztensor`` reads ztensor's own ``.zt`` (ztensor does not read .tdz).
    """
    if fmt == "tdz":
        return {"tdz_numba": "tdz", "ztensor": "zt", "own": "tdz", "safetensors": "safetensors"}
    return {"tdz_numba": fmt, "ztensor": fmt, "own": fmt}


def reader(fmt: str, name: str, copy: bool) -> Reader:
    """The reader ``name`` (see :func:`readers_of`) of the row ``fmt``."""
    if name == "tdz_numba":
        return _tdz_numba(copy)
    if name == "ztensor":
        return _ztensor(copy)
    if name == "safetensors":
        return _safetensors(copy)
    if name == "own":
        return _OWN[fmt](copy)
    raise ValueError(f"unknown reader {name!r}")


# -- the harness's touch ----------------------------------------------------------------------------


def addresses(tensors: list[Any]) -> tuple[np.ndarray, np.ndarray]:
    """Start addresses and byte sizes of ``tensors`` (torch tensors or numpy arrays, contiguous)."""
    addr = np.empty(len(tensors), np.int64)
    size = np.empty(len(tensors), np.int64)
    for i, t in enumerate(tensors):
        if hasattr(t, "data_ptr"):
            addr[i] = t.data_ptr()
            size[i] = t.nbytes
        else:
            if not t.flags.c_contiguous:
                raise ValueError("a reader returned a non-contiguous array")
            addr[i] = t.ctypes.data
            size[i] = t.nbytes
    return addr, size


@njit(cache=True, nogil=True)
def _touch_all(addr, size, page):  # pragma: no cover - compiled by Numba
    acc = 0
    for i in range(addr.size):
        n = size[i]
        if n <= 0:
            continue
        buf = carray(u8_pointer(addr[i]), n)
        for j in range(0, n, page):
            acc += buf[j]
    return acc


def touch(tensors: list[Any], page: int = PAGE) -> int:
    """Reads one byte of every ``page`` of every tensor (serially, in the given order); returns the
    sum of the bytes read (a checksum of what was touched: the same for every reader of the same
    tensors, whatever their order)."""
    addr, size = addresses(tensors)
    return int(_touch_all(addr, size, page))


def expected_touch(tensors: dict[str, Any], page: int = PAGE) -> tuple[int, int, int]:
    """``(count, nbytes, touch sum)`` of the written tensors: what every reader must reproduce."""
    ts = list(tensors.values())
    return len(ts), int(sum(t.nbytes for t in ts)), touch(ts, page)
