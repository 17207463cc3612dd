"""Deprecated path (issue 60): an alias of `trl_tree.rollout.acting.special_tokens` until the next release."""

from .._moved import moved

moved(__name__, "trl_tree.rollout.acting.special_tokens")
