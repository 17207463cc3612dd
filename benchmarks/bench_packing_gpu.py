"""Packed against path-wise training of long trees on a GPU: one row per tree with a flex_attention BlockMask, against
one causal row per root-to-leaf path.

A TreeOPSD tree of a search agent has long shared prefixes: the prompt, and turns whose observations run to
thousands of tokens, are shared by every leaf below them. `packing="tree"` forwards each unique token once (a row of
`tree.num_unique_tokens`, the ancestor-only mask as a BlockMask built from the DFS intervals); `packing="paths"`
forwards every leaf's whole history (`tree.num_path_tokens`) with plain causal attention. This script measures one
training forward + backward of `trl_tree.core.packing.packed_token_logps` (loss = sum of the trained tokens' log-probs) on
synthetic (M, N) trees of growing turn length, for:

    tree_flex     packing="tree", flex_attention with the BlockMask (the GPU path)
    tree_sdpa     packing="tree", sdpa with the dense [T, T] boolean mask (skipped past --dense_max_tokens)
    tree_chains   packing="tree", attn_implementation="tree_sdpa": sdpa chain by chain, the visible pairs only (what
                  the tree trainers use with an sdpa model; trl_tree.core.tree_attention)
    paths_sdpa    packing="paths", sdpa causal (no mask: flash / memory-efficient kernels)

and reports seconds, tokens forwarded, leaf tokens trained per second (the trees' root-to-leaf tokens, the same
work for every variant, over the seconds), peak memory per variant (MiB above the weights: activations, gradients,
kernel buffers; on CPU the peak resident memory of a forked child above its size at the fork), the paths/tree
speed-up, and the largest log-prob difference from paths_sdpa (the two layouts compute the same log-probs; bf16
rounding differs).

The model is randomly initialised from a config (default: Qwen3-0.6B's shape; nothing is downloaded), so only its
shape matters. On a machine without a GPU the script exits with a message; `--cpu` runs the sdpa variants on CPU in
float32 at the sizes given, and `--cpu-smoke` a tiny model on tiny trees, to check that the script works
(`--variants tree_flex,paths_sdpa` adds a forward-only flex_attention check: flex has no CPU backward, and its CPU
compile takes a minute).

`--row_tokens 1024,4096,...` sizes the trees by their tree row instead: each target sets the prompt, action and
observation lengths in the ratio 4 : 1 : 2 so that an (M, N) tree's expected unique tokens are the target (the
random anchors make each row's length vary about it). benchmarks/gpu_suite.py runs this sweep as its first section.

Usage:
    python benchmarks/bench_packing_gpu.py --output packing_gpu.json
    python benchmarks/bench_packing_gpu.py --row_tokens 1024,4096,16384,65536
    python benchmarks/bench_packing_gpu.py --observation_tokens 1024,4096,8192 --layers 8
    python benchmarks/bench_packing_gpu.py --cpu --hidden_size 256 --layers 2 --prompt_tokens 256 \
        --action_tokens 32 --observation_tokens 64,256,1024
    python benchmarks/bench_packing_gpu.py --cpu-smoke
"""

from __future__ import annotations

import argparse
import os
import pickle
import random
import resource
import sys
import time

import psutil
import torch
from common import environment, markdown_table, write_json

from trl_tree.core.packing import forward_cost, pack_trees, packed_token_logps, token_weight
from trl_tree.core.tree import RolloutTree, Turn
from trl_tree.core.tree_attention import TREE_SDPA

# Qwen3-0.6B's shape (config.json of Qwen/Qwen3-0.6B), written out so that nothing is downloaded
QWEN3_0_6B = dict(vocab_size=151936, hidden_size=1024, intermediate_size=3072, num_hidden_layers=28,
                  num_attention_heads=16, num_key_value_heads=8, head_dim=128, max_position_embeddings=40960,
                  rope_theta=1_000_000.0, tie_word_embeddings=True)
