"""TreeOPSD / TreePO trainers on scripted generations: a known tree, checked against values computed by hand."""

import math

import pytest
import torch

from tests.scripted import (
    AFTER_TOOL,
    CALL_1_PLUS_1,
    REPLIES,
    CounterEnv,
    arithmetic_dataset,
    config,
    contains_answer,
    scripted_engine,
    scripted_trainer,
    tiny,
    unchanged_after_training,
)
from trl_tree import TreeOPSDConfig, TreeOPSDTrainer, TreePOConfig, TreePOTrainer
from trl_tree.core.batch import TurnCredit
from trl_tree.rollout.growing.turn_loop import SamplerSettings
from trl_tree.testing import calculator


def _trainer(cls, config_cls, tmp_path, n_prompts=1, replies=REPLIES, **overrides):
    return scripted_trainer(cls, config_cls, tmp_path, replies, dataset=arithmetic_dataset(n_prompts), **overrides)


def _path_logp_sums(model, tree):
    """log π_old(a | h) of every unique turn, from an ordinary causal forward of each root-to-leaf path."""
    sums = {}
    for k, path in enumerate(tree.paths):
        ids = torch.tensor([tree.path_token_ids(k)])
        with torch.no_grad():
            logp = model(ids).logits[0, :-1].log_softmax(-1).gather(-1, ids[0, 1:, None])[:, 0]
        pos = len(tree.prompt_ids)
        for i in path:
            turn = tree.turns[i]
            sums[i] = logp[pos - 1 : pos - 1 + len(turn.action_ids)].sum().item()
            pos += len(turn.action_ids) + len(turn.observation_ids)
    return sums


def test_scripted_tree_rewards_credit_teacher_and_loss(tmp_path):
    trainer = _trainer(TreeOPSDTrainer, TreeOPSDConfig, tmp_path, target_radius=0.25)
    tok = trainer.processing_class
    captured = {}
    original = TreeOPSDTrainer.turn_credit

    def spy(self, tree):
        captured["tree"] = tree
        return original(self, tree)

    trainer.turn_credit = spy.__get__(trainer)
    inputs = [trainer.train_dataset[0]]
    batch = trainer.generate_batch(inputs)
    tree = captured["tree"]

    # the tree: K = 4 leaves, 4 unique turns (call, "answer 2" ×2, "answer 3", "give up")
    assert tree.num_leaves == 4 and tree.num_turns == 4
    assert tree.rewards == [1.0, 0.0, 0.0, 1.0]
    texts = {i: tok.decode(t.action_ids) for i, t in enumerate(tree.turns)}
    call = next(i for i, s in texts.items() if "<tool_call>" in s)
    two = next(i for i, s in texts.items() if "answer is 2" in s)
    three = next(i for i, s in texts.items() if "answer is 3" in s)
    give_up = next(i for i, s in texts.items() if "do not know" in s)
    assert tree.turns[two].multiplicity == 2 and tree.turns[two].parent == call == tree.turns[three].parent
    # token-in, token-out: the history is prompt + generated ids + observation ids, never re-tokenised; the
    # observation is exactly the chat template's rendering of the tool message and the next assistant header
    messages = [*inputs[0]["prompt"], {"role": "assistant", "content": "", "tool_calls": [
        {"type": "function", "function": {"name": "calculator", "arguments": {"expression": "1+1"}}}]},
        {"role": "tool", "name": "calculator", "content": "2"}]
    rendered = tok.apply_chat_template(messages, tools=[calculator], chat_template=trainer.chat_template,
                                       add_generation_prompt=True, tokenize=True, return_dict=False)
    turn = tree.turns[call]
    assert list(rendered)[-len(turn.observation_ids) :] == turn.observation_ids
    assert "<tool_response>\n2\n</tool_response>" in tok.decode(turn.observation_ids)
    assert tree.path_token_ids(0)[: len(tree.prompt_ids) + len(turn.action_ids)] == tree.prompt_ids + turn.action_ids

    # credit by hand: rewards (1, 0, 0, 1) → A = ±(1/2)/sqrt(1/3); V(call) = softmax(log π(2), log π(3)) · (A+, A−)
    a = 0.5 / math.sqrt(1 / 3)
    logp = _path_logp_sums(trainer.model, tree)
    w2 = 1 / (1 + math.exp(logp[three] - logp[two]))
    V = {two: a, three: -a, give_up: -a, call: w2 * a - (1 - w2) * a}
    tau = 3 / (0.25 * 2)
    q = TurnCredit.from_dict(batch).q[0]
    for i, v in V.items():
        assert math.isclose(TurnCredit.from_dict(batch).A[0, i].item(), v, abs_tol=1e-5)
        assert math.isclose(q[i].item(), 0.5 + v / tau, abs_tol=1e-6)
    assert math.isclose(TurnCredit.from_dict(batch).tau[0].item(), tau, rel_tol=1e-6)

    # first block: s = 0 exactly, so the loss is (τ/L_x) Σ L_i KL(Ber(q_i) ‖ Ber(1/2))
    loss = trainer.compute_loss(trainer.model, batch)
    L = {i: len(tree.turns[i].action_ids) for i in V}
    kl = {i: q[i].item() * math.log(2 * q[i].item()) + (1 - q[i].item()) * math.log(2 * (1 - q[i].item())) for i in V}
    expected = tau / sum(L.values()) * sum(L[i] * kl[i] for i in V)
    assert math.isclose(loss.item(), expected, rel_tol=1e-4)


