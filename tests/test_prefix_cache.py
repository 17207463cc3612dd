"""Reusing earlier calls' keys and values (`generation_cache="prefix"`) changes what is computed, not what is
sampled: the turns of a multi-call rollout equal those of a cache-free rollout, while the reused tokens skip prefill.
"""

import logging

import numpy as np
import pytest
import torch
from transformers.cache_utils import DynamicLayer

from tests.scripted import arithmetic_dataset, config, contains_answer, hf_engine, tiny, untooled_trainer
from trl_tree import TreeOPSDConfig, TreeOPSDTrainer
from trl_tree.envs.agent_eval import GreedyEngine
from trl_tree.rollout.generating import prefix_cache
from trl_tree.rollout.generating.engine import rollout_session
from trl_tree.rollout.generating.prefix_cache import PrefixKVStore

SHARED = 40  # a system prompt every prefix starts with
BUDGET = 12


@pytest.fixture(scope="module")
def trainer(tmp_path_factory):
    return untooled_trainer(tmp_path_factory.mktemp("prefix_cache"))


def _tokens(g, vocab, n):
    return torch.randint(3, vocab, (n,), generator=g).tolist()


def _rollout(engine, vocab, seed=0):
    """Three calls as a tree sampler makes them: first turns; then next turns after an observation, a branch from
    the middle of a turn, a duplicate history and an unrelated prompt; then a third turn of every branch."""
    g = torch.Generator().manual_seed(123)
    system = _tokens(g, vocab, SHARED)
    prefixes = [system + _tokens(g, vocab, n) for n in (3, 11, 25)]
    calls = []
    torch.manual_seed(seed)
    first = engine.generate(prefixes, [BUDGET, BUDGET, 5])
    calls.append(first)
    second_prefixes = [p + t.ids + _tokens(g, vocab, n) for p, t, n in zip(prefixes, first, (6, 9, 4))]
    second_prefixes += [
        prefixes[1] + first[1].ids[:3] + _tokens(g, vocab, 5),  # a branch grown from inside a stored turn
        list(second_prefixes[0]),  # a merged / duplicate history
        _tokens(g, vocab, 17),  # nothing stored shares it
    ]
    second = engine.generate(second_prefixes, [BUDGET] * len(second_prefixes))
    calls.append(second)
    third_prefixes = [p + t.ids + _tokens(g, vocab, 7) for p, t in zip(second_prefixes, second)]
    calls.append(engine.generate(third_prefixes, [BUDGET] * len(third_prefixes)))
    return calls


@pytest.mark.parametrize("do_sample", [False, True], ids=["greedy", "sampling"])
def test_reused_prefixes_sample_the_same_turns_as_a_fresh_prefill(trainer, monkeypatch, do_sample):
    vocab = trainer.model.config.vocab_size
    fresh = _rollout(hf_engine(trainer, monkeypatch, "dynamic", with_scores=True, do_sample=do_sample), vocab)
    engine = hf_engine(trainer, monkeypatch, "prefix", with_scores=True, do_sample=do_sample)
    with engine.rollout():
        reused = _rollout(engine, vocab)
        saved = engine.prefix_store.reused_tokens
    for fresh_call, reused_call in zip(fresh, reused):
        assert [c.ids for c in reused_call] == [c.ids for c in fresh_call]
        assert [c.finished for c in reused_call] == [c.finished for c in fresh_call]
        for a, b in zip(reused_call, fresh_call):
            torch.testing.assert_close(torch.tensor(a.logps), torch.tensor(b.logps), atol=1e-5, rtol=0)
            torch.testing.assert_close(torch.tensor(a.entropies), torch.tensor(b.entropies), atol=1e-5, rtol=0)
    assert saved > 4 * SHARED  # every continued history skipped its stored part
    assert engine.prefix_store.entries == [] and engine.prefix_store.reused_tokens == 0  # dropped with the rollout
    if do_sample:  # the seed matters: the comparison is not between two constant outputs
        other = _rollout(hf_engine(trainer, monkeypatch, "dynamic", do_sample=True), vocab, seed=1)
        assert [c.ids for c in other[0]] != [c.ids for c in fresh[0]]


