"""A few TreeOPSD steps on the tiny model with a calculator tool, for `accelerate launch` tests.

Usage, from the repository root (the script imports `tests.scripted`):
       accelerate launch [--multi_gpu --num_processes 2 | --config_file ds.yaml] -m tests.launch.tiny_tree_run OUT
       [lora] [a method of trl_tree.methods.METHODS | treeadv_gspo | treeflex_uneven | opsd_on_entropy_tree |
               atpo_on_init_expand | flat_grpo]
Writes OUT/report-rank{r}.json per rank: world size, whether every trainable parameter changed, the logged metric names,
accelerate's distributed type, the class of the model the trainer trains (its DDP / DeepSpeed / FSDP wrapper), and
what the first optimizer step did to the rank's first micro-batch (`FirstStep`: each unique turn's credit and mean
log-prob before and after the step).
"""

import dataclasses
import json
import os
import sys

import torch
from datasets import Dataset
from transformers import TrainerCallback

from trl_tree import TreeConfig, TreeTrainer, methods
from trl_tree.rollout.growing.flex_harness import TwoRoleHarness
from trl_tree.testing import calculator, calculator_conversations, tiny_model_and_tokenizer, tiny_model_path
from trl_tree.warm_start import cached_warm_start, model_fingerprint

# What each named method of the method table changes for the tiny model (a method not listed runs with its defaults)
TINY = {
    "at2po": {"num_initial_rollouts": 2, "expansion_rounds": 1, "branches_per_round": 2},
    # a low τ_H so that the tiny model's completions do branch
    "treeadv": {"num_initial_rollouts": 2, "entropy_threshold": 0.5, "max_branches_per_tree": 2,
                "min_segment_length": 2},
    # two-role harness: Reflection + one Execution segment (from a restored node) per search, K = 2 searches
    "treeflex": {"num_searches": 2, "max_blocks": 2},
}


class UnevenHarness(TwoRoleHarness):
    """The two-role harness, but rank r keeps r fewer searches of each task: ranks return different numbers of
    searches, so every gather of per-search values must accept uneven counts."""

    def run(self, tasks, kit):
        rank = torch.distributed.get_rank() if torch.distributed.is_initialized() else 0
        return [searches[: len(searches) - rank] for searches in super().run(tasks, kit)]


# Other configurations: (named method, or None for `TreeTrainer`; fields; trainer keyword arguments)
VARIANTS = {
    "treeadv_gspo": ("treeadv", {**TINY["treeadv"], "loss": "gspo_token", "epsilon": 3e-4, "epsilon_high": 4e-4}, {}),
    "treeflex_uneven": ("treeflex", {"num_searches": 3, "max_blocks": 2, "log_completions": True},
                        {"harness": UnevenHarness()}),
    # compositions: the TreeOPSD loss on an entropy-guided tree; ATPO on init-expand trees; flat multi-turn GRPO
    "opsd_on_entropy_tree": (None, {"sampler": "entropy_guided", "expansion_rounds": 1, "branches_per_round": 2,
                                    "num_initial_rollouts": 2}, {}),
    "atpo_on_init_expand": (None, {"loss": "atpo", "credit": "child_mean"}, {}),
    "flat_grpo": (None, {"sampler": "flat", "num_initial_rollouts": 4, "credit": "path", "loss": "grpo"}, {}),
}


def _entry(method, overrides, trainer_kwargs):
    if method is None:
        return TreeTrainer, TreeConfig, overrides, trainer_kwargs
    spec = methods.METHODS[method]
    return spec.trainer_class(), spec.config_class(), overrides, trainer_kwargs


METHODS = {
    **{name: _entry(name, TINY.get(name, {}), {}) for name in methods.METHODS},
    **{name: _entry(*variant) for name, variant in VARIANTS.items()},
}
# launched only: its searches differ per rank, which a single process cannot show
LAUNCH_ONLY = ("treeflex_uneven",)
# the configurations the golden record and the credit-direction test train, in order: every named method, then the
# compositions, which between them must train every registered sampler, credit and loss (`uncovered`)
CONFIGURATIONS = tuple(name for name in METHODS if name not in LAUNCH_ONLY)


