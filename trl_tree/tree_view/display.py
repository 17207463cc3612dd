"""What every part of a page shares: the page-wide settings derived from the data (`View`: the reward colour scale,
the chat template's tokens, the credit), how much of the data a page shows (`Budget`), the texts shown on hover, and
the texts every part writes (counts, reward spreads, one-line texts). Data and formatting only: the markup is the
templates' (`assets/templates/`), and every text here is written escaped by them (`page._escaped`)."""

from __future__ import annotations

import re

from .facts import leaf_values
from .records import BACKUP_CREDITS


def plural(n: int, word: str) -> str:
    return f"{n} {word}" + ("" if n == 1 else "s")


# -------------------------------------------------------------------- what the page derives from the data


class View:
    """Page-wide rendering settings derived from the data: the reward colour scale, the template tokens, whether the
    credit applied process penalties (`penalties`, from the data: `methods.Credit.applies_penalties`; files without
    it: only TreeFlex's groups had them) and the credit's own description (`credit_summary`)."""

    def __init__(self, data: dict):
        self.credit = data.get("credit", "")
        self.credit_summary = data.get("credit_summary", "")
        self.backup = self.credit in BACKUP_CREDITS
        penalties = data.get("penalties")
        if not isinstance(penalties, bool):
            penalties = any(record.get("kind") == "flex" for record in data.get("prompts", []))
        self.penalties = penalties
        values = [v for record in data.get("prompts", []) for v in leaf_values(record).values() if v is not None]
        if values and 0.0 <= min(values) and max(values) <= 1.0:
            self.low, self.high = 0.0, 1.0  # a [0, 1] reward keeps its absolute meaning: 0 red, 1 green
        elif values:
            self.low, self.high = min(values), max(values)
        else:
            self.low = self.high = 0.0
        # only markup-like tokens (<|im_end|>, </s>, [INST]): a tampered file's "a" must not hide every "a"
        tokens = [t for t in data.get("special_tokens", []) if len(t) >= 3 and t[0] in "<[" and t[-1] in ">]"]
        self.template = (
            re.compile("|".join(re.escape(t) for t in sorted(tokens, key=len, reverse=True)))
            if tokens
            else _TEMPLATE_FALLBACK
        )

    def level(self, value: float | None) -> int | None:
        """Where a reward sits on the page's reward scale, 0 (its low end) to 100 (its high end); None: no reward.

        The stylesheet draws it as `--rl` on a scale of its own, pale to deep violet, so that a reward's colour never
        reads as a credit's: the credit's signs are green (> 0), red (< 0) and grey (0), and a tree whose leaves
        all scored 0 must not look like a tree of negative credit (issue 59: both were red)."""
        if value is None:
            return None
        if self.high <= self.low:
            return 50
        return round(100 * min(max((value - self.low) / (self.high - self.low), 0.0), 1.0))


# What a page's symbols mean, on hover (their `title`): τ and A_k appear as numbers, a reader must not have to know
# the papers to read them (issue 59).
TAU_TITLE = (
    "τ = (K − 1)/(ρ√K), TreeOPSD's scale of this tree (K leaves, teacher radius ρ): a turn's teacher is "
    "q = ½ + V/τ, so q stays within ½ ± ρ"
)
LEAF_ADVANTAGES_TITLE = (
    "A_k: the rewards of the leaves that end here, each standardised over its tree's K leaves, "
    "(R_k − mean)/std: what the credit backs up to the turns above"
)
REWARD_SCALE_TITLE = (
    "a leaf's reward, pale (the page's lowest) to deep violet (its highest): a scale of its own, "
    "apart from the credit's green (> 0) / red (< 0) / grey (0)"
)
PENALTY_TITLE = (
    "Q: the process penalty of this turn's failed or malformed tool calls, which this run's credit adds "
    "to the turn's advantage (TreeFlex F2)"
)
POLICY_TITLE = (
    "the policy that sampled this tree: version v = the weights after v generation batches of training. "
    "Staleness = the versions between it and this batch's π_old (the weights this batch's update starts "
    "from): 0 = sampled by π_old itself (the synchronous trainer, max_staleness=0); above 0 = grown ahead "
    "by the rollout worker while earlier batches trained (max_staleness > 0)"
)
ABANDONED_TITLE = (
    "the environment's call timed out: the branch was ended at this turn, without the call's answer, "
    "because the abandoned call may still run and change the environment behind the model's back "
    "(counted by tools/abandoned_environments)"
)
_TEMPLATE_FALLBACK = re.compile(r"<\|[A-Za-z0-9_.:\-]{1,40}\|>")


def spread_text(low, high, mean) -> str:
    if low is None:
        return "no scored leaf"
    if high == low:
        return f"R {low:.3g} (all leaves)"
    return f"R {low:.3g}…{high:.3g}, mean {mean:.3g}"


def plain_text(text: str, view: View, limit: int) -> str:
    """A one-line plain version of a text (template tokens out), for the prompt list and the facts."""
    text = view.template.sub(" ", text)
    text = " ".join(text.split())
    return text[:limit] + ("…" if len(text) > limit else "")


class Budget:
    """How many nodes and characters of text the page has left; a node past either is cut, and every node after it
    (the shown nodes stay a prefix of the depth-first order, so a shown node's ancestors are shown)."""

    def __init__(self, max_nodes: int, max_chars: int):
        self.nodes_left, self.chars_left = max_nodes, max_chars
        self.total_nodes = self.cut_nodes = 0

    def take(self, node: dict) -> bool:
        self.total_nodes += 1
        size = sum(len(node.get(k) or "") for k in ("action", "observation", "context"))
        if self.nodes_left <= 0 or size > self.chars_left:
            self.nodes_left = 0  # cut the rest too: keeps the shown nodes a prefix of the DFS order
            self.cut_nodes += 1
            return False
        self.nodes_left -= 1
        self.chars_left -= size
        return True


# The page must read in a tracker's frame too: Trackio shows an HTML value in a 420-pixel-high frame at least 360 wide
# (its media grid), W&B in a panel about as small. Below 760 pixels of width the prompt list goes above the tree, and
# the legend stays folded unless the window is large (the script opens it there).
