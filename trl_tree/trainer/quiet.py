"""Deprecated path (issue 60): `trl_tree.trainer.quiet` is `trl_tree.trainer.configuration.quiet`; this alias goes in
the next release.
"""

from .._moved import moved

moved(__name__, "trl_tree.trainer.configuration.quiet")
