"""The typed tensors a tree trainer's micro-batch carries besides its packed tokens (docs/design.md §4).

- `TurnCredit`: the credit of one unit (a tree; a TreeFlex group) over its turns, or of a micro-batch of units padded
  to [N, max_turns]. It is what a credit computes and a loss's `prepare` adds to, and it travels through TRL's buffers
  as plain tensors (`to_dict` / `from_dict`, next to `PackedTrees.to_dict`).
- `LossInputs`: one micro-batch flattened for `trl_tree.core.losses`: per-token tensors of the trained tokens with global
  turn ids, and the micro-batch's `TurnCredit` with one entry per unique turn.

`TurnCredit` itself is the credit every loss reads (A, and the turns per unit). A loss that reads more declares a
**credit kind**: a dataclass subclass with its extra fields, next to the `prepare` that fills it
(`trl_tree.methods`: `TeacherCredit`, `PathCredit`, `PathWeightedCredit`, `FlexCredit`), so a kind carries exactly
the fields its loss reads and nothing unset. The machinery here (stack, flatten, the buffers' dict) is written once
over `dataclasses.fields`, so a new kind needs no change in this file. Fields are per turn (a 1-D tensor over the
unit's turns; [N, max_turns] padded when stacked) unless declared with `per_unit()` (a 0-dim tensor per unit; [N]
stacked).

A kind is registered once, by name (`@credit_kind` above its `@dataclass`; `CREDIT_KINDS`), and travels by that name:
`to_dict` writes the kind's id (`kind_id`, a hash of its name) once per unit under `credit_kind`, an [N] integer
tensor that TRL's buffers split, shuffle, move and save like every other row-wise tensor, and `from_dict` looks the
kind up by it (a resume state of an earlier version, without it: the registered kind with exactly its fields). The
kind was once recovered from the field names of every subclass, so merely defining an unused subclass with another
kind's fields broke that kind's batches. Registration refuses a taken name and a second kind with the same fields:
two kinds that carry the same tensors are one kind, and a loss that reads it names that one.
"""

from __future__ import annotations

import dataclasses
import hashlib
from dataclasses import dataclass
from typing import ClassVar

import torch
from torch import Tensor

_PREFIX = "credit_"  # TRL's buffers hold one flat dict per micro-batch; these keys sit next to `PackedTrees`'s
_KIND_KEY = _PREFIX + "kind"  # the kind's id per unit (so no kind may have a field named "kind")
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
        """The fields under `credit_<name>`, and the kind's id (`kind_id`) per unit under `credit_kind`: [N] once
        stacked (a row per unit, as TRL's buffers split every tensor), 0-dim for one unit."""
        kind = type(self)
        if CREDIT_KINDS.get(kind.__name__) is not kind:
            raise ValueError(f"{kind.describe()} is not a registered credit kind, so a micro-batch of it could not be "
                             "read back: decorate the class with `@trl_tree.core.batch.credit_kind` (above @dataclass).")
        units = () if self.count is None else self.count.shape
        out = {_PREFIX + name: value for name, value in self.present().items()}
        out[_KIND_KEY] = torch.full(units, kind_id(kind.__name__), dtype=torch.long, device=self.A.device)
        return out

    @classmethod
    def from_dict(cls, d: dict[str, Tensor]) -> TurnCredit:
        """The credit of a micro-batch from the dict `to_dict` wrote (other keys, e.g. the packed tokens, ignored), as
        the kind its `credit_kind` names; asked of a kind (`TeacherCredit.from_dict`), that kind or one below it.

        A dict without `credit_kind` is a resume state saved by a trl-tree before kinds travelled by name: its kind is
        the registered one with exactly its fields (unique: registration refuses a second kind with the same fields;
        an unregistered class is no kind)."""
        fields = {k[len(_PREFIX):]: v for k, v in d.items() if k.startswith(_PREFIX) and k != _KIND_KEY}
        if _KIND_KEY in d:
            ids = d[_KIND_KEY].unique().tolist()
            kinds = [_KIND_BY_ID.get(int(i)) for i in ids]
            if len(kinds) != 1 or kinds[0] is None:
                raise ValueError(f"The micro-batch's {_KIND_KEY!r} is {ids}, not the id of one registered credit kind "
                                 f"(registered: {_registered()}): a micro-batch holds one kind, registered in this "
                                 "process.")
        else:
            kinds = [k for k in CREDIT_KINDS.values() if _field_names(k) == set(fields) - {"count"}]
            if not kinds:
                raise ValueError(f"The micro-batch has no {_KIND_KEY!r} and no registered credit kind carries exactly "
                                 f"its fields {sorted(set(fields) - {'count'})} (registered: {_registered()}): it "
                                 "was not written by `TurnCredit.to_dict`.")
        kind = kinds[0]
        if not issubclass(kind, cls):
            raise ValueError(f"The micro-batch carries a {kind.describe()}, not a {cls.describe()}: its credit was "
                             "prepared for another loss.")
        if set(fields) - {"count"} != _field_names(kind):
            raise ValueError(f"The micro-batch carries a {kind.describe()} but its fields are {sorted(fields)}: it "
                             "was not written by `to_dict` of that kind.")
        return kind(**fields)


CREDIT_KINDS: dict[str, type[TurnCredit]] = {}  # every registered kind by name, in registration order
_KIND_BY_ID: dict[int, type[TurnCredit]] = {}


