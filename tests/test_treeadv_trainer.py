"""TreeAdvTrainer on scripted generations with scripted per-token entropies (docs/design.md §3 D1–D4): branches start at the
high-entropy tokens, the cap and the minimum segment length hold, segment advantages are the mean of the leaf
advantages below, a branch inside a tool call changes the call, GSPO-token travels through the batch, and with no
branching TreeAdv is flat GRPO."""

import math
import statistics

import pytest
import torch

from tests.scripted import (
    CALL_1_PLUS_1,
    TAU,
    EntropyScript,
    arithmetic_dataset,
    captured_units,
    config,
    contains_answer,
    math_entropy_script,
    scripted_trainer,
    tiny,
    tool_call,
)
from tests.trees import flat_gspo_token
from trl_tree import TreeAdvConfig, TreeAdvTrainer, TreeConfig, TreeTrainer, Turn
from trl_tree.core.batch import TurnCredit
from trl_tree.rollout.growing.token_branching import BRANCH_POINTS_METRIC, split_turns
from trl_tree.rollout.growing.turn_loop import Branch
from trl_tree.testing import calculator


def _capture_samples(trainer) -> list:
    """Every `SampledTrees` the trainer's sampler returns from now on (its per-tree stats travel with it)."""
    sampled, sample = [], trainer.sampler.sample
    trainer.sampler.sample = lambda roots: sampled.append(sample(roots)) or sampled[-1]
    return sampled


def _trainer(tmp_path, script, cls=TreeAdvTrainer, config_cls=TreeAdvConfig, n_prompts=1, tools=None, **overrides):
    trainer = scripted_trainer(cls, config_cls, tmp_path, script=script, dataset=arithmetic_dataset(n_prompts),
                               tools=tools, **overrides)
    return trainer, captured_units(trainer)


def _leaf_advantages(rewards):
    mean, std = statistics.mean(rewards), statistics.stdev(rewards)  # D1: sample std
    return [(r - mean) / std for r in rewards]


def _assert_segment_advantages(tree, A_batch):
    """D2 by hand: each node's advantage is the mean of A_k over the trajectories whose path goes through it."""
    A = _leaf_advantages(tree.rewards)
    for i in range(tree.num_turns):
        below = [A[k] for k, path in enumerate(tree.paths) if i in path]
        assert math.isclose(A_batch[i].item(), sum(below) / len(below), abs_tol=1e-5), i


def _cut_offsets(tree, first):
    """Offsets (in the root trajectory's completion) where the chain of segments starting at node `first` is cut."""
    offsets, node, pos = [], first, 0
    while tree.turns[node].partial:
        pos += len(tree.turns[node].action_ids)
        offsets.append(pos)
        node = tree.turns[node].children[0]  # the rest of the original trajectory came first
    return offsets, node


def test_branches_start_at_high_entropy_tokens_within_the_cap_and_min_segment_length(tmp_path):
    trainer, captured = _trainer(tmp_path, math_entropy_script(), num_initial_rollouts=2, entropy_threshold=TAU,
                                 max_branches_per_tree=2, min_segment_length=3, max_turns=1)
    sampled = _capture_samples(trainer)
    batch = trainer.generate_batch([trainer.train_dataset[0]])
    tree = captured[0]
    assert sampled[0].stats[BRANCH_POINTS_METRIC] == [2.0, 1.0]  # the cap binds on tree 1 (token 7 was eligible)
    assert tree.num_leaves == 5 and tree.rewards == [1.0, 0.0, 0.0, 1.0, 1.0]
    first_1, first_2 = tree.roots
    # root 1 is cut before tokens 4 and 10, root 2 before token 7; the token that starts each cut-off piece is one of
    # the high-entropy tokens, re-sampled by the sibling continuation
    offsets_1, last_1 = _cut_offsets(tree, first_1)
    offsets_2, last_2 = _cut_offsets(tree, first_2)
    assert offsets_1 == [4, 10] and offsets_2 == [7]
    for turn in tree.turns:
        if turn.partial:  # a segment that stops mid-turn: the rest of the split trajectory and one continuation
            rest, _ = turn.children
            assert tree.turns[rest].entropies[0] > TAU  # the branch started at a high-entropy token
            assert not turn.observation_ids
    # every piece of a split completion has at least L = 3 tokens
    pieces = [len(t.action_ids) for t in tree.turns if t.partial] + [len(tree.turns[i].action_ids) for i in
                                                                      (last_1, last_2)]
    assert min(pieces) >= 3
    assert tree.num_turns == 8
    # each shared segment is forwarded and trained once
    assert batch["valid"][0, 0].item() == tree.num_unique_tokens < tree.num_path_tokens
    trained = (batch["turn_ids"][0, 0] >= 0).sum().item()
    assert trained == sum(len(t.action_ids) for t in tree.turns)
    _assert_segment_advantages(tree, TurnCredit.from_dict(batch).A[0])
    # the root segment of tree 1 is shared by R1 (A+), its continuation at 4 (A−) and the one at 10 (A+)
    A = _leaf_advantages(tree.rewards)
    assert math.isclose(TurnCredit.from_dict(batch).A[0, first_1].item(), (A[0] + A[2] + A[3]) / 3, abs_tol=1e-5)
    assert torch.isfinite(trainer.compute_loss(trainer.model, batch))


