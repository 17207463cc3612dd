"""The generation backends' ports, built from a GRPOTrainer (docs/design.md §2, "Layers").

The rollout layer (`trl_tree.rollout`) takes narrow ports (`HFPorts`, `VLLMPorts`) instead of the trainer, so it
knows neither GRPOTrainer's attributes nor TRL's private names. This module is the one place that reads them for the
engines: through `trl_internals` for the private ones, and TRL's public helpers (`unwrap_model_for_generation`,
`profiling_context`) otherwise. Every value that the trainer may swap later (the DDP wrapper appears when training
starts; tests patch the generation config) is passed as a callable, read at each call as before.
"""

from __future__ import annotations

import contextlib

from .. import trl_internals
from ..rollout.generating.engine import HFPorts
from ..rollout.generating.vllm_engine import VLLMPorts
from .configuration.quiet import without_trl_checkpointing_warnings


@contextlib.contextmanager
def _unwrapped_for_generation(trainer):
    """The module to call `generate` on, gathered as GRPOTrainer gathers it (ZeRO-3 parameters, FSDP's full
    parameters), without TRL's deprecation noise."""
    from trl.models import unwrap_model_for_generation

    with (
        without_trl_checkpointing_warnings(),  # TRL's use of transformers' old names (`trainer.quiet`)
        unwrap_model_for_generation(
            trainer.model_wrapped,
            trainer.accelerator,
            gather_deepspeed3_params=trainer.args.ds3_gather_for_generation,
            generation_kwargs=trainer.generation_kwargs,
            gradient_checkpointing_kwargs=trainer.args.gradient_checkpointing_kwargs,
        ) as unwrapped,
        trl_internals.distributed(trainer).summon_full_params(trainer.model_wrapped, recurse=False),
    ):
        yield unwrapped


def hf_ports(trainer) -> HFPorts:
    """`HFEngine`'s ports of a GRPOTrainer: `generation_cache` "static" when its args lack the field (a plain
    GRPOConfig)."""
    return HFPorts(
        eos_ids=set(trainer.eos_token_ids),
        pad_id=trl_internals.tokenizer(trainer).pad_token_id,
        device=lambda: trainer.accelerator.device,
        model=lambda: trainer.model,
        wrapped_model=lambda: trainer.model_wrapped,
        generation_config=lambda: trainer.generation_config,
        unwrapped_for_generation=lambda: _unwrapped_for_generation(trainer),
        cache=getattr(trainer.args, "generation_cache", "static"),
        max_prefix_cache_bytes=getattr(trainer.args, "max_prefix_cache_bytes", None),
        # the autocast of the training forward (bf16 / fp16 as the config says), also around a PEFT model's
        # `generate`, which accelerate's wrapped `forward` does not cover
        precision=lambda: trainer.accelerator.autocast(),
    )


def vllm_ports(trainer) -> VLLMPorts:
    """`VLLMEngine`'s ports of a GRPOTrainer built with `use_vllm=True`: weights are synced against GRPOTrainer's own
    last-sync step, profiled with TRL's `profiling_context` (which reads `args.report_to` and the accelerator)."""
    from trl.extras.profiling import profiling_context

    return VLLMPorts(
        vllm_generation=trainer.vllm_generation,
        eos_ids=set(trainer.eos_token_ids),
        pad_id=trl_internals.tokenizer(trainer).pad_token_id,
        current_step=lambda: trainer.state.global_step,
        synced_step=lambda: trl_internals.last_loaded_step(trainer),
        mark_synced=lambda step: trl_internals.set_last_loaded_step(trainer, step),
        profile=lambda name: profiling_context(trainer, name),
    )
