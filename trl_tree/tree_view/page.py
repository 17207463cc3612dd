"""The page: pure string building from checked page data (`checks.checked_page`), no network, no external scripts or
fonts. The HTML skeleton, the stylesheet and the script are package data (`assets/page.html`, `assets/view.css`,
`assets/view.js`), inlined into every page so that a page is one self-contained file; the body is built here: inline
SVG for the minimap, `<details>` for long texts, every text of the data through `_esc` (`clean_text` then
`html.escape`) and every attribute from checked numbers. The script reads nothing but the page's own attributes and
text, and builds no HTML (it sets classes and `textContent`); without it every prompt is shown, unfolded.

Per turn the node shows first what a reader needs at a glance: its credit (the node is coloured by its sign) and
what the update did to it (Δp and its direction), a leaf's reward, and the warnings (truncated, failed tool calls);
the rest (tokens, round, entropy, q, p, log π, where siblings differ) is on demand: hover the node's id, or click
the node (or "all numbers") to expand it. The legend is written from the same tables and counts as the nodes
(`facts.CREDIT_SIGNS`, `facts.DIRECTIONS`)."""

from __future__ import annotations

import html
import json
import re
from importlib import resources
from string import Template

from .checks import checked_page
from .facts import (
    CREDIT_SIGNS,
    DIRECTION_MARKS,
    DIRECTIONS,
    UNCHANGED_DP,
    ZERO_CREDIT,
    analyse,
    leaf_values,
    record_question,
    short_questions,
)
from .records import BACKUP_CREDITS, MAX_CHARS, MAX_NODES, PAGE_NAME, SHOWN_CHARS
from .text import clean_text


def _asset(name: str) -> str:
    return resources.files(__package__).joinpath("assets", name).read_text(encoding="utf-8")


STYLE = _asset("view.css")  # the page's stylesheet, inlined in a <style>
SCRIPT = _asset("view.js")  # the page's script, inlined in a <script>: the only script a page has
_SKELETON = Template(_asset("page.html"))
# inlined raw text must not end its element early
assert "</style" not in STYLE.lower() and "</script" not in SCRIPT.lower() and "<!--" not in SCRIPT


def _document(title: str, body_class: str, body: str) -> str:
    """A whole page: the skeleton with its title, the stylesheet, the body (HTML built here) and the script."""
    return _SKELETON.substitute(title=_esc(title), style=STYLE, body_class=body_class, body=body, script=SCRIPT)


# ------------------------------------------------------------------------------------------------------ the index


def render_index(entries: list[dict], unreadable: list[tuple[str, str]] = ()) -> str:
    """The run's index page: how many generation batches a page stands for, then one block per saved page (its step
    and batch, linked) with a row per prompt (question, gold answer, reward spread, failed tool calls, the turns'
    update directions), filters and a search box; `unreadable`: (file name, why) of saved files left out."""
    esc = _esc
    rows, total = [], 0
    for entry in entries:
        name = entry["name"] if PAGE_NAME.fullmatch(entry["name"]) else None
        href = f"{name}.html" if name else None
        label = f"{entry['mode']} step {entry['step']}"
        prompts = entry["prompts"]
        mixed = sum(p["mixed"] for p in prompts)
        failed = sum(1 for p in prompts if p["failures"])
        counts = {k: sum(p.get(k) or 0 for p in prompts) for k in DIRECTIONS}
        head = (f'<a href="{esc(href)}">{esc(label)}</a>' if href else esc(label))
        batch = f"generation batch {entry['batch']}" if entry.get("batch") else ""
        parts = [batch, _plural(len(prompts), "prompt"), f"{mixed} with mixed rewards",
                 f"{_plural(failed, 'prompt')} with failed or malformed tool calls"]
        if any(counts.values()):
            parts.append(_directions_text(counts))
        parts.append(entry["method"])
        rows.append(f'<tr class="stephead"><th colspan="8">{head} <span class="mut">· '
                    f'{esc(" · ".join(p for p in parts if p))}</span></th></tr>')
        for p in prompts:
            total += 1
            link = f'<a href="{esc(href)}#prompt-{p["x"]}">#{p["x"]}</a>' if href else f"#{p['x']}"
            spread = _spread_text(p["min"], p["max"], p["mean"])
            directed = sum(p.get(k) or 0 for k in DIRECTIONS[:3])
            dp_cell = f"{p['toward']} / {p['away']} / {p['unchanged']}" if directed else ""
            rows.append(
                f'<tr class="row" data-mixed="{p["mixed"]}" data-failed="{int(p["failures"] > 0)}">'
                f"<td>{esc(label)}</td><td>{link}</td><td class=\"qcell\">{esc(p['question'])}</td>"
                f"<td>{esc(p['gold'])}</td><td>{esc(spread)} <span class=\"mut\">({p['leaves']} leaves)</span></td>"
                f"<td>{p['failures'] or ''}</td><td>{esc(dp_cell)}</td><td>{p.get('undirected') or ''}</td></tr>")
    method = entries[-1]["method"] if entries else ""
    title = f"{method} rollout trees · {_plural(len(entries), 'page')}" if entries else "rollout trees · no pages yet"
    tools = _filter_tools("search questions and gold answers")
    missing = ""
    if unreadable:
        missing = ('<div class="cutnote unreadable"><b>Not shown: ' + esc(_plural(len(unreadable), "saved file"))
                   + " could not be read</b> (a run stopped while writing leaves its last file half-written):<ul>"
                   + "".join(f"<li><code>{esc(name)}</code>: {esc(why)}</li>" for name, why in unreadable)
                   + "</ul></div>")
    body = "".join([
        f"<header><h1>{esc(title)}</h1><p class=\"summary\">{esc(_batches_text(entries))} "
        f"{esc(_plural(total, 'prompt'))}. Each row links to its prompt on its step's page; a page links to the steps "
        "before and after it.</p>", _directions_legend(entries), tools, missing, "</header>",
        "<main><table class=\"index\"><thead><tr><th>step</th><th>prompt</th><th>question</th><th>gold</th>"
        "<th>reward</th><th>failed calls</th><th title=\"turns with a direction: toward / away / unchanged\">"
        "update ↑ toward / ↓ away / = unchanged</th><th title=\"turns without a direction (zero credit), counted "
        "apart\">○ undirected</th></tr></thead><tbody>",
        "".join(rows), "</tbody></table></main>",
    ])
    return _document(title, "nojs indexpage", body)


