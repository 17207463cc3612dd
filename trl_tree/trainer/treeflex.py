"""`TreeFlexTrainer`: complete searches as group members, causal blocks, turn penalties, dual clip (docs/design.md §3 F1–F4).

The rollout
-----------
A harness (`trl_tree.rollout.flex_harness`; the rollout format is documented there) grows, per task, K complete
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
- **Aggregation as precomputed weights** (F4): at generation time every turn gets a per-token weight w_i such that a
  group's loss is the weighted token sum Σ_t w_{turn(t)} l_t, which equals `losses.aggregate` over the group for the
  chosen mode (token / block / rollout / role, mixed with the role mean by λ). The micro-batch loss is the mean over
  its groups of that sum (like the other tree trainers' mean over trees), so `_compute_loss` stays a weighted sum.
  Every mode is thus per group and each task counts equally in a batch ("token" is the token mean of a group, not
  of the whole batch).
- **Loss** (F3): `losses.dual_clip_loss` per token, PPO clip ε (ε_high) and for A < 0 the dual clip at −c·A, c = 3.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, ClassVar

import torch
from torch import Tensor

from .. import credit, losses, trl_internals
from ..packing import PackedTrees, pack_trees, packed_token_logps, pad_rows
from ..rollout.flex_harness import FlexBlock, FlexHarness, FlexKit, FlexSearch, FlexTask, TwoRoleHarness
from ..tree import RolloutTree
from .base import TreeTrainer
from .config import TreeConfig

HARNESSES = ("two_role",)
PENALTY_MODES = ("pre_norm", "post_norm")

# ---------------------------------------------------------------------------------------------------------------
# F4 as weights
# ---------------------------------------------------------------------------------------------------------------


def _unit_weights(lengths: Tensor, unit_ids: Tensor) -> Tensor:
    """w_i = 1 / (#units · L_u(i)): the mean within each unit, then the mean over the units with trained tokens."""
    _, inverse = torch.unique(unit_ids, return_inverse=True)
    totals = torch.zeros(int(inverse.max()) + 1, dtype=torch.float64).index_add_(0, inverse, lengths)
    units = int((totals > 0).sum())
    mine = totals[inverse]
    return torch.where(mine > 0, 1.0 / (units * mine.clamp(min=1e-300)), torch.zeros_like(mine))


def aggregation_weights(
    lengths: Tensor, search_ids: Tensor, block_ids: Tensor, role_ids: Tensor, mode: str = "rollout",
    role_lambda: float = 0.0,
) -> Tensor:
    """TreeFlex F4 for one group as a per-token weight of each turn: Σ_t w_{turn(t)} l_t = `losses.aggregate(l, …)`.

        token:    w_i = 1 / L                         L = the group's trained tokens
        block:    w_i = 1 / (#blocks · L_b(i))        every block equal; more blocks, more weight for their search
        rollout:  w_i = 1 / (#searches · L_s(i))      every complete search equal, whatever its length or blocks
        role:     w_i = 1 / (#roles · L_ρ(i))         Reflection and Execution equal
        mixed:    w = (1 − λ) w_mode + λ w_role

    Units without trained tokens are ignored (as in `losses.aggregate`); Σ_i w_i L_i = 1 when anything is trained.

    Args:
        lengths: L_i, trained tokens per turn (0 for a masked turn); search_ids, block_ids, role_ids: per turn.
    """
    if mode not in losses.AGGREGATION_MODES:
        raise ValueError(f"aggregation must be one of {losses.AGGREGATION_MODES}, got {mode!r}.")
    if not 0.0 <= role_lambda <= 1.0:
        raise ValueError(f"role_lambda must lie in [0, 1], got {role_lambda}.")
    lengths = torch.as_tensor(lengths, dtype=torch.float64)
    if lengths.numel() == 0:
        return lengths.clone()
    units = {"block": block_ids, "rollout": search_ids, "role": role_ids}

    def weights(unit: str) -> Tensor:
        if unit == "token":
            total = lengths.sum()
            return torch.full_like(lengths, 1.0 / float(total) if total > 0 else 0.0)
        return _unit_weights(lengths, torch.as_tensor(units[unit]))

    if mode == "role" or role_lambda == 1.0:
        return weights("role")
    base = weights(mode)
    return base if role_lambda == 0.0 else (1 - role_lambda) * base + role_lambda * weights("role")


# ---------------------------------------------------------------------------------------------------------------
# A task's group as trainable blocks
# ---------------------------------------------------------------------------------------------------------------


@dataclass
class FlexGroup:
    """One task's K complete searches laid out for training.

    Turns are numbered group-wide: blocks in order (search by search, each search's blocks in its order, blocks
    without turns skipped), each block's turns in order. Every per-turn tensor below uses that order.

    Attributes:
        searches: the harness's searches; scores: their K terminal scores.
        trees: one single-trajectory `RolloutTree` per trained block (prompt = the block's context).
        block_offsets: the group-wide id of each tree's first turn.
        turn_search, turn_block, turn_role: per turn, its search (0..K−1), block (group-wide) and role index.
        penalties: Q_i ≤ 0 per turn; lengths: trained tokens per turn (0 for a masked truncated turn).
    """

    searches: list[FlexSearch]
    scores: Tensor
    trees: list[RolloutTree]
    block_offsets: list[int]
    turn_search: Tensor
    turn_block: Tensor
    turn_role: Tensor
    penalties: Tensor
    lengths: Tensor
    masked_turns: list[int] = field(default_factory=list)

    @property
    def num_turns(self) -> int:
        return int(self.turn_search.numel())

    @classmethod
    def build(cls, searches: list[FlexSearch], scores: Tensor, roles: tuple[str, ...], extra_penalty=None,
              mask_truncated: bool = False) -> FlexGroup:
        """Lay out one group. `extra_penalty(search, block, turn_index) -> float` (≤ 0) adds to `Turn.penalty`."""
        trees, offsets, t_search, t_block, t_role, penalties, lengths, masked = [], [], [], [], [], [], [], []
        for s, search in enumerate(searches):
            for block in search.blocks:
                if not block.turns:
                    continue
                if block.role not in roles:
                    raise ValueError(f"A block has role {block.role!r}, not among the harness's roles {roles}.")
                if not block.context_ids:
                    raise ValueError(
                        f"A block of search {s} has an empty context: every block needs at least its rendered "
                        "context (the chat template's assistant header at least), which scores its first token."
                    )
                b = len(trees)
                offsets.append(len(t_search))
                trees.append(RolloutTree.from_trajectories(block.context_ids, [block.turns], [float(scores[s])]))
                for i, turn in enumerate(block.turns):
                    t_search.append(s)
                    t_block.append(b)
                    t_role.append(roles.index(block.role))
                    extra = 0.0 if extra_penalty is None else float(extra_penalty(search, block, i))
                    penalties.append(float(turn.penalty) + extra)
                    drop = mask_truncated and turn.truncated
                    if drop:
                        masked.append(len(t_search) - 1)
                    lengths.append(0 if drop else len(turn.action_ids))
        if not trees:
            raise ValueError("None of the task's searches has a block with a generated turn: nothing to train.")
        long = dict(dtype=torch.long)
        return cls(
            searches=searches, scores=torch.as_tensor(scores, dtype=torch.float64), trees=trees, block_offsets=offsets,
            turn_search=torch.tensor(t_search, **long), turn_block=torch.tensor(t_block, **long),
            turn_role=torch.tensor(t_role, **long), penalties=torch.tensor(penalties, dtype=torch.float64),
            lengths=torch.tensor(lengths, dtype=torch.float64), masked_turns=masked,
        )


def pack_groups(groups: list[FlexGroup], pad_token_id: int) -> PackedTrees:
    """[groups, max blocks, T]: row r of group n is its r-th block (a single causal path), turn ids group-wide.

    Each block is packed by `pack_trees` as a one-path tree, its turn ids shifted to group-wide ones, and the rows
    are stacked per group by `packing.pad_rows` (the padding convention of every packed layout); rows past a group's
    block count are padding (valid = 0, skipped by the forward). Masked turns (`FlexGroup.masked_turns`) get turn id
    and score index −1.
    """
    flat = pack_trees([tree for g in groups for tree in g.trees], pad_token_id, layout="tree")
    blocks = iter(range(flat.num_trees))  # the trees in group order, one per block
    rows = []
    for group in groups:
        rows.append([])
        for offset in group.block_offsets:
            row = flat.row(next(blocks))
            row["turn_ids"] = torch.where(row["turn_ids"] >= 0, row["turn_ids"] + offset, row["turn_ids"])
            rows[-1].append(row)
    packed = pad_rows(rows, pad_token_id)
    for n, group in enumerate(groups):
        if group.masked_turns:
            hit = torch.isin(packed.turn_ids[n], torch.tensor(group.masked_turns))
            packed.turn_ids[n][hit] = -1
            packed.score_index[n][hit] = -1
    return packed


# ---------------------------------------------------------------------------------------------------------------
# Configuration
# ---------------------------------------------------------------------------------------------------------------


@dataclass
class TreeFlexConfig(TreeConfig):
    """Configuration of `TreeFlexTrainer` (docs/design.md §3 F1–F4). Shares `TreeConfig`'s tool and budget fields.

    Parameters:
        sampler (`str`, defaults to `"two_role"`): the built-in harness (Reflection + Execution segments). Ignored
            when a `harness=` object is passed to the trainer.
        credit (`str`, defaults to `"search"`): fixed: F1–F2 group-relative credit over complete searches.
        loss (`str`, defaults to `"dual_clip"`): fixed: F3 PPO clip with the dual clip.
        num_searches (`int`, *optional*): K, complete searches per task (the group; at least 2). Defaults to 4, or to
            GRPO's `num_generations` when only that is set: a complete search is one member of the group, as a
            completion is in GRPO, so G = K.
        max_blocks (`int`, defaults to `4`): causal blocks per search at most (two-role: one Reflection block and up
            to `max_blocks − 1` Execution segments).
        penalty_mode (`str`, defaults to `"pre_norm"`): `"pre_norm"` A = (R + Q − mean)/divisor, `"post_norm"`
            A = (R − mean)/divisor + Q.
        aggregation (`str`, defaults to `"rollout"`): the unit that gets equal weight: `"token"`, `"block"`,
            `"rollout"` (each complete search; the paper's setup) or `"role"`.
        role_lambda (`float`, defaults to `0.0`): λ ∈ [0, 1] mixing the role mean into the aggregation (paper: 0).
        dual_clip_c (`float`, defaults to `3.0`): c of the dual clip for negative advantages (c > 1).
        max_card_chars (`int`, defaults to `2000`): a checkpoint card copied into another block is cut here.
        max_turns (`int`, defaults to `5`): assistant turns per Execution segment (per block of a custom harness).
        max_completion_length: token budget of one block after its context (generated plus appended tokens).
        tool_failure_penalty (`float`, defaults to `-1.0`): Q per malformed or rejected tool call (≤ 0).
        num_initial_rollouts, num_branches, target_radius, anchor_rule, expansion_*: unused (None or ignored);
            `packing` too: every block is one causal path.
    """

    sampler: str = field(default="two_role", metadata={"help": "The harness: two_role (or pass harness=)."})
    credit: str = field(default="search", metadata={"help": "Fixed: search-group credit with turn penalties."})
    loss: str = field(default="dual_clip", metadata={"help": "Fixed: PPO clip + dual clip."})
    num_searches: int | None = field(
        default=None, metadata={"help": "K: complete searches per task (the group; default 4, or num_generations)."}
    )
    max_blocks: int = field(default=4, metadata={"help": "Causal blocks per search at most."})
    penalty_mode: str = field(default="pre_norm", metadata={"help": "pre_norm | post_norm"})
    aggregation: str = field(default="rollout", metadata={"help": "token | block | rollout | role"})
    role_lambda: float = field(default=0.0, metadata={"help": "λ: weight of the role mean in the aggregation."})
    dual_clip_c: float = field(default=3.0, metadata={"help": "c of the dual clip (A < 0), c > 1."})
    max_card_chars: int | None = field(default=2000, metadata={"help": "Cut for cards copied into other blocks."})
    # tree-sampler fields that do not apply (None keeps them out of the model card)
    num_initial_rollouts: int | None = field(default=None, metadata={"help": "Unused by TreeFlex."})
    num_branches: int | None = field(default=None, metadata={"help": "Unused by TreeFlex."})
    target_radius: float | None = field(default=None, metadata={"help": "Unused by TreeFlex."})
    anchor_rule: str | None = field(default=None, metadata={"help": "Unused by TreeFlex."})

    maps_tool_calling_iterations: ClassVar[bool] = False  # max_turns is per segment here

    @property
    def leaves_per_tree(self) -> int:
        """K: complete searches per task (the group members)."""
        return self.num_searches

    @classmethod
    def _default_budget(cls, field_name: str) -> int:
        return 4  # num_searches

    def _check_composition(self):
        fixed = {"credit": ("search", self.credit), "loss": ("dual_clip", self.loss)}
        for name, (want, value) in fixed.items():
            if value != want:
                raise ValueError(
                    f"TreeFlexConfig.{name} is fixed to {want!r} (got {value!r}): TreeFlex's credit and loss are F1–F3;"
                    " vary them with penalty_mode, aggregation, role_lambda and dual_clip_c."
                )
        checks = [
            ("sampler", self.sampler, HARNESSES),
            ("penalty_mode", self.penalty_mode, PENALTY_MODES),
            ("aggregation", self.aggregation, losses.AGGREGATION_MODES),
        ]
        for name, value, valid in checks:
            if value not in valid:
                raise ValueError(f"{name} must be one of {valid}; got {value!r}.")
        self._resolve_budget()
        if self.num_searches < 2:
            raise ValueError(
                f"num_searches (K) must be ≥ 2: the group compares complete searches; got {self.num_searches}."
            )
        if self.max_blocks is None or self.max_blocks < 1:
            raise ValueError(f"max_blocks must be ≥ 1; got {self.max_blocks}.")
        if not 0.0 <= self.role_lambda <= 1.0:
            raise ValueError(f"role_lambda must lie in [0, 1]; got {self.role_lambda}.")
        if not self.dual_clip_c > 1.0:
            raise ValueError(f"dual_clip_c must exceed 1; got {self.dual_clip_c}.")
        if self.tool_failure_penalty > 0:
            raise ValueError(f"tool_failure_penalty is a process penalty Q ≤ 0; got {self.tool_failure_penalty}.")


# ---------------------------------------------------------------------------------------------------------------
# Trainer
# ---------------------------------------------------------------------------------------------------------------


@dataclass
class _Scored:
    """What `TreeTrainer._score_leaves` reads from a leaf, for one complete search."""

    messages: list[dict]
    prefix_ids: list[int]
    env: Any
    prompt_len: int = 0


class TreeFlexTrainer(TreeTrainer):
    """Drop-in `GRPOTrainer` replacement training with TreeFlex.

    Args:
        harness: a `FlexHarness` (see `trl_tree.rollout.flex_harness` for the rollout format); default: the two-role
            harness of `args.sampler`.
        Other arguments: as `GRPOTrainer` (`tools=` / `environment_factory=`, reward functions, PEFT, …).

    Hooks: `process_penalty(example, search, block, turn_index) -> float` adds a penalty Q ≤ 0 to a turn (default
    0); `turn_credit(group)` returns the per-turn tensors of a group; `turn_loss(flat, mode)` the micro-batch loss.

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

    _name = "TreeFlex"
    _tag_names = ["trl", "trl-tree", "treeflex"]
    config_class = TreeFlexConfig

    def __init__(self, model, reward_funcs=None, args: TreeFlexConfig | None = None, harness: FlexHarness | None = None,
                 **kwargs):
        if args is not None and not isinstance(args, TreeFlexConfig):
            raise TypeError(f"TreeFlexTrainer needs a TreeFlexConfig, got {type(args).__name__}.")
        self._harness = harness
        super().__init__(model, reward_funcs, args=args, **kwargs)

    def build_sampler(self, loop):
        self._turn_loop = loop
        if self._harness is not None:
            return self._harness
        return TwoRoleHarness(max_card_chars=self.args.max_card_chars)

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
        dummy-conversation difference, so the history stays token-in, token-out.
        """
        if all(m.get("role") == "tool" for m in messages):
            return list(trl_internals.tool_suffix_ids(self, messages))
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

    def turn_credit(self, group: FlexGroup) -> dict[str, Tensor]:
        """Per-turn tensors of one group (group-wide turn order): A (F1–F2), w (F4 weights) and the turn's ids."""
        A = credit.process_advantages(group.scores, group.penalties, group.turn_search, mode=self.args.penalty_mode)
        w = aggregation_weights(group.lengths, group.turn_search, group.turn_block, group.turn_role,
                                self.args.aggregation, self.args.role_lambda)
        return {"A": A.float(), "w": w.float(), "penalty": group.penalties.float(), "search": group.turn_search,
                "block": group.turn_block, "role": group.turn_role}

    # ---------------------------------------------------------------- generation

    def _generate_micro_batches(self, inputs: list[dict[str, Any]], num_chunks: int) -> list[dict[str, Tensor]]:
        """Run the harness on one generation batch of tasks, score the searches and build one group per task; then,
        as for trees (`TreeTrainer._micro_batches`), pack whole groups per micro-batch and recompute π_old on each
        with the very packed forward that trains it (a whole-batch forward would differ by ~1e-9, which Adam turns
        into real updates when every advantage is 0)."""
        mode = "train" if self.model.training else "eval"
        if any("image" in x or "images" in x for x in inputs):
            raise ValueError("TreeFlexTrainer supports text-only prompts; this batch has images.")
        prompts, roots = self._prepare_roots(inputs)
        tasks = [FlexTask(p, r.prompt_ids, r.env, r.tools, r.environment) for p, r in zip(prompts, roots)]
        searches_per_task = self.harness.run(tasks, self.flex_kit())
        if len(searches_per_task) != len(tasks) or any(not s for s in searches_per_task):
            raise ValueError("The harness must return a non-empty list of complete searches for every task.")

        scores = self._score_leaves(inputs, prompts, [[_as_scored(s) for s in ss] for ss in searches_per_task])
        roles = tuple(self.harness.roles)
        groups = []
        for example, searches, r in zip(inputs, searches_per_task, scores):
            def extra(search, block, i, example=example):
                return self.process_penalty(example, search, block, i)

            groups.append(FlexGroup.build(searches, r, roles, extra, self.mask_truncated_completions))
        batches, per_turn, forward_tokens = self._micro_batches(groups, num_chunks, mode)
        self._log_flex(mode, prompts, groups, scores, per_turn, forward_tokens)
        return batches

    def _pack_with_behaviour_logps(self, groups: list[FlexGroup], mode: str) -> tuple[PackedTrees, Tensor]:
        """One micro-batch of whole groups (one row per block) and π_old's log-probs on it."""
        packed = pack_groups(groups, trl_internals.tokenizer(self).pad_token_id)
        with torch.no_grad():
            old_logps, _ = packed_token_logps(self.model, packed.to(self.accelerator.device),
                                              temperature=self.temperature)
        return packed, old_logps

    # ---------------------------------------------------------------- loss

    def turn_loss(self, flat: dict[str, Tensor], mode: str) -> Tensor:
        """Mean over the micro-batch's groups of Σ_t w_{turn(t)} · dual_clip(r_t, A_{turn(t)}) (F3–F4)."""
        a = self.args
        ids = flat["turn_ids"]
        A, w = flat["A"][ids], flat["w"][ids]
        per_token = losses.dual_clip_loss(flat["logps"], flat["old_logps"], A, epsilon=a.epsilon, c=a.dual_clip_c,
                                          epsilon_high=a.epsilon_high)
        loss = (w.to(per_token) * per_token).sum() / max(int(flat["num_trees"]), 1)
        with torch.no_grad():
            ratio = (flat["logps"] - flat["old_logps"]).exp()
            dual = (A < 0) & (ratio > a.dual_clip_c)
            s = losses.turn_mean_log_ratio(flat["logps"], flat["old_logps"], ids, flat["A"].numel())
            self._log_clip_ratio(mode, _search_clip_counts(flat, a))
        block = self._optimizer_block()
        metrics = trl_internals.metrics(self, mode)
        metrics[f"tree/abs_log_ratio/block_{block}"].append(self._mean_over_ranks(s.abs().tolist()))
        metrics["treeflex/dual_clip_fraction"].append(self._mean_over_ranks(dual.float().tolist()))
        return loss

    # ---------------------------------------------------------------- metrics

    def _log_flex(self, mode, prompts, groups: list[FlexGroup], scores, per_turn, forward_tokens: int):
        """GRPO's metrics (`TreeTrainer._log_rollout_metrics`: a completion is a complete search, its group the task's
        searches; a search counts as cut when any of its turns was cut by its block's budget) and TreeFlex's own."""
        metrics = trl_internals.metrics(self, mode)
        searches = [s for g in groups for s in g.searches]
        self._count_forward_tokens(mode, forward_tokens)
        self._log_rollout_metrics(
            mode, [len(g.searches) for g in groups],
            [sum(len(t.action_ids) for b in s.blocks for t in b.turns) for s in searches],
            [any(t.truncated for b in s.blocks for t in b.turns) for s in searches],
            [s.tool_calls for s in searches], [s.tool_failures for s in searches],
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
        metrics["tree/abs_turn_advantage"].append(self._mean_over_ranks(
            [a for d in per_turn for a in d["A"].abs().tolist()]))
        for r, role in enumerate(self.harness.roles):
            share = [float(g.lengths[g.turn_role == r].sum() / g.lengths.sum().clamp(min=1)) for g in groups]
            metrics[f"treeflex/token_share/{role}"].append(self._mean_over_ranks(share))
        if self.log_completions:
            self._log_flex_completions(prompts, groups)
            if self._tree_view is not None:
                self._tree_view.record_flex(mode, prompts, groups, per_turn)

    def _log_flex_completions(self, prompts, groups: list[FlexGroup]):
        from accelerate.utils import gather_object

        rows_prompt, rows_completion, rows_adv, rows_blocks = [], [], [], []
        for prompt, group in zip(prompts, groups):
            advantages = credit.group_normalize(group.scores)
            for search, a in zip(group.searches, advantages.tolist()):
                rows_prompt.append(prompt)
                rows_completion.append(search.completion)
                rows_adv.append(a)
                rows_blocks.append(" | ".join(f"{b.role}:{len(b.context_ids)}+{len(b.turns)}t" for b in search.blocks))
        trl_internals.completion_logs(self)["prompt"].extend(gather_object(rows_prompt))
        trl_internals.completion_logs(self)["completion"].extend(gather_object(rows_completion))
        for i, name in enumerate(self.reward_func_names):
            col = self.accelerator.gather(self._last_rewards_per_func[:, i].to(self.accelerator.device))
            trl_internals.completion_logs(self)["rewards"][name].extend(col.tolist())
        trl_internals.completion_logs(self)["advantages"].extend(gather_object(rows_adv))
        trl_internals.completion_logs(self)["extra"]["blocks"].extend(gather_object(rows_blocks))


def _search_clip_counts(flat: dict[str, Tensor], args: TreeFlexConfig) -> Tensor:
    """GRPO's clip counts (`losses.token_clip_counts`) with each complete search as the sequence: a turn belongs to
    exactly one search, numbered across the micro-batch's groups."""
    searches = flat["search"].long()
    _, path_of_turn = torch.unique(flat["tree_ids"].long() * (int(searches.max()) + 1) + searches, return_inverse=True)
    return losses.token_clip_counts(
        flat["logps"], flat["old_logps"], flat["turn_ids"], flat["A"], path_of_turn,
        torch.arange(path_of_turn.numel(), device=path_of_turn.device), int(path_of_turn.max()) + 1,
        epsilon_low=args.epsilon, epsilon_high=args.epsilon_high if args.epsilon_high is not None else args.epsilon,
    )


def _as_scored(search: FlexSearch) -> _Scored:
    generated = [tok for block in search.blocks for turn in block.turns for tok in turn.action_ids]
    return _Scored(messages=search.completion, prefix_ids=generated, env=search.env)
