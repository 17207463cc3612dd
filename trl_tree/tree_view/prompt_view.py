"""What one prompt's part of a page shows, as data for the template `_prompt.html`: its button in the prompt list,
its facts (gold answer, reward spread, best and worst leaf, the policy that sampled it, tool calls, the update's
counts), its minimap, and its tree laid out for the template (`_tree_walk`; each node: `node_view.node_part`). Data
and formatting only: the markup is the template's, and every text here is written escaped by it
(`page._escaped`)."""

from __future__ import annotations

from .display import ABANDONED_TITLE, POLICY_TITLE, TAU_TITLE, Budget, View, plain_text, plural, spread_text
from .node_view import node_part


def _policy_text(record: dict) -> str:
    """A record's "version v · staleness s" (either may be unknown: "?"); "" when it has neither."""
    version, staleness = record.get("policy_version"), record.get("staleness")
    if version is None and staleness is None:
        return ""
    return " · ".join(
        f"{name} {'?' if v is None else int(v)}" for name, v in (("version", version), ("staleness", staleness))
    )


def _strip(record: dict, view: View) -> list[int]:
    """The tree's trajectory rewards as levels on the reward scale, lowest first (the spread at a glance); past 48,
    evenly spaced samples (they keep the spread)."""
    rewards = sorted(r for r in record.get("rewards", []) if r is not None)
    if len(rewards) > 48:
        rewards = [rewards[round(i * (len(rewards) - 1) / 47)] for i in range(48)]
    return [view.level(r) for r in rewards]


def _leaf(record: dict, node_id: int, facts: dict, view: View) -> dict:
    """The best or worst leaf in the facts: its id, its label, its reward and the start of its action."""
    node = next((n for n in record.get("nodes", []) if n["id"] == node_id), {})
    value = facts["values"].get(node_id)
    return {
        "id": int(node_id),
        "label": node.get("label") or f"#{node_id}",
        "level": view.level(value),
        "reward": f"{value:.3g}",
        "text": plain_text(node.get("action") or "", view, 90),
    }


def _nav(record: dict, facts: dict, question: str, view: View) -> dict:
    """The prompt's button in the prompt list: its question, gold answer, spread, best and worst leaf, flags."""
    gold = record.get("gold")
    nav = {
        "mixed": int(facts["mixed"]),
        "failed": int(facts["failures"] > 0),
        "question": plain_text(question, view, 110),
        "gold": plain_text(gold, view, 50) if gold else None,
        "spread": spread_text(facts["min"], facts["max"], facts["mean"]),
        "best": None,
        "worst": None,
        "failures": "",
        "updates": "",
    }
    if facts["best"] is not None and facts["mixed"]:
        labels = {
            n["id"]: n.get("label") or f"#{n['id']}"
            for n in record.get("nodes", [])
            if n["id"] in (facts["best"], facts["worst"])
        }
        for which in ("best", "worst"):
            nav[which] = {"label": labels[facts[which]], "reward": f"{facts['values'][facts[which]]:.3g}"}
    if facts["failures"]:
        nav["failures"] = f"{facts['failures']} failed call{'s' * (facts['failures'] != 1)}"
    counts = facts["dp_counts"]
    if sum(counts.values()):
        nav["updates"] = f"↑{counts['toward']} ↓{counts['away']} ={counts['unchanged']}" + (
            f" ○{counts['undirected']}" if counts["undirected"] else ""
        )
    return nav


# -------------------------------------------------------------------- one prompt


