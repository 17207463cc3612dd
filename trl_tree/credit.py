"""Deprecated path (issue 60): `trl_tree.credit` is `trl_tree.core.credit`; this alias goes in the next release."""

from ._moved import moved

moved(__name__, "trl_tree.core.credit")
