"""The rollout-tree view (`trl_tree.tree_view`): with `log_completions` every method writes a page per generation batch
whose content is the trainer's own tree and credit; `trl-tree view RUN_DIR` renders it again from the saved data;
untrusted text cannot run code in the viewer's browser; huge trees are cut with a note. The page's reading aids (the
question, gold answer and reward spread in the prompt list, leaf colours, paths, Δp, the minimap, the run's index)
are in tests/test_tree_view_page.py; W&B and Trackio for real in tests/test_tree_view_trackers.py."""

import json
import math
from html.parser import HTMLParser

import pytest
import torch

from tests.scripted import (
    AFTER_TOOL,
    REPLIES,
    TAU,
    TWO_ROLE_FIELDS,
    TwoRoleScript,
    arithmetic_dataset,
    captured_units,
    config,
    contains_answer,
    math_entropy_script,
    scripted_engine,
    scripted_trainer,
    tiny,
)
from trl_tree import (
    AT2POConfig,
    AT2POTrainer,
    RolloutTree,
    TreeAdvConfig,
    TreeAdvTrainer,
    TreeFlexConfig,
    TreeFlexTrainer,
    TreeOPSDConfig,
    TreeOPSDTrainer,
    Turn,
    cli,
    losses,
)
from trl_tree import credit as credit_lib
from trl_tree import tree_view as tv
from trl_tree.core.batch import LossInputs, TurnCredit
from trl_tree.core.packing import PackedTrees, packed_token_logps
from trl_tree.testing import calculator
from trl_tree.trainer.observability import tree_view_logging

# ------------------------------------------------------------------------------------------------------ helpers


class _Page(HTMLParser):
    """The page's nodes (their data-* attributes) and its <script> elements, as a browser would parse them."""

    def __init__(self, text: str):
        super().__init__(convert_charrefs=True)
        self.nodes, self.scripts, self.text = [], [], []
        self._in_script = False
        self.feed(text)

    def handle_starttag(self, tag, attrs):
        attrs = dict(attrs)
        if tag == "script":
            self._in_script = True
            self.scripts.append("")
        if tag == "div" and "node" in (attrs.get("class") or "").split():
            self.nodes.append(attrs)
        if any(name.startswith("on") for name in attrs):  # an event-handler attribute would run code
            self.scripts.append(f"handler on <{tag}>")

    def handle_endtag(self, tag):
        if tag == "script":
            self._in_script = False

    def handle_data(self, data):
        if self._in_script:
            self.scripts[-1] += data
        else:
            self.text.append(data)

    def turns(self) -> list[dict]:
        return [n for n in self.nodes if n.get("data-kind") == "turn"]


def _credit_per_unit(trainer) -> list[dict[str, list[float]]]:
    """Every tree's (group's) per-turn credit as the loss read it: the buffered micro-batches of the last generation
    batch, in unit order."""
    out = []
    for batch in trainer._buffered_inputs:
        credit = TurnCredit.from_dict(batch)
        per_turn = {k: v for k, v in credit.present().items() if k not in credit.per_unit_fields()}
        for n, count in enumerate(credit.count.tolist()):
            out.append({key: value[n, :count].tolist() for key, value in per_turn.items()})
    return out


def _only_page(tmp_path, prefix="step_"):
    pages = sorted((tmp_path / "tree_view").glob(f"{prefix}*.html"))
    assert len(pages) == 1, pages
    data = json.loads(pages[0].with_suffix(".json").read_text())
    return pages[0], data, _Page(pages[0].read_text())


def _assert_turns_once_with_credit(page: _Page, data: dict, credits: list[dict], keys=("A",)):
    """Every unique turn of every prompt is drawn exactly once, with the trainer's credit for it."""
    sections = page.turns()
    assert len(data["prompts"]) == len(credits)
    offset = 0
    for record, credit in zip(data["prompts"], credits):
        turns = sections[offset : offset + record["num_turns"]]
        offset += record["num_turns"]
        assert sorted(int(n["data-node"]) for n in turns) == list(range(record["num_turns"]))
        for node in turns:
            i = int(node["data-node"])
            for key in keys:
                assert math.isclose(float(node[f"data-{key.lower()}"]), credit[key][i], rel_tol=1e-6, abs_tol=1e-7)
    assert offset == len(sections)


