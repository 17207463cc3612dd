"""The page data: one prompt's rollout tree (`tree_record`) or TreeFlex group (`flex_record`) with its credit, as
plain JSON (texts already decoded and cut, numbers as floats), and a page of them (`page_data`). Pure Python: what
the page derives from it (spread, outcomes, directions) is in `facts.py`, computed when a page is rendered."""

from __future__ import annotations

import re
from collections.abc import Callable, Sequence
from typing import Any

from ..core.batch import TurnCredit
from .text import clean_text, cut_text, gold_answer, number, prompt_text, question_text

FORMAT = "trl-tree/tree-view"
VERSION = 1  # the fields added since (question, gold, tool calls, special tokens) are optional: v1 readers skip them
VIEW_DIR = "tree_view"  # under output_dir
INDEX = "index"  # tree_view/index.html (the run's steps) and index.json (their summaries, so a log reads no page)
PAGE_NAME = re.compile(r"(?:eval_)?step_\d{1,12}")  # what the trainer names its pages; the index links no other

MAX_ACTION_CHARS = 4000  # per node, in the saved data
MAX_OBSERVATION_CHARS = 1000  # "the start of its observation"
MAX_PROMPT_CHARS = 4000
MAX_QUESTION_CHARS = 1000
MAX_GOLD_CHARS = 500
MAX_CONTEXT_CHARS = 1500  # TreeFlex: the end of a block's context
MAX_NODES = 2000  # per page
MAX_CHARS = 1_500_000  # text characters per page
SHOWN_CHARS = 280  # a longer text is folded behind its first SHOWN_CHARS characters

BACKUP_CREDITS = ("likelihood", "child_mean", "child_softmax", "leaf_mean")  # A of a turn is its backed-up value V
SHOWN_CREDIT = ("A", "q")  # per-turn credit keys the page shows (others are loss internals: weights, path ranges)


def _row_fields(prompt, row: dict | None) -> dict:
    """The record's question and gold answer (texts cut as the data keeps them)."""
    fields = {"question": cut_text(question_text(prompt, row), MAX_QUESTION_CHARS)}
    gold = gold_answer(row)
    if gold is not None:
        fields["gold_column"], fields["gold"] = cut_text(gold[0], 100), cut_text(gold[1], MAX_GOLD_CHARS)
    return fields


