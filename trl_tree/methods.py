"""The method table: every sampler, credit and loss of the tree trainers declared once, and the named methods.

A tree trainer is three independent choices (`TreeConfig.sampler`, `.credit`, `.loss`; docs/design.md §1):

- a **sampler** grows one tree per prompt (`trl_tree.rollout.samplers`);
- a **credit** maps a finished tree to per-turn values V_i (the math: `trl_tree.credit`);
- a **loss** adds the per-turn tensors it needs to the credit (`prepare`: teachers, aggregation weights) and computes
  a micro-batch's loss and its metrics from the flattened tensors (`compute`; the math: `trl_tree.losses`). What it
  adds is its own credit kind (a `trl_tree.batch.TurnCredit` subclass declared next to its `prepare` below), and its
  `compute` refuses a micro-batch of another kind.

Each is registered here once (`register_sampler`, `register_credit`, `register_loss`) with the config fields it
reads, whether it needs per-token entropies from generation, and, for a sampler, its leaves and its cost per prompt.
Everything that depends on the choice reads this table: config validation (`TreeConfig`), the sampler budget
arithmetic (`trainer.components`), the generation engine's entropies (`TreeTrainer.needs_entropies`), the model
card's hyperparameter rows (`trainer.model_card`), the trainer's credit and loss. The named methods (`METHODS`) are
presets of the three with their own config and trainer classes, which `trl_tree`'s exports, the command line and the
test launchers list from here.

Adding a method: its math in `credit.py` / `losses.py` (pure functions citing their equations), a registration here
for each new component (a loss that reads more than A declares its credit kind, a `TurnCredit` dataclass subclass,
next to its `prepare`) and a `Method` entry for a named preset, and its tests.

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

import functools
import importlib
import inspect
from collections.abc import Callable
from dataclasses import dataclass, field
from fractions import Fraction
from typing import Any, NamedTuple

import torch
from torch import Tensor

from . import credit, losses
from .batch import LossInputs, TurnCredit, per_unit
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
        shape_fields: the other fields that change the budget (init_expand's N; entropy_guided's L and K) → the least
            value each may take: what an error for an unreachable G varies to list settings that reach it.
        leaf_tokens: the most tokens one leaf generates (`max_completion_length`; TreeFlex: per block, × max_blocks);
            with `leaves`, the bound on a tree's size that `components.check_tree_size` checks.
        leaf_tokens_formula: `leaf_tokens` as the error messages write it.
        needs_entropies: `(args) -> bool`: whether it reads per-token entropies from generation.
        unit: "tree", or "group" for TreeFlex's groups of complete searches.
        check: `(args) -> None`: validation of its own `fields` (run only when it is the chosen sampler, before the
            budget is resolved from G, so the budget arithmetic only ever sees valid shapes).
        derived: the `shape_fields` that config resolution may choose itself when only G is given and the preset's
            value cannot reach it (init_expand's N: `components.shape_for_generations`); a user-given value is kept.
        leaves_formula: `leaves` as the error messages write it.
        card: `(args, trainer) -> str | None`: the model card's sentence on how a prompt's unit is grown.
    """

    name: str
    build: Callable[[Any, Any, int], Any]
    fields: dict[str, str]
    budget_field: str
    leaves: Callable[[Any], int]
    budget: Callable[[Any], Fraction]
    budget_formula: str
    leaves_formula: str
    shape_fields: dict[str, int] = field(default_factory=dict)
    leaf_tokens: Callable[[Any], int] = lambda args: args.max_completion_length
    leaf_tokens_formula: str = "max_completion_length"
    needs_entropies: Callable[[Any], bool] = lambda args: False
    variable_leaves: bool = False
    unit: str = "tree"
    check: Callable[[Any], None] = lambda args: None
    derived: tuple[str, ...] = ()
    card: Callable[[Any, Any], str | None] = lambda args, trainer: None

    @property
    def summary(self) -> str:
        return summary_of(self.build)


