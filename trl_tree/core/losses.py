"""Turn-level losses on flattened per-token tensors: pure functions, one per method (docs/design.md §3, §4).

Conventions shared by every function:
    logps, old_logps   [n_tokens]  log π_θ and log π_old of each token (old is detached here)
    turn_ids           [n_tokens]  global index of the token's unique turn, -1 for tokens that are not trained
                                   (prompt, observations, padding, masked turns)
    per-turn tensors   [n_turns]   indexed by those turn ids
    tree_ids           [n_turns]   which tree each turn belongs to; the batch loss is the mean over trees.
    importance_weights             the decoupled form's truncated weights min(π_old/μ, C) for a tree sampled by an
                                   older behaviour policy μ (detached; per token, or per turn for the losses with one
                                   ratio per turn): `truncated_importance_weights`, `turn_importance_weights`. None
                                   (the default) is a fresh sample, μ = π_old, every weight 1 (docs/design.md §3,
                                   "Stale samples").
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


def truncated_importance_weights(old_logps: Tensor, behaviour_logps: Tensor, cap: float) -> Tensor:
    """Stale samples, per token: w_t = min(π_old(a_t) / μ(a_t), C), detached (decoupled PPO's correction; verl's
    `rollout_is_weights`, TRL's `token_truncate`).

    μ is the behaviour policy that sampled the token, π_old the policy at the start of the batch's optimizer blocks;
    for a fresh sample μ = π_old and every w_t is exactly 1 (C ≥ 1), so a weighted loss equals the unweighted one.
    """
    return (old_logps.detach() - behaviour_logps.detach()).exp().clamp(max=cap)


def turn_importance_weights(
    old_logps: Tensor, behaviour_logps: Tensor, turn_ids: Tensor, num_turns: int, cap: float
) -> Tensor:
    """Stale samples, per turn: w_i = min(exp((1/L_i) Σ_j log(π_old(a_ij) / μ(a_ij))), C), detached.

    The turn's geometric-mean weight, for the losses that take one ratio per turn (ATPO A5, TreeOPSD's decoupled
    form): the same per-token mean that makes their ratio r_i, so a turn's weight does not compound with its length.
    """
    return turn_mean_log_ratio(old_logps.detach(), behaviour_logps, turn_ids, num_turns).exp().clamp(max=cap)


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
    keep: Tensor | None = None,
    importance_weights: Tensor | None = None,
) -> Tensor:
    """T5: TreeOPSD's turn-level Bernoulli forward-KL to the frozen teacher, mean over trees.

        L_x = (τ_x / L_x) Σ_{i ∈ x} L_i · KL(Ber(q_i) ‖ Ber(σ(s_i))),   L_x = Σ_{i ∈ x} L_i over unique turns.

    Per-token gradient ∂L_x/∂log π_θ(a_ij) = (τ/L_x)(p_i − q_i): at θ = θ_old (p = 1/2) it is −V_i/L_x, the tree
    policy gradient (Theorem 2); it vanishes at p = q and reverses sign past it.

    Args:
        tau: τ per tree ([n_trees]) or one float for every tree.
        keep: optional [n_turns] bool: only these turns' KL terms enter the sum (the others get no gradient); L_x
            still counts every turn, so a kept turn's gradient is the one above. None: every turn (T5 as written).
        importance_weights: optional [n_turns] w_i multiplying each turn's KL term: the decoupled form
            (`old_logps` = π_old, w_i = `turn_importance_weights`), an ablation. TreeOPSD as its paper defines it
            passes the behaviour policy μ as `old_logps` and no weights (docs/design.md §3, "Stale samples").
    """
    num_turns = q.numel()
    n_trees = _per_tree(tree_ids, num_trees)
    s = turn_mean_log_ratio(logps, old_logps, turn_ids, num_turns)
    lengths = turn_token_counts(turn_ids, num_turns).to(s.dtype)
    kl = bernoulli_kl_from_logit(q.detach(), s)
    if keep is not None:
        kl = torch.where(keep.to(kl.device), kl, torch.zeros_like(kl))
    if importance_weights is not None:
        kl = kl * importance_weights.detach().to(kl)
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
    importance_weights: Tensor | None = None,
) -> Tensor:
    """T7: TreePO's fixed-credit surrogate, mean over trees.

        L_x = −(1/L_x) Σ_{i ∈ x} V_i Σ_j w_ij (log π_θ(a_ij) − log π_old(a_ij)),   w_ij = 1 for a fresh tree.

    Its gradient is −V_i/L_x per token in every block: equal to TreeOPSD's at θ = θ_old, but it never stops. A
    stale tree's tokens carry `importance_weights` w_ij = min(π_old/μ, C) per token (the decoupled form).
    """
    num_turns = V.numel()
    n_trees = _per_tree(tree_ids, num_trees)
    log_ratio = logps - old_logps.detach()
    if importance_weights is not None:
        log_ratio = log_ratio * importance_weights.detach().to(log_ratio)
    ratio_sum = turn_sum(log_ratio, turn_ids, num_turns)
    lengths = turn_token_counts(turn_ids, num_turns).to(ratio_sum.dtype)
    tree_tokens = torch.zeros(n_trees, dtype=ratio_sum.dtype, device=ratio_sum.device).index_add(0, tree_ids, lengths)
    per_tree = torch.zeros(n_trees, dtype=ratio_sum.dtype, device=ratio_sum.device).index_add(
        0, tree_ids, V.detach().to(ratio_sum.dtype) * ratio_sum
    )
    return (-per_tree / tree_tokens.clamp(min=1)).mean()


def zero_credit_turns(V: Tensor) -> Tensor:
    """The turns with no credit, V_i = 0 (every turn of a tree without a reward spread): TreeOPSD's teacher there is
    q_i = 1/2 (T4), so its KL pulls them back toward π_old, while TreePO's surrogate (T7) gives them no gradient."""
    return V == 0


