"""Packed tree forwards equal separate path forwards (docs/design.md §6).

The reference for every property is the obvious computation: run each root-to-leaf path alone as a plain causal
sequence and read log π(token | its history) from the previous position's logits.
"""

import pytest
import torch
from transformers import Qwen3Config

from tests.trees import PAD, branching_tree, random_ids, random_turn, tiny_model
from trl_tree.core.packing import (
    PackedTrees,
    additive_attention_mask,
    block_mask,
    dense_attention_mask,
    forward_cost,
    pack_cheapest,
    pack_trees,
    packed_token_logps,
    pad_rows,
    token_weight,
)
from trl_tree.core.tree import RolloutTree

TOL = 1e-5


@pytest.fixture(scope="module")
def sdpa_model():
    return tiny_model("sdpa")


def leaf_paths(tree: RolloutTree) -> list[list[int]]:
    """Unique root-to-leaf paths (turn indices), leaves in DFS order."""
    paths = []
    for leaf in (i for i, turn in enumerate(tree.turns) if turn.is_leaf):
        path = [leaf]
        while tree.turns[path[-1]].parent >= 0:
            path.append(tree.turns[path[-1]].parent)
        paths.append(path[::-1])
    return paths


def reference(model, tree: RolloutTree, temperature: float = 1.0):
    """Per unique leaf path: {turn: (action logps, action entropies)} from a plain causal forward of the path alone."""
    out = []
    for path in leaf_paths(tree):
        ids = list(tree.prompt_ids)
        spans = {}
        for i in path:
            spans[i] = len(ids)
            ids += tree.turns[i].action_ids + tree.turns[i].observation_ids
        logits = model(input_ids=torch.tensor([ids])).logits[0].float() / temperature
        logprobs = logits.log_softmax(-1)
        entropy = -(logprobs.exp() * logprobs).sum(-1)
        per_turn = {}
        for i, start in spans.items():
            targets = torch.tensor(tree.turns[i].action_ids)
            rows = torch.arange(start - 1, start - 1 + len(targets))
            per_turn[i] = (logprobs[rows, targets], entropy[rows])
        out.append(per_turn)
    return out


def packed_per_turn(values: torch.Tensor, turn_ids: torch.Tensor, num_turns: int) -> list[torch.Tensor]:
    """Split one tree's [R, T] per-token values into each turn's trained tokens (in order)."""
    return [values[turn_ids == i] for i in range(num_turns)]


def token_weights(tree: RolloutTree, seed: int = 1) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.randn(len(t.action_ids), generator=gen) / tree.num_unique_tokens for t in tree.turns]


def first_occurrence(ref: list[dict]) -> dict:
    """Each turn's reference values from the first path (DFS order) that contains it: each unique token once."""
    first = {}
    for per_turn in ref:
        for i, values in per_turn.items():
            first.setdefault(i, values)
    return first


def assert_matches_paths(model, tree: RolloutTree, layout: str, chunk_size: int = 1024):
    """Packed log-probs equal path-wise ones for every occurrence, and the gradients of a weighted sum agree."""
    params = [p for p in model.parameters() if p.requires_grad]
    weights = token_weights(tree)

    packed = pack_trees([tree], PAD, layout=layout)
    logps, _ = packed_token_logps(model, packed, chunk_size=chunk_size)
    per_turn = packed_per_turn(logps[0], packed.turn_ids[0], tree.num_turns)
    packed_loss = sum((lp * w).sum() for lp, w in zip(per_turn, weights))
    packed_grads = torch.autograd.grad(packed_loss, params)

    ref = reference(model, tree)
    for path_values in ref:
        for i, (ref_logps, _) in path_values.items():
            torch.testing.assert_close(per_turn[i], ref_logps, atol=TOL, rtol=0)
    first = first_occurrence(ref)
    assert sorted(first) == list(range(tree.num_turns))
    ref_loss = sum((first[i][0] * w).sum() for i, w in enumerate(weights))
    ref_grads = torch.autograd.grad(ref_loss, params)
    torch.testing.assert_close(packed_loss, ref_loss, atol=TOL, rtol=0)
    for got, want in zip(packed_grads, ref_grads):
        torch.testing.assert_close(got, want, atol=TOL, rtol=0)