def prompt_part(record: dict, x: int, budget: Budget, view: View, facts: dict, question: str) -> dict:
    """One prompt: its button in the prompt list, its facts, its full prompt, its minimap and its tree."""
    nodes = record.get("nodes", [])
    shown_ids = {n["id"] for n in nodes if budget.take(n)}
    children: dict[int, list[dict]] = {}
    for node in nodes:
        if node["id"] in shown_ids:
            children.setdefault(node["parent"], []).append(node)
    per_tree = record.get("per_tree") or {}
    details = [
        {"text": f"K = {record.get('num_leaves')} leaves", "title": ""},
        {"text": f"{record.get('num_turns')} unique turns", "title": ""},
    ]
    if record.get("prompt_tokens") is not None:
        details.append({"text": f"prompt {record['prompt_tokens']} tokens", "title": ""})
    if per_tree.get("tau") is not None:
        details.append({"text": f"τ = {per_tree['tau']:.3f}", "title": TAU_TITLE})
    roots = children.get(-1, [])
    what = "searches" if record.get("kind") == "flex" else "branches"
    return {
        "x": x,
        "kind": record.get("kind", "tree"),
        "question": question,
        "num_leaves": record.get("num_leaves"),
        "nav": _nav(record, facts, question, view),
        "strip": _strip(record, view),
        "facts": _facts(record, nodes, x, facts, view),
        "details": details,
        "roots": f"{len(roots)} {what}" if len(roots) > 1 else "",
        "prompt": record.get("prompt", ""),
        "rewards": " ".join("–" if r is None else f"{r:g}" for r in record.get("rewards", [])),
        "cut": len(nodes) - len(shown_ids),
        "num_nodes": len(nodes),
        "minimap": _minimap(roots, children, facts, view),
        "tree": _tree_walk(roots, children, facts, view),
    }


def _facts(record: dict, nodes: list[dict], x: int, facts: dict, view: View) -> dict:
    """The prompt's facts under its title: the gold answer, the reward spread, the best and worst leaf (or that all
    leaves scored the same), the policy that sampled it, abandoned trajectories, tool calls, the update's counts."""
    spread = spread_text(facts["min"], facts["max"], facts["mean"])
    if facts["std"] is not None and facts["mixed"]:
        spread += f", std {facts['std']:.3g}"
    out = {
        "gold": None,
        "spread": spread,
        "best": None,
        "worst": None,
        "same_rewards": False,
        "policy": _policy_text(record),
        "policy_title": POLICY_TITLE,
        "abandoned": "",
        "abandoned_title": ABANDONED_TITLE,
        "calls": None,
        "updates": None,
    }
    if record.get("gold"):
        out["gold"] = {"label": f"gold ({record.get('gold_column') or 'gold'})", "text": record["gold"]}
    if facts["best"] is not None:
        if facts["mixed"]:
            out["best"], out["worst"] = (_leaf(record, facts[k], facts, view) for k in ("best", "worst"))
        else:
            out["same_rewards"] = True
    abandoned = sum(int(n.get("abandoned") or 0) for n in nodes)
    if abandoned:
        out["abandoned"] = (
            f"{abandoned} {'trajectory' if abandoned == 1 else 'trajectories'} ended by a timed-out environment call"
        )
    if facts["calls"] or facts["failures"]:
        out["calls"] = {
            "count": facts["calls"],
            "failures": facts["failures"],
            "cls": "warn" if facts["failures"] else "",
        }
    counts = facts["dp_counts"]
    if sum(counts.values()):
        out["updates"] = dict(counts, directed=plural(counts["toward"] + counts["away"] + counts["unchanged"], "turn"))
    return out


