"""TreeFlex's group of complete searches as the pipeline's unit, beside the tree's (`trl_tree.core.tree_unit`).

A task's K complete searches (`trl_tree.rollout.growing.flex_harness`) laid out for training: each causal block a
one-trajectory `RolloutTree` whose prompt is its context, turns numbered group-wide, and the group packed as one row
per block so that a group travels whole through TRL's splits (the design decisions are `trl_tree.trainer.presets.treeflex`'s
docstring). `FlexUnits` grows, packs and records behaviour for `trl_tree.core.pipeline` as `TreeUnits` does for trees.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor

from .packing import PackedTrees, pack_trees, pad_rows
from .pipeline import Grown
from .tree import RolloutTree

# ---------------------------------------------------------------------------------------------------------------
# A task's group as trainable blocks
# ---------------------------------------------------------------------------------------------------------------


@dataclass
class FlexGroup:
    """One task's K complete searches laid out for training.

    Turns are numbered group-wide: blocks in order (search by search, each search's blocks in its order, blocks
    without turns skipped), each block's turns in order. Every per-turn tensor below uses that order.

    Attributes:
        searches: the harness's searches; scores: their K terminal scores.
        trees: one single-trajectory `RolloutTree` per trained block (prompt = the block's context).
        block_offsets: the group-wide id of each tree's first turn.
        turn_search, turn_block, turn_role: per turn, its search (0..K−1), block (group-wide) and role index.
        penalties: Q_i ≤ 0 per turn; lengths: trained tokens per turn (0 for a masked truncated turn).
    """

    searches: list[Any]  # `trl_tree.rollout.growing.flex_harness.FlexSearch`
    scores: Tensor
    trees: list[RolloutTree]
    block_offsets: list[int]
    turn_search: Tensor
    turn_block: Tensor
    turn_role: Tensor
    penalties: Tensor
    lengths: Tensor
    masked_turns: list[int] = field(default_factory=list)

    @property
    def num_turns(self) -> int:
        return int(self.turn_search.numel())

    @classmethod
    def build(cls, searches: list[Any], scores: Tensor, roles: tuple[str, ...], extra_penalty=None,
              mask_truncated: bool = False) -> FlexGroup:
        """Lay out one group. `extra_penalty(search, block, turn_index) -> float` (≤ 0) adds to `Turn.penalty`."""
        trees, offsets, t_search, t_block, t_role, penalties, lengths, masked = [], [], [], [], [], [], [], []
        for s, search in enumerate(searches):
            for block in search.blocks:
                if not block.turns:
                    continue
                if block.role not in roles:
                    raise ValueError(f"A block has role {block.role!r}, not among the harness's roles {roles}.")
                if not block.context_ids:
                    raise ValueError(
                        f"A block of search {s} has an empty context: every block needs at least its rendered "
                        "context (the chat template's assistant header at least), which scores its first token."
                    )
                b = len(trees)
                offsets.append(len(t_search))
                trees.append(RolloutTree.from_trajectories(block.context_ids, [block.turns], [float(scores[s])]))
                for i, turn in enumerate(block.turns):
                    t_search.append(s)
                    t_block.append(b)
                    t_role.append(roles.index(block.role))
                    extra = 0.0 if extra_penalty is None else float(extra_penalty(search, block, i))
                    penalties.append(float(turn.penalty) + extra)
                    drop = mask_truncated and turn.truncated
                    if drop:
                        masked.append(len(t_search) - 1)
                    lengths.append(0 if drop else len(turn.action_ids))
        if not trees:
            raise ValueError("None of the task's searches has a block with a generated turn: nothing to train.")
        long = dict(dtype=torch.long)
        return cls(
            searches=searches, scores=torch.as_tensor(scores, dtype=torch.float64), trees=trees, block_offsets=offsets,
            turn_search=torch.tensor(t_search, **long), turn_block=torch.tensor(t_block, **long),
            turn_role=torch.tensor(t_role, **long), penalties=torch.tensor(penalties, dtype=torch.float64),
            lengths=torch.tensor(lengths, dtype=torch.float64), masked_turns=masked,
        )


def pack_groups(groups: list[FlexGroup], pad_token_id: int) -> PackedTrees:
    """[groups, max blocks, T]: row r of group n is its r-th block (a single causal path), turn ids group-wide.

    Each block is packed by `pack_trees` as a one-path tree, its turn ids shifted to group-wide ones, and the rows
    are stacked per group by `packing.pad_rows` (the padding convention of every packed layout); rows past a group's
    block count are padding (valid = 0, skipped by the forward). Masked turns (`FlexGroup.masked_turns`) get turn id
    and score index −1.
    """
    flat = pack_trees([tree for g in groups for tree in g.trees], pad_token_id, layout="tree")
    blocks = iter(range(flat.num_trees))  # the trees in group order, one per block
    rows = []
    for group in groups:
        rows.append([])
        for offset in group.block_offsets:
            row = flat.row(next(blocks))
            row["turn_ids"] = torch.where(row["turn_ids"] >= 0, row["turn_ids"] + offset, row["turn_ids"])
            rows[-1].append(row)
    packed = pad_rows(rows, pad_token_id)
    for n, group in enumerate(groups):
        if group.masked_turns:
            hit = torch.isin(packed.turn_ids[n], torch.tensor(group.masked_turns))
            packed.turn_ids[n][hit] = -1
            packed.score_index[n][hit] = -1
    return packed


class FlexUnits:
    """TreeFlex's unit for the pipeline (`trl_tree.core.pipeline.RolloutUnit`): per task, the harness's K complete
    searches (the leaves, scored like a tree's) laid out as one `FlexGroup`, packed one row per block.

    The behaviour log-probs are not written back: the search credit reads only the terminal scores and the turns'
    penalties, and truncated turns are already masked by `FlexGroup.build` / `pack_groups`.
    """

    def __init__(self, search: Callable[[list, list], list[list[Any]]], roles: Sequence[str], pad_id: int,
                 mask_truncated: bool, process_penalty):
        """`search(prompts, roots)`: per task, the harness's complete searches (`FlexSearch`; the trainer binds its
        harness and kit, `TreeFlexTrainer.rollout_unit`); `roles`: the harness's role names. Passed in, so that the
        core imports nothing of the rollout layer."""
        self.search, self.roles, self.pad_id = search, roles, pad_id
        self.mask_truncated, self.process_penalty = mask_truncated, process_penalty

    def grow(self, prompts: list, roots: list) -> Grown:
        searches_per_task = self.search(prompts, roots)
        if len(searches_per_task) != len(roots) or any(not s for s in searches_per_task):
            raise ValueError("The harness must return a non-empty list of complete searches for every task.")
        return Grown(searches_per_task)

    def build(self, inputs: list[dict], roots: list, leaves: list[list[Any]], rewards: list[Tensor]):
        """One group per task; `process_penalty(example, search, block, turn_index)` adds to each turn's penalty."""
        roles = tuple(self.roles)
        groups = []
        for example, searches, r in zip(inputs, leaves, rewards):
            def extra(search, block, i, example=example):
                return self.process_penalty(example, search, block, i)

            groups.append(FlexGroup.build(searches, r, roles, extra, self.mask_truncated))
        return groups

    def pack(self, groups: list[FlexGroup]) -> tuple[PackedTrees, dict[str, float]]:
        return pack_groups(groups, self.pad_id), {}  # one layout: nothing to measure

    def record_behaviour(self, packed: PackedTrees, behaviour_logps: Tensor, groups: list[FlexGroup]) -> None:
        return None


# ---------------------------------------------------------------------------------------------------------------
# Trainer
# ---------------------------------------------------------------------------------------------------------------
