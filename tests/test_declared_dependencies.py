"""Every package the test suite imports when it collects comes from what the README's test line installs
(trl-tree with its `dev` and `deepspeed` extras, and what those require). CI runs the suite in a fresh virtual
environment, so a package that is only on this machine fails collection there; this test says which one, here.

Imports inside functions and modules guarded by `pytest.importorskip` are not collection-time needs and are left out."""

import ast
import sys
from importlib import metadata
from pathlib import Path

from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

ROOT = Path(__file__).resolve().parents[1]
TEST_EXTRAS = ("dev", "deepspeed")  # the README's test line: pip install -e ".[dev,deepspeed]"
LOCAL = {"trl_tree", "tests", "gpu_suite", "benchmarks", "scripts", "examples"}  # the repository's own modules


def _top_level_imports(path: Path) -> set[str]:
    """Modules imported at module level, up to a module-level skip (what follows it runs only where the skip did
    not fire). Imports in a function (the test's own, run-time needs) and in a `try` that catches ImportError (optional
    by construction) are left out."""
    names = set()
    for node in ast.parse(path.read_text()).body:
        if isinstance(node, ast.If) and any(_is_module_skip(child) for child in ast.walk(node)):
            break
        if isinstance(node, ast.Try) and any(_catches_import_error(handler) for handler in node.handlers):
            continue
        for child in ast.walk(node) if isinstance(node, (ast.If, ast.Try, ast.With)) else [node]:
            if isinstance(child, ast.Import):
                names |= {alias.name.split(".")[0] for alias in child.names}
            elif isinstance(child, ast.ImportFrom) and child.level == 0 and child.module:
                names.add(child.module.split(".")[0])
    return names


def _is_module_skip(node: ast.AST) -> bool:
    return (isinstance(node, ast.Call) and getattr(node.func, "attr", "") == "skip"
            and any(keyword.arg == "allow_module_level" for keyword in node.keywords))


def _catches_import_error(handler: ast.ExceptHandler) -> bool:
    caught = handler.type.elts if isinstance(handler.type, ast.Tuple) else [handler.type]
    return any(getattr(name, "id", "") in {"ImportError", "ModuleNotFoundError"} for name in caught)


def _skips_without(path: Path) -> set[str]:
    """Modules the file asks for through pytest.importorskip: a missing one skips, it does not fail."""
    return {node.args[0].value.split(".")[0] for node in ast.walk(ast.parse(path.read_text()))
            if isinstance(node, ast.Call) and getattr(node.func, "attr", "") == "importorskip"
            and node.args and isinstance(node.args[0], ast.Constant)}


def _installed_closure(distribution: str, extras: tuple[str, ...]) -> set[str]:
    """The distributions `pip install distribution[extras]` brings, followed through their own requirements."""
    seen: set[str] = set()
    todo = [(distribution, extras)]
    while todo:
        name, wanted = todo.pop()
        key = canonicalize_name(name)
        if key in seen and not wanted:
            continue
        seen.add(key)
        try:
            requires = metadata.requires(name) or []
        except metadata.PackageNotFoundError:
            continue  # declared but not installed here (a platform marker); nothing below it to follow
        for line in requires:
            requirement = Requirement(line)
            environments = [{"extra": extra} for extra in wanted] or [{"extra": ""}]
            if requirement.marker is None or any(requirement.marker.evaluate(env) for env in environments):
                todo.append((requirement.name, tuple(requirement.extras)))
    return seen


def test_every_module_the_suite_imports_at_collection_is_a_declared_dependency():
    closure = _installed_closure("trl-tree", TEST_EXTRAS)
    providers = metadata.packages_distributions()
    undeclared = {}
    for path in sorted((ROOT / "tests").rglob("*.py")):
        for module in _top_level_imports(path) - _skips_without(path) - LOCAL:
            if module in sys.stdlib_module_names or module == "__future__":
                continue
            dists = {canonicalize_name(d) for d in providers.get(module, [])}
            if not dists & closure:
                undeclared.setdefault(module, []).append(path.relative_to(ROOT).as_posix())
    assert not undeclared, (
        f"the suite imports {sorted(undeclared)} at collection ({undeclared}), which `pip install -e "
        f"\".[{','.join(TEST_EXTRAS)}]\"` does not install: add the package to pyproject.toml's `dev` extra")


def test_the_check_sees_a_missing_package(tmp_path):
    """The check's own premise: a module no declared distribution provides is reported."""
    closure = _installed_closure("trl-tree", TEST_EXTRAS)
    assert "pytest" in closure and "torch" in closure and "trl" in closure
    assert canonicalize_name("no-such-package-anywhere") not in closure
    probe = tmp_path / "test_probe.py"
    probe.write_text(
        "import os\nimport yaml\nfrom hypothesis import given\ntry:\n    import vllm\nexcept ImportError:\n    vllm = None\n"
        "\ndef test_x():\n    import wandb\n\nif vllm is None:\n    pytest.skip('no', allow_module_level=True)\nimport numba\n")
    assert _top_level_imports(probe) == {"os", "yaml", "hypothesis"}
