"""TreeFlexTrainer on scripted generations: blocks, restored context, penalties, F1 divisor and F4 weights.

The script plays both roles of the two-role harness. Per search (K = 2, max_blocks = 3):
  Reflection turn 0 → an instruction; Execution segment 1 calls the calculator, then writes its card;
  Reflection turn 1 → resume a node (search 0: node 1; search 1: node 7, which does not exist: rejected, Q = −1);
  Execution segment 2 (search 0: calculator again; search 1: a malformed call, Q = −1), then its card;
  Reflection turn 2 → the final answer (search 0: 2, R = 1; search 1: 3, R = 0).
"""

import math

import pytest
import torch
from trl.trainer.utils import split_tensor_dict

from tests.remote_env import RemoteCounterEnv, SessionServer
from tests.scripted import (
    EXECUTE_AFTER_TOOL,
    EXECUTE_FIRST,
    REFLECT,
    TWO_ROLE_FIELDS,
    CounterEnv,
    TwoRoleScript,
    arithmetic_dataset,
    captured_units,
    config,
    contains_answer,
    scripted_trainer,
    tiny,
    tool_call,
)
from trl_tree import TreeFlexConfig, TreeFlexTrainer, Turn, losses
from trl_tree.core.batch import LossInputs, TurnCredit
from trl_tree.core.losses import aggregation_weights
from trl_tree.core.packing import PackedTrees, packed_token_logps
from trl_tree.rollout.growing.flex_harness import (
    EXECUTION,
    REFLECTION,
    FlexBlock,
    FlexSearch,
)
from trl_tree.testing import ScriptedEngine, calculator
from trl_tree.trainer.presets.treeflex import FlexGroup, pack_groups


class Penalise(TreeFlexTrainer):
    """The configurable process penalty: −0.2 on search 0's first card (the last turn of its first segment)."""

    def process_penalty(self, example, search, block, turn_index):
        card = block.role == EXECUTION and block.messages[-1].get("content") == "Card: 1+1 = 2."
        return -0.2 if (search.tool_failures == 0 and card and turn_index == 1) else 0.0


def _trainer(tmp_path, cls=TreeFlexTrainer, reward=contains_answer, n_prompts=1, **overrides):
    trainer = scripted_trainer(cls, TreeFlexConfig, tmp_path, script=TwoRoleScript, reward_funcs=reward,
                               dataset=arithmetic_dataset(n_prompts), **{**TWO_ROLE_FIELDS, **overrides})
    return trainer, captured_units(trainer)


@pytest.fixture(scope="module")
def scripted(tmp_path_factory):
    """One scripted generation batch (with the −0.2 hook) and the trainer that made it."""
    trainer, groups = _trainer(tmp_path_factory.mktemp("flex"), cls=Penalise)
    batch = trainer.generate_batch([trainer.train_dataset[0]])
    return trainer, groups[0], batch


def _decode(tok, ids):
    return tok.decode(ids, skip_special_tokens=False)


# ---------------------------------------------------------------------------------------------------------------
# The two-role harness
# ---------------------------------------------------------------------------------------------------------------


def test_execution_blocks_start_from_a_restored_card_not_the_previous_history(scripted):
    trainer, group, _ = scripted
    tok = trainer.processing_class
    s0, s1 = group.searches
    assert [b.role for b in s0.blocks] == [REFLECTION, EXECUTION, EXECUTION]
    assert s0.info["resumed_from"] == [0, 1] and s1.info["resumed_from"] == [0, 1]
    first, second = s0.blocks[1], s0.blocks[2]
    ctx1, ctx2 = _decode(tok, first.context_ids), _decode(tok, second.context_ids)
    # segment 1 starts fresh from the root: the task and the instruction only
    assert "Restored checkpoint" not in ctx1 and "Instruction:\nCompute 1+1 with the calculator." in ctx1
    # segment 2 starts from node 1's card and Reflection's new instruction, not from segment 1's history
    assert "Restored checkpoint (node 1):\nCard: 1+1 = 2." in ctx2 and "Instruction:\nCheck the sum once more." in ctx2
    assert "<tool_call>" not in ctx2.split("<|im_start|>user")[-1] and "<tool_response>" not in ctx2
    assert second.context_ids[: len(first.token_ids)] != first.token_ids
    # Reflection is one block that grows by appending: its turns, then each card as appended context
    reflection = s0.blocks[0]
    assert len(reflection.turns) == 3
    observed = [_decode(tok, t.observation_ids) for t in reflection.turns]
    assert "Checkpoint card (node 1):\nCard: 1+1 = 2." in observed[0] and "Card: checked, 2." in observed[1]
    assert "No Execution segments remain" in observed[1] and observed[2] == ""
    # the reward sees the search's transcript ending with Reflection's answer
    assert s0.completion[-1]["content"] == "<answer>2</answer>" and group.scores.tolist() == [1.0, 0.0]


