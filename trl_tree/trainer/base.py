"""`TreeTrainer`: the GRPOTrainer subclass every tree method builds on (docs/design.md §2).

It replaces two things of GRPOTrainer and keeps the rest (datasets, reward functions, tools and environments, PEFT,
accelerate / DeepSpeed, vLLM, logging, checkpoints, Hub):

1. generation (`_generate_and_score_completions`): one generation batch of `trl_tree.core.pipeline` (grow one rollout
   tree per prompt with a sampler, score every leaf with TRL's reward functions, recompute π_old with one no-grad
   packed forward of the training model, compute the method's turn credit), returned as one packed row per tree
   (trees stay whole when TRL splits the generation batch into micro-batches);
2. the loss (`_compute_loss`): one packed forward of the current policy and the method's turn-level loss.

The pipeline knows no TRL: this class is the adapter that gives it narrow ports (`pipeline_ports`: GRPOTrainer's
prompt rendering and environments, TRL's reward computation, the model's forward, the credit) and its unit
(`rollout_unit`; TreeFlex's group is another), and logs what comes back. The TRL-side jobs behind those ports are
collaborators built in `__init__` from what they read (TRL's private names reached only through `trl_internals`,
here): `prompts.PromptRenderer` (render and check the prompts, parse a turn after them),
`environments.RootEnvironments` (the environment pool, resets, a root's tools) and `scoring.LeafScorer` (TRL's
reward computation on every leaf, padded per rank, the leaves' environments with them); `generation_logging`
(the generation metrics) is still a mixin; the generation backends get their ports from `engine_ports`.

The configuration chooses the sampler, the credit and the loss independently from the method table
(`trl_tree.methods`); the named trainers (`TreeOPSDTrainer`, `TreePOTrainer`, `AT2POTrainer`, `TreeAdvTrainer`) are
presets of `TreeTrainer`. `generate_batch` is the public seam to one generation batch (what TRL trains on).
"""

from __future__ import annotations

import functools
import gc
from typing import Any

import torch
from trl import GRPOTrainer

from .. import methods, trl_internals
from ..core import pipeline
from ..core.batch import LossInputs, TurnCredit
from ..core.packing import attend_tree_rows_by_chains, unwrap_model
from ..core.tree import RolloutTree
from ..core.tree_unit import TreeUnits
from ..rollout.generating.engine import HFEngine, rollout_session
from ..rollout.growing.samplers import TreeRoot
from ..rollout.growing.turn_loop import SamplerSettings, TurnLoop, TurnLoopPorts
from . import async_rollouts, collaborators, engine_ports, prompt_loading, resume
from .configuration import tree_budget
from .configuration.fields import TreeConfig, TreeTrainerConfig
from .environments import hide_fork
from .observability import model_card
from .observability import rank_metrics as tree_metrics
from .observability.generation_logging import GenerationLogging
from .observability.tree_view_logging import TreeViewRecorder
from .prompts import check_dataset_prompts, warn_unseen_tools
from .run_lock import holds_output_dir
from .scoring import check_completion_formats, guarded_reward_funcs


