"""One generation batch and its loss, as the paper's Algorithm 1 reads, without TRL (docs/design.md §2, "Layers").

    for a generation batch of prompts:
        grow one rollout unit per prompt                     unit.grow        (a tree; TreeFlex: K complete searches)
        score its leaves with the reward functions           ports.score      (a leaf; TreeFlex: a search)
        build the units from the leaves and their rewards    unit.build
        per micro-batch of whole units:
            pack them                                        unit.pack
            π_old ← one no-grad packed forward (T6)          ports.behaviour_logps, unit.record_behaviour
            credit each unit's turns                         ports.credit
    then per optimizer block, per micro-batch:
        the turn-level loss of one packed forward            loss_inputs, block_loss

The trainer (`trl_tree.trainer.base.TreeTrainer`) is an adapter: it builds the ports from GRPOTrainer's machinery
(TRL's reward computation, the chat template, the accelerator, the training model) and the unit from its
configuration, calls `generation_batch`, and logs what it returns. Everything it needs comes back as a value
(`GenerationBatch`, `LeafScores`), nothing through the trainer's attributes. A unit kind (`RolloutUnit`) is what
differs between the tree trainers (`trl_tree.tree_unit.TreeUnits`) and TreeFlex (`trl_tree.flex_unit.FlexUnits`): what
it grows, what its leaves are, how it packs, and whether π_old goes back into it.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch

from . import losses, methods
from .batch import LossInputs, TurnCredit
from .packing import PackedTrees, packed_token_logps


class Leaf(Protocol):
    """What the reward functions see of one leaf (a tree's trajectory, `rollout.turn_loop.Branch`; TreeFlex's complete
    search, `rollout.flex_harness.FlexSearch`): its conversation after the prompt, its generated ids, its
    environment."""

    messages: list[dict]
    completion_ids: list[int]
    env: Any


@dataclass
class LeafScores:
    """The reward functions' values on this rank's leaves of one generation batch, in leaf order (unit by unit).

    Attributes:
        per_func: [leaves, reward functions]; NaN where a function returned None (does not apply).
        weighted: GRPO's reward of each leaf, the weighted sum of the functions that apply (NaN: none applies).
        for_credit: per unit, its leaves' rewards as its credit reads them (aggregated with the unit as the group,
            unscored leaves filled).
    """

    per_func: torch.Tensor
    weighted: torch.Tensor
    for_credit: list[torch.Tensor]


@dataclass
class Grown:
    """What a unit kind grew for one generation batch: per prompt, its leaves; `diverged`, per prompt, how many
    branches were dropped because their environment disagreed with their history (None: the kind has no replays);
    `sampler_stats`, what the sampler measured while growing them (metric name -> one value per tree), returned here
    rather than left on the sampler so the trainer logs the batch it was given, not whatever the sampler did last."""

    leaves: list[list[Any]]
    diverged: list[int] | None = None
    sampler_stats: dict[str, list[float]] = field(default_factory=dict)


class RolloutUnit(Protocol):
    """One kind of training unit (a rollout tree, TreeFlex's group of searches) and what the pipeline asks of it."""

    def grow(self, prompts: list, roots: list) -> Grown:
        """One unit's leaves per prompt (`roots`: the prompts rendered, with their environments and tools)."""

    def build(self, inputs: list[dict], roots: list, leaves: list[list[Any]], rewards: list[torch.Tensor]) -> list:
        """The trainable units from the scored leaves."""

    def pack(self, units: list) -> PackedTrees:
        """One micro-batch of whole units, packed as the loss's forward reads it."""

    def record_behaviour(self, packed: PackedTrees, old_logps: torch.Tensor, units: list) -> None:
        """After π_old's forward: write it back where the credit reads it, mask what must not be trained."""


@dataclass
class PipelinePorts:
    """What the pipeline needs of its owner, narrowly.

    Attributes:
        prepare: `prepare(inputs) -> (prompts, roots)`: reset environments, render and check the prompts.
        score: `score(inputs, prompts, leaves_per_unit) -> LeafScores`: the reward functions on every leaf.
        behaviour_logps: `behaviour_logps(packed) -> Tensor`: π_old's token log-probs, one no-grad packed forward of
            the training model (the same code as the loss's forward, so the first block's log-ratio is exactly 0).
        credit: `credit(unit) -> TurnCredit`: the configured method's credit of one unit, of its loss's kind (the
            units of a micro-batch are stacked, so they share it).
        device: where the micro-batches go.
    """

    prepare: Callable[[list[dict]], tuple[list, list]]
    score: Callable[[list[dict], list, list[list[Any]]], LeafScores]
    behaviour_logps: Callable[[PackedTrees], torch.Tensor]
    credit: Callable[[Any], TurnCredit]
    device: Any


@dataclass
class GenerationBatch:
    """One generation batch, grown, scored, credited and packed: the micro-batches TRL buffers (`batches`) and what
    the trainer logs about them."""

    prompts: list
    grown: Grown
    scores: LeafScores
    units: list
    batches: list[dict[str, torch.Tensor]]
    per_turn: list[TurnCredit]
    forward_tokens: int  # what the π_old forwards processed, padding included


def generation_batch(unit: RolloutUnit, ports: PipelinePorts, inputs: list[dict], num_chunks: int) -> GenerationBatch:
    """Algorithm 1's generation phase on one batch of dataset rows: grow and score (`grow_and_score`), then per
    micro-batch pack, π_old and credit (`micro_batches`)."""
    prompts, grown, scores, units = grow_and_score(unit, ports, inputs)
    batches, per_turn, forward_tokens = micro_batches(unit, ports, units, num_chunks)
    return GenerationBatch(prompts, grown, scores, units, batches, per_turn, forward_tokens)


def grow_and_score(unit: RolloutUnit, ports: PipelinePorts, inputs: list[dict]):
    """One unit per dataset row, grown, its leaves scored, built: (prompts, grown, scores, units). Nothing is packed
    yet, so the same units can be trained by several losses (`TreeTrainer.sample_trees`)."""
    prompts, roots = ports.prepare(inputs)
    grown = unit.grow(prompts, roots)
    scores = ports.score(inputs, prompts, grown.leaves)
    return prompts, grown, scores, unit.build(inputs, roots, grown.leaves, scores.for_credit)


def micro_batches(unit: RolloutUnit, ports: PipelinePorts, units: Sequence, num_chunks: int):
    """Split whole units into `num_chunks` micro-batches. Each is packed, gets π_old from the very packed forward that
    will train it (T6: a whole-batch forward pads differently and leaves ~1e-9 of noise, which Adam blows up when every
    reward of a block is equal), and its credit. Returns the batches, every unit's credit and the forward tokens."""
    size = len(units) // num_chunks
    batches, per_turn, forward_tokens = [], [], 0
    for start in range(0, len(units), size):
        chunk = units[start : start + size]
        packed = unit.pack(chunk)
        old_logps = ports.behaviour_logps(packed)
        unit.record_behaviour(packed, old_logps, chunk)
        credit_of_chunk = [ports.credit(u) for u in chunk]
        batch = {**packed.to(ports.device).to_dict(), "old_logps": old_logps}
        batch.update(TurnCredit.stack(credit_of_chunk, ports.device).to_dict())
        batches.append(batch)
        per_turn += credit_of_chunk
        forward_tokens += packed.num_forward_tokens
    return batches, per_turn, forward_tokens


@torch.no_grad()
def behaviour_logps(model, packed: PackedTrees, device, temperature: float) -> torch.Tensor:
    """π_old's token log-probs on `packed`: the loss's forward code (`packed_token_logps`), without gradients."""
    logps, _ = packed_token_logps(model, packed.to(device), temperature=temperature)
    return logps.detach()


# ------------------------------------------------------------------------------------------ per optimizer block


def loss_inputs(model, inputs: dict, temperature: float, compute_entropy: bool = False):
    """One packed forward of `model` over a micro-batch, flattened as the losses read it, and the trained tokens'
    entropies (each unique token once) with `compute_entropy`."""
    packed = PackedTrees.from_dict(inputs)
    logps, entropy = packed_token_logps(model, packed, temperature=temperature, compute_entropy=compute_entropy)
    batch = LossInputs.build(packed.turn_ids, logps, inputs["old_logps"], TurnCredit.from_dict(inputs))
    return batch, entropy[packed.turn_ids >= 0] if entropy is not None else None


def block_loss(batch: LossInputs, args) -> tuple[torch.Tensor, dict]:
    """The configured loss of one micro-batch (`trl_tree.methods.LOSSES`) and its metrics, with every method's mean
    |s_i|, the turns' log-ratio, under a name with "{block}" for the optimizer block the caller logs it at."""
    loss, loss_metrics = methods.LOSSES[args.loss].compute(batch, args)
    with torch.no_grad():
        s = losses.turn_mean_log_ratio(batch.logps, batch.old_logps, batch.turn_ids, batch.num_turns)
    loss_metrics["tree/abs_log_ratio/block_{block}"] = s.abs()
    return loss, loss_metrics
