"""The checks of the tree configs' fields, apart from the fields themselves (`trl_tree.trainer.configuration.fields`).

The config module reads as the documented list of options (what `--help` and `TrlParser` show); the rules a value
must obey, and the wording of the error a wrong value raises, live here as plain functions of a config, so they can
be read, tested and reused (the CLI, evaluation scripts) without the dataclass machinery. `__post_init__` calls them,
each with the config as its argument: the composition (components, sampler kind, the method table's own field checks,
ending with the budget of `resolution`), the rollout fields, the generation kwargs and packing, and the GRPO options
a tree trainer maps (`max_tool_calling_iterations`) or refuses. The per-class hooks (`_check_composition`,
`_check_sampler_kind`, `_default_budget`) stay methods that delegate here, since overriding them is how a config class
customises its checks.
"""

from __future__ import annotations

import dataclasses
import math

from trl import GRPOConfig

from ... import methods
from ...core.packing import PACKING_CHOICES
from ...rollout.acting.env_branching import ENVIRONMENT_BRANCHING, check_replay_divergence
from ...rollout.acting.special_tokens import check_observation_special_tokens
from ...rollout.acting.tool_executor import check_max_concurrent_tool_calls
from ...rollout.acting.tools import check_tool_execution, check_tool_timeout
from ...rollout.generating.prefix_cache import check_max_bytes
from ...rollout.growing.turn_loop import check_chunk_tokens, check_max_tool_calls_per_turn
from .resolution import resolve_branches, resolve_budget

# The layouts `packing` takes, declared once in `trl_tree.core.packing` (its layouts and "auto")
PACKING_LAYOUTS = PACKING_CHOICES
MALFORMED_TOOL_CALL_POLICIES = ("observe", "end")
GENERATION_CACHES = ("prefix", "static", "dynamic")
# where the rollout worker generates (`async_rollouts`): in its thread, or in a child process (`engine_process`)
ROLLOUT_GENERATIONS = ("thread", "process")

_GRPO_DEFAULTS = {f.name: f.default for f in dataclasses.fields(GRPOConfig)}
# GRPO options without an effect on any tree trainer, and what to use instead (`unused_grpo_options`)
UNUSED_GRPO_OPTION_ADVICE = {
    "loss_type": "the aggregation is the chosen `loss`'s own (treeopsd/treepo: token mean per tree; atpo/grpo/"
    "gspo_token: GRPO's mean over root-to-leaf paths; TreeFlex: `aggregation`): choose it with `loss`.",
    "scale_rewards": "leaves are always standardised over their tree: choose the std with reward_std ('sample' or "
    "'population').",
    "delta": "no tree loss has the two-sided upper clip; the clipped losses take epsilon and epsilon_high.",
    "importance_sampling_level": "the ratio's level is the loss's: loss='gspo_token' (GSPO-token over paths), "
    "'atpo' (one ratio per turn) or 'grpo' (per token).",
    "beta": "the tree losses bound each update themselves (a frozen teacher or a clip) and train without a "
    "reference-model KL: set beta=0.0.",
    "num_iterations": "repeated optimisation on one generation batch is done by sequential optimizer blocks: set "
    "steps_per_generation = E × gradient_accumulation_steps and keep num_iterations = 1.",
    "top_entropy_quantile": "every unique turn is trained; the turn-level loss has no token entropy mask.",
    "entropy_coef": "the tree losses have no entropy bonus.",
    "use_adaptive_entropy": "the tree losses have no entropy bonus.",
    "off_policy_mask_threshold": "π_old is recomputed per micro-batch in the packed forward (the first block's "
    "log-ratio is exactly 0); there is no off-policy sequence mask.",
    "use_transformers_continuous_batching": "tree sampling continues token-id prefixes with model.generate or vLLM: set "
    "use_vllm=True for throughput, or leave it off.",
}


# GRPO's `multi_objective_aggregation` choices (`scoring.aggregate_leaf_rewards` implements them)
MULTI_OBJECTIVE_AGGREGATIONS = ("sum_then_normalize", "normalize_then_sum")


