"""One training run per output directory (issue 56, item 7): a second run on an `output_dir` that a live run holds is
refused, naming the other process; the lock goes when `train()` ends, however it ends; a crashed run's lock does not
hold; one process may take its own lock again; only the main process writes it.

Before: two runs started on one output_dir both trained and exited 0, the second having overwritten the first one's
checkpoints."""

import json
import os
import socket
import subprocess
import sys
import textwrap
import types

import pytest
from transformers import TrainerCallback

from tests.scripted import scripted_trainer
from trl_tree import TreeOPSDConfig, TreeOPSDTrainer
from trl_tree.trainer import run_lock

HOLDER = textwrap.dedent("""
    import sys
    from trl_tree.trainer import run_lock
    run_lock.acquire(sys.argv[1])
    print("held", flush=True)
    sys.stdin.readline()  # held until the test closes stdin (or kills this process)
""")


@pytest.fixture
def other_run(tmp_path):
    """Another live process holding `tmp_path / "out"`; stopped (killed, its lock left behind) on every exit path."""
    out = tmp_path / "out"
    proc = subprocess.Popen([sys.executable, "-c", HOLDER, str(out)], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                            text=True, cwd=os.path.dirname(os.path.dirname(__file__)))  # fmt: skip
    try:
        assert proc.stdout.readline().strip() == "held"
        yield out, proc
    finally:
        proc.kill()
        proc.wait(timeout=60)


def test_a_second_run_is_refused_naming_the_live_run_and_a_crashed_runs_lock_does_not_hold(other_run):
    out, proc = other_run
    with pytest.raises(run_lock.OutputDirInUse) as error:
        run_lock.acquire(out)
    message = str(error.value)
    holder = run_lock.holder_of(out)
    holder_named = f"process {proc.pid} on host {socket.gethostname()}, started {holder['started']}, running "
    assert f"output_dir {out} is in use by another training run: {holder_named}" in message
    assert "Wait for that run to end, or give this run another output_dir" in message
    proc.kill()  # a crash: no cleanup, the lock file stays
    proc.wait(timeout=60)
    assert run_lock.holder_of(out)["pid"] == proc.pid
    path = run_lock.acquire(out)  # the dead run's lock does not hold
    try:
        assert run_lock.holder_of(out)["pid"] == os.getpid()
    finally:
        run_lock.release(path)
    assert run_lock.holder_of(out) is None


def test_train_on_a_held_output_dir_is_refused_before_anything_is_written(other_run):
    out, proc = other_run
    trainer = scripted_trainer(TreeOPSDTrainer, TreeOPSDConfig, out, save_strategy="steps", save_steps=1)
    with pytest.raises(run_lock.OutputDirInUse, match=f"process {proc.pid} on host"):
        trainer.train()
    assert sorted(os.listdir(out)) == [run_lock.LOCK_NAME] and trainer.state.global_step == 0
    assert run_lock.holder_of(out)["pid"] == proc.pid  # the other run's lock is left alone


class Raise(TrainerCallback):
    def __init__(self, error):
        self.error, self.holders = error, []

    def on_step_begin(self, args, state, control, **kwargs):
        self.holders.append(run_lock.holder_of(args.output_dir))
        if self.error is not None:
            raise self.error


@pytest.mark.parametrize("error", [None, RuntimeError("a reward function failed"), KeyboardInterrupt()],
                         ids=["returns", "raises", "ctrl-c"])  # fmt: skip
def test_train_holds_the_lock_while_it_runs_and_releases_it_on_every_exit_path(tmp_path, error):
    spy = Raise(error)
    trainer = scripted_trainer(TreeOPSDTrainer, TreeOPSDConfig, tmp_path, callbacks=[spy])
    if error is None:
        trainer.train()
    else:
        with pytest.raises(type(error)):
            trainer.train()
    assert [h["pid"] for h in spy.holders] == [os.getpid()]
    assert run_lock.holder_of(tmp_path) is None and not (tmp_path / run_lock.LOCK_NAME).exists()


def test_one_process_may_take_its_own_lock_again_and_sequential_runs_share_a_dir(tmp_path):
    """Nested holds of one process (trainers of one notebook or test) count; the file goes with the last release.
    Two trainers of one process train one after the other on the same output_dir."""
    first = run_lock.acquire(tmp_path)
    second = run_lock.acquire(tmp_path)
    run_lock.release(second)
    assert run_lock.holder_of(tmp_path)["pid"] == os.getpid()
    run_lock.release(first)
    assert run_lock.holder_of(tmp_path) is None
    for _ in range(2):
        scripted_trainer(TreeOPSDTrainer, TreeOPSDConfig, tmp_path).train()
    assert run_lock.holder_of(tmp_path) is None


def _write_lock(out, **holder):
    out.mkdir(parents=True, exist_ok=True)
    (out / run_lock.LOCK_NAME).write_text(json.dumps(holder))


def test_a_reused_pid_or_an_unreadable_lock_does_not_hold(tmp_path, caplog):
    """The pid of a live process that started after the lock was written (pid reuse) is not the run that wrote it."""
    _write_lock(tmp_path, pid=os.getppid(), host=socket.gethostname(), started="2020-01-01T00:00:00+00:00",
                process_start=-1)  # fmt: skip
    run_lock.release(run_lock.acquire(tmp_path))
    assert "no longer alive" in caplog.text
    (tmp_path / run_lock.LOCK_NAME).write_text("{not json")
    run_lock.release(run_lock.acquire(tmp_path))
    assert run_lock.holder_of(tmp_path) is None


def test_a_lock_from_another_host_holds_and_says_how_to_clear_it(tmp_path):
    _write_lock(tmp_path, pid=1, host="gpu-node-7", started="2026-01-01T00:00:00+00:00", command="train.py")
    with pytest.raises(run_lock.OutputDirInUse) as error:
        run_lock.acquire(tmp_path)
    assert "process 1 on host gpu-node-7, started 2026-01-01T00:00:00+00:00, running 'train.py'" in str(error.value)
    assert f"if it has ended (a crash), delete {tmp_path / run_lock.LOCK_NAME}" in str(error.value)


def _accelerator(main: bool, answer):
    """A process of a two-process run; `answer` is what the main process broadcasts (its refusal, or None)."""
    return types.SimpleNamespace(is_main_process=main, num_processes=2), lambda objects, from_process=0: [answer]


@pytest.mark.parametrize("answer", [None, "output_dir x is in use by another training run: process 12"])
def test_only_the_main_process_writes_the_lock_and_every_process_gets_its_answer(tmp_path, monkeypatch, answer):
    accelerator, broadcast = _accelerator(main=False, answer=answer)
    monkeypatch.setattr("accelerate.utils.broadcast_object_list", broadcast)
    if answer is None:
        with run_lock.holding_output_dir(tmp_path, accelerator):
            assert run_lock.holder_of(tmp_path) is None  # written by the main process only
    else:
        with pytest.raises(run_lock.OutputDirInUse, match="process 12"):
            with run_lock.holding_output_dir(tmp_path, accelerator):
                pytest.fail("a refused run must not train")
    assert not (tmp_path / run_lock.LOCK_NAME).exists()
