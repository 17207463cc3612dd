"""Train a HotpotQA search agent with a tree trainer: the logic behind `examples/train_hotpot.py` and `trl-tree`.

Two settings share this code:

- **Offline default** (no `--dataset_name`, no `--model_name_or_path`): the tiny Qwen3 of `trl_tree.testing`, briefly
  warm-started (SFT) on scripted search conversations so that it emits parseable tool calls, a synthetic multi-hop
  world (`trl_tree.envs.synthetic`) with BM25 over its paragraphs, and a few TreeOPSD steps. Runs on 2 CPU cores in a
  few minutes, without the Hub.
- **The paper's setting**: `--model_name_or_path Qwen/Qwen3-4B-Thinking-2507 --dataset_name hotpotqa/hotpot_qa`, no warm
  start, the dataset's own distractor paragraphs (or `--corpus_path`, or `--retriever remote`), and the hyperparameters
  of `examples/recipes/treeopsd_hotpot_qwen3_4b.yaml`.

Either way the script reports exact match and F1 of greedy answers on held-out questions before and after training,
computed by `trl_tree.envs.agent_eval` (the same agent loop as the trainer's rollouts, and as `eval_hotpot.py`).

Offline defaults are *parser defaults*: they replace the dataclass defaults, and anything given on the command line
or in a `--config` file still wins. They apply when neither a dataset nor a model is given (`--offline_defaults` forces
them on or off). On a machine without a GPU, `bf16` defaults to False and `use_cpu` to True in every setting.
"""

from __future__ import annotations

import json
import os
import sys
import time
from dataclasses import dataclass, field
from typing import Any

from trl import ModelConfig, ScriptArguments, TrlParser

SYNTHETIC_DATASET = "synthetic"  # how the card and the logs name the offline data


@dataclass
class HotpotScriptArguments(ScriptArguments):
    """Script arguments of the HotpotQA search-agent scripts (data, retrieval, warm start, evaluation).

    Args:
        dataset_name (`str` or `None`, *optional*):
            HotpotQA's Hub id (`hotpotqa/hotpot_qa`) or a local file or folder in either HotpotQA layout. `None`: the
            offline synthetic multi-hop world.
        dataset_config (`str`, *optional*, defaults to `"distractor"`):
            HotpotQA configuration (`distractor` or `fullwiki`), or the sub-folder of a local copy.
        dataset_test_split (`str`, *optional*, defaults to `"validation"`):
            Split of the held-out questions evaluated before and after training.
        corpus_path (`str` or `None`, *optional*):
            JSONL corpus (`{"id", "title", "text"}` or Search-R1's `{"id", "contents"}` per line). `None`: the
            distinct context paragraphs of the training and evaluation questions.
        retriever (`str`, *optional*, defaults to `"bm25"`):
            `bm25` (bm25s, index cached on disk), `dense` (E5 via sentence-transformers) or `remote` (a Search-R1
            retrieval server at `retriever_url`, as the paper uses).
    """

    dataset_config: str | None = field(
        default="distractor", metadata={"help": "HotpotQA configuration: 'distractor' or 'fullwiki'."}
    )
    dataset_test_split: str = field(
        default="validation", metadata={"help": "Split of the held-out questions evaluated before and after training."}
    )
    corpus_path: str | None = field(
        default=None,
        metadata={"help": "JSONL retrieval corpus (id/title/text or Search-R1 id/contents). Default: the dataset's "
                  "own context paragraphs."},
    )
    retriever: str = field(
        default="bm25", metadata={"help": "Retriever: 'bm25', 'dense' (E5) or 'remote' (Search-R1 server).",
                                  "choices": ["bm25", "dense", "remote"]}
    )
    retriever_url: str = field(
        default="http://127.0.0.1:8000", metadata={"help": "URL of the Search-R1 retrieval server (retriever=remote)."}
    )
    dense_model: str = field(
        default="intfloat/e5-base-v2", metadata={"help": "Sentence-transformers encoder of retriever=dense."}
    )
    bm25_cache_dir: str | None = field(
        default=None, metadata={"help": "Where to cache BM25 indexes (default: ~/.cache/trl_tree/bm25)."}
    )
    topk: int = field(default=3, metadata={"help": "Passages returned per search (the paper: 3)."})
    long_query: str = field(
        default="truncate",
        metadata={"help": "A query over 512 characters is 'truncate'd (the paper) or answered with an 'error'.",
                  "choices": ["truncate", "error"]},
    )
    num_train: int | None = field(
        default=None, metadata={"help": "Training questions (default: the whole split; offline: see offline_defaults)."}
    )
    num_eval: int = field(
        default=100, metadata={"help": "Held-out questions evaluated before and after training; 0 skips evaluation."}
    )
    eval_batch_size: int = field(default=64, metadata={"help": "Questions decoded together during evaluation."})
    synthetic_seed: int = field(default=0, metadata={"help": "Seed of the synthetic world (offline data)."})
    f1_threshold: float = field(
        default=0.3, metadata={"help": "Training reward: token F1 of the answer when at least this, else 0 (paper)."}
    )
    warm_start_steps: int = field(
        default=0,
        metadata={"help": "SFT steps on scripted search conversations of the training questions before RL (0: none, "
                  "as in the paper). Teaches a small model the tool-call format."},
    )
    warm_start_lr: float = field(default=5e-3, metadata={"help": "Learning rate of the warm start."})
    warm_start_batch_size: int = field(default=8, metadata={"help": "Conversations per warm-start step."})
    offline_defaults: bool | None = field(
        default=None,
        metadata={"help": "Use the small offline defaults (tiny model, synthetic data, a few steps). Default: on when "
                  "neither --dataset_name nor --model_name_or_path is given. Command-line and --config values win."},
    )


