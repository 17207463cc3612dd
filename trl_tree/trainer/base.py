"""`TreeTrainer`: the GRPOTrainer subclass every tree method builds on (DESIGN §2).

It replaces two things of GRPOTrainer and keeps the rest (datasets, reward functions, tools and environments, PEFT,
accelerate / DeepSpeed, vLLM, logging, checkpoints, Hub):

1. generation (`_generate_and_score_completions`): grow one rollout tree per prompt with a sampler, score every leaf
   with TRL's reward functions, recompute π_old with one no-grad packed forward of the training model, compute the
   method's turn credit, and return one packed row per tree (trees stay whole when TRL splits the generation batch
   into micro-batches);
2. the loss (`_compute_loss`): one packed forward of the current policy and the method's turn-level loss.

The configuration chooses the sampler, the credit and the loss independently (`trl_tree.trainer.components`); the
named trainers (`TreeOPSDTrainer`, `TreePOTrainer`, `AT2POTrainer`) are presets of `TreeTrainer`.
"""

from __future__ import annotations

import functools
import inspect
import math
from typing import Any

import torch
from trl import GRPOTrainer
from trl.chat_template_utils import parse_response
from trl.data_utils import is_conversational
from trl.trainer.utils import is_async_callable

from .. import credit, losses
from ..packing import PackedTrees, pack_cheapest, pack_trees, packed_token_logps, unwrap_model
from ..rollout.engine import HFEngine
from ..rollout.env import environment_tools
from ..rollout.samplers import SamplerSettings, TreeRoot, TurnLoop
from ..tree import RolloutTree
from . import components, model_card
from .config import TreeConfig

PER_TURN = "credit_"  # batch keys of per-turn tensors, padded to the largest tree: [N, max_turns]


