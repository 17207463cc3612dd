"""The `trl-tree` console command, in the style of `trl grpo`: `trl-tree <method> [accelerate args] [script args]`.

    trl-tree treeopsd                                   # the offline default of examples/train_hotpot.py
    trl-tree treepo --model_name_or_path Qwen/Qwen3-0.6B --dataset_name my_org/my_prompts \\
        --reward_funcs my_pkg.rewards.f1 --tools my_pkg.tools.search     # any dataset, rewards and tools by import path
    trl-tree treeopsd --model_name_or_path Qwen/Qwen3-0.6B --dataset_name my_org/math --reward_funcs accuracy_reward
    trl-tree at2po --config my_recipe.yaml --environment_factory my_pkg.env.Env --accelerate_config multi_gpu
    trl-tree treeopsd --config examples/recipes/treeopsd_hotpot_qwen3_4b.yaml --accelerate_config deepspeed_zero3
    trl-tree treeadv --entropy_threshold 0.8 --max_branches_per_tree 3
    trl-tree view RUN_DIR                               # render the run's saved rollout-tree pages again
    trl-tree retrieval-server --corpus_path wiki.jsonl --port 8000   # serve search (Search-R1's API) to runs

Every method of the table (`trl_tree.methods.METHODS`) is a command: it runs the one script `trl_tree/scripts/train.py`
through `accelerate launch`, given the method's name first, with the method's config and trainer.
Which script, by one rule (`trl_tree.scripts.script_for`):

- a reward, tools or an environment named (`--reward_funcs`, `--reward_model_name_or_path`, `--tools`,
  `--environment_factory`, on the command line or in the `--config` YAML): the generic script, on the data given
  (`trl_tree.scripts.generic`, as `trl grpo`). `--reward_funcs` takes TRL's short names as `trl grpo` does
  (`accuracy_reward`, `think_format_reward`, ...: read from the installed TRL, `trl_internals.grpo_reward_names`) and
  import paths;
- none of them: the HotpotQA search agent (`trl_tree.scripts.hotpot`, the entry point of `examples/train_hotpot.py`),
  but only on its own data: no dataset (offline, the default), HotpotQA's Hub id `hotpotqa/hotpot_qa`, or any
  `--dataset_name` together with one of the example's own options (`--retriever`, `--warm_start_steps`, ...), as
  the recipe `examples/recipes/treeopsd_hotpot_qwen3_4b.yaml` has and as a local copy of HotpotQA needs. Other data
  without a reward is an error, before anything launches, that says what to pass: run as the example, the user's
  data would fail much later on a column it does not have (`question`), far from the cause.

Before anything is launched the command also checks that every key of the `--config` YAML is a field of the script
and every command-line option the script's or `accelerate launch`'s: an unknown one is named with the closest field
(difflib), an option of the other form is said to be one, and an accelerate option in the YAML is sent to the command
line (the launched script reads the YAML again and rejects keys it lacks, so TrlParser's passing them on to the
launcher failed only after the launch). It imports the objects the generic form names, too. Options the script does not know and accelerate does (`--num_processes`,
`--config_file`, `--mixed_precision`, ...) go to `accelerate launch`; `--accelerate_config NAME_OR_PATH` picks one of
the configs shipped in `trl_tree/accelerate_configs/` by name, or a file.

`trl-tree <method> --help` is short: what every run needs first (the model, the data, `--reward_funcs`, `--tools` and
`--environment_factory` always; then common training fields: output directory, learning rate, batch sizes, ...), then
the method's own fields, grouped as the method table declares them (tree sampler, credit, loss), and, in the HotpotQA
form, the example's own options (`help_groups`); GRPO options the trainers refuse unless left at their default
(`--beta`) are left out. `--help-all` lists every field of both forms, the refused ones marked. Building either imports the method's config class (transformers'
`TrainingArguments` and peft: about 4 of the 6-7 seconds a first `--help` takes on 2 busy cores), so the text is kept
on disk under a key of everything it depends on (`help_cache_file`) and the next `--help` takes what importing
trl_tree does (about 2 seconds).

In the HotpotQA form every method trains the same search agent (`trl_tree.scripts.hotpot`): same data, retriever,
reward, warm start and before/after evaluation; only the config and trainer class differ. Their offline defaults share
one tree budget, at most 12 leaves per prompt (4 complete trajectories and 8 continuations): TreeOPSD/TreePO (M, N) =
(4, 2), AT2PO M = 4 with 2 rounds of 4 branches (its library default, M = 2 and 2 rounds of 6, costs the same G = 8 in 14 leaves),
TreeAdv 4 trees of at most 1 + 2 leaves (the recipe `trl_tree/recipes/hotpot_offline.yaml`).

`view` is no training method and runs in this process, without accelerate: it reads the data that a run with
`log_completions=True` saved under `OUTPUT_DIR/tree_view/` and writes the HTML pages again
(`trl_tree.tree_view.render_run`). Nor is `retrieval-server`, which serves BM25 (or dense) search over a corpus with
Search-R1's HTTP API until stopped (`trl_tree.envs.retrieval_server`), for `--retriever remote --retriever_url URL`.

A method that declares why the HotpotQA example cannot train it (`Method.example_unfit`: TreeFlex, whose two-role
agent the example neither warm-starts nor evaluates) runs the generic form only: `trl-tree treeflex` without a reward
is refused with that reason, and its help lists the generic form's options.
"""

