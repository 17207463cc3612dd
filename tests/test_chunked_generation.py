"""Chunked generation (`TreeConfig.generation_chunk_tokens`): a call samples at most c tokens per branch, a turn still
going resumes in the next call, and branches that ended a turn rejoin at once. Chunking changes when tokens are
computed, not what a history continues with: with a deterministic policy every chunk size grows the same branches.
"""

import hashlib

import pytest

from tests.scripted import arithmetic_dataset, config, contains_answer, tiny
from trl_tree import TreeOPSDConfig, TreeOPSDTrainer
from trl_tree.envs.agent_eval import AgentSettings, GreedyEngine, run_agent
from trl_tree.rollout.generating.engine import Continuation, _cut_at_eos
from trl_tree.rollout.generating.prefix_cache import PrefixKVStore
from trl_tree.rollout.growing.samplers import InitExpandSampler, TreeRoot
from trl_tree.rollout.growing.turn_loop import Branch, SamplerSettings, TurnLoop, TurnLoopPorts

EOS, CALL, VOCAB = 1, 2, 12
OBSERVATION = [7, 7, 7]


def next_token(history: list[int]) -> int:
    """A deterministic policy: the next token is a hash of the whole history (ends a turn on EOS, calls on CALL)."""
    digest = hashlib.sha256(bytes(history[-40:]) + len(history).to_bytes(4, "little")).digest()
    return digest[0] % VOCAB


class TokenwiseEngine:
    """Samples token by token from `next_token`, so a turn cut after any number of tokens resumes exactly where an
    uncut call would have gone on. Records every call's budgets."""

    resumes_turns = True

    def __init__(self):
        self.budgets: list[list[int]] = []

    def generate(self, prefixes, max_new_tokens):
        self.budgets.append(list(max_new_tokens))
        out = []
        for prefix, budget in zip(prefixes, max_new_tokens):
            ids = []
            while len(ids) < budget and (not ids or ids[-1] != EOS):
                ids.append(next_token(prefix + ids))
            n, finished = _cut_at_eos(ids, {EOS}, budget)
            out.append(Continuation(ids[:n], [0.0] * n, [0.5] * n, finished))
        return out


def parse(ids, prefix):
    calls = [{"name": "probe", "arguments": {}}] if CALL in ids else []
    return {"role": "assistant", "content": " ".join(map(str, ids)), **({"tool_calls": calls} if calls else {})}


def loop(engine, chunk, max_turns=4, max_turn_tokens=9):
    settings = SamplerSettings(max_turns=max_turns, max_completion_length=40, max_turn_tokens=max_turn_tokens,
                               chunk_tokens=chunk)
    return TurnLoop(TurnLoopPorts(engine, parse, lambda messages: list(OBSERVATION)), settings)


