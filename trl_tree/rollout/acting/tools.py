"""One tool call from the model: untrusted input, run the way TRL's GRPOTrainer runs it.

Only registered tools run; arguments are checked against the tool's signature (names, count and annotated types) before
the call. Whatever a tool does — return any value (one that cannot be printed included), raise any exception
(`SystemExit` and `GeneratorExit` included), hang past its timeout, return an enormous string — the result is a tool
message, never a crash of the training run. The exceptions are
`KeyboardInterrupt`: the user stopping the run is re-raised, from the thread that called the tool; and
`ToolFatalError`, which a tool raises when its dependency is gone (no later call can succeed): the run stops.

As in GRPOTrainer's tool loop, the tool message's content is the tool's return value itself when it is a list of
content blocks, else `str(value)` (a list of plain values included, `tool_message_content`), and a failure is
`str({"error": message})`; that is what reward functions receive in `completions`. The model sees the same message cut
at `max_observation_chars`. Every call has a deadline (`timeout`; None: none, by the user's choice), enforced by the
caller over the call and the conversion of its result to text, its late result dropped. Synchronous tools run in the
calling thread with `execution="main"`, as in GRPOTrainer, so a tool can time itself out with `signal.alarm`, and the
deadline is a SIGALRM timer there, raised again until the call ends (`_run_with_alarm`); `execution="thread"` runs them
in a worker thread that we stop waiting for at the deadline. Threads left running a tool past it are counted and capped
(`note_stuck`). Async tools run on GRPOTrainer's background event loop when one is given, else on a private loop in a daemon
thread. Many calls at once (a worker pool, batched requests, calls in flight while the model generates) are
`tool_executor.py`'s; environments and how branches get theirs are `env_branching.py`'s.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import inspect
import json
import logging
import math
import re
import signal
import threading
import time
import types
import typing
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from ...text import shorten

logger = logging.getLogger(__name__)

TRUNCATION_MARKER = "\n...[truncated: {n} more characters]"
MAX_OBSERVATION_CHARS = 16_384  # the TreeOPSD paper's cap on a retrieved observation (Appendix E.3)
TOOL_EXECUTION_MODES = ("main", "thread")
POOLED = "pooled"  # internal: a synchronous tool runs in the calling thread, whose caller enforces the deadline


@dataclass
class ToolResult:
    """One tool call's outcome.

    `content` is the tool message's content as GRPOTrainer builds it (the return value if it is a list of content
    blocks, else `str(value)`; `str({"error": ...})` for a failure), never truncated: what reward functions and completion logs
    receive. `observation` is what the model
    sees: `content` cut at `max_observation_chars` with a marker (a list is passed to the chat template as it is).
    """

    name: str
    content: str | list
    failed: bool
    observation: str | list | None = None
    abandoned: bool = False  # answered as a timeout while the call may still run (its thread or task left behind)
    error_type: str | None = None  # the exception's type name, for a call that raised

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
    """The content GRPOTrainer puts in a tool message: a list of content blocks as it is, anything else `str(value)`,
    with three departures, all about text the model could otherwise not be shown:

    - a list counts as content blocks only when it is one: non-empty, every item a dict with a `"type"` key
      (`[{"type": "text", "text": ...}]`). Any other list (`["a", "b"]`, `[1, 2]`, `[]`) is `str(value)`, as a tuple
      already is: GRPOTrainer passes every list to the chat template as blocks, and Qwen3's template renders a list
      of plain values as an empty `<tool_response>`, so the model saw nothing and no call counted as failed;
    - `bytes` that are UTF-8 are decoded (GRPOTrainer's `str(value)` shows the model `b'...'` with escapes, which no
      tool author means); other bytes stay `str(value)`;
    - characters the tokenizer cannot encode (lone surrogates, what `surrogateescape` makes of non-UTF-8 output) are
      replaced with U+FFFD: the tokenizer would raise on them and stop training, naming neither tool nor cause.
    """
    if is_content_blocks(value):
        return value
    text = str(value)
    if isinstance(value, (bytes, bytearray)):
        with contextlib.suppress(UnicodeDecodeError):
            text = bytes(value).decode("utf-8")
    return encodable_text(text)


def is_content_blocks(value) -> bool:
    """Whether a tool's return value is a list of chat-template content blocks (dicts with a `"type"`)."""
    return isinstance(value, list) and bool(value) and all(isinstance(b, dict) and "type" in b for b in value)


