"""The rollout worker's generation in a child process (`rollout_generation="process"`, docs/design.md §9).

Two levels: `ProcessEngine` alone on the tiny model (a LoRA copy: PEFT's wrapper crosses the process boundary too),
against an `HFEngine` in this process on the same weights and generator state; and whole training runs of
`tests.launch.tiny_tree_run` (warm-started tiny model, real sampling, the calculator tool, E = 2 blocks), against the
worker generating in its thread. On CPU in float32 with the same kernels and thread count, the same draws give the
same bits, so "the same" below is bitwise. A child costs seconds to start: the engine tests share one.
"""

import contextlib
import os
import pickle
import shutil
import signal
import threading
import time

import pytest
import torch
from transformers import GenerationConfig, TrainerCallback

from tests.launch.tiny_tree_run import build_trainer
from tests.resume_runs import sampled_trainer
from tests.scripted import recording_losses, threads_left, tiny
from trl_tree import TreeOPSDConfig
from trl_tree.asynchronous import weights
from trl_tree.rollout.generating import engine_process
from trl_tree.rollout.generating.engine import HFEngine, HFPorts
from trl_tree.rollout.generating.engine_process import GenerationProcessError, ProcessEngine
from trl_tree.trainer.async_rollouts import _child_autocast, use_rollout_worker

PREFIXES = ["What is 1+1?", "Compute 2+3 with the calculator.", "Hello"]


def _ports(model, tok, device="cpu", precision=contextlib.nullcontext) -> HFPorts:
    config = GenerationConfig(do_sample=True, temperature=1.0, top_k=0, pad_token_id=tok.pad_token_id)
    return HFPorts(
        eos_ids={tok.convert_tokens_to_ids("<|im_end|>")}, pad_id=tok.pad_token_id, device=lambda: torch.device(device),
        model=lambda: model, wrapped_model=lambda: model, generation_config=lambda: config,
        unwrapped_for_generation=lambda: contextlib.nullcontext(model), cache="prefix", precision=precision,
    )


def _children() -> list[int]:
    """This process's live child processes (psutil: also those multiprocessing no longer tracks), but for
    multiprocessing's resource tracker, which the first "spawn" starts for the rest of the process's life."""
    psutil = pytest.importorskip("psutil")
    return [c.pid for c in psutil.Process().children(recursive=True)
            if c.status() != psutil.STATUS_ZOMBIE and "resource_tracker" not in " ".join(c.cmdline())]


def _sample(engine, tok, seed: int):
    """One rollout's two calls (the second continues the first's prefixes, reusing the child's stored keys and
    values), from seed `seed`: the continuations and the global generator's state after."""
    torch.manual_seed(seed)
    prefixes = [tok.encode(p) for p in PREFIXES]
    with engine.rollout():
        first = engine.generate(prefixes, [5, 8, 3])
        second = engine.generate([p + c.ids for p, c in zip(prefixes, first)], [4, 4, 4])
    return first + second, torch.get_rng_state()


def _redraw_adapter(policy, std: float, seed: int) -> None:
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in policy.named_parameters():
            if "lora_B" in name:
                p.normal_(0, std, generator=generator)


