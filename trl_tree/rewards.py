"""Rule-based rewards for question answering agents (HotpotQA / Search-R1 style).

Every reward function has TRL's signature ``f(prompts, completions, **kwargs) -> list[float]``: ``completions`` are
either plain strings or conversations (lists of messages: assistant turns that may carry ``tool_calls``, tool
observations, and a final assistant turn), and dataset columns arrive as keyword lists. The gold column is
``answer``: a string or a list of acceptable strings per example; scores take the max over the golds.

Answers are compared after SQuAD normalisation, the convention of HotpotQA, Search-R1 and the TreeOPSD paper
(Appendix E.1.1: training uses token F1 thresholded at 0.3, evaluation reports exact match).
"""

from __future__ import annotations

import functools
import inspect
import math
import numbers
import re
import string
import warnings
from collections import Counter
from collections.abc import Callable, Sequence
from typing import Any

from .text import ANSWER_SPAN, shorten

DEFAULT_F1_THRESHOLD = 0.3

_ARTICLES = re.compile(r"\b(a|an|the)\b")
_PUNCTUATION = set(string.punctuation)
# HotpotQA's official F1 refuses partial credit between a yes/no answer and anything else: "no" must not earn half a
# point against "no way", nor "yes" against "yes and no".
_CLOSED_ANSWERS = {"yes", "no", "noanswer"}

Completion = str | list[dict[str, Any]]
Gold = str | Sequence[str]


# ---------------------------------------------------------------------------------------------------------------
# Answer comparison (SQuAD / HotpotQA)
# ---------------------------------------------------------------------------------------------------------------


def normalize_answer(text: str) -> str:
    """SQuAD normalisation: lowercase, drop punctuation and the articles a/an/the, collapse whitespace.

    Used so that "The Beatles." and "beatles" count as the same answer, as in the official HotpotQA evaluation.
    """
    text = "".join(ch for ch in text.lower() if ch not in _PUNCTUATION)
    text = _ARTICLES.sub(" ", text)
    return " ".join(text.split())


def _golds(gold: Gold) -> list[str]:
    """The acceptable answers as a list (a single string is one answer)."""
    return [gold] if isinstance(gold, str) else list(gold)


def exact_match_score(prediction: str | None, gold: Gold) -> float:
    """1.0 when the normalised prediction equals a normalised gold answer, else 0.0 (max over golds)."""
    if prediction is None:
        return 0.0
    normalized = normalize_answer(prediction)
    return float(any(normalized == normalize_answer(g) for g in _golds(gold)))


def _token_f1(prediction: str, gold: str) -> float:
    """Token-overlap F1 between two answers after normalisation, with HotpotQA's yes/no rule."""
    pred, ref = normalize_answer(prediction), normalize_answer(gold)
    if (pred in _CLOSED_ANSWERS or ref in _CLOSED_ANSWERS) and pred != ref:
        return 0.0
    pred_tokens, ref_tokens = pred.split(), ref.split()
    overlap = sum((Counter(pred_tokens) & Counter(ref_tokens)).values())
    if overlap == 0:
        return 0.0
    precision, recall = overlap / len(pred_tokens), overlap / len(ref_tokens)
    return 2 * precision * recall / (precision + recall)


def f1_score(prediction: str | None, gold: Gold) -> float:
    """Token F1 (SQuAD/HotpotQA) between the prediction and the best-matching gold answer; 0.0 for no prediction."""
    if prediction is None:
        return 0.0
    return max((_token_f1(prediction, g) for g in _golds(gold)), default=0.0)


# ---------------------------------------------------------------------------------------------------------------
# Reading completions
# ---------------------------------------------------------------------------------------------------------------


def _text_of(message: dict[str, Any]) -> str:
    """A message's text content; multimodal content (a list of parts) contributes its text parts."""
    content = message.get("content") or ""
    if isinstance(content, str):
        return content
    return "".join(part.get("text", "") for part in content if isinstance(part, dict))


