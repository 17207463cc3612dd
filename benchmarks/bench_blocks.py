"""What later optimizer blocks do: TreeOPSD's finite target against TreePO's fixed credit and GRPO's clip, on the
very same trees of a real model.

TreeOPSD and TreePO differ only after the first optimizer block of a generation batch: TreePO keeps applying the
collection-time coefficient V_i / L_x, TreeOPSD scales each turn's gradient by the residual τ(q_i − p_i) to its
frozen teacher q_i = 1/2 + V_i/τ, which vanishes at p_i = q_i and reverses past it (the paper's Theorem 2). This
benchmark grows ONE generation batch of P trees (SmolLM2-135M-Instruct from `bench_learning.py`'s shared warm start,
the synthetic search task, the learning benchmark's sampling settings), then trains E sequential optimizer blocks on
those trees with each loss in turn, restarting from θ_old each time, so the only difference is the loss:

    treeopsd   the Bernoulli forward-KL to the teacher (T5)
    treepo     the fixed-credit surrogate (T7)
    clip       GRPO's token-level clipped surrogate with the tree's turn credit V_i as advantage (ε = 0.2)

at the learning benchmark's learning rate and at multiples of it (`--lr_scales`), under two schedules:

    revisit    every block trains the whole batch again (as PPO epochs do): the cleanest view of a finite target
    disjoint   the paper's schedule: the P trees split into E mini-batches, block e trains the e-th; each block's
               turns are trained after earlier blocks moved the shared policy

After every block, over every unique turn of the batch: the mean signed gap to the teacher in the direction of each
turn's target, d_i = sign(q_i − 1/2)(q_i − p_i) with p_i = σ(s_i) (positive: short of it; negative: past it), and
the fraction of turns past it; the mean and largest |s_i| (s_i: the turn's mean log-ratio to π_old; at the target
s_i = logit q_i); the teacher-forced KL(π_old ‖ π_θ) per assistant token on scripted trajectories of held-out
questions (what the policy lost elsewhere); and the fraction of trained tokens at the clip boundary (ratio past
1 ± ε in the advantage's direction: the tokens GRPO's clip gives no gradient). Under `disjoint`, each block's own
turns are also measured at the moment they are trained (`trained_*`).

The optimizer is the Trainer's default (AdamW, its betas, ε, weight decay and gradient clipping from the config) at a
constant learning rate; the loss of each block is the trainer's own `compute_loss` on the trainer's own micro-batches.

Each (schedule, method, learning rate) run is written to `<output stem>.runs/` as it finishes and skipped by a later
invocation with the same settings; the trees are cached there too, so the two schedules can run side by side in two
processes (one per core). Output: a table, JSON (`schedules[schedule]["blocks"][method][lr][e]`) and one PNG with a
panel per quantity.

Usage:
    python benchmarks/bench_blocks.py --output benchmarks/results/smollm2_blocks.json
    python benchmarks/bench_blocks.py --quick            (tiny model, seconds: checks the pipeline)
"""

from __future__ import annotations

import argparse
import copy
import json
import random
import re
import tempfile
import time
from pathlib import Path

