"""What a tree configuration costs and how many leaves it makes: the sampler budget arithmetic (docs/design.md §1).

The components themselves (samplers, credits, losses) are declared in the method table, `trl_tree.methods`; this
module answers, from that table, what a configuration costs and how many leaves it makes:

- `trajectory_budget` / `num_generations_of`: a tree's expected cost in complete trajectories, GRPO's G;
- `budget_for_generations` / `valid_budgets`: the sampler setting that gives a G asked for (config resolution and
  its error messages);
- `tree_size` / `check_tree_size` / `check_generations_fit`: the most a tree may hold, refused up front (with the
  arithmetic and the memory it implies) when no machine could hold it;
- `check_enough_prompts` / `effective_batch`: a dataset too small for one generation batch refused, and what a
  step costs, said once at start-up.
"""

from __future__ import annotations

import itertools
import math
from dataclasses import dataclass
from fractions import Fraction
from types import SimpleNamespace

from ... import methods
from ...text import plural

# Sanity bounds on one tree, checked up front by every configuration (`check_tree_size`): a tree is sampled, scored
# and packed whole on one process, so a tree past these is a typo or a unit mix-up that would otherwise die of
# MemoryError minutes in (M = N = 10 000 did, after 88 s). Far above every paper's trees (TreeOPSD K = 12, AT2PO 22)
# and a long-context agent's tree (the Qwen3-4B recipe: 12 leaves × 6,144 tokens = 73,728).
MAX_LEAVES_PER_TREE = 4096
MAX_TREE_TOKENS = 2**24
# Host bytes a generated token takes at the least, whatever the model: a Python int and a float in its turn's
# `action_ids` / `action_logps` (two 8-byte list slots, 28- and 24-byte objects: 68 bytes) and five int64 in the
# packed row (ids, positions, subtree end, score index, turn id: 40 bytes). A floor: the branches' histories, the
# trees' objects and the model's keys, values and activations come on top (benchmarks/bench_memory.py measures them).
MIN_HOST_BYTES_PER_TOKEN = 100
# Keys and values of one token of SmolLM2-135M in float32 (2 × 30 layers × 3 kv heads × 64 × 4 bytes): the errors'
# example of what a model adds per token, since a config does not know its model.
EXAMPLE_KV_BYTES_PER_TOKEN = 2 * 30 * 3 * 64 * 4


@dataclass(frozen=True)
class TreeSize:
    """The most one tree of a configuration may hold, from its fields alone (no model): `leaves` K (at most, for a
    variable K), its expected cost in complete `trajectories` (G before rounding) and `tokens`, the bound K × the
    tokens one leaf may generate."""

    leaves: int
    trajectories: Fraction
    tokens: int

    @property
    def min_host_bytes(self) -> int:
        """The host memory its `tokens` take at the least (`MIN_HOST_BYTES_PER_TOKEN` each), before any model."""
        return self.tokens * MIN_HOST_BYTES_PER_TOKEN


def tree_size(args) -> TreeSize:
    """`TreeSize` of a configuration whose sampler fields are resolved (the method table's declarations)."""
    sampler = methods.choice("sampler", args.sampler)
    leaves = sampler.leaves(args)
    return TreeSize(leaves=leaves, trajectories=sampler.budget(args), tokens=leaves * sampler.leaf_tokens(args))


def _gib(nbytes: int) -> str:
    return f"{nbytes / 2**30:,.1f} GiB" if nbytes < 2**40 else f"{nbytes / 2**40:,.1f} TiB"


def check_tree_size(args) -> None:
    """Refuse, before anything is built, a configuration whose tree could not be held (`MAX_LEAVES_PER_TREE`,
    `MAX_TREE_TOKENS`), with the arithmetic: leaves and trajectories per prompt, the token bound, the host memory it
    implies at the least, and the fields to lower. One check for every sampler (each declares its `leaves`, `budget`
    and `leaf_tokens` in `trl_tree.methods`)."""
    size = tree_size(args)
    if size.leaves <= MAX_LEAVES_PER_TREE and size.tokens <= MAX_TREE_TOKENS:
        return
    sampler = methods.SAMPLERS[args.sampler]
    shape = ", ".join(f"{name}={getattr(args, name)}" for name in (sampler.budget_field, *sampler.shape_fields))
    grows = (f"sampler={args.sampler!r} with {shape} grows K = {size.leaves:,} leaves per tree, costing "
             f"{sampler.budget_formula} = {float(size.trajectories):,.6g} trajectories of budget per prompt")
    _refuse(args, size, grows, (sampler.budget_field, *sampler.shape_fields))


