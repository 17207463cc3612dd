"""trl-tree: tree-structured agentic RL on top of Hugging Face TRL.

The light modules (`tree`, `credit`, `losses`) import eagerly; `packing` (`from trl_tree import packing`) and the
trainers pull in transformers/TRL and are imported on first use, so `import trl_tree.credit` stays fast.
"""

from . import credit, losses
from .tree import RolloutTree, Turn

__version__ = "0.1.0"

_TRAINERS = {
    "TreeConfig": "trl_tree.trainer.config",
    "TreeTrainer": "trl_tree.trainer.base",
    "TreeOPSDConfig": "trl_tree.trainer.treeopsd",
    "TreeOPSDTrainer": "trl_tree.trainer.treeopsd",
    "TreePOConfig": "trl_tree.trainer.treepo",
    "TreePOTrainer": "trl_tree.trainer.treepo",
    "AT2POConfig": "trl_tree.trainer.at2po",
    "AT2POTrainer": "trl_tree.trainer.at2po",
    "TreeAdvConfig": "trl_tree.trainer.treeadv",
    "TreeAdvTrainer": "trl_tree.trainer.treeadv",
    "TreeFlexConfig": "trl_tree.trainer.treeflex",
    "TreeFlexTrainer": "trl_tree.trainer.treeflex",
}

__all__ = ["RolloutTree", "Turn", "credit", "losses", "packing", *_TRAINERS]


def __getattr__(name):
    if name in _TRAINERS:
        import importlib

        return getattr(importlib.import_module(_TRAINERS[name]), name)
    raise AttributeError(f"module 'trl_tree' has no attribute {name!r}")
