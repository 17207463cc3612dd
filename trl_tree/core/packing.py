"""Packed forwards of rollout trees: a tree costs its unique tokens once (docs/design.md §6).

Layouts
-------
`pack_trees` turns N `RolloutTree`s into a `PackedTrees`: tensors of shape [N, R, T] (N trees, R rows per tree, T
tokens per row). Every tensor leads with the tree dimension because TRL splits and shuffles generation batches along
dim 0: a tree must stay one index so that its rows travel together.

- ``layout="tree"`` (R = 1): one row per tree holding its unique tokens in DFS order: the prompt, then every unique
  turn's action and observation tokens, a parent always before its children and every subtree contiguous. A merged
  (shared) turn appears once, so the row costs `tree.num_unique_tokens`.
- ``layout="paths"`` (R = the largest number of unique leaves in the batch): one plain causal row per unique
  root-to-leaf path, in DFS order of the leaves; trees with fewer leaves get fully padded rows. Shared prefixes are
  forwarded again in every row that contains them, but each unique action token is *trained* in one row only (the
  first, in DFS order, that contains its turn). This is the fallback for attention kernels without custom masks.
- `pack_cheapest` (the trainers' ``packing="auto"``) picks one of the two per batch from the cost of the forward:
  a dense-mask kernel pays all T² pairs of a tree row, so very long tree rows can cost more than their path rows.

Visibility rule
---------------
A token's context is exactly its root-to-leaf history. In DFS order the subtree of a node occupies the contiguous
index range [start, subtree_end), so key k is visible to query q iff ``k <= q < subtree_end[k]``: q comes at or after
k and still lies inside k's subtree, i.e. k's node is q's node (and k <= q within it) or one of q's ancestors. Prompt
tokens are ancestors of everything (their subtree ends at the row's valid length); a padding token sees only itself
(its subtree ends at its own index + 1), so no query row is fully masked and sdpa never produces NaNs. A path row is
the special case where every node's subtree runs to the row's end, i.e. plain causal attention, so such rows are
forwarded without a custom mask (any attention kernel; sdpa's causal fast path).

Position ids are positions in the token's own root-to-leaf path, so the rotary embedding sees what it would see on
the path alone. The log-prob of a node's first action token is read from the hidden state of its parent's last token
(`score_index`), every other token from the token before it.

The forward
-----------
`packed_token_logps` runs the model once on the rows (through the wrapper: DDP, DeepSpeed and PEFT hooks must fire),
captures the decoder's final hidden states with a forward hook, gathers the hidden states that score trained tokens
and projects only those through the output embedding, in checkpointed chunks so that the (trained tokens x vocab)
logits are never all alive for backward.
"""

from __future__ import annotations

from dataclasses import dataclass, fields

import torch
from torch import Tensor, nn
from torch.utils.checkpoint import checkpoint

from .tree import RolloutTree
from .tree_attention import TREE_SDPA, chain_attention_mask, tree_chains


@dataclass(frozen=True)
class Layout:
    """A way of packing trees into rows, declared once so that `pack_trees`, the configs' `packing` check and their
    messages all read the same list (`LAYOUTS`, `PACKING_CHOICES`)."""

    name: str
    doc: str


@dataclass(frozen=True)
class AttentionKernel:
    """What the packing needs to know about one attention implementation, declared once (`KERNELS`) so that the
    mask dispatch, the `auto` layout choice, the trainer's kernel switch and the error messages cannot disagree.

    Attributes:
        name: transformers' `attn_implementation` string.
        mask: the custom mask it takes for an ancestor-masked tree row: "dense" (boolean [B, 1, T, T]), "additive"
            (float [B, 1, T, T]), "block" (a flex_attention BlockMask) or "chains" (the rows' chains,
            `trl_tree.core.tree_attention`).
        sparse: computes only the visible pairs of a tree row, so the tree layout (unique tokens once) is never
            dearer than paths.
        tree_rows_with: the kernel that forwards tree rows faster and is otherwise this one (sdpa -> tree_sdpa);
            the trainer switches a policy to it when it forwards tree rows.
    """

    name: str
    mask: str
    sparse: bool = False
    tree_rows_with: str | None = None

    @property
    def chained(self) -> bool:
        """Needs the tree rows' chains passed down to every attention call instead of a [T, T] mask."""
        return self.mask == "chains"