def _plural(n: int, word: str) -> str:
    return f"{n} {word}" + ("" if n == 1 else "s")


def _batches_text(entries: list[dict]) -> str:
    """What a page of the run stands for: one generation batch (pages saved since pages follow batches), or, for
    pages saved by an older trl-tree at logging steps, the last batch before each log."""
    if not entries:
        return ""
    if all(e.get("batches") == 1 for e in entries):
        return "One page per generation batch (each page: 1 batch, after its last optimizer step)."
    return ("Pages saved at logging steps by an older trl-tree: each shows the last generation batch before its log, "
            "so a page may stand for several batches of which only the last is shown.")


def _directions_text(counts: dict) -> str:
    """The update's directions as counted on a page: the directed turns, then the undirected ones apart."""
    directed = counts["toward"] + counts["away"] + counts["unchanged"]
    text = (f"update of {_plural(directed, 'turn')} with a direction: {counts['toward']} toward, "
            f"{counts['away']} away, {counts['unchanged']} unchanged")
    if counts["undirected"]:
        text += f"; {counts['undirected']} undirected (zero credit) not counted"
    return text


def _direction_meanings(treeopsd: bool) -> dict[str, str]:
    """What each direction means, TreeOPSD's (relative to its teacher q) or the other losses' (to the credit's
    sign): the legend and the index say this, and `facts.turn_update` decides it."""
    if treeopsd:
        return {
            "toward": "p ended closer to the turn's teacher q than ½ was",
            "away": "p ended farther from q than ½ was (overshooting q counts as away)",
            "unchanged": f"|Δp| < {UNCHANGED_DP:g}",
            "undirected": f"q = ½ (zero credit, |q − ½| < {ZERO_CREDIT:g}): no target to move toward, so not counted "
                          "toward or away; the shared weights still move it",
        }
    return {
        "toward": "p moved the way the credit's sign asks (up for credit > 0, down for credit < 0)",
        "away": "p moved the other way",
        "unchanged": f"|Δp| < {UNCHANGED_DP:g}",
        "undirected": f"zero credit (|credit| < {ZERO_CREDIT:g}): no direction asked, so not counted toward or away",
    }


def _directions_legend(entries: list[dict]) -> str:
    if not any(p.get(k) for e in entries for p in e["prompts"] for k in DIRECTIONS):
        return ""
    treeopsd = any("treeopsd" in e["method"].lower() for e in entries)
    meanings = _direction_meanings(treeopsd)
    items = "".join(f"<li><b>{DIRECTION_MARKS[d]} {d}</b>: {_esc(meanings[d])}</li>" for d in DIRECTIONS)
    return (f'<details class="legend"><summary>what the update counts mean</summary><ul>'
            f"<li>p = σ(s), s the mean log-ratio of a turn's tokens after the update against π_old (½ before it); "
            f"Δp = p − ½</li>{items}</ul></details>")


def _filter_tools(placeholder: str) -> str:
    """The search box and the two filters (shown only with JavaScript, which applies them)."""
    return (f'<div class="tools"><input type="search" id="search" placeholder="{_esc(placeholder)}" '
            'aria-label="search"> <label><input type="checkbox" id="f-mixed"> mixed rewards</label> '
            '<label title="a turn whose tool call failed or could not be parsed (or a TreeFlex process penalty)">'
            '<input type="checkbox" id="f-failed"> failed or malformed tool calls</label> '
            '<span class="mut" id="shown-count"></span></div>')




# ------------------------------------------------------------------------------------------------------ the page


