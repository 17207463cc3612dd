"""The registry machinery: what a sampler, credit, loss and named method are (`Sampler`, `Credit`, `Loss`,
`Method`), the tables they are registered in, the registration functions that refuse a taken name or an inconsistent
loss declaration, and the questions the trainer, config and model card ask of a configuration. The entries themselves
are the catalogue modules next to this one (`trl_tree.methods`' docstring)."""

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

from ..core import losses
from ..core.batch import CREDIT_KINDS, LossInputs, TurnCredit

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
            the quantity it backs up to turns. Every credit declares it (the catalogue's standardising credits pass
            `leaf_advantages`), so the pages never show numbers a credit never used.
        check: `(args) -> None`: validation of its own `fields` (run only when it is the chosen credit).
        applies_penalties: whether its values add the turns' process penalties Q (`Turn.penalty`, recorded on
            failed or malformed tool calls whatever the method): the rollout-tree pages show a turn's Q only then,
            so a page never shows a penalty its credit did not apply.
    """

    name: str
    values: Callable[[Any, Any], Tensor]
    fields: dict[str, str]
    view: Callable[[Any, Any], Tensor]
    needs_entropies: bool = False
    unit: str = "tree"
    check: Callable[[Any], None] = lambda args: None
    applies_penalties: bool = False

    @property
    def summary(self) -> str:
        return summary_of(self.values)


CLIP_METRIC = "clip_ratio"
CLIP_FIELDS = ("epsilon", "epsilon_high")


class ClipCounts(NamedTuple):
    """A loss metric: per root-to-leaf path (or search) its low-clipped, high-clipped and trained token counts
    [n_paths, 3] (`losses.path_clip_counts`), logged as GRPO's `clip_ratio/*` over every rank's paths."""

    counts: Tensor


class Largest(NamedTuple):
    """A metric logged as the largest of every rank's values (a plain tensor metric is their mean)."""

    values: Tensor


