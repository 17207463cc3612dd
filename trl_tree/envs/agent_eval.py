"""Greedy evaluation of a tool-calling agent with the same turn loop the tree trainers sample with.

An evaluation number is only comparable to the training reward if the agent sees the same world in both: the same
prompt rendering (chat template with the tool schema), the same tool-call parsing, the same observation tokens, the
same turn and length limits. So nothing here re-implements the agent loop: generation goes through
:class:`~trl_tree.rollout.growing.turn_loop.TurnLoop` (what every tree sampler drives), tool calls through
:func:`~trl_tree.rollout.acting.tools.run_tool_call`, and prompts, parsing and observation ids are rendered the way
``GRPOTrainer`` renders them (its training chat template, ``parse_response`` and ``_get_tool_suffix_ids``). Only the
generation backend differs: greedy decoding on a plain model, one answer per question.

Used by ``examples/eval_hotpot.py`` and by ``examples/train_hotpot.py`` for its before / after numbers.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from trl_tree.rewards import exact_match_score, extract_answer, f1_score, is_well_formed
from trl_tree.rollout.generating.engine import Continuation, _cut_at_eos, rollout_session
from trl_tree.rollout.generating.prefix_cache import PrefixKVStore, left_padded, supports_reuse
from trl_tree.rollout.growing.turn_loop import Branch, SamplerSettings, TurnLoop, TurnLoopPorts


class AgentTemplate:
    """How a tokenizer renders prompts and tool observations and parses actions: exactly as ``GRPOTrainer`` does.

    With tools, GRPOTrainer installs TRL's response parser on the tokenizer (``add_response_schema``, for templates TRL
    knows) and, when the tokenizer's own chat template is not prefix-preserving, swaps in TRL's training template
    (``get_training_chat_template``). Rendering with a different template than training used would evaluate the model
    on token sequences it never saw, so the same choice is made here.

    Args:
        tokenizer: the model's tokenizer (TRL's response parser is added to it in place if it has none).
        tools: the tool functions, as passed to the trainer's ``tools=``.
        chat_template_kwargs: extra keyword arguments of ``apply_chat_template`` (``GRPOConfig.chat_template_kwargs``).
        observation_special_tokens: ``"neutralize"`` (tool output's special-token strings are tokenized as text) or
            ``"raw"``: keep it equal to training's ``TreeConfig.observation_special_tokens``.
    """

    def __init__(
        self, tokenizer, tools: Sequence[Callable], chat_template_kwargs: dict[str, Any] | None = None,
        observation_special_tokens: str = "neutralize",
    ) -> None:
        from trl.chat_template_utils import (
            add_response_schema,
            get_training_chat_template,
            is_chat_template_prefix_preserving,
        )

        from trl_tree.rollout.acting.special_tokens import check_observation_special_tokens

        check_observation_special_tokens(observation_special_tokens)
        self.observation_special_tokens = observation_special_tokens
        self.tools = list(tools)
        self.chat_template_kwargs = chat_template_kwargs or {}
        if self.tools and getattr(tokenizer, "response_template", None) is None:
            if getattr(tokenizer, "response_schema", None) is None:
                tokenizer = add_response_schema(tokenizer)
        self.tokenizer = tokenizer
        if self.tools and not is_chat_template_prefix_preserving(tokenizer):
            self.chat_template = get_training_chat_template(tokenizer)
        else:
            self.chat_template = None

    def prompt_ids(self, prompt: list[dict[str, Any]]) -> list[int]:
        """The conversational prompt rendered with the tool schema and the generation prompt."""
        ids = self.tokenizer.apply_chat_template(
            prompt,
            tools=self.tools or None,
            chat_template=self.chat_template,
            add_generation_prompt=True,
            tokenize=True,
            return_dict=False,
            **self.chat_template_kwargs,
        )
        return list(ids)

    def parse(self, ids: list[int], prefix: list[int]) -> dict[str, Any]:
        """One generated turn as an assistant message (``tool_calls`` included), as the trainer parses it."""
        from trl.chat_template_utils import parse_response

        if not self.tools:
            return {"role": "assistant", "content": self.tokenizer.decode(ids, skip_special_tokens=True)}
        return parse_response(self.tokenizer, ids, prefix=prefix, tools=self.tools)

    def observation_ids(self, tool_messages: list[dict[str, Any]]) -> list[int]:
        """Token ids of the tool messages and the next assistant header, rendered by TRL's own tool-suffix code so
        they are byte-identical to those the trainer appends during rollouts (control strings in the tool output
        handled as training handles them, ``observation_special_tokens``)."""
        from trl_tree.trl_internals import render_tool_suffix

        return render_tool_suffix(
            self.tokenizer, self.chat_template, self.chat_template_kwargs, tool_messages,
            special_tokens=self.observation_special_tokens,
        )


def eos_token_ids(model, tokenizer) -> list[int]:
    """Every id that ends a turn: the model's generation-config eos ids and the tokenizer's, as GRPOTrainer uses."""
    ids = model.generation_config.eos_token_id
    ids = [] if ids is None else [ids] if isinstance(ids, int) else list(ids)
    if tokenizer.eos_token_id is not None and tokenizer.eos_token_id not in ids:
        ids = [tokenizer.eos_token_id, *ids]
    return ids


class GreedyEngine:
    """Greedy ``model.generate`` on left-padded token-id prefixes: the evaluation backend of :class:`TurnLoop`.

    It implements the same ``generate(prefixes, max_new_tokens)`` protocol as the trainer's engines, in batches of
    ``batch_size`` prefixes (padding costs compute, and a long batch of long contexts costs memory). With
    ``reuse_prefixes`` (models whose cache allows it), each turn reuses the keys and values of the history earlier
    turns computed (:class:`~trl_tree.rollout.generating.prefix_cache.PrefixKVStore`): the weights do not change during an
    evaluation, so each question's history is encoded once instead of once per turn.
    """

    def __init__(self, model, tokenizer, batch_size: int = 64, reuse_prefixes: bool = True):
        self.model = model
        self.pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
        self.eos_ids = eos_token_ids(model, tokenizer)
        self.batch_size = batch_size
        self.store = PrefixKVStore() if reuse_prefixes and supports_reuse(model) else None

    @property
    def resumes_turns(self) -> bool:
        """Chunked evaluation (`AgentSettings.chunk_tokens`) needs the prefix store to resume a cut turn cheaply."""
        return self.store is not None

    @contextlib.contextmanager
    def rollout(self):
        """One batch of questions answered to the end (`rollout_session`): its reused keys and values are dropped
        afterwards, so memory holds one batch's histories at a time."""
        if self.store is not None:
            self.store.clear()
        try:
            yield self
        finally:
            if self.store is not None:
                self.store.clear()

    @torch.no_grad()
    def generate(self, prefixes: list[list[int]], max_new_tokens: list[int]) -> list[Continuation]:
        results: list[Continuation] = []
        for start in range(0, len(prefixes), self.batch_size):
            results += self._generate_batch(
                prefixes[start : start + self.batch_size], max_new_tokens[start : start + self.batch_size]
            )
        return results

    def _generate_batch(self, prefixes: list[list[int]], max_new_tokens: list[int]) -> list[Continuation]:
        budget = max(1, max(max_new_tokens))
        plan = (self.store.plan(prefixes, self.pad_id, self.model, budget) if self.store is not None
                else left_padded(prefixes, self.pad_id))
        device = self.model.device
        out = self.model.generate(
            input_ids=plan.input_ids.to(device),
            attention_mask=plan.attention_mask.to(device),
            max_new_tokens=budget,
            do_sample=False,
            temperature=None,
            top_p=None,
            top_k=None,
            eos_token_id=self.eos_ids,
            pad_token_id=self.pad_id,
            return_dict_in_generate=True,
            use_cache=True,
            **({} if plan.cache is None else {"cache": plan.cache}),
        )
        new = out.sequences[:, plan.input_ids.shape[1] :].cpu()
        lengths = [_cut_at_eos(new[row].tolist(), set(self.eos_ids), budget) for row, budget in
                   enumerate(max_new_tokens)]
        if self.store is not None:
            self.store.store(plan.cache, plan.attention_mask, prefixes, [new[row, :n].tolist() for row, (n, _) in
                                                                        enumerate(lengths)])
        return [Continuation(new[row, :n].tolist(), [0.0] * n, None, finished)
                for row, (n, finished) in enumerate(lengths)]


@dataclass
class AgentSettings(SamplerSettings):
    """The agent's limits: the turn loop's own (`SamplerSettings`: turns, budgets, tools) and what only evaluation
    has (greedy batch size, prefix reuse, the chat template's). Build it from a training config with `from_config`, so
    evaluation runs the limits the trainer optimised under, read in the one place the trainers read them."""

    max_turns: int = 5
    max_completion_length: int = 512
    batch_size: int = 64
    reuse_prefixes: bool = True  # encode each history once (GreedyEngine); False: re-encode it every turn
    chat_template_kwargs: dict[str, Any] | None = None
    observation_special_tokens: str = "neutralize"  # TreeConfig.observation_special_tokens

    @classmethod
    def from_config(cls, args, max_completion_length: int | None = None, **evaluation) -> AgentSettings:
        """A trainer config's limits (`SamplerSettings.from_config`) and its chat template's, with the
        evaluation-only fields (`batch_size`, `reuse_prefixes`) as keywords."""
        return super().from_config(args, max_completion_length, chat_template_kwargs=args.chat_template_kwargs,
                                   observation_special_tokens=args.observation_special_tokens, **evaluation)


def run_agent(
    model,
    tokenizer,
    prompts: list[list[dict[str, Any]]],
    tools: Sequence[Callable],
    settings: AgentSettings,
    engine=None,
) -> list[Branch]:
    """Greedy multi-turn rollouts, one per prompt: generate a turn, run its tool calls, append the observation ids,
    until the agent answers, the turn limit or the token budget ends it. Returns the finished branches in order.

    ``engine`` replaces greedy ``model.generate`` with any backend of the trainers' protocol (e.g. a scripted one).
    """
    template = AgentTemplate(tokenizer, tools, settings.chat_template_kwargs, settings.observation_special_tokens)
    loop = TurnLoop(
        TurnLoopPorts(
            engine=engine if engine is not None else GreedyEngine(
                model, template.tokenizer, settings.batch_size, settings.reuse_prefixes
            ),
            parse=template.parse,
            observation_ids=template.observation_ids,
        ),
        settings,
    )
    tool_map = {tool.__name__: tool for tool in tools}
    branches = []
    for i, prompt in enumerate(prompts):
        ids = template.prompt_ids(prompt)
        branches.append(Branch(tree=i, prefix_ids=ids, prompt_len=len(ids), tools=dict(tool_map)))
    was_training = model is not None and model.training
    if model is not None:
        model.eval()  # no dropout in greedy decoding
    try:
        # the loop's tool pool lives as long as this evaluation: its threads stop when it ends, Ctrl-C included
        with loop:
            # one batch of questions at a time, to the end: the reused keys and values of a batch are dropped before
            # the next batch starts, so memory holds one batch's histories, not every question's
            for start in range(0, len(branches), settings.batch_size):
                with rollout_session(loop.ports.engine):
                    loop.run(branches[start : start + settings.batch_size])
    finally:
        if model is not None:
            model.train(was_training)
    return branches


@dataclass
class AgentEvaluation:
    """Scores of one greedy answer per question: EM and F1 (SQuAD-normalised, unthresholded, as the paper reports),
    the rate of well-formed final answers, and mean assistant turns and tool calls."""

    exact_match: float
    f1: float
    format_rate: float
    mean_turns: float
    mean_tool_calls: float
    num_questions: int
    records: list[dict[str, Any]] = field(default_factory=list, repr=False)

    def summary(self) -> dict[str, float]:
        return {
            "exact_match": self.exact_match,
            "f1": self.f1,
            "format_rate": self.format_rate,
            "mean_turns": self.mean_turns,
            "mean_tool_calls": self.mean_tool_calls,
            "num_questions": self.num_questions,
        }


def evaluate_agent(
    model,
    tokenizer,
    rows: Sequence[dict[str, Any]],
    tools: Sequence[Callable],
    settings: AgentSettings | None = None,
    accelerator=None,
    engine=None,
) -> AgentEvaluation:
    """Evaluate ``model`` as a search agent on ``rows`` (each with ``prompt`` and ``answer``, e.g. from
    :func:`~trl_tree.envs.hotpot.examples_to_dataset`).

    With an ``accelerator`` on several processes, each process answers its share of the questions and the records
    are gathered, so every process returns the same numbers. ``model`` must then be an ordinary (not sharded) model
    on each process: evaluation generates a different number of turns per process, which sharded models cannot.
    """
    settings = settings or AgentSettings()
    rows = list(rows)
    indices = list(range(len(rows)))
    if accelerator is not None and accelerator.num_processes > 1:
        indices = indices[accelerator.process_index :: accelerator.num_processes]
    mine = [rows[i] for i in indices]
    prompts = [row["prompt"] for row in mine]
    branches = run_agent(model, tokenizer, prompts, tools, settings, engine=engine) if mine else []
    records = []
    for i, row, branch in zip(indices, mine, branches):
        prediction = extract_answer(branch.messages)
        records.append(
            {
                "index": i,
                "id": row.get("id"),
                "question": row.get("question"),
                "answer": row["answer"],
                "prediction": prediction,
                "exact_match": exact_match_score(prediction, row["answer"]),
                "f1": f1_score(prediction, row["answer"]),
                "well_formed": is_well_formed(branch.messages),
                "turns": len(branch.turns),
                "tool_calls": branch.tool_calls,
                "completion": branch.messages,
            }
        )
    if accelerator is not None and accelerator.num_processes > 1:
        from accelerate.utils import gather_object

        records = sorted(gather_object(records), key=lambda r: r["index"])
    n = max(1, len(records))
    return AgentEvaluation(
        exact_match=sum(r["exact_match"] for r in records) / n,
        f1=sum(r["f1"] for r in records) / n,
        format_rate=sum(r["well_formed"] for r in records) / n,
        mean_turns=sum(r["turns"] for r in records) / n,
        mean_tool_calls=sum(r["tool_calls"] for r in records) / n,
        num_questions=len(records),
        records=records,
    )


def load_model_for_eval(path: str, dtype="auto", device=None, attn_implementation: str | None = None):
    """A saved policy and its tokenizer, ready for :func:`evaluate_agent`.

    ``path`` is a model folder or Hub id, or a PEFT adapter folder (what ``save_model`` writes when training with
    LoRA); an adapter is loaded onto its base model and merged, so generation runs at the base model's speed.
    """
    import os

    from transformers import AutoModelForCausalLM, AutoTokenizer

    kwargs = {"dtype": dtype}
    if attn_implementation is not None:
        kwargs["attn_implementation"] = attn_implementation
    if os.path.isfile(os.path.join(path, "adapter_config.json")):
        from peft import AutoPeftModelForCausalLM

        model = AutoPeftModelForCausalLM.from_pretrained(path, **kwargs).merge_and_unload()
    else:
        model = AutoModelForCausalLM.from_pretrained(path, **kwargs)
    if device is not None:
        model.to(device)
    model.eval()
    return model, AutoTokenizer.from_pretrained(path)