def branches(n=12):
    return [Branch(tree=i, prefix_ids=[3, 4, i % VOCAB, i // VOCAB], prompt_len=4, tools={"probe": lambda: "ok"})
            for i in range(n)]


def summary(grown):
    return [(b.prefix_ids, [(t.action_ids, t.observation_ids, t.truncated, t.entropies) for t in b.turns],
             b.messages, b.calls_per_turn) for b in grown]


@pytest.mark.parametrize("chunk", [1, 2, 3, 5])
def test_every_chunk_size_grows_the_branches_a_whole_turn_per_call_grows(chunk):
    whole, engine = branches(), TokenwiseEngine()
    loop(TokenwiseEngine(), None).run(whole)
    chunked = branches()
    loop(engine, chunk).run(chunked)
    assert summary(chunked) == summary(whole)
    assert any(len(b.turns) > 1 for b in whole) and any(t.truncated for b in whole for t in b.turns)
    assert max(max(budgets) for budgets in engine.budgets) <= chunk  # no call samples more than c tokens per row
    assert all(b.pending is None and b.done for b in chunked)


@pytest.mark.parametrize("chunk", [None, 2])
def test_hooks_see_each_completed_turn_once_whatever_the_chunk(chunk):
    turns, ends = [], []

    def on_turn(branch):
        assert branch.pending is None  # a hook never sees a turn half-sampled
        turns.append((branch.tree, len(branch.turns)))
        return []

    def on_finish(branch):
        ends.append(branch.tree)
        return []

    grown = branches()
    loop(TokenwiseEngine(), chunk).run(grown, on_finish=on_finish, on_turn=on_turn)
    assert sorted(ends) == list(range(len(grown)))
    assert sorted(turns) == sorted((b.tree, t) for b in grown for t in range(1, len(b.turns)))


def test_continuations_started_between_chunks_continue_their_anchors_history():
    roots = [TreeRoot(prompt_ids=b.prefix_ids, tools=b.tools) for b in branches(3)]
    trees = InitExpandSampler(loop(TokenwiseEngine(), 2), num_initial=3, num_branches=2, seed=0).sample(roots)
    for tree in trees:
        initial, continuations = tree[:3], tree[3:]
        assert len(continuations) == 6 and all(b.done and b.pending is None for b in tree)
        for c in continuations:
            # the policy is deterministic, so a continuation handed exactly its anchor's history (mid-run, between
            # chunks) samples that trajectory's turns again: it must come out identical to one of them
            assert summary([c]) in [summary([i]) for i in initial]
            assert c.round == 1


def test_a_chunk_size_must_be_positive(tmp_path):
    with pytest.raises(ValueError, match="generation_chunk_tokens must be a positive"):
        SamplerSettings(max_turns=2, max_completion_length=8, chunk_tokens=0)
    with pytest.raises(ValueError, match="generation_chunk_tokens must be a positive"):
        config(TreeOPSDConfig, tmp_path, generation_chunk_tokens=0)


def test_engines_that_cannot_resume_a_cut_turn_sample_whole_turns():
    engine = TokenwiseEngine()
    engine.resumes_turns = False  # e.g. a cache that would prefill the whole history again for every chunk
    grown = branches()
    loop(engine, 2).run(grown)
    assert max(max(budgets) for budgets in engine.budgets) > 2
    whole = branches()
    loop(TokenwiseEngine(), None).run(whole)
    assert summary(grown) == summary(whole)


@pytest.mark.parametrize("cache, resumes", [("prefix", True), ("static", False), ("dynamic", False)])
def test_the_hf_engine_resumes_turns_only_with_the_prefix_store(tmp_path, monkeypatch, cache, resumes):
    from tests.scripted import hf_engine

    model, tok = tiny()
    trainer = TreeOPSDTrainer(model=model, reward_funcs=contains_answer, train_dataset=arithmetic_dataset(1),
                              args=config(TreeOPSDConfig, tmp_path, generation_chunk_tokens=4), processing_class=tok)
    assert hf_engine(trainer, monkeypatch, cache).resumes_turns is resumes
    if resumes:  # ZeRO-3 / FSDP on several processes generate without the prefix store: whole turns again
        import trl_tree.rollout.generating.engine as engine_module

        monkeypatch.setattr(engine_module, "_synced_generation", lambda model: True)
        assert hf_engine(trainer, monkeypatch, cache).resumes_turns is False


def test_a_call_mixing_resumed_turns_with_fresh_histories_prefills_the_long_tails_first():
    model, tok = tiny()
    store = PrefixKVStore()
    fresh = [[5 + (i * 7 + j) % 90 for j in range(60)] for i in range(4)]
    first = store.plan(fresh, tok.pad_token_id, model)  # nothing stored: every row prefills its whole history
    assert first.input_ids.shape[1] - max(first.reused) == 60
    # store three rows as a call would (their histories + 5 generated tokens), then resume them next to a new one
    engine = GreedyEngine(model, tok, batch_size=8)
    engine.store = store
    out = engine.generate(fresh[:3], [5, 5, 5])
    resumed = [p + o.ids for p, o in zip(fresh[:3], out)]
    plan = store.plan(resumed + [fresh[3] + [9] * 40], tok.pad_token_id, model)
    assert plan.input_ids.shape[1] - max(plan.reused) == 1  # the new row's 100 tokens were encoded on their own


def test_greedy_agent_answers_are_the_same_with_chunks():
    model, tok = tiny()
    prompts = [[{"role": "user", "content": f"Question {i}: what is {i}+{i}?"}] for i in range(4)]

    def calculator(expression: str) -> str:
        """Evaluate an arithmetic expression.

        Args:
            expression: e.g. "2+2"
        """
        return "4"

    settings = dict(max_turns=3, max_completion_length=48, max_turn_tokens=16, batch_size=4)
    whole = run_agent(model, tok, prompts, [calculator], AgentSettings(**settings))
    chunked = run_agent(model, tok, prompts, [calculator], AgentSettings(**settings, chunk_tokens=5))
    assert [b.prefix_ids for b in chunked] == [b.prefix_ids for b in whole]
    assert [b.messages for b in chunked] == [b.messages for b in whole]


def test_the_trainer_samples_in_chunks(tmp_path, monkeypatch):
    model, tok = tiny()
    args = config(TreeOPSDConfig, tmp_path, generation_chunk_tokens=3, max_turn_tokens=8)
    trainer = TreeOPSDTrainer(model=model, reward_funcs=contains_answer, args=args,
                              train_dataset=arithmetic_dataset(2), processing_class=tok)
    asked = []
    from trl_tree.rollout.generating.engine import HFEngine

    original = HFEngine.generate

    def spy(self, prefixes, max_new_tokens):
        asked.extend(max_new_tokens)
        return original(self, prefixes, max_new_tokens)

    monkeypatch.setattr(HFEngine, "generate", spy)
    trainer.train()
    assert asked and max(asked) <= 3
    assert trainer.state.global_step >= 1
