"""The trainer side of the rollout-tree view (`trl_tree.tree_view`): collect, finish, save and log one page per
generation batch when `log_completions` is on (every batch, whatever `logging_steps` is).

When and where, following how `GRPOTrainer.log` handles its completions table:

1. **collect** (every rank, at generation): each tree's (or TreeFlex group's) turns, decoded texts, leaf rewards and
   the per-turn credit the trainer has just computed for it (`trl_tree.core.pipeline.micro_batches`), in the order of the
   credit tensors;
2. **finish** (every rank, `on_step_end` of the optimizer step that completes the generation batch, or of the last
   step of training): one extra no-grad packed forward per micro-batch of the buffered generation batch gives each
   turn's probability *after* the update (mean token log-prob, TreeOPSD's p = σ(s)); π_old comes from the micro-batch itself. This
   forward is all the view costs in compute (about one π_old recompute per generation batch), and it runs only when
   `log_completions` is on. The records of all ranks are gathered;
3. **save** (main process, right when the batch is finished): `output_dir/tree_view/step_XXXXXX.json` (the data)
   and `.html` (the page), and the run's `index.html`. Before, pages were saved at the next `log`, so with
   `logging_steps` > 1 only the last batch before each log got one (the README's Python example, two batches at the
   default `logging_steps=10`, wrote one page);
4. **log** (main process, at the next `log`, like the completions table): each page saved since to the trackers
   `report_to` names that take HTML (`trl_tree.tree_view.sinks`: W&B's `wandb.Html` when a run is active, Trackio's
   `trackio.Html` in releases that have it), under the key `tree_view`, each at its own global step.

**Tracker steps.** transformers' Trackio callback logs the scalars without `step=`, and so do GRPOTrainer's
completions table and, before, this page: every `trackio.log` call advanced Trackio's own counter, so with
`log_completions` one optimizer step took 2-3 Trackio steps (the pages of steps 2/4/6/8 landed at 5/10/15/20, an
8-step run's scalars reached step ~20). `at_global_step` makes every Trackio log inside `TreeTrainer.log` default to
`state.global_step`. W&B needs no step (its history step must only grow, and transformers plots against
`train/global_step`); the page and the completions table get `train/global_step` in their row. Each tracker's part
is its sink's `filed_at`.

An evaluation batch is not trained, so its page (`eval_step_XXXXXX`) has the credit but no "after" probabilities.
"""

from __future__ import annotations

import contextlib
import json
from pathlib import Path

import torch
from transformers import TrainerCallback

from ... import methods, trl_internals
from ...core import losses
from ...tree_view import (
    VIEW_DIR,
    attach_turn_probabilities,
    flex_record,
    page_data,
    render_page,
    save_page,
    sinks,
    tree_record,
)


