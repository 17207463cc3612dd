"""TreeFlex rollouts: complete searches made of causal blocks, and a small two-role harness (docs/design.md §3 F1–F4).

A TreeFlex rollout is not one growing token sequence. A search may pause, save a checkpoint card, and start a later
segment from that card (or from a summary) instead of from everything said so far. What stays true inside such a
search is the *causal block*: a maximal stretch where the context only grows by appending tokens, so every generated
token has one well-defined generating context. TreeFlex trains each token in the block that generated it and treats
everything copied into a block from elsewhere (the task, restored cards, summaries, another role's instructions, tool
observations) as context.

The rollout format (what a harness returns; plug in your own)
-------------------------------------------------------------
A harness turns tasks into, per task, a list of complete searches (`FlexSearch`, the group members of F1):

    FlexSearch
      blocks:     list[FlexBlock]   the causal blocks of the search, in any order (Reflection's block first here)
      completion: list[dict]        what the reward functions see as this search's completion (conversational
                                    messages; the last message is usually the final answer)
      env:        Any               the search's environment at the end (passed to reward functions as `environments`)

    FlexBlock
      context_ids: list[int]        the block's whole context, rendered with the chat template and ending with the
                                    assistant header: system/role prompt, task, restored card or summary, copied-in
                                    instructions. Context only: never trained in this block (non-empty).
      turns: list[Turn]             what the policy generated in this block, in order. `Turn.action_ids` are trained;
                                    `Turn.observation_ids` (tool responses, copied-in cards, the next assistant
                                    header) are appended context. `Turn.penalty` is the turn's process penalty Q ≤ 0
                                    (the turn loop sets `tool_failure_penalty` × failed or malformed tool calls).
                                    `Turn.truncated`: cut by the token budget (masked when mask_truncated_completions).
      role: str                     which role generated the block (one of the harness's `roles`).
      messages: list[dict]          the block's conversation after its context (logging only).

The token history of a block is `context_ids + a_0 + o_0 + a_1 + o_1 + …`, which is exactly the sequence the policy
saw when it sampled each action (token in, token out: never decode and re-tokenise; build observations with
`FlexKit.append`). The trainer turns each block into a one-trajectory `RolloutTree` whose prompt is the block's
context, so the packed forward and π_old are the same code as for every other tree method, and it scores each search
with TRL's reward functions on `completion`.

A harness is any object with a `roles` tuple and `run(tasks, kit) -> list[list[FlexSearch]]` (one list of complete
searches per task, normally `kit.num_searches` of them). `kit` (`FlexKit`) lends it the policy: `kit.branch(context_ids,
tools, env)` opens a block and `kit.loop.run(branches)` grows such `Branch`es turn by turn with tool calls (batched;
collective across ranks; `FlexBlock.from_branch` converts the result), `kit.generate(prefixes, budgets)`
samples single turns, `kit.render(messages, tools)` renders a context, `kit.append(messages)` gives the token ids that
append messages after an assistant turn and open the next one. On multi-process runs every rank must make the same
number of `kit.loop.run` / `kit.generate` calls: decide loop continuation with `kit.any_active(flag)`.

Example: an agent that restarts from its own notes every block (a summarising agent)::

    class NotesHarness:
        roles = ("agent",)

        def run(self, tasks, kit):
            K = kit.num_searches
            searches = [(task, FlexSearch(blocks=[], completion=[], env=task.env)) for task in tasks for _ in range(K)]
            contexts = [task.prompt_ids for task, _ in searches]
            for _ in range(kit.max_blocks):  # the same number of rounds on every rank
                branches = [kit.branch(c, task.tools, s.env) for c, (task, s) in zip(contexts, searches)]
                kit.loop.run(branches)  # one causal block per search; tool calls batched
                for i, (branch, (task, search)) in enumerate(zip(branches, searches)):
                    search.blocks.append(FlexBlock.from_branch(branch, role="agent"))
                    search.completion += branch.messages
                    notes = branch.messages[-1]["content"]  # trained here, in the block that wrote it
                    restart = task.prompt + [{"role": "user", "content": f"Your notes so far: {notes}"}]
                    contexts[i] = kit.render(restart, list(task.tools.values()))  # context only from now on
            return [[s for _, s in searches[i * K : (i + 1) * K]] for i in range(len(tasks))]

(A stateful environment: each further search takes `task.environment.start()`, a fresh instance reset with the
task's row.) A summary that the policy writes in a separate call belongs to a block too: append it as a `Turn` of the
block that generated it, never only as text in the next context, or it is not trained anywhere.

The two-role harness (`TwoRoleHarness`)
---------------------------------------
Two roles, one policy: a role is a system-prompt variant. Per search:

- **Reflection** is one block for the whole search. Its context is its role prompt and the task; each Reflection turn
  writes an instruction for the next Execution segment, optionally `<resume>k</resume>` to continue from saved node k
  (default: the latest node), or the final answer `<answer>…</answer>`. After each segment the segment's checkpoint
  card is appended to Reflection's context as a user message (context, not trained here).
- **Execution** segments are blocks of their own. A segment's context is its role prompt (with the tools), the task,
  the *restored checkpoint card* of the selected node and the instruction — not the previous segment's history. It
  calls tools turn by turn (malformed or rejected calls: Q = `tool_failure_penalty`) and ends with a checkpoint card:
  its last assistant message, saved as a new node (with the segment's stateful environment and the tool calls that
  made it, so a later resume sees the world as it was at that node: a copy of it, or by replay, see `TreeEnvironment`).

Instructions are trained in Reflection, where they were written; cards in the Execution segment that wrote them;
neither again where they are read. A resume of a node that does not exist is a rejected call (Q = the failure
penalty) and falls back to the latest node. With `max_blocks` blocks per search there are at most `max_blocks − 1`
segments; after the last one Reflection is told to answer, and its next turn ends the search.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from typing import Any, Protocol

from ...core.tree import Turn
from ...text import ANSWER_SPAN
from ..acting.env_branching import RecordedCall, TreeEnvironment, fork_environment
from .turn_loop import Branch, TurnLoop, _bind_tools

REFLECTION, EXECUTION = "reflection", "execution"

REFLECTION_PROMPT = (
    "You are the Reflection role of a search agent. You plan; an Execution role with tools carries out one "
    "instruction at a time and reports back with a checkpoint card (a saved node). Reply with one instruction for the "
    "next Execution segment. To continue from an earlier saved node k instead of the latest one, start your reply "
    "with <resume>k</resume>. When you know the answer, reply with <answer>your answer</answer>."
)
EXECUTION_PROMPT = (
    "You are the Execution role of a search agent. Follow the instruction, using the tools when they help. Finish "
    "with a checkpoint card: a short summary of what you found, including the answer if you have it."
)
RESUME_PATTERN = re.compile(r"<resume>\s*(-?\d+)\s*</resume>")
LAST_SEGMENT_NOTE = "No Execution segments remain: reply with the final answer as <answer>...</answer>."


# ---------------------------------------------------------------------------------------------------------------
# The rollout format
# ---------------------------------------------------------------------------------------------------------------


@dataclass
class FlexBlock:
    """One causal block: a context (never trained here) and the turns the policy generated after it (see module)."""

    context_ids: list[int]
    turns: list[Turn] = field(default_factory=list)
    role: str = EXECUTION
    messages: list[dict] = field(default_factory=list)

    @classmethod
    def from_branch(cls, branch: Branch, role: str) -> FlexBlock:
        """A block from a `Branch` grown by `TurnLoop`: its prompt is the context, its turns the generated turns."""
        return cls(list(branch.prefix_ids[: branch.prompt_len]), list(branch.turns), role, list(branch.messages))

    @property
    def token_ids(self) -> list[int]:
        """The block's whole causal sequence: context, then each turn's action and observation."""
        ids = list(self.context_ids)
        for turn in self.turns:
            ids += turn.action_ids + turn.observation_ids
        return ids


@dataclass
class FlexSearch:
    """One complete search for a task: one member of the group-relative comparison (F1)."""

    blocks: list[FlexBlock]
    completion: list[dict]
    env: Any = None
    tool_calls: int = 0
    tool_failures: int = 0
    info: dict = field(default_factory=dict)

    # a search is a leaf of its task's group (`trl_tree.core.pipeline.Leaf`): what the reward functions see of it
    @property
    def messages(self) -> list[dict]:
        return self.completion

    @property
    def completion_ids(self) -> list[int]:
        """The tokens the policy generated, block after block (contexts and observations left out)."""
        return [tok for block in self.blocks for turn in block.turns for tok in turn.action_ids]


@dataclass
class FlexTask:
    """What a harness gets per task: the dataset prompt (messages), the prompt rendered with the tools (a ready-made
    single-role context), the task's (already reset) environment, the tools by name (bound to that env), and the
    task's `TreeEnvironment` (more instances reset with the task's row; copies or replays of an environment)."""

    prompt: list[dict]
    prompt_ids: list[int]
    env: Any = None
    tools: dict[str, Callable] = field(default_factory=dict)
    environment: TreeEnvironment | None = None


@dataclass
class FlexKit:
    """The trainer's policy and chat template, lent to a harness for one generation batch.

    Attributes:
        loop: grows `Branch`es turn by turn with tool calls (`loop.run(branches)`, batched, collective across ranks).
        render: `render(messages, tools) -> ids`: a context rendered with the chat template and the assistant header
            (`tools`: the callables whose schemas the template shows, or None).
        append: `append(messages) -> ids`: the tokens that append `messages` (user or tool) after an assistant turn
            and open the next assistant turn.
        decode: token ids to text (special tokens skipped).
        num_searches: K, complete searches per task (the group size).
        max_blocks: causal blocks per search at most.
    """

    loop: TurnLoop
    render: Callable[[list[dict], Sequence[Callable] | None], list[int]]
    append: Callable[[list[dict]], list[int]]
    decode: Callable[[list[int]], str]
    num_searches: int
    max_blocks: int

    @property
    def settings(self):
        return self.loop.settings

    @property
    def max_completion_length(self) -> int:
        """Token budget of one block after its context (generated plus appended tokens)."""
        return self.loop.settings.max_completion_length

    def any_active(self, flag: bool) -> bool:
        """Whether any rank still has work (a collective on multi-process runs: call it on every rank)."""
        return self.loop.ports.any_active(flag)

    def generate(self, prefixes: list[list[int]], budgets: list[int]):
        """One batched engine call (one `Continuation` per prefix). Every rank must call it equally often."""
        return self.loop.ports.engine.generate(prefixes, budgets)

    def branch(self, context_ids: list[int], tools: dict[str, Callable], env=None) -> Branch:
        """A new `Branch` (a block to grow with `loop.run`) whose context is `context_ids`."""
        return Branch(tree=0, prefix_ids=list(context_ids), prompt_len=len(context_ids), env=env,
                      tools=_bind_tools(tools, env))


class FlexHarness(Protocol):
    roles: tuple[str, ...]

    def run(self, tasks: list[FlexTask], kit: FlexKit) -> list[list[FlexSearch]]: ...


# ---------------------------------------------------------------------------------------------------------------
# The two-role harness
# ---------------------------------------------------------------------------------------------------------------


@dataclass
class _Node:
    """A saved node: the checkpoint card to restore, the environment as it was when the card was written, and every
    tool call that made that state since the task's reset (to rebuild it by replay)."""

    card: str | None
    env: Any
    calls: list[RecordedCall] = field(default_factory=list)


