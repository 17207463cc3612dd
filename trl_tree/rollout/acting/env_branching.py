"""Stateful environments (TRL's `environment_factory`) in a tree: the pool, snapshots, replay.

Instances come from an `EnvironmentPool` (created once, reset per batch, as GRPOTrainer's pool), and a tree's branches
get the environment as it was at their anchor through the tree's `TreeEnvironment`: a fork, a deep copy, or a replay of
the branch's recorded tool calls on a fresh instance (`environment_branching`). No default may let two branches share
state: "auto" deep-copies only an environment that says it may be copied or whose state is plain local data
(`copy_blocker`), and a replay that does not reproduce a branch's history marks the branch diverged
(`replay_divergence`), so it is not trained as if consistent. Running the calls themselves is `tools.py`'s.
"""

from __future__ import annotations

import collections
import contextlib
import copy
import dataclasses
import datetime
import decimal
import enum
import fractions
import inspect
import io
import logging
import pathlib
import random
import re
import socket
import sys
import threading
import types
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from ...text import shorten
from .tools import ToolResult, _safe_str

logger = logging.getLogger(__name__)


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
REPLAY_DIVERGENCE = ("drop", "raise")


def check_replay_divergence(policy: str) -> None:
    if policy not in REPLAY_DIVERGENCE:
        raise ValueError(
            f"replay_divergence must be one of {REPLAY_DIVERGENCE}; got {policy!r}: 'drop' leaves a branch whose "
            "replayed environment disagrees with its history out of the tree (counted in tree/diverged_branches), "
            "'raise' stops training with an error naming the environment and what differed."
        )


class ReplayDivergenceWarning(RuntimeWarning):
    """A replayed environment did not reproduce the recorded history: same row and calls, different outputs."""


class ReplayDivergenceError(RuntimeError):
    """`replay_divergence="raise"`: a replayed environment did not reproduce a branch's recorded history."""


@dataclass
class RecordedCall:
    """A tool call a branch has run: replay re-runs it to rebuild the branch's environment.

    `turn` is the branch's turn that made the call (−1: made before the branch's first turn, e.g. in a TreeFlex node
    the branch was restored from); `content` and `failed` are what the call gave then, to compare with the replay.
    `random_state` is the process's global random state just before the call (`capture_random_state`; None: not
    captured), restored before the replayed call so a tool that draws from `random`, NumPy or torch draws the same.
    """

    turn: int
    call: dict
    content: Any
    failed: bool
    random_state: Any = dataclasses.field(default=None, repr=False, compare=False)


# Replay reproduces what an environment draws from the process's global generators: the state before the original
# reset and before every original call is captured, restored before the replayed one, and the caller's state is put
# back afterwards (so a replay consumes none of the sampler's randomness). NumPy and torch are only looked at when
# something has imported them. Randomness from elsewhere (os.urandom, an unseeded Generator, a server) cannot be
# reproduced: the replay's divergence check is for that.


def capture_random_state() -> tuple:
    """Python's, NumPy's (legacy global) and torch's (CPU) global random states."""
    numpy, torch = sys.modules.get("numpy"), sys.modules.get("torch")
    return (
        random.getstate(),
        numpy.random.get_state() if numpy is not None and hasattr(numpy, "random") else None,
        torch.get_rng_state() if torch is not None and hasattr(torch, "get_rng_state") else None,
    )


def restore_random_state(state: tuple) -> None:
    python_state, numpy_state, torch_state = state
    random.setstate(python_state)
    if numpy_state is not None:
        sys.modules["numpy"].random.set_state(numpy_state)
    if torch_state is not None:
        sys.modules["torch"].set_rng_state(torch_state)


def same_random_state(a: tuple, b: tuple) -> bool:
    """Whether two `capture_random_state` results are the same states (nothing drew from the generators between)."""
    python_a, numpy_a, torch_a = a
    python_b, numpy_b, torch_b = b
    if python_a != python_b or (numpy_a is None) != (numpy_b is None) or (torch_a is None) != (torch_b is None):
        return False
    if numpy_a is not None and not (
        numpy_a[0] == numpy_b[0]
        and all((x == y).all() if hasattr(x, "all") else x == y for x, y in zip(numpy_a[1:], numpy_b[1:]))
    ):
        return False
    return torch_a is None or bool((torch_a == torch_b).all())


