"""The pages: `render_page` and `render_index` fill the Jinja2 templates with what each part shows, from checked page
data (`checks.checked_page`); no network, no external scripts or fonts. The markup is in the templates, package data
in `assets/templates/`: one per page kind (`tree.html`: a generation batch's trees, `index.html`: the run's index),
both extending the skeleton `document.html`, with partials (`_header.html`, `_prompt.html`, `_node.html`,
`_tools.html`). The Python gives them data and formatting only (texts, numbers formatted, which parts there are):
here the header's, the legend's and the index's; one prompt's in `prompt_view`, one node's in `node_view`. Every value a template writes is escaped
(`clean_text` then `html.escape`: `_escaped`), so model, tool and data text can never become markup; the stylesheet
and the script (`assets/view.css`, `assets/view.js`) are inlined into every page so that a page is one
self-contained file, and they are the only values a template writes unescaped (`|safe`, said in the template). The
script reads nothing but the page's own attributes and text, and builds no HTML (it sets classes and
`textContent`); without it every prompt is shown, unfolded.

Per turn the node shows first what a reader needs at a glance: its credit (the node is coloured by its sign) and
what the update did to it (Δp and its direction), a leaf's reward, and the warnings (truncated, failed tool calls);
the rest (tokens, round, entropy, q, p, log π, where siblings differ) is on demand: hover the node's id, or click
the node (or "all numbers") to expand it. The legend is written from the same tables and counts as the nodes
(`facts.CREDIT_SIGNS`, `facts.DIRECTIONS`)."""

from __future__ import annotations

import html
import re
from importlib import resources

import jinja2
import jinja2.ext
from markupsafe import Markup

from .checks import checked_page
from .display import (
    ABANDONED_TITLE,
    LEAF_ADVANTAGES_TITLE,
    POLICY_TITLE,
    REWARD_SCALE_TITLE,
    TAU_TITLE,
    Budget,
    View,
    plural,
    spread_text,
)
from .facts import (
    CREDIT_SIGNS,
    DIRECTION_MARKS,
    DIRECTIONS,
    UNCHANGED_DP,
    ZERO_CREDIT,
    analyse,
    record_question,
    short_questions,
)
from .prompt_view import prompt_part
from .records import MAX_CHARS, MAX_NODES, PAGE_NAME
from .text import clean_text

__all__ = ["ABANDONED_TITLE", "POLICY_TITLE", "SCRIPT", "STYLE", "render_index", "render_page"]


def _asset(name: str) -> str:
    return resources.files(__package__).joinpath("assets", name).read_text(encoding="utf-8")


STYLE = _asset("view.css")  # the page's stylesheet, inlined in a <style>
SCRIPT = _asset("view.js")  # the page's script, inlined in a <script>: the only script a page has
# inlined raw text must not end its element early
assert "</style" not in STYLE.lower() and "</script" not in SCRIPT.lower() and "<!--" not in SCRIPT


def _escaped(value) -> Markup:
    """What a template writes for `{{ value }}`: markup built by a template (a macro's output, `|safe`) as it is,
    anything else as text, its invisible characters made visible (`clean_text`) and escaped for text and
    attributes alike."""
    if hasattr(value, "__html__"):
        return value
    return Markup(html.escape(clean_text(str(value)), quote=True))


class _OneLine(jinja2.ext.Extension):
    """Templates are written one element a line, indented, to be read; the page is one line, as it was when Python
    wrote it (the text in a `<pre>` keeps its own line breaks): a line break in a template's source and the
    indentation after it are dropped on load. A space that matters is kept inside a line, or written `{{ " " }}`."""

    def preprocess(self, source: str, name: str | None, filename: str | None = None) -> str:
        return re.sub(r"\n[ \t]*", "", source)


class _Environment(jinja2.Environment):
    """Jinja2's environment, but `a.b` of a dict is always its key "b": the view data are dicts, and a key such as
    "update" or "items" must not quietly read as the dict's method."""

    def getattr(self, obj, attribute):
        if isinstance(obj, dict):
            return obj[attribute] if attribute in obj else self.undefined(obj=obj, name=attribute)
        return super().getattr(obj, attribute)


# Every value a template writes goes through `_escaped` (Jinja2 applies `finalize` to each `{{ }}`, then escapes
# what is not markup yet). Templates write texts only as `{{ value }}`: Jinja2's own `|join`, `~` and `|format`
# escape without `clean_text` (tests/test_tree_view_templates.py checks that no template uses them).
_TEMPLATES = _Environment(
    loader=jinja2.PackageLoader(__package__, "assets/templates"),
    autoescape=True,  # and `finalize` escapes with `clean_text` first: a value is text unless a template made it
    finalize=_escaped,
    undefined=jinja2.StrictUndefined,  # a name the Python did not pass is an error, not an empty string
    extensions=[_OneLine],
)


def _render(template: str, title: str, body_class: str, **context) -> str:
    """A whole page: the page kind's template in the skeleton with its title, stylesheet and script."""
    return _TEMPLATES.get_template(template).render(
        title=title, body_class=body_class, style=STYLE, script=SCRIPT, **context
    )


