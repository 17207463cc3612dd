"""The rollout-tree page in real trackers (issue #25, item 8): Trackio's local store and W&B in offline mode, each in
a temporary folder. Every page is logged at the trainer's global step, the scalars stay at theirs, and a run with
tool-calling completions trains through W&B's completions table.

Before: transformers' Trackio callback, GRPOTrainer's completions table and the page all called `trackio.log`
without `step=`, so Trackio's own counter advanced 2-3 times per optimizer step (the pages of steps 2/4 at Trackio
steps 5/10, an 8-step run's scalars up to ~20), and W&B's table of tool-calling completions raised "Data row
contained incompatible types", stopping training. The run is a subprocess (tests/launch/tree_view_tracker_run.py):
Trackio reads its storage folder when it is imported, which TRL does at import."""

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from trl_tree import tree_view as tv

REPO = Path(__file__).resolve().parent.parent
MAX_STEPS = 4  # two generation batches of two optimizer steps: pages at steps 2 and 4


@pytest.fixture(scope="module")
def tracked_run(tmp_path_factory):
    trackers = ["trackio", "wandb"]  # both in the dev extra, which CI installs: a missing one fails, never skips
    missing = [name for name in trackers if importlib.util.find_spec(name) is None]
    assert not missing, f"{missing} not installed: pip install -e '.[dev]'"
    out = tmp_path_factory.mktemp("tracked")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")])}
    done = subprocess.run([sys.executable, str(REPO / "tests" / "launch" / "tree_view_tracker_run.py"), str(out),
                           ",".join(trackers), str(MAX_STEPS)], capture_output=True, text=True, timeout=600, env=env)
    assert done.returncode == 0, done.stderr[-4000:]
    return out, json.loads((out / "report.json").read_text())


def _saved_pages(out: Path, report: dict) -> dict[int, str]:
    """Each saved page's step → the HTML a tracker gets for it (the page without the links to the files beside it)."""
    pages = {}
    for name in report["pages"]:
        data = tv.load_page_data(out / "tree_view" / name)
        pages[data["step"]] = tv.render_page(data)
    return pages


def test_trackio_files_each_page_and_the_scalars_at_the_trainers_global_step(tracked_run):
    out, report = tracked_run
    rows = report["trackio"]
    pages = _saved_pages(out, report)
    assert sorted(pages) == [2, 4] and report["global_step"] == MAX_STEPS
    logged = [row for row in rows if "tree_view" in row["keys"]]
    assert [row["step"] for row in logged] == [2, 4]  # not 5, 10
    for row in logged:
        assert row["page"] == pages[row["step"]]  # the page itself, as the run saved it
        assert row["page_meta"]["caption"] == f"train step {row['step']}: {out / 'tree_view'}/step_{row['step']:06d}.html"
    scalars = [row for row in rows if row["global_step"] is not None]
    assert scalars and all(row["step"] == row["global_step"] for row in scalars)
    assert max(row["step"] for row in rows) == MAX_STEPS  # not ~2.5 times the steps
    tables = [row["step"] for row in rows if "completions" in row["keys"]]
    assert tables and set(tables) <= set(range(1, MAX_STEPS + 1))


def test_wandb_logs_each_page_at_the_trainers_global_step_and_trains_through_its_completions_table(tracked_run):
    out, report = tracked_run
    rows = report["wandb"]
    pages = _saved_pages(out, report)
    logged = [row for row in rows if "tree_view" in row["keys"]]
    assert [row["global_step"] for row in logged] == [2, 4]
    for row in logged:
        assert row["page"] == pages[row["global_step"]]
    # GRPOTrainer's completions table of tool-calling leaves is in the history (as JSON text), each at its step
    tables = [row for row in rows if "completions" in row["keys"]]
    assert tables and all(1 <= row["global_step"] <= MAX_STEPS for row in tables)
    assert max(row["global_step"] for row in rows) == MAX_STEPS


def test_a_tracker_is_one_sink_class_registered_once_and_the_trainer_reaches_it_by_its_name(monkeypatch):
    """The trackers are sinks behind one protocol (`trl_tree.tree_view.sinks`), not an if-chain: a new one is a class
    registered under its `report_to` name, which both the page and the trainer's step pinning then reach."""
    import contextlib
    from types import SimpleNamespace

    from trl_tree.trainer.observability.tree_view_logging import at_global_step
    from trl_tree.tree_view import sinks

    pages, pinned = [], []

    class Fake:
        name = "fake"

        def log_page(self, page, *, step, caption=None):
            pages.append((page, step, caption))
            return True

        @contextlib.contextmanager
        def filed_at(self, current_step):
            pinned.append(current_step())
            yield

    monkeypatch.setitem(sinks.SINKS, "fake", Fake)
    assert tv.log_page_to_trackers("<p>page</p>", ["fake", "tensorboard"], step=3, caption="c") == ["fake"]
    assert pages == [("<p>page</p>", 3, "c")]
    trainer = SimpleNamespace(args=SimpleNamespace(report_to=["fake"]), state=SimpleNamespace(global_step=7))
    with at_global_step(trainer):
        pass
    assert pinned == [7]
    with pytest.raises(ValueError, match="registered already"):
        sinks.register_sink(Fake)
    assert {"wandb", "trackio"} <= set(sinks.SINKS)
    assert tv.log_page_to_trackers("<p>", "none", step=1) == []
