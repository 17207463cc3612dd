"""Issue 40's ablation: TreeOPSD's pull on zero-credit turns (V_i = 0, teacher q_i = 1/2), on its own.

`losses.zero_credit_anchor` is the part of T5 those turns contribute; TreeOPSD with `keep = V ≠ 0` is TreeOPSD without
it, TreePO plus it is TreePO with it. The properties: left-out turns get no gradient and the others TreeOPSD's; the
anchor's descent direction is τ(1/2 − p_i)/L_x on zero-credit turns and nothing elsewhere; at θ_old the anchor has no
gradient (the four losses take the same first block); the config field selects the variants and defaults to each
loss's own behaviour.
"""

import pytest
import torch

from tests.trees import flatten, grad, hotpot_like_tree, perturbed
from trl_tree import credit, losses, methods

ZEROED = [0, 3, 5, 9]  # turns given zero credit (as every turn of a tree without a reward spread has)


def _setup(rho=0.25):
    tree = hotpot_like_tree()
    A = credit.standardize(torch.tensor(tree.rewards, dtype=torch.float64))
    V = credit.likelihood_backup(tree, A).clone()
    V[ZEROED] = 0.0
    q, tau = credit.treeopsd_teacher(V, tree.num_leaves, rho)
    turn_ids, old, _ = flatten(tree)
    tree_ids = torch.zeros(tree.num_turns, dtype=torch.long)
    return tree, V, q, tau, turn_ids, old, tree_ids


def _zero_tokens(V, turn_ids):
    return losses.zero_credit_turns(V)[turn_ids]


def test_zero_credit_turns_are_those_with_v_exactly_zero():
    _, V, q, *_ = _setup()
    zero = losses.zero_credit_turns(V)
    assert zero.nonzero().flatten().tolist() == ZEROED
    assert torch.all(q[zero] == 0.5) and torch.all(q[~zero] != 0.5)


def test_left_out_turns_get_no_gradient_and_the_others_treeopsds():
    tree, V, q, tau, turn_ids, old, tree_ids = _setup()
    logps = perturbed(old, seed=1, scale=0.3)
    keep = ~losses.zero_credit_turns(V)
    g_full = grad(lambda lp: losses.treeopsd_loss(lp, old, turn_ids, q, tau, tree_ids), logps)
    g_kept = grad(lambda lp: losses.treeopsd_loss(lp, old, turn_ids, q, tau, tree_ids, keep=keep), logps)
    zero = _zero_tokens(V, turn_ids)
    assert torch.all(g_kept[zero] == 0)
    assert torch.all(g_full[zero] != 0)  # TreeOPSD itself pulls them (p ≠ 1/2 away from θ_old)
    assert torch.allclose(g_kept[~zero], g_full[~zero], atol=1e-12)  # L_x still counts every turn


def test_the_anchors_descent_direction_is_tau_times_half_minus_p_on_zero_credit_turns_only():
    tree, V, q, tau, turn_ids, old, tree_ids = _setup()
    logps = perturbed(old, seed=2, scale=0.3)
    g = grad(lambda lp: losses.zero_credit_anchor(lp, old, turn_ids, V, tau, tree_ids), logps)
    p = torch.sigmoid(losses.turn_mean_log_ratio(logps, old, turn_ids, tree.num_turns))
    L_x = len(turn_ids)
    zero = _zero_tokens(V, turn_ids)
    assert torch.allclose(-g[zero], (tau / L_x * (0.5 - p))[turn_ids][zero], atol=1e-12)
    assert torch.all(g[~zero] == 0)


def test_treeopsd_is_its_ablation_plus_the_anchor():
    tree, V, q, tau, turn_ids, old, tree_ids = _setup()
    logps = perturbed(old, seed=3, scale=0.3)
    keep = ~losses.zero_credit_turns(V)
    full = losses.treeopsd_loss(logps, old, turn_ids, q, tau, tree_ids)
    parts = (losses.treeopsd_loss(logps, old, turn_ids, q, tau, tree_ids, keep=keep)
             + losses.zero_credit_anchor(logps, old, turn_ids, V, tau, tree_ids))
    assert float(full) == pytest.approx(float(parts), abs=1e-12)
    assert torch.equal(losses.treeopsd_loss(logps, old, turn_ids, q, tau, tree_ids),
                       losses.treeopsd_loss(logps, old, turn_ids, q, tau, tree_ids, keep=None))


def test_at_theta_old_all_four_variants_take_the_same_first_block():
    tree, V, q, tau, turn_ids, old, tree_ids = _setup()
    keep = ~losses.zero_credit_turns(V)
    expected = -V[turn_ids] / len(turn_ids)
    for loss in (lambda lp: losses.treeopsd_loss(lp, old, turn_ids, q, tau, tree_ids),
                 lambda lp: losses.treeopsd_loss(lp, old, turn_ids, q, tau, tree_ids, keep=keep),
                 lambda lp: losses.treepo_loss(lp, old, turn_ids, V, tree_ids),
                 lambda lp: losses.treepo_loss(lp, old, turn_ids, V, tree_ids)
                 + losses.zero_credit_anchor(lp, old, turn_ids, V, tau, tree_ids)):
        assert torch.allclose(grad(loss, old.clone()), expected, atol=1e-12)


def test_the_config_field_defaults_to_each_losss_own_behaviour_and_selects_the_ablation(tmp_path):
    from trl_tree import TreeOPSDConfig, TreePOConfig

    cpu = dict(output_dir=str(tmp_path), use_cpu=True, bf16=False)
    assert methods.zero_credit_anchor(TreeOPSDConfig(**cpu), "treeopsd") is True
    assert methods.zero_credit_anchor(TreePOConfig(**cpu), "treepo") is False
    assert methods.zero_credit_anchor(TreeOPSDConfig(**cpu, zero_credit_anchor=False), "treeopsd") is False
    assert methods.zero_credit_anchor(TreePOConfig(**cpu, zero_credit_anchor=True), "treepo") is True
    assert "zero_credit_anchor" in methods.LOSSES["treeopsd"].fields
    assert "zero_credit_anchor" in methods.LOSSES["treepo"].fields
    with pytest.raises(ValueError, match="target_radius"):
        TreePOConfig(**cpu, zero_credit_anchor=True, target_radius=0.6)


def test_treepo_with_the_anchor_prepares_treeopsds_teacher_and_without_it_a_only():
    tree = hotpot_like_tree()
    A = credit.standardize(torch.tensor(tree.rewards, dtype=torch.float64))
    V = credit.likelihood_backup(tree, A)
    plain = methods.LOSSES["treepo"].prepare(tree, V, _Args(False))
    anchored = methods.LOSSES["treepo"].prepare(tree, V, _Args(True))
    assert type(plain) is methods.TurnCredit
    assert isinstance(anchored, methods.TeacherCredit)
    q, tau = credit.treeopsd_teacher(V, tree.num_leaves, 0.25)
    assert torch.equal(anchored.q, q) and float(anchored.tau) == pytest.approx(tau)


class _Args:
    def __init__(self, anchor):
        self.zero_credit_anchor, self.target_radius, self.reward_std = anchor, 0.25, "sample"
