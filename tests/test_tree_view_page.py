"""What the rollout-tree page shows a person opening it instead of the logs (issue #25): `trl-tree view OUTPUT_DIR`
finds the run's pages; the prompt list starts with the question (not the shared instruction), the gold answer, the
reward spread and the best and worst leaf; leaves are coloured by reward and a click highlights a path; a sibling is
told apart from a chain's continuation, with where it first differs, and a minimap shows the whole tree; TreeOPSD's
Δp is signed, precise and counted toward / away / unchanged; template tokens are hidden (kept in the data); one index
per run links every step and prompt. Each test checks properties of the page's data and HTML, not a snapshot."""

import importlib.util
import json
import re
from html.parser import HTMLParser
from pathlib import Path

import pytest
import torch

from tests.scripted import (
    REPLIES,
    arithmetic_dataset,
    scripted_trainer,
)
from trl_tree import RolloutTree, TreeOPSDConfig, TreeOPSDTrainer, Turn, cli
from trl_tree import tree_view as tv
from trl_tree.envs.hotpot import build_prompt

REPO = Path(__file__).resolve().parent.parent


class _Dom(HTMLParser):
    """The page as a browser parses it: every element with its attributes, parent and text; `.tpl` spans (hidden by
    the page's CSS) are tracked so that `visible_text` leaves them out."""

    VOID = {"meta", "input", "br", "img", "hr", "link", "line", "circle"}

    def __init__(self, text: str):
        super().__init__(convert_charrefs=True)
        self.root = {"tag": "#root", "attrs": {}, "children": [], "text": [], "parent": None}
        self.stack, self.elements = [self.root], []
        self.feed(text)

    def handle_starttag(self, tag, attrs):
        el = {"tag": tag, "attrs": dict(attrs), "children": [], "text": [], "parent": self.stack[-1]}
        self.stack[-1]["children"].append(el)
        self.elements.append(el)
        if tag not in self.VOID:
            self.stack.append(el)

    def handle_startendtag(self, tag, attrs):
        self.handle_starttag(tag, attrs)
        if tag not in self.VOID:
            self.stack.pop()

    def handle_endtag(self, tag):
        for i in range(len(self.stack) - 1, 0, -1):
            if self.stack[i]["tag"] == tag:
                del self.stack[i:]
                return

    def handle_data(self, data):
        self.stack[-1]["children"].append(data)

    @staticmethod
    def classes(el) -> list[str]:
        return (el["attrs"].get("class") or "").split()

    def find(self, tag=None, cls=None, **attrs) -> list[dict]:
        return [el for el in self.elements if (tag is None or el["tag"] == tag)
                and (cls is None or cls in self.classes(el))
                and all(el["attrs"].get(k.replace("_", "-")) == v for k, v in attrs.items())]

    @classmethod
    def text(cls, el, visible=False) -> str:
        out = []
        for child in el["children"]:
            if isinstance(child, str):
                out.append(child)
            elif not (visible and "tpl" in cls.classes(child)):
                out.append(cls.text(child, visible))
        return "".join(out)

    @staticmethod
    def within(el, ancestor_cls) -> dict | None:
        el = el["parent"]
        while el is not None:
            if ancestor_cls in _Dom.classes(el):
                return el
            el = el["parent"]
        return None


def _trainer(tmp_path, replies=REPLIES, dataset=None, **overrides):
    return scripted_trainer(TreeOPSDTrainer, TreeOPSDConfig, tmp_path, replies, dataset=dataset, log_completions=True,
                            **overrides)


def _chain_tree(texts, rewards, branches):
    """A tree whose trajectories are paths of token ids (id = index into `texts`), with `rewards`."""
    return RolloutTree.from_trajectories([0], [[Turn([i], [0.0], []) for i in path] for path in branches], rewards)


def _decode(texts):
    return lambda ids: "".join(texts[i] for i in ids)


# ------------------------------------------------------------------------------------------------ 1. trl-tree view


