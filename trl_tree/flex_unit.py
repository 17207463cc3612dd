"""Deprecated path (issue 60): `trl_tree.flex_unit` is `trl_tree.core.flex_unit`; this alias goes in the next release."""

from ._moved import moved

moved(__name__, "trl_tree.core.flex_unit")
