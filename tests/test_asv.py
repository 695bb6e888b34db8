"""The asv suite is discoverable and its README command runs without a prompt."""

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
ASV_DIR = ROOT / "asv_bench"


def _asv() -> str | None:
    exe = Path(sys.executable).parent / "asv"
    return str(exe) if exe.is_file() else shutil.which("asv")


@pytest.fixture
def asv_env(tmp_path):
    asv = _asv()
    if asv is None:
        pytest.skip("asv is not installed")
    env = {**os.environ, "HOME": str(tmp_path)}  # a machine without ~/.asv-machine.json
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")]))
    return asv, env


def test_asv_machine_yes_then_check_needs_no_prompt(asv_env):
    asv, env = asv_env
    proc = subprocess.run(
        [asv, "machine", "--yes"],
        cwd=ASV_DIR,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
        stdin=subprocess.DEVNULL,
    )
    assert proc.returncode == 0, proc.stderr
    proc = subprocess.run(
        [asv, "check", "--python=same"],
        cwd=ASV_DIR,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
        stdin=subprocess.DEVNULL,
    )
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    assert "No problems found" in proc.stdout


def test_asv_suites_import_only_public_names():
    import ast

    import tdz_numba.bench as bench

    for path in (ASV_DIR / "benchmarks").glob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("tdz_numba"):
                for alias in node.names:
                    assert not alias.name.startswith("_"), f"{path.name} imports private {alias.name}"
                    if node.module == "tdz_numba.bench":
                        assert alias.name in bench.__all__, f"{path.name}: {alias.name} not public"


def test_peak_rss_growth_tells_operations_apart():
    """The asv memory metric measures the operation, not the process: allocating
    64 MiB in the child shows up as ~64 MiB, doing nothing as ~0."""
    sys.path.insert(0, str(ASV_DIR / "benchmarks"))
    try:
        import peak
    finally:
        sys.path.pop(0)
    if not os.path.exists("/proc/self/clear_refs"):
        pytest.skip("needs Linux")
    grow = peak.measure_here(lambda: bytearray(64 << 20))
    idle = peak.measure_here(lambda: None)
    assert 60 << 20 <= grow <= 80 << 20
    assert idle < 8 << 20


def test_project_url_is_a_page_that_exists():
    """The published pages' project link (asv's ``project_url``, relative to ``html_dir``)
    opens the README: the package has no public home page yet, and a link to a page that
    does not exist (the PyPI page before publication) is worse than a local one."""
    import json

    conf = json.loads((ASV_DIR / "asv.conf.json").read_text())
    url = conf["project_url"]
    assert "://" not in url, url
    target = (ASV_DIR / conf["html_dir"] / url).resolve()
    assert target == ROOT / "README.md"
    assert target.read_text().startswith("# tdz_numba")
