"""The typed tensors a tree trainer's micro-batch carries besides its packed tokens (docs/design.md §4).

- `TurnCredit`: the credit of one unit (a tree; a TreeFlex group) over its turns, or of a micro-batch of units padded
  to [N, max_turns]. It is what a credit computes and a loss's `prepare` adds to, and it travels through TRL's buffers
  as plain tensors (`to_dict` / `from_dict`, next to `PackedTrees.to_dict`).
- `LossInputs`: one micro-batch flattened for `trl_tree.losses`: per-token tensors of the trained tokens with global
  turn ids, and the micro-batch's `TurnCredit` with one entry per unique turn.

Fields are per turn (a 1-D tensor over the unit's turns; [N, max_turns] padded when stacked) unless listed in
`TurnCredit.PER_UNIT` (a 0-dim tensor per unit; [N] stacked). A field a loss does not use is None.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch
from torch import Tensor

_PREFIX = "credit_"  # TRL's buffers hold one flat dict per micro-batch; these keys sit next to `PackedTrees`'s


@dataclass
class TurnCredit:
    """Per-turn credit of one unit, or of a micro-batch of units stacked by `stack`.

    Attributes:
        A: the turn's advantage / value V_i (every method).
        q, tau: TreeOPSD's teacher q_i = 1/2 + V_i/τ and its temperature τ per tree (T4).
        w: per-token weight of each turn in its unit's loss (GRPO's path weights, TreeFlex's F4 weights).
        path_lo, path_hi, num_paths: the root-to-leaf paths through each turn as a DFS range [lo, hi) of the tree's
            `num_paths` paths (GSPO-token, and the clip metrics of every clipped tree loss).
        penalty, search, block, role: TreeFlex's process penalty Q_i and the turn's search, block and role (F1–F4).
        count: turns per unit (set by `stack`; the padded width is the largest).
    """

    A: Tensor
    q: Tensor | None = None
    tau: Tensor | None = None
    w: Tensor | None = None
    path_lo: Tensor | None = None
    path_hi: Tensor | None = None
    num_paths: Tensor | None = None
    penalty: Tensor | None = None
    search: Tensor | None = None
    block: Tensor | None = None
    role: Tensor | None = None
    count: Tensor | None = None

    PER_UNIT = ("tau", "num_paths", "count")

    def present(self) -> dict[str, Tensor]:
        """The fields that are set, by name."""
        return {f.name: getattr(self, f.name) for f in dataclasses.fields(self) if getattr(self, f.name) is not None}

    @property
    def num_turns(self) -> int:
        """Turns of one (unstacked) unit."""
        return int(self.A.numel())

    def with_floats(self) -> TurnCredit:
        """Float fields as float32 (what the buffers hold); index fields stay integer."""
        return TurnCredit(**{k: v.float() if v.is_floating_point() else v for k, v in self.present().items()})

    @classmethod
    def stack(cls, units: list[TurnCredit], device=None) -> TurnCredit:
        """A micro-batch: per-turn fields padded with 0 to [N, max_turns], per-unit fields stacked to [N], and
        `count` the turns of each unit."""
        names = units[0].present().keys()
        if any(u.present().keys() != names for u in units):
            raise ValueError("Every unit of a micro-batch must carry the same credit fields.")
        width = max(u.num_turns for u in units)
        out = {"count": torch.tensor([u.num_turns for u in units], device=device)}
        for name in names:
            values = [getattr(u, name) for u in units]
            if name in cls.PER_UNIT:
                out[name] = torch.stack(values).to(device)
                continue
            padded = torch.zeros(len(values), width, dtype=values[0].dtype)
            for n, v in enumerate(values):
                padded[n, : v.numel()] = v
            out[name] = padded.to(device)
        return cls(**out)

    def flatten(self) -> TurnCredit:
        """A stacked micro-batch as one entry per unique turn (units in order, each unit's turns in order), the
        global turn numbering of `LossInputs.turn_ids`; per-unit fields stay [N]."""
        counts = self.count
        turn_mask = torch.arange(int(counts.max()), device=counts.device).unsqueeze(0) < counts.unsqueeze(1)
        out = {}
        for name, value in self.present().items():
            out[name] = value if name in self.PER_UNIT else value[:, : turn_mask.shape[1]][turn_mask.to(value.device)]
        return TurnCredit(**out)

    def unit_ids(self) -> Tensor:
        """For a flattened micro-batch: the unit (tree, group) of every turn."""
        counts = self.count.long()
        return torch.repeat_interleave(torch.arange(counts.numel(), device=counts.device), counts)

    def to_dict(self) -> dict[str, Tensor]:
        return {_PREFIX + name: value for name, value in self.present().items()}

    @classmethod
    def from_dict(cls, d: dict[str, Tensor]) -> TurnCredit:
        """The credit of a micro-batch from the dict `to_dict` wrote (other keys, e.g. the packed tokens, ignored)."""
        return cls(**{k[len(_PREFIX):]: v for k, v in d.items() if k.startswith(_PREFIX)})


@dataclass
class LossInputs:
    """One micro-batch flattened for the losses (`trl_tree.losses` conventions).

    Attributes:
        logps, old_logps: [n_tokens] log π_θ and log π_old of the trained tokens.
        turn_ids: [n_tokens] each token's global unique-turn id (unit x's turns follow those of units 0..x−1).
        token_tree_ids: [n_tokens] each token's unit.
        tree_ids: [n_turns] each turn's unit; num_trees: units in the micro-batch.
        credit: the micro-batch's `TurnCredit`, flattened (one entry per unique turn).
    """

    logps: Tensor
    old_logps: Tensor
    turn_ids: Tensor
    token_tree_ids: Tensor
    tree_ids: Tensor
    num_trees: int
    credit: TurnCredit

    @property
    def num_turns(self) -> int:
        return int(self.credit.A.numel())

    @classmethod
    def build(cls, turn_ids: Tensor, logps: Tensor, old_logps: Tensor, credit: TurnCredit) -> LossInputs:
        """From a packed micro-batch: `turn_ids` [N, R, T] per unit (−1: not trained), the forward's `logps` and
        π_old's `old_logps` in the same layout, and the stacked `credit`."""
        counts = credit.count
        offsets = torch.cumsum(counts, 0) - counts
        mask = turn_ids >= 0
        n_units = counts.numel()
        unit_of_token = torch.arange(n_units, device=logps.device).view(-1, 1, 1).expand_as(turn_ids)
        flat = credit.flatten()
        return cls(
            logps=logps[mask],
            old_logps=old_logps[mask],
            turn_ids=(turn_ids + offsets.view(-1, 1, 1).to(turn_ids.device))[mask],
            token_tree_ids=unit_of_token[mask],
            tree_ids=flat.unit_ids(),
            num_trees=n_units,
            credit=flat,
        )
