"""One generation batch and its loss, as the paper's Algorithm 1 reads, without TRL (docs/design.md §2, "Layers").

    for a generation batch of prompts:
        grow one rollout unit per prompt                     unit.grow        (a tree; TreeFlex: K complete searches)
        score its leaves with the reward functions           ports.score      (a leaf; TreeFlex: a search)
        build the units from the leaves and their rewards    unit.build
        per micro-batch of whole units:
            pack them                                        unit.pack
            μ = π_old ← one no-grad packed forward (T6)      ports.behaviour_logps, unit.record_behaviour
            credit each unit's turns                         ports.credit
    then per optimizer block, per micro-batch:
        the turn-level loss of one packed forward            loss_inputs (the configured loss: methods.block_loss)

A micro-batch carries two policies' log-probs: "behaviour_logps", μ, the behaviour policy that sampled its units
(their credit reads it), and "old_logps", π_old, the policy at the start of its optimizer blocks, with "staleness"
per unit, the policy versions between the two. Here they are one policy (staleness 0); a batch grown ahead of the
trainer by an older copy of the policy is moved onto the trainer's π_old by `rebase_on_policy`, and each loss
trains it in its declared form (docs/design.md §3, "Stale samples").

The trainer (`trl_tree.trainer.base.TreeTrainer`) is an adapter: it builds the ports from GRPOTrainer's machinery
(TRL's reward computation, the chat template, the accelerator, the training model) and the unit from its
configuration, calls `generation_batch`, and logs what it returns. Everything it needs comes back as a value
(`GenerationBatch`, `LeafScores`), nothing through the trainer's attributes. A unit kind (`RolloutUnit`) is what
differs between the tree trainers (`trl_tree.core.tree_unit.TreeUnits`) and TreeFlex (`trl_tree.core.flex_unit.FlexUnits`): what
it grows, what its leaves are, how it packs, and whether π_old goes back into it.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch

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

    def pack(self, units: list) -> tuple[PackedTrees, dict[str, float]]:
        """One micro-batch of whole units, packed as the loss's forward reads it, and what packing it measured
        (metric name -> value; empty when the kind measures nothing), returned for the trainer to log."""

    def record_behaviour(self, packed: PackedTrees, behaviour_logps: torch.Tensor, units: list) -> None:
        """After the forward of the behaviour policy μ (the weights that sampled the units): write its log-probs back
        where the credit reads them, mask what must not be trained."""


@dataclass
class PipelinePorts:
    """What the pipeline needs of its owner, narrowly.

    Attributes:
        prepare: `prepare(inputs) -> (prompts, roots)`: reset environments, render and check the prompts.
        score: `score(inputs, prompts, leaves_per_unit) -> LeafScores`: the reward functions on every leaf.
        behaviour_logps: `behaviour_logps(packed) -> Tensor`: the token log-probs of the policy that sampled the
            units (μ, which is π_old here), one no-grad packed forward of that model (the same code as the loss's
            forward, so the first block's log-ratio is exactly 0).
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
    # what packing measured (metric name -> one value per micro-batch; "auto" packing: which layout it chose)
    pack_metrics: dict[str, list[float]] = field(default_factory=dict)


def generation_batch(unit: RolloutUnit, ports: PipelinePorts, inputs: list[dict], num_chunks: int) -> GenerationBatch:
    """Algorithm 1's generation phase on one batch of dataset rows: grow and score (`grow_and_score`), then per
    micro-batch pack, π_old and credit (`micro_batches`)."""
    prompts, grown, scores, units = grow_and_score(unit, ports, inputs)
    batches, per_turn, forward_tokens, pack_metrics = micro_batches(unit, ports, units, num_chunks)
    return GenerationBatch(prompts, grown, scores, units, batches, per_turn, forward_tokens, pack_metrics)


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
    reward of a block is equal), and its credit. The model that sampled the units runs that forward, so its
    log-probs are the behaviour policy's too: "behaviour_logps" equals "old_logps" and "staleness" is 0. Returns the
    batches, every unit's credit, the forward tokens and what packing measured (name -> one value per micro-batch)."""
    size = len(units) // num_chunks
    batches, per_turn, forward_tokens, pack_metrics = [], [], 0, {}
    for start in range(0, len(units), size):
        chunk = units[start : start + size]
        packed, measured = unit.pack(chunk)
        for name, value in measured.items():
            pack_metrics.setdefault(name, []).append(value)
        behaviour = ports.behaviour_logps(packed)
        unit.record_behaviour(packed, behaviour, chunk)
        credit_of_chunk = [ports.credit(u) for u in chunk]
        batch = {
            **packed.to(ports.device).to_dict(),
            "old_logps": behaviour,
            "behaviour_logps": behaviour.clone(),
            "staleness": torch.zeros(len(chunk), dtype=torch.long, device=behaviour.device),
        }
        batch.update(TurnCredit.stack(credit_of_chunk, ports.device).to_dict())
        batches.append(batch)
        per_turn += credit_of_chunk
        forward_tokens += packed.num_forward_tokens
    return batches, per_turn, forward_tokens, pack_metrics


