"""The budget and batch resolutions of the tree configs, apart from the fields themselves (`trl_tree.trainer.configuration.fields`).

G (`num_generations`) and the sampler's budget field determine each other, and the batch sizes count trajectories of
that budget, as GRPO counts completions: these functions derive whichever is unset, rewrite a GRPO batch layout a
tree cannot take into the one that trains the same prompts per step, and refuse, with the settings that would work,
what no layout can hold. `__post_init__` (through the composition checks of `checks`) calls them, each with the
config as its argument; the arithmetic itself (a tree's cost, the settings that reach a G) is
`trl_tree.trainer.configuration.tree_budget`'.
"""

from __future__ import annotations

import dataclasses
import logging
from types import SimpleNamespace

from trl import GRPOConfig

from ... import methods

# The config's own logger: what the resolution says at start-up is about the config, and filters on it keep working
logger = logging.getLogger(f"{__package__}.config")

# GRPO's completions per micro-batch when unset (8 in TRL 1.x): the tree configs default to the same prompts per step
GRPO_DEFAULT_BATCH_SIZE = {f.name: f.default for f in dataclasses.fields(GRPOConfig)}["per_device_train_batch_size"]


def num_generations_for(config_class, fields: dict) -> int:
    """G that a config of `config_class` built with `fields` has, without building it: a what-if config with the
    class's defaults, the sampler fields the class resolves at construction and the class's default budget."""
    from .tree_budget import budget_field, num_generations_of

    if fields.get("num_generations") is not None:
        return fields["num_generations"]
    args = {f.name: f.default for f in dataclasses.fields(config_class) if f.default is not dataclasses.MISSING}
    probe = SimpleNamespace(**{**args, **fields})
    config_class._check_sampler_kind(probe.sampler)  # another kind's sampler reads fields this class does not have
    config_class._probe_defaults(probe)
    field_name = budget_field(probe)
    if getattr(probe, field_name) is None:
        setattr(probe, field_name, config_class._default_budget(field_name))
    return num_generations_of(probe)


def resolve_branches(config) -> None:
    """N unset: the preset's N, unless G alone is given (M unset too), the sampler lets N be derived
    (`methods.Sampler.derived`) and no M reaches G with it; then the N ≥ 1 nearest to it that does
    (`tree_budget.shape_for_generations`), so that a G GRPO accepts (3, 5, 7) is not refused for a default the user
    never chose. A user-given N is kept, and `resolve_budget` checks it."""
    from .tree_budget import budget_field, budget_for_generations, budget_formula, shape_for_generations

    if config.num_branches is not None:
        return
    preferred, G = config.default_num_branches, config.num_generations
    config.num_branches = preferred
    derives_n = "num_branches" in methods.SAMPLERS[config.sampler].derived
    if (not derives_n or getattr(config, budget_field(config)) is not None or not isinstance(G, int) or G < 1
            or budget_for_generations(config, G) is not None):
        return
    chosen = shape_for_generations(config, G, "num_branches", preferred)
    if chosen is None:
        return  # no (M, N) gives G: `resolve_budget` raises, listing the settings that do
    M, config.num_branches = chosen
    logger.warning(
        f"num_generations={G} → M={M}, N={config.num_branches}: no M gives G = {G} with the default N = {preferred} "
        f"(a tree costs {budget_formula(config.sampler)} trajectories), so N = {config.num_branches} (K = "
        f"{M * (config.num_branches + 1)} leaves per tree)."
        " Set num_initial_rollouts and num_branches to choose another split."
    )


def resolve_budget(config) -> None:
    """num_generations ↔ the sampler's budget: derive whichever is unset, or check that the two agree."""
    from .tree_budget import budget_field, budget_for_generations, budget_formula, num_generations_of, valid_budgets

    name = budget_field(config)
    G = config.num_generations
    if G is not None and (not isinstance(G, int) or G < 1):
        raise ValueError(f"num_generations must be a whole number of trajectories ≥ 1; got {G!r}.")
    if getattr(config, name) is None:
        setattr(config, name, config._default_budget(name) if G is None else budget_for_generations(config, G))
    if getattr(config, name) is not None and G in (None, num_generations_of(config)):
        config.num_generations = num_generations_of(config)
        return
    options = valid_budgets(config, G)
    given = f"{name}={getattr(config, name)} costs {num_generations_of(config)}" if getattr(config, name) else (
        f"no {name} ≥ 1 costs exactly that")
    raise ValueError(
        f"num_generations={G} is the rollout budget per prompt in complete trajectories; for sampler="
        f"{config.sampler!r} a tree costs {budget_formula(config.sampler)} (rounded up), and {given}. "
        + (f"Settings that give G = {G}: {'; '.join(options)}. " if options else
           f"No setting of {name} gives G = {G} with the other sampler fields as they are. ")
        + f"Set those, or leave num_generations unset to derive it from {name}."
    )


