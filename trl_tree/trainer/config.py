"""Configurations of the tree trainers: `GRPOConfig` subclasses with the tree fields (DESIGN §1, §3).

Sequential optimizer blocks (the paper's E): one generation batch of B prompts is split into E mini-batches of whole
trees, one optimizer step each. In TRL terms, with W processes:

    per_device_train_batch_size   trees per micro-batch on each process
    gradient_accumulation_steps   micro-batches per optimizer step
    steps_per_generation          micro-batches per generation batch  = E × gradient_accumulation_steps
    B = per_device_train_batch_size × W × steps_per_generation

e.g. the paper's B = 256, E = 4 on 8 GPUs: per_device_train_batch_size = 8, gradient_accumulation_steps = 1,
steps_per_generation = 4 (each block: 64 trees). `num_iterations` stays 1: the repeated optimisation on one batch
*is* the E blocks.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from trl import GRPOConfig
from trl.trainer.base_config import _BaseConfig

PACKING_LAYOUTS = ("tree", "paths", "auto")
MALFORMED_TOOL_CALL_POLICIES = ("observe", "end")
ANCHOR_RULES = ("uniform",)
GENERATION_CACHES = ("static", "dynamic")


@dataclass
class TreeConfig(GRPOConfig):
    """Fields shared by every tree trainer (the sampler budget, tools, packing).

    Composition (see `trl_tree.trainer.components`): `sampler` ("init_expand", "flat", "entropy_guided",
    "token_entropy"), `credit` ("likelihood", "child_mean", "child_softmax", "leaf_mean", "path") and `loss`
    ("treeopsd", "treepo", "atpo", "grpo", "gspo_token") are chosen independently; the named configs are presets.

    Parameters:
        sampler (`str`, defaults to `"init_expand"`): how trees grow.
        credit (`str`, defaults to `"likelihood"`): how leaf advantages are backed up to turns.
        loss (`str`, defaults to `"treeopsd"`): the turn-level objective.
        reward_std (`str`, defaults to `"sample"`): leaf standardisation: `"sample"` (ddof = 1, no epsilon; TreeOPSD
            T1, TreeAdv D1) or `"population"` (ddof = 0, + 1e-6; AT2PO A3).
        num_initial_rollouts (`int`, defaults to `4`): M, complete trajectories sampled per prompt.
        num_branches (`int`, defaults to `2`): N, continuations branched from each initial trajectory at uniformly
            drawn turn prefixes ("init_expand"). K = M(N + 1); (4, 2) matches GRPO's G = 8 in expected cost.
        anchor_rule (`str`, defaults to `"uniform"`): N turn indices uniformly from {1..T−1} with replacement (index
            0, a resample from the prompt, when T = 1).
        expansion_rounds (`int`, defaults to `2`): L, rounds of entropy-guided expansion ("entropy_guided").
        branches_per_round (`int`, defaults to `6`): K new branches per round ("entropy_guided").
        expansion_mode (`str`, defaults to `"entropy"`): `"entropy"` (A2 node scores) or `"random"` (ablation).
        sibling_penalty (`float`, defaults to `0.05`): α in S_i = H_i − α·max(0, siblings − 1).
        entropy_threshold (`float`, defaults to `1.0`): τ_H in nats ("token_entropy", TreeAdv): action tokens whose
            entropy exceeds it are branch points inside a completion. `float("inf")` turns branching off.
        max_branches_per_tree (`int`, defaults to `2`): cap on branch points (new leaves) per tree ("token_entropy");
            each of the M trees has 1 to 1 + this many leaves.
        min_segment_length (`int`, defaults to `8`): both pieces of a segment split at a branch point keep at least
            this many tokens ("token_entropy").
        branching_rounds (`int`, defaults to `1`): rounds of token-level branching; a continuation may branch again
            in a later round ("token_entropy").
        target_radius (`float`, defaults to `0.25`): ρ for the "treeopsd" loss: q ∈ [1/2 − ρ, 1/2 + ρ], 0 < ρ < 1/2.
        max_turns (`int`, defaults to `5`): assistant turns per trajectory, the final answer included (the paper's
            five for multi-hop QA). A tool call in the last allowed turn ends the trajectory unexecuted.
        packing (`str`, defaults to `"tree"`): `"tree"` forwards each tree once as a packed row of its unique tokens
            with an ancestor-only attention mask (sdpa / eager / flex_attention); `"paths"` forwards one causal row
            per root-to-leaf path (any attention kernel, e.g. flash-attention) and still trains each unique token once.
            `"auto"` picks one of the two per micro-batch from the cost of the forward (`packing.pack_cheapest`):
            "tree" with flex_attention, "paths" with kernels that take no mask, and with sdpa / eager whichever costs
            fewer multiply-adds, since a dense mask pays all T² pairs of a long tree row. Same log-probs either way.
        tool_timeout (`float`, defaults to `30.0`): seconds a tool call may run before it becomes an error observation.
        max_observation_chars (`int`, defaults to `16384`): a tool's output is cut at this many characters, with a
            marker saying how much was dropped (the paper's limit for retrieved observations).
        tool_failure_penalty (`float`, defaults to `-1.0`): process penalty Q recorded on a turn per failed or
            malformed tool call (used by TreeFlex; the other methods only log it).
        malformed_tool_calls (`str`, defaults to `"observe"`): what follows a turn that tries to call a tool but whose
            call does not parse (a `<tool_call>` tag without valid JSON). `"observe"`: an error observation saying
            how to write the call, and the trajectory goes on (the model can repair it; TreeFlex penalises the
            turn). `"end"`: the trajectory ends at that turn and is scored as it is, as TRL's GRPO tool loop does
            (its parser finds no tool call, so the turn is final). Either way the call counts as a tool failure.
        max_turn_tokens (`int` or `None`, defaults to `None`): tokens one sampled assistant turn may have (`None`: only
            `max_completion_length` bounds it). A `generate` call lasts as long as its longest row, so one rambling
            turn holds every other branch of the batch waiting; a turn cut by the cap ends its trajectory and is
            masked out of the loss like a truncated completion. GRPOConfig has no such option.
        generation_cache (`str`, defaults to `"static"`): KV cache of `model.generate` sampling (not vLLM). `"static"`
            preallocates one cache per call, sized to the batch's prefix width + token budget: same sampled ids as
            `"dynamic"` (logits agree to ~1e-7), 10-21% less CPU time on 300-1500-token prefixes, about the same on
            short ones (a `DynamicCache` is re-concatenated at every step). `"dynamic"`: transformers' default.
            Models without static-cache support, and ZeRO-3 / FSDP runs on several processes (synchronised
            generation), use the dynamic cache; GRPOConfig's `cache_implementation`, when set, is passed through.
        num_generations: not used: a tree's size is set by the sampler fields. Must stay 1 (one tree per prompt).
    """

    sampler: str = field(
        default="init_expand", metadata={"help": "init_expand | flat | entropy_guided | token_entropy"}
    )
    credit: str = field(default="likelihood", metadata={"help": "likelihood | child_mean | child_softmax | leaf_mean | path"})
    loss: str = field(default="treeopsd", metadata={"help": "treeopsd | treepo | atpo | grpo | gspo_token"})
    reward_std: str = field(default="sample", metadata={"help": "sample (ddof=1) | population (ddof=0, +1e-6)"})
    num_initial_rollouts: int = field(default=4, metadata={"help": "M: full trajectories per prompt."})
    num_branches: int = field(default=2, metadata={"help": "N: continuations per initial trajectory."})
    anchor_rule: str = field(default="uniform", metadata={"help": "Branch points: 'uniform' over turn prefixes."})
    expansion_rounds: int = field(default=2, metadata={"help": "L: entropy-guided expansion rounds."})
    branches_per_round: int = field(default=6, metadata={"help": "K: new branches per expansion round."})
    expansion_mode: str = field(default="entropy", metadata={"help": "entropy | random"})
    sibling_penalty: float = field(default=0.05, metadata={"help": "α of the AT2PO node score."})
    entropy_threshold: float = field(default=1.0, metadata={"help": "τ_H (nats): branch inside turns above it."})
    max_branches_per_tree: int = field(default=2, metadata={"help": "Cap on token-level branch points per tree."})
    min_segment_length: int = field(default=8, metadata={"help": "Fewest tokens per split segment."})
    branching_rounds: int = field(default=1, metadata={"help": "Rounds of token-level branching."})
    target_radius: float = field(default=0.25, metadata={"help": "ρ: q ∈ [1/2 − ρ, 1/2 + ρ], 0 < ρ < 1/2."})
    max_turns: int = field(default=5, metadata={"help": "Assistant turns per trajectory, the final answer included."})
    packing: str = field(default="tree", metadata={"help": "'tree' (one packed row per tree), 'paths' or 'auto'."})
    tool_timeout: float | None = field(default=30.0, metadata={"help": "Seconds a tool call may run."})
    max_observation_chars: int | None = field(default=16384, metadata={"help": "Cap on a tool output's length."})
    tool_failure_penalty: float = field(default=-1.0, metadata={"help": "Penalty per failed tool call (TreeFlex)."})
    malformed_tool_calls: str = field(
        default="observe", metadata={"help": "observe (error observation, go on) | end (end the trajectory, as TRL)"}
    )
    max_turn_tokens: int | None = field(default=None, metadata={"help": "Cap on one sampled assistant turn's tokens."})
    generation_cache: str = field(
        default="static", metadata={"help": "static (one preallocated KV cache per generate call) | dynamic"}
    )
    num_generations: int | None = field(default=1, metadata={"help": "Unused by tree trainers; must be 1."})
    vllm_importance_sampling_correction: bool = field(
        default=False, metadata={"help": "Unused: π_old is recomputed by the training model (must be False)."}
    )

    def __post_init__(self):
        self._check_composition()
        self._check_tree_fields()
        self._reject_grpo_options()
        # GRPOConfig.__post_init__ insists on num_generations ≥ 2 groups inside the generation batch; trees are whole
        # on one process instead, so run the base post-init and derive the batch sizes the way GRPOConfig does.
        _BaseConfig.__post_init__(self)
        if isinstance(self.pad_to_multiple_of, str):
            self.pad_to_multiple_of = None if self.pad_to_multiple_of.lower() in ("none", "null", "auto") else int(
                self.pad_to_multiple_of
            )
        self.scale_rewards = {True: "group", False: "none"}.get(self.scale_rewards, self.scale_rewards)
        if self.auto_find_batch_size:
            raise ValueError("auto_find_batch_size is not supported: it would split trees across micro-batches.")
        self._derive_generation_batch()

    def _derive_generation_batch(self):
        per_step = self.per_device_train_batch_size * self.world_size
        if self.generation_batch_size is None and self.steps_per_generation is None:
            self.steps_per_generation = self.gradient_accumulation_steps
        elif self.generation_batch_size is not None and self.steps_per_generation is None:
            if self.generation_batch_size % per_step != 0:
                raise ValueError(
                    f"generation_batch_size ({self.generation_batch_size}) must be divisible by the global batch of "
                    f"trees per micro-batch ({per_step})."
                )
            self.steps_per_generation = self.generation_batch_size // per_step
        elif self.generation_batch_size is not None:
            raise ValueError("Set either generation_batch_size or steps_per_generation, not both.")
        self.generation_batch_size = per_step * self.steps_per_generation
        if self.steps_per_generation % self.gradient_accumulation_steps != 0:
            raise ValueError(
                f"steps_per_generation ({self.steps_per_generation}) must be a multiple of gradient_accumulation_steps "
                f"({self.gradient_accumulation_steps}): each optimizer block is a whole number of micro-batches."
            )

    @property
    def num_optimizer_blocks(self) -> int:
        """E: optimizer steps taken on one generation batch."""
        return self.steps_per_generation // self.gradient_accumulation_steps

    @property
    def leaves_per_tree(self) -> int:
        from .components import leaves_per_tree

        return leaves_per_tree(self)

    def _check_composition(self):
        from .components import CREDITS, LOSSES, SAMPLERS

        for name, value, valid in (
            ("sampler", self.sampler, SAMPLERS), ("credit", self.credit, tuple(CREDITS)),
            ("loss", self.loss, tuple(LOSSES)), ("reward_std", self.reward_std, ("sample", "population")),
            ("anchor_rule", self.anchor_rule, ANCHOR_RULES), ("expansion_mode", self.expansion_mode,
                                                               ("entropy", "random")),
        ):
            if value not in valid:
                raise ValueError(f"{name} must be one of {valid}; got {value!r}.")
        if self.num_initial_rollouts is None or self.num_initial_rollouts < 1:
            raise ValueError(f"num_initial_rollouts (M) must be ≥ 1; got {self.num_initial_rollouts}.")
        if self.num_branches is None or self.num_branches < 0:
            raise ValueError(f"num_branches (N) must be ≥ 0; got {self.num_branches}.")
        if self.expansion_rounds < 0 or self.branches_per_round < 0:
            raise ValueError("expansion_rounds and branches_per_round must be ≥ 0.")
        if self.max_branches_per_tree < 0 or self.min_segment_length < 1 or self.branching_rounds < 1:
            raise ValueError(
                "Token-level branching needs max_branches_per_tree ≥ 0, min_segment_length ≥ 1 and branching_rounds ≥ "
                f"1; got {self.max_branches_per_tree}, {self.min_segment_length}, {self.branching_rounds}."
            )
        if self.entropy_threshold != self.entropy_threshold:
            raise ValueError("entropy_threshold is NaN; use float('inf') to turn token-level branching off.")
        if self.leaves_per_tree < 2:
            raise ValueError(
                f"A tree needs K ≥ 2 leaves to standardise rewards; this configuration gives K = {self.leaves_per_tree}"
                f" (for init_expand K = M(N + 1): M = {self.num_initial_rollouts}, N = {self.num_branches}; for "
                "token_entropy at most M(1 + max_branches_per_tree))."
            )
        if self.loss == "treeopsd":
            if not 0.0 < self.target_radius < 0.5:
                raise ValueError(f"target_radius ρ must satisfy 0 < ρ < 1/2; got {self.target_radius}.")
            if self.reward_std != "sample":
                raise ValueError(
                    "The treeopsd loss needs reward_std='sample': Samuelson's bound |A| ≤ (K−1)/√K on sample-"
                    "standardised rewards is what keeps q = 1/2 + V/τ inside [1/2 − ρ, 1/2 + ρ]."
                )
        if self.beta != 0.0:
            raise ValueError(
                f"{type(self).__name__} trains without a reference-model KL (β = 0): the tree losses bound each "
                "update themselves (a frozen teacher or a clip). Set beta=0.0."
            )

    def _check_tree_fields(self):
        if self.max_turns is None or self.max_turns < 1:
            raise ValueError(f"max_turns must be ≥ 1 (assistant turns per trajectory); got {self.max_turns}.")
        if self.packing not in PACKING_LAYOUTS:
            raise ValueError(f"packing must be one of {PACKING_LAYOUTS}; got {self.packing!r}.")
        if self.malformed_tool_calls not in MALFORMED_TOOL_CALL_POLICIES:
            raise ValueError(
                f"malformed_tool_calls must be one of {MALFORMED_TOOL_CALL_POLICIES}; got {self.malformed_tool_calls!r}:"
                " 'observe' answers an unparseable tool call with an error observation, 'end' ends the trajectory."
            )
        if self.max_completion_length is None or self.max_completion_length < 1:
            raise ValueError("max_completion_length must be a positive number of tokens per trajectory.")
        if self.max_turn_tokens is not None and self.max_turn_tokens < 1:
            raise ValueError(
                f"max_turn_tokens must be a positive number of tokens per assistant turn, or None; got "
                f"{self.max_turn_tokens}."
            )
        if self.generation_cache not in GENERATION_CACHES:
            raise ValueError(
                f"generation_cache must be one of {GENERATION_CACHES}; got {self.generation_cache!r}: 'static' "
                "preallocates the KV cache of each generate call, 'dynamic' grows it token by token."
            )

    def _reject_grpo_options(self):
        rejected = {
            "num_generations": (
                self.num_generations not in (None, 1),
                "a tree's size is set by the sampler (e.g. num_initial_rollouts and num_branches): leave "
                "num_generations unset.",
            ),
            "num_iterations": (
                self.num_iterations != 1,
                "repeated optimisation on one generation batch is done by sequential optimizer blocks: set "
                "steps_per_generation = E × gradient_accumulation_steps and keep num_iterations = 1.",
            ),
            "use_transformers_continuous_batching": (
                self.use_transformers_continuous_batching,
                "tree sampling continues token-id prefixes with model.generate or vLLM: set use_vllm=True for "
                "throughput, or leave it off.",
            ),
            "top_entropy_quantile": (
                self.top_entropy_quantile != 1.0,
                "every unique turn is trained; the turn-level loss has no token entropy mask.",
            ),
            "vllm_importance_sampling_correction": (
                self.vllm_importance_sampling_correction,
                "π_old is recomputed by the training model in the packed forward (no sampler/trainer mismatch to "
                "correct); leave it False.",
            ),
        }
        for name, (bad, advice) in rejected.items():
            if bad:
                raise ValueError(f"{type(self).__name__} does not use `{name}`: {advice}")




@dataclass
class TreeOPSDConfig(TreeConfig):
    """Configuration of `TreeOPSDTrainer` (paper §2–3, Alg. 1): init-expand (M, N) trees with uniform anchors,
    likelihood-weighted credit, the Bernoulli forward-KL to q = 1/2 + V/τ. See `TreeConfig` for every field."""


@dataclass
class TreePOConfig(TreeConfig):
    """Configuration of `TreePOTrainer`: TreeOPSD's trees and credit with the fixed-credit loss
    −(1/L_x) Σ_i V_i Σ_j log-ratio (T7). `target_radius` is unused."""

    loss: str = field(default="treepo", metadata={"help": "treeopsd | treepo | atpo | grpo"})


@dataclass
class AT2POConfig(TreeConfig):
    """Configuration of `AT2POTrainer`: entropy-guided expansion (M = 10 initial trajectories, L = 2 rounds of K = 6
    branches), turn credit by a softmax over child entropies (A4) on population-standardised leaves (A3), and the
    ATPO loss (per-turn geometric-mean ratio, per-turn clip, GRPO's path aggregation; A5).

    The paper's ablations are switches: `expansion_mode="random"`, `loss="grpo"` (token-level ratio and clip),
    `credit="path"` (turn credit off), `credit="child_mean"` / `"leaf_mean"` (other backups)."""

    sampler: str = field(default="entropy_guided", metadata={"help": "init_expand | flat | entropy_guided"})
    credit: str = field(default="child_softmax", metadata={"help": "likelihood | child_mean | child_softmax | leaf_mean | path"})
    loss: str = field(default="atpo", metadata={"help": "treeopsd | treepo | atpo | grpo"})
    reward_std: str = field(default="population", metadata={"help": "sample (ddof=1) | population (ddof=0, +1e-6)"})
    num_initial_rollouts: int = field(default=10, metadata={"help": "M: initial trajectories per prompt."})