def components(name: str) -> dict[str, str]:
    """The sampler, credit and loss configuration `name` trains: its overrides, else its config class's defaults."""
    _, config_cls, overrides, _ = METHODS[name]
    defaults = config_cls.__dataclass_fields__
    return {kind: overrides.get(kind, defaults[kind].default) for kind in ("sampler", "credit", "loss")}


def uncovered(configurations, kinds=("sampler", "credit", "loss")) -> list[str]:
    """What to add for each registered component of `kinds` that none of `configurations` trains: a composition in
    VARIANTS, which the golden record, the credit-direction test and this launcher then pick up."""
    trained = [components(name) for name in configurations]
    tables = {"sampler": methods.SAMPLERS, "credit": methods.CREDITS, "loss": methods.LOSSES}
    return [
        f"the {kind} {name!r} is trained by no configuration: add one using it to VARIANTS in "
        f"tests/launch/tiny_tree_run.py (e.g. \"{name}_tiny\": (None, {{\"{kind}\": \"{name}\", ...}}, {{}})), then "
        f"record it: python -m tests.test_golden_training --add {name}_tiny"
        for kind in kinds for name in tables[kind] if all(c[kind] != name for c in trained)
    ]


def correct_answer(completions, answer, **kwargs):
    """1 when the final assistant message contains the gold answer, plus a small shaping term (a tool was called,
    answer length) so that a tiny model's tree almost never has all-equal rewards (no gradient) in two steps."""
    rewards = []
    for c, a in zip(completions, answer):
        final = c[-1].get("content") or ""
        called = any(m["role"] == "tool" for m in c)
        rewards.append(float(a in final) + 0.1 * called + 0.001 * len(final))
    return rewards


def build_trainer(out: str, use_lora: bool = False, max_steps: int = 2, packing: str = "tree", method="treeopsd",
                  use_tools: bool = True, warm_start_steps: int = 150, max_completion_length: int = 96,
                  learning_rate: float = 1e-2, prompts: int = 8, **config_fields):
    """A warm-started tiny model, a calculator tool, two optimizer blocks per generation batch.

    `use_tools=False`: single-turn math instead: the same questions, answered directly (warm start on the question
    and the final answer, no tool schema in the prompt), with the same verifiable reward. `config_fields` go to the
    method's config (e.g. `log_completions=True`; `save_strategy="steps", save_steps=1` to checkpoint, which is off
    by default). `prompts`: the dataset's size (of the 64 warm-start questions).
    """
    trainer_cls, config_cls, overrides, trainer_kwargs = METHODS[method]
    model, tok = tiny_model_and_tokenizer()
    conversations = calculator_conversations(64, seed=0)
    torch.manual_seed(0)
    # cached: every launched and in-process run of the suite starts from the same warm start, trained once
    base = model_fingerprint(tiny_model_path())
    if use_tools:
        cached_warm_start(model, tok, conversations, base=base, tools=[calculator], steps=warm_start_steps)
    else:
        cached_warm_start(model, tok, [[c[0], c[-1]] for c in conversations], base=base, steps=warm_start_steps)
    ds = Dataset.from_dict({
        "prompt": [c[:1] for c in conversations[:prompts]],
        "answer": [c[-1]["content"].split()[-1].rstrip(".") for c in conversations[:prompts]],
    })
    peft_config = None
    if use_lora:
        from peft import LoraConfig

        peft_config = LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"])
    # the small tree of every tree config (TreeFlexConfig has no tree fields: its group is `num_searches`)
    own = {f.name for f in dataclasses.fields(config_cls)}
    tree_fields = {k: v for k, v in {"num_initial_rollouts": 2, "num_branches": 1, "packing": packing}.items() if k in own}
    tree_fields.update(overrides)
    one_tree = config_cls.num_generations_for(**tree_fields)  # per_device_train_batch_size counts trajectories
    args = config_cls(
        output_dir=out, per_device_train_batch_size=one_tree, gradient_accumulation_steps=1, steps_per_generation=2,
        max_steps=max_steps, **tree_fields, max_turns=3, max_completion_length=max_completion_length,
        learning_rate=learning_rate, logging_steps=1, report_to="none", bf16=False, gradient_checkpointing=False,
        use_cpu=not torch.cuda.is_available(), seed=0, **{"save_strategy": "no", **config_fields},
    )
    return trainer_cls(model=model, reward_funcs=correct_answer, args=args, train_dataset=ds,
                       processing_class=tok, tools=[calculator] if use_tools else None, peft_config=peft_config,
                       **trainer_kwargs)


