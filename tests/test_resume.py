"""Resume from any checkpoint continues the uninterrupted run exactly.

Setting: steps_per_generation = 2 with gradient_accumulation_steps = 1, so each generation batch is trained in E = 2
optimizer blocks; a checkpoint after every step (save_steps = 1) and max_steps = 4. Checkpoint 1 lies between the two
blocks of the first generation batch, checkpoint 2 at a generation-batch boundary.

Generation is scripted but *sampled*: each reply is drawn from torch's global generator, the one `model.generate`
samples with and transformers' checkpoints save, so trajectories have random lengths (1 to `max_turns` turns) and
rewards, and init-expand's anchors (uniform over {1..T−1}, from the sampler's own `random.Random`) depend on the
sampler's generator state. All runs are on CPU in float32 with one thread: the same operations in the same order give
bitwise-equal results, so the comparisons are exact (`torch.equal`).
"""

import functools
import json
import logging
import os
import random
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from transformers import TrainerCallback

from tests.resume_runs import count_generations, flex_trainer, logged, train, tree_trainer
from trl_tree import TreePOConfig, TreePOTrainer
from trl_tree.trainer import resume


def assert_same_run(resumed, params, full, full_params):
    """Bitwise-equal final parameters, and the same logged rewards and losses at every step."""
    assert params.keys() == full_params.keys()
    different = [n for n in params if not torch.equal(params[n], full_params[n])]
    assert not different, f"parameters differ from the uninterrupted run's: {different}"
    for key in ("reward", "loss"):
        assert logged(resumed, key) == logged(full, key), key
    assert max(logged(resumed, "loss")) == resumed.args.max_steps  # really trained to the end


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory):
    """The uninterrupted TreeOPSD run, its checkpoints kept."""
    out = tmp_path_factory.mktemp("full")
    trainer, params, generations = train(tree_trainer, out)
    assert generations == [0, 2]  # one generation batch per E = 2 optimizer blocks
    return out, trainer, params


@pytest.mark.parametrize("checkpoint", [1, 2])
def test_resume_equals_uninterrupted_run(uninterrupted, tmp_path, checkpoint):
    out, full, full_params = uninterrupted
    trainer, params, generations = train(tree_trainer, tmp_path, out / f"checkpoint-{checkpoint}")
    # the buffered batch is trained, not regenerated: the only generation is the second batch's, at micro-step 2
    assert generations == [2]
    assert_same_run(trainer, params, full, full_params)


def test_resume_state_holds_the_buffer_only_between_blocks(uninterrupted):
    out, _, _ = uninterrupted
    states = {
        k: torch.load(resume.state_file(str(out / f"checkpoint-{k}"), 0), weights_only=True) for k in (1, 2)
    }
    assert [states[k]["step"] for k in (1, 2)] == [1, 2]
    assert states[1]["buffered_inputs"] is not None and len(states[1]["buffered_inputs"]) == 2
    assert states[2]["buffered_inputs"] is None  # the next step generates anyway


def test_sampler_generator_resumes_with_the_same_anchors(uninterrupted, tmp_path):
    """The second generation batch's anchors, drawn after the first batch's draws in the uninterrupted run, are the
    same in a run resumed from checkpoint 2 (the sampler's `random.Random` is part of the checkpoint), and not what a
    freshly seeded sampler would draw on the same trajectories (so the check is not vacuous)."""
    out, full, _ = uninterrupted
    resumed = train(tree_trainer, tmp_path, out / "checkpoint-2")[0]
    second_batch = full.sampler.rng.draws_by_batch[1]
    assert resumed.sampler.rng.draws_by_batch == [second_batch]
    assert any(high > 1 for high, _ in second_batch), "trajectories of several turns are needed for anchors to matter"
    seeded = random.Random(full.args.seed)
    assert [seeded.randint(1, high) for high, _ in second_batch] != [anchor for _, anchor in second_batch]


def without_state(checkpoint_dir):
    os.remove(resume.state_file(str(checkpoint_dir), 0))


