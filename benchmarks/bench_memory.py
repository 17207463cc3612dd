"""Where a tree's memory goes, on the tiny model: the prefix KV store, the packed tree row, the training step.

For each tree size (M, N) of `--sizes`, a fresh TreeOPSD trainer on the calculator task (the warm-started tiny
model, as `bench_step.py` uses it) grows `--prompts` trees with the same seed, packs them into one micro-batch and
runs one loss forward and backward on it. Recorded per size:

    leaves, unique tokens     K per tree, and the tokens of the packed rows (each unique token once)
    path tokens               the tokens of every distinct root-to-leaf history: what the prefix store holds at most
    store peak                the most bytes of keys and values the prefix store held at once during the rollout
                              (`PrefixKVStore.peak_bytes`), also in tokens of KV (2 × layers × kv_heads × head_dim ×
                              bytes per value a token); the tokens its calls reused and prefilled
    call peak                 the most KV alive at the end of one call: the rows held, the call's own cache (padded
                              rows, spare columns) and the new rows cut from it, before the rows they extend go
    sampling Python peak      tracemalloc's peak of Python objects while sampling (histories, turns, token lists;
                              tensors are not Python objects), and what the sampled trees keep afterwards
    packed bytes              the tensors of the packed micro-batch (`TreeTrainer.micro_batches`: ids, positions, DFS
                              intervals, π_old, credit)
    saved for backward        the activations autograd keeps from the loss forward until backward (saved-tensor hooks,
                              each storage once, parameters excluded; the checkpointed vocabulary projection is
                              recomputed in backward and not counted), and the part saved inside the tree attention
    step RSS                  peak resident memory of the forward and backward above its start (CPU; allocator
                              caching makes it coarse)

Then the largest size again with `max_prefix_cache_bytes` = `--cap_fraction` of its store peak: the store's peak and
the tokens it reused, and whether the trees' sampled token ids equal the uncapped run's (they must: the cap changes
what is reused, not what is computed).

Usage:
    python benchmarks/bench_memory.py                          # tiny model; writes results/memory_tiny.json
    python benchmarks/bench_memory.py --sizes 2x1,4x2 --quick  # smoke run
"""

from __future__ import annotations

import argparse
import os
import random
import tempfile
import time
import traceback
import tracemalloc
from pathlib import Path

import torch
from common import (
    Budget,
    PeakMemory,
    build_trainer,
    environment,
    load_model,
    make_task,
    markdown_table,
    warm_started_model,
    write_json,
)

RESULTS = Path(__file__).resolve().parent / "results"


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--sizes", default="2x1,4x2,8x4,16x8", help="comma-separated MxN tree sizes")
    p.add_argument("--prompts", type=int, default=2, help="trees per size (one micro-batch)")
    p.add_argument("--max_turns", type=int, default=3)
    p.add_argument("--max_completion_length", type=int, default=96)
    p.add_argument("--warm_start_steps", type=int, default=150,
                   help="SFT steps on the calculator's scripted tool calls (cached; the tiny model then calls tools)")
    p.add_argument("--cap_fraction", type=float, default=0.25,
                   help="the capped rerun of the largest size keeps this fraction of its uncapped store peak")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--quick", action="store_true", help="smoke run: sizes 2x1,4x1, 1 prompt, 20 warm-start steps")
    p.add_argument("--output", default=str(RESULTS / "memory_tiny.json"), help="write the results as JSON here")
    args = p.parse_args(argv)
    if args.quick:
        args.sizes, args.prompts, args.warm_start_steps = "2x1,4x1", 1, 20
    args.sizes = [tuple(int(v) for v in size.split("x")) for size in args.sizes.split(",") if size.strip()]
    return args


def kv_bytes_per_token(model) -> int:
    """Bytes of keys and values one token takes in a full-attention cache of `model`."""
    config = model.config
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    kv_heads = getattr(config, "num_key_value_heads", None) or config.num_attention_heads
    return 2 * config.num_hidden_layers * kv_heads * head_dim * model.dtype.itemsize


