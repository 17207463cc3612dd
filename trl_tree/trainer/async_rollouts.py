"""The tree trainer's asynchronous rollouts: the rollout worker wired to a `TreeTrainer` (docs/design.md,
"Asynchronous rollouts").

With `max_staleness` = s > 0 the trainer does not grow its generation batches itself. At the first micro-step of
generation batch b (TRL's `_prepare_inputs` boundary) it
1. admits batches b .. b + s to the worker (`trl_tree.asynchronous.pacing`): those not yet admitted, with the rows
   read ahead from the loop's own epoch iterator (`ReadAhead`, installed by `TreeTrainer.get_batch_samples`) and the
   weights it publishes now, version b (`trl_tree.asynchronous.weights`);
2. takes batch b from the worker, grown with its own policy copy (version ≤ b), waiting if it is not finished;
3. recomputes π_old on each micro-batch with its own model and rebases the batch (`pipeline.rebase_on_policy`: the
   worker's log-probs become `behaviour_logps`, μ; staleness = b − the version that sampled it);
4. logs the batch as a synchronous one, plus the `async/*` metrics.
So the worker grows batch b + 1 .. b + s while the trainer runs batch b's optimizer blocks.

What the worker runs is the ordinary pipeline (`trl_tree.core.pipeline.generation_batch`) with ports of its own: its
policy copy for generation (an `HFEngine` on it; a custom engine object, e.g. a scripted one, is used as is) and for
μ's forward, its own turn loop and sampler (seeded as the trainer's), and a scorer whose reward logs go to a buffer of
the batch, merged into the trainer's metrics when the batch is taken (the trainer's own buffers are read and cleared
by its logging in the other thread). Evaluation, which generates in the trainer's thread with the trainer's model,
takes turns with the worker (`generation_turn`): they share the environments and TRL's reward-log buffers.

Served: one process or several (DDP, DeepSpeed ZeRO-1/2), the HF engine or a custom engine, every tree sampler,
credit and loss; vLLM in server mode on one process (`trl_tree.trainer.async_vllm`: generation through the server,
each published version pushed to it by TRL's weight sync between the worker's jobs). The HF engine's generation in
the worker's thread, or (`rollout_generation="process"`: one process, CPU) in a child process
(`trl_tree.rollout.generating.engine_process`) that maps the policy copy in shared memory, which `_load` writes in
place, and draws from the worker's generator state, handed over with each call: bit for bit what the thread trains,
without sharing the interpreter lock with training. Refused, with why: sharded weights (ZeRO-3, FSDP), vLLM
colocated (nothing to overlap) or on several processes, TreeFlex's searches; generation in a process with vLLM,
several processes, a custom engine or a GPU (`unsupported_process`).

On several processes each rank's worker grows that rank's share, as the synchronous trainer's ranks do, out of step
with the other ranks: its policy copy's forward has no collective, its turn loop votes with itself, and its scoring
keeps TRL's reward gather to its own rank (`trl_internals.rank_alone_rewards`, `rank_metrics.RankAlone`). Every
reduction over ranks then happens in the trainers' threads, in step: the π_old forward, the batch's logs, and the
merge of what each worker's scoring logged (`_log`).

Resume (`checkpoint_state`, `restore`; written by `trl_tree.trainer.resume`): the batch being trained is saved as in
a synchronous run; the batches admitted ahead (in flight) are not, but the weights they were admitted with are, with
the worker's sampler state and the global random state the worker left after the last batch the trainer took. The
resumed run re-reads their rows in the loop's restored order and regenerates them with those very weights, generators
and versions, so it trains what the uninterrupted run trains, bit for bit where that one reproduces itself.
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import functools
import logging
import threading
import time
from collections import defaultdict, deque
from collections.abc import Callable
from typing import Any

import torch

from .. import trl_internals
from ..asynchronous import pacing, random_state, weights
from ..asynchronous.worker import RolloutJob, RolloutWorker, StoppableEngine
from ..core import pipeline, tree_attention
from ..core.packing import PackedTrees, unwrap_model
from ..core.tree_unit import TreeUnits
from ..rollout.generating.engine import HFEngine, rollout_session
from ..rollout.generating.engine_process import ProcessEngine
from ..rollout.generating.vllm_engine import VLLMEngine
from . import async_vllm, engine_ports, resume
from .configuration.checks import ROLLOUT_GENERATIONS, check_choice
from .observability import rank_metrics as tree_metrics
from .scoring import LeafScorer

logger = logging.getLogger(__name__)


def unsupported(trainer) -> str | None:
    """Why this trainer cannot grow its trees in a rollout worker, or None."""
    from .base import TreeTrainer

    if _sharded(trainer):
        return (
            "its weights are sharded over the ranks (DeepSpeed ZeRO-3 or FSDP): the rollout worker grows each rank's "
            "share with a full copy of the policy, with no collective in its forward, and a sharded model has no "
            "full copy to take; ZeRO-1/2 and DDP keep full weights on every rank and are served"
        )
    if trainer.use_vllm and trainer.args.vllm_mode != "server":
        return (
            f"it generates with vLLM in {trainer.args.vllm_mode!r} mode, which shares the trainer's GPU and weights, "
            "so it has nothing to overlap (vllm_mode=\"server\", generation on a server of its own, is served)"
        )
    if trainer.use_vllm and trainer.accelerator.num_processes > 1:
        return (
            f"it generates through a vLLM server on {trainer.accelerator.num_processes} processes: TRL's "
            "VLLMGeneration gathers every rank's prompts to the main process, which alone holds the client, and "
            "broadcasts the completions back, collectives that each rank's worker would run from its own thread, out "
            "of step with the other ranks; the worker's vLLM server path serves one process"
        )
    dropout = random_state.active_dropout(unwrap_model(trainer.model))
    if trainer.args.gradient_checkpointing and dropout:
        return (
            f"it trains with activation (gradient) checkpointing and active dropout ({', '.join(dropout[:3])}): the "
            "backward replays the forward's dropout by rewinding the global random generator, which the worker samples "
            "from at the same time, so its samples would repeat and depend on timing (without dropout the replay is "
            "turned off). Set the dropout to 0 or gradient_checkpointing=False"
        )
    if type(trainer).rollout_unit is not TreeTrainer.rollout_unit:
        return (
            f"{type(trainer).__name__} trains another unit than a sampled tree (TreeFlex's group of searches, driven "
            "by its harness): the rollout worker grows trees of a tree sampler only"
        )
    return None


def unsupported_process(trainer) -> str | None:
    """Why this trainer's rollout worker cannot generate in a child process (`rollout_generation="process"`), or
    None. Read again when the worker session starts: a trainer's engine may be swapped after it is built."""
    if trainer.use_vllm:
        return (
            "it generates with vLLM, whose server is a process of its own already: the child process serves the "
            "HF engine's generation"
        )
    if trainer.accelerator.num_processes > 1:
        return (
            f"it runs on {trainer.accelerator.num_processes} processes: a generation process per rank is not built "
            "(one process is served)"
        )
    engine = trainer.generation_engine
    if not isinstance(engine, HFEngine):
        return (
            f"its generation engine is a {type(engine).__name__}, not an HFEngine: a custom engine is called as it "
            "is, from the worker's thread; only the HF engine is rebuilt in a child process"
        )
    if trainer.accelerator.device.type != "cpu":
        return (
            f"it trains on {trainer.accelerator.device}: the generation process serves a CPU policy copy (on a GPU, "
            "generation on the device already takes most of its Python off the interpreter; handing the device's "
            "generator and streams to a child is not built)"
        )
    return None


