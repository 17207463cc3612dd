"""The layers of docs/design.md §2, held by the imports themselves (issue 60).

Every module of `trl_tree` is parsed (ast: nothing is imported) and each import it makes, at module level or inside a
function, is checked against the rule of its room. An import that crosses a layer the diagram forbids fails here,
naming the file, the line, what it imported and the rule. The old paths of the modules that moved (into
`trl_tree.core`, and `rollout/` into growing/, generating/, acting/) still import for one release, warning and naming
the new path; the package itself uses none of them.
"""

import ast
import importlib
import sys
import warnings
from pathlib import Path

import pytest

import trl_tree

ROOT = Path(__file__).resolve().parents[1]
CORE_MODULES = ("tree", "batch", "credit", "losses", "packing", "tree_attention", "pipeline", "tree_unit", "flex_unit")
ROLLOUT_MODULES = {
    "growing": ("samplers", "turn_loop", "token_branching", "expansion", "flex_harness"),
    "generating": ("engine", "vllm_engine", "prefix_cache"),
    "acting": ("tools", "tool_executor", "env_branching", "special_tokens"),
}
# old path -> new, for one release
MOVED = {f"trl_tree.{name}": f"trl_tree.core.{name}" for name in CORE_MODULES} | {
    f"trl_tree.rollout.{name}": f"trl_tree.rollout.{job}.{name}"
    for job, names in ROLLOUT_MODULES.items()
    for name in names
} | {
    f"trl_tree.trainer.{old}": f"trl_tree.trainer.{new}"
    for old, new in {
        **{name: f"presets.{name}" for name in ("treeopsd", "treepo", "at2po", "treeadv", "treeflex")},
        "config": "configuration.fields",
        "config_checks": "configuration.checks",
        "config_budget": "configuration.resolution",
        "components": "configuration.tree_budget",
        "metrics": "observability.rank_metrics",
        "quiet": "configuration.quiet",
        **{
            name: f"observability.{name}"
            for name in ("generation_logging", "completions_table", "tree_view_logging", "model_card")
        },
    }.items()
}

# room -> the rooms of trl_tree it may import (its own always), as drawn in docs/design.md §2. A module's room is the
# longest prefix that names it; the package root and the deprecated aliases are in none. TRL ("trl") is refused to
# the core alone: the rest reach TRL's private names only through trl_internals (`TRL_INTERNALS_USERS`).
ALLOWED = {
    "trl_tree.core": (),
    "trl_tree.text": (),
    "trl_tree.rewards": ("trl_tree.text",),
    "trl_tree.rollout": ("trl_tree.core", "trl_tree.text"),
    "trl_tree.rollout.growing": (
        "trl_tree.rollout.generating",
        "trl_tree.rollout.acting",
        "trl_tree.core",
        "trl_tree.text",
    ),
    "trl_tree.rollout.generating": (),
    "trl_tree.rollout.acting": ("trl_tree.core", "trl_tree.text"),
    "trl_tree.asynchronous": (),
    "trl_tree.tree_view": ("trl_tree.core",),
    "trl_tree.methods": ("trl_tree.rollout", "trl_tree.core"),
    "trl_tree.envs": ("trl_tree.rewards", "trl_tree.rollout", "trl_tree.core", "trl_tree.text"),
    "trl_tree.model_cache": (),
    "trl_tree.warm_start": ("trl_tree.model_cache",),
    "trl_tree.testing": ("trl_tree.model_cache", "trl_tree.warm_start", "trl_tree.rollout"),
    "trl_tree.trainer.presets": (
        "trl_tree.trainer",
        "trl_tree.trainer.configuration",
        "trl_tree.methods",
        "trl_tree.rollout",
        "trl_tree.core",
    ),
    "trl_tree.trainer.configuration": (
        "trl_tree.methods",
        "trl_tree.rollout",
        "trl_tree.core",
        "trl_tree.text",
    ),
    "trl_tree.trainer.observability": (
        "trl_tree.trainer.configuration",
        "trl_tree.methods",
        "trl_tree.tree_view",
        "trl_tree.rollout",
        "trl_tree.core",
        "trl_tree.text",
    ),
    "trl_tree.trainer": (
        "trl_tree.trainer.configuration",
        "trl_tree.trainer.observability",
        "trl_tree.methods",
        "trl_tree.asynchronous",
        "trl_tree.tree_view",
        "trl_tree.rewards",
        "trl_tree.rollout",
        "trl_tree.core",
        "trl_tree.text",
    ),
}
WHY = {
    "trl_tree.core": "the core imports nothing of trl_tree outside itself: what it needs of a sampler, a harness or "
    "the trainer comes in through a unit's constructor or the pipeline's ports",
    "trl_tree.rollout": "rollout/ grows trees for whoever owns it: it takes ports (HFPorts, VLLMPorts, TurnLoopPorts), "
    "never the trainer, the catalogue that builds it or the views",
    "trl_tree.rollout.generating": "an engine continues prefixes for whoever calls it: it knows no sampler, tool or "
    "trainer (its owner's needs come in through HFPorts / VLLMPorts)",
    "trl_tree.rollout.acting": "tools and environments run between turns: they know neither the samplers that call "
    "them nor the engines",
    "trl_tree.asynchronous": "the producer thread is handed callables by the trainer; it never reaches back into it",
    "trl_tree.tree_view": "the page renders saved data; the trainer's side of it is "
    "trainer/observability/tree_view_logging.py",
    "trl_tree.trainer": "the adapter never imports a preset: the presets build on it, and the method table names them",
    "trl_tree.trainer.configuration": "a config is built before any trainer: it knows the method table and the rollout "
    "layer's value checks, not the adapter, its collaborators or the presets",
    "trl_tree.trainer.observability": "what a run shows reads the trainer's results as values: it imports neither the "
    "adapter nor the presets",
}
# TRL's private names: the trainer's, and those of the two entry points that drive TRL's helpers themselves (the CLI's
# reward names, the evaluation's tool-message rendering)
TRL_INTERNALS_USERS = ("trl_tree.trainer", "trl_tree.scripts", "trl_tree.envs.agent_eval", "trl_tree.trl_internals")


