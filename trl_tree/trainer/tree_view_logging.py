"""The trainer side of the rollout-tree view (`trl_tree.tree_view`): collect, finish, save and log one page per
generation batch when `log_completions` is on.

When and where, following how `GRPOTrainer.log` handles its completions table:

1. **collect** (every rank, at generation): each tree's (or TreeFlex group's) turns, decoded texts, leaf rewards and
   the per-turn credit the trainer has just computed for it (`TreeTrainer._micro_batches`), in the order of the
   credit tensors;
2. **finish** (every rank, `on_step_end` of the optimizer step that completes the generation batch, or of the last
   step of training): one extra no-grad packed forward per micro-batch of the buffered generation batch gives each
   turn's probability *after* the update (mean token log-prob, TreeOPSD's p = σ(s)); π_old comes from the micro-batch itself. This
   forward is all the view costs in compute (about one π_old recompute per generation batch), and it runs only when
   `log_completions` is on. The records of all ranks are gathered;
3. **save and log** (main process, at the next `log`, like the completions table): `output_dir/tree_view/
   step_XXXXXX.json` (the data) and `.html` (the page), and the page to the trackers `report_to` names that take HTML:
   W&B (`wandb.Html`, when a run is active) and Trackio (`trackio.Html`, in Trackio releases that have it; older ones
   only get the file), under the key `tree_view`.

An evaluation batch is not trained, so its page (`eval_step_XXXXXX`) has the credit but no "after" probabilities.
"""

from __future__ import annotations

import importlib
import io
import sys
from pathlib import Path

import torch
from transformers import TrainerCallback

from .. import credit as credit_lib
from .. import losses, methods, trl_internals
from ..batch import LossInputs, TurnCredit
from ..packing import PackedTrees, packed_token_logps
from ..tree_view import VIEW_DIR, attach_turn_probabilities, flex_record, page_data, save_page, tree_record

TRACKER_KEY = "tree_view"


class TreeViewRecorder(TrainerCallback):
    """Collects each generation batch's trees and credit, adds the turn probabilities after the update, and writes
    and logs the page. Built by `TreeTrainer` when `log_completions` is on; the trainer calls `record_trees` /
    `record_flex` at generation and `write_ready` from `log`."""

    def __init__(self, trainer):
        self.trainer = trainer
        self.pending: tuple[list[dict], int] | None = None  # the training batch's records, the micro-step it began
        self.ready: dict | None = None  # the finished page data, written at the next log

    # ---------------------------------------------------------------- collect

    def record_trees(self, mode: str, prompts, trees, branches_per_tree, per_turn) -> None:
        decode = self._decode
        columns = self._reward_columns([len(b) for b in branches_per_tree])
        args = self.trainer.args
        records = [
            tree_record(tree, credit, decode, prompt, leaf_rounds=[getattr(b, "round", 0) for b in branches],
                        reward_columns=cols, leaf_advantages=methods.leaf_advantages(tree, args).tolist(),
                        with_entropy=self.trainer.needs_entropies)
            for prompt, tree, branches, credit, cols in zip(prompts, trees, branches_per_tree, per_turn, columns)
        ]
        self._record(mode, records)

    def record_flex(self, mode: str, prompts, groups, per_turn) -> None:
        records = [flex_record(g, credit, self._decode, p, credit_lib.group_normalize(g.scores).tolist())
                   for p, g, credit in zip(prompts, groups, per_turn)]
        self._record(mode, records)

    def _decode(self, ids: list[int]) -> str:
        return trl_internals.tokenizer(self.trainer).decode(ids, skip_special_tokens=False)

    def _reward_columns(self, sizes: list[int]) -> list[dict[str, list]]:
        """Each reward function's value per leaf, split per tree (NaN: the function did not apply → None)."""
        per_func = self.trainer._last_rewards_per_func
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
            self.ready = self._page(records, "eval", note)

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
        self.ready = self._page(records, "train", note)

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

    def _page(self, records: list[dict], mode: str, note: str) -> dict:
        from accelerate.utils import gather_object

        trainer, args = self.trainer, self.trainer.args
        method = trainer._name
        if type(trainer).__name__ == "TreeTrainer":
            method = f"Tree ({args.sampler} × {args.credit} × {args.loss})"
        return page_data(gather_object(records), step=trainer.state.global_step, method=method, mode=mode,
                         credit=args.credit, after_note=note)

    # ---------------------------------------------------------------- save and log

    def write_ready(self) -> Path | None:
        """Save the finished page (main process) and log it to the trackers; returns the page's path."""
        data, self.ready = self.ready, None
        if data is None or not self.trainer.accelerator.is_main_process:
            return None
        prefix = "eval_" if data["mode"] == "eval" else ""
        _, page_path = save_page(data, Path(self.trainer.args.output_dir) / VIEW_DIR, f"{prefix}step_{data['step']:06d}")
        log_page_to_trackers(page_path.read_text(encoding="utf-8"), self.trainer.args.report_to)
        return page_path


def _turn_probabilities(trainer, batch: dict) -> list[tuple[list, list, list]]:
    """Per unit (tree or TreeFlex group) of a micro-batch: per turn, the mean token log-prob under π_old and under the
    current weights, and σ(mean log-ratio); None for a turn with no trained token (masked). The micro-batch is
    flattened as the loss flattens it (`LossInputs.build`)."""
    packed = PackedTrees.from_dict(batch)
    logps, _ = packed_token_logps(trainer.model, packed, temperature=trainer.temperature)
    flat = LossInputs.build(packed.turn_ids, logps, batch["old_logps"], TurnCredit.from_dict(batch))
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


def log_page_to_trackers(page: str, report_to) -> list[str]:
    """Log the page under `tree_view` to each tracker in `report_to` that takes HTML; returns the trackers logged to.

    W&B: `wandb.Html` when `wandb` is importable and a run is active (as GRPOTrainer checks `wandb.run` for its
    table). Trackio: `trackio.Html` where the installed Trackio has it; without it the saved file is the page. The page
    goes in as a file-like object, so a tracker never mistakes it for a path, and without the tracker's injected
    stylesheet (it is self-contained)."""
    report_to = [report_to] if isinstance(report_to, str) else list(report_to or [])
    logged = []
    if "wandb" in report_to:
        wandb = _module("wandb")
        if wandb is not None and getattr(wandb, "run", None) is not None:
            wandb.log({TRACKER_KEY: wandb.Html(io.StringIO(page), inject=False)})
            logged.append("wandb")
    if "trackio" in report_to:
        trackio = _module("trackio")
        html_type = getattr(trackio, "Html", None)
        if html_type is not None:
            trackio.log({TRACKER_KEY: html_type(io.StringIO(page), inject=False)})
            logged.append("trackio")
    return logged


def _module(name: str):
    if name in sys.modules:
        return sys.modules[name]
    try:
        return importlib.import_module(name)
    except ImportError:
        return None