def test_view_of_an_output_dir_finds_its_tree_view_folder_and_skips_other_json(tmp_path, capsys):
    out = tmp_path / "runs" / "treeopsd"
    _trainer(out).train()
    (out / "config.json").write_text('{"model_type": "qwen3"}')  # what a saved model leaves in output_dir
    page = out / "tree_view" / "step_000001.html"
    page.unlink()
    assert cli.main(["view", str(out)]) == 0
    printed = capsys.readouterr().out.split()
    assert str(page) in printed and str(out / "tree_view" / "index.html") == printed[-1] and page.is_file()
    # the tree_view folder itself, and the folder above the output_dir when it holds one run, work too
    assert cli.main(["view", str(out / "tree_view")]) == 0
    assert cli.main(["view", str(tmp_path / "runs")]) == 0
    (tmp_path / "runs" / "other" / "tree_view").mkdir(parents=True)
    (tmp_path / "runs" / "other" / "tree_view" / "step_000001.json").write_text((out / "tree_view" / "step_000001.json")
                                                                               .read_text())
    with pytest.raises(SystemExit, match="several runs"):
        cli.main(["view", str(tmp_path / "runs")])


def test_view_of_an_output_dir_without_pages_says_that_log_completions_is_needed(tmp_path):
    (tmp_path / "config.json").write_text("{}")
    (tmp_path / "trainer_state.json").write_text("{}")
    with pytest.raises(SystemExit) as error:
        cli.main(["view", str(tmp_path)])
    message = str(error.value)
    assert "log_completions=True" in message and "config.json" not in message and str(tmp_path) in message
    (tmp_path / "tree_view").mkdir()
    with pytest.raises(SystemExit, match="holds no saved page yet"):
        cli.main(["view", str(tmp_path)])
    with pytest.raises(SystemExit, match="no such file or folder"):
        cli.main(["view", str(tmp_path / "missing")])


