"""The rollout worker's vLLM path, server mode: the worker generates through a vLLM server (`trl vllm-serve`) with
TRL's own client, and each published version reaches the server by TRL's own weight sync, between the worker's jobs
(docs/design.md §9, "vLLM server mode").

What travels where:
- trainer → worker: the published version (`weights.PolicyWeights`: the trainable parameters, only the adapter with
  LoRA), loaded into the worker's policy copy between jobs, as with the HF engine;
- worker → server: when the worker starts a job whose version the server does not hold, `ServedPolicy.push` runs
  TRL's `VLLMGeneration.sync_weights` on a `VLLMGeneration` whose model is the policy copy: TRL's own walk of the
  parameters (with LoRA it merges the adapter into the base, streams the merged weights under vLLM's names and
  unmerges), its `VLLMClient.update_named_params` over the communicator TRL opened when the trainer was built, and its
  prefix-cache reset (TRL #3024: branches must not reuse the previous policy's KV). The trainer's live model is never
  read for it (it moves on meanwhile), and no engine call syncs by itself (`ServedPolicy.ports`);
- μ's log-probs are still the policy copy's packed forward, the loss's own code (issue 57, item 2): the server's
  log-probs come from other kernels, often in another dtype, so they are the sampler's, not the loss's.

Who holds the server: the worker (a published version) or the trainer's own engine, which syncs the trainer's live
weights when evaluation generates. Both record it in GRPOTrainer's `_last_loaded_step`: the trainer's engine writes
the step it pushed, a worker push writes None ("not the trainer's weights at any step"), so each sees the other's
push and pushes again before its next generation. They take turns under `AsyncRollouts.lock`, never inside each
other's generation batch.
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import time

from accelerate.utils import is_peft_model
from torch import nn

from .. import trl_internals
from ..asynchronous import weights
from ..rollout.generating.vllm_engine import VLLMPorts
from . import engine_ports


class ServedPolicy:
    """The vLLM server's weights as the rollout worker sets them: which published version it holds, and the push.

    Args:
        trainer: a tree trainer built with `use_vllm=True, vllm_mode="server"` on one process (its `vllm_generation`,
            TRL's, holds the client and the communicator).
        policy: the worker's policy copy (`weights.policy_copy`), holding the weights of the version to push when
            `push` is called.
    """

    def __init__(self, trainer, policy: nn.Module):
        self.trainer, self.policy = trainer, policy
        # TRL's object, its client and communicator shared, with the copy as the model its sync walks: the trainer's
        # own `vllm_generation` (evaluation's) keeps the trainer's model and its own generation settings
        self.generation = copy.copy(trainer.vllm_generation)
        self.generation.model = policy
        self.version: int | None = None  # the published version the worker last pushed
        self.pushes = 0

    def holds(self, version: int) -> bool:
        """Whether the server holds published `version` now: the worker pushed it last, and the trainer's own engine
        has not pushed the trainer's live weights since (it records the step it pushed where a push of ours left
        None)."""
        return self.version == version and trl_internals.last_loaded_step(self.trainer) is None

    def push(self, version: int) -> float:
        """Make the server hold `version`, the copy's weights now, by TRL's sync; the seconds it took (0.0 when it
        already holds it). Call it between generation batches, under the lock the trainer's generation takes."""
        if self.holds(version):
            return 0.0
        start = time.perf_counter()
        self.generation.sync_weights()  # TRL: walk (LoRA: merge, unmerge), stream, then reset the prefix cache
        if is_peft_model(self.policy):  # the unmerge left the copy's base within rounding of the trainer's
            weights.reset_frozen(self.policy, self.trainer.model)
        trl_internals.set_last_loaded_step(self.trainer, None)
        self.version = version
        self.pushes += 1
        return time.perf_counter() - start

    def ports(self) -> VLLMPorts:
        """`VLLMEngine`'s ports for the worker: TRL's generation with the copy as its model, and no sync inside an
        engine call (its step and synced step are one number: the push is the worker's, between jobs). Not profiled
        with TRL's `profiling_context`, which logs to the trackers from whichever thread runs it; the worker's
        timings are the `async/*` metrics."""
        return dataclasses.replace(
            engine_ports.vllm_ports(self.trainer),
            vllm_generation=self.generation,
            current_step=lambda: self.version,
            synced_step=lambda: self.version,
            mark_synced=lambda step: None,
            profile=lambda name: contextlib.nullcontext(),
        )
