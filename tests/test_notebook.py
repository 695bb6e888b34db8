"""notebooks/explore_archive.ipynb runs top to bottom without an error (nbclient, kernel "python3")."""

import json
import os
import sys
from pathlib import Path

import pytest

nbformat = pytest.importorskip("nbformat")
nbclient = pytest.importorskip("nbclient")
pytest.importorskip("ipykernel")
pytest.importorskip("matplotlib")

NOTEBOOK = Path(__file__).resolve().parent.parent / "notebooks" / "explore_archive.ipynb"
KERNEL = "python3"
_PLAIN_PYTHON = {"python", f"python{sys.version_info[0]}", "python{}.{}".format(*sys.version_info[:2])}


def _runs_this_interpreter(argv0: str) -> bool:
    # jupyter_client replaces a bare "python"/"python3"/"python3.X" with sys.executable
    if argv0 in _PLAIN_PYTHON:
        return True
    try:
        return Path(argv0).resolve() == Path(sys.executable).resolve() or Path(argv0).samefile(sys.executable)
    except OSError:
        return False


@pytest.fixture
def python3_kernel(tmp_path, monkeypatch):
    """Makes the "python3" kernel run this interpreter (the one with tdz_numba installed).

    A fresh venv with ipykernel has the spec in sys.prefix/share/jupyter/kernels/python3
    (argv "python", which jupyter_client maps to sys.executable); jupyter_client also
    provides ipykernel's native spec when none is installed. When the spec found is
    missing or points at another interpreter (a system-wide kernel), a private one is
    written under tmp_path and put first on JUPYTER_PATH; nothing outside tmp_path changes.
    """
    from jupyter_client.kernelspec import KernelSpecManager, NoSuchKernel

    try:
        spec = KernelSpecManager().get_kernel_spec(KERNEL)
        ok = bool(spec.argv) and _runs_this_interpreter(spec.argv[0])
    except NoSuchKernel:
        ok = False
    if not ok:
        kdir = tmp_path / "jupyter" / "kernels" / KERNEL
        kdir.mkdir(parents=True)
        kdir.joinpath("kernel.json").write_text(
            json.dumps(
                {
                    "argv": [sys.executable, "-m", "ipykernel_launcher", "-f", "{connection_file}"],
                    "display_name": "Python 3 (tdz_numba tests)",
                    "language": "python",
                }
            )
        )
        path = os.pathsep.join(p for p in (str(tmp_path / "jupyter"), os.environ.get("JUPYTER_PATH")) if p)
        monkeypatch.setenv("JUPYTER_PATH", path)
        spec = KernelSpecManager().get_kernel_spec(KERNEL)
        assert spec.argv[0] == sys.executable
    return KERNEL


def test_explore_archive_notebook(python3_kernel, tmp_path):
    nb = nbformat.read(NOTEBOOK, as_version=4)
    assert nb.metadata["kernelspec"]["name"] == "python3"
    client = nbclient.NotebookClient(
        nb,
        timeout=300,
        kernel_name=python3_kernel,
        allow_errors=True,
        resources={"metadata": {"path": str(tmp_path)}},
    )
    client.execute()
    errors = [
        f"cell {i}: {out.get('ename')}: {out.get('evalue')}\n" + "\n".join(out.get("traceback", []))[-3000:]
        for i, cell in enumerate(nb.cells)
        if cell.cell_type == "code"
        for out in cell.get("outputs", [])
        if out.output_type == "error"
    ]
    assert not errors, "\n\n".join(errors)
    outputs = [out for cell in nb.cells if cell.cell_type == "code" for out in cell.get("outputs", [])]
    html = [out["data"]["text/html"] for out in outputs if "text/html" in out.get("data", {})]
    assert any('class="tdz-archive"' in h and "group_000" in h and "<details" in h for h in html)
    pngs = [out for out in outputs if "image/png" in out.get("data", {})]
    assert len(pngs) >= 2  # the leaf's figure and the timing bars
    text = "".join(out.get("text", "") for out in outputs if out.output_type == "stream")
    assert "shared storage: True" in text and "64-byte aligned: True" in text
    assert "tdz_numba" in text and "torch.save" in text and "OK (tdz):" in text
    # compression, other formats and memory control sections
    assert "frames deflate" in text and "zero_copy=False" in text
    ratios = {
        line.split()[0]: float(line.split("(")[1].split("x)")[0])
        for line in text.splitlines()
        if line.startswith(("frames ", "noise ")) and "x), zero_copy=" in line
    }
    assert ratios["frames"] > 3 and ratios["noise"] < 1.5  # the markdown's claim, as printed
    assert "torch ['model.head.weight'" in text and "model.tdz ['head', 'layers']" in text
    assert "'layer_1': 0.0" in text and "evictable: True" in text and "streamed sum" in text
    assert not any(out.get("name") == "stderr" and "Traceback" in out.get("text", "") for out in outputs)