def encodable_text(text: str) -> str:
    """`text` with every character UTF-8 cannot encode replaced by U+FFFD (bytes smuggled in by `surrogateescape`
    decoded back first, so valid UTF-8 among them survives)."""
    try:
        text.encode("utf-8")
        return text
    except UnicodeEncodeError:
        pass
    try:
        return text.encode("utf-8", "surrogateescape").decode("utf-8", "replace")
    except UnicodeEncodeError:  # surrogates outside surrogateescape's range: one U+FFFD each
        return re.sub("[\ud800-\udfff]", "\ufffd", text)


def _tool_result(name: str, value, failed: bool, max_chars: int | None) -> ToolResult:
    content = tool_message_content(value)
    observation = truncate_observation(content, max_chars) if isinstance(content, str) else content
    return ToolResult(name, content, failed, observation)


def error_result(
    name: str, message: str, max_chars: int | None = None, *, abandoned: bool = False, error_type: str | None = None
) -> ToolResult:
    """A failed call, worded as GRPOTrainer words it: the tool message's content is `str({"error": message})`."""
    result = _tool_result(name, {"error": message}, True, max_chars)
    result.abandoned, result.error_type = abandoned, error_type
    return result


# Reward functions and completion logs get a tool's whole output (only the model's observation is cut): every call of
# a batch keeps it in memory until the batch is trained (96 calls of 8 MB held 768 MB). Not cut, since a reward may
# need all of it, but said once per tool when one output passes this many characters.
LARGE_CONTENT_CHARS = 1_000_000
_LARGE_WARNED: set[str] = set()


def _value_result(name: str, value, max_chars: int | None) -> ToolResult:
    """The tool message for a value a tool returned. Making it text runs the tool's own code (`__str__`, `__repr__`),
    which may raise like any other tool code: that is the tool's failure, an error observation, not the trainer's.
    It runs under the call's deadline (`run_tool_call`): a `__str__` that blocks is a timeout like the call itself."""
    try:
        if isinstance(value, list):
            repr(value)  # content blocks reach the chat template as they are: each must at least be printable
        result = _tool_result(name, value, False, max_chars)
    except (KeyboardInterrupt, _ToolDeadline):
        raise
    except BaseException as e:  # noqa: BLE001 - whatever the tool's __str__ raises, the run goes on
        why = f"{type(e).__name__}: {_safe_str(e)}"
        message = f"Tool {name} returned a {type(value).__name__} that cannot be converted to text ({why})."
        return error_result(name, message, max_chars, error_type=type(e).__name__)
    if isinstance(result.content, str) and len(result.content) > LARGE_CONTENT_CHARS and name not in _LARGE_WARNED:
        _LARGE_WARNED.add(name)
        logger.warning(
            "Tool %s returned %d characters. The model sees the first max_observation_chars of them, but reward "
            "functions and completion logs receive the whole output, which every call keeps in memory until its batch "
            "is trained (calls x size). Return less from the tool (cut or summarise it there) if rewards do not need "
            "it all.",
            name,
            len(result.content),
        )
    return result


def _safe_str(error: BaseException) -> str:
    """`str(error)`, or "" when the exception's own `__str__` raises (it is tool code too)."""
    try:
        return str(error)
    except KeyboardInterrupt:
        raise
    except BaseException:  # noqa: BLE001 - a broken message must not hide the error it describes
        return ""


def _describe(error: BaseException) -> str:
    """An exception as the model reads it: its message, or its type when it has none (`sys.exit()`)."""
    text = _safe_str(error)
    if text and isinstance(error, Exception):
        return text
    return f"{type(error).__name__}: {text}" if text else type(error).__name__


# ---------------------------------------------------------------------------------------------------------------
# Deadlines: every call is bounded, in every mode, its result's conversion to text included
# ---------------------------------------------------------------------------------------------------------------

RETRY_DEADLINE_SECONDS = 0.05  # main mode: how often the deadline is raised again in a tool that caught it


class CallAbandoned(TimeoutError):
    """A call answered as a timeout while it may still run: its caller stopped waiting for its thread (or its async
    task) at the deadline. Its result, if it comes, is dropped; what it does meanwhile to shared state (a stateful
    environment) is not known, which is why such a result is marked `abandoned`."""


