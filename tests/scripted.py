"""Scripted generation for trainer tests: the way TRL tests its tool loop, generation returns fixed token ids.

Also the small pieces every trainer test shares, each in one place: the tiny model, a one-step CPU config, a reward,
the reply scripts (`REPLIES`, TreeFlex's `TwoRoleScript`, TreeAdv's `EntropyScript`), the trainer built on them
(`scripted_trainer`, `captured_units`), a training check, and what one optimizer step does to each turn's
log-probability (`credit_and_logp_change`) with the check that it follows the credit (`assert_moves_with_credit`).
"""

import dataclasses
import json
import threading

import torch
from datasets import Dataset

from trl_tree.rollout.growing.flex_harness import REFLECTION_PROMPT
from trl_tree.testing import ScriptedEngine, calculator, tiny_model_and_tokenizer

CALL_1_PLUS_1 = '<tool_call>\n{"name": "calculator", "arguments": {"expression": "1+1"}}\n</tool_call>'
# what a history ends with when the model speaks again after a tool result (the key of a reply script)
AFTER_TOOL = "</tool_response><|im_end|>\n<|im_start|>assistant\n"


# Initial trajectories (M = 2): τ1 calls the calculator then answers 2 (R=1); τ2 gives up (R=0, T=1).
# Branches (N = 1): τ1 → anchor 1, answers 3 (R=0); τ2 → anchor 0 (T=1): calls, then answers 2 (R=1, same
# history as τ1: a merged leaf of multiplicity 2). τ2's continuation starts as soon as τ2 ends, so the engine sees
# τ1's answer, then (one call later) τ2's continuation's answer before τ1's continuation's: the replies' order.
REPLIES = {
    "<|im_start|>assistant\n": [CALL_1_PLUS_1, "I do not know.", CALL_1_PLUS_1],
    AFTER_TOOL: ["The answer is 2.", "The answer is 2.", "The answer is 3."],
}


def tool_call(name: str, **arguments) -> str:
    return f'<tool_call>\n{json.dumps({"name": name, "arguments": arguments})}\n</tool_call>'


class PrefixScript:
    """Answers the i-th generation from a given suffix of the history with the i-th text listed for it.

    `replies` maps the text the history ends with (decoded, after the last assistant header) to the list of texts to
    produce, consumed in call order; every text is closed with the end-of-turn token.
    """

    def __init__(self, tokenizer, replies: dict[str, list[str]]):
        self.tokenizer = tokenizer
        self.replies = {k: list(v) for k, v in replies.items()}
        self.eos = tokenizer.convert_tokens_to_ids("<|im_end|>")

    def __call__(self, prefix: list[int]) -> list[int]:
        text = self.tokenizer.decode(prefix, skip_special_tokens=False)
        key = max((k for k in self.replies if text.endswith(k) or k == ""), key=len)
        reply = self.replies[key].pop(0)
        return self.tokenizer.encode(reply, add_special_tokens=False) + [self.eos]


# TreeFlex's two roles, scripted (`TwoRoleScript`): Reflection replies by how many checkpoint cards its history holds,
# Execution segments by whether they follow a tool result; each list is consumed in call order
REFLECT = {
    0: ["Compute 1+1 with the calculator.", "Compute 1+1."],
    1: ["<resume>1</resume> Check the sum once more.", "<resume>7</resume> Check it."],
    2: ["<answer>2</answer>", "<answer>3</answer>"],
}
EXECUTE_FIRST = [CALL_1_PLUS_1, CALL_1_PLUS_1, CALL_1_PLUS_1, "<tool_call>{oops</tool_call>"]
EXECUTE_AFTER_TOOL = ["Card: 1+1 = 2.", "Card: 1+1 = 2.", "Card: checked, 2.", "Card: the call failed."]


