"""An `HFEngine` whose `generate` runs in a child process (docs/design.md §9, "Generation in a child process").

Why: on a CPU the rollout worker's generation is much Python at a few prompts, and in a thread of the trainer's
process it shares the interpreter lock with training: SmolLM2's generation slowed 13 % beside training in a thread
and not at all in a child process (benchmarks/README.md, section 11). Only generation moves: the worker's turn loop,
tools, scoring and μ's forward stay in its thread, so nothing of a batch crosses the process boundary but prefixes
and continuations.

- **Weights, zero copy.** The policy copy's parameters and buffers are moved to shared memory (`share_memory`) and
  the child gets the module itself, mapped onto the same memory. The owner keeps writing published weights into the
  copy in place (`copy_`, between jobs), and the child's next call generates with them. The owner writes only
  between jobs and the child reads only inside a call, which the owner makes and waits for, so they never overlap.
  A tensor replaced instead of written in place would leave the child on the old one: every rollout checks that the
  parameters and buffers still live where the child maps them. The copy must fit in the free shared memory
  (/dev/shm), checked before anything moves.
- **Random state, handed over.** `generate` samples from torch's global generator, whose state is the caller's: a
  seeded run and an exact resume (`trl_tree.asynchronous.random_state`) depend on it. Each call sends the caller's
  CPU generator state; the child sets it, generates, and sends its state back, which the caller sets. So the caller's
  generator draws exactly the numbers an in-process `HFEngine` would have drawn, and its state after the call is the
  same (with the same intra-op thread count, sent too, the same kernels compute the same bits).
- **Faults.** An exception in the child comes back as a `GenerationProcessError` carrying the child's traceback; the
  child dying (killed, out of memory) makes the waiting call raise within a poll (`_POLL_SECONDS`), never hang. The
  child ignores Ctrl-C (its owner handles it and closes the child); `close` stops it on every path.

CPU only: on a GPU generation runs on the device and takes most of that Python off the interpreter already, and the
device's own generator and streams would need handing over too (not built). Like every "spawn" child, it imports the
script's main module again: a training script must guard its top level with `if __name__ == "__main__":`.
"""

from __future__ import annotations

import contextlib
import os
import pickle
import shutil
import signal
import threading
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.multiprocessing as mp
from torch import nn

from .engine import Continuation, HFEngine, HFPorts

_POLL_SECONDS = 0.1


class GenerationProcessError(RuntimeError):
    """An exception raised in the generation process, raised again in its owner; `child_traceback` is the child's
    traceback text (also in the message)."""

    def __init__(self, message: str, child_traceback: str):
        super().__init__(f"{message}\n\nThe generation process's traceback:\n{child_traceback}")
        self.child_traceback = child_traceback


@dataclass
class _ChildSettings:
    """What the child rebuilds its `HFEngine` from: values and shared-memory modules, no callables over the owner's
    objects (they cannot be pickled, and would read the owner's state from another process)."""

    eos_ids: set[int]
    pad_id: int
    device: torch.device
    model: nn.Module
    wrapped_model: nn.Module
    generating: nn.Module  # the module `generate` is called on (what `unwrapped_for_generation` yields)
    generation_config: Any
    cache: str
    max_prefix_cache_bytes: int | None
    precision: Callable[[], contextlib.AbstractContextManager[Any]]
    with_scores: bool
    num_threads: int
    setup: Callable[[], None] | None