import torch
from bench_learning import MODEL_DEFAULTS
from common import (
    Budget,
    HeldOutKL,
    build_trainer,
    environment,
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
from torch import Tensor

from trl_tree import losses
from trl_tree.core.batch import LossInputs
from trl_tree.methods import TeacherCredit, clip_epsilons

# method -> (the trainer's `loss`, its `zero_credit_anchor`): the two last are issue 40's ablation, TreeOPSD without
# its q = 1/2 pull on zero-credit turns (V_i = 0) and TreePO with it (`losses.zero_credit_anchor`)
VARIANTS = {"treeopsd": ("treeopsd", None), "treepo": ("treepo", None), "clip": ("grpo", None),
            "treeopsd_no_anchor": ("treeopsd", False), "treepo_anchor": ("treepo", True)}
LOSS_OF = {method: loss for method, (loss, _) in VARIANTS.items()}
DEFAULT_METHODS = ("treeopsd", "treepo", "clip")
# settings added after the first run files were written: left out of a run's settings at these defaults, so the
# earlier run files still match
LATER_DEFAULTS = {"tree_choice": "spread", "measure": "every"}
MAP_THRESHOLDS = (0.1, 1.0)  # held-out KL (nats per assistant token) of the stability map's "largest stable scale"
SCHEDULES = ("revisit", "disjoint")
LOG_PANELS = {"abs_s_mean": 0.01, "abs_s_max": 0.01, "heldout_kl": 1e-3}  # panel -> symlog's linear range
# the quantities plotted, one panel each (JSON key -> axis label)
PANELS = {
    "gap_mean": "mean signed gap to q (toward target)",
    "past_fraction": "fraction of turns past q",
    "abs_s_mean": "mean |s_i| (turn log-ratio)",
    "abs_s_max": "max |s_i|",
    "heldout_kl": "held-out KL(π_old ‖ π_θ) per token",
    "clip_fraction": "tokens at the clip boundary",
}


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--model", choices=sorted(MODEL_DEFAULTS), default="smollm2",
                   help="smollm2: SmolLM2-135M-Instruct with bench_learning's LoRA warm start (default); tiny: the "
                        "2-layer offline Qwen3, full fine-tuning (a smoke test of the pipeline, no finding)")
    p.add_argument("--prompts", type=int, default=8, help="prompts sampled, one tree each (cached)")
    p.add_argument("--trees", type=int, default=2,
                   help="trees trained: the first of the sampled ones with a reward spread (a tree without one has "
                        "V_i = 0 on every turn), then others if too few have one")
    p.add_argument("--blocks", type=int, default=8, help="sequential optimizer blocks (E) of the revisit schedule")
    p.add_argument("--disjoint_blocks", type=int, default=2,
                   help="blocks of the disjoint schedule (one tree each by default); --trees must be a multiple")
    p.add_argument("--methods", default=",".join(DEFAULT_METHODS), help=f"comma-separated subset of {list(LOSS_OF)}")
    p.add_argument("--schedules", default=",".join(SCHEDULES), help=f"comma-separated subset of {list(SCHEDULES)}")
    p.add_argument("--lr_scales", default="1,10", help="multiples of the learning benchmark's learning rate")
    p.add_argument("--heldout", type=int, default=2, help="scripted held-out trajectories for the KL")
    p.add_argument("--seed", type=int, default=0, help="drives the prompts and the sampling of the trees")
    p.add_argument("--tree_choice", choices=("spread", "sampled"), default="spread",
                   help="spread: the first --trees trees with a reward spread; sampled: the first --trees as sampled, "
                        "trees without a spread (all V_i = 0) included, as the learning benchmark trains them")
    p.add_argument("--measure", choices=("every", "last"), default="every",
                   help="disjoint schedule: measure every turn after every block (every), or only after the last "
                        "(last: θ_old's point is exact without a forward; each block's own turns still as trained)")
    p.add_argument("--map_blocks", default=None,
                   help="the stability map: for each E in this list (e.g. 4,2,8) and each --tree_seeds, the disjoint "
                        "schedule of all --trees trees in E blocks, at every --lr_scales and --methods; run files "
                        "seedS-eE-METHOD-lrXx.json")
    p.add_argument("--tree_seeds", default="0", help="the stability map's independent generation batches (seeds)")
    p.add_argument("--threads", type=int, default=1, help="torch threads")
    p.add_argument("--gradient_checkpointing", action=argparse.BooleanOptionalAction, default=False,
                   help="recompute activations in the backward pass: the same numbers in less memory (a large tree "
                        "trained without it can take over 10 GB)")
    p.add_argument("--quick", action="store_true", help="tiny model, 2 trees, 2 blocks, one learning rate")
    p.add_argument("--output", default=None, help="JSON path; run files and cached trees go next to it")
    p.add_argument("--plot", default=None, help="PNG path (default: the output's, with .png)")
    p.add_argument("--report_only", action="store_true",
                   help="train nothing: the table, JSON and PNG of the run files next to --output (an unfinished "
                        "grid, e.g. between sittings)")
    args = p.parse_args(argv)
    if args.quick:
        args.model, args.prompts, args.trees, args.blocks, args.lr_scales, args.heldout = "tiny", 2, 2, 2, "1", 1
        args.disjoint_blocks = 2
    defaults = {"tiny": dict(learning_rate=2e-4, max_turns=3, max_completion_length=96, max_turn_tokens=None,
                             num_test=8, warm_start_steps=0, lora_rank=None),
                "smollm2": MODEL_DEFAULTS["smollm2"]}[args.model]
    for name in ("learning_rate", "max_turns", "max_completion_length", "max_turn_tokens", "num_test",
                 "warm_start_steps", "warm_start_lr", "warm_start_batch_size", "lora_rank"):
        setattr(args, name, defaults.get(name))
    args.methods = [m.strip() for m in args.methods.split(",") if m.strip()]
    args.schedules = [s.strip() for s in args.schedules.split(",") if s.strip()]
    args.lr_scales = [float(s) for s in args.lr_scales.split(",") if s.strip()]
    args.tree_seeds = [int(s) for s in args.tree_seeds.split(",") if s.strip()]
    if args.map_blocks is not None:
        args.map_blocks = [int(e) for e in args.map_blocks.split(",") if e.strip()]
        if bad := [e for e in args.map_blocks if args.trees % e]:
            p.error(f"--trees ({args.trees}) must be a multiple of every --map_blocks; not of {bad}")
    if unknown := (set(args.methods) - set(LOSS_OF)) | (set(args.schedules) - set(SCHEDULES)):
        p.error(f"unknown methods or schedules {sorted(unknown)}: methods {list(LOSS_OF)}, schedules {SCHEDULES}")
    if args.trees % args.disjoint_blocks:
        p.error(f"--trees ({args.trees}) must be a multiple of --disjoint_blocks ({args.disjoint_blocks}): whole "
                "trees per block")
    if args.trees > args.prompts:
        p.error(f"--trees ({args.trees}) cannot exceed --prompts ({args.prompts}): the trees are chosen among them")
    return args


# ---------------------------------------------------------------------------------------------------------------------
# What is measured after each block: pure functions of one forward
# ---------------------------------------------------------------------------------------------------------------------


