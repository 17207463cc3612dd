"""TreeOPSD credit (docs/design.md §3 T1–T4) and the other backups, checked against the paper's properties."""

import math

import pytest
import torch

from tests.trees import deep_tree, hotpot_like_tree
from trl_tree import RolloutTree, Turn, credit


def test_standardize_uses_sample_std_without_epsilon():
    r = torch.tensor([1.0, 0.0, 0.0, 3.0])
    expected = (r - r.mean()) / r.std(correction=1)
    assert torch.allclose(credit.standardize(r), expected.double())


def test_all_equal_rewards_give_zero_advantages_not_nan():
    assert torch.equal(credit.standardize(torch.full((12,), 0.7)), torch.zeros(12, dtype=torch.float64))


@pytest.mark.parametrize("K", [2, 3, 5, 12, 40])
def test_samuelson_bound_holds_with_equality_for_a_single_dissenter(K):
    gen = torch.Generator().manual_seed(K)
    for _ in range(50):
        A = credit.standardize(torch.rand(K, generator=gen))
        assert A.abs().max() <= credit.samuelson_bound(K) + 1e-12
    dissent = torch.zeros(K)
    dissent[3 % K] = 1.0
    assert math.isclose(credit.standardize(dissent).abs().max().item(), (K - 1) / math.sqrt(K), rel_tol=1e-12)


def test_K_below_two_is_an_error():
    with pytest.raises(ValueError, match="K ≥ 2"):
        credit.standardize(torch.tensor([1.0]))
    with pytest.raises(ValueError, match="K ≥ 2"):
        credit.treeopsd_teacher(torch.zeros(1), num_leaves=1, rho=0.25)


@pytest.mark.parametrize("rho", [0.0, 0.5, -0.1, 0.7])
def test_rho_outside_open_half_interval_is_an_error(rho):
    with pytest.raises(ValueError, match="0 < ρ < 1/2"):
        credit.treeopsd_teacher(torch.zeros(4), num_leaves=4, rho=rho)


def test_hand_computed_values_of_the_4_2_tree():
    """V by hand: weights are softmax over the unique children of the summed behaviour log-likelihood."""
    tree = hotpot_like_tree()
    rewards = torch.tensor(tree.rewards, dtype=torch.float64)
    A = credit.standardize(rewards)
    # 5 of 12 rewards are 1: mean 5/12, sample variance (5·(7/12)² + 7·(5/12)²)/11
    std = math.sqrt((5 * (7 / 12) ** 2 + 7 * (5 / 12) ** 2) / 11)
    hi, lo = (7 / 12) / std, (-5 / 12) / std
    assert torch.allclose(A, torch.tensor([hi if r else lo for r in tree.rewards], dtype=torch.float64))

    V = credit.likelihood_backup(tree, A)
    by_action = {tree.turns[i].action_ids[0]: V[i].item() for i in range(tree.num_turns)}
    # b's children: c (π = .6, two occurrences, both R = 1) and l (π = .2, R = 0); multiplicity is not a weight.
    v_b = 0.75 * hi + 0.25 * lo
    # a's children: b (.6·.5 = .3), g (.1), h (.2), m (.1), n (.3) whose only child p has R = 1.
    v_a = 0.3 * v_b + 0.1 * hi + 0.2 * lo + 0.1 * lo + 0.3 * hi
    # d's children: e (.5, R=0), i (.25, R=1), j (.25, R=0).
    v_d = 0.5 * lo + 0.25 * hi + 0.25 * lo
    expected = {
        10: v_a, 11: v_b, 13: hi, 14: lo, 15: hi, 16: lo, 17: lo, 18: hi, 19: hi,
        20: v_d, 21: lo, 22: hi, 23: lo, 24: lo, 25: lo,
    }
    for token, value in expected.items():
        assert math.isclose(by_action[token], value, rel_tol=1e-12, abs_tol=1e-12), token

    q, tau = credit.treeopsd_teacher(V, tree.num_leaves, rho=0.25)
    assert math.isclose(tau, 11 / (0.25 * math.sqrt(12)))
    assert torch.allclose(q, 0.5 + V / tau)