def test_each_prefix_reuses_its_longest_stored_prefix_and_prefills_at_least_one_token(trainer):
    model = trainer.model
    g = torch.Generator().manual_seed(0)
    store = PrefixKVStore(min_reuse=4)
    system = _tokens(g, model.config.vocab_size, 20)
    stored = [system + _tokens(g, model.config.vocab_size, n) for n in (5, 9)]
    plan = store.plan(stored, 0, model)
    with torch.no_grad():
        out = model.generate(input_ids=plan.input_ids, attention_mask=plan.attention_mask, max_new_tokens=3,
                             do_sample=False, return_dict_in_generate=True, pad_token_id=0, eos_token_id=None)
    new = out.sequences[:, plan.input_ids.shape[1]:].tolist()
    store.store(out.cache, plan.attention_mask, stored, new)
    # the last generated token never went through the model: 2 of the 3 generated tokens are stored
    assert [len(e.tokens) for e in store.entries] == [27, 31]
    queries = [
        stored[1] + new[1][:2] + [7, 8],  # extends row 1: reuses all 31 stored tokens
        list(stored[0]),  # equals a stored prefix of row 0: all but its last token
        system[:10] + [5, 5, 5],  # shares 10 tokens with both rows
        [9, 9, 9] + system,  # shares nothing
    ]
    # the matching alone: `plan` would first encode the one long tail on its own (tests/test_chunked_generation.py)
    plan = store._plan(queries, 0, model.config)
    assert plan.reused == [31, 24, 10, 0]
    width = max(plan.reused)
    for row, (query, k) in enumerate(zip(queries, plan.reused)):
        mask = plan.attention_mask[row]
        assert int(mask[:width].sum()) == k and int(mask[width:].sum()) == len(query) - k
        assert plan.input_ids[row, -(len(query) - k):].tolist() == query[k:]
        # the ids under the mask are the whole prefix: a patched `generate` (TRL's tests script it) reads it whole
        assert plan.input_ids[row][mask.bool()].tolist() == query


def test_a_growing_layer_holds_what_concatenation_holds():
    """Within its room, past it (the buffers move) and after a batch selection that replaces its tensors, a
    `GrowingLayer` returns the keys and values `DynamicLayer`'s concatenation returns; within the room it writes in
    place."""
    g = torch.Generator().manual_seed(0)

    def kv(n):
        return torch.randn(3, 2, n, 4, generator=g), torch.randn(3, 2, n, 4, generator=g)

    reused = kv(5)
    for start_with_reused in (False, True):
        reference = DynamicLayer()
        if start_with_reused:
            reference.update(*reused)
            buffers = tuple(torch.zeros(3, 2, 5 + 6 + 4, 4) for _ in range(2))
            for buffer, t in zip(buffers, reused):
                buffer[..., :5, :] = t
            layer = prefix_cache.GrowingLayer(4, buffers, length=5)
        else:
            layer = prefix_cache.GrowingLayer(4)
        pointers = []
        for n in [6] + [1] * 10:  # a prefill of 6 columns, then decode steps
            new = kv(n)
            expected, got = reference.update(*new), layer.update(*new)
            for a, b in zip(got, expected):
                torch.testing.assert_close(a, b, rtol=0, atol=0)
            pointers.append(layer.keys.data_ptr())
            assert layer.get_seq_length() == reference.get_seq_length()
        assert len(set(pointers[:5])) == 1  # the prefill and 4 steps fit the room: written in place
        assert len(set(pointers)) == 2  # the 5th step moved to buffers with twice the room, enough for the rest
        for cache in (reference, layer):
            cache.batch_select_indices(torch.tensor([0, 2]))
        new = tuple(t[:2] for t in kv(1))
        for a, b in zip(layer.update(*new), reference.update(*new)):
            torch.testing.assert_close(a, b, rtol=0, atol=0)


