"""The loss contract for stale samples (docs/design.md §3, "Stale samples"): a micro-batch carries the behaviour
policy μ that sampled its trees beside π_old, every registered loss declares how it trains a stale tree, a fresh
micro-batch (μ = π_old, staleness 0) trains exactly as before, and a producer's micro-batch is moved onto the
trainer's policy by `pipeline.rebase_on_policy`."""

import copy
import math
from types import SimpleNamespace

import pytest
import torch

from tests.scripted import config
from tests.trees import deep_tree, hotpot_like_tree, micro_batch_layout, perturbed
from trl_tree import credit, losses, methods, pipeline
from trl_tree.core.batch import LossInputs, TurnCredit
from trl_tree.core.packing import PackedTrees
from trl_tree.core.tree_unit import TreeUnits
from trl_tree.trainer.configuration.fields import TreeConfig, TreeFlexConfig
from trl_tree.trainer.observability import rank_metrics as tree_metrics

CAP = 3.0


@pytest.fixture(scope="module")
def configs(tmp_path_factory):
    """One validated config per registered loss and per form it declares (`stale_target`)."""
    out = {}
    for name, loss in methods.LOSSES.items():
        for form in loss.staleness:
            path = tmp_path_factory.mktemp(f"{name}-{form}")
            target = {"stale_target": form} if len(loss.staleness) > 1 else {}
            if loss.unit == "group":
                out[name, form] = TreeFlexConfig(
                    output_dir=str(path),
                    num_searches=2,
                    max_blocks=2,
                    use_cpu=True,
                    report_to="none",
                    per_device_train_batch_size=2,
                    behaviour_importance_cap=CAP,
                )
            else:
                out[name, form] = config(
                    TreeConfig, path, loss=name, credit="likelihood", behaviour_importance_cap=CAP, **target
                )
    return out


def _credit(tree, args) -> TurnCredit:
    """The unit's credit as the configured loss reads it; TreeFlex's kind (a group's) filled by hand over the tree's
    turns: its loss reads A, w and the search of each turn."""
    if methods.LOSSES[args.loss].unit == "tree":
        return methods.turn_credit(tree, args)
    n = tree.num_turns
    lengths = credit.turn_lengths(tree).double()
    return methods.FlexCredit(
        A=torch.linspace(-1.0, 1.0, n),
        w=(1.0 / lengths.sum()).expand(n).float(),
        penalty=torch.zeros(n),
        search=torch.arange(n) % 2,
        block=torch.arange(n),
        role=torch.zeros(n, dtype=torch.long),
    ).with_floats()


def _layout(trees, args):
    """[N, 1, T] turn ids and π_old's log-probs (float64) of `trees`, and their stacked credit."""
    turn_ids, old = micro_batch_layout(trees)
    return turn_ids, old, TurnCredit.stack([_credit(tree, args) for tree in trees])


def _stale_behaviour(turn_ids: torch.Tensor, old: torch.Tensor) -> torch.Tensor:
    """μ's log-probs for a stale tree: log(π_old/μ) is 1.5 (+0.1 on odd tokens) on every third turn, so those
    tokens' and turns' weights exceed C = 3 and are cut, and −0.4 (+0.1) elsewhere, a weight below 1."""
    shift = torch.where(turn_ids % 3 == 0, 1.5, -0.4).double() + 0.1 * (torch.arange(turn_ids.shape[-1]) % 2)
    return old - shift


def _loss_and_grad(args, turn_ids, logps, old, credit_, behaviour=None, staleness=None):
    logps = logps.clone().requires_grad_(True)
    batch = LossInputs.build(turn_ids, logps, old, credit_, behaviour, staleness)
    loss, _ = methods.LOSSES[args.loss].compute(batch, args)
    (g,) = torch.autograd.grad(loss, logps)
    return loss.detach(), g


