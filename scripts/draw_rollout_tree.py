"""Draw one prompt's rollout tree as a picture: the turns, where continuations branched, merged histories, each
turn's backed-up credit and each leaf's reward.

The README's tree picture is made with this script from real trees: one TreeOPSD generation batch of SmolLM2 from
the learning benchmark's warm start ((M, N) = (4, 2)), saved by the trainer. It reads the same page data as the HTML
view, so any run with `log_completions=True` can be drawn:

    python scripts/draw_rollout_tree.py OUTPUT_DIR [--prompt N] [--out tree.png]      # newest saved page of a run
    python scripts/draw_rollout_tree.py OUTPUT_DIR/tree_view/step_000004.json --out tree.png
    python scripts/draw_rollout_tree.py --sample-smollm2 /tmp/smollm2-view --prompts 4 \\
        --out tree.png                                 # sample the README's batch again (~8 CPU minutes), draw it
    python scripts/draw_rollout_tree.py docs/images/rollout_tree_smollm2.json \\
        --out docs/images/rollout_tree.png             # the README's picture, from that batch's saved page data

The credit drawn is what the trainer trained with (TreeOPSD: V_i, the likelihood-weighted backup of the standardised
leaf rewards, with π_old). Without `--prompt` the prompt drawn is the one whose leaves have the widest spread of
rewards (a tree whose leaves all fail has no credit to show).
"""

from __future__ import annotations

import argparse
import re
import sys
import textwrap
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

_QUERY = re.compile(r'"query"\s*:\s*"((?:[^"\\]|\\.)*)"')
_TOOL = re.compile(r'"name"\s*:\s*"([^"]+)"')


def action_label(action: str, width: int = 28) -> str:
    """What a turn did, in a few words: its search query, its answer, another tool's name, or 'malformed'."""
    from trl_tree.rewards import ANSWER_SPAN  # the answer the reward reads

    if m := ANSWER_SPAN.search(action):
        return _short("answer: " + m.group(1).strip(), width)
    if "<tool_call>" in action:
        if m := _QUERY.search(action):
            return _short("search: " + m.group(1), width)
        if m := _TOOL.search(action):
            return _short(m.group(1) + "(…)", width)
    return "no call / malformed"


def question(record: dict) -> str:
    """The record's question as the view shows it (`trl_tree.tree_view.question_text`), and its gold answer."""
    from trl_tree.tree_view import question_text

    asked = " ".join((record.get("question") or question_text(record["prompt"])).split())
    return asked + (f"   (gold: {record['gold']})" if record.get("gold") else "")


def _short(text: str, width: int) -> str:
    text = " ".join(text.split())
    return text if len(text) <= width else text[: width - 1] + "…"


def layout(record: dict) -> dict[int, tuple[float, int]]:
    """x (leaves evenly spaced in depth-first order, a parent centred over its children) and depth of each turn."""
    nodes = {n["id"]: n for n in record["nodes"] if n.get("kind", "turn") == "turn"}
    children: dict[int, list[int]] = {i: [] for i in nodes}
    roots = []
    for i, n in nodes.items():
        (children[n["parent"]] if n["parent"] in nodes else roots).append(i)
    place: dict[int, tuple[float, int]] = {}
    next_x = [0.0]

    def visit(i: int, depth: int) -> float:
        if not children[i]:
            x = next_x[0]
            next_x[0] += 1.0
        else:
            xs = [visit(c, depth + 1) for c in sorted(children[i])]
            x = (xs[0] + xs[-1]) / 2
        place[i] = (x, depth)
        return x

    for r in sorted(roots):
        visit(r, 1)
    return place


def branched_here(record: dict) -> set[int]:
    """Turns that start a continuation: their round (the sampling round that created them) is later than their
    parent's, or, in data without rounds, the first trajectory through them is later than the parent's first."""
    nodes = {n["id"]: n for n in record["nodes"] if n.get("kind", "turn") == "turn"}
    first: dict[int, int] = {}
    for k, path in enumerate(record.get("paths") or []):
        for i in path:
            first.setdefault(i, k)
    out = set()
    for i, n in nodes.items():
        parent = nodes.get(n["parent"])
        if parent is None:
            continue
        if n.get("round") is not None and parent.get("round") is not None:
            if n["round"] > parent["round"]:
                out.add(i)
        elif first.get(i, 0) > first.get(parent["id"], 0):
            out.add(i)
    return out


