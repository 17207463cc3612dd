"""The generation metrics of the tree trainers, under GRPOTrainer's names (docs/design.md §2, "Layers").

A mixin of `TreeTrainer`: what one generation batch (`trl_tree.core.pipeline.GenerationBatch`) logs, reduced over the
ranks (`rank_metrics`), the completions table of `log_completions` (its buffer sized for a tree batch, the rows
the console shows) and the tree view's page. Its own file so that
the trainer module is the adapter from GRPOTrainer to the pipeline only; TreeFlex overrides `_log_generation`.
"""

from __future__ import annotations

import contextlib

import torch
from trl.trainer.utils import nanstd

from ... import methods, trl_internals
from ...core import credit, pipeline
from ...core.batch import TurnCredit
from ...core.tree import render_tree
from ...rollout.acting.tools import stuck_tool_threads
from . import completions_table
from . import rank_metrics as tree_metrics
from .completions_table import TREE_COLUMN, RowMeta
from .tree_view_logging import at_global_step


@contextlib.contextmanager
def _set_for_the_block(obj, name: str, value):
    """`obj.name` is `value` inside the block, and restored after it."""
    saved = getattr(obj, name)
    setattr(obj, name, value)
    try:
        yield
    finally:
        setattr(obj, name, saved)


@contextlib.contextmanager
def _switched_off(obj, flag: str, when: bool):
    """`obj.flag` is False inside the block if `when`, and restored after it."""
    if not when:
        yield
        return
    setattr(obj, flag, False)
    try:
        yield
    finally:
        setattr(obj, flag, True)