# ----------------------------------------------------------------------------------------------------------------
# Equivalence with separate paths
# ----------------------------------------------------------------------------------------------------------------


def test_tree_fixture_has_the_shapes_the_tests_need():
    tree = branching_tree()
    depths = [t.depth for t in tree.turns]
    branching_depths = {tree.turns[i].depth for i, t in enumerate(tree.turns) if len(t.children) > 1}
    assert max(depths) >= 2 and len(tree.roots) == 2 and {0, 1} <= branching_depths
    assert tree.num_leaves > len(leaf_paths(tree))  # a merged duplicate path
    assert any(t.observation_ids for t in tree.turns) and any(not t.observation_ids for t in tree.turns)


@pytest.mark.parametrize("layout", ["tree", "paths"])
def test_packed_sdpa_equals_separate_paths(sdpa_model, layout):
    assert_matches_paths(sdpa_model, branching_tree(), layout, chunk_size=7)


@pytest.mark.parametrize("layout", ["tree", "paths"])
def test_packed_eager_additive_mask_equals_separate_paths(layout):
    assert_matches_paths(tiny_model("eager"), branching_tree(seed=3), layout)


@pytest.mark.parametrize("layout", ["tree", "paths"])
def test_packed_tree_sdpa_chains_equal_separate_paths(layout):
    """tree_sdpa attends chain by chain (trl_tree.core.tree_attention): the same log-probs and gradients as the paths."""
    assert_matches_paths(tiny_model("tree_sdpa"), branching_tree(seed=4), layout, chunk_size=7)


def test_the_equivalence_check_has_power(sdpa_model):
    """Plain causal attention over the packed row (siblings see each other) is far from the path-wise result."""
    tree = branching_tree()
    packed = pack_trees([tree], PAD)
    everything_visible = torch.full_like(packed.subtree_end, int(packed.valid.max()))
    causal = PackedTrees(**{**packed.to_dict(), "subtree_end": everything_visible})
    with torch.no_grad():
        good, _ = packed_token_logps(sdpa_model, packed)
        leaky, _ = packed_token_logps(sdpa_model, causal)
    assert (good - leaky).abs().max() > 1e-2


@pytest.mark.parametrize("attention", ["sdpa", "tree_sdpa"])
def test_batch_of_trees_with_padding_equals_each_tree_alone(attention):
    sdpa_model = tiny_model(attention)
    trees = [branching_tree(seed=s, prompt_len=p) for s, p in [(0, 3), (1, 11), (2, 7)]]
    for layout in ("tree", "paths"):
        with torch.no_grad():
            batch = pack_trees(trees, PAD, layout=layout, pad_to_multiple_of=16)
            logps, entropy = packed_token_logps(sdpa_model, batch, compute_entropy=True)
            for n, tree in enumerate(trees):
                alone = pack_trees([tree], PAD, layout=layout)
                want, want_entropy = packed_token_logps(sdpa_model, alone, compute_entropy=True)
                rows, length = want.shape[1:]
                torch.testing.assert_close(logps[n, :rows, :length], want[0], atol=TOL, rtol=0)
                torch.testing.assert_close(entropy[n, :rows, :length], want_entropy[0], atol=TOL, rtol=0)
                assert logps[n, rows:].abs().sum() == 0 and logps[n, :, length:].abs().sum() == 0


