"""The losses, each registered with its `prepare`, the credit kind it reads (declared here, next to its `prepare`),
the config fields it reads, the metrics it returns and how it trains a stale unit (`staleness`; the math:
`trl_tree.core.losses`). Each registered function adapts the one `LossInputs` to its pure function: the log-probs its
ratio is taken against and the importance weights, if any, come from `_stale`."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch
from torch import Tensor

from ..core import credit, losses
from ..core.batch import LossInputs, TurnCredit, credit_kind, per_unit
from .registry import (
    CLIP_METRIC,
    STALE_CAP_FIELD,
    STALE_TARGET_FIELD,
    ClipCounts,
    check_choice,
    importance_cap,
    register_loss,
    stale_form,
)

_CLIP = {
    "epsilon": "ε: clip range of the ratio (lower side)",
    "epsilon_high": "ε_high: upper clip range (default: ε)",
    **STALE_CAP_FIELD,  # every clipped loss trains stale samples in the decoupled form
}
_DECOUPLED = ("decoupled",)


def _stale(batch: LossInputs, args, loss: str, per: str) -> tuple[Tensor, Tensor | None]:
    """What the loss `loss` reads of a possibly stale micro-batch in its form (`methods.stale_form`, docs/design.md
    §3 "Stale samples"): the log-probs its ratio is taken against, and the importance weights (None: none).

    "behaviour": μ's log-probs, no weights (TreeOPSD as its paper defines it). "decoupled": π_old's, and the
    truncated weights min(π_old/μ, C) `per` "token" (`losses.truncated_importance_weights`) or "turn" (the
    geometric mean over the turn, `losses.turn_importance_weights`, for the losses with one ratio per turn). For a
    fresh micro-batch μ = π_old: the same log-probs and every weight exactly 1.
    """
    if stale_form(args, loss) == "behaviour":
        return batch.behaviour_logps, None
    cap = importance_cap(args)
    if per == "turn":
        return batch.old_logps, losses.turn_importance_weights(
            batch.old_logps, batch.behaviour_logps, batch.turn_ids, batch.num_turns, cap
        )
    return batch.old_logps, losses.truncated_importance_weights(batch.old_logps, batch.behaviour_logps, cap)


def epsilon_high(args) -> float:
    """ε_high of every clipped loss: ε when unset (None), else the value as given, 0.0 included (GRPO reads it
    literally too). The one place its default is written."""
    return args.epsilon if args.epsilon_high is None else args.epsilon_high


def clip_epsilons(args) -> dict[str, float]:
    """ε_low and ε_high of the clipped losses, as their functions take them."""
    return {"epsilon_low": args.epsilon, "epsilon_high": epsilon_high(args)}


def _plain(tree, A, args) -> TurnCredit:
    return TurnCredit(A=A)


@credit_kind
@dataclass
class TeacherCredit(TurnCredit):
    """TreeOPSD's credit (the "treeopsd" loss): A and the frozen teacher q_i = 1/2 + V_i/τ with its temperature τ
    per tree (T4)."""

    q: Tensor
    tau: Tensor = per_unit()


def _teacher(tree, A, args) -> TeacherCredit:
    q, tau = credit.treeopsd_teacher(A, tree.num_leaves, args.target_radius)
    return TeacherCredit(A=A, q=q, tau=torch.tensor(tau, dtype=torch.float64))


@credit_kind
@dataclass
class PathCredit(TurnCredit):
    """A and the root-to-leaf paths through each turn as a DFS range [path_lo, path_hi) of the tree's `num_paths`
    paths (`credit.path_intervals`): GSPO-token's (path, turn) pairs, and the per-path clip metrics of every clipped
    tree loss. A range keeps the paths in the per-turn layout, so they stack and flatten like any other field."""

    path_lo: Tensor
    path_hi: Tensor
    num_paths: Tensor = per_unit()

    clip_sequences: ClassVar[str] = "root-to-leaf paths"


def _with_paths(tree, A, args) -> PathCredit:
    lo, hi, num_paths = credit.path_intervals(tree)
    return PathCredit(A=A, path_lo=lo, path_hi=hi, num_paths=num_paths)


@credit_kind
@dataclass
class PathWeightedCredit(PathCredit):
    """The paths, and w: each turn's per-token weight under GRPO's seq-mean-token-mean over the tree's root-to-leaf
    paths (`credit.path_token_weights`; the "atpo" and "grpo" losses)."""

    w: Tensor


def _path_weighted(tree, A, args) -> PathWeightedCredit:
    lo, hi, num_paths = credit.path_intervals(tree)
    return PathWeightedCredit(A=A, path_lo=lo, path_hi=hi, num_paths=num_paths, w=credit.path_token_weights(tree))


def _path_pairs(batch: LossInputs) -> tuple[Tensor, Tensor, Tensor]:
    c = batch.credit
    return credit.pairs_from_intervals(c.path_lo, c.path_hi, c.num_paths, batch.tree_ids)


def _clip_counts(count, batch: LossInputs, args) -> ClipCounts:
    """GRPO's per-path clip counts of a tree loss; `count` is one of the `losses.*_clip_counts` functions."""
    pair_paths, pair_turns, path_trees = _path_pairs(batch)
    return ClipCounts(count(
        batch.logps, batch.old_logps, batch.turn_ids, batch.credit.A, pair_paths, pair_turns, path_trees.numel(),
        **clip_epsilons(args),
    ))