class TreeTrainer(GRPOTrainer):
    """A GRPOTrainer that grows rollout trees and trains unique turns with a turn-level loss.

    Use it directly with a `TreeConfig` to compose a sampler, a credit and a loss, or use a named preset
    (`TreeOPSDTrainer`, `TreePOTrainer`, `AT2POTrainer`). Takes GRPOTrainer's arguments (`tools=`,
    `environment_factory=`, `peft_config=`, reward functions with TRL's signature, …) except `rollout_func`.
    """

    _name = "Tree"
    _tag_names = ["trl", "trl-tree"]
    config_class = TreeConfig
    create_model_card = model_card.create_tree_model_card

    def __init__(self, model, reward_funcs=None, args: TreeConfig | None = None, **kwargs):
        if args is None:
            name = model if isinstance(model, str) else model.config._name_or_path
            args = self.config_class(f"{str(name).split('/')[-1]}-{self._name}")
        if not isinstance(args, TreeConfig):
            raise TypeError(
                f"{type(self).__name__} needs a TreeConfig such as {self.config_class.__name__} (got "
                f"{type(args).__name__}): the tree fields (sampler, credit, loss, num_initial_rollouts, …) live there."
            )
        if kwargs.get("rollout_func") is not None:
            raise ValueError(
                f"{type(self).__name__} grows its own rollout trees; `rollout_func` does not apply. Pass `tools=` or "
                "`environment_factory=` for tool use."
            )
        super().__init__(model, reward_funcs, args=args, **kwargs)
        self._resize_completion_logs(args.generation_batch_size * args.leaves_per_tree)
        self._hide_fork_from_tools()
        self.reward_funcs = [_guard_reward_func(f, n) for f, n in zip(self.reward_funcs, self.reward_func_names)]
        self.generation_engine = self._build_engine()
        self.sampler = self.build_sampler(self._build_turn_loop())

    # ---------------------------------------------------------------- set-up

    def _resize_completion_logs(self, maxlen: int):
        """GRPOTrainer keeps one generation batch of completions for `log_completions`; a tree batch has K leaves
        per prompt."""
        from collections import defaultdict, deque

        self._logs = {
            "images": deque(maxlen=maxlen),
            "prompt": deque(maxlen=maxlen),
            "completion": deque(maxlen=maxlen),
            "rewards": defaultdict(lambda: deque(maxlen=maxlen)),
            "advantages": deque(maxlen=maxlen),
            "extra": defaultdict(lambda: deque(maxlen=maxlen)),
        }

    def _hide_fork_from_tools(self):
        """An environment's `fork()` is how we branch it, not a tool for the model."""
        if self.environment_factories is None:
            return
        for name, tools in self._env_tools.items():
            self._env_tools[name] = [t for t in tools if getattr(t, "__name__", "") != "fork"]
        self.tools = [t for t in self.tools if getattr(t, "__name__", "") != "fork"]

    def _build_engine(self):
        if self.use_vllm:
            from ..rollout.vllm_engine import VLLMEngine

            return VLLMEngine(self, with_scores=self.needs_entropies)
        return HFEngine(self, with_scores=self.needs_entropies)

    @property
    def needs_entropies(self) -> bool:
        """Per-token entropies from generation are needed by entropy-guided expansion and the entropy backup (A1)."""
        a = self.args
        return (
            (a.sampler == "entropy_guided" and a.expansion_mode == "entropy")
            or a.sampler == "token_entropy"
            or a.credit == "child_softmax"
        )

    def _build_turn_loop(self) -> TurnLoop:
        settings = SamplerSettings(
            max_turns=self.args.max_turns,
            max_completion_length=self.max_completion_length,
            tool_timeout=self.args.tool_timeout,
            max_observation_chars=self.args.max_observation_chars,
            failure_penalty=self.args.tool_failure_penalty,
            malformed_tool_calls=self.args.malformed_tool_calls,
            max_turn_tokens=self.args.max_turn_tokens,
        )
        return TurnLoop(
            engine=_EngineProxy(self),
            parse=self._parse_action,
            observation_ids=self._get_tool_suffix_ids,
            settings=settings,
            any_active=self._any_rank_active,
        )

    def build_sampler(self, loop: TurnLoop):
        seed = self.args.seed + 1000 * self.accelerator.process_index
        return components.build_sampler(self.args, loop, seed)

    def _parse_action(self, ids: list[int], prefix: list[int]) -> dict:
        if not self.tools:
            return {"role": "assistant", "content": self._tokenizer.decode(ids, skip_special_tokens=True)}
        return parse_response(self._tokenizer, ids, prefix=prefix, tools=self.tools)

    def _any_rank_active(self, flag: bool) -> bool:
        if self.accelerator.num_processes == 1:
            return flag
        t = torch.tensor([1.0 if flag else 0.0], device=self.accelerator.device)
        return bool(self.accelerator.reduce(t, reduction="sum").item() > 0)

    # ---------------------------------------------------------------- generation

    def _prepare_inputs(self, generation_batch):
        """GRPOTrainer's buffering of a generation batch into `steps_per_generation` micro-batches, with one change:
        the split happens *before* π_old is recomputed, so each micro-batch's π_old comes from exactly the packed
        forward (same trees, same padding) that will train it, and the first block's log-ratio is exactly 0. (A
        whole-batch forward pads differently and leaves ~1e-9 of noise, which Adam can blow up when every reward of
        a block is equal.) Trees are not shuffled again: the prompt sampler already shuffles."""
        if not self.model.training:
            return self._generate_and_score_completions(generation_batch)
        generate_every = self.args.steps_per_generation * self.num_iterations
        if self._step % generate_every == 0 or self._buffered_inputs is None:
            self._buffered_inputs = self._generate_micro_batches(generation_batch, self.args.steps_per_generation)
        return self._buffered_inputs[self._step % self.args.steps_per_generation]

    def _generate_and_score_completions(self, inputs: list[dict[str, Any]]) -> dict[str, torch.Tensor]:
        return self._generate_micro_batches(inputs, 1)[0]

    def _generate_micro_batches(self, inputs: list[dict[str, Any]], num_chunks: int) -> list[dict[str, torch.Tensor]]:
        """Grow and score one tree per prompt, then pack, recompute π_old and compute credit per micro-batch."""
        mode = "train" if self.model.training else "eval"
        if any("image" in x or "images" in x for x in inputs):
            raise ValueError(f"{type(self).__name__} supports text-only prompts; this batch has images.")
        prompts, roots = self._prepare_roots(inputs)
        branches_per_tree = self.sampler.sample(roots)

        rewards = self._score_leaves(inputs, prompts, branches_per_tree)
        trees = [
            RolloutTree.from_trajectories(root.prompt_ids, [b.turns for b in branches], r.tolist())
            for root, branches, r in zip(roots, branches_per_tree, rewards)
        ]
        batches, per_turn, forward_tokens = self._micro_batches(trees, num_chunks, mode)
        self._log_generation(mode, prompts, trees, branches_per_tree, rewards, per_turn, forward_tokens)
        return batches

    def _micro_batches(self, units: list, num_chunks: int, mode: str):
        """Split whole units (trees; TreeFlex's groups) into `num_chunks` micro-batches. Each is packed, gets π_old
        from the very packed forward that will train it (T6: the first block's log-ratio is exactly 0), and its
        credit. Returns the batches, every unit's per-turn credit, and the tokens the packed forwards process."""
        size = len(units) // num_chunks
        batches, per_turn, forward_tokens = [], [], 0
        for start in range(0, len(units), size):
            chunk = units[start : start + size]
            packed, old_logps = self._pack_with_behaviour_logps(chunk, mode)
            credit_of_chunk = [self.turn_credit(unit) for unit in chunk]
            batch = {**packed.to(self.accelerator.device).to_dict(), "old_logps": old_logps}
            batch.update(_pad_per_turn(credit_of_chunk, self.accelerator.device))
            batches.append(batch)
            per_turn += credit_of_chunk
            forward_tokens += packed.num_forward_tokens
        return batches, per_turn, forward_tokens

    def _pack_with_behaviour_logps(self, trees: list[RolloutTree], mode: str) -> tuple[PackedTrees, torch.Tensor]:
        """One micro-batch of trees packed, and π_old's log-probs on it (written back into the trees' turns)."""
        packed = self._pack(trees)
        if self.args.packing == "auto":
            self._metrics[mode]["tree/packed_as_tree"].append(float(packed.input_ids.shape[1] == 1))
        old_logps = self._behaviour_logps(packed, trees)
        if self.mask_truncated_completions:
            _mask_truncated_turns(packed, trees)
        return packed, old_logps

    def _pack(self, trees: list[RolloutTree]) -> PackedTrees:
        """One micro-batch of trees in the configured layout ("auto": the cheaper forward for this model)."""
        if self.args.packing == "auto":
            return pack_cheapest(trees, self._tokenizer.pad_token_id, unwrap_model(self.model).config)
        return pack_trees(trees, self._tokenizer.pad_token_id, layout=self.args.packing)

    def _prepare_roots(self, inputs):
        """Reset one environment per prompt (its tools and state are the tree's root) and render the prompts."""
        prompts = [x.get("prompt", [{"role": "user", "content": ""}]) for x in inputs]
        envs = [None] * len(inputs)
        if self.environment_factories is not None:
            self._batch_environments = [x.get("environment") if self._multi_environment else None for x in inputs]
            envs = []
            for i, (x, name) in enumerate(zip(inputs, self._batch_environments)):
                if name not in self.environment_factories:
                    raise ValueError(
                        f"Example has environment={name!r}, not among {list(self.environment_factories)}."
                    )
                env = self.environment_factories[name]()
                kwargs = {k: v for k, v in x.items() if k != "environment"} if self._multi_environment else x
                observation = env.reset(**kwargs)
                if isinstance(observation, str) and is_conversational({"prompt": prompts[i]}):
                    last = prompts[i][-1]
                    prompts[i] = prompts[i][:-1] + [{**last, "content": last["content"] + observation}]
                envs.append(env)
        prompt_ids, _, _ = self._tokenize_prompts(prompts)
        roots = []
        for ids, env in zip(prompt_ids, envs):
            tools = {t.__name__: t for t in self._standalone_tools}
            if env is not None:
                tools.update({m.__name__: m for m in environment_tools(env)})
            roots.append(TreeRoot(prompt_ids=list(ids), env=env, tools=tools))
        return prompts, roots

    def _score_leaves(self, inputs, prompts, branches_per_tree) -> list[torch.Tensor]:
        """TRL's reward functions on every leaf: the completion is the whole multi-turn conversation after the prompt;
        dataset columns are passed through (repeated per leaf), environments as `environments`."""
        leaf_inputs, leaf_prompts, completions, completion_ids, envs = [], [], [], [], []
        for x, prompt, branches in zip(inputs, prompts, branches_per_tree):
            for b in branches:
                leaf_inputs.append(x)
                leaf_prompts.append(prompt)
                completions.append(b.messages if is_conversational({"prompt": prompt}) else _as_text(b.messages))
                completion_ids.append(b.prefix_ids[b.prompt_len :])
                envs.append(b.env)
        # TRL's `_calculate_rewards` gathers every rank's rows, which needs equal counts: a sampler may give ranks
        # different numbers of leaves, so pad with repeats of the last leaf and drop their rewards afterwards.
        n = len(leaf_inputs)
        width = self._max_over_ranks(n)
        for column in (leaf_inputs, leaf_prompts, completions, completion_ids, envs):
            column.extend(column[-1:] * (width - n))
        self.environments = envs if self.environment_factories is not None else None
        per_func = self._calculate_rewards(leaf_inputs, leaf_prompts, completions, completion_ids)
        start = self.accelerator.process_index * width
        per_func = per_func[start : start + n]
        rewards = (per_func * self.reward_weights.to(per_func.device).unsqueeze(0)).nansum(dim=1).cpu()
        self._last_rewards_per_func = per_func.cpu()
        sizes = [len(b) for b in branches_per_tree]
        return list(torch.split(rewards, sizes))

    @torch.no_grad()
    def _behaviour_logps(self, packed: PackedTrees, trees: list[RolloutTree]) -> torch.Tensor:
        """T6: π_old's log-probs, recomputed by the training model in the same packed forward code as π_θ (so the
        first block's log-ratio is exactly 0), written back into each tree's turns for the likelihood backup."""
        device_packed = packed.to(self.accelerator.device)
        logps, _ = packed_token_logps(self.model, device_packed, temperature=self.temperature)
        cpu = logps.detach().float().cpu()
        for n, tree in enumerate(trees):
            mask = packed.turn_ids[n] >= 0
            ids, values = packed.turn_ids[n][mask], cpu[n][mask]
            order = torch.argsort(ids, stable=True)
            counts = torch.bincount(ids, minlength=tree.num_turns).tolist()
            for turn, chunk in zip(tree.turns, torch.split(values[order], counts)):
                turn.action_logps = chunk.tolist()
        return logps.detach()

    def turn_credit(self, tree: RolloutTree) -> dict[str, torch.Tensor]:
        """Per-turn tensors of one tree (over `tree.turns`) that the loss needs; 0-dim tensors are per tree."""
        return components.turn_credit(tree, self.args)

    # ---------------------------------------------------------------- loss

    def _compute_loss(self, model, inputs):
        mode = "train" if self.model.training else "eval"
        packed = PackedTrees.from_dict(inputs)
        logps, _ = packed_token_logps(model, packed, temperature=self.temperature)
        flat = _flatten_micro_batch(packed, logps, inputs)
        loss = self.turn_loss(flat, mode)
        if mode == "train":
            loss = loss / getattr(self, "current_gradient_accumulation_steps", self.args.gradient_accumulation_steps)
        return loss

    def turn_loss(self, flat: dict[str, torch.Tensor], mode: str) -> torch.Tensor:
        loss = components.LOSSES[self.args.loss].compute(flat, self.args)
        with torch.no_grad():
            num_turns = flat["A"].numel()
            s = losses.turn_mean_log_ratio(flat["logps"], flat["old_logps"], flat["turn_ids"], num_turns)
        block = self._optimizer_block()
        if "q" in flat:  # how far each turn still is from its teacher
            gap = (torch.sigmoid(s) - flat["q"]).abs().tolist()
            self._metrics[mode][f"treeopsd/abs_p_minus_q/block_{block}"].append(self._mean_over_ranks(gap))
        self._metrics[mode][f"tree/abs_log_ratio/block_{block}"].append(self._mean_over_ranks(s.abs().tolist()))
        return loss

    def _optimizer_block(self) -> int:
        """Which of the E sequential optimizer blocks of the current generation batch is being trained."""
        return (self._step % self.args.steps_per_generation) // self.args.gradient_accumulation_steps

    # ---------------------------------------------------------------- metrics

    def _max_over_ranks(self, value: int) -> int:
        if self.accelerator.num_processes == 1:
            return value
        t = torch.tensor([value], device=self.accelerator.device)
        return int(self.accelerator.reduce(t, reduction="max").item())

    def _gather_uneven(self, values: torch.Tensor) -> torch.Tensor:
        """All ranks' values of a 1-D tensor whose length differs by rank (padded with NaN, which is dropped)."""
        values = values.float().to(self.accelerator.device)
        if self.accelerator.num_processes == 1:
            return values
        padded = self.accelerator.pad_across_processes(values, dim=0, pad_index=float("nan"))
        gathered = self.accelerator.gather(padded)
        return gathered[~torch.isnan(gathered)]

    def _mean_over_ranks(self, values: list[float]) -> float:
        t = torch.tensor([sum(values), float(len(values))], device=self.accelerator.device, dtype=torch.float64)
        total = self.accelerator.reduce(t, reduction="sum")
        return (total[0] / total[1].clamp(min=1)).item()

    def _log_generation(self, mode, prompts, trees, branches_per_tree, rewards, per_turn, forward_tokens: int):
        metrics = self._metrics[mode]
        all_rewards = self._gather_uneven(torch.cat(rewards))
        metrics["reward"].append(all_rewards.mean().item())
        metrics["reward_std"].append(all_rewards.std().item() if all_rewards.numel() > 1 else 0.0)
        for i, name in enumerate(self.reward_func_names):
            col = self._gather_uneven(self._last_rewards_per_func[:, i])
            metrics[f"rewards/{name}/mean"].append(torch.nanmean(col).item() if col.numel() else float("nan"))
        leaves = [b for branches in branches_per_tree for b in branches]
        metrics["tree/leaves_per_tree"].append(self._mean_over_ranks([t.num_leaves for t in trees]))
        metrics["tree/unique_turns"].append(self._mean_over_ranks([t.num_turns for t in trees]))
        metrics["tree/unique_tokens"].append(self._mean_over_ranks([t.num_unique_tokens for t in trees]))
        metrics["tree/flat_tokens"].append(self._mean_over_ranks([t.num_path_tokens for t in trees]))
        metrics["tree/forward_tokens"].append(self._mean_over_ranks([forward_tokens / len(trees)]))
        metrics["tree/turns_per_leaf"].append(self._mean_over_ranks([len(b.turns) for b in leaves]))
        metrics["completions/mean_length"].append(self._mean_over_ranks([b.completion_len for b in leaves]))
        calls = sum(b.tool_calls for b in leaves)
        failures = sum(b.tool_failures for b in leaves)
        if self.tools:
            metrics["tools/call_frequency"].append(self._mean_over_ranks([b.tool_calls for b in leaves]))
            total = self.accelerator.reduce(torch.tensor([failures, calls], dtype=torch.float64,
                                                         device=self.accelerator.device), reduction="sum")
            metrics["tools/failure_frequency"].append((total[0] / total[1].clamp(min=1)).item())
        self.log_turn_credit(metrics, per_turn)
        if mode == "train":
            tokens = torch.tensor(float(forward_tokens), device=self.accelerator.device)
            self.state.num_input_tokens_seen += int(self.accelerator.reduce(tokens, reduction="sum").item())
        if self.log_completions:
            self._log_tree_completions(prompts, trees, branches_per_tree)

    def log_turn_credit(self, metrics, per_turn: list[dict[str, torch.Tensor]]) -> None:
        """Mean |A| of the turn credit, and for TreeOPSD mean |q − 1/2| (how far the teachers move the policy)."""
        metrics["tree/abs_turn_advantage"].append(self._mean_over_ranks([a for d in per_turn for a in d["A"].abs().tolist()]))
        if "q" in per_turn[0]:
            gaps = [g for d in per_turn for g in (d["q"] - 0.5).abs().tolist()]
            metrics["treeopsd/abs_q_minus_half"].append(self._mean_over_ranks(gaps))

    def _log_tree_completions(self, prompts, trees, branches_per_tree):
        from accelerate.utils import gather_object

        rows_prompt, rows_completion, rows_tree, rows_adv = [], [], [], []
        for prompt, tree, branches in zip(prompts, trees, branches_per_tree):
            A = credit.standardize(torch.tensor(tree.rewards), min_leaves=1) if tree.num_leaves > 1 else [0.0]
            text = render_tree(tree, self._tokenizer)
            for k, b in enumerate(branches):
                rows_prompt.append(prompt)
                rows_completion.append(b.messages)
                rows_tree.append(text if k == 0 else f"(leaf {k} of the tree above: turns {tree.paths[k]})")
                rows_adv.append(float(A[k]))
        self._logs["prompt"].extend(gather_object(rows_prompt))
        self._logs["completion"].extend(gather_object(rows_completion))
        for i, name in enumerate(self.reward_func_names):
            self._logs["rewards"][name].extend(gather_object(self._last_rewards_per_func[:, i].tolist()))
        self._logs["advantages"].extend(gather_object(rows_adv))
        self._logs["extra"]["tree"].extend(gather_object(rows_tree))  # GRPOTrainer.log prints and saves the table