def _refuse_process(reason: str) -> ValueError:
    return ValueError(
        f"rollout_generation=\"process\" (the rollout worker's generation in a child process) cannot serve this run: "
        f"{reason}. Use rollout_generation=\"thread\"."
    )


def _child_autocast(trainer):
    """The trainer's autocast (`accelerator.autocast()`, the HF ports' `precision`) as a factory a child process can
    unpickle: `torch.autocast` with the settings accelerate would use, or no autocast."""
    from accelerate.utils import get_mixed_precision_context_manager

    handler = trainer.accelerator.autocast_handler
    context = get_mixed_precision_context_manager(trainer.accelerator.native_amp, handler)
    if not isinstance(context, torch.autocast):
        return contextlib.nullcontext
    kwargs = handler.to_kwargs() if handler is not None else {}
    return functools.partial(torch.autocast, device_type=context.device, dtype=context.fast_dtype, **kwargs)


def _sharded(trainer) -> bool:
    """Whether the trained model's parameters are sharded over the ranks (DeepSpeed ZeRO-3, FSDP)."""
    from transformers.integrations.deepspeed import is_deepspeed_zero3_enabled

    return bool(is_deepspeed_zero3_enabled() or getattr(trainer, "is_fsdp_enabled", False))


def use_rollout_worker(trainer, max_staleness: int, generation: str | None = None) -> AsyncRollouts:
    """Grow `trainer`'s generation batches in a rollout worker, at most `max_staleness` versions ahead, generating in
    its thread or in a child process (`generation`, default the trainer's `rollout_generation`). The trainer does
    this itself when `args.max_staleness` > 0; tests call it with 0 to run the worker path in lockstep."""
    if not isinstance(max_staleness, int) or isinstance(max_staleness, bool) or max_staleness < 0:
        raise ValueError(f"max_staleness must be an int >= 0, got {max_staleness!r}.")
    generation = getattr(trainer.args, "rollout_generation", "thread") if generation is None else generation
    check_choice("rollout_generation", generation, ROLLOUT_GENERATIONS)
    reason = unsupported(trainer)
    if reason is not None:
        raise ValueError(
            f"max_staleness={max_staleness} (asynchronous rollouts) cannot serve this run: {reason}. "
            "Use max_staleness=0."
        )
    if generation == "process" and (reason := unsupported_process(trainer)) is not None:
        raise _refuse_process(reason)
    trainer._async_rollouts = AsyncRollouts(trainer, max_staleness, generation)
    return trainer._async_rollouts


