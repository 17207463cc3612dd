"""The offline fixtures behave like a real Qwen3 as far as TRL can tell, and the warm start teaches the tool format."""

import importlib.resources
import json
import threading

import pytest
import torch
from trl.chat_template_utils import (
    add_response_schema,
    get_training_chat_template,
    is_chat_template_prefix_preserving,
    parse_response,
)

from trl_tree import testing
from trl_tree.testing import (
    calculator,
    calculator_conversations,
    tiny_model_and_tokenizer,
    tiny_model_path,
    warm_start,
)


@pytest.fixture(scope="session")
def cache_dir(tmp_path_factory):
    """A fresh cache for this file's tests, so the first call builds and later calls load."""
    return str(tmp_path_factory.mktemp("trl_tree_cache"))


@pytest.fixture(autouse=True)
def _cache_env(cache_dir, monkeypatch):
    """TRL_TREE_CACHE (what scripts read) points at that cache during each test of this file and is restored after
    it: set for the whole session, it would send every later test file to an empty cache, so their speed and the
    warm starts they find would depend on the order the files run in. The session fixtures below are built before
    this one runs, so they name the folder themselves."""
    monkeypatch.setenv("TRL_TREE_CACHE", cache_dir)


@pytest.fixture(scope="session")
def tiny(cache_dir):
    return tiny_model_and_tokenizer(cache_dir)


@pytest.fixture(scope="session")
def tokenizer(tiny):
    return add_response_schema(tiny[1])


@pytest.fixture(scope="session")
def warm(cache_dir):
    """A tiny model warm-started on calculator conversations, with the loss curve it produced."""
    model, tokenizer = tiny_model_and_tokenizer(cache_dir)
    losses = warm_start(model, tokenizer, calculator_conversations(64), tools=[calculator])
    return model, add_response_schema(tokenizer), losses


def render_prompt(tokenizer, messages):
    """The prompt exactly as GRPOTrainer renders it with tools= (it swaps in the training template for Qwen3)."""
    return tokenizer.apply_chat_template(
        messages,
        tools=[calculator],
        chat_template=get_training_chat_template(tokenizer),
        add_generation_prompt=True,
        tokenize=True,
        return_dict=False,
    )


def until_eos(ids, tokenizer):
    """Cut a sampled row after its first `<|im_end|>`, as GRPOTrainer does, dropping the padding of finished rows."""
    eos = tokenizer.eos_token_id
    return ids[: ids.index(eos) + 1] if eos in ids else ids


def test_chat_template_is_trl_qwen3_byte_for_byte(tokenizer):
    trl_template = importlib.resources.files("trl").joinpath("chat_templates", "qwen3.jinja").read_bytes()
    assert tokenizer.chat_template.encode("utf-8") == trl_template


def test_tool_tags_are_single_non_special_tokens_that_survive_decoding(tokenizer):
    for tag in testing.TOOL_TOKENS:
        ids = tokenizer.encode(f"x{tag}y", add_special_tokens=False)
        assert tokenizer.convert_tokens_to_ids(tag) in ids and len(ids) == 3, tag
        assert tag not in tokenizer.all_special_tokens
        assert tokenizer.decode(ids, skip_special_tokens=True) == f"x{tag}y"


def test_special_tokens_are_qwen_style(tiny):
    model, tokenizer = tiny
    assert tokenizer.pad_token == "<|endoftext|>" and tokenizer.eos_token == "<|im_end|>"
    assert tokenizer.padding_side == "left"
    assert model.generation_config.eos_token_id == tokenizer.convert_tokens_to_ids("<|im_end|>")
    assert model.generation_config.pad_token_id == tokenizer.pad_token_id
    assert model.config.vocab_size == len(tokenizer)


def test_response_parser_reads_a_hand_written_tool_call(tokenizer):
    prompt_ids = render_prompt(tokenizer, [{"role": "user", "content": "What is 17 + 25?"}])
    completion = (
        '<think>\n\n</think>\n\n<tool_call>\n{"name": "calculator", "arguments": {"expression": "17 + 25"}}\n'
        "</tool_call><|im_end|>"
    )
    ids = tokenizer.encode(completion, add_special_tokens=False)
    parsed = parse_response(tokenizer, ids, prefix=prompt_ids, tools=[calculator])
    function = {"name": "calculator", "arguments": {"expression": "17 + 25"}}
    assert parsed["tool_calls"] == [{"type": "function", "function": function}]
    assert parsed["content"] == ""


def test_training_template_is_prefix_preserving_while_the_original_is_not(tiny):
    tokenizer = tiny_model_and_tokenizer()[1]  # a private copy: we overwrite its template
    assert not is_chat_template_prefix_preserving(tokenizer)  # why TRL swaps templates for multi-turn tool use
    tokenizer.chat_template = get_training_chat_template(tokenizer)
    assert is_chat_template_prefix_preserving(tokenizer)


