"""Configurations of the tree trainers: `GRPOConfig` subclasses with the tree fields (docs/design.md §1, §3).

A GRPO config carries over with only the class swap; its numbers keep GRPO's meaning. With W processes and
G = `num_generations`:

    num_generations               G, the rollout budget per prompt in complete trajectories: a tree's expected cost
                                  (`tree_budget.trajectory_budget`, e.g. M(1 + N/2) for init-expand, so (4, 2) ⇔ 8)
    per_device_train_batch_size   trajectories of budget per micro-batch on each process, as in GRPO: the micro-batch
                                  holds per_device_train_batch_size / G whole trees (one per prompt)
    generation_batch_size         trajectories of budget per generation batch: B = generation_batch_size / G prompts
    gradient_accumulation_steps   micro-batches per optimizer step
    steps_per_generation          micro-batches per generation batch = E × gradient_accumulation_steps

so a GRPO config trains the same number of prompts per optimizer step with a tree trainer as with `GRPOTrainer`.
Sequential optimizer blocks (the paper's E): one generation batch of B prompts is split into E mini-batches of whole
trees, one optimizer step each. E.g. the paper's B = 256, E = 4 on 8 GPUs with G = 8: per_device_train_batch_size =
64 (8 trees), gradient_accumulation_steps = 1, steps_per_generation = 4 (each block: 64 trees). `num_iterations`
stays 1: the repeated optimisation on one batch *is* the E blocks.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import ClassVar

from trl import GRPOConfig

from ... import methods
from ...rollout.acting.tools import MAX_OBSERVATION_CHARS
from . import checks, resolution

# The allowed values, with the checks that enforce them (`checks`); re-exported for existing importers
PACKING_LAYOUTS = checks.PACKING_LAYOUTS
MALFORMED_TOOL_CALL_POLICIES = checks.MALFORMED_TOOL_CALL_POLICIES
ANCHOR_RULES = methods.ANCHOR_RULES  # the init_expand sampler's own (`methods.Sampler.check`)
GENERATION_CACHES = checks.GENERATION_CACHES
harnesses = checks.harnesses  # TreeFlex's built-in harnesses, the samplers TreeFlexConfig takes
# GRPO options without an effect on any tree trainer, and what to use instead (`TreeTrainerConfig.unused_grpo_options`;
# the CLI's help reads it under this name)
_REJECTED_ADVICE = checks.UNUSED_GRPO_OPTION_ADVICE
GRPO_DEFAULT_BATCH_SIZE = resolution.GRPO_DEFAULT_BATCH_SIZE


def component_choices(kind: str, unit: str = "tree") -> str:
    """The registered choices of a component field, as its help lists them: read from the method table, so that a
    newly registered sampler, credit or loss is listed without editing any help text."""
    table = {"sampler": methods.SAMPLERS, "credit": methods.CREDITS, "loss": methods.LOSSES}[kind]
    return " | ".join(name for name, entry in table.items() if entry.unit == unit)


def _component_field(kind: str, default: str, what: str, unit: str = "tree"):
    return field(default=default, metadata={"help": f"{what}: {component_choices(kind, unit)}."})


@dataclass
class TreeTrainerConfig(GRPOConfig):
    """Fields and checks shared by every tree trainer, TreeFlex included (`TreeConfig`, `TreeFlexConfig`): the turn
    limit, tools and tool safety, stateful environments, generation (cache, chunks, turn cap), the budget G
    (`num_generations`) and the batch sizes that count trajectories of budget, and the GRPO options a tree trainer
    reads or refuses. Not used on its own: a subclass declares `sampler`, `credit` and `loss` (the method table's
    components, `trl_tree.methods`), its sampler's own fields and `_check_composition`.

    Parameters:
        max_turns (`int`, *optional*, defaults to `5`): assistant turns per trajectory, the final answer included
            (the paper's five for multi-hop QA). A tool call in the last allowed turn ends the trajectory unexecuted.
            With GRPO's `max_tool_calling_iterations` = k set instead, it is k + 1 (TRL's loop: at most k rounds of
            tool execution, each followed by one more generation).
        tool_timeout (`float` or `None`, defaults to `30.0`): seconds a tool call may run before it becomes an error
            observation ("timed out after … s"), in every mode and for every kind of tool; the trainer enforces it
            from outside, so a tool cannot extend it (an async tool that catches its cancellation runs on in the
            background, its late result dropped). `None`: no deadline at all, a hung tool hangs the run.
        tool_execution (`str`, defaults to `"thread"`): where synchronous tools run. `"thread"`: in worker threads,
            up to `max_concurrent_tool_calls` at once, each call with a deadline the trainer stops waiting at (a hung
            tool becomes an error observation, even in C code; its thread lingers until the tool returns, as Python
            cannot kill a thread); `signal.signal` only works in the main thread, so a signal-based tool fails on
            every call. `"main"`: in the trainer's thread, one call after another, as GRPOTrainer runs them, so a
            tool may time itself out with `signal.alarm` / `signal.setitimer` (TRL's agent example does);
            `tool_timeout` is a SIGALRM timer there, which interrupts the tool where it is (pure Python, sleeps and
            lock waits; the trainer's own SIGALRM handler and timer are restored after each call). Its limits: a
            tool stuck in C code that does not return to the interpreter is not interrupted, a tool that arms its
            own alarm replaces the deadline for that call, and where there is no SIGALRM (Windows) or the trainer
            does not run in the main thread, the tool runs in a worker thread with the deadline instead. Async tools
            run on GRPOTrainer's event loop thread either way, with `tool_timeout`.
        max_concurrent_tool_calls (`int`, defaults to `64`): tool calls in flight at once. The calls of every turn
            that ended in one round of generation (all branches of all trees of the process) start together in a
            pool of worker threads (`trl_tree.rollout.acting.tool_executor`), so a round costs about its slowest call, not
            the sum of its calls; results are attached to their branches in a fixed order, so the sampled tokens do
            not depend on which call finishes first. A branch's calls on its stateful environment run in order (they
            share an instance); the calls of one round to a tool with a batched form (`trl_tree.batched_tool`) go in
            one request. With `generation_chunk_tokens`, calls of standalone tools also overlap generation: a branch
            waiting for them sits the engine calls out while the others go on (the batches, hence a seeded run's
            tokens, then depend on the tools' timing). `1` (or `tool_execution="main"`): one call after another, as
            GRPOTrainer.
        max_tool_calls_per_turn (`int` or `None`, defaults to `8`): tool calls of one assistant turn that run;
            each call beyond it gets an error observation instead (every call keeps its tool message) and counts as
            a failed call in `tools/failure_frequency` and the TreeFlex penalty. A turn's calls on its environment
            run one after another, so the cap bounds a turn's tool time at about `max_tool_calls_per_turn ×
            tool_timeout`. `None`: no cap.
        max_observation_chars (`int`, defaults to `16384`): what the model sees of a tool's output is cut at this many
            characters, with a marker saying how much was dropped (the paper's limit for retrieved observations).
            Reward functions receive the tool message as GRPOTrainer builds it, uncut: the returned value itself if it
            is a list, else `str(value)`.
        tool_failure_penalty (`float`, defaults to `-1.0`): process penalty Q recorded on a turn per failed or
            malformed tool call (used by TreeFlex; the other methods only log it).
        malformed_tool_calls (`str`, defaults to `"end"`): what follows a turn that tries to call a tool but whose
            call does not parse (a `<tool_call>` tag without valid JSON). `"end"`, GRPO's behaviour so that a GRPO
            run and its tree replacement sample the same kind of episode: the trajectory ends at that turn and is
            scored as it is, as TRL's GRPO tool loop does (its parser finds no tool call, so the turn is final).
            `"observe"`: an error observation saying how to write the call, and the trajectory goes on (the model can
            repair it; TreeFlex penalises the turn). Either way the call counts as a tool failure.
        observation_special_tokens (`str`, defaults to `"neutralize"`): how special-token strings inside tool and
            environment output (and TreeFlex's copied-in cards) become observation tokens. Such text is untrusted: a
            tool output holding `<|im_end|>\n<|im_start|>assistant\n…` would otherwise become the real turn markers,
            and the policy would train on contexts with forged turns. `"neutralize"`: every special or added token
            string of the tokenizer in the message text gets a zero-width space (U+200B) after its first character,
            so it is tokenized as text (`trl_tree.rollout.acting.special_tokens`); output without such strings renders
            exactly as in TRL. `"raw"`: TRL's rendering as it is, for tools trusted to write chat-template markup.
            The prompt is trusted either way, as in GRPO.
        environment_branching (`str`, defaults to `"auto"`): how a branch of a stateful environment
            (`environment_factory`) gets the environment as it was at its anchor turn. `"fork"`: the environment's own
            `fork()` of a snapshot taken before every turn (a fork() that raises is an error); `"copy"`:
            `copy.deepcopy` of that snapshot, whatever the environment holds; `"replay"`: no snapshots, a fresh
            instance is reset with the tree's dataset row and the branch's recorded tool calls up to the anchor are
            re-run in order (their outputs are not shown to the model again). Replay reproduces what the environment
            draws from Python's `random`, NumPy's and torch's global generators (their states before the original
            reset and calls are restored, and the sampler's own states put back afterwards); an output that differs
            from the recorded one all the same is a divergence (`replay_divergence`). Replay costs the replayed calls
            again; it is the way to branch clients of remote state, as in TRL's OpenEnv examples. `"auto"`: fork() if
            the environment has one (if it raises: replay, with a warning); else deepcopy only if a copy cannot share
            state with the original: the class sets `__trl_tree_copyable__ = True` or writes its own `__deepcopy__`,
            or everything reachable from its attributes is plain local data (scalars, builtin containers,
            dataclasses of those, `random.Random`, NumPy arrays and generators, torch tensors) and no attribute is
            named like a remote handle (`session_id`, `base_url`, `client`, ...); else replay (a warning says why).
            A deep copy of a REST client keeps its session id, so two branches would drive one server session.
            State outside the instance (a module-level registry) is invisible to the check: set
            `__trl_tree_copyable__ = False` on such an environment. Snapshots are only taken when the sampler will
            branch (not for `sampler="flat"`, `num_branches=0`, no expansion rounds), and every trajectory that
            starts at the prompt gets its own instance reset with the row (and the root's reset randomness), as in
            GRPO; instances are pooled and reused across batches.
        replay_divergence (`str`, defaults to `"drop"`): what becomes of a branch whose replayed environment does not
            reproduce its history (a replayed tool output, or a reset observation, that differs from the recorded
            one: randomness replay cannot restore, or a server's). Its context and its world disagree, so it must
            not be trained as if consistent. `"drop"`: it is warned about (`ReplayDivergenceWarning`) and left out of
            its tree before scoring and credit, with the branches copied from its diverged world; the metric
            `tree/diverged_branches` counts them per tree. `"raise"`: a `ReplayDivergenceError` naming the
            environment, the tool and what differed stops training. TreeFlex's searches are not dropped.
        max_turn_tokens (`int` or `None`, defaults to `None`): tokens one sampled assistant turn may have (`None`: only
            `max_completion_length` bounds it). A `generate` call lasts as long as its longest row, so one rambling
            turn holds every other branch of the batch waiting; a turn cut by the cap ends its trajectory and is
            masked out of the loss like a truncated completion. GRPOConfig has no such option.
        generation_cache (`str`, defaults to `"prefix"`): KV cache of `model.generate` sampling (not vLLM, whose own
            prefix caching does the same). `"prefix"`: within one rollout, every call reuses the keys and values of
            the sequences earlier calls processed (a branch's previous turns, the anchor's history it branched from),
            so each history is encoded once instead of at every turn; the reused KV is dropped when the rollout ends.
            `"static"`: one preallocated cache per call, sized to its prefix width + token budget. `"dynamic"`:
            transformers' default. All three sample the same ids but for floating-point near-ties. Models whose cache
            cannot be spliced per row (sliding-window, linear-attention, custom) or preallocated, and ZeRO-3 / FSDP
            runs on several processes (synchronised generation), use the dynamic cache; GRPOConfig's
            `cache_implementation`, when set, is passed through.
        max_prefix_cache_bytes (`int` or `None`, defaults to `None`): bytes of keys and values the `"prefix"` cache
            keeps between the calls of one rollout (`None`: no cap). Uncapped, it holds the KV of every leaf's
            history, about 2 × layers × kv_heads × head_dim × bytes per value (SmolLM2-135M in float32: 46 KB) per
            token of every root-to-leaf path, so it grows with the tree and the generation batch. Past the cap, the
            sequences stored or reused longest ago are dropped after each call: later prefixes reuse less and
            prefill more, and the same tokens are sampled (a dropped row's KV is recomputed, never approximated).
            The cache of the call in progress comes on top, as with any `generate`. Not read by vLLM. No cap by
            default: a good one depends on the model and the machine, and uncapped the store holds what one batched
            `generate` over all of a rollout's leaves would.
        generation_chunk_tokens (`int` or `None`, defaults to `None`): tokens a branch samples per generate call
            (`None`: a whole turn). A call otherwise lasts as long as its longest turn, with every branch that has
            ended its turn waiting for it, and the tree's continuations waiting for the next call. With c, a call
            stops after c tokens: a turn still going resumes in the next call (its KV reused, so it prefills one
            token), and the branches that ended a turn run their tools and rejoin, with new continuations, at once:
            continuous batching at chunk granularity. Each token is drawn from the same distribution; a seeded run's
            draws differ. Applies to `model.generate` with `generation_cache="prefix"` (one process, or without
            ZeRO-3 / FSDP): without the prefix store each chunk would prefill its whole history again, so the other
            caches sample whole turns, and so does vLLM, which schedules its rows continuously inside a call.
            GRPOConfig has no such option.

    GRPO fields, as a GRPO user reads them:
        num_generations (`int`, *optional*): G, GRPO's per-prompt rollout budget, read as the paper's matched budget in
            complete trajectories: a tree's expected cost is `tree_budget.trajectory_budget` (each sampler's
            `budget_formula` in the method table: init_expand M(1 + N/2), TreeFlex its K searches), rounded up. Unset:
            derived from the sampler fields. Set alone: M (TreeFlex: `num_searches`) is derived from it, and N too
            when no M reaches G with the default N (see `num_branches`). Set with M or N: they must agree. An error lists the settings that give the G asked for.
        per_device_train_batch_size, generation_batch_size: count trajectories of budget, as GRPO counts completions:
            a micro-batch holds per_device_train_batch_size / G whole trees (a whole number ≥ 1), a generation batch
            generation_batch_size / G prompts. GRPO also accepts a size below G (a group spans micro-batches) when the
            optimizer step and the generation batch hold whole groups; a tree cannot be split, so such a config
            trains one whole tree per micro-batch with proportionally less accumulation (said at start-up): the same
            prompts per optimizer step and per generation batch, the same steps. A GRPO config so trains the same
            prompts per step. Unset,
            per_device_train_batch_size is GRPO's 8 when G divides 8 (G = 4: two trees per micro-batch, GRPO's two
            prompts per step), else G (one tree; GRPO's 8 fails its own check for such a G).
        per_device_eval_batch_size: the same for evaluation (GRPO's loader repeats each prompt G times; one tree is
            grown per prompt), so it must be a multiple of G when evaluating. `num_generations_eval` must stay unset
            (or equal G): evaluation grows the training trees.
        max_tool_calling_iterations (`int`, *optional*): TRL's cap on tool-calling rounds per trajectory; sets
            `max_turns` = k + 1 (an explicit, different `max_turns` is an error).
        multi_objective_aggregation (`str`, defaults to `"sum_then_normalize"`): as in GRPO, with a tree's K leaves
            as the group. `"sum_then_normalize"`: the leaf reward is the weighted sum of the reward functions, then
            standardised over the tree (`reward_std`). `"normalize_then_sum"`: each function's rewards are first
            normalised over the tree's leaves, (r − mean)/(std + 1e-4) with the sample std as GRPO, then summed with
            the weights; the tree's standardisation takes the place of GRPO's batch-level normalisation.
        mask_truncated_completions (`bool`, defaults to `False`): as GRPO masks every token of a truncated completion,
            a turn is context only, not trained, unless some trajectory through it finished uncut: the turn cut by
            the token budget, and the complete turns before it that no finished trajectory shares. A batch of only
            truncated trajectories so trains nothing (loss 0, no gradient), as in GRPO.
        generation_kwargs: passed to generation as in GRPO, but `num_beams` and `num_return_sequences` must stay 1:
            each continuation of a prefix is one sampled (or greedy) branch of the tree.
        epsilon, epsilon_high: honoured by the clipped losses (those that read `epsilon` in the method table);
            `epsilon_high=None` is ε, any other value is read as given (`methods.epsilon_high`).
        vllm_importance_sampling_correction (`bool`, defaults to `False`, unlike GRPO): not applied: π_old is
            recomputed by the training model, and the sampler's log-probs are not used. With `use_vllm=True` it must
            stay False, so that the run does not silently differ from the GRPO run it replaces.
        behaviour_importance_cap (`float`, defaults to `3.0`): C, where a stale token's importance weight
            min(π_old/μ, C) is truncated (μ: the older policy that sampled the tree, π_old: the policy at the start
            of its optimizer blocks; GRPO's `vllm_importance_sampling_clip_max` for the same kind of weight). Read by
            the losses in the decoupled form (every clipped loss and TreePO; TreeOPSD with `stale_target=
            "decoupled"`); a finite number ≥ 1, so that a fresh sample's weight, 1, is never cut (docs/design.md §3,
            "Stale samples").
        max_staleness (`int`, defaults to `0`): TRL's `AsyncGRPOTrainer` name, counted in generation batches here
            (docs/design.md, "Asynchronous rollouts"). `0`: the synchronous trainer, unchanged. s > 0: a rollout
            worker thread with its own copy of the policy grows the next s generation batches while the trainer runs
            the optimizer blocks of the current one; batch b is sampled by the weights after batch b − s (fewer
            after a start, a new epoch), its log-probs kept as the behaviour policy's (`behaviour_logps`) beside
            π_old, and nothing is dropped. The HF engine, a custom engine or vLLM in server mode (each version
            pushed to the server by TRL's weight sync between the worker's jobs), tree samplers; what it cannot
            serve (vLLM colocated, TreeFlex, ...) is refused with why (`trl_tree.trainer.async_rollouts.unsupported`).
        rollout_generation (`str`, defaults to `"thread"`): where the rollout worker (max_staleness > 0) runs its HF
            engine's generation. `"thread"`: in the worker's thread. `"process"`: in a child process
            (`trl_tree.rollout.generating.engine_process`), the worker's policy copy in shared memory, written in
            place between batches, and torch's generator state handed over with each call, so it trains bit for bit
            what `"thread"` trains. On a CPU a thread shares the interpreter lock with training (SmolLM2's generation
            measured 13 % slower beside training in a thread, not slower in a process: benchmarks/README.md, section
            11). Refused with why where it cannot serve: max_staleness=0 (no worker, by this config), and by the
            trainer (`async_rollouts.unsupported_process`) vLLM (its server generates), several processes, a custom
            engine, a GPU.
        Rejected when set to anything but GRPOConfig's default, all named in one error with what to use instead
        (`TreeTrainerConfig.unused_grpo_options`): loss_type, scale_rewards, delta, importance_sampling_level, beta,
        num_iterations, top_entropy_quantile, entropy_coef, use_adaptive_entropy, off_policy_mask_threshold,
        use_transformers_continuous_batching, epsilon / epsilon_high (for the losses without a clip),
        max_tool_calling_iterations (TreeFlex).
    """

    max_turns: int | None = field(
        default=None, metadata={"help": "Assistant turns per trajectory, the final answer included (default 5)."}
    )
    tool_timeout: float | None = field(default=30.0, metadata={"help": "Seconds a tool call may run."})
    tool_execution: str = field(
        default="thread",
        metadata={
            "help": "thread (worker threads, max_concurrent_tool_calls at once; tool_timeout always stops waiting) | "
            "main (one at a time in the trainer's thread, as GRPO; signal works; tool_timeout by SIGALRM)"
        },
    )
    max_concurrent_tool_calls: int = field(
        default=64,
        metadata={"help": "Tool calls in flight at once (a round's calls start together; 1: one after another)."},
    )
    max_tool_calls_per_turn: int | None = field(
        default=8, metadata={"help": "Tool calls run per assistant turn; the rest get error observations (None: all)."}
    )
    max_observation_chars: int | None = field(
        default=MAX_OBSERVATION_CHARS, metadata={"help": "Cap on a tool output's length."}
    )
    tool_failure_penalty: float = field(default=-1.0, metadata={"help": "Penalty per failed tool call (TreeFlex)."})
    malformed_tool_calls: str = field(
        default="end", metadata={"help": "end (end the trajectory, as TRL) | observe (error observation, go on)"}
    )
    observation_special_tokens: str = field(
        default="neutralize",
        metadata={"help": "neutralize (special-token strings in tool output are tokenized as text) | raw (as TRL)"},
    )
    environment_branching: str = field(
        default="auto",
        metadata={"help": "auto | fork | copy | replay: how branches get a stateful environment's state (auto: fork(), "
                  "else deepcopy of plain local state or a class with __trl_tree_copyable__ = True, else replay)."},
    )
    replay_divergence: str = field(
        default="drop",
        metadata={"help": "drop | raise: a branch whose replayed environment disagrees with its history is left out "
                  "of its tree (tree/diverged_branches) or stops training."},
    )
    max_turn_tokens: int | None = field(default=None, metadata={"help": "Cap on one sampled assistant turn's tokens."})
    generation_cache: str = field(
        default="prefix",
        metadata={"help": "prefix (reuse earlier turns' KV within a rollout) | static (one preallocated KV cache per "
                  "generate call) | dynamic"},
    )
    max_prefix_cache_bytes: int | None = field(
        default=None, metadata={"help": "Cap on the bytes of keys and values generation_cache='prefix' keeps within a "
                                "rollout; least recently used sequences are dropped past it (None: no cap)."}
    )
    generation_chunk_tokens: int | None = field(
        default=None, metadata={"help": "Tokens a branch samples per generate call before the batch is re-formed "
                                "(None: a whole turn)."}
    )
    num_generations: int | None = field(
        default=None, metadata={"help": "G: rollout budget per prompt in complete trajectories (default: from M, N)."}
    )
    per_device_train_batch_size: int | None = field(
        default=None, metadata={"help": "Trajectories of budget per micro-batch per device, a multiple of G (default "
                                "GRPO's 8 when G divides it, the same 8 / G prompts per step; else G: one tree)."}
    )
    num_completions_to_print: int | None = field(
        default=8, metadata={"help": "Rows of the completions table printed with log_completions (GRPO: None, every "
                             "row; a tree batch has a row per leaf: tens of thousands of lines). None prints all."}
    )
    vllm_importance_sampling_correction: bool = field(
        default=False, metadata={"help": "Not applied: π_old is recomputed by the training model (False with vLLM)."}
    )
    behaviour_importance_cap: float = field(
        default=3.0, metadata={"help": "C: a stale token's importance weight min(π_old/μ, C) in the decoupled losses "
                               "(finite, ≥ 1)."}
    )
    max_staleness: int = field(
        default=0, metadata={"help": "Generation batches a rollout worker grows ahead of the trainer, each sampled by "
                             "weights at most this many generation batches old (0: synchronous)."}
    )
    rollout_generation: str = field(
        default="thread", metadata={"help": "thread | process: where the rollout worker (max_staleness > 0) generates "
                                   "with the HF engine: in its thread, or in a child process (CPU, one process; "
                                   "no interpreter lock shared with training)."}
    )

    default_max_turns: ClassVar[int] = 5
    maps_tool_calling_iterations: ClassVar[bool] = True  # TreeFlex's max_turns is per segment, not per trajectory

    def __post_init__(self):
        from .tree_budget import check_generations_fit, check_tree_size

        if type(self) is TreeTrainerConfig:
            raise TypeError("TreeTrainerConfig is the shared base: use TreeConfig (or a preset) or TreeFlexConfig.")
        if isinstance(self.max_staleness, bool) or not isinstance(self.max_staleness, int) or self.max_staleness < 0:
            raise ValueError(f"max_staleness must be an int >= 0 (0: synchronous), got {self.max_staleness!r}.")
        checks.check_rollout_generation(self)
        check_generations_fit(self)  # before the budget arithmetic derives the sampler's budget field from a G no
        # tree could hold
        self._check_composition()
        self._check_tree_fields()
        check_tree_size(self)  # the tree's leaves and tokens, from the resolved fields, for every sampler
        checks.reject_unused_grpo_options(self)
        resolution.resolve_micro_batch(self)
        # GRPOConfig's checks and mappings (scale_rewards, pad_to_multiple_of, generation batch, …) run unchanged:
        # with the batch sizes counting trajectories of budget, its divisibility by G is that of whole trees.
        from .quiet import without_trl_default_checkpointing_warning

        with without_trl_default_checkpointing_warning(self):  # GRPOConfig's default, under transformers' old name
            super().__post_init__()
        resolution.check_optimizer_blocks(self)

    @property
    def trees_per_micro_batch(self) -> int:
        """Prompts (= trees) in one micro-batch on one process: per_device_train_batch_size / G."""
        return self.per_device_train_batch_size // self.num_generations

    @property
    def prompts_per_generation(self) -> int:
        """B, prompts (= trees) in one generation batch over all processes: generation_batch_size / G."""
        return self.generation_batch_size // self.num_generations

    @property
    def num_optimizer_blocks(self) -> int:
        """E: optimizer steps taken on one generation batch."""
        return self.steps_per_generation // self.gradient_accumulation_steps

    @property
    def leaves_per_tree(self) -> int:
        """K: leaves per tree (at most, for a sampler with a variable K); TreeFlex: searches per task."""
        from .tree_budget import leaves_per_tree

        return leaves_per_tree(self)

    @classmethod
    def num_generations_for(cls, **fields) -> int:
        """G that a config of this class built with `fields` has, without building it (e.g. to size
        per_device_train_batch_size = trees × G)."""
        return resolution.num_generations_for(cls, fields)

    def unused_grpo_options(self) -> dict[str, str]:
        """GRPO options that would change nothing here, set to something other than GRPOConfig's default, with what
        to use instead. "Set" compares with GRPOConfig's own default (`scale_rewards=True` is "group")."""
        return checks.unused_grpo_options(self)

    @classmethod
    def _check_sampler_kind(cls, sampler: str) -> None:
        """A ValueError unless `sampler` is one this class trains (a tree sampler, or a TreeFlex harness)."""
        raise NotImplementedError

    @classmethod
    def _probe_defaults(cls, probe) -> None:
        """`num_generations_for`'s what-if config: fill the sampler fields the class resolves at construction."""

    @classmethod
    def _default_budget(cls, field_name: str) -> int:
        """The value of the sampler's budget field (`Sampler.budget_field`) when neither it nor G is set."""
        raise NotImplementedError

    def _check_composition(self):
        """The chosen components, checked and resolved: the subclass's own (a tree's sampler fields, TreeFlex's
        fixed credit and loss), ending with `resolution.resolve_budget`."""
        raise NotImplementedError

    def _check_tree_fields(self):
        """The rollout fields every config shares (`max_turns` from GRPO's `max_tool_calling_iterations` first),
        then the generation kwargs; a subclass adds its own fields' checks."""
        checks.apply_tool_calling_iterations(self)
        checks.check_tree_fields(self)
        checks.check_generation_kwargs(self)


@dataclass
class TreeConfig(TreeTrainerConfig):
    """The tree trainers' config: `TreeTrainerConfig` (tools, turn limit, generation, budget G, batch sizes) plus
    the fields of the tree components and the training layout, which it owns: `sampler`, `credit`, `loss`,
    `reward_std`, the tree samplers' fields (`num_initial_rollouts`, `num_branches`, `anchor_rule`,
    `expansion_rounds`, `branches_per_round`, `expansion_mode`, `sibling_penalty`, `entropy_threshold`,
    `max_branches_per_tree`, `min_segment_length`, `branching_rounds`), the teacher radius `target_radius` and
    `packing`. TreeFlex, which grows no tree, has its own (`TreeFlexConfig`, on the same base).

    Composition (the method table, `trl_tree.methods`): `sampler`, `credit` and `loss` are chosen independently
    among the registered tree components (`methods.SAMPLERS`, `CREDITS`, `LOSSES`; each field's help lists them, read
    from the table); the named configs are presets. TreeFlex's group components go together (`TreeFlexConfig`).
    Only the chosen components' own fields are validated (`methods.check_fields`).

    Parameters:
        sampler (`str`, defaults to `"init_expand"`): how trees grow (its help lists the registered samplers).
        credit (`str`, defaults to `"likelihood"`): how leaf advantages are backed up to turns.
        loss (`str`, defaults to `"treeopsd"`): the turn-level objective.
        reward_std (`str`, defaults to `"sample"`): leaf standardisation: `"sample"` (ddof = 1, no epsilon; TreeOPSD
            T1, TreeAdv D1) or `"population"` (ddof = 0, + 1e-6; AT2PO A3).
        num_initial_rollouts (`int`, *optional*): M, complete trajectories sampled per prompt. Defaults to the
            preset's M (4; AT2PO 10) or, when only `num_generations` is set, to the M whose budget is G.
        num_branches (`int`, *optional*): N, continuations branched from each initial trajectory at uniformly drawn
            turn prefixes ("init_expand"). K = M(N + 1); (4, 2) matches GRPO's G = 8 in expected cost. Defaults to 2;
            when only `num_generations` is set and no M reaches it with N = 2 (G = 3, 5, 7, ...), to the N ≥ 1
            nearest to 2 that does (G = 3: (M, N) = (2, 1)), said in a log line at start-up.
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
        zero_credit_anchor (`bool`, *optional*): whether turns with zero credit (V_i = 0: every turn of a tree
            without a reward spread) are pulled back toward π_old by a q = 1/2 Bernoulli teacher
            (`losses.zero_credit_anchor`). None: the loss's own behaviour ("treeopsd" pulls them, its KL to
            q_i = 1/2; "treepo" gives them no gradient). False with "treeopsd": they are left out of the KL; True with
            "treepo": the anchor, with TreeOPSD's τ, is added to the fixed-credit loss. The two are the ablation that
            separates TreeOPSD's finite target from its implicit anchor; other losses do not read it.
        stale_target (`str`, *optional*): how the "treeopsd" loss trains a tree sampled by an older policy μ than
            π_old, the policy at the start of its optimizer blocks. `"behaviour"`: as its paper defines it, the
            log-ratio s_i measured against μ, the policy the teacher q_i is relative to. `"decoupled"` (an ablation):
            s_i against π_old, each turn's KL weighted by min(π_old/μ, C) (`behaviour_importance_cap`). None: the
            loss's own form ("behaviour" for "treeopsd"; the other losses train only in the decoupled form and
            refuse "behaviour"). The two are one loss for a fresh tree (docs/design.md §3, "Stale samples").
        packing (`str`, defaults to `"tree"`): `"tree"` forwards each tree once as a packed row of its unique tokens
            with an ancestor-only attention mask (flex_attention / sdpa / eager); `"paths"` forwards one causal row
            per root-to-leaf path (any attention kernel, e.g. flash-attention) and still trains each unique token once.
            `"auto"` picks one of the two per micro-batch from the cost of the forward (`packing.pack_cheapest`):
            "tree" with flex_attention or tree_sdpa, "paths" with kernels that take no mask, and with a dense-mask
            kernel (eager) whichever costs fewer multiply-adds, since a dense mask pays all T² pairs of a long tree
            row. Same log-probs either way. With "tree" or "auto" the trainer switches an sdpa policy to
            `"tree_sdpa"` (`trl_tree.core.tree_attention`): tree rows are attended chain by chain, computing only the
            visible pairs; every other forward is sdpa's own.

        The shared fields (tools, turns, generation, G and the GRPO options): `TreeTrainerConfig`.
    """

    sampler: str = _component_field("sampler", "init_expand", "How trees grow")
    credit: str = _component_field("credit", "likelihood", "How leaf rewards are backed up to turns")
    loss: str = _component_field("loss", "treeopsd", "The turn-level objective")
    reward_std: str = field(default="sample", metadata={"help": "sample (ddof=1) | population (ddof=0, +1e-6)"})
    num_initial_rollouts: int | None = field(
        default=None, metadata={"help": "M: full trajectories per prompt (default: the preset's, or from num_generations)."}
    )
    num_branches: int | None = field(
        default=None, metadata={"help": "N: continuations per initial trajectory (default 2, or from num_generations)."}
    )
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
    zero_credit_anchor: bool | None = field(
        default=None, metadata={"help": "Pull V = 0 turns toward π_old (None: treeopsd yes, treepo no; an ablation)."}
    )
    stale_target: str | None = field(
        default=None, metadata={"help": "A stale tree's treeopsd log-ratio against: behaviour (μ, the paper) | "
                                "decoupled (π_old, × min(π_old/μ, C); an ablation). None: the loss's own."}
    )
    packing: str = field(default="tree", metadata={"help": "'tree' (one packed row per tree), 'paths' or 'auto'."})

    default_num_initial_rollouts: ClassVar[int] = 4  # the preset's M when neither M nor G is set
    default_num_branches: ClassVar[int] = 2  # the preset's N unless only G is set and N = 2 cannot reach it

    @classmethod
    def _check_sampler_kind(cls, sampler: str) -> None:
        checks.check_tree_sampler(sampler)

    @classmethod
    def _probe_defaults(cls, probe) -> None:
        if "num_branches" in vars(probe) and probe.num_branches is None:
            probe.num_branches = cls.default_num_branches

    @classmethod
    def _default_budget(cls, field_name: str) -> int:
        return cls.default_num_initial_rollouts

    def _check_composition(self):
        checks.check_tree_composition(self)

    def _check_tree_fields(self):
        super()._check_tree_fields()
        checks.check_packing(self)


@dataclass
class TreeOPSDConfig(TreeConfig):
    """Configuration of `TreeOPSDTrainer` (paper §2–3, Alg. 1): init-expand (M, N) trees with uniform anchors,
    likelihood-weighted credit, the Bernoulli forward-KL to q = 1/2 + V/τ. See `TreeConfig` (and its base `TreeTrainerConfig`) for every field."""


@dataclass
class TreePOConfig(TreeConfig):
    """Configuration of `TreePOTrainer`: TreeOPSD's trees and credit with the fixed-credit loss
    −(1/L_x) Σ_i V_i Σ_j log-ratio (T7). `target_radius` is unused."""

    loss: str = _component_field("loss", "treepo", "The turn-level objective")


@dataclass
class AT2POConfig(TreeConfig):
    """Configuration of `AT2POTrainer`: entropy-guided expansion (M = 2 initial trajectories, L = 2 rounds of K = 6
    branches), turn credit by a softmax over child entropies (A4) on population-standardised leaves (A3), and the
    ATPO loss (per-turn geometric-mean ratio, per-turn clip, GRPO's path aggregation; A5). Its default budget is
    GRPO's default G = M + L·K/2 = 8 trajectories per prompt, so that a GRPO config with nothing set compares like
    with like; the paper's M = 10 (`num_initial_rollouts=10`) costs G = 16.

    The paper's ablations are switches: `expansion_mode="random"`, `loss="grpo"` (token-level ratio and clip),
    `credit="path"` (turn credit off), `credit="child_mean"` / `"leaf_mean"` (other backups)."""

    sampler: str = _component_field("sampler", "entropy_guided", "How trees grow")
    credit: str = _component_field("credit", "child_softmax", "How leaf rewards are backed up to turns")
    loss: str = _component_field("loss", "atpo", "The turn-level objective")
    reward_std: str = field(default="population", metadata={"help": "sample (ddof=1) | population (ddof=0, +1e-6)"})
    num_initial_rollouts: int | None = field(
        default=None, metadata={"help": "M: initial trajectories per prompt (default 2: G = 8 as GRPO's; the paper's "
                                "10 gives G = 16; or from num_generations)."}
    )
    default_num_initial_rollouts: ClassVar[int] = 2


PENALTY_MODES = methods.PENALTY_MODES  # the search credit's own (`methods.Credit.check`)


@dataclass
class TreeAdvConfig(TreeConfig):
    """Configuration of `TreeAdvTrainer`: a forest of M = 4 trees per prompt, each branching inside its completions at
    tokens with entropy above τ_H = 1 nat (at most 2 branch points per tree, pieces of at least 8 tokens, one
    round), segment advantages (D1–D3, sample std) and GRPO's clipped token surrogate (D4).

    Switches: `loss="gspo_token"` (GSPO-token; GSPO clips the sequence ratio tightly, e.g. `epsilon=3e-4,
    epsilon_high=4e-4`), `entropy_threshold=float("inf")` (no branching: GRPO with G = M), `num_initial_rollouts`
    (the paper's 1, 2, 4 trees), `branching_rounds` (deeper trees), `credit="path"` (no segment credit: each token
    takes its trajectory's advantage, as in GRPO). See `TreeConfig` (and its base `TreeTrainerConfig`) for every field."""

    sampler: str = _component_field("sampler", "token_entropy", "How trees grow")
    credit: str = _component_field("credit", "leaf_mean", "How leaf rewards are backed up to turns (D2: leaf_mean)")
    loss: str = _component_field("loss", "grpo", "The turn-level objective (D4: grpo or gspo_token)")
    num_initial_rollouts: int | None = field(
        default=None, metadata={"help": "M: trees per prompt (default 4, or from num_generations)."}
    )


@dataclass
class TreeFlexConfig(TreeTrainerConfig):
    """Configuration of `TreeFlexTrainer` (docs/design.md §3 F1–F4). The shared fields (tools, turn limit, generation,
    budget G, batch sizes, GRPO options) are `TreeTrainerConfig`'s, as for the tree trainers; it owns `sampler`,
    `credit`, `loss`, `num_searches`, `max_blocks`, `penalty_mode`, `aggregation`, `role_lambda`, `dual_clip_c` and
    `max_card_chars`. TreeFlex grows no tree, so it has none of `TreeConfig`'s tree fields (`num_initial_rollouts`,
    `num_branches`, `anchor_rule`, the expansion and token-branching fields, `reward_std`, `target_radius`,
    `packing`: every block is one causal path, packed as a one-path tree row).

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
    """

    sampler: str = _component_field("sampler", "two_role", "The harness (or pass harness=)", unit="group")
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

    maps_tool_calling_iterations: ClassVar[bool] = False  # max_turns is per segment here

    @classmethod
    def _default_budget(cls, field_name: str) -> int:
        return 4  # num_searches

    @classmethod
    def _check_sampler_kind(cls, sampler: str) -> None:
        checks.check_harness(sampler)

    def _check_composition(self):
        checks.check_flex_composition(self)
