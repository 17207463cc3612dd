"""`TreePOTrainer`: TreeOPSD's trees and credit with the fixed-credit surrogate (T7), the paper's closest control.

Its first optimizer block equals TreeOPSD's (both are the tree policy gradient at θ_old); later blocks keep applying
the collection-time coefficient V_i/L_x however far the policy has already moved.
"""

from __future__ import annotations

import torch

from .. import losses
from .config import TreePOConfig
from .treeopsd import TreeOPSDTrainer


class TreePOTrainer(TreeOPSDTrainer):
    """Drop-in `GRPOTrainer` replacement training with TreePO's fixed tree credit."""

    _name = "TreePO"
    _tag_names = ["trl", "trl-tree", "treepo"]
    config_class = TreePOConfig

    def turn_loss(self, flat, mode):
        loss = losses.treepo_loss(
            flat["logps"], flat["old_logps"], flat["turn_ids"], flat["V"], flat["tree_ids"],
            num_trees=flat["num_trees"],
        )
        with torch.no_grad():
            s = losses.turn_mean_log_ratio(flat["logps"], flat["old_logps"], flat["turn_ids"], flat["V"].numel())
        self._metrics[mode][f"treepo/abs_log_ratio/block_{self._optimizer_block()}"].append(
            self._mean_over_ranks(s.abs().tolist())
        )
        return loss