def test_copied_text_is_trained_only_in_the_block_that_generated_it(scripted):
    """Each card and instruction is a trained turn in exactly one block and context everywhere it is copied."""
    trainer, group, _ = scripted
    tok = trainer.processing_class
    for search in group.searches:
        trained = [(b, _decode(tok, t.action_ids)) for b in search.blocks for t in b.turns]
        for text in ["Card: 1+1 = 2.", "Check the sum once more.", "Card: checked, 2."]:
            owners = [b.role for b, s in trained if text in s]
            if search is group.searches[0]:
                assert len(owners) == 1, text
        card_blocks = [b for b, s in trained if "Card: 1+1 = 2." in s]
        assert card_blocks[0].role == EXECUTION
        # the same card sits in Reflection's context and in the next segment's context, never as an action there
        assert "Card: 1+1 = 2." in _decode(tok, search.blocks[0].token_ids)
        assert "Card: 1+1 = 2." in _decode(tok, search.blocks[2].context_ids)


def test_rejected_resume_and_malformed_call_are_penalised_on_their_own_turn(scripted):
    _, group, _ = scripted
    s1 = group.searches[1]
    reflection, _, second = s1.blocks
    assert [t.penalty for t in reflection.turns] == [0.0, -1.0, 0.0]  # <resume>7</resume>: no such node
    assert [t.penalty for t in second.turns] == [-1.0, 0.0] and s1.tool_failures == 1


@pytest.mark.parametrize("world", ["copyable", "remote"])
def test_resuming_a_node_restores_its_environment_snapshot(tmp_path, world):
    """Search 0 resumes node 0 (the start) for its second segment, search 1 continues from node 1: both segments
    increment once, so the worlds end at 1 and 2. A remote session cannot be copied: its nodes are rebuilt by replay
    of the calls that made them."""
    if world == "remote":
        with SessionServer() as server:
            _resume_nodes(tmp_path, server.factory(RemoteCounterEnv))
    else:
        _resume_nodes(tmp_path, CounterEnv)


def _resume_nodes(tmp_path, factory):
    model, tok = tiny()
    reflect = {0: ["Count.", "Count."], 1: ["<resume>0</resume> Start over.", "Count once more."],
               2: ["<answer>done</answer>"] * 2}
    call = tool_call("increment")
    seen = []

    def counter(completions, environments, **kwargs):
        seen.extend(e.n for e in environments)
        return [float(e.n) for e in environments]

    args = config(TreeFlexConfig, tmp_path, num_searches=2, max_blocks=3, max_turns=3, max_completion_length=160)
    trainer = TreeFlexTrainer(model=model, reward_funcs=counter, args=args, train_dataset=arithmetic_dataset(1),
                              processing_class=tok, environment_factory=factory)
    script = TwoRoleScript(tok, reflect, first=[call] * 4, after=["Card: counted."] * 4)
    trainer.generation_engine = ScriptedEngine(script, [script.eos])
    trainer.log_completions = True
    batch = trainer.generate_batch([trainer.train_dataset[0]])
    assert seen == [1, 2]
    assert torch.allclose(torch.tensor(list(trainer._logs["advantages"])), torch.tensor([-0.5, 0.5]) / 0.5**0.5)
    assert trainer._logs["extra"]["blocks"][0].startswith("reflection:")
    assert torch.isfinite(trainer.compute_loss(trainer.model, batch))


# ---------------------------------------------------------------------------------------------------------------
# F1–F2 through the trainer
# ---------------------------------------------------------------------------------------------------------------


