"""The golden training record every machine compares (`tests/data/golden_float64.json`; the test is
tests/test_golden_training.py, which says how to regenerate it).

Why it carries across machines when the bitwise record does not (docs/design.md §7, "Bits are a property of the
machine"): nothing here samples, and nothing starts from bits a machine computed.

- The units are stored, not grown: four rollout trees and two TreeFlex groups whose tokens, shapes, rewards, entropies
  and penalties are drawn from Python's `random.Random` (the same numbers in every Python), so no near-tie of sampling
  can turn a last-bit difference into other tokens.
- The model is the tiny Qwen3 shape in float64 with every parameter an exact dyadic rational drawn the same way (no
  torch initializer, whose vectorised kernels round differently per machine).
- Training is the pipeline Algorithm 1 runs (`trl_tree.core.pipeline`: pack, π_old's packed forward, the registered credit
  and the loss's `prepare`, then per optimizer block one packed forward and the registered loss), with plain SGD: its
  update is linear in the gradient, where Adam's g/√v turns a rounding-level gradient into a ±lr step.

What is compared, per (credit, loss) pair of the registries (every pair that trains one unit kind):
- exactly: the packed micro-batches' integer tensors (a digest) and the credit's integer fields (paths, searches,
  roles, turn counts): integer arithmetic is the same everywhere;
- to `RTOL` relative (with `ATOL` for values near 0): the credit's float fields, π_old's sum, and per optimizer block
  the loss, its metrics, the gradient's norm and its projection on a fixed direction. Machines differ only in how
  their kernels order float64 sums (a relative 1e-16 per operation); see `SPREAD` for what was measured.
"""

from __future__ import annotations

import functools
import hashlib
import random
import tempfile
from pathlib import Path

import torch
from transformers import Qwen3Config, Qwen3ForCausalLM

from tests.trees import TINY_SHAPE
from trl_tree import methods, pipeline
from trl_tree.core.flex_unit import FlexGroup, FlexUnits
from trl_tree.core.packing import PackedTrees
from trl_tree.core.tree import RolloutTree, Turn
from trl_tree.core.tree_unit import TreeUnits
from trl_tree.rollout.growing.flex_harness import EXECUTION, REFLECTION, FlexBlock, FlexSearch

RECORD = Path(__file__).parent / "data" / "golden_float64.json"
RTOL = 1e-9
ATOL = 1e-12
# the largest relative difference of any recorded float between this machine's AVX512 kernels on one thread and its
# plain (ATEN_CPU_CAPABILITY=default) or AVX2 kernels, or two threads (2026-12, torch 2.13): RTOL leaves a margin of
# ~1e5 over it, for other machines' kernels, and still fails a change of one part in a billion
SPREAD = 1e-14
VOCAB, PAD = TINY_SHAPE["vocab_size"], 0
LEARNING_RATE = 0.5  # large enough that the second block's ratios leave GRPO's clip range (its clip counts are pinned)
BLOCKS = 2  # optimizer blocks of the one generation batch: the second trains at θ ≠ θ_old


# ---------------------------------------------------------------------------------------------------------------
# The model and the stored units
# ---------------------------------------------------------------------------------------------------------------


def dyadic(rng: random.Random, n: int, scale: float) -> list[float]:
    """n values uniform on [-scale, scale) in steps of scale/2^15: exact in float64 whatever the machine."""
    return [scale * (rng.getrandbits(16) - 32768) / 32768 for _ in range(n)]


def golden_model() -> Qwen3ForCausalLM:
    """The tiny Qwen3 shape of the packing tests, float64, every parameter drawn by `dyadic` (norms stay 1)."""
    config = Qwen3Config(**TINY_SHAPE)
    model = Qwen3ForCausalLM(config).to(torch.float64).eval()
    model.set_attn_implementation("sdpa")
    rng = random.Random(0)
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() > 1:
                p.copy_(torch.tensor(dyadic(rng, p.numel(), 0.25), dtype=torch.float64).view_as(p))
    return model


@functools.cache
def _direction() -> tuple[torch.Tensor, ...]:
    """A fixed direction in parameter space the gradients are projected on (a change of direction shows in it)."""
    rng = random.Random(1)
    return tuple(
        torch.tensor(dyadic(rng, p.numel(), 1.0), dtype=torch.float64).view_as(p)
        for _, p in golden_model().named_parameters()
    )


def _turn(rng: random.Random, last: bool, penalty: float = 0.0) -> Turn:
    n = rng.randint(1, 5)
    obs = [] if last else [rng.randrange(1, VOCAB) for _ in range(rng.randint(1, 3))]
    return Turn(
        action_ids=[rng.randrange(1, VOCAB) for _ in range(n)],
        action_logps=[0.0] * n,
        observation_ids=obs,
        entropies=[rng.getrandbits(6) / 16 for _ in range(n)],
        penalty=penalty,
    )


