"""`TreeOPSDTrainer`: tree rollouts, likelihood-weighted credit and the turn-level Bernoulli forward-KL (paper Alg. 1).

Per generation batch: one (M, N) tree per prompt, leaf rewards standardised (T1), backed up with behaviour-likelihood
weights (T3), mapped to frozen teachers q = 1/2 + V/τ (T4). Each of the E optimizer blocks then minimises
(τ/L_x) Σ_i L_i KL(Ber(q_i) ‖ Ber(σ(s_i))) over its trees (T5), so later blocks pursue a finite target instead of
repeating the first block's gradient.
"""

from __future__ import annotations

import torch

from .. import credit, losses
from ..rollout.samplers import InitExpandSampler
from .base import TreeTrainer
from .config import TreeOPSDConfig


class TreeOPSDTrainer(TreeTrainer):
    """Drop-in `GRPOTrainer` replacement training with TreeOPSD.

    Example:
        ```python
        from trl_tree import TreeOPSDConfig, TreeOPSDTrainer

        trainer = TreeOPSDTrainer(
            model="Qwen/Qwen3-4B-Thinking-2507",
            reward_funcs=f1_reward,
            args=TreeOPSDConfig(num_initial_rollouts=4, num_branches=2, target_radius=0.25, max_turns=5),
            train_dataset=dataset,
            tools=[search],
        )
        trainer.train()
        ```
    """

    _name = "TreeOPSD"
    _tag_names = ["trl", "trl-tree", "treeopsd"]
    _paper = {
        "title": "TreeOPSD: Building finite posterior distillation targets from shared-prefix trees",
        "id": "2610.23181",
        "citation": (
            "@article{zou2026treeopsd,\n"
            "    title   = {{TreeOPSD: Building Finite Posterior Distillation Targets from Shared-Prefix Trees}},\n"
            "    author  = {Heming Zou and others},\n"
            "    year    = 2026,\n"
            "    eprint  = {arXiv:2610.23181},\n"
            "}"
        ),
    }
    config_class = TreeOPSDConfig

    def __init__(self, model, reward_funcs=None, args: TreeOPSDConfig | None = None, **kwargs):
        if args is None:
            name = model if isinstance(model, str) else model.config._name_or_path
            args = self.config_class(f"{str(name).split('/')[-1]}-{self._name}")
        if not isinstance(args, self.config_class):
            raise TypeError(
                f"{type(self).__name__} needs a {self.config_class.__name__} (got {type(args).__name__}): the tree "
                "fields (num_initial_rollouts, num_branches, target_radius, max_turns, packing) live there."
            )
        super().__init__(model, reward_funcs, args=args, **kwargs)

    def build_sampler(self, loop):
        seed = self.args.seed + 1000 * self.accelerator.process_index
        return InitExpandSampler(loop, self.args.num_initial_rollouts, self.args.num_branches, seed=seed)

    def turn_credit(self, tree):
        A = credit.standardize(torch.tensor(tree.rewards, dtype=torch.float64))
        V = credit.likelihood_backup(tree, A)
        q, tau = credit.treeopsd_teacher(V, tree.num_leaves, self.args.target_radius)
        return {"q": q.float(), "V": V.float(), "tau": torch.tensor(tau, dtype=torch.float32)}

    def turn_loss(self, flat, mode):
        loss = losses.treeopsd_loss(
            flat["logps"], flat["old_logps"], flat["turn_ids"], flat["q"], flat["tau"], flat["tree_ids"],
            num_trees=flat["num_trees"],
        )
        with torch.no_grad():
            s = losses.turn_mean_log_ratio(flat["logps"], flat["old_logps"], flat["turn_ids"], flat["q"].numel())
            gap = (torch.sigmoid(s) - flat["q"]).abs().tolist()
        self._metrics[mode][f"treeopsd/abs_p_minus_q/block_{self._optimizer_block()}"].append(
            self._mean_over_ranks(gap)
        )
        return loss

    def log_turn_credit(self, metrics, per_turn):
        gaps = [g for d in per_turn for g in (d["q"] - 0.5).abs().tolist()]
        metrics["treeopsd/abs_q_minus_half"].append(self._mean_over_ranks(gaps))
