"""Asynchronous rollouts (`max_staleness`): the rollout worker, its pacing, its weights and its edges.

The runs are `tests.resume_runs.tree_trainer`'s: TreeOPSD on the tiny model, generation scripted but sampled from
torch's global generator, two trees per micro-batch, E = 2 optimizer blocks per generation batch, on CPU in float32,
so the same operations in the same order give bitwise-equal results.
"""

import logging
import re
import threading

import pytest
import torch
from transformers import TrainerCallback
from transformers.trainer_pt_utils import safe_globals

from tests.resume_runs import agent_turn, questions, sampled_engine
from tests.scripted import config, contains_answer, tiny
from trl_tree import TreeFlexConfig, TreeFlexTrainer, TreeOPSDConfig, TreeOPSDTrainer
from trl_tree.asynchronous import pacing, weights
from trl_tree.asynchronous.worker import RolloutJob, RolloutWorker, StoppableEngine
from trl_tree.testing import calculator
from trl_tree.trainer import resume
from trl_tree.trainer.async_rollouts import use_rollout_worker

STEPS = 6  # three generation batches of E = 2 blocks


def tree_trainer(output_dir, **changes):
    """`tests.resume_runs`' TreeOPSD run without checkpoints: two trees per micro-batch, E = 2, `STEPS` steps."""
    model, tok = tiny()
    fields = {"num_initial_rollouts": 2, "num_branches": 2}
    args = config(
        TreeOPSDConfig,
        output_dir,
        **fields,
        max_turns=4,
        max_completion_length=160,
        per_device_train_batch_size=2 * TreeOPSDConfig.num_generations_for(**fields),
        steps_per_generation=2,
        **{"max_steps": STEPS, **changes},
    )
    # 16 prompts, 4 per generation batch: the run's three batches lie in one epoch (a new epoch starts the worker's
    # pipeline again: its rows cannot be read before the loop begins it)
    trainer = TreeOPSDTrainer(
        model=model,
        reward_funcs=contains_answer,
        args=args,
        train_dataset=questions(16),
        processing_class=tok,
        tools=[calculator],
    )
    trainer.generation_engine = sampled_engine(tok, agent_turn)
    return trainer


def _run(tmp_path, name, max_staleness=None, callbacks=(), reward=None, **changes):
    """Train a `tree_trainer` run; `max_staleness` None: synchronous, else through the worker at that staleness.
    Returns the trainer, its final parameters, its losses and, per generation batch, its prompts and metrics."""
    trainer = tree_trainer(str(tmp_path / name), **changes)
    if max_staleness is not None:
        use_rollout_worker(trainer, max_staleness)
    if reward is not None:
        trainer.reward_funcs = [reward]
    for callback in callbacks:
        trainer.add_callback(callback)
    batches, losses = [], []
    log_generation, compute_loss = trainer._log_generation, trainer.compute_loss

    def record_batch(mode, result):
        batches.append([p[0]["content"] for p in result.prompts])
        return log_generation(mode, result)

    def record_loss(*args, **kwargs):
        loss = compute_loss(*args, **kwargs)
        losses.append(loss.detach().clone())
        return loss

    trainer._log_generation, trainer.compute_loss = record_batch, record_loss
    trainer.train()
    params = {n: p.detach().clone() for n, p in trainer.model.named_parameters() if p.requires_grad}
    return trainer, params, losses, batches


def _logged(trainer, key):
    return [entry[key] for entry in trainer.state.log_history if key in entry]


def _worker_threads():
    return [t for t in threading.enumerate() if t.name == "trl-tree-rollout-worker"]


def _threads_left(before: set) -> list[str]:
    """Threads started since `before` that still run, but for the process-wide ones tqdm and transformers' telemetry
    start once on first use."""
    return [
        t.name
        for t in threading.enumerate()
        if t not in before and t.name != "tqdm_monitor" and "_telemetry_worker" not in t.name
    ]


