"""Init-expand sampling (docs/design.md §3 "Anchors"): each trajectory's N anchors are uniform over {1..T−1} (0 when
T = 1), and continuations whose anchor the trajectory reaches start alongside it, so a tree of full-length
trajectories takes the flat loop's T rounds of generate calls, not T + (T − 1)."""

import random
from collections import Counter

import pytest

from tests.scripted import CounterEnv
from trl_tree.core.tree import Turn
from trl_tree.rollout.growing.samplers import InitExpandSampler, TreeRoot
from trl_tree.rollout.growing.turn_loop import Branch, SamplerSettings, TurnLoop, TurnLoopPorts
from trl_tree.testing import ScriptedEngine

CALL, ANSWER, OBSERVATION, EOS = 5, 6, 9, 2


def look() -> str:
    """Looks around.

    Returns:
        What it sees.
    """
    return "ok"


def _parser(tool: str):
    def parse(ids, prefix):
        if ids and ids[0] == CALL:
            return {"role": "assistant", "content": "",
                    "tool_calls": [{"type": "function", "function": {"name": tool, "arguments": {}}}]}
        return {"role": "assistant", "content": "done"}

    return parse


def _sampler(script, max_turns: int, m: int, n: int, seed: int = 0, tool: str = "look"
             ) -> tuple[InitExpandSampler, ScriptedEngine]:
    engine = ScriptedEngine(script, eos_ids=[EOS])
    ports = TurnLoopPorts(engine, parse=_parser(tool), observation_ids=lambda messages: [OBSERVATION] * len(messages))
    loop = TurnLoop(ports, SamplerSettings(max_turns=max_turns, max_completion_length=10_000))
    return InitExpandSampler(loop, m, n, seed=seed), engine


def _record_restarts(monkeypatch) -> list[tuple[Branch, int]]:
    """(trajectory, anchor) of every restart, whenever it happens (the trajectory may still be running)."""
    restarts, restart_at = [], Branch.restart_at

    def recording(self, t):
        restarts.append((self, t))
        return restart_at(self, t)

    monkeypatch.setattr(Branch, "restart_at", recording)
    return restarts


def test_anchors_are_uniform_over_the_turns_before_the_last_given_the_trajectory_length(monkeypatch):
    """Trajectories of random length T ≤ T_max = 4: the anchors drawn for a trajectory of length T are uniform over
    {1..T−1} (chi-square against uniform, per T), and 0 when T = 1, although the candidates that the trajectory
    reaches start before T is known."""
    policy = random.Random(1)  # the "model": calls the tool with probability 0.6 at every turn
    sampler, _ = _sampler(lambda prefix: [CALL if policy.random() < 0.6 else ANSWER, EOS], max_turns=4, m=4, n=3)
    restarts = _record_restarts(monkeypatch)
    for _ in range(150):
        sampler.sample([TreeRoot([1], tools={"look": look})] * 4)
    by_length: dict[int, Counter] = {}
    for trajectory, anchor in restarts:
        by_length.setdefault(len(trajectory.turns), Counter())[anchor] += 1
    assert set(by_length) == {1, 2, 3, 4}
    assert set(by_length[1]) == {0}
    for length in (2, 3, 4):
        counts = by_length[length]
        assert set(counts) == set(range(1, length))
        total = sum(counts.values())
        expected = total / (length - 1)
        chi_square = sum((counts[t] - expected) ** 2 / expected for t in range(1, length))
        assert total > 300 and chi_square < 13.8, (length, counts)  # 13.8: the 0.999 quantile at ≤ 2 dof


@pytest.mark.parametrize("max_turns", [2, 3, 5])
def test_full_length_trajectories_take_the_flat_loops_rounds(max_turns):
    """Every trajectory calls the tool until its last allowed turn: each continuation starts in the round of its
    anchor, so the tree takes max_turns generate calls (the flat loop's), and every tree still has K = M(N + 1)
    leaves of max_turns turns whose first anchor turns they share with their trajectory."""
    sampler, engine = _sampler(lambda prefix: [CALL, EOS], max_turns=max_turns, m=4, n=2)
    per_tree = sampler.sample([TreeRoot([1], tools={"look": look}), TreeRoot([3], tools={"look": look})])
    assert engine.calls == max_turns
    for tree in per_tree:
        initial, continuations = tree[:4], tree[4:]
        assert len(continuations) == 8 and all(b.done and len(b.turns) == max_turns for b in tree)
        for k, trajectory in enumerate(initial):
            for continuation in continuations[2 * k: 2 * k + 2]:
                shared = sum(a is b for a, b in zip(continuation.turns, trajectory.turns))
                assert 1 <= shared <= max_turns - 1  # kept turns [0, anchor), regenerated the rest
                assert continuation.tree == trajectory.tree


def test_a_continuation_started_alongside_its_trajectory_has_its_own_copy_of_the_history():
    """A continuation that starts while its trajectory runs keeps the trajectory's history as it was at the anchor:
    what the trajectory appends afterwards (its own later turns and observations) is not in the continuation."""
    sampler, _ = _sampler(lambda prefix: [CALL, EOS], max_turns=3, m=1, n=4, seed=3)
    [[trajectory, *continuations]] = sampler.sample([TreeRoot([1], tools={"look": look})])
    assert len(trajectory.turns) == 3
    for continuation in continuations:
        anchor = next(t for t, (a, b) in enumerate(zip(continuation.turns, trajectory.turns)) if a is not b)
        start = len(continuation.prefix_ids) - sum(
            len(turn.action_ids) + len(turn.observation_ids) for turn in continuation.turns[anchor:])
        assert continuation.prefix_ids[:start] == trajectory.prefix_ids[:start]
        assert len(continuation.messages) == 2 * len(continuation.turns) - 1  # its own turns and observations only


def test_a_continuation_started_alongside_its_trajectory_has_its_own_copy_of_the_environment():
    """Full-length trajectories, so every continuation starts while its trajectory runs (max_turns calls): each gets
    a copy of the trajectory's world as it is at the anchor. Every leaf counts 1, 2, 3 on its own counter, and the
    trajectory's counter is not advanced by its continuations' calls."""
    root_env = CounterEnv()
    sampler, engine = _sampler(lambda prefix: [CALL, EOS], max_turns=4, m=2, n=3, tool="increment")
    [tree] = sampler.sample([TreeRoot([1], env=root_env, tools={"increment": root_env.increment})])
    assert engine.calls == 4 and len(tree) == 2 * (3 + 1)
    assert len({id(b.env) for b in tree}) == len(tree)
    for branch in tree:
        assert [m["content"] for m in branch.messages if m["role"] == "tool"] == ["1", "2", "3"]
        assert branch.env.n == 3


def test_a_restart_at_the_turn_being_sampled_keeps_none_of_it():
    """restart_at(len(turns)) of a running branch keeps its history before that turn, without the head of the turn
    it may already hold (a branch resumed inside a turn)."""
    running = Branch(tree=0, prefix_ids=[1, 7, 7], prompt_len=1, pending=Turn([7, 7], [0.0, 0.0], []))
    restarted = running.restart_at(0)
    assert restarted.prefix_ids == [1] and restarted.pending is None and restarted.turns == []
