"""Evaluate a model as a HotpotQA search agent: greedy decoding, one answer per question, exact match and F1.

    # a model trained by train_hotpot.py: its data, retrieval and agent limits are read from its hotpot_results.json
    python examples/eval_hotpot.py --model_name_or_path outputs/treeopsd-hotpot-offline --output eval.json

    # HotpotQA's distractor validation split with a Search-R1 retrieval server
    python examples/eval_hotpot.py --model_name_or_path Qwen/Qwen3-4B-Thinking-2507 \\
        --dataset_name hotpotqa/hotpot_qa --retriever remote --retriever_url http://127.0.0.1:8000 --num_eval 1000

The agent loop is `trl_tree.envs.agent_eval`, the one the trainers' rollouts run (same prompt rendering, tool-call
parsing, observation tokens and limits), so these numbers are the ones `train_hotpot.py` prints before and after
training. With `accelerate launch --num_processes N` the questions are split across processes.
"""

from __future__ import annotations

import json
import os
from dataclasses import asdict, dataclass, field

from trl import TrlParser

from trl_tree.scripts.hotpot import RESULTS_FILE, HotpotDataArguments, build_retriever, load_questions


@dataclass
class EvalArguments(HotpotDataArguments):
    """Data and retrieval arguments of `train_hotpot.py`, plus the model, the agent limits and the output file.

    Unset arguments take the values the model was trained with when its folder holds train_hotpot.py's
    `hotpot_results.json`, so an offline model is evaluated on the same held-out synthetic questions and limits.
    """

    model_name_or_path: str | None = field(
        default=None,
        metadata={
            "help": "Model (Hub id or folder; a LoRA adapter folder works too). Default: the "
            "untrained tiny model of trl_tree.testing."
        },
    )
    dtype: str = field(default="auto", metadata={"help": "Model dtype: 'auto', 'bfloat16', 'float32', ..."})
    max_turns: int | None = field(default=None, metadata={"help": "Assistant turns, the answer included (default 5)."})
    max_completion_length: int | None = field(
        default=None, metadata={"help": "Token budget of one trajectory (default 6144, the paper's)."}
    )
    max_observation_chars: int | None = field(
        default=None, metadata={"help": "Characters kept of a search result (default 16384)."}
    )
    output: str | None = field(default=None, metadata={"help": "Write the scores and every answer to this JSON."})


_PAPER_LIMITS = {"max_turns": 5, "max_completion_length": 6144, "max_observation_chars": 16384}


def _apply_training_settings(args: EvalArguments, explicit: set[str]) -> EvalArguments:
    """Fill unset limits (and, for synthetic data, the world's settings) from the model's `hotpot_results.json`."""
    path = os.path.join(args.model_name_or_path or "", RESULTS_FILE)
    settings = {}
    if args.model_name_or_path and os.path.isfile(path):
        with open(path) as f:
            settings = json.load(f).get("settings", {})
    for name, value in settings.items():
        if hasattr(args, name) and name not in explicit:
            setattr(args, name, value)
    for name, value in _PAPER_LIMITS.items():
        if getattr(args, name) is None:
            setattr(args, name, value)
    return args


def _explicit_names(argv: list[str]) -> set[str]:
    """Arguments given on the command line or in `--config`: those keep their values over the training settings."""
    names = {a[2:].split("=")[0].replace("-", "_") for a in argv if a.startswith("--")}
    if "--config" in argv:
        import yaml

        with open(argv[argv.index("--config") + 1]) as f:
            names |= set(yaml.safe_load(f) or {})
    return names


def main(args: EvalArguments) -> dict:
    from accelerate import PartialState

    from trl_tree.envs import examples_to_dataset, make_search_tool
    from trl_tree.envs.agent_eval import AgentSettings, evaluate_agent, load_model_for_eval
    from trl_tree.testing import tiny_model_path

    state = PartialState()
    model_path = args.model_name_or_path or tiny_model_path()
    train, held_out = load_questions(args)
    if not held_out:
        raise ValueError("Nothing to evaluate: --num_eval must be positive.")
    search = make_search_tool(
        build_retriever(args, train + held_out),
        topk=args.topk,
        max_chars=args.max_observation_chars,
        long_query=args.long_query,
    )
    model, tokenizer = load_model_for_eval(model_path, dtype=args.dtype, device=state.device)
    settings = AgentSettings(
        max_turns=args.max_turns,
        max_completion_length=args.max_completion_length,
        max_observation_chars=args.max_observation_chars,
        batch_size=args.eval_batch_size,
    )
    result = evaluate_agent(model, tokenizer, list(examples_to_dataset(held_out)), [search], settings, state)
    report = {
        "model": model_path,
        "dataset": args.dataset_name or "synthetic",
        "split": args.dataset_test_split if args.dataset_name else "held-out synthetic questions",
        **result.summary(),
        "settings": {k: v for k, v in asdict(args).items() if k != "output"},
        "records": result.records,
    }
    if state.is_main_process:
        print(json.dumps({k: v for k, v in report.items() if k not in ("records", "settings")}, indent=2))
        if args.output:
            os.makedirs(os.path.dirname(os.path.abspath(args.output)), exist_ok=True)
            with open(args.output, "w") as f:
                json.dump(report, f, indent=2, default=str)
            print(f"wrote {args.output}")
    return report


if __name__ == "__main__":
    import sys

    parser = TrlParser(EvalArguments, prog="eval_hotpot.py")
    (eval_args,) = parser.parse_args_and_config()
    main(_apply_training_settings(eval_args, _explicit_names(sys.argv[1:])))
