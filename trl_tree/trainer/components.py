"""Sampler × credit × loss: the registries a `TreeConfig` chooses from (docs/design.md §1 table, issue "composition").

Each named trainer is a preset of these three choices; any other combination is a configuration away, e.g. the
TreeOPSD loss on an AT2PO entropy-guided tree:

    TreeConfig(sampler="entropy_guided", credit="likelihood", loss="treeopsd")

and with no branching the same pipeline is flat multi-turn GRPO, the baseline every comparison needs:

    TreeConfig(sampler="flat", num_initial_rollouts=8, credit="path", loss="grpo")

- A **sampler** grows one tree per prompt (`trl_tree.rollout.samplers`).
- A **credit** maps a finished tree to per-turn advantages `A` (`trl_tree.credit`).
- A **loss** adds the per-turn tensors it needs (`prepare`: teachers, aggregation weights) and computes the
  micro-batch loss from flattened per-token tensors (`compute`, `trl_tree.losses`).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from fractions import Fraction
from types import SimpleNamespace

import torch
from trl.trainer.utils import nanstd

from .. import credit, losses
from ..rollout.expansion import tree_turn_entropies
from ..rollout.samplers import EntropyGuidedSampler, InitExpandSampler, TurnLoop
from ..rollout.token_branching import TokenEntropySampler
from ..tree import RolloutTree

# ------------------------------------------------------------------------------------------------------ samplers


def build_sampler(args, loop: TurnLoop, seed: int):
    if args.sampler == "init_expand":
        return InitExpandSampler(loop, args.num_initial_rollouts, args.num_branches, seed=seed)
    if args.sampler == "flat":
        return InitExpandSampler(loop, args.num_initial_rollouts, 0, seed=seed)
    if args.sampler == "entropy_guided":
        return EntropyGuidedSampler(
            loop, args.num_initial_rollouts, args.expansion_rounds, args.branches_per_round,
            mode=args.expansion_mode, alpha=args.sibling_penalty, seed=seed,
        )
    if args.sampler == "token_entropy":
        return TokenEntropySampler(
            loop, args.num_initial_rollouts, args.entropy_threshold, args.max_branches_per_tree,
            min_segment_length=args.min_segment_length, rounds=args.branching_rounds,
        )
    raise ValueError(f"Unknown sampler {args.sampler!r}; choose one of {SAMPLERS}.")


SAMPLERS = ("init_expand", "flat", "entropy_guided", "token_entropy")


def leaves_per_tree(args) -> int:
    """K for a configuration. Token-level branching ("token_entropy") has a variable K: this is its budget
    M(1 + max_branches_per_tree), and the sampler guarantees K ≥ 2 whenever that budget is ≥ 2."""
    if args.sampler == "token_entropy":
        return args.num_initial_rollouts * (1 + args.max_branches_per_tree)
    if args.sampler == "init_expand":
        return args.num_initial_rollouts * (args.num_branches + 1)
    if args.sampler == "flat":
        return args.num_initial_rollouts
    return args.num_initial_rollouts + args.expansion_rounds * args.branches_per_round


def trajectory_budget(args) -> Fraction:
    """A tree's expected cost in complete trajectories: what GRPO's `num_generations` (G) buys per prompt.

    A continuation regenerates, on average, half a trajectory (it resumes from a turn or token drawn inside one):

        init_expand      M(1 + N/2)      M complete trajectories, N continuations of each from a uniform turn
        flat             M
        entropy_guided   M + L·K/2       L rounds of K continuations from entropy-selected turns (AT2PO)
        token_entropy    M(1 + b/2)      at most b continuations per trajectory from high-entropy tokens (TreeAdv):
                                         a cap, so the cost actually spent may be lower
        two_role         K               TreeFlex: the group of K complete searches (`num_searches`)

    so (M, N) = (4, 2) matches GRPO's default G = 8. `num_generations_of` rounds it up to whole trajectories.
    """
    M = args.num_initial_rollouts
    if args.sampler == "init_expand":
        return M * (1 + Fraction(args.num_branches, 2))
    if args.sampler == "flat":
        return Fraction(M)
    if args.sampler == "entropy_guided":
        return M + Fraction(args.expansion_rounds * args.branches_per_round, 2)
    if args.sampler == "token_entropy":
        return M * (1 + Fraction(args.max_branches_per_tree, 2))
    if args.sampler == "two_role":
        return Fraction(args.num_searches)
    raise ValueError(f"sampler must be one of {SAMPLERS}; got {args.sampler!r}.")


BUDGET_FORMULAS = {
    "init_expand": "M(1 + N/2)", "flat": "M", "entropy_guided": "M + L·K/2 (L = expansion_rounds, "
    "K = branches_per_round)", "token_entropy": "M(1 + b/2) (b = max_branches_per_tree)", "two_role": "num_searches",
}


def num_generations_of(args) -> int:
    """G for a configuration: `trajectory_budget` rounded up to whole trajectories."""
    return math.ceil(trajectory_budget(args))


def budget_field(args) -> str:
    """The field that `num_generations` sets when only G is given: M, or TreeFlex's group size."""
    return "num_searches" if args.sampler == "two_role" else "num_initial_rollouts"


