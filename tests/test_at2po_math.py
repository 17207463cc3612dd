"""AT2PO (docs/design.md §3 A1–A5): turn entropy, entropy-guided node selection, path aggregation and the ATPO loss."""

import math
import random

import pytest
import torch

from tests.trees import deep_tree, flatten, grad, hotpot_like_tree, perturbed
from trl_tree import RolloutTree, Turn, credit, losses
from trl_tree.rollout.growing import expansion


def _turn(token, entropy=None, obs=(9,)):
    return Turn([token], [-1.0], list(obs), entropies=None if entropy is None else [entropy])


# ---------------------------------------------------------------------------------------------------------------
# A1 turn entropy
# ---------------------------------------------------------------------------------------------------------------


def test_token_entropy_from_logits_is_exact_and_ignores_masked_vocabulary():
    gen = torch.Generator().manual_seed(0)
    logits = torch.randn(5, 7, generator=gen, dtype=torch.float64)
    expected = torch.distributions.Categorical(logits=logits).entropy()
    assert torch.allclose(losses.token_entropy_from_logits(logits), expected, atol=1e-12)
    assert math.isclose(losses.token_entropy_from_logits(torch.zeros(16)).item(), math.log(16), rel_tol=1e-6)
    masked = torch.tensor([0.0, 0.0, -math.inf, -math.inf])  # two live entries: entropy log 2, not NaN
    assert math.isclose(losses.token_entropy_from_logits(masked).item(), math.log(2), rel_tol=1e-6)


def test_turn_entropy_is_the_mean_over_each_turns_trained_tokens():
    entropies = torch.tensor([1.0, 3.0, 5.0, 100.0, 2.0, 0.0], dtype=torch.float64)
    turn_ids = torch.tensor([0, 0, 2, -1, 2, 2])  # token 3 (an observation) is not part of any turn
    H = losses.turn_entropy(entropies, turn_ids, num_turns=3)
    assert torch.allclose(H, torch.tensor([2.0, 0.0, 7.0 / 3], dtype=torch.float64))


def test_tree_turn_entropies_match_the_per_token_definition():
    a = Turn([1, 2], [-1.0, -1.0], [9], entropies=[0.2, 0.6])
    b, c = Turn([3], [-1.0], entropies=[1.5]), Turn([4, 5, 6], [-1.0] * 3, entropies=[0.0, 0.3, 0.9])
    tree = RolloutTree.from_trajectories([0], [[a, b], [a, c]], [1, 0])
    turn_ids, _, _ = flatten(tree)
    flat = torch.tensor([h for t in tree.turns for h in t.entropies], dtype=torch.float64)
    assert torch.allclose(expansion.tree_turn_entropies(tree), losses.turn_entropy(flat, turn_ids, tree.num_turns))
    with pytest.raises(ValueError, match="no per-token entropies"):
        expansion.tree_turn_entropies(hotpot_like_tree())


# ---------------------------------------------------------------------------------------------------------------
# A2 node selection
# ---------------------------------------------------------------------------------------------------------------


def _penalty_tree():
    """Prompt → a (children b, c, d), e (child f); b, c, d, f each end in a distinct leaf.

    Sibling counts: a, e: 2 (the prompt's children); b, c, d: 3; f: 1; leaves: 1 each.
    """
    a, e = _turn(1), _turn(2)
    b, c, d, f = _turn(3), _turn(4), _turn(5), _turn(6)
    leaves = [_turn(10 + j, obs=()) for j in range(4)]
    trajectories = [[a, b, leaves[0]], [a, c, leaves[1]], [a, d, leaves[2]], [e, f, leaves[3]]]
    tree = RolloutTree.from_trajectories([0], trajectories, [1, 0, 0, 1])
    index = {tree.turns[i].action_ids[0]: i for i in range(tree.num_turns)}
    return tree, index


def test_sibling_counts_include_the_prompts_children():
    tree, idx = _penalty_tree()
    counts = expansion.sibling_counts(tree)
    expected = {1: 2, 2: 2, 3: 3, 4: 3, 5: 3, 6: 1, 10: 1, 11: 1, 12: 1, 13: 1}
    assert {tok: int(counts[i]) for tok, i in idx.items()} == expected


