"""The GPU run in one script: packed training of long trees, one TreeOPSD step on CUDA, and generation with the
prefix store, on a randomly initialised Qwen3 (Qwen3-0.6B's shape, 0.6B parameters with tied embeddings) in bf16.
Sized for one H200 in under 8 minutes; nothing is downloaded, and neither TRL nor datasets is imported (but by the
opt-in `async_vllm` section, which needs a second GPU and vLLM).

Sections (`--sections`, in this order; the JSON is written after each, so a run cut short keeps what it measured):

    packing     bench_packing_gpu.py's sweep at 1k-64k tokens per tree row (`--row_tokens`): one forward + backward
                of `trl_tree.core.packing.packed_token_logps` per variant (tree_flex: the flex_attention BlockMask row;
                tree_sdpa: the dense-mask row, up to 32k tokens; tree_chains: trl-tree's tree_sdpa attention;
                paths_sdpa: causal path rows), seconds and peak memory, log-probs against the path rows.
    step        one TreeOPSD optimizer step on packed trees, per layout: pack, π_old from the same packed forward
                (docs/design.md T6), the method table's credit and loss (`methods.turn_credit`,
                `methods.LOSSES["treeopsd"]`: likelihood backup, teacher q, Bernoulli KL), backward, AdamW, its
                seconds and peak memory (one step: tree_flex's include compiling its kernel for a new length). The
                gradients of every tree layout are compared with the path layout's (relative L2 error, cosine);
                in bf16 they must agree within 3x the bf16 error of the path layout's own gradients against its
                float32 gradients (a float32 copy of the model, measured in the same run); in float32 to 1e-4.
    generation  multi-turn rollouts through the samplers' own turn loop (`TurnLoop`) and `InitExpandSampler`:
                a tree of (M, N) = (4, 2) per prompt against a flat group of G = M(1 + N/2) = 8 trajectories (the
                same budget), with `GreedyEngine`'s `model.generate` and the prefix KV store, and without the store.
                Every turn is a tool call of exactly --gen_turn_tokens tokens answered by --gen_observation_tokens
                random tokens (a random model writes no tool calls of its own), so both sample the same shape of
                work; reported: seconds per generated token and per leaf, tree / flat.
    precision   LoRA and full fine-tuning × bf16 / fp16 / fp32 as the trainer runs them (issue 59): a float32 model
                (as TRL loads one), LoRA on every linear layer or none, its `forward` under the config's autocast
                (what accelerate does to the model it prepares), `HFEngine` generating with the prefix store under
                the same autocast (`HFPorts.precision`, the trainer's `accelerator.autocast()`), then a packed
                tree_sdpa forward + backward. Checked: no dtype error, generation's attention computes in the dtype
                the packed forward computes in (bf16 / fp16 / float32 on CUDA; CPU has no fp16 autocast in
                accelerate, so fp16 computes in float32 there), finite gradients on the trainable parameters.
    async_vllm  (only when named: it needs TRL, datasets, vLLM and two GPUs) tree rollouts through a vLLM server
                (`trl vllm-serve` on the second GPU, the trainer on the first), synchronous against asynchronous at
                max_staleness 1 (the rollout worker's server path, its versions pushed by TRL's weight sync):
                steady-state wall seconds per generation batch, the waits and the pushes (`gpu_async_vllm.py`).

TRL is not needed: the step goes through trl-tree's pure functions (packing, credit, losses), which is the trainer's
computation without GRPOTrainer around it, and generation through `GreedyEngine` (the evaluation engine: the same
prefix store and `model.generate` as the trainer's `HFEngine`, which reaches the model through TRL's
`unwrap_model_for_generation`; decoding is greedy, and a decode step costs what a sampled one does). On the GPU
image (torch, transformers, accelerate, peft) the only extra is this repository on PYTHONPATH; see
benchmarks/README.md, "The GPU suite".

`--cpu` runs the same code paths at tiny sizes (the tiny Qwen3 shape, float32, the sdpa variants: flex_attention has
no CPU backward), which tests/test_benchmarks.py runs.

Usage:
    python benchmarks/gpu_suite.py                       # writes benchmarks/results/gpu_suite.json
    python benchmarks/gpu_suite.py --sections step,generation --output /tmp/gpu_suite_rerun.json
    python benchmarks/gpu_suite.py --cpu                 # tiny sizes; benchmarks/results/gpu_suite_cpu.json
    python benchmarks/gpu_suite.py --sections async_vllm --output benchmarks/results/gpu_async_vllm.json  # 2 GPUs
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import dataclasses
import functools
import random
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import bench_packing_gpu as packing_bench
import torch
from common import environment, markdown_table, write_json

from trl_tree import methods
from trl_tree.core.batch import LossInputs, TurnCredit
from trl_tree.core.packing import pack_trees, packed_token_logps
from trl_tree.core.tree_attention import TREE_SDPA
from trl_tree.envs.agent_eval import GreedyEngine
from trl_tree.rollout.generating.engine import HFEngine, HFPorts, rollout_session
from trl_tree.rollout.growing.samplers import InitExpandSampler, TreeRoot
from trl_tree.rollout.growing.turn_loop import SamplerSettings, TurnLoop, TurnLoopPorts

SECTIONS = ("packing", "step", "generation", "precision")
OPT_IN_SECTIONS = ("async_vllm",)  # run only when named in --sections (their needs are in their docstrings)
RESULTS = Path(__file__).resolve().parent / "results"
# TreeOPSD's loss as the method table computes it, with TreeOPSDConfig's defaults (importing the config needs TRL)
TREEOPSD = SimpleNamespace(credit="likelihood", loss="treeopsd", reward_std="sample", target_radius=0.25)
# Largest relative L2 error ||g - g_paths|| / ||g_paths|| of a tree layout's gradients against the path layout's.
# float32: the layouts agree to rounding. bf16: 3x the path layout's own bf16 error against its float32 gradients,
# measured in the same run (each layout rounds independently, so two bf16 runs differ by about sqrt(2) times that).
FLOAT32_TOLERANCE = 1e-4
BF16_NOISE_FACTOR = 3.0
STEP_VARIANTS = dict(packing_bench.VARIANTS)  # the same (layout, attention) pairs
GENERATION_VARIANTS = ("tree", "flat", "tree_no_store", "flat_no_store")

# (GPU default, --cpu default) of every size option
SIZES = {
    "row_tokens": ("1024,4096,16384,65536", "64,256"),
    "packing_variants": (",".join(packing_bench.VARIANTS), "tree_sdpa,tree_chains,paths_sdpa"),
    "repeats": (2, 1),
    "warmup": (1, 0),
    "step_row_tokens": (16384, 256),
    "step_variants": (",".join(STEP_VARIANTS), "tree_sdpa,tree_chains,paths_sdpa"),
    "gen_prompts": (8, 2),
    "gen_prompt_tokens": (512, 16),
    "gen_turn_tokens": (128, 8),
    "gen_observation_tokens": (256, 8),
    "gen_repeats": (2, 1),
    "precision_row_tokens": (2048, 128),
    "async_vllm_batches": (10, 3),
    "async_vllm_warmup": (2, 1),
    "async_vllm_completion_tokens": (256, 16),
    "async_vllm_trees": (2, 1),
}


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--sections", default=",".join(SECTIONS), help=f"comma-separated subset of {list(SECTIONS)}")
    p.add_argument("--cpu", action="store_true", help="the same code paths at tiny sizes, on CPU in float32")
    p.add_argument("--model", choices=sorted(packing_bench.SHAPES), default=None,
                   help="model shape, randomly initialised (default: qwen3-0.6b; tiny with --cpu)")
    p.add_argument("--layers", type=int, default=None, help="override the model's number of layers")
    p.add_argument("--dtype", choices=["bfloat16", "float32"], default=None,
                   help="weights and compute (default: bfloat16 on CUDA, float32 with --cpu)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--num_initial_rollouts", type=int, default=4, help="M of every tree (generation's flat group has "
                   "M(1 + N/2) trajectories)")
    p.add_argument("--num_branches", type=int, default=2, help="N of every tree")
    p.add_argument("--output", default=None, help="write the results as JSON here, after every section (default: "
                   "benchmarks/results/gpu_suite.json; --cpu: benchmarks/results/gpu_suite_cpu.json)")
    g = p.add_argument_group("packing")
    g.add_argument("--row_tokens", default=None, help="target tokens per tree row, comma-separated "
                   f"(default {SIZES['row_tokens'][0]}; --cpu {SIZES['row_tokens'][1]})")
    g.add_argument("--packing_variants", default=None, help=f"subset of {list(packing_bench.VARIANTS)}")
    g.add_argument("--repeats", type=int, default=None, help="timed passes per variant (default 2; --cpu 1)")
    g.add_argument("--warmup", type=int, default=None, help="untimed passes first (flex compiles; default 1)")
    g = p.add_argument_group("step")
    g.add_argument("--step_row_tokens", type=int, default=None, help="target tokens per tree row (default 16384)")
    g.add_argument("--step_trees", type=int, default=2, help="trees in the step's micro-batch")
    g.add_argument("--step_variants", default=None, help=f"subset of {list(STEP_VARIANTS)}; paths_sdpa is the "
                   "reference and always runs")
    g.add_argument("--learning_rate", type=float, default=1e-5)
    g = p.add_argument_group("generation")
    g.add_argument("--gen_variants", default=",".join(GENERATION_VARIANTS), help=f"subset of {GENERATION_VARIANTS}")
    g.add_argument("--gen_prompts", type=int, default=None, help="prompts (trees / flat groups) per rollout (8)")
    g.add_argument("--gen_prompt_tokens", type=int, default=None, help="tokens of each prompt (512)")
    g.add_argument("--gen_turn_tokens", type=int, default=None, help="tokens of every assistant turn (128)")
    g.add_argument("--gen_observation_tokens", type=int, default=None, help="tokens of every tool result (256)")
    g.add_argument("--gen_turns", type=int, default=3, help="assistant turns per trajectory (max_turns)")
    g.add_argument("--gen_batch_size", type=int, default=256, help="rows per generate call at most")
    g.add_argument("--gen_repeats", type=int, default=None, help="round-robin passes over the variants (2)")
    g = p.add_argument_group("precision")
    g.add_argument("--precision_row_tokens", type=int, default=None, help="target tokens per tree row of the packed "
                   f"forward (default {SIZES['precision_row_tokens'][0]}; --cpu {SIZES['precision_row_tokens'][1]})")
    g = p.add_argument_group("async_vllm (only when named in --sections)")
    g.add_argument("--async_vllm_batches", type=int, default=None, help="generation batches per variant (10)")
    g.add_argument("--async_vllm_warmup", type=int, default=None, help="first batches left out of the mean (2)")
    g.add_argument("--async_vllm_completion_tokens", type=int, default=None, help="token budget of a turn (256)")
    g.add_argument("--async_vllm_trees", type=int, default=None, help="trees per micro-batch (2)")
    g.add_argument("--async_vllm_server_gpu", type=int, default=1, help="the vLLM server's GPU (the trainer: 0)")
    args = p.parse_args(argv)
    for name, (gpu, cpu) in SIZES.items():
        if getattr(args, name) is None:
            setattr(args, name, cpu if args.cpu else gpu)
    args.sections = [s.strip() for s in args.sections.split(",") if s.strip()]
    if set(args.sections) - set(SECTIONS) - set(OPT_IN_SECTIONS):
        p.error(f"unknown sections {sorted(set(args.sections) - set(SECTIONS) - set(OPT_IN_SECTIONS))}; choose "
                f"from {list(SECTIONS + OPT_IN_SECTIONS)}")
    args.step_variants = _names(p, args.step_variants, STEP_VARIANTS)
    args.gen_variants = _names(p, args.gen_variants, GENERATION_VARIANTS)
    if "paths_sdpa" not in args.step_variants:
        args.step_variants.append("paths_sdpa")
    args.model = args.model or ("tiny" if args.cpu else "qwen3-0.6b")
    args.dtype = args.dtype or ("float32" if args.cpu else "bfloat16")
    args.output = args.output or str(RESULTS / ("gpu_suite_cpu.json" if args.cpu else "gpu_suite.json"))
    return args


def _names(parser, value: str, allowed) -> list[str]:
    names = [v.strip() for v in value.split(",") if v.strip()]
    if set(names) - set(allowed):
        parser.error(f"unknown variants {sorted(set(names) - set(allowed))}; choose from {list(allowed)}")
    return names


def packing_args(args, **changes) -> argparse.Namespace:
    """bench_packing_gpu.py's options for this run (its own parser, so its defaults hold): M, N and turns, the
    model, the device."""
    argv = ["--row_tokens", str(args.row_tokens), "--variants", args.packing_variants, "--repeats", str(args.repeats),
            "--warmup", str(args.warmup), "--seed", str(args.seed), "--model", args.model,
            "--num_initial_rollouts", str(args.num_initial_rollouts), "--num_branches", str(args.num_branches)]
    if args.layers:
        argv += ["--layers", str(args.layers)]
    if args.cpu:
        argv.append("--cpu")
    out = packing_bench.parse_args(argv)
    for name, value in changes.items():
        setattr(out, name, value)
    return out


# ---------------------------------------------------------------------------------------------------------------
# step
# ---------------------------------------------------------------------------------------------------------------


def treeopsd_loss(model, packed, credit: TurnCredit, old_logps: torch.Tensor) -> torch.Tensor:
    """The TreeOPSD loss of one packed micro-batch, as the trainer computes it (`TreeTrainer.loss_inputs`,
    `turn_loss`): the packed forward, the flattened `LossInputs`, the method table's loss."""
    logps, _ = packed_token_logps(model, packed)
    batch = LossInputs.build(packed.turn_ids, logps, old_logps, credit)
    loss, _ = methods.LOSSES[TREEOPSD.loss].compute(batch, TREEOPSD)
    return loss


