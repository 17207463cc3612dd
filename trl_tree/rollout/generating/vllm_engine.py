"""vLLM generation backend: TRL's own `VLLMGeneration`, driven token-in token-out (docs/design.md §5).

We do not start or talk to vLLM ourselves: GRPOTrainer already builds `trainer.vllm_generation` (colocate or server
mode) with the right process groups, sleep mode, PEFT merging and FSDP/ZeRO-3 gathering for weight sync. This module
only adapts it to the engine interface of `engine.py`:

- weights are synced at most once per optimizer step, before generating, exactly as GRPOTrainer does it, and TRL's
  `sync_weights` resets vLLM's prefix cache afterwards (see `VLLMEngine._sync_weights_if_stale`);
- `VLLMGeneration.generate` takes one `max_completion_length` for the whole batch, so we generate with the largest
  budget and cut each continuation to its own budget and at its end-of-turn token;
- ranks may hold different numbers of prefixes, but TRL slices gathered results by `process_index * len(prompts)`
  (server mode, and colocate with tensor parallelism), so every rank pads its batch to the largest one and all ranks
  agree on one token budget; a rank with nothing to do still makes the call (collectives stay balanced).
"""

from __future__ import annotations

import contextlib
import functools
import logging
import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from accelerate.utils import gather_object

from .engine import Continuation, _cut_at_eos

logger = logging.getLogger(__name__)


@dataclass
class VLLMPorts:
    """What `VLLMEngine` needs of its owner (the trainer builds these, `trl_tree.trainer.engine_ports.vllm_ports`), so
    the rollout layer reaches neither the trainer nor TRL's private names.

    Attributes:
        vllm_generation: TRL's `VLLMGeneration` (GRPOTrainer's `vllm_generation`).
        eos_ids, pad_id: the end-of-turn ids and the padding id.
        current_step: the optimizer step now (`state.global_step`); synced_step / mark_synced: the step whose weights
            vLLM holds, read and recorded (GRPOTrainer's own counter, so its generation and ours sync once).
        profile: `profile(name)`, a context manager timing a section (TRL's `profiling_context`).
    """

    vllm_generation: Any
    eos_ids: set[int]
    pad_id: int
    current_step: Callable[[], int]
    synced_step: Callable[[], int | None]
    mark_synced: Callable[[int], None]
    profile: Callable[[str], contextlib.AbstractContextManager[Any]]


def topk_entropy(logprobs: list[float | None]) -> float:
    """Estimate the entropy of a next-token distribution from the few log-probs vLLM returns.

    vLLM returns only the top-k log-probs (plus the sampled token's), never the full distribution, so the entropy
    cannot be computed exactly. We keep the returned tokens as they are and lump the unreturned tail mass
    r = 1 − Σ p_i into one bucket: Ĥ = −Σ p_i log p_i − r log r.

    Why this estimate and not renormalising over the top-k: by the grouping property of entropy,
    H = Ĥ + r · H(tail | tail), so Ĥ is a lower bound that is exact when the tail is empty (or one token) and only
    increases towards H as k grows; renormalising has no such guarantee (it over- or under-shoots depending on how
    the tail is spread). Entropy-guided samplers (AT2PO, TreeAdv) rank turns and tokens by entropy, and a
    monotone-in-k bound keeps that ranking stable for peaked distributions, where the top-k carries most of the mass.
    `None` entries (vLLM's NaN) are skipped.
    """
    probs = [math.exp(lp) for lp in logprobs if lp is not None and lp > -math.inf]
    entropy = -sum(p * math.log(p) for p in probs if p > 0.0)
    tail = 1.0 - sum(probs)
    if tail > 1e-12:
        entropy -= tail * math.log(tail)
    return entropy


