"""The tool runtime keeps its promises under faults (issue 56, items 1-4): no threads that pile up, every call bounded
in every mode (its result's conversion to text included), no environment used while an abandoned call may still run
in it, and results checked at the boundary."""

import asyncio
import logging
import math
import sqlite3
import threading
import time

import pytest
from transformers.utils.chat_template_utils import render_jinja_template

from tests.scripted import AFTER_TOOL, config, tool_call
from tests.test_concurrent_tools import SamplingEngine, call, grow, observation_ids, parse
from trl_tree import TreeOPSDConfig
from trl_tree.rollout.acting import tools as tools_module
from trl_tree.rollout.acting.env_branching import EnvironmentPool, TreeEnvironment
from trl_tree.rollout.acting.tools import StuckToolsError, batched_tool, run_tool_call, stuck_tool_threads
from trl_tree.rollout.growing.turn_loop import Branch, SamplerSettings, TurnLoop, TurnLoopPorts
from trl_tree.testing import qwen3_chat_template

needs_sigalrm = pytest.mark.skipif(not hasattr(tools_module.signal, "setitimer"), reason="no SIGALRM on this platform")


def quick(key: str) -> str:
    """Answers at once.

    Args:
        key: what to look up
    """
    return f"value of {key}"


def pool_threads() -> set[threading.Thread]:
    return {t for t in threading.enumerate() if t.name.startswith("tool-pool")}


@pytest.fixture(autouse=True)
def own_stuck_count(monkeypatch):
    """Each test counts only the stuck threads it makes (other tests' hung tools may still be running)."""
    monkeypatch.setattr(tools_module, "_STUCK", {})


def wait_until_no_stuck_threads() -> None:
    """Released tools return and their threads exit: wait (bounded) so the next test starts from none."""
    for _ in range(200):
        if stuck_tool_threads() == 0:
            return
        time.sleep(0.05)


# ---------------------------------------------------------------- 1. no resource that grows with the run


def test_closed_loops_leave_no_pool_threads_over_many_loops():
    before = pool_threads()
    for seed in range(30):
        with TurnLoop(
            TurnLoopPorts(SamplingEngine(seed), parse("quick"), observation_ids),
            SamplerSettings(max_turns=3, max_completion_length=64),
        ) as loop:
            branches = [
                Branch(tree=i, prefix_ids=[3, 4, 200 + i], prompt_len=3, tools={"quick": quick}) for i in range(8)
            ]
            loop.run(branches)
            assert len(pool_threads() - before) > 1  # the pool ran the calls concurrently
    assert pool_threads() - before == set()  # each loop's 8 workers and watchdog stopped (990 threads for 30 before)


def test_a_loop_stopped_by_ctrl_c_leaves_no_pool_threads():
    before = pool_threads()

    def interrupting(key: str) -> str:
        """Stops the run, as Ctrl-C does.

        Args:
            key: anything
        """
        raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        with TurnLoop(
            TurnLoopPorts(SamplingEngine(), parse("interrupting"), observation_ids),
            SamplerSettings(max_turns=3, max_completion_length=64),
        ) as loop:
            loop.run(
                [
                    Branch(tree=i, prefix_ids=[3, 4, 200 + i], prompt_len=3, tools={"interrupting": interrupting})
                    for i in range(4)
                ]
            )
    assert pool_threads() - before == set()


def test_a_closed_loop_runs_again_with_a_new_pool():
    loop = TurnLoop(
        TurnLoopPorts(SamplingEngine(), parse("quick"), observation_ids),
        SamplerSettings(max_turns=3, max_completion_length=64),
    )
    for _ in range(3):
        branches = [Branch(tree=i, prefix_ids=[3, 4, 200 + i], prompt_len=3, tools={"quick": quick}) for i in range(4)]
        loop.run(branches)
        loop.close()
        assert all(b.done and "value of" in b.messages[1]["content"] for b in branches)
    loop.close()  # twice is fine


