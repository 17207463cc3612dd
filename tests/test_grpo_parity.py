"""TRL's own GRPOTrainer tests, ported to run unchanged on `GRPOTrainer` (the reference) and on `TreeOPSDTrainer`.

The drop-in promise is that a GRPO pipeline keeps working when only the trainer and config classes are swapped. So
every test here is parametrized over the trainer class, builds its config from the *same* keyword arguments for both
(`GRPOConfig` / `TreeOPSDConfig`), and asserts an outcome that must hold for both: the parameters change, only the
LoRA parameters change, a metric is logged, a reward function saw a dataset column, a tool ran, a bad input raises.

Where they come from: `tests/test_grpo_trainer.py` of huggingface/trl (the `TestGRPOTrainer` class: dataset formats,
reward functions and weights, async and `None` rewards, reward models, PEFT, gradient checkpointing, eval, tools,
malformed tool calls, `environment_factory`, `log_completions`, `log_metric` / `log_extra`, `mask_truncated_completions`,
`multi_objective_aggregation`), ported in structure, not in text, with offline stand-ins for the Hub assets: the tiny
Qwen3 and tokenizer of `trl_tree.testing` for `trl-internal-testing/tiny-*ForCausalLM`, a sequence-classification
model built locally from the same config for `tiny-Qwen2ForSequenceClassification`, and datasets built in the test for
`trl-internal-testing/zen`. Callbacks, checkpoints and resuming are the transformers `Trainer` contract GRPO users
rely on. Like TRL's tool tests, the scripted tests replace `model.generate` with a stand-in that writes fixed replies:
both trainers generate through `model.generate`, so one script drives both.

Most tests leave `num_generations` at GRPO's default (8), with `per_device_train_batch_size=8`, so that each test
exercises its own feature; `test_num_generations_and_batch_size_carry_over` sets it explicitly.

Every test passes on both trainers: a gap of the tree trainer is a failing test here, not a skip.
"""

import socket
from unittest.mock import patch

import pytest
import torch
from datasets import Dataset
from peft import LoraConfig
from transformers import (
    AutoModelForCausalLM,
    AutoModelForSequenceClassification,
    AutoTokenizer,
    Qwen3Config,
    TrainerCallback,
)
from transformers.generation.utils import GenerateDecoderOnlyOutput
from trl import GRPOConfig, GRPOTrainer

from tests.scripted import AFTER_TOOL, CPU_RUN, tool_call
from trl_tree import TreeOPSDConfig, TreeOPSDTrainer
from trl_tree.testing import tiny_model_path

CONFIGS = {GRPOTrainer: GRPOConfig, TreeOPSDTrainer: TreeOPSDConfig}

# The keyword arguments every test passes to both config classes. `per_device_train_batch_size` = 8 completions is
# one prompt × GRPO's default `num_generations` (8). Generation is kept short and CPU-only; the learning rate is TRL's
# test value ("gradients are tiny and default lr can stall updates").
COMMON = dict(per_device_train_batch_size=8, max_completion_length=8, max_steps=1, learning_rate=0.1, **CPU_RUN)
# Scripted tool calls need room for the call, the tool response and an answer.
TOOL_BUDGET = dict(max_completion_length=128)

def trainers():
    """Parametrize a test over both trainers: GRPOTrainer is the reference, TreeOPSDTrainer the drop-in."""
    return pytest.mark.parametrize(
        "trainer_cls", [pytest.param(GRPOTrainer, id="grpo"), pytest.param(TreeOPSDTrainer, id="treeopsd")]
    )


def make_args(trainer_cls, tmp_path, **overrides):
    """The config of `trainer_cls` from COMMON plus `overrides`: the same keyword arguments for both trainers."""
    return CONFIGS[trainer_cls](output_dir=str(tmp_path), **{**COMMON, **overrides})


# ---------------------------------------------------------------------------------------------------------------------
# Offline stand-ins: models, datasets, tools
# ---------------------------------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def model_path():
    """The tiny Qwen3 causal LM and its tokenizer (TRL's qwen3 chat template), built once and cached on disk."""
    return tiny_model_path()


@pytest.fixture(scope="module")
def reward_model_path(model_path, tmp_path_factory):
    """A randomly initialised one-label sequence classifier from the tiny config, saved with the same tokenizer."""
    tokenizer = AutoTokenizer.from_pretrained(model_path)
    config = Qwen3Config.from_pretrained(model_path, num_labels=1, pad_token_id=tokenizer.pad_token_id)
    with torch.random.fork_rng(devices=[]):  # a fixed init without touching the tests' random state
        torch.manual_seed(0)
        model = AutoModelForSequenceClassification.from_config(config)
    path = tmp_path_factory.mktemp("reward") / "tiny-Qwen3ForSequenceClassification"
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    return str(path)


