"""TreeOPSD and TreePO losses (docs/design.md §3 T5–T7): gradients checked by autograd against the closed form."""

import math

import pytest
import torch

from tests.trees import flatten, grad, hotpot_like_tree, perturbed
from trl_tree import credit, losses


def _setup(rho=0.25):
    tree = hotpot_like_tree()
    A = credit.standardize(torch.tensor(tree.rewards, dtype=torch.float64))
    V = credit.likelihood_backup(tree, A)
    q, tau = credit.treeopsd_teacher(V, tree.num_leaves, rho)
    turn_ids, old, _ = flatten(tree)
    tree_ids = torch.zeros(tree.num_turns, dtype=torch.long)
    return tree, V, q, tau, turn_ids, old, tree_ids


def test_first_block_gradient_is_the_tree_policy_gradient_and_equals_treepo():
    tree, V, q, tau, turn_ids, old, tree_ids = _setup()
    L_x = len(turn_ids)
    assert L_x == 16  # 15 unique turns, b has two tokens: shared turns counted once
    g_opsd = grad(lambda lp: losses.treeopsd_loss(lp, old, turn_ids, q, tau, tree_ids), old)
    g_po = grad(lambda lp: losses.treepo_loss(lp, old, turn_ids, V, tree_ids), old)
    expected = -V[turn_ids] / L_x
    assert torch.allclose(g_opsd, expected, atol=1e-12)
    assert torch.allclose(g_po, expected, atol=1e-12)


def test_gradient_matches_closed_form_tau_over_Lx_times_p_minus_q():
    tree, V, q, tau, turn_ids, old, tree_ids = _setup()
    logps = perturbed(old, seed=0, scale=0.3)
    g = grad(lambda lp: losses.treeopsd_loss(lp, old, turn_ids, q, tau, tree_ids), logps)
    s = losses.turn_mean_log_ratio(logps, old, turn_ids, tree.num_turns)
    expected = tau / len(turn_ids) * (torch.sigmoid(s) - q)[turn_ids]
    assert torch.allclose(g, expected, atol=1e-12)


def test_gradient_vanishes_at_the_teacher_and_reverses_past_it():
    tree, V, q, tau, turn_ids, old, tree_ids = _setup()
    logit_q = torch.log(q) - torch.log1p(-q)
    at_target = old + logit_q[turn_ids]  # s_i = logit(q_i): p_i = q_i
    g = grad(lambda lp: losses.treeopsd_loss(lp, old, turn_ids, q, tau, tree_ids), at_target)
    assert g.abs().max() < 1e-12
    overshoot = old + 2 * logit_q[turn_ids]
    g_over = grad(lambda lp: losses.treeopsd_loss(lp, old, turn_ids, q, tau, tree_ids), overshoot)
    g_first = grad(lambda lp: losses.treeopsd_loss(lp, old, turn_ids, q, tau, tree_ids), old)
    moving = V[turn_ids].abs() > 1e-9
    assert (torch.sign(g_over[moving]) == -torch.sign(g_first[moving])).all()
    # TreePO keeps pushing with the same coefficient
    g_po = grad(lambda lp: losses.treepo_loss(lp, old, turn_ids, V, tree_ids), overshoot)
    assert torch.allclose(g_po, g_first, atol=1e-12)


def test_all_equal_rewards_pull_a_moved_policy_back_to_the_behaviour_policy():
    tree, _, _, _, turn_ids, old, tree_ids = _setup()
    V = credit.likelihood_backup(tree, credit.standardize(torch.ones(tree.num_leaves)))
    q, tau = credit.treeopsd_teacher(V, tree.num_leaves, 0.25)
    assert torch.equal(q, torch.full_like(q, 0.5))
    loss_fn = lambda lp: losses.treeopsd_loss(lp, old, turn_ids, q, tau, tree_ids)  # noqa: E731
    assert grad(loss_fn, old).abs().max() == 0
    assert (grad(loss_fn, old + 0.5) > 0).all()  # loss grows with log π_θ: descent lowers it back


def test_kl_stays_exact_when_the_sigmoid_saturates():
    q = torch.tensor([0.3], dtype=torch.float64)
    s = torch.tensor([80.0], dtype=torch.float64, requires_grad=True)
    kl = losses.bernoulli_kl_from_logit(q, s)
    (g,) = torch.autograd.grad(kl.sum(), s)
    # KL ≈ 0.3 log 0.3 + 0.7 log 0.7 + 0.7 · 80 (log σ(−80) ≈ −80)
    assert math.isclose(kl.item(), 0.3 * math.log(0.3) + 0.7 * math.log(0.7) + 0.7 * 80, rel_tol=1e-12)
    assert math.isclose(g.item(), 1.0 - 0.3, rel_tol=1e-12)


def test_batch_loss_is_the_mean_over_trees_and_untrained_tokens_do_not_count():
    tree, V, q, tau, turn_ids, old, tree_ids = _setup()
    n = tree.num_turns
    lp = perturbed(old, seed=1, scale=0.2)
    single = losses.treeopsd_loss(lp, old, turn_ids, q, tau, tree_ids)
    # second tree: same turns shifted by n, different teacher; padding / observation tokens with id -1 interleaved
    q2 = torch.full_like(q, 0.6)
    ids2 = torch.cat([turn_ids, torch.tensor([-1, -1]), turn_ids + n])
    lp2 = torch.cat([lp, torch.tensor([5.0, -7.0], dtype=torch.float64), lp])
    old2 = torch.cat([old, torch.zeros(2, dtype=torch.float64), old])
    both = losses.treeopsd_loss(
        lp2, old2, ids2, torch.cat([q, q2]), torch.tensor([tau, tau]), torch.cat([tree_ids, tree_ids + 1])
    )
    other = losses.treeopsd_loss(lp, old, turn_ids, q2, tau, tree_ids)
    assert torch.allclose(both, (single + other) / 2)


@pytest.mark.parametrize("loss", ["treeopsd", "treepo"])
def test_losses_weight_each_token_by_one_over_Lx(loss):
    """A turn with twice the tokens gets twice the total gradient mass (each token weighs 1/L_x)."""
    tree, V, q, tau, turn_ids, old, tree_ids = _setup()
    fn = {
        "treeopsd": lambda lp: losses.treeopsd_loss(lp, old, turn_ids, q, tau, tree_ids),
        "treepo": lambda lp: losses.treepo_loss(lp, old, turn_ids, V, tree_ids),
    }[loss]
    g = grad(fn, old)
    per_turn = torch.zeros(tree.num_turns, dtype=torch.float64).index_add_(0, turn_ids, g)
    counts = losses.turn_token_counts(turn_ids, tree.num_turns)
    assert torch.allclose(per_turn, -V * counts / len(turn_ids), atol=1e-12)
