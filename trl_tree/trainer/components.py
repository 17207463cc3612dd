"""The sampler budget arithmetic and the leaf rewards every configuration shares (docs/design.md §1).

The components themselves (samplers, credits, losses) are declared in the method table, `trl_tree.methods`; this
module answers, from that table, what a configuration costs and how many leaves it makes:

- `trajectory_budget` / `num_generations_of`: a tree's expected cost in complete trajectories, GRPO's G;
- `budget_for_generations` / `valid_budgets`: the sampler setting that gives a G asked for (config resolution and
  its error messages);
- `aggregate_leaf_rewards`: GRPO's `multi_objective_aggregation` with a tree's leaves as the group.
"""

from __future__ import annotations

import itertools
import math
from fractions import Fraction
from types import SimpleNamespace

import torch
from trl.trainer.utils import nanstd

from .. import methods


def leaves_per_tree(args) -> int:
    """K for a configuration (`trl_tree.methods.Sampler.leaves`). Token-level branching ("token_entropy") has a
    variable K: this is its budget M(1 + max_branches_per_tree), and the sampler guarantees K ≥ 2 whenever that
    budget is ≥ 2."""
    return methods.choice("sampler", args.sampler).leaves(args)


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
    Each sampler declares its own (`trl_tree.methods.Sampler.budget`).
    """
    return methods.choice("sampler", args.sampler).budget(args)


def budget_formula(sampler: str) -> str:
    return methods.SAMPLERS[sampler].budget_formula


def num_generations_of(args) -> int:
    """G for a configuration: `trajectory_budget` rounded up to whole trajectories."""
    return math.ceil(trajectory_budget(args))


def budget_field(args) -> str:
    """The field that `num_generations` sets when only G is given: M, or TreeFlex's group size."""
    return methods.choice("sampler", args.sampler).budget_field


def budget_for_generations(args, num_generations: int) -> int | None:
    """The value of `budget_field` (M, or TreeFlex's K) whose `num_generations_of` is exactly G, or None.

    Every budget is linear in that field, b(M) = b0 + slope·M with slope ≥ 1, so at most one M has ⌈b(M)⌉ = G:
    G − 1 < b0 + slope·M ≤ G."""
    field = budget_field(args)
    b0 = trajectory_budget(replace_fields(args, **{field: 0}))
    slope = trajectory_budget(replace_fields(args, **{field: 1})) - b0
    value = math.floor((num_generations - b0) / slope)
    return value if value >= 1 and b0 + slope * value > num_generations - 1 else None


def branches_for_generations(args, num_generations: int, preferred: int) -> tuple[int, int] | None:
    """(M, N) reaching G when only G is given and the preset's N = `preferred` cannot: the N ≥ 1 nearest to it (a
    tree that still branches; N = 0 would silently turn the method into flat GRPO), among equally near ones the one
    whose budget is exactly G (nothing lost to rounding), then the smaller. None when no N ≥ 1 reaches G with K ≥ 2.
    Any G ≥ 2 is reached: M = 1 with N = 2G − 2 costs exactly G."""
    found = []
    for n in range(1, 2 * num_generations + 1):
        candidate = replace_fields(args, num_branches=n)
        m = budget_for_generations(candidate, num_generations)
        if m is not None and m * (n + 1) >= 2:
            waste = num_generations - trajectory_budget(replace_fields(candidate, num_initial_rollouts=m))
            found.append((abs(n - preferred), waste, n, m))
    return (found and (min(found)[3], min(found)[2])) or None


def valid_budgets(args, num_generations: int, limit: int = 8) -> list[str]:
    """Settings that give G, for error messages: the budget field's value with the sampler's other fields as they
    are, then the values it takes as its `shape_fields` vary (each from 0 or 1 to 2G; trees keep K ≥ 2 leaves)."""
    sampler = methods.SAMPLERS[args.sampler]
    field, found = budget_field(args), []
    shapes = [range(0 if name == "num_branches" else 1, 2 * num_generations + 1) for name in sampler.shape_fields]
    current = tuple(getattr(args, name) for name in sampler.shape_fields)
    for values in [current, *(v for v in itertools.product(*shapes) if v != current)]:
        candidate = replace_fields(args, **dict(zip(sampler.shape_fields, values)))
        value = budget_for_generations(candidate, num_generations)
        if value is None or sampler.leaves(replace_fields(candidate, **{field: value})) < 2:
            continue
        found.append(", ".join(f"{name}={v}" for name, v in ((field, value), *zip(sampler.shape_fields, values))))
        if len(found) > limit:
            return found[:limit] + ["and more"]
    return found


def replace_fields(args, **changes):
    """A shallow copy of a config-like object with some fields changed (for what-if budget arithmetic)."""
    return SimpleNamespace(**{**vars(args), **changes})


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
