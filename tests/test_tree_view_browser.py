"""The rollout-tree pages in a real browser (issue 39): headless Chromium (the system's, /usr/bin/chromium) driven by
Playwright does what a reader does. The index lists the steps and its rows open their prompt; clicking a prompt
shows its tree; "next rewarded leaf" goes to one; the search box filters the list; a click on a node highlights its
path (in the minimap too) and shows its other numbers; the key's colours and counts are the nodes' own; a page of
2,000 leaves loads within seconds; tampered text shows as text and runs nothing.

The run folder is built without training, from hand-built trees (`tree_record`, `save_page`), so the module takes
seconds. A missing Playwright or Chromium fails the tests (the README's test command installs both): it never skips.
"""

import json
import time

import pytest
import torch

from trl_tree import RolloutTree, Turn
from trl_tree import tree_view as tv
from trl_tree.tree_view.browser import open_browser

LOAD_BOUND_S = 15.0  # a 2,000-leaf page loads in ~1-2 s here; generous, the machine is shared and noisy
HOSTILE = '</script><script>window.__pwned=1</script><img src=x onerror="window.__pwned=2">'

TEXTS = ["<tool_call>search(A)</tool_call>", "<answer>yes</answer>", "<answer>no</answer>", "<answer>maybe</answer>",
         "<tool_call>search(Louvre)</tool_call>", "<answer>Paris</answer>", "<answer>Rome</answer>",
         f"<tool_call>{HOSTILE}</tool_call>", f"<answer>{HOSTILE}</answer>", "a search result", HOSTILE]
OBS, HOSTILE_OBS = 9, 10


def _decode(ids):
    return "".join(TEXTS[i] for i in ids)


def _tree(paths, rewards, observation=OBS):
    def turn(i, last):
        return Turn([i], [0.0], [] if last else [observation])

    return RolloutTree.from_trajectories([0], [[turn(i, j == len(p) - 1) for j, i in enumerate(p)] for p in paths],
                                         rewards)


def _treeopsd(tree, question, gold, *, seed=0, turn_tools=None):
    """A TreeOPSD-like record: credit A from the rewards, q = ½ + A/6, p after the update moved toward q mostly."""
    g = torch.Generator().manual_seed(seed)
    n = tree.num_turns
    a = torch.zeros(n, dtype=torch.float64)
    rewards = torch.tensor(tree.rewards, dtype=torch.float64)
    if rewards.std() > 0:
        adv = (rewards - rewards.mean()) / rewards.std()
        for i in range(n):
            below = [k for k, path in enumerate(tree.paths) if i in path]
            a[i] = adv[below].mean()
    q = 0.5 + a / 6
    record = tv.tree_record(tree, {"A": a, "q": q}, _decode, [{"role": "user", "content": f"Question: {question}"}],
                            row={"answer": gold}, turn_tools=turn_tools)
    drift = (torch.rand(n, generator=g, dtype=torch.float64) - 0.3) * 2e-3
    p = (0.5 + (q - 0.5) * 0.05 + drift * (q != 0.5)).tolist()
    logp = (-torch.rand(n, generator=g, dtype=torch.float64)).tolist()
    tv.attach_turn_probabilities(record, logp, [x + 0.01 for x in logp], p)
    return record


def _records_step1():
    mixed = _tree([[0, 1], [0, 2], [0, 3]], [1.0, 0.0, 0.0])
    tools = [([1, 0], [0, 0]), ([1, 1], [0, 1]), ([1, 0], [0, 0])]  # per trajectory and turn: calls, failed
    louvre = _tree([[4, 5], [4, 6], [4, 6]], [0.0, 0.0, 0.0])  # all equal: zero credit, undirected turns (3: ×2)
    hostile = _tree([[7, 8], [7, 1]], [0.0, 1.0], observation=HOSTILE_OBS)
    return [_treeopsd(mixed, "Is A older than B?", "yes", turn_tools=tools),
            _treeopsd(louvre, "Where is the Louvre?", "Paris", seed=1),
            _treeopsd(hostile, f"What does {HOSTILE} do?", HOSTILE, seed=2)]


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory):
    folder = tmp_path_factory.mktemp("browser_run") / "tree_view"
    tv.save_page(tv.page_data(_records_step1(), step=1, method="TreeOPSD", credit="likelihood", batch=1), folder,
                 "step_000001")
    second = _treeopsd(_tree([[0, 1], [0, 2]], [0.0, 1.0]), "Is B older than C?", "no", seed=3)
    tv.save_page(tv.page_data([second], step=2, method="TreeOPSD", credit="likelihood", batch=2), folder,
                 "step_000002")
    return folder


@pytest.fixture(scope="module")
def browser():
    with open_browser() as context:  # fails (never skips) without Playwright or Chromium, saying how to install
        yield context


