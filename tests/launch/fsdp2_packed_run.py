"""FSDP2 (torch's `fully_shard`) on CPU processes over gloo, with trl-tree's packed tree training, for
tests/test_launch.py.

Usage: python -m torch.distributed.run --nproc_per_node 2 -m tests.launch.fsdp2_packed_run OUT   (repository root)

Accelerate never shards a CPU process's model (its CPU processes are MULTI_CPU, never FSDP: docs/design.md §8), so
this calls torch directly, as accelerate's FSDP2 path does on GPUs: every decoder layer and then the whole tiny
Qwen3 are `fully_shard`-ed (parameters become DTensors sharded over the ranks, gathered for each layer's forward and
backward, gradients reduce-scattered and averaged). Each rank trains its own micro-batch of two packed trees (the
tree layout, trl-tree's `tree_sdpa` attention) with TreeOPSD's loss (benchmarks/gpu_suite.py's `treeopsd_loss`:
packing, the method table's credit and loss), takes one AdamW step, and then generates greedily through the sharded model.
The same is computed without sharding on every rank: both micro-batches through an unsharded copy, gradients
averaged. Writes OUT/fsdp2-rank{r}.json: the largest differences of loss, gradients, updated parameters and
generated tokens from the unsharded computation.
"""

import copy
import json
import os
import sys
from pathlib import Path

import torch
import torch.distributed as dist
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor

from tests.trees import PAD, branching_tree, tiny_model
from trl_tree import methods
from trl_tree.core.batch import TurnCredit
from trl_tree.core.packing import pack_trees, packed_token_logps
from trl_tree.core.tree_attention import TREE_SDPA

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
from gpu_suite import TREEOPSD, treeopsd_loss  # noqa: E402


def micro_batch(rank: int):
    """Rank r's two trees (every leaf a different reward, so the credit is not zero) packed as one tree row each."""
    trees = [branching_tree(seed=2 * rank + i) for i in range(2)]
    for tree in trees:
        tree.rewards = [float(k % 3) for k in range(tree.num_leaves)]
    credit = TurnCredit.stack([methods.turn_credit(tree, TREEOPSD) for tree in trees])
    return pack_trees(trees, PAD, layout="tree"), credit


def loss_of(model, packed, credit):
    with torch.no_grad():
        old_logps, _ = packed_token_logps(model, packed)  # π_old from the same packed forward (T6)
    return treeopsd_loss(model, packed, credit, old_logps)


def full(tensor):
    return tensor.full_tensor() if isinstance(tensor, DTensor) else tensor


def main():
    out = Path(sys.argv[1])
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.set_num_threads(1)
    model = tiny_model("sdpa").train()
    model.set_attn_implementation(TREE_SDPA)  # what the tree trainers switch an sdpa policy to
    reference = copy.deepcopy(model)

    # unsharded: every rank's micro-batch, gradients averaged over the ranks as FSDP's reduce-scatter averages them
    losses = []
    for r in range(world):
        losses.append(loss_of(reference, *micro_batch(r)))
        (losses[-1] / world).backward()
    torch.optim.AdamW(reference.parameters(), lr=1e-2).step()
    prompt = torch.tensor([[5, 9, 13, 2, 7]])
    with torch.no_grad():  # greedy, after the update
        want_tokens = reference.generate(input_ids=prompt, max_new_tokens=6, do_sample=False, eos_token_id=None,
                                         pad_token_id=PAD)

    for layer in model.model.layers:
        fully_shard(layer)
    fully_shard(model)
    sharded = [p for p in model.parameters() if isinstance(p, DTensor)]
    # the optimizer holds the sharded parameters: made right after sharding, as accelerate prepares it (the root's
    # parameters are plain tensors between a no-grad forward and the next backward)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    loss = loss_of(model, *micro_batch(rank))
    loss.backward()
    grads = {n: full(p.grad) for n, p in model.named_parameters()}
    ref_params = dict(reference.named_parameters())
    grad_diff = max((grads[n] - ref_params[n].grad).abs().max().item() for n in grads)
    optimizer.step()
    param_diff = max((full(p.detach()) - ref_params[n].detach()).abs().max().item()
                     for n, p in model.named_parameters())
    with torch.no_grad():  # every forward gathers each layer's parameters from the ranks
        got_tokens = model.generate(input_ids=prompt, max_new_tokens=6, do_sample=False, eos_token_id=None,
                                    pad_token_id=PAD)
    report = {
        "rank": rank, "world": world, "all_sharded": len(sharded) == len(list(reference.parameters())),
        "local_numel": sum(p.to_local().numel() for p in sharded), "numel": sum(p.numel() for p in
                                                                              reference.parameters()),
        "loss_diff": abs(loss.item() - losses[rank].item()),
        "grad_norm": torch.stack([g.norm() for g in grads.values()]).norm().item(),
        "grad_diff": grad_diff, "param_diff": param_diff, "same_generation": torch.equal(got_tokens, want_tokens),
    }
    out.mkdir(parents=True, exist_ok=True)
    with open(out / f"fsdp2-rank{rank}.json", "w") as f:
        json.dump(report, f)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    os.environ.setdefault("TRL_EXPERIMENTAL_SILENCE", "1")
    main()
