"""Deprecated path (issue 60): `trl_tree.trainer.metrics` is `trl_tree.trainer.observability.rank_metrics`; this alias
goes in the next release.
"""

from .._moved import moved

moved(__name__, "trl_tree.trainer.observability.rank_metrics")
