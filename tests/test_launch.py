"""Launched runs: 2 processes, LoRA and DeepSpeed ZeRO on CPU (docs/design.md §7), a few TreeOPSD steps each.

Each run warm-starts the tiny model on calculator conversations and trains two optimizer blocks; it must finish on
every rank, change every trainable parameter and log the tree metrics.
"""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

SCRIPT = Path(__file__).parent / "launch" / "tiny_tree_run.py"
EXPECTED_METRICS = {
    "reward", "reward_std", "tree/leaves_per_tree", "tree/unique_turns", "tree/unique_tokens", "tree/flat_tokens",
    "tree/turns_per_leaf", "treeopsd/abs_q_minus_half", "treeopsd/abs_p_minus_q/block_0",
    "treeopsd/abs_p_minus_q/block_1", "tools/call_frequency", "tools/failure_frequency",
}

DEEPSPEED = """compute_environment: LOCAL_MACHINE
distributed_type: DEEPSPEED
deepspeed_config:
  zero_stage: {stage}
  offload_optimizer_device: none
  offload_param_device: none
  zero3_init_flag: false
mixed_precision: 'no'
num_machines: 1
num_processes: {processes}
use_cpu: true
"""


def _launch(tmp_path, launch_args, *script_args, timeout=600):
    env = {**os.environ, "TORCH_EXTENSIONS_DIR": str(tmp_path / "torch_ext"), "OMP_NUM_THREADS": "1",
           "TRL_EXPERIMENTAL_SILENCE": "1", "CI": "true"}
    cmd = [sys.executable, "-m", "accelerate.commands.launch", *launch_args, str(SCRIPT), str(tmp_path / "out"),
           *script_args]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=env)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    return [json.loads(p.read_text()) for p in sorted((tmp_path / "out").glob("report-rank*.json"))]


# GRPO's metrics, reduced over the ranks (clip_ratio/* for the losses that clip)
GRPO_METRICS = {"frac_reward_zero_std", "num_tokens", "entropy", "completions/clipped_ratio", "completions/min_length"}
CLIP_RATIO = {"clip_ratio/low_mean", "clip_ratio/low_min", "clip_ratio/high_max", "clip_ratio/region_mean"}


def _check(reports, world, method="treeopsd"):
    assert sorted(r["rank"] for r in reports) == list(range(world))
    expected = {
        "treeopsd": EXPECTED_METRICS,
        "treeflex": {"reward", "reward_std"},  # searches of blocks, not one tree per prompt
        "treeflex_uneven": {"reward", "reward_std"},
    }.get(method, {"reward", "tree/leaves_per_tree", "tree/unique_tokens"})
    expected = expected | GRPO_METRICS | (CLIP_RATIO if method != "treeopsd" else set())
    for r in reports:
        assert r["world"] == world
        assert r["all_changed"], r
        assert expected <= set(r["metrics"]), expected - set(r["metrics"])


@pytest.mark.slow
@pytest.mark.parametrize("method", ["treeopsd", "at2po", "treeadv", "treeflex", "treeflex_uneven"])
def test_two_processes_on_cpu(tmp_path, method):
    """Every method on two processes; "treeflex_uneven": the ranks return different numbers of searches."""
    reports = _launch(tmp_path, ["--multi_gpu", "--num_processes", "2", "--num_machines", "1"], method)
    _check(reports, world=2, method=method)


@pytest.mark.slow
def test_lora(tmp_path):
    _check(_launch(tmp_path, ["--num_processes", "1"], "lora"), world=1)


@pytest.mark.slow
@pytest.mark.parametrize("stage", [2, 3])
def test_deepspeed_zero_on_cpu(tmp_path, stage):
    pytest.importorskip("deepspeed")
    config = tmp_path / "ds.yaml"
    config.write_text(DEEPSPEED.format(stage=stage, processes=2))
    _check(_launch(tmp_path, ["--config_file", str(config)]), world=2)


def _recording_trainer(calls):
    """A TreeOPSDTrainer with only what `end` touches: the accelerator's barrier, cleanup and teardown, recorded."""
    from types import SimpleNamespace

    from trl_tree import TreeOPSDTrainer

    trainer = object.__new__(TreeOPSDTrainer)
    trainer.model, trainer.model_wrapped = "model", "ddp(model)"
    trainer.accelerator = SimpleNamespace(
        wait_for_everyone=lambda: calls.append("wait"),
        free_memory=lambda: calls.append(("free", trainer.model_wrapped)),
        end_training=lambda: calls.append("end"),
    )
    return trainer


def test_end_waits_for_every_process_and_drops_the_ddp_wrapper_before_the_group_goes():
    calls = []
    _recording_trainer(calls).end()
    assert calls == ["wait", ("free", "model"), "end"]


def test_end_works_on_a_transformers_without_trainer_end(monkeypatch):
    import transformers

    monkeypatch.delattr(transformers.Trainer, "end", raising=False)
    calls = []
    _recording_trainer(calls).end()
    assert calls == ["wait", ("free", "model"), "end"]
