"""TreeAdv's token-level branching: trees that branch *inside* completions at high-entropy tokens (docs/design.md §3 D1–D4).

Per prompt, a forest of M trees. Each tree starts as one complete trajectory (the turn loop: generate, run tools,
observe, up to `max_turns` assistant turns). Then, in `rounds` rounds, the highest-entropy tokens of the tree become
branch points: the history before the token is kept and a new continuation is sampled from there, so the policy
re-decides exactly the uncertain token, and the continuation runs to the end of its trajectory like any other.

Where the paper is silent, these rules are the spec:

- A branch point is an action token j of an existing segment node whose entropy H_j (of the distribution token j was
  sampled from) exceeds τ_H (`threshold`). It splits the node into [0, j) and [j, n); the new continuation is a sibling
  of [j, n). Each branch point adds one continuation, i.e. one leaf.
- Both pieces keep at least `min_segment_length` tokens (L): L ≤ j ≤ n − L. So the first token of a turn is never a
  branch point: re-sampling a whole turn is turn-level branching (the other samplers), and re-sampling the first turn
  from the prompt is simply another tree. Two branch points chosen in one node in the same round lie ≥ L apart.
- A tree gets at most `max_branches` branch points (`max_branches_per_tree`). Round r (of R) spends
  ceil(remaining / (R − r)) of them on the highest-entropy candidates among all the tree's current segments (its
  root trajectory and the continuations of earlier rounds): highest entropy first, ties to the earlier node in DFS
  order, then the earlier token.
- A continuation finishes the assistant turn it starts in; the *whole* turn (the kept head plus the continuation) is
  parsed for tool calls, so a branch inside a tool call can change the call. `max_turns` counts assistant turns, not
  segments. A stateful environment restarts as it was before that turn (no tool runs inside a turn).
- The reward group (D1) is every leaf of the prompt's forest: K = M + (branch points), between M and
  M(1 + max_branches). If a prompt would end with a single leaf (M = 1 and no token above τ_H), one branch is forced
  at its highest-entropy eligible token regardless of τ_H (or, when no token is eligible, one more trajectory is
  sampled from the prompt), so that the sample std of D1 exists.

Representation. A branch point inside a turn splits that turn into segment nodes: a `Turn` whose action stops
mid-turn (`partial=True`, no observation), followed by the `Turn` that continues it. During sampling a `Branch`
keeps whole assistant turns (so tool parsing, `max_turns` and environment snapshots stay per turn); the forest
remembers each branch point as the token history before it, and every trajectory that contains that history is cut
there. When sampling ends, each branch's `turns` are replaced by its segments (`split_turns`), so
`RolloutTree.from_trajectories` merges the shared segments (same history), packing trains every unique token once,
and the credit (D2, `credit.segment_advantages`) is per segment node, which D3 broadcasts to the segment's tokens.
"""

from __future__ import annotations

import math
from collections.abc import Iterable

from ...core.tree import RolloutTree, Turn
from .samplers import SampledTrees, TreeRoot, _start
from .turn_loop import Branch, TurnLoop

BRANCH_POINTS_METRIC = "treeadv/branch_points_per_tree"  # token-level branch points each tree got, per batch


def split_turns(branch: Branch, cuts: Iterable[int]) -> tuple[list[Turn], list[int]]:
    """The branch's assistant turns split into segment nodes at the token positions `cuts` (indices into
    `branch.prefix_ids`; a cut at p starts a new segment with token p). Cuts outside an action or at a turn's first
    token are ignored.

    Every segment but the last of a turn is `partial` (no observation, no penalty, not truncated); the last one
    keeps the turn's observation, truncation flag and process penalty.

    Returns:
        (segments, start position of each segment in `branch.prefix_ids`).
    """
    cuts = sorted(set(cuts))
    segments, starts = [], []
    for start, turn in zip(branch.turn_starts, branch.turns):
        n = len(turn.action_ids)
        bounds = [0, *(p - start for p in cuts if start < p < start + n), n]
        for a, b in zip(bounds[:-1], bounds[1:]):
            last = b == n
            segments.append(
                Turn(
                    action_ids=turn.action_ids[a:b],
                    action_logps=turn.action_logps[a:b],
                    observation_ids=list(turn.observation_ids) if last else [],
                    entropies=None if turn.entropies is None else turn.entropies[a:b],
                    truncated=turn.truncated and last,
                    penalty=turn.penalty if last else 0.0,
                    partial=not last,
                )
            )
            starts.append(start + a)
    return segments, starts