KERNELS = {
    kernel.name: kernel
    for kernel in (
        AttentionKernel("sdpa", mask="dense", tree_rows_with=TREE_SDPA),
        AttentionKernel("eager", mask="additive"),
        AttentionKernel("flex_attention", mask="block", sparse=True),
        AttentionKernel(TREE_SDPA, mask="chains", sparse=True),
    )
}
TREE_LAYOUTS = {
    layout.name: layout
    for layout in (
        Layout("tree", "one ancestor-masked row per tree: unique tokens once"),
        Layout("paths", "one causal row per unique root-to-leaf path"),
    )
}
# "auto" is not a packing of its own: `pack_cheapest` picks one of the layouts per micro-batch
AUTO_LAYOUT = "auto"
LAYOUTS = tuple(TREE_LAYOUTS)
PACKING_CHOICES = (*LAYOUTS, AUTO_LAYOUT)
# Kernels that take the ancestor mask of a tree row
MASKED_IMPLEMENTATIONS = tuple(KERNELS)
# Kernels that compute only the visible pairs of a tree row, so that its unique tokens are never dearer than paths
SPARSE_IMPLEMENTATIONS = tuple(name for name, kernel in KERNELS.items() if kernel.sparse)


def kernel_for_tree_rows(attn_implementation: str | None) -> str | None:
    """The kernel a policy loaded with `attn_implementation` should be switched to when it forwards tree rows
    (sdpa -> tree_sdpa), or None to keep its own."""
    kernel = KERNELS.get(attn_implementation)
    return kernel.tree_rows_with if kernel else None



def attend_tree_rows_by_chains(model) -> None:
    """Switch a policy that forwards tree rows to its kernel for them (`kernel_for_tree_rows`): an sdpa policy then
    computes only the visible pairs of a tree row (tree_sdpa: chain by chain, no [T, T] mask), so the tree layout
    stays cheaper than path rows at any length. Every other forward (generation, causal rows) is transformers' sdpa
    itself, and the setting is not saved with the model (`trl_tree.core.tree_attention`)."""
    base = unwrap_model(model)
    kernel = kernel_for_tree_rows(getattr(base.config, "_attn_implementation", None))
    if kernel is not None:
        base.set_attn_implementation(kernel)

@dataclass
class PackedTrees:
    """N packed trees; every tensor is [N, R, T] except `valid` ([N, R]).

    Attributes:
        input_ids: token ids, `pad_token_id` after each row's valid length.
        position_ids: a token's position in its own root-to-leaf path (prompt 0..P-1; a turn continues from its
            parent's last position). 0 for padding.
        subtree_end: exclusive end, in the row, of the DFS subtree of the token's node. Key k is visible to query q
            iff k <= q < subtree_end[k]. Prompt tokens: the row's valid length; padding: own index + 1.
        score_index: for a trained token at t, the row position whose hidden state predicts it (t - 1 inside a node;
            the parent's last token for a turn's first action token); -1 for tokens that are not scored.
        turn_ids: index into the tree's `tree.turns` for trained action tokens; -1 for prompt, observation and
            padding tokens (and, in the "paths" layout, for action tokens already trained in an earlier row).
        valid: non-padding length of each row (0 for an empty row).
    """

    input_ids: Tensor
    position_ids: Tensor
    subtree_end: Tensor
    score_index: Tensor
    turn_ids: Tensor
    valid: Tensor

    @property
    def num_forward_tokens(self) -> int:
        """Tokens the forward actually processes (padding excluded): the cost of the packed forward."""
        return int(self.valid.sum())

    @property
    def num_trees(self) -> int:
        return self.input_ids.shape[0]

    def to_dict(self, prefix: str = "") -> dict[str, Tensor]:
        """A flat dict of tensors, e.g. to ride along in TRL's generation-batch dicts (split and shuffled on dim 0)."""
        return {prefix + f.name: getattr(self, f.name) for f in fields(self)}

    @classmethod
    def from_dict(cls, d: dict[str, Tensor], prefix: str = "") -> PackedTrees:
        """Inverse of `to_dict`; extra keys in `d` are ignored."""
        return cls(**{f.name: d[prefix + f.name] for f in fields(cls)})

    def to(self, device: torch.device | str) -> PackedTrees:
        return PackedTrees(**{f.name: getattr(self, f.name).to(device) for f in fields(self)})

    def row(self, n: int, r: int = 0) -> dict[str, Tensor]:
        """Row r of tree n without its padding, as the dict of 1-D views that `pad_rows` stacks."""
        size = int(self.valid[n, r])
        return {f.name: getattr(self, f.name)[n, r, :size] for f in fields(self) if f.name != "valid"}


