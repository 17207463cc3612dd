"""The old import paths of moved modules, kept for one release (issue 60).

A module that moved (`trl_tree.credit` → `trl_tree.core.credit`) leaves a two-line module at its old path that calls
`moved`: importing the old path warns once, naming the new one, and then *is* the new module (the same object in
`sys.modules`, so its private names, `monkeypatch` and `isinstance` checks all keep working). `from trl_tree import
credit` (the package's own attributes, docs/design.md §4) never reaches these modules and never warns.
"""

from __future__ import annotations

import importlib
import sys
import warnings


def moved(old: str, new: str) -> None:
    """Make the module being imported as `old` the module `new`, with a DeprecationWarning naming `new`."""
    warnings.warn(
        f"`{old}` moved to `{new}` (issue 60); import it from there, or its public names from `trl_tree`. "
        "The old path goes in the next release.",
        DeprecationWarning,
        stacklevel=3,
    )
    sys.modules[old] = importlib.import_module(new)