def _tree_trainer(cls, config_cls, tmp_path, replies=REPLIES, **overrides):
    trainer = scripted_trainer(cls, config_cls, tmp_path, replies, log_completions=True, **overrides)
    return trainer, captured_units(trainer)


# ------------------------------------------------------------------------------------------------------ methods


def test_treeopsd_page_shows_each_unique_turn_once_with_its_credit_rewards_and_p_after_the_update(tmp_path):
    trainer, trees = _tree_trainer(TreeOPSDTrainer, TreeOPSDConfig, tmp_path, target_radius=0.25)
    trainer.train()
    path, data, page = _only_page(tmp_path)
    tree, credit = trees[0], _credit_per_unit(trainer)
    _assert_turns_once_with_credit(page, data, credit, keys=("A", "q"))
    nodes = {int(n["data-node"]): n for n in page.turns()}
    for i, turn in enumerate(tree.turns):
        assert int(nodes[i]["data-multiplicity"]) == turn.multiplicity
        ending = [tree.rewards[k] for k, leaf in enumerate(tree.leaf_of) if leaf == i]
        assert json.loads(nodes[i].get("data-rewards", "[]")) == ending  # leaves carry their rewards
    A_k = credit_lib.standardize(torch.tensor(tree.rewards, dtype=torch.float64)).tolist()  # T1
    for node in data["prompts"][0]["nodes"]:
        assert node.get("leaf_advantages", []) == pytest.approx([A_k[k] for k in node["trajectories"]])
    assert max(t.multiplicity for t in tree.turns) == 2  # the scripted tree has a merged leaf: shown as ×2
    assert "×2" in "".join(page.text)
    # p after the update = σ(mean log-ratio) of the trained model on the very rows it trained, per turn
    batch = trainer._buffered_inputs[0]
    packed = PackedTrees.from_dict(batch)
    with torch.no_grad():
        logps, _ = packed_token_logps(trainer.model, packed)
    flat = LossInputs.build(packed.turn_ids, logps, batch["old_logps"], TurnCredit.from_dict(batch))
    s = losses.turn_mean_log_ratio(flat.logps, flat.old_logps, flat.turn_ids, tree.num_turns)
    for i in range(tree.num_turns):
        assert math.isclose(float(nodes[i]["data-p-after"]), torch.sigmoid(s[i]).item(), rel_tol=1e-5)
    assert any(abs(float(n["data-p-after"]) - 0.5) > 1e-4 for n in nodes.values())  # the update moved them
    assert "after 1 of the 1 optimizer steps" in data["after_note"]


def test_at2po_page_marks_the_expansion_round_of_each_new_turn(tmp_path):
    # AT2PO expands after all M trajectories end, so the re-sampled turn answers last: "3", a new history
    replies = {**REPLIES, AFTER_TOOL: ["The answer is 2.", "The answer is 3.", "The answer is 2."]}
    trainer, trees = _tree_trainer(AT2POTrainer, AT2POConfig, tmp_path, replies=replies, num_initial_rollouts=2,
                                   expansion_rounds=1, branches_per_round=1)
    trainer.train()
    _, data, page = _only_page(tmp_path)
    _assert_turns_once_with_credit(page, data, _credit_per_unit(trainer))
    tree = trees[0]
    rounds = {int(n["data-node"]): int(n["data-round"]) for n in page.turns()}
    # a turn is as old as the earliest trajectory through it: the re-sampled branch (the last one) adds round-1 turns
    created_by_expansion = set(tree.paths[-1]) - {i for path in tree.paths[:-1] for i in path}
    assert created_by_expansion and all(rounds[i] == 1 for i in created_by_expansion)
    assert all(rounds[i] == 0 for i in set(range(tree.num_turns)) - created_by_expansion)