def test_the_sibling_penalty_changes_the_choice():
    """b has the highest entropy (1.00) but two siblings: S_b = 1.00 − 0.05·2 = 0.90 < S_f = 0.95 − 0 (only child)."""
    tree, idx = _penalty_tree()
    H = torch.zeros(tree.num_turns, dtype=torch.float64)
    for tok, h in {1: 0.5, 2: 0.3, 3: 1.00, 4: 0.2, 5: 0.1, 6: 0.95, 10: 9.0, 13: 9.0}.items():
        H[idx[tok]] = h  # leaves 10 and 13 have the highest entropy of all but are never candidates
    S = expansion.node_scores(tree, H, alpha=0.05)
    assert math.isclose(S[idx[3]].item(), 0.90) and math.isclose(S[idx[6]].item(), 0.95)
    assert math.isclose(S[idx[1]].item(), 0.45)
    assert expansion.select_expansion_turns(tree, H, k=1) == [idx[6]]
    assert expansion.select_expansion_turns(tree, H, k=1, alpha=0.0) == [idx[3]]
    assert expansion.select_expansion_turns(tree, H, k=3) == [idx[6], idx[3], idx[1]]  # highest score first


def test_selection_returns_distinct_non_leaf_turns_and_at_most_the_candidates():
    tree = hotpot_like_tree()
    H = torch.rand(tree.num_turns, generator=torch.Generator().manual_seed(0), dtype=torch.float64)
    candidates = set(expansion.expansion_candidates(tree).nonzero().squeeze(1).tolist())
    assert candidates == {i for i, t in enumerate(tree.turns) if not t.is_leaf}
    chosen = expansion.select_expansion_turns(tree, H, k=100)
    assert sorted(chosen) == sorted(candidates)  # k larger than the candidates: every candidate once
    assert expansion.select_expansion_turns(tree, H, k=0) == []
    single_turn = RolloutTree.from_trajectories([0], [[_turn(1, obs=())], [_turn(2, obs=())]], [1, 0])
    assert expansion.select_expansion_turns(single_turn, torch.zeros(2), k=3) == []


def test_ties_go_to_the_earlier_turn_in_dfs_order():
    tree = hotpot_like_tree()
    chosen = expansion.select_expansion_turns(tree, torch.zeros(tree.num_turns), k=2, alpha=0.0)
    candidates = expansion.expansion_candidates(tree).nonzero().squeeze(1).tolist()
    assert chosen == candidates[:2]


@pytest.mark.parametrize("k", [1, 2])
def test_random_mode_picks_uniformly_among_candidates(k):
    """Every non-leaf turn is drawn with probability k/n; leaves never; a seed makes the draw reproducible."""
    tree, _ = _penalty_tree()
    candidates = expansion.expansion_candidates(tree).nonzero().squeeze(1).tolist()
    n, draws = len(candidates), 3000
    gen = torch.Generator().manual_seed(123)
    counts = torch.zeros(tree.num_turns)
    for _ in range(draws):
        picked = expansion.select_expansion_turns(tree, None, k=k, rng=gen, mode="random")
        assert len(set(picked)) == k
        counts[picked] += 1
    freq = counts / draws
    assert torch.allclose(freq[candidates], torch.full((n,), k / n), atol=0.035)
    leaves = [i for i in range(tree.num_turns) if i not in candidates]
    assert freq.sum() == pytest.approx(k) and freq[leaves].sum() == 0

    first = [expansion.select_expansion_turns(tree, None, k, rng=random.Random(7), mode="random") for _ in range(3)]
    assert first[0] == first[1] == first[2]


def test_a_selected_turn_is_resampled_from_its_own_pre_turn_history():
    """The anchor keeps exactly the ancestors of turn i, so the regenerated turn is a sibling of i."""
    tree = deep_tree()
    for i in expansion.expansion_candidates(tree).nonzero().squeeze(1).tolist():
        k, t = expansion.expansion_anchor(tree, i)
        assert tree.paths[k][t] == i and t == tree.turns[i].depth
        kept = tree.paths[k][:t]
        ancestors, p = [], tree.turns[i].parent
        while p >= 0:
            ancestors.insert(0, p)
            p = tree.turns[p].parent
        assert kept == ancestors


# ---------------------------------------------------------------------------------------------------------------
# A3–A4: leaf values and backups (child-mean vs leaf-mean on an unbalanced tree is in test_credit.py)
# ---------------------------------------------------------------------------------------------------------------


