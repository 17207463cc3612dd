"""Stateful environments that cannot be copied (remote sessions) still branch, by replay; nothing is copied when
nothing branches; instances are pooled across batches as GRPOTrainer pools them (`environment_branching`)."""

import copy
import itertools

import pytest
from transformers import TrainerCallback

from tests.remote_env import RemoteCounterEnv, SessionServer, TicketEnv
from tests.scripted import arithmetic_dataset, config, tiny, tool_call, unchanged_after_training
from trl_tree import TreeOPSDConfig, TreeOPSDTrainer
from trl_tree.rollout.engine import ScriptedEngine
from trl_tree.rollout.env import EnvironmentPool, RecordedCall, ReplayDivergenceWarning, TreeEnvironment, run_tool_call


@pytest.fixture
def server():
    with SessionServer() as s:
        yield s


def _calling_script(tok, tool: str, calls: int = 3, **arguments):
    """A policy that calls `tool` until `calls` tool responses are in its history, then says it is done. `add` gets
    a new amount at every call, so every branch's world differs from its parent's after the anchor."""
    eos = tok.convert_tokens_to_ids("<|im_end|>")
    amounts = itertools.count(1)
    done = tok.encode("Done.", add_special_tokens=False)

    def script(prefix):
        if tok.decode(prefix).count("<tool_response>") >= calls:
            return done + [eos]
        args = {"amount": next(amounts)} if tool == "add" else arguments
        return tok.encode(tool_call(tool, **args), add_special_tokens=False) + [eos]

    return ScriptedEngine(script, [eos])


def _trainer(tmp_path, factory, tool="add", reward=None, **overrides):
    model, tok = tiny()
    fields = dict(num_initial_rollouts=2, num_branches=2, max_turns=5, max_completion_length=300)
    fields.update(overrides)
    args = config(TreeOPSDConfig, tmp_path, **fields)
    reward = reward or (lambda completions, environments, **kw: [float(e.n) for e in environments])
    trainer = TreeOPSDTrainer(model=model, reward_funcs=reward, args=args, train_dataset=arithmetic_dataset(1),
                              processing_class=tok, environment_factory=factory)
    trainer.generation_engine = _calling_script(tok, tool)
    return trainer


def _capture_branches(trainer) -> list:
    """Keep every finished branch the sampler returns."""
    seen, sample = [], trainer.sampler.sample

    def spy(roots):
        out = sample(roots)
        seen.extend(b for per_tree in out for b in per_tree)
        return out

    trainer.sampler.sample = spy
    return seen


def _tool_history(messages) -> list[tuple[str, dict, str]]:
    """(tool name, arguments, output) of every tool call in a trajectory's messages, in order."""
    calls = [c["function"] for m in messages if m["role"] == "assistant" for c in m.get("tool_calls") or []]
    outputs = [m["content"] for m in messages if m["role"] == "tool"]
    return [(c["name"], c["arguments"], out) for c, out in zip(calls, outputs, strict=True)]


ENTROPY_GUIDED = dict(sampler="entropy_guided", expansion_mode="random", expansion_rounds=1, branches_per_round=2)


@pytest.mark.parametrize("branching, sampler", [("auto", {}), ("replay", {}), ("auto", ENTROPY_GUIDED)])
def test_remote_session_environment_branches_by_replay_and_trains(tmp_path, server, branching, sampler, caplog):
    finals = []

    def counter(completions, environments, **kwargs):
        finals.extend(e.n for e in environments)  # the server's state of each leaf's own session
        return [float(n) for n in finals[-len(environments):]]

    trainer = _trainer(tmp_path, server.factory(RemoteCounterEnv), reward=counter, environment_branching=branching,
                       **sampler)
    branches = _capture_branches(trainer)
    with caplog.at_level("WARNING", logger="trl_tree.rollout.env"):
        assert unchanged_after_training(trainer) == []  # distinct final counters: non-zero advantages, a real update
    fallbacks = [r for r in caplog.records if "its branches are rebuilt by replay" in r.getMessage()]
    assert len(fallbacks) == (1 if branching == "auto" else 0)  # auto says once that it could not copy
    with pytest.raises(TypeError, match="socket"):
        copy.deepcopy(trainer.environment_pool.instances[None][0])  # a connected client: why replay is needed

    assert len(branches) == trainer.args.leaves_per_tree == len(finals)
    assert all(s is None for b in branches for s in b.snapshots)  # nothing could be copied, nothing was kept
    initial, expansions = branches[:2], branches[2:]
    # expansions restarted after turn ≥ 1 of their trajectory inherit its turns (and its recorded calls); with
    # init_expand all of them do (T = 4, anchors in 1..3)
    inherited = [any(b.turns[0] is a.turns[0] for a in initial) for b in expansions]
    assert all(inherited) if not sampler else any(inherited)
    for branch, final in zip(branches, finals):
        history = _tool_history(branch.messages)
        assert len(history) == 3
        fresh = RemoteCounterEnv(server.address)  # a fresh sequential run of this branch's history
        fresh.reset()
        assert [getattr(fresh, name)(**arguments) for name, arguments, _ in history] == [o for *_, o in history]
        assert final == fresh.n == int(history[-1][2])
        fresh._close()


