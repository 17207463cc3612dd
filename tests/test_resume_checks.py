"""A checkpoint whose `trainer_state.json` was cut short by an interrupted save (issue 41, item 7): resuming from it by
path is an error that names the file and the newest earlier complete checkpoint, before any weights load."""

import json
import os

import pytest

from tests.scripted import REPLIES, scripted_trainer
from trl_tree import TreeOPSDConfig, TreeOPSDTrainer
from trl_tree.trainer import resume


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    """checkpoint-1 and checkpoint-2 of a two-step scripted run, checkpoint-2's trainer state cut in half."""
    out = tmp_path_factory.mktemp("run")
    replies = {key: texts * 2 for key, texts in REPLIES.items()}  # two generation batches' worth
    trainer = scripted_trainer(TreeOPSDTrainer, TreeOPSDConfig, out, replies=replies, max_steps=2,
                               save_strategy="steps", save_steps=1)
    trainer.train()
    state = out / "checkpoint-2" / "trainer_state.json"
    text = state.read_text()
    state.write_text(text[: len(text) // 2])
    return out


def _resumed(tmp_path, checkpoint, monkeypatch):
    """Resume a fresh trainer from `checkpoint`, recording whether transformers began loading the weights."""
    loaded = []
    trainer = scripted_trainer(TreeOPSDTrainer, TreeOPSDConfig, tmp_path, max_steps=2)
    monkeypatch.setattr(trainer, "_load_from_checkpoint", lambda *args, **kwargs: loaded.append(args))
    with pytest.raises(ValueError) as error:
        trainer.train(resume_from_checkpoint=str(checkpoint))
    return str(error.value), loaded


def test_a_cut_short_trainer_state_names_the_file_and_the_earlier_checkpoint_before_loading(
        checkpoints, tmp_path, monkeypatch):
    message, loaded = _resumed(tmp_path, checkpoints / "checkpoint-2", monkeypatch)
    assert loaded == []  # nothing loaded: the error comes first
    assert f"{checkpoints / 'checkpoint-2' / 'trainer_state.json'} cannot be read (JSONDecodeError" in message
    assert f"the newest complete one is {checkpoints / 'checkpoint-1'}" in message
    assert "resume_from_checkpoint=True" in message


def test_without_an_earlier_complete_checkpoint_it_says_none_is_left(checkpoints, tmp_path, monkeypatch):
    first = checkpoints / "checkpoint-1" / "trainer_state.json"
    saved = first.read_text()
    try:
        first.write_text("{")
        message, loaded = _resumed(tmp_path, checkpoints / "checkpoint-2", monkeypatch)
    finally:
        first.write_text(saved)
    assert loaded == [] and f"none complete is left in {checkpoints}" in message


@pytest.mark.parametrize("content", ["", "{\"global_step\": 3", "\x00\x00"])
def test_check_trainer_state_refuses_any_unreadable_state_and_passes_a_valid_or_missing_one(tmp_path, content):
    (tmp_path / "trainer_state.json").write_text(content)
    with pytest.raises(ValueError, match="trainer_state.json cannot be read"):
        resume.check_trainer_state(str(tmp_path))
    (tmp_path / "trainer_state.json").write_text(json.dumps({"global_step": 3}))
    resume.check_trainer_state(str(tmp_path))
    os.remove(tmp_path / "trainer_state.json")
    resume.check_trainer_state(str(tmp_path))  # transformers' to judge: it resumes the weights alone
