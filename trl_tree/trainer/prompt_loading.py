"""GRPOTrainer's prompt loading with one row per tree (docs/design.md §2).

GRPO's loaders repeat each prompt G times (a group of G completions; `per_device_*_batch_size` counts completions).
A tree is the prompt's whole group, so the tree trainers draw each prompt once, with GRPO's own sampler, shuffling and
repetition over `steps_per_generation`; evaluation batches, which GRPO's loader still repeats, keep one row per group.
The trainer's overrides (`_get_train_sampler`, `get_train_dataloader`, `_one_row_per_prompt`) call these.
"""

from __future__ import annotations

from typing import Any

from datasets import IterableDataset
from trl.trainer.utils import RepeatSampler, repeat_iterable_dataset

from .. import trl_internals


def prompt_sampler(trainer, dataset) -> RepeatSampler:
    """GRPO's sampler, drawing each prompt once: the tree is the prompt's whole group."""
    return RepeatSampler(
        data_source=dataset,
        mini_repeat_count=1,
        batch_size=trainer.args.prompts_per_generation,
        repeat_count=trainer.num_iterations * trainer.args.steps_per_generation,
        shuffle=trainer.shuffle_dataset,
        seed=trainer.args.seed,
    )


def prompt_dataloader(trainer, sampler_fn):
    """GRPOTrainer's loader (a generation batch per step) without its G copies of each prompt; a streaming dataset
    is shuffled and repeated as GRPO repeats it, once per prompt. `sampler_fn` is the trainer's `_get_train_sampler`."""
    dataset, args = trainer.train_dataset, trainer.args
    if isinstance(dataset, IterableDataset):
        if trainer.shuffle_dataset:
            dataset = dataset.shuffle(seed=args.seed)
        dataset = repeat_iterable_dataset(
            dataset, mini_repeat_count=1, batch_size=args.prompts_per_generation,
            repeat_count=trainer.num_iterations * args.steps_per_generation,
        )
    return trl_internals.get_dataloader(
        trainer,
        dataset=dataset, description="Training",
        batch_size=trl_internals.train_batch_size(trainer) * args.steps_per_generation,
        sampler_fn=sampler_fn, is_training=True,
    )


def one_row_per_prompt(batch: list[dict[str, Any]], num_generations: int) -> list[dict[str, Any]]:
    """GRPO's evaluation loader repeats each prompt G times in a row (per_device_eval_batch_size counts
    completions, as in training); a tree is the prompt's whole group, so keep one row of each group."""
    if len(batch) % num_generations != 0:
        raise ValueError(
            f"An evaluation batch of {len(batch)} rows does not hold whole groups of num_generations "
            f"({num_generations}) copies of its prompts: make per_device_eval_batch_size a multiple of num_generations."
        )
    return batch[::num_generations]
