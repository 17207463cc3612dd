"""TreeFlex (docs/design.md §3 F1–F4): search-level advantages, turn penalties, dual clip and loss aggregation."""

import math

import pytest
import torch

from trl_tree import credit, losses

# ---------------------------------------------------------------------------------------------------------------
# F1–F2 advantages
# ---------------------------------------------------------------------------------------------------------------

# A group of K = 3 searches: search 0 has turns 0–2, search 1 turns 3–4, search 2 turns 5–7.
REWARDS = torch.tensor([1.0, 0.0, 1.0], dtype=torch.float64)
SEARCH_OF_TURN = torch.tensor([0, 0, 0, 1, 1, 2, 2, 2])


@pytest.mark.parametrize("mode", ["pre_norm", "post_norm"])
def test_without_penalties_every_turn_of_a_search_has_the_searchs_group_advantage(mode):
    A = credit.process_advantages(REWARDS, torch.zeros(8), SEARCH_OF_TURN, mode=mode)
    assert torch.allclose(A, credit.group_normalize(REWARDS)[SEARCH_OF_TURN])


@pytest.mark.parametrize("mode", ["pre_norm", "post_norm"])
def test_a_penalty_moves_only_its_own_turn_and_never_the_baseline(mode):
    Q = torch.tensor([0.0, -1.0, 0.0, 0.0, -0.2, 0.0, 0.0, -1.0], dtype=torch.float64)
    clean = credit.process_advantages(REWARDS, torch.zeros(8), SEARCH_OF_TURN, mode=mode)
    penalised = credit.process_advantages(REWARDS, Q, SEARCH_OF_TURN, mode=mode)
    untouched = Q == 0
    assert torch.equal(penalised[untouched], clean[untouched])  # other turns of the same search included
    mean, divisor = credit.group_baseline(REWARDS)  # from terminal scores only
    assert math.isclose(mean.item(), 2 / 3) and math.isclose(divisor.item(), REWARDS.std(correction=1).item())
    shift = Q / divisor if mode == "pre_norm" else Q
    assert torch.allclose(penalised - clean, shift)


@pytest.mark.parametrize("mode", ["pre_norm", "post_norm"])
def test_divisor_is_one_when_scores_are_equal_so_penalties_keep_their_scale(mode):
    Q = torch.tensor([0.0, -1.0, 0.0, 0.0, -0.2, 0.0, 0.0, 0.0], dtype=torch.float64)
    A = credit.process_advantages(torch.full((3,), 1.0), Q, SEARCH_OF_TURN, mode=mode)
    assert torch.allclose(A, Q, rtol=0, atol=1e-15)  # (1 + Q − 1)/1 up to rounding
    assert credit.group_baseline(torch.full((3,), 1.0))[1].item() == 1.0


def test_positive_penalties_and_unknown_modes_are_errors():
    with pytest.raises(ValueError, match="≤ 0"):
        credit.process_advantages(REWARDS, torch.tensor([0.0] * 7 + [0.5]), SEARCH_OF_TURN)
    with pytest.raises(ValueError, match="pre_norm"):
        credit.process_advantages(REWARDS, torch.zeros(8), SEARCH_OF_TURN, mode="both")
    with pytest.raises(ValueError, match="index"):
        credit.process_advantages(REWARDS, torch.zeros(8), SEARCH_OF_TURN + 1)


# ---------------------------------------------------------------------------------------------------------------
# F3 dual clip
# ---------------------------------------------------------------------------------------------------------------


def _loss_and_grad(log_ratio, A, **kw):
    lp = torch.tensor(log_ratio, dtype=torch.float64, requires_grad=True)
    loss = losses.dual_clip_loss(lp, torch.zeros_like(lp), torch.tensor(A, dtype=torch.float64), **kw)
    (g,) = torch.autograd.grad(loss.sum(), lp)
    return loss.detach(), g


def test_dual_clip_caps_the_loss_at_minus_c_a_for_negative_advantages():
    """ε = 0.2, c = 3. For A < 0 and r > c the loss is −cA = 3|A| with zero gradient, however large r gets."""
    big = [math.log(50.0), math.log(1e6)]
    loss, g = _loss_and_grad(big, [-1.0, -0.5])
    assert torch.allclose(loss, torch.tensor([3.0, 1.5], dtype=torch.float64)) and torch.equal(g, torch.zeros(2))
    # below the cap the ordinary PPO branch is active: r = 2, A = −1 → max(2, 1.2) = 2, gradient −r·A = 2
    loss, g = _loss_and_grad([math.log(2.0)], [-1.0])
    assert math.isclose(loss.item(), 2.0, rel_tol=1e-12) and math.isclose(g.item(), 2.0, rel_tol=1e-12)


def test_dual_clip_leaves_positive_advantages_to_the_ordinary_clip():
    # r = 50, A = 1: PPO clip gives −1.2·A with no gradient; c plays no role
    loss, g = _loss_and_grad([math.log(50.0)], [1.0])
    assert math.isclose(loss.item(), -1.2, rel_tol=1e-12) and g.item() == 0.0
    # r = 1.1 inside the clip: loss −rA, gradient −rA
    loss, g = _loss_and_grad([math.log(1.1)], [2.0])
    assert math.isclose(loss.item(), -2.2, rel_tol=1e-12) and math.isclose(g.item(), -2.2, rel_tol=1e-12)
    # for A < 0 with r below 1 − ε the ordinary clip holds it at −(1 − ε)A with no gradient
    loss, g = _loss_and_grad([math.log(0.5)], [-1.0])
    assert math.isclose(loss.item(), 0.8, rel_tol=1e-12) and g.item() == 0.0


