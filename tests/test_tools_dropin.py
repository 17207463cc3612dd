"""Tools behave as in GRPOTrainer: the same tool messages and observation tokens, tools in the main thread (so
signal-based timeouts work), nothing a tool raises ends the run but KeyboardInterrupt, and GRPO's tool metrics counted
per leaf over the leaf's whole history.

GRPOTrainer is the reference: it is built with the same tiny model and tools, and its generation is scripted the way
`scripted.py` scripts the tree trainers (`_generate_single_turn` returns fixed token ids).
"""

import asyncio
import signal
import sys
import threading
import time

import pytest
from trl import GRPOConfig, GRPOTrainer

from tests.scripted import (
    AFTER_TOOL,
    CALL_1_PLUS_1,
    PrefixScript,
    arithmetic_dataset,
    config,
    scripted_engine,
    scripted_trainer,
    tiny,
    tool_call,
)
from trl_tree import TreeOPSDConfig, TreeOPSDTrainer
from trl_tree.rollout.acting import tools as tools_module
from trl_tree.rollout.acting.tools import TRUNCATION_MARKER, run_tool_call
from trl_tree.rollout.growing.turn_loop import Branch, SamplerSettings, TurnLoop, TurnLoopPorts
from trl_tree.testing import ScriptedEngine, calculator

FIRST_TURN = "<|im_start|>assistant\n"


def call(name, **arguments):
    return {"type": "function", "function": {"name": name, "arguments": arguments}}


class Recorder:
    """A reward function that keeps what it was given (completions and their token ids) and scores 0."""

    __name__ = "recorder"

    def __init__(self):
        self.completions, self.completion_ids = None, None

    def __call__(self, completions, completion_ids, **kwargs):
        self.completions, self.completion_ids = completions, [list(ids) for ids in completion_ids]
        return [0.0] * len(completions)


def grpo_generation(tmp_path, tools, replies, num_generations):
    """Run GRPOTrainer's generation and tool loop on one prompt with scripted model outputs."""
    model, tok = tiny()
    recorder = Recorder()
    args = GRPOConfig(
        output_dir=str(tmp_path / "grpo"), num_generations=num_generations, per_device_train_batch_size=num_generations,
        max_completion_length=96, report_to="none", use_cpu=True, bf16=False, beta=0.0,
    )
    trainer = GRPOTrainer(model=model, reward_funcs=recorder, args=args, train_dataset=arithmetic_dataset(2),
                          processing_class=tok, tools=tools)
    script = PrefixScript(tok, replies)
    trainer._generate_single_turn = lambda prompt_ids, *args, **kwargs: ([script(list(p)) for p in prompt_ids], None)
    trainer._generate_and_score_completions([trainer.train_dataset[0]] * num_generations)
    return trainer, recorder


def tree_generation(tmp_path, tools, replies, **overrides):
    """Grow one scripted tree with TreeOPSDTrainer (no training step)."""
    recorder = Recorder()
    trainer = scripted_trainer(TreeOPSDTrainer, TreeOPSDConfig, tmp_path / "tree", replies, reward_funcs=recorder,
                               dataset=arithmetic_dataset(2), tools=tools, **overrides)
    trainer.generate_batch([trainer.train_dataset[0]])
    return trainer, recorder


def metrics(trainer):
    return trainer._metrics["train" if trainer.model.training else "eval"]


# ---------------------------------------------------------------- tool messages and observation tokens


def returning(value):
    def lookup(key: str):
        """Looks a key up.

        Args:
            key: what to look up
        """
        return value

    return lookup


# a list of content blocks is passed as it is, as GRPOTrainer does; a list of plain values is text here (GRPOTrainer
# passes it as blocks, which Qwen3's template renders empty): tests/test_tool_faults.py
@pytest.mark.parametrize("value", [{"answer": 2, "source": "calc"}, [{"type": "text", "text": "2"}], 42],
                         ids=["dict", "list", "int"])