QUESTIONS = [f"What is {a} times {b}?" for a, b in [(3, 4), (2, 5), (6, 7), (8, 9), (1, 2), (4, 4), (5, 3), (7, 2)]]


def conversational_dataset(n: int = 8, **columns) -> Dataset:
    return Dataset.from_dict({"prompt": [[{"role": "user", "content": q}] for q in QUESTIONS[:n]], **columns})


def standard_dataset(n: int = 8) -> Dataset:
    return Dataset.from_dict({"prompt": [f"The answer to '{q}' is" for q in QUESTIONS[:n]]})


def text_of(completion) -> str:
    """A completion as text, for both dataset formats (a string, or a list of messages)."""
    if isinstance(completion, str):
        return completion
    return "".join(str(m.get("content") or "") + str(m.get("tool_calls") or "") for m in completion)


def length_reward(completions, **kwargs):
    """Longer completions score higher: varies between samples, so every group / tree has a learning signal."""
    return [float(len(text_of(c))) for c in completions]


def letters_reward(completions, **kwargs):
    """Completions with more distinct characters score higher."""
    return [float(len(set(text_of(c)))) for c in completions]


def multiply_tool(a: int, b: int) -> int:
    """
    Multiplies two integers.

    Args:
        a: The first integer.
        b: The second integer.

    Returns:
        The product of the two integers.
    """
    return a * b


async def async_multiply_tool(a: int, b: int) -> int:
    """
    Asynchronously multiplies two integers.

    Args:
        a: The first integer.
        b: The second integer.

    Returns:
        The product of the two integers.
    """
    return a * b


def trainable_snapshot(trainer) -> dict[str, torch.Tensor]:
    return {n: p.detach().clone() for n, p in trainer.model.named_parameters() if p.requires_grad}


def changed(trainer, before: dict[str, torch.Tensor]) -> set[str]:
    return {n for n, p in trainer.model.named_parameters() if n in before and not torch.equal(p, before[n])}


def train_and_check_every_parameter_changed(trainer):
    before = trainable_snapshot(trainer)
    trainer.train()
    assert trainer.state.log_history[-1]["train_loss"] is not None
    assert changed(trainer, before) == set(before), f"unchanged: {sorted(set(before) - changed(trainer, before))}"


def logged_keys(trainer) -> set[str]:
    return {key for entry in trainer.state.log_history for key in entry}


# ---------------------------------------------------------------------------------------------------------------------
# Scripted generation: one stand-in for `model.generate` that both trainers call
# ---------------------------------------------------------------------------------------------------------------------


def tool_call_turn(name: str, **arguments) -> str:
    """An assistant turn that calls `name` and ends."""
    return tool_call(name, **arguments) + "<|im_end|>"




class ScriptedGenerate:
    """Replaces `model.generate`: row r of a batch whose prompt text is `prefix` gets the reply `script(prefix, r)`.

    Replies are text; `<|im_end|>` in it ends the turn, and a reply without it runs until the token budget, like a
    model that never stops. Returns what `generate` returns for the caller's generation config (a tensor of prompt +
    completion ids, or a `GenerateDecoderOnlyOutput` when `return_dict_in_generate` is set), right-padded.
    """

    def __init__(self, tokenizer, script):
        self.tokenizer = tokenizer
        self.script = script

    def __call__(self, input_ids, attention_mask=None, generation_config=None, **kwargs):
        mask = torch.ones_like(input_ids) if attention_mask is None else attention_mask
        budget = generation_config.max_new_tokens
        replies = []
        for row, (ids, keep) in enumerate(zip(input_ids, mask)):
            prefix = self.tokenizer.decode(ids[keep.bool()].tolist(), skip_special_tokens=False)
            reply = self.tokenizer.encode(self.script(prefix, row), add_special_tokens=False)
            replies.append(reply[:budget])
        width = max(len(r) for r in replies)
        pad = self.tokenizer.pad_token_id
        new = torch.tensor([r + [pad] * (width - len(r)) for r in replies], dtype=input_ids.dtype)
        sequences = torch.cat([input_ids, new.to(input_ids.device)], dim=1)
        if generation_config is not None and generation_config.return_dict_in_generate:
            return GenerateDecoderOnlyOutput(sequences=sequences)
        return sequences


def scripted(trainer, script):
    """A context manager under which the trainer's model generates what `script(prefix, row)` says."""
    return patch.object(trainer.model, "generate", side_effect=ScriptedGenerate(trainer.processing_class, script))