from __future__ import annotations

import argparse
import copy
import difflib
import functools
import hashlib
import importlib.resources
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path
from types import ModuleType
from typing import NoReturn

from trl_tree import methods


def commands() -> dict[str, str]:
    """The training commands → their help line: every method of the table, read when asked (a method registered
    after import is a command too)."""
    return {name: f"Train with {m.title} ({m.summary})." for name, m in methods.METHODS.items()}


# the one script `accelerate launch` runs for every method, given the method's name first (`scripts/train.py`)
TRAINING_SCRIPT = "train.py"
VIEW_HELP = "Render the rollout-tree pages of a run again from its saved data (OUTPUT_DIR/tree_view/*.json)."
RETRIEVAL_SERVER_HELP = "Serve BM25 search over a corpus with Search-R1's HTTP API, for --retriever remote."
TOOL_COMMANDS = ("view", "retrieval-server")  # the commands that are no training method, run in this process
_USAGE_EPILOG = (
    "Each command trains any dataset with reward functions (TRL's short names or import paths; tools or an "
    "environment factory by import path), e.g. `trl-tree treepo --model_name_or_path MODEL --dataset_name DATA "
    "--reward_funcs accuracy_reward`, or without them the HotpotQA search agent (offline by default)."
)


def _build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="trl-tree",
        description="Tree-structured agentic RL on top of TRL. Run `trl-tree <command> --help` for a command's options.",
        epilog=_USAGE_EPILOG,
        allow_abbrev=False,
    )
    subparsers = parser.add_subparsers(dest="command", metavar="{" + ",".join([*commands(), *TOOL_COMMANDS]) + "}")
    for name, help_text in commands().items():
        subparsers.add_parser(name, help=help_text, add_help=False)  # the script's own parser prints its help
    _add_view_arguments(subparsers.add_parser("view", help=VIEW_HELP, description=VIEW_HELP))
    subparsers.add_parser("retrieval-server", help=RETRIEVAL_SERVER_HELP, add_help=False)  # its own parser helps
    return parser


def retrieval_server(argv: list[str]) -> int:
    """`trl-tree retrieval-server ...`: serve search in this process until stopped (no accelerate, no model)."""
    from trl_tree.envs.retrieval_server import main as serve

    return serve(argv)


