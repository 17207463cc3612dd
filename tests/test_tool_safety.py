"""Nothing a tool does may escape or hang training (the reliability issue, items 5-9): deadlines are enforced by the
caller in every mode, converting a tool's value to text is guarded, arguments are checked against the annotated
types, and the tool calls of one turn are capped."""

import asyncio
import signal
import threading
import time
from types import SimpleNamespace
from typing import Any, Literal, Optional

import pytest

from tests.scripted import config
from trl_tree import TreeOPSDConfig
from trl_tree.rollout.acting.tools import run_tool_call
from trl_tree.rollout.growing.turn_loop import Branch, SamplerSettings, TurnLoop, TurnLoopPorts
from trl_tree.testing import ScriptedEngine
from trl_tree.trainer.base import TreeTrainer

needs_sigalrm = pytest.mark.skipif(not hasattr(signal, "setitimer"), reason="no SIGALRM on this platform")


def call(name, **arguments):
    return {"type": "function", "function": {"name": name, "arguments": arguments}}


# ---------------------------------------------------------------- 5. an async tool that swallows cancellation


stubborn_finished = threading.Event()


async def stubborn(key: str) -> str:
    """Ignores being cancelled and answers late.

    Args:
        key: anything
    """
    try:
        await asyncio.sleep(5)
    except asyncio.CancelledError:
        await asyncio.sleep(1.5)  # keeps working after the timeout cancelled it
    stubborn_finished.set()
    return "late"


async def quick(key: str) -> str:
    """Answers at once.

    Args:
        key: anything
    """
    return "quick"


@pytest.mark.parametrize("on_loop", [True, False], ids=["grpo_event_loop", "own_event_loop"])
def test_an_async_tool_that_swallows_cancellation_still_times_out_at_the_deadline(event_loop_thread, on_loop):
    # async tools take the same path in both execution modes (_await_tool)
    loop = event_loop_thread if on_loop else None
    tools = {"stubborn": stubborn, "quick": quick}
    stubborn_finished.clear()
    start = time.monotonic()
    late = run_tool_call(call("stubborn", key="a"), tools, timeout=0.5, max_chars=None, event_loop=loop)
    elapsed = time.monotonic() - start
    assert late.failed and "timed out after 0.5 s" in late.content
    assert elapsed < 1.4  # the deadline, not the tool, decides when the call ends
    start = time.monotonic()
    after = run_tool_call(call("quick", key="a"), tools, timeout=5, max_chars=None, event_loop=loop)
    assert (after.content, after.failed) == ("quick", False)
    assert time.monotonic() - start < 1  # the stray coroutine does not hold up the next call
    assert stubborn_finished.wait(5)  # the stray did finish, later ...
    assert late.failed and late.content == str({"error": "timed out after 0.5 s"})  # ... and its "late" went nowhere


# ---------------------------------------------------------------- 6. a value that cannot become text


class Unprintable:
    def __str__(self):
        raise RuntimeError("cannot print me")

    __repr__ = __str__


def _returning(value):
    def lookup(key: str):
        """Returns a value.

        Args:
            key: anything
        """
        return value

    return lookup


@pytest.mark.parametrize(
    "value", [Unprintable(), {"row": Unprintable()}, [Unprintable()]], ids=["object", "in_a_dict", "in_content_blocks"]
)
def test_a_value_whose_str_raises_becomes_an_error_observation_naming_tool_and_exception(value):
    r = run_tool_call(call("lookup", key="a"), {"lookup": _returning(value)}, timeout=5, max_chars=100)
    assert r.failed and isinstance(r.content, str)
    assert "lookup" in r.content and "RuntimeError" in r.content and "cannot print me" in r.content


class Mysterious(Exception):
    def __str__(self):
        raise ValueError("no message for you")


def raises_mysterious(key: str) -> str:
    """Raises an exception that cannot be printed.

    Args:
        key: anything
    """
    raise Mysterious()


def test_an_exception_whose_str_raises_becomes_an_error_observation():
    r = run_tool_call(call("raises_mysterious", key="a"), {"raises_mysterious": raises_mysterious}, 5, 100)
    assert r.failed and "Mysterious" in r.content


