"""TreeAdv (docs/design.md §3 D1–D4): segment advantages, per-token broadcast, and the GRPO / GSPO-token surrogates."""

import math

import pytest
import torch

from tests.trees import deep_tree, flat_gspo_token, flatten, grad, hotpot_like_tree, perturbed
from trl_tree import RolloutTree, Turn, credit, losses


def _chains(rewards, seed=0):
    """No branching: every trajectory is its own root-to-leaf chain (distinct first turns), as in flat GRPO."""
    gen = torch.Generator().manual_seed(seed)
    trajectories = []
    for k in range(len(rewards)):
        depth = 1 + k % 3
        turns = []
        for d in range(depth):
            n = 1 + (k + d) % 3
            turns.append(Turn([100 * k + d] * n, (-torch.rand(n, generator=gen) - 0.1).tolist(), [7] if d else []))
        trajectories.append(turns)
    return RolloutTree.from_trajectories([0], trajectories, rewards)


def _setup(tree_fn, seed, scale):
    tree = tree_fn()
    turn_ids, old, spans = flatten(tree)
    A = credit.segment_advantages(tree, credit.standardize(torch.tensor(tree.rewards, dtype=torch.float64)))
    return tree, turn_ids, old, spans, perturbed(old, seed, scale), A


# ---------------------------------------------------------------------------------------------------------------
# D1–D3
# ---------------------------------------------------------------------------------------------------------------


def test_without_branching_segment_advantages_are_grpos_standardised_rewards_per_token():
    rewards = [1.0, 0.0, 0.5, 0.0, 1.0, 0.25]
    tree = _chains(rewards)
    assert tree.num_turns == sum(1 + k % 3 for k in range(len(rewards)))  # nothing merged
    A = credit.standardize(torch.tensor(rewards, dtype=torch.float64))  # D1: sample std, as GRPO
    turn_ids, _, _ = flatten(tree)
    per_token = credit.token_advantages(credit.segment_advantages(tree, A), turn_ids)
    trajectory_of_turn = torch.empty(tree.num_turns, dtype=torch.long)
    for k, path in enumerate(tree.paths):
        trajectory_of_turn[path] = k
    assert torch.allclose(per_token, A[trajectory_of_turn[turn_ids]], atol=1e-12)


def test_segment_advantage_is_the_mean_over_leaf_occurrences_below_it():
    """Prompt → x → {y (reached twice), z → {u, v}}: occurrences below x are y, y, u, v."""
    x, y, z = Turn([1], [-1.0], [9]), Turn([2], [-1.0]), Turn([3], [-1.0], [9])
    u, v = Turn([4], [-1.0]), Turn([5], [-1.0])
    tree = RolloutTree.from_trajectories([0], [[x, y], [x, y], [x, z, u], [x, z, v]], [1, 1, 0, 1])
    A = torch.tensor([2.0, 2.0, -3.0, 1.0], dtype=torch.float64)
    seg = credit.segment_advantages(tree, A)
    by_token = {tree.turns[i].action_ids[0]: seg[i].item() for i in range(tree.num_turns)}
    assert by_token == pytest.approx({1: (2 + 2 - 3 + 1) / 4, 2: 2.0, 3: -1.0, 4: -3.0, 5: 1.0})


def test_each_token_takes_its_segments_advantage_and_untrained_tokens_get_zero():
    seg = torch.tensor([0.5, -1.0, 2.0], dtype=torch.float64)
    turn_ids = torch.tensor([-1, 0, 0, -1, 2, 1, 1, 1])
    expected = torch.tensor([0.0, 0.5, 0.5, 0.0, 2.0, -1.0, -1.0, -1.0], dtype=torch.float64)
    assert torch.equal(credit.token_advantages(seg, turn_ids), expected)


# ---------------------------------------------------------------------------------------------------------------
# D4: the surrogates against brute force over the K flat sequences
# ---------------------------------------------------------------------------------------------------------------


def _flat_grpo(tree, lp, old, spans, A, eps_lo, eps_hi):
    """Flat GRPO over the K sequences: each token's ratio and its segment's advantage, seq-mean-token-mean."""
    per_path = []
    for path in tree.paths:
        idx = [j for i in path for j in spans[i]]
        adv = torch.cat([A[i].expand(len(spans[i])) for i in path])
        ratio = (lp[idx] - old[idx]).exp()
        per_path.append(torch.minimum(ratio * adv, ratio.clamp(1 - eps_lo, 1 + eps_hi) * adv).mean())
    return -torch.stack(per_path).mean()


@pytest.mark.parametrize("tree_fn", [hotpot_like_tree, deep_tree])
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_grpo_surrogate_with_path_weights_equals_flat_grpo_over_the_k_sequences(tree_fn, seed):
    tree, turn_ids, old, spans, logps, A = _setup(tree_fn, seed, scale=0.3)
    w, tree_ids = credit.path_token_weights(tree), torch.zeros(tree.num_turns, dtype=torch.long)

    def ours(lp):
        return losses.clipped_token_loss(lp, old, turn_ids, A, w, tree_ids, epsilon_low=0.2, epsilon_high=0.28)

    def flat(lp):
        return _flat_grpo(tree, lp, old, spans, A, 0.2, 0.28)

    assert torch.allclose(ours(logps), flat(logps), atol=1e-12)
    assert torch.allclose(grad(ours, logps), grad(flat, logps), atol=1e-12)