def test_a_tool_result_reaches_reward_functions_and_the_model_as_in_grpo(tmp_path, value):
    replies = {FIRST_TURN: [tool_call("lookup", key="a")] * 2, AFTER_TOOL: ["Done."] * 2}
    _, grpo = grpo_generation(tmp_path, [returning(value)], replies, num_generations=2)
    _, tree = tree_generation(tmp_path, [returning(value)], replies, num_initial_rollouts=2, num_branches=0)

    tool_message = tree.completions[0][1]
    grpo_content = value if isinstance(value, list) else str(value)  # GRPOTrainer's rule, e.g. "{'answer': 2, ...}"
    assert tool_message == {"role": "tool", "name": "lookup", "content": grpo_content}
    assert tree.completions[0] == grpo.completions[0]  # the whole conversation the reward function gets
    assert tree.completion_ids[0] == grpo.completion_ids[0]  # actions + the observation GRPO's template renders


@pytest.mark.parametrize(("value", "seen"), [
    (b"caf\xc3\xa9".decode("utf-8", "surrogateescape") + "\udce9", "café\ufffd"),  # non-UTF-8 output, decoded leniently
    ("half \ud83d pair", "half \ufffd pair"),  # a lone surrogate outside surrogateescape's range
    (b"caf\xc3\xa9", "café"),  # UTF-8 bytes are decoded, where GRPO would show b'caf\\xc3\\xa9'
    (b"\xff\xfe", str(b"\xff\xfe")),  # bytes that are not UTF-8 stay GRPO's str(value)
], ids=["surrogateescape", "lone_surrogate", "utf8_bytes", "other_bytes"])
def test_tool_text_the_tokenizer_cannot_take_becomes_a_safe_observation(tmp_path, value, seen):
    """A tool returning lone surrogates once stopped training inside the tokenizer (TypeError, naming neither tool
    nor cause): the characters are replaced, and the run goes on."""
    replies = {FIRST_TURN: [tool_call("lookup", key="a")] * 2, AFTER_TOOL: ["Done."] * 2}
    _, tree = tree_generation(tmp_path, [returning(value)], replies, num_initial_rollouts=2, num_branches=0)
    assert tree.completions[0][1]["content"] == seen
    seen.encode("utf-8")


def test_an_async_tool_runs_on_grpos_event_loop_with_grpos_message(tmp_path):
    threads = []

    async def lookup(key: str):
        """Looks a key up.

        Args:
            key: what to look up
        """
        threads.append(threading.current_thread())
        return {"key": key}

    replies = {FIRST_TURN: [tool_call("lookup", key="a")] * 2, AFTER_TOOL: ["Done."] * 2}
    _, grpo = grpo_generation(tmp_path, [lookup], replies, num_generations=2)
    threads.clear()
    trainer, tree = tree_generation(tmp_path, [lookup], replies, num_initial_rollouts=2, num_branches=0)
    assert tree.completions[0] == grpo.completions[0] and tree.completion_ids[0] == grpo.completion_ids[0]
    assert set(threads) == {trainer.async_loop_thread}  # the trainer's one event loop thread, as in GRPOTrainer


def test_the_model_sees_a_cut_observation_and_reward_functions_the_whole_output():
    rendered = []
    loop = TurnLoop(
        TurnLoopPorts(
            ScriptedEngine(lambda prefix: [5, 2], eos_ids=[2]),
            parse=lambda ids, prefix: (
                {"role": "assistant", "content": "", "tool_calls": [call("lookup", key="a")]} if len(prefix) == 1
                else {"role": "assistant", "content": "done"}
            ),
            observation_ids=lambda messages: rendered.append(messages) or [9],
        ),
        SamplerSettings(max_turns=3, max_completion_length=50, max_observation_chars=10),
    )
    branch = Branch(tree=0, prefix_ids=[1], prompt_len=1, tools={"lookup": returning("x" * 25)})
    loop.run([branch])
    assert branch.messages[1]["content"] == "x" * 25
    assert rendered == [[{"role": "tool", "name": "lookup", "content": "x" * 10 + TRUNCATION_MARKER.format(n=15)}]]