def test_every_agent_evaluation_stops_its_pool(tmp_path_factory):
    from tests.scripted import tiny
    from tests.test_agent_eval import _oracle_engine
    from trl_tree.envs import build_corpus, examples_to_dataset, make_search_tool
    from trl_tree.envs.agent_eval import AgentSettings, evaluate_agent
    from trl_tree.envs.hotpot import BM25Retriever
    from trl_tree.envs.synthetic import make_synthetic_hotpot

    examples = make_synthetic_hotpot(2, seed=11)
    search = make_search_tool(BM25Retriever(build_corpus(examples), cache_dir=tmp_path_factory.mktemp("bm25")))
    rows = list(examples_to_dataset(examples))
    _, tok = tiny()
    before = pool_threads()
    for _ in range(10):
        result = evaluate_agent(
            None,
            tok,
            rows,
            [search],
            AgentSettings(max_turns=5, max_completion_length=2048),
            engine=_oracle_engine(tok, examples),
        )
        assert result.mean_tool_calls == 2.0
    assert pool_threads() - before == set()


def test_the_trainers_pool_stops_when_training_ends_even_by_ctrl_c(tmp_path, monkeypatch):
    from trl import GRPOTrainer

    from tests.test_tools_dropin import FIRST_TURN, returning, tree_generation

    before = pool_threads()
    replies = {FIRST_TURN: [tool_call("lookup", key="a")] * 2, AFTER_TOOL: ["Done."] * 2}
    trainer, _ = tree_generation(tmp_path, [returning("x")], replies, num_initial_rollouts=2, num_branches=0)
    assert pool_threads() - before  # the generation batch started the pool

    def interrupted(self, *args, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr(GRPOTrainer, "train", interrupted)  # what TreeTrainer.train calls: Ctrl-C mid-training
    with pytest.raises(KeyboardInterrupt):
        trainer.train()
    assert pool_threads() - before == set()


def hanging(gate: threading.Event, calls: list):
    def hang(key: str) -> str:
        """Hangs until the test lets it go.

        Args:
            key: anything
        """
        calls.append(key)
        gate.wait(60)
        return "late"

    return hang


@pytest.mark.parametrize("settings", [{}, {"max_concurrent_tool_calls": 1}], ids=["pool", "serial"])
def test_threads_stuck_in_hung_tools_are_counted_warned_once_and_stop_the_run_past_the_cap(
    settings, monkeypatch, caplog
):
    monkeypatch.setattr(tools_module, "MAX_STUCK_TOOL_THREADS", 5)
    monkeypatch.setattr(tools_module, "_STUCK_WARNED", set())
    gate, calls = threading.Event(), []
    hang = hanging(gate, calls)
    counts, threads = [], []
    before = {t for t in threading.enumerate() if t.name.startswith("tool")}
    try:
        with caplog.at_level(logging.WARNING, logger="trl_tree.rollout.acting.tools"):
            with pytest.raises(StuckToolsError, match=r"(?s)MAX_STUCK_TOOL_THREADS=5.*tools stuck: hang"):
                for _ in range(10):  # rounds of 2 hung calls: without a cap, 2 more threads every round
                    grow(hang, n=2, tool_timeout=0.2, engine=SamplingEngine(turns_with_calls=1), **settings)
                    counts.append(stuck_tool_threads())
                    threads.append(len({t for t in threading.enumerate() if t.name.startswith("tool")} - before))
        assert counts == [2, 4]  # each hung call's thread counted; the third round passed the cap of 5
        assert threads == counts  # the closed loops left no thread but those stuck in the hung tool
        warnings = [r.getMessage() for r in caplog.records if "ran past tool_timeout" in r.getMessage()]
        assert len(warnings) == 1 and warnings[0].startswith("Tool hang ran past tool_timeout=0.2 s")
    finally:
        gate.set()
        wait_until_no_stuck_threads()
    assert stuck_tool_threads() == 0  # released, they exit and are no longer counted


def test_stuck_threads_are_a_trainer_metric(tmp_path):
    from tests.test_tools_dropin import FIRST_TURN, metrics, returning, tree_generation

    replies = {FIRST_TURN: [tool_call("lookup", key="a")] * 2, AFTER_TOOL: ["Done."] * 2}
    trainer, _ = tree_generation(tmp_path, [returning("x")], replies, num_initial_rollouts=2, num_branches=0)
    assert metrics(trainer)["tools/stuck_workers"] == [float(stuck_tool_threads())]


# ---------------------------------------------------------------- 2. every call bounded, in every mode


class SlowText:
    """A value whose conversion to text takes far longer than the deadline."""

    def __init__(self, gate: threading.Event):
        self.gate = gate

    def __str__(self):
        self.gate.wait(5)
        return "late text"


def slow_text_tool(gate):
    def lookup(key: str):
        """Returns a value slow to print.

        Args:
            key: anything
        """
        return SlowText(gate)

    return lookup


@pytest.mark.parametrize("execution", [pytest.param("main", marks=needs_sigalrm), "thread"])
def test_the_deadline_covers_the_conversion_of_the_result_to_text(execution):
    gate = threading.Event()
    try:
        r = run_tool_call(call("lookup", key="a"), {"lookup": slow_text_tool(gate)}, 0.3, None, execution)
    finally:
        gate.set()
    assert r.failed and r.content == str({"error": "timed out after 0.3 s"})


def test_the_serial_mode_deadline_covers_the_conversion_too():
    gate = threading.Event()
    try:
        branches, _, _ = grow(
            slow_text_tool(gate),
            n=2,
            tool_timeout=0.3,
            max_concurrent_tool_calls=1,
            engine=SamplingEngine(turns_with_calls=1),
        )
    finally:
        gate.set()
    answers = [m["content"] for b in branches for m in b.messages if m["role"] == "tool"]
    assert answers == [str({"error": "timed out after 0.3 s"})] * 2


def retrying(attempts: list, backoff_in_handler: bool):
    def fetch(key: str) -> str:
        """Retries whatever fails, catching everything, as careless tools do.

        Args:
            key: anything
        """
        for _ in range(20):
            attempts.append(1)
            try:
                time.sleep(0.5)
                if not backoff_in_handler:
                    time.sleep(0.5)
            except BaseException:  # noqa: BLE001 - the point of the test: it catches the deadline too
                if backoff_in_handler:
                    time.sleep(0.5)
        return "late result"

    return fetch


@needs_sigalrm
@pytest.mark.parametrize("backoff_in_handler", [True, False], ids=["backoff_in_except", "all_in_try"])
def test_main_mode_drops_the_late_result_of_a_tool_that_catches_its_deadline(backoff_in_handler, caplog, monkeypatch):
    monkeypatch.setattr(tools_module, "_DEADLINE_CAUGHT", set())
    attempts = []
    with caplog.at_level(logging.WARNING, logger="trl_tree.rollout.acting.tools"):
        r = run_tool_call(call("fetch", key="a"), {"fetch": retrying(attempts, backoff_in_handler)}, 0.3, None, "main")
    assert r.failed and r.content == str({"error": "timed out after 0.3 s"})  # never the late result
    if backoff_in_handler:  # the deadline, raised again, lands in its backoff and ends the retry loop
        assert len(attempts) < 20
    assert any("caught its own deadline" in m and "tool_execution='thread'" in m for m in caplog.messages)


@pytest.mark.parametrize("value", ["5", 0, -1, 0.0, math.nan, math.inf, True])
def test_tool_timeout_must_be_a_positive_finite_number_or_none(tmp_path, value):
    with pytest.raises(ValueError, match=r"tool_timeout must be a positive, finite number of seconds"):
        config(TreeOPSDConfig, tmp_path, tool_timeout=value)
    with pytest.raises(ValueError, match=r"tool_timeout must be a positive, finite number"):
        SamplerSettings(max_turns=2, max_completion_length=8, tool_timeout=value)
    assert SamplerSettings(max_turns=2, max_completion_length=8, tool_timeout=None).tool_timeout is None
    assert SamplerSettings(max_turns=2, max_completion_length=8, tool_timeout=2).tool_timeout == 2


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("max_turns", "3"),
        ("max_turns", 2.5),
        ("max_observation_chars", 0),
        ("max_observation_chars", "100"),
        ("max_turn_tokens", 1.5),
        ("generation_chunk_tokens", "8"),
        ("tool_failure_penalty", math.nan),
        ("tool_failure_penalty", "-1"),
    ],
)
def test_the_numeric_rollout_fields_are_checked_when_the_config_is_built(tmp_path, field, value):
    with pytest.raises(ValueError, match=rf"^{field} must be a"):
        config(TreeOPSDConfig, tmp_path, **{field: value})