def test_a_branch_inside_a_tool_call_changes_the_call_and_max_turns_counts_assistant_turns(tmp_path):
    """The branch at the second '1' of "1+1" writes "1+2": the whole turn is parsed, the tool runs on "1+2", and the
    branch still gets its answer turn with max_turns = 2, although its first turn is two segments."""
    roots = [(CALL_1_PLUS_1, {17: 2.0}), ("I do not know.", {})]
    head_text = CALL_1_PLUS_1[: CALL_1_PLUS_1.index("1+1") + 2]
    script = lambda tok: EntropyScript(  # noqa: E731
        tok, roots, {head_text: '2"}}\n</tool_call>'}, {"2": "The answer is 2.", "3": "The answer is 3."}
    )
    trainer, captured = _trainer(tmp_path, script, tools=[calculator], num_initial_rollouts=2, max_turns=2,
                                 entropy_threshold=TAU, max_branches_per_tree=1, min_segment_length=2,
                                 max_completion_length=300)
    sampled = []
    sample = trainer.sampler.sample
    trainer.sampler.sample = lambda roots: sampled.append(sample(roots)) or sampled[-1]
    batch = trainer.generate_batch([trainer.train_dataset[0]])
    tree, tok = captured[0], trainer.processing_class
    assert tree.num_leaves == 3 and tree.rewards == [1.0, 0.0, 0.0]
    head = tree.roots[0]
    assert tree.turns[head].partial and tok.decode(tree.turns[head].action_ids) == head_text
    original, branch = tree.turns[head].children
    assert "<tool_response>\n2\n</tool_response>" in tok.decode(tree.turns[original].observation_ids)
    assert "<tool_response>\n3\n</tool_response>" in tok.decode(tree.turns[branch].observation_ids)
    answer = tree.turns[branch].children[0]
    assert tok.decode(tree.turns[answer].action_ids).startswith("The answer is 3.")
    assert tree.paths[2] == [head, branch, answer]  # three segments, two assistant turns
    # the reward functions see the whole re-parsed assistant turn
    messages = sampled[0][0][2].messages
    assert [m["role"] for m in messages] == ["assistant", "tool", "assistant"] and messages[1]["content"] == "3"
    assert messages[0]["tool_calls"][0]["function"] == {"name": "calculator", "arguments": {"expression": "1+2"}}
    _assert_segment_advantages(tree, TurnCredit.from_dict(batch).A[0])


# ---------------------------------------------------------------------------------------------------------------
# With no branching TreeAdv is flat GRPO
# ---------------------------------------------------------------------------------------------------------------

FLAT = [(CALL_1_PLUS_1, {5: 5.0}), ("I do not know.", {2: 5.0}), (tool_call("calculator", expression="2+2"), {})]
FLAT_AFTER = {"2": "The answer is 2.", "4": "The answer is 4."}


def _grads(model):
    return {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}


