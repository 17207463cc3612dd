"""tree_sdpa (`trl_tree.core.tree_attention`): a tree row attended chain by chain computes exactly the visible pairs of the
ancestor mask, and nothing else about the model changes."""

import pytest
import torch

from tests.scripted import arithmetic_dataset, config, contains_answer, tiny
from tests.trees import PAD, branching_tree, tiny_model
from trl_tree import RolloutTree, TreeOPSDConfig, TreeOPSDTrainer, Turn
from trl_tree.core.packing import dense_attention_mask, pack_trees, packed_token_logps
from trl_tree.core.tree_attention import TREE_SDPA, chain_attention_mask, tree_chains
from trl_tree.testing import calculator


def _packed_rows(trees, layout="tree", pad_to_multiple_of=None):
    packed = pack_trees(trees, PAD, layout=layout, pad_to_multiple_of=pad_to_multiple_of)
    return packed.subtree_end.flatten(0, 1), packed.valid.flatten()


def test_chains_cover_each_valid_position_once_and_attend_exactly_the_visible_keys():
    trees = [branching_tree(seed=s, prompt_len=p) for s, p in [(0, 3), (1, 11), (2, 7)]]
    subtree_end, valid = _packed_rows(trees, pad_to_multiple_of=16)
    dense = dense_attention_mask(subtree_end, valid)[:, 0]
    chains = tree_chains(subtree_end, valid)
    for b, row in enumerate(chains.rows):
        covered = [q for chain in row for q in range(chain.start, chain.stop)]
        assert covered == list(range(int(valid[b])))  # in order, no gaps, no padding
        for chain in row:
            mask = chain.mask if chain.mask is not None else torch.ones(len(chain.keys), len(chain.keys)).tril().bool()
            queries = torch.arange(chain.start, chain.stop)
            # the chain's block is the dense mask restricted to its queries and keys...
            assert torch.equal(mask, dense[b][queries][:, chain.keys])
            # ...and holds every key any of its queries may see
            assert torch.equal(mask.sum(1), dense[b][queries].sum(1))


def test_chain_pairs_are_fewer_than_the_dense_row_and_the_causal_path_rows():
    tree = branching_tree(seed=1)
    subtree_end, valid = _packed_rows([tree])
    path_lengths = _packed_rows([tree], layout="paths")[1]
    pairs = tree_chains(subtree_end, valid).num_pairs
    assert pairs < int(valid[0]) ** 2
    assert pairs < sum(n * n for n in path_lengths.tolist())


def test_an_empty_row_has_no_chains():
    subtree_end, valid = _packed_rows([branching_tree()])
    chains = tree_chains(torch.cat([subtree_end, subtree_end]), torch.tensor([0, int(valid[0])]))
    assert chains.rows[0] == [] and chains.rows[1]


def test_a_path_row_is_one_chain_without_a_mask():
    gen = torch.Generator().manual_seed(0)
    ids = lambda n: torch.randint(1, 100, (n,), generator=gen).tolist()  # noqa: E731
    tree = RolloutTree.from_trajectories(ids(4), [[Turn(ids(3), [0.0] * 3, ids(2)), Turn(ids(2), [0.0] * 2)]], [1.0])
    (chain,) = tree_chains(*_packed_rows([tree])).rows[0]
    assert (chain.start, chain.stop, chain.mask) == (0, tree.num_unique_tokens, None)


def test_every_forward_without_chains_is_sdpa_itself():
    """Generation and plain (padded, causal) forwards give sdpa's results: switching a policy to tree_sdpa changes
    only the packed tree rows."""
    sdpa, chained = tiny_model("sdpa"), tiny_model(TREE_SDPA)
    ids = torch.tensor([[PAD, PAD, 5, 6, 7], [1, 2, 3, 4, 5]])
    mask = (ids != PAD).long()
    with torch.no_grad():
        torch.testing.assert_close(chained(ids, attention_mask=mask).logits, sdpa(ids, attention_mask=mask).logits,
                                   atol=0, rtol=0)  # fmt: skip
        kwargs = dict(attention_mask=mask, max_new_tokens=6, do_sample=False, pad_token_id=PAD)
        assert torch.equal(chained.generate(ids, **kwargs), sdpa.generate(ids, **kwargs))


