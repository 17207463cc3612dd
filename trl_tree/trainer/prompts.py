"""Prompt rendering of the tree trainers: dataset rows to prompt token ids, as GRPOTrainer's (docs/design.md §2).

A collaborator of `TreeTrainer` (`PromptRenderer`, built with what it reads). GRPOTrainer renders prompts inside the generation step the tree trainers replace, so they
redo its part here: read each row's `prompt`, tokenize it with TRL's chat template and tool schemas (through
`trl_internals`), and check it against the model's positions, which TRL 1.16 does not (its GRPOConfig has no
max_prompt_length). A plain-text prompt is remembered for the response parser (`parse_action`), which would read it
as the start of the assistant's message otherwise. Its own file so that the trainer module is the adapter from
GRPOTrainer to the pipeline only.

Every row's prompt is checked when the trainer is built, before GRPOTrainer reads any (`check_dataset_prompts`): its
shape (None, an empty string or list, a message without its role or content, a non-message; `prompt_problem`), and,
once the tokenizer is there, its length against the model's positions (`check_dataset_prompt_lengths`); each error
names the row and the fix. Each batch's prompts are checked again, for streaming datasets and `generate_batch`.
"""

from __future__ import annotations

import json
import logging

from datasets import Dataset
from trl.chat_template_utils import parse_response
from trl.data_utils import is_conversational

from ..core.packing import unwrap_model

logger = logging.getLogger(__name__)