# -------------------------------------------------------------------- helpers


class _EngineProxy:
    """Looks up `trainer.generation_engine` at call time, so tests and users can swap the backend after init."""

    def __init__(self, trainer):
        self.trainer = trainer

    def generate(self, prefixes, max_new_tokens):
        return self.trainer.generation_engine.generate(prefixes, max_new_tokens)


def _as_text(messages: list[dict]) -> str:
    return "".join(m.get("content") or "" for m in messages if m.get("role") == "assistant")


def _mask_truncated_turns(packed: PackedTrees, trees: list[RolloutTree]) -> None:
    """Like GRPO's `mask_truncated_completions`, per turn: a turn cut by the budget is context, not trained."""
    for n, tree in enumerate(trees):
        truncated = [i for i, t in enumerate(tree.turns) if t.truncated]
        if truncated:
            hit = torch.isin(packed.turn_ids[n], torch.tensor(truncated, device=packed.turn_ids.device))
            packed.turn_ids[n][hit] = -1
            packed.score_index[n][hit] = -1


def _pad_per_turn(per_turn: list[dict[str, torch.Tensor]], device) -> dict[str, torch.Tensor]:
    """Stack per-tree credit: per-turn tensors padded to [N, max_turns], per-tree scalars to [N]."""
    out: dict[str, torch.Tensor] = {}
    width = max(max((v.numel() for v in d.values() if v.dim() == 1), default=1) for d in per_turn)
    out[PER_TURN + "count"] = torch.tensor([_num_turns(d) for d in per_turn], device=device)
    for key in per_turn[0]:
        values = [d[key] for d in per_turn]
        if values[0].dim() == 0:
            out[PER_TURN + key] = torch.stack(values).to(device)
        else:
            padded = torch.zeros(len(values), width, dtype=values[0].dtype)
            for n, v in enumerate(values):
                padded[n, : v.numel()] = v
            out[PER_TURN + key] = padded.to(device)
    return out


