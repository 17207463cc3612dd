"""Deprecated path (issue 60): `trl_tree.trainer.at2po` is `trl_tree.trainer.presets.at2po`; this alias goes in the next
release.
"""

from .._moved import moved

moved(__name__, "trl_tree.trainer.presets.at2po")
