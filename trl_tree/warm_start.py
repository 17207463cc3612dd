"""The warm start: a short supervised fine-tuning on scripted tool-use conversations, and its on-disk cache.

A model that never closes a tool call gives RL with tools nothing but noise to score, so the offline example, the
benchmarks and the tests teach the format first. The scripts cache the result by everything that determines it
(`cached_warm_start`): a rerun of `accelerate launch examples/train_hotpot.py` loads it instead of paying again.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from functools import partial
from pathlib import Path

import torch
from transformers import PreTrainedTokenizerFast
from trl.chat_template_utils import get_training_chat_template

from trl_tree.model_cache import cache_root, save_model_atomically


def assistant_token_mask(
    tokenizer: PreTrainedTokenizerFast,
    conversation: list[dict],
    tools: list[Callable | dict] | None = None,
    chat_template: str | None = None,
) -> tuple[list[int], list[int]]:
    """
    Token ids of a conversation and a mask that is 1 exactly on the tokens the model generates.

    An assistant turn's tokens are those between the prompt rendered with `add_generation_prompt=True` and the turn's
    closing `<|im_end|>` inclusive: the same split GRPOTrainer makes between prompt and completion, so warm-start
    targets are what the model will later be asked to sample. That holds only if each turn renders the same alone
    (as a completion) as in the whole conversation, i.e. if the template is prefix-preserving, which is checked.
    """
    render = partial(
        tokenizer.apply_chat_template, tools=tools, chat_template=chat_template, tokenize=True, return_dict=False
    )
    input_ids = list(render(conversation))
    mask = [0] * len(input_ids)
    for index, message in enumerate(conversation):
        if message["role"] != "assistant":
            continue
        prompt_ids = list(render(conversation[:index], add_generation_prompt=True))
        turn_ids = list(render(conversation[: index + 1]))
        start = len(prompt_ids)
        end = turn_ids.index(tokenizer.eos_token_id, start) + 1
        if turn_ids[:start] != prompt_ids or input_ids[:end] != turn_ids[:end]:
            raise ValueError(
                f"assistant message {index} renders differently as a completion than inside the conversation: the "
                "template is not prefix-preserving; pass a training template such as "
                "`get_training_chat_template(tokenizer)`"
            )
        mask[start:end] = [1] * (end - start)
    return input_ids, mask


def _collate(examples: list[tuple[list[int], list[int]]], pad_id: int) -> dict[str, torch.Tensor]:
    """Right-pad a batch; labels are -100 outside assistant tokens so the loss only teaches what the model says."""
    length = max(len(ids) for ids, _ in examples)
    input_ids = torch.full((len(examples), length), pad_id)
    attention_mask = torch.zeros((len(examples), length), dtype=torch.long)
    labels = torch.full((len(examples), length), -100)
    for row, (ids, mask) in enumerate(examples):
        ids_t, mask_t = torch.tensor(ids), torch.tensor(mask, dtype=torch.bool)
        input_ids[row, : len(ids)] = ids_t
        attention_mask[row, : len(ids)] = 1
        labels[row, : len(ids)] = torch.where(mask_t, ids_t, -100)
    return {"input_ids": input_ids, "attention_mask": attention_mask, "labels": labels}


def _assistant_loss(model: torch.nn.Module, batch: dict[str, torch.Tensor]) -> torch.Tensor:
    """
    Mean next-token cross-entropy over assistant tokens, with logits computed only where some row has a target.

    Most of each sequence is the system prompt with the tool schema, and the vocabulary projection and its softmax are
    the bulk of the cost at this size: skipping untrained positions with `logits_to_keep` cuts a step by a third.
    """
    targets = batch["labels"][:, 1:]
    positions = (targets != -100).any(dim=0).nonzero().squeeze(-1)  # logits at t predict the token at t + 1
    logits = model(
        input_ids=batch["input_ids"], attention_mask=batch["attention_mask"], logits_to_keep=positions
    ).logits
    return torch.nn.functional.cross_entropy(logits.flatten(0, 1).float(), targets[:, positions].flatten())


def _shuffled_batches(num_examples: int, batch_size: int, generator: torch.Generator) -> Iterator[list[int]]:
    """Endless minibatches of example indices drawn epoch by epoch, so every conversation is seen equally often."""
    pending: list[int] = []
    while True:
        while len(pending) < batch_size:
            pending += torch.randperm(num_examples, generator=generator).tolist()
        yield pending[:batch_size]
        pending = pending[batch_size:]


@contextmanager
def _torch_threads(num_threads: int) -> Iterator[None]:
    """
    Temporarily set torch's intra-op thread count.

    The tiny model's matrices are too small to split across cores, and when the cores are shared (two-process runs,
    parallel test sessions) OpenMP threads spin waiting for each other (benchmarks/README.md, section 5).
    """
    previous = torch.get_num_threads()
    torch.set_num_threads(num_threads)
    try:
        yield
    finally:
        torch.set_num_threads(previous)


def warm_start(
    model: torch.nn.Module,
    tokenizer: PreTrainedTokenizerFast,
    conversations: list[list[dict]],
    tools: list[Callable | dict] | None = None,
    steps: int = 100,
    lr: float = 3e-3,
    batch_size: int = 8,
    seed: int = 0,
    progress: bool = False,
) -> list[float]:
    """
    Supervised fine-tuning on the assistant turns of `conversations`, in place; returns the loss of every step.

    A random model never closes a tool call, so GRPO with tools would only ever score noise. A few seconds of SFT
    teaches the format. Conversations are rendered with the training template TRL itself will use (from
    `get_training_chat_template`; `None`, i.e. the tokenizer's own, if that is already training-ready) and with
    `tools=`, so the system prompt holds the tool schema exactly as GRPOTrainer renders it and the warm-started
    behaviour transfers to RL. `progress` shows a progress bar (with the running loss) on stderr.
    """
    if not conversations:
        raise ValueError("warm_start needs at least one conversation")
    template = get_training_chat_template(tokenizer)
    examples = [assistant_token_mask(tokenizer, conversation, tools, template) for conversation in conversations]
    parameters = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(parameters, lr=lr, weight_decay=0.0)
    generator = torch.Generator().manual_seed(seed)
    was_training = model.training
    model.train()
    losses = []
    bar = _progress_bar(steps) if progress else None
    with _torch_threads(1):
        for _, indices in zip(range(steps), _shuffled_batches(len(examples), batch_size, generator)):
            batch = _collate([examples[i] for i in indices], tokenizer.pad_token_id)
            loss = _assistant_loss(model, {name: tensor.to(model.device) for name, tensor in batch.items()})
            loss.backward()
            torch.nn.utils.clip_grad_norm_(parameters, 1.0)
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            losses.append(loss.item())
            if bar is not None:
                bar.set_postfix(loss=f"{losses[-1]:.3f}", refresh=False)
                bar.update()
    if bar is not None:
        bar.close()
    model.train(was_training)
    return losses



def _progress_bar(steps: int):
    from tqdm.auto import tqdm

    return tqdm(total=steps, desc="warm start", unit="step", dynamic_ncols=True)


# ---------------------------------------------------------------------------------------------------------------------
# The cache
# ---------------------------------------------------------------------------------------------------------------------

# Bump when the same inputs start to give other weights (a change to `warm_start`'s loss, batching or optimizer).
WARM_START_CACHE_VERSION = 1
LOSSES_FILE = "warm_start_losses.json"


@dataclass
class WarmStart:
    """What `cached_warm_start` did: the folder holding the warm-started model, every step's loss, and whether the
    folder came from the cache (then nothing was trained in this process)."""

    path: str
    losses: list[float]
    cached: bool


def model_fingerprint(name_or_path: str, revision: str | None = None) -> list:
    """What identifies a base model for the cache: a local folder by its files' names, sizes and modification times
    (so a model saved again at the same path is not mistaken for the old one), a Hub id by id and revision."""
    folder = Path(name_or_path)
    if not folder.is_dir():
        return [name_or_path, revision]
    files = sorted(p for p in folder.iterdir() if p.is_file() and not p.name.startswith("."))
    return [str(folder.resolve()), [[p.name, p.stat().st_size, p.stat().st_mtime_ns] for p in files]]


def _tool_schemas(tools: list[Callable | dict] | None) -> list[dict]:
    from transformers.utils import get_json_schema

    return [tool if isinstance(tool, dict) else get_json_schema(tool) for tool in tools or []]


def warm_start_key(base: list, conversations: list[list[dict]], tools, steps: int, lr: float, batch_size: int,
                   seed: int, dtype: str) -> str:
    """A short hash of everything that determines a warm start's weights: the cache folder's name."""
    parts = [WARM_START_CACHE_VERSION, base, conversations, _tool_schemas(tools), steps, lr, batch_size, seed, dtype]
    return hashlib.sha256(json.dumps(parts, sort_keys=True, default=str).encode()).hexdigest()[:12]


def cached_warm_start(
    model: torch.nn.Module,
    tokenizer: PreTrainedTokenizerFast,
    conversations: list[list[dict]],
    *,
    base: list,
    tools: list[Callable | dict] | None = None,
    steps: int = 100,
    lr: float = 3e-3,
    batch_size: int = 8,
    seed: int = 0,
    save: bool = True,
    progress: bool = False,
    cache_dir: str | None = None,
) -> WarmStart:
    """
    `warm_start` on `model` in place, unless a folder of the cache already holds its result for these inputs
    (`warm_start_key`; `base` is `model_fingerprint` of the model's source): then the weights are loaded from there.
    On a miss, the result is written to the cache atomically with its losses if `save` (the main process). Every
    process of a distributed run may call this: each one that misses trains the same weights from the same seed,
    and exactly one copy lands in the cache.
    """
    dtype = str(next(model.parameters()).dtype)
    key = warm_start_key(base, conversations, tools, steps, lr, batch_size, seed, dtype)
    path = cache_root(cache_dir) / "warm_start" / f"{steps}steps-{key}"
    if (path / LOSSES_FILE).is_file():
        _load_weights(model, path)
        return WarmStart(str(path), json.loads((path / LOSSES_FILE).read_text()), cached=True)
    losses = warm_start(model, tokenizer, conversations, tools=tools, steps=steps, lr=lr, batch_size=batch_size,
                        seed=seed, progress=progress)
    if save:
        save_model_atomically(path, tokenizer, model, extra_files={LOSSES_FILE: json.dumps(losses)})
    return WarmStart(str(path), losses, cached=False)


def _load_weights(model: torch.nn.Module, path: Path) -> None:
    """Copy the weights saved at `path` into `model`, on its device and in its dtype. Loaded by `from_pretrained`
    (which knows each architecture's key names and tied weights) and copied over, so the caller keeps its object."""
    with torch.random.fork_rng(devices=[]):  # a hit must leave the caller's random state as a miss does
        saved = type(model).from_pretrained(path, dtype=next(model.parameters()).dtype)
    model.load_state_dict(saved.state_dict())
    del saved