def saved_on_two_processes(checkpoint_dir):
    path = resume.state_file(str(checkpoint_dir), 0)
    state = torch.load(path, weights_only=True)
    state["layout"]["num_processes"] = 2
    torch.save(state, path)


@pytest.mark.parametrize("checkpoint, alter, reason, generations", [
    (1, without_state, "it has no trl_tree_state_0.pth", [1, 2]),
    (2, without_state, "it has no trl_tree_state_0.pth", [2]),
    (1, saved_on_two_processes, "num_processes: 2 → 1", [1, 2]),
])
def test_checkpoint_without_fitting_state_resumes_at_next_generation_batch(uninterrupted, tmp_path, caplog, checkpoint,
                                                                            alter, reason, generations):
    """A checkpoint without the resume state (an older trl-tree's), or with one of another run layout, resumes, says
    why it is not exact, and keeps the block order: from checkpoint 1 the interrupted batch is generated anew (at
    micro-step 1) for its second block."""
    out, _, _ = uninterrupted
    old = tmp_path / f"checkpoint-{checkpoint}"
    shutil.copytree(out / f"checkpoint-{checkpoint}", old)
    alter(old)
    with caplog.at_level(logging.WARNING, logger="trl_tree.trainer.resume"):
        trainer, _, generated_at = train(tree_trainer, tmp_path / "run", old)
    warning = " ".join(r.getMessage() for r in caplog.records if r.name == "trl_tree.trainer.resume")
    assert "cannot be resumed exactly" in warning and reason in warning
    assert ("remaining 1 optimizer block" in warning) == (checkpoint == 1)
    assert generated_at == generations
    assert max(logged(trainer, "loss")) == trainer.args.max_steps


def resume_warnings(caplog) -> str:
    return " ".join(r.getMessage() for r in caplog.records if r.name == "trl_tree.trainer.resume")


@pytest.mark.parametrize("changes, changed", [
    (dict(target_radius=0.1), "target_radius: 0.25 → 0.1"),
    (dict(num_branches=1), "num_branches: 2 → 1"),
    (dict(trees=1), "per_device_train_batch_size: 8 → 4"),
])
def test_changed_batch_config_generates_the_interrupted_batch_anew(uninterrupted, tmp_path, caplog, changes, changed):
    """Resumed between the two blocks of a generation batch with a field that shapes that batch or its credit (the
    teacher's ρ, the trees' branches, the trees per micro-batch) set otherwise, the run does not train the saved batch
    (built and credited under the checkpoint's config) but generates anew at once (micro-step 1), and the warning
    names the field with its old and new value."""
    out, _, _ = uninterrupted
    with caplog.at_level(logging.WARNING, logger="trl_tree.trainer.resume"):
        trainer, _, generated_at = train(functools.partial(tree_trainer, **changes), tmp_path, out / "checkpoint-1")
    warning = resume_warnings(caplog)
    assert "cannot be resumed exactly" in warning and changed in warning
    assert generated_at == [1, 2]
    assert max(logged(trainer, "loss")) == trainer.args.max_steps


def test_checkpoint_of_another_method_names_both_and_is_not_trained(uninterrupted, tmp_path, caplog):
    """TreeOPSD's checkpoint resumed by TreePOTrainer: the saved batch carries TreeOPSD's credit, so it is generated
    anew, and the warning names both trainers."""
    out, _, _ = uninterrupted
    make = functools.partial(tree_trainer, config_class=TreePOConfig, trainer_class=TreePOTrainer)
    with caplog.at_level(logging.WARNING, logger="trl_tree.trainer.resume"):
        _, _, generated_at = train(make, tmp_path, out / "checkpoint-1")
    warning = resume_warnings(caplog)
    assert "TreeOPSDTrainer" in warning and "TreePOTrainer" in warning
    assert generated_at == [1, 2]


class StepsTrained(TrainerCallback):
    def __init__(self):
        self.steps = []

    def on_step_end(self, args, state, control, **kwargs):
        self.steps.append(state.global_step)


