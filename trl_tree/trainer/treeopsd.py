"""Deprecated path (issue 60): `trl_tree.trainer.treeopsd` is `trl_tree.trainer.presets.treeopsd`; this alias goes in
the next release.
"""

from .._moved import moved

moved(__name__, "trl_tree.trainer.presets.treeopsd")
