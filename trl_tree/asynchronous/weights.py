"""The weight transfer: the trainer's policy published as a versioned snapshot, loaded into the worker's copy.

What travels is what the optimizer can change, the parameters that require gradients: every weight in full
fine-tuning, only the adapter with LoRA (the frozen base is the same in both copies since the worker's copy was taken).
A snapshot is a detached clone, so the trainer's next optimizer step, which writes its parameters in place, cannot
reach the weights a generation batch is being sampled with. The worker loads a snapshot between generation batches,
never inside an engine call, so every turn of a tree, and every tree of a batch, is sampled by one policy version.
"""

from __future__ import annotations

import copy
import time
from dataclasses import dataclass

import torch
from torch import nn


@dataclass(frozen=True)
class PolicyWeights:
    """One published policy version.

    Attributes:
        version: generation batches the trainer had finished training when it published them (docs/design.md,
            "Asynchronous rollouts": a version is a generation batch).
        tensors: the trainable parameters by name, detached clones (read-only for every reader).
        seconds: how long the publication took (the copy), logged as `async/weight_publication_time`.
    """

    version: int
    tensors: dict[str, torch.Tensor]
    seconds: float


def trainable_names(model: nn.Module) -> list[str]:
    """The parameters that travel: those that require gradients (LoRA: the adapter's)."""
    return [name for name, p in model.named_parameters() if p.requires_grad]


@torch.no_grad()
def publish(model: nn.Module, version: int) -> PolicyWeights:
    """A snapshot of `model`'s trainable parameters as policy `version`."""
    start = time.perf_counter()
    tensors = {name: p.detach().clone() for name, p in model.named_parameters() if p.requires_grad}
    if not tensors:
        raise ValueError("The model has no parameter that requires gradients: there are no weights to publish.")
    return PolicyWeights(version, tensors, time.perf_counter() - start)


def policy_copy(model: nn.Module) -> nn.Module:
    """The worker's own copy of the policy (PEFT wrapper included, so its forward applies the adapter), frozen: the
    worker never trains it, it only loads published weights into it.

    A forward patched on an instance (TRL's fused LM head, accelerate's mixed-precision wrapper) is a closure over
    the *original* module's bound forward, which `deepcopy` does not copy: the copy would silently run the trainer's
    weights. Those patches are removed from the copy, which runs its class's own forward; the caller applies the
    trainer's autocast around it (what accelerate's patch adds).

    Gradient checkpointing with an adapter makes transformers hook the input embeddings
    (`enable_input_require_grads`) so that a backward reaches the adapter through checkpointed layers. The copy runs
    no backward, so those hooks are removed too: they change no value, and as closures they would keep the copy from
    being sent to a generation process (`rollout_generation="process"`)."""
    copied = copy.deepcopy(model)
    for module in copied.modules():
        module.__dict__.pop("forward", None)
        _drop_require_grads_hooks(module)
    copied.requires_grad_(False)
    copied.train(model.training)  # the same mode as the trainer's forwards of π_old, so μ and π_old compute alike
    return copied


# what transformers' `enable_input_require_grads` registers on the input embeddings, and where it keeps the handles
_REQUIRE_GRADS_HOOK = "make_inputs_require_grads"
_REQUIRE_GRADS_HANDLES = ("_require_grads_hooks", "_require_grads_hook")


def _drop_require_grads_hooks(module: nn.Module) -> None:
    for key, hook in list(module._forward_hooks.items()):
        if getattr(hook, "__name__", None) == _REQUIRE_GRADS_HOOK:
            del module._forward_hooks[key]
            module._forward_hooks_with_kwargs.pop(key, None)
            module._forward_hooks_always_called.pop(key, None)
    for name in _REQUIRE_GRADS_HANDLES:
        module.__dict__.pop(name, None)


@torch.no_grad()
def load(copied: nn.Module, weights: PolicyWeights) -> None:
    """Write a snapshot into the worker's copy, refusing one whose names do not match (another model's weights)."""
    params = dict(copied.named_parameters())
    missing = sorted(set(weights.tensors) - set(params))
    if missing:
        raise ValueError(
            f"The published weights name {len(missing)} parameters the rollout worker's policy copy lacks (first: "
            f"{missing[0]!r}): the copy was taken from another model."
        )
    for name, tensor in weights.tensors.items():
        params[name].copy_(tensor)


@torch.no_grad()
def reset_frozen(copied: nn.Module, model: nn.Module) -> None:
    """Write `model`'s frozen parameters (those that never travel: the base under LoRA) back into the copy.

    The worker's vLLM path needs it after TRL's weight sync, which merges a LoRA adapter into the copy's base to
    stream the merged weights and then subtracts it again: `(w + d) - d` is `w` only up to rounding, so the copy's base
    would drift from the trainer's, one sync after another, and μ's forward with it."""
    params = dict(copied.named_parameters())
    for name, p in model.named_parameters():
        if not p.requires_grad:
            params[name].copy_(p)