TINY = dict(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, head_dim=32, max_position_embeddings=4096, tie_word_embeddings=True)
SHAPES = {"qwen3-0.6b": QWEN3_0_6B, "tiny": TINY}
VARIANTS = {"tree_flex": ("tree", "flex_attention"), "tree_sdpa": ("tree", "sdpa"), "tree_chains": ("tree", TREE_SDPA),
            "paths_sdpa": ("paths", "sdpa")}


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--observation_tokens", default="512,2048,4096",
                   help="comma-separated sweep: tokens of each tool observation (one tree size per value)")
    p.add_argument("--action_tokens", type=int, default=256, help="tokens of each assistant turn")
    p.add_argument("--prompt_tokens", type=int, default=1024, help="tokens of the prompt")
    p.add_argument("--row_tokens", default=None,
                   help="comma-separated sweep of target tokens per tree row, instead of --observation_tokens: each "
                        "sets prompt, action and observation tokens in the ratio 4 : 1 : 2 (tree_shapes)")
    p.add_argument("--turns", type=int, default=3, help="assistant turns per trajectory")
    p.add_argument("--num_initial_rollouts", type=int, default=4, help="M")
    p.add_argument("--num_branches", type=int, default=2, help="N")
    p.add_argument("--trees", type=int, default=1, help="trees per micro-batch")
    p.add_argument("--variants", default=None,
                   help=f"comma-separated subset of {list(VARIANTS)} (default: all; --cpu-smoke: no tree_flex, whose "
                        "CPU compile takes a minute)")
    p.add_argument("--dense_max_tokens", type=int, default=32768,
                   help="skip tree_sdpa above this many tokens per row (its [T, T] mask is T² bytes per tree)")
    p.add_argument("--model", choices=sorted(SHAPES), default=None,
                   help="model shape, randomly initialised (default: qwen3-0.6b on a GPU, tiny with --cpu-smoke)")
    p.add_argument("--layers", type=int, default=None, help="override the model's number of layers")
    p.add_argument("--hidden_size", type=int, default=None,
                   help="override the model's width (MLP 3x, 64-dim heads, half as many KV heads)")
    p.add_argument("--gradient_checkpointing", action=argparse.BooleanOptionalAction, default=True,
                   help="recompute layer activations in backward (long rows do not fit otherwise)")
    p.add_argument("--repeats", type=int, default=3, help="timed forward + backward passes per variant")
    p.add_argument("--warmup", type=int, default=1, help="untimed passes first (flex_attention compiles here)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--cpu", action="store_true",
                   help="run on CPU in float32 (sdpa variants; flex_attention has no CPU backward)")
    p.add_argument("--cpu-smoke", dest="cpu_smoke", action="store_true",
                   help="--cpu with a tiny model and tiny trees, one pass: checks that the script works")
    p.add_argument("--output", default=None, help="write the results as JSON here")
    args = p.parse_args(argv)
    args.observation_tokens = [int(x) for x in args.observation_tokens.split(",")]
    args.row_tokens = [int(x) for x in args.row_tokens.split(",")] if args.row_tokens else None
    args.cpu = args.cpu or args.cpu_smoke
    default = [v for v in VARIANTS if not (args.cpu and v == "tree_flex")]
    args.variants = [v.strip() for v in args.variants.split(",") if v.strip()] if args.variants else default
    if set(args.variants) - set(VARIANTS):
        p.error(f"unknown variants {sorted(set(args.variants) - set(VARIANTS))}; choose from {list(VARIANTS)}")
    if args.cpu_smoke:
        args.observation_tokens, args.action_tokens, args.prompt_tokens = [16, 48], 8, 24
        args.repeats, args.warmup, args.gradient_checkpointing = 1, 0, False
    args.model = args.model or ("tiny" if args.cpu_smoke else "qwen3-0.6b")
    return args


def tree_shapes(args) -> list[dict]:
    """The sweep's tree sizes: per size, its key in the results (`size`) and its prompt, action and observation
    lengths. `--row_tokens`: the lengths, in the ratio 4 : 1 : 2, whose expected tree row (`expected_row_tokens`)
    is the target; otherwise `--observation_tokens` with the fixed prompt and action lengths."""
    if not args.row_tokens:
        return [{"size": o, "prompt_tokens": args.prompt_tokens, "action_tokens": args.action_tokens,
                 "observation_tokens": o} for o in args.observation_tokens]
    unit = expected_row_tokens(args, prompt=4, action=1, observation=2)
    shapes = []
    for target in args.row_tokens:
        a = max(1, round(target / unit))
        shapes.append({"size": target, "prompt_tokens": 4 * a, "action_tokens": a, "observation_tokens": 2 * a})
    return shapes


