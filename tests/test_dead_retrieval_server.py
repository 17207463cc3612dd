"""A retrieval server that dies mid-run stops the HotpotQA example, as the README says, before it trains on it.

The example runs as a user runs it, in its own process (`tests/dead_server_run.py`: the script with a scripted policy
that searches every rollout), against a server it was given (`--retriever remote`) or one it started itself
(`--retriever server`). After a window full of answered searches and a first checkpoint, the server is killed. The run
must stop with an error naming the server, exit non-zero, leave that checkpoint as it was, save nothing after it (no
later checkpoint: it did not train on the failed searches; no final model, no results file) and skip the "after"
evaluation, which would only have measured the dead server.
"""

import hashlib
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from tests.dead_server_run import MARKER
from trl_tree.envs.retrieval_server import RetrievalServerProcess

ROOT = Path(__file__).resolve().parent.parent
# offline defaults, cut down: 1 held-out question evaluated before (and, if the run went on, after), no warm start
# (the policy is scripted), a checkpoint every step, 4 turns for 3 searches and an answer, 1 passage per search
ARGS = (
    "--num_train 4 --num_eval 1 --num_eval_train 0 --warm_start_steps 0 --max_steps 3 --save_strategy steps "
    "--save_steps 1 --per_device_train_batch_size 3 --steps_per_generation 1 --num_initial_rollouts 2 "
    "--num_branches 1 --max_turns 4 --max_completion_length 768 --topk 1 --log_completions false"
).split()


def _run_killing(kill: str, tmp_path: Path, *args: str) -> tuple[Path, subprocess.CompletedProcess]:
    out = tmp_path / "out"
    command = [
        sys.executable,
        "-m",
        "tests.dead_server_run",
        kill,
        *ARGS,
        *args,
        "--output_dir",
        str(out),
        "--bm25_cache_dir",
        str(tmp_path / "bm25"),
    ]
    env = {**os.environ, "TRL_TREE_CACHE": str(tmp_path / "cache"), "OMP_NUM_THREADS": "1"}
    return out, subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True, timeout=900)


def _assert_stopped_before_training_on_the_dead_server(out: Path, run: subprocess.CompletedProcess, url: str) -> str:
    printed = run.stdout + run.stderr
    assert run.returncode != 0, printed[-3000:]
    assert "[test] killed the retrieval server" in printed, printed[-3000:]
    error = printed[printed.rindex("ToolFatalError: ") :]
    assert f"Retrieval server {url}/retrieve" in error and "last checkpoint" in error
    killed = json.loads((out / MARKER).read_text())
    checkpoint = out / f"checkpoint-{killed['step']}"
    assert hashlib.sha256((checkpoint / "model.safetensors").read_bytes()).hexdigest() == killed["sha256"]
    assert json.loads((checkpoint / "trainer_state.json").read_text())["global_step"] == killed["step"]
    assert not (out / f"checkpoint-{killed['step'] + 1}").exists()  # no step trained on the failed searches
    assert not (out / "model.safetensors").exists() and not (out / "hotpot_results.json").exists()
    assert "[trl-tree] before" in printed and "[trl-tree] after" not in printed
    return error


@pytest.mark.slow
def test_a_remote_server_killed_mid_run_stops_it_before_it_trains_on_the_failures(tmp_path):
    server = RetrievalServerProcess(
        ["--synthetic", "--num_questions", "5", "--bm25_cache_dir", str(tmp_path / "bm25")],
        startup_timeout=300,
        log_path=tmp_path / "server.log",
    )
    server.start()
    try:
        out, run = _run_killing(
            str(server.process.pid), tmp_path, "--retriever", "remote", "--retriever_url", server.url
        )
    finally:
        server.stop()
    error = _assert_stopped_before_training_on_the_dead_server(out, run, server.url)
    assert "3 requests in a row" in error and "max_consecutive_failures=3" in error


@pytest.mark.slow
def test_a_server_of_its_own_that_dies_mid_run_stops_it_at_once_naming_its_exit_and_log(tmp_path):
    out, run = _run_killing("own", tmp_path, "--retriever", "server")
    printed = run.stdout + run.stderr
    started = re.search(r"retrieval server started at (\S+) \(log: (\S+)\)", printed)
    assert started, printed[-3000:]
    url, log = started.groups()
    try:
        error = _assert_stopped_before_training_on_the_dead_server(out, run, url)
        assert "is gone" in error and "exited with code -9 (killed by SIGKILL)" in error and log in error
        assert Path(log).is_file()  # kept: it may say why the server died
    finally:
        Path(log).unlink(missing_ok=True)