def target_gaps(s: Tensor, q: Tensor) -> dict[str, float]:
    """How far each turn is from its teacher, in the direction of its target: d_i = sign(q_i − 1/2)(q_i − σ(s_i)).

    Turns whose teacher is 1/2 (V_i = 0) have no direction and are left out. Also the largest and mean |s_i| over
    every turn, and the mean |logit q_i| (where |s_i| stands once every turn has reached its teacher)."""
    s, q = s.double(), q.double()
    directed = (q - 0.5).abs() > 1e-9
    d = torch.sign(q - 0.5)[directed] * (q[directed] - torch.sigmoid(s[directed]))
    return {"gap_mean": float(d.mean()) if d.numel() else 0.0,
            "past_fraction": float((d < 0).double().mean()) if d.numel() else 0.0,
            "abs_s_mean": float(s.abs().mean()), "abs_s_max": float(s.abs().max()),
            "abs_logit_q_mean": float(torch.logit(q[directed]).abs().mean()) if d.numel() else 0.0,
            "directed_turns": int(directed.sum()), "turns": int(s.numel())}


def clip_fraction(inputs: LossInputs, epsilon_low: float, epsilon_high: float) -> float:
    """Fraction of trained tokens whose ratio is past the clip range in its advantage's direction (GRPO's
    `is_low_clipped | is_high_clipped`, with each token's advantage its turn's V_i)."""
    ratio = torch.exp(inputs.logps.double() - inputs.old_logps.double())
    low, high = losses.clip_indicators(ratio, inputs.credit.A[inputs.turn_ids].double(), epsilon_low, epsilon_high)
    return float((low | high).double().mean())


# ---------------------------------------------------------------------------------------------------------------------
# The runs
# ---------------------------------------------------------------------------------------------------------------------


def trainer_for(args, task, model, tokenizer, output_dir: str):
    """A TreeOPSD trainer at the learning benchmark's sampling settings; its loss is switched per run (`with_loss`)."""
    budget = Budget(prompts=args.prompts, blocks=1, learning_rate=args.learning_rate, max_turns=args.max_turns,
                    max_completion_length=args.max_completion_length, max_turn_tokens=args.max_turn_tokens,
                    seed=args.seed, generation_batches=1)
    peft = lora_config(args.lora_rank) if args.lora_rank else None
    trainer = build_trainer("treeopsd", model, tokenizer, task, budget, output_dir, peft_config=peft,
                            gradient_checkpointing=args.gradient_checkpointing)
    trainer.model.train()
    return trainer


def with_loss(trainer, base_args, method: str) -> None:
    """The trainer's config with `method`'s loss (and zero-credit anchor): what `compute_loss` and the
    micro-batches' credit read."""
    args = copy.copy(base_args)
    args.loss, args.zero_credit_anchor = VARIANTS[method]
    trainer.args = args


def block_forward(trainer, model, batch: dict, grad: bool) -> LossInputs:
    """One micro-batch's forward under the current model, flattened as the losses read it (the trainer's own
    `loss_inputs`): with `grad`, the forward the block trains on."""
    with torch.set_grad_enabled(grad):
        return trainer.loss_inputs(model, batch)[0]


def turn_measures(inputs: LossInputs, q: Tensor, epsilons: dict) -> dict[str, float]:
    """The gap, |s| and clip quantities of one forward's turns against their teachers `q` (same turn order)."""
    with torch.no_grad():
        detached = LossInputs(**{**vars(inputs), "logps": inputs.logps.detach()})
        s = losses.turn_mean_log_ratio(detached.logps, detached.old_logps, detached.turn_ids, detached.num_turns)
        return {**target_gaps(s, q), "clip_fraction": clip_fraction(detached, **epsilons),
                "trained_tokens": int(detached.logps.numel())}


def pooled(parts: list[dict]) -> dict[str, float]:
    """Measures of several micro-batches as one batch: weighted by directed turns, turns or tokens as each is a mean
    over them (the largest |s| is the largest)."""
    def mean(key, weight):
        total = sum(p[weight] for p in parts)
        return sum(p[key] * p[weight] for p in parts) / total if total else 0.0

    return {"gap_mean": mean("gap_mean", "directed_turns"), "past_fraction": mean("past_fraction", "directed_turns"),
            "abs_logit_q_mean": mean("abs_logit_q_mean", "directed_turns"), "abs_s_mean": mean("abs_s_mean", "turns"),
            "abs_s_max": max(p["abs_s_max"] for p in parts), "clip_fraction": mean("clip_fraction", "trained_tokens"),
            "directed_turns": sum(p["directed_turns"] for p in parts), "turns": sum(p["turns"] for p in parts),
            "trained_tokens": sum(p["trained_tokens"] for p in parts)}


def teachers(measured: list[dict], batches: list[dict]) -> list[Tensor]:
    """TreeOPSD's q_i for the turns of each of `batches`, from `measured` (the same trees, split the same way, with
    TreeOPSD's credit): every loss is measured against the same teachers. The packing must be the same."""
    for ours, theirs in zip(batches, measured):
        if not torch.equal(ours["turn_ids"], theirs["turn_ids"]):
            raise RuntimeError("the measured micro-batches are packed differently from the trained ones")
    return [TeacherCredit.from_dict(b).flatten().q for b in measured]