@contextlib.contextmanager
def _callers_random_state():
    """Whatever the block draws or restores, the global random states are the caller's again afterwards."""
    state = capture_random_state()
    try:
        yield
    finally:
        restore_random_state(state)


# ---------------------------------------------------------------------------------------------------------------
# Which environments "auto" deep-copies
# ---------------------------------------------------------------------------------------------------------------

COPYABLE_ATTRIBUTE = "__trl_tree_copyable__"
_MAX_DEPTH = 8  # an environment's state nested deeper than this is not judged plain: replay, conservatively
_MAX_VALUES = 100_000  # nor is one with more values than this (walking it would cost about as much as copying it)
# An id or address of remote state is a plain string, which no type check tells from data: an attribute named like
# one (split at "_" and camelCase) makes the environment replayed. A false alarm only costs replays.
_REMOTE_NAME_PARTS = frozenset(
    {
        "session",
        "sessions",
        "sid",
        "client",
        "conn",
        "connection",
        "socket",
        "sock",
        "url",
        "uri",
        "endpoint",
        "host",
        "hostname",
        "server",
        "remote",
        "channel",
        "stub",
    }
)
_PLAIN_SCALARS = (type(None), bool, int, float, complex, str, bytes, range, type(Ellipsis))
_PLAIN_VALUES = (
    datetime.date,
    datetime.time,
    datetime.timedelta,
    decimal.Decimal,
    fractions.Fraction,
    pathlib.PurePath,
    enum.Enum,
)
_SEQUENCES = (list, tuple, set, frozenset, collections.deque)
_MAPPINGS = (dict, collections.OrderedDict, collections.Counter, collections.defaultdict)
_LOCKS = (
    type(threading.Lock()),
    type(threading.RLock()),
    threading.Condition,
    threading.Event,
    threading.Semaphore,
    threading.Barrier,
)


def copy_blocker(environment) -> str | None:
    """Why a deep copy of `environment` could share state with it (or with other copies); None when "auto" may copy it.

    A deep copy is independent only of the state it can see: a client's copy keeps the same session id, the same
    `requests.Session` cookies, the same server behind a handle, so two branches would drive one remote session. So
    "auto" copies an environment only when
    - its class says so: `__trl_tree_copyable__ = True` (False: never copy it under "auto"), or its author wrote a
      `__deepcopy__` (defined by the environment's class, or by a base that defines `reset` too: a generic base's,
      e.g. a pydantic model's, says nothing about what the fields point at); or
    - every value reachable from its attributes (at most `_MAX_DEPTH` levels, `_MAX_VALUES` values) is plain local
      data: scalars, builtin containers, dates, enums, paths, dataclasses of such values, `random.Random`, NumPy
      arrays (not of objects) and generators, torch tensors, or objects whose class declares itself copyable, and no
      attribute is named like a remote handle (`session_id`, `base_url`, `client`, …).
    Anything else (a socket, a file, a lock or thread, a module, a function, an HTTP session or connection pool, an
    object of any other class) could hold or point at state the copy would share. State outside the instance (module
    or class globals) is invisible to this check: such an environment should set `__trl_tree_copyable__ = False`.
    """
    cls = type(environment)
    declared = getattr(cls, COPYABLE_ATTRIBUTE, None)
    if declared is not None:
        return None if declared else f"{cls.__name__} sets {COPYABLE_ATTRIBUTE} = False"
    if _authored_deepcopy(cls):
        return None
    seen = {id(environment)}
    stack = [(f"{cls.__name__}.{name}", name, value, 1) for name, value in reversed(_attributes(environment))]
    count = 0
    while stack:
        path, name, value, depth = stack.pop()
        if name is not None and value is not None and _named_like_remote_handle(name):
            return f"{path} is named like a handle on remote state ({type(value).__name__} {shorten(value, 40)!r})"
        count += 1
        if count > _MAX_VALUES:
            return f"{cls.__name__} holds more than {_MAX_VALUES} values (not checked further)"
        if type(value) in _PLAIN_SCALARS or isinstance(value, _PLAIN_VALUES):
            continue
        if depth > _MAX_DEPTH:
            return f"{path} lies more than {_MAX_DEPTH} levels deep (not checked further)"
        if id(value) in seen:
            continue
        seen.add(id(value))
        children = _plain_children(value)
        if children is None:
            return f"{path} is {_what_it_is(value)}"
        stack.extend(
            (f"{path}{label}", child_name, child, depth + 1) for label, child_name, child in reversed(children)
        )
    return None


