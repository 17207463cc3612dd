"""The rollout-tree view: one self-contained HTML page per logged generation batch, and the data it is made from.

A tree trainer's behaviour is hard to read from scalars: which turn got credit, where the branches went, which
histories were merged, how far each turn's probability moved toward its teacher. The view draws each prompt's tree
with one node per unique turn (its action, the start of its observation, ×multiplicity, its credit), the leaves with
their rewards and the branch points; several prompts of the batch are selectable on one page.

Two layers, so that a page can be rendered again from what a run saved (`trl-tree view RUN_DIR`):

- the **page data**, plain JSON (`tree_record`, `flex_record`, `page_data`): texts already decoded and cut, numbers as
  floats. The trainer writes it to `output_dir/tree_view/step_XXXXXX.json` (`trl_tree.trainer.tree_view_logging`);
- the **page** (`render_page`): pure string building from that data, no network, no external scripts or fonts; inline
  CSS, `<details>` for long texts and a few lines of inline JavaScript to switch prompts and fold subtrees (without
  JavaScript every prompt is shown, unfolded).

Every text that comes from the model, a tool or the dataset is untrusted: `clean_text` replaces control, surrogate,
bidirectional, zero-width and tag characters with visible escapes and `html.escape` escapes it, so a model that
writes `<script>` shows the tag instead of running it. A saved data file is untrusted too (`trl-tree view` renders
whatever is in it): `render_page` first turns every number of the data into an int or float and every text into a
string (`_checked_page`), and refuses a file whose numbers are not numbers. The page's own script reads nothing from
the data and builds no HTML. Huge trees are cut
(`max_nodes`, `max_chars`) with a visible note, so a page always opens; the JSON keeps every node.
"""

from __future__ import annotations

import html
import json
import math
import re
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from .batch import TurnCredit

FORMAT = "trl-tree/tree-view"
VERSION = 1
VIEW_DIR = "tree_view"  # under output_dir

MAX_ACTION_CHARS = 4000  # per node, in the saved data
MAX_OBSERVATION_CHARS = 1000  # "the start of its observation"
MAX_PROMPT_CHARS = 4000
MAX_CONTEXT_CHARS = 1500  # TreeFlex: the end of a block's context
MAX_NODES = 2000  # per page
MAX_CHARS = 1_500_000  # text characters per page
SHOWN_CHARS = 280  # a longer text is folded behind its first SHOWN_CHARS characters

BACKUP_CREDITS = ("likelihood", "child_mean", "child_softmax", "leaf_mean")  # A of a turn is its backed-up value V
SHOWN_CREDIT = ("A", "q")  # per-turn credit keys the page shows (others are loss internals: weights, path ranges)

# ------------------------------------------------------------------------------------------------------ texts

_BIDI = {0x202A, 0x202B, 0x202C, 0x202D, 0x202E, 0x2066, 0x2067, 0x2068, 0x2069, 0x200E, 0x200F, 0x061C}
# zero-width characters (space, non-joiner, joiner, word joiner, BOM): they hide text inside text, e.g. the U+200B
# that `observation_special_tokens="neutralize"` puts into a special-token string of a tool output
_ZERO_WIDTH = {0x200B, 0x200C, 0x200D, 0x2060, 0xFEFF}
_TAGS = range(0xE0000, 0xE0080)  # Unicode tag characters: invisible, and able to carry a whole hidden ASCII text


def _visible(ch: str) -> str:
    code = ord(ch)
    if ch in "\n\t":
        return ch
    if code < 0x20 or 0x7F <= code <= 0x9F or code in _BIDI or code in _ZERO_WIDTH or code in _TAGS:
        return f"\\x{code:02x}" if code <= 0xFF else f"\\u{code:04x}" if code <= 0xFFFF else f"\\U{code:08x}"
    if 0xD800 <= code <= 0xDFFF:  # a lone surrogate cannot be written as UTF-8
        return "\ufffd"
    return ch


_SUSPECT = re.compile(
    "[\x00-\x08\x0b-\x1f\x7f-\x9f\u061c\u200b-\u200f\u2060\u202a-\u202e\u2066-\u2069\ufeff\ud800-\udfff"
    "\U000e0000-\U000e007f]"
)


def clean_text(text: str) -> str:
    """`text` with control characters (but newline and tab), lone surrogates, bidirectional controls (the Arabic
    letter mark included), zero-width characters and Unicode tag characters made visible (`\\x1b`, `\\u202e`,
    `\\u200b`, `\\U000e0041`, U+FFFD): they could hide or reorder what the page shows, or fail to encode."""
    text = str(text)
    return text if not _SUSPECT.search(text) else "".join(_visible(c) for c in text)


def cut_text(text: str, limit: int) -> str:
    """`text` cut to `limit` characters with a note saying how many were left out."""
    text = clean_text(text)
    if len(text) <= limit:
        return text
    return text[:limit] + f" … [{len(text) - limit} more characters not saved]"