def test_treeadv_page_shows_token_level_branch_points(tmp_path):
    trainer = scripted_trainer(TreeAdvTrainer, TreeAdvConfig, tmp_path, script=math_entropy_script(), tools=None,
                               num_initial_rollouts=2, entropy_threshold=TAU, max_branches_per_tree=2,
                               min_segment_length=3, max_turns=1, log_completions=True)
    trees = captured_units(trainer)
    trainer.train()
    _, data, page = _only_page(tmp_path)
    _assert_turns_once_with_credit(page, data, _credit_per_unit(trainer))
    partial = {int(n["data-node"]) for n in page.turns() if n.get("data-partial")}
    assert partial == {i for i, t in enumerate(trees[0].turns) if t.partial} and partial
    assert "✂ tokens 0–" in "".join(page.text)  # a segment that stops inside its assistant turn


def test_treeflex_page_shows_searches_blocks_and_turn_credit(tmp_path):
    trainer = scripted_trainer(TreeFlexTrainer, TreeFlexConfig, tmp_path, script=TwoRoleScript, log_completions=True,
                               **TWO_ROLE_FIELDS)
    groups = captured_units(trainer)
    trainer.train()
    _, data, page = _only_page(tmp_path)
    _assert_turns_once_with_credit(page, data, _credit_per_unit(trainer))
    group = groups[0]
    kinds = [n["data-kind"] for n in page.nodes]
    assert kinds.count("search") == len(group.searches) and kinds.count("block") == len(group.trees)
    searches = [n for n in page.nodes if n["data-kind"] == "search"]
    assert [json.loads(n["data-rewards"]) for n in searches] == [[r] for r in group.scores.tolist()]


def test_an_evaluation_batch_gets_a_page_without_after_probabilities(tmp_path):
    trainer, _ = _tree_trainer(TreeOPSDTrainer, TreeOPSDConfig, tmp_path)
    trainer.model.eval()
    trainer._prepare_inputs([trainer.train_dataset[0]] * trainer.num_generations_eval)
    trainer.log({})
    _, data, page = _only_page(tmp_path, prefix="eval_step_")
    assert data["mode"] == "eval" and page.turns()
    assert all("data-p-after" not in n for n in page.turns())


# ------------------------------------------------------------------------------------------------------ re-render


def test_trl_tree_view_renders_the_saved_pages_again_without_accelerate(tmp_path, monkeypatch, capsys):
    trainer, _ = _tree_trainer(TreeOPSDTrainer, TreeOPSDConfig, tmp_path)
    trainer.train()
    path, _, _ = _only_page(tmp_path)
    original = path.read_text()
    path.unlink()
    monkeypatch.setattr(cli, "launch", lambda *a, **k: pytest.fail("view must not go through accelerate launch"))
    assert cli.main(["view", str(tmp_path)]) == 0
    assert path.read_text() == original
    assert str(path) in capsys.readouterr().out
    out = tmp_path / "elsewhere"
    assert cli.main(["view", str(path.with_suffix(".json")), "--out", str(out), "--max-nodes", "1"]) == 0
    assert "nodes are not shown" in (out / path.name).read_text()


def test_view_of_a_folder_without_saved_data_says_what_to_do(tmp_path):
    with pytest.raises(SystemExit, match="log_completions=True"):
        cli.main(["view", str(tmp_path)])
    (tmp_path / "x.json").write_text('{"some": "json"}')
    with pytest.raises(SystemExit, match="not tree-view data"):
        cli.main(["view", str(tmp_path / "x.json")])


# ------------------------------------------------------------------------------------------------------ bad input

HOSTILE = '<script>alert(1)</script>\x1b[31m\x00 <img src=x onerror="alert(2)"> \u202eevil" onclick="alert(3)'


def _tree_with_text(texts: list[str]) -> tuple[RolloutTree, dict]:
    """A chain of turns (token id = index into `texts`), and a decode that returns the text of each id."""
    turns = [Turn([i], [0.0], [i]) for i in range(len(texts))]
    tree = RolloutTree.from_trajectories([0], [turns[:1], turns], [0.0, 1.0])
    credit = {"A": torch.linspace(-1, 1, tree.num_turns), "q": torch.full((tree.num_turns,), 0.5)}
    return tree, credit


def _decode_with(texts):
    return lambda ids: "".join(texts[i] for i in ids)


