"""Issue 59: resuming with unchanged arguments warned `per_device_train_batch_size: 8 (from args) != 2 (from
trainer_state.json)`, because transformers copies the dataloader's batch size, a count of trees for a tree trainer,
into the trainer state it later compares the arguments with. The state now records the arguments' batch size."""

import json

from transformers.trainer_callback import TrainerState
from transformers.trainer_utils import compare_trainer_and_checkpoint_args
from transformers.utils import logging as hf_logging

from tests.scripted import scripted_trainer
from trl_tree import TreeOPSDConfig, TreeOPSDTrainer


def test_a_checkpoint_records_the_per_device_batch_size_so_an_unchanged_resume_does_not_warn(tmp_path, monkeypatch):
    trainer = scripted_trainer(TreeOPSDTrainer, TreeOPSDConfig, tmp_path, save_strategy="steps", save_steps=1)
    assert trainer.args.trees_per_micro_batch != trainer.args.per_device_train_batch_size  # trees, not trajectories
    trainer.train()
    state_file = tmp_path / "checkpoint-1" / "trainer_state.json"
    assert json.loads(state_file.read_text())["train_batch_size"] == trainer.args.per_device_train_batch_size

    warnings = []
    logger = hf_logging.get_logger("transformers.trainer_utils")
    monkeypatch.setattr(logger, "warning_once", warnings.append)
    compare_trainer_and_checkpoint_args(trainer.args, TrainerState.load_from_json(str(state_file)))
    assert warnings == []
    trainer.args.per_device_train_batch_size *= 2  # a real change is still reported
    compare_trainer_and_checkpoint_args(trainer.args, TrainerState.load_from_json(str(state_file)))
    assert len(warnings) == 1 and "per_device_train_batch_size" in warnings[0]
