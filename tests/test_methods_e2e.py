"""Every trainer and at least two mixed sampler × credit × loss configurations train end to end on the tiny model."""


import pytest

from tests.launch.tiny_tree_run import build_trainer
from tests.scripted import unchanged_after_training


@pytest.mark.parametrize("method", ["at2po", "opsd_on_entropy_tree", "atpo_on_init_expand", "flat_grpo", "treeflex"])
def test_method_trains_every_parameter(tmp_path, method):
    trainer = build_trainer(str(tmp_path), max_steps=2, method=method)
    assert not unchanged_after_training(trainer)
    logged = [e for e in trainer.state.log_history if "tree/leaves_per_tree" in e]
    assert logged and logged[0]["tree/leaves_per_tree"] == trainer.args.leaves_per_tree


@pytest.mark.parametrize(
    ("method", "use_tools"),
    [("treeadv", True), ("treeadv_gspo", False)],  # GRPO surrogate with the calculator; GSPO-token on math, no tools
)
def test_treeadv_branches_inside_completions_and_trains_every_parameter(tmp_path, method, use_tools):
    trainer = build_trainer(str(tmp_path), max_steps=2, method=method, use_tools=use_tools,
                            warm_start_steps=150 if use_tools else 60, max_completion_length=96 if use_tools else 32)
    assert not unchanged_after_training(trainer)
    logged = next(e for e in trainer.state.log_history if "tree/leaves_per_tree" in e)
    # K varies with the entropies: between M (no branch point) and M(1 + max_branches_per_tree); here it branched
    assert trainer.args.num_initial_rollouts < logged["tree/leaves_per_tree"] <= trainer.args.leaves_per_tree
    assert logged["treeadv/branch_points_per_tree"] > 0
    assert (logged.get("tools/call_frequency", 0.0) > 0) == use_tools
