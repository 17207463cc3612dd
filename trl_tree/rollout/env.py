"""Tool calls from the model: untrusted input (DESIGN §5).

Only registered tools run; arguments are checked against the tool's signature before the call; a tool that raises,
hangs past its timeout or returns an enormous string becomes an error or truncated observation the model sees, never
a crash of the training run.

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
                    f"{_short(result.content)!r}, but the branch recorded {_short(recorded.content)!r}. Replay assumes "
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


def _short(value, n: int = 120) -> str:
    text = str(value)
    return text if len(text) <= n else text[: n - 1] + "…"