def zero_credit_anchor(
    logps: Tensor,
    old_logps: Tensor,
    turn_ids: Tensor,
    V: Tensor,
    tau: Tensor | float,
    tree_ids: Tensor,
    num_trees: int | None = None,
    importance_weights: Tensor | None = None,
) -> Tensor:
    """The part of T5 that TreeOPSD's zero-credit turns contribute, on its own: a q = 1/2 anchor, mean over trees.

        A_x = (τ_x / L_x) Σ_{i ∈ x, V_i = 0} L_i · KL(Ber(1/2) ‖ Ber(σ(s_i))),   L_x over every unique turn of x.

    Per-token gradient ∂A_x/∂log π_θ(a_ij) = (τ/L_x)(p_i − 1/2) on those turns (0 elsewhere): descent moves each
    by τ(1/2 − p_i)/L_x, back toward s_i = 0. TreePO's loss plus this anchor is TreePO with TreeOPSD's pull on
    zero-credit turns; TreeOPSD's loss with `keep = V ≠ 0` is TreeOPSD without it (an ablation of T5's two parts).
    `importance_weights`: per turn, as `treeopsd_loss` takes them.
    """
    half = torch.full_like(V, 0.5, dtype=torch.float64)
    return treeopsd_loss(logps, old_logps, turn_ids, half, tau, tree_ids, num_trees=num_trees,
                         keep=zero_credit_turns(V), importance_weights=importance_weights)


# ---------------------------------------------------------------------------------------------------------------
# Shared pieces of the clipped surrogates
# ---------------------------------------------------------------------------------------------------------------


def clipped_surrogate(ratio: Tensor, advantages: Tensor, epsilon_low: float, epsilon_high: float) -> Tensor:
    """PPO's clipped objective min(r·A, clip(r, 1 − ε_low, 1 + ε_high)·A), elementwise (to be maximised)."""
    return torch.minimum(ratio * advantages, ratio.clamp(1 - epsilon_low, 1 + epsilon_high) * advantages)