def _num_turns(d: dict[str, torch.Tensor]) -> int:
    return max((v.numel() for v in d.values() if v.dim() == 1), default=0)


def _flatten_micro_batch(packed: PackedTrees, logps: torch.Tensor, inputs: dict) -> dict[str, torch.Tensor]:
    """Per-token tensors of the trained tokens with global turn ids, and per-turn tensors of the micro-batch's trees:
    the layout `trl_tree.losses` takes (DESIGN §4)."""
    counts = inputs[PER_TURN + "count"]
    n_trees = counts.numel()
    offsets = torch.cumsum(counts, 0) - counts
    mask = packed.turn_ids >= 0
    tree_of_token = torch.arange(n_trees, device=logps.device).view(-1, 1, 1).expand_as(packed.turn_ids)
    turn_mask = torch.arange(int(counts.max()), device=counts.device).unsqueeze(0) < counts.unsqueeze(1)
    flat = {
        "logps": logps[mask],
        "old_logps": inputs["old_logps"][mask],
        "turn_ids": (packed.turn_ids + offsets.view(-1, 1, 1))[mask],
        "token_tree_ids": tree_of_token[mask],
        "tree_ids": torch.arange(n_trees, device=counts.device).unsqueeze(1).expand_as(turn_mask)[turn_mask],
        "num_trees": n_trees,
    }
    for key, value in inputs.items():
        if key.startswith(PER_TURN) and key != PER_TURN + "count":
            name = key[len(PER_TURN) :]
            flat[name] = value if value.dim() == 1 else value[:, : turn_mask.shape[1]][turn_mask]
    return flat


