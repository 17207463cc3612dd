"""Deprecated path (issue 60): `trl_tree.trainer.components` is `trl_tree.trainer.configuration.tree_budget`
(`aggregate_leaf_rewards` moved beside the scoring it serves, `trl_tree.trainer.scoring`); this alias goes in the
next release.
"""

from .._moved import moved

moved(__name__, "trl_tree.trainer.configuration.tree_budget")