def _num_weighted_turns(advantages: Tensor, turn_weights: Tensor) -> int:
    """The batch's unique-turn count for the turn-weighted surrogates (`atpo_loss`, `clipped_token_loss`).

    It is read off A_i, one entry per unique turn; w_i must match it, since both are indexed by the tokens' turn ids.
    The two losses share their parameter list on purpose: the trainer swaps one for the other (the "atpo" and "grpo"
    entries of `trl_tree.methods.LOSSES`), which is AT2PO's ablation.
    """
    num_turns = advantages.numel()
    if turn_weights.numel() != num_turns:
        raise ValueError(
            f"turn_weights has {turn_weights.numel()} entries but the batch has {num_turns} unique turns."
        )
    return num_turns


def _weighted_tree_mean(per_turn_total: Tensor, tree_ids: Tensor, num_trees: int | None) -> Tensor:
    """Σ over each tree's turns of the (already weighted) per-turn totals, then the mean over trees."""
    n_trees = _per_tree(tree_ids, num_trees)
    per_tree = per_turn_total.new_zeros(n_trees).index_add(0, tree_ids.to(per_turn_total.device), per_turn_total)
    return per_tree.mean()


# ---------------------------------------------------------------------------------------------------------------
# AT2PO (docs/design.md §3 A1, A5)
# ---------------------------------------------------------------------------------------------------------------


def token_entropy_from_logits(logits: Tensor) -> Tensor:
    """H_t = −Σ_v π(v | h_t) log π(v | h_t), exact from the logits [..., V] -> [...] (the per-token input of A1).

    Computed in at least float32; masked vocabulary entries (logit −inf) contribute 0.
    """
    logp = torch.log_softmax(logits.to(torch.promote_types(logits.dtype, torch.float32)), dim=-1)
    p = logp.exp()
    return torch.where(p > 0, -p * logp, torch.zeros_like(p)).sum(-1)


def turn_entropy(token_entropies: Tensor, turn_ids: Tensor, num_turns: int) -> Tensor:
    """AT2PO A1: H_i = (1/L_i) Σ_j H(a_ij), the mean per-token entropy over each turn's trained tokens (0 if none)."""
    counts = turn_token_counts(turn_ids, num_turns).to(token_entropies.dtype)
    return turn_sum(token_entropies, turn_ids, num_turns) / counts.clamp(min=1)


def atpo_loss(
    logps: Tensor,
    old_logps: Tensor,
    turn_ids: Tensor,
    advantages: Tensor,
    turn_weights: Tensor,
    tree_ids: Tensor,
    *,
    epsilon_low: float = 0.2,
    epsilon_high: float = 0.2,
    num_trees: int | None = None,
    importance_weights: Tensor | None = None,
) -> Tensor:
    """AT2PO A5: Agentic Turn-based Policy Optimization, one importance ratio and one clip per turn.

        r_i = exp((1/L_i) Σ_j (log π_θ(a_ij) − log π_old(a_ij)))                 (turn geometric-mean ratio)
        ℓ_ij = min(r_i A_i, clip(r_i, 1 − ε_low, 1 + ε_high) A_i)                 (every token j of turn i)
        L_x = −Σ_{i ∈ x} w_i Σ_j ℓ_ij,   batch loss = mean over trees x

    A_i is the turn's value (A4). The per-token weights w_i say how turns are aggregated; A5's default is GRPO's
    seq-mean-token-mean over the K root-to-leaf paths, `credit.path_token_weights(tree)` (each unique token trained
    once with the weight of every path through it); `credit.token_mean_weights(tree)` is a token mean over unique
    tokens. Per-token gradient: −w_i A_i r_i when turn i is unclipped and 0 when its ratio is clipped — a whole
    turn stops at once, unlike the token-level surrogate (`clipped_token_loss`, the "GRPO loss" ablation).

    Args:
        advantages: A_i per unique turn (detached here).
        turn_weights: w_i per unique turn, the weight of each of its tokens in its tree (sum_i w_i L_i = 1 per tree).
        importance_weights: a stale tree's per-turn weights (`turn_importance_weights`, the geometric mean of
            π_old/μ over the turn, like r_i), multiplying each turn's term; None: a fresh tree.
    """
    num_turns = _num_weighted_turns(advantages, turn_weights)
    r = turn_mean_log_ratio(logps, old_logps, turn_ids, num_turns).exp()
    term = clipped_surrogate(r, advantages.detach().to(r), epsilon_low, epsilon_high)
    if importance_weights is not None:
        term = term * importance_weights.detach().to(term)
    lengths = turn_token_counts(turn_ids, num_turns).to(r)
    return -_weighted_tree_mean(turn_weights.to(r) * lengths * term, tree_ids, num_trees)


