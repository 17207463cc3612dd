"""The registries as wholes: what holds for every registered credit kind, credit and loss, checked by iterating the
tables (`trl_tree.core.batch.CREDIT_KINDS`, `trl_tree.methods.CREDITS`, `.LOSSES`), so that a newly registered one is
checked by the suite without anyone adding it to a list here."""

import dataclasses
import gc
import random

import pytest
import torch
from torch import Tensor

from tests import golden_float64
from tests.scripted import config
from tests.trees import hotpot_like_tree
from trl_tree import methods
from trl_tree.core.batch import CREDIT_KINDS, TurnCredit, credit_kind, per_unit
from trl_tree.core.flex_unit import FlexUnits
from trl_tree.core.tree_unit import TreeUnits
from trl_tree.trainer.configuration.fields import TreeConfig

# ---------------------------------------------------------------------------------------------------------------
# Credit kinds: registered once, by name; a micro-batch carries its kind's name through TRL's buffers
# ---------------------------------------------------------------------------------------------------------------


@pytest.fixture
def kinds_table():
    """`CREDIT_KINDS` as before the test, and the classes it defined gone (`__subclasses__` holds them until then)."""
    from trl_tree import batch

    before, by_id = dict(CREDIT_KINDS), dict(batch._KIND_BY_ID)
    yield CREDIT_KINDS
    CREDIT_KINDS.clear()
    CREDIT_KINDS.update(before)
    batch._KIND_BY_ID.clear()
    batch._KIND_BY_ID.update(by_id)
    gc.collect()


def _gspo_token_batch(tmp_path) -> dict[str, Tensor]:
    args = config(TreeConfig, tmp_path, loss="gspo_token", credit="leaf_mean", epsilon=3e-4, epsilon_high=4e-4)
    unit = methods.turn_credit(hotpot_like_tree(), args)
    return TurnCredit.stack([unit, unit]).to_dict()


def test_an_unregistered_kind_with_path_credits_fields_leaves_gspo_token_batches_as_they_were(tmp_path, kinds_table):
    """Defining a class is not registering a kind: once, merely defining an unused subclass with `PathCredit`'s fields
    made every gspo_token micro-batch fail to load (its kind was recovered from the field names)."""

    @dataclasses.dataclass
    class Shadow(TurnCredit):
        path_lo: Tensor
        path_hi: Tensor
        num_paths: Tensor = per_unit()

    back = TurnCredit.from_dict(_gspo_token_batch(tmp_path))
    assert type(back) is methods.PathCredit
    assert Shadow not in CREDIT_KINDS.values()


def test_a_second_kind_with_the_same_fields_or_name_is_refused_at_registration(tmp_path, kinds_table):
    """Registration, not the first micro-batch, refuses a kind that could not be told from a registered one: the same
    fields (whatever the class name), or the same name (whatever the fields). The table keeps the first."""
    before = dict(kinds_table)
    with pytest.raises(
        ValueError,
        match=r"Shadow\(A, path_lo, path_hi, num_paths\) carries exactly the fields of the "
        r"registered PathCredit\(A, path_lo, path_hi, num_paths\)",
    ):

        @credit_kind
        @dataclasses.dataclass
        class Shadow(TurnCredit):
            path_lo: Tensor
            path_hi: Tensor
            num_paths: Tensor = per_unit()

    with pytest.raises(ValueError, match="A credit kind named 'PathCredit' is registered already"):

        @credit_kind
        @dataclasses.dataclass
        class PathCredit(TurnCredit):  # another module's class of the same name, other fields
            path_weight: Tensor

    with pytest.raises(ValueError, match="has a field named 'kind'"):

        @credit_kind
        @dataclasses.dataclass
        class Labelled(TurnCredit):
            kind: Tensor

    with pytest.raises(TypeError, match="put @credit_kind above @dataclass"):

        @dataclasses.dataclass
        @credit_kind
        class Reversed(TurnCredit):
            extra: Tensor

    assert kinds_table == before
    assert type(TurnCredit.from_dict(_gspo_token_batch(tmp_path))) is methods.PathCredit


def test_a_new_kind_registered_travels_by_its_name_and_an_unregistered_one_is_refused(tmp_path, kinds_table):
    """A kind with its own field round-trips as itself; a loss declaring an unregistered kind is refused when it is
    registered, and an unregistered kind's micro-batch when it is written (it could not be read back)."""

    @credit_kind
    @dataclasses.dataclass
    class Discounted(TurnCredit):
        gamma: Tensor = per_unit()

    unit = Discounted(A=torch.tensor([1.0, -1.0]), gamma=torch.tensor(0.9))
    assert type(TurnCredit.from_dict(TurnCredit.stack([unit]).to_dict())) is Discounted

    @dataclasses.dataclass
    class Loose(TurnCredit):
        extra: Tensor

    with pytest.raises(ValueError, match="Loss 'loose' reads the credit kind .*Loose.*, which is not registered"):
        methods.register_loss("loose", prepare=lambda *a: None, credit_kind=Loose)(lambda batch, args: None)
    assert "loose" not in methods.LOSSES
    with pytest.raises(ValueError, match=r"Loose\(A, extra\) is not a registered credit kind"):
        TurnCredit.stack([Loose(A=torch.zeros(1), extra=torch.zeros(1))]).to_dict()


