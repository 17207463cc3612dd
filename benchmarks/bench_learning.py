"""Does the paper's ordering (TreeOPSD above TreePO above GRPO) hold at tiny scale? Held-out exact match against
rollout tokens spent, on the synthetic multi-hop search task, at a matched rollout budget.

Every method starts from the same warm-started model (a short SFT on scripted search trajectories, cached) and trains
on the same questions with the same BM25 `search` tool, reward (token F1 of the `<answer>` span, thresholded at 0.3,
as in the paper), turn and token limits, P prompts per generation batch and E optimizer steps per generation batch:

    grpo        GRPOTrainer, G = 8 completions per prompt
    treepo      TreePOTrainer, one (M, N) = (4, 2) tree per prompt, fixed credit V_i / L_x
    treeopsd    TreeOPSDTrainer, the same trees, the Bernoulli forward-KL to the bounded teacher q = 1/2 + V/τ
    at2po       AT2POTrainer (opt-in), M = 4 initial trajectories and 2 rounds of 4 entropy-guided branches
    treeadv     TreeAdvTrainer (opt-in), M = 4 initial trajectories and up to 8 token-level branches
    flat_grpo   (opt-in) GRPO on trl-tree's own loop: TreeConfig(sampler="flat", credit="path", loss="grpo"), G = 8
                independent trajectories per prompt, packed like the trees: GRPO at the trees' implementation, so
                that a difference from the trees is the sampling and the credit, not TRL's loop against trl-tree's

M(1 + N/2) = G matches the expected generated trajectories per prompt. Before training and every `--eval_every`
generation batches, the policy answers `--num_test` held-out questions greedily with the same agent loop
(`trl_tree.envs.agent_eval`): EM, F1 and the rate of well-formed answers are recorded against the rollout tokens the
method has sampled so far (policy tokens only; observations are not generated). Each method runs `--seeds` seeds (the
seed drives sampling, anchors and data order; the warm start is shared). Output: a table of mean ± std over seeds,
a PNG plot (matplotlib: `pip install trl-tree[plot]`) and, with `--output`, JSON.

`--model smollm2` runs the same comparison with a real pretrained model, SmolLM2-135M-Instruct
(`trl_tree.testing.smollm2_path`, offline): a LoRA warm start merged into the weights (shared by every method and
seed), LoRA RL, 128 held-out questions, turns capped at `--max_turn_tokens`. With `--output FILE`, every method-seed
run writes its own result (`FILE` without `.json`, + `.runs/METHOD-seedSEED.json`) as soon as it finishes, and a later
invocation skips the runs whose result is there, so a table too long for one sitting is completed over several; the
summary JSON, a Markdown table (`.md`) and the plot (`.png`, unless `--plot` says where) are written from every run
result present. `--warm_start_sweep 5,10,20` measures the held-out success of warm starts of those lengths instead.

`--max_staleness S` (issue 57, benchmarks/analysis_plan.md F) trains trl-tree's methods with asynchronous rollouts: a
rollout worker grows the next generation batches while the trainer trains, batch j sampled by the policy of batch
max(0, j − S) (`TreeConfig.max_staleness`, docs/design.md §9). S is part of a run's identity: with S > 0 the table is
`FILE_sS.json` (its runs in `FILE_sS.runs/`), never the synchronous table of `FILE`, and each run file stores what the
trainer logged about its staleness and waits (`async`). TRL's `GRPOTrainer` (`grpo`) is synchronous: refused at S > 0.

Usage:
    python benchmarks/bench_learning.py --output learning.json --plot learning.png
    python benchmarks/bench_learning.py --model smollm2 --methods grpo,treepo,treeopsd --seeds 0,1,2 --output FILE
    python benchmarks/bench_learning.py --model smollm2 --methods treeopsd --max_staleness 1 --output FILE
    python benchmarks/bench_learning.py --quick
"""

from __future__ import annotations

import argparse
import hashlib
import json
import math
import random
import shutil
import statistics
import tempfile
import textwrap
import time
from pathlib import Path

import torch
from common import (
    TASK_LIMITS,
    TASK_SIZES,
    BatchMeter,
    HeldOutKL,
    add_budget_arguments,
    budget_from_args,
    build_trainer,
    cache_root,
    environment,
    fill_task_defaults,
    held_out_examples,
    load_model,
    lora_config,
    make_task,
    markdown_table,
    portable,
    runs_dir_of,
    warm_started_model,
    write_json,
)
from stats import collapsed
from transformers import TrainerCallback
from transformers.trainer_callback import PrinterCallback

from trl_tree.rewards import format_reward

# treeopsd_no_anchor / treepo_anchor: issue 40's ablation (`common.LOSS_VARIANTS`: TreeOPSD without its q = 1/2 pull
# on zero-credit turns, TreePO with it)
# flat_grpo: issue 58's control, GRPO sampled and trained by trl-tree's loop (`common.matched_sampler_fields`)
METHODS = ("grpo", "treepo", "treeopsd", "at2po", "treeadv", "treeopsd_no_anchor", "treepo_anchor", "flat_grpo")
DEFAULT_METHODS = ("grpo", "treepo", "treeopsd")
# What `--model smollm2` changes (each still overridable on the command line). The warm start (10 LoRA steps) leaves
# held-out success well inside (0, 1) (see benchmarks/README.md); turns are capped so that one rambling sampled turn
# does not hold a whole generate call open; held-out questions are 128 (32 give a standard error near 0.09). The
# scripted two-search trajectory is about 330 completion tokens with SmolLM2's tokenizer (305 before the answer turn,
# at most 341): 448 leaves room for the answer, where 320 ended most trajectories before it.
MODEL_DEFAULTS = {
    "tiny": {},
    "smollm2": dict(warm_start_steps=10, warm_start_lr=1e-3, warm_start_batch_size=4, lora_rank=16, num_test=128,
                    learning_rate=2e-4, max_turns=3, max_completion_length=448, max_turn_tokens=64, prompts=2,
                    blocks=1, generation_batches=8, eval_every=4),
}


def _seed_list(text: str) -> list[int]:
    try:
        seeds = [int(s) for s in text.split(",") if s.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"--seeds takes comma-separated integers such as 0,1,2; got {text!r}") from None
    if not seeds or len(set(seeds)) != len(seeds):
        raise argparse.ArgumentTypeError(f"--seeds needs distinct seeds such as 0,1,2; got {text!r}")
    return seeds


