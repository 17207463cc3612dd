"""Tool calls from the model: untrusted input (DESIGN §5).

Only registered tools run; arguments are checked against the tool's signature before the call; a tool that raises,
hangs past its timeout or returns an enormous string becomes an error or truncated observation the model sees, never
a crash of the training run. Stateful environments (TRL's `environment_factory`) are branched by `fork_environment`.
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


@dataclass
class ToolResult:
    name: str
    content: str
    failed: bool


def truncate_observation(text: str, max_chars: int) -> str:
    """Cap a tool's output at `max_chars` characters, saying how much was dropped."""
    if max_chars is None or len(text) <= max_chars:
        return text
    return text[:max_chars] + TRUNCATION_MARKER.format(n=len(text) - max_chars)


def _run_with_timeout(fn: Callable, kwargs: dict, timeout: float | None):
    """Run `fn(**kwargs)` in a daemon thread; raise TimeoutError if it does not return within `timeout` seconds.

    Python cannot kill a thread: a hung tool keeps its thread until it returns, but the rollout goes on.
    """
    if timeout is None:
        result = fn(**kwargs)
        return asyncio.run(result) if inspect.isawaitable(result) else result
    box: dict = {}

    def target():
        try:
            result = fn(**kwargs)
            box["value"] = asyncio.run(result) if inspect.isawaitable(result) else result
        except BaseException as e:  # noqa: BLE001 - reported to the model as an error observation
            box["error"] = e

    thread = threading.Thread(target=target, daemon=True)
    thread.start()
    thread.join(timeout)
    if thread.is_alive():
        raise TimeoutError(f"timed out after {timeout:g} s")
    if "error" in box:
        raise box["error"]
    return box["value"]


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


def run_tool_call(
    tool_call: dict, tools: dict[str, Callable], timeout: float | None, max_chars: int | None
) -> ToolResult:
    """Run one parsed tool call (`{"type": "function", "function": {"name", "arguments"}}`) safely."""
    function = tool_call.get("function") if isinstance(tool_call, dict) else None
    name = function.get("name") if isinstance(function, dict) else None
    if not isinstance(name, str) or tool_call.get("type", "function") != "function":
        return ToolResult(str(name or "unknown"), "Error: malformed tool call.", failed=True)
    if name not in tools:
        available = ", ".join(sorted(tools)) or "none"
        return ToolResult(name, f"Error: unknown tool '{name}'. Available tools: {available}.", failed=True)
    try:
        arguments = _check_arguments(tools[name], function.get("arguments", {}))
        result = _run_with_timeout(tools[name], arguments, timeout)
    except Exception as e:  # noqa: BLE001 - the model sees the error, the run goes on
        return ToolResult(name, truncate_observation(f"Error: tool '{name}' failed: {e}", max_chars), failed=True)
    content = result if isinstance(result, str) else json.dumps(result, default=str)
    return ToolResult(name, truncate_observation(content, max_chars), failed=False)


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
