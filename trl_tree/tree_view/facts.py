"""What a page says about its data, derived when it is rendered (so older files get it too): each prompt's reward
spread, leaf outcomes, best and worst leaf, failed tool calls, each turn's credit sign and what the update did to
it. Pure Python on checked page data (`checks.checked_page`); the page and the index only format these facts, and
the page's legend is written from the same tables (`CREDIT_SIGNS`, `DIRECTIONS`), so it cannot say otherwise than
the nodes show.

**Credit sign.** A turn's credit A (the backed-up value V for the tree credits) is "positive", "negative" or "zero"
(|A| < `ZERO_CREDIT`, e.g. every turn of a tree whose leaves all have the same reward); the page colours the node by
it.

**What the update did.** Per trained turn, p = σ(s) with s = the mean log-ratio of the turn's tokens after the update
against π_old (TreeOPSD's p, ½ under π_old; for the other losses from the mean token log-probabilities before and
after), Δp = p − ½. A turn has a direction only when its credit asks for one: TreeOPSD, q ≠ ½ (q = ½ + V/τ); the other
losses, A ≠ 0. Such a turn moved "toward" (TreeOPSD: p ended closer to q than ½ was, overshooting q counts as away;
the others: p moved the way the credit's sign asks, up for A > 0), "away" (the other way), or stayed "unchanged"
(|Δp| < `UNCHANGED_DP`). A turn without a direction is "undirected", counted apart: the shared weights move it
too, but toward nothing.
"""

from __future__ import annotations

import math

from .text import question_text

# |Δp| below this is "unchanged": p is σ of a mean of float32 log-ratios from two forwards, whose rounding alone moves
# it by ~1e-7; a realistic learning rate moves it by 1e-5 to 1e-2 per generation batch.
UNCHANGED_DP = 1e-6
# |A| (and TreeOPSD's |q − ½| = |V|/τ) below this is zero credit: no sign, no direction. The standardised rewards of a
# tree whose leaves are all equal are exactly 0; float64 backups of unequal ones are far above it.
ZERO_CREDIT = 1e-9

# (class, what it means): the node colours and the legend's swatches, in this order
CREDIT_SIGNS = (
    ("pos", "credit above 0: the attempts below this turn did better than its tree's average"),
    ("neg", "credit below 0: they did worse"),
    ("zero", f"zero credit (|credit| < {ZERO_CREDIT:g}): no learning signal for this turn"),
)
DIRECTIONS = ("toward", "away", "unchanged", "undirected")
DIRECTION_MARKS = {"toward": "↑", "away": "↓", "unchanged": "=", "undirected": "○"}


def credit_sign(a: float | None) -> str | None:
    """The node's colour class for its credit A: "pos", "neg", "zero" (|A| < `ZERO_CREDIT`); None without credit."""
    if a is None:
        return None
    if abs(a) < ZERO_CREDIT:
        return "zero"
    return "pos" if a > 0 else "neg"


def turn_update(credit: dict) -> tuple[float, str] | None:
    """(Δp, direction) of a trained turn from its credit fields (`A`, `q`, `p_after`, `logp_old`, `logp_new`);
    None when the page has no "after" values for it (an evaluation page, a masked turn)."""
    p = credit.get("p_after")
    if p is None:
        old, new = credit.get("logp_old"), credit.get("logp_new")
        if old is None or new is None:
            return None
        s = new - old
        p = 1.0 / (1.0 + math.exp(-s)) if s > -700 else 0.0
    dp = p - 0.5
    q, a = credit.get("q"), credit.get("A")
    if q is not None:
        if abs(q - 0.5) < ZERO_CREDIT:
            return dp, "undirected"
        if abs(dp) < UNCHANGED_DP:
            return dp, "unchanged"
        return dp, "toward" if abs(p - q) < abs(0.5 - q) else "away"
    if a is None or abs(a) < ZERO_CREDIT:
        return dp, "undirected"
    if abs(dp) < UNCHANGED_DP:
        return dp, "unchanged"
    return dp, "toward" if (dp > 0) == (a > 0) else "away"