def _add_view_arguments(parser: argparse.ArgumentParser) -> None:
    from trl_tree.tree_view import MAX_CHARS, MAX_NODES

    parser.add_argument("run_dir", help="a run's output_dir, its tree_view/ folder, or one saved .json file")
    parser.add_argument("--out", default=None, help="write the pages here instead of beside their data")
    parser.add_argument("--max-nodes", type=int, default=MAX_NODES, help="nodes per page before it is cut")
    parser.add_argument("--max-chars", type=int, default=MAX_CHARS, help="text characters per page before it is cut")


def view(argv: list[str]) -> int:
    """`trl-tree view RUN_DIR`: re-render the saved pages (no accelerate, no model)."""
    from trl_tree.tree_view import render_run

    parser = argparse.ArgumentParser(prog="trl-tree view", description=VIEW_HELP)
    _add_view_arguments(parser)
    args = parser.parse_args(argv)
    try:
        pages = render_run(args.run_dir, args.out, max_nodes=args.max_nodes, max_chars=args.max_chars)
    except (FileNotFoundError, ValueError) as e:
        raise SystemExit(f"trl-tree view: {e}") from e
    for page in pages:
        print(page)
    for path, why in getattr(pages, "unreadable", []):  # e.g. a crashed run's half-written last file
        print(f"trl-tree view: not rendered, unreadable: {path} ({why})", file=sys.stderr)
    return 0


def shipped_accelerate_configs():
    """The folder of accelerate configs shipped in the package (`trl_tree/accelerate_configs/`, package data)."""
    return importlib.resources.files("trl_tree").joinpath("accelerate_configs")


def shipped_accelerate_config_names() -> list[str]:
    configs = shipped_accelerate_configs().iterdir()
    return sorted(p.name.removesuffix(".yaml") for p in configs if p.name.endswith(".yaml"))


def resolve_accelerate_config(launch_args: list[str]) -> list[str]:
    """`--accelerate_config NAME_OR_PATH` -> `--config_file PATH`, NAME being one of `shipped_accelerate_configs()`."""
    if "--accelerate_config" not in launch_args:
        return launch_args
    i = launch_args.index("--accelerate_config")
    if i + 1 >= len(launch_args):
        raise SystemExit("trl-tree: expected a config name or path after --accelerate_config.")
    name = launch_args[i + 1]
    shipped = shipped_accelerate_configs()
    candidates = [Path(name), shipped.joinpath(name), shipped.joinpath(f"{name}.yaml")]
    path = next((p for p in candidates if p.is_file()), None)
    if path is None:
        raise SystemExit(
            f"trl-tree: accelerate config {name!r} is neither a file nor one of {shipped_accelerate_config_names()}."
        )
    return ["--config_file", str(path), *launch_args[:i], *launch_args[i + 2 :]]


def _split_known(all_args: list[str], unknown: list[str]) -> list[str]:
    """`all_args` without the ordered subsequence `unknown` (the arguments the script parser did not consume)."""
    pending = iter(unknown)
    current = next(pending, None)
    kept = []
    for item in all_args:
        if current is not None and item == current:
            current = next(pending, None)
        else:
            kept.append(item)
    return kept


def _fail(command: str, message: str) -> NoReturn:
    """An error of the command line, before anything is launched: one line, not the parsers' 200-line usage."""
    print(f"trl-tree {command}: error: {message}", file=sys.stderr)
    raise SystemExit(2)


def _usage(command: str) -> str:
    return f"trl-tree {command} [--config YAML] [OPTIONS] [ACCELERATE OPTIONS]   (--help: the main ones, --help-all)"


