"""What a tree page says about how its trees were sampled (`trl_tree.tree_view`): the policy version that sampled
them and its staleness against the batch's π_old (issue 57 item 6; docs/design.md §9), and the branches that ended
because a call on their environment timed out (issue 56 item 3; §5, `Branch.abandoned_at`). Saved pages without
these fields (older runs) still render."""

import json
from html.parser import HTMLParser

import pytest
import torch

from tests.scripted import REPLIES, arithmetic_dataset, captured_units, scripted_trainer
from tests.test_async_rollouts import tree_trainer
from trl_tree import RolloutTree, TreeOPSDConfig, TreeOPSDTrainer, Turn, cli
from trl_tree import tree_view as tv
from trl_tree.trainer.async_rollouts import use_rollout_worker
from trl_tree.tree_view.page import ABANDONED_TITLE, POLICY_TITLE

PAYLOAD = "<img src=x onerror=alert(1)>"


class _Titles(HTMLParser):
    """Every element's class and title, and the text inside each element with a title, as a browser parses them."""

    def __init__(self, text: str):
        super().__init__(convert_charrefs=True)
        self.items, self.open, self.tags = [], [], []
        self.feed(text)

    def handle_starttag(self, tag, attrs):
        attrs = dict(attrs)
        self.tags.append(tag)
        item = {
            "tag": tag,
            "class": attrs.get("class") or "",
            "title": attrs.get("title"),
            "text": "",
            "node": attrs.get("data-node"),
        }
        self.items.append(item)
        if tag not in ("input", "br", "meta", "link"):
            self.open.append(item)

    def handle_endtag(self, tag):
        while self.open:
            if self.open.pop()["tag"] == tag:
                break

    def handle_data(self, data):
        for item in self.open:
            item["text"] += data

    def with_class(self, cls: str) -> list[dict]:
        return [i for i in self.items if cls in i["class"].split()]


def _saved(folder, prefix="step_") -> list[dict]:
    return [json.loads(p.read_text()) for p in sorted((folder / "tree_view").glob(f"{prefix}*.json"))]


def _policies(data: dict) -> set[tuple]:
    return {(r.get("policy_version"), r.get("staleness")) for r in data["prompts"]}


def _policy_facts(page: str) -> list[str]:
    """The "policy" fact of each prompt: its text, checked to carry the hover that explains it."""
    facts = [i for i in _Titles(page).items if i["tag"] == "abbr" and i["title"] == POLICY_TITLE]
    return [f["text"] for f in facts]


# ------------------------------------------------------------------------------------------------------ policy version


def test_the_synchronous_trainers_pages_show_its_own_version_and_staleness_0(tmp_path):
    """max_staleness = 0: batch b is sampled by π_old itself, version b (the weights after b generation batches)."""
    replies = {k: v * 3 for k, v in REPLIES.items()}  # two batches and an evaluation batch
    trainer = scripted_trainer(
        TreeOPSDTrainer,
        TreeOPSDConfig,
        tmp_path,
        replies,
        dataset=arithmetic_dataset(2),
        log_completions=True,
        max_steps=2,
    )
    trainer.train()
    saved = _saved(tmp_path)
    assert [_policies(d) for d in saved] == [{(0, 0)}, {(1, 0)}]
    pages = sorted((tmp_path / "tree_view").glob("step_*.html"))
    assert _policy_facts(pages[1].read_text()) == ["version 1 · staleness 0"] * len(saved[1]["prompts"])
    assert "policy version 1, staleness 0" in pages[1].read_text()  # the page's summary line
    # an evaluation batch is sampled by the weights of the moment, which need not be a version: it says none
    trainer.model.eval()
    trainer._prepare_inputs([trainer.train_dataset[0]] * trainer.num_generations_eval)
    trainer.log({})
    (evaluation,) = _saved(tmp_path, "eval_step_")
    assert _policies(evaluation) == {(None, None)}