def _final_assistant_message(completion: Completion) -> dict[str, Any] | None:
    """The last assistant message of a conversation; a plain string completion is one assistant message."""
    if isinstance(completion, str):
        return {"role": "assistant", "content": completion}
    for message in reversed(completion):
        if message.get("role") == "assistant":
            return message
    return None


def extract_answer(completion: Completion) -> str | None:
    """The stripped text of the last ``<answer>...</answer>`` span in the final assistant message, or None.

    Only the final message counts: an answer written in an earlier turn, before the agent went on searching, is not
    the agent's answer. The last span wins so that a model quoting the format while reasoning is still scored on
    what it concluded.
    """
    message = _final_assistant_message(completion)
    if message is None:
        return None
    spans = ANSWER_SPAN.findall(_text_of(message))
    return spans[-1].strip() if spans else None


def _tool_call_is_parsed(tool_call: Any) -> bool:
    """A tool call that the chat-template parser turned into ``{"type": "function", "function": {name, arguments}}``."""
    if not isinstance(tool_call, dict) or tool_call.get("type", "function") != "function":
        return False
    function = tool_call.get("function")
    return (
        isinstance(function, dict)
        and isinstance(function.get("name"), str)
        and bool(function["name"])
        and isinstance(function.get("arguments"), dict)
    )


def _all_tool_calls_parsed(conversation: list[dict[str, Any]]) -> bool:
    """No assistant turn holds a malformed tool call.

    TRL falls back to plain text when a response does not parse, so a raw ``<tool_call>`` left in an assistant's
    content is the mark of a call that never ran.
    """
    for message in conversation:
        if message.get("role") != "assistant":
            continue
        if "<tool_call>" in _text_of(message):
            return False
        if not all(_tool_call_is_parsed(call) for call in message.get("tool_calls") or []):
            return False
    return True


def _has_one_answer_span(message: dict[str, Any]) -> bool:
    """Exactly one opening and one closing answer tag, in that order, around a non-empty answer."""
    text = _text_of(message)
    if text.count("<answer>") != 1 or text.count("</answer>") != 1:
        return False
    span = ANSWER_SPAN.search(text)
    return span is not None and bool(span.group(1).strip())


def is_well_formed(completion: Completion) -> bool:
    """Whether the completion ends in one answer span, with every tool call parsed and none left pending."""
    message = _final_assistant_message(completion)
    if message is None or message.get("tool_calls") or not _has_one_answer_span(message):
        return False
    return isinstance(completion, str) or _all_tool_calls_parsed(completion)


# ---------------------------------------------------------------------------------------------------------------
# Reward functions (TRL signature)
# ---------------------------------------------------------------------------------------------------------------


def _gold_column(kwargs: dict[str, Any], num_completions: int) -> list[Gold]:
    """The ``answer`` column, checked to line up with the completions."""
    if "answer" not in kwargs:
        raise ValueError(
            "This reward needs the gold answers in a dataset column named `answer`; "
            f"got columns {sorted(k for k in kwargs if not k.startswith('trainer'))}."
        )
    answers = list(kwargs["answer"])
    if len(answers) != num_completions:
        raise ValueError(f"Got {num_completions} completions but {len(answers)} gold answers.")
    return answers


def exact_match_reward(prompts: list, completions: list[Completion], **kwargs) -> list[float]:
    """Exact match (after SQuAD normalisation) of the extracted ``<answer>`` against the ``answer`` column."""
    answers = _gold_column(kwargs, len(completions))
    return [exact_match_score(extract_answer(c), gold) for c, gold in zip(completions, answers)]


def thresholded_f1_reward(threshold: float = DEFAULT_F1_THRESHOLD) -> Callable[..., list[float]]:
    """Build a reward that pays the answer's token F1 when it reaches ``threshold``, and 0 below it.

    The threshold (0.3 in the TreeOPSD paper, Appendix E.1.1) keeps the reward from paying for answers that share
    only a stray token with the gold, which a policy would otherwise learn to farm by answering with long lists.
    """

    def f1_reward(prompts: list, completions: list[Completion], **kwargs) -> list[float]:
        answers = _gold_column(kwargs, len(completions))
        scores = [f1_score(extract_answer(c), gold) for c, gold in zip(completions, answers)]
        return [score if score >= threshold else 0.0 for score in scores]

    f1_reward.__doc__ = f"Token F1 of the extracted ``<answer>`` against ``answer`` when at least {threshold}, else 0."
    # TRL logs each reward under its function's name; distinct thresholds must not collide in the logs.
    if threshold != DEFAULT_F1_THRESHOLD:
        f1_reward.__name__ = f1_reward.__qualname__ = f"f1_reward_t{threshold:g}"
    return f1_reward


