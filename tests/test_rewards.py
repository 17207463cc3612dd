"""Properties of the QA rewards: SQuAD normalisation, EM, token F1 and its threshold, answer extraction, format; and
of the guard the trainers put around every reward function."""

import asyncio
import inspect
import math
import warnings

import pytest
from trl.trainer.utils import is_async_callable

from trl_tree.rewards import (
    exact_match_reward,
    exact_match_score,
    extract_answer,
    f1_reward,
    f1_score,
    format_reward,
    guard_reward_func,
    normalize_answer,
    thresholded_f1_reward,
)


def _call(query):
    return {"type": "function", "function": {"name": "search", "arguments": {"query": query}}}


def _conversation(final_content, earlier_content="Let me search."):
    """An agent rollout as TRL passes it to rewards: tool call, observation, final assistant message."""
    return [
        {"role": "assistant", "content": earlier_content, "tool_calls": [_call("Zorblax Inc.")]},
        {"role": "tool", "name": "search", "content": "Doc 1 (Title: Zorblax Inc.) ..."},
        {"role": "assistant", "content": final_content},
    ]


@pytest.mark.parametrize(
    "text, expected",
    [
        ("The Beatles!", "beatles"),
        ("  an   Apple, a day ", "apple day"),
        ("theater", "theater"),  # articles only as whole words
        ("U.S.A.", "usa"),
    ],
)
def test_normalize_answer_lowercases_and_drops_punctuation_articles_and_extra_space(text, expected):
    assert normalize_answer(text) == expected


def test_exact_match_ignores_case_punctuation_articles_and_takes_max_over_golds():
    assert exact_match_score("the Beatles.", "Beatles") == 1.0
    assert exact_match_score("Beatles", ["Rolling Stones", "The Beatles"]) == 1.0
    assert exact_match_score("Beatle", "Beatles") == 0.0
    assert exact_match_score(None, "Beatles") == 0.0


def test_f1_is_token_overlap_harmonic_mean_and_max_over_golds():
    assert f1_score("Barack Obama", "Obama") == pytest.approx(2 / 3)  # P = 1/2, R = 1
    assert f1_score("Obama", ["Bush", "Barack Obama"]) == pytest.approx(2 / 3)
    assert f1_score("the Paris", "Paris") == 1.0
    assert f1_score("London", "Paris") == 0.0
    assert f1_score(None, "Paris") == 0.0


def test_f1_gives_no_partial_credit_to_yes_no_answers():
    """HotpotQA's rule: "no" shares a token with "no way" but is a different answer."""
    assert f1_score("no", "no way") == 0.0
    assert f1_score("yes it is", "yes") == 0.0
    assert f1_score("Yes.", "yes") == 1.0


def test_thresholded_f1_pays_f1_at_or_above_threshold_and_zero_below():
    golds = {"answer": ["x1"]}
    five = [_conversation("<answer> x1 x2 x3 x4 x5 </answer>")]  # F1 = 2 * (1/5) / (6/5) = 1/3 >= 0.3
    six = [_conversation("<answer> x1 x2 x3 x4 x5 x6 </answer>")]  # F1 = 2/7 ~ 0.286 < 0.3
    assert f1_reward([None], five, **golds) == [pytest.approx(1 / 3)]
    assert f1_reward([None], six, **golds) == [0.0]
    lenient = thresholded_f1_reward(threshold=0.2)
    assert lenient([None], six, **golds) == [pytest.approx(2 / 7)]
    assert lenient.__name__ != f1_reward.__name__  # TRL logs rewards by name: they must not collide


def test_extract_answer_reads_last_span_of_final_assistant_message():
    conversation = _conversation(
        "I thought <answer> Paris </answer> but no. <answer> Lyon </answer>", earlier_content="<answer> Nice </answer>"
    )
    assert extract_answer(conversation) == "Lyon"
    assert extract_answer(_conversation("No idea.", earlier_content="<answer> Nice </answer>")) is None
    assert extract_answer("reasoning... <answer>\n Lyon \n</answer>") == "Lyon"
    assert extract_answer([{"role": "assistant", "content": [{"type": "text", "text": "<answer>Lyon</answer>"}]}]) == (
        "Lyon"
    )
    assert extract_answer([{"role": "tool", "content": "<answer> Paris </answer>"}]) is None