@dataclass(frozen=True)
class Credit:
    """How a finished unit becomes per-turn values: `values(unit, args) -> V` [n_turns] (float64).

    Attributes:
        view: `(unit, args) -> [K]`: the per-leaf (per-search) values the rollout-tree pages show for this credit,
            the quantity it backs up to turns; a credit with its own leaf values declares them, or the pages would
            show numbers it never used.
        check: `(args) -> None`: validation of its own `fields` (run only when it is the chosen credit).
    """

    name: str
    values: Callable[[Any, Any], Tensor]
    fields: dict[str, str]
    needs_entropies: bool = False
    unit: str = "tree"
    view: Callable[[Any, Any], Tensor] = lambda unit, args: leaf_advantages(unit, args)
    check: Callable[[Any], None] = lambda args: None

    @property
    def summary(self) -> str:
        return summary_of(self.values)


class ClipCounts(NamedTuple):
    """A loss metric: per root-to-leaf path (or search) its low-clipped, high-clipped and trained token counts
    [n_paths, 3] (`losses.path_clip_counts`), logged as GRPO's `clip_ratio/*` over every rank's paths."""

    counts: Tensor


@dataclass(frozen=True)
class Loss:
    """A turn-level loss.

    Attributes:
        prepare: `(unit, A, args) -> credit_kind`: the unit's credit with the extra per-turn tensors the loss reads.
        credit_kind: the `TurnCredit` kind `prepare` returns and `compute` reads (`TurnCredit`: A only); `compute`
            refuses a micro-batch of another kind, naming both, instead of failing on a missing field.
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
    credit_kind: type[TurnCredit] = TurnCredit
    unit: str = "tree"
    credit_metrics: Callable[[list[TurnCredit]], dict[str, Any]] = lambda credits: {}
    check: Callable[[Any], None] = lambda args: None

    @property
    def clipped(self) -> bool:
        return "epsilon" in self.fields

    @property
    def summary(self) -> str:
        return summary_of(self.compute)


@dataclass(frozen=True)
class Paper:
    """The paper a method implements, as TRL's model card cites it (`title`, arXiv `id`, BibTeX `citation`)."""

    title: str
    id: str
    citation: str

    def as_trl_dict(self) -> dict[str, str]:
        """The `_paper` mapping TRL's `generate_model_card` reads."""
        return {"title": self.title, "id": self.id, "citation": self.citation}


@dataclass(frozen=True)
class Method:
    """A named method: a preset of the three components with its own config and trainer classes.

    Attributes:
        title: the class-name prefix and display name ("TreeOPSD" → `TreeOPSDConfig`, `TreeOPSDTrainer`).
        config, trainer: "module:Class" of the config and trainer classes (imported on first use).
        sampler, credit, loss: its default components.
        summary: one line, for command-line help and listings.
        paper: the paper it implements (the trainer's model-card citation), or None.
        example_unfit: why the HotpotQA example script (`trl_tree.scripts.hotpot`) cannot train it, or "" when it
            can; a method with a reason runs only the generic script (`trl-tree <method> --reward_funcs ...`), and
            the command line says this reason when asked for the example.
    """

    name: str
    title: str
    config: str
    trainer: str
    sampler: str
    credit: str
    loss: str
    summary: str
    paper: Paper | None = None
    example_unfit: str = ""

    @property
    def tags(self) -> list[str]:
        """The model card's tags: TRL's, trl-tree's and the method's name."""
        return ["trl", "trl-tree", self.name]

    def config_class(self):
        return _load(self.config)

    def trainer_class(self):
        return _load(self.trainer)

    def preset(self, trainer_class: type) -> type:
        """Class decorator of the method's trainer: its display name, tags, paper and config class, from this
        entry (so none of them is written twice)."""
        trainer_class._name = self.title
        trainer_class._tag_names = self.tags
        if self.paper is not None:
            trainer_class._paper = self.paper.as_trl_dict()
        trainer_class.config_class = self.config_class()
        return trainer_class


