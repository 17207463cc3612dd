"""Deprecated path (issue 60): `trl_tree.trainer.config_checks` is `trl_tree.trainer.configuration.checks`; this alias
goes in the next release.
"""

from .._moved import moved

moved(__name__, "trl_tree.trainer.configuration.checks")