# ---------------------------------------------------------------------------------------------------------------
# Token-level surrogates: GRPO (AT2PO's ablation, TreeAdv D4) and GSPO-token (TreeAdv D4)
# ---------------------------------------------------------------------------------------------------------------


def clipped_token_loss(
    logps: Tensor,
    old_logps: Tensor,
    turn_ids: Tensor,
    advantages: Tensor,
    turn_weights: Tensor,
    tree_ids: Tensor,
    *,
    epsilon_low: float = 0.2,
    epsilon_high: float = 0.2,
    num_trees: int | None = None,
    importance_weights: Tensor | None = None,
) -> Tensor:
    """GRPO's token-level clipped surrogate with per-turn (TreeAdv: per-segment, D3) advantages.

        ρ_t = π_θ(y_t) / π_old(y_t),   ℓ_t = min(ρ_t A_{i(t)}, clip(ρ_t, 1 − ε_low, 1 + ε_high) A_{i(t)})
        L_x = −Σ_t w_{i(t)} ℓ_t,   batch loss = mean over trees x

    With `credit.path_token_weights` this equals GRPO's seq-mean-token-mean over the tree's K flat trajectories, each
    token taking its segment's advantage (TreeAdv D3–D4, GRPO variant); with per-turn values as advantages it is the
    "GRPO loss" arm of AT2PO's ablation against `atpo_loss`. A stale tree's tokens carry `importance_weights`
    [n_tokens] (`truncated_importance_weights`), ℓ_t → w_t ℓ_t: decoupled PPO.
    """
    num_turns = _num_weighted_turns(advantages, turn_weights)
    mask = _trained(turn_ids)
    ids = turn_ids[mask]
    ratio = (logps[mask] - old_logps[mask].detach()).exp()
    term = clipped_surrogate(ratio, advantages.detach().to(ratio)[ids], epsilon_low, epsilon_high)
    if importance_weights is not None:
        term = term * importance_weights[mask].detach().to(term)
    per_turn = ratio.new_zeros(num_turns).index_add(0, ids, turn_weights.to(ratio)[ids] * term)
    return -_weighted_tree_mean(per_turn, tree_ids, num_trees)


def _path_ratios(logps, old_logps, turn_ids, num_turns: int, pair_paths, pair_turns, num_paths: int):
    """GSPO's sequence ratio s_k = exp(mean log-ratio over path k's tokens), detached, and the paths' token counts."""
    lengths = turn_token_counts(turn_ids, num_turns).to(logps.dtype)
    path_len = lengths.new_zeros(num_paths).index_add(0, pair_paths, lengths[pair_turns])
    turn_log_ratio = turn_sum(logps - old_logps.detach(), turn_ids, num_turns)
    path_log_ratio = logps.new_zeros(num_paths).index_add(0, pair_paths, turn_log_ratio[pair_turns])
    return (path_log_ratio / path_len.clamp(min=1)).exp().detach(), path_len


