"""The method table (`trl_tree.methods`): each sampler, credit and loss is declared once, and what depends on the
choice (config validation, entropies, the model card, the package's exports, the loss and its metrics) reads it;
the typed micro-batch credit (`trl_tree.core.batch`) survives TRL's buffers."""

import dataclasses
import math
import re
from types import SimpleNamespace

import pytest
import torch

import trl_tree
from tests.scripted import config
from tests.trees import deep_tree, flatten, hotpot_like_tree, micro_batch_layout, perturbed
from trl_tree import credit, losses, methods
from trl_tree.core.batch import LossInputs, TurnCredit
from trl_tree.trainer.configuration.fields import TreeConfig, TreeFlexConfig
from trl_tree.trainer.observability.model_card import tree_section


def test_every_exported_name_resolves_including_the_lazy_packing_module():
    for name in trl_tree.__all__:
        assert getattr(trl_tree, name) is not None, name
    assert trl_tree.core.packing.pack_trees is not None  # `import trl_tree; trl_tree.core.packing` works without a from-import


@pytest.mark.parametrize("name", list(methods.METHODS))
def test_each_named_method_is_a_preset_of_its_registered_components(name):
    method = methods.METHODS[name]
    config_class, trainer_class = method.config_class(), method.trainer_class()
    defaults = {f.name: f.default for f in dataclasses.fields(config_class)}
    assert (defaults["sampler"], defaults["credit"], defaults["loss"]) == (method.sampler, method.credit, method.loss)
    assert trainer_class.config_class is config_class
    assert getattr(trl_tree, f"{method.title}Config") is config_class
    assert getattr(trl_tree, f"{method.title}Trainer") is trainer_class


def test_every_field_a_component_reads_exists_on_its_config():
    tree_fields = {f.name for f in dataclasses.fields(TreeConfig)}
    flex_fields = {f.name for f in dataclasses.fields(TreeFlexConfig)}
    for table in (methods.SAMPLERS, methods.CREDITS, methods.LOSSES):
        for component in table.values():
            fields = flex_fields if component.unit == "group" else tree_fields
            assert set(component.fields) <= fields, (component.name, set(component.fields) - fields)


def test_treeflex_config_has_none_of_the_fields_only_tree_components_read():
    """TreeFlexConfig shares `TreeTrainerConfig` with the tree configs, not `TreeConfig`: the fields that only the
    tree samplers, credits and losses of the table read (M, N, the expansion and token-branching fields, reward_std,
    target_radius, packing) are not fields of it, so they are not in `trl-tree treeflex --help` either."""
    from trl_tree.trainer.configuration.fields import TreeTrainerConfig

    def read_by(unit):
        return {name for table in (methods.SAMPLERS, methods.CREDITS, methods.LOSSES)
                for component in table.values() if component.unit == unit for name in component.fields}

    tree_only = read_by("tree") - read_by("group") - {f.name for f in dataclasses.fields(TreeTrainerConfig)}
    assert {"num_initial_rollouts", "num_branches", "anchor_rule", "expansion_rounds", "branches_per_round",
            "expansion_mode", "sibling_penalty", "entropy_threshold", "max_branches_per_tree", "min_segment_length",
            "branching_rounds", "reward_std", "target_radius", "packing"} <= tree_only
    assert not tree_only & {f.name for f in dataclasses.fields(TreeFlexConfig)}
    assert issubclass(TreeConfig, TreeTrainerConfig) and issubclass(TreeFlexConfig, TreeTrainerConfig)
    assert not issubclass(TreeFlexConfig, TreeConfig)


@pytest.mark.parametrize(
    "choice, needed",
    [
        ({"sampler": "entropy_guided", "credit": "child_mean", "loss": "atpo"}, True),  # A2 node scores
        ({"sampler": "entropy_guided", "expansion_mode": "random", "credit": "child_mean", "loss": "atpo"}, False),
        ({"sampler": "token_entropy", "credit": "leaf_mean", "loss": "grpo"}, True),  # branch points
        ({"sampler": "init_expand", "credit": "child_softmax", "loss": "atpo"}, True),  # A4 entropy backup
        ({"sampler": "init_expand", "credit": "likelihood", "loss": "treeopsd"}, False),
        ({"sampler": "flat", "credit": "path", "loss": "grpo", "num_initial_rollouts": 4}, False),
    ],
)
def test_needs_entropies_follows_the_chosen_components(tmp_path, choice, needed):
    assert methods.needs_entropies(config(TreeConfig, tmp_path, **choice)) is needed