def _minimap(roots: list[dict], children: dict[int, list[dict]], facts: dict, view: View) -> dict | None:
    """The whole (shown) tree at a glance: one dot per node, rows by depth, leaves side by side, an inner node over
    its children; branch edges blue (`eb`), a chain's continuation grey (`ec`); leaves coloured by reward. Each dot
    links to its node. From the checked numbers only (ids, rewards); None for an empty tree."""
    if not roots:
        return None
    pos: dict[int, tuple[float, int]] = {}
    column, depth_max = 0, 0
    stack = [(node, 0, False) for node in reversed(roots)]
    while stack:  # post-order without recursion (a chain can be deeper than Python's stack)
        node, depth, done = stack.pop()
        kids = children.get(node["id"], [])
        depth_max = max(depth_max, depth)
        if not kids:
            pos[node["id"]] = (column, depth)
            column += 1
        elif done:
            pos[node["id"]] = ((pos[kids[0]["id"]][0] + pos[kids[-1]["id"]][0]) / 2, depth)
        else:
            stack.append((node, depth, True))
            stack.extend((kid, depth + 1, False) for kid in reversed(kids))
    dx = min(max(700 / max(column, 1), 3.0), 18.0)
    dy = min(max(260 / (depth_max + 1), 3.0), 16.0)
    pad = 6.0

    def xy(i):
        c, d = pos[i]
        return f"{pad + (c + 0.5) * dx:.1f}", f"{pad + (d + 0.5) * dy:.1f}"

    edges, dots = [], []
    for parent_id, kids in children.items():
        if parent_id not in pos:
            continue
        x1, y1 = xy(parent_id)
        cls = "eb" if len(kids) > 1 and kids[0].get("kind") != "block" else "ec"
        for kid in kids:
            x2, y2 = xy(kid["id"])
            edges.append({"cls": cls, "x1": x1, "y1": y1, "x2": x2, "y2": y2})
    for node_id in pos:
        cx, cy = xy(node_id)
        value = facts["values"].get(node_id)
        kind = "leaf" if node_id in facts["values"] else ("bp" if len(children.get(node_id, [])) > 1 else "in")
        dots.append(
            {
                "id": int(node_id),
                "cls": kind,
                "cx": cx,
                "cy": cy,
                "level": view.level(value),
                "tip": f"#{int(node_id)}" + (f" · R {value:.3g}" if value is not None else ""),
            }
        )
    return {
        "width": f"{column * dx + 2 * pad:.0f}",
        "height": f"{(depth_max + 1) * dy + 2 * pad:.0f}",
        "radius": f"{min(max(min(dx, dy) * 0.3, 1.5), 5.0):.1f}",
        "edges": edges,
        "dots": dots,
    }


def _divergence(siblings: list[dict]) -> tuple[str, int]:
    """Where siblings first differ: ("action", n) when their actions share their first n characters (n may be 0),
    ("observation", n) when the actions are equal and their observations differ after n characters, ("", 0) when
    their texts are equal (they differ in being a leaf, or a segment)."""
    for field in ("action", "observation"):
        texts = [s.get(field) or "" for s in siblings]
        if len(set(texts)) > 1:
            shared = len(texts[0])
            for t in texts[1:]:
                shared = min(shared, len(t))
                for i in range(shared):
                    if t[i] != texts[0][i]:
                        shared = i
                        break
            return field, shared
    return "", 0


def _tree_walk(roots: list[dict], children: dict[int, list[dict]], facts: dict, view: View) -> list[tuple]:
    """The tree as the template draws it, a flat list of (step, value) (`_node.html`'s `tree`): siblings side by
    side under a branch point ("branches" … "/branches", an "item" each, marked ↳ i/n with where its text first
    differs from theirs), a chain of single children straight down ("chain", its "node"s, then its last node's
    children in a "sub"). Built with a stack of what is left to do, not recursion: a tree can be deeper than
    Python's (and Jinja's) stack."""
    out: list[tuple] = []
    todo: list[tuple] = [("siblings", roots)]
    while todo:
        task, value, *sibling = todo.pop()
        if task == "emit":
            out.append(value)
        elif task == "siblings":
            if len(value) == 1:
                todo.append(("chain", value[0], None))
            elif value:
                blocks = value[0].get("kind") == "block"  # a search's blocks come one after the other
                field, shared = ("", 0) if blocks else _divergence(value)
                out.append(("branches", blocks))
                todo.append(("emit", ("/branches", None)))
                for i in reversed(range(len(value))):
                    info = None if blocks else (i + 1, len(value), field, shared)
                    todo.extend([("emit", ("/item", None)), ("chain", value[i], info), ("emit", ("item", None))])
        else:  # a chain: the node and its single children, then the last one's children
            node, info = value, sibling[0]
            out.append(("chain", None))
            while True:
                kids = children.get(node["id"], [])
                out.append(("node", node_part(node, len(kids), facts, view, info)))
                info = None
                if len(kids) != 1:
                    todo.append(("emit", ("/chain", None)))
                    if kids:
                        todo.extend([("emit", ("/sub", None)), ("siblings", kids), ("emit", ("sub", None))])
                    break
                node = kids[0]
    return out
