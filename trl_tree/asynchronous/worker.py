"""The rollout worker: a thread that grows whole generation batches while the trainer trains.

The trainer admits jobs (`submit`: a generation batch's rows and the policy version to sample them with) and takes
finished batches in the same order (`take`). Between jobs, never inside one, the worker loads the job's published
weights into its own policy copy; inside a job it runs what the trainer gave it (`produce`: grow, score, μ's packed
forward, credit). It is one thread and one job at a time, so batches come back in admission order.

Stopping, on every path:
- a fault in the worker (any exception, a fatal tool error) ends the thread and is raised again by the trainer's
  next `take`, the worker's own exception object with a note saying where it came from; `take` polls, so a trainer
  waiting on a batch sees it within a tenth of a second;
- `close` (the trainer stopping, normally or on an error or Ctrl-C in its own thread) sets the stop flag, which the
  engine wrapper `StoppableEngine` checks before every engine call, so a job in progress ends at its next turn
  round; then it joins the thread;
- a weight load that stalls (longer than `load_seconds`) is raised by the trainer's `take` as a TimeoutError within
  a tenth of a second of the deadline, and `close` then reports the thread it cannot join. Python cannot interrupt a thread inside a C call or a tool, so `close` waits for
  the current engine call (and tool calls, which have `tool_timeout`), and says so if the thread outlives its wait.
"""

from __future__ import annotations

import queue
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from .weights import PolicyWeights

_POLL_SECONDS = 0.1


class RolloutWorkerStopped(Exception):
    """Raised inside the worker's engine calls once the worker is asked to stop: unwinds a job in progress."""


@dataclass
class RolloutJob:
    """One admitted generation batch: the loop's own `item` (its dataset rows), the `weights` to sample it with."""

    item: Any
    weights: PolicyWeights
    admitted_at: float = field(default_factory=time.perf_counter)


@dataclass
class Finished:
    """A grown batch and what it cost: `producer_wait`, seconds the worker sat idle before starting it (nothing
    admitted yet); `seconds`, how long growing it took."""

    job: RolloutJob
    result: Any
    producer_wait: float
    seconds: float


class StoppableEngine:
    """A generation engine that refuses to start a call once `stop` is set: the worker's turn loop calls the engine
    once per round, so a stop request ends a job at its next round instead of after the whole batch."""

    def __init__(self, engine, stop: threading.Event):
        self.engine, self.stop = engine, stop

    def generate(self, prefixes, max_new_tokens):
        if self.stop.is_set():
            raise RolloutWorkerStopped("the rollout worker was asked to stop")
        return self.engine.generate(prefixes, max_new_tokens)

    @property
    def resumes_turns(self) -> bool:
        return getattr(self.engine, "resumes_turns", False)

    def __getattr__(self, name):  # `rollout` (the engine's session) and anything else the turn loop reads
        return getattr(self.engine, name)


class RolloutWorker:
    """Grows admitted generation batches in a thread of its own.

    Args:
        produce: `produce(item) -> result`, one generation batch with the weights already loaded.
        load_weights: `load_weights(weights)`, called between jobs when a job's version differs from the loaded one.
        stop: the stop flag, shared with the `StoppableEngine` the worker's turn loop calls (a new one if None).
        join_seconds: how long `close` waits for the thread before reporting it still running.
        load_seconds: how long loading one version's weights may take before the trainer's `take` gives up on the
            worker (a weight publication that stalls: a hung copy, or a vLLM server that stopped answering).
    """

    def __init__(
        self,
        produce: Callable[[Any], Any],
        load_weights: Callable[[PolicyWeights], None],
        stop: threading.Event | None = None,
        join_seconds: float = 120.0,
        load_seconds: float = 600.0,
    ):
        self._produce, self._load_weights, self.join_seconds = produce, load_weights, join_seconds
        self.load_seconds = load_seconds
        self._loading_since: float | None = None  # set by the thread while it loads weights
        self._jobs: queue.Queue[RolloutJob | None] = queue.Queue()
        self._finished: queue.Queue[Finished | BaseException] = queue.Queue()
        self._stop = threading.Event() if stop is None else stop
        self._loaded_version: int | None = None
        self.in_flight = 0  # admitted and not yet taken (trainer thread only)
        self.error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, name="trl-tree-rollout-worker", daemon=True)
        self._thread.start()

    @property
    def stopped(self) -> bool:
        return self._stop.is_set()

    @property
    def alive(self) -> bool:
        return self._thread.is_alive()

    def submit(self, job: RolloutJob) -> None:
        """Admit one generation batch (after those already admitted)."""
        self._raise_if_failed()
        self.in_flight += 1
        self._jobs.put(job)

    def ready(self) -> int:
        """Finished batches waiting to be taken."""
        return self._finished.qsize()

    def take(self) -> Finished:
        """The oldest admitted batch, waiting for it; the worker's own error if it failed."""
        if self.in_flight == 0:
            raise RuntimeError("No generation batch was admitted to the rollout worker: nothing to take.")
        while True:
            try:
                got = self._finished.get(timeout=_POLL_SECONDS)
            except queue.Empty:
                self._raise_if_load_stalled()
                if not self._thread.is_alive():
                    self._raise_if_failed()
                    raise RuntimeError(
                        "The rollout worker stopped without finishing the generation batch it was given."
                    ) from None
                continue
            if isinstance(got, BaseException):
                self._raise(got)
            self.in_flight -= 1
            return got

    def close(self) -> None:
        """Stop the worker and wait for its thread (idempotent). A job in progress ends at its next engine call."""
        self._stop.set()
        self._jobs.put(None)
        self._thread.join(self.join_seconds)
        if self._thread.is_alive():
            raise RuntimeError(
                f"The rollout worker thread is still running {self.join_seconds:.0f} s after it was asked to stop: an "
                "engine call or a tool without a timeout (tool_timeout=None) does not return."
            )

    # ------------------------------------------------------------------ the thread

    def _run(self) -> None:
        try:
            while not self._stop.is_set():
                idle_from = time.perf_counter()
                job = self._jobs.get()
                if job is None or self._stop.is_set():
                    return
                started = time.perf_counter()
                if job.weights.version != self._loaded_version:
                    self._loading_since = time.perf_counter()
                    self._load_weights(job.weights)
                    self._loading_since = None
                    self._loaded_version = job.weights.version
                result = self._produce(job.item)
                self._finished.put(Finished(job, result, started - idle_from, time.perf_counter() - started))
        except RolloutWorkerStopped:
            return
        except BaseException as error:  # noqa: BLE001 - every fault goes to the trainer, which raises it
            if self._stop.is_set():  # a job unwound by close(): the trainer is already stopping
                return
            self.error = error
            self._finished.put(error)

    def _raise_if_load_stalled(self) -> None:
        since = self._loading_since
        if since is not None and time.perf_counter() - since > self.load_seconds:
            self._stop.set()  # the thread, if the load ever returns, ends before its next job
            raise TimeoutError(
                f"The rollout worker has been loading published weights for more than {self.load_seconds:.0f} s: the "
                "weight publication stalled (a copy that does not return, or a generation server that stopped "
                "answering). Training stops here; check the server or the worker's device, then resume from the last "
                "checkpoint."
            )

    def _raise_if_failed(self) -> None:
        if self.error is not None:
            self._raise(self.error)

    def _raise(self, error: BaseException):
        if not any("rollout worker" in note for note in getattr(error, "__notes__", ())):
            error.add_note(
                "(raised in trl-tree's rollout worker thread, which was growing a generation batch ahead of "
                "the trainer: max_staleness > 0)"
            )
        raise error