def test_an_unknown_component_names_the_field_and_the_registered_choices(tmp_path):
    with pytest.raises(ValueError, match=re.escape(f"loss must be one of {tuple(methods.LOSSES)}")):
        config(TreeConfig, tmp_path, loss="ppo")


def test_components_of_a_tree_and_of_treeflex_do_not_mix(tmp_path):
    with pytest.raises(ValueError, match="choose components of one kind"):
        config(TreeConfig, tmp_path, credit="search")
    with pytest.raises(ValueError, match="use TreeFlexConfig"):
        TreeConfig(str(tmp_path), sampler="two_role", credit="search", loss="dual_clip", use_cpu=True, bf16=False)


@pytest.fixture
def half_treepo():
    """A new loss registered for one test: TreePO's surrogate at half the scale, reading `target_radius`."""

    def prepare(tree, A, args):
        return TurnCredit(A=A)

    @methods.register_loss("half_treepo", prepare=prepare, staleness=("decoupled",),
                           fields={"target_radius": "a field this loss reads", **methods.STALE_CAP_FIELD},
                           returns=("half_treepo/abs_A",))
    def compute(batch, args):
        loss, metrics = methods.LOSSES["treepo"].compute(batch, args)
        return loss / 2, {"half_treepo/abs_A": batch.credit.A.abs()}

    yield methods.LOSSES["half_treepo"]
    del methods.LOSSES["half_treepo"]


def test_a_registered_loss_is_one_configuration_away(tmp_path, half_treepo):
    """One registration: the config accepts it, the model card lists the field it reads, the trainer's credit and
    loss run it; and as a loss without a clip, a changed epsilon is rejected naming it."""
    args = config(TreeConfig, tmp_path, loss="half_treepo", target_radius=0.125)
    assert "target_radius" in methods.fields_read(args)

    class Card:
        pass

    card = Card()
    card.args = args
    assert "| `target_radius` | 0.125 |" in tree_section(card)
    with pytest.raises(ValueError, match="'half_treepo' loss has no ratio clip"):
        config(TreeConfig, tmp_path, loss="half_treepo", epsilon=0.3)

    tree = hotpot_like_tree()
    unit = methods.turn_credit(tree, args)
    turn_ids, old, _ = flatten(tree)
    batch = LossInputs.build(turn_ids.view(1, 1, -1), old.view(1, 1, -1), old.view(1, 1, -1), TurnCredit.stack([unit]))
    loss, metrics = half_treepo.compute(batch, args)
    full, _ = methods.LOSSES["treepo"].compute(batch, args)
    assert loss.item() == full.item() / 2 and set(metrics) == {"half_treepo/abs_A"}


def _one_batch(trees, args, seed=0):
    """The micro-batch of `trees` as the trainer lays it out, at log-probs near π_old."""
    units = [methods.turn_credit(tree, args) for tree in trees]
    turn_ids, old = micro_batch_layout(trees)
    new = perturbed(old, seed, 0.05)
    return LossInputs.build(turn_ids, new, old, TurnCredit.stack(units))


# the credit each tree loss is checked with (any other would do: the three choices are independent); a new loss
# gets "leaf_mean"
_CREDIT_OF = {"treeopsd": "likelihood", "treepo": "likelihood", "atpo": "child_mean"}


