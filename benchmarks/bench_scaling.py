"""Scaling curves: what a tree costs as it grows, against GRPO's flat group at a matched trajectory budget.

One axis at a time around a default point, every other setting held (`--axes`, and each axis's points can be given):

    leaves              (M, N) from (2, 1) to (8, 4): K = M(N + 1) leaves per tree, 4 to 40
    turns               assistant turns per trajectory, 2 to 8 (turns - 1 tool calls, then the answer)
    observation_tokens  tokens of each tool result, 128 to 4,096
    prompts             prompts (trees) per generation batch, 1 to 16

At every point two variants, each in a fresh process (`--no-isolate`: all in this one):

    tree   TreeOPSDTrainer, one (M, N) tree per prompt, packing="tree"
    flat   GRPO's loss on the same agent loop (TreeConfig sampler="flat", bench_step.py's `flat_grpo`) with
           G = M(1 + N/2) trajectories per prompt: the trajectories an (M, N) tree is expected to generate
           (docs/design.md §3), so both spend the same trajectory budget, and the tree gets K = M(N + 1) leaves for it.

What is real and what is scripted. Real: the library end to end (the trainer, the init-expand sampler and its anchors,
the turn loop, tool execution, the tool messages rendered and tokenized by the chat template, the prefix KV store,
`generate`'s prefill and decode steps, rewards, merging, credit, packing, π_old's forward, the loss's forward and
backward, the optimizer step) on a real model: the tiny Qwen3 of `trl_tree.testing` (random weights: nothing here
depends on what it has learnt) or, with `--model smollm2`, SmolLM2-135M-Instruct with LoRA. Scripted: which tokens
the policy emits and what the tool returns. A logits processor forces every sampled token to the script's: the model
still computes every step's logits (the compute is the model's, the choice is the script's), so a sampled turn is
exactly `--action_tokens` tokens, a trajectory makes exactly turns - 1 `lookup` calls and then answers, and every
observation is `observation_tokens` one-token words (plus the chat template's few). Queries and observations are random
words, so two trajectories share exactly what the tree makes them share, and the reward (the answer's word in the first
half of the word list) is a fair coin per leaf. So the sweep measures what the library and the model cost for a given
shape of tree, not what a random model happens to ramble; token counts are exact and reproducible (given `--seed`).
`--engine scripted` replaces the forced model by `trl_tree.testing.ScriptedEngine` (no model in sampling: the
library's own sampling overhead alone).

Measured per point and variant, the mean over `--batches` generation batches after `--warmup` (`common.BatchMeter`):
generation CPU seconds (the trainer's generation phase: sampling, tools, rewards, merging, packing, π_old's forward;
`sampling` is its `generate` calls alone), training CPU seconds (the rest of the batch: loss forwards, backwards, the
optimizer step), peak memory above the batch's start in each phase (CPU: resident set, freed memory handed back to the
system at each phase's start; GPU: allocated), generated tokens and tokens forwarded by the loss passes; each also per
leaf and per unique token (the trees' prompt and unique turns, each once). CPU seconds are this process's
(`time.process_time`, one torch thread): on shared cores they are what the run would take on one idle core.

Training: one tree (flat: one group) per micro-batch, a generation batch's micro-batches accumulated into one optimizer
step (E = 1), so the training memory is one tree's whatever the prompts per batch.

Each axis's curve is fitted as cost ≈ a·x^b (least squares on log-log); the exponent b is in the JSON, the table and the
plot. The summary says along which axes the tree's cost per leaf falls and by how much against the flat group.

On CPU, observations past 512 tokens need more than 1.5 GB per process (sdpa's math kernel attends each long chain:
memory grows with the square of its length) and minutes a generation batch (a tree at 2,048: 187 CPU s): the committed
run stops that axis at 512; a separate run at P = 1 takes it to 4,096 (11.6 GB for the flat group's training there;
benchmarks/README.md, section 9).

Usage:
    python benchmarks/bench_scaling.py --quick                                  # seconds: 2 points per axis
    python benchmarks/bench_scaling.py --observation_tokens 128,256,512 --warmup 0 --batches 2 \
        --output benchmarks/results/scaling.json --plot benchmarks/results/scaling.png   # the README's, 10 CPU min
    python benchmarks/bench_scaling.py --report_only --output benchmarks/results/scaling.json --plot scaling.png
    python benchmarks/bench_scaling.py --model smollm2 --axes leaves --default 4,2,3,128,1 --warmup 0 --batches 1 \\
        --output benchmarks/results/scaling_smollm2_leaves.json   # and --axes turns: 3 points each, 24 and 45 CPU min
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import json
import math
import multiprocessing
import random
import statistics
import tempfile
import time
import zlib
from concurrent.futures import ProcessPoolExecutor
from dataclasses import asdict, dataclass, replace
from pathlib import Path

import torch
from common import (
    BatchMeter,
    Budget,
    PeakMemory,
    Task,
    build_trainer,
    environment,
    load_model,
    lora_config,
    markdown_table,
    summarize,
    write_json,
)
from transformers import LogitsProcessor, LogitsProcessorList
from transformers.trainer_callback import PrinterCallback

from trl_tree.rollout.generating.engine import HFEngine
from trl_tree.testing import ScriptedEngine
from trl_tree.trainer.engine_ports import hf_ports

AXES = ("leaves", "turns", "observation_tokens", "prompts")
AXIS_LABELS = {"leaves": "leaves per tree K = M(N + 1)", "turns": "turns per trajectory",
               "observation_tokens": "observation tokens", "prompts": "prompts per generation batch"}
VARIANTS = ("tree", "flat")


@dataclass(frozen=True)
class Point:
    """One setting of the four axes."""

    num_initial_rollouts: int = 4  # M
    num_branches: int = 2  # N
    turns: int = 3
    # 128, not 256: on CPU the chains of long observations are attended by sdpa's math kernel, whose training memory
    # grows with the square of a chain's length; at 256 the 8-turn point needed 1.9 GB per process (benchmarks/README.md)
    observation_tokens: int = 128
    prompts: int = 4

    def __post_init__(self):
        if (self.num_initial_rollouts * self.num_branches) % 2:
            raise ValueError(f"M·N must be even for a whole matched group G = M(1 + N/2): {self}")

    @property
    def leaves(self) -> int:
        return self.num_initial_rollouts * (self.num_branches + 1)

    @property
    def group_size(self) -> int:
        """GRPO's matched G = M(1 + N/2) (docs/design.md §3)."""
        return self.num_initial_rollouts * (2 + self.num_branches) // 2

    def value(self, axis: str):
        return {"leaves": self.leaves, "turns": self.turns, "observation_tokens": self.observation_tokens,
                "prompts": self.prompts}[axis]

    def name(self) -> str:
        return (f"M{self.num_initial_rollouts}N{self.num_branches}-T{self.turns}-O{self.observation_tokens}"
                f"-P{self.prompts}")