class TreeViewRecorder(TrainerCallback):
    """Collects each generation batch's trees and credit, adds the turn probabilities after the update, and writes
    and logs the page. Built by `TreeTrainer` when `log_completions` is on; the trainer calls `record_trees` /
    `record_flex` at generation and `write_ready` from `log`."""

    def __init__(self, trainer):
        self.trainer = trainer
        self.pending: tuple[list[dict], int] | None = None  # the training batch's records, the micro-step it began
        self.to_log: list[tuple[str, dict, Path]] = []  # (page, data, its file) saved since the last log
        self.rows: list[dict] = []  # the dataset rows of the batch being generated (question, gold answer)
        self.policy: tuple[int, int] | None = None  # (version, staleness) of that batch when a rollout worker grew it
        self.batches = 0  # training generation batches finished so far (resumed runs: since the resume)

    # ---------------------------------------------------------------- collect

    def note_rows(self, rows: list[dict], *, policy: tuple[int, int] | None = None) -> None:
        """The dataset rows of the batch about to be generated (or logged), one per prompt
        (`TreeTrainer._prepare_roots`). `policy`: (the version that sampled the batch, its staleness) when the rollout
        worker grew it (`async_rollouts`); None: the trainer samples it itself, with π_old (`_policy`)."""
        self.rows = list(rows)
        self.policy = policy

    def _policy(self, mode: str) -> dict:
        """The batch's `policy_version` and `staleness` for its records (docs/design.md §9: version b = the weights
        after b generation batches). Sampled by the trainer itself, the batch's policy is π_old, version b at its
        first micro-step, so staleness 0. An evaluation batch gets neither: it is sampled by the weights of the
        moment, which need not be a version (evaluation may run between the optimizer steps of a batch)."""
        if mode != "train":
            return {}
        if self.policy is not None:
            version, staleness = self.policy
        else:
            per_batch = self.trainer.args.steps_per_generation * self.trainer.num_iterations
            version, staleness = trl_internals.micro_step(self.trainer) // per_batch, 0
        return {"policy_version": version, "staleness": staleness}

    def _rows(self, n: int) -> list[dict | None]:
        return self.rows if len(self.rows) == n else [None] * n

    def record_trees(self, mode: str, prompts, trees, branches_per_tree, per_turn, per_func) -> None:
        """One generation batch's trees; `per_func`: every leaf's reward-function values (`LeafScores.per_func`)."""
        decode = self._decode
        columns = self._reward_columns(per_func, [len(b) for b in branches_per_tree])
        args, policy = self.trainer.args, self._policy(mode)
        records = [
            tree_record(tree, credit, decode, prompt, leaf_rounds=[getattr(b, "round", 0) for b in branches],
                        reward_columns=cols, leaf_advantages=methods.CREDITS[args.credit].view(tree, args).tolist(),
                        with_entropy=self.trainer.needs_entropies, row=row,
                        turn_tools=[(getattr(b, "calls_per_turn", []), getattr(b, "failures_per_turn", []))
                                    for b in branches],
                        abandoned=[getattr(b, "abandoned_at", None) is not None for b in branches], **policy)
            for prompt, tree, branches, credit, cols, row in zip(prompts, trees, branches_per_tree, per_turn, columns,
                                                                 self._rows(len(prompts)))
        ]
        self._record(mode, records)

    def record_flex(self, mode: str, prompts, groups, per_turn) -> None:
        view = methods.CREDITS[self.trainer.args.credit].view  # the leaf values the credit backs up
        policy = self._policy(mode)
        records = [flex_record(g, credit, self._decode, p, view(g, self.trainer.args).tolist(), row=row, **policy)
                   for p, g, credit, row in zip(prompts, groups, per_turn, self._rows(len(prompts)))]
        self._record(mode, records)

    def _decode(self, ids: list[int]) -> str:
        return trl_internals.tokenizer(self.trainer).decode(ids, skip_special_tokens=False)

    def _reward_columns(self, per_func, sizes: list[int]) -> list[dict[str, list]]:
        """Each reward function's value per leaf, split per tree (NaN: the function did not apply → None)."""
        names = self.trainer.reward_func_names
        out = []
        for rows in torch.split(per_func, sizes):
            out.append({name: [None if v != v else v for v in rows[:, i].tolist()] for i, name in enumerate(names)})
        return out

    def _record(self, mode: str, records: list[dict]) -> None:
        if mode == "train":
            self.pending = (records, trl_internals.micro_step(self.trainer))
        else:  # an evaluation batch is not trained: its page is finished now
            note = "evaluation batch: not trained, so no probabilities after an update"
            self._save(self._page(records, "eval", note))

    # ---------------------------------------------------------------- finish

    def on_step_end(self, args, state, control, **kwargs):
        if self.pending is None:
            return
        records, start = self.pending
        per_batch = args.steps_per_generation * self.trainer.num_iterations
        done = trl_internals.micro_step(self.trainer) - start
        if done < per_batch and not (control.should_training_stop or state.global_step >= state.max_steps):
            return
        self.pending = None
        self._attach_after(records)
        steps, total = done // args.gradient_accumulation_steps, per_batch // args.gradient_accumulation_steps
        note = (f"log π and p after {steps} of the {total} optimizer steps on this generation batch"
                + ("" if steps == total else " (training stopped before the others)"))
        self.batches += 1
        self._save(self._page(records, "train", note, batch=self._batch_number(args)))

    def _batch_number(self, args) -> int:
        """Which generation batch of the run this is (1, 2, …), from the global step where the run's steps per
        batch divide it (a resumed run too); else counted since the trainer started."""
        per_batch = max(1, args.steps_per_generation * self.trainer.num_iterations // args.gradient_accumulation_steps)
        step = self.trainer.state.global_step
        return -(-step // per_batch) if step else self.batches

    @torch.no_grad()
    def _attach_after(self, records: list[dict]) -> None:
        """Mean token log-probs under π_old and after the update, and p = σ(s), for every turn, from one packed forward per buffered micro-batch
        (the very rows the loss trained, so a turn's tokens are scored in their own context)."""
        trainer = self.trainer
        batches = trl_internals.buffered_inputs(trainer) or []
        stats = [unit for batch in batches for unit in _turn_probabilities(trainer, batch)]
        if len(stats) != len(records):  # not this batch's buffer (e.g. a resumed run): show the credit only
            return
        for record, (logp_old, logp_new, p) in zip(records, stats):
            treeopsd = any("q" in n.get("credit", {}) for n in record["nodes"])
            attach_turn_probabilities(record, logp_old, logp_new, p if treeopsd else None)

    def _page(self, records: list[dict], mode: str, note: str, batch: int | None = None) -> dict:
        from accelerate.utils import gather_object

        trainer, args = self.trainer, self.trainer.args
        method = trainer._name
        if type(trainer).__name__ == "TreeTrainer":
            method = f"Tree ({args.sampler} × {args.credit} × {args.loss})"
        credit = methods.CREDITS[args.credit]
        return page_data(gather_object(records), step=trainer.state.global_step, method=method, mode=mode,
                         credit=args.credit, after_note=note, special_tokens=self._special_tokens(), batch=batch,
                         credit_summary=credit.summary, penalties=credit.applies_penalties)

    def _special_tokens(self) -> list[str]:
        """The tokenizer's special tokens (the chat template's `<|im_start|>`, `<|im_end|>`, `<|endoftext|>`, …), which
        the page hides in the texts it shows; added tokens that are not special (`<tool_call>`, `<think>`) stay."""
        tok = trl_internals.tokenizer(self.trainer)
        tokens = set(getattr(tok, "all_special_tokens", None) or [])
        for added in (getattr(tok, "added_tokens_decoder", None) or {}).values():
            if getattr(added, "special", False):
                tokens.add(str(added.content))
        return sorted(t for t in tokens if isinstance(t, str))

    # ---------------------------------------------------------------- save and log

    def _save(self, data: dict) -> None:
        """Save a finished page (main process) now, and keep it for the trackers' next log."""
        if not self.trainer.accelerator.is_main_process:
            return
        prefix = "eval_" if data["mode"] == "eval" else ""
        _, page_path = save_page(data, Path(self.trainer.args.output_dir) / VIEW_DIR, f"{prefix}step_{data['step']:06d}")
        self.to_log.append((data, page_path))

    def write_ready(self) -> list[Path]:
        """Log the pages saved since the last log to the trackers (main process), each at its own step; returns
        their paths."""
        pages, self.to_log = self.to_log, []
        for data, page_path in pages:
            # a tracker shows the page alone, so without the links to the steps beside it (not beside it there)
            log_page_to_trackers(render_page(data), self.trainer.args.report_to, step=data["step"],
                                 caption=f"{data['mode']} step {data['step']}: {page_path}")
        return [page_path for _, page_path in pages]


def _turn_probabilities(trainer, batch: dict) -> list[tuple[list, list, list]]:
    """Per unit (tree or TreeFlex group) of a micro-batch: per turn, the mean token log-prob under π_old and under the
    current weights, and σ(mean log-ratio); None for a turn with no trained token (masked). The micro-batch is
    flattened as the loss flattens it (`TreeTrainer.loss_inputs`)."""
    flat, _ = trainer.loss_inputs(trainer.model, batch)
    n, ids = flat.num_turns, flat.turn_ids
    tokens = losses.turn_token_counts(ids, n)
    old = losses.turn_sum(flat.old_logps.double(), ids, n) / tokens.clamp(min=1)
    new = losses.turn_sum(flat.logps.double(), ids, n) / tokens.clamp(min=1)
    trained = (tokens > 0).tolist()

    def values(t):
        return [v if ok else None for v, ok in zip(t.tolist(), trained)]

    logp_old, logp_new, p = values(old), values(new), values(torch.sigmoid(new - old))
    out, start = [], 0
    for c in flat.credit.count.tolist():
        out.append((logp_old[start : start + c], logp_new[start : start + c], p[start : start + c]))
        start += c
    return out


def log_page_to_trackers(page: str, report_to, *, step: int, caption: str | None = None) -> list[str]:
    """`trl_tree.tree_view.sinks.log_page_to_trackers`: the page to each tracker in `report_to` that takes HTML."""
    return sinks.log_page_to_trackers(page, report_to, step=step, caption=caption)


@contextlib.contextmanager
def at_global_step(trainer):
    """Inside, every Trackio log that names no step is filed at `trainer.state.global_step`, and every W&B log
    without `train/global_step` gets it, so that the scalars (transformers' callbacks log without a step), the
    completions table and the tree page of one `TreeTrainer.log` all sit at the trainer's step.

    transformers' Trackio callback calls `trackio.log(...)` without `step=`, GRPOTrainer's completions table too:
    each call advanced Trackio's counter by one, so with `log_completions` the counter ran 2-3 times ahead of the
    trainer. Both look `log` up on the module at call time, so the module's `log` is wrapped for the duration of the
    call and put back after (also on an error). For W&B, GRPOTrainer's completions table of tool-calling completions
    cannot be built at all (`wandb.Table` rejects a column of message lists with tool calls: "Data row contained
    incompatible types", which stopped training): the buffered completions go to W&B as JSON text instead."""
    with contextlib.ExitStack() as stack:
        for sink in sinks.sinks_for(trainer.args.report_to):
            stack.enter_context(sink.filed_at(lambda: trainer.state.global_step))
            if sink.name == "wandb" and sink.active():
                _completions_as_text(trainer)
        yield


def _completions_as_text(trainer) -> None:
    """GRPOTrainer's buffered prompts and completions as JSON text where they are chat messages: W&B's table takes
    text, but no column of message lists whose messages have different fields (tool calls, tool names)."""
    logs = trl_internals.completion_logs(trainer)
    for key in ("prompt", "completion"):
        column = logs.get(key) if isinstance(logs, dict) else None
        if column is None or not any(isinstance(v, (list, dict)) for v in column):
            continue
        texts = [v if isinstance(v, str) else json.dumps(v, ensure_ascii=False, default=str) for v in column]
        column.clear()
        column.extend(texts)
