"""The turn loop: grows branches one turn at a time with a multi-turn tool-calling policy (docs/design.md §5).

A `Branch` is one trajectory being grown: its token history (which only ever grows by appending the model's tokens
and the observation's tokens), its turns, its conversation messages (what reward functions see) and, for stateful
environments, the environment, the tool calls that shaped it and, when the sampler will branch and the environment
can be copied, a snapshot of it before every turn (so a branch can restart from any turn with the world as it was
then; without snapshots it is rebuilt by replaying the recorded calls, see `TreeEnvironment`).

A round of the loop is one batched engine call that continues every ready branch by one turn (or one chunk of it),
then the tool calls of the turns that ended, all at once (`tool_executor`). On multi-process runs, `any_active` is a
collective: every rank keeps calling the engine (with nothing, if it has nothing left) until no rank has work, so all
ranks issue the same number of generate calls. The samplers (`samplers.py`) decide which branches to start and where
to restart them; this loop only grows them.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from ..tree import Turn
from .engine import GenerationEngine
from .env_branching import RecordedCall, TreeEnvironment, capture_random_state, environment_tools, fork_environment
from .tools import MAX_OBSERVATION_CHARS, ToolResult, check_tool_execution, error_result, run_tool_call

INVALID_TOOL_NAME = "invalid_tool_call"


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

    @property
    def completion_len(self) -> int:
        return len(self.prefix_ids) - self.prompt_len

    @property
    def completion_ids(self) -> list[int]:
        """Everything after the prompt (tool observations included): what TRL's reward functions get as
        `completion_ids` (`trl_tree.pipeline.Leaf`)."""
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
    tool_execution: str = "main"  # or "thread" (TreeConfig.tool_execution)
    max_turn_tokens: int | None = None  # cap on one sampled assistant turn (TreeConfig.max_turn_tokens)
    chunk_tokens: int | None = None  # tokens a branch samples per engine call (TreeConfig.generation_chunk_tokens)
    max_tool_calls_per_turn: int | None = 8  # calls run per turn, the rest answered with errors (TreeConfig's field)

    def __post_init__(self):
        check_tool_execution(self.tool_execution)
        check_chunk_tokens(self.chunk_tokens)
        check_max_tool_calls_per_turn(self.max_tool_calls_per_turn)


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


class TurnLoop:
    """Continues branches one turn at a time: generate, parse tool calls, run them, append the observation.

    Args:
        engine: the generation backend.
        parse: `parse(action_ids, prefix_ids) -> assistant message dict` (with `tool_calls` when the action calls
            tools), e.g. TRL's `parse_response` bound to the tokenizer.
        observation_ids: `observation_ids(tool_messages) -> token ids` for the tool responses and the next
            assistant header (TRL's `_get_tool_suffix_ids`).
        any_active: `any_active(local_flag) -> bool` across ranks (identity on one process).
        settings: budgets and tool limits.
        event_loop: where async tools run (GRPOTrainer's `async_loop`); None: a new event loop per call.
    """

    def __init__(
        self,
        engine: GenerationEngine,
        parse: Callable[[list[int], list[int]], dict],
        observation_ids: Callable[[list[dict]], list[int]],
        settings: SamplerSettings,
        any_active: Callable[[bool], bool] = lambda flag: flag,
        event_loop=None,
    ):
        self.engine = engine
        self.parse = parse
        self.observation_ids = observation_ids
        self.settings = settings
        self.any_active = any_active
        self.event_loop = event_loop

    def run_call(self, call: dict, tools: dict[str, Callable]) -> ToolResult:
        """Run one parsed tool call with the loop's limits and execution mode (replay re-runs recorded calls through
        this too, so a replayed call runs exactly as the original did)."""
        s = self.settings
        return run_tool_call(call, tools, s.tool_timeout, s.max_observation_chars, s.tool_execution, self.event_loop)

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
        running, instead of waiting for a call of their own.
        """
        while self.any_active(any(not b.done for b in branches)):
            active = [b for b in branches if not b.done]
            for branch in self.step(active):
                hook = on_finish if branch.done else on_turn
                if hook is not None:
                    branches.extend(hook(branch))

    def step(self, active: list[Branch]) -> list[Branch]:
        """One engine call that continues every active branch; returns those that completed a turn.

        With `settings.chunk_tokens` = c and an engine that resumes a cut turn cheaply (`resumes_turns`), a call
        samples at most c tokens per branch (continuous batching at chunk granularity): a branch whose turn is still
        going after c tokens keeps them as its pending head and goes on in the next call, while the branches that
        ended their turn run their tools and rejoin, and new branches join, at once, instead of every branch of the
        batch waiting for the longest turn. Each token is still drawn from the same distribution, given the same
        history; only the batches (hence a seeded run's random draws) differ.
        """
        budgets = [self._turn_budget(b) for b in active]
        chunk = self.settings.chunk_tokens if getattr(self.engine, "resumes_turns", False) else None
        asked = budgets if chunk is None else [min(budget, chunk) for budget in budgets]
        outputs = self.engine.generate([b.prefix_ids for b in active], asked)
        completed = []
        for branch, out, budget, n in zip(active, outputs, budgets, asked):
            if n < budget and not out.finished and len(out.ids) == n:  # cut by the chunk, not a budget: goes on
                self._extend_pending(branch, out)
            else:
                self._append_turn(branch, out)
                completed.append(branch)
        return completed

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

    def _append_turn(self, branch: Branch, out) -> None:
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
        message = (self.parse(ids, branch.prefix_ids[: branch.turn_starts[-1]]) if ids  # the whole assistant turn
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
            return
        if malformed and s.malformed_tool_calls == "end":  # TRL's loop: no parsed call, so the turn is final
            self._record_tool_results(branch, turn, [_malformed_result()])
            branch.done = True
            return
        states = [] if branch.env is not None else None
        results = self._run_calls(calls, branch.tools, states) if calls else [_malformed_result()]
        if branch.env is not None:  # calls past the cap never ran: replay must not run them either
            ran = zip(calls[: self._calls_run(calls)], results, states)
            branch.env_calls += [RecordedCall(t, call, r.content, r.failed, state) for call, r, state in ran]
        self._record_tool_results(branch, turn, results)
        # the model sees each message cut at max_observation_chars; the conversation keeps the full content
        obs = self.observation_ids([r.observation_message for r in results])
        if branch.completion_len + len(obs) >= s.max_completion_length:
            branch.done = True  # no room for the answer: end here, as TRL drops overlong tool results
            return
        turn.observation_ids = list(obs)
        branch.messages.extend(r.message for r in results)
        branch.prefix_ids = branch.prefix_ids + list(obs)


    def _calls_run(self, calls: list) -> int:
        cap = self.settings.max_tool_calls_per_turn
        return len(calls) if cap is None else min(cap, len(calls))

    def _run_calls(self, calls: list[dict], tools: dict[str, Callable], states: list | None = None) -> list[ToolResult]:
        """Run a turn's first `max_tool_calls_per_turn` calls, in order, and answer the rest with an error each.
        `states`, when given, gets the global random states each call ran with (what replay restores).

        A turn's calls run one after another, each with its own deadline, so without a cap one turn could hold the
        batch for (calls × tool_timeout). Each capped call still gets its tool message, so the conversation stays
        well-formed (every call answered) and the model reads why; it counts as a failed call (metrics, TreeFlex's
        penalty).
        """
        n = self._calls_run(calls)
        results = []
        for call in calls[:n]:
            if states is not None:
                states.append(capture_random_state())
            results.append(self.run_call(call, tools))
        return results + [_capped_result(call, n, len(calls)) for call in calls[n:]]

    def _record_tool_results(self, branch: Branch, turn: Turn, results) -> None:
        """Count the turn's tool calls and failures, and put the process penalty on the turn that made them."""
        failures = sum(r.failed for r in results)
        branch.calls_per_turn[-1] = len(results)
        branch.failures_per_turn[-1] = failures
        turn.penalty = self.settings.failure_penalty * failures


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
