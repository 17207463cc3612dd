"""Many tool calls at once: a bounded pool of worker threads, batched requests, calls in flight during generation.

A real agent's tools are slow (a retrieval server answers in 50-500 ms, a sandbox in seconds), and TRL's GRPOTrainer
runs a batch's calls one after another, so a step pays calls × latency. Here the calls that are ready in one round of
the turn loop (every branch of every tree of the rank) start together:

- a call runs through `tools.run_tool_call` in a worker of the pool, so it keeps its error handling, and the pool's
  watchdog keeps its deadline (`tool_timeout`): a call past it is a timeout error at once, whatever the tool does,
  and the worker stuck in it leaves the pool for a new one (Python cannot kill a thread). Ten hung calls of one
  round cost one deadline, not ten;
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
import logging
import queue
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from .tools import (
    _SIGNAL_ADVISED,
    POOLED,
    ToolFatalError,
    ToolResult,
    _await_tool,
    _check_arguments,
    _describe,
    _timed_out,
    _value_result,
    batch_form,
    error_result,
    note_stuck,
    run_tool_call,
)

logger = logging.getLogger(__name__)

POLL_SECONDS = 0.05  # how often a waiting thread looks up from its wait: Ctrl-C and a fatal error land within it


@dataclass
class PlannedCall:
    """One parsed tool call of one branch, with the tools it may reach (the branch's, bound to its environment)."""

    call: dict
    tools: dict[str, Callable]


@dataclass(eq=False)
class ToolJob:
    """What the pool runs: `steps` in order, each returning the `ToolResult`s of its calls (a lane's step is one call,
    a batched request's one step answers all its calls). `timeout` is each step's deadline (None: none); when a step
    passes it, `expire(i)` gives the results that stand for steps i.. (a timeout error for step i's calls, "not run"
    for the later ones). `done` is set when the job has its results, or failed (`error`, re-raised in the waiting
    thread)."""

    steps: list[Callable[[], list[ToolResult]]]
    timeout: float | None = None
    expire: Callable[[int], list[ToolResult]] | None = None
    names: list[str] = field(default_factory=list)  # each step's tool, to name one that is stuck
    results: list[ToolResult] | None = None
    error: BaseException | None = None
    done: threading.Event = field(default_factory=threading.Event)
    started: float | None = None
    finished: float | None = None
    # the worker's progress, which the watchdog reads under `lock`
    lock: threading.Lock = field(default_factory=threading.Lock, repr=False)
    partial: list[ToolResult] = field(default_factory=list, repr=False)
    step: int = 0
    step_started: float = 0.0
    expired: bool = False
    worker: threading.Thread | None = field(default=None, repr=False)  # the thread running it
    epoch: int = 0  # the pool's epoch (`ToolExecutor.close`) of that thread


class ToolExecutor:
    """A bounded pool of daemon worker threads for tool jobs, with a watchdog for their deadlines.

    A worker runs a job's calls itself, in its own thread: a thread per call (the single-call path's way to stop
    waiting at a deadline) costs ~150 µs of interpreter time a call, more than a fast tool. So the deadline is the
    watchdog's: every `POLL_SECONDS` it looks at the running jobs, and a step past its deadline gets its timeout
    results at once, whatever the tool does. Python cannot kill the worker stuck in it: that thread leaves the pool
    (it exits when the tool returns, its late results dropped) and a new worker takes its place, so a hung tool never
    holds the pool's capacity, and ten hung calls of a round cost one deadline. The threads so left are counted
    (`tools.note_stuck`: a warning naming the tool the first time, the `tools/stuck_workers` metric, and past
    `tools.MAX_STUCK_TOOL_THREADS` a `StuckToolsError` raised where the run waits).

    Daemon threads, not `concurrent.futures.ThreadPoolExecutor`'s: the interpreter joins those at exit, so a tool
    stuck past its deadline, or a run stopped by Ctrl-C, would keep the process alive. Workers start when first
    needed, up to `max_concurrent`; `close()` (or leaving a `with` block) stops them and the watchdog, and the pool
    starts new ones if it is used again.
    """

    def __init__(self, max_concurrent: int):
        check_max_concurrent_tool_calls(max_concurrent)
        self.max_concurrent = max_concurrent
        self._queue: queue.SimpleQueue[tuple[int, ToolJob] | None] = queue.SimpleQueue()
        self._workers = 0
        self._idle = 0  # workers waiting for a job (counted until they take one, under `_lock`)
        self._pending = 0  # jobs queued and not yet taken (the same bookkeeping: qsize() runs ahead of it)
        self._running: set[ToolJob] = set()
        self._threads: set[threading.Thread] = set()  # this epoch's workers
        self._lock = threading.Lock()
        self._generation = 0  # bumped by cancel(): queued jobs of an earlier generation are dropped
        self._epoch = 0  # bumped by close(): the workers of an earlier epoch exit, their counts no longer kept
        self._watchdog: threading.Thread | None = None
        self._stop_watching: threading.Event | None = None
        self.finished = threading.Condition()  # notified whenever a job is done (`wait_for(first=True)`)

    def __enter__(self) -> ToolExecutor:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def submit(self, jobs: Sequence[ToolJob]) -> None:
        """Queue the jobs in order; each starts when a worker is free, and workers are added while more jobs wait
        than workers are free, up to `max_concurrent`."""
        with self._lock:
            for job in jobs:
                self._queue.put((self._generation, job))
            self._pending += len(jobs)
            self._add_workers()
            if self._watchdog is None and any(job.timeout is not None for job in jobs):
                self._stop_watching = threading.Event()
                self._watchdog = threading.Thread(
                    target=self._watch, args=(self._stop_watching,), daemon=True, name="tool-pool-watchdog"
                )
                self._watchdog.start()

    def _add_workers(self) -> None:
        """Start workers while more jobs wait than workers are free. Both counts change under `_lock` only: an idle
        worker may already have taken a job off the queue and wait for the lock to say so."""
        while self._pending > self._idle and self._workers < self.max_concurrent:
            self._idle += 1  # a new worker is free until it takes a job
            self._workers += 1
            thread = threading.Thread(
                target=self._work, args=(self._queue, self._epoch), daemon=True, name=f"tool-pool-{self._workers}"
            )
            self._threads.add(thread)
            thread.start()

    def cancel(self) -> None:
        """Drop every queued job that has not started (running ones finish within their deadlines, unobserved)."""
        with self._lock:
            self._generation += 1

    def close(self) -> None:
        """Stop the pool's threads: queued jobs are dropped, idle workers and the watchdog exit now (joined), a worker
        busy with a call exits when its call ends. Safe to call more than once, and on every exit path (the turn loop,
        the agent evaluation and the trainer call it when they end, Ctrl-C included); a later `submit` starts new
        threads. Threads stuck in a tool past its deadline stay until the tool returns (`tools.note_stuck`)."""
        with self._lock:
            self._generation += 1
            for _ in range(self._workers):
                self._queue.put(None)  # one per worker of this epoch: each takes one and exits
            busy = {job.worker for job in self._running}
            threads = [t for t in self._threads if t not in busy]
            self._queue = queue.SimpleQueue()
            self._epoch += 1
            self._workers = self._idle = self._pending = 0
            self._threads = set()
            watchdog, self._watchdog = self._watchdog, None
            if self._stop_watching is not None:
                self._stop_watching.set()
            self._stop_watching = None
        for thread in threads + ([watchdog] if watchdog is not None else []):
            if thread is not threading.current_thread():
                thread.join(1.0)  # they are waiting on the queue or the stop event: they exit at once

    def _work(self, tasks: queue.SimpleQueue, epoch: int) -> None:
        while True:
            item = tasks.get()
            if item is None:  # the pool was closed
                return
            generation, job = item
            with self._lock:
                if epoch == self._epoch:
                    self._idle -= 1
                    self._pending -= 1
                dropped = generation != self._generation
                if not dropped:
                    job.worker, job.epoch = threading.current_thread(), epoch
                    self._running.add(job)
            if dropped:
                job.error = _Cancelled()
                self._settle(job)
            elif not self._run(job):
                return  # the watchdog gave up on this thread's tool: it has left the pool
            with self._lock:
                if epoch == self._epoch:
                    self._idle += 1

    def _run(self, job: ToolJob) -> bool:
        """Run a job's steps; False when the watchdog expired it meanwhile (this thread then leaves the pool)."""
        job.started = time.monotonic()
        error = None
        for i, step in enumerate(job.steps):
            with job.lock:
                job.step, job.step_started = i, time.monotonic()
            try:
                results = step()
            except BaseException as e:  # noqa: BLE001 - handed to the waiting thread, which re-raises it
                error = e
            with job.lock:
                if job.expired:
                    return False
                if error is not None:
                    break
                job.partial.extend(results)
        with job.lock:
            job.error = error
            job.results = None if error is not None else list(job.partial)
        self._settle(job)
        return True

    def _settle(self, job: ToolJob) -> None:
        job.finished = time.monotonic()
        with self._lock:
            self._running.discard(job)
        job.done.set()
        with self.finished:
            self.finished.notify_all()

    def _watch(self, stop: threading.Event) -> None:
        """Expire every step past its deadline, every `POLL_SECONDS`, until the pool is closed."""
        while not stop.wait(POLL_SECONDS):
            now = time.monotonic()
            with self._lock:
                running = list(self._running)
            for job in running:
                with job.lock:
                    late = (
                        job.timeout is not None
                        and not job.expired
                        and not job.done.is_set()
                        and now - job.step_started > job.timeout
                    )
                    if late:
                        job.expired = True
                        job.results = job.partial + job.expire(job.step)
                if late:
                    with self._lock:  # its worker is stuck in the tool: a new one takes its place
                        self._threads.discard(job.worker)
                        if job.epoch == self._epoch:
                            self._workers -= 1
                            self._add_workers()
                    name = job.names[job.step] if job.step < len(job.names) else "unknown"
                    job.error = note_stuck(job.worker, name, job.timeout)  # past the cap: raised where the run waits
                    self._settle(job)


class _Cancelled(Exception):
    """A queued job dropped by `ToolExecutor.cancel` (the run is stopping)."""


def wait_for(jobs: Sequence[ToolJob], executor: ToolExecutor, first: bool = False) -> None:
    """Wait until every job is done (`first`: until one is), re-raising the first run-stopping error in job order.

    The wait wakes at least every `POLL_SECONDS`, so Ctrl-C is not held up by a tool, and a job that raised
    `ToolFatalError` or `KeyboardInterrupt` stops the wait within that time even while earlier jobs still run. Either
    way the jobs not yet started are dropped (`cancel`).
    """
    try:
        if first:
            while not any(job.done.is_set() for job in jobs):
                with executor.finished:
                    executor.finished.wait(POLL_SECONDS)
                _raise_stopping(jobs)
        else:
            for job in jobs:
                while not job.done.wait(POLL_SECONDS):
                    _raise_stopping(jobs)
        _raise_stopping(jobs)
    except BaseException:
        executor.cancel()
        raise


def _raise_stopping(jobs: Sequence[ToolJob]) -> None:
    """Re-raise the first error of a finished job (in job order): ToolFatalError, KeyboardInterrupt, or a failure of
    the job's own machinery; a dropped job's cancellation is not one."""
    for job in jobs:
        if job.done.is_set() and job.error is not None and not isinstance(job.error, _Cancelled):
            raise job.error


# ---------------------------------------------------------------------------------------------------------------
# Jobs from a round's calls
# ---------------------------------------------------------------------------------------------------------------


@dataclass
class CallLimits:
    """What every call keeps: its deadline, the cut of what the model sees, and where async tools run."""

    timeout: float | None
    max_chars: int | None
    event_loop: Any = None


def plan_jobs(
    requests: Sequence[Sequence[PlannedCall]],
    environments: Sequence[Any],
    limits: CallLimits,
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
            job = _lane_job([calls[k] for k in lane], limits)
            jobs.append(job)
            for position, k in enumerate(lane):
                where[i][k] = (job, position)
    for key, members in batches.items():
        form = forms[key]
        size = form.max_batch_size or len(members)
        for start in range(0, len(members), size):
            chunk = members[start : start + size]
            job = _batch_job(form.fn, [m[2] for m in chunk], [m[3] for m in chunk], limits)
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


def _lane_job(calls: list[PlannedCall], limits: CallLimits) -> ToolJob:
    """A branch's calls, one step each, in order. When one passes its deadline, the later ones are not run: they
    would share the instance (or the files) that the call still running holds."""

    def step(planned: PlannedCall) -> Callable[[], list[ToolResult]]:
        return lambda: [
            run_tool_call(planned.call, planned.tools, limits.timeout, limits.max_chars, POOLED, limits.event_loop)
        ]

    def expire(i: int) -> list[ToolResult]:
        name = _call_name(calls[i])
        timed_out = error_result(
            name, _describe(_timed_out(limits.timeout)), limits.max_chars, abandoned=True, error_type="TimeoutError"
        )
        return [timed_out] + [
            error_result(
                _call_name(c),
                f"Not run: the call of {name} before it in this turn timed out and may still be running.",
                limits.max_chars,
            )
            for c in calls[i + 1 :]
        ]

    return ToolJob([step(c) for c in calls], limits.timeout, expire, names=[_call_name(c) for c in calls])


def _call_name(planned: PlannedCall) -> str:
    function = planned.call.get("function") if isinstance(planned.call, dict) else None
    name = function.get("name") if isinstance(function, dict) else None
    return name if isinstance(name, str) else "unknown"


def _batch_job(fn: Callable, calls: list[PlannedCall], arguments: list[dict], limits: CallLimits) -> ToolJob:
    """One request of a tool's batched form for several calls, under one deadline. Its failure (an exception, a
    timeout, results of the wrong shape: `check_batch_results`) is every call's error; an exception instance in its
    place is that call's."""
    name = _call_name(calls[0])

    def run() -> list[ToolResult]:
        try:
            if inspect.iscoroutinefunction(fn):
                values = _await_tool(fn(arguments), limits.timeout, limits.event_loop, name)
            else:
                values = fn(arguments)
                if inspect.isawaitable(values):
                    values = _await_tool(values, limits.timeout, limits.event_loop, name)
            check_batch_results(fn, name, values, len(arguments))
        except (KeyboardInterrupt, ToolFatalError, asyncio.CancelledError):
            raise
        except BaseException as e:  # noqa: BLE001 - every call of the request gets the error, the run goes on
            return [error_result(name, _describe(e), limits.max_chars, error_type=type(e).__name__) for _ in calls]
        return [_batched_value(name, value, limits.max_chars) for value in values]

    def expire(i: int) -> list[ToolResult]:
        return [
            error_result(
                name,
                _describe(_timed_out(limits.timeout)),
                limits.max_chars,
                abandoned=True,
                error_type="TimeoutError",
            )
            for _ in calls
        ]

    return ToolJob([run], limits.timeout, expire, names=[name])


_BAD_BATCH_WARNED: set[str] = set()


def check_batch_results(fn: Callable, name: str, values, calls: int) -> None:
    """A batched form returns a list or tuple of one result per call, in order; anything else (a dict, whose keys
    would become the answers; a str, whose characters would; None; a generator; the wrong length) is a TypeError
    naming the form and what it must return, which every call of the request gets as its error, and which is logged
    once per form (the model alone would read it otherwise)."""
    form = getattr(fn, "__qualname__", None) or type(fn).__name__
    if not isinstance(values, (list, tuple)):
        problem = f"returned a {type(values).__name__}"
    elif len(values) != calls:
        problem = f"returned {len(values)} results for {calls} calls"
    else:
        return
    message = (
        f"the batched form {form} of tool {name} {problem}; it must return a list (or tuple) of one result "
        f"per call, in order ({calls} here): a value as the tool returns it, or an exception instance for a "
        "call that failed alone"
    )
    if form not in _BAD_BATCH_WARNED:
        _BAD_BATCH_WARNED.add(form)
        logger.warning("Every call of this request fails: %s.", message)
    raise TypeError(message)


_THREAD_HINTED: set[str] = set()


def advise_on_failing_round(results: Sequence[ToolResult]) -> None:
    """A tool that failed every one of its calls of a round, two or more, in worker threads, with the same exception
    type (not a timeout) most likely cannot run there: a client made in the main thread (a `sqlite3` connection is
    usable only in its own thread), or state that is not thread-safe. Say once per tool which setting runs it in the
    trainer's thread, since the model alone reads the errors."""
    by_tool: dict[str, list[ToolResult]] = {}
    for result in results:
        by_tool.setdefault(result.name, []).append(result)
    for name, calls in by_tool.items():
        types = {r.error_type for r in calls}
        if name in _THREAD_HINTED or name in _SIGNAL_ADVISED:  # said once; `signal` use has its own advice
            continue
        if len(calls) < 2 or not all(r.failed for r in calls) or len(types) != 1:
            continue
        (error_type,) = types
        if error_type is None or error_type in ("TimeoutError", "CallAbandoned"):
            continue
        _THREAD_HINTED.add(name)
        logger.warning(
            "Tool %s failed all %d of its calls of this round in worker threads, each with %s (first: %s). If it "
            "uses a client made in another thread (a sqlite3 connection only works in the thread that made it) or "
            "state that is not safe to share between threads, set tool_execution='main' to run tools one at a time "
            "in the trainer's thread, as GRPOTrainer does; tools must be thread-safe to run concurrently "
            "(docs/design.md §5).",
            name,
            len(calls),
            error_type,
            calls[0].content,
        )


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