def test_entropy_and_temperature_match_the_full_softmax_on_each_path(sdpa_model):
    tree = branching_tree(seed=5)
    with torch.no_grad():
        packed = pack_trees([tree], PAD)
        logps, entropy = packed_token_logps(sdpa_model, packed, temperature=0.7, compute_entropy=True, chunk_size=5)
        first = first_occurrence(reference(sdpa_model, tree, temperature=0.7))
    turn_ids = packed.turn_ids[0]
    packed_logps = packed_per_turn(logps[0], turn_ids, tree.num_turns)
    packed_entropy = packed_per_turn(entropy[0], turn_ids, tree.num_turns)
    for i in range(tree.num_turns):
        torch.testing.assert_close(packed_logps[i], first[i][0], atol=TOL, rtol=0)
        torch.testing.assert_close(packed_entropy[i], first[i][1], atol=TOL, rtol=0)
    assert (entropy[0][turn_ids < 0] == 0).all() and (logps[0][turn_ids < 0] == 0).all()


# ----------------------------------------------------------------------------------------------------------------
# Layout invariants
# ----------------------------------------------------------------------------------------------------------------


def test_forward_cost_is_unique_tokens_for_tree_and_path_tokens_for_paths():
    trees = [branching_tree(seed=s, prompt_len=4 + s) for s in range(3)]
    tree_packed = pack_trees(trees, PAD, layout="tree")
    path_packed = pack_trees(trees, PAD, layout="paths")
    for n, tree in enumerate(trees):
        assert int(tree_packed.valid[n].sum()) == tree.num_unique_tokens
        path_tokens = sum(
            len(tree.prompt_ids) + sum(len(tree.turns[i].action_ids) + len(tree.turns[i].observation_ids) for i in p)
            for p in leaf_paths(tree)
        )
        assert int(path_packed.valid[n].sum()) == path_tokens
    assert tree_packed.num_forward_tokens == sum(t.num_unique_tokens for t in trees)
    assert path_packed.num_forward_tokens < sum(t.num_path_tokens for t in trees)  # duplicates are not repeated


def test_each_unique_action_token_is_trained_exactly_once_in_both_layouts():
    tree = branching_tree()
    for layout in ("tree", "paths"):
        turn_ids = pack_trees([tree], PAD, layout=layout).turn_ids[0]
        counts = torch.bincount(turn_ids[turn_ids >= 0], minlength=tree.num_turns)
        assert counts.tolist() == [len(t.action_ids) for t in tree.turns]


def test_positions_restart_per_path_and_first_tokens_are_scored_from_the_parent():
    tree = branching_tree()
    packed = pack_trees([tree], PAD)
    positions, score, turn_ids = packed.position_ids[0, 0], packed.score_index[0, 0], packed.turn_ids[0, 0]
    ids = packed.input_ids[0, 0]
    first = {i: int((turn_ids == i).nonzero()[0]) for i in range(tree.num_turns)}

    def last_token(i):  # the parent's last token: its last observation token, or last action token without one
        if i < 0:
            return len(tree.prompt_ids) - 1
        return first[i] + len(tree.turns[i].action_ids) + len(tree.turns[i].observation_ids) - 1

    for i, turn in enumerate(tree.turns):
        assert int(score[first[i]]) == last_token(turn.parent)
        assert int(positions[first[i]]) == int(positions[last_token(turn.parent)]) + 1  # continues its history
        span = torch.arange(first[i], first[i] + len(turn.action_ids))
        assert ids[span].tolist() == turn.action_ids
        assert score[span[1:]].tolist() == (span[1:] - 1).tolist()
        siblings = tree.children_of(turn.parent) if turn.parent >= 0 else tree.roots
        assert len({int(positions[first[s]]) for s in siblings}) == 1
    # Every row of the paths layout is one path: positions are 0..valid-1.
    paths = pack_trees([tree], PAD, layout="paths")
    for r, length in enumerate(paths.valid[0].tolist()):
        assert paths.position_ids[0, r, :length].tolist() == list(range(length))
        assert paths.subtree_end[0, r, :length].tolist() == [length] * length