# Threads left running a tool past its deadline. Python cannot stop a thread: each stays until its tool returns, so a
# tool that never returns would leave one per call for the rest of the run. They are counted (`stuck_tool_threads`,
# the trainers' `tools/stuck_workers`), said once per tool, and past `MAX_STUCK_TOOL_THREADS` the run stops
# (`StuckToolsError`): a tool that never returns is a bug to fix, not a leak to live with. 256 is four rounds of a
# full default pool (64 calls) that all hung; set this module attribute to allow more.
MAX_STUCK_TOOL_THREADS = 256
_STUCK: dict[threading.Thread, str] = {}
_STUCK_LOCK = threading.Lock()
_STUCK_WARNED: set[str] = set()


def stuck_tool_threads() -> int:
    """How many threads are still running a tool call whose deadline passed (process-wide, every mode)."""
    with _STUCK_LOCK:
        for thread in [t for t in _STUCK if not t.is_alive()]:
            del _STUCK[thread]
        return len(_STUCK)


def note_stuck(thread: threading.Thread | None, name: str, timeout: float) -> BaseException | None:
    """Count `thread`, left running tool `name` past its deadline; warn the first time per tool. Returns the error
    that stops the run when the count passes `MAX_STUCK_TOOL_THREADS` (the caller raises it where the run waits)."""
    if thread is None or not thread.is_alive():
        return None
    count = stuck_tool_threads()
    with _STUCK_LOCK:
        _STUCK[thread] = name
        count += 1
        first = name not in _STUCK_WARNED
        _STUCK_WARNED.add(name)
        names = sorted(set(_STUCK.values()))
    if count > MAX_STUCK_TOOL_THREADS:
        return StuckToolsError(
            f"{count} tool calls are still running past their deadline (tool_timeout={timeout:g} s), each holding a "
            f"thread, more than MAX_STUCK_TOOL_THREADS={MAX_STUCK_TOOL_THREADS} (trl_tree.rollout.acting.tools); tools "
            f"stuck: {', '.join(names)}. Python cannot stop a thread, so a tool that never returns leaks one per call "
            "for the rest of the run. Make the tool return (give its own I/O a timeout shorter than tool_timeout, "
            "e.g. a socket or HTTP client timeout), or raise the limit if its calls do end, only late."
        )
    if first:
        logger.warning(
            "Tool %s ran past tool_timeout=%g s: the call was answered as a timeout, but its thread is still running "
            "it (Python cannot stop a thread) and stays until the tool returns. Stuck threads are counted in "
            "tools/stuck_workers; past %d the run stops. Give the tool's own I/O a timeout shorter than tool_timeout.",
            name,
            timeout,
            MAX_STUCK_TOOL_THREADS,
        )
    return None


def _run_in_worker(fn: Callable, kwargs: dict, timeout: float | None, name: str, grace: float = 0.0):
    """Run `fn(**kwargs)` in a daemon thread; raise `CallAbandoned` if it does not return within `timeout` seconds
    (+ `grace`, for a callee that ends itself at `timeout`), counting the thread as stuck (`note_stuck`).

    Python cannot kill a thread: a hung tool keeps its thread until it returns, but the rollout goes on. Whatever the
    tool raises is caught in the worker (no thread traceback) and re-raised here, in the calling thread.
    """
    box: dict = {}

    def target():
        try:
            box["value"] = fn(**kwargs)
        except BaseException as e:  # noqa: BLE001 - re-raised in the calling thread below
            box["error"] = e

    thread = threading.Thread(target=target, daemon=True, name=f"tool-{name}")
    thread.start()
    thread.join(None if timeout is None else timeout + grace)
    if thread.is_alive():
        stop = note_stuck(thread, name, timeout)
        if stop is not None:
            raise stop
        raise _abandoned(timeout)
    if "error" in box:
        raise box["error"]
    return box["value"]


async def _settle(awaitable, name: str = "tool"):
    """Await a tool inside its own task and return `(ok, value or exception)`.

    asyncio re-raises a task's `SystemExit` / `KeyboardInterrupt` out of the event loop, which would stop GRPOTrainer's
    shared loop thread for good; caught here, in the task that runs the tool, they reach the caller as values.
    Cancellation is not caught: it is how `wait_for` times the tool out and how `asyncio.run` turns Ctrl-C into
    KeyboardInterrupt. The tools with a call running are noted, to name them when the loop is found blocked.
    """
    with _ASYNC_LOCK:
        _ASYNC_RUNNING[name] = _ASYNC_RUNNING.get(name, 0) + 1
    try:
        return True, await awaitable
    except asyncio.CancelledError:
        raise
    except BaseException as e:  # noqa: BLE001 - handed to the caller
        return False, e
    finally:
        with _ASYNC_LOCK:
            _ASYNC_RUNNING[name] -= 1
            if not _ASYNC_RUNNING[name]:
                del _ASYNC_RUNNING[name]