def cache_bytes(cache) -> int:
    """Bytes of a call's KV cache: its layers' buffers (`GrowingLayer`, spare columns included) or tensors."""
    total = 0
    for layer in cache.layers:
        buffers = getattr(layer, "_buffers", None) or (layer.keys, layer.values)
        total += sum(t.nbytes for t in buffers)
    return total


def path_tokens(tree) -> int:
    """Tokens of every distinct root-to-leaf history (merged leaves once): the store keeps each such row once."""
    lengths = []
    for turn in tree.turns:
        parent = lengths[turn.parent] if turn.parent >= 0 else len(tree.prompt_ids)
        lengths.append(parent + len(turn.action_ids) + len(turn.observation_ids))
    return sum(lengths[i] for i in set(tree.leaf_of))


def saved_for_backward(model, run) -> tuple[object, dict[str, int]]:
    """`run()`'s result and the bytes of the tensors autograd saved for backward while it ran (each storage once,
    the model's parameters excluded: they are held anyway), split into those saved inside the tree attention
    (`trl_tree/core/tree_attention.py`: each chain's gathered ancestor keys and values, sdpa's own) and the rest."""
    parameters = {p.untyped_storage().data_ptr() for p in model.parameters()}
    storages: dict[int, tuple[int, str]] = {}

    def pack(tensor):
        try:
            storage = tensor.untyped_storage()
        except (RuntimeError, NotImplementedError):  # e.g. a tensor subclass without storage
            return tensor
        if storage.data_ptr() not in parameters and storage.data_ptr() not in storages:
            inside = any(frame.filename.endswith("tree_attention.py") for frame in traceback.extract_stack())
            storages[storage.data_ptr()] = (storage.nbytes(), "attention" if inside else "other")
        return tensor

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
        result = run()
    split = {"attention": 0, "other": 0}
    for nbytes, kind in storages.values():
        split[kind] += nbytes
    return result, split


def measure(model_path: str, task, size: tuple[int, int], args, cap: int | None = None) -> tuple[dict, list]:
    """One size: grow the trees (same seed every time), pack them, one training forward + backward."""
    M, N = size
    model, tokenizer = load_model(model_path)
    budget = Budget(prompts=args.prompts, blocks=1, num_initial_rollouts=M, num_branches=N, generation_batches=1,
                    max_turns=args.max_turns, max_completion_length=args.max_completion_length, seed=args.seed)
    memory = PeakMemory()
    with tempfile.TemporaryDirectory() as output_dir:
        trainer = build_trainer("treeopsd", model, tokenizer, task, budget, output_dir, max_prefix_cache_bytes=cap)
        store = trainer.generation_engine.prefix_store
        counts, call_peak = [], [0]
        clear, keep = store.clear, store.store

        def clear_and_count():  # the engine empties the store when the rollout ends: count its work first
            counts.append((store.reused_tokens, store.prefilled_tokens))
            clear()

        def store_and_measure(cache, *args):  # at the end of a call: the rows held, the call's cache, the new rows
            held, before = store.bytes_held, {id(entry) for entry in store.entries}
            keep(cache, *args)
            fresh = sum(entry.nbytes for entry in store.entries if id(entry) not in before)
            call_peak[0] = max(call_peak[0], held + cache_bytes(cache) + fresh)

        store.clear, store.store = clear_and_count, store_and_measure
        rows = [trainer.train_dataset[i] for i in range(args.prompts)]
        random.seed(args.seed)
        torch.manual_seed(args.seed)
        store.reset_peak()
        memory.reset()
        rss_before = memory.peak_mib()
        tracemalloc.start()
        started = time.process_time()
        trees = trainer.sample_trees(rows)
        sampling_cpu = time.process_time() - started
        kept, python_peak = tracemalloc.get_traced_memory()
        tracemalloc.stop()
        sampling_rss = memory.peak_mib() - rss_before
        batch = trainer.micro_batches(trees, 1)[0]
        packed_bytes = sum(t.nbytes for t in batch.values() if isinstance(t, torch.Tensor))
        trainer.model.train()
        memory.reset()
        rss_before = memory.peak_mib()
        loss, saved = saved_for_backward(trainer.model, lambda: trainer.compute_loss(trainer.model, batch))
        loss.backward()
        step_rss = memory.peak_mib() - rss_before
        memory.close()
        kv = kv_bytes_per_token(trainer.model)
        unique = sum(len(t.prompt_ids) + sum(len(x.action_ids) + len(x.observation_ids) for x in t.turns)
                     for t in trees)
        row = {
            "M": M, "N": N, "cap_bytes": cap, "leaves_per_tree": trees[0].num_leaves, "trees": len(trees),
            "generated_tokens": sum(len(x.action_ids) for t in trees for x in t.turns),
            "unique_tokens": unique, "path_tokens": sum(path_tokens(t) for t in trees),
            "kv_bytes_per_token": kv,
            "store_peak_bytes": store.peak_bytes, "store_peak_tokens": store.peak_bytes // kv,
            "store_reused_tokens": sum(r for r, _ in counts), "prefilled_tokens": sum(p for _, p in counts),
            "call_peak_bytes": call_peak[0],
            "sampling_python_peak_bytes": python_peak, "trees_python_bytes": kept,
            "sampling_rss_mib": sampling_rss, "sampling_cpu_seconds": sampling_cpu,
            "packed_bytes": packed_bytes, "saved_for_backward_bytes": saved["attention"] + saved["other"],
            "saved_in_attention_bytes": saved["attention"], "step_rss_mib": step_rss,
        }
    ids = [[(t.parent, t.action_ids, t.observation_ids) for t in tree.turns] for tree in trees]
    return row, ids


