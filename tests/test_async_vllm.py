"""The rollout worker's vLLM server path (`trl_tree.trainer.async_vllm`), with only the server faked (no vllm needed).

The fake sits where the server would: a `VLLMClient` of TRL's whose `generate` samples a scripted agent and whose
`update_named_params` / `reset_prefix_cache` keep what the "server" holds, so TRL's own `VLLMGeneration` (its
`generate`, its `sync_weights` with the PEFT merge and the cache reset) runs unchanged. What is checked: the worker
pushes each published version once, between its jobs, never during a generation call, with the published tensors
(the merged published adapter under LoRA), every generation call of batch j finds the server holding exactly the
version its job was admitted with, the copy's base stays the trainer's after TRL's merge and unmerge, a push of the
trainer's own engine (evaluation) makes the worker push again, and colocate mode and several processes are refused.

Real vLLM (a `trl vllm-serve` server on CPU) is tests/vllm_cpu/test_async_vllm_server.py, in its own environment.
"""

from __future__ import annotations

import sys
import threading
import time
from types import SimpleNamespace

import pytest
import torch
from accelerate import Accelerator
from trl.generation.vllm_client import VLLMClient
from trl.generation.vllm_generation import VLLMGeneration

from tests.resume_runs import agent_turn, questions, sampled_engine
from tests.scripted import config, contains_answer, tiny
from trl_tree import TreeOPSDConfig, TreeOPSDTrainer
from trl_tree.asynchronous import weights
from trl_tree.rollout.generating.vllm_engine import VLLMEngine
from trl_tree.testing import calculator
from trl_tree.trainer import async_rollouts
from trl_tree.trainer.async_vllm import ServedPolicy
from trl_tree.trainer.engine_ports import vllm_ports

STEPS = 6  # three generation batches of E = 2 blocks


class FakeServer(VLLMClient):
    """TRL's client over a pretend server: `generate` samples `script` (torch's generator, as the scripted runs do),
    `update_named_params` keeps the streamed tensors as the weights the server holds (TRL's broadcast replaced), and
    every call is recorded in `events` with the thread it came from."""

    def __init__(self, script):
        self.base_url, self.model, self.communicator, self._updating_weights = "http://fake", "fake", None, False
        self.script, self.held, self.events, self.streamed = script, {}, [], []
        self.generating = False  # inside a generate call now
        self.pushed_while_generating = 0

    def generate(self, prompts, max_tokens=16, **kwargs):
        self.generating = True
        try:
            self.events.append(("generate", threading.current_thread().name, dict(self.held)))
            out = self.script.generate(prompts, [max_tokens] * len(prompts))
            return {
                "prompt_ids": prompts,
                "completion_ids": [c.ids for c in out],
                "logprobs": [[[0.0] for _ in c.ids] for c in out],
                "logprob_token_ids": [[[t] for t in c.ids] for c in out],
            }
        finally:
            self.generating = False

    def update_named_params(self, metadata, named_params):
        self.pushed_while_generating += self.generating
        streamed = {name: tensor.detach().clone() for name, tensor in named_params}
        assert [m[0] for m in metadata] == list(streamed)  # TRL announces what it streams, in order
        self.held.update(streamed)
        self.streamed.append(streamed)
        self.events.append(("push", threading.current_thread().name, dict(self.held)))

    def reset_prefix_cache(self):
        self.events.append(("reset", threading.current_thread().name, None))


@pytest.fixture
def fake_server(monkeypatch):
    """Every `VLLMGeneration` built in the test talks to one `FakeServer` (TRL's `_init_vllm` replaced; the rest of
    VLLMGeneration is TRL's)."""
    _, tok = tiny()
    server = FakeServer(sampled_engine(tok, agent_turn))
    monkeypatch.setattr(VLLMGeneration, "_init_vllm", lambda self: setattr(self, "vllm_client", server))
    return server


def vllm_trainer(output_dir, **changes):
    """`tests.test_async_rollouts`' run (TreeOPSD, two trees per micro-batch, E = 2) generating through vLLM in server
    mode: the trainer's engine is the `VLLMEngine` (nothing swapped), the server the fake."""
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
        max_steps=STEPS,
        use_vllm=True,
        **{"vllm_mode": "server", **changes},
    )
    return TreeOPSDTrainer(
        model=model,
        reward_funcs=contains_answer,
        args=args,
        train_dataset=questions(16),
        processing_class=tok,
        tools=[calculator],
    )


def _version_held(held: dict, published: dict[int, weights.PolicyWeights]) -> int | None:
    """The published version whose every tensor the server holds exactly, or None."""
    found = [
        v for v, w in published.items() if all(n in held and torch.equal(held[n], t) for n, t in w.tensors.items())
    ]
    return found[-1] if found else None