# ----------------------------------------------------------------------------------------------------------------
# Packing
# ----------------------------------------------------------------------------------------------------------------


def pack_trees(
    trees: list[RolloutTree], pad_token_id: int, layout: str = "tree", pad_to_multiple_of: int | None = None
) -> PackedTrees:
    """Pack trees into [N, R, T] tensors (see the module docstring for the two layouts).

    Args:
        trees: N rollout trees (one per prompt).
        pad_token_id: id written into padding positions (never attended to by real tokens, never trained).
        layout: "tree" (one ancestor-masked row per tree: unique tokens once) or "paths" (one causal row per unique
            root-to-leaf path; each unique action token trained once).
        pad_to_multiple_of: round T up to a multiple of this (e.g. 128 for flex_attention's block size).

    Raises:
        ValueError: unknown layout, no trees, a missing pad token id, or a tree with an empty prompt (its first
            turns would have no position to be scored from).
    """
    if layout not in LAYOUTS:
        raise ValueError(f"Unknown packing layout {layout!r}; valid layouts are {', '.join(map(repr, LAYOUTS))}.")
    if not trees:
        raise ValueError("pack_trees needs at least one tree; got an empty list.")
    if pad_token_id is None:
        raise ValueError("pad_token_id is None: pass the tokenizer's pad id (or its eos id if it has no pad token).")
    for n, tree in enumerate(trees):
        if len(tree.prompt_ids) == 0:
            raise ValueError(
                f"Tree {n} has an empty prompt: a first turn's first token is scored from the prompt's last token, "
                "so the prompt needs at least one token (e.g. the chat template's assistant header)."
            )
    build = _tree_rows if layout == "tree" else _path_rows
    rows = [build(tree) for tree in trees]
    return pad_rows(rows, pad_token_id, pad_to_multiple_of)


def _tree_rows(tree: RolloutTree) -> list[dict[str, Tensor]]:
    """One row: every unique turn, in DFS order, under its own parent; all action tokens trained."""
    nodes = list(range(tree.num_turns))
    parents = [turn.parent for turn in tree.turns]
    return [_pack_row(tree, nodes, parents, trained=[True] * len(nodes))]


def _path_rows(tree: RolloutTree) -> list[dict[str, Tensor]]:
    """One causal row per unique leaf (DFS order); a turn is trained only in the first row that contains it."""
    seen: set[int] = set()
    rows = []
    for leaf in (i for i, turn in enumerate(tree.turns) if turn.is_leaf):
        path = _ancestors(tree, leaf)
        trained = [i not in seen for i in path]
        seen.update(path)
        rows.append(_pack_row(tree, path, parents=list(range(-1, len(path) - 1)), trained=trained))
    return rows


def _ancestors(tree: RolloutTree, node: int) -> list[int]:
    """Turn indices from the first turn down to `node`."""
    path = []
    while node >= 0:
        path.append(node)
        node = tree.turns[node].parent
    return path[::-1]


