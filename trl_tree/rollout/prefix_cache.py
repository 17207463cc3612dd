"""Keys and values computed once per rollout: a turn's `generate` call reuses the KV of the sequences earlier calls
of the same rollout already processed (docs/design.md §5).

A tree's branches share their histories: turn t+1 of a branch continues the very sequence turn t generated, and a
branch grown from an anchor's turn prefix continues a prefix of the anchor's sequence. Plain `model.generate`
prefills every prefix from its first token at every call, so on CPU a multi-turn rollout spends most of its time
re-encoding histories it has already encoded. `PrefixKVStore` keeps, for every row of every call, the KV of the
tokens that row holds (its prefix and the turn it generated); the next call finds for each prefix the stored row
sharing its longest common prefix and prefills only the rest.

Layout of a call with reuse (one row per prefix, left-aligned padding as usual):

    cache columns:  [ pad … | reused KV of the row's first k tokens ]     width L = max k
    input columns:  [ pad … | the row's first k ids | pad … | the row's other tokens ]

The attention mask is 0 on both pads, so a row may have a hole in the middle; `generate` derives position ids from
the mask's cumulative sum, so every real token keeps the position it has in an unpadded sequence. Keys and values
depend only on a token's own prefix and position, so the reused ones equal those a full prefill would compute (up to
floating-point summation order: sampled ids are the same but for near-ties).

The store is valid for one set of weights: callers empty it when a rollout ends (`HFEngine.rollout`). It holds
each live sequence once (a row that a later row extends is dropped), i.e. about as much memory as one batched
`generate` over the same sequences.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

# Reusing fewer tokens than this is not worth a row of padding in the cache (a pad column costs attention, not MLP).
MIN_REUSE = 8


@dataclass
class _Entry:
    tokens: np.ndarray  # the token ids whose KV is stored, in order
    keys: list[torch.Tensor]  # per layer: [kv_heads, len(tokens), head_dim]
    values: list[torch.Tensor]


@dataclass
class ReusePlan:
    """One call's inputs: the cache of the reused tokens and the ids / mask to give `generate` (each row's reused
    tokens in the cache's columns, which `generate` skips, then its tokens not covered by the cache). `cache` is None only in a plain layout (`left_padded`);
    with reuse it is always a cache the caller owns, which `generate` extends in place and `store` then reads (a model
    whose config says `use_cache=False` does not return it)."""

    cache: object | None
    input_ids: torch.Tensor
    attention_mask: torch.Tensor
    reused: list[int]  # tokens of each prefix whose KV came from the store


def left_padded(prefixes: list[list[int]], pad_id: int) -> ReusePlan:
    """The plain layout of a call that reuses nothing: every prefix whole, left-padded."""
    return PrefixKVStore()._plan(prefixes, pad_id, config=None)


def supports_reuse(model) -> bool:
    """Whether `model`'s default cache is a plain `DynamicCache` of full-attention layers, the only layout whose
    per-row KV can be cut out and spliced back (sliding-window, linear-attention or custom caches cannot)."""
    base = model.get_base_model() if callable(getattr(model, "get_base_model", None)) else model
    config = getattr(base, "config", None)
    if config is None or getattr(config, "is_encoder_decoder", False):
        return False
    if not getattr(base, "_supports_default_dynamic_cache", lambda: False)():
        return False
    from transformers import DynamicCache
    from transformers.cache_utils import DynamicLayer

    try:
        cache = DynamicCache(config=config)
    except (KeyError, ValueError, TypeError, NotImplementedError):
        return False
    return all(type(layer) is DynamicLayer for layer in cache.layers)


def _common_prefix(a: np.ndarray, b: np.ndarray) -> int:
    n = min(len(a), len(b))
    if n == 0:
        return 0
    differ = a[:n] != b[:n]
    return int(differ.argmax()) if differ.any() else n


class PrefixKVStore:
    """The KV of every sequence the current rollout's calls have processed, reused by the calls that continue them.

    Args:
        min_reuse: a prefix reuses a stored row only if they share at least this many tokens.
    """

    def __init__(self, min_reuse: int = MIN_REUSE):
        self.min_reuse = min_reuse
        self.entries: list[_Entry] = []
        self.reused_tokens = 0  # prefill tokens saved since the last clear (for benchmarks and tests)
        self.prefilled_tokens = 0

    def clear(self) -> None:
        self.entries = []
        self.reused_tokens = self.prefilled_tokens = 0

    def _best(self, prefix: np.ndarray) -> tuple[_Entry | None, int]:
        best, best_len = None, 0
        for entry in self.entries:
            n = _common_prefix(entry.tokens, prefix)
            if n > best_len:
                best, best_len = entry, n
        # at least one token is left to prefill: the next token's logits come from the last prefix token's forward
        best_len = min(best_len, len(prefix) - 1)
        return (best, best_len) if best_len >= self.min_reuse else (None, 0)

    def plan(self, prefixes: list[list[int]], pad_id: int, model) -> ReusePlan:
        """The cache of each prefix's longest stored prefix, and the ids left to prefill, for one `generate` call.

        Heads that several prefixes of the call share beyond what is stored (a system prompt on the first turn, the
        prompt of a tree's M trajectories) are encoded first, once each (`_encode_shared_heads`); so are long tails
        in a call where most rows have almost nothing to prefill (`_encode_uneven_tails`)."""
        self._encode_shared_heads(prefixes, pad_id, model)
        self._encode_uneven_tails(prefixes, pad_id, model)
        plan = self._plan(prefixes, pad_id, model.config)
        if plan.cache is None:  # an empty cache of our own: `generate` fills it in place, whatever it returns
            from transformers import DynamicCache

            plan.cache = DynamicCache(config=model.config)
        return plan

    def _encode_shared_heads(self, prefixes: list[list[int]], pad_id: int, model) -> None:
        """Store the KV of every longest head that two prefixes of the call share and no stored row covers: one
        forward, batch = distinct heads, itself reusing what is stored. Sorting the prefixes puts each one next to
        the prefix it shares most with, so the neighbours' common prefixes are every row's longest shared head."""
        arrays = [np.asarray(p, dtype=np.int64) for p in prefixes]
        order = sorted(range(len(prefixes)), key=lambda i: prefixes[i])
        shared = [0] * len(prefixes)
        for a, b in zip(order, order[1:]):
            n = _common_prefix(arrays[a], arrays[b])
            shared[a], shared[b] = max(shared[a], n), max(shared[b], n)
        heads: dict[tuple[int, ...], None] = {}
        for i, prefix in enumerate(prefixes):
            n = min(shared[i], len(prefix) - 1)
            if n >= self.min_reuse and self._best(arrays[i])[1] < n:
                heads.setdefault(tuple(prefix[:n]), None)
        if heads:
            self._encode([list(h) for h in heads], pad_id, model)

    def _encode_uneven_tails(self, prefixes: list[list[int]], pad_id: int, model) -> None:
        """`generate` prefills every row as wide as the longest tail, so a call that mixes rows resuming a turn (one
        token to prefill: chunked generation, `TurnLoop.step`) with rows starting one after an observation (hundreds)
        would pay the long tail for every row. When the rows with more than `min_reuse` tokens to prefill are at most
        half of the call, their prefixes (but their last token) are encoded first, in a forward of their own."""
        tails = [len(p) - self._best(np.asarray(p, dtype=np.int64))[1] for p in prefixes]
        long = [p[:-1] for p, tail in zip(prefixes, tails) if tail > self.min_reuse]
        if long and 2 * len(long) <= len(prefixes):
            self._encode(long, pad_id, model)

    def _encode(self, heads: list[list[int]], pad_id: int, model) -> None:
        """Store the KV of `heads` (each reusing what is stored): one forward, batch = heads."""
        from transformers import DynamicCache

        plan = self._plan(heads, pad_id, model.config)
        cache = plan.cache if plan.cache is not None else DynamicCache(config=model.config)
        mask = plan.attention_mask.to(model.device)
        cached = max(plan.reused)  # unlike `generate`, a forward does not skip the cache's columns
        with torch.no_grad():
            model(input_ids=plan.input_ids[:, cached:].to(model.device), attention_mask=mask,
                  position_ids=(mask.cumsum(-1) - 1).clamp(min=0)[:, cached:], use_cache=True, logits_to_keep=1,
                  cache=cache)
        self.store(cache, plan.attention_mask, heads, [[] for _ in heads])

    def _plan(self, prefixes: list[list[int]], pad_id: int, config) -> ReusePlan:
        arrays = [np.asarray(p, dtype=np.int64) for p in prefixes]
        matches = [self._best(a) for a in arrays]
        reused = [k for _, k in matches]
        width = max(reused)
        rest = max(len(p) - k for p, k in zip(prefixes, reused))
        input_ids = torch.full((len(prefixes), width + rest), pad_id, dtype=torch.long)
        attention_mask = torch.zeros_like(input_ids)
        for row, (prefix, k) in enumerate(zip(prefixes, reused)):
            tail = prefix[k:]
            input_ids[row, width + rest - len(tail) :] = torch.tensor(tail, dtype=torch.long)
            attention_mask[row, width + rest - len(tail) :] = 1
            if k:  # the reused tokens' own ids (`generate` skips them; a patched `generate` reads the whole prefix)
                input_ids[row, width - k : width] = torch.tensor(prefix[:k], dtype=torch.long)
                attention_mask[row, width - k : width] = 1
        self.reused_tokens += sum(reused)
        self.prefilled_tokens += sum(len(p) - k for p, k in zip(prefixes, reused))
        if width == 0:
            return ReusePlan(None, input_ids, attention_mask, reused)
        from transformers import DynamicCache

        reference = next(entry for entry, _ in matches if entry is not None)
        layers = []
        for layer, (k0, v0) in enumerate(zip(reference.keys, reference.values)):
            keys = k0.new_zeros(len(prefixes), k0.shape[0], width, k0.shape[-1])
            values = v0.new_zeros(len(prefixes), v0.shape[0], width, v0.shape[-1])
            for row, (entry, k) in enumerate(matches):
                if entry is not None:
                    keys[row, :, width - k :] = entry.keys[layer][:, :k]
                    values[row, :, width - k :] = entry.values[layer][:, :k]
            layers.append((keys, values))
        return ReusePlan(DynamicCache(ddp_cache_data=layers, config=config), input_ids, attention_mask, reused)

    def store(self, cache, attention_mask: torch.Tensor, prefixes: list[list[int]], new_ids: list[list[int]]) -> None:
        """Keep each row's KV after a call: its prefix and the tokens it generated (`new_ids`, cut at its end of
        turn). `cache` is the plan's cache after the call and `attention_mask` the mask the call was given; the last
        generated token never went through the model, so its KV is not there."""
        width = attention_mask.shape[1]
        if cache.get_seq_length() < width:  # `generate` did not run on this cache (patched, e.g. scripted in tests)
            self.entries = []
            return
        generated_columns = cache.get_seq_length() - width
        fresh = []
        for row, (prefix, new) in enumerate(zip(prefixes, new_ids)):
            kept = min(len(new), generated_columns)
            columns = torch.cat([attention_mask[row].nonzero().flatten(), torch.arange(width, width + kept)])
            columns = columns.to(cache.layers[0].keys.device)
            fresh.append(
                _Entry(
                    tokens=np.asarray(list(prefix) + list(new[:kept]), dtype=np.int64),
                    keys=[layer.keys[row].index_select(1, columns) for layer in cache.layers],
                    values=[layer.values[row].index_select(1, columns) for layer in cache.layers],
                )
            )
        self._add(fresh)

    def _add(self, fresh: list[_Entry]) -> None:
        """Add the new rows; drop every row (old or new) whose tokens another row extends: its KV is a prefix of
        that row's, so no future prefix matches it better."""
        pool = self.entries + fresh
        by_length = sorted(range(len(pool)), key=lambda i: -len(pool[i].tokens))
        kept: list[int] = []
        for i in by_length:
            tokens = pool[i].tokens
            if not any(_common_prefix(pool[j].tokens, tokens) == len(tokens) for j in kept):
                kept.append(i)
        self.entries = [pool[i] for i in sorted(kept)]