def test_padding_and_empty_rows_follow_the_conventions():
    trees = [branching_tree(seed=0), RolloutTree.from_trajectories([5, 6], [[random_turn(torch.Generator(), 2, 0)]], [1.0])]
    packed = pack_trees(trees, pad_token_id=7, layout="paths", pad_to_multiple_of=8)
    assert packed.input_ids.shape[-1] % 8 == 0 and packed.valid[1].tolist()[1:] == [0] * (packed.valid.shape[1] - 1)
    pad = torch.arange(packed.input_ids.shape[-1]) >= packed.valid[..., None]
    assert (packed.input_ids[pad] == 7).all() and (packed.position_ids[pad] == 0).all()
    assert (packed.turn_ids[pad] == -1).all() and (packed.score_index[pad] == -1).all()
    index = torch.arange(packed.input_ids.shape[-1]).expand_as(packed.subtree_end)
    assert (packed.subtree_end[pad] == index[pad] + 1).all()
    mask = dense_attention_mask(packed.subtree_end.flatten(0, 1), packed.valid.flatten())
    assert mask.any(-1).all()  # no fully masked query row


def test_to_dict_round_trip_and_device_move():
    packed = pack_trees([branching_tree()], PAD, layout="paths")
    d = packed.to_dict(prefix="tree_")
    assert all(k.startswith("tree_") and isinstance(v, torch.Tensor) and v.shape[0] == 1 for k, v in d.items())
    back = PackedTrees.from_dict({**d, "other": 1}, prefix="tree_").to("cpu")
    assert all(torch.equal(a, b) for a, b in zip(back.to_dict().values(), packed.to_dict().values()))


def test_rows_repad_to_the_same_batch():
    """`PackedTrees.row` strips a row's padding and `pad_rows` puts it back (empty rows too): the identity."""
    trees = [branching_tree(seed=0), RolloutTree.from_trajectories([5, 6], [[random_turn(torch.Generator(), 2, 0)]], [1.0])]
    for layout, multiple in (("paths", None), ("paths", 8), ("tree", None)):
        packed = pack_trees(trees, pad_token_id=7, layout=layout, pad_to_multiple_of=multiple)
        N, R = packed.valid.shape
        again = pad_rows([[packed.row(n, r) for r in range(R)] for n in range(N)], 7, multiple)
        assert all(torch.equal(a, b) for a, b in zip(again.to_dict().values(), packed.to_dict().values()))

# ----------------------------------------------------------------------------------------------------------------
# Wrapped models: the forward must go through the wrapper
# ----------------------------------------------------------------------------------------------------------------


class CountingWrapper(torch.nn.Module):
    """Stands in for DDP / DeepSpeed: `.module` holds the model, and only calls to the wrapper run its hooks."""

    def __init__(self, module):
        super().__init__()
        self.module = module
        self.calls = 0

    def forward(self, **kwargs):
        self.calls += 1
        return self.module(**kwargs)


def test_forward_goes_through_the_wrapper(sdpa_model):
    wrapper = CountingWrapper(sdpa_model)
    packed = pack_trees([branching_tree()], PAD)
    with torch.no_grad():
        got, _ = packed_token_logps(wrapper, packed)
        want, _ = packed_token_logps(sdpa_model, packed)
    assert wrapper.calls == 1
    torch.testing.assert_close(got, want, atol=0, rtol=0)


def test_peft_lora_model_matches_separate_paths():
    import peft  # a dependency of trl-tree
    model = tiny_model("sdpa")
    config = peft.LoraConfig(
        r=4, lora_alpha=8, target_modules=["q_proj", "v_proj", "lm_head"], init_lora_weights=False
    )
    lora = peft.get_peft_model(model, config)
    assert_matches_paths(lora, branching_tree(seed=4), "tree", chunk_size=6)


