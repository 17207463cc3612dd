"""Exact resume from any checkpoint: the per-process state that transformers' checkpoint does not hold.

transformers saves the model, the optimizer, the scheduler, the trainer state and the global random generators
(`rng_state*.pth`), and on resume it skips the dataloader batches already seen. A tree trainer carries two more things
from one optimizer step to the next, per process:

- **the generation batch being trained.** The E optimizer blocks of a generation batch all train on the trees
  generated at its first step (`_buffered_inputs`, with π_old recomputed then); `_step` counts micro-batches and
  says which one comes next. GRPOTrainer starts a resumed run with no buffer and `_step = 0`, so a checkpoint saved
  between two blocks would regenerate the batch (other trees, another π_old) and shift the block order for the rest of
  the run.
- **the sampler's own random generators** (init-expand's anchors, random expansion, a custom harness's draws). They
  are not the global ones transformers restores, so a resumed sampler would draw its first anchors again.

With a rollout worker (max_staleness > 0) a third: **the batches in flight**, admitted ahead and not yet trained. They
are regenerated on resume, not saved: the state holds the weights each was admitted with, the worker's sampler state
and the global random state after the last batch trained (`AsyncRollouts.checkpoint_state`, under "rollouts"), so the
regenerated batches are the uninterrupted run's (docs/design.md, "Asynchronous rollouts").

All are written to `trl_tree_state_{process_index}.pth` in the checkpoint folder by the trainer's `_save_rng_state`
hook and read back by its `_load_rng_state` hook: transformers calls the first on every process when it saves a
checkpoint, and the second on every process before the first resumed training step (after skipping the seen batches),
so the resumed run takes its next micro-batch from the restored buffer instead of generating.

A sampler's state is its `state_dict()` if it defines one (with `load_state_dict(state)`), else the state of every
random generator it holds as an attribute (`random.Random`, `torch.Generator`, NumPy's `Generator` / `RandomState`):
the built-in samplers and most custom harnesses need nothing more. The global generators the engine samples with
(torch's, for `model.generate`) are transformers' to save; vLLM's own sampling state is not restorable.

The saved batch was built, and credited, under the checkpoint's configuration: a run resumed with another one (other
batch sizes, branches, teacher radius, components, another trainer: `_layout`) would train the rest of that batch as
the old run would have, silently. So the state records every field that shapes the batch, and on any difference the
resumed run generates the batch anew, with a warning naming each field (old → new).

`resume_from_checkpoint=True` goes through `last_complete_checkpoint`: transformers takes the newest `checkpoint-*`
folder, even one a crash during the save left without its trainer state, and then fails on it. Whichever checkpoint is
resumed, every file the resume reads is checked before anything loads (`check_checkpoint`): a file cut short by an
interrupted save (the trainer state, the weights, the optimizer, scheduler and scaler, every RNG and trl-tree state
file) is an error naming it, the checkpoint and the newest complete earlier one, where torch would fail after the
weights had loaded with an error naming no file (`OSError: [Errno 22]` for a cut `rng_state.pth`). A checkpoint without
its optimizer state (`save_only_model=True`) is refused unless `TRL_TREE_RESUME_WITHOUT_OPTIMIZER=1`: transformers
would resume it with a fresh optimizer and schedule, without a word.
"""

from __future__ import annotations

import json
import logging
import os
import random
import re
import zipfile
from typing import Any

import numpy as np
import torch
from transformers import TrainerCallback
from transformers.trainer import (
    FSDP_MODEL_NAME,
    OPTIMIZER_NAME,
    OPTIMIZER_NAME_BIN,
    SCHEDULER_NAME,
    TRAINER_STATE_NAME,
)
from transformers.trainer_pt_utils import safe_globals
from transformers.trainer_utils import PREFIX_CHECKPOINT_DIR
from transformers.utils import (
    ADAPTER_SAFE_WEIGHTS_NAME,
    ADAPTER_WEIGHTS_NAME,
    SAFE_WEIGHTS_INDEX_NAME,
    SAFE_WEIGHTS_NAME,
    WEIGHTS_INDEX_NAME,
    WEIGHTS_NAME,
)
from transformers.utils.import_utils import check_torch_load_is_safe

