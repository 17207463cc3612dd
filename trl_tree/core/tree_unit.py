"""The rollout tree as the pipeline's unit (`trl_tree.core.pipeline.RolloutUnit`): grown by a sampler, one per prompt.

Its leaves are the sampler's branches (`rollout.turn_loop.Branch`), one trajectory each; the unit built from them is a
`RolloutTree` with the leaves' rewards; it packs in the configured layout, and the behaviour policy's log-probs μ (the
packed forward of the weights that sampled it) are written back into its turns, where the likelihood backup of
TreeOPSD's credit reads them (T3).
"""

from __future__ import annotations

from collections.abc import Callable
from contextlib import AbstractContextManager
from typing import Any

import torch

from .packing import PackedTrees, pack_cheapest, pack_trees
from .pipeline import Grown
from .tree import RolloutTree


class TreeUnits:
    """Trees grown by `sampler`, one rollout session per generation batch.

    Args:
        sampler: a tree sampler (`trl_tree.methods.SAMPLERS`): `sample(roots) -> SampledTrees`, the branches per
            root and what the sampler measured growing them.
        session: `session()`, the context one generation batch grows in: the engine's rollout session
            (`trl_tree.rollout.generating.engine.rollout_session(engine)`, where a backend drops the state valid only for the
            current weights). Passed in, so that the core imports nothing of the rollout layer.
        pad_id: the padding id; layout: `TreeConfig.packing` ("auto": the cheaper forward for `model_config`).
        mask_truncated: GRPO's `mask_truncated_completions` (`mask_truncated_turns`).
    """

    def __init__(self, sampler, session: Callable[[], AbstractContextManager], pad_id: int, layout: str,
                 model_config=None, mask_truncated: bool = False):
        self.sampler, self.session, self.pad_id = sampler, session, pad_id
        self.layout, self.model_config, self.mask_truncated = layout, model_config, mask_truncated

    def grow(self, prompts: list, roots: list) -> Grown:
        """One tree's branches per root. A branch whose environment disagrees with its history (a diverged replay) is
        no leaf: its context and its world differ, so neither its reward nor its turns' credit mean anything
        (`replay_divergence="drop"`)."""
        with self.session():
            branches_per_tree = self.sampler.sample(roots)
        diverged = [sum(b.diverged_at is not None for b in branches) for branches in branches_per_tree]
        kept = [[b for b in branches if b.diverged_at is None] for branches in branches_per_tree]
        return Grown(kept, diverged, branches_per_tree.stats)

    def build(self, inputs: list[dict], roots: list, leaves: list[list[Any]], rewards: list[torch.Tensor]):
        return [
            RolloutTree.from_trajectories(root.prompt_ids, [b.turns for b in branches], r.tolist())
            for root, branches, r in zip(roots, leaves, rewards)
        ]

    def pack(self, trees: list[RolloutTree]) -> tuple[PackedTrees, dict[str, float]]:
        """One micro-batch of trees in the configured layout ("auto": the cheaper forward for this model, with
        `tree/packed_as_tree` saying which it chose), and what packing measured, for the trainer to log."""
        if self.layout == "auto":
            packed = pack_cheapest(trees, self.pad_id, self.model_config)
            return packed, {"tree/packed_as_tree": float(packed.input_ids.shape[1] == 1)}
        return pack_trees(trees, self.pad_id, layout=self.layout), {}

    def record_behaviour(self, packed: PackedTrees, behaviour_logps: torch.Tensor, trees: list[RolloutTree]) -> None:
        """μ's log-probs written back into each tree's turns (for the likelihood backup), then the truncated turns
        masked. They replace the sampler's own: the likelihood weights are the packed forward's, as the loss's
        log-ratio is (a sampling engine's log-probs of the same weights differ in precision, vLLM's most). The forward
        is the sampling model's, so a tree grown ahead of the trainer keeps its behaviour policy's credit, whatever
        π_old the trainer later measures its loss against (`pipeline.rebase_on_policy`)."""
        cpu = behaviour_logps.detach().float().cpu()
        for n, tree in enumerate(trees):
            mask = packed.turn_ids[n] >= 0
            ids, values = packed.turn_ids[n][mask], cpu[n][mask]
            order = torch.argsort(ids, stable=True)
            counts = torch.bincount(ids, minlength=tree.num_turns).tolist()
            for turn, chunk in zip(tree.turns, torch.split(values[order], counts)):
                turn.action_logps = chunk.tolist()
        if self.mask_truncated:
            mask_truncated_turns(packed, trees)


def mask_truncated_turns(packed: PackedTrees, trees: list[RolloutTree]) -> None:
    """GRPO's `mask_truncated_completions` on a tree: GRPO masks every token of a truncated completion, so a turn is
    context, not trained, unless some trajectory through it finished uncut (GRPO would train those tokens through that
    completion). A turn cut by the budget is masked, and so is a complete turn (a tool call) that only truncated
    trajectories pass: otherwise the truncated leaves' rewards would still train it, and a batch of only truncated
    trajectories would not give GRPO's zero loss and zero gradient."""
    for n, tree in enumerate(trees):
        finished = {i for path in tree.paths if not any(tree.turns[j].truncated for j in path) for i in path}
        truncated = [i for i in range(tree.num_turns) if i not in finished]
        if truncated:
            hit = torch.isin(packed.turn_ids[n], torch.tensor(truncated, device=packed.turn_ids.device))
            packed.turn_ids[n][hit] = -1
            packed.score_index[n][hit] = -1
