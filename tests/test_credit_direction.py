"""Each trainer's loss moves the policy the way its credit says: after one optimizer step on a generated micro-batch,
turns with positive credit are more likely and turns with negative credit less likely.

The end-to-end tests check that every parameter changes and which metrics are logged; a loss with the wrong sign
passes those. Here every configuration of `tests/launch/tiny_tree_run.CONFIGURATIONS` (each named method and the
compositions that train the other registered credits and losses) is built as in its end-to-end test
(`tests/launch/tiny_tree_run.build_trainer`), generates two
trees (groups) from the tiny warm-started model, and takes one small gradient step on its own loss
(`scripted.credit_and_logp_change`). Each unique turn's mean log-prob is measured before and after, on the same packed
micro-batch, through the trainer's `loss_inputs`.

The properties, both of which a flipped loss sign reverses (checked by negating `compute_loss`):
- the credit-weighted change Σ_i A_i Δ_i is positive (to first order it is a positive combination of the gradient's
  squared norm, whatever the loss's per-turn weights);
- of the turns with strong credit (|A| at least half the largest), more than half move in their credit's direction.
  Not all of them: turns share a model, and a weak cross-effect of the other turns' gradients can outweigh a turn's own.
Both are `scripted.assert_moves_with_credit`, which the launched runs check too (tests/test_launch.py: the first Adam
step of a launched training run, over every rank's turns).
"""

import pytest

from tests.launch.tiny_tree_run import CONFIGURATIONS, build_trainer, uncovered
from tests.scripted import assert_moves_with_credit, credit_and_logp_change

# what a configuration needs here besides `build_trainer`'s defaults (GSPO-token's tiny sequence ratios move too
# little with tools on)
OVERRIDES = {"treeadv_gspo": {"use_tools": False, "warm_start_steps": 60, "max_completion_length": 32}}


def test_every_registered_credit_and_loss_is_checked_here():
    """A newly registered credit or loss is trained by no configuration below until one names it."""
    assert not uncovered(CONFIGURATIONS, ("credit", "loss")), "\n".join(uncovered(CONFIGURATIONS, ("credit", "loss")))


@pytest.mark.parametrize("method", CONFIGURATIONS)
def test_one_step_makes_positive_credit_turns_likelier_and_negative_ones_less_likely(tmp_path, method):
    trainer = build_trainer(str(tmp_path), max_steps=1, method=method, **OVERRIDES.get(method, {}))
    credit, change = credit_and_logp_change(trainer, [trainer.train_dataset[0], trainer.train_dataset[1]])
    assert_moves_with_credit(credit, change)