def test_dual_clip_constant_must_exceed_one():
    with pytest.raises(ValueError, match="exceed 1"):
        losses.dual_clip_loss(torch.zeros(1), torch.zeros(1), torch.ones(1), c=1.0)


# ---------------------------------------------------------------------------------------------------------------
# F4 aggregation
# ---------------------------------------------------------------------------------------------------------------

# search 0: block 7 (Reflection) [1, 3], block 3 (Execution) [12]
# search 1: block 5 (Execution) [4, 6, 2] plus a masked restored-context token (100), block 9 (Reflection) [8]
LOSS = torch.tensor([1.0, 3.0, 12.0, 4.0, 6.0, 100.0, 2.0, 8.0], dtype=torch.float64)
MASK = torch.tensor([1, 1, 1, 1, 1, 0, 1, 1], dtype=torch.bool)
BLOCK = torch.tensor([7, 7, 3, 5, 5, 5, 5, 9])
SEARCH = torch.tensor([0, 0, 0, 1, 1, 1, 1, 1])
ROLE = torch.tensor([0, 0, 1, 1, 1, 1, 1, 0])  # 0 = Reflection, 1 = Execution

HAND = {
    "token": 36 / 7,  # (1 + 3 + 12 + 4 + 6 + 2 + 8) / 7
    "block": (2 + 12 + 4 + 8) / 4,  # block means 2, 12, 4, 8
    "rollout": (16 / 3 + 5) / 2,  # search means 16/3 and 20/4
    "role": (4 + 6) / 2,  # Reflection [1, 3, 8] → 4, Execution [12, 4, 6, 2] → 6
}


@pytest.mark.parametrize("mode", list(HAND))
def test_each_aggregation_mode_matches_the_hand_computed_value(mode):
    out = losses.aggregate(LOSS, MASK, BLOCK, SEARCH, ROLE, mode=mode)
    assert math.isclose(out.item(), HAND[mode], rel_tol=1e-12)


def test_role_lambda_mixes_the_role_mean_into_the_base_average():
    out = losses.aggregate(LOSS, MASK, BLOCK, SEARCH, ROLE, mode="rollout", role_lambda=0.25)
    assert math.isclose(out.item(), 0.75 * HAND["rollout"] + 0.25 * HAND["role"], rel_tol=1e-12)
    out = losses.aggregate(LOSS, MASK, BLOCK, SEARCH, ROLE, mode="token", role_lambda=1.0)
    assert math.isclose(out.item(), HAND["role"], rel_tol=1e-12)


@pytest.mark.parametrize(
    "mode, unit",
    [("token", None), ("block", BLOCK), ("rollout", SEARCH), ("role", ROLE)],
)
def test_each_mode_gives_its_units_equal_total_weight(mode, unit):
    """d loss / d l_t = 1/(#units · |unit(t)|): every unit's tokens share an equal total weight; masked tokens 0."""
    loss = LOSS.clone().requires_grad_(True)
    (g,) = torch.autograd.grad(losses.aggregate(loss, MASK, BLOCK, SEARCH, ROLE, mode=mode), loss)
    assert g[~MASK].abs().sum() == 0
    if unit is None:
        assert torch.allclose(g[MASK], torch.full((7,), 1 / 7, dtype=torch.float64))
        return
    units = unit[MASK].unique()
    for u in units:
        in_u = (unit == u) & MASK
        assert torch.allclose(g[in_u], torch.full((int(in_u.sum()),), 1 / (len(units) * int(in_u.sum()))).double())


def test_aggregate_needs_the_ids_of_its_unit_and_survives_an_empty_mask():
    with pytest.raises(ValueError, match="block_ids"):
        losses.aggregate(LOSS, MASK, None, SEARCH, ROLE, mode="block")
    with pytest.raises(ValueError, match="role_ids"):
        losses.aggregate(LOSS, MASK, BLOCK, SEARCH, None, mode="rollout", role_lambda=0.5)
    loss = LOSS.clone().requires_grad_(True)
    out = losses.aggregate(loss, torch.zeros(8, dtype=torch.bool), BLOCK, SEARCH, ROLE)
    assert out.item() == 0.0 and out.requires_grad


def test_penalised_turn_changes_only_its_own_tokens_gradient_end_to_end():
    """F2 → F3 → F4 at θ = θ_old: adding a penalty to turn 1 changes the gradient of turn 1's tokens only."""
    token_turn = torch.tensor([0, 0, 1, 1, 1, 2, 3, 3, 4])
    token_search = SEARCH_OF_TURN[token_turn]
    old = -torch.rand(9, generator=torch.Generator().manual_seed(0), dtype=torch.float64)
    mask = torch.ones(9, dtype=torch.bool)

    def grad(Q):
        A = credit.process_advantages(REWARDS, Q, SEARCH_OF_TURN)[token_turn]
        lp = old.clone().requires_grad_(True)
        loss = losses.aggregate(losses.dual_clip_loss(lp, old, A), mask, search_ids=token_search, mode="rollout")
        return torch.autograd.grad(loss, lp)[0]

    Q = torch.zeros(8, dtype=torch.float64)
    Q[1] = -1.0
    diff = grad(Q) - grad(torch.zeros(8, dtype=torch.float64))
    assert (diff[token_turn == 1] > 0).all()  # the penalty pushes that turn's tokens down
    assert torch.equal(diff[token_turn != 1], torch.zeros(6, dtype=torch.float64))
