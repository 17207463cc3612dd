"""TreeOPSD with a tool on the tiny model, one phase of a run across machines, for tests/test_multi_machine.py.

Usage, from the repository root, on each "machine" (the same command with its own --machine_rank):
    accelerate launch --config_file trl_tree/accelerate_configs/multi_node.yaml --num_processes 2 \
        --machine_rank R --main_process_ip 127.0.0.1 --main_process_port P \
        -m tests.launch.tiny_machines_run OUT PHASE [--hold_after_save STEP]

tests/launch/tiny_tree_run.py's run (the warm-started tiny model, the calculator tool, two optimizer blocks per
generation batch) for 4 optimizer steps with a checkpoint after each. PHASE names the run's folder, OUT/PHASE;
`resume` resumes OUT/interrupted from its newest complete checkpoint (`resume_from_checkpoint=True`) and trains to the
end.
`--hold_after_save STEP`: after checkpoint STEP is saved, every process writes its process id to
OUT/PHASE/held-rank{r} and sleeps until it is killed (the test SIGKILLs both machines' training processes there, so
the stop point is exact; torchrun starts each in a session of its own, so killing a launcher does not reach it).

Each process writes OUT/PHASE/report-rank{r}.json (its rank, world size, machine, the micro-steps at which it
generated, its logged losses and rewards by step) and its final parameters to OUT/PHASE/params-rank{r}.pt.
"""

import json
import os
import sys
import time
from pathlib import Path

import torch
from transformers import TrainerCallback

from tests.launch.tiny_tree_run import build_trainer
from tests.resume_runs import count_generations, logged

MAX_STEPS = 4  # two generation batches of E = 2 optimizer blocks


class HoldAfterSave(TrainerCallback):
    """Stop this process, as a crash would, right after checkpoint `step` is written: say so, then wait to be
    killed."""

    def __init__(self, step: int, folder: Path, rank: int):
        self.step, self.folder, self.rank = step, folder, rank

    def on_save(self, args, state, control, **kwargs):
        if state.global_step == self.step:
            (self.folder / f"held-rank{self.rank}").write_text(str(os.getpid()))
            while True:
                time.sleep(60)


def main():
    out, phase = Path(sys.argv[1]), sys.argv[2]
    hold = int(sys.argv[sys.argv.index("--hold_after_save") + 1]) if "--hold_after_save" in sys.argv else None
    folder = out / ("interrupted" if phase == "resume" else phase)
    folder.mkdir(parents=True, exist_ok=True)
    trainer = build_trainer(str(folder), max_steps=MAX_STEPS, save_strategy="steps", save_steps=1)
    rank = trainer.accelerator.process_index
    if hold is not None:
        trainer.add_callback(HoldAfterSave(hold, folder, rank))
    generations = count_generations(trainer)
    trainer.train(resume_from_checkpoint=True if phase == "resume" else None)
    report = {
        "rank": rank,
        "world": trainer.accelerator.num_processes,
        "machine": int(os.environ.get("GROUP_RANK", -1)),  # torchrun's node rank: accelerate's --machine_rank
        "distributed_type": str(trainer.accelerator.distributed_type),
        "generations": generations,
        "losses": logged(trainer, "loss"),
        "rewards": logged(trainer, "reward"),
    }
    report_folder = out / phase
    report_folder.mkdir(parents=True, exist_ok=True)
    model = trainer.accelerator.unwrap_model(trainer.model)
    torch.save({n: p.detach().cpu() for n, p in model.named_parameters()}, report_folder / f"params-rank{rank}.pt")
    with open(report_folder / f"report-rank{rank}.json", "w") as f:
        json.dump(report, f)
    trainer.end()  # all ranks wait, the DDP reducer goes, then the process group


if __name__ == "__main__":
    os.environ.setdefault("TRL_EXPERIMENTAL_SILENCE", "1")
    main()
