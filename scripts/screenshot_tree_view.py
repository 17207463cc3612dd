"""Look at a rollout-tree page as a person would: open it in headless Chromium and write a PNG screenshot.

A developer check, not a test (CI needs no browser; tests/test_tree_view.py checks the page's content). Usage:

    python scripts/screenshot_tree_view.py PAGE.html [--out shot.png]          # a saved page
    python scripts/screenshot_tree_view.py RUN_DIR [--out shot.png]            # the run's newest page (rendered
                                                                                 # again from its saved data)
    python scripts/screenshot_tree_view.py --tiny-run treeopsd --out shot.png  # train the warm-started tiny model
                                                                                 # for one generation batch with
                                                                                 # log_completions=True, then shoot
                                                                                 # (treeopsd, at2po, treeadv, treeflex)

Then open the PNG and look: the tree's shape, the merged leaves (×m), the credit chips, the folded long texts, the
prompt list. `--prompt N` clicks the N-th prompt of the list before the shot; `--height` makes the window taller.

Chromium: Debian's package (`apt-get install -y chromium`) or any Chrome on PATH; `--chromium PATH` picks one.
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
BROWSERS = ("chromium", "chromium-browser", "google-chrome", "google-chrome-stable")
FLAGS = ("--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
         "--disable-background-networking", "--disable-component-update", "--disable-sync", "--hide-scrollbars")


def find_browser(explicit: str | None) -> str:
    found = explicit or next((shutil.which(b) for b in BROWSERS if shutil.which(b)), None)
    if not found:
        raise SystemExit(f"No Chromium found (looked for {', '.join(BROWSERS)}): install one, e.g. "
                         "`apt-get install -y chromium`, or pass --chromium PATH.")
    return found


def newest_page(target: Path) -> Path:
    """The page to shoot: an .html file as it is; a .json or a run directory rendered again (newest page)."""
    from trl_tree.tree_view import render_run

    if target.suffix == ".html":
        return target
    pages = render_run(target)
    return max(pages, key=lambda p: (p.stat().st_mtime, p.name))


def with_prompt_selected(page: Path, prompt: int) -> Path:
    """A copy of the page that shows prompt N (the page's own prompt list, clicked by a line of script)."""
    text = page.read_text(encoding="utf-8")
    click = (f"<script>var b=document.querySelectorAll('.navbtn')[{prompt}];if(b){{b.click();}}</script></body>")
    copy = page.with_name(f"{page.stem}.prompt{prompt}.html")
    copy.write_text(text.replace("</body>", click, 1), encoding="utf-8")
    return copy


def screenshot(page: Path, out: Path, browser: str, width: int = 1400, height: int = 1000) -> Path:
    profile = tempfile.mkdtemp(prefix="tree-view-chromium-")
    command = [browser, *FLAGS, f"--user-data-dir={profile}", f"--screenshot={out.resolve()}",
               f"--window-size={width},{height}", page.resolve().as_uri()]
    try:
        subprocess.run(command, check=True, capture_output=True, timeout=120)
    finally:
        shutil.rmtree(profile, ignore_errors=True)
    if not out.is_file():
        raise SystemExit(f"Chromium wrote no screenshot to {out}.")
    return out


def tiny_run(method: str, out_dir: Path) -> Path:
    """Train the warm-started tiny model (tests/launch/tiny_tree_run.py) for one generation batch of two prompts
    with log_completions=True; returns the run directory."""
    sys.path.insert(0, str(REPO / "tests" / "launch"))
    os.environ.setdefault("TRL_EXPERIMENTAL_SILENCE", "1")
    from tiny_tree_run import build_trainer

    trainer = build_trainer(str(out_dir), max_steps=2, method=method, log_completions=True)
    trainer.train()
    return out_dir


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("target", nargs="?", help="a page (.html), its data (.json) or a run's output_dir")
    parser.add_argument("--tiny-run", choices=("treeopsd", "at2po", "treeadv", "treeflex"), default=None)
    parser.add_argument("--out", default="tree_view.png")
    parser.add_argument("--prompt", type=int, default=0, help="which prompt of the page to show")
    parser.add_argument("--width", type=int, default=1400)
    parser.add_argument("--height", type=int, default=1000)
    parser.add_argument("--chromium", default=None)
    args = parser.parse_args(argv)
    browser = find_browser(args.chromium)
    if args.tiny_run:
        target = tiny_run(args.tiny_run, Path(args.target or tempfile.mkdtemp(prefix=f"tree-view-{args.tiny_run}-")))
    elif args.target:
        target = Path(args.target)
    else:
        parser.error("give a page, a run directory, or --tiny-run METHOD")
    page = newest_page(target)
    if args.prompt:
        page = with_prompt_selected(page, args.prompt)
    shot = screenshot(page, Path(args.out), browser, args.width, args.height)
    print(f"page: {page}\nscreenshot: {shot}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