# the synchronous loss of each registered loss: its pure function against π_old, no importance weights (the call
# every loss made before stale samples had a contract); a newly registered loss adds its own
def _synchronous(b: LossInputs, args):
    c, eps = b.credit, methods.clip_epsilons(args) if "epsilon" in methods.LOSSES[args.loss].fields else {}
    if args.loss == "treeopsd":
        return losses.treeopsd_loss(b.logps, b.old_logps, b.turn_ids, c.q, c.tau, b.tree_ids, num_trees=b.num_trees)
    if args.loss == "treepo":
        return losses.treepo_loss(b.logps, b.old_logps, b.turn_ids, c.A, b.tree_ids, num_trees=b.num_trees)
    if args.loss == "atpo":
        return losses.atpo_loss(b.logps, b.old_logps, b.turn_ids, c.A, c.w, b.tree_ids, num_trees=b.num_trees, **eps)
    if args.loss == "grpo":
        return losses.clipped_token_loss(
            b.logps, b.old_logps, b.turn_ids, c.A, c.w, b.tree_ids, num_trees=b.num_trees, **eps
        )
    if args.loss == "gspo_token":
        pairs = credit.pairs_from_intervals(c.path_lo, c.path_hi, c.num_paths, b.tree_ids)
        return losses.gspo_token_loss(b.logps, b.old_logps, b.turn_ids, c.A, *pairs, num_trees=b.num_trees, **eps)
    if args.loss == "dual_clip":
        per_token = losses.dual_clip_loss(
            b.logps,
            b.old_logps,
            c.A[b.turn_ids],
            epsilon=args.epsilon,
            c=args.dual_clip_c,
            epsilon_high=methods.epsilon_high(args),
        )
        return (c.w[b.turn_ids].to(per_token) * per_token).sum() / max(int(b.num_trees), 1)
    raise AssertionError(f"loss {args.loss!r} has no synchronous reference here: add it to `_synchronous`")


_FORMS = [(name, form) for name, loss in methods.LOSSES.items() for form in loss.staleness]


@pytest.mark.parametrize(("name", "form"), _FORMS)
@pytest.mark.parametrize("block", ["first", "later"])
def test_at_staleness_zero_every_registered_loss_is_its_synchronous_loss_bit_for_bit(configs, name, form, block):
    """μ = π_old, as `micro_batches` writes it (a copy, staleness 0): the value and the gradient of every registered
    loss, in every form it declares, are exactly those of its pure function against π_old without weights, in the
    first block (θ = θ_old) and in a later one."""
    args = configs[name, form]
    turn_ids, old, credit_ = _layout([hotpot_like_tree(), deep_tree()], args)
    logps = old.clone() if block == "first" else perturbed(old, seed=3, scale=0.3)
    loss, g = _loss_and_grad(args, turn_ids, logps, old, credit_, old.clone(), torch.zeros(2, dtype=torch.long))

    reference = logps.clone().requires_grad_(True)
    expected = _synchronous(LossInputs.build(turn_ids, reference, old, credit_), args)
    (g_expected,) = torch.autograd.grad(expected, reference)
    assert loss.item() == expected.item()
    assert torch.equal(g, g_expected)
    if block == "first" and name == "treeopsd":
        assert g.abs().max() > 0  # the tree policy gradient, not a vacuous zero


def test_treeopsd_on_a_stale_tree_stops_at_its_teacher_measured_against_the_behaviour_policy(configs):
    """TreeOPSD as its paper defines it: p_i = σ(mean log π_θ/μ). Where p = q against μ the gradient vanishes, however
    far π_old has moved from μ; at p = q against π_old (what the decoupled form measures) it does not."""
    args = configs["treeopsd", "behaviour"]
    turn_ids, old, credit_ = _layout([hotpot_like_tree(), deep_tree()], args)
    behaviour = _stale_behaviour(turn_ids, old)
    flat = credit_.flatten()
    offsets = (torch.cumsum(credit_.count, 0) - credit_.count).view(-1, 1, 1)
    logit_q = torch.logit(flat.q.double())
    at_teacher = torch.where(turn_ids >= 0, logit_q[(turn_ids + offsets).clamp(min=0)], 0.0)
    staleness = torch.tensor([2, 1])

    _, g = _loss_and_grad(args, turn_ids, behaviour + at_teacher, old, credit_, behaviour, staleness)
    assert g.abs().max() < 1e-12
    _, g_off = _loss_and_grad(args, turn_ids, old + at_teacher, old, credit_, behaviour, staleness)
    assert g_off.abs().max() > 1e-3
    # the decoupled ablation stops where the KL against π_old is at its teacher instead
    _, g_decoupled = _loss_and_grad(
        configs["treeopsd", "decoupled"], turn_ids, old + at_teacher, old, credit_, behaviour, staleness
    )
    assert g_decoupled.abs().max() < 1e-12