def draw(record: dict, out: str, title: str | None = None) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.colors import TwoSlopeNorm
    from matplotlib.lines import Line2D

    nodes = {n["id"]: n for n in record["nodes"] if n.get("kind", "turn") == "turn"}
    if not nodes:
        raise SystemExit("This record has no turns to draw (TreeFlex's searches are drawn by the HTML view only).")
    place = layout(record)
    branches = branched_here(record)
    width = max(x for x, _ in place.values()) + 1
    depth = max(d for _, d in place.values())
    fig, ax = plt.subplots(figsize=(max(8.0, 1.1 * width), 1.7 * depth + 2.2))
    credits = [n["credit"].get("A") for n in nodes.values() if n["credit"].get("A") is not None]
    bound = max([abs(c) for c in credits] + [1e-6])
    norm = TwoSlopeNorm(vcenter=0.0, vmin=-bound, vmax=bound)
    cmap_credit, cmap_reward = plt.get_cmap("coolwarm_r"), plt.get_cmap("RdYlGn")
    rewards = [r for n in nodes.values() for r in n.get("rewards", []) if r is not None]
    low, high = (min(rewards), max(rewards)) if rewards else (0.0, 1.0)
    span = (high - low) or 1.0

    top = (width - 1) / 2
    ax.text(top, 0, _short("question: " + question(record), 110), ha="center", va="center", fontsize=10,
            bbox=dict(boxstyle="round,pad=0.4", fc="#eeeeee", ec="#888888"))
    for i, n in nodes.items():
        x, d = place[i]
        px, pd = place[n["parent"]] if n["parent"] in nodes else (top, 0)
        dashed = i in branches
        ax.plot([px, x], [-pd, -d], color="#e67e22" if dashed else "#999999", lw=1.6 if dashed else 1.2,
                ls="--" if dashed else "-", zorder=1)
    for i, n in nodes.items():
        x, d = place[i]
        A = n["credit"].get("A")
        face = cmap_credit(norm(A)) if A is not None else "#dddddd"
        ax.scatter([x], [-d], s=260, c=[face], edgecolors="#333333", linewidths=0.8, zorder=3)
        label = textwrap.fill(action_label(n["action"], 40), 15)
        ax.text(x, -d - 0.2, label, fontsize=6.5, ha="center", va="top", zorder=4, linespacing=1.0)
        if A is not None:
            ax.text(x, -d, f"{A:+.2f}", fontsize=5.5, ha="center", va="center", zorder=4,
                    color="white" if abs(norm(A) - 0.5) > 0.3 else "black")
        m = n.get("multiplicity", 1)
        if m > 1 and not n.get("leaf"):
            ax.text(x + 0.2, -d + 0.12, f"×{m}", fontsize=7, ha="left", va="bottom", color="#555555")
        leaf_rewards = [r for r in n.get("rewards", []) if r is not None] if n.get("leaf") else []
        if leaf_rewards:  # one square per leaf; identical trajectories merged into it are counted (×m)
            ly = -d - 0.95
            ax.plot([x, x], [-d - 0.62, ly + 0.12], color="#bbbbbb", lw=0.8, zorder=1)
            r = sum(leaf_rewards) / len(leaf_rewards)
            ax.scatter([x], [ly], marker="s", s=170, c=[cmap_reward((r - low) / span)], edgecolors="#333333",
                       linewidths=0.6, zorder=3)
            ax.text(x, ly, f"{r:.2g}", fontsize=6.5, ha="center", va="center", zorder=4)
            if len(leaf_rewards) > 1:
                ax.text(x, ly - 0.2, f"×{len(leaf_rewards)} merged", fontsize=6.5, ha="center", va="top",
                        color="#333333")
    num_leaves = record.get("num_leaves", sum(len(n.get("rewards", [])) for n in nodes.values()))
    ax.set_title(title or f"{num_leaves} trajectories in {len(nodes)} unique turns", fontsize=11)
    handles = [
        Line2D([], [], color="#999999", lw=1.2, label="turn of an earlier trajectory"),
        Line2D([], [], color="#e67e22", lw=1.6, ls="--", label="a continuation branches here"),
        Line2D([], [], marker="o", ls="", mfc=cmap_credit(norm(bound)), mec="#333333", ms=9,
               label="turn: backed-up credit V (blue > 0 > red)"),
        Line2D([], [], marker="s", ls="", mfc=cmap_reward(1.0), mec="#333333", ms=8,
               label="trajectory's reward (green high, red low)"),
    ]
    ax.legend(handles=handles, loc="lower center", bbox_to_anchor=(0.5, -0.06), ncol=2, fontsize=8, frameon=False)
    ax.set_xlim(-0.8, width - 0.2)
    ax.set_ylim(-depth - 1.5, 0.5)
    ax.axis("off")
    fig.tight_layout()
    fig.savefig(out, dpi=150)
    plt.close(fig)