@pytest.mark.parametrize("loss", [name for name, loss in methods.LOSSES.items() if loss.unit == "tree"])
def test_each_tree_loss_returns_its_loss_and_declared_metrics(tmp_path, loss):
    """(loss, metrics): finite, the metrics it declares (`Loss.returns`); TreeOPSD's equals the pure function of
    `trl_tree.core.losses` on the same tensors; a clipped loss reports GRPO's clip counts per root-to-leaf path (K rows
    per tree), TreeOPSD its teachers' gaps per turn."""
    eps = {"epsilon": 3e-4, "epsilon_high": 4e-4} if loss == "gspo_token" else {}
    args = config(TreeConfig, tmp_path, loss=loss, credit=_CREDIT_OF.get(loss, "leaf_mean"), **eps)
    trees = [hotpot_like_tree(), deep_tree()]
    batch = _one_batch(trees, args)
    value, metrics = methods.LOSSES[loss].compute(batch, args)
    assert value.dim() == 0 and math.isfinite(value.item())
    assert set(metrics) == set(methods.LOSSES[loss].returns)
    if methods.LOSSES[loss].clipped:
        counts = metrics["clip_ratio"].counts
        assert counts.shape == (sum(t.num_leaves for t in trees), 3)
        path_tokens = [float(credit.turn_lengths(t)[path].sum()) for t in trees for path in t.paths]
        assert sorted(counts[:, 2].tolist()) == sorted(path_tokens)  # every path's trained tokens (paths renumbered)
    if loss == "treeopsd":
        c = batch.credit
        expected = losses.treeopsd_loss(batch.logps, batch.old_logps, batch.turn_ids, c.q, c.tau, batch.tree_ids)
        assert torch.allclose(value, expected)
        assert metrics["treeopsd/abs_p_minus_q/block_{block}"].numel() == batch.num_turns


def test_turn_credit_survives_the_buffers_and_flattens_in_global_turn_order(tmp_path):
    """stack → to_dict → from_dict → flatten gives each unit's per-turn values back, units in order, and keeps the
    per-unit fields one per unit."""
    args = config(TreeConfig, tmp_path)  # TreeOPSD: A, q per turn; τ per tree
    trees = [hotpot_like_tree(), deep_tree(), hotpot_like_tree()]
    units = [methods.turn_credit(tree, args) for tree in trees]
    stored = TurnCredit.stack(units).to_dict()
    assert all(key.startswith("credit_") for key in stored)
    assert stored["credit_kind"].shape == (3,)  # the kind's id per tree, split with the rows as every field is
    back = TurnCredit.from_dict({**stored, "input_ids": torch.zeros(3, 1, 4)})  # other keys of the batch ignored
    assert back.count.tolist() == [t.num_turns for t in trees]
    flat = back.flatten()
    assert torch.equal(flat.A, torch.cat([u.A for u in units]))
    assert torch.equal(flat.q, torch.cat([u.q for u in units]))
    assert torch.equal(flat.tau, torch.stack([u.tau for u in units]))
    assert torch.equal(flat.unit_ids(), torch.repeat_interleave(torch.arange(3), back.count))
    # TreeOPSD's kind comes back, with none of the fields its loss does not read
    assert type(back) is type(flat) is methods.TeacherCredit and set(back.present()) == {"A", "q", "tau", "count"}


def _unit_of(loss: str, tmp_path):
    """One unit's prepared credit for `loss`: a tree's through the trainer's `turn_credit`; for TreeFlex's group loss,
    its `prepare` on a stand-in group of two searches (the fields it reads, nothing grown)."""
    if methods.LOSSES[loss].unit == "tree":
        return methods.turn_credit(hotpot_like_tree(), config(TreeConfig, tmp_path, loss=loss))
    group = SimpleNamespace(
        lengths=torch.tensor([3.0, 2.0, 4.0]), penalties=torch.tensor([0.0, -1.0, 0.0]),
        turn_search=torch.tensor([0, 0, 1]), turn_block=torch.tensor([0, 1, 2]), turn_role=torch.tensor([0, 1, 0]),
    )
    args = SimpleNamespace(aggregation="rollout", role_lambda=0.0)
    return methods.LOSSES[loss].prepare(group, torch.tensor([0.5, -0.5, 1.0], dtype=torch.float64), args).with_floats()


@pytest.mark.parametrize("loss", list(methods.LOSSES))
def test_each_loss_prepares_its_own_credit_kind_and_it_survives_the_buffers_as_that_kind(tmp_path, loss):
    """`prepare` returns the kind the loss declares, carrying every field of it; stack → to_dict → from_dict gives
    that kind back with the same tensors, per-unit fields (declared by the kind) one per unit."""
    kind = methods.LOSSES[loss].credit_kind
    unit = _unit_of(loss, tmp_path)
    assert type(unit) is kind
    assert set(unit.present()) == {f.name for f in dataclasses.fields(kind)} - {"count"}
    stacked = TurnCredit.stack([unit, unit])
    back = TurnCredit.from_dict(stacked.to_dict())
    assert type(back) is kind
    assert stacked.present().keys() == back.present().keys()
    assert all(torch.equal(v, getattr(back, k)) for k, v in stacked.present().items())
    flat = back.flatten()
    for name, value in unit.present().items():
        expected = torch.stack([value] * 2) if name in kind.per_unit_fields() else torch.cat([value] * 2)
        assert torch.equal(getattr(flat, name), expected), name