@pytest.mark.parametrize("tree_fn", [hotpot_like_tree, deep_tree])
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_gspo_token_on_unique_tokens_equals_gspo_token_over_the_k_sequences(tree_fn, seed):
    """A shared token sees every path's own sequence ratio; clips are a mix of active and inactive here."""
    tree, turn_ids, old, spans, logps, A = _setup(tree_fn, seed, scale=0.1)
    pairs = credit.path_turn_pairs(tree)
    eps = (0.02, 0.03)

    def ours(lp):
        return losses.gspo_token_loss(lp, old, turn_ids, A, *pairs, epsilon_low=eps[0], epsilon_high=eps[1])

    def flat(lp):
        return flat_gspo_token(tree, [lp[s] for s in spans], [old[s] for s in spans], A, *eps)

    path_tokens = [[j for i in p for j in spans[i]] for p in tree.paths]
    s = [(logps[idx] - old[idx]).mean().exp() for idx in path_tokens]
    inside = [1 - eps[0] < x.item() < 1 + eps[1] for x in s]
    assert any(inside) and not all(inside)  # the check covers both clipped and unclipped paths
    assert torch.allclose(ours(logps), flat(logps), atol=1e-12)
    assert torch.allclose(grad(ours, logps), grad(flat, logps), atol=1e-12)


def test_gspo_token_with_one_advantage_per_sequence_is_gspo():
    """GSPO §4.3: with A_{i,t} = A_i, GSPO-token equals sequence-level GSPO in value and gradient."""
    rewards = [1.0, 0.0, 0.5, 0.0, 1.0]
    tree = _chains(rewards, seed=3)
    turn_ids, old, spans = flatten(tree)
    A = credit.segment_advantages(tree, credit.standardize(torch.tensor(rewards, dtype=torch.float64)))
    logps = perturbed(old, seed=4, scale=0.2)
    pairs = credit.path_turn_pairs(tree)

    def gspo(lp):
        out = []
        for path in tree.paths:
            idx = [j for i in path for j in spans[i]]
            s = (lp[idx] - old[idx]).mean().exp()
            out.append(torch.minimum(s * A[path[0]], s.clamp(1 - 0.1, 1 + 0.1) * A[path[0]]))
        return -torch.stack(out).mean()

    def ours(lp):
        return losses.gspo_token_loss(lp, old, turn_ids, A, *pairs, epsilon_low=0.1, epsilon_high=0.1)

    assert torch.allclose(ours(logps), gspo(logps), atol=1e-12)
    assert torch.allclose(grad(ours, logps), grad(gspo, logps), atol=1e-12)


@pytest.mark.parametrize("tree_fn", [hotpot_like_tree, deep_tree])
def test_gspo_token_and_grpo_gradients_agree_at_the_behaviour_policy(tree_fn):
    tree, turn_ids, old, _, _, A = _setup(tree_fn, 0, scale=0.0)
    w, tree_ids = credit.path_token_weights(tree), torch.zeros(tree.num_turns, dtype=torch.long)
    g_gspo = grad(lambda lp: losses.gspo_token_loss(lp, old, turn_ids, A, *credit.path_turn_pairs(tree)), old)
    g_grpo = grad(lambda lp: losses.clipped_token_loss(lp, old, turn_ids, A, w, tree_ids), old)
    assert torch.allclose(g_gspo, g_grpo, atol=1e-12)
    assert torch.allclose(g_grpo, -(w * A)[turn_ids], atol=1e-12)


def test_gspo_token_batch_is_the_mean_over_trees_with_global_ids():
    t1, ids1, old1, _, lp1, A1 = _setup(hotpot_like_tree, 0, scale=0.1)
    t2, ids2, old2, _, lp2, A2 = _setup(deep_tree, 1, scale=0.1)
    one = losses.gspo_token_loss(lp1, old1, ids1, A1, *credit.path_turn_pairs(t1), epsilon_low=0.02, epsilon_high=0.02)
    two = losses.gspo_token_loss(lp2, old2, ids2, A2, *credit.path_turn_pairs(t2), epsilon_low=0.02, epsilon_high=0.02)
    pair_paths, pair_turns, path_trees = credit.path_turn_pairs([t1, t2])
    assert pair_paths.max() + 1 == t1.num_leaves + t2.num_leaves
    assert pair_turns.max() + 1 == t1.num_turns + t2.num_turns
    both = losses.gspo_token_loss(
        torch.cat([lp1, torch.tensor([9.0], dtype=torch.float64), lp2]),
        torch.cat([old1, torch.zeros(1, dtype=torch.float64), old2]),
        torch.cat([ids1, torch.tensor([-1]), ids2 + t1.num_turns]),
        torch.cat([A1, A2]),
        pair_paths,
        pair_turns,
        path_trees,
        epsilon_low=0.02,
        epsilon_high=0.02,
    )
    assert math.isclose(both.item(), (one.item() + two.item()) / 2, rel_tol=1e-12)