def budget_for_generations(args, num_generations: int) -> int | None:
    """The value of `budget_field` (M, or TreeFlex's K) whose `num_generations_of` is exactly G, or None.

    Every budget is linear in that field, b(M) = b0 + slope·M with slope ≥ 1, so at most one M has ⌈b(M)⌉ = G:
    G − 1 < b0 + slope·M ≤ G."""
    field = budget_field(args)
    b0 = trajectory_budget(replace_fields(args, **{field: 0}))
    slope = trajectory_budget(replace_fields(args, **{field: 1})) - b0
    value = math.floor((num_generations - b0) / slope)
    return value if value >= 1 and b0 + slope * value > num_generations - 1 else None


def valid_budgets(args, num_generations: int, limit: int = 8) -> list[str]:
    """Settings of the sampler's budget fields that give G, for error messages (init_expand: every (M, N))."""
    field = budget_field(args)
    if args.sampler != "init_expand":
        value = budget_for_generations(args, num_generations)
        return [] if value is None else [f"{field}={value}"]
    found = []
    for n in range(0, 2 * num_generations + 1):
        m = budget_for_generations(replace_fields(args, num_branches=n), num_generations)
        if m is not None and m * (n + 1) >= 2:
            found.append(f"(M, N) = ({m}, {n})")
    return found[:limit] + (["…"] if len(found) > limit else [])


def replace_fields(args, **changes):
    """A shallow copy of a config-like object with some fields changed (for what-if budget arithmetic)."""
    return SimpleNamespace(**{**vars(args), **changes})


# -------------------------------------------------------------------------------------------------------- credit


MULTI_OBJECTIVE_AGGREGATIONS = ("sum_then_normalize", "normalize_then_sum")


def aggregate_leaf_rewards(rewards_per_func: torch.Tensor, weights: torch.Tensor, mode: str) -> torch.Tensor:
    """One tree's leaf rewards [K] from its reward functions' outputs [K, F] (NaN: the function returned None), by
    GRPO's `multi_objective_aggregation` with the tree's K leaves as the group:

        sum_then_normalize   R_k = Σ_f w_f r_kf                                  (normalised later, over the tree)
        normalize_then_sum   R_k = Σ_f w_f (r_kf − mean_f) / (std_f + 1e-4)      mean, sample std over the K leaves

    NaNs are skipped (nanmean / nansum, as GRPO). GRPO then normalises the summed rewards over the whole batch; a tree
    standardises them over its own leaves (`leaf_advantages`) instead.
    """
    weights = weights.to(rewards_per_func)
    if mode == "sum_then_normalize":
        return (rewards_per_func * weights.unsqueeze(0)).nansum(dim=1)
    if mode == "normalize_then_sum":
        mean = torch.nanmean(rewards_per_func, dim=0, keepdim=True)
        std = nanstd(rewards_per_func, dim=0, keepdim=True) if len(rewards_per_func) > 1 else torch.zeros_like(mean)
        return ((rewards_per_func - mean) / (std + 1e-4) * weights.unsqueeze(0)).nansum(dim=1)
    raise ValueError(f"multi_objective_aggregation must be one of {MULTI_OBJECTIVE_AGGREGATIONS}; got {mode!r}.")