def train_blocks(trainer, base_args, trees, method: str, lr: float, schedule: str, heldout, args, theta_old):
    """E optimizer blocks of `method` from θ_old on `trees`; the measurements at θ_old and after every block.

    `revisit`: the state after block e is measured on the forward that trains block e + 1 (the same weights, the
    whole batch), so a block costs one forward and backward. `disjoint`: one tree per micro-batch, block e
    accumulating the gradients of its trees' micro-batches (each loss divided by their number: the mean over the
    block's trees, as one micro-batch of them would give, in one tree's memory); after every block, a forward of
    every micro-batch; and each block's own turns as they are trained (`trained_*`)."""
    model = trainer.model
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name in theta_old:
                p.copy_(theta_old[name])
    blocks = args.blocks if schedule == "revisit" else args.disjoint_blocks
    chunks = 1 if schedule == "revisit" else len(trees)
    per_block = 1 if schedule == "revisit" else len(trees) // blocks  # micro-batches (trees) a block accumulates
    with_loss(trainer, base_args, "treeopsd")
    measured = trainer.micro_batches(trees, chunks)
    with_loss(trainer, base_args, method)
    batches = trainer.micro_batches(trees, chunks)
    q = teachers(measured, batches)
    epsilons = clip_epsilons(trainer.args)
    parameters = [p for p in model.parameters() if p.requires_grad]
    a = trainer.args
    optimizer = torch.optim.AdamW(parameters, lr=lr, betas=(a.adam_beta1, a.adam_beta2), eps=a.adam_epsilon,
                                  weight_decay=a.weight_decay)

    def everything(block: int, forwards=None) -> dict:
        parts = forwards or [turn_measures(block_forward(trainer, model, b, grad=False), q_b, epsilons)
                             for b, q_b in zip(batches, q)]
        return {"block": block, **pooled(parts), "heldout_kl": heldout(model)}

    last_only = schedule == "disjoint" and getattr(args, "measure", "every") == "last"
    if schedule == "revisit":
        points = []
    elif last_only:  # at θ_old every s_i = 0, every ratio is 1 and the held-out KL is 0: no forward needed
        zero = [{**target_gaps(torch.zeros_like(q_b, dtype=torch.float64), q_b), "clip_fraction": 0.0,
                 "trained_tokens": int((b["turn_ids"] >= 0).sum())} for b, q_b in zip(batches, q)]
        points = [{"block": 0, **pooled(zero), "heldout_kl": 0.0, "trained_blocks": []}]
    else:
        points = [everything(0)]
    for e in range(blocks):
        indices = [0] if schedule == "revisit" else range(e * per_block, (e + 1) * per_block)
        measures, loss = [], 0.0
        for index in indices:
            inputs = block_forward(trainer, model, batches[index], grad=True)
            measures.append(turn_measures(inputs, q[index], epsilons))
            part = trainer.turn_loss(inputs, "train") / len(indices)
            part.backward()
            loss += float(part.detach())
        trained = pooled(measures) if len(measures) > 1 else measures[0]
        if schedule == "revisit":
            points.append(everything(e, [trained]))
        elif last_only:
            points[0]["trained_blocks"].append(trained)  # block e + 1's turns as it trains them
        else:
            points[-1].update({f"trained_{k}": v for k, v in trained.items()})  # block e + 1's turns, before it
        torch.nn.utils.clip_grad_norm_(parameters, a.max_grad_norm)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        points[-1]["next_loss"] = loss
        if (schedule == "disjoint" and not last_only) or e == blocks - 1:
            points.append(everything(e + 1))
        last = points[-1] if not (last_only and e < blocks - 1) else {"block": f"{e + 1} (its own turns, as trained)",
                                                                       **trained, "heldout_kl": float("nan")}
        print(f"    {schedule} {method} lr {lr:g} block {last['block']}: gap {last['gap_mean']:+.4f}  past "
              f"{last['past_fraction']:.2f}  |s| {last['abs_s_mean']:.4f} (max {last['abs_s_max']:.3f})  KL "
              f"{last['heldout_kl']:.2e}  clip {last['clip_fraction']:.3f}", flush=True)
    return points


def main(argv=None):
    args = parse_args(argv)
    if args.report_only:
        return report_present_runs(args) if args.map_blocks is None else map_report(args)
    torch.set_num_threads(args.threads)
    random.seed(args.seed)
    torch.manual_seed(args.seed)
    task = make_task("search", None, args.num_test)
    base = None
    if args.model == "smollm2":
        from trl_tree.testing import smollm2_path

        base = smollm2_path()
    model_path = warm_started_model(task, base, args.warm_start_steps or 0, lr=args.warm_start_lr or 3e-3,
                                    batch_size=args.warm_start_batch_size or 8, lora_rank=args.lora_rank)
    runs_dir = runs_dir_of(args.output) if args.output else None
    if args.map_blocks is not None:
        return stability_map(args, task, model_path, runs_dir)
    model, tokenizer = load_model(model_path)
    with tempfile.TemporaryDirectory() as output_dir:
        trainer, trees, sampling_seconds, theta_old, heldout = prepared_batch(
            args, task, model, tokenizer, output_dir, runs_dir)
        base_args = trainer.args
        results = {}
        for schedule in args.schedules:
            for method in args.methods:
                for scale in args.lr_scales:
                    results.setdefault(schedule, {}).setdefault(method, {})[f"{scale:g}x"] = one_run(
                        trainer, base_args, trees, method, scale, schedule, heldout, args, theta_old, runs_dir)
    report(results, args, trees, sampling_seconds)


