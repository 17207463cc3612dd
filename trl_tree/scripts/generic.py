"""Train any dataset with a tree method, as `trl grpo` trains one with GRPO: `trl-tree <method> --reward_funcs ...`.

    trl-tree treepo --model_name_or_path Qwen/Qwen3-0.6B --dataset_name my_org/my_prompts \\
        --reward_funcs my_pkg.rewards.f1 --tools my_pkg.tools.search
    trl-tree treeopsd --config my_recipe.yaml --environment_factory my_pkg.env.Env --accelerate_config multi_gpu

Everything is named on the command line or in the `--config` YAML, as in TRL's `trl/scripts/grpo.py`:

- the data: `--dataset_name` (a Hub id, a local folder, or a local `.json` / `.jsonl` / `.csv` / `.parquet` file),
  or a `datasets:` mixture in the YAML (TRL's `DatasetMixtureConfig`); a `prompt` column, plus any columns the
  reward functions read;
- the reward: `--reward_funcs` (TRL's short names as `trl grpo` takes them, such as `accuracy_reward` or
  `think_format_reward`, read from the installed TRL by `trl_tree.trl_internals.grpo_reward`; or import paths such
  as `trl.rewards.accuracy_reward` or `my_pkg.rewards.f1`) and/or `--reward_model_name_or_path`;
- tool use: `--tools` (import paths of functions, or of lists of functions) or `--environment_factory` (the import
  path of a class or function that returns a fresh environment), passed to the trainer as `tools=` and
  `environment_factory=`;
- the model (`--model_name_or_path`, PEFT through `--use_peft`), and every field of the method's config.

A module given by import path is looked up from the working directory too (as `trl grpo` does), so a file
`my_rewards.py` next to where the command runs is `--reward_funcs my_rewards.f1`.

`trl_tree.scripts.script_for` sends a command line here when it names a reward, tools or an environment; without
any, `trl-tree <method>` runs the HotpotQA example (`trl_tree.scripts.hotpot`) on its own data, and other data is an
error that says what to pass (`trl_tree.scripts.NoRewardError`).
"""

from __future__ import annotations

import difflib
import importlib
import os
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from trl import DatasetMixtureConfig, ModelConfig, ScriptArguments, TrlParser

from trl_tree.scripts import (
    SELECTING_ARGUMENTS,  # noqa: F401  (its fields that select it: `script_for`)
    resolve_model_name,
)
from trl_tree.scripts.hotpot import machine_defaults, method_config, trainer_class_for

# local data files, by suffix: the `datasets` builder that reads them
_FILE_BUILDERS = {".json": "json", ".jsonl": "json", ".csv": "csv", ".parquet": "parquet"}


@dataclass
class TreeScriptArguments(ScriptArguments):
    """Arguments of the generic training script, on top of TRL's `ScriptArguments` (dataset name, config, splits).

    Args:
        reward_funcs (`list[str]`, *optional*):
            Reward functions as `trl grpo` takes them: TRL's short names (`accuracy_reward`,
            `think_format_reward`, ...: `trl_tree.trl_internals.grpo_reward_names()`) or import paths
            (`module.function`, e.g. `trl.rewards.accuracy_reward` or `my_pkg.rewards.f1`).
        reward_model_name_or_path (`str`, *optional*):
            A reward model (Hub id or local folder), used with or instead of `reward_funcs`.
        tools (`list[str]`, *optional*):
            Import paths of tool functions, or of a list of them, passed as the trainer's `tools=`.
        environment_factory (`str`, *optional*):
            Import path of a class or function returning a fresh environment (its public methods are the tools),
            passed as the trainer's `environment_factory=`.
    """

    reward_funcs: list[str] | None = field(
        default=None,
        metadata={
            "help": "Reward functions: TRL's short names as `trl grpo` takes them (e.g. accuracy_reward, "
            "think_format_reward) or import paths (e.g. my_pkg.rewards.f1)."
        },
    )
    reward_model_name_or_path: str | None = field(
        default=None, metadata={"help": "Reward model id or local path (with or instead of --reward_funcs)."}
    )
    tools: list[str] | None = field(
        default=None,
        metadata={"help": "Tool functions (or lists of them) by import path, e.g. 'my_pkg.tools.search'."},
    )
    environment_factory: str | None = field(
        default=None, metadata={"help": "Environment class or factory by import path, e.g. 'my_pkg.env.Env'."}
    )