def _params(model):
    return {n: p.detach().clone() for n, p in model.named_parameters() if p.requires_grad}


def test_a_trajectory_is_expanded_as_soon_as_it_ends_alongside_those_still_running(tmp_path):
    """τ2 ends after one turn, τ1 after two: τ2's continuation is sampled in the same engine call as τ1's second
    turn, so the tree takes 3 calls of 2 rows, where expanding after all M trajectories took 4 (2, 1, 2, 1 rows)."""
    trainer = _trainer(TreeOPSDTrainer, TreeOPSDConfig, tmp_path)
    rows = []
    generate = trainer.generation_engine.generate
    trainer.generation_engine.generate = lambda prefixes, budgets: rows.append(len(prefixes)) or generate(
        prefixes, budgets)
    captured = {}
    original = trainer.turn_credit
    trainer.turn_credit = lambda tree: captured.setdefault("tree", tree) and original(tree)
    trainer.generate_batch([trainer.train_dataset[0]])
    assert rows == [2, 2, 2]
    assert captured["tree"].rewards == [1.0, 0.0, 0.0, 1.0]  # the tree of the hand-computed test above


@pytest.mark.parametrize("blocks", [2])
def test_theorem_2_treeopsd_and_treepo_share_the_first_update_and_differ_later(tmp_path, blocks):
    replies = {k: v * 2 for k, v in REPLIES.items()}  # two prompts, same script each
    updates = {}
    for cls, cfg in [(TreeOPSDTrainer, TreeOPSDConfig), (TreePOTrainer, TreePOConfig)]:
        trainer = _trainer(cls, cfg, tmp_path / cls.__name__, n_prompts=2, replies=replies,
                           steps_per_generation=blocks, max_steps=blocks, learning_rate=5e-2,
                           optim="sgd", lr_scheduler_type="constant")
        start = _params(trainer.model)
        snapshots = []
        trainer.add_callback(_Snapshot(snapshots))
        trainer.train()
        updates[cls.__name__] = [start, *snapshots]
    opsd, po = updates["TreeOPSDTrainer"], updates["TreePOTrainer"]
    first = max((opsd[1][n] - po[1][n]).abs().max().item() for n in opsd[0])
    moved = max((opsd[1][n] - opsd[0][n]).abs().max().item() for n in opsd[0])
    second = max(((opsd[2][n] - opsd[1][n]) - (po[2][n] - po[1][n])).abs().max().item() for n in opsd[0])
    assert moved > 1e-4  # the first block did move the parameters ...
    assert first <= 1e-6  # ... identically for both methods (the tangent at θ_old is the tree policy gradient)
    assert second > 1e-5  # later blocks differ: TreeOPSD's residual τ(q − p) is no longer V