def expected_row_tokens(args, prompt: int, action: int, observation: int) -> float:
    """E[unique tokens] of one `synthetic_tree`: the prompt, M trajectories of `turns` turns (every turn but the last
    with an observation), and M·N continuations, each regenerating the turns from a uniform anchor a ∈ {1..T−1} on."""
    t = args.turns
    trajectory = t * action + (t - 1) * observation
    anchors = range(1, t) if t > 1 else [0]
    continuation = sum((t - a) * action + max(0, t - 1 - a) * observation for a in anchors) / len(anchors)
    return prompt + args.num_initial_rollouts * (trajectory + args.num_branches * continuation)


def synthetic_tree(args, shape: dict, vocab_size: int, rng: random.Random) -> RolloutTree:
    """An init-expand (M, N) tree of random tokens of `shape`'s lengths (`tree_shapes`): M trajectories of `turns`
    turns (the last one a final answer without observation), and N continuations of each from anchors drawn uniformly
    from turns 1..T-1, as TreeOPSD's sampler draws them. Continuations are fresh random turns, so nothing below an
    anchor is shared. Rewards are random (uniform in [0, 1))."""
    action_tokens, observation_tokens = shape["action_tokens"], shape["observation_tokens"]

    def tokens(n):
        return [rng.randrange(1, vocab_size) for _ in range(n)]

    def turn(last: bool) -> Turn:
        return Turn(tokens(action_tokens), [0.0] * action_tokens, [] if last else tokens(observation_tokens))

    def continue_from(prefix: list[Turn]) -> list[Turn]:
        return prefix + [turn(t == args.turns - 1) for t in range(len(prefix), args.turns)]

    trajectories = []
    for _ in range(args.num_initial_rollouts):
        initial = continue_from([])
        trajectories.append(initial)
        for _ in range(args.num_branches):
            anchor = rng.randint(1, args.turns - 1) if args.turns > 1 else 0
            trajectories.append(continue_from(initial[:anchor]))
    rewards = [rng.random() for _ in trajectories]
    return RolloutTree.from_trajectories(tokens(shape["prompt_tokens"]), trajectories, rewards)