def leaf_advantages(tree: RolloutTree, args) -> torch.Tensor:
    """T1 / D1 (sample std, no epsilon) or A3 (population std + 1e-6)."""
    rewards = torch.tensor(tree.rewards, dtype=torch.float64)
    if args.reward_std == "population":
        return credit.standardize(rewards, ddof=0, eps=1e-6)
    return credit.standardize(rewards)


def _path_credit(tree: RolloutTree, A: torch.Tensor) -> torch.Tensor:
    """No tree credit (AT2PO's "credit off" ablation; flat GRPO): every token takes its trajectory's A_k.

    On unique turns with GRPO's seq-mean-token-mean weights w_i = Σ_{k∋i} 1/(K|p_k|), the turn value
    A_i = Σ_{k∋i} A_k/(K|p_k|) / w_i reproduces the flat per-path gradient at θ_old exactly.
    """
    lengths = credit.turn_lengths(tree)
    pair_paths, pair_turns, _ = credit.path_turn_pairs(tree)
    path_len = torch.zeros(tree.num_leaves, dtype=torch.float64).index_add_(0, pair_paths, lengths[pair_turns])
    per_pair = 1.0 / (tree.num_leaves * path_len[pair_paths].clamp(min=1))
    weight = torch.zeros(tree.num_turns, dtype=torch.float64).index_add_(0, pair_turns, per_pair)
    weighted = torch.zeros(tree.num_turns, dtype=torch.float64).index_add_(0, pair_turns, per_pair * A[pair_paths])
    return weighted / weight.clamp(min=1e-300)


CREDITS: dict[str, Callable[[RolloutTree, torch.Tensor], torch.Tensor]] = {
    "likelihood": credit.likelihood_backup,  # TreeOPSD T3
    "child_mean": credit.child_mean_backup,  # AT2PO A4
    "child_softmax": lambda tree, A: credit.entropy_softmax_backup(tree, A, tree_turn_entropies(tree)),  # AT2PO A4
    "leaf_mean": credit.leaf_mean_backup,  # AT2PO A4, TreeAdv D2
    "path": _path_credit,  # no tree credit: GRPO over root-to-leaf paths
}


def turn_advantages(tree: RolloutTree, args) -> torch.Tensor:
    return CREDITS[args.credit](tree, leaf_advantages(tree, args))


# -------------------------------------------------------------------------------------------------------- losses


@dataclass
class LossSpec:
    """`prepare(tree, A, args)` → extra per-turn tensors (0-dim: per tree); `compute(flat, args)` → scalar loss;
    for a loss that clips, `clip_counts(flat, args)` → the micro-batch's `losses.path_clip_counts` (GRPO's
    `clip_ratio/*` metrics)."""

    prepare: Callable[[RolloutTree, torch.Tensor, object], dict[str, torch.Tensor]]
    compute: Callable[[dict, object], torch.Tensor]
    clip_counts: Callable[[dict, object], torch.Tensor] | None = None


def _teacher(tree, A, args):
    q, tau = credit.treeopsd_teacher(A, tree.num_leaves, args.target_radius)
    return {"q": q, "tau": torch.tensor(tau, dtype=torch.float64)}


def _path_weights(tree, A, args):
    """GRPO's seq-mean-token-mean weights, and the paths (for the clip metrics, which are per path like GRPO's)."""
    return {"w": credit.path_token_weights(tree), **_path_intervals(tree, A, args)}


def _nothing(tree, A, args):
    return {}


def _path_intervals(tree, A, args):
    """GSPO-token's (path, turn) pairs as per-turn tensors, so they travel in the per-turn batch layout.

    Numbering the K trajectories by the DFS index of their leaf, the paths through turn i are exactly those whose
    leaf lies in i's subtree, a contiguous DFS range: the paths [path_lo_i, path_hi_i). `_path_pairs` expands the
    ranges back into `credit.path_turn_pairs`'s layout (paths renumbered, which the loss does not depend on).
    """
    leaves = torch.bincount(torch.tensor(tree.leaf_of, dtype=torch.long), minlength=tree.num_turns)
    lo = torch.cumsum(leaves, 0) - leaves
    hi = lo + credit.leaf_counts_below(tree).long()
    return {"path_lo": lo, "path_hi": hi, "num_paths": torch.tensor(tree.num_leaves)}


