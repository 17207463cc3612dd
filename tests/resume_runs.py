"""The runs of the exact-resume tests (tests/test_resume.py) and of their launched two-process and two-machine forms
(tests/launch/tiny_resume_run.py, tiny_machines_run.py): scripted but sampled generation, and how a run is trained
and recorded."""

import random

import torch
from datasets import Dataset

from tests.scripted import AFTER_TOOL, CALL_1_PLUS_1, config, contains_answer, tiny
from trl_tree import TreeFlexConfig, TreeFlexTrainer, TreeOPSDConfig, TreeOPSDTrainer
from trl_tree.rollout.growing.flex_harness import REFLECTION_PROMPT
from trl_tree.testing import ScriptedEngine, calculator

# two trees per micro-batch and E = 2 optimizer blocks per generation batch; per_device_train_batch_size counts
# trajectories of budget (2 trees × G), so the trainers below set it from their own G
RUN = dict(steps_per_generation=2, gradient_accumulation_steps=1, max_steps=4, save_strategy="steps", save_steps=1,
           logging_steps=1)


def sampled_engine(tok, options) -> ScriptedEngine:
    """Stands in for sampling from the model: the reply to a history is drawn, with torch's global generator, from
    `options(history_text)`."""
    eos = tok.convert_tokens_to_ids("<|im_end|>")

    def script(prefix):
        choices = options(tok.decode(prefix, skip_special_tokens=False))
        reply = choices[int(torch.randint(len(choices), ()))]
        return tok.encode(reply, add_special_tokens=False) + [eos]

    return ScriptedEngine(script, [eos])


def agent_turn(text: str) -> list[str]:
    """Call the calculator (half the time, so trajectories have 1 to max_turns turns) or answer."""
    if text.endswith(AFTER_TOOL):
        return [CALL_1_PLUS_1, CALL_1_PLUS_1, "The answer is 2.", "The answer is 3."]
    return [CALL_1_PLUS_1, CALL_1_PLUS_1, "The answer is 2.", "I do not know."]


def two_role_turn(text: str) -> list[str]:
    """TreeFlex's two roles: Reflection instructs or answers; an Execution segment calls or writes its card."""
    if REFLECTION_PROMPT[:40] in text:
        return ["Compute 1+1 with the calculator.", "<answer>2</answer>", "<answer>3</answer>"]
    return ["Card: 1+1 = 2."] if text.endswith(AFTER_TOOL) else [CALL_1_PLUS_1, "Card: no call needed."]


class RecordingRandom(random.Random):
    """The sampler's generator, recording its anchor draws (upper bound T − 1, anchor) per generation batch."""

    def __init__(self, rng: random.Random):
        super().__init__()
        self.setstate(rng.getstate())
        self.draws_by_batch = []

    def randint(self, a, b):
        value = super().randint(a, b)
        self.draws_by_batch[-1].append((b, value))
        return value


def questions(n: int) -> Dataset:
    return Dataset.from_dict({
        "prompt": [[{"role": "user", "content": f"What is 1+1? (question {i})"}] for i in range(n)],
        "answer": ["2"] * n,
    })


def sampled_trainer(output_dir, prompts=8, trees=2, model=None, config_class=TreeOPSDConfig,
                    trainer_class=TreeOPSDTrainer, **changes):
    """The sampled calculator run every exact-resume, rollout-worker and `bench_async` run builds on: TreeOPSD (or
    `trainer_class`) on `prompts` questions, `trees` (M, N) = (2, 2) trees per micro-batch, turns drawn by
    `sampled_engine(agent_turn)` with the calculator tool. `model`: the policy trained (default: the tiny Qwen3; the
    tokenizer is the tiny one's either way); `changes`: config fields set otherwise than here or in
    `tests.scripted.config` (one step, no checkpoints)."""
    tiny_model, tok = tiny()
    fields = {"num_initial_rollouts": 2, "num_branches": 2, "max_turns": 4, "max_completion_length": 160, **changes}
    args = config(config_class, output_dir, **fields,
                  per_device_train_batch_size=trees * config_class.num_generations_for(**fields))
    trainer = trainer_class(model=tiny_model if model is None else model, reward_funcs=contains_answer, args=args,
                            train_dataset=questions(prompts), processing_class=tok, tools=[calculator])
    trainer.generation_engine = sampled_engine(tok, agent_turn)
    return trainer


def tree_trainer(output_dir, trees=2, config_class=TreeOPSDConfig, trainer_class=TreeOPSDTrainer, **changes):
    """The exact-resume run: `sampled_trainer` on 8 questions, checkpointing every step (`RUN`), its sampler's
    anchor draws recorded; `changes` are config fields set otherwise than in it."""
    trainer = sampled_trainer(output_dir, trees=trees, config_class=config_class, trainer_class=trainer_class,
                              **{**RUN, **changes})
    trainer.sampler.rng = RecordingRandom(trainer.sampler.rng)
    return trainer


def flex_trainer(output_dir):
    model, tok = tiny()
    args = config(TreeFlexConfig, output_dir, num_searches=2, max_blocks=3, max_turns=3, max_completion_length=200,
                  per_device_train_batch_size=2 * TreeFlexConfig.num_generations_for(num_searches=2), **RUN)
    trainer = TreeFlexTrainer(model=model, reward_funcs=contains_answer, args=args, train_dataset=questions(8),
                              processing_class=tok, tools=[calculator])
    trainer.generation_engine = sampled_engine(tok, two_role_turn)
    return trainer


def count_generations(trainer) -> list[int]:
    """Record the `_step` of every generation batch the trainer generates."""
    steps = []
    original = trainer._generate_micro_batches

    def spy(inputs, num_chunks):
        if trainer.model.training:
            steps.append(trainer._step)
            if isinstance(getattr(trainer.sampler, "rng", None), RecordingRandom):
                trainer.sampler.rng.draws_by_batch.append([])
        return original(inputs, num_chunks)

    trainer._generate_micro_batches = spy
    rollouts = trainer._async_rollouts  # with a rollout worker the trainer takes its batches from it instead
    if rollouts is not None:
        take = rollouts.micro_batches

        def spy_taken(item):
            steps.append(trainer._step)
            return take(item)

        rollouts.micro_batches = spy_taken
    return steps


def train(make, output_dir, resume_from=None):
    """Train to max_steps (from a checkpoint if given); return the trainer, its parameters and its generation steps."""
    trainer = make(output_dir)
    generations = count_generations(trainer)
    trainer.train(resume_from_checkpoint=resume_from)
    params = {n: p.detach().clone() for n, p in trainer.model.named_parameters()}
    return trainer, params, generations


def logged(trainer, key: str) -> dict[int, float]:
    return {e["step"]: e[key] for e in trainer.state.log_history if key in e}