class ProcessEngine:
    """`engine` (an `HFEngine` on a CPU policy copy) run in a child process started with torch's "spawn" context;
    the interface its callers use: `generate`, `rollout`, `resumes_turns`, `with_scores`.

    Args:
        engine: the HF engine to run in the child. Its ports are read once, now: their callables become the values
            they return (the generation config as it is now), and the module `unwrapped_for_generation` yields is the
            one the child generates with. Every module the ports name is moved to shared memory.
        precision: the context every forward of a call runs under in the child (`HFPorts.precision`), picklable: a
            `functools.partial(torch.autocast, ...)` for the owner's autocast, or `contextlib.nullcontext`. None: the
            engine's own, which must then be picklable (a trainer's is a callable over its accelerator, which no
            child can call: a ValueError says so rather than the child running without it).
        setup: a picklable function the child calls before building its engine (module-level, so the child imports
            its module): what the model's forward needs registered in that process too, e.g. an attention kernel.
        start_seconds: how long the child may take to start (import torch and transformers, map the weights).
        join_seconds: how long `close` waits for the child to exit before terminating it.
    """

    def __init__(
        self,
        engine: HFEngine,
        precision: Callable[[], contextlib.AbstractContextManager[Any]] | None = None,
        setup: Callable[[], None] | None = None,
        start_seconds: float = 600.0,
        join_seconds: float = 10.0,
    ):
        if not isinstance(engine, HFEngine):
            raise TypeError(f"ProcessEngine runs an HFEngine in a child process, got {type(engine).__name__}.")
        ports = engine.ports
        device = torch.device(ports.device())
        if device.type != "cpu":
            raise ValueError(
                f"ProcessEngine generates on the CPU only; this engine's device is {device}. On a GPU generate in "
                "the owner's process (rollout_generation=\"thread\")."
            )
        if precision is None:
            precision = ports.precision
            try:
                pickle.dumps(precision)
            except Exception as error:  # noqa: BLE001 - whatever pickling raises, the advice is the same
                raise ValueError(
                    f"The engine's precision context ({precision!r}) cannot be sent to a child process "
                    f"({type(error).__name__}: {error}): pass ProcessEngine a picklable `precision`, e.g. "
                    "functools.partial(torch.autocast, device_type=\"cpu\", dtype=torch.bfloat16), or "
                    "contextlib.nullcontext for none."
                ) from None
        with ports.unwrapped_for_generation() as generating:
            pass
        settings = _ChildSettings(
            eos_ids=set(ports.eos_ids), pad_id=ports.pad_id, device=device, model=ports.model(),
            wrapped_model=ports.wrapped_model(), generating=generating, generation_config=ports.generation_config(),
            cache=ports.cache, max_prefix_cache_bytes=ports.max_prefix_cache_bytes, precision=precision,
            with_scores=engine.with_scores, num_threads=torch.get_num_threads(), setup=setup,
        )
        modules = {id(m): m for m in (settings.model, settings.wrapped_model, generating)}.values()
        _check_shared_memory_room(modules)
        for module in modules:
            module.share_memory()
        # where each tensor lives: a tensor rebound since (not written in place) is one the child does not see
        self._addresses = [(m, {name: t.data_ptr() for name, t in _tensors(m)}) for m in modules]
        self.with_scores = engine.with_scores
        self.start_seconds, self.join_seconds = start_seconds, join_seconds
        self._resumes_turns: bool | None = None  # the child's answer, sent when it is ready
        self._send_lock = threading.Lock()  # `close` may send its sentinel from another thread
        self._closed = False
        self._exit_error: RuntimeError | None = None
        context = mp.get_context("spawn")
        self._conn, child_conn = context.Pipe()
        self._process = context.Process(target=_serve, args=(child_conn, settings), daemon=True,
                                        name="trl-tree-generation")
        try:
            with _sigint_ignored():  # inherited by the child from its first instruction (its owner handles Ctrl-C)
                self._process.start()
        except Exception as error:
            self._conn.close()
            raise RuntimeError(
                f"The rollout worker's generation process could not be started ({type(error).__name__}: {error}): "
                "what it is sent (the policy copy, the generation config, `precision`, `setup`) must be picklable, "
                "classes and functions importable by module name. Use rollout_generation=\"thread\" otherwise."
            ) from error
        except BaseException:
            self._conn.close()
            raise
        finally:
            child_conn.close()  # the child's end lives in the child alone: its exit then reads as EOF here
        self._started_at = time.perf_counter()

    @property
    def pid(self) -> int | None:
        return self._process.pid

    @property
    def alive(self) -> bool:
        return not self._closed and self._process.is_alive()

    @property
    def resumes_turns(self) -> bool:
        """The child's `HFEngine.resumes_turns` (read once it is ready: the ports it answers from are fixed)."""
        self._ready()
        return self._resumes_turns

    @torch.no_grad()
    def generate(self, prefixes: list[list[int]], max_new_tokens: list[int]) -> list[Continuation]:
        """`HFEngine.generate` in the child, drawing from and advancing this process's global torch generator."""
        _, continuations, rng_state = self._call(("generate", prefixes, max_new_tokens, _rng_bytes()))
        _set_rng(rng_state)
        return continuations

    @contextlib.contextmanager
    def rollout(self):
        """One rollout under fixed weights (`HFEngine.rollout`): the child's reused keys and values are dropped when
        it starts and ends. The weights are checked first to be those the child maps."""
        self._check_in_place()
        self._call(("clear",))
        try:
            yield self
        except BaseException:
            with contextlib.suppress(RuntimeError, OSError):  # the child may be the fault: keep the first error
                if self.alive:
                    self._call(("clear",))
            raise
        self._call(("clear",))

    def close(self) -> None:
        """Stop the child (idempotent): a sentinel, then terminate, then kill, each after a wait."""
        if self._closed:
            return
        self._closed = True
        process = self._process
        try:
            if process.is_alive():
                with self._send_lock, contextlib.suppress(OSError, ValueError):
                    self._conn.send(None)
                process.join(self.join_seconds)
            for stop in (process.terminate, process.kill):
                if process.is_alive():
                    stop()
                    process.join(5.0)
        finally:
            self._conn.close()

    # ------------------------------------------------------------------ the owner's side of the pipe

    def _ready(self) -> None:
        """Wait for the child's start (its engine built), raising what it failed with."""
        if self._resumes_turns is not None:
            return
        reply = self._receive(deadline=self._started_at + self.start_seconds)
        if reply[0] == "error":
            raise GenerationProcessError(f"The rollout worker's generation process could not start: {reply[1]}",
                                         reply[2])
        self._resumes_turns = reply[1]

    def _call(self, request: tuple) -> tuple:
        if self._closed:
            raise RuntimeError("The rollout worker's generation process was closed: no more calls.")
        self._ready()
        if self._exit_error is not None:
            raise self._exit_error
        try:
            with self._send_lock:
                self._conn.send(request)
        except OSError:  # BrokenPipeError, ConnectionResetError: the child is gone
            raise self._exited() from None
        reply = self._receive()
        if reply[0] == "error":
            raise GenerationProcessError(
                f"The rollout worker's generation process (pid {self.pid}) raised {reply[1]}", reply[2]
            )
        return reply

    def _receive(self, deadline: float | None = None) -> tuple:
        """The child's next reply, polling so that a child that died (or never answers by `deadline`) raises."""
        while True:
            try:
                if self._conn.poll(_POLL_SECONDS):
                    return self._conn.recv()
            except (EOFError, OSError):
                raise self._exited() from None
            if not self._process.is_alive():
                raise self._exited()
            if deadline is not None and time.perf_counter() > deadline:
                raise TimeoutError(
                    f"The rollout worker's generation process (pid {self.pid}) did not start within "
                    f"{self.start_seconds:.0f} s. A machine this loaded may need a longer start_seconds."
                )

    def _exited(self) -> RuntimeError:
        """The error of a child that is gone (kept: every later call raises it at once)."""
        if self._exit_error is None:
            self._process.join(1.0)
            code = self._process.exitcode
            how = f"code {code}"
            if code is not None and code < 0:
                with contextlib.suppress(ValueError):
                    how += f" ({signal.Signals(-code).name})"
            self._exit_error = RuntimeError(
                f"The rollout worker's generation process (pid {self.pid}) exited with {how} while its owner waited "
                "on it: it was killed (the kernel's out-of-memory killer sends SIGKILL), or crashed (its output, if "
                "any, is on this process's stderr). A child that exits at once with code 1 may have imported a "
                "training script without `if __name__ == \"__main__\":` (a spawned child imports the main module "
                "again). Training stops here; resume from the last checkpoint."
            )
        return self._exit_error

    def _check_in_place(self) -> None:
        for module, addresses in self._addresses:
            for name, tensor in _tensors(module):
                if addresses.get(name) == tensor.data_ptr() and tensor.is_shared():
                    continue
                raise RuntimeError(
                    f"The policy copy's tensor {name!r} does not live in the memory the generation process maps: it "
                    "was replaced or moved, not written in place, so the child would generate with other weights. "
                    "Write published weights into the copy with `copy_` (trl_tree.asynchronous.weights.load)."
                )