def render_page(data: dict, *, max_nodes: int = MAX_NODES, max_chars: int = MAX_CHARS,
                links: dict | None = None) -> str:
    """The HTML page of `data` (`page_data`). Nodes past `max_nodes`, or past `max_chars` characters of text, are cut
    in depth-first order (a shown node's ancestors are always shown) and a note on the page says how many.

    `links`: the run's index and the pages before and after this one (`save_page` and `render_run` pass them; a page
    for a tracker has none, since its files are not beside it there).

    Raises:
        ValueError: a number of the data is not a number (or a list or record is not one), naming where.
    """
    data = checked_page(data)
    view = _View(data)
    budget = _Budget(max_nodes, max_chars)
    records = data.get("prompts", [])
    analyses = [analyse(record) for record in records]
    questions = short_questions([record_question(r) for r in records])
    sections, nav = [], []
    for x, (record, facts) in enumerate(zip(records, analyses)):
        sections.append(_render_prompt(record, x, budget, view, facts, questions[x]))
        nav.append(_nav_entry(record, x, facts, questions[x], view))
    esc = _esc
    title = f"{data.get('method', '')} rollout trees · {data.get('mode', 'train')} step {data.get('step', 0)}"
    cut = ""
    if budget.cut_nodes:
        cut = (f'<p class="cutnote">This page is cut: {budget.cut_nodes} of {budget.total_nodes} nodes are not shown '
               f"(limits: {max_nodes} nodes, {max_chars} characters of text per page). The saved JSON has every node;"
               " render it with other limits: <code>trl-tree view RUN_DIR --max-nodes N --max-chars N</code>.</p>")
    leafnav = ('<div class="leafnav"><button type="button" id="next-rewarded">next rewarded leaf ▸</button>'
               '<button type="button" id="next-failed">next failed leaf ▸</button>'
               '<span class="mut" id="leafpos"></span><span class="switches"><label title="every turn\'s other '
               'numbers (tokens, round, q, p, log π, …); one turn\'s: click it, or hover its id">'
               '<input type="checkbox" id="all-numbers"> all numbers</label> <label class="tpltoggle" title="the '
               'chat template\'s special tokens (&lt;|im_start|&gt;, &lt;|im_end|&gt;, …): hidden in the texts shown, '
               'kept in the data"><input type="checkbox" id="show-tpl"> show template tokens</label></span></div>')
    body = "".join([
        f"<header><div class=\"titlebar\"><h1>{esc(title)}</h1>{_step_links(links)}</div>",
        _page_summary_line(records, analyses, data), _key(data, analyses, view), _legend(data, view, analyses), cut,
        "</header>",
        "<div class=\"main\"><nav class=\"prompts\">", _filter_tools("search questions, actions, observations"),
        "<div class=\"navtitle\">prompts</div><div class=\"navlist\">", "".join(nav), "</div></nav>",
        "<main>", leafnav, "".join(sections), "</main></div>",
    ])
    return _document(title, "nojs", body)


def _step_links(links: dict | None) -> str:
    if not links:
        return ""
    parts = []
    for key, arrow in (("prev", "◀ "), ("index", ""), ("next", "")):
        if key == "index":
            parts.append(f'<a class="steplink" href="{_esc(links["index"])}">all steps</a>')
        elif links.get(key) and PAGE_NAME.fullmatch(links[key]):
            text = f"{arrow}{links.get(f'{key}_label', links[key])}" + (" ▶" if key == "next" else "")
            parts.append(f'<a class="steplink" rel="{key}" href="{_esc(links[key])}.html">{_esc(text)}</a>')
        else:
            parts.append(f'<span class="steplink off">{"◀ first page" if key == "prev" else "last page ▶"}</span>')
    return '<nav class="steps">' + "".join(parts) + "</nav>"


# -------------------------------------------------------------------- what the page derives from the data


class _View:
    """Page-wide rendering settings derived from the data: the reward colour scale and the template tokens."""

    def __init__(self, data: dict):
        self.credit = data.get("credit", "")
        self.backup = self.credit in BACKUP_CREDITS
        values = [v for record in data.get("prompts", []) for v in leaf_values(record).values() if v is not None]
        if values and 0.0 <= min(values) and max(values) <= 1.0:
            self.low, self.high = 0.0, 1.0  # a [0, 1] reward keeps its absolute meaning: 0 red, 1 green
        elif values:
            self.low, self.high = min(values), max(values)
        else:
            self.low = self.high = 0.0
        # only markup-like tokens (<|im_end|>, </s>, [INST]): a tampered file's "a" must not hide every "a"
        tokens = [t for t in data.get("special_tokens", []) if len(t) >= 3 and t[0] in "<[" and t[-1] in ">]"]
        self.template = (re.compile("|".join(re.escape(t) for t in sorted(tokens, key=len, reverse=True)))
                         if tokens else _TEMPLATE_FALLBACK)

    def hue(self, value: float | None) -> int | None:
        """Red (0) at the scale's low end to green (120) at its high end; None: no reward, no colour."""
        if value is None:
            return None
        if self.high <= self.low:
            return 60
        return round(120 * min(max((value - self.low) / (self.high - self.low), 0.0), 1.0))


# Without the tokenizer's list (older files): `<|name|>` tokens (Qwen, Llama 3, Phi, …)
_TEMPLATE_FALLBACK = re.compile(r"<\|[A-Za-z0-9_.:\-]{1,40}\|>")
_ROLE = re.compile(r"[A-Za-z][A-Za-z0-9_\-]{0,19}")


def _spread_text(low, high, mean) -> str:
    if low is None:
        return "no scored leaf"
    if high == low:
        return f"R {low:.3g} (all leaves)"
    return f"R {low:.3g}…{high:.3g}, mean {mean:.3g}"


def _plain(text: str, view: _View, limit: int) -> str:
    """A one-line plain version of a text (template tokens out), for the prompt list and the facts."""
    text = view.template.sub(" ", text)
    text = " ".join(text.split())
    return text[:limit] + ("…" if len(text) > limit else "")


def _fmt_dp(dp: float) -> str:
    """Δp signed, with enough digits for a realistic learning rate's 1e-5 (0.00001 would print as +0.000)."""
    if dp == 0:
        return "±0"
    return f"{dp:+.4f}" if abs(dp) >= 1e-3 else f"{dp:+.2e}"


def _fmt_p_after(p: float) -> str:
    return f"{p:.3f}" if abs(p - 0.5) >= 1e-2 else f"{p:.6f}"


# -------------------------------------------------------------------- header, legend, prompt list


def _page_summary_line(records: list[dict], analyses: list[dict], data: dict) -> str:
    mixed = sum(a["mixed"] for a in analyses)
    failed = sum(1 for a in analyses if a["failures"])
    parts = [_plural(len(records), "prompt"), f"{mixed} with mixed rewards",
             f"{_plural(failed, 'prompt')} with failed or malformed tool calls"]
    if data.get("batch"):
        parts.insert(0, f"generation batch {data['batch']}")
    return f'<p class="summary">{_esc(" · ".join(parts))}</p>'