# ---------------------------------------------------------------------------------------------------------------------
# Datasets
# ---------------------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("fmt", ["standard", "conversational"])
@trainers()
def test_dataset_format_trains_every_parameter(trainer_cls, fmt, model_path, tmp_path):
    dataset = standard_dataset() if fmt == "standard" else conversational_dataset()
    trainer = trainer_cls(
        model=model_path, reward_funcs=length_reward, args=make_args(trainer_cls, tmp_path), train_dataset=dataset
    )
    train_and_check_every_parameter_changed(trainer)


@trainers()
def test_extra_columns_and_trainer_state_reach_reward_functions(trainer_cls, model_path, tmp_path):
    expected = {q: i for i, q in enumerate(QUESTIONS)}
    seen = []

    def column_reward(prompts, completions, some_values, trainer_state, **kwargs):
        assert hasattr(trainer_state, "global_step")
        seen.extend((p[-1]["content"], v) for p, v in zip(prompts, some_values, strict=True))
        return length_reward(completions)

    dataset = conversational_dataset(some_values=list(range(len(QUESTIONS))))
    trainer = trainer_cls(
        model=model_path, reward_funcs=column_reward, args=make_args(trainer_cls, tmp_path), train_dataset=dataset
    )
    train_and_check_every_parameter_changed(trainer)
    assert seen and all(expected[question] == value for question, value in seen)


@trainers()
def test_dataset_without_prompt_column_raises(trainer_cls, model_path, tmp_path):
    dataset = Dataset.from_dict({"question": QUESTIONS})
    with pytest.raises((KeyError, ValueError), match="prompt"):  # GRPO raises in train(); at init is as good
        trainer = trainer_cls(
            model=model_path, reward_funcs=length_reward, args=make_args(trainer_cls, tmp_path), train_dataset=dataset
        )
        trainer.train()


@trainers()
def test_num_generations_and_batch_size_carry_over(trainer_cls, model_path, tmp_path):
    """A GRPO config with num_generations=4 and per_device_train_batch_size=4 trains one prompt per step."""
    prompts_seen = set()

    def recording_reward(prompts, completions, **kwargs):
        prompts_seen.update(p[-1]["content"] for p in prompts)
        return length_reward(completions)

    args = make_args(trainer_cls, tmp_path, num_generations=4, per_device_train_batch_size=4)
    trainer = trainer_cls(
        model=model_path, reward_funcs=recording_reward, args=args, train_dataset=conversational_dataset()
    )
    train_and_check_every_parameter_changed(trainer)
    assert len(prompts_seen) == 1


@trainers()
def test_num_generations_larger_than_the_batch_size_trains(trainer_cls, model_path, tmp_path):
    """Ported from TRL's test_training_num_generations_larger_than_batch_size: a group of 6 spans two micro-batches
    of 3 with gradient accumulation 2; both trainers train one prompt per optimizer step."""
    prompts_per_step = []

    def recording_reward(prompts, completions, **kwargs):
        prompts_per_step.append(len({p[-1]["content"] for p in prompts}))
        return length_reward(completions)

    args = make_args(trainer_cls, tmp_path, num_generations=6, per_device_train_batch_size=3,
                     gradient_accumulation_steps=2)
    trainer = trainer_cls(
        model=model_path, reward_funcs=recording_reward, args=args, train_dataset=conversational_dataset()
    )
    train_and_check_every_parameter_changed(trainer)
    assert prompts_per_step and set(prompts_per_step) == {1}


# ---------------------------------------------------------------------------------------------------------------------
# Reward functions and reward models
# ---------------------------------------------------------------------------------------------------------------------


@trainers()
def test_multiple_reward_funcs_with_weights_are_logged(trainer_cls, model_path, tmp_path):
    args = make_args(trainer_cls, tmp_path, reward_weights=[0.7, 0.3])
    trainer = trainer_cls(
        model=model_path, reward_funcs=[length_reward, letters_reward], args=args,
        train_dataset=conversational_dataset(),
    )
    train_and_check_every_parameter_changed(trainer)
    for name in ("length_reward", "letters_reward"):
        for stat in ("mean", "std"):
            assert f"rewards/{name}/{stat}" in trainer.state.log_history[0]


@pytest.mark.parametrize("aggregation", ["sum_then_normalize", "normalize_then_sum"])
@trainers()
def test_logged_reward_reflects_reward_weights(trainer_cls, aggregation, model_path, tmp_path):
    def constant_one(completions, **kwargs):
        return [1.0] * len(completions)

    def constant_zero(completions, **kwargs):
        return [0.0] * len(completions)

    args = make_args(trainer_cls, tmp_path, reward_weights=[0.7, 0.3], multi_objective_aggregation=aggregation)
    trainer = trainer_cls(
        model=model_path, reward_funcs=[constant_one, constant_zero], args=args, train_dataset=conversational_dataset()
    )
    trainer.train()
    assert trainer.state.log_history[0]["reward"] == pytest.approx(0.7)


