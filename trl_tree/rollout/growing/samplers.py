"""Growing rollout trees: where trajectories start and where continuations restart (docs/design.md §3 "Anchors").

The samplers decide which branches to grow (M trajectories from the prompt, continuations restarted at turn prefixes,
entropy-guided expansions); the turn loop (`turn_loop.py`) grows them, one batched engine call per round.
"""
from __future__ import annotations

import random
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from ...core.tree import RolloutTree
from ..acting.env_branching import TreeEnvironment, fork_environment
from .expansion import expansion_anchor, select_expansion_turns, tree_turn_entropies
from .turn_loop import Branch, TurnLoop, _bind_tools

# ---------------------------------------------------------------------------------------------------------------
# Samplers
# ---------------------------------------------------------------------------------------------------------------


class SampledTrees(list):
    """What `sample` returns: per root, its finished branches (a list, as the callers index and unpack it), with
    `stats`, what the sampler measured while growing them (metric name -> one value per tree, prompt-major; e.g.
    TreeAdv's branch points). The tree unit passes them on in `pipeline.Grown` for the trainer to log."""

    def __init__(self, per_root: list[list[Branch]], stats: dict[str, list[float]] | None = None):
        super().__init__(per_root)
        self.stats = stats or {}


@dataclass
class TreeRoot:
    """What a sampler needs to start one tree: the rendered prompt, the root's (already reset) environment if any, and
    the tree's `TreeEnvironment` (the pool to take more instances from and the dataset row to reset them with)."""

    prompt_ids: list[int]
    env: Any = None
    tools: dict[str, Callable] = field(default_factory=dict)
    environment: TreeEnvironment | None = None


def _start(tree: int, root: TreeRoot, first: bool, snapshots: bool) -> Branch:
    """A trajectory from the root. The tree's first one uses the root's environment; every other one a fresh instance
    reset with the same row (no copy). `snapshots`: whether the sampler will restart branches from inner turns."""
    env = root.env
    if not first and env is not None:
        env = root.environment.start() if root.environment is not None else fork_environment(env)
    diverged = root.environment is not None and env is not None and root.environment.diverged(env)
    return Branch(
        tree=tree, prefix_ids=list(root.prompt_ids), prompt_len=len(root.prompt_ids), env=env,
        tools=_bind_tools(root.tools, env), environment=root.environment, take_snapshots=snapshots,
        diverged_at=0 if diverged else None,
    )


def uniform_anchors(num_turns: int, n: int, rng: random.Random) -> list[int]:
    """N anchor turn indices drawn uniformly from {1..T−1} with replacement; 0 (resample from the prompt) if T = 1."""
    if num_turns <= 1:
        return [0] * n
    return [rng.randint(1, num_turns - 1) for _ in range(n)]


def early_anchors(max_turns: int, n: int, rng: random.Random) -> list[int]:
    """N anchor candidates drawn before a trajectory starts, uniformly from {1..max_turns − 1} (none when
    max_turns = 1). See `InitExpandSampler` for why they leave the anchors uniform over {1..T−1}."""
    return [rng.randint(1, max_turns - 1) for _ in range(n)] if max_turns > 1 else []