def prepared_batch(args, task, model, tokenizer, output_dir: str, runs_dir: Path | None):
    """What every run on one generation batch starts from: the trainer, its (cached) sampled trees as chosen, the
    seconds sampling took, θ_old's trainable weights and the held-out KL meter."""
    trainer = trainer_for(args, task, model, tokenizer, output_dir)
    sampled, sampling_seconds = sampled_trees(trainer, task, args, runs_dir)
    trees = chosen_trees(sampled, args.trees, args.tree_choice)
    theta_old = {n: p.detach().clone() for n, p in trainer.model.named_parameters() if p.requires_grad}
    heldout = HeldOutKL(trainer.model, held_out_examples(task, tokenizer, args.heldout), trainer.temperature)
    return trainer, trees, sampling_seconds, theta_old, heldout


# ---------------------------------------------------------------------------------------------------------------------
# The stability map: learning-rate scale × E × method, over independent generation batches
# ---------------------------------------------------------------------------------------------------------------------


def map_args(args, seed: int, blocks: int):
    """The settings of one cell of the map: the disjoint schedule of `blocks` blocks on the trees of `seed`."""
    out = copy.copy(args)
    out.seed, out.disjoint_blocks, out.schedules = seed, blocks, ["disjoint"]
    return out


def map_run_name(seed: int, blocks: int) -> str:
    return f"seed{seed}-e{blocks}"


def run_file_name(prefix: str, method: str, scale: float) -> str:
    """The run file of one (schedule or map cell, method, scale); `MAP_RUN_FILE` parses the map's."""
    return f"{prefix}-{method}-lr{scale:g}x.json"


MAP_RUN_FILE = re.compile(r"seed(\d+)-e(\d+)-(\w+)-lr([\d.]+)x\.json")  # run_file_name(map_run_name(...), ...)


def stability_map(args, task, model_path: str, runs_dir: Path | None) -> None:
    """Every (tree seed, E, scale, method) of the map, in the order of the arguments' lists, each written as it
    finishes and skipped when present; the trees of each seed sampled once (cached); then `map_report`."""
    for seed in args.tree_seeds:
        cell = map_args(args, seed, args.map_blocks[0])
        random.seed(seed)
        torch.manual_seed(seed)
        model, tokenizer = load_model(model_path)
        with tempfile.TemporaryDirectory() as output_dir:
            trainer, trees, _, theta_old, heldout = prepared_batch(cell, task, model, tokenizer, output_dir, runs_dir)
            base_args = trainer.args
            for blocks in args.map_blocks:  # in the order given, so that a sitting makes the runs that matter first
                cell = map_args(args, seed, blocks)
                for scale in args.lr_scales:
                    for method in args.methods:
                        one_run(trainer, base_args, trees, method, scale, "disjoint", heldout, cell, theta_old,
                                runs_dir, prefix=map_run_name(seed, blocks))
        del trainer, model
    if args.output:
        map_report(args)


def largest_stable_scale(kl_by_scale: dict[float, list[float]], threshold: float) -> float | None:
    """The largest scale below which (itself included) every measured seed's held-out KL stays under `threshold`,
    scanning scales upward and stopping at the first that crosses; None when the smallest already crosses."""
    best = None
    for scale in sorted(kl_by_scale):
        if max(kl_by_scale[scale]) >= threshold:
            break
        best = scale
    return best


def complete_scales(by_scale: dict[float, list[dict]], tree_seeds: list[int]) -> dict[float, list[float]]:
    """Scale -> held-out KL per tree seed, for the scales every tree seed asked for has run: a scale run on one seed of
    two would otherwise count as stable on "every seed" before the other seed could cross."""
    return {scale: [p["heldout_kl"] for p in points] for scale, points in by_scale.items()
            if {p["seed"] for p in points} >= set(tree_seeds)}


def map_cells(args) -> dict:
    """E -> method -> scale -> [final point of each tree seed present] from the run files; missing ones named."""
    runs_dir = runs_dir_of(args.output)
    cells: dict = {}
    for blocks in args.map_blocks:
        for method in args.methods:
            for scale in args.lr_scales:
                for seed in args.tree_seeds:
                    path = runs_dir / run_file_name(map_run_name(seed, blocks), method, scale)
                    if not path.is_file():
                        print(f"[map E = {blocks} {method} {scale:g}x seed {seed}] missing", flush=True)
                        continue
                    run = json.loads(path.read_text())
                    if run["settings"] != run_settings(map_args(args, seed, blocks)):
                        raise SystemExit(f"{path} was made with other settings ({run['settings']}).")
                    last = {**run["points"][-1], "seed": seed, "cpu_seconds": run["cpu_seconds"]}
                    cells.setdefault(blocks, {}).setdefault(method, {}).setdefault(scale, []).append(last)
    return cells


def with_stored_grid(args):
    """`args` with its map grid widened to every cell stored next to --output: one sitting runs a few cells, and its
    report (which the map's files are) must still cover the cells of every other sitting, not only its own."""
    runs_dir = runs_dir_of(args.output)
    stored = [MAP_RUN_FILE.fullmatch(path.name) for path in runs_dir.glob("seed*-e*-*.json")]
    stored = [(int(m[1]), int(m[2]), m[3], float(m[4])) for m in stored if m and m[3] in LOSS_OF]
    out = copy.copy(args)
    out.tree_seeds = sorted({*args.tree_seeds, *(seed for seed, *_ in stored)})
    out.map_blocks = sorted({*args.map_blocks, *(blocks for _, blocks, *_ in stored)})
    methods = {*args.methods, *(method for *_, method, _ in stored)}
    out.methods = [method for method in LOSS_OF if method in methods]  # one order (and colour) in every report
    out.lr_scales = sorted({*args.lr_scales, *(scale for *_, scale in stored)})
    return out


