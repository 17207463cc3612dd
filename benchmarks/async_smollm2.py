"""`bench_async.py --setting smollm2`: asynchronous rollouts with real generation on this machine's CPU cores
(issue 57, item 7, second setting), and `--contention`: what a rollout worker in its own process, instead of a
thread, would buy (item 4).

The run is the learning benchmark's SmolLM2 TreeOPSD run (`bench_learning.py --model smollm2`, section 3b of
benchmarks/README.md), built by its own builders: its arguments (`bench_learning.parse_args`), its search task and
BM25 retriever (`common.make_task`: the world of 200 training and 128 held-out questions), its cached warm start
(`common.warm_started_model`: 10 LoRA steps merged, `trl_tree.testing.smollm2_path()` as base), LoRA rank 16 for RL,
(M, N) = (4, 2) trees, its turn and token limits (3 turns, 448 tokens a trajectory, 64 a turn), at TreeOPSD's best
rate (8e-4), with E = 4 optimizer blocks per generation batch. What it changes, for cost only: 4 prompts per
generation batch (`--prompts`: one tree per block, the fewest E = 4 allows; the learning runs take 8) and 2 generation
batches per variant (`--batches`), the first left out (`--warmup`), so each variant's figure is one steady batch, the
same 4 prompts in every variant. Why so few: the stored learning runs' batches of 8 trees spent 205-305 CPU seconds
generating and 154-264 training at one thread, so a batch of 4 trees is about 2 × 120 s at one thread, and sync_t1,
sync_t2 and async_s1 together take about 22 minutes on two quiet cores (about 30 with `--staleness 1,2`). Each run
samples its own trees (other weights, other rounding), so its batch has its own size: `/ limit per token` divides
that out, roughly.

Variants, each one run of its own in this process, in this order:
- `sync_t1`, `sync_t2`: the synchronous trainer at 1 and at 2 intra-op torch threads; the faster is "sync";
- `async_s1` (and `async_s2`, ... with `--staleness 1,2`): the rollout worker at that `max_staleness`, at 1 torch
  thread: the worker's thread and the trainer's thread each compute on one core, the cores split between producer and
  trainer;
- `async_s1_process` (with `--rollout_generation thread,process` or `process`): the same, the worker's generation in
  a child process (`TreeConfig.rollout_generation="process"`: the copy's weights in shared memory, one torch thread
  in the child), so generation no longer shares the trainer's interpreter lock. Its child starts (5-15 s) inside the
  first batch, which `--warmup` leaves out.
Columns (per generation batch, the mean over the batches after the warm-up): wall seconds (between the starts of
consecutive batches), the speedup over the faster sync, the ratio to the limit, the process's CPU seconds over wall
seconds (cores kept busy), generated tokens, π_old's forward in the trainer's thread; for sync its generation and
training phases (`common.BatchMeter`: the generation phase is `_generate_micro_batches`: growing, scoring, packing,
π_old; training is the rest of the batch); for async the trainer's wait for the worker's batch, the worker's idle wait
for admission, the weight publication and the worker's seconds growing a batch (`async/*`, docs/design.md §9).

The limit is max(generation, training) per batch at the threads each side gets (one), from `sync_t1`'s own phases.
Asynchronously π_old's forward moves from the generation side to the trainer's (the worker computes μ with its copy,
the trainer recomputes π_old with the current weights), so the trainer's own floor is training + that forward: the
`pi_old` column says how much that is.

`--contention` measures instead, on the same model and settings, at 1 torch thread: one generation batch alone
(grow, score, pack, π_old: the sync generation phase; the same rows, the sampler and torch's generator reset before
each, so each is the same work), E optimizer blocks alone (training each block on one of its micro-batches), and
both at once, generation on a model copy of its own, (a) as two Python threads of this process (what the rollout
worker does) and (b) generation in a `multiprocessing` child (spawn) with its own trainer and copy, whose generation
batch alone is measured too. Each side runs while the other has not finished its share (the generation side is
stopped at its next engine call, the training side after its block), so each side's measured share ran wholly
beside the other's work. The ratios concurrent / alone say what two threads cost (the interpreter lock and the shared
memory bandwidth and caches) against two processes (the latter only); `overlap` is (generation + training alone) /
max of the two concurrent, the speedup a perfect pipeline at that contention gives. Its cost, by the same estimate:
about 15 minutes (a warm-up tree and block, the batch and its blocks alone, each side twice at once, the child's
start, warm-up and batch alone).

`--quick`: the tiny model (no warm start) in place of SmolLM2, 4 short batches' worth of rows: seconds, to test the
pipeline; its figures mean nothing.
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import gc
import multiprocessing
import queue
import random
import statistics
import sys
import tempfile
import threading
import time
import traceback
from pathlib import Path

import torch
from transformers import TrainerCallback
from transformers.trainer_callback import PrinterCallback

BENCHMARKS = Path(__file__).resolve().parent
ROOT = BENCHMARKS.parent
for _path in (ROOT, BENCHMARKS):
    if str(_path) not in sys.path:
        sys.path.insert(0, str(_path))

import bench_learning  # noqa: E402
from common import (  # noqa: E402
    BatchMeter,
    PeakMemory,
    budget_from_args,
    build_trainer,
    environment,
    load_model,
    lora_config,
    make_task,
    markdown_table,
    warm_started_model,
    write_json,
)

from trl_tree.asynchronous.worker import RolloutWorkerStopped, StoppableEngine  # noqa: E402
from trl_tree.core import pipeline  # noqa: E402
from trl_tree.trainer import resume  # noqa: E402

E = 4  # optimizer blocks per generation batch
LEARNING_RATE = 8e-4  # TreeOPSD's best on the SmolLM2 learning benchmark (benchmarks/README.md, 3b)
METHOD = "treeopsd"
SEED = 0
DEFAULT_OUTPUT = BENCHMARKS / "results" / "async_smollm2.json"
DEFAULT_CONTENTION_OUTPUT = BENCHMARKS / "results" / "async_smollm2_contention.json"
CHILD_SECONDS = 1800  # how long the parent waits for its generation child's next report before giving up


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="bench_async.py --setting smollm2", description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--batches", type=int, default=2, help="generation batches per variant")
    p.add_argument("--warmup", type=int, default=1, help="the first batches left out (the pipeline filling up)")
    p.add_argument("--prompts", type=int, default=4, help=f"prompts (trees) per generation batch, a multiple of E={E}")
    p.add_argument("--staleness", default="1", help="the asynchronous variants' max_staleness, comma-separated")
    p.add_argument("--rollout_generation", default="thread",
                   help="where the asynchronous variants' worker generates, comma-separated: thread (async_sS) and/or "
                        "process (async_sS_process: TreeConfig.rollout_generation, generation in a child process)")
    p.add_argument("--sync_threads", default=None,
                   help="torch threads of the synchronous variants, comma-separated; 1 is needed (the limit) "
                        "(default 1,2; --quick: 1)")
    p.add_argument("--max_turns", type=int, default=None, help="assistant turns per trajectory (default: 3)")
    p.add_argument("--max_completion_length", type=int, default=None, help="tokens per trajectory (default: 448)")
    p.add_argument("--contention", action="store_true",
                   help="measure generation and training alone, as two threads and as two processes, instead")
    p.add_argument("--quick", action="store_true", help="the tiny model, short trees: tests the pipeline in seconds")
    p.add_argument("--output", default=None,
                   help=f"JSON (default {DEFAULT_OUTPUT.name}, with --contention {DEFAULT_CONTENTION_OUTPUT.name}, "
                        "in benchmarks/results/)")
    args = p.parse_args(argv)
    if args.prompts <= 0 or args.prompts % E:
        p.error(f"--prompts {args.prompts}: give a positive multiple of E={E} (whole trees per optimizer block).")
    if not 0 <= args.warmup < args.batches:
        p.error(f"--warmup {args.warmup} must leave at least one of the --batches {args.batches} measured.")
    args.staleness = _integers(p, "--staleness", args.staleness, minimum=1)
    args.rollout_generation = [g.strip() for g in args.rollout_generation.split(",") if g.strip()]
    if not args.rollout_generation or set(args.rollout_generation) - {"thread", "process"}:
        p.error(f"--rollout_generation takes thread, process or both (comma-separated); got {args.rollout_generation}")
    if args.sync_threads is None:  # two OpenMP threads on cores that other jobs share can be many times slower
        args.sync_threads = "1" if args.quick else "1,2"
    text, args.sync_threads = args.sync_threads, _integers(p, "--sync_threads", args.sync_threads, minimum=1)
    if 1 not in args.sync_threads:
        p.error(f"--sync_threads {text}: include 1, whose phases give the limit (1,2 or 1).")
    if args.output is None:
        args.output = str(DEFAULT_CONTENTION_OUTPUT if args.contention else DEFAULT_OUTPUT)
    return args


def _integers(parser, flag: str, text: str, minimum: int) -> list[int]:
    try:
        values = [int(v) for v in text.split(",") if v.strip()]
    except ValueError:
        values = []
    if not values or min(values) < minimum or len(set(values)) != len(values):
        parser.error(f"{flag} takes distinct comma-separated integers >= {minimum}, such as 1,2; got {text!r}.")
    return values


def run_settings(args) -> argparse.Namespace:
    """The learning benchmark's settings for this run (`bench_learning.parse_args`): SmolLM2's (or `--quick`'s), with
    this benchmark's prompts, E, rate and batches."""
    argv = ["--methods", METHOD, "--seeds", str(SEED), "--blocks", str(E), "--prompts", str(args.prompts),
            "--generation_batches", str(args.batches), "--learning_rate", str(LEARNING_RATE)]
    argv += ["--quick"] if args.quick else ["--model", "smollm2"]
    for name in ("max_turns", "max_completion_length"):
        if getattr(args, name) is not None:
            argv += [f"--{name}", str(getattr(args, name))]
    settings = bench_learning.parse_args(argv)
    if args.quick:  # --quick sets its own batch shape: this benchmark's, with rows for every batch and one ahead
        settings.prompts, settings.blocks, settings.generation_batches = args.prompts, E, args.batches
        settings.num_train = max(settings.num_train, args.prompts * (args.batches + max(args.staleness) + 1))
    return settings


def task_and_model(settings) -> tuple:
    """The search task and the warm-started model's folder, as `bench_learning.main` makes them (cached)."""
    task = make_task(settings.task, settings.num_train, settings.num_test, topk=settings.topk)
    base = settings.model_name_or_path
    if base is None and settings.model == "smollm2":
        from trl_tree.testing import smollm2_path

        base = smollm2_path()
    path = warm_started_model(task, base, settings.warm_start_steps, lr=settings.warm_start_lr,
                              batch_size=settings.warm_start_batch_size, lora_rank=settings.lora_rank)
    return task, path


def build(settings, task, model_path: str, output_dir: str, max_staleness: int = 0, rollout_generation: str = "thread"):
    """The learning benchmark's trainer (`bench_learning.run`'s construction), at `max_staleness`, its worker
    generating in its thread or in a child process (`rollout_generation`)."""
    random.seed(SEED)
    torch.manual_seed(SEED)
    budget = budget_from_args(settings, generation_batches=settings.generation_batches, seed=SEED)
    model, tokenizer = load_model(model_path)
    peft = lora_config(settings.lora_rank) if settings.lora_rank else None
    staleness = {"max_staleness": max_staleness} if max_staleness else {}
    if rollout_generation != "thread":
        staleness["rollout_generation"] = rollout_generation
    trainer = build_trainer(METHOD, model, tokenizer, task, budget, output_dir, peft_config=peft,
                            gradient_checkpointing=settings.gradient_checkpointing, **staleness)
    trainer.remove_callback(PrinterCallback)
    return trainer


# ---------------------------------------------------------------------------------------------------------------------
# The variants
# ---------------------------------------------------------------------------------------------------------------------


class BatchStarts(TrainerCallback):
    """The wall time at which each generation batch starts (its first optimizer block) and the run ends."""

    def __init__(self, steps_per_batch: int):
        self.steps_per_batch, self.starts, self.end = steps_per_batch, [], None

    def on_step_begin(self, args, state, control, **kwargs):
        if state.global_step % self.steps_per_batch == 0:
            self.starts.append(time.perf_counter())

    def on_train_end(self, args, state, control, **kwargs):
        self.end = time.perf_counter()


@contextlib.contextmanager
def timed_pi_old(clock: BatchStarts):
    """Per generation batch, the seconds the trainer's own thread spends in the packed no-grad forward
    (`pipeline.behaviour_logps`: π_old, synchronously and asynchronously; the worker's μ forward, in its thread, is
    not counted)."""
    seconds: dict[int, float] = {}
    original = pipeline.behaviour_logps

    def timed(*args, **kwargs):
        start = time.perf_counter()
        try:
            return original(*args, **kwargs)
        finally:
            if threading.current_thread() is threading.main_thread():
                batch = len(clock.starts) - 1
                seconds[batch] = seconds.get(batch, 0.0) + time.perf_counter() - start

    pipeline.behaviour_logps = timed
    try:
        yield seconds
    finally:
        pipeline.behaviour_logps = original


def run_variant(name: str, threads: int, max_staleness: int, settings, task, model_path: str, warmup: int,
                out: Path, rollout_generation: str = "thread") -> dict:
    """One run; its steady-state seconds per batch, phases (sync) or waits (async)."""
    torch.set_num_threads(threads)
    trainer = build(settings, task, model_path, str(out / name), max_staleness, rollout_generation)
    meter = BatchMeter(trainer, memory=PeakMemory(interval=1.0))  # its RSS sampler wakes once a second, no more
    clock = BatchStarts(E)
    trainer.add_callback(clock)
    print(f"[{name}] {threads} torch thread(s), max_staleness {max_staleness}", flush=True)
    with timed_pi_old(clock) as pi_old:
        wall, cpu = time.perf_counter(), time.process_time()
        trainer.train()
        wall, cpu = time.perf_counter() - wall, time.process_time() - cpu
    meter.memory.close()
    bounds = [*clock.starts, clock.end]
    intervals = [b - a for a, b in zip(bounds, bounds[1:])]
    steady = meter.batches[warmup:]

    def mean(values):
        return statistics.fmean(values[warmup:])

    row = {
        "variant": name,
        "torch_threads": threads,
        "max_staleness": max_staleness,
        "rollout_generation": rollout_generation if max_staleness else None,
        "seconds_per_batch": mean(intervals),
        "intervals": intervals,
        "cores_busy": cpu / wall,  # the process's CPU seconds per wall second over the whole run
        "generated_tokens": statistics.fmean(b.generated_tokens for b in steady),
        "pi_old_seconds": mean([pi_old.get(i, 0.0) for i in range(len(intervals))]),
        "run_seconds": wall,
    }
    if max_staleness == 0:
        row["generation_seconds"] = statistics.fmean(b.generation_seconds for b in steady)
        row["training_seconds"] = statistics.fmean(b.training_seconds for b in steady)
    else:
        logged = trainer.state.log_history

        def series(metric):
            return [entry[f"async/{metric}"] for entry in logged if f"async/{metric}" in entry]

        row["trainer_wait"] = mean(series("trainer_wait"))
        row["producer_wait"] = mean(series("producer_wait"))
        row["weight_publication_seconds"] = mean(series("weight_publication_time"))
        row["worker_generation_seconds"] = mean(series("generation_time"))
        row["trainer_busy_seconds"] = row["seconds_per_batch"] - row["trainer_wait"]
        row["staleness_max"] = max(series("staleness_max"))
    print(f"[{name}] {row['seconds_per_batch']:.1f} s per batch (intervals "
          f"{', '.join(f'{i:.1f}' for i in intervals)})", flush=True)
    del trainer, meter
    gc.collect()
    return row


def steady_bound(row: dict, sync_seconds: float, limit: float) -> None:
    """An asynchronous row's steady-state bound: a pipeline cannot deliver batches faster than its worker grows one
    (beside the trainer), nor than the trainer trains one, so a batch interval measured after a head start (the first
    batch's training gave the worker time to grow the next) is read beside max(interval, the worker's batch)."""
    if row["max_staleness"] == 0:
        return
    row["bound_seconds"] = max(row["seconds_per_batch"], row["worker_generation_seconds"])
    row["bound_speedup"] = sync_seconds / row["bound_seconds"]
    row["bound_over_limit"] = row["bound_seconds"] / limit


def measure_variants(args, settings, task, model_path: str, out: Path) -> dict:
    rows = [run_variant(f"sync_t{n}", n, 0, settings, task, model_path, args.warmup, out) for n in args.sync_threads]
    rows += [run_variant(f"async_s{s}" + ("" if where == "thread" else f"_{where}"), 1, s, settings, task,
                         model_path, args.warmup, out, where)
             for s in args.staleness for where in args.rollout_generation]
    sync = {row["torch_threads"]: row for row in rows if row["max_staleness"] == 0}
    best = min(sync.values(), key=lambda row: row["seconds_per_batch"])
    one = sync[1]
    limit = max(one["generation_seconds"], one["training_seconds"])
    for row in rows:
        row["speedup"] = best["seconds_per_batch"] / row["seconds_per_batch"]
        row["over_limit"] = row["seconds_per_batch"] / limit
        # the same per generated token: each run samples trees of its own sizes (other weights, other threads), so
        # one batch's seconds carry its trees' size; per token is a rough correction (generation and training both
        # grow with the tokens)
        row["over_limit_per_token"] = row["over_limit"] * one["generated_tokens"] / row["generated_tokens"]
        steady_bound(row, best["seconds_per_batch"], limit)
    headers = {"variant": "variant", "torch_threads": "torch threads", "seconds_per_batch": "s / batch",
               "speedup": "speedup", "over_limit": "/ limit", "over_limit_per_token": "/ limit per token",
               "cores_busy": "cores busy",
               "generation_seconds": "generation", "training_seconds": "training", "pi_old_seconds": "π_old",
               "trainer_wait": "trainer wait", "producer_wait": "producer wait",
               "weight_publication_seconds": "publication", "worker_generation_seconds": "worker's batch",
               "generated_tokens": "tokens", "bound_seconds": "bound s / batch", "bound_speedup": "bound speedup",
               "bound_over_limit": "bound / limit"}
    print(markdown_table([{k: (round(v, 2) if isinstance(v, float) else v) for k, v in r.items()} for r in rows],
                         list(headers), headers))
    print(f"sync = {best['variant']}; limit max(generation {one['generation_seconds']:.1f}, training "
          f"{one['training_seconds']:.1f}) = {limit:.1f} s per batch (sync_t1's phases); target: / limit <= 1.1")
    return {"rows": rows, "sync": best["variant"], "limit_seconds": limit,
            "limit_from": {"variant": one["variant"], "generation_seconds": one["generation_seconds"],
                           "training_seconds": one["training_seconds"]}}


# ---------------------------------------------------------------------------------------------------------------------
# Contention: generation and training alone, as two threads, as two processes
# ---------------------------------------------------------------------------------------------------------------------


class Generation:
    """One generation batch on a trainer that never trains, the same work every time: the same rows, the sampler's
    generators and torch's global generator (the HF engine samples from it) reset before each. Its engine can be put
    behind a stop flag (`stoppable`), which ends a batch at its next engine call."""

    def __init__(self, trainer, rows: list[dict]):
        self.trainer, self.rows = trainer, rows
        self.engine = trainer.generation_engine
        self.sampler_state = copy.deepcopy(resume.sampler_state(trainer.sampler))
        trainer.model.train()  # the trainer's generation mode ("train"), as in a training run

    def stoppable(self, stop) -> None:
        self.trainer.generation_engine = StoppableEngine(self.engine, stop)

    def batch(self, rows: list[dict] | None = None) -> tuple[dict, list[dict]]:
        """(seconds and trained tokens of one generation batch, its E micro-batches); `rows`: other rows (a
        warm-up)."""
        trainer = self.trainer
        resume.load_sampler_state(trainer.sampler, copy.deepcopy(self.sampler_state))
        torch.manual_seed(SEED)
        start = time.perf_counter()
        trees = trainer.sample_trees(self.rows if rows is None else rows)
        batches = trainer.micro_batches(trees, min(E, len(trees)))  # packing, π_old's forward, credit: the rest of the sync phase
        seconds = time.perf_counter() - start
        tokens = sum(int((b["turn_ids"] >= 0).sum()) for b in batches)
        return {"seconds": seconds, "trained_tokens": tokens}, batches


class Training:
    """Optimizer blocks on fixed micro-batches, one micro-batch a block, as the trainer trains them: the packed
    forward with entropies, the method's loss, backward, gradient clipping and an AdamW step (`bench_blocks`' loop)."""

    def __init__(self, trainer, batches: list[dict]):
        self.trainer, self.batches, self.done = trainer, batches, 0
        self.model = trainer.model
        self.model.train()
        self.parameters = [p for p in self.model.parameters() if p.requires_grad]
        a = trainer.args
        self.optimizer = torch.optim.AdamW(self.parameters, lr=a.learning_rate, betas=(a.adam_beta1, a.adam_beta2),
                                           eps=a.adam_epsilon, weight_decay=a.weight_decay)

    def block(self) -> float:
        batch = self.batches[self.done % len(self.batches)]
        start = time.perf_counter()
        inputs, _ = self.trainer.loss_inputs(self.model, batch, compute_entropy=True)
        self.trainer.turn_loss(inputs, "train").backward()
        torch.nn.utils.clip_grad_norm_(self.parameters, self.trainer.args.max_grad_norm)
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        self.done += 1
        return time.perf_counter() - start


def train_beside(training: Training, generation_done, generator_alive) -> list[float]:
    """Training blocks until E of them are done and the other side has finished one generation batch (or died)."""
    blocks = []
    while not (len(blocks) >= E and generation_done.is_set()) and generator_alive():
        blocks.append(training.block())
    return blocks


def generate_beside(generation: Generation, stop, done) -> list[dict]:
    """Generation batches until `stop` (set by the training side once its share is done): the first is measured
    whole beside training; a later one is cut at its next engine call."""
    batches = []
    generation.stoppable(stop)
    try:
        while not stop.is_set():
            batches.append(generation.batch()[0])
            done.set()
    except RolloutWorkerStopped:
        pass
    return batches


def in_threads(generation: Generation, training: Training) -> dict:
    """Both at once as two Python threads of this process (what the rollout worker does)."""
    stop, done, failed = threading.Event(), threading.Event(), []
    result: list[dict] = []

    def generate():
        try:
            result.extend(generate_beside(generation, stop, done))
        except BaseException as error:  # noqa: BLE001 - re-raised in the main thread
            failed.append(error)

    thread = threading.Thread(target=generate, name="contention-generation", daemon=True)
    thread.start()
    try:
        blocks = train_beside(training, done, thread.is_alive)
    finally:
        stop.set()
        thread.join()
    if failed:
        raise failed[0]
    return {"generation": result[0], "training_blocks": blocks[:E]}


def generation_child(settings, model_path: str, rows: list[dict], stop, go, done, reports) -> None:
    """The child process: its own trainer and model copy, one generation batch alone, then batches beside the
    parent's training until `stop`."""
    try:
        torch.set_num_threads(1)
        task = make_task(settings.task, settings.num_train, settings.num_test, topk=settings.topk)
        with tempfile.TemporaryDirectory() as scratch:
            generation = Generation(build(settings, task, model_path, scratch), rows)
            generation.batch(rows[:1])  # warm-up, as the parent's
            reports.put(("alone", generation.batch()[0]))
            go.wait()
            reports.put(("beside", generate_beside(generation, stop, done)))
    except BaseException:  # noqa: BLE001 - reported to the parent, which raises it
        reports.put(("error", traceback.format_exc()))


def _report(reports, process, kind: str):
    """The child's next report, which must be `kind`; its error, or its death, raised here."""
    deadline = time.monotonic() + CHILD_SECONDS
    while time.monotonic() < deadline:
        try:
            got, value = reports.get(timeout=1.0)
        except queue.Empty:
            if not process.is_alive():
                raise RuntimeError(f"The generation child process died (exit code {process.exitcode}).") from None
            continue
        if got == "error":
            raise RuntimeError(f"The generation child process failed:\n{value}")
        if got != kind:
            raise RuntimeError(f"The generation child process reported {got!r} where {kind!r} was due.")
        return value
    raise TimeoutError(f"The generation child process sent no {kind!r} report in {CHILD_SECONDS} s.")


def in_processes(settings, model_path: str, rows: list[dict], training: Training) -> dict:
    """Generation in a child process (spawned: its own interpreter, trainer and model copy) beside this process's
    training. The child is stopped and joined on every path."""
    context = multiprocessing.get_context("spawn")
    stop, go, done, reports = context.Event(), context.Event(), context.Event(), context.Queue()
    process = context.Process(target=generation_child, args=(settings, model_path, rows, stop, go, done, reports),
                              name="contention-generation", daemon=True)
    process.start()
    try:
        alone = _report(reports, process, "alone")
        go.set()
        blocks = train_beside(training, done, process.is_alive)
        stop.set()
        beside = _report(reports, process, "beside")
        process.join(60)
    finally:
        stop.set()
        go.set()
        if process.is_alive():
            process.terminate()
            process.join(10)
    if not beside:
        raise RuntimeError("The generation child process finished no generation batch beside training.")
    return {"generation_alone_in_child": alone, "generation": beside[0], "training_blocks": blocks[:E]}


def measure_contention(args, settings, task, model_path: str, out: Path) -> dict:
    torch.set_num_threads(1)
    rows = task.train_rows[: args.prompts]
    generation = Generation(build(settings, task, model_path, str(out / "generation")), rows)
    # a warm-up of each side first (one tree; one block): a process's first calls pay for lazy initialisations
    print("[contention] generation alone", flush=True)
    generation.batch(rows[:1])
    generation_alone, batches = generation.batch()
    training = Training(build(settings, task, model_path, str(out / "training")), batches)
    print("[contention] training alone", flush=True)
    training.block()
    training_alone = [training.block() for _ in range(E)]
    print("[contention] two threads", flush=True)
    threads = in_threads(generation, training)
    print("[contention] two processes", flush=True)
    processes = in_processes(settings, model_path, rows, training)

    alone_g, alone_t = generation_alone["seconds"], sum(training_alone)
    table = [{"run": "alone", "generation": alone_g, "generation_tokens": generation_alone["trained_tokens"],
              "training": alone_t, "generation_ratio": 1.0, "training_ratio": 1.0, "overlap": None}]
    for name, measured in (("two threads", threads), ("two processes", processes)):
        g, t = measured["generation"]["seconds"], sum(measured["training_blocks"])
        reference = measured.get("generation_alone_in_child", generation_alone)["seconds"]
        table.append({"run": name, "generation": g, "generation_tokens": measured["generation"]["trained_tokens"],
                      "training": t, "generation_ratio": g / reference, "training_ratio": t / alone_t,
                      "overlap": (alone_g + alone_t) / max(g, t)})
    child = processes["generation_alone_in_child"]
    table.insert(1, {"run": "alone, in the child process", "generation": child["seconds"],
                     "generation_tokens": child["trained_tokens"], "training": None, "generation_ratio": 1.0,
                     "training_ratio": None, "overlap": None})
    headers = {"run": "run", "generation": "generation batch s", "generation_tokens": "its trained tokens",
               "training": f"{E} blocks s", "generation_ratio": "generation / alone",
               "training_ratio": "training / alone", "overlap": "overlap"}
    print(markdown_table([{k: (round(v, 2) if isinstance(v, float) else ("" if v is None else v))
                           for k, v in r.items()} for r in table], list(headers), headers))
    return {"contention": table, "generation_alone": generation_alone, "training_alone_blocks": training_alone,
            "threads": threads, "processes": processes}


# ---------------------------------------------------------------------------------------------------------------------


def main(argv=None) -> dict:
    args = parse_args(argv)
    settings = run_settings(args)
    task, model_path = task_and_model(settings)
    with tempfile.TemporaryDirectory() as scratch:  # the trainers' output_dir: nothing of it is kept
        measure = measure_contention if args.contention else measure_variants
        measured = measure(args, settings, task, model_path, Path(scratch))
    result = {
        "setting": "smollm2",
        "measurement": "contention" if args.contention else "variants",
        "model": settings.model,
        "model_path": model_path,
        "settings": {"method": METHOD, "blocks": E, "prompts": args.prompts, "batches": args.batches,
                     "warmup": args.warmup, "learning_rate": LEARNING_RATE, "lora_rank": settings.lora_rank,
                     "num_initial_rollouts": settings.num_initial_rollouts, "num_branches": settings.num_branches,
                     "max_turns": settings.max_turns, "max_completion_length": settings.max_completion_length,
                     "max_turn_tokens": settings.max_turn_tokens,
                     "gradient_checkpointing": settings.gradient_checkpointing},
        **measured,
        "quick": args.quick,
        "environment": environment(kernels=False),
        "command": " ".join(["python benchmarks/bench_async.py --setting smollm2",
                             *(argv if argv is not None else sys.argv[1:])]),
    }
    write_json(args.output, result)
    return result


if __name__ == "__main__":
    main()