# ---------------------------------------------------------------------------------------------------------------
# Methods and defaults
# ---------------------------------------------------------------------------------------------------------------


def _methods() -> dict[str, tuple[type, type]]:
    """Command name -> (config class, trainer class). Imported lazily: `--help` should not pay for the trainers."""
    from trl_tree import TreeOPSDConfig, TreeOPSDTrainer, TreePOConfig, TreePOTrainer

    return {"treeopsd": (TreeOPSDConfig, TreeOPSDTrainer), "treepo": (TreePOConfig, TreePOTrainer)}


METHODS = ("treeopsd", "treepo")

# The offline run: a 2-layer tiny model that only knows the tool-call format from its warm start. Its numbers are
# not the paper's; they show the pipeline end to end in a few minutes on 2 CPU cores.
OFFLINE_SCRIPT_DEFAULTS: dict[str, Any] = {
    "num_train": 64,
    "num_eval": 32,
    "warm_start_steps": 120,
    "warm_start_lr": 5e-3,
    "warm_start_batch_size": 8,
}
OFFLINE_TRAINING_DEFAULTS: dict[str, Any] = {
    "num_initial_rollouts": 4,
    "num_branches": 2,
    "target_radius": 0.25,
    "max_turns": 4,
    "max_completion_length": 320,
    "per_device_train_batch_size": 4,
    "steps_per_generation": 2,  # E = 2 optimizer blocks per generation batch of 8 trees
    "max_steps": 8,
    "learning_rate": 2e-3,
    "lr_scheduler_type": "constant",
    "logging_steps": 1,
    "save_strategy": "no",
    "report_to": "none",
    "seed": 0,
    "bf16": False,
    "gradient_checkpointing": False,
}


def _cpu_only() -> bool:
    import torch

    return not torch.cuda.is_available() and not (hasattr(torch, "xpu") and torch.xpu.is_available())


def machine_defaults() -> dict[str, Any]:
    """Without a GPU, TrainingArguments' bf16 default would fail its own device check: train in fp32 on the CPU."""
    return {"bf16": False, "use_cpu": True} if _cpu_only() else {}


def offline_defaults(method: str) -> dict[str, Any]:
    return {**OFFLINE_SCRIPT_DEFAULTS, **OFFLINE_TRAINING_DEFAULTS, "output_dir": f"outputs/{method}-hotpot-offline"}