def _as_grpo_reads(name: str, value):
    """GRPOConfig's own mapping of a legacy value (scale_rewards=True is "group", False is "none")."""
    if name == "scale_rewards" and isinstance(value, bool):
        return "group" if value else "none"
    return value


def harnesses() -> tuple[str, ...]:
    """TreeFlex's built-in harnesses: the samplers of the method table that grow groups of complete searches."""
    return tuple(name for name, s in methods.SAMPLERS.items() if s.unit == "group")


def check_components(config) -> None:
    """sampler, credit and loss are registered in `trl_tree.methods` and train the same kind of unit."""
    methods.components_of(config)
    methods.check_units(config)


def check_tree_sampler(sampler: str) -> None:
    """A tree config trains tree samplers; TreeFlex's harnesses have their own config and trainer."""
    if methods.choice("sampler", sampler).unit != "tree":
        raise ValueError(
            f"sampler={sampler!r} is TreeFlex's harness: use TreeFlexConfig and TreeFlexTrainer for it."
        )


def check_harness(sampler: str) -> None:
    """TreeFlexConfig's sampler is one of the built-in harnesses (`harnesses`)."""
    check_choice("sampler", sampler, harnesses())


def check_tree_composition(config) -> None:
    """A tree config's components, checked and resolved: registered and of the tree kind, N and then the budget
    resolved (the method table's field checks in between, as the budget arithmetic needs valid shapes), and a tree
    with M ≥ 1 and K ≥ 2 leaves to standardise over."""
    check_components(config)
    config._check_sampler_kind(config.sampler)
    sampler = methods.SAMPLERS[config.sampler]
    resolve_branches(config)
    methods.check_fields(config)  # before the budget arithmetic, which needs valid shapes
    resolve_budget(config)
    if config.num_initial_rollouts < 1:
        raise ValueError(f"num_initial_rollouts (M) must be ≥ 1; got {config.num_initial_rollouts}.")
    if config.leaves_per_tree < 2:
        raise ValueError(
            f"A tree needs K ≥ 2 leaves to standardise rewards; this configuration gives K = {config.leaves_per_tree}"
            f" (sampler={config.sampler!r}: K = {sampler.leaves_formula}, M = {config.num_initial_rollouts})."
        )


def check_flex_composition(config) -> None:
    """TreeFlex's composition: its credit and loss fixed to F1–F3, a built-in harness, the harness's, the search
    credit's and the dual clip's own fields, the budget K ≥ 2 searches, and a process penalty Q ≤ 0."""
    preset = methods.METHODS["treeflex"]
    fixed = {"credit": (preset.credit, config.credit), "loss": (preset.loss, config.loss)}
    for name, (want, value) in fixed.items():
        if value != want:
            raise ValueError(
                f"TreeFlexConfig.{name} is fixed to {want!r} (got {value!r}): TreeFlex's credit and loss are F1–F3;"
                " vary them with penalty_mode, aggregation, role_lambda and dual_clip_c."
            )
    config._check_sampler_kind(config.sampler)
    check_components(config)
    methods.check_fields(config)  # the harness's, the search credit's and the dual clip's own fields
    resolve_budget(config)
    if config.num_searches < 2:
        raise ValueError(
            f"num_searches (K) must be ≥ 2: the group compares complete searches; got {config.num_searches}."
        )
    if config.tool_failure_penalty > 0:
        raise ValueError(f"tool_failure_penalty is a process penalty Q ≤ 0; got {config.tool_failure_penalty}.")


