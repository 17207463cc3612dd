"""The process's global random generators as the rollout worker leaves them after each generation batch.

Generation samples from the global generators (torch's, which `model.generate` and a scripted engine draw from;
Python's and NumPy's, which tools may use). With a rollout worker they advance in the worker's thread, batch after
batch, while the trainer draws nothing from them between batches (no dropout in the policies trained here), so the
state at the start of batch j is the state the worker left after batch j − 1. A checkpoint is written in the
trainer's thread while the worker is somewhere inside a later batch: transformers' `rng_state.pth` then holds a state
that depends on timing. The worker therefore captures the state at the end of every batch, and a checkpoint with
batches in flight saves the one after the last batch the trainer took, the state the first regenerated batch must
start from (`trl_tree.trainer.async_rollouts`).
"""

from __future__ import annotations

import random
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