def test_under_autocast_the_chain_route_returns_the_dtype_and_values_of_sdpa_with_the_dense_mask():
    """bf16 autocast with a Qwen3-style q/k norm hands float32 queries and keys and bf16 values to attention (issue
    59): every row, padded ones included, must come back in sdpa's dtype (bf16), as the path route's would."""
    from types import SimpleNamespace

    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    from trl_tree.core.tree_attention import tree_sdpa_attention

    subtree_end, valid = _packed_rows([branching_tree(seed=0, prompt_len=3), branching_tree(seed=1, prompt_len=11)])
    assert int(valid.min()) < subtree_end.shape[1]  # a row with padding, whose zeros once promoted it to float32
    gen = torch.Generator().manual_seed(0)
    batch, length = subtree_end.shape
    query = torch.randn(batch, 4, length, 8, generator=gen)
    key, value = torch.randn(batch, 2, length, 8, generator=gen), torch.randn(batch, 2, length, 8, generator=gen)
    module = SimpleNamespace(num_key_value_groups=2, training=False, is_causal=True)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        chained, _ = tree_sdpa_attention(module, query, key, value.bfloat16(), chain_attention_mask(batch, "cpu"),
                                         tree_chains=tree_chains(subtree_end, valid))  # fmt: skip
        dense_mask = dense_attention_mask(subtree_end, valid)
        dense, _ = sdpa_attention_forward(module, query, key, value.bfloat16(), dense_mask)
    assert chained.dtype == dense.dtype == torch.bfloat16
    for row, n in enumerate(valid.tolist()):
        torch.testing.assert_close(chained[row, :n], dense[row, :n], atol=2e-2, rtol=2e-2)
        assert not chained[row, n:].any()


def test_gradient_checkpointing_recomputes_the_chains():
    """Train mode with gradient checkpointing: the recomputed layers see the same chains (same log-probs and
    gradients as without checkpointing)."""
    tree = branching_tree(seed=2)
    packed = pack_trees([tree], PAD)
    results = []
    for checkpointing in (False, True):
        model = tiny_model(TREE_SDPA).train()
        if checkpointing:
            model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        logps, _ = packed_token_logps(model, packed)
        grads = torch.autograd.grad(logps.sum(), [p for p in model.parameters() if p.requires_grad])
        results.append((logps.detach(), grads))
    torch.testing.assert_close(results[0][0], results[1][0], atol=1e-6, rtol=0)
    for plain, recomputed in zip(results[0][1], results[1][1], strict=True):
        torch.testing.assert_close(plain, recomputed, atol=1e-6, rtol=0)


def test_the_placeholder_mask_without_chains_is_an_error_not_a_wrong_mask():
    model = tiny_model(TREE_SDPA)
    ids = torch.tensor([[1, 2, 3]])
    with pytest.raises(ValueError, match="tree_chains.*packing='paths'"):
        model(ids, attention_mask=chain_attention_mask(1, "cpu"))


def test_sliding_window_models_are_refused_on_the_chain_route():
    model = tiny_model(TREE_SDPA)
    for layer in model.model.layers:
        layer.self_attn.sliding_window = 4
    with pytest.raises(ValueError, match="sliding_window"):
        packed_token_logps(model, pack_trees([branching_tree()], PAD))


@pytest.mark.parametrize(("packing", "expected"), [("tree", TREE_SDPA), ("auto", TREE_SDPA), ("paths", "sdpa")])
def test_tree_trainers_attend_an_sdpa_policy_by_chains_when_they_pack_trees(tmp_path, packing, expected):
    model, tok = tiny()
    args = config(TreeOPSDConfig, tmp_path, packing=packing)
    TreeOPSDTrainer(model=model, reward_funcs=contains_answer, args=args, train_dataset=arithmetic_dataset(4),
                    processing_class=tok, tools=[calculator])  # fmt: skip
    assert model.config._attn_implementation == expected
    model.save_pretrained(tmp_path / "saved")  # the switch is the trainer's, not the checkpoint's
    assert TREE_SDPA not in (tmp_path / "saved" / "config.json").read_text()