def render_tree(tree: RolloutTree, tokenizer, values: torch.Tensor | None = None, width: int = 80) -> str:
    """The tree as indented text: one line per unique turn (its action, the observation's start, ×multiplicity),
    then the K rewards. Used by `log_completions`."""
    lines = [f"prompt ({len(tree.prompt_ids)} tokens)  K={tree.num_leaves}  unique turns={tree.num_turns}"]
    for i, turn in enumerate(tree.turns):
        action = tokenizer.decode(turn.action_ids, skip_special_tokens=False).replace("\n", " ")
        if len(action) > width:
            action = action[: width - 1] + "…"
        extra = f" ×{turn.multiplicity}" if turn.multiplicity > 1 else ""
        value = f" V={values[i]:+.3f}" if values is not None else ""
        lines.append(f"{'  ' * (turn.depth + 1)}[{i}] {action}{extra}{value}")
    lines.append("rewards: " + " ".join(f"{r:g}" for r in tree.rewards))
    return "\n".join(lines)


def _guard_reward_func(func, name: str):
    """Wrap a reward function so that an exception or a NaN names the function and the sample.

    `None` stays allowed (TRL's "not applicable"); NaN or ±inf is an error, because a tree needs every leaf's reward
    to standardise and back up. A model-based reward (an `nn.Module`) or an async function is left as it is.
    """
    if isinstance(func, torch.nn.Module) or is_async_callable(func) or getattr(func, "_trl_tree_guarded", False):
        return func

    @functools.wraps(func)
    def guarded(*args, prompts=None, completions=None, **kwargs):
        try:
            out = func(*args, prompts=prompts, completions=completions, **kwargs)
        except Exception as e:
            j = _first_failing_sample(func, prompts, completions, kwargs)
            where = f"sample {j}" if j is not None else f"a batch of {len(completions or [])} samples"
            raise RuntimeError(
                f"Reward function '{name}' raised {type(e).__name__}: {e} on {where}"
                + (f" (completion: {_short(completions[j])})" if j is not None else "")
                + ". Fix the function, or return None for samples it cannot score."
            ) from e
        for j, r in enumerate(out or []):
            if r is not None and not math.isfinite(float(r)):
                raise ValueError(
                    f"Reward function '{name}' returned {r} for sample {j} (completion: {_short(completions[j])}). "
                    "Rewards must be finite; return None where the function does not apply."
                )
        return out

    guarded._trl_tree_guarded = True
    guarded.__signature__ = inspect.signature(func) if callable(func) else None
    return guarded


def _first_failing_sample(func, prompts, completions, kwargs) -> int | None:
    n = len(completions or [])
    for j in range(n):
        one = {k: ([v[j]] if isinstance(v, list) and len(v) == n else v) for k, v in kwargs.items()}
        try:
            func(prompts=[prompts[j]], completions=[completions[j]], **one)
        except Exception:
            return j
    return None


def _short(x, n: int = 160) -> str:
    s = str(x)
    return s if len(s) <= n else s[: n - 1] + "…"
