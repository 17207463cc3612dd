"""The turn loop: grows branches one turn at a time with a multi-turn tool-calling policy (docs/design.md §5).

A `Branch` is one trajectory being grown: its token history (which only ever grows by appending the model's tokens
and the observation's tokens), its turns, its conversation messages (what reward functions see) and, for stateful
environments, the environment, the tool calls that shaped it and, when the sampler will branch and the environment
can be copied, a snapshot of it before every turn (so a branch can restart from any turn with the world as it was
then; without snapshots it is rebuilt by replaying the recorded calls, see `TreeEnvironment`).

A round of the loop is one batched engine call that continues every ready branch by one turn (or one chunk of it),
then the tool calls of the turns that ended, all at once (`tool_executor`). What the loop needs of its owner (the
engine, action parsing, observation ids, the any-rank-active vote, its metrics) is one typed port, `TurnLoopPorts`.
On multi-process runs, `any_active` is a collective: every rank keeps calling the engine (with nothing, if it has
nothing left) until no rank has work, so all ranks issue the same number of generate calls. The samplers
(`samplers.py`) decide which branches to start and where to restart them; this loop only grows them.
"""

from __future__ import annotations

import logging
import time
import warnings
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from ...core.tree import Turn
from ..acting.env_branching import (
    RecordedCall,
    TreeEnvironment,
    capture_random_state,
    environment_tools,
    fork_environment,
    same_random_state,
)
from ..acting.tool_executor import (
    CallLimits,
    PlannedCall,
    ToolExecutor,
    advise_on_failing_round,
    check_max_concurrent_tool_calls,
    plan_jobs,
    wait_for,
)
from ..acting.tools import (
    MAX_OBSERVATION_CHARS,
    ToolResult,
    check_tool_execution,
    check_tool_timeout,
    error_result,
    run_tool_call,
)
from ..generating.engine import GenerationEngine

INVALID_TOOL_NAME = "invalid_tool_call"
logger = logging.getLogger(__name__)


