"""What one node of a prompt's tree shows, as data for the template `_node.html`: its classes and `data-`
attributes (what the script and the stylesheet read), its head (what a reader needs first), its other numbers on
demand, and its texts as segments (the chat template's tokens apart, long texts folded). Data and formatting only:
the markup is the template's, and every text here is written escaped by it (`page._escaped`)."""

from __future__ import annotations

import json
import re

from .display import ABANDONED_TITLE, LEAF_ADVANTAGES_TITLE, PENALTY_TITLE, View
from .records import SHOWN_CHARS

DIRECTION_WORDS = {"toward": "toward", "away": "away", "unchanged": "unchanged", "undirected": "no target"}
_ROLE = re.compile(r"[A-Za-z][A-Za-z0-9_\-]{0,19}")


def _fmt(value, digits: int = 3) -> str:
    return "–" if value is None else f"{value:+.{digits}f}"


def _fmt_p(value) -> str:
    return "–" if value is None else f"{value:.3f}"


def _fmt_dp(dp: float) -> str:
    """Δp signed, with enough digits for a realistic learning rate's 1e-5 (0.00001 would print as +0.000)."""
    if dp == 0:
        return "±0"
    return f"{dp:+.4f}" if abs(dp) >= 1e-3 else f"{dp:+.2e}"


def _fmt_p_after(p: float) -> str:
    return f"{p:.3f}" if abs(p - 0.5) >= 1e-2 else f"{p:.6f}"


def _tokens(n) -> str:
    return f"{int(n)} token" + ("" if int(n) == 1 else "s")


def _attribute_name(key: str) -> str:
    """A credit key as a `data-` attribute name: only [a-z0-9-] (a hand-edited data file cannot add attributes)."""
    return re.sub(r"[^a-z0-9-]", "", str(key).replace("_", "-").lower()) or "x"


