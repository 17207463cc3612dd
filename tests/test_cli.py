"""The `trl-tree` console command: help for every method, a clear error otherwise, and what it hands accelerate."""

import json
import re
import runpy
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from trl_tree import cli, methods
from trl_tree.scripts import hotpot

REPO = Path(__file__).resolve().parent.parent
METHODS = list(methods.METHODS)  # every command is a method of the table
EXAMPLE_METHODS = list(hotpot.example_methods())  # those the HotpotQA example trains (the rest: generic form only)
TRAINING_SCRIPT = REPO / "trl_tree" / "scripts" / "train.py"


def test_top_level_help_lists_the_methods(capsys):
    assert cli.main(["--help"]) == 0
    out = capsys.readouterr().out
    assert all(method in out for method in METHODS) and set(cli.commands()) == set(methods.METHODS)


def test_a_method_unfit_for_the_example_says_its_own_reason_and_runs_the_generic_form(monkeypatch, capsys):
    """A method declaring why the HotpotQA example cannot train it (TreeFlex) is refused without a reward, with
    that declaration as the reason, and launches the one training script when a reward is named."""
    (name,) = [n for n, m in methods.METHODS.items() if m.example_unfit]
    err = _refused(monkeypatch, capsys, [name])
    assert methods.METHODS[name].example_unfit in err
    launched = []
    monkeypatch.setattr("accelerate.commands.launch.launch_command", launched.append)
    argv = ["--reward_funcs", "accuracy_reward", "--dataset_name", "data.jsonl", "--model_name_or_path", "m"]
    assert cli.main([name, *argv]) == 0
    (args,) = launched
    assert Path(args.training_script) == TRAINING_SCRIPT and args.training_script_args == [name, *argv]


def test_a_registered_method_is_a_command_in_help_with_a_runnable_entry(monkeypatch, capsys):
    """Registering a `Method` is all a new preset needs to be a command: it is in the top-level help, its own help
    builds, and the launch hands accelerate the one training script, which parses the new method's config."""
    base = methods.METHODS["treepo"]
    new = methods.Method(
        "treecopy",
        "TreeCopy",
        base.config,
        base.trainer,
        base.sampler,
        base.credit,
        base.loss,
        "a method registered in a test",
    )
    monkeypatch.setitem(methods.METHODS, new.name, new)
    assert cli.main(["--help"]) == 0
    assert "treecopy" in capsys.readouterr().out
    assert "--target_radius" not in _help(["treecopy", "--help"], capsys)  # the preset's loss: treepo, no teacher
    launched = []
    monkeypatch.setattr("accelerate.commands.launch.launch_command", launched.append)
    assert cli.main(["treecopy", "--max_steps", "1"]) == 0
    (args,) = launched
    assert Path(args.training_script) == TRAINING_SCRIPT
    parsed = []
    monkeypatch.setattr(hotpot, "main", lambda *a: parsed.append(a))
    monkeypatch.setattr(sys, "argv", [args.training_script, *args.training_script_args])
    runpy.run_path(args.training_script, run_name="__main__")
    ((_, training_args, _),) = parsed
    assert type(training_args) is new.config_class() and training_args.output_dir == "outputs/treecopy-hotpot-offline"


@pytest.fixture(autouse=True)
def _own_help_cache(tmp_path, monkeypatch):
    """Each test reads and writes the help cache (`cli.help_cache_file`) of its own, empty cache folder."""
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))


def _help(argv, capsys) -> str:
    with pytest.raises(SystemExit) as exit_info:
        cli.main(argv)
    assert exit_info.value.code == 0
    return capsys.readouterr().out


def _options(text: str) -> list[str]:
    """The `--options` a help text lists at the start of its lines, in order."""
    return re.findall(r"^\s+(--[a-z_]+)", text, flags=re.M)


