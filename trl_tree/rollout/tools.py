"""One tool call from the model: untrusted input, run the way TRL's GRPOTrainer runs it.

Only registered tools run; arguments are checked against the tool's signature (names, count and annotated types) before
the call. Whatever a tool does — return any value (one that cannot be printed included), raise any exception
(`SystemExit` and `GeneratorExit` included), hang past its timeout, return an enormous string — the result is a tool
message, never a crash of the training run. The exceptions are
`KeyboardInterrupt`: the user stopping the run is re-raised, from the thread that called the tool; and
`ToolFatalError`, which a tool raises when its dependency is gone (no later call can succeed): the run stops.

As in GRPOTrainer's tool loop, the tool message's content is the tool's return value itself when it is a list (content
blocks), else `str(value)`, and a failure is `str({"error": message})`; that is what reward functions receive in
`completions`. The model sees the same message cut at `max_observation_chars`. Every call has a deadline (`timeout`;
None: none, by the user's choice), enforced by the caller. Synchronous tools run in the calling thread with
`execution="main"`, as in GRPOTrainer, so a tool can time itself out with `signal.alarm`, and the deadline is a SIGALRM
timer there (`_run_with_alarm`); `execution="thread"` runs them in a worker thread that we stop waiting for at the
deadline. Async tools run on GRPOTrainer's background event loop when one is given, else on a private loop in a daemon
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
import re
import signal
import threading
import time
import types
import typing
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from ..text import shorten

logger = logging.getLogger(__name__)

TRUNCATION_MARKER = "\n...[truncated: {n} more characters]"
MAX_OBSERVATION_CHARS = 16_384  # the TreeOPSD paper's cap on a retrieved observation (Appendix E.3)
TOOL_EXECUTION_MODES = ("main", "thread")
POOLED = "pooled"  # internal: a synchronous tool runs in the calling thread, whose caller enforces the deadline


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
    """The content GRPOTrainer puts in a tool message: a list (content blocks) as it is, anything else `str(value)`,
    with two departures, both about text the model could otherwise not be shown:

    - `bytes` that are UTF-8 are decoded (GRPOTrainer's `str(value)` shows the model `b'...'` with escapes, which no
      tool author means); other bytes stay `str(value)`;
    - characters the tokenizer cannot encode (lone surrogates, what `surrogateescape` makes of non-UTF-8 output) are
      replaced with U+FFFD: the tokenizer would raise on them and stop training, naming neither tool nor cause.
    """
    if isinstance(value, list):
        return value
    text = str(value)
    if isinstance(value, (bytes, bytearray)):
        with contextlib.suppress(UnicodeDecodeError):
            text = bytes(value).decode("utf-8")
    return encodable_text(text)


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


def error_result(name: str, message: str, max_chars: int | None = None) -> ToolResult:
    """A failed call, worded as GRPOTrainer words it: the tool message's content is `str({"error": message})`."""
    return _tool_result(name, {"error": message}, True, max_chars)


def _value_result(name: str, value, max_chars: int | None) -> ToolResult:
    """The tool message for a value a tool returned. Making it text runs the tool's own code (`__str__`, `__repr__`),
    which may raise like any other tool code: that is the tool's failure, an error observation, not the trainer's."""
    try:
        if isinstance(value, list):
            repr(value)  # content blocks reach the chat template as they are: each must at least be printable
        return _tool_result(name, value, False, max_chars)
    except KeyboardInterrupt:
        raise
    except BaseException as e:  # noqa: BLE001 - whatever the tool's __str__ raises, the run goes on
        why = f"{type(e).__name__}: {_safe_str(e)}"
        message = f"Tool {name} returned a {type(value).__name__} that cannot be converted to text ({why})."
        return error_result(name, message, max_chars)


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
        raise _timed_out(timeout)
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
    """`_settle` with the tool cancelled at the deadline. Only a tool that lets itself be cancelled stops here (and
    `wait_for` waits for the cancellation to finish): the caller enforces the deadline itself (`_await_tool`)."""
    try:
        return await asyncio.wait_for(_settle(awaitable), timeout)
    except asyncio.TimeoutError:
        return False, _timed_out(timeout)


def _timed_out(timeout: float) -> TimeoutError:
    return TimeoutError(f"timed out after {timeout:g} s")