def test_an_observation_too_long_for_the_budget_is_counted_and_its_turn_marked(tmp_path):
    """The call's answer does not fit what is left of max_completion_length: the trajectory ends there as in TRL, but
    not silently: the turn says so and the generation metrics count it."""
    replies = {FIRST_TURN: [tool_call("lookup", key="a")] * 2, AFTER_TOOL: ["Done."] * 2}
    trainer, tree = tree_generation(tmp_path, [returning("word " * 2000)], replies, num_initial_rollouts=2,
                                    num_branches=0, max_completion_length=64, max_observation_chars=None)
    assert all(len(c) == 1 for c in tree.completions)  # the answer never reached the model
    assert metrics(trainer)["tools/dropped_observations"] == [1.0]
    roomy, _ = tree_generation(tmp_path, [returning("short")], replies, num_initial_rollouts=2, num_branches=0)
    assert metrics(roomy)["tools/dropped_observations"] == [0.0]


def test_a_dropped_observation_marks_the_turn_that_called():
    loop = TurnLoop(
        TurnLoopPorts(
            ScriptedEngine(lambda prefix: [5, 2], eos_ids=[2]),
            parse=lambda ids, prefix: {"role": "assistant", "content": "", "tool_calls": [call("lookup", key="a")]},
            observation_ids=lambda messages: [9] * 100,
        ),
        SamplerSettings(max_turns=3, max_completion_length=50),
    )
    branch = Branch(tree=0, prefix_ids=[1], prompt_len=1, tools={"lookup": returning("x")})
    loop.run([branch])
    assert branch.done and [t.observation_dropped for t in branch.turns] == [True]
    assert loop.tool_stats.dropped_observations == 1


def test_an_unknown_execution_mode_is_rejected_with_the_choices(tmp_path):
    with pytest.raises(ValueError, match=r"tool_execution must be one of \('main', 'thread'\); got 'process'"):
        config(TreeOPSDConfig, tmp_path, tool_execution="process")
    with pytest.raises(ValueError, match="tool_execution must be one of"):
        run_tool_call(call("lookup", key="a"), {"lookup": returning(1)}, 1, None, execution="process")


# ---------------------------------------------------------------- where tools run


class QueryTimeout(Exception):
    pass


def query(seconds: float) -> str:
    """Runs a query that takes `seconds` and times itself out with SIGALRM, as TRL's agent example does.

    Args:
        seconds: how long the query takes
    """

    def on_alarm(signum, frame):
        raise QueryTimeout("query took too long")

    previous = signal.signal(signal.SIGALRM, on_alarm)
    signal.setitimer(signal.ITIMER_REAL, 0.05)
    try:
        time.sleep(seconds)
        return "3 rows"
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)


needs_sigalrm = pytest.mark.skipif(not hasattr(signal, "SIGALRM"), reason="no SIGALRM on this platform")


@needs_sigalrm
def test_a_signal_timed_tool_works_in_the_main_thread():
    fast = run_tool_call(call("query", seconds=0.0), {"query": query}, timeout=5, max_chars=None, execution="main")
    slow = run_tool_call(call("query", seconds=5.0), {"query": query}, timeout=5, max_chars=None, execution="main")
    assert (fast.content, fast.failed) == ("3 rows", False)
    assert slow.failed and "query took too long" in slow.content


@needs_sigalrm
def test_a_signal_timed_tool_fails_in_a_worker_thread():
    r = run_tool_call(call("query", seconds=0.0), {"query": query}, timeout=5, max_chars=None, execution="thread")
    assert r.failed and "main thread" in r.content


@needs_sigalrm
@pytest.mark.parametrize(("overrides", "expected"), [
    ({"tool_execution": "main"}, "3 rows"),
    ({"max_concurrent_tool_calls": 1, "tool_execution": "main"}, "3 rows"),
    ({}, "main thread"),  # the default runs tools concurrently, in worker threads
])
def test_signal_timed_tools_need_the_trainers_thread(tmp_path, caplog, monkeypatch, overrides, expected):
    """GRPOTrainer runs tools in its own thread, where TRL's agent example times them out with `signal.alarm`;
    trl-tree's default runs them concurrently in worker threads, where signal fails: the model gets the error and the
    log says once which setting runs such a tool."""
    monkeypatch.setattr(tools_module, "_SIGNAL_ADVISED", set())  # advised once per tool and process
    replies = {FIRST_TURN: [tool_call("query", seconds=0.0)] * 2, AFTER_TOOL: ["Done."] * 2}
    with caplog.at_level("WARNING", logger="trl_tree.rollout.acting.tools"):
        _, tree = tree_generation(tmp_path, [query], replies, num_initial_rollouts=2, num_branches=0, **overrides)
    assert expected in tree.completions[0][1]["content"]
    advice = [r for r in caplog.records if "tool_execution='main'" in r.getMessage()]
    assert len(advice) == (0 if overrides else 1)