def build_model(args):
    from transformers import Qwen3Config, Qwen3ForCausalLM

    shape = dict(SHAPES[args.model])
    if args.layers:
        shape["num_hidden_layers"] = args.layers
    if args.hidden_size:
        heads = max(1, args.hidden_size // 64)
        shape.update(hidden_size=args.hidden_size, intermediate_size=3 * args.hidden_size, head_dim=64,
                     num_attention_heads=heads, num_key_value_heads=max(1, heads // 2))
    torch.manual_seed(args.seed)
    model = Qwen3ForCausalLM(Qwen3Config(**shape))
    if not args.cpu:
        model = model.to(device="cuda", dtype=torch.bfloat16)
    if args.gradient_checkpointing:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    model.config.use_cache = False
    return model.train()


def measure(model, packed, attn_implementation: str, args) -> tuple[dict, torch.Tensor]:
    """Seconds of one forward + backward (mean over repeats; CPU seconds on CPU), peak memory, and the log-probs of
    the last pass.

    On CPU each variant runs in a forked child (`_in_forked_child`), so that its peak memory is its own: the kernel
    keeps a per-process peak RSS that cannot be reset, and memory an earlier variant freed to the allocator would
    hide the next one's. flex_attention runs the forward only on CPU: it checks that the BlockMask path runs and
    agrees.
    """
    if args.cpu:
        (stats, logps), peak_bytes = _in_forked_child(lambda: _passes(model, packed, attn_implementation, args))
        return {**stats, "peak_memory_mib": peak_bytes / 2**20}, logps
    torch.cuda.reset_peak_memory_stats()
    stats, logps = _passes(model, packed, attn_implementation, args)
    return {**stats, "peak_memory_mib": (torch.cuda.max_memory_allocated() - model_bytes(model)) / 2**20}, logps


def _passes(model, packed, attn_implementation: str, args) -> tuple[dict, torch.Tensor]:
    model.set_attn_implementation(attn_implementation)
    cuda = not args.cpu
    backward = cuda or attn_implementation != "flex_attention"  # flex_attention has no backward on CPU
    # on CPU the run is single-threaded: its CPU time does not count the other jobs of a shared machine
    clock = time.perf_counter if cuda else time.process_time
    seconds = []
    for i in range(args.warmup + args.repeats):
        model.zero_grad(set_to_none=True)
        if cuda:
            torch.cuda.synchronize()
        start = clock()
        with torch.set_grad_enabled(backward):
            logps, _ = packed_token_logps(model, packed)
        if backward:
            logps.sum().backward()
        if cuda:
            torch.cuda.synchronize()
        if i >= args.warmup:
            seconds.append(clock() - start)
    return {"seconds": sum(seconds) / len(seconds)}, logps.detach().float()


def model_bytes(model) -> int:
    """The weights' bytes: what every variant holds before its first pass (GPU peaks are reported above it)."""
    return sum(p.numel() * p.element_size() for p in model.parameters())


def _in_forked_child(work):
    """`work()` in a forked child: its result, and the child's peak resident memory above its memory at the fork
    (bytes; `ru_maxrss` of a fresh process starts at its own size, unlike a long-lived one's lifetime maximum).
    Errors in the child are raised here."""
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: never returns
        try:
            start = psutil.Process().memory_info().rss
            result = work()
            payload = (result, resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 - start)
        except BaseException as error:  # noqa: BLE001 - handed to the parent, which raises it
            payload = error
        with os.fdopen(write, "wb") as pipe:
            pickle.dump(payload, pipe)
        os._exit(0)
    os.close(write)
    with os.fdopen(read, "rb") as pipe:
        payload = pickle.load(pipe)
    os.waitpid(pid, 0)
    if isinstance(payload, BaseException):
        raise payload
    return payload


def main(argv=None):
    args = parse_args(argv)
    if not args.cpu and not torch.cuda.is_available():
        sys.exit("bench_packing_gpu.py measures flex_attention training on a GPU, and no CUDA device is visible. "
                 "Run it on a GPU machine, or pass --cpu-smoke for a tiny sdpa version on CPU (--cpu for sdpa at "
                 "the sizes given).")
    if args.cpu:
        torch.set_num_threads(1)  # the tiny matrices do not split; shared cores make OpenMP threads spin
    model = build_model(args)
    result = sweep(model, args)
    report(result, model, args)
    if args.output:
        write_json(args.output, {"config": vars(args), "environment": environment(), **result})


def sweep(model, args) -> dict:
    """Every variant at every size of `tree_shapes(args)`: the runs (one per size and variant), the paths/tree
    speed-ups by "size/variant", and what packing="auto" picks with sdpa at each size (by `size`)."""
    device = "cpu" if args.cpu else "cuda"
    rng = random.Random(args.seed)
    runs, auto_choice = [], {}
    shapes = tree_shapes(args)
    for shape in shapes:
        key = shape["size"]
        trees = [synthetic_tree(args, shape, model.config.vocab_size, rng) for _ in range(args.trees)]
        # what packing="auto" picks for a dense-mask kernel (sdpa), to set against the measured tree_sdpa/paths_sdpa
        costs = {layout: forward_cost(pack_trees(trees, 0, layout), token_weight(model.config))
                 for layout in ("tree", "paths")}
        auto_choice[key] = {"picks": min(costs, key=costs.get), "cost_tree_over_paths": costs["tree"] / costs["paths"]}
        size = {"size": key, **{k: v for k, v in shape.items() if k != "size"},
                "unique_tokens": sum(t.num_unique_tokens for t in trees),
                "path_tokens": sum(t.num_path_tokens for t in trees), "leaves": sum(t.num_leaves for t in trees)}
        reference = None
        for variant in sorted(args.variants, key=lambda v: v != "paths_sdpa"):  # paths first: the reference
            layout, attn_implementation = VARIANTS[variant]
            packed = pack_trees(trees, pad_token_id=0, layout=layout).to(device)
            row_tokens = int(packed.valid.max())
            if variant == "tree_sdpa" and row_tokens > args.dense_max_tokens:
                print(f"skip {variant} at {row_tokens} tokens per row (> --dense_max_tokens)", flush=True)
                continue
            try:
                stats, logps = measure(model, packed, attn_implementation, args)
            except torch.OutOfMemoryError:
                print(f"{variant}: out of memory at {size}", flush=True)
                torch.cuda.empty_cache()
                continue
            trained = packed.turn_ids >= 0
            values = logps[trained]  # the same trained tokens in both layouts, in DFS order of their turns
            if reference is None and layout == "paths":
                reference = _by_turn(packed, values)
            mine = _by_turn(packed, values)
            difference = max((mine[k] - reference[k]).abs().max().item() for k in mine) if reference else None
            forward = int(packed.valid.sum())
            runs.append({**size, "variant": variant, **stats, "forward_tokens": forward,
                         "row_tokens": row_tokens, "padded_tokens": int((packed.valid > 0).sum()) * row_tokens,
                         "leaf_tokens_per_second": size["path_tokens"] / stats["seconds"],
                         "max_abs_logp_diff_vs_paths": difference})
            print(f"{variant:>10} size={key}: {stats['seconds']:.3f} s", flush=True)
            del packed, logps

    speedups = {}
    for shape in shapes:
        key = shape["size"]
        by_variant = {r["variant"]: r for r in runs if r["size"] == key}
        if "tree_sdpa" in by_variant and "paths_sdpa" in by_variant:
            faster = min(("tree_sdpa", "paths_sdpa"), key=lambda v: by_variant[v]["seconds"])
            auto_choice[key]["measured_faster"] = faster.removesuffix("_sdpa")
        for variant in ("tree_flex", "tree_sdpa", "tree_chains"):
            if variant in by_variant and "paths_sdpa" in by_variant:
                speedups[f"{key}/{variant}"] = by_variant["paths_sdpa"]["seconds"] / by_variant[variant]["seconds"]
    return {"runs": runs, "speedup_paths_over_tree": speedups, "auto_sdpa": auto_choice}


def report(result: dict, model, args) -> None:
    """The sweep's table, speed-ups and packing="auto" picks, printed."""
    device = "cpu" if args.cpu else "cuda"
    sized_by = "row_tokens (target)" if args.row_tokens else "observation_tokens"
    columns = ["size", "variant", "unique_tokens", "path_tokens", "forward_tokens", "seconds",
               "leaf_tokens_per_second", "peak_memory_mib", "max_abs_logp_diff_vs_paths"]
    shape = ("prompt, action and observation tokens 4 : 1 : 2" if args.row_tokens else
             f"{args.action_tokens} action tokens + the observation, prompt {args.prompt_tokens}")
    print(f"\nOne forward + backward per variant ({device}, {model.config.num_hidden_layers} layers, hidden "
          f"{model.config.hidden_size}; M = {args.num_initial_rollouts}, N = {args.num_branches}, {args.turns} turns; "
          f"{shape}; size = {sized_by})\n")
    print(markdown_table(result["runs"], columns))
    print("\nspeed-up of packing (paths seconds / tree seconds): "
          + ", ".join(f"{k}: {v:.2f}x" for k, v in result["speedup_paths_over_tree"].items()))
    print("packing='auto' with sdpa (cost model, trl_tree.core.packing.forward_cost): "
          + ", ".join(f"size {k}: {v['picks']} (tree/paths cost {v['cost_tree_over_paths']:.2f}"
                      + (f"; measured faster: {v['measured_faster']})" if "measured_faster" in v else ")")
                      for k, v in result["auto_sdpa"].items()))


def _by_turn(packed, values: torch.Tensor) -> dict[tuple[int, int], torch.Tensor]:
    """Trained log-probs grouped by (tree, turn), each turn's tokens in order: comparable across layouts."""
    turn_ids = packed.turn_ids
    tree_of = torch.arange(turn_ids.shape[0], device=turn_ids.device).view(-1, 1, 1).expand_as(turn_ids)
    trained = turn_ids >= 0
    keys = list(zip(tree_of[trained].tolist(), turn_ids[trained].tolist()))
    grouped: dict[tuple[int, int], list[float]] = {}
    for key, value in zip(keys, values.tolist()):
        grouped.setdefault(key, []).append(value)
    return {k: torch.tensor(v) for k, v in grouped.items()}


if __name__ == "__main__":
    main()