@dataclass
class Branch:
    """One trajectory being grown. `turn_starts[t]` / `message_starts[t]` mark where turn t begins;
    `calls_per_turn[t]` / `failures_per_turn[t]` count the tool calls turn t made and how many of them failed.

    `pending` is the head of an assistant turn that is already in `prefix_ids` but not yet in `turns`: a branch
    restarted inside a turn (`restart_inside`, TreeAdv's token-level branching) continues that turn, and the turn loop
    then records and parses the whole turn, head and continuation together.

    Environment: `environment` is the tree's `TreeEnvironment` (None without `environment_factory`); `env_calls` the
    tool calls run on `env` so far (what replay re-runs); `snapshots[t]` a copy of `env` before turn t, or None (turn
    0: a restart from the prompt starts a fresh instance; replay: no copies). The turn loop takes snapshots only when
    `take_snapshots` is set, i.e. when the sampler will restart branches. `diverged_at` is the first turn from which
    the branch's environment disagrees with its history (a replay that did not reproduce it, or a copy of such a
    world), None while they agree: the trainer does not train such a branch (`replay_divergence`).
    """

    tree: int
    prefix_ids: list[int]
    prompt_len: int
    turns: list[Turn] = field(default_factory=list)
    messages: list[dict] = field(default_factory=list)
    env: Any = None
    tools: dict[str, Callable] = field(default_factory=dict)
    snapshots: list[Any] = field(default_factory=list)
    turn_starts: list[int] = field(default_factory=list)
    message_starts: list[int] = field(default_factory=list)
    calls_per_turn: list[int] = field(default_factory=list)
    failures_per_turn: list[int] = field(default_factory=list)
    done: bool = False
    pending: Turn | None = None
    environment: TreeEnvironment | None = None
    env_calls: list[RecordedCall] = field(default_factory=list)
    take_snapshots: bool = False
    diverged_at: int | None = None
    round: int = 0  # the sampling round that created the branch (0: initial trajectories); the tree view shows it
    # the turn whose call on `env` timed out while it may still run there (its thread was left behind): the branch
    # ends at that turn, since its environment may change behind the model's back (docs/design.md §5)
    abandoned_at: int | None = None

    @property
    def completion_len(self) -> int:
        return len(self.prefix_ids) - self.prompt_len

    @property
    def completion_ids(self) -> list[int]:
        """Everything after the prompt (tool observations included): what TRL's reward functions get as
        `completion_ids` (`trl_tree.core.pipeline.Leaf`)."""
        return self.prefix_ids[self.prompt_len :]

    @property
    def tool_calls(self) -> int:
        """Tool calls of the whole trajectory, those of the turns it shares with other branches included (GRPO counts
        per completion)."""
        return sum(self.calls_per_turn)

    @property
    def tool_failures(self) -> int:
        """Failed or malformed tool calls of the whole trajectory."""
        return sum(self.failures_per_turn)

    def restart_at(self, t: int) -> Branch:
        """A new branch that keeps turns [0, t) and will regenerate turn t (t = 0: resample from the prompt)."""
        env = self._environment_before(t)
        # t = len(turns): the branch itself is about to sample turn t (an anchor reached while it runs)
        head = len(self.pending.action_ids) if self.pending is not None else 0
        end = self.turn_starts[t] if t < len(self.turn_starts) else len(self.prefix_ids) - head
        messages_end = self.message_starts[t] if t < len(self.message_starts) else len(self.messages)
        return Branch(
            tree=self.tree,
            prefix_ids=self.prefix_ids[:end],
            prompt_len=self.prompt_len,
            turns=list(self.turns[:t]),
            messages=list(self.messages[:messages_end]),
            env=env,
            tools=_bind_tools(self.tools, env),
            snapshots=list(self.snapshots[:t]),
            turn_starts=list(self.turn_starts[:t]),
            message_starts=list(self.message_starts[:t]),
            calls_per_turn=list(self.calls_per_turn[:t]),
            failures_per_turn=list(self.failures_per_turn[:t]),
            environment=self.environment,
            env_calls=[c for c in self.env_calls if c.turn < t],
            take_snapshots=self.take_snapshots,
            diverged_at=self._diverged_at_restart(t, env),
        )

    def _diverged_at_restart(self, t: int, env) -> int | None:
        """Where a branch restarted before turn t with environment `env` disagrees with its history: at t when `env`
        was rebuilt and did not reproduce it; else (a copy) where this branch's world did, if turn t lies past that."""
        rebuilt = self.environment.diverged(env) if self.environment is not None and env is not None else None
        if rebuilt is not None:
            return t if rebuilt else None
        return self.diverged_at if self.diverged_at is not None and t >= self.diverged_at else None

    def _environment_before(self, t: int):
        """The environment as it was before turn t, for a branch restarted there (see `TreeEnvironment`)."""
        if self.env is None:
            return None
        if t == len(self.turns) and not self.done:
            snapshot = self.env  # before turn t (no tool runs inside a turn) the world is the branch's own: copy it
        else:
            snapshot = self.snapshots[t] if t < len(self.snapshots) else None
        if self.environment is not None:
            return self.environment.at(snapshot, [c for c in self.env_calls if c.turn < t])
        if snapshot is None:
            raise ValueError(
                f"Cannot restart this branch before turn {t}: no snapshot of its environment was taken there and it has "
                "no TreeEnvironment to rebuild one (build its TreeRoot with `environment=`, or set take_snapshots)."
            )
        return fork_environment(snapshot)

    def turn_at(self, position: int) -> int:
        """The assistant turn whose action covers token `position` of `prefix_ids`."""
        for t, (start, turn) in enumerate(zip(self.turn_starts, self.turns)):
            if start <= position < start + len(turn.action_ids):
                return t
        raise ValueError(f"Token {position} lies in no action of this branch (prompt, observation or past its end).")

    def restart_inside(self, position: int) -> Branch:
        """A new branch that keeps the history up to token `position`, which lies inside turn t's action (not at its
        first token), and regenerates turn t from that token on: the kept head of turn t becomes `pending`.

        The environment is the one before turn t (no tool runs inside a turn), as in `restart_at(t)`.
        """
        t = self.turn_at(position)
        offset = position - self.turn_starts[t]
        if offset == 0:
            raise ValueError(f"Token {position} starts turn {t}: branch at a turn boundary with restart_at({t}).")
        turn = self.turns[t]
        branch = self.restart_at(t)
        branch.prefix_ids = branch.prefix_ids + turn.action_ids[:offset]
        branch.pending = Turn(
            turn.action_ids[:offset],
            turn.action_logps[:offset],
            entropies=None if turn.entropies is None else turn.entropies[:offset],
        )
        return branch


def _bind_tools(tools: dict[str, Callable], env) -> dict[str, Callable]:
    """Re-point an environment's tool methods at `env` (a forked copy); standalone tools are kept as they are."""
    if env is None:
        return dict(tools)
    rebound = {**tools}
    for method in environment_tools(env):
        rebound[method.__name__] = method
    return rebound