class TwoRoleScript:
    """Replies by role (the Reflection system prompt is in the history) and by progress, in call order."""

    def __init__(self, tok, reflect=REFLECT, first=EXECUTE_FIRST, after=EXECUTE_AFTER_TOOL):
        self.tok, self.mark = tok, REFLECTION_PROMPT[:40]
        self.reflect = {k: list(v) for k, v in reflect.items()}
        self.first, self.after = list(first), list(after)
        self.eos = tok.convert_tokens_to_ids("<|im_end|>")

    def __call__(self, prefix):
        text = self.tok.decode(prefix, skip_special_tokens=False)
        if self.mark in text:
            reply = self.reflect[text.count("Checkpoint card (node")].pop(0)
        else:
            reply = (self.after if text.endswith(AFTER_TOOL) else self.first).pop(0)
        return self.tok.encode(reply, add_special_tokens=False) + [self.eos]


# TreeAdv: replies with scripted per-token entropies (τ_H = TAU), and the single-turn math script its tests use
TAU = 1.0
HEADER = "<|im_start|>assistant\n"


class EntropyScript:
    """Replies by the text of the current assistant turn so far (after the last assistant header): `roots` are
    consumed in order for an empty turn, `continuations` map a mid-turn head to its continuation, `after_tool` maps
    the last tool response to the next turn. Root texts come with per-token entropies {token index: entropy}."""

    def __init__(self, tok, roots, continuations=None, after_tool=None):
        self.tok, self.eos = tok, tok.convert_tokens_to_ids("<|im_end|>")
        self.roots = list(roots)
        self.continuations = continuations or {}
        self.after_tool = after_tool or {}

    def ids(self, text):
        return self.tok.encode(text, add_special_tokens=False) + [self.eos]

    def __call__(self, prefix):
        history = self.tok.decode(prefix)
        turn = history.split(HEADER)[-1]
        if turn == "" and "<tool_response>" in history:
            text, high = self.after_tool[history.split("<tool_response>\n")[-1].split("\n")[0]], {}
        elif turn == "":
            text, high = self.roots.pop(0)
        else:
            text, high = self.continuations[turn], {}
        ids = self.ids(text)
        return ids, [high.get(j, 0.0) for j in range(len(ids))]


# Single turn, no tools. Root 1 (13 tokens with <|im_end|>): entropies above τ at token 1 (too close to the start for
# L = 3), 4 (taken), 6 (within L of 4), 7 (eligible, but the cap of 2 is spent), 10 (taken), 11 (too close to the
# end). Root 2 (10 tokens): token 7 (taken), token 5 below τ.
ROOT_1 = ("Let me think. The answer is 2.", {1: 3.0, 4: 2.0, 6: 1.8, 7: 1.3, 10: 1.5, 11: 1.2, 9: 0.9})
ROOT_2 = ("I think the answer is 3.", {7: 1.2, 5: 0.5})
CONTINUATIONS = {"Let me th": "ink the answer is 3.", "Let me think. The answer is": " 2!",
                 "I think the answer is": " 2."}


def math_entropy_script(n_prompts=1):
    return lambda tok: EntropyScript(tok, [ROOT_1, ROOT_2] * n_prompts, CONTINUATIONS)


class CounterEnv:
    """A stateful environment: a branch must continue from the count its trajectory had at the anchor."""

    def __init__(self):
        self.n = 0

    def reset(self, **kwargs):
        self.n = 0

    def increment(self) -> str:
        """Adds one to the counter.

        Returns:
            The counter's new value.
        """
        self.n += 1
        return str(self.n)


def scripted_engine(tokenizer, replies) -> ScriptedEngine:
    script = PrefixScript(tokenizer, replies)
    return ScriptedEngine(script, eos_ids=[script.eos])


def contains_answer(completions, answer, **kwargs):
    """1 if the final assistant message contains the gold answer."""
    return [float(a in (c[-1].get("content") or "")) for c, a in zip(completions, answer)]


def tiny():
    return tiny_model_and_tokenizer()


def arithmetic_dataset(n: int) -> Dataset:
    return Dataset.from_dict(
        {"prompt": [[{"role": "user", "content": "What is 1+1?"}]] * n, "answer": ["2"] * n}
    )


