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

M(1 + N/2) = G matches the expected generated trajectories per prompt. Before training and every `--eval_every`
generation batches, the policy answers `--num_test` held-out questions greedily with the same agent loop
(`trl_tree.envs.agent_eval`): EM, F1 and the rate of well-formed answers are recorded against the rollout tokens the
method has sampled so far (policy tokens only; observations are not generated). Each method runs `--seeds` seeds (the
seed drives sampling, anchors and data order; the warm start is shared). Output: a table of mean ± std over seeds,
a PNG plot (matplotlib: `pip install trl-tree[plot]`) and, with `--output`, JSON.

Usage:
    python benchmarks/bench_learning.py --output learning.json --plot learning.png
    python benchmarks/bench_learning.py --quick
"""

from __future__ import annotations

import argparse
import random
import statistics
import tempfile
import time

import torch
from common import (
    TASK_LIMITS,
    TASK_SIZES,
    BatchMeter,
    add_budget_arguments,
    budget_from_args,
    build_trainer,
    environment,
    fill_task_defaults,
    load_model,
    make_task,
    markdown_table,
    warm_started_model,
    write_json,
)
from transformers import TrainerCallback
from transformers.trainer_callback import PrinterCallback

from trl_tree.rewards import format_reward

METHODS = ("grpo", "treepo", "treeopsd", "at2po", "treeadv")
DEFAULT_METHODS = ("grpo", "treepo", "treeopsd")


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--model_name_or_path", default=None, help="model to train (default: the tiny offline Qwen3)")
    p.add_argument("--methods", default=",".join(DEFAULT_METHODS), help=f"comma-separated subset of {list(METHODS)}")
    p.add_argument("--seeds", type=int, default=3, help="seeds per method (0, 1, ...)")
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
    p.add_argument("--warm_start_steps", type=int, default=None,
                   help="SFT steps on scripted trajectories (cached; default: 600 search, 150 calculator)")
    p.add_argument("--threads", type=int, default=None, help="torch threads (default: 1 on CPU)")
    p.add_argument("--quick", action="store_true",
                   help="smoke run: 1 seed, 1 generation batch of 2 prompts, 2 test questions, no warm start")
    p.add_argument("--plot", default=None, help="write the EM-vs-rollout-tokens plot here (PNG)")
    p.add_argument("--output", default=None, help="write the results as JSON here")
    args = p.parse_args(argv)
    fill_task_defaults(args)
    args.num_train = args.num_train or TASK_SIZES[args.task][0]
    args.num_test = args.num_test or TASK_SIZES[args.task][1]
    if args.quick:
        args.seeds, args.generation_batches, args.eval_every, args.prompts, args.blocks = 1, 1, 1, 2, 1
        args.num_train, args.num_test, args.warm_start_steps = 8, 2, 0
        args.max_turns, args.max_completion_length = 2, 48
    args.methods = [m.strip() for m in args.methods.split(",") if m.strip()]
    if set(args.methods) - set(METHODS):
        p.error(f"unknown methods {sorted(set(args.methods) - set(METHODS))}; choose from {list(METHODS)}")
    return args


class HeldOutEvaluation(TrainerCallback):
    """Greedy EM / F1 / format rate and the task's own reward (`reward`: F1 ≥ 0.3 for search, the exact final number
    for the calculator) on the held-out questions, before training and every `every` generation batches, against the
    rollout tokens sampled so far (read from the `BatchMeter`)."""

    def __init__(self, trainer, meter: BatchMeter, task, settings, every_steps: int):
        self.trainer, self.meter, self.task, self.settings = trainer, meter, task, settings
        self.every_steps = every_steps
        self.curve: list[dict] = []

    def evaluate(self, generation_batches: int):
        from trl_tree.envs.agent_eval import evaluate_agent

        start = time.perf_counter()
        model = self.trainer.accelerator.unwrap_model(self.trainer.model)
        result = evaluate_agent(model, self.trainer.processing_class, self.task.test_rows, self.task.tools,
                                self.settings)
        batches = self.meter.batches
        records = result.records
        task_reward = self.task.reward_funcs[0](  # TRL's reward signature, keywords only
            prompts=[self.task.test_rows[r["index"]]["prompt"] for r in records],
            completions=[r["completion"] for r in records], answer=[r["answer"] for r in records])
        point = {"generation_batches": generation_batches, "reward": statistics.fmean(task_reward),
                 "rollout_tokens": sum(b.generated_tokens for b in batches),
                 "leaves": sum(b.leaves for b in batches),
                 **{k: v for k, v in result.summary().items() if k != "num_questions"},
                 "eval_seconds": time.perf_counter() - start}
        self.curve.append(point)
        print(f"  batch {generation_batches:>3}  tokens {point['rollout_tokens']:>7}  EM {point['exact_match']:.3f}  "
              f"F1 {point['f1']:.3f}  format {point['format_rate']:.2f}  reward {point['reward']:.3f}", flush=True)

    def on_train_begin(self, args, state, control, **kwargs):
        self.evaluate(0)

    def on_step_end(self, args, state, control, **kwargs):
        if state.global_step % self.every_steps == 0 or state.global_step == state.max_steps:
            self.evaluate(state.global_step // self.meter.steps_per_batch)


def run(method: str, seed: int, model_path: str, task, args) -> dict:
    """Train one method with one seed; return its held-out curve and its per-batch training rewards."""
    from trl_tree.envs.agent_eval import AgentSettings

    random.seed(seed)
    torch.manual_seed(seed)
    budget = budget_from_args(args, generation_batches=args.generation_batches, seed=seed)
    settings = AgentSettings(max_turns=args.max_turns, max_completion_length=args.max_completion_length)
    model, tokenizer = load_model(model_path)
    with tempfile.TemporaryDirectory() as output_dir:
        weights = {"reward_weights": [1.0, args.format_reward_weight]} if args.format_reward_weight else {}
        trainer = build_trainer(method, model, tokenizer, task, budget, output_dir, **weights)
        trainer.remove_callback(PrinterCallback)
        meter = BatchMeter(trainer)
        evaluation = HeldOutEvaluation(trainer, meter, task, settings, every_steps=args.eval_every * args.blocks)
        trainer.add_callback(evaluation)
        started = time.perf_counter()
        trainer.train()
        meter.memory.close()
    rewards = [e["reward"] for e in trainer.state.log_history if "reward" in e]
    return {"seed": seed, "curve": evaluation.curve, "train_reward": rewards,
            "train_seconds": time.perf_counter() - started}


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
        summary[method] = row
    return summary


def plot(runs: dict[str, list[dict]], path: str, title: str, metric: str = "exact_match") -> None:
    """`metric` (held-out EM, or the task's reward) against rollout tokens: the mean over seeds at each evaluation
    point, ± one std shaded."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib is not installed (pip install 'trl-tree[plot]'): no plot written.", flush=True)
        return
    figure, axes = plt.subplots(figsize=(6, 4))
    for method, seeds in runs.items():
        points = min(len(r["curve"]) for r in seeds)
        tokens = [statistics.fmean(r["curve"][i]["rollout_tokens"] for r in seeds) for i in range(points)]
        stats = [mean_std([r["curve"][i][metric] for r in seeds]) for i in range(points)]
        mean = [m for m, _ in stats]
        axes.plot(tokens, mean, marker="o", label=method)
        axes.fill_between(tokens, [m - s for m, s in stats], [m + s for m, s in stats], alpha=0.2)
    axes.set_xlabel("rollout tokens sampled")
    axes.set_ylabel({"exact_match": "held-out exact match (greedy)"}.get(metric, f"held-out {metric} (greedy)"))
    axes.set_title(title, fontsize=9)
    axes.legend()
    figure.tight_layout()
    figure.savefig(path, dpi=120)
    print(f"wrote {path}", flush=True)