def _authored_deepcopy(cls: type) -> bool:
    owner = next((c for c in cls.__mro__ if "__deepcopy__" in vars(c)), None)
    return owner is not None and owner is not object and (owner is cls or "reset" in vars(owner))


def _named_like_remote_handle(name: str) -> bool:
    words = re.sub(r"(?<=[a-z0-9])(?=[A-Z])", "_", name).lower().strip("_").split("_")
    return any(word in _REMOTE_NAME_PARTS for word in words)


def _attributes(value) -> list[tuple[str, Any]]:
    """An object's instance attributes: its `__dict__` and its slots."""
    attributes = list(vars(value).items()) if isinstance(getattr(value, "__dict__", None), dict) else []
    for cls in type(value).__mro__:
        slots = vars(cls).get("__slots__", ())
        for slot in (slots,) if isinstance(slots, str) else slots:
            if slot not in ("__dict__", "__weakref__") and hasattr(value, slot):
                attributes.append((slot, getattr(value, slot)))
    return attributes


def _plain_children(value) -> list[tuple[str, str | None, Any]] | None:
    """The values inside a plain value, as (path label, attribute name or None, value); None: not plain."""
    cls = type(value)
    declared = getattr(cls, COPYABLE_ATTRIBUTE, None)
    if declared is not None and not isinstance(value, type):
        return [] if declared else None
    if cls in _MAPPINGS:
        factory = getattr(value, "default_factory", None)
        if factory is not None and not (isinstance(factory, type) and factory.__module__ == "builtins"):
            return None
        items = list(value.items())
        return [(f"[{shorten(k, 30)!r}] (key)", None, k) for k, _ in items] + [
            (f"[{shorten(k, 30)!r}]", None, v) for k, v in items
        ]
    if cls in _SEQUENCES:
        return [(f"[{i}]", None, v) for i, v in enumerate(value)]
    if cls is bytearray or cls in (random.Random, random.SystemRandom):
        return []
    numpy, torch = sys.modules.get("numpy"), sys.modules.get("torch")
    if numpy is not None and hasattr(numpy, "ndarray"):
        if isinstance(value, numpy.ndarray):
            return [] if value.dtype != object else None
        if isinstance(
            value, (numpy.generic, numpy.random.Generator, numpy.random.RandomState, numpy.random.BitGenerator)
        ):
            return []
    if torch is not None and hasattr(torch, "Tensor") and isinstance(value, torch.Tensor):
        return []
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return [(f".{name}", name, v) for name, v in _attributes(value)]
    return None


def _what_it_is(value) -> str:
    """What a value that is not plain data is, for the message that says why an environment is replayed."""
    known = [
        (socket.socket, "a socket"),
        (io.IOBase, "an open file or stream"),
        (types.ModuleType, "a module"),
        (threading.Thread, "a thread"),
        (_LOCKS, "a lock or other threading primitive"),
    ]
    for module, attribute, what in (
        ("requests", "Session", "an HTTP session (requests.Session)"),
        ("http.client", "HTTPConnection", "an HTTP connection"),
        ("urllib3", "PoolManager", "an HTTP connection pool"),
        ("urllib3", "HTTPConnectionPool", "an HTTP connection pool"),
    ):
        kind = getattr(sys.modules.get(module), attribute, None)
        if isinstance(kind, type):
            known.append((kind, what))
    for kind, what in known:
        if isinstance(value, kind):
            return what
    if isinstance(value, type):
        return "a class (its class-level state is shared by every copy)"
    if callable(value):
        return f"a {type(value).__name__} (a callable may close over state outside the environment)"
    if type(value) in _MAPPINGS:
        return "a defaultdict whose default_factory is not a builtin type"
    return (
        f"an object of class {type(value).__module__}.{type(value).__qualname__}, which the check does not know "
        "(it may hold or point at state outside the environment)"
    )


