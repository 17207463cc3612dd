"""`TreeAdvTrainer`: token-level branching at high-entropy tokens, segment advantages, GRPO or GSPO-token (TreeAdv;
docs/design.md §3 D1–D4).

Per prompt, a forest of M trees (`num_initial_rollouts`): each is one complete trajectory that then branches *inside*
its completions at the tokens whose entropy exceeds τ_H (`entropy_threshold`), at most `max_branches_per_tree`
times, every split piece at least `min_segment_length` tokens (`trl_tree.rollout.growing.token_branching`). A branch point
splits the turn into segment nodes, so shared prefixes are stored and trained once.

    A_k      = (R_k − mean R) / std_sample(R)   over every leaf of the prompt's forest            D1
    A^tok(n) = mean of A_k over the leaf occurrences below segment n  (`credit.segment_advantages`)  D2
    token t of segment n takes A^tok(n)                                                          D3
    loss     = GRPO's clipped token surrogate, seq-mean-token-mean over the K root-to-leaf sequences
               (`losses.clipped_token_loss` with `credit.path_token_weights`), or GSPO-token
               (`losses.gspo_token_loss`, loss="gspo_token")                                        D4

With no branching (τ_H above every entropy) the forest is M flat trajectories and TreeAdv is GRPO with G = M, the
same loss and gradient as `TreeConfig(sampler="flat", credit="path", loss="grpo")`, as long as no two trajectories
share a turn. It works for single-turn prompts (math with a verifiable reward, no tools) as for multi-turn tool use.
A preset of `TreeTrainer` (sampler="token_entropy", credit="leaf_mean", loss="grpo").
"""

from __future__ import annotations

from ... import methods
from ..base import TreeTrainer


@methods.preset("treeadv")  # name, tags and config class from the method table
class TreeAdvTrainer(TreeTrainer):
    """Drop-in `GRPOTrainer` replacement training with TreeAdv.

    Example:
        ```python
        from trl_tree import TreeAdvConfig, TreeAdvTrainer

        trainer = TreeAdvTrainer(
            model="Qwen/Qwen3-4B-Instruct-2507",
            reward_funcs=accuracy_reward,  # a verifiable math reward; add tools=[...] for tool use
            args=TreeAdvConfig(num_initial_rollouts=4, max_branches_per_tree=2, entropy_threshold=1.0),
            train_dataset=dataset,
        )
        trainer.train()
        ```
    """