def kind_id(name: str) -> int:
    """The id a kind travels under: the first 63 bits of the SHA-256 of its name, the same in every process and
    every version (a registration index would change with the order modules register their kinds in)."""
    return int.from_bytes(hashlib.sha256(name.encode()).digest()[:8], "big") >> 1


def credit_kind(kind: type[TurnCredit]) -> type[TurnCredit]:
    """Class decorator (above `@dataclass`): register `kind`, a dataclass below `TurnCredit`, as a credit kind under
    its class name. Refused: a name taken already, a kind whose fields another kind carries exactly (the two could
    not be told apart by what a loss reads: add a field, or use the registered kind), and a field named "kind"."""
    name = kind.__name__
    if not (isinstance(kind, type) and issubclass(kind, TurnCredit) and "__dataclass_fields__" in vars(kind)):
        raise TypeError(f"@credit_kind registers a dataclass below TurnCredit; {name} is not one (put @credit_kind "
                        "above @dataclass).")
    if name in CREDIT_KINDS:
        raise ValueError(f"A credit kind named {name!r} is registered already ({CREDIT_KINDS[name].describe()}): give "
                         f"the new kind another class name (registered: {', '.join(CREDIT_KINDS)}).")
    fields = _field_names(kind)
    if "kind" in fields:
        raise ValueError(f"{kind.describe()} has a field named 'kind', the key its micro-batches carry the kind's id "
                         "under: rename the field.")
    same = next((k for k in CREDIT_KINDS.values() if _field_names(k) == fields), None)
    if same is not None:
        raise ValueError(f"{kind.describe()} carries exactly the fields of the registered {same.describe()}: a second "
                         f"kind with the same fields is refused (use {same.__name__}, or give the new kind the field "
                         "that makes it another kind).")
    if kind_id(name) in _KIND_BY_ID:  # 2^-63 per pair of names, but a clash would make two kinds one
        raise ValueError(f"{name!r} hashes to the id of {_KIND_BY_ID[kind_id(name)].__name__}: rename the class.")
    CREDIT_KINDS[name] = _KIND_BY_ID[kind_id(name)] = kind
    return kind


def _field_names(kind: type[TurnCredit]) -> frozenset[str]:
    return frozenset(f.name for f in dataclasses.fields(kind)) - {"count"}


def _registered() -> str:
    return ", ".join(f"{k.describe()} = {kind_id(name)}" for name, k in CREDIT_KINDS.items())


credit_kind(TurnCredit)


@dataclass
class LossInputs:
    """One micro-batch flattened for the losses (`trl_tree.core.losses` conventions).

    Attributes:
        logps, old_logps: [n_tokens] log π_θ and log π_old of the trained tokens (π_old: the policy at the start of
            the micro-batch's optimizer blocks, recomputed by the packed forward that trains it).
        behaviour_logps: [n_tokens] log μ, the behaviour policy that sampled the tokens, from the same packed forward
            code; equal to `old_logps` for a fresh unit (docs/design.md §3, "Stale samples").
        staleness: [n_turns] int64, policy versions between μ and π_old for each turn (0: fresh).
        turn_ids: [n_tokens] each token's global unique-turn id (unit x's turns follow those of units 0..x−1).
        token_tree_ids: [n_tokens] each token's unit.
        tree_ids: [n_turns] each turn's unit; num_trees: units in the micro-batch.
        credit: the micro-batch's `TurnCredit`, of the kind its loss reads, flattened (one entry per unique turn).
    """

    logps: Tensor
    old_logps: Tensor
    behaviour_logps: Tensor
    staleness: Tensor
    turn_ids: Tensor
    token_tree_ids: Tensor
    tree_ids: Tensor
    num_trees: int
    credit: TurnCredit

    @property
    def num_turns(self) -> int:
        return int(self.credit.A.numel())

    @classmethod
    def build(cls, turn_ids: Tensor, logps: Tensor, old_logps: Tensor, credit: TurnCredit,
              behaviour_logps: Tensor | None = None, staleness: Tensor | None = None) -> LossInputs:
        """From a packed micro-batch: `turn_ids` [N, R, T] per unit (−1: not trained), the forward's `logps`, π_old's
        `old_logps` and μ's `behaviour_logps` in the same layout, the stacked `credit` and `staleness` [N] per unit.
        Without `behaviour_logps` and `staleness` the micro-batch is fresh: μ = π_old, staleness 0."""
        counts = credit.count
        offsets = torch.cumsum(counts, 0) - counts
        mask = turn_ids >= 0
        n_units = counts.numel()
        unit_of_token = torch.arange(n_units, device=logps.device).view(-1, 1, 1).expand_as(turn_ids)
        flat = credit.flatten()
        unit_ids = flat.unit_ids()
        if staleness is None:
            staleness = torch.zeros(n_units, dtype=torch.long)
        if staleness.shape != (n_units,):
            raise ValueError(f"staleness must hold one version count per unit, shape ({n_units},); got "
                             f"{tuple(staleness.shape)}.")
        return cls(
            logps=logps[mask],
            old_logps=old_logps[mask],
            behaviour_logps=(old_logps if behaviour_logps is None else behaviour_logps)[mask],
            staleness=staleness.to(unit_ids.device, torch.long)[unit_ids],
            turn_ids=(turn_ids + offsets.view(-1, 1, 1).to(turn_ids.device))[mask],
            token_tree_ids=unit_of_token[mask],
            tree_ids=unit_ids,
            num_trees=n_units,
            credit=flat,
        )
