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

Both are written to `trl_tree_state_{process_index}.pth` in the checkpoint folder by the trainer's `_save_rng_state`
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
folder, even one a crash during the save left without its trainer state, and then fails on it.
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
from transformers.trainer import FSDP_MODEL_NAME, TRAINER_STATE_NAME
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

logger = logging.getLogger(__name__)

STATE_FILE = "trl_tree_state_{rank}.pth"
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
    state = {
        "version": FORMAT_VERSION,
        "step": trl_internals.micro_step(trainer),
        "layout": _layout(trainer),
        "buffered_inputs": buffered,
        "sampler": sampler_state(trainer.sampler),
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
    then fails on it); a checkpoint given by path whose trainer state is cut short is an error naming the file before
    anything loads (`check_trainer_state`); anything else passes through."""
    if resume_from_checkpoint is True:
        return last_complete_checkpoint(output_dir)
    if isinstance(resume_from_checkpoint, str | os.PathLike):
        check_trainer_state(os.fspath(resume_from_checkpoint))  # before transformers loads the weights
    return resume_from_checkpoint


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


def _earlier_complete(checkpoint_dir: str) -> str:
    """' (the newest complete one is PATH)' for the checkpoints beside `checkpoint_dir` older than it, else ''."""
    parent, name = os.path.split(os.path.normpath(checkpoint_dir))
    own = _CHECKPOINT.match(name)
    if own is None or not os.path.isdir(parent):
        return ""
    older = sorted(
        (int(m.group(1)), other) for other in os.listdir(parent)
        if (m := _CHECKPOINT.match(other)) and int(m.group(1)) < int(own.group(1))
        and os.path.isdir(os.path.join(parent, other))
    )
    for _, other in reversed(older):
        if not missing_parts(os.path.join(parent, other)):
            return f" (the newest complete one is {os.path.join(parent, other)})"
    return f" (none complete is left in {parent})" if older else ""


def missing_parts(checkpoint_dir: str) -> list[str]:
    """What `checkpoint_dir` lacks of a checkpoint a resume can read: transformers' trainer state (written last, by
    the main process), the model weights in any layout transformers loads (safetensors or bin, sharded, adapter,
    FSDP, DeepSpeed), and trl-tree's state file of every process whose RNG state was saved (none with
    `save_only_model`). A process whose save had not begun when the run stopped leaves no trace to check; its restore
    then falls back to resuming at the next generation batch (`restore_state`)."""
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
        elif not zipfile.is_zipfile(os.path.join(checkpoint_dir, name)):
            missing.append(f"{name} cut short (not a complete torch.save file)")
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