def main(argv=None) -> dict:
    args = parse_args(argv)
    torch.set_num_threads(1)
    started = time.process_time()
    task = make_task("calculator", seed=args.seed)
    model_path = warm_started_model(task, None, args.warm_start_steps, seed=args.seed)
    rows, largest_ids = [], None
    for size in args.sizes:
        row, largest_ids = measure(model_path, task, size, args)
        rows.append(row)
        print(f"[{size[0]}x{size[1]}] K = {row['leaves_per_tree']}, store peak {row['store_peak_bytes']:,} B", flush=True)
    last = rows[-1]
    cap = max(1, int(args.cap_fraction * last["store_peak_bytes"]))
    capped, capped_ids = measure(model_path, task, args.sizes[-1], args, cap=cap)
    capped["same_tokens_as_uncapped"] = capped_ids == largest_ids
    rows.append(capped)
    columns = ["M", "N", "cap_bytes", "leaves_per_tree", "generated_tokens", "unique_tokens", "path_tokens",
               "store_peak_tokens", "store_peak_bytes", "call_peak_bytes", "prefilled_tokens", "sampling_python_peak_bytes",
               "trees_python_bytes", "packed_bytes", "saved_for_backward_bytes", "saved_in_attention_bytes",
               "step_rss_mib"]
    headers = {"cap_bytes": "cap B", "leaves_per_tree": "K", "generated_tokens": "generated",
               "unique_tokens": "unique tok", "path_tokens": "path tok", "store_peak_tokens": "store peak tok",
               "store_peak_bytes": "store peak B", "call_peak_bytes": "call peak B", "prefilled_tokens": "prefilled tok",
               "sampling_python_peak_bytes": "sampling Python peak B", "trees_python_bytes": "trees Python B",
               "packed_bytes": "packed B", "saved_for_backward_bytes": "saved for backward B",
               "saved_in_attention_bytes": "of which in attention B",
               "step_rss_mib": "step RSS MiB"}
    print(markdown_table(rows, columns, headers))
    print(f"capped rerun ({cap:,} B): same sampled tokens as uncapped: {capped['same_tokens_as_uncapped']}")
    payload = {"settings": {**vars(args), "sizes": [f"{m}x{n}" for m, n in args.sizes]}, "rows": rows,
               "cpu_seconds": time.process_time() - started, "environment": environment()}
    write_json(args.output, payload)
    return payload


if __name__ == "__main__":
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    main()
