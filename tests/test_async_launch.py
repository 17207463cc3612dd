"""Asynchronous rollouts on two processes (docs/design.md §9): each rank's rollout worker grows that rank's share out
of step with the other ranks, and every reduction over ranks stays in the trainers' threads.

`tests/launch/tiny_async_run.py` trains the warm-started tiny model (real HF generation, the calculator tool,
TreeOPSD) three ways on each of two CPU processes: synchronously, through the worker in lockstep, and at
max_staleness 1."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


@pytest.fixture(scope="module")
def reports(tmp_path_factory):
    out = tmp_path_factory.mktemp("async_launch")
    env = {**os.environ, "OMP_NUM_THREADS": "1", "TRL_EXPERIMENTAL_SILENCE": "1", "CI": "true"}
    cmd = [sys.executable, "-m", "accelerate.commands.launch", "--multi_gpu", "--num_processes", "2",
           "--num_machines", "1", "-m", "tests.launch.tiny_async_run", str(out)]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=900, env=env, cwd=ROOT)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    found = [json.loads(p.read_text()) for p in sorted(out.glob("report-rank*.json"))]
    assert [r["rank"] for r in found] == [0, 1] and all(r["world"] == 2 for r in found)
    return found


@pytest.mark.slow
def test_the_worker_in_lockstep_trains_what_the_synchronous_ranks_train_bit_for_bit(reports):
    """At max_staleness 0 every rank's worker grows exactly the trees its synchronous rank grows (its policy copy,
    its own vote, its rewards ungathered), so the DDP-reduced steps, and every loss and weight, are the same bits."""
    for r in reports:
        assert r["lockstep_losses_equal"] and r["lockstep_params_equal"], r
        assert r["lockstep_staleness"] == [0.0, 0.0, 0.0]


@pytest.mark.slow
def test_staleness_1_on_two_ranks_samples_by_the_paced_version_and_trains(reports):
    """Batch j is sampled by version max(0, j − 1) on every rank (the ranks agree: each admits at the same step), the
    reward logged is the mean over both ranks' leaves (equal on both ranks: reduced in the trainers' threads), every
    parameter moves, the losses are finite, and no thread is left once `train()` returns."""
    for r in reports:
        assert r["stale_policy_version"] == [0.0, 0.0, 1.0]
        assert r["stale_staleness"] == [0.0, 1.0, 1.0]
        assert r["stale_all_changed"] and all(abs(x) < 1e6 for x in r["stale_losses"])
        assert not r["threads_left"], r["threads_left"]
    assert reports[0]["stale_rewards"] == reports[1]["stale_rewards"]
    assert reports[0]["stale_losses"] != reports[1]["stale_losses"]  # each rank trained its own share of trees