def test_a_call_within_its_token_budget_never_copies_its_history(trainer, monkeypatch):
    """The engine gives the store its call's budget, so the cache has room for every token the call samples: its
    buffers are set up once (reused columns, or the prefill's when nothing is reused) and never move."""
    copied = []
    move = prefix_cache.GrowingLayer._move

    def counting_move(self, keys, values, capacity):
        copied.append(keys.shape[-2])
        move(self, keys, values, capacity)

    monkeypatch.setattr(prefix_cache.GrowingLayer, "_move", counting_move)
    engine = hf_engine(trainer, monkeypatch, "prefix")
    with engine.rollout():
        _rollout(engine, trainer.model.config.vocab_size)
        assert engine.prefix_store.reused_tokens > 0
    assert copied and set(copied) == {0}  # reservations only


def test_a_large_budget_reserves_at_most_the_initial_room(trainer):
    """A call's cache keeps room for its token budget, but a budget of thousands reserves only `MAX_INITIAL_ROOM`
    spare columns per row (a longer turn doubles the room as it goes)."""
    model = trainer.model
    store = PrefixKVStore(min_reuse=4)
    stored = [list(range(3, 40))]
    with torch.no_grad():
        plan = store.plan(stored, 0, model)
        out = model.generate(input_ids=plan.input_ids, attention_mask=plan.attention_mask, max_new_tokens=2,
                             do_sample=False, return_dict_in_generate=True, pad_token_id=0, eos_token_id=None)
    store.store(out.cache, plan.attention_mask, stored, out.sequences[:, plan.input_ids.shape[1]:].tolist())
    query = stored[0] + [7, 8, 9]
    for budget, room in ((10, 10), (10_000, prefix_cache.MAX_INITIAL_ROOM)):
        plan = store.plan([query], 0, model, max_new_tokens=budget)
        columns = plan.input_ids.shape[1]  # reused columns + the prefill
        assert all(layer._buffers[0].shape[-2] == columns + room for layer in plan.cache.layers)


def test_a_row_that_another_extends_is_dropped(trainer):
    store = PrefixKVStore(min_reuse=1)
    entry = lambda tokens: prefix_cache._Entry(np.asarray(tokens), [], [])  # noqa: E731
    store._add([entry([1, 2, 3]), entry([4, 5])])
    store._add([entry([1, 2, 3, 6]), entry([1, 2, 7]), entry([4, 5])])
    assert sorted(e.tokens.tolist() for e in store.entries) == [[1, 2, 3, 6], [1, 2, 7], [4, 5]]


def test_a_call_that_generate_did_not_run_empties_the_store_and_its_index(trainer):
    """A patched `generate` (TRL's tests script it) leaves the plan's cache unfilled: the store then drops every row,
    and its lookups, which go through a sorted index of the rows, must not find any."""
    model = trainer.model
    store = PrefixKVStore(min_reuse=4)
    stored = [list(range(3, 40)), list(range(5, 30))]
    with torch.no_grad():
        plan = store.plan(stored, 0, model)
        out = model.generate(input_ids=plan.input_ids, attention_mask=plan.attention_mask, max_new_tokens=2,
                             do_sample=False, return_dict_in_generate=True, pad_token_id=0, eos_token_id=None)
    store.store(out.cache, plan.attention_mask, stored, out.sequences[:, plan.input_ids.shape[1]:].tolist())
    assert store._best(stored[0] + [7])[1] > 0
    unfilled = store.plan([stored[0] + [9] * 20], 0, model)
    store.store(unfilled.cache, unfilled.attention_mask, [stored[0] + [9] * 20], [[]])
    assert store.entries == [] and store._best(stored[0] + [7]) == (None, 0)