def make_parser(method: str = "treeopsd", subparsers=None, prog: str | None = None) -> TrlParser:
    """The parser of one method: `HotpotScriptArguments`, the method's config and TRL's `ModelConfig`."""
    config_class = _methods()[method][0]
    dataclass_types = (HotpotScriptArguments, config_class, ModelConfig)
    if subparsers is not None:
        return subparsers.add_parser(method, help=f"Train a HotpotQA search agent with {config_class.__name__[:-6]}",
                                     dataclass_types=dataclass_types)
    return TrlParser(dataclass_types, prog=prog)


def _wants_offline(argv: list[str]) -> bool:
    """Peek at the data, model and `offline_defaults` arguments (command line and `--config`) without building the
    training config, whose validation depends on the defaults still to be chosen."""
    peek = TrlParser((HotpotScriptArguments, ModelConfig))
    script_args, model_args, _ = peek.parse_args_and_config(argv, return_remaining_strings=True)
    if script_args.offline_defaults is not None:
        return script_args.offline_defaults
    return script_args.dataset_name is None and model_args.model_name_or_path is None


def parse_args(method: str = "treeopsd", argv: list[str] | None = None, prog: str | None = None):
    """(script_args, training_args, model_args) from the command line and `--config`, with the machine's and (when
    offline) the offline defaults in place of the dataclass defaults."""
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = make_parser(method, prog=prog)
    if not {"-h", "--help"} & set(argv):
        defaults = machine_defaults()
        if _wants_offline(argv):
            defaults.update(offline_defaults(method))
        parser.set_defaults_with_config(**defaults)
    return parser.parse_args_and_config(argv)


# ---------------------------------------------------------------------------------------------------------------
# Data, retrieval, model
# ---------------------------------------------------------------------------------------------------------------


def load_questions(script_args: HotpotScriptArguments) -> tuple[list[dict], list[dict]]:
    """Training and held-out questions in HotpotQA's internal form (`trl_tree.envs.hotpot`)."""
    from trl_tree.envs import load_hotpot_examples, synthetic_splits

    num_eval = max(0, script_args.num_eval)
    if script_args.dataset_name is None:
        num_train = script_args.num_train if script_args.num_train is not None else 256
        return synthetic_splits(num_train, num_eval, seed=script_args.synthetic_seed)
    train = load_hotpot_examples(script_args.dataset_name, script_args.dataset_config, script_args.dataset_train_split)
    train = train[: script_args.num_train] if script_args.num_train is not None else train
    held_out = []
    if num_eval:
        held_out = load_hotpot_examples(
            script_args.dataset_name, script_args.dataset_config, script_args.dataset_test_split
        )[:num_eval]
    return train, held_out


def build_retriever(script_args: HotpotScriptArguments, examples: list[dict]):
    """The retriever behind the search tool (see `HotpotScriptArguments.retriever`)."""
    from trl_tree.envs import BM25Retriever, DenseRetriever, RemoteRetriever, build_corpus, load_corpus

    if script_args.retriever == "remote":
        return RemoteRetriever(script_args.retriever_url)
    corpus = load_corpus(script_args.corpus_path) if script_args.corpus_path else build_corpus(examples)
    if script_args.retriever == "dense":
        return DenseRetriever(corpus, model_name=script_args.dense_model)
    if script_args.retriever == "bm25":
        return BM25Retriever(corpus, cache_dir=script_args.bm25_cache_dir)
    raise ValueError(f"retriever must be 'bm25', 'dense' or 'remote'; got {script_args.retriever!r}.")


def build_search_tool(script_args: HotpotScriptArguments, training_args, examples: list[dict]):
    from trl_tree.envs import make_search_tool
    from trl_tree.envs.hotpot import DEFAULT_MAX_CHARS

    return make_search_tool(
        build_retriever(script_args, examples),
        topk=script_args.topk,
        max_chars=training_args.max_observation_chars or DEFAULT_MAX_CHARS,
        long_query=script_args.long_query,
    )