def prompt_text(prompt) -> str:
    """A dataset prompt as text: a string as it is, chat messages as `role: content` lines."""
    if isinstance(prompt, str):
        return prompt
    if isinstance(prompt, Sequence):
        lines = []
        for message in prompt:
            if isinstance(message, dict):
                content = message.get("content")
                if isinstance(content, list):  # content parts
                    content = " ".join(str(p.get("text", "")) if isinstance(p, dict) else str(p) for p in content)
                lines.append(f"{message.get('role', '?')}: {content if content is not None else ''}")
            else:
                lines.append(str(message))
        return "\n".join(lines)
    return str(prompt)


def _number(value) -> float | None:
    if value is None:
        return None
    value = float(value)
    return value if math.isfinite(value) else None


# ------------------------------------------------------------------------------------------------------ page data


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
) -> dict:
    """One prompt's rollout tree as page data.

    Args:
        tree: the `RolloutTree` the trainer trained (its `turns` order is the order of the credit tensors).
        credit: the tree's per-turn credit as the trainer computed it (`TreeTrainer.turn_credit`, a `TurnCredit`):
            `A` for every method, `q` (and the per-tree `tau`) for TreeOPSD; or a dict of such fields, 1-D tensors or
            lists over `tree.turns`, 0-dim per tree.
        decode: token ids → text (the tokenizer's decode, special tokens kept).
        prompt: the dataset prompt (text or chat messages).
        leaf_rounds: per trajectory k, the sampling round that created it (0: the initial trajectories; AT2PO's
            expansion rounds 1..L; a continuation from an anchor or a token-level branch point: ≥ 1). A node's
            round is the earliest round of the trajectories through it.
        reward_columns: per reward function, its value for each trajectory k (None: it did not apply).
        leaf_advantages: A_k, each trajectory's standardised reward (what the credit backs up).
        with_entropy: show each turn's mean token entropy (when the sampler or the credit used entropies).
    """
    per_turn, per_tree = _split_credit(credit, tree.num_turns)
    rounds = [None] * tree.num_turns
    if leaf_rounds is not None:
        for k, path in enumerate(tree.paths):
            for i in path:
                rounds[i] = leaf_rounds[k] if rounds[i] is None else min(rounds[i], leaf_rounds[k])
    ending = [[] for _ in tree.turns]
    for k, leaf in enumerate(tree.leaf_of):
        ending[leaf].append(k)
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
            "penalty": _number(turn.penalty),
            "round": rounds[i],
            "entropy": _mean(turn.entropies) if with_entropy else None,
            "credit": {key: _number(values[i]) for key, values in per_turn.items()},
            "trajectories": ending[i],
            "rewards": [_number(tree.rewards[k]) for k in ending[i]],
        }
        if leaf_advantages is not None:
            node["leaf_advantages"] = [_number(leaf_advantages[k]) for k in ending[i]]
        if reward_columns:
            node["reward_columns"] = {name: [_number(col[k]) for k in ending[i]] for name, col in reward_columns.items()}
        nodes.append(node)
    return {
        "kind": "tree",
        "prompt": cut_text(prompt_text(prompt), MAX_PROMPT_CHARS),
        "prompt_tokens": len(tree.prompt_ids),
        "num_leaves": tree.num_leaves,
        "num_turns": tree.num_turns,
        "rewards": [_number(r) for r in tree.rewards],
        "paths": [list(p) for p in tree.paths],
        "per_tree": per_tree,
        "nodes": nodes,
    }


def flex_record(group, credit: TurnCredit | dict[str, Any], decode: Callable[[list[int]], str], prompt,
                search_advantages: Sequence[float] | None = None) -> dict:
    """One TreeFlex task as page data: its K complete searches, each a node whose children are its causal blocks
    (role, the end of the block's context), each block the chain of turns it generated with their credit.

    `credit` is the group's per-turn credit (`TreeFlexTrainer.turn_credit`, a `TurnCredit`: `A`, `penalty`, … in the
    group-wide turn order); turn nodes keep that index as their `id`, search and block nodes get ids after the turns.
    `search_advantages`: each search's group-normalised score (F1), shown on its node."""
    per_turn, per_tree = _split_credit(credit, group.num_turns)
    nodes, next_id, turn = [], group.num_turns, 0
    trees = iter(group.trees)
    for s, search in enumerate(group.searches):
        search_id, next_id = next_id, next_id + 1
        score = _number(group.scores[s])
        nodes.append({
            "id": search_id, "parent": -1, "kind": "search", "label": f"search {s}", "leaf": True,
            "multiplicity": 1, "rewards": [score], "trajectories": [s], "credit": {},
            "action": "", "observation": "", "tokens": 0,
            "leaf_advantages": [] if search_advantages is None else [_number(search_advantages[s])],
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
                    "penalty": _number(per_turn.get("penalty", [t.penalty] * group.num_turns)[turn]),
                    "round": None, "entropy": None,
                    "credit": {k: _number(v[turn]) for k, v in per_turn.items()},
                    "trajectories": [], "rewards": [],
                })
                parent, turn = turn, turn + 1
    return {
        "kind": "flex",
        "prompt": cut_text(prompt_text(prompt), MAX_PROMPT_CHARS),
        "num_leaves": len(group.searches),
        "num_turns": group.num_turns,
        "rewards": [_number(r) for r in group.scores.tolist()],
        "per_tree": per_tree,
        "nodes": _dfs(nodes),
    }


