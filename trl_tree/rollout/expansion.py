"""Deprecated path (issue 60): an alias of `trl_tree.rollout.growing.expansion` until the next release."""

from .._moved import moved

moved(__name__, "trl_tree.rollout.growing.expansion")
