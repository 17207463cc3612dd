"""One training run per output directory: `TreeTrainer.train` holds `output_dir/_trl_tree_run.lock` while it runs.

Two runs started on one `output_dir` both trained and saved `checkpoint-N` folders over each other's (and the later
one's checkpoint rotation deleted the earlier one's), each exiting 0. Now the second is refused when it starts
training, with the holder named: its process id, host, start time and command.

- The lock is a small JSON file written by the main process only (in a multi-process run the others learn the answer
  from it, so every process raises the same error and none is left waiting in a collective).
- It is released when `train()` ends, on every exit path (return, exception, Ctrl-C). A run killed without cleanup
  (SIGKILL, SIGTERM's default, a power cut) leaves the file, which does not hold: a lock whose process has ended on
  this host (no such pid, a zombie, a pid since reused by another process, or a reboot since) is taken over, with a
  warning. A lock written on another host cannot be checked from here and holds until that run ends or the file is
  deleted; the error says so.
- Within one process it is re-entrant: several trainers of one process (a notebook, pytest) may train on one
  `output_dir`, one after another or nested, since one process cannot race itself the way two runs do.
- Its name starts with "_", which transformers' pushes to the Hub skip.

Checking and taking the lock happen under an exclusive `flock` of the output directory, so two runs started at once
(or both finding the same stale lock) cannot both take it; where the filesystem refuses `flock`, the check is done
without it.
"""

from __future__ import annotations

import contextlib
import datetime
import functools
import json
import logging
import os
import socket
import sys
import threading

logger = logging.getLogger(__name__)

LOCK_NAME = "_trl_tree_run.lock"

_held: dict[str, int] = {}  # lock path -> how many `train()` calls of this process hold it
_held_guard = threading.Lock()


class OutputDirInUse(RuntimeError):
    """A live run holds the output directory: another run would overwrite its checkpoints."""


def holds_output_dir(train):
    """`TreeTrainer.train` decorated: the trainer's `output_dir` is held while it runs (`holding_output_dir`), before
    a checkpoint is chosen and until everything `train` closes on its way out is closed."""

    @functools.wraps(train)
    def holding(self, *args, **kwargs):
        with holding_output_dir(self.args.output_dir, self.accelerator):
            return train(self, *args, **kwargs)

    return holding


@contextlib.contextmanager
def holding_output_dir(output_dir: str | os.PathLike | None, accelerator):
    """Hold `output_dir` for this run while the block runs: the main process takes the lock (or raises
    `OutputDirInUse` naming the run that holds it), every other process gets the same answer, and the main process
    releases the lock however the block ends."""
    if not output_dir:
        yield
        return
    path, refusal = None, None
    if accelerator.is_main_process:
        try:
            path = acquire(output_dir)
        except OutputDirInUse as error:
            refusal = str(error)
    try:
        if accelerator.num_processes > 1:
            from accelerate.utils import broadcast_object_list

            refusal = broadcast_object_list([refusal], from_process=0)[0]
        if refusal is not None:
            raise OutputDirInUse(refusal)
        yield
    finally:
        if path is not None:
            release(path)


def acquire(output_dir: str | os.PathLike) -> str:
    """Take the lock of `output_dir` for this process and return its path, or raise `OutputDirInUse` naming the live
    run that holds it."""
    os.makedirs(output_dir, exist_ok=True)
    path = os.path.join(os.path.realpath(output_dir), LOCK_NAME)
    with _held_guard:
        if _held.get(path):
            _held[path] += 1
            return path
        with _directory_flock(os.path.dirname(path)):
            holder = _read(path)
            if holder is not None and not _is_this_process(holder):
                if _is_alive(holder):
                    raise OutputDirInUse(_in_use_message(output_dir, path, holder))
                logger.warning(
                    "%s was left by a run that is no longer alive (%s); taking it over.", path, _describe(holder)
                )
            _write(path, _this_process())
        _held[path] = 1
    return path


def release(path: str) -> None:
    """Give back one hold of the lock at `path`; the last one of this process removes the file (if it is still this
    process's: a user may have deleted it and another run taken it since)."""
    with _held_guard:
        count = _held.get(path, 0) - 1
        if count > 0:
            _held[path] = count
            return
        _held.pop(path, None)
        holder = _read(path)
        if holder is not None and _is_this_process(holder):
            with contextlib.suppress(FileNotFoundError):
                os.remove(path)


