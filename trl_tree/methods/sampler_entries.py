"""The samplers: how one unit per prompt is grown, each registered with the config fields it reads, its leaves
and its cost per prompt (the trees themselves: `trl_tree.rollout.growing.samplers`)."""

from __future__ import annotations

from fractions import Fraction

from .registry import check_choice, register_sampler

_TREE_LIMITS = {
    "max_turns": "assistant turns per trajectory (final answer included)",
    "max_completion_length": "token budget of one trajectory",
    "packing": "training layout of a tree",
}
_M = {"num_initial_rollouts": "M: complete trajectories sampled per prompt"}
ANCHOR_RULES = ("uniform",)
EXPANSION_MODES = ("entropy", "random")


def _check_init_expand(args) -> None:
    check_choice("anchor_rule", args.anchor_rule, ANCHOR_RULES)
    if args.num_branches < 0:
        raise ValueError(f"num_branches (N) must be ≥ 0; got {args.num_branches}.")


def _check_entropy_guided(args) -> None:
    check_choice("expansion_mode", args.expansion_mode, EXPANSION_MODES)
    if args.expansion_rounds < 0 or args.branches_per_round < 0:
        raise ValueError("expansion_rounds and branches_per_round must be ≥ 0.")


def _check_token_entropy(args) -> None:
    if args.max_branches_per_tree < 0 or args.min_segment_length < 1 or args.branching_rounds < 1:
        raise ValueError(
            "Token-level branching needs max_branches_per_tree ≥ 0, min_segment_length ≥ 1 and branching_rounds ≥ "
            f"1; got {args.max_branches_per_tree}, {args.min_segment_length}, {args.branching_rounds}."
        )
    if args.entropy_threshold != args.entropy_threshold:
        raise ValueError("entropy_threshold is NaN; use float('inf') to turn token-level branching off.")


def _check_two_role(args) -> None:
    if args.max_blocks is None or args.max_blocks < 1:
        raise ValueError(f"max_blocks must be ≥ 1; got {args.max_blocks}.")


def _card_init_expand(args, trainer) -> str | None:
    M, N = args.num_initial_rollouts, args.num_branches
    if M is None or N is None:
        return None
    return (f"Each prompt grows one rollout tree: M = {M} complete multi-turn trajectories, then N = {N} "
            f"continuations of each from uniformly drawn turn prefixes, K = M(N + 1) = {M * (N + 1)} leaves; "
            "shared turns are merged and trained once.")


def _card_entropy_guided(args, trainer) -> str | None:
    M, L, K = args.num_initial_rollouts, args.expansion_rounds, args.branches_per_round
    if M is None:
        return None
    how = "those of highest node score" if args.expansion_mode == "entropy" else "chosen at random"
    return (f"Each prompt grows one rollout tree: M = {M} complete multi-turn trajectories, then L = {L} rounds that "
            f"each re-sample K = {K} turns ({how}) from their pre-turn history, M + L·K = "
            f"{M + L * K} leaves; shared turns are merged and trained once.")


def _card_token_entropy(args, trainer) -> str | None:
    M, B = args.num_initial_rollouts, args.max_branches_per_tree
    if M is None:
        return None
    return (f"Each prompt grows a forest of M = {M} trees: one complete trajectory each, branched inside its turns at "
            f"tokens whose entropy exceeds τ_H = {args.entropy_threshold:g}, at most {B} branch points per tree (1 to "
            f"{1 + B} leaves per tree, at most {M * (1 + B)} per prompt); shared prefixes are trained once.")


def _card_two_role(args, trainer) -> str | None:
    if getattr(args, "num_searches", None) is None:
        return None
    harness = getattr(trainer, "_harness", None)  # a custom harness passed to TreeFlexTrainer(harness=...)
    blocks = (
        "one Reflection block, then Execution segments that restart from restored checkpoint cards"
        if harness is None
        else f"grown by the custom harness `{type(harness).__name__}`"
    )
    return (f"Each task gets a group of K = {args.num_searches} complete searches, each of at most "
            f"{args.max_blocks} causal blocks ({blocks}); every generated token is trained once, in the block that "
            "generated it, and each search's score is compared within its group.")


@register_sampler(
    "init_expand",
    fields={
        **_M, "num_branches": "N: continuations branched from each trajectory", "anchor_rule": "branch points",
        **_TREE_LIMITS,
    },
    budget_field="num_initial_rollouts",
    leaves=lambda a: a.num_initial_rollouts * (a.num_branches + 1),
    budget=lambda a: a.num_initial_rollouts * (1 + Fraction(a.num_branches, 2)),
    budget_formula="M(1 + N/2)",
    leaves_formula="M(N + 1)",
    shape_fields={"num_branches": 0},  # N = 0 is flat sampling, a valid (if unbranched) tree
    derived=("num_branches",),
    check=_check_init_expand,
    card=_card_init_expand,
)
def _init_expand(args, loop, seed):
    """TreeOPSD: M complete trajectories, then N continuations of each from uniformly drawn turns (K = M(N + 1))."""
    from ..rollout.growing.samplers import InitExpandSampler

    return InitExpandSampler(loop, args.num_initial_rollouts, args.num_branches, seed=seed)


