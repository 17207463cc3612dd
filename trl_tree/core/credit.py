"""Turn-level credit on a rollout tree: pure functions, one per equation (docs/design.md §3).

Every function takes plain tensors (and a `RolloutTree` for its shape) and returns tensors; nothing here touches a
model. Values are indexed like `tree.turns` (unique turns in DFS order) unless said otherwise.

TreeOPSD (summary eqs; paper §2.3, §3):
    A_k  = (R_k − mean R) / std_sample(R)                             T1  `standardize`
    V_i  = Σ_c ω_ic V_c,  ω_ic = softmax_c log π_old(a_c | h_c)       T3  `likelihood_backup`
    τ    = (K − 1) / (ρ √K),  q_i = 1/2 + V_i / τ                     T4  `treeopsd_teacher`
A merged leaf's value is the mean of its occurrences' A_k (T2, `leaf_values`).

Every backup here is a softmax-weighted average over a turn's unique children, `V_i = Σ_c softmax_c(z_c) V_c`;
the methods differ only in the child logits z_c: the summed behaviour log-likelihood (TreeOPSD), log of the
child's multiplicity (AT2PO child-mean), the child's entropy plus that log (AT2PO child-softmax) or log of the leaf occurrences
below it (leaf-mean, TreeAdv's segment advantage). `softmax_backup` is that one mechanism.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

from .tree import RolloutTree

# ---------------------------------------------------------------------------------------------------------------
# Leaf statistics
# ---------------------------------------------------------------------------------------------------------------


def standardize(rewards: Tensor, *, ddof: int = 1, eps: float = 0.0, min_leaves: int = 2) -> Tensor:
    """T1: A_k = (R_k − mean R) / std(R) over the K terminal trajectories of one tree, duplicates included.

    TreeOPSD uses the sample std (ddof=1) and no epsilon; if every reward is exactly equal, every A_k is 0 (not NaN).
    AT2PO (A3) is `standardize(R, ddof=0, eps=1e-6)`.

    Raises:
        ValueError: fewer than `min_leaves` rewards (the sample std needs K ≥ 2), or a non-finite reward.
    """
    rewards = torch.as_tensor(rewards, dtype=torch.float64)
    if rewards.dim() != 1:
        raise ValueError(f"standardize expects a 1-D tensor of K rewards, got shape {tuple(rewards.shape)}.")
    if rewards.numel() < min_leaves:
        raise ValueError(
            f"A tree needs K ≥ {min_leaves} terminal trajectories to standardise rewards, got K = {rewards.numel()}: "
            "increase num_initial_rollouts (M) or num_branches (N)."
        )
    if not torch.isfinite(rewards).all():
        bad = int((~torch.isfinite(rewards)).nonzero()[0])
        raise ValueError(f"Reward of trajectory {bad} is {rewards[bad].item()}: rewards must be finite.")
    centered = rewards - rewards.mean()
    if bool((rewards == rewards[0]).all()):
        return torch.zeros_like(rewards)
    return centered / (rewards.std(correction=ddof) + eps)


def group_normalize(scores: Tensor) -> Tensor:
    """TreeFlex F1: (R − mean) / divisor over the group's terminal scores (`group_baseline`: the sample std, or 1
    when all scores are equal or there is one)."""
    scores = torch.as_tensor(scores, dtype=torch.float64)
    mean, divisor = group_baseline(scores)
    return (scores - mean) / divisor


def samuelson_bound(num_leaves: int) -> float:
    """|A_k| ≤ (K − 1)/√K for sample-standardised values (Samuelson's inequality); equality for one dissenter."""
    return (num_leaves - 1) / math.sqrt(num_leaves)


def leaf_values(tree: RolloutTree, leaf_advantages: Tensor) -> Tensor:
    """T2: each terminal turn's value is the mean of the A_k of the trajectories that end in it.

    Returns a tensor over `tree.turns` with the leaf values at terminal turns and 0 elsewhere.
    """
    leaf_advantages = torch.as_tensor(leaf_advantages, dtype=torch.float64)
    if leaf_advantages.numel() != tree.num_leaves:
        raise ValueError(
            f"Got {leaf_advantages.numel()} leaf advantages for a tree with K = {tree.num_leaves} trajectories."
        )
    leaf_of = torch.tensor(tree.leaf_of)
    sums = torch.zeros(tree.num_turns, dtype=torch.float64).index_add_(0, leaf_of, leaf_advantages)
    counts = multiplicities(tree)
    return torch.where(counts > 0, sums / counts.clamp(min=1), torch.zeros_like(sums))


# ---------------------------------------------------------------------------------------------------------------
# Tree shape as tensors
# ---------------------------------------------------------------------------------------------------------------


def parents(tree: RolloutTree) -> Tensor:
    """Parent index of every unique turn (-1 for first turns)."""
    return torch.tensor([t.parent for t in tree.turns], dtype=torch.long)


def multiplicities(tree: RolloutTree) -> Tensor:
    """How many trajectories end in each unique turn (0 for non-terminal turns)."""
    return torch.tensor([t.multiplicity for t in tree.turns], dtype=torch.float64)


def is_leaf(tree: RolloutTree) -> Tensor:
    return torch.tensor([t.is_leaf for t in tree.turns], dtype=torch.bool)


def action_logp_sums(tree: RolloutTree) -> Tensor:
    """log π_old(a_i | h_i) summed over each turn's whole actor span (T3's child logits)."""
    return torch.tensor([t.action_logp_sum for t in tree.turns], dtype=torch.float64)


def leaf_counts_below(tree: RolloutTree) -> Tensor:
    """Number of leaf occurrences (trajectories, duplicates counted) in each turn's subtree."""
    counts = multiplicities(tree).clone()
    par = parents(tree)
    for i in range(tree.num_turns - 1, -1, -1):  # DFS order: children after parents, so reverse is bottom-up
        if par[i] >= 0:
            counts[par[i]] += counts[i]
    return counts


def _depths(tree: RolloutTree) -> Tensor:
    return torch.tensor([t.depth for t in tree.turns], dtype=torch.long)


# ---------------------------------------------------------------------------------------------------------------
# Backups
# ---------------------------------------------------------------------------------------------------------------


def softmax_backup(tree: RolloutTree, leaf_value: Tensor, child_logits: Tensor) -> Tensor:
    """V_i = Σ_{c ∈ children(i)} softmax_c(z_c) · V_c, bottom-up; leaves keep `leaf_value`.

    The softmax runs over the *unique* children of each turn, vectorised one depth level at a time (a scatter
    log-sum-exp per level), so the cost is O(turns) tensor work, not a Python loop per child.

    Args:
        tree: the tree whose shape is used.
        leaf_value: values over `tree.turns`, read at terminal turns.
        child_logits: z_c over `tree.turns`: the logit each turn gets as a child of its parent.
    """
    leaf_value = torch.as_tensor(leaf_value, dtype=torch.float64)
    child_logits = torch.as_tensor(child_logits, dtype=torch.float64)
    n = tree.num_turns
    if leaf_value.numel() != n or child_logits.numel() != n:
        raise ValueError(f"Expected tensors over the tree's {n} unique turns.")
    par, depth, leaf = parents(tree), _depths(tree), is_leaf(tree)
    values = torch.where(leaf, leaf_value, torch.zeros_like(leaf_value))
    for d in range(int(depth.max()), 0, -1):
        child = (depth == d).nonzero().squeeze(1)
        p = par[child]
        z = child_logits[child]
        zmax = torch.full((n,), -math.inf, dtype=torch.float64).scatter_reduce(0, p, z, reduce="amax")
        w = torch.exp(z - zmax[p])
        norm = torch.zeros(n, dtype=torch.float64).index_add_(0, p, w)
        contrib = torch.zeros(n, dtype=torch.float64).index_add_(0, p, w * values[child])
        has_child = norm > 0
        values = torch.where(has_child & ~leaf, contrib / norm.clamp(min=1e-300), values)
    return values


def likelihood_backup(tree: RolloutTree, leaf_advantages: Tensor) -> Tensor:
    """T2–T3: TreeOPSD's likelihood-weighted backup.

    V_leaf = mean A_k of the trajectories ending there; V_i = Σ_c ω_ic V_c with ω_ic = softmax over the unique children
    c of i of log π_old(a_c | h_c), the log-likelihood summed over the child's whole actor span (not the per-token
    mean: a long, likely continuation should outweigh a short, unlikely one exactly as the behaviour policy does).
    """
    return softmax_backup(tree, leaf_values(tree, leaf_advantages), action_logp_sums(tree))


def _log_leaf_multiplicity(tree: RolloutTree) -> Tensor:
    """log m_c for a leaf child reached by m trajectories, 0 for any other turn: as a softmax logit offset it counts
    the leaf m times, as the unmerged tree of the m identical trajectories would."""
    return torch.where(is_leaf(tree), multiplicities(tree), torch.ones(tree.num_turns, dtype=torch.float64)).log()


def child_mean_backup(tree: RolloutTree, leaf_advantages: Tensor) -> Tensor:
    """AT2PO A4 child-mean: V_i = mean over children; a leaf child with multiplicity m counts m times."""
    return softmax_backup(tree, leaf_values(tree, leaf_advantages), _log_leaf_multiplicity(tree))


def leaf_mean_backup(tree: RolloutTree, leaf_advantages: Tensor) -> Tensor:
    """Leaf-mean: V_i = mean of the A_k of every trajectory through i (AT2PO A4; TreeAdv D2 segment advantage)."""
    return softmax_backup(tree, leaf_values(tree, leaf_advantages), leaf_counts_below(tree).log())


def entropy_softmax_backup(tree: RolloutTree, leaf_advantages: Tensor, turn_entropies: Tensor) -> Tensor:
    """AT2PO A4 child-softmax (default): V_i = Σ_c softmax_c(H_c) V_c over the children's turn entropies (A1).

    A leaf child reached by m identical trajectories counts m times, as in `child_mean_backup`: its logit is
    H_c + log m_c. AT2PO's tree keeps the m trajectories as m sibling leaves of equal entropy and value, and merging
    them (T2) must not change the credit; with equal entropies this backup is exactly child-mean. (TreeOPSD's T3
    instead softmaxes over unique children: its paper defines the backup on the merged tree.)
    """
    logits = torch.as_tensor(turn_entropies, dtype=torch.float64) + _log_leaf_multiplicity(tree)
    return softmax_backup(tree, leaf_values(tree, leaf_advantages), logits)


# ---------------------------------------------------------------------------------------------------------------
# Teachers
# ---------------------------------------------------------------------------------------------------------------


def treeopsd_temperature(num_leaves: int, rho: float) -> float:
    """T4: τ = (K − 1)/(ρ √K). With |V| ≤ (K−1)/√K (Samuelson), |V/τ| ≤ ρ, so q stays in [1/2 − ρ, 1/2 + ρ]."""
    if not 0.0 < rho < 0.5:
        raise ValueError(f"target_radius ρ must satisfy 0 < ρ < 1/2 (so that q stays in (0, 1)); got ρ = {rho}.")
    if num_leaves < 2:
        raise ValueError(f"TreeOPSD needs K ≥ 2 terminal trajectories per tree; got K = {num_leaves}.")
    return (num_leaves - 1) / (rho * math.sqrt(num_leaves))


def treeopsd_teacher(V: Tensor, num_leaves: int, rho: float) -> tuple[Tensor, float]:
    """T4: the frozen bounded Bernoulli teacher q_i = 1/2 + V_i/τ, τ = (K − 1)/(ρ √K). Returns (q, τ)."""
    tau = treeopsd_temperature(num_leaves, rho)
    return 0.5 + torch.as_tensor(V, dtype=torch.float64) / tau, tau


# ---------------------------------------------------------------------------------------------------------------
# Path aggregation: GRPO's seq-mean-token-mean over root-to-leaf paths, expressed on unique turns
# ---------------------------------------------------------------------------------------------------------------


def turn_lengths(tree: RolloutTree) -> Tensor:
    """L_i: the number of action tokens of each unique turn (what a turn trains when nothing is masked)."""
    return torch.tensor([t.num_action_tokens for t in tree.turns], dtype=torch.float64)


def path_turn_pairs(trees: RolloutTree | list[RolloutTree]) -> tuple[Tensor, Tensor, Tensor]:
    """The root-to-leaf paths of a batch of trees as flat index tensors, one entry per (trajectory, turn on it).

    Turns are numbered globally by concatenating the trees' `turns` in order (turn j of tree x has id
    Σ_{y<x} n_turns(y) + j, the `turn_ids` convention of `losses`), paths likewise (path k of tree x has id
    Σ_{y<x} K_y + k). A trajectory that duplicates another is its own path, as in a flat GRPO batch.

    Returns:
        pair_paths [n_pairs]: the path of each entry; pair_turns [n_pairs]: its unique turn;
        path_trees [n_paths]: the tree of each path.
    """
    trees = [trees] if isinstance(trees, RolloutTree) else list(trees)
    pair_paths, pair_turns, path_trees = [], [], []
    turn_offset = path_offset = 0
    for x, tree in enumerate(trees):
        lengths = torch.tensor([len(p) for p in tree.paths], dtype=torch.long)
        pair_paths.append(torch.repeat_interleave(torch.arange(tree.num_leaves) + path_offset, lengths))
        pair_turns.append(torch.tensor([i for p in tree.paths for i in p], dtype=torch.long) + turn_offset)
        path_trees.append(torch.full((tree.num_leaves,), x, dtype=torch.long))
        turn_offset += tree.num_turns
        path_offset += tree.num_leaves
    return torch.cat(pair_paths), torch.cat(pair_turns), torch.cat(path_trees)


def _pair_path_lengths(tree: RolloutTree, lengths: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """`path_turn_pairs(tree)`'s (pair_paths, pair_turns) and the trained length |p_k| of each pair's path."""
    pair_paths, pair_turns, _ = path_turn_pairs(tree)
    path_len = torch.zeros(tree.num_leaves, dtype=torch.float64).index_add_(0, pair_paths, lengths[pair_turns])
    return pair_paths, pair_turns, path_len[pair_paths]


def path_token_weights(tree: RolloutTree, lengths: Tensor | None = None) -> Tensor:
    """AT2PO A5 / GRPO seq-mean-token-mean over the K root-to-leaf paths, as a per-token weight of each unique turn.

    A flat GRPO batch of the tree's K trajectories computes (1/K) Σ_k (1/|p_k|) Σ_{t ∈ p_k} ℓ_t with
    |p_k| = Σ_{i ∈ p_k} L_i trained tokens. When ℓ_t does not depend on the path (per-token or per-turn ratios and
    advantages), training each unique token once with weight

        w_i = Σ_{k : i ∈ p_k} 1 / (K · |p_k|)

    gives the same loss and gradient: Σ_i w_i Σ_j ℓ_ij. The weights sum to one over the tree's trained tokens,
    Σ_i w_i L_i = 1, so the tree's loss is a weighted token mean (`losses.atpo_loss`, `losses.clipped_token_loss`).

    Args:
        lengths: L_i, trained tokens per unique turn (default: every action token; pass
            `losses.turn_token_counts(turn_ids, n)` when some turns are masked, e.g. truncated ones).
    """
    lengths = turn_lengths(tree) if lengths is None else torch.as_tensor(lengths, dtype=torch.float64)
    _, pair_turns, path_len = _pair_path_lengths(tree, lengths)
    per_pair = torch.where(path_len > 0, 1.0 / (tree.num_leaves * path_len.clamp(min=1e-300)), 0.0)
    return torch.zeros(tree.num_turns, dtype=torch.float64).index_add_(0, pair_turns, per_pair)


def path_credit(tree: RolloutTree, leaf_advantages: Tensor) -> Tensor:
    """No tree credit (AT2PO's "credit off" ablation; flat GRPO): every token takes its trajectory's A_k.

    A token shared by several paths gets one value, the path-weighted mean of their A_k with the weights of
    `path_token_weights`: A_i = Σ_{k∋i} A_k/(K|p_k|) / w_i. Trained with those weights, this reproduces the flat
    per-path gradient at θ_old exactly. Every path counts as if it had at least one token, so a turn whose paths
    have none still gets the mean of their A_k.
    """
    leaf_advantages = torch.as_tensor(leaf_advantages, dtype=torch.float64)
    pair_paths, pair_turns, path_len = _pair_path_lengths(tree, turn_lengths(tree))
    per_pair = 1.0 / (tree.num_leaves * path_len.clamp(min=1))
    zeros = torch.zeros(tree.num_turns, dtype=torch.float64)
    weight = zeros.index_add(0, pair_turns, per_pair)
    weighted = zeros.index_add(0, pair_turns, per_pair * leaf_advantages[pair_paths])
    return weighted / weight.clamp(min=1e-300)


def path_intervals(tree: RolloutTree) -> tuple[Tensor, Tensor, Tensor]:
    """The root-to-leaf paths through each turn as a DFS range: (path_lo, path_hi) per turn, and the path count K.

    Numbering the K trajectories by the DFS index of their leaf, the paths through turn i are exactly those whose
    leaf lies in i's subtree, a contiguous DFS range [path_lo_i, path_hi_i). Per-turn tensors travel in the trainer's
    per-turn batch layout where `path_turn_pairs`'s pairs would not; `pairs_from_intervals` expands them back.
    """
    leaves = torch.bincount(torch.tensor(tree.leaf_of, dtype=torch.long), minlength=tree.num_turns)
    lo = torch.cumsum(leaves, 0) - leaves
    hi = lo + leaf_counts_below(tree).long()
    return lo, hi, torch.tensor(tree.num_leaves)


def pairs_from_intervals(
    path_lo: Tensor, path_hi: Tensor, num_paths: Tensor, tree_ids: Tensor
) -> tuple[Tensor, Tensor, Tensor]:
    """`path_turn_pairs`'s (pair_paths, pair_turns, path_trees) of a batch from the per-turn ranges of
    `path_intervals` (turns numbered globally, `tree_ids` per turn, `num_paths` per tree). Path ids are global (tree
    x's paths follow those of trees 0..x−1) and renumbered in DFS order, which no loss depends on."""
    lo, hi, num_paths = path_lo.long(), path_hi.long(), num_paths.long()
    tree_ids = tree_ids.to(lo.device)
    counts = hi - lo
    first = lo + (torch.cumsum(num_paths, 0) - num_paths)[tree_ids]
    starts = torch.cumsum(counts, 0) - counts
    within = torch.arange(int(counts.sum()), device=lo.device) - torch.repeat_interleave(starts, counts)
    pair_paths = torch.repeat_interleave(first, counts) + within
    pair_turns = torch.repeat_interleave(torch.arange(lo.numel(), device=lo.device), counts)
    path_trees = torch.repeat_interleave(torch.arange(num_paths.numel(), device=lo.device), num_paths)
    return pair_paths, pair_turns, path_trees


def token_mean_weights(tree: RolloutTree, lengths: Tensor | None = None) -> Tensor:
    """Token mean over the tree's unique trained tokens: w_i = 1/L_x, L_x = Σ_i L_i (TreeOPSD's T5 weighting)."""
    lengths = turn_lengths(tree) if lengths is None else torch.as_tensor(lengths, dtype=torch.float64)
    total = lengths.sum()
    return torch.full((tree.num_turns,), 1.0 / float(total) if total > 0 else 0.0, dtype=torch.float64)


# ---------------------------------------------------------------------------------------------------------------
# TreeAdv (docs/design.md §3 D1–D3)
# ---------------------------------------------------------------------------------------------------------------


def segment_advantages(tree: RolloutTree, leaf_advantages: Tensor) -> Tensor:
    """TreeAdv D2: A^tok(n) = mean of the advantages of every leaf occurrence below segment n.

    D1 leaf advantages are `standardize(R)` (ddof=1). A leaf reached by m trajectories counts m times, so this is
    `leaf_mean_backup`: A^tok(n) = Σ_{k : n ∈ p_k} A_k / |{k : n ∈ p_k}|.
    """
    return leaf_mean_backup(tree, leaf_advantages)


def token_advantages(node_advantages: Tensor, turn_ids: Tensor) -> Tensor:
    """TreeAdv D3: each token takes the advantage of the unique segment (turn) that covers it; 0 where turn_id = -1."""
    node_advantages = torch.as_tensor(node_advantages)
    return torch.where(turn_ids >= 0, node_advantages[turn_ids.clamp(min=0)], 0.0)


# ---------------------------------------------------------------------------------------------------------------
# TreeFlex (docs/design.md §3 F1–F2)
# ---------------------------------------------------------------------------------------------------------------


def group_baseline(scores: Tensor) -> tuple[Tensor, Tensor]:
    """TreeFlex F1: (mean, divisor) of the group's terminal scores; divisor = sample std, or 1 if all are equal.

    `group_normalize(R) = (R − mean) / divisor`. Only terminal scores enter: process penalties never move either.
    """
    scores = torch.as_tensor(scores, dtype=torch.float64)
    if scores.dim() != 1 or scores.numel() == 0:
        raise ValueError(f"group_baseline expects a non-empty 1-D tensor of scores, got shape {tuple(scores.shape)}.")
    one = torch.ones((), dtype=torch.float64)
    if scores.numel() < 2 or bool((scores == scores[0]).all()):
        return scores.mean(), one
    return scores.mean(), scores.std(correction=1)


def process_advantages(
    rewards: Tensor, penalties_per_turn: Tensor, turn_to_search: Tensor, mode: str = "pre_norm"
) -> Tensor:
    """TreeFlex F2: per-turn advantages of one group of K complete searches with turn-level process penalties.

        pre_norm  (default):  A_i = (R_{s(i)} + Q_i − mean R) / divisor
        post_norm:            A_i = (R_{s(i)} − mean R) / divisor + Q_i

    R are the K terminal scores (one per search, the group members), Q_i ≤ 0 the penalty of turn i (0 for most turns)
    and s(i) the search turn i belongs to. mean and divisor come from the terminal scores only (F1, `group_baseline`),
    so a penalty changes only its own turn's tokens, never the baseline of the others; with equal scores the divisor
    is 1 and a penalty keeps its original scale. Without penalties every turn of a search has the search's advantage.

    Returns:
        A [n_turns], indexed like `penalties_per_turn`.
    """
    if mode not in ("pre_norm", "post_norm"):
        raise ValueError(f"mode must be 'pre_norm' or 'post_norm', got {mode!r}.")
    rewards = torch.as_tensor(rewards, dtype=torch.float64)
    penalties = torch.as_tensor(penalties_per_turn, dtype=torch.float64)
    search = torch.as_tensor(turn_to_search, dtype=torch.long)
    if penalties.shape != search.shape:
        raise ValueError(
            f"penalties_per_turn {tuple(penalties.shape)} and turn_to_search {tuple(search.shape)} must match."
        )
    if (penalties > 0).any():
        bad = int((penalties > 0).nonzero()[0])
        raise ValueError(f"Process penalties must be ≤ 0 (TreeFlex F2); turn {bad} has Q = {penalties[bad].item()}.")
    if search.numel() and (search.min() < 0 or search.max() >= rewards.numel()):
        raise ValueError(f"turn_to_search must index the {rewards.numel()} searches of the group.")
    mean, divisor = group_baseline(rewards)
    if mode == "pre_norm":
        return (rewards[search] + penalties - mean) / divisor
    return (rewards[search] - mean) / divisor + penalties