class EnvironmentPool:
    """The trainer's environment instances, created once and reused, as GRPOTrainer's `_environment_pool`, and the
    rules by which a branch gets a copy of one (`branching`) and what becomes of a branch whose replay diverged.

    `acquire(name)` hands out the next instance not yet used in this batch, creating one with the factory only when
    the batch needs more than exist; `release()` makes them all available to the next batch, which resets them. A tree
    needs one instance per trajectory that starts at the root or is rebuilt by replay, so the pool grows to that size
    in the first batch and then stays there.

    Args:
        factories: `{name: factory}` (GRPOTrainer's `environment_factories`; `None` is the single unnamed one).
        instances: `{name: [instances]}` to start from (GRPOTrainer's `_environment_pool`, seeded with its probes);
            the pool keeps using (and growing) these lists.
        branching: "fork", "copy", "replay" or "auto" (see `TreeEnvironment`).
        divergence: "drop" or "raise" (`REPLAY_DIVERGENCE`, see `TreeEnvironment`).
    """

    def __init__(
        self, factories: dict, instances: dict | None = None, branching: str = "auto", divergence: str = "drop"
    ):
        if branching not in ENVIRONMENT_BRANCHING:
            raise ValueError(f"environment_branching must be one of {ENVIRONMENT_BRANCHING}; got {branching!r}.")
        check_replay_divergence(divergence)
        self.factories = factories
        self.instances = instances if instances is not None else {}
        self.branching = branching
        self.divergence = divergence
        self._handed_out: dict = {}
        # "auto": environments replayed from then on, because a copy could share state, failed, or fork() raised
        self._replayed: set = set()
        for name, pool in self.instances.items():
            _check_distinct(name, pool)
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
            _check_distinct(name, pool)
        self._handed_out[name] = index + 1
        return pool[index]

    def retire(self, environment) -> None:
        """Take `environment` out of the pool for good: a call abandoned at its deadline may still run in it, so no
        later batch may reset it (the pool makes a new instance in its place when one is needed). An instance not in
        the pool (a branch's copy) needs nothing."""
        for name, pool in self.instances.items():
            for index, instance in enumerate(pool):
                if instance is environment:
                    del pool[index]
                    if index < self._handed_out.get(name, 0):
                        self._handed_out[name] -= 1
                    return

    def release(self) -> None:
        """Every instance is free again (call when nothing of the last batch uses its environments any more)."""
        self._handed_out = {}

    def size(self, name=None) -> int:
        """How many instances of environment `name` exist."""
        return len(self.instances.get(name, []))

    def copy(self, name, environment):
        """An independent copy of `environment` by the branching rule, or None when branches are to be replayed."""
        mode = "replay" if name in self._replayed else self.branching
        if mode == "replay":
            return None
        has_fork = callable(getattr(environment, "fork", None))
        if mode == "fork" and not has_fork:
            raise TypeError(_no_fork_message(environment))
        if has_fork and mode in ("auto", "fork"):
            return self._fork(name, environment, mode)
        if mode == "auto":
            blocker = copy_blocker(environment)
            if blocker is not None:
                return self._replay_from_now_on(
                    name,
                    environment,
                    f"a deep copy could share state with the original: {blocker}",
                    f"If a deep copy of it is independent, set `{COPYABLE_ATTRIBUTE} = True` on the class (or give it "
                    "a fork() method); environment_branching='replay' skips this check.",
                )
        try:
            return copy.deepcopy(environment)
        except Exception as e:
            if mode == "copy":
                raise TypeError(
                    f"environment_branching='copy', but copy.deepcopy of {type(environment).__name__} failed "
                    f"({type(e).__name__}: {e}), e.g. because it holds a socket to a remote session. Use "
                    "environment_branching='replay' (or 'auto'), or add a `fork(self)` method and use 'fork'."
                ) from e
            return self._replay_from_now_on(
                name,
                environment,
                f"it cannot be deep-copied ({type(e).__name__}: {e}) and has no fork()",
                "Set environment_branching='replay' to skip the copy attempt.",
            )

    def _fork(self, name, environment, mode: str):
        try:
            return environment.fork()
        except Exception as e:
            what = f"{type(environment).__name__}.fork() raised {type(e).__name__}: {_safe_str(e)}"
            if mode == "fork":
                raise RuntimeError(
                    f"environment_branching='fork', but {what}. A branch needs an independent copy of the environment "
                    "as it was at its anchor: fix fork() so it returns one, or set environment_branching='auto' or "
                    "'replay' to rebuild branches by re-running their tool calls on a fresh instance."
                ) from e
            return self._replay_from_now_on(
                name, environment, what, "Fix fork(), or set environment_branching='replay' to skip it."
            )

    def _replay_from_now_on(self, name, environment, why: str, hint: str) -> None:
        """Under "auto": say once why environment `name` is not copied, and replay its branches from now on."""
        self._replayed.add(name)
        logger.warning(
            "Environment %s is not copied for branching: %s. So its branches are rebuilt by replay (a fresh instance "
            "reset with the row, then the branch's recorded tool calls re-run in order), which assumes the "
            "environment reproduces them; a branch whose replay does not is %s (replay_divergence). %s",
            type(environment).__name__,
            why,
            "dropped from its tree" if self.divergence == "drop" else "an error",
            hint,
        )
        return None


