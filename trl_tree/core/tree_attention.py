"""Tree rows on sdpa without the [T, T] mask: each chain of a packed tree row attends to its ancestors and itself.

Why: a tree row (`packing="tree"`) holds every unique token once, but sdpa with a dense ancestor mask computes all
T² score pairs of the row, most of them masked (a branch never sees its siblings), so past a few thousand tokens per
row the tree lost to its causal path rows on CPU (benchmarks/README.md, section 2). flex_attention skips the masked
blocks on a GPU; this module is the same saving for any sdpa kernel (CPU, or a GPU without flex).

A *chain* is a maximal run of consecutive row positions with the same `subtree_end` (docs/design.md §6): each of its
tokens is the parent of the next, so the chain is a piece of one root-to-leaf path. Because the DFS intervals nest, a
key k before the chain's start s is visible to every query of the chain iff it is visible to s (``subtree_end[k] >
s``): the chain's ancestors. So the row's attention is, chain by chain, one ordinary sdpa call whose queries are the
chain and whose keys are its ancestors' positions (all visible) followed by the chain itself (causal). The pairs
computed are exactly the visible ones (plus the masked upper triangle of each chain's own block), every query is
computed once, and no [T, T] tensor exists.

Usage: the tree trainers switch an sdpa policy to it (`TreeConfig.packing`); elsewhere, ``import
trl_tree.core.tree_attention`` (which registers the name with transformers; `trl_tree.core.packing` imports it) and load the
model with ``attn_implementation="tree_sdpa"`` or call ``model.set_attn_implementation("tree_sdpa")``. Every other
forward (generation, GRPO-style rows, a causal path row) is transformers' own sdpa, unchanged: only a forward that
passes the chains (`packing.packed_token_logps` on a tree row) takes the chain route.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor
from transformers import AttentionInterface, AttentionMaskInterface
from transformers.integrations.sdpa_attention import repeat_kv, sdpa_attention_forward
from transformers.masking_utils import sdpa_mask

TREE_SDPA = "tree_sdpa"


@dataclass(frozen=True)
class Chain:
    """One chain of a row: queries `start:stop`, keys `keys` (ancestors, then the chain), and the boolean mask
    [stop - start, len(keys)] (None when the chain has no ancestors: plain causal attention)."""

    start: int
    stop: int
    keys: Tensor
    mask: Tensor | None


@dataclass(frozen=True)
class TreeChains:
    """The chains of every row of a packed forward ([B, T] rows), computed once and shared by all layers.

    Positions past a row's valid length belong to no chain; their attention output is zero (they score nothing).
    """

    rows: list[list[Chain]]
    length: int
    key_index: list[Tensor]  # per row, its chains' `keys` concatenated: one gather serves the whole row

    @property
    def num_pairs(self) -> int:
        """Query-key pairs the chain route computes (each chain's full block, masked upper triangle included)."""
        return sum((c.stop - c.start) * len(c.keys) for row in self.rows for c in row)


def tree_chains(subtree_end: Tensor, valid: Tensor) -> TreeChains:
    """Split packed rows ([B, T] `subtree_end`, [B] valid lengths) into chains (see the module docstring)."""
    rows, masks = [], {}
    for ends, length in zip(subtree_end, valid.tolist(), strict=True):
        ends, chains = ends[:length], []
        if length == 0:
            rows.append(chains)
            continue
        starts = torch.cat([ends.new_zeros(1), (ends[1:] != ends[:-1]).nonzero().flatten() + 1]).tolist()
        for start, stop in zip(starts, starts[1:] + [length], strict=True):
            ancestors = (ends[:start] > start).nonzero().flatten()
            own = torch.arange(start, stop, device=ends.device)
            key = (stop - start, len(ancestors))
            if key[1] and key not in masks:
                causal = torch.ones(key[0], key[0], dtype=torch.bool, device=ends.device).tril()
                masks[key] = torch.cat([causal.new_ones(key[0], key[1]), causal], dim=1)
            chains.append(Chain(start, stop, torch.cat([ancestors, own]), masks.get(key) if key[1] else None))
        rows.append(chains)
    key_index = [torch.cat([c.keys for c in chains]) if chains else subtree_end.new_zeros(0) for chains in rows]
    return TreeChains(rows, subtree_end.shape[-1], key_index)


def chain_attention_mask(batch: int, device: torch.device | str) -> Tensor:
    """The `attention_mask` to pass with `tree_chains`: an empty 4D tensor, which transformers hands to the attention
    function as it is (no mask of its own is built) and which no other kernel could mistake for a real mask."""
    return torch.empty(batch, 1, 0, 0, dtype=torch.bool, device=device)


def tree_sdpa_attention(
    module: torch.nn.Module,
    query: Tensor,
    key: Tensor,
    value: Tensor,
    attention_mask: Tensor | None,
    dropout: float = 0.0,
    scaling: float | None = None,
    tree_chains: TreeChains | None = None,
    **kwargs,
) -> tuple[Tensor, None]:
    """transformers' attention-function signature: query [B, H, T, D], key / value [B, H_kv, T, D] → [B, T, H, D].

    With `tree_chains` (passed as a forward kwarg, which transformers hands down to every attention call) the rows
    are attended chain by chain; without it this is transformers' sdpa.
    """
    if tree_chains is None:
        if attention_mask is not None and attention_mask.numel() == 0:
            raise ValueError(
                "This forward was given the tree-chain placeholder mask but no `tree_chains`: the model did not pass "
                "its forward kwargs down to attention. Load it with attn_implementation='sdpa' and pack with "
                "packing='paths' (or 'auto')."
            )
        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout, scaling, **kwargs)
    for unsupported in ("sliding_window", "softcap"):
        if kwargs.get(unsupported) is not None:
            raise ValueError(
                f"tree_sdpa does not implement {unsupported} attention. Use attn_implementation='flex_attention' or "
                "'sdpa' with packing='paths'."
            )
    groups = getattr(module, "num_key_value_groups", 1)
    dropout = dropout if module.training else 0.0
    heads, length, dim = query.shape[1], tree_chains.length, value.shape[-1]
    # One gather and one split per row rather than an index per chain: the backward of an indexing op allocates a
    # gradient of its whole input's size, so per-chain indexing allocated (and summed) a row-sized buffer per chain.
    rows = []
    for chains, queries, keys, values, index in zip(
        tree_chains.rows, query.unbind(0), key.unbind(0), value.unbind(0), tree_chains.key_index, strict=True
    ):
        stop = chains[-1].stop if chains else 0
        *query_pieces, _padding = queries.split([c.stop - c.start for c in chains] + [length - stop], dim=1)
        sizes = [len(c.keys) for c in chains]
        # gathered on the KV heads, then repeated for their query heads: the keys of a row are gathered once
        key_pieces = _repeat_heads(keys.index_select(1, index), groups).split(sizes, dim=1)
        value_pieces = _repeat_heads(values.index_select(1, index), groups).split(sizes, dim=1)
        pieces = [
            torch.nn.functional.scaled_dot_product_attention(
                q, k, v, attn_mask=c.mask, dropout_p=dropout, is_causal=c.mask is None, scale=scaling
            )
            for c, q, k, v in zip(chains, query_pieces, key_pieces, value_pieces, strict=True)
        ]
        # padding positions score nothing; their zeros take sdpa's output dtype (the autocast dtype under mixed
        # precision, where a Qwen3-style q/k norm hands float32 queries to a bf16 forward), so that no row is
        # promoted to float32 by its padding and every row has the dtype of transformers' sdpa on the path route
        pieces.append(query.new_zeros(heads, length - stop, dim, dtype=_output_dtype(query)))
        rows.append(torch.cat(pieces, dim=1))
    return torch.stack(rows).transpose(1, 2).contiguous(), None


def _output_dtype(query: Tensor) -> torch.dtype:
    """The dtype sdpa returns for `query`: the autocast dtype when autocast is on for its device (sdpa is one of
    autocast's lower-precision ops, which casts float32 and half inputs, never float64), else the query's own."""
    device = query.device.type
    if query.dtype in (torch.float32, torch.float16, torch.bfloat16) and torch.is_autocast_enabled(device):
        return torch.get_autocast_dtype(device)
    return query.dtype


def _repeat_heads(states: Tensor, groups: int) -> Tensor:
    """[H_kv, K, D] → [H_kv * groups, K, D], each KV head repeated for its query heads (transformers' repeat_kv)."""
    return repeat_kv(states.unsqueeze(0), groups).squeeze(0)


def register() -> None:
    """Make ``attn_implementation="tree_sdpa"`` known to transformers (idempotent); its masks are sdpa's."""
    AttentionInterface.register(TREE_SDPA, tree_sdpa_attention)
    AttentionMaskInterface.register(TREE_SDPA, sdpa_mask)


register()
