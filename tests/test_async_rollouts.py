"""Asynchronous rollouts (`max_staleness`): the rollout worker, its pacing, its weights and its edges.

The runs are `tests.resume_runs.sampled_trainer`'s: TreeOPSD on the tiny model, generation scripted but sampled from
torch's global generator, two trees per micro-batch, E = 2 optimizer blocks per generation batch, on CPU in float32,
so the same operations in the same order give bitwise-equal results.
"""

import functools
import logging
import re
import threading
import time

import pytest
import torch
from transformers import TrainerCallback
from transformers.trainer_pt_utils import safe_globals

from tests.launch.tiny_tree_run import CONFIGURATIONS, build_trainer, components
from tests.resume_runs import questions, sampled_trainer
from tests.scripted import contains_answer, recording_losses, threads_left, tiny
from trl_tree import TreeFlexConfig, TreeFlexTrainer, TreeOPSDConfig, methods
from trl_tree.asynchronous import pacing, weights
from trl_tree.asynchronous.worker import RolloutJob, RolloutWorker, StoppableEngine
from trl_tree.trainer import async_rollouts, resume
from trl_tree.trainer.async_rollouts import use_rollout_worker

STEPS = 6  # three generation batches of E = 2 blocks
TREE_SAMPLERS = [n for n, s in methods.SAMPLERS.items() if s.unit == "tree"]  # TreeFlex's searches: refused


def tree_trainer(output_dir, **changes):
    """`tests.resume_runs`' sampled TreeOPSD run without checkpoints: two trees per micro-batch, E = 2, `STEPS` steps.
    16 prompts, 4 per generation batch: the run's three batches lie in one epoch (a new epoch starts the worker's
    pipeline again: its rows cannot be read before the loop begins it)."""
    return sampled_trainer(output_dir, prompts=16, steps_per_generation=2, **{"max_steps": STEPS, **changes})


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
    assert not threads_left(threads) and not _worker_threads()


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
    assert not threads_left(threads) and not _worker_threads()


def test_the_trainer_stopping_stops_the_worker(tmp_path):
    """Ctrl-C in the trainer's thread (after the first optimizer step, while the worker grows ahead) ends `train`
    with it, and the worker thread is gone."""

    class Interrupt(TrainerCallback):
        def on_step_end(self, args, state, control, **kwargs):
            raise KeyboardInterrupt

    threads = set(threading.enumerate())
    with pytest.raises(KeyboardInterrupt):
        _run(tmp_path, "interrupted", max_staleness=2, callbacks=[Interrupt()])
    assert not threads_left(threads) and not _worker_threads()


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


@pytest.mark.parametrize("name", [n for n in CONFIGURATIONS if components(n)["sampler"] in TREE_SAMPLERS])
def test_every_tree_configuration_trains_at_staleness_1(tmp_path, name):
    """Every named method and composition that grows trees (every tree sampler, credit and loss between them, as the
    golden record trains them) trains through the rollout worker at max_staleness 1 with real generation on the tiny
    model: its second batch is sampled one version back, its behaviour log-probs travel beside π_old, and its losses
    are finite. (TreeFlex, whose harness grows searches, is refused: `test_bad_max_staleness_and_unserved...`.)"""
    trainer = build_trainer(str(tmp_path), method=name, max_steps=4, prompts=8, max_staleness=1)
    losses = recording_losses(trainer)
    trainer.train()
    assert _logged(trainer, "async/staleness_max") == [0.0, 1.0]
    assert len(losses) == 4 and all(torch.isfinite(x) for x in losses)