def _check_teacher(args) -> None:
    """T4: the teacher stays in (0, 1) only for 0 < ρ < 1/2 and sample-standardised leaves."""
    if not 0.0 < args.target_radius < 0.5:
        raise ValueError(f"target_radius ρ must satisfy 0 < ρ < 1/2; got {args.target_radius}.")
    if args.reward_std != "sample":
        raise ValueError(
            "The treeopsd loss needs reward_std='sample': Samuelson's bound |A| ≤ (K−1)/√K on sample-"
            "standardised rewards is what keeps q = 1/2 + V/τ inside [1/2 − ρ, 1/2 + ρ]."
        )


def _teacher_gaps(credits: list[TeacherCredit]) -> dict[str, Tensor]:
    """How far the teachers move the policy: |q_i − 1/2| over every turn."""
    return {"treeopsd/abs_q_minus_half": torch.cat([(c.q - 0.5).abs() for c in credits])}


_ZERO_CREDIT = {
    "zero_credit_anchor": "pull zero-credit turns (V_i = 0) toward π_old with a q = 1/2 teacher (default: treeopsd "
                          "yes, treepo no; the other choice is an ablation)"
}


def zero_credit_anchor(args, loss: str) -> bool:
    """Whether the loss `loss` ("treeopsd" or "treepo") pulls zero-credit turns toward π_old: the config's
    `zero_credit_anchor`, or when it is None the loss's own behaviour (T5's KL to q = 1/2 does, T7 does not)."""
    chosen = getattr(args, "zero_credit_anchor", None)
    return (loss == "treeopsd") if chosen is None else bool(chosen)


def _check_treepo(args) -> None:
    """The anchor's τ = (K − 1)/(ρ√K) needs a radius 0 < ρ < 1/2, as TreeOPSD's teacher does."""
    if zero_credit_anchor(args, "treepo") and not 0.0 < args.target_radius < 0.5:
        raise ValueError(f"target_radius ρ must satisfy 0 < ρ < 1/2 for the zero-credit anchor's τ; got "
                         f"{args.target_radius}.")


@register_loss(
    "treeopsd", prepare=_teacher, credit_kind=TeacherCredit, staleness=("behaviour", "decoupled"),
    fields={"target_radius": "ρ: teacher radius, q ∈ [1/2 − ρ, 1/2 + ρ]", **_ZERO_CREDIT, **STALE_TARGET_FIELD,
            **STALE_CAP_FIELD},
    returns=("treeopsd/abs_p_minus_q/block_{block}",),
    credit_metrics=_teacher_gaps,
    check=_check_teacher,
)
def _treeopsd(batch: LossInputs, args):
    """TreeOPSD T5: the turn-level Bernoulli forward-KL to the frozen teacher q; logs how far each turn still is
    from it, |σ(s_i) − q_i|. With `zero_credit_anchor=False`, turns with V_i = 0 are left out of the sum. A stale
    tree's s_i is measured against the behaviour policy μ that sampled it, as the teacher is (the paper's form);
    `stale_target="decoupled"` measures it against π_old with each turn's KL weighted by min(π_old/μ, C)."""
    c = batch.credit
    reference, weights = _stale(batch, args, "treeopsd", per="turn")
    keep = None if zero_credit_anchor(args, "treeopsd") else ~losses.zero_credit_turns(c.A)
    loss = losses.treeopsd_loss(
        batch.logps, reference, batch.turn_ids, c.q, c.tau, batch.tree_ids, num_trees=batch.num_trees,
        keep=keep, importance_weights=weights,
    )
    with torch.no_grad():
        s = losses.turn_mean_log_ratio(batch.logps, reference, batch.turn_ids, batch.num_turns)
        gap = (torch.sigmoid(s) - c.q).abs()
    return loss, {"treeopsd/abs_p_minus_q/block_{block}": gap}