# the losses with one ratio per turn weight each turn by its geometric-mean weight, the others each token
_PER_TURN = {("atpo", "decoupled"), ("treeopsd", "decoupled")}


@pytest.mark.parametrize(("name", "form"), [f for f in _FORMS if f[1] == "decoupled"])
@pytest.mark.parametrize("block", ["first", "later"])
def test_a_decoupled_loss_weights_each_stale_token_by_min_of_old_over_behaviour_and_cap(configs, name, form, block):
    """Decoupled PPO: the gradient on a stale tree is the fresh tree's (ratio and clip against π_old) times
    min(π_old/μ, C), per token (per turn, its geometric mean, for one ratio per turn); weights past C are cut at C."""
    args = configs[name, form]
    turn_ids, old, credit_ = _layout([hotpot_like_tree(), deep_tree()], args)
    behaviour = _stale_behaviour(turn_ids, old)
    logps = old.clone() if block == "first" else perturbed(old, seed=5, scale=0.3)
    _, g_fresh = _loss_and_grad(args, turn_ids, logps, old, credit_)
    _, g_stale = _loss_and_grad(args, turn_ids, logps, old, credit_, behaviour, torch.tensor([1, 1]))

    trained = turn_ids >= 0
    raw = (old - behaviour).exp()
    if (name, form) in _PER_TURN:
        flat = LossInputs.build(turn_ids, old, old, credit_, behaviour)
        log_w = losses.turn_mean_log_ratio(flat.old_logps, flat.behaviour_logps, flat.turn_ids, flat.num_turns)
        raw = torch.zeros_like(old).masked_scatter(trained, log_w.exp()[flat.turn_ids])
    expected = raw.clamp(max=CAP)
    assert (raw[trained] > CAP).any() and (raw[trained] < 1).any()
    assert torch.allclose(g_stale, expected * g_fresh, rtol=1e-12, atol=1e-15)
    assert (g_fresh[trained] != 0).any()


@pytest.mark.parametrize(("name", "form"), _FORMS)
def test_no_gradient_reaches_the_old_or_the_behaviour_log_probs(configs, name, form):
    """π_old and μ, and the weights made of them, are constants of the loss: only log π_θ is differentiated."""
    args = configs[name, form]
    turn_ids, old, credit_ = _layout([hotpot_like_tree()], args)
    old_leaf = old.clone().requires_grad_(True)
    behaviour_leaf = _stale_behaviour(turn_ids, old).requires_grad_(True)
    logps = perturbed(old, seed=7, scale=0.3).requires_grad_(True)
    batch = LossInputs.build(turn_ids, logps, old_leaf, credit_, behaviour_leaf, torch.tensor([1]))
    loss, _ = methods.LOSSES[name].compute(batch, args)
    g_logps, g_old, g_behaviour = torch.autograd.grad(loss, [logps, old_leaf, behaviour_leaf], allow_unused=True)
    assert g_logps is not None and g_logps.abs().max() > 0
    assert g_old is None and g_behaviour is None


# ------------------------------------------------------------------------------------------------ registration