@dataclass
class SamplerSettings:
    max_turns: int
    max_completion_length: int
    tool_timeout: float | None = 30.0
    max_observation_chars: int | None = MAX_OBSERVATION_CHARS
    failure_penalty: float = -1.0
    malformed_tool_calls: str = "end"  # as TRL's loop, or "observe" (TreeConfig.malformed_tool_calls)
    tool_execution: str = "thread"  # or "main" (TreeConfig.tool_execution)
    max_turn_tokens: int | None = None  # cap on one sampled assistant turn (TreeConfig.max_turn_tokens)
    chunk_tokens: int | None = None  # tokens a branch samples per engine call (TreeConfig.generation_chunk_tokens)
    max_tool_calls_per_turn: int | None = 8  # calls run per turn, the rest answered with errors (TreeConfig's field)
    max_concurrent_tool_calls: int = 64  # tool jobs in flight at once (TreeConfig's field; 1: one after another)

    def __post_init__(self):
        check_tool_execution(self.tool_execution)
        check_tool_timeout(self.tool_timeout)
        check_chunk_tokens(self.chunk_tokens)
        check_max_tool_calls_per_turn(self.max_tool_calls_per_turn)
        check_max_concurrent_tool_calls(self.max_concurrent_tool_calls)

    @classmethod
    def from_config(cls, args, max_completion_length: int | None = None, **extra) -> SamplerSettings:
        """The settings a trainer config (`TreeTrainerConfig`) gives, read in one place so every user of the loop
        (the trainers, the agent evaluation's `AgentSettings`, the HotpotQA script) runs tools and budgets alike;
        `extra`: a subclass's own fields."""
        return cls(
            max_turns=args.max_turns,
            max_completion_length=max_completion_length or args.max_completion_length,
            tool_timeout=args.tool_timeout,
            max_observation_chars=args.max_observation_chars,
            failure_penalty=args.tool_failure_penalty,
            malformed_tool_calls=args.malformed_tool_calls,
            tool_execution=args.tool_execution,
            max_turn_tokens=args.max_turn_tokens,
            chunk_tokens=args.generation_chunk_tokens,
            max_tool_calls_per_turn=args.max_tool_calls_per_turn,
            max_concurrent_tool_calls=args.max_concurrent_tool_calls,
            **extra,
        )

    @property
    def concurrent_tools(self) -> bool:
        """Whether a round's calls run together in the worker pool. `tool_execution="main"` runs synchronous tools in
        the trainer's thread, which holds one call at a time, so it runs every call as GRPOTrainer does."""
        return self.max_concurrent_tool_calls > 1 and self.tool_execution != "main"


def check_chunk_tokens(chunk_tokens: int | None) -> None:
    if chunk_tokens is not None and chunk_tokens < 1:
        raise ValueError(
            f"generation_chunk_tokens must be a positive number of tokens per generate call, or None (a whole turn per "
            f"call); got {chunk_tokens}."
        )


def check_max_tool_calls_per_turn(cap: int | None) -> None:
    if cap is not None and (isinstance(cap, bool) or not isinstance(cap, int) or cap < 1):
        raise ValueError(
            f"max_tool_calls_per_turn must be a positive number of tool calls run per assistant turn, or None (no "
            f"cap); got {cap!r}."
        )


@dataclass
class ToolStats:
    """What the loop's tool calls cost: calls run, seconds the loop stood still waiting for them (with nothing to
    generate meanwhile), observations dropped for want of room in the trajectory's budget, branches ended because a
    call on their environment was abandoned at its deadline. Threads stuck in tools are process-wide:
    `tools.stuck_tool_threads()`."""

    calls: int = 0
    wait_seconds: float = 0.0
    dropped_observations: int = 0
    abandoned_environments: int = 0  # branches ended by a timed-out call still running on their environment


