"""The method table: every sampler, credit and loss of the tree trainers declared once, and the named methods.

A tree trainer is three independent choices (`TreeConfig.sampler`, `.credit`, `.loss`; docs/design.md §1):

- a **sampler** grows one tree per prompt (`trl_tree.rollout.growing.samplers`);
- a **credit** maps a finished tree to per-turn values V_i (the math: `trl_tree.core.credit`);
- a **loss** adds the per-turn tensors it needs to the credit (`prepare`: teachers, aggregation weights) and computes
  a micro-batch's loss and its metrics from the flattened tensors (`compute`; the math: `trl_tree.core.losses`). What it
  adds is its own credit kind (a `trl_tree.core.batch.TurnCredit` subclass declared next to its `prepare` below), and its
  `compute` refuses a micro-batch of another kind.

Each is registered once (`register_sampler`, `register_credit`, `register_loss`) with the config fields it reads,
whether it needs per-token entropies from generation, for a sampler its leaves and its cost per prompt, and for a
loss the metric names it returns (`Loss.returns`). Registration refuses a name taken already, and a loss whose
declaration cannot hold: a clipped loss returns "clip_ratio", reads `epsilon` and `epsilon_high`, and reads a credit
kind that numbers the sequences its clip counts are per (`TurnCredit.clip_sequences`); its registered `compute`
refuses a call that returns other metrics than it declares. Every loss also declares how it trains a unit sampled by
an older behaviour policy (`Loss.staleness`, `STALE_FORMS`; a clipped loss in the decoupled form), and a loss that
declares none is refused.

The package is the machinery and the catalogue, which importing it registers:

- `registry`: the entries (`Sampler`, `Credit`, `Loss`, `Method`), the tables, `register_*`, and the questions asked
  of a configuration (`components_of`, `needs_entropies`, `fields_read`, `turn_credit`, ...);
- `sampler_entries`, `credit_entries`, `loss_entries` (with the credit kinds the losses read), `method_entries`:
  every registration, by job.
Everything that depends on the choice reads this table: config validation (`TreeConfig`), the sampler budget
arithmetic (`trainer.configuration.tree_budget`), the generation engine's entropies (`TreeTrainer.needs_entropies`), the model
card's hyperparameter rows (`trainer.model_card`), the trainer's credit and loss. The named methods (`METHODS`) are
presets of the three with their own config and trainer classes, which `trl_tree`'s exports, the command line and the
test launchers list from here.

Adding a method: its math in `trl_tree/core/credit.py` / `trl_tree/core/losses.py` (pure functions citing their equations), a
registration in the catalogue module of each new component (a loss that reads more than A declares its credit kind,
a `TurnCredit` dataclass subclass registered with `@credit_kind`, next to its `prepare` in `loss_entries`; and the
metrics it returns) and a `Method` entry in `method_entries` for a named preset. Then run the suite: the tests
enumerate the tables (tests/test_registries.py checks every credit's and every loss's properties), and those that need
something per component (a tiny configuration that trains it, its golden records) fail saying what to add.

TreeFlex is registered too (sampler "two_role", credit "search", loss "dual_clip") but keeps its own trainer:
its unit is not a rollout tree but a task's group of complete searches, each a list of causal blocks grown by a
harness, so generation (`FlexGroup` instead of `RolloutTree`) and packing (one row per block) differ; its credit and
loss are the catalogue's, applied to that unit.

Usage:

    from trl_tree import methods

    methods.METHODS["at2po"].config_class()          # AT2POConfig
    methods.SAMPLERS["entropy_guided"].fields         # the config fields it reads, with their meaning
    methods.needs_entropies(args)                    # does this configuration need per-token entropies?
"""

# importing the catalogue registers it (each table keeps its module's order, whatever the order of the modules)
from ..core.batch import TurnCredit
from .credit_entries import PENALTY_MODES, REWARD_STDS, leaf_advantages
from .loss_entries import (
    FlexCredit,
    PathCredit,
    PathWeightedCredit,
    TeacherCredit,
    clip_epsilons,
    epsilon_high,
    zero_credit_anchor,
)
from .method_entries import TREEOPSD_PAPER
from .registry import (
    CLIP_FIELDS,
    CLIP_METRIC,
    CORE_CLASSES,
    CREDITS,
    IMPORTANCE_METRIC,
    LOSSES,
    METHODS,
    SAMPLERS,
    STALE_CAP_FIELD,
    STALE_FORMS,
    STALE_TARGET_FIELD,
    ClipCounts,
    Credit,
    Largest,
    Loss,
    Method,
    Paper,
    Sampler,
    block_loss,
    check_choice,
    check_fields,
    check_units,
    choice,
    components_of,
    exported_classes,
    fields_read,
    importance_cap,
    method_of_config,
    needs_entropies,
    preset,
    register_credit,
    register_loss,
    register_method,
    register_sampler,
    stale_form,
    summary_of,
    turn_credit,
)
from .sampler_entries import ANCHOR_RULES, EXPANSION_MODES

__all__ = [
    "ANCHOR_RULES", "CLIP_FIELDS", "CLIP_METRIC", "CORE_CLASSES", "IMPORTANCE_METRIC", "CREDITS", "ClipCounts", "Credit", "EXPANSION_MODES",
    "FlexCredit", "LOSSES", "METHODS", "Loss", "Method", "PENALTY_MODES", "Paper", "PathCredit", "PathWeightedCredit",
    "REWARD_STDS", "SAMPLERS", "STALE_CAP_FIELD", "STALE_FORMS", "STALE_TARGET_FIELD", "Sampler", "TREEOPSD_PAPER",
    "TeacherCredit", "TurnCredit", "Largest",
    "block_loss", "check_choice", "check_fields", "check_units", "choice", "clip_epsilons", "components_of", "epsilon_high",
    "exported_classes", "fields_read", "importance_cap", "leaf_advantages", "method_of_config", "needs_entropies",
    "preset", "register_credit", "register_loss", "register_method", "register_sampler", "stale_form", "summary_of",
    "turn_credit", "zero_credit_anchor",
]