class GenerationLogging:
    """Logging of a generation batch; mixed into `TreeTrainer` (reads its accelerator, args, reward names, tools)."""

    def _gather_uneven(self, values: torch.Tensor) -> torch.Tensor:
        return tree_metrics.gather_uneven(self.accelerator, values)

    def _mean_over_ranks(self, values: list[float] | torch.Tensor) -> float:
        return tree_metrics.mean_over_ranks(self.accelerator, values)

    def log(self, logs: dict[str, float], start_time: float | None = None) -> None:
        """GRPOTrainer's `log` (metrics, and the completions table with `log_completions`), then the rollout-tree view
        of the last finished generation batch, saved and logged to the trackers (`trl_tree.tree_view`).

        The completions table is shown once per step: GRPOTrainer prints (and logs) it again with the end-of-training
        summary, which transformers logs at the last step's number, the same rows a second time."""
        shown_already = self.log_completions and self.state.global_step == self._completions_shown_at
        self._completions_shown_at = self.state.global_step
        # the console's table is trl-tree's (`completions_table`): taken before W&B's logging turns the rows into JSON
        table = self._console_completions() if self.log_completions and not shown_already else None
        with (at_global_step(self), _switched_off(self, "log_completions", shown_already),
              _set_for_the_block(self, "num_completions_to_print", 0)):  # TRL's own table: logged, not printed
            # Trackio files everything of this log at the trainer's step, not at its own count
            super().log(logs, start_time)
            pages = self._tree_view.write_ready() if self._tree_view is not None else []
        if table is not None:
            self._print_completions(table, pages)

    def _log_rollout_metrics(self, mode, group_sizes: list[int], lengths: list[int], clipped: list[bool],
                             tool_calls: list[int], tool_failures: list[int], scores: pipeline.LeafScores) -> None:
        """GRPOTrainer's generation metrics under its names. A "completion" is a leaf trajectory (TreeFlex: a complete
        search) and its group is its tree (TreeFlex: the task's searches); `group_sizes` are the leaves per tree.

            rewards/<name>/mean, /std    nan-mean / nan-std of each reward function over the completions (None is NaN:
                                         the function does not apply)
            reward, reward_std           the same of the weighted reward sum; completions no function scores left out
            frac_reward_zero_std         fraction of trees whose scored leaf rewards are all equal, so that the tree
                                         gives no learning signal (GRPO's per group; fewer than 2 scored leaves too)
            num_tokens                   `state.num_input_tokens_seen`, counted as GRPO counts it: per completion,
                                         its prompt's tokens plus its generated tokens (tool results masked out, as
                                         GRPO's tool_mask does), so a turn shared by several leaves counts once per
                                         leaf. What the tree forwards is `tree/forward_tokens`, its unique tokens
                                         `tree/unique_tokens` (TreeFlex: the packed forward tokens of its blocks)
            completions/mean_length, /min_length, /max_length
                                         the completion's generated tokens (tool observations excluded, as GRPO's
                                         tool mask does)
            completions/clipped_ratio    fraction of completions cut by the token budget (their last turn did not end
                                         with EOS; TreeFlex: a block of the search was cut)
            completions/mean_terminated_length, /min_terminated_length, /max_terminated_length
                                         the same lengths over the completions that were not cut (0 if none)
            tools/call_frequency         tool calls per completion (a leaf counts every call on its path)
            tools/failure_frequency      failed calls / calls (0 without calls)
            tools/dropped_observations   (trees) fraction of leaves that ended because a tool answer did not fit what
                                         was left of max_completion_length (the turn is marked observation_dropped)
            tools/stuck_workers          threads still running a tool call past tool_timeout (mean over ranks;
                                         `trl_tree.rollout.acting.tools.stuck_tool_threads`; past a cap the run stops)
            tools/abandoned_environments (environments) fraction of leaves ended because a call on their environment
                                         timed out while it may still run there (`Branch.abandoned_at`)
        """
        metrics = trl_internals.metrics(self, mode)
        per_func, rewards = scores.per_func, scores.weighted
        for i, name in enumerate(self.reward_func_names):
            column = self._gather_uneven(per_func[:, i])  # NaN dropped: GRPO's nan-aware statistics
            metrics[f"rewards/{name}/mean"].append(torch.nanmean(column).item())
            metrics[f"rewards/{name}/std"].append(nanstd(column).item())
        all_rewards = self._gather_uneven(rewards)
        metrics["reward"].append(torch.nanmean(all_rewards).item())
        metrics["reward_std"].append(nanstd(all_rewards).item())
        zero_std = [float(_no_reward_spread(r)) for r in torch.split(rewards, group_sizes)]
        metrics["frac_reward_zero_std"].append(self._mean_over_ranks(zero_std))
        metrics["num_tokens"] = [self.state.num_input_tokens_seen]
        all_lengths = self._gather_uneven(torch.tensor(lengths, dtype=torch.float64))
        cut = self._gather_uneven(torch.tensor(clipped, dtype=torch.float64)).bool()
        metrics["completions/mean_length"].append(all_lengths.mean().item())
        metrics["completions/min_length"].append(all_lengths.min().item())
        metrics["completions/max_length"].append(all_lengths.max().item())
        metrics["completions/clipped_ratio"].append(cut.double().mean().item())
        terminated = all_lengths[~cut] if (~cut).any() else all_lengths.new_zeros(1)
        metrics["completions/mean_terminated_length"].append(terminated.mean().item())
        metrics["completions/min_terminated_length"].append(terminated.min().item())
        metrics["completions/max_terminated_length"].append(terminated.max().item())
        self._log_tool_use(metrics, tool_calls, tool_failures)

    def _count_forward_tokens(self, mode: str, forward_tokens: int) -> None:
        """Add this rank's `forward_tokens` (summed over ranks) to `state.num_input_tokens_seen`, as GRPO does in
        training only."""
        if mode == "train":
            tokens = torch.tensor(float(forward_tokens), device=self.accelerator.device)
            self.state.num_input_tokens_seen += int(self.accelerator.reduce(tokens, reduction="sum").item())

    def _log_generation(self, mode, result: pipeline.GenerationBatch) -> None:
        """One generation batch's metrics (GRPO's and the tree's), its completions table and its tree-view page."""
        prompts, trees, branches_per_tree, per_turn = result.prompts, result.units, result.grown.leaves, result.per_turn
        metrics = trl_internals.metrics(self, mode)
        leaves = [b for branches in branches_per_tree for b in branches]
        lengths = [sum(len(t.action_ids) for t in b.turns) for b in leaves]
        # GRPO's num_tokens: every completion with its prompt, generated tokens only (not what the packed tree forwards)
        self._count_forward_tokens(mode, sum(b.prompt_len + n for b, n in zip(leaves, lengths)))
        self._log_rollout_metrics(
            mode, [len(b) for b in branches_per_tree], lengths,
            [b.turns[-1].truncated for b in leaves], [b.tool_calls for b in leaves], [b.tool_failures for b in leaves],
            result.scores,
        )
        if self.tools:  # a turn's tool answer that did not fit the token budget: the model never saw it
            dropped = [float(any(t.observation_dropped for t in b.turns)) for b in leaves]
            metrics["tools/dropped_observations"].append(self._mean_over_ranks(dropped))
            # threads still running a tool call past its deadline (process-wide; the run stops past a cap)
            metrics["tools/stuck_workers"].append(self._mean_over_ranks([float(stuck_tool_threads())]))
        if self.environment_factories is not None:  # leaves ended by a timed-out call still running on their env
            abandoned = [float(getattr(b, "abandoned_at", None) is not None) for b in leaves]
            metrics["tools/abandoned_environments"].append(self._mean_over_ranks(abandoned))
        metrics["tree/leaves_per_tree"].append(self._mean_over_ranks([t.num_leaves for t in trees]))
        metrics["tree/unique_turns"].append(self._mean_over_ranks([t.num_turns for t in trees]))
        metrics["tree/unique_tokens"].append(self._mean_over_ranks([t.num_unique_tokens for t in trees]))
        metrics["tree/flat_tokens"].append(self._mean_over_ranks([t.num_path_tokens for t in trees]))
        metrics["tree/forward_tokens"].append(self._mean_over_ranks([result.forward_tokens / len(trees)]))
        metrics["tree/turns_per_leaf"].append(self._mean_over_ranks([len(b.turns) for b in leaves]))
        if self.environment_factories is not None:
            metrics["tree/diverged_branches"].append(self._mean_over_ranks(result.grown.diverged))
        self.log_turn_credit(metrics, per_turn)
        for name, per_tree in result.grown.sampler_stats.items():  # what the sampler measured (TreeAdv: branch points)
            if per_tree:
                metrics[name].append(self._mean_over_ranks(per_tree))
        self._log_pack_metrics(metrics, result)
        if self.log_completions:
            self._log_tree_completions(prompts, trees, branches_per_tree, result.scores.per_func)
            if self._tree_view is not None:
                self._tree_view.record_trees(mode, prompts, trees, branches_per_tree, per_turn, result.scores.per_func)

    @staticmethod
    def _log_pack_metrics(metrics, result: pipeline.GenerationBatch) -> None:
        """What packing measured, one value per micro-batch of this rank ("auto" packing: `tree/packed_as_tree`,
        1 when it chose tree rows), returned by the unit's `pack` in the batch rather than written while packing."""
        for name, values in result.pack_metrics.items():
            metrics[name].extend(values)

    def _log_tool_use(self, metrics, calls: list[int], failures: list[int]) -> None:
        """GRPOTrainer's tool metrics, one completion = one leaf (every call of its history, shared turns included):
        `tools/call_frequency` = calls per completion, `tools/failure_frequency` = failed calls / calls (0 without
        calls), both over all ranks. Logged only when the trainer has tools, as in GRPOTrainer."""
        if not self.tools:
            return
        metrics["tools/call_frequency"].append(self._mean_over_ranks(calls))
        total = torch.tensor([sum(failures), sum(calls)], dtype=torch.float64, device=self.accelerator.device)
        total = self.accelerator.reduce(total, reduction="sum")
        metrics["tools/failure_frequency"].append((total[0] / total[1]).item() if total[1] > 0 else 0.0)

    def log_turn_credit(self, metrics, per_turn: list[TurnCredit]) -> None:
        """Mean |A| of the turn credit over every rank's turns, and the loss's own credit metrics
        (`trl_tree.methods.Loss.credit_metrics`; TreeOPSD: mean |q − 1/2|, how far the teachers move the policy)."""
        values = {"tree/abs_turn_advantage": torch.cat([c.A.abs() for c in per_turn])}
        values.update(methods.LOSSES[self.args.loss].credit_metrics(per_turn))
        tree_metrics.log_values(metrics, self.accelerator, values)

    def _log_tree_completions(self, prompts, trees, branches_per_tree, per_func: torch.Tensor):
        rows_prompt, rows_completion, rows_tree, rows_adv, rows_meta = [], [], [], [], []
        for prompt, tree, branches in zip(prompts, trees, branches_per_tree):
            A = credit.standardize(torch.tensor(tree.rewards), min_leaves=1) if tree.num_leaves > 1 else [0.0]
            text = render_tree(tree, trl_internals.tokenizer(self))
            group, summary = self._next_completion_group(), _tree_summary(tree)
            for k, b in enumerate(branches):
                rows_prompt.append(prompt)
                rows_completion.append(b.messages)
                rows_tree.append(text if k == 0 else f"(leaf {k} of the tree above: turns {tree.paths[k]})")
                rows_adv.append(float(A[k]))
                rows_meta.append(RowMeta(group, k, len(branches), tuple(tree.paths[k]), summary))
        self._log_completion_rows(rows_prompt, rows_completion, rows_adv, {TREE_COLUMN: rows_tree}, per_func,
                                  rows_meta)

    def _next_completion_group(self) -> tuple[int, int]:
        """A key of the next logged group (tree, or TreeFlex's task), unique over ranks and batches: what the console
        table uses to show a group's prompt and tree once."""
        self._completion_groups_logged = getattr(self, "_completion_groups_logged", 0) + 1
        return self.accelerator.process_index, self._completion_groups_logged

    def _log_completion_rows(self, prompts: list, completions: list, advantages: list[float],
                             extra: dict[str, list], per_func: torch.Tensor, meta: list[RowMeta] | None = None) -> None:
        """GRPOTrainer's completions table (`log_completions`), one row per leaf (TreeFlex: per search) of every rank,
        with each reward function's column. Objects are gathered, so ranks may hold different numbers of rows.
        `meta` says which group each row belongs to, for the console's table only (`completions_table`)."""
        from accelerate.utils import gather_object

        self._completion_meta.extend(gather_object(list(meta) if meta is not None else [None] * len(prompts)))
        logs = trl_internals.completion_logs(self)
        logs["prompt"].extend(gather_object(prompts))
        logs["completion"].extend(gather_object(completions))
        for i, name in enumerate(self.reward_func_names):
            logs["rewards"][name].extend(gather_object(per_func[:, i].tolist()))
        logs["advantages"].extend(gather_object(advantages))
        for column, rows in extra.items():  # GRPOTrainer.log prints and saves the table
            logs["extra"][column].extend(gather_object(rows))

    def _resize_completion_logs(self, maxlen: int):
        """GRPOTrainer keeps one generation batch of completions for `log_completions`; a tree batch has K leaves
        per prompt."""
        from collections import defaultdict, deque

        logs = {
            "images": deque(maxlen=maxlen),
            "prompt": deque(maxlen=maxlen),
            "completion": deque(maxlen=maxlen),
            "rewards": defaultdict(lambda: deque(maxlen=maxlen)),
            "advantages": deque(maxlen=maxlen),
            "extra": defaultdict(lambda: deque(maxlen=maxlen)),
        }
        trl_internals.set_completion_logs(self, logs)
        self._completion_meta = deque(maxlen=maxlen)  # each logged row's group, for the console's table

    def _console_completions(self) -> completions_table.Table | None:
        """The rows of the buffered completions that the console shows (`args.num_completions_to_print` of them,
        drawn as TRL draws them), prepared for it; None where TRL would print nothing (not the main process, no
        `rich`, nothing buffered)."""
        from transformers.utils import is_rich_available

        logs = trl_internals.completion_logs(self)
        num_rows = len(logs["prompt"])
        if not (self.accelerator.is_main_process and is_rich_available() and num_rows):
            return None
        meta = list(self._completion_meta)[-num_rows:]
        meta = [None] * (num_rows - len(meta)) + meta
        rows = completions_table.chosen_rows(num_rows, self.num_completions_to_print)
        return completions_table.console_table(
            list(logs["prompt"]), list(logs["completion"]), {k: list(v) for k, v in logs["rewards"].items()},
            list(logs["advantages"]), {k: list(v) for k, v in logs["extra"].items()}, meta, rows,
        )

    def _print_completions(self, table: completions_table.Table, pages: list | None = None) -> None:
        """TRL's table printer on the prepared rows (looked up on TRL's GRPO module, where GRPOTrainer calls it) on a
        terminal; off one (a log file, CI, `| tee`), one line per row and the path of the step's tree page
        (`completions_table.compact_lines`), since rich would render the table at 80 columns, one word a line."""
        if not completions_table.stdout_is_terminal():
            lines = completions_table.compact_lines(table, self.state.global_step)
            lines += [f"[completions step {self.state.global_step}] the rollout-tree page: {page}" for page in pages or []]
            print("\n".join(lines), flush=True)
            return
        import trl.trainer.grpo_trainer as grpo_module

        grpo_module.print_prompt_completions_sample(
            table.prompts, table.completions, table.rewards, table.advantages, self.state.global_step, None,
            extra=table.extra,
        )


def _tree_summary(tree) -> str:
    """One line about a tree for the console's completions table (the tree view draws it)."""
    rewards = " ".join(f"{r:g}" for r in tree.rewards)
    return f"{tree.num_leaves} leaves, {tree.num_turns} unique turns; rewards {rewards}"


def _no_reward_spread(rewards: torch.Tensor) -> bool:
    """A tree's leaf rewards (NaN: unscored) give no learning signal: fewer than two are scored, or all are equal."""
    scored = rewards[~torch.isnan(rewards)]
    return scored.numel() < 2 or bool(torch.isclose(scored.std(), scored.new_zeros(())))