# Adam's first step moves every parameter by about the learning rate, whatever its gradient's size. At build_trainer's
# 1e-2 that is far past first order for the tiny model: every turn of the first micro-batch loses 5 to 9 nats of
# log-prob whatever its credit, so the step's direction cannot be seen. At 1e-4 the change of each turn's log-prob
# follows the gradient (`FirstStep`), and every parameter still changes.
LEARNING_RATE = 1e-4


class FirstStep(TrainerCallback):
    """What the first optimizer step does to the first micro-batch it trains (gradient_accumulation_steps = 1: the
    step trains that micro-batch only): each unique turn's credit A_i as the loss reads it, and its mean log-prob under
    θ_old (measured when the first loss is computed, before any step) and after the step, in `record`.

    With DDP the step follows the gradient averaged over the ranks, so its direction is a property of every rank's
    turns together (tests/test_launch.py gathers the ranks' records)."""

    def __init__(self, trainer):
        # imported here: scripts/screenshot_tree_view.py imports this module by file name, without `tests` importable
        from tests.scripted import turn_mean_logps

        self.trainer, self.measure, self.batch, self.record = trainer, turn_mean_logps, None, {}
        compute_loss = trainer.compute_loss

        def first_recorded(model, inputs, *args, **kwargs):
            if self.batch is None:
                self.batch = inputs
                before, credit = turn_mean_logps(trainer, inputs)
                self.record.update(credit=credit.tolist(), logp_before=before.tolist())
            return compute_loss(model, inputs, *args, **kwargs)

        trainer.compute_loss = first_recorded
        trainer.add_callback(self)

    def on_step_end(self, args, state, control, **kwargs):
        if state.global_step == 1:
            self.record["logp_after"] = self.measure(self.trainer, self.batch)[0].tolist()


def main():
    out, use_lora = sys.argv[1], "lora" in sys.argv[2:]
    method = next((a for a in sys.argv[2:] if a in METHODS), "treeopsd")
    # LoRA's B starts at 0, so A only moves from the second optimizer step on
    trainer = build_trainer(out, use_lora, max_steps=4 if use_lora else 2, method=method,
                            learning_rate=LEARNING_RATE)
    first_step = FirstStep(trainer)
    before = {n: p.detach().clone().float().cpu() for n, p in trainer.model.named_parameters() if p.requires_grad}
    trainer.train()
    after = dict(trainer.accelerator.unwrap_model(trainer.model).named_parameters())
    changed = []
    for name, p in after.items():
        if name in before:
            full = p
            if hasattr(p, "ds_id"):  # ZeRO-3 partitioned parameter
                import deepspeed

                with deepspeed.zero.GatheredParameters([p]):
                    full = p.detach().clone()
            changed.append(bool((full.detach().float().cpu() - before[name]).abs().max() > 0))
            if not changed[-1]:
                print("unchanged", name, flush=True)
    metrics = sorted({k for entry in trainer.state.log_history for k in entry})
    report = {"rank": trainer.accelerator.process_index, "world": trainer.accelerator.num_processes,
              "num_trainable": len(changed), "all_changed": all(changed) and bool(changed), "metrics": metrics,
              "distributed_type": str(trainer.accelerator.distributed_type),
              "wrapper": type(trainer.model_wrapped).__name__, "first_step": first_step.record}
    # one file per rank: two ranks printing to one pipe can interleave their lines
    os.makedirs(out, exist_ok=True)
    with open(os.path.join(out, f"report-rank{report['rank']}.json"), "w") as f:
        json.dump(report, f)
    trainer.end()  # what every script ends with: all ranks wait, the DDP reducer goes, then the process group


if __name__ == "__main__":
    os.environ.setdefault("TRL_EXPERIMENTAL_SILENCE", "1")
    main()