def make_parser(method: str = "treeopsd", prog: str | None = None) -> TrlParser:
    """`TreeScriptArguments`, the method's config, TRL's `ModelConfig` and `DatasetMixtureConfig` (as `trl grpo`)."""
    return TrlParser((TreeScriptArguments, method_config(method), ModelConfig, DatasetMixtureConfig), prog=prog)


def prepared_parser(method: str, argv: list[str], prog: str | None = None) -> TrlParser:
    """The method's parser with the machine's defaults (fp32 on a CPU-only machine) in place of the dataclass ones."""
    parser = make_parser(method, prog=prog)
    if not {"-h", "--help"} & set(argv):
        parser.set_defaults_with_config(**machine_defaults())
    return parser


def parse_args(method: str = "treeopsd", argv: list[str] | None = None, prog: str | None = None):
    """(script_args, training_args, model_args, dataset_args) from the command line and `--config`; the model
    `tiny` is the offline tiny model's folder (`trl_tree.scripts.resolve_model_name`)."""
    argv = list(sys.argv[1:] if argv is None else argv)
    parsed = prepared_parser(method, argv, prog=prog).parse_args_and_config(argv)
    script_args, training_args, model_args, dataset_args = parsed
    model_args.model_name_or_path = resolve_model_name(model_args.model_name_or_path)
    return script_args, training_args, model_args, dataset_args


# ---------------------------------------------------------------------------------------------------------------
# Import paths
# ---------------------------------------------------------------------------------------------------------------


def import_object(path: str, argument: str) -> Any:
    """The object at `path` (`package.module.name`); a bad path is a ValueError naming the `argument` it came from.

    The working directory is searched too, as `trl grpo` does, so that a module next to the command imports."""
    module_name, _, name = path.rpartition(".")
    if not module_name or not name:
        raise ValueError(
            f"{argument}: {path!r} is not an import path; expected 'package.module.name' (e.g. "
            "'trl.rewards.accuracy_reward', or 'my_rewards.f1' for a my_rewards.py in the working directory)."
        )
    if os.getcwd() not in sys.path:
        sys.path.insert(0, os.getcwd())
    try:
        module = importlib.import_module(module_name)
    except ImportError as error:
        raise ValueError(f"{argument}: cannot import {module_name!r} (from {path!r}): {error}") from error
    if not hasattr(module, name):
        raise ValueError(f"{argument}: module {module_name!r} has no attribute {name!r} (from {path!r}).")
    return getattr(module, name)


def reward_names_text() -> str:
    """TRL's short reward names for a message, or what to write instead when the installed TRL's cannot be read."""
    from trl_tree import trl_internals

    try:
        return "one of TRL's " + ", ".join(trl_internals.grpo_reward_names())
    except LookupError:
        return "an import path of TRL's, e.g. trl.rewards.accuracy_reward"


def reward_function(name: str):
    """`--reward_funcs NAME` as `trl grpo` reads it: one of TRL's short names (which have no dot), else an import path.
    An unknown short name is a ValueError listing TRL's, and the closest one."""
    from trl_tree import trl_internals

    if "." in name:
        function = import_object(name, "--reward_funcs")
        if not callable(function):
            raise ValueError(f"--reward_funcs: {name!r} is a {type(function).__name__}, not a function.")
        return function
    try:
        names = trl_internals.grpo_reward_names()
    except LookupError as error:
        raise ValueError(
            f"--reward_funcs: {name!r} is not an import path ('package.module.name'), and TRL's short reward names "
            f"cannot be read from the installed TRL ({error}); give the import path, e.g. 'trl.rewards.{name}'."
        ) from error
    if name in names:
        return trl_internals.grpo_reward(name)
    close = difflib.get_close_matches(name, names, n=1)
    raise ValueError(
        f"--reward_funcs: {name!r} is neither one of TRL's reward names ({', '.join(names)}) nor an import path "
        "'package.module.name' (e.g. 'my_rewards.f1' for a my_rewards.py in the working directory)."
        + (f" Did you mean {close[0]!r}?" if close else "")
    )


def load_reward_funcs(script_args: TreeScriptArguments) -> list:
    """The reward model (by name, loaded by the trainer) and the reward functions, in that order."""
    rewards: list = [script_args.reward_model_name_or_path] if script_args.reward_model_name_or_path else []
    functions = [reward_function(name) for name in script_args.reward_funcs or []]
    problem = reward_dependency_problems(list(script_args.reward_funcs or []), functions)
    if problem is not None:
        raise ValueError(problem)
    rewards += functions
    if not rewards:
        raise ValueError(
            "No reward: give --reward_funcs (TRL's short names such as accuracy_reward, or import paths of reward "
            "functions) and/or --reward_model_name_or_path."
        )
    return rewards