def _turn_texts(trainer, group):
    tok = trainer.processing_class
    return [_decode(tok, t.action_ids) for tree in group.trees for t in tree.turns]


def test_penalties_move_only_their_turn_and_not_the_baseline(tmp_path, scripted):
    """Same script with and without the −0.2 hook: only the hooked turn's advantage (and tokens' gradient) moves."""
    trainer, group, batch = scripted
    plain, plain_groups = _trainer(tmp_path)
    plain_batch = plain.generate_batch([plain.train_dataset[0]])
    assert _turn_texts(trainer, group) == _turn_texts(plain, plain_groups[0])
    n = group.num_turns
    A, A_plain = (TurnCredit.from_dict(b).A[0, :n].double() for b in (batch, plain_batch))
    hooked = (group.penalties != plain_groups[0].penalties).nonzero().flatten().tolist()
    assert len(hooked) == 1 and math.isclose(group.penalties[hooked[0]].item(), -0.2)
    divisor = math.sqrt(0.5)  # scores (1, 0): mean 1/2, sample std 1/√2, unchanged by any penalty
    others = [i for i in range(n) if i != hooked[0]]
    assert torch.equal(A[others], A_plain[others])
    assert math.isclose((A - A_plain)[hooked[0]].item(), -0.2 / divisor, rel_tol=1e-6)  # pre_norm: Q / divisor
    # by hand: A = (R_s + Q_i − 1/2) / (1/√2)
    expected = (group.scores[group.turn_search] + group.penalties - 0.5) / divisor
    assert torch.allclose(A, expected, atol=1e-6)

    # the per-token gradient of the trainer's loss at θ_old differs exactly on the hooked turn's tokens
    def token_grad(tr, b):
        from trl_tree.core.packing import PackedTrees

        packed = PackedTrees.from_dict(b)
        logps = b["old_logps"].clone().requires_grad_(True)
        flat = LossInputs.build(packed.turn_ids, logps, b["old_logps"], TurnCredit.from_dict(b))
        (g,) = torch.autograd.grad(tr.turn_loss(flat, "train"), logps)
        return g[packed.turn_ids >= 0], flat.turn_ids

    g, ids = token_grad(trainer, batch)
    g_plain, _ = token_grad(plain, plain_batch)
    moved = (g - g_plain).abs() > 0
    assert moved.any() and torch.equal(moved, ids == hooked[0])


@pytest.mark.parametrize("mode", ["pre_norm", "post_norm"])
def test_divisor_is_one_when_all_scores_are_equal(tmp_path, mode):
    trainer, groups = _trainer(tmp_path, reward=lambda completions, **kw: [1.0] * len(completions), penalty_mode=mode)
    batch = trainer.generate_batch([trainer.train_dataset[0]])
    group = groups[0]
    A = TurnCredit.from_dict(batch).A[0, : group.num_turns].double()
    assert torch.equal(group.penalties != 0, A != 0)  # no penalty: no advantage; penalties at their own scale
    assert torch.allclose(A, group.penalties, atol=1e-7) and (group.penalties == -1.0).sum() == 2


# ---------------------------------------------------------------------------------------------------------------
# Restored context gets no gradient
# ---------------------------------------------------------------------------------------------------------------


def test_restored_context_gets_no_gradient_through_the_packed_loss(scripted):
    """Gradient of the trainer's loss w.r.t. the final hidden states: the state at position p only scores token
    p + 1, so it is zero exactly where p + 1 is context (restored card, instruction, task, observations)."""
    trainer, group, batch = scripted
    tok = trainer.processing_class
    captured = {}

    def keep(module, args, output):
        output.last_hidden_state.retain_grad()
        captured["hidden"] = output.last_hidden_state

    handle = trainer.model.get_decoder().register_forward_hook(keep)
    try:
        trainer.model.zero_grad()
        trainer.compute_loss(trainer.model, batch).backward()
    finally:
        handle.remove()
    grad = captured["hidden"].grad.abs().sum(-1)  # [blocks, T]
    turn_ids = batch["turn_ids"][0, :, : grad.shape[1]]
    blocks = [b for s in group.searches for b in s.blocks if b.turns]
    for r, block in enumerate(blocks):
        ctx = len(block.context_ids)
        scores_trained = turn_ids[r, 1:] >= 0  # position p scores token p + 1
        assert (turn_ids[r, :ctx] == -1).all()  # the whole context is untrained, restored card included
        assert torch.equal(grad[r, :-1] > 0, scores_trained), r
        assert grad[r, : ctx - 1].sum() == 0
    # the restored card is inside the second segment's context
    second = blocks[2]
    assert "Restored checkpoint (node 1)" in _decode(tok, second.context_ids)