@dataclass
class _TwoRoleSearch:
    task: int
    reflection: Branch
    nodes: list[_Node]
    segments: list[Branch] = field(default_factory=list)
    completion: list[dict] = field(default_factory=list)
    resumed_from: list[int] = field(default_factory=list)
    env: Any = None
    done: bool = False


def _another_start(task: FlexTask):
    """An environment for a further search of the task: a fresh instance reset with the task's row (no copy)."""
    return task.environment.start() if task.environment is not None else fork_environment(task.env)


def with_role_prompt(prompt: list[dict], role_prompt: str) -> list[dict]:
    """The task's messages under a role's system prompt (a dataset system message is kept after the role prompt)."""
    if prompt and prompt[0].get("role") == "system":
        return [{"role": "system", "content": f"{role_prompt}\n\n{prompt[0]['content']}"}, *prompt[1:]]
    return [{"role": "system", "content": role_prompt}, *prompt]


def _with_last_user_text(messages: list[dict], extra: str) -> list[dict]:
    """Append `extra` to the last user message (or add a user message if there is none)."""
    for i in range(len(messages) - 1, -1, -1):
        if messages[i].get("role") == "user" and isinstance(messages[i].get("content"), str):
            last = messages[i]
            return [*messages[:i], {**last, "content": f"{last['content']}\n\n{extra}"}, *messages[i + 1 :]]
    return [*messages, {"role": "user", "content": extra}]


