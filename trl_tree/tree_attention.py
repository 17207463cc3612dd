"""Deprecated path (issue 60): `trl_tree.tree_attention` is `trl_tree.core.tree_attention`; this alias goes in the next release."""

from ._moved import moved

moved(__name__, "trl_tree.core.tree_attention")
