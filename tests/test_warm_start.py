"""The warm start's cache: a rerun with the same inputs loads exactly what the first run trained, and any input that
changes the weights changes the folder."""

import json
import os

import pytest
import torch

from trl_tree import warm_start as warm_start_module
from trl_tree.testing import calculator, calculator_conversations, tiny_model_and_tokenizer, tiny_model_path
from trl_tree.warm_start import LOSSES_FILE, cached_warm_start, model_fingerprint, warm_start_key

STEPS = 3


@pytest.fixture
def cache(tmp_path, monkeypatch):
    monkeypatch.setenv("TRL_TREE_CACHE", str(tmp_path))  # the tiny model's folder and the warm starts, both fresh
    return tmp_path


def _run(**overrides):
    model, tokenizer = tiny_model_and_tokenizer()
    kwargs = {"base": model_fingerprint(tiny_model_path()), "tools": [calculator], "steps": STEPS, "batch_size": 2,
              "seed": 0, **overrides}
    result = cached_warm_start(model, tokenizer, calculator_conversations(4), **kwargs)
    return model, result


def _same_weights(a, b) -> bool:
    return all(torch.equal(x, y) for x, y in zip(a.state_dict().values(), b.state_dict().values(), strict=True))


def test_a_rerun_loads_the_weights_and_losses_the_first_run_trained_without_training(cache, monkeypatch):
    trained, first = _run()
    assert not first.cached and len(first.losses) == STEPS
    assert json.loads((cache / "warm_start" / os.path.basename(first.path) / LOSSES_FILE).read_text()) == first.losses

    def no_training(*args, **kwargs):
        raise AssertionError("a cached warm start must not train")

    monkeypatch.setattr(warm_start_module, "warm_start", no_training)
    loaded, second = _run()
    assert second.cached and second.path == first.path and second.losses == first.losses
    assert _same_weights(loaded, trained)
    untouched, _ = tiny_model_and_tokenizer()
    assert not _same_weights(loaded, untouched)  # the hit did load the trained weights, not keep the base


def test_a_process_that_does_not_save_leaves_the_cache_empty(cache):
    _, result = _run(save=False)
    assert not result.cached and not (cache / "warm_start").exists()


@pytest.mark.parametrize("change", [{"steps": STEPS + 1}, {"lr": 1e-3}, {"batch_size": 3}, {"seed": 1},
                                    {"tools": []}])
def test_every_input_that_changes_the_weights_changes_the_folder(cache, change):
    _, first = _run()
    _, other = _run(**change)
    assert not other.cached and other.path != first.path


def test_the_data_and_the_base_model_are_part_of_the_key(tmp_path):
    conversations = calculator_conversations(2)
    key = warm_start_key(["base"], conversations, [calculator], 3, 1e-3, 2, 0, "torch.float32")
    assert key == warm_start_key(["base"], conversations, [calculator], 3, 1e-3, 2, 0, "torch.float32")
    assert key != warm_start_key(["other"], conversations, [calculator], 3, 1e-3, 2, 0, "torch.float32")
    assert key != warm_start_key(["base"], calculator_conversations(3), [calculator], 3, 1e-3, 2, 0, "torch.float32")
    assert key != warm_start_key(["base"], conversations, [calculator], 3, 1e-3, 2, 0, "torch.bfloat16")


def test_a_model_saved_again_at_the_same_path_is_a_different_base(tmp_path):
    folder = tmp_path / "model"
    folder.mkdir()
    (folder / "model.safetensors").write_bytes(b"old")
    before = model_fingerprint(str(folder))
    os.utime(folder / "model.safetensors", ns=(1, 1))
    assert model_fingerprint(str(folder)) != before
    assert model_fingerprint("Qwen/Qwen3-4B", "main") != model_fingerprint("Qwen/Qwen3-4B", "v2")



def test_a_hit_leaves_the_global_random_state_as_a_miss_does(cache):
    """Runs that are compared token for token (exact resume) may be one a miss and one a hit."""
    torch.manual_seed(123)
    _run()
    after_miss = torch.random.get_rng_state()
    torch.manual_seed(123)
    _, hit = _run()
    assert hit.cached and torch.equal(torch.random.get_rng_state(), after_miss)