# ---------------------------------------------------------------- 7. arguments are checked against annotated types


def typed(
    text: str = "",
    count: int = 0,
    ratio: float = 0.0,
    flag: bool = False,
    items: list[int] = (),
    table: dict[str, int] = None,
    maybe: int | None = None,
    opt: Optional[str] = None,  # noqa: UP045 - both spellings
    mode: Literal["fast", "slow"] = "fast",
    anything: Any = None,
    untyped=None,
    later: "Undefined" = None,  # noqa: F821
) -> str:
    """Takes one argument of each kind.

    Args:
        text: a string
    """
    return "ok"


@pytest.mark.parametrize(
    ("arguments", "expected", "got"),
    [
        ({"text": {"a": 1}}, "str", "got dict"),
        ({"count": "abc"}, "int", "got str"),
        ({"count": "3"}, "int", "got str"),  # no string-to-number coercion
        ({"count": True}, "int", "got bool"),  # bool is not an int
        ({"count": 1.5}, "int", "got float"),
        ({"count": None}, "int", "got None"),
        ({"ratio": "1.0"}, "float", "got str"),
        ({"ratio": False}, "float", "got bool"),
        ({"flag": 1}, "bool", "got int"),
        ({"items": "1,2"}, "list[int]", "got str"),
        ({"items": [1, "a"]}, "list[int]", "got list"),
        ({"table": [1]}, "dict[str, int]", "got list"),
        ({"table": {"a": "x"}}, "dict[str, int]", "got dict"),
        ({"maybe": "3"}, "int | None", "got str"),
        ({"opt": 3}, "str | None", "got int"),
        ({"mode": "medium"}, "'fast', 'slow'", "got str"),
    ],
)
def test_an_argument_of_the_wrong_type_is_a_bad_arguments_observation(arguments, expected, got):
    r = run_tool_call(call("typed", **arguments), {"typed": typed}, timeout=5, max_chars=None)
    (name,) = arguments
    assert r.failed and "bad arguments" in r.content
    assert f"'{name}'" in r.content and expected in r.content and got in r.content


@pytest.mark.parametrize(
    "arguments",
    [
        {"text": "x", "count": 3, "ratio": 1.5, "flag": False, "items": [], "table": {}},
        {"ratio": 1},  # an int is a JSON number: fine for a float
        {"items": [1, 2], "table": {"a": 1}, "maybe": 3, "opt": "x", "mode": "slow"},
        {"maybe": None, "opt": None, "table": None},  # None where the default is None
        {"anything": {"x": [1]}, "untyped": [1, "a"], "later": 3},  # Any, no annotation, unresolvable: unchecked
    ],
)
def test_arguments_of_the_annotated_types_run(arguments):
    r = run_tool_call(call("typed", **arguments), {"typed": typed}, timeout=5, max_chars=None)
    assert (r.content, r.failed) == ("ok", False)


# ---------------------------------------------------------------- 8. tool calls per turn are capped


def _loop(calls: int, **settings):
    ran = []

    def count(key: str) -> str:
        """Counts its calls.

        Args:
            key: anything
        """
        ran.append(key)
        return key

    loop = TurnLoop(
        TurnLoopPorts(
            ScriptedEngine(lambda prefix: [5, 2], eos_ids=[2]),
            parse=lambda ids, prefix: (
                {"role": "assistant", "content": "", "tool_calls": [call("count", key=str(i)) for i in range(calls)]}
                if len(prefix) == 1
                else {"role": "assistant", "content": "done"}
            ),
            observation_ids=lambda messages: [9],
        ),
        SamplerSettings(max_turns=3, max_completion_length=50, **settings),
    )
    branch = Branch(tree=0, prefix_ids=[1], prompt_len=1, tools={"count": count})
    loop.run([branch])
    return branch, ran


def test_tool_calls_beyond_the_per_turn_cap_are_answered_with_errors_not_run():
    branch, ran = _loop(30, max_tool_calls_per_turn=3)
    assert ran == ["0", "1", "2"]
    tool_messages = [m for m in branch.messages if m["role"] == "tool"]
    assert len(tool_messages) == 30  # every call still has its tool message: the chat stays well-formed
    assert all("max_tool_calls_per_turn" in m["content"] and "3" in m["content"] for m in tool_messages[3:])
    assert (branch.tool_calls, branch.tool_failures) == (30, 27)  # capped calls count as failed calls