def launch(command: str, all_args: list[str]) -> int:
    """Validate the script arguments here (so `--help`, typos, a missing reward and bad import paths answer at once),
    then `accelerate launch` the command's script with them and everything else as launcher arguments."""
    if "--help-all" in all_args or {"-h", "--help"} & set(all_args):
        sys.stdout.write(cached_help_text(command, all_args, full="--help-all" in all_args))
        raise SystemExit(0)

    from trl_tree.scripts import check_data, check_method_form, form_for, generic

    try:
        check_method_form(command, all_args)
    except ValueError as error:  # the method declares it cannot run the HotpotQA example (`Method.example_unfit`)
        _fail(command, str(error))
    script_module = form_for(all_args)
    parser = script_module.prepared_parser(command, all_args, prog=f"trl-tree {command}")
    parser.usage = _usage(command)  # what an argparse error prints above its message
    problems = config_key_problems(command, all_args, script_module, parser)
    if problems:
        _fail(command, problems)
    *parsed, config_remaining, cli_remaining = parser.parse_args_and_config(
        all_args, return_remaining_strings=True, separate_remaining_strings=True
    )
    problems = launcher_option_problems(command, cli_remaining, script_module, parser)
    if problems:
        _fail(command, problems)
    try:
        check_data(all_args)
        if script_module is generic:
            generic.check_arguments(*parsed)
    except ValueError as error:  # a NoRewardError, or what `check_arguments` cannot import or is not given
        _fail(command, str(error))

    from accelerate.commands.launch import launch_command, launch_command_parser

    launch_args = resolve_accelerate_config(config_remaining + cli_remaining)
    script_args = _split_known(all_args, cli_remaining)
    script = str(importlib.resources.files("trl_tree.scripts").joinpath(TRAINING_SCRIPT))
    launch_namespace = launch_command_parser().parse_args([*launch_args, script, command, *script_args])
    if launch_namespace.training_script != script:  # a stray word before the script would be launched instead
        _fail(
            command,
            f"unexpected argument {launch_namespace.training_script!r}: every option is --name [VALUE] "
            f"(`trl-tree {command} --help` lists them).",
        )
    try:
        launch_command(launch_namespace)
    except subprocess.CalledProcessError as error:  # one process: the child's own error is the last output above
        return _launched_process_failed(command, error.returncode)
    except Exception as error:  # several processes: torch's ChildFailedError, after each rank's own error
        if type(error).__name__ != "ChildFailedError":
            raise
        codes = sorted({failure.exitcode for failure in getattr(error, "failures", {}).values()}) or [1]
        return _launched_process_failed(command, codes[0])
    return 0


def _launched_process_failed(command: str, returncode: int) -> int:
    """The launched training process failed and has printed its own error: one line after it, not accelerate's
    traceback of the launcher (a wall of 40+ lines that buried the child's last lines, issue 59)."""
    print(f"trl-tree {command}: the training process exited with code {returncode}; its error is the output just "
          "above (from the launched script, not from accelerate).", file=sys.stderr)  # fmt: skip
    return returncode


# ---------------------------------------------------------------------------------------------------------------
# Help
# ---------------------------------------------------------------------------------------------------------------

# The short `--help` opens with these groups of fields, what every run needs (the model, the data, the rewards and
# tools, where to write, how fast to learn), then the method's own fields (read from the method table), each with the
# first sentence of its help or the line given here. Each is a field of the generic script's or the HotpotQA example's
# parser (tests/test_cli.py checks it); `--help-all` lists every field of both with its whole help. GRPO options the
# tree trainers refuse unless left at GRPO's default (`beta`, `loss_type`, ...: `TreeTrainerConfig.unused_grpo_options`)
# are not here, and `--help-all` marks them so.
DATA_OPTIONS = {
    "model_name_or_path": "The policy to train: a Hub id, a local folder, or `tiny` (a 2-layer Qwen3 built "
    "locally, trl_tree.testing.tiny_model_path(): try a command offline).",
    "dataset_name": "A Hub id, a local folder, or a .json / .jsonl / .csv / .parquet file.",
    "dataset_config": "The dataset's configuration (subset) name.",
    "reward_funcs": None,
    "reward_model_name_or_path": None,
    "tools": None,
    "environment_factory": None,
    "use_peft": None,
}
DATA_TITLE = "model, data, rewards and tools"
TRAINING_OPTIONS = {
    "output_dir": None,
    "learning_rate": None,
    "max_steps": "Optimizer steps to train (overrides num_train_epochs).",
    "per_device_train_batch_size": None,
    "num_generations": None,
    "steps_per_generation": None,
    "gradient_accumulation_steps": None,
    "temperature": None,
    "bf16": None,
    "gradient_checkpointing": None,
    "use_vllm": None,
    "use_cpu": "Train on the CPU even where a GPU is available (the default on a machine without one).",
    "logging_steps": None,
    "report_to": None,
    "log_completions": "Log sampled completions, and save the rollout-tree pages (trl-tree view).",
    "save_strategy": None,
    "seed": None,
    "push_to_hub": None,
}
EXAMPLE_OPTIONS = {
    "offline_defaults": None,
    "retriever": None,
    "corpus_path": None,
    "num_train": None,
    "num_eval": None,
    "warm_start_steps": None,
    "f1_threshold": None,
}
_METAVARS = {
    "reward_funcs": "NAME_OR_PATH",
    "tools": "PATH",
    "environment_factory": "PATH",
    "dataset_name": "DATA",
    "model_name_or_path": "MODEL",
    "reward_model_name_or_path": "MODEL",
    "output_dir": "DIR",
}
_KINDS = {"int": "INT", "float": "FLOAT", "str": "STR", "string_to_bool": "BOOL"}  # type names (TRL's parser wraps
# `T | None` fields' converters, keeping their __name__)


