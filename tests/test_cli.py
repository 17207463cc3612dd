"""The `trl-tree` console command: help for every method, a clear error otherwise, and what it hands accelerate."""

import json
import runpy
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from trl_tree import cli
from trl_tree.scripts import hotpot

REPO = Path(__file__).resolve().parent.parent
METHODS = ["treeopsd", "treepo", "at2po", "treeadv"]
# method -> (config, trainer) class names, and an option only that method's config has on top of TreeConfig's
EXPECTED = {
    "treeopsd": ("TreeOPSDConfig", "TreeOPSDTrainer"),
    "treepo": ("TreePOConfig", "TreePOTrainer"),
    "at2po": ("AT2POConfig", "AT2POTrainer"),
    "treeadv": ("TreeAdvConfig", "TreeAdvTrainer"),
}


def test_top_level_help_lists_the_methods(capsys):
    assert cli.main(["--help"]) == 0
    out = capsys.readouterr().out
    assert all(method in out for method in METHODS)
    assert "treeflex" not in cli.COMMANDS  # see the cli module docstring: no honest evaluation of the two-role agent
    assert "no `treeflex` command" in cli.__doc__


@pytest.mark.parametrize("method", METHODS)
def test_each_method_prints_its_training_arguments(method, capsys):
    with pytest.raises(SystemExit) as exit_info:
        cli.main([method, "--help"])
    assert exit_info.value.code == 0
    out = capsys.readouterr().out
    assert f"trl-tree {method}" in out
    for option in (
        "--num_initial_rollouts",
        "--num_branches",
        "--max_turns",
        "--dataset_name",
        "--retriever",
        "--warm_start_steps",
        "--use_peft",
        "--model_name_or_path",
    ):
        assert option in out
    own = {"at2po": ["--expansion_rounds", "--branches_per_round"], "treeadv": ["--entropy_threshold"]}
    for option in own.get(method, []):
        assert option in out


@pytest.mark.parametrize("method", METHODS)
def test_each_method_launches_its_script_which_trains_with_its_trainer(method, monkeypatch):
    """`trl-tree <method>` hands accelerate `scripts/<method>.py`; that script parses the method's config (with the
    offline defaults) and `main` picks the method's trainer class from it."""
    import trl_tree

    launched = []
    monkeypatch.setattr("accelerate.commands.launch.launch_command", launched.append)
    assert cli.main([method, "--max_steps", "1"]) == 0
    (args,) = launched
    assert Path(args.training_script) == REPO / "trl_tree" / "scripts" / f"{method}.py"

    parsed = []
    monkeypatch.setattr(hotpot, "main", lambda *a: parsed.append(a))
    monkeypatch.setattr(sys, "argv", [args.training_script, *args.training_script_args])
    runpy.run_path(args.training_script, run_name="__main__")
    ((script_args, training_args, model_args),) = parsed
    config_name, trainer_name = EXPECTED[method]
    assert type(training_args).__name__ == config_name and training_args.max_steps == 1
    assert training_args.output_dir == f"outputs/{method}-hotpot-offline" and script_args.warm_start_steps > 0
    config_class, trainer_class = hotpot.method_classes(method)
    assert type(training_args) is config_class
    assert trainer_class is getattr(trl_tree, trainer_name) and trainer_class.config_class is config_class


@pytest.mark.parametrize("method", METHODS)
def test_offline_defaults_share_treeopsds_tree_budget(method):
    """At most 12 leaves per prompt (4 complete trajectories + 8 continuations), whatever the method's own defaults
    (AT2PO's M = 2, L = 2, K = 6 would be 14)."""
    _, training_args, _ = hotpot.parse_args(method, [])
    assert training_args.num_initial_rollouts == 4 and training_args.leaves_per_tree == 12
    assert training_args.max_steps == hotpot.OFFLINE_TRAINING_DEFAULTS["max_steps"]
    if method == "at2po":
        assert (training_args.expansion_rounds, training_args.branches_per_round) == (2, 4)


def test_an_unknown_command_names_the_valid_ones(capsys):
    with pytest.raises(SystemExit) as exit_info:
        cli.main(["grpo"])
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert "unknown command 'grpo'" in err and "treeopsd, treepo, at2po, treeadv" in err


def test_a_typo_in_a_script_argument_fails_before_anything_is_launched(monkeypatch):
    launched = []
    monkeypatch.setattr("accelerate.commands.launch.launch_command", launched.append)
    with pytest.raises(SystemExit):
        cli.main(["treeopsd", "--num_branchez", "3"])
    assert not launched


def test_script_arguments_go_to_the_script_and_the_rest_to_accelerate(monkeypatch):
    launched = []
    monkeypatch.setattr("accelerate.commands.launch.launch_command", launched.append)
    assert cli.main(["treepo", "--num_processes", "1", "--max_steps", "1", "--accelerate_config", "multi_cpu"]) == 0
    (args,) = launched
    assert Path(args.training_script).name == "treepo.py"
    assert Path(args.training_script).parent == REPO / "trl_tree" / "scripts"
    assert args.training_script_args == ["--max_steps", "1"]
    assert args.num_processes == 1
    assert Path(args.config_file) == REPO / "trl_tree" / "accelerate_configs" / "multi_cpu.yaml"  # package data


def test_an_unknown_accelerate_config_lists_the_shipped_ones():
    with pytest.raises(SystemExit, match="multi_cpu"):
        cli.resolve_accelerate_config(["--accelerate_config", "nope"])


@pytest.mark.skipif(shutil.which("trl-tree") is None, reason="the package's console scripts are not installed")
def test_console_script_is_installed_and_runs():
    out = subprocess.run(["trl-tree", "--help"], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0 and "treeopsd" in out.stdout


@pytest.mark.parametrize(
    ("method", "tree"),
    [
        ("at2po", "--num_initial_rollouts 2 --expansion_rounds 1 --branches_per_round 1"),
        ("treeadv", "--num_initial_rollouts 2 --max_branches_per_tree 1 --min_segment_length 4"),
    ],
    ids=["at2po", "treeadv"],
)
def test_offline_run_of_a_new_method_trains_a_few_steps_and_saves_the_model(method, tree, tmp_path, monkeypatch):
    """`trl-tree at2po` / `treeadv`'s script end to end on the offline default (tiny model, synthetic world), shrunk
    like tests/test_train_hotpot.py shrinks TreeOPSD's: warm start, evaluation, a training step, save, evaluation
    (~10 s each on 2 cores)."""
    tiny = (
        "--num_train 4 --num_eval 2 --warm_start_steps 2 --warm_start_batch_size 2 --max_steps 1 "
        f"--per_device_train_batch_size 3 --steps_per_generation 1 {tree} --max_turns 2 --max_completion_length 48"
    ).split()
    out = tmp_path / "model"
    argv = [*tiny, "--output_dir", str(out), "--bm25_cache_dir", str(tmp_path / "bm25")]
    script = REPO / "trl_tree" / "scripts" / f"{method}.py"
    monkeypatch.setattr(sys, "argv", [str(script), *argv])
    runpy.run_path(str(script), run_name="__main__")  # what `accelerate launch` runs
    summary = json.loads((out / "hotpot_results.json").read_text())
    assert summary["method"] == {"at2po": "AT2PO", "treeadv": "TreeAdv"}[method] and summary["reward_curve"]
    assert summary["before"]["num_questions"] == summary["after"]["num_questions"] == 2
    assert (out / "model.safetensors").is_file()