def _async_trainer(output_dir, max_steps):
    """tests/test_async_rollouts.py's run (two trees per micro-batch, E = 2 blocks per generation batch), with pages."""
    return tree_trainer(output_dir, max_steps=max_steps, log_completions=True)


def test_pages_of_a_rollout_worker_show_the_version_that_sampled_each_batch_and_its_staleness(tmp_path):
    """max_staleness = 1: batch b is sampled by version max(0, b − 1); each page shows that version and the staleness
    the loss trained with (the micro-batches' `staleness`), as `async/policy_version` logs them."""
    trainer = _async_trainer(str(tmp_path), max_steps=6)
    use_rollout_worker(trainer, 1)
    trained = []
    micro_batches = trainer._async_rollouts.micro_batches
    trainer._async_rollouts.micro_batches = lambda item: trained.append(micro_batches(item)) or trained[-1]
    trainer.train()
    saved = _saved(tmp_path)
    assert [_policies(d) for d in saved] == [{(0, 0)}, {(0, 1)}, {(1, 1)}]
    logged = [
        (e["async/policy_version"], e["async/staleness_max"])
        for e in trainer.state.log_history
        if "async/policy_version" in e
    ]
    assert [next(iter(_policies(d))) for d in saved] == [(int(v), int(s)) for v, s in logged]
    for data, batches in zip(saved, trained):  # each tree's staleness is the one its loss used
        per_tree = torch.cat([b["staleness"] for b in batches]).tolist()
        assert [r["staleness"] for r in data["prompts"]] == per_tree
    page = sorted((tmp_path / "tree_view").glob("step_*.html"))[1].read_text()
    assert set(_policy_facts(page)) == {"version 0 · staleness 1"}


def _chain(rewards=(0.0, 1.0)) -> tuple[RolloutTree, dict]:
    """A root turn and two leaves after it, one per trajectory."""
    turns = [Turn([i], [0.0], [i]) for i in range(3)]
    tree = RolloutTree.from_trajectories([0], [turns[:2], [turns[0], turns[2]]], list(rewards))
    return tree, {"A": torch.linspace(-1, 1, tree.num_turns)}


def _decode(ids):
    return " ".join(f"t{i}" for i in ids)


def test_a_page_saved_before_the_policy_was_recorded_renders_and_says_nothing_of_it():
    tree, credit = _chain()
    old = tv.page_data([tv.tree_record(tree, credit, _decode, "q")], step=1, method="m")
    assert "policy_version" not in old["prompts"][0] and "staleness" not in old["prompts"][0]
    page = tv.render_page(old)
    assert _policy_facts(page) == [] and "staleness" not in page
    # one of the two known (a hand-edited file): the other shows as unknown
    record = tv.tree_record(tree, credit, _decode, "q", policy_version=4)
    assert _policy_facts(tv.render_page(tv.page_data([record], step=1, method="m"))) == ["version 4 · staleness ?"]


@pytest.mark.parametrize("key", ["policy_version", "staleness"])
def test_a_tampered_policy_field_is_coerced_or_rejected_by_name(tmp_path, key):
    tree, credit = _chain()
    data = tv.page_data(
        [tv.tree_record(tree, credit, _decode, "q", policy_version=3, staleness=1)], step=7, method="m"
    )
    data["prompts"][0][key] = "2"  # a number as text: coerced
    assert "2" in _policy_facts(tv.render_page(data))[0]
    data["prompts"][0][key] = PAYLOAD
    path = tmp_path / "step_000007.json"
    path.write_text(json.dumps(data))
    with pytest.raises(SystemExit, match=rf"prompts\[0\]\.{key} must be a number"):
        cli.main(["view", str(path)])
    assert not path.with_suffix(".html").exists()


# ------------------------------------------------------------------------------------------------------ abandoned