@pytest.fixture(scope="module")
def lora_engines():
    """A LoRA policy copy (nonzero adapter), an `HFEngine` on it here and a `ProcessEngine` on it in a child."""
    from peft import LoraConfig, get_peft_model

    model, tok = tiny()
    torch.manual_seed(0)  # LoRA's A is drawn from the global generator
    policy = get_peft_model(model, LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"]))
    _redraw_adapter(policy, std=0.5, seed=0)  # LoRA's B starts at 0: an adapter that changed nothing shows nothing
    # what gradient checkpointing adds to an adapter's model: a closure hooked on the input embeddings
    policy.enable_input_require_grads()
    copied = weights.policy_copy(policy)
    local = HFEngine(_ports(copied, tok))
    process = ProcessEngine(HFEngine(_ports(copied, tok)))
    yield policy, copied, tok, local, process
    process.close()


def test_the_child_samples_what_this_process_samples_and_follows_weights_loaded_in_place(lora_engines):
    """From the same generator state the child returns the continuations an `HFEngine` here returns and leaves the
    caller's generator where it would be; after the owner loads new adapter weights into the copy in place
    (`weights.load`, no message to the child), the child's next rollout samples with them."""
    policy, copied, tok, local, process = lora_engines
    assert process.resumes_turns is local.resumes_turns is True  # prefix reuse in the child too
    here, state_here = _sample(local, tok, seed=3)
    there, state_there = _sample(process, tok, seed=3)
    assert there == here and torch.equal(state_there, state_here)
    assert _sample(process, tok, seed=4)[0] != here  # another seed: other tokens (the comparison can fail)

    _redraw_adapter(policy, std=5.0, seed=1)  # an adapter that changes what is sampled
    weights.load(copied, weights.publish(policy, version=1))
    after_here, _ = _sample(local, tok, seed=3)
    after_there, _ = _sample(process, tok, seed=3)
    assert after_there == after_here and after_here != here


def test_the_copy_drops_the_hooks_that_serve_a_backward_and_the_trained_model_keeps_them(lora_engines):
    """Gradient checkpointing with an adapter hooks the input embeddings so that a backward reaches the adapter; the
    policy copy runs none, and the closure would keep it from reaching a child (it cannot be pickled)."""
    policy, copied, *_ = lora_engines

    def require_grads_hooks(model):
        return [h for m in model.modules() for h in m._forward_hooks.values()
                if h.__name__ == "make_inputs_require_grads"]

    assert len(require_grads_hooks(policy)) == 1 and require_grads_hooks(copied) == []
    pickle.dumps(copied)


def test_an_exception_in_the_child_comes_back_with_its_traceback_and_the_child_serves_on(lora_engines):
    _, _, tok, _, process = lora_engines
    with pytest.raises(GenerationProcessError, match=r"generation process \(pid \d+\) raised builtins\.IndexError"
                       ) as caught:
        process.generate([[10**7]], [2])  # a token id past the vocabulary
    assert "Traceback (most recent call last)" in caught.value.child_traceback
    assert "embedding" in caught.value.child_traceback  # the child's own frames
    os.kill(process.pid, signal.SIGINT)  # Ctrl-C is its owner's to handle: the child ignores it
    time.sleep(0.5)
    assert process.alive and len(process.generate([tok.encode("Hi")], [2])) == 1


def test_a_replaced_tensor_is_refused_before_the_child_samples_with_stale_weights(lora_engines):
    """The zero-copy contract: the owner writes into the copy's tensors; a tensor rebound instead lives where the
    child does not look, so the next rollout refuses to start, naming it."""
    _, copied, _, _, process = lora_engines
    layer = copied.base_model.model.model.layers[0].self_attn.q_proj.lora_A["default"]
    shared = layer.weight
    layer.weight = torch.nn.Parameter(shared.detach().clone(), requires_grad=False)
    try:
        with pytest.raises(RuntimeError, match=r"lora_A.*does not live in the memory the generation process maps"):
            with process.rollout():
                pass
    finally:
        layer.weight = shared


class SlowPrecision:
    """A `precision` context for the child that never lets a call finish (picklable: the child imports it)."""

    def __enter__(self):
        time.sleep(600)

    def __exit__(self, *exc):
        return False


def test_a_child_killed_mid_call_fails_the_call_at_once_and_close_leaves_nothing():
    """The child dies (SIGKILL, as the out-of-memory killer sends) while its owner waits on a call that would take
    ten minutes: the call raises the exit at once (within polls, not the call's length), later calls too; `close` is
    idempotent and no child process is left."""
    model, tok = tiny()
    before = set(_children())
    process = ProcessEngine(HFEngine(_ports(weights.policy_copy(model), tok, precision=SlowPrecision)))
    assert process.resumes_turns  # started
    killer = threading.Timer(1.0, os.kill, (process.pid, signal.SIGKILL))
    killer.start()
    started = time.perf_counter()
    try:
        with pytest.raises(RuntimeError, match=r"generation process \(pid \d+\) exited with code -9 \(SIGKILL\)"):
            process.generate([tok.encode("Hi")], [2])
        assert time.perf_counter() - started < 60  # not the ten minutes the call would have taken
        with pytest.raises(RuntimeError, match="exited with code -9"):
            process.generate([tok.encode("Hi")], [2])
    finally:
        killer.join()
        process.close()
        process.close()
    assert not process.alive and set(_children()) <= before


def test_engines_a_child_cannot_run_are_refused_before_it_starts():
    """A copy on another device than the CPU, a precision context no child can unpickle (a trainer's is a callable
    over its accelerator), a copy larger than the free shared memory: refused with what to do, before any child
    starts or any weight moves, not a child that runs without it or a copy that fails half moved."""
    model, tok = tiny()
    before = set(_children())
    with pytest.raises(ValueError, match="generates on the CPU only; this engine's device is meta"):
        ProcessEngine(HFEngine(_ports(model, tok, device="meta")))
    with pytest.raises(ValueError, match=r"precision context .* cannot be sent to a child process.*pass ProcessEngine "
                       r"a picklable `precision`"):
        ProcessEngine(HFEngine(_ports(model, tok, precision=lambda: contextlib.nullcontext())))
    with pytest.MonkeyPatch.context() as m:  # a container's /dev/shm, 64 MB unless sized, full
        disk_usage = shutil.disk_usage
        m.setattr(engine_process.shutil, "disk_usage", lambda path: disk_usage(path)._replace(free=0))
        with pytest.raises(ValueError, match=r"needs \d+ MiB of shared memory .* has 0 MiB free.*--shm-size"):
            ProcessEngine(HFEngine(_ports(model, tok)))
    assert set(_children()) <= before and not any(t.is_shared() for t in model.parameters())


# ---------------------------------------------------------------------------------------------- training runs

STEPS = 6  # three generation batches of E = 2 blocks: at staleness 1 sampled by versions 0, 0, 1


def _train(tmp_path, name, generation=None, max_staleness=None, **changes):
    """A `build_trainer` run of `STEPS` steps: synchronous (`max_staleness` None), through the worker in lockstep
    (0), or at that staleness; `generation` where the worker generates. Returns its losses, final trainable
    parameters, logged policy versions and its trainer."""
    fields = {"rollout_generation": generation} if max_staleness else {}
    if max_staleness:
        fields["max_staleness"] = max_staleness
    trainer = build_trainer(str(tmp_path / name), max_steps=STEPS, **fields, **changes)
    if max_staleness == 0:
        use_rollout_worker(trainer, 0, generation)
    losses = recording_losses(trainer)
    trainer.train()
    params = {n: p.detach().clone() for n, p in trainer.model.named_parameters() if p.requires_grad}
    versions = [e["async/policy_version"] for e in trainer.state.log_history if "async/policy_version" in e]
    return losses, params, versions, trainer


def _same(run, other) -> bool:
    """The same losses and final parameters, bit for bit (and versions, where both logged them)."""
    (losses, params, versions, _), (other_losses, other_params, other_versions, _) = run, other
    return ((versions == other_versions or not other_versions) and len(losses) == len(other_losses) == STEPS
            and all(torch.equal(a, b) for a, b in zip(losses, other_losses))
            and all(torch.equal(params[n], other_params[n]) for n in other_params))


@pytest.mark.parametrize("max_staleness", [0, 1])
def test_generating_in_a_child_trains_bit_for_bit_what_the_worker_thread_trains(tmp_path, max_staleness):
    """In lockstep (s = 0) the process worker trains what the thread worker and the synchronous trainer train; at
    s = 1 what the thread worker trains at s = 1: the same draws (the generator handed to the child and back), the
    same weights per version (loaded into the shared copy in place). No child process or thread is left."""
    threads, children = set(threading.enumerate()), set(_children())
    in_process = _train(tmp_path, "process", "process", max_staleness)
    assert not threads_left(threads) and set(_children()) <= children
    assert in_process[3]._async_rollouts.generation_process is None  # closed with the session
    in_thread = _train(tmp_path, "thread", "thread", max_staleness)
    assert _same(in_process, in_thread)
    assert in_process[2] == ([0.0, 1.0, 2.0] if max_staleness == 0 else [0.0, 0.0, 1.0])
    if max_staleness == 0:
        assert _same(in_process, _train(tmp_path, "sync"))


def test_the_child_killed_mid_run_stops_training_with_the_exit_and_leaves_nothing(tmp_path):
    """A reward function (in the worker's thread, scoring batch 0) kills the generation process: the worker's next
    job (batch 1) fails on its first call, and `train` stops with that error; no thread or child is left."""
    threads, children = set(threading.enumerate()), set(_children())
    trainer = build_trainer(str(tmp_path), max_steps=STEPS, max_staleness=1, rollout_generation="process")
    killed = []

    def killing_reward(completions, **kwargs):
        if not killed:
            killed.append(trainer._async_rollouts.generation_process.pid)
            os.kill(killed[0], signal.SIGKILL)
        return [0.0] * len(completions)

    trainer.reward_funcs = [killing_reward]
    with pytest.raises(RuntimeError, match=r"generation process \(pid \d+\) exited with code -9") as caught:
        trainer.train()
    assert any("rollout worker" in note for note in caught.value.__notes__)
    assert trainer._async_rollouts.generation_process is None and trainer._async_rollouts.worker is None
    assert not threads_left(threads) and set(_children()) <= children and killed[0] not in _children()


class _StopAfterCheckpoint(TrainerCallback):
    def on_save(self, args, state, control, **kwargs):
        if state.global_step == 3:
            raise KeyboardInterrupt  # as Ctrl-C in the trainer's thread, after checkpoint 3


def test_a_resumed_run_trains_bit_for_bit_what_the_uninterrupted_run_trains(tmp_path):
    """The generator state the worker captures after each batch (`random_state.capture`) is the one the child left:
    stopped by Ctrl-C after checkpoint 3 (between batch 1's blocks, batch 2 in flight) and resumed, a run at s = 1
    trains the uninterrupted run's losses and parameters, bit for bit; no child is left by the interrupted run."""
    fields = dict(max_steps=STEPS, max_staleness=1, rollout_generation="process", save_strategy="steps", save_steps=1)
    full = build_trainer(str(tmp_path / "full"), **fields)
    full_losses = recording_losses(full)
    full.train()
    children = set(_children())
    stopping = build_trainer(str(tmp_path / "stopped"), **fields)
    stopping.add_callback(_StopAfterCheckpoint())
    losses = recording_losses(stopping)
    with pytest.raises(KeyboardInterrupt):
        stopping.train()
    assert set(_children()) <= children
    resumed = build_trainer(str(tmp_path / "stopped"), **fields)
    resumed_losses = recording_losses(resumed)
    resumed.train(resume_from_checkpoint=True)
    losses = losses[:3] + resumed_losses
    assert len(losses) == len(full_losses) == STEPS and all(torch.equal(a, b) for a, b in zip(losses, full_losses))
    assert all(torch.equal(p, q) for p, q in zip(resumed.model.parameters(), full.model.parameters()))


# ---------------------------------------------------------------------------------------------- refusals


def test_bad_values_and_a_run_without_a_worker_are_refused_by_the_config(tmp_path):
    with pytest.raises(ValueError, match=r"rollout_generation must be one of \('thread', 'process'\); got 'fork'"):
        TreeOPSDConfig(output_dir=str(tmp_path), max_staleness=1, rollout_generation="fork")
    with pytest.raises(ValueError, match=r"cannot serve this run: max_staleness=0 has no rollout worker"):
        TreeOPSDConfig(output_dir=str(tmp_path), rollout_generation="process")


def test_runs_it_cannot_serve_are_refused_with_why(tmp_path, monkeypatch):
    """vLLM (its server generates), several processes (not built) and a custom engine, the last when training starts
    (an engine swapped after the trainer was built), before any child or thread is started."""
    trainer = sampled_trainer(str(tmp_path / "custom"), prompts=8, steps_per_generation=2, max_steps=2,
                              max_staleness=1, rollout_generation="process")  # its engine: scripted, set after
    threads, children = set(threading.enumerate()), set(_children())
    with pytest.raises(ValueError, match=r"rollout_generation=\"process\" .* cannot serve this run: its generation "
                       r"engine is a ScriptedEngine, not an HFEngine.*Use rollout_generation=\"thread\""):
        trainer.train()
    assert not threads_left(threads) and set(_children()) <= children

    trainer = build_trainer(str(tmp_path / "hf"))
    with monkeypatch.context() as m:
        m.setattr(type(trainer.accelerator), "num_processes", property(lambda self: 2))
        with pytest.raises(ValueError, match="on 2 processes: a generation process per rank is not built"):
            use_rollout_worker(trainer, 1, "process")
    monkeypatch.setattr(trainer, "use_vllm", True)
    monkeypatch.setattr(trainer.args, "vllm_mode", "server")
    with pytest.raises(ValueError, match="vLLM, whose server is a process of its own already"):
        use_rollout_worker(trainer, 1, "process")
    with pytest.raises(ValueError, match="rollout_generation must be one of"):
        use_rollout_worker(trainer, 1, "processes")


def test_the_trainers_autocast_reaches_the_child_as_the_same_autocast(tmp_path):
    """The HF ports' precision is the trainer's `accelerator.autocast()`, a closure no child can unpickle; the child
    gets a picklable factory that, unpickled, sets autocast exactly as it does (bf16), or none at all (float32)."""

    def autocast_state():
        return torch.is_autocast_enabled("cpu"), torch.get_autocast_dtype("cpu"), torch.is_autocast_cache_enabled()

    trainer = sampled_trainer(str(tmp_path / "bf16"), bf16=True)
    with trainer.accelerator.autocast():
        expected = autocast_state()
    with pickle.loads(pickle.dumps(_child_autocast(trainer)))():
        assert autocast_state() == expected and expected[:2] == (True, torch.bfloat16)
    assert _child_autocast(sampled_trainer(str(tmp_path / "fp32"))) is contextlib.nullcontext
