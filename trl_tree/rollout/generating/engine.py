"""Generation backends: "continue these token-id prefixes until the turn ends" (docs/design.md §5).

A sampler round is one batched call. Token-in, token-out: prefixes are lists of token ids that only grow; nothing is
decoded and re-tokenised. Every backend returns, per prefix, the generated ids, their sampling log-probs and (when
the backend can) per-token entropies, and whether the turn ended on an end-of-turn token or ran out of budget.

On multi-process runs each rank must issue the same number of calls (ZeRO-3, FSDP and vLLM's collectives); a rank
with nothing to do calls `generate([])`, which the backends turn into a one-token dummy call.
"""

from __future__ import annotations

import contextlib
import copy
import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol

import torch

from .prefix_cache import PrefixKVStore, left_padded, supports_reuse

logger = logging.getLogger(__name__)


@dataclass
class HFPorts:
    """What `HFEngine` needs of its owner, and nothing else: the rollout layer knows no trainer and no TRL internals
    (the trainer builds these, `trl_tree.trainer.engine_ports.hf_ports`). Callables are read at every call, since the
    owner may swap them between calls (the DDP wrapper appears when training starts; tests patch the generation
    config).

    Attributes:
        eos_ids, pad_id: the end-of-turn ids and the padding id.
        device: where the prefixes go (read per call, as the accelerator's state is).
        model: the training model (unwrapped by the owner's accelerator: what the prefix store's checks read).
        wrapped_model: the model as the accelerator wraps it (DDP / DeepSpeed / FSDP), for the synced-generation rule.
        generation_config: the `GenerationConfig` each call copies.
        unwrapped_for_generation: a context manager yielding the module to call `generate` on, with the weights
            gathered as GRPOTrainer gathers them (ZeRO-3, FSDP).
        cache, max_prefix_cache_bytes: `TreeConfig.generation_cache` and `max_prefix_cache_bytes`.
        precision: a context manager under which every forward of a call runs (the prefix store's prefill and
            `generate`): the trainer's mixed-precision autocast, so that generation computes in the dtypes its packed
            forward computes in. Needed because a PEFT model's `generate` bypasses the autocast that accelerate wraps
            around its `forward`: under bf16 the prefill (a `forward`) stored bf16 values that the un-autocast
            `generate` then attended with float32 queries (issue 59). Nothing by default (a model used alone).
    """

    eos_ids: set[int]
    pad_id: int
    device: Callable[[], Any]
    model: Callable[[], Any]
    wrapped_model: Callable[[], Any]
    generation_config: Callable[[], Any]
    unwrapped_for_generation: Callable[[], contextlib.AbstractContextManager[Any]]
    cache: str = "static"
    max_prefix_cache_bytes: int | None = None
    precision: Callable[[], contextlib.AbstractContextManager[Any]] = contextlib.nullcontext


@dataclass
class Continuation:
    """What a backend generated for one prefix."""

    ids: list[int]
    logps: list[float]
    entropies: list[float] | None
    finished: bool  # ended on an end-of-turn token (False: cut by the token budget)


class GenerationEngine(Protocol):
    """`generate` continues each prefix by at most its budget of tokens, stopping at the end of the turn.

    An engine may also say, with a `resumes_turns` attribute (False when absent), that a turn cut after a few tokens
    costs nothing to resume: the next call prefills one token, not the whole history. Only then does the turn loop
    sample in chunks (`SamplerSettings.chunk_tokens`).
    """

    def generate(self, prefixes: list[list[int]], max_new_tokens: list[int]) -> list[Continuation]: ...


def _cut_at_eos(ids: list[int], eos_ids: set[int], budget: int) -> tuple[int, bool]:
    """Length of the turn (the end-of-turn token included) and whether it finished within `budget`."""
    for j, tok in enumerate(ids[:budget]):
        if tok in eos_ids:
            return j + 1, True
    return min(len(ids), budget), False