def test_a3_leaf_values_use_population_std_with_epsilon():
    r = torch.tensor([1.0, 0.0, 0.0, 1.0, 1.0], dtype=torch.float64)
    A = credit.standardize(r, ddof=0, eps=1e-6)
    assert torch.allclose(A, (r - r.mean()) / (r.std(correction=0) + 1e-6))


# ---------------------------------------------------------------------------------------------------------------
# Path aggregation and the ATPO loss (A5)
# ---------------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("tree_fn", [hotpot_like_tree, deep_tree])
def test_path_weights_sum_to_one_and_count_every_path_through_a_turn(tree_fn):
    tree = tree_fn()
    w = credit.path_token_weights(tree)
    L = credit.turn_lengths(tree)
    assert math.isclose((w * L).sum().item(), 1.0, rel_tol=1e-12)
    K = tree.num_leaves
    path_len = [sum(L[i].item() for i in p) for p in tree.paths]
    for i in range(tree.num_turns):
        expected = sum(1 / (K * path_len[k]) for k, p in enumerate(tree.paths) if i in p)
        assert math.isclose(w[i].item(), expected, rel_tol=1e-12)


def _flat_path_loss(tree, logps, old, spans, per_path_token_terms):
    """GRPO seq-mean-token-mean over the K flat root-to-leaf sequences (shared tokens repeated in every path)."""
    per_path = []
    for path in tree.paths:
        idx = torch.tensor([j for i in path for j in spans[i]])
        per_path.append(per_path_token_terms(path, idx).sum() / len(idx))
    return -torch.stack(per_path).mean()


def _random_setup(tree_fn, seed, scale=0.3):
    tree = tree_fn()
    turn_ids, old, spans = flatten(tree)
    A = credit.child_mean_backup(tree, credit.standardize(torch.tensor(tree.rewards, dtype=torch.float64), ddof=0))
    return tree, turn_ids, old, spans, perturbed(old, seed, scale), A


@pytest.mark.parametrize("tree_fn", [hotpot_like_tree, deep_tree])
@pytest.mark.parametrize("seed", [0, 1])
def test_atpo_with_path_weights_equals_grpo_style_aggregation_over_flat_paths(tree_fn, seed):
    tree, turn_ids, old, spans, logps, A = _random_setup(tree_fn, seed)
    eps_lo, eps_hi = 0.1, 0.15
    w, tree_ids = credit.path_token_weights(tree), torch.zeros(tree.num_turns, dtype=torch.long)

    def tree_loss(lp):
        return losses.atpo_loss(lp, old, turn_ids, A, w, tree_ids, epsilon_low=eps_lo, epsilon_high=eps_hi)

    def flat_loss(lp):
        def terms(path, idx):
            out = []
            for i in path:
                r = (lp[list(spans[i])] - old[list(spans[i])]).mean().exp()
                term = torch.minimum(r * A[i], r.clamp(1 - eps_lo, 1 + eps_hi) * A[i])
                out.append(term.expand(len(spans[i])))
            return torch.cat(out)

        return _flat_path_loss(tree, lp, old, spans, terms)

    assert torch.allclose(tree_loss(logps), flat_loss(logps), atol=1e-12)
    assert torch.allclose(grad(tree_loss, logps), grad(flat_loss, logps), atol=1e-12)


def test_atpo_gradient_vanishes_exactly_on_clipped_turns():
    """Turn ratio r_i = exp(mean log-ratio); the clip (ε = 0.2) acts on the whole turn, never on single tokens."""
    turn_ids = torch.tensor([0, 0, 1, 1, 2, 2, 3, 3, -1])
    old = torch.zeros(9, dtype=torch.float64)
    log_ratio = torch.tensor([0.5, 0.3, -0.4, -0.6, 0.5, 0.3, 0.6, -0.5, 3.0], dtype=torch.float64)
    A = torch.tensor([1.0, -1.0, -1.0, 2.0], dtype=torch.float64)
    # turn 0: r = e^0.4 > 1.2, A > 0 → clipped.  turn 1: r = e^-0.5 < 0.8, A < 0 → clipped.
    # turn 2: r = e^0.4 > 1.2 but A < 0 → min keeps r·A, not clipped.  turn 3: r = e^0.05, inside, although
    # its tokens' own ratios (e^0.6, e^-0.5) lie outside [0.8, 1.2].
    w = torch.full((4,), 1 / 8, dtype=torch.float64)
    tree_ids = torch.zeros(4, dtype=torch.long)
    g = grad(lambda lp: losses.atpo_loss(lp, old, turn_ids, A, w, tree_ids), log_ratio)
    assert torch.equal(g[:4], torch.zeros(4, dtype=torch.float64)) and g[8] == 0
    r = torch.tensor([math.exp(0.4), math.exp(0.05)], dtype=torch.float64)
    expected = -(1 / 8) * A[[2, 3]] * r  # per token: −w_i A_i r_i (the 1/L_i of the mean cancels the L_i tokens)
    assert torch.allclose(g[4:6], expected[0].expand(2), atol=1e-12)
    assert torch.allclose(g[6:8], expected[1].expand(2), atol=1e-12)
    # the token-level GRPO surrogate clips turn 3's tokens one by one instead: its first token gets no gradient
    g_tok = grad(lambda lp: losses.clipped_token_loss(lp, old, turn_ids, A, w, tree_ids), log_ratio)
    assert g_tok[6] == 0 and g_tok[7] != 0