# Each tree: trajectories as turn labels (a label is one turn of that tree; a label shared by trajectories is a shared
# prefix; a repeated trajectory merges into a leaf of multiplicity 2) and the leaves' rewards. The last tree's rewards
# are all equal: zero credit, trained in the second block, where θ ≠ θ_old.
TREES = (
    (["abc", "abd", "ae", "fg", "abc"], [1.0, 0.0, 0.5, 0.0, 1.0]),
    (["ab", "acd", "h", "ace"], [0.25, 1.0, 0.0, 0.75]),
    (["abc", "ad", "ef"], [0.0, 1.0, 0.0]),
    (["ab", "ac", "d"], [0.5, 0.5, 0.5]),
)


def build_tree(rng: random.Random, trajectories: list[str], rewards: list[float]) -> RolloutTree:
    """A tree of `trajectories` (strings of turn labels: a label shared by trajectories is one turn, a shared prefix),
    its turns' tokens, observations and entropies drawn from `rng`."""
    inner = {label for path in trajectories for label in path[:-1]}
    turns = {label: _turn(rng, last=label not in inner) for label in sorted({c for p in trajectories for c in p})}
    prompt = [rng.randrange(1, VOCAB) for _ in range(rng.randint(2, 6))]
    return RolloutTree.from_trajectories(prompt, [[turns[c] for c in p] for p in trajectories], rewards)


def stored_trees() -> list[RolloutTree]:
    """The four trees of `TREES`, built afresh (the pipeline writes π_old into their turns)."""
    rng = random.Random(2)
    return [build_tree(rng, trajectories, rewards) for trajectories, rewards in TREES]


def build_group(rng: random.Random, scores: list[float], penalties: bool = True, max_execution: int = 2) -> FlexGroup:
    """A TreeFlex group of one complete search per score: a Reflection block, then 1 to `max_execution` Execution
    blocks, some turns with a process penalty (with `penalties`)."""
    searches = []
    for _ in scores:
        blocks = [FlexBlock([rng.randrange(1, VOCAB) for _ in range(4)], [_turn(rng, last=True)], REFLECTION)]
        for _ in range(rng.randint(1, max_execution)):
            n = rng.randint(1, 2)
            turns = [
                _turn(rng, last=i == n - 1, penalty=-0.5 * rng.getrandbits(1) if penalties else 0.0) for i in range(n)
            ]
            blocks.append(FlexBlock([rng.randrange(1, VOCAB) for _ in range(rng.randint(2, 5))], turns, EXECUTION))
        searches.append(FlexSearch(blocks=blocks, completion=[]))
    return FlexGroup.build(searches, torch.tensor(scores, dtype=torch.float64), (REFLECTION, EXECUTION))


def stored_groups() -> list[FlexGroup]:
    """Two TreeFlex groups of three complete searches."""
    rng = random.Random(3)
    return [build_group(rng, scores) for scores in ([1.0, 0.0, 0.5], [0.0, 0.25, 1.0])]


# ---------------------------------------------------------------------------------------------------------------
# The configurations and their run
# ---------------------------------------------------------------------------------------------------------------


def configurations() -> dict[str, tuple[str, str]]:
    """Every (credit, loss) pair of the registries that trains one kind of unit, named "credit+loss": a newly
    registered credit or loss adds its pairs here, and the test fails until the record holds them."""
    return {
        f"{c}+{loss}": (c, loss)
        for c, credit in methods.CREDITS.items()
        for loss, entry in methods.LOSSES.items()
        if credit.unit == entry.unit
    }


def golden_args(credit: str, loss: str, output_dir: str):
    """The config a pair trains with: its class's defaults (a changed default is a changed behaviour), one tree (or
    group) per micro-batch of two."""
    from tests.scripted import config
    from trl_tree.trainer.configuration.fields import TreeConfig, TreeFlexConfig

    unit = methods.LOSSES[loss].unit
    cls = TreeConfig if unit == "tree" else TreeFlexConfig
    shape = {"num_initial_rollouts": 2, "num_branches": 1} if unit == "tree" else {"num_searches": 3, "max_blocks": 2}
    return config(cls, output_dir, trees_per_micro_batch=2, credit=credit, loss=loss, **shape)


def _digest(tensors) -> str:
    h = hashlib.sha256()
    for t in tensors:
        h.update(str(tuple(t.shape)).encode())
        h.update(t.detach().to(torch.int64).contiguous().numpy().tobytes())
    return h.hexdigest()[:32]