def _random_tree(seed: int, num_leaves: int = 12) -> RolloutTree:
    """Random trajectories over a tiny alphabet so that prefixes collide and merge."""
    gen = torch.Generator().manual_seed(seed)
    trajectories = []
    for _ in range(num_leaves):
        depth = int(torch.randint(1, 5, (1,), generator=gen))
        turns = []
        for _ in range(depth):
            tok = int(torch.randint(0, 3, (1,), generator=gen))
            n = int(torch.randint(1, 4, (1,), generator=gen))
            turns.append(Turn([tok] * n, (-torch.rand(n, generator=gen) * 3).tolist(), [100 + tok]))
        trajectories.append(turns)
    rewards = torch.randint(0, 3, (num_leaves,), generator=gen).tolist()
    return RolloutTree.from_trajectories([0], trajectories, rewards)


@pytest.mark.parametrize("seed", range(8))
@pytest.mark.parametrize("rho", [0.05, 0.25, 0.49])
def test_every_teacher_lies_within_the_radius(seed, rho):
    tree = _random_tree(seed)
    V = credit.likelihood_backup(tree, credit.standardize(torch.tensor(tree.rewards, dtype=torch.float64)))
    q, _ = credit.treeopsd_teacher(V, tree.num_leaves, rho)
    assert (q >= 0.5 - rho - 1e-12).all() and (q <= 0.5 + rho + 1e-12).all()


def test_all_equal_rewards_give_q_one_half_everywhere():
    tree = _random_tree(3)
    V = credit.likelihood_backup(tree, credit.standardize(torch.ones(tree.num_leaves)))
    q, _ = credit.treeopsd_teacher(V, tree.num_leaves, 0.25)
    assert torch.equal(q, torch.full_like(q, 0.5))


def _leaf_weights(tree: RolloutTree, i: int) -> dict[int, float]:
    """The recursive backup weights of the leaves below turn i: products of the child softmaxes on each path."""
    turn = tree.turns[i]
    if turn.is_leaf:
        return {i: 1.0}
    z = torch.tensor([tree.turns[c].action_logp_sum for c in turn.children], dtype=torch.float64)
    out: dict[int, float] = {}
    for w, c in zip(torch.softmax(z, 0).tolist(), turn.children):
        for leaf, wl in _leaf_weights(tree, c).items():
            out[leaf] = out.get(leaf, 0.0) + w * wl
    return out


@pytest.mark.parametrize("tree_fn", [hotpot_like_tree, deep_tree, lambda: _random_tree(11)])
def test_theorem_1_map_then_backup_equals_backup_then_map(tree_fn):
    tree = tree_fn()
    A = credit.standardize(torch.tensor(tree.rewards, dtype=torch.float64))
    V = credit.likelihood_backup(tree, A)
    q, tau = credit.treeopsd_teacher(V, tree.num_leaves, 0.25)
    leaf_q = 0.5 + credit.leaf_values(tree, A) / tau  # map each leaf first ...
    q_backed = credit.softmax_backup(tree, leaf_q, credit.action_logp_sums(tree))  # ... then back up
    assert torch.allclose(q_backed, q, atol=1e-12)


@pytest.mark.parametrize("tree_fn", [hotpot_like_tree, deep_tree])
def test_theorem_1_parent_kl_gradient_equals_weighted_descendant_gradients(tree_fn):
    """d/ds KL(Ber(q_i) ‖ Ber(σ(s))) = Σ_k W_ik d/ds KL(Ber(q_k) ‖ Ber(σ(s))) for the leaves k below i."""
    from trl_tree.core.losses import bernoulli_kl_from_logit

    tree = tree_fn()
    A = credit.standardize(torch.tensor(tree.rewards, dtype=torch.float64))
    V = credit.likelihood_backup(tree, A)
    q, _ = credit.treeopsd_teacher(V, tree.num_leaves, 0.25)
    for i in range(tree.num_turns):
        for s0 in (-1.3, 0.0, 0.4):
            s = torch.tensor(s0, dtype=torch.float64, requires_grad=True)
            (parent_grad,) = torch.autograd.grad(bernoulli_kl_from_logit(q[i], s), s)
            weighted = sum(
                w * torch.autograd.grad(bernoulli_kl_from_logit(q[k], s), s)[0]
                for k, w in _leaf_weights(tree, i).items()
            )
            assert math.isclose(parent_grad.item(), float(weighted), abs_tol=1e-12)