AGGREGATION_REPLIES = ["Twelve.<|im_end|>", "It is 12, I think.<|im_end|>", "No idea<|im_end|>", "12<|im_end|>"]


def _logged_advantages(trainer_cls, aggregation, scale, model_path, tmp_path):
    """Advantages after one scripted step with rewards [scale × length, has-a-digit]."""

    def scaled_length(completions, **kwargs):
        return [scale * r for r in length_reward(completions)]

    def has_digit(completions, **kwargs):
        return [float(any(ch.isdigit() for ch in text_of(c))) for c in completions]

    args = make_args(trainer_cls, tmp_path, multi_objective_aggregation=aggregation, log_completions=True,
                     max_completion_length=16)
    trainer = trainer_cls(
        model=model_path, reward_funcs=[scaled_length, has_digit], args=args, train_dataset=conversational_dataset()
    )
    with scripted(trainer, lambda prefix, row: AGGREGATION_REPLIES[row % len(AGGREGATION_REPLIES)]):
        trainer.train()
    return torch.tensor(list(trainer._logs["advantages"]))


@pytest.mark.parametrize(
    ("trainer_cls", "aggregation"),
    [
        pytest.param(GRPOTrainer, "sum_then_normalize", id="grpo-sum_then_normalize"),
        pytest.param(GRPOTrainer, "normalize_then_sum", id="grpo-normalize_then_sum"),
        pytest.param(TreeOPSDTrainer, "sum_then_normalize", id="treeopsd-sum_then_normalize"),
        pytest.param(TreeOPSDTrainer, "normalize_then_sum", id="treeopsd-normalize_then_sum"),
    ],
)
def test_normalize_then_sum_makes_advantages_independent_of_a_reward_scale(
    trainer_cls, aggregation, model_path, tmp_path
):
    """normalize_then_sum normalises each reward function before summing: scaling one function changes nothing.
    sum_then_normalize sums first, so the larger-scale function dominates and the advantages move."""
    small = _logged_advantages(trainer_cls, aggregation, 1.0, model_path, tmp_path / "x1")
    large = _logged_advantages(trainer_cls, aggregation, 1000.0, model_path, tmp_path / "x1000")
    assert small.shape == large.shape and small.numel() > 0
    same = torch.allclose(small, large, atol=1e-3)
    assert same == (aggregation == "normalize_then_sum")


@trainers()
def test_sync_and_async_reward_funcs(trainer_cls, model_path, tmp_path):
    def constant(completions, **kwargs):
        return [1 for _ in completions]

    async def async_letters(completions, **kwargs):
        return letters_reward(completions)

    trainer = trainer_cls(
        model=model_path, reward_funcs=[length_reward, constant, async_letters],
        args=make_args(trainer_cls, tmp_path), train_dataset=conversational_dataset(),
    )
    train_and_check_every_parameter_changed(trainer)


@trainers()
def test_reward_funcs_returning_none_for_some_or_all_samples(trainer_cls, model_path, tmp_path):
    """None means "not applicable" (TRL): the other functions' rewards still train the model."""

    def every_other(completions, **kwargs):
        return [None if i % 2 else r for i, r in enumerate(length_reward(completions))]

    def never_applicable(completions, **kwargs):
        return [None] * len(completions)

    trainer = trainer_cls(
        model=model_path, reward_funcs=[letters_reward, every_other, never_applicable],
        args=make_args(trainer_cls, tmp_path), train_dataset=conversational_dataset(),
    )
    train_and_check_every_parameter_changed(trainer)
    logged = trainer.state.log_history[0]
    assert torch.isfinite(torch.tensor(logged["rewards/every_other/mean"]))


@trainers()
def test_reward_func_returning_a_tensor(trainer_cls, model_path, tmp_path):
    def tensor_reward(completions, **kwargs):
        return torch.tensor(length_reward(completions))

    trainer = trainer_cls(
        model=model_path, reward_funcs=tensor_reward, args=make_args(trainer_cls, tmp_path),
        train_dataset=conversational_dataset(),
    )
    train_and_check_every_parameter_changed(trainer)


@trainers()
def test_reward_model_from_a_path(trainer_cls, model_path, reward_model_path, tmp_path):
    """A reward model given by name: TRL loads it and its tokenizer, and scores the rendered conversation."""
    trainer = trainer_cls(
        model=model_path, reward_funcs=reward_model_path, args=make_args(trainer_cls, tmp_path),
        train_dataset=conversational_dataset(),
    )
    train_and_check_every_parameter_changed(trainer)
    assert "rewards/tiny-Qwen3ForSequenceClassification/mean" in trainer.state.log_history[0]