_SHM = "/dev/shm"  # where torch's shared CPU tensors live on Linux (POSIX shared memory)


def _check_shared_memory_room(modules) -> None:
    """Refuse a copy that does not fit in the shared-memory filesystem now, with what to do, before torch fails on
    it mid-copy (a container's /dev/shm is 64 MB unless sized: `docker run --shm-size`)."""
    if not os.path.isdir(_SHM):
        return
    storages = {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for m in modules
                for _, t in _tensors(m) if not t.is_shared()}
    needed, free = sum(storages.values()), shutil.disk_usage(_SHM).free
    if needed > free:
        raise ValueError(
            f"The policy copy needs {needed / 2**20:.0f} MiB of shared memory for the generation process, and "
            f"{_SHM} has {free / 2**20:.0f} MiB free: give it more (in a container, e.g. `docker run "
            "--shm-size=...`) or use rollout_generation=\"thread\"."
        )


def _tensors(module: nn.Module):
    yield from module.named_parameters(remove_duplicate=False)
    yield from module.named_buffers(remove_duplicate=False)


@contextlib.contextmanager
def _sigint_ignored():
    """SIGINT ignored while a child is started, so the child inherits the disposition (from the main thread only:
    Python sets handlers there alone; elsewhere the child ignores it from its first line of `_serve`)."""
    if threading.current_thread() is not threading.main_thread() or signal.getsignal(signal.SIGINT) is None:
        yield  # (None: a handler set outside Python, which could not be put back)
        return
    previous = signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, previous)


