#!/usr/bin/env bash
# Make sure the browser tests (tests/test_tree_view_browser.py) have their browser: Debian's `chromium` package at
# /usr/bin/chromium (or $TRL_TREE_CHROMIUM), which Playwright drives. Installs it with apt-get when it is missing and
# this runs as root; otherwise says what to run. Playwright's own `playwright install` is never used (it downloads a
# browser). The README's test command runs this before pytest, so a missing browser fails loudly instead of skipping.
set -euo pipefail
browser="${TRL_TREE_CHROMIUM:-/usr/bin/chromium}"
if [[ -x "$browser" ]]; then
    exit 0
fi
if [[ -n "${TRL_TREE_CHROMIUM:-}" ]]; then
    echo "ensure_chromium: TRL_TREE_CHROMIUM=$browser is not an executable file" >&2
    exit 1
fi
if ! command -v apt-get >/dev/null 2>&1; then
    echo "ensure_chromium: no Chromium at /usr/bin/chromium and no apt-get: install Chromium with your system's" \
         "package manager, then set TRL_TREE_CHROMIUM=/path/to/chromium" >&2
    exit 1
fi
if [[ "$(id -u)" != "0" ]]; then
    echo "ensure_chromium: no Chromium at /usr/bin/chromium, and installing it needs root: run" \
         "'sudo apt-get update && sudo apt-get install -y chromium', then run the tests again" >&2
    exit 1
fi
echo "ensure_chromium: installing Debian's chromium (the browser tests' browser)"
apt-get update -q
DEBIAN_FRONTEND=noninteractive apt-get install -y -q chromium
test -x /usr/bin/chromium
