"""Mixed precision × PEFT (issue 59): a drop-in subclass trains wherever GRPOTrainer trains, LoRA and full fine-tuning,
bf16 / fp16 / fp32 as the config says, and its generation computes in the dtype its packed forward computes in.

The failure this guards: with `bf16=True` (GRPO's default) and a LoRA model, accelerate wraps the PEFT model's
`forward` in autocast but not its `generate` (which calls the base model). The prefix store's prefill (a `forward`)
stored bf16 values that the un-autocast `generate` then attended with float32 queries: "Expected query, key, and
value to have the same dtype". The CPU cases are here; the GPU cases are in benchmarks/gpu_suite.py (`precision`).
"""

import math

import pytest
import torch
from peft import LoraConfig

from tests.scripted import arithmetic_dataset, config
from trl_tree import TreeOPSDConfig, TreeOPSDTrainer
from trl_tree.rollout.generating.engine import HFEngine
from trl_tree.testing import tiny_model_path

# what sdpa computes in for each setting on CPU: accelerate runs CPU fp16 without autocast (no native fp16 amp on
# CPU), so an fp16 config computes in float32 there, for GRPOTrainer as for the tree trainers
CPU_DTYPE = {"bf16": torch.bfloat16, "fp16": torch.float32, "fp32": torch.float32}


def distinct_characters(completions, **kwargs):
    """Varies between the tiny model's random completions, so that every tree has a learning signal."""
    return [float(len(set(c[-1].get("content") or ""))) for c in completions]


@pytest.fixture
def attention_dtypes(monkeypatch):
    """The dtypes of every attention output, split into generation (inside `HFEngine.generate`) and the rest (the
    packed forwards that recompute π_old and train)."""
    seen = {"generation": set(), "forward": set()}
    phase = ["forward"]
    sdpa, generate = torch.nn.functional.scaled_dot_product_attention, HFEngine.generate

    def recording_sdpa(*args, **kwargs):
        out = sdpa(*args, **kwargs)
        seen[phase[0]].add(out.dtype)
        return out

    def generating(self, *args, **kwargs):
        phase[0] = "generation"
        try:
            return generate(self, *args, **kwargs)
        finally:
            phase[0] = "forward"

    monkeypatch.setattr(torch.nn.functional, "scaled_dot_product_attention", recording_sdpa)
    monkeypatch.setattr(HFEngine, "generate", generating)
    return seen


@pytest.mark.parametrize("precision", ["bf16", "fp16", "fp32"])
@pytest.mark.parametrize("adapter", ["lora", "full"])
def test_lora_and_full_fine_tuning_train_in_every_cpu_precision(tmp_path, attention_dtypes, adapter, precision):
    args = config(TreeOPSDConfig, tmp_path, bf16=precision == "bf16", fp16=precision == "fp16", max_turns=1,
                  max_completion_length=8)  # fmt: skip
    peft_config = LoraConfig(r=8, target_modules="all-linear") if adapter == "lora" else None
    # the model by path, as a user passes it: loaded in float32 (TRL's default), the config's precision is autocast
    trainer = TreeOPSDTrainer(model=tiny_model_path(), reward_funcs=distinct_characters, args=args,
                              train_dataset=arithmetic_dataset(4), peft_config=peft_config)  # fmt: skip
    before = {n: p.detach().clone() for n, p in trainer.model.named_parameters()}
    trainer.train()
    assert math.isfinite(trainer.state.log_history[-1]["train_loss"])
    moved = {n for n, p in trainer.model.named_parameters() if not torch.equal(p, before[n])}
    if adapter == "lora":  # LoRA's B starts at zero, so one step moves B (A's first gradient comes in step 2)
        assert moved and all("lora_B" in n for n in moved)
    else:
        assert moved == set(before)
    assert attention_dtypes["generation"] == attention_dtypes["forward"] == {CPU_DTYPE[precision]}
