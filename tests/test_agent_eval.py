"""The evaluation agent loop renders, parses and observes exactly like the trainer, and scores what it is given."""

import json

import pytest

from tests.scripted import config, tiny
from trl_tree import TreeOPSDConfig, TreeOPSDTrainer
from trl_tree.envs import build_corpus, examples_to_dataset, make_search_tool, scripted_search_conversation
from trl_tree.envs.agent_eval import AgentSettings, AgentTemplate, GreedyEngine, evaluate_agent
from trl_tree.envs.hotpot import BM25Retriever
from trl_tree.envs.synthetic import make_synthetic_hotpot
from trl_tree.testing import ScriptedEngine


@pytest.fixture(scope="module")
def world(tmp_path_factory):
    examples = make_synthetic_hotpot(6, seed=11)
    search = make_search_tool(BM25Retriever(build_corpus(examples), cache_dir=tmp_path_factory.mktemp("bm25")))
    return examples, list(examples_to_dataset(examples)), search


def test_prompt_observation_and_parsing_match_the_trainers(world, tmp_path):
    examples, rows, search = world
    model, tok = tiny()
    trainer = TreeOPSDTrainer(
        model=model,
        reward_funcs=lambda completions, **kw: [0.0] * len(completions),
        args=config(TreeOPSDConfig, tmp_path),
        train_dataset=examples_to_dataset(examples),
        processing_class=tok,
        tools=[search],
    )
    template = AgentTemplate(tok, [search])
    prompt_ids, _, _ = trainer._tokenize_prompts([rows[0]["prompt"]])
    assert template.prompt_ids(rows[0]["prompt"]) == list(prompt_ids[0])
    tool_messages = [
        {"role": "tool", "name": "search", "content": search(examples[0]["supporting_facts"]["title"][0])}
    ]
    assert template.observation_ids(tool_messages) == list(trainer._get_tool_suffix_ids(tool_messages))
    call = tok.encode(
        '<tool_call>\n{"name": "search", "arguments": {"query": "x"}}\n</tool_call><|im_end|>',
        add_special_tokens=False,
    )
    assert template.parse(call, list(prompt_ids[0])) == trainer._parse_action(call, list(prompt_ids[0]))


def _oracle_engine(tok, examples):
    """Replays each question's scripted search conversation turn by turn (keyed by the question in the prefix)."""
    turns = {}
    for example in examples:
        conversation = scripted_search_conversation(example, search=lambda q: "")
        turns[example["question"]] = [m for m in conversation if m["role"] == "assistant"]
    eos = tok.convert_tokens_to_ids("<|im_end|>")

    def script(prefix):
        text = tok.decode(prefix)
        question = next(q for q in turns if q in text)
        message = turns[question][text.count("<|im_start|>assistant") - 1]
        rendered = message["content"]
        for call in message.get("tool_calls") or []:
            arguments = json.dumps(call["function"]["arguments"])
            rendered += f'\n<tool_call>\n{{"name": "search", "arguments": {arguments}}}\n</tool_call>'
        return tok.encode(rendered, add_special_tokens=False) + [eos]

    return ScriptedEngine(script, [eos])


def _oracle_result(world, max_turns):
    """The oracle's evaluation on every question of the world, under a turn limit."""
    examples, rows, search = world
    _, tok = tiny()
    settings = AgentSettings(max_turns=max_turns, max_completion_length=2048)
    return evaluate_agent(None, tok, rows, [search], settings, engine=_oracle_engine(tok, examples))


def test_an_agent_that_searches_both_hops_and_answers_scores_one(world):
    result = _oracle_result(world, max_turns=5)
    assert (result.exact_match, result.f1, result.format_rate) == (1.0, 1.0, 1.0)
    assert (result.mean_turns, result.mean_tool_calls) == (3.0, 2.0)
    searched = [m["content"] for m in result.records[0]["completion"] if m["role"] == "tool"]
    assert all(text.startswith("Doc 1 (Title: ") for text in searched)  # the real search tool ran


def test_the_turn_limit_cuts_the_agent_before_its_answer(world):
    result = _oracle_result(world, max_turns=2)
    assert result.exact_match == 0.0 and result.mean_turns == 2.0 and result.mean_tool_calls == 1.0


def test_greedy_decoding_is_deterministic_and_stops_at_the_budget(world):
    _, rows, search = world
    model, tok = tiny()
    settings = AgentSettings(max_turns=2, max_completion_length=16, batch_size=2)
    first = evaluate_agent(model, tok, rows[:2], [search], settings)
    second = evaluate_agent(model, tok, rows[:2], [search], settings)
    assert [r["completion"] for r in first.records] == [r["completion"] for r in second.records]
    engine = GreedyEngine(model, tok)
    out = engine.generate([[1, 2, 3]], [5])[0]
    assert len(out.ids) <= 5


def test_evaluation_runs_every_limit_the_trainer_runs(tmp_path):
    """`AgentSettings.from_config` reads a training config through the trainers' own `SamplerSettings.from_config`:
    every turn-loop field (turns, budgets, tool limits, malformed calls) equals training's, non-default values
    included, so before/after numbers measure the policy under the limits it was optimised with."""
    from dataclasses import fields

    from trl_tree.rollout.growing.turn_loop import SamplerSettings

    args = config(TreeOPSDConfig, tmp_path, max_turns=3, max_turn_tokens=40, generation_chunk_tokens=8,
                  tool_timeout=2.5, max_tool_calls_per_turn=2, malformed_tool_calls="observe", tool_failure_penalty=-0.5,
                  max_concurrent_tool_calls=3, observation_special_tokens="raw")
    settings = AgentSettings.from_config(args, batch_size=5)
    loop = SamplerSettings.from_config(args)
    assert {f.name: getattr(settings, f.name) for f in fields(SamplerSettings)} == vars(loop)
    assert settings.batch_size == 5 and settings.observation_special_tokens == "raw"
    with pytest.raises(ValueError, match="max_concurrent_tool_calls"):
        AgentSettings(max_concurrent_tool_calls=0)  # the loop's own checks hold for evaluation too
