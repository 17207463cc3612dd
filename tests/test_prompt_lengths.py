"""A prompt longer than the model's positions deep in a dataset (issue 41, item 7) is refused when the trainer is
built, naming its row, instead of when its batch comes up mid-run; the check bounds rows without rendering them, so a
dataset of short prompts costs no tokenization (`PromptRenderer.check_dataset_prompt_lengths`)."""

import random

import pytest
from datasets import Dataset
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tests.scripted import config, contains_answer, tiny
from trl_tree import TreeOPSDConfig, TreeOPSDTrainer, trl_internals
from trl_tree.testing import calculator


def _long_text(n_chars: int, seed: int = 0) -> str:
    rng = random.Random(seed)
    words = ["Alice", "1938", "kitchen", "searched", "river's", "7", "Ω", "answers"]
    text = ""
    while len(text) < n_chars:
        text += rng.choice(words) + rng.choice([" ", ", ", ". "])
    return text


def _rows(n: int, long_row: int | None = None, conversational: bool = True) -> Dataset:
    prompts = [_long_text(30_000) if i == long_row else f"What is {i} + 1?" for i in range(n)]
    if conversational:
        prompts = [[{"role": "system", "content": "Use the calculator."}, {"role": "user", "content": p}]
                   for p in prompts]  # fmt: skip
    return Dataset.from_dict({"prompt": prompts, "answer": ["2"] * n})


def _trainer(tmp_path, dataset, **kwargs):
    model, tok = tiny()
    return TreeOPSDTrainer(model=model, reward_funcs=contains_answer, args=config(TreeOPSDConfig, tmp_path),
                           train_dataset=dataset, processing_class=tok, tools=[calculator], **kwargs)


@pytest.mark.parametrize("conversational", [True, False], ids=["conversational", "standard"])
def test_a_prompt_past_the_models_positions_deep_in_the_dataset_is_refused_when_the_trainer_is_built(
        tmp_path, conversational):
    with pytest.raises(ValueError, match=r"train_dataset row 33 renders to \d+ tokens.*max_position_embeddings = "
                       r"4096.*dataset\.filter.*when the trainer is built"):
        _trainer(tmp_path, _rows(40, long_row=33, conversational=conversational))


def test_a_long_prompt_in_an_eval_dataset_is_named_with_its_split(tmp_path):
    with pytest.raises(ValueError, match=r"eval_dataset\['held_out'\] row 2 renders to"):
        _trainer(tmp_path, _rows(4), eval_dataset={"held_out": _rows(3, long_row=2)})


def test_short_prompts_are_bounded_without_tokenizing_any_row(tmp_path, monkeypatch):
    trainer = _trainer(tmp_path, _rows(200))
    tokenized = []
    original = trl_internals.tokenize_prompts
    monkeypatch.setattr(trl_internals, "tokenize_prompts",
                        lambda t, prompts: tokenized.extend(prompts) or original(t, prompts))
    trainer._check_dataset_prompt_lengths(trainer.train_dataset)
    # one rendering with empty contents per sequence of roles (the template's overhead), no row of the dataset
    assert tokenized == [[{"role": "system", "content": ""}, {"role": "user", "content": ""}]]


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    return _trainer(tmp_path_factory.mktemp("bound"), _rows(2))


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(texts=st.lists(st.text(min_size=0, max_size=300), min_size=1, max_size=3),
       roles=st.lists(st.sampled_from(["system", "user", "assistant"]), min_size=3, max_size=3),
       standard=st.booleans())
def test_the_bound_is_never_below_the_rendered_token_count(built, texts, roles, standard):
    """The bound that lets a row skip tokenization is an upper bound of what the rendering really costs, for any
    text (any Unicode, lone surrogates aside) and sequence of roles, in both dataset formats."""
    texts = [t.encode("utf-8", "ignore").decode() for t in texts]
    prompt = texts[0] if standard else [{"role": r, "content": t} for r, t in zip(roles, texts)]
    (ids,), _, _ = trl_internals.tokenize_prompts(built, [prompt])
    assert built.prompt_renderer._prompt_token_bound(prompt, {}) >= len(ids)
