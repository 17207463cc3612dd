"""Train a HotpotQA search agent with a tree trainer: the logic behind `examples/train_hotpot.py` and `trl-tree`.

Two settings share this code:

- **Offline default** (no `--dataset_name`, no `--model_name_or_path`): the tiny Qwen3 of `trl_tree.testing`, briefly
  warm-started (SFT) on scripted search conversations so that it emits parseable tool calls, a synthetic multi-hop
  world (`trl_tree.envs.synthetic`) with BM25 over its paragraphs, and a few steps of the method (TreeOPSD, TreePO,
  AT2PO or TreeAdv, each at the same tree budget), all set in the recipe `trl_tree/recipes/hotpot_offline.yaml`. Runs
  on a CPU in a few minutes, without the Hub.
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
from dataclasses import dataclass, field, fields
from typing import Any

from trl import ModelConfig, ScriptArguments, TrlParser

from trl_tree import methods

SYNTHETIC_DATASET = "synthetic"  # how the card and the logs name the offline data
RESULTS_FILE = "hotpot_results.json"  # the run's summary, next to the model; eval_hotpot.py reads its settings


@dataclass
class HotpotDataArguments(ScriptArguments):
    """Which questions, and how the agent searches: shared by training (`train_hotpot.py`) and `eval_hotpot.py`.

    Args:
        dataset_name (`str` or `None`, *optional*):
            HotpotQA's Hub id (`hotpotqa/hotpot_qa`) or a local file or folder in either HotpotQA layout. `None`: the
            offline synthetic multi-hop world (`trl_tree.envs.synthetic`).
        dataset_config (`str`, *optional*, defaults to `"distractor"`):
            HotpotQA configuration (`distractor` or `fullwiki`), or the sub-folder of a local copy.
        dataset_test_split (`str`, *optional*, defaults to `"validation"`):
            Split of the held-out questions.
        corpus_path (`str` or `None`, *optional*):
            JSONL corpus (`{"id", "title", "text"}` or Search-R1's `{"id", "contents"}` per line). `None`: the
            distinct context paragraphs of the training and held-out questions.
        retriever (`str`, *optional*, defaults to `"bm25"`):
            `bm25` (bm25s, index cached on disk), `dense` (E5 via sentence-transformers), `remote` (a Search-R1
            retrieval server at `retriever_url`, as the paper uses: Search-R1's or `trl-tree retrieval-server`), or
            `server` (start `trl-tree retrieval-server` with BM25 over the same corpus as `bm25` would search, on a
            free port of 127.0.0.1, search through it as `remote` does, and stop it at exit; every process of a
            multi-process run starts its own).
        num_train, num_eval (`int`):
            Questions used for training and held out. The synthetic world is generated from both counts together,
            so evaluating a synthetic-trained model on its held-out questions needs the same two numbers.
    """

    dataset_config: str | None = field(
        default="distractor", metadata={"help": "HotpotQA configuration: 'distractor' or 'fullwiki'."}
    )
    dataset_test_split: str = field(default="validation", metadata={"help": "Split of the held-out questions."})
    corpus_path: str | None = field(
        default=None,
        metadata={
            "help": "JSONL retrieval corpus (id/title/text or Search-R1 id/contents). Default: the dataset's "
            "own context paragraphs."
        },
    )
    retriever: str = field(
        default="bm25",
        metadata={
            "help": "Retriever: 'bm25', 'dense' (E5), 'remote' (a Search-R1 server at --retriever_url) or 'server' "
            "(start `trl-tree retrieval-server` over the same corpus as bm25, and search through it).",
            "choices": ["bm25", "dense", "remote", "server"],
        },
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
        metadata={
            "help": "A query over 512 characters is 'truncate'd (the paper) or answered with an 'error'.",
            "choices": ["truncate", "error"],
        },
    )
    num_train: int | None = field(
        default=None, metadata={"help": "Training questions: the first N of the split (default: all; synthetic: 256)."}
    )
    num_eval: int = field(
        default=100, metadata={"help": "Held-out questions evaluated (greedy, one answer each); 0 skips evaluation."}
    )
    eval_batch_size: int = field(default=64, metadata={"help": "Questions decoded together during evaluation."})
    synthetic_seed: int = field(default=0, metadata={"help": "Seed of the synthetic world (offline data)."})


@dataclass
class HotpotScriptArguments(HotpotDataArguments):
    """Arguments of the training script: data and retrieval (`HotpotDataArguments`), reward, warm start, defaults.

    Args:
        warm_start_steps (`int`, *optional*, defaults to `0`):
            SFT steps on scripted search conversations of the training questions before RL (the paper: none). A
            randomly initialised model never closes a tool call; a brief warm start teaches it the format.
        offline_defaults (`bool` or `None`, *optional*):
            Use the small offline settings (the recipe `trl_tree/recipes/hotpot_offline.yaml`). `None`: on when
            neither `--dataset_name` nor `--model_name_or_path` is given.
    """

    f1_threshold: float = field(
        default=0.3, metadata={"help": "Training reward: token F1 of the answer when at least this, else 0 (paper)."}
    )
    warm_start_steps: int = field(
        default=0,
        metadata={
            "help": "SFT steps on scripted search conversations of the training questions before RL (0: none, "
            "as in the paper). Teaches a small model the tool-call format."
        },
    )
    warm_start_lr: float = field(default=5e-3, metadata={"help": "Learning rate of the warm start."})
    num_eval_train: int = field(
        default=0,
        metadata={
            "help": "Also evaluate the first N training questions before and after training: what RL optimises "
            "(a small model's gains from memorising show here, not on held-out questions)."
        },
    )
    warm_start_batch_size: int = field(default=8, metadata={"help": "Conversations per warm-start step."})
    offline_defaults: bool | None = field(
        default=None,
        metadata={
            "help": "Use the small offline defaults (tiny model, synthetic data, a few steps). Default: on when "
            "neither --dataset_name nor --model_name_or_path is given. Command-line and --config values win."
        },
    )


# ---------------------------------------------------------------------------------------------------------------
# Methods and defaults
# ---------------------------------------------------------------------------------------------------------------


def method_classes(method: str) -> tuple[type, type]:
    """(config class, trainer class) of a method name, from the method table (`trl_tree.methods`)."""
    method_config(method)  # the unknown-name check
    entry = methods.METHODS[method]
    return entry.config_class(), entry.trainer_class()


def example_methods() -> tuple[str, ...]:
    """The methods this example trains: those of the table that declare no reason it cannot
    (`methods.Method.example_unfit`: TreeFlex's two-role agent is not the single-role tool loop that the warm start
    teaches and the before/after evaluation measures)."""
    return tuple(name for name, m in methods.METHODS.items() if not m.example_unfit)


def method_config(method: str) -> type:
    """The config class of any method of the table (the generic script trains every one)."""
    if method not in methods.METHODS:
        raise ValueError(f"Unknown method {method!r}; choose one of {sorted(methods.METHODS)}.")
    return methods.METHODS[method].config_class()


def example_config(method: str) -> type:
    """The config class of a method this example trains, or the method's own reason it does not."""
    unfit = methods.METHODS[method].example_unfit if method in methods.METHODS else ""
    if unfit:
        raise ValueError(f"The HotpotQA example cannot train {method}: {unfit}.")
    return method_config(method)


# The offline run's values live in a recipe file, like the paper's (`examples/recipes/`), shipped with the package.
OFFLINE_RECIPE = "hotpot_offline.yaml"


def _offline_recipe() -> dict[str, Any]:
    import importlib.resources

    import yaml

    return yaml.safe_load(importlib.resources.files("trl_tree").joinpath("recipes", OFFLINE_RECIPE).read_text())


def _checkpointing_key_for_this_transformers(recipe: dict[str, Any]) -> dict[str, Any]:
    """transformers 5.23 renamed `gradient_checkpointing` to `activation_checkpointing` (the old name warns); the
    recipe uses the new name, read as the old one where the installed transformers (>= 5.2 is supported) lacks it."""
    from transformers import TrainingArguments

    if (
        "activation_checkpointing" in recipe
        and "activation_checkpointing" not in TrainingArguments.__dataclass_fields__
    ):
        recipe["gradient_checkpointing"] = recipe.pop("activation_checkpointing")
    return recipe


def _split_offline_recipe() -> tuple[dict[str, Any], dict[str, Any], dict[str, dict[str, Any]]]:
    """(script fields, training-config fields, per-method fields) of the offline recipe."""
    recipe = _checkpointing_key_for_this_transformers(_offline_recipe())
    methods = recipe.pop("methods")
    script_fields = {f.name for f in fields(HotpotScriptArguments)}
    script = {k: v for k, v in recipe.items() if k in script_fields}
    return script, {k: v for k, v in recipe.items() if k not in script_fields}, methods


OFFLINE_SCRIPT_DEFAULTS, OFFLINE_TRAINING_DEFAULTS, OFFLINE_METHOD_DEFAULTS = _split_offline_recipe()


def _cpu_only() -> bool:
    import torch

    return not torch.cuda.is_available() and not (hasattr(torch, "xpu") and torch.xpu.is_available())


def machine_defaults() -> dict[str, Any]:
    """Without a GPU, TrainingArguments' bf16 default would fail its own device check: train in fp32 on the CPU."""
    return {"bf16": False, "use_cpu": True} if _cpu_only() else {}


def offline_defaults(method: str) -> dict[str, Any]:
    return {
        **OFFLINE_SCRIPT_DEFAULTS,
        **OFFLINE_TRAINING_DEFAULTS,
        **OFFLINE_METHOD_DEFAULTS.get(method, {}),
        "output_dir": f"outputs/{method}-hotpot-offline",
    }


# what `--help` adds: the command is not limited to HotpotQA
_OTHER_DATA = (
    "This is the HotpotQA example. To train on any dataset, name the reward functions (and tools or an environment) "
    "by import path: --dataset_name DATA --model_name_or_path MODEL --reward_funcs my_pkg.rewards.f1 [--tools "
    "my_pkg.tools.search | --environment_factory my_pkg.env.Env]; add --help to those for all their options."
)


def make_parser(method: str = "treeopsd", prog: str | None = None) -> TrlParser:
    """The parser of one method: `HotpotScriptArguments`, the method's config and TRL's `ModelConfig`."""
    return TrlParser((HotpotScriptArguments, example_config(method), ModelConfig), prog=prog, epilog=_OTHER_DATA)


def _wants_offline(argv: list[str]) -> bool:
    """Peek at the data, model and `offline_defaults` arguments (command line and `--config`) without building the
    training config, whose validation depends on the defaults still to be chosen."""
    from trl_tree.scripts import is_tiny_model_name

    peek = TrlParser((HotpotScriptArguments, ModelConfig))
    script_args, model_args, _ = peek.parse_args_and_config(argv, return_remaining_strings=True)
    if script_args.offline_defaults is not None:
        return script_args.offline_defaults
    model = model_args.model_name_or_path
    return script_args.dataset_name is None and (model is None or is_tiny_model_name(model))


def prepared_parser(method: str, argv: list[str], prog: str | None = None) -> TrlParser:
    """The method's parser with the machine's and (when offline) the offline defaults in place of the dataclass
    defaults; `argv` is only peeked at (`--help` gets the plain parser, whose help lists the dataclass defaults)."""
    parser = make_parser(method, prog=prog)
    if not {"-h", "--help"} & set(argv):
        defaults = machine_defaults()
        if _wants_offline(argv):
            defaults.update(offline_defaults(method))
        parser.set_defaults_with_config(**defaults)
    return parser


def parse_args(method: str = "treeopsd", argv: list[str] | None = None, prog: str | None = None):
    """(script_args, training_args, model_args) from the command line and `--config`, over the defaults of
    `prepared_parser`. The model `tiny` is the offline default's tiny model, as if none were named."""
    from trl_tree.scripts import is_tiny_model_name

    argv = list(sys.argv[1:] if argv is None else argv)
    script_args, training_args, model_args = prepared_parser(method, argv, prog=prog).parse_args_and_config(argv)
    if is_tiny_model_name(model_args.model_name_or_path):
        model_args.model_name_or_path = None  # `_model_path` gives the tiny model, and the summary says it is
    return script_args, training_args, model_args


# ---------------------------------------------------------------------------------------------------------------
# Data, retrieval, model
# ---------------------------------------------------------------------------------------------------------------


def load_questions(script_args: HotpotDataArguments) -> tuple[list[dict], list[dict]]:
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


# the retrieval servers this process started (`--retriever server`), stopped by `main` when it ends, or at exit
_OWN_SERVERS: list = []


def start_retrieval_server(script_args: HotpotDataArguments, examples: list[dict]):
    """`trl-tree retrieval-server` as a child process, with BM25 over the corpus `--retriever bm25` would search: the
    `--corpus_path` file, else the questions' own paragraphs, written to a JSONL file for it. Returns the running
    `RetrievalServerProcess` (its `url`)."""
    import tempfile

    from trl_tree.envs import build_corpus
    from trl_tree.envs.retrieval_server import RetrievalServerProcess, write_corpus

    corpus_path, owned = script_args.corpus_path, []
    if corpus_path is None:
        owned.append(tempfile.mkdtemp(prefix="trl-tree-corpus-"))
        corpus_path = str(write_corpus(build_corpus(examples), os.path.join(owned[0], "corpus.jsonl")))
    server_args = ["--corpus_path", corpus_path, "--topk", str(script_args.topk)]
    if script_args.bm25_cache_dir:
        server_args += ["--bm25_cache_dir", script_args.bm25_cache_dir]
    server = RetrievalServerProcess(server_args, owned_paths=owned)
    _OWN_SERVERS.append(server)
    server.start()
    print(f"[trl-tree] retrieval server started at {server.url} (log: {server.log_path})", flush=True)
    return server


def stop_retrieval_servers() -> None:
    """Stop the retrieval servers this process started (`--retriever server`)."""
    while _OWN_SERVERS:
        _OWN_SERVERS.pop().stop()


def build_retriever(script_args: HotpotDataArguments, examples: list[dict], deadline: float | None = None):
    """The retriever behind the search tool (see `HotpotScriptArguments.retriever`). `deadline`: the seconds a remote
    search may take, retries included (the trainer's `tool_timeout`: past it nobody waits for the search)."""
    from trl_tree.envs import BM25Retriever, DenseRetriever, RemoteRetriever, build_corpus, load_corpus

    if script_args.retriever in ("remote", "server"):
        url, server = script_args.retriever_url, None
        if script_args.retriever == "server":
            server = start_retrieval_server(script_args, examples)
            url = server.url
        # One search now: without it a missing server shows only after the model has loaded, as searches that all
        # fail (and then a stopped run). A server of our own is polled before every search: its exit stops the run.
        retriever = RemoteRetriever(url, deadline=deadline, server=server)
        try:
            retriever.check()
        except ConnectionError as e:
            raise ConnectionError(
                f"{e} Or pass the address of a running server with --retriever_url, or search without a server: "
                "--retriever bm25."
            ) from e.__cause__
        return retriever
    corpus = load_corpus(script_args.corpus_path) if script_args.corpus_path else build_corpus(examples)
    if script_args.retriever == "dense":
        return DenseRetriever(corpus, model_name=script_args.dense_model)
    if script_args.retriever == "bm25":
        return BM25Retriever(corpus, cache_dir=script_args.bm25_cache_dir)
    raise ValueError(f"retriever must be 'bm25', 'dense', 'remote' or 'server'; got {script_args.retriever!r}.")


def build_search_tool(script_args: HotpotScriptArguments, training_args, examples: list[dict]):
    from trl_tree.envs import make_search_tool
    from trl_tree.envs.hotpot import DEFAULT_MAX_CHARS

    return make_search_tool(
        build_retriever(script_args, examples, deadline=training_args.tool_timeout),
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
    remote_code = getattr(training_args, "trust_remote_code", False)
    kwargs = {"revision": model_args.model_revision, "trust_remote_code": remote_code, "dtype": dtype}
    if model_args.attn_implementation is not None:
        kwargs["attn_implementation"] = model_args.attn_implementation
    kwargs.update(training_args.model_init_kwargs or {})
    model = AutoModelForCausalLM.from_pretrained(path, **kwargs)
    tokenizer = AutoTokenizer.from_pretrained(path, revision=model_args.model_revision, trust_remote_code=remote_code)
    return model, tokenizer


def agent_settings(script_args: HotpotScriptArguments, training_args):
    """Evaluation limits equal to training's, so before/after numbers measure the policy the trainer optimises."""
    from trl_tree.envs.agent_eval import AgentSettings

    return AgentSettings.from_config(training_args, batch_size=script_args.eval_batch_size)


def reward_curve(log_history: list[dict[str, Any]]) -> list[float]:
    """The mean training reward of every logged step (TRL logs `reward` per `logging_steps`)."""
    return [float(entry["reward"]) for entry in log_history if "reward" in entry]


def describe_reward_curve(curve: list[float]) -> str:
    """One line on a training-reward curve that means what it says: the means of its first and last thirds (a single
    first or last point of a noisy curve says little), and the curve itself when it is short."""
    if not curve:
        return "no training reward was logged"
    points = " ".join(f"{r:.2f}" for r in curve)
    if len(curve) < 3:
        return f"training reward per logged step: {points}"
    third = -(-len(curve) // 3)  # rounded up: 4 points give halves, not a single first and last point
    first, last = sum(curve[:third]) / third, sum(curve[-third:]) / third
    shown = f": {points}" if len(curve) <= 24 else f" ({len(curve)} logged steps)"
    return (
        f"training reward{shown}; mean of the first third {first:.3f}, of the last third {last:.3f} "
        f"({last - first:+.3f})"
    )


def tree_view_index(output_dir: str) -> str | None:
    """The run's rollout-tree index page (written with log_completions), or None."""
    from trl_tree.tree_view import INDEX, VIEW_DIR

    path = os.path.join(output_dir, VIEW_DIR, f"{INDEX}.html")
    return path if os.path.isfile(path) else None


def _format_eval(name: str, result) -> str:
    return (
        f"{name:<12} EM {result.exact_match:6.3f}   F1 {result.f1:6.3f}   well-formed {result.format_rate:5.2f}   "
        f"turns {result.mean_turns:4.2f}   searches {result.mean_tool_calls:4.2f}   ({result.num_questions} questions)"
    )


# ---------------------------------------------------------------------------------------------------------------
# Entry point
# ---------------------------------------------------------------------------------------------------------------


def trainer_class_for(training_args) -> type:
    """The trainer of a method's config (`TreeOPSDConfig` -> `TreeOPSDTrainer`, ...), from the method table."""
    method = methods.method_of_config(training_args)
    if method is None:
        raise TypeError(
            f"training_args must be one of the methods' configs {tuple(methods.METHODS)}; got {type(training_args)}."
        )
    return method.trainer_class()


def warm_start_policy(model, tokenizer, search, train_examples, script_args, training_args, model_args, state):
    """SFT on scripted search conversations of the training questions, in place; returns the first and last loss.

    Cached by everything that determines the weights (`trl_tree.warm_start.cached_warm_start`): a rerun with the
    same model, questions, tool and warm-start settings loads the result instead of training again."""
    from trl_tree.envs import scripted_search_conversation
    from trl_tree.warm_start import cached_warm_start, model_fingerprint

    conversations = [scripted_search_conversation(e, search=search) for e in train_examples]
    started = time.time()
    result = cached_warm_start(
        model,
        tokenizer,
        conversations,
        base=model_fingerprint(_model_path(model_args), model_args.model_revision),
        tools=[search],
        steps=script_args.warm_start_steps,
        lr=script_args.warm_start_lr,
        batch_size=script_args.warm_start_batch_size,
        seed=training_args.seed,
        save=state.is_main_process,
        progress=state.is_main_process,
    )
    if model_args.use_peft:
        _save_warm_started_base(model, tokenizer, training_args.output_dir, state)
    losses = result.losses
    how = f"loaded from {result.path}" if result.cached else f"{time.time() - started:.0f}s, cached in {result.path}"
    state.print(
        f"[trl-tree] warm start: {len(losses)} SFT steps on scripted search conversations, loss "
        f"{losses[0]:.3f} -> {losses[-1]:.3f} ({how})"
    )
    return [losses[0], losses[-1]]


def _save_warm_started_base(model, tokenizer, output_dir: str, state) -> None:
    """A LoRA adapter is saved relative to its base model's path; the base it trains on is the warm-started model, so
    save that next to the adapter and make it the path the adapter records."""
    base_dir = os.path.join(output_dir, "warm_start_base")
    if state.is_main_process:
        model.save_pretrained(base_dir)
        tokenizer.save_pretrained(base_dir)
    state.wait_for_everyone()
    model.name_or_path = model.config._name_or_path = os.path.abspath(base_dir)


def evaluation_sets(script_args: HotpotScriptArguments, train_examples, held_out) -> dict[str, list]:
    """Prefix of the summary keys -> questions evaluated before and after training: held out (""), and the first
    `num_eval_train` training questions ("train_"). Empty sets are left out."""
    from trl_tree.envs import examples_to_dataset

    sets = {"": held_out, "train_": train_examples[: script_args.num_eval_train]}
    return {prefix: list(examples_to_dataset(rows)) for prefix, rows in sets.items() if rows}


def evaluate(model, tokenizer, evaluations, search, settings, state, when: str) -> dict[str, Any]:
    """Greedy EM / F1 of `model` on every evaluation set, as summary entries `<prefix><when>` (printed too)."""
    from trl_tree.envs.agent_eval import evaluate_agent

    results = {}
    for prefix, rows in evaluations.items():
        result = evaluate_agent(model, tokenizer, rows, [search], settings, accelerator=state)
        results[prefix + when] = result.summary()
        state.print("[trl-tree] " + _format_eval(prefix + when, result))
    return results


def evaluate_saved(output_dir: str, tokenizer, evaluations, search, settings, state, device) -> dict[str, Any]:
    """`evaluate` on the saved model, as eval_hotpot.py would load it: also correct when training sharded the
    parameters."""
    from trl_tree.envs.agent_eval import load_model_for_eval

    policy, _ = load_model_for_eval(output_dir, device=device)
    results = evaluate(policy, tokenizer, evaluations, search, settings, state, "after")
    del policy
    return results


def train(trainer_class, model, tokenizer, search, train_examples, script_args, training_args, model_args):
    """Build the method's trainer on the training questions with the search tool and the thresholded F1 reward,
    train, and save the model to `output_dir`."""
    from trl import get_peft_config

    from trl_tree.envs import examples_to_dataset
    from trl_tree.rewards import thresholded_f1_reward

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
    trainer.save_model(training_args.output_dir)
    return trainer


def run_settings(script_args: HotpotScriptArguments, training_args, train_examples, held_out) -> dict[str, Any]:
    """What eval_hotpot.py needs to score the saved model on the same questions, with the same limits."""
    return {
        "dataset_name": script_args.dataset_name,
        "dataset_config": script_args.dataset_config,
        "dataset_train_split": script_args.dataset_train_split,
        "dataset_test_split": script_args.dataset_test_split,
        "num_train": len(train_examples),
        "num_eval": len(held_out),
        "synthetic_seed": script_args.synthetic_seed,
        "corpus_path": script_args.corpus_path,
        "retriever": script_args.retriever,
        "retriever_url": script_args.retriever_url,
        "dense_model": script_args.dense_model,
        "topk": script_args.topk,
        "long_query": script_args.long_query,
        "max_turns": training_args.max_turns,
        "max_completion_length": training_args.max_completion_length,
        "max_observation_chars": training_args.max_observation_chars,
    }


def main(script_args: HotpotScriptArguments, training_args, model_args: ModelConfig) -> dict[str, Any]:
    """Warm start (optional), evaluate, train, save, evaluate again; returns (and saves) the summary.

    The trainer is chosen by the type of `training_args` (`trainer_class_for`). The summary is written to
    `output_dir/hotpot_results.json` (`RESULTS_FILE`). A retrieval server it started (`--retriever server`) is
    stopped when it returns or fails.
    """
    try:
        return _main(script_args, training_args, model_args)
    finally:
        stop_retrieval_servers()


def _main(script_args: HotpotScriptArguments, training_args, model_args: ModelConfig) -> dict[str, Any]:
    from accelerate import PartialState

    trainer_class = trainer_class_for(training_args)
    device = training_args.device  # sets up the distributed state the way the trainer will (e.g. use_cpu)
    state = PartialState()
    started = time.time()
    dataset_label = script_args.dataset_name or SYNTHETIC_DATASET

    train_examples, held_out = load_questions(script_args)
    search = build_search_tool(script_args, training_args, train_examples + held_out)
    model, tokenizer = load_model_and_tokenizer(model_args, training_args)
    model.to(device)
    state.print(
        f"[trl-tree] {trainer_class.__name__} on {dataset_label}: {len(train_examples)} training questions, "
        f"{len(held_out)} held out; model {_model_path(model_args)}"
    )
    summary: dict[str, Any] = {
        "method": trainer_class._name,
        "dataset": dataset_label,
        "model": _model_path(model_args),
        "tiny_model": model_args.model_name_or_path is None,
    }
    if script_args.warm_start_steps > 0:
        summary["warm_start_loss"] = warm_start_policy(
            model, tokenizer, search, train_examples, script_args, training_args, model_args, state
        )

    settings = agent_settings(script_args, training_args)
    evaluations = evaluation_sets(script_args, train_examples, held_out)
    summary.update(evaluate(model, tokenizer, evaluations, search, settings, state, "before"))
    trainer = train(trainer_class, model, tokenizer, search, train_examples, script_args, training_args, model_args)
    summary["reward_curve"] = reward_curve(trainer.state.log_history)
    state.wait_for_everyone()  # the main process writes the weights that every process evaluates next
    if evaluations:
        summary.update(
            evaluate_saved(training_args.output_dir, tokenizer, evaluations, search, settings, state, device)
        )

    summary["settings"] = run_settings(script_args, training_args, train_examples, held_out)
    summary["output_dir"] = training_args.output_dir
    summary["tree_view"] = tree_view_index(training_args.output_dir)
    summary["seconds"] = round(time.time() - started, 1)
    if state.is_main_process:
        with open(os.path.join(training_args.output_dir, RESULTS_FILE), "w") as f:
            json.dump(summary, f, indent=2)
    if training_args.push_to_hub:  # after the results file, so the Hub repo has it next to the weights and card
        trainer.push_to_hub(dataset_name=dataset_label)
    if state.is_main_process:
        _print_summary(summary)
    trainer.end()  # every process waits for the others, then the trackers finish and the process group goes
    return summary


def _print_summary(summary: dict[str, Any]) -> None:
    curve = summary.get("reward_curve") or []
    lines = ["", f"===== {summary['method']} on {summary['dataset']} ====="]
    if curve:
        lines.append(describe_reward_curve(curve) + " (each point: the mean over its trees' leaves)")
        if max(curve) == 0.0:
            lines.append(
                "note: no leaf of any tree earned a reward, so every tree's rewards were equal and its turn credit "
                "was 0 (TreeOPSD's teachers sat at q = 1/2; the clipped losses had no advantage to follow): the "
                "policy had nothing to learn from. A model that never answers correctly, even by chance, cannot be "
                "improved by outcome rewards; warm-start it longer (--warm_start_steps) or start from a capable model "
                "(--model_name_or_path)."
            )
    for prefix, what in (("", "held-out"), ("train_", "training")):
        for name in ("before", "after"):
            if prefix + name in summary:
                r = summary[prefix + name]
                lines.append(
                    f"{name:<6} training: EM {r['exact_match']:.3f}  F1 {r['f1']:.3f}  well-formed "
                    f"{r['format_rate']:.2f}  turns {r['mean_turns']:.2f}  searches {r['mean_tool_calls']:.2f}  "
                    f"({r['num_questions']} {what} questions, greedy)"
                )
        if prefix + "before" in summary and prefix + "after" in summary:
            before, after = summary[prefix + "before"], summary[prefix + "after"]
            lines.append(
                f"EM change on the same {what} questions: {after['exact_match'] - before['exact_match']:+.3f}"
            )
            if after["format_rate"] < before["format_rate"] - 0.05:
                lines.append(
                    f"note: fewer {what} answers are well-formed after training ({before['format_rate']:.2f} -> "
                    f"{after['format_rate']:.2f}): RL moved the policy away from the warm start's format on these "
                    "questions; the tree-view pages show the malformed calls (filter: failed or malformed)."
                )
    if summary.get("tiny_model"):
        lines.append(
            "note: the offline default trains a 2-layer tiny model for a few minutes; it memorises its training "
            "questions but cannot learn to copy unseen names, so held-out numbers stay near 0 and show the pipeline "
            "working end to end, not the method's gains (see examples/recipes/ for the paper's setting)."
        )
    lines.append(f"model saved to {summary['output_dir']} ({summary['seconds']:.0f}s in all)")
    if summary.get("tree_view"):
        lines.append(
            f"rollout trees: open {summary['tree_view']} in a browser "
            f"(`trl-tree view {summary['output_dir']}` renders them again)"
        )
    print("\n".join(lines), flush=True)


def run(method: str = "treeopsd", argv: list[str] | None = None, prog: str | None = None) -> dict[str, Any]:
    """The command-line entry point: parse the command line (and `--config`) for `method`, then `main`."""
    script_args, training_args, model_args = parse_args(method, argv, prog=prog)
    if model_args.model_name_or_path is None and training_args.use_cpu and "OMP_NUM_THREADS" not in os.environ:
        import torch

        # The tiny model's matrices are too small to split across cores, so threads only wait for each other
        # (benchmarks/README.md, section 5). `accelerate launch` already sets OMP_NUM_THREADS=1.
        torch.set_num_threads(1)
    return main(script_args, training_args, model_args)


if __name__ == "__main__":
    run("treeopsd")
