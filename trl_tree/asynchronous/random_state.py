"""The process's global random generators as the rollout worker leaves them after each generation batch.

Generation samples from the global generators (torch's, which `model.generate` and a scripted engine draw from;
Python's and NumPy's, which tools may use). With a rollout worker they advance in the worker's thread, batch after
batch, while the trainer draws nothing from them between batches (no dropout in the policies trained here), so the
state at the start of batch j is the state the worker left after batch j − 1. A checkpoint is written in the
trainer's thread while the worker is somewhere inside a later batch: transformers' `rng_state.pth` then holds a state
that depends on timing. The worker therefore captures the state at the end of every batch, and a checkpoint with
batches in flight saves the one after the last batch the trainer took, the state the first regenerated batch must
start from (`trl_tree.trainer.async_rollouts`).

One thing in the trainer's thread does touch them: activation (gradient) checkpointing's backward replays the
forward under the generator state the forward saw (torch's `preserve_rng_state`, on by default): it sets the global
state back, recomputes, and restores it afterwards. Concurrently sampling, the worker would draw numbers it (or the
forward) already drew and lose its draws made during the backward, so its samples would repeat and depend on timing.
The replay exists for dropout; with no dropout active it changes nothing, so a worker session turns it off
(`checkpointing_leaves_rng_alone`) and the trainer refuses asynchronous rollouts where dropout is active
(`active_dropout`).
"""

from __future__ import annotations

import functools
import random
from collections.abc import Callable
from typing import Any

import numpy as np
import torch


def capture() -> dict[str, Any]:
    """The global generators' states (Python, NumPy, torch CPU, and every CUDA device once CUDA is initialised)."""
    state = {"python": random.getstate(), "numpy": np.random.get_state(), "cpu": torch.get_rng_state()}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def restore(state: dict[str, Any]) -> None:
    """Set the global generators to `state` (a `capture()`)."""
    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    torch.set_rng_state(state["cpu"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


def active_dropout(model: torch.nn.Module) -> list[str]:
    """What in `model` draws from the generators in a training forward: dropout modules with p > 0 (by name) and
    configured dropout probabilities > 0 (`config.attention_dropout`, ...; functional dropout inside attention)."""
    found = [name or type(model).__name__ for name, m in model.named_modules()
             if isinstance(m, torch.nn.modules.dropout._DropoutNd) and m.p > 0]
    config = getattr(model, "config", None)
    for key, value in (vars(config) if config is not None else {}).items():
        if "dropout" in key and isinstance(value, int | float) and not isinstance(value, bool) and value > 0:
            found.append(f"config.{key}={value}")
    return found


def checkpointing_leaves_rng_alone(model: torch.nn.Module) -> Callable[[], None]:
    """Make `model`'s activation checkpointing (transformers' `_gradient_checkpointing_func` on its layers) leave the
    global generators alone (`preserve_rng_state=False`); returns the function that puts the originals back. A
    model without checkpointing is left as it is."""
    changed = []
    for module in model.modules():
        func = module.__dict__.get("_gradient_checkpointing_func")
        if func is not None:
            changed.append((module, func))
            module._gradient_checkpointing_func = functools.partial(func, preserve_rng_state=False)

    def restore_checkpointing() -> None:
        for module, func in changed:
            module._gradient_checkpointing_func = func

    return restore_checkpointing
