"""What chunked generation (`TreeConfig.generation_chunk_tokens`) saves on identical work: greedy multi-turn agent
rollouts on held-out search questions, whole turns per `generate` call against chunks of c tokens.

Greedy decoding makes the comparison exact: every variant answers the same questions with the same turns (but for
floating-point near-ties, counted in the `same answers` column), so the CPU seconds compare the same tokens
computed two ways, unlike a sampling benchmark whose variants draw different trajectories. Variants run
round-robin in this process (`--repeats`), so a change in the machine's load hits each alike; read the CPU seconds
and their ratio to whole turns.

Usage:
    python benchmarks/bench_generation.py --output generation.json                    # the tiny model, warm-started
    python benchmarks/bench_generation.py --model_name_or_path FOLDER --warm_start_steps 0 --max_turn_tokens 64
    python benchmarks/bench_generation.py --quick
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
from common import environment, load_model, make_task, markdown_table, warm_started_model, write_json

from trl_tree.envs.agent_eval import AgentSettings, GreedyEngine, run_agent


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model_name_or_path", default=None, help="model folder (default: the tiny Qwen3)")
    p.add_argument("--warm_start_steps", type=int, default=150,
                   help="SFT steps on the task's scripted tool calls first (cached; 0 = none)")
    p.add_argument("--chunks", default="8,16,32", help="comma-separated chunk sizes c to compare with whole turns")
    p.add_argument("--num_questions", type=int, default=32, help="held-out questions answered per variant")
    p.add_argument("--batch_size", type=int, default=16, help="questions answered together (rows of a call)")
    p.add_argument("--max_turns", type=int, default=3)
    p.add_argument("--max_completion_length", type=int, default=448)
    p.add_argument("--max_turn_tokens", type=int, default=None, help="cap on one turn's tokens (None: the budget)")
    p.add_argument("--repeats", type=int, default=2, help="round-robin passes over the variants")
    p.add_argument("--threads", type=int, default=1, help="torch threads")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--quick", action="store_true", help="smoke run: 4 questions, chunks 4, 1 pass, 10 warm-start steps")
    p.add_argument("--output", default=None, help="write the results as JSON here")
    args = p.parse_args(argv)
    if args.quick:
        args.num_questions, args.batch_size, args.chunks, args.repeats = 4, 4, "4", 1
        args.warm_start_steps, args.max_completion_length = 10, 96
    args.chunks = [int(c) for c in args.chunks.split(",") if c.strip()]
    if any(c < 1 for c in args.chunks):
        p.error(f"--chunks must be positive token counts; got {args.chunks}")
    return args


class CountingEngine(GreedyEngine):
    """The evaluation engine, counting its calls, decode steps and rows × decode steps (finished rows included: a
    call runs until its longest row ends)."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.calls = self.decode_steps = self.row_steps = 0

    def _generate_batch(self, prefixes, max_new_tokens):
        self.calls += 1
        out = super()._generate_batch(prefixes, max_new_tokens)
        steps = max(len(c.ids) for c in out)
        self.decode_steps += steps
        self.row_steps += len(prefixes) * steps
        return out


def run_variant(model, tokenizer, task, args, chunk: int | None, reuse_prefixes: bool = True) -> dict:
    """One timed greedy pass over the first `args.num_questions` held-out questions: CPU and wall seconds, the
    engine's counts, and each question's whole history (to check that variants give the same answers)."""
    settings = AgentSettings(max_turns=args.max_turns, max_completion_length=args.max_completion_length,
                             max_turn_tokens=args.max_turn_tokens, batch_size=args.batch_size, chunk_tokens=chunk)
    engine = CountingEngine(model, tokenizer, batch_size=args.batch_size, reuse_prefixes=reuse_prefixes)
    prompts = [row["prompt"] for row in task.test_rows[: args.num_questions]]
    cpu, wall = time.process_time(), time.perf_counter()
    branches = run_agent(model, tokenizer, prompts, task.tools, settings, engine=engine)
    cpu, wall = time.process_time() - cpu, time.perf_counter() - wall
    generated = sum(len(turn.action_ids) for b in branches for turn in b.turns)
    return {"cpu_seconds": cpu, "seconds": wall, "generated_tokens": generated, "calls": engine.calls,
            "decode_steps": engine.decode_steps, "row_steps": engine.row_steps, "histories": [b.prefix_ids for b in branches]}


def main(argv=None):
    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    task = make_task("search", seed=args.seed)
    model_path = warm_started_model(task, args.model_name_or_path, args.warm_start_steps, seed=args.seed)
    model, tokenizer = load_model(model_path)
    variants = {"whole turns": None, **{f"chunks of {c}": c for c in args.chunks}}
    runs: dict[str, list[dict]] = {name: [] for name in variants}
    for _ in range(args.repeats):
        for name, chunk in variants.items():
            runs[name].append(run_variant(model, tokenizer, task, args, chunk))
            print(f"[{name}] {runs[name][-1]['cpu_seconds']:.1f} CPU s", flush=True)
    reference = runs["whole turns"][0]["histories"]
    base_cpu = statistics.fmean(r["cpu_seconds"] for r in runs["whole turns"])
    rows = []
    for name, chunk in variants.items():
        first = runs[name][0]
        cpu = statistics.fmean(r["cpu_seconds"] for r in runs[name])
        rows.append({
            "variant": name, "chunk_tokens": chunk, "cpu_seconds": cpu,
            "seconds": statistics.fmean(r["seconds"] for r in runs[name]),
            "cpu_vs_whole_turns": cpu / base_cpu, "generated_tokens": first["generated_tokens"],
            "calls": first["calls"], "decode_steps": first["decode_steps"], "row_steps": first["row_steps"],
            "row_steps_per_generated": first["row_steps"] / max(first["generated_tokens"], 1),
            "same_answers": sum(h == r for h, r in zip(first["histories"], reference)) / len(reference),
        })
    print(f"\nGreedy agent, {args.num_questions} held-out search questions, {args.batch_size} per batch, "
          f"{args.max_turns} turns, {args.repeats} passes, model {model_path}\n")
    print(markdown_table(rows, ["variant", "cpu_seconds", "cpu_vs_whole_turns", "seconds", "generated_tokens", "calls",
                                "decode_steps", "row_steps", "row_steps_per_generated", "same_answers"],
                         {"cpu_seconds": "CPU s", "cpu_vs_whole_turns": "CPU / whole turns", "seconds": "wall s",
                          "generated_tokens": "generated tok", "calls": "generate calls", "decode_steps": "decode steps",
                          "row_steps": "rows x decode steps", "row_steps_per_generated": "row steps / gen tok",
                          "same_answers": "same answers"}))
    if args.output:
        write_json(args.output, {"config": {**vars(args), "model_path": model_path}, "environment": environment(),
                                 "variants": rows})
        print(f"wrote {args.output}")


if __name__ == "__main__":
    main()