def _is_treeopsd(analyses_or_nodes) -> bool:
    return any("q" in (n.get("credit") or {}) for n in analyses_or_nodes)


def _key(data: dict, analyses: list[dict], view: _View) -> str:
    """The always-visible key, written from the page's own counts and the very classes its nodes carry: the credit
    signs (a swatch of each colour, with how many turns have it), the leaf reward scale, and the update's
    directions (the chip of each, with how many turns, the undirected ones apart)."""
    signs = {cls: sum(a["sign_counts"][cls] for a in analyses) for cls, _ in CREDIT_SIGNS}
    name = "V" if view.backup else "A"
    short = {"pos": f"{name} &gt; 0", "neg": f"{name} &lt; 0", "zero": f"{name} = 0"}
    items = []
    if any(signs.values()):
        items.append('<span class="keygroup"><b>credit</b> ' + " ".join(
            f'<span class="keyitem" data-sign="{cls}" title="{_esc(what)}"><i class="swatch {cls}"></i>{short[cls]} '
            f'<span class="n">{signs[cls]}</span></span>' for cls, what in CREDIT_SIGNS) + "</span>")
    scale = (f"{view.low:.3g}" + "–" + f"{view.high:.3g}") if view.high > view.low else "–"
    items.append(f'<span class="keygroup"><b>leaf reward</b> <span class="scale"></span> {_esc(scale)}</span>')
    counts = {k: sum(a["dp_counts"][k] for a in analyses) for k in DIRECTIONS}
    if any(counts.values()):
        meanings = _direction_meanings(any(_is_treeopsd(r.get("nodes", [])) for r in data.get("prompts", [])))
        directed = counts["toward"] + counts["away"] + counts["unchanged"]
        items.append(f'<span class="keygroup"><b>update (Δp) of {_plural(directed, "turn")} with a direction</b> '
                     + " ".join(f'<span class="keyitem" data-dir="{d}" title="{_esc(meanings[d])}"><span class="chip dir '
                                f'{d}">{d}</span> <span class="n">{counts[d]}</span></span>'
                                for d in DIRECTIONS[:3])
                     + f'; <span class="keyitem" data-dir="undirected" title="{_esc(meanings["undirected"])}">'
                       f'<span class="chip dir undirected">undirected</span> <span class="n">'
                       f'{counts["undirected"]}</span> apart</span></span>')
    return '<p class="key">' + " ".join(items) + "</p>"


def _legend(data: dict, view: _View, analyses: list[dict]) -> str:
    credit = data.get("credit", "")
    nodes = [n for r in data.get("prompts", []) for n in r.get("nodes", [])]
    name = "V" if view.backup else "A"
    parts = [
        (f"<b>{name}</b>: the turn's value backed up from the leaves, which the loss uses as its advantage"
         if view.backup else f"<b>{name}</b>: the turn's advantage as the loss uses it")
        + (f" (credit <code>{_esc(credit)}</code>)" if credit else "") + ". The node's colour is its sign: "
        + "; ".join(f'<i class="swatch {cls}"></i> {_esc(what)}' for cls, what in CREDIT_SIGNS),
        "<b>leaf reward</b>: R on its chip, coloured on the reward scale above (the bar under the leaf too); <b>✓ "
        "rewarded</b>: a reward above 0 and at least its tree's mean; <b>✗ failed</b>: the others",
        "<b>×m</b>: m trajectories ended in this merged leaf",
        "<b>↓</b>: the same trajectory goes on; <b>↳ i/n</b>: one of n siblings after a branch point, with where "
        "its text first differs from theirs (marked)",
        "<b>the other numbers</b> of a turn (tokens, sampling round, entropy H, q, p, log π, the leaves' standardised "
        "rewards A<sub>k</sub>): hover its id, click it (which also highlights its path from the root, in the minimap "
        "too), or tick “all numbers”",
        "<b>log π</b>: the mean log-probability of the action's tokens, under π_old → after the update",
        "the chat template's special tokens are hidden in the texts (the data keeps them; “show template tokens”)",
    ]
    if any(n.get("entropy") is not None for n in nodes):
        parts.append("<b>H</b>: the action's mean token entropy at generation")
    if any(a["dp"] for a in analyses):
        treeopsd = _is_treeopsd(nodes)
        meanings = _direction_meanings(treeopsd)
        parts.append(
            ("<b>q</b>: TreeOPSD's teacher probability for the turn (½ + V/τ). " if treeopsd else "")
            + "<b>Δp</b> = p − ½, p = σ(s), s the mean log-ratio of the turn's tokens after the update against π_old "
            "(½ before it): what this batch's update did to each turn, measured after it. "
            + "; ".join(f"<b>{d}</b>: {_esc(meanings[d])}" for d in DIRECTIONS))
    note = data.get("after_note")
    if note:
        parts.append(f"<i>{_esc(note)}</i>")
    return ('<details class="legend"><summary>how to read this page</summary><ul>'
            + "".join(f"<li>{p}</li>" for p in parts) + "</ul></details>")


def _strip(record: dict, view: _View) -> str:
    """The tree's trajectory rewards as a strip of coloured cells, lowest first (the spread at a glance)."""
    rewards = sorted(r for r in record.get("rewards", []) if r is not None)
    if len(rewards) > 48:  # evenly spaced samples keep the spread
        rewards = [rewards[round(i * (len(rewards) - 1) / 47)] for i in range(48)]
    cells = "".join(f'<i style="--rh:{view.hue(r)}"></i>' for r in rewards)
    return f'<span class="strip" aria-hidden="true">{cells}</span>'