from .. import methods, trl_internals
from ..asynchronous import random_state

logger = logging.getLogger(__name__)

STATE_FILE = "trl_tree_state_{rank}.pth"
# set to 1 to resume a checkpoint without its optimizer state, with fresh ones (`check_optimizer_state`)
RESUME_WITHOUT_OPTIMIZER = "TRL_TREE_RESUME_WITHOUT_OPTIMIZER"
FORMAT_VERSION = 1
STATE_KEYS = ("version", "step", "layout", "buffered_inputs", "sampler")

# What shapes a saved generation batch besides the chosen components' own fields (`methods.fields_read`): how it is
# split into micro-batches and optimizer blocks, how many trajectories a tree holds, and what its rewards, π_old
# (computed at `temperature`) and truncation masks were computed with.
BATCH_FIELDS = (
    "sampler", "credit", "loss", "per_device_train_batch_size", "generation_batch_size", "steps_per_generation",
    "gradient_accumulation_steps", "num_generations", "num_iterations", "max_turns", "max_completion_length",
    "max_turn_tokens", "temperature", "reward_weights", "multi_objective_aggregation", "mask_truncated_completions",
)


def state_file(checkpoint_dir: str, rank: int) -> str:
    return os.path.join(checkpoint_dir, STATE_FILE.format(rank=rank))


# ------------------------------------------------------------------------------------------------- sampler state


def random_generators(obj) -> dict[str, Any]:
    """The random generators `obj` holds as attributes, by attribute name."""
    kinds = (random.Random, torch.Generator, np.random.Generator, np.random.RandomState)
    return {name: value for name, value in sorted(getattr(obj, "__dict__", {}).items()) if isinstance(value, kinds)}


def _generator_state(generator) -> Any:
    if isinstance(generator, random.Random):
        return generator.getstate()
    if isinstance(generator, torch.Generator):
        return generator.get_state()
    if isinstance(generator, np.random.Generator):
        return generator.bit_generator.state
    return generator.get_state()  # np.random.RandomState


def _set_generator_state(generator, state) -> None:
    if isinstance(generator, random.Random):
        generator.setstate(state)
    elif isinstance(generator, torch.Generator):
        generator.set_state(state)
    elif isinstance(generator, np.random.Generator):
        generator.bit_generator.state = state
    else:
        generator.set_state(state)


def sampler_state(sampler) -> dict[str, Any]:
    """What the sampler needs to draw exactly what an uninterrupted run would draw next."""
    if callable(getattr(sampler, "state_dict", None)):
        return {"state_dict": sampler.state_dict()}
    return {"generators": {name: _generator_state(g) for name, g in random_generators(sampler).items()}}


def load_sampler_state(sampler, state: dict[str, Any]) -> None:
    """Inverse of `sampler_state`; a checkpoint of another sampler configuration is an error that says so."""
    name = type(sampler).__name__
    if "state_dict" in state:
        if not callable(getattr(sampler, "load_state_dict", None)):
            raise ValueError(
                f"The checkpoint holds a state_dict() of the sampler, but {name} has no load_state_dict(state): give "
                "the sampler (harness) both methods, or resume with the sampler the checkpoint was saved with."
            )
        sampler.load_state_dict(state["state_dict"])
        return
    generators = random_generators(sampler)
    saved = state["generators"]
    if set(saved) != set(generators):
        raise ValueError(
            f"The checkpoint's sampler state has random generators {sorted(saved)}, but this trainer's sampler ({name})"
            f" has {sorted(generators)}: resume with the sampler configuration the checkpoint was saved with."
        )
    for attribute, generator in generators.items():
        _set_generator_state(generator, saved[attribute])


# ------------------------------------------------------------------------------------------------- trainer state