f1_reward = thresholded_f1_reward(DEFAULT_F1_THRESHOLD)


def format_reward(prompts: list, completions: list[Completion], **kwargs) -> list[float]:
    """1.0 when the final assistant message has exactly one non-empty ``<answer>`` span and every tool call parsed.

    A final message that still requests a tool call is not an answer and scores 0.
    """
    return [float(is_well_formed(c)) for c in completions]


# ---------------------------------------------------------------------------------------------------------------
# Completion formats: what a reward function reads, and what the dataset's prompts make TRL hand it
# ---------------------------------------------------------------------------------------------------------------

# `list[list[dict[str, str]]]`, `typing.List[typing.List[typing.Dict]]`, `Sequence[Sequence[Mapping]]`, as written
_MESSAGE_LISTS = re.compile(r"^(?:list|sequence)\[(?:list|sequence)\[(?:dict|mapping)\b")

CONVERT_TO_CONVERSATIONAL = (
    "Give each row's prompt as chat messages (TRL's conversational format), "
    '{"prompt": [{"role": "user", "content": "..."}]}, e.g. '
    'dataset.map(lambda row: {"prompt": [{"role": "user", "content": row["prompt"]}]}) with `datasets`'
)


def reads_chat_messages(func) -> bool:
    """Whether a reward function declares that it reads each completion as chat messages: its `completions` parameter
    is annotated as a list of message lists (`list[list[dict[str, str]]]`), as TRL's `accuracy_reward`,
    `reasoning_accuracy_reward`, `think_format_reward` and cosine-scaled reward are (they read
    `completion[0]["content"]`). An unannotated function says nothing, so it is not judged (False)."""
    try:
        signature = inspect.signature(func, eval_str=True)
    except (NameError, TypeError, ValueError, SyntaxError):  # an annotation that names what it did not import
        try:
            signature = inspect.signature(func)
        except (TypeError, ValueError):
            return False
    parameter = signature.parameters.get("completions")
    if parameter is None or parameter.annotation is inspect.Parameter.empty:
        return False
    annotation = parameter.annotation if isinstance(parameter.annotation, str) else repr(parameter.annotation)
    return bool(_MESSAGE_LISTS.match(re.sub(r"\s|typing\.|collections\.abc\.", "", annotation).lower()))


def completion_format_problem(reward_funcs: Sequence, names: Sequence[str], conversational: bool) -> str | None:
    """What is wrong when a reward function reads chat messages but the dataset's prompts are plain strings, else None.

    For a prompt that is a plain string (TRL's standard format) GRPOTrainer hands reward functions each completion as
    a plain string, and so do the tree trainers; a function that reads `completion[0]["content"]` then fails on the
    first batch (under GRPOTrainer too, with "string indices must be integers"), after the model has loaded and
    generated. Checked when the trainer is built and, for a local data file, by `trl-tree` before launching."""
    if conversational:
        return None
    readers = [name for func, name in zip(reward_funcs, names) if callable(func) and reads_chat_messages(func)]
    if not readers:
        return None
    which = ", ".join(repr(n) for n in readers)
    return (
        f"The reward function{'s' if len(readers) > 1 else ''} {which} read{'' if len(readers) > 1 else 's'} each "
        "completion as chat messages (completion[0]['content']: its `completions` parameter is annotated "
        "list[list[dict]]), but the dataset's prompts are plain strings (TRL's standard format), for which TRL hands "
        "reward functions each completion as a plain string, as GRPOTrainer does. "
        f"{CONVERT_TO_CONVERSATIONAL}; or use reward functions that take plain-string completions."
    )


