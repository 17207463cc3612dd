"""Many tool calls at once: a bounded pool of worker threads, batched requests, calls in flight during generation.

A real agent's tools are slow (a retrieval server answers in 50-500 ms, a sandbox in seconds), and TRL's GRPOTrainer
runs a batch's calls one after another, so a step pays calls × latency. Here the calls that are ready in one round of
the turn loop (every branch of every tree of the rank) start together:

- a call is one *job* for the pool, run by `tools.run_tool_call` in `execution="thread"` mode, so it keeps its own
  deadline (`tool_timeout`) and its error handling: a job ends within its deadline whatever the tool does, and a
  pool thread is never held by a hung tool (the tool's own thread lingers, as Python cannot kill a thread). Ten hung
  calls of one round cost one deadline, not ten;
- the calls of one branch's turn run in order, in one job (a *lane*), as GRPOTrainer runs them: a later call may rely
  on an earlier one (the same environment instance, a file it wrote). Concurrency is across branches;
- the calls of one round to a standalone tool with a batched form (`tools.batched_tool`) go in one request per
  `max_batch_size`, under one deadline (the Search-R1 server takes a list of queries);
- at most `max_concurrent` jobs run at once; the rest wait in order.

Results come back as `ToolJob`s that the turn loop attaches to their branches in a fixed order (the branches' order in
the round), never in the order they finish, so a run whose rounds wait for their calls samples the same tokens
whatever the tools' timing. `KeyboardInterrupt` (the user) and `ToolFatalError` (a tool whose dependency is gone),
raised by any call, reach the waiting thread within `POLL_SECONDS`, and the jobs not yet started are dropped.
"""

from __future__ import annotations

import asyncio
import inspect
import queue
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from .tools import (
    ToolFatalError,
    ToolResult,
    _await_tool,
    _check_arguments,
    _describe,
    _run_in_worker,
    _value_result,
    batch_form,
    error_result,
    run_tool_call,
)

POLL_SECONDS = 0.05  # how often a waiting thread looks up from its wait: Ctrl-C and a fatal error land within it


@dataclass
class PlannedCall:
    """One parsed tool call of one branch, with the tools it may reach (the branch's, bound to its environment)."""

    call: dict
    tools: dict[str, Callable]


@dataclass
class ToolJob:
    """What the pool runs: `run()` returns one `ToolResult` per call of the job, in order. `done` is set when it has
    (or when it failed: `error` holds what it raised, re-raised in the waiting thread)."""

    run: Callable[[], list[ToolResult]]
    results: list[ToolResult] | None = None
    error: BaseException | None = None
    done: threading.Event = field(default_factory=threading.Event)
    started: float | None = None
    finished: float | None = None


class ToolExecutor:
    """A bounded pool of daemon worker threads for tool jobs.

    Daemon threads, not `concurrent.futures.ThreadPoolExecutor`'s: the interpreter joins those at exit, so a tool
    stuck past its deadline (its job has returned, its own thread has not) or a run stopped by Ctrl-C would keep the
    process alive. Workers start when first needed, up to `max_concurrent`.
    """

    def __init__(self, max_concurrent: int):
        check_max_concurrent_tool_calls(max_concurrent)
        self.max_concurrent = max_concurrent
        self._queue: queue.SimpleQueue[tuple[int, ToolJob]] = queue.SimpleQueue()
        self._workers: list[threading.Thread] = []
        self._idle = 0
        self._lock = threading.Lock()
        self._generation = 0  # bumped by cancel(): queued jobs of an earlier generation are dropped

    def submit(self, jobs: Sequence[ToolJob]) -> None:
        """Queue the jobs in order; each starts when a worker is free, and workers are added while more jobs wait
        than workers are free, up to `max_concurrent`."""
        with self._lock:
            for job in jobs:
                self._queue.put((self._generation, job))
            while self._queue.qsize() > self._idle and len(self._workers) < self.max_concurrent:
                self._idle += 1  # a new worker is free until it takes a job
                worker = threading.Thread(target=self._work, daemon=True, name=f"tool-pool-{len(self._workers)}")
                self._workers.append(worker)
                worker.start()

    def cancel(self) -> None:
        """Drop every queued job that has not started (running ones finish within their deadlines, unobserved)."""
        with self._lock:
            self._generation += 1

    def _work(self) -> None:
        while True:
            generation, job = self._queue.get()
            with self._lock:
                self._idle -= 1
                dropped = generation != self._generation
            if dropped:
                job.error = _Cancelled()
                job.done.set()
            else:
                job.started = time.monotonic()
                try:
                    job.results = job.run()
                except BaseException as e:  # noqa: BLE001 - handed to the waiting thread, which re-raises it
                    job.error = e
                job.finished = time.monotonic()
                job.done.set()
            with self._lock:
                self._idle += 1


class _Cancelled(Exception):
    """A queued job dropped by `ToolExecutor.cancel` (the run is stopping)."""


def wait_for(jobs: Sequence[ToolJob], executor: ToolExecutor, first: bool = False) -> None:
    """Wait until every job is done (`first`: until one is), re-raising the first run-stopping error in job order.

    The wait wakes every `POLL_SECONDS`, so Ctrl-C is not held up by a tool; a job that raised `ToolFatalError` or
    `KeyboardInterrupt` stops the wait at once. Either way the jobs not yet started are dropped (`cancel`).
    """
    try:
        while True:
            pending = [job for job in jobs if not job.done.is_set()]
            for job in jobs:
                if job.done.is_set() and job.error is not None and not isinstance(job.error, _Cancelled):
                    raise job.error
            if not pending or (first and len(pending) < len(jobs)):
                return
            pending[0].done.wait(POLL_SECONDS)
    except BaseException:
        executor.cancel()
        raise


