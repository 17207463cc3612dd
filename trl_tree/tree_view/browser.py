"""Headless Chromium through Playwright, as the browser tests (tests/test_tree_view_browser.py) and
`scripts/screenshot_tree_view.py` open the pages: the system's Chromium (Debian's `chromium` package,
`scripts/ensure_chromium.sh` installs it), never a browser Playwright downloads, with no network use of its own and a
fresh profile each time. A development tool: the package itself never imports it, and Playwright is in the `dev`
extra only."""

from __future__ import annotations

import contextlib
import os
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path

CHROMIUM = "/usr/bin/chromium"
FLAGS = ("--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
         "--disable-background-networking", "--disable-component-update", "--disable-sync")


def chromium_path(explicit: str | None = None) -> str:
    """The Chromium to run: `explicit`, else `$TRL_TREE_CHROMIUM`, else /usr/bin/chromium; an error that says how
    to install it when there is none."""
    path = explicit or os.environ.get("TRL_TREE_CHROMIUM") or CHROMIUM
    if not Path(path).is_file():
        raise RuntimeError(f"No Chromium at {path}: run `bash scripts/ensure_chromium.sh` (apt-get install -y "
                           "chromium, as root), or point TRL_TREE_CHROMIUM at one.")
    return path


@contextlib.contextmanager
def open_browser(executable: str | None = None, *, width: int = 1400, height: int = 1000) -> Iterator:
    """A Playwright browser context of headless Chromium with a fresh profile, removed after."""
    try:
        from playwright.sync_api import sync_playwright
    except ImportError as e:
        raise RuntimeError("Playwright is not installed: pip install -e '.[dev]' (never `playwright install`: "
                           "the system's Chromium is used).") from e
    profile = tempfile.mkdtemp(prefix="tree-view-chromium-")
    try:
        with sync_playwright() as p:
            context = p.chromium.launch_persistent_context(
                profile, executable_path=chromium_path(executable), headless=True, args=list(FLAGS),
                viewport={"width": width, "height": height})
            try:
                yield context
            finally:
                context.close()
    finally:
        shutil.rmtree(profile, ignore_errors=True)