def gspo_token_loss(
    logps: Tensor,
    old_logps: Tensor,
    turn_ids: Tensor,
    advantages: Tensor,
    pair_paths: Tensor,
    pair_turns: Tensor,
    path_trees: Tensor,
    *,
    epsilon_low: float = 3e-4,
    epsilon_high: float = 4e-4,
    num_trees: int | None = None,
    importance_weights: Tensor | None = None,
) -> Tensor:
    """TreeAdv D4: GSPO-token (GSPO paper §4.3) over the K root-to-leaf sequences a tree encodes.

        s_k = exp((1/|y_k|) Σ_{t ∈ y_k} log(π_θ(y_t) / π_old(y_t)))             (sequence ratio of path k)
        s_{k,t} = sg[s_k] · π_θ(y_t) / sg[π_θ(y_t)]                               (= s_k in value)
        L_x = −(1/K) Σ_k (1/|y_k|) Σ_{t ∈ y_k} min(s_{k,t} A_t, clip(s_{k,t}, 1 − ε_low, 1 + ε_high) A_t)

    A_t is the token's segment advantage (D3). A token shared by several paths sees each path's own s_k, so the loss
    runs over (path, turn) pairs (`credit.path_turn_pairs`), not over unique turns; each unique token is still
    scored once. Its gradient is −Σ_{k ∋ t} s_k A_t / (K |y_k|) over the paths whose clip is inactive: at θ = θ_old
    it equals the GRPO surrogate's with path weights. The ratios s_k are tiny-clipped (GSPO's ε ≈ 3e-4, 4e-4).

    Args:
        advantages: A per unique turn (segment); pair_paths, pair_turns, path_trees: `credit.path_turn_pairs(trees)`.
        importance_weights: a stale tree's per-token weights w_t (`truncated_importance_weights`): each token's
            term is w_t·min(·) (the sequence ratio s_k stays against π_old); None: a fresh tree, every w_t = 1.
    """
    num_turns, num_paths = advantages.numel(), path_trees.numel()
    pair_paths, pair_turns, path_trees = (x.to(logps.device) for x in (pair_paths, pair_turns, path_trees))
    s_path, path_len = _path_ratios(logps, old_logps, turn_ids, num_turns, pair_paths, pair_turns, num_paths)
    w = torch.ones_like(logps) if importance_weights is None else importance_weights.detach().to(logps)
    # Σ_{t ∈ i} w_t min(s_{k,t} A_i, clip(s_{k,t}) A_i) with s_{k,t} = s_k in value: the turn's weight W_i = Σ_t w_t
    # times min(·) of s_k · (Σ_t w_t π_θ/sg[π_θ]) / W_i, whose value is s_k and whose d/dlog π_θ(y_t) is s_k w_t / W_i.
    # With every w_t = 1, W_i = L_i: the turn's tokens summed.
    mass = turn_sum(w, turn_ids, num_turns)
    unit = (logps - logps.detach()).exp()
    unit_turn = turn_sum(unit * w, turn_ids, num_turns) / torch.where(mass > 0, mass, torch.ones_like(mass))
    s_pair = s_path[pair_paths] * unit_turn[pair_turns]
    term = mass[pair_turns] * clipped_surrogate(
        s_pair, advantages.detach().to(logps)[pair_turns], epsilon_low, epsilon_high
    )
    per_path = logps.new_zeros(num_paths).index_add(0, pair_paths, term) / path_len.clamp(min=1)
    n_trees = _per_tree(path_trees, num_trees)
    paths_per_tree = mass.new_zeros(n_trees).index_add(0, path_trees, torch.ones_like(per_path))
    per_tree = logps.new_zeros(n_trees).index_add(0, path_trees, per_path) / paths_per_tree.clamp(min=1)
    return -per_tree.mean()


# ---------------------------------------------------------------------------------------------------------------
# GRPOTrainer's clip_ratio/* metrics for the clipped surrogates (they read the losses' tensors, change no loss)
# ---------------------------------------------------------------------------------------------------------------


def clip_indicators(ratio: Tensor, advantages: Tensor, epsilon_low: float, epsilon_high: float) -> tuple[Tensor, Tensor]:
    """GRPO's clip indicators, elementwise: low where r < 1 − ε_low and A < 0, high where r > 1 + ε_high and A > 0.

    These are the elements whose clipped term wins the surrogate's min, so they get no gradient; the definitions are
    GRPOTrainer's `is_low_clipped` / `is_high_clipped`.
    """
    A = advantages.to(ratio)
    return (ratio < 1 - epsilon_low) & (A < 0), (ratio > 1 + epsilon_high) & (A > 0)