@pytest.mark.parametrize("form", [[], ["--reward_funcs", "x.y"]], ids=["hotpot", "generic"])
@pytest.mark.parametrize("method", METHODS)
def test_short_help_lists_what_every_run_needs_first_then_the_methods_own_fields_grouped(method, form, capsys):
    """`trl-tree <method> --help`: the model, data, rewards and tools open it, then common training (output
    directory, learning rate first), then the fields the method's sampler, credit and loss read (the method table),
    group by group, in one block; the reward, tools and environment options are there whether or not one is given;
    every option it lists is a real one (in `--help-all`), and it is a small part of `--help-all`."""
    out = _help([method, *form, "--help"], capsys)
    full = _help([method, *form, "--help-all"], capsys)
    entry = methods.METHODS[method]
    components = [("sampler", methods.SAMPLERS[entry.sampler]), ("credit", methods.CREDITS[entry.credit]),
                  ("loss", methods.LOSSES[entry.loss])]  # fmt: skip
    own = list(dict.fromkeys(f"--{n}" for kind, c in components for n in (kind, *c.fields)))
    listed = _options(out)
    first = ["--model_name_or_path", "--dataset_name", "--dataset_config", "--reward_funcs",
             "--reward_model_name_or_path", "--tools", "--environment_factory", "--use_peft", "--config",
             "--output_dir", "--learning_rate"]  # fmt: skip
    assert listed[: len(first)] == first
    start = listed.index(own[0])
    assert listed[start : start + len(own)] == own
    assert start > listed.index("--learning_rate")
    titles = ["model, data, rewards and tools", "common training", f"tree sampler ({entry.sampler})",
              f"credit ({entry.credit})", f"loss ({entry.loss})"]  # fmt: skip
    positions = [out.index(f"\n\n{title}") for title in titles]  # a section title follows a blank line
    assert positions == sorted(positions)
    for option in ("--reward_funcs", "--tools", "--environment_factory", "--dataset_name", "--model_name_or_path"):
        assert option in listed
    assert "--help-all" in out and f"trl-tree {method}" in out
    notes = {"--accelerate_config", "--num_processes", "--help", "--help-all", "--config"}  # not dataclass fields
    assert set(listed) - notes <= set(_options(full))
    example = form == [] and method in EXAMPLE_METHODS  # a method unfit for the example has the generic form only
    assert ("--retriever" in listed) == example  # the example's own options only in the example's form
    assert len(out.splitlines()) * 5 < len(full.splitlines())


@pytest.mark.parametrize("form", [[], ["--tools", "x.y"]], ids=["hotpot", "generic"])
def test_help_all_lists_every_option_of_both_forms(form, capsys):
    from trl_tree.scripts import generic

    full = _help(["treeadv", *form, "--help-all"], capsys)
    every = {
        s for parser in (generic.make_parser("treeadv"), hotpot.make_parser("treeadv")) for action in parser._actions
        for s in action.option_strings if s.startswith("--") and "-" not in s[2:]
    }  # fmt: skip
    assert every <= set(re.findall(r"--[a-z_0-9]+", full))


def test_treeflex_help_lists_none_of_the_tree_fields(capsys):
    """TreeFlex grows no tree: `trl-tree treeflex --help-all` has its own fields, and none of the tree samplers'."""
    full = set(
        re.findall(r"--[a-z_0-9]+", _help(["treeflex", "--reward_funcs", "accuracy_reward", "--help-all"], capsys))
    )
    assert {"--num_searches", "--max_blocks", "--max_turns", "--tool_timeout", "--num_generations"} <= full
    tree_fields = (
        "num_initial_rollouts",
        "num_branches",
        "anchor_rule",
        "expansion_rounds",
        "branches_per_round",
        "expansion_mode",
        "sibling_penalty",
        "entropy_threshold",
        "max_branches_per_tree",
        "min_segment_length",
        "branching_rounds",
        "reward_std",
        "target_radius",
        "packing",
    )
    assert [name for name in tree_fields if f"--{name}" in full] == []
    tree_help = set(re.findall(r"--[a-z_0-9]+", _help(["treeadv", "--help-all"], capsys)))
    assert {f"--{name}" for name in tree_fields} <= tree_help


def test_the_first_lines_of_help_are_the_model_and_data_and_beta_is_left_out(capsys):
    """The issue's complaint: the first 40 lines were sampler, credit and loss internals, and `--beta` (refused unless
    0) was listed as a common option. Now the first option lines are the model and the data; `--beta` is only in
    `--help-all`, marked as refused."""
    out = _help(["treeopsd", "--help"], capsys)
    head = out.split("\n\n", 3)[3].splitlines()  # after the usage line, the command's line and its paragraph
    assert head[0] == "model, data, rewards and tools:" and head[1].split()[0] == "--model_name_or_path"
    assert [line.split()[0] for line in head[1:] if line.startswith("  --")][:3] == [
        "--model_name_or_path",
        "--dataset_name",
        "--dataset_config",
    ]
    assert "--beta" not in _options(out)
    full = _help(["treeopsd", "--help-all"], capsys)
    beta = full[full.index("  --beta") :].split("\n  --", 1)[0]
    assert "refused by trl-tree unless left at GRPO's default" in " ".join(beta.split())