@pytest.mark.parametrize(
    ("declaration", "message"),
    [
        ({}, r"Loss 'bad' declares no staleness treatment: register it with staleness=\(FORM, ...\)"),
        ({"staleness": ("fresh",)}, r"Loss 'bad' declares staleness=\('fresh',\): each form once, among 'behaviour'"),
        (
            {"staleness": ("behaviour", "behaviour")},
            r"declares staleness=\('behaviour', 'behaviour'\): each form once",
        ),
        (
            {
                "staleness": ("behaviour",),
                "credit_kind": methods.PathCredit,
                "fields": {**dict.fromkeys(methods.CLIP_FIELDS, "a clip range"), **methods.STALE_CAP_FIELD},
                "returns": ("clip_ratio",),
            },
            r"Loss 'bad' returns 'clip_ratio', so its ratio is clipped to a trust region around π_old, but declares "
            r"staleness=\('behaviour',\): a clipped loss trains stale samples in the decoupled form only",
        ),
        (
            {"staleness": ("decoupled",)},
            r"Loss 'bad' declares staleness=\('decoupled',\) but does not read "
            r"behaviour_importance_cap",
        ),
        (
            {"staleness": ("behaviour", "decoupled"), "fields": methods.STALE_CAP_FIELD},
            r"declares staleness=\('behaviour', 'decoupled'\) but does not read stale_target",
        ),
    ],
    ids=["none", "unknown", "twice", "clipped-against-behaviour", "decoupled-without-cap", "forms-without-choice"],
)
def test_a_loss_without_a_fitting_staleness_declaration_is_refused(loss_table, declaration, message):
    with pytest.raises(ValueError, match=message):
        methods.register_loss("bad", prepare=lambda *a: None, **declaration)(lambda batch, args: None)
    assert "bad" not in loss_table


def test_every_registered_loss_declares_its_staleness_and_clipped_ones_are_decoupled():
    """The catalogue as the issue asks: TreeOPSD against μ (the decoupled form its ablation), the rest decoupled."""
    assert methods.LOSSES["treeopsd"].staleness == ("behaviour", "decoupled")
    for name, loss in methods.LOSSES.items():
        assert loss.staleness, name
        if loss.clipped or name == "treepo":
            assert loss.staleness == ("decoupled",), name


# ------------------------------------------------------------------------------------------------ configuration


def test_the_stale_fields_are_checked_naming_the_field_and_the_loss(tmp_path):
    assert methods.stale_form(config(TreeConfig, tmp_path), "treeopsd") == "behaviour"
    assert methods.stale_form(config(TreeConfig, tmp_path, stale_target="decoupled"), "treeopsd") == "decoupled"
    assert methods.stale_form(config(TreeConfig, tmp_path, loss="grpo", credit="leaf_mean"), "grpo") == "decoupled"
    with pytest.raises(
        ValueError,
        match=r"stale_target='behaviour', but the 'grpo' loss trains stale samples only "
        r"in the form 'decoupled'",
    ):
        config(TreeConfig, tmp_path, loss="grpo", credit="leaf_mean", stale_target="behaviour")
    with pytest.raises(
        ValueError,
        match=r"stale_target='bogus', but the 'treeopsd' loss trains stale samples only "
        r"in the forms 'behaviour', 'decoupled'",
    ):
        config(TreeConfig, tmp_path, stale_target="bogus")
    for cap in (0.5, float("inf"), float("nan")):
        with pytest.raises(ValueError, match=r"behaviour_importance_cap C .* a finite number ≥ 1 .* got"):
            config(TreeConfig, tmp_path, behaviour_importance_cap=cap)
    with pytest.raises(ValueError, match="behaviour_importance_cap"):
        TreeFlexConfig(
            output_dir=str(tmp_path),
            num_searches=2,
            max_blocks=2,
            use_cpu=True,
            report_to="none",
            per_device_train_batch_size=2,
            behaviour_importance_cap=0.9,
        )
    assert methods.importance_cap(config(TreeConfig, tmp_path, behaviour_importance_cap=1)) == 1.0


# ------------------------------------------------------------------------------------------------ the micro-batch


@pytest.fixture(scope="module")
def tiny():
    from trl_tree.testing import tiny_model_and_tokenizer

    torch.manual_seed(0)
    model, tokenizer = tiny_model_and_tokenizer()
    return model.eval(), tokenizer


def _producer_batches(model, tokenizer, args, trees, num_chunks=1):
    """What an asynchronous producer's `generation_batch` gives after growing `trees`: `micro_batches` run with the
    producer's own copy of the policy as the model that sampled them."""
    unit = TreeUnits(sampler=None, session=None, pad_id=tokenizer.pad_token_id, layout="tree")
    ports = pipeline.PipelinePorts(
        prepare=None,
        score=None,
        device="cpu",
        behaviour_logps=lambda packed: pipeline.behaviour_logps(model, packed, "cpu", 1.0),
        credit=lambda tree: methods.turn_credit(tree, args),
    )
    return pipeline.micro_batches(unit, ports, trees, num_chunks)[0]