def _pack_row(tree: RolloutTree, nodes: list[int], parents: list[int], trained: list[bool]) -> dict[str, Tensor]:
    """Lay the prompt and `nodes` (turn indices, a parent before its children, subtrees contiguous) out as one row.

    `parents[j]` is the position in `nodes` of node j's parent (-1: the prompt). Per-node quantities are computed
    with short Python loops over nodes; per-token tensors are then expanded from them with `repeat_interleave`.
    Segment 0 is the prompt, segment j + 1 is nodes[j].
    """
    turns = [tree.turns[i] for i in nodes]
    lengths = [len(tree.prompt_ids)] + [len(t.action_ids) + len(t.observation_ids) for t in turns]
    num_trained = [0] + [len(t.action_ids) if keep else 0 for t, keep in zip(turns, trained)]
    seg_parent = [-1] + [p + 1 for p in parents]  # the prompt is segment 0
    starts = [0] * len(lengths)
    for s in range(1, len(lengths)):
        starts[s] = starts[s - 1] + lengths[s - 1]
    # A turn continues the positions of its parent; its first action token is scored from the parent's last token.
    first_position, parent_last = [0] * len(lengths), [-1] * len(lengths)
    for s in range(1, len(lengths)):
        p = seg_parent[s]
        first_position[s] = first_position[p] + lengths[p]
        parent_last[s] = starts[p] + lengths[p] - 1
    # Subtrees are contiguous, so a segment's subtree ends where its own tokens plus all descendants' tokens end.
    subtree_size = list(lengths)
    for s in range(len(lengths) - 1, 0, -1):
        subtree_size[seg_parent[s]] += subtree_size[s]
    subtree_end = [start + size for start, size in zip(starts, subtree_size)]

    segment = torch.repeat_interleave(torch.arange(len(lengths)), torch.tensor(lengths))
    index = torch.arange(segment.numel())
    offset = index - torch.tensor(starts)[segment]
    is_trained = offset < torch.tensor(num_trained)[segment]
    first_of_node = offset == 0
    score = torch.where(first_of_node, torch.tensor(parent_last)[segment], index - 1)
    ids = list(tree.prompt_ids)
    for turn in turns:
        ids += turn.action_ids + turn.observation_ids
    return {
        "input_ids": torch.tensor(ids, dtype=torch.long),
        "position_ids": torch.tensor(first_position)[segment] + offset,
        "subtree_end": torch.tensor(subtree_end)[segment],
        "score_index": torch.where(is_trained, score, -1),
        "turn_ids": torch.where(is_trained, torch.tensor([-1] + nodes)[segment], -1),
    }