@pytest.fixture
def page(browser):
    page = browser.new_page()
    page.dialogs = []
    page.on("dialog", lambda d: (page.dialogs.append(d.message), d.dismiss()))
    yield page
    page.close()


def _open(page, path, anchor=""):
    page.goto(path.resolve().as_uri() + anchor)
    page.wait_for_selector("body.js")  # the page's script ran
    return page


def _visible_sections(page):
    return page.eval_on_selector_all("section.prompt", "els => els.filter(e => e.offsetParent !== null).map(e => e.id)")


def test_the_index_lists_every_step_and_a_row_opens_its_prompt(page, run_dir):
    _open(page, run_dir / "index.html")
    heads = page.locator("tr.stephead").all_inner_texts()
    assert [h.split(" ·")[0] for h in heads] == ["train step 1", "train step 2"]
    assert "generation batch 2" in heads[1]
    assert page.locator("tr.row").count() == 4
    assert "One page per generation batch" in page.locator("header .summary").inner_text()
    page.locator('tr.row a[href="step_000001.html#prompt-1"]').click()
    page.wait_for_url("**/step_000001.html#prompt-1")
    page.wait_for_selector("body.js")
    assert _visible_sections(page) == ["prompt-1"]
    assert "Where is the Louvre?" in page.locator("section#prompt-1 h2").inner_text()


def test_clicking_a_prompt_shows_its_tree_and_only_its_tree(page, run_dir):
    _open(page, run_dir / "step_000001.html")
    assert _visible_sections(page) == ["prompt-0"]
    page.locator(".navbtn").nth(1).click()
    assert _visible_sections(page) == ["prompt-1"]
    assert page.locator(".navbtn.active").get_attribute("data-target") == "prompt-1"
    nodes = page.locator("section#prompt-1 .node")
    assert nodes.count() == 3 and all(nodes.nth(i).is_visible() for i in range(3))
    assert page.locator("section#prompt-0 .node").first.is_hidden()


def test_next_rewarded_leaf_goes_to_a_rewarded_leaf(page, run_dir):
    _open(page, run_dir / "step_000001.html")
    page.locator(".navbtn").nth(1).click()  # a prompt without a rewarded leaf: the button goes to another prompt's
    page.locator("#next-rewarded").click()
    picked = page.locator(".node.picked")
    assert picked.count() == 1 and picked.get_attribute("data-outcome") == "rewarded"
    assert picked.is_visible() and picked.bounding_box()["y"] >= 0  # scrolled into view
    assert page.locator("#leafpos").inner_text() == "rewarded leaf 1 of 2"
    page.locator("#next-rewarded").click()
    assert page.locator("#leafpos").inner_text() == "rewarded leaf 2 of 2"
    assert page.locator(".node.picked").get_attribute("data-outcome") == "rewarded"


def test_the_search_box_filters_the_prompt_list(page, run_dir):
    _open(page, run_dir / "step_000001.html")
    page.locator("#search").fill("louvre")
    shown = page.eval_on_selector_all(".navbtn", "els => els.filter(e => e.offsetParent !== null).length")
    assert shown == 1 and page.locator("#shown-count").inner_text() == "1 of 3 prompts"
    assert _visible_sections(page) == ["prompt-1"]  # the shown prompt follows the filter
    page.locator("#search").fill("")
    page.locator("#f-failed").check()
    assert page.locator("#shown-count").inner_text() == "1 of 3 prompts"
    page.locator("#f-failed").uncheck()
    page.locator("#f-mixed").check()
    assert page.locator("#shown-count").inner_text() == "2 of 3 prompts"


def test_clicking_a_node_highlights_its_path_and_shows_its_other_numbers(page, run_dir):
    _open(page, run_dir / "step_000001.html")
    leaf = page.locator('section#prompt-0 .node[data-outcome="failed"]').first
    assert leaf.locator(".extra").is_hidden()  # the other numbers are on demand
    leaf.locator(".head").click()
    path = page.eval_on_selector_all("section#prompt-0 .node.onpath", "els => els.map(e => e.dataset.node)")
    walk, node = [], leaf.get_attribute("data-node")
    parents = dict(page.eval_on_selector_all("section#prompt-0 .node",
                                             "els => els.map(e => [e.dataset.node, e.dataset.parent])"))
    while node != "-1":
        walk.append(node)
        node = parents[node]
    assert sorted(path) == sorted(walk) and len(walk) == 2
    dots = page.eval_on_selector_all("section#prompt-0 .minimap a", "els => els.filter(a => "
                                     "a.firstElementChild.classList.contains('onpath')).map(a => a.dataset.ref)")
    assert sorted(dots) == sorted(walk)
    assert leaf.locator(".extra").is_visible() and "log π" in leaf.locator(".extra").inner_text()
    others = page.locator("section#prompt-0 .node:not(.picked) > .extra")
    assert all(others.nth(i).is_hidden() for i in range(others.count()))
    page.locator("#all-numbers").check()
    assert all(others.nth(i).is_visible() for i in range(others.count()))


