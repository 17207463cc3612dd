"""The `trl-tree` console command: help for every method, a clear error otherwise, and what it hands accelerate."""

import shutil
import subprocess
from pathlib import Path

import pytest

from trl_tree import cli

REPO = Path(__file__).resolve().parent.parent


def test_top_level_help_lists_the_methods(capsys):
    assert cli.main(["--help"]) == 0
    out = capsys.readouterr().out
    assert "treeopsd" in out and "treepo" in out


@pytest.mark.parametrize("method", ["treeopsd", "treepo"])
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


def test_an_unknown_command_names_the_valid_ones(capsys):
    with pytest.raises(SystemExit) as exit_info:
        cli.main(["grpo"])
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert "unknown command 'grpo'" in err and "treeopsd, treepo" in err


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
    assert Path(args.config_file) == REPO / "accelerate_configs" / "multi_cpu.yaml"


def test_an_unknown_accelerate_config_lists_the_shipped_ones():
    with pytest.raises(SystemExit, match="multi_cpu"):
        cli.resolve_accelerate_config(["--accelerate_config", "nope"])


@pytest.mark.skipif(shutil.which("trl-tree") is None, reason="the package's console scripts are not installed")
def test_console_script_is_installed_and_runs():
    out = subprocess.run(["trl-tree", "--help"], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0 and "treeopsd" in out.stdout
