"""Resume on several processes, for `accelerate launch` tests (tests/test_resume.py).

Runs tests/test_resume.py's setting on every rank: the uninterrupted run, then a run resumed from checkpoint 1 (between
the two optimizer blocks of the first generation batch).

Usage, from the repository root (it imports tests/test_resume.py's helpers):
    accelerate launch --multi_gpu --num_processes 2 -m tests.launch.tiny_resume_run OUT
        [treeopsd | treeopsd_async | treeflex]
Writes OUT/resume-rank{r}.json per rank: the world size, whether this rank's resume-state file was saved, the steps
at which each run generated, and whether the resumed run's parameters, rewards and losses equal the uninterrupted
run's.
"""

import functools
import gc
import json
import os
import sys
from pathlib import Path

import torch

from tests.resume_runs import flex_trainer, logged, train, tree_trainer
from trl_tree.trainer import resume


def main():
    out = Path(sys.argv[1])
    if "treeflex" in sys.argv[2:]:
        make = flex_trainer
    elif "treeopsd_async" in sys.argv[2:]:  # the rollout worker one batch ahead: a batch in flight at checkpoint 1
        make = functools.partial(tree_trainer, max_staleness=1)
    else:
        make = tree_trainer
    full, full_params, full_generations = train(make, out / "full")
    checkpoint = out / "full" / "checkpoint-1"
    rank = full.accelerator.process_index
    resumed, params, generations = train(make, out / "resumed", checkpoint)
    report = {
        "rank": rank,
        "world": full.accelerator.num_processes,
        "state_saved": os.path.isfile(resume.state_file(str(checkpoint), rank)),
        "full_generations": full_generations,
        "resumed_generations": generations,
        "same_params": all(torch.equal(params[n], full_params[n]) for n in full_params),
        "same_rewards": logged(resumed, "reward") == logged(full, "reward"),
        "same_losses": logged(resumed, "loss") == logged(full, "loss"),
    }
    with open(out / f"resume-rank{rank}.json", "w") as f:
        json.dump(report, f)
    if torch.distributed.is_initialized():  # as tiny_tree_run.py: tear Gloo down in order
        torch.distributed.barrier()
        del full, resumed
        gc.collect()
        torch.distributed.destroy_process_group()


if __name__ == "__main__":
    os.environ.setdefault("TRL_EXPERIMENTAL_SILENCE", "1")
    main()
