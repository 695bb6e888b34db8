"""Every code block of the README and of the ``docs/*.md`` pages runs as pasted.

The ``python`` blocks run in order (the README first, then the pages by name),
in one fresh temporary directory, each in a new interpreter (so a block cannot
lean on a name another block defined unless it defines it itself). Then every
``tdz ...`` line of the ``bash`` blocks runs there too (as ``python -m
tdz_numba ...``), against the files the Python blocks made. Set-up commands
(``scripts/setup.sh``, ``pip``, ``conda``, ``cd``, ``asv``) are not run here: CI
runs them (``.ci/run``). A block that fails only because an optional package
(safetensors, tensordict, h5py, ...) is not installed is skipped, naming it.

The README is a front page: the two set-up commands come first, it stays under
300 lines, and every relative link of every page (images included) resolves.
"""

import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
README = ROOT / "README.md"
PAGES = [README, *sorted((ROOT / "docs").glob("*.md"))]
FENCE = re.compile(r"^```(\w+)[^\n]*\n(.*?)^```", re.M | re.S)
#: Packages a block may need that the base install does not bring (the extras and the peers).
OPTIONAL = {
    "safetensors",
    "tensordict",
    "h5py",
    "onnx",
    "gguf",
    "fsspec",
    "s3fs",
    "aiohttp",
    "moto",
    "orjson",
}
MISSING_MODULE = re.compile(r"ModuleNotFoundError: No module named '([\w.]+)'")
#: Optional packages a skipped block lacked (the CLI lines that need its files skip too).
_skipped: list[str] = []


def _name(page: Path) -> str:
    return page.relative_to(ROOT).as_posix()


def page_blocks(page: Path, lang: str) -> list[str]:
    return [body for kind, body in FENCE.findall(page.read_text()) if kind == lang]


def blocks(lang: str) -> list[tuple[str, str]]:
    """``(page name, body)`` of every ``lang`` block, the README first."""
    return [(_name(page), body) for page in PAGES for body in page_blocks(page, lang)]


def _ids(items: list[tuple[str, str]]) -> list[str]:
    seen: dict[str, int] = {}
    out = []
    for page, _ in items:
        out.append(f"{page}#{seen.get(page, 0)}")
        seen[page] = seen.get(page, 0) + 1
    return out


def _env() -> dict[str, str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")]))
    env.setdefault("NUMBA_CACHE_DIR", str(ROOT / ".numba_cache"))
    return env


@pytest.fixture(scope="module")
def workdir(tmp_path_factory):
    return tmp_path_factory.mktemp("readme")


def test_readme_has_python_and_cli_blocks():
    assert len(page_blocks(README, "python")) >= 1  # the tour
    assert any(
        line.strip().startswith("tdz ") for b in page_blocks(README, "bash") for line in b.splitlines()
    )
    assert len(blocks("python")) >= 3
    assert {page for page, _ in blocks("python")} > {"README.md"}  # the docs pages' blocks are collected


def test_readme_opens_with_the_two_setup_commands():
    text = README.read_text()
    first = FENCE.search(text)
    assert first is not None and first.group(1) == "bash"
    assert "\n## " not in text[: first.start()]  # before any section
    commands = [line.split("  #", 1)[0].strip() for line in first.group(2).splitlines() if line.strip()]
    assert len(commands) == 2 and all(c.startswith("bash scripts/setup.sh && ") for c in commands)
    assert any("-m pytest" in c for c in commands) and any("tdz_numba.cli.demo" in c for c in commands)
    # CI runs the README's test command as written, and the demo's module
    ci = (ROOT / ".ci" / "run").read_text()
    assert next(c for c in commands if "-m pytest" in c) in ci and "-m tdz_numba.cli.demo" in ci


def test_readme_is_a_front_page():
    assert len(README.read_text().splitlines()) <= 300


def _slug(heading: str) -> str:
    """GitHub's anchor for a heading: lower case, punctuation dropped, spaces as hyphens."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def _anchors(page: Path) -> set[str]:
    text = FENCE.sub("", page.read_text())
    return {_slug(h) for h in re.findall(r"^#+ (.+)$", text, re.M)}


@pytest.mark.parametrize("page", PAGES, ids=_name)
def test_relative_links_resolve(page):
    text = re.sub(r"`[^`\n]*`", "", FENCE.sub("", page.read_text()))  # links outside code only
    links = re.findall(r"\]\(([^)\s]+)\)", text)
    bad = []
    for link in links:
        if re.match(r"[a-z]+:", link):  # http(s), mailto
            continue
        target, _, anchor = link.partition("#")
        path = (page.parent / target).resolve() if target else page
        if not path.exists():
            bad.append(f"{link}: no such file")
        elif anchor and path.suffix == ".md" and anchor not in _anchors(path):
            bad.append(f"{link}: no heading #{anchor} in {path.name}")
    assert not bad, f"{_name(page)}: {bad}"


PYTHON_BLOCKS = blocks("python")


@pytest.mark.parametrize("i", range(len(PYTHON_BLOCKS)), ids=_ids(PYTHON_BLOCKS))
def test_python_block_runs(i, workdir):
    page, code = PYTHON_BLOCKS[i]
    proc = subprocess.run(
        [sys.executable, "-c", code], cwd=workdir, env=_env(), capture_output=True, text=True, timeout=600
    )
    missing = MISSING_MODULE.findall(proc.stderr)
    if proc.returncode != 0 and missing and missing[-1].split(".")[0] in OPTIONAL:
        _skipped.append(missing[-1])
        pytest.skip(f"{page}: needs the optional package {missing[-1]!r}")
    assert proc.returncode == 0, f"{page} python block:\n{code}\n--- stderr:\n{proc.stderr[-3000:]}"


def _cli_lines() -> list[tuple[str, str]]:
    out = []
    for page, body in blocks("bash"):
        for line in body.splitlines():
            line = line.split("  #", 1)[0].strip()
            if line.startswith("tdz ") and not line.startswith("tdz bench"):
                out.append((page, line))
    return out


CLI_LINES = _cli_lines()


@pytest.mark.parametrize("i", range(len(CLI_LINES)), ids=[f"{p}: {line}" for p, line in CLI_LINES])
def test_cli_line_runs(i, workdir):
    # after the python blocks (pytest runs this module's tests in file order)
    page, line = CLI_LINES[i]
    argv = shlex.split(line)[1:]
    proc = subprocess.run(
        [sys.executable, "-m", "tdz_numba", *argv],
        cwd=workdir,
        env=_env(),
        capture_output=True,
        text=True,
        timeout=600,
    )
    absent = [a for a in argv if "." in a and not a.startswith("-") and not (workdir / a).exists()]
    if proc.returncode != 0 and _skipped and absent:
        pytest.skip(f"{line}: {absent} not made (blocks skipped for lack of {_skipped})")
    assert proc.returncode == 0, f"{page}: {line}\n{proc.stdout[-2000:]}\n{proc.stderr[-2000:]}"
