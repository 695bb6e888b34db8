"""Packaging metadata agrees across pyproject.toml, environment.yml and recipe/meta.yaml,
and the ``tdz`` entry points run."""

import os
import re
import shutil
import subprocess
import sys
import sysconfig
from pathlib import Path

import pytest

try:
    import tomllib
except ImportError:  # Python 3.10
    tomllib = pytest.importorskip("tomli")

ROOT = Path(__file__).resolve().parent.parent

# PyPI name -> conda-forge name, where they differ
CONDA_NAME = {
    "torch": "pytorch",
    "zlib-ng": "python-zlib-ng",
    "build": "python-build",
    "xxhash": "python-xxhash",
}


# -- tiny parsers ------------------------------------------------------------------------------


def _norm(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def _split_req(req: str) -> tuple[str, str]:
    """``"numpy >=1.24,<2.5"`` / ``"numpy>=1.24, <2.5"`` -> ``("numpy", ">=1.24,<2.5")``
    (extras and markers dropped, the specifiers sorted, spaces removed)."""
    req = req.split(";", 1)[0].strip()
    m = re.match(r"^([A-Za-z0-9][A-Za-z0-9._-]*)\s*(\[[^\]]*\])?\s*(.*)$", req)
    assert m, f"cannot parse requirement {req!r}"
    spec = ",".join(sorted(s.strip().replace(" ", "") for s in m.group(3).split(",") if s.strip()))
    return _norm(m.group(1)), spec


def _strip_comment(line: str) -> str:
    return re.sub(r"(^|\s)#.*$", "", line).rstrip()


def yaml_list(text: str, *keys: str) -> list[str]:
    """The items of the block list at ``keys`` (e.g. ``("requirements", "run")``) in a
    simple YAML file: enough for environment.yml and a conda recipe (Jinja lines are
    ignored). Items that are mappings (``- pip:``) are skipped."""
    lines = [_strip_comment(line) for line in text.splitlines()]
    indent, i = -1, 0
    for key in keys:
        for j in range(i, len(lines)):
            line = lines[j]
            if not line.strip() or line.lstrip().startswith("{%"):
                continue
            ind = len(line) - len(line.lstrip())
            if ind <= indent and not (ind == indent and line.lstrip().startswith("- ")):
                raise KeyError(f"{key!r} not found under {keys[: keys.index(key)]}")
            if line.strip() in (f"{key}:", f"- {key}:"):
                indent = ind + (2 if line.strip().startswith("- ") else 0)
                i = j + 1
                break
        else:
            raise KeyError(f"{key!r} not found")
    items: list[str] = []
    item_indent = None
    for line in lines[i:]:
        if not line.strip():
            continue
        ind = len(line) - len(line.lstrip())
        s = line.strip()
        if ind < indent or (ind == indent and not s.startswith("- ")):
            break
        if not s.startswith("- "):
            continue
        if item_indent is None:
            item_indent = ind
        if ind == item_indent and not s.endswith(":"):
            items.append(s[2:].strip())
    return items


@pytest.fixture(scope="module")
def pyproject():
    return tomllib.loads((ROOT / "pyproject.toml").read_text())


@pytest.fixture(scope="module")
def env_text():
    return (ROOT / "environment.yml").read_text()


def render_recipe(text: str, **variables: str) -> str:
    """The recipe as conda-build renders it (Jinja2), with conda-build's ``PYTHON`` variable."""
    jinja2 = pytest.importorskip("jinja2")
    env = jinja2.Environment(undefined=jinja2.StrictUndefined)
    return env.from_string(text).render(PYTHON="python", **variables)


@pytest.fixture(scope="module")
def recipe_raw():
    return (ROOT / "recipe" / "meta.yaml").read_text()


@pytest.fixture(scope="module")
def recipe_text(recipe_raw):
    return render_recipe(recipe_raw)


def _runtime(pyproject) -> dict[str, str]:
    """pyproject's runtime dependencies under their conda names: name -> specifier."""
    out = {}
    for req in pyproject["project"]["dependencies"]:
        name, spec = _split_req(req)
        out[CONDA_NAME.get(name, name)] = spec
    return out


# -- the parser itself ---------------------------------------------------------------------------


def test_yaml_list_parser():
    text = """
{% set v = "1" %}
requirements:
  host:
    - pip
  run:
    - numpy >=1.24   # comment
    - pytorch
  run_constrained:
    - tensordict ==0.15.3
deps:
- a
- pip:
    - b
- c
"""
    assert yaml_list(text, "requirements", "run") == ["numpy >=1.24", "pytorch"]
    assert yaml_list(text, "requirements", "host") == ["pip"]
    assert yaml_list(text, "deps") == ["a", "c"]
    assert yaml_list(text, "deps", "pip") == ["b"]
    with pytest.raises(KeyError):
        yaml_list(text, "requirements", "test")
    assert _split_req("numpy>=1.24, <2.5") == ("numpy", "<2.5,>=1.24")
    assert _split_req("zlib_ng[x] >=0.5 ; python_version>'3'") == ("zlib-ng", ">=0.5")


# -- agreement ------------------------------------------------------------------------------------


def test_runtime_dependencies_agree(pyproject, env_text, recipe_text):
    runtime = _runtime(pyproject)
    assert set(runtime) == {"numba", "numpy", "pytorch", "python-zlib-ng"}

    recipe = dict(_split_req(r) for r in yaml_list(recipe_text, "requirements", "run"))
    python_spec = recipe.pop("python")
    assert recipe == runtime, "recipe/meta.yaml run requirements differ from pyproject.toml dependencies"
    assert python_spec == pyproject["project"]["requires-python"].replace(" ", "")

    env = dict(_split_req(r) for r in yaml_list(env_text, "dependencies"))
    env_runtime = {k: v for k, v in env.items() if k in runtime}
    # the dev environment may only tighten pytorch, to what tensordict 0.15.3 (a dev dependency) needs
    assert env_runtime.pop("pytorch") == ">=2.11"
    assert env_runtime == {k: v for k, v in runtime.items() if k != "pytorch"}, (
        "environment.yml runtime packages differ from pyproject.toml dependencies"
    )
    # the environment's pinned python satisfies requires-python
    m = re.fullmatch(r"=+(\d+)\.(\d+).*", env["python"])
    assert m, env["python"]
    low = re.fullmatch(r">=(\d+)\.(\d+)", pyproject["project"]["requires-python"].replace(" ", ""))
    assert (int(m[1]), int(m[2])) >= (int(low[1]), int(low[2]))


def test_environment_has_the_dev_tools(pyproject, env_text):
    conda = {_split_req(r)[0] for r in yaml_list(env_text, "dependencies")}
    pip = {_split_req(r)[0] for r in yaml_list(env_text, "dependencies", "pip") if not r.startswith("-")}
    dev = {
        CONDA_NAME.get(n, n) for n, _ in map(_split_req, pyproject["project"]["optional-dependencies"]["dev"])
    }
    missing = dev - conda - pip
    assert not missing, f"dev extras missing from environment.yml: {sorted(missing)}"
    runtime = set(_runtime(pyproject))
    extras = {
        CONDA_NAME.get(n, n)
        for reqs in pyproject["project"]["optional-dependencies"].values()
        for n, _ in map(_split_req, reqs)
    }
    system_tools = {"zip", "unzip"}  # Debian/conda binaries the interop tests call
    unknown = conda - dev - extras - runtime - system_tools - {"python", "pip"}
    assert not unknown, f"environment.yml installs packages pyproject.toml does not name: {sorted(unknown)}"


def test_requirements_dev_names_the_runtime(pyproject):
    lines = (ROOT / "requirements-dev.txt").read_text().splitlines()
    names = {_split_req(s)[0] for s in map(_strip_comment, lines) if s.strip() and not s.startswith("-")}
    assert {n for n, _ in map(_split_req, pyproject["project"]["dependencies"])} <= names


def test_recipe_metadata(pyproject, recipe_raw, recipe_text):
    m = re.search(r'{%\s*set\s+version\s*=\s*"([^"]+)"\s*%}', recipe_raw)
    assert m and m[1] == pyproject["project"]["version"]
    assert re.search(r"^\s+noarch:\s*python\s*$", recipe_text, re.M)
    assert re.search(
        r"^\s+script:\s*python -m pip install \. --no-deps --no-build-isolation -vv\s*$", recipe_text, re.M
    )
    # conda-forge's noarch conventions: python_min in host and test, >=python_min at run time, pip check
    python_min = pyproject["project"]["requires-python"].removeprefix(">=")
    assert f"python {python_min}" in yaml_list(recipe_text, "requirements", "host")
    assert f"python {python_min}" in yaml_list(recipe_text, "test", "requires")
    assert "pip check" in yaml_list(recipe_text, "test", "commands")
    # conda-forge overrides python_min at build time; the recipe follows it
    assert "python >=3.12" in yaml_list(render_recipe(recipe_raw, python_min="3.12"), "requirements", "run")
    host = dict(_split_req(r) for r in yaml_list(recipe_text, "requirements", "host"))
    build_requires = dict(map(_split_req, pyproject["build-system"]["requires"]))
    assert host["setuptools"] == build_requires["setuptools"] == ">=77"  # SPDX `license = "MIT"` needs 77
    about = re.search(r"^about:\n((?:[ ].*\n|\n)+)", recipe_text, re.M)[1]
    assert re.search(rf"^\s+home:\s*{re.escape(pyproject['project']['urls']['Homepage'])}\s*$", about, re.M)
    assert re.search(rf"^\s+license:\s*{pyproject['project']['license']}\s*$", about, re.M)
    license_file = re.search(r"^\s+license_file:\s*(\S+)\s*$", about, re.M)[1]
    assert (ROOT / license_file).is_file() and license_file in pyproject["project"]["license-files"]
    assert "MIT License" in (ROOT / license_file).read_text()
    scripts = pyproject["project"]["scripts"]
    assert scripts == {"tdz": "tdz_numba.cli:main"}
    entry_points = [e.replace(" ", "") for e in yaml_list(recipe_text, "build", "entry_points")]
    assert entry_points == [f"{k}={v}" for k, v in scripts.items()]
    assert "tdz_numba" in yaml_list(recipe_text, "test", "imports")
    assert "tdz --help" in yaml_list(recipe_text, "test", "commands")


def test_changelog_has_this_version(pyproject):
    text = (ROOT / "CHANGELOG.md").read_text()
    assert re.search(rf"^## \[{re.escape(pyproject['project']['version'])}\]", text, re.M)


# -- entry points ----------------------------------------------------------------------------------


def test_python_m_help():
    proc = subprocess.run(
        [sys.executable, "-m", "tdz_numba", "--help"], capture_output=True, text=True, timeout=60
    )
    assert proc.returncode == 0, proc.stderr
    for verb in ("info", "tree", "show", "verify", "pack", "unpack", "refresh", "bench"):
        assert verb in proc.stdout


def _console_script() -> str | None:
    exe = "tdz.exe" if os.name == "nt" else "tdz"
    for d in (sysconfig.get_path("scripts"), str(Path(sys.executable).parent)):
        p = Path(d) / exe
        if p.is_file():
            return str(p)
    return shutil.which("tdz")


def test_console_script():
    tdz = _console_script()
    assert tdz, "the `tdz` console script is not installed (pip install -e .)"
    proc = subprocess.run([tdz, "--help"], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.startswith("usage: tdz ") and "unpack" in proc.stdout
    from tdz_numba import __version__

    proc = subprocess.run([tdz, "--version"], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0 and __version__ in proc.stdout


# -- build and install ----------------------------------------------------------------------------


@pytest.mark.skipif(shutil.which("git") is None, reason="needs git for a clean source copy")
def test_build_sdist_and_wheel_then_install(tmp_path):
    """``python -m build`` makes an sdist and a wheel; the wheel installs into a fresh venv
    (``--no-deps``: no torch download) and imports; both carry the license and py.typed."""
    pytest.importorskip("build")
    import tarfile
    import zipfile

    src = tmp_path / "src"
    # a copy of the tracked files only: no .venv, caches or build outputs
    files = subprocess.run(
        ["git", "ls-files", "-co", "--exclude-standard"], cwd=ROOT, capture_output=True, text=True, check=True
    ).stdout.split()
    for rel in files:
        if (ROOT / rel).is_file():
            (src / rel).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(ROOT / rel, src / rel)
    out = tmp_path / "dist"
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "build",
            "--no-isolation",
            "--sdist",
            "--wheel",
            "--outdir",
            str(out),
            str(src),
        ],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    (wheel,) = out.glob("*.whl")
    (sdist,) = out.glob("*.tar.gz")
    names = zipfile.ZipFile(wheel).namelist()
    assert "tdz_numba/py.typed" in names and "tdz_numba/__init__.py" in names
    # every sub-package of the source tree is in the wheel
    for init in (ROOT / "tdz_numba").rglob("__init__.py"):
        assert init.relative_to(ROOT).as_posix() in names, f"{init.parent.name} missing from the wheel"
    assert any(n.endswith(".dist-info/licenses/LICENSE") for n in names)
    assert not any(n.startswith("tests/") for n in names)
    with tarfile.open(sdist) as tar:
        members = {m.name.split("/", 1)[1] for m in tar.getmembers() if "/" in m.name}
    assert {"LICENSE", "pyproject.toml", "tdz_numba/__init__.py", "tdz_numba/py.typed"} <= members
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True, timeout=120)
    py = venv / "bin" / "python"
    # no PYTHONPATH: a checkout on it (with a tdz_numba.egg-info) would make pip think the
    # package is already installed and skip the wheel
    clean_env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PYTHONHOME")}
    proc = subprocess.run(
        [str(py), "-m", "pip", "install", "-q", "--no-deps", "--no-index", str(wheel)],
        capture_output=True,
        text=True,
        timeout=300,
        env=clean_env,
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    # import tdz_numba needs none of its dependencies: they load on first use
    proc = subprocess.run(
        [str(py), "-c", "import tdz_numba, sys; print(tdz_numba.__version__, tdz_numba.__file__)"],
        capture_output=True,
        text=True,
        timeout=60,
        cwd=tmp_path,
        env=clean_env,
    )
    assert proc.returncode == 0, proc.stderr
    version, where = proc.stdout.split()
    assert version == tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["version"]
    assert str(venv) in where
    assert (venv / "bin" / "tdz").is_file()
