"""The view's files: a page's data (`step_XXXXXX.json`) and page (`.html`) in `output_dir/tree_view/`, the run's
index (`index.json`, `index.html`), and `render_run` (what `trl-tree view RUN_DIR` does): every readable saved page
rendered again, the unreadable ones (a crashed run's half-written last file) listed instead of stopping the rest.

Files are written whole or not at all (a temporary file beside, then renamed), so a run stopped while writing leaves
the previous version, not half of the new one."""

from __future__ import annotations

import json
import os
import tempfile
from pathlib import Path

from .checks import checked_index, checked_page
from .facts import analyse, record_question
from .page import render_index, render_page
from .records import FORMAT, INDEX, MAX_CHARS, MAX_NODES, PAGE_NAME, VERSION, VIEW_DIR


def write_text(path: Path, text: str) -> None:
    """Write `text` to `path` whole: into a temporary file in the same folder, then renamed over `path`."""
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            f.write(text)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def save_page(data: dict, directory: str | Path, name: str, *, max_nodes: int = MAX_NODES,
              max_chars: int = MAX_CHARS) -> tuple[Path, Path]:
    """Write `name.json` (the data) and `name.html` (the page) into `directory`, add the page to the run's index
    (`index.json`, `index.html`) and write the page before it again, so that it links to this one; returns the
    data's and the page's paths."""
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    json_path, html_path = directory / f"{name}.json", directory / f"{name}.html"
    write_text(json_path, json.dumps(data, ensure_ascii=False))
    entries = _upsert(index_entries(directory), page_summary(data, name))
    write_index(directory, entries)
    links = _neighbours(entries, name)
    write_text(html_path, render_page(data, max_nodes=max_nodes, max_chars=max_chars, links=links))
    before = links.get("prev")
    if before and (directory / f"{before}.json").is_file():  # its "next" link now has a page to point at
        try:
            previous = load_page_data(directory / f"{before}.json")
            page = render_page(previous, max_nodes=max_nodes, max_chars=max_chars,
                               links=_neighbours(entries, before))
        except ValueError:  # a damaged earlier file keeps its page; `trl-tree view` names the problem
            pass
        else:
            write_text(directory / f"{before}.html", page)
    return json_path, html_path


def load_page_data(path: str | Path) -> dict:
    """The data of a saved page; a file that is not one is an error that names it."""
    path = Path(path)
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ValueError(f"{path}: not a readable tree-view data file ({e}).") from e
    if not isinstance(data, dict) or data.get("format") != FORMAT:
        raise ValueError(f"{path}: not tree-view data (no \"format\": \"{FORMAT}\").")
    if not isinstance(data.get("version", 0), int):
        raise ValueError(f"{path}: \"version\" must be a number, got {data['version']!r:.80}.")
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
        files = [p for p in files if PAGE_NAME.fullmatch(p.stem)]
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
            f"{folder} holds no saved page yet: a run with log_completions=True writes one after each generation "
            "batch's last optimizer step.")
    raise FileNotFoundError(
        f"No rollout-tree pages in {run_dir} (expected {run_dir / VIEW_DIR}/step_XXXXXX.json): a run saves them only "
        "with log_completions=True (`--log_completions true` on the command line, `log_completions: true` in a "
        "--config YAML, or log_completions=True in the config). Train with it, then run `trl-tree view "
        "OUTPUT_DIR` on the run's output_dir.")


class RenderedRun(list):
    """The pages `render_run` wrote (the index last), and `unreadable`: (saved file, why) for each file it could not
    render (a half-written or damaged one)."""

    def __init__(self, pages=(), unreadable=()):
        super().__init__(pages)
        self.unreadable: list[tuple[Path, str]] = list(unreadable)