_ASYNC_RUNNING: dict[str, int] = {}  # async tools with a call in progress, by name
_ASYNC_LOCK = threading.Lock()
_BLOCKED_LOOP_WARNED: set[int] = set()


async def _settle_within(awaitable, timeout: float | None, name: str = "tool"):
    """`_settle` with the tool cancelled at the deadline. Only a tool that lets itself be cancelled stops here (and
    `wait_for` waits for the cancellation to finish): the caller enforces the deadline itself (`_await_tool`)."""
    try:
        return await asyncio.wait_for(_settle(awaitable, name), timeout)
    except asyncio.TimeoutError:
        return False, _timed_out(timeout)


def _timed_out(timeout: float) -> TimeoutError:
    return TimeoutError(f"timed out after {timeout:g} s")


def _abandoned(timeout: float) -> CallAbandoned:
    return CallAbandoned(f"timed out after {timeout:g} s")


def _await_tool(awaitable, timeout: float | None, event_loop: asyncio.AbstractEventLoop | None, name: str = "tool"):
    """Run an async tool to completion: on `event_loop` (GRPOTrainer's `async_loop`, a daemon thread: tools that keep
    loop-bound clients between calls need the same loop every time), else on a new loop in a daemon thread.

    The deadline is the caller's: at `timeout` it stops waiting and the call is a timeout, whatever the tool does. The
    tool's task is cancelled too, but a tool may catch the cancellation and go on: it then runs on in the background,
    on its loop, and what it returns late is dropped. That is why a new loop runs in a thread of its own, not in this
    one: `asyncio.run` here would wait for such a tool. A tool that blocks its loop without awaiting holds that loop
    (GRPOTrainer's, for its other async tools), not the trainer; when a call times out on a loop that does not answer,
    a warning says so once per loop (`_warn_if_loop_blocked`).
    """
    settled = _settle_within(awaitable, timeout, name)
    if event_loop is None:
        ok, value = _run_in_worker(asyncio.run, {"main": settled}, timeout, name, grace=RETRY_DEADLINE_SECONDS)
    else:
        future = asyncio.run_coroutine_threadsafe(settled, event_loop)
        try:
            ok, value = future.result(timeout)
        except (concurrent.futures.TimeoutError, _ToolDeadline):  # the latter: main mode's alarm, for a sync tool
            future.cancel()  # cancels the tool's task on its loop; if it ignores that, its result goes nowhere
            _warn_if_loop_blocked(event_loop, name, timeout)
            ok, value = False, _abandoned(timeout)
    if not ok:
        raise value
    return value


def _warn_if_loop_blocked(event_loop: asyncio.AbstractEventLoop, name: str, timeout: float) -> None:
    """After a call timed out on `event_loop`: if the loop does not run a no-op within `RETRY_DEADLINE_SECONDS`, a
    coroutine holds it without awaiting, so every async call on it waits (and reads as a timeout). Said once per loop,
    naming the async tools with a call in progress (the one blocking it is among them)."""
    if id(event_loop) in _BLOCKED_LOOP_WARNED or not event_loop.is_running():
        return
    probe = asyncio.run_coroutine_threadsafe(asyncio.sleep(0), event_loop)
    try:
        probe.result(RETRY_DEADLINE_SECONDS)
        return
    except concurrent.futures.TimeoutError:
        probe.cancel()
    _BLOCKED_LOOP_WARNED.add(id(event_loop))
    with _ASYNC_LOCK:
        running = ", ".join(sorted(_ASYNC_RUNNING)) or "none"
    logger.warning(
        "Async tool %s timed out (tool_timeout=%g s) while its event loop was blocked: a coroutine on it runs "
        "synchronous code without awaiting, so every async call on that loop waits for it and reads as a timeout. "
        "Async tools with a call in progress: %s. Run blocking work with `await asyncio.to_thread(...)`, or make "
        "the tool a plain function (synchronous tools run in worker threads).",
        name,
        timeout,
        running,
    )