def test_each_credit_kind_declares_its_per_unit_fields_and_no_two_kinds_share_their_fields():
    """Every loss reads a registered kind (`trl_tree.core.batch.CREDIT_KINDS`), and no two registered kinds carry the same
    fields (registration refuses it: tests/test_registries.py)."""
    from trl_tree.core.batch import CREDIT_KINDS

    kinds = {methods.LOSSES[name].credit_kind for name in methods.LOSSES} | {TurnCredit}
    assert kinds <= set(CREDIT_KINDS.values())
    names = {frozenset(f.name for f in dataclasses.fields(k)) for k in CREDIT_KINDS.values()}
    assert len(names) == len(CREDIT_KINDS)
    assert TurnCredit.per_unit_fields() == {"count"}
    assert methods.TeacherCredit.per_unit_fields() == {"count", "tau"}
    assert methods.PathCredit.per_unit_fields() == {"count", "num_paths"}
    assert methods.PathWeightedCredit.per_unit_fields() == {"count", "num_paths"}
    assert methods.FlexCredit.per_unit_fields() == {"count"}


def test_credits_of_different_kinds_do_not_stack():
    """One loss reads a micro-batch, so its units share one kind; a kind below another (more fields) is another."""
    A = torch.zeros(2)
    teacher = methods.TeacherCredit(A, q=torch.full((2,), 0.5), tau=torch.tensor(1.0))
    with pytest.raises(ValueError, match=r"same credit kind; got TeacherCredit\(A, q, tau\), TurnCredit\(A\)"):
        TurnCredit.stack([TurnCredit(A), teacher])
    paths = methods.PathCredit(A, path_lo=torch.zeros(2), path_hi=torch.ones(2), num_paths=torch.tensor(1))
    weighted = methods.PathWeightedCredit(A, path_lo=paths.path_lo, path_hi=paths.path_hi, num_paths=paths.num_paths,
                                          w=torch.ones(2))
    with pytest.raises(ValueError, match="same credit kind"):
        TurnCredit.stack([paths, weighted])
    with pytest.raises(ValueError, match="same credit kind"):  # asked for a kind, given another
        methods.TeacherCredit.stack([TurnCredit(A)])


def test_a_micro_batch_of_no_registered_kind_is_refused_naming_the_kinds():
    """The kind travels by name (`credit_kind`, its id per unit): a dict with the id of no registered kind, of two
    kinds, or of another kind than the one asked for, is refused saying which; so is one without it (a resume state
    of an earlier version) whose fields are no registered kind's."""
    from trl_tree.core.batch import kind_id

    stored = {"credit_A": torch.zeros(1, 2), "credit_w": torch.ones(1, 2), "credit_count": torch.tensor([2])}
    with pytest.raises(ValueError, match=r"The micro-batch has no 'credit_kind' and no registered credit kind carries "
                                         r"exactly its fields \['A', 'w'\]"):
        TurnCredit.from_dict(stored)
    with pytest.raises(ValueError, match=r"is \[7\], not the id of one registered credit kind \(registered: "
                                         r"TurnCredit\(A\) = \d+, .*FlexCredit\(A, w, penalty, search, block, role\)"):
        TurnCredit.from_dict({**stored, "credit_kind": torch.tensor([7])})
    two = torch.tensor([kind_id("TurnCredit"), kind_id("TeacherCredit")])
    with pytest.raises(ValueError, match="not the id of one registered credit kind"):
        TurnCredit.from_dict({"credit_A": torch.zeros(2, 2), "credit_count": torch.tensor([2, 2]), "credit_kind": two})
    plain = TurnCredit.stack([TurnCredit(torch.zeros(2))]).to_dict()
    with pytest.raises(ValueError, match=r"carries a TurnCredit\(A\), not a TeacherCredit\(A, q, tau\)"):
        methods.TeacherCredit.from_dict(plain)  # asked for TreeOPSD's teachers, given TreePO's credit
    with pytest.raises(ValueError, match=r"carries a TurnCredit\(A\) but its fields are \['A', 'count', 'w'\]"):
        TurnCredit.from_dict({**plain, "credit_w": torch.ones(1, 2)})


