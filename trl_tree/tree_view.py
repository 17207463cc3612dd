"""The rollout-tree view: one self-contained HTML page per logged generation batch, an index page per run, and the data
they are made from.

A tree trainer's behaviour is hard to read from scalars: which turn got credit, where the branches went, which
histories were merged, how far each turn's probability moved toward its teacher. The view draws each prompt's tree
with one node per unique turn (its action, the start of its observation, ×multiplicity, its credit), the leaves
coloured by reward, the branch points and where the siblings under one first differ, and a minimap of the whole tree.
The prompt list starts each entry with the question (not the instruction every prompt shares), the gold answer, the
reward spread and the best and worst leaf, and can be filtered (mixed rewards, failed or malformed tool calls) and
searched. `index.html` beside the pages lists every step of the run and every prompt of each.

Two layers, so that a page can be rendered again from what a run saved (`trl-tree view OUTPUT_DIR`):

- the **page data**, plain JSON (`tree_record`, `flex_record`, `page_data`): texts already decoded and cut, numbers as
  floats. The trainer writes it to `output_dir/tree_view/step_XXXXXX.json` (`trl_tree.trainer.tree_view_logging`);
  what the page derives (reward spread, best and worst leaf, TreeOPSD's Δp and its direction) is computed when it is
  rendered, so older files get it too;
- the **page** (`render_page`, `render_index`): pure string building from that data, no network, no external scripts
  or fonts; inline CSS and SVG, `<details>` for long texts and a few lines of inline JavaScript to switch prompts,
  fold subtrees, highlight a path, step through leaves and filter the list (without JavaScript every prompt is shown,
  unfolded).

Every text that comes from the model, a tool or the dataset is untrusted: `clean_text` replaces control, surrogate,
bidirectional, zero-width and tag characters with visible escapes and `html.escape` escapes it, so a model that
writes `<script>` shows the tag instead of running it. A saved data file is untrusted too (`trl-tree view` renders
whatever is in it): `render_page` first turns every number of the data into an int or float and every text into a
string (`_checked_page`), and refuses a file whose numbers are not numbers; the SVG minimap and every attribute are
written from those checked numbers only. The page's script reads nothing but the page's own attributes and text, and
builds no HTML (it sets classes and `textContent`). Huge trees are cut (`max_nodes`, `max_chars`) with a visible
note, so a page always opens; the JSON keeps every node.
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
VERSION = 1  # the fields added since (question, gold, tool calls, special tokens) are optional: v1 readers skip them
VIEW_DIR = "tree_view"  # under output_dir
INDEX = "index"  # tree_view/index.html (the run's steps) and index.json (their summaries, so a log reads no page)

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

# Dataset columns the page reads, first match wins. The question: HotpotQA-style rows carry it besides the prompt
# (whose user turn is a long shared instruction with the question at its end). The gold answer: what the reward
# functions usually compare against.
QUESTION_COLUMNS = ("question", "query", "problem")
GOLD_COLUMNS = ("answer", "answers", "gold", "gold_answer", "ground_truth", "solution", "target", "reference", "label")

# |Δp| below this is "unchanged": p is σ of a mean of float32 log-ratios from two forwards, whose rounding alone moves
# it by ~1e-7; a realistic learning rate moves it by 1e-5 to 1e-2 per generation batch.
UNCHANGED_DP = 1e-6

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


def _content_text(content) -> str:
    if isinstance(content, list):  # content parts
        return " ".join(str(p.get("text", "")) if isinstance(p, dict) else str(p) for p in content)
    return "" if content is None else str(content)


def prompt_text(prompt) -> str:
    """A dataset prompt as text: a string as it is, chat messages as `role: content` lines."""
    if isinstance(prompt, str):
        return prompt
    if isinstance(prompt, Sequence):
        lines = []
        for message in prompt:
            if isinstance(message, dict):
                lines.append(f"{message.get('role', '?')}: {_content_text(message.get('content'))}")
            else:
                lines.append(str(message))
        return "\n".join(lines)
    return str(prompt)


_QUESTION_MARKER = re.compile(r"(?:^|\n|\s)(?:question|q)\s*:\s*", re.IGNORECASE)


def question_text(prompt, row: dict | None = None) -> str:
    """What the prompt asks, without what every prompt shares: the row's `question` column (`QUESTION_COLUMNS`) when
    it has one; else the last user message (the system message is the same for every prompt), from its last
    "Question:" on when it has one (Search-R1-style instructions put the question at the end)."""
    for column in QUESTION_COLUMNS:
        value = (row or {}).get(column)
        if isinstance(value, str) and value.strip():
            return value.strip()
    text = prompt if isinstance(prompt, str) else None
    if text is None and isinstance(prompt, Sequence):
        users = [m for m in prompt if isinstance(m, dict) and m.get("role") == "user"]
        text = _content_text(users[-1].get("content")) if users else prompt_text(prompt)
    text = str(text if text is not None else prompt)
    marks = list(_QUESTION_MARKER.finditer(text))
    if marks and text[marks[-1].end():].strip():
        text = text[marks[-1].end():]
    return text.strip()


def gold_answer(row: dict | None) -> tuple[str, str] | None:
    """(column, text) of the row's gold answer (`GOLD_COLUMNS`), None when the dataset has none."""
    for column in GOLD_COLUMNS:
        value = (row or {}).get(column)
        if value is None or value == "" or value == []:
            continue
        if isinstance(value, str):
            return column, value
        if isinstance(value, (list, tuple)) and all(isinstance(v, (str, int, float)) for v in value):
            return column, " | ".join(str(v) for v in value)
        try:
            return column, json.dumps(value, ensure_ascii=False, default=str)
        except (TypeError, ValueError):
            return column, str(value)
    return None


def _number(value) -> float | None:
    if value is None:
        return None
    value = float(value)
    return value if math.isfinite(value) else None


# ------------------------------------------------------------------------------------------------------ page data


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
        if calls[i] is not None:
            node["tool_calls"], node["tool_failures"] = calls[i], failures[i]
        if leaf_advantages is not None:
            node["leaf_advantages"] = [_number(leaf_advantages[k]) for k in ending[i]]
        if reward_columns:
            node["reward_columns"] = {name: [_number(col[k]) for k in ending[i]] for name, col in reward_columns.items()}
        nodes.append(node)
    return {
        "kind": "tree",
        "prompt": cut_text(prompt_text(prompt), MAX_PROMPT_CHARS),
        **_row_fields(prompt, row),
        "prompt_tokens": len(tree.prompt_ids),
        "num_leaves": tree.num_leaves,
        "num_turns": tree.num_turns,
        "rewards": [_number(r) for r in tree.rewards],
        "paths": [list(p) for p in tree.paths],
        "per_tree": per_tree,
        "nodes": nodes,
    }


def flex_record(group, credit: TurnCredit | dict[str, Any], decode: Callable[[list[int]], str], prompt,
                search_advantages: Sequence[float] | None = None, *, row: dict | None = None) -> dict:
    """One TreeFlex task as page data: its K complete searches, each a node whose children are its causal blocks
    (role, the end of the block's context), each block the chain of turns it generated with their credit.

    `credit` is the group's per-turn credit (`TreeFlexTrainer.turn_credit`, a `FlexCredit`: `A`, `penalty`, … in the
    group-wide turn order); turn nodes keep that index as their `id`, search and block nodes get ids after the turns.
    `search_advantages`: each search's group-normalised score (F1), shown on its node. `row`: the dataset row (its
    question and gold answer)."""
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
        **_row_fields(prompt, row),
        "num_leaves": len(group.searches),
        "num_turns": group.num_turns,
        "rewards": [_number(r) for r in group.scores.tolist()],
        "per_tree": per_tree,
        "nodes": _dfs(nodes),
    }


