"""Training scripts behind `examples/` and the `trl-tree` console command.

`trl-tree <method>` launches `train.py METHOD` (one entry for every method of `trl_tree.methods.METHODS`), which runs
one of two scripts with the method's config and trainer (`script_for` picks it):

- `generic`: any dataset, with reward functions, tools or an environment factory given by import path (or TRL's short
  reward names), as `trl grpo` trains one; chosen when the command line or its `--config` YAML names any of them
  (`SELECTING_ARGUMENTS`);
- `hotpot`: otherwise, the HotpotQA search agent (also `examples/train_hotpot.py`): offline by default. It runs only on
  its own data: none named (the offline synthetic world), HotpotQA's Hub id `hotpotqa/hotpot_qa`, or any data when the
  command line or YAML also sets one of the example's own options (`example_options()`: `--retriever`,
  `--warm_start_steps`, ...; how a recipe such as `examples/recipes/treeopsd_hotpot_qwen3_4b.yaml`, or a local copy
  of HotpotQA, says it is the example). Other data without a reward is an error (`NoRewardError`): the example's
  reward and prompt would run on columns the user's data does not have. A method that declares why it cannot run
  the example (`Method.example_unfit`, TreeFlex) runs only the generic script (`check_method_form`).
"""

from __future__ import annotations

from types import ModuleType
from typing import Any

# the fields of the generic script that select it (`generic.TreeScriptArguments`): the HotpotQA example has none
SELECTING_ARGUMENTS = ("reward_funcs", "reward_model_name_or_path", "tools", "environment_factory")

# the example's own dataset: the HotpotQA example trains on it (or offline, on no dataset) without being told more
HOTPOT_DATASET = "hotpotqa/hotpot_qa"


# The offline tiny model (`trl_tree.testing.tiny_model_path()`: a 2-layer Qwen3 built locally, no download) by a name
# the command line takes, `--model_name_or_path tiny`, in both forms; a local folder of that name still wins.
TINY_MODEL_NAME = "tiny"


def is_tiny_model_name(name: str | None) -> bool:
    """Whether `name` is `TINY_MODEL_NAME` and not a local folder: the offline tiny model."""
    from pathlib import Path

    return name == TINY_MODEL_NAME and not Path(name).exists()


def resolve_model_name(name: str | None) -> str | None:
    """`name`, or the folder of the offline tiny model (built on first use) when `name` is `TINY_MODEL_NAME`."""
    if not is_tiny_model_name(name):
        return name
    from trl_tree.testing import tiny_model_path

    return tiny_model_path()


class NoRewardError(ValueError):
    """User data named without a reward, tools or an environment (see the module docstring)."""


def config_file(argv: list[str]) -> str | None:
    """The path after `--config` (or in `--config=PATH`), as TrlParser reads it; None without one."""
    path = next((a.split("=", 1)[1] for a in argv if a.startswith("--config=")), None)
    if path is None and "--config" in argv[:-1]:
        path = argv[argv.index("--config") + 1]
    return path


def config_file_content(argv: list[str]) -> dict[str, Any]:
    """The top-level mapping of the `--config` YAML in `argv` (empty without one; a missing or malformed file is the
    parser's error, reported when it reads the file)."""
    path = config_file(argv)
    if path is None:
        return {}
    import yaml

    try:
        with open(path) as f:
            content = yaml.safe_load(f)
    except (OSError, yaml.YAMLError):
        return {}
    return content if isinstance(content, dict) else {}


def _option_name(arg: str) -> str:
    # HfArgumentParser accepts `--reward-funcs` for `--reward_funcs`: both name the same field
    return arg[2:].split("=", 1)[0].replace("-", "_")


def named_options(argv: list[str]) -> set[str]:
    """The fields `argv` sets: its `--options` (dashes read as underscores) and the keys of its `--config` YAML."""
    return {_option_name(a) for a in argv if a.startswith("--")} | set(config_file_content(argv))


