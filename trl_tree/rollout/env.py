"""Tool calls from the model: untrusted input, run the way TRL's GRPOTrainer runs them.

Only registered tools run; arguments are checked against the tool's signature before the call. Whatever a tool does —
return any value, raise any exception (`SystemExit` and `GeneratorExit` included), hang past its timeout, return an
enormous string — the result is a tool message, never a crash of the training run. The one exception is
`KeyboardInterrupt`: the user stopping the run is re-raised, from the thread that called the tool.

As in GRPOTrainer's tool loop, the tool message's content is the tool's return value itself when it is a list (content
blocks), else `str(value)`, and a failure is `str({"error": message})`; that is what reward functions receive in
`completions`. The model sees the same message cut at `max_observation_chars`. Synchronous tools run in the calling
thread by default, as in GRPOTrainer, so a tool can time itself out with `signal.alarm`; `execution="thread"` runs
them in a worker thread that we can stop waiting for (`timeout`). Async tools run on GRPOTrainer's background event
loop when one is given. Stateful environments (TRL's `environment_factory`) are branched by `fork_environment`.
"""

from __future__ import annotations

import asyncio
import copy
import inspect
import json
import threading
from collections.abc import Callable
from dataclasses import dataclass

TRUNCATION_MARKER = "\n...[truncated: {n} more characters]"
TOOL_EXECUTION_MODES = ("main", "thread")


@dataclass
class ToolResult:
    """One tool call's outcome.

    `content` is the tool message's content as GRPOTrainer builds it (the return value if it is a list, else
    `str(value)`; `str({"error": ...})` for a failure), never truncated: what reward functions and completion logs
    receive. `observation` is what the model
    sees: `content` cut at `max_observation_chars` with a marker (a list is passed to the chat template as it is).
    """

    name: str
    content: str | list
    failed: bool
    observation: str | list | None = None

    def __post_init__(self):
        if self.observation is None:
            self.observation = self.content

    @property
    def message(self) -> dict:
        """The tool message of the conversation (reward functions, logs)."""
        return {"role": "tool", "name": self.name, "content": self.content}

    @property
    def observation_message(self) -> dict:
        """The tool message the chat template renders into the model's observation tokens."""
        return {"role": "tool", "name": self.name, "content": self.observation}


def truncate_observation(text: str, max_chars: int) -> str:
    """Cap a tool's output at `max_chars` characters, saying how much was dropped."""
    if max_chars is None or len(text) <= max_chars:
        return text
    return text[:max_chars] + TRUNCATION_MARKER.format(n=len(text) - max_chars)


def tool_message_content(value) -> str | list:
    """The content GRPOTrainer puts in a tool message: a list (content blocks) as it is, anything else `str(value)`."""
    return value if isinstance(value, list) else str(value)


def _tool_result(name: str, value, failed: bool, max_chars: int | None) -> ToolResult:
    content = tool_message_content(value)
    observation = truncate_observation(content, max_chars) if isinstance(content, str) else content
    return ToolResult(name, content, failed, observation)


def error_result(name: str, message: str, max_chars: int | None = None) -> ToolResult:
    """A failed call, worded as GRPOTrainer words it: the tool message's content is `str({"error": message})`."""
    return _tool_result(name, {"error": message}, True, max_chars)


def _describe(error: BaseException) -> str:
    """An exception as the model reads it: its message, or its type when it has none (`sys.exit()`)."""
    text = str(error)
    if text and isinstance(error, Exception):
        return text
    return f"{type(error).__name__}: {text}" if text else type(error).__name__


def _run_in_worker(fn: Callable, kwargs: dict, timeout: float | None):
    """Run `fn(**kwargs)` in a daemon thread; raise TimeoutError if it does not return within `timeout` seconds.

    Python cannot kill a thread: a hung tool keeps its thread until it returns, but the rollout goes on. Whatever the
    tool raises is caught in the worker (no thread traceback) and re-raised here, in the calling thread.
    """
    box: dict = {}

    def target():
        try:
            box["value"] = fn(**kwargs)
        except BaseException as e:  # noqa: BLE001 - re-raised in the calling thread below
            box["error"] = e

    thread = threading.Thread(target=target, daemon=True, name=f"tool-{getattr(fn, '__name__', 'call')}")
    thread.start()
    thread.join(timeout)
    if thread.is_alive():
        raise TimeoutError(f"timed out after {timeout:g} s")
    if "error" in box:
        raise box["error"]
    return box["value"]


async def _settle(awaitable):
    """Await a tool inside its own task and return `(ok, value or exception)`.

    asyncio re-raises a task's `SystemExit` / `KeyboardInterrupt` out of the event loop, which would stop GRPOTrainer's
    shared loop thread for good; caught here, in the task that runs the tool, they reach the caller as values.
    Cancellation is not caught: it is how `wait_for` times the tool out and how `asyncio.run` turns Ctrl-C into
    KeyboardInterrupt.
    """
    try:
        return True, await awaitable
    except asyncio.CancelledError:
        raise
    except BaseException as e:  # noqa: BLE001 - handed to the caller
        return False, e


async def _settle_within(awaitable, timeout: float | None):
    try:
        return await asyncio.wait_for(_settle(awaitable), timeout)
    except asyncio.TimeoutError:
        return False, TimeoutError(f"timed out after {timeout:g} s")


