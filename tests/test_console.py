"""What a run prints (issue 41, item 5): the completions table shows a tree's prompt and description once, never
points at a tree row it did not print, and puts tool calls on their own lines; no FutureWarning about TRL's use of
transformers' old checkpointing names; counts read "1 prompt", not "1 prompts"."""

import random
import warnings

import pytest
from datasets import Dataset
from hypothesis import given
from hypothesis import strategies as st

from tests.scripted import CALL_1_PLUS_1, REPLIES, arithmetic_dataset, config, contains_answer, scripted_trainer, tiny
from trl_tree import TreeOPSDConfig, TreeOPSDTrainer
from trl_tree.text import plural
from trl_tree.trainer.observability import completions_table as ct

SYSTEM = "SYSTEMSTART You are a careful agent. " + "You are a careful agent. " * 40 + "THE-END-OF-THE-SYSTEM-PROMPT"


def _logged(group_sizes):
    """Logged columns of trees of the given sizes, with their `RowMeta`s, as the trainer buffers them."""
    prompts, completions, meta = [], [], []
    for g, size in enumerate(group_sizes):
        prompt = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": f"question {g}"}]
        for k in range(size):
            prompts.append(prompt)
            completions.append([{"role": "assistant", "content": f"answer {g}.{k}"}])
            meta.append(ct.RowMeta((0, g), k, size, (k,), f"tree {g}"))
    n = len(prompts)
    extra = {"tree": [f"logged {i}" for i in range(n)], "note": [f"note {i}" for i in range(n)]}
    return prompts, completions, {"r": [0.0] * n}, [0.0] * n, extra, meta


@given(sizes=st.lists(st.integers(1, 6), min_size=1, max_size=6), samples=st.one_of(st.none(), st.integers(0, 40)),
       seed=st.integers(0, 2**16))
def test_the_console_table_never_points_at_a_tree_it_did_not_print(sizes, samples, seed):
    prompts, completions, rewards, advantages, extra, meta = _logged(sizes)
    rows = ct.chosen_rows(len(prompts), samples, random.Random(seed))
    table = ct.console_table(prompts, completions, rewards, advantages, extra, meta, rows)
    assert len(table.prompts) == len(rows) == (len(prompts) if samples is None else min(samples, len(prompts)))
    described = set()
    for i, prompt, cell in zip(rows, table.prompts, table.extra["tree"]):
        group = meta[i].group
        if cell.endswith(f"of the tree above: turns [{meta[i].index}]"):
            assert group in described and prompt == ct.SAME_PROMPT  # its tree's row was printed above it
        else:
            assert cell.startswith(f"tree {group[1]}\nleaf {meta[i].index + 1} of {meta[i].size}")
            assert group not in described and prompt != ct.SAME_PROMPT
            described.add(group)
    assert table.extra["note"] == [extra["note"][i] for i in rows]  # other columns (log_extra) as logged
    text = repr(table.prompts)
    assert "THE-END-OF-THE-SYSTEM-PROMPT" not in text and text.count("SYSTEMSTART") == len(described)


def test_a_tool_call_is_on_its_own_line_after_the_text():
    message = {"role": "assistant", "content": "I will search first.",
               "tool_calls": [{"type": "function", "function": {"name": "search", "arguments": {"query": "Ada"}}},
                              {"function": {"name": "search", "arguments": '{"query": "Bob"}'}},
                              {"function": {"name": "search", "arguments": "{oops"}}]}  # fmt: skip
    (shown,) = ct.compact_messages([message])
    assert shown["content"].splitlines() == [
        "I will search first.", "→ search(query='Ada')", "→ search(query='Bob')", "→ search({oops)"]
    assert "tool_calls" not in shown
    long = ct.compact_messages([{"role": "tool", "name": "search", "content": "x" * 5000}])[0]["content"]
    assert long.startswith("[search] x") and long.endswith("(4,401 more characters)") and len(long) < 700


def test_a_trained_steps_table_shows_the_system_prompt_once_per_tree_and_the_tool_call_apart(tmp_path, capsys,
                                                                                             monkeypatch):
    monkeypatch.setenv("COLUMNS", "250")  # rich's width: no cell wrapped mid-word
    monkeypatch.setattr(ct, "stdout_is_terminal", lambda: True)  # the table (off a terminal: one line per row)
    dataset = Dataset.from_dict({"prompt": [[{"role": "system", "content": SYSTEM},
                                             {"role": "user", "content": "What is 1+1?"}]], "answer": ["2"]})
    trainer = scripted_trainer(TreeOPSDTrainer, TreeOPSDConfig, tmp_path,
                               replies={k: [f"Let me compute.{v}" if v == CALL_1_PLUS_1 else v for v in texts]
                                        for k, texts in REPLIES.items()},
                               dataset=dataset, log_completions=True, num_completions_to_print=None)
    trainer.train()
    out = capsys.readouterr().out
    assert out.count("SYSTEMSTART") == 1 and "THE-END-OF-THE-SYSTEM-PROMPT" not in out
    assert out.count("〃 (the") == 3  # the other leaves of the one tree
    assert "→ calculator(expression='1+1')" in out and "compute.calculator" not in out
    assert "of the tree above" in out and out.count("4 leaves, ") == 1