def _layout(trainer) -> dict[str, Any]:
    """What must match for a saved buffer to be the resumed run's: the trainer that built it, its micro-batches per
    process and their order, and every config field that shapes its trees, rewards, π_old and credit. The fields are
    the method table's (so a new sampler, credit or loss field is recorded without being listed here) and
    `BATCH_FIELDS`. A loss field that only `compute` reads (ε) is recorded too: the table does not say which of a
    loss's fields its `prepare` reads, and a needless regeneration costs one batch, a missed one trains on wrong
    credit."""
    args = trainer.args
    layout = {"trainer": type(trainer).__name__, "num_processes": trainer.accelerator.num_processes}
    for name in (*BATCH_FIELDS, *methods.fields_read(args)):
        layout.setdefault(name, _plain(getattr(args, name, None)))
    return layout


def _plain(value):
    """A config value as `torch.load(weights_only=True)` reads it back and `==` compares it."""
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    return repr(value)


def _layout_changes(saved: dict[str, Any], current: dict[str, Any]) -> str | None:
    """Why a buffer saved with `saved` is not this run's (every difference, old → new), or None when it is."""
    def value(layout, name, absent):
        return repr(layout[name]) if name in layout else absent

    changed = [
        f"{name}: {value(saved, name, '(not recorded)')} → {value(current, name, '(not read by this run)')}"
        for name in dict.fromkeys([*saved, *current])
        if name != "trainer" and saved.get(name, _MISSING) != current.get(name, _MISSING)
    ]
    old, new = saved.get("trainer"), current["trainer"]
    writer = old or "a trl-tree that did not record its trainer"
    other_trainer = f"it was written by {writer} and is resumed by {new}" if old != new else ""
    if not changed:
        return other_trainer or None
    fields = "what shapes its saved generation batch and credit differs: " + ", ".join(changed)
    return f"{other_trainer}; {fields}" if other_trainer else fields


_MISSING = object()


def _generates_next(trainer) -> bool:
    """Whether the next training step starts a new generation batch (so the buffer need not be kept)."""
    return trl_internals.micro_step(trainer) % (trainer.args.steps_per_generation * trainer.num_iterations) == 0