def map_report(args) -> None:
    """The map's table (per E, method and scale: held-out KL and mean |s| after E blocks, per seed) over every cell
    stored next to --output (`with_stored_grid`), per E and method the largest stable scale at each of
    `MAP_THRESHOLDS`, JSON next to --output and one figure."""
    if not args.output:
        raise SystemExit("the stability map reads and writes next to --output; pass --output.")
    args = with_stored_grid(args)
    cells = map_cells(args)
    if not cells:
        raise SystemExit("No run files of the map yet.")
    rows, stable = [], {}
    for blocks, by_method in cells.items():
        for method, by_scale in by_method.items():
            for scale, points in sorted(by_scale.items()):
                rows.append({"E": blocks, "method": method, "lr": f"{scale:g}× ({args.learning_rate * scale:.2g})",
                             "seeds": ",".join(str(p["seed"]) for p in points),
                             "held-out KL": ", ".join(f"{p['heldout_kl']:.3g}" for p in points),
                             "mean |s|": ", ".join(f"{p['abs_s_mean']:.3g}" for p in points),
                             "max |s|": ", ".join(f"{p['abs_s_max']:.3g}" for p in points),
                             "past q": ", ".join(f"{p['past_fraction']:.2f}" for p in points),
                             "CPU min": f"{sum(p['cpu_seconds'] for p in points) / 60 / len(points):.1f}"})
            kl = complete_scales(by_scale, args.tree_seeds)
            if kl:
                stable.setdefault(str(blocks), {})[method] = {f"{t:g}": largest_stable_scale(kl, t)
                                                              for t in MAP_THRESHOLDS}
                stable[str(blocks)][method]["measured"] = sorted(kl)
    stable_rows = [{"E": blocks, "method": method, "scales measured": ", ".join(f"{s:g}" for s in by_t["measured"]),
                    **{f"largest scale, KL < {t:g}": (f"{by_t[f'{t:g}']:g}×" if by_t[f"{t:g}"] is not None
                                                       else f"< {by_t['measured'][0]:g}×") for t in MAP_THRESHOLDS}}
                   for blocks, by_method in stable.items() for method, by_t in by_method.items()]
    caption = (f"Stability map: held-out KL(π_old ‖ π_θ) per assistant token on {args.heldout} scripted held-out "
               f"trajectories and mean |s_i| after E disjoint blocks of the {args.trees} trees of one generation "
               f"batch ({args.tree_choice}), per tree seed; scale × {args.learning_rate:g}")
    table = markdown_table(rows, list(rows[0])) + "\n\n" + markdown_table(stable_rows, list(stable_rows[0]))
    print(f"\n{caption}\n\n{table}")
    write_json(args.output, {"config": vars(args), "environment": environment(), "thresholds": list(MAP_THRESHOLDS),
                             "cells": {str(b): {m: {f"{s:g}": v for s, v in bs.items()} for m, bs in bm.items()}
                                       for b, bm in cells.items()},
                             "largest_stable_scale": stable})
    Path(args.output).with_suffix(".md").write_text(f"{caption}\n\n{table}\n")
    plot_map(cells, args.plot or str(Path(args.output).with_suffix(".png")), caption)


MAP_LABELS = {"treeopsd": "TreeOPSD", "treepo": "TreePO", "clip": "GRPO's clip",
              "treeopsd_no_anchor": "TreeOPSD without its q = 1/2 pull", "treepo_anchor": "TreePO with that pull"}


