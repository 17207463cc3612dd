"""TRL's private names: every one trl-tree uses is declared in `trl_tree.trainer.trl_internals`, exists in the
installed TRL with the parameters trl-tree passes, and is used nowhere else (so a TRL release breaks this file, not a
training run)."""

import re
from pathlib import Path

import pytest
from trl import GRPOTrainer

from trl_tree import trl_internals

PACKAGE = Path(trl_internals.__file__).resolve().parent


def test_installed_trl_has_every_private_name_trl_tree_uses():
    assert trl_internals.mismatches() == ()
    trl_internals.check_installed()


@pytest.mark.parametrize("name", sorted(trl_internals.CALLED))
def test_a_renamed_method_fails_with_a_message_naming_it(monkeypatch, name):
    owner = trl_internals._classes()[trl_internals.CALLED[name][0]]
    monkeypatch.delattr(owner, name)
    trl_internals.mismatches.cache_clear()
    try:
        with pytest.raises(ImportError, match=re.escape(f"{owner.__name__}.{name}")) as error:
            trl_internals.check_installed()
        assert "pip install" in str(error.value)
    finally:
        monkeypatch.undo()
        trl_internals.mismatches.cache_clear()


def test_a_trl_whose_reward_gather_moved_fails_with_a_message_naming_it(monkeypatch):
    """`rank_alone_rewards` switches the module-level `gather` that `_calculate_rewards` ends with: a TRL without it
    (or gathering otherwise) fails the check, naming it, instead of gathering inside the rollout worker's thread."""
    import trl.trainer.grpo_trainer as grpo

    monkeypatch.delattr(grpo, "gather")
    trl_internals.mismatches.cache_clear()
    try:
        problems = trl_internals.mismatches()
        assert len(problems) == 1 and "module-level `gather`" in problems[0], problems
    finally:
        monkeypatch.undo()
        trl_internals.mismatches.cache_clear()


def test_a_changed_signature_is_reported(monkeypatch):
    monkeypatch.setattr(GRPOTrainer, "_get_tool_suffix_ids", lambda self, messages, extra: None)
    trl_internals.mismatches.cache_clear()
    try:
        problems = trl_internals.mismatches()
        assert len(problems) == 1 and "_get_tool_suffix_ids" in problems[0] and "tool_messages" in problems[0]
    finally:
        monkeypatch.undo()
        trl_internals.mismatches.cache_clear()


def _uses_outside_the_module(name: str) -> list[str]:
    """Lines of trl_tree (outside trl_internals.py) that reach TRL's private `name` as an attribute."""
    pattern = re.compile(rf"(?<!super\(\))\.{re.escape(name)}\b")
    hits = []
    for path in PACKAGE.rglob("*.py"):
        if path.name == "trl_internals.py":
            continue
        for number, line in enumerate(path.read_text().splitlines(), 1):
            if pattern.search(line) and not line.lstrip().startswith("#"):
                hits.append(f"{path.relative_to(PACKAGE)}:{number}: {line.strip()}")
    return hits


@pytest.mark.parametrize("name", sorted(set(trl_internals.CALLED) | set(trl_internals.ATTRIBUTES)))
def test_private_names_are_reached_only_through_the_module(name):
    assert _uses_outside_the_module(name) == []


def test_overridden_methods_are_only_called_on_the_trainer_itself():
    """An override is called through `self` (our own method) or `super()` (TRL's), never on another object."""
    for name in trl_internals.OVERRIDDEN:
        other = [hit for hit in _uses_outside_the_module(name) if f"self.{name}" not in hit]
        assert other == [], name


def test_trl_grpos_short_reward_names_are_read_from_the_installed_trl():
    """`REWARD_NAMES`: the dict of short reward names that `trl grpo`'s `main` builds is found, and every name in it
    resolves to a callable of `trl.rewards` (a TRL release that moves or reshapes it fails here)."""
    assert trl_internals.reward_name_problems() == ()
    assert trl_internals.grpo_reward_names()[0] == "accuracy_reward"


def test_a_trl_without_the_short_reward_names_is_reported_naming_where_they_were(monkeypatch):
    monkeypatch.setattr(trl_internals, "REWARD_NAMES", ("trl.scripts.grpo", "main", "renamed_registry"))
    trl_internals._reward_registry.cache_clear()
    try:
        (problem,) = trl_internals.reward_name_problems()
        assert "renamed_registry" in problem and "trl.scripts.grpo.main" in problem
        with pytest.raises(LookupError):
            trl_internals.grpo_reward_names()
    finally:
        monkeypatch.undo()
        trl_internals._reward_registry.cache_clear()