def help_groups(command: str, example: bool) -> list[tuple[str, dict[str, str | None]]]:
    """(title, {field: its short help, or None for the first sentence of its own}) of the short help, each field in
    its first group only: what every run needs first (the model, data, rewards and tools; then common training:
    output directory, learning rate, batch sizes, ...), then the method's sampler, credit and loss, each with the
    fields it reads (`trl_tree.methods`), and, in the HotpotQA example's form (`example`), the example's options."""
    method = methods.METHODS[command]
    components = [
        ("tree sampler", "sampler", methods.SAMPLERS[method.sampler]),
        ("credit", "credit", methods.CREDITS[method.credit]),
        ("loss", "loss", methods.LOSSES[method.loss]),
    ]
    groups = [(DATA_TITLE, DATA_OPTIONS), ("common training", TRAINING_OPTIONS)]
    groups += [
        (f"{title} ({entry.name})", dict.fromkeys([field, *entry.fields])) for title, field, entry in components
    ]
    if example:
        groups.append(("the HotpotQA example (without a reward, tools or environment)", EXAMPLE_OPTIONS))
    seen: set[str] = set()
    out = []
    for title, names in groups:
        out.append((title, {n: h for n, h in names.items() if not (n in seen or seen.add(n))}))
    return out


def _first_sentence(text: str) -> str:
    return re.split(r"(?<=\.)\s+(?=[A-Z`(\[])", " ".join(text.split()), maxsplit=1)[0]


def _short_action(action: argparse.Action, help_line: str | None) -> argparse.Action:
    """`action` as the short help shows it: its underscore spelling, a metavar naming the kind of value, one line of
    help, and its default unless it is None."""
    short = copy.copy(action)
    short.option_strings = [next((s for s in action.option_strings if "-" not in s[2:]), action.option_strings[0])]
    if action.choices is None:
        kind = _KINDS.get(getattr(action.type, "__name__", ""))
        short.metavar = _METAVARS.get(action.dest) or kind or action.metavar
    short.help = (help_line or _first_sentence(action.help or "")).replace("%", "%%")
    if action.default is None:
        short.default = argparse.SUPPRESS
    return short


def _note(options: list[str], help_text: str, metavar: str | None = None) -> argparse.Action:
    """A line of help for what no dataclass field declares (`--config`, the launcher's options, `--help-all`)."""
    return argparse.Action(
        options,
        dest=argparse.SUPPRESS,
        metavar=metavar,
        default=argparse.SUPPRESS,
        help=help_text,
        nargs=0 if metavar is None else None,
    )


