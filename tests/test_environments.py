"""Stateful environments that cannot be copied (remote sessions) still branch, by replay; nothing is copied when
nothing branches; instances are pooled across batches as GRPOTrainer pools them (`environment_branching`)."""

import copy
import dataclasses
import itertools
import os
import random
import warnings

import numpy as np
import pytest
import torch
from transformers import TrainerCallback

from tests.remote_env import RemoteCounterEnv, SessionServer, TicketEnv
from tests.scripted import arithmetic_dataset, config, tiny, tool_call, unchanged_after_training
from trl_tree import TreeOPSDConfig, TreeOPSDTrainer
from trl_tree.rollout.acting.env_branching import (
    EnvironmentPool,
    RecordedCall,
    ReplayDivergenceWarning,
    TreeEnvironment,
)
from trl_tree.rollout.acting.tools import run_tool_call
from trl_tree.testing import ScriptedEngine


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
    with caplog.at_level("WARNING", logger="trl_tree.rollout.acting.env_branching"):
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

    class CopyCountingEnv(PlainCounterEnv):
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


# ---------------------------------------------------------------------------------------------------------------
# No default shares state between branches: auto copies only what is plain data or says it may be copied; a
# replayed branch whose world disagrees with its history is not trained; a failing fork() is no crash
# ---------------------------------------------------------------------------------------------------------------

ROW = {"prompt": [{"role": "user", "content": "What is 1+1?"}], "answer": "2"}
_SESSIONS: dict[str, int] = {}  # a stand-in server's sessions: state the clients point at but do not own


def _open_session() -> str:
    sid = f"session-{len(_SESSIONS)}"
    _SESSIONS[sid] = 0
    return sid


class _ServerCounter:
    """A client whose counter lives on the server, under a key: a deep copy copies the key, not the session."""
    def _key(self) -> str:
        raise NotImplementedError

    def add(self, amount: int) -> str:
        """Adds an amount to the counter.

        Args:
            amount: how much to add.

        Returns:
            The counter's new value.
        """
        _SESSIONS[self._key()] += amount
        return str(_SESSIONS[self._key()])

    @property
    def n(self) -> int:
        return _SESSIONS[self._key()]


class RestSessionEnv(_ServerCounter):
    """A REST client: a base URL and the session id the server handed out (plain strings, remote state)."""
    def __init__(self):
        self.base_url, self.session_id = "http://counter.invalid", None

    def reset(self, **kwargs):
        self.session_id = _open_session()

    def _key(self):
        return self.session_id


class _Handle:
    """A handle on a server-side session, of a class nothing knows about."""
    def __init__(self, key):
        self.key = key


class HandleSessionEnv(_ServerCounter):
    def __init__(self):
        self.link = None

    def reset(self, **kwargs):
        self.link = _Handle(_open_session())

    def _key(self):
        return self.link.key


class RequestsSessionEnv(_ServerCounter):
    """An HTTP client: a `requests.Session` (deep-copyable) and a token naming the server-side session."""
    def __init__(self):
        import requests

        self.http, self.token = requests.Session(), None

    def reset(self, **kwargs):
        self.token = _open_session()

    def _key(self):
        return self.token


def _outputs_match_own_calls(branch) -> bool:
    """Every `add` output of the branch is the running sum of the branch's own amounts."""
    history = _tool_history(branch.messages)
    amounts = list(itertools.accumulate(arguments["amount"] for _, arguments, _ in history))
    return [output for *_, output in history] == [str(a) for a in amounts]


@pytest.mark.parametrize("client", ["rest", "handle", "requests", "socket"])
def test_auto_does_not_copy_clients_of_remote_state_every_leaf_sees_its_own_calls(tmp_path, client):
    if client == "requests":
        import requests  # noqa: F401 - installed with the dev extra (CI's): missing, this fails instead of skipping
    finals = []

    def final_counter(completions, environments, **kwargs):
        finals.extend(e.n for e in environments)
        return [float(e.n) for e in environments]

    with SessionServer() as server:
        factory = {"rest": RestSessionEnv, "handle": HandleSessionEnv, "requests": RequestsSessionEnv,
                   "socket": server.factory(RemoteCounterEnv)}[client]
        trainer = _trainer(tmp_path, factory, reward=final_counter)
        branches = _capture_branches(trainer)
        trainer.generate_batch([ROW])
    assert len(branches) == 6
    assert [b for b in branches if not _outputs_match_own_calls(b)] == []
    assert finals == [int(_tool_history(b.messages)[-1][2]) for b in branches]  # each leaf's world is its own