class _ToolDeadline(BaseException):
    """Raised inside a synchronous tool by the SIGALRM deadline. A BaseException, as asyncio's CancelledError is, so
    that a tool's `except Exception:` does not swallow its own timeout; `_run_with_alarm` makes it a TimeoutError."""


def _alarm_available() -> bool:
    """Whether this thread can take SIGALRM: Python runs signal handlers, and lets them be set, in the main thread
    only, and Windows has no SIGALRM."""
    return hasattr(signal, "setitimer") and threading.current_thread() is threading.main_thread()


def _run_with_alarm(work: Callable[[], Any], timeout: float, name: str = "tool"):
    """Run `work()` in this thread, with a SIGALRM deadline `timeout` seconds away; a result after it is dropped.

    The handler raises inside the tool, between two bytecodes or out of an interrupted sleep or lock wait, so pure
    Python and blocking waits are stopped; C code that does not return to the interpreter (or that retries on EINTR)
    is not. A tool that catches the deadline (`except BaseException`, a bare `except:` in a retry loop) gets it again
    every `RETRY_DEADLINE_SECONDS` until one lands outside its `try` (its retry sleep, its loop's jump), and a value it
    returns after the deadline is answered as a timeout all the same: the model never reads a late result. The
    caller's SIGALRM handler and real-time timer are restored afterwards, the timer less the time the call took (a
    process has one ITIMER_REAL): a timer that fell due during the call fires at once. A tool that arms its own alarm
    (TRL's agent example does) replaces this deadline for the rest of its call; its late result is still dropped.
    """
    start = time.monotonic()
    armed, fired = [True], [0]

    def raise_deadline(signum, frame):
        if armed[0]:
            fired[0] += 1
            raise _ToolDeadline

    previous_timer = signal.getitimer(signal.ITIMER_REAL)
    previous_handler = signal.signal(signal.SIGALRM, raise_deadline)
    outcome: list = []
    try:
        while True:  # again only when the deadline fires between the tool's end and the disarm below
            try:
                if not outcome:
                    signal.setitimer(signal.ITIMER_REAL, max(timeout, 1e-6), RETRY_DEADLINE_SECONDS)  # 0 disarms
                    outcome.append(work())
                armed[0] = False
                signal.setitimer(signal.ITIMER_REAL, 0)  # the deadline must not fire into our code
                break
            except _ToolDeadline:
                outcome[:] = [_LATE]
    finally:
        armed[0] = False
        signal.setitimer(signal.ITIMER_REAL, 0)
        # getsignal is None for a handler set outside Python; SIG_DFL is the closest we can put back
        signal.signal(signal.SIGALRM, signal.SIG_DFL if previous_handler is None else previous_handler)
        _restore_timer(previous_timer, time.monotonic() - start)
    if fired[0] > 1 and name not in _DEADLINE_CAUGHT:
        _DEADLINE_CAUGHT.add(name)
        logger.warning(
            "Tool %s caught its own deadline (an `except BaseException:` or bare `except:`), so it ran on past "
            "tool_timeout=%g s until the deadline, raised again every %g s, landed outside its try; its result was "
            "dropped. Catch `Exception` instead, so the deadline can stop it; a tool that catches everything around "
            "every wait cannot be stopped in the trainer's thread: run it with tool_execution='thread'.",
            name,
            timeout,
            RETRY_DEADLINE_SECONDS,
        )
    if outcome[0] is _LATE or time.monotonic() - start > timeout:
        raise _timed_out(timeout)
    return outcome[0]


_DEADLINE_CAUGHT: set[str] = set()


_LATE = object()


def _restore_timer(previous: tuple[float, float], elapsed: float) -> None:
    delay, interval = previous
    if delay > 0:
        signal.setitimer(signal.ITIMER_REAL, max(delay - elapsed, 1e-6), interval)


def _bounded(work: Callable[[], Any], timeout: float | None, execution: str, name: str):
    """Run `work()` (the call and the conversion of its result to text) within the deadline.

    `"thread"`: in a worker thread we stop waiting for at `timeout`. `"main"`: in this thread, as GRPOTrainer runs
    tools (so `signal`-based code in the tool works), with a SIGALRM timer as the deadline (`_run_with_alarm`). Where
    no signal can reach this thread (not the main thread, Windows) the worker thread's deadline stands in: the tool
    then runs in another thread, but a hung tool still cannot hold the trainer. `POOLED`: in this thread, a worker of
    `tool_executor.ToolExecutor`, whose watchdog gives up at the deadline. `timeout=None`: no deadline, as the user
    chose.
    """
    if execution == POOLED or timeout is None:
        return work()
    if execution == "main" and _alarm_available():
        return _run_with_alarm(work, timeout, name)
    return _run_in_worker(work, {}, timeout, name)