def branch_points(
    tree: RolloutTree, threshold: float, min_segment_length: int, max_points: int
) -> list[tuple[int, int]]:
    """Where to branch next in one tree: up to `max_points` (node, offset) pairs, highest entropy first.

    A candidate is token j of node i (`tree.turns[i]`, a segment) with H_ij > `threshold` and
    L ≤ j ≤ n_i − L (L = `min_segment_length`: both pieces of the split keep ≥ L tokens). Candidates are taken by
    entropy (ties: earlier node in DFS order, then earlier token), skipping any within L tokens of a point already
    taken in the same node.

    Raises:
        ValueError: a node carries no per-token entropies.
    """
    if min_segment_length < 1:
        raise ValueError(f"min_segment_length must be ≥ 1; got {min_segment_length}.")
    candidates = []
    for i, turn in enumerate(tree.turns):
        if turn.entropies is None:
            raise ValueError(
                f"Node {i} carries no per-token entropies: token-level branching needs them from generation (the "
                "engine's with_scores=True, which every tree trainer turns on for sampler='token_entropy'). A custom "
                "generation engine must return per-token entropies."
            )
        n = len(turn.action_ids)
        for j in range(min_segment_length, n - min_segment_length + 1):
            h = float(turn.entropies[j])
            if h > threshold:
                candidates.append((-h, i, j))
    candidates.sort()
    chosen: list[tuple[int, int]] = []
    taken: dict[int, list[int]] = {}
    for _, i, j in candidates:
        if len(chosen) >= max_points:
            break
        if any(abs(j - other) < min_segment_length for other in taken.get(i, [])):
            continue
        taken.setdefault(i, []).append(j)
        chosen.append((i, j))
    return chosen