def _final_text(branch: Branch) -> str:
    """An Execution segment's checkpoint card: the content of its last assistant message."""
    for message in reversed(branch.messages):
        if message.get("role") == "assistant":
            return (message.get("content") or "").strip()
    return ""


class TwoRoleHarness:
    """Reflection plans and resumes saved nodes; Execution segments run tools from a restored node and end with a
    checkpoint card (see the module docstring). Both roles are played by the same policy.

    Args:
        reflection_prompt, execution_prompt: the roles' system prompts.
        max_card_chars: a card copied into another context is cut at this many characters (None: no cut).
    """

    roles = (REFLECTION, EXECUTION)

    def __init__(self, reflection_prompt: str = REFLECTION_PROMPT, execution_prompt: str = EXECUTION_PROMPT,
                 max_card_chars: int | None = 2000):
        self.reflection_prompt = reflection_prompt
        self.execution_prompt = execution_prompt
        self.max_card_chars = max_card_chars

    def run(self, tasks: list[FlexTask], kit: FlexKit) -> list[list[FlexSearch]]:
        for task in tasks:
            if not isinstance(task.prompt, list):
                raise ValueError("TwoRoleHarness needs conversational prompts (a list of messages per example).")
        searches = []
        for i, task in enumerate(tasks):
            context = kit.render(with_role_prompt(task.prompt, self.reflection_prompt), None)
            for k in range(kit.num_searches):
                env = task.env if k == 0 or task.env is None else _another_start(task)
                reflection = kit.branch(context, {}, None)
                searches.append(_TwoRoleSearch(i, reflection, nodes=[_Node(None, env)], env=env))
        while kit.any_active(any(not s.done for s in searches)):
            active = [s for s in searches if not s.done]
            outputs = kit.generate([s.reflection.prefix_ids for s in active],
                                   [kit.max_completion_length - s.reflection.completion_len for s in active])
            segments = []
            for search, out in zip(active, outputs):
                segment = self._reflect(search, out, tasks[search.task], kit)
                if segment is not None:
                    segments.append((search, segment))
            kit.loop.run([segment for _, segment in segments])  # every rank calls it once per round
            for search, segment in segments:
                self._checkpoint(search, segment, kit)
        return [[self._result(s) for s in searches if s.task == i] for i in range(len(tasks))]

    def _reflect(self, search: _TwoRoleSearch, out, task: FlexTask, kit: FlexKit) -> Branch | None:
        """Append Reflection's turn; return the Execution segment it launches (None when the search ends)."""
        text = kit.decode(out.ids)
        turn = Turn(out.ids, out.logps, [], entropies=out.entropies, truncated=not out.finished)
        branch = search.reflection
        branch.turns.append(turn)
        branch.messages.append({"role": "assistant", "content": text})
        branch.prefix_ids = branch.prefix_ids + list(out.ids)
        search.completion.append({"role": "assistant", "content": text})
        no_segments_left = 1 + len(search.segments) >= kit.max_blocks
        if not out.finished or ANSWER_SPAN.search(text) or no_segments_left:
            search.done = True
            return None
        node = len(search.nodes) - 1
        resume = RESUME_PATTERN.search(text)
        if resume is not None:
            wanted = int(resume.group(1))
            if 0 <= wanted < len(search.nodes):
                node = wanted
            else:  # a rejected call: Q = the tool-failure penalty, continue from the latest node
                turn.penalty = kit.settings.failure_penalty
        instruction = RESUME_PATTERN.sub("", text).strip()
        search.resumed_from.append(node)
        restored = search.nodes[node]
        context = with_role_prompt(task.prompt, self.execution_prompt)
        if restored.card is not None:
            context = _with_last_user_text(context, f"Restored checkpoint (node {node}):\n{restored.card}")
        context = _with_last_user_text(context, f"Instruction:\n{instruction}")
        env = None
        if restored.env is not None:
            env = (task.environment.at(restored.env, restored.calls) if task.environment is not None
                   else fork_environment(restored.env))
        tools = list(task.tools.values()) or None
        return kit.branch(kit.render(context, tools), task.tools, env)

    def _checkpoint(self, search: _TwoRoleSearch, segment: Branch, kit: FlexKit) -> None:
        """Save the segment's card as a new node and copy it into Reflection's context."""
        search.segments.append(segment)
        search.completion.extend(segment.messages)
        search.env = segment.env if segment.env is not None else search.env
        card = _final_text(segment) or "(no card)"
        if self.max_card_chars is not None and len(card) > self.max_card_chars:
            card = card[: self.max_card_chars] + " …"
        before = search.nodes[search.resumed_from[-1]].calls
        search.nodes.append(_Node(card, segment.env, before + [replace(c, turn=-1) for c in segment.env_calls]))
        message = f"Checkpoint card (node {len(search.nodes) - 1}):\n{card}"
        if 1 + len(search.segments) >= kit.max_blocks:
            message += f"\n\n{LAST_SEGMENT_NOTE}"
        obs = kit.append([{"role": "user", "content": message}])
        branch = search.reflection
        if branch.completion_len + len(obs) >= kit.max_completion_length:
            search.done = True  # no room for another Reflection turn: the search ends with this card
            return
        branch.turns[-1].observation_ids = list(obs)
        branch.messages.append({"role": "user", "content": message})
        branch.prefix_ids = branch.prefix_ids + list(obs)

    def _result(self, search: _TwoRoleSearch) -> FlexSearch:
        blocks = [FlexBlock.from_branch(search.reflection, REFLECTION)]
        blocks += [FlexBlock.from_branch(segment, EXECUTION) for segment in search.segments]
        return FlexSearch(
            blocks=blocks,
            completion=search.completion,
            env=search.env,
            tool_calls=sum(s.tool_calls for s in search.segments),
            tool_failures=sum(s.tool_failures for s in search.segments),
            info={"resumed_from": search.resumed_from, "cards": [n.card for n in search.nodes[1:]]},
        )