def pad_rows(
    rows: list[list[dict[str, Tensor]]], pad_token_id: int, pad_to_multiple_of: int | None = None
) -> PackedTrees:
    """Stack ragged rows into [N, R, T]; padding follows the conventions of `PackedTrees`.

    `rows[n]` holds the rows of tree n, each a dict of 1-D tensors of one length keyed by the [N, R, T] fields of
    `PackedTrees` (as `PackedTrees.row` returns them); R is the most rows of any tree, and a tree with fewer gets empty
    rows (valid 0). T is the longest row, rounded up to a multiple of `pad_to_multiple_of`. Shared by `pack_trees` and
    by layouts built from its rows (TreeFlex's `pack_groups`), so the padding convention lives in one place.
    """
    num_rows = max(len(tree_rows) for tree_rows in rows)
    length = max(row["input_ids"].numel() for tree_rows in rows for row in tree_rows)
    if pad_to_multiple_of:
        length = -(-length // pad_to_multiple_of) * pad_to_multiple_of
    shape = (len(rows), num_rows, length)
    out = {
        "input_ids": torch.full(shape, pad_token_id, dtype=torch.long),
        "position_ids": torch.zeros(shape, dtype=torch.long),
        "subtree_end": (torch.arange(length) + 1).expand(shape).clone(),
        "score_index": torch.full(shape, -1, dtype=torch.long),
        "turn_ids": torch.full(shape, -1, dtype=torch.long),
    }
    valid = torch.zeros(shape[:2], dtype=torch.long)
    for n, tree_rows in enumerate(rows):
        for r, row in enumerate(tree_rows):
            size = row["input_ids"].numel()
            valid[n, r] = size
            for name, tensor in row.items():
                out[name][n, r, :size] = tensor
    return PackedTrees(**out, valid=valid)


# ----------------------------------------------------------------------------------------------------------------
# Attention masks
# ----------------------------------------------------------------------------------------------------------------


def _padding_sees_itself(subtree_end: Tensor, valid: Tensor | None) -> Tensor:
    """Force the padding convention (own index + 1) past `valid`, whatever the caller stored there."""
    if valid is None:
        return subtree_end
    index = torch.arange(subtree_end.shape[-1], device=subtree_end.device)
    return torch.where(index < valid[:, None], subtree_end, index + 1)


def dense_attention_mask(subtree_end: Tensor, valid: Tensor | None = None) -> Tensor:
    """Boolean [B, 1, T, T] mask (True = attend) for `sdpa`: key k visible to query q iff k <= q < subtree_end[k].

    Args:
        subtree_end: [B, T] rows of `PackedTrees.subtree_end`.
        valid: [B] valid lengths; positions past them are treated as padding (they see only themselves).
    """
    subtree_end = _padding_sees_itself(subtree_end, valid)
    query = torch.arange(subtree_end.shape[-1], device=subtree_end.device)[:, None]
    return (query < subtree_end[:, None, :]).tril_()[:, None]  # tril: key <= query (one [T, T] pass, in place)


def additive_attention_mask(
    subtree_end: Tensor, valid: Tensor | None = None, dtype: torch.dtype = torch.float32
) -> Tensor:
    """Float [B, 1, T, T] mask (0 = attend, dtype-min = masked) for `eager`.

    Eager attention *adds* the mask to the scores, so a boolean mask would add 1/0 and silently attend everywhere.
    """
    allowed = dense_attention_mask(subtree_end, valid)
    return torch.zeros(allowed.shape, dtype=dtype, device=allowed.device).masked_fill(~allowed, torch.finfo(dtype).min)


def block_mask(subtree_end: Tensor, valid: Tensor | None = None, block_size: int = 128):
    """A flex_attention `BlockMask` with mask_mod (kv <= q) & (q < subtree_end[b, kv]).

    Only the block-sparse summary is built, from the DFS intervals (`ancestor_blocks`), never the [T, T] mask that
    `create_block_mask` would evaluate first: the GPU path for long trees. Blocks that lie entirely outside every
    ancestor chain are skipped by the kernel; blocks where every pair is visible skip the mask_mod.
    """
    from torch.nn.attention.flex_attention import BlockMask

    subtree_end = _padding_sees_itself(subtree_end, valid)

    def ancestor_mask(b, h, q_idx, kv_idx):
        return (kv_idx <= q_idx) & (q_idx < subtree_end[b, kv_idx])

    length = subtree_end.shape[-1]
    partial, full = ancestor_blocks(subtree_end, block_size)
    return BlockMask.from_kv_blocks(
        *_ordered_blocks(partial), *_ordered_blocks(full), BLOCK_SIZE=block_size, mask_mod=ancestor_mask,
        seq_lengths=(length, length),
    )


def ancestor_blocks(subtree_end: Tensor, block_size: int) -> tuple[Tensor, Tensor]:
    """Which (query block, key block) pairs hold some but not all visible pairs (`partial`), or only visible pairs
    (`full`): bool [B, 1, n, n] with n = ceil(T / block_size), in O(B·n² + B·T) instead of the O(B·T²) mask.

    Key k is visible to query q iff q ∈ [k, subtree_end[k]). For key block j strictly before query block i (every key
    precedes every query), some pair is visible iff max(subtree_end over block j) > the first query of block i, and
    every pair iff min(subtree_end over block j) ≥ the end of block i. A diagonal block always holds a visible pair
    (k = q) and never only visible ones (k > q is masked); key blocks after the query block hold none. Positions past
    T (rounding T up to a multiple of `block_size`) count as masked, as in `create_block_mask`, so a truncated last
    block is never full.
    """
    if block_size < 2:
        raise ValueError(f"block_size must be at least 2; got {block_size}.")
    batch, length = subtree_end.shape
    n = -(-length // block_size)
    ends = nn.functional.pad(subtree_end, (0, n * block_size - length), value=0).view(batch, n, block_size)
    max_end, min_end = ends.amax(-1), ends.amin(-1)  # [B, n] over each key block; padded keys: 0
    block = torch.arange(n, device=subtree_end.device)
    first_query = (block * block_size)[None, :, None]  # [1, n (query block), 1]
    stop_query = first_query + block_size
    before = (block[None, :] < block[:, None])[None]  # [1, n (query), n (key)]: key block before the query block
    some = (before & (max_end[:, None, :] > first_query)) | torch.eye(n, dtype=torch.bool, device=block.device)
    full = before & (min_end[:, None, :] >= stop_query)
    return (some & ~full)[:, None], full[:, None]


def _ordered_blocks(blocks: Tensor) -> tuple[Tensor, Tensor]:
    """(number of marked key blocks, key block indices with the marked ones first) per query block, as BlockMask
    takes them."""
    blocks = blocks.to(torch.int32)
    indices = torch.argsort(blocks, dim=-1, descending=True, stable=True)
    return blocks.sum(-1).to(torch.int32), indices.to(torch.int32)


def attention_mask_for(attn_implementation: str | None, subtree_end: Tensor, valid: Tensor, dtype: torch.dtype):
    """The 4D mask that `attn_implementation` understands, or a ValueError if it cannot take a custom mask."""
    kernel = KERNELS.get(attn_implementation)
    if kernel is not None and kernel.mask == "dense":
        return dense_attention_mask(subtree_end, valid)
    if kernel is not None and kernel.mask == "additive":
        return additive_attention_mask(subtree_end, valid, dtype)
    if kernel is not None and kernel.mask == "block":
        return block_mask(subtree_end, valid)
    raise ValueError(
        f"Attention implementation {attn_implementation!r} cannot take the tree (ancestor) attention mask. Load the "
        f"model with attn_implementation in {MASKED_IMPLEMENTATIONS} (flex_attention is the fast GPU path, tree_sdpa "
        'the fast path elsewhere), or pack with layout="paths", which only needs causal attention (packing="paths" '
        'or "auto" in the tree configs).'
    )


def attention_inputs(attn_implementation: str | None, subtree_end: Tensor, valid: Tensor, dtype: torch.dtype) -> dict:
    """The forward kwargs that make rows of ancestor-masked trees attend correctly: for tree_sdpa the rows' chains
    (`trl_tree.core.tree_attention`, which transformers hands down to every attention call) with its placeholder mask,
    otherwise the mask the kernel understands (`attention_mask_for`)."""
    kernel = KERNELS.get(attn_implementation)
    if kernel is not None and kernel.chained:
        return {"attention_mask": chain_attention_mask(len(valid), subtree_end.device),
                "tree_chains": tree_chains(subtree_end, valid)}
    return {"attention_mask": attention_mask_for(attn_implementation, subtree_end, valid, dtype)}


# ----------------------------------------------------------------------------------------------------------------
# Choosing the layout from the cost of the forward
# ----------------------------------------------------------------------------------------------------------------


def token_weight(config) -> float:
    """Multiply-adds of one token through a decoder layer's projections and MLP, in units of one attention score
    pair (q·k and the weighted v: 2 × the query width).

    Attention with a dense mask (sdpa, eager) computes all T² pairs of a tree row, whereas causal path rows cost about
    half of each row's L², for shorter L; the projections and MLP cost the same per token in both layouts. This
    weight is their exchange rate (checked against the CPU timings of the packing benchmark: benchmarks/README.md,
    section 4). Read from a transformers config (gated MLP; GQA through `num_key_value_heads`).
    """
    hidden = config.hidden_size
    heads = config.num_attention_heads
    head_dim = getattr(config, "head_dim", None) or hidden // heads
    q_width = heads * head_dim
    kv_width = (getattr(config, "num_key_value_heads", None) or heads) * head_dim
    intermediate = getattr(config, "intermediate_size", None) or 4 * hidden
    per_token = hidden * q_width + 2 * hidden * kv_width + q_width * hidden + 3 * hidden * intermediate
    return per_token / (2 * q_width)


def forward_cost(packed: PackedTrees, weight: float) -> float:
    """Relative cost of `packed_token_logps` on `packed` with a dense-mask kernel: `weight` per forwarded token plus
    one per attention score pair. It mirrors the forward: empty rows skipped, rows cut to the widest valid row, plain
    causal rows scoring T(T + 1)/2 pairs, ancestor-masked rows all T²."""
    valid = packed.valid.reshape(-1)
    kept = valid > 0
    rows, width = int(kept.sum()), int(valid.max())
    subtree_end = packed.subtree_end.reshape(valid.numel(), -1)[kept, :width]
    pairs = width * (width + 1) / 2 if _rows_are_causal(subtree_end, valid[kept]) else width * width
    return rows * (weight * width + pairs)


def pack_cheapest(
    trees: list[RolloutTree], pad_token_id: int, config, pad_to_multiple_of: int | None = None
) -> PackedTrees:
    """Pack `trees` in the layout whose forward costs less for a model with this `config` (`packing="auto"`).

    flex_attention and tree_sdpa compute only the visible pairs, so the tree row (unique tokens once) is never
    dearer: "tree". A kernel that takes no custom mask (flash-attention): "paths". A dense-mask kernel (sdpa,
    eager) pays every T² pair of a tree row, so a long tree row can cost more than its causal path rows although it
    forwards fewer tokens (benchmarks/README.md, section 2); both packings are built (cheap next to the forward)
    and the one with the smaller `forward_cost` is kept. Either layout gives the same log-probs and trains each
    token once.
    """
    attention = getattr(config, "_attn_implementation", None)
    if attention in SPARSE_IMPLEMENTATIONS:
        return pack_trees(trees, pad_token_id, "tree", pad_to_multiple_of)
    if attention not in MASKED_IMPLEMENTATIONS:
        return pack_trees(trees, pad_token_id, "paths", pad_to_multiple_of)
    tree = pack_trees(trees, pad_token_id, "tree", pad_to_multiple_of)
    paths = pack_trees(trees, pad_token_id, "paths", pad_to_multiple_of)
    weight = token_weight(config)
    return tree if forward_cost(tree, weight) <= forward_cost(paths, weight) else paths


# ----------------------------------------------------------------------------------------------------------------
# The forward
# ----------------------------------------------------------------------------------------------------------------


def _rows_are_causal(subtree_end: Tensor, valid: Tensor) -> bool:
    """Whether every valid token's subtree ends at its row's valid length, i.e. the ancestor mask is the causal one."""
    index = torch.arange(subtree_end.shape[-1], device=subtree_end.device)
    return bool(((subtree_end == valid[:, None]) | (index >= valid[:, None])).all())


def unwrap_model(model: nn.Module) -> nn.Module:
    """The transformers model under DDP / DeepSpeed / FSDP1 (`.module`), torch.compile (`_orig_mod`) and PEFT."""
    while True:
        if isinstance(getattr(model, "module", None), nn.Module):
            model = model.module
        elif isinstance(getattr(model, "_orig_mod", None), nn.Module):
            model = model._orig_mod
        elif hasattr(model, "get_base_model"):
            model = model.get_base_model()
        else:
            return model


def _score_chunk(head: nn.Module, hidden: Tensor, targets: Tensor, temperature: float, compute_entropy: bool):
    """Log-prob of `targets` (and entropy) under head(hidden) / temperature, in float32, or in float64 for a float64
    model (the golden record every machine checks trains one: tests/test_golden_training.py)."""
    logits = head(hidden)
    logits = logits.to(torch.promote_types(logits.dtype, torch.float32)) / temperature
    log_normalizer = logits.logsumexp(-1)
    logps = logits.gather(-1, targets[:, None]).squeeze(-1) - log_normalizer
    if not compute_entropy:
        return logps, logps.new_empty(0)
    entropy = log_normalizer - (logits.softmax(-1) * logits).sum(-1)
    return logps, entropy


def _score(head: nn.Module, hidden: Tensor, targets: Tensor, temperature: float, compute_entropy: bool, chunk: int):
    """Project `hidden` chunk by chunk; with grad enabled each chunk is recomputed in backward (checkpoint).

    Without the checkpoint, autograd would keep every chunk's float32 logits alive until backward: (trained tokens x
    vocab) floats, often larger than the whole model's activations.
    """
    logps, entropies = [], []
    # At least one (possibly empty) chunk: with nothing to score (every turn masked, e.g. all truncated) the empty
    # result still hangs off the head and the forward, so the loss is a zero with a grad_fn, as GRPO's masked loss.
    for start in range(0, max(hidden.shape[0], 1), chunk):
        args = (head, hidden[start : start + chunk], targets[start : start + chunk], temperature, compute_entropy)
        if torch.is_grad_enabled():
            # nothing in a chunk is random: no generator state to replay (the replay would rewind the global
            # generator under a rollout worker sampling from it, trl_tree.asynchronous.random_state)
            lp, ent = checkpoint(_score_chunk, *args, use_reentrant=False, preserve_rng_state=False)
        else:
            lp, ent = _score_chunk(*args)
        logps.append(lp)
        entropies.append(ent)
    return torch.cat(logps), torch.cat(entropies)


def _forward_hidden(model: nn.Module, base: nn.Module, input_ids: Tensor, position_ids: Tensor, **attention) -> Tensor:
    """Final hidden states [B, T, H] of the decoder, from a forward that goes through `model` (the wrapper).

    Only the last position's logits are computed by the model itself (logits_to_keep=1); the rest are projected by
    the caller at the positions that score trained tokens.
    """
    captured = {}

    def keep_hidden(module, args, output):
        captured["hidden"] = output.last_hidden_state if hasattr(output, "last_hidden_state") else output[0]

    handle = base.get_decoder().register_forward_hook(keep_hidden)
    try:
        model(input_ids=input_ids, position_ids=position_ids, use_cache=False, logits_to_keep=1, **attention)
    finally:
        handle.remove()
    return captured["hidden"]


def packed_token_logps(
    model: nn.Module,
    packed: PackedTrees,
    *,
    temperature: float = 1.0,
    compute_entropy: bool = False,
    chunk_size: int = 1024,
) -> tuple[Tensor, Tensor | None]:
    """Per-token log-probs (and entropies) of the trained tokens of `packed`, in one forward of its rows.

    Args:
        model: a causal LM, possibly wrapped (DDP, DeepSpeed, PEFT): the forward is called through the wrapper so
            that gradient sync and ZeRO-3 parameter gathering happen.
        packed: from `pack_trees`, on the model's device.
        temperature: logits are divided by it before the softmax (as in TRL).
        compute_entropy: also return the entropy of the full (tempered) distribution at each trained token.
        chunk_size: number of scored positions projected to the vocabulary at a time.

    Returns:
        logps [N, R, T] and entropy [N, R, T] (or None), float32 (float64 for a float64 model), zero where
        `packed.turn_ids == -1`. Both carry gradients when grad is enabled; detach the entropy if it only selects or
        weights tokens.

    Raises:
        ValueError: the model's attention implementation cannot take a custom mask (use layout="paths" or
            sdpa / eager / flex_attention).
    """
    base = unwrap_model(model)
    num_trees, num_rows, length = packed.input_ids.shape
    input_ids, position_ids, subtree_end, score_index, turn_ids = (
        getattr(packed, name).reshape(num_trees * num_rows, length)
        for name in ("input_ids", "position_ids", "subtree_end", "score_index", "turn_ids")
    )
    valid = packed.valid.reshape(-1)
    kept = valid > 0  # fully padded rows (short trees in the "paths" layout) are not forwarded
    width = int(valid.max())  # TRL's splits can leave trailing padding shared by every row
    if _rows_are_causal(subtree_end[kept, :width], valid[kept]):
        # Every node's subtree runs to its row's end (the "paths" layout, or trees that are single paths): plain causal
        # attention, which every kernel runs without a [T, T] mask (sdpa's is_causal, flash-attention). Positions are
        # then the row index; letting them run on over the padding keeps transformers from reading the padding as
        # further packed sequences (which would build a full mask again).
        attention = {"attention_mask": None}
        positions = torch.arange(width, device=input_ids.device).expand(int(kept.sum()), width)
    else:
        implementation = base.config._attn_implementation
        attention = attention_inputs(implementation, subtree_end[kept, :width], valid[kept], base.dtype)
        positions = position_ids[kept, :width]
    hidden = _forward_hidden(model, base, input_ids[kept, :width], positions, **attention)

    row, col = (turn_ids >= 0).nonzero(as_tuple=True)
    scoring = hidden[kept.long().cumsum(0)[row] - 1, score_index[row, col]]  # row index among the kept rows
    head = base.get_output_embeddings()
    logps, entropy = _score(head, scoring, input_ids[row, col], temperature, compute_entropy, chunk_size)

    def scatter(values: Tensor) -> Tensor:
        full = values.new_zeros(num_trees * num_rows, length)
        return full.index_put((row, col), values).reshape(num_trees, num_rows, length)

    return scatter(logps), scatter(entropy) if compute_entropy else None