def test_the_worker_pushes_each_version_once_between_jobs_and_each_batch_is_sampled_by_its_version(
    tmp_path, fake_server, monkeypatch
):
    published: dict[int, weights.PolicyWeights] = {}
    publish = weights.publish

    def recording_publish(model, version):
        published[version] = publish(model, version)
        return published[version]

    monkeypatch.setattr(weights, "publish", recording_publish)
    trainer = vllm_trainer(tmp_path, max_staleness=1)
    rollouts = trainer._async_rollouts
    produce, jobs = rollouts._produce, []

    def marked_produce(item):  # the worker's jobs, in order: pushes must fall between them
        jobs.append(len(jobs))
        fake_server.events.append(("job", len(jobs) - 1, None))
        try:
            return produce(item)
        finally:
            fake_server.events.append(("end", len(jobs) - 1, None))

    load = rollouts._load

    def late_load(published_weights):
        """Push versions after the first only once the trainer has stepped past them (it trains the batch before
        without them): a push that read the live model would then send other weights."""
        deadline = time.monotonic() + 60
        while 0 < published_weights.version and trainer.state.global_step <= 2 * published_weights.version:
            assert time.monotonic() < deadline, "the trainer never stepped past the version"
            time.sleep(0.01)
        return load(published_weights)

    rollouts._produce, rollouts._load = marked_produce, late_load
    trainer.train()

    versions = [e["async/policy_version"] for e in trainer.state.log_history if "async/policy_version" in e]
    assert versions == [0.0, 0.0, 1.0]  # batch j sampled by version max(0, j - 1)
    assert [e["async/staleness_max"] for e in trainer.state.log_history if "async/staleness_max" in e] == [0, 1, 1]
    pushes = [e["async/weight_push_time"] for e in trainer.state.log_history if "async/weight_push_time" in e]
    assert pushes[0] > 0 and pushes[1] == 0.0 and pushes[2] > 0  # batch 1 found version 0 on the server

    # every generation call of job j (all in the worker's thread) found the server holding exactly its version
    job, held_by_job = None, {}
    for kind, who, held in fake_server.events:
        if kind in ("job", "end"):
            job = who if kind == "job" else None
        elif kind == "generate":
            assert who == "trl-tree-rollout-worker" and job is not None
            held_by_job.setdefault(job, set()).add(_version_held(held, published))
    assert [held_by_job[j] for j in range(3)] == [{0}, {0}, {1}]

    # pushes: from the worker, between its jobs, each followed by TRL's prefix-cache reset, each version once
    job, pushed_versions = None, []
    for i, (kind, who, held) in enumerate(fake_server.events):
        if kind in ("job", "end"):
            job = who if kind == "job" else None
        elif kind == "push":
            assert who == "trl-tree-rollout-worker" and job is None  # the `load` hook, before the job starts
            assert fake_server.events[i + 1][0] == "reset"
            pushed_versions.append(_version_held(held, published))
    assert pushed_versions[:2] == [0, 1] and pushed_versions == sorted(set(pushed_versions))  # a late job may add 2
    assert fake_server.pushed_while_generating == 0
    # the tensors streamed are the published snapshot (all trainable here), not the live model, which moved on
    for streamed, version in zip(fake_server.streamed, pushed_versions):
        assert all(torch.equal(streamed[n], t) for n, t in published[version].tensors.items())
    assert any(not torch.equal(p, fake_server.streamed[1][n]) for n, p in trainer.model.named_parameters())
    assert rollouts.worker is None and rollouts.served is None  # the session ended with train()


def _lora_trainer(server_script, monkeypatch):
    """A trainer-shaped object for `ServedPolicy` with a LoRA policy whose adapter is not zero, and TRL's real
    `VLLMGeneration` in server mode over a `FakeServer`."""
    from peft import LoraConfig, get_peft_model

    model, tok = tiny()
    torch.manual_seed(0)
    policy = get_peft_model(model, LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"],
                                              init_lora_weights=False))
    server = FakeServer(server_script)
    monkeypatch.setattr(VLLMGeneration, "_init_vllm", lambda self: setattr(self, "vllm_client", server))
    accelerator = Accelerator(cpu=True)
    generation = VLLMGeneration(model=policy, accelerator=accelerator, processing_class=tok, mode="server")
    trainer = SimpleNamespace(
        vllm_generation=generation,
        model=policy,
        state=SimpleNamespace(global_step=0),
        _last_loaded_step=-1,
        eos_token_ids=[tok.convert_tokens_to_ids("<|im_end|>")],
        _tokenizer=tok,
        accelerator=accelerator,
        args=SimpleNamespace(report_to=[]),
    )
    return trainer, server


def _train_adapter(model, seed):
    """As an optimizer step would: move every adapter weight."""
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            if p.requires_grad:
                p.add_(torch.randn(p.shape, generator=generator) * 0.05)