# A quiet one-process CPU run, the fields every test config shares: every step logged, no tracker, float32, no
# gradient checkpointing, no checkpoints, seed 0
CPU_RUN = dict(logging_steps=1, report_to="none", bf16=False, gradient_checkpointing=False, use_cpu=True,
               save_strategy="no", seed=0)


def config(cls, tmp_path, trees_per_micro_batch=1, **overrides):
    """A one-step CPU config; per_device_train_batch_size counts trajectories of budget (trees × G), as in GRPO."""
    defaults = dict(
        output_dir=str(tmp_path),
        steps_per_generation=1,
        max_steps=1,
        num_initial_rollouts=2,
        num_branches=1,
        max_turns=3,
        max_completion_length=96,
        learning_rate=1e-2,
        **CPU_RUN,
    )
    # the small tree's fields only where the class has them (TreeFlexConfig grows no tree: its group is num_searches)
    own = {f.name for f in dataclasses.fields(cls)}
    defaults = {k: v for k, v in defaults.items() if k in own or k not in ("num_initial_rollouts", "num_branches")}
    defaults.update(overrides)
    defaults.setdefault("per_device_train_batch_size", trees_per_micro_batch * cls.num_generations_for(**defaults))
    return cls(**defaults)


def unchanged_after_training(trainer) -> list[str]:
    """Run `trainer.train()` and return the names of the trainable parameters it left exactly as they were."""
    before = {n: p.detach().clone() for n, p in trainer.model.named_parameters() if p.requires_grad}
    trainer.train()
    return [n for n, p in trainer.model.named_parameters() if p.requires_grad and torch.equal(p, before[n])]


def hf_engine(trainer, monkeypatch, cache: str, with_scores: bool = False, **generation):
    """An `HFEngine` of `trainer` with `generation_cache=cache` and these generation-config fields (undone after the
    test by `monkeypatch`)."""
    import copy

    from trl_tree.rollout.generating.engine import HFEngine
    from trl_tree.trainer.engine_ports import hf_ports

    monkeypatch.setattr(trainer.args, "generation_cache", cache)
    gen_config = copy.deepcopy(trainer.generation_config)
    for key, value in generation.items():
        setattr(gen_config, key, value)
    monkeypatch.setattr(trainer, "generation_config", gen_config)
    return HFEngine(hf_ports(trainer), with_scores=with_scores)


def turn_mean_logps(trainer, batch) -> tuple[torch.Tensor, torch.Tensor]:
    """Each unique turn's mean log-prob under the trainer's model on a generated micro-batch, through the trainer's own
    `loss_inputs` (NaN for a turn without trained tokens), and the turns' credit A as the loss reads it."""
    with torch.no_grad():
        flat, _ = trainer.loss_inputs(trainer.model, batch)
    n = flat.num_turns
    sums = torch.zeros(n, dtype=torch.float64).index_add_(0, flat.turn_ids.cpu(), flat.logps.detach().double().cpu())
    counts = torch.bincount(flat.turn_ids.cpu(), minlength=n).double()
    return sums / counts, flat.credit.A.detach().double().cpu()


def assert_moves_with_credit(credit, change) -> None:
    """One optimizer step moved the policy the way the credit says: over the turns it trained (`change` not NaN), the
    credit-weighted change Σ_i A_i Δ_i is positive, and more than half of the turns with strong credit (|A| at least
    half the largest) moved in their credit's direction. `credit`, `change`: per unique turn, tensors or lists."""
    credit, change = torch.as_tensor(credit, dtype=torch.float64), torch.as_tensor(change, dtype=torch.float64)
    trained = ~torch.isnan(change)
    credit, change = credit[trained], change[trained]
    assert credit.abs().max() > 0.1, f"no turn has clearly nonzero credit: {credit.tolist()}"
    assert (credit * change).sum() > 0, (credit.tolist(), change.tolist())
    strong = credit.abs() >= 0.5 * credit.abs().max()
    agree = (torch.sign(change[strong]) == torch.sign(credit[strong])).double().mean()
    assert agree > 0.5, (credit[strong].tolist(), change[strong].tolist())


