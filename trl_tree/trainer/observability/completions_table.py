"""The console's completions table of `log_completions`, made readable for trees (issue 41, item 5).

GRPOTrainer prints a sample of the buffered completions with TRL's `print_prompt_completions_sample`, one row per
completion with its whole prompt. A tree's K leaves share their prompt, so the table repeated the whole system prompt
on every row (about 584 lines for the HotpotQA job), its "tree" column said "leaf k of the tree above" on rows whose
tree row had not been sampled, and TRL's formatter ran a tool call into the text before it ("first.search(…").

The table printed here is TRL's (the same function and look) on rows prepared for the console only: a group's prompt
is shown once, on its first printed row, with the system prompt cut to its start; each message is cut to
`MAX_MESSAGE_CHARS` and each tool call is on a line of its own; the tree column describes the tree on the first
printed row of each tree, so "the tree above" is always printed above. What is saved and sent to the trackers
(GRPOTrainer's parquet file, W&B, Trackio) keeps every row in full.

Off a terminal (a log file, CI, `| tee`) rich renders the table at 80 columns, one word a line: about 580 of the
HotpotQA job's 620 lines (issue 59). There each printed row is one line instead (`compact_lines`: the tree, the
rewards, the advantage, the prompt once per tree and the completion, each cut), then where the tree pages are.
"""

from __future__ import annotations

import json
import random
import sys
from dataclasses import dataclass

from ...text import shorten

MAX_MESSAGE_CHARS = 600  # a message's text in the console (the logged table keeps it whole)
MAX_SYSTEM_CHARS = 120  # a system prompt's start, once per printed tree
TREE_COLUMN = "tree"  # the tree column of the logged table, replaced by `RowMeta`'s description here
SAME_PROMPT = "〃 (the prompt above)"


@dataclass(frozen=True)
class RowMeta:
    """Where a logged completion sits: its group (a tree, or TreeFlex's task), its index there and, for a tree, its
    leaf's turns and a one-line description of the tree."""

    group: tuple
    index: int
    size: int
    turns: tuple[int, ...] | None = None
    tree: str | None = None


@dataclass
class Table:
    """The columns TRL's `print_prompt_completions_sample` takes, for the rows to print."""

    prompts: list
    completions: list
    rewards: dict[str, list[float]]
    advantages: list[float]
    extra: dict[str, list]


def chosen_rows(num_rows: int, num_samples: int | None, rng: random.Random | None = None) -> list[int]:
    """The rows to print, in their logged order: all, or `num_samples` drawn at random as TRL draws them."""
    if num_samples is None or num_samples >= num_rows:
        return list(range(num_rows))
    if num_samples <= 0:
        return []
    return sorted((rng or random).sample(range(num_rows), num_samples))


def console_table(prompts, completions, rewards: dict, advantages, extra: dict, meta: list[RowMeta | None],
                  rows: list[int]) -> Table:
    """The printed `rows` of the logged columns, prepared for the console (module docstring)."""
    table = Table([], [], {name: [] for name in rewards}, [], {})
    has_trees = any(m is not None and m.tree is not None for m in meta)
    columns = {name: values for name, values in extra.items() if not (has_trees and name == TREE_COLUMN)}
    table.extra = {name: [] for name in columns} | ({TREE_COLUMN: []} if has_trees else {})
    shown_groups: set = set()
    for i in rows:
        m = meta[i]
        first = m is None or m.group not in shown_groups
        if m is not None:
            shown_groups.add(m.group)
        table.prompts.append(compact_prompt(prompts[i]) if first else SAME_PROMPT)
        table.completions.append(compact_messages(completions[i]))
        for name in rewards:
            table.rewards[name].append(rewards[name][i])
        table.advantages.append(advantages[i])
        for name, values in columns.items():
            table.extra[name].append(values[i])
        if has_trees:
            table.extra[TREE_COLUMN].append(tree_cell(m, first))
    return table


def tree_cell(meta: RowMeta | None, first: bool) -> str:
    """The tree column of one printed row: the tree's description on its first printed row, else a pointer to it."""
    if meta is None or meta.tree is None:
        return ""
    turns = f": turns {list(meta.turns)}" if meta.turns is not None else ""
    if first:
        return f"{meta.tree}\nleaf {meta.index + 1} of {meta.size}{turns}"
    return f"leaf {meta.index + 1} of {meta.size} of the tree above{turns}"