def _leaf_label(record: dict, node_id: int | None, facts: dict, view: _View, x: int, with_text: bool) -> str:
    if node_id is None:
        return ""
    node = next((n for n in record.get("nodes", []) if n["id"] == node_id), {})
    value = facts["values"].get(node_id)
    name = node.get("label") or f"#{node_id}"
    text = _plain(node.get("action") or "", view, 90) if with_text else ""
    return (f'<a class="leaflink" href="#n-{x}-{int(node_id)}" data-ref="{int(node_id)}">{_esc(name)}</a> '
            f'<span class="rv" style="--rh:{view.hue(value)}">R {_esc(f"{value:.3g}")}</span>'
            + (f' <span class="snip">{_esc(text)}</span>' if text else ""))


def _nav_entry(record: dict, x: int, facts: dict, question: str, view: _View) -> str:
    label = _plain(question, view, 110)
    gold = record.get("gold")
    lines = [f'<span class="q"><span class="num">#{x}</span> {_esc(label)}</span>']
    if gold:
        lines.append(f'<span class="gold">gold: {_esc(_plain(gold, view, 50))}</span>')
    lines.append(f'<span class="sub">{_strip(record, view)} {_esc(_spread_text(facts["min"], facts["max"], facts["mean"]))}'
                 f' · K={_esc(record.get("num_leaves"))}</span>')
    if facts["best"] is not None and facts["mixed"]:
        labels = {n["id"]: n.get("label") or f"#{n['id']}" for n in record.get("nodes", [])
                  if n["id"] in (facts["best"], facts["worst"])}
        best, worst = facts["values"][facts["best"]], facts["values"][facts["worst"]]
        lines.append(f'<span class="sub">best {_esc(labels[facts["best"]])} ({best:.3g}) · worst '
                     f'{_esc(labels[facts["worst"]])} ({worst:.3g})</span>')
    flags = []
    if facts["failures"]:
        flags.append(f'<span class="flag warn">{facts["failures"]} failed call{"s" * (facts["failures"] != 1)}</span>')
    counts = facts["dp_counts"]
    if sum(counts.values()):
        flags.append(f'<span class="flag dp" title="update: toward / away / unchanged, undirected apart">'
                     f'↑{counts["toward"]} ↓{counts["away"]} ={counts["unchanged"]}'
                     + (f' ○{counts["undirected"]}' if counts["undirected"] else "") + "</span>")
    if flags:
        lines.append('<span class="sub">' + " ".join(flags) + "</span>")
    return (f'<button type="button" class="navbtn" data-target="prompt-{x}" data-mixed="{int(facts["mixed"])}" '
            f'data-failed="{int(facts["failures"] > 0)}">' + "".join(lines) + "</button>")


# -------------------------------------------------------------------- one prompt


def _render_prompt(record: dict, x: int, budget: _Budget, view: _View, facts: dict, question: str) -> str:
    nodes = record.get("nodes", [])
    shown_ids = {n["id"] for n in nodes if budget.take(n)}
    children: dict[int, list[dict]] = {}
    for node in nodes:
        if node["id"] in shown_ids:
            children.setdefault(node["parent"], []).append(node)
    per_tree = record.get("per_tree") or {}
    details = [f"K = {record.get('num_leaves')} leaves", f"{record.get('num_turns')} unique turns"]
    if record.get("prompt_tokens") is not None:
        details.append(f"prompt {record['prompt_tokens']} tokens")
    if per_tree.get("tau") is not None:
        details.append(f"τ = {per_tree['tau']:.3f}")
    rewards = " ".join("–" if r is None else f"{r:g}" for r in record.get("rewards", []))
    missing = len(nodes) - len(shown_ids)
    cut = f'<p class="cutnote">{missing} of {len(nodes)} nodes of this prompt are cut.</p>' if missing else ""
    roots = children.get(-1, [])
    what = "searches" if record.get("kind") == "flex" else "branches"
    root_branch = f' <span class="badge branch">{len(roots)} {what}</span>' if len(roots) > 1 else ""
    facts_html = []
    if record.get("gold"):
        column = record.get("gold_column") or "gold"
        facts_html.append(_fact(f"gold ({column})", f'<b class="goldtext">{_esc(record["gold"])}</b>'))
    spread = _spread_text(facts["min"], facts["max"], facts["mean"])
    if facts["std"] is not None and facts["mixed"]:
        spread += f", std {facts['std']:.3g}"
    facts_html.append(_fact("reward", f"{_strip(record, view)} {_esc(spread)} over {_esc(record.get('num_leaves'))} "
                                      "leaves"))
    if facts["best"] is not None:
        if facts["mixed"]:
            facts_html.append(_fact("best leaf", _leaf_label(record, facts["best"], facts, view, x, True)))
            facts_html.append(_fact("worst leaf", _leaf_label(record, facts["worst"], facts, view, x, True)))
        else:
            facts_html.append(_fact("leaves", "every leaf has the same reward: no learning signal from this tree"))
    if facts["calls"] or facts["failures"]:
        facts_html.append(_fact("tool calls", f'{facts["calls"]} on its unique turns, <b class="'
                                f'{"warn" if facts["failures"] else ""}">{facts["failures"]} failed or malformed</b>'))
    counts = facts["dp_counts"]
    if sum(counts.values()):
        directed = counts["toward"] + counts["away"] + counts["unchanged"]
        facts_html.append(_fact("update (Δp)", f"{_plural(directed, 'turn')} with a direction: "
                                f'<b class="toward">{counts["toward"]} toward</b> · <b class="away">'
                                f'{counts["away"]} away</b> · <b class="unchanged">{counts["unchanged"]} unchanged</b>'
                                + (f' · <span class="mut">{counts["undirected"]} undirected (zero credit), not '
                                   "counted</span>" if counts["undirected"] else "")))
    body = [
        f'<section class="prompt" id="prompt-{x}" data-prompt="{x}">',
        f'<h2><span class="num">#{x}</span> <span class="kind">{_esc(record.get("kind", "tree"))}</span> '
        f'<span class="qtext">{_esc(question)}</span></h2>',
        '<div class="facts">', "".join(facts_html), "</div>",
        f'<details class="prompttext"><summary>full prompt{root_branch} · {_esc(" · ".join(details))} · rewards: '
        f'{_esc(rewards)}</summary><pre>{_esc(record.get("prompt", ""))}</pre></details>',
        cut, _minimap(roots, children, x, facts, view),
        '<div class="tree">', _render_children(roots, children, x, facts, view), "</div></section>",
    ]
    return "".join(body)


