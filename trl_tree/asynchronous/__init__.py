"""Asynchronous rollouts: trees grown while the trainer trains (docs/design.md, "Asynchronous rollouts").

This package owns the parts that do not know the trainer:

- `worker.RolloutWorker`: the rollout worker, a thread that grows, scores and credits whole generation batches with
  its own copy of the policy, in the order they were admitted, and hands them back finished (or its own error);
- `weights`: the weight transfer, a versioned snapshot of the trainable weights the trainer publishes and the worker
  loads between generation batches (with LoRA only the adapter, what the optimizer changes, travels);
- `pacing`: staleness pacing, which policy version samples which generation batch (admission, never dropping), and
  `ReadAhead`, the training loop's dataloader iterator read ahead in exactly the order the loop reads it.

A finished batch is put on the trainer's policy by `trl_tree.core.pipeline.rebase_on_policy` (the loss contract's): π_old
recomputed by the trainer, the worker's log-probs kept as the behaviour policy's, μ.

Names follow TRL's experimental `AsyncGRPOTrainer` (`max_staleness`, a rollout worker, a weight transfer). It
imports nothing of trl_tree (docs/design.md §2, "Rooms"; `tests/test_layers.py`): what a batch is grown with (the
pipeline, the engine, the ports) comes in as callables from the trainer's wiring, `trl_tree.trainer.async_rollouts`,
and TRL's private names are reached only through `trl_tree.trl_internals`.
"""