def test_the_key_shows_the_nodes_own_colours_and_counts(page, run_dir):
    _open(page, run_dir / "step_000001.html")
    for sign in ("pos", "neg", "zero"):
        swatch = page.eval_on_selector(f'.key .keyitem[data-sign="{sign}"] .swatch',
                                       "e => getComputedStyle(e).backgroundColor")
        borders = page.eval_on_selector_all(f'.node[data-sign="{sign}"]',
                                            "els => els.map(e => getComputedStyle(e).borderLeftColor)")
        count = int(page.locator(f'.key .keyitem[data-sign="{sign}"] .n').inner_text())
        assert count == len(borders) > 0 and set(borders) == {swatch}
    assert len({page.eval_on_selector(f'.key .keyitem[data-sign="{s}"] .swatch',
                                      "e => getComputedStyle(e).backgroundColor") for s in ("pos", "neg", "zero")}) == 3
    for direction in tv.DIRECTIONS:
        count = int(page.locator(f'.key .keyitem[data-dir="{direction}"] .n').inner_text())
        assert count == page.locator(f'.node[data-dir="{direction}"]').count()
    louvre = page.eval_on_selector_all("section#prompt-1 .node", "els => els.map(e => e.dataset.dir)")
    assert louvre == ["undirected"] * 3  # the all-equal tree's turns: not "away"
    # each turn's head carries its credit and what the update did to it
    head = page.locator("section#prompt-0 .node").first.locator(".head").inner_text()
    assert "V " in head and "Δp " in head


def test_a_page_of_2000_leaves_loads_within_seconds(page, tmp_path):
    paths = [[0, 1 + b, 100 + b * 50 + k] for b in range(40) for k in range(50)]
    texts = [f"turn {i}: " + "lorem ipsum dolor sit amet " * 4 for i in range(100 + 40 * 50)]
    tree = RolloutTree.from_trajectories([0], [[Turn([i], [0.0], [0]) for i in p] for p in paths],
                                         [float(k % 3 == 0) for k in range(len(paths))])
    n = tree.num_turns
    record = tv.tree_record(tree, {"A": torch.linspace(-1, 1, n), "q": torch.linspace(0.3, 0.7, n)},
                            lambda ids: "".join(texts[i] for i in ids), "Question: many leaves")
    tv.attach_turn_probabilities(record, [-1.0] * n, [-0.99] * n, [0.5 + 1e-3] * n)
    assert tree.num_leaves == 2000
    file = tmp_path / "step_000001.html"
    file.write_text(tv.render_page(tv.page_data([record], step=1, method="TreeOPSD"), max_nodes=n))
    start = time.perf_counter()
    _open(page, file)
    shown = page.locator(".node").count()
    elapsed = time.perf_counter() - start
    assert shown == n and elapsed < LOAD_BOUND_S, (shown, elapsed)
    start = time.perf_counter()
    page.locator("#next-rewarded").click()
    assert page.locator(".node.picked").get_attribute("data-outcome") == "rewarded"
    assert time.perf_counter() - start < LOAD_BOUND_S
    print(f"2000-leaf page: {n} nodes, loaded in {elapsed:.2f} s")


def test_tampered_text_shows_as_text_and_runs_nothing(page, run_dir, tmp_path):
    _open(page, run_dir / "step_000001.html")
    page.locator(".navbtn").nth(2).click()
    page.locator("#all-numbers").check()
    section = page.locator("section#prompt-2")
    assert HOSTILE in section.inner_text()  # the tool text, the model's text and the question, shown as text
    assert page.evaluate("window.__pwned") is None and page.dialogs == []
    assert page.locator("section#prompt-2 img").count() == 0
    assert page.eval_on_selector_all("script", "els => els.length") == 1
    # a hand-edited data file (`trl-tree view` renders what it holds) with markup in every text and key
    data = json.loads((run_dir / "step_000001.json").read_text())
    data["method"] = HOSTILE
    for node in data["prompts"][0]["nodes"]:
        node["label"] = HOSTILE
        node["credit"][HOSTILE] = 0.5
    folder = tmp_path / "tree_view"
    folder.mkdir()
    (folder / "step_000001.json").write_text(json.dumps(data))
    tv.render_run(folder)
    _open(page, folder / "step_000001.html")
    page.locator("section#prompt-0 .node").first.locator(".head").click()
    page.locator("#next-rewarded").click()
    assert page.evaluate("window.__pwned") is None and page.dialogs == []
    assert HOSTILE in page.locator("h1").inner_text()
    assert page.eval_on_selector_all("script", "els => els.length") == 1
