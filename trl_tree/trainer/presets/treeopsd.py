"""`TreeOPSDTrainer`: tree rollouts, likelihood-weighted credit and the turn-level Bernoulli forward-KL (paper Alg. 1).

Per generation batch: one (M, N) tree per prompt, leaf rewards standardised (T1), backed up with behaviour-likelihood
weights (T3), mapped to frozen teachers q = 1/2 + V/τ (T4). Each of the E optimizer blocks then minimises
(τ/L_x) Σ_i L_i KL(Ber(q_i) ‖ Ber(σ(s_i))) over its trees (T5), so later blocks pursue a finite target instead of
repeating the first block's gradient. A preset of `TreeTrainer` (sampler="init_expand", credit="likelihood",
loss="treeopsd").
"""

from __future__ import annotations

from ... import methods
from ..base import TreeTrainer


@methods.preset("treeopsd")  # name, tags, paper and config class from the method table
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