def test_every_option_the_short_help_names_is_a_field_of_a_script():
    """The hand-picked groups of the short help (rewards and data, common training, the example's) name real fields:
    a renamed field fails here, not as a silently shorter help."""
    from trl_tree.scripts import generic

    fields = {a.dest for p in (generic.make_parser("treepo"), hotpot.make_parser("treepo")) for a in p._actions}
    for names in (cli.DATA_OPTIONS, cli.TRAINING_OPTIONS, cli.EXAMPLE_OPTIONS):
        assert set(names) <= fields


def test_help_is_cached_and_the_cached_text_is_the_built_one(tmp_path, monkeypatch, capsys):
    """The second `--help` reads the text the first wrote (under a key of the code it comes from); an unusable cache
    folder changes nothing but the speed; a `--config` file's help is never cached (its values are the defaults)."""
    first = _help(["at2po", "--help"], capsys)
    path = cli.help_cache_file("at2po", ["--help"], full=False)
    assert path.is_file() and path.read_text() == first == cli.help_text("at2po", ["--help"])
    path.write_text("from the cache\n")
    assert _help(["at2po", "--help"], capsys) == "from the cache\n"
    assert cli.help_cache_file("at2po", ["--help"], full=True) != path
    assert cli.help_cache_file("treepo", ["--help"], full=False) != path
    assert cli.help_cache_file("at2po", ["--reward_funcs", "x.y", "--help"], full=False) != path
    recipe = tmp_path / "r.yaml"
    recipe.write_text("expansion_rounds: 3\n")
    assert cli.help_cache_file("at2po", ["--config", str(recipe), "--help"], full=False) is None
    assert "(default: 3)" in _help(["at2po", "--config", str(recipe), "--help"], capsys)

    blocked = tmp_path / "blocked"
    blocked.write_text("a file where the cache folder would be")
    monkeypatch.setenv("XDG_CACHE_HOME", str(blocked))
    assert _help(["at2po", "--help"], capsys) == first


