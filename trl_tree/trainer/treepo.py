"""Deprecated path (issue 60): `trl_tree.trainer.treepo` is `trl_tree.trainer.presets.treepo`; this alias goes in the
next release.
"""

from .._moved import moved

moved(__name__, "trl_tree.trainer.presets.treepo")