class PromptRenderer:
    """Prompts read, rendered and checked; held by `TreeTrainer` as `prompts`.

    `tokenize` is TRL's `_tokenize_prompts` (prompts → (ids, ..., ...)), `tokenizer` the processing class's tokenizer,
    `tools` the trainer's tools, `model` the policy (its config's positions are read at each check), `owner` the
    trainer's class name (for errors), `owns_prompts` whether an environment's reset may supply the prompt."""

    def __init__(self, *, tokenize, tokenizer, tools, model, max_completion_length: int,
                 owner: str, owns_prompts: bool):
        self._tokenize = tokenize
        self._chat_tokenizer = tokenizer
        self.tools = tools
        self._model = model
        self._budget = max_completion_length
        self._owner = owner
        self._owns_prompts = owns_prompts
        self._text_prompt_ids: list = []
        self._warned_prompt_room = False

    def dataset_prompts(self, inputs: list[dict]) -> list:
        """Each row's `prompt` (a string or chat messages). As in GRPOTrainer, it may be missing only when an
        environment owns the data (its `reset()` supplies the prompt); otherwise a dataset without it is an error,
        not a batch of empty prompts."""
        if not self._owns_prompts and any("prompt" not in x for x in inputs):
            raise KeyError(
                f"{self._owner}: the dataset has no 'prompt' column (an example has the keys "
                f"{sorted(next(x for x in inputs if 'prompt' not in x))}). As GRPOTrainer does, the tree trainers read "
                "each example's prompt from 'prompt' (a string, or a list of chat messages): rename the column, or "
                "pass environment_factory= when an environment's reset() provides the prompt."
            )
        prompts = [x.get("prompt", [{"role": "user", "content": ""}]) for x in inputs]
        # each batch too: a streaming dataset's rows, or those given to `generate_batch`, are not seen at start-up
        for i, prompt in enumerate(prompts):
            problem = prompt_problem(prompt, owns_prompts=self._owns_prompts, first=prompts[0])
            if problem is not None:
                raise ValueError(f"{self._owner}: row {i} of this batch {problem}")
        return prompts

    def render_prompts(self, prompts: list) -> list:
        """The prompts' token ids (TRL's `_tokenize_prompts`: chat template and tool schemas), checked against the
        model's positions; plain-text prompts are remembered for `parse_action`."""
        prompt_ids, _, _ = self._tokenize(prompts)
        self._check_prompt_lengths(prompt_ids)
        # a plain-text prompt is no chat turn: the response parser must not read it as the assistant's message
        conversational = is_conversational({"prompt": prompts[0]})
        self._text_prompt_ids = [] if conversational else sorted((list(p) for p in prompt_ids), key=len, reverse=True)
        return prompt_ids

    def parse_action(self, ids: list[int], prefix: list[int]) -> dict:
        """One generated turn as an assistant message (TRL's response parser; tool calls parsed when there are
        tools), read after the prompt when the prompt is plain text."""
        if not self.tools:
            return {"role": "assistant", "content": self._chat_tokenizer.decode(ids, skip_special_tokens=True)}
        prefix = _after_text_prompt(prefix, self._text_prompt_ids)
        return parse_response(self._chat_tokenizer, ids, prefix=prefix, tools=self.tools)

    def _position_limit(self) -> int | None:
        return position_limit(self._model)

    def warn_if_budget_exceeds_positions(self):
        """A completion budget the model's positions cannot hold even after a one-token prompt: said once here, since
        GRPOTrainer does not refuse it either (transformers' generate runs on past the positions)."""
        limit, budget = self._position_limit(), self._budget
        if limit is not None and budget >= limit:
            logger.warning(
                f"max_completion_length ({budget}) is not below the model's max_position_embeddings ({limit}): no "
                "prompt leaves room for a full completion, and tokens past the model's positions are generated and "
                f"trained on positions it never learned. Lower max_completion_length below {limit} minus your longest "
                "prompt."
            )

    def check_dataset_prompt_lengths(self, dataset, name: str = "train_dataset") -> None:
        """Every prompt of the dataset checked against the model's positions when the trainer is built, so that a
        prompt too long to continue (a 20,000-character row deep in the data) fails now, naming its row, and not when
        its batch comes up hours into the run (`_check_prompt_lengths` still checks each batch: streaming datasets and
        environment prompts are known only then).

        The cost: rendering and tokenizing every row takes about 1.5 ms a row (10,000 chat prompts with a system
        prompt and a tool schema: 15 s on 2 busy CPU cores), so rows are first bounded without rendering: a prompt's
        token count is at most its messages' UTF-8 bytes (as JSON, whose keys add some 30 per message) plus what the
        chat template adds around empty messages with those roles (rendered once per sequence of roles), since no
        tokenizer makes more tokens than bytes. Only rows whose bound reaches the limit are tokenized: the 10,000 rows
        above take 0.4 s. Streaming datasets, environments (whose reset supplies the prompt and the tools) and
        multimodal content are left to the per-batch check."""
        limit = self._position_limit()
        if limit is None or self._owns_prompts or not isinstance(dataset, Dataset):
            return
        if "prompt" not in dataset.column_names:
            return
        prompts = dataset["prompt"]
        overheads: dict = {}
        suspects = [i for i, prompt in enumerate(prompts) if self._prompt_token_bound(prompt, overheads) >= limit]
        for start in range(0, len(suspects), 64):
            rows = suspects[start : start + 64]
            prompt_ids, _, _ = self._tokenize([prompts[i] for i in rows])
            for i, ids in zip(rows, prompt_ids):
                if len(ids) >= limit:
                    message = _too_long_message(f"{name} row {i}", len(ids), limit, self._budget)
                    raise ValueError(f"{message} Checked when the trainer is built, so that it does not stop the run "
                                     "when the row's batch comes up.")

    def _prompt_token_bound(self, prompt, overheads: dict) -> float:
        """An upper bound of the prompt's rendered tokens (`check_dataset_prompt_lengths`), inf where none is cheap."""
        if isinstance(prompt, str):
            key, size = (), len(prompt.encode("utf-8", "surrogatepass"))
        elif isinstance(prompt, list) and all(isinstance(m, dict) and isinstance(m.get("content", ""), str)
                                              for m in prompt):
            key = tuple(m.get("role") for m in prompt)
            size = sum(len(json.dumps(m, ensure_ascii=False, default=str).encode("utf-8", "surrogatepass"))
                       for m in prompt)
        else:  # multimodal content: rendered with its images only at its batch
            return float("inf")
        if key not in overheads:
            overheads[key] = self._template_overhead(key)
        return overheads[key] + size

    def _template_overhead(self, roles: tuple) -> float:
        """The tokens the chat template (and its tool schemas) adds around messages of these roles: their rendering
        with empty contents; a plain-text prompt's special tokens. inf when the template refuses empty messages."""
        empty = "" if not roles else [{"role": role, "content": ""} for role in roles]
        try:
            (ids,), _, _ = self._tokenize([empty])
        except Exception:  # noqa: BLE001 - a template that rejects these messages: tokenize such rows exactly
            return float("inf")
        return len(ids) + 8  # and a few tokens of slack for merges across the template's edges

    def _check_prompt_lengths(self, prompt_ids) -> None:
        """A prompt at or past the model's positions is an error at its batch: TRL 1.16's GRPOConfig has no
        max_prompt_length (GRPOTrainer truncates no prompt), and generate would continue past the positions without
        a word. A prompt that fits but leaves less than max_completion_length is said once (completions there run
        past the positions too)."""
        limit = self._position_limit()
        if limit is None:
            return
        budget = self._budget
        for i, ids in enumerate(prompt_ids):
            if len(ids) >= limit:
                raise ValueError(_too_long_message(f"Prompt {i} of this batch", len(ids), limit, budget))
            # budget ≥ limit: every prompt is short of room, which start-up has said already
            if len(ids) + budget > limit and budget < limit and not self._warned_prompt_room:
                self._warned_prompt_room = True
                logger.warning(
                    f"Prompt {i} of this batch has {len(ids)} tokens and leaves fewer than max_completion_length "
                    f"({budget}) of the model's max_position_embeddings ({limit}): a trajectory that uses its whole "
                    "budget runs past the model's positions. Filter the dataset to prompts below "
                    f"{limit - budget} tokens or lower max_completion_length (said once per run)."
                )