def test_a_loss_given_a_credit_of_another_kind_names_both(tmp_path):
    """A micro-batch prepared for one loss and trained by another fails before any arithmetic, naming what the loss
    reads and what it got; a kind that carries every field a loss reads (TreePO reads only A) is accepted."""
    trees = [hotpot_like_tree(), deep_tree()]
    plain = _one_batch(trees, config(TreeConfig, tmp_path, loss="treepo"))
    with pytest.raises(TypeError, match=r"the 'treeopsd' loss reads a TeacherCredit\(A, q, tau\) but was given a "
                                        r"TurnCredit\(A\)"):
        methods.LOSSES["treeopsd"].compute(plain, config(TreeConfig, tmp_path, loss="treeopsd"))
    with pytest.raises(TypeError, match=r"'atpo' loss reads a PathWeightedCredit.* given a PathCredit"):
        methods.LOSSES["atpo"].compute(_one_batch(trees, config(TreeConfig, tmp_path, loss="gspo_token")),
                                       config(TreeConfig, tmp_path, loss="atpo"))
    teacher = _one_batch(trees, config(TreeConfig, tmp_path, loss="treeopsd"))
    args = config(TreeConfig, tmp_path, loss="treepo")
    treepo = methods.LOSSES["treepo"].compute
    assert torch.equal(treepo(teacher, args)[0], treepo(plain, args)[0])


def test_path_credit_gives_each_turn_the_path_weighted_mean_of_its_trajectories():
    """`credit.path_credit` uses `path_token_weights`'s weights: Σ_i w_i L_i A_i over a tree equals GRPO's
    (1/K) Σ_k A_k (each path's tokens averaged, then the paths)."""
    tree = hotpot_like_tree()
    A = credit.standardize(torch.tensor(tree.rewards, dtype=torch.float64))
    V, w, L = credit.path_credit(tree, A), credit.path_token_weights(tree), credit.turn_lengths(tree)
    assert math.isclose((w * L * V).sum().item(), A.mean().item(), abs_tol=1e-12)
    first = tree.roots[0]
    through = [k for k, path in enumerate(tree.paths) if first in path]
    lengths = torch.tensor([float(L[tree.paths[k]].sum()) for k in through], dtype=torch.float64)
    expected = (A[through] / lengths).sum() / (1 / lengths).sum()
    assert math.isclose(V[first].item(), expected.item(), rel_tol=1e-12)


# ---------------------------------------------------------------------------------------------------------------
# Each component owns what it knows: its checks, its help, its place in the docs
# ---------------------------------------------------------------------------------------------------------------

_KINDS = {"sampler": methods.SAMPLERS, "credit": methods.CREDITS, "loss": methods.LOSSES}


def _design_tables() -> str:
    """The method and component tables of docs/design.md §1 (its table rows)."""
    from pathlib import Path

    text = (Path(__file__).resolve().parent.parent / "docs" / "design.md").read_text()
    section = text[text.index("## 1."):text.index("## 2.")]
    return "\n".join(line for line in section.splitlines() if line.startswith("|"))


@pytest.mark.parametrize("kind", list(_KINDS))
def test_every_registered_component_is_in_its_config_fields_help_and_the_design_table(kind):
    """A registration is listed by the help of the config field that chooses it (TreeFlex's group components by
    TreeFlexConfig's) and by docs/design.md's tables: no hand-written list can fall behind the table."""
    from dataclasses import fields

    from trl_tree import TreeConfig, TreeFlexConfig

    tables = _design_tables()
    for name, entry in _KINDS[kind].items():
        config = TreeConfig if entry.unit == "tree" else TreeFlexConfig
        field = next(f for f in fields(config) if f.name == kind)
        if not (config is TreeFlexConfig and kind != "sampler"):  # TreeFlex's credit and loss are fixed
            assert name in field.metadata["help"].split(": ", 1)[1], (kind, name)
        assert f"`{name}`" in tables, f"{kind} {name!r} is missing from docs/design.md's tables"
        assert entry.summary, f"{kind} {name!r} has no docstring to summarise it"