def page_data(records: list[dict], *, step: int, method: str, mode: str = "train", credit: str = "",
              after_note: str = "") -> dict:
    """The data of one page: the prompts' records and what the page says about them."""
    return {
        "format": FORMAT, "version": VERSION, "step": int(step), "method": method, "mode": mode,
        "credit": credit, "after_note": after_note, "prompts": records,
    }


def attach_turn_probabilities(record: dict, logp_old: Sequence[float | None], logp_new: Sequence[float | None] | None,
                              p_after: Sequence[float | None] | None) -> None:
    """Add, per turn node (indexed by its `id`), the mean log-probability of its action's tokens under π_old and
    under the updated policy (`logp_old`, `logp_new`), and p = σ(s) after the update (TreeOPSD's turn probability,
    s = `logp_new − logp_old`; p = 1/2 under π_old). None: the turn was not trained (masked)."""
    for node in record["nodes"]:
        if node["kind"] != "turn":
            continue
        i = node["id"]
        node["credit"]["logp_old"] = _number(logp_old[i])
        if logp_new is not None:
            node["credit"]["logp_new"] = _number(logp_new[i])
        if p_after is not None:
            node["credit"]["p_after"] = _number(p_after[i])


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
            per_tree[key] = _number(values)
    return per_turn, per_tree


def _mean(values) -> float | None:
    return _number(sum(values) / len(values)) if values else None


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


# ------------------------------------------------------------------------------------------------------ saving


def save_page(data: dict, directory: str | Path, name: str, *, max_nodes: int = MAX_NODES,
              max_chars: int = MAX_CHARS) -> tuple[Path, Path]:
    """Write `name.json` (the data) and `name.html` (the page) into `directory`; returns both paths."""
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    json_path, html_path = directory / f"{name}.json", directory / f"{name}.html"
    json_path.write_text(json.dumps(data, ensure_ascii=False), encoding="utf-8")
    html_path.write_text(render_page(data, max_nodes=max_nodes, max_chars=max_chars), encoding="utf-8")
    return json_path, html_path


def load_page_data(path: str | Path) -> dict:
    """The data of a saved page; a file that is not one is an error that names it."""
    path = Path(path)
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, json.JSONDecodeError) as e:
        raise ValueError(f"{path}: not a readable tree-view data file ({e}).") from e
    if not isinstance(data, dict) or data.get("format") != FORMAT:
        raise ValueError(f"{path}: not tree-view data (no \"format\": \"{FORMAT}\").")
    if not isinstance(data.get("version", 0), int):
        raise ValueError(f"{path}: \"version\" must be a number, got {_shown(data['version'])}.")
    if data.get("version", 0) > VERSION:
        raise ValueError(f"{path}: tree-view data version {data['version']} is newer than this trl-tree reads "
                         f"({VERSION}); upgrade trl-tree.")
    return data


def render_run(run_dir: str | Path, out_dir: str | Path | None = None, *, max_nodes: int = MAX_NODES,
               max_chars: int = MAX_CHARS) -> list[Path]:
    """Render every saved page of a run again: `RUN_DIR/tree_view/*.json` (or RUN_DIR itself when it holds them, or
    one `.json` file) → `.html` beside each (or in `out_dir`). Returns the pages written.

    Raises:
        FileNotFoundError: no saved tree-view data there (the run needs `log_completions=True`).
    """
    run_dir = Path(run_dir)
    if run_dir.is_file():
        files = [run_dir]
    else:
        folder = run_dir / VIEW_DIR if (run_dir / VIEW_DIR).is_dir() else run_dir
        files = sorted(folder.glob("*.json"))
    if not files:
        raise FileNotFoundError(
            f"No tree-view data under {run_dir} (expected {run_dir / VIEW_DIR}/step_XXXXXX.json): train with "
            "log_completions=True, which saves one page per logged generation batch."
        )
    written = []
    for path in files:
        data = load_page_data(path)
        target = Path(out_dir) if out_dir is not None else path.parent
        target.mkdir(parents=True, exist_ok=True)
        page = target / (path.stem + ".html")
        try:
            text = render_page(data, max_nodes=max_nodes, max_chars=max_chars)
        except ValueError as e:
            raise ValueError(f"{path}: {e}") from e
        page.write_text(text, encoding="utf-8")
        written.append(page)
    return written


# ------------------------------------------------------------------------------------------------------ the page