def node_part(node: dict, num_children: int, facts: dict, view: View, sibling=None) -> dict:
    """One node: its classes and `data-` attributes (what the script and the stylesheet read), its head (what a
    reader needs first), its other numbers (`.extra`: on click, with "all numbers", as the id's hover text), then
    its texts. `sibling`: (i, n, field, shared) for the i-th of n siblings after a branch point."""
    kind = node.get("kind", "turn")
    credit = node.get("credit", {})
    node_id = int(node["id"])
    classes = ["node", kind]
    value = facts["values"].get(node_id)
    outcome = facts["outcome"].get(node_id)
    if node.get("leaf") or node_id in facts["values"]:
        classes.append("leaf")
    if num_children > 1:
        classes.append("bp")
    sign = facts["signs"].get(node_id)
    if sign is not None:
        classes.append(sign)
    data = []  # the `data-` attributes after data-parent, in this order
    if sign is not None:
        data.append(("sign", sign))
    if kind == "turn":
        data.append(("multiplicity", int(node.get("multiplicity") or 0)))
        if node.get("round") is not None:
            data.append(("round", int(node["round"])))
        if node.get("partial"):
            data.append(("partial", 1))
    if outcome:
        data.append(("outcome", outcome))
    dp = facts["dp"].get(node_id)
    if dp:
        data += [("dp", repr(dp[0])), ("dir", dp[1])]
    data += [(_attribute_name(key), repr(float(number))) for key, number in credit.items() if number is not None]
    if node.get("rewards"):
        data.append(("rewards", json.dumps(node["rewards"])))
    extra = _extra(node, num_children, credit, sibling)
    out = {
        "classes": " ".join(classes),
        "kind": kind,
        "id": node_id,
        "parent": int(node.get("parent", -1)),
        "data": data,
        "level": view.level(value),
        "fold": num_children > 1,
        "sibling": {"i": sibling[0], "of": sibling[1]} if sibling is not None else None,
        "tip": " · ".join(text for _, text, _ in extra),
        "label": node.get("label") or "#" + str(node_id),
        "head": _head(node, num_children, credit, view, dp, outcome),
        "extra": extra,
        "diverge": None,
        "context": None,
        "action": None,
        "action_split": None,
        "observation": None,
        "observation_tokens": "",
    }
    inline = None
    if sibling is not None and sibling[2]:
        text = node.get(sibling[2]) or ""
        if sibling[2] == "action" and _cut_at(text, SHOWN_CHARS, view)[1] <= SHOWN_CHARS:
            inline = sibling[3]  # short: the action itself shows the shared start dimmed and the rest marked
        else:
            out["diverge"] = _divergence_note(node, sibling, view)
    if kind == "block":
        out["context"] = _folded(node.get("context", ""), "ctxtext", view)
        out["context_tokens"] = int(node.get("context_tokens") or 0)
    action = node.get("action")
    if action and inline is not None:
        out["action_split"] = {"same": _segments(action[:inline], view), "rest": _segments(action[inline:], view)}
    elif action:
        out["action"] = _folded(action, "action", view)
    if node.get("observation"):
        out["observation"] = _folded(node["observation"], "obstext", view, SHOWN_CHARS // 2)
        if node.get("observation_tokens"):
            out["observation_tokens"] = _tokens(node["observation_tokens"])
    return out


def _divergence_note(node: dict, sibling, view: View) -> dict:
    """The sibling's text from where it first differs from its siblings' (the shared start dimmed, cut)."""
    _, n, field, shared = sibling
    text = node.get(field) or ""
    where = "its action" if field == "action" else "the same action; its observation"
    if shared == 0:
        what = f"{where} differs from the first character"
    else:
        what = f"{where} shares its first {shared} characters with its siblings', then"
    return {
        "what": what,
        "elided": shared > 24,
        "before": _segments(text[max(0, shared - 24) : shared], view),
        "after": _segments(text[shared : shared + 80], view),
        "more": len(text) > shared + 80,
    }


def _head(
    node: dict, num_children: int, credit: dict, view: View, dp: tuple[float, str] | None, outcome: str | None
) -> dict:
    """The head's items, what a reader needs first: the credit (A, or V for a backed-up credit), what the update
    did to the turn (Δp and its direction), a leaf's reward (its chip green when rewarded, red when failed), ×m, the
    warnings (a process penalty Q only where the credit applied one: `view.penalties`), and a TreeFlex search's or
    block's shape. An item the node does not have is empty."""
    head = {
        "credit": "",
        "change": None,
        "reward": None,
        "merged": "",
        "truncated": bool(node.get("truncated")),
        "failures": "",
        "abandoned": "",
        "penalty": "",
        "penalty_title": PENALTY_TITLE,
        "blocks": "",
    }
    if "A" in credit:
        head["credit"] = f"{'V' if view.backup else 'A'} {_fmt(credit['A'])}"
    if dp is not None:
        head["change"] = {"direction": dp[1], "text": f"{_fmt_dp(dp[0])} {DIRECTION_WORDS[dp[1]]}"}
    rewards = node.get("rewards") or []
    if rewards:
        columns = node.get("reward_columns")
        title = ""
        if columns:
            title = "; ".join(
                f"{name}: {', '.join('–' if v is None else f'{v:g}' for v in vals)}" for name, vals in columns.items()
            )
        shown = ", ".join("–" if r is None else f"{r:g}" for r in rewards[:8]) + ("…" if len(rewards) > 8 else "")
        head["reward"] = {
            "outcome": outcome or "",
            "title": title,
            "text": shown,
            "mark": {"rewarded": " ✓", "failed": " ✗"}.get(outcome or "", ""),
        }
    if (node.get("multiplicity") or 0) > 1:
        head["merged"] = int(node["multiplicity"])
    if node.get("tool_failures"):
        head["failures"] = f"{int(node['tool_failures'])} of {int(node.get('tool_calls') or 0)} calls failed"
    if node.get("abandoned"):  # the branch's last turn (docs/design.md §5, environments after a timeout)
        n, m = int(node["abandoned"]), int(node.get("multiplicity") or 0)
        head["abandoned"] = ABANDONED_TITLE + (f"; {n} of the {m} trajectories ending here" if m > 1 else "")
    if node.get("penalty") and view.penalties:  # recorded on every failed call; shown where the credit applies it
        head["penalty"] = f"{node['penalty']:+.2f}"
    if num_children > 1 and node.get("kind") == "search":  # a search's children are its blocks, one after another
        head["blocks"] = num_children
    return head


def _extra(node: dict, num_children: int, credit: dict, sibling) -> list[tuple[str, str, str]]:
    """The node's other numbers, on demand: (class, text, hover title) of each."""
    out = []
    if node.get("kind") == "turn":
        out.append(("badge tok", f"{int(node.get('tokens') or 0)} tok", "tokens of the action"))
    if num_children > 1 and node.get("kind") != "search":
        out.append(("badge branch", f"{num_children} branches", "children after this branch point"))
    start = int(node.get("turn_offset") or 0)
    if node.get("partial"):
        end = start + int(node.get("tokens") or 0)
        out.append(
            (
                "badge cut",
                f"✂ tokens {start}–{end} of the turn",
                "a segment: the assistant turn goes on in the "
                f"children, which branch inside the turn at token {end} (TreeAdv)",
            )
        )
    elif start:
        out.append(
            ("badge cut", f"tokens {start}– of the turn", f"the rest of an assistant turn split at token {start}")
        )
    if node.get("round"):
        out.append(
            (
                "badge round",
                f"round {int(node['round'])}",
                f"created in sampling round {int(node['round'])} (0: the initial trajectories)",
            )
        )
    if node.get("entropy") is not None:
        out.append(("badge ent", f"H {node['entropy']:.2f}", "mean token entropy of the action"))
    if credit.get("q") is not None:
        out.append(("chip q", f"q {_fmt_p(credit['q'])}", "TreeOPSD's teacher probability for the turn"))
    if credit.get("p_after") is not None:
        out.append(("chip p", f"p ½→{_fmt_p_after(credit['p_after'])}", "p = σ(s): ½ under π_old, after the update"))
    if credit.get("logp_old") is not None:
        new = f"→{_fmt(credit['logp_new'], 2)}" if credit.get("logp_new") is not None else ""
        out.append(
            (
                "chip lp",
                f"log π {_fmt(credit['logp_old'], 2)}{new}",
                "mean log-probability of the action's tokens: under π_old" + (" → after the update" if new else ""),
            )
        )
    advantages = node.get("leaf_advantages") or []
    if advantages:
        out.append(
            (
                "badge adv",
                "A_k " + ", ".join(_fmt(a, 2) for a in advantages[:8]) + ("…" if len(advantages) > 8 else ""),
                LEAF_ADVANTAGES_TITLE,
            )
        )
    if sibling is not None and sibling[2]:
        _, _, field, shared = sibling
        out.append(
            (
                "badge dv",
                f"{field} differs after {shared} chars",
                f"where this sibling's {field} first differs from its siblings'",
            )
        )
    return out


# -------------------------------------------------------------------- texts


def _cut_at(text: str, shown: int, view: View) -> tuple[int, int]:
    """(where to cut `text` so that `shown` visible characters come before, the visible length): template tokens
    do not count, and no token is cut in two."""
    visible, pos, cut = 0, 0, None
    for m in view.template.finditer(text):
        segment = m.start() - pos
        if cut is None and visible + segment >= shown:
            cut = pos + (shown - visible)
        visible += segment
        pos = m.end()
    if cut is None and visible + len(text) - pos >= shown:
        cut = pos + (shown - visible)
    visible += len(text) - pos
    return (len(text) if cut is None else cut), visible


def _folded(text: str, cls: str, view: View, shown: int = SHOWN_CHARS) -> dict:
    """A text, folded behind its start (`peek`) when it is long; `peek` None: short, shown whole."""
    cut, visible = _cut_at(text, shown, view)
    if visible <= shown:
        return {"cls": cls, "full": _segments(text, view), "peek": None, "more": 0}
    return {"cls": cls, "full": _segments(text, view), "peek": _segments(text[:cut], view), "more": len(text) - cut}


_NEWLINES = re.compile(r"\n{3,}")


def _segments(text: str, view: View) -> list[tuple[str, object]]:
    """A text for a `<pre>` as (kind, value) segments (`_tools.html`'s `shown`): "text"; "template": the chat
    template's tokens (hidden on the page until its switch shows them), with the template's own line break after
    one; "role": a role header after one (`<|im_start|>user⏎`), shown as a small label; "newlines": a run of 3+ line
    breaks, drawn as one marked line (a model's empty lines would otherwise stretch the node)."""
    out: list[tuple[str, object]] = []

    def plain(part: str):
        pos = 0
        for m in _NEWLINES.finditer(part):
            if m.start() > pos:
                out.append(("text", part[pos : m.start()]))
            out.append(("newlines", len(m.group())))
            pos = m.end()
        if pos < len(part):
            out.append(("text", part[pos:]))

    pos = 0
    for m in view.template.finditer(text):
        plain(text[pos : m.start()])
        hidden, pos = m.group(), m.end()
        role = _ROLE.match(text, pos)
        if role and (text.startswith("\n", role.end()) or view.template.match(text, role.end())):
            newline = "\n" if text.startswith("\n", role.end()) else ""
            out += [("template", hidden), ("role", role.group()), ("template", newline)]
            pos = role.end() + len(newline)
            continue
        if text.startswith("\n", pos):  # the template's own line break after the token
            hidden, pos = hidden + "\n", pos + 1
        out.append(("template", hidden))
    plain(text[pos:])
    return out
