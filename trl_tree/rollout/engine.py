"""Generation backends: "continue these token-id prefixes until the turn ends" (docs/design.md §5).

A sampler round is one batched call. Token-in, token-out: prefixes are lists of token ids that only grow; nothing is
decoded and re-tokenised. Every backend returns, per prefix, the generated ids, their sampling log-probs and (when
the backend can) per-token entropies, and whether the turn ended on an end-of-turn token or ran out of budget.

On multi-process runs each rank must issue the same number of calls (ZeRO-3, FSDP and vLLM's collectives); a rank
with nothing to do calls `generate([])`, which the backends turn into a one-token dummy call.
"""

from __future__ import annotations

import copy
import logging
from dataclasses import dataclass
from typing import Protocol

import torch

from .. import trl_internals

logger = logging.getLogger(__name__)


@dataclass
class Continuation:
    """What a backend generated for one prefix."""

    ids: list[int]
    logps: list[float]
    entropies: list[float] | None
    finished: bool  # ended on an end-of-turn token (False: cut by the token budget)


class GenerationEngine(Protocol):
    def generate(self, prefixes: list[list[int]], max_new_tokens: list[int]) -> list[Continuation]: ...


def _cut_at_eos(ids: list[int], eos_ids: set[int], budget: int) -> tuple[int, bool]:
    """Length of the turn (the end-of-turn token included) and whether it finished within `budget`."""
    for j, tok in enumerate(ids[:budget]):
        if tok in eos_ids:
            return j + 1, True
    return min(len(ids), budget), False


class HFEngine:
    """`model.generate` on the training model (through TRL's `unwrap_model_for_generation`, so DeepSpeed ZeRO-3 and
    FSDP parameters are gathered the way GRPOTrainer gathers them).

    With `with_scores=True`, entropies are exact (from the raw logits of every step) and log-probs are those of the
    sampling distribution (after temperature / top-p / top-k). Keeping every step's logits costs steps × batch × vocab
    floats, so it is off unless a sampler needs entropies (AT2PO, TreeAdv); π_old is recomputed by the training model
    in the packed forward anyway (docs/design.md T6), so the placeholders (0.0) are never used as log-probs.

    KV cache (`args.generation_cache`, "static" when the trainer's args lack the field): "static" passes `generate` a
    fresh `StaticCache` sized to this call's prefix width + token budget, freed with the call. Same sampled ids as
    the `DynamicCache`, whose growth re-concatenates every layer's keys and values at every step (~21% of CPU
    generation time on a search-agent profile). Not `cache_implementation="static"`: transformers then sizes every
    later cache to the longest call seen so far (`_previous_max_cache_length`), which made short calls 1.6–1.75×
    slower after one long call. Models that cannot hold a static cache (encoder-decoder, linear-attention or custom
    caches, `_can_compile_fullgraph` unset) use the dynamic cache, with one warning; so do ZeRO-3 / FSDP runs on
    several processes, whose synchronised generation steps a finished rank on past its own budget.
    """

    def __init__(self, trainer, with_scores: bool = False):
        self.trainer = trainer
        self.with_scores = with_scores
        self.eos_ids = set(trainer.eos_token_ids)
        self.pad_id = trl_internals.tokenizer(trainer).pad_token_id
        self.cache = getattr(trainer.args, "generation_cache", "static")
        if self.cache not in ("static", "dynamic"):
            raise ValueError(f"generation_cache must be 'static' or 'dynamic'; got {self.cache!r}.")
        self._warned = False

    def _generation_config(self, max_new_tokens: int):
        config = copy.deepcopy(self.trainer.generation_config)
        config.max_new_tokens = max_new_tokens
        config.output_scores = config.output_logits = self.with_scores
        config.return_dict_in_generate = True
        return config

    def _static_cache(self, model, max_cache_len: int):
        """A `StaticCache` for `model` (unwrapped; PEFT's base model is looked through), or None to let `generate`
        build its default cache: `generation_cache="dynamic"`, a `cache_implementation` asked for explicitly (by the
        trainer's generation config or the checkpoint's), synchronised generation, or a model that cannot hold one."""
        if self.cache != "static" or _synced_generation(model):
            return None
        base = model.get_base_model() if callable(getattr(model, "get_base_model", None)) else model
        asked = [getattr(c, "cache_implementation", None) for c in (self.trainer.generation_config,
                                                                    getattr(base, "generation_config", None))]
        if any(a is not None for a in asked) or self.trainer.generation_config.use_cache is False:
            return None
        config = getattr(base, "config", None)
        reason = None
        if config is None or config.is_encoder_decoder:
            reason = "no decoder-only config"
        elif not getattr(base, "_can_compile_fullgraph", False):
            reason = "_can_compile_fullgraph is not set"
        elif not getattr(base, "_supports_default_dynamic_cache", lambda: False)():
            reason = "the model manages its own cache"
        else:
            from transformers import StaticCache

            try:
                return StaticCache(config=config, max_cache_len=max_cache_len)
            except (KeyError, ValueError, TypeError, NotImplementedError) as error:  # e.g. linear-attention layers
                reason = f"{type(error).__name__}: {error}"
        if not self._warned:
            self._warned = True
            logger.warning(
                "generation_cache='static' is not supported by %s (%s); generating with the dynamic cache.",
                type(base).__name__, reason,
            )
        return None

    @torch.no_grad()
    def generate(self, prefixes: list[list[int]], max_new_tokens: list[int]) -> list[Continuation]:
        from trl.models import unwrap_model_for_generation

        trainer = self.trainer
        dummy = not prefixes
        if dummy:  # keep collectives balanced across ranks
            prefixes, max_new_tokens = [[self.pad_id]], [1]
        device = trainer.accelerator.device
        width = max(len(p) for p in prefixes)
        input_ids = torch.full((len(prefixes), width), self.pad_id, dtype=torch.long)
        attention_mask = torch.zeros_like(input_ids)
        for row, prefix in enumerate(prefixes):  # left padding
            input_ids[row, width - len(prefix) :] = torch.tensor(prefix)
            attention_mask[row, width - len(prefix) :] = 1
        budget = max(max_new_tokens)
        with (
            unwrap_model_for_generation(
                trainer.model_wrapped,
                trainer.accelerator,
                gather_deepspeed3_params=trainer.args.ds3_gather_for_generation,
                generation_kwargs=trainer.generation_kwargs,
                gradient_checkpointing_kwargs=trainer.args.gradient_checkpointing_kwargs,
            ) as unwrapped,
            trl_internals.distributed(trainer).summon_full_params(trainer.model_wrapped, recurse=False),
        ):
            cache = self._static_cache(unwrapped, width + budget)
            out = unwrapped.generate(
                input_ids=input_ids.to(device),
                attention_mask=attention_mask.to(device),
                generation_config=self._generation_config(budget),
                **({} if cache is None else {"cache": cache}),
            )
        sequences, step_scores, step_logits = out.sequences, out.scores, out.logits
        del out, cache  # `out` holds the KV cache: free it before the per-step scores are stacked
        if dummy:
            return []
        new = sequences[:, width:].cpu()
        if self.with_scores:
            scores = torch.stack(step_scores, dim=1).float().log_softmax(-1).cpu()  # processed: what was sampled from
            raw = torch.stack(step_logits, dim=1).float().log_softmax(-1).cpu()
            logps = scores.gather(-1, new.unsqueeze(-1)).squeeze(-1)
            entropies = -(raw.exp() * raw).sum(-1)
        results = []
        for row in range(len(prefixes)):
            n, finished = _cut_at_eos(new[row].tolist(), self.eos_ids, max_new_tokens[row])
            results.append(
                Continuation(
                    ids=new[row, :n].tolist(),
                    logps=logps[row, :n].tolist() if self.with_scores else [0.0] * n,
                    entropies=entropies[row, :n].tolist() if self.with_scores else None,
                    finished=finished,
                )
            )
        return results


