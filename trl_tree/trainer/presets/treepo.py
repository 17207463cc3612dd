"""`TreePOTrainer`: TreeOPSD's trees and credit with the fixed-credit surrogate (T7), the paper's closest control.

Its first optimizer block equals TreeOPSD's (both are the tree policy gradient at θ_old); later blocks keep applying
the collection-time coefficient V_i/L_x however far the policy has already moved. A preset of `TreeTrainer`
(sampler="init_expand", credit="likelihood", loss="treepo").
"""

from __future__ import annotations

from ... import methods
from ..base import TreeTrainer


@methods.preset("treepo")  # name, tags, paper (TreeOPSD's, whose control it is) and config class from the table
class TreePOTrainer(TreeTrainer):
    """Drop-in `GRPOTrainer` replacement training with TreePO's fixed tree credit."""