def copy_checkpoints(out, run_dir, steps):
    for k in steps:
        shutil.copytree(out / f"checkpoint-{k}", run_dir / f"checkpoint-{k}")


def test_resume_true_takes_the_newest_complete_checkpoint(uninterrupted, tmp_path, caplog):
    """Saves interrupted at steps 3 and 4 (the trainer state never written; the weights gone): resume_from_checkpoint
    =True resumes from checkpoint 2, so exactly steps 3 and 4 are trained, and the log names the skipped folders and
    what each lacks."""
    out, _, _ = uninterrupted
    copy_checkpoints(out, tmp_path, [1, 2, 3, 4])
    (tmp_path / "checkpoint-4" / "trainer_state.json").unlink()
    (tmp_path / "checkpoint-3" / "model.safetensors").unlink()
    trainer = tree_trainer(tmp_path)
    generations, steps = count_generations(trainer), StepsTrained()
    trainer.add_callback(steps)
    with caplog.at_level(logging.WARNING, logger="trl_tree.trainer.resume"):
        trainer.train(resume_from_checkpoint=True)
    assert steps.steps == [3, 4] and generations == [2]
    warning = resume_warnings(caplog)
    assert "checkpoint-2" in warning
    assert "checkpoint-4" in warning and "trainer_state.json" in warning
    assert "checkpoint-3" in warning and "model weights" in warning


def test_resume_true_without_a_complete_checkpoint_says_what_each_lacks(uninterrupted, tmp_path):
    out, _, _ = uninterrupted
    copy_checkpoints(out, tmp_path, [1, 2])
    (tmp_path / "checkpoint-1" / "trainer_state.json").unlink()
    state = Path(resume.state_file(str(tmp_path / "checkpoint-2"), 0))
    state.write_bytes(state.read_bytes()[:100])  # cut short by the crash
    with pytest.raises(ValueError) as error:
        tree_trainer(tmp_path).train(resume_from_checkpoint=True)
    message = str(error.value)
    assert "no complete checkpoint" in message
    assert "checkpoint-1" in message and "trainer_state.json" in message
    assert "checkpoint-2" in message and "trl_tree_state_0.pth" in message


def test_state_file_without_its_keys_is_a_clear_error(uninterrupted, tmp_path):
    """A state file that loads but lacks keys names them and says how to resume anyway (as an unreadable one does)."""
    out, _, _ = uninterrupted
    copy_checkpoints(out, tmp_path, [1])
    path = resume.state_file(str(tmp_path / "checkpoint-1"), 0)
    state = torch.load(path, weights_only=True)
    del state["sampler"], state["step"]
    torch.save(state, path)
    with pytest.raises(ValueError, match=r"lacks .*'sampler'.*'step'.*Delete the file"):
        train(tree_trainer, tmp_path / "run", tmp_path / "checkpoint-1")


def test_treeflex_resumes_between_blocks(tmp_path):
    full, full_params, generations = train(flex_trainer, tmp_path / "full")
    assert generations == [0, 2]
    resumed, params, generations = train(flex_trainer, tmp_path / "resumed", tmp_path / "full" / "checkpoint-1")
    assert generations == [2]
    assert_same_run(resumed, params, full, full_params)


# ------------------------------------------------------------------------------------------------- sampler state


class HarnessWithGenerators:
    """A custom sampler owning one generator of each kind the checkpoint restores."""

    def __init__(self, seed):
        self.py = random.Random(seed)
        self.torch_gen = torch.Generator().manual_seed(seed)
        self.np_gen = np.random.default_rng(seed)
        self.np_legacy = np.random.RandomState(seed)
        self.not_a_generator = seed

    def draw(self):
        return (self.py.random(), torch.rand((), generator=self.torch_gen).item(), self.np_gen.random(),
                self.np_legacy.rand())