def render_page(data: dict, *, max_nodes: int = MAX_NODES, max_chars: int = MAX_CHARS) -> str:
    """The HTML page of `data` (`page_data`). Nodes past `max_nodes`, or past `max_chars` characters of text, are cut
    in depth-first order (a shown node's ancestors are always shown) and a note on the page says how many.

    Raises:
        ValueError: a number of the data is not a number (or a list or record is not one), naming where.
    """
    data = _checked_page(data)
    budget = _Budget(max_nodes, max_chars)
    sections, nav = [], []
    for x, record in enumerate(data.get("prompts", [])):
        body = _render_prompt(record, x, budget, data)
        sections.append(body)
        nav.append(_nav_entry(record, x))
    esc = _esc
    title = f"{data.get('method', '')} rollout trees · {data.get('mode', 'train')} step {data.get('step', 0)}"
    cut = ""
    if budget.cut_nodes:
        cut = (f'<p class="cutnote">This page is cut: {budget.cut_nodes} of {budget.total_nodes} nodes are not shown '
               f"(limits: {max_nodes} nodes, {max_chars} characters of text per page). The saved JSON has every node;"
               " render it with other limits: <code>trl-tree view RUN_DIR --max-nodes N --max-chars N</code>.</p>")
    return "".join([
        "<!DOCTYPE html>\n<html lang=\"en\"><head><meta charset=\"utf-8\">",
        "<meta name=\"viewport\" content=\"width=device-width, initial-scale=1\">",
        f"<title>{esc(title)}</title><style>{_CSS}</style></head><body class=\"nojs\">",
        f"<header><h1>{esc(title)}</h1>{_legend(data)}{cut}</header>",
        "<div class=\"main\"><nav><div class=\"navtitle\">prompts</div>", "".join(nav), "</nav>",
        "<main>", "".join(sections), "</main></div>",
        f"<script>{_JS}</script></body></html>\n",
    ])


# Every field the page renders, by type: the renderer may then format numbers with int()/`:.2f` and put texts through
# `_esc`, whatever a hand-edited file holds (a text where a number goes would otherwise reach the HTML unescaped, or
# stop the rendering with a bare TypeError).
_PAGE_TEXTS = ("method", "mode", "credit", "after_note")
_RECORD_INTS = ("prompt_tokens", "num_leaves", "num_turns")
_RECORD_TEXTS = ("kind", "prompt")
_NODE_INTS = ("id", "parent", "tokens", "observation_tokens", "context_tokens", "multiplicity", "turn_offset", "round")
_NODE_FLOATS = ("entropy", "penalty")
_NODE_FLOAT_LISTS = ("rewards", "leaf_advantages")
_NODE_TEXTS = ("kind", "label", "action", "observation", "context")


def _shown(value) -> str:
    text = repr(value)
    return text if len(text) <= 80 else text[:80] + "…"


def _as_int(value, where: str) -> int | None:
    if value is None:
        return None
    try:
        return int(value)
    except (TypeError, ValueError, OverflowError):
        raise ValueError(f"{where} must be a number, got {_shown(value)}: the file was edited or is damaged; "
                         "render the data the run saved.") from None


def _as_float(value, where: str) -> float | None:
    if value is None:
        return None
    try:
        return _number(value)
    except (TypeError, ValueError, OverflowError):
        raise ValueError(f"{where} must be a number, got {_shown(value)}: the file was edited or is damaged; "
                         "render the data the run saved.") from None


def _as_list(value, where: str) -> list:
    if value is None:
        return []
    if not isinstance(value, list):
        raise ValueError(f"{where} must be a list, got {_shown(value)}: the file was edited or is damaged.")
    return value


def _as_dict(value, where: str) -> dict:
    if value is None:
        return {}
    if not isinstance(value, dict):
        raise ValueError(f"{where} must be a JSON object, got {_shown(value)}: the file was edited or is damaged.")
    return value


def _float_map(value, where: str) -> dict[str, float | None]:
    return {str(k): _as_float(v, f"{where}[{k!r}]") for k, v in _as_dict(value, where).items()}


def _float_list(value, where: str) -> list[float | None]:
    return [_as_float(v, f"{where}[{i}]") for i, v in enumerate(_as_list(value, where))]


def _checked_page(data) -> dict:
    """A copy of page data with every field the page renders of its type: numbers int or float (or None), texts str,
    lists and objects as such. Anything else is a `ValueError` that says where (`prompts[0].nodes[3].tokens`)."""
    data = dict(_as_dict(data, "the page data"))
    for key in _PAGE_TEXTS:
        if key in data:
            data[key] = str(data[key])
    data["step"] = _as_int(data.get("step", 0), "step") or 0
    prompts = []
    for x, record in enumerate(_as_list(data.get("prompts"), "prompts")):
        where = f"prompts[{x}]"
        record = dict(_as_dict(record, where))
        for key in _RECORD_INTS:
            record[key] = _as_int(record.get(key), f"{where}.{key}")
        for key in _RECORD_TEXTS:
            if key in record:
                record[key] = str(record[key])
        record["rewards"] = _float_list(record.get("rewards"), f"{where}.rewards")
        record["per_tree"] = _float_map(record.get("per_tree"), f"{where}.per_tree")
        record["nodes"] = [_checked_node(node, f"{where}.nodes[{i}]")
                           for i, node in enumerate(_as_list(record.get("nodes"), f"{where}.nodes"))]
        prompts.append(record)
    data["prompts"] = prompts
    return data


