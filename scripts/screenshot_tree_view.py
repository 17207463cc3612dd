"""Look at a rollout-tree page as a person would: open it in headless Chromium and write a PNG screenshot. It
regenerates the README's picture (docs/images/tree_view.png):

    python scripts/screenshot_tree_view.py --tiny-run treeopsd --out docs/images/tree_view.png --height 1100

The browser is the one the browser tests drive (tests/test_tree_view_browser.py), opened the same way
(`trl_tree.tree_view.browser`: the system's Chromium through Playwright, a fresh profile). Usage:

    python scripts/screenshot_tree_view.py PAGE.html [--out shot.png]          # a saved page
    python scripts/screenshot_tree_view.py RUN_DIR [--out shot.png]            # the run's newest page (rendered
                                                                                 # again from its saved data)
    python scripts/screenshot_tree_view.py --tiny-run treeopsd --out shot.png  # train the warm-started tiny model
                                                                                 # for one generation batch with
                                                                                 # log_completions=True, then shoot
                                                                                 # (treeopsd, at2po, treeadv, treeflex)
    python scripts/screenshot_tree_view.py RUN_DIR --index --out index.png     # the run's index page

Then open the PNG and look: the tree's shape, the merged leaves (×m), the credit colours and chips, the key, the
folded long texts, the prompt list. `--prompt N` clicks the N-th prompt of the list before the shot, `--click
next-failed` (or next-rewarded, best-leaf, show-tpl, all-numbers, f-mixed, f-failed) clicks one of the page's
controls, `--search TEXT` types into its search box; `--height` makes the window taller, `--width 700 --height 420`
is about what a tracker's frame shows.

The tiny run trains at the Quickstart's learning rate (`trl_tree/recipes/hotpot_offline.yaml`, 1e-4), not the
tests' 1e-2: at 1e-2 one generation batch collapses every turn's p = σ(s) to about 0 or 1, so the page would show
an update no real run makes. `--learning-rate` picks another (TreeOPSD's default is 1e-6: Δp of about 1e-5).

Chromium: Debian's package at /usr/bin/chromium (`bash scripts/ensure_chromium.sh`), or `--chromium PATH`; Playwright
from the `dev` extra.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent


def newest_page(target: Path) -> Path:
    """The page to shoot: an .html file as it is; a .json or a run directory rendered again (newest page)."""
    from trl_tree.tree_view import INDEX, render_run

    if target.suffix == ".html":
        return target
    pages = [p for p in render_run(target) if p.stem != INDEX]  # render_run returns the index last
    return max(pages, key=lambda p: (int("".join(c for c in p.stem if c.isdigit()) or 0), p.stem.startswith("step")))


CLICKS = {  # --click NAME: the control it clicks
    "next-rewarded": "#next-rewarded", "next-failed": "#next-failed", "best-leaf": "section.prompt.active .leaflink",
    "show-tpl": "#show-tpl", "all-numbers": "#all-numbers", "f-mixed": "#f-mixed", "f-failed": "#f-failed",
}


def screenshot(page: Path, out: Path, *, prompt: int = 0, clicks: tuple[str, ...] = (), search: str | None = None,
               width: int = 1400, height: int = 1000, chromium: str | None = None) -> Path:
    """Open `page` in headless Chromium, show prompt N, click the named controls and type `search` into the search
    box as a reader would, then write the window as a PNG."""
    from trl_tree.tree_view.browser import open_browser

    try:
        with open_browser(chromium, width=width, height=height) as browser:
            tab = browser.new_page()
            tab.goto(page.resolve().as_uri())
            tab.wait_for_selector("body.js, body.nojs")
            buttons = tab.locator(".navbtn")
            if prompt and buttons.count() > prompt:
                buttons.nth(prompt).click()
            for name in clicks:
                control = tab.locator(CLICKS[name]).first
                if control.count():
                    control.click()
            if search is not None and tab.locator("#search").count():
                tab.locator("#search").fill(search)
            tab.wait_for_timeout(300)  # a scroll the page makes settles
            out.parent.mkdir(parents=True, exist_ok=True)
            tab.screenshot(path=str(out))
    except RuntimeError as e:  # no Playwright or no Chromium: say how to get them
        raise SystemExit(str(e)) from e
    return out


def quickstart_learning_rate() -> float:
    """The learning rate of the Quickstart's offline recipe (what `examples/train_hotpot.py` trains at)."""
    import yaml

    return float(yaml.safe_load((REPO / "trl_tree" / "recipes" / "hotpot_offline.yaml").read_text())["learning_rate"])


def tiny_run(method: str, out_dir: Path, learning_rate: float | None = None, max_steps: int = 2) -> Path:
    """Train the warm-started tiny model (tests/launch/tiny_tree_run.py) with log_completions=True for `max_steps`
    optimizer steps (2: one generation batch of two prompts) at `learning_rate` (default: the Quickstart's);
    returns the run directory."""
    sys.path.insert(0, str(REPO / "tests" / "launch"))
    os.environ.setdefault("TRL_EXPERIMENTAL_SILENCE", "1")
    from tiny_tree_run import build_trainer

    trainer = build_trainer(str(out_dir), max_steps=max_steps, method=method, log_completions=True)
    # build_trainer's 1e-2 is the launch tests' rate (parameters must visibly change in 2 steps); the optimizer is
    # made in train(), so the demo's rate set here is the one it trains at
    trainer.args.learning_rate = quickstart_learning_rate() if learning_rate is None else learning_rate
    trainer.train()
    return out_dir


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("target", nargs="?", help="a page (.html), its data (.json) or a run's output_dir")
    parser.add_argument("--tiny-run", choices=("treeopsd", "at2po", "treeadv", "treeflex"), default=None)
    parser.add_argument("--out", default="tree_view.png")
    parser.add_argument("--prompt", type=int, default=0, help="which prompt of the page to show")
    parser.add_argument("--click", action="append", default=[], choices=sorted(CLICKS),
                        help="click a control of the page before the shot (repeatable)")
    parser.add_argument("--search", default=None, help="type this into the page's search box")
    parser.add_argument("--index", action="store_true", help="shoot the run's index page instead")
    parser.add_argument("--learning-rate", type=float, default=None,
                        help="--tiny-run: the learning rate (default: the Quickstart's, 1e-4)")
    parser.add_argument("--max-steps", type=int, default=2, help="--tiny-run: optimizer steps (2 per page)")
    parser.add_argument("--width", type=int, default=1400)
    parser.add_argument("--height", type=int, default=1000)
    parser.add_argument("--chromium", default=None, help="the Chromium to drive (default: /usr/bin/chromium)")
    args = parser.parse_args(argv)
    if args.tiny_run:
        target = tiny_run(args.tiny_run, Path(args.target or tempfile.mkdtemp(prefix=f"tree-view-{args.tiny_run}-")),
                          args.learning_rate, args.max_steps)
    elif args.target:
        target = Path(args.target)
    else:
        parser.error("give a page, a run directory, or --tiny-run METHOD")
    page = newest_page(target)
    if args.index:
        page = page.parent / "index.html"
    shot = screenshot(page, Path(args.out), prompt=args.prompt, clicks=tuple(args.click), search=args.search,
                      width=args.width, height=args.height, chromium=args.chromium)
    print(f"page: {page}\nscreenshot: {shot}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