def test_every_method_has_its_row_in_the_design_table():
    rows = _design_tables().splitlines()
    for name, m in methods.METHODS.items():
        row = next((r for r in rows if r.startswith(f"| `{name}` |")), None)
        assert row is not None, f"method {name!r} is missing from docs/design.md's table"
        assert all(f"`{c}`" in row for c in (m.sampler, m.credit, m.loss)) and f"`{m.title}Trainer`" in row


def test_only_the_chosen_components_fields_are_validated(tmp_path):
    """An out-of-range field of a sampler that is not chosen changes nothing and is not refused; chosen, it is."""
    config(TreeConfig, tmp_path, sampler="init_expand", expansion_mode="bogus", min_segment_length=0)
    with pytest.raises(ValueError, match="expansion_mode"):
        config(TreeConfig, tmp_path, sampler="entropy_guided", expansion_mode="bogus")
    with pytest.raises(ValueError, match="min_segment_length"):
        config(TreeConfig, tmp_path, sampler="token_entropy", min_segment_length=0)
    with pytest.raises(ValueError, match="reward_std"):
        config(TreeConfig, tmp_path, reward_std="bogus")


def test_epsilon_high_unset_is_epsilon_and_zero_is_read_literally():
    """As GRPO reads it: None → ε, and 0.0 is 0.0 (not silently ε)."""
    from types import SimpleNamespace

    assert methods.epsilon_high(SimpleNamespace(epsilon=0.2, epsilon_high=None)) == 0.2
    assert methods.epsilon_high(SimpleNamespace(epsilon=0.2, epsilon_high=0.0)) == 0.0
    assert methods.clip_epsilons(SimpleNamespace(epsilon=0.2, epsilon_high=0.0)) == {"epsilon_low": 0.2,
                                                                                       "epsilon_high": 0.0}


@pytest.mark.parametrize("name", list(methods.METHODS))
def test_presets_take_name_tags_paper_and_config_from_their_method(name):
    """A preset trainer's display name, tags and paper are its `Method`'s; every preset derives from `TreeTrainer`
    alone, so no preset inherits another's identity (TreePO is not a TreeOPSD)."""
    from trl_tree.trainer.base import TreeTrainer

    m = methods.METHODS[name]
    trainer = m.trainer_class()
    assert trainer._name == m.title and trainer._tag_names == m.tags and trainer.config_class is m.config_class()
    if m.paper is not None:
        assert trainer._paper["id"] == m.paper.id
    presets = {other.trainer_class() for other in methods.METHODS.values()} - {trainer}
    assert not any(issubclass(trainer, other) for other in presets) and issubclass(trainer, TreeTrainer)


def test_every_tree_credit_views_one_value_per_leaf():
    """What the tree view shows per leaf (`Credit.view`) is one value per leaf of the tree, for every tree credit;
    for the standardising credits it is the A_k they back up."""
    from types import SimpleNamespace

    tree = hotpot_like_tree()
    args = SimpleNamespace(reward_std="sample")
    for name, entry in methods.CREDITS.items():
        if entry.unit == "tree":
            view = entry.view(tree, args)
            assert view.shape == (tree.num_leaves,), name
            if "reward_std" in entry.fields:
                assert torch.equal(view, methods.leaf_advantages(tree, args)), name


def test_a_plain_tree_trainer_refuses_treeflexs_config(tmp_path):
    """TreeFlexConfig shares only the base with the tree configs: `TreeTrainer` cannot train it (no sampler,
    credit or packing fields), and says which config it needs."""
    from trl_tree import TreeFlexConfig, TreeTrainer
    from trl_tree.testing import tiny_model_and_tokenizer

    model, tok = tiny_model_and_tokenizer()
    args = TreeFlexConfig(output_dir=str(tmp_path), num_searches=2, max_blocks=2, use_cpu=True, report_to="none",
                          per_device_train_batch_size=2)
    with pytest.raises(TypeError, match="TreeTrainer needs a TreeConfig"):
        TreeTrainer(model=model, reward_funcs=lambda completions, **kw: [0.0] * len(completions), args=args,
                    processing_class=tok)