def test_a_plain_local_environment_is_still_copied_under_auto(tmp_path):
    """Plain data (scalars, containers, a dataclass, random.Random, arrays, tensors) copies cheaply: no replay."""

    @dataclasses.dataclass
    class Meta:
        name: str = "counter"
        tags: list = dataclasses.field(default_factory=list)

    resets = []

    class LocalCounterEnv:
        def __init__(self):
            self.n, self.history, self.meta = 0, [], Meta()
            self.rng, self.board, self.weights = random.Random(0), np.zeros(3), torch.zeros(2)

        def reset(self, **kwargs):
            resets.append(kwargs)
            self.n, self.history = 0, []

        def add(self, amount: int) -> str:
            """Adds an amount to the counter.

            Args:
                amount: how much to add.

            Returns:
                The counter's new value.
            """
            self.n += amount
            self.history.append(amount)
            return str(self.n)

    trainer = _trainer(tmp_path, LocalCounterEnv)
    branches = _capture_branches(trainer)
    resets_before = len(resets)
    trainer.generate_batch([ROW])
    assert len(resets) - resets_before == 2  # one per trajectory from the prompt; no branch was replayed
    assert all(s is not None for b in branches[:2] for s in b.snapshots[1:])  # copies were kept
    assert all(_outputs_match_own_calls(b) for b in branches)


def test_an_environment_can_declare_itself_copyable_or_not():
    from trl_tree.rollout.acting.env_branching import copy_blocker

    class Declared(RestSessionEnv):
        __trl_tree_copyable__ = True

    class Refused:
        __trl_tree_copyable__ = False

        def __init__(self):
            self.n = 0

    class OwnDeepcopy(HandleSessionEnv):
        def __deepcopy__(self, memo):
            other = HandleSessionEnv()
            return other

    assert copy_blocker(Declared()) is None and copy_blocker(OwnDeepcopy()) is None
    assert "__trl_tree_copyable__ = False" in copy_blocker(Refused())
    handle = HandleSessionEnv()
    handle.reset()
    assert "link" in copy_blocker(handle) and "_Handle" in copy_blocker(handle)
    rest = RestSessionEnv()
    rest.reset()
    rest.base_url = None  # unset handles are no handles; the session id alone is one
    assert "RestSessionEnv.session_id is named like a handle on remote state" in copy_blocker(rest)


class RandomWorldEnv:
    """A local world whose reset and tools draw from Python's, NumPy's and torch's global generators (the Wordle
    example draws its secret word so): the observation does not show the secret, the tool outputs depend on it."""

    def reset(self, **kwargs):
        self.n = random.randrange(1000) + int(np.random.randint(1000)) + int(torch.randint(1000, ()))
        return "Find the counter."

    def add(self, amount: int) -> str:
        """Adds an amount (and some noise) to the counter.

        Args:
            amount: how much to add.

        Returns:
            The counter's new value.
        """
        self.n += amount + random.randrange(10) + int(np.random.randint(10)) + int(torch.randint(10, ()))
        return str(self.n)


def test_replay_reproduces_what_reset_and_tools_draw_from_the_global_generators(tmp_path):
    finals = []

    def final_counter(completions, environments, **kwargs):
        finals.extend(e.n for e in environments)
        return [float(e.n) for e in environments]

    trainer = _trainer(tmp_path, RandomWorldEnv, reward=final_counter, environment_branching="replay")
    branches = _capture_branches(trainer)
    with warnings.catch_warnings():
        warnings.simplefilter("error", ReplayDivergenceWarning)
        trainer.generate_batch([ROW])
    assert len(branches) == len(finals) == 6 and all(b.diverged_at is None for b in branches)
    assert finals == [int(_tool_history(b.messages)[-1][2]) for b in branches]  # world and history agree