REWARDS_EXTRA = "trl-tree[rewards]"  # pyproject.toml: the packages TRL's own reward functions import when called


def missing_packages(function) -> list[str]:
    """The modules `function` checks for with an `is_<module>_available()` helper that report False: the convention
    of TRL and transformers for optional dependencies (`accuracy_reward` calls `is_math_verify_available()` and raises
    ImportError only when first called, after the launch and the model load). Nested functions' code is searched too;
    a callable object is read through its `__call__`."""
    target = function if hasattr(function, "__code__") else type(function).__call__
    code, namespace = getattr(target, "__code__", None), getattr(target, "__globals__", {})
    if code is None:
        return []
    names, todo = set(), [code]
    while todo:
        current = todo.pop()
        names |= set(current.co_names)
        todo += [c for c in current.co_consts if hasattr(c, "co_names")]
    missing = []
    for name in sorted(names):
        check = namespace.get(name)
        if not (name.startswith("is_") and name.endswith("_available") and callable(check)):
            continue
        try:
            available = check()
        except Exception:  # noqa: BLE001 - a check that cannot answer is not evidence of a missing package
            continue
        if available is False:
            missing.append(name.removeprefix("is_").removesuffix("_available"))
    return missing


def reward_dependency_problems(names: list[str], rewards: list) -> str | None:
    """The named reward functions whose optional dependencies are not installed (`missing_packages`), with the pip
    line that installs them; None when every one can run. Checked before the launch, where the error otherwise came
    21 s later, from the first reward call, under accelerate's traceback."""
    problems = []
    for name, function in zip(names, rewards, strict=True):
        for module in missing_packages(function):
            problems.append(f"--reward_funcs {name} needs the package `{module}`, which is not installed: "
                            f"pip install {module.replace('_', '-')}")  # fmt: skip
    if not problems:
        return None
    return "; ".join(problems) + f' (or pip install "{REWARDS_EXTRA}", which brings what TRL\'s rewards need).'


def load_tools(script_args: TreeScriptArguments) -> list | None:
    """The tool functions; a path may name one function or a list / tuple of them."""
    tools = []
    for path in script_args.tools or []:
        found = import_object(path, "--tools")
        found = list(found) if isinstance(found, list | tuple) else [found]
        if not all(callable(tool) for tool in found):
            raise ValueError(f"--tools: {path!r} must be a function or a list of functions.")
        tools += found
    return tools or None


def load_environment_factory(script_args: TreeScriptArguments):
    if script_args.environment_factory is None:
        return None
    factory = import_object(script_args.environment_factory, "--environment_factory")
    if not callable(factory):
        raise ValueError(
            f"--environment_factory: {script_args.environment_factory!r} must be a class or a function that returns "
            "a fresh environment."
        )
    return factory


def check_arguments(script_args: TreeScriptArguments, training_args, model_args: ModelConfig, dataset_args) -> None:
    """Import every object the arguments name and check that a model and data are given, so that a typo fails before
    anything is launched (`trl-tree` calls this; `main` meets the same errors)."""
    _require_model_and_data(script_args, model_args, dataset_args)
    rewards = load_reward_funcs(script_args)
    load_tools(script_args)
    load_environment_factory(script_args)
    _check_completion_format(script_args, dataset_args, rewards)


def _check_completion_format(script_args: TreeScriptArguments, dataset_args, rewards: list) -> None:
    """A reward function that reads chat messages on a local data file of plain-string prompts is refused here, before
    the launch (`rewards.completion_format_problem`; the trainer refuses it too, after the launch, for Hub data)."""
    from trl_tree.rewards import completion_format_problem

    conversational = _local_data_is_conversational(script_args, dataset_args)
    names = [getattr(f, "__name__", str(f)) for f in rewards]
    problem = completion_format_problem(rewards, names, conversational is not False)
    if problem is not None:
        raise ValueError(f"--dataset_name {script_args.dataset_name}: {problem}")