def preset(name: str) -> Callable[[type], type]:
    """`@methods.preset("treeopsd")` on a trainer class: `Method.preset` of the registered method `name`."""
    return METHODS[name].preset


def summary_of(function) -> str:
    """A registered component's one-line summary, for help and listings: the first paragraph of its docstring
    (the registration's docstring is the one place a component describes itself)."""
    doc = inspect.getdoc(function) or ""
    return " ".join(doc.split("\n\n")[0].split())


def _load(path: str):
    module, name = path.split(":")
    return getattr(importlib.import_module(module), name)


SAMPLERS: dict[str, Sampler] = {}
CREDITS: dict[str, Credit] = {}
LOSSES: dict[str, Loss] = {}
METHODS: dict[str, Method] = {}


def _free(table: dict, kind: str, name: str) -> str:
    """`name`, refused when `table` has it already: a second registration under a name would silently replace the
    first, and every config, preset and test that names it would then run the other component."""
    if name in table:
        raise ValueError(f"A {kind} named {name!r} is registered already; give the new one another name (registered "
                         f"{kind}s: {', '.join(sorted(table))}).")
    return name


def register_sampler(name: str, **spec) -> Callable:
    """Decorator: register `build(args, loop, seed)` as the sampler `name` (the other `Sampler` attributes as keywords)."""
    _free(SAMPLERS, "sampler", name)

    def register(build):
        SAMPLERS[_free(SAMPLERS, "sampler", name)] = Sampler(name=name, build=build, **spec)
        return build

    return register


def register_credit(name: str, **spec) -> Callable:
    """Decorator: register `values(unit, args) -> V` as the credit `name`."""
    _free(CREDITS, "credit", name)

    def register(values):
        CREDITS[_free(CREDITS, "credit", name)] = Credit(name=name, values=values, **spec)
        return values

    return register


def register_loss(name: str, *, prepare: Callable, credit_kind: type[TurnCredit] = TurnCredit, **spec) -> Callable:
    """Decorator: register `compute(batch, args) -> (loss, metrics)` as the loss `name`, with its `prepare` and the
    credit kind both share. The registered `compute` checks the micro-batch's kind first (`TurnCredit.require`)."""
    _free(LOSSES, "loss", name)

    def register(compute):
        @functools.wraps(compute)
        def checked(batch: LossInputs, args):
            credit_kind.require(batch.credit, f"the {name!r} loss")
            return compute(batch, args)

        LOSSES[_free(LOSSES, "loss", name)] = Loss(name=name, prepare=prepare, compute=checked,
                                                   credit_kind=credit_kind, **spec)
        return compute

    return register


def register_method(method: Method) -> Method:
    METHODS[_free(METHODS, "method", method.name)] = method
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
    integer): the credit's values A and the loss's `prepare`, as the loss's credit kind (`Loss.credit_kind`)."""
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
ANCHOR_RULES = ("uniform",)
EXPANSION_MODES = ("entropy", "random")


def _check_choice(name: str, value, valid: tuple) -> None:
    if value not in valid:
        raise ValueError(f"{name} must be one of {valid}; got {value!r}.")


def _check_init_expand(args) -> None:
    _check_choice("anchor_rule", args.anchor_rule, ANCHOR_RULES)
    if args.num_branches < 0:
        raise ValueError(f"num_branches (N) must be ≥ 0; got {args.num_branches}.")


def _check_entropy_guided(args) -> None:
    _check_choice("expansion_mode", args.expansion_mode, EXPANSION_MODES)
    if args.expansion_rounds < 0 or args.branches_per_round < 0:
        raise ValueError("expansion_rounds and branches_per_round must be ≥ 0.")