def _call_tool(fn: Callable, kwargs: dict, timeout: float | None, event_loop, name: str = "tool"):
    """Call a tool and return its raw value, raising what it raises. A synchronous tool runs here (the deadline is
    `_bounded`'s, around this); an async tool, or a tool returning an awaitable, is awaited with `timeout`
    (`_await_tool`)."""
    if inspect.iscoroutinefunction(fn):
        return _await_tool(fn(**kwargs), timeout, event_loop, name)
    value = fn(**kwargs)
    return _await_tool(value, timeout, event_loop, name) if inspect.isawaitable(value) else value


def _check_arguments(fn: Callable, arguments) -> dict:
    if isinstance(arguments, str):  # some parsers leave JSON arguments as a string
        try:
            arguments = json.loads(arguments)
        except json.JSONDecodeError as e:
            raise ValueError(f"arguments are not valid JSON ({e.msg})") from None
    if not isinstance(arguments, dict):
        raise ValueError(f"arguments must be a JSON object, got {type(arguments).__name__}")
    signature = _signature(fn)
    try:
        bound = signature.bind(**arguments)
    except TypeError as e:
        raise ValueError(f"bad arguments: {e}") from None
    for name, value in bound.arguments.items():
        _check_type(signature.parameters[name], name, value)
    return arguments


def _signature(fn: Callable) -> inspect.Signature:
    """The tool's signature with its annotations evaluated (`from __future__ import annotations` leaves strings). If
    one cannot be evaluated (a name the tool's module does not define), the strings stay and are not checked."""
    try:
        return inspect.signature(fn, eval_str=True)
    except Exception:  # noqa: BLE001 - NameError, SyntaxError, ... in an annotation: check names and count only
        return inspect.signature(fn)


def _check_type(parameter: inspect.Parameter, name: str, value) -> None:
    """Raise a bad-arguments ValueError, worded for the model to fix its call, if `value` does not fit the annotation.

    `**kwargs: T` checks each extra argument against T. None is accepted where the default is None (`x: str = None`,
    the implicit Optional older code relies on).
    """
    if parameter.kind is inspect.Parameter.VAR_POSITIONAL:
        return  # keyword arguments never bind to *args
    values = value.items() if parameter.kind is inspect.Parameter.VAR_KEYWORD else [(name, value)]
    for key, item in values:
        if item is None and parameter.default is None:
            continue
        if not _matches(item, parameter.annotation):
            expected, got = _type_name(parameter.annotation), "None" if item is None else type(item).__name__
            raise ValueError(f"bad arguments: {key!r} must be {expected}, got {got} ({shorten(repr(item), 60)})")


_ANY = (Any, object, inspect.Parameter.empty)
_ARRAYS = (list, tuple, set, frozenset)  # JSON has arrays only: an array stands for any of these
_CHECKED = (str, int, float, bool, dict, type(None))


def _matches(value, expected) -> bool:
    """Whether a JSON value fits a type annotation, with the leniency of JSON Schema (TRL's tool schemas): an int is a
    number, so it fits `float`; a bool is not a number; a string is never a number (no coercion); an array fits list,
    tuple and set. Unions, Optional, Literal and Annotated are looked into; the items of a list and the values of a
    dict are checked too. What JSON cannot carry (a dataclass, an Enum, Path, a TypeVar, an unevaluated string) is
    left to the tool to convert: accepted.
    """
    if expected is None:  # `x: None`, as typing spells NoneType
        expected = type(None)
    if expected in _ANY:
        return True
    origin, args = typing.get_origin(expected), typing.get_args(expected)
    if origin is typing.Annotated:
        return _matches(value, args[0])
    if origin is typing.Union or origin is types.UnionType:
        return any(_matches(value, option) for option in args)
    if origin is typing.Literal:
        return any(value == option and type(value) is type(option) for option in args)
    outer = origin or expected
    if not isinstance(outer, type):
        return True
    if isinstance(value, bool) and outer in (int, float):
        return False
    if outer is float:
        return isinstance(value, (int, float))
    if outer in _ARRAYS:
        return isinstance(value, list) and _items_match(value, outer, args)
    if outer is dict or outer.__module__ == "collections.abc":
        return isinstance(value, outer) and _items_match(value, outer, args)
    return isinstance(value, outer) if outer in _CHECKED else True