# ---------------------------------------------------------------- 3. no environment used behind the model's back


class Account:
    """A stateful environment whose `deposit` may hang; what the model last saw must be what the instance holds."""

    gate = threading.Event()

    def reset(self, **row):
        self.balance = 0
        self.calls = 0

    def deposit(self, key: str) -> str:
        """Deposits 10; the second call of an instance hangs before it writes.

        Args:
            key: anything
        """
        self.calls += 1
        if self.calls == 2:
            self.gate.wait(60)
        self.balance += 10
        return str(self.balance)


@pytest.mark.parametrize("settings", [{}, {"max_concurrent_tool_calls": 1}], ids=["pool", "serial"])
def test_a_branch_ends_when_a_call_on_its_environment_is_abandoned(settings):
    Account.gate = threading.Event()
    loop = TurnLoop(
        TurnLoopPorts(SamplingEngine(turns_with_calls=4), parse("deposit"), observation_ids),
        SamplerSettings(max_turns=6, max_completion_length=96, tool_timeout=0.3, **settings),
    )
    branches = []
    for i in range(3):
        env = Account()
        env.reset()
        branches.append(
            Branch(tree=i, prefix_ids=[3, 4, 200 + i], prompt_len=3, env=env, tools={"deposit": env.deposit})
        )
    try:
        with loop:
            loop.run(branches)
        for b in branches:
            assert b.done and b.abandoned_at == 1 and len(b.turns) == 2  # ended at the turn whose call was abandoned
            assert b.env.calls == 2  # nothing more ran on the instance while that call may still run
            assert [m["content"] for m in b.messages if m["role"] == "tool"] == ["10"]  # the last world the model saw
        assert loop.tool_stats.abandoned_environments == 3
    finally:
        Account.gate.set()
        wait_until_no_stuck_threads()