class TreeTrainer(GenerationLogging, GRPOTrainer):
    """A GRPOTrainer that grows rollout trees and trains unique turns with a turn-level loss.

    Use it directly with a `TreeConfig` to compose a sampler, a credit and a loss, or use a named preset
    (`TreeOPSDTrainer`, `TreePOTrainer`, `AT2POTrainer`). Takes GRPOTrainer's arguments (`tools=`,
    `environment_factory=`, `peft_config=`, reward functions with TRL's signature, …) except `rollout_func`.
    """

    _name = "Tree"
    _tag_names = ["trl", "trl-tree"]
    config_class = TreeConfig
    config_base: type[TreeTrainerConfig] = TreeConfig  # what `args` must be an instance of
    create_model_card = model_card.create_tree_model_card

    def __init__(self, model, reward_funcs=None, args: TreeTrainerConfig | None = None, **kwargs):
        if args is None:
            name = model if isinstance(model, str) else model.config._name_or_path
            args = self.config_class(f"{str(name).split('/')[-1]}-{self._name}")
        if not isinstance(args, self.config_base):  # TreeConfig; TreeFlexTrainer's is TreeFlexConfig
            raise TypeError(
                f"{type(self).__name__} needs a TreeConfig such as {self.config_class.__name__} (got "
                f"{type(args).__name__}): the tree fields (sampler, credit, loss, num_initial_rollouts, …) live there."
            )
        if kwargs.get("rollout_func") is not None:
            raise ValueError(
                f"{type(self).__name__} grows its own rollout trees; `rollout_func` does not apply. Pass `tools=` or "
                "`environment_factory=` for tool use."
            )
        trl_internals.check_installed()  # a TRL release that renamed what we build on fails here, with the names
        datasets = [("train_dataset", kwargs.get("train_dataset")), ("eval_dataset", kwargs.get("eval_dataset"))]
        # every row's prompt shape, before anything reads a row (`prompts.check_dataset_prompts`)
        check_dataset_prompts(
            type(self).__name__, datasets, owns_prompts=kwargs.get("environment_factory") is not None
        )
        check_completion_formats(type(self).__name__, reward_funcs, datasets)
        warn_unseen_tools(type(self).__name__, datasets, kwargs.get("tools"))
        super().__init__(model, reward_funcs, args=args, **kwargs)
        if self._forwards_tree_rows():  # sdpa -> tree_sdpa: a tree row's visible pairs only
            attend_tree_rows_by_chains(self.model)
        # The dataloader yields prompts, one tree each: a micro-batch of per_device_train_batch_size trajectories of
        # budget is per_device_train_batch_size / G trees (GRPO's micro-batch holds the same prompts, G times each).
        trl_internals.set_train_batch_size(self, args.trees_per_micro_batch)
        self.add_callback(resume.TrainBatchSizeInState())  # the state records the arguments' batch size, not trees
        tree_budget.check_enough_prompts(args, self.train_dataset)
        self._resize_completion_logs(args.prompts_per_generation * args.leaves_per_tree)
        if self.environment_factories is not None:
            self.tools = hide_fork(self.tools, trl_internals.environment_tools_by_name(self))
        self.reward_funcs = guarded_reward_funcs(self.reward_funcs, self.reward_func_names)
        self.scorer = collaborators.leaf_scorer(self)
        self.prompt_renderer = collaborators.prompt_renderer(self)
        self.generation_engine = self._build_engine()
        self._turn_loop = self._build_turn_loop()
        self.sampler = self.build_sampler(self._turn_loop)
        self.root_environments = collaborators.root_environments(self, self._turn_loop.run_call)
        self.environment_pool = self.root_environments.pool
        self.accelerator.print(tree_budget.effective_batch(args, type(self).__name__))
        self.prompt_renderer.warn_if_budget_exceeds_positions()
        self._check_dataset_prompt_lengths(self.train_dataset)
        evals = self.eval_dataset if isinstance(self.eval_dataset, dict) else {"": self.eval_dataset}
        for name, dataset in evals.items():
            self._check_dataset_prompt_lengths(dataset, f"eval_dataset{f'[{name!r}]' if name else ''}")
        # the rollout-tree view (one page per generation batch), with the completions table of log_completions
        self._tree_view = TreeViewRecorder(self) if self.log_completions else None
        self._completions_shown_at: int | None = None  # the step whose completions table `log` last showed
        if self._tree_view is not None:
            self.add_callback(self._tree_view)
        # max_staleness > 0: a rollout worker grows the next generation batches while this one trains
        self._async_rollouts: async_rollouts.AsyncRollouts | None = None
        if args.max_staleness > 0:
            async_rollouts.use_rollout_worker(self, args.max_staleness)

    # ---------------------------------------------------------------- set-up

    def _forwards_tree_rows(self) -> bool:
        """Whether training forwards packed tree rows (with `subtree_end`): every `packing` but "paths"."""
        return self.args.packing != "paths"

    def get_total_train_batch_size(self, args) -> int:
        """transformers' samples per optimizer step (`train_samples_per_second` and the start-up "Total train batch
        size"). GRPO's dataloader repeats each prompt G times, so its samples are completions; ours yields each prompt
        once (one tree), so a tree counts as its K leaves, its completions (at most K for a sampler with a variable K:
        token_entropy)."""
        return super().get_total_train_batch_size(args) * self.args.leaves_per_tree

    def _get_train_sampler(self, dataset=None):
        """GRPO's sampler, each prompt drawn once (`prompt_loading.prompt_sampler`)."""
        return prompt_loading.prompt_sampler(self, self.train_dataset if dataset is None else dataset)

    def get_train_dataloader(self):
        """GRPOTrainer's loader without its G copies of each prompt (`prompt_loading.prompt_dataloader`)."""
        return prompt_loading.prompt_dataloader(self, self._get_train_sampler)

    def _build_engine(self):
        """The generation backend, given narrow ports of this trainer (`engine_ports`), not the trainer itself."""
        if self.use_vllm:
            from ..rollout.generating.vllm_engine import VLLMEngine

            return VLLMEngine(engine_ports.vllm_ports(self), with_scores=self.needs_entropies)
        return HFEngine(engine_ports.hf_ports(self), with_scores=self.needs_entropies)

    @property
    def needs_entropies(self) -> bool:
        """Whether generation records per-token entropies: the sampler or the credit reads them
        (`trl_tree.methods.needs_entropies`)."""
        return methods.needs_entropies(self.args)

    def _build_turn_loop(self, engine=None, *, rank_alone: bool = False) -> TurnLoop:
        """The turn loop the sampler grows trees with; `engine` (the rollout worker's) instead of this trainer's."""
        settings = SamplerSettings.from_config(self.args, max_completion_length=self.max_completion_length)
        return TurnLoop(self.turn_loop_ports(engine, rank_alone=rank_alone), settings)

    def turn_loop_ports(self, engine=None, *, rank_alone: bool = False) -> TurnLoopPorts:
        """The turn loop's narrow view of this trainer, built here only: the generation backend (this trainer's,
        looked up per call, or `engine`), TRL's action parsing and observation rendering, the vote across ranks on
        whether any still has work, and GRPOTrainer's event loop for async tools.

        The vote keeps every rank calling the engine until all are done, which a forward with collectives (ZeRO-3,
        FSDP) needs. `rank_alone`: a loop that runs out of step with the other ranks (the rollout worker's, whose
        engine is a plain policy copy with no collective in its forward) votes with itself alone."""
        return TurnLoopPorts(
            engine=_EngineProxy(self) if engine is None else engine,
            parse=self._parse_action,
            # tool and environment text is untrusted: its control strings are tokenized as text by default
            observation_ids=functools.partial(
                trl_internals.tool_suffix_ids, self, special_tokens=self.args.observation_special_tokens
            ),
            any_active=bool if rank_alone else self._any_rank_active,
            event_loop=getattr(self, "async_loop", None),  # GRPOTrainer starts it when a tool is async
        )

    def build_sampler(self, loop: TurnLoop):
        """The configured sampler (`trl_tree.methods.SAMPLERS`), seeded per process."""
        seed = self.args.seed + 1000 * self.accelerator.process_index
        return methods.SAMPLERS[self.args.sampler].build(self.args, loop, seed)

    def _parse_action(self, ids: list[int], prefix: list[int]) -> dict:
        return self.prompt_renderer.parse_action(ids, prefix)

    def _check_dataset_prompt_lengths(self, dataset, name: str = "train_dataset") -> None:
        self.prompt_renderer.check_dataset_prompt_lengths(dataset, name)

    def _any_rank_active(self, flag: bool) -> bool:
        return tree_metrics.any_rank(self.accelerator, flag)

    # ---------------------------------------------------------------- generation

    def _prepare_inputs(self, generation_batch):
        """GRPOTrainer's buffering of a generation batch into `steps_per_generation` micro-batches, with one change:
        the split happens *before* π_old is recomputed, so each micro-batch's π_old comes from exactly the packed
        forward (same trees, same padding) that will train it, and the first block's log-ratio is exactly 0 (why:
        `trl_tree.core.pipeline.micro_batches`). Trees are not shuffled again: the prompt sampler already shuffles."""
        if not self.model.training:
            return self._generate_and_score_completions(self._one_row_per_prompt(generation_batch))
        generate_every = self.args.steps_per_generation * self.num_iterations
        step = trl_internals.micro_step(self)
        if step % generate_every == 0 or trl_internals.buffered_inputs(self) is None:
            if self._async_rollouts is not None:  # grown ahead by the rollout worker (`async_rollouts`)
                batches = self._async_rollouts.micro_batches(generation_batch)
            else:
                batches = self._generate_micro_batches(generation_batch, self.args.steps_per_generation)
            trl_internals.set_buffered_inputs(self, batches)
        return trl_internals.buffered_inputs(self)[step % self.args.steps_per_generation]

    def _one_row_per_prompt(self, batch: list[dict[str, Any]]) -> list[dict[str, Any]]:
        return prompt_loading.one_row_per_prompt(batch, self.num_generations_eval)

    def generate_batch(self, inputs: list[dict[str, Any]]) -> dict[str, torch.Tensor]:
        """Grow, score and credit one tree per dataset row of `inputs` and return them as one micro-batch: exactly
        what the trainer trains on (in train mode) or evaluates (in eval mode).

        The batch is a flat dict of tensors, as TRL buffers it: the packed trees (`PackedTrees.from_dict(batch)`),
        π_old's log-probs (`batch["old_logps"]`, the packed layout) and the per-turn credit
        (`TurnCredit.from_dict(batch)`, one row per tree). Generation metrics are logged as in training. This is the
        public seam to inspect a method's trees, credit and loss inputs without running `train()`; during training
        TRL reaches it through `_generate_and_score_completions`.
        """
        return self._generate_micro_batches(inputs, 1)[0]

    def _generate_and_score_completions(self, inputs: list[dict[str, Any]]) -> dict[str, torch.Tensor]:
        return self.generate_batch(inputs)

    def _generate_micro_batches(self, inputs: list[dict[str, Any]], num_chunks: int) -> list[dict[str, torch.Tensor]]:
        """Algorithm 1's generation phase (`trl_tree.core.pipeline.generation_batch`) with this trainer's unit and ports:
        grow and score one unit per prompt, then pack, recompute π_old and compute credit per micro-batch; logged."""
        mode = "train" if self.model.training else "eval"
        with async_rollouts.generation_turn(self):  # evaluation takes turns with a rollout worker
            result = pipeline.generation_batch(self.rollout_unit(mode), self.pipeline_ports(), inputs, num_chunks)
        self._log_generation(mode, result)
        return result.batches

    def sample_trees(self, inputs: list[dict[str, Any]]) -> list[RolloutTree]:
        """Grow and score one tree per dataset row of `inputs`, without packing, credit or logging: the seam for
        training several losses on the very same trees (`benchmarks/bench_blocks.py`). `micro_batches(trees, E)`
        then gives what one generation batch of E optimizer blocks trains."""
        mode = "train" if self.model.training else "eval"
        return pipeline.grow_and_score(self.rollout_unit(mode), self.pipeline_ports(), inputs)[3]

    def micro_batches(self, trees: list[RolloutTree], num_chunks: int) -> list[dict[str, torch.Tensor]]:
        """`trees` split into `num_chunks` micro-batches as training splits a generation batch: packed, with π_old
        recomputed by the current model and the configured method's credit (`generate_batch`'s layout)."""
        mode = "train" if self.model.training else "eval"
        return pipeline.micro_batches(self.rollout_unit(mode), self.pipeline_ports(), trees, num_chunks)[0]

    def rollout_unit(self, mode: str) -> TreeUnits:
        """What this trainer grows and trains per prompt (`trl_tree.core.pipeline.RolloutUnit`): a tree of the configured
        sampler, generated by the current backend (read per batch: tests and users may swap it after init)."""
        return TreeUnits(
            self.sampler, functools.partial(rollout_session, self.generation_engine),
            trl_internals.tokenizer(self).pad_token_id, self.args.packing,
            unwrap_model(self.model).config, self.mask_truncated_completions,
        )

    def pipeline_ports(self) -> pipeline.PipelinePorts:
        """The pipeline's narrow view of this trainer: GRPOTrainer's prompt rendering and environments, TRL's reward
        computation, the training model's no-grad forward for π_old, the method's credit. Built per batch, so an
        instance's overrides (a test's spy on `turn_credit`) are the ones called."""
        return pipeline.PipelinePorts(
            prepare=self._prepare_roots,
            score=self._score_leaves,
            behaviour_logps=lambda packed: pipeline.behaviour_logps(
                self.model, packed, self.accelerator.device, self.temperature
            ),
            credit=self.turn_credit,
            device=self.accelerator.device,
        )

    def _prepare_roots(self, inputs):
        """The pipeline's `prepare` port: per row, its prompt (`prompts.PromptRenderer`), its environment reset
        (`environments.RootEnvironments`; its tools and state are the tree's root) and the rendered prompt ids."""
        if self._tree_view is not None:  # the tree view shows each prompt's question and gold answer from its row
            self._tree_view.note_rows(inputs)
        return self._rollout_roots(inputs)

    def _rollout_roots(self, inputs):
        """`_prepare_roots` without the tree view's note (the rollout worker's port: its batch is logged later)."""
        prompts = self.prompt_renderer.dataset_prompts(inputs)
        envs, handles = self.root_environments.reset(inputs, prompts)
        prompt_ids = self.prompt_renderer.render_prompts(prompts)
        roots = [
            TreeRoot(prompt_ids=list(ids), env=env, tools=self.root_environments.root_tools(env), environment=handle)
            for ids, env, handle in zip(prompt_ids, envs, handles)
        ]
        return prompts, roots

    def _score_leaves(self, inputs, prompts, branches_per_tree) -> pipeline.LeafScores:
        """The pipeline's `score` port (`scoring.LeafScorer`): TRL's reward functions on every leaf, the leaves'
        environments handed to the reward computation with their rows (`trl_internals.calculate_rewards`)."""
        rows = self.scorer.leaf_rows(inputs, prompts, branches_per_tree)
        mode = "train" if self.model.training else "eval"
        return self.scorer.score(rows, branches_per_tree, mode)

    def turn_credit(self, unit) -> TurnCredit:
        """The credit of one unit (a tree, over `tree.turns`; TreeFlex: a group) with everything its loss reads
        (`trl_tree.methods.turn_credit`)."""
        return methods.turn_credit(unit, self.args)

    # ---------------------------------------------------------------- loss

    def loss_inputs(self, model, inputs: dict, compute_entropy: bool = False) -> tuple[LossInputs, torch.Tensor | None]:
        """One packed forward of `model` over a micro-batch, flattened as the losses read it, and the tokens' entropies
        (trained tokens only, each unique token once) with `compute_entropy`. The loss, the tree view's "after"
        probabilities and the block benchmark all read the micro-batch through here."""
        return pipeline.loss_inputs(model, inputs, self.temperature, compute_entropy)

    def _compute_loss(self, model, inputs):
        mode = "train" if self.model.training else "eval"
        batch, entropy = self.loss_inputs(model, inputs, compute_entropy=True)
        loss = self.turn_loss(batch, mode)
        # GRPO's `entropy`: mean entropy of the trained tokens (each unique token once), from the training forward
        logged = trl_internals.metrics(self, mode)
        logged["entropy"].append(self._mean_over_ranks(entropy.detach()))
        if mode == "train":
            loss = loss / getattr(self, "current_gradient_accumulation_steps", self.args.gradient_accumulation_steps)
        return loss

    def turn_loss(self, batch: LossInputs, mode: str) -> torch.Tensor:
        """The configured loss of one micro-batch (`trl_tree.methods.LOSSES`), logging its metrics and every method's
        mean |s_i|, the turns' log-ratio, per optimizer block."""
        loss, loss_metrics = methods.block_loss(batch, self.args)
        block = self._optimizer_block()
        tree_metrics.log_values(trl_internals.metrics(self, mode), self.accelerator, loss_metrics, block)
        return loss

    def _optimizer_block(self) -> int:
        """Which of the E sequential optimizer blocks of the current generation batch is being trained."""
        return (trl_internals.micro_step(self) % self.args.steps_per_generation) // self.args.gradient_accumulation_steps

    # ---------------------------------------------------------------- checkpoints

    @holds_output_dir  # one run per output_dir (`run_lock`)
    def train(self, resume_from_checkpoint: str | bool | None = None, *args, **kwargs):
        """transformers' `train`, resuming only from a complete checkpoint (`resume.checkpoint_to_resume`); a rollout
        worker's session ends with it, on every path (`async_rollouts`)."""
        checkpoint = resume.checkpoint_to_resume(resume_from_checkpoint, self.args.output_dir)
        try:
            return super().train(checkpoint, *args, **kwargs)
        finally:
            if self._async_rollouts is not None:
                self._async_rollouts.close()
            self._turn_loop.close()  # the tool pool's threads stop with training (a later call starts new ones)

    def get_batch_samples(self, epoch_iterator, num_batches, device):
        """transformers' micro-batches of one optimizer step; with a rollout worker, read from the epoch iterator
        wrapped so the worker can read the next generation batches' rows ahead, in the loop's order."""
        if self._async_rollouts is not None:
            epoch_iterator = self._async_rollouts.read_ahead(epoch_iterator)
        return super().get_batch_samples(epoch_iterator, num_batches, device)

    def end(self) -> None:
        """transformers' `end` (finish the trackers, destroy the process group), in order: every process waits for
        the others, drops the DDP wrapper, then the group goes.

        Call it once, last, after saving and pushing. Before, a process that finished early destroyed its gloo group
        while rank 0 was still writing the weights or the results file, and the DDP reducer's gloo work objects were
        left to interpreter exit: 1 two-process run in 20 ended with SIGABRT ("terminate called without an active
        exception") after training had succeeded. transformers before 5.18 has no `Trainer.end`; Accelerate's
        `end_training` is what it calls."""
        turn_loop = getattr(self, "_turn_loop", None)  # None: `__init__` failed before building it
        if turn_loop is not None:
            turn_loop.close()
        self.accelerator.wait_for_everyone()
        self.model_wrapped = self.model  # the DDP / DeepSpeed wrapper and, with it, the reducer's gloo work
        self.accelerator.free_memory()
        gc.collect()
        parent_end = getattr(super(), "end", None)
        if parent_end is not None:
            parent_end()
        else:
            self.accelerator.end_training()

    def _save_rng_state(self, output_dir: str) -> None:
        """transformers' per-process hook at checkpoint time. Besides the global generators, an exact resume needs the
        sampler's generators and the generation batch being trained (`trl_tree.trainer.resume`)."""
        super()._save_rng_state(output_dir)
        resume.save_state(self, output_dir)

    def _load_rng_state(self, checkpoint: str | None) -> None:
        """transformers calls this on every process before the first resumed training step: restore the buffered
        generation batch and the position in it too, so the resumed run trains on it instead of regenerating."""
        super()._load_rng_state(checkpoint)
        if checkpoint is not None:
            resume.restore_state(self, checkpoint)


# -------------------------------------------------------------------- helpers


class _EngineProxy:
    """Looks up `trainer.generation_engine` at call time, so tests and users can swap the backend after init."""

    def __init__(self, trainer):
        self.trainer = trainer

    def generate(self, prefixes, max_new_tokens):
        return self.trainer.generation_engine.generate(prefixes, max_new_tokens)

    @property
    def resumes_turns(self) -> bool:
        return getattr(self.trainer.generation_engine, "resumes_turns", False)