def test_off_a_terminal_each_printed_row_is_one_line_and_the_page_is_named(tmp_path, capsys):
    """issue 59: in a log file rich rendered the table at 80 columns, one word a line (580 of 620 lines)."""
    dataset = Dataset.from_dict({"prompt": [[{"role": "system", "content": SYSTEM},
                                             {"role": "user", "content": "What is 1+1?"}]], "answer": ["2"]})
    trainer = scripted_trainer(TreeOPSDTrainer, TreeOPSDConfig, tmp_path, dataset=dataset, log_completions=True,
                               num_completions_to_print=None)  # fmt: skip
    assert not ct.stdout_is_terminal()  # pytest's captured stdout, as a log file
    trainer.train()
    out = capsys.readouterr().out
    rows = [line for line in out.splitlines() if line.startswith("[completions step 1] ") and "completion: " in line]
    assert len(rows) == 4 and not any(c in out for c in "│┃╭━")  # the tree's 4 leaves, no table drawn
    assert out.count("SYSTEMSTART") == 1 and "4 leaves, " in rows[0] and "→ calculator(expression='1+1')" in out
    assert all(len(line) < 1000 and "reward contains_answer " in line for line in rows)
    (page,) = [line for line in out.splitlines() if "the rollout-tree page: " in line]
    assert page.endswith(".html") and (tmp_path / "tree_view").exists()


def test_no_futurewarning_about_trls_checkpointing_names(tmp_path):
    """TRL's GRPOConfig default (gradient_checkpointing=True) and its unwrap around every generation used
    transformers' old names: 10 FutureWarnings in the README's example. Set by the user, the old name still warns."""
    model, tok = tiny()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        args = TreeOPSDConfig(output_dir=str(tmp_path), num_initial_rollouts=2, num_branches=1, max_turns=1,
                              max_completion_length=4, max_steps=1, report_to="none", use_cpu=True, bf16=False,
                              save_strategy="no")
        assert args.gradient_checkpointing is True
        trainer = TreeOPSDTrainer(model=model, reward_funcs=contains_answer, args=args,
                                  train_dataset=arithmetic_dataset(1), processing_class=tok)
        trainer.train()
    assert [str(w.message) for w in caught if "checkpointing" in str(w.message)] == []
    with pytest.warns(FutureWarning, match="`gradient_checkpointing` is deprecated"):
        TreeOPSDConfig(output_dir=str(tmp_path), gradient_checkpointing=False, report_to="none", use_cpu=True)


def test_startup_counts_read_in_the_singular_for_one(tmp_path, capsys):
    model, tok = tiny()
    TreeOPSDTrainer(model=model, reward_funcs=contains_answer, args=config(TreeOPSDConfig, tmp_path),
                    train_dataset=arithmetic_dataset(1), processing_class=tok)
    out = capsys.readouterr().out
    for part in ("1 prompt per generation batch", "1 tree per micro-batch", "K = 4 leaves per tree",
                 "1 prompt and 3 expected trajectories per optimizer step", "E = 1 optimizer block per"):
        assert part in out


@given(count=st.integers(0, 1000))
def test_plural_is_singular_exactly_for_one(count):
    assert plural(count, "leaf", "leaves") == (f"{count} leaf" if count == 1 else f"{count} leaves")


def test_a_treeflex_table_shows_each_tasks_prompt_once(tmp_path, capsys, monkeypatch):
    from tests.scripted import TWO_ROLE_FIELDS, TwoRoleScript
    from trl_tree import TreeFlexConfig, TreeFlexTrainer

    monkeypatch.setenv("COLUMNS", "250")
    monkeypatch.setattr(ct, "stdout_is_terminal", lambda: True)
    trainer = scripted_trainer(TreeFlexTrainer, TreeFlexConfig, tmp_path, script=TwoRoleScript, log_completions=True,
                               num_completions_to_print=None, **TWO_ROLE_FIELDS)
    trainer.train()
    out = capsys.readouterr().out
    assert out.count("〃 (the prompt above)") == 1 and "blocks" in out  # 2 searches, one prompt; TreeFlex's column
