"""Text conventions shared by the rewards and the rollout layer, in a module that imports nothing of the package.

Both `trl_tree.rewards` (which reads the agents' final answers) and `trl_tree.rollout` (whose harness stops a search
at one, and whose messages quote model output) need them; keeping them here lets each import downwards only, instead
of rewards reaching up into `rollout.tools` and the harness into `rewards`.
"""

from __future__ import annotations

import re

ANSWER_SPAN = re.compile(r"<answer>(.*?)</answer>", re.DOTALL)  # the final answer of the agents here


def shorten(value, n: int = 120) -> str:
    """`str(value)` cut to `n` characters with an ellipsis, for error and warning messages that quote model output."""
    text = str(value)
    return text if len(text) <= n else text[: n - 1] + "…"


def plural(count: int | float, noun: str, plural_form: str | None = None) -> str:
    """`count` and the noun, singular for exactly 1 ("1 prompt", "2 prompts", "1 optimizer block"), for console lines
    that count things the user configured."""
    return f"{count:g} {noun if count == 1 else plural_form or noun + 's'}"
