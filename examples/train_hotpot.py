"""Train a HotpotQA search agent with TreeOPSD.

Offline, on a laptop (tiny model, synthetic multi-hop world, BM25; a few minutes on a CPU):

    accelerate launch examples/train_hotpot.py

The paper's setting (Qwen3-4B-Thinking-2507, HotpotQA distractor, 8 GPUs; add `--retriever remote
--retriever_url http://host:8000` for a Search-R1 E5 server over Wikipedia, as the paper, or for a BM25 server
started with `trl-tree retrieval-server --corpus_path wiki.jsonl --port 8000`; `--retriever server` starts one
itself):

    accelerate launch --config_file trl_tree/accelerate_configs/deepspeed_zero3.yaml examples/train_hotpot.py \\
        --config examples/recipes/treeopsd_hotpot_qwen3_4b.yaml

LoRA: `--use_peft --lora_r 16`. Push the model and its card: `--push_to_hub --hub_model_id you/name`.
TreePO (the paper's fixed-credit control) with the same arguments: `trl-tree treepo ...`.
All arguments: `python examples/train_hotpot.py --help`.
"""

from trl_tree.scripts.hotpot import HotpotScriptArguments, main, make_parser, parse_args, run

__all__ = ["HotpotScriptArguments", "main", "make_parser", "parse_args"]

if __name__ == "__main__":
    # parse_args("treeopsd") then main(...), on one CPU thread for the tiny model (see `run`)
    run("treeopsd", prog="train_hotpot.py")
