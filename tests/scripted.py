"""Scripted generation for trainer tests: the way TRL tests its tool loop, generation returns fixed token ids.

Also the small pieces every trainer test shares: the tiny model, a one-step CPU config, a reward, a training check.
"""

import json

import torch
from datasets import Dataset

from trl_tree.rollout.engine import ScriptedEngine
from trl_tree.testing import tiny_model_and_tokenizer

CALL_1_PLUS_1 = '<tool_call>\n{"name": "calculator", "arguments": {"expression": "1+1"}}\n</tool_call>'
# what a history ends with when the model speaks again after a tool result (the key of a reply script)
AFTER_TOOL = "</tool_response><|im_end|>\n<|im_start|>assistant\n"


def tool_call(name: str, **arguments) -> str:
    return f'<tool_call>\n{json.dumps({"name": name, "arguments": arguments})}\n</tool_call>'


class PrefixScript:
    """Answers the i-th generation from a given suffix of the history with the i-th text listed for it.

    `replies` maps the text the history ends with (decoded, after the last assistant header) to the list of texts to
    produce, consumed in call order; every text is closed with the end-of-turn token.
    """

    def __init__(self, tokenizer, replies: dict[str, list[str]]):
        self.tokenizer = tokenizer
        self.replies = {k: list(v) for k, v in replies.items()}
        self.eos = tokenizer.convert_tokens_to_ids("<|im_end|>")

    def __call__(self, prefix: list[int]) -> list[int]:
        text = self.tokenizer.decode(prefix, skip_special_tokens=False)
        key = max((k for k in self.replies if text.endswith(k) or k == ""), key=len)
        reply = self.replies[key].pop(0)
        return self.tokenizer.encode(reply, add_special_tokens=False) + [self.eos]


class CounterEnv:
    """A stateful environment: a branch must continue from the count its trajectory had at the anchor."""

    def __init__(self):
        self.n = 0

    def reset(self, **kwargs):
        self.n = 0

    def increment(self) -> str:
        """Adds one to the counter.

        Returns:
            The counter's new value.
        """
        self.n += 1
        return str(self.n)


def scripted_engine(tokenizer, replies) -> ScriptedEngine:
    script = PrefixScript(tokenizer, replies)
    return ScriptedEngine(script, eos_ids=[script.eos])


def contains_answer(completions, answer, **kwargs):
    """1 if the final assistant message contains the gold answer."""
    return [float(a in (c[-1].get("content") or "")) for c, a in zip(completions, answer)]


def tiny():
    return tiny_model_and_tokenizer()


def arithmetic_dataset(n: int) -> Dataset:
    return Dataset.from_dict(
        {"prompt": [[{"role": "user", "content": "What is 1+1?"}]] * n, "answer": ["2"] * n}
    )


def config(cls, tmp_path, trees_per_micro_batch=1, **overrides):
    """A one-step CPU config; per_device_train_batch_size counts trajectories of budget (trees × G), as in GRPO."""
    defaults = dict(
        output_dir=str(tmp_path),
        steps_per_generation=1,
        max_steps=1,
        num_initial_rollouts=2,
        num_branches=1,
        max_turns=3,
        max_completion_length=96,
        logging_steps=1,
        report_to="none",
        bf16=False,
        gradient_checkpointing=False,
        use_cpu=True,
        save_strategy="no",
        learning_rate=1e-2,
        seed=0,
    )
    defaults.update(overrides)
    defaults.setdefault("per_device_train_batch_size", trees_per_micro_batch * cls.num_generations_for(**defaults))
    return cls(**defaults)


def unchanged_after_training(trainer) -> list[str]:
    """Run `trainer.train()` and return the names of the trainable parameters it left exactly as they were."""
    before = {n: p.detach().clone() for n, p in trainer.model.named_parameters() if p.requires_grad}
    trainer.train()
    return [n for n, p in trainer.model.named_parameters() if p.requires_grad and torch.equal(p, before[n])]


def hf_engine(trainer, monkeypatch, cache: str, with_scores: bool = False, **generation):
    """An `HFEngine` of `trainer` with `generation_cache=cache` and these generation-config fields (undone after the
    test by `monkeypatch`)."""
    import copy

    from trl_tree.rollout.engine import HFEngine
    from trl_tree.trainer.engine_ports import hf_ports

    monkeypatch.setattr(trainer.args, "generation_cache", cache)
    gen_config = copy.deepcopy(trainer.generation_config)
    for key, value in generation.items():
        setattr(gen_config, key, value)
    monkeypatch.setattr(trainer, "generation_config", gen_config)
    return HFEngine(hf_ports(trainer), with_scores=with_scores)