def treeopsd_step(model, trees, variant: str, args, device, optimizer_step: bool = True) -> tuple[dict, torch.Tensor]:
    """One optimizer step on `trees` in `variant`'s layout and attention, from the model's current weights (restored
    afterwards, so every variant starts from the same θ = θ_old): its loss, seconds, peak memory and the gradients
    (flattened, float32). `optimizer_step=False`: the gradients only."""
    layout, attn_implementation = STEP_VARIANTS[variant]
    model.set_attn_implementation(attn_implementation)
    # the credit of every tree (T1-T4) from the trees' recorded log-probs: the same for every layout
    credit = TurnCredit.stack([methods.turn_credit(tree, TREEOPSD) for tree in trees], device)
    packed = pack_trees(trees, pad_token_id=0, layout=layout).to(device)
    saved = {n: p.detach().clone() for n, p in model.named_parameters()} if optimizer_step else {}
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.learning_rate) if optimizer_step else None
    model.zero_grad(set_to_none=True)
    if device == "cuda":
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
    start = time.perf_counter()
    with torch.no_grad():  # π_old from the very packed forward that trains the batch (T6: s = 0 in the first block)
        old_logps, _ = packed_token_logps(model, packed)
    loss = treeopsd_loss(model, packed, credit, old_logps)
    loss.backward()
    grads = torch.cat([p.grad.detach().float().flatten() for p in model.parameters() if p.grad is not None])
    if optimizer is not None:
        optimizer.step()
    if device == "cuda":
        torch.cuda.synchronize()
    seconds = time.perf_counter() - start
    peak = (torch.cuda.max_memory_allocated() - packing_bench.model_bytes(model)) / 2**20 if device == "cuda" else None
    with torch.no_grad():
        for n, p in model.named_parameters():
            if n in saved:
                p.copy_(saved[n])
    model.zero_grad(set_to_none=True)
    del optimizer, saved
    stats = {"variant": variant, "layout": layout, "attention": attn_implementation, "loss": loss.item(),
             "seconds": seconds, "peak_memory_mib": peak, "forward_tokens": packed.num_forward_tokens,
             "row_tokens": int(packed.valid.max()), "rows": int((packed.valid > 0).sum())}
    return stats, grads