# ---------------------------------------------------------------------------------------------------------------
# Jobs from a round's calls
# ---------------------------------------------------------------------------------------------------------------


@dataclass
class CallLimits:
    """What every call keeps: its deadline, the cut of what the model sees, and where async tools run."""

    timeout: float | None
    max_chars: int | None
    event_loop: Any = None


def plan_jobs(requests: Sequence[Sequence[PlannedCall]], environments: Sequence[Any], limits: CallLimits,
              ) -> tuple[list[ToolJob], list[list[tuple[ToolJob, int]]]]:
    """The jobs for one round: `requests[i]` is branch i's calls (in order), `environments[i]` its environment
    instance (None: standalone tools only). Returns the jobs and, per branch and call, (job, index of the call's
    result in that job).

    A branch's calls run in order, in one job (its *lane*), as GRPOTrainer runs a turn's calls: a later call may rely
    on what an earlier one did (a file written, the environment's state); concurrency is across branches. The
    exception are calls to a standalone tool with a batched form: by declaring it, the tool says its calls may be made
    together, so the round's calls to it from every branch go in one request (`max_batch_size` a request).
    """
    jobs: list[ToolJob] = []
    where: list[list[tuple[ToolJob, int] | None]] = [[None] * len(calls) for calls in requests]
    batches: dict[int, list[tuple[int, int, PlannedCall, dict]]] = {}
    forms: dict[int, Any] = {}
    for i, (calls, environment) in enumerate(zip(requests, environments)):
        lane = []
        for k, planned in enumerate(calls):
            tool = _named_tool(planned)
            form = batch_form(tool) if tool is not None and not _bound_to(tool, environment) else None
            arguments = _checked_arguments(tool, planned) if form is not None else None
            if arguments is None:  # no batched form, or arguments that do not fit: run alone, which says why
                lane.append(k)
                continue
            batches.setdefault(id(form.fn), []).append((i, k, planned, arguments))
            forms[id(form.fn)] = form
        if lane:
            job = ToolJob(_run_in_order([calls[k] for k in lane], limits))
            jobs.append(job)
            for position, k in enumerate(lane):
                where[i][k] = (job, position)
    for key, members in batches.items():
        form = forms[key]
        size = form.max_batch_size or len(members)
        for start in range(0, len(members), size):
            chunk = members[start : start + size]
            job = ToolJob(_run_batch(form.fn, [m[2] for m in chunk], [m[3] for m in chunk], limits))
            jobs.append(job)
            for position, (i, k, _, _) in enumerate(chunk):
                where[i][k] = (job, position)
    return jobs, where


def _named_tool(planned: PlannedCall) -> Callable | None:
    function = planned.call.get("function") if isinstance(planned.call, dict) else None
    name = function.get("name") if isinstance(function, dict) else None
    kind = planned.call.get("type", "function") if isinstance(planned.call, dict) else None
    return planned.tools.get(name) if isinstance(name, str) and kind == "function" else None


def _bound_to(tool: Callable, environment) -> bool:
    """Whether `tool` is a method of the branch's environment instance (its calls share that instance's state)."""
    return environment is not None and getattr(tool, "__self__", None) is environment


def _checked_arguments(tool: Callable, planned: PlannedCall) -> dict | None:
    """The call's arguments checked against the tool's own signature, or None when they do not fit (the call then runs
    alone through `run_tool_call`, which words the error for the model)."""
    try:
        return _check_arguments(tool, planned.call["function"].get("arguments", {}))
    except ValueError:
        return None


def _run_in_order(calls: list[PlannedCall], limits: CallLimits) -> Callable[[], list[ToolResult]]:
    def run() -> list[ToolResult]:
        return [run_tool_call(c.call, c.tools, limits.timeout, limits.max_chars, "thread", limits.event_loop)
                for c in calls]

    return run


def _run_batch(fn: Callable, calls: list[PlannedCall], arguments: list[dict], limits: CallLimits,
               ) -> Callable[[], list[ToolResult]]:
    """One request of a tool's batched form for several calls, under one deadline. Its failure (an exception, a
    timeout, a wrong number of results) is every call's error; an exception instance in its place is that call's."""

    def run() -> list[ToolResult]:
        name = calls[0].call["function"]["name"]
        try:
            if inspect.iscoroutinefunction(fn):
                values = _await_tool(fn(arguments), limits.timeout, limits.event_loop)
            else:
                values = _run_in_worker(lambda: fn(arguments), {}, limits.timeout)
                if inspect.isawaitable(values):
                    values = _await_tool(values, limits.timeout, limits.event_loop)
            values = list(values)
            if len(values) != len(arguments):
                raise ValueError(f"the batched form of {name} returned {len(values)} results for {len(arguments)} "
                                 "calls; it must return one per call, in order")
        except (KeyboardInterrupt, ToolFatalError, asyncio.CancelledError):
            raise
        except BaseException as e:  # noqa: BLE001 - every call of the request gets the error, the run goes on
            return [error_result(name, _describe(e), limits.max_chars) for _ in calls]
        return [_batched_value(name, value, limits.max_chars) for value in values]

    return run


def _batched_value(name: str, value, max_chars: int | None) -> ToolResult:
    if isinstance(value, ToolFatalError):
        raise value
    if isinstance(value, BaseException):
        return error_result(name, _describe(value), max_chars)
    return _value_result(name, value, max_chars)


def check_max_concurrent_tool_calls(value: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(
            f"max_concurrent_tool_calls must be a positive number of tool calls in flight at once (1: one after "
            f"another, as GRPOTrainer runs them); got {value!r}."
        )