def _checked_node(node, where: str) -> dict:
    node = dict(_as_dict(node, where))
    for key in ("id", "parent"):
        if key not in node:
            raise ValueError(f"{where} has no {key!r}: the file was edited or is damaged.")
    for key in _NODE_INTS:
        if key in node:
            node[key] = _as_int(node[key], f"{where}.{key}")
    for key in _NODE_FLOATS:
        if key in node:
            node[key] = _as_float(node[key], f"{where}.{key}")
    for key in _NODE_FLOAT_LISTS:
        if key in node:
            node[key] = _float_list(node[key], f"{where}.{key}")
    for key in _NODE_TEXTS:
        if node.get(key) is not None:
            node[key] = str(node[key])
    node["credit"] = _float_map(node.get("credit"), f"{where}.credit")
    if "reward_columns" in node:
        columns = _as_dict(node["reward_columns"], f"{where}.reward_columns")
        node["reward_columns"] = {str(name): _float_list(values, f"{where}.reward_columns[{name!r}]")
                                  for name, values in columns.items()}
    if "trajectories" in node:
        node["trajectories"] = [_as_int(k, f"{where}.trajectories[{i}]")
                                for i, k in enumerate(_as_list(node["trajectories"], f"{where}.trajectories"))]
    return node


class _Budget:
    def __init__(self, max_nodes: int, max_chars: int):
        self.nodes_left, self.chars_left = max_nodes, max_chars
        self.total_nodes = self.cut_nodes = 0

    def take(self, node: dict) -> bool:
        self.total_nodes += 1
        size = sum(len(node.get(k) or "") for k in ("action", "observation", "context"))
        if self.nodes_left <= 0 or size > self.chars_left:
            self.nodes_left = 0  # cut the rest too: keeps the shown nodes a prefix of the DFS order
            self.cut_nodes += 1
            return False
        self.nodes_left -= 1
        self.chars_left -= size
        return True


def _esc(text) -> str:
    return html.escape(clean_text(str(text)), quote=True)


def _fmt(value, digits: int = 3) -> str:
    return "–" if value is None else f"{value:+.{digits}f}"


def _fmt_p(value) -> str:
    return "–" if value is None else f"{value:.3f}"


def _legend(data: dict) -> str:
    credit = data.get("credit", "")
    backup = credit in BACKUP_CREDITS
    parts = [
        ("<b>V</b>: the turn's value backed up from the leaves, which the loss uses as its advantage"
         if backup else "<b>A</b>: the turn's advantage as the loss uses it")
        + (f" (credit <code>{_esc(credit)}</code>)" if credit else ""),
        "<b>R · A<sub>k</sub></b>: a leaf's reward(s) and standardised reward(s)",
        "<b>×m</b>: m trajectories ended in this merged leaf",
        "<b>n branches</b>: a branch point",
        "<b>log π</b>: the mean log-probability of the action's tokens, under π_old → after the update",
    ]
    nodes = [n for r in data.get("prompts", []) for n in r.get("nodes", [])]
    if any(n.get("entropy") is not None for n in nodes):
        parts.append("<b>H</b>: the action's mean token entropy at generation")
    if any("q" in n.get("credit", {}) for n in nodes):
        parts.append("<b>q</b>: TreeOPSD's teacher; <b>p</b>: the turn's probability σ(s), ½ under π_old → after "
                     "the update (it moves toward q)")
    note = data.get("after_note")
    if note:
        parts.append(f"<i>{_esc(note)}</i>")
    return "<p class=\"legend\">" + " · ".join(parts) + "</p>"


def _nav_entry(record: dict, x: int) -> str:
    rewards = [r for r in record.get("rewards", []) if r is not None]
    mean = sum(rewards) / len(rewards) if rewards else None
    first = (record.get("prompt") or "").strip().splitlines()
    user = [line for line in first if line.startswith("user:")]
    label = (user[-1][5:] if user else (first[-1] if first else "")).strip()
    label = label[:60] + ("…" if len(label) > 60 else "")
    return (f'<button class="navbtn" data-target="prompt-{x}"><span class="num">#{x}</span> {_esc(label)}'
            f'<span class="sub">K={_esc(record.get("num_leaves"))} · turns={_esc(record.get("num_turns"))} · R̄='
            f'{"–" if mean is None else f"{mean:.2f}"}</span></button>')