def _model_path(model_args: ModelConfig) -> str:
    from trl_tree.testing import tiny_model_path

    return model_args.model_name_or_path or tiny_model_path()


def load_model_and_tokenizer(model_args: ModelConfig, training_args):
    """The policy and its tokenizer. Loaded here rather than by the trainer, because the warm start and the "before"
    evaluation need the model before the trainer wraps it."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    path = _model_path(model_args)
    dtype = model_args.dtype if model_args.dtype in (None, "auto") else getattr(torch, model_args.dtype)
    kwargs = {"revision": model_args.model_revision, "trust_remote_code": model_args.trust_remote_code, "dtype": dtype}
    if model_args.attn_implementation is not None:
        kwargs["attn_implementation"] = model_args.attn_implementation
    kwargs.update(training_args.model_init_kwargs or {})
    model = AutoModelForCausalLM.from_pretrained(path, **kwargs)
    tokenizer = AutoTokenizer.from_pretrained(path, revision=model_args.model_revision,
                                              trust_remote_code=model_args.trust_remote_code)
    return model, tokenizer


def agent_settings(script_args: HotpotScriptArguments, training_args):
    """Evaluation limits equal to training's, so before/after numbers measure the policy the trainer optimises."""
    from trl_tree.envs.agent_eval import AgentSettings

    return AgentSettings(
        max_turns=training_args.max_turns,
        max_completion_length=training_args.max_completion_length,
        max_observation_chars=training_args.max_observation_chars,
        tool_timeout=training_args.tool_timeout,
        batch_size=script_args.eval_batch_size,
    )


def reward_curve(log_history: list[dict[str, Any]]) -> list[float]:
    """The mean training reward of every logged step (TRL logs `reward` per `logging_steps`)."""
    return [float(entry["reward"]) for entry in log_history if "reward" in entry]


def _format_eval(name: str, result) -> str:
    return (
        f"{name:<7} EM {result.exact_match:6.3f}   F1 {result.f1:6.3f}   well-formed {result.format_rate:5.2f}   "
        f"turns {result.mean_turns:4.2f}   searches {result.mean_tool_calls:4.2f}   ({result.num_questions} questions)"
    )


# ---------------------------------------------------------------------------------------------------------------
# Entry point
# ---------------------------------------------------------------------------------------------------------------


