"""Turn-level losses on flattened per-token tensors: pure functions, one per method (DESIGN §3, §4).

Conventions shared by every function:
    logps, old_logps   [n_tokens]  log π_θ and log π_old of each token (old is detached here)
    turn_ids           [n_tokens]  global index of the token's unique turn, -1 for tokens that are not trained
                                   (prompt, observations, padding, masked turns)
    per-turn tensors   [n_turns]   indexed by those turn ids
    tree_ids           [n_turns]   which tree each turn belongs to; the batch loss is the mean over trees.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor


def _trained(turn_ids: Tensor) -> Tensor:
    return turn_ids >= 0


def turn_token_counts(turn_ids: Tensor, num_turns: int) -> Tensor:
    """L_i: the number of trained actor tokens of each unique turn."""
    mask = _trained(turn_ids)
    return torch.zeros(num_turns, dtype=torch.float64, device=turn_ids.device).index_add_(
        0, turn_ids[mask], torch.ones(int(mask.sum()), dtype=torch.float64, device=turn_ids.device)
    )


def turn_sum(values: Tensor, turn_ids: Tensor, num_turns: int) -> Tensor:
    """Σ_j values_ij over each turn's trained tokens (differentiable)."""
    mask = _trained(turn_ids)
    out = values.new_zeros(num_turns)
    return out.index_add(0, turn_ids[mask], values[mask])


def turn_mean_log_ratio(logps: Tensor, old_logps: Tensor, turn_ids: Tensor, num_turns: int) -> Tensor:
    """T5: s_i = (1/L_i) Σ_j (log π_θ(a_ij) − log π_old(a_ij)), the log of the turn's geometric-mean ratio."""
    counts = turn_token_counts(turn_ids, num_turns).to(logps.dtype)
    return turn_sum(logps - old_logps.detach(), turn_ids, num_turns) / counts.clamp(min=1)


def _per_tree(tree_ids: Tensor, num_trees: int | None) -> int:
    return int(tree_ids.max()) + 1 if num_trees is None else num_trees


def bernoulli_kl_from_logit(q: Tensor, s: Tensor) -> Tensor:
    """KL(Ber(q) ‖ Ber(σ(s))) computed from the logit s with log-sigmoid, so it stays exact when σ(s) saturates.

    KL = q (log q − log σ(s)) + (1 − q)(log(1 − q) − log σ(−s)); ∂KL/∂s = σ(s) − q.
    """
    q = q.to(s.dtype)
    return (
        torch.xlogy(q, q)
        + torch.xlogy(1 - q, 1 - q)
        - q * F.logsigmoid(s)
        - (1 - q) * F.logsigmoid(-s)
    )


def treeopsd_loss(
    logps: Tensor,
    old_logps: Tensor,
    turn_ids: Tensor,
    q: Tensor,
    tau: Tensor | float,
    tree_ids: Tensor,
    num_trees: int | None = None,
) -> Tensor:
    """T5: TreeOPSD's turn-level Bernoulli forward-KL to the frozen teacher, mean over trees.

        L_x = (τ_x / L_x) Σ_{i ∈ x} L_i · KL(Ber(q_i) ‖ Ber(σ(s_i))),   L_x = Σ_{i ∈ x} L_i over unique turns.

    Per-token gradient ∂L_x/∂log π_θ(a_ij) = (τ/L_x)(p_i − q_i): at θ = θ_old (p = 1/2) it is −V_i/L_x, the tree
    policy gradient (Theorem 2); it vanishes at p = q and reverses sign past it.

    Args:
        tau: τ per tree ([n_trees]) or one float for every tree.
    """
    num_turns = q.numel()
    n_trees = _per_tree(tree_ids, num_trees)
    s = turn_mean_log_ratio(logps, old_logps, turn_ids, num_turns)
    lengths = turn_token_counts(turn_ids, num_turns).to(s.dtype)
    kl = bernoulli_kl_from_logit(q.detach(), s)
    tree_tokens = torch.zeros(n_trees, dtype=s.dtype, device=s.device).index_add(0, tree_ids, lengths)
    tree_kl = torch.zeros(n_trees, dtype=s.dtype, device=s.device).index_add(0, tree_ids, lengths * kl)
    tau = torch.as_tensor(tau, dtype=s.dtype, device=s.device).expand(n_trees)
    return (tau * tree_kl / tree_tokens.clamp(min=1)).mean()


def treepo_loss(
    logps: Tensor,
    old_logps: Tensor,
    turn_ids: Tensor,
    V: Tensor,
    tree_ids: Tensor,
    num_trees: int | None = None,
) -> Tensor:
    """T7: TreePO's fixed-credit surrogate, mean over trees.

        L_x = −(1/L_x) Σ_{i ∈ x} V_i Σ_j (log π_θ(a_ij) − log π_old(a_ij)).

    Its gradient is −V_i/L_x per token in every block: equal to TreeOPSD's at θ = θ_old, but it never stops.
    """
    num_turns = V.numel()
    n_trees = _per_tree(tree_ids, num_trees)
    ratio_sum = turn_sum(logps - old_logps.detach(), turn_ids, num_turns)
    lengths = turn_token_counts(turn_ids, num_turns).to(ratio_sum.dtype)
    tree_tokens = torch.zeros(n_trees, dtype=ratio_sum.dtype, device=ratio_sum.device).index_add(0, tree_ids, lengths)
    per_tree = torch.zeros(n_trees, dtype=ratio_sum.dtype, device=ratio_sum.device).index_add(
        0, tree_ids, V.detach().to(ratio_sum.dtype) * ratio_sum
    )
    return (-per_tree / tree_tokens.clamp(min=1)).mean()