def test_with_lora_only_the_adapter_travels_and_the_server_gets_the_merged_published_weights(monkeypatch):
    _, tok = tiny()
    trainer, server = _lora_trainer(sampled_engine(tok, agent_turn), monkeypatch)
    policy = trainer.model
    copied = weights.policy_copy(policy)
    _train_adapter(policy, seed=1)
    published = weights.publish(policy, version=1)
    assert published.tensors and all("lora_" in name for name in published.tensors)  # the adapter alone travels
    _train_adapter(policy, seed=2)  # the trainer moves on: the push must not read it
    weights.load(copied, published)

    # the control: TRL's sync alone (merge, stream, unmerge) leaves the copy's base off the trainer's by rounding
    bare = weights.policy_copy(copied)
    unmerged = ServedPolicy(trainer, bare)
    unmerged.generation.sync_weights()
    base = {n: p for n, p in policy.named_parameters() if not p.requires_grad}
    assert any(not torch.equal(p, base[n]) for n, p in bare.named_parameters() if n in base)
    server.streamed.clear()

    served = ServedPolicy(trainer, copied)
    assert served.push(1) > 0 and served.holds(1) and trainer._last_loaded_step is None
    (streamed,) = server.streamed
    vllm_names = {n for n, _ in tiny()[0].named_parameters()}  # the plain model's names: what vLLM loads
    assert set(streamed) == vllm_names
    layer = copied.base_model.model.model.layers[0].self_attn.q_proj
    a, b = (published.tensors[f"base_model.model.model.layers.0.self_attn.q_proj.lora_{x}.default.weight"]
            for x in "AB")
    merged = layer.base_layer.weight + layer.scaling["default"] * (b @ a)
    torch.testing.assert_close(streamed["model.layers.0.self_attn.q_proj.weight"], merged, rtol=0, atol=1e-6)
    # μ's copy keeps the trainer's base bit for bit, and the published adapter
    assert all(torch.equal(p, base[n]) for n, p in copied.named_parameters() if n in base)
    assert all(torch.equal(dict(copied.named_parameters())[n], t) for n, t in published.tensors.items())
    assert served.push(1) == 0.0 and len(server.streamed) == 1  # held already: nothing travels


def test_a_push_of_the_trainers_own_engine_makes_the_worker_push_its_version_again(monkeypatch):
    """Evaluation generates with the trainer's engine, which syncs the trainer's live weights; the worker's next
    job must find its own version on the server again, and evaluation after a worker push syncs again too."""
    _, tok = tiny()
    trainer, server = _lora_trainer(sampled_engine(tok, agent_turn), monkeypatch)
    copied = weights.policy_copy(trainer.model)
    served = ServedPolicy(trainer, copied)
    evaluation = VLLMEngine(vllm_ports(trainer))
    served.push(0)
    trainer.state.global_step = 3
    evaluation.generate([[5, 6]], [4])  # the trainer's engine pushes the trainer's weights (step 3)
    assert trainer._last_loaded_step == 3 and not served.holds(0)
    assert served.push(0) > 0 and served.holds(0) and served.pushes == 2
    evaluation.generate([[5, 6]], [4])
    assert trainer._last_loaded_step == 3 and len(server.streamed) == 4  # worker, trainer, worker, trainer
    worker_engine = VLLMEngine(served.ports())
    served.push(0)
    worker_engine.generate([[5, 6]], [4])  # the worker's engine never syncs by itself
    assert len(server.streamed) == 5 and [e[0] for e in server.events[-3:]] == ["push", "reset", "generate"]


def test_colocated_or_multi_process_vllm_is_refused_with_why(tmp_path, fake_server):
    def trainer(mode, processes=1):
        return SimpleNamespace(
            accelerator=SimpleNamespace(num_processes=processes),
            use_vllm=True,
            args=SimpleNamespace(vllm_mode=mode),
            is_fsdp_enabled=False,
        )

    assert "nothing to overlap" in async_rollouts.unsupported(trainer("colocate"))
    assert "on 2 processes" in async_rollouts.unsupported(trainer("server", 2))
    with pytest.raises(ValueError, match="in 'colocate' mode, which shares the trainer's GPU and weights"):
        vllm_trainer(tmp_path, max_staleness=1, vllm_mode="colocate")


def test_the_gpu_sections_model_folder_is_what_the_server_and_the_trainers_load(tmp_path, benchmark_script):
    """benchmarks/gpu_async_vllm.py's model (a random Qwen3 of the run's shape with the tiny tokenizer), saved where
    `trl vllm-serve` and both trainers load it: one vocabulary for the model and its tokenizer, the run's depth."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    try:
        gpu_suite = benchmark_script("gpu_suite")
        section = benchmark_script("gpu_async_vllm")
        args = gpu_suite.parse_args(["--cpu", "--sections", "async_vllm", "--layers", "3"])
        folder = section.model_folder(args, tmp_path / "model")
    finally:  # the fixture forgets only its own scripts' modules
        for name in ("gpu_suite", "gpu_async_vllm", "bench_packing_gpu"):
            sys.modules.pop(name, None)
    model, tok = AutoModelForCausalLM.from_pretrained(folder), AutoTokenizer.from_pretrained(folder)
    assert model.config.vocab_size == len(tok) and model.config.num_hidden_layers == 3
    assert model.config.eos_token_id == tok.convert_tokens_to_ids("<|im_end|>") and tok.chat_template
    assert (args.async_vllm_batches, args.async_vllm_warmup, args.async_vllm_server_gpu) == (3, 1, 1)