def test_cache_round_trips_identical_weights_and_tokenizer(tiny, cache_dir):
    model, tokenizer = tiny
    again, tokenizer_again = tiny_model_and_tokenizer(cache_dir)
    assert tiny_model_path().startswith(cache_dir)  # the env var sets the default folder
    assert tokenizer_again.get_vocab() == tokenizer.get_vocab()
    for (name, weight), (_, weight_again) in zip(model.state_dict().items(), again.state_dict().items()):
        assert torch.equal(weight, weight_again), name


def test_build_is_deterministic_given_seed(tiny, tmp_path):
    reference = tiny[0].state_dict()
    rebuilt, _ = tiny_model_and_tokenizer(str(tmp_path))
    assert all(torch.equal(reference[name], weight) for name, weight in rebuilt.state_dict().items())
    other_seed, _ = tiny_model_and_tokenizer(str(tmp_path), seed=1)
    assert not torch.equal(other_seed.lm_head.weight, reference["lm_head.weight"])


def test_concurrent_builders_agree_on_one_folder(tmp_path):
    barrier = threading.Barrier(2)
    paths = []

    def build():
        barrier.wait()
        paths.append(tiny_model_path(str(tmp_path)))

    threads = [threading.Thread(target=build) for _ in range(2)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert len(paths) == 2 and paths[0] == paths[1]
    assert [p.name for p in tmp_path.iterdir()] == [f"{testing.CACHE_VERSION}-seed0"]  # no staging folder left over
    tiny_model_and_tokenizer(str(tmp_path))  # and what is there loads


def test_assistant_mask_covers_each_turn_through_its_im_end(tokenizer):
    conversation = calculator_conversations(1)[0]
    template = get_training_chat_template(tokenizer)
    ids, mask = testing.assistant_token_mask(tokenizer, conversation, [calculator], template)
    masked = tokenizer.decode([i for i, m in zip(ids, mask) if m])
    expression = conversation[1]["tool_calls"][0]["function"]["arguments"]["expression"]
    call = json.dumps({"name": "calculator", "arguments": {"expression": expression}})
    answer = conversation[-1]["content"]
    empty_think = "<think>\n\n</think>\n\n"
    assert masked == f"{empty_think}<tool_call>\n{call}\n</tool_call><|im_end|>{empty_think}{answer}<|im_end|>"


def test_assistant_mask_rejects_a_template_that_is_not_prefix_preserving(tokenizer):
    with pytest.raises(ValueError, match="prefix-preserving"):
        testing.assistant_token_mask(tokenizer, calculator_conversations(1)[0], [calculator])  # original qwen3.jinja


def test_warm_start_lowers_the_loss(warm):
    losses = warm[2]
    assert len(losses) == 100
    assert sum(losses[-10:]) / 10 < 0.25 * sum(losses[:10]) / 10


def test_warm_start_restores_training_mode_and_thread_count(cache_dir):
    model, tokenizer = tiny_model_and_tokenizer()
    model.eval()
    threads = torch.get_num_threads()
    losses = warm_start(model, tokenizer, calculator_conversations(2), tools=[calculator], steps=2, batch_size=4)
    assert len(losses) == 2  # batches larger than the data set wrap around epochs
    assert not model.training and torch.get_num_threads() == threads


def test_warm_model_samples_parseable_tool_calls(warm):
    model, tokenizer, _ = warm
    prompt = calculator_conversations(1, seed=123)[0][:1]
    prompt_ids = render_prompt(tokenizer, prompt)
    with torch.random.fork_rng():
        torch.manual_seed(0)
        output = model.generate(torch.tensor([prompt_ids]), do_sample=True, max_new_tokens=48, num_return_sequences=8)
    parsed = [
        parse_response(
            tokenizer, until_eos(sample[len(prompt_ids) :].tolist(), tokenizer), prefix=prompt_ids, tools=[calculator]
        )
        for sample in output
    ]
    calls = [message["tool_calls"][0]["function"] for message in parsed if message.get("tool_calls")]
    assert calls, parsed
    assert all(call["name"] == "calculator" for call in calls)


def test_calculator_evaluates_integer_arithmetic():
    assert calculator("17 + 25") == "42"
    assert calculator("(2 + 3) * -4") == "-20"
    assert calculator("84 / 2") == "42"
    assert calculator("7 / 2") == "3.5"


@pytest.mark.parametrize(
    "expression", ["__import__('os').system('true')", "2 ** 10", "1.5 + 1", "True + 1", "x + 1", "", "1 +", "3 / 0"]
)
def test_calculator_rejects_anything_but_integer_arithmetic(expression):
    with pytest.raises(ValueError):
        calculator(expression)


def test_calculator_conversations_answer_with_the_tool_result():
    for user, call, tool, answer in calculator_conversations(20, seed=3):
        expression = call["tool_calls"][0]["function"]["arguments"]["expression"]
        assert expression in user["content"]
        assert tool["content"] == answer["content"] == calculator(expression)
        assert float(answer["content"]).is_integer()