PROMPT_FORMATS = (
    "A prompt is a non-empty string (TRL's standard format) or a non-empty list of chat messages "
    '[{"role": "user", "content": "..."}] (conversational).'
)
_FIX_ROWS = "Drop such rows (dataset.filter(lambda row: bool(row['prompt']))) or fill them in."


def check_dataset_prompts(owner: str, datasets: list[tuple[str, object]], *, owns_prompts: bool) -> None:
    """Every row's `prompt` of each dataset (train, eval, a dict of evals) checked for its shape when the trainer is
    built, before GRPOTrainer is: a None, an empty string or list, or a message without its role or content is an
    error naming the row and the fix (`prompt_problem`), where TRL fails with a bare IndexError (an empty list first,
    read to tell the dataset's format) or the tokenizer's type error (None), or not at all until the row's batch comes
    up, hours in. One pass over the column in Python (10,000 two-message chat prompts: 0.14 s on 2 busy cores, most of
    it Arrow's conversion to Python); streaming datasets are checked per batch (`PromptRenderer.dataset_prompts`)."""
    for name, dataset in datasets:
        for key, one in dataset.items() if isinstance(dataset, dict) else [(None, dataset)]:
            if not isinstance(one, Dataset) or "prompt" not in one.column_names:
                continue
            label = name if key is None else f"{name}[{key!r}]"
            column, first = one.select_columns(["prompt"]).with_format(None), None
            for start in range(0, len(column), 1024):
                for i, prompt in enumerate(column[start : start + 1024]["prompt"], start):
                    first = prompt if i == 0 else first
                    problem = prompt_problem(prompt, owns_prompts=owns_prompts, first=first)
                    if problem is not None:
                        raise ValueError(
                            f"{owner}: {label} row {i} {problem} Checked when the trainer is built, so "
                            "that the row does not stop the run when its batch comes up."
                        )


def warn_unseen_tools(owner: str, datasets: list[tuple[str, object]], tools) -> None:
    """Warn when the trainer is given `tools` but a dataset's prompts are plain strings: a plain-text prompt is fed
    as it is, with no chat template to render the tools' schemas, so the model is never shown the tools (issue 59:
    they were silently unseen). A warning, not an error: a model already trained on the tools may still call them."""
    if not tools:
        return
    for name, dataset in datasets:
        for key, one in dataset.items() if isinstance(dataset, dict) else [(None, dataset)]:
            if not isinstance(one, Dataset) or "prompt" not in one.column_names or len(one) == 0:
                continue
            if isinstance(one[0]["prompt"], str):
                label = name if key is None else f"{name}[{key!r}]"
                names = ", ".join(getattr(t, "__name__", type(t).__name__) for t in tools)
                logger.warning(
                    "%s: %s has plain-string prompts, so the tools (%s) are never shown to the model: a plain-text "
                    "prompt gets no chat template, which is what renders the tools' schemas into the prompt. Give "
                    'the prompts as chat messages ([{"role": "user", "content": ...}]) for the model to see them.',
                    owner, label, names,
                )
                return