def _staleness(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        value = -1
    if value < 0:
        raise argparse.ArgumentTypeError(f"--max_staleness takes an integer >= 0 (0: synchronous); got {text!r}")
    return value


def staleness_output(output: str, max_staleness: int) -> str:
    """Where the table of runs at `max_staleness` lives: `output` itself at 0; `FILE_sS.json` (its runs in
    `FILE_sS.runs/`) at S > 0, unless the name already ends in `_sS`. So the command of a synchronous table with
    `--max_staleness S` added writes the staleness arm beside that table, never into it."""
    path, suffix = Path(output), f"_s{max_staleness}"
    if max_staleness == 0 or path.stem.endswith(suffix):
        return output
    return str(path.with_name(path.stem + suffix + path.suffix))


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--model", choices=sorted(MODEL_DEFAULTS), default="tiny",
                   help="tiny: the 2-layer offline Qwen3 (full fine-tuning); smollm2: SmolLM2-135M-Instruct "
                        "(trl_tree.testing.smollm2_path; LoRA warm start and RL)")
    p.add_argument("--model_name_or_path", default=None, help="base model folder or Hub id (overrides --model's)")
    p.add_argument("--methods", default=",".join(DEFAULT_METHODS), help=f"comma-separated subset of {list(METHODS)}")
    p.add_argument("--seeds", type=_seed_list, default=[0, 1, 2], help="comma-separated seeds (default 0,1,2)")
    p.add_argument("--generation_batches", type=int, default=10, help="generation batches per run")
    p.add_argument("--eval_every", type=int, default=2, help="evaluate every this many generation batches")
    p.add_argument("--task", choices=sorted(TASK_LIMITS), default="search",
                   help="search: synthetic multi-hop QA with BM25 (the paper's setting, EM); calculator: arithmetic "
                        "with one tool call, a task the tiny model can do (held-out reward = exact final answer)")
    add_budget_arguments(p, learning_rate=2e-4, max_turns=None, max_completion_length=None)
    p.add_argument("--format_reward_weight", type=float, default=0.0,
                   help="add the well-formed-answer reward with this weight (0: the paper's reward alone)")
    p.add_argument("--num_train", type=int, default=None, help="training questions (default: 200 search, 64 calculator)")
    p.add_argument("--num_test", type=int, default=None, help="held-out questions (default: 48 search, 32 calculator; "
                   "the search world is built from both counts, so changing them changes the cached warm start)")
    p.add_argument("--num_eval", type=int, default=None,
                   help="evaluate only the first N held-out questions (default: all --num_test): a quicker, noisier "
                        "evaluation of the same world, so the cached warm start is reused")
    p.add_argument("--warm_start_steps", type=int, default=None,
                   help="SFT steps on scripted trajectories (cached; default: 600 search, 150 calculator; smollm2 10)")
    p.add_argument("--warm_start_lr", type=float, default=3e-3, help="learning rate of the warm start")
    p.add_argument("--warm_start_batch_size", type=int, default=8, help="conversations per warm-start step")
    p.add_argument("--lora_rank", type=int, default=None,
                   help="train LoRA adapters of this rank (warm start and RL) instead of the whole model")
    p.add_argument("--topk", type=int, default=None, help="passages per search (search task; default 2)")
    p.add_argument("--rollout_token_budget", type=int, default=None,
                   help="end a run at the first generation batch by which it has sampled this many rollout tokens "
                        "(matched budgets whatever each method's turns cost; default: --generation_batches only)")
    p.add_argument("--warm_start_sweep", default=None,
                   help="comma-separated warm-start lengths: measure each one's held-out success and exit")
    p.add_argument("--threads", type=int, default=None, help="torch threads (default: 1 on CPU)")
    p.add_argument("--grpo_micro_batch", type=int, default=None,
                   help="GRPO: sequences per micro-batch, gradients accumulated over the step (default: the whole "
                        "step at once; 4 bounds the training forward's memory, the same step up to rounding)")
    p.add_argument("--gradient_checkpointing", action=argparse.BooleanOptionalAction, default=True,
                   help="recompute activations in the backward pass (GRPOConfig's default, kept: without it GRPO's "
                        "16 unpacked SmolLM2 trajectories need ~18 GB; numerically the same either way)")
    p.add_argument("--max_staleness", type=_staleness, default=0, metavar="S",
                   help="asynchronous rollouts for trl-tree's methods: a rollout worker grows generation batch j with "
                        "the policy of batch max(0, j - S) while the trainer trains (TreeConfig.max_staleness). 0 "
                        "(default): synchronous, as every table before it. With S > 0 the table is --output's name + "
                        "_sS (FILE_sS.json, its runs in FILE_sS.runs/). Not for grpo (TRL's GRPOTrainer is synchronous)")
    p.add_argument("--drift_trajectories", type=int, default=8, metavar="K",
                   help="search task: at every evaluation, the drift from the warm start, KL(warm start || policy) per "
                        "assistant token teacher-forced on K scripted held-out trajectories (`heldout_kl`; the "
                        "stability map's measure, which uses 8). 0: not measured")
    p.add_argument("--quick", action="store_true",
                   help="smoke run: 1 seed, 1 generation batch of 2 prompts, 2 test questions, no warm start")
    p.add_argument("--tree_view", default=None, metavar="DIR",
                   help="tree methods: save each run's rollout-tree pages (log_completions) under DIR/METHOD-seedS/")
    p.add_argument("--plot", default=None, help="write the EM-vs-rollout-tokens plot here (PNG)")
    p.add_argument("--output", default=None, help="write the results as JSON here")
    p.add_argument("--equivalent_warm_starts", default=None,
                   help="comma-separated warm-start weight hashes (a run file's `warm_start_sha256`) to treat as one "
                        "warm start: the same folder (data and recipe) built on machines whose kernels round "
                        "differently (docs/design.md, section 7). Accepted only while every run of the table starts "
                        "from the same held-out metrics; each run file keeps its own hash")
    p.add_argument("--check_warm_start", default=None, metavar="FILE",
                   help="train nothing: build (or read from the cache) this machine's warm start and write to FILE "
                        "its weights hash, the machine's kernel fingerprint, its held-out point, and, for each run "
                        "next to --output, whether that run started from the same weights or the same held-out point "
                        "(can this machine extend that table?)")
    p.add_argument("--report_only", action="store_true",
                   help="train nothing: rewrite the table, plot and summary of --output from the run files present "
                        "for --methods and --seeds (an unfinished table, e.g. mid-way through the sittings)")
    model_name = p.parse_known_args(argv)[0].model
    p.set_defaults(**MODEL_DEFAULTS[model_name])
    args = p.parse_args(argv)
    fill_task_defaults(args)
    args.num_train = args.num_train or TASK_SIZES[args.task][0]
    args.num_test = args.num_test or TASK_SIZES[args.task][1]
    if args.quick:
        args.seeds, args.generation_batches, args.eval_every, args.prompts, args.blocks = [0], 1, 1, 2, 1
        args.num_train, args.num_test, args.warm_start_steps = 8, 2, 0
        args.max_turns, args.max_completion_length = 2, 48
    args.methods = [m.strip() for m in args.methods.split(",") if m.strip()]
    if set(args.methods) - set(METHODS):
        p.error(f"unknown methods {sorted(set(args.methods) - set(METHODS))}; choose from {list(METHODS)}")
    if args.max_staleness and "grpo" in args.methods:
        p.error(f"--max_staleness {args.max_staleness}: method grpo is TRL's GRPOTrainer, which trains synchronously "
                "here (it has no rollout worker). Drop grpo from --methods, or train flat_grpo (GRPO's loss on "
                "trl-tree's own loop, which takes --max_staleness).")
    if args.output:
        args.output = staleness_output(args.output, args.max_staleness)
    if args.check_warm_start and (problem := check_file_problem(args.check_warm_start, args.output)):
        p.error(problem)
    return args