@torch.no_grad()
def behaviour_logps(model, packed: PackedTrees, device, temperature: float) -> torch.Tensor:
    """`model`'s token log-probs on `packed`: the loss's forward code (`packed_token_logps`), without gradients. The
    sampling model's are μ's (and π_old's when it is the trainer's); the trainer's, for a producer's batch, are
    π_old's (`rebase_on_policy`)."""
    logps, _ = packed_token_logps(model, packed.to(device), temperature=temperature)
    return logps.detach()


def rebase_on_policy(batch: dict, old_logps: torch.Tensor, staleness: torch.Tensor) -> dict:
    """A micro-batch grown ahead of the trainer, moved onto the trainer's policy: a new dict, `batch` unchanged.

    An asynchronous producer runs `generation_batch` on its own copy of the policy, so its micro-batches come out of
    `micro_batches` with "old_logps" = its own forward, μ's, and credit computed from μ (the likelihood backup reads
    the behaviour policy's log-probs, T3). The trainer taking one passes its fresh π_old forward of the same packed
    micro-batch (`behaviour_logps(trainer_model, PackedTrees.from_dict(batch), ...)`) and each unit's staleness, the
    policy versions between μ and π_old: "behaviour_logps" ← the producer's "old_logps", "old_logps" ← `old_logps`,
    "staleness" ← `staleness`.

    A unit of staleness 0 was sampled with the trainer's own weights, so μ is π_old: its behaviour log-probs are the
    trainer's forward too. The producer's forward of the same weights may differ in the last bits (another thread
    count sums in another order), and T6 is why π_old is recomputed: so at staleness 0 the first block's log-ratio
    is exactly 0 against either policy, and every loss is exactly its synchronous self.

    Args:
        batch: a micro-batch as `micro_batches` wrote it (μ = π_old, staleness 0: a batch is rebased once).
        old_logps: π_old's log-probs, the layout of `batch["old_logps"]`.
        staleness: [N] int, one count ≥ 0 per unit of the micro-batch.
    """
    behaviour = batch["old_logps"]
    if "behaviour_logps" not in batch or "staleness" not in batch:
        raise ValueError(
            "rebase_on_policy takes a micro-batch of `pipeline.micro_batches` (with 'behaviour_logps' and "
            f"'staleness'); this one has the keys {sorted(batch)}."
        )
    if batch["staleness"].any() or not torch.equal(batch["behaviour_logps"], behaviour):
        raise ValueError(
            "This micro-batch's behaviour log-probs differ from its π_old already: it was rebased once. "
            "Rebase a producer's micro-batch once, as the trainer takes it."
        )
    if old_logps.shape != behaviour.shape:
        raise ValueError(
            f"old_logps has shape {tuple(old_logps.shape)} but the micro-batch's log-probs have "
            f"{tuple(behaviour.shape)}: compute π_old by the packed forward of this very micro-batch."
        )
    units = behaviour.shape[0]
    staleness = torch.as_tensor(staleness)
    if staleness.shape != (units,) or staleness.is_floating_point() or bool((staleness < 0).any()):
        raise ValueError(
            f"staleness must be {units} integer counts ≥ 0, one per unit of the micro-batch; got "
            f"{staleness.tolist()} ({staleness.dtype})."
        )
    old_logps = old_logps.detach().to(behaviour.device)
    fresh = (staleness == 0).to(behaviour.device).view(-1, *([1] * (behaviour.dim() - 1)))
    return {
        **batch,
        "old_logps": old_logps,
        "behaviour_logps": torch.where(fresh, old_logps, behaviour),
        "staleness": staleness.to(batch["staleness"].device, torch.long),
    }


# ------------------------------------------------------------------------------------------ per optimizer block


def loss_inputs(model, inputs: dict, temperature: float, compute_entropy: bool = False):
    """One packed forward of `model` over a micro-batch, flattened as the losses read it, and the trained tokens'
    entropies (each unique token once) with `compute_entropy`.

    The micro-batch carries π_old, μ and the staleness (`micro_batches`, `rebase_on_policy`). One with neither
    "behaviour_logps" nor "staleness" is a fresh batch of the contract before them (a resume state saved by an
    earlier trl-tree): μ = π_old, staleness 0. One with only one of the two is refused."""
    packed = PackedTrees.from_dict(inputs)
    stale_keys = [key for key in ("behaviour_logps", "staleness") if key in inputs]
    if len(stale_keys) == 1:
        raise ValueError(
            f"The micro-batch carries {stale_keys[0]!r} without "
            f"{({'behaviour_logps', 'staleness'} - set(stale_keys)).pop()!r}: a micro-batch carries both "
            "(`pipeline.micro_batches` writes them, `pipeline.rebase_on_policy` moves a stale one)."
        )
    logps, entropy = packed_token_logps(model, packed, temperature=temperature, compute_entropy=compute_entropy)
    batch = LossInputs.build(
        packed.turn_ids,
        logps,
        inputs["old_logps"],
        TurnCredit.from_dict(inputs),
        inputs.get("behaviour_logps"),
        inputs.get("staleness"),
    )
    return batch, entropy[packed.turn_ids >= 0] if entropy is not None else None