@pytest.mark.parametrize("overrides", [dict(num_branches=0), dict(sampler="flat"),
                                       dict(environment_branching="replay", num_branches=2)])
def test_no_fork_or_copy_when_nothing_branches_or_branches_replay(tmp_path, overrides):
    copies = []

    class CopyCountingEnv:
        def __init__(self):
            self.n = 0

        def reset(self, **kwargs):
            self.n = 0

        def add(self, amount: int) -> str:
            """Adds an amount to the counter.

            Args:
                amount: how much to add.

            Returns:
                The counter's new value.
            """
            self.n += amount
            return str(self.n)

        def fork(self):
            copies.append("fork")
            other = CopyCountingEnv()
            other.n = self.n
            return other

        def __deepcopy__(self, memo):
            copies.append("deepcopy")
            return self.fork()

    trainer = _trainer(tmp_path, CopyCountingEnv, **overrides)
    trainer.generate_batch([trainer.train_dataset[0]])
    assert copies == []


def test_the_pool_is_reused_across_batches_and_reset_with_the_row(tmp_path, server):
    sizes, resets = [], []

    class RowRecordingEnv(RemoteCounterEnv):
        def reset(self, **kwargs):
            resets.append(kwargs)
            super().reset(**kwargs)

    class Sizes(TrainerCallback):
        def on_step_end(self, args, state, control, **kwargs):
            sizes.append((trainer.environment_pool.size(), server.created))

    trainer = _trainer(tmp_path, server.factory(RowRecordingEnv), max_steps=3)
    trainer.add_callback(Sizes())
    trainer.train()
    assert len(sizes) == 3
    assert sizes[0] == sizes[1] == sizes[2]  # no new instances after the first batch
    assert sizes[0][0] == sizes[0][1]  # every instance built is a pool instance (GRPOTrainer's probe included)
    assert resets and all(r["answer"] == "2" and r["prompt"][0]["content"] == "What is 1+1?" for r in resets)


def test_fork_and_copy_modes_say_what_to_do_with_a_remote_session(tmp_path, server):
    with pytest.raises(ValueError, match=r"environment_branching='fork', but RemoteCounterEnv has no fork\(\)"):
        _trainer(tmp_path, server.factory(RemoteCounterEnv), environment_branching="fork")
    trainer = _trainer(tmp_path, server.factory(RemoteCounterEnv), environment_branching="copy")
    with pytest.raises(TypeError, match=r"environment_branching='copy', but copy.deepcopy of RemoteCounterEnv failed"):
        trainer.generate_batch([trainer.train_dataset[0]])


def test_a_non_deterministic_environment_warns_when_replay_diverges(tmp_path, server):
    trainer = _trainer(tmp_path, server.factory(TicketEnv), tool="take_ticket",
                       reward=lambda completions, **kw: [0.0] * len(completions))
    with pytest.warns(ReplayDivergenceWarning, match=r"Replaying tool 'take_ticket' \(call of turn \d\) on a fresh "
                                                     r"TicketEnv gave '\d+', but the branch recorded '\d+'"):
        trainer.generate_batch([trainer.train_dataset[0]])


def test_environment_branching_is_validated(tmp_path):
    with pytest.raises(ValueError, match="environment_branching must be one of"):
        config(TreeOPSDConfig, tmp_path, environment_branching="snapshot")


def test_replay_reruns_only_the_environments_own_tools_in_order(server):
    """Standalone tools (stateless) and calls that named no tool of the environment are not re-run."""
    pool = EnvironmentPool({None: server.factory(RemoteCounterEnv)}, branching="replay")

    def run_call(call, tools):
        return run_tool_call(call, tools, timeout=5, max_chars=None)

    tree = TreeEnvironment(pool, None, {}, run_call)
    tree.start()

    def call(name, **arguments):
        return {"type": "function", "function": {"name": name, "arguments": arguments}}

    recorded = [RecordedCall(0, call("add", amount=2), "2", False), RecordedCall(1, call("calculator", x="1"), "1", False),
                RecordedCall(1, call("add", amount=3), "5", False), RecordedCall(2, call("nope"), "Error", True)]
    assert tree.snapshot(tree.start()) is None  # replay takes no snapshots
    assert tree.at(None, recorded).n == 5
    assert pool.size() == 3
    pool.release()
    assert tree.start().n == 0 and pool.size() == 3  # released instances are reused, reset


def test_a_reset_that_differs_from_the_roots_is_warned_about():
    class Drifting:
        resets = 0

        def reset(self, **kwargs):
            Drifting.resets += 1
            return f"puzzle {Drifting.resets}"

    tree = TreeEnvironment(EnvironmentPool({None: Drifting}), None, {"prompt": "p"}, run_call=None)
    tree.start()
    assert tree.reset_observation == "puzzle 1"
    with pytest.warns(ReplayDivergenceWarning, match="reset returned a different observation for the same row"):
        tree.start()