class HFEngine:
    """`model.generate` on the training model (through `HFPorts.unwrapped_for_generation`: for the trainer, TRL's
    `unwrap_model_for_generation`, so DeepSpeed ZeRO-3 and FSDP parameters are gathered the way GRPOTrainer gathers
    them).

    With `with_scores=True`, entropies are exact (from the raw logits of every step) and log-probs are those of the
    sampling distribution (after temperature / top-p / top-k). Keeping every step's logits costs steps × batch × vocab
    floats, so it is off unless a sampler needs entropies (AT2PO, TreeAdv); π_old is recomputed by the training model
    in the packed forward anyway (docs/design.md T6), so the placeholders (0.0) are never used as log-probs.

    KV cache (`HFPorts.cache`, the trainer's `generation_cache`; "static" by default): "prefix" (the default of
    `TreeConfig`) reuses, within one rollout, the keys and values of every sequence an earlier call processed
    (`prefix_cache.PrefixKVStore`): a branch's next turn and a branch grown from an anchor's turn prefix prefill only
    the tokens no earlier call has seen, and the call's cache grows in place (`prefix_cache.GrowingLayer`). The store
    is emptied when the rollout ends (`rollout()`), since the weights change after it; within a rollout it keeps at
    most `HFPorts.max_prefix_cache_bytes` (least recently used rows dropped first; the same ids are sampled). "static"
    passes `generate` a fresh `StaticCache` sized to this call's prefix width + token budget, freed with the call: the
    `DynamicCache`'s growth re-concatenates every layer's keys and values at every step. Not
    `cache_implementation="static"`: transformers then sizes every later cache to the longest call seen so far
    (`_previous_max_cache_length`), which slows every later short call (benchmarks/README.md, section 4). Models
    that cannot hold a static cache or splice per-row caches (encoder-decoder, sliding-window, linear-attention or
    custom caches) use the dynamic cache, with one warning; so do ZeRO-3 / FSDP runs on several processes, whose
    synchronised generation steps a finished rank on past its own budget.
    """

    def __init__(self, ports: HFPorts, with_scores: bool = False):
        self.ports = ports
        self.with_scores = with_scores
        self.eos_ids = set(ports.eos_ids)
        self.pad_id = ports.pad_id
        self.cache = ports.cache
        if self.cache not in ("prefix", "static", "dynamic"):
            raise ValueError(f"generation_cache must be 'prefix', 'static' or 'dynamic'; got {self.cache!r}.")
        self.prefix_store = PrefixKVStore(max_bytes=ports.max_prefix_cache_bytes)
        self._warned = False

    @contextlib.contextmanager
    def rollout(self):
        """One rollout's calls, under fixed weights: the reused keys and values are dropped when it ends."""
        self.prefix_store.clear()
        try:
            yield self
        finally:
            self.prefix_store.clear()

    @property
    def resumes_turns(self) -> bool:
        """A cut turn resumes by prefilling one token only when the prefix store is used (`generation_cache="prefix"`
        on a model whose cache can be spliced, on one process or without ZeRO-3 / FSDP); otherwise each chunk would
        prefill the whole history again, so the turn loop samples whole turns."""
        return self._reuses_prefixes(self.ports.model()) and not _synced_generation(self.ports.wrapped_model())

    def _reuses_prefixes(self, model) -> bool:
        if self.cache != "prefix" or _synced_generation(model):
            return False
        if self.ports.generation_config().use_cache is False or self._asked_cache_implementation(model):
            return False
        if supports_reuse(model):
            return True
        self._warn(model, "its cache is not one DynamicCache of full-attention layers")
        return False

    def _asked_cache_implementation(self, model) -> bool:
        """A `cache_implementation` asked for explicitly (by the trainer's generation config or the checkpoint's)."""
        base = model.get_base_model() if callable(getattr(model, "get_base_model", None)) else model
        asked = [getattr(c, "cache_implementation", None) for c in (self.ports.generation_config(),
                                                                    getattr(base, "generation_config", None))]
        return any(a is not None for a in asked)

    def _warn(self, model, reason: str) -> None:
        if not self._warned:
            self._warned = True
            base = model.get_base_model() if callable(getattr(model, "get_base_model", None)) else model
            logger.warning(
                "generation_cache=%r is not supported by %s (%s); generating with the dynamic cache.",
                self.cache, type(base).__name__, reason,
            )

    def _generation_config(self, max_new_tokens: int):
        config = copy.deepcopy(self.ports.generation_config())
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
        if self._asked_cache_implementation(model) or self.ports.generation_config().use_cache is False:
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
        self._warn(model, reason)
        return None

    @torch.no_grad()
    def generate(self, prefixes: list[list[int]], max_new_tokens: list[int]) -> list[Continuation]:
        dummy = not prefixes
        if dummy:  # keep collectives balanced across ranks
            prefixes, max_new_tokens = [[self.pad_id]], [1]
        device = self.ports.device()
        budget = max(max_new_tokens)
        with self.ports.unwrapped_for_generation() as unwrapped, self.ports.precision():
            store = self.prefix_store if self._reuses_prefixes(unwrapped) and not dummy else None
            plan = store.plan(prefixes, self.pad_id, unwrapped, budget) if store else left_padded(prefixes, self.pad_id)
            width = plan.input_ids.shape[1]
            cache = plan.cache if store is not None else self._static_cache(unwrapped, width + budget)
            generation_config = self._generation_config(budget)
            if store is not None:  # the model's config may say use_cache=False (gradient checkpointing sets it)
                generation_config.use_cache = True
            out = unwrapped.generate(
                input_ids=plan.input_ids.to(device),
                attention_mask=plan.attention_mask.to(device),
                generation_config=generation_config,
                **({} if cache is None else {"cache": cache}),
            )
        # a `GenerateOutput`, or the sequences tensor alone (a `generate` patched as TRL's tests patch it)
        if isinstance(out, torch.Tensor):
            sequences, step_scores, step_logits = out, None, None
        else:
            sequences, step_scores, step_logits = out.sequences, out.scores, out.logits
        if dummy:
            return []
        if self.with_scores and (step_scores is None or step_logits is None):
            raise ValueError(
                f"model.generate returned only the sequences ({type(out).__name__}), but this sampler reads per-token "
                "scores (log-probs and entropies, e.g. entropy-guided expansion or token-level branching): let it "
                "return a GenerateOutput (return_dict_in_generate=True, output_scores=True, output_logits=True)."
            )
        new = sequences[:, width:].cpu()
        lengths = [_cut_at_eos(new[row].tolist(), self.eos_ids, max_new_tokens[row]) for row in range(len(prefixes))]
        if store is not None:
            store.store(plan.cache, plan.attention_mask, prefixes, [new[row, :n].tolist() for row, (n, _) in
                                                                   enumerate(lengths)])
        del out, cache, plan  # `out` holds the KV cache: free it before the per-step scores are stacked
        if self.with_scores:
            scores = torch.stack(step_scores, dim=1).float().log_softmax(-1).cpu()  # processed: what was sampled from
            raw = torch.stack(step_logits, dim=1).float().log_softmax(-1).cpu()
            logps = scores.gather(-1, new.unsqueeze(-1)).squeeze(-1)
            entropies = -(raw.exp() * raw).sum(-1)
        results = []
        for row, (n, finished) in enumerate(lengths):
            results.append(
                Continuation(
                    ids=new[row, :n].tolist(),
                    logps=logps[row, :n].tolist() if self.with_scores else [0.0] * n,
                    entropies=entropies[row, :n].tolist() if self.with_scores else None,
                    finished=finished,
                )
            )
        return results


@contextlib.contextmanager
def rollout_session(engine):
    """One rollout of `engine` (any backend): backends that keep state valid only for the current weights (the HF
    engine's reused keys and values) drop it when the rollout ends."""
    rollout = getattr(engine, "rollout", None)
    if rollout is None:
        yield engine
        return
    with rollout():
        yield engine


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