class _Snapshot:
    """Records the trainable parameters after every optimizer step."""

    def __init__(self, out):
        self.out = out

    def __getattr__(self, name):
        if name.startswith("on_"):
            return lambda *a, **k: None
        raise AttributeError(name)

    def on_step_end(self, args, state, control, model=None, **kwargs):
        self.out.append(_params(model))


def test_stateful_environment_branches_see_the_state_at_their_anchor(tmp_path):
    model, tok = tiny()
    eos = tok.convert_tokens_to_ids("<|im_end|>")
    call = tok.encode('<tool_call>\n{"name": "increment", "arguments": {}}\n</tool_call>', add_special_tokens=False)
    done = tok.encode("Done.", add_special_tokens=False)

    def script(prefix):  # call increment until three tool responses are in the history, then stop
        return (call if tok.decode(prefix).count("<tool_response>") < 3 else done) + [eos]

    seen = []

    def counter_reward(completions, environments, **kwargs):
        seen.append([[m["content"] for m in c if m["role"] == "tool"] for c in completions])
        return [float(e.n) for e in environments]

    from trl_tree.testing import ScriptedEngine

    args = config(TreeOPSDConfig, tmp_path, num_initial_rollouts=1, num_branches=3, max_turns=5,
                  max_completion_length=300)
    trainer = TreeOPSDTrainer(model=model, reward_funcs=counter_reward, args=args,
                              train_dataset=arithmetic_dataset(1), processing_class=tok, environment_factory=CounterEnv)
    trainer.generation_engine = ScriptedEngine(script, [eos])
    before = trainer.environments
    batch = trainer.generate_batch([trainer.train_dataset[0]])
    # every leaf (the original and three branches from turns 1..3) counted 1, 2, 3 on its own copy of the world
    assert seen[0] == [["1", "2", "3"]] * 4
    # the leaves' environments went to the reward computation with their rows, not onto the trainer
    assert trainer.environments is before
    # all-equal rewards: zero advantages, q = 1/2 everywhere, a finite loss
    credit = TurnCredit.from_dict(batch)
    assert torch.equal(credit.q[0, : int(credit.count[0])], torch.full((4,), 0.5))
    assert torch.isfinite(trainer.compute_loss(trainer.model, batch))


def boom(x: str) -> str:
    """Always fails.

    Args:
        x: anything
    """
    raise RuntimeError("service unavailable")


def test_failing_and_malformed_tool_calls_become_observations_and_are_counted(tmp_path):
    replies = {
        "<|im_start|>assistant\n": ['<tool_call>\n{"name": "boom", "arguments": {"x": "1"}}\n</tool_call>'] * 2,
        AFTER_TOOL: ["<tool_call>{oops</tool_call>"] * 2
        + ["The answer is 2."] * 2,
    }
    model, tok = tiny()
    args = config(TreeOPSDConfig, tmp_path, num_initial_rollouts=2, num_branches=0, max_turns=4,
                  max_completion_length=300, malformed_tool_calls="observe")  # the model may repair the call
    trainer = TreeOPSDTrainer(model=model, reward_funcs=contains_answer, args=args,
                              train_dataset=arithmetic_dataset(1), processing_class=tok, tools=[calculator, boom])
    trainer.generation_engine = scripted_engine(tok, replies)
    trainer.model.train()
    trainer.generate_batch([trainer.train_dataset[0]])
    metrics = trainer._metrics["train"]
    assert metrics["tools/failure_frequency"] == [1.0] and metrics["tools/call_frequency"] == [2.0]
    assert metrics["reward"] == [1.0]


def test_malformed_tool_call_ends_the_trajectory_by_default_as_in_trl(tmp_path):
    """The default `malformed_tool_calls="end"` is TRL's loop: the unparseable call is the final turn, still scored
    and counted (GRPOTrainer's tool loop finds no parsed call and ends the completion)."""
    replies = {
        "<|im_start|>assistant\n": ["<tool_call>{oops</tool_call>"] * 2,
        AFTER_TOOL: ["The answer is 2."] * 2,
    }
    model, tok = tiny()
    args = config(TreeOPSDConfig, tmp_path, num_initial_rollouts=2, num_branches=0, max_turns=4,
                  max_completion_length=300)
    assert args.malformed_tool_calls == SamplerSettings(max_turns=1, max_completion_length=8).malformed_tool_calls == "end"
    trainer = TreeOPSDTrainer(model=model, reward_funcs=contains_answer, args=args,
                              train_dataset=arithmetic_dataset(1), processing_class=tok, tools=[calculator])
    trainer.generation_engine = scripted_engine(tok, replies)
    trainer.model.train()
    trainer.generate_batch([trainer.train_dataset[0]])
    metrics = trainer._metrics["train"]
    assert metrics["tree/turns_per_leaf"] == [1.0]  # the malformed turn is terminal: no observation, no answer
    assert metrics["tools/failure_frequency"] == [1.0] and metrics["tools/call_frequency"] == [1.0]
    assert metrics["reward"] == [0.0]