# ---------------------------------------------------------------------------------------------- the child


def _serve(conn, settings: _ChildSettings) -> None:
    """The child: build the engine, answer "ready", then serve requests until the sentinel or the owner's exit."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        torch.set_num_threads(settings.num_threads)
        if settings.setup is not None:
            settings.setup()
        engine = HFEngine(_ports(settings), with_scores=settings.with_scores)
        ready = ("ready", engine.resumes_turns)
    except Exception as error:  # noqa: BLE001 - sent to the owner, which raises it
        ready = ("error", _describe(error), traceback.format_exc())
    conn.send(ready)
    if ready[0] == "error":
        return
    while True:
        try:
            request = conn.recv()
        except (EOFError, OSError):  # the owner is gone
            return
        if request is None:
            return
        try:
            if request[0] == "generate":
                _, prefixes, budgets, rng_state = request
                _set_rng(rng_state)
                continuations = engine.generate(prefixes, budgets)
                reply = ("ok", continuations, _rng_bytes())
            elif request[0] == "clear":
                engine.prefix_store.clear()
                reply = ("ok",)
            else:
                raise ValueError(f"unknown request {request[0]!r}")
        except Exception as error:  # noqa: BLE001 - sent to the owner, which raises it
            reply = ("error", _describe(error), traceback.format_exc())
        conn.send(reply)


def _ports(settings: _ChildSettings) -> HFPorts:
    return HFPorts(
        eos_ids=settings.eos_ids,
        pad_id=settings.pad_id,
        device=lambda: settings.device,
        model=lambda: settings.model,
        wrapped_model=lambda: settings.wrapped_model,
        generation_config=lambda: settings.generation_config,
        unwrapped_for_generation=lambda: contextlib.nullcontext(settings.generating),
        cache=settings.cache,
        max_prefix_cache_bytes=settings.max_prefix_cache_bytes,
        precision=settings.precision,
    )


def _rng_bytes() -> bytes:
    """torch's CPU generator state as bytes: a tensor would cross the pipe through a shared-memory file of its own
    and start multiprocessing's descriptor-sharing thread, for a few kilobytes."""
    return torch.get_rng_state().numpy().tobytes()


def _set_rng(state: bytes) -> None:
    torch.set_rng_state(torch.frombuffer(bytearray(state), dtype=torch.uint8))


def _describe(error: BaseException) -> str:
    return f"{type(error).__module__}.{type(error).__qualname__}: {error}"