def path_clip_counts(
    pair_low: Tensor, pair_high: Tensor, pair_paths: Tensor, pair_turns: Tensor, turn_lengths: Tensor, num_paths: int
) -> Tensor:
    """[num_paths, 3]: per root-to-leaf path, its low-clipped, high-clipped and trained token counts.

    The path is GRPO's "sequence" (a leaf trajectory); a token shared by several paths counts once on each, as it would
    in a flat GRPO batch of the tree's K trajectories. `pair_low` / `pair_high` are the clipped tokens of each
    (path, turn) pair of `credit.path_turn_pairs`.
    """
    out = turn_lengths.new_zeros(num_paths, 3, dtype=torch.float64)
    pair_paths = pair_paths.to(out.device)
    for column, values in enumerate((pair_low, pair_high, turn_lengths[pair_turns])):
        out[:, column].index_add_(0, pair_paths, values.to(out))
    return out


def token_clip_counts(
    logps: Tensor, old_logps: Tensor, turn_ids: Tensor, advantages: Tensor, pair_paths: Tensor, pair_turns: Tensor,
    num_paths: int, *, epsilon_low: float, epsilon_high: float,
) -> Tensor:
    """Per-path clip counts (`path_clip_counts`) of a token-level ratio ρ_t with the token's turn advantage: the
    surrogate of `clipped_token_loss` (GRPO, TreeAdv D4) and of `dual_clip_loss` (TreeFlex F3)."""
    num_turns = advantages.numel()
    pair_paths, pair_turns = pair_paths.to(logps.device), pair_turns.to(logps.device)
    mask = _trained(turn_ids)
    ids = turn_ids[mask]
    ratio = (logps[mask] - old_logps[mask]).detach().exp()
    low, high = clip_indicators(ratio, advantages.detach()[ids], epsilon_low, epsilon_high)
    low_turn, high_turn = (ratio.new_zeros(num_turns, dtype=torch.float64).index_add(0, ids, x.double())
                           for x in (low, high))
    lengths = turn_token_counts(turn_ids, num_turns)
    return path_clip_counts(low_turn[pair_turns], high_turn[pair_turns], pair_paths, pair_turns, lengths, num_paths)


def turn_clip_counts(
    logps: Tensor, old_logps: Tensor, turn_ids: Tensor, advantages: Tensor, pair_paths: Tensor, pair_turns: Tensor,
    num_paths: int, *, epsilon_low: float, epsilon_high: float,
) -> Tensor:
    """Per-path clip counts of ATPO's per-turn ratio r_i (`atpo_loss`): a clipped turn clips all of its tokens."""
    num_turns = advantages.numel()
    pair_paths, pair_turns = pair_paths.to(logps.device), pair_turns.to(logps.device)
    r = turn_mean_log_ratio(logps.detach(), old_logps, turn_ids, num_turns).exp()
    low, high = clip_indicators(r, advantages.detach(), epsilon_low, epsilon_high)
    lengths = turn_token_counts(turn_ids, num_turns)
    return path_clip_counts((low * lengths)[pair_turns], (high * lengths)[pair_turns], pair_paths, pair_turns, lengths,
                            num_paths)


def gspo_token_clip_counts(
    logps: Tensor, old_logps: Tensor, turn_ids: Tensor, advantages: Tensor, pair_paths: Tensor, pair_turns: Tensor,
    num_paths: int, *, epsilon_low: float, epsilon_high: float,
) -> Tensor:
    """Per-path clip counts of GSPO-token (`gspo_token_loss`): path k's sequence ratio s_k against each of its turns'
    advantages, so a shared turn may be clipped on one path and not on another. Tokens are counted (GRPO's token
    mean): with one advantage per path, GRPO's sequence-level mode would count each path once instead."""
    num_turns = advantages.numel()
    pair_paths, pair_turns = pair_paths.to(logps.device), pair_turns.to(logps.device)
    s_path, _ = _path_ratios(logps.detach(), old_logps, turn_ids, num_turns, pair_paths, pair_turns, num_paths)
    low, high = clip_indicators(s_path[pair_paths], advantages.detach()[pair_turns], epsilon_low, epsilon_high)
    lengths = turn_token_counts(turn_ids, num_turns)
    pair_len = lengths[pair_turns]
    return path_clip_counts(low * pair_len, high * pair_len, pair_paths, pair_turns, lengths, num_paths)