def _fact(label: str, value: str) -> str:
    """One line of the prompt's facts: a label (escaped here) and its value (HTML built by the caller)."""
    return f'<div class="fact"><span class="lbl">{_esc(label)}</span><span class="val">{value}</span></div>'


def _minimap(roots: list[dict], children: dict[int, list[dict]], x: int, facts: dict, view: _View) -> str:
    """The whole (shown) tree at a glance, as inline SVG: one dot per node, rows by depth, leaves side by side, an
    inner node over its children; branch edges blue, a chain's continuation grey; leaves coloured by reward. Each
    dot links to its node. Built from the checked numbers only (ids, rewards)."""
    if not roots:
        return ""
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
    width, height = column * dx + 2 * pad, (depth_max + 1) * dy + 2 * pad
    radius = min(max(min(dx, dy) * 0.3, 1.5), 5.0)

    def xy(i):
        c, d = pos[i]
        return pad + (c + 0.5) * dx, pad + (d + 0.5) * dy

    edges, dots = [], []
    for parent_id, kids in children.items():
        if parent_id not in pos:
            continue
        px, py = xy(parent_id)
        cls = "eb" if len(kids) > 1 and kids[0].get("kind") != "block" else "ec"
        for kid in kids:
            cx, cy = xy(kid["id"])
            edges.append(f'<line class="{cls}" x1="{px:.1f}" y1="{py:.1f}" x2="{cx:.1f}" y2="{cy:.1f}"/>')
    for node_id in pos:
        node_x, node_y = xy(node_id)
        value = facts["values"].get(node_id)
        kind = "leaf" if node_id in facts["values"] else ("bp" if len(children.get(node_id, [])) > 1 else "in")
        style = f' style="--rh:{view.hue(value)}"' if value is not None else ""
        tip = f"#{int(node_id)}" + (f" · R {value:.3g}" if value is not None else "")
        dots.append(f'<a href="#n-{x}-{int(node_id)}" data-ref="{int(node_id)}"><circle class="{kind}" '
                    f'cx="{node_x:.1f}" cy="{node_y:.1f}" r="{radius:.1f}"{style}><title>{_esc(tip)}</title>'
                    "</circle></a>")
    return (f'<svg class="minimap" viewBox="0 0 {width:.0f} {height:.0f}" width="{width:.0f}" height="{height:.0f}" '
            f'role="img" aria-label="minimap of the tree">{"".join(edges)}{"".join(dots)}</svg>')


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


def _render_children(siblings: list[dict], children: dict[int, list[dict]], x: int, facts: dict,
                     view: _View) -> str:
    """Siblings side by side under a branch point (`<ul>`), each marked ↳ i/n with where its text first differs
    from theirs; a chain of single children is drawn straight down (↓)."""
    if not siblings:
        return ""
    if len(siblings) == 1:
        return _render_chain(siblings[0], children, x, facts, view, None)
    if siblings[0].get("kind") == "block":  # a search's blocks come one after the other: no siblings to compare
        items = "".join(f"<li>{_render_chain(node, children, x, facts, view, None)}</li>" for node in siblings)
        return f'<ul class="branches blocks">{items}</ul>'
    field, shared = _divergence(siblings)
    items = "".join(
        f"<li>{_render_chain(node, children, x, facts, view, (i + 1, len(siblings), field, shared))}</li>"
        for i, node in enumerate(siblings))
    return f'<ul class="branches">{items}</ul>'


def _render_chain(node: dict, children: dict[int, list[dict]], x: int, facts: dict, view: _View, sibling) -> str:
    out = []
    while True:
        kids = children.get(node["id"], [])
        out.append(_render_node(node, len(kids), x, facts, view, sibling))
        sibling = None
        if len(kids) != 1:
            if kids:
                out.append(f'<div class="sub">{_render_children(kids, children, x, facts, view)}</div>')
            return '<div class="chain">' + "".join(out) + "</div>"
        node = kids[0]