# ---------------------------------------------------------------------------------------------------------------
# F4 through the trainer's weights
# ---------------------------------------------------------------------------------------------------------------


# search 0: Reflection block 0 (turns of 2 and 1 tokens), Execution block 1 (3);
# search 1: Reflection block 2 (1), Execution block 3 (2, 2).
LENGTHS = torch.tensor([2.0, 1.0, 3.0, 1.0, 2.0, 2.0], dtype=torch.float64)
SEARCH, BLOCK, ROLE = torch.tensor([0, 0, 0, 1, 1, 1]), torch.tensor([0, 0, 1, 2, 3, 3]), torch.tensor([0, 0, 1, 0, 1, 1])
HAND = {
    "token": [1 / 11] * 6,  # 11 trained tokens
    "block": [1 / 12, 1 / 12, 1 / 12, 1 / 4, 1 / 16, 1 / 16],  # 4 blocks of 3, 3, 1, 4 tokens
    "rollout": [1 / 12] * 3 + [1 / 10] * 3,  # 2 searches of 6 and 5 tokens
    "role": [1 / 8, 1 / 8, 1 / 14, 1 / 8, 1 / 14, 1 / 14],  # Reflection 4 tokens, Execution 7
}


@pytest.mark.parametrize("mode", list(HAND))
def test_aggregation_weights_match_hand_numbers(mode):
    w = aggregation_weights(LENGTHS, SEARCH, BLOCK, ROLE, mode)
    assert torch.allclose(w, torch.tensor(HAND[mode], dtype=torch.float64), rtol=1e-12, atol=0)
    assert math.isclose(float((w * LENGTHS).sum()), 1.0, rel_tol=1e-12)
    mixed = aggregation_weights(LENGTHS, SEARCH, BLOCK, ROLE, mode, role_lambda=0.25)
    expected = 0.75 * torch.tensor(HAND[mode], dtype=torch.float64) + 0.25 * torch.tensor(HAND["role"]).double()
    assert torch.allclose(mixed, expected, rtol=1e-6, atol=0)


@pytest.mark.parametrize("mode", list(HAND))
@pytest.mark.parametrize("role_lambda", [0.0, 0.3])
def test_trainer_weights_realise_each_mode_over_the_group(scripted, mode, role_lambda):
    """The weights the trainer ships per turn turn Σ_t w l_t into `losses.aggregate` over the whole group, for the
    actual scripted group."""
    trainer, group, _ = scripted
    trainer.args.aggregation, trainer.args.role_lambda = mode, role_lambda
    try:
        w = trainer.turn_credit(group).w.double()
    finally:
        trainer.args.aggregation, trainer.args.role_lambda = "rollout", 0.0
    token_turn = torch.repeat_interleave(torch.arange(group.num_turns), group.lengths.long())
    per_token = torch.randn(token_turn.numel(), dtype=torch.float64, generator=torch.Generator().manual_seed(1))
    ours = (w[token_turn] * per_token).sum()
    ids = {"block_ids": group.turn_block[token_turn], "search_ids": group.turn_search[token_turn],
           "role_ids": group.turn_role[token_turn]}
    expected = losses.aggregate(per_token, torch.ones_like(per_token, dtype=torch.bool), **ids, mode=mode,
                                role_lambda=role_lambda)
    assert math.isclose(ours.item(), expected.item(), rel_tol=1e-6)
    # and the unit each mode equalises gets equal total weight
    unit = {"token": None, "block": group.turn_block, "rollout": group.turn_search, "role": group.turn_role}[mode]
    if unit is not None and role_lambda == 0.0:
        totals = torch.zeros(int(unit.max()) + 1, dtype=torch.float64).index_add_(0, unit, w * group.lengths)
        assert torch.allclose(totals, torch.full_like(totals, 1 / totals.numel()))