def test_ddp_gradients_match_and_every_parameter_is_reduced(tmp_path):
    """DDP (gloo, one process) raises on the next forward if a parameter missed the reduction of the last backward."""
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel

    if dist.is_initialized():
        pytest.skip("a process group is already initialised in this session")
    dist.init_process_group("gloo", init_method=f"file://{tmp_path}/store", rank=0, world_size=1)
    try:
        model = tiny_model("sdpa")
        ddp = DistributedDataParallel(model)
        tree = branching_tree(seed=6)
        packed = pack_trees([tree], PAD)
        for _ in range(2):
            ddp.zero_grad()
            logps, _ = packed_token_logps(ddp, packed)
            (logps * torch.linspace(-1, 1, logps.numel()).view_as(logps)).sum().backward()
        grads = [p.grad.clone() for p in model.parameters()]
        model.zero_grad()
        logps, _ = packed_token_logps(model, packed)
        (logps * torch.linspace(-1, 1, logps.numel()).view_as(logps)).sum().backward()
        for got, p in zip(grads, model.parameters()):
            torch.testing.assert_close(got, p.grad, atol=TOL, rtol=0)
    finally:
        dist.destroy_process_group()


# ----------------------------------------------------------------------------------------------------------------
# Masks and backends
# ----------------------------------------------------------------------------------------------------------------


def test_mask_encodes_ancestor_visibility():
    tree = branching_tree()
    packed = pack_trees([tree], PAD)
    mask = dense_attention_mask(packed.subtree_end[:, 0], packed.valid[:, 0])[0, 0]
    turn_ids = packed.turn_ids[0, 0]
    first = {i: int((turn_ids == i).nonzero()[0]) for i in range(tree.num_turns)}
    for i, turn in enumerate(tree.turns):
        seen = {first[j] for j in range(tree.num_turns) if mask[first[i], first[j]]}
        ancestors, node = set(), turn.parent
        while node >= 0:
            ancestors.add(first[node])
            node = tree.turns[node].parent
        assert seen == ancestors | {first[i]}
        assert mask[first[i], : len(tree.prompt_ids)].all()
    additive = additive_attention_mask(packed.subtree_end[:, 0], packed.valid[:, 0], torch.float32)[0, 0]
    assert torch.equal(additive == 0, mask) and (additive[~mask] == torch.finfo(torch.float32).min).all()


def test_block_mask_builds_and_agrees_with_the_dense_mask(sdpa_model):
    from torch.nn.attention.flex_attention import BlockMask, create_mask

    packed = pack_trees([branching_tree(seed=s) for s in range(2)], PAD)
    subtree_end, valid = packed.subtree_end[:, 0], packed.valid[:, 0]
    mask = block_mask(subtree_end, valid)
    assert isinstance(mask, BlockMask)
    length = subtree_end.shape[-1]
    dense = create_mask(mask.mask_mod, 2, 1, length, length, device="cpu")
    assert torch.equal(dense, dense_attention_mask(subtree_end, valid))


def test_flex_attention_forward_equals_dense_on_cpu(sdpa_model):
    packed = pack_trees([branching_tree(seed=s) for s in range(2)], PAD)
    with torch.no_grad():
        want, _ = packed_token_logps(sdpa_model, packed)
        sdpa_model.set_attn_implementation("flex_attention")
        try:  # the pinned torch runs flex_attention's forward on CPU: a failure here is a regression, not a skip
            got, _ = packed_token_logps(sdpa_model, packed)
        finally:
            sdpa_model.set_attn_implementation("sdpa")
    torch.testing.assert_close(got, want, atol=TOL, rtol=0)


# ----------------------------------------------------------------------------------------------------------------
# Bad input
# ----------------------------------------------------------------------------------------------------------------


def test_unknown_layout_is_rejected_with_the_valid_ones():
    with pytest.raises(ValueError, match="'tree'.*'paths'"):
        pack_trees([branching_tree()], PAD, layout="flat")