class InitExpandSampler:
    """TreeOPSD / TreePO's initialise-then-expand trees: M full trajectories, then N continuations of each from
    uniformly drawn turn prefixes. K = M(N + 1) leaves per tree; expected cost ≈ M(1 + N/2) trajectories.

    When continuations start. An anchor t regenerates turn t from the trajectory's first t turns, so its continuation
    can start as soon as the trajectory is about to sample turn t, alongside it, rather than after it ends (which
    would add up to T − 1 rounds of generate calls after the longest trajectory's T). But the anchor must be uniform
    over {1..T−1}, and T is known only at the end. So each of the N anchors is first drawn, before the trajectory
    starts, uniformly from {1..T_max − 1} (T_max = max_turns ≥ T): a candidate a that the trajectory reaches (it is
    about to sample turn a, so T ≥ a + 1) starts at once; one it never reaches (a ≥ T) is drawn again uniformly from
    {1..T−1} when the trajectory ends. Given T, the candidate is independent of the trajectory, so

        P(anchor = t | T) = 1/(T_max − 1) + (T_max − T)/(T_max − 1) · 1/(T − 1) = 1/(T − 1),   t ∈ {1..T−1}:

    exactly the uniform anchors (T = 1: every candidate is redrawn, as 0). Trajectories that use all T_max turns,
    the longest, never wait; a shorter one's redrawn continuations start when it ends. The continuations are
    distributed as if they had waited; only the order of the random draws (hence the tokens of a seeded run) differs.
    """

    def __init__(self, loop: TurnLoop, num_initial: int, num_branches: int, seed: int = 0):
        if num_initial < 1 or num_branches < 0:
            raise ValueError(
                f"Need num_initial_rollouts M ≥ 1 and num_branches N ≥ 0; got M = {num_initial}, N = {num_branches}."
            )
        self.loop = loop
        self.num_initial = num_initial
        self.num_branches = num_branches
        self.rng = random.Random(seed)

    def sample(self, roots: list[TreeRoot]) -> SampledTrees:
        """Returns, per tree, its K finished branches: the M initial ones first, then their continuations (each
        trajectory's in the order they started)."""
        initial = [
            _start(i, root, first=m == 0, snapshots=self.num_branches > 0)
            for i, root in enumerate(roots)
            for m in range(self.num_initial)
        ]
        max_turns = self.loop.settings.max_turns
        candidates = {id(b): early_anchors(max_turns, self.num_branches, self.rng) for b in initial}
        continuations: dict[int, list[Branch]] = {id(b): [] for b in initial}

        def branch_from(trajectory: Branch, anchors: list[int]) -> list[Branch]:
            new = [trajectory.restart_at(t) for t in anchors]
            for continuation in new:  # continuations are leaves: nothing restarts from them
                continuation.take_snapshots = False
                continuation.round = 1
            continuations[id(trajectory)] += new
            return new

        def reached(branch: Branch) -> list[Branch]:
            if branch.round:
                return []
            t, waiting = len(branch.turns), candidates[id(branch)]
            candidates[id(branch)] = [a for a in waiting if a != t]
            return branch_from(branch, [a for a in waiting if a == t])

        def finished(branch: Branch) -> list[Branch]:
            if branch.round:
                return []
            candidates.pop(id(branch))  # those it never reached (each ≥ T) are drawn again from {1..T−1}
            missing = self.num_branches - len(continuations[id(branch)])
            return branch_from(branch, uniform_anchors(len(branch.turns), missing, self.rng))

        branching = self.num_branches > 0
        self.loop.run(list(initial), on_finish=finished if branching else None, on_turn=reached if branching else None)
        expansions = [c for branch in initial for c in continuations[id(branch)]]
        per_tree: list[list[Branch]] = [[] for _ in roots]
        for branch in initial + expansions:
            per_tree[branch.tree].append(branch)
        return SampledTrees(per_tree)


class EntropyGuidedSampler:
    """AT2PO's entropy-guided expansion (A1–A2): M initial trajectories, then L rounds that each re-sample the K
    highest-scoring turns S_i = H_i − α·max(0, siblings − 1) from their own pre-turn history (a new sibling).

    `mode="random"` picks the K turns uniformly among the candidates (the paper's random-expansion ablation). When a
    tree has fewer candidate turns than K (e.g. single-turn trajectories), the rest of the round's budget resamples
    from the prompt, so every tree has K = M + L·K leaves.
    """

    def __init__(
        self, loop: TurnLoop, num_initial: int, rounds: int, per_round: int, mode: str = "entropy",
        alpha: float = 0.05, seed: int = 0,
    ):
        if num_initial < 1 or rounds < 0 or per_round < 0:
            raise ValueError(
                f"Need num_initial_rollouts ≥ 1, expansion_rounds ≥ 0 and branches_per_round ≥ 0; got "
                f"{num_initial}, {rounds}, {per_round}."
            )
        if mode not in ("entropy", "random"):
            raise ValueError(f"expansion_mode must be 'entropy' or 'random'; got {mode!r}.")
        self.loop, self.num_initial, self.rounds, self.per_round = loop, num_initial, rounds, per_round
        self.mode, self.alpha = mode, alpha
        self.rng = random.Random(seed)

    def sample(self, roots: list[TreeRoot]) -> SampledTrees:
        branching = self.rounds > 0 and self.per_round > 0
        per_tree = [
            [_start(i, root, first=m == 0, snapshots=branching) for m in range(self.num_initial)]
            for i, root in enumerate(roots)
        ]
        self.loop.run([b for branches in per_tree for b in branches])
        for r in range(self.rounds):
            new = [self._expand(root, branches) for root, branches in zip(roots, per_tree)]
            for b in (b for branches in new for b in branches):
                b.round = r + 1
            self.loop.run([b for branches in new for b in branches])
            for branches, added in zip(per_tree, new):
                branches.extend(added)
        return SampledTrees(per_tree)

    def _expand(self, root: TreeRoot, branches: list[Branch]) -> list[Branch]:
        tree = RolloutTree.from_trajectories(root.prompt_ids, [b.turns for b in branches], [0.0] * len(branches))
        entropies = tree_turn_entropies(tree) if self.mode == "entropy" else None
        chosen = select_expansion_turns(tree, entropies, self.per_round, alpha=self.alpha, rng=self.rng, mode=self.mode)
        restarts = [branches[k].restart_at(t) for k, t in (expansion_anchor(tree, i) for i in chosen)]
        restarts += [branches[0].restart_at(0) for _ in range(self.per_round - len(chosen))]
        return restarts