def _treepo_credit(tree, A, args) -> TurnCredit:
    """A alone; with the zero-credit anchor also TreeOPSD's teacher and its τ (which the anchor reads)."""
    return _teacher(tree, A, args) if zero_credit_anchor(args, "treepo") else _plain(tree, A, args)


@register_loss("treepo", prepare=_treepo_credit, staleness=_DECOUPLED, fields={**_ZERO_CREDIT, **STALE_CAP_FIELD},
               check=_check_treepo)
def _treepo(batch: LossInputs, args):
    """T7: TreeOPSD's first-block gradient in every block; with `zero_credit_anchor=True`, plus TreeOPSD's q = 1/2
    pull on zero-credit turns (`losses.zero_credit_anchor`). A stale tree: decoupled, each token's log-ratio against
    π_old weighted by min(π_old/μ, C) (the anchor, one ratio per turn, by the turn's geometric-mean weight)."""
    reference, weights = _stale(batch, args, "treepo", per="token")
    loss = losses.treepo_loss(
        batch.logps, reference, batch.turn_ids, batch.credit.A, batch.tree_ids, num_trees=batch.num_trees,
        importance_weights=weights,
    )
    if zero_credit_anchor(args, "treepo"):
        TeacherCredit.require(batch.credit, "the 'treepo' loss with zero_credit_anchor=True")
        c = batch.credit
        reference, turn_weights = _stale(batch, args, "treepo", per="turn")
        loss = loss + losses.zero_credit_anchor(
            batch.logps, reference, batch.turn_ids, c.A, c.tau, batch.tree_ids, num_trees=batch.num_trees,
            importance_weights=turn_weights,
        )
    return loss, {}


@register_loss("atpo", prepare=_path_weighted, credit_kind=PathWeightedCredit, staleness=_DECOUPLED, fields=_CLIP,
               returns=(CLIP_METRIC,))
def _atpo(batch: LossInputs, args):
    """AT2PO A5: one ratio and one clip per turn, GRPO's path aggregation. A stale tree: decoupled, each turn's
    term weighted by its geometric-mean min(π_old/μ, C)."""
    c = batch.credit
    reference, weights = _stale(batch, args, "atpo", per="turn")
    loss = losses.atpo_loss(
        batch.logps, reference, batch.turn_ids, c.A, c.w, batch.tree_ids, num_trees=batch.num_trees,
        importance_weights=weights, **clip_epsilons(args),
    )
    with torch.no_grad():
        return loss, {CLIP_METRIC: _clip_counts(losses.turn_clip_counts, batch, args)}


@register_loss("grpo", prepare=_path_weighted, credit_kind=PathWeightedCredit, staleness=_DECOUPLED, fields=_CLIP,
               returns=(CLIP_METRIC,))
def _grpo(batch: LossInputs, args):
    """GRPO's token-level clipped surrogate over root-to-leaf paths (AT2PO's ablation, TreeAdv D4). A stale tree:
    decoupled, each token's term weighted by min(π_old/μ, C)."""
    c = batch.credit
    reference, weights = _stale(batch, args, "grpo", per="token")
    loss = losses.clipped_token_loss(
        batch.logps, reference, batch.turn_ids, c.A, c.w, batch.tree_ids, num_trees=batch.num_trees,
        importance_weights=weights, **clip_epsilons(args),
    )
    with torch.no_grad():
        return loss, {CLIP_METRIC: _clip_counts(losses.token_clip_counts, batch, args)}


@register_loss("gspo_token", prepare=_with_paths, credit_kind=PathCredit, staleness=_DECOUPLED, fields=_CLIP,
               returns=(CLIP_METRIC,))