class VLLMEngine:
    """Continue token-id prefixes with the trainer's `VLLMGeneration` (`trainer.vllm_generation`).

    Args:
        ports: what it reads of a GRPOTrainer (or subclass) built with `use_vllm=True` (`VLLMPorts`): its
            `vllm_generation`, the optimizer step and the last weight-sync step, the end-of-turn and pad ids, and
            TRL's profiling context.
        with_scores: also return per-token entropy *estimates* (`topk_entropy`), for the entropy-guided samplers.
            Same meaning as `HFEngine(with_scores=...)`. Log-probs are returned either way: vLLM computes them anyway.
        entropy_top_k: how many top log-probs to request per token for the estimate. vLLM caps this with its
            `max_logprobs` engine argument (20 by default; TRL's colocate `LLM(...)` leaves the default).

    Log-probs are those of the sampled tokens, as vLLM reports them: `processed_logprobs` in colocate mode (TRL builds
    the `LLM` that way: after temperature and top-k/top-p, i.e. the sampling distribution, as `HFEngine`'s), and
    whatever `--logprobs-mode` the server was started with in server mode. Entropies are estimated from the same
    (processed) log-probs, whereas `HFEngine` computes them exactly from the raw logits; the two agree at temperature
    1 without top-k/top-p.
    """

    # vLLM schedules its rows continuously inside a call; resuming a cut turn through TRL's generate would pay a
    # call's overhead per chunk, so the turn loop gives it whole turns (`TreeConfig.generation_chunk_tokens`)
    resumes_turns = False

    def __init__(self, ports: VLLMPorts, with_scores: bool = False, entropy_top_k: int = 20):
        self.ports = ports
        self.vllm_generation = ports.vllm_generation
        self.with_scores = with_scores
        self.entropy_top_k = entropy_top_k
        self.eos_ids = set(ports.eos_ids)
        self.pad_id = ports.pad_id
        if self.prefix_caching_enabled() is False:
            logger.warning(
                "vLLM runs without prefix caching: every branch of a rollout tree recomputes its whole prefix. "
                "Tree sampling stays correct but loses most of its speed-up."
            )

    def prefix_caching_enabled(self) -> bool | None:
        """Whether the colocated vLLM engine caches prefixes (`None` when it can't be told: server mode).

        TRL's colocate `LLM(...)` does not pass `enable_prefix_caching`, so vLLM's default applies: on for generative
        models with standard attention (`ModelConfig.is_prefix_caching_supported`), turned off only on RISC-V CPUs and
        for MLA models on CPU (vLLM 0.31 `EngineArgs._set_default_chunked_prefill_and_prefix_caching_args`,
        `CpuPlatform`). A server started by `trl vllm-serve` gets the same default unless `--enable_prefix_caching
        False` is passed.
        """
        llm = getattr(self.vllm_generation, "llm", None)
        if llm is None:
            return None
        return bool(llm.llm_engine.vllm_config.cache_config.enable_prefix_caching)

    def _sync_weights_if_stale(self) -> None:
        """Push the training weights to vLLM once per optimizer step, before generating (as GRPOTrainer does).

        TRL's `VLLMGeneration.sync_weights` (trl 1.16, `generation/vllm_generation.py`) ends with
        `self.llm.reset_prefix_cache()` in colocate mode and `self.vllm_client.reset_prefix_cache()` on the main process
        in server mode (TRL #3024). That reset is what makes prefix caching safe for trees: branches share long
        prefixes, and without it a branch started after a weight update would silently attend to KV blocks computed
        by the previous policy. Every rank takes this branch together (the step counter is the same everywhere), which
        matters because the weight gathering inside `sync_weights` is collective under ZeRO-3/FSDP.
        """
        step = self.ports.current_step()
        if step != self.ports.synced_step():
            with self.ports.profile("sync_weights"):
                self.vllm_generation.sync_weights()
            self.ports.mark_synced(step)

    @contextlib.contextmanager
    def _sampling_overrides(self, max_tokens: int):
        """Set the batch's token budget, log-prob count and stop tokens on `VLLMGeneration` for one call.

        `VLLMGeneration.generate` reads these from its attributes (no per-call arguments), so they are swapped in and
        restored afterwards: GRPOTrainer's own generation, if it still runs, sees its configuration unchanged. The
        trainer's end-of-turn ids are added as `stop_token_ids` so vLLM stops where `_cut_at_eos` cuts, whatever
        the checkpoint's `generation_config.json` says; `max_tokens`/`logprobs` in the user's `generation_kwargs` are
        dropped for the call, since TRL applies those kwargs last and they would override the budget.
        """
        vg = self.vllm_generation
        saved = (vg.max_completion_length, vg.logprobs, vg.generation_kwargs)
        stop = sorted(set(saved[2].get("stop_token_ids") or []) | self.eos_ids)
        vg.max_completion_length = max_tokens
        vg.logprobs = self.entropy_top_k if self.with_scores else 0
        kwargs = {k: v for k, v in saved[2].items() if k not in ("max_tokens", "logprobs")}
        vg.generation_kwargs = {**kwargs, "stop_token_ids": stop}
        try:
            yield
        finally:
            vg.max_completion_length, vg.logprobs, vg.generation_kwargs = saved

    def generate(self, prefixes: list[list[int]], max_new_tokens: list[int]) -> list[Continuation]:
        if len(prefixes) != len(max_new_tokens):
            raise ValueError(f"{len(prefixes)} prefixes but {len(max_new_tokens)} token budgets")
        self._sync_weights_if_stale()

        # Agree across ranks on the batch size and the budget (one SamplingParams serves the whole gathered batch).
        work = gather_object([(len(prefixes), max(max_new_tokens, default=0))])
        batch_size = max(1, max(n for n, _ in work))  # at least one (dummy) prompt, even if no rank has work
        budget = max(1, max(b for _, b in work))  # vLLM rejects max_tokens=0
        prompts = [list(p) for p in prefixes] + [[self.pad_id]] * (batch_size - len(prefixes))

        with self._sampling_overrides(budget):
            _, completion_ids, logprobs, logprob_token_ids = self.vllm_generation.generate(
                prompts=prompts,
                images=None,
                num_generations=1,
                profiler=self.ports.profile("vLLM.generate"),
            )

        results = []
        for row, row_budget in enumerate(max_new_tokens):  # the padding rows are dropped here
            ids = list(completion_ids[row])
            n, finished = _cut_at_eos(ids, self.eos_ids, row_budget)
            logps, entropies = [], []
            for t in range(n):
                # Entries run from most to least likely and include the sampled token, which may sit outside the
                # top-k (then last): look it up by id, not position (GRPOTrainer's `lp[0]` assumes logprobs=0).
                row_ids, row_lps = logprob_token_ids[row][t], logprobs[row][t]
                lp = row_lps[row_ids.index(ids[t])]
                logps.append(math.nan if lp is None else lp)
                if self.with_scores:
                    entropies.append(topk_entropy(row_lps))
            results.append(
                Continuation(
                    ids=ids[:n], logps=logps, entropies=entropies if self.with_scores else None, finished=finished
                )
            )
        return results