def test_help_starts_neither_accelerate_nor_the_data_libraries():
    """`--help` imports what its text needs (the method's config class), not the launcher or the data stack."""
    code = (
        "import sys; from trl_tree import cli\n"
        "try:\n    cli.main(['treeopsd', '--help'])\nexcept SystemExit:\n    pass\n"
        "print(sorted(m for m in ('accelerate.commands.launch', 'datasets', 'trl_tree.envs') if m in sys.modules))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300, cwd=REPO)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip().splitlines()[-1] == "[]"


@pytest.mark.parametrize("method", EXAMPLE_METHODS)
def test_each_method_launches_its_script_which_trains_with_its_trainer(method, monkeypatch):
    """`trl-tree <method>` hands accelerate `scripts/train.py <method>`; that script parses the method's config
    (with the offline defaults) and `main` picks the method's trainer class from it."""
    launched = []
    monkeypatch.setattr("accelerate.commands.launch.launch_command", launched.append)
    assert cli.main([method, "--max_steps", "1"]) == 0
    (args,) = launched
    assert Path(args.training_script) == TRAINING_SCRIPT and args.training_script_args[0] == method

    parsed = []
    monkeypatch.setattr(hotpot, "main", lambda *a: parsed.append(a))
    monkeypatch.setattr(sys, "argv", [args.training_script, *args.training_script_args])
    runpy.run_path(args.training_script, run_name="__main__")
    ((script_args, training_args, model_args),) = parsed
    entry = methods.METHODS[method]
    assert type(training_args) is entry.config_class() and training_args.max_steps == 1
    assert training_args.output_dir == f"outputs/{method}-hotpot-offline" and script_args.warm_start_steps > 0
    assert hotpot.trainer_class_for(training_args) is entry.trainer_class()
    assert entry.trainer_class().config_class is entry.config_class()


@pytest.mark.parametrize("method", EXAMPLE_METHODS)
def test_offline_defaults_share_treeopsds_tree_budget(method):
    """At most 12 leaves per prompt (4 complete trajectories + 8 continuations), whatever the method's own defaults
    (AT2PO's M = 2, L = 2, K = 6 would be 14)."""
    _, training_args, _ = hotpot.parse_args(method, [])
    assert training_args.num_initial_rollouts == 4 and training_args.leaves_per_tree == 12
    assert training_args.max_steps == hotpot.OFFLINE_TRAINING_DEFAULTS["max_steps"]
    if method == "at2po":
        assert (training_args.expansion_rounds, training_args.branches_per_round) == (2, 4)


def test_the_offline_tiny_model_has_a_name_the_command_line_takes(tmp_path, monkeypatch):
    """Issue 59: the tiny model had no name a command takes (the user had to ask Python for `tiny_model_path()`).
    `--model_name_or_path tiny` is that folder in the generic form, and the offline default in the example's form
    (its offline settings included); a local folder named `tiny` is still that folder."""
    from trl_tree.scripts import generic
    from trl_tree.testing import tiny_model_path

    generic_argv = ["--model_name_or_path", "tiny", "--dataset_name", "d.jsonl", "--reward_funcs", "x.y"]
    monkeypatch.chdir(tmp_path)
    _, _, model_args, _ = generic.parse_args("treeopsd", generic_argv)
    assert model_args.model_name_or_path == tiny_model_path()
    _, training_args, model_args = hotpot.parse_args("treeopsd", ["--model_name_or_path", "tiny"])
    assert model_args.model_name_or_path is None and hotpot._model_path(model_args) == tiny_model_path()
    assert training_args.max_steps == hotpot.OFFLINE_TRAINING_DEFAULTS["max_steps"]
    (tmp_path / "tiny").mkdir()
    _, _, model_args, _ = generic.parse_args("treeopsd", generic_argv)
    assert model_args.model_name_or_path == "tiny"


def test_the_short_help_names_the_tiny_model_and_use_cpu(capsys):
    """Issue 59: `--use_cpu` was only in `--help-all`, and nothing said how to name the offline model."""
    out = _help(["treeopsd", "--help"], capsys)
    assert "--use_cpu" in _options(out)
    model_line = " ".join(out[out.index("  --model_name_or_path") :].split("\n  --", 1)[0].split())
    assert "`tiny`" in model_line


def test_an_unknown_command_names_the_valid_ones(capsys):
    with pytest.raises(SystemExit) as exit_info:
        cli.main(["grpo"])
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert "unknown command 'grpo'" in err and ", ".join(methods.METHODS) in err


def _refused(monkeypatch, capsys, argv) -> str:
    """The error `trl-tree` gives for `argv` (exit status 2, nothing launched)."""
    launched = []
    monkeypatch.setattr("accelerate.commands.launch.launch_command", launched.append)
    with pytest.raises(SystemExit) as exit_info:
        cli.main(argv)
    assert exit_info.value.code == 2 and not launched
    return capsys.readouterr().err


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--num_branchez", "3"], "unknown option '--num_branchez' (did you mean '--num_branches'?)"),
        (["--num-branchez", "3"], "unknown option '--num_branchez' (did you mean '--num_branches'?)"),
        (["--max_stepz=3"], "(did you mean '--max_steps'?)"),
        (["--entropy_treshold", "1"], "(did you mean '--entropy_threshold'?)"),
        (["--reward_funcs", "x.y", "--retriever", "bm25"], "'--retriever' is an option of the HotpotQA example"),
        (["--max_steps", "1", "stray"], "unexpected argument 'stray'"),
    ],
)
def test_an_unknown_option_fails_before_the_launch_naming_the_closest(monkeypatch, capsys, argv, message):
    err = _refused(monkeypatch, capsys, ["treeadv", *argv])
    assert message in err and "--help" in err  # and where to look
    assert len(err.splitlines()) == 1  # not the parsers' usage of every option


@pytest.mark.parametrize(
    ("recipe", "message"),
    [
        ("num_branchez: 3\n", "unknown key 'num_branchez' (did you mean 'num_branches'?)"),
        ("learning_rte: 0.1\nmax_steps: 2\n", "unknown key 'learning_rte' (did you mean 'learning_rate'?)"),
        (
            "num_processes: 2\n",
            "'num_processes' is an option of `accelerate launch`, not of the script: give it on the command line",
        ),
        ("reward_funcs: [x.y]\nretriever: bm25\n", "'retriever' is an option of the HotpotQA example"),
        ("tree_budget: 3\nfoo: 1\n", "unknown key 'tree_budget'; unknown key 'foo'. Fix or remove them"),
    ],
    ids=["typo", "typo-among-good-keys", "accelerate-key", "other-form", "no-close-name"],
)
def test_an_unknown_config_key_fails_before_the_launch_naming_the_closest_field(
    tmp_path, monkeypatch, capsys, recipe, message
):
    path = tmp_path / "recipe.yaml"
    path.write_text(recipe)
    err = _refused(monkeypatch, capsys, ["treepo", "--config", str(path)])
    assert f"--config {path}: " in err and message in err and "--help-all" in err