def relative_error(grads: torch.Tensor, reference: torch.Tensor) -> tuple[float, float]:
    """||g − ref|| / ||ref|| and the cosine of the two, in float64 by chunks (a float32 sum over 0.6B entries drifts
    by percents)."""
    assert grads.shape == reference.shape, (grads.shape, reference.shape)
    dot = sq = sq_ref = diff = 0.0
    for a, b in zip(grads.split(1 << 24), reference.split(1 << 24)):
        a, b = a.double(), b.double()
        dot += float(a @ b)
        sq += float(a @ a)
        sq_ref += float(b @ b)
        diff += float((a - b) @ (a - b))
    return (diff / sq_ref) ** 0.5, dot / (sq * sq_ref) ** 0.5


def run_step(model, args, device) -> dict:
    """One TreeOPSD step per variant on the same trees and weights; each tree layout's gradients against paths'
    (and, in bf16, every layout's against the path layout's float32 gradients: the rounding noise floor)."""
    shape_args = packing_args(args, row_tokens=[args.step_row_tokens], trees=args.step_trees)
    shape = packing_bench.tree_shapes(shape_args)[0]
    rng = random.Random(args.seed + 1)
    trees = [packing_bench.synthetic_tree(shape_args, shape, model.config.vocab_size, rng)
             for _ in range(args.step_trees)]
    exact = None
    if model.dtype != torch.float32:
        full = copy.deepcopy(model).float()
        exact = treeopsd_step(full, trees, "paths_sdpa", args, device, optimizer_step=False)[1]
        del full
        if device == "cuda":
            torch.cuda.empty_cache()
    runs, reference = [], None
    for variant in sorted(args.step_variants, key=lambda v: v != "paths_sdpa"):  # paths first: the reference
        stats, grads = treeopsd_step(model, trees, variant, args, device)
        if reference is None:
            reference = grads
        error, cosine = relative_error(grads, reference)
        run = {**stats, "grad_rel_l2_vs_paths": error, "grad_cosine_vs_paths": cosine,
               "grad_max_abs_diff_vs_paths": (grads - reference).abs().max().item(), "grad_norm": grads.norm().item(),
               "loss_diff_vs_paths": stats["loss"] - runs[0]["loss"] if runs else 0.0}
        if exact is not None:
            run["grad_rel_l2_vs_float32_paths"] = relative_error(grads, exact)[0]
        runs.append(run)
        print(f"step {variant:>11}: loss {stats['loss']:.6g}, {stats['seconds']:.2f} s, gradient error vs paths "
              f"{error:.2e} (cosine {cosine:.6f})", flush=True)
        del grads
    del reference, exact
    noise = runs[0].get("grad_rel_l2_vs_float32_paths")  # the path layout's own rounding
    tolerance = FLOAT32_TOLERANCE if noise is None else max(FLOAT32_TOLERANCE, BF16_NOISE_FACTOR * noise)
    for run in runs:
        run["grads_match"] = run["grad_rel_l2_vs_paths"] <= tolerance
    return {"trees": {"shape": shape, "unique_tokens": sum(t.num_unique_tokens for t in trees),
                      "path_tokens": sum(t.num_path_tokens for t in trees),
                      "leaves": sum(t.num_leaves for t in trees)},
            "dtype": str(model.dtype), "bf16_noise_vs_float32": noise, "gradient_tolerance": tolerance,
            "runs": runs, "all_grads_match": all(r["grads_match"] for r in runs)}


