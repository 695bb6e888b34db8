"""Renders an archive's notebook repr (``Archive._repr_html_``) in headless Chromium and saves a
PNG: what a notebook user sees, checked in a real browser (issue 25).

Usage::

    python scripts/repr_screenshot.py OUT.png [--archive PATH] [--browser /usr/bin/chromium] [--collapsed]

Without ``--archive`` a small sample is saved first: the demo's replay-buffer groups, a
safetensors-style flat level with metadata, and a few tiny leaves whose values show in full.
Exits 2 when no browser is found (Debian: ``apt-get install chromium``).
"""

from __future__ import annotations

import argparse
import html
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import numpy as np

import tdz_numba
from tdz_numba.cli.demo import sample_tree

BROWSERS = ("chromium", "chromium-browser", "google-chrome", "google-chrome-stable")
FLAGS = (
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-quic",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
    "--hide-scrollbars",
)


def sample(path: Path) -> Path:
    """Saves the sample archive the screenshot shows at ``path``."""
    tree = sample_tree(groups=3, values=1000)
    tree["small"] = {"steps": np.arange(7, dtype=np.int64), "reward": np.linspace(0, 1, 5, dtype=np.float32)}
    tdz_numba.save(tree, path, metadata={"source": "scripts/repr_screenshot.py", "round": 25})
    return path


def page(archive_path: Path, expand: bool = True) -> str:
    """The HTML page: the repr as a notebook cell's output shows it, in the browser's defaults
    (``expand``: every collapsible level shown open, as after a user's clicks)."""
    with tdz_numba.open(archive_path) as ar:
        body = ar._repr_html_()
    if expand:
        body = body.replace("<details>", "<details open>")
    title = html.escape(archive_path.name)
    return (
        f"<!doctype html><html><head><meta charset='utf-8'><title>{title}</title></head>"
        f"<body style='font-family: sans-serif; margin: 16px'>{body}</body></html>"
    )


def shoot(html_path: Path, out: Path, browser: str, size: str = "1100,1400") -> None:
    """Screenshots ``html_path`` with headless ``browser`` into ``out`` (a fresh profile dir)."""
    with tempfile.TemporaryDirectory() as profile:
        cmd = [browser, *FLAGS, f"--user-data-dir={profile}", f"--window-size={size}"]
        cmd += [f"--screenshot={out}", html_path.resolve().as_uri()]
        subprocess.run(cmd, check=True, capture_output=True, timeout=120)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("out", type=Path)
    ap.add_argument("--archive", type=Path)
    ap.add_argument("--browser")
    ap.add_argument("--collapsed", action="store_true", help="levels closed, as first shown")
    args = ap.parse_args(argv)
    browser = args.browser or next(filter(None, map(shutil.which, BROWSERS)), None)
    if browser is None:
        print("no headless browser found (apt-get install chromium)", file=sys.stderr)
        return 2
    with tempfile.TemporaryDirectory() as d:
        archive = args.archive or sample(Path(d) / "sample.tdz")
        html_path = Path(d) / "repr.html"
        html_path.write_text(page(archive, not args.collapsed), encoding="utf-8")
        shoot(html_path, args.out, browser)
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