def leaf_values(record: dict) -> dict[int, float | None]:
    """Each node where trajectories end (TreeFlex: each search) → the mean of their rewards (None: none scored)."""
    out = {}
    for node in record.get("nodes", []):
        rewards = node.get("rewards") or []
        if rewards:
            scored = [r for r in rewards if r is not None]
            out[node["id"]] = sum(scored) / len(scored) if scored else None
    return out


def analyse(record: dict) -> dict:
    """What the page says of one prompt: reward spread, leaf outcomes, best and worst leaf, failed tool calls, each
    turn's credit sign, and per trained turn Δp and its direction (`turn_update`) with their counts."""
    rewards = [r for r in record.get("rewards", []) if r is not None]
    low = min(rewards) if rewards else None
    high = max(rewards) if rewards else None
    mean = sum(rewards) / len(rewards) if rewards else None
    std = math.sqrt(sum((r - mean) ** 2 for r in rewards) / len(rewards)) if rewards else None
    values = leaf_values(record)
    outcome = {}
    for i, v in values.items():
        if v is not None and mean is not None:
            # rewarded: a positive reward at least its tree's mean (a 0/1 reward: the 1s); failed: the rest
            at_least_mean = v >= mean - 1e-9 * max(1.0, abs(mean))
            outcome[i] = "rewarded" if v > 0 and at_least_mean else "failed"
    scored = [(v, i) for i, v in values.items() if v is not None]
    best = max(scored, key=lambda t: t[0])[1] if scored else None  # the first of equals (DFS order)
    worst = min(scored, key=lambda t: t[0])[1] if scored else None
    failures, calls, penalised = 0, 0, 0
    dp, counts = {}, dict.fromkeys(DIRECTIONS, 0)
    signs, sign_counts = {}, {cls: 0 for cls, _ in CREDIT_SIGNS}
    for node in record.get("nodes", []):
        failures += int(node.get("tool_failures") or 0)
        calls += int(node.get("tool_calls") or 0)
        penalised += int((node.get("penalty") or 0) < 0)
        credit = node.get("credit") or {}
        sign = credit_sign(credit.get("A"))
        if sign is not None:
            signs[node["id"]] = sign
            sign_counts[sign] += 1
        update = turn_update(credit) if node.get("kind", "turn") == "turn" else None
        if update is not None:
            dp[node["id"]] = update
            counts[update[1]] += 1
    return {"min": low, "max": high, "mean": mean, "std": std, "mixed": high is not None and high > low,
            "values": values, "outcome": outcome, "best": best, "worst": worst,
            "failures": failures or penalised, "calls": calls, "penalised": penalised, "dp": dp, "dp_counts": counts,
            "signs": signs, "sign_counts": sign_counts}


def record_question(record: dict) -> str:
    """The record's question; an older file has none saved: from its prompt text (the last `user:` message)."""
    if record.get("question"):
        return record["question"]
    text = record.get("prompt") or ""
    lines = text.splitlines()
    starts = [i for i, line in enumerate(lines) if line.startswith("user:")]
    if starts:
        text = "\n".join(lines[starts[-1]:])[5:]
    return question_text(text.strip())


def short_questions(questions: list[str]) -> list[str]:
    """The questions without the text they all start with (an instruction shared by every prompt of the page), cut
    at a word; one question, or a short shared start, is left as it is."""
    if len(questions) < 2:
        return questions
    shared = len(questions[0])
    for q in questions[1:]:
        shared = min(shared, len(q))
        while not q.startswith(questions[0][:shared]):
            shared -= 1
    if shared < 30:
        return questions
    cut = questions[0].rfind(" ", 0, shared) + 1 or shared
    return [("… " + q[cut:].strip()) if q[cut:].strip() else q for q in questions]