def test_without_branching_treeadv_equals_flat_grpo(tmp_path):
    """τ_H above every entropy: the same M trajectories, tree, advantages, loss and gradient as
    TreeConfig(sampler="flat", credit="path", loss="grpo") — here at θ_old and at a perturbed π_old."""
    results = {}
    for name, cls, config_cls, extra in [
        ("treeadv", TreeAdvTrainer, TreeAdvConfig, {"entropy_threshold": 100.0, "max_branches_per_tree": 2,
                                                    "min_segment_length": 1}),
        ("grpo", TreeTrainer, TreeConfig, {"sampler": "flat", "credit": "path", "loss": "grpo"}),
    ]:
        script = lambda tok: EntropyScript(tok, list(FLAT), after_tool=FLAT_AFTER)  # noqa: E731
        trainer, captured = _trainer(tmp_path / name, script, cls, config_cls, tools=[calculator],
                                     num_initial_rollouts=3, max_turns=3, max_completion_length=300, **extra)
        batch = trainer.generate_batch([trainer.train_dataset[0]])
        out = {"tree": captured[0], "batch": batch, "loss": [], "grads": []}
        noise = 0.05 * torch.randn(batch["old_logps"].shape, generator=torch.Generator().manual_seed(0))
        for old in (batch["old_logps"], batch["old_logps"] + noise):
            trainer.model.zero_grad()
            # a fresh batch at another π_old: the behaviour policy that sampled it moves with it (μ = π_old)
            loss = trainer.compute_loss(trainer.model, {**batch, "old_logps": old, "behaviour_logps": old})
            loss.backward()
            out["loss"].append(loss.item())
            out["grads"].append(_grads(trainer.model))
        results[name] = out
    adv, grpo = results["treeadv"], results["grpo"]
    assert [t.action_ids for t in adv["tree"].turns] == [t.action_ids for t in grpo["tree"].turns]
    assert adv["tree"].paths == grpo["tree"].paths and adv["tree"].rewards == grpo["tree"].rewards == [1.0, 0.0, 0.0]
    assert not any(t.partial for t in adv["tree"].turns)
    assert torch.allclose(TurnCredit.from_dict(adv["batch"]).A, TurnCredit.from_dict(grpo["batch"]).A, atol=1e-6)
    assert torch.allclose(TurnCredit.from_dict(adv["batch"]).w, TurnCredit.from_dict(grpo["batch"]).w)
    for block in range(2):
        assert abs(adv["loss"][block]) > 1e-6 or block == 0
        assert math.isclose(adv["loss"][block], grpo["loss"][block], rel_tol=1e-5, abs_tol=1e-7)
        for n, g in adv["grads"][block].items():
            assert torch.allclose(g, grpo["grads"][block][n], atol=1e-7, rtol=1e-5), n
    assert max(g.abs().max().item() for g in adv["grads"][0].values()) > 0


# ---------------------------------------------------------------------------------------------------------------
# GSPO-token through the trainer's batch
# ---------------------------------------------------------------------------------------------------------------


def test_gspo_token_loss_in_the_trainer_equals_gspo_token_over_each_trees_sequences(tmp_path):
    """Two branched trees in one batch: the per-turn path ranges rebuild every (path, turn) pair with global ids."""
    eps = 0.02
    trainer, captured = _trainer(tmp_path, math_entropy_script(2), n_prompts=2, num_initial_rollouts=2, max_turns=1,
                                 entropy_threshold=TAU, max_branches_per_tree=2, min_segment_length=3,
                                 loss="gspo_token", epsilon=eps, epsilon_high=eps)
    batch = trainer.generate_batch([trainer.train_dataset[0], trainer.train_dataset[1]])
    noise = 0.05 * torch.randn(batch["old_logps"].shape, generator=torch.Generator().manual_seed(1))
    batch["old_logps"] = batch["old_logps"] + noise
    batch["behaviour_logps"] = batch["old_logps"]  # still a fresh batch: μ = π_old
    from trl_tree.core.packing import PackedTrees, packed_token_logps

    with torch.no_grad():
        loss = trainer.compute_loss(trainer.model, batch).item()
        logps, _ = packed_token_logps(trainer.model, PackedTrees.from_dict(batch))
    expected, ratios = [], []
    for n, tree in enumerate(captured):
        ids = batch["turn_ids"][n, 0]
        lp = [logps[n, 0][ids == i] for i in range(tree.num_turns)]
        old = [batch["old_logps"][n, 0][ids == i] for i in range(tree.num_turns)]
        expected.append(flat_gspo_token(tree, lp, old, TurnCredit.from_dict(batch).A[n], eps))
        ratios += [torch.cat([lp[i] - old[i] for i in p]).mean().exp().item() for p in tree.paths]
    assert any(abs(r - 1) > eps for r in ratios) and any(abs(r - 1) < eps for r in ratios)  # clips both ways
    assert math.isclose(loss, torch.stack(expected).mean().item(), rel_tol=1e-5, abs_tol=1e-7)


# ---------------------------------------------------------------------------------------------------------------
# Pieces
# ---------------------------------------------------------------------------------------------------------------


