"""The typed tensors a tree trainer's micro-batch carries besides its packed tokens (docs/design.md §4).

- `TurnCredit`: the credit of one unit (a tree; a TreeFlex group) over its turns, or of a micro-batch of units padded
  to [N, max_turns]. It is what a credit computes and a loss's `prepare` adds to, and it travels through TRL's buffers
  as plain tensors (`to_dict` / `from_dict`, next to `PackedTrees.to_dict`).
- `LossInputs`: one micro-batch flattened for `trl_tree.losses`: per-token tensors of the trained tokens with global
  turn ids, and the micro-batch's `TurnCredit` with one entry per unique turn.

`TurnCredit` itself is the credit every loss reads (A, and the turns per unit). A loss that reads more declares a
**credit kind**: a dataclass subclass with its extra fields, next to the `prepare` that fills it
(`trl_tree.methods`: `TeacherCredit`, `PathCredit`, `PathWeightedCredit`, `FlexCredit`), so a kind carries exactly
the fields its loss reads and nothing unset. The machinery here (stack, flatten, the buffers' dict) is written once
over `dataclasses.fields`, so a new kind needs no change in this file. Fields are per turn (a 1-D tensor over the
unit's turns; [N, max_turns] padded when stacked) unless declared with `per_unit()` (a 0-dim tensor per unit; [N]
stacked). `from_dict` finds the kind by its field names: every kind has a distinct set of them.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import ClassVar

import torch
from torch import Tensor

_PREFIX = "credit_"  # TRL's buffers hold one flat dict per micro-batch; these keys sit next to `PackedTrees`'s
_PER_UNIT = "per_unit"  # the field metadata key `per_unit()` sets


def per_unit(**kwargs):
    """A credit field with one value per unit (a 0-dim tensor; [N] stacked) instead of one per turn: declared on the
    field itself, so the kind that owns the field says how it stacks."""
    return dataclasses.field(metadata={_PER_UNIT: True}, **kwargs)


@dataclass
class TurnCredit:
    """Per-turn credit of one unit, or of a micro-batch of units stacked by `stack`: the kind every loss can read
    (TreePO's), and the base of the kinds that carry more (docs/design.md §4).

    Attributes:
        A: the turn's advantage / value V_i (every method).
        count: turns per unit (set by `stack`; the padded width is the largest). Keyword-only, so a kind's own
            fields follow A positionally.
    """

    A: Tensor
    count: Tensor | None = per_unit(default=None, kw_only=True)
    # the sequences a clipped loss counts its clip ratio per ("root-to-leaf paths"), empty when the kind numbers
    # none: `methods.register_loss` refuses a clipped loss whose kind has none
    clip_sequences: ClassVar[str] = ""

    @classmethod
    def per_unit_fields(cls) -> frozenset[str]:
        """The fields declared with `per_unit()` (`count` included)."""
        return frozenset(f.name for f in dataclasses.fields(cls) if f.metadata.get(_PER_UNIT))

    @classmethod
    def describe(cls) -> str:
        """The kind as the errors name it: its class and the fields it carries besides `count`."""
        return f"{cls.__name__}({', '.join(f.name for f in dataclasses.fields(cls) if f.name != 'count')})"

    @classmethod
    def require(cls, credit: TurnCredit, reader: str) -> None:
        """Refuse a credit of another kind, naming both: `reader` (e.g. "the 'atpo' loss") reads this kind's fields,
        which a credit prepared for another loss does not carry."""
        if not isinstance(credit, cls):
            raise TypeError(
                f"{reader} reads a {cls.describe()} but was given a {type(credit).describe()}: the micro-batch's "
                "credit was prepared for another loss (`trl_tree.methods.turn_credit` with this configuration "
                "prepares the right one)."
            )

    def present(self) -> dict[str, Tensor]:
        """The fields that are set, by name (every field of the kind; `count` once stacked)."""
        return {f.name: getattr(self, f.name) for f in dataclasses.fields(self) if getattr(self, f.name) is not None}

    @property
    def num_turns(self) -> int:
        """Turns of one (unstacked) unit."""
        return int(self.A.numel())

    def with_floats(self) -> TurnCredit:
        """Float fields as float32 (what the buffers hold); index fields stay integer."""
        return type(self)(**{k: v.float() if v.is_floating_point() else v for k, v in self.present().items()})

    @classmethod
    def stack(cls, units: list[TurnCredit], device=None) -> TurnCredit:
        """A micro-batch of units of one kind: per-turn fields padded with 0 to [N, max_turns], per-unit fields
        stacked to [N], and `count` the turns of each unit. Units of different kinds are refused: one loss reads the
        micro-batch, and the padded layout needs every unit to carry the same fields."""
        kind = type(units[0])
        if not issubclass(kind, cls) or any(type(u) is not kind for u in units):
            kinds = sorted({type(u).describe() for u in units})
            raise ValueError(f"Every unit of a micro-batch must carry the same credit kind; got {', '.join(kinds)}.")
        width = max(u.num_turns for u in units)
        out = {"count": torch.tensor([u.num_turns for u in units], device=device)}
        per_unit_names = kind.per_unit_fields()
        for name in units[0].present():
            values = [getattr(u, name) for u in units]
            if name in per_unit_names:
                out[name] = torch.stack(values).to(device)
                continue
            padded = torch.zeros(len(values), width, dtype=values[0].dtype)
            for n, v in enumerate(values):
                padded[n, : v.numel()] = v
            out[name] = padded.to(device)
        return kind(**out)

    def flatten(self) -> TurnCredit:
        """A stacked micro-batch as one entry per unique turn (units in order, each unit's turns in order), the
        global turn numbering of `LossInputs.turn_ids`; per-unit fields stay [N]."""
        counts = self.count
        turn_mask = torch.arange(int(counts.max()), device=counts.device).unsqueeze(0) < counts.unsqueeze(1)
        per_unit_names = self.per_unit_fields()
        out = {}
        for name, value in self.present().items():
            out[name] = value if name in per_unit_names else value[:, : turn_mask.shape[1]][turn_mask.to(value.device)]
        return type(self)(**out)

    def unit_ids(self) -> Tensor:
        """For a flattened micro-batch: the unit (tree, group) of every turn."""
        counts = self.count.long()
        return torch.repeat_interleave(torch.arange(counts.numel(), device=counts.device), counts)

    def to_dict(self) -> dict[str, Tensor]:
        return {_PREFIX + name: value for name, value in self.present().items()}

    @classmethod
    def from_dict(cls, d: dict[str, Tensor]) -> TurnCredit:
        """The credit of a micro-batch from the dict `to_dict` wrote (other keys, e.g. the packed tokens, ignored), as
        the kind that carries exactly its fields (`kind_of`)."""
        fields = {k[len(_PREFIX):]: v for k, v in d.items() if k.startswith(_PREFIX)}
        return cls.kind_of(fields)(**fields)

    @classmethod
    def kind_of(cls, names) -> type[TurnCredit]:
        """The credit kind, this class or one below it, whose fields are exactly `names` (`count` optional). The
        buffers hold plain tensors only, so the field names are what says the kind; two kinds with the same names
        could not be told apart, and are refused here rather than one silently taken for the other."""
        wanted = set(names) - {"count"}
        found = [k for k in _kinds(cls) if {f.name for f in dataclasses.fields(k)} - {"count"} == wanted]
        if len(found) != 1:
            known = ", ".join(k.describe() for k in _kinds(cls))
            problem = "no credit kind" if not found else f"{len(found)} credit kinds"
            raise ValueError(f"{problem} carries exactly the fields {sorted(wanted)}; the kinds: {known}.")
        return found[0]


def _kinds(root: type[TurnCredit]) -> list[type[TurnCredit]]:
    """`root` and every dataclass below it (a subclass that is not itself a dataclass adds no fields, so it is no
    kind of its own). The kinds are declared where their losses are (`trl_tree.methods`), which `import trl_tree`
    loads, so no list of them is kept here."""
    out, stack = [], [root]
    while stack:
        kind = stack.pop()
        if kind in out:  # reached again through another base
            continue
        if "__dataclass_fields__" in vars(kind):
            out.append(kind)
        stack.extend(kind.__subclasses__())
    return out


@dataclass
class LossInputs:
    """One micro-batch flattened for the losses (`trl_tree.losses` conventions).

    Attributes:
        logps, old_logps: [n_tokens] log π_θ and log π_old of the trained tokens.
        turn_ids: [n_tokens] each token's global unique-turn id (unit x's turns follow those of units 0..x−1).
        token_tree_ids: [n_tokens] each token's unit.
        tree_ids: [n_turns] each turn's unit; num_trees: units in the micro-batch.
        credit: the micro-batch's `TurnCredit`, of the kind its loss reads, flattened (one entry per unique turn).
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