def prompt_problem(prompt, *, owns_prompts: bool = False, first=None) -> str | None:
    """What is wrong with one dataset prompt, as the end of a sentence that starts with where it is ("row 3 "), with
    the fix; None for a usable prompt. `first` is the first prompt of its dataset or batch, whose format (string or
    messages) TRL renders the whole batch in. With an environment (`owns_prompts`) the messages may be empty: its
    reset's observation is appended to the last one, as TRL's placeholder prompt `[{"role": "user", "content": ""}]`
    relies on."""
    if prompt is None:
        return f"has no prompt (None). {PROMPT_FORMATS} {_FIX_ROWS}"
    if isinstance(prompt, str):
        if not prompt.strip():
            return f"has an empty prompt ({prompt!r}). {PROMPT_FORMATS} {_FIX_ROWS}"
        if isinstance(first, list):
            return _mixed_formats("a plain string", "chat messages")
        return None
    if not isinstance(prompt, list | tuple):
        return f"has a prompt of type {type(prompt).__name__} ({_short(prompt)}). {PROMPT_FORMATS}"
    if len(prompt) == 0:
        return f"has an empty list of messages as its prompt. {PROMPT_FORMATS} {_FIX_ROWS}"
    if isinstance(first, str):
        return _mixed_formats("chat messages", "a plain string")
    for j, message in enumerate(prompt):
        if not isinstance(message, dict):
            return (
                f"has a prompt whose message {j} is a {type(message).__name__} ({_short(message)}), not a chat "
                f"message. {PROMPT_FORMATS} Convert the rows (dataset.map)."
            )
        role, content = message.get("role"), message.get("content")
        if not isinstance(role, str) or not role:
            return (
                f"has a prompt whose message {j} has no role (role={role!r}; keys {sorted(message)}). Each "
                'message needs "role" ("system", "user", "assistant" or "tool") and "content": rename its keys '
                "(dataset.map) or fix the row."
            )
        if content is None and not message.get("tool_calls"):
            return (
                f"has a prompt whose message {j} (role {role!r}) has no content (content=None; keys "
                f'{sorted(message)}). Each message needs "content" (a string, or a list of content blocks); only '
                "an assistant message with tool_calls may go without. Fix the row, or drop it (dataset.filter)."
            )
        if content is not None and not isinstance(content, str | list):
            return (
                f"has a prompt whose message {j} (role {role!r}) has content of type {type(content).__name__} "
                f"({_short(content)}): a message's content is a string, or a list of content blocks."
            )
    if not owns_prompts and all(_is_empty(m.get("content")) and not m.get("tool_calls") for m in prompt):
        return (
            f"has a prompt whose messages are all empty ({_short(prompt)}): the model would be asked nothing. "
            f"{PROMPT_FORMATS} Fill such rows in, or drop them (dataset.filter)."
        )
    return None


def _mixed_formats(this: str, first: str) -> str:
    return (
        f"is {this}, but the first prompt is {first}: TRL renders a batch in the format of its first prompt, so "
        "every row needs the same one. Convert the rows to one format (dataset.map)."
    )


def _is_empty(content) -> bool:
    return content is None or (isinstance(content, str) and not content.strip()) or content == []


def _short(value, width: int = 60) -> str:
    text = repr(value)
    return text if len(text) <= width else text[: width - 3] + "..."


def position_limit(model) -> int | None:
    """The model's `max_position_embeddings` (a multimodal model's text config), what GRPOTrainer's tool loop caps
    sequences at; None when the config has none."""
    config = unwrap_model(model).config
    config = config.get_text_config() if hasattr(config, "get_text_config") else config
    return getattr(config, "max_position_embeddings", None)


def _too_long_message(which: str, length: int, limit: int, budget: int) -> str:
    """A prompt at or past the model's positions: what it is, and how to shorten or filter it."""
    return (
        f"{which} renders to {length} tokens (chat template and tool schemas included), but the model has "
        f"max_position_embeddings = {limit}: it cannot be continued without running past the model's positions. "
        "GRPOConfig has no max_prompt_length to truncate it; shorten the prompt, or filter the dataset on the rendered "
        "prompt length (dataset.filter) to prompts "
        + (f"below {limit - budget} tokens, which leaves room for max_completion_length = {budget}."
           if budget < limit else f"below {limit} tokens, and lower max_completion_length ({budget}).")
    )


def _after_text_prompt(prefix: list[int], text_prompt_ids) -> list[int]:
    """The history after its plain-text prompt (the longest of `text_prompt_ids` it starts with), else all of it.

    TRL's response parser reads everything after the last assistant header of `prefix` as the assistant's message. A
    plain-text prompt has no header, so the parser would hand the prompt's text to reward functions as the start of
    the completion; the response starts right after the prompt, as with an empty prefix.
    """
    for ids in text_prompt_ids:
        if prefix[: len(ids)] == ids:
            return prefix[len(ids) :]
    return prefix