def test_the_per_turn_cap_defaults_to_eight_and_none_lifts_it():
    assert len(_loop(30)[1]) == 8
    assert len(_loop(30, max_tool_calls_per_turn=None)[1]) == 30


def test_the_cap_is_a_config_field_carried_to_the_turn_loop(tmp_path):
    assert TreeOPSDConfig.max_tool_calls_per_turn == 8
    args = config(TreeOPSDConfig, tmp_path, max_tool_calls_per_turn=2)
    ports = TurnLoopPorts(ScriptedEngine(lambda prefix: [2], eos_ids=[2]), lambda ids, prefix: {}, lambda m: [])
    trainer = SimpleNamespace(args=args, max_completion_length=96, turn_loop_ports=lambda engine=None, **_: ports)
    assert TreeTrainer._build_turn_loop(trainer).settings.max_tool_calls_per_turn == 2
    with pytest.raises(ValueError, match="max_tool_calls_per_turn must be"):
        config(TreeOPSDConfig, tmp_path, max_tool_calls_per_turn=0)


# ---------------------------------------------------------------- 9. a hung sync tool in the default "main" mode


def sleeper(seconds: float) -> str:
    """Sleeps.

    Args:
        seconds: how long
    """
    threading.Event().wait(seconds)
    return "awake"


def spinner(seconds: float) -> str:
    """Busy-loops in Python.

    Args:
        seconds: how long
    """
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        pass
    return "done spinning"


def swallower(seconds: float) -> str:
    """Catches every Exception, as careless tools do.

    Args:
        seconds: how long
    """
    try:
        time.sleep(seconds)
    except Exception:  # noqa: BLE001 - the point of the test
        return "swallowed"
    return "awake"


HUNG = {f.__name__: f for f in (sleeper, spinner, swallower)}


@needs_sigalrm
@pytest.mark.parametrize("name", sorted(HUNG))
def test_a_hung_sync_tool_times_out_in_the_main_thread_by_default(name):
    start = time.monotonic()
    r = run_tool_call(call(name, seconds=5.0), HUNG, timeout=0.5, max_chars=None)  # execution="main", the default
    assert r.failed and "timed out after 0.5 s" in r.content
    assert time.monotonic() - start < 3


@needs_sigalrm
def test_the_main_thread_deadline_restores_the_callers_handler_and_timer():
    def callers_handler(signum, frame):
        raise AssertionError("the caller's timer fired during the test")

    previous = signal.signal(signal.SIGALRM, callers_handler)
    signal.setitimer(signal.ITIMER_REAL, 100)
    try:
        fast = run_tool_call(call("sleeper", seconds=0.0), HUNG, timeout=5, max_chars=None)
        slow = run_tool_call(call("sleeper", seconds=5.0), HUNG, timeout=0.3, max_chars=None)
        assert (fast.content, fast.failed) == ("awake", False) and slow.failed
        assert signal.getsignal(signal.SIGALRM) is callers_handler
        assert 90 < signal.getitimer(signal.ITIMER_REAL)[0] <= 100  # still running, less the time the calls took
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)


def test_a_hung_sync_tool_times_out_in_main_mode_off_the_main_thread():
    box = {}
    thread = threading.Thread(
        target=lambda: box.update(r=run_tool_call(call("sleeper", seconds=5.0), HUNG, 0.5, None))
    )
    start = time.monotonic()
    thread.start()
    thread.join(10)
    assert box["r"].failed and "timed out after 0.5 s" in box["r"].content
    assert time.monotonic() - start < 3


@needs_sigalrm
def test_no_timeout_means_no_deadline_and_no_timer():
    r = run_tool_call(call("sleeper", seconds=0.2), HUNG, timeout=None, max_chars=None)
    assert (r.content, r.failed) == ("awake", False)
    assert signal.getitimer(signal.ITIMER_REAL) == (0.0, 0.0)