def test_a_branch_ended_by_an_abandoned_environment_call_is_marked_on_its_last_turn():
    tree, credit = _chain()
    record = tv.tree_record(tree, credit, _decode, "q", abandoned=[True, False])
    marked = {n["id"]: n["abandoned"] for n in record["nodes"] if "abandoned" in n}
    assert marked == {tree.leaf_of[0]: 1}  # trajectory 0's last turn; not trajectory 1's, nor the shared turns
    page = _Titles(tv.render_page(tv.page_data([record], step=1, method="m")))
    badges = page.with_class("abandoned")
    assert [b["text"] for b in badges] == ["environment call timed out"]
    assert badges[0]["title"] == ABANDONED_TITLE and "timed out" in badges[0]["title"]
    assert "may still" in badges[0]["title"]  # why the branch was ended, on hover
    nodes = [i for i in page.items if i["node"] is not None and "node" in i["class"].split()]
    holding = [n["node"] for n in nodes if "environment call timed out" in n["text"]]
    assert holding == [str(tree.leaf_of[0])]
    facts = [i["text"] for i in page.items if i["title"] == ABANDONED_TITLE and i["tag"] == "abbr"]
    assert facts == ["1 trajectory ended by a timed-out environment call"]
    # no branch abandoned, or an older file: no badge
    for data in (
        tv.tree_record(tree, credit, _decode, "q", abandoned=[False, False]),
        tv.tree_record(tree, credit, _decode, "q"),
    ):
        assert not _Titles(tv.render_page(tv.page_data([data], step=1, method="m"))).with_class("abandoned")
    with pytest.raises(ValueError, match="abandoned has 1 entries for the tree's 2 trajectories"):
        tv.tree_record(tree, credit, _decode, "q", abandoned=[True])


def test_a_merged_leaf_says_how_many_of_its_trajectories_were_abandoned():
    turns = [Turn([i], [0.0], [i]) for i in range(2)]
    tree = RolloutTree.from_trajectories([0], [turns, turns], [0.0, 0.0])  # two equal trajectories: one leaf, ×2
    record = tv.tree_record(tree, {"A": torch.zeros(tree.num_turns)}, _decode, "q", abandoned=[True, False])
    (badge,) = _Titles(tv.render_page(tv.page_data([record], step=1, method="m"))).with_class("abandoned")
    assert badge["title"].endswith("; 1 of the 2 trajectories ending here")


def test_a_tampered_abandoned_count_is_rejected_by_name(tmp_path):
    tree, credit = _chain()
    data = tv.page_data([tv.tree_record(tree, credit, _decode, "q", abandoned=[True, False])], step=7, method="m")
    leaf = next(i for i, n in enumerate(data["prompts"][0]["nodes"]) if "abandoned" in n)
    data["prompts"][0]["nodes"][leaf]["abandoned"] = PAYLOAD
    path = tmp_path / "step_000007.json"
    path.write_text(json.dumps(data))
    with pytest.raises(SystemExit, match=rf"nodes\[{leaf}\]\.abandoned must be a number"):
        cli.main(["view", str(path)])
    assert not path.with_suffix(".html").exists()


def test_the_trainer_marks_the_leaf_of_each_branch_its_turn_loop_ended_at_an_abandoned_call(tmp_path):
    """The turn loop sets `Branch.abandoned_at` (tests/test_tool_faults.py); the page marks that branch's leaf."""
    trainer = scripted_trainer(TreeOPSDTrainer, TreeOPSDConfig, tmp_path, log_completions=True)
    trees = captured_units(trainer)
    log_generation = trainer._log_generation

    def abandon_first_leaf(mode, result):
        branch = result.grown.leaves[0][0]
        branch.abandoned_at = len(branch.turns) - 1  # as `TurnLoop._abandon_environment` marks it
        return log_generation(mode, result)

    trainer._log_generation = abandon_first_leaf
    trainer.train()
    (data,) = _saved(tmp_path)
    tree = trees[0]
    marked = {n["id"]: n["abandoned"] for n in data["prompts"][0]["nodes"] if n.get("abandoned")}
    assert marked == {tree.leaf_of[0]: 1}
