"""Generating: the backends that continue token-id prefixes until the turn ends (docs/design.md §5).

It owns the engines (`engine`: the protocol, `HFEngine` over `generate` with its ports `HFPorts`, the rollout session;
`vllm_engine`: vLLM through TRL's public `VLLMGeneration`, with `VLLMPorts`; `engine_process`: an `HFEngine` run in a
child process, its weights in shared memory) and the store of reused keys and values
(`prefix_cache`). A new engine or a generation-speed feature goes here. It may import torch, transformers and TRL's
public modules; nothing else of trl_tree (not the samplers that call it, not the tools, not the trainer): what it
needs of its owner comes in through its ports.
"""
