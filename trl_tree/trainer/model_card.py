"""Deprecated path (issue 60): `trl_tree.trainer.model_card` is `trl_tree.trainer.observability.model_card`; this alias
goes in the next release.
"""

from .._moved import moved

moved(__name__, "trl_tree.trainer.observability.model_card")
