"""`TreeOPSDTrainer`: tree rollouts, likelihood-weighted credit and the turn-level Bernoulli forward-KL (paper Alg. 1).

Per generation batch: one (M, N) tree per prompt, leaf rewards standardised (T1), backed up with behaviour-likelihood
weights (T3), mapped to frozen teachers q = 1/2 + V/τ (T4). Each of the E optimizer blocks then minimises
(τ/L_x) Σ_i L_i KL(Ber(q_i) ‖ Ber(σ(s_i))) over its trees (T5), so later blocks pursue a finite target instead of
repeating the first block's gradient. A preset of `TreeTrainer` (sampler="init_expand", credit="likelihood",
loss="treeopsd").
"""

from __future__ import annotations

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