# ---------------------------------------------------------------- what a tool raises


class Abort(BaseException):
    pass


def _raiser(error):
    def tool(key: str):
        """Raises.

        Args:
            key: anything
        """
        raise error

    async def async_tool(key: str):
        """Raises after yielding to the event loop.

        Args:
            key: anything
        """
        await asyncio.sleep(0)
        raise error

    return tool, async_tool


def _loop_is_alive(loop) -> bool:
    return asyncio.run_coroutine_threadsafe(asyncio.sleep(0, "alive"), loop).result(timeout=5) == "alive"


RAISED = [
    (SystemExit(3), "SystemExit: 3"),
    (SystemExit(), "SystemExit"),
    (GeneratorExit(), "GeneratorExit"),
    (Abort("stop"), "Abort: stop"),
    (RuntimeError("database is on fire"), "database is on fire"),
]


@pytest.mark.parametrize("execution", ["main", "thread"])
@pytest.mark.parametrize(("error", "shown"), RAISED, ids=[type(e).__name__ + str(e) for e, _ in RAISED])
def test_whatever_a_sync_tool_raises_becomes_an_error_observation(execution, error, shown):
    tool, _ = _raiser(error)
    r = run_tool_call(call("tool", key="a"), {"tool": tool}, timeout=5, max_chars=None, execution=execution)
    assert r.failed and r.content == str({"error": shown})


@pytest.mark.parametrize("on_loop", [True, False], ids=["grpo_event_loop", "own_event_loop"])
@pytest.mark.parametrize(("error", "shown"), RAISED, ids=[type(e).__name__ + str(e) for e, _ in RAISED])
def test_whatever_an_async_tool_raises_becomes_an_error_observation(event_loop_thread, on_loop, error, shown):
    _, tool = _raiser(error)
    loop = event_loop_thread if on_loop else None
    r = run_tool_call(call("tool", key="a"), {"tool": tool}, timeout=5, max_chars=None, event_loop=loop)
    assert r.failed and r.content == str({"error": shown})
    assert _loop_is_alive(event_loop_thread)  # a SystemExit inside a task would otherwise stop the shared loop


@pytest.mark.parametrize("execution", ["main", "thread"])
def test_keyboard_interrupt_in_a_tool_stops_the_run_from_the_calling_thread(execution, monkeypatch):
    thread_errors = []
    monkeypatch.setattr(threading, "excepthook", thread_errors.append)
    tool, _ = _raiser(KeyboardInterrupt())
    with pytest.raises(KeyboardInterrupt):
        run_tool_call(call("tool", key="a"), {"tool": tool}, timeout=5, max_chars=None, execution=execution)
    assert thread_errors == []  # re-raised here, not printed as a dying thread's traceback


@pytest.mark.parametrize("on_loop", [True, False], ids=["grpo_event_loop", "own_event_loop"])
def test_keyboard_interrupt_in_an_async_tool_stops_the_run_and_spares_the_loop(event_loop_thread, on_loop):
    _, tool = _raiser(KeyboardInterrupt())
    with pytest.raises(KeyboardInterrupt):
        run_tool_call(call("tool", key="a"), {"tool": tool}, timeout=5, max_chars=None,
                      event_loop=event_loop_thread if on_loop else None)
    assert _loop_is_alive(event_loop_thread)


async def sleepy(key: str) -> str:
    """Sleeps far too long.

    Args:
        key: anything
    """
    await asyncio.sleep(30)
    return "late"


async def fetch(key: str) -> dict:
    """Fetches a record.

    Args:
        key: the record's key
    """
    await asyncio.sleep(0)
    return {"key": key}