@pytest.mark.parametrize(
    ("reward", "error", "message"),
    [
        (lambda completions, **kw: [1 / ("3" not in c[-1]["content"]) for c in completions], RuntimeError,
         r"Reward function '<lambda>' raised ZeroDivisionError: .* on sample 2"),
        (lambda completions, **kw: [float("inf") if "3" in c[-1]["content"] else 1.0 for c in completions],
         ValueError, r"Reward function '<lambda>' returned inf for sample 2"),
    ],
)
def test_a_reward_function_that_raises_or_returns_inf_is_named_with_the_sample(tmp_path, reward, error, message):
    model, tok = tiny()
    trainer = TreeOPSDTrainer(model=model, reward_funcs=reward, args=config(TreeOPSDConfig, tmp_path),
                              train_dataset=arithmetic_dataset(1), processing_class=tok, tools=[calculator])
    trainer.generation_engine = scripted_engine(tok, REPLIES)
    with pytest.raises(error, match=message):
        trainer.generate_batch([trainer.train_dataset[0]])


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        ({"num_initial_rollouts": 0}, "num_initial_rollouts"),
        ({"num_branches": -1}, "num_branches"),
        ({"num_initial_rollouts": 1, "num_branches": 0}, "K ≥ 2 leaves"),
        ({"loss": "treeopsd", "reward_std": "population"}, "needs reward_std=.sample."),
        ({"sampler": "beam"}, "sampler must be one of"),
        ({"loss": "ppo"}, "loss must be one of"),
        ({"target_radius": 0.5}, "0 < ρ < 1/2"),
        ({"target_radius": 0.0}, "0 < ρ < 1/2"),
        ({"num_iterations": 2}, "steps_per_generation = E × gradient_accumulation_steps"),
        ({"beta": 0.04}, "beta=0.0"),
        ({"num_generations": 8}, r"num_initial_rollouts=2 costs 3\. Settings that give G = 8: num_initial_rollouts=5, num_branches=1; "
                               r"num_initial_rollouts=8, num_branches=0"),
        ({"packing": "flat"}, "packing must be one of"),
        ({"malformed_tool_calls": "retry"}, "malformed_tool_calls must be one of"),
        ({"max_turn_tokens": 0}, "max_turn_tokens must be a positive whole number"),
        ({"steps_per_generation": 3, "gradient_accumulation_steps": 2}, "multiple of gradient_accumulation_steps"),
    ],
)
def test_invalid_configuration_is_rejected_with_advice(tmp_path, overrides, message):
    with pytest.raises(ValueError, match=message):
        config(TreeOPSDConfig, tmp_path, **overrides)


def test_log_completions_shows_each_tree_as_text_with_its_rewards(tmp_path):
    trainer = _trainer(TreeOPSDTrainer, TreeOPSDConfig, tmp_path, log_completions=True)
    trainer.generate_batch([trainer.train_dataset[0]])
    trees = [t for t in trainer._logs["extra"]["tree"] if t.startswith("prompt")]
    assert len(trees) == 1 and "K=4" in trees[0] and "rewards: 1 0 0 1" in trees[0] and "×2" in trees[0]
    assert list(trainer._logs["rewards"]["contains_answer"]) == [1.0, 0.0, 0.0, 1.0]
    assert len(trainer._logs["completion"]) == 4