@contextlib.contextmanager
def vllm_cpu_weight_sync(**llm_kwargs):
    """Make TRL's colocated vLLM usable for training on CPU; wrap the construction of `VLLMGeneration` in it.

    Two things stand in the way on vLLM's CPU backend (as of vllm-cpu 0.31):

    - After loading, `dispatch_cpu_unquantized_gemm` repacks every linear layer's weight for oneDNN/SGL kernels and
      replaces `layer.weight` with an empty `Parameter` that has no `weight_loader`, so TRL's
      `model.load_weights(...)` fails with `AttributeError: 'Parameter' object has no attribute 'weight_loader'`;
      the embedding keeps its weight but the tied `lm_head` reads a packed copy, so a sync would not reach the
      logits either. We replace the dispatch with a plain `F.linear` on the live weight.
    - TRL's `LLM(...)` passes no `dtype`, and vLLM's "auto" downcasts float32 checkpoints to bfloat16 on CPU.
      `llm_kwargs` (e.g. `dtype="float32"`, `enforce_eager=True`) are added to TRL's `LLM(...)` call.

    - At start-up vLLM's CPU platform rebinds its Triton kernels by scanning the attributes of every loaded module
      and reading `vars(value).get("kernel")` (`vllm.triton_utils.dispatcher._rebind_kernels`). numba (which `bm25s`
      imports, so the search agent's BM25 retriever loads it) leaves llvmlite's `ffi.lib` in a module, whose
      `__getattr__` answers `__dict__` with a C-function wrapper, and start-up fails with `AttributeError:
      '_lib_fn_wrapper' object has no attribute 'get'`. `scannable_module_attributes` hides such objects behind
      delegating shims while the context is open.

    Only meant for colocate mode, where TRL runs vLLM in-process (`distributed_executor_backend="external_launcher"`
    disables vLLM's engine subprocess), so patching this process's modules reaches the model. The layers only need
    the patch while they are loaded: leaving the context restores vLLM, TRL and the shimmed modules.
    """
    import torch
    import trl.generation.vllm_generation as trl_vllm_generation
    import vllm.model_executor.layers.utils as vllm_layer_utils

    def plain_linear(layer, remove_weight):
        layer.cpu_linear = torch.nn.functional.linear

    saved_dispatch, saved_llm = vllm_layer_utils.dispatch_cpu_unquantized_gemm, trl_vllm_generation.LLM
    vllm_layer_utils.dispatch_cpu_unquantized_gemm = plain_linear
    if llm_kwargs:
        trl_vllm_generation.LLM = functools.partial(saved_llm, **llm_kwargs)
    try:
        with scannable_module_attributes():
            yield
    finally:
        vllm_layer_utils.dispatch_cpu_unquantized_gemm = saved_dispatch
        trl_vllm_generation.LLM = saved_llm


