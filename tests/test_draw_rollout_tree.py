"""scripts/draw_rollout_tree.py: the README's tree picture is drawn from page data the trainer saved."""

import importlib.util
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PAGE = ROOT / "docs" / "images" / "rollout_tree_smollm2.json"


@pytest.fixture(scope="module")
def draw():
    spec = importlib.util.spec_from_file_location("draw_rollout_tree", ROOT / "scripts" / "draw_rollout_tree.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_a_turn_is_labelled_by_what_it_did(draw):
    call = '<think>\n</think>\n<tool_call>\n{"name": "search", "arguments": {"query": "Stulbes"}}\n</tool_call>'
    assert draw.action_label(call) == "search: Stulbes"
    assert draw.action_label("<answer> 1983 </answer>") == "answer: 1983"
    assert draw.action_label('<tool_call>{"name": "calculator", "arguments": {}}</tool_call>') == "calculator(…)"
    assert draw.action_label("I think the answer is 4") == "no call / malformed"


def test_each_parent_sits_over_its_children_and_every_leaf_has_its_own_column(draw):
    records = draw.records_from_page(PAGE)
    for record in records:
        place = draw.layout(record)
        turns = [n for n in record["nodes"] if n.get("kind", "turn") == "turn"]
        assert set(place) == {n["id"] for n in turns}
        for n in turns:
            kids = [place[c["id"]][0] for c in turns if c["parent"] == n["id"]]
            if kids:
                assert min(kids) <= place[n["id"]][0] <= max(kids)
                assert all(place[c["id"]][1] == place[n["id"]][1] + 1 for c in turns if c["parent"] == n["id"])
        leaf_columns = [place[n["id"]][0] for n in turns if not any(c["parent"] == n["id"] for c in turns)]
        assert len(set(leaf_columns)) == len(leaf_columns)


def test_continuations_are_the_turns_a_later_trajectory_created(draw):
    record = {"paths": [[0, 1], [0, 2]], "nodes": [
        {"id": 0, "parent": -1}, {"id": 1, "parent": 0}, {"id": 2, "parent": 0}]}
    assert draw.branched_here(record) == {2}


def test_the_readmes_picture_is_drawn_from_the_saved_page(draw, tmp_path):
    out = tmp_path / "tree.png"
    draw.main([str(PAGE), "--out", str(out)])
    assert out.stat().st_size > 10_000
    with pytest.raises(SystemExit, match="prompts 0 to 3"):
        draw.main([str(PAGE), "--prompt", "9", "--out", str(out)])
    with pytest.raises(SystemExit, match="log_completions=True"):
        draw.main([str(tmp_path), "--out", str(out)])
