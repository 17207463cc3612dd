"""What asynchronous rollouts buy: wall seconds per generation batch, synchronous against `max_staleness` 1 and 2
(issue 57, item 7).

Setting "paced" (where generation has its own device, as GPUs give): TreeOPSD on the tiny model with the calculator
tool, two trees per micro-batch, E = 2 optimizer blocks per generation batch, training real. Generation is a script
sampled from torch's generator (`tests.resume_runs`' agent: call the calculator or answer) behind `PacedEngine`, which
sleeps `per_token_seconds` × the most tokens any row gets in each engine call (one batched decode), so generation
costs time but no CPU, like a separate device. A calibration run (synchronous, no pace) measures a generation batch's
training seconds, its unpaced generation seconds and its decode steps; the pace adds the difference, so that
generation takes as long as training (balanced),
the case where overlap gains most: the limit is max(generation, training) per batch, 2x over synchronous.

Per variant, one run of `--batches` generation batches; the first `--warmup` are left out (the pipeline filling up).
Columns: steady-state wall seconds per generation batch (between the starts of consecutive batches), the speedup over
synchronous, the ratio to the limit (1.0 = at the limit), and per batch the trainer's wait for the worker's batch,
the worker's idle wait for admission, and the weight publication. Targets: ≥ 1.8x over synchronous and within 1.1x
of the limit.

Setting "smollm2" (`--setting smollm2`, `async_smollm2.py`, its own flags): this machine's CPU cores, real generation.
The learning benchmark's SmolLM2 TreeOPSD run (its warm start, search task and retriever, LoRA, (M, N) = (4, 2), 3
turns), E = 4, 4 prompts a generation batch, 2 batches a variant with the first left out: synchronous at 1 and at 2
torch threads (the faster is "sync") against the rollout worker at `max_staleness` 1 (`--staleness 1,2`: and 2) at 1
thread, the worker's thread and the trainer's each on one core. The limit is max(generation, training) per batch from
the 1-thread synchronous run's own phases; target: within 1.1x of it. `--contention` measures instead generation and
training alone, as two threads of one process and as two processes (generation in a child process with its own
copy): what a worker process instead of a thread would buy. Both need the cores quiet (async_smollm2.py says what
each costs).

Usage:
    python benchmarks/bench_async.py --output benchmarks/results/async_paced.json
    python benchmarks/bench_async.py --quick          (seconds: checks the pipeline, the figures mean nothing)
    python benchmarks/bench_async.py --setting smollm2 [--staleness 1,2] [--contention] [--quick]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

import torch  # noqa: E402
from common import environment, markdown_table, write_json  # noqa: E402
from transformers import Qwen3Config, Qwen3ForCausalLM, TrainerCallback  # noqa: E402

from tests.resume_runs import sampled_trainer  # noqa: E402
from tests.scripted import tiny  # noqa: E402
from trl_tree import TreeOPSDTrainer  # noqa: E402

E = 2  # optimizer blocks per generation batch
TREES = 2  # per micro-batch: 4 prompts per generation batch
WIDTH, LAYERS = 512, 4  # the trained policy's hidden size and depth (`policy`)


class PacedEngine:
    """A scripted engine that costs time, not CPU: each call sleeps per_token_seconds × its longest row (a batched
    decode), and counts the decode steps it was asked for (to calibrate the pace)."""

    resumes_turns = False

    def __init__(self, engine, per_token_seconds: float):
        self.engine, self.per_token_seconds, self.decode_steps = engine, per_token_seconds, 0

    def generate(self, prefixes, max_new_tokens):
        out = self.engine.generate(prefixes, max_new_tokens)
        steps = max((len(c.ids) for c in out), default=0)
        self.decode_steps += steps
        if self.per_token_seconds > 0:
            time.sleep(self.per_token_seconds * steps)
        return out


class BatchClock(TrainerCallback):
    """The wall time at which each generation batch starts (its first optimizer block) and the run ends."""

    def __init__(self):
        self.starts, self.end = [], None

    def on_step_begin(self, args, state, control, **kwargs):
        if state.global_step % E == 0:
            self.starts.append(time.perf_counter())

    def on_train_end(self, args, state, control, **kwargs):
        self.end = time.perf_counter()


def policy(width: int, layers: int):
    """The policy trained: the tiny tokenizer's Qwen3, `width` wide and `layers` deep, randomly initialised (seed 0).
    The scripted engine samples without it, so only training and the μ / π_old forwards run it: wide enough, a
    batch's cost is its arithmetic (which releases the GIL), not the interpreter's bookkeeping of a 64-wide model,
    which two threads of one process cannot overlap."""
    model, tok = tiny()
    if width == model.config.hidden_size and layers == model.config.num_hidden_layers:
        return model, tok
    config = Qwen3Config(**{
        **model.config.to_dict(),
        "hidden_size": width,
        "intermediate_size": 3 * width,
        "num_hidden_layers": layers,
        "layer_types": None,
        "max_window_layers": layers,
    })
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        wide = Qwen3ForCausalLM(config)
    wide.generation_config = model.generation_config
    return wide, tok


def build(output_dir: str, batches: int, per_token_seconds: float, max_staleness: int, width: int = WIDTH,
          layers: int = LAYERS) -> TreeOPSDTrainer:
    """The tests' sampled TreeOPSD run (`tests.resume_runs.sampled_trainer`: (M, N) = (2, 2), 4 turns, the calculator)
    on the `policy` model, `TREES` trees per micro-batch and E blocks per generation batch, every batch in one epoch
    (a new epoch restarts the worker's pipeline), its sampler behind `PacedEngine`."""
    model, _ = policy(width, layers)
    trainer = sampled_trainer(output_dir, prompts=2 * TREES * batches, trees=TREES, model=model,
                              steps_per_generation=E, max_steps=batches * E, max_staleness=max_staleness,
                              disable_tqdm=True)
    trainer.generation_engine = PacedEngine(trainer.generation_engine, per_token_seconds)
    return trainer


def run(variant: str, max_staleness: int, batches: int, warmup: int, per_token_seconds: float, out: Path,
        width: int = WIDTH, layers: int = LAYERS) -> dict:
    """One run; its steady-state seconds per batch, and per batch its generation time, waits and publications."""
    torch.manual_seed(0)
    trainer = build(str(out / variant), batches, per_token_seconds, max_staleness, width, layers)
    clock, generation = BatchClock(), []
    trainer.add_callback(clock)
    if max_staleness == 0:  # the synchronous trainer: time its generation phase
        original = trainer._generate_micro_batches

        def timed(inputs, num_chunks):
            start = time.perf_counter()
            result = original(inputs, num_chunks)
            generation.append(time.perf_counter() - start)
            return result

        trainer._generate_micro_batches = timed
    trainer.train()
    logged = trainer.state.log_history
    bounds = [*clock.starts, clock.end]
    intervals = [b - a for a, b in zip(bounds, bounds[1:])]
    steady = intervals[warmup:]

    def series(name):
        return [entry[name] for entry in logged if name in entry]

    row = {
        "variant": variant,
        "max_staleness": max_staleness,
        "batches": batches,
        "warmup": warmup,
        "seconds_per_batch": statistics.mean(steady),
        "intervals": intervals,
        "decode_steps": trainer.generation_engine.decode_steps,
    }
    if max_staleness == 0:
        row["generation_seconds"] = statistics.mean(generation[warmup:])
        row["training_seconds"] = statistics.mean(i - g for i, g in zip(steady, generation[warmup:]))
    else:
        row["generation_seconds"] = statistics.mean(series("async/generation_time")[warmup:])
        row["trainer_wait"] = statistics.mean(series("async/trainer_wait")[warmup:])
        row["producer_wait"] = statistics.mean(series("async/producer_wait")[warmup:])
        row["weight_publication_seconds"] = statistics.mean(series("async/weight_publication_time"))
        row["staleness_max"] = max(series("async/staleness_max"))
    return row


SETTINGS = ("paced", "smollm2")


def main(argv=None) -> dict:
    chooser = argparse.ArgumentParser(add_help=False)
    chooser.add_argument("--setting", choices=SETTINGS, default="paced")
    chosen, rest = chooser.parse_known_args(argv)
    if chosen.setting == "smollm2":  # a module of its own, with its own flags
        from async_smollm2 import main as smollm2_main

        return smollm2_main(rest)
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--setting", choices=SETTINGS, default="paced",
                        help="paced (this parser's flags) or smollm2 (`--setting smollm2 --help` for its own)")
    parser.add_argument("--batches", type=int, default=10)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--staleness", default="1,2", help="the asynchronous variants' max_staleness, comma-separated")
    parser.add_argument("--per_token_seconds", type=float, default=None, help="the pace (default: calibrated)")
    parser.add_argument("--quick", action="store_true", help="3 batches, 1 left out, a fixed small pace, the 64-wide model")
    parser.add_argument("--threads", type=int, default=None,
                        help="torch's intra-op threads (default: torch's own, one per core)")
    parser.add_argument("--width", type=int, default=WIDTH, help="the trained policy's hidden size")
    parser.add_argument("--layers", type=int, default=LAYERS, help="the trained policy's layers")
    parser.add_argument("--output", default=str(ROOT / "benchmarks" / "results" / "async_paced.json"))
    args = parser.parse_args(argv)
    if args.quick:
        args.batches, args.warmup = 3, 1
        args.per_token_seconds = 1e-4 if args.per_token_seconds is None else args.per_token_seconds
        args.width, args.layers = 64, 2
    if args.threads is not None:  # one process-wide setting: the worker thread and the trainer share it
        torch.set_num_threads(args.threads)
    with tempfile.TemporaryDirectory() as scratch:  # the trainers' output_dir: nothing of it is kept
        return measure(args, argv, Path(scratch))


