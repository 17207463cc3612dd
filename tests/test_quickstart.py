"""The README's Quickstart is what CI runs: `.ci/run` holds the two command lines verbatim, checks them against the
README before running them, and runs them in a fresh virtual environment, so a package that only the machine has
cannot hide a missing install step, and the README and CI cannot drift apart."""

import importlib.util
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
CI_RUN = (ROOT / ".ci" / "run").read_text()

_spec = importlib.util.spec_from_file_location("quickstart", ROOT / "scripts" / "quickstart.py")
quickstart = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(quickstart)


def test_the_quickstart_is_two_lines_the_main_job_then_the_tests():
    main_job, tests = quickstart.quickstart_lines((ROOT / "README.md").read_text())
    assert main_job.endswith("accelerate launch examples/train_hotpot.py")
    assert re.search(r"\bpython -m pytest\b", tests)
    assert main_job.startswith("pip install") and tests.startswith("pip install")  # each installs what it needs


def test_ci_runs_the_readmes_lines_verbatim_in_a_fresh_venv_and_checks_them_against_it():
    in_venv = CI_RUN[CI_RUN.index("python3 -m venv") : CI_RUN.index("\ndeactivate")]
    for line in quickstart.quickstart_lines((ROOT / "README.md").read_text()):
        assert f"'{line}'" in in_venv  # the very text a user pastes, inside the fresh environment
    assert "python scripts/quickstart.py" in in_venv  # and .ci/run stops if its copy drifts from the README
    assert 'bash -euo pipefail -c "$line"' in in_venv
    venv = re.search(r"^python3 -m venv (.+)$", CI_RUN, flags=re.M)
    assert venv is not None and "--system-site-packages" not in venv.group(1)


def test_ci_stops_before_running_anything_when_its_copy_drifts_from_the_readme(tmp_path):
    """The drift check itself, run as .ci/run runs it: equal lines pass; one changed README line stops CI."""
    import shutil
    import subprocess
    import sys

    check = CI_RUN[CI_RUN.index("quickstart=(") : CI_RUN.index("for line in")]
    (tmp_path / "scripts").mkdir()
    shutil.copy(ROOT / "scripts" / "quickstart.py", tmp_path / "scripts" / "quickstart.py")
    shims = tmp_path / "bin"
    shims.mkdir()
    (shims / "python").symlink_to(sys.executable)  # .ci/run calls `python` inside its venv
    env = {"PATH": f"{shims}:/usr/bin:/bin"}

    def run_check(readme: str) -> subprocess.CompletedProcess:
        (tmp_path / "README.md").write_text(readme)
        return subprocess.run(["bash", "-euo", "pipefail", "-c", check], cwd=tmp_path, env=env, capture_output=True,
                              text=True)

    readme = (ROOT / "README.md").read_text()
    assert run_check(readme).returncode == 0
    drifted = run_check(readme.replace("accelerate launch examples/train_hotpot.py", "python examples/train_hotpot.py", 1))
    assert drifted.returncode == 1 and "differ from the README" in drifted.stdout


def test_ci_installs_nothing_for_the_main_environment_beyond_the_readme():
    before_deactivate = CI_RUN[: CI_RUN.index("\ndeactivate")]
    readme_lines = quickstart.quickstart_lines((ROOT / "README.md").read_text())
    installs = [line for line in re.findall(r"[^\n]*pip install[^\n]*", before_deactivate)
                if line.strip().strip("'") not in readme_lines]
    assert installs == ["python -m pip install -q --upgrade pip"]  # the README's own lines install everything else


@pytest.mark.parametrize(
    "readme, error",
    [
        ("# trl-tree\n\nno quickstart here\n", "no '## Quickstart' heading"),
        ("## Quickstart\n\nJust read the docs.\n\n## Next\n\n```bash\nls\n```\n", "no fenced code block"),
    ],
)
def test_a_readme_without_a_quickstart_block_is_a_clear_error(readme, error):
    with pytest.raises(ValueError, match=error):
        quickstart.quickstart_lines(readme)


def test_comments_and_blank_lines_in_the_block_are_not_commands():
    readme = "## Quickstart\n\n```bash\n# install and train\nfirst\n\nsecond\n```\n"
    assert quickstart.quickstart_lines(readme) == ["first", "second"]


def test_the_test_line_installs_the_browser_tests_browser_and_driver_before_pytest():
    """The browser tests fail without Chromium or Playwright (they never skip), so the line that runs the suite must
    install both: Playwright through the `dev` extra, Chromium through scripts/ensure_chromium.sh, before pytest."""
    _, tests = quickstart.quickstart_lines((ROOT / "README.md").read_text())
    steps = [step.strip() for step in tests.split("&&")]
    assert "bash scripts/ensure_chromium.sh" in steps
    assert steps.index("bash scripts/ensure_chromium.sh") < next(i for i, s in enumerate(steps) if "pytest" in s)
    assert re.search(r'pip install -e "\.\[[^\]]*\bdev\b', tests)
    dev = re.search(r"^dev = \[(.*)\]", (ROOT / "pyproject.toml").read_text(), flags=re.M)
    assert dev is not None and '"playwright"' in dev.group(1)
    script = (ROOT / "scripts" / "ensure_chromium.sh").read_text()
    assert "apt-get install -y -q chromium" in script and "playwright install" not in script.replace(
        "`playwright install` is never used", "")


def test_ensure_chromium_is_quiet_when_the_browser_is_there_and_says_what_to_do_when_not(tmp_path):
    import subprocess

    browser = tmp_path / "chromium"
    browser.write_text("#!/bin/sh\n")
    browser.chmod(0o755)
    script = str(ROOT / "scripts" / "ensure_chromium.sh")
    there = subprocess.run(["bash", script], env={"PATH": "/usr/bin:/bin", "TRL_TREE_CHROMIUM": str(browser)},
                           capture_output=True, text=True)
    assert there.returncode == 0 and there.stdout == there.stderr == ""
    missing = subprocess.run(["bash", script], env={"PATH": "/usr/bin:/bin", "TRL_TREE_CHROMIUM": str(tmp_path / "no")},
                             capture_output=True, text=True)
    assert missing.returncode == 1 and "TRL_TREE_CHROMIUM" in missing.stderr
