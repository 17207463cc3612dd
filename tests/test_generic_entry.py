"""`trl-tree <method>` on any dataset, as `trl grpo`: reward functions, tools and environments by import path, a
`--config` YAML, clear errors for bad import paths, and the accelerate configs found in an installed layout."""

import json
import re
import runpy
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

from trl_tree import cli
from trl_tree.scripts import generic, hotpot, script_for
from trl_tree.testing import tiny_model_path

REPO = Path(__file__).resolve().parent.parent

# A user's module next to where the command runs: a reward that records its calls, and an environment.
USER_MODULE = '''
calls = []


def short_answer(completions, answer, **kwargs):
    calls.append(len(completions))
    return [float(a in (c[-1].get("content") or "")) - 0.01 * len(c) for c, a in zip(completions, answer)]


class Counter:
    def reset(self, **kwargs):
        self.count = 0

    def increment(self, step: int) -> str:
        """Adds a step to the counter.

        Args:
            step: how much to add.
        """
        self.count += step
        return str(self.count)


not_callable = 3
'''


@pytest.fixture
def user_dir(tmp_path, monkeypatch):
    """A working directory holding `my_task.py` and a two-prompt JSONL dataset (conversational prompts + answers)."""
    (tmp_path / "my_task.py").write_text(textwrap.dedent(USER_MODULE))
    rows = [{"prompt": [{"role": "user", "content": f"What is {a} + {b}?"}], "answer": str(a + b)} for a, b in
            [(2, 3), (4, 5)]]  # fmt: skip
    (tmp_path / "data.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    monkeypatch.chdir(tmp_path)
    monkeypatch.delitem(sys.modules, "my_task", raising=False)
    yield tmp_path
    sys.modules.pop("my_task", None)


# (M, N) = (2, 1): 4 leaves, G = 3; one tree per micro-batch and per generation batch; short random turns
TINY_TREE = (
    "--num_initial_rollouts 2 --num_branches 1 --per_device_train_batch_size 3 --steps_per_generation 1 --max_steps 1 "
    "--max_turns 2 --max_completion_length 24 --report_to none --save_strategy no"
).split()


def _launched(monkeypatch, argv):
    """What `trl-tree` hands `accelerate launch` for `argv`: (script path, script arguments)."""
    launched = []
    monkeypatch.setattr("accelerate.commands.launch.launch_command", launched.append)
    assert cli.main(argv) == 0
    (args,) = launched
    return args.training_script, args.training_script_args


def test_treepo_trains_a_local_dataset_with_a_reward_and_an_environment_by_import_path(user_dir, monkeypatch):
    """`trl-tree treepo` end to end on a local JSONL file: validated by the command, then run as `accelerate launch`
    runs the script; the reward named by import path scores every leaf, the model is saved with a TreePOConfig."""
    out = user_dir / "out"
    argv = ["treepo", "--model_name_or_path", tiny_model_path(), "--dataset_name", "data.jsonl",
            "--reward_funcs", "my_task.short_answer", "--environment_factory", "my_task.Counter",
            *TINY_TREE, "--output_dir", str(out)]  # fmt: skip
    script, script_args = _launched(monkeypatch, argv)
    assert Path(script) == REPO / "trl_tree" / "scripts" / "train.py" and script_args[0] == "treepo"

    monkeypatch.setattr(sys, "argv", [script, *script_args])
    runpy.run_path(script, run_name="__main__")
    calls = sys.modules["my_task"].calls
    assert calls and all(n % 4 == 0 for n in calls)  # whole trees of K = M(N + 1) = 4 leaves
    assert (out / "model.safetensors").is_file()
    saved_args = torch.load(out / "training_args.bin", weights_only=False)
    assert type(saved_args).__name__ == "TreePOConfig" and saved_args.max_steps == 1


def test_a_config_file_naming_rewards_selects_the_generic_script_and_the_command_line_wins(user_dir):
    recipe = user_dir / "recipe.yaml"
    recipe.write_text(
        f"model_name_or_path: {tiny_model_path()}\ndataset_name: data.jsonl\nreward_funcs: [my_task.short_answer]\n"
        "tools: [trl_tree.testing.calculator]\nnum_branches: 1\nlearning_rate: 0.01\nmax_steps: 5\n"
    )
    argv = ["--config", str(recipe), "--max_steps", "2"]
    assert script_for(argv) is generic and script_for([f"--config={recipe}"]) is generic
    script_args, training_args, model_args, _ = generic.parse_args("at2po", argv)
    assert type(training_args).__name__ == "AT2POConfig"
    assert script_args.reward_funcs == ["my_task.short_answer"] and model_args.model_name_or_path == tiny_model_path()
    assert (training_args.num_branches, training_args.learning_rate, training_args.max_steps) == (1, 0.01, 2)
    assert [t.__name__ for t in generic.load_tools(script_args)] == ["calculator"]


def test_without_a_reward_tools_or_environment_the_command_is_the_hotpotqa_example(tmp_path):
    assert script_for([]) is hotpot
    assert script_for(["--dataset_name", "hotpotqa/hotpot_qa", "--max_steps", "3"]) is hotpot
    recipe = tmp_path / "recipe.yaml"
    recipe.write_text("max_steps: 3\n")
    assert script_for(["--config", str(recipe)]) is hotpot
    for name in generic.SELECTING_ARGUMENTS:
        assert script_for([f"--{name}", "x.y"]) is generic


@pytest.mark.parametrize(
    ("argument", "path", "message"),
    [
        ("--reward_funcs", "no_such_module.f1", "cannot import 'no_such_module'"),
        ("--reward_funcs", "my_task.missing", "module 'my_task' has no attribute 'missing'"),
        ("--reward_funcs", "f1", "'f1' is neither one of TRL's reward names (accuracy_reward, "),
        ("--tools", "my_task.not_callable", "must be a function or a list of functions"),
        ("--environment_factory", "my_task.nope", "has no attribute 'nope'"),
    ],
)
def test_a_bad_import_path_fails_before_the_launch_naming_the_argument(
    user_dir, monkeypatch, capsys, argument, path, message
):
    launched = []
    monkeypatch.setattr("accelerate.commands.launch.launch_command", launched.append)
    reward = [] if argument == "--reward_funcs" else ["--reward_funcs", "my_task.short_answer"]
    with pytest.raises(SystemExit) as exit_info:
        cli.main(["treeopsd", "--model_name_or_path", "m", "--dataset_name", "data.jsonl", *reward, argument, path])
    assert exit_info.value.code == 2 and not launched
    err = capsys.readouterr().err
    assert f"{argument}: " in err and message in err


@pytest.mark.parametrize(
    ("argv", "missing"),
    [
        (["--model_name_or_path", "m", "--dataset_name", "data.jsonl", "--tools", "x.y"], "No reward"),
        (["--dataset_name", "data.jsonl", "--reward_funcs", "my_task.short_answer"], "--model_name_or_path"),
        (["--model_name_or_path", "m", "--reward_funcs", "my_task.short_answer"], "No data"),
    ],
    ids=["reward", "model", "data"],
)
def test_a_missing_reward_model_or_dataset_is_named_before_the_launch(user_dir, argv, missing):
    with pytest.raises(ValueError, match=missing):
        generic.check_arguments(*generic.parse_args("treeopsd", argv))


def test_a_local_data_file_of_an_unknown_kind_is_named(user_dir):
    (user_dir / "data.txt").write_text("hello\n")
    script_args, _, _, dataset_args = generic.parse_args("treeopsd", ["--dataset_name", "data.txt"])
    with pytest.raises(ValueError, match=r"--dataset_name: cannot read 'data.txt'.*\.csv"):
        generic.load_data(script_args, dataset_args)


def test_help_of_either_form_lists_the_reward_options_and_only_the_examples_its_own(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    with pytest.raises(SystemExit):
        cli.main(["treepo", "--help"])
    out = capsys.readouterr().out
    assert "--reward_funcs accuracy_reward" in out and "--environment_factory" in out and "--retriever" in out
    with pytest.raises(SystemExit):
        cli.main(["treepo", "--reward_funcs", "x.y", "--help"])
    out = capsys.readouterr().out
    assert "--environment_factory" in out and "--tools" in out and "--retriever" not in out


def test_the_selecting_arguments_are_fields_of_the_generic_script():
    from dataclasses import fields

    assert set(generic.SELECTING_ARGUMENTS) <= {f.name for f in fields(generic.TreeScriptArguments)}


# ---------------------------------------------------------------------------------------------------------------
# TRL's short reward names
# ---------------------------------------------------------------------------------------------------------------


def test_trls_short_reward_names_are_the_functions_trl_grpo_trains_with():
    """Each short name `trl grpo` takes gives the function (or the factory's product) TRL's own `main` would use: a
    plain name is `trl.rewards`' function itself, and the overlong punishment has TRL's parameters."""
    import trl.rewards

    from trl_tree import trl_internals

    names = trl_internals.grpo_reward_names()
    assert {"accuracy_reward", "think_format_reward", "get_soft_overlong_punishment"} <= set(names)
    for name in names:
        function = generic.reward_function(name)
        assert callable(function)
        if name != "get_soft_overlong_punishment":
            assert function is getattr(trl.rewards, name)
    punishment = generic.reward_function("get_soft_overlong_punishment")
    assert (punishment.max_completion_len, punishment.soft_punish_cache) == (1280, 256)  # trl/scripts/grpo.py's
    assert generic.reward_function("trl.rewards.accuracy_reward") is trl.rewards.accuracy_reward  # paths still work


@pytest.mark.parametrize(
    ("name", "message"),
    [("accuracy_rewards", "Did you mean 'accuracy_reward'?"), ("think_format", "Did you mean 'think_format_reward'?"),
     ("bleu", "nor an import path")],
)  # fmt: skip
def test_an_unknown_short_reward_name_lists_trls_names(name, message):
    from trl_tree import trl_internals

    with pytest.raises(ValueError, match=re.escape(message)) as error:
        generic.reward_function(name)
    assert all(known in str(error.value) for known in trl_internals.grpo_reward_names())


def test_a_reward_whose_dependency_is_missing_is_named_before_the_launch_with_what_to_install(
    user_dir, monkeypatch, capsys
):
    """issue 59: accuracy_reward needs math_verify and raised only when first called, 21 s after the launch."""
    import trl.rewards.accuracy_rewards

    monkeypatch.setattr(trl.rewards.accuracy_rewards, "is_math_verify_available", lambda: False)
    launched = []
    monkeypatch.setattr("accelerate.commands.launch.launch_command", launched.append)
    with pytest.raises(SystemExit) as exit_info:
        cli.main(["treeopsd", "--model_name_or_path", "m", "--dataset_name", "data.jsonl", "--reward_funcs",
                  "accuracy_reward", "think_format_reward"])  # fmt: skip
    assert exit_info.value.code == 2 and not launched
    err = capsys.readouterr().err
    assert "--reward_funcs accuracy_reward needs the package `math_verify`" in err and "pip install math-verify" in err
    assert 'pip install "trl-tree[rewards]"' in err and "think_format_reward" not in err  # it needs nothing
    assert re.search(r'^rewards = \["math-verify', (REPO / "pyproject.toml").read_text(), re.MULTILINE)  # the extra


def test_a_failed_launch_returns_the_childs_exit_code_with_one_line_not_a_traceback(user_dir, monkeypatch, capsys):
    import subprocess

    def failing(namespace):
        raise subprocess.CalledProcessError(returncode=3, cmd=["python", namespace.training_script])

    monkeypatch.setattr("accelerate.commands.launch.launch_command", failing)
    argv = ["treeopsd", "--model_name_or_path", "m", "--dataset_name", "data.jsonl", "--reward_funcs", "my_task.short_answer"]
    assert cli.main(argv) == 3
    assert capsys.readouterr().err.splitlines() == [
        "trl-tree treeopsd: the training process exited with code 3; its error is the output just above (from the "
        "launched script, not from accelerate)."
    ]


def test_a_users_reward_is_checked_by_its_own_availability_helpers(user_dir):
    (user_dir / "needs_pkg.py").write_text(
        "def is_no_such_pkg_available():\n    return False\n\n\n"
        "def scored(completions, **kwargs):\n    if not is_no_such_pkg_available():\n        raise ImportError\n"
        "    return [0.0] * len(completions)\n"
    )
    try:
        with pytest.raises(ValueError, match=r"needs_pkg.scored needs the package `no_such_pkg`.*pip install no-such-pkg"):
            generic.check_arguments(*generic.parse_args("treeopsd", ["--model_name_or_path", "m", "--dataset_name",
                                                                      "data.jsonl", "--reward_funcs", "needs_pkg.scored"]))  # fmt: skip
    finally:
        sys.modules.pop("needs_pkg", None)


def test_a_short_reward_name_goes_to_the_script_as_given(user_dir, monkeypatch):
    argv = ["treepo", "--model_name_or_path", "m", "--dataset_name", "data.jsonl", "--reward_funcs", "accuracy_reward",
            "think_format_reward", "my_task.short_answer"]  # fmt: skip
    _, script_args = _launched(monkeypatch, argv)
    assert script_args == argv  # the method first, for the one training script, then the options as given
    parsed, *_ = generic.parse_args("treepo", script_args[1:])
    names = [getattr(f, "__name__", "") for f in generic.load_reward_funcs(parsed)]
    assert names == ["accuracy_reward", "think_format_reward", "short_answer"]


def test_without_trls_names_a_short_name_says_to_give_the_import_path(monkeypatch):
    from trl_tree import trl_internals

    monkeypatch.setattr(trl_internals, "REWARD_NAMES", ("trl.scripts.grpo", "main", "no_such_registry"))
    trl_internals._reward_registry.cache_clear()
    try:
        with pytest.raises(ValueError, match=r"cannot be read from the installed TRL.*'trl\.rewards\.accuracy_"):
            generic.reward_function("accuracy_reward")
        assert "trl.rewards.accuracy_reward" in generic.reward_names_text()
    finally:
        monkeypatch.undo()
        trl_internals._reward_registry.cache_clear()


def _installed_copy(site: Path) -> Path:
    """`trl_tree` as a wheel installs it: its Python modules plus the package data pyproject.toml declares."""
    from setuptools.config.pyprojecttoml import read_configuration

    config = read_configuration(REPO / "pyproject.toml")["tool"]["setuptools"]
    source = REPO / "trl_tree"
    files = set(source.rglob("*.py"))
    for pattern in config["package-data"]["trl_tree"]:
        files |= set(source.glob(pattern))
    for path in files:
        target = site / "trl_tree" / path.relative_to(source)
        target.parent.mkdir(parents=True, exist_ok=True)
        target.write_bytes(path.read_bytes())
    return site


def test_accelerate_configs_and_the_offline_recipe_resolve_in_an_installed_layout(tmp_path):
    """No source checkout around: `--accelerate_config NAME` and the offline defaults come from the package data."""
    site = _installed_copy(tmp_path / "site")
    code = (
        "import json; from trl_tree.cli import resolve_accelerate_config; "
        "from trl_tree.scripts.hotpot import OFFLINE_TRAINING_DEFAULTS; "
        "print(json.dumps([resolve_accelerate_config(['--accelerate_config', n]) for n in ('multi_cpu', 'fsdp2')] "
        "+ [OFFLINE_TRAINING_DEFAULTS['max_steps']]))"
    )
    out = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, capture_output=True, text=True, timeout=300,
                         env={"PYTHONPATH": str(site), "PATH": "/usr/bin:/bin"})  # fmt: skip
    assert out.returncode == 0, out.stderr
    *resolved, max_steps = json.loads(out.stdout.strip().splitlines()[-1])
    for (flag, path), name in zip(resolved, ("multi_cpu", "fsdp2")):
        assert flag == "--config_file" and Path(path) == site / "trl_tree" / "accelerate_configs" / f"{name}.yaml"
    assert max_steps == hotpot.OFFLINE_TRAINING_DEFAULTS["max_steps"]