@trainers()
def test_reward_model_instance_with_its_tokenizer_mixed_with_a_function(
    trainer_cls, model_path, reward_model_path, tmp_path
):
    """A reward model instance with its own tokenizer, on a standard (text) dataset: it scores prompt + completion."""
    reward_model = AutoModelForSequenceClassification.from_pretrained(reward_model_path, num_labels=1)
    reward_tokenizer = AutoTokenizer.from_pretrained(reward_model_path)
    calls = []
    original_forward = reward_model.forward

    def counting_forward(*args, **kwargs):
        calls.append(kwargs["input_ids"].shape[0])
        return original_forward(*args, **kwargs)

    reward_model.forward = counting_forward
    trainer = trainer_cls(
        model=model_path, reward_funcs=[reward_model, length_reward], reward_processing_classes=[reward_tokenizer, None],
        args=make_args(trainer_cls, tmp_path), train_dataset=standard_dataset(),
    )
    train_and_check_every_parameter_changed(trainer)
    assert sum(calls) > 0  # the reward model scored the completions


# ---------------------------------------------------------------------------------------------------------------------
# PEFT and gradient checkpointing
# ---------------------------------------------------------------------------------------------------------------------


@trainers()
def test_lora_trains_only_adapter_parameters(trainer_cls, model_path, tmp_path):
    model = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32)
    base_names = {f"base_model.model.{n}" for n, _ in model.named_parameters()}
    # Two steps: LoRA's B starts at zero, so A receives its first gradient only in the second step.
    args = make_args(trainer_cls, tmp_path, max_steps=2)
    trainer = trainer_cls(
        model=model, reward_funcs=length_reward, args=args, train_dataset=conversational_dataset(),
        peft_config=LoraConfig(r=8, lora_alpha=16, target_modules=["q_proj", "v_proj"]),
    )
    before = {n: p.detach().clone() for n, p in trainer.model.named_parameters()}
    trainer.train()
    moved = {n for n, p in trainer.model.named_parameters() if not torch.equal(p, before[n])}
    lora = {n for n in before if "lora_" in n}
    assert lora and moved == lora
    assert not moved & base_names


@trainers()
def test_gradient_checkpointing_trains_every_parameter(trainer_cls, model_path, tmp_path):
    args = make_args(trainer_cls, tmp_path, gradient_checkpointing=True)
    trainer = trainer_cls(
        model=model_path, reward_funcs=length_reward, args=args, train_dataset=conversational_dataset()
    )
    train_and_check_every_parameter_changed(trainer)


# ---------------------------------------------------------------------------------------------------------------------
# Tools
# ---------------------------------------------------------------------------------------------------------------------


@trainers()
def test_tools_are_rendered_into_the_prompt_and_training_runs(trainer_cls, model_path, tmp_path):
    """Unscripted: the tiny model rarely calls the tool, but the schema must be in what it is asked to continue."""
    trainer = trainer_cls(
        model=model_path, reward_funcs=length_reward, args=make_args(trainer_cls, tmp_path),
        train_dataset=conversational_dataset(), tools=[multiply_tool],
    )
    prompts_given = []
    generate = trainer.model.generate

    def spy(*args, **kwargs):
        prompts_given.append(trainer.processing_class.decode(kwargs["input_ids"][0], skip_special_tokens=False))
        return generate(*args, **kwargs)

    with patch.object(trainer.model, "generate", side_effect=spy):
        trainer.train()
    assert trainer.state.log_history[-1]["train_loss"] is not None
    assert prompts_given and all('"name": "multiply_tool"' in p and "<tools>" in p for p in prompts_given)
    assert "tools/call_frequency" in trainer.state.log_history[0]


def multiply_script(tool_name: str):
    """Row 0 of every three calls the tool correctly, row 1 with a wrong argument name, row 2 answers directly;
    after a tool response the model says "Done!"."""

    def script(prefix: str, row: int) -> str:
        if prefix.endswith(AFTER_TOOL):
            return "Done!<|im_end|>"
        return [tool_call_turn(tool_name, a=3, b=4), tool_call_turn(tool_name, a=3, c=4), "I don't know any tool.<|im_end|>"][
            row % 3
        ]

    return script


