"""The notebook repr as a browser draws it (issue 25): ``scripts/repr_screenshot.py`` renders
``Archive._repr_html_`` in headless Chromium; the test checks the picture has the table's ink
(rows of text, not a blank or an error page) and that the page it drew holds the headers, the
value previews, the metadata and the per-level sizes. Skips where no browser is installed
(Debian: ``apt-get install chromium``)."""

import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

ROOT = Path(__file__).resolve().parent.parent
SCRIPT = ROOT / "scripts" / "repr_screenshot.py"
sys.path.insert(0, str(SCRIPT.parent))

import repr_screenshot  # noqa: E402


def test_page_has_headers_previews_metadata_and_level_sizes(tmp_path):
    html = repr_screenshot.page(repr_screenshot.sample(tmp_path / "s.tdz"))
    assert "<th>key</th><th>dtype</th><th>shape</th>" in html and "<th>values</th>" in html
    assert '<td class="tdz-v">0 1 2 3 4 5 6</td>' in html  # 7 values: all shown
    assert "metadata: source = &#x27;scripts/repr_screenshot.py&#x27;; round = 25" in html
    assert "20 keys &middot; 78.1 KiB" in html  # a sub-level's size
    assert "<details>" not in html  # expanded for the picture


def test_preview_elides_only_runs_of_three_or_more():
    from tdz_numba.archive.display import value_preview

    assert value_preview(torch.arange(8)) == "0 1 2 3 4 5 6 7"
    assert value_preview(torch.arange(9)) == "0 1 2 ... 6 7 8"
    assert value_preview(torch.zeros(0)) == ""


@pytest.mark.skipif(
    not any(map(shutil.which, repr_screenshot.BROWSERS)), reason="no headless Chromium installed"
)
def test_headless_chromium_draws_the_table(tmp_path):
    import matplotlib.image as mpimg

    out = tmp_path / "repr.png"
    proc = subprocess.run(
        [sys.executable, str(SCRIPT), str(out)], capture_output=True, text=True, timeout=300
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    img = mpimg.imread(out)
    assert img.shape[:2] == (1400, 1100)
    dark = img[..., :3].mean(axis=2) < 0.5  # text pixels
    rows = np.flatnonzero(dark.any(axis=1))
    # the sample's 74 rows of text (root, 4 sub-levels, ~68 leaf and header rows) at ~15 px:
    # ink spread over at least 1000 px of the page, not a one-line error page
    assert rows.size > 500 and rows[-1] - rows[0] > 1000, (rows.size, rows[:1], rows[-1:])