def test_sampler_state_round_trips_every_generator_kind(tmp_path):
    harness = HarnessWithGenerators(0)
    harness.draw()
    path = tmp_path / "state.pth"
    torch.save(resume.sampler_state(harness), path)
    expected = harness.draw()
    restored = HarnessWithGenerators(1)
    from transformers.trainer_pt_utils import safe_globals

    with safe_globals():
        resume.load_sampler_state(restored, torch.load(path, weights_only=True))
    assert restored.draw() == expected


def test_sampler_state_dict_is_used_when_defined():
    class Counting:
        def __init__(self):
            self.calls = 0

        def state_dict(self):
            return {"calls": self.calls}

        def load_state_dict(self, state):
            self.calls = state["calls"]

    a, b = Counting(), Counting()
    a.calls = 3
    resume.load_sampler_state(b, resume.sampler_state(a))
    assert b.calls == 3


def test_sampler_state_of_another_configuration_is_an_error():
    state = resume.sampler_state(HarnessWithGenerators(0))

    class OneGenerator:
        rng = None

        def __init__(self):
            self.rng = random.Random(0)

    with pytest.raises(ValueError, match="random generators .* resume with the sampler configuration"):
        resume.load_sampler_state(OneGenerator(), state)


# ------------------------------------------------------------------------------------------------- two processes


@pytest.mark.slow
@pytest.mark.parametrize("method", ["treeopsd", "treeopsd_async", "treeflex"])
def test_two_processes_resume_exactly(tmp_path, method):
    """Each rank saves and restores its own state file (its own buffer and sampler generators) and the resumed run
    equals the uninterrupted one on every rank; "treeopsd_async": at max_staleness 1, each rank's rollout worker with
    the second generation batch in flight at the checkpoint (its weights and the worker's state saved per rank)."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", "TRL_EXPERIMENTAL_SILENCE": "1", "CI": "true"}
    cmd = [sys.executable, "-m", "accelerate.commands.launch", "--multi_gpu", "--num_processes", "2",
           "--num_machines", "1", "-m", "tests.launch.tiny_resume_run", str(tmp_path), method]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600, env=env, cwd=Path(__file__).parents[1])
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    reports = [json.loads(p.read_text()) for p in sorted(tmp_path.glob("resume-rank*.json"))]
    assert [r["rank"] for r in reports] == [0, 1]
    for r in reports:
        assert r["world"] == 2 and r["state_saved"]
        assert r["full_generations"] == [0, 2] and r["resumed_generations"] == [2]
        assert r["same_params"] and r["same_rewards"] and r["same_losses"], r


# ------------------------------------------------------------------------------------------------- real sampling


def sampled_by_the_model(output_dir):
    """The warm-started tiny model sampling its own trees with `model.generate` (the `HFEngine`, through the prefix
    KV store, `generation_cache="prefix"`) and calling a real calculator: nothing scripted."""
    from tests.launch.tiny_tree_run import build_trainer

    return build_trainer(str(output_dir), max_steps=4, save_strategy="steps", save_steps=1)


@pytest.fixture(scope="module")
def uninterrupted_sampled(tmp_path_factory):
    out = tmp_path_factory.mktemp("full_sampled")
    trainer, params, generations = train(sampled_by_the_model, out)
    assert generations == [0, 2]
    return out, trainer, params


@pytest.mark.parametrize("checkpoint", [1, 2])
def test_resume_of_a_model_sampled_run_equals_the_uninterrupted_run(uninterrupted_sampled, tmp_path, checkpoint):
    """Exact resume on the real sampling path: the prefix store is rebuilt from nothing after the resume, the second
    generation batch is drawn by `model.generate` from the restored torch generator, and the final parameters are
    bitwise those of the run that never stopped."""
    from trl_tree.rollout.generating.engine import HFEngine

    out, full, full_params = uninterrupted_sampled
    assert isinstance(full.generation_engine, HFEngine) and full.generation_engine.cache == "prefix"
    trainer, params, generations = train(sampled_by_the_model, tmp_path, out / f"checkpoint-{checkpoint}")
    assert generations == [2]
    assert_same_run(trainer, params, full, full_params)