def test_sorted_lookups_agree_with_comparing_every_stored_row():
    """The store looks a prefix up by binary search over its rows in lexicographic order; it must find what a scan
    of every row finds: the longest common prefix, the earliest stored row among those sharing it, and keep exactly
    the rows no other row extends (the earliest of identical rows). Random trees of short sequences over a small
    alphabet make shared prefixes, extensions and duplicates common."""
    rng = np.random.default_rng(0)

    def common(a, b):
        n = 0
        while n < min(len(a), len(b)) and a[n] == b[n]:
            n += 1
        return n

    for trial in range(200):
        store = PrefixKVStore(min_reuse=int(rng.integers(1, 3)))
        pool: list[list[int]] = []  # every row ever added, to grow new rows from
        reference: list[list[int]] = []
        for _ in range(int(rng.integers(1, 5))):
            fresh = []
            for _ in range(int(rng.integers(1, 6))):
                base = pool[int(rng.integers(len(pool)))][: int(rng.integers(0, 6))] if pool and rng.random() < 0.8 \
                    else []
                fresh.append(base + rng.integers(0, 3, int(rng.integers(0, 4))).tolist())
            pool += fresh
            store._add([prefix_cache._Entry(np.asarray(t, dtype=np.int64), [], []) for t in fresh])
            candidates = reference + fresh
            reference = [t for i, t in enumerate(candidates)
                         if not any(j != i and common(u, t) == len(t) and (len(u) > len(t) or j < i)
                                    for j, u in enumerate(candidates))]
            assert [e.tokens.tolist() for e in store.entries] == reference, trial
        for _ in range(10):
            query = rng.integers(0, 3, int(rng.integers(1, 9))).tolist()
            longest = max((common(t, query) for t in reference), default=0)
            expected_row = next((t for t in reference if common(t, query) == longest), None)
            reuse = min(longest, len(query) - 1)
            entry, k = store._best(query)
            if reuse >= store.min_reuse and longest:
                assert entry is not None and entry.tokens.tolist() == expected_row and k == reuse, (trial, query)
            else:
                assert (entry, k) == (None, 0), (trial, query)


def test_the_trainer_reuses_within_a_rollout_and_starts_each_rollout_empty(trainer, monkeypatch):
    engine = hf_engine(trainer, monkeypatch, "prefix")
    monkeypatch.setattr(trainer, "generation_engine", engine)
    seen = []
    original = engine.prefix_store.plan

    def plan(*args, **kwargs):
        seen.append(len(engine.prefix_store.entries))
        return original(*args, **kwargs)

    monkeypatch.setattr(engine.prefix_store, "plan", plan)
    for _ in range(2):
        with rollout_session(trainer.generation_engine):
            engine.generate([[5] * 30], [4])
            engine.generate([[5] * 30 + [6]], [4])
    assert seen == [0, 1, 0, 1]
    assert engine.prefix_store.entries == []


def test_models_whose_cache_cannot_be_spliced_fall_back_with_one_warning(trainer, monkeypatch, caplog):
    vocab = trainer.model.config.vocab_size
    expected = _rollout(hf_engine(trainer, monkeypatch, "dynamic"), vocab)
    import trl_tree.rollout.generating.engine as engine_module

    monkeypatch.setattr(engine_module, "supports_reuse", lambda model: False)
    engine = hf_engine(trainer, monkeypatch, "prefix")
    with caplog.at_level(logging.WARNING, logger="trl_tree.rollout.generating.engine"), engine.rollout():
        assert _rollout(engine, vocab) == expected
        assert engine.prefix_store.entries == []
    assert len([r for r in caplog.records if "generation_cache='prefix' is not supported" in r.getMessage()]) == 1


def test_sliding_window_models_are_not_spliced():
    from transformers import Qwen3Config, Qwen3ForCausalLM

    kwargs = dict(vocab_size=64, hidden_size=16, intermediate_size=32, num_hidden_layers=2, num_attention_heads=2,
                  num_key_value_heads=1, head_dim=8)
    assert prefix_cache.supports_reuse(Qwen3ForCausalLM(Qwen3Config(**kwargs)))
    sliding = Qwen3Config(**kwargs, use_sliding_window=True, sliding_window=8, max_window_layers=0)
    assert not prefix_cache.supports_reuse(Qwen3ForCausalLM(sliding))


def test_greedy_evaluation_engine_reuses_histories_with_the_same_answers(trainer):
    model, tok = tiny()
    vocab = model.config.vocab_size
    plain = GreedyEngine(model, tok, batch_size=2, reuse_prefixes=False)
    reusing = GreedyEngine(model, tok, batch_size=2)
    assert plain.store is None and reusing.store is not None
    assert _rollout(reusing, vocab) == _rollout(plain, vocab)
    assert reusing.store.reused_tokens > 4 * SHARED


