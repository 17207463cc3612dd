"""The reward computation of the tree trainers: TRL's reward functions on every leaf (docs/design.md §2).

A collaborator of `TreeTrainer` (`LeafScorer`, built with what it reads), behind the pipeline's `score` port. GRPOTrainer scores completions inside the generation step the
tree trainers replace; here a completion is a leaf (a tree's trajectory; TreeFlex: a complete search), scored by
TRL's own `_calculate_rewards` (through `trl_internals`) so reward functions see what they see under GRPOTrainer.
Three things differ and live here: ranks may hold different numbers of leaves, which TRL's gather cannot take (each
rank is padded and its padding dropped); the group whose rewards are aggregated and filled for unscored leaves is the
tree; and what reward functions log through TRL's callbacks is flushed as GRPOTrainer's generation step would. Its own
file so that the trainer module is the adapter from GRPOTrainer to the pipeline only.
"""

from __future__ import annotations

import dataclasses

import torch
from trl.data_utils import is_conversational
from trl.trainer.utils import nanstd

from ..core import pipeline
from ..rewards import completion_format_problem, dataset_is_conversational, guard_reward_func
from .configuration.checks import MULTI_OBJECTIVE_AGGREGATIONS
from .observability import rank_metrics as tree_metrics


def check_completion_formats(owner: str, reward_funcs, datasets: list[tuple[str, object]]) -> None:
    """Refuse, before the model loads, reward functions that read chat messages on a dataset of plain-string
    prompts (`rewards.completion_format_problem`): as under GRPOTrainer they would get plain-string completions
    and fail on the first batch. Each dataset (train, eval, a dict of evals) is judged by its first row."""
    funcs = reward_funcs if isinstance(reward_funcs, list | tuple) else [reward_funcs]
    names = [getattr(f, "__name__", type(f).__name__) for f in funcs]
    for name, dataset in datasets:
        for one in dataset.values() if isinstance(dataset, dict) else [dataset]:
            problem = completion_format_problem(funcs, names, dataset_is_conversational(one) is not False)
            if problem is not None:
                raise ValueError(f"{owner}: {name}: {problem}")


def guarded_reward_funcs(funcs: list, names: list[str]) -> list:
    """Each reward function wrapped by `rewards.guard_reward_func` (its values checked, named in errors)."""
    return [guard_reward_func(f, n) for f, n in zip(funcs, names)]


def aggregate_leaf_rewards(rewards_per_func: torch.Tensor, weights: torch.Tensor, mode: str) -> torch.Tensor:
    """One tree's leaf rewards [K] from its reward functions' outputs [K, F] (NaN: the function returned None), by
    GRPO's `multi_objective_aggregation` with the tree's K leaves as the group:

        sum_then_normalize   R_k = Σ_f w_f r_kf                                  (normalised later, over the tree)
        normalize_then_sum   R_k = Σ_f w_f (r_kf − mean_f) / (std_f + 1e-4)      mean, sample std over the K leaves

    NaNs are skipped (nanmean / nansum, as GRPO). GRPO then normalises the summed rewards over the whole batch; a tree
    standardises them over its own leaves (`leaf_advantages`) instead.
    """
    weights = weights.to(rewards_per_func)
    if mode == "sum_then_normalize":
        return (rewards_per_func * weights.unsqueeze(0)).nansum(dim=1)
    if mode == "normalize_then_sum":
        mean = torch.nanmean(rewards_per_func, dim=0, keepdim=True)
        std = nanstd(rewards_per_func, dim=0, keepdim=True) if len(rewards_per_func) > 1 else torch.zeros_like(mean)
        return ((rewards_per_func - mean) / (std + 1e-4) * weights.unsqueeze(0)).nansum(dim=1)
    raise ValueError(f"multi_objective_aggregation must be one of {MULTI_OBJECTIVE_AGGREGATIONS}; got {mode!r}.")


@dataclasses.dataclass
class LeafRows:
    """Every leaf of a batch as TRL's `_calculate_rewards` reads it, padded to the widest rank (`n` are this
    rank's own rows, `width` every rank's padded count); `envs` are the leaves' environments, which the reward
    computation gets with the rows (TRL passes them to reward functions as `environments=`)."""

    inputs: list
    prompts: list
    completions: list
    completion_ids: list
    envs: list
    n: int
    width: int


