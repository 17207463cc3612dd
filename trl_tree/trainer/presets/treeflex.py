"""`TreeFlexTrainer`: complete searches as group members, causal blocks, turn penalties, dual clip (docs/design.md §3 F1–F4).

The rollout
-----------
A harness (`trl_tree.rollout.growing.flex_harness`; the rollout format is documented there) grows, per task, K complete
searches (`num_searches`), each a list of *causal blocks*: a block is one causal token sequence — its context (the
role prompt, the task, restored or copied-in text such as a checkpoint card, a summary or another role's instruction,
rendered with the chat template; context only) followed by the turns the policy generated in it (trained; tool
observations and appended cards stay context). The default `TwoRoleHarness` has one Reflection block per search and
one block per Execution segment, each segment starting from a restored checkpoint card.

Design decisions
----------------
- **A block is a one-trajectory `RolloutTree`** whose prompt is the block's context, so `pack_trees` and
  `packed_token_logps` are reused unchanged: each token's log-probability is evaluated in the context that generated
  it, and context tokens (turn id −1) are never scored, so restored text gets no loss in the block that reads it.
- **Batch layout: dim 0 is a task's group, one packed row per block** (`PackedTrees` of shape [groups, max blocks,
  T], empty rows padded and skipped by the forward). TRL shuffles and splits the generation batch along dim 0 into
  micro-batches and optimizer blocks, so a group always travels whole: every aggregation mode sees the whole group,
  exactly, whatever `per_device_train_batch_size`, `gradient_accumulation_steps` or `steps_per_generation` are. (A row
  per block along dim 0 would scatter a group's blocks over micro-batches and optimizer steps.)
- **Credit per turn** (F1–F2, `credit.process_advantages`): A_i = (R_s + Q_i − mean R)/divisor ("pre_norm", default)
  or (R_s − mean R)/divisor + Q_i ("post_norm"), with mean and divisor (sample std; 1 when all scores are equal)
  from the K terminal scores only, so a penalty moves its own turn's tokens and never the baseline. Q_i ≤ 0 is what
  the harness recorded on the turn (`Turn.penalty`: `tool_failure_penalty` per malformed or rejected tool call) plus
  the trainer's `process_penalty` hook (e.g. −0.2 for out-of-scope work). `credit.standardize` is not used: it needs
  K ≥ 2 and has no divisor-1 rule.
- **Aggregation as precomputed weights** (F4, `losses.aggregation_weights`): at generation time every turn gets a
  per-token weight w_i such that a group's loss is the weighted token sum Σ_t w_{turn(t)} l_t, which equals
  `losses.aggregate` over the group for the chosen mode (token / block / rollout / role, mixed with the role mean by
  λ). The micro-batch loss is the mean over its groups of that sum (like the other tree trainers' mean over trees),
  so `_compute_loss` stays a weighted sum. Every mode is thus per group and each task counts equally in a batch
  ("token" is the token mean of a group, not of the whole batch).
- **Loss** (F3): `losses.dual_clip_loss` per token, PPO clip ε (ε_high) and for A < 0 the dual clip at −c·A, c = 3.
- **Credit and loss come from the method table** (`trl_tree.methods`: credit "search", loss "dual_clip"), like every
  other method's; this trainer differs only in its unit (a group of searches made of causal blocks, grown by a
  harness) and how it packs it: `FlexUnits` is that unit for `trl_tree.core.pipeline`, which runs the tree trainers'
  generation batch unchanged (a search is a scored leaf, `FlexSearch.completion_ids`; no fake branch).
"""

from __future__ import annotations

from torch import Tensor

from ... import methods, trl_internals
from ...core import credit
from ...core.flex_unit import (  # the unit, beside the tree's (`trl_tree.core.tree_unit`)
    FlexGroup,
    FlexUnits,
    pack_groups,
)
from ...core.pipeline import GenerationBatch
from ...rollout.acting.special_tokens import observation_messages
from ...rollout.growing.flex_harness import FlexBlock, FlexHarness, FlexKit, FlexSearch, FlexTask
from ..base import TreeTrainer
from ..configuration.fields import TreeFlexConfig
from ..observability.completions_table import RowMeta

__all__ = ["FlexGroup", "FlexUnits", "TreeFlexConfig", "TreeFlexTrainer", "pack_groups"]