# How a loss trains a unit sampled by an older behaviour policy μ (π_old: the policy at the start of the batch's
# optimizer blocks; docs/design.md §3, "Stale samples"). A loss declares the forms it supports, the first its own.
STALE_FORMS = {
    "behaviour": "its log-ratio (and teacher) measured against the behaviour policy μ that sampled the unit",
    "decoupled": "its ratio against π_old, times the truncated importance weight min(π_old/μ, C), detached",
}
STALE_CAP_FIELD = {
    "behaviour_importance_cap": "C: a stale token's importance weight min(π_old/μ, C) is truncated at C (≥ 1)",
}
STALE_TARGET_FIELD = {
    "stale_target": "which policy a stale unit's log-ratio is measured against: behaviour (μ) | decoupled (π_old, "
                    "weighted by min(π_old/μ, C)); None: the loss's own",
}


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
        returns: the metric names `compute` returns, declared so that registration can check them against the
            fields and the credit kind, and the registered `compute` refuses a call that returns others. A clipped
            loss returns "clip_ratio" (`ClipCounts`), reads `epsilon` and `epsilon_high`, and needs a credit kind
            that numbers the sequences the counts are per (`TurnCredit.clip_sequences`).
        fields: the config fields it reads → their meaning.
        credit_metrics: `(credits: list[TurnCredit]) -> metrics` of a generation batch's prepared credit, logged
            like `compute`'s besides the mean |A| every loss gets.
        check: `(args) -> None`, raising a `ValueError` that names the field when the configuration cannot train
            with this loss (run by config validation).
        staleness: the forms (`STALE_FORMS`) in which it trains a unit sampled by an older behaviour policy, its
            own first; `stale_form(args, name)` is the one a configuration trains with. Declared by every loss and
            checked at registration: a clipped loss is "decoupled" only (its clip is a trust region around π_old),
            "decoupled" reads `behaviour_importance_cap`, and a loss with several forms reads `stale_target`.
        linear_in_credit: at its first block (θ = θ_old, fresh units) its gradient is linear in the credit and is
            the policy gradient: ∂loss/∂log π_θ of each trained token of turn i is −c·A_i with c > 0 (zero where
            A_i = 0). The suite checks it of every loss that declares it (tests/test_registries.py); a loss with a
            term that is not (a KL to a reference policy, an entropy bonus) declares False.
    """

    name: str
    prepare: Callable[[Any, Tensor, Any], TurnCredit]
    compute: Callable[[LossInputs, Any], tuple[Tensor, dict[str, Any]]]
    fields: dict[str, str]
    staleness: tuple[str, ...]
    credit_kind: type[TurnCredit] = TurnCredit
    returns: tuple[str, ...] = ()
    unit: str = "tree"
    credit_metrics: Callable[[list[TurnCredit]], dict[str, Any]] = lambda credits: {}
    check: Callable[[Any], None] = lambda args: None
    linear_in_credit: bool = True

    @property
    def clipped(self) -> bool:
        return CLIP_METRIC in self.returns

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
    """Decorator: register `values(unit, args) -> V` as the credit `name`, with the per-leaf values it backs up
    (`view`, see `Credit`) and its other `Credit` attributes as keywords."""
    _free(CREDITS, "credit", name)
    if not callable(spec.get("view")):
        raise ValueError(f"Credit {name!r} declares no view: pass view=(unit, args) -> [K], the per-leaf values it "
                         "backs up to turns, which the rollout-tree pages show (a credit of standardised leaf "
                         "rewards: view=trl_tree.methods.leaf_advantages).")

    def register(values):
        CREDITS[_free(CREDITS, "credit", name)] = Credit(name=name, values=values, **spec)
        return values

    return register


def _check_loss_declaration(name: str, credit_kind: type[TurnCredit], returns: tuple[str, ...],
                            fields: dict[str, str]) -> None:
    """Refuse a loss whose declaration cannot hold at run time: the clip metrics, the clip fields and the credit
    kind go together (a clipped loss found otherwise only as a KeyError deep in a training step); the credit kind is
    a registered one (its micro-batches travel by its name: `trl_tree.core.batch.credit_kind`)."""
    if CREDIT_KINDS.get(getattr(credit_kind, "__name__", None)) is not credit_kind:
        raise ValueError(f"Loss {name!r} reads the credit kind {credit_kind!r}, which is not registered: decorate it "
                         "with `@trl_tree.core.batch.credit_kind` (above @dataclass), next to its `prepare`.")
    clipped = CLIP_METRIC in returns
    missing = [f for f in CLIP_FIELDS if f not in fields]
    if clipped and missing:
        raise ValueError(f"Loss {name!r} returns {CLIP_METRIC!r} but does not read {', '.join(missing)}: a clipped "
                         "loss declares the clip range it counts against (fields={**_CLIP, ...}).")
    if not clipped and "epsilon" in fields:
        raise ValueError(f"Loss {name!r} reads 'epsilon' but does not declare returns=({CLIP_METRIC!r}, ...): a "
                         "clipped loss logs GRPO's clip_ratio/* (return ClipCounts under that name) and declares it.")
    if clipped and not credit_kind.clip_sequences:
        kinds = sorted({loss.credit_kind.__name__ for loss in LOSSES.values() if loss.credit_kind.clip_sequences})
        raise ValueError(f"Loss {name!r} returns {CLIP_METRIC!r}, counted per sequence, but its credit kind "
                         f"{credit_kind.describe()} numbers none (`clip_sequences` is empty): use a kind that does "
                         f"({', '.join(kinds)}) or a subclass of one, with a `prepare` that builds it.")


def _check_staleness_declaration(name: str, staleness: tuple[str, ...], returns: tuple[str, ...],
                                 fields: dict[str, str]) -> None:
    """Refuse a loss that does not say how it trains a stale unit, or says it in a form that cannot hold: every loss
    trains trees that an asynchronous producer may have sampled with an older policy (docs/design.md §3, "Stale
    samples"), so none may leave it to chance."""
    forms = ", ".join(f"{form!r} ({meaning})" for form, meaning in STALE_FORMS.items())
    if not staleness:
        raise ValueError(f"Loss {name!r} declares no staleness treatment: register it with staleness=(FORM, ...), "
                         f"the forms in which it trains a unit sampled by an older behaviour policy μ, its own "
                         f"first; the forms: {forms}.")
    unknown = [form for form in staleness if form not in STALE_FORMS]
    if unknown or len(set(staleness)) != len(staleness):
        raise ValueError(f"Loss {name!r} declares staleness={staleness}: each form once, among {forms}.")
    if CLIP_METRIC in returns and staleness != ("decoupled",):
        raise ValueError(f"Loss {name!r} returns {CLIP_METRIC!r}, so its ratio is clipped to a trust region around "
                         f"π_old, but declares staleness={staleness}: a clipped loss trains stale samples in the "
                         "decoupled form only, staleness=('decoupled',) (the ratio against π_old, times the "
                         "truncated weight min(π_old/μ, C)).")
    missing = [f for f in (*(STALE_CAP_FIELD if "decoupled" in staleness else {}),
                           *(STALE_TARGET_FIELD if len(staleness) > 1 else {})) if f not in fields]
    if missing:
        raise ValueError(f"Loss {name!r} declares staleness={staleness} but does not read {', '.join(missing)}: the "
                         "decoupled form reads its truncation cap (fields={**STALE_CAP_FIELD, ...}), a loss with "
                         "several forms the choice among them (fields={**STALE_TARGET_FIELD, ...}).")


def register_loss(name: str, *, prepare: Callable, staleness: tuple[str, ...] = (),
                  credit_kind: type[TurnCredit] = TurnCredit, returns: tuple[str, ...] = (),
                  fields: dict[str, str] | None = None, **spec) -> Callable:
    """Decorator: register `compute(batch, args) -> (loss, metrics)` as the loss `name`, with its `prepare`, the
    forms in which it trains stale samples (`Loss.staleness`), the credit kind both share and the metric names it
    returns (`Loss.returns`), refusing an inconsistent declaration. The registered `compute` checks the micro-batch's
    kind first (`TurnCredit.require`) and the metric names it returns after (a set comparison per micro-batch)."""
    _free(LOSSES, "loss", name)
    returns, fields, staleness = tuple(returns), dict(fields or {}), tuple(staleness)
    _check_loss_declaration(name, credit_kind, returns, fields)
    _check_staleness_declaration(name, staleness, returns, fields)

    def register(compute):
        @functools.wraps(compute)
        def checked(batch: LossInputs, args):
            credit_kind.require(batch.credit, f"the {name!r} loss")
            loss, metrics = compute(batch, args)
            if metrics.keys() != set(returns):
                raise ValueError(f"Loss {name!r} returned the metrics {sorted(metrics)} but declares "
                                 f"returns={returns}: declare what compute returns in its register_loss.")
            return loss, metrics

        LOSSES[_free(LOSSES, "loss", name)] = Loss(name=name, prepare=prepare, compute=checked, fields=fields,
                                                   staleness=staleness, credit_kind=credit_kind, returns=returns,
                                                   **spec)
        return compute

    return register


def register_method(method: Method) -> Method:
    METHODS[_free(METHODS, "method", method.name)] = method
    return method


def check_choice(name: str, value, valid: tuple) -> None:
    """A component's check of a config field that takes one of `valid`."""
    if value not in valid:
        raise ValueError(f"{name} must be one of {valid}; got {value!r}.")


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


CORE_CLASSES = {
    "TreeConfig": "trl_tree.trainer.configuration.fields:TreeConfig",
    "TreeTrainer": "trl_tree.trainer.base:TreeTrainer",
}


def check_fields(args) -> None:
    """Each chosen component's validation of its own fields (`Sampler.check`, `Credit.check`, `Loss.check`), and the
    chosen loss's staleness fields (`stale_form`, `importance_cap`): the fields of components not chosen are not
    read, so they are not checked either."""
    for component in components_of(args):
        component.check(args)
    stale_form(args, args.loss)
    if "decoupled" in LOSSES[args.loss].staleness:
        importance_cap(args)


def stale_form(args, loss: str) -> str:
    """The form (`STALE_FORMS`) in which the loss `loss` trains a stale unit under `args`: `stale_target` when set
    (one of the forms the loss declares), else the loss's own, the first it declares."""
    forms = LOSSES[loss].staleness
    chosen = getattr(args, "stale_target", None)
    if chosen is None:
        return forms[0]
    if chosen not in forms:
        raise ValueError(f"stale_target={chosen!r}, but the {loss!r} loss trains stale samples only in the form"
                         f"{'s' if len(forms) > 1 else ''} {', '.join(map(repr, forms))} (None: its own, "
                         f"{forms[0]!r}).")
    return chosen


def importance_cap(args) -> float:
    """C of the decoupled form's weight min(π_old/μ, C), checked: a finite number ≥ 1, so that a fresh sample's
    weight, exactly 1, is never cut (at staleness 0 every loss is then exactly its synchronous self)."""
    cap = args.behaviour_importance_cap
    if isinstance(cap, bool) or not isinstance(cap, (int, float)) or not 1.0 <= cap < float("inf"):
        raise ValueError(f"behaviour_importance_cap C truncates a stale token's importance weight min(π_old/μ, C): "
                         f"it must be a finite number ≥ 1 (a fresh token's weight is 1 and must not be cut); got "
                         f"{cap!r}.")
    return float(cap)

IMPORTANCE_METRIC = "sampling/importance_sampling_ratio"  # GRPOTrainer's name for its truncated π_old/μ weights


def block_loss(batch: LossInputs, args) -> tuple[Tensor, dict]:
    """The configured loss of one micro-batch (`LOSSES[args.loss]`) and its metrics, with every method's mean |s_i|,
    the turns' log-ratio against π_old, and the trained tokens' truncated importance weights min(π_old/μ, C) (mean,
    max, and the fraction cut at C; named as GRPOTrainer names its own, all 1 and 0 for a fresh batch), under names
    with "{block}" for the optimizer block the caller logs them at.

    The micro-batch is the pipeline's (`trl_tree.core.pipeline.loss_inputs`); which loss trains it is the method
    table's answer, so this lives with the table and the core imports no catalogue."""
    loss, loss_metrics = LOSSES[args.loss].compute(batch, args)
    with torch.no_grad():
        s = losses.turn_mean_log_ratio(batch.logps, batch.old_logps, batch.turn_ids, batch.num_turns)
        cap = importance_cap(args)
        weights = losses.truncated_importance_weights(batch.old_logps, batch.behaviour_logps, cap)
        truncated = (batch.old_logps - batch.behaviour_logps).exp() > cap
    loss_metrics["tree/abs_log_ratio/block_{block}"] = s.abs()
    loss_metrics[IMPORTANCE_METRIC + "/mean/block_{block}"] = weights
    loss_metrics[IMPORTANCE_METRIC + "/max/block_{block}"] = Largest(weights)
    loss_metrics[IMPORTANCE_METRIC + "/truncated_fraction/block_{block}"] = truncated.float()
    return loss, loss_metrics


def exported_classes() -> dict[str, str]:
    """Every public config and trainer class of `trl_tree` → "module:Class"."""
    out = dict(CORE_CLASSES)
    for m in METHODS.values():
        out[f"{m.title}Config"], out[f"{m.title}Trainer"] = m.config, m.trainer
    return out


def method_of_config(config) -> Method | None:
    """The named method whose config class is exactly `type(config)`, or None (a plain `TreeConfig`)."""
    return next((m for m in METHODS.values() if type(config) is m.config_class()), None)
