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
loop when one is given.

Stateful environments (TRL's `environment_factory`): instances come from an `EnvironmentPool` (created once, reset per
batch, as GRPOTrainer's pool), and a tree's branches get the environment as it was at their anchor through the tree's
`TreeEnvironment`: a fork, a deep copy, or a replay of the branch's recorded tool calls on a fresh instance
(`environment_branching`).
"""

from __future__ import annotations

import asyncio
import copy
import inspect
import json
import logging
import threading
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

logger = logging.getLogger(__name__)

TRUNCATION_MARKER = "\n...[truncated: {n} more characters]"
MAX_OBSERVATION_CHARS = 16_384  # the TreeOPSD paper's cap on a retrieved observation (Appendix E.3)
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


# ---------------------------------------------------------------------------------------------------------------
# Branching stateful environments: pool, snapshots, replay
# ---------------------------------------------------------------------------------------------------------------

ENVIRONMENT_BRANCHING = ("auto", "fork", "copy", "replay")


class ReplayDivergenceWarning(RuntimeWarning):
    """A replayed environment did not reproduce the recorded history: same row and calls, different outputs."""


@dataclass
class RecordedCall:
    """A tool call a branch has run: replay re-runs it to rebuild the branch's environment.

    `turn` is the branch's turn that made the call (−1: made before the branch's first turn, e.g. in a TreeFlex node
    the branch was restored from); `content` and `failed` are what the call gave then, to compare with the replay.
    """

    turn: int
    call: dict
    content: Any
    failed: bool


class EnvironmentPool:
    """The trainer's environment instances, created once and reused, as GRPOTrainer's `_environment_pool`, and the
    rule (`branching`, one of `ENVIRONMENT_BRANCHING`) by which a branch gets a copy of one.

    `acquire(name)` hands out the next instance not yet used in this batch, creating one with the factory only when
    the batch needs more than exist; `release()` makes them all available to the next batch, which resets them. A tree
    needs one instance per trajectory that starts at the root or is rebuilt by replay, so the pool grows to that size
    in the first batch and then stays there.

    Args:
        factories: `{name: factory}` (GRPOTrainer's `environment_factories`; `None` is the single unnamed one).
        instances: `{name: [instances]}` to start from (GRPOTrainer's `_environment_pool`, seeded with its probes);
            the pool keeps using (and growing) these lists.
        branching: "fork", "copy", "replay" or "auto" (see `TreeEnvironment`).
    """

    def __init__(self, factories: dict, instances: dict | None = None, branching: str = "auto"):
        if branching not in ENVIRONMENT_BRANCHING:
            raise ValueError(f"environment_branching must be one of {ENVIRONMENT_BRANCHING}; got {branching!r}.")
        self.factories = factories
        self.instances = instances if instances is not None else {}
        self.branching = branching
        self._handed_out: dict = {}
        self._cannot_copy: set = set()  # "auto": environments whose deepcopy failed once are replayed from then on
        if branching == "fork":
            for pool in self.instances.values():
                if pool and not callable(getattr(pool[0], "fork", None)):
                    raise ValueError(_no_fork_message(pool[0]))

    def acquire(self, name=None):
        """An instance of environment `name` that no one else uses in this batch (not reset: the caller resets it)."""
        if name not in self.factories:
            raise ValueError(f"Unknown environment {name!r}; expected one of {list(self.factories)}.")
        pool = self.instances.setdefault(name, [])
        index = self._handed_out.get(name, 0)
        if index == len(pool):
            pool.append(self.factories[name]())
        self._handed_out[name] = index + 1
        return pool[index]

    def release(self) -> None:
        """Every instance is free again (call when nothing of the last batch uses its environments any more)."""
        self._handed_out = {}

    def size(self, name=None) -> int:
        """How many instances of environment `name` exist."""
        return len(self.instances.get(name, []))

    def copy(self, name, environment):
        """An independent copy of `environment` by the branching rule, or None when branches are to be replayed."""
        mode = "replay" if name in self._cannot_copy else self.branching
        if mode == "replay":
            return None
        if mode in ("auto", "fork") and callable(getattr(environment, "fork", None)):
            return environment.fork()
        if mode == "fork":
            raise TypeError(_no_fork_message(environment))
        try:
            return copy.deepcopy(environment)
        except Exception as e:
            if mode == "copy":
                raise TypeError(
                    f"environment_branching='copy', but copy.deepcopy of {type(environment).__name__} failed "
                    f"({type(e).__name__}: {e}), e.g. because it holds a socket to a remote session. Use "
                    "environment_branching='replay' (or 'auto'), or add a `fork(self)` method and use 'fork'."
                ) from e
            self._cannot_copy.add(name)
            logger.warning(
                "Environment %s cannot be deep-copied (%s: %s) and has no fork(): its branches are rebuilt by replay "
                "(a fresh instance reset with the row, then the branch's recorded tool calls re-run in order), which "
                "assumes a deterministic environment. Set environment_branching='replay' to skip the copy attempt.",
                type(environment).__name__, type(e).__name__, e,
            )
            return None


def _no_fork_message(environment) -> str:
    return (
        f"environment_branching='fork', but {type(environment).__name__} has no fork() method. Add `fork(self)` "
        "returning an independent copy (e.g. a new session with the same state), or use environment_branching="
        "'auto', 'copy' (copy.deepcopy) or 'replay' (re-run the branch's tool calls on a fresh instance)."
    )


class TreeEnvironment:
    """One tree's environments: where they come from (the pool), the dataset row they are reset with, and how a
    branch gets the environment as it was at its anchor.

    Every trajectory that starts at the root gets its own instance, reset with the tree's row, as GRPOTrainer resets
    one instance per rollout; no copy is made. A branch restarted before turn t > 0 needs the state after turns
    0..t−1. By the pool's `branching` rule:

    - "fork": the environment's own `fork()` of the snapshot taken before turn t;
    - "copy": `copy.deepcopy` of that snapshot;
    - "replay": no snapshots at all. A fresh instance is reset with the row and the branch's recorded tool calls of
      turns 0..t−1 are re-run on it in order. Their outputs are not shown to the model again (the history's token ids
      stay as recorded); an output that differs from the recorded one gives a `ReplayDivergenceWarning` naming the
      tool and the turn. Replay assumes a deterministic environment: the same row and the same calls give the same
      state and outputs (a reset that returns a different observation is warned about as well). It costs the
      replayed calls again, and is the only way to branch an environment that holds a remote session (a socket);
    - "auto" (default): `fork()` if the environment has one, else `copy.deepcopy`, else (the copy fails) replay.

    Snapshots are only taken when the sampler will branch (`Branch.take_snapshots`).

    Args:
        pool: the `EnvironmentPool` instances come from.
        name: the environment's name in the pool (None: the single `environment_factory`).
        row: the keyword arguments of `reset` (the dataset row, as GRPOTrainer passes it).
        run_call: `run_call(tool_call, tools) -> ToolResult`, how the turn loop runs a call (its limits apply).
    """

    def __init__(self, pool: EnvironmentPool, name, row: dict, run_call: Callable[[dict, dict], ToolResult]):
        self.pool, self.name, self.row, self.run_call = pool, name, row, run_call
        self.reset_observation: Any = None
        self._started = False

    def start(self):
        """An instance reset with the row: the root's (the first call, whose observation the prompt shows) or another
        trajectory's from the root."""
        environment = self.pool.acquire(self.name)
        observation = environment.reset(**self.row)
        if not self._started:
            self._started, self.reset_observation = True, observation
        elif not _same(observation, self.reset_observation):
            warnings.warn(
                f"{type(environment).__name__}.reset returned a different observation for the same row than it did "
                "for the tree's root, whose observation the prompt shows. Trajectories of one tree share the prompt, "
                "so reset must be deterministic given the row.",
                ReplayDivergenceWarning, stacklevel=2,
            )
        return environment

    def snapshot(self, environment):
        """A copy of `environment` to restart branches from later; None when branches will be rebuilt by replay."""
        return self.pool.copy(self.name, environment)

    def at(self, snapshot, calls: list[RecordedCall]):
        """The environment as it was at an anchor: a copy of the snapshot taken there, else (no snapshot, or it cannot
        be copied) a fresh instance with `calls` replayed."""
        if snapshot is not None:
            environment = self.pool.copy(self.name, snapshot)
            if environment is not None:
                return environment
        return self.replay(calls)

    def replay(self, calls: list[RecordedCall]):
        """A fresh instance reset with the row, with the environment's recorded calls re-run in order.

        Calls of standalone tools (not methods of the environment) and calls that named no tool of it are skipped:
        they did not touch its state.
        """
        environment = self.start()
        tools = {method.__name__: method for method in environment_tools(environment)}
        for recorded in calls:
            function = recorded.call.get("function") if isinstance(recorded.call, dict) else None
            name = function.get("name") if isinstance(function, dict) else None
            if name not in tools:
                continue
            result = self.run_call(recorded.call, tools)
            if result.failed != recorded.failed or not _same(result.content, recorded.content):
                where = f"turn {recorded.turn}" if recorded.turn >= 0 else "an earlier segment"
                warnings.warn(
                    f"Replaying tool '{name}' (call of {where}) on a fresh {type(environment).__name__} gave "
                    f"{shorten(result.content)!r}, but the branch recorded {shorten(recorded.content)!r}. Replay assumes "
                    "a deterministic environment (same row, same calls, same outputs): this branch continues from a "
                    "state that differs from its history. Give the environment a fork() method, make it deep-copyable, "
                    "or make its tools deterministic.",
                    ReplayDivergenceWarning, stacklevel=2,
                )
        return environment


def _same(a, b) -> bool:
    try:
        return bool(a == b)
    except Exception:  # e.g. arrays without a single truth value
        return False


def shorten(value, n: int = 120) -> str:
    """`str(value)` cut to `n` characters with an ellipsis, for error and warning messages that quote model output."""
    text = str(value)
    return text if len(text) <= n else text[: n - 1] + "…"