@needs_sigalrm
def test_in_main_mode_a_timed_out_call_has_ended_so_the_branch_goes_on():
    Account.gate = threading.Event()
    loop = TurnLoop(
        TurnLoopPorts(SamplingEngine(turns_with_calls=3), parse("deposit"), observation_ids),
        SamplerSettings(max_turns=5, max_completion_length=96, tool_timeout=0.3, tool_execution="main"),
    )
    env = Account()
    env.reset()
    branch = Branch(tree=0, prefix_ids=[3, 4, 200], prompt_len=3, env=env, tools={"deposit": env.deposit})
    loop.run([branch])
    answers = [m["content"] for m in branch.messages if m["role"] == "tool"]
    assert branch.abandoned_at is None and answers == ["10", str({"error": "timed out after 0.3 s"}), "20"]


class Plain:
    def reset(self, **row):
        self.n = 0


def test_an_abandoned_instance_leaves_the_pool_and_is_never_reset_again():
    pool = EnvironmentPool({None: Plain})
    first, second = pool.acquire(), pool.acquire()
    pool.retire(first)
    third = pool.acquire()  # the batch goes on with new instances
    pool.release()
    later = [pool.acquire() for _ in range(3)]
    assert first not in later and {id(x) for x in later} == {id(second), id(third), id(later[2])}
    assert all(x is not first for x in pool.instances[None])