class _DelegatingShim:
    """Stands in for an object whose `vars()` is not a mapping: a plain `__dict__`, every other attribute read from
    (and written to) the object itself, calls passed through."""

    def __init__(self, target):
        object.__setattr__(self, "_shim_target", target)

    def __getattr__(self, name):
        return getattr(object.__getattribute__(self, "_shim_target"), name)

    def __setattr__(self, name, value):
        setattr(object.__getattribute__(self, "_shim_target"), name, value)

    def __call__(self, *args, **kwargs):
        return object.__getattribute__(self, "_shim_target")(*args, **kwargs)


def _has_mapping_vars(value) -> bool:
    try:
        return not hasattr(value, "__dict__") or hasattr(vars(value), "get")
    except Exception:  # an attribute whose `__dict__` lookup raises: vLLM's scan would fail on it too
        return False


@contextlib.contextmanager
def scannable_module_attributes():
    """While open, every module attribute whose `vars()` is not a mapping (llvmlite's `ffi.lib`, see
    `vllm_cpu_weight_sync`) is replaced by a `_DelegatingShim` of it, so a scan of `sys.modules` that reads
    `vars(value).get(...)` passes; the originals are put back on exit. Code that uses the attribute meanwhile
    reaches the original through the shim."""
    import sys

    swapped = []
    for module in list(sys.modules.values()):
        namespace = getattr(module, "__dict__", None)
        if not isinstance(namespace, dict):
            continue
        for attr, value in list(namespace.items()):
            if not _has_mapping_vars(value):
                swapped.append((namespace, attr, value))
                namespace[attr] = _DelegatingShim(value)
    try:
        yield [(attr, value) for _, attr, value in swapped]
    finally:
        for namespace, attr, value in swapped:
            if isinstance(namespace.get(attr), _DelegatingShim):
                namespace[attr] = value
