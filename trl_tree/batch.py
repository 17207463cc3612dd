"""Deprecated path (issue 60): `trl_tree.batch` is `trl_tree.core.batch`; this alias goes in the next release."""

from ._moved import moved

moved(__name__, "trl_tree.core.batch")