@dataclass(frozen=True)
class TurnLoopPorts:
    """What the turn loop needs of its owner (a trainer, the agent evaluation, a test), narrowly: built in one place
    by each owner (`TreeTrainer._build_turn_loop`), as the pipeline's `PipelinePorts` are.

    Attributes:
        engine: the generation backend (`GenerationEngine`: `generate(prefixes, max_new_tokens)`).
        parse: `parse(action_ids, prefix_ids) -> assistant message dict` (with `tool_calls` when the action calls
            tools), e.g. TRL's `parse_response` bound to the tokenizer.
        observation_ids: `observation_ids(tool_messages) -> token ids` for the tool responses and the next
            assistant header (TRL's `_get_tool_suffix_ids`).
        any_active: `any_active(local_flag) -> bool`, the vote across ranks on whether any still has work (a
            collective on multi-process runs; this process's own flag on one).
        tool_stats: the loop's metrics, what its tool calls cost, counted here for the owner to read.
        event_loop: where async tools run (GRPOTrainer's `async_loop`); None: a new event loop per call.
    """

    engine: GenerationEngine
    parse: Callable[[list[int], list[int]], dict]
    observation_ids: Callable[[list[dict]], list[int]]
    any_active: Callable[[bool], bool] = lambda flag: flag
    tool_stats: ToolStats = field(default_factory=ToolStats)
    event_loop: Any = None

    def __post_init__(self):
        if not callable(getattr(self.engine, "generate", None)):
            raise TypeError(
                f"TurnLoopPorts.engine must be a generation backend with `generate(prefixes, max_new_tokens)` "
                f"(trl_tree.rollout.generating.engine.GenerationEngine); got {type(self.engine).__name__}."
            )
        for name in ("parse", "observation_ids", "any_active"):
            if not callable(getattr(self, name)):
                raise TypeError(f"TurnLoopPorts.{name} must be callable; got {type(getattr(self, name)).__name__}.")


