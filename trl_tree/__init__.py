"""trl-tree: tree-structured agentic RL on top of Hugging Face TRL.

The core (`trl_tree.core`: the tree, credit, losses, packing, the pipeline) is re-exported here as modules, so
`from trl_tree import credit, losses, methods, packing` is the public way in (docs/design.md §4); the old paths
(`trl_tree.credit`, `trl_tree.packing`, ...) still import, with a DeprecationWarning naming the new one, for one
release. The light modules (`tree`, `batch`, `credit`, `losses`, `methods`, the method table) import eagerly;
`packing`, the rest of the core and the trainers pull in transformers/TRL and are imported on first use
(`trl_tree.packing`, `trl_tree.TreeOPSDTrainer`), so `from trl_tree import credit` stays fast. The config and trainer
classes exported here are those of the method table (`trl_tree.methods.exported_classes`).
"""

import importlib

from . import methods
from .core import batch, credit, losses, tree
from .core.tree import RolloutTree, Turn
from .rollout.acting.tools import ToolFatalError, batched_tool

__version__ = "0.1.0"

_LAZY_MODULES = ("packing",)
_LAZY_CORE = ("packing", "tree_attention", "pipeline", "tree_unit", "flex_unit")  # trl_tree.<name>: trl_tree.core's
_CLASSES = methods.exported_classes()

__all__ = [
    "RolloutTree",
    "Turn",
    "ToolFatalError",
    "batched_tool",
    "batch",
    "credit",
    "losses",
    "methods",
    "tree",
    *_LAZY_MODULES,
    *_CLASSES,
]


def __getattr__(name):
    if name in _LAZY_CORE:
        return importlib.import_module(f"{__name__}.core.{name}")
    if name in _CLASSES:
        module, attr = _CLASSES[name].split(":")
        return getattr(importlib.import_module(module), attr)
    raise AttributeError(f"module 'trl_tree' has no attribute {name!r}")