def _check_token_entropy(args) -> None:
    if args.max_branches_per_tree < 0 or args.min_segment_length < 1 or args.branching_rounds < 1:
        raise ValueError(
            "Token-level branching needs max_branches_per_tree ≥ 0, min_segment_length ≥ 1 and branching_rounds ≥ "
            f"1; got {args.max_branches_per_tree}, {args.min_segment_length}, {args.branching_rounds}."
        )
    if args.entropy_threshold != args.entropy_threshold:
        raise ValueError("entropy_threshold is NaN; use float('inf') to turn token-level branching off.")


def _check_two_role(args) -> None:
    if args.max_blocks is None or args.max_blocks < 1:
        raise ValueError(f"max_blocks must be ≥ 1; got {args.max_blocks}.")


def _card_init_expand(args, trainer) -> str | None:
    M, N = args.num_initial_rollouts, args.num_branches
    if M is None or N is None:
        return None
    return (f"Each prompt grows one rollout tree: M = {M} complete multi-turn trajectories, then N = {N} "
            f"continuations of each from uniformly drawn turn prefixes, K = M(N + 1) = {M * (N + 1)} leaves; "
            "shared turns are merged and trained once.")


def _card_entropy_guided(args, trainer) -> str | None:
    M, L, K = args.num_initial_rollouts, args.expansion_rounds, args.branches_per_round
    if M is None:
        return None
    how = "those of highest node score" if args.expansion_mode == "entropy" else "chosen at random"
    return (f"Each prompt grows one rollout tree: M = {M} complete multi-turn trajectories, then L = {L} rounds that "
            f"each re-sample K = {K} turns ({how}) from their pre-turn history, M + L·K = "
            f"{M + L * K} leaves; shared turns are merged and trained once.")


def _card_token_entropy(args, trainer) -> str | None:
    M, B = args.num_initial_rollouts, args.max_branches_per_tree
    if M is None:
        return None
    return (f"Each prompt grows a forest of M = {M} trees: one complete trajectory each, branched inside its turns at "
            f"tokens whose entropy exceeds τ_H = {args.entropy_threshold:g}, at most {B} branch points per tree (1 to "
            f"{1 + B} leaves per tree, at most {M * (1 + B)} per prompt); shared prefixes are trained once.")


def _card_two_role(args, trainer) -> str | None:
    if getattr(args, "num_searches", None) is None:
        return None
    harness = getattr(trainer, "_harness", None)  # a custom harness passed to TreeFlexTrainer(harness=...)
    blocks = (
        "one Reflection block, then Execution segments that restart from restored checkpoint cards"
        if harness is None
        else f"grown by the custom harness `{type(harness).__name__}`"
    )
    return (f"Each task gets a group of K = {args.num_searches} complete searches, each of at most "
            f"{args.max_blocks} causal blocks ({blocks}); every generated token is trained once, in the block that "
            "generated it, and each search's score is compared within its group.")


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
    leaves_formula="M(N + 1)",
    shape_fields={"num_branches": 0},  # N = 0 is flat sampling, a valid (if unbranched) tree
    derived=("num_branches",),
    check=_check_init_expand,
    card=_card_init_expand,
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
    leaves_formula="M",
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
    leaves_formula="M + L·K",
    shape_fields={"expansion_rounds": 1, "branches_per_round": 1},
    needs_entropies=lambda a: a.expansion_mode == "entropy",  # A2 node scores
    check=_check_entropy_guided,
    card=_card_entropy_guided,
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
    leaves_formula="at most M(1 + b)",
    shape_fields={"max_branches_per_tree": 1},
    needs_entropies=lambda a: True,  # branch points are high-entropy tokens
    variable_leaves=True,
    check=_check_token_entropy,
    card=_card_token_entropy,
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
    leaves_formula="num_searches",
    leaf_tokens=lambda a: a.max_completion_length * a.max_blocks,  # each block has its own budget
    leaf_tokens_formula="max_completion_length × max_blocks",
    unit="group",
    check=_check_two_role,
    card=_card_two_role,
)
def _two_role(args, loop, seed):
    """TreeFlex: a Reflection block, then Execution segments restarting from restored checkpoint cards."""
    from .rollout.flex_harness import TwoRoleHarness

    return TwoRoleHarness(max_card_chars=args.max_card_chars)