class TurnLoop:
    """Continues branches one turn at a time: generate, parse tool calls, run them, append the observation.

    Tool calls (`tool_executor`): the calls of every turn that ended in a round start together in a bounded worker
    pool (`settings.max_concurrent_tool_calls`; 1, or `tool_execution="main"`, runs them one after another in this
    thread, as GRPOTrainer does). Their results are attached in the order of the round's branches, so the sampled
    tokens do not depend on which call finishes first. With chunked generation (`settings.chunk_tokens`, continuous
    batching) the calls of standalone tools also overlap generation: their branches sit out the engine calls until
    their results land, while the other branches go on; the batches, hence a seeded run's tokens, then depend on the
    tools' timing. Calls on a branch's stateful environment always complete within their round (see `_run_round`).

    Args:
        ports: what the loop needs of its owner (`TurnLoopPorts`: the engine, action parsing, observation ids, the
            any-rank-active vote, the metrics it counts into, the event loop of async tools).
        settings: budgets and tool limits.
    """

    def __init__(self, ports: TurnLoopPorts, settings: SamplerSettings):
        if not isinstance(ports, TurnLoopPorts):
            raise TypeError(
                f"TurnLoop takes its owner's ports as one TurnLoopPorts(engine=..., parse=..., observation_ids=...) "
                f"and then its SamplerSettings; got {type(ports).__name__} for the ports."
            )
        if not isinstance(settings, SamplerSettings):
            raise TypeError(f"TurnLoop's settings must be a SamplerSettings; got {type(settings).__name__}.")
        self.ports = ports
        self.settings = settings
        self.executor = ToolExecutor(settings.max_concurrent_tool_calls) if settings.concurrent_tools else None
        self._waiting: list[_ToolRequest] = []  # requests in flight while generation goes on (chunked rounds)
        # per environment class, whether its calls were seen drawing from the global random generators (absent: not
        # known yet). Such calls run one at a time, so that replay knows the random state each ran with (`_run_round`)
        self._environment_draws: dict[type, bool] = {}
        self._blocks_checked: set[str] = set()  # tools whose content blocks were rendered once (`_check_blocks_render`)

    @property
    def tool_stats(self) -> ToolStats:
        """What the loop's tool calls cost so far (`ports.tool_stats`)."""
        return self.ports.tool_stats

    def close(self) -> None:
        """Stop the tool pool's threads (`ToolExecutor.close`). Whoever builds a loop closes it when done with it, on
        every exit path (`with TurnLoop(...) as loop:`); a closed loop may still run, restarting its pool."""
        if self.executor is not None:
            self.executor.close()

    def __enter__(self) -> TurnLoop:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def run_call(self, call: dict, tools: dict[str, Callable]) -> ToolResult:
        """Run one parsed tool call with the loop's limits and execution mode (replay re-runs recorded calls through
        this too, so a replayed call runs exactly as the original did)."""
        s = self.settings
        execution = s.tool_execution if not s.concurrent_tools else "thread"
        return run_tool_call(call, tools, s.tool_timeout, s.max_observation_chars, execution, self.ports.event_loop)

    def run(
        self,
        branches: list[Branch],
        on_finish: Callable[[Branch], list[Branch]] | None = None,
        on_turn: Callable[[Branch], list[Branch]] | None = None,
    ) -> None:
        """Grow every branch to a terminal turn (in place).

        After each engine call, `on_turn(branch)` is asked about every branch that completed a turn and goes on (it is
        about to sample turn `len(branch.turns)`), and `on_finish(branch)` about every branch that is now done. The new
        branches they return are appended to `branches` and join the next engine call alongside the branches still
        running, instead of waiting for a call of their own. A turn is complete once its tool results are attached.
        """
        def completed(turned: list[Branch]) -> None:
            for branch in turned:
                hook = on_finish if branch.done else on_turn
                if hook is not None:
                    branches.extend(hook(branch))

        self._waiting = []
        while self.ports.any_active(any(not b.done for b in branches)):
            while self._waiting and not self._ready(branches):  # nothing to generate: wait for a tool to land
                completed(self._collect(block=True))
            completed(self.step([b for b in branches if not b.done]))

    def _ready(self, branches: list[Branch]) -> list[Branch]:
        """The branches the next engine call continues: not done, not waiting for their tools."""
        waiting = {id(request.branch) for request in self._waiting}
        return [b for b in branches if not b.done and id(b) not in waiting]

    def step(self, active: list[Branch]) -> list[Branch]:
        """One engine call that continues every ready branch, then the round's tool calls; returns the branches that
        completed a turn (tool results attached), in a fixed order.

        With `settings.chunk_tokens` = c and an engine that resumes a cut turn cheaply (`resumes_turns`), a call
        samples at most c tokens per branch (continuous batching at chunk granularity): a branch whose turn is still
        going after c tokens keeps them as its pending head and goes on in the next call, while the branches that
        ended their turn run their tools and rejoin, and new branches join, at once, instead of every branch of the
        batch waiting for the longest turn. Each token is still drawn from the same distribution, given the same
        history; only the batches (hence a seeded run's random draws) differ. In that mode a branch whose standalone
        tools are still running sits the call out (`_collect` attaches its results when they land).
        """
        ready = self._ready(active)
        budgets = [self._turn_budget(b) for b in ready]
        chunk = self.settings.chunk_tokens if getattr(self.ports.engine, "resumes_turns", False) else None
        asked = budgets if chunk is None else [min(budget, chunk) for budget in budgets]
        outputs = self.ports.engine.generate([b.prefix_ids for b in ready], asked)
        ended: list[tuple[Branch, _ToolRequest | None]] = []
        for branch, out, budget, n in zip(ready, outputs, budgets, asked):
            if n < budget and not out.finished and len(out.ids) == n:  # cut by the chunk, not a budget: goes on
                self._extend_pending(branch, out)
            else:
                ended.append((branch, self._append_turn(branch, out)))
        self._run_round([request for _, request in ended if request is not None], overlap=chunk is not None)
        in_flight = {id(request.branch) for request in self._waiting}
        ended_now = [branch for branch, _ in ended if id(branch) not in in_flight]
        return ended_now + self._collect(block=False)

    @staticmethod
    def _extend_pending(branch: Branch, out) -> None:
        """Keep a chunk of a turn that is still going as the branch's pending head (in `prefix_ids`, not a turn)."""
        ids, logps, entropies = _join_head(branch.pending, out)
        branch.pending = Turn(ids, logps, entropies=entropies)
        branch.prefix_ids = branch.prefix_ids + list(out.ids)

    def _turn_budget(self, branch: Branch) -> int:
        """New tokens the branch's next turn may sample: what is left of the trajectory's budget, capped per turn.

        One generate call runs as long as its longest row, so a single rambling turn holds the whole batch open; the
        per-turn cap (counting a pending head's tokens as the turn's) bounds that. A turn cut by either budget is
        truncated: it ends the trajectory and is context, not trained.
        """
        budget = self.settings.max_completion_length - branch.completion_len
        cap = self.settings.max_turn_tokens
        if cap is not None:
            head = len(branch.pending.action_ids) if branch.pending is not None else 0
            budget = min(budget, max(1, cap - head))
        return budget

    def _append_turn(self, branch: Branch, out) -> _ToolRequest | None:
        """Record the turn the engine ended; return its tool calls to run (None: the branch is done or its turn
        complete)."""
        s = self.settings
        t = len(branch.turns)
        head, branch.pending = branch.pending, None  # the turn's first tokens, when it continues a mid-turn prefix
        ids, logps, entropies = _join_head(head, out)
        branch.turn_starts.append(len(branch.prefix_ids) - (len(head.action_ids) if head is not None else 0))
        branch.message_starts.append(len(branch.messages))
        if branch.env is not None:
            # before turn 0 the world is the reset one: a restart there starts a fresh instance (no copy needed)
            needed = branch.take_snapshots and (t > 0 or branch.environment is None)
            branch.snapshots.append(_snapshot(branch) if needed else None)
        # A backend that returns no token (no EOS either) gives an empty action: TRL's response parser fails on it,
        # so it is an empty assistant message without tool calls, which ends the trajectory (scored like any leaf).
        message = (self.ports.parse(ids, branch.prefix_ids[: branch.turn_starts[-1]]) if ids  # the whole assistant turn
                   else {"role": "assistant", "content": ""})
        calls = message.get("tool_calls") or []
        malformed = not calls and bool(branch.tools) and _looks_like_tool_call(message)
        branch.messages.append(message)
        branch.prefix_ids = branch.prefix_ids + out.ids
        turn = Turn(ids, logps, [], entropies=entropies, truncated=not out.finished)
        branch.turns.append(turn)
        branch.calls_per_turn.append(0)
        branch.failures_per_turn.append(0)
        last_turn_allowed = t + 1 >= s.max_turns
        if not out.finished or (not calls and not malformed) or last_turn_allowed:
            branch.done = True
            return None
        if malformed and s.malformed_tool_calls == "end":  # TRL's loop: no parsed call, so the turn is final
            self._record_tool_results(branch, turn, [_malformed_result()])
            branch.done = True
            return None
        if not calls:  # "observe": the malformed call is answered at once, nothing runs
            self._attach(_ToolRequest(branch, turn, t, [], [_malformed_result()]))
            return None
        n = self._calls_run(calls)
        capped = [_capped_result(call, n, len(calls)) for call in calls[n:]]
        return _ToolRequest(branch, turn, t, [PlannedCall(call, branch.tools) for call in calls[:n]], capped)

    def _calls_run(self, calls: list) -> int:
        cap = self.settings.max_tool_calls_per_turn
        return len(calls) if cap is None else min(cap, len(calls))

    def _run_round(self, requests: list[_ToolRequest], overlap: bool) -> None:
        """Run the tool calls of the turns that ended in this round and attach their results, in the requests' order.

        A turn's first `max_tool_calls_per_turn` calls run, the rest are answered with an error each: without a cap
        one turn could hold the batch for (calls × tool_timeout); each capped call still gets its tool message, so the
        conversation stays well-formed and the model reads why (a failed call for the metrics and TreeFlex's penalty).

        One at a time (`concurrent_tools` off): in order, in this thread, each after capturing the global random
        state it runs with (what replay restores), as GRPOTrainer runs them. Concurrently: each branch's calls are a
        lane of the pool (`tool_executor.plan_jobs`; batched tools in one request). Replay needs the global random
        state each environment call ran with, and calls running together would race on it. So an environment class's
        calls run one at a time (exact capture) until a round shows they leave the global state alone; then they join
        the pool, the state captured once before each round and checked after it: unchanged, no call drew and the
        capture is exact for every call; changed, the round's environment calls are recorded without a state (a
        replay of them that does not reproduce its history is caught as a divergence), a warning says so, and their
        classes run one at a time from then on. For the same reason environment calls never overlap generation
        (which draws from torch's generator): with `overlap`, only requests without an environment stay in flight
        across engine calls.
        """
        if not requests:
            return
        for order, request in enumerate(requests):
            request.order = order
        self.ports.tool_stats.calls += sum(len(r.calls) for r in requests)
        serial = [r for r in requests if self._one_at_a_time(r)]
        drew: dict[type, bool] = {}
        start = time.monotonic()
        for request in serial:
            cls = type(request.branch.env)
            drew[cls] = self._run_serially(request) or drew.get(cls, False)
        self.ports.tool_stats.wait_seconds += time.monotonic() - start  # the loop stands still while they run
        if self.executor is not None:  # environments seen drawing stay serial; the others join the pool
            for cls, did in drew.items():
                self._environment_draws[cls] = self._environment_draws.get(cls, False) or did
        pooled = [r for r in requests if not any(r is q for q in serial)]
        now: list[_ToolRequest] = []
        if pooled:
            environments = [r.branch.env for r in pooled]
            state = capture_random_state() if any(env is not None for env in environments) else None
            limits = CallLimits(self.settings.tool_timeout, self.settings.max_observation_chars, self.ports.event_loop)
            jobs, where = plan_jobs([r.calls for r in pooled], environments, limits)
            for request, slots in zip(pooled, where):
                request.slots, request.random_state = slots, state
            self.executor.submit(jobs)
            now = [r for r in pooled if not (overlap and r.branch.env is None)]
            self._waiting.extend(r for r in pooled if overlap and r.branch.env is None)
            self._wait([job for r in now for job, _ in r.slots])
            if state is not None and not same_random_state(state, capture_random_state()):
                self._environment_calls_drew_randomness(now)
            advise_on_failing_round([result for r in now for result in r.gathered()])
        self._attach_in_order(serial + now)

    def _one_at_a_time(self, request: _ToolRequest) -> bool:
        """Whether a request's calls run in this thread, alone: all of them without the pool; with it, the calls on
        an environment class not yet seen to leave the global random state alone (see `_run_round`)."""
        if self.executor is None:
            return True
        return request.branch.env is not None and self._environment_draws.get(type(request.branch.env), True)

    def _run_serially(self, request: _ToolRequest) -> bool:
        """Run a request's calls in order in this thread, each after capturing the global random state it runs with;
        return whether any of them drew from it."""
        request.results, request.states = [], []
        drew = False
        for planned in request.calls:
            request.states.append(capture_random_state())
            request.results.append(self.run_call(planned.call, planned.tools))
            drew = drew or (request.branch.env is not None
                            and not same_random_state(request.states[-1], capture_random_state()))
        return drew

    def _attach_in_order(self, requests: list[_ToolRequest]) -> None:
        for request in sorted(requests, key=lambda r: r.order):
            self._attach(request)

    def _wait(self, jobs: list, first: bool = False) -> None:
        """Wait for tool jobs (`first`: for one of them), counting the time generation stood still for them."""
        start = time.monotonic()
        try:
            wait_for(jobs, self.executor, first=first)
        finally:
            self.ports.tool_stats.wait_seconds += time.monotonic() - start

    def _collect(self, block: bool) -> list[Branch]:
        """Attach the results of requests in flight that have landed (`block`: wait for one first, as no branch can
        generate meanwhile), in the order they were made; returns their branches."""
        if not self._waiting:
            return []
        jobs = [job for request in self._waiting for job, _ in request.slots]
        if block:
            self._wait(jobs, first=True)
        landed = [r for r in self._waiting if all(job.done.is_set() for job, _ in r.slots)]
        wait_for([job for r in landed for job, _ in r.slots], self.executor)  # re-raises what stops the run
        self._waiting = [r for r in self._waiting if r not in landed]
        for request in landed:
            self._attach(request)
        return [request.branch for request in landed]

    def _environment_calls_drew_randomness(self, requests: list[_ToolRequest]) -> None:
        names = sorted({type(r.branch.env).__name__ for r in requests if r.branch.env is not None})
        warnings.warn(
            f"Tool calls on environment(s) {', '.join(names)} drew from the global random generators (Python's "
            "`random`, NumPy's or torch's) while other calls ran concurrently, so the random state each call ran "
            "with is unknown and a replay of them may not reproduce their outputs (such branches are caught as "
            "diverged, replay_divergence). From now on their calls run one at a time, each after its random state is "
            "captured; other calls stay concurrent. To keep an environment's calls concurrent, draw from a generator "
            "of its own (seeded from the row) instead, or give it a fork() method (its branches are then not "
            "replayed).",
            RuntimeWarning, stacklevel=4,
        )
        for request in requests:
            if request.branch.env is not None:
                self._environment_draws[type(request.branch.env)] = True
                request.random_state = None

    def _attach(self, request: _ToolRequest) -> None:
        """Give a branch its turn's tool results: the recorded calls (what replay re-runs), counts and penalty, and
        the observation tokens, unless they do not fit what is left of the trajectory's budget."""
        branch, turn = request.branch, request.turn
        results = request.gathered() + request.capped
        if branch.env is not None:  # calls past the cap never ran: replay must not run them either
            states = request.states or [request.random_state] * len(request.calls)
            ran = zip(request.calls, results, states)
            branch.env_calls += [RecordedCall(request.t, p.call, r.content, r.failed, state) for p, r, state in ran]
        self._record_tool_results(branch, turn, results)
        if branch.env is not None and any(r.abandoned for r in results):
            self._abandon_environment(branch, request.t)
            return
        # the model sees each message cut at max_observation_chars; the conversation keeps the full content
        obs = self.ports.observation_ids([r.observation_message for r in results])
        self._check_blocks_render(results)
        if branch.completion_len + len(obs) >= self.settings.max_completion_length:
            branch.done = True  # no room for the answer: end here, as TRL drops overlong tool results
            turn.observation_dropped = True
            self.ports.tool_stats.dropped_observations += 1
            return
        turn.observation_ids = list(obs)
        branch.messages.extend(r.message for r in results)
        branch.prefix_ids = branch.prefix_ids + list(obs)

    def _check_blocks_render(self, results: list[ToolResult]) -> None:
        """Content blocks reach the chat template as they are (GRPOTrainer's rule), and some templates render them as
        nothing (Qwen3's shows an empty `<tool_response>`): the model would read nothing and no call would count as
        failed. Checked once per tool, by rendering its blocks against an empty message; said in a warning."""
        for result in results:
            if not isinstance(result.observation, list) or result.name in self._blocks_checked:
                continue
            self._blocks_checked.add(result.name)
            empty = {**result.observation_message, "content": ""}
            if self.ports.observation_ids([result.observation_message]) == self.ports.observation_ids([empty]):
                logger.warning(
                    "Tool %s returned content blocks (a list of dicts with a \"type\"), which the chat template "
                    "renders to nothing: the model reads an empty tool response. Return a str (or a value whose str() "
                    "the model should read) instead.", result.name,
                )

    def _abandon_environment(self, branch: Branch, t: int) -> None:
        """A call on the branch's environment timed out and its thread was left running it: the instance may change
        behind the model's back for as long as that call runs. The branch ends at turn t (like a dropped observation,
        without the answer, so the model is never shown a world it did not see change), counted in `tool_stats` and
        the trainers' `tools/abandoned_environments`; the instance leaves the environment pool, so no later batch
        resets it under the call (the pool makes a new one)."""
        branch.done = True
        branch.abandoned_at = t
        self.ports.tool_stats.abandoned_environments += 1
        if branch.environment is not None:
            branch.environment.pool.retire(branch.env)

    def _record_tool_results(self, branch: Branch, turn: Turn, results) -> None:
        """Count the turn's tool calls and failures, and put the process penalty on the turn that made them."""
        failures = sum(r.failed for r in results)
        branch.calls_per_turn[-1] = len(results)
        branch.failures_per_turn[-1] = failures
        turn.penalty = self.settings.failure_penalty * failures


