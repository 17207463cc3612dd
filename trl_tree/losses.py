"""Deprecated path (issue 60): `trl_tree.losses` is `trl_tree.core.losses`; this alias goes in the next release."""

from ._moved import moved

moved(__name__, "trl_tree.core.losses")
