"""A run across two machines, simulated on this host: trained, checkpointed, killed, resumed exactly.

Each "machine" is its own `accelerate launch` command with the shipped multi-node config
(`trl_tree/accelerate_configs/multi_node.yaml`), `--machine_rank 0 | 1` and the main machine's address 127.0.0.1: one
process a machine, a world of two joined over gloo by torchrun's static rendezvous, as on two hosts. The run is
tests/launch/tiny_tree_run.py's TreeOPSD run with the calculator tool (tests/launch/tiny_machines_run.py), 4
optimizer steps, E = 2 blocks per generation batch, a checkpoint after every step. It is trained uninterrupted once;
a second run is SIGKILLed on both machines right after checkpoint 1, between the two blocks of its first generation
batch, and a third resumes it with `resume_from_checkpoint=True`. The resumed run must train the buffered batch
without generating it again and end with the uninterrupted run's weights, losses and rewards, bit for bit (CPU,
float32, one thread: tests/test_resume.py).
"""

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from trl_tree.testing import free_port

ROOT = Path(__file__).resolve().parent.parent
CONFIG = ROOT / "trl_tree" / "accelerate_configs" / "multi_node.yaml"
TIMEOUT = 600




def launch_machines(out: Path, phase: str, *script_args: str) -> list[tuple[subprocess.Popen, Path]]:
    """Start both machines' launchers (machine 0 is the main one), each logging to OUT/PHASE-machine{r}.log."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", "TRL_EXPERIMENTAL_SILENCE": "1", "CI": "true"}
    port = str(free_port())
    machines = []
    for machine in (0, 1):
        cmd = [sys.executable, "-m", "accelerate.commands.launch", "--config_file", str(CONFIG), "--num_processes",
               "2", "--num_machines", "2", "--mixed_precision", "no", "--machine_rank", str(machine),
               "--main_process_ip", "127.0.0.1", "--main_process_port", port,
               "-m", "tests.launch.tiny_machines_run", str(out), phase, *script_args]
        log = out / f"{phase}-machine{machine}.log"
        out.mkdir(parents=True, exist_ok=True)
        with open(log, "w") as f:
            machines.append((subprocess.Popen(cmd, stdout=f, stderr=subprocess.STDOUT, env=env, cwd=ROOT,
                                              start_new_session=True), log))
    return machines


def logs(machines) -> str:
    return "\n".join(f"--- {log.name}\n{log.read_text()[-4000:]}" for _, log in machines)


def stop(machines) -> None:
    for proc, _ in machines:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()


def finish(machines) -> list[int]:
    """Wait for both launchers; return their exit codes (both killed on a timeout)."""
    deadline = time.monotonic() + TIMEOUT
    try:
        return [proc.wait(timeout=max(1.0, deadline - time.monotonic())) for proc, _ in machines]
    except subprocess.TimeoutExpired:
        stop(machines)
        pytest.fail(f"the two machines did not finish within {TIMEOUT} s\n{logs(machines)}")


def run(out: Path, phase: str) -> list[dict]:
    machines = launch_machines(out, phase)
    assert finish(machines) == [0, 0], logs(machines)
    return reports(out / phase)


def reports(folder: Path) -> list[dict]:
    found = [json.loads(p.read_text()) for p in sorted(folder.glob("report-rank*.json"))]
    for r in found:
        r["params"] = torch.load(folder / f"params-rank{r['rank']}.pt", weights_only=True)
    return found


def kill_after_checkpoint(out: Path, step: int) -> None:
    """Train until checkpoint `step` is written on both machines, then SIGKILL each machine's training process
    (torchrun's worker, in a session of its own) as a crash would; the launchers then exit with the failure."""
    machines = launch_machines(out, "interrupted", "--hold_after_save", str(step))
    held = [out / "interrupted" / f"held-rank{r}" for r in (0, 1)]
    deadline = time.monotonic() + TIMEOUT
    while not all(p.is_file() and p.read_text() for p in held):
        if any(proc.poll() is not None for proc, _ in machines) or time.monotonic() > deadline:
            stop(machines)
            pytest.fail(f"the run ended or hung before checkpoint {step}\n{logs(machines)}")
        time.sleep(1)
    for p in held:
        os.kill(int(p.read_text()), signal.SIGKILL)
    codes = finish(machines)
    assert all(code != 0 for code in codes), codes  # each launcher saw its process killed


@pytest.mark.slow
def test_two_machines_resume_exactly_after_a_kill(tmp_path):
    full = run(tmp_path, "full")
    assert sorted((r["rank"], r["machine"]) for r in full) == [(0, 0), (1, 1)]  # one process on each machine
    for r in full:
        assert r["world"] == 2 and r["distributed_type"] == "DistributedType.MULTI_CPU"
        assert r["generations"] == [0, 2]  # two generation batches, each trained in E = 2 blocks
        assert set(r["losses"]) == {"1", "2", "3", "4"}

    kill_after_checkpoint(tmp_path, step=1)
    run_dir = tmp_path / "interrupted"
    assert (run_dir / "checkpoint-1").is_dir() and not (run_dir / "checkpoint-2").exists()
    assert not list(run_dir.glob("report-rank*.json"))  # killed before the end

    resumed = run(tmp_path, "resume")
    reference = full[0]
    for r in resumed:
        assert r["world"] == 2
        # the interrupted generation batch's second block trains on the restored buffer; the only generation is the
        # second batch's, at micro-step 2
        assert r["generations"] == [2]
        assert r["losses"] == reference["losses"] and r["rewards"] == reference["rewards"]
        different = [n for n in reference["params"] if not torch.equal(r["params"][n], reference["params"][n])]
        assert not different, f"rank {r['rank']}: parameters differ from the uninterrupted run's: {different}"