# ------------------------------------------------------------------------------------------------------ the index


def render_index(entries: list[dict], unreadable: list[tuple[str, str]] = ()) -> str:
    """The run's index page: how many generation batches a page stands for, then one block per saved page (its step
    and batch, linked) with a row per prompt (question, gold answer, reward spread, failed tool calls, the turns'
    update directions), filters and a search box; `unreadable`: (file name, why) of saved files left out."""
    blocks, total = [], 0
    for entry in entries:
        name = entry["name"] if PAGE_NAME.fullmatch(entry["name"]) else None
        prompts = entry["prompts"]
        mixed = sum(p["mixed"] for p in prompts)
        failed = sum(1 for p in prompts if p["failures"])
        counts = {k: sum(p.get(k) or 0 for p in prompts) for k in DIRECTIONS}
        parts = [
            f"generation batch {entry['batch']}" if entry.get("batch") else "",
            plural(len(prompts), "prompt"),
            f"{mixed} with mixed rewards",
            f"{plural(failed, 'prompt')} with failed or malformed tool calls",
        ]
        if any(counts.values()):
            parts.append(_directions_text(counts))
        parts.append(entry["method"])
        rows = []
        for p in prompts:
            total += 1
            directed = sum(p.get(k) or 0 for k in DIRECTIONS[:3])
            rows.append(
                {
                    "x": p["x"],
                    "mixed": p["mixed"],
                    "failed": int(p["failures"] > 0),
                    "question": p["question"],
                    "gold": p["gold"],
                    "spread": spread_text(p["min"], p["max"], p["mean"]),
                    "leaves": p["leaves"],
                    "failures": p["failures"] or "",
                    "undirected": p.get("undirected") or "",
                    "directed": f"{p['toward']} / {p['away']} / {p['unchanged']}" if directed else "",
                }
            )
        blocks.append(
            {
                "href": f"{name}.html" if name else None,
                "label": f"{entry['mode']} step {entry['step']}",
                "about": " · ".join(p for p in parts if p),
                "rows": rows,
            }
        )
    method = entries[-1]["method"] if entries else ""
    title = f"{method} rollout trees · {plural(len(entries), 'page')}" if entries else "rollout trees · no pages yet"
    directions = []
    if any(p.get(k) for e in entries for p in e["prompts"] for k in DIRECTIONS):
        meanings = _direction_meanings(any("treeopsd" in e["method"].lower() for e in entries))
        directions = [{"mark": DIRECTION_MARKS[d], "name": d, "meaning": meanings[d]} for d in DIRECTIONS]
    return _render(
        "index.html",
        title,
        "nojs indexpage",
        entries=blocks,
        batches=_batches_text(entries),
        prompts=plural(total, "prompt"),
        directions=directions,
        unreadable=list(unreadable),
        unreadable_count=plural(len(unreadable), "saved file"),
    )


def _batches_text(entries: list[dict]) -> str:
    """What a page of the run stands for: one generation batch (pages saved since pages follow batches), or, for
    pages saved by an older trl-tree at logging steps, the last batch before each log."""
    if not entries:
        return ""
    if all(e.get("batches") == 1 for e in entries):
        return "One page per generation batch (each page: 1 batch, after its last optimizer step)."
    return (
        "Pages saved at logging steps by an older trl-tree: each shows the last generation batch before its log, "
        "so a page may stand for several batches of which only the last is shown."
    )


def _directions_text(counts: dict) -> str:
    """The update's directions as counted on a page: the directed turns, then the undirected ones apart."""
    directed = counts["toward"] + counts["away"] + counts["unchanged"]
    text = (
        f"update of {plural(directed, 'turn')} with a direction: {counts['toward']} toward, "
        f"{counts['away']} away, {counts['unchanged']} unchanged"
    )
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


# ------------------------------------------------------------------------------------------------------ the page


def render_page(
    data: dict, *, max_nodes: int = MAX_NODES, max_chars: int = MAX_CHARS, links: dict | None = None
) -> str:
    """The HTML page of `data` (`page_data`). Nodes past `max_nodes`, or past `max_chars` characters of text, are cut
    in depth-first order (a shown node's ancestors are always shown) and a note on the page says how many.

    `links`: the run's index and the pages before and after this one (`save_page` and `render_run` pass them; a page
    for a tracker has none, since its files are not beside it there).

    Raises:
        ValueError: a number of the data is not a number (or a list or record is not one), naming where.
    """
    data = checked_page(data)
    view = View(data)
    budget = Budget(max_nodes, max_chars)
    records = data.get("prompts", [])
    analyses = [analyse(record) for record in records]
    questions = short_questions([record_question(r) for r in records])
    prompts = [
        prompt_part(record, x, budget, view, facts, questions[x])
        for x, (record, facts) in enumerate(zip(records, analyses))
    ]
    title = f"{data.get('method', '')} rollout trees · {data.get('mode', 'train')} step {data.get('step', 0)}"
    cut = None
    if budget.cut_nodes:
        cut = {"nodes": budget.cut_nodes, "total": budget.total_nodes, "max_nodes": max_nodes, "max_chars": max_chars}
    return _render(
        "tree.html",
        title,
        "nojs",
        links=_step_links(links),
        summary=_summary(records, analyses, data),
        page_key=_key(data, analyses, view),
        page_legend=_legend(data, view, analyses),
        cut=cut,
        prompts=prompts,
    )