def clip_ratio_summary(path_counts: Tensor) -> dict[str, float]:
    """GRPOTrainer's `clip_ratio/*` from `path_clip_counts` rows (every path of the batch, all ranks):

        low_mean, high_mean, region_mean   low- / high- / either-clipped share of the paths' trained tokens (GRPO's
                                           token mean over completion tokens)
        low_min, high_max                  smallest low-clipped and largest high-clipped share of one path (GRPO's
                                           per-sequence mean, min / max over sequences; paths without tokens skipped)
    """
    low, high, tokens = path_counts.double().reshape(-1, 3).unbind(-1)
    total = tokens.sum().clamp(min=1)
    kept = tokens > 0
    per_path_low, per_path_high = low[kept] / tokens[kept], high[kept] / tokens[kept]
    nan = float("nan")
    return {
        "low_mean": (low.sum() / total).item(),
        "high_mean": (high.sum() / total).item(),
        "region_mean": ((low + high).sum() / total).item(),
        "low_min": per_path_low.min().item() if kept.any() else nan,
        "high_max": per_path_high.max().item() if kept.any() else nan,
    }


# ---------------------------------------------------------------------------------------------------------------
# TreeFlex (docs/design.md §3 F3–F4)
# ---------------------------------------------------------------------------------------------------------------


def dual_clip_loss(
    logps: Tensor,
    old_logps: Tensor,
    advantages: Tensor,
    epsilon: float = 0.2,
    c: float = 3.0,
    *,
    epsilon_high: float | None = None,
    importance_weights: Tensor | None = None,
) -> Tensor:
    """TreeFlex F3: per-token PPO clip loss with the dual clip for negative advantages (Ye et al. 2020), c = 3.

        l_t = max(−r_t A_t, −clip(r_t, 1 − ε, 1 + ε_high) A_t)                   A_t ≥ 0
        l_t = min(max(−r_t A_t, −clip(r_t, 1 − ε, 1 + ε_high) A_t), −c A_t)       A_t < 0

    r_t = exp(log π_θ − log π_old), evaluated in the token's own generating context. For A < 0 the loss is capped at
    −c·A = c|A|: a token whose ratio has blown up (r > c) stops contributing gradient instead of dominating.
    Returns the per-token loss (to be reduced by `aggregate` / `aggregation_weights`).

    Args:
        advantages: A per token (e.g. `process_advantages` gathered by each token's turn).
        epsilon_high: upper clip (default ε).
        importance_weights: a stale search's per-token weights w_t (`truncated_importance_weights`): l_t → w_t l_t,
            the dual clip's cap still on r_t against π_old; None: a fresh search.
    """
    if c <= 1.0:
        raise ValueError(f"The dual-clip constant c must exceed 1, got c = {c}.")
    eps_high = epsilon if epsilon_high is None else epsilon_high
    ratio = (logps - old_logps.detach()).exp()
    A = advantages.detach().to(ratio)
    clipped = -clipped_surrogate(ratio, A, epsilon, eps_high)
    per_token = torch.where(A < 0, torch.minimum(clipped, -c * A), clipped)
    return per_token if importance_weights is None else per_token * importance_weights.detach().to(per_token)


AGGREGATION_MODES = ("token", "block", "rollout", "role")


def _unit_weights(lengths: Tensor, unit_ids: Tensor) -> Tensor:
    """w_i = 1 / (#units · L_u(i)): the mean within each unit, then the mean over the units with trained tokens."""
    _, inverse = torch.unique(unit_ids, return_inverse=True)
    totals = torch.zeros(int(inverse.max()) + 1, dtype=torch.float64, device=lengths.device).index_add_(
        0, inverse, lengths
    )
    units = int((totals > 0).sum())
    mine = totals[inverse]
    return torch.where(mine > 0, 1.0 / (units * mine.clamp(min=1e-300)), torch.zeros_like(mine))