# the full sweep (what benchmarks/README.md reports): the leaves axis grows N at M = 4 and M at N = 2 through the
# default (4, 2), which is what separates what more leaves per trajectory save from what more trajectories cost
FULL_AXES = {"leaves": [(2, 1), (2, 2), (4, 1), (4, 2), (4, 4), (8, 2), (8, 4)], "turns": [2, 3, 4, 6, 8],
             "observation_tokens": [128, 256, 512, 1024, 2048, 4096], "prompts": [1, 2, 4, 8, 16]}
QUICK_DEFAULT = Point(num_initial_rollouts=2, num_branches=1, turns=2, observation_tokens=32, prompts=2)
QUICK_AXES = {"leaves": [(2, 1), (2, 2)], "turns": [2, 3], "observation_tokens": [32, 64], "prompts": [1, 2]}
# SmolLM2 (`--model smollm2`): the issue's 3 points on the leaves and turns axes
SMOLLM2_AXES = {"leaves": [(2, 1), (4, 2), (8, 4)], "turns": [2, 4, 8]}


# ---------------------------------------------------------------------------------------------------------------------
# The scripted task: a `lookup` tool with observations of a set length, a policy that calls it a set number of times
# ---------------------------------------------------------------------------------------------------------------------


def one_token_words(tokenizer, count: int = 512) -> list[tuple[str, int]]:
    """`count` alphabetic words that are one token with their leading space, and those tokens: text made of them has
    exactly one token per word (byte-level BPE splits before each space, so neighbouring words never merge)."""
    words = []
    for token, token_id in sorted(tokenizer.get_vocab().items(), key=lambda item: item[1]):
        word = token[1:]
        if token.startswith("Ġ") and len(word) >= 3 and word.isascii() and word.isalpha():
            if tokenizer.encode(" " + word, add_special_tokens=False) == [token_id]:
                words.append((word, token_id))
                if len(words) == count:
                    break
    if len(words) < 16:
        raise ValueError(f"{type(tokenizer).__name__} has only {len(words)} one-token words; this task needs 16.")
    return words


