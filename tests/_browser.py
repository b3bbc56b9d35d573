"""A page in headless chromium, for the tests that look at what a person sees (the report, the
API reference): a screenshot and the DOM after its scripts ran."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser") or (
    "/usr/bin/chromium" if Path("/usr/bin/chromium").exists() else None)
#: the skip reason where no chromium is installed
NO_CHROMIUM = "no chromium installed (.ci/run installs it with apt-get where it can)"


def render(url: str, tmp_path: Path):
    """(screenshot pixels 1600 x 1200, the DOM, chromium's stderr of both runs) of ``url``; asserts
    the screenshot was written and is not blank."""
    import numpy as np
    from matplotlib.image import imread

    flags = [CHROMIUM, "--headless", "--no-sandbox", "--disable-gpu", "--enable-logging=stderr", "--v=0",
             "--user-data-dir=" + str(tmp_path / "profile")]
    shot = tmp_path / "shot.png"
    res = subprocess.run(flags + ["--window-size=1200,1600", f"--screenshot={shot}", url],
                         capture_output=True, text=True, timeout=60)
    assert shot.exists(), res.stderr[-2000:]
    pixels = imread(shot)
    assert pixels.shape[:2] == (1600, 1200) and float(np.std(pixels[..., :3])) > 0.05  # not blank
    dom = subprocess.run(flags + ["--virtual-time-budget=5000", "--dump-dom", url],
                         capture_output=True, text=True, timeout=60)
    return pixels, dom.stdout, res.stderr, dom.stderr