@methods.preset("treeflex")  # name, tags and config class from the method table
class TreeFlexTrainer(TreeTrainer):
    """Drop-in `GRPOTrainer` replacement training with TreeFlex.

    Args:
        harness: a `FlexHarness` (see `trl_tree.rollout.growing.flex_harness` for the rollout format); default: the two-role
            harness of `args.sampler`.
        Other arguments: as `GRPOTrainer` (`tools=` / `environment_factory=`, reward functions, PEFT, …).

    Hooks: `process_penalty(example, search, block, turn_index) -> float` adds a penalty Q ≤ 0 to a turn (default
    0); `turn_credit(group)` returns the `FlexCredit` of a group; `turn_loss(batch, mode)` the micro-batch loss.

    Example:
        ```python
        from trl_tree import TreeFlexConfig, TreeFlexTrainer

        trainer = TreeFlexTrainer(
            model="Qwen/Qwen3-4B-Thinking-2507",
            reward_funcs=judge_reward,
            args=TreeFlexConfig(num_searches=8, max_blocks=6, aggregation="rollout", role_lambda=0.0),
            train_dataset=dataset,
            tools=[search, open_page],
        )
        trainer.train()
        ```
    """

    config_base = TreeFlexConfig

    def __init__(self, model, reward_funcs=None, args: TreeFlexConfig | None = None, harness: FlexHarness | None = None,
                 **kwargs):
        if args is not None and not isinstance(args, TreeFlexConfig):
            raise TypeError(f"TreeFlexTrainer needs a TreeFlexConfig, got {type(args).__name__}.")
        self._harness = harness
        super().__init__(model, reward_funcs, args=args, **kwargs)

    def build_sampler(self, loop):
        """The harness passed to the trainer, else the configured one (`trl_tree.methods.SAMPLERS`)."""
        self._turn_loop = loop
        if self._harness is not None:
            return self._harness
        return super().build_sampler(loop)

    def _forwards_tree_rows(self) -> bool:
        """Always: each block is packed as a one-path tree row (`pack_groups`), so TreeFlex has no `packing`."""
        return True

    @property
    def harness(self) -> FlexHarness:
        return self.sampler

    def flex_kit(self) -> FlexKit:
        """What the harness may use of the policy for one generation batch."""
        return FlexKit(
            loop=self._turn_loop, render=self._render_context, append=self._append_ids,
            decode=lambda ids: trl_internals.tokenizer(self).decode(ids, skip_special_tokens=True),
            num_searches=self.args.num_searches, max_blocks=self.args.max_blocks,
        )

    def _render_context(self, messages: list[dict], tools=None) -> list[int]:
        """A block's context: `messages` through the (training) chat template, with the assistant header."""
        ids = self.processing_class.apply_chat_template(
            messages, tools=list(tools) if tools else None, chat_template=self.chat_template,
            add_generation_prompt=True, tokenize=True, return_dict=False, **self.chat_template_kwargs,
        )
        return list(ids)

    def _append_ids(self, messages: list[dict]) -> list[int]:
        """Token ids that append `messages` after an assistant turn and open the next assistant turn.

        Tool messages use TRL's `_get_tool_suffix_ids`; other roles (a card copied in as a user message) the same
        dummy-conversation difference, so the history stays token-in, token-out. Either way the messages carry text
        the model or a tool wrote, so `observation_special_tokens` applies to both.
        """
        mode = self.args.observation_special_tokens
        if all(m.get("role") == "tool" for m in messages):
            return list(trl_internals.tool_suffix_ids(self, messages, special_tokens=mode))
        messages = observation_messages(trl_internals.tokenizer(self), list(messages), mode)
        dummy = [{"role": "user", "content": "dummy"}, {"role": "assistant", "content": "dummy"}]

        def render(conversation, generation_prompt):
            return list(self.processing_class.apply_chat_template(
                conversation, add_generation_prompt=generation_prompt, tokenize=True, return_dict=False,
                chat_template=self.chat_template, **self.chat_template_kwargs,
            ))

        prefix, full = render(dummy, False), render(dummy + list(messages), True)
        eos = [i for i, tok in enumerate(prefix) if tok == trl_internals.tokenizer(self).eos_token_id]
        if eos:
            prefix = prefix[: eos[-1] + 1]
        if full[: len(prefix)] != prefix:
            raise ValueError("The chat template does not preserve prefixes: cannot append messages token-wise.")
        return full[len(prefix) :]

    # ---------------------------------------------------------------- hooks

    def process_penalty(self, example: dict, search: FlexSearch, block: FlexBlock, turn_index: int) -> float:
        """An extra process penalty Q ≤ 0 for `block.turns[turn_index]` (added to `Turn.penalty`, which already
        holds the tool-failure penalties). Override, e.g. return −0.2 for a judged out-of-scope turn."""
        return 0.0

    # ---------------------------------------------------------------- generation

    def rollout_unit(self, mode: str) -> FlexUnits:
        """TreeFlex's unit for the pipeline: a task's group of complete searches, grown by the harness with this
        batch's kit (the unit, in the core, gets the search as a callable: it imports nothing of the rollout)."""
        harness, kit = self.harness, self.flex_kit()

        def search(prompts: list, roots: list) -> list[list[FlexSearch]]:
            tasks = [FlexTask(p, r.prompt_ids, r.env, r.tools, r.environment) for p, r in zip(prompts, roots)]
            return harness.run(tasks, kit)

        return FlexUnits(search, harness.roles, trl_internals.tokenizer(self).pad_token_id,
                         self.mask_truncated_completions, self.process_penalty)

    # ---------------------------------------------------------------- metrics

    def _log_generation(self, mode, result: GenerationBatch) -> None:
        """GRPO's metrics (`TreeTrainer._log_rollout_metrics`: a completion is a complete search, its group the task's
        searches; a search counts as cut when any of its turns was cut by its block's budget) and TreeFlex's own."""
        prompts, groups, per_turn = result.prompts, result.units, result.per_turn
        metrics = trl_internals.metrics(self, mode)
        searches = [s for g in groups for s in g.searches]
        self._count_forward_tokens(mode, result.forward_tokens)
        self._log_rollout_metrics(
            mode, [len(g.searches) for g in groups],
            [sum(len(t.action_ids) for b in s.blocks for t in b.turns) for s in searches],
            [any(t.truncated for b in s.blocks for t in b.turns) for s in searches],
            [s.tool_calls for s in searches], [s.tool_failures for s in searches], result.scores,
        )
        metrics["tree/leaves_per_tree"].append(self._mean_over_ranks([len(g.searches) for g in groups]))
        metrics["treeflex/blocks_per_search"].append(self._mean_over_ranks([len(s.blocks) for s in searches]))
        metrics["treeflex/turns_per_search"].append(self._mean_over_ranks(
            [sum(len(b.turns) for b in s.blocks) for s in searches]))
        metrics["treeflex/context_tokens_per_block"].append(self._mean_over_ranks(
            [len(t.prompt_ids) for g in groups for t in g.trees]))
        penalties = [q for g in groups for q in g.penalties.tolist()]
        metrics["treeflex/penalised_turn_fraction"].append(self._mean_over_ranks([float(q < 0) for q in penalties]))
        metrics["treeflex/mean_turn_penalty"].append(self._mean_over_ranks(penalties))
        self.log_turn_credit(metrics, per_turn)
        self._log_pack_metrics(metrics, result)
        for r, role in enumerate(self.harness.roles):
            share = [float(g.lengths[g.turn_role == r].sum() / g.lengths.sum().clamp(min=1)) for g in groups]
            metrics[f"treeflex/token_share/{role}"].append(self._mean_over_ranks(share))
        if self.log_completions:
            self._log_flex_completions(prompts, groups, result.scores.per_func)
            if self._tree_view is not None:
                self._tree_view.record_flex(mode, prompts, groups, per_turn)

    def _log_flex_completions(self, prompts, groups: list[FlexGroup], per_func: Tensor):
        rows_prompt, rows_completion, rows_adv, rows_blocks, rows_meta = [], [], [], [], []
        for prompt, group in zip(prompts, groups):
            advantages = credit.group_normalize(group.scores)
            key = self._next_completion_group()
            for k, (search, a) in enumerate(zip(group.searches, advantages.tolist())):
                rows_prompt.append(prompt)
                rows_completion.append(search.completion)
                rows_adv.append(a)
                rows_blocks.append(" | ".join(f"{b.role}:{len(b.context_ids)}+{len(b.turns)}t" for b in search.blocks))
                rows_meta.append(RowMeta(key, k, len(group.searches)))
        self._log_completion_rows(rows_prompt, rows_completion, rows_adv, {"blocks": rows_blocks}, per_func,
                                  rows_meta)