def test_reuse_works_when_the_model_config_disables_the_cache(trainer, monkeypatch):
    """Gradient checkpointing sets `model.config.use_cache = False`, and then `generate` returns no cache: the engine
    passes its own cache and asks for it to be used, so the turns are still those of a fresh prefill."""
    vocab = trainer.model.config.vocab_size
    expected = _rollout(hf_engine(trainer, monkeypatch, "dynamic"), vocab)
    monkeypatch.setattr(trainer.model.config, "use_cache", False)
    engine = hf_engine(trainer, monkeypatch, "prefix", use_cache=None)  # GRPOTrainer's, unless the user sets it
    with engine.rollout():
        assert _rollout(engine, vocab) == expected
        assert engine.prefix_store.reused_tokens > 4 * SHARED
    model, tok = tiny()
    model.config.use_cache = False
    assert _rollout(GreedyEngine(model, tok, batch_size=2), vocab) == _rollout(
        GreedyEngine(model, tok, batch_size=2, reuse_prefixes=False), vocab)


def test_evaluation_holds_one_batch_of_questions_in_the_store_at_a_time():
    from trl_tree.envs.agent_eval import AgentSettings, run_agent

    model, tok = tiny()
    engine = GreedyEngine(model, tok, batch_size=2)
    sizes, original = [], engine.store.store

    def store(*args):
        original(*args)
        sizes.append(len(engine.store.entries))

    engine.store.store = store
    prompts = [[{"role": "user", "content": f"Question {i}: what is {i}+{i}?"}] for i in range(5)]
    run_agent(model, tok, prompts, [], AgentSettings(max_turns=1, max_completion_length=4, batch_size=2),
              engine=engine)
    assert sizes and max(sizes) <= 2 and engine.store.entries == []


def _fake_entry(tokens: list[int]) -> prefix_cache._Entry:
    """A stored row whose keys and values take 8 bytes per token (one float32 key and value per token)."""
    n = len(tokens)
    return prefix_cache._Entry(np.asarray(tokens, dtype=np.int64), [torch.zeros(1, n, 1)], [torch.zeros(1, n, 1)])


def test_a_full_store_drops_the_rows_stored_or_reused_longest_ago():
    """LRU: a row that a call reused counts as new; past the cap the oldest go first, and only as many as needed."""
    store = PrefixKVStore(min_reuse=1, max_bytes=8 * 30)
    a, b, c, d = ([k] * 10 for k in (1, 2, 3, 4))
    for row in (a, b, c):
        store._add([_fake_entry(row)])
    assert store.bytes_held == 8 * 30 and store.evicted_bytes == 0  # exactly at the cap: nothing dropped
    store._plan([a + [9]], pad_id=0, config=None)  # a call reuses `a`: now the most recently used
    store._add([_fake_entry(d)])
    assert [int(e.tokens[0]) for e in store.entries] == [1, 3, 4]  # `b`, stored longest ago, went
    assert store.bytes_held == 8 * 30 and store.evicted_bytes == 8 * 10
    store._add([_fake_entry([5] * 25)])  # needs room for 25: every older row goes
    assert [int(e.tokens[0]) for e in store.entries] == [5] and store.bytes_held == 8 * 25
    store._add([_fake_entry([6] * 31)])  # larger than the cap itself: not kept at all
    assert store.bytes_held <= 8 * 30 and store._best([6] * 31 + [7]) == (None, 0)


@pytest.mark.parametrize("cap", [0, -1, 2.5, True])
def test_a_cap_that_is_not_a_positive_number_of_bytes_is_a_config_error(trainer, tmp_path, cap):
    with pytest.raises(ValueError, match=r"max_prefix_cache_bytes must be a positive whole number of bytes.*None"):
        config(TreeOPSDConfig, tmp_path, max_prefix_cache_bytes=cap)
    with pytest.raises(ValueError, match="max_prefix_cache_bytes"):
        PrefixKVStore(max_bytes=cap)
    assert PrefixKVStore(max_bytes=1).max_bytes == 1
    assert trainer.args.max_prefix_cache_bytes is None  # the default: no cap


