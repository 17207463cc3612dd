"""Deprecated path (issue 60): `trl_tree.trainer.tree_view_logging` is
`trl_tree.trainer.observability.tree_view_logging`; this alias goes in the next release.
"""

from .._moved import moved

moved(__name__, "trl_tree.trainer.observability.tree_view_logging")