def widest_spread(records: list[dict]) -> int:
    def spread(r):
        values = [v for v in r.get("rewards", []) if v is not None]
        return (max(values) - min(values) if values else 0.0, -abs(len(values) / 2 - sum(values)))

    return max(range(len(records)), key=lambda i: spread(records[i]))


def records_from_page(path: Path) -> list[dict]:
    from trl_tree.tree_view import VIEW_DIR, load_page_data

    if path.is_dir():
        folder = path / VIEW_DIR if (path / VIEW_DIR).is_dir() else path
        pages = sorted(folder.glob("step_*.json"))
        if not pages:
            raise SystemExit(f"{path}: no saved tree-view data (train with log_completions=True to save pages).")
        path = pages[-1]
    return [r for r in load_page_data(path)["prompts"] if r.get("kind", "tree") == "tree"]


def sample_smollm2(output_dir: str, prompts: int, seed: int) -> Path:
    """Train TreeOPSD for one generation batch of `prompts` trees from the learning benchmark's SmolLM2 warm start
    (`bench_learning.py --model smollm2`'s settings, its cached warm start) with `log_completions`, so that the
    trainer saves the page data: π_old written back, the credit the loss used, p after the step. Returns the page."""
    sys.path.insert(0, str(REPO / "benchmarks"))
    import bench_learning
    import torch
    from common import budget_from_args, build_trainer, load_model, lora_config, make_task, warm_started_model

    from trl_tree.testing import smollm2_path

    args = bench_learning.parse_args(["--model", "smollm2", "--prompts", str(prompts), "--generation_batches", "1"])
    torch.set_num_threads(1)
    torch.manual_seed(seed)
    task = make_task(args.task, args.num_train, args.num_test, topk=args.topk)
    model_path = warm_started_model(task, smollm2_path(), args.warm_start_steps, lr=args.warm_start_lr,
                                    batch_size=args.warm_start_batch_size, lora_rank=args.lora_rank)
    model, tokenizer = load_model(model_path)
    trainer = build_trainer("treeopsd", model, tokenizer, task, budget_from_args(args, 1, seed), output_dir,
                            peft_config=lora_config(args.lora_rank), log_completions=True,
                            num_completions_to_print=0)
    trainer.train()
    return sorted((Path(output_dir) / "tree_view").glob("step_*.json"))[-1]


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("source", nargs="?", help="a run's output folder, its tree_view/ folder, or a page's JSON")
    parser.add_argument("--sample-smollm2", metavar="OUTPUT_DIR",
                        help="first train SmolLM2 one generation batch with the view on (minutes), then draw its page")
    parser.add_argument("--prompts", type=int, default=2, help="with --sample-smollm2: trees in the batch")
    parser.add_argument("--seed", type=int, default=0, help="with --sample-smollm2")
    parser.add_argument("--prompt", type=int, help="which prompt of the page (0-based); default: widest reward spread")
    parser.add_argument("--out", default="rollout_tree.png")
    parser.add_argument("--title")
    args = parser.parse_args(argv)
    if (args.source is None) == (args.sample_smollm2 is None):
        parser.error("give a saved page (SOURCE) or --sample-smollm2 OUTPUT_DIR, one of them")
    if args.sample_smollm2:
        args.source = sample_smollm2(args.sample_smollm2, args.prompts, args.seed)
        print(f"page data: {args.source}")
    records = records_from_page(Path(args.source))
    if not records:
        raise SystemExit("No rollout trees in this data.")
    index = widest_spread(records) if args.prompt is None else args.prompt
    if not 0 <= index < len(records):
        raise SystemExit(f"--prompt {index}: the data has prompts 0 to {len(records) - 1}.")
    draw(records[index], args.out, args.title)
    print(f"wrote {args.out} (prompt {index} of {len(records)})")


if __name__ == "__main__":
    main()