def _render_node(node: dict, num_children: int, x: int, facts: dict, view: _View, sibling=None) -> str:
    """One node: its head (what a reader needs first: the credit, coloured by its sign, what the update did, a leaf's
    reward, the warnings), its other numbers (`.extra`: shown on click, with "all numbers", and as the id's hover
    text), then its texts."""
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
    attrs = [f'class="{_esc(" ".join(classes))}"', f'data-kind="{_esc(kind)}"', f'id="n-{x}-{node_id}"',
             f'data-node="{node_id}"', f'data-parent="{int(node.get("parent", -1))}"']
    if sign is not None:
        attrs.append(f'data-sign="{sign}"')
    if kind == "turn":
        attrs.append(f'data-multiplicity="{int(node.get("multiplicity") or 0)}"')
        if node.get("round") is not None:
            attrs.append(f'data-round="{int(node["round"])}"')
        if node.get("partial"):
            attrs.append('data-partial="1"')
    if outcome:
        attrs.append(f'data-outcome="{outcome}"')
    dp = facts["dp"].get(node_id)
    if dp:
        attrs.append(f'data-dp="{dp[0]!r}" data-dir="{dp[1]}"')
    for key, number in credit.items():
        if number is not None:
            attrs.append(f'data-{_attribute_name(key)}="{float(number)!r}"')
    if node.get("rewards"):
        attrs.append(f'data-rewards="{_esc(json.dumps(node["rewards"]))}"')
    style_attr = f' style="--rh:{view.hue(value)}"' if value is not None else ""
    extra = _extra(node, num_children, credit, sibling)
    head = []
    if sibling is not None:
        i, n, _, _ = sibling
        head.append(f'<span class="badge sib" title="one of the {n} siblings after a branch point">↳ {i}/{n}</span>')
    tip = " · ".join(text for _, text, _ in extra)
    head.append(f'<span class="nid" title="{_esc(tip)}">{_esc(node.get("label") or "#" + str(node_id))}</span>')
    head += _first(node, num_children, credit, view.backup, dp, outcome)
    body, inline = [], None
    if sibling is not None and sibling[2]:
        _, _, field, shared = sibling
        text = node.get(field) or ""
        if field == "action" and _cut_at(text, SHOWN_CHARS, view)[1] <= SHOWN_CHARS:
            inline = shared  # short: the action itself shows the shared start dimmed and the rest marked
        else:
            body.append(_divergence_note(node, sibling, view))
    if kind == "block":
        body.append(f'<div class="ctx"><span class="lbl">context ({int(node.get("context_tokens") or 0)} tokens)'
                    f"</span>{_folded(node.get('context', ''), 'ctxtext', view)}</div>")
    if node.get("action") and inline is not None:
        action = node["action"]
        body.append(f'<pre class="action diverging"><span class="same">{_display(action[:inline], view)}</span>'
                    f"<mark>{_display(action[inline:], view)}</mark></pre>")
    elif node.get("action"):
        body.append(_folded(node["action"], "action", view))
    if node.get("observation"):
        obs_tokens = node.get("observation_tokens")
        body.append(f'<div class="obs"><span class="lbl">observation'
                    f'{f" ({_tokens(obs_tokens)})" if obs_tokens else ""}</span>'
                    f'{_folded(node["observation"], "obstext", view, SHOWN_CHARS // 2)}</div>')
    fold = ('<button type="button" class="fold" title="fold or unfold the subtree">▾</button>'
            if num_children > 1 else "")
    more = ""
    if extra:
        more = '<div class="extra">' + "".join(f'<span class="{cls}" title="{_esc(title)}">{_esc(text)}</span>'
                                               for cls, text, title in extra) + "</div>"
    return (f'<div {" ".join(attrs)}{style_attr}><div class="head">{fold}{"".join(head)}</div>{more}'
            f'{"".join(body)}</div>')


def _divergence_note(node: dict, sibling, view: _View) -> str:
    """The sibling's text from where it first differs from its siblings' (the shared start dimmed, cut)."""
    _, n, field, shared = sibling
    text = node.get(field) or ""
    where = "its action" if field == "action" else "the same action; its observation"
    if shared == 0:
        what = f"{where} differs from the first character"
    else:
        what = f"{where} shares its first {shared} characters with its siblings', then"
    before = text[max(0, shared - 24):shared]
    after = text[shared:shared + 80]
    return (f'<div class="diverge"><span class="lbl">↳ {_esc(what)}</span><pre>'
            f'{"…" if shared > 24 else ""}<span class="same">{_display(before, view)}</span>'
            f'<mark>{_display(after, view) or "(ends here)"}</mark>{"…" if len(text) > shared + 80 else ""}'
            "</pre></div>")


def _tokens(n) -> str:
    return f"{int(n)} token" + ("" if int(n) == 1 else "s")


def _attribute_name(key: str) -> str:
    """A credit key as a `data-` attribute name: only [a-z0-9-] (a hand-edited data file cannot add attributes)."""
    return re.sub(r"[^a-z0-9-]", "", str(key).replace("_", "-").lower()) or "x"


def _first(node: dict, num_children: int, credit: dict, backup: bool, dp: tuple[float, str] | None,
           outcome: str | None) -> list[str]:
    """The head's items, what a reader needs first: the credit (A, or V for a backed-up credit), what the update
    did to the turn (Δp and its direction), a leaf's reward (its chip green when rewarded, red when failed), ×m, the
    warnings, and a TreeFlex search's or block's shape."""
    items = []
    if "A" in credit:
        items.append(f'<span class="chip a" title="the turn\'s credit">{"V" if backup else "A"} '
                     f"{_fmt(credit['A'])}</span>")
    if dp is not None:
        items.append(f'<span class="chip dir {dp[1]}" title="Δp = p − ½ after the update: {dp[1]}">'
                     f"Δp {_fmt_dp(dp[0])} {DIRECTION_WORDS[dp[1]]}</span>")
    rewards = node.get("rewards") or []
    if rewards:
        title = ""
        columns = node.get("reward_columns")
        if columns:
            title = "; ".join(f"{name}: {', '.join('–' if v is None else f'{v:g}' for v in vals)}"
                              for name, vals in columns.items())
        shown = ", ".join("–" if r is None else f"{r:g}" for r in rewards[:8]) + ("…" if len(rewards) > 8 else "")
        mark = {"rewarded": " ✓", "failed": " ✗"}.get(outcome or "", "")
        items.append(f'<span class="badge reward{f" {outcome}" if outcome else ""}" title="{_esc(title)}">'
                     f"R {_esc(shown)}{mark}</span>")
    if (node.get("multiplicity") or 0) > 1:
        items.append(f'<span class="badge mult" title="{int(node["multiplicity"])} trajectories ended in this merged '
                     f'leaf">×{int(node["multiplicity"])}</span>')
    if node.get("truncated"):
        items.append('<span class="badge warn">truncated</span>')
    if node.get("tool_failures"):
        items.append(f'<span class="badge warn" title="tool calls of this turn that failed or could not be parsed">'
                     f'{int(node["tool_failures"])} of {int(node.get("tool_calls") or 0)} calls failed</span>')
    if node.get("penalty"):
        items.append(f'<span class="badge warn" title="process penalty recorded on the turn (failed or malformed '
                     f'tool calls, TreeFlex hooks); TreeFlex\'s credit adds it">Q {node["penalty"]:+.2f}</span>')
    if num_children > 1 and node.get("kind") == "search":  # a search's children are its blocks, one after another
        items.append(f'<span class="badge branch">{num_children} blocks</span>')
    return items


