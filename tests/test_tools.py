"""Tool calls are untrusted input (docs/design.md §5): each failure becomes an observation, never a crash."""

import threading
import time

import pytest

from trl_tree.rollout.acting.env_branching import fork_environment
from trl_tree.rollout.acting.tools import TRUNCATION_MARKER, ToolFatalError, run_tool_call


def add(a: int, b: int) -> str:
    """Adds two numbers.

    Args:
        a: first
        b: second
    """
    return str(a + b)


def boom(x: str) -> str:
    """Always fails.

    Args:
        x: anything
    """
    raise RuntimeError("database is on fire")


_release = threading.Event()


def hang(x: str) -> str:
    """Never returns in time.

    Args:
        x: anything
    """
    _release.wait(10)
    return "late"


def huge(x: str) -> str:
    """Returns a lot.

    Args:
        x: anything
    """
    return "y" * 100_000


TOOLS = {f.__name__: f for f in (add, boom, hang, huge)}


def call(name, **arguments):
    return {"type": "function", "function": {"name": name, "arguments": arguments}}


def test_a_registered_tool_runs():
    r = run_tool_call(call("add", a=2, b=3), TOOLS, timeout=5, max_chars=100)
    assert (r.content, r.failed) == ("5", False)


def test_a_tool_that_raises_becomes_an_error_observation_worded_as_grpo():
    r = run_tool_call(call("boom", x="1"), TOOLS, timeout=5, max_chars=1000)
    assert r.failed and r.content == str({"error": "database is on fire"})  # GRPOTrainer's tool message


def test_a_tool_that_hangs_times_out_in_a_worker_thread():
    start = time.monotonic()
    r = run_tool_call(call("hang", x="1"), TOOLS, timeout=0.3, max_chars=1000, execution="thread")
    _release.set()
    assert r.failed and "timed out after 0.3 s" in r.content
    assert time.monotonic() - start < 3


def test_an_enormous_output_is_truncated_with_a_marker_for_the_model_only():
    r = run_tool_call(call("huge", x="1"), TOOLS, timeout=5, max_chars=50)
    assert not r.failed
    assert r.observation == "y" * 50 + TRUNCATION_MARKER.format(n=100_000 - 50)
    assert r.content == "y" * 100_000  # reward functions get the tool's whole output, as in GRPOTrainer


@pytest.mark.parametrize(
    ("tool_call", "message"),
    [
        (call("rm_rf", path="/"), "Tool rm_rf not found. Available tools: add, boom, hang, huge"),
        (call("add", a=1), "bad arguments"),
        (call("add", a=1, b=2, c=3), "bad arguments"),
        ({"type": "function", "function": {"name": "add", "arguments": "{not json"}}, "not valid JSON"),
        ({"type": "function", "function": {"name": "add", "arguments": [1, 2]}}, "must be a JSON object"),
        ({"type": "function", "function": "add"}, "Malformed tool call: it names no function"),
        ({"type": "code", "function": {"name": "add"}}, "Unsupported tool call type: code"),
    ],
)
def test_unregistered_tools_and_bad_arguments_never_run(tool_call, message):
    r = run_tool_call(tool_call, TOOLS, timeout=5, max_chars=1000)
    assert r.failed and r.content.startswith("{'error': ") and message in r.content


def test_json_string_arguments_are_accepted():
    r = run_tool_call({"type": "function", "function": {"name": "add", "arguments": '{"a": 1, "b": 1}'}}, TOOLS, 5, 100)
    assert r.content == "2"


class Counter:
    def __init__(self):
        self.n = 0


class Forkable(Counter):
    def fork(self):
        other = Forkable()
        other.n = self.n + 100  # proves fork() is preferred over deepcopy
        return other


class Unforkable(Counter):
    def __init__(self):
        super().__init__()
        self.lock = threading.Lock()  # locks cannot be deep-copied


def test_fork_prefers_the_environments_own_fork_then_deepcopy():
    c = Counter()
    c.n = 3
    copy = fork_environment(c)
    copy.n += 1
    assert (c.n, copy.n) == (3, 4)
    assert fork_environment(Forkable()).n == 100


def test_an_environment_that_cannot_be_forked_says_what_to_do():
    with pytest.raises(TypeError, match="add a `fork\\(self\\)` method"):
        fork_environment(Unforkable())


def dependency_gone(x: str) -> str:
    """Fails because what it needs is gone.

    Args:
        x: anything
    """
    raise ToolFatalError("the retrieval server at http://127.0.0.1:1 is gone")


async def async_dependency_gone(x: str) -> str:
    """Fails, asynchronously, because what it needs is gone.

    Args:
        x: anything
    """
    raise ToolFatalError("the retrieval server at http://127.0.0.1:1 is gone")


@pytest.mark.parametrize("execution", ["main", "thread"])
@pytest.mark.parametrize("tool", [dependency_gone, async_dependency_gone])
def test_a_tool_fatal_error_escapes_the_guard_and_stops_the_run(tool, execution):
    """Any other exception is the model's observation; ToolFatalError says the run cannot go on (every later call
    would fail the same way), so it reaches the trainer in every execution mode, sync or async."""
    with pytest.raises(ToolFatalError, match="retrieval server"):
        run_tool_call(call(tool.__name__, x="1"), {tool.__name__: tool}, timeout=5, max_chars=100, execution=execution)