def _recording_store(store: PrefixKVStore, after_each_call: list) -> None:
    """Record (bytes held, bytes evicted, tokens reused, tokens prefilled; the last three since the rollout began)
    after every call's `store`."""
    original = store.store

    def store_and_record(*args):
        original(*args)
        after_each_call.append((store.bytes_held, store.evicted_bytes, store.reused_tokens, store.prefilled_tokens))

    store.store = store_and_record


@pytest.mark.parametrize("do_sample", [False, True], ids=["greedy", "sampling"])
def test_a_capped_store_holds_at_most_its_cap_and_samples_what_an_uncapped_one_does(trainer, monkeypatch, do_sample):
    """Three calls of a tree-like rollout through a store capped below what it would hold: after every call the store
    holds at most the cap, rows were dropped and others still reused, and every call's ids, log-probs and entropies
    are those of the uncapped store."""
    vocab = trainer.model.config.vocab_size
    engine = hf_engine(trainer, monkeypatch, "prefix", with_scores=True, do_sample=do_sample)
    with engine.rollout():
        uncapped = _rollout(engine, vocab)
        held = engine.prefix_store.bytes_held
    cap = held // 3
    monkeypatch.setattr(trainer.args, "max_prefix_cache_bytes", cap)
    engine = hf_engine(trainer, monkeypatch, "prefix", with_scores=True, do_sample=do_sample)
    after_each_call = []
    _recording_store(engine.prefix_store, after_each_call)
    with engine.rollout():
        capped = _rollout(engine, vocab)
    assert len(after_each_call) >= 3 and all(record[0] <= cap for record in after_each_call)
    _, evicted, reused, _ = after_each_call[-1]
    assert evicted > 0 and reused > 0  # the cap forced drops, and what stayed was reused
    for capped_call, uncapped_call in zip(capped, uncapped, strict=True):
        assert [c.ids for c in capped_call] == [c.ids for c in uncapped_call]
        for a, b in zip(capped_call, uncapped_call):
            torch.testing.assert_close(torch.tensor(a.logps), torch.tensor(b.logps), atol=1e-5, rtol=0)
            torch.testing.assert_close(torch.tensor(a.entropies), torch.tensor(b.entropies), atol=1e-5, rtol=0)


def test_a_tree_larger_than_the_cap_samples_the_same_tokens_as_without_one(tmp_path):
    """A whole TreeOPSD rollout on the tiny model, sampled (temperature 1), in chunks of 8 tokens so that every turn
    takes several calls that resume through the store: with a cap of about a seventh of what the uncapped store
    comes to hold, rows are dropped and fewer tokens reused, and the same seed grows trees with exactly the same
    token ids as without a cap."""
    model, tok = tiny()
    cap = 128 * 1024  # 128 tokens of the tiny model's KV (1 KiB a token): one branch's history, about
    trees, records = {}, {}
    for limit in (None, cap):
        args = config(TreeOPSDConfig, tmp_path / str(limit), num_initial_rollouts=2, num_branches=2,
                      max_completion_length=64, generation_chunk_tokens=8, max_prefix_cache_bytes=limit)
        trainer = TreeOPSDTrainer(model=model, reward_funcs=contains_answer, args=args,
                                  train_dataset=arithmetic_dataset(2), processing_class=tok)
        records[limit] = []
        _recording_store(trainer.generation_engine.prefix_store, records[limit])
        torch.manual_seed(0)
        grown = trainer.sample_trees([trainer.train_dataset[0], trainer.train_dataset[1]])
        trees[limit] = [[(t.parent, t.action_ids, t.observation_ids) for t in tree.turns] for tree in grown]
    assert trees[cap] == trees[None]
    assert max(record[0] for record in records[None]) > 4 * cap  # the uncapped tree holds far more than the cap
    assert all(record[0] <= cap for record in records[cap])
    (_, evicted, reused, prefilled), prefilled_uncapped = records[cap][-1], records[None][-1][3]
    # rows were dropped and others reused, so more was prefilled: other work, the same ids
    assert evicted > 0 and reused > 0 and prefilled > prefilled_uncapped
