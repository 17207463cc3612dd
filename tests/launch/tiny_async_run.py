"""Asynchronous rollouts on every rank, for `tests/test_async_launch.py` (docs/design.md §9).

Usage, from the repository root:
       accelerate launch --multi_gpu --num_processes 2 -m tests.launch.tiny_async_run OUT
Per rank, three runs of the warm-started tiny model (real HF generation, the calculator tool, TreeOPSD, E = 2 blocks,
three generation batches): synchronous; through the rollout worker in lockstep (max_staleness 0); and at
max_staleness 1. Writes OUT/report-rank{r}.json: whether the lockstep run's losses and final weights equal the
synchronous run's bit for bit, the staleness and policy version logged per batch at max_staleness 1, whether every
trainable parameter changed there, its losses, and the threads left running after each run.
"""

import json
import sys
import threading
from pathlib import Path

import torch

from tests.launch.tiny_tree_run import build_trainer
from tests.scripted import recording_losses, threads_left
from trl_tree.trainer.async_rollouts import use_rollout_worker

STEPS = 6  # three generation batches of E = 2 optimizer blocks (steps_per_generation = 2)
# one epoch holds the three batches (a new epoch starts the worker's pipeline afresh: docs/design.md §9)
PROMPTS = 16



def run(out: Path, name: str, max_staleness: int | None) -> dict:
    """One run; `max_staleness` None: synchronous, 0: the worker in lockstep, else the trainer's own field."""
    fields = {} if max_staleness in (None, 0) else {"max_staleness": max_staleness}
    trainer = build_trainer(str(out / name), max_steps=STEPS, prompts=PROMPTS, **fields)
    if max_staleness == 0:
        use_rollout_worker(trainer, 0)
    losses = recording_losses(trainer)
    before = {n: p.detach().clone() for n, p in trainer.model.named_parameters() if p.requires_grad}
    threads = set(threading.enumerate())
    trainer.train()
    after = {n: p.detach().clone() for n, p in trainer.model.named_parameters() if p.requires_grad}
    logged = {key: [e[key] for e in trainer.state.log_history if key in e]
              for key in ("async/staleness_max", "async/policy_version", "reward")}
    return {"losses": losses, "params": after, "logged": logged, "threads_left": threads_left(threads),
            "all_changed": all(not torch.equal(before[n], after[n]) for n in before)}


def main():
    out = Path(sys.argv[1])
    sync, lockstep, stale = run(out, "sync", None), run(out, "async0", 0), run(out, "async1", 1)
    rank = torch.distributed.get_rank() if torch.distributed.is_initialized() else 0
    world = torch.distributed.get_world_size() if torch.distributed.is_initialized() else 1
    report = {
        "rank": rank,
        "world": world,
        "lockstep_losses_equal": len(sync["losses"]) == len(lockstep["losses"])
        and all(torch.equal(a, b) for a, b in zip(sync["losses"], lockstep["losses"])),
        "lockstep_params_equal": all(torch.equal(sync["params"][n], lockstep["params"][n]) for n in sync["params"]),
        "lockstep_staleness": lockstep["logged"]["async/staleness_max"],
        "stale_staleness": stale["logged"]["async/staleness_max"],
        "stale_policy_version": stale["logged"]["async/policy_version"],
        "stale_losses": [float(x) for x in stale["losses"]],
        "stale_all_changed": stale["all_changed"],
        "stale_rewards": stale["logged"]["reward"],
        "threads_left": sync["threads_left"] + lockstep["threads_left"] + stale["threads_left"],
    }
    out.mkdir(parents=True, exist_ok=True)
    (out / f"report-rank{rank}.json").write_text(json.dumps(report))


if __name__ == "__main__":
    main()