@pytest.mark.parametrize("tool", [multiply_tool, async_multiply_tool], ids=["sync", "async"])
@trainers()
def test_scripted_tool_calls_run_and_reach_the_reward_function(trainer_cls, tool, model_path, tmp_path):
    completions_seen = []

    def reward(completions, **kwargs):
        completions_seen.extend(completions)
        return length_reward(completions)

    args = make_args(trainer_cls, tmp_path, **TOOL_BUDGET)
    trainer = trainer_cls(
        model=model_path, reward_funcs=reward, args=args, train_dataset=conversational_dataset(), tools=[tool]
    )
    before = trainable_snapshot(trainer)
    with scripted(trainer, multiply_script(tool.__name__)):
        trainer.train()
    assert changed(trainer, before) == set(before)
    tool_messages = [m for c in completions_seen for m in c if m["role"] == "tool"]
    assert any(str(m["content"]) == "12" for m in tool_messages)  # the correct call ran: 3 × 4
    logged = trainer.state.log_history[0]
    assert logged["tools/call_frequency"] > 0
    assert 0 < logged["tools/failure_frequency"] < 1  # the call with a wrong argument name failed, the other did not


def product_record(a: int, b: int) -> dict:
    """
    Multiplies two integers and returns a record of the operation.

    Args:
        a: The first integer.
        b: The second integer.

    Returns:
        The operands and their product.
    """
    return {"a": a, "b": b, "product": a * b}


@trainers()
def test_tool_results_reach_the_reward_function_as_grpo_passes_them(trainer_cls, model_path, tmp_path):
    """GRPO puts a tool's result into the tool message as `str(result)` (a list, for multimodal content, as it is)."""
    tool_contents = []

    def reward(completions, **kwargs):
        tool_contents.extend(m["content"] for c in completions for m in c if m["role"] == "tool")
        return length_reward(completions)

    args = make_args(trainer_cls, tmp_path, **TOOL_BUDGET)
    trainer = trainer_cls(
        model=model_path, reward_funcs=reward, args=args, train_dataset=conversational_dataset(),
        tools=[product_record],
    )
    with scripted(trainer, multiply_script("product_record")):
        trainer.train()
    assert str(product_record(3, 4)) in tool_contents


@trainers()
def test_malformed_tool_calls_run_no_tool_and_training_goes_on(trainer_cls, model_path, tmp_path):
    ran = []

    def recording_multiply(a: int, b: int) -> int:
        """
        Multiplies two integers.

        Args:
            a: The first integer.
            b: The second integer.
        """
        ran.append((a, b))
        return a * b

    malformed = [
        '<tool_call>\n{"arguments": {"a": 3, "b": 4}}\n</tool_call><|im_end|>',  # no name
        "<toolcall>\n{\"name\": \"recording_multiply\"}\n</toolcall><|im_end|>",  # not the tool tag
        '<tool_call>\n{"name": "recording_multiply", "arguments": {a: 3, b: 4}}\n</tool_call><|im_end|>',  # bad JSON
        "Done!<|im_end|>",
    ]
    args = make_args(trainer_cls, tmp_path, **TOOL_BUDGET)
    trainer = trainer_cls(
        model=model_path, reward_funcs=length_reward, args=args, train_dataset=conversational_dataset(),
        tools=[recording_multiply],
    )
    before = trainable_snapshot(trainer)
    with scripted(trainer, lambda prefix, row: malformed[row % len(malformed)]):
        trainer.train()
    assert changed(trainer, before) == set(before)
    assert not ran


@trainers()
def test_max_tool_calling_iterations_caps_the_tool_calls_of_a_completion(trainer_cls, model_path, tmp_path):
    completions_seen = []

    def reward(completions, **kwargs):
        completions_seen.extend(completions)
        return length_reward(completions)

    args = make_args(trainer_cls, tmp_path, max_tool_calling_iterations=1, **TOOL_BUDGET)
    trainer = trainer_cls(
        model=model_path, reward_funcs=reward, args=args, train_dataset=conversational_dataset(),
        tools=[multiply_tool],
    )
    # a model that never stops calling the tool
    with scripted(trainer, lambda prefix, row: tool_call_turn("multiply_tool", a=row, b=2)):
        trainer.train()
    calls_per_completion = [sum(m["role"] == "tool" for m in c) for c in completions_seen]
    assert max(calls_per_completion) == 1


# ---------------------------------------------------------------------------------------------------------------------
# Environments
# ---------------------------------------------------------------------------------------------------------------------


class CounterEnvironment:
    """TRL's test environment: a counter the model increments through a tool."""

    def reset(self, **kwargs):
        self._counter = 0

    def increment(self, step: int) -> int:
        """
        Increment the internal counter.

        Args:
            step: Value to add to the counter.

        Returns:
            The updated counter value.
        """
        self._counter += step
        return self._counter


def counter_script(prefix: str, row: int) -> str:
    """A correct call, a call to a tool that does not exist, no call; then "Done!" after a tool response."""
    if prefix.endswith(AFTER_TOOL):
        return "Done!<|im_end|>"
    return [tool_call_turn("increment", step=1), tool_call_turn("decrement", step=2), "I won't increment.<|im_end|>"][row % 3]