def test_split_turns_keeps_the_observation_and_flags_on_the_last_piece():
    turn = Turn(list(range(10, 16)), [-0.5] * 6, [7, 8], entropies=[0.1] * 6, truncated=True, penalty=-1.0)
    branch = Branch(tree=0, prefix_ids=[1, 2, *range(10, 16), 7, 8], prompt_len=2, turns=[turn], turn_starts=[2])
    segments, starts = split_turns(branch, [4, 2, 9, 6])  # 2 starts the turn and 9 is an observation: ignored
    assert [s.action_ids for s in segments] == [[10, 11], [12, 13], [14, 15]] and starts == [2, 4, 6]
    assert [s.partial for s in segments] == [True, True, False]
    assert [s.observation_ids for s in segments] == [[], [], [7, 8]]
    assert [(s.truncated, s.penalty) for s in segments] == [(False, 0.0), (False, 0.0), (True, -1.0)]


def test_a_single_tree_without_high_entropy_tokens_still_gets_two_leaves(tmp_path):
    """M = 1 and nothing above τ_H: one branch is forced at the highest-entropy eligible token (D1 needs K ≥ 2)."""
    roots = [("I think the answer is 3.", {3: 0.4, 6: 0.7})]
    script = lambda tok: EntropyScript(tok, roots, {"I think the answer": " is 2."})  # noqa: E731
    trainer, captured = _trainer(tmp_path, script, num_initial_rollouts=1, max_turns=1, entropy_threshold=TAU,
                                 max_branches_per_tree=2, min_segment_length=2)
    trainer.generate_batch([trainer.train_dataset[0]])
    tree = captured[0]
    assert tree.num_leaves == 2 and tree.rewards == [0.0, 1.0]
    assert len(tree.turns[tree.roots[0]].action_ids) == 6


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        ({"min_segment_length": 0}, "min_segment_length ≥ 1"),
        ({"max_branches_per_tree": -1}, "max_branches_per_tree ≥ 0"),
        ({"branching_rounds": 0}, "branching_rounds ≥"),
        ({"num_initial_rollouts": 1, "max_branches_per_tree": 0}, "K ≥ 2 leaves"),
        ({"entropy_threshold": float("nan")}, "NaN"),
    ],
)
def test_invalid_treeadv_configuration_is_rejected(tmp_path, overrides, message):
    with pytest.raises(ValueError, match=message):
        config(TreeAdvConfig, tmp_path, **overrides)


def test_real_generation_with_exact_entropies_keeps_the_invariants_over_two_rounds(tmp_path):
    """The tiny model generating for real (HF engine, exact entropies from the logits), two rounds of branching."""
    model, tok = tiny()
    args = config(TreeAdvConfig, tmp_path, num_initial_rollouts=2, max_turns=1, max_completion_length=24,
                  entropy_threshold=0.5, max_branches_per_tree=3, branching_rounds=2, min_segment_length=3)
    trainer = TreeAdvTrainer(model=model, reward_funcs=lambda completions, **kw: [float(len(c[-1]["content"]) % 3)
                                                                                  for c in completions],
                             args=args, train_dataset=arithmetic_dataset(1), processing_class=tok)
    assert trainer.generation_engine.with_scores  # needs_entropies
    captured = []
    original = trainer.turn_credit
    trainer.turn_credit = lambda tree: captured.append(tree) or original(tree)
    sampled = _capture_samples(trainer)
    batch = trainer.generate_batch([trainer.train_dataset[0]])
    tree, points = captured[0], [int(n) for n in sampled[0].stats[BRANCH_POINTS_METRIC]]
    assert all(n <= 3 for n in points) and tree.num_leaves == 2 + sum(points) and sum(points) > 0
    for turn in tree.turns:
        if turn.partial:
            rest = tree.turns[turn.children[0]]  # the trajectory that was split came first
            assert len(turn.action_ids) >= 3 and len(rest.action_ids) >= 3
            assert rest.entropies[0] > 0.5
    assert batch["valid"][0, 0].item() == tree.num_unique_tokens
    _assert_segment_advantages(tree, TurnCredit.from_dict(batch).A[0])


def test_a_plain_tree_trainer_with_token_branching_generates_entropies(tmp_path):
    """Composition: `TreeTrainer(TreeConfig(sampler="token_entropy"))` asks the engine for per-token entropies."""
    model, tok = tiny()
    args = config(TreeConfig, tmp_path, sampler="token_entropy", credit="leaf_mean", loss="grpo", max_turns=1,
                  max_completion_length=8, entropy_threshold=0.0, min_segment_length=1)
    trainer = TreeTrainer(model=model, reward_funcs=contains_answer, args=args, train_dataset=arithmetic_dataset(1),
                          processing_class=tok)
    assert trainer.needs_entropies and trainer.generation_engine.with_scores
    batch = trainer.generate_batch([trainer.train_dataset[0]])
    assert int(TurnCredit.from_dict(batch).count[0]) > args.num_initial_rollouts  # branched inside completions