# ---------------------------------------------------------------------------------------------------------------
# Credits
# ---------------------------------------------------------------------------------------------------------------

PENALTY_MODES = ("pre_norm", "post_norm")

REWARD_STDS = ("sample", "population")


def _check_reward_std(args) -> None:
    _check_choice("reward_std", args.reward_std, REWARD_STDS)


# the tree credits back up standardised leaf rewards: each reads `reward_std`, and the pages show its A_k
_STANDARDISED = {"fields": {"reward_std": "standardisation of the leaf rewards"}, "check": _check_reward_std}


def leaf_advantages(tree, args) -> Tensor:
    """A_k of the tree's K leaves: T1 / D1 (sample std, no epsilon) or A3 (population std + 1e-6): what the
    standardising credits back up, so the pages' per-leaf view of each (`Credit.view`)."""
    rewards = torch.tensor(tree.rewards, dtype=torch.float64)
    if args.reward_std == "population":
        return credit.standardize(rewards, ddof=0, eps=1e-6)
    return credit.standardize(rewards)


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
    check=lambda args: _check_choice("penalty_mode", args.penalty_mode, PENALTY_MODES),
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


def epsilon_high(args) -> float:
    """ε_high of every clipped loss: ε when unset (None), else the value as given, 0.0 included (GRPO reads it
    literally too). The one place its default is written."""
    return args.epsilon if args.epsilon_high is None else args.epsilon_high


def clip_epsilons(args) -> dict[str, float]:
    """ε_low and ε_high of the clipped losses, as their functions take them."""
    return {"epsilon_low": args.epsilon, "epsilon_high": epsilon_high(args)}


def _plain(tree, A, args) -> TurnCredit:
    return TurnCredit(A=A)


@dataclass
class TeacherCredit(TurnCredit):
    """TreeOPSD's credit (the "treeopsd" loss): A and the frozen teacher q_i = 1/2 + V_i/τ with its temperature τ
    per tree (T4)."""

    q: Tensor
    tau: Tensor = per_unit()


def _teacher(tree, A, args) -> TeacherCredit:
    q, tau = credit.treeopsd_teacher(A, tree.num_leaves, args.target_radius)
    return TeacherCredit(A=A, q=q, tau=torch.tensor(tau, dtype=torch.float64))


@dataclass
class PathCredit(TurnCredit):
    """A and the root-to-leaf paths through each turn as a DFS range [path_lo, path_hi) of the tree's `num_paths`
    paths (`credit.path_intervals`): GSPO-token's (path, turn) pairs, and the per-path clip metrics of every clipped
    tree loss. A range keeps the paths in the per-turn layout, so they stack and flatten like any other field."""

    path_lo: Tensor
    path_hi: Tensor
    num_paths: Tensor = per_unit()


def _with_paths(tree, A, args) -> PathCredit:
    lo, hi, num_paths = credit.path_intervals(tree)
    return PathCredit(A=A, path_lo=lo, path_hi=hi, num_paths=num_paths)


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
    "treeopsd", prepare=_teacher, credit_kind=TeacherCredit,
    fields={"target_radius": "ρ: teacher radius, q ∈ [1/2 − ρ, 1/2 + ρ]", **_ZERO_CREDIT},
    credit_metrics=_teacher_gaps,
    check=_check_teacher,
)
def _treeopsd(batch: LossInputs, args):
    """TreeOPSD T5: the turn-level Bernoulli forward-KL to the frozen teacher q; logs how far each turn still is
    from it, |σ(s_i) − q_i|. With `zero_credit_anchor=False`, turns with V_i = 0 are left out of the sum."""
    c = batch.credit
    keep = None if zero_credit_anchor(args, "treeopsd") else ~losses.zero_credit_turns(c.A)
    loss = losses.treeopsd_loss(
        batch.logps, batch.old_logps, batch.turn_ids, c.q, c.tau, batch.tree_ids, num_trees=batch.num_trees,
        keep=keep,
    )
    with torch.no_grad():
        s = losses.turn_mean_log_ratio(batch.logps, batch.old_logps, batch.turn_ids, batch.num_turns)
        gap = (torch.sigmoid(s) - c.q).abs()
    return loss, {"treeopsd/abs_p_minus_q/block_{block}": gap}