def tree_record(
    tree,
    credit: TurnCredit | dict[str, Any],
    decode: Callable[[list[int]], str],
    prompt,
    *,
    leaf_rounds: Sequence[int] | None = None,
    reward_columns: dict[str, Sequence[float | None]] | None = None,
    leaf_advantages: Sequence[float] | None = None,
    with_entropy: bool = False,
    row: dict | None = None,
    turn_tools: Sequence[tuple[Sequence[int], Sequence[int]]] | None = None,
    abandoned: Sequence[bool] | None = None,
    policy_version: int | None = None,
    staleness: int | None = None,
) -> dict:
    """One prompt's rollout tree as page data.

    Args:
        tree: the `RolloutTree` the trainer trained (its `turns` order is the order of the credit tensors).
        credit: the tree's per-turn credit as the trainer computed it (`TreeTrainer.turn_credit`, a `TurnCredit` of
            its loss's kind): `A` for every method, `q` (and the per-tree `tau`) for TreeOPSD's `TeacherCredit`; or a
            dict of such fields, 1-D tensors or lists over `tree.turns`, 0-dim per tree.
        decode: token ids → text (the tokenizer's decode, special tokens kept).
        prompt: the dataset prompt (text or chat messages).
        leaf_rounds: per trajectory k, the sampling round that created it (0: the initial trajectories; AT2PO's
            expansion rounds 1..L; a continuation from an anchor or a token-level branch point: ≥ 1). A node's
            round is the earliest round of the trajectories through it.
        reward_columns: per reward function, its value for each trajectory k (None: it did not apply).
        leaf_advantages: A_k, each trajectory's standardised reward (what the credit backs up).
        with_entropy: show each turn's mean token entropy (when the sampler or the credit used entropies).
        row: the dataset row of the prompt: its question and gold answer columns are shown (`question_text`,
            `gold_answer`).
        turn_tools: per trajectory k, (tool calls, failed or malformed calls) of each turn on its path
            (`Branch.calls_per_turn`, `failures_per_turn`); a path of another length is skipped.
        abandoned: per trajectory k, whether it ended because a call on its environment timed out while it may still
            run there (`Branch.abandoned_at`): its leaf counts such trajectories (`abandoned`), the page marks it.
        policy_version: the version of the policy that sampled the tree (docs/design.md §9: version b = the weights
            after b generation batches; the rollout worker's version, or the trainer's own when it samples itself).
        staleness: the policy versions between that and the batch's π_old (0: sampled by π_old itself).
    """
    per_turn, per_tree = _split_credit(credit, tree.num_turns)
    rounds = [None] * tree.num_turns
    if leaf_rounds is not None:
        for k, path in enumerate(tree.paths):
            for i in path:
                rounds[i] = leaf_rounds[k] if rounds[i] is None else min(rounds[i], leaf_rounds[k])
    calls, failures = [None] * tree.num_turns, [None] * tree.num_turns
    for k, (made, failed) in enumerate(turn_tools or []):
        if len(made) == len(failed) == len(tree.paths[k]):  # one entry per turn of the path (a shared turn: equal)
            for t, i in enumerate(tree.paths[k]):
                calls[i], failures[i] = int(made[t]), int(failed[t])
    ending = [[] for _ in tree.turns]
    for k, leaf in enumerate(tree.leaf_of):
        ending[leaf].append(k)
    if abandoned is not None and len(abandoned) != len(tree.paths):
        raise ValueError(f"tree_view: abandoned has {len(abandoned)} entries for the tree's {len(tree.paths)} "
                         "trajectories; pass one per trajectory, in the tree's order (its branches' `abandoned_at`).")
    ended_abandoned = [sum(bool(abandoned[k]) for k in ks) if abandoned is not None else 0 for ks in ending]
    offsets = [0] * tree.num_turns  # where a segment starts inside its assistant turn (TreeAdv's split turns)
    nodes = []
    for i, turn in enumerate(tree.turns):
        parent = turn.parent
        if parent >= 0 and tree.turns[parent].partial:
            offsets[i] = offsets[parent] + len(tree.turns[parent].action_ids)
        node = {
            "id": i,
            "parent": parent,
            "kind": "turn",
            "action": cut_text(decode(turn.action_ids), MAX_ACTION_CHARS),
            "observation": cut_text(decode(turn.observation_ids), MAX_OBSERVATION_CHARS),
            "tokens": len(turn.action_ids),
            "observation_tokens": len(turn.observation_ids),
            "multiplicity": turn.multiplicity,
            "leaf": turn.is_leaf,
            "partial": turn.partial,
            "turn_offset": offsets[i],
            "truncated": turn.truncated,
            "penalty": number(turn.penalty),
            "round": rounds[i],
            "entropy": _mean(turn.entropies) if with_entropy else None,
            "credit": {key: number(values[i]) for key, values in per_turn.items()},
            "trajectories": ending[i],
            "rewards": [number(tree.rewards[k]) for k in ending[i]],
        }
        if calls[i] is not None:
            node["tool_calls"], node["tool_failures"] = calls[i], failures[i]
        if ended_abandoned[i]:  # the branch's last turn: its environment's call timed out (docs/design.md §5)
            node["abandoned"] = ended_abandoned[i]
        if leaf_advantages is not None:
            node["leaf_advantages"] = [number(leaf_advantages[k]) for k in ending[i]]
        if reward_columns:
            node["reward_columns"] = {name: [number(col[k]) for k in ending[i]] for name, col in reward_columns.items()}
        nodes.append(node)
    return {
        "kind": "tree",
        "prompt": cut_text(prompt_text(prompt), MAX_PROMPT_CHARS),
        **_row_fields(prompt, row),
        "prompt_tokens": len(tree.prompt_ids),
        "num_leaves": tree.num_leaves,
        "num_turns": tree.num_turns,
        "rewards": [number(r) for r in tree.rewards],
        "paths": [list(p) for p in tree.paths],
        "per_tree": per_tree,
        "nodes": nodes,
        **_policy_fields(policy_version, staleness),
    }