def generation_turn(trainer):
    """A context in which the trainer's own thread may generate (evaluation) while a rollout worker exists: the two
    take turns, one generation batch at a time."""
    rollouts = getattr(trainer, "_async_rollouts", None)
    return rollouts.lock if rollouts is not None else contextlib.nullcontext()


@dataclasses.dataclass
class _Produced:
    """What the worker returns for one batch: the pipeline's result, the metrics and completion-table columns its
    scoring and packing logged, and the worker's sampler state and the global random state it left (where the next
    batch starts: what a checkpoint taken after this batch needs to regenerate the next ones, `checkpoint_state`)."""

    result: pipeline.GenerationBatch
    metrics: dict[str, list]
    extra: dict[str, list]
    next_sampler: dict[str, Any]
    next_random: dict[str, Any]
    weight_push_seconds: float = 0.0  # pushing its version to the vLLM server (server mode; 0 when it held it)


class AsyncRollouts:
    """One trainer's asynchronous rollouts; a worker session lasts one `train()` call (`close` ends it)."""

    def __init__(self, trainer, max_staleness: int, generation: str = "thread"):
        self.trainer, self.max_staleness, self.generation = trainer, max_staleness, generation
        self.generate_every = trainer.args.steps_per_generation * trainer.num_iterations
        self.lock = threading.Lock()
        self.reader: pacing.ReadAhead | None = None
        self.worker: RolloutWorker | None = None
        self._admitted: deque[RolloutJob] = deque()  # admitted and not yet taken, in order
        self._buffers: tuple[dict, dict] | None = None  # the batch being grown's metrics and extra columns
        # where the next batch to grow starts (the worker's sampler state, the global random state) and the weights
        # of batches a resumed checkpoint had in flight, admitted again before any newly published ones
        self._next_sampler: dict | None = None
        self._next_random: dict | None = None
        self._restored_weights: deque[weights.PolicyWeights] = deque()
        self._restore_checkpointing: Callable[[], None] = lambda: None  # set by a worker session (`_start`)
        self.generation_process: ProcessEngine | None = None  # generation="process": the session's child
        # the vLLM server's weights (server mode: `async_vllm`), the version in the policy copy, and the seconds spent
        # pushing since the last batch was produced (worker thread only)
        self.served: async_vllm.ServedPolicy | None = None
        self._copy_version: int | None = None
        self._push_seconds = 0.0

    # ------------------------------------------------------------------ the trainer's side

    def read_ahead(self, epoch_iterator):
        """The loop's epoch iterator as a `ReadAhead` (a new one per epoch)."""
        if self.reader is None or self.reader.source is not epoch_iterator:
            if self._admitted:
                raise RuntimeError(
                    f"A new epoch began with {len(self._admitted)} generation batches of the last one admitted to the "
                    "rollout worker and never trained."
                )
            self.reader = pacing.ReadAhead(epoch_iterator)
        return self.reader

    def micro_batches(self, item: list[dict[str, Any]]) -> list[dict[str, torch.Tensor]]:
        """Generation batch `item` (the rows the loop handed over) as the micro-batches TRL buffers, grown by the
        worker; batches up to `max_staleness` ahead admitted first."""
        trainer = self.trainer
        current = trl_internals.micro_step(trainer) // self.generate_every
        if self.worker is None:
            self._start()
        published = self._admit(item, current)
        waited_from = time.perf_counter()
        ready = self.worker.ready()
        finished = self.worker.take()
        trainer_wait = time.perf_counter() - waited_from
        if finished.job is not self._admitted[0] or finished.job.item is not item:
            raise RuntimeError("The rollout worker returned another generation batch than the one the loop is at.")
        self._admitted.popleft()
        staleness = current - finished.job.weights.version
        produced: _Produced = finished.result
        self._next_sampler, self._next_random = produced.next_sampler, produced.next_random
        batches = [self._rebase(batch, staleness) for batch in produced.result.batches]
        self._log(item, produced, staleness, finished, trainer_wait, ready, published)
        return batches

    def close(self) -> None:
        """End the worker session: stop and join the worker, close its turn loop's tool pool and its generation
        process, forget what was admitted and restored (idempotent; a later `train()` without resume starts the
        worker's sampler afresh)."""
        worker, self.worker = self.worker, None
        process, self.generation_process = self.generation_process, None
        self.reader, self._admitted = None, deque()
        self._next_sampler, self._next_random, self._restored_weights = None, None, deque()
        restore_checkpointing, self._restore_checkpointing = self._restore_checkpointing, lambda: None
        try:
            if worker is not None:
                try:
                    worker.close()  # the thread first: it may be waiting on the generation process
                finally:
                    self.turn_loop.close()
        finally:
            try:
                if process is not None:  # also when the session failed to start after starting it
                    process.close()
            finally:
                restore_checkpointing()
                self.served, self._copy_version = None, None  # a next session pushes its first version again

    def checkpoint_state(self) -> dict[str, Any] | None:
        """What a checkpoint needs to regenerate the batches in flight as the uninterrupted run grows them: the
        worker's sampler state and the global random state after the last batch taken (the latter only with batches
        in flight: else the worker is idle and transformers' own `rng_state.pth` is that state), and the published
        weights (by version, each once) of every batch admitted and not yet taken, in admission order. None before
        the session's first batch (a checkpoint always follows one)."""
        if self._next_sampler is None:
            return None
        in_flight = [job.weights for job in self._admitted] + list(self._restored_weights)
        return {
            "max_staleness": self.max_staleness,
            "sampler": self._next_sampler,
            "random": self._next_random if in_flight else None,
            "in_flight": [w.version for w in in_flight],
            "weights": {w.version: {n: t.to("cpu") for n, t in w.tensors.items()} for w in in_flight},
        }

    def restore(self, saved: dict[str, Any] | None, checkpoint_sampler: dict[str, Any]) -> None:
        """Resume from a checkpoint's `checkpoint_state` (`saved`), or, None, from a synchronous run's checkpoint,
        whose sampler state (`checkpoint_sampler`) is its training stream and whose random state transformers restores.
        Called in the trainer's thread before the first resumed step, before the worker starts: the global generators
        are set now; the worker's sampler is loaded when it is built; the in-flight weights are admitted first."""
        if saved is None:
            self._next_sampler, self._next_random = checkpoint_sampler, None
            return
        self._next_sampler, self._next_random = saved["sampler"], saved["random"]
        if saved["random"] is not None:
            random_state.restore(saved["random"])
        device = self.trainer.accelerator.device
        in_flight = [
            weights.PolicyWeights(v, {n: t.to(device) for n, t in saved["weights"][v].items()}, 0.0)
            for v in saved["in_flight"]
        ]
        if in_flight and saved["max_staleness"] != self.max_staleness:
            logger.warning(
                "The checkpoint was saved with max_staleness=%d and is resumed with max_staleness=%d: its %d "
                "generation batch(es) in flight are grown with the current weights instead of the ones they were "
                "admitted with (same prompts, same order; fresher samples than the uninterrupted run's).",
                saved["max_staleness"],
                self.max_staleness,
                len(in_flight),
            )
            in_flight = []
        self._restored_weights = deque(in_flight)

    def _admit(self, item, current: int) -> weights.PolicyWeights | None:
        """Admit batches current .. current + max_staleness not yet admitted: those a resumed checkpoint had in flight
        with the weights they were admitted with, the others with the weights published now (returned, or None)."""
        position = self.reader.position_of(item) if self.reader is not None else None
        published = None
        for offset, _ in enumerate(pacing.admitted(current, self.max_staleness)):
            if offset == 0:
                upcoming = item
            elif position is None:
                break
            elif (current + offset) * self.generate_every >= self.trainer.state.max_steps:
                break  # the run ends before that batch would train: growing it would only spend the cores
            else:
                upcoming = self.reader.peek(position + offset * self.generate_every)
                if upcoming is None:  # the epoch ends: the next one starts the pipeline again
                    break
            if any(upcoming is job.item for job in self._admitted):
                continue
            if self._restored_weights:
                sampled_by = self._restored_weights.popleft()
            else:
                if published is None:
                    published = weights.publish(self.trainer.model, current)
                sampled_by = published
            job = RolloutJob(upcoming, sampled_by)
            self.worker.submit(job)
            self._admitted.append(job)
        if self._restored_weights:
            raise RuntimeError(
                f"The checkpoint resumed had {len(self._restored_weights)} more generation batch(es) in flight than "
                "the training loop has ahead in this epoch: the dataset changed since it was saved. Resume with the "
                "dataset the checkpoint was saved with."
            )
        return published

    def _rebase(self, batch: dict, staleness: int) -> dict:
        """π_old recomputed by the trainer's model on the batch's own packed rows; the worker's log-probs kept as μ."""
        trainer = self.trainer
        device = trainer.accelerator.device
        old_logps = pipeline.behaviour_logps(trainer.model, PackedTrees.from_dict(batch), device, trainer.temperature)
        units = batch["input_ids"].shape[0]
        return pipeline.rebase_on_policy(
            batch, old_logps, torch.full((units,), staleness, dtype=torch.int64, device=device)
        )

    def _log(
        self, item, produced: _Produced, staleness: int, finished, trainer_wait: float, ready: int, published
    ) -> None:
        """The batch's generation metrics (as a synchronous batch's), what its growing logged, and `async/*`."""
        trainer = self.trainer
        metrics = trl_internals.metrics(trainer, "train")
        # what each rank's worker scoring logged for its rank alone, reduced over the ranks now, in step
        tree_metrics.flush_logs_over_ranks(trainer.accelerator, produced.metrics, produced.extra,
                                           len(produced.result.scores.weighted), metrics,
                                           trl_internals.completion_logs(trainer)["extra"])
        if trainer._tree_view is not None:  # its pages show the version that sampled the batch and its staleness
            trainer._tree_view.note_rows(item, policy=(finished.job.weights.version, staleness))
        trainer._log_generation("train", produced.result)
        metrics["async/staleness_mean"].append(float(staleness))  # one version per batch: every tree's staleness
        metrics["async/staleness_max"].append(float(staleness))
        metrics["async/policy_version"].append(float(finished.job.weights.version))
        metrics["async/trainer_wait"].append(trainer_wait)
        metrics["async/producer_wait"].append(finished.producer_wait)
        metrics["async/generation_time"].append(finished.seconds)
        metrics["async/queue_depth"].append(float(ready))
        metrics["async/weight_publication_time"].append(published.seconds if published is not None else 0.0)
        if self.served is not None:
            metrics["async/weight_push_time"].append(produced.weight_push_seconds)

    # ------------------------------------------------------------------ the worker's side

    def _start(self) -> None:
        """A worker session: the policy copy, the worker's engine, turn loop, sampler and scorer, and the thread."""
        trainer = self.trainer
        if self.generation == "process" and (reason := unsupported_process(trainer)) is not None:
            raise _refuse_process(reason)  # the engine swapped since the trainer was built (a custom one)
        # the trainer's backward must not rewind the generator the worker samples from (`random_state`)
        self._restore_checkpointing = random_state.checkpointing_leaves_rng_alone(trainer.model)
        self.policy = weights.policy_copy(trainer.model)
        engine = trainer.generation_engine
        if isinstance(engine, HFEngine):  # generation on the copy; another engine object (scripted) is used as is
            ports = dataclasses.replace(
                engine_ports.hf_ports(trainer),
                model=lambda: unwrap_model(self.policy),
                wrapped_model=lambda: self.policy,
                unwrapped_for_generation=lambda: contextlib.nullcontext(self.policy),
            )
            engine = HFEngine(ports, with_scores=trainer.needs_entropies)
            if self.generation == "process":  # the copy in shared memory, generated with in a child (`_load` in place)
                # the copy's attention may be the tree kernel (`packing.attend_tree_rows_by_chains`): registered there
                self.generation_process = ProcessEngine(
                    engine, precision=_child_autocast(trainer), setup=tree_attention.register
                )
                engine = self.generation_process
        elif isinstance(engine, VLLMEngine):  # server mode (`unsupported`): the versions reach the server by push
            self.served = async_vllm.ServedPolicy(trainer, self.policy)
            engine = VLLMEngine(self.served.ports(), with_scores=trainer.needs_entropies)
        stop = threading.Event()  # set by `close`: the engine refuses new calls, so a job ends at its next round
        self.engine = StoppableEngine(engine, stop)
        # its tool pool is the worker's, closed with it; out of step with the other ranks, it votes alone
        self.turn_loop = trainer._build_turn_loop(self.engine, rank_alone=True)
        self.sampler = trainer.build_sampler(self.turn_loop)
        if self._next_sampler is not None:  # resumed: where the uninterrupted run's worker sampler was
            resume.load_sampler_state(self.sampler, self._next_sampler)
        self.scorer = LeafScorer(
            accelerator=tree_metrics.RankAlone(trainer.accelerator.device),
            reward_weights=trainer.reward_weights,
            calculate_rewards=self._rank_alone_rewards,
            aggregation=trainer.multi_objective_aggregation,
            pending_logs=lambda: trl_internals.pending_reward_logs(trainer),
            completion_logs=lambda: {"extra": self._buffers[1]},
            metrics=lambda mode: self._buffers[0],
        )
        self.worker = RolloutWorker(self._produce, self._load, stop)

    def _load(self, published: weights.PolicyWeights) -> None:
        """The worker's `load` hook, between jobs: the job's published version into the policy copy and, in vLLM
        server mode, from the copy to the server (never the trainer's live model, which moves on meanwhile)."""
        weights.load(self.policy, published)
        self._copy_version = published.version
        if self.served is not None:
            with self.lock:  # evaluation's engine pushes the trainer's weights under the same lock
                self._push_seconds += self.served.push(published.version)

    def _produce(self, item) -> _Produced:
        """One generation batch on the worker's thread: the ordinary pipeline with the worker's ports."""
        trainer = self.trainer
        with self.lock:
            if self.served is not None:  # again if evaluation pushed the trainer's weights since `_load`
                self._push_seconds += self.served.push(self._copy_version)
            self._buffers = (defaultdict(list), defaultdict(list))
            unit = TreeUnits(
                self.sampler,
                functools.partial(rollout_session, self.engine),
                trl_internals.tokenizer(trainer).pad_token_id,
                trainer.args.packing,
                unwrap_model(self.policy).config,
                trainer.mask_truncated_completions,
            )
            ports = pipeline.PipelinePorts(
                prepare=trainer._rollout_roots,
                score=self._score,
                behaviour_logps=self._behaviour_logps,
                credit=trainer.turn_credit,
                device=trainer.accelerator.device,
            )
            result = pipeline.generation_batch(unit, ports, item, trainer.args.steps_per_generation)
            # deep-copied: a sampler's state_dict() may hand out its live objects
            next_sampler = copy.deepcopy(resume.sampler_state(self.sampler))
            pushed, self._push_seconds = self._push_seconds, 0.0
            return _Produced(result, *self._buffers, next_sampler, random_state.capture(), pushed)

    def _rank_alone_rewards(self, *rows):
        """TRL's reward computation on this rank's leaves, ungathered (the other ranks' workers are elsewhere)."""
        with trl_internals.rank_alone_rewards():
            return trl_internals.calculate_rewards(self.trainer, *rows)

    def _behaviour_logps(self, packed: PackedTrees) -> torch.Tensor:
        """μ's log-probs: the policy copy's packed forward, under the trainer's autocast (the copy's forward is its
        class's own, without accelerate's mixed-precision patch: `weights.policy_copy`)."""
        trainer = self.trainer
        with trainer.accelerator.autocast():
            return pipeline.behaviour_logps(self.policy, packed, trainer.accelerator.device, trainer.temperature)

    def _score(self, inputs, prompts, branches_per_tree) -> pipeline.LeafScores:
        """The trainer's `score` port with the worker's scorer (its logs go to the batch's buffers)."""
        rows = self.scorer.leaf_rows(inputs, prompts, branches_per_tree)
        return self.scorer.score(rows, branches_per_tree, "train")