def _items_match(value, outer: type, args: tuple) -> bool:
    """The items of an array (`list[int]`, `tuple[int, ...]`, `tuple[int, str]`) or the values of an object
    (`dict[str, int]`; JSON keys are always strings, so keys are not checked)."""
    if isinstance(value, dict):
        return len(args) != 2 or all(_matches(v, args[1]) for v in value.values())
    if outer is tuple and args and not (len(args) == 2 and args[1] is Ellipsis):
        return len(value) == len(args) and all(map(_matches, value, args))
    return not args or all(_matches(v, args[0]) for v in value)


def _type_name(expected) -> str:
    """An annotation as the model reads it: `int`, `list[int]`, `str | None`, `one of 'fast', 'slow'`."""
    origin, args = typing.get_origin(expected), typing.get_args(expected)
    if expected is None or expected is type(None):
        return "None"
    if expected is Ellipsis:
        return "..."
    if origin is typing.Annotated:
        return _type_name(args[0])
    if origin is typing.Union or origin is types.UnionType:
        return " | ".join(_type_name(option) for option in args)
    if origin is typing.Literal:
        return "one of " + ", ".join(repr(option) for option in args)
    if origin is not None and args:
        return f"{_type_name(origin)}[{', '.join(_type_name(a) for a in args)}]"
    return getattr(expected, "__name__", None) or str(expected).replace("typing.", "")


def check_tool_execution(execution: str) -> None:
    if execution not in TOOL_EXECUTION_MODES:
        raise ValueError(
            f"tool_execution must be one of {TOOL_EXECUTION_MODES}; got {execution!r}: 'main' runs synchronous tools in "
            "the calling thread (as GRPOTrainer; signal-based timeouts work, tool_timeout is a SIGALRM timer that "
            "cannot stop a tool stuck in C code), 'thread' in a worker thread (tool_timeout always stops waiting, "
            "signal does not work)."
        )


def check_tool_timeout(timeout) -> None:
    """`tool_timeout` is a positive, finite number of seconds, or None (no deadline). Anything else would break the
    deadline silently: 0 or less times every call out, NaN compares false (no deadline in the pool), infinity never
    fires, and a string stops the pool's watchdog thread with a TypeError, after which nothing has a deadline."""
    if timeout is None:
        return
    if (
        isinstance(timeout, bool)
        or not isinstance(timeout, (int, float))
        or not math.isfinite(timeout)
        or timeout <= 0
    ):
        raise ValueError(
            f"tool_timeout must be a positive, finite number of seconds a tool call may run, or None for no deadline "
            f"(a hung tool then hangs the run); got {timeout!r} ({type(timeout).__name__})."
        )


class ToolFatalError(RuntimeError):
    """A tool's dependency is gone: stop the run.

    Every other exception from a tool becomes an error observation, because it is about this call (bad input, a
    transient failure) and the model can read it and go on. A tool raises this one when no later call can succeed
    either (its retrieval server has stopped answering, say): training on with every call failing would finish the
    run on rollouts that taught the model nothing, with only a metric to show it. `run_tool_call` re-raises it.
    """


class StuckToolsError(ToolFatalError):
    """More tool threads are stuck past their deadline than `MAX_STUCK_TOOL_THREADS` (`note_stuck`): the run stops,
    as for any `ToolFatalError`."""