def _to_device(value, device):
    if isinstance(value, torch.Tensor):
        return value.to(device)
    if isinstance(value, dict):
        return {k: _to_device(v, device) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return type(value)(_to_device(v, device) for v in value)
    return value


def save_state(trainer, output_dir: str) -> None:
    """Write this process's resume state into the checkpoint folder `output_dir`."""
    buffered = None if _generates_next(trainer) else _to_device(trl_internals.buffered_inputs(trainer), "cpu")
    rollouts = getattr(trainer, "_async_rollouts", None)
    state = {
        "version": FORMAT_VERSION,
        "step": trl_internals.micro_step(trainer),
        "layout": _layout(trainer),
        "buffered_inputs": buffered,
        "sampler": sampler_state(trainer.sampler),  # with a rollout worker: evaluation's (training's is the worker's)
        "rollouts": rollouts.checkpoint_state() if rollouts is not None else None,
    }
    os.makedirs(output_dir, exist_ok=True)  # another process may not have created the folder yet
    # written under a temporary name and renamed: a crash mid-write (the buffer can be large) leaves no file that
    # looks like a state file, so `last_complete_checkpoint` sees the checkpoint as partial
    path = state_file(output_dir, trainer.accelerator.process_index)
    torch.save(state, path + ".tmp")
    os.replace(path + ".tmp", path)


def restore_state(trainer, checkpoint_dir: str) -> None:
    """Restore this process's resume state from `checkpoint_dir`, or resume at the next generation batch (with a
    warning) when the checkpoint has none that fits this run.

    The choice is the same on every process: one rank training from its restored buffer while another generates
    would leave the generation collectives waiting for each other."""
    path = state_file(checkpoint_dir, trainer.accelerator.process_index)
    state, reason = _read_state(path), None
    if state is None:
        reason = f"it has no {os.path.basename(path)} (saved by an older trl-tree, or with save_only_model=True)"
    else:
        reason = _layout_changes(state["layout"], _layout(trainer))
    if not _on_every_process(trainer, reason is None):
        _resume_without_state(trainer, checkpoint_dir, reason or "another process cannot restore its resume state")
        return
    load_sampler_state(trainer.sampler, state["sampler"])
    trl_internals.set_micro_step(trainer, state["step"])
    trl_internals.set_buffered_inputs(trainer, _to_device(state["buffered_inputs"], trainer.accelerator.device))
    saved_rollouts, rollouts = state.get("rollouts"), getattr(trainer, "_async_rollouts", None)
    if rollouts is not None:  # the worker regenerates what was in flight, as the uninterrupted run grew it
        rollouts.restore(saved_rollouts, state["sampler"])
    elif saved_rollouts is not None:  # an asynchronous run's checkpoint resumed synchronously: its training stream
        load_sampler_state(trainer.sampler, saved_rollouts["sampler"])
        if saved_rollouts["random"] is not None:
            random_state.restore(saved_rollouts["random"])


def _read_state(path: str) -> dict | None:
    if not os.path.isfile(path):
        return None
    with safe_globals():
        check_torch_load_is_safe()
        try:
            state = torch.load(path, weights_only=True)
        except Exception as error:
            raise RuntimeError(
                f"Could not read the trl-tree resume state {path} ({type(error).__name__}: {error}). Delete the file "
                "to resume from this checkpoint at the next generation batch instead of exactly."
            ) from error
    if not isinstance(state, dict):
        raise ValueError(
            f"{path} holds a {type(state).__name__}, not a trl-tree resume state (a dict of {list(STATE_KEYS)}). "
            "Delete the file to resume from this checkpoint at the next generation batch instead of exactly."
        )
    if state.get("version") != FORMAT_VERSION:
        raise ValueError(
            f"{path} has resume-state format {state.get('version')!r}; this trl-tree reads format {FORMAT_VERSION}. "
            "Resume with the trl-tree version that saved it, or delete the file to resume at the next generation batch."
        )
    missing = [key for key in STATE_KEYS if key not in state]
    if missing:
        raise ValueError(
            f"{path} lacks {missing} of the trl-tree resume state (format {FORMAT_VERSION} has "
            f"{list(STATE_KEYS)}): it was not written whole by trl-tree. Delete the file to resume from this checkpoint "
            "at the next generation batch instead of exactly."
        )
    return state


def _on_every_process(trainer, flag: bool) -> bool:
    if trainer.accelerator.num_processes == 1:
        return flag
    count = torch.tensor([float(flag)], device=trainer.accelerator.device)
    return int(trainer.accelerator.reduce(count, reduction="sum").item()) == trainer.accelerator.num_processes


def _resume_without_state(trainer, checkpoint_dir: str, reason: str) -> None:
    """Keep the uninterrupted run's block order (`_step` counts micro-batches, as it would have), and say what is not
    exact: the sampler's generators restart from their seeds, and an interrupted generation batch is generated anew."""
    step = trainer.state.global_step
    trl_internals.set_micro_step(trainer, step * trainer.args.gradient_accumulation_steps)
    trl_internals.set_buffered_inputs(trainer, None)
    args = trainer.args
    left = (-trl_internals.micro_step(trainer)) % args.steps_per_generation // args.gradient_accumulation_steps
    if left:
        how = (
            f"the generation batch interrupted at step {step} is generated anew (new trees for the same prompts) for "
            f"its remaining {left} optimizer block(s), and the sampler's random generators restart from their seeds. "
            "Later generation batches keep the uninterrupted run's block order."
        )
    else:
        how = "training resumes at the next generation batch, but the sampler's random generators restart from their seeds."
    logger.warning("Checkpoint %s cannot be resumed exactly: %s. So %s", checkpoint_dir, reason, how)


# ------------------------------------------------------------------------------------------------- which checkpoint

_CHECKPOINT = re.compile(rf"^{PREFIX_CHECKPOINT_DIR}-(\d+)$")  # transformers' own pattern (`get_last_checkpoint`)
_RNG_STATE = re.compile(r"^rng_state(?:_(\d+))?\.pth$")  # transformers' per-process (or single-process) RNG file
_WEIGHTS = (SAFE_WEIGHTS_NAME, WEIGHTS_NAME, SAFE_WEIGHTS_INDEX_NAME, WEIGHTS_INDEX_NAME, ADAPTER_SAFE_WEIGHTS_NAME,
            ADAPTER_WEIGHTS_NAME)


def checkpoint_to_resume(resume_from_checkpoint, output_dir: str):
    """What `TreeTrainer.train` hands transformers: `True` becomes the newest *complete* checkpoint
    (`last_complete_checkpoint`; transformers takes the newest folder, which a crash during a save leaves partial, and
    then fails on it); a checkpoint given by path with a file cut short is an error naming the file before anything
    loads (`check_checkpoint`); either without its optimizer state is refused unless told (`check_optimizer_state`);
    anything else passes through."""
    if resume_from_checkpoint is True:
        checkpoint = last_complete_checkpoint(output_dir)
    elif isinstance(resume_from_checkpoint, str | os.PathLike):
        checkpoint = os.fspath(resume_from_checkpoint)
        check_checkpoint(checkpoint)  # before transformers loads the weights
    else:
        return resume_from_checkpoint
    check_optimizer_state(checkpoint)
    return checkpoint


def last_complete_checkpoint(output_dir: str) -> str:
    """The newest `checkpoint-N` folder of `output_dir` that holds everything a resume reads (`missing_parts`), for
    `resume_from_checkpoint=True`. transformers takes the newest folder, and a crash during a save leaves that one
    partial, so the resume fails on it; the older complete one is what the run can continue from. Skipped folders
    are logged with what each lacks; with no complete one, the error lists every folder found and why."""
    names = os.listdir(output_dir) if os.path.isdir(output_dir) else []
    found = sorted(
        (int(m.group(1)), name) for name in names
        if (m := _CHECKPOINT.match(name)) and os.path.isdir(os.path.join(output_dir, name))
    )
    skipped = []
    for _, name in reversed(found):
        path = os.path.join(output_dir, name)
        missing = missing_parts(path)
        if not missing:
            if skipped:
                logger.warning(
                    "resume_from_checkpoint=True: resuming from %s, the newest complete checkpoint, and skipping the "
                    "newer partial one(s) (a save interrupted?): %s", path, "; ".join(skipped),
                )
            return path
        skipped.append(f"{name} ({', '.join(missing)})")
    if not found:
        raise ValueError(
            f"resume_from_checkpoint=True, but {output_dir} has no {PREFIX_CHECKPOINT_DIR}-N folder to resume from: "
            "check output_dir, or train without resume_from_checkpoint."
        )
    raise ValueError(
        f"resume_from_checkpoint=True, but {output_dir} has no complete checkpoint: " + "; ".join(skipped) + ". Each "
        "was left partial by an interrupted save (or its files were removed). Pass a checkpoint folder you know to be "
        "usable as resume_from_checkpoint, or train without it to start over."
    )


def check_trainer_state(checkpoint_dir: str) -> None:
    """A checkpoint given by path whose `trainer_state.json` is not valid JSON is an error naming the file and an
    earlier checkpoint to resume from, raised before anything loads.

    transformers loads the model weights (and optimizer) first and the trainer state later, so a state file cut short
    by an interrupted save surfaced as a bare `JSONDecodeError` after the weights had loaded. (A missing file is
    transformers' to judge: it resumes the weights without the trainer state. `resume_from_checkpoint=True` skips
    such a folder, `last_complete_checkpoint`.)"""
    path = os.path.join(checkpoint_dir, TRAINER_STATE_NAME)
    if not os.path.isfile(path):
        return
    try:
        with open(path) as f:
            json.load(f)
    except (OSError, ValueError) as error:
        raise ValueError(
            f"resume_from_checkpoint: {path} cannot be read ({type(error).__name__}: {error}): the save that wrote "
            "it was interrupted, so this checkpoint cannot be resumed; nothing was loaded. Resume from an earlier "
            f"checkpoint{_earlier_complete(checkpoint_dir)}, or pass resume_from_checkpoint=True, which takes the "
            "newest complete one."
        ) from error


def check_checkpoint(checkpoint_dir: str) -> None:
    """Every file of `checkpoint_dir` that a resume reads, checked before anything loads: the trainer state
    (`check_trainer_state`), then every weights, optimizer, scheduler, scaler, RNG and trl-tree state file
    (`cut_files`). A file cut short is an error naming it, the checkpoint and the newest complete earlier one.

    transformers loads the weights first, then the optimizer and scheduler, the trainer state and, at the first step,
    the RNG states, with torch errors that name no file (a cut `rng_state.pth`: `OSError: [Errno 22] Invalid
    argument`, after the weights had loaded). What is checked is the files' structure (a torch.save zip's central
    directory, a safetensors header and its data's length), read from their ends in microseconds: a file an
    interrupted save left short, not one damaged inside (whose torch error then stands)."""
    check_trainer_state(checkpoint_dir)
    if not os.path.isdir(checkpoint_dir):
        return  # transformers' own error: "Can't find a valid checkpoint at ..."
    broken = cut_files(checkpoint_dir)
    if broken:
        files = "; ".join(f"{os.path.join(checkpoint_dir, name)} {problem}" for name, problem in broken)
        raise ValueError(
            f"resume_from_checkpoint: {files}: the save that wrote it was interrupted (or the file was damaged since), "
            f"so checkpoint {checkpoint_dir} cannot be resumed; nothing was loaded. Resume from an earlier "
            f"checkpoint{_earlier_complete(checkpoint_dir)}, or pass resume_from_checkpoint=True, which takes the "
            "newest complete one."
        )


def check_optimizer_state(checkpoint_dir: str) -> None:
    """A checkpoint without its optimizer state (`save_only_model=True`, or the files removed) is refused unless
    `TRL_TREE_RESUME_WITHOUT_OPTIMIZER=1`: transformers loads the optimizer and scheduler only when both files are
    there and otherwise resumes the weights with fresh ones (AdamW's moments from zero, the schedule from its start),
    without a word, so the run would not continue as the uninterrupted one. With the variable set, it resumes so and
    says it."""
    missing = missing_optimizer_state(checkpoint_dir)
    if not missing:
        return
    what = (
        f"{checkpoint_dir} has no {' and no '.join(missing)} (saved with save_only_model=True, or the files were "
        "removed): transformers would resume its weights with a fresh optimizer and learning-rate schedule (the "
        "optimizer's moments from zero, the schedule from its start), so the run would not continue as it would have"
    )
    if os.environ.get(RESUME_WITHOUT_OPTIMIZER, "").strip().lower() in ("1", "true", "yes", "on"):
        logger.warning("resume_from_checkpoint: %s. Resuming so, as %s=1 asks.", what, RESUME_WITHOUT_OPTIMIZER)
        return
    raise ValueError(
        f"resume_from_checkpoint: {what}; nothing was loaded. Resume from a checkpoint with its optimizer state"
        f"{_earlier_complete(checkpoint_dir, with_optimizer=True)}, or set {RESUME_WITHOUT_OPTIMIZER}=1 to resume "
        "from this one with a fresh optimizer and schedule."
    )


def missing_optimizer_state(checkpoint_dir: str) -> list[str]:
    """Which of the optimizer and scheduler files transformers' `_load_optimizer_and_scheduler` needs are missing
    (both, or it loads neither); none for DeepSpeed's layout (a `global_step*` folder holds the optimizer, which its
    loader checks) or a folder that is not there (transformers' error)."""
    if not os.path.isdir(checkpoint_dir):
        return []
    files = set(os.listdir(checkpoint_dir))
    folders = [name for name in files if os.path.isdir(os.path.join(checkpoint_dir, name))]
    if any(name.startswith("global_step") for name in folders):
        return []
    # transformers' own test: optimizer.pt, optimizer.bin, or a folder named for the optimizer (FSDP's sharded state)
    has_optimizer = OPTIMIZER_NAME in files or OPTIMIZER_NAME_BIN in files or any("optimizer" in n for n in folders)
    return [name for name, present in ((OPTIMIZER_NAME, has_optimizer), (SCHEDULER_NAME, SCHEDULER_NAME in files))
            if not present]


# The files a resume reads with torch.load (weights in the .bin layouts too), all torch.save zip archives
_TORCH_FILE = re.compile(
    r"^(?:optimizer\.pt|scheduler\.pt|scaler\.pt|rng_state(?:_\d+)?\.pth|trl_tree_state_\d+\.pth"
    r"|pytorch_model(?:-\d+-of-\d+)?\.bin|adapter_model\.bin)$"
)


def cut_files(checkpoint_dir: str) -> list[tuple[str, str]]:
    """(name, what is wrong) for each file of `checkpoint_dir` that a resume reads and a save left cut short."""
    broken = []
    for name in sorted(os.listdir(checkpoint_dir)):
        path = os.path.join(checkpoint_dir, name)
        if not os.path.isfile(path):
            continue
        if _TORCH_FILE.match(name):
            problem = _torch_file_problem(path)
        elif name.endswith(".safetensors"):
            problem = _safetensors_problem(path)
        else:
            continue
        if problem is not None:
            broken.append((name, problem))
    return broken


def _torch_file_problem(path: str) -> str | None:
    """Why the torch.save file `path` cannot be whole: a zip archive (torch ≥ 1.6) is read from its end, where its
    central directory is written last, so a cut one has none. Legacy (pickle) files are left to torch."""
    size = os.path.getsize(path)
    with open(path, "rb") as f:
        head = f.read(2)
    if head[:1] == b"\x80":  # the legacy format: a pickle, which no cheap check reads
        return None
    if head != b"PK":
        return f"is cut short ({size} bytes; not a torch.save file)"
    try:
        with zipfile.ZipFile(path):
            return None
    except (zipfile.BadZipFile, OSError, ValueError):
        return f"is cut short ({size} bytes; not a complete torch.save file)"


def _safetensors_problem(path: str) -> str | None:
    """Why the safetensors file `path` cannot be whole: its header (8 bytes of length, then JSON) gives every tensor's
    byte range, so the file's length must reach the last one."""
    size = os.path.getsize(path)
    with open(path, "rb") as f:
        raw = f.read(8)
        length = int.from_bytes(raw, "little") if len(raw) == 8 else None
        if length is None or 8 + length > size:
            return f"is cut short ({size} bytes; its header is incomplete)"
        try:
            header = json.loads(f.read(length))
            end = max((v["data_offsets"][1] for k, v in header.items() if k != "__metadata__"), default=0)
        except (ValueError, TypeError, KeyError, IndexError, AttributeError):
            return "has an unreadable header (not a safetensors file)"
    if 8 + length + end > size:
        return f"is cut short ({size} of {8 + length + end} bytes)"
    return None


def _earlier_complete(checkpoint_dir: str, with_optimizer: bool = False) -> str:
    """' (the newest complete one is PATH)' for the checkpoints beside `checkpoint_dir` older than it (that hold their
    optimizer state too, `with_optimizer`), else ''."""
    parent, name = os.path.split(os.path.normpath(checkpoint_dir))
    own = _CHECKPOINT.match(name)
    if own is None or not os.path.isdir(parent):
        return ""
    older = sorted(
        (int(m.group(1)), other) for other in os.listdir(parent)
        if (m := _CHECKPOINT.match(other)) and int(m.group(1)) < int(own.group(1))
        and os.path.isdir(os.path.join(parent, other))
    )
    which = " with its optimizer state" if with_optimizer else ""
    for _, other in reversed(older):
        path = os.path.join(parent, other)
        if not missing_parts(path) and not (with_optimizer and missing_optimizer_state(path)):
            return f" (the newest complete one{which} is {path})"
    return f" (none complete{which} is left in {parent})" if older else ""


def missing_parts(checkpoint_dir: str) -> list[str]:
    """What `checkpoint_dir` lacks of a checkpoint a resume can read: transformers' trainer state (written last, by
    the main process), the model weights in any layout transformers loads (safetensors or bin, sharded, adapter,
    FSDP, DeepSpeed), and trl-tree's state file of every process whose RNG state was saved (none with
    `save_only_model`), each of the files resume reads whole (`cut_files`). A process whose save had not begun when
    the run stopped leaves no trace to check; its restore then falls back to resuming at the next generation batch
    (`restore_state`). The optimizer state is not a part here: a checkpoint without it was saved so
    (`save_only_model`), not cut by a crash (`check_optimizer_state`)."""
    files = set(os.listdir(checkpoint_dir))
    missing = []
    trainer_state = os.path.join(checkpoint_dir, TRAINER_STATE_NAME)
    if TRAINER_STATE_NAME not in files:
        missing.append(f"no {TRAINER_STATE_NAME}")
    else:
        try:
            with open(trainer_state) as f:
                json.load(f)
        except (OSError, ValueError):
            missing.append(f"{TRAINER_STATE_NAME} cut short (not valid JSON)")
    weights = _missing_weights(checkpoint_dir, files)
    if weights:
        missing.append(weights)
    ranks = sorted(int(m.group(1) or 0) for name in files if (m := _RNG_STATE.match(name)))
    for rank in ranks:
        name = STATE_FILE.format(rank=rank)
        if name not in files:
            missing.append(f"no {name}, which is saved after the RNG state (an older trl-tree saved none: pass such a "
                           "checkpoint's path to resume from it at the next generation batch)")
    missing.extend(f"{name} {problem}" for name, problem in cut_files(checkpoint_dir))
    return missing


def _missing_weights(checkpoint_dir: str, files: set[str]) -> str | None:
    """What is missing of the model weights, in the layouts transformers' `_load_from_checkpoint` accepts."""
    folders = [name for name in files if os.path.isdir(os.path.join(checkpoint_dir, name))]
    if any(FSDP_MODEL_NAME in name for name in files) or any(name.startswith("global_step") for name in folders):
        return None  # FSDP's and DeepSpeed's own layouts, which their loaders check
    adapters = {ADAPTER_SAFE_WEIGHTS_NAME, ADAPTER_WEIGHTS_NAME}
    if any(adapters & set(os.listdir(os.path.join(checkpoint_dir, name))) for name in folders):
        return None  # several PEFT adapters, one folder each
    present = [name for name in _WEIGHTS if name in files]
    if not present:
        return f"no model weights ({' or '.join(_WEIGHTS)})"
    for index in (SAFE_WEIGHTS_INDEX_NAME, WEIGHTS_INDEX_NAME):
        if index in present:
            try:
                with open(os.path.join(checkpoint_dir, index)) as f:
                    shards = set(json.load(f)["weight_map"].values())
            except (OSError, ValueError, KeyError, AttributeError):
                return f"{index} cut short (no weight_map)"
            if shards - files:
                return f"model weight shard(s) {sorted(shards - files)} of {index} missing"
    return None


class TrainBatchSizeInState(TrainerCallback):
    """Writes into the trainer state what transformers means by its `train_batch_size`: the per-device batch size
    of the arguments (× GPUs of DataParallel), the number that `compare_trainer_and_checkpoint_args` checks a resumed
    run's arguments against.

    A tree trainer's dataloader batches prompts (`trees_per_micro_batch`: per_device_train_batch_size / G), so the
    `_train_batch_size` it sets, which transformers copies into the state, is that count of trees; every resume with
    unchanged arguments then warned "per_device_train_batch_size: 8 (from args) != 2 (from trainer_state.json)"
    (issue 59). Set at the start of training, after a resumed state was compared, so every checkpoint saves it."""

    def on_train_begin(self, args, state, control, **kwargs):
        state.train_batch_size = args.per_device_train_batch_size * max(1, args.n_gpu)