def _render_prompt(record: dict, x: int, budget: _Budget, data: dict) -> str:
    nodes = record.get("nodes", [])
    shown_ids = {n["id"] for n in nodes if budget.take(n)}
    children: dict[int, list[dict]] = {}
    for node in nodes:
        if node["id"] in shown_ids:
            children.setdefault(node["parent"], []).append(node)
    per_tree = record.get("per_tree") or {}
    facts = [f"K = {record.get('num_leaves')} leaves", f"{record.get('num_turns')} unique turns"]
    if record.get("prompt_tokens") is not None:
        facts.append(f"prompt {record['prompt_tokens']} tokens")
    if per_tree.get("tau") is not None:
        facts.append(f"τ = {per_tree['tau']:.3f}")
    rewards = " ".join("–" if r is None else f"{r:g}" for r in record.get("rewards", []))
    missing = len(nodes) - len(shown_ids)
    cut = f'<p class="cutnote">{missing} of {len(nodes)} nodes of this prompt are cut.</p>' if missing else ""
    roots = children.get(-1, [])
    what = "searches" if record.get("kind") == "flex" else "branches"
    root_branch = f' <span class="badge branch">{len(roots)} {what}</span>' if len(roots) > 1 else ""
    body = [
        f'<section class="prompt" id="prompt-{x}" data-prompt="{x}">',
        f'<h2>#{x} <span class="kind">{_esc(record.get("kind", "tree"))}</span></h2>',
        f'<details class="prompttext"><summary>prompt{root_branch} · {_esc(" · ".join(facts))} · rewards: '
        f'{_esc(rewards)}</summary><pre>{_esc(record.get("prompt", ""))}</pre></details>',
        cut,
        '<div class="tree">', _render_children(roots, children, data), "</div></section>",
    ]
    return "".join(body)


def _render_children(siblings: list[dict], children: dict[int, list[dict]], data: dict) -> str:
    """Siblings side by side under a branch point (`<ul>`); a chain of single children is drawn straight down."""
    if not siblings:
        return ""
    if len(siblings) == 1:
        return _render_chain(siblings[0], children, data)
    items = "".join(f"<li>{_render_chain(node, children, data)}</li>" for node in siblings)
    return f'<ul class="branches">{items}</ul>'


def _render_chain(node: dict, children: dict[int, list[dict]], data: dict) -> str:
    out = []
    while True:
        kids = children.get(node["id"], [])
        out.append(_render_node(node, len(kids), data.get("credit") in BACKUP_CREDITS))
        if len(kids) != 1:
            if kids:
                out.append(f'<div class="sub">{_render_children(kids, children, data)}</div>')
            return '<div class="chain">' + "".join(out) + "</div>"
        node = kids[0]


def _render_node(node: dict, num_children: int, backup: bool) -> str:
    kind = node.get("kind", "turn")
    credit = node.get("credit", {})
    classes = ["node", kind]
    if node.get("leaf"):
        classes.append("leaf")
    a = credit.get("A")
    if a is not None:
        classes.append("pos" if a > 0 else "neg" if a < 0 else "zero")
    attrs = [f'class="{_esc(" ".join(classes))}"', f'data-kind="{_esc(kind)}"']
    if kind == "turn":
        attrs.append(f'data-node="{int(node["id"])}"')
        attrs.append(f'data-multiplicity="{int(node.get("multiplicity") or 0)}"')
        if node.get("round") is not None:
            attrs.append(f'data-round="{int(node["round"])}"')
        if node.get("partial"):
            attrs.append('data-partial="1"')
    for key, value in credit.items():
        if value is not None:
            attrs.append(f'data-{_attribute_name(key)}="{float(value)!r}"')
    if node.get("rewards"):
        attrs.append(f'data-rewards="{_esc(json.dumps(node["rewards"]))}"')
    style = ""
    if a is not None:
        strength = min(abs(a), 2.0) / 2.0
        style = f' style="--s:{strength:.3f}"'
    head = [f'<span class="nid">{_esc(node.get("label") or "#" + str(node["id"]))}</span>']
    head += _badges(node, num_children)
    head += _chips(credit, backup)
    body = []
    if kind == "block":
        body.append(f'<div class="ctx"><span class="lbl">context ({int(node.get("context_tokens") or 0)} tokens)'
                    f"</span>{_folded(node.get('context', ''), 'ctxtext')}</div>")
    if node.get("action"):
        body.append(_folded(node["action"], "action"))
    if node.get("observation"):
        obs_tokens = node.get("observation_tokens")
        body.append(f'<div class="obs"><span class="lbl">observation'
                    f'{f" ({_tokens(obs_tokens)})" if obs_tokens else ""}</span>'
                    f'{_folded(node["observation"], "obstext", SHOWN_CHARS // 2)}</div>')
    fold = '<button class="fold" title="fold or unfold the subtree">▾</button>' if num_children > 1 else ""
    return (f'<div {" ".join(attrs)}{style}><div class="head">{fold}{"".join(head)}</div>'
            f'{"".join(body)}</div>')


def _tokens(n) -> str:
    return f"{int(n)} token" + ("" if int(n) == 1 else "s")


def _attribute_name(key: str) -> str:
    """A credit key as a `data-` attribute name: only [a-z0-9-] (a hand-edited data file cannot add attributes)."""
    return re.sub(r"[^a-z0-9-]", "", str(key).replace("_", "-").lower()) or "x"