def _trainer_old_logps(model, batch):
    return pipeline.behaviour_logps(model, PackedTrees.from_dict(batch), "cpu", 1.0)


def test_a_synchronous_micro_batch_carries_the_behaviour_policy_equal_to_pi_old_and_staleness_zero(tiny, tmp_path):
    model, tokenizer = tiny
    (batch,) = _producer_batches(model, tokenizer, config(TreeConfig, tmp_path), [hotpot_like_tree()])
    assert torch.equal(batch["behaviour_logps"], batch["old_logps"])
    assert batch["behaviour_logps"] is not batch["old_logps"]  # two fields, not one tensor under two names
    assert batch["staleness"].tolist() == [0] and batch["staleness"].dtype == torch.long


@pytest.mark.parametrize("loss", [name for name, loss in methods.LOSSES.items() if loss.unit == "tree"])
def test_a_producers_batch_rebased_at_staleness_zero_trains_as_the_synchronous_batch(tiny, tmp_path, loss):
    """Equal weights, staleness 0: the first block's log-ratio is exactly 0 against π_old and against μ, and every
    loss is exactly the synchronous batch's."""
    model, tokenizer = tiny
    args = config(TreeConfig, tmp_path, loss=loss, credit="likelihood")
    trees = [hotpot_like_tree(), deep_tree()]
    (produced,) = _producer_batches(copy.deepcopy(model), tokenizer, args, trees)
    (synchronous,) = _producer_batches(model, tokenizer, args, [hotpot_like_tree(), deep_tree()])
    rebased = pipeline.rebase_on_policy(produced, _trainer_old_logps(model, produced), torch.tensor([0, 0]))

    batch, _ = pipeline.loss_inputs(model, rebased, 1.0)
    assert torch.equal(batch.logps, batch.old_logps) and torch.equal(batch.logps, batch.behaviour_logps)
    assert batch.staleness.tolist() == [0] * batch.num_turns
    reference, _ = pipeline.loss_inputs(model, synchronous, 1.0)
    assert methods.block_loss(batch, args)[0].item() == methods.block_loss(reference, args)[0].item()


def test_rebase_keeps_the_producers_log_probs_as_the_behaviour_policy_of_a_stale_tree(tiny, tmp_path):
    """Staleness 1 (the trainer stepped once since the producer's weights): π_old is the trainer's forward, μ the
    producer's, per unit; at staleness 0 μ is π_old's forward even if the producer's bits differ (another thread
    count), so that unit's first-block log-ratio stays exactly 0. The input dict is left as it was."""
    model, tokenizer = tiny
    args = config(TreeConfig, tmp_path)
    producer = copy.deepcopy(model)
    (produced,) = _producer_batches(producer, tokenizer, args, [hotpot_like_tree(), deep_tree()])
    produced = {
        **produced,
        "old_logps": produced["old_logps"] + 1e-7,  # the producer's bits, off in the last place
        "behaviour_logps": produced["behaviour_logps"] + 1e-7,
    }
    trainer = copy.deepcopy(model)
    with torch.no_grad():
        next(trainer.parameters()).add_(0.05)  # one optimizer step later
    before = {k: v.clone() for k, v in produced.items()}
    old_logps = _trainer_old_logps(trainer, produced)
    rebased = pipeline.rebase_on_policy(produced, old_logps, torch.tensor([0, 1]))

    assert all(torch.equal(produced[k], before[k]) for k in before)
    assert torch.equal(rebased["old_logps"], old_logps)
    assert torch.equal(rebased["behaviour_logps"][0], old_logps[0])  # staleness 0: the trainer's forward
    assert torch.equal(rebased["behaviour_logps"][1], produced["old_logps"][1])  # staleness 1: the producer's
    assert rebased["staleness"].tolist() == [0, 1]
    batch, _ = pipeline.loss_inputs(trainer, rebased, 1.0)
    first, second = batch.token_tree_ids == 0, batch.token_tree_ids == 1
    assert torch.equal(batch.logps, batch.old_logps)  # the first block, against π_old
    assert torch.equal(batch.logps[first], batch.behaviour_logps[first])
    assert (batch.logps[second] - batch.behaviour_logps[second]).abs().max() > 1e-4  # the tree is stale against μ