def page_data(records: list[dict], *, step: int, method: str, mode: str = "train", credit: str = "",
              after_note: str = "", special_tokens: Sequence[str] = ()) -> dict:
    """The data of one page: the prompts' records and what the page says about them. `special_tokens`: the
    tokenizer's special tokens (`<|im_start|>`, `<|im_end|>`, …), which the page hides in the texts it shows (the
    data keeps them; a switch on the page shows them)."""
    return {
        "format": FORMAT, "version": VERSION, "step": int(step), "method": method, "mode": mode,
        "credit": credit, "after_note": after_note,
        "special_tokens": sorted({clean_text(t)[:60] for t in special_tokens if t and str(t).strip()})[:200],
        "prompts": records,
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

_PAGE_NAME = re.compile(r"(?:eval_)?step_\d{1,12}")  # what the trainer names its pages; the index links no other


def save_page(data: dict, directory: str | Path, name: str, *, max_nodes: int = MAX_NODES,
              max_chars: int = MAX_CHARS) -> tuple[Path, Path]:
    """Write `name.json` (the data) and `name.html` (the page) into `directory`, add the page to the run's index
    (`index.json`, `index.html`) and write the page before it again, so that it links to this one; returns the
    data's and the page's paths."""
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    json_path, html_path = directory / f"{name}.json", directory / f"{name}.html"
    json_path.write_text(json.dumps(data, ensure_ascii=False), encoding="utf-8")
    entries = _upsert(_index_entries(directory), page_summary(data, name))
    write_index(directory, entries)
    links = _neighbours(entries, name)
    html_path.write_text(render_page(data, max_nodes=max_nodes, max_chars=max_chars, links=links), encoding="utf-8")
    before = links.get("prev")
    if before and (directory / f"{before}.json").is_file():  # its "next" link now has a page to point at
        try:
            previous = load_page_data(directory / f"{before}.json")
            page = render_page(previous, max_nodes=max_nodes, max_chars=max_chars,
                               links=_neighbours(entries, before))
        except ValueError:  # a damaged earlier file keeps its page; `trl-tree view` names the problem
            pass
        else:
            (directory / f"{before}.html").write_text(page, encoding="utf-8")
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


def _page_files(folder: Path, *, any_name: bool) -> list[Path]:
    """The saved pages' data in `folder`: every `.json` but the index in a `tree_view/` folder (`any_name`), only
    the trainer's `step_XXXXXX.json` / `eval_step_XXXXXX.json` anywhere else (a run's output_dir also holds
    `config.json` and the like, which are no pages)."""
    files = [p for p in folder.glob("*.json") if p.stem != INDEX]
    if not any_name:
        files = [p for p in files if _PAGE_NAME.fullmatch(p.stem)]
    return sorted(files)


def find_pages(run_dir: str | Path) -> list[Path]:
    """The saved pages' data of a run: `OUTPUT_DIR/tree_view/*.json` (OUTPUT_DIR: the run's `output_dir`), the
    `tree_view/` folder itself, a folder with `step_XXXXXX.json` files, or one `.json` file.

    Raises:
        FileNotFoundError: none there, saying why (a run writes them only with `log_completions=True`).
    """
    run_dir = Path(run_dir)
    if run_dir.is_file():
        return [run_dir]
    if not run_dir.is_dir():
        raise FileNotFoundError(f"{run_dir}: no such file or folder (give a run's output_dir, its {VIEW_DIR}/ "
                                "folder, or one saved .json file).")
    folder = run_dir / VIEW_DIR if (run_dir / VIEW_DIR).is_dir() else run_dir
    files = _page_files(folder, any_name=folder.name == VIEW_DIR)
    if files:
        return files
    nested = sorted(p for p in run_dir.glob(f"*/{VIEW_DIR}") if p.is_dir() and _page_files(p, any_name=True))
    if len(nested) == 1:  # e.g. the folder above a run's output_dir
        return _page_files(nested[0], any_name=True)
    if nested:
        raise FileNotFoundError(f"{run_dir} holds the pages of several runs ({', '.join(str(p.parent) for p in nested)}"
                                "): give one of them.")
    if folder.name == VIEW_DIR:
        raise FileNotFoundError(
            f"{folder} holds no saved page yet: a run with log_completions=True writes one at the first log after "
            "each generation batch's last optimizer step.")
    raise FileNotFoundError(
        f"No rollout-tree pages in {run_dir} (expected {run_dir / VIEW_DIR}/step_XXXXXX.json): a run saves them only "
        "with log_completions=True (`--log_completions true` on the command line, `log_completions: true` in a "
        "--config YAML, or log_completions=True in the config). Train with it, then run `trl-tree view "
        "OUTPUT_DIR` on the run's output_dir.")


def render_run(run_dir: str | Path, out_dir: str | Path | None = None, *, max_nodes: int = MAX_NODES,
               max_chars: int = MAX_CHARS) -> list[Path]:
    """Render every saved page of a run again (`find_pages`: `OUTPUT_DIR/tree_view/*.json`, or that folder, or one
    `.json` file) → `.html` beside each (or in `out_dir`), each linked to the steps before and after it, and the
    run's `index.html` there. Returns the pages written, the index last.

    Raises:
        FileNotFoundError: no saved tree-view data there (the run needs `log_completions=True`).
        ValueError: a file that is no tree-view data or whose numbers are not numbers, naming it.
    """
    files = find_pages(run_dir)
    loaded = [(path, load_page_data(path)) for path in files]
    single = Path(run_dir).is_file()
    written = []
    for target in sorted({Path(out_dir) if out_dir is not None else path.parent for path, _ in loaded}):
        here = [(path, data) for path, data in loaded if (Path(out_dir) if out_dir is not None else path.parent) == target]
        target.mkdir(parents=True, exist_ok=True)
        try:
            if single:  # one page again: its neighbours are those of its run's index, when it renders in place
                entries = _index_entries(target) if out_dir is None else []
                entries = _upsert(entries, page_summary(here[0][1], here[0][0].stem))
            else:
                entries = sorted((page_summary(data, path.stem) for path, data in here), key=_order)
        except ValueError as e:
            raise ValueError(f"{_failing(here)}: {e}") from e
        for path, data in here:
            links = _neighbours(entries, path.stem)
            try:
                text = render_page(data, max_nodes=max_nodes, max_chars=max_chars, links=links)
            except ValueError as e:
                raise ValueError(f"{path}: {e}") from e
            page = target / (path.stem + ".html")
            page.write_text(text, encoding="utf-8")
            written.append(page)
        written.append(write_index(target, entries))
    return written


def _failing(loaded: list[tuple[Path, dict]]) -> Path:
    """The first of `loaded` whose data does not check (for the error message)."""
    for path, data in loaded:
        try:
            _checked_page(data)
        except ValueError:
            return path
    return loaded[0][0]


# ------------------------------------------------------------------------------------------------------ the index


def page_summary(data: dict, name: str) -> dict:
    """What the run's index shows of one page: its step, and per prompt the question, gold answer, reward spread,
    failed tool calls and TreeOPSD's Δp directions. Raises `ValueError` as `render_page` does."""
    data = _checked_page(data)
    prompts = []
    for x, record in enumerate(data["prompts"]):
        facts = _analyse(record)
        prompts.append({
            "x": x, "question": _record_question(record)[:300], "gold": (record.get("gold") or "")[:200],
            "min": facts["min"], "max": facts["max"], "mean": facts["mean"], "leaves": record.get("num_leaves") or 0,
            "mixed": int(facts["mixed"]), "failures": facts["failures"], **facts["dp_counts"],
        })
    return {"name": str(name), "step": data["step"], "mode": data.get("mode", "train"),
            "method": data.get("method", ""), "prompts": prompts}


def _order(entry: dict):
    return entry["step"], entry["mode"] != "train", entry["name"]


def _upsert(entries: list[dict], entry: dict) -> list[dict]:
    return sorted([e for e in entries if e["name"] != entry["name"]] + [entry], key=_order)


def _neighbours(entries: list[dict], name: str) -> dict:
    """The page's links: the index, and the pages just before and after it in the run (by step; a step's evaluation
    page after its training page)."""
    names = [e["name"] for e in entries]
    links: dict = {"index": f"{INDEX}.html"}
    if name in names:
        i = names.index(name)
        for key, j in (("prev", i - 1), ("next", i + 1)):
            if 0 <= j < len(entries) and _PAGE_NAME.fullmatch(names[j]):
                links[key] = names[j]
                links[f"{key}_label"] = f"{entries[j]['mode']} step {entries[j]['step']}"
    return links


_SUMMARY_FLOATS = ("min", "max", "mean")
_SUMMARY_INTS = ("x", "leaves", "mixed", "failures", "toward", "away", "unchanged")


def _checked_index(data) -> list[dict]:
    """The entries of a saved `index.json`, every field of its type (the file is untrusted, like the pages)."""
    data = _as_dict(data, "the index")
    if data.get("format") != f"{FORMAT}/index":
        raise ValueError("not a tree-view index")
    entries = []
    for i, entry in enumerate(_as_list(data.get("pages"), "pages")):
        entry = _as_dict(entry, f"pages[{i}]")
        prompts = []
        for x, p in enumerate(_as_list(entry.get("prompts"), f"pages[{i}].prompts")):
            p = _as_dict(p, f"pages[{i}].prompts[{x}]")
            checked = {k: _as_float(p.get(k), k) for k in _SUMMARY_FLOATS}
            checked.update({k: _as_int(p.get(k), k) or 0 for k in _SUMMARY_INTS})
            checked.update(question=str(p.get("question", "")), gold=str(p.get("gold", "")))
            prompts.append(checked)
        entries.append({"name": str(entry.get("name", "")), "step": _as_int(entry.get("step"), "step") or 0,
                        "mode": str(entry.get("mode", "train")), "method": str(entry.get("method", "")),
                        "prompts": prompts})
    return sorted(entries, key=_order)


def _index_entries(directory: Path) -> list[dict]:
    """The index's entries: from `index.json`, or, when it is missing or damaged, from the saved pages (each read
    once; a damaged page is left out)."""
    try:
        return _checked_index(json.loads((directory / f"{INDEX}.json").read_text(encoding="utf-8")))
    except (OSError, ValueError):
        pass
    entries = []
    for path in _page_files(directory, any_name=True):
        try:
            entries.append(page_summary(load_page_data(path), path.stem))
        except ValueError:
            continue
    return sorted(entries, key=_order)


def write_index(directory: str | Path, entries: list[dict]) -> Path:
    """Write the run's `index.json` (the entries) and `index.html` (`render_index`); returns the page's path."""
    directory = Path(directory)
    (directory / f"{INDEX}.json").write_text(
        json.dumps({"format": f"{FORMAT}/index", "version": VERSION, "pages": entries}, ensure_ascii=False),
        encoding="utf-8")
    page = directory / f"{INDEX}.html"
    page.write_text(render_index(entries), encoding="utf-8")
    return page


def render_index(entries: list[dict]) -> str:
    """The run's index page: one block per saved page (its step, linked) with a row per prompt (question, gold
    answer, reward spread, failed tool calls, Δp directions), filters and a search box."""
    esc = _esc
    rows, total = [], 0
    for entry in entries:
        name = entry["name"] if _PAGE_NAME.fullmatch(entry["name"]) else None
        href = f"{name}.html" if name else None
        label = f"{entry['mode']} step {entry['step']}"
        prompts = entry["prompts"]
        mixed = sum(p["mixed"] for p in prompts)
        failed = sum(1 for p in prompts if p["failures"])
        dp = {k: sum(p[k] for p in prompts) for k in ("toward", "away", "unchanged")}
        head = (f'<a href="{esc(href)}">{esc(label)}</a>' if href else esc(label))
        dp_text = (f" · Δp: {dp['toward']} toward q, {dp['away']} away, {dp['unchanged']} unchanged"
                   if any(dp.values()) else "")
        rows.append(f'<tr class="stephead"><th colspan="7">{head} <span class="mut">· {len(prompts)} prompts · '
                    f"{mixed} with mixed rewards · {failed} with failed or malformed tool calls{esc(dp_text)} · "
                    f"{esc(entry['method'])}</span></th></tr>")
        for p in prompts:
            total += 1
            link = f'<a href="{esc(href)}#prompt-{p["x"]}">#{p["x"]}</a>' if href else f"#{p['x']}"
            spread = _spread_text(p["min"], p["max"], p["mean"])
            dp_cell = (f"{p['toward']} / {p['away']} / {p['unchanged']}"
                       if p["toward"] + p["away"] + p["unchanged"] else "")
            rows.append(
                f'<tr class="row" data-mixed="{p["mixed"]}" data-failed="{int(p["failures"] > 0)}">'
                f"<td>{esc(label)}</td><td>{link}</td><td class=\"qcell\">{esc(p['question'])}</td>"
                f"<td>{esc(p['gold'])}</td><td>{esc(spread)} <span class=\"mut\">({p['leaves']} leaves)</span></td>"
                f"<td>{p['failures'] or ''}</td><td>{esc(dp_cell)}</td></tr>")
    method = entries[-1]["method"] if entries else ""
    title = f"{method} rollout trees · {len(entries)} pages" if entries else "rollout trees · no pages yet"
    tools = _filter_tools("search questions and gold answers")
    return "".join([
        "<!DOCTYPE html>\n<html lang=\"en\"><head><meta charset=\"utf-8\">",
        "<meta name=\"viewport\" content=\"width=device-width, initial-scale=1\">",
        f"<title>{esc(title)}</title><style>{_CSS}</style></head><body class=\"nojs indexpage\">",
        f"<header><h1>{esc(title)}</h1><p class=\"summary\">{total} prompts. Each row links to its prompt on its "
        "step's page; a page links to the steps before and after it.</p>", tools, "</header>",
        "<main><table class=\"index\"><thead><tr><th>step</th><th>prompt</th><th>question</th><th>gold</th>"
        "<th>reward</th><th>failed calls</th><th>Δp toward / away / unchanged</th></tr></thead><tbody>",
        "".join(rows), "</tbody></table></main>",
        f"<script>{_JS}</script></body></html>\n",
    ])


def _filter_tools(placeholder: str) -> str:
    """The search box and the two filters (shown only with JavaScript, which applies them)."""
    return (f'<div class="tools"><input type="search" id="search" placeholder="{_esc(placeholder)}" '
            'aria-label="search"> <label><input type="checkbox" id="f-mixed"> mixed rewards</label> '
            '<label title="a turn whose tool call failed or could not be parsed (or a TreeFlex process penalty)">'
            '<input type="checkbox" id="f-failed"> failed or malformed tool calls</label> '
            '<span class="mut" id="shown-count"></span></div>')


# ------------------------------------------------------------------------------------------------------ the page


def render_page(data: dict, *, max_nodes: int = MAX_NODES, max_chars: int = MAX_CHARS,
                links: dict | None = None) -> str:
    """The HTML page of `data` (`page_data`). Nodes past `max_nodes`, or past `max_chars` characters of text, are cut
    in depth-first order (a shown node's ancestors are always shown) and a note on the page says how many.

    `links`: the run's index and the pages before and after this one (`save_page` and `render_run` pass them; a page
    for a tracker has none, since its files are not beside it there).

    Raises:
        ValueError: a number of the data is not a number (or a list or record is not one), naming where.
    """
    data = _checked_page(data)
    view = _View(data)
    budget = _Budget(max_nodes, max_chars)
    records = data.get("prompts", [])
    analyses = [_analyse(record) for record in records]
    questions = _short_questions([_record_question(r) for r in records])
    sections, nav = [], []
    for x, (record, facts) in enumerate(zip(records, analyses)):
        sections.append(_render_prompt(record, x, budget, view, facts, questions[x]))
        nav.append(_nav_entry(record, x, facts, questions[x], view))
    esc = _esc
    title = f"{data.get('method', '')} rollout trees · {data.get('mode', 'train')} step {data.get('step', 0)}"
    cut = ""
    if budget.cut_nodes:
        cut = (f'<p class="cutnote">This page is cut: {budget.cut_nodes} of {budget.total_nodes} nodes are not shown '
               f"(limits: {max_nodes} nodes, {max_chars} characters of text per page). The saved JSON has every node;"
               " render it with other limits: <code>trl-tree view RUN_DIR --max-nodes N --max-chars N</code>.</p>")
    leafnav = ('<div class="leafnav"><button type="button" id="next-rewarded">next rewarded leaf ▸</button>'
               '<button type="button" id="next-failed">next failed leaf ▸</button>'
               '<span class="mut" id="leafpos"></span><label class="tpltoggle" title="the chat template\'s special '
               'tokens (&lt;|im_start|&gt;, &lt;|im_end|&gt;, …): hidden in the texts shown, kept in the data">'
               '<input type="checkbox" id="show-tpl"> show template tokens</label></div>')
    return "".join([
        "<!DOCTYPE html>\n<html lang=\"en\"><head><meta charset=\"utf-8\">",
        "<meta name=\"viewport\" content=\"width=device-width, initial-scale=1\">",
        f"<title>{esc(title)}</title><style>{_CSS}</style></head><body class=\"nojs\">",
        f"<header><div class=\"titlebar\"><h1>{esc(title)}</h1>{_step_links(links)}</div>",
        _page_summary_line(records, analyses), _legend(data, view), cut, "</header>",
        "<div class=\"main\"><nav class=\"prompts\">", _filter_tools("search questions, actions, observations"),
        "<div class=\"navtitle\">prompts</div><div class=\"navlist\">", "".join(nav), "</div></nav>",
        "<main>", leafnav, "".join(sections), "</main></div>",
        f"<script>{_JS}</script></body></html>\n",
    ])


def _step_links(links: dict | None) -> str:
    if not links:
        return ""
    parts = []
    for key, arrow in (("prev", "◀ "), ("index", ""), ("next", "")):
        if key == "index":
            parts.append(f'<a class="steplink" href="{_esc(links["index"])}">all steps</a>')
        elif links.get(key) and _PAGE_NAME.fullmatch(links[key]):
            text = f"{arrow}{links.get(f'{key}_label', links[key])}" + (" ▶" if key == "next" else "")
            parts.append(f'<a class="steplink" rel="{key}" href="{_esc(links[key])}.html">{_esc(text)}</a>')
        else:
            parts.append(f'<span class="steplink off">{"◀ first page" if key == "prev" else "last page ▶"}</span>')
    return '<nav class="steps">' + "".join(parts) + "</nav>"


# -------------------------------------------------------------------- what the page derives from the data


class _View:
    """Page-wide rendering settings derived from the data: the reward colour scale and the template tokens."""

    def __init__(self, data: dict):
        self.credit = data.get("credit", "")
        self.backup = self.credit in BACKUP_CREDITS
        values = [v for record in data.get("prompts", []) for v in _leaf_values(record).values() if v is not None]
        if values and 0.0 <= min(values) and max(values) <= 1.0:
            self.low, self.high = 0.0, 1.0  # a [0, 1] reward keeps its absolute meaning: 0 red, 1 green
        elif values:
            self.low, self.high = min(values), max(values)
        else:
            self.low = self.high = 0.0
        # only markup-like tokens (<|im_end|>, </s>, [INST]): a tampered file's "a" must not hide every "a"
        tokens = [t for t in data.get("special_tokens", []) if len(t) >= 3 and t[0] in "<[" and t[-1] in ">]"]
        self.template = (re.compile("|".join(re.escape(t) for t in sorted(tokens, key=len, reverse=True)))
                         if tokens else _TEMPLATE_FALLBACK)

    def hue(self, value: float | None) -> int | None:
        """Red (0) at the scale's low end to green (120) at its high end; None: no reward, no colour."""
        if value is None:
            return None
        if self.high <= self.low:
            return 60
        return round(120 * min(max((value - self.low) / (self.high - self.low), 0.0), 1.0))


# Without the tokenizer's list (older files): `<|name|>` tokens (Qwen, Llama 3, Phi, …)
_TEMPLATE_FALLBACK = re.compile(r"<\|[A-Za-z0-9_.:\-]{1,40}\|>")
_ROLE = re.compile(r"[A-Za-z][A-Za-z0-9_\-]{0,19}")


def _leaf_values(record: dict) -> dict[int, float | None]:
    """Each node where trajectories end (TreeFlex: each search) → the mean of their rewards (None: none scored)."""
    out = {}
    for node in record.get("nodes", []):
        rewards = node.get("rewards") or []
        if rewards:
            scored = [r for r in rewards if r is not None]
            out[node["id"]] = sum(scored) / len(scored) if scored else None
    return out


def _analyse(record: dict) -> dict:
    """What the page says of one prompt: reward spread, leaf outcomes, best and worst leaf, failed tool calls, and
    per TreeOPSD turn Δp = p − ½ and its direction relative to q."""
    rewards = [r for r in record.get("rewards", []) if r is not None]
    low = min(rewards) if rewards else None
    high = max(rewards) if rewards else None
    mean = sum(rewards) / len(rewards) if rewards else None
    std = math.sqrt(sum((r - mean) ** 2 for r in rewards) / len(rewards)) if rewards else None
    values = _leaf_values(record)
    outcome = {}
    for i, v in values.items():
        if v is not None and mean is not None:
            # rewarded: a positive reward at least its tree's mean (a 0/1 reward: the 1s); failed: the rest
            at_least_mean = v >= mean - 1e-9 * max(1.0, abs(mean))
            outcome[i] = "rewarded" if v > 0 and at_least_mean else "failed"
    scored = [(v, i) for i, v in values.items() if v is not None]
    best = max(scored, key=lambda t: t[0])[1] if scored else None  # the first of equals (DFS order)
    worst = min(scored, key=lambda t: t[0])[1] if scored else None
    failures, calls, penalised = 0, 0, 0
    dp, counts = {}, {"toward": 0, "away": 0, "unchanged": 0}
    for node in record.get("nodes", []):
        failures += int(node.get("tool_failures") or 0)
        calls += int(node.get("tool_calls") or 0)
        penalised += int((node.get("penalty") or 0) < 0)
        credit = node.get("credit") or {}
        q, p = credit.get("q"), credit.get("p_after")
        if q is not None and p is not None:
            dp[node["id"]] = (p - 0.5, _direction(q, p))
            counts[dp[node["id"]][1]] += 1
    return {"min": low, "max": high, "mean": mean, "std": std, "mixed": high is not None and high > low,
            "values": values, "outcome": outcome, "best": best, "worst": worst,
            "failures": failures or penalised, "calls": calls, "penalised": penalised, "dp": dp, "dp_counts": counts}


def _direction(q: float, p: float) -> str:
    """Where the update moved a turn's p = σ(s) (½ under π_old): "toward" q when p ended closer to q than ½ was,
    "away" when farther (overshooting q counts as away), "unchanged" when |p − ½| < `UNCHANGED_DP`."""
    if abs(p - 0.5) < UNCHANGED_DP:
        return "unchanged"
    return "toward" if abs(p - q) < abs(0.5 - q) else "away"


def _record_question(record: dict) -> str:
    """The record's question; an older file has none saved: from its prompt text (the last `user:` message)."""
    if record.get("question"):
        return record["question"]
    text = record.get("prompt") or ""
    lines = text.splitlines()
    starts = [i for i, line in enumerate(lines) if line.startswith("user:")]
    if starts:
        text = "\n".join(lines[starts[-1]:])[5:]
    return question_text(text.strip())


def _short_questions(questions: list[str]) -> list[str]:
    """The questions without the text they all start with (an instruction shared by every prompt of the page), cut
    at a word; one question, or a short shared start, is left as it is."""
    if len(questions) < 2:
        return questions
    shared = len(questions[0])
    for q in questions[1:]:
        shared = min(shared, len(q))
        while not q.startswith(questions[0][:shared]):
            shared -= 1
    if shared < 30:
        return questions
    cut = questions[0].rfind(" ", 0, shared) + 1 or shared
    return [("… " + q[cut:].strip()) if q[cut:].strip() else q for q in questions]


def _spread_text(low, high, mean) -> str:
    if low is None:
        return "no scored leaf"
    if high == low:
        return f"R {low:.3g} (all leaves)"
    return f"R {low:.3g}…{high:.3g}, mean {mean:.3g}"


def _plain(text: str, view: _View, limit: int) -> str:
    """A one-line plain version of a text (template tokens out), for the prompt list and the facts."""
    text = view.template.sub(" ", text)
    text = " ".join(text.split())
    return text[:limit] + ("…" if len(text) > limit else "")


def _fmt_dp(dp: float) -> str:
    """Δp signed, with enough digits for a realistic learning rate's 1e-5 (0.00001 would print as +0.000)."""
    if dp == 0:
        return "±0"
    return f"{dp:+.4f}" if abs(dp) >= 1e-3 else f"{dp:+.2e}"


def _fmt_p_after(p: float) -> str:
    return f"{p:.3f}" if abs(p - 0.5) >= 1e-2 else f"{p:.6f}"


# -------------------------------------------------------------------- header, legend, prompt list


def _page_summary_line(records: list[dict], analyses: list[dict]) -> str:
    mixed = sum(a["mixed"] for a in analyses)
    failed = sum(1 for a in analyses if a["failures"])
    parts = [f"{len(records)} prompts", f"{mixed} with mixed rewards", f"{failed} with failed or malformed tool calls"]
    counts = {k: sum(a["dp_counts"][k] for a in analyses) for k in ("toward", "away", "unchanged")}
    n = sum(counts.values())
    dp = ""
    if n:
        dp = (f' · <span class="dpsum">Δp of {n} trained turns: <b class="toward">{counts["toward"]} toward q</b>, '
              f'<b class="away">{counts["away"]} away</b>, <b class="unchanged">{counts["unchanged"]} unchanged</b>'
              "</span>")
    return f'<p class="summary">{_esc(" · ".join(parts))}{dp}</p>'


def _legend(data: dict, view: _View) -> str:
    credit = data.get("credit", "")
    nodes = [n for r in data.get("prompts", []) for n in r.get("nodes", [])]
    scale = (f"{view.low:.3g}" + "–" + f"{view.high:.3g}") if view.high > view.low else "–"
    parts = [
        ("<b>V</b>: the turn's value backed up from the leaves, which the loss uses as its advantage"
         if view.backup else "<b>A</b>: the turn's advantage as the loss uses it")
        + (f" (credit <code>{_esc(credit)}</code>)" if credit else ""),
        f'<b>leaf colour</b>: its reward on <span class="scale"></span> {_esc(scale)}; <b>rewarded</b>: a reward '
        "above 0 and at least its tree's mean; <b>failed</b>: the others",
        "<b>R · A<sub>k</sub></b>: a leaf's reward(s) and standardised reward(s)",
        "<b>×m</b>: m trajectories ended in this merged leaf",
        "<b>↓</b>: the same trajectory goes on; <b>↳ i/n</b>: one of n siblings after a branch point, with where "
        "its text first differs from theirs",
        "<b>log π</b>: the mean log-probability of the action's tokens, under π_old → after the update",
        "click a node: its path from the root is highlighted (in the minimap too)",
        "the chat template's special tokens are hidden in the texts (the data keeps them; “show template tokens”)",
    ]
    if any(n.get("entropy") is not None for n in nodes):
        parts.append("<b>H</b>: the action's mean token entropy at generation")
    if any("q" in n.get("credit", {}) for n in nodes):
        parts.append(
            "<b>q</b>: TreeOPSD's teacher probability for the turn; <b>p</b>: σ(s), s the mean log-ratio of the "
            "turn's tokens, ½ under π_old, shown after the update; <b>Δp</b> = p − ½. <b>toward q</b>: p ended "
            "closer to q than ½ was; <b>away</b>: farther (past q counts as away); <b>unchanged</b>: "
            f"|Δp| &lt; {UNCHANGED_DP:g}. This is what this batch's update did to each turn, measured after it")
    note = data.get("after_note")
    if note:
        parts.append(f"<i>{_esc(note)}</i>")
    return ('<details class="legend"><summary>how to read this page</summary><ul>'
            + "".join(f"<li>{p}</li>" for p in parts) + "</ul></details>")


def _strip(record: dict, view: _View) -> str:
    """The tree's trajectory rewards as a strip of coloured cells, lowest first (the spread at a glance)."""
    rewards = sorted(r for r in record.get("rewards", []) if r is not None)
    if len(rewards) > 48:  # evenly spaced samples keep the spread
        rewards = [rewards[round(i * (len(rewards) - 1) / 47)] for i in range(48)]
    cells = "".join(f'<i style="--rh:{view.hue(r)}"></i>' for r in rewards)
    return f'<span class="strip" aria-hidden="true">{cells}</span>'


def _leaf_label(record: dict, node_id: int | None, facts: dict, view: _View, x: int, with_text: bool) -> str:
    if node_id is None:
        return ""
    node = next((n for n in record.get("nodes", []) if n["id"] == node_id), {})
    value = facts["values"].get(node_id)
    name = node.get("label") or f"#{node_id}"
    text = _plain(node.get("action") or "", view, 90) if with_text else ""
    return (f'<a class="leaflink" href="#n-{x}-{int(node_id)}" data-ref="{int(node_id)}">{_esc(name)}</a> '
            f'<span class="rv" style="--rh:{view.hue(value)}">R {_esc(f"{value:.3g}")}</span>'
            + (f' <span class="snip">{_esc(text)}</span>' if text else ""))


def _nav_entry(record: dict, x: int, facts: dict, question: str, view: _View) -> str:
    label = _plain(question, view, 110)
    gold = record.get("gold")
    lines = [f'<span class="q"><span class="num">#{x}</span> {_esc(label)}</span>']
    if gold:
        lines.append(f'<span class="gold">gold: {_esc(_plain(gold, view, 50))}</span>')
    lines.append(f'<span class="sub">{_strip(record, view)} {_esc(_spread_text(facts["min"], facts["max"], facts["mean"]))}'
                 f' · K={_esc(record.get("num_leaves"))}</span>')
    if facts["best"] is not None and facts["mixed"]:
        labels = {n["id"]: n.get("label") or f"#{n['id']}" for n in record.get("nodes", [])
                  if n["id"] in (facts["best"], facts["worst"])}
        best, worst = facts["values"][facts["best"]], facts["values"][facts["worst"]]
        lines.append(f'<span class="sub">best {_esc(labels[facts["best"]])} ({best:.3g}) · worst '
                     f'{_esc(labels[facts["worst"]])} ({worst:.3g})</span>')
    flags = []
    if facts["failures"]:
        flags.append(f'<span class="flag warn">{facts["failures"]} failed call{"s" * (facts["failures"] != 1)}</span>')
    counts = facts["dp_counts"]
    if sum(counts.values()):
        flags.append(f'<span class="flag dp">Δp ↑{counts["toward"]} ↓{counts["away"]} ={counts["unchanged"]}</span>')
    if flags:
        lines.append('<span class="sub">' + " ".join(flags) + "</span>")
    return (f'<button type="button" class="navbtn" data-target="prompt-{x}" data-mixed="{int(facts["mixed"])}" '
            f'data-failed="{int(facts["failures"] > 0)}">' + "".join(lines) + "</button>")


# -------------------------------------------------------------------- one prompt


def _render_prompt(record: dict, x: int, budget: _Budget, view: _View, facts: dict, question: str) -> str:
    nodes = record.get("nodes", [])
    shown_ids = {n["id"] for n in nodes if budget.take(n)}
    children: dict[int, list[dict]] = {}
    for node in nodes:
        if node["id"] in shown_ids:
            children.setdefault(node["parent"], []).append(node)
    per_tree = record.get("per_tree") or {}
    details = [f"K = {record.get('num_leaves')} leaves", f"{record.get('num_turns')} unique turns"]
    if record.get("prompt_tokens") is not None:
        details.append(f"prompt {record['prompt_tokens']} tokens")
    if per_tree.get("tau") is not None:
        details.append(f"τ = {per_tree['tau']:.3f}")
    rewards = " ".join("–" if r is None else f"{r:g}" for r in record.get("rewards", []))
    missing = len(nodes) - len(shown_ids)
    cut = f'<p class="cutnote">{missing} of {len(nodes)} nodes of this prompt are cut.</p>' if missing else ""
    roots = children.get(-1, [])
    what = "searches" if record.get("kind") == "flex" else "branches"
    root_branch = f' <span class="badge branch">{len(roots)} {what}</span>' if len(roots) > 1 else ""
    facts_html = []
    if record.get("gold"):
        column = record.get("gold_column") or "gold"
        facts_html.append(_fact(f"gold ({column})", f'<b class="goldtext">{_esc(record["gold"])}</b>'))
    spread = _spread_text(facts["min"], facts["max"], facts["mean"])
    if facts["std"] is not None and facts["mixed"]:
        spread += f", std {facts['std']:.3g}"
    facts_html.append(_fact("reward", f"{_strip(record, view)} {_esc(spread)} over {_esc(record.get('num_leaves'))} "
                                      "leaves"))
    if facts["best"] is not None:
        if facts["mixed"]:
            facts_html.append(_fact("best leaf", _leaf_label(record, facts["best"], facts, view, x, True)))
            facts_html.append(_fact("worst leaf", _leaf_label(record, facts["worst"], facts, view, x, True)))
        else:
            facts_html.append(_fact("leaves", "every leaf has the same reward: no learning signal from this tree"))
    if facts["calls"] or facts["failures"]:
        facts_html.append(_fact("tool calls", f'{facts["calls"]} on its unique turns, <b class="'
                                f'{"warn" if facts["failures"] else ""}">{facts["failures"]} failed or malformed</b>'))
    counts = facts["dp_counts"]
    if sum(counts.values()):
        facts_html.append(_fact("TreeOPSD Δp", f'<b class="toward">{counts["toward"]} toward q</b> · <b class="away">'
                                f'{counts["away"]} away</b> · <b class="unchanged">{counts["unchanged"]} unchanged</b>'))
    body = [
        f'<section class="prompt" id="prompt-{x}" data-prompt="{x}">',
        f'<h2><span class="num">#{x}</span> <span class="kind">{_esc(record.get("kind", "tree"))}</span> '
        f'<span class="qtext">{_esc(question)}</span></h2>',
        '<div class="facts">', "".join(facts_html), "</div>",
        f'<details class="prompttext"><summary>full prompt{root_branch} · {_esc(" · ".join(details))} · rewards: '
        f'{_esc(rewards)}</summary><pre>{_esc(record.get("prompt", ""))}</pre></details>',
        cut, _minimap(roots, children, x, facts, view),
        '<div class="tree">', _render_children(roots, children, x, facts, view), "</div></section>",
    ]
    return "".join(body)


def _fact(label: str, value: str) -> str:
    """One line of the prompt's facts: a label (escaped here) and its value (HTML built by the caller)."""
    return f'<div class="fact"><span class="lbl">{_esc(label)}</span><span class="val">{value}</span></div>'


def _minimap(roots: list[dict], children: dict[int, list[dict]], x: int, facts: dict, view: _View) -> str:
    """The whole (shown) tree at a glance, as inline SVG: one dot per node, rows by depth, leaves side by side, an
    inner node over its children; branch edges blue, a chain's continuation grey; leaves coloured by reward. Each
    dot links to its node. Built from the checked numbers only (ids, rewards)."""
    if not roots:
        return ""
    pos: dict[int, tuple[float, int]] = {}
    column, depth_max = 0, 0
    stack = [(node, 0, False) for node in reversed(roots)]
    while stack:  # post-order without recursion (a chain can be deeper than Python's stack)
        node, depth, done = stack.pop()
        kids = children.get(node["id"], [])
        depth_max = max(depth_max, depth)
        if not kids:
            pos[node["id"]] = (column, depth)
            column += 1
        elif done:
            pos[node["id"]] = ((pos[kids[0]["id"]][0] + pos[kids[-1]["id"]][0]) / 2, depth)
        else:
            stack.append((node, depth, True))
            stack.extend((kid, depth + 1, False) for kid in reversed(kids))
    dx = min(max(700 / max(column, 1), 3.0), 18.0)
    dy = min(max(260 / (depth_max + 1), 3.0), 16.0)
    pad = 6.0
    width, height = column * dx + 2 * pad, (depth_max + 1) * dy + 2 * pad
    radius = min(max(min(dx, dy) * 0.3, 1.5), 5.0)

    def xy(i):
        c, d = pos[i]
        return pad + (c + 0.5) * dx, pad + (d + 0.5) * dy

    edges, dots = [], []
    for parent_id, kids in children.items():
        if parent_id not in pos:
            continue
        px, py = xy(parent_id)
        cls = "eb" if len(kids) > 1 and kids[0].get("kind") != "block" else "ec"
        for kid in kids:
            cx, cy = xy(kid["id"])
            edges.append(f'<line class="{cls}" x1="{px:.1f}" y1="{py:.1f}" x2="{cx:.1f}" y2="{cy:.1f}"/>')
    for node_id in pos:
        node_x, node_y = xy(node_id)
        value = facts["values"].get(node_id)
        kind = "leaf" if node_id in facts["values"] else ("bp" if len(children.get(node_id, [])) > 1 else "in")
        style = f' style="--rh:{view.hue(value)}"' if value is not None else ""
        tip = f"#{int(node_id)}" + (f" · R {value:.3g}" if value is not None else "")
        dots.append(f'<a href="#n-{x}-{int(node_id)}" data-ref="{int(node_id)}"><circle class="{kind}" '
                    f'cx="{node_x:.1f}" cy="{node_y:.1f}" r="{radius:.1f}"{style}><title>{_esc(tip)}</title>'
                    "</circle></a>")
    return (f'<svg class="minimap" viewBox="0 0 {width:.0f} {height:.0f}" width="{width:.0f}" height="{height:.0f}" '
            f'role="img" aria-label="minimap of the tree">{"".join(edges)}{"".join(dots)}</svg>')


def _divergence(siblings: list[dict]) -> tuple[str, int]:
    """Where siblings first differ: ("action", n) when their actions share their first n characters (n may be 0),
    ("observation", n) when the actions are equal and their observations differ after n characters, ("", 0) when
    their texts are equal (they differ in being a leaf, or a segment)."""
    for field in ("action", "observation"):
        texts = [s.get(field) or "" for s in siblings]
        if len(set(texts)) > 1:
            shared = len(texts[0])
            for t in texts[1:]:
                shared = min(shared, len(t))
                for i in range(shared):
                    if t[i] != texts[0][i]:
                        shared = i
                        break
            return field, shared
    return "", 0


def _render_children(siblings: list[dict], children: dict[int, list[dict]], x: int, facts: dict,
                     view: _View) -> str:
    """Siblings side by side under a branch point (`<ul>`), each marked ↳ i/n with where its text first differs
    from theirs; a chain of single children is drawn straight down (↓)."""
    if not siblings:
        return ""
    if len(siblings) == 1:
        return _render_chain(siblings[0], children, x, facts, view, None)
    if siblings[0].get("kind") == "block":  # a search's blocks come one after the other: no siblings to compare
        items = "".join(f"<li>{_render_chain(node, children, x, facts, view, None)}</li>" for node in siblings)
        return f'<ul class="branches blocks">{items}</ul>'
    field, shared = _divergence(siblings)
    items = "".join(
        f"<li>{_render_chain(node, children, x, facts, view, (i + 1, len(siblings), field, shared))}</li>"
        for i, node in enumerate(siblings))
    return f'<ul class="branches">{items}</ul>'


def _render_chain(node: dict, children: dict[int, list[dict]], x: int, facts: dict, view: _View, sibling) -> str:
    out = []
    while True:
        kids = children.get(node["id"], [])
        out.append(_render_node(node, len(kids), x, facts, view, sibling))
        sibling = None
        if len(kids) != 1:
            if kids:
                out.append(f'<div class="sub">{_render_children(kids, children, x, facts, view)}</div>')
            return '<div class="chain">' + "".join(out) + "</div>"
        node = kids[0]


def _render_node(node: dict, num_children: int, x: int, facts: dict, view: _View, sibling=None) -> str:
    kind = node.get("kind", "turn")
    credit = node.get("credit", {})
    node_id = int(node["id"])
    classes = ["node", kind]
    value = facts["values"].get(node_id)
    outcome = facts["outcome"].get(node_id)
    if node.get("leaf") or node_id in facts["values"]:
        classes.append("leaf")
    if num_children > 1:
        classes.append("bp")
    a = credit.get("A")
    if a is not None:
        classes.append("pos" if a > 0 else "neg" if a < 0 else "zero")
    attrs = [f'class="{_esc(" ".join(classes))}"', f'data-kind="{_esc(kind)}"', f'id="n-{x}-{node_id}"',
             f'data-node="{node_id}"', f'data-parent="{int(node.get("parent", -1))}"']
    if kind == "turn":
        attrs.append(f'data-multiplicity="{int(node.get("multiplicity") or 0)}"')
        if node.get("round") is not None:
            attrs.append(f'data-round="{int(node["round"])}"')
        if node.get("partial"):
            attrs.append('data-partial="1"')
    if outcome:
        attrs.append(f'data-outcome="{outcome}"')
    dp = facts["dp"].get(node_id)
    if dp:
        attrs.append(f'data-dp="{dp[0]!r}" data-dir="{dp[1]}"')
    for key, number in credit.items():
        if number is not None:
            attrs.append(f'data-{_attribute_name(key)}="{float(number)!r}"')
    if node.get("rewards"):
        attrs.append(f'data-rewards="{_esc(json.dumps(node["rewards"]))}"')
    style = []
    if a is not None:
        style.append(f"--s:{min(abs(a), 2.0) / 2.0:.3f}")
    if value is not None:
        style.append(f"--rh:{view.hue(value)}")
    style_attr = f' style="{";".join(style)}"' if style else ""
    head = []
    if sibling is not None:
        i, n, _, _ = sibling
        head.append(f'<span class="badge sib" title="one of the {n} siblings after a branch point">↳ {i}/{n}</span>')
    head.append(f'<span class="nid">{_esc(node.get("label") or "#" + str(node_id))}</span>')
    head += _badges(node, num_children)
    if outcome:
        head.append(f'<span class="badge out {outcome}">{outcome}</span>')
    head += _chips(credit, view.backup, dp)
    body, inline = [], None
    if sibling is not None and sibling[2]:
        _, _, field, shared = sibling
        head.append(f'<span class="badge dv" title="where this sibling\'s {field} first differs from its siblings\'">'
                    f"{field} differs after {shared} chars</span>")
        text = node.get(field) or ""
        if field == "action" and _cut_at(text, SHOWN_CHARS, view)[1] <= SHOWN_CHARS:
            inline = shared  # short: the action itself shows the shared start dimmed and the rest marked
        else:
            body.append(_divergence_note(node, sibling, view))
    if kind == "block":
        body.append(f'<div class="ctx"><span class="lbl">context ({int(node.get("context_tokens") or 0)} tokens)'
                    f"</span>{_folded(node.get('context', ''), 'ctxtext', view)}</div>")
    if node.get("action") and inline is not None:
        action = node["action"]
        body.append(f'<pre class="action diverging"><span class="same">{_display(action[:inline], view)}</span>'
                    f"<mark>{_display(action[inline:], view)}</mark></pre>")
    elif node.get("action"):
        body.append(_folded(node["action"], "action", view))
    if node.get("observation"):
        obs_tokens = node.get("observation_tokens")
        body.append(f'<div class="obs"><span class="lbl">observation'
                    f'{f" ({_tokens(obs_tokens)})" if obs_tokens else ""}</span>'
                    f'{_folded(node["observation"], "obstext", view, SHOWN_CHARS // 2)}</div>')
    fold = ('<button type="button" class="fold" title="fold or unfold the subtree">▾</button>'
            if num_children > 1 else "")
    return (f'<div {" ".join(attrs)}{style_attr}><div class="head">{fold}{"".join(head)}</div>'
            f'{"".join(body)}</div>')


def _divergence_note(node: dict, sibling, view: _View) -> str:
    """The sibling's text from where it first differs from its siblings' (the shared start dimmed, cut)."""
    _, n, field, shared = sibling
    text = node.get(field) or ""
    where = "its action" if field == "action" else "the same action; its observation"
    if shared == 0:
        what = f"{where} differs from the first character"
    else:
        what = f"{where} shares its first {shared} characters with its siblings', then"
    before = text[max(0, shared - 24):shared]
    after = text[shared:shared + 80]
    return (f'<div class="diverge"><span class="lbl">↳ {_esc(what)}</span><pre>'
            f'{"…" if shared > 24 else ""}<span class="same">{_display(before, view)}</span>'
            f'<mark>{_display(after, view) or "(ends here)"}</mark>{"…" if len(text) > shared + 80 else ""}'
            "</pre></div>")


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
    if node.get("tool_failures"):
        badges.append(f'<span class="badge warn" title="tool calls of this turn that failed or could not be parsed">'
                      f'{int(node["tool_failures"])} of {int(node.get("tool_calls") or 0)} calls failed</span>')
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


_DIR_MARK = {"toward": "↑ toward q", "away": "↓ away from q", "unchanged": "= unchanged"}


def _chips(credit: dict, backup: bool, dp: tuple[float, str] | None) -> list[str]:
    chips = []
    if "A" in credit:
        chips.append(f'<span class="chip a">{"V" if backup else "A"} {_fmt(credit["A"])}</span>')
    if "q" in credit:
        chips.append(f'<span class="chip q">q {_fmt_p(credit["q"])}</span>')
        if credit.get("p_after") is not None and dp is not None:
            chips.append(f'<span class="chip p">p ½→{_fmt_p_after(credit["p_after"])}</span>')
            chips.append(f'<span class="chip dir {dp[1]}" title="Δp = p − ½ after the update; toward q: p ended '
                         f'closer to q than ½ was">Δp {_fmt_dp(dp[0])} {_DIR_MARK[dp[1]]}</span>')
    if "logp_old" in credit:
        new = f'→{_fmt(credit["logp_new"], 2)}' if "logp_new" in credit else ""
        chips.append(f'<span class="chip lp" title="mean log-probability of the action\'s tokens: under π_old'
                     f'{" → after the update" if new else ""}">log π {_fmt(credit["logp_old"], 2)}{new}</span>')
    return chips


def _cut_at(text: str, shown: int, view: _View) -> tuple[int, int]:
    """(where to cut `text` so that `shown` visible characters come before, the visible length): template tokens
    do not count, and no token is cut in two."""
    visible, pos, cut = 0, 0, None
    for m in view.template.finditer(text):
        segment = m.start() - pos
        if cut is None and visible + segment >= shown:
            cut = pos + (shown - visible)
        visible += segment
        pos = m.end()
    if cut is None and visible + len(text) - pos >= shown:
        cut = pos + (shown - visible)
    visible += len(text) - pos
    return (len(text) if cut is None else cut), visible


def _folded(text: str, cls: str, view: _View, shown: int = SHOWN_CHARS) -> str:
    """A text, folded behind its start when it is long (native `<details>`: no script needed)."""
    cut, visible = _cut_at(text, shown, view)
    if visible <= shown:
        return f'<pre class="{cls}">{_display(text, view)}</pre>'
    return (f'<details class="{cls}"><summary><pre class="peek">{_display(text[:cut], view)}…</pre><span class="more">'
            f'▸ {len(text) - cut} more characters</span><span class="less">▴ fold</span></summary>'
            f"<pre>{_display(text, view)}</pre></details>")


def _display(text: str, view: _View) -> str:
    """Escaped text for a `<pre>`, with the chat template's tokens in hidden spans (`.tpl`, shown by the page's
    switch) and a role header after one (`<|im_start|>user⏎`) as a small label."""
    out, pos = [], 0
    for m in view.template.finditer(text):
        out.append(_text(text[pos:m.start()]))
        hidden, pos = m.group(), m.end()
        role = _ROLE.match(text, pos)
        if role and (text.startswith("\n", role.end()) or view.template.match(text, role.end())):
            newline = "\n" if text.startswith("\n", role.end()) else ""
            out.append(f'<span class="tpl">{_esc(hidden)}</span><span class="role">{_esc(role.group())}</span>'
                       f'<span class="tpl">{newline}</span>')
            pos = role.end() + len(newline)
            continue
        if text.startswith("\n", pos):  # the template's own line break after the token
            hidden, pos = hidden + "\n", pos + 1
        out.append(f'<span class="tpl">{_esc(hidden)}</span>')
    out.append(_text(text[pos:]))
    return "".join(out)


_NEWLINES = re.compile(r"\n{3,}")


def _text(text: str) -> str:
    """Escaped text for a `<pre>`, a run of 3+ newlines drawn as one marked line (a model's empty lines would
    otherwise stretch the node)."""
    return _NEWLINES.sub(lambda m: f'\n<span class="nl">⏎×{len(m.group())}</span>\n', _esc(text))


def _esc(text) -> str:
    return html.escape(clean_text(str(text)), quote=True)


def _fmt(value, digits: int = 3) -> str:
    return "–" if value is None else f"{value:+.{digits}f}"


def _fmt_p(value) -> str:
    return "–" if value is None else f"{value:.3f}"


# Every field the page renders, by type: the renderer may then format numbers with int()/`:.2f` and put texts through
# `_esc`, whatever a hand-edited file holds (a text where a number goes would otherwise reach the HTML unescaped, or
# stop the rendering with a bare TypeError).
_PAGE_TEXTS = ("method", "mode", "credit", "after_note")
_RECORD_INTS = ("prompt_tokens", "num_leaves", "num_turns")
_RECORD_TEXTS = ("kind", "prompt", "question", "gold", "gold_column")
_NODE_INTS = ("id", "parent", "tokens", "observation_tokens", "context_tokens", "multiplicity", "turn_offset", "round",
              "tool_calls", "tool_failures")
_NODE_FLOATS = ("entropy", "penalty")
_NODE_FLOAT_LISTS = ("rewards", "leaf_advantages")
_NODE_TEXTS = ("kind", "label", "action", "observation", "context")


def _shown(value) -> str:
    text = repr(value)
    return text if len(text) <= 80 else text[:80] + "…"


def _as_number(value, where: str, convert):
    """`convert(value)`, None for None; a saved field that is no number is a damaged or edited file."""
    if value is None:
        return None
    try:
        return convert(value)
    except (TypeError, ValueError, OverflowError):
        raise ValueError(f"{where} must be a number, got {_shown(value)}: the file was edited or is damaged; "
                         "render the data the run saved.") from None


def _as_int(value, where: str) -> int | None:
    return _as_number(value, where, int)


def _as_float(value, where: str) -> float | None:
    return _as_number(value, where, _number)


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
    data["special_tokens"] = [str(t)[:60] for t in _as_list(data.get("special_tokens"), "special_tokens")[:200]]
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



# The page must read in a tracker's frame too: Trackio shows an HTML value in a 420-pixel-high frame at least 360 wide
# (its media grid), W&B in a panel about as small. Below 760 pixels of width the prompt list goes above the tree, and
# the legend stays folded unless the window is large (the script opens it there).
_CSS = """
:root{--bg:#fafafa;--fg:#1d1d1f;--mut:#6b6b70;--line:#c8c8cc;--card:#fff;--pos:22,140,60;--neg:200,40,40;
--br:#3b6fd8}
*{box-sizing:border-box}body{margin:0;font:13px/1.4 system-ui,-apple-system,"Segoe UI",sans-serif;background:var(--bg);
color:var(--fg)}header{padding:8px 16px 6px;border-bottom:1px solid var(--line);background:#fff}
h1{font-size:16px;margin:0}h2{font-size:15px;margin:4px 0 6px}.kind{color:var(--mut);font-weight:normal;font-size:12px}
.titlebar{display:flex;flex-wrap:wrap;align-items:baseline;gap:6px 16px}.steps{display:flex;gap:8px;font-size:12px}
.steplink{color:var(--br);text-decoration:none;border:1px solid var(--line);border-radius:4px;padding:1px 7px;
background:#fff}.steplink.off{color:var(--mut);border-style:dashed}
.summary{margin:3px 0;font-size:12px;color:var(--mut)}.summary b{font-weight:600}
.legend{margin:2px 0;color:var(--mut);font-size:12px}.legend summary{cursor:pointer;color:var(--br);list-style:revert}
.legend ul{margin:3px 0;padding-left:18px;columns:2 420px;column-gap:28px}.legend li{margin:1px 0}
.scale{display:inline-block;width:60px;height:9px;vertical-align:middle;border-radius:2px;
background:linear-gradient(90deg,hsl(0 70% 50%),hsl(60 70% 50%),hsl(120 60% 40%))}
.cutnote{background:#fff4d6;border:1px solid #e6c35c;padding:6px 10px;border-radius:4px}
.main{display:flex;align-items:flex-start}
nav.prompts{position:sticky;top:0;width:270px;flex:none;max-height:100vh;overflow:auto;padding:8px;border-right:1px solid
var(--line)}.navtitle{color:var(--mut);font-size:11px;text-transform:uppercase;margin:6px 0 4px}
.tools{display:none;font-size:12px;color:var(--mut)}body.js .tools{display:block}
.tools input[type=search]{width:100%;font:inherit;padding:3px 6px;margin:0 0 3px;border:1px solid var(--line);
border-radius:4px}.tools label{white-space:nowrap;margin-right:6px;cursor:pointer}
.navbtn{display:block;width:100%;text-align:left;border:1px solid var(--line);background:#fff;border-radius:4px;
padding:5px 7px;margin:0 0 5px;cursor:pointer;font:inherit;overflow-wrap:anywhere}
.navbtn.active{border-color:var(--br);background:#eef3ff}.navbtn.hidden{display:none}
.navbtn .num{font-weight:600}.navbtn .q{display:block}.navbtn .gold{display:block;font-size:11px;color:#6a4c00}
.navbtn .sub{display:block;color:var(--mut);font-size:11px}
.flag{border-radius:8px;padding:0 5px;border:1px solid var(--line)}.flag.warn{background:#fde8e8;border-color:#e9a0a0}
.flag.dp{background:#eef3ff}
.strip{display:inline-flex;gap:1px;vertical-align:middle}.strip i{display:inline-block;width:6px;height:10px;
border-radius:1px;background:hsl(var(--rh) 65% 45%)}
main{flex:1;min-width:0;padding:6px 16px;overflow:auto}
body.js section.prompt{display:none}body.js section.prompt.active{display:block}
section.prompt{margin-bottom:24px}.prompttext summary{cursor:pointer;color:var(--mut);list-style:revert}
.qtext{font-weight:600}.facts{display:grid;grid-template-columns:max-content 1fr;gap:2px 10px;margin:0 0 6px;
font-size:12px}.fact{display:contents}.fact .lbl{display:block;padding-top:2px}.goldtext{color:#6a4c00}
.rv{border-radius:8px;padding:0 5px;background:hsl(var(--rh) 70% 92%);border:1px solid hsl(var(--rh) 50% 60%)}
.snip{color:var(--mut);font-family:ui-monospace,"DejaVu Sans Mono",monospace}
b.toward{color:#17693a}b.away{color:#b02a2a}b.unchanged{color:var(--mut)}b.warn{color:#b02a2a}
.leafnav{display:none;position:sticky;top:0;z-index:2;background:var(--bg);padding:4px 0;gap:6px;align-items:center;
flex-wrap:wrap;font-size:12px}body.js .leafnav{display:flex}
.leafnav button{font:inherit;border:1px solid var(--line);background:#fff;border-radius:4px;padding:2px 8px;
cursor:pointer}#next-rewarded{border-color:hsl(120 45% 55%)}#next-failed{border-color:hsl(0 55% 65%)}
.tpltoggle{margin-left:auto;color:var(--mut);cursor:pointer}
.minimap{display:block;max-width:100%;height:auto;margin:4px 0 8px;background:#fff;border:1px solid var(--line);
border-radius:4px}.minimap line{stroke:#b8b8bd;stroke-width:1.2}.minimap line.eb{stroke:#8fb0ee;stroke-width:1.4}
.minimap circle{fill:#9a9aa0;stroke:#fff;stroke-width:.6;cursor:pointer}.minimap circle.bp{fill:var(--br)}
.minimap circle.leaf{fill:hsl(var(--rh,0) 65% 45%)}.minimap circle.onpath{stroke:#111;stroke-width:1.8}
pre{margin:0;white-space:pre-wrap;word-break:break-word;font:12px/1.35 ui-monospace,"DejaVu Sans Mono",monospace}
.chain{display:flex;flex-direction:column;align-items:flex-start}
.chain>.node:not(:first-child){margin-top:14px;position:relative}
.chain>.node:not(:first-child)::before{content:"↓";position:absolute;left:9px;top:-15px;height:14px;font-size:11px;
line-height:14px;color:#8a8a90}
ul.branches{list-style:none;margin:10px 0 0;padding:0 0 0 14px;border-left:2px solid #9db8ef}
ul.branches.blocks{border-left-color:var(--line)}ul.branches.blocks>li::before{border-top-color:var(--line)}
ul.branches>li{position:relative;padding:0 0 10px 14px}
ul.branches>li::before{content:"";position:absolute;left:-14px;top:14px;width:26px;border-top:2px solid #9db8ef}
.sub.folded{display:none}
.node{background:var(--card);border:1px solid var(--line);border-left:5px solid #aaa;border-radius:5px;
padding:5px 8px;max-width:760px;min-width:260px;cursor:default}
.node.pos{border-left-color:rgba(var(--pos),calc(.25 + .75*var(--s,0)))}
.node.neg{border-left-color:rgba(var(--neg),calc(.25 + .75*var(--s,0)))}
.node.bp{border-bottom:2px solid #9db8ef}
.node.leaf{background:hsl(var(--rh,0) 60% 96%);box-shadow:inset 0 -3px 0 hsl(var(--rh,0) 55% 50%)}
.node.search{background:#f2effc;border-left-color:#7c5cd6}.node.block{background:#f3f6f8;border-left-color:#5a8fb0}
.node.onpath{outline:2px solid #111;outline-offset:1px}.node.picked{outline:3px solid var(--br)}
.head{display:flex;flex-wrap:wrap;gap:4px;align-items:center;margin-bottom:3px}.nid{font-weight:600;margin-right:2px}
.badge,.chip{font-size:11px;border-radius:10px;padding:0 6px;border:1px solid var(--line);white-space:nowrap}
.badge.tok,.badge.ent{color:var(--mut)}.badge.branch{background:#e8f0ff;border-color:#9db8ef}
.badge.sib{background:var(--br);border-color:var(--br);color:#fff;font-weight:600}
.badge.cut{background:#fff0e6;border-color:#f0b07a}.badge.round{background:#eef9f0;border-color:#93cf9f}
.badge.warn{background:#fde8e8;border-color:#e9a0a0}.badge.mult{background:#f1ebff;border-color:#b7a2ef;font-weight:600}
.badge.reward{background:#fff6d5;border-color:#e3c560;font-weight:600}
.badge.out.rewarded{background:hsl(120 45% 90%);border-color:hsl(120 35% 60%)}
.badge.out.failed{background:hsl(0 60% 93%);border-color:hsl(0 50% 70%)}
.chip{font-family:ui-monospace,"DejaVu Sans Mono",monospace}.chip.a{font-weight:600}
.node.pos .chip.a{background:rgba(var(--pos),.12)}.node.neg .chip.a{background:rgba(var(--neg),.12)}
.chip.q{background:#eef3ff}.chip.p{background:#f4f4f4}.chip.dir.toward{background:#e3f4e8;border-color:#8cc79d}
.chip.dir.away{background:#fbe4e4;border-color:#e2a0a0}.chip.dir.unchanged{color:var(--mut)}
.action{color:var(--fg)}.obs{margin-top:3px;color:var(--mut)}.lbl{font-size:10px;text-transform:uppercase;
color:var(--mut);display:block}.ctx{color:var(--mut);margin-bottom:3px}
.diverge{margin:0 0 4px;padding:2px 5px;border-left:2px solid #9db8ef;background:#f5f8ff}
.diverge .same,.diverging .same{color:var(--mut)}.diverge mark,.diverging mark{background:#fff1a8}
.badge.dv{background:#f5f8ff;border-color:#9db8ef;color:#2c55a8}
.tpl{display:none}body.showtpl .tpl{display:inline;color:#a0a0a6}
.role{font-size:10px;text-transform:uppercase;background:#ececef;color:var(--mut);border-radius:3px;padding:0 4px;
margin:0 2px 0 0}body.showtpl .role{font-size:inherit;text-transform:none;background:none;padding:0;margin:0}
details>summary{cursor:pointer;list-style:none}details>summary::-webkit-details-marker{display:none}
.legend>summary::-webkit-details-marker,.prompttext>summary::-webkit-details-marker{display:revert}
details[open] .peek,details[open] .more,details:not([open]) .less{display:none}
.more,.less{font-size:11px;color:var(--br)}.nl{color:var(--mut);font-size:10px}.mut{color:var(--mut)}
.fold{border:none;background:none;cursor:pointer;padding:0 2px;font-size:12px;color:var(--mut)}
table.index{border-collapse:collapse;width:100%;font-size:12px}table.index th,table.index td{text-align:left;
vertical-align:top;padding:3px 6px;border-bottom:1px solid #e4e4e8}tr.stephead th{background:#eef1f6;padding-top:8px}
tr.row.hidden{display:none}.qcell{max-width:520px}.indexpage main{padding:8px 16px}
@media (max-width:760px){.main{display:block}nav.prompts{position:static;width:auto;max-height:none;
border-right:none;border-bottom:1px solid var(--line);padding:4px 8px}.navtitle{display:none}
.navlist{display:flex;gap:5px;overflow-x:auto}.navlist .navbtn{flex:none;width:230px;margin:0}
.node{min-width:0}main{padding:4px 8px}header{padding:6px 8px}h1{font-size:14px}}
@media (max-width:480px){.facts{grid-template-columns:1fr}}
@media (max-height:520px){.summary{margin:1px 0}.tools input[type=search]{margin:0}}
"""

# Reads only the page's own attributes and text; sets classes, `open`, `hidden` and `textContent`; builds no HTML.
_JS = """
(function(){
  var body=document.body; body.classList.remove('nojs'); body.classList.add('js');
  function all(sel, root){return Array.prototype.slice.call((root||document).querySelectorAll(sel));}
  var buttons=all('.navbtn'), sections=all('section.prompt'), rows=all('tr.row'), current=null;
  function show(id){
    current=id;
    sections.forEach(function(s){s.classList.toggle('active', s.id===id);});
    buttons.forEach(function(b){b.classList.toggle('active', b.getAttribute('data-target')===id);});
  }
  buttons.forEach(function(b){b.addEventListener('click', function(){show(b.getAttribute('data-target'));});});
  all('.fold').forEach(function(f){f.addEventListener('click', function(e){
    e.stopPropagation();
    var s=f.closest('.node').nextElementSibling; if(!s||!s.classList.contains('sub')) return;
    s.classList.toggle('folded'); f.textContent=s.classList.contains('folded')?'▸':'▾';});});
  function nodeIn(sec, id){return sec.querySelector('.node[data-node="'+String(parseInt(id,10))+'"]');}
  function highlight(node){
    all('.onpath').forEach(function(n){n.classList.remove('onpath');});
    all('.picked').forEach(function(n){n.classList.remove('picked');});
    var sec=node.closest('section.prompt'), cur=node, ids={};
    node.classList.add('picked');
    while(cur){
      cur.classList.add('onpath'); ids[cur.getAttribute('data-node')]=1;
      var sub=cur.parentElement&&cur.parentElement.closest('.sub.folded');
      while(sub){sub.classList.remove('folded'); sub=sub.parentElement&&sub.parentElement.closest('.sub.folded');}
      var p=cur.getAttribute('data-parent'); if(p===null||p==='-1') break;
      cur=nodeIn(sec, p);
    }
    if(sec){all('.minimap [data-ref]', sec).forEach(function(a){
      var c=a.firstElementChild; if(c) c.classList.toggle('onpath', !!ids[a.getAttribute('data-ref')]);});}
  }
  function go(node){
    var sec=node.closest('section.prompt'); if(sec&&sec.id!==current) show(sec.id);
    highlight(node); node.scrollIntoView({block:'center'});
  }
  all('.node').forEach(function(n){n.addEventListener('click', function(e){
    if(e.target.closest('button, a')) return; highlight(n);});});
  all('[data-ref]').forEach(function(a){a.addEventListener('click', function(e){
    var sec=a.closest('section.prompt'); var n=sec&&nodeIn(sec, a.getAttribute('data-ref'));
    if(n){e.preventDefault(); go(n);}});});
  var pos=document.getElementById('leafpos');
  function visible(s){var b=buttons[sections.indexOf(s)]; return !b||!b.classList.contains('hidden');}
  function step(kind){
    var list=[]; sections.forEach(function(s){if(visible(s)) list=list.concat(all('.node[data-outcome="'+kind+'"]', s));});
    if(!list.length){ if(pos) pos.textContent='no '+kind+' leaf'+(buttons.length>1?' in the prompts shown':''); return; }
    var picked=document.querySelector('.node.picked'), at=list.indexOf(picked), i=0;
    if(at>=0){ i=(at+1)%list.length; }
    else { var sec=current&&document.getElementById(current);
      for(var j=0;j<list.length;j++){ if(list[j].closest('section.prompt')===sec){ i=j; break; } } }
    go(list[i]);
    if(pos) pos.textContent=kind+' leaf '+(i+1)+' of '+list.length;
  }
  ['rewarded','failed'].forEach(function(kind){var b=document.getElementById('next-'+kind);
    if(b) b.addEventListener('click', function(){step(kind);});});
  var search=document.getElementById('search'), fm=document.getElementById('f-mixed'),
      ff=document.getElementById('f-failed'), count=document.getElementById('shown-count');
  var items=buttons.length?buttons:rows, texts=(buttons.length?sections:rows).map(function(s){
    return s.textContent.toLowerCase();});
  function apply(){
    var q=search?search.value.trim().toLowerCase():'', n=0, first=null;
    items.forEach(function(b, i){
      var ok=(!fm||!fm.checked||b.getAttribute('data-mixed')==='1')&&(!ff||!ff.checked||b.getAttribute('data-failed')==='1')
        &&(!q||texts[i].indexOf(q)>=0);
      b.classList.toggle('hidden', !ok); if(ok){n++; if(first===null) first=b;}
    });
    if(count) count.textContent=n+' of '+items.length+(buttons.length?' prompts':' rows');
    if(buttons.length&&first&&document.querySelector('.navbtn.active.hidden')) show(first.getAttribute('data-target'));
  }
  [search, fm, ff].forEach(function(el){if(el) el.addEventListener('input', apply);});
  [fm, ff].forEach(function(el){if(el) el.addEventListener('change', apply);});
  var tpl=document.getElementById('show-tpl');
  if(tpl) tpl.addEventListener('change', function(){body.classList.toggle('showtpl', tpl.checked);});
  var legend=document.querySelector('details.legend');
  if(legend&&window.innerHeight>=800&&window.innerWidth>=1000) legend.open=true;
  function fromHash(){
    var h=location.hash.slice(1), m=/^n-(\\d+)-(\\d+)$/.exec(h);
    if(/^prompt-\\d+$/.test(h)&&document.getElementById(h)) show(h);
    else if(m){var sec=document.getElementById('prompt-'+m[1]), n=sec&&nodeIn(sec, m[2]); if(n) go(n);}
  }
  window.addEventListener('hashchange', fromHash);
  if(buttons.length){show(buttons[0].getAttribute('data-target')); fromHash(); apply();}
  else if(rows.length){apply();}
  else {body.classList.remove('js');}
})();
"""