def _synced_generation(model) -> bool:
    """Whether `generate` runs with `synced_gpus` (ZeRO-3 or FSDP on several processes, transformers' own rule): a
    rank that has finished keeps stepping the model until every rank has, i.e. up to the largest budget of any rank,
    past a cache sized to its own budget. Such runs keep the dynamic cache."""
    if not (torch.distributed.is_available() and torch.distributed.is_initialized()):
        return False
    if torch.distributed.get_world_size() < 2:
        return False
    from transformers.integrations.deepspeed import is_deepspeed_zero3_enabled
    from transformers.integrations.fsdp import is_fsdp_managed_module

    return is_deepspeed_zero3_enabled() or is_fsdp_managed_module(model)


class ScriptedEngine:
    """Replays fixed turns: `script(prefix) -> list[int]` decides what the "model" says after a prefix (or returns
    `(ids, entropies)` to also script per-token entropies, e.g. to drive entropy-guided expansion).

    For tests and demos, the way TRL tests its tool loop with patched generation: the tree that comes out is known
    in advance. Log-probs are uniform placeholders (the trainer recomputes π_old with the training model anyway).
    """

    def __init__(self, script, eos_ids):
        self.script = script
        self.eos_ids = set(eos_ids)
        self.calls = 0

    def generate(self, prefixes: list[list[int]], max_new_tokens: list[int]) -> list[Continuation]:
        self.calls += 1
        results = []
        for prefix, budget in zip(prefixes, max_new_tokens):
            out = self.script(list(prefix))
            ids, entropies = (list(out[0]), list(out[1])) if isinstance(out, tuple) else (list(out), [0.0] * len(out))
            n, finished = _cut_at_eos(ids, self.eos_ids, budget)
            results.append(Continuation(ids[:n], [0.0] * n, entropies[:n], finished))
        return results