def resolve_micro_batch(config) -> None:
    """Trees stay whole in a micro-batch: per_device_train_batch_size must be a multiple of G (and so must
    per_device_eval_batch_size when evaluating: GRPO's loader gives each evaluation prompt G rows)."""
    if config.per_device_train_batch_size is None:
        # GRPO's default 8 completions per micro-batch, i.e. the same 8 / G prompts per step as GRPO, wherever
        # that holds whole trees; otherwise one tree (GRPO's 8 with such a G fails its own generation-batch check)
        G = config.num_generations
        config.per_device_train_batch_size = GRPO_DEFAULT_BATCH_SIZE if GRPO_DEFAULT_BATCH_SIZE % G == 0 else G
    G, size = config.num_generations, config.per_device_train_batch_size
    if config.num_generations_eval not in (None, G):
        raise ValueError(
            f"num_generations_eval ({config.num_generations_eval}) differs from num_generations ({G}): evaluation "
            "grows the same trees as training (the sampler fields set their size), so leave num_generations_eval "
            "unset."
        )
    evaluates = getattr(config.eval_strategy, "value", config.eval_strategy) != "no"
    if evaluates and config.per_device_eval_batch_size % G != 0:
        raise ValueError(
            f"per_device_eval_batch_size ({config.per_device_eval_batch_size}) counts trajectories, as in GRPO: it "
            f"must be a multiple of num_generations ({G}) so that evaluation batches hold whole trees."
        )
    if size >= G and size % G == 0:
        return
    accumulation = config.gradient_accumulation_steps
    per_generation = config.steps_per_generation or accumulation
    if config.generation_batch_size is None and (size * accumulation) % G == 0 and (size * per_generation) % G == 0:
        # GRPO accepts this: a group of G completions spans micro-batches as long as the optimizer step and the
        # generation batch hold whole groups. A tree is trained in one packed forward and cannot be split, so the
        # same prompts per optimizer step and per generation batch train as one whole tree per micro-batch with
        # proportionally less accumulation: the same optimizer steps, schedule and logs; the micro-batch (and its
        # memory) is one tree.
        config.per_device_train_batch_size = G
        config.gradient_accumulation_steps = size * accumulation // G
        if config.steps_per_generation is not None:
            config.steps_per_generation = size * per_generation // G
        logger.warning(
            f"per_device_train_batch_size={size} is below num_generations={G}: GRPO spreads a group over "
            f"micro-batches, a tree cannot be split, so each micro-batch is one whole tree "
            f"(per_device_train_batch_size={G}, gradient_accumulation_steps={config.gradient_accumulation_steps}"
            + (f", steps_per_generation={config.steps_per_generation}" if config.steps_per_generation else "")
            + f"): the same {size * accumulation // G} prompt(s) per optimizer step and "
            f"{size * per_generation // G} per generation batch as GRPO's settings."
        )
        return
    below, above = (size // G) * G, (size // G + 1) * G
    nearest = f"{above}" if below == 0 else f"{below} or {above}"
    divisors = [d for d in range(2, size + 1) if size % d == 0]
    raise ValueError(
        f"per_device_train_batch_size ({size}) counts trajectories, as in GRPO: a micro-batch holds "
        f"per_device_train_batch_size / num_generations whole trees, so it must be a multiple of num_generations "
        f"({G}). Set per_device_train_batch_size to {nearest}"
        + (f", or choose sampler fields whose num_generations divides {size} (one of {divisors})." if divisors
           else ".")
    )


def check_optimizer_blocks(config) -> None:
    """After GRPOConfig has resolved steps_per_generation: each optimizer block (the paper's E, one optimizer step
    on a mini-batch of whole trees) is a whole number of micro-batches."""
    if config.steps_per_generation % config.gradient_accumulation_steps != 0:
        raise ValueError(
            f"steps_per_generation ({config.steps_per_generation}) must be a multiple of gradient_accumulation_steps "
            f"({config.gradient_accumulation_steps}): each optimizer block is a whole number of micro-batches."
        )