def _gspo_token(batch: LossInputs, args):
    """TreeAdv D4: GSPO-token over the tree's K root-to-leaf sequences. A stale tree: decoupled, the sequence
    ratios against π_old and each token's term weighted by min(π_old/μ, C)."""
    reference, weights = _stale(batch, args, "gspo_token", per="token")
    loss = losses.gspo_token_loss(
        batch.logps, reference, batch.turn_ids, batch.credit.A, *_path_pairs(batch),
        num_trees=batch.num_trees, importance_weights=weights, **clip_epsilons(args),
    )
    with torch.no_grad():
        return loss, {CLIP_METRIC: _clip_counts(losses.gspo_token_clip_counts, batch, args)}


def _check_dual_clip(args) -> None:
    check_choice("aggregation", args.aggregation, losses.AGGREGATION_MODES)
    if not 0.0 <= args.role_lambda <= 1.0:
        raise ValueError(f"role_lambda must lie in [0, 1]; got {args.role_lambda}.")
    if not args.dual_clip_c > 1.0:
        raise ValueError(f"dual_clip_c must exceed 1; got {args.dual_clip_c}.")


@credit_kind
@dataclass
class FlexCredit(TurnCredit):
    """TreeFlex's credit (the "dual_clip" loss) over a group's turns: A, w the F4 aggregation as each turn's per-token
    weight, and the turn's process penalty Q_i (F2) and its search, block and role (the clip metrics count per
    search; the rollout-tree page and the metrics show the rest)."""

    w: Tensor
    penalty: Tensor
    search: Tensor
    block: Tensor
    role: Tensor

    clip_sequences: ClassVar[str] = "searches"


def _flex_weights(group, A, args) -> FlexCredit:
    w = losses.aggregation_weights(group.lengths, group.turn_search, group.turn_block, group.turn_role,
                                   args.aggregation, args.role_lambda)
    return FlexCredit(A=A, w=w, penalty=group.penalties, search=group.turn_search, block=group.turn_block,
                      role=group.turn_role)


@register_loss(
    "dual_clip",
    prepare=_flex_weights,
    credit_kind=FlexCredit,
    fields={
        "aggregation": "the unit given equal weight in a group's loss",
        "role_lambda": "λ: weight of the role mean mixed into the aggregation",
        **_CLIP,
        "dual_clip_c": "c: dual clip at −c·A for negative advantages",
    },
    returns=(CLIP_METRIC, "treeflex/dual_clip_fraction"),
    unit="group",
    staleness=_DECOUPLED,
    check=_check_dual_clip,
)
def _dual_clip(batch: LossInputs, args):
    """TreeFlex F3–F4: the mean over the micro-batch's groups of Σ_t w_{turn(t)} · dual_clip(r_t, A_{turn(t)}). A
    stale group: decoupled, each token's term weighted by min(π_old/μ, C)."""
    c, ids = batch.credit, batch.turn_ids
    A, w = c.A[ids], c.w[ids]
    reference, weights = _stale(batch, args, "dual_clip", per="token")
    per_token = losses.dual_clip_loss(batch.logps, reference, A, epsilon=args.epsilon, c=args.dual_clip_c,
                                      epsilon_high=epsilon_high(args), importance_weights=weights)
    loss = (w.to(per_token) * per_token).sum() / max(int(batch.num_trees), 1)
    with torch.no_grad():
        ratio = (batch.logps - batch.old_logps).exp()
        dual = ((A < 0) & (ratio > args.dual_clip_c)).float()
        counts = _search_clip_counts(batch, args)
    return loss, {CLIP_METRIC: counts, "treeflex/dual_clip_fraction": dual}


def _search_clip_counts(batch: LossInputs, args) -> ClipCounts:
    """GRPO's clip counts (`losses.token_clip_counts`) with each complete search as the sequence: a turn belongs to
    exactly one search, numbered across the micro-batch's groups."""
    searches = batch.credit.search.long()
    _, path_of_turn = torch.unique(batch.tree_ids.long() * (int(searches.max()) + 1) + searches, return_inverse=True)
    return ClipCounts(losses.token_clip_counts(
        batch.logps, batch.old_logps, batch.turn_ids, batch.credit.A, path_of_turn,
        torch.arange(path_of_turn.numel(), device=path_of_turn.device), int(path_of_turn.max()) + 1,
        **clip_epsilons(args),
    ))