def credit_and_logp_change(trainer, rows, step_norm: float = 1e-2):
    """The per-turn credit of a micro-batch the trainer generates from `rows`, and how one optimizer step on the
    trainer's own loss over it changes each turn's mean log-prob (after − before).

    The step is plain gradient descent scaled to a parameter step of norm `step_norm`: small enough to be first order
    (the change of a turn's log-prob follows the gradient), large enough to be visible above float noise. The
    parameters are restored afterwards."""
    trainer.model.train()
    batch = trainer.generate_batch(rows)
    params = [p for p in trainer.model.parameters() if p.requires_grad]
    saved = [p.detach().clone() for p in params]
    before, credit = turn_mean_logps(trainer, batch)
    for p in params:
        p.grad = None
    trainer.compute_loss(trainer.model, batch).backward()
    grads = [torch.zeros_like(p) if p.grad is None else p.grad for p in params]
    norm = torch.sqrt(sum((g.double() ** 2).sum() for g in grads))
    assert norm > 0, "the loss has no gradient on this batch"
    with torch.no_grad():
        for p, g in zip(params, grads):
            p.sub_(g * (step_norm / norm).to(g))
    after, _ = turn_mean_logps(trainer, batch)
    with torch.no_grad():
        for p, s in zip(params, saved):
            p.copy_(s)
            p.grad = None
    return credit, after - before


def scripted_trainer(cls, config_cls, tmp_path, replies=REPLIES, *, script=None, reward_funcs=contains_answer,
                     dataset=None, tools=(calculator,), callbacks=(), **overrides):
    """The tiny model and a trainer of `cls` with a one-step CPU config (`config`, with `overrides`) on `dataset` (one
    arithmetic prompt by default), generating by script: `replies` (a `PrefixScript`'s) or, if given, `script(tok)`
    (a script object with an `eos` id: `TwoRoleScript`, an `EntropyScript`)."""
    model, tok = tiny()
    trainer = cls(model=model, reward_funcs=reward_funcs, args=config(config_cls, tmp_path, **overrides),
                  train_dataset=arithmetic_dataset(1) if dataset is None else dataset, processing_class=tok,
                  tools=list(tools) if tools else None, callbacks=list(callbacks))
    if script is None:
        trainer.generation_engine = scripted_engine(tok, replies)
    else:
        made = script(tok)
        trainer.generation_engine = ScriptedEngine(made, [made.eos])
    return trainer


def captured_units(trainer) -> list:
    """The units (trees; TreeFlex's groups) the trainer computes credit for from now on, in order."""
    units = []
    original = trainer.turn_credit
    trainer.turn_credit = lambda unit: units.append(unit) or original(unit)
    return units


# TreeFlex's scripted run: two searches of up to three blocks; search 1's malformed call is answered with an error
# observation and its segment goes on to its card
TWO_ROLE_FIELDS = dict(num_searches=2, max_blocks=3, max_turns=3, max_completion_length=160,
                       malformed_tool_calls="observe")


def untooled_trainer(output_dir):
    """A TreeOPSD trainer of the tiny model without tools and with its own `HFEngine`: for the generation tests, which
    call the engine directly."""
    from trl_tree import TreeOPSDConfig, TreeOPSDTrainer

    model, tok = tiny()
    return TreeOPSDTrainer(model=model, reward_funcs=contains_answer, args=config(TreeOPSDConfig, output_dir),
                           train_dataset=arithmetic_dataset(1), processing_class=tok)


def threads_left(before: set) -> list[str]:
    """Threads started since `before` that still run, but for the process-wide ones tqdm and transformers' telemetry
    start once on first use."""
    return [
        t.name
        for t in threading.enumerate()
        if t not in before and t.name != "tqdm_monitor" and "_telemetry_worker" not in t.name
    ]


def recording_losses(trainer) -> list:
    """The list each loss `trainer` computes from now on is appended to (detached clones), for runs compared bit for
    bit or checked finite."""
    losses, compute_loss = [], trainer.compute_loss

    def record(*args, **kwargs):
        loss = compute_loss(*args, **kwargs)
        losses.append(loss.detach().clone())
        return loss

    trainer.compute_loss = record
    return losses
