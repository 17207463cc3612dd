"""A checkpoint whose `trainer_state.json` was cut short by an interrupted save (issue 41, item 7): resuming from it by
path is an error that names the file and the newest earlier complete checkpoint, before any weights load. So is any
other file resume reads, cut short (issue 56, item 7), and a checkpoint without its optimizer state is refused unless
TRL_TREE_RESUME_WITHOUT_OPTIMIZER=1."""

import json
import logging
import os
import shutil

import pytest
import torch

from tests.scripted import REPLIES, scripted_trainer
from trl_tree import TreeOPSDConfig, TreeOPSDTrainer
from trl_tree.trainer import resume


@pytest.fixture(scope="module")
def saved_run(tmp_path_factory):
    """checkpoint-1 and checkpoint-2 of a two-step scripted run, whole (tests alter copies)."""
    out = tmp_path_factory.mktemp("saved")
    replies = {key: texts * 2 for key, texts in REPLIES.items()}  # two generation batches' worth
    trainer = scripted_trainer(TreeOPSDTrainer, TreeOPSDConfig, out, replies=replies, max_steps=2,
                               save_strategy="steps", save_steps=1)
    trainer.train()
    return out


@pytest.fixture(scope="module")
def checkpoints(saved_run, tmp_path_factory):
    """The saved run's checkpoints, checkpoint-2's trainer state cut in half."""
    out = tmp_path_factory.mktemp("run")
    for name in ("checkpoint-1", "checkpoint-2"):
        shutil.copytree(saved_run / name, out / name)
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


# ---------------------------------------------------------------------------------------------- every file (issue 56)


def _copy(saved_run, tmp_path):
    for name in ("checkpoint-1", "checkpoint-2"):
        shutil.copytree(saved_run / name, tmp_path / name)
    return tmp_path


def _cut(path, keep=0.5):
    data = path.read_bytes()
    path.write_bytes(data[: int(len(data) * keep)])


@pytest.mark.parametrize("name", ["rng_state.pth", "optimizer.pt", "scheduler.pt", "trl_tree_state_0.pth",
                                  "model.safetensors"])  # fmt: skip
def test_a_cut_file_names_itself_the_checkpoint_and_the_newest_complete_one_before_loading(
        saved_run, tmp_path, monkeypatch, name):
    """Before: a cut rng_state.pth was a bare `OSError: [Errno 22]` after the weights loaded, a cut optimizer.pt or
    scheduler.pt torch's error naming no file, a cut trl-tree state an error after the weights had loaded."""
    out = _copy(saved_run, tmp_path / "out")
    _cut(out / "checkpoint-2" / name)
    message, loaded = _resumed(tmp_path / "run", out / "checkpoint-2", monkeypatch)
    assert loaded == []
    assert f"{out / 'checkpoint-2' / name} is cut short" in message
    assert f"checkpoint {out / 'checkpoint-2'} cannot be resumed; nothing was loaded" in message
    assert f"the newest complete one is {out / 'checkpoint-1'}" in message


def test_resume_true_skips_a_checkpoint_with_a_cut_file(saved_run, tmp_path, caplog):
    out = _copy(saved_run, tmp_path)
    _cut(out / "checkpoint-2" / "rng_state.pth", keep=0.9)
    with caplog.at_level(logging.WARNING, logger="trl_tree.trainer.resume"):
        assert resume.checkpoint_to_resume(True, str(out)) == str(out / "checkpoint-1")
    assert "checkpoint-2 (rng_state.pth is cut short" in caplog.text