def aggregation_weights(
    lengths: Tensor, search_ids: Tensor | None, block_ids: Tensor | None, role_ids: Tensor | None,
    mode: str = "rollout", role_lambda: float = 0.0,
) -> Tensor:
    """TreeFlex F4 for one group as a weight per element (a turn of L_i trained tokens, or one token with L = 1):
    the group's loss is Σ_i w_i Σ_{t ∈ i} l_t.

        token:    w_i = 1 / L                         L = the group's trained tokens
        block:    w_i = 1 / (#blocks · L_b(i))        every causal block equal; more blocks, more weight for their search
        rollout:  w_i = 1 / (#searches · L_s(i))      every complete search equal, whatever its length or blocks
        role:     w_i = 1 / (#roles · L_ρ(i))         Reflection and Execution equal
        mixed:    w = (1 − λ) w_mode + λ w_role       (λ = role_lambda ∈ [0, 1]; the paper trains with rollout, λ = 0)

    Units without trained tokens are ignored; Σ_i w_i L_i = 1 when anything is trained.

    Args:
        lengths: L_i, trained tokens of each element (0 for a masked one); search_ids, block_ids, role_ids: per
            element (the ones the mode needs are required).
    """
    if mode not in AGGREGATION_MODES:
        raise ValueError(f"aggregation must be one of {AGGREGATION_MODES}, got {mode!r}.")
    if not 0.0 <= role_lambda <= 1.0:
        raise ValueError(f"role_lambda must lie in [0, 1], got {role_lambda}.")
    lengths = torch.as_tensor(lengths, dtype=torch.float64)
    if lengths.numel() == 0:
        return lengths.clone()
    units = {"block": ("block_ids", block_ids), "rollout": ("search_ids", search_ids), "role": ("role_ids", role_ids)}

    def weights(unit: str) -> Tensor:
        if unit == "token":
            total = lengths.sum()
            return torch.full_like(lengths, 1.0 / float(total) if total > 0 else 0.0)
        name, ids = units[unit]
        if ids is None:
            raise ValueError(f"mode={unit!r} (or role_lambda > 0 for 'role') needs {name}.")
        return _unit_weights(lengths, torch.as_tensor(ids, device=lengths.device))

    if mode == "role" or role_lambda == 1.0:
        return weights("role")
    base = weights(mode)
    return base if role_lambda == 0.0 else (1 - role_lambda) * base + role_lambda * weights("role")


def aggregate(
    per_token_loss: Tensor,
    token_mask: Tensor,
    block_ids: Tensor | None = None,
    search_ids: Tensor | None = None,
    role_ids: Tensor | None = None,
    mode: str = "rollout",
    role_lambda: float = 0.0,
) -> Tensor:
    """TreeFlex F4: reduce a group's per-token losses; the unit that gets equal weight is the choice.

        token:    Σ_t m_t l_t / Σ_t m_t                                  every trained token equal
        block:    mean over blocks b of (mean over b's trained tokens)    every causal block equal
        rollout:  mean over searches i of (mean over i's trained tokens)  every complete search equal (paper's setup)
        role:     mean over roles ρ of (mean over ρ's trained tokens)     Reflection and Execution equal

        loss = (1 − λ) · loss_mode + λ · loss_role

    Only tokens with mask 1 count (prompt, restored context, harness text and observations are masked). Ids are
    global over what is passed: "over all blocks of the group" means every block id present, so a search with more
    blocks weighs more under `block`. Blocks/searches/roles without trained tokens are ignored. This is
    `aggregation_weights` with every token its own element (L = 1); the trainer uses the per-turn form.

    Args:
        per_token_loss, token_mask, block_ids, search_ids, role_ids: [n_tokens]; the ids the mode needs are required.
    """
    mask = token_mask.bool()
    if not mask.any():
        if mode not in AGGREGATION_MODES:
            raise ValueError(f"aggregation must be one of {AGGREGATION_MODES}, got {mode!r}.")
        return (per_token_loss * 0.0).sum()
    ids = [None if x is None else x.to(mask.device)[mask] for x in (search_ids, block_ids, role_ids)]
    w = aggregation_weights(torch.ones(int(mask.sum()), dtype=torch.float64, device=mask.device), *ids, mode,
                            role_lambda)
    return (w.to(per_token_loss) * per_token_loss[mask]).sum()