def test_model_and_tool_text_cannot_run_code_in_the_page():
    texts = [HOSTILE, "fine", "</pre></div></body>" + HOSTILE]
    tree, credit = _tree_with_text(texts)
    record = tv.tree_record(tree, credit, _decode_with(texts), [{"role": "user", "content": HOSTILE}],
                            reward_columns={HOSTILE: [1.0, None]})
    page_text = tv.render_page(tv.page_data([record], step=1, method=HOSTILE, credit=HOSTILE))
    page = _Page(page_text)
    assert page.scripts == [tv.SCRIPT]  # the page's own script only: no <script> and no on* handler from the data
    assert "\x1b" not in page_text and "\x00" not in page_text and "\u202e" not in page_text
    shown = "".join(page.text)
    assert "<script>alert(1)</script>" in shown and "\\x1b[31m" in shown and "\\u202e" in shown  # shown as text
    assert len(page.turns()) == tree.num_turns
    # a hand-edited data file (`trl-tree view` renders saved JSON) cannot add attributes either
    record["nodes"][0]["credit"]['x" onmouseover="alert(4)'] = 1.0
    record["nodes"][1]["kind"] = 'turn" onclick="alert(5)'
    assert _Page(tv.render_page(tv.page_data([record], step=1, method="m"))).scripts == [tv.SCRIPT]


PAYLOAD = '<img src=x onerror=alert(1)><script>alert(2)</script>"><b onclick=alert(3)>'


class _Tags(HTMLParser):
    """Every start tag of a page, as a browser would parse it."""

    def __init__(self, text: str):
        super().__init__(convert_charrefs=True)
        self.tags = []
        self.feed(text)

    def handle_starttag(self, tag, attrs):
        self.tags.append(tag)


def _saved_step(tmp_path, edit):
    """A step file as a run saves it (texts from every kind of node), then `edit(data)` as an attacker would."""
    texts = ["a", "b", "c"]
    tree, credit = _tree_with_text(texts)
    record = tv.tree_record(tree, credit, _decode_with(texts), "q", reward_columns={"r": [1.0, None]},
                            leaf_advantages=[0.5, -0.5], leaf_rounds=[0, 1], with_entropy=True)
    block = dict(record["nodes"][1], kind="block", label="block", context="ctx", context_tokens=3)
    record["nodes"].insert(1, {**block, "id": 99, "parent": 0})
    data = tv.page_data([record], step=7, method="m", credit="likelihood", after_note="note")
    edit(data)
    path = tmp_path / "tree_view" / "step_000007.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(data))
    return path


def test_a_tampered_step_file_cannot_run_code_in_the_page(tmp_path):
    def every_text(data):
        data.update(method=PAYLOAD, mode=PAYLOAD, credit=PAYLOAD, after_note=PAYLOAD)
        record = data["prompts"][0]
        record.update(kind=PAYLOAD, prompt=PAYLOAD, num_leaves="2", num_turns="3")  # numbers as text: coerced
        record["per_tree"][PAYLOAD] = 1.0
        for node in record["nodes"]:
            node.update(label=PAYLOAD, action=PAYLOAD, observation=PAYLOAD, context=PAYLOAD)
            node["credit"][PAYLOAD] = 0.5
            node["reward_columns"] = {PAYLOAD: [1.0]}
        record["nodes"][-1]["kind"] = PAYLOAD

    path = _saved_step(tmp_path, every_text)
    assert cli.main(["view", str(path)]) == 0
    page_text = path.with_suffix(".html").read_text()
    assert "<img" not in page_text and "<b " not in page_text and page_text.count("<script") == 1
    assert _Page(page_text).scripts == [tv.SCRIPT] and "img" not in _Tags(page_text).tags
    assert PAYLOAD in "".join(_Page(page_text).text)  # shown as text
    for sink in ("innerHTML", "outerHTML", "insertAdjacentHTML", "document.write"):  # the script builds no HTML
        assert sink not in tv.SCRIPT