def test_rebase_refuses_a_batch_rebased_already_and_bad_staleness(tiny, tmp_path):
    model, tokenizer = tiny
    (produced,) = _producer_batches(model, tokenizer, config(TreeConfig, tmp_path), [hotpot_like_tree()])
    old = produced["old_logps"] - 0.1
    once = pipeline.rebase_on_policy(produced, old, torch.tensor([1]))
    with pytest.raises(ValueError, match="it was rebased once"):
        pipeline.rebase_on_policy(once, old, torch.tensor([1]))
    for bad in (torch.tensor([-1]), torch.tensor([1, 2]), torch.tensor([0.5])):
        with pytest.raises(ValueError, match="staleness must be 1 integer counts ≥ 0, one per unit"):
            pipeline.rebase_on_policy(produced, old, bad)
    with pytest.raises(ValueError, match="compute π_old by the packed forward of this very micro-batch"):
        pipeline.rebase_on_policy(produced, old[..., :-1], torch.tensor([1]))


def test_loss_inputs_reads_both_policies_and_refuses_half_of_them(tiny, tmp_path):
    """A batch without either key is the fresh contract from before (a saved resume state): μ = π_old."""
    model, tokenizer = tiny
    (batch,) = _producer_batches(model, tokenizer, config(TreeConfig, tmp_path), [hotpot_like_tree()])
    legacy = {k: v for k, v in batch.items() if k not in ("behaviour_logps", "staleness")}
    flat, _ = pipeline.loss_inputs(model, legacy, 1.0)
    assert torch.equal(flat.behaviour_logps, flat.old_logps) and not flat.staleness.any()
    for key in ("behaviour_logps", "staleness"):
        half = {k: v for k, v in batch.items() if k != key}
        with pytest.raises(ValueError, match=f"carries .* without '{key}': a micro-batch carries both"):
            pipeline.loss_inputs(model, half, 1.0)


# ------------------------------------------------------------------------------------------------ metrics


def test_block_metrics_report_the_importance_weights_and_the_fraction_cut(configs):
    """GRPOTrainer's `sampling/importance_sampling_ratio/*` names, per block: all 1 and nothing cut on a fresh batch;
    on a stale one the mean and largest weight (at most C) and the share of tokens cut at C, the largest logged as
    the maximum over ranks."""
    args = configs["grpo", "decoupled"]
    turn_ids, old, credit_ = _layout([hotpot_like_tree()], args)
    name = methods.IMPORTANCE_METRIC
    fresh = methods.block_loss(LossInputs.build(turn_ids, old, old, credit_), args)[1]
    assert (
        fresh[name + "/mean/block_{block}"].eq(1).all() and not fresh[name + "/truncated_fraction/block_{block}"].any()
    )

    behaviour = _stale_behaviour(turn_ids, old)
    stale = methods.block_loss(LossInputs.build(turn_ids, old, old, credit_, behaviour, torch.tensor([2])), args)[1]
    raw = (old - behaviour)[turn_ids >= 0].exp()
    logged = {}
    tree_metrics.log_values(
        _Lists(logged), SimpleNamespace(num_processes=1, device="cpu", reduce=lambda t, reduction: t), stale, block=1
    )
    assert math.isclose(logged[name + "/mean/block_1"][0], raw.clamp(max=CAP).mean().item(), rel_tol=1e-6)
    assert logged[name + "/max/block_1"] == [CAP]
    assert math.isclose(logged[name + "/truncated_fraction/block_1"][0], (raw > CAP).double().mean().item())


class _Lists(dict):
    """TRL's `_metrics[mode]`: a list per name, made on first use."""

    def __init__(self, out):
        super().__init__()
        self.out = out

    def __getitem__(self, key):
        return self.out.setdefault(key, [])
