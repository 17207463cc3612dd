"""trl-tree: tree-structured agentic RL on top of Hugging Face TRL.

The light modules (`tree`, `credit`, `losses`, `methods`, the method table) import eagerly; `packing` and the
trainers pull in transformers/TRL and are imported on first use (`trl_tree.packing`, `trl_tree.TreeOPSDTrainer`), so
`import trl_tree.credit` stays fast. The config and trainer classes exported here are those of the method table
(`trl_tree.methods.exported_classes`).
"""

import importlib

from . import credit, losses, methods
from .rollout.tools import ToolFatalError, batched_tool
from .tree import RolloutTree, Turn

__version__ = "0.1.0"

_LAZY_MODULES = ("packing",)
_CLASSES = methods.exported_classes()

__all__ = ["RolloutTree", "Turn", "ToolFatalError", "batched_tool", "credit", "losses", "methods", *_LAZY_MODULES, *_CLASSES]


def __getattr__(name):
    if name in _LAZY_MODULES:
        return importlib.import_module(f"{__name__}.{name}")
    if name in _CLASSES:
        module, attr = _CLASSES[name].split(":")
        return getattr(importlib.import_module(module), attr)
    raise AttributeError(f"module 'trl_tree' has no attribute {name!r}")
