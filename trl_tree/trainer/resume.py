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
"""

from __future__ import annotations

import logging
import os
import random
from typing import Any

import numpy as np
import torch
from transformers.trainer_pt_utils import safe_globals
from transformers.utils.import_utils import check_torch_load_is_safe

from .. import trl_internals

logger = logging.getLogger(__name__)

STATE_FILE = "trl_tree_state_{rank}.pth"
FORMAT_VERSION = 1


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


def _layout(trainer) -> dict[str, int]:
    """What must match for a saved buffer to be the resumed run's: its micro-batches per process and their order."""
    return {
        "num_processes": trainer.accelerator.num_processes,
        "steps_per_generation": trainer.args.steps_per_generation,
        "gradient_accumulation_steps": trainer.args.gradient_accumulation_steps,
    }


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
    torch.save(state, state_file(output_dir, trainer.accelerator.process_index))


def restore_state(trainer, checkpoint_dir: str) -> None:
    """Restore this process's resume state from `checkpoint_dir`, or resume at the next generation batch (with a
    warning) when the checkpoint has none that fits this run.

    The choice is the same on every process: one rank training from its restored buffer while another generates
    would leave the generation collectives waiting for each other."""
    path = state_file(checkpoint_dir, trainer.accelerator.process_index)
    state, reason = _read_state(path), None
    if state is None:
        reason = f"it has no {os.path.basename(path)} (saved by an older trl-tree, or with save_only_model=True)"
    elif state["layout"] != _layout(trainer):
        reason = f"it was saved with {state['layout']}, and this run has {_layout(trainer)}"
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
    if state.get("version") != FORMAT_VERSION:
        raise ValueError(
            f"{path} has resume-state format {state.get('version')!r}; this trl-tree reads format {FORMAT_VERSION}. "
            "Resume with the trl-tree version that saved it, or delete the file to resume at the next generation batch."
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