def check_generations_fit(args) -> None:
    """A `num_generations` G past `MAX_LEAVES_PER_TREE` is refused before the budget arithmetic derives the sampler
    fields from it (its search for a split of G takes time in proportion to G: a minute for G = 10^6): every
    sampler's K is at least its cost in trajectories (a continuation costs half a trajectory and adds a whole leaf),
    so such a G has no tree that fits."""
    G, per_leaf = args.num_generations, args.max_completion_length
    if isinstance(G, bool) or not isinstance(G, int) or G <= MAX_LEAVES_PER_TREE:
        return
    if not isinstance(per_leaf, int) or per_leaf < 1:
        return  # no token bound to state: the field's own check refuses it (`TreeTrainerConfig._check_tree_fields`)
    asks = (f"num_generations={G:,} asks for trees of at least K = {G:,} leaves per prompt (every sampler's K is at "
            "least its cost in trajectories of budget)")
    _refuse(args, TreeSize(G, Fraction(G), G * methods.choice("sampler", args.sampler).leaf_tokens(args)), asks,
            ("num_generations",))


def _refuse(args, size: TreeSize, grows: str, fields: tuple[str, ...]) -> None:
    sampler = methods.SAMPLERS[args.sampler]
    per_leaf = sampler.leaf_tokens_formula.replace(
        "max_completion_length", f"max_completion_length {args.max_completion_length}"
    ).replace("max_blocks", f"max_blocks {getattr(args, 'max_blocks', None)}")
    over = (f"more than the {MAX_LEAVES_PER_TREE} leaves" if size.leaves > MAX_LEAVES_PER_TREE
            else f"more than the 2^24 = {MAX_TREE_TOKENS:,} tokens")
    raise ValueError(
        f"This configuration's tree is too large to hold: {grows}. Its leaves may generate up to {size.leaves:,} × "
        f"{per_leaf} = {size.tokens:,} tokens, {over} a tree may have (one tree is sampled, scored and packed whole "
        f"on one process). That is at least {_gib(size.min_host_bytes)} of host memory for the tokens alone "
        f"({MIN_HOST_BYTES_PER_TOKEN} bytes each), and the model's keys and values come on top (2 × layers × "
        f"kv_heads × head_dim × bytes per value a token; SmolLM2-135M in float32: "
        f"{EXAMPLE_KV_BYTES_PER_TOKEN / 1000:.0f} KB, {_gib(size.tokens * EXAMPLE_KV_BYTES_PER_TOKEN)} for these "
        f"tokens), then its activations in training. Lower {' or '.join(fields)} (what sets K) or "
        f"{sampler.leaf_tokens_formula.replace(' × ', ' or ')}; a GRPO-sized tree has tens of leaves (TreeOPSD's "
        "(M, N) = (4, 2): K = 12 for GRPO's G = 8)."
    )


def leaves_per_tree(args) -> int:
    """K for a configuration (`trl_tree.methods.Sampler.leaves`). Token-level branching ("token_entropy") has a
    variable K: this is its budget M(1 + max_branches_per_tree), and the sampler guarantees K ≥ 2 whenever that
    budget is ≥ 2."""
    return methods.choice("sampler", args.sampler).leaves(args)


def trajectory_budget(args) -> Fraction:
    """A tree's expected cost in complete trajectories: what GRPO's `num_generations` (G) buys per prompt.

    Each sampler declares its own, in the method table (`trl_tree.methods.Sampler.budget`, written out as its
    `budget_formula`; the README's table of them is checked against it). Where a sampler branches, a continuation
    counts as half a trajectory: on average it regenerates half of one, resuming from a turn or token drawn inside it.
    `num_generations_of` rounds the cost up to whole trajectories.
    """
    return methods.choice("sampler", args.sampler).budget(args)


def budget_formula(sampler: str) -> str:
    return methods.SAMPLERS[sampler].budget_formula


def num_generations_of(args) -> int:
    """G for a configuration: `trajectory_budget` rounded up to whole trajectories."""
    return math.ceil(trajectory_budget(args))


def budget_field(args) -> str:
    """The field that `num_generations` sets when only G is given: M, or TreeFlex's group size."""
    return methods.choice("sampler", args.sampler).budget_field