def _badges(node: dict, num_children: int) -> list[str]:
    badges = []
    if node.get("kind") == "turn":
        badges.append(f'<span class="badge tok">{int(node.get("tokens") or 0)} tok</span>')
    if num_children > 1:  # a search's children are its blocks, one after the other: no branch point
        what = "blocks" if node.get("kind") == "search" else "branches"
        badges.append(f'<span class="badge branch">{num_children} {what}</span>')
    start = int(node.get("turn_offset") or 0)
    if node.get("partial"):
        end = start + int(node.get("tokens") or 0)
        badges.append(f'<span class="badge cut" title="a segment: the assistant turn goes on in the children, which '
                      f'branch inside the turn at token {end} (TreeAdv)">✂ tokens {start}–{end} of the turn</span>')
    elif start:
        badges.append(f'<span class="badge cut" title="the rest of an assistant turn split at token {start}">'
                      f"tokens {start}– of the turn</span>")
    if node.get("round"):
        badges.append(f'<span class="badge round" title="created in sampling round {int(node["round"])} (0: the '
                      f'initial trajectories)">round {int(node["round"])}</span>')
    if node.get("entropy") is not None:
        badges.append(f'<span class="badge ent" title="mean token entropy of the action">H {node["entropy"]:.2f}</span>')
    if node.get("truncated"):
        badges.append('<span class="badge warn">truncated</span>')
    if node.get("penalty"):
        badges.append(f'<span class="badge warn" title="process penalty recorded on the turn (failed or malformed '
                      f'tool calls, TreeFlex hooks); TreeFlex\'s credit adds it">Q {node["penalty"]:+.2f}</span>')
    if (node.get("multiplicity") or 0) > 1:
        badges.append(f'<span class="badge mult">×{int(node["multiplicity"])}</span>')
    rewards = node.get("rewards") or []
    if rewards:
        title = ""
        columns = node.get("reward_columns")
        if columns:
            title = "; ".join(f"{name}: {', '.join('–' if v is None else f'{v:g}' for v in vals)}"
                              for name, vals in columns.items())
        shown = ", ".join("–" if r is None else f"{r:g}" for r in rewards[:8]) + ("…" if len(rewards) > 8 else "")
        advantages = node.get("leaf_advantages") or []
        if advantages:
            shown += " · A " + ", ".join(_fmt(a, 2) for a in advantages[:8]) + ("…" if len(advantages) > 8 else "")
        badges.append(f'<span class="badge reward" title="{_esc(title)}">R {_esc(shown)}</span>')
    return badges


def _chips(credit: dict, backup: bool) -> list[str]:
    chips = []
    if "A" in credit:
        chips.append(f'<span class="chip a">{"V" if backup else "A"} {_fmt(credit["A"])}</span>')
    if "q" in credit:
        chips.append(f'<span class="chip q">q {_fmt_p(credit["q"])}</span>')
        if "p_after" in credit:
            chips.append(f'<span class="chip p">p 0.500→{_fmt_p(credit["p_after"])}</span>')
    if "logp_old" in credit:
        new = f'→{_fmt(credit["logp_new"], 2)}' if "logp_new" in credit else ""
        chips.append(f'<span class="chip lp" title="mean log-probability of the action\'s tokens: under π_old'
                     f'{" → after the update" if new else ""}">log π {_fmt(credit["logp_old"], 2)}{new}</span>')
    return chips


def _folded(text: str, cls: str, shown: int = SHOWN_CHARS) -> str:
    """A text, folded behind its start when it is long (native `<details>`: no script needed)."""
    if len(text) <= shown:
        return f'<pre class="{cls}">{_text(text)}</pre>'
    return (f'<details class="{cls}"><summary><pre class="peek">{_text(text[:shown])}…</pre><span class="more">'
            f'▸ {len(text) - shown} more characters</span><span class="less">▴ fold</span></summary>'
            f"<pre>{_text(text)}</pre></details>")


_NEWLINES = re.compile(r"\n{3,}")


def _text(text: str) -> str:
    """Escaped text for a `<pre>`, a run of 3+ newlines drawn as one marked line (a model's empty lines would
    otherwise stretch the node)."""
    return _NEWLINES.sub(lambda m: f'\n<span class="nl">⏎×{len(m.group())}</span>\n', _esc(text))