def _await_tool(awaitable, timeout: float | None, event_loop: asyncio.AbstractEventLoop | None):
    """Run an async tool to completion: on `event_loop` (GRPOTrainer's `async_loop`, a daemon thread: tools that keep
    loop-bound clients between calls need the same loop every time), else on a new loop in this thread. The timeout
    cancels the tool at its next `await`; a tool that blocks the loop without awaiting cannot be timed out."""
    settled = _settle_within(awaitable, timeout)
    if event_loop is None:
        ok, value = asyncio.run(settled)
    else:
        ok, value = asyncio.run_coroutine_threadsafe(settled, event_loop).result()
    if not ok:
        raise value
    return value


def _call_tool(fn: Callable, kwargs: dict, timeout: float | None, execution: str, event_loop):
    """Call a tool and return its raw value, raising what it raises.

    A synchronous tool runs in this thread (`execution="main"`, GRPOTrainer's way: `signal`-based timeouts inside
    the tool work, but `timeout` cannot stop a tool that hangs) or in a worker thread (`"thread"`: `timeout` is
    enforced, `signal.signal` raises ValueError). An async tool — or a tool returning an awaitable — is awaited with
    `timeout` in either mode.
    """
    if inspect.iscoroutinefunction(fn):
        return _await_tool(fn(**kwargs), timeout, event_loop)
    value = _run_in_worker(fn, kwargs, timeout) if execution == "thread" else fn(**kwargs)
    return _await_tool(value, timeout, event_loop) if inspect.isawaitable(value) else value


def _check_arguments(fn: Callable, arguments) -> dict:
    if isinstance(arguments, str):  # some parsers leave JSON arguments as a string
        try:
            arguments = json.loads(arguments)
        except json.JSONDecodeError as e:
            raise ValueError(f"arguments are not valid JSON ({e.msg})") from None
    if not isinstance(arguments, dict):
        raise ValueError(f"arguments must be a JSON object, got {type(arguments).__name__}")
    try:
        inspect.signature(fn).bind(**arguments)
    except TypeError as e:
        raise ValueError(f"bad arguments: {e}") from None
    return arguments


def check_tool_execution(execution: str) -> None:
    if execution not in TOOL_EXECUTION_MODES:
        raise ValueError(
            f"tool_execution must be one of {TOOL_EXECUTION_MODES}; got {execution!r}: 'main' runs synchronous tools in "
            "the calling thread (as GRPOTrainer; signal-based timeouts work, tool_timeout cannot stop a hung tool), "
            "'thread' in a worker thread (tool_timeout is enforced, signal does not work)."
        )


def run_tool_call(
    tool_call: dict, tools: dict[str, Callable], timeout: float | None, max_chars: int | None,
    execution: str = "main", event_loop: asyncio.AbstractEventLoop | None = None,
) -> ToolResult:
    """Run one parsed tool call (`{"type": "function", "function": {"name", "arguments"}}`) safely.

    `timeout` applies to async tools always and to synchronous ones with `execution="thread"` (see `_call_tool`);
    `max_chars` cuts what the model sees (`ToolResult.observation`), not the content reward functions receive.
    Re-raises only KeyboardInterrupt.
    """
    check_tool_execution(execution)
    function = tool_call.get("function") if isinstance(tool_call, dict) else None
    name = function.get("name") if isinstance(function, dict) else None
    kind = tool_call.get("type", "function") if isinstance(tool_call, dict) else None
    if kind != "function":
        return error_result(str(name or "unknown"), f"Unsupported tool call type: {kind}")
    if not isinstance(name, str):
        return error_result("unknown", "Malformed tool call: it names no function.")
    if name not in tools:
        available = ", ".join(sorted(tools)) or "none"
        return error_result(name, f"Tool {name} not found. Available tools: {available}.")
    try:
        arguments = _check_arguments(tools[name], function.get("arguments", {}))
        value = _call_tool(tools[name], arguments, timeout, execution, event_loop)
    except KeyboardInterrupt:
        raise  # the user stops the run; not something the model did
    except BaseException as e:  # noqa: BLE001 - SystemExit, GeneratorExit, ...: the model sees the error, the run goes on
        return error_result(name, _describe(e), max_chars)
    return _tool_result(name, value, False, max_chars)


def environment_tools(environment) -> list[Callable]:
    """The public methods of a TRL environment instance that are exposed as tools (as GRPOTrainer does)."""
    return [
        getattr(environment, name)
        for name, _ in inspect.getmembers(type(environment), predicate=inspect.isfunction)
        if name not in ("reset", "get_reward", "fork") and not name.startswith("_")
    ]


def fork_environment(environment):
    """An independent copy of a stateful environment, so a branch sees the state as it was at its anchor.

    Uses the environment's own `fork()` when it has one, else `copy.deepcopy`.
    """
    if callable(getattr(environment, "fork", None)):
        return environment.fork()
    try:
        return copy.deepcopy(environment)
    except Exception as e:
        raise TypeError(
            f"Cannot branch the environment {type(environment).__name__}: it has no fork() method and "
            f"copy.deepcopy failed ({type(e).__name__}: {e}). Tree sampling restarts branches from intermediate "
            "turns, so the environment's state must be copyable: add a `fork(self)` method that returns an "
            "independent copy (e.g. reopening connections), or make its state deep-copyable."
        ) from e
