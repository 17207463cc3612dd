"""A saved data file is untrusted (`trl-tree view` renders whatever is in it): `checked_page` turns every number of
page data into an int or float and every text into a string, and refuses a file whose numbers are not numbers,
saying where (`prompts[0].nodes[3].tokens`); `checked_index` does the same for a run's `index.json`. The renderer
may then format numbers with int()/`:.2f` and put texts through its escaping, whatever a hand-edited file holds."""

from __future__ import annotations

from .records import FORMAT
from .text import number

# Every field the page renders, by type: the renderer may then format numbers with int()/`:.2f` and put texts through
# `_esc`, whatever a hand-edited file holds (a text where a number goes would otherwise reach the HTML unescaped, or
# stop the rendering with a bare TypeError).
_PAGE_TEXTS = ("method", "mode", "credit", "credit_summary", "after_note")
_RECORD_INTS = ("prompt_tokens", "num_leaves", "num_turns")
_RECORD_OPTIONAL_INTS = ("policy_version", "staleness")  # absent in files saved before them: stay absent
_RECORD_TEXTS = ("kind", "prompt", "question", "gold", "gold_column")
_NODE_INTS = ("id", "parent", "tokens", "observation_tokens", "context_tokens", "multiplicity", "turn_offset", "round",
              "tool_calls", "tool_failures", "abandoned")
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
    return _as_number(value, where, number)


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


def checked_page(data) -> dict:
    """A copy of page data with every field the page renders of its type: numbers int or float (or None), texts str,
    lists and objects as such. Anything else is a `ValueError` that says where (`prompts[0].nodes[3].tokens`)."""
    data = dict(_as_dict(data, "the page data"))
    for key in _PAGE_TEXTS:
        if key in data:
            data[key] = str(data[key])
    data["step"] = _as_int(data.get("step", 0), "step") or 0
    for key in ("batch", "batches"):
        if key in data:
            data[key] = _as_int(data[key], key)
    data["special_tokens"] = [str(t)[:60] for t in _as_list(data.get("special_tokens"), "special_tokens")[:200]]
    if "penalties" in data and not isinstance(data["penalties"], bool):
        raise ValueError(f"penalties: expected true or false, got {_shown(data['penalties'])}")
    prompts = []
    for x, record in enumerate(_as_list(data.get("prompts"), "prompts")):
        where = f"prompts[{x}]"
        record = dict(_as_dict(record, where))
        for key in _RECORD_INTS:
            record[key] = _as_int(record.get(key), f"{where}.{key}")
        for key in _RECORD_OPTIONAL_INTS:
            if key in record:
                record[key] = _as_int(record[key], f"{where}.{key}")
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


_SUMMARY_FLOATS = ("min", "max", "mean")
_SUMMARY_INTS = ("x", "leaves", "mixed", "failures", "toward", "away", "unchanged", "undirected")


def checked_index(data) -> list[dict]:
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
                        "batch": _as_int(entry.get("batch"), "batch"), "batches": _as_int(entry.get("batches"), "batches"),
                        "prompts": prompts})
    return entries
