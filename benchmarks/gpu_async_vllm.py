"""gpu_suite.py's `async_vllm` section: tree rollouts through a vLLM server (`vllm_mode="server"`, `trl vllm-serve`),
synchronous against asynchronous at max_staleness 1 (issue 57, item 4): steady-state wall seconds per generation
batch, the trainer's wait for the worker, the worker's wait for admission, and the weight pushes.

What it needs that the rest of the suite does not, hence a section that runs only when named (`--sections
async_vllm`):
- TRL, datasets and vLLM (a CUDA build that matches torch) in the environment: the trainer and the server are real;
- two GPUs: the server on one (`--async_vllm_server_gpu`, default 1), the trainer on the other (cuda:0). TRL's
  weight sync is an NCCL group of the trainer and the server's workers, and NCCL refuses two ranks on one GPU
  ("Duplicate GPU detected"); TRL's client has no other transport. With fewer than two GPUs the section records why
  it did not run instead of measuring.

Workload: TreeOPSD on a randomly initialised Qwen3 of the run's shape (`--model`, `--layers`) with the tiny tokenizer's
vocabulary, saved to a temporary folder the server loads (nothing is downloaded), in the run's dtype; (M, N) trees
from `--num_initial_rollouts` / `--num_branches`, `--async_vllm_trees` per micro-batch, E = 2 optimizer blocks per
generation batch, every turn up to `--async_vllm_completion_tokens` tokens (a random policy writes no tool call, so a
leaf is one turn, most of them cut at the budget). Both variants train `--async_vllm_batches` generation batches from
the same initial weights against the same server; the first `--async_vllm_warmup` are left out. Synchronous: the
trainer's own engine pushes its weights before each generation batch (TRL's sync, as GRPOTrainer); asynchronous: the
rollout worker generates batch j with version max(0, j - 1), pushed by TRL's sync from the worker's copy between its
jobs (`trl_tree.trainer.async_vllm`).

`run(args, device, server_url=..., model_path=...)` measures against a server already running (the vLLM-CPU test,
tests/vllm_cpu/test_async_vllm_server.py, runs this code at tiny sizes that way, with a stand-in for the NCCL leg).
"""

from __future__ import annotations

import contextlib
import os
import statistics
import subprocess
import tempfile
import time
from pathlib import Path

import torch

from trl_tree.testing import free_port, stop_process_group

E = 2  # optimizer blocks per generation batch
SERVER_START_SECONDS = 600






@contextlib.contextmanager
def serve(model_path: str, gpu: int, dtype: str, log: Path, memory_utilization: float = 0.5):
    """`trl vllm-serve` (TRL's own command, `build_command`, with its dev-mode environment) on `gpu` in a session of
    its own; yields its URL once healthy; its whole process group is stopped on every way out."""
    import requests
    from trl.scripts.vllm_serve import ScriptArguments, build_command

    port = free_port()
    command = build_command(ScriptArguments(model=model_path, host="127.0.0.1", port=port, dtype=dtype,
                                            gpu_memory_utilization=memory_utilization, max_model_len=4096))
    env = {**os.environ, "VLLM_SERVER_DEV_MODE": "1", "CUDA_VISIBLE_DEVICES": str(gpu)}
    with open(log, "w") as out:
        process = subprocess.Popen(command, env=env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + SERVER_START_SECONDS
        while True:
            if process.poll() is not None:
                raise RuntimeError(f"The vLLM server exited with {process.returncode}; its log is {log}.")
            with contextlib.suppress(requests.ConnectionError):
                if requests.get(f"{url}/health", timeout=2).status_code == 200:
                    break
            if time.monotonic() > deadline:
                raise RuntimeError(f"The vLLM server was not up after {SERVER_START_SECONDS} s; its log is {log}.")
            time.sleep(1)
        yield url
    finally:
        stop_process_group(process, waits=(15, 15))


def model_folder(args, folder: Path) -> str:
    """A random Qwen3 of the run's shape with the tiny tokenizer (its vocabulary and chat template), saved in the
    run's dtype where the server and the trainers load it."""
    import bench_packing_gpu as packing_bench
    from transformers import PreTrainedTokenizerFast, Qwen3Config, Qwen3ForCausalLM

    from trl_tree.testing import tiny_model_path

    tokenizer = PreTrainedTokenizerFast.from_pretrained(tiny_model_path())
    shape = {**packing_bench.SHAPES[args.model], "vocab_size": len(tokenizer)}
    if args.layers:
        shape["num_hidden_layers"] = args.layers
    torch.manual_seed(args.seed)
    model = Qwen3ForCausalLM(Qwen3Config(**shape, pad_token_id=tokenizer.pad_token_id,
                                         eos_token_id=tokenizer.convert_tokens_to_ids("<|im_end|>")))
    model.to(getattr(torch, args.dtype)).save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return str(folder)


def length_reward(completions, **kwargs) -> list[float]:
    """A reward that varies between leaves (a random policy answers nothing right): its last message's length."""
    return [len(c[-1].get("content") or "") / 1000.0 for c in completions]


def _trainer(args, device: str, model_path: str, url: str, max_staleness: int, output_dir: str):
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, PreTrainedTokenizerFast

    from trl_tree import TreeOPSDConfig, TreeOPSDTrainer
    from trl_tree.testing import calculator

    tree = {"num_initial_rollouts": args.num_initial_rollouts, "num_branches": args.num_branches}
    prompts = args.async_vllm_trees * E * args.async_vllm_batches
    config = TreeOPSDConfig(
        output_dir=output_dir, **tree, max_turns=2, max_completion_length=args.async_vllm_completion_tokens,
        per_device_train_batch_size=args.async_vllm_trees * TreeOPSDConfig.num_generations_for(**tree),
        steps_per_generation=E, max_steps=E * args.async_vllm_batches, learning_rate=1e-6, seed=args.seed,
        logging_steps=1, report_to="none", save_strategy="no", disable_tqdm=True, use_cpu=device == "cpu",
        bf16=args.dtype == "bfloat16" and device != "cpu", gradient_checkpointing=False, use_vllm=True,
        vllm_mode="server", vllm_server_base_url=url, max_staleness=max_staleness,
    )
    dataset = Dataset.from_dict({"prompt": [[{"role": "user", "content": f"What is {i}+1?"}] for i in range(prompts)]})
    model = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32)  # trained in float32 (+ autocast)
    return TreeOPSDTrainer(model=model, reward_funcs=length_reward, args=config, train_dataset=dataset,
                           processing_class=PreTrainedTokenizerFast.from_pretrained(model_path), tools=[calculator])