def _treepo_credit(tree, A, args) -> TurnCredit:
    """A alone; with the zero-credit anchor also TreeOPSD's teacher and its τ (which the anchor reads)."""
    return _teacher(tree, A, args) if zero_credit_anchor(args, "treepo") else _plain(tree, A, args)


@register_loss("treepo", prepare=_treepo_credit, fields=_ZERO_CREDIT, check=_check_treepo)
def _treepo(batch: LossInputs, args):
    """T7: TreeOPSD's first-block gradient in every block; with `zero_credit_anchor=True`, plus TreeOPSD's q = 1/2
    pull on zero-credit turns (`losses.zero_credit_anchor`)."""
    loss = losses.treepo_loss(
        batch.logps, batch.old_logps, batch.turn_ids, batch.credit.A, batch.tree_ids, num_trees=batch.num_trees
    )
    if zero_credit_anchor(args, "treepo"):
        TeacherCredit.require(batch.credit, "the 'treepo' loss with zero_credit_anchor=True")
        c = batch.credit
        loss = loss + losses.zero_credit_anchor(
            batch.logps, batch.old_logps, batch.turn_ids, c.A, c.tau, batch.tree_ids, num_trees=batch.num_trees
        )
    return loss, {}


@register_loss("atpo", prepare=_path_weighted, credit_kind=PathWeightedCredit, fields=_CLIP)
def _atpo(batch: LossInputs, args):
    """AT2PO A5: one ratio and one clip per turn, GRPO's path aggregation."""
    c = batch.credit
    loss = losses.atpo_loss(
        batch.logps, batch.old_logps, batch.turn_ids, c.A, c.w, batch.tree_ids, num_trees=batch.num_trees,
        **clip_epsilons(args),
    )
    with torch.no_grad():
        return loss, {"clip_ratio": _clip_counts(losses.turn_clip_counts, batch, args)}


@register_loss("grpo", prepare=_path_weighted, credit_kind=PathWeightedCredit, fields=_CLIP)
def _grpo(batch: LossInputs, args):
    """GRPO's token-level clipped surrogate over root-to-leaf paths (AT2PO's ablation, TreeAdv D4)."""
    c = batch.credit
    loss = losses.clipped_token_loss(
        batch.logps, batch.old_logps, batch.turn_ids, c.A, c.w, batch.tree_ids, num_trees=batch.num_trees,
        **clip_epsilons(args),
    )
    with torch.no_grad():
        return loss, {"clip_ratio": _clip_counts(losses.token_clip_counts, batch, args)}


@register_loss("gspo_token", prepare=_with_paths, credit_kind=PathCredit, fields=_CLIP)
def _gspo_token(batch: LossInputs, args):
    """TreeAdv D4: GSPO-token over the tree's K root-to-leaf sequences."""
    loss = losses.gspo_token_loss(
        batch.logps, batch.old_logps, batch.turn_ids, batch.credit.A, *_path_pairs(batch),
        num_trees=batch.num_trees, **clip_epsilons(args),
    )
    with torch.no_grad():
        return loss, {"clip_ratio": _clip_counts(losses.gspo_token_clip_counts, batch, args)}


