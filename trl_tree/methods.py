"""The method table: every sampler, credit and loss of the tree trainers declared once, and the named methods.

A tree trainer is three independent choices (`TreeConfig.sampler`, `.credit`, `.loss`; docs/design.md §1):

- a **sampler** grows one tree per prompt (`trl_tree.rollout.samplers`);
- a **credit** maps a finished tree to per-turn values V_i (the math: `trl_tree.credit`);
- a **loss** adds the per-turn tensors it needs to the credit (`prepare`: teachers, aggregation weights) and computes
  a micro-batch's loss and its metrics from the flattened tensors (`compute`; the math: `trl_tree.losses`).

Each is registered here once (`register_sampler`, `register_credit`, `register_loss`) with the config fields it
reads, whether it needs per-token entropies from generation, and, for a sampler, its leaves and its cost per prompt.
Everything that depends on the choice reads this table: config validation (`TreeConfig`), the sampler budget
arithmetic (`trainer.components`), the generation engine's entropies (`TreeTrainer.needs_entropies`), the model
card's hyperparameter rows (`trainer.model_card`), the trainer's credit and loss. The named methods (`METHODS`) are
presets of the three with their own config and trainer classes, which `trl_tree`'s exports, the command line and the
test launchers list from here.

Adding a method: its math in `credit.py` / `losses.py` (pure functions citing their equations), a registration here
for each new component and a `Method` entry for a named preset, and its tests.

TreeFlex is registered here too (sampler "two_role", credit "search", loss "dual_clip") but keeps its own trainer:
its unit is not a rollout tree but a task's group of complete searches, each a list of causal blocks grown by a
harness, so generation (`FlexGroup` instead of `RolloutTree`) and packing (one row per block) differ; its credit and
loss are the ones below, applied to that unit.

Usage:

    from trl_tree import methods

    methods.METHODS["at2po"].config_class()          # AT2POConfig
    methods.SAMPLERS["entropy_guided"].fields         # the config fields it reads, with their meaning
    methods.needs_entropies(args)                    # does this configuration need per-token entropies?
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from dataclasses import dataclass
from fractions import Fraction
from typing import Any, NamedTuple

import torch
from torch import Tensor

from . import credit, losses
from .batch import LossInputs, TurnCredit
from .rollout.expansion import tree_turn_entropies

# ---------------------------------------------------------------------------------------------------------------
# The entries
# ---------------------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Sampler:
    """How one unit per prompt is grown.

    Attributes:
        build: `(args, loop, seed) -> sampler` (an object with `sample(roots)`; TreeFlex: a harness with `run`).
        fields: the config fields it reads → their meaning (the model card's rows, in this order).
        budget_field: the field `num_generations` sets when only G is given (M, or TreeFlex's K).
        leaves: K, leaves per tree (at most, when `variable_leaves`).
        budget: the expected cost of one tree in complete trajectories (what GRPO's G buys per prompt).
        budget_formula: `budget` as the error messages write it.
        shape_fields: the other fields that change the budget (init_expand's N; entropy_guided's L and K): what an
            error for an unreachable G varies to list settings that reach it.
        leaf_tokens: the most tokens one leaf generates (`max_completion_length`; TreeFlex: per block, × max_blocks);
            with `leaves`, the bound on a tree's size that `components.check_tree_size` checks.
        leaf_tokens_formula: `leaf_tokens` as the error messages write it.
        needs_entropies: `(args) -> bool`: whether it reads per-token entropies from generation.
        unit: "tree", or "group" for TreeFlex's groups of complete searches.
    """

    name: str
    build: Callable[[Any, Any, int], Any]
    fields: dict[str, str]
    budget_field: str
    leaves: Callable[[Any], int]
    budget: Callable[[Any], Fraction]
    budget_formula: str
    shape_fields: tuple[str, ...] = ()
    leaf_tokens: Callable[[Any], int] = lambda args: args.max_completion_length
    leaf_tokens_formula: str = "max_completion_length"
    needs_entropies: Callable[[Any], bool] = lambda args: False
    variable_leaves: bool = False
    unit: str = "tree"


@dataclass(frozen=True)
class Credit:
    """How a finished unit becomes per-turn values: `values(unit, args) -> V` [n_turns] (float64)."""

    name: str
    values: Callable[[Any, Any], Tensor]
    fields: dict[str, str]
    needs_entropies: bool = False
    unit: str = "tree"


class ClipCounts(NamedTuple):
    """A loss metric: per root-to-leaf path (or search) its low-clipped, high-clipped and trained token counts
    [n_paths, 3] (`losses.path_clip_counts`), logged as GRPO's `clip_ratio/*` over every rank's paths."""

    counts: Tensor


@dataclass(frozen=True)
class Loss:
    """A turn-level loss.

    Attributes:
        prepare: `(unit, A, args) -> TurnCredit`: the unit's credit with the extra per-turn tensors the loss reads.
        compute: `(batch: LossInputs, args) -> (loss, metrics)`. Metrics map a name to a tensor whose elements are
            averaged over every rank (a name containing "{block}" is logged per optimizer block), or to
            `ClipCounts`.
        fields: the config fields it reads → their meaning.
        credit_metrics: `(credits: list[TurnCredit]) -> metrics` of a generation batch's prepared credit, logged
            like `compute`'s besides the mean |A| every loss gets.
        check: `(args) -> None`, raising a `ValueError` that names the field when the configuration cannot train
            with this loss (run by config validation).
    """

    name: str
    prepare: Callable[[Any, Tensor, Any], TurnCredit]
    compute: Callable[[LossInputs, Any], tuple[Tensor, dict[str, Any]]]
    fields: dict[str, str]
    unit: str = "tree"
    credit_metrics: Callable[[list[TurnCredit]], dict[str, Any]] = lambda credits: {}
    check: Callable[[Any], None] = lambda args: None

    @property
    def clipped(self) -> bool:
        return "epsilon" in self.fields


@dataclass(frozen=True)
class Method:
    """A named method: a preset of the three components with its own config and trainer classes.

    Attributes:
        title: the class-name prefix and display name ("TreeOPSD" → `TreeOPSDConfig`, `TreeOPSDTrainer`).
        config, trainer: "module:Class" of the config and trainer classes (imported on first use).
        sampler, credit, loss: its default components.
        summary: one line, for command-line help and listings.
    """

    name: str
    title: str
    config: str
    trainer: str
    sampler: str
    credit: str
    loss: str
    summary: str
    paper: str = ""

    def config_class(self):
        return _load(self.config)

    def trainer_class(self):
        return _load(self.trainer)


def _load(path: str):
    module, name = path.split(":")
    return getattr(importlib.import_module(module), name)


SAMPLERS: dict[str, Sampler] = {}
CREDITS: dict[str, Credit] = {}
LOSSES: dict[str, Loss] = {}
METHODS: dict[str, Method] = {}


def register_sampler(name: str, **spec) -> Callable:
    """Decorator: register `build(args, loop, seed)` as the sampler `name` (the other `Sampler` attributes as keywords)."""

    def register(build):
        SAMPLERS[name] = Sampler(name=name, build=build, **spec)
        return build

    return register


def register_credit(name: str, **spec) -> Callable:
    """Decorator: register `values(unit, args) -> V` as the credit `name`."""

    def register(values):
        CREDITS[name] = Credit(name=name, values=values, **spec)
        return values

    return register


def register_loss(name: str, *, prepare: Callable, **spec) -> Callable:
    """Decorator: register `compute(batch, args) -> (loss, metrics)` as the loss `name`, with its `prepare`."""

    def register(compute):
        LOSSES[name] = Loss(name=name, prepare=prepare, compute=compute, **spec)
        return compute

    return register


def register_method(method: Method) -> Method:
    METHODS[method.name] = method
    return method


# ---------------------------------------------------------------------------------------------------------------
# Questions about a configuration
# ---------------------------------------------------------------------------------------------------------------


def choice(kind: str, name: str):
    """The registered sampler / credit / loss `name`, or an error naming the config field and the choices."""
    table = {"sampler": SAMPLERS, "credit": CREDITS, "loss": LOSSES}[kind]
    if name not in table:
        raise ValueError(f"{kind} must be one of {tuple(table)}; got {name!r}.")
    return table[name]


def components_of(args) -> tuple[Sampler, Credit, Loss]:
    return choice("sampler", args.sampler), choice("credit", args.credit), choice("loss", args.loss)


def needs_entropies(args) -> bool:
    """Whether generation must record per-token entropies: a sampler that branches on them, or a credit that reads
    them."""
    sampler, credit_, _ = components_of(args)
    return sampler.needs_entropies(args) or credit_.needs_entropies


def fields_read(args) -> dict[str, str]:
    """Every config field the chosen components read → its meaning, sampler's first (the model card's rows)."""
    out: dict[str, str] = {}
    for component in components_of(args):
        for name, meaning in component.fields.items():
            out.setdefault(name, meaning)
    return out


def check_units(args) -> None:
    """The three components must train the same kind of unit (a tree, or TreeFlex's group of searches)."""
    sampler, credit_, loss = components_of(args)
    if not sampler.unit == credit_.unit == loss.unit:
        raise ValueError(
            f"sampler={sampler.name!r} grows {sampler.unit}s but credit={credit_.name!r} reads {credit_.unit}s and "
            f"loss={loss.name!r} trains {loss.unit}s: choose components of one kind (TreeFlex's 'two_role', 'search'"
            " and 'dual_clip' go together)."
        )


def turn_credit(unit, args) -> TurnCredit:
    """Everything the configured loss needs for one unit (a tree; a TreeFlex group), float32 (index fields stay
    integer): the credit's values A and the loss's `prepare`."""
    A = CREDITS[args.credit].values(unit, args)
    return LOSSES[args.loss].prepare(unit, A, args).with_floats()


# ---------------------------------------------------------------------------------------------------------------
# Samplers
# ---------------------------------------------------------------------------------------------------------------

_TREE_LIMITS = {
    "max_turns": "assistant turns per trajectory (final answer included)",
    "max_completion_length": "token budget of one trajectory",
    "packing": "training layout of a tree",
}
_M = {"num_initial_rollouts": "M: complete trajectories sampled per prompt"}


@register_sampler(
    "init_expand",
    fields={
        **_M, "num_branches": "N: continuations branched from each trajectory", "anchor_rule": "branch points",
        **_TREE_LIMITS,
    },
    budget_field="num_initial_rollouts",
    leaves=lambda a: a.num_initial_rollouts * (a.num_branches + 1),
    budget=lambda a: a.num_initial_rollouts * (1 + Fraction(a.num_branches, 2)),
    budget_formula="M(1 + N/2)",
    shape_fields=("num_branches",),
)
def _init_expand(args, loop, seed):
    """TreeOPSD: M complete trajectories, then N continuations of each from uniformly drawn turns (K = M(N + 1))."""
    from .rollout.samplers import InitExpandSampler

    return InitExpandSampler(loop, args.num_initial_rollouts, args.num_branches, seed=seed)


@register_sampler(
    "flat",
    fields={**_M, **_TREE_LIMITS},
    budget_field="num_initial_rollouts",
    leaves=lambda a: a.num_initial_rollouts,
    budget=lambda a: Fraction(a.num_initial_rollouts),
    budget_formula="M",
)
def _flat(args, loop, seed):
    """No branching: M independent trajectories (flat multi-turn GRPO with credit="path", loss="grpo")."""
    from .rollout.samplers import InitExpandSampler

    return InitExpandSampler(loop, args.num_initial_rollouts, 0, seed=seed)


@register_sampler(
    "entropy_guided",
    fields={
        **_M,
        "expansion_rounds": "L: entropy-guided expansion rounds",
        "branches_per_round": "K: branches added per expansion round",
        "expansion_mode": "which turns are re-sampled: by node score or at random",
        "sibling_penalty": "α: node score S = H − α·max(0, siblings − 1)",
        **_TREE_LIMITS,
    },
    budget_field="num_initial_rollouts",
    leaves=lambda a: a.num_initial_rollouts + a.expansion_rounds * a.branches_per_round,
    budget=lambda a: a.num_initial_rollouts + Fraction(a.expansion_rounds * a.branches_per_round, 2),
    budget_formula="M + L·K/2 (L = expansion_rounds, K = branches_per_round)",
    shape_fields=("expansion_rounds", "branches_per_round"),
    needs_entropies=lambda a: a.expansion_mode == "entropy",  # A2 node scores
)
def _entropy_guided(args, loop, seed):
    """AT2PO A1–A2: M trajectories, then L rounds re-sampling the K turns of highest node score."""
    from .rollout.samplers import EntropyGuidedSampler

    return EntropyGuidedSampler(
        loop, args.num_initial_rollouts, args.expansion_rounds, args.branches_per_round,
        mode=args.expansion_mode, alpha=args.sibling_penalty, seed=seed,
    )


@register_sampler(
    "token_entropy",
    fields={
        **_M,
        "entropy_threshold": "τ_H: branch inside turns above this token entropy",
        "max_branches_per_tree": "branch points (new leaves) per tree at most",
        "min_segment_length": "fewest tokens of either piece of a split segment",
        "branching_rounds": "rounds of token-level branching",
        **_TREE_LIMITS,
    },
    budget_field="num_initial_rollouts",
    # a variable K: this is the budget M(1 + b); the sampler guarantees K ≥ 2 whenever that budget is ≥ 2
    leaves=lambda a: a.num_initial_rollouts * (1 + a.max_branches_per_tree),
    budget=lambda a: a.num_initial_rollouts * (1 + Fraction(a.max_branches_per_tree, 2)),
    budget_formula="M(1 + b/2) (b = max_branches_per_tree)",
    shape_fields=("max_branches_per_tree",),
    needs_entropies=lambda a: True,  # branch points are high-entropy tokens
    variable_leaves=True,
)
def _token_entropy(args, loop, seed):
    """TreeAdv: a forest of M trajectories branched inside their turns at tokens of entropy above τ_H."""
    from .rollout.token_branching import TokenEntropySampler

    return TokenEntropySampler(
        loop, args.num_initial_rollouts, args.entropy_threshold, args.max_branches_per_tree,
        min_segment_length=args.min_segment_length, rounds=args.branching_rounds,
    )


@register_sampler(
    "two_role",
    fields={
        "num_searches": "K: complete searches per task (the group)",
        "max_blocks": "causal blocks per search at most",
        "max_card_chars": "characters kept of a checkpoint card copied into another block",
        "max_turns": "assistant turns per Execution segment (per block of a custom harness)",
        "max_completion_length": "token budget of one block after its context",
    },
    budget_field="num_searches",
    leaves=lambda a: a.num_searches,
    budget=lambda a: Fraction(a.num_searches),
    budget_formula="num_searches",
    leaf_tokens=lambda a: a.max_completion_length * a.max_blocks,  # each block has its own budget
    leaf_tokens_formula="max_completion_length × max_blocks",
    unit="group",
)
def _two_role(args, loop, seed):
    """TreeFlex: a Reflection block, then Execution segments restarting from restored checkpoint cards."""
    from .rollout.flex_harness import TwoRoleHarness

    return TwoRoleHarness(max_card_chars=args.max_card_chars)


# ---------------------------------------------------------------------------------------------------------------
# Credits
# ---------------------------------------------------------------------------------------------------------------

_REWARD_STD = {"reward_std": "standardisation of the leaf rewards"}


def leaf_advantages(tree, args) -> Tensor:
    """A_k of the tree's K leaves: T1 / D1 (sample std, no epsilon) or A3 (population std + 1e-6)."""
    rewards = torch.tensor(tree.rewards, dtype=torch.float64)
    if args.reward_std == "population":
        return credit.standardize(rewards, ddof=0, eps=1e-6)
    return credit.standardize(rewards)


@register_credit("likelihood", fields=_REWARD_STD)
def _likelihood(tree, args):
    """TreeOPSD T2–T3: softmax over the children's behaviour log-likelihoods."""
    return credit.likelihood_backup(tree, leaf_advantages(tree, args))


@register_credit("child_mean", fields=_REWARD_STD)
def _child_mean(tree, args):
    """AT2PO A4: the mean over children, a leaf of multiplicity m counted m times."""
    return credit.child_mean_backup(tree, leaf_advantages(tree, args))


@register_credit("child_softmax", fields=_REWARD_STD, needs_entropies=True)
def _child_softmax(tree, args):
    """AT2PO A4 (default): softmax over the children's turn entropies A1, multiplicity counted as in child_mean."""
    return credit.entropy_softmax_backup(tree, leaf_advantages(tree, args), tree_turn_entropies(tree))


@register_credit("leaf_mean", fields=_REWARD_STD)
def _leaf_mean(tree, args):
    """AT2PO A4, TreeAdv D2: the mean of every leaf occurrence below the turn."""
    return credit.leaf_mean_backup(tree, leaf_advantages(tree, args))


@register_credit("path", fields=_REWARD_STD)
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
)
def _search(group, args):
    """TreeFlex F1–F2: group-relative advantage of each complete search, plus the turn's process penalty."""
    return credit.process_advantages(group.scores, group.penalties, group.turn_search, mode=args.penalty_mode)


# ---------------------------------------------------------------------------------------------------------------
# Losses
# ---------------------------------------------------------------------------------------------------------------

_CLIP = {
    "epsilon": "ε: clip range of the ratio (lower side)",
    "epsilon_high": "ε_high: upper clip range (default: ε)",
}


def clip_epsilons(args) -> dict[str, float]:
    """ε_low and ε_high of the clipped losses, as their functions take them (ε_high unset: ε)."""
    return {"epsilon_low": args.epsilon, "epsilon_high": args.epsilon_high or args.epsilon}


def _plain(tree, A, args) -> TurnCredit:
    return TurnCredit(A=A)


def _teacher(tree, A, args) -> TurnCredit:
    q, tau = credit.treeopsd_teacher(A, tree.num_leaves, args.target_radius)
    return TurnCredit(A=A, q=q, tau=torch.tensor(tau, dtype=torch.float64))


def _with_paths(tree, A, args) -> TurnCredit:
    """The paths through each turn as a DFS range (`credit.path_intervals`), so they travel in the per-turn layout
    (GSPO-token's (path, turn) pairs; every clipped loss's per-path clip metrics)."""
    lo, hi, num_paths = credit.path_intervals(tree)
    return TurnCredit(A=A, path_lo=lo, path_hi=hi, num_paths=num_paths)


def _path_weighted(tree, A, args) -> TurnCredit:
    """GRPO's seq-mean-token-mean weights over the tree's root-to-leaf paths, and the paths."""
    out = _with_paths(tree, A, args)
    out.w = credit.path_token_weights(tree)
    return out


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


def _teacher_gaps(credits: list[TurnCredit]) -> dict[str, Tensor]:
    """How far the teachers move the policy: |q_i − 1/2| over every turn."""
    return {"treeopsd/abs_q_minus_half": torch.cat([(c.q - 0.5).abs() for c in credits])}


@register_loss(
    "treeopsd", prepare=_teacher, fields={"target_radius": "ρ: teacher radius, q ∈ [1/2 − ρ, 1/2 + ρ]"},
    credit_metrics=_teacher_gaps,
    check=_check_teacher,
)
def _treeopsd(batch: LossInputs, args):
    """T5, and how far each turn still is from its teacher, |σ(s_i) − q_i|."""
    c = batch.credit
    loss = losses.treeopsd_loss(
        batch.logps, batch.old_logps, batch.turn_ids, c.q, c.tau, batch.tree_ids, num_trees=batch.num_trees
    )
    with torch.no_grad():
        s = losses.turn_mean_log_ratio(batch.logps, batch.old_logps, batch.turn_ids, batch.num_turns)
        gap = (torch.sigmoid(s) - c.q).abs()
    return loss, {"treeopsd/abs_p_minus_q/block_{block}": gap}


@register_loss("treepo", prepare=_plain, fields={})
def _treepo(batch: LossInputs, args):
    """T7: TreeOPSD's first-block gradient in every block."""
    loss = losses.treepo_loss(
        batch.logps, batch.old_logps, batch.turn_ids, batch.credit.A, batch.tree_ids, num_trees=batch.num_trees
    )
    return loss, {}


@register_loss("atpo", prepare=_path_weighted, fields=_CLIP)
def _atpo(batch: LossInputs, args):
    """AT2PO A5: one ratio and one clip per turn, GRPO's path aggregation."""
    c = batch.credit
    loss = losses.atpo_loss(
        batch.logps, batch.old_logps, batch.turn_ids, c.A, c.w, batch.tree_ids, num_trees=batch.num_trees,
        **clip_epsilons(args),
    )
    with torch.no_grad():
        return loss, {"clip_ratio": _clip_counts(losses.turn_clip_counts, batch, args)}


@register_loss("grpo", prepare=_path_weighted, fields=_CLIP)
def _grpo(batch: LossInputs, args):
    """GRPO's token-level clipped surrogate over root-to-leaf paths (AT2PO's ablation, TreeAdv D4)."""
    c = batch.credit
    loss = losses.clipped_token_loss(
        batch.logps, batch.old_logps, batch.turn_ids, c.A, c.w, batch.tree_ids, num_trees=batch.num_trees,
        **clip_epsilons(args),
    )
    with torch.no_grad():
        return loss, {"clip_ratio": _clip_counts(losses.token_clip_counts, batch, args)}


@register_loss("gspo_token", prepare=_with_paths, fields=_CLIP)
def _gspo_token(batch: LossInputs, args):
    """TreeAdv D4: GSPO-token over the tree's K root-to-leaf sequences."""
    loss = losses.gspo_token_loss(
        batch.logps, batch.old_logps, batch.turn_ids, batch.credit.A, *_path_pairs(batch),
        num_trees=batch.num_trees, **clip_epsilons(args),
    )
    with torch.no_grad():
        return loss, {"clip_ratio": _clip_counts(losses.gspo_token_clip_counts, batch, args)}


def _flex_weights(group, A, args) -> TurnCredit:
    """F4 as per-token weights of each turn, and the turn's penalty, search, block and role."""
    w = losses.aggregation_weights(group.lengths, group.turn_search, group.turn_block, group.turn_role,
                                   args.aggregation, args.role_lambda)
    return TurnCredit(A=A, w=w, penalty=group.penalties, search=group.turn_search, block=group.turn_block,
                      role=group.turn_role)


@register_loss(
    "dual_clip",
    prepare=_flex_weights,
    fields={
        "aggregation": "the unit given equal weight in a group's loss",
        "role_lambda": "λ: weight of the role mean mixed into the aggregation",
        **_CLIP,
        "dual_clip_c": "c: dual clip at −c·A for negative advantages",
    },
    unit="group",
)
def _dual_clip(batch: LossInputs, args):
    """TreeFlex F3–F4: the mean over the micro-batch's groups of Σ_t w_{turn(t)} · dual_clip(r_t, A_{turn(t)})."""
    c, ids = batch.credit, batch.turn_ids
    A, w = c.A[ids], c.w[ids]
    per_token = losses.dual_clip_loss(batch.logps, batch.old_logps, A, epsilon=args.epsilon, c=args.dual_clip_c,
                                      epsilon_high=args.epsilon_high)
    loss = (w.to(per_token) * per_token).sum() / max(int(batch.num_trees), 1)
    with torch.no_grad():
        ratio = (batch.logps - batch.old_logps).exp()
        dual = ((A < 0) & (ratio > args.dual_clip_c)).float()
        counts = _search_clip_counts(batch, args)
    return loss, {"clip_ratio": counts, "treeflex/dual_clip_fraction": dual}


def _search_clip_counts(batch: LossInputs, args) -> ClipCounts:
    """GRPO's clip counts (`losses.token_clip_counts`) with each complete search as the sequence: a turn belongs to
    exactly one search, numbered across the micro-batch's groups."""
    searches = batch.credit.search.long()
    _, path_of_turn = torch.unique(batch.tree_ids.long() * (int(searches.max()) + 1) + searches, return_inverse=True)
    return ClipCounts(losses.token_clip_counts(
        batch.logps, batch.old_logps, batch.turn_ids, batch.credit.A, path_of_turn,
        torch.arange(path_of_turn.numel(), device=path_of_turn.device), int(path_of_turn.max()) + 1,
        epsilon_low=args.epsilon, epsilon_high=args.epsilon_high if args.epsilon_high is not None else args.epsilon,
    ))


# ---------------------------------------------------------------------------------------------------------------
# The named methods
# ---------------------------------------------------------------------------------------------------------------

register_method(Method(
    "treeopsd", "TreeOPSD", "trl_tree.trainer.config:TreeOPSDConfig", "trl_tree.trainer.treeopsd:TreeOPSDTrainer",
    "init_expand", "likelihood", "treeopsd",
    "tree rollouts, likelihood-weighted turn credit, turn-level Bernoulli forward-KL to a bounded teacher",
    paper="2610.23181",
))
register_method(Method(
    "treepo", "TreePO", "trl_tree.trainer.config:TreePOConfig", "trl_tree.trainer.treepo:TreePOTrainer",
    "init_expand", "likelihood", "treepo", "TreeOPSD's trees and credit with the fixed-credit surrogate",
))
register_method(Method(
    "at2po", "AT2PO", "trl_tree.trainer.config:AT2POConfig", "trl_tree.trainer.at2po:AT2POTrainer",
    "entropy_guided", "child_softmax", "atpo", "entropy-guided expansion, turn credit, the ATPO loss",
))
register_method(Method(
    "treeadv", "TreeAdv", "trl_tree.trainer.config:TreeAdvConfig", "trl_tree.trainer.treeadv:TreeAdvTrainer",
    "token_entropy", "leaf_mean", "grpo", "branching at high-entropy tokens, segment advantages, GRPO or GSPO-token",
))
register_method(Method(
    "treeflex", "TreeFlex", "trl_tree.trainer.config:TreeFlexConfig", "trl_tree.trainer.treeflex:TreeFlexTrainer",
    "two_role", "search", "dual_clip",
    "complete searches of causal blocks as group members, turn penalties, dual clip",
))

# the generic trainer every method is a preset of (`TreeConfig(sampler=..., credit=..., loss=...)`)
CORE_CLASSES = {
    "TreeConfig": "trl_tree.trainer.config:TreeConfig",
    "TreeTrainer": "trl_tree.trainer.base:TreeTrainer",
}


def exported_classes() -> dict[str, str]:
    """Every public config and trainer class of `trl_tree` → "module:Class"."""
    out = dict(CORE_CLASSES)
    for m in METHODS.values():
        out[f"{m.title}Config"], out[f"{m.title}Trainer"] = m.config, m.trainer
    return out


def method_of_config(config) -> Method | None:
    """The named method whose config class is exactly `type(config)`, or None (a plain `TreeConfig`)."""
    return next((m for m in METHODS.values() if type(config) is m.config_class()), None)


__all__ = [
    "CREDITS", "ClipCounts", "Credit", "LOSSES", "METHODS", "Loss", "Method", "SAMPLERS", "Sampler", "check_units",
    "choice", "components_of", "exported_classes", "fields_read", "leaf_advantages", "method_of_config",
    "needs_entropies", "register_credit", "register_loss", "register_method", "register_sampler", "turn_credit",
]