def check_environment_run(trainer_cls, environment_factory, model_path, tmp_path):
    """Train one scripted step; every completion's environment must hold exactly the state its own calls made."""
    seen = []

    def counter_reward(completions, environments, **kwargs):
        seen.extend(zip(completions, environments, strict=True))
        return [float(env._counter) for env in environments]

    args = make_args(trainer_cls, tmp_path, **TOOL_BUDGET)
    trainer = trainer_cls(
        model=model_path, reward_funcs=counter_reward, args=args, train_dataset=conversational_dataset(),
        environment_factory=environment_factory,
    )
    before = trainable_snapshot(trainer)
    with scripted(trainer, counter_script):
        trainer.train()
    assert changed(trainer, before) == set(before)
    assert seen
    for completion, env in seen:
        assert env._counter == sum(m["role"] == "tool" and m["name"] == "increment" for m in completion)
    assert any(env._counter == 1 for _, env in seen)
    assert trainer.state.log_history[0]["tools/failure_frequency"] > 0  # "decrement" is no tool


@trainers()
def test_environment_factory_state_follows_each_completion(trainer_cls, model_path, tmp_path):
    check_environment_run(trainer_cls, CounterEnvironment, model_path, tmp_path)


class RemoteCounterClient(CounterEnvironment):
    """Like OpenEnv's clients: the environment holds a connection to a session, and a connection cannot be copied."""

    opened: list[socket.socket] = []

    def __init__(self):
        self._connection, peer = socket.socketpair()
        RemoteCounterClient.opened += [self._connection, peer]


@pytest.fixture
def close_connections():
    yield
    while RemoteCounterClient.opened:
        RemoteCounterClient.opened.pop().close()


@trainers()
def test_environment_that_cannot_be_copied(trainer_cls, model_path, tmp_path, close_connections):
    check_environment_run(trainer_cls, RemoteCounterClient, model_path, tmp_path)


# ---------------------------------------------------------------------------------------------------------------------
# Logging and callbacks
# ---------------------------------------------------------------------------------------------------------------------


@trainers()
def test_log_completions_fills_the_completion_table(trainer_cls, model_path, tmp_path):
    args = make_args(trainer_cls, tmp_path, log_completions=True)
    trainer = trainer_cls(
        model=model_path, reward_funcs=[length_reward, letters_reward], args=args,
        train_dataset=conversational_dataset(),
    )
    trainer.train()
    logs = trainer._logs
    n = len(logs["prompt"])
    assert n > 0 and len(logs["completion"]) == n and len(logs["advantages"]) == n
    assert all(len(logs["rewards"][name]) == n for name in ("length_reward", "letters_reward"))
    assert all(p in [[{"role": "user", "content": q}] for q in QUESTIONS] for p in logs["prompt"])


@trainers()
def test_reward_func_log_metric_and_log_extra(trainer_cls, model_path, tmp_path):
    def reward(completions, log_metric, log_extra, **kwargs):
        log_metric("custom_accuracy", 0.75)
        log_extra("first_characters", [text_of(c)[:5] for c in completions])
        return length_reward(completions)

    args = make_args(trainer_cls, tmp_path, log_completions=True)
    trainer = trainer_cls(model=model_path, reward_funcs=reward, args=args, train_dataset=conversational_dataset())
    trainer.train()
    assert trainer.state.log_history[0].get("custom_accuracy") == pytest.approx(0.75)
    assert "first_characters" in trainer._logs["extra"]


class RecordingCallback(TrainerCallback):
    def __init__(self):
        self.logs, self.steps = [], []

    def on_log(self, args, state, control, logs=None, **kwargs):
        self.logs.append(dict(logs or {}))

    def on_step_end(self, args, state, control, **kwargs):
        self.steps.append(state.global_step)


@trainers()
def test_callbacks_receive_on_step_end_and_on_log(trainer_cls, model_path, tmp_path):
    callback = RecordingCallback()
    trainer = trainer_cls(
        model=model_path, reward_funcs=length_reward, args=make_args(trainer_cls, tmp_path, max_steps=2),
        train_dataset=conversational_dataset(), callbacks=[callback],
    )
    trainer.train()
    assert callback.steps == [1, 2]
    step_logs = [entry for entry in callback.logs if "loss" in entry]
    assert len(step_logs) == 2
    for entry in step_logs:
        for key in ("loss", "grad_norm", "learning_rate", "reward", "reward_std", "rewards/length_reward/mean",
                    "completions/mean_length"):
            assert key in entry, key
    assert "train_loss" in callback.logs[-1]