def _launch_notes(command: str) -> list[argparse.Action]:
    return [
        _note(
            ["--accelerate_config"],
            f"An accelerate config shipped with trl-tree ({', '.join(shipped_accelerate_config_names())}), or a file.",
            "NAME_OR_PATH",
        ),
        _note(
            ["--num_processes", "--mixed_precision", "..."],
            "Any option of `accelerate launch` goes to the launcher (accelerate launch --help).",
        ),
        _note(["-h", "--help"], "These options."),
        _note(["--help-all"], f"Every option of `trl-tree {command}`."),
    ]


def help_text(command: str, argv: list[str], *, full: bool = False) -> str:
    """`trl-tree <command> --help` (`full=False`): what every run needs first, then the method's own fields, grouped
    (`help_groups`), with the reward, tools and environment options always listed; `--help-all` (`full=True`): every
    field of the form `argv` selects (the generic script's or the HotpotQA example's), then the other form's own, the
    options the tree trainers refuse unless left at GRPO's default marked so.

    Help shows the defaults of the dataclasses, and a `--config` file's values in their place (as TrlParser's help
    does). Building the parsers imports the method's config class (transformers' `TrainingArguments`): most of the
    time `--help` takes; nothing else heavy is imported (not accelerate's launcher, nor the scripts' data modules)."""
    from trl_tree.scripts import config_file_content, form_for, generic, hotpot

    unfit = methods.METHODS[command].example_unfit  # such a method has the generic form only
    form = generic if unfit else form_for(argv)
    prog = f"trl-tree {command}"
    parser = form.make_parser(command, prog=prog)
    other_parser = None if unfit else _other_form(form).make_parser(command, prog=prog)
    config = {k: v for k, v in config_file_content(argv).items() if k != "env"}
    for p in (parser, other_parser):
        if p is not None:
            p.set_defaults_with_config(**config)
    parser.usage = _usage(command)
    own = [a for a in parser._actions if a.option_strings and a.dest != "help"]
    extra = [] if unfit else [a for a in other_parser._actions if a.option_strings and a.dest not in _dests(parser)]
    example = form is hotpot
    if full:
        _mark_refused_options([*own, *extra])
        formatter = parser._get_formatter()
        title = (
            "training your own data (with --reward_funcs, --tools or --environment_factory)"
            if example
            else "the HotpotQA example (without a reward, tools or environment)"
        )
        if extra:
            formatter.start_section(f"options of {title}")
            formatter.add_arguments(extra)
            formatter.end_section()
        formatter.start_section("launching")
        formatter.add_arguments(_launch_notes(command)[:2])
        formatter.end_section()
        parser.epilog = None  # the example's pointer to the generic form: its options follow here
        return parser.format_help() + formatter.format_help()

    # a field of both forms as the generic script declares it: the data group is about the user's data (the example's
    # `dataset_config` defaults to HotpotQA's "distractor"); the config and model fields are the same in both
    generic_parser, example_parser = (other_parser, parser) if example else (parser, other_parser)
    by_dest: dict[str, argparse.Action] = {}
    for action in [*generic_parser._actions, *(example_parser._actions if example_parser else [])]:
        if action.option_strings:
            by_dest.setdefault(action.dest, action)
    formatter = parser.formatter_class(prog=prog, max_help_position=34)
    formatter.add_usage(_usage(command).replace("%", "%%"), [], [])
    formatter.add_text(commands()[command])
    formatter.add_text(
        "It trains your data with the rewards, tools or environment you name: --model_name_or_path MODEL "
        "--dataset_name DATA --reward_funcs accuracy_reward [--tools my_pkg.tools.search | --environment_factory "
        "my_pkg.env.Env]. "
        + (
            f"It has no HotpotQA example form: {unfit}."
            if unfit
            else "Without any of them it is the HotpotQA example (no dataset, or hotpotqa/hotpot_qa): "
            f"`trl-tree {command}` alone runs it offline on a CPU."
        )
    )
    for title, names in help_groups(command, example):
        formatter.start_section(title)
        formatter.add_arguments([_short_action(by_dest[n], h) for n, h in names.items() if n in by_dest])
        if title == DATA_TITLE:
            config_note = _note(["--config"], "A YAML file of any fields (the command line wins).", "YAML")
            formatter.add_arguments([config_note])
        formatter.end_section()
    formatter.start_section("launching and help")
    formatter.add_arguments(_launch_notes(command))
    formatter.end_section()
    formatter.add_text(f"`trl-tree {command} --help-all` lists all {len(own) + len(extra)} options.")
    return formatter.format_help()