def budget_for_generations(args, num_generations: int) -> int | None:
    """The value of `budget_field` (M, or TreeFlex's K) whose `num_generations_of` is exactly G, or None.

    Every budget is linear in that field, b(M) = b0 + slope·M with slope ≥ 1, so at most one M has ⌈b(M)⌉ = G:
    G − 1 < b0 + slope·M ≤ G."""
    field = budget_field(args)
    b0 = trajectory_budget(replace_fields(args, **{field: 0}))
    slope = trajectory_budget(replace_fields(args, **{field: 1})) - b0
    value = math.floor((num_generations - b0) / slope)
    return value if value >= 1 and b0 + slope * value > num_generations - 1 else None


def shape_for_generations(args, num_generations: int, name: str, preferred: int) -> tuple[int, int] | None:
    """(budget field's value, `name`'s value) reaching G when only G is given and the preset's value `preferred` of
    the sampler's derivable shape field `name` (`Sampler.derived`: init_expand's N) cannot: the value ≥ 1 nearest to
    it (a tree that still branches; N = 0 would silently turn the method into flat GRPO), among equally near ones the
    one whose budget is exactly G (nothing lost to rounding), then the smaller. None when no value ≥ 1 reaches G with
    K ≥ 2. For init_expand any G ≥ 2 is reached: M = 1 with N = 2G − 2 costs exactly G."""
    sampler, field = methods.choice("sampler", args.sampler), budget_field(args)
    found = []
    for n in range(1, 2 * num_generations + 1):
        candidate = replace_fields(args, **{name: n})
        m = budget_for_generations(candidate, num_generations)
        if m is not None and sampler.leaves(replace_fields(candidate, **{field: m})) >= 2:
            waste = num_generations - trajectory_budget(replace_fields(candidate, **{field: m}))
            found.append((abs(n - preferred), waste, n, m))
    return (found and (min(found)[3], min(found)[2])) or None


def valid_budgets(args, num_generations: int, limit: int = 8) -> list[str]:
    """Settings that give G, for error messages: the budget field's value with the sampler's other fields as they
    are, then the values it takes as its `shape_fields` vary (each from its least value to 2G; trees keep K ≥ 2
    leaves)."""
    sampler = methods.SAMPLERS[args.sampler]
    field, found = budget_field(args), []
    shapes = [range(least, 2 * num_generations + 1) for least in sampler.shape_fields.values()]
    current = tuple(getattr(args, name) for name in sampler.shape_fields)
    for values in [current, *(v for v in itertools.product(*shapes) if v != current)]:
        candidate = replace_fields(args, **dict(zip(sampler.shape_fields, values)))
        value = budget_for_generations(candidate, num_generations)
        if value is None or sampler.leaves(replace_fields(candidate, **{field: value})) < 2:
            continue
        found.append(", ".join(f"{name}={v}" for name, v in ((field, value), *zip(sampler.shape_fields, values))))
        if len(found) > limit:
            return found[:limit] + ["and more"]
    return found


def replace_fields(args, **changes):
    """A shallow copy of a config-like object with some fields changed (for what-if budget arithmetic)."""
    return SimpleNamespace(**{**vars(args), **changes})


def check_enough_prompts(args, dataset) -> None:
    """A dataset smaller than one generation batch would train 0 steps and exit as if it had succeeded."""
    from datasets import IterableDataset

    needed = args.prompts_per_generation
    if dataset is None or isinstance(dataset, IterableDataset) or len(dataset) >= needed:
        return
    raise ValueError(
        f"train_dataset has {len(dataset)} prompts, but one generation batch needs {needed} "
        f"(generation_batch_size {args.generation_batch_size} / num_generations {args.num_generations}"
        f" = per_device_train_batch_size / num_generations × processes × steps_per_generation). Lower "
        "per_device_train_batch_size, steps_per_generation or generation_batch_size, or use more prompts."
    )


def effective_batch(args, owner: str) -> str:
    """What a step costs, in the user's terms: the line a trainer prints once at start-up (main process)."""
    per_step = args.trees_per_micro_batch * args.world_size * args.gradient_accumulation_steps
    trajectories = per_step * float(trajectory_budget(args))
    return (
        f"{owner}: num_generations G = {plural(args.num_generations, 'trajectory', 'trajectories')} "
        f"of budget per prompt; {plural(args.prompts_per_generation, 'prompt')} per generation batch; "
        f"{plural(args.trees_per_micro_batch, 'tree')} per micro-batch per process; K = "
        f"{plural(args.leaves_per_tree, 'leaf', 'leaves')} per tree"
        + (" (at most)" if methods.SAMPLERS[args.sampler].variable_leaves else "")
        + f"; {plural(per_step, 'prompt')} and {plural(trajectories, 'expected trajectory', 'expected trajectories')}"
        f" per optimizer step; E = {plural(args.num_optimizer_blocks, 'optimizer block')} per generation batch."
    )