def apply_tool_calling_iterations(config) -> None:
    """TRL's tool loop runs at most k = max_tool_calling_iterations rounds of tool execution, each followed by one
    more generation, so a trajectory has at most k + 1 assistant turns: exactly `max_turns` = k + 1 (a tool call
    in the last allowed turn ends the trajectory unexecuted, as TRL leaves it)."""
    k = config.max_tool_calling_iterations
    if k is None or not config.maps_tool_calling_iterations:
        if config.max_turns is None:
            config.max_turns = config.default_max_turns
        return
    if not isinstance(k, int) or k < 0:
        raise ValueError(f"max_tool_calling_iterations must be a whole number ≥ 0; got {k!r}.")
    if config.max_turns is not None and config.max_turns != k + 1:
        raise ValueError(
            f"max_tool_calling_iterations={k} allows {k + 1} assistant turns per trajectory (k tool rounds and the "
            f"answer), but max_turns={config.max_turns}: set only one of them (max_turns = k + 1)."
        )
    config.max_turns = k + 1


def check_rollout_numbers(config) -> None:
    """The numeric rollout fields have the type and range they are used with: a string, a bool, NaN or infinity
    would otherwise fail mid-rollout (or, for `tool_timeout`, switch the deadline off without a word)."""
    check_tool_timeout(config.tool_timeout)
    counts = {"max_turns": False, "max_completion_length": False, "max_observation_chars": True,
              "max_turn_tokens": True, "generation_chunk_tokens": True}
    for name, optional in counts.items():
        value = getattr(config, name)
        if value is None and optional:
            continue
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(
                f"{name} must be a positive whole number{' or None' if optional else ''}; got {value!r} "
                f"({type(value).__name__})."
            )
    penalty = config.tool_failure_penalty
    if isinstance(penalty, bool) or not isinstance(penalty, (int, float)) or not math.isfinite(penalty):
        raise ValueError(f"tool_failure_penalty must be a finite number; got {penalty!r} ({type(penalty).__name__}).")


def check_tree_fields(config) -> None:
    """The rollout fields every tree config shares (turns, tools, environment branching, generation), each refused
    here with the reason and the valid values rather than failing mid-rollout."""
    check_rollout_numbers(config)
    if config.max_turns is None or config.max_turns < 1:
        raise ValueError(f"max_turns must be ≥ 1 (assistant turns per trajectory); got {config.max_turns}.")
    check_choice("multi_objective_aggregation", config.multi_objective_aggregation, MULTI_OBJECTIVE_AGGREGATIONS)
    check_tool_execution(config.tool_execution)
    check_max_concurrent_tool_calls(config.max_concurrent_tool_calls)
    check_max_tool_calls_per_turn(config.max_tool_calls_per_turn)
    check_choice("malformed_tool_calls", config.malformed_tool_calls, MALFORMED_TOOL_CALL_POLICIES,
                 "'observe' answers an unparseable tool call with an error observation, 'end' ends the trajectory.")
    check_observation_special_tokens(config.observation_special_tokens)
    if config.max_completion_length is None or config.max_completion_length < 1:
        raise ValueError("max_completion_length must be a positive number of tokens per trajectory.")
    check_choice("environment_branching", config.environment_branching, ENVIRONMENT_BRANCHING,
                 "'fork' uses the environment's fork(), 'copy' copy.deepcopy, 'replay' re-runs the recorded tool calls "
                 "on a fresh instance, 'auto' fork(), else a copy when nothing could be shared, else replay.")
    check_replay_divergence(config.replay_divergence)
    if config.max_turn_tokens is not None and config.max_turn_tokens < 1:
        raise ValueError(
            f"max_turn_tokens must be a positive number of tokens per assistant turn, or None; got "
            f"{config.max_turn_tokens}."
        )
    check_chunk_tokens(config.generation_chunk_tokens)
    check_max_bytes(config.max_prefix_cache_bytes)
    check_choice("generation_cache", config.generation_cache, GENERATION_CACHES,
                 "'prefix' reuses earlier turns' keys and values within a rollout, 'static' preallocates the KV cache "
                 "of each generate call, 'dynamic' grows it token by token.")


def check_choice(name: str, value, choices, meaning: str = "") -> None:
    """`value` of the field `name` is one of `choices`, else a ValueError naming all of them and, when given, what
    each `meaning`."""
    if value not in choices:
        raise ValueError(f"{name} must be one of {choices}; got {value!r}" + (f": {meaning}" if meaning else "."))