def test_the_kind_survives_trls_split_and_shuffle_and_a_checkpoint(tmp_path):
    """The kind's id is one entry per unit, so TRL's row-wise splits and shuffles (which slice every tensor along its
    first dimension) and the resume file (`torch.load(weights_only=True)`) keep it with each unit."""
    from trl.trainer.utils import shuffle_sequence_dict, split_tensor_dict

    stored = _gspo_token_batch(tmp_path)
    for part in split_tensor_dict(shuffle_sequence_dict(stored), 2):
        assert type(TurnCredit.from_dict(part)) is methods.PathCredit
        assert part["credit_kind"].shape == (1,)
    torch.save(stored, tmp_path / "batch.pt")
    back = TurnCredit.from_dict(torch.load(tmp_path / "batch.pt", weights_only=True))
    assert type(back) is methods.PathCredit and torch.equal(back.path_lo, stored["credit_path_lo"])


def test_a_resume_state_without_the_kind_reads_as_the_registered_kind_of_its_fields(tmp_path, kinds_table):
    """A buffered batch saved by a trl-tree before kinds travelled by name has no `credit_kind`: it reads as the one
    registered kind with its fields, whatever unregistered class has them too."""

    @dataclasses.dataclass
    class Shadow(TurnCredit):
        path_lo: Tensor
        path_hi: Tensor
        num_paths: Tensor = per_unit()

    old = {k: v for k, v in _gspo_token_batch(tmp_path).items() if k != "credit_kind"}
    assert type(TurnCredit.from_dict(old)) is methods.PathCredit


# ---------------------------------------------------------------------------------------------------------------
# Every registered credit: zero for equal rewards, GRPO's value where turns share no leaf, rising with its leaf
# ---------------------------------------------------------------------------------------------------------------


def _args(credit: str, tmp_path):
    """A config choosing `credit`, with a loss of its unit kind."""
    unit = methods.CREDITS[credit].unit
    loss = next(name for name, entry in methods.LOSSES.items() if entry.unit == unit)
    return golden_float64.golden_args(credit, loss, str(tmp_path))


def _unit(kind: str, rewards: list[float], flat: bool = False, seed: int = 0):
    """A unit of `kind` with one leaf per reward, the same tokens for the same seed whatever the rewards. Flat: every
    turn on one leaf (a tree of disjoint trajectories, GRPO's group; TreeFlex's searches, no penalties). Else a tree
    branching at the prompt and at depths 1 and 2 (every leaf keeps a turn of its own), or searches with penalties."""
    rng = random.Random(seed)
    if kind == "group":
        return golden_float64.build_group(rng, rewards, penalties=not flat)
    labels = "abcdefghijklmnopqrstuvwxyz"
    if flat:
        trajectories = [labels[2 * k : 2 * k + 2] for k in range(len(rewards))]
    else:
        trajectories = ["abc", "abd", "ae", "fg", "fh", "i"][: len(rewards)]
    return golden_float64.build_tree(rng, trajectories, rewards)


def _leaves_through(unit) -> list[set[int]]:
    """Per turn, the leaves (a tree's paths, a group's searches) that pass through it."""
    if hasattr(unit, "paths"):
        through = [set() for _ in range(unit.num_turns)]
        for k, path in enumerate(unit.paths):
            for i in path:
                through[i].add(k)
        return through
    return [{int(s)} for s in unit.turn_search]


REWARDS = [1.0, 0.0, 0.5, 0.25, 0.75, 0.0]


@pytest.mark.parametrize("credit", list(methods.CREDITS))
def test_equal_rewards_give_every_turn_zero_credit(tmp_path, credit):
    entry = methods.CREDITS[credit]
    for flat in (True, False):
        unit = _unit(entry.unit, [0.5] * 4, flat=flat)
        V = entry.values(unit, _args(credit, tmp_path))
        if entry.unit == "group" and not flat:  # a process penalty is credit of its own (F2): equal where Q is
            penalties = unit.penalties
            assert torch.equal(V == V[0], penalties == penalties[0]), (credit, V.tolist(), penalties.tolist())
            continue
        assert torch.equal(V, torch.zeros_like(V)), (credit, flat, V.tolist())