def run_tool_call(
    tool_call: dict,
    tools: dict[str, Callable],
    timeout: float | None,
    max_chars: int | None,
    execution: str = "main",
    event_loop: asyncio.AbstractEventLoop | None = None,
) -> ToolResult:
    """Run one parsed tool call (`{"type": "function", "function": {"name", "arguments"}}`) safely.

    `timeout` is every call's deadline, in every mode, the conversion of the result to text included (`_bounded`,
    `_await_tool`; None: no deadline); a result that comes after it is dropped and the call answered as a timeout;
    `max_chars` cuts what the model sees (`ToolResult.observation`), not the content reward functions receive.
    Re-raises only KeyboardInterrupt (the user stops the run) and ToolFatalError (the tool says the run cannot go on).
    """
    if execution != POOLED:
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
    tool = tools[name]
    try:
        arguments = _check_arguments(tool, function.get("arguments", {}))
    except Exception as e:  # noqa: BLE001 - a call that does not fit the tool never runs; the model reads why
        return error_result(name, _describe(e), max_chars)

    def work() -> ToolResult:  # the call and its conversion to text, under one deadline
        return _value_result(name, _call_tool(tool, arguments, timeout, event_loop, name), max_chars)

    try:
        if inspect.iscoroutinefunction(tool) and execution != POOLED and timeout is not None:
            # its await has the deadline (`_await_tool`, which cancels the task); this bounds the conversion too
            return _run_in_worker(work, {}, timeout, name, grace=4 * RETRY_DEADLINE_SECONDS)
        return _bounded(work, timeout, execution, name)
    except (KeyboardInterrupt, ToolFatalError):
        raise  # the user, or a tool whose dependency is gone, stops the run; not something the model did
    except BaseException as e:  # noqa: BLE001 - SystemExit, GeneratorExit, ...: the model sees the error, the run goes on
        _advise_on_signal_use(name, e)
        return error_result(
            name, _describe(e), max_chars, abandoned=isinstance(e, CallAbandoned), error_type=type(e).__name__
        )


_SIGNAL_ADVISED: set[str] = set()


def _advise_on_signal_use(name: str, error: BaseException) -> None:
    """A tool that sets a signal handler (TRL's agent example times its calls out with `signal.alarm`) fails in a
    worker thread, which is where calls run concurrently: say once per tool which setting runs it, since the model
    only sees the error."""
    if (
        isinstance(error, ValueError)
        and "signal only works in main thread" in _safe_str(error)
        and name not in _SIGNAL_ADVISED
    ):
        _SIGNAL_ADVISED.add(name)
        logger.warning(
            "Tool %s uses `signal`, which only works in the main thread, but tool calls run concurrently in worker "
            "threads (tool_execution='thread', the default). Every call of it fails. Set tool_execution='main' to run "
            "tools one at a time in the trainer's thread, as GRPOTrainer does (tool_timeout then is a SIGALRM "
            "timer), or drop the tool's own alarm: tool_timeout already bounds every call.",
            name,
        )


# ---------------------------------------------------------------------------------------------------------------
# Batched tools: one request for the calls of a round
# ---------------------------------------------------------------------------------------------------------------

BATCH_ATTRIBUTE = "__trl_tree_batch__"


@dataclass(frozen=True)
class BatchForm:
    """A tool's batched form (see `batched_tool`)."""

    fn: Callable
    max_batch_size: int | None = None


def batched_tool(batch_fn: Callable, max_batch_size: int | None = None) -> Callable[[Callable], Callable]:
    """Declare the batched form of a tool, for servers that answer many requests in one (Search-R1's retrieval
    server takes a list of queries).

    `batch_fn(calls)` takes a list of the keyword arguments of several calls (each already checked against the tool's
    own signature) and returns one result per call, in order: a value as the tool would return it, or an exception
    instance for a call that failed alone. It may be a coroutine function. The tool itself stays a plain function:
    TRL builds its schema from it, and it is what runs when calls run one at a time (`max_concurrent_tool_calls=1`).
    When calls run through the executor, the calls of one round to the same tool go in one request of at most
    `max_batch_size` calls (None: no cap), under one deadline (`tool_timeout`).

        def search_many(calls):
            return retriever.search([c["query"] for c in calls])

        @batched_tool(search_many, max_batch_size=64)
        def search(query: str) -> str:
            return search_many([{"query": query}])[0]
    """
    if not callable(batch_fn):
        raise TypeError(f"batched_tool needs a callable batched form; got {type(batch_fn).__name__}.")
    if max_batch_size is not None and (
        isinstance(max_batch_size, bool) or not isinstance(max_batch_size, int) or max_batch_size < 1
    ):
        raise ValueError(
            f"max_batch_size must be a positive number of calls per request, or None; got {max_batch_size!r}."
        )

    def declare(tool: Callable) -> Callable:
        setattr(tool, BATCH_ATTRIBUTE, BatchForm(batch_fn, max_batch_size))
        return tool

    return declare


def batch_form(tool: Callable) -> BatchForm | None:
    """The batched form a tool declares (`batched_tool`), or None."""
    form = getattr(tool, BATCH_ATTRIBUTE, None)
    return form if isinstance(form, BatchForm) else None