def test_replay_leaves_the_callers_random_state_as_it_was():
    from trl_tree.rollout.acting.env_branching import capture_random_state

    def run_call(call, tools):
        return run_tool_call(call, tools, timeout=5, max_chars=None)

    pool = EnvironmentPool({None: RandomWorldEnv}, branching="replay")
    tree = TreeEnvironment(pool, None, {}, run_call)
    root = tree.start()
    call = {"type": "function", "function": {"name": "add", "arguments": {"amount": 1}}}
    drawn_with = capture_random_state()
    recorded = [RecordedCall(0, call, run_call(call, {"add": root.add}).content, False, drawn_with)]

    def state():
        return random.getstate(), np.random.get_state()[1].tolist(), torch.get_rng_state().tolist()

    before = state()
    replayed = tree.at(None, recorded)
    assert state() == before  # the sampler's own randomness is not disturbed by replays
    assert replayed.n == root.n and tree.diverged(replayed) is False


class UrandomEnv:
    """Divergence no process state can prevent: every call draws from the OS."""
    def reset(self, **kwargs):
        self.n = 0

    def add(self, amount: int) -> str:
        """Adds an amount (and some noise) to the counter.

        Args:
            amount: how much to add.

        Returns:
            The counter's new value.
        """
        self.n += amount + int.from_bytes(os.urandom(4), "little")
        return str(self.n)


def test_a_diverged_replay_is_dropped_from_the_tree_and_counted(tmp_path):
    from trl_tree import trl_internals

    scored = []

    def count(completions, **kwargs):
        scored.extend(completions)
        return [float(len(c)) for c in completions]

    trainer = _trainer(tmp_path, UrandomEnv, reward=count, environment_branching="replay")
    branches = _capture_branches(trainer)
    with pytest.warns(ReplayDivergenceWarning, match="Replaying tool 'add'"):
        trainer.generate_batch([ROW])
    diverged = [b for b in branches if b.diverged_at is not None]
    assert len(branches) == 6 and len(diverged) == 4  # every continuation replays calls that cannot repeat
    metrics = trl_internals.metrics(trainer, "train" if trainer.model.training else "eval")
    assert metrics["tree/diverged_branches"] == [4.0]
    assert metrics["tree/leaves_per_tree"] == [2.0]  # the diverged continuations are no leaves
    assert len(scored) == 2  # and are not scored


def test_a_diverged_replay_raises_when_asked_to(tmp_path):
    from trl_tree.rollout.acting.env_branching import ReplayDivergenceError

    trainer = _trainer(tmp_path, UrandomEnv, environment_branching="replay", replay_divergence="raise")
    with pytest.raises(ReplayDivergenceError, match=r"UrandomEnv: replaying tool 'add' \(call of turn \d\) gave"):
        trainer.generate_batch([ROW])


def test_replay_divergence_is_validated(tmp_path):
    with pytest.raises(ValueError, match="replay_divergence must be one of"):
        config(TreeOPSDConfig, tmp_path, replay_divergence="ignore")


class PlainCounterEnv:
    """A counter with an `add(amount)` tool, all of its state plain local data."""
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


class BrokenForkEnv(PlainCounterEnv):
    """A plain counter whose fork() fails (e.g. the server cannot snapshot a session)."""
    def fork(self):
        raise RuntimeError("the server cannot snapshot this session")


def test_a_failing_fork_falls_back_to_replay_under_auto(tmp_path, caplog):
    trainer = _trainer(tmp_path, BrokenForkEnv)
    branches = _capture_branches(trainer)
    with caplog.at_level("WARNING", logger="trl_tree.rollout.acting.env_branching"):
        trainer.generate_batch([ROW])
    messages = [r.getMessage() for r in caplog.records]
    assert any("BrokenForkEnv.fork() raised RuntimeError: the server cannot snapshot" in m for m in messages)
    assert len(branches) == 6 and all(_outputs_match_own_calls(b) for b in branches)


def test_a_failing_fork_under_fork_says_what_to_do(tmp_path):
    trainer = _trainer(tmp_path, BrokenForkEnv, environment_branching="fork")
    with pytest.raises(RuntimeError, match=r"environment_branching='fork', but BrokenForkEnv\.fork\(\) raised "
                                           r"RuntimeError.*environment_branching='auto' or 'replay'"):
        trainer.generate_batch([ROW])