def main(argv=None):
    args = parse_args(argv)
    if not torch.cuda.is_available():
        torch.set_num_threads(args.threads or 1)
    task = make_task(args.task, args.num_train, args.num_test)
    model_path = warm_started_model(task, args.model_name_or_path, args.warm_start_steps)
    if args.format_reward_weight:
        task.reward_funcs = [*task.reward_funcs, format_reward]
    runs: dict[str, list[dict]] = {m: [] for m in args.methods}
    for seed in range(args.seeds):  # seeds outermost: a slow machine still gets every method at every seed it ran
        for method in args.methods:
            print(f"[{method} seed {seed}]", flush=True)
            runs[method].append(run(method, seed, model_path, task, args))

    summary = summarize(runs)
    if args.task == "search":
        columns = {"EM before": "initial_exact_match", "EM after": "final_exact_match", "best EM": "best_exact_match",
                   "F1 after": "final_f1", "format after": "final_format_rate"}
        headline, task_title = "exact_match", "synthetic multi-hop search, reward F1>=0.3"
    else:  # the calculator's answers are plain text, not <answer> spans: its own reward is the held-out measure
        columns = {"held-out reward before": "initial_reward", "held-out reward after": "final_reward",
                   "best held-out reward": "best_reward"}
        headline, task_title = "reward", "calculator tool, reward = exact final answer"
    rows = [{"method": m, **{label: _pm(s, key) for label, key in columns.items()},
             "train reward": _pm(s, "train_reward"), "train reward, first third": _pm(s, "train_reward_first"),
             "train reward, last third": _pm(s, "train_reward_last"), "rollout tokens": _pm(s, "rollout_tokens", digits=0)}
            for m, s in summary.items()]
    print(f"\nHeld-out greedy answers to {args.num_test} questions ({args.task}), {args.seeds} seed(s), mean ± std, "
          f"after {args.generation_batches} generation batches of {args.prompts} prompts\n")
    print(markdown_table(rows, list(rows[0])))
    title = (f"{task_title}, tiny Qwen3; P={args.prompts}, E={args.blocks}, G={args.group_size} vs "
             f"(M,N)=({args.num_initial_rollouts},{args.num_branches}); {args.seeds} seeds"
             + (f" + {args.format_reward_weight:g} x format" if args.format_reward_weight else ""))
    if args.plot:
        plot(runs, args.plot, title, metric=headline)
    if args.output:
        write_json(args.output, {"config": {**vars(args), "model_path": model_path}, "environment": environment(),
                                 "summary": summary, "runs": runs})


def _pm(summary: dict, name: str, digits: int = 3) -> str:
    return f"{summary[name + '_mean']:.{digits}f} ± {summary[name + '_std']:.{digits}f}"


if __name__ == "__main__":
    main()