def plot_map(cells: dict, path: str, caption: str) -> None:
    """Two rows (held-out KL, mean |s| after E blocks) × one column per E, rows on one shared log scale so the
    columns compare at a glance; a line per method through the seeds' mean, each seed a dot; the KL thresholds
    dashed; one legend for the figure."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    colours = {"treeopsd": "tab:blue", "treepo": "tab:orange", "clip": "tab:green", "treeopsd_no_anchor": "tab:purple",
               "treepo_anchor": "tab:red"}
    columns = sorted(cells)
    scales = sorted({s for by_method in cells.values() for by_scale in by_method.values() for s in by_scale})
    figure, axes = plt.subplots(2, len(columns), figsize=(3.6 * len(columns) + 1.0, 6.0), squeeze=False,
                                sharex=True, sharey="row")
    floor = 1e-3  # a KL or |s| of exactly 0 (nothing moved) is drawn at the floor of the log scale
    for col, blocks in enumerate(columns):
        for row, (key, label) in enumerate((("heldout_kl", "held-out KL per token"), ("abs_s_mean", "mean |s_i|"))):
            ax = axes[row][col]
            for method in colours:
                by_scale = cells[blocks].get(method)
                if not by_scale:
                    continue
                present = sorted(by_scale)
                means = [max(floor, sum(p[key] for p in by_scale[s]) / len(by_scale[s])) for s in present]
                ax.plot(present, means, color=colours[method], marker="o", markersize=4, label=MAP_LABELS[method])
                for s in present:
                    ax.scatter([s] * len(by_scale[s]), [max(floor, p[key]) for p in by_scale[s]],
                               color=colours[method], s=10, alpha=0.45)
            if key == "heldout_kl":
                for t in MAP_THRESHOLDS:
                    ax.axhline(t, color="grey", linestyle="--", linewidth=0.8)
            ax.set_xscale("log", base=2)
            ax.set_yscale("log")
            ax.set_xticks(scales, [f"{s:g}×" for s in scales])
            ax.set_xlim(min(scales) / 1.5, max(scales) * 1.5)
            ax.set_title(f"E = {blocks} blocks: {label}", fontsize=9)
            if row == 1:
                ax.set_xlabel("learning-rate scale (× 2e-4)", fontsize=8)
            ax.tick_params(labelsize=7)
            ax.grid(alpha=0.25, which="major")
    handles = {}
    for ax in axes.flat:
        for handle, label in zip(*ax.get_legend_handles_labels()):
            handles.setdefault(label, handle)
    figure.legend(handles.values(), handles.keys(), loc="upper center", ncol=min(5, len(handles)), fontsize=8,
                  frameon=False, bbox_to_anchor=(0.5, 0.95))
    figure.suptitle(caption, fontsize=8, wrap=True, y=0.995)
    figure.tight_layout(rect=(0, 0, 1, 0.91))
    figure.savefig(path, dpi=110)
    print(f"wrote {path}", flush=True)


def report_present_runs(args) -> None:
    """`--report_only`: the report of the run files present for the requested grid, saying which are missing."""
    if not args.output:
        raise SystemExit("--report_only reads the run files next to --output; pass --output.")
    runs_dir = runs_dir_of(args.output)
    cache = runs_dir / f"trees-seed{args.seed}.pt"
    if not cache.is_file():
        raise SystemExit(f"No sampled trees at {cache}: run without --report_only first.")
    saved = torch.load(cache, weights_only=False)
    results = {}
    for schedule in args.schedules:
        for method in args.methods:
            for scale in args.lr_scales:
                path = runs_dir / run_file_name(schedule, method, scale)
                if not path.is_file():
                    print(f"[{schedule} {method} {scale:g}x] missing: {path}", flush=True)
                    continue
                run = json.loads(path.read_text())
                if run["settings"] != run_settings(args):
                    raise SystemExit(f"{path} was made with other settings ({run['settings']}).")
                results.setdefault(schedule, {}).setdefault(method, {})[f"{scale:g}x"] = run["points"]
    if not results:
        raise SystemExit(f"No run files for this grid in {runs_dir}.")
    report(results, args, chosen_trees(saved["trees"], args.trees, args.tree_choice), saved["sampling_seconds"])


def one_run(trainer, base_args, trees, method, scale, schedule, heldout, args, theta_old, runs_dir, prefix=None):
    """One (schedule, method, learning rate): from its run file when a sitting made it with these settings."""
    path = runs_dir / run_file_name(prefix or schedule, method, scale) if runs_dir else None
    settings = run_settings(args)
    if path is not None and path.is_file():
        saved = json.loads(path.read_text())
        if saved["settings"] == settings:
            print(f"[{schedule} {method} {scale:g}x] done before: {path}", flush=True)
            return saved["points"]
        raise SystemExit(f"{path} was made with other settings ({saved['settings']}); use another --output.")
    print(f"[{schedule} {method} {scale:g}x lr = {args.learning_rate * scale:g}]", flush=True)
    started = time.process_time()
    points = train_blocks(trainer, base_args, trees, method, args.learning_rate * scale, schedule, heldout, args,
                          theta_old)
    if path is not None:
        write_json(path, {"settings": settings, "points": points, "cpu_seconds": time.process_time() - started,
                          "environment": environment()})
    return points


def run_settings(args) -> dict:
    """What a run's numbers depend on (not which runs to make, nor where to write)."""
    out = {k: v for k, v in vars(args).items() if k not in ("methods", "schedules", "lr_scales", "output", "plot",
                                                             "threads", "quick", "report_only", "map_blocks",
                                                             "tree_seeds", "gradient_checkpointing")}
    for k, default in LATER_DEFAULTS.items():
        if out.get(k) == default:
            del out[k]
    return portable(out)  # as the run files store them (`common.write_json`)


def sampling_settings(args) -> dict:
    """What the sampled trees depend on: the run's settings but for how they are trained and measured."""
    return {k: v for k, v in run_settings(args).items()
            if k not in ("trees", "blocks", "disjoint_blocks", "heldout", "tree_choice", "measure")}


def sampled_trees(trainer, task, args, runs_dir: Path | None):
    """The generation batch: P training prompts drawn by the seed, one tree each; cached next to the output so that
    every schedule and every later sitting trains the very same trees."""
    cache = runs_dir / f"trees-seed{args.seed}.pt" if runs_dir else None
    if cache is not None and cache.is_file():
        saved = torch.load(cache, weights_only=False)
        if saved["settings"] == sampling_settings(args):
            return saved["trees"], saved["sampling_seconds"]
    rows = random.Random(args.seed).sample(task.train_rows, args.prompts)
    started = time.process_time()
    print(f"[sampling {args.prompts} trees]", flush=True)
    trees = trainer.sample_trees(rows)
    seconds = time.process_time() - started
    if cache is not None:
        cache.parent.mkdir(parents=True, exist_ok=True)
        torch.save({"settings": sampling_settings(args), "trees": trees, "sampling_seconds": seconds}, cache)
    return trees, seconds