def _step_links(links: dict | None) -> dict | None:
    """The run's index and the pages before and after this one; a neighbour whose name is not a page's: none."""
    if not links:
        return None
    out = {"index": links["index"]}
    for key in ("prev", "next"):
        out[key] = None
        if links.get(key) and PAGE_NAME.fullmatch(links[key]):
            label = links.get(f"{key}_label", links[key])
            out[key] = {"href": f"{links[key]}.html", "text": f"◀ {label}" if key == "prev" else f"{label} ▶"}
    return out


# -------------------------------------------------------------------- header, legend, prompt list


def _summary(records: list[dict], analyses: list[dict], data: dict) -> str:
    mixed = sum(a["mixed"] for a in analyses)
    failed = sum(1 for a in analyses if a["failures"])
    parts = [
        plural(len(records), "prompt"),
        f"{mixed} with mixed rewards",
        f"{plural(failed, 'prompt')} with failed or malformed tool calls",
    ]
    if data.get("batch"):
        parts.insert(0, f"generation batch {data['batch']}")
    policy = _policy_summary(records)
    if policy:
        parts.append(policy)
    return " · ".join(parts)


def _policy_summary(records: list[dict]) -> str:
    """The page's policy versions and staleness (one each in a batch, §9), or their ranges; "" where no record says
    (files saved before they were recorded)."""
    shown = []
    for key, name in (("policy_version", "policy version"), ("staleness", "staleness")):
        values = sorted({r[key] for r in records if r.get(key) is not None})
        if values:
            shown.append(f"{name} {values[0]}" if len(values) == 1 else f"{name}s {values[0]}–{values[-1]}")
    return ", ".join(shown)


def _is_treeopsd(analyses_or_nodes) -> bool:
    return any("q" in (n.get("credit") or {}) for n in analyses_or_nodes)


def _key(data: dict, analyses: list[dict], view: View) -> dict:
    """The always-visible key, from the page's own counts and the very classes its nodes carry: the credit signs
    (a swatch of each colour, with how many turns have it), the leaf reward scale, and the update's directions (the
    chip of each, with how many turns, the undirected ones apart)."""
    signs = {cls: sum(a["sign_counts"][cls] for a in analyses) for cls, _ in CREDIT_SIGNS}
    name = "V" if view.backup else "A"
    relations = {"pos": f"{name} > 0", "neg": f"{name} < 0", "zero": f"{name} = 0"}
    key = {
        "reward_title": REWARD_SCALE_TITLE,
        "signs": [],
        "directions": [],
        "directed": "",
        "undirected": None,
        "scale": (f"{view.low:.3g}" + "–" + f"{view.high:.3g}") if view.high > view.low else "–",
    }
    if any(signs.values()):
        key["signs"] = [
            {"cls": cls, "meaning": what, "relation": relations[cls], "count": signs[cls]}
            for cls, what in CREDIT_SIGNS
        ]
    counts = {k: sum(a["dp_counts"][k] for a in analyses) for k in DIRECTIONS}
    if any(counts.values()):
        meanings = _direction_meanings(any(_is_treeopsd(r.get("nodes", [])) for r in data.get("prompts", [])))
        key["directions"] = [{"name": d, "meaning": meanings[d], "count": counts[d]} for d in DIRECTIONS[:3]]
        key["directed"] = plural(counts["toward"] + counts["away"] + counts["unchanged"], "turn")
        key["undirected"] = {"meaning": meanings["undirected"], "count": counts["undirected"]}
    return key


def _legend(data: dict, view: View, analyses: list[dict]) -> dict:
    """What the legend says besides its fixed lines: the credit (A, or V for a backed-up credit), and the lines of
    the numbers this page has (entropy, the update's directions, TreeOPSD's q)."""
    nodes = [n for r in data.get("prompts", []) for n in r.get("nodes", [])]
    treeopsd = _is_treeopsd(nodes)
    directions = []
    if any(a["dp"] for a in analyses):
        meanings = _direction_meanings(treeopsd)
        directions = [(d, meanings[d]) for d in DIRECTIONS]
    return {
        "backup": view.backup,
        "name": "V" if view.backup else "A",
        "credit": data.get("credit", ""),
        "credit_title": view.credit_summary or f"the credit this run used: {view.credit}",
        "signs": list(CREDIT_SIGNS),
        "leaf_advantages_title": LEAF_ADVANTAGES_TITLE,
        "tau_title": TAU_TITLE,
        "entropy": any(n.get("entropy") is not None for n in nodes),
        "directions": directions,
        "treeopsd": treeopsd,
        "note": data.get("after_note") or "",
    }