def _local_data_is_conversational(script_args: TreeScriptArguments, dataset_args) -> bool | None:
    """Whether the first training row of a local data file or folder has chat-message prompts (streamed: only that
    row is read); None for Hub data and `datasets:` mixtures, which are not fetched before the launch."""
    from trl.data_utils import is_conversational

    path = None if dataset_args.datasets or script_args.dataset_name is None else Path(script_args.dataset_name)
    if path is None or not path.exists() or (path.is_file() and path.suffix not in _FILE_BUILDERS):
        return None
    from datasets import load_dataset

    try:
        if path.is_file():
            data = load_dataset(
                _FILE_BUILDERS[path.suffix], data_files={"train": str(path)}, split="train", streaming=True
            )
        else:
            data = load_dataset(
                str(path), name=script_args.dataset_config, split=script_args.dataset_train_split, streaming=True
            )
        row = next(iter(data), None)
    except Exception:  # noqa: BLE001 - data that does not read is the launched script's to report, as before
        return None
    return None if not isinstance(row, dict) or "prompt" not in row else is_conversational({"prompt": row["prompt"]})


def _require_model_and_data(script_args: TreeScriptArguments, model_args: ModelConfig, dataset_args) -> None:
    if model_args.model_name_or_path is None:
        raise ValueError(
            "--model_name_or_path is required: the Hub id or local folder of the policy to train (`tiny`: the "
            "offline 2-layer Qwen3 of trl_tree.testing, for trying a command without a download)."
        )
    if script_args.dataset_name is None and not dataset_args.datasets:
        raise ValueError(
            "No data: give --dataset_name (a Hub id, a folder or a data file) or `datasets:` in --config."
        )


# ---------------------------------------------------------------------------------------------------------------
# Data and entry point
# ---------------------------------------------------------------------------------------------------------------


def load_data(script_args: TreeScriptArguments, dataset_args: DatasetMixtureConfig):
    """The `DatasetDict` to train (and evaluate) on: a `datasets:` mixture, a local data file, or a Hub id / folder."""
    from datasets import load_dataset
    from trl import get_dataset

    if dataset_args.datasets:
        return get_dataset(dataset_args)
    path = Path(script_args.dataset_name)
    if path.is_file():
        if path.suffix not in _FILE_BUILDERS:
            raise ValueError(
                f"--dataset_name: cannot read {path.name!r}; a local data file must end in one of "
                f"{sorted(_FILE_BUILDERS)}."
            )
        return load_dataset(_FILE_BUILDERS[path.suffix], data_files={script_args.dataset_train_split: str(path)})
    return load_dataset(
        script_args.dataset_name, name=script_args.dataset_config, streaming=script_args.dataset_streaming
    )


def _model_init_kwargs(model_args: ModelConfig, training_args) -> dict[str, Any]:
    """What `trl grpo` passes to `from_pretrained`, with the config's own `model_init_kwargs` winning."""
    kwargs = {
        "revision": model_args.model_revision,
        "trust_remote_code": training_args.trust_remote_code,
        "attn_implementation": model_args.attn_implementation,
        "dtype": model_args.dtype,
    }
    return {**kwargs, **(training_args.model_init_kwargs or {})}


def main(script_args: TreeScriptArguments, training_args, model_args: ModelConfig, dataset_args: DatasetMixtureConfig):
    """Train the method of `training_args`' type on the data with the rewards and tools named, save (and push)."""
    from trl import get_peft_config, get_quantization_config

    _require_model_and_data(script_args, model_args, dataset_args)
    trainer_class = trainer_class_for(training_args)
    reward_funcs = load_reward_funcs(script_args)
    tools, environment_factory = load_tools(script_args), load_environment_factory(script_args)
    dataset = load_data(script_args, dataset_args)
    training_args.model_init_kwargs = _model_init_kwargs(model_args, training_args)

    trainer = trainer_class(
        model=model_args.model_name_or_path,
        reward_funcs=reward_funcs,
        args=training_args,
        train_dataset=dataset[script_args.dataset_train_split],
        eval_dataset=dataset[script_args.dataset_test_split] if training_args.eval_strategy != "no" else None,
        quantization_config=get_quantization_config(model_args),
        peft_config=get_peft_config(model_args),
        tools=tools,
        environment_factory=environment_factory,
    )
    trainer.train(resume_from_checkpoint=training_args.resume_from_checkpoint)
    trainer.save_model(training_args.output_dir)
    trainer.accelerator.print(f"[trl-tree] {trainer_class.__name__}: model saved to {training_args.output_dir}")
    if training_args.push_to_hub:
        trainer.push_to_hub(dataset_name=script_args.dataset_name)
    trainer.end()  # every process waits for the others, then the trackers finish and the process group goes
    return trainer


def run(method: str = "treeopsd", argv: list[str] | None = None, prog: str | None = None):
    """The command-line entry point: parse the command line (and `--config`) for `method`, then `main`."""
    return main(*parse_args(method, argv, prog=prog))