def measure(args, argv, out: Path) -> dict:
    calibration = None
    if args.per_token_seconds is None:  # balanced: generation's sleeps as long as one batch's training
        calibration = run("calibration", 0, args.batches, args.warmup, 0.0, out, args.width, args.layers)
        steps_per_batch = calibration["decode_steps"] / args.batches
        # generation's own CPU work (sampling, tools, rewards, forwards) already takes part of a batch's time
        paced = max(calibration["training_seconds"] - calibration["generation_seconds"], 0.0)
        args.per_token_seconds = paced / steps_per_batch
        print(
            f"calibration: training {calibration['training_seconds']:.3f} s per batch, {steps_per_batch:.0f} decode "
            f"steps per batch -> {args.per_token_seconds * 1e3:.3f} ms per token",
            flush=True,
        )
    rows = [run("sync", 0, args.batches, args.warmup, args.per_token_seconds, out, args.width, args.layers)]
    for s in (int(v) for v in args.staleness.split(",") if v):
        rows.append(run(f"async_{s}", s, args.batches, args.warmup, args.per_token_seconds, out, args.width, args.layers))
    sync = rows[0]
    limit = max(sync["generation_seconds"], sync["training_seconds"])
    for row in rows:
        row["speedup"] = sync["seconds_per_batch"] / row["seconds_per_batch"]
        row["over_limit"] = row["seconds_per_batch"] / limit
    headers = {
        "variant": "variant",
        "seconds_per_batch": "s / batch",
        "speedup": "speedup",
        "over_limit": "/ limit",
        "trainer_wait": "trainer wait",
        "producer_wait": "producer wait",
        "weight_publication_seconds": "publication",
    }
    print(
        markdown_table(
            [{k: (round(v, 3) if isinstance(v, float) else v) for k, v in r.items()} for r in rows],
            list(headers),
            headers,
        )
    )
    print(
        f"limit max(generation {sync['generation_seconds']:.3f}, training {sync['training_seconds']:.3f}) = "
        f"{limit:.3f} s per batch; targets: speedup >= 1.8, / limit <= 1.1"
    )
    result = {
        "setting": "paced",
        "policy": {"hidden_size": args.width, "layers": args.layers},
        "torch_threads": torch.get_num_threads(),
        "per_token_seconds": args.per_token_seconds,
        "limit_seconds": limit,
        "calibration": calibration,
        "rows": rows,
        "quick": args.quick,
        "environment": environment(kernels=False),
        "command": " ".join(["python benchmarks/bench_async.py", *(argv if argv is not None else sys.argv[1:])]),
    }
    write_json(args.output, result)
    return result


if __name__ == "__main__":
    main()