def test_worker_at_staleness_0_reproduces_the_synchronous_run_bit_for_bit(tmp_path):
    """The worker path in lockstep (each batch admitted when its weights exist, sampled by the worker's own policy
    copy, π_old recomputed by the trainer) trains exactly what the synchronous trainer trains."""
    threads = set(threading.enumerate())
    _, sync_params, sync_losses, sync_batches = _run(tmp_path, "sync")
    trainer, params, losses, batches = _run(tmp_path, "async0", max_staleness=0)
    assert batches == sync_batches and len(batches) == STEPS // 2
    assert len(losses) == len(sync_losses) and all(torch.equal(a, b) for a, b in zip(losses, sync_losses))
    assert all(torch.equal(params[n], sync_params[n]) for n in sync_params)
    assert _logged(trainer, "async/staleness_max") == [0.0] * (STEPS // 2)  # logged once per generation batch
    assert not _threads_left(threads) and not _worker_threads()


def test_staleness_1_samples_each_batch_with_the_weights_one_batch_old_and_reproduces_itself(tmp_path):
    """At max_staleness = 1 batch b is sampled by the weights after batch b − 1 (batch 0 by the initial ones), its
    micro-batches carry the worker's log-probs as the behaviour policy's beside the trainer's π_old, the same prompts
    are trained in the same order as synchronously, and a second seeded run is bitwise the same."""
    _, _, _, sync_batches = _run(tmp_path, "sync")
    trainer, params, losses, batches = _run(tmp_path, "async1", max_staleness=1)
    assert batches == sync_batches
    assert _logged(trainer, "async/policy_version") == [0.0, 0.0, 1.0]
    assert _logged(trainer, "async/staleness_max") == [0.0, 1.0, 1.0]
    _, again_params, again_losses, _ = _run(tmp_path, "async1_again", max_staleness=1)
    assert all(torch.equal(a, b) for a, b in zip(losses, again_losses))
    assert all(torch.equal(params[n], again_params[n]) for n in params)


def test_micro_batches_carry_behaviour_and_old_logps_and_staleness(tmp_path):
    """A batch taken from the worker holds μ (`behaviour_logps`, the worker's forward) and π_old (`old_logps`, the
    trainer's) in the same layout, and each tree's staleness; at staleness 1 after a step they differ."""
    trainer = tree_trainer(str(tmp_path), max_steps=4)
    use_rollout_worker(trainer, 1)
    taken = []
    micro_batches = trainer._async_rollouts.micro_batches
    trainer._async_rollouts.micro_batches = lambda item: taken.append(micro_batches(item)) or taken[-1]
    trainer.train()
    first, second = taken[0][0], taken[1][0]
    for batch in (first, second):
        assert batch["behaviour_logps"].shape == batch["old_logps"].shape
        assert batch["staleness"].dtype == torch.int64 and batch["staleness"].shape == (batch["input_ids"].shape[0],)
    trained = first["turn_ids"] >= 0
    assert first["staleness"].tolist() == [0, 0]
    assert torch.equal(first["behaviour_logps"][trained], first["old_logps"][trained])
    assert second["staleness"].tolist() == [1, 1]
    trained = second["turn_ids"] >= 0
    assert not torch.equal(second["behaviour_logps"][trained], second["old_logps"][trained])


class Boom(RuntimeError):
    pass


def test_a_fault_in_the_worker_stops_training_with_the_workers_own_error(tmp_path):
    """A reward function that raises while the worker grows batch 2 (ahead of the trainer) stops `train` with that
    very exception, noted as the worker's, and no worker thread is left."""
    calls = []

    def reward(completions, **kwargs):
        calls.append(1)
        if len(calls) == 2:
            raise Boom("the reward server is down")
        return [1.0] * len(completions)

    threads = set(threading.enumerate())
    with pytest.raises(Boom, match="the reward server is down") as caught:
        _run(tmp_path, "boom", max_staleness=1, reward=reward)
    assert any("rollout worker" in note for note in caught.value.__notes__)
    assert not _threads_left(threads) and not _worker_threads()


def test_the_trainer_stopping_stops_the_worker(tmp_path):
    """Ctrl-C in the trainer's thread (after the first optimizer step, while the worker grows ahead) ends `train`
    with it, and the worker thread is gone."""

    class Interrupt(TrainerCallback):
        def on_step_end(self, args, state, control, **kwargs):
            raise KeyboardInterrupt

    threads = set(threading.enumerate())
    with pytest.raises(KeyboardInterrupt):
        _run(tmp_path, "interrupted", max_staleness=2, callbacks=[Interrupt()])
    assert not _threads_left(threads) and not _worker_threads()


class StopAfterCheckpoint(TrainerCallback):
    """Stops training (an exception out of `train`) once checkpoint `step` is written whole."""

    def __init__(self, step: int):
        self.step = step

    def on_save(self, args, state, control, **kwargs):
        if state.global_step == self.step:
            raise Stopped(f"stopped after checkpoint-{self.step}")


class Stopped(RuntimeError):
    pass


def _train_recording_steps(trainer, **train_kwargs):
    """`trainer.train(**train_kwargs)`, recording per optimizer step (one micro-batch each here) the dataset rows it
    trains (the question ids in its trees' tokens), its trees' tokens and its loss. When training raises `Stopped`,
    the steps recorded are on the exception (`steps`)."""
    steps, compute_loss = [], trainer.compute_loss
    tok = trainer.processing_class

    def record(model, inputs, *args, **kwargs):
        loss = compute_loss(model, inputs, *args, **kwargs)
        ids = inputs["input_ids"].detach().clone()
        text = tok.decode([t for t in ids.reshape(-1).tolist() if t >= 0])
        rows = sorted({int(i) for i in re.findall(r"\(question (\d+)\)", text)})
        steps.append((rows, ids, loss.detach().clone()))
        return loss

    trainer.compute_loss = record
    try:
        trainer.train(**train_kwargs)
    except Stopped as stopped:
        stopped.steps = steps
        raise
    return steps


CHECKPOINT_EVERY_STEP = dict(save_strategy="steps", save_steps=1)


@pytest.fixture(scope="module")
def uninterrupted_at_staleness_1(tmp_path_factory):
    """The uninterrupted max_staleness=1 run: its steps (rows, tokens, loss), trainer and final parameters."""
    full = tree_trainer(str(tmp_path_factory.mktemp("full")), max_staleness=1, **CHECKPOINT_EVERY_STEP)
    steps = _train_recording_steps(full)
    params = {n: p.detach().clone() for n, p in full.model.named_parameters() if p.requires_grad}
    return steps, full, params


@pytest.mark.parametrize("checkpoint, resumed_staleness", [(2, 1), (3, 1), (3, 0), (3, 2)])
def test_resume_at_staleness_1_trains_every_prompt_once_bit_for_bit(
    uninterrupted_at_staleness_1, tmp_path, caplog, checkpoint, resumed_staleness
):
    """A max_staleness=1 run checkpointing every step is stopped after checkpoint 2 (a generation-batch boundary:
    batch 1 in flight, admitted with version 0) or 3 (between batch 1's two blocks: batch 1's buffer saved, batch 2
    in flight with version 1, older than the checkpoint's weights), then resumed with `resume_from_checkpoint=True`.
    Across the resume every optimizer step trains the rows and trees the uninterrupted run trains at that step, none
    skipped or trained twice. Resumed at max_staleness=1 the run ends bitwise where the uninterrupted one does
    (losses, parameters, policy versions): the batches in flight are regenerated with the weights, sampler state and
    random state they had. Resumed synchronously (max_staleness=0), or at another staleness (2, with a warning), the
    trees are the same (sampler and random state restored), the batch in flight sampled by the checkpoint's newer
    weights."""
    full_steps, full, full_params = uninterrupted_at_staleness_1
    rows = [row for step_rows, _, _ in full_steps for row in step_rows]
    assert len(full_steps) == STEPS and len(rows) == len(set(rows)) == 2 * STEPS  # two trees per step, all distinct

    out = str(tmp_path / "stopped")
    stopping = tree_trainer(out, max_staleness=1, **CHECKPOINT_EVERY_STEP)
    stopping.add_callback(StopAfterCheckpoint(checkpoint))
    with pytest.raises(Stopped) as stopped:
        _train_recording_steps(stopping)
    with safe_globals():  # the saved random state holds NumPy's generator state
        state = torch.load(resume.state_file(f"{out}/checkpoint-{checkpoint}", 0), weights_only=True)
    assert state["rollouts"]["in_flight"] == [(checkpoint - 1) // 2]  # one batch in flight, and its version
    resumed = tree_trainer(out, max_staleness=resumed_staleness, **CHECKPOINT_EVERY_STEP)
    with caplog.at_level(logging.WARNING, logger="trl_tree.trainer.async_rollouts"):
        steps = stopped.value.steps[:checkpoint] + _train_recording_steps(resumed, resume_from_checkpoint=True)
    other_staleness = "saved with max_staleness=1 and is resumed with max_staleness=2" in caplog.text
    assert other_staleness == (resumed_staleness == 2)

    assert [r for r, _, _ in steps] == [r for r, _, _ in full_steps]  # none skipped, none trained twice
    assert all(torch.equal(a, b) for (_, a, _), (_, b, _) in zip(steps, full_steps, strict=True))  # the same trees
    if resumed_staleness != 1:
        return
    assert all(torch.equal(a, b) for (_, _, a), (_, _, b) in zip(steps, full_steps, strict=True))
    params = {n: p.detach().clone() for n, p in resumed.model.named_parameters() if p.requires_grad}
    assert all(torch.equal(params[n], full_params[n]) for n in full_params)
    assert _logged(resumed, "async/policy_version") == _logged(full, "async/policy_version") == [0.0, 0.0, 1.0]


def test_bad_max_staleness_and_unserved_runs_are_refused(tmp_path):
    with pytest.raises(ValueError, match="max_staleness must be an int >= 0"):
        TreeOPSDConfig(output_dir=str(tmp_path), max_staleness=-1)
    model, tok = tiny()
    args = TreeFlexConfig(
        output_dir=str(tmp_path),
        num_searches=2,
        max_staleness=1,
        use_cpu=True,
        report_to="none",
        per_device_train_batch_size=2,
        bf16=False,
    )
    with pytest.raises(ValueError, match="TreeFlex's group of searches"):
        TreeFlexTrainer(
            model=model, reward_funcs=contains_answer, args=args, train_dataset=questions(4), processing_class=tok
        )


# ---------------------------------------------------------------------------------------------- the parts alone


def test_read_ahead_hands_the_loop_the_same_items_in_order_and_peeks_ahead():
    items = [[{"q": i}] for i in range(5)]
    reader = pacing.ReadAhead(iter(items))
    assert reader.peek(3) is items[3] and reader.peek(1) is items[1]
    assert [next(reader), next(reader)] == items[:2]
    assert reader.position_of(items[1]) == 1 and reader.position_of(items[0]) is None  # forgotten once passed
    assert reader.peek(7) is None
    assert list(reader) == items[2:]
    with pytest.raises(ValueError, match="already handed"):
        reader.peek(0)


def test_admission_covers_the_current_batch_and_max_staleness_more():
    assert list(pacing.admitted(3, 0)) == [3] and list(pacing.admitted(3, 2)) == [3, 4, 5]


def test_published_weights_are_a_snapshot_of_the_trainable_parameters_only():
    model = torch.nn.Sequential(torch.nn.Linear(2, 2), torch.nn.Linear(2, 1))
    model[0].requires_grad_(False)  # a frozen base, as under LoRA: it does not travel
    published = weights.publish(model, version=3)
    assert set(published.tensors) == {"1.weight", "1.bias"} and published.version == 3
    copied = weights.policy_copy(model)
    with torch.no_grad():
        model[1].weight.add_(1.0)  # the trainer's next step does not reach the snapshot
    assert not torch.equal(published.tensors["1.weight"], model[1].weight)
    weights.load(copied, weights.publish(model, version=4))
    assert torch.equal(copied[1].weight, model[1].weight) and not copied[1].weight.requires_grad
    with pytest.raises(ValueError, match="lacks"):
        weights.load(torch.nn.Linear(2, 2), published)


def test_worker_returns_batches_in_order_loads_weights_between_them_and_closes():
    loaded = []
    worker = RolloutWorker(lambda item: item * 10, lambda w: loaded.append(w.version))
    v0, v1 = (weights.PolicyWeights(v, {}, 0.0) for v in (0, 1))
    for item, w in ((1, v0), (2, v0), (3, v1)):
        worker.submit(RolloutJob(item, w))
    assert [worker.take().result for _ in range(3)] == [10, 20, 30]
    assert loaded == [0, 1]  # once per new version, between jobs
    worker.close()
    assert not worker.alive


def test_worker_stop_ends_a_job_at_its_next_engine_call():
    class Engine:
        def generate(self, prefixes, max_new_tokens):
            return ["ok"]

    stop = threading.Event()
    engine = StoppableEngine(Engine(), stop)
    started, calls = threading.Event(), []

    def produce(item):  # a job of many engine rounds, as a turn loop makes
        started.set()
        while True:
            calls.append(engine.generate([[1]], [1]))

    worker = RolloutWorker(produce, lambda w: None, stop)
    worker.submit(RolloutJob(0, weights.PolicyWeights(0, {}, 0.0)))
    started.wait()
    worker.close()
    assert not worker.alive and worker.error is None


def test_bench_async_quick_compares_sync_with_staleness_1_and_2(tmp_path):
    """`benchmarks/bench_async.py --quick` runs and writes its table's keys; the figures are the machine's, never
    asserted, but each asynchronous run's batches were sampled exactly max_staleness versions back at most."""
    from tests.test_benchmarks import run_benchmark

    result = run_benchmark("bench_async.py", "--quick", tmp_path=tmp_path)
    rows = {row["variant"]: row for row in result["rows"]}
    assert list(rows) == ["sync", "async_1", "async_2"]
    for row in rows.values():
        assert {"seconds_per_batch", "speedup", "over_limit", "generation_seconds"} <= row.keys()
    for s in (1, 2):
        row = rows[f"async_{s}"]
        assert {"trainer_wait", "producer_wait", "weight_publication_seconds"} <= row.keys()
        assert row["staleness_max"] == s
    assert result["limit_seconds"] > 0
