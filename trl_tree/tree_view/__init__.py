"""The rollout-tree view: one self-contained HTML page per generation batch, an index page per run, and the data
they are made from.

A tree trainer's behaviour is hard to read from scalars: which turn got credit, where the branches went, which
histories were merged, how far each turn's probability moved toward its teacher. The view draws each prompt's tree
with one node per unique turn, coloured by its credit's sign, whose head shows its credit and what the update did to
it (the rest on demand), then its action and the start of its observation; leaves carry their reward; the branch
points and where the siblings under one first differ are marked, and a minimap shows the whole tree. The prompt list
starts each entry with the question (not the instruction every prompt shares), the gold answer, the reward spread
and the best and worst leaf, and can be filtered (mixed rewards, failed or malformed tool calls) and
searched. `index.html` beside the pages lists every step of the run and every prompt of each.

The package, by job, so that a page can be rendered again from what a run saved (`trl-tree view OUTPUT_DIR`):

- `records.py`, the **page data**, plain JSON (`tree_record`, `flex_record`, `page_data`): texts already decoded and
  cut (`text.py`), numbers as floats. The trainer writes it to `output_dir/tree_view/step_XXXXXX.json`, one per
  generation batch (`trl_tree.trainer.observability.tree_view_logging`);
- `facts.py`, what the page derives from it (reward spread, best and worst leaf, each turn's credit sign, what the
  update did to it and in which direction), computed when a page is rendered, so older files get it too; pure Python;
- `checks.py`, saved data as untrusted input (below);
- `page.py` and `assets/` (package data: the HTML skeleton `page.html`, `view.css`, `view.js`), the **page**
  (`render_page`, `render_index`): pure string building from that data, no network, no external scripts or fonts;
  inline CSS and SVG, `<details>` for long texts, and a script to switch prompts, fold subtrees, highlight a path,
  show a turn's other numbers, step through leaves and filter the list (without JavaScript every prompt is shown,
  unfolded, with every number);
- `files.py`, the **writing**: a page's files, the run's index, `render_run` (every readable saved page again; the
  unreadable ones listed);
- `sinks.py`, the **trackers** that take the page (W&B, Trackio), one class each behind `TrackerSink`;
- `browser.py`, headless Chromium through Playwright for the browser tests and `scripts/screenshot_tree_view.py`
  (a development tool: nothing else imports it).

Every text that comes from the model, a tool or the dataset is untrusted: `clean_text` replaces control, surrogate,
bidirectional, zero-width and tag characters with visible escapes and `html.escape` escapes it, so a model that
writes `<script>` shows the tag instead of running it. A saved data file is untrusted too (`trl-tree view` renders
whatever is in it): `render_page` first turns every number of the data into an int or float and every text into a
string (`checked_page`), and refuses a file whose numbers are not numbers; the SVG minimap and every attribute are
written from those checked numbers only. The page's script reads nothing but the page's own attributes and text, and
builds no HTML (it sets classes and `textContent`). Huge trees are cut (`max_nodes`, `max_chars`) with a visible
note, so a page always opens; the JSON keeps every node.
"""

from .checks import checked_index, checked_page
from .facts import (
    CREDIT_SIGNS,
    DIRECTIONS,
    UNCHANGED_DP,
    ZERO_CREDIT,
    analyse,
    credit_sign,
    leaf_values,
    record_question,
    short_questions,
    turn_update,
)
from .files import (
    RenderedRun,
    find_pages,
    index_entries,
    load_page_data,
    page_summary,
    render_run,
    save_page,
    write_index,
)
from .page import SCRIPT, STYLE, render_index, render_page
from .records import (
    BACKUP_CREDITS,
    FORMAT,
    INDEX,
    MAX_ACTION_CHARS,
    MAX_CHARS,
    MAX_CONTEXT_CHARS,
    MAX_GOLD_CHARS,
    MAX_NODES,
    MAX_OBSERVATION_CHARS,
    MAX_PROMPT_CHARS,
    MAX_QUESTION_CHARS,
    PAGE_NAME,
    SHOWN_CHARS,
    SHOWN_CREDIT,
    VERSION,
    VIEW_DIR,
    attach_turn_probabilities,
    flex_record,
    page_data,
    tree_record,
)
from .sinks import SINKS, TRACKER_KEY, TrackerSink, log_page_to_trackers, register_sink, sinks_for
from .text import GOLD_COLUMNS, QUESTION_COLUMNS, clean_text, cut_text, gold_answer, prompt_text, question_text

__all__ = [
    "BACKUP_CREDITS", "CREDIT_SIGNS", "DIRECTIONS", "FORMAT", "GOLD_COLUMNS", "INDEX", "MAX_ACTION_CHARS", "MAX_CHARS",
    "MAX_CONTEXT_CHARS", "MAX_GOLD_CHARS", "MAX_NODES", "MAX_OBSERVATION_CHARS", "MAX_PROMPT_CHARS",
    "MAX_QUESTION_CHARS", "PAGE_NAME", "QUESTION_COLUMNS", "SCRIPT", "SHOWN_CHARS", "SHOWN_CREDIT", "SINKS", "STYLE",
    "TRACKER_KEY", "UNCHANGED_DP", "VERSION", "VIEW_DIR", "ZERO_CREDIT", "RenderedRun", "TrackerSink", "analyse",
    "attach_turn_probabilities", "checked_index", "checked_page", "clean_text", "credit_sign", "cut_text",
    "find_pages", "flex_record", "gold_answer", "index_entries", "leaf_values", "load_page_data",
    "log_page_to_trackers", "page_data", "page_summary", "prompt_text", "question_text", "record_question",
    "register_sink", "render_index", "render_page", "render_run", "save_page", "short_questions", "sinks_for",
    "tree_record", "turn_update", "write_index",
]