def test_an_abandoned_environment_call_retires_the_trees_instance():
    Account.gate = threading.Event()
    pool = EnvironmentPool({None: Account})
    loop = TurnLoop(
        TurnLoopPorts(SamplingEngine(turns_with_calls=3), parse("deposit"), observation_ids),
        SamplerSettings(max_turns=5, max_completion_length=96, tool_timeout=0.3),
    )
    handle = TreeEnvironment(pool, None, {}, loop.run_call)
    env = handle.start()
    branch = Branch(
        tree=0, prefix_ids=[3, 4, 200], prompt_len=3, env=env, tools={"deposit": env.deposit}, environment=handle
    )
    try:
        with loop:
            loop.run([branch])
        assert branch.abandoned_at == 1 and all(x is not env for x in pool.instances[None])
    finally:
        Account.gate.set()
        wait_until_no_stuck_threads()


def test_a_factory_that_returns_one_shared_instance_is_refused():
    shared = Plain()
    pool = EnvironmentPool({None: lambda: shared})
    pool.acquire()
    with pytest.raises(
        ValueError,
        match=r"(?s)returned the same Plain instance more than once.*environment_factory="
        r"MyEnv",
    ):
        pool.acquire()
    with pytest.raises(ValueError, match="returned the same Plain instance"):
        EnvironmentPool({None: Plain}, {None: [shared, shared]})


def test_a_trainer_with_a_shared_environment_instance_is_refused(tmp_path):
    from tests.test_environments import PlainCounterEnv, _trainer

    shared = PlainCounterEnv()
    with pytest.raises(ValueError, match="returned the same PlainCounterEnv instance more than once"):
        trainer = _trainer(tmp_path, lambda: shared)
        trainer.generate_batch([trainer.train_dataset[0]])


# ---------------------------------------------------------------- 4. results checked at the boundary


@pytest.mark.parametrize(
    ("returned", "what"),
    [
        (lambda calls: {c["key"]: "v" for c in calls}, "returned a dict"),
        (lambda calls: "ab", "returned a str"),
        (lambda calls: None, "returned a NoneType"),
        (lambda calls: ["only one"], "returned 1 results for 2 calls"),
    ],
    ids=["dict", "str", "none", "length"],
)
def test_a_batched_form_must_return_a_list_of_one_result_per_call(returned, what, caplog):
    def lookup_many(calls):
        return returned(calls)

    @batched_tool(lookup_many)
    def lookup(key: str) -> str:
        """Looks a key up.

        Args:
            key: what to look up
        """
        return "single"

    with caplog.at_level(logging.WARNING, logger="trl_tree.rollout.acting.tool_executor"):
        branches, _, _ = grow(lookup, n=2, engine=SamplingEngine(turns_with_calls=1))
    answers = [m["content"] for b in branches for m in b.messages if m["role"] == "tool"]
    expected = (
        f"the batched form {lookup_many.__qualname__} of tool lookup {what}; it must return a list (or tuple)"
        " of one result per call, in order (2 here)"
    )
    assert len(answers) == 2 and all(expected in a for a in answers)


def render_tool_message(content) -> str:
    """The tiny Qwen3's chat template (`trl_tree.testing`) rendering one tool message."""
    messages = [
        {"role": "user", "content": "q"},
        {"role": "assistant", "content": "", "tool_calls": [call("lookup", key="a")]},
        {"role": "tool", "name": "lookup", "content": content},
    ]
    rendered, _ = render_jinja_template([messages], chat_template=qwen3_chat_template())
    return rendered[0].split("<tool_response>")[1].split("</tool_response>")[0]


@pytest.mark.parametrize(
    "value", [["Paris", "France"], [1, 2.5], ("a", 1), []], ids=["strs", "numbers", "tuple", "empty"]
)
def test_a_list_of_plain_values_renders_as_text(value):
    r = run_tool_call(call("lookup", key="a"), {"lookup": lambda key: value}, 5, None, "thread")
    assert r.content == str(value) and not r.failed
    assert render_tool_message(r.observation).strip() == str(value)  # the model reads it
    assert render_tool_message(list(value)).strip() in ("", "[]") or isinstance(value, tuple)  # as blocks: nothing


