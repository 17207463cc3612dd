"""The credits: how a finished unit becomes per-turn values V_i, each registered with the config fields it reads
(the math: `trl_tree.core.credit`)."""

from __future__ import annotations

import torch
from torch import Tensor

from ..core import credit
from ..rollout.growing.expansion import tree_turn_entropies
from .registry import check_choice, register_credit

PENALTY_MODES = ("pre_norm", "post_norm")

REWARD_STDS = ("sample", "population")


def _check_reward_std(args) -> None:
    check_choice("reward_std", args.reward_std, REWARD_STDS)


def leaf_advantages(tree, args) -> Tensor:
    """A_k of the tree's K leaves: T1 / D1 (sample std, no epsilon) or A3 (population std + 1e-6): what the
    standardising credits back up, so the pages' per-leaf view of each (`Credit.view`)."""
    rewards = torch.tensor(tree.rewards, dtype=torch.float64)
    if args.reward_std == "population":
        return credit.standardize(rewards, ddof=0, eps=1e-6)
    return credit.standardize(rewards)


# the tree credits back up standardised leaf rewards: each reads `reward_std`, and the pages show its A_k
_STANDARDISED = {
    "fields": {"reward_std": "standardisation of the leaf rewards"},
    "check": _check_reward_std,
    "view": leaf_advantages,
}


@register_credit("likelihood", **_STANDARDISED)
def _likelihood(tree, args):
    """TreeOPSD T2–T3: softmax over the children's behaviour log-likelihoods."""
    return credit.likelihood_backup(tree, leaf_advantages(tree, args))


@register_credit("child_mean", **_STANDARDISED)
def _child_mean(tree, args):
    """AT2PO A4: the mean over children, a leaf of multiplicity m counted m times."""
    return credit.child_mean_backup(tree, leaf_advantages(tree, args))


@register_credit("child_softmax", **_STANDARDISED, needs_entropies=True)
def _child_softmax(tree, args):
    """AT2PO A4 (default): softmax over the children's turn entropies A1, multiplicity counted as in child_mean."""
    return credit.entropy_softmax_backup(tree, leaf_advantages(tree, args), tree_turn_entropies(tree))


@register_credit("leaf_mean", **_STANDARDISED)
def _leaf_mean(tree, args):
    """AT2PO A4, TreeAdv D2: the mean of every leaf occurrence below the turn."""
    return credit.leaf_mean_backup(tree, leaf_advantages(tree, args))


@register_credit("path", **_STANDARDISED)
def _path(tree, args):
    """No tree credit (AT2PO's "credit off" ablation; flat GRPO): each token takes its trajectory's A_k."""
    return credit.path_credit(tree, leaf_advantages(tree, args))


@register_credit(
    "search",
    fields={
        "penalty_mode": "where turn penalties enter: pre_norm (R + Q − mean)/σ or post_norm",
        "tool_failure_penalty": "Q: process penalty per failed or malformed tool call",
    },
    unit="group",
    view=lambda group, args: credit.group_normalize(group.scores),  # each search's score within its group
    check=lambda args: check_choice("penalty_mode", args.penalty_mode, PENALTY_MODES),
    applies_penalties=True,  # F2: the turn's process penalty enters its advantage
)
def _search(group, args):
    """TreeFlex F1–F2: group-relative advantage of each complete search, plus the turn's process penalty."""
    return credit.process_advantages(group.scores, group.penalties, group.turn_search, mode=args.penalty_mode)