def variant(args, device: str, model_path: str, url: str, max_staleness: int, output_dir: str) -> dict:
    """One run: steady-state seconds per generation batch; synchronous: its generation phase (the push included);
    asynchronous: the `async/*` waits and pushes."""
    from transformers import TrainerCallback

    class BatchClock(TrainerCallback):
        def __init__(self):
            self.starts, self.end = [], None

        def on_step_begin(self, a, state, control, **kwargs):
            if state.global_step % E == 0:
                self.starts.append(time.perf_counter())

        def on_train_end(self, a, state, control, **kwargs):
            self.end = time.perf_counter()

    trainer = _trainer(args, device, model_path, url, max_staleness, output_dir)
    clock, generation = BatchClock(), []
    trainer.add_callback(clock)
    if max_staleness == 0:
        original = trainer._generate_micro_batches

        def timed(inputs, num_chunks):
            start = time.perf_counter()
            batches = original(inputs, num_chunks)
            generation.append(time.perf_counter() - start)
            return batches

        trainer._generate_micro_batches = timed
    client = trainer.vllm_generation.vllm_client
    try:
        trainer.train()
    finally:
        client.close_communicator()  # the next variant's trainer opens its own with the server
    bounds = [*clock.starts, clock.end]
    steady = [b - a for a, b in zip(bounds, bounds[1:])][args.async_vllm_warmup:]
    logged = trainer.state.log_history

    def series(name):
        return [entry[name] for entry in logged if name in entry][args.async_vllm_warmup:]

    row = {"variant": "sync" if max_staleness == 0 else f"async_{max_staleness}", "max_staleness": max_staleness,
           "seconds_per_batch": statistics.mean(steady), "intervals": steady}
    if max_staleness == 0:
        row["generation_seconds"] = statistics.mean(generation[args.async_vllm_warmup:])
        row["training_seconds"] = row["seconds_per_batch"] - row["generation_seconds"]
    else:
        row["generation_seconds"] = statistics.mean(series("async/generation_time"))
        row["trainer_wait"] = statistics.mean(series("async/trainer_wait"))
        row["producer_wait"] = statistics.mean(series("async/producer_wait"))
        row["weight_push_seconds"] = statistics.mean(series("async/weight_push_time"))
        row["staleness"] = [entry["async/staleness_max"] for entry in logged if "async/staleness_max" in entry]
    del trainer
    if device == "cuda":
        torch.cuda.empty_cache()
    return row


def run(args, device: str, server_url: str | None = None, model_path: str | None = None) -> dict:
    """Sync against async (max_staleness 1) through one server: started here on `--async_vllm_server_gpu` with a
    model of the run's shape, or `server_url` serving `model_path`."""
    if server_url is None and device == "cuda" and torch.cuda.device_count() < 2:
        return {"skipped": f"{torch.cuda.device_count()} GPU visible: the vLLM server and the trainer need one GPU "
                "each (TRL's weight sync is an NCCL group, and NCCL refuses two ranks on one GPU)"}
    with tempfile.TemporaryDirectory() as scratch, contextlib.ExitStack() as stack:
        scratch = Path(scratch)
        if server_url is None:
            model_path = model_folder(args, scratch / "model")
            server_url = stack.enter_context(
                serve(model_path, args.async_vllm_server_gpu, args.dtype, scratch / "server.log"))
        rows = [variant(args, device, model_path, server_url, s, str(scratch / f"run{s}")) for s in (0, 1)]
    sync = rows[0]
    limit = max(sync["generation_seconds"], sync["training_seconds"])
    for row in rows:
        row["speedup"] = sync["seconds_per_batch"] / row["seconds_per_batch"]
        row["over_limit"] = row["seconds_per_batch"] / limit
    return {"rows": rows, "limit_seconds": limit, "batches": args.async_vllm_batches,
            "warmup": args.async_vllm_warmup, "completion_tokens": args.async_vllm_completion_tokens}
