"""Deprecated path (issue 60): `trl_tree.trainer.generation_logging` is
`trl_tree.trainer.observability.generation_logging`; this alias goes in the next release.
"""

from .._moved import moved

moved(__name__, "trl_tree.trainer.observability.generation_logging")