def _await_tool(awaitable, timeout: float | None, event_loop: asyncio.AbstractEventLoop | None):
    """Run an async tool to completion: on `event_loop` (GRPOTrainer's `async_loop`, a daemon thread: tools that keep
    loop-bound clients between calls need the same loop every time), else on a new loop in a daemon thread.

    The deadline is the caller's: at `timeout` it stops waiting and the call is a timeout, whatever the tool does. The
    tool's task is cancelled too, but a tool may catch the cancellation and go on: it then runs on in the background,
    on its loop, and what it returns late is dropped. That is why a new loop runs in a thread of its own, not in this
    one: `asyncio.run` here would wait for such a tool. A tool that blocks its loop without awaiting holds that loop
    (GRPOTrainer's, for its other async tools), not the trainer.
    """
    settled = _settle_within(awaitable, timeout)
    if event_loop is None:
        ok, value = _run_in_worker(asyncio.run, {"main": settled}, timeout)
    else:
        future = asyncio.run_coroutine_threadsafe(settled, event_loop)
        try:
            ok, value = future.result(timeout)
        except concurrent.futures.TimeoutError:
            future.cancel()  # cancels the tool's task on its loop; if it ignores that, its result goes nowhere
            ok, value = False, _timed_out(timeout)
    if not ok:
        raise value
    return value


class _ToolDeadline(BaseException):
    """Raised inside a synchronous tool by the SIGALRM deadline. A BaseException, as asyncio's CancelledError is, so
    that a tool's `except Exception:` does not swallow its own timeout; `_run_with_alarm` makes it a TimeoutError."""


def _raise_deadline(signum, frame):
    raise _ToolDeadline


def _alarm_available() -> bool:
    """Whether this thread can take SIGALRM: Python runs signal handlers, and lets them be set, in the main thread
    only, and Windows has no SIGALRM."""
    return hasattr(signal, "setitimer") and threading.current_thread() is threading.main_thread()


def _run_with_alarm(fn: Callable, kwargs: dict, timeout: float):
    """Run `fn(**kwargs)` in this thread, with a SIGALRM deadline `timeout` seconds away.

    The handler raises inside the tool, between two bytecodes or out of an interrupted sleep or lock wait, so pure
    Python and blocking waits are stopped; C code that does not return to the interpreter (or that retries on EINTR)
    is not. The caller's SIGALRM handler and real-time timer are restored afterwards, the timer less the time the call
    took (a process has one ITIMER_REAL): a timer that fell due during the call fires at once. A tool that arms its
    own alarm (TRL's agent example does) replaces this deadline for the rest of its call.
    """
    start = time.monotonic()
    previous_handler = signal.signal(signal.SIGALRM, _raise_deadline)
    previous_timer = (0.0, 0.0)
    try:
        try:
            previous_timer = signal.setitimer(signal.ITIMER_REAL, max(timeout, 1e-6))  # 0 would disarm it
            return fn(**kwargs)
        finally:
            signal.setitimer(signal.ITIMER_REAL, 0)  # before anything else: the deadline must not fire into our code
    except _ToolDeadline:
        raise _timed_out(timeout) from None
    finally:
        # getsignal is None for a handler set outside Python; SIG_DFL is the closest we can put back
        signal.signal(signal.SIGALRM, signal.SIG_DFL if previous_handler is None else previous_handler)
        _restore_timer(previous_timer, time.monotonic() - start)


def _restore_timer(previous: tuple[float, float], elapsed: float) -> None:
    delay, interval = previous
    if delay > 0:
        signal.setitimer(signal.ITIMER_REAL, max(delay - elapsed, 1e-6), interval)


def _run_sync(fn: Callable, kwargs: dict, timeout: float | None, execution: str):
    """Run a synchronous tool with its deadline.

    `"thread"`: in a worker thread we stop waiting for at `timeout`. `"main"`: in this thread, as GRPOTrainer runs
    tools (so `signal`-based code in the tool works), with a SIGALRM timer as the deadline — it interrupts the tool
    where it is, in the thread it was promised. Where no signal can reach this thread (not the main thread, Windows)
    the worker thread's deadline stands in: the tool then runs in another thread, but a hung tool still cannot hold the
    trainer. `timeout=None` is no deadline, as the user chose.
    """
    if execution == "thread":
        return _run_in_worker(fn, kwargs, timeout)
    if execution == POOLED:  # a worker of `tool_executor.ToolExecutor`, whose watchdog gives up at the deadline
        return fn(**kwargs)
    if timeout is None:
        return fn(**kwargs)
    if _alarm_available():
        return _run_with_alarm(fn, kwargs, timeout)
    return _run_in_worker(fn, kwargs, timeout)