def test_loss_is_the_group_aggregate_and_exact_under_micro_batch_splitting(tmp_path):
    """Two tasks: the loss at θ_old is the mean over groups of aggregate(−A_t); each half of TRL's split is exactly
    its own group's aggregate (a group never straddles micro-batches)."""
    trainer, groups = _trainer(tmp_path, n_prompts=2, aggregation="block", steps_per_generation=2)
    tok = trainer.processing_class
    trainer.generation_engine = ScriptedEngine(_Doubled(tok), [tok.convert_tokens_to_ids("<|im_end|>")])
    batch = trainer.generate_batch([trainer.train_dataset[0], trainer.train_dataset[1]])

    def group_aggregate(group, A):
        token_turn = torch.repeat_interleave(torch.arange(group.num_turns), group.lengths.long())
        return losses.aggregate(-A[token_turn], torch.ones(token_turn.numel(), dtype=torch.bool),
                                block_ids=group.turn_block[token_turn], mode="block").item()

    A = TurnCredit.from_dict(batch).A
    expected = [group_aggregate(g, A[n, : g.num_turns].double()) for n, g in enumerate(groups)]
    with torch.no_grad():
        full = trainer.compute_loss(trainer.model, batch).item()
        halves = [trainer.compute_loss(trainer.model, half).item() for half in split_tensor_dict(batch, 2)]
    assert math.isclose(full, sum(expected) / 2, rel_tol=1e-5)
    assert all(math.isclose(h, e, rel_tol=1e-5) for h, e in zip(halves, expected))


def test_pi_old_is_recomputed_per_micro_batch_so_the_first_block_ratio_is_exactly_one(tmp_path):
    """Two groups of different lengths, one micro-batch each: each micro-batch's π_old comes from the same packed
    forward (same width) that the loss runs, so at θ_old every trained token's log-ratio is exactly 0 (why that matters:
    `trl_tree.core.pipeline.micro_batches`)."""
    trainer, groups = _trainer(tmp_path, n_prompts=2, steps_per_generation=2)
    tok = trainer.processing_class
    trainer.generation_engine = ScriptedEngine(_Doubled(tok), [tok.convert_tokens_to_ids("<|im_end|>")])
    long = {**trainer.train_dataset[1], "prompt": [{"role": "user", "content": "What is 1+1? " + "Think. " * 40}]}
    batches = trainer._generate_micro_batches([trainer.train_dataset[0], long], 2)
    assert len(batches) == 2 and all(b["input_ids"].shape[0] == 1 for b in batches)
    assert batches[0]["valid"].max() < batches[1]["valid"].max()  # a whole-batch forward would pad the first
    for batch in batches:
        packed = PackedTrees.from_dict(batch)
        with torch.no_grad():
            logps, _ = packed_token_logps(trainer.model, packed, temperature=trainer.temperature)
        trained = packed.turn_ids >= 0
        assert trained.any()
        assert torch.equal(logps[trained], batch["old_logps"][trained])


class _Doubled(TwoRoleScript):
    """The two-role script for two tasks in one batch (the second task replays the first one's replies)."""

    def __init__(self, tok):
        super().__init__(tok)
        self.reflect = {k: v * 2 for k, v in REFLECT.items()}
        self.first = EXECUTE_FIRST[:2] * 2 + EXECUTE_FIRST[2:] * 2
        self.after = EXECUTE_AFTER_TOOL[:2] * 2 + EXECUTE_AFTER_TOOL[2:] * 2