DIRECTION_WORDS = {"toward": "toward", "away": "away", "unchanged": "unchanged", "undirected": "no target"}


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
        out.append(("badge cut", f"✂ tokens {start}–{end} of the turn", "a segment: the assistant turn goes on in the "
                    f"children, which branch inside the turn at token {end} (TreeAdv)"))
    elif start:
        out.append(("badge cut", f"tokens {start}– of the turn", f"the rest of an assistant turn split at token {start}"))
    if node.get("round"):
        out.append(("badge round", f"round {int(node['round'])}",
                    f"created in sampling round {int(node['round'])} (0: the initial trajectories)"))
    if node.get("entropy") is not None:
        out.append(("badge ent", f"H {node['entropy']:.2f}", "mean token entropy of the action"))
    if credit.get("q") is not None:
        out.append(("chip q", f"q {_fmt_p(credit['q'])}", "TreeOPSD's teacher probability for the turn"))
    if credit.get("p_after") is not None:
        out.append(("chip p", f"p ½→{_fmt_p_after(credit['p_after'])}", "p = σ(s): ½ under π_old, after the update"))
    if credit.get("logp_old") is not None:
        new = f"→{_fmt(credit['logp_new'], 2)}" if credit.get("logp_new") is not None else ""
        out.append(("chip lp", f"log π {_fmt(credit['logp_old'], 2)}{new}", "mean log-probability of the action's "
                    "tokens: under π_old" + (" → after the update" if new else "")))
    advantages = node.get("leaf_advantages") or []
    if advantages:
        out.append(("badge adv", "A_k " + ", ".join(_fmt(a, 2) for a in advantages[:8])
                    + ("…" if len(advantages) > 8 else ""), "the leaves' standardised rewards"))
    if sibling is not None and sibling[2]:
        _, _, field, shared = sibling
        out.append(("badge dv", f"{field} differs after {shared} chars",
                    f"where this sibling's {field} first differs from its siblings'"))
    return out


def _cut_at(text: str, shown: int, view: _View) -> tuple[int, int]:
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


def _folded(text: str, cls: str, view: _View, shown: int = SHOWN_CHARS) -> str:
    """A text, folded behind its start when it is long (native `<details>`: no script needed)."""
    cut, visible = _cut_at(text, shown, view)
    if visible <= shown:
        return f'<pre class="{cls}">{_display(text, view)}</pre>'
    return (f'<details class="{cls}"><summary><pre class="peek">{_display(text[:cut], view)}…</pre><span class="more">'
            f'▸ {len(text) - cut} more characters</span><span class="less">▴ fold</span></summary>'
            f"<pre>{_display(text, view)}</pre></details>")


def _display(text: str, view: _View) -> str:
    """Escaped text for a `<pre>`, with the chat template's tokens in hidden spans (`.tpl`, shown by the page's
    switch) and a role header after one (`<|im_start|>user⏎`) as a small label."""
    out, pos = [], 0
    for m in view.template.finditer(text):
        out.append(_text(text[pos:m.start()]))
        hidden, pos = m.group(), m.end()
        role = _ROLE.match(text, pos)
        if role and (text.startswith("\n", role.end()) or view.template.match(text, role.end())):
            newline = "\n" if text.startswith("\n", role.end()) else ""
            out.append(f'<span class="tpl">{_esc(hidden)}</span><span class="role">{_esc(role.group())}</span>'
                       f'<span class="tpl">{newline}</span>')
            pos = role.end() + len(newline)
            continue
        if text.startswith("\n", pos):  # the template's own line break after the token
            hidden, pos = hidden + "\n", pos + 1
        out.append(f'<span class="tpl">{_esc(hidden)}</span>')
    out.append(_text(text[pos:]))
    return "".join(out)


_NEWLINES = re.compile(r"\n{3,}")


def _text(text: str) -> str:
    """Escaped text for a `<pre>`, a run of 3+ newlines drawn as one marked line (a model's empty lines would
    otherwise stretch the node)."""
    return _NEWLINES.sub(lambda m: f'\n<span class="nl">⏎×{len(m.group())}</span>\n', _esc(text))


def _esc(text) -> str:
    return html.escape(clean_text(str(text)), quote=True)


def _fmt(value, digits: int = 3) -> str:
    return "–" if value is None else f"{value:+.{digits}f}"


def _fmt_p(value) -> str:
    return "–" if value is None else f"{value:.3f}"



class _Budget:
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