@pytest.mark.parametrize("execution", ["main", "thread"])
@pytest.mark.parametrize("on_loop", [True, False], ids=["grpo_event_loop", "own_event_loop"])
def test_async_tools_work_and_time_out_in_both_modes(event_loop_thread, execution, on_loop):
    loop = event_loop_thread if on_loop else None
    tools = {"fetch": fetch, "sleepy": sleepy}
    ok = run_tool_call(call("fetch", key="a"), tools, timeout=5, max_chars=None, execution=execution, event_loop=loop)
    late = run_tool_call(call("sleepy", key="a"), tools, timeout=0.1, max_chars=None, execution=execution,
                         event_loop=loop)
    assert (ok.content, ok.failed) == ("{'key': 'a'}", False)
    assert late.failed and "timed out after 0.1 s" in late.content


def test_sys_exit_in_a_tool_does_not_end_training(tmp_path):
    def shutdown(reason: str) -> str:
        """Shuts the machine down.

        Args:
            reason: why
        """
        sys.exit(f"shutting down: {reason}")

    replies = {FIRST_TURN: [tool_call("shutdown", reason="done")] * 2, AFTER_TOOL: ["Bye."] * 2}
    model, tok = tiny()
    recorder = Recorder()
    trainer = TreeOPSDTrainer(
        model=model, reward_funcs=recorder, args=config(TreeOPSDConfig, tmp_path, num_branches=0),
        train_dataset=arithmetic_dataset(1), processing_class=tok, tools=[shutdown],
    )
    trainer.generation_engine = scripted_engine(tok, replies)
    trainer.train()
    assert trainer.state.global_step == 1
    assert recorder.completions[0][1]["content"] == str({"error": "SystemExit: shutting down: done"})


# ---------------------------------------------------------------- tool metrics


def test_a_branch_inherits_the_tool_calls_of_its_shared_prefix():
    loop = TurnLoop(
        TurnLoopPorts(
            ScriptedEngine(lambda prefix: [5, 2], eos_ids=[2]),
            parse=lambda ids, prefix: (
                {"role": "assistant", "content": "", "tool_calls": [call("lookup", key="a"), call("missing")]}
                if len(prefix) == 1 else {"role": "assistant", "content": "done"}
            ),
            observation_ids=lambda messages: [9],
        ),
        SamplerSettings(max_turns=3, max_completion_length=50),
    )
    branch = Branch(tree=0, prefix_ids=[1], prompt_len=1, tools={"lookup": returning(1)})
    loop.run([branch])
    assert (branch.tool_calls, branch.tool_failures) == (2, 1)
    after_call, from_prompt = branch.restart_at(1), branch.restart_at(0)
    assert (after_call.tool_calls, after_call.tool_failures) == (2, 1)
    assert (from_prompt.tool_calls, from_prompt.tool_failures) == (0, 0)
    loop.run([after_call])
    assert (after_call.tool_calls, after_call.tool_failures) == (2, 1)  # its answer made no call of its own


def test_tool_metrics_count_every_leaf_history_as_grpo_counts_completions(tmp_path):
    # The tree (M = 2, N = 1): τ1 calls 1/0 (fails) then answers; τ2 gives up; τ1's branch at turn 1 shares τ1's
    # failed call and answers 3; τ2's branch (from the prompt) calls 1+1 and answers. Its four leaves, as four GRPO
    # completions: calls 1, 0, 1, 1 and failures 1, 0, 1, 0.
    divide_by_zero = tool_call("calculator", expression="1/0")
    tree_replies = {  # τ2's branch starts when τ2 ends, so it answers before τ1's branch
        FIRST_TURN: [divide_by_zero, "I do not know.", CALL_1_PLUS_1],
        AFTER_TOOL: ["The answer is 2.", "The answer is 2.", "The answer is 3."],
    }
    grpo_replies = {
        FIRST_TURN: [divide_by_zero, "I do not know.", divide_by_zero, CALL_1_PLUS_1],
        AFTER_TOOL: ["The answer is 2.", "The answer is 3.", "The answer is 2."],
    }
    tree_trainer, tree = tree_generation(tmp_path, [calculator], tree_replies, num_initial_rollouts=2, num_branches=1)
    grpo_trainer, grpo = grpo_generation(tmp_path, [calculator], grpo_replies, num_generations=4)

    assert tree.completions == grpo.completions  # the same four conversations
    for name, expected in (("tools/call_frequency", 3 / 4), ("tools/failure_frequency", 2 / 3)):
        assert metrics(tree_trainer)[name] == pytest.approx([expected])
        assert metrics(grpo_trainer)[name] == pytest.approx([expected])