_CSS = """
:root{--bg:#fafafa;--fg:#1d1d1f;--mut:#6b6b70;--line:#c8c8cc;--card:#fff;--pos:22,140,60;--neg:200,40,40}
*{box-sizing:border-box}body{margin:0;font:13px/1.4 system-ui,-apple-system,"Segoe UI",sans-serif;background:var(--bg);
color:var(--fg)}header{padding:10px 16px;border-bottom:1px solid var(--line);background:#fff}
h1{font-size:17px;margin:0 0 4px}h2{font-size:15px;margin:4px 0}.kind{color:var(--mut);font-weight:normal}
.legend{margin:2px 0;color:var(--mut);font-size:12px}.cutnote{background:#fff4d6;border:1px solid #e6c35c;
padding:6px 10px;border-radius:4px}.main{display:flex;align-items:flex-start}
nav{position:sticky;top:0;width:230px;flex:none;max-height:100vh;overflow:auto;padding:8px;border-right:1px solid
var(--line)}.navtitle{color:var(--mut);font-size:11px;text-transform:uppercase;margin:0 0 4px}
.navbtn{display:block;width:100%;text-align:left;border:1px solid var(--line);background:#fff;border-radius:4px;
padding:5px 7px;margin:0 0 5px;cursor:pointer;font:inherit;overflow-wrap:anywhere}.navbtn.active{border-color:#3b6fd8;background:#eef3ff}
.navbtn .num{font-weight:600}.navbtn .sub{display:block;color:var(--mut);font-size:11px}
main{flex:1;padding:8px 16px;overflow:auto}body.js section.prompt{display:none}body.js section.prompt.active{display:block}
section.prompt{margin-bottom:24px}.prompttext summary{cursor:pointer;color:var(--mut)}
pre{margin:0;white-space:pre-wrap;word-break:break-word;font:12px/1.35 ui-monospace,"DejaVu Sans Mono",monospace}
.chain{display:flex;flex-direction:column;align-items:flex-start}
.chain>.node:not(:first-child){margin-top:10px;position:relative}
.chain>.node:not(:first-child)::before{content:"";position:absolute;left:14px;top:-11px;height:10px;
border-left:2px solid var(--line)}
ul.branches{list-style:none;margin:10px 0 0;padding:0 0 0 14px;border-left:2px solid var(--line)}
ul.branches>li{position:relative;padding:0 0 10px 14px}
ul.branches>li::before{content:"";position:absolute;left:-14px;top:14px;width:26px;border-top:2px solid var(--line)}
.sub.folded{display:none}
.node{background:var(--card);border:1px solid var(--line);border-left:5px solid #aaa;border-radius:5px;
padding:5px 8px;max-width:760px;min-width:260px}
.node.pos{border-left-color:rgba(var(--pos),calc(.25 + .75*var(--s,0)))}
.node.neg{border-left-color:rgba(var(--neg),calc(.25 + .75*var(--s,0)))}
.node.leaf{box-shadow:inset 0 -2px 0 #d9d0f5}.node.search{background:#f2effc;border-left-color:#7c5cd6}
.node.block{background:#f3f6f8;border-left-color:#5a8fb0}
.head{display:flex;flex-wrap:wrap;gap:4px;align-items:center;margin-bottom:3px}.nid{font-weight:600;margin-right:2px}
.badge,.chip{font-size:11px;border-radius:10px;padding:0 6px;border:1px solid var(--line);white-space:nowrap}
.badge.tok,.badge.ent{color:var(--mut)}.badge.branch{background:#e8f0ff;border-color:#9db8ef}
.badge.cut{background:#fff0e6;border-color:#f0b07a}.badge.round{background:#eef9f0;border-color:#93cf9f}
.badge.warn{background:#fde8e8;border-color:#e9a0a0}.badge.mult{background:#f1ebff;border-color:#b7a2ef;font-weight:600}
.badge.reward{background:#fff6d5;border-color:#e3c560;font-weight:600}
.chip{font-family:ui-monospace,"DejaVu Sans Mono",monospace}.chip.a{font-weight:600}
.node.pos .chip.a{background:rgba(var(--pos),.12)}.node.neg .chip.a{background:rgba(var(--neg),.12)}
.chip.q{background:#eef3ff}.chip.p{background:#f4f4f4}
.action{color:var(--fg)}.obs{margin-top:3px;color:var(--mut)}.lbl{font-size:10px;text-transform:uppercase;
color:var(--mut);display:block}.ctx{color:var(--mut);margin-bottom:3px}
details>summary{cursor:pointer;list-style:none}details>summary::-webkit-details-marker{display:none}
details[open] .peek,details[open] .more,details:not([open]) .less{display:none}
.more,.less{font-size:11px;color:#3b6fd8}.nl{color:var(--mut);font-size:10px}
.fold{border:none;background:none;cursor:pointer;padding:0 2px;font-size:12px;color:var(--mut)}
"""

_JS = """
(function(){
  var body=document.body; body.classList.remove('nojs'); body.classList.add('js');
  var buttons=document.querySelectorAll('.navbtn');
  function show(id){
    document.querySelectorAll('section.prompt').forEach(function(s){s.classList.toggle('active', s.id===id);});
    buttons.forEach(function(b){b.classList.toggle('active', b.getAttribute('data-target')===id);});
  }
  buttons.forEach(function(b){b.addEventListener('click', function(){show(b.getAttribute('data-target'));});});
  document.querySelectorAll('.fold').forEach(function(f){f.addEventListener('click', function(){
    var s=f.closest('.node').nextElementSibling; if(!s||!s.classList.contains('sub')) return;
    s.classList.toggle('folded'); f.textContent=s.classList.contains('folded')?'▸':'▾';});});
  if(buttons.length){show(buttons[0].getAttribute('data-target'));} else {body.classList.remove('js');}
})();
"""