def dataset_is_conversational(dataset) -> bool | None:
    """Whether the first row's `prompt` is chat messages (TRL's `is_conversational`, as GRPOTrainer decides it per
    batch), False for a plain string; None where it cannot be told cheaply: no dataset, no `prompt` column (an
    environment's reset supplies the prompt), or a streaming dataset (reading a row would fetch it)."""
    from datasets import Dataset
    from trl.data_utils import is_conversational

    if not isinstance(dataset, Dataset) or len(dataset) == 0 or "prompt" not in dataset.column_names:
        return None
    return is_conversational({"prompt": dataset[0]["prompt"]})


# ---------------------------------------------------------------------------------------------------------------
# Guarding the trainer's reward functions
# ---------------------------------------------------------------------------------------------------------------


def guard_reward_func(func, name: str):
    """Wrap a reward function, synchronous or async, so that an exception, an infinite reward or an output of the
    wrong kind names the function; both kinds follow one rule.

    `None` means "does not apply to this sample" (TRL's rule), and so does NaN: GRPOTrainer stores None as NaN and its
    nansum / nanmean skip both, so a NaN cannot mean anything else there, and a reward function written for it must
    work here. A NaN becomes None, with a warning the first time for each function, since a NaN is more often a bug
    than a choice. A leaf that no function scores is then handled as GRPO handles such a completion (see
    `trainer.scoring._rewards_for_credit`). ±inf is an error: GRPO gives it no meaning (its group's advantages become
    inf or NaN), and a tree would back it up into every ancestor. A 1-D tensor or array of rewards is read as
    GRPOTrainer reads it; strings, nested values or a wrong count are errors that say what to return. A model-based
    reward (an `nn.Module`) is left as it is. An async function stays async (TRL awaits it on its event loop).
    """
    import torch
    from trl.trainer.utils import is_async_callable

    if isinstance(func, torch.nn.Module) or getattr(func, "_trl_tree_guarded", False):
        return func
    warned_nan: list[bool] = []  # a function that returns NaN does so every batch: say it once

    def checked(out, completions):
        return _finite_rewards(name, _checked_rewards(name, out, completions or []), completions, warned_nan)

    if is_async_callable(func):

        @functools.wraps(func)
        async def guarded(*args, prompts=None, completions=None, **kwargs):
            try:
                out = await func(*args, prompts=prompts, completions=completions, **kwargs)
            except Exception as e:
                j = await _first_failing_sample_async(func, prompts, completions, kwargs)
                raise _raised(name, e, j, completions) from e
            return checked(out, completions)

    else:

        @functools.wraps(func)
        def guarded(*args, prompts=None, completions=None, **kwargs):
            try:
                out = func(*args, prompts=prompts, completions=completions, **kwargs)
            except Exception as e:
                raise _raised(name, e, _first_failing_sample(func, prompts, completions, kwargs), completions) from e
            return checked(out, completions)

    guarded._trl_tree_guarded = True
    guarded.__signature__ = inspect.signature(func) if callable(func) else None
    return guarded


_RETURN_ADVICE = (
    "return a list with one reward per completion: a number (a float, int, bool or one-element tensor), or None "
    "where the function does not apply"
)


def _checked_rewards(name: str, out, completions: list) -> list[float | None]:
    """A reward function's output as GRPOTrainer reads it (a list, or a tensor / array it iterates, with None for
    "not applicable"), as a list of floats and Nones; anything else is an error that names the function."""
    if out is None or isinstance(out, (str, bytes, dict)) or not hasattr(out, "__len__"):
        raise TypeError(f"Reward function '{name}' returned {_quote(repr(out))} ({type(out).__name__}); {_RETURN_ADVICE}.")
    if _is_tensor(out) and out.dim() != 1:
        raise ValueError(
            f"Reward function '{name}' returned a tensor of shape {tuple(out.shape)}; {_RETURN_ADVICE} (a 1-D tensor of "
            f"{len(completions)} rewards works too)."
        )
    values = list(out)
    if len(values) != len(completions):
        raise ValueError(
            f"Reward function '{name}' returned {len(values)} rewards for {len(completions)} completions; "
            f"{_RETURN_ADVICE}."
        )
    checked = []
    for j, r in enumerate(values):
        if _is_tensor(r) and r.numel() == 1:
            r = r.item()
        if r is not None and not isinstance(r, numbers.Real):
            raise TypeError(
                f"Reward function '{name}' returned {_quote(repr(r))} ({type(r).__name__}) for sample {j} "
                f"(completion: {_quote(completions[j])}); {_RETURN_ADVICE}."
            )
        checked.append(None if r is None else float(r))
    return checked