def main(script_args: HotpotScriptArguments, training_args, model_args: ModelConfig) -> dict[str, Any]:
    """Warm start (optional), evaluate, train, save, evaluate again; returns (and saves) the summary.

    The trainer is chosen by the type of `training_args` (`TreeOPSDConfig` -> `TreeOPSDTrainer`, `TreePOConfig` ->
    `TreePOTrainer`). The summary is written to `output_dir/hotpot_results.json`.
    """
    from accelerate import PartialState
    from trl import get_peft_config

    from trl_tree.envs import examples_to_dataset, scripted_search_conversation
    from trl_tree.envs.agent_eval import evaluate_agent, load_model_for_eval
    from trl_tree.rewards import thresholded_f1_reward
    from trl_tree.testing import warm_start

    trainer_class = next(t for c, t in _methods().values() if type(training_args) is c)
    device = training_args.device  # sets up the distributed state the way the trainer will (e.g. use_cpu)
    state = PartialState()
    started = time.time()
    dataset_label = script_args.dataset_name or SYNTHETIC_DATASET

    train_examples, held_out = load_questions(script_args)
    search = build_search_tool(script_args, training_args, train_examples + held_out)
    model, tokenizer = load_model_and_tokenizer(model_args, training_args)
    model.to(device)
    state.print(f"[trl-tree] {trainer_class.__name__} on {dataset_label}: {len(train_examples)} training questions, "
                f"{len(held_out)} held out; model {_model_path(model_args)}")

    summary: dict[str, Any] = {"method": trainer_class._name, "dataset": dataset_label,
                               "model": _model_path(model_args)}
    if script_args.warm_start_steps > 0:
        conversations = [scripted_search_conversation(e, search=search) for e in train_examples]
        t = time.time()
        losses = warm_start(model, tokenizer, conversations, tools=[search], steps=script_args.warm_start_steps,
                            lr=script_args.warm_start_lr, batch_size=script_args.warm_start_batch_size,
                            seed=training_args.seed)
        summary["warm_start_loss"] = [losses[0], losses[-1]]
        state.print(f"[trl-tree] warm start: {len(losses)} SFT steps on scripted search conversations, loss "
                    f"{losses[0]:.3f} -> {losses[-1]:.3f} ({time.time() - t:.0f}s)")

    eval_rows = list(examples_to_dataset(held_out)) if held_out else []
    settings = agent_settings(script_args, training_args)
    if eval_rows:
        before = evaluate_agent(model, tokenizer, eval_rows, [search], settings, accelerator=state)
        summary["before"] = before.summary()
        state.print("[trl-tree] " + _format_eval("before", before))

    trainer = trainer_class(
        model=model,
        reward_funcs=thresholded_f1_reward(script_args.f1_threshold),
        args=training_args,
        train_dataset=examples_to_dataset(train_examples),
        processing_class=tokenizer,
        tools=[search],
        peft_config=get_peft_config(model_args),
    )
    trainer.train(resume_from_checkpoint=training_args.resume_from_checkpoint)
    curve = reward_curve(trainer.state.log_history)
    summary["reward_curve"] = curve
    trainer.save_model(training_args.output_dir)

    if eval_rows:
        # The saved model, as eval_hotpot.py would load it: also correct when training sharded the parameters.
        policy, _ = load_model_for_eval(training_args.output_dir, device=device)
        after = evaluate_agent(policy, tokenizer, eval_rows, [search], settings, accelerator=state)
        summary["after"] = after.summary()
        state.print("[trl-tree] " + _format_eval("after", after))
        del policy

    if training_args.push_to_hub:
        trainer.push_to_hub(dataset_name=dataset_label)

    summary["output_dir"] = training_args.output_dir
    summary["seconds"] = round(time.time() - started, 1)
    if state.is_main_process:
        _print_summary(summary)
        with open(os.path.join(training_args.output_dir, "hotpot_results.json"), "w") as f:
            json.dump(summary, f, indent=2)
    if hasattr(trainer, "end"):
        trainer.end()
    return summary


def _print_summary(summary: dict[str, Any]) -> None:
    curve = summary.get("reward_curve") or []
    lines = ["", f"===== {summary['method']} on {summary['dataset']} ====="]
    if curve:
        k = max(1, len(curve) // 4)
        first, last = sum(curve[:k]) / k, sum(curve[-k:]) / k
        lines.append(f"training reward (F1 >= threshold), {len(curve)} logged steps: first {curve[0]:.3f}, last "
                     f"{curve[-1]:.3f}; mean of first {k}: {first:.3f}, of last {k}: {last:.3f}")
        lines.append("reward curve: " + " ".join(f"{r:.2f}" for r in curve))
    for name in ("before", "after"):
        if name in summary:
            r = summary[name]
            lines.append(f"{name:<6} training: EM {r['exact_match']:.3f}  F1 {r['f1']:.3f}  well-formed "
                         f"{r['format_rate']:.2f}  turns {r['mean_turns']:.2f}  searches {r['mean_tool_calls']:.2f}  "
                         f"({r['num_questions']} held-out questions, greedy)")
    if "before" in summary and "after" in summary:
        gained = summary["after"]["exact_match"] - summary["before"]["exact_match"]
        lines.append(f"EM change on the same held-out questions: {gained:+.3f}")
    lines.append(f"model saved to {summary['output_dir']} ({summary['seconds']:.0f}s in all)")
    print("\n".join(lines), flush=True)


def run(method: str = "treeopsd", argv: list[str] | None = None, prog: str | None = None) -> dict[str, Any]:
    """Parse the command line (and `--config`) for `method`, then `main`."""
    script_args, training_args, model_args = parse_args(method, argv, prog=prog)
    return main(script_args, training_args, model_args)


if __name__ == "__main__":
    run("treeopsd")