def _policy_fields(policy_version: int | None, staleness: int | None) -> dict:
    """The record's policy version and staleness, where known (files saved before them have neither)."""
    fields = {}
    if policy_version is not None:
        fields["policy_version"] = int(policy_version)
    if staleness is not None:
        fields["staleness"] = int(staleness)
    return fields


def flex_record(group, credit: TurnCredit | dict[str, Any], decode: Callable[[list[int]], str], prompt,
                search_advantages: Sequence[float] | None = None, *, row: dict | None = None,
                policy_version: int | None = None, staleness: int | None = None) -> dict:
    """One TreeFlex task as page data: its K complete searches, each a node whose children are its causal blocks
    (role, the end of the block's context), each block the chain of turns it generated with their credit.

    `credit` is the group's per-turn credit (`TreeFlexTrainer.turn_credit`, a `FlexCredit`: `A`, `penalty`, … in the
    group-wide turn order); turn nodes keep that index as their `id`, search and block nodes get ids after the turns.
    `search_advantages`: each search's group-normalised score (F1), shown on its node. `row`: the dataset row (its
    question and gold answer). `policy_version`, `staleness`: as for `tree_record`."""
    per_turn, per_tree = _split_credit(credit, group.num_turns)
    nodes, next_id, turn = [], group.num_turns, 0
    trees = iter(group.trees)
    for s, search in enumerate(group.searches):
        search_id, next_id = next_id, next_id + 1
        score = number(group.scores[s])
        nodes.append({
            "id": search_id, "parent": -1, "kind": "search", "label": f"search {s}", "leaf": True,
            "multiplicity": 1, "rewards": [score], "trajectories": [s], "credit": {},
            "action": "", "observation": "", "tokens": 0,
            "leaf_advantages": [] if search_advantages is None else [number(search_advantages[s])],
        })
        for b, block in enumerate(search.blocks):
            if not block.turns:
                continue
            tree = next(trees)
            block_id, next_id = next_id, next_id + 1
            nodes.append({
                "id": block_id, "parent": search_id, "kind": "block", "label": f"block {b} · {block.role}",
                "context": cut_text(_tail(decode(block.context_ids), MAX_CONTEXT_CHARS), MAX_CONTEXT_CHARS + 2),
                "context_tokens": len(block.context_ids), "credit": {}, "action": "", "observation": "",
                "tokens": 0, "multiplicity": 0, "leaf": False, "rewards": [], "trajectories": [],
            })
            parent = block_id
            for t in tree.turns:
                nodes.append({
                    "id": turn, "parent": parent, "kind": "turn",
                    "action": cut_text(decode(t.action_ids), MAX_ACTION_CHARS),
                    "observation": cut_text(decode(t.observation_ids), MAX_OBSERVATION_CHARS),
                    "tokens": len(t.action_ids), "observation_tokens": len(t.observation_ids), "multiplicity": 0,
                    "leaf": False, "partial": False, "turn_offset": 0, "truncated": t.truncated,
                    "penalty": number(per_turn.get("penalty", [t.penalty] * group.num_turns)[turn]),
                    "round": None, "entropy": None,
                    "credit": {k: number(v[turn]) for k, v in per_turn.items()},
                    "trajectories": [], "rewards": [],
                })
                parent, turn = turn, turn + 1
    return {
        "kind": "flex",
        "prompt": cut_text(prompt_text(prompt), MAX_PROMPT_CHARS),
        **_row_fields(prompt, row),
        "num_leaves": len(group.searches),
        "num_turns": group.num_turns,
        "rewards": [number(r) for r in group.scores.tolist()],
        "per_tree": per_tree,
        "nodes": _dfs(nodes),
        **_policy_fields(policy_version, staleness),
    }