def check_file_problem(path: str, output: str | None) -> str | None:
    """Why `--check_warm_start FILE` must not be written (None if it may): the check writes FILE whole, so FILE must
    be a new file or an earlier check's, never --output's table or any other result it would erase."""
    if output and Path(path).resolve() == Path(output).resolve():
        return (f"--check_warm_start {path} is --output, the table the check reads its runs from; writing the check "
                "there would erase the table. Name a file of its own, e.g. --check_warm_start warm_start_check.json.")
    if not Path(path).is_file():
        return None
    try:
        earlier = json.loads(Path(path).read_text())
    except (OSError, ValueError):
        earlier = None
    if not (isinstance(earlier, dict) and {"heldout_point", "warm_start_sha256", "runs"} <= set(earlier)):
        return (f"--check_warm_start {path}: that file exists and is not an earlier warm-start check (the check "
                "writes FILE whole, and would erase what it holds). Name a new file, or an earlier check's.")
    return None


class HeldOutEvaluation(TrainerCallback):
    """Greedy EM / F1 / format rate and the task's own reward (`reward`: F1 ≥ 0.3 for search, the exact final number
    for the calculator) on the held-out questions, before training and every `every` generation batches, against the
    rollout tokens sampled so far (read from the `BatchMeter`); with `drift_examples`, the drift from the model it
    first evaluates (the warm start): `heldout_kl`, KL(warm start ‖ policy) per assistant token on those scripted
    held-out trajectories (`HeldOutKL`, the stability map's measure), 0 at the first point by definition.

    With a rollout worker (max_staleness > 0) an evaluation takes its turn between the worker's batches
    (`generation_turn`: the wait counts as training, not evaluation), and with `defer_final` the last point is taken
    by `finish`, after `train()` has stopped the worker: a batch it grows ahead for a step that never comes then stops
    at its next engine call instead of sharing the cores with the final evaluation."""

    def __init__(self, trainer, meter: BatchMeter, task, settings, every_steps: int, token_budget: int | None = None,
                 start_path: str | None = None, defer_final: bool = False, drift_examples: list | None = None):
        self.trainer, self.meter, self.task, self.settings = trainer, meter, task, settings
        self.drift_examples, self.drift = drift_examples, None
        self.start_path = start_path  # the untrained model's folder: its evaluation is shared by every method and seed
        self.every_steps = every_steps
        self.token_budget = token_budget
        self.curve: list[dict] = []
        self.defer_final, self.final_batches = defer_final, None
        self.started = time.perf_counter()
        self.started_cpu, self.eval_cpu = time.process_time(), 0.0

    def evaluate(self, generation_batches: int):
        from trl_tree.trainer.async_rollouts import generation_turn

        with generation_turn(self.trainer):  # a no-op without a rollout worker
            self._evaluate(generation_batches)

    def _evaluate(self, generation_batches: int):
        start, start_cpu = time.perf_counter(), time.process_time()
        # the CPU seconds training has cost so far, evaluations excluded: the x axis of EM against compute
        train_cpu = start_cpu - self.started_cpu - self.eval_cpu
        model = self.trainer.accelerator.unwrap_model(self.trainer.model)
        batches = self.meter.batches
        point = {"generation_batches": generation_batches,
                 "rollout_tokens": sum(b.generated_tokens for b in batches),
                 "leaves": sum(b.leaves for b in batches),
                 **heldout_metrics(model, self.trainer.processing_class, self.task, self.settings,
                                   cached_as=self.start_path if generation_batches == 0 else None),
                 **self._drift(model),
                 "eval_seconds": time.perf_counter() - start, "train_cpu_seconds": train_cpu}
        self.eval_cpu += time.process_time() - start_cpu
        self.curve.append(point)
        print(f"  batch {generation_batches:>3}  tokens {point['rollout_tokens']:>7}  EM {point['exact_match']:.3f}  "
              f"F1 {point['f1']:.3f}  format {point['format_rate']:.2f}  reward {point['reward']:.3f}", flush=True)

    def _drift(self, model) -> dict:
        if not self.drift_examples:
            return {}
        if self.drift is None:  # the first point: the reference is the model as it is now (its KL to itself is 0)
            self.drift = HeldOutKL(model, self.drift_examples, self.trainer.temperature)
            return {"heldout_kl": 0.0}
        return {"heldout_kl": self.drift(model)}

    def on_train_begin(self, args, state, control, **kwargs):
        self.evaluate(0)

    def on_step_end(self, args, state, control, **kwargs):
        at_batch_end = state.global_step % self.meter.steps_per_batch == 0
        spent = sum(b.generated_tokens for b in self.meter.batches)
        if at_batch_end:  # progress of a run that takes tens of minutes
            print(f"  batch {state.global_step // self.meter.steps_per_batch:>3} trained  tokens {spent:>7}  "
                  f"{time.perf_counter() - self.started:.0f} s", flush=True)
        if at_batch_end and self.token_budget is not None and spent >= self.token_budget:
            control.should_training_stop = True  # the matched budget is spent: this is the run's final point
        final = state.global_step == state.max_steps or (control.should_training_stop and at_batch_end)
        if final and self.defer_final:
            self.final_batches = state.global_step // self.meter.steps_per_batch
        elif state.global_step % self.every_steps == 0 or final:
            self.evaluate(state.global_step // self.meter.steps_per_batch)

    def finish(self):
        """The final point `defer_final` left for after `train()`."""
        if self.final_batches is not None:
            self.evaluate(self.final_batches)
            self.final_batches = None


def heldout_cache(model_path: str, task, settings) -> Path:
    """Where the held-out metrics of the unchanged weights in `model_path` are cached (`heldout_metrics`)."""
    # chunking changes how greedy answers are computed, not which: it is not part of the key
    fields = {k: v for k, v in vars(settings).items() if k != "chunk_tokens"}
    key = json.dumps([model_path, task.fingerprint(), task.test_rows, fields], sort_keys=True, default=str)
    return cache_root() / "heldout" / f"{hashlib.sha256(key.encode()).hexdigest()[:16]}.json"


def heldout_metrics(model, tokenizer, task, settings, cached_as: str | None = None) -> dict:
    """Greedy answers to the task's held-out questions: EM, F1, format rate, and the task's own reward (mean).

    `cached_as`: the folder `model` was loaded from, unchanged since (a LoRA adapter not yet trained adds exactly 0).
    Greedy decoding of the same weights on the same questions gives the same answers, so the result is cached under
    `cache_root()` and the warm start's evaluation (minutes for SmolLM2 on 128 questions) is paid once, not once per
    method, seed and warm-start sweep."""
    from trl_tree.envs.agent_eval import evaluate_agent

    cache = None if cached_as is None else heldout_cache(cached_as, task, settings)
    if cache is not None and cache.is_file():
        return json.loads(cache.read_text())
    result = evaluate_agent(model, tokenizer, task.test_rows, task.tools, settings)
    records = result.records
    task_reward = task.reward_funcs[0](  # TRL's reward signature, keywords only
        prompts=[task.test_rows[r["index"]]["prompt"] for r in records],
        completions=[r["completion"] for r in records], answer=[r["answer"] for r in records])
    metrics = {"reward": statistics.fmean(task_reward),
               **{k: v for k, v in result.summary().items() if k != "num_questions"}}
    if cache is not None:
        write_json(cache, metrics)
    # per question, in test-row order: what a paired comparison of two runs on the same held-out questions needs
    # (not cached: the warm start's point needs no pairing, and an old cache entry stays valid)
    metrics["per_question"] = {"exact_match": [r["exact_match"] for r in sorted(records, key=lambda r: r["index"])],
                               "reward": [float(x) for x in task_reward]}
    return metrics


def drift_examples(args, task, tokenizer) -> list | None:
    """The scripted held-out trajectories drift is measured on (`--drift_trajectories`); None where there are none
    (the calculator has no scripted search to teacher-force)."""
    if args.task != "search" or not args.drift_trajectories:
        return None
    return held_out_examples(task, tokenizer, args.drift_trajectories)


def agent_settings(args):
    """The held-out agent's limits: training's turn and token limits."""
    from trl_tree.envs.agent_eval import AgentSettings

    return AgentSettings(max_turns=args.max_turns, max_completion_length=args.max_completion_length,
                         max_turn_tokens=args.max_turn_tokens)


def headline_metric(task_name: str) -> str:
    """Held-out success: exact match of the `<answer>` span for search; the exact final number for the calculator
    (its answers are plain text, not `<answer>` spans, so its own reward is the measure)."""
    return "exact_match" if task_name == "search" else "reward"


def run(method: str, seed: int, model_path: str, task, args) -> dict:
    """Train one method with one seed; return its held-out curve (first point: the warm start; last: after training,
    copied to `heldout_before` / `heldout_after`), its rollout tokens and its per-batch training rewards."""
    random.seed(seed)
    torch.manual_seed(seed)
    budget = budget_from_args(args, generation_batches=args.generation_batches, seed=seed)
    model, tokenizer = load_model(model_path)
    with tempfile.TemporaryDirectory() as output_dir:
        weights = {"reward_weights": [1.0, args.format_reward_weight]} if args.format_reward_weight else {}
        view = {"log_completions": True, "num_completions_to_print": 0} if args.tree_view and method != "grpo" else {}
        peft = lora_config(args.lora_rank) if args.lora_rank else None
        # parse_args refuses grpo at max_staleness > 0: every method here is trl-tree's
        staleness = {"max_staleness": args.max_staleness} if args.max_staleness else {}
        trainer = build_trainer(method, model, tokenizer, task, budget, output_dir, peft_config=peft,
                                gradient_checkpointing=args.gradient_checkpointing, **weights, **view, **staleness)
        trainer.remove_callback(PrinterCallback)
        meter = BatchMeter(trainer)
        evaluation = HeldOutEvaluation(trainer, meter, task, agent_settings(args),
                                       every_steps=args.eval_every * args.blocks,
                                       token_budget=args.rollout_token_budget, start_path=model_path,
                                       defer_final=bool(staleness), drift_examples=drift_examples(args, task, tokenizer))
        trainer.add_callback(evaluation)
        started, started_cpu = time.perf_counter(), time.process_time()
        trainer.train()
        evaluation.finish()
        meter.memory.close()
        if view:  # the temporary output folder goes: keep its pages
            from trl_tree.tree_view import INDEX, VIEW_DIR

            pages = Path(args.tree_view) / f"{method}-seed{seed}"
            shutil.copytree(Path(output_dir) / VIEW_DIR, pages, dirs_exist_ok=True)
            print(f"[{method} seed {seed}] rollout-tree pages: {pages / f'{INDEX}.html'}", flush=True)
    rewards = [e["reward"] for e in trainer.state.log_history if "reward" in e]
    metric, curve = headline_metric(args.task), evaluation.curve
    return {"method": method, "seed": seed, "heldout_metric": metric, "heldout_before": curve[0][metric],
            "heldout_after": curve[-1][metric], "rollout_tokens": curve[-1]["rollout_tokens"], "curve": curve,
            "train_reward": rewards, "train_seconds": time.perf_counter() - started,
            # the process's CPU seconds (all its threads): with one torch thread, about what the run takes on an idle
            # core, whatever else shares the machine's cores
            "train_cpu_seconds": time.process_time() - started_cpu,
            "batches": [vars(b) for b in meter.batches],
            **({"async": async_summary(trainer.state.log_history, meter)} if staleness else {})}


# what the trainer logs per generation batch with a rollout worker (docs/design.md §9), stored in each run file
ASYNC_METRICS = ("staleness_mean", "staleness_max", "policy_version", "trainer_wait", "producer_wait", "generation_time",
                 "queue_depth", "weight_publication_time")


def async_summary(log_history: list[dict], meter: BatchMeter) -> dict:
    """A run at max_staleness > 0: the trainer's `async/*` metrics per generation batch (`per_batch`; logged every E
    steps, one value a batch), and the run's staleness (mean and max over its batches) and waits (seconds in all:
    the trainer waiting for the worker's batch, the worker idle waiting for admission); with the batches the worker
    grew ahead and the run never trained (none when it ends at max_steps, which the worker never grows past; up to
    max_staleness when a token budget stops it early) and their sampled tokens, which the
    run's `rollout_tokens` (the trained batches', as a synchronous run counts them) leaves out."""
    per_batch = {name: [entry[f"async/{name}"] for entry in log_history if f"async/{name}" in entry]
                 for name in ASYNC_METRICS}
    if not per_batch["staleness_max"]:
        raise RuntimeError("A run at max_staleness > 0 logged no async/* metrics: the trainer's asynchronous logging "
                           "changed (docs/design.md, section 9); update bench_learning.async_summary.")
    return {"staleness_mean": statistics.fmean(per_batch["staleness_mean"]),
            "staleness_max": max(per_batch["staleness_max"]),
            "trainer_wait_seconds": sum(per_batch["trainer_wait"]),
            "producer_wait_seconds": sum(per_batch["producer_wait"]),
            "untrained_batches": len(meter.grown),
            "untrained_generated_tokens": sum(record.generated_tokens for _, record in meter.grown.values()),
            "per_batch": per_batch}


def run_file(output: str, method: str, seed: int) -> Path:
    """Where one method-seed run's result lives: next to `--output`, in `<output stem>.runs/`."""
    return runs_dir_of(output) / f"{method}-seed{seed}.json"


# Arguments that do not change a run's numbers: which runs to make, where to write, threads, and gradient
# checkpointing (recomputed activations are the same activations)
# (and GRPO's micro-batch split: one tiny-model step with micro-batches of 4 against one of 16 differed by 8e-6 in
# the parameters for an update of 1e-3, rounding; each run file still records it in its config)
NOT_RESULT_ARGUMENTS = {"methods", "seeds", "output", "plot", "threads", "gradient_checkpointing", "report_only",
                        "check_warm_start",
                        "drift_trajectories",  # a measurement: eval-mode forwards that draw nothing (HeldOutKL)
                        "tree_view",  # the pages cost one no-grad forward a batch and change no sample or step
                        "grpo_micro_batch",
                        "equivalent_warm_starts"}  # which tables a run may join, not how it trains


# Arguments added after run files were stored, with the value every run before them had: a run file without
# max_staleness was trained synchronously
OLDER_RUN_VALUES = {"max_staleness": 0}


def checked_run(path: Path, args) -> dict:
    """A finished run's result, if it was made with these arguments: a table must not mix runs of different settings
    (e.g. a changed default, or another max_staleness), so a mismatch is an error naming the fields."""
    result = json.loads(path.read_text())
    saved = result.get("config", {})
    current = portable(json.loads(json.dumps(vars(args), default=str)))  # as the run file stores them
    differ = {k: (saved.get(k, OLDER_RUN_VALUES.get(k)), v) for k, v in current.items()
              if k not in NOT_RESULT_ARGUMENTS and saved.get(k, OLDER_RUN_VALUES.get(k)) != v}
    if differ:
        listed = ", ".join(f"{k}: {old!r} there, {new!r} now" for k, (old, new) in sorted(differ.items()))
        staleness = (" A table holds runs of one max_staleness: with --max_staleness S > 0, --output FILE.json "
                     "writes the table FILE_sS.json." if "max_staleness" in differ else "")
        raise SystemExit(f"{path} was made with other settings ({listed}). Use another --output for these settings, "
                         f"or the same arguments to complete that table.{staleness}")
    return result


def warm_start_identity(model_path: str) -> dict:
    """What identifies a warm start across sittings: its cache folder's name (a hash of what built it) and a hash
    of its weights. The same inputs can still give other weights on another machine (other CPU kernels, another
    version of an unpinned dependency), and runs from other weights must not share a table."""
    digest = hashlib.sha256()
    for weights in sorted(Path(model_path).glob("*.safetensors")):
        with weights.open("rb") as f:
            for block in iter(lambda: f.read(1 << 24), b""):
                digest.update(block)
    return {"warm_start": Path(model_path).name, "warm_start_sha256": digest.hexdigest()[:16]}


# the warm start's held-out point that every run records first: equal for warm starts that differ only in rounding
START_METRICS = ("exact_match", "f1", "format_rate", "mean_turns", "mean_tool_calls", "reward")


def start_point(metrics: dict) -> dict:
    """The fields of a held-out point that say which model was evaluated (`START_METRICS`)."""
    return {k: metrics.get(k) for k in START_METRICS}


def check_one_warm_start(runs: list[tuple[Path, dict]], current: dict | None = None,
                         equivalent: str | None = None, current_start: dict | None = None) -> None:
    """Every run of a table (and, with `current`, the warm start this sitting would train from) starts from the
    same model; otherwise an error that names the runs and what to do, before any training time is spent.

    Run files written before the weights hash was recorded are compared by the warm start's folder name only.
    `equivalent` (`--equivalent_warm_starts`): comma-separated weight hashes of one folder that count as one warm
    start, as long as every run's first held-out point (and `current_start`, this sitting's warm start's) agrees on
    `START_METRICS`."""
    hashes_as_one = {h.strip() for h in (equivalent or "").split(",") if h.strip()}

    def identity(result: dict) -> dict:
        config = result.get("config", {})
        return {"warm_start": Path(config.get("model_path", "")).name,
                "warm_start_sha256": config.get("warm_start_sha256")}

    def same(a: dict, b: dict) -> bool:
        hashes = a["warm_start_sha256"], b["warm_start_sha256"]
        return a["warm_start"] == b["warm_start"] and (None in hashes or hashes[0] == hashes[1]
                                                       or set(hashes) <= hashes_as_one)

    if hashes_as_one:
        starts = {path.name: start_point(result["curve"][0]) for path, result in runs if result.get("curve")}
        if current_start is not None:
            starts["this sitting's warm start"] = start_point(current_start)
        if len({json.dumps(start, sort_keys=True) for start in starts.values()}) > 1:
            listed = "; ".join(f"{name}: {start}" for name, start in starts.items())
            raise SystemExit(f"--equivalent_warm_starts {equivalent}: these runs start from other held-out metrics "
                             f"({listed}), so their warm starts are other models, not one model rounded differently. "
                             "Use another --output for runs from another warm start.")

    reference = current or (identity(runs[0][1]) if runs else None)
    others = [(path, identity(result), result) for path, result in runs if not same(identity(result), reference)]
    if not others:
        return
    listed = "; ".join(f"{path.name}: {who['warm_start']} (sha256 {who['warm_start_sha256'] or 'not recorded'}, "
                       f"held-out before {result.get('heldout_before')})" for path, who, result in others)
    here = "this sitting's warm start" if current else "the table's first run"
    # the folder's name hashes the data and the recipe: the same name with other weights is other rounding
    rounding = (" The same folder name with other weights is the same recipe on kernels that round differently (another"
                " machine: `kernel_fingerprint` in a run file's environment says which): --equivalent_warm_starts"
                f" {','.join(sorted({str(who['warm_start_sha256']) for _, who, _ in others}))},"
                f"{reference['warm_start_sha256']} counts them as one warm start if their held-out metrics agree."
                if any(who["warm_start"] == reference["warm_start"] for _, who, _ in others) else "")
    raise SystemExit(
        f"Runs trained from another warm start than {here} ({reference['warm_start']}, sha256 "
        f"{reference['warm_start_sha256'] or 'not recorded'}): {listed}. A table compares methods from one starting "
        f"model.{rounding} Put that warm start's folder back under $TRL_TREE_CACHE/benchmarks (default "
        "~/.cache/trl_tree/benchmarks) to complete the table, or use another --output to start a new one.")


def present_runs(args) -> list[tuple[Path, dict]]:
    """The run files already next to --output (any method and seed)."""
    folder = runs_dir_of(args.output) if args.output else None
    if folder is None or not folder.is_dir():
        return []
    return [(path, json.loads(path.read_text())) for path in sorted(folder.glob("*-seed*.json"))]


def warm_start_point(model_path: str, task, args) -> dict:
    """The warm start's held-out metrics (cached: every run's first evaluation reads them back, and a cached point
    does not load the model)."""
    settings = agent_settings(args)
    cache = heldout_cache(model_path, task, settings)
    if cache.is_file():
        return json.loads(cache.read_text())
    model, tokenizer = load_model(model_path)
    return heldout_metrics(model, tokenizer, task, settings, cached_as=model_path)


def check_warm_start(args, task, model_path: str) -> None:
    """`--check_warm_start FILE`: whether the runs next to --output started from this machine's warm start, bit for
    bit or up to rounding (the same held-out point: `--equivalent_warm_starts`), before any training time is spent on
    a sitting whose runs could not join that table."""
    identity, start = warm_start_identity(model_path), warm_start_point(model_path, task, args)
    point = start_point(start)
    rows = []
    for path, result in present_runs(args):
        config, first = result.get("config", {}), (result.get("curve") or [{}])[0]
        rows.append({"run": path.name, "warm_start": Path(config.get("model_path", "")).name,
                     "warm_start_sha256": config.get("warm_start_sha256"),
                     "kernel_fingerprint": result.get("environment", {}).get("kernel_fingerprint"),
                     "same_weights": config.get("warm_start_sha256") == identity["warm_start_sha256"],
                     "same_heldout_point": start_point(first) == point})
    machine = environment()
    print(f"This machine (kernel fingerprint {machine['kernel_fingerprint']}, {machine['cpu_capability']}) builds "
          f"{identity['warm_start']} with weights {identity['warm_start_sha256']}; held-out point {point}", flush=True)
    if rows:
        print(markdown_table(rows, list(rows[0])), flush=True)
    write_json(args.check_warm_start, {"config": vars(args), "environment": machine, **identity,
                                       "heldout_point": point, "runs": rows})


def warm_start_sweep(args, task, base: str | None) -> None:
    """The held-out success of warm starts of several lengths (greedy, the benchmark's agent settings): the table
    that picks a warm start leaving room for RL."""
    rows = []
    for steps in [int(s) for s in args.warm_start_sweep.split(",")]:
        path = warm_started_model(task, base, steps, lr=args.warm_start_lr, batch_size=args.warm_start_batch_size,
                                  lora_rank=args.lora_rank)
        model, tokenizer = load_model(path)
        started = time.perf_counter()
        metrics = heldout_metrics(model, tokenizer, task, agent_settings(args), cached_as=path)
        rows.append({"warm_start_steps": steps, **metrics, "eval_seconds": time.perf_counter() - started})
        print(markdown_table(rows[-1:], list(rows[-1])), flush=True)
    table = markdown_table(rows, list(rows[0]))
    print(f"\nWarm starts, held-out greedy on {args.num_eval or args.num_test} questions ({args.task}, {args.model})"
          f"\n\n{table}")
    if args.output:
        write_json(args.output, {"config": vars(args), "environment": environment(), "warm_starts": rows})


def mean_std(values: list[float]) -> tuple[float, float]:
    return statistics.fmean(values), statistics.stdev(values) if len(values) > 1 else 0.0


def summarize(runs: dict[str, list[dict]]) -> dict[str, dict]:
    """Per method, over seeds: EM / F1 / format before and after training, best EM, rollout tokens, train reward."""
    summary = {}
    for method, seeds in runs.items():
        row = {}
        for name, pick in (("initial", lambda c: c[0]), ("final", lambda c: c[-1])):
            for metric in ("exact_match", "f1", "format_rate", "reward"):
                row[f"{name}_{metric}_mean"], row[f"{name}_{metric}_std"] = mean_std(
                    [pick(r["curve"])[metric] for r in seeds])
        for metric in ("exact_match", "reward"):
            row[f"best_{metric}_mean"], row[f"best_{metric}_std"] = mean_std(
                [max(p[metric] for p in r["curve"]) for r in seeds])
        row["rollout_tokens_mean"], row["rollout_tokens_std"] = mean_std([r["curve"][-1]["rollout_tokens"]
                                                                          for r in seeds])
        row["train_reward_mean"], row["train_reward_std"] = mean_std(
            [statistics.fmean(r["train_reward"]) if r["train_reward"] else 0.0 for r in seeds])
        # the training reward at the start and at the end: the first and the last third of the generation batches
        for name, part in (("first", lambda x: x[: max(1, len(x) // 3)]), ("last", lambda x: x[-max(1, len(x) // 3):])):
            row[f"train_reward_{name}_mean"], row[f"train_reward_{name}_std"] = mean_std(
                [statistics.fmean(part(r["train_reward"])) if r["train_reward"] else 0.0 for r in seeds])
        row["collapsed"] = sum(collapsed(r["curve"][-1]) for r in seeds)  # stats.collapsed: format or EM lost
        row["runs"] = len(seeds)
        cpu = [r["train_cpu_seconds"] / 60 for r in seeds if "train_cpu_seconds" in r]  # older run files lack it
        row["run_cpu_minutes_mean"], row["run_cpu_minutes_std"] = mean_std(cpu) if cpu else (float("nan"),) * 2
        summary[method] = row
    return summary


# Which paired differences the report shows, when both methods have runs: the flagship against each alternative
PAIRS = (("treeopsd", "treepo"), ("treeopsd", "grpo"), ("treepo", "grpo"), ("treeopsd", "treeopsd_no_anchor"),
         ("treepo_anchor", "treepo"), ("treeopsd", "flat_grpo"), ("treepo", "flat_grpo"), ("flat_grpo", "grpo"))


def paired_difference(a_runs: list[dict], b_runs: list[dict], metric: str = "exact_match", resamples: int = 10_000,
                      seed: int = 0) -> dict | None:
    """A − B on the same held-out questions after training: the mean per-question difference over the seeds both
    ran (seed s of A paired with seed s of B: the same data order and warm start), with a 95 % bootstrap interval
    that resamples seeds and, within each replicate, questions (both with replacement; the same questions for every
    seed, since every seed answers the same held-out set). Pairing removes the questions' own difficulty from the
    noise, which a difference of two independent means keeps. None when no seed has per-question outcomes in both.

    The training run is the unit of replication, not the question: `per_seed` holds each seed's difference and
    `t_ci95` the Student-t interval over them (`stats.t_interval`), the interval to quote; the bootstrap's `ci95`
    treats question-seeds as independent and is kept only as the spread over questions."""
    import numpy as np
    from stats import t_interval

    def outcomes(runs):
        return {r["seed"]: r["curve"][-1]["per_question"][metric] for r in runs
                if "per_question" in r["curve"][-1]}

    a, b = outcomes(a_runs), outcomes(b_runs)
    seeds = sorted(set(a) & set(b))
    if not seeds:
        return None
    d = np.array([np.subtract(a[s], b[s], dtype=float) for s in seeds])  # [seeds, questions]
    rng = np.random.default_rng(seed)
    pick_seeds = rng.integers(0, len(seeds), size=(resamples, len(seeds)))
    pick_questions = rng.integers(0, d.shape[1], size=(resamples, d.shape[1]))
    replicates = d[pick_seeds[:, :, None], pick_questions[:, None, :]].mean(axis=(1, 2))
    low, high = np.quantile(replicates, [0.025, 0.975])
    per_seed = {s: float(row.mean()) for s, row in zip(seeds, d)}
    interval = t_interval(list(per_seed.values()))
    return {"mean": float(d.mean()), "ci95": [float(low), float(high)], "seeds": seeds, "questions": d.shape[1],
            "a_better": int((d > 0).sum()), "b_better": int((d < 0).sum()), "per_seed": per_seed,
            "t_ci95": [interval.low, interval.high] if interval.n > 1 else None}


def paired_differences(runs: dict[str, list[dict]], metric: str) -> dict[str, dict]:
    found = {}
    for a, b in PAIRS:
        if a in runs and b in runs:
            difference = paired_difference(runs[a], runs[b], metric)
            if difference is not None:
                found[f"{a} - {b}"] = difference
    return found


def _x_cpu_minutes(run: dict, i: int) -> float:
    """Training CPU minutes at evaluation point i. Runs recorded before points carried it have only two: 0 at the
    start and the run's whole CPU time (its evaluations included) at the end; their points between are NaN (not
    drawn), not put at the end."""
    point, last = run["curve"][i], len(run["curve"]) - 1
    if "train_cpu_seconds" in point:
        return point["train_cpu_seconds"] / 60
    return 0.0 if i == 0 else run.get("train_cpu_seconds", math.nan) / 60 if i == last else math.nan


def plot(runs: dict[str, list[dict]], path: str, title: str, metric: str = "exact_match") -> None:
    """`metric` (held-out EM, or the task's reward) against rollout tokens and training CPU minutes: the mean over
    seeds at each evaluation point, ± one std shaded (clipped to the metric's range, [0, 1])."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib is not installed (pip install 'trl-tree[plot]'): no plot written.", flush=True)
        return
    figure, panels = plt.subplots(1, 2, figsize=(11, 4), sharey=True)
    x_axes = (("rollout tokens sampled", lambda r, i: r["curve"][i]["rollout_tokens"]),
              ("training CPU minutes (one thread)", _x_cpu_minutes))
    for axes, (x_label, x_of) in zip(panels, x_axes):
        for method, seeds in runs.items():
            points = min(len(r["curve"]) for r in seeds)
            drawn = [i for i in range(points) if all(math.isfinite(x_of(r, i)) for r in seeds)]
            xs = [statistics.fmean(x_of(r, i) for r in seeds) for i in drawn]
            stats = [mean_std([r["curve"][i][metric] for r in seeds]) for i in drawn]
            mean = [m for m, _ in stats]
            band = f", mean ± 1 std over {len(seeds)} seeds" if len(seeds) > 1 else ", 1 seed"
            (line,) = axes.plot(xs, mean, marker="o", label=f"{method}{band}")
            axes.fill_between(xs, [max(0.0, m - s) for m, s in stats], [min(1.0, m + s) for m, s in stats],
                              alpha=0.2, color=line.get_color())
        axes.set_xlabel(x_label)
    panels[0].set_ylabel({"exact_match": "held-out exact match (greedy)"}.get(metric, f"held-out {metric} (greedy)"))
    figure.suptitle(textwrap.fill(title, 130), fontsize=9)
    panels[0].legend()
    figure.tight_layout()
    figure.savefig(path, dpi=120)
    print(f"wrote {path}", flush=True)


def main(argv=None):
    args = parse_args(argv)
    if not torch.cuda.is_available():
        torch.set_num_threads(args.threads or 1)
    if args.max_staleness and args.output:
        print(f"max_staleness {args.max_staleness}: the table is {args.output}, its runs in "
              f"{runs_dir_of(args.output)}/", flush=True)
    task = make_task(args.task, args.num_train, args.num_test, topk=args.topk)
    if args.num_eval is not None:
        if not 0 < args.num_eval <= len(task.test_rows):
            raise SystemExit(f"--num_eval {args.num_eval}: choose 1 to {len(task.test_rows)} (--num_test)")
        task.test_rows = task.test_rows[:args.num_eval]  # the corpus, built from every question, stays the same
    if args.format_reward_weight:
        task.reward_funcs = [*task.reward_funcs, format_reward]
    base = args.model_name_or_path
    if base is None and args.model == "smollm2":
        from trl_tree.testing import smollm2_path

        base = smollm2_path()
    if args.warm_start_sweep:
        return warm_start_sweep(args, task, base)
    if args.report_only:
        return report_present_runs(args)
    model_path = warm_started_model(task, base, args.warm_start_steps, lr=args.warm_start_lr,
                                    batch_size=args.warm_start_batch_size, lora_rank=args.lora_rank)
    warm_start = warm_start_identity(model_path)
    if args.check_warm_start:
        return check_warm_start(args, task, model_path)
    start = warm_start_point(model_path, task, args) if args.equivalent_warm_starts else None
    check_one_warm_start(present_runs(args), warm_start, args.equivalent_warm_starts, start)
    runs: dict[str, list[dict]] = {m: [] for m in args.methods}
    for seed in args.seeds:  # seeds outermost: a slow machine still gets every method at every seed it ran
        for method in args.methods:
            path = run_file(args.output, method, seed) if args.output else None
            if path is not None and path.is_file():
                print(f"[{method} seed {seed}] done before: {path}", flush=True)
                runs[method].append(checked_run(path, args))
                continue
            print(f"[{method} seed {seed}]", flush=True)
            result = run(method, seed, model_path, task, args)
            if path is not None:  # written at once, so an interrupted sitting keeps every finished run
                # what the warm start's cache key hashed, too: if another machine builds another warm start, these
                # say whether the base model or the warm-start data differed
                write_json(path, {**result, "config": {**vars(args), "model_path": model_path,
                                                        "warm_start_sha256": warm_start["warm_start_sha256"],
                                                        "base_model": base, "task_fingerprint": task.fingerprint()},
                                  "environment": environment()})
            runs[method].append(result)
    report(runs, args, model_path)


def report_present_runs(args) -> None:
    """`--report_only`: the report of the finished runs of --methods x --seeds, saying which are still missing."""
    if not args.output:
        raise SystemExit("--report_only reads the run files of --output; pass --output.")
    runs: dict[str, list[dict]] = {m: [] for m in args.methods}
    for seed in args.seeds:
        for method in args.methods:
            path = run_file(args.output, method, seed)
            if path.is_file():
                runs[method].append(checked_run(path, args))
            else:
                print(f"[{method} seed {seed}] missing: {path}", flush=True)
    runs = {m: r for m, r in runs.items() if r}
    if not runs:
        raise SystemExit(f"No finished runs for {args.methods} x seeds {args.seeds} next to {args.output}.")
    check_one_warm_start([(run_file(args.output, r["method"], r["seed"]), r) for rs in runs.values() for r in rs],
                         equivalent=args.equivalent_warm_starts)
    report(runs, args, next(iter(runs.values()))[0]["config"]["model_path"])


def report(runs: dict[str, list[dict]], args, model_path: str) -> None:
    """The table (stdout, and `.md` next to `--output`), the plot and the summary JSON of the runs."""
    summary = summarize(runs)
    if args.task == "search":
        columns = {"EM before": "initial_exact_match", "EM after": "final_exact_match", "best EM": "best_exact_match",
                   "F1 after": "final_f1", "format after": "final_format_rate"}
        task_title = "synthetic multi-hop search, reward F1>=0.3"
    else:
        columns = {"held-out reward before": "initial_reward", "held-out reward after": "final_reward",
                   "best held-out reward": "best_reward"}
        task_title = "calculator tool, reward = exact final answer"
    rows = [{"method": m, "seeds": ",".join(str(r["seed"]) for r in runs[m]),
             **{label: _pm(s, key) for label, key in columns.items()},
             "train reward": _pm(s, "train_reward"), "train reward, first third": _pm(s, "train_reward_first"),
             "train reward, last third": _pm(s, "train_reward_last"), "rollout tokens": _pm(s, "rollout_tokens", digits=0),
             "run CPU minutes": _pm(s, "run_cpu_minutes", digits=0),
             "collapsed runs": f"{s['collapsed']} of {s['runs']}",
             **(async_columns(runs[m]) if args.max_staleness else {})}
            for m, s in summary.items()]
    seeds = ",".join(str(s) for s in args.seeds)
    caption = (f"Held-out greedy answers to {args.num_eval or args.num_test} questions ({args.task}, {args.model}), "
               f"seeds {seeds}, mean ± std, after {args.generation_batches} generation batches of {args.prompts} prompts"
               + (f"; asynchronous rollouts at max_staleness {args.max_staleness} (batch j sampled by the policy of "
                  f"batch max(0, j − {args.max_staleness}))" if args.max_staleness else ""))
    table = markdown_table(rows, list(rows[0]))
    metric = headline_metric(args.task)
    differences = paired_differences(runs, metric)
    if differences:
        paired_rows = [{"A − B": name.replace(" - ", " − "), "seeds": ",".join(map(str, d["seeds"])),
                        "questions": d["questions"], f"paired {metric} difference": f"{d['mean']:+.3f}",
                        "per seed": ", ".join(f"{v:+.3f}" for v in d["per_seed"].values()),
                        "95 % t-interval over seeds": (f"[{d['t_ci95'][0]:+.3f}, {d['t_ci95'][1]:+.3f}]"
                                                       if d["t_ci95"] else "one seed: none"),
                        "questions A better / B better (summed over seeds)": f"{d['a_better']} / {d['b_better']}"}
                       for name, d in differences.items()]
        table += ("\n\nPaired on the same held-out questions after training (seed s against seed s; the interval is "
                  "a Student-t interval over the seeds, each run one unit):\n\n"
                  + markdown_table(paired_rows, list(paired_rows[0])))
    print(f"\n{caption}\n\n{table}")
    model_name = {"tiny": "tiny Qwen3", "smollm2": "SmolLM2-135M-Instruct"}[args.model]
    title = (f"{task_title}, {model_name}; P={args.prompts}, E={args.blocks}, G={args.group_size} vs "
             f"(M,N)=({args.num_initial_rollouts},{args.num_branches}); seeds {seeds}"
             + (f" + {args.format_reward_weight:g} x format" if args.format_reward_weight else "")
             + (f"; max_staleness {args.max_staleness}" if args.max_staleness else ""))
    plot_path = args.plot or (str(Path(args.output).with_suffix(".png")) if args.output else None)
    if plot_path:
        plot(runs, plot_path, title, metric=headline_metric(args.task))
    if args.output:
        Path(args.output).with_suffix(".md").write_text(f"{caption}\n\n{table}\n")
        results = {m: {str(r["seed"]): {k: r.get(k) for k in ("heldout_before", "heldout_after", "rollout_tokens")}
                       for r in seeds_} for m, seeds_ in runs.items()}
        write_json(args.output, {"config": {**vars(args), "model_path": model_path}, "environment": environment(),
                                 "results": results, "summary": summary, "paired_differences": differences,
                                 "runs": runs})


def async_columns(runs: list[dict]) -> dict[str, str]:
    """A staleness table's own columns, means over the method's runs: the staleness its batches trained at, the
    trainer's and the worker's waits, and the training wall minutes (`stats.train_wall_seconds`: evaluations left
    out; comparable only between runs of one sitting)."""
    from stats import train_wall_seconds

    def mean(values):
        values = [v for v in values if v is not None]
        return statistics.fmean(values) if values else math.nan

    stored = [r["async"] for r in runs if "async" in r]
    wall = mean([(w / 60 if (w := train_wall_seconds(r)) is not None else None) for r in runs])
    return {"staleness mean / max": f"{mean([a['staleness_mean'] for a in stored]):.2f} / "
                                    f"{max((a['staleness_max'] for a in stored), default=math.nan):g}",
            "trainer wait s": f"{mean([a['trainer_wait_seconds'] for a in stored]):.0f}",
            "worker idle s": f"{mean([a['producer_wait_seconds'] for a in stored]):.0f}",
            "train wall minutes": f"{wall:.1f}"}


def _pm(summary: dict, name: str, digits: int = 3) -> str:
    if math.isnan(summary[name + "_mean"]):
        return "not recorded"
    return f"{summary[name + '_mean']:.{digits}f} ± {summary[name + '_std']:.{digits}f}"


if __name__ == "__main__":
    main()