def test_a_budget_cut_trajectory_is_scored_and_its_truncated_turn_can_be_masked(tmp_path):
    long_answer = "The answer is 2. " + "blah " * 200
    replies = {
        "<|im_start|>assistant\n": [CALL_1_PLUS_1, "I do not know.", CALL_1_PLUS_1],
        AFTER_TOOL: [long_answer, "The answer is 3.", long_answer],
    }
    trainer = _trainer(TreeOPSDTrainer, TreeOPSDConfig, tmp_path, replies=replies, max_completion_length=80,
                       mask_truncated_completions=True)
    captured = {}
    original = trainer.turn_credit
    trainer.turn_credit = lambda tree: captured.setdefault("tree", tree) and original(tree)
    batch = trainer.generate_batch([trainer.train_dataset[0]])
    tree = captured["tree"]
    truncated = [i for i, t in enumerate(tree.turns) if t.truncated]
    assert truncated and tree.rewards[0] == 1.0  # cut by the budget, still scored ("The answer is 2." was said)
    assert not torch.isin(batch["turn_ids"], torch.tensor(truncated)).any()  # ... but not trained


def test_every_rank_issues_the_same_number_of_generate_calls():
    """A rank whose branches are done keeps calling the engine (with nothing) while another rank still works."""
    from trl_tree.rollout.growing.turn_loop import Branch, SamplerSettings, TurnLoop, TurnLoopPorts
    from trl_tree.testing import ScriptedEngine

    engine = ScriptedEngine(lambda prefix: [7, 2], eos_ids=[2])
    other_rank_rounds = iter([True, True, False])  # the other rank still works in rounds 2 and 3
    ports = TurnLoopPorts(engine, parse=lambda ids, prefix: {"role": "assistant", "content": "done"},
                          observation_ids=lambda msgs: [], any_active=lambda local: local or next(other_rank_rounds))
    loop = TurnLoop(ports, SamplerSettings(max_turns=3, max_completion_length=10))
    branch = Branch(tree=0, prefix_ids=[1], prompt_len=1)
    loop.run([branch])
    assert branch.done and len(branch.turns) == 1
    assert engine.calls == 3  # one real call, then two empty ones to match the other rank


def test_the_turn_loop_takes_what_it_needs_of_its_owner_as_one_checked_port():
    """The engine, action parsing, observation ids, the rank vote and the metrics come as one `TurnLoopPorts`, each
    checked where the port is built: a loop built the old way (the engine first) or a port with a part that cannot be
    called is refused with what to pass, not met as an AttributeError mid-rollout."""
    from trl_tree.rollout.growing.turn_loop import TurnLoop, TurnLoopPorts
    from trl_tree.testing import ScriptedEngine

    engine = ScriptedEngine(lambda prefix: [7, 2], eos_ids=[2])
    settings = SamplerSettings(max_turns=1, max_completion_length=4)
    with pytest.raises(TypeError, match=r"TurnLoop takes its owner's ports as one TurnLoopPorts\(engine=.*got "
                                        "ScriptedEngine for the ports"):
        TurnLoop(engine, settings)
    with pytest.raises(TypeError, match=r"TurnLoopPorts.engine must be a generation backend with `generate.*got "
                                        "function"):
        TurnLoopPorts(lambda prefixes, budgets: [], parse=lambda ids, prefix: {}, observation_ids=lambda m: [])
    with pytest.raises(TypeError, match="TurnLoopPorts.observation_ids must be callable; got list"):
        TurnLoopPorts(engine, parse=lambda ids, prefix: {}, observation_ids=[9])


