"""Deprecated path (issue 60): `trl_tree.trainer.completions_table` is
`trl_tree.trainer.observability.completions_table`; this alias goes in the next release.
"""

from .._moved import moved

moved(__name__, "trl_tree.trainer.observability.completions_table")