# ---------------------------------------------------------------------------------------------------------------
# generation
# ---------------------------------------------------------------------------------------------------------------

TOOL_CALL = {"role": "assistant", "content": "", "tool_calls": [
    {"type": "function", "function": {"name": "lookup", "arguments": {}}}]}


def lookup() -> str:
    """The workload's tool: its text is not what the model reads (`observation_ids` gives random tokens)."""
    return "result"


class FixedTurns:
    """The engine's continuations as turns that end after their token budget (`max_turn_tokens`): no end-of-turn id
    is set, so every turn of the workload has exactly that many tokens, tree and flat alike. Counts the calls and
    the tokens generated."""

    resumes_turns = False  # whole turns per call, as the trainer's default

    def __init__(self, engine):
        self.engine = engine
        self.calls = self.generated_tokens = 0

    def rollout(self):
        return self.engine.rollout()

    def generate(self, prefixes, max_new_tokens):
        out = self.engine.generate(prefixes, max_new_tokens)
        self.calls += 1
        self.generated_tokens += sum(len(c.ids) for c in out)
        return [dataclasses.replace(c, finished=True) for c in out]


def generation_workload(model, args, variant: str, prompts: list[list[int]], device) -> dict:
    """One rollout of every prompt: a tree (InitExpandSampler with M, N) or a flat group (N = 0, M(1 + N/2)
    trajectories), with or without the prefix store. Seconds, tokens generated, leaves."""
    tree, store = variant.startswith("tree"), not variant.endswith("_no_store")
    vocab = model.config.vocab_size
    tokenizer = SimpleNamespace(pad_token_id=0, eos_token_id=None)  # GreedyEngine's ids; no end-of-turn id
    engine = FixedTurns(GreedyEngine(model, tokenizer, batch_size=args.gen_batch_size, reuse_prefixes=store))
    rng = random.Random(args.seed)
    settings = SamplerSettings(
        max_turns=args.gen_turns, max_turn_tokens=args.gen_turn_tokens, tool_timeout=None,
        max_completion_length=args.gen_turns * (args.gen_turn_tokens + args.gen_observation_tokens) + 1,
    )
    loop = TurnLoop(TurnLoopPorts(engine, parse=lambda ids, prefix: dict(TOOL_CALL),
                                  observation_ids=lambda messages: [rng.randrange(1, vocab) for _ in range(
                                      args.gen_observation_tokens)]), settings)
    m, n = args.num_initial_rollouts, args.num_branches
    sampler = InitExpandSampler(loop, m, n, seed=args.seed) if tree else InitExpandSampler(
        loop, m + m * n // 2, 0, seed=args.seed)
    roots = [TreeRoot(prompt_ids=list(p), tools={"lookup": lookup}) for p in prompts]
    if device == "cuda":
        torch.cuda.synchronize()
    start = time.perf_counter()
    with rollout_session(engine):
        per_tree = sampler.sample(roots)
    if device == "cuda":
        torch.cuda.synchronize()
    seconds = time.perf_counter() - start
    leaves = sum(len(branches) for branches in per_tree)
    return {"variant": variant, "seconds": seconds, "generated_tokens": engine.generated_tokens, "leaves": leaves,
            "calls": engine.calls, "prefix_store": engine.engine.store is not None,
            "turns_per_leaf": sum(len(b.turns) for bs in per_tree for b in bs) / leaves}


def run_generation(model, args, device) -> dict:
    """Every generation variant, round-robin over `--gen_repeats` passes, after an untimed warm-up rollout (one
    prompt, with and without the store: the first calls pay for kernel selection and allocator growth)."""
    model.set_attn_implementation("sdpa")
    model.eval()
    rng = random.Random(args.seed + 2)
    vocab = model.config.vocab_size
    prompts = [[rng.randrange(1, vocab) for _ in range(args.gen_prompt_tokens)] for _ in range(args.gen_prompts)]
    for variant in ("tree", "tree_no_store"):
        generation_workload(model, args, variant, prompts[:1], device)
    passes: dict[str, list[dict]] = {v: [] for v in args.gen_variants}
    for _ in range(args.gen_repeats):
        for variant in args.gen_variants:
            passes[variant].append(generation_workload(model, args, variant, prompts, device))
            print(f"generation {variant:>13}: {passes[variant][-1]['seconds']:.2f} s", flush=True)
    runs = []
    for results in passes.values():
        seconds = sum(r["seconds"] for r in results) / len(results)
        first = results[0]
        runs.append({**first, "seconds": seconds, "seconds_per_pass": [r["seconds"] for r in results],
                     "seconds_per_generated_token": seconds / first["generated_tokens"],
                     "seconds_per_leaf": seconds / first["leaves"],
                     "generated_tokens_per_leaf": first["generated_tokens"] / first["leaves"]})
    by_variant = {r["variant"]: r for r in runs}
    ratios = {}
    for tree, flat in (("tree", "flat"), ("tree_no_store", "flat_no_store")):
        if tree in by_variant and flat in by_variant:
            for unit in ("seconds_per_generated_token", "seconds_per_leaf"):
                ratios[f"{tree}/{flat} {unit}"] = by_variant[tree][unit] / by_variant[flat][unit]
    for with_store in ("tree", "flat"):
        if with_store in by_variant and f"{with_store}_no_store" in by_variant:
            ratios[f"{with_store}/{with_store}_no_store seconds"] = (
                by_variant[with_store]["seconds"] / by_variant[f"{with_store}_no_store"]["seconds"])
    model.train()
    return {"workload": {"prompts": args.gen_prompts, "prompt_tokens": args.gen_prompt_tokens,
                         "turn_tokens": args.gen_turn_tokens, "observation_tokens": args.gen_observation_tokens,
                         "turns": args.gen_turns, "M": args.num_initial_rollouts, "N": args.num_branches,
                         "flat_group": args.num_initial_rollouts * (2 + args.num_branches) // 2},
            "runs": runs, "ratios": ratios}


# ---------------------------------------------------------------------------------------------------------------
# precision
# ---------------------------------------------------------------------------------------------------------------

PRECISION_CASES = tuple((adapter, precision) for adapter in ("lora", "full") for precision in ("bf16", "fp16", "fp32"))


def autocast_of(precision: str, device: str):
    """The context the trainer computes under for `precision` (accelerate's `get_mixed_precision_context_manager`):
    autocast to bf16 / fp16, or nothing for fp32 and for fp16 on CPU (accelerate has no native fp16 amp there)."""
    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}.get(precision)
    if dtype is None or (device == "cpu" and dtype == torch.float16):
        return contextlib.nullcontext
    return functools.partial(torch.autocast, device_type=device, dtype=dtype)


@contextlib.contextmanager
def recorded_attention_dtypes(seen: set):
    """Adds the dtype of every attention output computed inside to `seen`."""
    sdpa = torch.nn.functional.scaled_dot_product_attention

    def recording(*args, **kwargs):
        out = sdpa(*args, **kwargs)
        seen.add(str(out.dtype).removeprefix("torch."))
        return out

    torch.nn.functional.scaled_dot_product_attention = recording
    try:
        yield seen
    finally:
        torch.nn.functional.scaled_dot_product_attention = sdpa


def precision_case(base, trees, adapter: str, precision: str, args, device) -> dict:
    """One (adapter, precision) case of the `precision` section: generation with the prefix store, then a packed
    forward + backward, each attention output's dtype recorded."""
    from peft import LoraConfig, get_peft_model
    from transformers import GenerationConfig

    model = copy.deepcopy(base)
    if adapter == "lora":
        model = get_peft_model(model, LoraConfig(r=8, target_modules="all-linear"))
    context = autocast_of(precision, device)
    forward = model.forward

    @functools.wraps(forward)
    def autocast_forward(*a, **k):  # accelerate's `prepare_model`: the outer module's forward, not its generate
        with context():
            return forward(*a, **k)

    model.forward = autocast_forward
    ports = HFPorts(eos_ids=set(), pad_id=0, device=lambda: device, model=lambda: model, wrapped_model=lambda: model,
                    generation_config=lambda: GenerationConfig(do_sample=False, pad_token_id=0),
                    unwrapped_for_generation=lambda: contextlib.nullcontext(model), cache="prefix", precision=context)
    engine = HFEngine(ports)
    rng = random.Random(args.seed + 3)
    vocab = model.config.vocab_size
    head = [rng.randrange(1, vocab) for _ in range(args.gen_prompt_tokens)]
    prefixes = [head + [rng.randrange(1, vocab)] for _ in range(4)]  # a shared head: the store prefills it first
    result = {"adapter": adapter, "precision": precision, "generation_dtypes": [], "forward_dtypes": []}
    try:
        generation, packed_forward = set(), set()
        with recorded_attention_dtypes(generation), engine.rollout():
            first = engine.generate(prefixes, [args.gen_turn_tokens] * len(prefixes))
            engine.generate([p + c.ids + [rng.randrange(1, vocab)] for p, c in zip(prefixes, first)],
                            [args.gen_turn_tokens] * len(prefixes))  # the second turn reuses the stored keys
        model.train()
        packed = pack_trees(trees, pad_token_id=0).to(device)
        with recorded_attention_dtypes(packed_forward):
            logps, _ = packed_token_logps(model, packed)
            logps.float().mean().backward()
        grads = [p.grad for p in model.parameters() if p.requires_grad]
        result.update(generation_dtypes=sorted(generation), forward_dtypes=sorted(packed_forward),
                      trainable_parameters=sum(p.numel() for p in model.parameters() if p.requires_grad),
                      grads_finite=all(g is not None and bool(torch.isfinite(g).all()) for g in grads),
                      grad_norm=float(torch.stack([g.float().norm() for g in grads if g is not None]).norm()))
        result["ok"] = result["grads_finite"] and result["generation_dtypes"] == result["forward_dtypes"]
    except RuntimeError as error:  # the dtype error this section guards against: reported, not fatal to the suite
        result.update(ok=False, error=f"{type(error).__name__}: {error}")
    print(f"precision {adapter:>4} {precision}: generation {result['generation_dtypes']}, packed forward "
          f"{result['forward_dtypes']}{', ' + result['error'] if 'error' in result else ''}", flush=True)
    return result


def run_precision(args, device) -> dict:
    """Every case of `PRECISION_CASES` from one float32 model of the run's shape, on the same small trees."""
    base = packing_bench.build_model(packing_args(args)).float().to(device)
    base.set_attn_implementation(TREE_SDPA)  # the tree trainers' switch: chains for packed trees, sdpa otherwise
    shape_args = packing_args(args, row_tokens=[args.precision_row_tokens], trees=2)
    shape = packing_bench.tree_shapes(shape_args)[0]
    rng = random.Random(args.seed + 4)
    trees = [packing_bench.synthetic_tree(shape_args, shape, base.config.vocab_size, rng) for _ in range(2)]
    runs = []
    for adapter, precision in PRECISION_CASES:
        runs.append(precision_case(base, trees, adapter, precision, args, device))
        if device == "cuda":
            torch.cuda.empty_cache()  # the case's model copy is gone with its frame
    del base
    return {"runs": runs, "all_ok": all(r["ok"] for r in runs)}


# ---------------------------------------------------------------------------------------------------------------


def main(argv=None):
    args = parse_args(argv)
    if not args.cpu and not torch.cuda.is_available():
        sys.exit("gpu_suite.py runs on a CUDA GPU and none is visible; --cpu runs the same code at tiny sizes.")
    device = "cpu" if args.cpu else "cuda"
    if args.cpu:
        torch.set_num_threads(1)  # tiny matrices; shared cores
    started = time.perf_counter()
    model = packing_bench.build_model(packing_args(args)).to(getattr(torch, args.dtype))
    parameters = sum(p.numel() for p in model.parameters())
    print(f"model: {args.model}, {parameters / 1e6:.0f}M parameters, {args.dtype}, {device}", flush=True)
    result = {"config": vars(args), "environment": environment(kernels=False), "parameters": parameters, "seconds": {}}
    for section in args.sections:
        begin = time.perf_counter()
        if section == "packing":
            sweep_args = packing_args(args)
            result["packing"] = packing_bench.sweep(model, sweep_args)
            packing_bench.report(result["packing"], model, sweep_args)
        elif section == "step":
            result["step"] = run_step(model, args, device)
        elif section == "precision":
            result["precision"] = run_precision(args, device)
        elif section == "async_vllm":
            import gpu_async_vllm  # imports TRL and datasets when it runs, never on the default sections' way

            result["async_vllm"] = gpu_async_vllm.run(args, device)
        else:
            result["generation"] = run_generation(model, args, device)
        result["seconds"][section] = time.perf_counter() - begin
        # neither is imported on the way (the GPU image has neither): benchmarks/README.md, "The GPU suite"
        result["imported"] = sorted(m for m in ("trl", "datasets") if m in sys.modules)
        print(f"[{section}] {result['seconds'][section]:.1f} s", flush=True)
        write_json(args.output, result)
    result["seconds"]["total"] = time.perf_counter() - started
    summary(result)
    write_json(args.output, result)


def summary(result: dict) -> None:
    if "step" in result:
        step = result["step"]
        print(f"\nOne TreeOPSD step ({step['trees']['unique_tokens']:,} unique / {step['trees']['path_tokens']:,} path "
              f"tokens; gradient tolerance {step['gradient_tolerance']:g})\n")
        print(markdown_table(step["runs"], ["variant", "loss", "seconds", "peak_memory_mib", "forward_tokens",
                                            "grad_rel_l2_vs_paths", "grad_rel_l2_vs_float32_paths",
                                            "grad_cosine_vs_paths", "grads_match"]))
    if "generation" in result:
        generation = result["generation"]
        print(f"\nGeneration, {generation['workload']}\n")
        print(markdown_table(generation["runs"], ["variant", "seconds", "generated_tokens", "leaves", "calls",
                                                  "seconds_per_generated_token", "seconds_per_leaf"]))
        print("\n" + ", ".join(f"{k}: {v:.3f}" for k, v in generation["ratios"].items()))
    if "precision" in result:
        print("\nPrecision (LoRA / full × bf16 / fp16 / fp32: generation and the packed forward in one dtype)\n")
        print(markdown_table(result["precision"]["runs"], ["adapter", "precision", "generation_dtypes",
                                                           "forward_dtypes", "grads_finite", "ok"]))
    if "async_vllm" in result:
        measured = result["async_vllm"]
        if "skipped" in measured:
            print(f"\nasync_vllm not run: {measured['skipped']}")
        else:
            print(f"\nThrough a vLLM server, sync vs max_staleness 1 (limit {measured['limit_seconds']:.3f} s per "
                  "generation batch)\n")
            print(markdown_table(measured["rows"], ["variant", "seconds_per_batch", "speedup", "over_limit",
                                                    "generation_seconds", "trainer_wait", "producer_wait",
                                                    "weight_push_seconds"]))
    print("\nsections: " + ", ".join(f"{k} {v:.0f} s" for k, v in result["seconds"].items()))


if __name__ == "__main__":
    main()