class TokenEntropySampler:
    """TreeAdv's forest of M trees per prompt that branch inside completions at tokens with entropy > τ_H.

    See the module docstring for the rules. `sample` returns, per prompt, its finished branches (the M roots first,
    then the continuations in the order they were created); their `turns` are segment nodes.

    Args:
        loop: the turn loop (generation, tools, observations).
        num_trees: M, independent root trajectories per prompt.
        threshold: τ_H in nats; tokens with entropy above it are branch candidates.
        max_branches: cap on branch points (new leaves) per tree.
        min_segment_length: L, the fewest tokens a segment created by a split may have (≥ 1).
        rounds: R, rounds of branching (a continuation of round r may itself branch in round r + 1).
    """

    def __init__(
        self, loop: TurnLoop, num_trees: int, threshold: float, max_branches: int, min_segment_length: int = 1,
        rounds: int = 1,
    ):
        if num_trees < 1 or max_branches < 0 or min_segment_length < 1 or rounds < 1:
            raise ValueError(
                "Need num_initial_rollouts (trees) ≥ 1, max_branches_per_tree ≥ 0, min_segment_length ≥ 1 and "
                f"branching_rounds ≥ 1; got {num_trees}, {max_branches}, {min_segment_length}, {rounds}."
            )
        if math.isnan(threshold):
            raise ValueError("entropy_threshold must be a number (use float('inf') to turn branching off).")
        self.loop, self.num_trees, self.threshold = loop, num_trees, threshold
        self.max_branches, self.min_segment_length, self.rounds = max_branches, min_segment_length, rounds

    def sample(self, roots: list[TreeRoot]) -> SampledTrees:
        branching = self.max_branches > 0
        forests = [
            [[_start(x, root, first=m == 0, snapshots=branching)] for m in range(self.num_trees)]
            for x, root in enumerate(roots)
        ]
        cuts: list[dict[int, list[list[int]]]] = [{} for _ in roots]  # per prompt: position -> histories cut there
        added: list[list[Branch]] = [[] for _ in roots]
        used = [[0] * self.num_trees for _ in roots]
        self.loop.run([tree[0] for forest in forests for tree in forest])
        # Every rank runs the same number of loop.run calls (R rounds and the fallback), each a collective.
        for r in range(self.rounds):
            new = []
            for x, (root, forest) in enumerate(zip(roots, forests)):
                for m, tree in enumerate(forest):
                    quota = math.ceil((self.max_branches - used[x][m]) / (self.rounds - r))
                    for child in self._branch(root, tree, cuts[x], self.threshold, quota):
                        child.round = r + 1
                        tree.append(child)
                        added[x].append(child)
                        new.append(child)
                        used[x][m] += 1
            self.loop.run(new)
        self.loop.run(self._ensure_two_leaves(roots, forests, cuts, added, used))
        per_prompt = []
        for x, forest in enumerate(forests):
            branches = [tree[0] for tree in forest] + added[x]
            for branch in branches:
                branch.turns = split_turns(branch, _cuts_of(branch, cuts[x]))[0]
            per_prompt.append(branches)
        return SampledTrees(per_prompt, {BRANCH_POINTS_METRIC: [float(n) for per_tree in used for n in per_tree]})

    def _branch(self, root: TreeRoot, tree: list[Branch], cuts, threshold: float, quota: int) -> list[Branch]:
        """Choose up to `quota` branch points in one tree, record them as cuts, and return the new branches."""
        if quota <= 0:
            return []
        segmented = [split_turns(b, _cuts_of(b, cuts)) for b in tree]
        rollout = RolloutTree.from_trajectories(root.prompt_ids, [s for s, _ in segmented], [0.0] * len(tree))
        anchor: dict[int, tuple[int, int]] = {}  # node -> (a trajectory through it, the node's start in that one)
        for k, path in enumerate(rollout.paths):
            for q, node in enumerate(path):
                anchor.setdefault(node, (k, segmented[k][1][q]))
        children = []
        for node, offset in branch_points(rollout, threshold, self.min_segment_length, quota):
            k, start = anchor[node]
            position = start + offset
            cuts.setdefault(position, []).append(tree[k].prefix_ids[:position])
            children.append(tree[k].restart_inside(position))
        return children

    def _ensure_two_leaves(self, roots, forests, cuts, added, used) -> list[Branch]:
        """D1 needs K ≥ 2 leaves per prompt: a prompt left with one leaf (M = 1, nothing above τ_H) gets one branch
        at its highest-entropy eligible token, or one more trajectory from the prompt if no token is eligible."""
        extra = []
        for x, (root, forest) in enumerate(zip(roots, forests)):
            if sum(len(tree) for tree in forest) >= 2 or self.max_branches == 0:
                continue
            tree = forest[0]
            children = self._branch(root, tree, cuts[x], -math.inf, 1) or [tree[0].restart_at(0)]
            for child in children:
                child.round = self.rounds + 1
            tree.extend(children)
            added[x].extend(children)
            used[x][0] += len(children)
            extra.extend(children)
        return extra


def _cuts_of(branch: Branch, cuts: dict[int, list[list[int]]]) -> list[int]:
    """The recorded branch points that lie on this branch: positions whose history equals the branch's prefix."""
    ids = branch.prefix_ids
    return [p for p, histories in cuts.items() if p < len(ids) and any(ids[:p] == h for h in histories)]