def _check_distinct(name, pool: list) -> None:
    """Every instance in the pool is its own object: a factory that returns one shared instance (`lambda: env`) would
    give every tree and every replayed branch the same world, their calls overlapping and their updates lost."""
    seen: set[int] = set()
    for instance in pool:
        if id(instance) in seen:
            which = "environment_factory" if name is None else f"environment factory {name!r}"
            raise ValueError(
                f"The {which} returned the same {type(instance).__name__} instance more than once: every tree's root "
                "and every replayed branch needs an environment of its own (their calls run concurrently and each "
                "reset would wipe the others' state). Pass a factory that builds a new instance on each call, e.g. "
                "the class itself (environment_factory=MyEnv) or `lambda: MyEnv(config)`, not `lambda: env`; state "
                "that must be shared (a client, a corpus) goes in a module-level object the instances read."
            )
        seen.add(id(instance))


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

    - "fork": the environment's own `fork()` of the snapshot taken before turn t (a fork() that raises is an error);
    - "copy": `copy.deepcopy` of that snapshot;
    - "replay": no snapshots at all. A fresh instance is reset with the row and the branch's recorded tool calls of
      turns 0..t−1 are re-run on it in order. Their outputs are not shown to the model again (the history's token ids
      stay as recorded). What the environment draws from Python's `random`, NumPy's global generator and torch's
      (CPU) global generator is reproduced: the global states captured before the root's reset and before each
      original call are restored before the replayed ones, and the caller's states are put back afterwards. An output
      that differs from the recorded one (randomness from elsewhere, a server) means the branch's world disagrees with
      its history: a `ReplayDivergenceWarning` names the tool and turn and the branch is marked diverged (`diverged`),
      for the trainer to drop before credit (the pool's `divergence="drop"`), or a `ReplayDivergenceError` stops the
      run (`"raise"`). A reset that returns another observation than the root's (whose observation the prompt shows)
      diverges the same way. Replay costs the replayed calls again, and is the way to branch clients of remote state;
    - "auto" (default): `fork()` if the environment has one (one that raises: replay from then on, with a warning);
      else `copy.deepcopy` if `copy_blocker` finds nothing a copy could share (the class says it may be copied, or its
      state is plain local data); else replay.

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
        self._reset_random_state: tuple | None = None
        # id → (instance, diverged) of every instance rebuilt here (the instance is kept so its id stays its own)
        self._rebuilt: dict[int, tuple[Any, bool]] = {}

    def start(self):
        """An instance reset with the row: the root's (the first call, whose observation the prompt shows) or another
        trajectory's from the root, which gets the root's world: the root's reset randomness is replayed for it."""
        environment = self.pool.acquire(self.name)
        if not self._started:
            self._reset_random_state = capture_random_state()
            self.reset_observation = environment.reset(**self.row)
            self._started = True
            return environment
        with _callers_random_state():
            restore_random_state(self._reset_random_state)
            observation = environment.reset(**self.row)
        diverged = not _same(observation, self.reset_observation)
        self._rebuilt[id(environment)] = (environment, diverged)
        if diverged:
            cls = type(environment).__name__
            self._diverged(
                f"{cls}.reset returned a different observation for the same row than it did for the tree's root, "
                "whose observation the prompt shows. Trajectories of one tree share the prompt, so reset must be "
                "deterministic given the row (and the global random states, which are replayed).",
                f"{cls}: reset gave {shorten(observation)!r} for the tree's row, but the root's reset gave "
                f"{shorten(self.reset_observation)!r}, which the prompt shows",
            )
        return environment

    def diverged(self, environment) -> bool | None:
        """Whether `environment`, rebuilt here (a trajectory from the root, or a replay), disagrees with the history
        it was rebuilt for; None when it was not rebuilt here (the root's instance, a copy)."""
        rebuilt = self._rebuilt.get(id(environment))
        return None if rebuilt is None or rebuilt[0] is not environment else rebuilt[1]

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
        """A fresh instance reset with the row, with the environment's recorded calls re-run in order, each after the
        global random states it originally ran with; the caller's random states are unchanged afterwards.

        Calls of standalone tools (not methods of the environment) and calls that named no tool of it are skipped:
        they did not touch its state. Replay stops at the first call that gives another output than recorded: the
        instance is marked diverged (see `diverged`) and the rest could not make it agree again.
        """
        with _callers_random_state():
            environment = self.start()
            if self.diverged(environment):
                return environment
            tools = {method.__name__: method for method in environment_tools(environment)}
            for recorded in calls:
                function = recorded.call.get("function") if isinstance(recorded.call, dict) else None
                name = function.get("name") if isinstance(function, dict) else None
                if name not in tools:
                    continue
                if recorded.random_state is not None:
                    restore_random_state(recorded.random_state)
                result = self.run_call(recorded.call, tools)
                if result.failed == recorded.failed and _same(result.content, recorded.content):
                    continue
                self._rebuilt[id(environment)] = (environment, True)
                cls = type(environment).__name__
                where = f"turn {recorded.turn}" if recorded.turn >= 0 else "an earlier segment"
                outputs = f"gave {shorten(result.content)!r}, but the branch recorded {shorten(recorded.content)!r}"
                self._diverged(
                    f"Replaying tool '{name}' (call of {where}) on a fresh {cls} {outputs}. Replay assumes the "
                    "environment reproduces the same outputs for the same row and calls: this branch's world differs "
                    "from its history.",
                    f"{cls}: replaying tool '{name}' (call of {where}) {outputs}",
                )
                break
        return environment

    def _diverged(self, warning: str, error: str) -> None:
        if self.pool.divergence == "raise":
            raise ReplayDivergenceError(
                f"{error}. A replayed branch's world must match its history (replay_divergence='raise'). Give the "
                "environment a fork() method, make its randomness reproducible (draw it from `random`, NumPy's or "
                "torch's global generator, which replay restores, or from a generator seeded by the row), or set "
                "replay_divergence='drop' to leave such branches out of training."
            )
        warnings.warn(
            f"{warning} The branch is marked diverged (replay_divergence='drop'): the tree trainers leave it out of "
            "its tree before credit and count it in tree/diverged_branches (TreeFlex's searches are not dropped). "
            "Give the environment a fork() method or make its randomness reproducible (`random`, NumPy's or torch's "
            "global generator, or a generator seeded by the row).",
            ReplayDivergenceWarning,
            stacklevel=3,
        )


def _same(a, b) -> bool:
    try:
        return bool(a == b)
    except Exception:  # e.g. arrays without a single truth value
        return False
