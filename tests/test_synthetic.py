"""Properties of the synthetic multi-hop world: determinism, HotpotQA schema, answerability, disjoint splits."""

import re

import pytest

from trl_tree.envs.synthetic import make_synthetic_hotpot, scripted_search_conversation, synthetic_splits
from trl_tree.rewards import exact_match_reward, extract_answer, format_reward


@pytest.fixture(scope="module")
def examples():
    return make_synthetic_hotpot(120, seed=3)


def _paragraph(example, title):
    return example["context"]["sentences"][example["context"]["title"].index(title)]


def test_same_seed_same_questions_and_different_seed_different_world():
    assert make_synthetic_hotpot(30, seed=1) == make_synthetic_hotpot(30, seed=1)
    assert make_synthetic_hotpot(30, seed=1) != make_synthetic_hotpot(30, seed=2)


def test_examples_follow_hotpotqa_distractor_schema(examples):
    for example in examples:
        assert set(example) == {"id", "question", "answer", "type", "level", "supporting_facts", "context"}
        assert example["type"] in {"bridge", "comparison"}
        context, facts = example["context"], example["supporting_facts"]
        assert len(context["title"]) == len(context["sentences"]) == 8  # 2 gold + 6 distractors
        assert len(set(context["title"])) == 8
        for title, sent_id in zip(facts["title"], facts["sent_id"]):
            assert 0 <= sent_id < len(_paragraph(example, title))
    assert {e["type"] for e in examples} == {"bridge", "comparison"}
    assert len({e["id"] for e in examples}) == len({e["question"] for e in examples}) == len(examples)


def test_num_distractors_sets_context_size():
    assert all(len(e["context"]["title"]) == 5 for e in make_synthetic_hotpot(10, num_distractors=3))


def test_bridge_questions_need_two_hops(examples):
    """The first supporting sentence names the bridge entity; the second states the answer; the question names
    only the first entity."""
    for example in (e for e in examples if e["type"] == "bridge"):
        (first, second), (first_id, second_id) = example["supporting_facts"].values()
        assert first in example["question"] and second not in example["question"]
        assert second in _paragraph(example, first)[first_id]
        assert example["answer"] in _paragraph(example, second)[second_id]


def test_comparison_answers_are_one_of_the_entities_or_yes_no(examples):
    for example in (e for e in examples if e["type"] == "comparison"):
        first, second = example["supporting_facts"]["title"]
        assert first in example["question"] and second in example["question"]
        assert example["answer"] in {first, second, "yes", "no"}


def test_answers_are_short_and_names_are_made_up_words(examples):
    for example in examples:
        assert 1 <= len(example["answer"].split()) <= 2
        for title in example["context"]["title"]:
            for word in title.split():
                assert re.fullmatch(r"[A-Z][a-z]{1,12}\.?", word), title


def test_splits_are_disjoint_questions_over_one_world():
    train, test = synthetic_splits(80, 20, seed=5)
    assert (len(train), len(test)) == (80, 20)
    assert not {e["question"] for e in train} & {e["question"] for e in test}
    assert not {e["id"] for e in train} & {e["id"] for e in test}
    paragraphs = {}
    for example in train + test:
        for title, sentences in zip(example["context"]["title"], example["context"]["sentences"]):
            assert paragraphs.setdefault(title, sentences) == sentences  # one world: a title has one paragraph
    train_titles = {t for e in train for t in e["context"]["title"]}
    assert any(t in train_titles for e in test for t in e["supporting_facts"]["title"])


def test_scripted_conversation_searches_each_hop_and_answers(examples):
    for example in examples[:20]:
        conversation = scripted_search_conversation(example)
        assert [m["role"] for m in conversation] == ["system", "user"] + ["assistant", "tool"] * 2 + ["assistant"]
        queries = [m["tool_calls"][0]["function"]["arguments"]["query"] for m in conversation if m.get("tool_calls")]
        assert queries == example["supporting_facts"]["title"]
        for query, observation in zip(queries, [m["content"] for m in conversation if m["role"] == "tool"]):
            assert observation.startswith(f"Doc 1 (Title: {query})")
        completion = conversation[2:]
        assert extract_answer(completion) == example["answer"]
        assert format_reward([None], [completion]) == [1.0]
        assert exact_match_reward([None], [completion], answer=[example["answer"]]) == [1.0]


def test_scripted_conversation_uses_a_given_search_tool(examples):
    seen = []
    conversation = scripted_search_conversation(
        examples[0], search=lambda q: seen.append(q) or "stub", include_prompt=False
    )
    assert seen == examples[0]["supporting_facts"]["title"]
    assert conversation[0]["role"] == "assistant" and conversation[1]["content"] == "stub"