@pytest.mark.parametrize("where", [
    "num_leaves", "num_turns", "prompt_tokens", "rewards.0", "per_tree.tau", "nodes.0.tokens", "nodes.0.id",
    "nodes.0.multiplicity", "nodes.0.entropy", "nodes.0.penalty", "nodes.0.round", "nodes.0.credit.A",
    "nodes.0.turn_offset", "nodes.0.observation_tokens", "nodes.1.context_tokens", "nodes.0.rewards.0",
    "nodes.0.leaf_advantages.0", "nodes.0.reward_columns.r.0", "step",
])
def test_a_number_of_a_tampered_step_file_that_is_no_number_is_rejected_by_name(tmp_path, where):
    def edit(data):
        keys = where.split(".")
        holder = data if keys[0] == "step" else data["prompts"][0]
        for key in keys[:-1]:
            holder = holder[int(key)] if isinstance(holder, list) else holder[key]
        holder[int(keys[-1]) if isinstance(holder, list) else keys[-1]] = "<img src=x onerror=alert(1)>"

    path = _saved_step(tmp_path, edit)
    with pytest.raises(SystemExit, match=rf"{path.name}.*{where.split('.')[-1] if where[-1] != '0' else ''}.*number"):
        cli.main(["view", str(path)])
    assert not path.with_suffix(".html").exists()


INVISIBLE = "\u061c\u200b\u200c\u200d\u2060\ufeff\U000e0001\U000e0041\U000e007f"


def test_invisible_characters_are_shown_as_visible_markers():
    text = f"pay{INVISIBLE}here"
    cleaned = tv.clean_text(text)
    assert not any(ch in cleaned for ch in INVISIBLE)
    for marker in ("\\u061c", "\\u200b", "\\u200c", "\\u200d", "\\u2060", "\\ufeff", "\\U000e0001", "\\U000e0041",
                   "\\U000e007f"):
        assert marker in cleaned
    tree, credit = _tree_with_text([text, text])
    page = tv.render_page(tv.page_data([tv.tree_record(tree, credit, _decode_with([text, text]), text)], step=0,
                                       method="m"))
    assert not any(ch in page for ch in INVISIBLE) and "\\U000e0041" in page


def test_a_huge_tree_is_cut_with_a_note_and_shown_nodes_keep_their_ancestors():
    texts = [f"turn {i} " + "x" * 50 for i in range(400)]
    chains = [[Turn([0], [0.0])] + [Turn([i], [0.0]) for i in range(1, j)] for j in range(2, 400, 3)]
    tree = RolloutTree.from_trajectories([0], chains, [float(k % 2) for k in range(len(chains))])
    record = tv.tree_record(tree, {"A": torch.zeros(tree.num_turns)}, _decode_with(texts), "q")
    page = _Page(tv.render_page(tv.page_data([record], step=3, method="m"), max_nodes=60))
    shown = {int(n["data-node"]) for n in page.turns()}
    assert len(shown) == 60
    assert all(tree.turns[i].parent in shown or tree.turns[i].parent == -1 for i in shown)
    assert f"{tree.num_turns - 60} of {tree.num_turns} nodes are not shown" in " ".join(page.text)
    by_chars = _Page(tv.render_page(tv.page_data([record], step=3, method="m"), max_chars=2000))
    assert 0 < len(by_chars.turns()) < 40 and "nodes are not shown" in " ".join(by_chars.text)


def test_long_texts_are_cut_in_the_data_and_folded_on_the_page():
    texts = ["a" * (tv.MAX_ACTION_CHARS + 10), "b" * 500]
    tree, credit = _tree_with_text(texts)
    record = tv.tree_record(tree, credit, _decode_with(texts), "q")
    assert record["nodes"][0]["action"].endswith("[10 more characters not saved]")
    assert "<details" in tv.render_page(tv.page_data([record], step=0, method="m"))


def test_credit_of_another_tree_is_rejected_with_the_reason():
    tree, _ = _tree_with_text(["a", "b"])
    with pytest.raises(ValueError, match="credit .A. has 5 values for 3 turns"):
        tv.tree_record(tree, {"A": torch.zeros(5)}, _decode_with(["a", "b"]), "q")


# ------------------------------------------------------------------------------------------------------ trackers