def test_content_blocks_stay_blocks_and_a_template_that_renders_them_empty_is_named(caplog):
    blocks = [{"type": "text", "text": "Paris"}]
    r = run_tool_call(call("lookup", key="a"), {"lookup": lambda key: blocks}, 5, None, "thread")
    assert r.content == blocks  # GRPOTrainer's rule for content blocks
    assert render_tool_message(r.observation) == render_tool_message("")  # but Qwen3's template shows nothing of them

    def rendered_ids(messages):
        return [ord(c) for m in messages for c in render_tool_message(m["content"])]

    def lookup(key: str):
        """Returns content blocks.

        Args:
            key: anything
        """
        return blocks

    with caplog.at_level(logging.WARNING, logger="trl_tree.rollout.growing.turn_loop"):
        with TurnLoop(
            TurnLoopPorts(SamplingEngine(turns_with_calls=1), parse("lookup"), rendered_ids),
            SamplerSettings(max_turns=3, max_completion_length=64),
        ) as loop:
            loop.run(
                [Branch(tree=i, prefix_ids=[3, 4, 200 + i], prompt_len=3, tools={"lookup": lookup}) for i in range(3)]
            )
    (warning,) = [m for m in caplog.messages if "renders to nothing" in m]
    assert warning.startswith("Tool lookup returned content blocks") and "Return a str" in warning


def test_a_tool_that_fails_every_call_in_workers_hints_at_main_mode(caplog):
    connection = sqlite3.connect(":memory:")  # made in this thread: usable only here

    def query(key: str) -> str:
        """Queries the database.

        Args:
            key: anything
        """
        return str(connection.execute("select 1").fetchone())

    try:
        with caplog.at_level(logging.WARNING, logger="trl_tree.rollout.acting.tool_executor"):
            branches, _, _ = grow(query, n=4, engine=SamplingEngine(turns_with_calls=1))
        assert all(b.tool_failures == 1 for b in branches)
        hints = [m for m in caplog.messages if m.startswith("Tool query failed all 4 of its calls")]
        assert len(hints) == 1 and "ProgrammingError" in hints[0] and "tool_execution='main'" in hints[0]
        serial, _, _ = grow(query, n=2, engine=SamplingEngine(turns_with_calls=1), tool_execution="main")
        assert all(b.tool_failures == 0 for b in serial)  # the hint's remedy works
    finally:
        connection.close()


def test_an_async_tool_that_blocks_its_event_loop_is_named(event_loop_thread, caplog, monkeypatch):
    monkeypatch.setattr(tools_module, "_BLOCKED_LOOP_WARNED", set())

    async def blocking(key: str) -> str:
        """Blocks its loop with synchronous work.

        Args:
            key: anything
        """
        time.sleep(1.0)
        return "late"

    with caplog.at_level(logging.WARNING, logger="trl_tree.rollout.acting.tools"):
        r = run_tool_call(call("blocking", key="a"), {"blocking": blocking}, 0.2, None, "thread", event_loop_thread)
    assert r.failed and "timed out" in r.content
    (warning,) = [m for m in caplog.messages if "event loop was blocked" in m]
    assert "Async tools with a call in progress: blocking" in warning and "asyncio.to_thread" in warning
    asyncio.run_coroutine_threadsafe(asyncio.sleep(0), event_loop_thread).result(5)  # the loop is free again


def test_a_large_output_is_said_once_with_its_size(caplog, monkeypatch):
    monkeypatch.setattr(tools_module, "_LARGE_WARNED", set())
    big = "x" * (tools_module.LARGE_CONTENT_CHARS + 1)
    with caplog.at_level(logging.WARNING, logger="trl_tree.rollout.acting.tools"):
        for _ in range(2):
            r = run_tool_call(call("dump", key="a"), {"dump": lambda key: big}, 5, 100, "thread")
    assert len(r.content) == len(big) and len(r.observation) < 200  # rewards get all of it, the model its cut
    (warning,) = [m for m in caplog.messages if "Tool dump returned" in m]
    assert f"returned {len(big)} characters" in warning
