"""`HFEngine` with a static or a dynamic KV cache: the same turns, the static one sized per call (the prefix-reusing
cache is tested in test_prefix_cache.py)."""

import copy
import logging

import pytest
import torch
from transformers import StaticCache

from tests.scripted import config, hf_engine, untooled_trainer
from trl_tree import TreeConfig
from trl_tree.rollout.generating.engine import HFEngine
from trl_tree.trainer.engine_ports import hf_ports

# Left-padded batch of different widths; one budget shorter than the others (a per-row cut inside the call).
LENGTHS = (7, 33, 64, 121)
BUDGETS = [24, 24, 9, 24]


@pytest.fixture(scope="module")
def trainer(tmp_path_factory):
    return untooled_trainer(tmp_path_factory.mktemp("hf_engine"))


@pytest.fixture
def prefixes(trainer):
    g = torch.Generator().manual_seed(0)
    vocab = trainer.model.config.vocab_size
    return [torch.randint(3, vocab, (n,), generator=g).tolist() for n in LENGTHS]


def _sample(engine, prefixes, budgets=BUDGETS, seed=0):
    torch.manual_seed(seed)
    return engine.generate(prefixes, budgets)


def _spy_generate(monkeypatch, model):
    """Record the `cache` each `model.generate` call receives."""
    seen, original = [], model.generate

    def generate(*args, **kwargs):
        seen.append(kwargs.get("cache"))
        return original(*args, **kwargs)

    monkeypatch.setattr(model, "generate", generate)
    return seen


@pytest.mark.parametrize("do_sample", [False, True], ids=["greedy", "sampling"])
@pytest.mark.parametrize("with_scores", [False, True], ids=["ids", "scores"])
def test_static_and_dynamic_caches_generate_the_same_turns(trainer, prefixes, monkeypatch, do_sample, with_scores):
    results = {}
    for cache in ("dynamic", "static"):
        engine = hf_engine(trainer, monkeypatch, cache, with_scores=with_scores, do_sample=do_sample)
        results[cache] = [_sample(engine, prefixes, seed=seed) for seed in (0, 1)]
    for dynamic, static in zip(results["dynamic"], results["static"]):
        assert [c.ids for c in static] == [c.ids for c in dynamic]
        assert [c.finished for c in static] == [c.finished for c in dynamic]
        assert [len(c.ids) for c in static] == [min(b, len(c.ids)) for b, c in zip(BUDGETS, static)]
        if with_scores:
            for s, d in zip(static, dynamic):
                torch.testing.assert_close(torch.tensor(s.logps), torch.tensor(d.logps), atol=1e-5, rtol=0)
                torch.testing.assert_close(torch.tensor(s.entropies), torch.tensor(d.entropies), atol=1e-5, rtol=0)
    if do_sample:  # the seed matters: the comparison is not between two constant outputs
        assert [c.ids for c in results["static"][0]] != [c.ids for c in results["static"][1]]


def test_end_of_turn_cut_and_budget_flags_are_the_same_with_both_caches(trainer, prefixes, monkeypatch):
    """Make a token that the first turn samples early an end-of-turn token: that turn finishes on it, the others
    hit their budget, identically with both caches."""
    sampled = _sample(hf_engine(trainer, monkeypatch, "dynamic"), prefixes)
    stop = sampled[0].ids[3]
    eos_ids = [*trainer.eos_token_ids, stop]
    monkeypatch.setattr(trainer, "eos_token_ids", eos_ids)
    results = {
        cache: _sample(hf_engine(trainer, monkeypatch, cache, eos_token_id=eos_ids), prefixes)
        for cache in ("dynamic", "static")
    }
    assert results["static"] == results["dynamic"]
    turns = results["static"]
    assert turns[0].finished and turns[0].ids == sampled[0].ids[: sampled[0].ids.index(stop) + 1]
    assert any(not t.finished for t in turns)
    for turn, budget in zip(turns, BUDGETS):
        ends = [j for j, tok in enumerate(turn.ids) if tok in eos_ids]
        if turn.finished:  # cut right after its first end-of-turn token
            assert ends == [len(turn.ids) - 1] and len(turn.ids) <= budget
        else:
            assert not ends and len(turn.ids) == budget


def test_static_cache_is_fresh_and_sized_to_each_call(trainer, prefixes, monkeypatch):
    seen = _spy_generate(monkeypatch, trainer.model)
    engine = hf_engine(trainer, monkeypatch, "static")
    engine.generate(prefixes, BUDGETS)
    engine.generate(prefixes[:1], [5])  # a narrower call after a wide one gets a smaller cache (no ratchet)
    engine.generate([], [])  # the dummy call of an idle rank
    assert all(isinstance(c, StaticCache) for c in seen)
    assert [c.layers[0].max_cache_len for c in seen] == [max(LENGTHS) + max(BUDGETS), LENGTHS[0] + 5, 2]
    assert len({id(c) for c in seen}) == 3

    seen.clear()
    hf_engine(trainer, monkeypatch, "dynamic").generate(prefixes, BUDGETS)
    # a cache_implementation asked for explicitly (GRPOConfig.cache_implementation) is left to transformers
    hf_engine(trainer, monkeypatch, "static", cache_implementation="dynamic").generate(prefixes, BUDGETS)
    assert seen == [None, None]