def test_the_trainer_logs_each_finished_page_once_on_the_main_process(tmp_path, monkeypatch):
    sent = []
    monkeypatch.setattr(tree_view_logging, "log_page_to_trackers",
                        lambda page, report_to, **kw: sent.append((page, kw)))
    trainer, _ = _tree_trainer(TreeOPSDTrainer, TreeOPSDConfig, tmp_path)
    trainer.train()  # logs at step 1 and at the end of training: the page goes out once
    path, data, _ = _only_page(tmp_path)
    # the tracker's copy is the same page without the links to the files beside it (they are not beside it there)
    assert sent == [(tv.render_page(data), {"step": 1, "caption": f"train step 1: {path}"})]
    assert 'href="index.html"' in path.read_text() and 'href="index.html"' not in sent[0][0]


def test_every_generation_batch_gets_a_page_in_the_readmes_python_example_setting(tmp_path, monkeypatch):
    """Issue 41 item 3: the README's Python example (max_steps=2, one generation batch per optimizer step,
    logging_steps at its default 10) wrote one page for its two batches: pages followed the logging steps."""
    from tests.test_docs import _readme_block

    example = _readme_block("Try it in Python", "python")
    assert "max_steps=2" in example and "logging_steps" not in example and "steps_per_generation" not in example
    sent = []
    monkeypatch.setattr(tree_view_logging, "log_page_to_trackers",
                        lambda page, report_to, **kw: sent.append(kw["step"]))
    replies = {k: v * 2 for k, v in REPLIES.items()}
    trainer = scripted_trainer(TreeOPSDTrainer, TreeOPSDConfig, tmp_path, replies, dataset=arithmetic_dataset(2),
                               log_completions=True, max_steps=2, logging_steps=10)
    assert trainer.args.steps_per_generation * trainer.num_iterations == trainer.args.gradient_accumulation_steps
    trainer.train()
    folder = tmp_path / "tree_view"
    assert sorted(p.name for p in folder.glob("step_*.html")) == ["step_000001.html", "step_000002.html"]
    saved = [json.loads((folder / f"step_00000{i}.json").read_text()) for i in (1, 2)]
    assert [(d["step"], d["batch"], d["batches"]) for d in saved] == [(1, 1, 1), (2, 2, 1)]
    assert sent == [1, 2]  # both pages reach the trackers, each at its own step, at the next log
    index = (folder / "index.html").read_text()
    assert "One page per generation batch (each page: 1 batch" in index
    assert "generation batch 1" in index and "generation batch 2" in index


def test_the_pages_templates_stylesheet_and_script_are_package_data_inlined_into_every_page():
    """An installed wheel must carry the page's assets: each file under trl_tree/tree_view/assets/ (the stylesheet,
    the script, the templates) matches a package-data pattern of pyproject.toml, and a page inlines the stylesheet
    and the script (one self-contained file)."""
    import fnmatch
    import re
    from pathlib import Path

    root = Path(tv.__file__).resolve().parents[2]
    block = re.search(r"^trl_tree = \[(.*)\]", (root / "pyproject.toml").read_text(), flags=re.M)
    patterns = re.findall(r'"([^"]+)"', block.group(1))
    folder = root / "trl_tree/tree_view/assets"
    assets = sorted(p.relative_to(root / "trl_tree").as_posix() for p in folder.rglob("*") if p.is_file())
    assert {"tree_view/assets/view.css", "tree_view/assets/view.js", "tree_view/assets/templates/document.html",
            "tree_view/assets/templates/tree.html", "tree_view/assets/templates/index.html"} <= set(assets)
    assert all(any(fnmatch.fnmatch(a, pattern) for pattern in patterns) for a in assets)
    page = tv.render_page(tv.page_data([], step=1, method="m"))
    assert tv.STYLE in page and tv.SCRIPT in page and page.startswith("<!DOCTYPE html>")
    assert "<link" not in page and "src=" not in page  # nothing loaded from elsewhere


def test_without_log_completions_nothing_is_collected_or_written(tmp_path):
    model, tok = tiny()
    args = config(TreeOPSDConfig, tmp_path)
    trainer = TreeOPSDTrainer(model=model, reward_funcs=contains_answer, args=args,
                              train_dataset=arithmetic_dataset(1), processing_class=tok, tools=[calculator])
    trainer.generation_engine = scripted_engine(tok, REPLIES)
    trainer.train()
    assert trainer._tree_view is None and not (tmp_path / "tree_view").exists()
