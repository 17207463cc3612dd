"""Issue 59: tools given with plain-string prompts were never shown to the model (a plain-text prompt gets no chat
template, which is what renders the tools' schemas), silently. The trainer now says so when it is built."""

import logging

from datasets import Dataset

from tests.scripted import config, contains_answer, tiny
from trl_tree import TreeOPSDConfig, TreeOPSDTrainer
from trl_tree.testing import calculator


def _build(tmp_path, prompt, tools):
    model, tok = tiny()
    dataset = Dataset.from_dict({"prompt": [prompt] * 2, "answer": ["2"] * 2})
    return TreeOPSDTrainer(model=model, reward_funcs=contains_answer, args=config(TreeOPSDConfig, tmp_path),
                           train_dataset=dataset, processing_class=tok, tools=tools)


def test_tools_with_plain_string_prompts_are_said_to_be_unseen(tmp_path, caplog):
    with caplog.at_level(logging.WARNING, logger="trl_tree.trainer.prompts"):
        _build(tmp_path, "What is 1+1?", [calculator])
    (message,) = [r.getMessage() for r in caplog.records if "never shown to the model" in r.getMessage()]
    assert "train_dataset has plain-string prompts, so the tools (calculator)" in message
    assert "chat messages" in message


def test_tools_with_chat_prompts_or_plain_prompts_without_tools_are_not_warned(tmp_path, caplog):
    with caplog.at_level(logging.WARNING, logger="trl_tree.trainer.prompts"):
        _build(tmp_path, [{"role": "user", "content": "What is 1+1?"}], [calculator])
        _build(tmp_path, "What is 1+1?", None)
    assert not [r for r in caplog.records if "never shown to the model" in r.getMessage()]
