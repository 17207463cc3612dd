"""The checks of the tree configs' fields, apart from the fields themselves (`trl_tree.trainer.config`).

The config module reads as the documented list of options (what `--help` and `TrlParser` show); the rules a value
must obey, and the wording of the error a wrong value raises, live here as plain functions of a config, so they can
be read, tested and reused (the CLI, evaluation scripts) without the dataclass machinery. `__post_init__` calls them;
the ones that resolve or rewrite values (budgets, branches, legacy GRPO options) stay methods of the config.
"""

from __future__ import annotations

from ..packing import PACKING_CHOICES
from ..rollout.env_branching import ENVIRONMENT_BRANCHING, check_replay_divergence
from ..rollout.prefix_cache import check_max_bytes
from ..rollout.special_tokens import check_observation_special_tokens
from ..rollout.tool_executor import check_max_concurrent_tool_calls
from ..rollout.tools import check_tool_execution
from ..rollout.turn_loop import check_chunk_tokens, check_max_tool_calls_per_turn

# The layouts `packing` takes, declared once in `trl_tree.packing` (its layouts and "auto")
PACKING_LAYOUTS = PACKING_CHOICES
MALFORMED_TOOL_CALL_POLICIES = ("observe", "end")
GENERATION_CACHES = ("prefix", "static", "dynamic")


def check_tree_fields(config) -> None:
    """The rollout fields every tree config shares (turns, tools, environment branching, generation), each refused
    here with the reason and the valid values rather than failing mid-rollout."""
    if config.max_turns is None or config.max_turns < 1:
        raise ValueError(f"max_turns must be ≥ 1 (assistant turns per trajectory); got {config.max_turns}.")
    from .components import MULTI_OBJECTIVE_AGGREGATIONS

    if config.multi_objective_aggregation not in MULTI_OBJECTIVE_AGGREGATIONS:
        raise ValueError(
            f"multi_objective_aggregation must be one of {MULTI_OBJECTIVE_AGGREGATIONS}; got "
            f"{config.multi_objective_aggregation!r}."
        )
    check_tool_execution(config.tool_execution)
    check_max_concurrent_tool_calls(config.max_concurrent_tool_calls)
    check_max_tool_calls_per_turn(config.max_tool_calls_per_turn)
    if config.malformed_tool_calls not in MALFORMED_TOOL_CALL_POLICIES:
        raise ValueError(
            f"malformed_tool_calls must be one of {MALFORMED_TOOL_CALL_POLICIES}; got {config.malformed_tool_calls!r}:"
            " 'observe' answers an unparseable tool call with an error observation, 'end' ends the trajectory."
        )
    check_observation_special_tokens(config.observation_special_tokens)
    if config.max_completion_length is None or config.max_completion_length < 1:
        raise ValueError("max_completion_length must be a positive number of tokens per trajectory.")
    if config.environment_branching not in ENVIRONMENT_BRANCHING:
        raise ValueError(
            f"environment_branching must be one of {ENVIRONMENT_BRANCHING}; got {config.environment_branching!r}: "
            "'fork' uses the environment's fork(), 'copy' copy.deepcopy, 'replay' re-runs the recorded tool calls "
            "on a fresh instance, 'auto' fork(), else a copy when nothing could be shared, else replay."
        )
    check_replay_divergence(config.replay_divergence)
    if config.max_turn_tokens is not None and config.max_turn_tokens < 1:
        raise ValueError(
            f"max_turn_tokens must be a positive number of tokens per assistant turn, or None; got "
            f"{config.max_turn_tokens}."
        )
    check_chunk_tokens(config.generation_chunk_tokens)
    check_max_bytes(config.max_prefix_cache_bytes)
    if config.generation_cache not in GENERATION_CACHES:
        raise ValueError(
            f"generation_cache must be one of {GENERATION_CACHES}; got {config.generation_cache!r}: 'prefix' reuses "
            "earlier turns' keys and values within a rollout, 'static' preallocates the KV cache of each generate "
            "call, 'dynamic' grows it token by token."
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
    """`packing` names a layout of `trl_tree.packing` or "auto"."""
    if config.packing not in PACKING_LAYOUTS:
        raise ValueError(f"packing must be one of {PACKING_LAYOUTS}; got {config.packing!r}.")