@pytest.mark.parametrize("removed", [["optimizer.pt"], ["scheduler.pt"], ["optimizer.pt", "scheduler.pt"]])
def test_a_checkpoint_without_its_optimizer_state_is_refused_unless_told(saved_run, tmp_path, monkeypatch, caplog,
                                                                         removed):
    """transformers loads the optimizer and scheduler only when both files are there, else resumes with fresh ones
    without a word (before: so did trl-tree). Refused, naming what is missing, the checkpoint to resume from instead
    and the variable that allows it; with TRL_TREE_RESUME_WITHOUT_OPTIMIZER=1 it resumes and says so."""
    out = _copy(saved_run, tmp_path / "out")
    for name in removed:
        os.remove(out / "checkpoint-2" / name)
    monkeypatch.delenv(resume.RESUME_WITHOUT_OPTIMIZER, raising=False)
    message, loaded = _resumed(tmp_path / "run", out / "checkpoint-2", monkeypatch)
    assert loaded == []
    assert f"{out / 'checkpoint-2'} has no {' and no '.join(removed)} (saved with save_only_model=True" in message
    assert f"the newest complete one with its optimizer state is {out / 'checkpoint-1'}" in message
    assert "TRL_TREE_RESUME_WITHOUT_OPTIMIZER=1" in message
    with pytest.raises(ValueError, match="has no"):  # resume_from_checkpoint=True too: it does not pass silently
        resume.checkpoint_to_resume(True, str(out))
    monkeypatch.setenv(resume.RESUME_WITHOUT_OPTIMIZER, "1")
    with caplog.at_level(logging.WARNING, logger="trl_tree.trainer.resume"):
        assert resume.checkpoint_to_resume(str(out / "checkpoint-2"), str(out)) == str(out / "checkpoint-2")
    assert "a fresh optimizer" in caplog.text and "TRL_TREE_RESUME_WITHOUT_OPTIMIZER=1 asks" in caplog.text


def test_a_checkpoint_without_its_optimizer_state_resumes_when_told(saved_run, tmp_path, monkeypatch):
    """The opt-in really trains on: the weights and trainer state load, step 2 is trained with a fresh optimizer."""
    out = _copy(saved_run, tmp_path / "out")
    os.remove(out / "checkpoint-1" / "optimizer.pt")
    monkeypatch.setenv(resume.RESUME_WITHOUT_OPTIMIZER, "1")
    replies = {key: texts * 2 for key, texts in REPLIES.items()}
    trainer = scripted_trainer(TreeOPSDTrainer, TreeOPSDConfig, tmp_path / "run", replies=replies, max_steps=2)
    trainer.train(resume_from_checkpoint=str(out / "checkpoint-1"))
    assert trainer.state.global_step == 2


def test_deepspeeds_layout_keeps_its_optimizer_elsewhere(tmp_path):
    (tmp_path / "global_step3").mkdir()
    assert resume.missing_optimizer_state(str(tmp_path)) == []
    (tmp_path / "global_step3").rmdir()
    assert resume.missing_optimizer_state(str(tmp_path)) == ["optimizer.pt", "scheduler.pt"]


def test_any_cut_of_a_torch_or_safetensors_file_is_found_and_a_whole_one_passes(tmp_path):
    """The structure checks read each file's end: every proper prefix of a torch.save zip or a safetensors file is
    reported, the whole file is not."""
    from safetensors.torch import save_file

    optimizer = {"state": {0: {"exp_avg": torch.randn(64, 64)}}, "param_groups": [{"lr": 0.1}]}
    torch.save(optimizer, tmp_path / "optimizer.pt")
    save_file({"w": torch.randn(64, 64), "b": torch.zeros(3)}, tmp_path / "model.safetensors")
    assert resume.cut_files(str(tmp_path)) == []
    for name in ("optimizer.pt", "model.safetensors"):
        path = tmp_path / name
        whole = path.read_bytes()
        for keep in sorted({0, 1, 2, 7, 8, 9, 100, len(whole) // 2, len(whole) - 22, len(whole) - 1}):
            path.write_bytes(whole[:keep])
            assert [n for n, _ in resume.cut_files(str(tmp_path))] == [name], keep
        path.write_bytes(whole)
    assert resume.cut_files(str(tmp_path)) == []
