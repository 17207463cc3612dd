"""Untrusted observation text is tokenized as text: control strings in it cannot become control tokens.

A tool's output, an environment's answer or a retrieved document is written by someone else. Rendered through the
chat template as it is, a tool output that contains `<|im_end|>\\n<|im_start|>assistant\\n<tool_call>…` becomes the
real turn-marker ids, and the policy trains on contexts with forged assistant or system turns (and the sampler on
histories that end a turn where nobody ended it). The prompt stays trusted, as in GRPO; what the model generates is
its own action; only text appended as an observation goes through here (`TreeConfig.observation_special_tokens`).

How: every occurrence of a control string of the tokenizer in the message's `content` (and tool `name`) gets a
ZERO WIDTH SPACE (U+200B) after its first character, `<|im_end|>` → `<` U+200B `|im_end|>`. Why this and not
`split_special_tokens=True` on the content's span of the rendered text: the chat template renders (and TRL's
`_get_tool_suffix_ids` slices) the whole conversation at once, so tokenizing a span on its own would change how the
text around it tokenizes, and observations without control strings would no longer be byte-identical to TRL's. Here
a message without control strings is passed on unchanged (the same ids as `"raw"`), and one with them differs by
one invisible character per occurrence: every original character is still there in the decoded text (the tree view
shows U+200B as `\\u200b`), and no added token's string is left for the tokenizer to match.

The control strings are the tokenizer's special tokens and added tokens (Qwen's `<tool_call>`/`<think>` are added
as non-special tokens, yet they are markup the parser and the template act on). Left out: whitespace-only added
tokens (they are text, and cannot forge a turn) and one-character tokens (nothing to split; no chat template known
to us uses one).
"""

from __future__ import annotations

import functools
import re
from typing import Any

OBSERVATION_SPECIAL_TOKENS = ("neutralize", "raw")
BREAK = "\u200b"  # ZERO WIDTH SPACE: no tokenizer's added token contains it, and it does not change how text reads


def check_observation_special_tokens(mode: str) -> None:
    if mode not in OBSERVATION_SPECIAL_TOKENS:
        raise ValueError(
            f"observation_special_tokens must be one of {OBSERVATION_SPECIAL_TOKENS}; got {mode!r}: 'neutralize' "
            "tokenizes special-token strings inside tool/environment output as text (the default), 'raw' renders "
            "them as the special tokens themselves (only for tools you trust to write chat-template markup)."
        )


def control_strings(tokenizer) -> tuple[str, ...]:
    """The strings the tokenizer turns into special or added tokens, longest first (see the module docstring)."""
    tokenizer = getattr(tokenizer, "tokenizer", tokenizer)  # a processor's text tokenizer
    strings = set(getattr(tokenizer, "all_special_tokens", ()))
    strings.update(str(token) for token in getattr(tokenizer, "added_tokens_decoder", {}).values())
    return tuple(sorted((s for s in strings if len(s) > 1 and not s.isspace()), key=lambda s: (-len(s), s)))


@functools.lru_cache(maxsize=32)
def _pattern(strings: tuple[str, ...]) -> re.Pattern | None:
    return re.compile("|".join(map(re.escape, strings))) if strings else None


def neutralize_text(text: str, strings: tuple[str, ...]) -> str:
    """`text` with U+200B after the first character of each occurrence of each of `strings`.

    Repeated until none is left: breaking one string can leave another inside it (`<tool_call>` holds `tool_call>`
    if that were a token too); each pass inserts at least one character, and no string is made of U+200B alone."""
    pattern = _pattern(strings)
    if pattern is None:
        return text
    while pattern.search(text):
        text = pattern.sub(lambda m: m.group()[0] + BREAK + m.group()[1:], text)
    return text


def _neutralized_content(content: Any, strings: tuple[str, ...]) -> Any:
    if isinstance(content, str):
        return neutralize_text(content, strings)
    if isinstance(content, list):  # content parts: the text ones are text ({"type": "image"} parts are left alone)
        return [
            {**part, "text": neutralize_text(part["text"], strings)}
            if isinstance(part, dict) and isinstance(part.get("text"), str) else part
            for part in content
        ]
    return content


def observation_messages(tokenizer, messages: list[dict], mode: str) -> list[dict]:
    """`messages` as the chat template should render them into observation ids under `mode`
    (`TreeConfig.observation_special_tokens`): `"raw"` unchanged; `"neutralize"` with every control string of the
    tokenizer in each message's `content` (and tool `name`) broken by U+200B. New dicts; the caller's messages (the
    conversation reward functions see) are not changed.

    Raises:
        ValueError: an unknown mode; or a tokenizer that forms a special token again from the broken text (a
            normalizer that deletes zero-width characters), which would make "neutralize" a silent no-op.
    """
    check_observation_special_tokens(mode)
    if mode == "raw":
        return list(messages)
    strings = control_strings(tokenizer)
    out, changed = [], []
    for message in messages:
        new = dict(message)
        for key in ("content", "name"):
            if key in new:
                new[key] = _neutralized_content(new[key], strings)
                if new[key] != message[key]:
                    changed.append(new[key])
        out.append(new)
    if changed:
        _check_broken(tokenizer, changed, strings)
    return out


def _check_broken(tokenizer, contents: list, strings: tuple[str, ...]) -> None:
    """Only when something was broken (rare): tokenize it alone and make sure no control token came back. Added
    tokens are matched on the raw text before the model's own tokenization, so the content alone tells."""
    tokenizer = getattr(tokenizer, "tokenizer", tokenizer)
    wanted = set(strings)
    ids = {i for i, token in tokenizer.added_tokens_decoder.items() if str(token) in wanted}
    ids.update(i for token, i in zip(tokenizer.all_special_tokens, tokenizer.all_special_ids) if token in wanted)
    ids.discard(tokenizer.unk_token_id)  # text the vocabulary cannot spell is <unk>, not a forged control token
    for content in contents:
        texts = [content] if isinstance(content, str) else [p["text"] for p in content if isinstance(p, dict)
                                                                and isinstance(p.get("text"), str)]
        for text in texts:
            found = ids.intersection(tokenizer(text, add_special_tokens=False)["input_ids"])
            if found:
                raise ValueError(
                    "observation_special_tokens='neutralize' cannot break special tokens with this tokenizer: "
                    f"{tokenizer.convert_ids_to_tokens(sorted(found))} formed again after a U+200B was inserted (its "
                    "normalizer removes zero-width characters). Use a tokenizer without such a normalizer, or set "
                    "observation_special_tokens='raw' if every tool and environment is trusted."
                )