def _value(argv: list[str], name: str) -> Any:
    """The value `argv` gives the field `name`: its command line's (which wins, as in TrlParser), else its YAML's."""
    for i, arg in enumerate(argv):
        if arg.startswith("--") and _option_name(arg) == name:
            if "=" in arg:
                return arg.split("=", 1)[1]
            return argv[i + 1] if i + 1 < len(argv) else None
    return config_file_content(argv).get(name)


def names_generic(argv: list[str]) -> bool:
    """Whether `argv` (or its `--config` file) names a reward, tools or an environment: the generic script's form."""
    return bool(named_options(argv) & set(SELECTING_ARGUMENTS))


def example_options() -> set[str]:
    """The HotpotQA example's own fields (retrieval, warm start, reward threshold, ...): those of its script
    arguments that TRL's `ScriptArguments` (dataset name, splits, ...) does not have."""
    from dataclasses import fields

    from trl import ScriptArguments

    from trl_tree.scripts.hotpot import HotpotScriptArguments

    return {f.name for f in fields(HotpotScriptArguments)} - {f.name for f in fields(ScriptArguments)}


def user_data(argv: list[str]) -> str | None:
    """The data `argv` names that is not the HotpotQA example's own (`--dataset_name` other than HotpotQA's Hub id, or
    a `datasets:` mixture in the YAML), unless `argv` also sets one of the example's own options; else None."""
    named = named_options(argv)
    if named & example_options():
        return None
    if "datasets" in named:
        return "the `datasets:` mixture of --config"
    dataset = _value(argv, "dataset_name")
    return None if dataset in (None, HOTPOT_DATASET) else f"--dataset_name {dataset}"


def no_reward_message(data: str) -> str:
    from trl_tree.scripts.generic import reward_names_text

    return (
        f"{data} is given without a reward. Name one with --reward_funcs ({reward_names_text()}, or an import path "
        "such as my_pkg.rewards.f1) or --reward_model_name_or_path, and add --tools or --environment_factory for tool "
        f"use. Without any of them the command is the HotpotQA example, which trains on {HOTPOT_DATASET}, offline "
        "data (no --dataset_name), or a local copy of HotpotQA together with one of its own options (e.g. "
        "--retriever bm25)."
    )


def form_for(argv: list[str]) -> ModuleType:
    """The script whose options `argv` is written in: `generic` when it (or its `--config` file) names a reward, tools
    or an environment, else `hotpot` (which `check_data` then checks is given its own data)."""
    from trl_tree.scripts import generic, hotpot

    return generic if names_generic(argv) else hotpot


def check_method_form(method: str, argv: list[str]) -> None:
    """A `ValueError` with the method's own reason (`trl_tree.methods.Method.example_unfit`) when `argv` is the
    HotpotQA example's form (no reward, tools or environment named) and the method cannot run that example."""
    from trl_tree import methods

    unfit = methods.METHODS[method].example_unfit
    if unfit and not names_generic(argv):
        raise ValueError(f"{method} has no HotpotQA example form: {unfit}.")


def check_data(argv: list[str]) -> None:
    """A `NoRewardError` saying what to pass when `argv` is the HotpotQA example's form but names other data."""
    data = None if names_generic(argv) else user_data(argv)
    if data is not None:
        raise NoRewardError(no_reward_message(data))


def script_for(argv: list[str]) -> ModuleType:
    """`generic` when `argv` (or its `--config` file) names a reward, tools or an environment; `hotpot` when it names
    no data or the example's (module docstring); else a `NoRewardError` that says what to pass."""
    check_data(argv)
    return form_for(argv)


def run(method: str, argv: list[str] | None = None, prog: str | None = None) -> Any:
    """What `trl-tree <method>` runs once launched: the script `script_for` picks, on the command line."""
    import sys

    argv = list(sys.argv[1:] if argv is None else argv)
    check_method_form(method, argv)
    return script_for(argv).run(method, argv, prog=prog)