def _within(name: str, prefixes) -> bool:
    return any(name == p or name.startswith(p + ".") for p in prefixes)


def _module_of(path: Path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _is_module(name: str) -> bool:
    base = ROOT.joinpath(*name.split("."))
    return base.with_suffix(".py").is_file() or (base / "__init__.py").is_file()


def imports_of(path: Path, module: str) -> list[tuple[int, list[str]]]:
    """(line, absolute module names) of every import statement in `path` (the module `module`): `from X import a`
    names X, and X.a too where that is a module of the repository (`from .. import methods` imports trl_tree.methods)."""
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    found = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found += [(node.lineno, [alias.name]) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                parts = package.split(".")
                base = ".".join(parts[: len(parts) - node.level + 1] + ([node.module] if node.module else []))
            else:
                base = node.module
            found.append(
                (node.lineno, [base] + [f"{base}.{a.name}" for a in node.names if _is_module(f"{base}.{a.name}")])
            )
    return found


def _room(module: str) -> str | None:
    rooms = [room for room in ALLOWED if _within(module, (room,))]
    return max(rooms, key=len) if rooms else None


def _why(module: str, name: str) -> str | None:
    """Why `module` may not import `name` (None: it may)."""
    if name in MOVED and module not in MOVED:
        return f"{name} is a deprecated alias: import {MOVED[name]}"
    if _within(name, ("trl_tree.trl_internals",)):
        if _within(module, TRL_INTERNALS_USERS):
            return None
        return "TRL's private names are the trainer's business (trl_internals: trainer/ and the entry points only)"
    room = _room(module)
    if room is None or _room(name) == room:
        return None
    if room == "trl_tree.core" and (_within(name, ("trl",)) or name == "trl_tree"):
        return WHY[room]
    target = _room(name)
    if target is None or _within(target, ALLOWED[room]):
        return None
    return WHY.get(room, f"{room} may import only {', '.join(ALLOWED[room]) or 'itself'} (docs/design.md §2)")


def violations(path: Path, module: str) -> list[str]:
    """Each import statement of `module` (at `path`) that its room forbids, as 'file:line imports X: why', X the most
    specific module of the statement that crosses."""
    where = path.relative_to(ROOT) if path.is_relative_to(ROOT) else path
    out = []
    for line, names in imports_of(path, module):
        crossing = [(name, why) for name in names if (why := _why(module, name))]
        if crossing:
            name, why = max(crossing, key=lambda pair: len(pair[0]))
            out.append(f"{where}:{line} imports {name}: {why}")
    return out


def _package_modules():
    return sorted((ROOT / "trl_tree").rglob("*.py"))


def test_every_import_keeps_to_its_layer():
    """No module of trl_tree imports across a layer the diagram of docs/design.md §2 forbids."""
    found = [v for path in _package_modules() for v in violations(path, _module_of(path))]
    assert not found, "\n".join(found)


def test_the_repository_imports_no_old_path():
    """The tests, benchmarks, examples and scripts import the core where it lives (`from trl_tree import credit`, the
    public name, is fine; `trl_tree.credit` as a path is the deprecated alias)."""
    found = []
    for folder in ("tests", "benchmarks", "examples", "scripts"):
        for path in sorted((ROOT / folder).rglob("*.py")):
            for node in ast.walk(ast.parse(path.read_text())):
                if isinstance(node, ast.Import):
                    names = [alias.name for alias in node.names]
                elif isinstance(node, ast.ImportFrom) and node.level == 0:
                    names = [node.module]
                else:
                    continue
                found += [f"{path.relative_to(ROOT)}:{node.lineno} imports {n}" for n in names if n in MOVED]
    assert not found, "\n".join(found)


@pytest.mark.parametrize(
    ("module", "source", "expected"),
    [
        (
            "trl_tree.core.unit",
            "from ..rollout.generating.engine import rollout_session\n",
            "trl_tree.rollout.generating.engine",
        ),
        (
            "trl_tree.rollout.generating.engine",
            "from ..acting.tools import run_tool_call\n",
            "trl_tree.rollout.acting.tools",
        ),
        (
            "trl_tree.rollout.acting.tools",
            "from ..growing.turn_loop import Branch\n",
            "trl_tree.rollout.growing.turn_loop",
        ),
        ("trl_tree.core.unit", "def f():\n    from .. import methods\n", "trl_tree.methods"),
        ("trl_tree.core.unit", "import trl\n", "trl"),
        ("trl_tree.rollout.sampler", "from ..trainer import base\n", "trl_tree.trainer.base"),
        ("trl_tree.asynchronous.worker", "from trl_tree.trainer.base import TreeTrainer\n", "trl_tree.trainer.base"),
        (
            "trl_tree.tree_view.page",
            "from ..trainer.observability import tree_view_logging\n",
            "trl_tree.trainer.observability.tree_view_logging",
        ),
        ("trl_tree.trainer.base", "from .presets.treeopsd import TreeOPSDTrainer\n", "trl_tree.trainer.presets.treeopsd"),
        ("trl_tree.trainer.configuration.fields", "from ..base import TreeTrainer\n", "trl_tree.trainer.base"),
        ("trl_tree.trainer.observability.model_card", "from .. import scoring\n", "trl_tree.trainer.scoring"),
        ("trl_tree.rewards", "from .trl_internals import grpo_reward\n", "trl_tree.trl_internals"),
        ("trl_tree.trainer.base", "from ..credit import standardize\n", "trl_tree.credit"),
    ],
)
def test_a_crossing_import_is_caught(tmp_path, module, source, expected):
    """The checker is no formality: each forbidden arrow of the diagram, written into a module of that room, fails
    it, naming what was imported (inside a function too)."""
    path = tmp_path / "module.py"
    path.write_text(source)
    found = violations(path, module)
    assert len(found) == 1 and f"imports {expected}:" in found[0], found


def test_an_allowed_import_passes(tmp_path):
    path = tmp_path / "module.py"
    path.write_text("import torch\nfrom .packing import pack_trees\nfrom ..core import credit\n")
    assert violations(path, "trl_tree.core.unit") == []
    assert violations(path, "trl_tree.trainer.base") == []


@pytest.mark.parametrize("old", sorted(MOVED))
def test_an_old_path_warns_and_is_the_moved_module(old):
    """`import trl_tree.credit` keeps working for one release: it is `trl_tree.core.credit` itself (private names,
    monkeypatching and isinstance checks unchanged), with a DeprecationWarning naming the new path."""
    sys.modules.pop(old, None)
    with pytest.warns(DeprecationWarning, match=MOVED[old].replace(".", r"\.")):
        aliased = importlib.import_module(old)
    assert aliased is importlib.import_module(MOVED[old])


def test_the_public_module_names_import_without_a_warning(monkeypatch):
    """`from trl_tree import credit, losses, methods, packing` (docs/design.md §4) reaches the core without the
    deprecated aliases, whether or not an alias was imported before."""
    for name in ("packing", "pipeline"):  # the lazy ones: answered by trl_tree.__getattr__, not the old path
        monkeypatch.delattr(trl_tree, name, raising=False)
        monkeypatch.delitem(sys.modules, f"trl_tree.{name}", raising=False)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        from trl_tree import credit, losses, methods, packing, pipeline  # noqa: F401
    assert not [w for w in caught if "trl_tree" in str(w.message)], [str(w.message) for w in caught]
    assert credit is importlib.import_module("trl_tree.core.credit")
    assert packing is importlib.import_module("trl_tree.core.packing")
    assert pipeline is importlib.import_module("trl_tree.core.pipeline")