@pytest.mark.parametrize("credit", list(methods.CREDITS))
def test_where_no_two_leaves_share_a_turn_every_turn_gets_its_leafs_value(tmp_path, credit):
    """On a unit whose every turn lies on one leaf (a flat tree: GRPO's group; a group's searches), the backup has
    nothing to combine: every turn's credit is its leaf's value, the one the tree view shows (`Credit.view`)."""
    entry, args = methods.CREDITS[credit], _args(credit, tmp_path)
    unit = _unit(entry.unit, REWARDS[:5], flat=True)
    V, leaf_values = entry.values(unit, args), entry.view(unit, args)
    through = _leaves_through(unit)
    assert all(len(leaves) == 1 for leaves in through)
    expected = torch.stack([leaf_values[next(iter(leaves))] for leaves in through]).to(V)
    assert torch.allclose(V, expected, rtol=1e-12, atol=1e-12), (credit, V.tolist(), expected.tolist())


@pytest.mark.parametrize("credit", list(methods.CREDITS))
def test_raising_a_leafs_reward_raises_the_credit_of_the_turns_only_it_passes(tmp_path, credit):
    """Each leaf in turn gets 0.3 more reward: its own turns (those no other leaf passes) gain credit, strictly. (A
    shared turn need not: the other leaves below it lose standardised reward as the mean rises.)"""
    entry, args = methods.CREDITS[credit], _args(credit, tmp_path)
    rewards = REWARDS[:5]
    before = entry.values(_unit(entry.unit, rewards), args)
    through = _leaves_through(_unit(entry.unit, rewards))
    for k in range(len(rewards)):
        own = [i for i, leaves in enumerate(through) if leaves == {k}]
        assert own, f"leaf {k} has no turn of its own in the test's unit"
        raised = [r + 0.3 * (j == k) for j, r in enumerate(rewards)]
        after = entry.values(_unit(entry.unit, raised), args)
        assert bool((after[own] > before[own]).all()), (credit, k, before[own].tolist(), after[own].tolist())


# ---------------------------------------------------------------------------------------------------------------
# Every loss linear in its credit: the policy gradient's direction at its first block
# ---------------------------------------------------------------------------------------------------------------

LINEAR_LOSSES = [name for name, entry in methods.LOSSES.items() if entry.linear_in_credit]


@pytest.mark.parametrize("loss", LINEAR_LOSSES)
def test_the_first_block_gradient_of_a_linear_loss_has_the_sign_of_minus_the_credit(tmp_path, loss):
    """At θ = θ_old (the first block, π_old from the very packed forward, T6), ∂loss/∂log π_θ of every trained token
    of turn i has the sign of −A_i, and is 0 where A_i = 0: gradient descent raises the likelihood of turns with
    positive credit and lowers it where credit is negative. The credit is set by hand (signs mixed, zeros
    included), so the check is the loss's, through the trainer's pipeline (pack, π_old, `prepare`, `loss_inputs`)."""
    from trl_tree import pipeline

    entry = methods.LOSSES[loss]
    credit = next(name for name, c in methods.CREDITS.items() if c.unit == entry.unit)
    args = golden_float64.golden_args(credit, loss, str(tmp_path))
    pattern = [1.0, -0.5, 0.0, 0.75, -1.25, 0.25, -2.0]
    units = [_unit(entry.unit, REWARDS[:5], seed=s) for s in (0, 1)]
    A_of = {
        id(u): torch.tensor([pattern[(i + n) % len(pattern)] for i in range(u.num_turns)], dtype=torch.float64)
        for n, u in enumerate(units)
    }
    model = golden_float64.golden_model()
    rollout = (
        TreeUnits(None, None, 0, args.packing, model.config)
        if entry.unit == "tree"
        else FlexUnits(None, None, 0, False, None)
    )
    ports = pipeline.PipelinePorts(
        prepare=None,
        score=None,
        device="cpu",
        credit=lambda u: entry.prepare(u, A_of[id(u)], args).with_floats(),
        behaviour_logps=lambda packed: pipeline.behaviour_logps(model, packed, "cpu", args.temperature),
    )
    (inputs,) = pipeline.micro_batches(rollout, ports, units, 1)[0]
    with torch.no_grad():
        batch, _ = pipeline.loss_inputs(model, inputs, args.temperature)
    assert torch.equal(batch.logps, batch.old_logps)  # θ = θ_old
    logps = batch.logps.clone().requires_grad_(True)
    value, _ = entry.compute(dataclasses.replace(batch, logps=logps), args)
    (grad,) = torch.autograd.grad(value, logps)
    A = batch.credit.A.double()[batch.turn_ids]
    nonzero = A != 0
    assert bool(nonzero.any()) and bool((~nonzero).any())
    assert torch.equal(torch.sign(grad[nonzero]), -torch.sign(A[nonzero])), (loss, grad.tolist(), A.tolist())
    assert float(grad[~nonzero].abs().max()) <= 1e-12, (loss, grad[~nonzero].tolist())