def test_synchronised_generation_keeps_the_dynamic_cache(trainer, prefixes, monkeypatch):
    """ZeRO-3 / FSDP on several processes step a finished rank on until every rank is done, past its own budget (the
    launched ZeRO-3 test runs this for real); on one process there is nothing to synchronise."""
    import trl_tree.rollout.generating.engine as engine_module

    assert not engine_module._synced_generation(trainer.model)
    seen = _spy_generate(monkeypatch, trainer.model)
    monkeypatch.setattr(engine_module, "_synced_generation", lambda model: True)
    hf_engine(trainer, monkeypatch, "static").generate(prefixes, BUDGETS)
    assert seen == [None]


def test_model_without_static_cache_support_falls_back_with_one_warning(trainer, prefixes, monkeypatch, caplog):
    expected = _sample(hf_engine(trainer, monkeypatch, "dynamic"), prefixes)
    monkeypatch.setattr(type(trainer.model), "_can_compile_fullgraph", False)
    seen = _spy_generate(monkeypatch, trainer.model)
    engine = hf_engine(trainer, monkeypatch, "static")
    with caplog.at_level(logging.WARNING, logger="trl_tree.rollout.generating.engine"):
        results = [_sample(engine, prefixes) for _ in range(2)]
    assert seen == [None, None]
    assert results == [expected, expected]
    warnings = [r for r in caplog.records if "generation_cache='static' is not supported" in r.getMessage()]
    assert len(warnings) == 1


def test_peft_model_gets_a_static_cache_and_the_same_turns(trainer, prefixes, monkeypatch):
    from peft import LoraConfig, get_peft_model

    lora = get_peft_model(copy.deepcopy(trainer.model), LoraConfig(r=4, target_modules=["q_proj", "v_proj"]))
    monkeypatch.setattr(trainer, "model_wrapped", lora)
    seen = _spy_generate(monkeypatch, lora.get_base_model())
    results = {c: _sample(hf_engine(trainer, monkeypatch, c), prefixes) for c in ("dynamic", "static")}
    assert results["static"] == results["dynamic"]
    assert seen[0] is None and isinstance(seen[1], StaticCache)


@pytest.mark.parametrize("cache", ["prefix", "dynamic"])
def test_a_generate_patched_to_return_a_plain_tensor_of_sequences_is_accepted(trainer, prefixes, monkeypatch, cache):
    """TRL's tests patch `model.generate` to return the sequences tensor only; the engine reads both that and a
    `GenerateOutput`, and gives the same ids. (Before the tests that build configs: that resets the trainer's
    accelerator state.)"""
    engine = hf_engine(trainer, monkeypatch, cache)
    expected = [c.ids for c in _sample(engine, prefixes)]
    original = trainer.model.generate
    monkeypatch.setattr(trainer.model, "generate", lambda *a, **k: original(*a, **k).sequences)
    engine = hf_engine(trainer, monkeypatch, cache)
    got = _sample(engine, prefixes)
    assert [c.ids for c in got] == expected and all(c.entropies is None for c in got)
    with pytest.raises(ValueError, match="returned only the sequences.*scores"):
        hf_engine(trainer, monkeypatch, cache, with_scores=True).generate(prefixes, BUDGETS)


def test_generation_hides_only_trls_is_gradient_checkpointing_warning(trainer, prefixes):
    """TRL's `unwrap_model_for_generation` reads `is_gradient_checkpointing`, deprecated from transformers 5.23: the
    engine's generate calls do not pass that FutureWarning on to the user (and leave every other warning alone)."""
    import warnings

    with warnings.catch_warnings(record=True) as direct:
        warnings.simplefilter("always")
        trainer.model.is_gradient_checkpointing  # noqa: B018 (the property access is what warns)
    if not any("is_gradient_checkpointing" in str(w.message) for w in direct):
        pytest.skip("this transformers does not deprecate is_gradient_checkpointing")
    engine = HFEngine(hf_ports(trainer))
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        _sample(engine, prefixes)
        warnings.warn("another warning", UserWarning, stacklevel=1)
    messages = [str(w.message) for w in seen]
    assert not [m for m in messages if "is_gradient_checkpointing" in m]
    assert "another warning" in messages


def test_generation_cache_defaults_to_prefix_and_rejects_unknown_values(tmp_path, trainer, monkeypatch):
    assert config(TreeConfig, tmp_path).generation_cache == "prefix"
    assert config(TreeConfig, tmp_path, generation_cache="dynamic").generation_cache == "dynamic"
    with pytest.raises(ValueError, match=r"must be one of \('prefix', 'static', 'dynamic'\); got 'paged'"):
        config(TreeConfig, tmp_path, generation_cache="paged")
    monkeypatch.setattr(trainer.args, "generation_cache", "offloaded")
    with pytest.raises(ValueError, match="generation_cache must be 'prefix', 'static' or 'dynamic'"):
        HFEngine(hf_ports(trainer))