# The GRPO metrics that have a meaning for every tree method ("completion" = a leaf trajectory). Left out: kl (not
# logged with beta=0 by GRPO either) and clip_ratio/* (TreeOPSD's loss does not clip).
GRPO_METRICS = [
    "num_tokens", "reward", "reward_std", "rewards/length_reward/mean", "rewards/length_reward/std",
    "frac_reward_zero_std", "completions/mean_length", "completions/min_length", "completions/max_length",
    "completions/clipped_ratio", "completions/mean_terminated_length", "completions/min_terminated_length",
    "completions/max_terminated_length", "entropy",
]


@trainers()
def test_grpo_metrics_are_logged_under_grpo_names(trainer_cls, model_path, tmp_path):
    trainer = trainer_cls(
        model=model_path, reward_funcs=length_reward, args=make_args(trainer_cls, tmp_path),
        train_dataset=conversational_dataset(),
    )
    trainer.train()
    missing = [key for key in GRPO_METRICS if key not in trainer.state.log_history[0]]
    assert not missing, missing


# ---------------------------------------------------------------------------------------------------------------------
# Evaluation, checkpoints, resuming
# ---------------------------------------------------------------------------------------------------------------------


@trainers()
def test_eval_dataset_with_eval_strategy_logs_eval_metrics(trainer_cls, model_path, tmp_path):
    args = make_args(trainer_cls, tmp_path, eval_strategy="steps", eval_steps=1, per_device_eval_batch_size=8)
    trainer = trainer_cls(
        model=model_path, reward_funcs=length_reward, args=args, train_dataset=conversational_dataset(),
        eval_dataset=conversational_dataset(2),
    )
    trainer.train()
    keys = logged_keys(trainer)
    assert {"eval_loss", "eval_reward", "eval_rewards/length_reward/mean"} <= keys


@trainers()
def test_checkpoints_hold_the_trainer_state_and_training_resumes(trainer_cls, model_path, tmp_path):
    args = make_args(trainer_cls, tmp_path, save_strategy="steps", save_steps=1)
    trainer = trainer_cls(
        model=model_path, reward_funcs=length_reward, args=args, train_dataset=conversational_dataset()
    )
    trainer.train()
    checkpoint = tmp_path / "checkpoint-1"
    files = {p.name for p in checkpoint.iterdir()}
    expected = {"model.safetensors", "config.json", "trainer_state.json", "optimizer.pt", "scheduler.pt",
                "rng_state.pth", "training_args.bin", "tokenizer.json", "tokenizer_config.json"}
    assert expected <= files, expected - files

    args = make_args(trainer_cls, tmp_path, save_strategy="steps", save_steps=1, max_steps=2)
    resumed = trainer_cls(
        model=model_path, reward_funcs=length_reward, args=args, train_dataset=conversational_dataset()
    )
    resumed.train(resume_from_checkpoint=str(checkpoint))
    assert resumed.state.global_step == 2
    assert [e["step"] for e in resumed.state.log_history if "loss" in e] == [1, 2]


# ---------------------------------------------------------------------------------------------------------------------
# Truncated completions
# ---------------------------------------------------------------------------------------------------------------------


@trainers()
def test_mask_truncated_completions_all_truncated_leaves_the_model_unchanged(trainer_cls, model_path, tmp_path):
    """Every completion runs past max_completion_length: with the mask on, nothing is trained and the loss is 0."""
    args = make_args(trainer_cls, tmp_path, mask_truncated_completions=True)
    trainer = trainer_cls(
        model=model_path, reward_funcs=length_reward, args=args, train_dataset=conversational_dataset()
    )
    never_stops = ["one two three four five six seven eight nine ten", "a b c d e f g h i j k l m n o p"]
    before = trainable_snapshot(trainer)
    with scripted(trainer, lambda prefix, row: never_stops[row % 2]):
        trainer.train()
    assert trainer.state.log_history[-1]["train_loss"] == pytest.approx(0.0)
    assert not changed(trainer, before)


@trainers()
def test_mask_truncated_completions_trains_on_the_finished_ones(trainer_cls, model_path, tmp_path):
    args = make_args(trainer_cls, tmp_path, mask_truncated_completions=True)
    trainer = trainer_cls(
        model=model_path, reward_funcs=length_reward, args=args, train_dataset=conversational_dataset()
    )
    replies = ["Yes.<|im_end|>", "one two three four five six seven eight nine ten", "No, not that.<|im_end|>",
               "Twelve<|im_end|>"]
    before = trainable_snapshot(trainer)
    with scripted(trainer, lambda prefix, row: replies[row % len(replies)]):
        trainer.train()
    assert changed(trainer, before) == set(before)
