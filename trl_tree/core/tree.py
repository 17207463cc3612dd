"""The rollout tree: trajectories of a prompt merged by shared history (docs/design.md §3 T2, §4).

A trajectory is a list of `Turn`s: the tokens the policy generated (`action_ids`, trained) followed by the tokens the
environment answered (`observation_ids`, context only). Two trajectories share a turn node iff their whole histories
up to and including that turn are equal: the prompt, every earlier action and observation, the action itself, its
observation and whether it ended the trajectory (or, for a TreeAdv segment, stopped inside the assistant turn:
`Turn.partial`). Equal histories are the same state of the world, so training them twice would only double-count
them; the tree stores each unique turn once and remembers how many trajectories ended in it (`multiplicity`), which
is what the reward statistics need.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field


@dataclass
class Turn:
    """One assistant turn of a trajectory.

    Args:
        action_ids: tokens the policy generated in this turn (trained).
        action_logps: log π_old of each action token under the policy that generated it (same length).
        observation_ids: tokens appended after the action by the environment (tool response and the next turn's
            header). Context only: never trained.
        entropies: optional per-token entropies of the action (AT2PO's expansion and TreeAdv's branching use them).
        truncated: the turn was cut by a length budget (it can be excluded from training, like TRL's
            `mask_truncated_completions`).
        penalty: a process penalty Q ≤ 0 for this turn (TreeFlex, e.g. a malformed tool call).
        partial: the action stops inside an assistant turn: this is a *segment* and the trajectory's next `Turn`
            continues the same assistant turn (TreeAdv's token-level branch points). A partial turn has no
            observation and is never a trajectory's last turn.
        observation_dropped: the turn called tools whose answer did not fit what was left of the trajectory's token
            budget, so the trajectory ended without it (as TRL drops an overlong tool result): the model never saw
            the answer to its call. Counted in `tools/dropped_observations`.
    """

    action_ids: list[int]
    action_logps: list[float]
    observation_ids: list[int] = field(default_factory=list)
    entropies: list[float] | None = None
    truncated: bool = False
    penalty: float = 0.0
    partial: bool = False
    observation_dropped: bool = False


@dataclass
class TreeTurn:
    """A unique turn node of a `RolloutTree`.

    `parent` indexes `RolloutTree.turns` (-1 for a first turn, whose parent is the prompt). `multiplicity` counts the
    trajectories that end in this turn (0 for a non-terminal turn); `children` lists the unique child turns in the
    order they first appeared.
    """

    action_ids: list[int]
    action_logps: list[float]
    observation_ids: list[int]
    parent: int
    depth: int
    is_leaf: bool
    multiplicity: int = 0
    children: list[int] = field(default_factory=list)
    entropies: list[float] | None = None
    truncated: bool = False
    penalty: float = 0.0
    partial: bool = False  # a segment that ends inside an assistant turn (its children continue the turn)

    @property
    def num_action_tokens(self) -> int:
        return len(self.action_ids)

    @property
    def action_logp_sum(self) -> float:
        """log π_old(a | h) of the whole action span: the child logit of the likelihood-weighted backup (T3)."""
        return float(sum(self.action_logps))


class RolloutTree:
    """Trajectories of one prompt merged into a tree of unique turns, in DFS order.

    Attributes:
        prompt_ids: the rendered prompt tokens (the root's context).
        turns: unique turns in DFS order (a parent always precedes its children; children in order of appearance).
        leaf_of: for each trajectory k, the index of its terminal turn.
        paths: for each trajectory k, the turn indices from its first turn to its terminal turn.
        rewards: the K terminal rewards, one per trajectory (duplicates included).
    """

    def __init__(self, prompt_ids: list[int], turns: list[TreeTurn], paths: list[list[int]], rewards: list[float]):
        self.prompt_ids = list(prompt_ids)
        self.turns = turns
        self.paths = paths
        self.leaf_of = [path[-1] for path in paths]
        self.rewards = list(rewards)

    @property
    def num_leaves(self) -> int:
        """K: the number of terminal trajectories, duplicates counted."""
        return len(self.paths)

    @property
    def num_turns(self) -> int:
        """The number of unique turns."""
        return len(self.turns)

    @property
    def roots(self) -> list[int]:
        """The unique first turns (children of the prompt)."""
        return [i for i, turn in enumerate(self.turns) if turn.parent == -1]

    @property
    def num_unique_tokens(self) -> int:
        """Tokens of the prompt plus every unique turn's action and observation: what one packed forward costs."""
        return len(self.prompt_ids) + sum(len(t.action_ids) + len(t.observation_ids) for t in self.turns)

    @property
    def num_path_tokens(self) -> int:
        """Tokens a flat, one-sequence-per-trajectory forward would cost (shared prefixes repeated)."""
        per_turn = [len(t.action_ids) + len(t.observation_ids) for t in self.turns]
        return sum(len(self.prompt_ids) + sum(per_turn[i] for i in path) for path in self.paths)

    def children_of(self, index: int) -> list[int]:
        return self.turns[index].children

    @classmethod
    def from_trajectories(
        cls, prompt_ids: list[int], trajectories: list[list[Turn]], rewards: list[float]
    ) -> RolloutTree:
        """Merge K trajectories of one prompt into a tree of unique turns (T2).

        Args:
            prompt_ids: the prompt's token ids, shared by every trajectory.
            trajectories: K lists of `Turn`; the last turn of each is terminal.
            rewards: K terminal rewards, in the same order.

        Raises:
            ValueError: naming the trajectory (and turn) for an empty trajectory, a turn without action tokens,
                action ids and log-probs of different lengths, a reward count that differs from the trajectory
                count, or a non-finite reward.
        """
        _validate(trajectories, rewards)
        turns: list[TreeTurn] = []
        index_of: dict[tuple, int] = {}
        paths: list[list[int]] = []
        for trajectory in trajectories:
            parent, path = -1, []
            for t, turn in enumerate(trajectory):
                is_leaf = t == len(trajectory) - 1
                key = (parent, tuple(turn.action_ids), tuple(turn.observation_ids), is_leaf, turn.partial)
                node = index_of.get(key)
                if node is None:
                    node = len(turns)
                    index_of[key] = node
                    turns.append(
                        TreeTurn(
                            action_ids=list(turn.action_ids),
                            action_logps=[float(x) for x in turn.action_logps],
                            observation_ids=list(turn.observation_ids),
                            parent=parent,
                            depth=t,
                            is_leaf=is_leaf,
                            entropies=None if turn.entropies is None else list(turn.entropies),
                            truncated=turn.truncated,
                            penalty=float(turn.penalty),
                            partial=turn.partial,
                        )
                    )
                    if parent >= 0:
                        turns[parent].children.append(node)
                if is_leaf:
                    turns[node].multiplicity += 1
                path.append(node)
                parent = node
            paths.append(path)
        return cls._in_dfs_order(prompt_ids, turns, paths, rewards)

    @classmethod
    def _in_dfs_order(cls, prompt_ids, turns, paths, rewards) -> RolloutTree:
        """Renumber turns so that they appear in depth-first order (children in order of first appearance)."""
        order: list[int] = []
        stack = [i for i, turn in enumerate(turns) if turn.parent == -1][::-1]
        while stack:
            node = stack.pop()
            order.append(node)
            stack.extend(reversed(turns[node].children))
        new_index = {old: new for new, old in enumerate(order)}
        renumbered = []
        for old in order:
            turn = turns[old]
            turn.parent = new_index[turn.parent] if turn.parent >= 0 else -1
            turn.children = [new_index[c] for c in turn.children]
            renumbered.append(turn)
        new_paths = [[new_index[i] for i in path] for path in paths]
        return cls(prompt_ids, renumbered, new_paths, rewards)

    def path_token_ids(self, k: int) -> list[int]:
        """The full token sequence of trajectory k: prompt, then each turn's action and observation."""
        ids = list(self.prompt_ids)
        for i in self.paths[k]:
            ids += self.turns[i].action_ids + self.turns[i].observation_ids
        return ids

    def __repr__(self) -> str:
        return f"RolloutTree(num_leaves={self.num_leaves}, num_turns={self.num_turns})"


def _validate(trajectories: list[list[Turn]], rewards: list[float]) -> None:
    if len(rewards) != len(trajectories):
        raise ValueError(
            f"Got {len(rewards)} rewards for {len(trajectories)} trajectories: pass exactly one terminal reward per "
            "trajectory, in the same order."
        )
    if not trajectories:
        raise ValueError("A rollout tree needs at least one trajectory; got none.")
    for k, (trajectory, reward) in enumerate(zip(trajectories, rewards)):
        if len(trajectory) == 0:
            raise ValueError(f"Trajectory {k} is empty: every trajectory needs at least one turn.")
        reward = float(reward)
        if not math.isfinite(reward):
            raise ValueError(
                f"Trajectory {k} has a non-finite reward ({reward}): check the reward function for this sample."
            )
        for t, turn in enumerate(trajectory):
            # an empty action (a backend that returned no token) is a final turn with nothing to train, and only that
            if len(turn.action_ids) == 0 and (turn.observation_ids or t < len(trajectory) - 1):
                raise ValueError(
                    f"Trajectory {k}, turn {t} has no action tokens but is followed by more of the trajectory: only a "
                    "trajectory's final turn may be an empty action (it ends the trajectory)."
                )
            if len(turn.action_ids) != len(turn.action_logps):
                raise ValueError(
                    f"Trajectory {k}, turn {t}: {len(turn.action_ids)} action ids but {len(turn.action_logps)} "
                    "action log-probs; they must align one to one."
                )
            if turn.entropies is not None and len(turn.entropies) != len(turn.action_ids):
                raise ValueError(
                    f"Trajectory {k}, turn {t}: {len(turn.action_ids)} action ids but {len(turn.entropies)} "
                    "entropies; they must align one to one."
                )
            if turn.partial and (turn.observation_ids or t == len(trajectory) - 1):
                raise ValueError(
                    f"Trajectory {k}, turn {t} is partial (it stops inside an assistant turn), so it can have no "
                    "observation and must be followed by the segment that continues the turn."
                )


def render_tree(tree: RolloutTree, tokenizer, values=None, width: int = 80) -> str:
    """The tree as indented text: one line per unique turn (its action, the observation's start, ×multiplicity),
    then the K rewards (`values`: a value per unique turn to show, e.g. V_i). Used by the trainers' `log_completions`."""
    lines = [f"prompt ({len(tree.prompt_ids)} tokens)  K={tree.num_leaves}  unique turns={tree.num_turns}"]
    for i, turn in enumerate(tree.turns):
        action = tokenizer.decode(turn.action_ids, skip_special_tokens=False).replace("\n", " ")
        if len(action) > width:
            action = action[: width - 1] + "…"
        extra = f" ×{turn.multiplicity}" if turn.multiplicity > 1 else ""
        value = f" V={values[i]:+.3f}" if values is not None else ""
        lines.append(f"{'  ' * (turn.depth + 1)}[{i}] {action}{extra}{value}")
    lines.append("rewards: " + " ".join(f"{r:g}" for r in tree.rewards))
    return "\n".join(lines)