@pytest.mark.parametrize("tree_fn", [hotpot_like_tree, deep_tree])
def test_atpo_and_grpo_losses_agree_at_the_behaviour_policy(tree_fn):
    """At θ = θ_old every ratio is 1, nothing is clipped and both gradients are −w_i A_i per token."""
    tree, turn_ids, old, _, _, A = _random_setup(tree_fn, 0)
    w, tree_ids = credit.path_token_weights(tree), torch.zeros(tree.num_turns, dtype=torch.long)
    g_atpo = grad(lambda lp: losses.atpo_loss(lp, old, turn_ids, A, w, tree_ids), old)
    g_grpo = grad(lambda lp: losses.clipped_token_loss(lp, old, turn_ids, A, w, tree_ids), old)
    assert torch.allclose(g_atpo, -(w * A)[turn_ids], atol=1e-12)
    assert torch.allclose(g_grpo, g_atpo, atol=1e-12)


@pytest.mark.parametrize("loss_fn", [losses.atpo_loss, losses.clipped_token_loss])
def test_turn_weighted_losses_reject_weights_of_another_length(loss_fn):
    turn_ids, lp = torch.tensor([0, 0, 1]), torch.zeros(3, dtype=torch.float64)
    A, w, tree_ids = torch.ones(2, dtype=torch.float64), torch.ones(3, dtype=torch.float64), torch.zeros(2).long()
    with pytest.raises(ValueError, match="turn_weights has 3 entries but the batch has 2 unique turns"):
        loss_fn(lp, lp, turn_ids, A, w, tree_ids)


def test_atpo_batch_loss_is_the_mean_over_trees():
    t1, ids1, old1, _, lp1, A1 = _random_setup(hotpot_like_tree, 0)
    t2, ids2, old2, _, lp2, A2 = _random_setup(deep_tree, 1)
    w1, w2 = credit.path_token_weights(t1), credit.path_token_weights(t2)
    z1, z2 = torch.zeros(t1.num_turns, dtype=torch.long), torch.zeros(t2.num_turns, dtype=torch.long)
    one = losses.atpo_loss(lp1, old1, ids1, A1, w1, z1)
    two = losses.atpo_loss(lp2, old2, ids2, A2, w2, z2)
    both = losses.atpo_loss(
        torch.cat([lp1, torch.tensor([4.0], dtype=torch.float64), lp2]),
        torch.cat([old1, torch.zeros(1, dtype=torch.float64), old2]),
        torch.cat([ids1, torch.tensor([-1]), ids2 + t1.num_turns]),
        torch.cat([A1, A2]),
        torch.cat([w1, w2]),
        torch.cat([z1, z2 + 1]),
    )
    assert torch.allclose(both, (one + two) / 2, atol=1e-12)


def test_masked_turns_drop_out_of_the_path_lengths():
    """Passing trained lengths (a truncated turn masked to 0) renormalises every path through it."""
    tree = hotpot_like_tree()
    L = credit.turn_lengths(tree)
    masked = L.clone()
    masked[tree.leaf_of[0]] = 0  # trajectory 0's terminal turn is not trained
    w = credit.path_token_weights(tree, masked)
    assert math.isclose((w * masked).sum().item(), 1.0, rel_tol=1e-12)
    assert not torch.allclose(w, credit.path_token_weights(tree))
