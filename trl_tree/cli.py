"""The `trl-tree` console command, in the style of `trl grpo`: `trl-tree <method> [accelerate args] [script args]`.

    trl-tree treeopsd                                   # the offline default of examples/train_hotpot.py
    trl-tree treepo --model_name_or_path Qwen/Qwen3-0.6B --dataset_name my_org/my_prompts \\
        --reward_funcs my_pkg.rewards.f1 --tools my_pkg.tools.search     # any dataset, rewards and tools by import path
    trl-tree at2po --config my_recipe.yaml --environment_factory my_pkg.env.Env --accelerate_config multi_gpu
    trl-tree treeopsd --config examples/recipes/treeopsd_hotpot_qwen3_4b.yaml --accelerate_config deepspeed_zero3
    trl-tree treeadv --entropy_threshold 0.8 --max_branches_per_tree 3
    trl-tree view RUN_DIR                               # render the run's saved rollout-tree pages again

Each method runs `trl_tree/scripts/<method>.py` through `accelerate launch`, with the method's config and trainer. The
script trains any dataset when the command line or its `--config` YAML names reward functions, tools or an environment
factory by import path (`trl_tree.scripts.generic`, as `trl grpo`), and otherwise the HotpotQA search agent, offline
by default (`trl_tree.scripts.hotpot`, the same entry point as `examples/train_hotpot.py`). Arguments the script does
not know (`--num_processes`, `--config_file`, `--mixed_precision`, ...) go to `accelerate launch`;
`--accelerate_config NAME_OR_PATH` picks one of the configs shipped in `trl_tree/accelerate_configs/` by name, or a
file. The script's arguments, and the import paths they name, are checked before anything is launched.

In the HotpotQA form every method trains the same search agent (`trl_tree.scripts.hotpot`): same data, retriever,
reward, warm start and before/after evaluation; only the config and trainer class differ. Their offline defaults share
one tree budget, at most 12 leaves per prompt (4 complete trajectories and 8 continuations): TreeOPSD/TreePO (M, N) =
(4, 2), AT2PO M = 4 with 2 rounds of 4 branches (its library default, M = 2 and 2 rounds of 6, costs the same G = 8 in 14 leaves),
TreeAdv 4 trees of at most 1 + 2 leaves (the recipe `trl_tree/recipes/hotpot_offline.yaml`).

`view` is no training method and runs in this process, without accelerate: it reads the data that a run with
`log_completions=True` saved under `OUTPUT_DIR/tree_view/` and writes the HTML pages again
(`trl_tree.tree_view.render_run`).

There is no `treeflex` command. `TreeFlexTrainer` rolls out with a two-role harness (`trl_tree.rollout.flex_harness`):
a Reflection block without tools writes instructions or the `<answer>`, and Execution segments restart from restored
checkpoint cards. This script's warm start teaches, and its before/after evaluation and `examples/eval_hotpot.py` run,
the single-role tool loop of the other trainers (one conversation that searches and answers; `max_turns` and
`max_completion_length` per trajectory, where TreeFlex reads them per segment and per block), and its prompt is that
loop's single-agent instruction. Trained through this script, TreeFlex would optimise an agent that the script never
warm-starts nor evaluates, so its EM/F1 would not measure what it trained. Use `TreeFlexTrainer` from Python
(README, "Use it like GRPOTrainer") until an evaluation of the two-role agent exists. The generic form has no such
obstacle: it neither warm-starts nor evaluates, and `TreeFlexTrainer` takes the same reward functions, `tools=` and
`environment_factory=` (it trains on what `trl_tree.scripts.generic` loads). TreeFlex can join as a command that runs
the generic form only, once the methods' table lists it with its config.
"""

from __future__ import annotations

import argparse
import importlib.resources
import sys
from pathlib import Path

from trl_tree import methods

# the training commands: every method of the table but TreeFlex (see above)
COMMANDS = {name: f"Train with {m.title} ({m.summary})." for name, m in methods.METHODS.items() if name != "treeflex"}
VIEW_HELP = "Render the rollout-tree pages of a run again from its saved data (OUTPUT_DIR/tree_view/*.json)."
_USAGE_EPILOG = (
    "Each command trains any dataset with reward functions (and tools or an environment factory) by import path, "
    "e.g. `trl-tree treepo --model_name_or_path MODEL --dataset_name DATA --reward_funcs my_pkg.rewards.f1`, or "
    "without them the HotpotQA search agent (offline by default)."
)


def _build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="trl-tree",
        description="Tree-structured agentic RL on top of TRL. Run `trl-tree <command> --help` for a command's options.",
        epilog=_USAGE_EPILOG,
        allow_abbrev=False,
    )
    subparsers = parser.add_subparsers(dest="command", metavar="{" + ",".join([*COMMANDS, "view"]) + "}")
    for name, help_text in COMMANDS.items():
        subparsers.add_parser(name, help=help_text, add_help=False)  # the script's own parser prints its help
    _add_view_arguments(subparsers.add_parser("view", help=VIEW_HELP, description=VIEW_HELP))
    return parser


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
    return 0


def shipped_accelerate_configs():
    """The folder of accelerate configs shipped in the package (`trl_tree/accelerate_configs/`, package data)."""
    return importlib.resources.files("trl_tree").joinpath("accelerate_configs")


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
        available = sorted(p.name.removesuffix(".yaml") for p in shipped.iterdir() if p.name.endswith(".yaml"))
        raise SystemExit(f"trl-tree: accelerate config {name!r} is neither a file nor one of {available}.")
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


def launch(command: str, all_args: list[str]) -> int:
    """Validate the script arguments here (so `--help`, typos and bad import paths answer at once), then `accelerate
    launch` the command's script with them and everything else as launcher arguments."""
    from accelerate.commands.launch import launch_command, launch_command_parser

    from trl_tree.scripts import generic, script_for

    script_module = script_for(all_args)
    parser = script_module.prepared_parser(command, all_args, prog=f"trl-tree {command}")
    *parsed, config_remaining, cli_remaining = parser.parse_args_and_config(
        all_args, return_remaining_strings=True, separate_remaining_strings=True
    )
    if script_module is generic:
        try:
            generic.check_arguments(*parsed)
        except ValueError as error:
            parser.error(str(error))
    launch_args = resolve_accelerate_config(config_remaining + cli_remaining)
    script_args = _split_known(all_args, cli_remaining)
    script = importlib.resources.files("trl_tree.scripts").joinpath(f"{command}.py")
    launch_command(launch_command_parser().parse_args([*launch_args, str(script), *script_args]))
    return 0


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = _build_parser()
    if not argv or argv[0] in ("-h", "--help"):
        parser.print_help()
        return 0
    if argv[0] == "view":
        return view(argv[1:])
    if argv[0] not in COMMANDS:
        parser.error(f"unknown command {argv[0]!r}; choose one of: {', '.join([*COMMANDS, 'view'])}.")
    return launch(argv[0], argv[1:])


if __name__ == "__main__":
    raise SystemExit(main())