def test_max_turn_tokens_caps_each_sampled_turn_and_the_cut_turn_ends_the_trajectory(tmp_path):
    """A rambling answer is cut at `max_turn_tokens` although the trajectory's budget has room; like a budget cut,
    the cut turn is terminal, still scored, and masked from the loss with mask_truncated_completions."""
    long_answer = "The answer is 2. " + "blah " * 200
    replies = {
        "<|im_start|>assistant\n": [CALL_1_PLUS_1] * 4,
        AFTER_TOOL: [long_answer, "The answer is 3."] * 2,
    }
    trainer = _trainer(TreeOPSDTrainer, TreeOPSDConfig, tmp_path, replies=replies, max_completion_length=1000,
                       max_turn_tokens=24, mask_truncated_completions=True)
    requested = []
    generate = trainer.generation_engine.generate
    trainer.generation_engine.generate = lambda prefixes, budgets: requested.extend(budgets) or generate(
        prefixes, budgets)
    captured = {}
    original = trainer.turn_credit
    trainer.turn_credit = lambda tree: captured.setdefault("tree", tree) and original(tree)
    batch = trainer.generate_batch([trainer.train_dataset[0]])
    tree = captured["tree"]
    assert requested and max(requested) <= 24
    truncated = [i for i, t in enumerate(tree.turns) if t.truncated]
    assert truncated and all(len(tree.turns[i].action_ids) == 24 for i in truncated)
    assert all(len(t.action_ids) <= 24 for t in tree.turns)
    assert 1.0 in tree.rewards  # "The answer is 2." fits in the cut turn and is scored
    assert not torch.isin(batch["turn_ids"], torch.tensor(truncated)).any()


def test_turn_cap_counts_the_head_a_mid_turn_branch_already_has():
    """A branch resumed inside a turn (token-level branching) has part of the turn already: the cap is the turn's."""
    from trl_tree.core.tree import Turn
    from trl_tree.rollout.growing.turn_loop import Branch, SamplerSettings, TurnLoop, TurnLoopPorts
    from trl_tree.testing import ScriptedEngine

    engine = ScriptedEngine(lambda prefix: [7] * 50 + [2], eos_ids=[2])
    loop = TurnLoop(TurnLoopPorts(engine, parse=lambda ids, prefix: {"role": "assistant", "content": "x"},
                                  observation_ids=lambda msgs: []),
                    SamplerSettings(max_turns=2, max_completion_length=100, max_turn_tokens=10))
    head = Turn([7, 7, 7], [0.0] * 3, [])
    resumed = Branch(tree=0, prefix_ids=[1, 7, 7, 7], prompt_len=1, pending=head)
    fresh = Branch(tree=0, prefix_ids=[1], prompt_len=1)
    loop.run([resumed, fresh])
    assert [len(b.turns[0].action_ids) for b in (resumed, fresh)] == [10, 10]
    assert resumed.turns[0].truncated and fresh.turns[0].truncated


@pytest.mark.parametrize("loss", ["treeopsd", "atpo"])
def test_a_turn_of_zero_tokens_is_an_empty_action_that_ends_its_trajectory(tmp_path, loss):
    """A backend that returns no token for a turn (TRL's response parser fails on an empty completion): the turn is
    an empty action, the trajectory ends there and its leaf is scored like any other; training goes on."""
    from trl_tree import TreeConfig
    from trl_tree.testing import ScriptedEngine
    from trl_tree.trainer.base import TreeTrainer

    model, tok = tiny()
    eos = tok.convert_tokens_to_ids("<|im_end|>")
    answer = tok.encode("The answer is 2.", add_special_tokens=False) + [eos]
    replies = iter([[]] + [answer] * 20)  # the first trajectory's first turn: nothing at all
    args = config(TreeConfig, tmp_path, loss=loss, reward_std="population" if loss == "atpo" else "sample")
    trainer = TreeTrainer(model=model, reward_funcs=contains_answer, args=args, train_dataset=arithmetic_dataset(1),
                          processing_class=tok, tools=[calculator])
    trainer.generation_engine = ScriptedEngine(lambda prefix: next(replies), eos_ids=[eos])
    captured = {}
    original = trainer._score_leaves

    def spy(inputs, prompts, branches_per_tree):
        captured["branches"] = branches_per_tree[0]
        captured["scores"] = original(inputs, prompts, branches_per_tree)
        return captured["scores"]

    trainer._score_leaves = spy
    assert unchanged_after_training(trainer) == []
    branches = captured["branches"]
    empty = [b for b in branches if not b.turns[-1].action_ids]
    assert len(empty) == 1 and len(empty[0].turns) == 1 and empty[0].done
    assert empty[0].messages == [{"role": "assistant", "content": ""}]
    assert captured["scores"].per_func[:, 0].tolist() == [0.0, 1.0, 1.0, 1.0]  # the empty leaf: scored, 0
    assert all(math.isfinite(v) for log in trainer.state.log_history for k, v in log.items() if k == "loss")