def test_blocks_pack_one_row_each_and_a_masked_truncated_turn_is_not_trained():
    def turn(n, **kw):
        return Turn(list(range(10, 10 + n)), [0.0] * n, [7], **kw)

    searches = [
        FlexSearch([FlexBlock([1, 2], [turn(2), turn(3, truncated=True)], REFLECTION),
                    FlexBlock([4], [], EXECUTION)], []),  # a block without turns trains nothing and is dropped
        FlexSearch([FlexBlock([1, 2, 3], [turn(1)], EXECUTION)], []),
    ]
    group = FlexGroup.build(searches, torch.tensor([1.0, 0.0]), (REFLECTION, EXECUTION), mask_truncated=True)
    packed = pack_groups([group], pad_token_id=0)
    assert packed.turn_ids.shape[:2] == (1, 2) and packed.valid.tolist() == [[2 + 3 + 4, 3 + 2]]
    for r, block in enumerate([searches[0].blocks[0], searches[1].blocks[0]]):
        assert packed.input_ids[0, r, : packed.valid[0, r]].tolist() == block.token_ids
    assert group.lengths.tolist() == [2.0, 0.0, 1.0] and group.turn_search.tolist() == [0, 0, 1]
    trained = packed.turn_ids[packed.turn_ids >= 0]
    assert trained.tolist() == [0, 0, 2]  # turn 1 (truncated) is context, turn 2 has its group-wide id
    w = aggregation_weights(group.lengths, group.turn_search, group.turn_block, group.turn_role, "token")
    assert torch.allclose(w * group.lengths, torch.tensor([2 / 3, 0.0, 1 / 3], dtype=torch.float64))


# ---------------------------------------------------------------------------------------------------------------
# A user harness plugs in
# ---------------------------------------------------------------------------------------------------------------


class NotesHarness:
    """The module docstring's example: one role; every block restarts from the task plus the last block's notes."""

    roles = ("agent",)

    def run(self, tasks, kit):
        K = kit.num_searches
        searches = [(task, FlexSearch(blocks=[], completion=[], env=task.env)) for task in tasks for _ in range(K)]
        contexts = [task.prompt_ids for task, _ in searches]
        for _ in range(kit.max_blocks):
            branches = [kit.branch(c, task.tools, s.env) for c, (task, s) in zip(contexts, searches)]
            kit.loop.run(branches)
            for i, (branch, (task, search)) in enumerate(zip(branches, searches)):
                search.blocks.append(FlexBlock.from_branch(branch, role="agent"))
                search.completion += branch.messages
                notes = branch.messages[-1]["content"]
                restart = task.prompt + [{"role": "user", "content": f"Your notes so far: {notes}"}]
                contexts[i] = kit.render(restart, list(task.tools.values()))
        return [[s for _, s in searches[i * K : (i + 1) * K]] for i in range(len(tasks))]


def test_a_user_harness_plugs_in_and_trains(tmp_path):
    model, tok = tiny()
    replies = {"": ["Notes: start.", "Notes: nothing.", "The answer is 2.", "I do not know."]}
    from tests.scripted import scripted_engine

    args = config(TreeFlexConfig, tmp_path, num_searches=2, max_blocks=2, max_completion_length=64)
    trainer = TreeFlexTrainer(model=model, reward_funcs=contains_answer, args=args, harness=NotesHarness(),
                              train_dataset=arithmetic_dataset(1), processing_class=tok, tools=[calculator])
    trainer.generation_engine = scripted_engine(tok, replies)
    batch = trainer.generate_batch([trainer.train_dataset[0]])
    assert batch["valid"].shape == (1, 4)  # 2 searches × 2 blocks, one row each
    second_context = tok.decode(batch["input_ids"][0, 1, : int(batch["valid"][0, 1])])
    assert "Your notes so far: Notes: start." in second_context
    assert torch.equal(TurnCredit.from_dict(batch).role[0, :4], torch.zeros(4, dtype=torch.long))
    assert torch.isfinite(trainer.compute_loss(trainer.model, batch))


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        ({"num_searches": 1}, "num_searches"),
        ({"aggregation": "search"}, "aggregation must be one of"),
        ({"penalty_mode": "both"}, "penalty_mode must be one of"),
        ({"role_lambda": 1.5}, "role_lambda"),
        ({"dual_clip_c": 1.0}, "dual_clip_c must exceed 1"),
        ({"loss": "treeopsd"}, "fixed"),
        ({"sampler": "init_expand"}, "sampler must be one of"),
        ({"tool_failure_penalty": 1.0}, "Q ≤ 0"),
        ({"max_blocks": 0}, "max_blocks"),
    ],
)
def test_invalid_treeflex_configuration_is_rejected(tmp_path, overrides, message):
    with pytest.raises(ValueError, match=message):
        config(TreeFlexConfig, tmp_path, **overrides)
