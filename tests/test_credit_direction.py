"""Each trainer's loss moves the policy the way its credit says: after one optimizer step on a generated micro-batch,
turns with positive credit are more likely and turns with negative credit less likely.

The end-to-end tests check that every parameter changes and which metrics are logged; a loss with the wrong sign
passes those. Here every trainer (TreeOPSD, TreePO, AT2PO, TreeAdv with the GRPO and the GSPO-token surrogates,
TreeFlex, flat GRPO) is built as in its end-to-end test (`tests/launch/tiny_tree_run.build_trainer`), generates two
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

from tests.launch.tiny_tree_run import build_trainer
from tests.scripted import assert_moves_with_credit, credit_and_logp_change

METHODS = {
    "treeopsd": {},
    "treepo": {},
    "at2po": {},
    "treeadv": {},
    "treeadv_gspo": {"use_tools": False, "warm_start_steps": 60, "max_completion_length": 32},
    "treeflex": {},
    "flat_grpo": {},
}


@pytest.mark.parametrize("method", list(METHODS))
def test_one_step_makes_positive_credit_turns_likelier_and_negative_ones_less_likely(tmp_path, method):
    trainer = build_trainer(str(tmp_path), max_steps=1, method=method, **METHODS[method])
    credit, change = credit_and_logp_change(trainer, [trainer.train_dataset[0], trainer.train_dataset[1]])
    assert_moves_with_credit(credit, change)