def test_child_mean_and_leaf_mean_differ_on_an_unbalanced_tree():
    """Root x has a leaf child (R=1) and an internal child with three leaves (R=0,0,0)."""
    x, y, z = Turn([1], [-1.0], [9]), Turn([2], [-1.0]), Turn([3], [-1.0], [9])
    leaves = [Turn([4], [-1.0]), Turn([5], [-1.0]), Turn([6], [-1.0])]
    tree = RolloutTree.from_trajectories([0], [[x, y]] + [[x, z, leaf] for leaf in leaves], [1, 0, 0, 0])
    A = torch.tensor([3.0, -1.0, -1.0, -1.0], dtype=torch.float64)
    root = tree.roots[0]
    assert math.isclose(credit.child_mean_backup(tree, A)[root].item(), (3.0 + -1.0) / 2)
    assert math.isclose(credit.leaf_mean_backup(tree, A)[root].item(), 0.0)


def test_child_mean_counts_a_merged_leaf_by_its_multiplicity():
    x, y, z = Turn([1], [-1.0], [9]), Turn([2], [-1.0]), Turn([3], [-1.0])
    tree = RolloutTree.from_trajectories([0], [[x, y], [x, y], [x, z]], [1, 1, 0])
    A = torch.tensor([1.0, 1.0, -2.0], dtype=torch.float64)
    assert math.isclose(credit.child_mean_backup(tree, A)[tree.roots[0]].item(), 0.0)


def test_entropy_softmax_backup_weights_children_by_entropy():
    x, y, z = Turn([1], [-1.0], [9]), Turn([2], [-1.0]), Turn([3], [-1.0])
    tree = RolloutTree.from_trajectories([0], [[x, y], [x, z]], [1, 0])
    A = torch.tensor([1.0, -1.0], dtype=torch.float64)
    entropies = torch.zeros(tree.num_turns, dtype=torch.float64)
    y_idx, z_idx = tree.leaf_of
    entropies[y_idx], entropies[z_idx] = math.log(3.0), 0.0  # weights 3/4 and 1/4
    V = credit.entropy_softmax_backup(tree, A, entropies)
    assert math.isclose(V[tree.roots[0]].item(), 0.75 - 0.25)


def test_entropy_softmax_counts_a_merged_leaf_by_its_multiplicity_like_child_mean():
    """Two identical trajectories merge into one leaf of multiplicity 2; child-softmax must give it the weight of two
    sibling leaves of its entropy (the unmerged tree), as child-mean does: logits H + log m."""
    x, y, z = Turn([1], [-1.0], [9]), Turn([2], [-1.0]), Turn([3], [-1.0])
    tree = RolloutTree.from_trajectories([0], [[x, y], [x, y], [x, z]], [1, 1, 0])
    A = torch.tensor([1.0, 1.0, -2.0], dtype=torch.float64)
    y_idx, _, z_idx = tree.leaf_of
    root = tree.roots[0]
    equal = torch.full((tree.num_turns,), 0.7, dtype=torch.float64)
    assert torch.allclose(credit.entropy_softmax_backup(tree, A, equal), credit.child_mean_backup(tree, A))
    entropies = torch.zeros(tree.num_turns, dtype=torch.float64)
    entropies[y_idx], entropies[z_idx] = math.log(3.0), 0.0
    # unmerged: children y, y (e^H = 3 each, value 1) and z (e^H = 1, value −2) → (3 + 3 − 2) / 7
    V = credit.entropy_softmax_backup(tree, A, entropies)
    assert math.isclose(V[root].item(), (3 * 1.0 + 3 * 1.0 + 1 * -2.0) / 7)


def test_group_normalize_divisor_is_one_when_scores_are_equal():
    assert torch.equal(credit.group_normalize(torch.full((4,), 2.0)), torch.zeros(4, dtype=torch.float64))
    s = torch.tensor([0.0, 1.0, 2.0])
    assert torch.allclose(credit.group_normalize(s), (s - 1.0).double() / 1.0)