def test_every_key_of_the_shipped_recipes_is_known(monkeypatch):
    """The invariant beside the errors above: the paper's recipe and the offline one pass the key check (the
    offline recipe's `methods:` is its own per-method table, read by `hotpot.offline_defaults`)."""
    import yaml

    from trl_tree.scripts import hotpot as example

    for recipe in (REPO / "examples" / "recipes").glob("*.yaml"):
        argv = ["--config", str(recipe)]
        assert cli.config_key_problems("treeopsd", argv, example, example.make_parser("treeopsd")) is None
    offline = yaml.safe_load((REPO / "trl_tree" / "recipes" / "hotpot_offline.yaml").read_text())
    fields = {a.dest for a in example.make_parser("at2po")._actions}
    assert set(offline) - {"methods"} <= fields
    assert {k for m in offline["methods"].values() for k in m} <= fields


@pytest.mark.parametrize(
    "data",
    [["--dataset_name", "my_org/my_prompts"], ["--dataset_name=data.jsonl", "--model_name_or_path", "m"],
     ["--dataset-name", "data.jsonl"]],
    ids=["hub-id", "local-file", "dash-spelling"],
)  # fmt: skip
def test_user_data_without_a_reward_is_refused_before_the_launch_saying_what_to_pass(monkeypatch, capsys, data):
    """Not the HotpotQA example on someone else's data (which failed much later on a missing 'question' column)."""
    err = _refused(monkeypatch, capsys, ["treepo", *data])
    assert "without a reward" in err and "--reward_funcs" in err and "accuracy_reward" in err
    assert "--tools" in err and "--environment_factory" in err and "hotpotqa/hotpot_qa" in err


def test_user_data_in_a_config_file_without_a_reward_is_refused(tmp_path, monkeypatch, capsys):
    path = tmp_path / "recipe.yaml"
    path.write_text("dataset_name: my_org/my_prompts\nmax_steps: 3\n")
    assert "--dataset_name my_org/my_prompts is given without a reward" in _refused(
        monkeypatch, capsys, ["treepo", "--config", str(path)]
    )


@pytest.mark.parametrize(
    "argv",
    [[], ["--max_steps", "2"], ["--dataset_name", "hotpotqa/hotpot_qa", "--num_eval", "0"],
     ["--dataset_name", "./my_hotpot_copy", "--retriever", "bm25"], ["--model_name_or_path", "some/model"]],
    ids=["offline", "offline-option", "hotpotqa", "local-copy-with-an-example-option", "own-model-offline-data"],
)  # fmt: skip
def test_the_hotpotqa_example_still_launches_on_its_own_data(monkeypatch, argv):
    """The invariant beside the refusal: the example runs, unchanged, when its data is meant."""
    launched = []
    monkeypatch.setattr("accelerate.commands.launch.launch_command", launched.append)
    assert cli.main(["treeopsd", *argv]) == 0
    (args,) = launched
    assert Path(args.training_script) == TRAINING_SCRIPT and args.training_script_args == ["treeopsd", *argv]


def test_the_papers_recipe_is_the_hotpotqa_example():
    from trl_tree.scripts import script_for

    recipe = REPO / "examples" / "recipes" / "treeopsd_hotpot_qwen3_4b.yaml"
    assert script_for(["--config", str(recipe)]) is hotpot
    assert script_for(["--config", str(recipe), "--dataset_name", "./local_hotpot"]) is hotpot  # its own options


def test_script_arguments_go_to_the_script_and_the_rest_to_accelerate(monkeypatch):
    launched = []
    monkeypatch.setattr("accelerate.commands.launch.launch_command", launched.append)
    assert cli.main(["treepo", "--num_processes", "1", "--max_steps", "1", "--accelerate_config", "multi_cpu"]) == 0
    (args,) = launched
    assert Path(args.training_script) == TRAINING_SCRIPT
    assert args.training_script_args == ["treepo", "--max_steps", "1"]
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
    monkeypatch.setattr(sys, "argv", [str(TRAINING_SCRIPT), method, *argv])
    runpy.run_path(str(TRAINING_SCRIPT), run_name="__main__")  # what `accelerate launch` runs
    summary = json.loads((out / "hotpot_results.json").read_text())
    assert summary["method"] == {"at2po": "AT2PO", "treeadv": "TreeAdv"}[method] and summary["reward_curve"]
    assert summary["before"]["num_questions"] == summary["after"]["num_questions"] == 2
    assert (out / "model.safetensors").is_file()