def compact_prompt(prompt):
    """A prompt for the console: a system message cut to its start (with its length), the others to
    `MAX_MESSAGE_CHARS`; a plain-text prompt likewise."""
    if isinstance(prompt, str):
        return _cut(prompt, MAX_MESSAGE_CHARS)
    if not _is_messages(prompt):
        return prompt
    out = []
    for message in prompt:
        content = message.get("content")
        if isinstance(content, str) and message.get("role") == "system" and len(content) > MAX_SYSTEM_CHARS:
            content = f"{shorten(content, MAX_SYSTEM_CHARS)} ({len(content):,} characters)"
        out.append(_compact_message({**message, "content": content}))
    return out


def compact_messages(completion):
    """A completion for the console: each message cut to `MAX_MESSAGE_CHARS`, each tool call on a line of its own
    after the text (TRL's formatter writes them straight after it)."""
    if isinstance(completion, str):
        return _cut(completion, MAX_MESSAGE_CHARS)
    if not _is_messages(completion):
        return completion
    return [_compact_message(message) for message in completion]


def _compact_message(message: dict) -> dict:
    content = message.get("content")
    text = _cut(content, MAX_MESSAGE_CHARS) if isinstance(content, str) else content
    calls = [_call_text(call) for call in message.get("tool_calls") or []]
    if calls:
        before = text.rstrip() + "\n" if isinstance(text, str) and text.strip() else ""
        text = before + "\n".join(f"→ {call}" for call in calls)
    if message.get("role") == "tool" and message.get("name"):
        text = f"[{message['name']}] {text or ''}"
    out = {k: v for k, v in message.items() if k not in ("tool_calls", "content")}
    return {**out, "content": text if text is not None else ""}


def _call_text(call) -> str:
    """A tool call as `name(arg=value, ...)`, however its arguments are stored (a dict, a JSON string, malformed)."""
    function = call.get("function", call) if isinstance(call, dict) else {}
    arguments = function.get("arguments", {}) if isinstance(function, dict) else {}
    if isinstance(arguments, str):
        try:
            arguments = json.loads(arguments)
        except ValueError:
            return _cut(f"{function.get('name', '?')}({arguments})", MAX_MESSAGE_CHARS)
    if not isinstance(arguments, dict):
        return _cut(f"{function.get('name', '?')}({arguments!r})", MAX_MESSAGE_CHARS)
    shown = ", ".join(f"{k}={v!r}" for k, v in arguments.items())
    return _cut(f"{function.get('name', '?')}({shown})", MAX_MESSAGE_CHARS)


def _cut(text: str, n: int) -> str:
    return text if len(text) <= n else f"{text[: n - 1]}… ({len(text) - n + 1:,} more characters)"


def _is_messages(value) -> bool:
    return isinstance(value, list) and all(isinstance(m, dict) for m in value)


COMPACT_FIELD_CHARS = 160  # a prompt's or completion's text on a compact line


def stdout_is_terminal() -> bool:
    """Whether the console is a terminal (the table), else a log (`compact_lines`)."""
    return sys.stdout.isatty()


def compact_lines(table: Table, step: int) -> list[str]:
    """The prepared rows off a terminal: one line per row (no line breaks inside), in the table's order."""
    lines = []
    for i, (prompt, completion) in enumerate(zip(table.prompts, table.completions, strict=True)):
        parts = [f"[completions step {step}]"]
        tree = table.extra.get(TREE_COLUMN)
        if tree and tree[i]:
            parts.append(_one_line(str(tree[i]).replace("\n", "; "), COMPACT_FIELD_CHARS))
        rewards = ", ".join(f"{name} {values[i]:.3g}" for name, values in table.rewards.items())
        parts.append(f"reward {rewards}" if rewards else "no reward")
        parts.append(f"advantage {table.advantages[i]:+.3g}")
        if prompt != SAME_PROMPT:
            parts.append(f"prompt: {_one_line(_text(prompt), COMPACT_FIELD_CHARS)}")
        parts.append(f"completion: {_one_line(_text(completion), COMPACT_FIELD_CHARS)}")
        lines.append(" | ".join(parts))
    return lines


def _text(value) -> str:
    """A prompt or completion (prepared by `compact_prompt` / `compact_messages`) as text, messages joined by " / "."""
    if _is_messages(value):
        return " / ".join(str(m.get("content") or "") for m in value)
    return str(value)


def _one_line(text: str, n: int) -> str:
    return _cut(" ".join(text.split()), n)
