"""Deprecated path (issue 60): `trl_tree.pipeline` is `trl_tree.core.pipeline`; this alias goes in the next release."""

from ._moved import moved

moved(__name__, "trl_tree.core.pipeline")
