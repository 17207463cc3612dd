"""Properties of the rollout tree (docs/design.md §3 T2, §4)."""

import math

import pytest

from tests.trees import PROMPT, A, B, C, D, hotpot_like_tree
from trl_tree import RolloutTree, Turn


def test_hotpot_like_tree_counts_duplicates_in_K_and_shares_turns():
    tree = hotpot_like_tree()
    assert tree.num_leaves == 12
    assert tree.num_turns == 15 < sum(len(tree.paths[k]) for k in range(12)) == 26
    duplicate_leaf = tree.turns[tree.leaf_of[0]]
    assert tree.leaf_of[0] == tree.leaf_of[5] and duplicate_leaf.multiplicity == 2
    assert sum(t.multiplicity for t in tree.turns) == tree.num_leaves
    assert len(tree.roots) == 4  # a, d, f, k


def test_turns_are_in_dfs_order_with_consistent_parents():
    tree = hotpot_like_tree()
    for i, turn in enumerate(tree.turns):
        assert turn.parent < i
        assert turn.depth == (0 if turn.parent < 0 else tree.turns[turn.parent].depth + 1)
        assert turn.is_leaf == (not turn.children)
        for c in turn.children:
            assert tree.turns[c].parent == i
    # DFS: the subtree of each turn is one contiguous block right after it.
    for i in range(tree.num_turns):
        subtree = {i}
        for j in range(i + 1, tree.num_turns):
            if tree.turns[j].parent in subtree:
                subtree.add(j)
            else:
                break
        assert subtree == _descendants(tree, i)


def _descendants(tree, i):
    out, stack = set(), [i]
    while stack:
        n = stack.pop()
        out.add(n)
        stack.extend(tree.turns[n].children)
    return out


def test_paths_reconstruct_every_trajectory_token_for_token():
    trajectories = [[A, B, C], [A, B, C], [D], [A, D]]
    tree = RolloutTree.from_trajectories(PROMPT, trajectories, [1, 0, 1, 0])
    for k, traj in enumerate(trajectories):
        expected = PROMPT + sum((turn.action_ids + turn.observation_ids for turn in traj), [])
        assert tree.path_token_ids(k) == expected
    assert tree.num_path_tokens == sum(len(tree.path_token_ids(k)) for k in range(4))
    assert tree.num_unique_tokens < tree.num_path_tokens


def test_merging_needs_the_whole_history_observation_and_terminality():
    a_other_obs = Turn(A.action_ids, A.action_logps, observation_ids=[99])
    a_terminal = Turn(A.action_ids, A.action_logps, observation_ids=A.observation_ids)
    tree = RolloutTree.from_trajectories(PROMPT, [[A, B], [a_other_obs, B], [a_terminal]], [0, 1, 2])
    # same action but a different observation, or ending there, are different states
    assert len(tree.roots) == 3
    # the same action after different histories is a different turn
    tree = RolloutTree.from_trajectories(PROMPT, [[A, C], [D, C]], [0, 1])
    assert tree.num_turns == 4


def test_observation_tokens_are_never_action_tokens():
    tree = hotpot_like_tree()
    for turn in tree.turns:
        assert len(turn.action_ids) == len(turn.action_logps)
    a = tree.turns[tree.roots[0]]
    assert a.action_ids == [10] and a.observation_ids == [90, 91]


@pytest.mark.parametrize(
    ("trajectories", "rewards", "message"),
    [
        ([[A], []], [0, 1], "Trajectory 1 is empty"),
        ([[A], [Turn([1, 2], [-0.1])]], [0, 1], "Trajectory 1, turn 0: 2 action ids but 1 action log-probs"),
        ([[A], [Turn([], []), A]], [0, 1], "Trajectory 1, turn 0 has no action tokens but is followed by more"),
        ([[A], [B]], [0, 1, 1], "3 rewards for 2 trajectories"),
        ([[A], [B]], [0, math.nan], "Trajectory 1 has a non-finite reward"),
        ([], [], "at least one trajectory"),
    ],
)
def test_bad_input_names_the_trajectory_and_turn(trajectories, rewards, message):
    with pytest.raises(ValueError, match=message):
        RolloutTree.from_trajectories(PROMPT, trajectories, rewards)


def test_an_empty_final_action_is_a_leaf_with_nothing_to_train():
    """A backend that returned no token ends its trajectory with an empty action (rollout.samplers.TurnLoop): the
    tree keeps it as a leaf of its own, with its reward, and merges it with an identical empty leaf."""
    tree = RolloutTree.from_trajectories(PROMPT, [[A, Turn([], [])], [A, B], [A, Turn([], [])]], [0.0, 1.0, 0.0])
    assert tree.num_leaves == 3 and tree.num_turns == 3 and tree.rewards == [0.0, 1.0, 0.0]
    assert tree.paths[0] == tree.paths[2] and tree.num_unique_tokens == len(PROMPT) + 3 + len(B.action_ids) + 1