def _metric(value) -> list[float]:
    """A loss metric as the record keeps it: a tensor's mean (what is logged), `ClipCounts`' column sums (low-,
    high-clipped and trained tokens), another wrapped tensor's (e.g. `Largest`) largest value."""
    if isinstance(value, methods.ClipCounts):
        return value.counts.double().sum(0).tolist()
    if isinstance(value, tuple):
        return [value[0].double().max().item()]
    return [value.double().mean().item()]


def run(credit: str, loss: str) -> dict:
    """The record of one pair: two optimizer blocks of SGD on the stored units, from `golden_model`."""
    with tempfile.TemporaryDirectory() as out:
        args = golden_args(credit, loss, out)
    torch.manual_seed(0)  # nothing here draws, but a loss that did would draw the same
    model = golden_model()
    if methods.LOSSES[loss].unit == "tree":
        units = stored_trees()
        unit = TreeUnits(None, None, PAD, args.packing, model.config, args.mask_truncated_completions)
    else:
        units = stored_groups()
        unit = FlexUnits(None, None, PAD, args.mask_truncated_completions, None)
    ports = pipeline.PipelinePorts(
        prepare=None,
        score=None,
        device="cpu",
        credit=lambda u: methods.turn_credit(u, args),
        behaviour_logps=lambda packed: pipeline.behaviour_logps(model, packed, "cpu", args.temperature),
    )
    batches = pipeline.micro_batches(unit, ports, units, BLOCKS)[0]
    record = {"packed": [], "credit": [], "old_logps": [], "blocks": []}
    for inputs in batches:
        packed = PackedTrees.from_dict(inputs).to_dict()  # the packing alone: its integer tensors
        record["packed"].append(_digest(v for _, v in sorted(packed.items()) if not v.is_floating_point()))
        record["credit"].append({k: v.tolist() for k, v in sorted(inputs.items()) if k.startswith("credit_")})
        record["old_logps"].append(inputs["old_logps"].sum().item())
    for inputs in batches:
        model.zero_grad()
        batch, _ = pipeline.loss_inputs(model, inputs, args.temperature)
        value, metrics = methods.block_loss(batch, args)
        value.backward()
        grads = [p.grad if p.grad is not None else torch.zeros_like(p) for p in model.parameters()]
        record["blocks"].append(
            {
                "loss": value.item(),
                "grad_norm": torch.sqrt(sum((g * g).sum() for g in grads)).item(),
                "grad_projection": sum((g * r).sum() for g, r in zip(grads, _direction())).item(),
                "metrics": {name: _metric(v) for name, v in sorted(metrics.items())},
            }
        )
        with torch.no_grad():
            for p, g in zip(model.parameters(), grads):
                p -= LEARNING_RATE * g
    return record


# ---------------------------------------------------------------------------------------------------------------
# Comparing
# ---------------------------------------------------------------------------------------------------------------


def differences(got, want, where: str = "") -> list[str]:
    """Where `got` differs from the recorded `want`: strings, ints and structure exactly, floats to RTOL / ATOL."""
    if isinstance(want, dict):
        if not isinstance(got, dict) or got.keys() != want.keys():
            return [f"{where}: keys {sorted(got) if isinstance(got, dict) else got!r}, recorded {sorted(want)}"]
        return [d for k in want for d in differences(got[k], want[k], f"{where}.{k}" if where else k)]
    if isinstance(want, list):
        if not isinstance(got, list) or len(got) != len(want):
            return [f"{where}: {got!r}, recorded {want!r}"]
        return [d for i, (g, w) in enumerate(zip(got, want)) for d in differences(g, w, f"{where}[{i}]")]
    if isinstance(want, float) and isinstance(got, float):
        if abs(got - want) <= RTOL * abs(want) + ATOL:
            return []
        return [
            f"{where}: {got!r}, recorded {want!r} (relative difference {abs(got - want) / max(abs(want), ATOL):.1e}"
            f", tolerance {RTOL:.0e})"
        ]
    return [] if type(got) is type(want) and got == want else [f"{where}: {got!r}, recorded {want!r} (exact)"]


def largest_relative_difference(got, want) -> float:
    """The largest |got − want| / |want| over the floats of two records of the same structure (for `SPREAD`)."""
    if isinstance(want, dict):
        return max((largest_relative_difference(got[k], want[k]) for k in want), default=0.0)
    if isinstance(want, list):
        return max((largest_relative_difference(g, w) for g, w in zip(got, want)), default=0.0)
    if isinstance(want, float):
        return abs(got - want) / max(abs(want), ATOL)
    return 0.0