def test_exact_match_reward_scores_each_completion_against_its_gold():
    completions = [_conversation("<answer> The Beatles </answer>"), _conversation("<answer> Queen </answer>"), "x"]
    assert exact_match_reward([None] * 3, completions, answer=["beatles", "ABBA", "x"]) == [1.0, 0.0, 0.0]


def test_rewards_name_the_missing_answer_column():
    with pytest.raises(ValueError, match="`answer`"):
        f1_reward([None], ["<answer> x </answer>"], question=["q"])


def test_format_reward_requires_one_answer_span_and_parsed_tool_calls():
    good = _conversation("So the answer is <answer> Lyon </answer>")
    two_spans = _conversation("<answer> Lyon </answer> <answer> Paris </answer>")
    empty_span = _conversation("<answer>  </answer>")
    unclosed = _conversation("<answer> Lyon")
    unparsed = [{"role": "assistant", "content": '<tool_call>{"name": "search"'}, good[-1]]
    bad_arguments = [{"role": "assistant", "content": "", "tool_calls": [{"type": "function", "function": {}}]}]
    pending = [{"role": "assistant", "content": "<answer> Lyon </answer>", "tool_calls": [_call("Lyon")]}]
    completions = [good, two_spans, empty_span, unclosed, unparsed, bad_arguments + good[1:], pending]
    assert format_reward([None] * len(completions), completions) == [1.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0]
    assert format_reward([None, None], ["<answer> Lyon </answer>", "Lyon"]) == [1.0, 0.0]


# ---------------------------------------------------------------------------------------------------------------
# The reward-function guard: one rule for sync and async functions
# ---------------------------------------------------------------------------------------------------------------


def _scores(value):
    """Rewards of completions "2", "I do not know", "3": `value` for the second, 1.0 for the others."""

    def partial_reward(completions, **kwargs):
        return [value if "know" in c else 1.0 for c in completions]

    async def async_partial_reward(completions, **kwargs):
        await asyncio.sleep(0)
        return partial_reward(completions)

    return partial_reward, async_partial_reward


def _guarded(func):
    guarded = guard_reward_func(func, "partial_reward")
    assert is_async_callable(guarded) == is_async_callable(func)  # TRL must still await an async function
    return guarded


def _call_guarded(guarded):
    """A guarded function called as TRL calls it (an async one awaited, as on GRPOTrainer's event loop)."""
    out = guarded(prompts=[None] * 3, completions=["2", "I do not know", "3"])
    return asyncio.run(out) if inspect.isawaitable(out) else out


def _run_guarded(func):
    return _call_guarded(_guarded(func))


@pytest.mark.parametrize("kind", [0, 1], ids=["sync", "async"])
def test_nan_from_a_sync_or_async_reward_function_is_none_and_warns_once(kind):
    """GRPOTrainer cannot tell a NaN from a None (it turns None into NaN and skips NaN in nansum / nanmean): either
    means "does not apply to this sample". The guard says so for both kinds, warning once per function, because a NaN
    is often a bug that a None would not be."""
    guarded = _guarded(_scores(math.nan)[kind])
    with pytest.warns(UserWarning, match=r"'partial_reward' returned nan for sample 1 .*None"):
        assert _call_guarded(guarded) == [1.0, None, 1.0]
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # said once: a function that returns NaN does so every batch
        assert _call_guarded(guarded) == [1.0, None, 1.0]


@pytest.mark.parametrize("kind", [0, 1], ids=["sync", "async"])
def test_none_passes_the_guard_silently_for_sync_and_async_reward_functions(kind):
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert _run_guarded(_scores(None)[kind]) == [1.0, None, 1.0]


@pytest.mark.parametrize("kind", [0, 1], ids=["sync", "async"])
def test_an_infinite_reward_is_an_error_for_sync_and_async_reward_functions(kind):
    """±inf has no GRPO meaning: it would make every advantage of the group inf or NaN, and a tree's backed-up values
    with it."""
    with pytest.raises(ValueError, match=r"'partial_reward' returned inf for sample 1 .*finite"):
        _run_guarded(_scores(math.inf)[kind])


@pytest.mark.parametrize("kind", [0, 1], ids=["sync", "async"])
def test_a_reward_of_the_wrong_kind_is_named_for_sync_and_async_reward_functions(kind):
    with pytest.raises(TypeError, match=r"'partial_reward' returned 'high' \(str\) for sample 1"):
        _run_guarded(_scores("high")[kind])