@dataclass(eq=False)
class _ToolRequest:
    """One ended turn's tool calls: those that run (`calls`) and the error answers of those past the cap (`capped`).
    Results come from `_run_serially` (`results`, with the random `states` each call ran with) or from the pool's jobs
    (`slots`: per call, its job and the index of its result there; `random_state`: captured before the round)."""

    branch: Branch
    turn: Turn
    t: int
    calls: list[PlannedCall]
    capped: list[ToolResult]
    slots: list = field(default_factory=list)
    random_state: Any = None
    results: list[ToolResult] | None = None
    states: list | None = None
    order: int = 0

    def gathered(self) -> list[ToolResult]:
        if self.results is not None:
            return list(self.results)
        return [job.results[index] for job, index in self.slots]


def _snapshot(branch: Branch):
    """A copy of the branch's environment before its next turn (None when its branches will be replayed)."""
    if branch.environment is None:
        return fork_environment(branch.env)
    return branch.environment.snapshot(branch.env)


def _join_head(head: Turn | None, out) -> tuple[list[int], list[float], list[float] | None]:
    """A turn's ids, log-probs and entropies: the pending head (if any) followed by what the engine generated."""
    if head is None:
        return list(out.ids), list(out.logps), out.entropies
    entropies = None if head.entropies is None or out.entropies is None else head.entropies + list(out.entropies)
    return head.action_ids + list(out.ids), head.action_logps + list(out.logps), entropies


def _looks_like_tool_call(message: dict) -> bool:
    content = message.get("content")
    return isinstance(content, str) and "<tool_call>" in content


def _capped_result(call, cap: int, made: int) -> ToolResult:
    function = call.get("function") if isinstance(call, dict) else None
    name = function.get("name") if isinstance(function, dict) else None
    return error_result(
        name if isinstance(name, str) else "unknown",
        f"Not run: this turn made {made} tool calls and at most {cap} run per turn (max_tool_calls_per_turn). "
        "Make fewer calls per turn, and the rest in the next turn.",
    )


def _malformed_result() -> ToolResult:
    return error_result(
        INVALID_TOOL_NAME,
        'Malformed tool call. Write <tool_call>{"name": ..., "arguments": {...}}</tool_call> with valid JSON.',
    )
