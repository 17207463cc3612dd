"""`AT2POTrainer`: entropy-guided tree expansion, turn-wise credit and the ATPO loss (AT2PO; docs/design.md §3 A1–A5).

M initial trajectories; L rounds each re-sample the K turns with the highest node score
S_i = H_i − α·max(0, siblings − 1) from their own pre-turn history; leaves are standardised with the population std
(A3) and backed up by a softmax over child entropies (A4, default); each turn's tokens share one geometric-mean
ratio and one clip (A5), aggregated like GRPO over root-to-leaf paths. A preset of `TreeTrainer`
(sampler="entropy_guided", credit="child_softmax", loss="atpo"); the paper's ablations are `AT2POConfig` switches.
"""

from __future__ import annotations

from ... import methods
from ..base import TreeTrainer


@methods.preset("at2po")  # name, tags and config class from the method table
class AT2POTrainer(TreeTrainer):
    """Drop-in `GRPOTrainer` replacement training with AT2PO."""

