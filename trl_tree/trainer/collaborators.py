"""What each of the tree trainer's collaborators reads from GRPOTrainer, in one place (docs/design.md §2).

`PromptRenderer`, `RootEnvironments` and `LeafScorer` take explicit constructor arguments, so each can be built and
tested without a trainer; these functions are the wiring: which of GRPOTrainer's attributes and private buffers
(reached only through `trl_internals`) each one gets. Callables, not values, where TRL may replace the object later
(its completion logs and metrics buffers are re-created by `_resize_completion_logs` and by resume).
"""

from __future__ import annotations

from .. import trl_internals
from .environments import RootEnvironments
from .prompts import PromptRenderer
from .scoring import LeafScorer


def leaf_scorer(trainer) -> LeafScorer:
    """TRL's reward computation, weights, aggregation and the buffers reward functions log into."""
    return LeafScorer(
        accelerator=trainer.accelerator, reward_weights=trainer.reward_weights,
        calculate_rewards=lambda *rows: trl_internals.calculate_rewards(trainer, *rows),
        aggregation=trainer.multi_objective_aggregation,
        pending_logs=lambda: trl_internals.pending_reward_logs(trainer),
        completion_logs=lambda: trl_internals.completion_logs(trainer),
        metrics=lambda mode: trl_internals.metrics(trainer, mode),
    )


def prompt_renderer(trainer) -> PromptRenderer:
    """TRL's prompt tokenization (chat template, tool schemas), the model whose positions bound the prompts, and the
    completion budget."""
    return PromptRenderer(
        tokenize=lambda prompts: trl_internals.tokenize_prompts(trainer, prompts),
        tokenizer=trl_internals.tokenizer(trainer), tools=trainer.tools, model=trainer.model,
        max_completion_length=trainer.args.max_completion_length, owner=type(trainer).__name__,
        owns_prompts=trainer.environment_factories is not None,
    )


def root_environments(trainer, run_call) -> RootEnvironments:
    """GRPOTrainer's environment factories and pool, the branching rules, and the turn loop's tool call
    (`run_call`), which replays an environment's history."""
    has_envs = trainer.environment_factories is not None
    return RootEnvironments(
        factories=trainer.environment_factories,
        instances=trl_internals.environment_pool(trainer) if has_envs else None,
        branching=trainer.args.environment_branching, divergence=trainer.args.replay_divergence, run_call=run_call,
        standalone_tools=trl_internals.standalone_tools(trainer),
        multi=has_envs and trl_internals.multi_environment(trainer),
        note_batch=lambda names: trl_internals.set_batch_environments(trainer, names),
    )
