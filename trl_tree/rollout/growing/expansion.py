"""AT2PO's entropy-guided tree expansion: which turns to branch from next (docs/design.md §3 A1–A2). Pure node selection.

One expansion round of AT2PO (M initial trajectories, L rounds, K branches per round):

    H_i = (1/L_i) Σ_j H(a_ij)                                   A1  turn entropy (`tree_turn_entropies`)
    S_i = H_i − α · max(0, |children(parent(i))| − 1),  α = 0.05   A2  node score (`node_scores`)
    select the top-K candidates by S (candidates: non-leaf turns)      `select_expansion_turns`

A selected turn i is **re-sampled from its own pre-turn history**: the sampler restarts a trajectory through i just
before turn i (`Branch.restart_at(depth_i)`, see `expansion_anchor`), regenerates turn i and continues to a terminal
turn. The new branch is therefore a *sibling* of i (a child of parent(i), or of the prompt for a first turn), which
is why the penalty counts i's siblings: a parent that already has many children is penalised, and each new branch
raises the penalty of its siblings in later rounds.

Nothing here touches a model or the environment; the sampler turns the selected indices into branches.
"""

from __future__ import annotations

import random

import torch
from torch import Tensor

from ...core.losses import turn_entropy
from ...core.tree import RolloutTree

SIBLING_PENALTY = 0.05


def tree_turn_entropies(tree: RolloutTree) -> Tensor:
    """A1 on a tree: H_i = mean of turn i's stored per-token entropies (`Turn.entropies`), over `tree.turns`
    (`losses.turn_entropy` of the tree's tokens).

    Raises:
        ValueError: a turn was generated without per-token entropies.
    """
    missing = [i for i, turn in enumerate(tree.turns) if turn.entropies is None]
    if missing:
        raise ValueError(
            f"Turns {missing[:5]} carry no per-token entropies: generate with per-token entropies (the "
            "engine's `with_scores=True`) to use entropy-guided expansion, or use mode='random'."
        )
    lengths = torch.tensor([len(t.entropies) for t in tree.turns], dtype=torch.long)
    values = torch.tensor([h for t in tree.turns for h in t.entropies], dtype=torch.float64)
    return turn_entropy(values, torch.repeat_interleave(torch.arange(tree.num_turns), lengths), tree.num_turns)


def sibling_counts(tree: RolloutTree) -> Tensor:
    """|children(parent(i))| for every unique turn, itself included; the prompt is the parent of first turns."""
    parent = torch.tensor([t.parent for t in tree.turns], dtype=torch.long)
    children = torch.bincount(parent + 1, minlength=tree.num_turns + 1)  # slot 0 is the prompt
    return children[parent + 1]


def expansion_candidates(tree: RolloutTree) -> Tensor:
    """A2 candidates: the non-leaf turns (a terminal turn is never an expansion point). Bool over `tree.turns`."""
    return torch.tensor([not t.is_leaf for t in tree.turns], dtype=torch.bool)


def node_scores(tree: RolloutTree, turn_entropies: Tensor, alpha: float = SIBLING_PENALTY) -> Tensor:
    """A2: S_i = H_i − α · max(0, |children(parent(i))| − 1), over `tree.turns` (α = 0.05 in AT2PO)."""
    turn_entropies = torch.as_tensor(turn_entropies, dtype=torch.float64)
    if turn_entropies.shape != (tree.num_turns,):
        raise ValueError(f"Expected {tree.num_turns} turn entropies, got shape {tuple(turn_entropies.shape)}.")
    if not torch.isfinite(turn_entropies).all():
        raise ValueError("Turn entropies must be finite.")
    return turn_entropies - alpha * (sibling_counts(tree) - 1).clamp(min=0).to(torch.float64)


def select_expansion_turns(
    tree: RolloutTree,
    turn_entropies: Tensor | None,
    k: int,
    alpha: float = SIBLING_PENALTY,
    rng: torch.Generator | random.Random | None = None,
    mode: str = "entropy",
) -> list[int]:
    """A2: the turns to branch from in one expansion round, as indices into `tree.turns`.

    mode="entropy": the top-k candidates (non-leaf turns) by S_i = H_i − α · max(0, |children(parent(i))| − 1),
    highest first; ties go to the earlier turn in DFS order. mode="random": k candidates drawn uniformly without
    replacement (the "random tree search" arm of AT2PO's ablation; `turn_entropies` is ignored and may be None).

    Each selected turn is distinct. When there are fewer than k candidates (e.g. every trajectory has one turn), all
    of them are returned and the sampler decides how to spend the rest of its budget (e.g. resample from the prompt).
    Each selected turn i is re-sampled from its own pre-turn history, so its new branch becomes i's sibling.

    Args:
        turn_entropies: H_i over `tree.turns` (`tree_turn_entropies`, or A1 `losses.turn_entropy` from logits).
        rng: a `torch.Generator` or `random.Random` for mode="random" (the global generator if None).
    """
    if mode not in ("entropy", "random"):
        raise ValueError(f"mode must be 'entropy' or 'random', got {mode!r}.")
    if k < 0:
        raise ValueError(f"k must be ≥ 0, got {k}.")
    candidates = expansion_candidates(tree).nonzero().squeeze(1)
    n = min(k, candidates.numel())
    if mode == "random":
        if isinstance(rng, random.Random):
            return sorted(rng.sample(candidates.tolist(), n)) if n else []
        return sorted(candidates[torch.randperm(candidates.numel(), generator=rng)[:n]].tolist())
    scores = node_scores(tree, turn_entropies, alpha)[candidates]
    order = torch.sort(scores, descending=True, stable=True).indices[:n]
    return candidates[order].tolist()


def expansion_anchor(tree: RolloutTree, turn: int) -> tuple[int, int]:
    """Where to restart for a selected turn: (trajectory k through it, position t of the turn on k's path).

    Restarting trajectory k before its turn t (`Branch.restart_at(t)`) keeps turns 0..t−1 — turn i's pre-turn
    history, including the environment as it was then — and regenerates turn t: a sibling of turn i.
    """
    for k, path in enumerate(tree.paths):
        if turn in path:
            return k, path.index(turn)
    raise ValueError(f"Turn {turn} lies on no trajectory of the tree (it has {tree.num_turns} turns).")