def _call_tool(fn: Callable, kwargs: dict, timeout: float | None, execution: str, event_loop):
    """Call a tool and return its raw value, raising what it raises (a TimeoutError at its deadline).

    A synchronous tool runs as `_run_sync` says; an async tool — or a tool returning an awaitable — is awaited with
    `timeout` in either mode (`_await_tool`).
    """
    if inspect.iscoroutinefunction(fn):
        return _await_tool(fn(**kwargs), timeout, event_loop)
    value = _run_sync(fn, kwargs, timeout, execution)
    return _await_tool(value, timeout, event_loop) if inspect.isawaitable(value) else value


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


class ToolFatalError(RuntimeError):
    """A tool's dependency is gone: stop the run.

    Every other exception from a tool becomes an error observation, because it is about this call (bad input, a
    transient failure) and the model can read it and go on. A tool raises this one when no later call can succeed
    either (its retrieval server has stopped answering, say): training on with every call failing would finish the
    run on rollouts that taught the model nothing, with only a metric to show it. `run_tool_call` re-raises it.
    """


def run_tool_call(
    tool_call: dict, tools: dict[str, Callable], timeout: float | None, max_chars: int | None,
    execution: str = "main", event_loop: asyncio.AbstractEventLoop | None = None,
) -> ToolResult:
    """Run one parsed tool call (`{"type": "function", "function": {"name", "arguments"}}`) safely.

    `timeout` is every call's deadline, in either mode (see `_run_sync`, `_await_tool`; None: no deadline);
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
    try:
        arguments = _check_arguments(tools[name], function.get("arguments", {}))
        value = _call_tool(tools[name], arguments, timeout, execution, event_loop)
    except (KeyboardInterrupt, ToolFatalError):
        raise  # the user, or a tool whose dependency is gone, stops the run; not something the model did
    except BaseException as e:  # noqa: BLE001 - SystemExit, GeneratorExit, ...: the model sees the error, the run goes on
        _advise_on_signal_use(name, e)
        return error_result(name, _describe(e), max_chars)
    return _value_result(name, value, max_chars)


_SIGNAL_ADVISED: set[str] = set()


def _advise_on_signal_use(name: str, error: BaseException) -> None:
    """A tool that sets a signal handler (TRL's agent example times its calls out with `signal.alarm`) fails in a
    worker thread, which is where calls run concurrently: say once per tool which setting runs it, since the model
    only sees the error."""
    if isinstance(error, ValueError) and "signal only works in main thread" in _safe_str(error) \
            and name not in _SIGNAL_ADVISED:
        _SIGNAL_ADVISED.add(name)
        logger.warning(
            "Tool %s uses `signal`, which only works in the main thread, but tool calls run concurrently in worker "
            "threads (tool_execution='thread', the default). Every call of it fails. Set tool_execution='main' to run "
            "tools one at a time in the trainer's thread, as GRPOTrainer does (tool_timeout then is a SIGALRM "
            "timer), or drop the tool's own alarm: tool_timeout already bounds every call.", name,
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
    if max_batch_size is not None and (isinstance(max_batch_size, bool) or not isinstance(max_batch_size, int)
                                       or max_batch_size < 1):
        raise ValueError(f"max_batch_size must be a positive number of calls per request, or None; got "
                         f"{max_batch_size!r}.")

    def declare(tool: Callable) -> Callable:
        setattr(tool, BATCH_ATTRIBUTE, BatchForm(batch_fn, max_batch_size))
        return tool

    return declare


def batch_form(tool: Callable) -> BatchForm | None:
    """The batched form a tool declares (`batched_tool`), or None."""
    form = getattr(tool, BATCH_ATTRIBUTE, None)
    return form if isinstance(form, BatchForm) else None