class LeafScorer:
    """Leaves scored by the reward functions; held by `TreeTrainer` as `scorer`.

    `calculate_rewards` is TRL's `_calculate_rewards` (inputs, prompts, completions, completion ids, environments →
    per function), `reward_weights` and `aggregation` GRPO's `reward_weights` and `multi_objective_aggregation`,
    `pending_logs`, `completion_logs` and `metrics` (mode → dict) TRL's buffers that reward functions' logs are
    flushed into."""

    def __init__(self, *, accelerator, calculate_rewards, reward_weights: torch.Tensor, aggregation: str,
                 pending_logs, completion_logs, metrics):
        self.accelerator = accelerator
        self._rewards_per_func = calculate_rewards
        self.reward_weights = reward_weights
        self.multi_objective_aggregation = aggregation
        self._pending_logs = pending_logs
        self._completion_logs = completion_logs
        self._metric_buffers = metrics

    def leaf_rows(self, inputs, prompts, branches_per_tree) -> LeafRows:
        """Every leaf (`trl_tree.core.pipeline.Leaf`: a branch; TreeFlex: a search) as a row: the completion is the whole
        multi-turn conversation after the prompt; dataset columns are passed through (repeated per leaf)."""
        leaf_inputs, leaf_prompts, completions, completion_ids, envs = [], [], [], [], []
        for x, prompt, branches in zip(inputs, prompts, branches_per_tree):
            for b in branches:
                leaf_inputs.append(x)
                leaf_prompts.append(prompt)
                completions.append(b.messages if is_conversational({"prompt": prompt}) else _as_text(b.messages))
                completion_ids.append(b.completion_ids)
                envs.append(b.env)
        # TRL's `_calculate_rewards` gathers every rank's rows, which needs equal counts: a sampler may give ranks
        # different numbers of leaves, so pad with repeats of the last leaf and drop their rewards afterwards.
        n = len(leaf_inputs)
        width = tree_metrics.max_over_ranks(self.accelerator, n)
        for column in (leaf_inputs, leaf_prompts, completions, completion_ids, envs):
            column.extend(column[-1:] * (width - n))
        return LeafRows(leaf_inputs, leaf_prompts, completions, completion_ids, envs, n, width)

    def score(self, rows: LeafRows, branches_per_tree, mode: str) -> pipeline.LeafScores:
        """TRL's reward functions on `rows` (with the leaves' environments, `rows.envs`), this rank's rows kept,
        with the weighted rewards and each tree's rewards for its credit."""
        per_func = self._rewards_per_func(rows.inputs, rows.prompts, rows.completions, rows.completion_ids, rows.envs)
        self._flush_reward_logs(rows.n, mode)
        start = self.accelerator.process_index * rows.width
        per_func = per_func[start : start + rows.n].cpu()
        return pipeline.LeafScores(
            per_func, self._weighted_rewards(per_func),
            self._leaf_rewards_for_credit(per_func, [len(b) for b in branches_per_tree]),
        )

    def _leaf_rewards_for_credit(self, per_func: torch.Tensor, sizes: list[int]) -> list[torch.Tensor]:
        """Each tree's leaf rewards for its credit: the reward functions combined by GRPO's
        `multi_objective_aggregation` with the tree as the group, and leaves that no function scores filled as
        `_rewards_for_credit` says."""
        unscored = torch.isnan(per_func).all(dim=1)
        weights, mode = self.reward_weights.cpu(), self.multi_objective_aggregation
        return [
            _rewards_for_credit(aggregate_leaf_rewards(rows, weights, mode).masked_fill(none, float("nan")))
            for rows, none in zip(torch.split(per_func, sizes), torch.split(unscored, sizes))
        ]

    def _weighted_rewards(self, per_func: torch.Tensor) -> torch.Tensor:
        """GRPO's reward of each leaf: the weighted sum of the reward functions that apply (None → NaN: does not
        apply), NaN for a leaf that no function scores (TRL's `_calculate_rewards` has warned about it)."""
        rewards = (per_func * self.reward_weights.to(per_func.device).unsqueeze(0)).nansum(dim=1)
        return rewards.masked_fill(torch.isnan(per_func).all(dim=1), float("nan"))

    def _flush_reward_logs(self, num_rows: int, mode: str) -> None:
        """What reward functions passed to TRL's `log_metric` / `log_extra` callbacks, flushed as GRPOTrainer's
        `_generate_and_score_completions` (which the tree trainers replace) does: each metric averaged over the values
        of all ranks into `_metrics`, each extra column (one value per leaf) into the completions table. Values of the
        rows that pad a rank for `_calculate_rewards` are dropped. Column and metric names are sorted so every rank
        gathers them in the same order."""
        pending_metrics, pending_extra = self._pending_logs()
        tree_metrics.flush_logs_over_ranks(self.accelerator, pending_metrics, pending_extra, num_rows,
                                           self._metric_buffers(mode), self._completion_logs()["extra"])


def _as_text(messages: list[dict]) -> str:
    """A leaf's completion for a plain-text prompt: its assistant text, as GRPOTrainer's text completions."""
    return "".join(m.get("content") or "" for m in messages if m.get("role") == "assistant")


def _rewards_for_credit(rewards: torch.Tensor) -> torch.Tensor:
    """One tree's (or TreeFlex group's) leaf rewards for its credit, with GRPO's treatment of unscored leaves.

    GRPOTrainer gives a completion that no reward function scores (every one returned None) advantage 0 and leaves it
    out of its group's mean. A tree needs a reward on every leaf, so such a leaf takes the mean of the scored leaves:
    its standardised advantage is 0 and the baseline is the scored leaves' mean (the spread still counts every leaf).
    A tree with no scored leaf gets 0 everywhere, hence no signal.
    """
    unscored = torch.isnan(rewards)
    if not unscored.any():
        return rewards
    fill = rewards[~unscored].mean() if (~unscored).any() else rewards.new_zeros(())
    return rewards.masked_fill(unscored, fill.item())