def test_attention_without_custom_masks_is_rejected_with_the_alternatives(sdpa_model):
    packed = pack_trees([branching_tree()], PAD)
    sdpa_model.config._attn_implementation = "flash_attention_2"
    try:
        with pytest.raises(ValueError, match=r'flash_attention_2.*layout="paths"'):
            packed_token_logps(sdpa_model, packed)
    finally:
        sdpa_model.set_attn_implementation("sdpa")


def test_token_weight_counts_projection_and_mlp_multiply_adds_per_attention_pair():
    # Qwen3-0.6B: q 16 × 128, kv 8 × 128, MLP 3072; per token 1024·2048 + 2·1024·1024 + 2048·1024 + 3·1024·3072
    # multiply-adds, per score pair 2 · 2048 (q·k and the weighted v)
    config = Qwen3Config(hidden_size=1024, intermediate_size=3072, num_attention_heads=16, num_key_value_heads=8,
                         head_dim=128)
    assert token_weight(config) == 15_728_640 / 4096
    assert token_weight(tiny_model().config) == (64 * 128 + 2 * 64 * 64 + 128 * 64 + 3 * 64 * 128) / 256


def _disjoint_long_trajectories(length: int) -> RolloutTree:
    """Four leaves that share only a 2-token prompt: nothing for the tree row to save, and a dense mask over 4L."""
    gen = torch.Generator().manual_seed(0)
    return RolloutTree.from_trajectories(random_ids(gen, 2), [[random_turn(gen, length, 0)] for _ in range(4)], [0.0] * 4)


def _long_shared_prompt(prompt_len: int) -> RolloutTree:
    """Six short leaves under one long prompt: the path rows forward the prompt six times."""
    gen = torch.Generator().manual_seed(0)
    return RolloutTree.from_trajectories(random_ids(gen, prompt_len), [[random_turn(gen, 4, 0)] for _ in range(6)], [0.0] * 6)


def test_forward_cost_is_the_same_for_a_single_path_in_both_layouts():
    gen = torch.Generator().manual_seed(0)
    tree = RolloutTree.from_trajectories(random_ids(gen, 5), [[random_turn(gen, 3, 2), random_turn(gen, 4, 0)]], [1.0])
    weight = token_weight(tiny_model().config)
    assert forward_cost(pack_trees([tree], PAD, "tree"), weight) == forward_cost(pack_trees([tree], PAD, "paths"), weight)


def test_auto_packing_picks_the_cheaper_layout_for_a_dense_mask(sdpa_model):
    weight = token_weight(sdpa_model.config)
    for tree, expected in ((_long_shared_prompt(400), "tree"), (_disjoint_long_trajectories(600), "paths")):
        costs = {layout: forward_cost(pack_trees([tree], PAD, layout), weight) for layout in ("tree", "paths")}
        assert min(costs, key=costs.get) == expected, costs
        rows = pack_cheapest([tree], PAD, sdpa_model.config).input_ids.shape[1]
        assert rows == (1 if expected == "tree" else len(leaf_paths(tree)))


def test_auto_packing_follows_the_attention_kernel(sdpa_model):
    tree = _disjoint_long_trajectories(600)  # paths are cheaper with a dense mask...
    try:
        for sparse in ("flex_attention", "tree_sdpa"):
            sdpa_model.config._attn_implementation = sparse
            # ...but flex_attention and tree_sdpa skip the masked pairs, so the tree row (unique tokens once) is kept
            assert pack_cheapest([tree], PAD, sdpa_model.config).input_ids.shape[1] == 1
        sdpa_model.config._attn_implementation = "flash_attention_2"  # no custom masks at all: path rows
        assert pack_cheapest([_long_shared_prompt(400)], PAD, sdpa_model.config).input_ids.shape[1] == 6
    finally:
        sdpa_model.set_attn_implementation("sdpa")


def test_empty_prompt_is_rejected():
    tree = RolloutTree.from_trajectories([], [[random_turn(torch.Generator(), 2, 0)]], [1.0])
    with pytest.raises(ValueError, match="empty prompt"):
        pack_trees([tree], PAD)