def check_rollout_generation(config) -> None:
    """`rollout_generation` names a place the rollout worker generates in, and "process" has a worker to serve.
    What else it cannot serve (vLLM, several processes, a custom engine, a GPU) is refused by the trainer
    (`trl_tree.trainer.async_rollouts.unsupported_process`), which knows the run."""
    check_choice("rollout_generation", config.rollout_generation, ROLLOUT_GENERATIONS,
                 "'thread' generates in the rollout worker's thread, 'process' in a child process.")
    if config.rollout_generation == "process" and config.max_staleness == 0:
        raise ValueError(
            "rollout_generation=\"process\" (the rollout worker's generation in a child process) cannot serve this "
            "run: max_staleness=0 has no rollout worker (the trainer generates in its own thread). Set "
            "max_staleness >= 1, or use rollout_generation=\"thread\"."
        )


def check_generation_kwargs(config) -> None:
    """A tree grows by continuing each prefix with one sampled (or greedy) sequence: beam search and several
    returned sequences per prefix give rows that belong to no branch (and a KV cache expanded per beam, which the
    prefix store cannot splice), so they are refused here rather than failing mid-rollout."""
    kwargs = config.generation_kwargs or {}
    for name in ("num_beams", "num_return_sequences"):
        value = kwargs.get(name)
        if value is not None and value != 1:
            raise ValueError(
                f"generation_kwargs {name}={value} is not supported: tree sampling needs one sampled sequence per "
                "prefix (each continuation is one branch of the tree; more branches come from the sampler fields, "
                "e.g. num_initial_rollouts and num_branches). Remove it or set it to 1; greedy decoding "
                "(do_sample=False) and the sampling options (temperature, top_p, top_k, ...) are fine."
            )


def check_packing(config) -> None:
    """`packing` names a layout of `trl_tree.core.packing` or "auto"."""
    check_choice("packing", config.packing, PACKING_LAYOUTS)


def unused_grpo_options(config) -> dict[str, str]:
    """GRPO options that would change nothing here, set to something other than GRPOConfig's default, with what
    to use instead. "Set" compares with GRPOConfig's own default (`scale_rewards=True` is "group")."""
    found = {
        name: advice for name, advice in sorted(UNUSED_GRPO_OPTION_ADVICE.items())
        if _as_grpo_reads(name, getattr(config, name)) != _GRPO_DEFAULTS[name]
    }
    if not methods.choice("loss", config.loss).clipped:
        clipped = [name for name, loss in methods.LOSSES.items() if loss.clipped and loss.unit == "tree"]
        for name in ("epsilon", "epsilon_high"):
            if getattr(config, name) != _GRPO_DEFAULTS[name]:
                found[name] = (
                    f"the {config.loss!r} loss has no ratio clip (its teacher / fixed credit bounds the update); the "
                    f"clipped losses {', '.join(map(repr, clipped))} read it."
                )
    if config.max_tool_calling_iterations is not None and not config.maps_tool_calling_iterations:
        found["max_tool_calling_iterations"] = (
            "a search is several causal blocks here: cap tool use per block with max_turns and the blocks with "
            "max_blocks."
        )
    if config.use_vllm and config.vllm_importance_sampling_correction:
        found["vllm_importance_sampling_correction"] = (
            "π_old is recomputed by the training model in the packed forward and vLLM's sampling log-probs are not "
            "used, so no correction is applied: set it to False."
        )
    return found


def reject_unused_grpo_options(config) -> None:
    """Every GRPO option the config sets to no effect (`config.unused_grpo_options()`), named in one error with
    what to use instead, so a GRPO config carried over learns all of them at once."""
    found = config.unused_grpo_options()
    if found:
        lines = "\n".join(f"  - {name}={getattr(config, name)!r}: {advice}" for name, advice in found.items())
        raise ValueError(
            f"{type(config).__name__} does not use these GRPO options (they would change nothing); unset them:\n"
            f"{lines}"
        )