def scripted_task(words: list[tuple[str, int]], observation_tokens: int, num_prompts: int = 64) -> Task:
    """Prompts asking to look something up, the `lookup` tool (exactly `observation_tokens` random one-token words
    after "Found", seeded by the query), and a fair-coin reward: 1 when the final message's last word is in the first
    half of the word list (the policy picks it at random)."""
    words = [w for w, _ in words]
    winning = set(words[: len(words) // 2])

    def lookup(query: str) -> str:
        """
        Looks a query up in the reference text.

        Args:
            query: What to look up.

        Returns:
            The passage found for the query.
        """
        rng = random.Random(zlib.crc32(query.encode()))
        return "Found" + "".join(" " + rng.choice(words) for _ in range(observation_tokens))

    def coin_reward(completions, **kwargs) -> list[float]:
        rewards = []
        for completion in completions:
            text = (completion[-1].get("content") or "") if isinstance(completion, list) else str(completion)
            rewards.append(float(bool(text.split()) and text.split()[-1] in winning))
        return rewards

    rows = [{"prompt": [{"role": "user", "content": f"Look up item {i} and answer in one word."}], "answer": ""}
            for i in range(num_prompts)]
    return Task(name="scripted", train_rows=rows, test_rows=[], tools=[lookup], reward_funcs=[coin_reward],
                warm_start_conversations=[])


class ScriptedPolicy:
    """What the policy says after a history: a `lookup` call while the history has fewer than `turns - 1` tool
    results, else an answer; every turn exactly `action_tokens` tokens (the end-of-turn token included), its words
    drawn at random (seeded). A history's tool results are counted from its `<|im_start|>` headers: each tool round adds
    two (the tool message and the next assistant turn) to the prompt's."""

    CALL_HEAD = '<tool_call>\n{"name": "lookup", "arguments": {"query": "find'
    CALL_TAIL = '"}}\n</tool_call>'
    ANSWER_HEAD = "Answer:"

    def __init__(self, tokenizer, words: list[tuple[str, int]], tools, turns: int, action_tokens: int, seed: int):
        self.words = [token_id for _, token_id in words]
        self.eos = tokenizer.convert_tokens_to_ids("<|im_end|>")
        self.header = tokenizer.convert_tokens_to_ids("<|im_start|>")
        encode = functools.partial(tokenizer.encode, add_special_tokens=False)
        self.call_head, self.call_tail, self.answer_head = (encode(self.CALL_HEAD), encode(self.CALL_TAIL),
                                                            encode(self.ANSWER_HEAD))
        self.call_words = action_tokens - len(self.call_head) - len(self.call_tail) - 1
        self.answer_words = action_tokens - len(self.answer_head) - 1
        if min(self.call_words, self.answer_words) < 1:
            raise ValueError(f"--action_tokens {action_tokens} leaves no room for a query: at least "
                             f"{len(self.call_head) + len(self.call_tail) + 2} with this tokenizer.")
        self.calls = turns - 1
        prompt = tokenizer.apply_chat_template([{"role": "user", "content": "x"}], tools=tools, tokenize=False,
                                               add_generation_prompt=True)
        self.prompt_headers = prompt.count("<|im_start|>")
        self.rng = random.Random(seed)

    def __call__(self, prefix: list[int]) -> list[int]:
        extra = prefix.count(self.header) - self.prompt_headers
        if extra < 0 or extra % 2:
            raise RuntimeError(f"a history with {extra} headers past the prompt's: not a prompt plus whole tool rounds "
                               "(the chat template renders tool results differently from what ScriptedPolicy counts).")
        choose = self.rng.choice
        if extra // 2 < self.calls:
            return self.call_head + [choose(self.words) for _ in range(self.call_words)] + self.call_tail + [self.eos]
        return self.answer_head + [choose(self.words) for _ in range(self.answer_words)] + [self.eos]


class _ForceTokens(LogitsProcessor):
    """Every row's next token is its script's: all logits -inf but that token's (temperature, top-k and top-p leave a
    single finite logit alone, so sampling returns it). Past its script a row gets `fill` (it has ended its turn)."""

    def __init__(self, replies: list[list[int]], fill: int):
        width = max(len(r) for r in replies) + 1
        self.forced = torch.tensor([r + [fill] * (width - len(r)) for r in replies])
        self.start: int | None = None

    def __call__(self, input_ids, scores):
        if self.start is None:  # generate hands the processors the whole sequence so far: the first call is step 0
            self.start = input_ids.shape[1]
        step = min(input_ids.shape[1] - self.start, self.forced.shape[1] - 1)
        forced = self.forced[:, step : step + 1].to(scores.device)
        return torch.full_like(scores, float("-inf")).scatter_(1, forced, 0.0)


class ForcedEngine(HFEngine):
    """The trainer's own HF engine (prefix KV store, its cache, `generate`) with the script's tokens forced: the
    model's computation, the script's choices. Checks that what came back is the script."""

    def __init__(self, trainer, policy: ScriptedPolicy):
        super().__init__(hf_ports(trainer), with_scores=trainer.needs_entropies)
        self.trainer, self.policy = trainer, policy  # `_forcing` patches the model the trainer's ports unwrap

    def generate(self, prefixes, max_new_tokens):
        if not prefixes:
            return super().generate(prefixes, max_new_tokens)
        replies = [self.policy(list(p)) for p in prefixes]
        with _forcing(self.trainer, _ForceTokens(replies, self.policy.eos)):
            continuations = super().generate(prefixes, max_new_tokens)
        for continuation, reply, budget in zip(continuations, replies, max_new_tokens):
            if continuation.ids != reply[:budget]:
                raise RuntimeError("the forced generation differs from its script: the rows of `generate` are not "
                                   "the prefixes' order, or a processor after ours changed the logits.")
        return continuations


@contextlib.contextmanager
def _forcing(trainer, processor: LogitsProcessor):
    """`generate` of the model the engine will unwrap, with `processor` added, for one call (an instance attribute
    over the class's method, removed after: the library's code is not changed)."""
    model = trainer.accelerator.unwrap_model(trainer.model_wrapped)
    own = vars(model).get("generate")
    model.generate = functools.partial(own or type(model).generate.__get__(model),
                                       logits_processor=LogitsProcessorList([processor]))
    try:
        yield
    finally:
        if own is None:
            del model.generate
        else:
            model.generate = own


# ---------------------------------------------------------------------------------------------------------------------
# One point
# ---------------------------------------------------------------------------------------------------------------------


def trajectory_budget(point: Point, action_tokens: int) -> int:
    """Tokens a trajectory may have: its turns and observations with room for the template (the script never needs
    the limit: nothing is cut)."""
    return point.turns * (action_tokens + point.observation_tokens + 64)


def run_variant(variant: str, point: Point, model_path: str, args: argparse.Namespace) -> dict:
    """Train `variant` at `point` for warmup + batches generation batches; the summary of the measured ones."""
    from transformers import AutoConfig

    if not torch.cuda.is_available():
        torch.set_num_threads(args.threads)
    random.seed(args.seed)
    torch.manual_seed(args.seed)
    budget_tokens = trajectory_budget(point, args.action_tokens)
    # room for the prompt (a few hundred tokens with the tool schema) and the trajectory: both models here use the
    # default RoPE, computed for any position, so raising the limit changes no weight, only what the trainer checks
    positions = max(AutoConfig.from_pretrained(model_path).max_position_embeddings, budget_tokens + 1024)
    model, tokenizer = load_model(model_path, max_position_embeddings=positions)
    words = one_token_words(tokenizer)
    task = scripted_task(words, point.observation_tokens, num_prompts=max(64, 4 * point.prompts))
    budget = Budget(prompts=point.prompts, blocks=point.prompts, group_size=point.group_size,
                    num_initial_rollouts=point.num_initial_rollouts, num_branches=point.num_branches,
                    generation_batches=args.warmup + args.batches, learning_rate=args.learning_rate,
                    max_turns=point.turns, max_completion_length=budget_tokens,
                    max_turn_tokens=args.action_tokens + 8, seed=args.seed)
    method = {"tree": "treeopsd", "flat": "flat_grpo"}[variant]
    with tempfile.TemporaryDirectory() as output_dir:
        trainer = build_trainer(
            method, model, tokenizer, task, budget, output_dir, packing="tree",
            peft_config=lora_config(16) if args.model == "smollm2" else None,
            # one tree (group) per micro-batch, accumulated into one optimizer step per generation batch (E = 1)
            gradient_accumulation_steps=point.prompts, max_steps=budget.generation_batches, logging_steps=1,
            max_observation_chars=None, generation_cache=args.generation_cache,
        )
        trainer.remove_callback(PrinterCallback)
        policy = ScriptedPolicy(tokenizer, words, task.tools, point.turns, args.action_tokens, seed=args.seed)
        trainer.generation_engine = (ForcedEngine(trainer, policy) if args.engine == "forced"
                                     else ScriptedEngine(policy, eos_ids=[policy.eos]))
        meter = BatchMeter(trainer, memory=PeakMemory(release_freed=True))
        started = time.process_time()
        trainer.train()
        meter.memory.close()
    measured = meter.batches[args.warmup :]
    summary = summarize(measured)
    print(f"[{point.name()} {variant}] {len(meter.batches)} generation batches ({args.warmup} warm-up) in "
          f"{time.process_time() - started:.1f} CPU s", flush=True)
    return {**derived(summary), "per_batch": [asdict(b) for b in meter.batches]}


# per-leaf and per-unique-token versions of these (the memory ones: above the batch's start)
COSTS = ("generation_cpu_seconds", "sampling_cpu_seconds", "training_cpu_seconds", "step_cpu_seconds",
         "generation_memory_mib", "training_memory_mib", "generated_tokens", "forward_tokens")


def derived(summary: dict) -> dict:
    """The summary with each phase's memory above the batch's start, and every cost per leaf and per unique token."""
    out = dict(summary)
    out["generation_memory_mib"] = summary["generation_peak_memory_mib"] - summary["start_memory_mib"]
    out["training_memory_mib"] = summary["training_peak_memory_mib"] - summary["start_memory_mib"]
    for cost in COSTS:
        out[f"{cost}_per_leaf"] = out[cost] / summary["leaves"]
        out[f"{cost}_per_unique_token"] = out[cost] / summary["unique_tokens"]
    return out


def measure(points: list[Point], model_path: str, args: argparse.Namespace) -> dict[Point, dict[str, dict]]:
    """Every variant at every point, the variants of a point back to back (so a change in the machine's load hits
    both alike), each in a fresh process with `--isolate` (its memory is its own)."""
    results = {}
    for point in points:
        results[point] = {}
        for variant in args.variants:
            if args.isolate:
                context = multiprocessing.get_context("spawn")
                with ProcessPoolExecutor(max_workers=1, mp_context=context) as pool:
                    results[point][variant] = pool.submit(run_variant, variant, point, model_path, args).result()
            else:
                results[point][variant] = run_variant(variant, point, model_path, args)
    return results


# ---------------------------------------------------------------------------------------------------------------------
# Fits, table, plot, summary
# ---------------------------------------------------------------------------------------------------------------------


def exponent(xs: list[float], ys: list[float]) -> float | None:
    """b of y ≈ a·x^b, least squares on log-log; None with fewer than 2 positive points or one x."""
    pairs = [(math.log(x), math.log(y)) for x, y in zip(xs, ys) if x > 0 and y is not None and y > 0]
    if len(pairs) < 2 or len({x for x, _ in pairs}) < 2:
        return None
    mx, my = statistics.fmean(x for x, _ in pairs), statistics.fmean(y for _, y in pairs)
    return sum((x - mx) * (y - my) for x, y in pairs) / sum((x - mx) ** 2 for x, _ in pairs)


FITTED = ("generation_cpu_seconds", "sampling_cpu_seconds", "training_cpu_seconds", "step_cpu_seconds",
          "generation_memory_mib", "training_memory_mib", "generated_tokens", "forward_tokens",
          "step_cpu_seconds_per_leaf", "generation_cpu_seconds_per_leaf", "training_cpu_seconds_per_leaf",
          "generated_tokens_per_leaf", "forward_tokens_per_leaf", "step_cpu_seconds_per_unique_token")
RATIOS = ("step_cpu_seconds", "step_cpu_seconds_per_leaf", "generation_cpu_seconds_per_leaf",
          "training_cpu_seconds_per_leaf", "generated_tokens_per_leaf", "forward_tokens_per_leaf")


def sweep(axis: str, points: list[Point], results: dict) -> dict:
    """One axis's points (tree and flat at each, with tree / flat ratios) and the exponents of each cost."""
    rows = []
    for point in sorted(points, key=lambda p: (p.value(axis), p.num_branches)):
        tree, flat = results[point]["tree"], results[point]["flat"]
        rows.append({"x": point.value(axis), "point": asdict(point), "K": point.leaves, "G": point.group_size,
                     "tree": {k: v for k, v in tree.items() if k != "per_batch"},
                     "flat": {k: v for k, v in flat.items() if k != "per_batch"},
                     "tree_over_flat": {r: tree[r] / flat[r] if flat[r] else None for r in RATIOS}})
    xs = [r["x"] for r in rows]
    exponents = {v: {m: exponent(xs, [r[v][m] for r in rows]) for m in FITTED} for v in VARIANTS}
    return {"axis": axis, "label": AXIS_LABELS[axis], "points": rows, "exponents": exponents}


TABLE = ["x", "variant", "leaves", "generation_cpu_seconds", "sampling_cpu_seconds", "training_cpu_seconds",
         "step_cpu_seconds_per_leaf", "per_leaf_vs_flat", "generation_memory_mib", "training_memory_mib",
         "generated_tokens", "forward_tokens", "generated_tokens_per_leaf", "forward_tokens_per_leaf",
         "step_cpu_seconds_per_unique_token"]
HEADERS = {"generation_cpu_seconds": "gen CPU s", "sampling_cpu_seconds": "of it sampling", "training_cpu_seconds":
           "train CPU s", "step_cpu_seconds_per_leaf": "CPU s / leaf", "per_leaf_vs_flat": "tree / flat per leaf",
           "generation_memory_mib": "gen MiB", "training_memory_mib": "train MiB", "generated_tokens": "generated",
           "forward_tokens": "forwarded", "generated_tokens_per_leaf": "gen / leaf", "forward_tokens_per_leaf":
           "fwd / leaf", "step_cpu_seconds_per_unique_token": "CPU ms / 1k unique"}


def table(result: dict) -> str:
    """One row per variant and point (memory: the phase's peak above the batch's start), then the exponents."""
    rows = []
    for row in result["points"]:
        x = (f"({row['point']['num_initial_rollouts']}, {row['point']['num_branches']})" if result["axis"] == "leaves"
             else row["x"])
        for variant in VARIANTS:
            values = {**row[variant], "x": x if variant == "tree" else "",
                      "variant": "tree" if variant == "tree" else f"flat, G = {row['G']}"}
            values["step_cpu_seconds_per_unique_token"] *= 1e6  # ms per 1k tokens
            if variant == "tree":
                values["per_leaf_vs_flat"] = row["tree_over_flat"]["step_cpu_seconds_per_leaf"]
            rows.append(values)
    lines = [markdown_table(rows, TABLE, {**HEADERS, "x": result["axis"]})]
    for variant in VARIANTS:
        e = result["exponents"][variant]
        lines.append("| " + " | ".join(["exponent", variant, ""] + [
            f"{e[c]:+.2f}" if e.get(c) is not None else "" for c in TABLE[3:]]) + " |")
    return "\n".join(lines)


def summary_lines(sweeps: dict[str, dict]) -> list[str]:
    """Along each axis (and, for the leaves, along M and along N apart), whether the tree's CPU seconds per leaf fall,
    and why: per leaf = (unique tokens per leaf) × (CPU per unique token), i.e. how much of a leaf the tree shares and
    what each unique token costs (longer contexts, fuller batches), with the flat group's beside it."""
    lines = []
    for axis, result in sweeps.items():
        points = result["points"]
        lines.append(_transition(axis, points[0], points[-1], result["exponents"]))
        if axis == "leaves":  # the two ways a tree grows: more leaves per trajectory (N), more trajectories (M)
            by_mn = {(r["point"]["num_initial_rollouts"], r["point"]["num_branches"]): r for r in points}
            for label, a, b in (("N at M = 4", (4, 1), (4, 4)), ("M at N = 2", (2, 2), (8, 2))):
                if a in by_mn and b in by_mn:
                    lines.append("  " + _transition(f"growing {label}, (M, N)", by_mn[a], by_mn[b]))
    return lines


def _transition(name: str, a: dict, b: dict, exponents: dict | None = None) -> str:
    """One line: the tree's CPU per leaf from point a to b, split into sharing and per-token cost, and the flat's."""

    def change(variant, key):
        return b[variant][key] / a[variant][key] if a[variant][key] else float("nan")

    def verdict(factor):
        return "falls" if factor < 0.9 else "rises" if factor > 1.1 else "stays"

    def unique_per_leaf(variant, row):
        return row[variant]["unique_tokens"] / row[variant]["leaves"]

    tree, flat = change("tree", "step_cpu_seconds_per_leaf"), change("flat", "step_cpu_seconds_per_leaf")
    a_x = a["x"] if not name.startswith("growing") else f"({a['point']['num_initial_rollouts']}, {a['point']['num_branches']})"
    b_x = b["x"] if not name.startswith("growing") else f"({b['point']['num_initial_rollouts']}, {b['point']['num_branches']})"
    fitted = f" (exponent {_fmt(exponents['tree']['step_cpu_seconds_per_leaf'])})" if exponents else ""
    return (
        f"{name} {a_x} -> {b_x}: the tree's CPU per leaf {verdict(tree)}, x{tree:.2f}{fitted} = "
        f"x{unique_per_leaf('tree', b) / unique_per_leaf('tree', a):.2f} unique tokens per leaf (sharing) "
        f"x {change('tree', 'step_cpu_seconds_per_unique_token'):.2f} CPU per unique token (context, batching); "
        f"the flat group's x{flat:.2f} (x{unique_per_leaf('flat', b) / unique_per_leaf('flat', a):.2f} x "
        f"{change('flat', 'step_cpu_seconds_per_unique_token'):.2f}); tree / flat per leaf "
        f"{a['tree_over_flat']['step_cpu_seconds_per_leaf']:.2f} -> {b['tree_over_flat']['step_cpu_seconds_per_leaf']:.2f}"
    )


def _fmt(value: float | None) -> str:
    return "n/a" if value is None else f"{value:+.2f}"


PANELS = (("generation_cpu_seconds", "generation CPU s"), ("training_cpu_seconds", "training CPU s"),
          ("step_cpu_seconds_per_leaf", "CPU s per leaf"), ("memory", "peak MiB above batch start"))


def plot(sweeps: dict[str, dict], path: str, title: str) -> None:
    """One row per axis: generation and training CPU seconds, CPU seconds per leaf, each phase's peak memory; tree
    and flat on one log-log panel, the fitted exponent in the legend."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
        import matplotlib.ticker
    except ImportError:
        print("matplotlib is not installed (pip install -e '.[plot]'): no plot.")
        return
    fig, axes = plt.subplots(len(sweeps), len(PANELS), figsize=(4.2 * len(PANELS), 3.3 * len(sweeps)), squeeze=False)
    colors = {"tree": "tab:green", "flat": "tab:blue"}
    plain = matplotlib.ticker.FuncFormatter(lambda v, _: f"{v:g}")
    for row, result in enumerate(sweeps.values()):
        xs = [p["x"] for p in result["points"]]
        for col, (metric, label) in enumerate(PANELS):
            ax = axes[row][col]
            series = ([(m, style) for m, style in (("generation_memory_mib", "-"), ("training_memory_mib", "--"))]
                      if metric == "memory" else [(metric, "-")])
            for variant in VARIANTS:
                for name, style in series:
                    ys = [p[variant][name] for p in result["points"]]
                    b = result["exponents"][variant].get(name)
                    tag = f"{variant}{' ' + name.split('_')[0] if metric == 'memory' else ''} (b = {_fmt(b)})"
                    keep = [(x, y) for x, y in zip(xs, ys) if y > 0]
                    if keep:
                        ax.plot(*zip(*keep), style, marker="o", color=colors[variant], label=tag, markersize=4)
            ax.set_xscale("log")
            ax.set_yscale("log")
            ax.set_xticks(xs, [str(x) for x in xs])  # the points themselves, as plain numbers
            ax.xaxis.set_minor_formatter(matplotlib.ticker.NullFormatter())
            # plain numbers at 1, 2 and 5 of each decade: most curves span less than a decade
            ax.yaxis.set_minor_locator(matplotlib.ticker.LogLocator(subs=(2.0, 5.0)))
            ax.yaxis.set_major_formatter(plain)
            ax.yaxis.set_minor_formatter(plain)
            ax.set_xlabel(result["label"])
            ax.set_title(label, fontsize=10)
            ax.legend(fontsize=7)
            ax.grid(True, which="both", alpha=0.3)
    fig.suptitle(title)
    fig.tight_layout()
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=80)
    print(f"wrote {path}", flush=True)


# ---------------------------------------------------------------------------------------------------------------------
# Command line
# ---------------------------------------------------------------------------------------------------------------------


def _pairs(text: str) -> list[tuple[int, int]]:
    return [tuple(int(v) for v in item.lower().split("x")) for item in text.split(",") if item.strip()]


def _ints(text: str) -> list[int]:
    return [int(v) for v in text.split(",") if v.strip()]


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--model", choices=("tiny", "smollm2"), default="tiny",
                   help="tiny: the 2-layer Qwen3 of trl_tree.testing; smollm2: SmolLM2-135M-Instruct with LoRA rank 16 "
                        "(trl_tree.testing.smollm2_path(); default axes: leaves and turns, 3 points each)")
    p.add_argument("--model_name_or_path", default=None,
                   help="another model folder with --model's settings (the tests run the smollm2 settings on the tiny "
                        "model)")
    p.add_argument("--engine", choices=("forced", "scripted"), default="forced",
                   help="forced: the model's generate with the script's tokens forced; scripted: ScriptedEngine, "
                        "no model call in sampling")
    p.add_argument("--axes", default=None, help=f"comma-separated subset of {list(AXES)} (default: all; smollm2: "
                                                "leaves,turns)")
    p.add_argument("--leaves", type=_pairs, default=None, help="the leaves axis's (M, N) points, e.g. 2x1,4x2,8x4")
    p.add_argument("--turns", type=_ints, default=None, help="the turns axis's points, e.g. 2,4,8")
    p.add_argument("--observation_tokens", type=_ints, default=None, help="the observation axis's points")
    p.add_argument("--prompts", type=_ints, default=None, help="the prompts axis's points")
    p.add_argument("--default", default=None,
                   help="the point every other axis is held at, M,N,turns,observation_tokens,prompts (default 4,2,3,128,4)")
    p.add_argument("--variants", default=",".join(VARIANTS),
                   help="tree, flat or both (the sweep's ratios and summary need both)")
    p.add_argument("--action_tokens", type=int, default=32, help="tokens of every sampled turn")
    p.add_argument("--batches", type=int, default=2, help="measured generation batches per variant and point")
    p.add_argument("--warmup", type=int, default=1, help="generation batches run before measuring")
    p.add_argument("--learning_rate", type=float, default=None, help="default: 1e-5 (tiny), 2e-4 (smollm2, LoRA)")
    p.add_argument("--generation_cache", choices=("prefix", "static", "dynamic"), default="prefix",
                   help="TreeConfig.generation_cache (both variants)")
    p.add_argument("--threads", type=int, default=1, help="torch threads on CPU")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--isolate", action=argparse.BooleanOptionalAction, default=True,
                   help="run each variant at each point in a fresh process (default) or all in this one")
    p.add_argument("--quick", action="store_true",
                   help="smoke run: 2 points per axis around a small default, 1 batch, no warm-up, in-process")
    p.add_argument("--report_only", action="store_true",
                   help="measure nothing: the tables, summary and plot of the JSON at --output (its summary rewritten)")
    p.add_argument("--output", default=None, help="write the results as JSON here")
    p.add_argument("--plot", default=None, help="write the plot (PNG) here")
    args = p.parse_args(argv)
    if args.quick:
        args.batches, args.warmup, args.isolate = 1, 0, False
    args.variants = [v.strip() for v in args.variants.split(",") if v.strip()]
    if set(args.variants) - set(VARIANTS):
        p.error(f"--variants: choose from {list(VARIANTS)}")
    args.learning_rate = args.learning_rate or (2e-4 if args.model == "smollm2" else 1e-5)
    chosen = QUICK_AXES if args.quick else SMOLLM2_AXES if args.model == "smollm2" else FULL_AXES
    names = ([a.strip() for a in args.axes.split(",")] if args.axes
             else list(SMOLLM2_AXES) if args.model == "smollm2" else list(chosen))
    unknown = set(names) - set(AXES)
    if unknown:
        p.error(f"unknown axes {sorted(unknown)}; choose from {list(AXES)}")
    args.axes = {a: getattr(args, a) or chosen.get(a) or FULL_AXES[a] for a in names}
    if args.default:
        m, n, t, o, pr = _ints(args.default)
        args.default = Point(m, n, t, o, pr)
    else:
        args.default = QUICK_DEFAULT if args.quick else Point()
    return args


def axis_points(axis: str, values: list, default: Point) -> list[Point]:
    if axis == "leaves":
        return [replace(default, num_initial_rollouts=m, num_branches=n) for m, n in values]
    return [replace(default, **{axis: v}) for v in values]


def report(sweeps: dict[str, dict], title: str) -> list[str]:
    """Print each axis's table and the summary; return the summary's lines."""
    for result in sweeps.values():
        print(f"\n### {result['label']}\n\n{table(result)}")
    lines = summary_lines(sweeps)
    print("\nSummary\n" + "\n".join(lines))
    return lines


def title_of(config: dict) -> str:
    default = config["default"]
    return (f"{config['model']} model, {config['engine']} tokens; default (M, N) = ({default['num_initial_rollouts']}, "
            f"{default['num_branches']}), {default['turns']} turns, {default['observation_tokens']} observation "
            f"tokens, {default['prompts']} prompts; {config['action_tokens']} tokens per turn")


def main(argv=None):
    args = parse_args(argv)
    if args.report_only:
        if not args.output:
            raise SystemExit("--report_only reads the JSON of --output; pass --output.")
        payload = json.loads(Path(args.output).read_text())
        title = title_of(payload["config"])
        print(title)
        payload["summary"] = report(payload["sweeps"], title)
        write_json(args.output, payload)
        if args.plot:
            plot(payload["sweeps"], args.plot, title)
        return
    from trl_tree.testing import smollm2_path, tiny_model_path

    model_path = args.model_name_or_path or (smollm2_path() if args.model == "smollm2" else tiny_model_path())
    per_axis = {axis: axis_points(axis, values, args.default) for axis, values in args.axes.items()}
    points = list(dict.fromkeys(p for ps in per_axis.values() for p in ps))  # the default point is run once
    started = time.perf_counter()
    results = measure(points, model_path, args)
    if set(args.variants) != set(VARIANTS):
        for point in points:
            for variant, result in results[point].items():
                print(f"{point.name()} {variant}: " + ", ".join(
                    f"{k} {result[k]:.4g}" for k in FITTED + ("unique_tokens", "leaves", "peak_memory_mib")))
        return
    sweeps = {axis: sweep(axis, ps, results) for axis, ps in per_axis.items()}
    config = {k: (asdict(v) if isinstance(v, Point) else v) for k, v in vars(args).items() if k != "output"}
    title = title_of(config)
    print(f"\n{title}; mean of {args.batches} generation batches after {args.warmup} warm-up; "
          f"{time.perf_counter() - started:.0f} s for {len(points)} points")
    lines = report(sweeps, title)
    if args.output:  # before the plot: a plot that fails must not lose the measurements
        write_json(args.output, {"config": {**config, "model_path": model_path}, "environment": environment(),
                                 "sweeps": sweeps, "summary": lines,
                                 "runs": {p.name(): {v: results[p][v]["per_batch"] for v in VARIANTS}
                                          for p in points}})
    if args.plot:
        plot(sweeps, args.plot, title)


if __name__ == "__main__":
    main()