def _raised(name: str, error: Exception, j: int | None, completions) -> RuntimeError:
    """The error for a reward function that raised, naming the first sample that fails alone (when one does)."""
    where = f"sample {j}" if j is not None else f"a batch of {len(completions or [])} samples"
    return RuntimeError(
        f"Reward function '{name}' raised {type(error).__name__}: {error} on {where}"
        + (f" (completion: {_quote(completions[j])})" if j is not None else "")
        + (_text_completion_hint() if _indexed_a_string(error, completions) else
           ". Fix the function, or return None for samples it cannot score.")
    )


def _indexed_a_string(error: Exception, completions) -> bool:
    """The error looks like a function reading chat messages out of a plain-string completion."""
    return isinstance(error, (TypeError, KeyError, IndexError)) and bool(completions) and isinstance(completions[0], str)


def _text_completion_hint() -> str:
    return (
        ". The completions are plain strings because the dataset's prompts are (TRL's standard format: GRPOTrainer "
        "hands reward functions the completion text); a function that reads chat messages (completion[0]['content'])"
        f" needs conversational prompts. {CONVERT_TO_CONVERSATIONAL}; or make the function take strings."
    )


def _finite_rewards(name: str, rewards: list[float | None], completions, warned_nan: list[bool]) -> list:
    """NaN read as None (with a warning the first time), ±inf an error: see `guard_reward_func`."""
    infinite = [j for j, r in enumerate(rewards) if r is not None and math.isinf(r)]
    if infinite:
        j = infinite[0]
        raise ValueError(
            f"Reward function '{name}' returned {rewards[j]} for sample {j} (completion: {_quote(completions[j])}). "
            "Rewards must be finite; return None where the function does not apply."
        )
    nan = [j for j, r in enumerate(rewards) if r is not None and math.isnan(r)]
    if nan and not warned_nan:
        warned_nan.append(True)
        j = nan[0]
        warnings.warn(
            f"Reward function '{name}' returned nan for sample {j} (completion: {_quote(completions[j])})"
            + (f" and {len(nan) - 1} more of this batch" if len(nan) > 1 else "")
            + ". It is read as None, 'does not apply to this sample', as GRPOTrainer reads it: the other reward "
            "functions decide, and a leaf none of them scores gets advantage 0. Return None to say so (this warning "
            "is given once per function), or fix the function if the NaN is a bug.",
            UserWarning,
            stacklevel=2,
        )
    return [None if r is None or math.isnan(r) else r for r in rewards]


def _one_sample(kwargs: dict, j: int, n: int) -> dict:
    """Sample `j`'s share of the reward kwargs: per-sample columns (lists of length n) cut to it, the rest as is."""
    return {k: ([v[j]] if isinstance(v, list) and len(v) == n else v) for k, v in kwargs.items()}


def _first_failing_sample(func, prompts, completions, kwargs) -> int | None:
    n = len(completions or [])
    for j in range(n):
        try:
            func(prompts=[prompts[j]], completions=[completions[j]], **_one_sample(kwargs, j, n))
        except Exception:
            return j
    return None


async def _first_failing_sample_async(func, prompts, completions, kwargs) -> int | None:
    n = len(completions or [])
    for j in range(n):
        try:
            await func(prompts=[prompts[j]], completions=[completions[j]], **_one_sample(kwargs, j, n))
        except Exception:
            return j
    return None


def _quote(value) -> str:
    """A sample's completion or a reward's value as quoted in reward-function errors."""
    return shorten(value, 160)


def _is_tensor(value) -> bool:
    import torch

    return isinstance(value, torch.Tensor)