def _mark_refused_options(actions: list[argparse.Action]) -> None:
    """GRPO options that the tree trainers refuse unless left at GRPO's default (`beta`: any non-zero value), said so
    in `--help-all` with what to use instead, since their GRPO help describes an effect they do not have here."""
    from trl_tree.trainer.configuration.fields import _REJECTED_ADVICE

    for action in actions:
        advice = _REJECTED_ADVICE.get(action.dest)
        if advice is not None:
            action.help = f"[refused by trl-tree unless left at GRPO's default: {advice}] " + (action.help or "")


# Building the help imports the method's config class, and with it transformers' TrainingArguments and peft: most of
# the seconds `--help` takes. The text depends only on the code (trl-tree's files, these distributions' versions), the
# command, the form and the terminal width, so it is kept on disk under a key of all of them and read back next time.
HELP_CACHE_DEPENDENCIES = ("trl", "transformers", "peft", "accelerate", "torch")


def help_cache_file(command: str, argv: list[str], *, full: bool) -> Path | None:
    """Where the help for this command line is cached, or None where it is not: with a `--config` file (whose values
    the help shows as defaults), or with a dependency installed editable (its help can change under one version)."""
    from importlib import metadata

    from trl_tree.scripts import config_file, names_generic

    if config_file(argv) is not None:
        return None
    versions = []
    for name in HELP_CACHE_DEPENDENCIES:
        try:
            distribution = metadata.distribution(name)
        except metadata.PackageNotFoundError:
            return None
        if '"editable": true' in (distribution.read_text("direct_url.json") or "").replace("'", '"'):
            return None
        versions.append((name, distribution.version))
    package = Path(__file__).resolve().parent
    files = [(str(p.relative_to(package)), p.stat().st_size, p.stat().st_mtime_ns)
             for p in sorted(package.rglob("*")) if p.suffix in (".py", ".yaml")]  # fmt: skip
    width = shutil.get_terminal_size().columns  # argparse wraps to it
    kind = f"{command}-{'all' if full else 'short'}-{'generic' if names_generic(argv) else 'hotpot'}-{width}"
    key = hashlib.sha256(repr((sys.version, sys.prefix, versions, files)).encode()).hexdigest()[:24]
    cache = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "trl_tree" / "help"
    return cache / f"{kind}-{key}.txt"


def cached_help_text(command: str, argv: list[str], *, full: bool = False) -> str:
    """`help_text`, read from `help_cache_file` when it is there, else built and written there (older help of the
    same kind is removed). A cache that cannot be read or written is skipped."""
    path = help_cache_file(command, argv, full=full)
    try:
        if path is not None and path.is_file():
            return path.read_text()
    except OSError:
        pass
    text = help_text(command, argv, full=full)
    if path is not None:
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            for old in path.parent.glob(f"{path.name.rsplit('-', 1)[0]}-*.txt"):
                old.unlink(missing_ok=True)
            partial = path.with_suffix(f".{os.getpid()}.tmp")
            partial.write_text(text)
            partial.replace(path)  # never a half-written file under the final name
        except OSError:
            pass
    return text


# ---------------------------------------------------------------------------------------------------------------
# Unknown options and config keys
# ---------------------------------------------------------------------------------------------------------------


def _dests(parser: argparse.ArgumentParser) -> set[str]:
    return {action.dest for action in parser._actions if action.option_strings}


def _other_form(form: ModuleType) -> ModuleType:
    """The other script form: the HotpotQA example for the generic script, and the generic script for the example."""
    from trl_tree.scripts import generic, hotpot

    return hotpot if form is generic else generic