def chosen_trees(trees: list, count: int, choice: str = "spread") -> list:
    """`spread`: the first `count` trees with a reward spread, then the first others: only a spread gives any turn
    credit (V_i = 0 everywhere else), so a tree without one changes no loss's first block. `sampled`: the first
    `count` as sampled, as a generation batch of the learning benchmark trains them (after the first block, TreeOPSD
    pulls a tree without a spread back toward π_old, TreePO leaves it alone)."""
    if choice == "sampled":
        return list(trees[:count])
    spread = [t for t in trees if len(set(t.rewards)) > 1]
    return (spread + [t for t in trees if len(set(t.rewards)) <= 1])[:count]


def tree_summary(trees) -> dict:
    rewards = [r for t in trees for r in t.rewards]
    return {"trees": len(trees), "leaves": sum(t.num_leaves for t in trees), "unique_turns": sum(t.num_turns for t in trees),
            "unique_tokens": sum(t.num_unique_tokens for t in trees), "mean_reward": sum(rewards) / len(rewards),
            "trees_with_reward_spread": sum(len(set(t.rewards)) > 1 for t in trees)}


def report(results: dict, args, trees, sampling_seconds: float) -> None:
    rows = []
    for schedule, by_method in results.items():
        for method, by_lr in by_method.items():
            for lr, points in by_lr.items():
                first, last = points[1 if len(points) > 2 else -1], points[-1]
                rows.append({"schedule": schedule, "method": method, "lr": lr,
                             "blocks": last["block"], "gap after 1": f"{first['gap_mean']:+.4f}",
                             "gap after E": f"{last['gap_mean']:+.4f}",
                             "past q": f"{last['past_fraction']:.2f}", "mean |s|": f"{last['abs_s_mean']:.4f}",
                             "max |s|": f"{last['abs_s_max']:.3f}", "held-out KL": f"{last['heldout_kl']:.2e}",
                             "at clip": f"{last['clip_fraction']:.3f}"})
    summary = tree_summary(trees)
    caption = (f"{args.model}: one generation batch of {summary['trees']} trees ({summary['leaves']} leaves, "
               f"{summary['unique_turns']} unique turns, {summary['trees_with_reward_spread']} with a reward spread), "
               f"E = {schedule_blocks(args, results)} optimizer blocks from θ_old; gap = mean sign(q−½)(q−p) over directed turns "
               f"(mean |logit q| = {results_first(results)['abs_logit_q_mean']:.3f})")
    print(f"\n{caption}\n\n{markdown_table(rows, list(rows[0]))}")
    if not args.output:
        return
    write_json(args.output, {"config": vars(args), "environment": environment(), "trees": summary,
                             "sampling_cpu_seconds": sampling_seconds,
                             "schedules": {s: {"blocks": by_method} for s, by_method in results.items()}})
    Path(args.output).with_suffix(".md").write_text(f"{caption}\n\n{markdown_table(rows, list(rows[0]))}\n")
    plot(results, args.plot or str(Path(args.output).with_suffix(".png")), caption)


def schedule_blocks(args, results: dict) -> str:
    """The blocks of each schedule present, e.g. "8 (revisit) or 4 (disjoint)"."""
    blocks = {"revisit": args.blocks, "disjoint": args.disjoint_blocks}
    return " or ".join(f"{blocks[s]} ({s})" for s in results)


def results_first(results: dict) -> dict:
    return next(iter(next(iter(next(iter(results.values())).values())).values()))[0]


def plot(results: dict, path: str, caption: str) -> None:
    """One panel per quantity against the block index; a row per schedule; colour = method, line style = lr."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    schedules = list(results)
    figure, axes = plt.subplots(len(schedules), len(PANELS), figsize=(3.2 * len(PANELS), 3.0 * len(schedules)),
                                squeeze=False)
    colours = {"treeopsd": "tab:blue", "treepo": "tab:orange", "clip": "tab:green"}
    for row, schedule in enumerate(schedules):
        for col, (key, label) in enumerate(PANELS.items()):
            ax = axes[row][col]
            for method, by_lr in results[schedule].items():
                for i, (lr, points) in enumerate(by_lr.items()):
                    ax.plot([p["block"] for p in points], [p[key] for p in points], color=colours.get(method),
                            linestyle=("-", "--", ":", "-.")[i % 4], marker="o", markersize=3, label=f"{method} {lr}")
            if key == "gap_mean":
                ax.axhline(0.0, color="grey", linewidth=0.8)
            if key in LOG_PANELS:  # fixed credit's drift grows by orders of magnitude; 0 at θ_old stays drawable
                ax.set_yscale("symlog", linthresh=LOG_PANELS[key])
            ax.set_title(f"{schedule}: {label}", fontsize=8)
            ax.set_xlabel("optimizer block", fontsize=8)
            ax.tick_params(labelsize=7)
    axes[0][0].legend(fontsize=7)
    figure.suptitle(caption, fontsize=8, wrap=True)
    figure.tight_layout(rect=(0, 0, 1, 0.93))
    figure.savefig(path, dpi=110)
    print(f"wrote {path}", flush=True)


if __name__ == "__main__":
    main()