def holder_of(output_dir: str | os.PathLike) -> dict | None:
    """The run recorded in `output_dir`'s lock (pid, host, started, command), None when there is none."""
    return _read(os.path.join(os.path.realpath(output_dir), LOCK_NAME))


# ------------------------------------------------------------------------------------------------- the lock file


def _this_process() -> dict:
    return {
        "pid": os.getpid(),
        "host": socket.gethostname(),
        "started": datetime.datetime.now().astimezone().isoformat(timespec="seconds"),
        "process_start": _process_start(os.getpid()),
        "boot_id": _boot_id(),
        "command": " ".join(sys.argv)[:500],
    }


def _write(path: str, holder: dict) -> None:
    """Written whole under a temporary name and renamed, so a reader never sees half a lock."""
    temporary = f"{path}.{os.getpid()}.tmp"
    with open(temporary, "w") as f:
        json.dump(holder, f)
    os.replace(temporary, path)


def _read(path: str) -> dict | None:
    """The lock's holder; None when there is no lock. An unreadable file (not written by `_write`) reads as a holder
    with no pid, which `_is_alive` takes for stale."""
    try:
        with open(path) as f:
            holder = json.load(f)
    except FileNotFoundError:
        return None
    except (OSError, ValueError):
        return {}
    return holder if isinstance(holder, dict) else {}


def _is_this_process(holder: dict) -> bool:
    return (
        holder.get("pid") == os.getpid()
        and holder.get("host") == socket.gethostname()
        and holder.get("process_start") == _process_start(os.getpid())
    )


def _is_alive(holder: dict) -> bool:
    """Whether the process that wrote the lock still runs. On another host this cannot be told: it counts as alive."""
    if holder.get("host") != socket.gethostname():
        return bool(holder.get("host"))
    pid = holder.get("pid")
    if not isinstance(pid, int) or pid <= 0:
        return False
    if holder.get("boot_id") and _boot_id() and holder["boot_id"] != _boot_id():
        return False  # the machine rebooted since: every process of then has ended
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        pass  # another user's process: it exists
    if _process_state(pid) in ("Z", "X"):
        return False  # ended, not yet reaped by its parent
    started, now = holder.get("process_start"), _process_start(pid)
    return started is None or now is None or started == now  # else the pid was reused by another process


def _process_stat(pid: int) -> list[str] | None:
    """The fields of /proc/PID/stat after the command name (Linux); None elsewhere or when it cannot be read."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()
    except (OSError, IndexError):
        return None


def _process_start(pid: int) -> int | None:
    """When the process started, in clock ticks since boot (field 22 of /proc/PID/stat): with the pid, it tells a
    process from a later one that reuses its pid."""
    fields = _process_stat(pid)
    return int(fields[19]) if fields and len(fields) > 19 else None


def _process_state(pid: int) -> str | None:
    fields = _process_stat(pid)
    return fields[0] if fields else None


def _boot_id() -> str | None:
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            return f.read().strip()
    except OSError:
        return None


@contextlib.contextmanager
def _directory_flock(directory: str):
    """An exclusive `flock` of the directory while the lock is checked and taken, so two runs cannot both find it free
    (or both find the same stale lock). Skipped where there is no `flock` or the filesystem refuses it."""
    try:
        import fcntl
    except ImportError:  # not POSIX
        yield
        return
    try:
        fd = os.open(directory, os.O_RDONLY)
    except OSError:
        yield
        return
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX)
        except OSError:  # some network filesystems
            pass
        yield
    finally:
        os.close(fd)  # closing the descriptor releases the flock


# ------------------------------------------------------------------------------------------------- the error


def _describe(holder: dict) -> str:
    if not holder:
        return "an unreadable lock file"
    running = f", running {holder['command']!r}" if holder.get("command") else ""
    return f"process {holder.get('pid')} on host {holder.get('host')}, started {holder.get('started')}{running}"


def _in_use_message(output_dir, path: str, holder: dict) -> str:
    here = holder.get("host") == socket.gethostname()
    gone = (
        "A lock whose process has ended on this host does not hold: once that run ends, this one can start."
        if here
        else f"That host is not this one ({socket.gethostname()}), so whether the run still lives cannot be told "
        f"from here: if it has ended (a crash), delete {path}."
    )
    return (
        f"output_dir {os.fspath(output_dir)} is in use by another training run: {_describe(holder)} (its lock: "
        f"{path}). Two runs in one output_dir write checkpoint-N over each other's and rotate each other's away. Wait "
        f"for that run to end, or give this run another output_dir. {gone}"
    )
