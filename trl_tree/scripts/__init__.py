"""Training scripts behind `examples/` and the `trl-tree` console command (one module per command, as `trl/scripts`).

`trl-tree <method>` runs one of two scripts with the method's config and trainer (`script_for` picks it):

- `generic`: any dataset, with reward functions, tools or an environment factory given by import path, as `trl grpo`
  trains one; chosen when the command line or its `--config` YAML names any of them (`generic.SELECTING_ARGUMENTS`);
- `hotpot`: otherwise, the HotpotQA search agent (also `examples/train_hotpot.py`): offline by default.
"""

from __future__ import annotations

from types import ModuleType
from typing import Any


def _config_file_keys(argv: list[str]) -> set[str]:
    """The top-level keys of the `--config` YAML in `argv` (none without one; a missing file is the parser's error)."""
    path = next((a.split("=", 1)[1] for a in argv if a.startswith("--config=")), None)
    if path is None and "--config" in argv[:-1]:
        path = argv[argv.index("--config") + 1]
    if path is None:
        return set()
    import yaml

    try:
        with open(path) as f:
            content = yaml.safe_load(f)
    except OSError:
        return set()
    return set(content) if isinstance(content, dict) else set()


def script_for(argv: list[str]) -> ModuleType:
    """`generic` when `argv` (or its `--config` file) names a reward, tools or an environment, else `hotpot`."""
    from trl_tree.scripts import generic, hotpot

    named = {a[2:].split("=", 1)[0] for a in argv if a.startswith("--")} | _config_file_keys(argv)
    return generic if named & set(generic.SELECTING_ARGUMENTS) else hotpot


def run(method: str, argv: list[str] | None = None, prog: str | None = None) -> Any:
    """What `trl-tree <method>` runs once launched: the script `script_for` picks, on the command line."""
    import sys

    argv = list(sys.argv[1:] if argv is None else argv)
    return script_for(argv).run(method, argv, prog=prog)