def test_view_of_a_run_with_a_half_written_step_file_renders_every_readable_step_and_lists_the_other(tmp_path,
                                                                                                     capsys):
    """Issue 41 item 7: a crashed run's last step file is often half-written; `trl-tree view` rendered nothing."""
    folder = tmp_path / "tree_view"
    for step in (1, 2, 3):
        tv.save_page(tv.page_data(_hotpot_records(), step=step, method="m"), folder, f"step_{step:06d}")
    full = (folder / "step_000003.json").read_text()
    (folder / "step_000003.json").write_text(full[: len(full) // 2])  # stopped while writing
    (folder / "step_000002.json").write_text(full.replace('"num_leaves": 3', '"num_leaves": "three"', 1))
    for page in folder.glob("*.html"):
        page.unlink()
    assert cli.main(["view", str(tmp_path)]) == 0
    out, err = capsys.readouterr()
    assert out.split() == [str(folder / "step_000001.html"), str(folder / "index.html")]
    assert "unreadable" in err and "step_000003.json" in err and "step_000002.json" in err and "number" in err
    assert not (folder / "step_000003.html").exists() and not (folder / "step_000002.html").exists()
    index = _Dom((folder / "index.html").read_text())
    assert [a["attrs"]["href"] for a in index.find("a") if a["attrs"]["href"].endswith("prompt-0")] == [
        "step_000001.html#prompt-0"]
    (note,) = index.find("div", cls="unreadable")
    assert "step_000002.json" in _Dom.text(note) and "step_000003.json" in _Dom.text(note)
    page = _Dom((folder / "step_000001.html").read_text())
    assert not page.find("a", rel="next")  # no link to a page that was not written
    # every file unreadable: an error naming each; one file given: its own error, as before
    (folder / "step_000001.json").write_text("{")
    with pytest.raises(SystemExit, match=r"no saved page there is readable(.|\n)*step_000001(.|\n)*step_000003"):
        cli.main(["view", str(tmp_path)])
    with pytest.raises(SystemExit, match="step_000003.json: not a readable tree-view data file"):
        cli.main(["view", str(folder / "step_000003.json")])


def test_the_trainers_files_are_written_whole(tmp_path, monkeypatch):
    """A page's files are written to a temporary file and renamed: a write that fails leaves the file as it was."""
    folder = tmp_path / "tree_view"
    tv.save_page(tv.page_data(_hotpot_records(), step=1, method="m"), folder, "step_000001")
    before = (folder / "step_000001.json").read_text()
    from trl_tree.tree_view import files

    def failing_replace(src, dst):
        raise OSError("disk full")

    monkeypatch.setattr(files.os, "replace", failing_replace)
    with pytest.raises(OSError, match="disk full"):
        tv.save_page(tv.page_data(_hotpot_records()[:1], step=1, method="m"), folder, "step_000001")
    assert (folder / "step_000001.json").read_text() == before
    assert sorted(p.name for p in folder.iterdir()) == ["index.html", "index.json", "step_000001.html",
                                                        "step_000001.json"]  # no temporary file left


# ------------------------------------------------------------------------------------------------ 2. the prompt list


def _hotpot_records():
    """Two HotpotQA-style prompts (system message, then the shared Search-R1 instruction with the question at its
    end) with mixed rewards, as the trainer records them with their dataset rows."""
    texts = ["search A", "answer yes", "answer no", "search B", "answer Paris", "answer Rome"]
    records = []
    for question, gold, base in (("Is A older than B?", "yes", 0), ("Where is the Louvre?", "Paris", 3)):
        tree = _chain_tree(texts, [1.0, 0.0, 0.0], [[base, base + 1], [base, base + 2], [base, base + 2]])
        prompt = build_prompt(question)
        records.append(tv.tree_record(tree, {"A": torch.zeros(tree.num_turns)}, _decode(texts), prompt,
                                      row={"prompt": prompt, "answer": gold, "id": "x"}))
    return records


def test_each_prompt_in_the_list_starts_with_its_question_gold_answer_spread_and_best_and_worst_leaf():
    records = _hotpot_records()
    dom = _Dom(tv.render_page(tv.page_data(records, step=1, method="m")))
    entries = dom.find("button", cls="navbtn")
    for entry, question, gold in zip(entries, ("Is A older than B?", "Where is the Louvre?"), ("yes", "Paris")):
        first = next(c for c in entry["children"] if isinstance(c, dict))
        assert _Dom.text(first).strip() == f"#{entries.index(entry)} {question}"  # not "Answer the given question…"
        text = _Dom.text(entry)
        assert f"gold: {gold}" in text and "R 0…1, mean 0.333" in text
        assert "best #1 (1) · worst #2 (0)" in text  # leaf #1 (reward 1) and #2 (the merged ×2 leaf, reward 0)
        assert entry["attrs"]["data-mixed"] == "1"
    section = dom.find("section", id="prompt-0")[0]
    assert _Dom.text(dom.find("span", cls="qtext")[0]) == "Is A older than B?"
    links = [el for el in dom.find("a", cls="leaflink") if _Dom.within(el, "facts") and el in _descendants(section)]
    assert [el["attrs"]["href"] for el in links] == ["#n-0-1", "#n-0-2"]  # best, worst: anchors of their nodes
    assert {"n-0-1", "n-0-2"} <= {el["attrs"].get("id") for el in dom.find("div", cls="node")}
    assert "answer yes" in _Dom.text(links[0]["parent"])  # the best leaf's text


def _descendants(el) -> list[dict]:
    out = []
    for child in el["children"]:
        if isinstance(child, dict):
            out += [child, *_descendants(child)]
    return out


def test_the_trainer_records_the_question_and_gold_answer_of_the_dataset_row(tmp_path):
    _trainer(tmp_path).train()
    (record,) = json.loads((tmp_path / "tree_view" / "step_000001.json").read_text())["prompts"]
    assert record["question"] == "What is 1+1?" and record["gold"] == "2" and record["gold_column"] == "answer"


def test_the_trainer_page_says_what_its_credit_is_and_that_it_applied_no_penalty(tmp_path):
    """Issue 59: the page's hover text for the credit and whether a turn's Q is shown come from the credit's
    registered entry (`methods.Credit`), not from a list of method names in the page."""
    from trl_tree import methods

    _trainer(tmp_path).train()
    data = json.loads((tmp_path / "tree_view" / "step_000001.json").read_text())
    credit = methods.CREDITS[data["credit"]]
    assert data["credit_summary"] == credit.summary and data["penalties"] is False is credit.applies_penalties
    assert [name for name, c in methods.CREDITS.items() if c.applies_penalties] == ["search"]  # TreeFlex F2 only


def test_a_page_saved_before_questions_were_recorded_shows_the_question_without_the_shared_instruction():
    records = _hotpot_records()
    for record in records:  # as an older run saved them: the prompt text only
        for key in ("question", "gold", "gold_column"):
            record.pop(key)
    dom = _Dom(tv.render_page(tv.page_data(records, step=1, method="m")))
    assert [_Dom.text(el) for el in dom.find("span", cls="qtext")] == ["Is A older than B?", "Where is the Louvre?"]
    # no "Question:" marker either: the start every prompt shares is cut
    shared = "Please think step by step and use the tools when you need them. "
    assert tv.short_questions([shared + "What is 2+2?", shared + "Name a prime."]) == ["… What is 2+2?",
                                                                                        "… Name a prime."]


# ------------------------------------------------------------------------------------------------ 3. leaves and paths


def test_leaves_are_coloured_by_reward_and_marked_rewarded_or_failed():
    texts = ["root", "good", "bad", "half"]
    tree = _chain_tree(texts, [1.0, 0.0, 0.25], [[0, 1], [0, 2], [0, 3]])
    record = tv.tree_record(tree, {"A": torch.zeros(tree.num_turns)}, _decode(texts), "q")
    dom = _Dom(tv.render_page(tv.page_data([record], step=1, method="m")))
    leaves = {int(el["attrs"]["data-node"]): el for el in dom.find("div", cls="leaf")}
    level = {i: int(re.search(r"--rl:(\d+)", el["attrs"]["style"]).group(1)) for i, el in leaves.items()}
    assert level == {1: 100, 2: 0, 3: 25}  # a [0, 1] reward on its absolute scale: 0 its low end, 1 its high end
    # rewarded: a positive reward at least the tree's mean (0.4167); failed: the others
    assert {i: el["attrs"]["data-outcome"] for i, el in leaves.items()} == {1: "rewarded", 2: "failed", 3: "failed"}
    assert all("data-outcome" not in el["attrs"] for el in dom.find("div", cls="node") if el not in leaves.values())
    assert dom.find("button", id="next-rewarded") and dom.find("button", id="next-failed")


def test_every_node_names_its_parent_so_a_click_can_highlight_the_root_to_leaf_path():
    texts = [f"t{i}" for i in range(7)]
    tree = _chain_tree(texts, [1.0, 0.0, 1.0, 0.0], [[0, 1, 2], [0, 1, 3], [0, 4, 5], [0, 4, 6]])
    record = tv.tree_record(tree, {"A": torch.zeros(tree.num_turns)}, _decode(texts), "q")
    dom = _Dom(tv.render_page(tv.page_data([record], step=1, method="m")))
    parent = {int(el["attrs"]["data-node"]): int(el["attrs"]["data-parent"]) for el in dom.find("div", cls="node")}
    for k, path in enumerate(tree.paths):  # walking data-parent from a leaf gives the tree's path, reversed
        walk, node = [], tree.leaf_of[k]
        while node != -1:
            walk.append(node)
            node = parent[node]
        assert walk[::-1] == path
    assert "data-parent" in tv.SCRIPT and "onpath" in tv.SCRIPT  # the script walks them and marks the path


# ------------------------------------------------------------------------------------------------ 4. the shape


def test_siblings_are_marked_and_show_where_they_first_differ_and_a_chain_is_not():
    texts = ["search(x)", "The answer is 42.", "The answer is 7.", "thinking", "done"]
    tree = _chain_tree(texts, [1.0, 0.0, 0.5], [[0, 1], [0, 2], [3, 4]])
    record = tv.tree_record(tree, {"A": torch.zeros(tree.num_turns)}, _decode(texts), "q")
    dom = _Dom(tv.render_page(tv.page_data([record], step=1, method="m")))
    nodes = {int(el["attrs"]["data-node"]): el for el in dom.find("div", cls="node")}
    badge = {i: _Dom.text(b) for i, el in nodes.items() for b in _descendants(el) if "sib" in _Dom.classes(b)}
    # roots [search(x), thinking] are 2 siblings; under search(x) the two answers are; "done" continues a chain
    by_text = {tree.turns[i].action_ids[0]: i for i in range(tree.num_turns)}
    assert badge == {by_text[0]: "↳ 1/2", by_text[3]: "↳ 2/2", by_text[1]: "↳ 1/2", by_text[2]: "↳ 2/2"}
    assert by_text[4] not in badge
    shared = len("The answer is ")
    for i in (by_text[1], by_text[2]):
        text = _Dom.text(nodes[i])
        assert f"action differs after {shared} chars" in text
        marked = next(b for b in _descendants(nodes[i]) if b["tag"] == "mark")
        assert _Dom.text(marked) == texts[tree.turns[i].action_ids[0]][shared:]  # the part that differs
    assert "action differs after 0 chars" in _Dom.text(nodes[by_text[0]])


def test_the_minimap_has_a_dot_per_shown_node_linked_to_it_and_an_edge_per_parent_child():
    texts = [f"t{i}" for i in range(7)]
    tree = _chain_tree(texts, [1.0, 0.0, 1.0, 0.0], [[0, 1, 2], [0, 1, 3], [0, 4, 5], [0, 4, 6]])
    record = tv.tree_record(tree, {"A": torch.zeros(tree.num_turns)}, _decode(texts), "q")
    dom = _Dom(tv.render_page(tv.page_data([record], step=1, method="m")))
    (svg,) = dom.find("svg", cls="minimap")
    links = [el for el in _descendants(svg) if el["tag"] == "a"]
    assert sorted(int(a["attrs"]["data-ref"]) for a in links) == list(range(tree.num_turns))
    assert all(a["attrs"]["href"] == f"#n-0-{a['attrs']['data-ref']}" for a in links)
    lines = [el for el in _descendants(svg) if el["tag"] == "line"]
    assert len(lines) == tree.num_turns - 1  # one root
    branch_points = sum(len(t.children) > 1 for t in tree.turns)
    assert sum("eb" in _Dom.classes(el) for el in lines) == sum(len(t.children) for t in tree.turns
                                                                if len(t.children) > 1) and branch_points == 3


# ------------------------------------------------------------------------------------------------ 5. TreeOPSD's Δp


def _treeopsd_record(q, p_after):
    texts = [f"t{i}" for i in range(len(q))]
    tree = _chain_tree(texts, [1.0, 0.0] + [0.5] * (len(q) - 3), [[0, i] for i in range(1, len(q))])
    record = tv.tree_record(tree, {"A": torch.zeros(tree.num_turns), "q": torch.tensor(q)}, _decode(texts), "q")
    tv.attach_turn_probabilities(record, [0.0] * len(q), [0.0] * len(q), p_after)
    return tree, record


def test_delta_p_is_signed_precise_and_counted_toward_away_and_unchanged_with_undirected_turns_apart():
    q = [0.7, 0.3, 0.6, 0.5, 0.55]
    p = [0.5 + 2e-5, 0.5 + 0.0123, 0.5 + 1e-7, 0.5 - 3e-4, 0.62]  # toward (tiny), away, unchanged, q = ½, past q
    tree, record = _treeopsd_record(q, p)
    dom = _Dom(tv.render_page(tv.page_data([record], step=1, method="TreeOPSD")))
    nodes = {int(el["attrs"]["data-node"]): el for el in dom.find("div", cls="node")}
    by_text = {tree.turns[i].action_ids[0]: i for i in range(tree.num_turns)}
    # q = ½ (zero credit) asks for no direction: "undirected", not "away"; overshooting q is farther from q than ½
    expected = ["toward", "away", "unchanged", "undirected", "away"]
    for j, direction in enumerate(expected):
        node = nodes[by_text[j]]
        assert node["attrs"]["data-dir"] == direction
        assert float(node["attrs"]["data-dp"]) == pytest.approx(p[j] - 0.5)
    chips = {j: _Dom.text(next(b for b in _descendants(nodes[by_text[j]]) if "dir" in _Dom.classes(b)))
             for j in range(len(q))}
    assert chips[0] == "Δp +2.00e-05 toward"  # 2e-5 is not "+0.000"
    assert chips[1] == "Δp +0.0123 away" and chips[3] == "Δp -3.00e-04 no target"
    assert "p ½→0.500020" in _Dom.text(nodes[by_text[0]])
    (key,) = dom.find("p", cls="key")
    counts = {el["attrs"]["data-dir"]: int(_Dom.text(next(c for c in _descendants(el) if "n" in _Dom.classes(c))))
              for el in _descendants(key) if "keyitem" in _Dom.classes(el) and "data-dir" in el["attrs"]}
    assert counts == {"toward": 1, "away": 2, "unchanged": 1, "undirected": 1}
    assert "update (Δp) of 4 turns with a direction" in _Dom.text(key)
    legend = _Dom.text(dom.find("details", cls="legend")[0])
    assert "closer to the turn's teacher q than ½ was" in legend and "q = ½ (zero credit" in legend


def test_a_tree_whose_rewards_are_all_equal_counts_no_turn_toward_or_away():
    """Issue 41 item 2: 12 leaves all rewarded 0 have zero credit (q = ½) everywhere; the update still moves their
    turns (shared weights), which the page used to count as "away" (0 toward / 10 away). They are undirected."""
    texts = [f"t{i}" for i in range(13)]
    tree = _chain_tree(texts, [0.0] * 12, [[0, i] for i in range(1, 13)])
    n = tree.num_turns
    credit = {"A": torch.zeros(n, dtype=torch.float64), "q": torch.full((n,), 0.5, dtype=torch.float64)}
    record = tv.tree_record(tree, credit, _decode(texts), "q")
    tv.attach_turn_probabilities(record, [0.0] * n, [0.0] * n, [0.5 + 0.003 * (-1) ** i for i in range(n)])
    facts = tv.analyse(tv.checked_page(tv.page_data([record], step=1, method="TreeOPSD"))["prompts"][0])
    assert facts["dp_counts"] == {"toward": 0, "away": 0, "unchanged": 0, "undirected": n}
    assert facts["sign_counts"] == {"pos": 0, "neg": 0, "zero": n}
    summary = tv.page_summary(tv.page_data([record], step=1, method="TreeOPSD"), "step_000001")["prompts"][0]
    assert (summary["toward"], summary["away"], summary["undirected"]) == (0, 0, n)
    index = _Dom(tv.render_index([tv.page_summary(tv.page_data([record], step=1, method="TreeOPSD"), "step_000001")]))
    (row,) = index.find("tr", cls="row")
    cells = [_Dom.text(c) for c in row["children"] if isinstance(c, dict)]
    assert cells[-2:] == ["", str(n)]  # no toward / away / unchanged; the undirected ones apart
    assert "0 toward, 0 away" in _Dom.text(index.find("tr", cls="stephead")[0])
    legend = _Dom.text(index.find("details", cls="legend")[0])
    assert "undirected" in legend and "not counted toward or away" in legend
    # the other losses: a direction where the credit is non-zero, relative to its sign, from log π before and after
    other = tv.tree_record(tree, {"A": torch.tensor([0.0] + [1.0, -1.0] * 6)}, _decode(texts), "q")
    tv.attach_turn_probabilities(other, [0.0] * n, [0.01, 0.01, 0.01] + [0.0] * (n - 3), None)
    update = {node["id"]: tv.turn_update(node["credit"])[1] for node in other["nodes"]}
    by_text = {tree.turns[i].action_ids[0]: i for i in range(n)}
    assert [update[by_text[j]] for j in range(4)] == ["undirected", "toward", "away", "unchanged"]


def test_the_trainer_page_counts_match_the_turns(tmp_path):
    _trainer(tmp_path, target_radius=0.25).train()
    dom = _Dom((tmp_path / "tree_view" / "step_000001.html").read_text())
    dirs = [el["attrs"]["data-dir"] for el in dom.find("div", cls="node") if "data-dir" in el["attrs"]]
    assert dirs and set(dirs) <= set(tv.DIRECTIONS)
    key = {el["attrs"]["data-dir"]: int(_Dom.text(next(c for c in _descendants(el) if "n" in _Dom.classes(c))))
           for el in dom.find("span", cls="keyitem") if "data-dir" in el["attrs"]}
    assert key == {d: dirs.count(d) for d in tv.DIRECTIONS}


def test_the_screenshot_demo_trains_at_the_quickstart_learning_rate(monkeypatch, tmp_path):
    spec = importlib.util.spec_from_file_location("screenshot_tree_view", REPO / "scripts" / "screenshot_tree_view.py")
    script = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(script)
    import yaml

    recipe = yaml.safe_load((REPO / "trl_tree" / "recipes" / "hotpot_offline.yaml").read_text())
    assert script.quickstart_learning_rate() == float(recipe["learning_rate"]) == 1e-4

    class Trained:  # what tiny_run does with build_trainer's trainer: set the rate, then train
        def __init__(self):
            self.args = type("Args", (), {"learning_rate": 1e-2})()
            self.rate_at_train = None

        def train(self):
            self.rate_at_train = self.args.learning_rate

    made = []
    fake = type(__import__("sys"))("tiny_tree_run")
    fake.build_trainer = lambda out, **kw: made.append(Trained()) or made[-1]
    monkeypatch.setitem(__import__("sys").modules, "tiny_tree_run", fake)
    script.tiny_run("treeopsd", tmp_path)
    assert made[0].rate_at_train == 1e-4


# ------------------------------------------------------------------------------------------------ 6. template tokens


def test_template_tokens_are_hidden_in_the_shown_texts_and_kept_in_the_data(tmp_path):
    _trainer(tmp_path).train()
    data = json.loads((tmp_path / "tree_view" / "step_000001.json").read_text())
    assert {"<|im_start|>", "<|im_end|>", "<|endoftext|>"} <= set(data["special_tokens"])
    assert "<|im_start|>" in "".join(n["observation"] for n in data["prompts"][0]["nodes"])  # kept in the data
    dom = _Dom((tmp_path / "tree_view" / "step_000001.html").read_text())
    shown = "".join(_Dom.text(el, visible=True) for el in dom.find("div", cls="node"))
    assert "<tool_response>" in shown  # an added token that is no special token stays
    assert not any(t in shown for t in ("<|im_start|>", "<|im_end|>", "<|endoftext|>"))
    roles = {_Dom.text(el) for el in dom.find("span", cls="role")}
    assert {"user", "assistant"} <= roles  # the role headers after <|im_start|>, as labels
    assert dom.find("input", id="show-tpl") and "showtpl" in tv.SCRIPT
    assert dom.find("details", cls="legend")  # the legend folds


def test_a_tampered_special_token_list_cannot_hide_ordinary_text():
    texts = ["a plain answer", "<|im_end|>"]
    tree = _chain_tree(texts, [1.0], [[0, 1]])
    record = tv.tree_record(tree, {"A": torch.zeros(tree.num_turns)}, _decode(texts), "q")
    data = tv.page_data([record], step=1, method="m", special_tokens=["a", " ", "<|im_end|>", "plain"])
    shown = "".join(_Dom.text(el, visible=True) for el in _Dom(tv.render_page(data)).find("div", cls="node"))
    assert "a plain answer" in shown and "<|im_end|>" not in shown


# ------------------------------------------------------------------------------------------------ 7. the run's index


def test_the_run_index_lists_every_step_and_prompt_and_the_pages_link_prev_and_next(tmp_path):
    replies = {k: v * 2 for k, v in REPLIES.items()}
    _trainer(tmp_path, replies=replies, dataset=arithmetic_dataset(2), max_steps=2).train()
    folder = tmp_path / "tree_view"
    first, second = _Dom((folder / "step_000001.html").read_text()), _Dom((folder / "step_000002.html").read_text())
    assert [a["attrs"]["href"] for a in first.find("a", rel="next")] == ["step_000002.html"]
    assert not first.find("a", rel="prev") and not second.find("a", rel="next")
    assert [a["attrs"]["href"] for a in second.find("a", rel="prev")] == ["step_000001.html"]
    index = _Dom((folder / "index.html").read_text())
    rows = index.find("tr", cls="row")
    assert [a["attrs"]["href"] for row in rows for a in _descendants(row) if a["tag"] == "a"] == [
        "step_000001.html#prompt-0", "step_000002.html#prompt-0"]
    assert all("What is 1+1?" in _Dom.text(row) and row["attrs"]["data-mixed"] == "1" for row in rows)
    assert index.find("input", id="search") and index.find("input", id="f-mixed") and index.find("input", id="f-failed")
    # the step pages have the same filters and search box over their prompt list
    assert first.find("input", id="search") and first.find("input", id="f-failed")
    # re-rendering the run gives the same pages (links included)
    before = {p.name: p.read_text() for p in folder.glob("*.html")}
    tv.render_run(tmp_path)
    assert {p.name: p.read_text() for p in folder.glob("*.html")} == before


def test_the_failed_calls_filter_marks_prompts_with_failed_or_malformed_tool_calls():
    texts = ["call", "answer", "bad call", "answer"]
    tree = _chain_tree(texts, [1.0, 0.0], [[0, 1], [2, 3]])
    tools = [([1, 0], [0, 0]), ([1, 0], [1, 0])]  # per trajectory: (calls, failures) per turn of its path
    failing = tv.tree_record(tree, {"A": torch.zeros(tree.num_turns)}, _decode(texts), "q", turn_tools=tools)
    fine = tv.tree_record(tree, {"A": torch.zeros(tree.num_turns)}, _decode(texts), "q",
                          turn_tools=[(c, [0] * len(c)) for c, _ in tools])
    dom = _Dom(tv.render_page(tv.page_data([failing, fine], step=1, method="m")))
    assert [b["attrs"]["data-failed"] for b in dom.find("button", cls="navbtn")] == ["1", "0"]
    assert "1 of 1 calls failed" in _Dom.text(dom.find("section", id="prompt-0")[0])


def test_a_tampered_index_json_is_escaped_or_rebuilt(tmp_path):
    _trainer(tmp_path).train()
    folder = tmp_path / "tree_view"
    index = json.loads((folder / "index.json").read_text())
    index["pages"][0]["prompts"][0]["question"] = "<script>alert(1)</script>"
    index["pages"][0]["name"] = 'x" onclick="alert(2)'
    (folder / "index.json").write_text(json.dumps(index))
    page = tv.render_index(tv.index_entries(folder))
    dom = _Dom(page)
    scripts = [el for el in dom.elements if el["tag"] == "script"]
    assert [_Dom.text(el) for el in scripts] == [tv.SCRIPT]
    assert not any(name.startswith("on") for el in dom.elements for name in el["attrs"])
    assert "<script>alert(1)</script>" in _Dom.text(dom.root)  # shown as text
    assert not any("onclick" in (a["attrs"].get("href") or "") for a in dom.find("a"))  # not a page name: no link
    (folder / "index.json").write_text('{"format": "something else"}')  # damaged: rebuilt from the saved pages
    assert [e["name"] for e in tv.index_entries(folder)] == ["step_000001"]


# ------------------------------------------------------------------------------------------------ issue 59


def _hsl_hue(rgb: str) -> float:
    import colorsys

    r, g, b = (int(v) / 255 for v in rgb.split(","))
    return colorsys.rgb_to_hls(r, g, b)[0] * 360


def test_rewards_have_a_colour_scale_of_their_own_apart_from_the_credit_signs():
    """Issue 59: red meant both "V < 0" and "reward 0", so a tree whose leaves all scored 0 read as negative credit.
    Every rule of the stylesheet that colours by the reward level (`--rl`) uses the reward hue, and that hue is far
    from each credit sign's (green, red; grey has none)."""
    style = tv.page.STYLE
    rules = [rule for rule in style.split("}") if re.search(r"var\(--rl[,)]", rule)]
    assert rules and not re.search(r"--rh[:,)]", style)  # the old red-to-green reward hue is gone
    assert all(re.findall(r"hsl\(([^ ]+) ", rule) and set(re.findall(r"hsl\(([^ ]+) ", rule)) == {"var(--rhue)"}
               for rule in rules)
    reward_hue = float(re.search(r"--rhue:(\d+)", style).group(1))
    for sign in ("pos", "neg"):
        hue = _hsl_hue(re.search(rf"\.{sign}\{{--sign:rgb\(([\d,]+)\)", style).group(1))
        assert min(abs(hue - reward_hue), 360 - abs(hue - reward_hue)) > 60, sign
    scale = re.search(r"\.scale\{[^}]*\}", style).group(0)
    assert "var(--rlow)" in scale and "var(--rhigh)" in scale and "hsl(0 " not in scale


def test_tau_leaf_advantages_and_the_credit_are_explained_on_hover():
    """Issue 59: τ, A_k and "credit likelihood" had no explanation on the page."""
    texts = ["root", "good", "bad"]
    tree = _chain_tree(texts, [1.0, 0.0], [[0, 1], [0, 2]])
    credit = {"A": torch.zeros(tree.num_turns), "q": torch.full((tree.num_turns,), 0.5), "tau": torch.tensor(2.5)}
    record = tv.tree_record(tree, credit, _decode(texts), "q", leaf_advantages=[0.7, -0.7])
    html = tv.render_page(tv.page_data([record], step=1, method="m", credit="likelihood",
                                       credit_summary="softmax over the children's behaviour log-likelihoods"))
    dom = _Dom(html)
    (tau,) = [el for el in dom.find("abbr") if _Dom.text(el).startswith("τ = 2.500")]
    assert "(K − 1)/(ρ√K)" in tau["attrs"]["title"] and "q = ½ + V/τ" in tau["attrs"]["title"]
    advantages = [el for el in dom.find(cls="adv")]
    assert advantages and all("standardised over its tree's K leaves" in el["attrs"]["title"] for el in advantages)
    (code,) = [el for el in dom.find("code") if _Dom.text(el) == "likelihood"]
    assert code["attrs"]["title"] == "softmax over the children's behaviour log-likelihoods"


@pytest.mark.parametrize("penalties, shown", [(False, False), (True, True), (None, False)])
def test_a_turns_penalty_badge_is_shown_only_where_the_credit_applied_it(penalties, shown):
    """Issue 59: a TreeOPSD page showed TreeFlex's "Q −1.00" badge on a failed call, a penalty TreeOPSD never
    applies. The page data says whether the credit applied penalties; a tree page saved without it shows none."""
    texts = ["call", "answer"]
    tree = _chain_tree(texts, [1.0, 0.0], [[0], [1]])
    record = tv.tree_record(tree, {"A": torch.zeros(tree.num_turns)}, _decode(texts), "q")
    record["nodes"][0]["penalty"] = -1.0
    dom = _Dom(tv.render_page(tv.page_data([record], step=1, method="m", penalties=penalties)))
    badges = [_Dom.text(el) for el in dom.find("span", cls="penalty")]
    assert badges == (["Q -1.00"] if shown else [])