def _check_dual_clip(args) -> None:
    _check_choice("aggregation", args.aggregation, losses.AGGREGATION_MODES)
    if not 0.0 <= args.role_lambda <= 1.0:
        raise ValueError(f"role_lambda must lie in [0, 1]; got {args.role_lambda}.")
    if not args.dual_clip_c > 1.0:
        raise ValueError(f"dual_clip_c must exceed 1; got {args.dual_clip_c}.")


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
    unit="group",
    check=_check_dual_clip,
)
def _dual_clip(batch: LossInputs, args):
    """TreeFlex F3–F4: the mean over the micro-batch's groups of Σ_t w_{turn(t)} · dual_clip(r_t, A_{turn(t)})."""
    c, ids = batch.credit, batch.turn_ids
    A, w = c.A[ids], c.w[ids]
    per_token = losses.dual_clip_loss(batch.logps, batch.old_logps, A, epsilon=args.epsilon, c=args.dual_clip_c,
                                      epsilon_high=epsilon_high(args))
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
        **clip_epsilons(args),
    ))


# ---------------------------------------------------------------------------------------------------------------
# The named methods
# ---------------------------------------------------------------------------------------------------------------

# TreeOPSD and its control TreePO come from one paper: both cards cite it
TREEOPSD_PAPER = Paper(
    title="TreeOPSD: Building finite posterior distillation targets from shared-prefix trees",
    id="2610.23181",
    citation=(
        "@article{zou2026treeopsd,\n"
        "    title   = {{TreeOPSD: Building Finite Posterior Distillation Targets from Shared-Prefix Trees}},\n"
        "    author  = {Heming Zou and others},\n"
        "    year    = 2026,\n"
        "    eprint  = {arXiv:2610.23181},\n"
        "}"
    ),
)
# why `trl-tree treeflex` runs only the generic script (`Method.example_unfit`)
_TREEFLEX_NOT_THE_EXAMPLE = (
    "TreeFlex trains a two-role agent (a Reflection block without tools, then Execution segments restarting from "
    "checkpoint cards), while the HotpotQA example's warm start teaches, and its before/after evaluation measures, "
    "the single-role tool loop of the other methods, so its EM/F1 would not measure what TreeFlex trained. Name a "
    "reward (--reward_funcs or --reward_model_name_or_path), with --tools or --environment_factory for tool use, to "
    "run the generic script on your data, or use TreeFlexTrainer from Python"
)

register_method(Method(
    "treeopsd", "TreeOPSD", "trl_tree.trainer.config:TreeOPSDConfig", "trl_tree.trainer.treeopsd:TreeOPSDTrainer",
    "init_expand", "likelihood", "treeopsd",
    "tree rollouts, likelihood-weighted turn credit, turn-level Bernoulli forward-KL to a bounded teacher",
    paper=TREEOPSD_PAPER,
))
register_method(Method(
    "treepo", "TreePO", "trl_tree.trainer.config:TreePOConfig", "trl_tree.trainer.treepo:TreePOTrainer",
    "init_expand", "likelihood", "treepo", "TreeOPSD's trees and credit with the fixed-credit surrogate",
    paper=TREEOPSD_PAPER,
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
    example_unfit=_TREEFLEX_NOT_THE_EXAMPLE,
))

# the generic trainer every method is a preset of (`TreeConfig(sampler=..., credit=..., loss=...)`)
CORE_CLASSES = {
    "TreeConfig": "trl_tree.trainer.config:TreeConfig",
    "TreeTrainer": "trl_tree.trainer.base:TreeTrainer",
}


def check_fields(args) -> None:
    """Each chosen component's validation of its own fields (`Sampler.check`, `Credit.check`, `Loss.check`): the
    fields of components not chosen are not read, so they are not checked either."""
    for component in components_of(args):
        component.check(args)


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
    "CREDITS", "ClipCounts", "Credit", "FlexCredit", "LOSSES", "METHODS", "Loss", "Method", "Paper", "PathCredit",
    "PathWeightedCredit", "SAMPLERS", "Sampler", "TeacherCredit",
    "check_fields", "check_units", "choice", "components_of", "epsilon_high", "exported_classes", "fields_read",
    "leaf_advantages", "method_of_config", "needs_entropies", "preset", "register_credit", "register_loss",
    "register_method", "register_sampler", "summary_of", "turn_credit",
]