def _path_pairs(f) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(pair_paths, pair_turns, path_trees) of a micro-batch from the flattened per-turn ranges of `_path_intervals`,
    with global path ids (tree x's paths follow those of trees 0..x−1)."""
    lo, hi, num_paths = f["path_lo"].long(), f["path_hi"].long(), f["num_paths"].long()
    tree_ids = f["tree_ids"].to(lo.device)
    counts = hi - lo
    first = lo + (torch.cumsum(num_paths, 0) - num_paths)[tree_ids]
    starts = torch.cumsum(counts, 0) - counts
    within = torch.arange(int(counts.sum()), device=lo.device) - torch.repeat_interleave(starts, counts)
    pair_paths = torch.repeat_interleave(first, counts) + within
    pair_turns = torch.repeat_interleave(torch.arange(lo.numel(), device=lo.device), counts)
    path_trees = torch.repeat_interleave(torch.arange(num_paths.numel(), device=lo.device), num_paths)
    return pair_paths, pair_turns, path_trees


def _clip_counts(count):
    """`LossSpec.clip_counts` of a clipped surrogate: `count` is one of the `losses.*_clip_counts` functions."""

    def clip_counts(f, a):
        pair_paths, pair_turns, path_trees = _path_pairs(f)
        return count(
            f["logps"], f["old_logps"], f["turn_ids"], f["A"], pair_paths, pair_turns, path_trees.numel(),
            epsilon_low=a.epsilon, epsilon_high=a.epsilon_high or a.epsilon,
        )

    return clip_counts


LOSSES: dict[str, LossSpec] = {
    "treeopsd": LossSpec(
        _teacher,
        lambda f, a: losses.treeopsd_loss(
            f["logps"], f["old_logps"], f["turn_ids"], f["q"], f["tau"], f["tree_ids"], num_trees=f["num_trees"]
        ),
    ),
    "treepo": LossSpec(
        _nothing,
        lambda f, a: losses.treepo_loss(
            f["logps"], f["old_logps"], f["turn_ids"], f["A"], f["tree_ids"], num_trees=f["num_trees"]
        ),
    ),
    "atpo": LossSpec(
        _path_weights,
        lambda f, a: losses.atpo_loss(
            f["logps"], f["old_logps"], f["turn_ids"], f["A"], f["w"], f["tree_ids"],
            epsilon_low=a.epsilon, epsilon_high=a.epsilon_high or a.epsilon, num_trees=f["num_trees"],
        ),
        _clip_counts(losses.turn_clip_counts),
    ),
    "grpo": LossSpec(
        _path_weights,
        lambda f, a: losses.clipped_token_loss(
            f["logps"], f["old_logps"], f["turn_ids"], f["A"], f["w"], f["tree_ids"],
            epsilon_low=a.epsilon, epsilon_high=a.epsilon_high or a.epsilon, num_trees=f["num_trees"],
        ),
        _clip_counts(losses.token_clip_counts),
    ),
    "gspo_token": LossSpec(  # TreeAdv D4: GSPO-token over the tree's K root-to-leaf sequences
        _path_intervals,
        lambda f, a: losses.gspo_token_loss(
            f["logps"], f["old_logps"], f["turn_ids"], f["A"], *_path_pairs(f),
            epsilon_low=a.epsilon, epsilon_high=a.epsilon_high or a.epsilon, num_trees=f["num_trees"],
        ),
        _clip_counts(losses.gspo_token_clip_counts),
    ),
}


def turn_credit(tree: RolloutTree, args) -> dict[str, torch.Tensor]:
    """Everything the configured loss needs for one tree, as float32 per-turn tensors (0-dim: per tree)."""
    A = turn_advantages(tree, args)
    out = {"A": A, **LOSSES[args.loss].prepare(tree, A, args)}
    return {k: v.float() for k, v in out.items()}