@functools.lru_cache(maxsize=1)
def _accelerate_options() -> frozenset[str]:
    from accelerate.commands.launch import launch_command_parser

    return frozenset(s for action in launch_command_parser()._actions for s in action.option_strings)


def _unknown(command: str, name: str, form: ModuleType, parser, *, key: bool) -> str:
    """What to say about the option (or YAML key) `name` that the parser of the script `form` does not have."""
    from trl_tree.scripts import generic

    shown = name if key else f"--{name}"
    accelerate_name = f"--{name}" in _accelerate_options() or name == "accelerate_config"
    if key and accelerate_name:
        return (
            f"{shown!r} is an option of `accelerate launch`, not of the script: give it on the command line "
            f"(--{name} VALUE) or in an accelerate config file (--accelerate_config NAME_OR_PATH)"
        )
    other = _other_form(form)
    if name in _dests(other.make_parser(command)):
        if other is generic:
            return (
                f"{shown!r} is an option of training your own data, with --reward_funcs, --tools or "
                "--environment_factory"
            )
        return (
            f"{shown!r} is an option of the HotpotQA example, which runs only without --reward_funcs, "
            "--reward_model_name_or_path, --tools and --environment_factory"
        )
    candidates = _dests(parser) | {o[2:] for o in _accelerate_options() if o.startswith("--")}
    close = difflib.get_close_matches(name, candidates, n=1, cutoff=0.75)
    hint = f" (did you mean {close[0] if key else '--' + close[0]!r}?)" if close else ""
    return f"unknown {'key' if key else 'option'} {shown!r}{hint}"


def config_key_problems(command: str, argv: list[str], form: ModuleType, parser) -> str | None:
    """The keys of the `--config` YAML that the script does not have, each with what to do; None when it has all.

    TrlParser would hand an unknown key on to `accelerate launch` as an option, where it fails after the launch;
    checked here, it fails first, with the closest field name."""
    from trl_tree.scripts import config_file, config_file_content

    known = _dests(parser) | {"env"}  # `env:` sets environment variables (TrlParser)
    unknown = [key for key in config_file_content(argv) if key not in known]
    if not unknown:
        return None
    reasons = "; ".join(_unknown(command, str(key), form, parser, key=True) for key in unknown)
    return (
        f"--config {config_file(argv)}: {reasons}. Fix or remove {'them' if len(unknown) > 1 else 'it'}: "
        f"`trl-tree {command} --help-all` lists every field a config file may set."
    )


def launcher_option_problems(command: str, cli_remaining: list[str], form: ModuleType, parser) -> str | None:
    """The command-line options neither the script nor `accelerate launch` knows (what the script's parser left, less
    accelerate's options and their values), each with the closest option; None when there are none."""
    unknown = []
    for token in cli_remaining:
        name = token.split("=", 1)[0]
        launcher = name in _accelerate_options() or name == "--accelerate_config"
        if launcher or not name.startswith("-") or _is_number(name):  # a launcher option or its value
            continue
        unknown.append(_unknown(command, name.lstrip("-").replace("-", "_"), form, parser, key=False))
    if not unknown:
        return None
    return "; ".join(unknown) + (
        f". `trl-tree {command} --help` lists the main options (--help-all every one), `accelerate launch --help` "
        "accelerate's."
    )


def _is_number(token: str) -> bool:
    try:
        float(token)
    except ValueError:
        return False
    return True


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = _build_parser()
    if not argv or argv[0] in ("-h", "--help"):
        parser.print_help()
        return 0
    if argv[0] == "view":
        return view(argv[1:])
    if argv[0] == "retrieval-server":
        return retrieval_server(argv[1:])
    if argv[0] not in commands():
        parser.error(f"unknown command {argv[0]!r}; choose one of: {', '.join([*commands(), *TOOL_COMMANDS])}.")
    return launch(argv[0], argv[1:])


if __name__ == "__main__":
    raise SystemExit(main())
