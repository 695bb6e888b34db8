"""The real-file campaign (issue 23): every file of a corpus read by our reader and by the
format's own library, bit for bit, then converted to .tdz and read back by tensordict 0.15.3.

The corpus: test data that installed packages ship (onnx's ``.pb``/``.onnx``, numpy's
``.npy``/``.npz``, h5py's ``.h5``), the fixtures kept in ``tests/fixtures/`` (HDF5 files
of jhdf and h5py, ``.pt`` files an older torch wrote, tensordict's archives) and files
written here by the owning libraries in unusual but legal configurations (the generators
of the tests: every dtype, views, conjugate/negative bits, pickle protocols, legacy .pt,
every GGUF quant type and alignment, Python 2 era ``.npy`` headers, HDF5 filters...).

Each file ends in one outcome:

* ``agree``: every tensor equal to the owner's (dtype, shape, bytes, NaN payloads), and
  the .tdz conversion read back equal by us and by tensordict (where tensordict has the dtype);
* ``both refuse``: the owner cannot read it either;
* ``limit``: we refuse with a :class:`~tdz_numba.TdzError` what the owner reads, and the
  reason is a limit the docs list (docs/formats.md#what-each-reader-refuses);
* ``refused``: we refuse what the owner reads, for a reason the docs do not list (a bug);
* ``disagree``: values, dtypes or shapes differ (a bug);
* ``stray``: an exception that is not a ``TdzError`` (a bug).

Usage: ``python scripts/campaign_real.py [--json OUT] [-v]`` (about a minute); exits 1 when
a file ends ``refused``, ``disagree`` or ``stray``.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import traceback
import warnings
from collections import Counter
from collections.abc import Callable, Iterator
from pathlib import Path

import numpy as np
import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))

import tdz_numba  # noqa: E402
from tdz_numba.conversion import TENSORDICT_DTYPES  # noqa: E402
from tdz_numba.errors import TdzError  # noqa: E402

#: Words of a refusal that name a documented limit (docs/formats.md, "What each reader refuses").
LIMITS = (
    "quantized",
    "sparse",
    "set of tensors",
    "dict key of type",
    "surrogate",
    "both read as",
    "bits8",
    "structured",
    "object",
    "SequenceProto",
    "MapProto",
    "OptionalProto",
    "big-endian GGUF",
    "external",
    "virtual",
    "compound",
    "opaque",
    "reference",
    "vlen",
    "variable-length",
    "filter",
    "szip",
    "scale-offset",
    "nbit",
    "TorchScript",
    "not a tensor file",
    "string",
    "collides with the meta.json field",
    "cannot store a value",
)
BAD = ("refused", "disagree", "stray")


def _bits(t) -> tuple:
    """dtype, shape and raw bytes of a tensor or array (resolved, C order)."""
    if isinstance(t, torch.Tensor):
        t = t.resolve_conj().resolve_neg().contiguous()
        raw = t.reshape(-1).view(torch.uint8).numpy().tobytes() if t.numel() else b""
        return str(t.dtype).removeprefix("torch."), tuple(t.shape), raw
    a = np.asarray(t)
    if a.dtype.kind in "biufc" and not a.dtype.isnative:
        a = a.astype(a.dtype.newbyteorder("="))
    return (
        str(torch.from_numpy(np.zeros(0, a.dtype)).dtype).removeprefix("torch."),
        a.shape,
        np.ascontiguousarray(a).tobytes(),
    )


def _flat(tree, prefix: str = "") -> dict:
    out = {}
    for k, v in tree.items() if hasattr(tree, "items") else []:
        key = f"{prefix}{k}"
        if isinstance(v, torch.Tensor):
            out[key] = v
        elif hasattr(v, "items"):
            out.update(_flat(v, key + "/"))
    return out


def _same(want: dict, got: dict, where: str) -> None:
    assert sorted(want) == sorted(got), f"{where}: keys {sorted(set(want) ^ set(got))[:5]}"
    for k, w in want.items():
        if not isinstance(w, (np.ndarray, torch.Tensor)):  # a plain value (tensordict's non-tensor data)
            assert w == got[k], f"{where}: {k}: {w!r} != {got[k]!r}"
            continue
        if isinstance(w, np.ndarray) and w.dtype.kind in "OUS":  # strings: a plain value of ours
            plain = [x.decode() if isinstance(x, bytes) else x for x in w.reshape(-1).tolist()]
            assert list(np.asarray(got[k], dtype=object).reshape(-1)) == plain, (
                f"{where}: {k}: strings differ"
            )
            continue
        a, b = _bits(w), _bits(got[k])
        assert a[:2] == b[:2], f"{where}: {k}: {a[:2]} != {b[:2]}"
        assert a[2] == b[2], f"{where}: {k}: bytes differ"


def _round_trip(path: Path, tmp: Path, ours: dict) -> None:
    """convert -> .tdz read back by us, and by tensordict where it has every dtype."""
    dst = tmp / (path.name + ".tdz")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        tdz_numba.convert(path, dst)
    back = _flat(tdz_numba.load(dst, nest="/"))
    _same(
        {k.replace(".", "/"): v for k, v in ours.items()},
        {k.replace(".", "/"): v for k, v in back.items()},
        f"{dst}",
    )
    if any(str(v.dtype) not in TENSORDICT_DTYPES for v in back.values()):
        return  # tensordict 0.15.3 has no such dtype (convert warns)
    from tensordict import TensorDict

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        td = TensorDict.load_memmap(dst)
    got = {}
    for k in td.keys(include_nested=True, leaves_only=True):
        v = td.get(k)
        if isinstance(v, torch.Tensor):
            got["/".join(k) if isinstance(k, tuple) else k] = v
    _same(
        {k.replace(".", "/"): v for k, v in back.items()},
        {k.replace(".", "/"): v for k, v in got.items()},
        f"{dst} (tensordict)",
    )


def _ours(path: Path) -> dict:
    """Our leaves by key, plain values (strings) included."""
    with tdz_numba.open(path) as ar:
        out: dict = {k: t.clone() for k, t in ar.iter_leaves()}
        stack = [("", ar.to_dict())]
        while stack:
            prefix, d = stack.pop()
            for k, v in d.items():
                if hasattr(v, "items"):
                    stack.append((f"{prefix}{k}/", v))
                elif not isinstance(v, torch.Tensor):
                    out[f"{prefix}{k}"] = v
        return out


# -- the corpus: (format, label, path, the owner's flat {key: array}) --------------------------
Case = tuple[str, str, Path, Callable[[], dict]]


def _onnx_cases() -> Iterator[Case]:
    try:
        import onnx
        from onnx import numpy_helper
    except ImportError:
        return
    root = Path(onnx.__file__).parent
    for p in sorted(root.rglob("*")):
        if p.suffix == ".pb" and p.is_file():

            def owner(p=p):
                t = onnx.TensorProto()
                t.ParseFromString(p.read_bytes())
                return {t.name or "tensor": numpy_helper.to_array(t)}

            yield "onnx", f"onnx:{p.relative_to(root)}", p, owner
        elif p.suffix == ".onnx" and p.is_file():

            def owner(p=p):
                m = onnx.load(p, load_external_data=False)
                return {i.name: numpy_helper.to_array(i) for i in m.graph.initializer}

            yield "onnx", f"onnx:{p.relative_to(root)}", p, owner


def _numpy_cases(tmp: Path) -> Iterator[Case]:
    root = Path(np.__file__).parent / "lib" / "tests" / "data"
    files = sorted(root.glob("*.np[yz]"))

    def write(name: str, fn) -> Path:
        p = tmp / name
        fn(p)
        return p

    rng = np.random.default_rng(0)
    arrays = {
        "f8": rng.standard_normal((3, 4)),
        ">f4": rng.standard_normal(5).astype(">f4"),
        "fortran": np.asfortranarray(rng.standard_normal((3, 5))),
        "zero_dim": np.array(7, "<i2"),
        "empty": np.zeros((0, 3), np.float32),
        "bool": rng.integers(0, 2, 6).astype(bool),
        "c16": (rng.standard_normal(4) + 1j).astype(np.complex128),
        ">c8": np.array([1 - 2j], ">c8"),
        "u8": np.arange(9, dtype=np.uint64),
        "f2": rng.standard_normal(7).astype(np.float16),
    }
    for name, a in arrays.items():
        files.append(write(f"{name}.npy", lambda p, a=a: np.save(p, a)))
    files.append(write("savez.npz", lambda p: np.savez(p, **arrays)))
    files.append(write("savez_c.npz", lambda p: np.savez_compressed(p, **arrays)))
    for i, header in enumerate(
        [
            "{'descr': '<i8', 'fortran_order': False, 'shape': (2L,), }",
            "{'descr': '<f4', 'fortran_order': False, 'shape': (1L, 2L), }",
        ]
    ):
        data = np.arange(2, dtype="<i8").tobytes() if "i8" in header else np.ones(2, "<f4").tobytes()
        h = header.encode("latin1")
        h += b" " * (-(10 + len(h) + 1) % 64) + b"\n"
        files.append(
            write(
                f"py2_{i}.npy",
                lambda p, h=h, d=data: p.write_bytes(
                    b"\x93NUMPY\x01\x00" + len(h).to_bytes(2, "little") + h + d
                ),
            )
        )
    for p in files:

        def owner(p=p):
            if p.suffix == ".npy":
                return {"0": np.load(p, allow_pickle=False)}
            with np.load(p, allow_pickle=False) as z:
                return {k: z[k] for k in z.files}

        yield "numpy", f"numpy:{p.name}", p, owner


def _hdf5_cases(tmp: Path) -> Iterator[Case]:
    try:
        import h5py
    except ImportError:
        return
    files = sorted((ROOT / "tests" / "fixtures" / "hdf5_real").glob("*.h*5"))
    files += sorted((Path(h5py.__file__).parent / "tests" / "data_files").glob("*.h5"))
    p = tmp / "filters.h5"
    with h5py.File(p, "w", libver="earliest") as f:
        x = np.arange(4000, dtype="<f4").reshape(40, 100)
        f.create_dataset("gzip", data=x, chunks=(10, 100), compression="gzip", shuffle=True)
        f.create_dataset("lzf", data=x, chunks=(8, 50), compression="lzf")
        f.create_dataset("fletcher", data=x, chunks=(40, 10), fletcher32=True)
        f.create_dataset("be", data=x.astype(">i4"))
        f.create_dataset("scalar", data=np.float64(2.5))
        f.create_dataset("empty", shape=(0, 4), dtype="f8")
        f.create_dataset("fill", shape=(3, 3), dtype="i2", fillvalue=-5)
        g = f.create_group("g/h")
        g.create_dataset("bool", data=np.array([True, False]))
    files.append(p)
    for p in files:
        yield "hdf5", f"hdf5:{p.name}", p, None  # compared by tests/hdf5_oracle.py


def _pt_cases(tmp: Path) -> Iterator[Case]:
    import test_pt_realfiles as ptr

    for name, (make, kwargs, _convert) in ptr.GENERATED.items():
        p = tmp / f"{name}.pt"
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            torch.save(make(), p, **kwargs)
        yield "torch", f"torch:{name}", p, None
    for p in sorted(ptr.FIXTURES.glob("*.bin")):
        yield "torch", f"torch:fixture/{p.name}", p, None
    for name, (make, _reason) in ptr.REFUSED.items():
        p = tmp / f"refused_{name}.pt"
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            torch.save(make(), p)
        yield "torch", f"torch:{name}", p, None


def _gguf_cases(tmp: Path) -> Iterator[Case]:
    try:
        import gguf
        import test_readers_realfiles as rr
    except ImportError:
        return
    p = tmp / "every_type.gguf"
    rr._write_every_type(p)
    paths = [p]
    for align in (1, 8, 256):
        q = tmp / f"align{align}.gguf"
        w = gguf.GGUFWriter(str(q), "test")
        w.add_custom_alignment(align)
        for i in range(3):
            w.add_tensor(f"t{i}", np.arange(5 + i, dtype=np.float32))
        w.write_header_to_file()
        w.write_kv_data_to_file()
        w.write_tensors_to_file()
        w.close()
        paths.append(q)
    for p in paths:

        def owner(p=p):
            r = gguf.GGUFReader(str(p))
            return {t.name: np.asarray(t.data) for t in r.tensors}

        yield "gguf", f"gguf:{p.name}", p, owner


def _safetensors_cases(tmp: Path) -> Iterator[Case]:
    from safetensors.torch import load_file, save_file

    dtypes = [
        d
        for d in (
            torch.float64,
            torch.float32,
            torch.float16,
            torch.bfloat16,
            torch.int64,
            torch.int32,
            torch.int16,
            torch.int8,
            torch.uint8,
            torch.bool,
            torch.float8_e4m3fn,
            torch.float8_e5m2,
            torch.uint16,
            torch.uint32,
            torch.uint64,
            torch.complex64,
        )
    ]
    g = torch.Generator().manual_seed(0)
    tree = {str(d).removeprefix("torch."): torch.randint(0, 100, (3, 5), generator=g).to(d) for d in dtypes}
    tree["zero_dim"], tree["empty"] = torch.tensor(3.5), torch.zeros(0, 7)
    p = tmp / "every.safetensors"
    try:
        save_file(tree, str(p), metadata={"format": "pt"})
    except Exception:  # noqa: BLE001 - an older safetensors without some dtypes
        tree = {k: v for k, v in tree.items() if v.dtype in (torch.float32, torch.int64, torch.bfloat16)}
        save_file(tree, str(p), metadata={"format": "pt"})
    yield "safetensors", "safetensors:every_dtype", p, lambda: load_file(str(p))


def _tensordict_cases(tmp: Path) -> Iterator[Case]:
    try:
        from tensordict import TensorDict
    except ImportError:
        return
    root = ROOT / "tests" / "fixtures"
    for p in sorted(root.glob("td_*.tdz")):
        yield "tdz", f"tdz:{p.name}", p, None
    d = tmp / "td_dir"
    td = TensorDict(
        {"a": torch.arange(6.0).reshape(2, 3), "n": {"b": torch.ones(2, 4, dtype=torch.int16)}},
        batch_size=[2],
    )
    td.memmap(d)
    yield "memmap_dir", "memmap_dir:tensordict", d, None


def _td_owner(path: Path) -> dict:
    from tensordict import TensorDict

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        td = TensorDict.load_memmap(path)
    out = {}
    for k in td.keys(include_nested=True, leaves_only=True, is_leaf=lambda c: not issubclass(c, TensorDict)):
        v = td.get(k)
        v = v.data if hasattr(v, "data") and not isinstance(v, torch.Tensor) else v  # NonTensorData
        out["/".join(k) if isinstance(k, tuple) else k] = v.clone() if isinstance(v, torch.Tensor) else v
    return out


# -- one file ----------------------------------------------------------------------------------
def _limit(msg: str) -> bool:
    return any(w.lower() in msg.lower() for w in LIMITS)


def run_case(fmt: str, path: Path, owner: Callable[[], dict] | None, tmp: Path) -> tuple[str, str]:
    if fmt == "hdf5":
        import hdf5_oracle

        try:
            rep = hdf5_oracle.compare(path)
        except TdzError as e:
            return ("limit" if _limit(str(e)) else "refused"), str(e)[:200]
        if rep.mismatches or rep.missing:
            return "disagree", "; ".join(rep.mismatches + rep.missing)[:200]
        return ("limit" if rep.refused else "agree"), ", ".join(rep.refused)[:200]
    if fmt == "torch":
        import shutil

        import test_pt_realfiles as ptr

        path = Path(shutil.copy(path, tmp / path.name))  # check_file wants its folder to itself

        name = path.stem.removeprefix("refused_")
        convert = ptr.GENERATED.get(name, (None, {}, "both"))[2]
        trusted = ptr.GENERATED.get(name, (None, {}, "both"))[1].get("pickle_protocol", 2) > 3
        try:
            ptr.check_file(path, tmp, convert, trusted=trusted)
        except TdzError as e:
            return ("limit" if _limit(str(e)) else "refused"), str(e)[:200]
        except BaseException as e:  # noqa: BLE001 - pytest.raises of the refused branch, AssertionError
            if path.stem.startswith("refused_") and "TdzError" not in repr(e):
                return "limit", str(e)[:200]
            return "disagree", f"{type(e).__name__}: {e}"[:200]
        return "agree", ""
    try:
        want = owner() if owner is not None else _td_owner(path)
    except Exception as e:  # noqa: BLE001 - the owner refuses
        try:
            _ours(path)
        except TdzError:
            return "both refuse", f"{type(e).__name__}: {e}"[:200]
        return "agree", f"the owner refuses ({type(e).__name__}); we read it"
    try:
        got = _ours(path)
    except TdzError as e:
        return ("limit" if _limit(str(e)) else "refused"), str(e)[:200]
    want = {
        k: (v if isinstance(v, torch.Tensor) or owner is None else np.asarray(v)) for k, v in want.items()
    }
    try:
        if fmt == "gguf":  # our keys are the tensor names; quantized leaves are raw bytes
            for k, v in want.items():
                assert (
                    _bits(got[k].contiguous().view(-1).view(torch.uint8))[2]
                    == np.ascontiguousarray(v).tobytes()
                ), k
        else:
            _same({k: v for k, v in want.items()}, {k: v for k, v in got.items()}, str(path))
        tensors = {k: v for k, v in got.items() if isinstance(v, torch.Tensor)}
        if tensors:
            _round_trip(path, tmp, tensors)
    except AssertionError as e:
        return "disagree", str(e)[:200]
    except TdzError as e:
        return ("limit" if _limit(str(e)) else "refused"), f"convert: {e}"[:200]
    return "agree", ""


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--json", type=Path, help="write every file's outcome here")
    ap.add_argument("-v", "--verbose", action="store_true", help="print every file that is not 'agree'")
    args = ap.parse_args(argv)
    rows = []
    with tempfile.TemporaryDirectory() as d:
        tmp = Path(d)
        gens = [
            _onnx_cases(),
            _numpy_cases(tmp),
            _hdf5_cases(tmp),
            _pt_cases(tmp),
            _gguf_cases(tmp),
            _safetensors_cases(tmp),
            _tensordict_cases(tmp),
        ]
        for gen in gens:
            for fmt, label, path, owner in gen:
                work = tmp / "w"
                work.mkdir(exist_ok=True)
                for f in work.iterdir():
                    f.unlink()
                try:
                    outcome, why = run_case(fmt, path, owner, work)
                except BaseException as e:  # noqa: BLE001 - counted, never raised
                    outcome, why = "stray", "".join(traceback.format_exception_only(e)).strip()[:200]
                rows.append({"format": fmt, "file": label, "outcome": outcome, "why": why})
                if args.verbose and outcome != "agree":
                    print(f"{outcome:11} {label}: {why}")
    by = Counter((r["format"], r["outcome"]) for r in rows)
    outcomes = ["agree", "both refuse", "limit", *BAD]
    print(f"{'format':12}" + "".join(f"{o:>12}" for o in outcomes) + f"{'files':>8}")
    for fmt in sorted({r["format"] for r in rows}):
        cells = [by[(fmt, o)] for o in outcomes]
        print(f"{fmt:12}" + "".join(f"{c:>12}" for c in cells) + f"{sum(cells):>8}")
    total = Counter(r["outcome"] for r in rows)
    print(f"{'all':12}" + "".join(f"{total[o]:>12}" for o in outcomes) + f"{len(rows):>8}")
    if args.json:
        args.json.write_text(json.dumps(rows, indent=1))
    return 1 if any(total[o] for o in BAD) else 0


if __name__ == "__main__":
    sys.exit(main())