def page_data(records: list[dict], *, step: int, method: str, mode: str = "train", credit: str = "",
              after_note: str = "", special_tokens: Sequence[str] = (), batch: int | None = None,
              credit_summary: str = "", penalties: bool | None = None) -> dict:
    """The data of one page: the prompts' records of one generation batch and what the page says about them.
    `special_tokens`: the tokenizer's special tokens (`<|im_start|>`, `<|im_end|>`, …), which the page hides in the
    texts it shows (the data keeps them; a switch on the page shows them). `batch`: which generation batch of the
    run it is (1, 2, …; None: not known). `batches` = 1 says the page stands for one generation batch: files saved
    before pages followed batches lack it (they were written at logging steps, the last batch before each log).
    `credit_summary`: what the credit `credit` does, in its registered entry's words (the page's hover text for it);
    `penalties`: whether that credit adds the turns' process penalties Q (`methods.Credit.applies_penalties`): the
    page shows a turn's Q only then (None, as in older files: only on TreeFlex's groups)."""
    data = {
        "format": FORMAT, "version": VERSION, "step": int(step), "method": method, "mode": mode,
        "credit": credit, "after_note": after_note,
        "special_tokens": sorted({clean_text(t)[:60] for t in special_tokens if t and str(t).strip()})[:200],
        "batches": 1, "prompts": records,
    }
    if batch is not None:
        data["batch"] = int(batch)
    if credit_summary:
        data["credit_summary"] = str(credit_summary)
    if penalties is not None:
        data["penalties"] = bool(penalties)
    return data


def attach_turn_probabilities(record: dict, logp_old: Sequence[float | None], logp_new: Sequence[float | None] | None,
                              p_after: Sequence[float | None] | None) -> None:
    """Add, per turn node (indexed by its `id`), the mean log-probability of its action's tokens under π_old and
    under the updated policy (`logp_old`, `logp_new`), and p = σ(s) after the update (TreeOPSD's turn probability,
    s = `logp_new − logp_old`; p = 1/2 under π_old). None: the turn was not trained (masked)."""
    for node in record["nodes"]:
        if node["kind"] != "turn":
            continue
        i = node["id"]
        node["credit"]["logp_old"] = number(logp_old[i])
        if logp_new is not None:
            node["credit"]["logp_new"] = number(logp_new[i])
        if p_after is not None:
            node["credit"]["p_after"] = number(p_after[i])


def _split_credit(credit: TurnCredit | dict[str, Any], num_turns: int) -> tuple[dict[str, list], dict[str, float]]:
    fields = credit.present() if isinstance(credit, TurnCredit) else credit
    per_turn, per_tree = {}, {}
    for key, value in fields.items():
        values = value.tolist() if hasattr(value, "tolist") else value
        if isinstance(values, list):
            if len(values) != num_turns:
                raise ValueError(
                    f"tree_view: credit {key!r} has {len(values)} values for {num_turns} turns; pass the trainer's "
                    "per-turn credit of this very tree (over its turns, in order)."
                )
            if key in SHOWN_CREDIT:
                per_turn[key] = values
        else:
            per_tree[key] = number(values)
    return per_turn, per_tree


def _mean(values) -> float | None:
    return number(sum(values) / len(values)) if values else None


def _tail(text: str, limit: int) -> str:
    return text if len(text) <= limit else "… " + text[-limit:]


def _dfs(nodes: list[dict]) -> list[dict]:
    """Nodes in depth-first order (children in the order given), the order the page draws and cuts them in."""
    children: dict[int, list[dict]] = {}
    for node in nodes:
        children.setdefault(node["parent"], []).append(node)
    out, stack = [], list(reversed(children.get(-1, [])))
    while stack:
        node = stack.pop()
        out.append(node)
        stack.extend(reversed(children.get(node["id"], [])))
    return out
