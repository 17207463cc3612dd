"""`examples/train_hotpot.py` end to end with tiny settings, its argument defaults, and `eval_hotpot.py` agreeing with it.

The offline example must run on a fresh machine; here it runs in-process with a handful of questions and steps, so
that CI covers warm start -> evaluation -> TreeOPSD training -> save -> evaluation in well under a minute.
"""

import contextlib
import importlib.util
import io
import json
import sys
from pathlib import Path

import pytest
import torch

from trl_tree.scripts.hotpot import OFFLINE_TRAINING_DEFAULTS, parse_args

EXAMPLES = Path(__file__).resolve().parent.parent / "examples"


def _load_example(name):
    spec = importlib.util.spec_from_file_location(name, EXAMPLES / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module  # dataclasses resolve their annotations through sys.modules
    spec.loader.exec_module(module)
    return module


TINY = (
    "--num_train 4 --num_eval 3 --warm_start_steps 2 --warm_start_batch_size 2 --max_steps 1 "
    "--per_device_train_batch_size 3 --steps_per_generation 1 --num_initial_rollouts 2 --num_branches 1 "
    "--max_turns 2 --max_completion_length 48"
).split()


@pytest.fixture(scope="module")
def offline_run(tmp_path_factory):
    out = tmp_path_factory.mktemp("offline")
    train_hotpot = _load_example("train_hotpot")
    argv = [*TINY, "--output_dir", str(out / "model"), "--bm25_cache_dir", str(out / "bm25")]
    script_args, training_args, model_args = train_hotpot.parse_args("treeopsd", argv)
    printed = io.StringIO()
    with contextlib.redirect_stdout(printed):
        summary = train_hotpot.main(script_args, training_args, model_args)
    return out, printed.getvalue(), summary


def test_offline_run_reports_em_and_f1_before_and_after_and_saves_the_model(offline_run, capsys):
    out, _, summary = offline_run
    for name in ("before", "after"):
        assert set(summary[name]) >= {"exact_match", "f1", "format_rate", "num_questions"}
        assert summary[name]["num_questions"] == 3
        assert 0.0 <= summary[name]["exact_match"] <= summary[name]["f1"] + 1e-9 <= 1.0 + 1e-9
    assert summary["reward_curve"] and len(summary["warm_start_loss"]) == 2
    model_dir = out / "model"
    assert (model_dir / "config.json").is_file() and (model_dir / "model.safetensors").is_file()
    assert json.loads((model_dir / "hotpot_results.json").read_text())["after"] == summary["after"]


def test_offline_run_prints_both_evaluations_the_reward_curve_and_the_model_folder(offline_run):
    out, printed, _ = offline_run
    assert "before training: EM" in printed and "after  training: EM" in printed and "F1" in printed
    assert "training reward" in printed and f"model saved to {out / 'model'}" in printed


def test_offline_run_writes_the_tree_view_and_ends_by_printing_its_page(offline_run):
    out, printed, summary = offline_run
    page = out / "model" / "tree_view" / "index.html"
    assert summary["tree_view"] == str(page) and page.is_file()
    assert printed.rstrip().splitlines()[-1].startswith(f"rollout trees: open {page}")


def test_the_reward_summary_compares_the_first_and_last_thirds_not_two_points():
    from trl_tree.scripts.hotpot import describe_reward_curve as describe

    line = describe([0.28, 0.29, 0.40, 0.28])  # first and last point equal, the curve was not flat
    assert "0.28 0.29 0.40 0.28" in line and "first third 0.285" in line and "last third 0.340" in line
    assert "(+0.055)" in line
    assert "first third" not in describe([0.5, 0.6]) and describe([]) == "no training reward was logged"


def test_eval_hotpot_scores_the_saved_model_like_the_training_run(offline_run, tmp_path):
    out, _, summary = offline_run
    eval_hotpot = _load_example("eval_hotpot")
    args = eval_hotpot.EvalArguments(
        model_name_or_path=str(out / "model"), bm25_cache_dir=str(out / "bm25"), output=str(tmp_path / "eval.json")
    )
    args = eval_hotpot._apply_training_settings(args, explicit={"model_name_or_path", "bm25_cache_dir", "output"})
    assert (args.num_train, args.num_eval, args.max_turns, args.max_completion_length) == (4, 3, 2, 48)
    report = eval_hotpot.main(args)
    assert {k: report[k] for k in summary["after"]} == summary["after"]
    saved = json.loads((tmp_path / "eval.json").read_text())
    assert len(saved["records"]) == 3 and {"question", "answer", "prediction", "completion"} <= set(
        saved["records"][0]
    )


def test_no_arguments_means_the_offline_defaults(monkeypatch):
    monkeypatch.setattr(sys, "argv", ["train_hotpot.py"])
    script_args, training_args, model_args = parse_args("treeopsd")
    assert script_args.dataset_name is None and model_args.model_name_or_path is None
    assert script_args.warm_start_steps > 0 and script_args.num_eval > 0
    for name, value in OFFLINE_TRAINING_DEFAULTS.items():
        parsed = getattr(training_args, name)
        parsed = getattr(parsed, "value", parsed)  # enums (lr_scheduler_type, save_strategy)
        assert parsed == ([] if value == "none" else value), name  # report_to="none" parses to []
    assert training_args.output_dir == "outputs/treeopsd-hotpot-offline"



def test_the_offline_recipe_parses_without_deprecation_warnings(monkeypatch):
    """The recipe's own keys must not be ones transformers deprecates (`gradient_checkpointing` from 5.23)."""
    import warnings

    monkeypatch.setattr(sys, "argv", ["train_hotpot.py"])
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        _, training_args, _ = parse_args("treeopsd")
    assert not [w for w in seen if issubclass(w.category, FutureWarning) and "checkpointing" in str(w.message)]
    assert training_args.gradient_checkpointing is False


def test_the_recipes_checkpointing_key_is_read_as_the_old_name_where_transformers_lacks_the_new(monkeypatch):
    import transformers

    from trl_tree.scripts.hotpot import _checkpointing_key_for_this_transformers as adapt

    assert adapt({"activation_checkpointing": False}) == {"activation_checkpointing": False}  # 5.23 and later
    fields_before_5_23 = {k: v for k, v in transformers.TrainingArguments.__dataclass_fields__.items()
                          if k != "activation_checkpointing"}
    monkeypatch.setattr(transformers.TrainingArguments, "__dataclass_fields__", fields_before_5_23)
    assert adapt({"activation_checkpointing": False}) == {"gradient_checkpointing": False}

def test_command_line_and_config_file_beat_the_offline_defaults(tmp_path):
    recipe = tmp_path / "recipe.yaml"
    recipe.write_text("learning_rate: 0.01\nmax_steps: 5\nnum_eval: 7\n")
    script_args, training_args, _ = parse_args("treeopsd", ["--config", str(recipe), "--max_steps", "2"])
    assert (training_args.learning_rate, training_args.max_steps, script_args.num_eval) == (0.01, 2, 7)
    assert training_args.max_turns == OFFLINE_TRAINING_DEFAULTS["max_turns"]  # the rest stay offline defaults


def test_a_dataset_or_a_model_turns_the_offline_defaults_off(tmp_path):
    _, training_args, _ = parse_args("treeopsd", ["--dataset_name", str(tmp_path / "hotpot.jsonl")])
    assert training_args.max_steps == -1 and training_args.num_initial_rollouts == 4
    assert training_args.learning_rate == 1e-6  # TRL's default, not the offline one
    script_args, training_args, _ = parse_args("treepo", ["--dataset_name", "x", "--offline_defaults", "true"])
    assert training_args.max_steps == OFFLINE_TRAINING_DEFAULTS["max_steps"]
    assert type(training_args).__name__ == "TreePOConfig"


def test_the_paper_recipe_parses_to_the_papers_hyperparameters():
    recipe = EXAMPLES / "recipes" / "treeopsd_hotpot_qwen3_4b.yaml"
    script_args, training_args, model_args = parse_args(
        "treeopsd", ["--config", str(recipe), "--use_vllm", "false", "--bf16", "false", "--use_cpu", "true"]
    )
    assert model_args.model_name_or_path == "Qwen/Qwen3-4B-Thinking-2507"
    assert script_args.dataset_name == "hotpotqa/hotpot_qa" and script_args.warm_start_steps == 0
    assert (training_args.num_initial_rollouts, training_args.num_branches) == (4, 2)
    assert training_args.target_radius == 0.25 and training_args.num_optimizer_blocks == 4
    assert training_args.num_generations == 8 and training_args.trees_per_micro_batch == 8
    assert training_args.trees_per_micro_batch * 8 * training_args.steps_per_generation == 256
    assert training_args.learning_rate == 1e-6 and training_args.weight_decay == 0.01
    assert (training_args.adam_beta1, training_args.adam_beta2) == (0.9, 0.999)
    assert training_args.max_turns == 5 and script_args.topk == 3
    assert (training_args.max_completion_length, training_args.max_observation_chars) == (6144, 16384)
    assert (training_args.temperature, training_args.top_p) == (1.0, 1.0)
    assert training_args.lr_scheduler_type == "constant"


def test_a_dataset_without_question_or_answer_names_the_missing_columns(tmp_path):
    data = tmp_path / "bad.jsonl"
    data.write_text(json.dumps({"id": "1", "query": "Who?", "gold": "me"}) + "\n")
    script_args, training_args, model_args = parse_args(
        "treeopsd", ["--dataset_name", str(data), "--output_dir", str(tmp_path / "out")]
    )
    with pytest.raises(ValueError, match=r"missing the column\(s\) \['question', 'answer'\]; found columns"):
        _load_example("train_hotpot").main(script_args, training_args, model_args)


def test_lora_adapter_is_saved_against_the_warm_started_base(tmp_path):
    """The adapter trains on the warm-started weights, so that is the base it must be loaded onto."""
    from trl_tree.envs.agent_eval import load_model_for_eval

    out = tmp_path / "lora"
    argv = [*TINY, "--num_eval_train", "0", "--use_peft", "--lora_r", "4", "--output_dir", str(out),
            "--bm25_cache_dir", str(tmp_path / "bm25")]  # fmt: skip
    train_hotpot = _load_example("train_hotpot")
    summary = train_hotpot.main(*train_hotpot.parse_args("treeopsd", argv))
    adapter = json.loads((out / "adapter_config.json").read_text())
    assert adapter["base_model_name_or_path"] == str((out / "warm_start_base").resolve())
    model, _ = load_model_for_eval(str(out))  # base + adapter, merged
    assert not hasattr(model, "peft_config") and summary["after"]["num_questions"] == 3


def test_a_rerun_loads_the_warm_start_from_the_cache_with_the_same_weights(tmp_path, monkeypatch, capsys):
    """Line 1 of the Quickstart pays for its warm start once: a rerun with the same inputs loads it."""
    from accelerate import PartialState

    from trl_tree.scripts import hotpot

    monkeypatch.setenv("TRL_TREE_CACHE", str(tmp_path / "cache"))
    argv = [*TINY, "--output_dir", str(tmp_path / "out"), "--bm25_cache_dir", str(tmp_path / "bm25")]
    script_args, training_args, model_args = parse_args("treeopsd", argv)
    train_examples, held_out = hotpot.load_questions(script_args)
    search = hotpot.build_search_tool(script_args, training_args, train_examples + held_out)

    def warm_started():
        model, tokenizer = hotpot.load_model_and_tokenizer(model_args, training_args)
        losses = hotpot.warm_start_policy(model, tokenizer, search, train_examples, script_args, training_args,
                                          model_args, PartialState())
        return model, losses, capsys.readouterr().out

    first, first_losses, first_printed = warm_started()
    second, second_losses, second_printed = warm_started()
    assert "cached in" in first_printed and "loaded from" in second_printed
    assert second_losses == first_losses
    assert all(torch.equal(a, b) for a, b in zip(first.state_dict().values(), second.state_dict().values()))