def test_with_activation_checkpointing_the_trainer_never_rewinds_the_generator_the_worker_samples_from(tmp_path):
    """Checkpointing's backward replays the forward's random state (torch's `preserve_rng_state`): it would set the
    global generator back while the worker samples from it, so samples would repeat and depend on timing. A worker
    session turns the replay off (no dropout is active) and puts it back when training ends; a seeded run with
    checkpointing at staleness 1 then reproduces itself bit for bit."""
    calls = []
    set_rng_state = torch.set_rng_state

    def recording(state):
        calls.append(threading.current_thread().name)
        return set_rng_state(state)

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(torch, "set_rng_state", recording)
        mp.setattr(torch.random, "set_rng_state", recording)  # what torch.random.fork_rng restores with
        trainer, params, losses, _ = _run(tmp_path, "ckpt", max_staleness=1, gradient_checkpointing=True)
    layers = [m for m in trainer.model.modules() if "_gradient_checkpointing_func" in m.__dict__]
    assert layers and all(m.gradient_checkpointing for m in layers if hasattr(m, "gradient_checkpointing"))
    assert calls == []  # nobody set the global generator during training
    assert all(not isinstance(m._gradient_checkpointing_func, functools.partial)
               or "preserve_rng_state" not in m._gradient_checkpointing_func.keywords for m in layers)  # put back
    _, again, again_losses, _ = _run(tmp_path, "ckpt_again", max_staleness=1, gradient_checkpointing=True)
    assert all(torch.equal(a, b) for a, b in zip(losses, again_losses))
    assert all(torch.equal(params[n], again[n]) for n in params)


def test_dropout_with_activation_checkpointing_is_refused_with_why(tmp_path):
    trainer = tree_trainer(str(tmp_path), gradient_checkpointing=True)
    unwrapped = trainer.accelerator.unwrap_model(trainer.model)
    unwrapped.model.layers[0].mlp.add_module("drop", torch.nn.Dropout(0.1))
    with pytest.raises(ValueError, match=r"checkpointing and active dropout \(model\.layers\.0\.mlp\.drop\)"):
        use_rollout_worker(trainer, 1)


def test_sharded_weights_are_refused_with_why(tmp_path, monkeypatch):
    """ZeRO-3 and FSDP shard the weights: the worker's full policy copy cannot be taken, and the refusal says which
    launches are served instead."""
    import transformers.integrations.deepspeed as ds

    trainer = tree_trainer(str(tmp_path))
    assert async_rollouts.unsupported(trainer) is None
    monkeypatch.setattr(ds, "is_deepspeed_zero3_enabled", lambda: True)
    with pytest.raises(ValueError, match=r"sharded over the ranks \(DeepSpeed ZeRO-3 or FSDP\).*ZeRO-1/2 and DDP"):
        use_rollout_worker(trainer, 1)


def test_rank_alone_rewards_skip_trls_gather_in_that_thread_only(monkeypatch):
    """TRL's `_calculate_rewards` ends with accelerate's `gather`: inside `rank_alone_rewards` it is the identity for
    the calling thread, while another thread at the same moment still reaches the real gather."""
    import trl.trainer.grpo_trainer as grpo

    from trl_tree import trl_internals

    with trl_internals.rank_alone_rewards():  # installs the switch
        pass
    monkeypatch.setattr(grpo.gather, "__wrapped__", lambda tensor: "gathered")
    other = []
    with trl_internals.rank_alone_rewards():
        x = torch.arange(3.0)
        thread = threading.Thread(target=lambda: other.append(grpo.gather(x)))
        thread.start()
        thread.join(5)
        assert grpo.gather(x) is x  # this thread: ungathered, the very tensor
    assert other == ["gathered"] and grpo.gather(x) == "gathered"  # the other thread, and this one after


def test_rank_alone_reductions_are_over_this_rank_only():
    from trl_tree.trainer.observability import rank_metrics

    alone = rank_metrics.RankAlone(torch.device("cpu"))
    assert rank_metrics.max_over_ranks(alone, 3) == 3 and rank_metrics.any_rank(alone, False) is False
    assert rank_metrics.mean_over_ranks(alone, [1.0, 2.0, 6.0]) == 3.0
    assert rank_metrics.gather_objects(alone, ["a", "b"]) == ["a", "b"]


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


def test_a_weight_load_that_stalls_stops_the_trainer_within_its_deadline():
    """A publication that never completes (a hung copy, a server that stopped answering) does not hang the trainer:
    its `take` raises a TimeoutError naming the stall within a poll of the deadline, and the thread is released."""
    release = threading.Event()
    worker = RolloutWorker(lambda item: item, lambda w: release.wait(30), load_seconds=0.3, join_seconds=5)
    worker.submit(RolloutJob(0, weights.PolicyWeights(0, {}, 0.0)))
    started = time.perf_counter()
    with pytest.raises(TimeoutError, match="weight publication stalled"):
        worker.take()
    assert time.perf_counter() - started < 5
    release.set()
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
