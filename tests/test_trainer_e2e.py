"""Unscripted end-to-end: a warm-started tiny model calls a real tool while TreeOPSD trains it (issue: trainer)."""


import pytest

from tests.launch.tiny_tree_run import build_trainer
from tests.scripted import unchanged_after_training


@pytest.mark.parametrize("packing", ["tree", "paths", "auto"])
def test_three_steps_two_blocks_per_generation_change_every_parameter(tmp_path, packing):
    trainer = build_trainer(str(tmp_path), max_steps=3, packing=packing)
    assert not unchanged_after_training(trainer)
    logged = {k for entry in trainer.state.log_history for k in entry}
    for key in ("reward", "reward_std", "tree/leaves_per_tree", "tree/unique_turns", "tree/unique_tokens",
                "tree/flat_tokens", "tree/turns_per_leaf", "treeopsd/abs_q_minus_half",
                "treeopsd/abs_p_minus_q/block_0", "treeopsd/abs_p_minus_q/block_1", "tools/call_frequency",
                "tools/failure_frequency"):
        assert key in logged, key
    assert ("tree/packed_as_tree" in logged) == (packing == "auto")  # which layout "auto" chose, per micro-batch
    history = [e for e in trainer.state.log_history if "tree/unique_tokens" in e]
    # a tree shares its prefixes: unique tokens are fewer than the flat rollouts would have needed
    assert all(e["tree/unique_tokens"] < e["tree/flat_tokens"] for e in history)
    # π_old is recomputed per micro-batch by the very packed forward that trains it: the first block starts at s = 0
    first = [e for e in trainer.state.log_history if "tree/abs_log_ratio/block_0" in e][0]
    assert first["tree/abs_log_ratio/block_0"] == 0.0
