"""Texts for the page data: untrusted text made visible and safe to encode (`clean_text`), cut with a note
(`cut_text`), and a dataset row read for its prompt, question and gold answer."""

from __future__ import annotations

import json
import math
import re
from collections.abc import Sequence

# Dataset columns the page reads, first match wins. The question: HotpotQA-style rows carry it besides the prompt
# (whose user turn is a long shared instruction with the question at its end). The gold answer: what the reward
# functions usually compare against.
QUESTION_COLUMNS = ("question", "query", "problem")
GOLD_COLUMNS = ("answer", "answers", "gold", "gold_answer", "ground_truth", "solution", "target", "reference", "label")


_BIDI = {0x202A, 0x202B, 0x202C, 0x202D, 0x202E, 0x2066, 0x2067, 0x2068, 0x2069, 0x200E, 0x200F, 0x061C}
# zero-width characters (space, non-joiner, joiner, word joiner, BOM): they hide text inside text, e.g. the U+200B
# that `observation_special_tokens="neutralize"` puts into a special-token string of a tool output
_ZERO_WIDTH = {0x200B, 0x200C, 0x200D, 0x2060, 0xFEFF}
_TAGS = range(0xE0000, 0xE0080)  # Unicode tag characters: invisible, and able to carry a whole hidden ASCII text


def _visible(ch: str) -> str:
    code = ord(ch)
    if ch in "\n\t":
        return ch
    if code < 0x20 or 0x7F <= code <= 0x9F or code in _BIDI or code in _ZERO_WIDTH or code in _TAGS:
        return f"\\x{code:02x}" if code <= 0xFF else f"\\u{code:04x}" if code <= 0xFFFF else f"\\U{code:08x}"
    if 0xD800 <= code <= 0xDFFF:  # a lone surrogate cannot be written as UTF-8
        return "\ufffd"
    return ch


_SUSPECT = re.compile(
    "[\x00-\x08\x0b-\x1f\x7f-\x9f\u061c\u200b-\u200f\u2060\u202a-\u202e\u2066-\u2069\ufeff\ud800-\udfff"
    "\U000e0000-\U000e007f]"
)


def clean_text(text: str) -> str:
    """`text` with control characters (but newline and tab), lone surrogates, bidirectional controls (the Arabic
    letter mark included), zero-width characters and Unicode tag characters made visible (`\\x1b`, `\\u202e`,
    `\\u200b`, `\\U000e0041`, U+FFFD): they could hide or reorder what the page shows, or fail to encode."""
    text = str(text)
    return text if not _SUSPECT.search(text) else "".join(_visible(c) for c in text)


def cut_text(text: str, limit: int) -> str:
    """`text` cut to `limit` characters with a note saying how many were left out."""
    text = clean_text(text)
    if len(text) <= limit:
        return text
    return text[:limit] + f" … [{len(text) - limit} more characters not saved]"


def _content_text(content) -> str:
    if isinstance(content, list):  # content parts
        return " ".join(str(p.get("text", "")) if isinstance(p, dict) else str(p) for p in content)
    return "" if content is None else str(content)


def prompt_text(prompt) -> str:
    """A dataset prompt as text: a string as it is, chat messages as `role: content` lines."""
    if isinstance(prompt, str):
        return prompt
    if isinstance(prompt, Sequence):
        lines = []
        for message in prompt:
            if isinstance(message, dict):
                lines.append(f"{message.get('role', '?')}: {_content_text(message.get('content'))}")
            else:
                lines.append(str(message))
        return "\n".join(lines)
    return str(prompt)


_QUESTION_MARKER = re.compile(r"(?:^|\n|\s)(?:question|q)\s*:\s*", re.IGNORECASE)


def question_text(prompt, row: dict | None = None) -> str:
    """What the prompt asks, without what every prompt shares: the row's `question` column (`QUESTION_COLUMNS`) when
    it has one; else the last user message (the system message is the same for every prompt), from its last
    "Question:" on when it has one (Search-R1-style instructions put the question at the end)."""
    for column in QUESTION_COLUMNS:
        value = (row or {}).get(column)
        if isinstance(value, str) and value.strip():
            return value.strip()
    text = prompt if isinstance(prompt, str) else None
    if text is None and isinstance(prompt, Sequence):
        users = [m for m in prompt if isinstance(m, dict) and m.get("role") == "user"]
        text = _content_text(users[-1].get("content")) if users else prompt_text(prompt)
    text = str(text if text is not None else prompt)
    marks = list(_QUESTION_MARKER.finditer(text))
    if marks and text[marks[-1].end():].strip():
        text = text[marks[-1].end():]
    return text.strip()


def gold_answer(row: dict | None) -> tuple[str, str] | None:
    """(column, text) of the row's gold answer (`GOLD_COLUMNS`), None when the dataset has none."""
    for column in GOLD_COLUMNS:
        value = (row or {}).get(column)
        if value is None or value == "" or value == []:
            continue
        if isinstance(value, str):
            return column, value
        if isinstance(value, (list, tuple)) and all(isinstance(v, (str, int, float)) for v in value):
            return column, " | ".join(str(v) for v in value)
        try:
            return column, json.dumps(value, ensure_ascii=False, default=str)
        except (TypeError, ValueError):
            return column, str(value)
    return None


def number(value) -> float | None:
    """`value` as a float, None for None and for NaN or ±inf (JSON has no such numbers)."""
    if value is None:
        return None
    value = float(value)
    return value if math.isfinite(value) else None