@pytest.mark.parametrize(("register", "table", "name"), [
    (lambda: methods.register_sampler("init_expand")(lambda args, loop, seed: None), methods.SAMPLERS, "init_expand"),
    (lambda: methods.register_credit("likelihood")(lambda unit, args: None), methods.CREDITS, "likelihood"),
    (lambda: methods.register_loss("treeopsd", prepare=lambda *a: None)(lambda batch, args: None), methods.LOSSES,
     "treeopsd"),
], ids=["sampler", "credit", "loss"])
def test_a_name_registered_twice_is_refused_and_the_first_stays(register, table, name):
    """Registering a taken name once replaced the component silently (verl's registry refuses it, so does this)."""
    first = table[name]
    with pytest.raises(ValueError, match=f"named '{name}' is registered already"):
        register()
    assert table[name] is first


def test_a_credit_without_its_leaf_view_is_refused_and_not_registered():
    """The pages show each credit's per-leaf values (`Credit.view`). The machinery holds no default for it (the
    catalogue's `leaf_advantages` was one, imported back from the catalogue): a credit declares what it backs up."""
    with pytest.raises(ValueError, match=r"Credit 'viewless' declares no view: pass view=\(unit, args\) -> \[K\].*"
                                         r"view=trl_tree.methods.leaf_advantages\)"):
        methods.register_credit("viewless", fields={})(lambda unit, args: None)
    assert "viewless" not in methods.CREDITS


def test_the_registry_imports_nothing_of_the_catalogue():
    """`methods/registry.py` is the machinery, the `*_entries` modules the catalogue that registers into it: the
    catalogue passes what it knows (a credit's view) to the machinery, which never imports it back (a circle)."""
    import ast
    import inspect

    from trl_tree.methods import registry

    imported = set()
    for node in ast.walk(ast.parse(inspect.getsource(registry))):
        if isinstance(node, ast.ImportFrom):
            imported |= {node.module or ""} | {f"{node.module or ''}.{alias.name}" for alias in node.names}
        elif isinstance(node, ast.Import):
            imported |= {alias.name for alias in node.names}
    assert not [name for name in imported if name.endswith("_entries")], sorted(imported)


_CLIP_FIELDS = dict.fromkeys(methods.CLIP_FIELDS, "a clip range")  # the fields a clipped loss must read


@pytest.mark.parametrize(("declaration", "message"), [
    ({"credit_kind": TurnCredit, "fields": _CLIP_FIELDS, "returns": ("clip_ratio",)},
     r"Loss 'bad' returns 'clip_ratio', counted per sequence, but its credit kind TurnCredit\(A\) numbers none"),
    ({"credit_kind": methods.PathCredit, "fields": {}, "returns": ("clip_ratio",)},
     "Loss 'bad' returns 'clip_ratio' but does not read epsilon, epsilon_high"),
    ({"credit_kind": methods.PathCredit, "fields": _CLIP_FIELDS},
     r"Loss 'bad' reads 'epsilon' but does not declare returns=\('clip_ratio', ...\)"),
], ids=["clipped-without-paths", "clipped-without-epsilon", "epsilon-without-clip-metrics"])
def test_an_inconsistent_loss_declaration_is_refused_naming_the_loss(loss_table, declaration, message):
    """The clip metrics, the clip fields and a credit kind that numbers sequences go together; a loss declaring
    some without the others is refused at registration, not found as a KeyError in a training step."""
    with pytest.raises(ValueError, match=message):
        methods.register_loss("bad", prepare=lambda *a: None, **declaration)(lambda batch, args: None)
    assert "bad" not in loss_table


def test_a_loss_returning_undeclared_metrics_fails_naming_it(tmp_path, loss_table):
    """The registered `compute` compares the metric names with the declaration (`Loss.returns`) on every call."""

    @methods.register_loss("quiet_treepo", prepare=lambda tree, A, args: TurnCredit(A=A), returns=("quiet/A",),
                           staleness=("decoupled",), fields=methods.STALE_CAP_FIELD)
    def compute(batch, args):
        return loss_table["treepo"].compute(batch, args)

    args = config(TreeConfig, tmp_path, loss="quiet_treepo")
    with pytest.raises(ValueError, match=r"Loss 'quiet_treepo' returned the metrics \[\] but declares "
                                         r"returns=\('quiet/A',\)"):
        loss_table["quiet_treepo"].compute(_one_batch([hotpot_like_tree()], args), args)
