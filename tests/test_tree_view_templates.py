"""The rollout-tree pages as templates (trl_tree/tree_view/assets/templates/): the pages they write are the pages the
Python wrote before them, byte for byte; every value a template writes is escaped, the only exceptions being the
package's stylesheet and script; the view's Python holds data and formatting, no markup; no module of the view is
over 600 lines.

The golden pages in tests/data/tree_view_pages/ were written by the page module before it had templates
(`NAME.json`: what it was called with; `NAME.html`: what it wrote, the inlined stylesheet and script left out so
that a change of view.css or view.js does not touch them): a tree page that has every part of a page (siblings and
where they differ, long texts folded, template tokens and roles, runs of empty lines, warnings, the policy line, an
abandoned call, links to the pages before and after, a cut; model text with markup and invisible characters in every
field), TreeFlex's searches and blocks, and a run index (a file it could not read). After a change of the page that
is meant, write them again with `TRL_TREE_WRITE_GOLDEN_PAGES=1 python -m pytest tests/test_tree_view_templates.py`
and read the diff."""

import ast
import json
import os
import re
from pathlib import Path

import pytest

from trl_tree import tree_view as tv

GOLDEN = Path(__file__).parent / "data" / "tree_view_pages"
VIEW = Path(tv.__file__).parent
TEMPLATES = VIEW / "assets" / "templates"


def _without_assets(page: str) -> str:
    assert page.count(tv.STYLE) == 1 and page.count(tv.SCRIPT) == 1
    return page.replace(tv.STYLE, "/* view.css */").replace(tv.SCRIPT, "/* view.js */")


@pytest.mark.parametrize("name", ["tree_page", "treeflex_page", "index_page"])
def test_each_page_kind_writes_the_page_the_python_wrote_before_the_templates(name):
    case = json.loads((GOLDEN / f"{name}.json").read_text(encoding="utf-8"))
    page = _without_assets(getattr(tv, case["render"])(*case["args"], **case["kwargs"]))
    golden = GOLDEN / f"{name}.html"
    if os.environ.get("TRL_TREE_WRITE_GOLDEN_PAGES") == "1":
        golden.write_text(page, encoding="utf-8")
        pytest.skip(f"wrote {golden}: read its diff")
    assert page == golden.read_text(encoding="utf-8")


def test_the_golden_tree_page_has_every_part_it_stands_for():
    """The golden page is only worth its bytes if the parts are there (and its model text was escaped)."""
    page = (GOLDEN / "tree_page.html").read_text(encoding="utf-8")
    for part in [
        'class="diverge"',
        "(ends here)",
        'class="nl"',
        'class="role"',
        'class="tpl"',
        ">truncated<",
        "calls failed",
        'rel="prev"',
        'rel="next"',
        "This page is cut",
        "environment call timed out",
        'class="lbl">policy',
        'class="chip q"',
        'class="chip dir',
        "action diverging",
        'class="badge mult"',
        "&lt;script&gt;",
        "\\u202e",
    ]:
        assert part in page, part
    assert "<script>alert" not in page and "<img" not in page


def _template_sources() -> dict[str, str]:
    return {p.name: p.read_text(encoding="utf-8") for p in sorted(TEMPLATES.glob("*.html"))}


def test_a_template_writes_a_value_unescaped_only_for_the_stylesheet_and_the_script():
    """`|safe` only where the value is the package's own asset, and said why; no Jinja2 construct that escapes without
    `clean_text` (`|join`, `~`, `|format`, `|e`) or turns escaping off."""
    sources = _template_sources()
    assert {"document.html", "tree.html", "index.html"} <= set(sources)
    safe = [
        (name, m.group(1)) for name, text in sources.items() for m in re.finditer(r"\{\{\s*(\w+)\s*\|\s*safe", text)
    ]
    assert sorted(safe) == [("document.html", "script"), ("document.html", "style")]
    for name, text in sources.items():
        for m in re.finditer(r"\{\{[^}]*\|\s*safe", text):
            assert "|safe: " in text[max(0, m.start() - 200) : m.start()], f"{name}: a |safe without its reason"
        tags = " ".join(re.findall(r"\{\{.*?\}\}|\{%.*?%\}", text, flags=re.S))
        for construct in ("|join", "| join", "~", "|format", "|e ", "|e}", "|escape", "autoescape", "Markup"):
            assert construct not in tags, f"{name}: {construct}"


def test_every_value_is_escaped_after_its_invisible_characters_are_made_visible():
    """Through the templates a text of the data reaches the page as `clean_text` then `html.escape` made it: the same
    escaping in a text and in an attribute (the hover title of a node's id is its label's other numbers)."""
    tree, data = _one_turn('<b>\u202etext\'s "end"</b>')
    page = tv.render_page(data)
    assert "&lt;b&gt;\\u202etext&#x27;s &quot;end&quot;&lt;/b&gt;" in page
    assert "\u202e" not in page and "<b>\\u202e" not in page


def _one_turn(action: str):
    import torch

    from trl_tree import RolloutTree, Turn

    tree = RolloutTree.from_trajectories([1], [[Turn(action_ids=[5], action_logps=[-0.5])]], [1.0])
    record = tv.tree_record(tree, {"A": torch.zeros(tree.num_turns)}, lambda ids: action, "prompt")
    return tree, tv.page_data([record], step=1, method="m")


def test_the_views_python_holds_no_markup_and_no_module_of_the_view_is_over_600_lines():
    """The markup is the templates': no string of the view's data modules (docstrings aside) holds a tag, and none
    of them imports markupsafe; page.py holds only the skeleton's escaping and the templates' environment."""
    for path in sorted(VIEW.glob("*.py")):
        assert len(path.read_text(encoding="utf-8").splitlines()) <= 600, path.name
    for name in ("display.py", "prompt_view.py", "node_view.py", "page.py"):
        source = (VIEW / name).read_text(encoding="utf-8")
        tree = ast.parse(source)
        docstrings = {
            id(n.body[0].value)
            for n in ast.walk(tree)
            if isinstance(n, (ast.Module, ast.FunctionDef, ast.ClassDef))
            and n.body
            and isinstance(n.body[0], ast.Expr)
            and isinstance(n.body[0].value, ast.Constant)
        }
        for node in ast.walk(tree):
            if isinstance(node, ast.Constant) and isinstance(node.value, str) and id(node) not in docstrings:
                assert not re.search(r"<[a-z/][a-z]*[ >/]", node.value), f"{name}: markup in {node.value[:60]!r}"
        if name != "page.py":
            assert "markupsafe" not in source and "jinja2" not in source, name