@register_sampler(
    "flat",
    fields={**_M, **_TREE_LIMITS},
    budget_field="num_initial_rollouts",
    leaves=lambda a: a.num_initial_rollouts,
    budget=lambda a: Fraction(a.num_initial_rollouts),
    budget_formula="M",
    leaves_formula="M",
)
def _flat(args, loop, seed):
    """No branching: M independent trajectories (flat multi-turn GRPO with credit="path", loss="grpo")."""
    from ..rollout.growing.samplers import InitExpandSampler

    return InitExpandSampler(loop, args.num_initial_rollouts, 0, seed=seed)


@register_sampler(
    "entropy_guided",
    fields={
        **_M,
        "expansion_rounds": "L: entropy-guided expansion rounds",
        "branches_per_round": "K: branches added per expansion round",
        "expansion_mode": "which turns are re-sampled: by node score or at random",
        "sibling_penalty": "α: node score S = H − α·max(0, siblings − 1)",
        **_TREE_LIMITS,
    },
    budget_field="num_initial_rollouts",
    leaves=lambda a: a.num_initial_rollouts + a.expansion_rounds * a.branches_per_round,
    budget=lambda a: a.num_initial_rollouts + Fraction(a.expansion_rounds * a.branches_per_round, 2),
    budget_formula="M + L·K/2 (L = expansion_rounds, K = branches_per_round)",
    leaves_formula="M + L·K",
    shape_fields={"expansion_rounds": 1, "branches_per_round": 1},
    needs_entropies=lambda a: a.expansion_mode == "entropy",  # A2 node scores
    check=_check_entropy_guided,
    card=_card_entropy_guided,
)
def _entropy_guided(args, loop, seed):
    """AT2PO A1–A2: M trajectories, then L rounds re-sampling the K turns of highest node score."""
    from ..rollout.growing.samplers import EntropyGuidedSampler

    return EntropyGuidedSampler(
        loop, args.num_initial_rollouts, args.expansion_rounds, args.branches_per_round,
        mode=args.expansion_mode, alpha=args.sibling_penalty, seed=seed,
    )


@register_sampler(
    "token_entropy",
    fields={
        **_M,
        "entropy_threshold": "τ_H: branch inside turns above this token entropy",
        "max_branches_per_tree": "branch points (new leaves) per tree at most",
        "min_segment_length": "fewest tokens of either piece of a split segment",
        "branching_rounds": "rounds of token-level branching",
        **_TREE_LIMITS,
    },
    budget_field="num_initial_rollouts",
    # a variable K: this is the budget M(1 + b); the sampler guarantees K ≥ 2 whenever that budget is ≥ 2
    leaves=lambda a: a.num_initial_rollouts * (1 + a.max_branches_per_tree),
    budget=lambda a: a.num_initial_rollouts * (1 + Fraction(a.max_branches_per_tree, 2)),
    budget_formula="M(1 + b/2) (b = max_branches_per_tree)",
    leaves_formula="at most M(1 + b)",
    shape_fields={"max_branches_per_tree": 1},
    needs_entropies=lambda a: True,  # branch points are high-entropy tokens
    variable_leaves=True,
    check=_check_token_entropy,
    card=_card_token_entropy,
)
def _token_entropy(args, loop, seed):
    """TreeAdv: a forest of M trajectories branched inside their turns at tokens of entropy above τ_H."""
    from ..rollout.growing.token_branching import TokenEntropySampler

    return TokenEntropySampler(
        loop, args.num_initial_rollouts, args.entropy_threshold, args.max_branches_per_tree,
        min_segment_length=args.min_segment_length, rounds=args.branching_rounds,
    )


@register_sampler(
    "two_role",
    fields={
        "num_searches": "K: complete searches per task (the group)",
        "max_blocks": "causal blocks per search at most",
        "max_card_chars": "characters kept of a checkpoint card copied into another block",
        "max_turns": "assistant turns per Execution segment (per block of a custom harness)",
        "max_completion_length": "token budget of one block after its context",
    },
    budget_field="num_searches",
    leaves=lambda a: a.num_searches,
    budget=lambda a: Fraction(a.num_searches),
    budget_formula="num_searches",
    leaves_formula="num_searches",
    leaf_tokens=lambda a: a.max_completion_length * a.max_blocks,  # each block has its own budget
    leaf_tokens_formula="max_completion_length × max_blocks",
    unit="group",
    check=_check_two_role,
    card=_card_two_role,
)
def _two_role(args, loop, seed):
    """TreeFlex: a Reflection block, then Execution segments restarting from restored checkpoint cards."""
    from ..rollout.growing.flex_harness import TwoRoleHarness

    return TwoRoleHarness(max_card_chars=args.max_card_chars)