def render_run(run_dir: str | Path, out_dir: str | Path | None = None, *, max_nodes: int = MAX_NODES,
               max_chars: int = MAX_CHARS) -> RenderedRun:
    """Render every readable saved page of a run again (`find_pages`: `OUTPUT_DIR/tree_view/*.json`, or that
    folder, or one `.json` file) → `.html` beside each (or in `out_dir`), each linked to the steps before and after
    it, and the run's `index.html` there (which lists the files it could not read). Returns the pages written, the
    index last; `.unreadable` holds (file, why) for each saved file that is not readable page data (a crashed run's
    half-written last file): the others are rendered all the same.

    Raises:
        FileNotFoundError: no saved tree-view data there (the run needs `log_completions=True`).
        ValueError: the one file given is no tree-view data or its numbers are not numbers (naming it), or no file
            of the folder is readable (naming each).
    """
    files = find_pages(run_dir)
    single = Path(run_dir).is_file()
    loaded, unreadable = [], []
    for path in files:
        try:
            data = load_page_data(path)
            try:
                summary = page_summary(data, path.stem)
            except ValueError as e:
                raise ValueError(f"{path}: {e}") from e
        except ValueError as e:
            if single:
                raise
            unreadable.append((path, str(e)))
            continue
        loaded.append((path, data, summary))
    if not loaded:
        raise ValueError("no saved page there is readable:\n" + "\n".join(why for _, why in unreadable))
    written = RenderedRun(unreadable=unreadable)

    def target_of(path: Path) -> Path:
        return Path(out_dir) if out_dir is not None else path.parent

    for target in sorted({target_of(path) for path, _, _ in loaded}):
        here = [item for item in loaded if target_of(item[0]) == target]
        target.mkdir(parents=True, exist_ok=True)
        if single:  # one page again: its neighbours are those of its run's index, when it renders in place
            entries = _upsert(index_entries(target) if out_dir is None else [], here[0][2])
        else:
            entries = sorted((summary for _, _, summary in here), key=_order)
        for path, data, _ in here:
            page = target / (path.stem + ".html")
            write_text(page, render_page(data, max_nodes=max_nodes, max_chars=max_chars,
                                         links=_neighbours(entries, path.stem)))
            written.append(page)
        missing = [(p, why) for p, why in unreadable if target_of(p) == target]
        written.append(write_index(target, entries, unreadable=missing))
    return written


# ------------------------------------------------------------------------------------------------------ the index


def page_summary(data: dict, name: str) -> dict:
    """What the run's index shows of one page: its step and generation batch, and per prompt the question, gold
    answer, reward spread, failed tool calls and the turns' update directions (`facts.turn_update`). Raises
    `ValueError` as `render_page` does."""
    data = checked_page(data)
    prompts = []
    for x, record in enumerate(data["prompts"]):
        facts = analyse(record)
        prompts.append({
            "x": x, "question": record_question(record)[:300], "gold": (record.get("gold") or "")[:200],
            "min": facts["min"], "max": facts["max"], "mean": facts["mean"], "leaves": record.get("num_leaves") or 0,
            "mixed": int(facts["mixed"]), "failures": facts["failures"], **facts["dp_counts"],
        })
    return {"name": str(name), "step": data["step"], "mode": data.get("mode", "train"),
            "method": data.get("method", ""), "batch": data.get("batch"), "batches": data.get("batches"),
            "prompts": prompts}


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
            if 0 <= j < len(entries) and PAGE_NAME.fullmatch(names[j]):
                links[key] = names[j]
                links[f"{key}_label"] = f"{entries[j]['mode']} step {entries[j]['step']}"
    return links


def index_entries(directory: Path) -> list[dict]:
    """The index's entries: from `index.json`, or, when it is missing or damaged, from the saved pages (each read
    once; a damaged page is left out)."""
    try:
        return sorted(checked_index(json.loads((directory / f"{INDEX}.json").read_text(encoding="utf-8"))),
                      key=_order)
    except (OSError, ValueError):
        pass
    entries = []
    for path in _page_files(directory, any_name=True):
        try:
            entries.append(page_summary(load_page_data(path), path.stem))
        except ValueError:
            continue
    return sorted(entries, key=_order)


def write_index(directory: str | Path, entries: list[dict], *, unreadable=()) -> Path:
    """Write the run's `index.json` (the entries) and `index.html` (`render_index`, listing the `unreadable` saved
    files); returns the page's path."""
    directory = Path(directory)
    write_text(directory / f"{INDEX}.json",
               json.dumps({"format": f"{FORMAT}/index", "version": VERSION, "pages": entries}, ensure_ascii=False))
    page = directory / f"{INDEX}.html"
    write_text(page, render_index(entries, unreadable=[(Path(p).name, why) for p, why in unreadable]))
    return page
