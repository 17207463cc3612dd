"""What prefix KV reuse saves the greedy multi-turn evaluation (`trl_tree.envs.agent_eval`), with its answers.

The held-out evaluation answers each question in up to `max_turns` turns; without reuse every turn prefills the whole
history again (system prompt, tool schema, question, earlier turns and observations). `GreedyEngine` keeps each
history's keys and values within a batch of questions (`AgentSettings.reuse_prefixes`, the default), and encodes a
head that all rows of a call share once. Both settings must give the same answers: reuse changes how a turn's
history is encoded, not what greedy decoding picks from it (up to float rounding: the script counts the questions
whose whole history is the same).

Both settings run in one process on the same warm-started model and questions, alternating (`--repeats`), timed in
wall seconds and the process's CPU seconds (CPU is what a shared machine measures reliably). Usage:

    python benchmarks/bench_eval_cache.py --model smollm2 --num_questions 32 --output benchmarks/results/eval_cache.json
    python benchmarks/bench_eval_cache.py --quick     # tiny model, a few questions: the pipeline, not the number
"""

from __future__ import annotations

import argparse
import statistics

import torch
from bench_generation import run_variant
from bench_learning import MODEL_DEFAULTS
from common import (
    TASK_LIMITS,
    TASK_SIZES,
    environment,
    load_model,
    make_task,
    markdown_table,
    warm_started_model,
    write_json,
)

SETTINGS = {"none": False, "prefix": True}  # table label -> AgentSettings.reuse_prefixes


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", choices=["tiny", "smollm2"], default="smollm2")
    p.add_argument("--num_questions", type=int, default=32, help="the first N held-out questions of the search task")
    p.add_argument("--warm_start_steps", type=int, default=None,
                   help="SFT steps before evaluating (default: the learning benchmark's; --quick: none)")
    p.add_argument("--repeats", type=int, default=1, help="timings per setting, alternating the order")
    p.add_argument("--batch_size", type=int, default=64, help="questions answered together (GreedyEngine)")
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--quick", action="store_true", help="tiny model, 4 questions, 2 turns: a smoke test")
    p.add_argument("--output", default=None, help="JSON file for the rows and the environment")
    args = p.parse_args(argv)
    # the learning benchmark's task, warm start and held-out limits for this model: the same world, the same cached
    # warm start, the same evaluation as its learning runs
    limits = {**TASK_LIMITS["search"], "max_turn_tokens": None, "num_test": TASK_SIZES["search"][1],
              "warm_start_lr": 3e-3, "warm_start_batch_size": 8, "lora_rank": None, **MODEL_DEFAULTS[args.model]}
    if args.quick:
        args.model, args.num_questions = "tiny", min(args.num_questions, 4)
        limits = {**limits, "max_turns": 2, "max_completion_length": 48, "warm_start_steps": 0, "num_test": 4}
    if args.warm_start_steps is None:
        args.warm_start_steps = limits["warm_start_steps"]
    if not 1 <= args.num_questions <= limits["num_test"] or args.repeats < 1:
        p.error(f"--num_questions must be 1 to {limits['num_test']} (the held-out questions), --repeats at least 1")
    for name in ("max_turns", "max_completion_length", "max_turn_tokens", "num_test", "warm_start_lr",
                 "warm_start_batch_size", "lora_rank"):
        setattr(args, name, limits[name])
    return args


def main(argv=None) -> dict:
    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    task = make_task("search", TASK_SIZES["search"][0], args.num_test)
    base = None
    if args.model == "smollm2":
        from trl_tree.testing import smollm2_path

        base = smollm2_path()
    model_path = warm_started_model(task, base, args.warm_start_steps, lr=args.warm_start_lr,
                                    batch_size=args.warm_start_batch_size, lora_rank=args.lora_rank)
    model, tokenizer = load_model(model_path)
    runs: dict[str, list[dict]] = {label: [] for label in SETTINGS}
    for repeat in range(args.repeats):
        for label in (SETTINGS if repeat % 2 == 0 else reversed(SETTINGS)):
            runs[label].append(run_variant(model, tokenizer, task, args, chunk=None, reuse_prefixes=SETTINGS[label]))
            print(f"[{label}] repeat {repeat}: {runs[label][-1]['seconds']:.1f} s, "
                  f"{runs[label][-1]['cpu_seconds']:.1f} CPU s", flush=True)
    reference = runs["none"][0]["histories"]
    baseline_cpu = statistics.fmean(r["cpu_seconds"] for r in runs["none"])
    rows = []
    for label, points in runs.items():
        cpu = statistics.fmean(p["cpu_seconds"] for p in points)
        rows.append({"kv_reuse": label, "repeats": len(points), "seconds": statistics.fmean(p["seconds"] for p in points),
                     "cpu_seconds": cpu, "cpu_ratio": cpu / baseline_cpu, "speedup": baseline_cpu / cpu,
                     "generated_tokens": points[0]["generated_tokens"], "calls": points[0]["calls"],
                     "same_answers": sum(h == r for h, r in zip(points[0]["histories"], reference))})
    print(markdown_table(rows, list(rows[0])))
    payload = {"config": vars(args), "model_path": model_path, "environment": environment(), "rows": rows,
               "questions": args.num_questions}
    if args.output:
        write_json(args.output, payload)
    return payload


if __name__ == "__main__":
    main()
