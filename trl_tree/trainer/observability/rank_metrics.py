"""Rank reductions and the metric logging every tree trainer shares (`TreeTrainer`, `TreeFlexTrainer`).

Each process holds its own trees (or TreeFlex groups), and samplers may give processes different numbers of leaves,
turns or searches, so every reduction here accepts a different count per rank. Every rank must call the same
reductions in the same order (they are collectives); values are logged into TRL's `_metrics[mode]` lists. Code that
runs for its rank alone, out of step with the others (the rollout worker's thread), passes `RankAlone` instead of the
accelerator: every reduction is then over this rank only, and the caller's thread reduces later, in step.
"""

from __future__ import annotations

import dataclasses

import torch

from ...core import losses
from ...methods import ClipCounts, Largest


@dataclasses.dataclass(frozen=True)
class RankAlone:
    """The accelerator's reduction interface over this rank alone: what the rank reductions below read of an
    accelerator (`num_processes`, `process_index`, `device`, `reduce`), for a thread that must not meet the other
    ranks' collectives."""

    device: torch.device
    num_processes: int = 1
    process_index: int = 0

    def reduce(self, tensor: torch.Tensor, reduction: str = "sum") -> torch.Tensor:
        return tensor


def gather_objects(accelerator, values: list) -> list:
    """Every rank's list, concatenated in rank order (accelerate's `gather_object`)."""
    if accelerator.num_processes == 1:
        return list(values)
    from accelerate.utils import gather_object

    return gather_object(list(values))


def flush_logs_over_ranks(accelerator, pending_metrics: dict, pending_extra: dict, num_rows: int, metrics: dict,
                          extra: dict) -> None:
    """What reward functions passed to TRL's `log_metric` / `log_extra` (`pending_metrics`: name -> values,
    `pending_extra`: column -> one value per row), flushed as GRPOTrainer's generation step flushes them: each metric
    the mean of every rank's values into `metrics`, each column every rank's first `num_rows` values (None where a
    rank logged none) into `extra`. Names are sorted so every rank gathers them in one order; both dicts are emptied."""
    for column in sorted(set(gather_objects(accelerator, list(pending_extra)))):
        values = pending_extra.get(column, [None] * num_rows)[:num_rows]
        extra[column].extend(gather_objects(accelerator, values))
    pending_extra.clear()
    for name in sorted(set(gather_objects(accelerator, list(pending_metrics)))):
        metrics[name].append(mean_over_ranks(accelerator, pending_metrics.get(name, [])))
    pending_metrics.clear()


def max_over_ranks(accelerator, value: int) -> int:
    if accelerator.num_processes == 1:
        return value
    t = torch.tensor([value], device=accelerator.device)
    return int(accelerator.reduce(t, reduction="max").item())


def any_rank(accelerator, flag: bool) -> bool:
    if accelerator.num_processes == 1:
        return flag
    t = torch.tensor([1.0 if flag else 0.0], device=accelerator.device)
    return bool(accelerator.reduce(t, reduction="sum").item() > 0)


def gather_uneven(accelerator, values: torch.Tensor) -> torch.Tensor:
    """All ranks' values of a 1-D tensor whose length differs by rank (padded with NaN, which is dropped)."""
    values = values.float().to(accelerator.device)
    if accelerator.num_processes == 1:
        return values
    padded = accelerator.pad_across_processes(values, dim=0, pad_index=float("nan"))
    gathered = accelerator.gather(padded)
    return gathered[~torch.isnan(gathered)]


def mean_over_ranks(accelerator, values: list[float] | torch.Tensor) -> float:
    """The mean of every rank's values (each rank may hold a different number; none at all counts as 0)."""
    values = torch.as_tensor(values, dtype=torch.float64, device=accelerator.device)
    t = torch.stack([values.sum(), values.new_tensor(float(values.numel()))])
    total = accelerator.reduce(t, reduction="sum")
    return (total[0] / total[1].clamp(min=1)).item()


def log_clip_ratio(metrics, accelerator, path_counts: torch.Tensor) -> None:
    """GRPO's `clip_ratio/*` over every rank's root-to-leaf paths (`losses.clip_ratio_summary`)."""
    gathered = gather_uneven(accelerator, path_counts.reshape(-1))
    for key, value in losses.clip_ratio_summary(gathered).items():
        metrics[f"clip_ratio/{key}"].append(value)


def log_values(metrics, accelerator, values: dict, block: int | None = None) -> None:
    """A loss's or a credit's metrics (`trl_tree.methods.Loss`): a tensor is averaged over every rank's elements,
    `Largest` is their maximum (NaN when no rank has one), `ClipCounts` become GRPO's `clip_ratio/*`; "{block}" in a
    name is the optimizer block."""
    for name, value in values.items():
        if isinstance(value, ClipCounts):
            log_clip_ratio(metrics, accelerator, value.counts)
        elif isinstance(value, Largest):
            gathered = gather_uneven(accelerator, value.values.detach().reshape(-1))
            metrics[name.format(block=block)].append(gathered.max().item() if gathered.numel() else float("nan"))
        else:
            metrics[name.format(block=block)].append(mean_over_ranks(accelerator, value.detach().reshape(-1)))
